//! What the consumer kill tests (`tests/rabbitmq_kill.rs`,
//! `tests/nats_kill.rs`) share: the stores the workers write to, worker
//! processes to kill, and a seeded generator for the kill instants.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, ensure};

/// Where the consumers keep their records and business rows, and how the
/// test counts those rows.
pub trait Business {
    /// The worker's `db` argument.
    fn db(&self) -> String;
    /// The value of a `SELECT COUNT(...) FROM orders`-style query.
    fn count(&mut self, what: &str) -> Result<i64>;
}

/// A SQLite file in a temporary directory, its `orders` table made.
pub struct Sqlite {
    path: String,
    _dir: tempfile::TempDir,
}

impl Sqlite {
    /// A new file with an empty `orders` table (each worker also makes it).
    pub fn new() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("idem.db");
        let path = path.to_str().context("utf-8 path")?.to_owned();
        rusqlite::Connection::open(&path)?.execute(
            "CREATE TABLE IF NOT EXISTS orders (idem_key TEXT NOT NULL, worker TEXT NOT NULL)",
            [],
        )?;
        Ok(Self { path, _dir: dir })
    }
}

impl Business for Sqlite {
    fn db(&self) -> String {
        self.path.clone()
    }

    fn count(&mut self, what: &str) -> Result<i64> {
        let conn = rusqlite::Connection::open(&self.path)?;
        Ok(conn.query_row(&format!("SELECT {what} FROM orders"), [], |r| r.get(0))?)
    }
}

/// A schema of its own on the PostgreSQL at `IDEM_TEST_PG_URL`, with an
/// `orders` table, dropped at the end.
pub struct Postgres {
    url: String,
    schema: String,
    client: postgres::Client,
}

impl Postgres {
    /// A new schema, or `None` (skipped, with a line saying so) when
    /// `IDEM_TEST_PG_URL` is not set; CI always sets it.
    pub fn new() -> Result<Option<Self>> {
        let Ok(url) = std::env::var("IDEM_TEST_PG_URL") else {
            eprintln!("skipped: IDEM_TEST_PG_URL is not set (CI sets it)");
            return Ok(None);
        };
        let schema = idem_engine::testing::unique_name("idem_kill");
        let mut client = postgres::Client::connect(&url, postgres::NoTls)?;
        client.batch_execute(&format!(
            "CREATE SCHEMA \"{schema}\"; \
             CREATE TABLE \"{schema}\".orders (idem_key TEXT NOT NULL, worker TEXT NOT NULL)"
        ))?;
        Ok(Some(Self {
            url,
            schema,
            client,
        }))
    }
}

impl Business for Postgres {
    fn db(&self) -> String {
        format!("{}#{}", self.url, self.schema)
    }

    fn count(&mut self, what: &str) -> Result<i64> {
        let sql = format!("SELECT {what} FROM \"{}\".orders", self.schema);
        Ok(self.client.query_one(&sql, &[])?.get(0))
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self.client.batch_execute(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema
        ));
    }
}

/// Polls every 100 ms, at most `within`, until `messages` distinct
/// messages have taken effect and `left()` (what the broker still holds:
/// pending, unacked or waiting to be retried) is 0; then stops `workers`
/// and checks that each message took effect exactly once. Returns the
/// business rows.
pub fn drain_and_count(
    business: &mut dyn Business,
    messages: usize,
    within: std::time::Duration,
    workers: Vec<Worker>,
    mut left: impl FnMut() -> Result<u64>,
) -> Result<i64> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let distinct = business.count("COUNT(DISTINCT idem_key)")?;
        let left = left()?;
        if distinct == messages as i64 && left == 0 {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "after {within:?}: {distinct} messages took effect, {left} still held by the broker"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    drop(workers);
    let rows = business.count("COUNT(*)")?;
    ensure!(
        rows == messages as i64,
        "{rows} business rows for {messages} messages: a message took effect twice"
    );
    Ok(rows)
}

/// Kills per test run.
pub const KILLS: usize = 20;
/// Consumer processes at a time.
pub const CONSUMERS: usize = 2;
/// The consumers' lease, in ms: short, so that a message whose consumer
/// died is taken over soon.
pub const LEASE_MS: &str = "500";

/// Sleeps 10 to 99 ms, then kills one of `workers` (in turn) and starts a
/// new one with `args`, [`KILLS`] times.
pub fn kill_repeatedly(workers: &mut [Worker], args: &[&str], rng: &mut Rng) -> Result<()> {
    for kill in 0..KILLS {
        std::thread::sleep(std::time::Duration::from_millis(10 + rng.below(90)));
        let w = kill % workers.len();
        workers[w].kill()?;
        workers[w] = Worker::start(args)?;
    }
    Ok(())
}

/// A consumer process, killed when dropped.
pub struct Worker {
    child: Child,
}

impl Worker {
    /// Starts `idem-test-worker ARGS` and waits for its "ready".
    pub fn start(args: &[&str]) -> Result<Self> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem-test-worker"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().context("stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        ensure!(line.trim() == "ready", "the worker said {line:?}");
        Ok(Self { child })
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A small deterministic generator (xorshift), seeded from the clock and
/// printed, so a failing run can be repeated.
pub struct Rng(pub u64);

impl Rng {
    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}
