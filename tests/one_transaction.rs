//! `run_in_one_transaction` on SQLite, through the real engine component:
//! the claim, the business write and the stored outcome commit together,
//! or nothing does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::time::Duration;

#[path = "support/options.rs"]
mod options;

use anyhow::{Context, Result, bail, ensure};
use idem::{
    ActionResult, BeginRequest, Decision, Disposition, Engine, ExpiredLease, Failure,
    InProgressMode, ManualClock, Policy, RecordKey, RunInTransaction, RunOutcome, SqliteStore,
    Status, StoreError, Success, WaitSpec,
};

const T0: u64 = 1_767_225_600_000;

struct Setup {
    _dir: tempfile::TempDir,
    db: std::path::PathBuf,
    engine: Engine,
    clock: ManualClock,
}

fn setup() -> Result<Setup> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    rusqlite::Connection::open(&db)?
        .execute_batch("CREATE TABLE orders (idem_key TEXT NOT NULL, amount INTEGER NOT NULL)")?;
    let clock = ManualClock::new(T0);
    let engine = Engine::builder()
        .storage(SqliteStore::open(&db, options::sqlite_options())?)
        .clock(clock.clone())
        .build()?;
    Ok(Setup {
        _dir: dir,
        db,
        engine,
        clock,
    })
}

fn request(k: &str) -> BeginRequest {
    BeginRequest::json(
        RecordKey::new("tenant-1", "order.create", k),
        r#"{"sku":"A1","qty":2}"#,
        Policy::default(),
    )
}

fn orders(db: &std::path::Path, k: &str) -> Result<i64> {
    Ok(rusqlite::Connection::open(db)?.query_row(
        "SELECT count(*) FROM orders WHERE idem_key = ?1",
        [k],
        |r| r.get(0),
    )?)
}

/// Writes one order row for the request's key, then returns `result`.
fn order(engine: &Engine, req: &BeginRequest, result: ActionResult) -> Result<RunOutcome> {
    Ok(engine.run_in_one_transaction(req, |_, conn| {
        match conn.execute("INSERT INTO orders VALUES (?1, 100)", [&req.key.idem_key]) {
            Ok(_) => result,
            Err(e) => ActionResult::retryable("db", e),
        }
    })?)
}

fn ok(r: &str) -> ActionResult {
    ActionResult::Succeeded(Success::with_ref(r))
}

#[test]
fn one_commit_holds_the_record_and_the_business_row_and_a_retry_replays() -> Result<()> {
    let s = setup()?;
    let req = request("k1");
    match order(&s.engine, &req, ok("order-1"))? {
        RunOutcome::Executed { ticket, .. } => {
            ensure!(
                ticket.attempt == 1 && ticket.fencing_token == 1,
                "{ticket:?}"
            )
        }
        other => bail!("expected an execution, got {other:?}"),
    }
    let st = s.engine.inspect(&req.key)?.context("the record")?;
    ensure!(st.status == Status::Succeeded, "{st:?}");
    match order(&s.engine, &req, ok("order-2"))? {
        RunOutcome::NotExecuted(Decision::Replay(r)) => {
            ensure!(r.result_ref.as_deref() == Some("order-1"), "{r:?}")
        }
        other => bail!("expected a replay, got {other:?}"),
    }
    ensure!(orders(&s.db, "k1")? == 1, "one business row");
    Ok(())
}

#[test]
fn a_failed_action_is_rolled_back_to_the_claim_and_its_failure_stored() -> Result<()> {
    let s = setup()?;
    // Retryable: the row is undone, the attempt counted, the next run is attempt 2.
    let req = request("k1");
    let outcome = order(
        &s.engine,
        &req,
        ActionResult::Failed(
            Failure {
                code: "busy".into(),
                message: "the warehouse was busy".into(),
                response: None,
            },
            Disposition::Retryable,
        ),
    )?;
    ensure!(
        matches!(outcome, RunOutcome::Executed { .. }),
        "{outcome:?}"
    );
    ensure!(
        orders(&s.db, "k1")? == 0,
        "the failed attempt's row is gone"
    );
    let st = s
        .engine
        .inspect(&req.key)?
        .context("the failure is stored")?;
    ensure!(st.attempts == 1, "{st:?}");
    match order(&s.engine, &req, ok("order-1"))? {
        RunOutcome::Executed { ticket, .. } => ensure!(ticket.attempt == 2, "{ticket:?}"),
        other => bail!("expected a second attempt, got {other:?}"),
    }
    ensure!(orders(&s.db, "k1")? == 1);
    // Final: undone, stored, and answered as failed from then on.
    let req = request("k2");
    let declined = Failure {
        code: "card-declined".into(),
        message: "the card was declined".into(),
        response: None,
    };
    order(
        &s.engine,
        &req,
        ActionResult::Failed(declined.clone(), Disposition::Final),
    )?;
    ensure!(orders(&s.db, "k2")? == 0);
    match order(&s.engine, &req, ok("order-2"))? {
        RunOutcome::NotExecuted(Decision::Failed(f)) => ensure!(f == declined, "{f:?}"),
        other => bail!("expected the stored failure, got {other:?}"),
    }
    ensure!(orders(&s.db, "k2")? == 0);
    Ok(())
}

