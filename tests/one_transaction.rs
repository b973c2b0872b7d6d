//! `run_in_one_transaction` on SQLite, through the real engine component:
//! the claim, the business write and the stored outcome commit together,
//! or nothing does; and `run_batch_in_one_transaction`, several requests
//! in one such transaction.

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

/// A racing thread's engine: a store of its own on `db`, one connection,
/// a busy timeout long enough for every other thread's turn.
fn thread_engine(db: &std::path::Path) -> Result<Engine> {
    let options = idem::SqliteOptions {
        pool_size: 1,
        busy_timeout: Duration::from_secs(30),
        ..options::sqlite_options()
    };
    Ok(Engine::builder()
        .storage(SqliteStore::open(db, options)?)
        .build()?)
}

/// Runs `run(t, engine, barrier)` on `threads` real threads, each with
/// its own store on `db`; counts their executions and replays, and fails on
/// any other outcome.
fn race(
    db: &std::path::Path,
    threads: usize,
    run: impl Fn(usize, &Engine, &Barrier) -> Result<Vec<RunOutcome>> + Send + Sync + 'static,
) -> Result<(usize, usize)> {
    let barrier = Arc::new(Barrier::new(threads));
    let run = Arc::new(run);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (db, barrier, run) = (db.to_owned(), barrier.clone(), run.clone());
            std::thread::spawn(move || -> Result<Vec<RunOutcome>> {
                run(t, &thread_engine(&db)?, &barrier)
            })
        })
        .collect();
    let (mut executed, mut replayed) = (0, 0);
    for h in handles {
        for outcome in h.join().expect("thread")? {
            match outcome {
                RunOutcome::Executed { .. } => executed += 1,
                RunOutcome::NotExecuted(Decision::Replay(_)) => replayed += 1,
                other => bail!("unexpected outcome {other:?}"),
            }
        }
    }
    Ok((executed, replayed))
}

