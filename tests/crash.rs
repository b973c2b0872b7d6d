//! Crash consistency: a writer process (`idem-test-worker crash`) runs
//! random operations on one SQLite file and is killed with SIGKILL at a
//! random point, 100 times in a row on the same file. After each kill:
//!
//! - `PRAGMA integrity_check` is ok;
//! - no record is in a state the engine cannot produce (checked field by
//!   field in SQL, and by the engine's own check through `inspect`);
//! - the business side effects match the successes exactly: every `orders`
//!   row belongs to one succeeded ownership generation (one still stored,
//!   or one that a sweep or a replacement retired, logged by a trigger in
//!   the same transaction), and every success has exactly one row.
//!
//! The kill point is chosen by counting the worker's progress lines, not by
//! sleeping: some workers die before they print anything, most after a
//! random number of operations.

use std::io::{BufRead, BufReader, Lines, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use idem::{Engine, ManualClock, RecordKey, SqliteOptions, SqliteStore};

const WORKER: &str = env!("CARGO_BIN_EXE_idem-test-worker");
const T0: u64 = 1_767_225_600_000;

/// Kills, as the issue asks.
const ITERATIONS: u64 = 100;
/// The most operations a run reports before it is killed: short runs, so
/// that the 100 kills land at many different points and the test stays fast.
const MAX_OPS_BEFORE_KILL: u64 = 40;
/// Virtual time between two runs, after the last time a killed worker
/// wrote: more than the crash policy's lease (1 s), so that claims left by a
/// killed worker expire, and a retention (5 s) passes every few runs, so
/// that records are swept and re-created.
const CLOCK_STEP_MS: u64 = 1_500;

/// The business table, and the log of successes that left the record
/// table (swept, or replaced after retention), written by triggers inside
/// the transaction that removes them.
const SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS orders (
        idem_key TEXT NOT NULL, record_id INTEGER NOT NULL, fencing_token INTEGER NOT NULL);
    CREATE TABLE IF NOT EXISTS retired_success (
        record_id INTEGER NOT NULL, fencing_token INTEGER NOT NULL);
    CREATE TRIGGER IF NOT EXISTS success_swept AFTER DELETE ON idempotency_record
        WHEN old.status = 'succeeded'
        BEGIN INSERT INTO retired_success VALUES (old.id, old.fencing_token); END;
    CREATE TRIGGER IF NOT EXISTS success_replaced AFTER UPDATE ON idempotency_record
        WHEN old.status = 'succeeded'
            AND (new.status != 'succeeded' OR new.fencing_token != old.fencing_token)
        BEGIN INSERT INTO retired_success VALUES (old.id, old.fencing_token); END;";

/// Records whose fields do not fit their status, or whose counters cannot
/// have been written by the engine.
const IMPOSSIBLE: &str = "
    SELECT * FROM idempotency_record WHERE NOT (
        fencing_token >= 1 AND revision >= 1 AND attempts >= 1 AND attempts <= fencing_token
        AND created_at <= updated_at AND length(request_hash) = 64
        AND CASE status
            WHEN 'processing' THEN lease_until IS NOT NULL AND expires_at IS NULL
                AND result_ref IS NULL
            WHEN 'succeeded' THEN expires_at IS NOT NULL AND lease_until IS NULL
                AND failure IS NULL AND result_ref = 'order-' || id || '-' || fencing_token
            WHEN 'failed' THEN expires_at IS NOT NULL AND lease_until IS NULL
                AND failure IS NOT NULL AND result_ref IS NULL
            WHEN 'released' THEN expires_at IS NOT NULL AND lease_until IS NULL
                AND result_ref IS NULL
            WHEN 'outcome-unknown' THEN expires_at IS NULL AND result_ref IS NULL
            ELSE 0 END)";

/// A small xorshift generator for the kill points.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x % n
    }
}

fn count(conn: &rusqlite::Connection, sql: &str) -> Result<i64> {
    Ok(conn.query_row(sql, [], |r| r.get(0))?)
}

