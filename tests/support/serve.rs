//! Runs the real `idem` binary for the proxy tests (`tests/proxy.rs`):
//! `idem serve` as a child process, the `inspect`/`stats`/`sweep`/
//! `reconcile` commands, and a small blocking HTTP client for the test's
//! own requests (all to 127.0.0.1).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use ureq::http;

#[path = "build.rs"]
mod build;

/// How long `idem serve` may take to print its listening line.
const STARTUP: Duration = Duration::from_secs(60);
/// How long a CLI command (`inspect`, `stats`, ...) may take.
const CLI: Duration = Duration::from_secs(30);
/// How long one HTTP exchange may take, end to end.
const HTTP: Duration = Duration::from_secs(20);

/// The `idem` binary of the `host` crate, built once per test process with
/// the profile of this test build, in the workspace's target directory.
///
/// No `--target`: with an explicit target triple cargo puts every artifact
/// under `target/<triple>/` and would rebuild Wasmtime and the rest of the
/// dependency tree a second time. Without it the binary is built for the
/// host, which is what this test process runs on.
///
/// Built as `cargo build --workspace --examples --bin idem` (see
/// [`build::workspace_build`]): after `cargo test --workspace`, nothing
/// compiles.
pub fn idem_bin() -> Result<&'static Path> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| {
        build::workspace_build()
            .bin("idem")
            .arg("--examples")
            .run()
            .map(|run| run.path().to_path_buf())
            .map_err(|e| format!("{e:#}"))
    })
    .as_deref()
    .map_err(|e| anyhow!("building the idem binary failed: {e}"))
}

/// Collects a child's stderr on a thread, for diagnostics.
struct StderrSink {
    text: Arc<Mutex<String>>,
    thread: Option<JoinHandle<()>>,
}

impl StderrSink {
    fn new(mut stderr: ChildStderr) -> Self {
        let text = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&text);
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Self {
            text,
            thread: Some(thread),
        }
    }

    fn text(&self) -> String {
        self.text.lock().unwrap().clone()
    }

    /// Waits for the pipe to close (call after the child exited).
    fn finish(&mut self) -> String {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.text()
    }
}

/// Options for `idem serve`.
pub struct Serve {
    upstream: String,
    db: std::ffi::OsString,
    /// Where `config` is written.
    config_dir: Option<PathBuf>,
    extra: Vec<String>,
    config: Option<String>,
    admin: bool,
    admin_token: Option<String>,
}

impl Serve {
    /// `idem serve --listen 127.0.0.1:0 --upstream UPSTREAM --db DB`.
    pub fn new(upstream: &str, db: &Path) -> Self {
        Self {
            upstream: upstream.to_string(),
            db: db.as_os_str().to_owned(),
            config_dir: db.parent().map(Path::to_path_buf),
            extra: Vec::new(),
            config: None,
            admin: false,
            admin_token: None,
        }
    }

    /// `idem serve ... --db URL --pg-schema SCHEMA` on PostgreSQL; a
    /// configuration is written to `config_dir`.
    pub fn postgres(upstream: &str, url: &str, schema: &str, config_dir: &Path) -> Self {
        Self {
            upstream: upstream.to_string(),
            db: url.into(),
            config_dir: Some(config_dir.to_path_buf()),
            extra: vec!["--pg-schema".to_string(), schema.to_string()],
            config: None,
            admin: false,
            admin_token: None,
        }
    }

    /// Writes `toml` next to the database and passes `--config`.
    pub fn config(mut self, toml: &str) -> Self {
        self.config = Some(toml.to_string());
        self
    }

    /// Passes `--workers N`.
    #[allow(dead_code)] // Not every suite picks its workers.
    pub fn workers(mut self, n: usize) -> Self {
        self.extra.extend(["--workers".to_string(), n.to_string()]);
        self
    }

    /// Passes `--clock-offset-file`: the proxy reads `clock`'s time.
    pub fn clock(mut self, clock: &TestClock) -> Self {
        self.extra.extend(clock.args().map(str::to_owned));
        self
    }

