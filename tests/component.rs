//! The shipped component itself: what it imports and how loading fails.

use anyhow::{Result, bail, ensure};
use idem::{Engine, Error, MemoryStore};

#[test]
fn component_imports_only_idem_interfaces() -> Result<()> {
    let engine = Engine::builder().storage(MemoryStore::new()).build()?;
    let imports = engine.component_imports();
    ensure!(!imports.is_empty());
    for name in &imports {
        ensure!(
            name.starts_with("idem:engine/"),
            "the guest imports {name}, which is not idem's own"
        );
    }
    for wanted in ["store", "clock", "results"] {
        ensure!(
            imports
                .iter()
                .any(|n| n.starts_with(&format!("idem:engine/{wanted}@"))),
            "missing import {wanted}: {imports:?}"
        );
    }
    Ok(())
}

#[test]
fn loading_bytes_that_are_not_a_component_fails_at_build() -> Result<()> {
    match Engine::builder()
        .storage(MemoryStore::new())
        .guest_bytes(b"\0asm not really".to_vec())
        .build()
    {
        Err(Error::Load(msg)) => ensure!(!msg.is_empty()),
        Err(other) => bail!("expected a load error, got {other}"),
        Ok(_) => bail!("garbage must not load"),
    }
    Ok(())
}

#[test]
fn loading_a_missing_file_names_the_file() -> Result<()> {
    match Engine::builder().guest_file("/nonexistent/idem.wasm") {
        Err(Error::Load(msg)) => ensure!(msg.contains("/nonexistent/idem.wasm"), "{msg}"),
        Err(other) => bail!("{other}"),
        Ok(_) => bail!("a missing file must not load"),
    }
    Ok(())
}

/// A guest that runs out of memory traps mid-call: the caller gets a trap
/// error, nothing is written, and the next call runs on a fresh instance.
#[test]
fn a_call_over_the_memory_limit_writes_nothing_and_the_next_call_works() -> Result<()> {
    use idem::{BeginRequest, Decision, Policy, RecordKey, Storage, StoredResponse, Success};

    let store = MemoryStore::new();
    let engine = Engine::builder()
        .storage(store.clone())
        .memory_limit(4 * 1024 * 1024)
        .build()?;
    let big = RecordKey::new("tenant-1", "order.create", "big");
    let req = BeginRequest::raw(big.clone(), "x", Policy::default());
    let Decision::Execute(t) = engine.begin(&req)? else {
        bail!("a new key executes");
    };
    // A stored response larger than the guest may hold in memory.
    let huge = Success {
        result_ref: Some("order-1".into()),
        response: Some(StoredResponse {
            status: 200,
            headers: vec![],
            body: vec![b'x'; 1024 * 1024],
        }),
    };
    ensure!(
        engine.complete(&t, &req.policy, &huge)?
            == idem::Completion::Recorded(idem::Status::Succeeded)
    );
    let mut rec = store.get(&big)?.expect("record");
    let before = rec.clone();
    rec.response.as_mut().expect("response").body = vec![b'x'; 8 * 1024 * 1024];
    rec.revision += 1;
    ensure!(store.compare_and_swap(before.revision, &rec)? == idem::SwapOutcome::Swapped);
    let stored = store.snapshot();
    match engine.begin(&req) {
        Err(Error::MemoryLimit { limit, requested }) => {
            ensure!(limit == 4 * 1024 * 1024 && requested > limit)
        }
        other => bail!("expected the memory limit, got {other:?}"),
    }
    ensure!(store.snapshot() == stored, "a trap writes nothing");
    let small = BeginRequest::raw(
        RecordKey::new("tenant-1", "order.create", "small"),
        "x",
        Policy::default(),
    );
    ensure!(
        matches!(engine.begin(&small)?, Decision::Execute(_)),
        "a fresh instance serves the next call"
    );
    Ok(())
}

/// Without a result lookup, reconcile cannot tell whether an action took
/// effect: it refuses, and writes nothing (no key taken over and put back
/// under a new fencing token).
#[test]
fn reconcile_without_a_lookup_refuses_and_changes_nothing() -> Result<()> {
    let store = MemoryStore::new();
    let clock = idem::ManualClock::new(1_767_225_600_000);
    let engine = Engine::builder()
        .storage(store.clone())
        .clock(clock.clone())
        .build()?;
    let policy = idem::Policy::default();
    let req = idem::BeginRequest::json(
        idem::RecordKey::new("tenant-1", "order.create", "k"),
        "{}",
        policy.clone(),
    );
    ensure!(matches!(engine.begin(&req)?, idem::Decision::Execute(_)));
    clock.advance(policy.lease_ms);
    let before = store.snapshot();
    match engine.reconcile("order.create", &policy, 10) {
        Err(Error::NoLookup) => {}
        other => bail!("expected NoLookup, got {other:?}"),
    }
    match engine.spawn_reconciler(
        vec![("order.create".into(), policy.clone())],
        std::time::Duration::from_millis(1),
        std::num::NonZeroU32::MIN,
    ) {
        Err(Error::NoLookup) => {}
        other => bail!("expected NoLookup, got {other:?}"),
    }
    ensure!(store.snapshot() == before, "nothing was written");
    // A limit of 0 only checks the policy, as the layer does at start.
    ensure!(engine.reconcile("order.create", &policy, 0)?.examined == 0);
    Ok(())
}

/// `reconcile` reads `list-stale` a bounded page at a time, each after the
/// last record of the one before: however high its limit, no one listing
/// copies more than a page of records into the guest, and each record is
/// listed once.
#[test]
fn reconcile_lists_stale_records_a_bounded_page_at_a_time() -> Result<()> {
    use idem::store::Op;
    let store = MemoryStore::new();
    let clock = idem::ManualClock::new(1_767_225_600_000);
    let engine = Engine::builder()
        .storage(store.clone())
        .clock(clock.clone())
        .results(|_: &idem::RecordKey| Ok::<Option<String>, idem::StoreError>(None))
        .build()?;
    let policy = idem::Policy::default();
    // The guest's page (`MAX_STALE_PAGE`) is 100 records.
    let crashed = 201;
    for i in 0..crashed {
        let req = idem::BeginRequest::json(
            idem::RecordKey::new("tenant-1", "order.create", format!("k{i}")),
            "{}",
            policy.clone(),
        );
        ensure!(matches!(engine.begin(&req)?, idem::Decision::Execute(_)));
        clock.advance(1);
    }
    clock.advance(policy.lease_ms);
    let before = store.calls(Op::ListStale);
    let report = engine.reconcile("order.create", &policy, u32::MAX)?;
    ensure!(
        (report.examined, report.released) == (crashed, crashed),
        "{report:?}"
    );
    // Pages of 100, 100 and 1: the last, short, ends the run (a page of
    // 101 or more would take two listings).
    let listings = store.calls(Op::ListStale) - before;
    ensure!(listings == 3, "{listings} listings");
    Ok(())
}
