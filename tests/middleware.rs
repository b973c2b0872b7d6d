//! End to end: the `middleware` component composed with the example
//! handler (`examples/order-handler`), served by `idem serve-component` on
//! a SQLite database, driven by a blocking HTTP client on 127.0.0.1.
//!
//! The handler prints one `order-handler: executed METHOD PATH -> STATUS`
//! line per execution to the server's stdout; the tests count those lines.

#[path = "support/serve.rs"]
mod serve;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use serve::{Proxy, Resp, TEST_CLIENT, idem_ok, serve_component};

/// The start of the line the handler prints once per execution.
const EXECUTED: &str = "order-handler: executed ";

/// How long the server's stdout may take to show a handler's line after its
/// response arrived (the pipe is read by a thread).
const ARRIVAL: Duration = Duration::from_secs(10);

/// Concurrent duplicates sent at once: more than the machine's cores, so
/// that some really overlap.
const DUPLICATES: usize = 8;

/// The handler component, built once per test process for wasm32-wasip2
/// with the guest profile, in a target directory of its own under the
/// tests' temporary directory (so it never waits on the outer build).
fn handler_wasm() -> Result<&'static Path> {
    static WASM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    WASM.get_or_init(|| {
        let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("wasm-examples");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "--locked", "-p", "order-handler"])
            .args(["--target", "wasm32-wasip2", "--profile", "guest"])
            .arg("--target-dir")
            .arg(&target_dir)
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .status()
            .map_err(|e| format!("running cargo: {e}"))?;
        if !status.success() {
            return Err(format!("building order-handler failed: {status}"));
        }
        Ok(target_dir.join("wasm32-wasip2/guest/order_handler.wasm"))
    })
    .as_deref()
    .map_err(|e| anyhow!("{e}"))
}

/// The middleware composed with the handler, written once per test
/// process by `idem compose`.
fn composed_wasm() -> Result<&'static Path> {
    static WASM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    WASM.get_or_init(|| {
        let handler = handler_wasm().map_err(|e| format!("{e:#}"))?;
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("order-service.wasm");
        idem_ok(&[
            "compose",
            "--handler",
            handler.to_str().ok_or("non-UTF-8 path")?,
            "--out",
            out.to_str().ok_or("non-UTF-8 path")?,
        ])
        .map_err(|e| format!("{e:#}"))?;
        Ok(out)
    })
    .as_deref()
    .map_err(|e| anyhow!("{e}"))
}

/// One test's world: a temporary database and a server on it.
struct World {
    server: Proxy,
    _dir: tempfile::TempDir,
}

impl World {
    fn start() -> Result<Self> {
        let wasm = composed_wasm()?;
        let dir = tempfile::tempdir()?;
        let server = serve_component(wasm, &dir.path().join("idem.db"))?;
        Ok(Self { server, _dir: dir })
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
    let db = w._dir.path().join("idem.db");
    let db = db.to_str().context("utf-8 path")?;
    let out = idem_ok(&[
        "--db",
        db,
        "--json",
        "inspect",
        "--scope",
        &auth_scope(TEST_CLIENT),
        "--biz",
        "http",
        "--key",
        "order-1",
    ])?;
    let status = out.json()?;
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
    let stats = idem_ok(&[
        "--db",
        w._dir
            .path()
            .join("idem.db")
            .to_str()
            .context("utf-8 path")?,
        "--json",
        "stats",
    ])?
    .json()?;
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