    /// Passes `--admin 127.0.0.1:0`.
    pub fn admin(mut self) -> Self {
        self.admin = true;
        self
    }

    /// Sets `IDEM_ADMIN_TOKEN` for the proxy: the operator endpoints' token.
    #[allow(dead_code)] // Not every suite uses the operator endpoints.
    pub fn admin_token(mut self, token: &str) -> Self {
        self.admin_token = Some(token.to_string());
        self
    }

    /// Starts the proxy and waits for its `idem listening on` line.
    pub fn start(self) -> Result<Proxy> {
        let bin = idem_bin()?;
        let mut cmd = Command::new(bin);
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0", "--upstream", &self.upstream])
            .arg("--db")
            .arg(&self.db)
            .args(&self.extra);
        if let Some(toml) = &self.config {
            let dir = self
                .config_dir
                .as_deref()
                .context("no directory for the config")?;
            // A fresh name per start: a test may start several proxies.
            let mut n = 0;
            let path = loop {
                let p = dir.join(format!("idem-{n}.toml"));
                if !p.exists() {
                    break p;
                }
                n += 1;
            };
            std::fs::write(&path, toml)?;
            cmd.arg("--config").arg(path);
        }
        if self.admin {
            cmd.args(["--admin", "127.0.0.1:0"]);
        }
        cmd.env_remove("IDEM_ADMIN_TOKEN");
        if let Some(token) = &self.admin_token {
            cmd.env("IDEM_ADMIN_TOKEN", token);
        }
        start(cmd, self.admin)
    }
}

/// The time of a test's `idem` processes: the system clock plus the
/// milliseconds in a file they all read (`--clock-offset-file`). The test
/// moves it forward past a lease or a retention instead of waiting.
pub struct TestClock {
    path: String,
}

impl TestClock {
    /// A clock with no offset yet, its file in `dir`.
    pub fn new(dir: &Path) -> Result<Self> {
        let path = dir.join("clock-offset-ms");
        let path = path
            .to_str()
            .context("a temporary path that is not UTF-8")?;
        Ok(Self {
            path: path.to_owned(),
        })
    }

    /// `--clock-offset-file FILE`, for an `idem` command line.
    pub fn args(&self) -> [&str; 2] {
        ["--clock-offset-file", &self.path]
    }

    /// Moves the time of every process reading this clock forward by `ms`.
    /// The file is replaced atomically: a reader never sees half of it.
    pub fn advance(&self, ms: u64) -> Result<()> {
        let now = match std::fs::read_to_string(&self.path) {
            Ok(text) => text.trim().parse::<u64>()?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(e.into()),
        };
        let next = format!("{}.next", self.path);
        std::fs::write(&next, (now + ms).to_string())?;
        std::fs::rename(&next, &self.path)?;
        Ok(())
    }
}

/// `idem serve-component COMPONENT --listen 127.0.0.1:0 --db DB`: serves a
/// composed middleware component; waits for its listening line.
pub fn serve_component(component: &Path, db: &Path) -> Result<Proxy> {
    serve_component_with(component, db.as_os_str(), &[])
}

/// `idem serve-component COMPONENT --listen 127.0.0.1:0 --db DB ARGS...`
/// (such as `--pg-schema S` or `--config FILE`); waits for its listening
/// line.
pub fn serve_component_with(
    component: &Path,
    db: &std::ffi::OsStr,
    args: &[&std::ffi::OsStr],
) -> Result<Proxy> {
    let mut cmd = Command::new(idem_bin()?);
    cmd.arg("serve-component")
        .arg(component)
        .args(["--listen", "127.0.0.1:0"])
        .arg("--db")
        .arg(db)
        .args(args);
    start(cmd, false)
}

