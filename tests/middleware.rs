//! End to end: the `middleware` component composed with the example
//! handler (`examples/order-handler`), served by `idem serve-component` on
//! a SQLite database or a PostgreSQL schema, driven by a blocking HTTP
//! client on 127.0.0.1.
//!
//! The handler prints one `order-handler: executed METHOD PATH -> STATUS`
//! line per execution to the server's stdout; the tests count those lines.
//!
//! The guest bounds are tested with the middleware-world variant of the
//! misbehaving guest (`tests/guests/misbehaving`, feature `middleware`):
//! the real middleware, whose wrapped handler loops or allocates without
//! end on the routes whose biz type asks for it.

mod common;
#[path = "support/serve.rs"]
mod serve;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use common::PgSchema;
use idem::{
    BeginRequest, Decision, Engine, Policy, PostgresStore, RecordKey, SqliteStore, SystemClock,
};
use serve::{CliOutput, Proxy, Resp, TEST_CLIENT, idem_ok, serve_component_with};

/// The start of the line the handler prints once per execution.
const EXECUTED: &str = "order-handler: executed ";

/// How long the server's stdout may take to show a handler's line after its
/// response arrived (the pipe is read by a thread).
const ARRIVAL: Duration = Duration::from_secs(10);

/// Concurrent duplicates sent at once: more than the machine's cores, so
/// that some really overlap.
const DUPLICATES: usize = 8;

/// The handler component (`examples/order-handler`), built for
/// wasm32-wasip2 with the guest profile by this package's build script.
const HANDLER_WASM: &str = concat!(env!("OUT_DIR"), "/order_handler.wasm");

/// `middleware` composed with the handler by `idem compose`, written once
/// per test process to `name` under the tests' temporary directory.
fn compose(middleware: Option<&Path>, name: &str) -> Result<PathBuf, String> {
    let handler = Path::new(HANDLER_WASM);
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let utf8 = |p: &Path| p.to_str().map(str::to_owned).ok_or("non-UTF-8 path");
    let mut args = vec![
        "compose".to_owned(),
        "--handler".to_owned(),
        utf8(handler)?,
        "--out".to_owned(),
        utf8(&out)?,
    ];
    if let Some(m) = middleware {
        args.extend(["--middleware".to_owned(), utf8(m)?]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    idem_ok(&args).map_err(|e| format!("{e:#}"))?;
    Ok(out)
}

/// The embedded middleware composed with the handler.
fn composed_wasm() -> Result<&'static Path> {
    static WASM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    WASM.get_or_init(|| compose(None, "order-service.wasm"))
        .as_deref()
        .map_err(|e| anyhow!("{e}"))
}

/// The misbehaving middleware (built by this package's build script)
/// composed with the handler.
fn misbehaving_wasm() -> Result<&'static Path> {
    static WASM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    WASM.get_or_init(|| {
        let middleware = Path::new(concat!(
            env!("OUT_DIR"),
            "/idem_misbehaving_middleware.wasm"
        ));
        compose(Some(middleware), "misbehaving-service.wasm")
    })
    .as_deref()
    .map_err(|e| anyhow!("{e}"))
}

/// Where a world's keys are stored.
enum Db {
    /// `idem.db` in the world's directory.
    Sqlite,
    /// A schema of the test's own.
    Postgres(PgSchema),
}

/// One test's world: a temporary directory (the SQLite database, the
/// configuration file), and a server on its database.
struct World {
    server: Proxy,
    db: Db,
    dir: tempfile::TempDir,
}

impl World {
    /// The shipped middleware with the handler, on SQLite, unconfigured.
    fn start() -> Result<Self> {
        Self::start_with(composed_wasm()?, Db::Sqlite, None)
    }

