//! The engine on SQLite against the bare-SQL baseline: new key, replay and
//! mismatch at each thread count, baseline and engine alternating round
//! after round on two database files with the same settings.

use std::sync::Mutex;

use anyhow::{Context, Result, anyhow};
use idem::{Engine, SqliteOptions, SqliteStore};

use crate::bare::{self, Bare};
use crate::common::{
    Compared, Path, Report, STORED_KEYS, Samples, Settings, engine_op, idle_note, key_for, round,
    stored_key,
};

/// Runs the path measurements.
pub fn run(settings: &Settings, report: &mut Report) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let max_threads = settings.threads.iter().copied().max().unwrap_or(1);
    let store = SqliteStore::open(
        dir.path().join("idem.db"),
        SqliteOptions {
            pool_size: u32::try_from(max_threads.max(8))?,
            ..SqliteOptions::default()
        },
    )?;
    let engine = Engine::builder().storage(store).build()?;
    let bare_path = dir.path().join("bare.db");
    bare::create(&bare_path)?;
    let bare: Vec<Mutex<Bare>> = (0..max_threads)
        .map(|_| Bare::open(&bare_path).map(Mutex::new))
        .collect::<Result<_>>()?;
    let stored = if settings.smoke { 50 } else { STORED_KEYS };
    for i in 0..stored {
        engine_op(&engine, Path::NewKey, &stored_key(i))?;
        lock(&bare[0])?.op(Path::NewKey, &stored_key(i))?;
    }
    measure(settings, report, "sqlite", &engine, &bare, stored)
}

fn lock(m: &Mutex<Bare>) -> Result<std::sync::MutexGuard<'_, Bare>> {
    m.lock()
        .map_err(|_| anyhow!("a baseline connection was poisoned"))
}

/// Measures every path at every thread count; `stored` keys exist.
fn measure(
    settings: &Settings,
    report: &mut Report,
    section: &str,
    engine: &Engine,
    bare: &[Mutex<Bare>],
    stored: usize,
) -> Result<()> {
    Report::compared_header(&format!(
        "SQLite, engine against bare SQL: {} rounds x {} operations per thread; ops/s are \
         medians over rounds, latencies over all operations{}",
        settings.rounds,
        settings.ops,
        idle_note(settings)
    ));
    // New keys name the run (side and thread count), so runs never collide.
    let key = |path, who: &str, threads: usize, r, t, i| {
        key_for(path, &format!("{who}{threads}"), r, t, i, stored)
    };
    for &path in &settings.paths {
        for &threads in &settings.threads {
            let (mut b, mut e) = (Samples::default(), Samples::default());
            for r in 0..settings.rounds {
                round(threads, settings.ops, settings.idle_gap, &mut b, |t, i| {
                    lock(&bare[t])?.op(path, &key(path, "bare", threads, r, t, i))
                })
                .context("bare SQL")?;
                round(threads, settings.ops, settings.idle_gap, &mut e, |t, i| {
                    engine_op(engine, path, &key(path, "idem", threads, r, t, i))
                })
                .context("engine")?;
            }
            report.compared(Compared {
                section,
                path,
                threads,
                bare: b,
                idem: e,
            });
        }
    }
    Ok(())
}
