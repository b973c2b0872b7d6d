//! The tower layer in-process: an axum service with the layer against the
//! same service without it, each a child process (this bench binary run
//! with `--serve-app`), loaded by wrk; the difference in the process's CPU
//! time per request is what the layer adds.
//!
//! The handler reads the order's body, numbers an order and answers 201
//! with a small JSON body. The layer runs on SQLite with the default
//! configuration (a key is required on POST; the wrk script sends one,
//! with credentials). Kinds, at 1 and 32 connections: new keys (the layer
//! claims, runs the handler, stores the answer) and one fixed key (the
//! layer replays it; the handler does not run); and new keys at 32
//! connections on a store with group commit (`SqliteOptions::group_commit`,
//! where a write that would wait for a group moves to a blocking thread).

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::common::{Report, Settings};
use crate::proxy::{Child, Kind, Target, have_wrk, measure, start_server, write_script, wrk};
use anyhow::{Context, Result, bail};
use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use idem::layer::IdempotencyLayer;
use idem::proxy::ProxyConfig;
use idem::{Engine, SqliteOptions, SqliteStore};

/// The first argument that makes this binary serve the app instead of
/// measuring: `--serve-app bare|layer DB`.
pub const SERVE_APP: &str = "--serve-app";

/// The handler both apps run: it reads the order's body, as a service
/// that creates orders does, and answers a new order number. Reading the
/// body matters to the comparison: hyper hands a body over in a later
/// poll of the connection's task, which costs the bare app a wake-up that
/// a handler ignoring its body would not pay, and the layer always reads
/// the body (to fingerprint it).
fn app() -> Router {
    let counter = Arc::new(AtomicU64::new(0));
    Router::new().route(
        "/orders",
        post(move |body: Bytes| {
            let n = counter.fetch_add(1, Ordering::Relaxed);
            async move {
                (
                    axum::http::StatusCode::CREATED,
                    [("content-type", "application/json")],
                    format!("{{\"order\":\"order-{n}\",\"bytes\":{}}}", body.len()),
                )
            }
        }),
    )
}

/// Serves the app (`bare`: without the layer; `layer`: with it, on the
/// SQLite file `db`) on a free port of 127.0.0.1 until killed; prints
/// `listening on ADDR` first. Runs on tokio's default multi-threaded
/// runtime, as an axum service would.
pub fn serve_app(mut args: impl Iterator<Item = String>) -> Result<()> {
    let kind = args.next().context("--serve-app takes bare or layer")?;
    let db = args.next().context("--serve-app takes a database file")?;
    let app = match kind.as_str() {
        "bare" => app(),
        "layer" | "layer-grouped" => {
            let options = SqliteOptions {
                group_commit: kind == "layer-grouped",
                ..SqliteOptions::default()
            };
            let store = SqliteStore::open(&db, options)?;
            let engine = Engine::builder().storage(store).build()?;
            app().layer(IdempotencyLayer::new(engine, ProxyConfig::default())?)
        }
        other => bail!("--serve-app takes bare, layer or layer-grouped, not {other}"),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("listening on {}", listener.local_addr()?);
        axum::serve(listener, app).await?;
        Ok(())
    })
}

/// Starts this binary as `--serve-app kind db`.
fn spawn_app(kind: &str, db: &std::path::Path) -> Result<(Child, Target)> {
    let exe = std::env::current_exe().context("the bench binary's path")?;
    let mut cmd = Command::new(exe);
    cmd.arg(SERVE_APP).arg(kind).arg(db);
    start_server(cmd, "listening on ")
}

/// Runs the layer measurements.
pub fn run(settings: &Settings, report: &mut Report) -> Result<()> {
    if !have_wrk() {
        println!("\nlayer: skipped, wrk is not installed (apt-get install wrk)");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let script = write_script(dir.path())?;
    let (_bare, bare) = spawn_app("bare", &dir.path().join("unused.db"))?;
    let (_layer, layered) = spawn_app("layer", &dir.path().join("idem.db"))?;
    let (_grouped, grouped) = spawn_app("layer-grouped", &dir.path().join("grouped.db"))?;
    // The fixed key, completed once before it is replayed; a warm-up of
    // every kind.
    wrk(&script, layered, (1, 1), "fixed", "warm")?;
    wrk(&script, layered, (1, 32), "new", "warm")?;
    wrk(&script, bare, (1, 32), "new", "warm")?;
    wrk(&script, grouped, (1, 32), "new", "warm")?;
    let kinds: [Kind<'_>; 9] = [
        ("bare, new keys", bare, "new", 1),
        ("layer, first requests", layered, "new", 1),
        ("bare, fixed key", bare, "fixed", 1),
        ("layer, replays", layered, "fixed", 1),
        ("bare, new keys", bare, "new", 32),
        ("layer, first requests", layered, "new", 32),
        ("layer, first, grouped", grouped, "new", 32),
        ("bare, fixed key", bare, "fixed", 32),
        ("layer, replays", layered, "fixed", 32),
    ];
    let rows = measure(
        settings,
        &script,
        &kinds,
        "layer",
        "an axum service with and without IdempotencyLayer (SQLite); CPU is the service \
         process's user + system time per request",
        report,
    )?;
    let cpus: Vec<f64> = rows.iter().map(|l| l.cpu_us_per_request).collect();
    println!(
        "the layer adds {:+.1} us CPU per first request and {:+.1} us per replay at 1 \
         connection ({:+.1} and {:+.1} at 32)",
        cpus[1] - cpus[0],
        cpus[3] - cpus[2],
        cpus[5] - cpus[4],
        cpus[8] - cpus[7],
    );
    println!(
        "with group commit, first requests at 32 connections run at {:.2}x the rate \
         without it ({:+.1} us CPU each)",
        rows[6].rps / rows[5].rps,
        cpus[6] - cpus[5],
    );
    Ok(())
}