/// Spawns `cmd` (an `idem` server) and waits for its `idem listening on`
/// line (and `idem admin on` line when `admin`).
fn start(mut cmd: Command, admin: bool) -> Result<Proxy> {
    let bin = PathBuf::from(cmd.get_program());
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {}", bin.display()))?;
    let stdout = child.stdout.take().context("stdout")?;
    let stderr = StderrSink::new(child.stderr.take().context("stderr")?);
    let lines = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = mpsc::channel();
    let all = Arc::clone(&lines);
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            all.lock().unwrap().push(line.clone());
            // Once nobody listens any more, keep draining the pipe.
            let _ = tx.send(line);
        }
    });
    let mut proxy = Proxy {
        child,
        pid: 0,
        base: String::new(),
        admin: None,
        stdout: lines,
        stderr,
        exited: None,
    };
    proxy.pid = proxy.child.id();
    let deadline = Instant::now() + STARTUP;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(url) = line.strip_prefix("idem admin on ") {
                    proxy.admin = Some(url.trim().to_string());
                } else if let Some(url) = line.strip_prefix("idem listening on ") {
                    proxy.base = url.trim().to_string();
                    break;
                }
            }
            Err(e) => {
                let _ = proxy.child.kill();
                let status = proxy.child.wait().ok();
                let err = proxy.stderr.finish();
                bail!(
                    "idem serve printed no listening line ({e}); exit {status:?}; \
                     stdout {:?}; stderr:\n{err}",
                    proxy.stdout.lock().unwrap()
                );
            }
        }
    }
    ensure!(
        proxy.base.starts_with("http://127.0.0.1:"),
        "listening on {:?}",
        proxy.base
    );
    ensure!(
        !admin || proxy.admin.is_some(),
        "--admin given but no `idem admin on` line before the listening line"
    );
    ensure!(
        admin || proxy.admin.is_none(),
        "an admin line without --admin"
    );
    Ok(proxy)
}

/// A running `idem serve`. Dropping it kills it (SIGKILL) and prints its
/// stderr, which the test harness shows only for a failing test.
pub struct Proxy {
    child: Child,
    pid: u32,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// `http://127.0.0.1:PORT` of the admin listener, with `--admin`.
    pub admin: Option<String>,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: StderrSink,
    exited: Option<ExitStatus>,
}

impl Proxy {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A request to `path`, as [`TEST_CLIENT`].
    pub fn request(&self, method: &str, path: &str) -> Req {
        Req::new(method, &self.url(path)).auth(TEST_CLIENT)
    }

    pub fn post(&self, path: &str) -> Req {
        self.request("POST", path)
    }

    pub fn get(&self, path: &str) -> Req {
        self.request("GET", path)
    }

    /// Sends a signal (`libc::SIGTERM`, `libc::SIGINT`, ...).
    pub fn signal(&self, signal: i32) -> Result<()> {
        let pid = i32::try_from(self.pid)?;
        // SAFETY: kill(2) on our own child's pid; the child is not reaped
        // before `wait`, so the pid cannot have been reused.
        let rc = unsafe { libc::kill(pid, signal) };
        ensure!(rc == 0, "kill: {}", std::io::Error::last_os_error());
        Ok(())
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) -> Result<()> {
        if self.exited.is_none() {
            self.child.kill()?;
            self.exited = Some(self.child.wait()?);
        }
        Ok(())
    }

    /// Waits for the process to exit by itself, at most `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        if let Some(s) = self.exited {
            return Ok(s);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                self.exited = Some(status);
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!("idem serve did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Every stdout line so far.
    pub fn stdout_lines(&self) -> Vec<String> {
        self.stdout.lock().unwrap().clone()
    }

    /// Stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.text()
    }

