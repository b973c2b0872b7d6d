//! The adapter against a real NATS server with JetStream on
//! 127.0.0.1:4222 (`NATS_URL` overrides it). Each test makes streams,
//! subjects and consumers of its own, so the tests run in parallel on one
//! server, and deletes its streams when it ends, passed or failed (the
//! messages of a test killed before that expire after [`STREAM_MAX_AGE`]). The PostgreSQL variant runs when
//! `IDEM_TEST_PG_URL` names a server and is skipped (saying so) otherwise.
//!
//! Run with `--nocapture` to see each test's figures.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::message::{PublishMessage, StreamMessage};
use async_nats::jetstream::stream::{self, StorageType};
use async_nats::jetstream::{self, Context};
use bytes::Bytes;
use idem_consumer::{Batcher, Consumer, ConsumerConfig, HandlerError};
use idem_engine::types::Success;
use idem_engine::{ActionResult, Engine, MemoryStore};
use idem_nats::{
    AdapterConfig, DELIVERED_HEADER, DETAIL_HEADER, Delivery, Incoming, JetStreamAdapter,
    MESSAGE_ID_HEADER, MessageId, NatsError, REASON_HEADER, Report,
};
use idem_sqlite::RunInTransaction;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The header the producer in these tests puts the idem key in. The
/// 1,000 x 2 test leaves `Nats-Msg-Id` off so that JetStream keeps both
/// copies of each message, as it does for a retry after the stream's
/// `duplicate_window`.
const KEY_HEADER: &str = "Idem-Key";

/// How long a test waits for the broker to reach a state (all messages
/// acked, a dead letter stored) before it fails: far beyond what a healthy
/// local server needs, short enough that a hang fails the test.
const SETTLE: Duration = Duration::from_secs(60);

/// How often a waiting test asks the server again.
const POLL: Duration = Duration::from_millis(20);

/// How long a test stream keeps a message: longer than any test, short
/// enough that the streams of a killed test run hold nothing for long.
const STREAM_MAX_AGE: Duration = Duration::from_secs(600);

/// The consumer's ack_wait where the test does not exercise it: no handler
/// here comes close, so every redelivery is idem's or the producer's doing.
const LONG_ACK_WAIT: Duration = Duration::from_secs(30);

/// The ack_wait of the slow-handler tests: JetStream redelivers an unacked
/// message after 1 s.
const SHORT_ACK_WAIT: Duration = Duration::from_secs(1);

/// The slow handler's run: two and a half ack_waits, so that without
/// progress notes JetStream redelivers it at least twice meanwhile.
const SLOW_HANDLER: Duration = Duration::from_millis(2500);

/// The biz type of the tests' consumers.
const BIZ: &str = "inventory.reserve";

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned())
}

use idem_engine::testing::Gate;
use idem_engine::testing::unique_name as unique;

/// A test's own stream and subject, and a dead-letter stream and subject.
struct Broker {
    js: Context,
    stream: String,
    subject: String,
    dlq_stream: String,
    dlq_subject: String,
}

impl Broker {
    async fn new(tag: &str) -> anyhow::Result<Broker> {
        let client = async_nats::connect(nats_url())
            .await
            .context("connect to NATS (is nats-server -js running?)")?;
        let js = jetstream::new(client);
        let name = unique(tag);
        let broker = Broker {
            js,
            stream: name.to_uppercase(),
            subject: format!("idem_test.{name}"),
            dlq_stream: format!("{}_DLQ", name.to_uppercase()),
            dlq_subject: format!("idem_test_dlq.{name}"),
        };
        for (stream, subject) in [
            (&broker.stream, &broker.subject),
            (&broker.dlq_stream, &broker.dlq_subject),
        ] {
            broker
                .js
                .create_stream(stream::Config {
                    name: stream.clone(),
                    subjects: vec![subject.clone()],
                    storage: StorageType::Memory,
                    max_age: STREAM_MAX_AGE,
                    ..Default::default()
                })
                .await
                .with_context(|| format!("create stream {stream}"))?;
        }
        Ok(broker)
    }

    /// A durable pull consumer on the stream, with explicit acks and
    /// unlimited deliveries (idem decides when a message is dead).
    async fn consumer(&self, name: &str, ack_wait: Duration) -> anyhow::Result<PullConsumer> {
        let stream = self.js.get_stream(&self.stream).await?;
        Ok(stream
            .create_consumer(pull::Config {
                durable_name: Some(name.to_owned()),
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                max_deliver: -1,
                ..Default::default()
            })
            .await?)
    }

    /// Publishes `body` with `key` in [`KEY_HEADER`] (none when `None`)
    /// and no `Nats-Msg-Id`; returns the ack to await.
    async fn publish(
        &self,
        key: Option<&str>,
        body: impl Into<Bytes>,
    ) -> anyhow::Result<jetstream::context::PublishAckFuture> {
        let mut message = PublishMessage::build().payload(body.into());
        if let Some(key) = key {
            message = message.header(KEY_HEADER, key);
        }
        Ok(self.js.send_publish(self.subject.clone(), message).await?)
    }

    async fn stream_messages(&self, stream: &str) -> anyhow::Result<u64> {
        Ok(self
            .js
            .get_stream(stream)
            .await?
            .get_info()
            .await?
            .state
            .messages)
    }

    /// Waits until the consumer has delivered everything and every delivery
    /// was acked or terminated.
    async fn drained(&self, consumer: &PullConsumer) -> anyhow::Result<()> {
        eventually("the consumer to be drained", || async {
            let info = consumer.get_info().await?;
            Ok(info.num_pending == 0 && info.num_ack_pending == 0)
        })
        .await
    }

