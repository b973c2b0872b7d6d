//! Group commit: new keys (`begin` then `complete`) from many concurrent
//! callers on one SQLite file, with `SqliteOptions::group_commit` off (a
//! commit per claim and per completion) and on (the claims and completions
//! waiting at the same moment share one transaction), under
//! `synchronous=NORMAL` and `=FULL`. Off and on alternate round by round.

use std::time::Duration;

use anyhow::{Context, Result};
use idem::store::Synchronous;
use idem::{Engine, SqliteOptions, SqliteStore};
use serde_json::json;

use crate::common::{Path, Report, Samples, Settings, engine_op, key_for, round};

/// How long a writer waits for the lock, on both sides: 32 callers that
/// each commit with an fsync queue for longer than the default 5 s on a
/// slow or shared disk, and a timeout would end the measurement.
const BUSY_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs the group-commit measurements.
pub fn run(settings: &Settings, report: &mut Report) -> Result<()> {
    let callers = settings.group_callers;
    // Each caller does fewer operations than on the path table: there are
    // many more callers.
    let ops = (settings.ops / 4).max(5);
    println!(
        "\ngroup commit: {callers} concurrent callers, new keys, {} rounds x {ops} per caller \
         ({} with FULL); ops/s medians over rounds",
        settings.rounds,
        (ops / 8).max(3)
    );
    println!(
        "{:<12} {:>10} {:>10} {:>7}  {:>9} {:>9}",
        "synchronous", "off op/s", "on op/s", "on/off", "off p99", "on p99"
    );
    for (name, sync) in [("NORMAL", Synchronous::Normal), ("FULL", Synchronous::Full)] {
        // Every FULL commit waits for the disk: fewer operations per caller
        // keep the run short.
        let ops = if sync == Synchronous::Full {
            (ops / 8).max(3)
        } else {
            ops
        };
        let dir = tempfile::tempdir()?;
        let open = |file: &str, group_commit: bool| -> Result<Engine> {
            let store = SqliteStore::open(
                dir.path().join(file),
                SqliteOptions {
                    synchronous: sync,
                    group_commit,
                    busy_timeout: BUSY_TIMEOUT,
                    ..SqliteOptions::default()
                },
            )?;
            Ok(Engine::builder().storage(store).build()?)
        };
        let (off, on) = (open("off.db", false)?, open("on.db", true)?);
        let (mut s_off, mut s_on) = (Samples::default(), Samples::default());
        for r in 0..settings.rounds {
            round(callers, ops, Duration::ZERO, &mut s_off, |t, i| {
                engine_op(
                    &off,
                    Path::NewKey,
                    &key_for(Path::NewKey, "off", r, t, i, 0),
                )
            })
            .context("group commit off")?;
            round(callers, ops, Duration::ZERO, &mut s_on, |t, i| {
                engine_op(&on, Path::NewKey, &key_for(Path::NewKey, "on", r, t, i, 0))
            })
            .context("group commit on")?;
        }
        let (a, b) = (s_off.rate(), s_on.rate());
        let (pa, pb) = (s_off.percentile_us(0.99), s_on.percentile_us(0.99));
        println!(
            "{name:<12} {a:>10.0} {b:>10.0} {:>7.2}  {pa:>7.0}us {pb:>7.0}us",
            b / a
        );
        report.add(json!({
            "section": "group_commit", "synchronous": name, "callers": callers,
            "off_ops_per_s": a, "on_ops_per_s": b, "ratio": b / a,
            "off_p99_us": pa, "on_p99_us": pb,
        }));
    }
    Ok(())
}
