//! Many idem hosts on one PostgreSQL database.
//!
//! - Multi-host: two `idem serve` processes share one database in front of
//!   one counting upstream; storms of identical requests spread over both
//!   execute once per key.
//! - Faults: the database connections of the proxies (or of an engine) are
//!   killed with `pg_terminate_backend` mid-traffic; no key executes twice,
//!   a lost connection is an error (never a new key), and service resumes.
//!
//! Each test works in a PostgreSQL schema of its own (dropped after), so the
//! tests run in parallel on one database. Without `IDEM_TEST_PG_URL` every
//! test prints why it was skipped.

mod common;
#[path = "support/serve.rs"]
mod serve;
#[path = "support/upstream.rs"]
mod upstream;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Barrier, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use common::{PgSchema, T0, key, request, unique_name};
use idem::postgres::RunInTransaction as PgRun;
use idem::{
    ActionResult, BeginRequest, Completion, Decision, Disposition, Engine, Error, ExpiredLease,
    Failure, ManualClock, MemoryStore, Policy, PostgresOptions, PostgresStore, RunOutcome, Status,
    StoreError, Success,
};
use serve::{Proxy, Resp, Serve};
use upstream::Upstream;

const BODY: &str = r#"{"sku":"A1","qty":2}"#;

/// How long a test waits for the server to reach a state it set up.
const SETTLE: Duration = Duration::from_secs(20);

/// Two proxies on one schema, in front of one upstream.
struct Hosts {
    proxies: [Proxy; 2],
    up: Upstream,
    schema: PgSchema,
    _dir: tempfile::TempDir,
}

impl Hosts {
    /// `None` without a test server. `app` names the proxies' connections
    /// (`application_name`); `config` is their TOML configuration.
    fn start(app: &str, config: Option<&str>) -> Result<Option<Hosts>> {
        let Some(schema) = PgSchema::new() else {
            return Ok(None);
        };
        let dir = tempfile::tempdir()?;
        let up = Upstream::start()?;
        let url = schema.url_with("application_name", app);
        let start = || -> Result<Proxy> {
            let mut s = Serve::postgres(&up.url(), &url, &schema.name, dir.path());
            if let Some(c) = config {
                s = s.config(c);
            }
            s.start()
        };
        // Started one after the other and then together would both work
        // (migrations take an advisory lock); together is the harder case.
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(start);
            let b = s.spawn(start);
            (a.join(), b.join())
        });
        let a = a.map_err(|_| anyhow::anyhow!("starting proxy A panicked"))??;
        let b = b.map_err(|_| anyhow::anyhow!("starting proxy B panicked"))??;
        Ok(Some(Hosts {
            proxies: [a, b],
            up,
            schema,
            _dir: dir,
        }))
    }

    /// Records in the schema by status, read with plain SQL.
    fn statuses(&self) -> Result<HashMap<String, i64>> {
        let mut c = self.schema.raw()?;
        let rows = c.query(
            &format!(
                "SELECT status, COUNT(*) FROM \"{}\".idempotency_record GROUP BY status",
                self.schema.name
            ),
            &[],
        )?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }
}

/// What one storm of identical requests got back.
#[derive(Default, Debug)]
struct Tally {
    fresh: usize,
    replayed: usize,
    in_progress: usize,
}

fn tally(answers: &[Resp]) -> Result<Tally> {
    let mut t = Tally::default();
    let mut body: Option<&[u8]> = None;
    for r in answers {
        match r.status {
            201 => {
                if r.replayed() {
                    t.replayed += 1;
                } else {
                    t.fresh += 1;
                }
                // Every 201 carries the one execution's answer.
                match body {
                    None => body = Some(&r.body),
                    Some(b) => ensure!(b == r.body, "two different answers: {:?}", r.text()),
                }
            }
            409 => {
                r.expect_problem(409, "request-in-progress")?;
                t.in_progress += 1;
            }
            other => bail!("status {other}: {:?}", r.text()),
        }
    }
    Ok(t)
}

