//! The RabbitMQ adapter against the real broker on 127.0.0.1:5672
//! (guest/guest): duplicates published by the producer, competing
//! consumers, poison messages, conflicts, a consumer whose connection dies
//! mid-message, on SQLite and PostgreSQL. Each test has queues of its own,
//! deleted at the end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use idem_consumer::{Consumer, ConsumerConfig, HandlerError};
use idem_engine::{Engine, Storage};
use idem_rabbitmq::lapin::options::{BasicGetOptions, ConfirmSelectOptions, QueueDeclareOptions};
use idem_rabbitmq::lapin::types::{AMQPValue, FieldTable};
use idem_rabbitmq::lapin::{Channel, Connection, ConnectionProperties};
use idem_rabbitmq::{
    DEAD_LETTER_HEADER, Incoming, Options, RabbitConsumer, Stats, Topology, publish,
};
use tokio::sync::watch;

/// The broker every developer and CI machine runs.
const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The longest a test waits for the consumers to drain its queue.
const DRAIN: Duration = Duration::from_secs(120);

/// A queue name of the test's own.
fn unique(prefix: &str) -> String {
    idem_engine::testing::unique_name(&format!("idem-test-{prefix}"))
}

async fn connect() -> Result<Connection> {
    Connection::connect(AMQP_URL, ConnectionProperties::default())
        .await
        .context("RabbitMQ on 127.0.0.1:5672 (guest/guest) must answer: `.ci/run` checks it")
}

/// One test's queues, deleted on [`Queues::delete`].
struct Queues {
    conn: Connection,
    producer: Channel,
    topology: Topology,
}

impl Queues {
    async fn new(prefix: &str) -> Result<Self> {
        let conn = connect().await?;
        let producer = conn.create_channel().await?;
        producer
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let topology = Topology::declare(&producer, &unique(prefix)).await?;
        Ok(Self {
            conn,
            producer,
            topology,
        })
    }

    async fn publish(&self, id: &str, body: &[u8]) -> Result<()> {
        publish(&self.producer, &self.topology.queue, id, body).await?;
        Ok(())
    }

    /// Messages ready in `queue` (not counting unacked deliveries).
    async fn ready(&self, queue: &str) -> Result<u32> {
        let q = self
            .producer
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        Ok(q.message_count())
    }

    /// Takes every message in the dead-letter queue: (id, reason).
    async fn dead_letters(&self) -> Result<Vec<(String, String)>> {
        let mut out = Vec::new();
        while let Some(m) = self
            .producer
            .basic_get(
                self.topology.dead_letter_queue.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await?
        {
            let id = m
                .delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default();
            let reason = match m
                .delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(DEAD_LETTER_HEADER).cloned())
            {
                Some(AMQPValue::LongString(s)) => s.to_string(),
                other => format!("{other:?}"),
            };
            out.push((id, reason));
        }
        Ok(out)
    }

    async fn delete(self) -> Result<()> {
        self.topology.delete(&self.producer).await?;
        self.conn.close(200, "done".into()).await?;
        Ok(())
    }
}

/// Business effects by message id: the handler's one write.
#[derive(Clone, Default)]
struct Effects(Arc<Mutex<HashMap<String, Vec<Vec<u8>>>>>);

impl Effects {
    fn record(&self, m: &Incoming) {
        self.0
            .lock()
            .expect("effects")
            .entry(m.id.clone())
            .or_default()
            .push(m.body.clone());
    }

    fn of(&self, id: &str) -> Vec<Vec<u8>> {
        self.0
            .lock()
            .expect("effects")
            .get(id)
            .cloned()
            .unwrap_or_default()
    }

    fn counts(&self) -> HashMap<String, usize> {
        self.0
            .lock()
            .expect("effects")
            .iter()
            .map(|(k, v)| (k.clone(), v.len()))
            .collect()
    }
}

fn consumer_on(store: impl Storage, config: ConsumerConfig) -> Result<Consumer> {
    Ok(Consumer::new(
        Engine::builder().storage(store).build()?,
        config,
    ))
}