    /// Waits for `n` dead letters and returns them in order.
    async fn dead_letters(&self, n: u64) -> anyhow::Result<Vec<StreamMessage>> {
        eventually("the dead letters", || async {
            Ok(self.stream_messages(&self.dlq_stream).await? >= n)
        })
        .await?;
        let dlq = self.js.get_stream(&self.dlq_stream).await?;
        let mut letters = Vec::new();
        for seq in 1..=n {
            letters.push(dlq.get_raw_message(seq).await?);
        }
        Ok(letters)
    }

    /// The adapter configuration of the tests: ids from [`KEY_HEADER`],
    /// dead letters to the test's dead-letter stream.
    fn config(&self) -> anyhow::Result<AdapterConfig> {
        let mut config = AdapterConfig::new(&self.stream, &self.dlq_subject);
        config.message_id = MessageId::header(KEY_HEADER)?;
        Ok(config)
    }

    fn adapter(
        &self,
        pull: &PullConsumer,
        consumer: &Consumer,
        config: AdapterConfig,
    ) -> JetStreamAdapter {
        JetStreamAdapter::new(self.js.clone(), pull.clone(), consumer.clone(), config)
    }
}

impl Drop for Broker {
    /// Deletes the test's streams, also when the test failed: on a thread of
    /// its own, since the test's runtime may be unwinding.
    fn drop(&mut self) {
        let streams = [self.stream.clone(), self.dlq_stream.clone()];
        let names = streams.clone();
        let deleted = std::thread::spawn(move || -> anyhow::Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let js = jetstream::new(async_nats::connect(nats_url()).await?);
                for stream in &names {
                    js.delete_stream(stream).await?;
                }
                Ok(())
            })
        })
        .join();
        if !matches!(deleted, Ok(Ok(()))) {
            eprintln!("could not delete the test streams {streams:?}: {deleted:?}");
        }
    }
}

/// Polls `check` until it answers true, failing after [`SETTLE`].
async fn eventually<F, Fut>(what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + SETTLE;
    loop {
        if check().await? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("waited {SETTLE:?} for {what}");
        }
        tokio::time::sleep(POLL).await;
    }
}

fn header<'a>(m: &'a StreamMessage, name: &str) -> Option<&'a str> {
    m.headers.get(name).map(|v| v.as_str())
}

/// The business effects: each message id and the bodies it ran with.
#[derive(Clone, Default)]
struct Effects(Arc<Mutex<HashMap<String, Vec<Bytes>>>>);

impl Effects {
    fn record(&self, d: &Delivery) {
        self.0
            .lock()
            .expect("effects")
            .entry(d.id.clone())
            .or_default()
            .push(d.message.payload.clone());
    }

    fn ids(&self) -> usize {
        self.0.lock().expect("effects").len()
    }

    fn total(&self) -> usize {
        self.0.lock().expect("effects").values().map(Vec::len).sum()
    }

    fn of(&self, id: &str) -> Vec<Bytes> {
        self.0
            .lock()
            .expect("effects")
            .get(id)
            .cloned()
            .unwrap_or_default()
    }

    /// A handler that records the effect and succeeds.
    fn handler(
        &self,
    ) -> impl Fn(Delivery) -> std::future::Ready<Result<String, HandlerError>> + Send + Sync + 'static
    {
        let effects = self.clone();
        move |d: Delivery| {
            effects.record(&d);
            std::future::ready(Ok(format!("reserved {}", d.id)))
        }
    }
}

/// A way to end the runs of a test.
struct Stop(watch::Sender<bool>);

impl Stop {
    fn new() -> Stop {
        Stop(watch::channel(false).0)
    }

    fn signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.0.subscribe();
        async move {
            let _ = rx.wait_for(|stopped| *stopped).await;
        }
    }

    fn now(&self) {
        self.0.send_replace(true);
    }
}

/// Runs `adapter` with `handler` on a task of its own until `stop`.
fn spawn<H, Fut>(
    adapter: JetStreamAdapter,
    handler: H,
    stop: &Stop,
) -> JoinHandle<Result<Report, NatsError>>
where
    H: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<String, HandlerError>> + Send + 'static,
{
    let signal = stop.signal();
    tokio::spawn(async move { adapter.run(handler, signal).await })
}

fn engine_on<S: idem_engine::Storage>(store: S) -> anyhow::Result<Engine> {
    Ok(Engine::builder().storage(store).build()?)
}

fn sum(reports: &[Report]) -> Report {
    reports.iter().fold(Report::default(), |a, r| Report {
        deliveries: a.deliveries + r.deliveries,
        redeliveries: a.redeliveries + r.redeliveries,
        executed: a.executed + r.executed,
        duplicates: a.duplicates + r.duplicates,
        in_progress: a.in_progress + r.in_progress,
        retried: a.retried + r.retried,
        dead_lettered: a.dead_lettered + r.dead_lettered,
        store_errors: a.store_errors + r.store_errors,
        broker_errors: a.broker_errors + r.broker_errors,
    })
}

// ---------------------------------------------------------------------------
// A thousand messages, each published twice, four consumers.

/// How many distinct messages the producer sends; each is sent twice.
const MESSAGES: usize = 1_000;

/// How many consumer runs pull from the one durable consumer.
const CONSUMERS: usize = 4;

