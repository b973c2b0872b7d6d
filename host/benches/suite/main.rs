//! idem's benchmark suite: what idem costs against the bare SQL an
//! idempotency check cannot avoid, and where the time goes.
//!
//! Parts (run in this order; `--only` picks some):
//!
//! - `paths`: the engine on SQLite against the bare-SQL baseline, new key,
//!   replay and mismatch, at 1, 2 and 8 threads;
//! - `group`: group commit on against off, 32 concurrent callers,
//!   `synchronous=NORMAL` and `=FULL`;
//! - `guest`: the guest's own cost: fingerprints of 200 B, 4 KiB and
//!   64 KiB bodies, one host→guest call, one instantiation;
//! - `scale`: `begin` latency against table size, sweep throughput;
//! - `proxy`: `idem serve` under wrk against the upstream direct;
//! - `layer`: an axum service with `IdempotencyLayer` under wrk against the
//!   same service without it, and behind a hand-written SQL check (the
//!   floor of what a check on SQLite adds there);
//! - `calls`: the `layer` part's apps called directly on one thread, with
//!   no network: the CPU the layer and the check add per request, without
//!   what a server pays to be woken and to use its sockets;
//! - `pg`: the engine on PostgreSQL against bare SQL on the same server.
//!
//! Every ratio pairs idem with its baseline in the same run, alternating
//! round by round, because shared machines are noisy.
//!
//! Run with `cargo bench -p idem --bench suite` (5 rounds x 2 000
//! operations; not yet timed on the 2-vCPU machine); `-- --quick` is
//! shorter (about three minutes there), `-- --smoke` is the CI check (seconds);
//! `--only paths,guest` picks parts, `--threads 1,8` the thread counts,
//! `--path replay,new-key` the paths of the `paths` part, `--rounds 3
//! --ops 50000` the counts of the `paths` part (long runs of one path for a
//! profiler),
//! `--idle-us 100` has each operation of the `paths` and `pg` parts start
//! after its thread slept that long (as a server's thread sleeps between
//! requests), `--scale 10000000` adds a table size, `--compare-bin PATH` has the
//! `proxy` part measure another `idem` binary (an earlier build) in the
//! same rounds, `--wrk-normal` runs wrk at the normal scheduling policy
//! instead of as `SCHED_BATCH` (`proxy::Wrk` says why). The table is
//! printed and the
//! figures are written to `target/idem-bench.json`.

mod bare;
mod body;
mod calls;
mod common;
mod group;
mod guest;
mod layer;
mod paths;
#[cfg(feature = "postgres")]
mod pg;
mod proxy;
mod scale;

use anyhow::{Context, Result, bail};

use common::{Report, Settings};

/// The parts, in the order they run.
const PARTS: [&str; 8] = [
    "paths", "group", "guest", "scale", "proxy", "layer", "calls", "pg",
];

fn list<T: std::str::FromStr>(value: &str, flag: &str) -> Result<Vec<T>> {
    value
        .split(',')
        .map(|v| v.trim().parse::<T>())
        .collect::<Result<_, _>>()
        .map_err(|_| anyhow::anyhow!("{flag} takes a comma-separated list of numbers"))
}

/// A positive count given to `flag`.
fn count(value: Option<String>, flag: &str) -> Result<usize> {
    value
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .with_context(|| format!("{flag} takes a positive number"))
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().is_some_and(|a| a == layer::SERVE_APP) {
        // A child of the `layer` part: serve until killed.
        args.next();
        return layer::serve_app(args);
    }
    let mut settings = Settings::full();
    let mut only: Option<Vec<String>> = None;
    let mut threads = None;
    let mut paths = None;
    let mut rounds = None;
    let mut ops = None;
    let mut extra_sizes: Vec<u64> = Vec::new();
    let mut compare_bin = None;
    let mut wrk_normal = false;
    let mut out =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/idem-bench.json");
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => settings = Settings::quick(),
            "--smoke" => settings = Settings::smoke(),
            "--only" => {
                let v = args.next().context("--only takes a list of parts")?;
                only = Some(v.split(',').map(str::to_owned).collect());
            }
            "--threads" => {
                threads = Some(list(
                    &args.next().context("--threads takes a list")?,
                    "--threads",
                )?)
            }
            "--path" => {
                let v = args.next().context("--path takes a list of paths")?;
                paths = Some(
                    v.split(',')
                        .map(|p| {
                            common::Path::parse(p.trim()).with_context(|| {
                                format!("unknown path {p}; the paths are new-key, replay, mismatch")
                            })
                        })
                        .collect::<Result<Vec<_>>>()?,
                );
            }
            "--rounds" => rounds = Some(count(args.next(), "--rounds")?),
            "--ops" => ops = Some(count(args.next(), "--ops")?),
            "--idle-us" => {
                let us = count(args.next(), "--idle-us")?;
                settings.idle_gap = std::time::Duration::from_micros(u64::try_from(us)?);
            }
            "--scale" => {
                extra_sizes = list(&args.next().context("--scale takes a list")?, "--scale")?
            }
            "--out" => out = args.next().context("--out takes a file")?.into(),
            "--wrk-normal" => wrk_normal = true,
            "--compare-bin" => {
                compare_bin = Some(args.next().context("--compare-bin takes a file")?.into())
            }
            // What `cargo bench` and `cargo test` pass to every bench target.
            "--bench" | "--nocapture" => {}
            other => bail!("unknown argument {other}; see the top of host/benches/suite/main.rs"),
        }
    }
    if let Some(t) = threads {
        settings.threads = t;
    }
    if let Some(p) = paths {
        settings.paths = p;
    }
    if let Some(r) = rounds {
        settings.rounds = r;
    }
    if let Some(o) = ops {
        settings.ops = o;
    }
    settings.compare_bin = compare_bin;
    settings.wrk_batch = !wrk_normal;
    settings.scale_sizes.extend(extra_sizes);
    settings.scale_sizes.sort_unstable();
    settings.scale_sizes.dedup();
    if let Some(o) = &only
        && let Some(bad) = o.iter().find(|p| !PARTS.contains(&p.as_str()))
    {
        bail!("unknown part {bad}; the parts are {}", PARTS.join(", "));
    }
    let wanted = |part: &str| only.as_ref().is_none_or(|o| o.iter().any(|p| p == part));
    let mut report = Report::new();
    for part in PARTS {
        if !wanted(part) {
            continue;
        }
        let result = match part {
            "paths" => paths::run(&settings, &mut report),
            "group" => group::run(&settings, &mut report),
            "guest" => guest::run(&settings, &mut report),
            "scale" => scale::run(&settings, &mut report),
            "proxy" => proxy::run(&settings, &mut report),
            "layer" => layer::run(&settings, &mut report),
            "calls" => calls::run(&settings, &mut report),
            #[cfg(feature = "postgres")]
            "pg" => pg::run(&settings, &mut report),
            _ => {
                println!("\n{part}: skipped, not built in (the postgres feature is off)");
                Ok(())
            }
        };
        result.with_context(|| format!("benchmark part {part}"))?;
    }
    report.write(&out)?;
    println!("\nfigures written to {}", out.display());
    Ok(())
}
