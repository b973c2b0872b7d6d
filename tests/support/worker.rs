//! A worker process for the multi-process tests in `tests/processes.rs`.
//!
//! ```text
//! idem-test-worker race <db> <keys>           wait for "go" on stdin, then claim and
//!                                             execute keys 0..keys; print "executed N"
//! idem-test-worker hold <db> <key> <now> <mode>
//!     mode = claim:    claim the key, print "holding", block
//!     mode = written:  claim, write the business row outside any transaction, print
//!                      "holding", block (the crash between business write and status update)
//!     mode = in-tx:    claim, write the business row inside the business transaction,
//!                      print "holding", block before it commits
//! ```
//! The parent kills `hold` workers with SIGKILL.

use std::io::{BufRead, Write};

#[path = "options.rs"]
mod options;

use anyhow::{Context, Result, bail};
use idem::{
    ActionResult, BeginRequest, Decision, Engine, ManualClock, Policy, RecordKey, RunOutcome,
    SqliteStore, Success,
};

/// The business table the tests count side effects in. No unique
/// constraint: a second execution would show up as a second row.
pub const BUSINESS_SCHEMA: &str =
    "CREATE TABLE IF NOT EXISTS orders (idem_key TEXT NOT NULL, worker TEXT NOT NULL)";

fn engine(db: &str, clock: Option<ManualClock>) -> Result<(Engine, SqliteStore)> {
    let store = SqliteStore::open(db, options::sqlite_options())?;
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| c.execute(BUSINESS_SCHEMA, []))??;
    tx.commit()?;
    let mut builder = Engine::builder().storage(store.clone());
    if let Some(clock) = clock {
        builder = builder.clock(clock);
    }
    Ok((builder.build()?, store))
}

fn key(k: &str) -> RecordKey {
    RecordKey::new("tenant-1", "order.create", k)
}

fn block_forever() -> ! {
    loop {
        std::thread::park();
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let me = std::process::id().to_string();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["race", db, keys] => {
            let keys: u32 = keys.parse().context("keys")?;
            let (engine, _store) = engine(db, None)?;
            println!("ready");
            std::io::stdout().flush()?;
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line)?;
            let mut executed = 0;
            for i in 0..keys {
                let req = BeginRequest::json(key(&format!("k{i}")), "{}", Policy::default());
                let outcome = engine.run_in_transaction(&req, |_, conn| {
                    match conn.execute(
                        "INSERT INTO orders (idem_key, worker) VALUES (?1, ?2)",
                        (&req.key.idem_key, &me),
                    ) {
                        Ok(_) => ActionResult::Succeeded(Success::with_ref(format!("order-{i}"))),
                        Err(e) => ActionResult::retryable("db", e),
                    }
                })?;
                match outcome {
                    RunOutcome::Executed {
                        result: ActionResult::Succeeded(_),
                        ..
                    } => executed += 1,
                    RunOutcome::Executed { result, .. } => {
                        bail!("business write failed: {result:?}")
                    }
                    _ => {}
                }
            }
            println!("executed {executed}");
        }
        ["hold", db, k, now, mode] => {
            let clock = ManualClock::new(now.parse().context("now")?);
            let (engine, store) = engine(db, Some(clock))?;
            let req = BeginRequest::json(key(k), "{}", Policy::default());
            match *mode {
                "claim" | "written" => {
                    let Decision::Execute(_ticket) = engine.begin(&req)? else {
                        bail!("the key was not free");
                    };
                    if *mode == "written" {
                        let tx = store.begin_transaction()?;
                        tx.with_connection(|c| {
                            c.execute(
                                "INSERT INTO orders (idem_key, worker) VALUES (?1, ?2)",
                                (k, &me),
                            )
                        })??;
                        tx.commit()?;
                    }
                    println!("holding");
                    std::io::stdout().flush()?;
                    block_forever();
                }
                "in-tx" => {
                    engine.run_in_transaction(&req, |_, conn| {
                        let wrote = conn.execute(
                            "INSERT INTO orders (idem_key, worker) VALUES (?1, ?2)",
                            (k, &me),
                        );
                        println!("holding {}", wrote.is_ok());
                        let _ = std::io::stdout().flush();
                        block_forever();
                    })?;
                }
                other => bail!("unknown mode {other}"),
            }
        }
        _ => bail!("usage: idem-test-worker race <db> <keys> | hold <db> <key> <now> <mode>"),
    }
    Ok(())
}
