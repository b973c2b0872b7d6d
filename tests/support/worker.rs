//! A worker process for the multi-process tests in `tests/processes.rs` and
//! `tests/crash.rs`.
//!
//! ```text
//! idem-test-worker race <db> <keys>           wait for "go" on stdin, then claim and
//!                                             execute keys 0..keys; print "executed N"
//! idem-test-worker hold <db> <key> <now> <mode>
//!     mode = claim:    claim the key, print "holding", block
//!     mode = written:  claim, write the business row outside any transaction, print
//!                      "holding", block (the crash between business write and status update)
//!     mode = in-tx:    claim, write the business row inside the business transaction,
//!                      print "holding", block before it commits
//!     mode = one-tx:   claim and write the business row in one transaction
//!                      (`run_in_one_transaction`), print "holding", block before it commits
//! idem-test-worker hold-pg <url> <schema> <key> <now>
//!     claim the key on PostgreSQL (the store's schema), write a row into
//!     <schema>.orders inside the business transaction (`run_in_transaction`),
//!     print "holding true", block before it commits
//! idem-test-worker crash <db> <now> <seed>
//!     print "ready", then run random operations over 8 keys forever, printing
//!     "op N" after each: business actions in the business transaction
//!     (`run_in_transaction`, each writing one `orders` row), claims left
//!     unfinished, extends, failures, sweeps, reconciles and clock advances.
//!     A refusal the engine must never give prints "bad ..." and exits.
//! idem-test-worker crash-zygote
//!     compile the engine component once, print "ready", then read commands:
//!     "run <db> <now> <seed>" forks a child that runs `crash` (printing its
//!     lines) and prints "pid N"; "reap N" waits for that child and prints
//!     "reaped N". Forking skips compiling the component for every run.
//! idem-test-worker rabbit-consume <queue> <db> <lease_ms>
//!     consume a RabbitMQ queue through idem (see worker_rabbitmq.rs)
//! idem-test-worker nats-consume <stream> <durable> <dlq-subject> <db> <lease_ms> single|shared
//!     consume a JetStream durable consumer through idem (see worker_nats.rs)
//! ```
//! The parent kills `hold`, `crash`, `rabbit-consume` and `nats-consume`
//! workers with SIGKILL.

use std::io::{BufRead, Write};

#[path = "options.rs"]
mod options;
#[path = "worker_nats.rs"]
mod worker_nats;
#[path = "worker_rabbitmq.rs"]
mod worker_rabbitmq;

use anyhow::{Context, Result, bail};
use idem::{
    ActionResult, BeginRequest, Decision, Disposition, Engine, ExpiredLease, Failure, ManualClock,
    Policy, RecordKey, RunInTransaction, RunOutcome, SqliteOptions, SqliteStore, Success, Ticket,
};

/// The business table the tests count side effects in. No unique
/// constraint: a second execution would show up as a second row.
pub const BUSINESS_SCHEMA: &str =
    "CREATE TABLE IF NOT EXISTS orders (idem_key TEXT NOT NULL, worker TEXT NOT NULL)";

fn engine(db: &str, clock: Option<ManualClock>) -> Result<(Engine, SqliteStore)> {
    let store = SqliteStore::open(db, options::sqlite_options())?;
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| c.execute(BUSINESS_SCHEMA, []))??;
    tx.commit()?;
    let mut builder = Engine::builder().storage(store.clone());
    if let Some(clock) = clock {
        builder = builder.clock(clock);
    }
    Ok((builder.build()?, store))
}

fn key(k: &str) -> RecordKey {
    RecordKey::new("tenant-1", "order.create", k)
}

