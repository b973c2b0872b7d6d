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
//!
//! A fourth app is the floor the layer is held against: the same service
//! behind a hand-written check that runs the bare-SQL baseline's statements
//! ([`crate::bare`]) on the request's thread: one `SELECT` of the key's
//! row, which answers a replay; on a miss, the claim's `INSERT` (its own
//! commit), the handler, and an `UPDATE` that stores the answer (a second
//! commit). No fingerprint, no lease, no fencing, no component: what it
//! adds over the bare service is what any SQLite-backed check pays in this
//! server, on this machine, in this run. Each runtime worker has its own
//! connection, so at 32 connections its writes meet at SQLite's lock (the
//! busy handler), as a hand-written check's connections would.

use std::cell::RefCell;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::bare::{self, Bare};
use crate::common::{Report, Settings};
use crate::proxy::{Child, Kind, Target, Wrk, have_wrk, measure, start_server};
use anyhow::{Context, Result, bail};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{Next, from_fn};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem::layer::IdempotencyLayer;
use idem::proxy::ProxyConfig;
use idem::{Engine, RecordKey, SqliteOptions, SqliteStore};

/// The first argument that makes this binary serve the app instead of
/// measuring: `--serve-app bare|layer|layer-grouped|bare-sql DB`.
pub const SERVE_APP: &str = "--serve-app";

/// The handler every app runs: it reads the order's body, as a service
/// that creates orders does, and answers a new order number. Reading the
/// body matters to the comparison: hyper hands a body over in a later
/// poll of the connection's task, which costs the bare app a wake-up that
/// a handler ignoring its body would not pay, and the layer always reads
/// the body (to fingerprint it).
pub(crate) fn app() -> Router {
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

/// The largest body the hand-written check reads: the layer's default
/// `max_body_bytes`, so both refuse the same requests.
const BARE_SQL_MAX_BODY: usize = idem::api::DEFAULT_MAX_BODY_BYTES as usize;

/// The database file of the hand-written check (`--serve-app bare-sql`).
static BARE_SQL_DB: OnceLock<PathBuf> = OnceLock::new();

thread_local! {
    /// Each runtime worker's own connection to [`BARE_SQL_DB`], opened on
    /// its first request, as the store keeps one per thread.
    static BARE_SQL: RefCell<Option<Bare>> = const { RefCell::new(None) };
}

/// Runs `f` on this thread's connection to the hand-written check's file.
fn with_bare_sql<R>(f: impl FnOnce(&Bare) -> Result<R>) -> Result<R> {
    BARE_SQL.with(|cell| {
        let mut slot = cell.borrow_mut();
        let bare = match &mut *slot {
            Some(bare) => bare,
            empty => {
                let db = BARE_SQL_DB
                    .get()
                    .context("the check's database is not set")?;
                empty.insert(Bare::open(db)?)
            }
        };
        f(bare)
    })
}

/// The hand-written check around the handler: see the module's doc. The
/// scope is the `Authorization` header, as the layer's default.
async fn bare_sql_check(request: Request, next: Next) -> Response {
    match bare_sql_answer(request, next).await {
        Ok(response) => response,
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")).into_response(),
    }
}

async fn bare_sql_answer(request: Request, next: Next) -> Result<Response> {
    let (parts, body) = request.into_parts();
    let header_str = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .with_context(|| format!("no {name} header"))
    };
    let key = RecordKey::new(
        header_str("authorization")?,
        "orders",
        header_str("idempotency-key")?,
    );
    let body = axum::body::to_bytes(body, BARE_SQL_MAX_BODY).await?;
    let json = HeaderValue::from_static("application/json");
    if let Some(stored) = with_bare_sql(|b| b.find(&key))? {
        let stored = stored.context("a claimed key has no stored answer yet")?;
        return Ok((StatusCode::CREATED, [(header::CONTENT_TYPE, json)], stored).into_response());
    }
    let Some(id) = with_bare_sql(|b| b.claim(&key))? else {
        return Ok(StatusCode::CONFLICT.into_response());
    };
    let response = next.run(Request::from_parts(parts, Body::from(body))).await;
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, BARE_SQL_MAX_BODY).await?;
    with_bare_sql(|b| b.settle(id, None, Some(&body)))?;
    Ok(Response::from_parts(parts, Body::from(body)))
}

