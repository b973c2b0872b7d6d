//! A store written by the version-1 engine, read by the current one.
//!
//! `tests/fixtures/v1-store.sqlite` was written by the engine before
//! fingerprint version 2 (see `tests/fixtures/README.md`). Its records carry
//! version-1 fingerprints; the current engine must replay their retries and
//! refuse other requests, exactly as the version-1 engine did.

use anyhow::{Context, Result, bail};
use idem::{
    BeginRequest, Decision, Engine, ManualClock, Policy, RecordKey, SqliteOptions, SqliteStore,
    Storage,
};
use sha2::{Digest, Sha256};

/// The fixture's clock: the time its records were written at.
const WRITTEN_AT: u64 = 1_767_225_600_000;

fn key(idem_key: &str) -> RecordKey {
    RecordKey::new("tenant-1", "order.create", idem_key)
}

/// A copy of the fixture (the test never changes the committed file) and
/// an engine over it, at the fixture's time plus `later_ms`.
fn open(dir: &tempfile::TempDir, later_ms: u64) -> Result<(Engine, SqliteStore)> {
    let path = dir.path().join("v1-store.sqlite");
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/v1-store.sqlite"
    );
    std::fs::copy(fixture, &path).context("copy the fixture")?;
    let store = SqliteStore::open(&path, SqliteOptions::default())?;
    let engine = Engine::builder()
        .storage(store.clone())
        .clock(ManualClock::new(WRITTEN_AT + later_ms))
        .build()?;
    Ok((engine, store))
}

