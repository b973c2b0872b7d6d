//! Cost against table size: `begin` latency with 10 thousand, 1 million
//! (and, with `--scale N`, more) records in the table, and sweep
//! throughput on expired records. Records are written with plain SQL in
//! large transactions (the engine would take hours for 10 million); they
//! are well-formed succeeded records with the fingerprint of the bench
//! body, so `begin` replays them.

use std::path::Path as FsPath;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use idem::{BeginRequest, Decision, Engine, Policy, RecordKey, SqliteOptions, SqliteStore};
use rusqlite::{Connection, params};
use serde_json::json;

use crate::bare::{Bare, now_ms};
use crate::common::{BODY, Path, Report, Rng, Settings, engine_op, percentile};

/// Records per fill transaction: large enough that commits do not
/// dominate the fill, small enough to keep the WAL file modest.
const FILL_BATCH: u64 = 50_000;

/// Records one sweep call deletes: the proxy's default `sweep_batch`.
const SWEEP_BATCH: u32 = 1_000;

/// Operations measured at each table size.
fn samples(settings: &Settings) -> usize {
    if settings.smoke { 20 } else { 2_000 }
}

/// The bench body's fingerprint as the engine stores it: the hash and the
/// fingerprint version it was computed with.
struct Print {
    hash: String,
    version: i64,
}

/// Appends records `from..to` to the table: succeeded with `print`,
/// expiring at `expires_at`.
fn fill(path: &FsPath, from: u64, to: u64, print: &Print, expires_at: i64) -> Result<()> {
    let mut conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(30))?;
    conn.execute_batch("PRAGMA synchronous = NORMAL")?;
    let now = now_ms();
    let mut at = from;
    while at < to {
        let end = (at + FILL_BATCH).min(to);
        let tx = conn.transaction()?;
        {
            let mut stmt = tx.prepare_cached(
                "INSERT INTO idempotency_record (scope_key, biz_type, idem_key, request_hash, \
                 fingerprint_version, status, fencing_token, revision, attempts, created_at, \
                 updated_at, expires_at, result_ref) \
                 VALUES ('bench', 'order.create', ?1, ?2, ?5, 'succeeded', 1, 2, 1, ?3, ?3, ?4, \
                 'order-1')",
            )?;
            for i in at..end {
                stmt.execute(params![
                    format!("fill-{i:010}"),
                    print.hash,
                    now,
                    expires_at,
                    print.version
                ])?;
            }
        }
        tx.commit()?;
        at = end;
    }
    Ok(())
}

fn fill_key(i: u64) -> RecordKey {
    RecordKey::new("bench", "order.create", format!("fill-{i:010}"))
}

fn p50_p99(mut d: Vec<Duration>) -> (f64, f64) {
    d.sort_unstable();
    let us = |x: Duration| x.as_secs_f64() * 1e6;
    (us(percentile(&d, 0.5)), us(percentile(&d, 0.99)))
}

/// Runs the scale measurements.
pub fn run(settings: &Settings, report: &mut Report) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.db");
    let store = SqliteStore::open(&path, SqliteOptions::default())?;
    let engine = Engine::builder().storage(store).build()?;
    // One record written by the engine gives the bench body's fingerprint.
    let probe = RecordKey::new("bench", "order.create", "probe");
    engine_op(&engine, Path::NewKey, &probe)?;
    let fingerprint = Connection::open(&path)?.query_row(
        "SELECT request_hash, fingerprint_version FROM idempotency_record WHERE idem_key = 'probe'",
        [],
        |r| {
            Ok(Print {
                hash: r.get(0)?,
                version: r.get(1)?,
            })
        },
    )?;
    let bare = Bare::open(&path)?;
    let n = samples(settings);
    println!("\nscale: begin latency against table size ({n} operations each), µs");
    println!(
        "{:>12}  {:>9} {:>9}  {:>9} {:>9}  {:>9} {:>9}",
        "records", "new p50", "new p99", "replay p50", "replay p99", "SELECT p50", "SELECT p99"
    );
    let mut filled = 0;
    let mut rng = Rng::new(42);
    for &size in &settings.scale_sizes {
        fill(
            &path,
            filled,
            size,
            &fingerprint,
            now_ms() + 30 * 86_400_000,
        )?;
        filled = size;
        let (mut new, mut replay, mut select) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..n {
            let key = RecordKey::new("bench", "order.create", format!("new-{size}-{i}"));
            let req = BeginRequest::json(key, BODY, Policy::default());
            let at = Instant::now();
            let d = engine.begin(&req)?;
            new.push(at.elapsed());
            if !matches!(d, Decision::Execute(_)) {
                bail!("a new key did not execute: {}", d.name());
            }
            let key = fill_key(rng.below(size));
            let req = BeginRequest::json(key.clone(), BODY, Policy::default());
            let at = Instant::now();
            let d = engine.begin(&req)?;
            replay.push(at.elapsed());
            if !matches!(d, Decision::Replay(_)) {
                bail!("a filled key did not replay: {}", d.name());
            }
            let at = Instant::now();
            bare.op(Path::Replay, &key)?;
            select.push(at.elapsed());
        }
        let (n50, n99) = p50_p99(new);
        let (r50, r99) = p50_p99(replay);
        let (s50, s99) = p50_p99(select);
        println!("{size:>12}  {n50:>9.1} {n99:>9.1}  {r50:>9.1} {r99:>9.1}  {s50:>9.1} {s99:>9.1}");
        report.add(json!({
            "section": "scale", "records": size,
            "new_key_begin_p50_us": n50, "new_key_begin_p99_us": n99,
            "replay_begin_p50_us": r50, "replay_begin_p99_us": r99,
            "bare_select_p50_us": s50, "bare_select_p99_us": s99,
        }));
    }
    drop(engine);
    drop(bare);

    // Sweep: a fresh file full of expired records.
    let sweep_path = dir.path().join("sweep.db");
    let store = SqliteStore::open(&sweep_path, SqliteOptions::default())?;
    fill(&sweep_path, 0, settings.sweep_records, &fingerprint, 1)?;
    let engine = Engine::builder().storage(store).build()?;
    let at = Instant::now();
    let mut deleted = 0u64;
    loop {
        let n = engine.sweep(SWEEP_BATCH)?;
        if n == 0 {
            break;
        }
        deleted += u64::from(n);
    }
    let secs = at.elapsed().as_secs_f64();
    if deleted != settings.sweep_records {
        bail!(
            "sweep deleted {deleted} of {} records",
            settings.sweep_records
        );
    }
    let rate = deleted as f64 / secs;
    println!(
        "sweep: {deleted} expired records in {secs:.2} s, {rate:.0} records/s (batches of {SWEEP_BATCH})"
    );
    report.add(json!({
        "section": "sweep", "records": deleted, "seconds": secs, "records_per_s": rate,
        "batch": SWEEP_BATCH,
    }));
    Ok(())
}