#[test]
fn two_proxies_on_one_database_execute_each_key_once() -> Result<()> {
    /// Concurrent identical requests per key, spread over both proxies.
    const CONCURRENT: usize = 200;
    /// Distinct keys after the first storm, each with its own storm.
    const KEYS: usize = 100;
    let Some(hosts) = Hosts::start(&unique_name("idem_multi"), None)? else {
        return Ok(());
    };
    let requests = AtomicUsize::new(0);
    let barrier = Barrier::new(CONCURRENT);
    // The first storm on a slow path (every duplicate arrives while the
    // first request runs), then one storm per key on a fast one.
    let storms: Vec<(String, &str)> = std::iter::once(("storm".to_string(), "/slow?ms=300"))
        .chain((0..KEYS).map(|k| (format!("key-{k}"), "/orders")))
        .collect();
    let answers: Vec<Vec<Resp>> = std::thread::scope(|s| -> Result<Vec<Vec<Resp>>> {
        let handles: Vec<_> = (0..CONCURRENT)
            .map(|n| {
                let proxy = &hosts.proxies[n % 2];
                let (barrier, storms, requests) = (&barrier, &storms, &requests);
                s.spawn(move || -> Result<Vec<Resp>> {
                    let mut mine = Vec::new();
                    for (key, path) in storms {
                        barrier.wait();
                        requests.fetch_add(1, Ordering::Relaxed);
                        mine.push(proxy.post(path).key(key).json(BODY).send()?);
                    }
                    Ok(mine)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| anyhow::anyhow!("client panicked"))?)
            .collect()
    })?;

    let sent = requests.load(Ordering::Relaxed);
    ensure!(sent == CONCURRENT * (KEYS + 1));
    let executions = hosts.up.total();
    for (i, (key, _)) in storms.iter().enumerate() {
        let storm: Vec<Resp> = answers.iter().map(|a| a[i].clone()).collect();
        let t = tally(&storm).with_context(|| format!("key {key}"))?;
        ensure!(t.fresh == 1, "key {key}: {t:?}");
        ensure!(
            hosts.up.count_for(key) == 1,
            "key {key} executed {} times",
            hosts.up.count_for(key)
        );
    }
    ensure!(
        executions == KEYS + 1,
        "{executions} executions for {} keys",
        KEYS + 1
    );
    let statuses = hosts.statuses()?;
    ensure!(
        statuses.get("succeeded") == Some(&((KEYS + 1) as i64)) && statuses.len() == 1,
        "{statuses:?}"
    );
    println!(
        "multi-host: {sent} requests sent to 2 proxies ({CONCURRENT} concurrent per key, {} keys); \
         upstream executions counted: {executions}",
        KEYS + 1
    );
    Ok(())
}

/// Kills every backend named `app`; returns how many there were.
fn kill_backends(admin: &mut postgres::Client, app: &str) -> Result<i64> {
    Ok(admin
        .query_one(
            "SELECT COUNT(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1) AS killed",
            &[&app],
        )?
        .get(0))
}

/// What a client got for one key, retrying while the store was down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyFate {
    /// 201 after this many 503s.
    Done(usize),
    /// 409: the key was claimed (or ran) but its outcome could not be
    /// stored; it stays blocked until an operator settles it.
    Blocked,
}

#[test]
fn killed_database_connections_never_execute_a_key_twice_and_the_proxies_recover() -> Result<()> {
    const WORKERS: usize = 8;
    const KEYS_PER_WORKER: usize = 25;
    /// Kill every connection after this many answers that reached the
    /// database. Only those count: right after a kill each dead pooled
    /// connection fails one operation with 503 before its pool drops it,
    /// and the two pools hold more connections than this, so counting 503s
    /// could fire the next kill before any connection was opened again.
    /// With at most `WORKERS` requests in flight across a kill, at least
    /// `KILL_EVERY - WORKERS` of the counted answers began on a connection
    /// opened after it, so every kill finds one.
    const KILL_EVERY: usize = 15;
    const _: () = assert!(KILL_EVERY > WORKERS);
    const KILLS: usize = 8;
    /// The most 503s one key may get before the test gives up.
    const MAX_RETRIES: usize = 50;
    // "manual": a key whose outcome was lost never runs again by itself,
    // however long the test takes.
    const CONFIG: &str = "[defaults]\nexpired_lease = \"manual\"\n";
    let app = unique_name("idem_fault");
    let Some(hosts) = Hosts::start(&app, Some(CONFIG))? else {
        return Ok(());
    };
    let mut admin = hosts.schema.raw()?;

    let (answered, progress) = mpsc::channel::<()>();
    let unavailable = AtomicUsize::new(0);
    let (fates, killed) = std::thread::scope(|s| -> Result<_> {
        let workers: Vec<_> = (0..WORKERS)
            .map(|w| {
                let (hosts, answered, unavailable) = (&hosts, answered.clone(), &unavailable);
                s.spawn(move || -> Result<Vec<(String, KeyFate)>> {
                    let mut fates = Vec::new();
                    for k in 0..KEYS_PER_WORKER {
                        let key = format!("fault-{w}-{k}");
                        let mut retries = 0;
                        let fate = loop {
                            let proxy = &hosts.proxies[(k + retries) % 2];
                            let r = proxy.post("/orders").key(&key).json(BODY).send()?;
                            if r.status != 503 {
                                let _ = answered.send(());
                            }
                            match r.status {
                                201 => break KeyFate::Done(retries),
                                409 => break KeyFate::Blocked,
                                503 => {
                                    r.expect_problem(503, "store-unavailable")?;
                                    unavailable.fetch_add(1, Ordering::Relaxed);
                                    retries += 1;
                                    ensure!(retries < MAX_RETRIES, "key {key}: 503 forever");
                                }
                                other => bail!("key {key}: status {other}: {:?}", r.text()),
                            }
                        };
                        fates.push((key, fate));
                    }
                    Ok(fates)
                })
            })
            .collect();
        drop(answered);
        // Paced by the traffic, not by time: a kill after every few answers
        // that reached the database.
        let mut killed = Vec::new();
        let mut seen = 0;
        while killed.len() < KILLS && progress.recv().is_ok() {
            seen += 1;
            if seen % KILL_EVERY == 0 {
                killed.push(kill_backends(&mut admin, &app)?);
            }
        }
        // Drain, so that no worker blocks on a full channel (it never
        // does: the channel is unbounded; this only ends the receiver).
        drop(progress);
        let mut fates = Vec::new();
        for h in workers {
            fates.extend(h.join().map_err(|_| anyhow::anyhow!("worker panicked"))??);
        }
        Ok((fates, killed))
    })?;

    ensure!(
        killed.len() == KILLS,
        "only {} kills: {killed:?}",
        killed.len()
    );
    ensure!(
        killed.iter().all(|&n| n > 0),
        "a kill found no connection: {killed:?}"
    );
    // No key ran twice; every key answered 201 ran exactly once.
    for (key, fate) in &fates {
        let runs = hosts.up.count_for(key);
        match fate {
            KeyFate::Done(_) => ensure!(runs == 1, "{key}: {fate:?} but {runs} executions"),
            KeyFate::Blocked => ensure!(runs <= 1, "{key}: blocked but {runs} executions"),
        }
    }
    let done = fates
        .iter()
        .filter(|(_, f)| matches!(f, KeyFate::Done(_)))
        .count();
    let blocked = fates.len() - done;
    ensure!(
        done > fates.len() / 2,
        "{done} of {} keys done",
        fates.len()
    );

    // The connections are back: every fresh key succeeds and runs once, on
    // either proxy. A pooled connection killed less than the pool's
    // check window (`DEFAULT_CHECK_AFTER_IDLE`, 500 ms) after it was last
    // used is handed out unchecked and fails one operation with 503 before
    // the pool drops it (the documented cost of the window; the last kill
    // is often only ~150 ms before this loop). So each key may get 503s,
    // but no more in all than the two pools hold connections, and a 503 is
    // never an execution.
    let pooled = 2 * usize::try_from(idem::PostgresOptions::default().pool_size)?;
    let mut late_unavailable = 0;
    for i in 0..20 {
        let key = format!("after-{i}");
        let r = loop {
            let r = hosts.proxies[i % 2]
                .post("/orders")
                .key(&key)
                .json(BODY)
                .send()?;
            if r.status != 503 {
                break r;
            }
            r.expect_problem(503, "store-unavailable")?;
            ensure!(hosts.up.count_for(&key) == 0, "{key}: 503 after executing");
            late_unavailable += 1;
            ensure!(
                late_unavailable <= pooled,
                "{late_unavailable} 503s after the faults: more than the pools' {pooled} connections"
            );
        };
        r.expect_status(201)?;
        ensure!(!r.replayed() && hosts.up.count_for(&key) == 1, "{key}");
    }
    println!(
        "faults: {} kills ({} connections), {} keys: {done} done, {blocked} blocked; \
         {} answers 503 ({late_unavailable} after the faults); upstream executions: {}",
        killed.len(),
        killed.iter().sum::<i64>(),
        fates.len(),
        unavailable.load(Ordering::Relaxed),
        hosts.up.total()
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// The engine itself, through the real component, on a killed connection.

/// An engine on its own schema whose connections are named `app`.
fn engine_on(schema: &PgSchema, app: &str) -> Result<(Engine, PostgresStore, ManualClock)> {
    let store = PostgresStore::connect(
        &schema.url_with("application_name", app),
        PostgresOptions {
            pool_size: 1,
            ..schema.options()
        },
    )?;
    let clock = ManualClock::new(T0);
    let engine = Engine::builder()
        .storage(store.clone())
        .clock(clock.clone())
        .build()?;
    Ok((engine, store, clock))
}

/// The fingerprint the engine computes for `req`, read back from a record
/// it writes in a scratch in-memory store: another host's claim of the same
/// request stores exactly this.
fn fingerprint_of(req: &BeginRequest) -> Result<(String, u32)> {
    let engine = Engine::builder()
        .storage(MemoryStore::new())
        .clock(ManualClock::new(T0))
        .build()?;
    ensure!(matches!(engine.begin(req)?, Decision::Execute(_)));
    let status = engine
        .inspect(&req.key)?
        .context("the scratch store holds the claim")?;
    Ok((status.fingerprint, status.fingerprint_version))
}

/// Waits until a backend named `app` waits for a lock.
fn wait_for_lock_wait(admin: &mut postgres::Client, app: &str) -> Result<()> {
    let deadline = Instant::now() + SETTLE;
    loop {
        let waiting: i64 = admin
            .query_one(
                "SELECT COUNT(*) FROM pg_stat_activity \
                 WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&app],
            )?
            .get(0);
        if waiting > 0 {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "no statement of {app} ever waited"
        );
        std::thread::yield_now();
    }
}

/// Waits until a backend named `app` waits for a lock, then kills it.
fn kill_when_waiting(admin: &mut postgres::Client, app: &str) -> Result<()> {
    wait_for_lock_wait(admin, app)?;
    ensure!(kill_backends(admin, app)? == 1);
    Ok(())
}

#[test]
fn a_lost_connection_during_complete_is_an_error_and_the_retry_records_once() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let app = unique_name("idem_engine");
    let (engine, _store, _clock) = engine_on(&schema, &app)?;
    let req = request("k1", BODY);
    let Decision::Execute(ticket) = engine.begin(&req)? else {
        bail!("expected execute");
    };
    // Another session holds the record, so the completion waits for it;
    // its connection is killed meanwhile.
    let mut blocker = schema.raw()?;
    let mut admin = schema.raw()?;
    let mut tx = blocker.transaction()?;
    tx.execute(
        &format!(
            "SELECT 1 FROM \"{}\".idempotency_record FOR UPDATE",
            schema.name
        ),
        &[],
    )?;
    let success = Success::with_ref("order-1");
    let lost = std::thread::scope(|s| -> Result<_> {
        let complete = s.spawn(|| engine.complete(&ticket, &req.policy, &success));
        kill_when_waiting(&mut admin, &app)?;
        complete
            .join()
            .map_err(|_| anyhow::anyhow!("complete panicked"))
    })?;
    ensure!(
        matches!(lost, Err(Error::Store(StoreError::Unavailable(_)))),
        "a lost connection must be an error: {lost:?}"
    );
    tx.rollback()?;
    // The duplicate is told to wait, never to execute; the owner's retry
    // records the outcome once; then the duplicate replays.
    ensure!(matches!(engine.begin(&req)?, Decision::InProgress(_)));
    ensure!(
        engine.complete(&ticket, &req.policy, &success)? == Completion::Recorded(Status::Succeeded)
    );
    ensure!(
        engine.complete(&ticket, &req.policy, &success)? == Completion::Recorded(Status::Succeeded)
    );
    match engine.begin(&req)? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-1")),
        other => bail!("expected replay, got {other:?}"),
    }
    let s = engine.inspect(&key("k1"))?.context("record")?;
    ensure!(s.attempts == 1 && s.fencing_token == 1, "{s:?}");
    Ok(())
}

#[test]
fn a_lost_connection_during_begin_is_an_error_never_a_new_key() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let app = unique_name("idem_engine");
    let (engine, _store, _clock) = engine_on(&schema, &app)?;
    let mut admin = schema.raw()?;
    // Another host claims both keys in transactions it has not committed:
    // the engine's claim waits to learn whether each key is taken, and its
    // connection is killed meanwhile. One claim is then committed, the
    // other rolled back.
    let mut executions = 0;
    for (k, commit) in [("k-committed", true), ("k-rolled-back", false)] {
        let other = request(k, BODY);
        let (fingerprint, version) = fingerprint_of(&other)?;
        let version = i64::from(version);
        let decision = {
            // The other host's claim, inside a transaction that a blocker
            // session holds open.
            let mut blocker = schema.raw()?;
            let mut tx = blocker.transaction()?;
            tx.execute(
                &format!(
                    "INSERT INTO \"{}\".idempotency_record (scope_key, biz_type, idem_key, \
                     request_hash, fingerprint_version, status, fencing_token, revision, \
                     attempts, lease_until, created_at, updated_at) \
                     VALUES ($1, $2, $3, $4, $7, 'processing', 1, 1, 1, $5, $6, $6)",
                    schema.name
                ),
                &[
                    &other.key.scope,
                    &other.key.biz_type,
                    &other.key.idem_key,
                    &fingerprint,
                    &i64::try_from(T0 + other.policy.lease_ms)?,
                    &i64::try_from(T0)?,
                    &version,
                ],
            )?;
            let lost = std::thread::scope(|s| -> Result<_> {
                let begin = s.spawn(|| engine.begin(&other));
                kill_when_waiting(&mut admin, &app)?;
                begin.join().map_err(|_| anyhow::anyhow!("begin panicked"))
            })?;
            ensure!(
                matches!(lost, Err(Error::Store(StoreError::Unavailable(_)))),
                "{k}: a lost connection must be an error: {lost:?}"
            );
            if commit {
                tx.commit()?;
            } else {
                tx.rollback()?;
            }
            // The retry, on a new connection.
            engine.begin(&other)?
        };
        match (commit, decision) {
            // The other host holds the key: never executed here.
            (true, Decision::InProgress(_)) => {}
            // The key is free: the retry executes, once.
            (false, Decision::Execute(_)) => {
                executions += 1;
                ensure!(matches!(engine.begin(&other)?, Decision::InProgress(_)));
            }
            (_, d) => bail!("{k}: unexpected {d:?}"),
        }
    }
    ensure!(executions == 1);
    Ok(())
}