/// The app with the layer on the SQLite file `db` (group commit or not),
/// with the default configuration.
pub(crate) fn layered_app(db: &std::path::Path, group_commit: bool) -> Result<Router> {
    let options = SqliteOptions {
        group_commit,
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(db, options)?;
    let engine = Engine::builder().storage(store).build()?;
    Ok(app().layer(IdempotencyLayer::new(engine, ProxyConfig::default())?))
}

/// The app behind the hand-written check, on the new file `db`; once per
/// process.
pub(crate) fn checked_app(db: &std::path::Path) -> Result<Router> {
    bare::create(db)?;
    BARE_SQL_DB
        .set(db.to_owned())
        .map_err(|_| anyhow::anyhow!("the check's database was set twice"))?;
    Ok(app().layer(from_fn(bare_sql_check)))
}

/// Serves the app (`bare`: without the layer; `layer`: with it, on the
/// SQLite file `db`; `bare-sql`: behind the hand-written check, on `db`)
/// on a free port of 127.0.0.1 until killed; prints
/// `listening on ADDR` first. Runs on tokio's default multi-threaded
/// runtime, as an axum service would.
pub fn serve_app(mut args: impl Iterator<Item = String>) -> Result<()> {
    let kind = args
        .next()
        .context("--serve-app takes bare, layer, layer-grouped or bare-sql")?;
    let db = args.next().context("--serve-app takes a database file")?;
    let app = match kind.as_str() {
        "bare" => app(),
        "layer" => layered_app(db.as_ref(), false)?,
        "layer-grouped" => layered_app(db.as_ref(), true)?,
        "bare-sql" => checked_app(db.as_ref())?,
        other => bail!("--serve-app takes bare, layer, layer-grouped or bare-sql, not {other}"),
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
    let wrk = Wrk::new(dir.path(), settings)?;
    let (_bare, bare) = spawn_app("bare", &dir.path().join("unused.db"))?;
    let (_layer, layered) = spawn_app("layer", &dir.path().join("idem.db"))?;
    let (_grouped, grouped) = spawn_app("layer-grouped", &dir.path().join("grouped.db"))?;
    let (_checked, checked) = spawn_app("bare-sql", &dir.path().join("bare-sql.db"))?;
    // The fixed key, completed once before it is replayed; a warm-up of
    // every kind.
    wrk.run(layered, (1, 1), "fixed", "warm")?;
    wrk.run(checked, (1, 1), "fixed", "warm")?;
    wrk.run(layered, (1, 32), "new", "warm")?;
    wrk.run(bare, (1, 32), "new", "warm")?;
    wrk.run(grouped, (1, 32), "new", "warm")?;
    wrk.run(checked, (1, 32), "new", "warm")?;
    let kinds: [Kind<'_>; 13] = [
        ("bare, new keys", bare, "new", 1),
        ("layer, first requests", layered, "new", 1),
        ("bare, fixed key", bare, "fixed", 1),
        ("layer, replays", layered, "fixed", 1),
        ("bare, new keys", bare, "new", 32),
        ("layer, first requests", layered, "new", 32),
        ("layer, first, grouped", grouped, "new", 32),
        ("bare, fixed key", bare, "fixed", 32),
        ("layer, replays", layered, "fixed", 32),
        ("bare SQL, first", checked, "new", 1),
        ("bare SQL, replays", checked, "fixed", 1),
        ("bare SQL, replays", checked, "fixed", 32),
        ("bare SQL, first", checked, "new", 32),
    ];
    let rows = measure(
        settings,
        &wrk,
        &kinds,
        "layer",
        "an axum service with and without IdempotencyLayer (SQLite), and behind a \
         hand-written SQL check; CPU is the service process's user + system time per request",
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
    let floor = |check: usize, layer: usize, bare: usize| {
        let (floor, added) = (cpus[check] - cpus[bare], cpus[layer] - cpus[bare]);
        format!(
            "{floor:+.1} us (the layer {added:+.1}, {:.1}x)",
            added / floor
        )
    };
    println!(
        "a hand-written SQL check adds {} per first request and {} per replay at 1 \
         connection; {} per replay at 32",
        floor(9, 1, 0),
        floor(10, 3, 2),
        floor(11, 8, 7),
    );
    println!(
        "at 32 connections, first requests run at {:.2}x the bare service's rate behind the \
         hand-written check (p99 {:.1} ms) and at {:.2}x behind the layer (p99 {:.1} ms)",
        rows[12].rps / rows[4].rps,
        rows[12].p99_us / 1000.0,
        rows[5].rps / rows[4].rps,
        rows[5].p99_us / 1000.0,
    );
    Ok(())
}