/// Exactly one order row for each of `keys` keys.
fn one_row_per_key(db: &std::path::Path, keys: usize) -> Result<()> {
    let (rows, distinct): (i64, i64) = rusqlite::Connection::open(db)?.query_row(
        "SELECT count(*), count(DISTINCT idem_key) FROM orders",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    ensure!(
        rows == keys as i64 && distinct == rows,
        "rows {rows}, distinct {distinct}"
    );
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
    let (executed, replayed) = race(&s.db, THREADS, |_, engine, barrier| {
        let mut outcomes = Vec::new();
        for i in 0..KEYS {
            let req = request(&format!("k{i}"));
            barrier.wait();
            outcomes.push(order(engine, &req, ok(&format!("order-{i}")))?);
        }
        Ok(outcomes)
    })?;
    println!("threads {THREADS}, keys {KEYS}: executed {executed}, replayed {replayed}");
    ensure!(executed == KEYS && replayed == KEYS * (THREADS - 1));
    one_row_per_key(&s.db, KEYS)
}

// ---------------------------------------------------------------------------
// Batches: several requests in one transaction, one commit.

/// Runs `reqs` in one batch; each executed request writes one order row
/// for its key, then returns `result(index)`.
fn order_batch(
    engine: &Engine,
    reqs: &[BeginRequest],
    result: impl Fn(usize) -> ActionResult,
) -> Result<Vec<Result<RunOutcome, idem::Error>>> {
    Ok(engine.run_batch_in_one_transaction(reqs, |i, _, conn| {
        match conn.execute(
            "INSERT INTO orders VALUES (?1, 100)",
            [&reqs[i].key.idem_key],
        ) {
            Ok(_) => result(i),
            Err(e) => ActionResult::retryable("db", e),
        }
    })?)
}

fn executed_attempt(outcome: &Result<RunOutcome, idem::Error>) -> Option<u32> {
    match outcome {
        Ok(RunOutcome::Executed {
            ticket,
            result: ActionResult::Succeeded(_),
            ..
        }) => Some(ticket.attempt),
        _ => None,
    }
}

#[test]
fn a_batch_commits_once_and_a_duplicate_inside_it_replays() -> Result<()> {
    let s = setup()?;
    let reqs = ["k1", "k2", "k1", "k3"].map(request);
    let db = s.db.clone();
    let seen_outside = Mutex::new(None);
    let outcomes = s.engine.run_batch_in_one_transaction(&reqs, |i, _, conn| {
        conn.execute(
            "INSERT INTO orders VALUES (?1, 100)",
            [&reqs[i].key.idem_key],
        )
        .expect("the business write");
        if i == 3 {
            // Another connection sees none of the batch before its commit.
            let rows = rusqlite::Connection::open(&db).and_then(|c| {
                c.query_row("SELECT count(*) FROM orders", [], |r| r.get::<_, i64>(0))
            });
            *seen_outside.lock().expect("seen") = Some(rows.map_err(|e| e.to_string()));
        }
        ok(&format!("order-{i}"))
    })?;
    ensure!(outcomes.len() == 4, "{outcomes:?}");
    for i in [0, 1, 3] {
        ensure!(
            executed_attempt(&outcomes[i]) == Some(1),
            "{:?}",
            outcomes[i]
        );
    }
    match &outcomes[2] {
        Ok(RunOutcome::NotExecuted(Decision::Replay(r))) => {
            ensure!(r.result_ref.as_deref() == Some("order-0"), "{r:?}")
        }
        other => bail!("the duplicate in the batch should replay, got {other:?}"),
    }
    let seen = seen_outside.lock().expect("seen").clone();
    ensure!(
        seen == Some(Ok(0)),
        "nothing was visible before the commit: {seen:?}"
    );
    for k in ["k1", "k2", "k3"] {
        ensure!(orders(&s.db, k)? == 1, "one row for {k}");
        let st = s.engine.inspect(&request(k).key)?.context("the record")?;
        ensure!(st.status == Status::Succeeded, "{st:?}");
    }
    // A redelivered batch replays every request.
    let again = order_batch(&s.engine, &reqs, |_| ok("never"))?;
    ensure!(
        again
            .iter()
            .all(|o| matches!(o, Ok(RunOutcome::NotExecuted(Decision::Replay(_))))),
        "{again:?}"
    );
    ensure!(orders(&s.db, "k1")? == 1);
    Ok(())
}

#[test]
fn a_request_that_fails_or_errors_in_a_batch_is_undone_alone() -> Result<()> {
    let s = setup()?;
    let store = s
        .engine
        .storage::<SqliteStore>()
        .context("the engine's store")?;
    // A key with a control character breaks the key rules.
    let bad = request("bad\u{7}key");
    let reqs = [
        request("k1"),
        request("k2"),
        request("k3"),
        bad,
        request("k5"),
    ];
    let outcomes = s.engine.run_batch_with_one_transaction(
        &reqs,
        || store.begin_transaction(),
        |i, _, tx| {
            let k = &reqs[i].key.idem_key;
            tx.with_connection(|c| c.execute("INSERT INTO orders VALUES (?1, 100)", [k]))?
                .map_err(|e| StoreError::Internal(e.to_string()))?;
            match i {
                1 => Ok(ActionResult::retryable("busy", "the warehouse was busy")),
                2 => Err(StoreError::Unavailable("the connection dropped".into())),
                _ => Ok(ok(&format!("order-{i}"))),
            }
        },
        idem::BatchErrors::SkipRequest,
    )?;
    ensure!(executed_attempt(&outcomes[0]) == Some(1), "{outcomes:?}");
    ensure!(
        matches!(
            &outcomes[1],
            Ok(RunOutcome::Executed {
                result: ActionResult::Failed(_, Disposition::Retryable),
                stored: Status::Released,
                ..
            })
        ),
        "{:?}",
        outcomes[1]
    );
    ensure!(
        matches!(
            &outcomes[2],
            Err(idem::Error::Store(StoreError::Unavailable(_)))
        ),
        "{:?}",
        outcomes[2]
    );
    ensure!(
        matches!(
            &outcomes[3],
            Ok(RunOutcome::NotExecuted(Decision::Invalid(_)))
        ),
        "{:?}",
        outcomes[3]
    );
    ensure!(executed_attempt(&outcomes[4]) == Some(1), "{outcomes:?}");
    // The others committed; the failure is stored without its row; the
    // request that errored left nothing, not even a claim.
    ensure!(orders(&s.db, "k1")? == 1 && orders(&s.db, "k5")? == 1);
    ensure!(orders(&s.db, "k2")? == 0 && orders(&s.db, "k3")? == 0);
    let st = s.engine.inspect(&reqs[1].key)?.context("k2's failure")?;
    ensure!(st.status == Status::Released && st.attempts == 1, "{st:?}");
    ensure!(s.engine.inspect(&reqs[2].key)?.is_none(), "no claim for k3");
    // Their redeliveries: k2 runs as attempt 2, k3 as attempt 1.
    let again = order_batch(&s.engine, &reqs[1..3], |_| ok("order"))?;
    ensure!(executed_attempt(&again[0]) == Some(2), "{again:?}");
    ensure!(executed_attempt(&again[1]) == Some(1), "{again:?}");
    Ok(())
}

#[test]
fn an_aborted_batch_keeps_nothing() -> Result<()> {
    let s = setup()?;
    let store = s
        .engine
        .storage::<SqliteStore>()
        .context("the engine's store")?;
    let reqs = ["k1", "k2", "k3"].map(request);
    let outcome = s.engine.run_batch_with_one_transaction(
        &reqs,
        || store.begin_transaction(),
        |i, _, tx| {
            let k = &reqs[i].key.idem_key;
            tx.with_connection(|c| c.execute("INSERT INTO orders VALUES (?1, 100)", [k]))?
                .map_err(|e| StoreError::Internal(e.to_string()))?;
            match i {
                1 => Err(StoreError::Unavailable("the connection dropped".into())),
                _ => Ok(ok("order")),
            }
        },
        idem::BatchErrors::AbortBatch,
    );
    ensure!(
        matches!(outcome, Err(idem::Error::Store(StoreError::Unavailable(_)))),
        "{outcome:?}"
    );
    for r in &reqs {
        ensure!(s.engine.inspect(&r.key)?.is_none(), "no claim for {r:?}");
        ensure!(orders(&s.db, &r.key.idem_key)? == 0);
    }
    Ok(())
}

/// Real threads, each with its own store on one file, each running every
/// key in batches of 20 in its own order: each key executes once.
#[test]
fn four_threads_of_batches_in_different_orders_execute_each_key_once() -> Result<()> {
    const THREADS: usize = 4;
    const KEYS: usize = 200;
    const BATCH: usize = 20;
    let s = setup()?;
    let (executed, replayed) = race(&s.db, THREADS, |t, engine, barrier| {
        // Thread t walks the keys with its own stride.
        let stride = [1, 7, 13, 199][t];
        let keys: Vec<BeginRequest> = (0..KEYS)
            .map(|i| request(&format!("k{}", (i * stride) % KEYS)))
            .collect();
        let mut outcomes = Vec::new();
        barrier.wait();
        for chunk in keys.chunks(BATCH) {
            for outcome in order_batch(engine, chunk, |_| ok("order"))? {
                outcomes.push(outcome?);
            }
        }
        Ok(outcomes)
    })?;
    println!(
        "threads {THREADS}, keys {KEYS}, batches of {BATCH}: executed {executed}, replayed {replayed}"
    );
    ensure!(executed == KEYS && replayed == KEYS * (THREADS - 1));
    one_row_per_key(&s.db, KEYS)
}
