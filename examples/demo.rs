//! A tour of idem on a SQLite file: the first request executes, a retry is
//! replayed, a conflicting retry is refused, a concurrent duplicate is told
//! to wait, and a crashed owner's key is reconciled instead of re-executed.
//!
//! Run with `cargo run --example demo`.

use anyhow::{Result, bail};
use idem::{
    ActionResult, BeginRequest, Decision, Engine, ExpiredLease, ManualClock, Policy, RecordKey,
    RunInTransaction, RunOutcome, SqliteOptions, SqliteStore, StoreError, Success,
};

fn main() -> Result<()> {
    let dir = tempfile_dir()?;
    let db = dir.join("demo.db");
    let store = SqliteStore::open(&db, SqliteOptions::default())?;
    // The business table lives in the same database file.
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, idem_key TEXT, sku TEXT)",
        )
    })??;
    tx.commit()?;

    // A virtual clock, so the demo can jump past a lease without sleeping.
    let clock = ManualClock::new(1_767_225_600_000);
    let lookup_db = db.clone();
    let engine = Engine::builder()
        .storage(store)
        .clock(clock.clone())
        // Reconciliation asks the business table whether an order exists.
        .results(move |key: &RecordKey| {
            let conn = rusqlite::Connection::open(&lookup_db)
                .map_err(|e| StoreError::Unavailable(e.to_string()))?;
            conn.query_row(
                "SELECT 'order-' || id FROM orders WHERE idem_key = ?1",
                [&key.idem_key],
                |r| r.get::<_, String>(0),
            )
            .map(Some)
            .or_else(|e| match e {
                rusqlite::Error::QueryReturnedNoRows => Ok(None),
                e => Err(StoreError::Unavailable(e.to_string())),
            })
        })
        .build()?;

    let policy = Policy {
        expired_lease: ExpiredLease::Reconcile,
        ..Policy::default()
    };
    let key = RecordKey::new(
        "user-42",
        "order.create",
        "3f1c2a9e-5b7d-4e8f-9a10-1b2c3d4e5f60",
    );
    let create = |body: &str| BeginRequest::json(key.clone(), body, policy.clone());

    // The business write and the "succeeded" transition share one SQLite
    // transaction: the seed's step 4.
    let place_order = |req: &BeginRequest| {
        engine.run_in_transaction(req, |_, conn| {
            match conn.execute(
                "INSERT INTO orders (idem_key, sku) VALUES (?1, 'A1')",
                [&req.key.idem_key],
            ) {
                Ok(_) => ActionResult::Succeeded(Success::with_ref(format!(
                    "order-{}",
                    conn.last_insert_rowid()
                ))),
                Err(e) => ActionResult::retryable("db-error", e),
            }
        })
    };

    println!("1. first request");
    report(place_order(&create(r#"{"sku":"A1","qty":2}"#))?);

    println!("2. the client retries (same body, other key order and spacing)");
    report(place_order(&create(r#"{ "qty": 2, "sku": "A1" }"#))?);

    println!("3. the same key with a different body");
    report(place_order(&create(r#"{"sku":"B7","qty":1}"#))?);

    println!("4. a duplicate while the first is still running");
    let other = RecordKey::new("user-42", "order.create", "slow-request-1");
    let slow = BeginRequest::json(other.clone(), "{}", policy.clone());
    let Decision::Execute(_ticket) = engine.begin(&slow)? else {
        bail!("a new key executes");
    };
    report(RunOutcome::NotExecuted(engine.begin(&slow)?));

    println!("5. the owner crashed after writing its order; its lease runs out");
    let conn = rusqlite::Connection::open(&db)?;
    conn.execute(
        "INSERT INTO orders (idem_key, sku) VALUES (?1, 'C3')",
        [&other.idem_key],
    )?;
    clock.advance(policy.lease_ms);
    report(place_order(&slow)?);

    let orders: i64 = conn.query_row("SELECT count(*) FROM orders", [], |r| r.get(0))?;
    println!("orders in the table: {orders} (one per key, whatever the retries)");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

fn report(outcome: RunOutcome) {
    match outcome {
        RunOutcome::Executed { ticket, result, .. } => {
            println!("   executed (attempt {}): {result:?}", ticket.attempt)
        }
        RunOutcome::LostOwnership { .. } => println!("   executed, but a newer owner took over"),
        RunOutcome::NotExecuted(d) => match d {
            Decision::Replay(r) => println!("   replayed: {:?}, not executed again", r.result_ref),
            Decision::Mismatch(m) => {
                println!(
                    "   refused: the key was used for another request ({}…)",
                    m.stored_prefix
                )
            }
            Decision::InProgress(b) => {
                println!("   in progress: retry after {} ms", b.retry_after_ms)
            }
            other => println!("   {}: {other:?}", other.name()),
        },
    }
}

fn tempfile_dir() -> Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("idem-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