/// Publishes [`MESSAGES`] messages twice each (the copies back to back, so
/// that they often reach two consumers at once), without `Nats-Msg-Id`, and
/// lets [`CONSUMERS`] runs, one per engine, consume them; checks that each
/// took effect exactly once and every delivery was acked.
async fn thousand_twice(tag: &str, engines: Vec<Engine>) -> anyhow::Result<()> {
    let broker = Broker::new(tag).await?;
    let pull = broker.consumer("workers", LONG_ACK_WAIT).await?;
    let mut acks = Vec::with_capacity(2 * MESSAGES);
    for i in 0..MESSAGES {
        let key = format!("order-{i}");
        let body = format!("{{\"order\":{i},\"sku\":\"A{}\"}}", i % 7);
        for _ in 0..2 {
            acks.push(broker.publish(Some(&key), body.clone()).await?);
        }
    }
    for ack in acks {
        let ack = ack.await?;
        ensure!(!ack.duplicate, "JetStream dropped a copy");
    }
    ensure!(broker.stream_messages(&broker.stream).await? == 2 * MESSAGES as u64);

    let effects = Effects::default();
    let stop = Stop::new();
    let started = Instant::now();
    let runs: Vec<_> = engines
        .into_iter()
        .map(|engine| {
            let consumer = Consumer::new(engine, ConsumerConfig::new(BIZ));
            let adapter = broker.adapter(&pull, &consumer, broker.config()?);
            Ok(spawn(adapter, effects.handler(), &stop))
        })
        .collect::<anyhow::Result<_>>()?;
    eventually("every message's effect", || async {
        Ok(effects.ids() == MESSAGES)
    })
    .await?;
    broker.drained(&pull).await?;
    let elapsed = started.elapsed();
    stop.now();
    let mut reports = Vec::new();
    for run in runs {
        reports.push(run.await??);
    }
    let total = sum(&reports);

    println!(
        "{tag}: {MESSAGES} messages published twice = {} in the stream; {} consumers: \
         {} deliveries ({} redeliveries), {} executed, {} duplicates acked, {} in progress \
         elsewhere (nakked), {} business effects, in {elapsed:.2?}; per consumer executed {:?}",
        2 * MESSAGES,
        reports.len(),
        total.deliveries,
        total.redeliveries,
        total.executed,
        total.duplicates,
        total.in_progress,
        effects.total(),
        reports.iter().map(|r| r.executed).collect::<Vec<_>>(),
    );
    let twice: Vec<_> = (0..MESSAGES)
        .map(|i| format!("order-{i}"))
        .filter(|id| effects.of(id).len() != 1)
        .collect();
    ensure!(
        twice.is_empty(),
        "ids without exactly one effect: {twice:?}"
    );
    assert_eq!(effects.total(), MESSAGES);
    assert_eq!(total.executed, MESSAGES as u64);
    // Each of the 2,000 stream messages was acked once: run, or a duplicate.
    assert_eq!(total.executed + total.duplicates, 2 * MESSAGES as u64);
    assert_eq!(total.dead_lettered + total.store_errors + total.retried, 0);
    assert_eq!(
        total.deliveries,
        2 * MESSAGES as u64 + total.in_progress,
        "a delivery is acked, or nakked as in progress and delivered again"
    );
    let info = pull.get_info().await?;
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_messages_published_twice_take_effect_once_on_sqlite() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("idem.db");
    // One store (one pool) per consumer on one file, as separate processes.
    let engines = (0..CONSUMERS)
        .map(|_| {
            let store =
                idem_sqlite::SqliteStore::open(&path, idem_sqlite::SqliteOptions::default())?;
            engine_on(store)
        })
        .collect::<anyhow::Result<_>>()?;
    thousand_twice("sqlite", engines).await
}

/// The PostgreSQL server's URL, or `None` after saying why the test is
/// skipped.
fn pg_url() -> Option<String> {
    match std::env::var("IDEM_TEST_PG_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            eprintln!("skipped: IDEM_TEST_PG_URL is not set, so there is no PostgreSQL server");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_messages_published_twice_take_effect_once_on_postgres() -> anyhow::Result<()> {
    let Some(url) = pg_url() else {
        return Ok(());
    };
    let schema = unique("idem_nats_test");
    // Separate stores, each with its own pool: separate connections, as
    // separate consumer processes have. The client is blocking.
    let engines = {
        let (url, schema) = (url.clone(), schema.clone());
        tokio::task::spawn_blocking(move || {
            (0..CONSUMERS)
                .map(|_| {
                    let store = idem_postgres::PostgresStore::connect(
                        &url,
                        idem_postgres::PostgresOptions {
                            schema: schema.clone(),
                            pool_size: 4,
                            ..Default::default()
                        },
                    )?;
                    engine_on(store)
                })
                .collect::<anyhow::Result<Vec<_>>>()
        })
        .await??
    };
    let outcome = thousand_twice("postgres", engines).await;
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let mut admin = postgres::Client::connect(&url, postgres::NoTls)?;
        admin.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))?;
        Ok(())
    })
    .await??;
    outcome
}

/// How many messages the blocking-handler test sends, each twice.
const BLOCKING_MESSAGES: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_handler_writes_each_message_once_in_the_idem_transaction() -> anyhow::Result<()>
{
    writers("blocking", false).await.map(drop)
}

/// As above, with each consumer's messages in flight run together, one
/// transaction (one commit) per batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batching_handler_writes_each_message_once_in_one_transaction_per_batch()
-> anyhow::Result<()> {
    let largest = writers("batching", true).await?;
    assert!(largest > 1, "the messages were never batched");
    Ok(())
}