#[test]
fn an_unknown_outcome_is_stored_and_never_run_again_blindly() -> Result<()> {
    let s = setup()?;
    let req = request("k1");
    let timed_out = Failure {
        code: "gateway-timeout".into(),
        message: "the payment gateway did not answer".into(),
        response: None,
    };
    order(
        &s.engine,
        &req,
        ActionResult::Failed(timed_out, Disposition::OutcomeUnknown),
    )?;
    ensure!(orders(&s.db, "k1")? == 0, "the local row is rolled back");
    // Past the lease too: only a lookup or an operator may settle it.
    s.clock.set(T0 + 10 * req.policy.lease_ms);
    let ran = AtomicU64::new(0);
    let outcome = s.engine.run_in_one_transaction(&req, |_, _| {
        ran.fetch_add(1, Ordering::SeqCst);
        ok("order-1")
    })?;
    ensure!(
        matches!(
            outcome,
            RunOutcome::NotExecuted(Decision::OutcomeUnknown(_))
        ),
        "{outcome:?}"
    );
    ensure!(ran.load(Ordering::SeqCst) == 0, "never run again blindly");
    Ok(())
}

#[test]
fn an_action_that_errors_leaves_no_record_and_no_row() -> Result<()> {
    let s = setup()?;
    let store = s
        .engine
        .storage::<SqliteStore>()
        .context("the engine's store")?;
    let req = request("k1");
    let outcome = s.engine.run_with_one_transaction(
        &req,
        || store.begin_transaction(),
        |_, tx| {
            tx.with_connection(|c| c.execute("INSERT INTO orders VALUES ('k1', 100)", []))?
                .map_err(|e| StoreError::Internal(e.to_string()))?;
            Err(StoreError::Unavailable("the connection dropped".into()))
        },
    );
    ensure!(
        matches!(outcome, Err(idem::Error::Store(StoreError::Unavailable(_)))),
        "{outcome:?}"
    );
    ensure!(s.engine.inspect(&req.key)?.is_none(), "no claim is left");
    ensure!(orders(&s.db, "k1")? == 0);
    // Nothing to wait out: the retry runs at once, as the first attempt.
    match order(&s.engine, &req, ok("order-1"))? {
        RunOutcome::Executed { ticket, .. } => ensure!(ticket.attempt == 1, "{ticket:?}"),
        other => bail!("expected an execution, got {other:?}"),
    }
    Ok(())
}

/// A clock that reports each reading: the engine reads it in `begin`
/// after looking the key up and before claiming it.
struct Reporting {
    at: u64,
    readings: Mutex<mpsc::Sender<()>>,
}

impl idem::Clock for Reporting {
    fn now(&self) -> u64 {
        let _ = self.readings.lock().map(|tx| tx.send(()));
        self.at
    }
    fn pause(&self, _: u64) {}
}

#[test]
fn a_duplicate_waits_for_the_transaction_and_replays() -> Result<()> {
    let s = setup()?;
    let (readings, read) = mpsc::channel();
    let engine = Engine::builder()
        .storage(SqliteStore::open(&s.db, options::sqlite_options())?)
        .clock(Reporting {
            at: T0,
            readings: Mutex::new(readings),
        })
        .build()?;
    let req = request("k1");
    let (inside, entered) = mpsc::channel();
    let (release, released) = mpsc::channel::<()>();
    let (first_engine, first_req) = (engine.clone(), req.clone());
    let first = std::thread::spawn(move || -> Result<RunOutcome> {
        Ok(first_engine.run_in_one_transaction(&first_req, |_, conn| {
            conn.execute("INSERT INTO orders VALUES ('k1', 100)", [])
                .expect("the business write");
            inside.send(()).expect("the test waits");
            released.recv().expect("the test releases");
            ok("order-1")
        })?)
    });
    entered.recv_timeout(Duration::from_secs(20))?;
    while read.try_recv().is_ok() {}
    let (dup_engine, dup_req) = (engine.clone(), req.clone());
    let duplicate = std::thread::spawn(move || dup_engine.begin(&dup_req));
    // The duplicate has looked the key up (the claim is not visible) and
    // goes on to claim it, which waits for the open transaction.
    read.recv_timeout(Duration::from_secs(20))?;
    release.send(())?;
    let first = first.join().expect("first")?;
    ensure!(matches!(first, RunOutcome::Executed { .. }), "{first:?}");
    match duplicate.join().expect("duplicate")? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-1"), "{r:?}"),
        other => bail!("expected a replay, got {other:?}"),
    }
    ensure!(orders(&s.db, "k1")? == 1);
    Ok(())
}

