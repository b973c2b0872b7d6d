//! The idem component in a Wasmtime store the embedder owns
//! (`idem::embed`): bindings generated here from `wit/`, as an outside
//! host would generate them, and no imports but `embed::add_to_linker`.

// wasmtime's own error type, which its API returns (not anyhow's).
use wasmtime::{Result, bail};

use idem::embed::{self, IdemCtx};
use idem::{FaultKind, ManualClock, MemoryStore, RecordKey, Status};
use wasmtime::component::{Component, Linker};
use wasmtime::{Engine, Store};

mod outside {
    wasmtime::component::bindgen!({ path: "wit", world: "idem" });
}

use outside::exports::idem::engine::engine::{
    BeginRequest, BodyKind, Completion, Decision, EngineError,
};
use outside::idem::engine::types::{
    self as wit, ExpiredLease, FailureMode, InProgressMode, KeyCharset, KeyFormat, Policy,
};

/// An embedder's store data: idem's context beside state of its own.
struct HostData {
    idem: IdemCtx,
    requests_served: u32,
}

fn policy() -> Policy {
    Policy {
        retention_ms: 86_400_000,
        lease_ms: 30_000,
        retry_after_ms: 1_000,
        expired_lease: ExpiredLease::TakeOver,
        outcome_unknown: ExpiredLease::Manual,
        failure_mode: FailureMode::HonorDisposition,
        max_attempts: None,
        in_progress: InProgressMode::Reject,
        fingerprint_fields: Vec::new(),
        key_format: KeyFormat {
            min_length: 1,
            max_length: 255,
            charset: KeyCharset::PrintableAscii,
        },
        max_body_bytes: 1 << 20,
    }
}

fn begin(key: &str, body: &str) -> BeginRequest {
    BeginRequest {
        key: wit::RecordKey {
            scope: "tenant-1".into(),
            biz_type: "order.create".into(),
            idem_key: key.into(),
        },
        attributes: vec![("method".into(), "POST".into())],
        body_kind: BodyKind::Json,
        body: body.as_bytes().to_vec(),
        policy: policy(),
    }
}

/// A fresh store and instance over `storage`, linked only through
/// `embed::add_to_linker`.
fn instance(
    engine: &Engine,
    storage: &MemoryStore,
    clock: &ManualClock,
) -> Result<(Store<HostData>, outside::Idem)> {
    let mut linker = Linker::<HostData>::new(engine);
    embed::add_to_linker(&mut linker, |data| &mut data.idem)?;
    let component = Component::new(engine, idem::engine::DEFAULT_GUEST)?;
    let ctx = IdemCtx::builder()
        .storage(storage.clone())
        .clock(clock.clone())
        .build()?;
    let mut store = Store::new(
        engine,
        HostData {
            idem: ctx,
            requests_served: 0,
        },
    );
    let idem = outside::Idem::instantiate(&mut store, &component, &linker)?;
    Ok((store, idem))
}

#[test]
fn an_embedder_runs_execute_complete_replay_and_mismatch_in_its_own_store() -> Result<()> {
    let engine = Engine::default();
    let storage = MemoryStore::new();
    let clock = ManualClock::new(1_000_000);
    let (mut store, idem) = instance(&engine, &storage, &clock)?;
    let guest = idem.idem_engine_engine();

    let first = begin("k-1", r#"{"sku":"A1","qty":2}"#);
    let ticket = match guest.call_begin(&mut store, &first)? {
        Ok(Decision::Execute(ticket)) => ticket,
        other => bail!("a new key must execute, got {other:?}"),
    };
    store.data_mut().requests_served += 1;
    let success = wit::Success {
        result_ref: Some("order-1001".into()),
        response: None,
    };
    let done = guest.call_complete(&mut store, &ticket, &first.policy, &success)?;
    assert!(
        matches!(done, Ok(Completion::Recorded(wit::Status::Succeeded))),
        "{done:?}"
    );

    // The same request with its keys in another order: the canonical
    // fingerprint matches, and the stored result comes back.
    clock.advance(5);
    let retry = begin("k-1", r#"{"qty":2,"sku":"A1"}"#);
    match guest.call_begin(&mut store, &retry)? {
        Ok(Decision::Replay(replayed)) => {
            assert_eq!(replayed.result_ref.as_deref(), Some("order-1001"));
        }
        other => bail!("a completed key must replay, got {other:?}"),
    }
    match guest.call_begin(&mut store, &begin("k-1", r#"{"sku":"B2","qty":2}"#))? {
        Ok(Decision::Mismatch(_)) => {}
        other => bail!("another body under the key must mismatch, got {other:?}"),
    }
    assert_eq!(store.data().requests_served, 1);

    // The record is in the embedder's storage, as idem's own engine sees it.
    let records = storage.snapshot();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].status, Status::Succeeded);
    assert_eq!(
        records[0].key,
        RecordKey::new("tenant-1", "order.create", "k-1")
    );
    assert_eq!(records[0].created_at, 1_000_000);
    let engine = idem::Engine::builder().storage(storage.clone()).build()?;
    let status = engine.inspect(&records[0].key)?;
    assert!(status.is_some(), "the engine reads the embedder's record");
    Ok(())
}

#[test]
fn a_store_failure_reaches_the_guest_as_its_error_not_a_trap() -> Result<()> {
    let engine = Engine::default();
    let storage = MemoryStore::new();
    let clock = ManualClock::new(1_000_000);
    let (mut store, idem) = instance(&engine, &storage, &clock)?;
    let guest = idem.idem_engine_engine();

    storage.fail_next(None, 1, FaultKind::Unavailable);
    match guest.call_begin(&mut store, &begin("k-2", "{}"))? {
        Err(EngineError::Store(_)) => {}
        other => bail!("a store outage must be a store error, got {other:?}"),
    }
    assert!(
        storage.is_empty(),
        "nothing is written when the store fails"
    );
    // The instance is still usable: the next call executes.
    match guest.call_begin(&mut store, &begin("k-2", "{}"))? {
        Ok(Decision::Execute(_)) => Ok(()),
        other => bail!("after the outage the key must execute, got {other:?}"),
    }
}

#[test]
fn a_context_without_storage_is_refused() {
    let err = IdemCtx::builder().build().err();
    assert_eq!(err, Some(embed::CtxError::NoStorage));
}
