//! The bounded guest: every call into the component has a deadline and a
//! memory cap, a trap discards the instance, and a component that does not
//! fit idem's world is refused at start-up.
//!
//! Run through the real components: the deliberately misbehaving guest
//! (`tests/guests/misbehaving`, built by this package's build script) and
//! the shipped engine.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use idem::{
    BeginRequest, Decision, Engine, Error, ExpiredLease, ManualClock, MemoryStore, Policy,
    RecordKey, SqliteStore, Status, Storage, Success, SystemClock,
};

/// The misbehaving guest; its biz types choose how it misbehaves.
const MISBEHAVING: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/idem_misbehaving_guest.wasm"));

// The biz types of `tests/guests/misbehaving/src/lib.rs`.
const LOOP: &str = "misbehave-loop";
const ALLOCATE: &str = "misbehave-allocate";
const TRAP: &str = "misbehave-trap";
const TRAP_AFTER_CLAIM: &str = "misbehave-trap-after-claim";
const COUNT: &str = "misbehave-count";
const SLOW_HOST: &str = "misbehave-slow-host";
/// `SLOW_HOST` pauses 4 × 100 ms in the host.
const SLOW_HOST_TOTAL: Duration = Duration::from_millis(400);

/// The deadline these tests give the guest: short, so a looping guest is
/// stopped quickly, and far above what an honest call computes.
const DEADLINE: Duration = Duration::from_millis(200);

/// How late past its deadline a stopped call may return on a loaded
/// machine (two cores shared with other builds): one epoch tick plus
/// scheduling delay.
const LATENESS: Duration = Duration::from_secs(3);

/// The start of the manual clock.
const T0: u64 = 1_767_225_600_000;

fn request(biz_type: &str, key: &str) -> BeginRequest {
    BeginRequest::json(
        RecordKey::new("tenant-1", biz_type, key),
        r#"{"amount":1}"#,
        Policy {
            expired_lease: ExpiredLease::TakeOver,
            ..Policy::default()
        },
    )
}

fn misbehaving(storage: impl Storage) -> Result<Engine> {
    Ok(Engine::builder()
        .storage(storage)
        .clock(ManualClock::new(T0))
        .guest_bytes(MISBEHAVING)
        .guest_deadline(DEADLINE)
        .build()?)
}

/// How many calls the instance that served this one has served.
fn calls_served(engine: &Engine) -> Result<u64> {
    match engine.begin(&request(COUNT, "k"))? {
        Decision::InProgress(busy) => Ok(busy.retry_after_ms),
        other => bail!("the count mode answered {}", other.name()),
    }
}

#[test]
fn instances_are_reused_while_they_behave() -> Result<()> {
    let engine = misbehaving(MemoryStore::new())?;
    ensure!(calls_served(&engine)? == 1);
    ensure!(calls_served(&engine)? == 2);
    ensure!(calls_served(&engine)? == 3);
    Ok(())
}

#[test]
fn a_guest_that_loops_is_stopped_at_its_deadline() -> Result<()> {
    let engine = misbehaving(MemoryStore::new())?;
    ensure!(calls_served(&engine)? == 1);
    let start = Instant::now();
    let outcome = engine.begin(&request(LOOP, "k"));
    let took = start.elapsed();
    match outcome {
        Err(Error::Deadline { limit }) => ensure!(limit == DEADLINE, "{limit:?}"),
        Err(other) => bail!("expected a missed deadline, got {other}"),
        Ok(d) => bail!("a looping guest answered {}", d.name()),
    }
    ensure!(
        took >= DEADLINE,
        "stopped after {took:?}, before its deadline"
    );
    ensure!(took < DEADLINE + LATENESS, "stopped only after {took:?}");
    // The instance was discarded: the next call gets a fresh one.
    ensure!(calls_served(&engine)? == 1);
    Ok(())
}

#[test]
fn the_deadline_error_says_what_happened() -> Result<()> {
    let engine = misbehaving(MemoryStore::new())?;
    let message = match engine.begin(&request(LOOP, "k")) {
        Err(e @ Error::Deadline { .. }) => e.to_string(),
        other => bail!("expected a missed deadline, got {other:?}"),
    };
    ensure!(
        message.contains("deadline of 200 ms") && message.contains("discarded"),
        "{message}"
    );
    Ok(())
}