// ---------------------------------------------------------------------------
// Business transactions (the seed's step 4): the business rows and the
// record's transition commit together, through the real component.

/// The schema's business table: no unique constraint, so a second execution
/// would be a second row.
fn orders_table(schema: &PgSchema) -> Result<String> {
    let table = format!("\"{}\".orders", schema.name);
    schema.raw()?.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {table} (idem_key TEXT NOT NULL, worker TEXT NOT NULL)"
    ))?;
    Ok(table)
}

fn orders_of(schema: &PgSchema, table: &str, k: &str) -> Result<i64> {
    Ok(schema
        .raw()?
        .query_one(
            &format!("SELECT COUNT(*) FROM {table} WHERE idem_key = $1"),
            &[&k],
        )?
        .get(0))
}

/// Runs `req` in a business transaction that writes one order row, calling
/// `meanwhile` after the write and before the action returns `result`.
fn run_order(
    engine: &Engine,
    table: &str,
    req: &BeginRequest,
    meanwhile: impl FnOnce(),
    result: ActionResult,
) -> Result<RunOutcome> {
    let insert = format!("INSERT INTO {table} (idem_key, worker) VALUES ($1, 'test')");
    Ok(PgRun::run_in_transaction(engine, req, |_, client| {
        if let Err(e) = client.execute(&insert, &[&req.key.idem_key]) {
            return ActionResult::retryable("db", e);
        }
        meanwhile();
        result
    })?)
}