/// What one check found.
struct Tally {
    orders: i64,
    succeeded: i64,
    retired: i64,
}

fn check(db: &Path, engine: &Engine) -> Result<Tally> {
    let store = SqliteStore::open(db, SqliteOptions::default())?;
    ensure!(store.integrity_check()?, "PRAGMA integrity_check failed");
    let conn = rusqlite::Connection::open(db)?;
    let impossible = count(&conn, &format!("SELECT count(*) FROM ({IMPOSSIBLE})"))?;
    if impossible > 0 {
        let mut stmt = conn.prepare(&format!(
            "SELECT id, status, fencing_token, revision, attempts, lease_until, expires_at, \
             result_ref, failure IS NOT NULL, created_at, updated_at FROM ({IMPOSSIBLE})"
        ))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(format!(
                    "id {} {} token {} revision {} attempts {} lease {:?} expires {:?} ref {:?} \
                     failure {} created {} updated {}",
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, i64>(4)?,
                    r.get::<_, Option<i64>>(5)?,
                    r.get::<_, Option<i64>>(6)?,
                    r.get::<_, Option<String>>(7)?,
                    r.get::<_, bool>(8)?,
                    r.get::<_, i64>(9)?,
                    r.get::<_, i64>(10)?,
                ))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        bail!("records in an impossible state: {rows:#?}");
    }
    // The engine's own check of every record.
    let mut stmt = conn.prepare("SELECT scope_key, biz_type, idem_key FROM idempotency_record")?;
    let keys = stmt
        .query_map([], |r| {
            Ok(RecordKey::new(
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    for key in keys {
        engine
            .inspect(&key)
            .with_context(|| format!("inspect {key:?}"))?;
    }
    let doubled = count(
        &conn,
        "SELECT count(*) FROM (SELECT 1 FROM orders
            GROUP BY record_id, fencing_token HAVING count(*) > 1)",
    )?;
    ensure!(doubled == 0, "{doubled} generations executed twice");
    let orphans = count(
        &conn,
        "SELECT count(*) FROM orders o WHERE NOT EXISTS (
            SELECT 1 FROM idempotency_record r WHERE r.id = o.record_id
                AND r.fencing_token = o.fencing_token AND r.status = 'succeeded')
        AND NOT EXISTS (SELECT 1 FROM retired_success t
            WHERE t.record_id = o.record_id AND t.fencing_token = o.fencing_token)",
    )?;
    ensure!(orphans == 0, "{orphans} business effects without a success");
    let unbacked = count(
        &conn,
        "SELECT count(*) FROM idempotency_record r WHERE r.status = 'succeeded'
            AND NOT EXISTS (SELECT 1 FROM orders o
                WHERE o.record_id = r.id AND o.fencing_token = r.fencing_token)",
    )? + count(
        &conn,
        "SELECT count(*) FROM retired_success t WHERE NOT EXISTS (SELECT 1 FROM orders o
            WHERE o.record_id = t.record_id AND o.fencing_token = t.fencing_token)",
    )?;
    ensure!(
        unbacked == 0,
        "{unbacked} successes without a business effect"
    );
    let tally = Tally {
        orders: count(&conn, "SELECT count(*) FROM orders")?,
        succeeded: count(
            &conn,
            "SELECT count(*) FROM idempotency_record WHERE status = 'succeeded'",
        )?,
        retired: count(&conn, "SELECT count(*) FROM retired_success")?,
    };
    ensure!(
        tally.orders == tally.succeeded + tally.retired,
        "business effects {} != successes {} + retired successes {}",
        tally.orders,
        tally.succeeded,
        tally.retired
    );
    Ok(tally)
}

/// The worker that forks the runs (`idem-test-worker crash-zygote`): it
/// compiles the engine component once, so a run starts in milliseconds.
struct Zygote {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Zygote {
    fn start() -> Result<Zygote> {
        let mut child = Command::new(WORKER)
            .arg("crash-zygote")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().context("stdin")?;
        let lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
        let mut z = Zygote {
            child,
            stdin,
            lines,
        };
        ensure!(z.line()? == "ready", "the zygote did not start");
        Ok(z)
    }

    fn line(&mut self) -> Result<String> {
        self.lines
            .next()
            .context("the zygote's output ended")?
            .map_err(Into::into)
    }

    /// Forks one run and kills it with SIGKILL after `ops` operations
    /// (before it reports anything when `ops` is `None`). Returns how many
    /// operations it reported.
    fn run_and_kill(&mut self, db: &Path, now: u64, seed: u64, ops: Option<u64>) -> Result<u64> {
        let db = db.to_str().context("path")?;
        writeln!(self.stdin, "run {db} {now} {seed}")?;
        self.stdin.flush()?;
        let pid: libc::pid_t = loop {
            let line = self.line()?;
            if let Some(pid) = line.strip_prefix("pid ") {
                break pid.parse()?;
            }
        };
        let mut done = 0;
        let result = (|| -> Result<()> {
            let Some(target) = ops else { return Ok(()) };
            while done < target {
                let line = self.line()?;
                if line.starts_with("bad ") {
                    bail!("the worker hit an engine error: {line}");
                }
                if line.starts_with("op ") {
                    done += 1;
                }
            }
            Ok(())
        })();
        // SAFETY: kill(2) on the zygote's child, which is not reaped before
        // the `reap` below, so its pid cannot have been reused.
        let killed = unsafe { libc::kill(pid, libc::SIGKILL) };
        ensure!(killed == 0, "kill: {}", std::io::Error::last_os_error());
        writeln!(self.stdin, "reap {pid}")?;
        self.stdin.flush()?;
        // What the run printed before it died is skipped.
        while self.line()? != format!("reaped {pid}") {}
        result.map(|()| done)
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn sigkill_at_random_points_leaves_a_consistent_database() -> Result<()> {
    let started = Instant::now();
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    {
        SqliteStore::open(&db, SqliteOptions::default())?;
        rusqlite::Connection::open(&db)?.execute_batch(SCHEMA)?;
    }
    let clock = ManualClock::new(T0);
    let checker = Engine::builder()
        .storage(SqliteStore::open(&db, SqliteOptions::default())?)
        .clock(clock.clone())
        .build()?;
    let mut zygote = Zygote::start()?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut total_ops = 0;
    let mut running = std::time::Duration::ZERO;
    let mut tally = None;
    let mut now = T0;
    for i in 0..ITERATIONS {
        // Each worker has its own clock: start it after every time the
        // killed ones wrote, so that time never goes back across workers.
        let written: Option<i64> = rusqlite::Connection::open(&db)?.query_row(
            "SELECT max(updated_at) FROM idempotency_record",
            [],
            |r| r.get(0),
        )?;
        let written = written.map_or(0, |t| u64::try_from(t).unwrap_or(0));
        now = now.max(written) + CLOCK_STEP_MS;
        clock.set(now);
        // One run in ten dies before it has done anything.
        let ops = (rng.below(10) != 0).then(|| rng.below(MAX_OPS_BEFORE_KILL) + 1);
        let run = Instant::now();
        total_ops += zygote
            .run_and_kill(&db, now, i, ops)
            .with_context(|| format!("run {i}"))?;
        running += run.elapsed();
        tally = Some(check(&db, &checker).with_context(|| format!("after kill {i}"))?);
    }
    let tally = tally.context("no run")?;
    println!(
        "crash: {ITERATIONS} kills, {total_ops} operations reported before them, \
         {} business effects = {} stored + {} retired successes, {:.1} s ({:.1} s in workers)",
        tally.orders,
        tally.succeeded,
        tally.retired,
        started.elapsed().as_secs_f64(),
        running.as_secs_f64()
    );
    ensure!(tally.orders > 0, "no business action ever succeeded");
    ensure!(tally.retired > 0, "no success was ever swept or replaced");
    Ok(())
}
