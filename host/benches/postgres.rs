//! The engine on PostgreSQL against bare SQL on the same server.
//!
//! Three paths, each at 1 and 8 threads:
//!
//! | path | engine | bare-SQL baseline |
//! |---|---|---|
//! | new key | `begin` (execute) + `complete` | `INSERT … ON CONFLICT DO NOTHING RETURNING id` of a processing row, then a second transaction `UPDATE` to succeeded |
//! | replay | `begin` on a succeeded key | one `SELECT` by the unique key |
//! | mismatch | `begin` on a succeeded key with another body | one `SELECT` by the unique key |
//!
//! The baseline uses prepared statements on one connection per thread, in
//! a table with the store's own schema; the engine runs with the store's
//! defaults (pooled connections checked on checkout) and, on a second line,
//! without the checkout check. Baseline and engine runs alternate, round
//! after round, and the figures are medians over rounds; the machine is
//! shared, so compare the columns of one run, not runs.
//!
//! Run with `IDEM_TEST_PG_URL=postgres://… cargo bench -p idem --bench
//! postgres` (`-- --quick` is a smoke run). Without the variable it prints
//! that it was skipped.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use idem::{
    BeginRequest, Decision, Engine, Policy, PostgresOptions, PostgresStore, RecordKey, Success,
};
use postgres::{Client, NoTls, Statement};

/// Rounds per measurement by default: enough for a stable median.
const ROUNDS: usize = 5;
/// Operations per thread per round by default.
const OPS: usize = 1_000;
/// Rounds and operations with `--quick`, a smoke run.
const QUICK_ROUNDS: usize = 1;
/// See [`QUICK_ROUNDS`].
const QUICK_OPS: usize = 20;
/// Succeeded keys the replay and mismatch paths read, spread over threads.
const STORED_KEYS: usize = 2_000;
/// The thread counts measured.
const THREADS: [usize; 2] = [1, 8];

const BODY: &str = r#"{"sku":"A1","qty":2,"note":"bench"}"#;
const OTHER_BODY: &str = r#"{"sku":"A1","qty":3,"note":"bench"}"#;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    NewKey,
    Replay,
    Mismatch,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::NewKey => "new key",
            Path::Replay => "replay",
            Path::Mismatch => "mismatch",
        }
    }
}

/// Latencies of every operation and the wall time of each round.
#[derive(Default)]
struct Samples {
    latencies: Vec<Duration>,
    rates: Vec<f64>,
}

impl Samples {
    fn rate(&self) -> f64 {
        let mut r = self.rates.clone();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    }

    fn percentile(&mut self, p: f64) -> Duration {
        self.latencies.sort_unstable();
        let idx = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[idx.min(self.latencies.len() - 1)]
    }
}

struct Bare {
    client: Client,
    insert: Statement,
    settle: Statement,
    select: Statement,
}

impl Bare {
    fn connect(url: &str, schema: &str) -> Result<Bare> {
        let mut client = Client::connect(url, NoTls)?;
        let table = format!("\"{schema}\".idempotency_record");
        let insert = client.prepare(&format!(
            "INSERT INTO {table} (scope_key, biz_type, idem_key, request_hash, \
             fingerprint_version, status, fencing_token, revision, attempts, lease_until, \
             created_at, updated_at) \
             VALUES ($1, $2, $3, $4, 1, 'processing', 1, 1, 1, $5, $6, $6) \
             ON CONFLICT (scope_key, biz_type, idem_key) DO NOTHING RETURNING id"
        ))?;
        let settle = client.prepare(&format!(
            "UPDATE {table} SET status = 'succeeded', revision = 2, lease_until = NULL, \
             expires_at = $2, updated_at = $3, result_ref = $4 WHERE id = $1 AND revision = 1"
        ))?;
        let select = client.prepare(&format!(
            "SELECT id, scope_key, biz_type, idem_key, request_hash, fingerprint_version, \
             status, fencing_token, revision, attempts, lease_until, created_at, updated_at, \
             expires_at, result_ref, response, failure FROM {table} \
             WHERE scope_key = $1 AND biz_type = $2 AND idem_key = $3"
        ))?;
        Ok(Bare {
            client,
            insert,
            settle,
            select,
        })
    }