#[test]
fn run_in_transaction_commits_the_business_row_with_the_record_once() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let (engine, _store, _clock) = engine_on(&schema, &unique_name("idem_tx"))?;
    let table = orders_table(&schema)?;
    let req = request("k1", BODY);
    let ok = || ActionResult::Succeeded(Success::with_ref("order-1"));
    let first = run_order(&engine, &table, &req, || {}, ok())?;
    ensure!(matches!(first, RunOutcome::Executed { .. }), "{first:?}");
    let again = run_order(&engine, &table, &req, || {}, ok())?;
    match again {
        RunOutcome::NotExecuted(Decision::Replay(r)) => {
            ensure!(r.result_ref.as_deref() == Some("order-1"), "{r:?}")
        }
        other => bail!("expected a replay, got {other:?}"),
    }
    ensure!(orders_of(&schema, &table, "k1")? == 1, "one business row");
    Ok(())
}

#[test]
fn run_in_transaction_rolls_back_the_business_row_when_ownership_was_lost() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let (engine, _store, _clock) = engine_on(&schema, &unique_name("idem_tx_a"))?;
    let (other, _other_store, other_clock) = engine_on(&schema, &unique_name("idem_tx_b"))?;
    let table = orders_table(&schema)?;
    let req = request("k1", BODY);
    // While the first owner's action runs, its lease ends on another host,
    // which takes the key over (fencing token 2).
    other_clock.set(T0 + req.policy.lease_ms);
    let mut taken_over = None;
    let outcome = run_order(
        &engine,
        &table,
        &req,
        || taken_over = Some(other.begin(&req)),
        ActionResult::Succeeded(Success::with_ref("order-1")),
    )?;
    match taken_over {
        Some(Ok(Decision::Execute(t))) => ensure!(t.fencing_token == 2, "{t:?}"),
        other => bail!("the other host did not take the key over: {other:?}"),
    }
    ensure!(
        matches!(outcome, RunOutcome::LostOwnership { .. }),
        "{outcome:?}"
    );
    ensure!(
        orders_of(&schema, &table, "k1")? == 0,
        "the fenced-off owner's business row was rolled back"
    );
    let s = engine.inspect(&key("k1"))?.context("record")?;
    ensure!(
        s.status == Status::Processing && s.fencing_token == 2,
        "{s:?}"
    );
    Ok(())
}