    /// Stderr once it holds `text`, or as it is after `timeout`: a line the
    /// server logged before it answered can still be on its way through
    /// the pipe and the reader thread when the answer arrives.
    pub fn stderr_with(&self, text: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.stderr();
            if log.contains(text) || Instant::now() >= deadline {
                return log;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.kill();
        let err = self.stderr.finish();
        if !err.is_empty() {
            eprintln!("--- idem serve (pid {}) stderr:\n{}", self.pid, tail(&err));
        }
    }
}

/// How many of a child's last stderr lines a failing test shows: enough
/// for the events that led to the failure, few enough that a CI log cut to
/// its head and tail still shows the test's own error after them.
const STDERR_TAIL_LINES: usize = 40;

/// The last [`STDERR_TAIL_LINES`] lines of `text`, saying how many were left
/// out.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let skip = lines.len().saturating_sub(STDERR_TAIL_LINES);
    let mut out = String::new();
    if skip > 0 {
        out.push_str(&format!("[{skip} earlier lines left out]\n"));
    }
    out.push_str(&lines[skip..].join("\n"));
    out
}

/// The output of one CLI command.
#[derive(Debug)]
pub struct CliOutput {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CliOutput {
    /// Stdout parsed as JSON, for `--json`.
    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_str(self.stdout.trim())
            .with_context(|| format!("not JSON: {:?} (stderr {:?})", self.stdout, self.stderr))
    }
}

/// Runs `idem ARGS...` to completion, at most 30 s.
pub fn idem(args: &[&str]) -> Result<CliOutput> {
    let bin = idem_bin()?;
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut out = child.stdout.take().context("stdout")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let mut err = StderrSink::new(child.stderr.take().context("stderr")?);
    let deadline = Instant::now() + CLI;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("idem {args:?} did not finish within {CLI:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stdout = reader
        .join()
        .map_err(|_| anyhow!("stdout reader panicked"))?;
    Ok(CliOutput {
        status,
        stdout,
        stderr: err.finish(),
    })
}

/// Runs `idem ARGS...` and requires exit status 0.
pub fn idem_ok(args: &[&str]) -> Result<CliOutput> {
    let out = idem(args)?;
    ensure!(
        out.status.success(),
        "idem {args:?} exited {}: stdout {:?} stderr {:?}",
        out.status,
        out.stdout,
        out.stderr
    );
    Ok(out)
}

fn agent() -> &'static ureq::Agent {
    static AGENT: OnceLock<ureq::Agent> = OnceLock::new();
    AGENT.get_or_init(|| {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .max_redirects(0)
            .timeout_global(Some(HTTP))
            // Enough for the largest storm of concurrent requests
            // (tests/postgres.rs), so that connections are reused rather
            // than left by the thousand in TIME_WAIT.
            .max_idle_connections(256)
            .max_idle_connections_per_host(256)
            .build()
            .into()
    })
}

/// The `Authorization` value of every request made through [`Proxy`]
/// unless the test says otherwise ([`Req::auth`], [`Req::anonymous`]):
/// `idem serve` and the middleware refuse keyed requests that name no
/// client by default (`anonymous = "reject"`), so the suites' clients
/// identify themselves as a real client would.
pub const TEST_CLIENT: &str = "Bearer test-client";

/// The problem `type` of `name`: the base every idem problem type shares.
pub fn problem_type(name: &str) -> String {
    format!("{}{name}", idem::proxy::problem::PROBLEM_BASE)
}

/// One HTTP request of the test's own.
#[derive(Clone, Debug)]
pub struct Req {
    method: String,
    url: String,
    headers: Vec<(String, Vec<u8>)>,
    /// Sent as `Authorization`, after `headers`.
    auth: Option<String>,
    body: Option<Vec<u8>>,
}

impl Req {
    /// A request without credentials.
    pub fn new(method: &str, url: &str) -> Self {
        Self {
            method: method.to_string(),
            url: url.to_string(),
            headers: Vec::new(),
            auth: None,
            body: None,
        }
    }

    /// Any header, as raw bytes.
    pub fn header(mut self, name: &str, value: impl AsRef<[u8]>) -> Self {
        self.headers
            .push((name.to_string(), value.as_ref().to_vec()));
        self
    }

    /// `Idempotency-Key: VALUE` exactly as given (a bare token, or a
    /// Structured Field string when the value carries its quotes).
    pub fn key(self, value: impl AsRef<[u8]>) -> Self {
        self.header("Idempotency-Key", value)
    }

