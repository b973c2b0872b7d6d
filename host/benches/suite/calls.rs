//! The tower layer's own cost, without a network: the `layer` part's three
//! apps (the bare axum service, the service with `IdempotencyLayer` on
//! SQLite, the service behind the hand-written SQL check) called directly
//! (`tower::ServiceExt::oneshot`) on one thread, and replays on two at once,
//! app after app round by round, with the request and the answer's body as
//! a client would send and read them.
//!
//! Under wrk, every figure also carries what the server pays to be woken,
//! to read a socket and to write one; at one connection that is most of it,
//! and it varies with how the scheduler treats the load generator. Here
//! nothing sleeps, and what an app adds over the bare service is the CPU
//! its middleware spends on a request. The CPU is the process's
//! (`CLOCK_PROCESS_CPUTIME_ID`), so work moved to another thread counts.

use anyhow::{Context, Result, ensure};
use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::json;
use tower::ServiceExt;

use crate::common::{Report, Settings, median};
use crate::layer::{app, checked_app, layered_app};

/// Replays per app per round: about a third of a second of the layer's.
const REPLAYS_PER_ROUND: usize = 20_000;

/// First requests per app per round: each writes twice, about a tenth of
/// a millisecond.
const FIRSTS_PER_ROUND: usize = 2_000;

/// Calls per app per round of the CI smoke run.
const SMOKE_CALLS: usize = 20;

/// The request the `layer` part's wrk script sends: one order, with the
/// credentials that name its scope, under `key`.
fn order(key: &str) -> Result<Request<Body>> {
    Ok(Request::post("/orders")
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .header("authorization", "Bearer bench-client")
        .body(Body::from(r#"{"sku":"A1","qty":2}"#))?)
}

/// The process's CPU time, in microseconds.
fn process_cpu_us() -> Result<f64> {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill in.
    let read = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    ensure!(read == 0, "the process's CPU clock could not be read");
    Ok(t.tv_sec as f64 * 1e6 + t.tv_nsec as f64 / 1e3)
}

/// Sends `calls` orders to `app` from thread `t` (order `i` under
/// `key(t, i)`), reads each answer, and checks that it is the handler's
/// 201 (the first answer, or its replay).
async fn send(
    app: &Router,
    t: usize,
    calls: usize,
    key: &(impl Fn(usize, usize) -> String + Sync),
) -> Result<()> {
    for i in 0..calls {
        let answer = app.clone().oneshot(order(&key(t, i))?).await?;
        ensure!(
            answer.status() == StatusCode::CREATED,
            "answered {}, not 201",
            answer.status()
        );
        axum::body::to_bytes(answer.into_body(), usize::MAX).await?;
    }
    Ok(())
}

/// [`send`] on `threads` threads at once, each with a runtime of its own
/// (as runtime workers), sharing `app`; the CPU per call.
fn round(
    app: &Router,
    threads: usize,
    calls: usize,
    key: impl Fn(usize, usize) -> String + Sync,
) -> Result<f64> {
    let before = process_cpu_us()?;
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let key = &key;
                s.spawn(move || {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?
                        .block_on(send(app, t, calls, key))
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| {
            w.join()
                .map_err(|_| anyhow::anyhow!("a calling thread panicked"))?
        })
    })?;
    Ok((process_cpu_us()? - before) / (calls * threads) as f64)
}

/// Runs the direct-call measurements.
pub fn run(settings: &Settings, report: &mut Report) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let apps = [
        ("bare", app()),
        ("layer", layered_app(&dir.path().join("idem.db"), false)?),
        ("bare SQL", checked_app(&dir.path().join("bare-sql.db"))?),
    ];
    let (replays, firsts) = if settings.smoke {
        (SMOKE_CALLS, SMOKE_CALLS)
    } else {
        (REPLAYS_PER_ROUND, FIRSTS_PER_ROUND)
    };
    println!(
        "\ncalls: the layer part's apps called directly, no network ({} rounds; {replays} \
         replays and {firsts} first requests per app, thread and round; CPU is the \
         process's, per call, median over rounds)",
        settings.rounds
    );
    println!(
        "{:<15} {:>7} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "kind", "threads", "bare us", "layer us", "check us", "layer adds", "check adds"
    );
    for (_, app) in &apps[1..] {
        round(app, 1, 1, |_, _| "fixed".to_owned()).context("the fixed key's first request")?;
    }
    // The store's calls run on the calling thread, as on a runtime worker
    // (SQLite answers in microseconds). Two threads share one app as two
    // workers share a server's: what they add over one is what the layer's
    // shared state (pools, locks, caches) costs a busy server.
    // (kind, threads, calls per thread, a new key per call)
    let kinds = [
        ("replays", 1, replays, false),
        ("replays", 2, replays, false),
        ("first requests", 1, firsts, true),
    ];
    for (kind, threads, calls, new_keys) in kinds {
        let mut cpu: [Vec<f64>; 3] = Default::default();
        for r in 0..settings.rounds {
            for (j, (name, app)) in apps.iter().enumerate() {
                let key = |t: usize, i: usize| {
                    if new_keys {
                        format!("new-{r}-{t}-{i}")
                    } else {
                        "fixed".to_owned()
                    }
                };
                let per_call = round(app, threads, calls, key)
                    .with_context(|| format!("{name}, {kind}, {threads} threads"))?;
                cpu[j].push(per_call);
            }
        }
        let [bare, layer, check] = cpu.map(|samples| median(&samples));
        println!(
            "{kind:<15} {threads:>7} {bare:>10.1} {layer:>10.1} {check:>10.1} {:>+12.1} {:>+12.1}",
            layer - bare,
            check - bare
        );
        report.add(json!({
            "section": "calls",
            "kind": kind,
            "threads": threads,
            "calls_per_round": calls,
            "rounds": settings.rounds,
            "bare_cpu_us_per_call": bare,
            "layer_cpu_us_per_call": layer,
            "check_cpu_us_per_call": check,
        }));
    }
    Ok(())
}