#[test]
fn run_in_transaction_rolls_back_a_failed_action_and_stores_the_failure() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let (engine, _store, _clock) = engine_on(&schema, &unique_name("idem_tx"))?;
    let table = orders_table(&schema)?;
    let req = request("k1", BODY);
    let declined = Failure {
        code: "card-declined".into(),
        message: "the card was declined".into(),
        response: None,
    };
    let outcome = run_order(
        &engine,
        &table,
        &req,
        || {},
        ActionResult::Failed(declined.clone(), Disposition::Final),
    )?;
    ensure!(
        matches!(outcome, RunOutcome::Executed { .. }),
        "{outcome:?}"
    );
    ensure!(
        orders_of(&schema, &table, "k1")? == 0,
        "the write rolled back"
    );
    match engine.begin(&req)? {
        Decision::Failed(f) => ensure!(f == declined, "{f:?}"),
        other => bail!("expected the stored failure, got {other:?}"),
    }
    Ok(())
}

#[test]
fn one_transaction_commits_once_replays_and_stores_a_failure_after_an_aborted_statement()
-> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let (engine, _store, _clock) = engine_on(&schema, &unique_name("idem_one_tx"))?;
    let table = orders_table(&schema)?;
    let insert = format!("INSERT INTO {table} (idem_key, worker) VALUES ($1, 'test')");
    let req = request("k1", BODY);
    let run = |req: &BeginRequest, fail_after_write: bool| {
        PgRun::run_in_one_transaction(&engine, req, |_, client| {
            if let Err(e) = client.execute(&insert, &[&req.key.idem_key]) {
                return ActionResult::retryable("db", e);
            }
            if fail_after_write {
                // A failed statement aborts the transaction.
                let e = client.execute("SELECT 1/0", &[]).err();
                return ActionResult::Failed(
                    Failure {
                        code: "declined".into(),
                        message: format!("{e:?}"),
                        response: None,
                    },
                    Disposition::Final,
                );
            }
            ActionResult::Succeeded(Success::with_ref("order-1"))
        })
    };
    ensure!(matches!(run(&req, false)?, RunOutcome::Executed { .. }));
    match run(&req, false)? {
        RunOutcome::NotExecuted(Decision::Replay(r)) => {
            ensure!(r.result_ref.as_deref() == Some("order-1"), "{r:?}")
        }
        other => bail!("expected a replay, got {other:?}"),
    }
    ensure!(orders_of(&schema, &table, "k1")? == 1, "one business row");
    let req2 = request("k2", BODY);
    ensure!(matches!(run(&req2, true)?, RunOutcome::Executed { .. }));
    ensure!(
        orders_of(&schema, &table, "k2")? == 0,
        "the failed action's row is gone"
    );
    match engine.begin(&req2)? {
        Decision::Failed(f) => ensure!(f.code == "declined", "{f:?}"),
        other => bail!("expected the stored failure, got {other:?}"),
    }
    Ok(())
}

