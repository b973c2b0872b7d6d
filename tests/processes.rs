//! Real OS processes against one SQLite file: a race between two processes,
//! and processes killed with SIGKILL while they hold a lease.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};

#[path = "support/options.rs"]
mod options;

use anyhow::{Context, Result, bail, ensure};
use idem::{
    BeginRequest, Decision, Engine, ExpiredLease, ManualClock, Policy, RecordKey, SqliteStore,
    StoreError, Success,
};

const WORKER: &str = env!("CARGO_BIN_EXE_idem-test-worker");
const T0: u64 = 1_767_225_600_000;

fn spawn(args: &[&str]) -> Result<(Child, BufReader<ChildStdout>)> {
    let mut child = Command::new(WORKER)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let out = BufReader::new(child.stdout.take().context("stdout")?);
    Ok((child, out))
}

fn read_line(out: &mut BufReader<ChildStdout>) -> Result<String> {
    let mut line = String::new();
    out.read_line(&mut line)?;
    Ok(line.trim().to_string())
}

fn orders(db: &std::path::Path, key: &str) -> Result<i64> {
    let conn = rusqlite::Connection::open(db)?;
    Ok(conn.query_row(
        "SELECT count(*) FROM orders WHERE idem_key = ?1",
        [key],
        |r| r.get(0),
    )?)
}

#[test]
fn two_processes_race_on_one_file() -> Result<()> {
    const KEYS: u32 = 300;
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    let db = db.to_str().context("path")?;
    let keys = KEYS.to_string();
    let mut workers = vec![spawn(&["race", db, &keys])?, spawn(&["race", db, &keys])?];
    for (_, out) in &mut workers {
        ensure!(read_line(out)? == "ready");
    }
    for (child, _) in &mut workers {
        writeln!(child.stdin.as_mut().context("stdin")?, "go")?;
    }
    let mut executed = 0;
    for (mut child, mut out) in workers {
        let line = read_line(&mut out)?;
        let n: u32 = line
            .strip_prefix("executed ")
            .with_context(|| format!("worker said {line:?}"))?
            .parse()?;
        executed += n;
        ensure!(child.wait()?.success());
    }
    ensure!(executed == KEYS, "executions reported: {executed}");
    let conn = rusqlite::Connection::open(db)?;
    let (rows, distinct): (i64, i64) = conn.query_row(
        "SELECT count(*), count(DISTINCT idem_key) FROM orders",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    ensure!(
        rows == i64::from(KEYS) && distinct == rows,
        "rows {rows}, distinct {distinct}"
    );
    Ok(())
}

/// Starts a worker that claims `k` at T0 and blocks, then kills it.
fn kill_holder(db: &str, k: &str, mode: &str) -> Result<String> {
    let (mut child, mut out) = spawn(&["hold", db, k, &T0.to_string(), mode])?;
    let line = read_line(&mut out)?;
    child.kill()?; // SIGKILL
    child.wait()?;
    Ok(line)
}

fn survivor(db: &std::path::Path, expired_lease: ExpiredLease) -> Result<(Engine, Policy)> {
    let store = SqliteStore::open(db, options::sqlite_options())?;
    let lookup_db = db.to_path_buf();
    let engine = Engine::builder()
        .storage(store)
        .clock(ManualClock::new(T0 + Policy::default().lease_ms))
        .results(move |key: &RecordKey| {
            let conn = rusqlite::Connection::open(&lookup_db)
                .map_err(|e| StoreError::Unavailable(e.to_string()))?;
            let n: i64 = conn
                .query_row(
                    "SELECT count(*) FROM orders WHERE idem_key = ?1",
                    [&key.idem_key],
                    |r| r.get(0),
                )
                .map_err(|e| StoreError::Unavailable(e.to_string()))?;
            Ok((n > 0).then(|| format!("order-for-{}", key.idem_key)))
        })
        .build()?;
    let policy = Policy {
        expired_lease,
        ..Policy::default()
    };
    Ok((engine, policy))
}

fn request(k: &str, policy: &Policy) -> BeginRequest {
    BeginRequest::json(
        RecordKey::new("tenant-1", "order.create", k),
        "{}",
        policy.clone(),
    )
}

#[test]
fn killed_after_business_write_is_reconciled_not_repeated() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    ensure!(kill_holder(db.to_str().context("path")?, "k1", "written")? == "holding");
    let (engine, policy) = survivor(&db, ExpiredLease::Reconcile)?;
    match engine.begin(&request("k1", &policy))? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-for-k1")),
        other => bail!("expected the found result to be replayed, got {other:?}"),
    }
    ensure!(orders(&db, "k1")? == 1, "executed exactly once");
    Ok(())
}

#[test]
fn killed_before_business_write_is_taken_over() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    ensure!(kill_holder(db.to_str().context("path")?, "k1", "claim")? == "holding");
    let (engine, policy) = survivor(&db, ExpiredLease::Reconcile)?;
    let Decision::Execute(t) = engine.begin(&request("k1", &policy))? else {
        bail!("nothing was written, so the key must execute again");
    };
    ensure!(t.fencing_token == 2 && t.attempt == 2, "{t:?}");
    engine.complete(&t, &policy, &Success::with_ref("order-1"))?;
    ensure!(orders(&db, "k1")? == 0);
    Ok(())
}

#[test]
fn killed_inside_business_transaction_leaves_nothing_half_written() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    ensure!(kill_holder(db.to_str().context("path")?, "k1", "in-tx")? == "holding true");
    let store = SqliteStore::open(&db, options::sqlite_options())?;
    ensure!(store.integrity_check()?, "integrity_check after SIGKILL");
    ensure!(
        orders(&db, "k1")? == 0,
        "the uncommitted business write is gone"
    );
    let (engine, policy) = survivor(&db, ExpiredLease::Manual)?;
    ensure!(matches!(
        engine.begin(&request("k1", &policy))?,
        Decision::OutcomeUnknown(_)
    ));
    let (engine, policy) = survivor(&db, ExpiredLease::Reconcile)?;
    ensure!(matches!(
        engine.begin(&request("k1", &policy))?,
        Decision::Execute(_)
    ));
    Ok(())
}

#[test]
fn killed_inside_one_transaction_leaves_no_claim_to_wait_out() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    ensure!(kill_holder(db.to_str().context("path")?, "k1", "one-tx")? == "holding true");
    let store = SqliteStore::open(&db, options::sqlite_options())?;
    ensure!(store.integrity_check()?, "integrity_check after SIGKILL");
    ensure!(
        orders(&db, "k1")? == 0,
        "the uncommitted business write is gone"
    );
    // The claim went with it: at the same instant, under the policy that
    // never executes an abandoned key again, the key is free, and its
    // first attempt runs.
    let engine = Engine::builder()
        .storage(store)
        .clock(ManualClock::new(T0))
        .build()?;
    let policy = Policy {
        expired_lease: ExpiredLease::Manual,
        ..Policy::default()
    };
    let Decision::Execute(t) = engine.begin(&request("k1", &policy))? else {
        bail!("the killed transaction left a claim behind");
    };
    ensure!(t.attempt == 1 && t.fencing_token == 1, "{t:?}");
    Ok(())
}
