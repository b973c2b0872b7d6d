//! What the guest itself costs, on the in-memory store so that storage
//! adds next to nothing:
//!
//! - `begin` on a succeeded key (one `get` import), with JSON bodies of
//!   200 B, 4 KiB and 64 KiB fingerprinted through RFC 8785 canonical JSON,
//!   and the 64 KiB body as `raw` (hashed only);
//! - one host→guest call: `sweep(0)` on an empty store (one export call,
//!   two trivial imports);
//! - one instantiation: a new engine's first call, less a warm call.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use idem::{BeginRequest, Decision, Engine, MemoryStore, Policy, RecordKey, Success};
use serde_json::json;

use crate::body::json_body;
use crate::common::{Report, Settings, percentile};

/// The body sizes measured.
const SIZES: [(usize, &str); 3] = [(200, "200 B"), (4 * 1024, "4 KiB"), (64 * 1024, "64 KiB")];

fn time(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    let mut d: Vec<Duration> = Vec::with_capacity(reps);
    for _ in 0..reps {
        let at = Instant::now();
        f()?;
        d.push(at.elapsed());
    }
    d.sort_unstable();
    Ok((
        percentile(&d, 0.5).as_secs_f64() * 1e6,
        percentile(&d, 0.99).as_secs_f64() * 1e6,
    ))
}

/// Runs the guest-cost measurements.
pub fn run(settings: &Settings, report: &mut Report) -> Result<()> {
    let engine = Engine::builder().storage(MemoryStore::new()).build()?;
    let reps = settings.guest_reps;
    println!("\nguest cost (in-memory store), {reps} repetitions: median and p99 in µs");
    println!("{:<44} {:>9} {:>9}", "what", "p50 us", "p99 us");
    let line = |report: &mut Report, what: String, (p50, p99): (f64, f64)| {
        println!("{what:<44} {p50:>9.1} {p99:>9.1}");
        report.add(json!({"section": "guest", "what": what, "p50_us": p50, "p99_us": p99}));
    };
    let policy = Policy {
        max_body_bytes: 1024 * 1024,
        ..Policy::default()
    };
    for (size, label) in SIZES {
        let body = json_body(size);
        for raw in [false, true] {
            if raw && size != 64 * 1024 {
                continue;
            }
            let key = RecordKey::new("bench", "guest", format!("{size}-{raw}"));
            let req = if raw {
                BeginRequest::raw(key, body.as_bytes(), policy.clone())
            } else {
                BeginRequest::json(key, body.as_bytes(), policy.clone())
            };
            let t = match engine.begin(&req)? {
                Decision::Execute(t) => t,
                other => bail!("the first begin of {label} decided {other:?}"),
            };
            engine.complete(&t, &req.policy, &Success::with_ref("r"))?;
            let timed = time(reps, || match engine.begin(&req)? {
                Decision::Replay(_) => Ok(()),
                other => bail!("unexpected decision {}", other.name()),
            })?;
            let kind = if raw {
                "raw, hashed only"
            } else {
                "json, canonical"
            };
            line(
                report,
                format!("begin (replay), {label} body, {kind}"),
                timed,
            );
        }
    }
    let call = time(reps, || engine.sweep(0).map(drop).map_err(Into::into))?;
    line(report, "one host->guest call (sweep 0)".into(), call);
    let first = time(reps.min(500), || {
        let fresh = Engine::builder().storage(MemoryStore::new()).build()?;
        fresh.sweep(0)?;
        Ok(())
    })?;
    line(
        report,
        "instantiation (first call less a warm call)".into(),
        (first.0 - call.0, first.1 - call.1),
    );
    Ok(())
}