#[test]
fn a_postgres_batch_commits_once_and_undoes_a_failed_or_erroring_request_alone() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let (engine, store, _clock) = engine_on(&schema, &unique_name("idem_batch"))?;
    let table = orders_table(&schema)?;
    let insert = format!("INSERT INTO {table} (idem_key, worker) VALUES ($1, 'test')");
    let reqs = ["k1", "k2", "k3", "k1", "k4"].map(|k| request(k, BODY));
    let outcomes = PgRun::run_batch_in_one_transaction(&engine, &reqs, |i, _, client| {
        if let Err(e) = client.execute(&insert, &[&reqs[i].key.idem_key]) {
            return ActionResult::retryable("db", e);
        }
        // Request 1 fails after a statement that aborted the transaction;
        // request 2 too, and reports the failure as retryable.
        match i {
            1 => {
                let e = client.execute("SELECT 1/0", &[]).err();
                ActionResult::Failed(
                    Failure {
                        code: "declined".into(),
                        message: format!("{e:?}"),
                        response: None,
                    },
                    Disposition::Final,
                )
            }
            2 => match client.execute("SELECT 1/0", &[]) {
                Ok(_) => ActionResult::Succeeded(Success::with_ref("never")),
                Err(e) => ActionResult::retryable("db", e),
            },
            _ => ActionResult::Succeeded(Success::with_ref(format!("order-{i}"))),
        }
    })?;
    ensure!(outcomes.len() == 5, "{outcomes:?}");
    for i in [0, 4] {
        ensure!(
            matches!(
                &outcomes[i],
                Ok(RunOutcome::Executed {
                    result: ActionResult::Succeeded(_),
                    ..
                })
            ),
            "{:?}",
            outcomes[i]
        );
    }
    ensure!(
        matches!(
            &outcomes[1],
            Ok(RunOutcome::Executed {
                result: ActionResult::Failed(_, Disposition::Final),
                ..
            })
        ),
        "{:?}",
        outcomes[1]
    );
    ensure!(
        matches!(
            &outcomes[2],
            Ok(RunOutcome::Executed {
                result: ActionResult::Failed(_, Disposition::Retryable),
                ..
            })
        ),
        "{:?}",
        outcomes[2]
    );
    match &outcomes[3] {
        Ok(RunOutcome::NotExecuted(Decision::Replay(r))) => {
            ensure!(r.result_ref.as_deref() == Some("order-0"), "{r:?}")
        }
        other => bail!("the duplicate in the batch should replay, got {other:?}"),
    }
    for (k, rows) in [("k1", 1), ("k2", 0), ("k3", 0), ("k4", 1)] {
        ensure!(
            orders_of(&schema, &table, k)? == rows,
            "{rows} rows for {k}"
        );
    }
    match engine.begin(&reqs[1])? {
        Decision::Failed(f) => ensure!(f.code == "declined", "{f:?}"),
        other => bail!("expected the stored failure, got {other:?}"),
    }
    // The retryable failure runs again, as attempt 2.
    let again = PgRun::run_batch_in_one_transaction(&engine, &reqs[2..3], |_, _, client| {
        match client.execute(&insert, &[&"k3"]) {
            Ok(_) => ActionResult::Succeeded(Success::with_ref("order-k3")),
            Err(e) => ActionResult::retryable("db", e),
        }
    })?;
    match &again[..] {
        [Ok(RunOutcome::Executed { ticket, .. })] => ensure!(ticket.attempt == 2, "{ticket:?}"),
        other => bail!("expected a second attempt, got {other:?}"),
    }
    ensure!(orders_of(&schema, &table, "k3")? == 1);
    // A request whose action errors after aborting the transaction is
    // undone alone, claim included, and the next request commits.
    let reqs = ["k5", "k6"].map(|k| request(k, BODY));
    let outcomes = engine.run_batch_with_one_transaction(
        &reqs,
        || store.begin_transaction(),
        |i, _, tx| {
            let k = &reqs[i].key.idem_key;
            tx.with_connection(|c| c.execute(&insert, &[k]))?
                .map_err(|e| idem::StoreError::Internal(e.to_string()))?;
            if i == 0 {
                let e = tx.with_connection(|c| c.execute("SELECT 1/0", &[]))?;
                return Err(idem::StoreError::Unavailable(format!("{e:?}")));
            }
            Ok(ActionResult::Succeeded(Success::with_ref("order-k6")))
        },
        idem::BatchErrors::SkipRequest,
    )?;
    ensure!(
        matches!(
            &outcomes[0],
            Err(idem::Error::Store(idem::StoreError::Unavailable(_)))
        ),
        "{outcomes:?}"
    );
    ensure!(
        matches!(&outcomes[1], Ok(RunOutcome::Executed { .. })),
        "{outcomes:?}"
    );
    ensure!(engine.inspect(&reqs[0].key)?.is_none(), "no claim for k5");
    ensure!(orders_of(&schema, &table, "k5")? == 0 && orders_of(&schema, &table, "k6")? == 1);
    Ok(())
}