#[test]
fn time_in_host_imports_does_not_count_against_the_guest() -> Result<()> {
    // The system clock really sleeps in `pause`: 400 ms in the host, twice
    // the guest's deadline.
    let engine = Engine::builder()
        .storage(MemoryStore::new())
        .clock(SystemClock::new())
        .guest_bytes(MISBEHAVING)
        .guest_deadline(DEADLINE)
        .build()?;
    let start = Instant::now();
    let served = match engine.begin(&request(SLOW_HOST, "k"))? {
        Decision::InProgress(busy) => busy.retry_after_ms,
        other => bail!("the slow-host mode answered {}", other.name()),
    };
    ensure!(start.elapsed() >= SLOW_HOST_TOTAL, "the host did not wait");
    ensure!(served == 1);
    // Not discarded either.
    ensure!(calls_served(&engine)? == 2);
    Ok(())
}

#[test]
fn a_guest_that_allocates_without_end_hits_the_memory_limit() -> Result<()> {
    const LIMIT: usize = 32 * 1024 * 1024;
    let engine = Engine::builder()
        .storage(MemoryStore::new())
        .clock(ManualClock::new(T0))
        .guest_bytes(MISBEHAVING)
        .memory_limit(LIMIT)
        .build()?;
    ensure!(calls_served(&engine)? == 1);
    match engine.begin(&request(ALLOCATE, "k")) {
        Err(Error::MemoryLimit { limit, requested }) => {
            ensure!(limit == LIMIT, "{limit}");
            ensure!(requested > LIMIT, "{requested}");
        }
        Err(other) => bail!("expected the memory limit, got {other}"),
        Ok(d) => bail!("an endless allocation answered {}", d.name()),
    }
    ensure!(calls_served(&engine)? == 1, "the instance was reused");
    Ok(())
}

#[test]
fn a_trap_is_reported_as_a_trap_and_discards_the_instance() -> Result<()> {
    let engine = misbehaving(MemoryStore::new())?;
    ensure!(calls_served(&engine)? == 1);
    match engine.begin(&request(TRAP, "k")) {
        Err(Error::Trap(message)) => ensure!(!message.is_empty()),
        Err(other) => bail!("expected a trap, got {other}"),
        Ok(d) => bail!("a trapping guest answered {}", d.name()),
    }
    ensure!(calls_served(&engine)? == 1, "the instance was reused");
    Ok(())
}

#[test]
fn a_trap_after_the_claim_leaves_a_consistent_record() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("idem.db"), Default::default())?;
    let clock = ManualClock::new(T0);
    let bad = Engine::builder()
        .storage(store.clone())
        .clock(clock.clone())
        .guest_bytes(MISBEHAVING)
        .build()?;
    let req = request(TRAP_AFTER_CLAIM, "order-1");
    match bad.begin(&req) {
        Err(Error::Trap(_)) => {}
        other => bail!("expected a trap, got {other:?}"),
    }

    // The claim is the one atomic write the guest made: a whole processing
    // record, owned by token 1 until its lease ends.
    let rec = store.get(&req.key)?.context("the claim was not written")?;
    ensure!(rec.status == Status::Processing, "{:?}", rec.status);
    ensure!(rec.fencing_token == 1 && rec.revision >= 1 && rec.attempts == 1);
    ensure!(rec.lease_until == Some(T0 + req.policy.lease_ms));
    ensure!(rec.fingerprint.len() == 64 && rec.result_ref.is_none());

    // The real engine reads it as any crashed owner's claim.
    let good = Engine::builder()
        .storage(store.clone())
        .clock(clock.clone())
        .build()?;
    match good.begin(&req)? {
        Decision::InProgress(_) => {}
        other => bail!("a live claim was answered {}", other.name()),
    }
    clock.advance(req.policy.lease_ms);
    let ticket = match good.begin(&req)? {
        Decision::Execute(ticket) => ticket,
        other => bail!("an expired claim was answered {}", other.name()),
    };
    ensure!(ticket.fencing_token == 2, "{ticket:?}");
    good.complete(&ticket, &req.policy, &Success::with_ref("order-1001"))?;
    match good.begin(&req)? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-1001")),
        other => bail!("a completed key was answered {}", other.name()),
    }
    // The misbehaving engine got a fresh instance and behaves again.
    ensure!(calls_served(&bad)? == 1);
    Ok(())
}