/// A SQLite store with the business table of the writer tests, in idem's
/// database and without a unique constraint: a second write of one message
/// would show.
fn reservations_store(dir: &tempfile::TempDir) -> anyhow::Result<idem_sqlite::SqliteStore> {
    let store = idem_sqlite::SqliteStore::open(
        dir.path().join("idem.db"),
        idem_sqlite::SqliteOptions::default(),
    )?;
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| {
        c.execute_batch("CREATE TABLE reservations (id TEXT NOT NULL, body BLOB NOT NULL)")
    })??;
    tx.commit()?;
    Ok(store)
}

/// Publishes [`BLOCKING_MESSAGES`] messages, each twice (a producer retry).
async fn publish_each_twice(broker: &Broker) -> anyhow::Result<()> {
    for i in 0..BLOCKING_MESSAGES {
        for _ in 0..2 {
            broker
                .publish(Some(&format!("order-{i}")), format!("qty={i}"))
                .await?
                .await?;
        }
    }
    Ok(())
}

/// The reservation rows, and how many distinct ids they have.
fn reservation_rows(store: &idem_sqlite::SqliteStore) -> anyhow::Result<(i64, i64)> {
    let tx = store.begin_transaction()?;
    let counts = tx.with_connection(|c| {
        c.query_row(
            "SELECT COUNT(*), COUNT(DISTINCT id) FROM reservations",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
    })??;
    tx.rollback()?;
    Ok(counts)
}

/// Waits for every message's reservation and for the consumer to be
/// drained, stops the runs and sums their reports.
async fn settled(
    broker: &Broker,
    pull: &PullConsumer,
    store: &idem_sqlite::SqliteStore,
    stop: Stop,
    runs: Vec<JoinHandle<Result<Report, NatsError>>>,
) -> anyhow::Result<Report> {
    eventually("every reservation", || async {
        Ok(reservation_rows(store)?.1 == BLOCKING_MESSAGES as i64)
    })
    .await?;
    broker.drained(pull).await?;
    stop.now();
    let mut reports = Vec::new();
    for run in runs {
        reports.push(run.await??);
    }
    Ok(sum(&reports))
}

/// The business row of a delivery, written in the idem transaction.
fn reserve(conn: &rusqlite::Connection, incoming: &Incoming) -> ActionResult {
    match conn.execute(
        "INSERT INTO reservations (id, body) VALUES (?1, ?2)",
        (incoming.id.as_str(), incoming.message.payload.as_ref()),
    ) {
        Ok(_) => ActionResult::Succeeded(Success::with_ref(incoming.id.clone())),
        Err(e) => ActionResult::retryable("reservations", e),
    }
}

/// [`BLOCKING_MESSAGES`] published twice, two consumers writing a row per
/// message in the idem transaction (`run_in_transaction`, or with `batch`
/// `run_batch_in_one_transaction`): one row per message. Returns the
/// largest batch.
async fn writers(tag: &str, batch: bool) -> anyhow::Result<usize> {
    let broker = Broker::new(tag).await?;
    let pull = broker.consumer("writers", LONG_ACK_WAIT).await?;
    let dir = tempfile::tempdir()?;
    let store = reservations_store(&dir)?;
    let consumer = Consumer::new(engine_on(store.clone())?, ConsumerConfig::new(BIZ));
    publish_each_twice(&broker).await?;
    let stop = Stop::new();
    let largest = Arc::new(AtomicUsize::new(0));
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let adapter = broker.adapter(&pull, &consumer, broker.config()?);
            let signal = stop.signal();
            let largest = largest.clone();
            Ok(tokio::spawn(async move {
                if batch {
                    adapter
                        .run_batch_blocking(
                            usize::MAX,
                            move |batch: Vec<Incoming>, engine: &Engine, requests| {
                                largest.fetch_max(batch.len(), Ordering::SeqCst);
                                engine.run_batch_in_one_transaction(requests, |i, _, conn| {
                                    reserve(conn, &batch[i])
                                })
                            },
                            signal,
                        )
                        .await
                } else {
                    adapter
                        .run_blocking(
                            |incoming: Incoming, engine: &Engine, request| {
                                engine
                                    .run_in_transaction(request, |_, conn| reserve(conn, &incoming))
                            },
                            signal,
                        )
                        .await
                }
            }))
        })
        .collect::<anyhow::Result<_>>()?;
    let total = settled(&broker, &pull, &store, stop, runs).await?;
    let rows = || reservation_rows(&store);
    let (written, distinct) = rows()?;
    let largest = largest.load(Ordering::SeqCst);
    println!(
        "{tag}: {BLOCKING_MESSAGES} messages published twice, 2 consumers writing in the idem \
         transaction: {written} rows ({distinct} ids), {} deliveries, {} executed, {} duplicates, \
         {} in progress, largest batch {largest}",
        total.deliveries, total.executed, total.duplicates, total.in_progress
    );
    assert_eq!(
        (written, distinct),
        (BLOCKING_MESSAGES as i64, BLOCKING_MESSAGES as i64)
    );
    assert_eq!(total.executed, BLOCKING_MESSAGES as u64);
    assert_eq!(
        total.executed + total.duplicates,
        2 * BLOCKING_MESSAGES as u64
    );
    Ok(largest)
}

/// Messages in flight per adapter when two adapters share a batcher.
const SHARED_IN_FLIGHT: usize = 4;