#[test]
fn one_transaction_on_postgres_a_duplicate_host_waits_and_replays() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let (engine, _store, _clock) = engine_on(&schema, &unique_name("idem_one_tx_a"))?;
    let app = unique_name("idem_one_tx_b");
    let (other, _other_store, _other_clock) = engine_on(&schema, &app)?;
    let table = orders_table(&schema)?;
    let insert = format!("INSERT INTO {table} (idem_key, worker) VALUES ($1, 'test')");
    let req = request("k1", BODY);
    let (inside, entered) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let first = std::thread::scope(|scope| -> Result<RunOutcome> {
        let (engine, req, insert) = (&engine, &req, &insert);
        let first = scope.spawn(move || {
            PgRun::run_in_one_transaction(engine, req, |_, client| {
                client
                    .execute(insert.as_str(), &[&req.key.idem_key])
                    .expect("write");
                inside.send(()).expect("the test waits");
                released.recv().expect("the test releases");
                ActionResult::Succeeded(Success::with_ref("order-1"))
            })
        });
        entered.recv_timeout(SETTLE)?;
        // The other host's claim waits on the uncommitted key, then replays.
        let duplicate = scope.spawn(|| other.begin(req));
        wait_for_lock_wait(&mut schema.raw()?, &app)?;
        release.send(())?;
        match duplicate.join().expect("duplicate")? {
            Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-1"), "{r:?}"),
            d => bail!("expected a replay, got {d:?}"),
        }
        Ok(first.join().expect("first")?)
    })?;
    ensure!(matches!(first, RunOutcome::Executed { .. }), "{first:?}");
    ensure!(orders_of(&schema, &table, "k1")? == 1);
    Ok(())
}