fn block_forever() -> ! {
    loop {
        std::thread::park();
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let me = std::process::id().to_string();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["race", db, keys] => {
            let keys: u32 = keys.parse().context("keys")?;
            let (engine, _store) = engine(db, None)?;
            println!("ready");
            std::io::stdout().flush()?;
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line)?;
            let mut executed = 0;
            for i in 0..keys {
                let req = BeginRequest::json(key(&format!("k{i}")), "{}", Policy::default());
                let outcome = engine.run_in_transaction(&req, |_, conn| {
                    match conn.execute(
                        "INSERT INTO orders (idem_key, worker) VALUES (?1, ?2)",
                        (&req.key.idem_key, &me),
                    ) {
                        Ok(_) => ActionResult::Succeeded(Success::with_ref(format!("order-{i}"))),
                        Err(e) => ActionResult::retryable("db", e),
                    }
                })?;
                match outcome {
                    RunOutcome::Executed {
                        result: ActionResult::Succeeded(_),
                        ..
                    } => executed += 1,
                    RunOutcome::Executed { result, .. } => {
                        bail!("business write failed: {result:?}")
                    }
                    _ => {}
                }
            }
            println!("executed {executed}");
        }
        ["hold", db, k, now, mode] => {
            let clock = ManualClock::new(now.parse().context("now")?);
            let (engine, store) = engine(db, Some(clock))?;
            let req = BeginRequest::json(key(k), "{}", Policy::default());
            match *mode {
                "claim" | "written" => {
                    let Decision::Execute(_ticket) = engine.begin(&req)? else {
                        bail!("the key was not free");
                    };
                    if *mode == "written" {
                        let tx = store.begin_transaction()?;
                        tx.with_connection(|c| {
                            c.execute(
                                "INSERT INTO orders (idem_key, worker) VALUES (?1, ?2)",
                                (k, &me),
                            )
                        })??;
                        tx.commit()?;
                    }
                    println!("holding");
                    std::io::stdout().flush()?;
                    block_forever();
                }
                "in-tx" | "one-tx" => {
                    let action = |_: &Ticket, conn: &rusqlite::Connection| -> ActionResult {
                        let wrote = conn.execute(
                            "INSERT INTO orders (idem_key, worker) VALUES (?1, ?2)",
                            (k, &me),
                        );
                        println!("holding {}", wrote.is_ok());
                        let _ = std::io::stdout().flush();
                        block_forever()
                    };
                    if *mode == "in-tx" {
                        engine.run_in_transaction(&req, action)?;
                    } else {
                        engine.run_in_one_transaction(&req, action)?;
                    }
                }
                other => bail!("unknown mode {other}"),
            }
        }
        ["hold-pg", url, schema, k, now] => {
            let store = idem::PostgresStore::connect(
                url,
                idem::PostgresOptions {
                    schema: (*schema).to_owned(),
                    pool_size: 1,
                    ..idem::PostgresOptions::default()
                },
            )?;
            let engine = Engine::builder()
                .storage(store)
                .clock(ManualClock::new(now.parse().context("now")?))
                .build()?;
            let req = BeginRequest::json(key(k), "{}", Policy::default());
            let insert =
                format!("INSERT INTO \"{schema}\".orders (idem_key, worker) VALUES ($1, $2)");
            idem::postgres::RunInTransaction::run_in_transaction(&engine, &req, |_, client| {
                let wrote = client.execute(&insert, &[k, &me]);
                println!("holding {}", wrote.is_ok());
                let _ = std::io::stdout().flush();
                block_forever();
            })?;
        }
        ["crash", db, now, seed] => crash(db, now.parse().context("now")?, seed.parse()?)?,
        ["crash-zygote"] => zygote()?,
        ["nats-consume", stream, durable, dlq, db, lease_ms, mode] => worker_nats::consume(
            stream,
            durable,
            dlq,
            db,
            lease_ms.parse().context("lease_ms")?,
            mode,
        )?,
        ["rabbit-consume", queue, db, lease_ms] => {
            worker_rabbitmq::consume(queue, db, lease_ms.parse().context("lease_ms")?)?
        }
        _ => bail!(
            "usage: idem-test-worker race <db> <keys> | hold <db> <key> <now> <mode> \
             | hold-pg <url> <schema> <key> <now> \
             | crash <db> <now> <seed> | crash-zygote | rabbit-consume <queue> <db> <lease_ms> \
             | nats-consume <stream> <durable> <dlq-subject> <db> <lease_ms> single|shared"
        ),
    }
    Ok(())
}

/// The business table of `crash`: one row per business action that took
/// effect, naming the ownership generation it ran under. The parent
/// (tests/crash.rs) creates it.
const CRASH_INSERT: &str =
    "INSERT INTO orders (idem_key, record_id, fencing_token) VALUES (?1, ?2, ?3)";

/// How many keys `crash` works on: few, so that keys are contended,
/// expire and are taken over.
const CRASH_KEYS: u64 = 8;

/// A small xorshift generator: the worker needs no statistical quality,
/// only a seeded sequence.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The crash policy: a short lease and retention, so that the parent's
/// clock steps between runs expire leases and records.
pub fn crash_policy(seed: u64) -> Policy {
    Policy {
        lease_ms: 1_000,
        retention_ms: 5_000,
        expired_lease: match seed % 3 {
            0 => ExpiredLease::TakeOver,
            1 => ExpiredLease::Reconcile,
            _ => ExpiredLease::Manual,
        },
        ..Policy::default()
    }
}