/// Two adapters on one durable consumer, sharing one batcher
/// (`run_batched`): while a batch runs, the deliveries of both wait, and
/// the next batch takes them all, more than one adapter ever has in
/// flight; batches never overlap; and every message, published twice,
/// takes effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_sharing_a_batcher_commit_their_deliveries_in_one_batch() -> anyhow::Result<()> {
    let broker = Broker::new("shared").await?;
    let pull = broker.consumer("shared", LONG_ACK_WAIT).await?;
    let dir = tempfile::tempdir()?;
    let store = reservations_store(&dir)?;
    let consumer = Consumer::new(engine_on(store.clone())?, ConsumerConfig::new(BIZ));
    publish_each_twice(&broker).await?;
    let sizes = Arc::new(Mutex::new(Vec::<usize>::new()));
    let running = Arc::new(AtomicUsize::new(0));
    let overlapped = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Gate::default());
    let batcher = Batcher::new(&consumer, 2 * SHARED_IN_FLIGHT, {
        let (sizes, running, overlapped, gate) = (
            sizes.clone(),
            running.clone(),
            overlapped.clone(),
            gate.clone(),
        );
        move |batch: Vec<Incoming>, engine: &Engine, requests: &[idem_engine::BeginRequest]| {
            if running.fetch_add(1, Ordering::SeqCst) > 0 {
                overlapped.fetch_add(1, Ordering::SeqCst);
            }
            let first = {
                let mut sizes = sizes.lock().unwrap_or_else(|p| p.into_inner());
                sizes.push(batch.len());
                sizes.len() == 1
            };
            if first {
                gate.wait();
            }
            let outcomes = engine
                .run_batch_in_one_transaction(requests, |i, _, conn| reserve(conn, &batch[i]));
            running.fetch_sub(1, Ordering::SeqCst);
            outcomes
        }
    });
    let stop = Stop::new();
    let mut config = broker.config()?;
    config.max_in_flight = SHARED_IN_FLIGHT;
    let start = |config: AdapterConfig| {
        let adapter = broker.adapter(&pull, &consumer, config);
        let (batcher, signal) = (batcher.clone(), stop.signal());
        tokio::spawn(async move { adapter.run_batched(batcher, signal).await })
    };
    let sizes_now = || sizes.lock().unwrap_or_else(|p| p.into_inner()).clone();
    // The first adapter: its first batch is held at the gate, the rest of
    // its deliveries wait behind it.
    let mut runs = vec![start(config.clone())];
    eventually("the first batch", || async { Ok(!sizes_now().is_empty()) }).await?;
    let first = sizes_now()[0];
    eventually("the first adapter's deliveries to wait", || async {
        Ok(batcher.waiting() == SHARED_IN_FLIGHT - first)
    })
    .await?;
    // The second adapter's deliveries join them.
    runs.push(start(config));
    eventually("both adapters' deliveries to wait", || async {
        Ok(batcher.waiting() == 2 * SHARED_IN_FLIGHT - first)
    })
    .await?;
    gate.open();
    let total = settled(&broker, &pull, &store, stop, runs).await?;
    let rows = || reservation_rows(&store);
    let sizes = sizes_now();
    println!(
        "shared batcher: {BLOCKING_MESSAGES} messages published twice, 2 adapters x \
         {SHARED_IN_FLIGHT} in flight: {} deliveries, {} executed, {} duplicates, {} batches, \
         the first two of {} and {}",
        total.deliveries,
        total.executed,
        total.duplicates,
        sizes.len(),
        sizes[0],
        sizes[1]
    );
    // The batch after the held one took every delivery that waited, from
    // both adapters: more than one adapter can have in flight. Once the
    // held batch is answered, the first adapter may pull up to `first`
    // new deliveries, which can join before that batch is taken.
    assert!(
        (2 * SHARED_IN_FLIGHT - first..=2 * SHARED_IN_FLIGHT).contains(&sizes[1]),
        "the batch after the held one: {sizes:?}"
    );
    assert!(sizes[1] > SHARED_IN_FLIGHT - first);
    assert_eq!(
        overlapped.load(Ordering::SeqCst),
        0,
        "two batches ran at once"
    );
    assert_eq!(
        rows()?,
        (BLOCKING_MESSAGES as i64, BLOCKING_MESSAGES as i64)
    );
    assert_eq!(total.executed, BLOCKING_MESSAGES as u64);
    assert_eq!(
        total.executed + total.duplicates,
        2 * BLOCKING_MESSAGES as u64
    );
    assert_eq!(total.dead_lettered + total.store_errors, 0);
    Ok(())
}

// ---------------------------------------------------------------------------
// A handler slower than ack_wait.

/// Counts a slow handler's runs and lets the test know when one started.
#[derive(Clone)]
struct Slow {
    runs: Arc<AtomicU64>,
    finished: Arc<AtomicU64>,
    started: Arc<tokio::sync::Notify>,
}

impl Slow {
    fn new() -> Slow {
        Slow {
            runs: Arc::new(AtomicU64::new(0)),
            finished: Arc::new(AtomicU64::new(0)),
            started: Arc::new(tokio::sync::Notify::new()),
        }
    }