/// Version 1 as `guest/src/fingerprint.rs` documents it, computed here.
fn v1(attributes: &[(&str, &str)], raw: bool, form: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(b"idem-fp/1\x00");
    h.update(
        u32::try_from(attributes.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    for (name, value) in attributes {
        for part in [name, value] {
            h.update(u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
            h.update(part.as_bytes());
        }
    }
    h.update([if raw { b'R' } else { b'J' }]);
    h.update((form.len() as u64).to_be_bytes());
    h.update(form);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn replayed_ref(decision: Decision) -> Result<String> {
    match decision {
        Decision::Replay(r) => r.result_ref.context("no result ref"),
        other => bail!("expected a replay, got {}", other.name()),
    }
}

#[test]
fn the_fixture_holds_version_1_records() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (_, store) = open(&dir, 0)?;
    let http = [("method", "POST"), ("path", "/v1/orders")];
    for (k, attributes, raw, form) in [
        ("json-1", &[][..], false, &br#"{"qty":2,"sku":"A1"}"#[..]),
        (
            "amount-1",
            &[],
            false,
            br#"{"amount":100,"currency":"EUR"}"#,
        ),
        // Version 1 rounded 2^53+1 to 2^53.
        ("account-1", &[], false, br#"{"account":9007199254740992}"#),
        ("fields-1", &[], false, br#"{"/amount":5}"#),
        ("raw-1", &[], true, b"\xff\x00raw"),
        ("http-1", &http[..], false, br#"{"n":1.5}"#),
        ("running-1", &[], false, br#"{"sku":"B2"}"#),
    ] {
        let rec = store
            .get(&key(k))?
            .with_context(|| format!("{k} is in the fixture"))?;
        assert_eq!(rec.fingerprint_version, 1, "{k}");
        assert_eq!(rec.fingerprint, v1(attributes, raw, form), "{k}");
    }
    Ok(())
}

#[test]
fn retries_of_version_1_requests_replay() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (engine, store) = open(&dir, 1_000)?;
    let p = Policy::default();
    // Respelled: other key order, spacing and number spelling.
    let d = engine.begin(&BeginRequest::json(
        key("json-1"),
        r#"{ "qty": 2.0, "sku": "A1" }"#,
        p.clone(),
    ))?;
    assert_eq!(replayed_ref(d)?, "order-1");
    let d = engine.begin(&BeginRequest::json(
        key("amount-1"),
        r#"{"currency":"EUR","amount":1e2}"#,
        p.clone(),
    ))?;
    assert_eq!(replayed_ref(d)?, "order-2");
    let mut fields = p.clone();
    fields.fingerprint_fields = vec!["/amount".into()];
    let d = engine.begin(&BeginRequest::json(
        key("fields-1"),
        r#"{"amount":5,"ts":"2026-06-30T00:00:00Z"}"#,
        fields,
    ))?;
    assert_eq!(replayed_ref(d)?, "order-4");
    let d = engine.begin(&BeginRequest::raw(
        key("raw-1"),
        b"\xff\x00raw".to_vec(),
        p.clone(),
    ))?;
    assert_eq!(replayed_ref(d)?, "order-5");
    let mut http = BeginRequest::json(key("http-1"), r#"{"n":1.5}"#, p.clone());
    http.attributes = vec![
        ("method".into(), "POST".into()),
        ("path".into(), "/v1/orders".into()),
    ];
    let d = engine.begin(&http)?;
    match d {
        Decision::Replay(r) => {
            let response = r.response.context("the stored response")?;
            assert_eq!(response.status, 201);
            assert_eq!(response.body, br#"{"order":"order-6"}"#);
        }
        other => bail!("expected a replay, got {}", other.name()),
    }
    // The record keeps its version: nothing was rewritten.
    assert_eq!(
        store
            .get(&key("json-1"))?
            .context("json-1")?
            .fingerprint_version,
        1
    );
    Ok(())
}

#[test]
fn other_requests_on_version_1_keys_mismatch() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (engine, _) = open(&dir, 1_000)?;
    let p = Policy::default();
    for (k, body) in [
        ("json-1", r#"{"sku":"A1","qty":3}"#),
        ("amount-1", r#"{"amount":101,"currency":"EUR"}"#),
        // Not even version 1 can read it: never the same request.
        ("amount-1", r#"{"amount":1e400,"currency":"EUR"}"#),
    ] {
        match engine.begin(&BeginRequest::json(key(k), body, p.clone()))? {
            Decision::Mismatch(m) => assert_eq!(m.stored_version, 1, "{k}"),
            other => bail!("{k} {body}: expected a mismatch, got {}", other.name()),
        }
    }
    let mut http = BeginRequest::json(key("http-1"), r#"{"n":1.5}"#, p.clone());
    http.attributes = vec![
        ("method".into(), "POST".into()),
        ("path".into(), "/v1/refunds".into()),
    ];
    assert!(matches!(engine.begin(&http)?, Decision::Mismatch(_)));
    Ok(())
}

#[test]
fn a_version_1_record_keeps_version_1_rounding() -> Result<()> {
    // Stored under version 1, whose numbers were doubles: 2^53 and 2^53+1
    // were one request then, and that record still answers both.
    let dir = tempfile::tempdir()?;
    let (engine, _) = open(&dir, 1_000)?;
    let p = Policy::default();
    for body in [
        r#"{"account":9007199254740993}"#,
        r#"{"account":9007199254740992}"#,
    ] {
        let d = engine.begin(&BeginRequest::json(key("account-1"), body, p.clone()))?;
        assert_eq!(replayed_ref(d)?, "order-3", "{body}");
    }
    // A new key is stored with version 2, which tells them apart.
    let Decision::Execute(t) = engine.begin(&BeginRequest::json(
        key("account-2"),
        r#"{"account":9007199254740993}"#,
        p.clone(),
    ))?
    else {
        bail!("expected execute");
    };
    engine.complete(&t, &p, &idem::Success::with_ref("order-7"))?;
    let status = engine.inspect(&key("account-2"))?.context("account-2")?;
    assert_eq!(status.fingerprint_version, 2);
    match engine.begin(&BeginRequest::json(
        key("account-2"),
        r#"{"account":9007199254740992}"#,
        p,
    ))? {
        Decision::Mismatch(m) => assert_eq!(m.stored_version, 2),
        other => bail!("expected a mismatch, got {}", other.name()),
    }
    Ok(())
}

#[test]
fn a_version_1_key_in_flight_is_in_progress_then_taken_over() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let p = Policy::default();
    let (engine, _) = open(&dir, 1_000)?;
    let same = BeginRequest::json(key("running-1"), r#"{"sku":"B2"}"#, p.clone());
    assert!(matches!(engine.begin(&same)?, Decision::InProgress(_)));
    assert!(matches!(
        engine.begin(&BeginRequest::json(
            key("running-1"),
            r#"{"sku":"C3"}"#,
            p.clone()
        ))?,
        Decision::Mismatch(_)
    ));
    drop(engine);
    // After the lease, the same request takes the key over (the default
    // policy), still matched with version 1, and the record keeps it.
    let dir2 = tempfile::tempdir()?;
    let (later, store) = open(&dir2, p.lease_ms + 1)?;
    match later.begin(&same)? {
        Decision::Execute(t) => assert_eq!(t.fencing_token, 2),
        other => bail!("expected a take-over, got {}", other.name()),
    }
    assert_eq!(
        store
            .get(&key("running-1"))?
            .context("running-1")?
            .fingerprint_version,
        1
    );
    Ok(())
}