    fn op(&mut self, path: Path, key: &RecordKey) -> Result<()> {
        match path {
            Path::NewKey => {
                let now = now_ms();
                let row = self.client.query_one(
                    &self.insert,
                    &[
                        &key.scope,
                        &key.biz_type,
                        &key.idem_key,
                        &"ab".repeat(32),
                        &(now + 60_000),
                        &now,
                    ],
                )?;
                let id: i64 = row.get(0);
                let n = self.client.execute(
                    &self.settle,
                    &[&id, &(now + 86_400_000), &now, &b"order-1".as_slice()],
                )?;
                ensure!(n == 1);
            }
            Path::Replay | Path::Mismatch => {
                let row = self
                    .client
                    .query_opt(&self.select, &[&key.scope, &key.biz_type, &key.idem_key])?;
                ensure!(row.is_some(), "stored key {key:?} missing");
            }
        }
        Ok(())
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn engine_op(engine: &Engine, path: Path, key: &RecordKey) -> Result<()> {
    let body = if path == Path::Mismatch {
        OTHER_BODY
    } else {
        BODY
    };
    let req = BeginRequest::json(key.clone(), body, Policy::default());
    match (path, engine.begin(&req)?) {
        (Path::NewKey, Decision::Execute(t)) => {
            engine.complete(&t, &req.policy, &Success::with_ref("order-1"))?;
        }
        (Path::Replay, Decision::Replay(_)) | (Path::Mismatch, Decision::Mismatch(_)) => {}
        (p, d) => anyhow::bail!("{p:?}: unexpected decision {}", d.name()),
    }
    Ok(())
}

/// The key thread `t` uses for operation `i` of `round`.
fn key_for(path: Path, who: &str, round: usize, t: usize, i: usize) -> RecordKey {
    match path {
        Path::NewKey => RecordKey::new("bench", "order.create", format!("{who}-{round}-{t}-{i}")),
        Path::Replay | Path::Mismatch => RecordKey::new(
            "bench",
            "order.create",
            format!("stored-{}", (t * 7919 + i) % STORED_KEYS),
        ),
    }
}

/// Runs one round on `threads` threads; `op(thread, i)` does one operation.
fn round<F>(threads: usize, ops: usize, samples: &mut Samples, op: F) -> Result<()>
where
    F: Fn(usize, usize) -> Result<()> + Sync,
{
    let started = Instant::now();
    let latencies = std::thread::scope(|s| -> Result<Vec<Duration>> {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let op = &op;
                s.spawn(move || -> Result<Vec<Duration>> {
                    let mut mine = Vec::with_capacity(ops);
                    for i in 0..ops {
                        let at = Instant::now();
                        op(t, i)?;
                        mine.push(at.elapsed());
                    }
                    Ok(mine)
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            all.extend(
                h.join()
                    .map_err(|_| anyhow::anyhow!("a thread panicked"))??,
            );
        }
        Ok(all)
    })?;
    let wall = started.elapsed().as_secs_f64();
    samples.rates.push((threads * ops) as f64 / wall);
    samples.latencies.extend(latencies);
    Ok(())
}

fn drop_schema(url: &str, schema: &str) -> Result<()> {
    Client::connect(url, NoTls)?
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))?;
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let (rounds, ops) = if quick {
        (QUICK_ROUNDS, QUICK_OPS)
    } else {
        (ROUNDS, OPS)
    };
    let Some(url) = std::env::var("IDEM_TEST_PG_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        println!("skipped: IDEM_TEST_PG_URL is not set, so there is no PostgreSQL server");
        return Ok(());
    };
    let tag = std::process::id();
    let schemas = [
        format!("idem_bench_engine_{tag}"),
        format!("idem_bench_nocheck_{tag}"),
        format!("idem_bench_bare_{tag}"),
    ];
    let result = run(&url, &schemas, rounds, ops);
    for s in &schemas {
        drop_schema(&url, s)?;
    }
    result
}

fn run(url: &str, schemas: &[String; 3], rounds: usize, ops: usize) -> Result<()> {
    let max_threads = THREADS.iter().copied().max().unwrap_or(1);
    let open = |schema: &str, check: bool| -> Result<(Engine, PostgresStore)> {
        let store = PostgresStore::connect(
            url,
            PostgresOptions {
                schema: schema.to_owned(),
                pool_size: max_threads as u32,
                check_on_checkout: check,
                ..PostgresOptions::default()
            },
        )?;
        Ok((Engine::builder().storage(store.clone()).build()?, store))
    };
    let (engine, _s1) = open(&schemas[0], true)?;
    let (nocheck, _s2) = open(&schemas[1], false)?;
    // The bare table: the store's own schema, created by a store.
    drop(PostgresStore::connect(
        url,
        PostgresOptions {
            schema: schemas[2].clone(),
            pool_size: 1,
            ..PostgresOptions::default()
        },
    )?);
    let mut bare: Vec<std::sync::Mutex<Bare>> = (0..max_threads)
        .map(|_| Bare::connect(url, &schemas[2]).map(std::sync::Mutex::new))
        .collect::<Result<_>>()?;

    // The keys the replay and mismatch paths read, in all three tables.
    for i in 0..STORED_KEYS {
        let key = RecordKey::new("bench", "order.create", format!("stored-{i}"));
        engine_op(&engine, Path::NewKey, &key)?;
        engine_op(&nocheck, Path::NewKey, &key)?;
        bare[0]
            .get_mut()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .op(Path::NewKey, &key)?;
    }

    println!(
        "PostgreSQL: {rounds} rounds x {ops} operations per thread; ops/s are medians over \
         rounds, latencies over all operations"
    );
    println!(
        "{:<9} {:>7}  {:>10} {:>10} {:>10}  {:>7} {:>7}  {:>9} {:>9} {:>9} {:>9}",
        "path",
        "threads",
        "bare ops/s",
        "idem ops/s",
        "nochk op/s",
        "ratio",
        "nochk",
        "bare p50",
        "bare p99",
        "idem p50",
        "idem p99"
    );
    for path in [Path::NewKey, Path::Replay, Path::Mismatch] {
        for threads in THREADS {
            let (mut b, mut e, mut n) =
                (Samples::default(), Samples::default(), Samples::default());
            for r in 0..rounds {
                round(threads, ops, &mut b, |t, i| {
                    let mut conn = bare[t].lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
                    conn.op(path, &key_for(path, "bare", r, t, i))
                })
                .context("bare SQL")?;
                round(threads, ops, &mut e, |t, i| {
                    engine_op(&engine, path, &key_for(path, "engine", r, t, i))
                })
                .context("engine")?;
                round(threads, ops, &mut n, |t, i| {
                    engine_op(&nocheck, path, &key_for(path, "nocheck", r, t, i))
                })
                .context("engine without checkout check")?;
            }
            let us = |d: Duration| format!("{:.0} us", d.as_secs_f64() * 1e6);
            println!(
                "{:<9} {:>7}  {:>10.0} {:>10.0} {:>10.0}  {:>7.2} {:>7.2}  {:>9} {:>9} {:>9} {:>9}",
                path.name(),
                threads,
                b.rate(),
                e.rate(),
                n.rate(),
                e.rate() / b.rate(),
                n.rate() / b.rate(),
                us(b.percentile(0.5)),
                us(b.percentile(0.99)),
                us(e.percentile(0.5)),
                us(e.percentile(0.99)),
            );
        }
    }
    bare.clear();
    Ok(())
}