    fn handler(
        &self,
    ) -> impl Fn(
        Delivery,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<String, HandlerError>> + Send>>
    + Send
    + Sync
    + 'static {
        let slow = self.clone();
        move |_d: Delivery| {
            let slow = slow.clone();
            Box::pin(async move {
                slow.runs.fetch_add(1, Ordering::SeqCst);
                slow.started.notify_one();
                // The handler's own work takes this long: real time, as the
                // broker's ack_wait is.
                tokio::time::sleep(SLOW_HANDLER).await;
                slow.finished.fetch_add(1, Ordering::SeqCst);
                Ok("slow".to_owned())
            })
        }
    }
}

/// Runs one message through a slow handler on a first run that handles one
/// message at a time; a second run starts once the handler has. Both share
/// one store, as two processes share a database. Returns the handler's runs
/// and both runs' reports.
async fn slow_handler(tag: &str, progress: bool) -> anyhow::Result<(u64, Report, Report)> {
    let broker = Broker::new(tag).await?;
    let pull = broker.consumer("slow", SHORT_ACK_WAIT).await?;
    let consumer = Consumer::new(engine_on(MemoryStore::new())?, ConsumerConfig::new(BIZ));
    let mut config = broker.config()?;
    config.progress = progress;
    // While its handler runs, the first run pulls nothing more, so a
    // redelivery goes to the second.
    config.max_in_flight = 1;
    let slow = Slow::new();
    let stop = Stop::new();
    let started = Instant::now();
    let first = spawn(
        broker.adapter(&pull, &consumer, config.clone()),
        slow.handler(),
        &stop,
    );
    broker.publish(Some("slow-1"), "x").await?.await?;
    tokio::time::timeout(SETTLE, slow.started.notified())
        .await
        .context("the handler did not start")?;
    let second = spawn(
        broker.adapter(&pull, &consumer, config),
        slow.handler(),
        &stop,
    );
    eventually("the slow handler to finish", || async {
        Ok(slow.finished.load(Ordering::SeqCst) >= 1)
    })
    .await?;
    broker.drained(&pull).await?;
    let elapsed = started.elapsed();
    stop.now();
    let (a, b) = (first.await??, second.await??);
    let runs = slow.runs.load(Ordering::SeqCst);
    println!(
        "{tag}: ack_wait {SHORT_ACK_WAIT:?}, handler {SLOW_HANDLER:?}, progress {progress}: \
         handler runs {runs}; first run {} deliveries ({} redeliveries), {} executed, {} \
         duplicates; second run {} deliveries ({} redeliveries), {} in progress (nakked), {} \
         executed, {} duplicates; drained in {elapsed:.2?}",
        a.deliveries,
        a.redeliveries,
        a.executed,
        a.duplicates,
        b.deliveries,
        b.redeliveries,
        b.in_progress,
        b.executed,
        b.duplicates,
    );
    Ok((runs, a, b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_to_a_second_consumer_while_the_handler_runs_is_nakked_not_run()
-> anyhow::Result<()> {
    let (runs, first, second) = slow_handler("slow_no_progress", false).await?;
    assert_eq!(runs, 1, "the handler ran once");
    assert_eq!(first.executed, 1);
    // JetStream redelivered after ack_wait, to the second run, which found
    // the message in progress and nakked it with a delay.
    assert!(second.deliveries >= 1, "{second:?}");
    assert!(second.redeliveries >= 1, "{second:?}");
    assert!(second.in_progress >= 1, "{second:?}");
    assert_eq!(second.executed, 0);
    assert_eq!(first.dead_lettered + second.dead_lettered, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_that_reports_progress_is_not_redelivered() -> anyhow::Result<()> {
    let (runs, first, second) = slow_handler("slow_progress", true).await?;
    assert_eq!(runs, 1);
    assert_eq!(
        (first.deliveries, first.redeliveries, first.executed),
        (1, 0, 1)
    );
    assert_eq!(second.deliveries, 0, "{second:?}");
    assert_eq!(first.broker_errors, 0);
    Ok(())
}

// ---------------------------------------------------------------------------
// Poison messages, conflicts, missing ids, a store that does not answer.

/// Counts each id's handler runs and answers by the id's prefix.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, u32>>>);

impl Runs {
    fn of(&self, id: &str) -> u32 {
        self.0.lock().expect("runs").get(id).copied().unwrap_or(0)
    }

    /// Fails `poison-*` retryably and `declined-*` for good; succeeds
    /// otherwise.
    fn handler(
        &self,
    ) -> impl Fn(Delivery) -> std::future::Ready<Result<String, HandlerError>> + Send + Sync + 'static
    {
        let runs = self.clone();
        move |d: Delivery| {
            *runs
                .0
                .lock()
                .expect("runs")
                .entry(d.id.clone())
                .or_default() += 1;
            std::future::ready(if d.id.starts_with("poison") {
                Err(HandlerError::retryable("stock-db-down", "timeout"))
            } else if d.id.starts_with("declined") {
                Err(HandlerError::final_failure("card-declined", "no"))
            } else {
                Ok("done".to_owned())
            })
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_retried_with_backoff_then_dead_lettered_and_stays_dead()
-> anyhow::Result<()> {
    let broker = Broker::new("poison").await?;
    let pull = broker.consumer("poison", LONG_ACK_WAIT).await?;
    let mut settings = ConsumerConfig::new(BIZ);
    settings.policy.max_attempts = Some(3);
    settings.first_retry_delay = Duration::from_millis(100);
    let consumer = Consumer::new(engine_on(MemoryStore::new())?, settings);
    let runs = Runs::default();
    let stop = Stop::new();
    let run = spawn(
        broker.adapter(&pull, &consumer, broker.config()?),
        runs.handler(),
        &stop,
    );

    // A retryable failure: three attempts, nakked after 100 ms and 200 ms,
    // then dead-lettered as failed.
    let published = Instant::now();
    broker.publish(Some("poison-1"), "p").await?.await?;
    let letters = broker.dead_letters(1).await?;
    let poison_took = published.elapsed();
    let poison = &letters[0];
    assert_eq!(header(poison, REASON_HEADER), Some("failed"));
    assert!(
        header(poison, DETAIL_HEADER).is_some_and(|d| d.contains("stock-db-down")),
        "{:?}",
        poison.headers
    );
    assert_eq!(header(poison, MESSAGE_ID_HEADER), Some("poison-1"));
    assert_eq!(header(poison, KEY_HEADER), Some("poison-1"));
    assert_eq!(header(poison, DELIVERED_HEADER), Some("3"));
    assert_eq!(poison.payload, "p");
    assert_eq!(runs.of("poison-1"), 3);
    assert!(
        poison_took >= Duration::from_millis(300),
        "the naks' delays were not honoured: dead-lettered after {poison_took:?}"
    );

    // A final failure: dead-lettered at once.
    broker.publish(Some("declined-1"), "d").await?.await?;
    let letters = broker.dead_letters(2).await?;
    let declined = &letters[1];
    assert_eq!(header(declined, REASON_HEADER), Some("failed"));
    assert!(header(declined, DETAIL_HEADER).is_some_and(|d| d.contains("card-declined")));
    assert_eq!(header(declined, DELIVERED_HEADER), Some("1"));
    assert_eq!(runs.of("declined-1"), 1);

    // The producer sends it again: dead-lettered again, not run.
    broker.publish(Some("declined-1"), "d").await?.await?;
    let letters = broker.dead_letters(3).await?;
    assert_eq!(header(&letters[2], REASON_HEADER), Some("failed"));
    assert_eq!(header(&letters[2], MESSAGE_ID_HEADER), Some("declined-1"));
    assert_eq!(runs.of("declined-1"), 1);

    broker.drained(&pull).await?;
    stop.now();
    let report = run.await??;
    println!(
        "poison: max_attempts 3, first retry 100 ms: the retryable failure ran {} times and was \
         dead-lettered after {poison_took:.2?}; the final failure ran {} time, its second copy \
         0 times; report {report:?}",
        runs.of("poison-1"),
        runs.of("declined-1"),
    );
    assert_eq!(report.retried, 2);
    assert_eq!(report.dead_lettered, 3);
    assert_eq!(report.deliveries, 5);
    assert_eq!(report.executed, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_id_with_another_body_is_dead_lettered_as_a_conflict_and_the_first_effect_stays()
-> anyhow::Result<()> {
    let broker = Broker::new("conflict").await?;
    let pull = broker.consumer("conflict", LONG_ACK_WAIT).await?;
    let consumer = Consumer::new(engine_on(MemoryStore::new())?, ConsumerConfig::new(BIZ));
    let effects = Effects::default();
    let stop = Stop::new();
    let run = spawn(
        broker.adapter(&pull, &consumer, broker.config()?),
        effects.handler(),
        &stop,
    );
    broker
        .publish(Some("order-1"), "{\"qty\":1}")
        .await?
        .await?;
    eventually("the first effect", || async { Ok(effects.total() == 1) }).await?;
    broker
        .publish(Some("order-1"), "{\"qty\":5}")
        .await?
        .await?;
    let letters = broker.dead_letters(1).await?;
    assert_eq!(header(&letters[0], REASON_HEADER), Some("conflict"));
    assert_eq!(header(&letters[0], MESSAGE_ID_HEADER), Some("order-1"));
    assert_eq!(letters[0].payload, "{\"qty\":5}");
    broker.drained(&pull).await?;
    stop.now();
    let report = run.await??;
    println!(
        "conflict: effects {:?}; report {report:?}",
        effects.of("order-1")
    );
    assert_eq!(effects.of("order-1"), [Bytes::from_static(b"{\"qty\":1}")]);
    assert_eq!((report.executed, report.dead_lettered), (1, 1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_an_id_is_dead_lettered_as_invalid_without_running() -> anyhow::Result<()>
{
    let broker = Broker::new("no_id").await?;
    let pull = broker.consumer("no_id", LONG_ACK_WAIT).await?;
    let consumer = Consumer::new(engine_on(MemoryStore::new())?, ConsumerConfig::new(BIZ));
    let effects = Effects::default();
    let stop = Stop::new();
    let run = spawn(
        broker.adapter(&pull, &consumer, broker.config()?),
        effects.handler(),
        &stop,
    );
    broker.publish(None, "anonymous").await?.await?;
    broker.publish(Some(""), "empty key").await?.await?;
    // Handled concurrently: the dead letters may come in either order.
    let letters = broker.dead_letters(2).await?;
    for letter in &letters {
        assert_eq!(header(letter, REASON_HEADER), Some("invalid"));
    }
    let without = letters
        .iter()
        .find(|l| header(l, MESSAGE_ID_HEADER).is_none())
        .context("the message without a key")?;
    assert!(
        header(without, DETAIL_HEADER).is_some_and(|d| d.contains(KEY_HEADER)),
        "{:?}",
        without.headers
    );
    assert_eq!(without.payload, "anonymous");
    let empty = letters
        .iter()
        .find(|l| header(l, MESSAGE_ID_HEADER) == Some(""))
        .context("the message with an empty key")?;
    assert!(
        header(empty, DETAIL_HEADER).is_some_and(|d| d.contains("empty")),
        "{:?}",
        empty.headers
    );
    broker.drained(&pull).await?;
    stop.now();
    let report = run.await??;
    println!(
        "no id: dead letters {:?}; report {report:?}",
        letters
            .iter()
            .map(|l| header(l, DETAIL_HEADER).unwrap_or_default().to_owned())
            .collect::<Vec<_>>()
    );
    assert_eq!(effects.total(), 0);
    assert_eq!(report.dead_lettered, 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_does_not_answer_gets_naks_never_an_ack() -> anyhow::Result<()> {
    let broker = Broker::new("store_down").await?;
    let pull = broker.consumer("store_down", LONG_ACK_WAIT).await?;
    let store = MemoryStore::new();
    let consumer = Consumer::new(engine_on(store.clone())?, ConsumerConfig::new(BIZ));
    let mut config = broker.config()?;
    config.error_delay = Duration::from_millis(100);
    let effects = Effects::default();
    let stop = Stop::new();
    store.disconnect();
    let run = spawn(
        broker.adapter(&pull, &consumer, config),
        effects.handler(),
        &stop,
    );
    broker.publish(Some("order-1"), "x").await?.await?;
    // Three deliveries while the store is down: each nakked, none acked.
    eventually("three deliveries", || async {
        Ok(pull.get_info().await?.delivered.consumer_sequence >= 3)
    })
    .await?;
    assert_eq!(effects.total(), 0);
    assert_eq!(broker.stream_messages(&broker.dlq_stream).await?, 0);
    store.reconnect();
    eventually("the effect", || async { Ok(effects.total() == 1) }).await?;
    broker.drained(&pull).await?;
    stop.now();
    let report = run.await??;
    println!("store down: report {report:?}");
    assert!(report.store_errors >= 3, "{report:?}");
    assert_eq!((report.executed, report.dead_lettered), (1, 0));
    assert_eq!(report.deliveries, report.store_errors + 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_subject_the_consumer_would_pull_again_is_refused() -> anyhow::Result<()> {
    let broker = Broker::new("loop").await?;
    let pull = broker.consumer("loop", LONG_ACK_WAIT).await?;
    let consumer = Consumer::new(engine_on(MemoryStore::new())?, ConsumerConfig::new(BIZ));
    for subject in [broker.subject.clone(), format!("{}.*", broker.dlq_subject)] {
        let mut config = broker.config()?;
        config.dead_letter_subject = subject.clone();
        let why = refusal(broker.adapter(&pull, &consumer, config)).await?;
        assert!(why.contains("dead-letter subject"), "{why}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_without_explicit_acks_is_refused() -> anyhow::Result<()> {
    let broker = Broker::new("ack_all").await?;
    // One ack would settle every earlier message, running or not.
    let pull: PullConsumer = broker
        .js
        .get_stream(&broker.stream)
        .await?
        .create_consumer(pull::Config {
            durable_name: Some("ack_all".to_owned()),
            ack_policy: AckPolicy::All,
            ..Default::default()
        })
        .await?;
    let consumer = Consumer::new(engine_on(MemoryStore::new())?, ConsumerConfig::new(BIZ));
    let why = refusal(broker.adapter(&pull, &consumer, broker.config()?)).await?;
    assert!(why.contains("AckPolicy::Explicit"), "{why}");
    Ok(())
}

/// A batcher built on a consumer of another biz type, or of the same biz
/// type under another policy, is refused before anything is pulled: its
/// messages would be keyed and answered under the other rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batcher_on_another_consumer_is_refused() -> anyhow::Result<()> {
    let broker = Broker::new("other_batcher").await?;
    let pull = broker.consumer("other_batcher", LONG_ACK_WAIT).await?;
    broker.publish(Some("order-1"), "qty=1").await?.await?;
    let engine = engine_on(MemoryStore::new())?;
    let consumer = Consumer::new(engine.clone(), ConsumerConfig::new(BIZ));
    let mut other_policy = ConsumerConfig::new(BIZ);
    other_policy.policy.max_attempts = Some(1);
    for config in [ConsumerConfig::new("billing.charge"), other_policy] {
        let other = Consumer::new(engine.clone(), config);
        let batcher = Batcher::new(
            &other,
            4,
            |_: Vec<Incoming>, _: &Engine, _: &[idem_engine::BeginRequest]| Ok(Vec::new()),
        );
        let adapter = broker.adapter(&pull, &consumer, broker.config()?);
        let outcome =
            tokio::time::timeout(SETTLE, adapter.run_batched(batcher, std::future::pending()))
                .await?;
        match outcome {
            Err(NatsError::Config(why)) => assert!(why.contains("batcher"), "{why}"),
            other => bail!("the adapter ran with another consumer's batcher: {other:?}"),
        }
    }
    // Nothing was pulled: the message still waits.
    let info = pull.clone().info().await?.clone();
    assert_eq!((info.num_pending, info.num_ack_pending), (1, 0));
    Ok(())
}

/// Why `adapter` refuses to run; an error if it does not refuse.
async fn refusal(adapter: JetStreamAdapter) -> anyhow::Result<String> {
    let outcome = tokio::time::timeout(
        SETTLE,
        adapter.run(Effects::default().handler(), std::future::pending()),
    )
    .await?;
    match outcome {
        Err(NatsError::Config(why)) => Ok(why),
        other => bail!("the adapter did not refuse its configuration: {other:?}"),
    }
}