#[test]
fn a_key_claimed_outside_is_in_progress_at_once_even_under_a_wait_policy() -> Result<()> {
    let s = setup()?;
    let mut req = request("k1");
    let Decision::Execute(_) = s.engine.begin(&req)? else {
        bail!("the key was free");
    };
    // Waiting would hold the write lock that the owner needs to finish.
    req.policy.in_progress = InProgressMode::Wait(WaitSpec {
        max_wait_ms: 60_000,
        poll_interval_ms: 100,
    });
    let ran = AtomicU64::new(0);
    let outcome = s.engine.run_in_one_transaction(&req, |_, _| {
        ran.fetch_add(1, Ordering::SeqCst);
        ok("order-1")
    })?;
    ensure!(
        matches!(outcome, RunOutcome::NotExecuted(Decision::InProgress(_))),
        "{outcome:?}"
    );
    ensure!(ran.load(Ordering::SeqCst) == 0);
    Ok(())
}

#[test]
fn what_begin_settles_without_executing_is_committed() -> Result<()> {
    let s = setup()?;
    let req = BeginRequest {
        policy: Policy {
            expired_lease: ExpiredLease::Reconcile,
            ..Policy::default()
        },
        ..request("k1")
    };
    let Decision::Execute(_) = s.engine.begin(&req)? else {
        bail!("the key was free");
    };
    // The owner crashed after its effect; past the lease, the lookup finds it.
    let db = s.db.clone();
    let engine = Engine::builder()
        .storage(SqliteStore::open(&s.db, options::sqlite_options())?)
        .clock(s.clock.clone())
        .results(move |key: &RecordKey| {
            let n =
                orders(&db, &key.idem_key).map_err(|e| StoreError::Unavailable(e.to_string()))?;
            Ok((n > 0).then(|| "order-found".to_owned()))
        })
        .build()?;
    rusqlite::Connection::open(&s.db)?.execute("INSERT INTO orders VALUES ('k1', 100)", [])?;
    s.clock.set(T0 + req.policy.lease_ms);
    let outcome = engine.run_in_one_transaction(&req, |_, _| ok("never"))?;
    match outcome {
        RunOutcome::NotExecuted(Decision::Replay(r)) => {
            ensure!(r.result_ref.as_deref() == Some("order-found"), "{r:?}")
        }
        other => bail!("expected the found result, got {other:?}"),
    }
    let st = engine.inspect(&req.key)?.context("the record")?;
    ensure!(
        st.status == Status::Succeeded,
        "settled and committed: {st:?}"
    );
    ensure!(orders(&s.db, "k1")? == 1);
    Ok(())
}

/// Real threads, each with its own store on one file, racing on every key:
/// each key executes once, and every duplicate replays (none is told "in
/// progress", because no claim is visible before its outcome).
#[test]
fn eight_threads_execute_each_key_once_and_every_duplicate_replays() -> Result<()> {
    const THREADS: usize = 8;
    const KEYS: usize = 200;
    let s = setup()?;
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (db, barrier) = (s.db.clone(), barrier.clone());
            std::thread::spawn(move || -> Result<(usize, usize)> {
                let options = idem::SqliteOptions {
                    pool_size: 1,
                    busy_timeout: Duration::from_secs(30),
                    ..options::sqlite_options()
                };
                let engine = Engine::builder()
                    .storage(SqliteStore::open(&db, options)?)
                    .build()?;
                let (mut executed, mut replayed) = (0, 0);
                for i in 0..KEYS {
                    let req = request(&format!("k{i}"));
                    barrier.wait();
                    match order(&engine, &req, ok(&format!("order-{i}")))? {
                        RunOutcome::Executed { .. } => executed += 1,
                        RunOutcome::NotExecuted(Decision::Replay(_)) => replayed += 1,
                        other => bail!("unexpected outcome {other:?}"),
                    }
                }
                Ok((executed, replayed))
            })
        })
        .collect();
    let (mut executed, mut replayed) = (0, 0);
    for h in handles {
        let (e, r) = h.join().expect("thread")?;
        executed += e;
        replayed += r;
    }
    println!("threads {THREADS}, keys {KEYS}: executed {executed}, replayed {replayed}");
    ensure!(executed == KEYS && replayed == KEYS * (THREADS - 1));
    let conn = rusqlite::Connection::open(&s.db)?;
    let (rows, distinct): (i64, i64) = conn.query_row(
        "SELECT count(*), count(DISTINCT idem_key) FROM orders",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    ensure!(
        rows == KEYS as i64 && distinct == rows,
        "rows {rows}, distinct {distinct}"
    );
    Ok(())
}