    /// `component` on `db`, with `config` as its `--config` file.
    fn start_with(component: &Path, db: Db, config: Option<&str>) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let config_path = dir.path().join("idem.toml");
        if let Some(toml) = config {
            std::fs::write(&config_path, toml)?;
        }
        let sqlite = dir.path().join("idem.db");
        let mut args: Vec<&OsStr> = Vec::new();
        if config.is_some() {
            args.extend([OsStr::new("--config"), config_path.as_os_str()]);
        }
        let server = match &db {
            Db::Sqlite => serve_component_with(component, sqlite.as_os_str(), &args)?,
            Db::Postgres(schema) => {
                args.extend([OsStr::new("--pg-schema"), OsStr::new(&schema.name)]);
                serve_component_with(component, OsStr::new(&schema.url), &args)?
            }
        };
        Ok(Self { server, db, dir })
    }

    /// `idem --db DB ARGS...` on this world's database.
    fn idem(&self, args: &[&str]) -> Result<CliOutput> {
        let sqlite = self.dir.path().join("idem.db");
        let mut all: Vec<&str> = vec!["--db"];
        match &self.db {
            Db::Sqlite => all.push(sqlite.to_str().context("non-UTF-8 path")?),
            Db::Postgres(schema) => all.extend([schema.url.as_str(), "--pg-schema", &schema.name]),
        }
        all.extend_from_slice(args);
        idem_ok(&all)
    }

    /// The stored state of `key` (biz type `biz`, the test client's scope),
    /// as `idem inspect --json` prints it.
    fn inspect(&self, biz: &str, key: &str) -> Result<serde_json::Value> {
        self.idem(&[
            "--json",
            "inspect",
            "--scope",
            &auth_scope(TEST_CLIENT),
            "--biz",
            biz,
            "--key",
            key,
        ])?
        .json()
    }

    /// An engine of this process's own on the world's database: another
    /// idem host beside the server.
    fn engine(&self) -> Result<Engine> {
        let builder = Engine::builder().clock(SystemClock::new());
        let builder = match &self.db {
            Db::Sqlite => builder.storage(SqliteStore::open(
                self.dir.path().join("idem.db"),
                Default::default(),
            )?),
            Db::Postgres(schema) => {
                builder.storage(PostgresStore::connect(&schema.url, schema.options())?)
            }
        };
        Ok(builder.build()?)
    }

    /// How many times the handler ran for `POST path`, waiting until the
    /// count reaches `expected` or [`ARRIVAL`] passes (the stdout pipe lags
    /// a little).
    fn executions(&self, path: &str, expected: usize) -> usize {
        let prefix = format!("{EXECUTED}POST {path} ");
        let deadline = Instant::now() + ARRIVAL;
        loop {
            let n = self
                .server
                .stdout_lines()
                .iter()
                .filter(|l| l.starts_with(&prefix))
                .count();
            if n >= expected || Instant::now() >= deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the server's stderr shows `text`, waiting for it at most
    /// [`ARRIVAL`] (the pipe is read by a thread, so a line written before
    /// an answer may be read after it).
    fn logged(&self, text: &str) -> bool {
        self.server.stderr_with(text, ARRIVAL).contains(text)
    }

    fn order(&self, key: &str, body: &str) -> Result<Resp> {
        self.server.post("/orders").key(key).json(body).send()
    }
}

#[test]
fn duplicates_run_the_handler_once_and_replay_its_answer() -> Result<()> {
    let w = World::start()?;
    let first = w.order("order-1", r#"{"sku":"A1","qty":2}"#)?;
    first.expect_status(201)?;
    ensure!(!first.replayed(), "the first answer is marked as replayed");
    let order_id = first.json()?["order_id"]
        .as_str()
        .context("no order_id")?
        .to_owned();

    // Same key, same request (keys in another order, other spacing: the
    // same JSON): the stored answer, byte for byte.
    for body in [r#"{"sku":"A1","qty":2}"#, r#"{ "qty": 2, "sku": "A1" }"#] {
        let again = w.order("order-1", body)?;
        again.expect_status(201)?;
        ensure!(again.replayed(), "a duplicate is not marked as replayed");
        ensure!(
            again.body == first.body,
            "the replay differs: {}",
            again.text()
        );
        ensure!(
            again.header("content-type") == first.header("content-type"),
            "the replay's content type differs"
        );
    }
    ensure!(
        w.executions("/orders", 1) == 1,
        "the handler ran {} times",
        w.executions("/orders", 2)
    );

    // A new key runs again, with a new order.
    let second = w.order("order-2", r#"{"sku":"A1","qty":2}"#)?;
    second.expect_status(201)?;
    ensure!(
        second.json()?["order_id"] != order_id.as_str(),
        "same order id"
    );
    ensure!(
        w.executions("/orders", 2) == 2,
        "the handler did not run for a new key"
    );

    // The key is in the store, under the proxy's biz type and the scope
    // of the client's credentials.
    let status = w.inspect("http", "order-1")?;
    ensure!(status["status"] == "succeeded", "inspect: {status}");
    Ok(())
}

/// The scope the proxy and the middleware derive from an `Authorization`
/// value.
fn auth_scope(authorization: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(authorization.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("auth:{hex}")
}

#[test]
fn unidentified_clients_are_refused_without_running() -> Result<()> {
    let w = World::start()?;
    // As `idem serve`'s default, `anonymous = "reject"`: a 401 with a
    // challenge, the handler not run, nothing stored.
    let r = w
        .server
        .post("/orders")
        .anonymous()
        .key("anon-1")
        .json(r#"{"sku":"A1","qty":1}"#)
        .send()?;
    let p = r.expect_problem(401, "client-unidentified")?;
    ensure!(
        p["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("Authorization"),
        "{p}"
    );
    ensure!(
        r.header("www-authenticate") == Some("Bearer realm=\"idem\""),
        "{:?}",
        r.headers
    );
    let stats = w.idem(&["--json", "stats"])?.json()?;
    ensure!(stats["total"] == 0, "stored: {stats}");
    // The key rules come first: a keyless POST is still 400 key-missing.
    w.server
        .post("/orders")
        .anonymous()
        .json("{}")
        .send()?
        .expect_problem(400, "key-missing")?;
    // With credentials the same key runs once: nothing was kept before.
    w.order("anon-1", r#"{"sku":"A1","qty":1}"#)?
        .expect_status(201)?;
    ensure!(
        w.executions("/orders", 1) == 1,
        "the handler ran {} times",
        w.executions("/orders", 2)
    );
    Ok(())
}

#[test]
fn concurrent_duplicates_run_the_handler_once() -> Result<()> {
    let w = Arc::new(World::start()?);
    let barrier = Arc::new(Barrier::new(DUPLICATES));
    let threads: Vec<_> = (0..DUPLICATES)
        .map(|_| {
            let (w, barrier) = (w.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                w.order("order-concurrent", r#"{"sku":"B2","qty":1}"#)
            })
        })
        .collect();
    let answers = threads
        .into_iter()
        .map(|t| t.join().map_err(|_| anyhow!("a client thread panicked"))?)
        .collect::<Result<Vec<_>>>()?;

    let created: Vec<&Resp> = answers.iter().filter(|r| r.status == 201).collect();
    ensure!(
        !created.is_empty(),
        "no duplicate got the order: {answers:?}"
    );
    for r in &answers {
        if r.status != 201 {
            // Still running when it arrived: told to retry, nothing ran.
            r.expect_problem(409, "request-in-progress")?;
            ensure!(r.header("retry-after").is_some(), "409 without Retry-After");
        }
    }
    ensure!(
        created.iter().all(|r| r.body == created[0].body),
        "the duplicates got different orders"
    );
    ensure!(
        created.iter().filter(|r| !r.replayed()).count() == 1,
        "not exactly one original answer"
    );
    ensure!(
        w.executions("/orders", 1) == 1,
        "the handler ran {} times",
        w.executions("/orders", 2)
    );

    // Once settled, every retry is a replay of that one order.
    let retry = w.order("order-concurrent", r#"{"sku":"B2","qty":1}"#)?;
    ensure!(
        retry.replayed() && retry.body == created[0].body,
        "{retry:?}"
    );
    ensure!(w.executions("/orders", 1) == 1, "a retry ran the handler");
    Ok(())
}

#[test]
fn mismatches_and_bad_keys_are_refused_without_running() -> Result<()> {
    let w = World::start()?;
    w.order("order-m", r#"{"sku":"C3","qty":1}"#)?
        .expect_status(201)?;
    // Same key, other body: 422 key-reused, the stored order not revealed.
    let other = w.order("order-m", r#"{"sku":"C3","qty":9}"#)?;
    other.expect_problem(422, "key-reused")?;
    other.expect_not_containing(&[b"ord-"])?;
    // Same key and body on another path: a different request too.
    let path = w
        .server
        .post("/reject")
        .key("order-m")
        .json(r#"{"sku":"C3","qty":1}"#)
        .send()?;
    path.expect_problem(422, "key-reused")?;
    // No key on a POST, an invalid key, two keys.
    w.server
        .post("/orders")
        .json("{}")
        .send()?
        .expect_problem(400, "key-missing")?;
    w.server
        .post("/orders")
        .key("\"unterminated")
        .json("{}")
        .send()?
        .expect_problem(400, "key-invalid")?;
    w.server
        .post("/orders")
        .key("k1")
        .key("k2")
        .json("{}")
        .send()?
        .expect_problem(400, "key-invalid")?;
    // Declared JSON, not JSON: the engine's invalid decision, field named.
    let bad = w.order("order-bad-json", "{not json")?;
    let p = bad.expect_problem(400, "invalid-request")?;
    ensure!(p["field"] == "body" && p["rule"] == "not-json", "{p}");
    ensure!(
        w.executions("/orders", 1) == 1,
        "a refused request ran the handler"
    );
    Ok(())
}

#[test]
fn failures_follow_their_disposition() -> Result<()> {
    let w = World::start()?;
    // 422 is a final failure: stored and replayed, the handler runs once.
    let first = w.server.post("/reject").key("rej-1").json("{}").send()?;
    first.expect_status(422)?;
    let again = w.server.post("/reject").key("rej-1").json("{}").send()?;
    again.expect_status(422)?;
    ensure!(again.replayed() && again.body == first.body, "{again:?}");
    // 503 is retryable: the key is released and the next duplicate runs.
    for _ in 0..2 {
        let r = w
            .server
            .post("/overloaded")
            .key("busy-1")
            .json("{}")
            .send()?;
        r.expect_status(503)?;
        ensure!(!r.replayed(), "a retryable failure was replayed");
    }
    ensure!(w.executions("/reject", 1) == 1, "a final failure ran again");
    ensure!(
        w.executions("/overloaded", 2) == 2,
        "a retryable failure was not run again"
    );
    // Reads pass straight through, with no key.
    w.server.get("/nowhere").send()?.expect_status(404)?;
    Ok(())
}

// ---------------------------------------------------------------------------
// The store scenario on SQLite and on PostgreSQL
// ---------------------------------------------------------------------------

/// Execute, replay, mismatch and in-progress, through the server on `w`'s
/// database.
fn store_scenario(w: &World) -> Result<()> {
    const BODY: &str = r#"{"sku":"S1","qty":3}"#;
    // Execute: the handler runs and its answer is stored.
    let first = w.order("scenario-1", BODY)?;
    first.expect_status(201)?;
    ensure!(!first.replayed(), "the first answer is marked as replayed");
    // Replay: the stored answer, marked, without running the handler.
    let again = w.order("scenario-1", BODY)?;
    again.expect_status(201)?;
    ensure!(again.replayed(), "a duplicate is not marked as replayed");
    ensure!(
        again.body == first.body,
        "the replay differs: {}",
        again.text()
    );
    ensure!(
        w.executions("/orders", 1) == 1,
        "the handler ran {} times",
        w.executions("/orders", 2)
    );
    // Mismatch: the same key with another body.
    w.order("scenario-1", r#"{"sku":"S1","qty":4}"#)?
        .expect_problem(422, "key-reused")?;
    // In progress: another idem host on the same database holds the key
    // (it claimed it for the very request the middleware would make, and
    // has not finished): the server answers 409 and does not run it.
    let mut claim = BeginRequest::json(
        RecordKey::new(auth_scope(TEST_CLIENT), "http", "scenario-2"),
        BODY,
        Policy::default(),
    );
    claim.attributes = vec![
        ("method".into(), "POST".into()),
        ("path".into(), "/orders".into()),
    ];
    match w.engine()?.begin(&claim)? {
        Decision::Execute(_) => {}
        other => anyhow::bail!("the other host's claim was answered {}", other.name()),
    }
    let busy = w.order("scenario-2", BODY)?;
    busy.expect_problem(409, "request-in-progress")?;
    ensure!(
        busy.header("retry-after").is_some(),
        "409 without Retry-After"
    );
    ensure!(
        w.executions("/orders", 2) == 1,
        "a key held by another host ran the handler"
    );
    let status = w.inspect("http", "scenario-1")?;
    ensure!(status["status"] == "succeeded", "inspect: {status}");
    Ok(())
}

#[test]
fn the_store_scenario_on_sqlite() -> Result<()> {
    store_scenario(&World::start()?)
}

#[test]
fn the_store_scenario_on_postgres() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let w = World::start_with(composed_wasm()?, Db::Postgres(schema), None)?;
    store_scenario(&w)?;
    // The keys are in the schema the server was given.
    let Db::Postgres(schema) = &w.db else {
        anyhow::bail!("not on PostgreSQL");
    };
    let mut c = schema.raw()?;
    let rows = c.query(
        &format!(
            "SELECT COUNT(*) FROM \"{}\".idempotency_record",
            schema.name
        ),
        &[],
    )?;
    let count: i64 = rows.first().context("no count")?.get(0);
    ensure!(count == 2, "{count} records in the schema");
    Ok(())
}

// ---------------------------------------------------------------------------
// The guest's deadline and memory cap
// ---------------------------------------------------------------------------

/// The deadline the bounded tests give the guest: short, so a looping
/// component is stopped quickly, and far above what an honest request
/// computes.
const DEADLINE: Duration = Duration::from_millis(200);

/// How late past its deadline a stopped request may be answered on a
/// loaded machine (two cores shared with other builds): one epoch tick,
/// scheduling delay and the HTTP exchange.
const LATENESS: Duration = Duration::from_secs(3);

/// The memory cap the bounded tests give the guest: room for the
/// middleware and the handler (a few MiB each), far below what the
/// allocating route asks for.
const MEMORY_CAP: u64 = 32 * 1024 * 1024;

/// The configuration of the bounded tests, with the guest deadline
/// `deadline`: routes whose biz types make the misbehaving middleware's
/// handler loop or allocate without end.
fn bounded_config(deadline: Duration) -> String {
    format!(
        r#"
guest_deadline_ms = {}
guest_memory_bytes = {MEMORY_CAP}

[[routes]]
path = "/loop"
biz_type = "misbehave-loop"

[[routes]]
path = "/allocate"
biz_type = "misbehave-allocate"
"#,
        deadline.as_millis()
    )
}

/// The key of a request the component was stopped on is left claimed (the
/// handler may have run): its retry is told to wait, and the same server
/// still serves other requests.
fn after_a_stop(w: &World, path: &str, key: &str) -> Result<()> {
    let retry = w.server.post(path).key(key).json("{}").send()?;
    retry.expect_problem(409, "request-in-progress")?;
    let order = w.order(&format!("{key}-order"), r#"{"sku":"A1","qty":1}"#)?;
    order.expect_status(201)?;
    ensure!(!order.replayed(), "a new key was replayed");
    ensure!(w.executions("/orders", 1) == 1, "the order did not run");
    Ok(())
}

#[test]
fn a_component_that_loops_is_stopped_at_its_deadline_and_the_server_goes_on() -> Result<()> {
    let w = World::start_with(
        misbehaving_wasm()?,
        Db::Sqlite,
        Some(&bounded_config(DEADLINE)),
    )?;
    let start = Instant::now();
    let stopped = w.server.post("/loop").key("loop-1").json("{}").send()?;
    let took = start.elapsed();
    let p = stopped.expect_problem(500, "internal-error")?;
    ensure!(
        p["guest_deadline_ms"] == u64::try_from(DEADLINE.as_millis())?,
        "{p}"
    );
    ensure!(
        took >= DEADLINE,
        "answered after {took:?}, before the deadline"
    );
    ensure!(took < DEADLINE + LATENESS, "answered only after {took:?}");
    ensure!(
        w.logged("ran past its deadline"),
        "the stop was not logged: {}",
        w.server.stderr()
    );
    after_a_stop(&w, "/loop", "loop-1")?;
    // Stopped again, as quickly: no instance outlived its stop.
    let start = Instant::now();
    w.server
        .post("/loop")
        .key("loop-2")
        .json("{}")
        .send()?
        .expect_problem(500, "internal-error")?;
    ensure!(start.elapsed() < DEADLINE + LATENESS);
    Ok(())
}

#[test]
fn a_component_that_allocates_without_end_hits_the_memory_cap() -> Result<()> {
    // The default deadline: filling the cap must not run into it.
    let w = World::start_with(
        misbehaving_wasm()?,
        Db::Sqlite,
        Some(&bounded_config(idem::engine::DEFAULT_GUEST_DEADLINE)),
    )?;
    let stopped = w
        .server
        .post("/allocate")
        .key("alloc-1")
        .json("{}")
        .send()?;
    let p = stopped.expect_problem(500, "internal-error")?;
    ensure!(p["guest_memory_bytes"] == MEMORY_CAP, "{p}");
    ensure!(
        w.logged("more than its memory limit"),
        "the stop was not logged: {}",
        w.server.stderr()
    );
    after_a_stop(&w, "/allocate", "alloc-1")?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Per-route policy from --config
// ---------------------------------------------------------------------------

#[test]
fn routes_from_the_config_file_set_biz_types_key_rules_and_server_errors() -> Result<()> {
    let w = World::start_with(
        composed_wasm()?,
        Db::Sqlite,
        Some(
            r#"
[defaults]
key = "optional"

[[routes]]
method = "POST"
path = "/orders"
biz_type = "order.create"
key = "required"

[[routes]]
path = "/overloaded"
biz_type = "overload"
server_errors = "store"
"#,
        ),
    )?;
    // /orders requires a key; elsewhere a keyless POST runs unguarded.
    w.server
        .post("/orders")
        .json("{}")
        .send()?
        .expect_problem(400, "key-missing")?;
    for _ in 0..2 {
        let r = w.server.post("/reject").json("{}").send()?;
        r.expect_status(422)?;
        ensure!(!r.replayed(), "an unkeyed request was replayed");
    }
    ensure!(
        w.executions("/reject", 2) == 2,
        "an unkeyed request did not run each time"
    );

    // Keys of /orders have its biz type: the same key on a route of
    // another biz type is another key, not a reuse.
    w.order("route-1", r#"{"sku":"R1","qty":1}"#)?
        .expect_status(201)?;
    let other = w.server.post("/reject").key("route-1").json("{}").send()?;
    other.expect_status(422)?;
    ensure!(
        other.json()?["error"] == "rejected" && !other.replayed(),
        "not the handler's own answer: {other:?}"
    );
    let status = w.inspect("order.create", "route-1")?;
    ensure!(status["status"] == "succeeded", "inspect: {status}");
    let status = w.inspect("http", "route-1")?;
    ensure!(status["status"] == "failed", "inspect: {status}");

    // server_errors = "store": the 503 is final, stored and replayed.
    let first = w
        .server
        .post("/overloaded")
        .key("busy-1")
        .json("{}")
        .send()?;
    first.expect_status(503)?;
    let again = w
        .server
        .post("/overloaded")
        .key("busy-1")
        .json("{}")
        .send()?;
    again.expect_status(503)?;
    ensure!(again.replayed() && again.body == first.body, "{again:?}");
    ensure!(
        w.executions("/overloaded", 1) == 1,
        "a stored 5xx ran again"
    );
    let status = w.inspect("overload", "busy-1")?;
    ensure!(status["status"] == "failed", "inspect: {status}");
    Ok(())
}

/// A body over the server's limit is refused with 413 before the rest of
/// it arrived. The answer says `Connection: close`, and the connection
/// closes: an answer promising keep-alive on a connection then closed
/// would make a client that pooled it lose its next request.
#[test]
fn a_body_over_the_limit_is_refused_and_the_connection_closed_as_said() -> Result<()> {
    use std::io::{Read, Write};

    let w = World::start()?;
    let addr = w
        .server
        .base
        .strip_prefix("http://")
        .context("server base URL")?;
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(ARRIVAL))?;
    let limit = idem::middleware::MAX_REQUEST_BODY_BYTES;
    // Declared larger than what is sent before the answer is read.
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: server\r\nAuthorization: {TEST_CLIENT}\r\n\
         Idempotency-Key: \"big\"\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        limit + 1000
    );
    s.write_all(head.as_bytes())?;
    s.write_all(&vec![b' '; limit + 1])?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut chunk).context("reading the answer")?;
        ensure!(n > 0, "closed before an answer");
        answer.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&answer).to_ascii_lowercase();
    ensure!(head.starts_with("http/1.1 413"), "{head}");
    ensure!(head.contains("connection: close"), "{head}");
    // The rest of the body and a second request: the server closes
    // without answering it.
    let _ = s.write_all(&vec![b' '; 999]);
    let _ = s.write_all(b"GET /orders HTTP/1.1\r\nHost: server\r\n\r\n");
    let mut rest = Vec::new();
    let closed = loop {
        match s.read(&mut chunk) {
            Ok(0) => break true,
            Ok(n) => rest.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(e) => return Err(e).context("waiting for the close"),
        }
    };
    ensure!(closed);
    ensure!(
        !String::from_utf8_lossy(&rest).contains("HTTP/1.1"),
        "a second answer on a connection said to close"
    );
    ensure!(w.executions("/orders", 0) == 0, "the handler ran");
    Ok(())
}