fn crash(db: &str, now: u64, seed: u64) -> Result<()> {
    let clock = ManualClock::new(now);
    let store = SqliteStore::open(db, SqliteOptions::default())?;
    // Business writes commit only together with the success, so the
    // business system is sure: no committed row without a success.
    let engine = Engine::builder()
        .storage(store)
        .clock(clock.clone())
        .results(|_: &RecordKey| Ok(None::<String>))
        .build()?;
    let policy = crash_policy(seed);
    let mut rng = Rng(seed.max(1));
    let mut held: Vec<Ticket> = Vec::new();
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    for n in 0u64.. {
        let k = format!("k{}", rng.below(CRASH_KEYS));
        let req = BeginRequest::json(key(&k), "{}", policy.clone());
        let roll = rng.below(100);
        let answer: Result<(), idem::Error> = match roll {
            0..45 => {
                let outcome = rng.below(100);
                engine
                    .run_in_transaction(&req, |t, conn| {
                        if let Err(e) = conn.execute(
                            CRASH_INSERT,
                            (&k, t.record_id as i64, t.fencing_token as i64),
                        ) {
                            return ActionResult::retryable("db", e);
                        }
                        let failed = |d| {
                            let f = Failure {
                                code: "declined".into(),
                                message: String::new(),
                                response: None,
                            };
                            ActionResult::Failed(f, d)
                        };
                        match outcome {
                            0..70 => ActionResult::Succeeded(Success::with_ref(format!(
                                "order-{}-{}",
                                t.record_id, t.fencing_token
                            ))),
                            70..82 => failed(Disposition::Retryable),
                            82..92 => failed(Disposition::Final),
                            _ => failed(Disposition::OutcomeUnknown),
                        }
                    })
                    .map(drop)
            }
            45..55 => engine.begin(&req).map(|d| {
                if let Decision::Execute(t) = d {
                    held.push(t);
                }
            }),
            55..65 if !held.is_empty() => {
                let t = &held[rng.below(held.len() as u64) as usize];
                engine.extend(t, &policy).map(drop)
            }
            65..72 if !held.is_empty() => {
                let t = held.swap_remove(rng.below(held.len() as u64) as usize);
                let d = if rng.below(2) == 0 {
                    Disposition::Retryable
                } else {
                    Disposition::OutcomeUnknown
                };
                let f = Failure {
                    code: "gave-up".into(),
                    message: String::new(),
                    response: None,
                };
                engine.fail(&t, &policy, &f, d).map(drop)
            }
            72..80 => engine.sweep(100).map(drop),
            80..88 => engine.reconcile("order.create", &policy, 100).map(drop),
            _ => {
                clock.advance(rng.below(2_000));
                Ok(())
            }
        };
        match answer {
            // SQLite busy: the store's answer, not the engine's fault.
            Ok(()) | Err(idem::Error::Store(_)) => {}
            Err(e) => {
                writeln!(out, "bad {e}")?;
                out.flush()?;
                bail!("{e}");
            }
        }
        writeln!(out, "op {n}")?;
        out.flush()?;
    }
    Ok(())
}

/// `crash-zygote`: forks `crash` runs from a process that has compiled the
/// engine component already.
fn zygote() -> Result<()> {
    // Compiles the default component into this process; the children
    // forked below reuse it. No database is opened here: a SQLite
    // connection must not cross a fork.
    Engine::builder()
        .storage(idem::MemoryStore::new())
        .build()?;
    let mut out = std::io::stdout();
    writeln!(out, "ready")?;
    out.flush()?;
    let mut line = String::new();
    loop {
        line.clear();
        if std::io::stdin().read_line(&mut line)? == 0 {
            return Ok(());
        }
        match line.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["run", db, now, seed] => {
                let (now, seed): (u64, u64) = (now.parse()?, seed.parse()?);
                out.flush()?;
                // SAFETY: fork(2) in a test worker. The child only runs
                // `crash` (which opens its own database connection) and
                // leaves with _exit(2); nothing it inherits is shared with a
                // thread of the parent: no lock is held across the fork.
                match unsafe { libc::fork() } {
                    -1 => bail!("fork: {}", std::io::Error::last_os_error()),
                    0 => {
                        // Whatever ends the run is reported, so that the
                        // parent never waits for lines that cannot come.
                        let run = std::panic::catch_unwind(|| crash(db, now, seed));
                        let why = match run {
                            Ok(Ok(())) => "the run ended".to_owned(),
                            Ok(Err(e)) => format!("{e:#}"),
                            Err(_) => "a panic".to_owned(),
                        };
                        println!("bad {why}");
                        let code = 1;
                        // SAFETY: ends the child without running the
                        // parent's exit handlers a second time.
                        unsafe { libc::_exit(code) }
                    }
                    child => {
                        writeln!(out, "pid {child}")?;
                        out.flush()?;
                    }
                }
            }
            ["reap", pid] => {
                let pid: libc::pid_t = pid.parse()?;
                let mut status = 0;
                // SAFETY: waits for our own child.
                if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
                    bail!("waitpid {pid}: {}", std::io::Error::last_os_error());
                }
                writeln!(out, "reaped {pid}")?;
                out.flush()?;
            }
            _ => bail!("unknown command {line:?}"),
        }
    }
}