#[test]
fn the_shipped_engine_has_a_deadline_too() -> Result<()> {
    // A 4 MiB JSON body takes the guest far more than one 10 ms epoch
    // tick to canonicalize and hash.
    let mut body = String::from("[");
    for i in 0..400_000 {
        body.push_str(&format!("{{\"n\":{i}}},"));
    }
    body.push_str("0]");
    let mut req = request("order", "big");
    req.body = body.into_bytes();
    req.policy.max_body_bytes = 64 * 1024 * 1024;
    let tight = Engine::builder()
        .storage(MemoryStore::new())
        .clock(ManualClock::new(T0))
        .guest_deadline(Duration::from_millis(1))
        .build()?;
    match tight.begin(&req) {
        Err(Error::Deadline { .. }) => {}
        other => bail!("expected a missed deadline, got {other:?}"),
    }
    // With the default deadline the same request goes through.
    let engine = Engine::builder()
        .storage(MemoryStore::new())
        .clock(ManualClock::new(T0))
        .build()?;
    let start = Instant::now();
    match engine.begin(&req)? {
        Decision::Execute(_) => {}
        other => bail!("expected execute, got {}", other.name()),
    }
    eprintln!(
        "begin with a {} byte JSON body: {:?}",
        req.body.len(),
        start.elapsed()
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Components that do not fit idem's world
// ---------------------------------------------------------------------------

fn load_error(wat: &str) -> Result<String> {
    let wasm = wat::parse_str(wat)?;
    match Engine::builder()
        .storage(MemoryStore::new())
        .guest_bytes(wasm)
        .build()
    {
        Err(Error::Load(message)) => {
            eprintln!("refused: {message}");
            Ok(message)
        }
        Err(other) => bail!("expected a load error, got {other}"),
        Ok(_) => bail!("a component outside idem's world loaded"),
    }
}

#[test]
fn a_component_without_the_engine_export_is_refused_naming_it() -> Result<()> {
    let message = load_error("(component)")?;
    ensure!(message.contains("idem:engine/engine"), "{message}");
    Ok(())
}

#[test]
fn a_component_with_a_foreign_import_is_refused_naming_it() -> Result<()> {
    let message = load_error(
        r#"(component
             (import "wasi:cli/environment@0.2.0" (instance
               (export "get-arguments" (func (result (list string)))))))"#,
    )?;
    ensure!(message.contains("wasi:cli/environment@0.2.0"), "{message}");
    Ok(())
}

#[test]
fn a_component_with_a_mismatched_import_is_refused_naming_it() -> Result<()> {
    // `store.get` with the wrong signature.
    let message = load_error(
        r#"(component
             (import "idem:engine/store@0.4.0" (instance
               (export "get" (func (param "key" u32) (result u32))))))"#,
    )?;
    ensure!(
        message.contains("idem:engine/store@0.4.0") && message.contains("get"),
        "{message}"
    );
    Ok(())
}

#[test]
fn a_component_with_an_incomplete_export_is_refused_naming_it() -> Result<()> {
    // An `engine` instance with only a `begin`, which takes nothing and
    // returns nothing.
    let message = load_error(
        r#"(component
             (core module $m (func (export "begin")))
             (core instance $i (instantiate $m))
             (type $nothing (func))
             (func $begin (type $nothing) (canon lift (core func $i "begin")))
             (instance $engine (export "begin" (func $begin)))
             (export "idem:engine/engine@0.4.0" (instance $engine)))"#,
    )?;
    ensure!(message.contains("idem:engine/engine@0.4.0"), "{message}");
    Ok(())
}