/// Runs `consumers` on `queues` until `done` says the work is over (or
/// [`DRAIN`] passes), then stops them; returns their stats.
async fn run_until<H, Fut>(
    queues: &Queues,
    consumers: Vec<Consumer>,
    handler: H,
    done: impl Fn(&[Arc<Stats>]) -> bool,
) -> Result<Vec<Arc<Stats>>>
where
    H: Fn(Incoming) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<&'static str, HandlerError>> + Send,
{
    run_until_with(
        queues,
        consumers,
        move |rabbit, shutdown| {
            let handler = handler.clone();
            tokio::spawn(async move { rabbit.run(handler, shutdown).await })
        },
        done,
    )
    .await
}

/// The shutdown signal a consumer task is given.
type Shutdown = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// [`run_until`], with `spawn` starting each consumer's task.
async fn run_until_with(
    queues: &Queues,
    consumers: Vec<Consumer>,
    spawn: impl Fn(
        RabbitConsumer,
        Shutdown,
    ) -> tokio::task::JoinHandle<Result<(), idem_rabbitmq::AdapterError>>,
    done: impl Fn(&[Arc<Stats>]) -> bool,
) -> Result<Vec<Arc<Stats>>> {
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    let mut stats = Vec::new();
    for consumer in consumers {
        let channel = queues.conn.create_channel().await?;
        let rabbit = RabbitConsumer::new(
            channel,
            queues.topology.clone(),
            consumer,
            Options::default(),
        )
        .await?;
        stats.push(rabbit.stats());
        let mut stopped = stopped.clone();
        tasks.push(spawn(
            rabbit,
            Box::pin(async move {
                let _ = stopped.wait_for(|s| *s).await;
            }),
        ));
    }
    let deadline = Instant::now() + DRAIN;
    while !done(&stats) {
        if Instant::now() > deadline {
            let _ = stop.send(true);
            bail!("the consumers did not finish within {DRAIN:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(true);
    drop(stopped);
    for t in tasks {
        t.await??;
    }
    Ok(stats)
}

fn total(stats: &[Arc<Stats>], f: impl Fn(&Stats) -> &std::sync::atomic::AtomicU64) -> u64 {
    stats.iter().map(|s| Stats::get(f(s))).sum()
}

/// 1,000 messages, each published twice (a producer retry), consumed by
/// `consumers`: exactly 1,000 effects, every delivery acked, nothing left.
async fn thousand_published_twice(
    prefix: &str,
    consumers: Vec<Consumer>,
) -> Result<(Queues, Effects, Vec<Arc<Stats>>)> {
    const MESSAGES: usize = 1_000;
    let queues = Queues::new(prefix).await?;
    for i in 0..MESSAGES {
        let body = format!("{{\"order\":{i}}}");
        queues.publish(&format!("m-{i}"), body.as_bytes()).await?;
        queues.publish(&format!("m-{i}"), body.as_bytes()).await?;
    }
    let effects = Effects::default();
    let e = effects.clone();
    let stats = run_until(
        &queues,
        consumers,
        move |m: Incoming| {
            let e = e.clone();
            async move {
                e.record(&m);
                Ok("done")
            }
        },
        |s| total(s, |s| &s.executed) + total(s, |s| &s.duplicates) >= 2 * MESSAGES as u64,
    )
    .await?;
    let counts = effects.counts();
    ensure!(counts.len() == MESSAGES, "{} ids took effect", counts.len());
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n != 1).collect();
    ensure!(
        twice.is_empty(),
        "ids with other than one effect: {twice:?}"
    );
    ensure!(total(&stats, |s| &s.executed) == MESSAGES as u64);
    ensure!(total(&stats, |s| &s.duplicates) == MESSAGES as u64);
    ensure!(total(&stats, |s| &s.dead_lettered) == 0);
    ensure!(queues.ready(&queues.topology.queue).await? == 0);
    println!(
        "{prefix}: {MESSAGES} messages published twice, {} deliveries, {} effects, {} duplicates acked, {} retried",
        total(&stats, |s| &s.delivered),
        counts.values().sum::<usize>(),
        total(&stats, |s| &s.duplicates),
        total(&stats, |s| &s.retried),
    );
    Ok((queues, effects, stats))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_consumers_on_one_sqlite_file_take_each_message_once() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.db");
    // Four consumers as four processes would be: each opens the file.
    let consumers = (0..4)
        .map(|_| {
            let store = idem_sqlite::SqliteStore::open(&path, Default::default())?;
            consumer_on(store, ConsumerConfig::new("order.create"))
        })
        .collect::<Result<Vec<_>>>()?;
    let (queues, _, _) = thousand_published_twice("sqlite", consumers).await?;
    queues.delete().await
}

/// Four consumers on one SQLite file, each handling the deliveries that
/// have arrived in one transaction (`run_batch_in_one_transaction`), with
/// a business row per message: 1,000 messages published twice, 1,000 rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_batching_consumers_write_each_message_once() -> Result<()> {
    use idem_sqlite::RunInTransaction as _;
    const MESSAGES: usize = 1_000;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.db");
    rusqlite::Connection::open(&path)?
        .execute_batch("CREATE TABLE orders (idem_key TEXT NOT NULL)")?;
    let consumers = (0..4)
        .map(|_| {
            let store = idem_sqlite::SqliteStore::open(&path, Default::default())?;
            consumer_on(store, ConsumerConfig::new("order.create"))
        })
        .collect::<Result<Vec<_>>>()?;
    let queues = Queues::new("batch").await?;
    for i in 0..MESSAGES {
        let body = format!("{{\"order\":{i}}}");
        queues.publish(&format!("m-{i}"), body.as_bytes()).await?;
        queues.publish(&format!("m-{i}"), body.as_bytes()).await?;
    }
    let largest = Arc::new(AtomicUsize::new(0));
    let seen = largest.clone();
    let stats = run_until_with(
        &queues,
        consumers,
        move |rabbit, shutdown| {
            let seen = seen.clone();
            tokio::spawn(async move {
                rabbit
                    .run_batch_blocking(
                        usize::from(idem_rabbitmq::DEFAULT_PREFETCH),
                        move |batch: Vec<Incoming>, engine: &Engine, requests| {
                            seen.fetch_max(batch.len(), Ordering::Relaxed);
                            engine.run_batch_in_one_transaction(requests, |i, _, conn| {
                                match conn.execute("INSERT INTO orders VALUES (?1)", [&batch[i].id])
                                {
                                    Ok(_) => idem_engine::ActionResult::Succeeded(
                                        idem_engine::Success::with_ref(&batch[i].id),
                                    ),
                                    Err(e) => idem_engine::ActionResult::retryable("db", e),
                                }
                            })
                        },
                        shutdown,
                    )
                    .await
            })
        },
        |s| total(s, |s| &s.executed) + total(s, |s| &s.duplicates) >= 2 * MESSAGES as u64,
    )
    .await?;
    let (rows, distinct): (i64, i64) = rusqlite::Connection::open(&path)?.query_row(
        "SELECT count(*), count(DISTINCT idem_key) FROM orders",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    ensure!(
        rows == MESSAGES as i64 && distinct == rows,
        "rows {rows}, distinct {distinct}"
    );
    ensure!(total(&stats, |s| &s.executed) == MESSAGES as u64);
    ensure!(total(&stats, |s| &s.duplicates) == MESSAGES as u64);
    ensure!(total(&stats, |s| &s.dead_lettered) == 0);
    ensure!(queues.ready(&queues.topology.queue).await? == 0);
    let largest = largest.load(Ordering::Relaxed);
    ensure!(largest > 1, "the deliveries were never batched");
    println!(
        "batch: {MESSAGES} messages published twice, {} deliveries, {rows} rows, largest batch {largest}",
        total(&stats, |s| &s.delivered),
    );
    queues.delete().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_on_one_postgres_database_take_each_message_once() -> Result<()> {
    let Ok(url) = std::env::var("IDEM_TEST_PG_URL") else {
        eprintln!("skipped: IDEM_TEST_PG_URL is not set (CI sets it)");
        return Ok(());
    };
    let schema = unique("pg").replace('-', "_");
    // Two stores, two connection pools: as two machines would be. The
    // PostgreSQL client blocks: it is opened off the async threads.
    let (u, s) = (url.clone(), schema.clone());
    let consumers = tokio::task::spawn_blocking(move || {
        (0..2)
            .map(|_| {
                let options = idem_postgres::PostgresOptions {
                    schema: s.clone(),
                    ..Default::default()
                };
                let store = idem_postgres::PostgresStore::connect(&u, options)?;
                consumer_on(store, ConsumerConfig::new("order.create"))
            })
            .collect::<Result<Vec<_>>>()
    })
    .await??;
    let outcome = thousand_published_twice("postgres", consumers).await;
    tokio::task::spawn_blocking(move || -> Result<()> {
        let mut admin = postgres::Client::connect(&url, postgres::NoTls)?;
        admin.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))?;
        Ok(())
    })
    .await??;
    outcome?.0.delete().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_retried_with_a_limit_then_dead_lettered() -> Result<()> {
    let queues = Queues::new("poison").await?;
    let mut config = ConsumerConfig::new("order.create");
    config.policy.max_attempts = Some(3);
    config.first_retry_delay = Duration::from_millis(100);
    let consumer = consumer_on(idem_engine::MemoryStore::new(), config)?;
    queues.publish("poison", b"{}").await?;
    queues.publish("declined", b"{}").await?;
    let runs = Effects::default();
    let r = runs.clone();
    let handler = move |m: Incoming| {
        let r = r.clone();
        async move {
            r.record(&m);
            match m.id.as_str() {
                "poison" => Err(HandlerError::retryable("stock-db-down", "timeout")),
                _ => Err(HandlerError::final_failure("card-declined", "declined")),
            }
        }
    };
    run_until(&queues, vec![consumer.clone()], handler.clone(), |s| {
        total(s, |s| &s.dead_lettered) >= 2
    })
    .await?;
    ensure!(
        runs.of("poison").len() == 3,
        "poison ran {:?}",
        runs.of("poison").len()
    );
    ensure!(runs.of("declined").len() == 1);
    let mut dead = queues.dead_letters().await?;
    dead.sort();
    ensure!(
        dead == [
            ("declined".to_owned(), "failed".to_owned()),
            ("poison".to_owned(), "failed".to_owned())
        ],
        "{dead:?}"
    );
    // Published again: dead-lettered again as final, without running.
    queues.publish("declined", b"{}").await?;
    run_until(&queues, vec![consumer], handler, |s| {
        total(s, |s| &s.dead_lettered) >= 1
    })
    .await?;
    ensure!(runs.of("declined").len() == 1);
    ensure!(queues.dead_letters().await? == [("declined".to_owned(), "failed".to_owned())]);
    queues.delete().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_id_with_another_body_is_dead_lettered_as_a_conflict() -> Result<()> {
    let queues = Queues::new("conflict").await?;
    let consumer = consumer_on(idem_engine::MemoryStore::new(), ConsumerConfig::new("o"))?;
    queues.publish("m-1", b"first").await?;
    queues.publish("m-1", b"second").await?;
    let effects = Effects::default();
    let e = effects.clone();
    run_until(
        &queues,
        vec![consumer],
        move |m: Incoming| {
            let e = e.clone();
            async move {
                e.record(&m);
                Ok("done")
            }
        },
        |s| total(s, |s| &s.executed) + total(s, |s| &s.dead_lettered) >= 2,
    )
    .await?;
    ensure!(
        effects.of("m-1") == [b"first".to_vec()],
        "{:?}",
        effects.of("m-1")
    );
    ensure!(queues.dead_letters().await? == [("m-1".to_owned(), "conflict".to_owned())]);
    queues.delete().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_an_id_is_dead_lettered_as_invalid() -> Result<()> {
    let queues = Queues::new("no-id").await?;
    let consumer = consumer_on(idem_engine::MemoryStore::new(), ConsumerConfig::new("o"))?;
    publish(&queues.producer, &queues.topology.queue, "", b"x").await?;
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    run_until(
        &queues,
        vec![consumer],
        move |_m: Incoming| {
            r.fetch_add(1, Ordering::SeqCst);
            async { Ok("done") }
        },
        |s| total(s, |s| &s.dead_lettered) >= 1,
    )
    .await?;
    ensure!(ran.load(Ordering::SeqCst) == 0);
    ensure!(queues.dead_letters().await? == [(String::new(), "invalid".to_owned())]);
    queues.delete().await
}