#[test]
fn killed_inside_a_postgres_business_transaction_leaves_no_business_row() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    // The worker's store creates the schema; the business table goes in it.
    let (survivor, _store, clock) = engine_on(&schema, &unique_name("idem_survivor"))?;
    let table = orders_table(&schema)?;
    let app = unique_name("idem_worker");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idem-test-worker"))
        .args([
            "hold-pg",
            &schema.url_with("application_name", &app),
            &schema.name,
            "k1",
            &T0.to_string(),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().context("stdout")?),
        &mut line,
    )?;
    ensure!(line.trim() == "holding true", "worker said {line:?}");
    // The worker's transaction is open, its business row written in it.
    let open = "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1 \
                AND state LIKE 'idle in transaction%'";
    let mut admin = schema.raw()?;
    let open_now = |admin: &mut postgres::Client| -> Result<i64> {
        Ok(admin.query_one(open, &[&app])?.get(0))
    };
    ensure!(
        open_now(&mut admin)? == 1,
        "the worker holds no open transaction"
    );
    child.kill()?; // SIGKILL, inside the transaction
    child.wait()?;
    // The server rolls the transaction back when the connection closes.
    let deadline = Instant::now() + SETTLE;
    while open_now(&mut admin)? != 0 {
        ensure!(
            Instant::now() < deadline,
            "the killed worker's transaction stayed open"
        );
        std::thread::yield_now();
    }
    ensure!(orders_of(&schema, &table, "k1")? == 0);
    // The claim itself was committed before the action: the key is in
    // progress until its lease ends, then the policy decides.
    let policy = Policy::default();
    let req = BeginRequest::json(key("k1"), "{}", policy.clone());
    ensure!(matches!(survivor.begin(&req)?, Decision::InProgress(_)));
    clock.set(T0 + policy.lease_ms);
    let manual = BeginRequest::json(
        key("k1"),
        "{}",
        Policy {
            expired_lease: ExpiredLease::Manual,
            ..policy.clone()
        },
    );
    ensure!(matches!(
        survivor.begin(&manual)?,
        Decision::OutcomeUnknown(_)
    ));
    match survivor.begin(&req)? {
        Decision::Execute(t) => ensure!(t.fencing_token == 2 && t.attempt == 2, "{t:?}"),
        other => bail!("expected a take-over, got {other:?}"),
    }
    Ok(())
}

/// The operator's commands on PostgreSQL: `idem stuck` lists a crashed
/// owner's key and an unknown outcome, `idem settle` decides each, and the
/// engine then replays (or runs again) accordingly.
#[test]
fn an_operator_lists_and_settles_stuck_keys_on_postgres() -> Result<()> {
    let Some(schema) = PgSchema::new() else {
        return Ok(());
    };
    let (engine, _store, clock) = engine_on(&schema, &unique_name("idem_operator"))?;
    // Records from an hour ago: the crashed owner's lease is long over.
    let p = Policy::default();
    clock.set(
        u64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_millis(),
        )? - 3_600_000,
    );
    let req = |k: &str| BeginRequest::json(key(k), "{}", p.clone());
    let Decision::Execute(_crashed) = engine.begin(&req("crashed"))? else {
        bail!("expected execute");
    };
    let Decision::Execute(unknown) = engine.begin(&req("unknown"))? else {
        bail!("expected execute");
    };
    let timeout = Failure {
        code: "timeout".into(),
        message: String::new(),
        response: None,
    };
    engine.fail(&unknown, &p, &timeout, Disposition::OutcomeUnknown)?;
    let db = [
        "--db",
        schema.url.as_str(),
        "--pg-schema",
        schema.name.as_str(),
    ];
    let stuck =
        serve::idem_ok(&[&["stuck", "--biz", "order.create", "--json"][..], &db[..]].concat())?
            .json()?;
    let mut keys: Vec<&str> = stuck
        .as_array()
        .context("a list")?
        .iter()
        .filter_map(|r| r["key"].as_str())
        .collect();
    keys.sort_unstable();
    ensure!(keys == ["crashed", "unknown"], "{stuck}");
    let who = ["--scope", "tenant-1", "--biz", "order.create"];
    serve::idem_ok(
        &[
            &[
                "settle",
                "--key",
                "crashed",
                "--failed",
                "--code",
                "card-declined",
            ][..],
            &who[..],
            &db[..],
        ]
        .concat(),
    )?;
    serve::idem_ok(
        &[
            &[
                "settle",
                "--key",
                "unknown",
                "--succeeded",
                "--result-ref",
                "o-9",
            ][..],
            &who[..],
            &db[..],
        ]
        .concat(),
    )?;
    match engine.begin(&req("crashed"))? {
        Decision::Failed(f) => ensure!(f.code == "card-declined", "{f:?}"),
        other => bail!("expected the settled failure, got {other:?}"),
    }
    match engine.begin(&req("unknown"))? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("o-9"), "{r:?}"),
        other => bail!("expected the settled success, got {other:?}"),
    }
    let none =
        serve::idem_ok(&[&["stuck", "--biz", "order.create", "--json"][..], &db[..]].concat())?
            .json()?;
    ensure!(none.as_array().is_some_and(Vec::is_empty), "{none}");
    Ok(())
}
