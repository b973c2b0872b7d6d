//! Real threads, each with its own SQLite connection, racing on one file:
//! the unique index decides, so each key executes exactly once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

#[path = "support/options.rs"]
mod options;

use anyhow::{Result, ensure};
use idem::{
    ActionResult, BeginRequest, Decision, Engine, Policy, RecordKey, RunInTransaction, RunOutcome,
    SqliteOptions, SqliteStore, Success,
};

const THREADS: usize = 8;
const KEYS: usize = 1_000;

#[test]
fn eight_threads_one_thousand_keys_execute_once_each() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    {
        let conn = rusqlite::Connection::open(&db)?;
        conn.execute_batch(
            "PRAGMA journal_mode=WAL; CREATE TABLE orders (idem_key TEXT NOT NULL);",
        )?;
    }
    let barrier = Arc::new(Barrier::new(THREADS));
    let side_effects = Arc::new(AtomicU64::new(0));
    let per_key: Arc<Vec<AtomicU64>> = Arc::new((0..KEYS).map(|_| AtomicU64::new(0)).collect());
    let mut handles = Vec::new();
    for _ in 0..THREADS {
        let (db, barrier) = (db.clone(), barrier.clone());
        let (side_effects, per_key) = (side_effects.clone(), per_key.clone());
        handles.push(std::thread::spawn(move || -> Result<(u64, u64)> {
            // One connection per thread: nothing in-process can arbitrate.
            let options = SqliteOptions {
                pool_size: 1,
                ..options::sqlite_options()
            };
            let store = SqliteStore::open(&db, options)?;
            let engine = Engine::builder().storage(store).build()?;
            let (mut executed, mut not_executed) = (0, 0);
            for (i, count) in per_key.iter().enumerate() {
                let key = RecordKey::new("tenant-1", "order.create", format!("key-{i}"));
                let req = BeginRequest::json(key, format!("{{\"n\":{i}}}"), Policy::default());
                barrier.wait();
                match engine.run_in_transaction(&req, |_, conn| {
                    count.fetch_add(1, Ordering::SeqCst);
                    side_effects.fetch_add(1, Ordering::SeqCst);
                    match conn.execute("INSERT INTO orders VALUES (?1)", [&req.key.idem_key]) {
                        Ok(_) => ActionResult::Succeeded(Success::with_ref(format!("o-{i}"))),
                        Err(e) => panic!("business write failed: {e}"),
                    }
                })? {
                    RunOutcome::Executed { .. } => executed += 1,
                    RunOutcome::NotExecuted(Decision::InProgress(_) | Decision::Replay(_)) => {
                        not_executed += 1
                    }
                    other => anyhow::bail!("unexpected outcome {other:?}"),
                }
            }
            Ok((executed, not_executed))
        }));
    }
    let mut executed = 0;
    let mut not_executed = 0;
    for h in handles {
        let (e, n) = h.join().expect("thread panicked")?;
        executed += e;
        not_executed += n;
    }
    println!(
        "threads {THREADS}, keys {KEYS}: executions {executed}, duplicates answered without executing {not_executed}, side effects {}",
        side_effects.load(Ordering::SeqCst)
    );
    ensure!(executed == KEYS as u64);
    ensure!(not_executed == (KEYS * (THREADS - 1)) as u64);
    ensure!(side_effects.load(Ordering::SeqCst) == KEYS as u64);
    ensure!(
        per_key.iter().all(|c| c.load(Ordering::SeqCst) == 1),
        "one execution per key"
    );
    let conn = rusqlite::Connection::open(&db)?;
    let rows: i64 = conn.query_row("SELECT count(DISTINCT idem_key) FROM orders", [], |r| {
        r.get(0)
    })?;
    let all: i64 = conn.query_row("SELECT count(*) FROM orders", [], |r| r.get(0))?;
    ensure!(
        rows == KEYS as i64 && all == rows,
        "business rows {all}, distinct {rows}"
    );
    Ok(())
}

/// One `Engine` shared by every thread (instances are pooled inside it),
/// on a pool of SQLite connections, with the plain `run` API.
#[test]
fn one_shared_engine_across_threads_executes_once_per_key() -> Result<()> {
    const SHARED_KEYS: usize = 300;
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("idem.db"), options::sqlite_options())?;
    let engine = Engine::builder().storage(store).build()?;
    let barrier = Arc::new(Barrier::new(THREADS));
    let per_key: Arc<Vec<AtomicU64>> =
        Arc::new((0..SHARED_KEYS).map(|_| AtomicU64::new(0)).collect());
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let (engine, barrier, per_key) = (engine.clone(), barrier.clone(), per_key.clone());
            std::thread::spawn(move || -> Result<()> {
                for (i, count) in per_key.iter().enumerate() {
                    let key = RecordKey::new("tenant-1", "order.create", format!("key-{i}"));
                    let req = BeginRequest::raw(key, format!("{i}"), Policy::default());
                    barrier.wait();
                    engine.run(&req, |_| {
                        count.fetch_add(1, Ordering::SeqCst);
                        ActionResult::Succeeded(Success::with_ref(format!("o-{i}")))
                    })?;
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join().expect("thread panicked")?;
    }
    let counts: Vec<u64> = per_key.iter().map(|c| c.load(Ordering::SeqCst)).collect();
    ensure!(
        counts.iter().all(|&c| c == 1),
        "executions per key: {counts:?}"
    );
    Ok(())
}