    /// `Authorization: VALUE`, instead of any earlier one.
    pub fn auth(mut self, value: &str) -> Self {
        self.auth = Some(value.to_string());
        self
    }

    /// No `Authorization` header: a client that does not identify itself.
    pub fn anonymous(mut self) -> Self {
        self.auth = None;
        self
    }

    /// A JSON body with `Content-Type: application/json`.
    pub fn json(self, body: &str) -> Self {
        self.body("application/json", body.as_bytes())
    }

    /// A body with a content type.
    pub fn body(mut self, content_type: &str, body: &[u8]) -> Self {
        self = self.header("Content-Type", content_type);
        self.body = Some(body.to_vec());
        self
    }

    /// Sends it and reads the whole answer.
    pub fn send(&self) -> Result<Resp> {
        let mut builder = http::Request::builder()
            .method(self.method.as_str())
            .uri(&self.url);
        for (name, value) in &self.headers {
            builder = builder.header(name.as_str(), http::HeaderValue::from_bytes(value)?);
        }
        if let Some(auth) = &self.auth {
            builder = builder.header("Authorization", auth.as_str());
        }
        let what = format!("{} {}", self.method, self.url);
        let resp = match &self.body {
            Some(body) => agent().run(builder.body(body.clone())?),
            None => agent().run(builder.body(())?),
        };
        let mut resp = resp.with_context(|| what.clone())?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = if self.method == "HEAD" {
            Vec::new()
        } else {
            resp.body_mut()
                .with_config()
                .limit(64 << 20)
                .read_to_vec()
                .with_context(|| format!("reading the body of {what}"))?
        };
        Ok(Resp {
            status,
            headers,
            body,
        })
    }
}

/// An HTTP answer, read whole.
#[derive(Clone, Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// `Idempotent-Replayed: true`.
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Result<serde_json::Value> {
        serde_json::from_slice(&self.body).with_context(|| format!("not JSON: {:?}", self.text()))
    }

    /// Requires a status.
    pub fn expect_status(&self, status: u16) -> Result<&Self> {
        ensure!(
            self.status == status,
            "expected status {status}, got {}: headers {:?}, body {:?}",
            self.status,
            self.headers,
            self.text()
        );
        Ok(self)
    }

    /// Requires a problem of idem's own: this status,
    /// `application/problem+json`, the `type` [`problem_type`]`(TYPE_NAME)`,
    /// a non-empty `title`, a `status` member (when present) equal to the
    /// status, and no `Idempotent-Replayed: true`. Returns the problem.
    pub fn expect_problem(&self, status: u16, type_name: &str) -> Result<serde_json::Value> {
        self.expect_status(status)?;
        let ct = self.header("content-type").unwrap_or_default();
        ensure!(
            ct.starts_with("application/problem+json"),
            "problem content-type expected, got {ct:?}; body {:?}",
            self.text()
        );
        let p = self.json()?;
        let ty = p["type"]
            .as_str()
            .context("problem without a string `type`")?;
        ensure!(
            ty == problem_type(type_name),
            "problem type {ty:?} is not {:?}; problem {p}",
            problem_type(type_name)
        );
        let title = p["title"].as_str().context("problem without a `title`")?;
        ensure!(!title.is_empty(), "empty problem title");
        if let Some(s) = p.get("status") {
            ensure!(s.as_u64() == Some(u64::from(status)), "problem status {s}");
        }
        ensure!(!self.replayed(), "a problem marked as replayed");
        Ok(p)
    }

    /// Requires that none of `secrets` appears in the body.
    pub fn expect_not_containing(&self, secrets: &[&[u8]]) -> Result<&Self> {
        for s in secrets {
            ensure!(
                !s.is_empty() && !self.body.windows(s.len()).any(|w| w == *s),
                "the answer reveals {:?}: {:?}",
                String::from_utf8_lossy(s),
                self.text()
            );
        }
        Ok(self)
    }
}
