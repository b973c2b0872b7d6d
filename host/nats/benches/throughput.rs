//! Messages per second through the JetStream adapter with idem (a SQLite
//! store) against the same pull loop with plain acks, in one run on one
//! server: the same stream setup, the same number of consumers, messages in
//! flight and pull batch, and a handler that does nothing, so the
//! difference is what idem costs per message. Also prints the handling
//! latency (taking a delivery to sending its ack), p50 and p99.
//!
//! ```text
//! cargo bench -p idem-nats --bench throughput
//! cargo bench -p idem-nats --bench throughput -- --messages 20000 --consumers 4 --in-flight 8
//! cargo test -p idem-nats --benches -- --smoke     # a few hundred messages: does it run?
//! ```
//!
//! Needs a NATS server with JetStream on 127.0.0.1:4222 (`NATS_URL`
//! overrides it). The streams are in memory, so the broker's disk is not
//! measured.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_engine::testing::{cpu_time_us, find_process};

use anyhow::{Context as _, bail};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::{self, StorageType};
use async_nats::jetstream::{self, Context};
use futures_util::StreamExt;
use idem_consumer::{Acked, Batcher, Consumer, ConsumerConfig, HandlerError, Verdict};
use idem_engine::Engine;
use idem_engine::{ActionResult, BeginRequest, Error as EngineError, RunOutcome, Success};
use idem_nats::{
    AdapterConfig, DEFAULT_MAX_IN_FLIGHT, Delivery, Incoming, JetStreamAdapter, MessageId, Observer,
};
use idem_sqlite::{RunInTransaction, SqliteOptions, SqliteStore};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

/// Messages per mode by default: enough for a steady rate (a second or
/// more per mode), few enough that a run takes seconds.
const DEFAULT_MESSAGES: usize = 5_000;
/// Messages per mode with `--smoke`: only proves that the bench runs.
const SMOKE_MESSAGES: usize = 200;
/// Consumer runs pulling from the one durable consumer, as four workers.
const DEFAULT_CONSUMERS: usize = 4;
/// The body of each message: a small order, as a typical event.
const BODY_BYTES: usize = 128;
/// The header carrying each message's idem key.
const KEY_HEADER: &str = "Idem-Key";
/// The ack_wait of the bench's consumers: far above any handling time
/// here, so nothing is redelivered.
const ACK_WAIT: Duration = Duration::from_secs(30);
/// The pull stream's idle heartbeat, as the adapter's.
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);
/// Publish acks awaited together while loading a stream. async-nats
/// holds at most a few thousand unacknowledged publishes
/// (`max_ack_inflight`) and makes the next `send_publish` wait for one to
/// be awaited, so a load that awaited none until the end hung past that.
const PUBLISH_WINDOW: usize = 1_000;
/// How long the bench waits for a mode to finish before it gives up.
const DEADLINE: Duration = Duration::from_secs(300);

struct Args {
    messages: usize,
    consumers: usize,
    in_flight: usize,
    /// Only the batched idem row and its baseline (`--only-batch`), e.g.
    /// for a profile of the batched path.
    only_batch: bool,
}

fn args() -> anyhow::Result<Args> {
    let mut args = Args {
        messages: DEFAULT_MESSAGES,
        consumers: DEFAULT_CONSUMERS,
        in_flight: DEFAULT_MAX_IN_FLIGHT,
        only_batch: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut number = |name: &str| -> anyhow::Result<usize> {
            let n: usize = it
                .next()
                .with_context(|| format!("{name} needs a number"))?
                .parse()
                .with_context(|| format!("{name} needs a number"))?;
            anyhow::ensure!(n > 0, "{name} must be at least 1");
            Ok(n)
        };
        match arg.as_str() {
            "--smoke" => args.messages = SMOKE_MESSAGES,
            "--messages" => args.messages = number("--messages")?,
            "--consumers" => args.consumers = number("--consumers")?,
            "--in-flight" => args.in_flight = number("--in-flight")?,
            "--only-batch" => args.only_batch = true,
            // `cargo bench` passes it.
            "--bench" => {}
            other => bail!(
                "unknown argument {other:?}; use --smoke, --messages N, --consumers N, --in-flight N, --only-batch"
            ),
        }
    }
    Ok(args)
}

/// What one mode measured.
struct Measured {
    rate: f64,
    p50: Duration,
    p99: Duration,
    /// This process's CPU time (user + system) per message.
    cpu_us: f64,
    /// nats-server's CPU time per message (0 when its process is not found).
    server_cpu_us: f64,
}

/// CPU time used by this process and by nats-server since `start`.
struct CpuMeter {
    server: Option<String>,
    own: f64,
    server_start: f64,
}

impl CpuMeter {
    fn start() -> anyhow::Result<CpuMeter> {
        let server = find_process("nats-server");
        let server_start = server.as_deref().map_or(Ok(0.0), cpu_time_us)?;
        Ok(CpuMeter {
            server,
            own: cpu_time_us("self")?,
            server_start,
        })
    }

    /// (this process, nats-server) CPU microseconds per message since `start`.
    fn per_message(&self, messages: usize) -> anyhow::Result<(f64, f64)> {
        let server = self.server.as_deref().map_or(Ok(0.0), cpu_time_us)?;
        Ok((
            (cpu_time_us("self")? - self.own) / messages as f64,
            (server - self.server_start) / messages as f64,
        ))
    }
}

impl Measured {
    fn new(
        messages: usize,
        elapsed: Duration,
        mut latencies: Vec<Duration>,
        (cpu_us, server_cpu_us): (f64, f64),
    ) -> Measured {
        latencies.sort_unstable();
        let at = |q: f64| {
            let i = ((latencies.len() as f64 * q).ceil() as usize).saturating_sub(1);
            latencies.get(i).copied().unwrap_or_default()
        };
        Measured {
            rate: messages as f64 / elapsed.as_secs_f64(),
            p50: at(0.50),
            p99: at(0.99),
            cpu_us,
            server_cpu_us,
        }
    }
}

/// A stream holding `n` messages with distinct keys, and a durable pull
/// consumer on it.
async fn loaded(js: &Context, name: &str, n: usize) -> anyhow::Result<PullConsumer> {
    let subject = format!("idem_bench.{}", name.to_lowercase());
    let stream = js
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.clone()],
            storage: StorageType::Memory,
            ..Default::default()
        })
        .await?;
    let body = "x".repeat(BODY_BYTES);
    let mut acks = Vec::with_capacity(PUBLISH_WINDOW);
    for i in 0..n {
        let message = PublishMessage::build()
            .payload(body.clone().into())
            .header(KEY_HEADER, format!("order-{i}"));
        acks.push(js.send_publish(subject.clone(), message).await?);
        if acks.len() == PUBLISH_WINDOW {
            for ack in acks.drain(..) {
                ack.await?;
            }
        }
    }
    for ack in acks {
        ack.await?;
    }
    Ok(stream
        .create_consumer(pull::Config {
            durable_name: Some("bench".to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            ..Default::default()
        })
        .await?)
}

/// Counts handled messages and wakes the bench at the last one.
#[derive(Clone)]
struct Tally {
    done: Arc<AtomicUsize>,
    target: usize,
    all_done: Arc<Notify>,
    latencies: Arc<Mutex<Vec<Duration>>>,
}

impl Tally {
    fn new(target: usize) -> Tally {
        Tally {
            done: Arc::new(AtomicUsize::new(0)),
            target,
            all_done: Arc::new(Notify::new()),
            latencies: Arc::new(Mutex::new(Vec::with_capacity(target))),
        }
    }

    fn handled(&self, latency: Duration) {
        if let Ok(mut l) = self.latencies.lock() {
            l.push(latency);
        }
        if self.done.fetch_add(1, Ordering::SeqCst) + 1 == self.target {
            self.all_done.notify_one();
        }
    }

    async fn wait(&self) -> anyhow::Result<()> {
        tokio::time::timeout(DEADLINE, self.all_done.notified())
            .await
            .with_context(|| {
                format!(
                    "only {} of {} messages were handled within {DEADLINE:?}",
                    self.done.load(Ordering::SeqCst),
                    self.target
                )
            })
    }

    fn latencies(&self) -> Vec<Duration> {
        self.latencies.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

/// The baseline: the adapter's loop (a pull stream batching as many
/// messages as are in flight, a task per message) with a plain ack.
async fn plain(pull: PullConsumer, in_flight: usize, tally: Tally, stop: watch::Receiver<bool>) {
    let mut stop = stop;
    let Ok(mut messages) = pull
        .stream()
        .max_messages_per_batch(in_flight)
        .heartbeat(PULL_HEARTBEAT)
        .messages()
        .await
    else {
        return;
    };
    let mut tasks = JoinSet::new();
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            next = messages.next(), if tasks.len() < in_flight => match next {
                Some(Ok(message)) => {
                    let tally = tally.clone();
                    tasks.spawn(async move {
                        let started = Instant::now();
                        let _key = message.headers.as_ref().and_then(|h| h.get(KEY_HEADER));
                        if message.ack().await.is_ok() {
                            tally.handled(started.elapsed());
                        }
                    });
                }
                Some(Err(_)) => {}
                None => break,
            },
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// Waits until the consumer has every message acked.
async fn drained(pull: &PullConsumer) -> anyhow::Result<()> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let info = pull.get_info().await?;
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "messages left unacked: {info:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn measure_plain(js: &Context, tag: &str, args: &Args) -> anyhow::Result<Measured> {
    let name = format!("IDEM_BENCH_PLAIN_{tag}");
    let pull = loaded(js, &name, args.messages).await?;
    let tally = Tally::new(args.messages);
    let (stop, stopped) = watch::channel(false);
    let cpu = CpuMeter::start()?;
    let started = Instant::now();
    let runs: Vec<_> = (0..args.consumers)
        .map(|_| {
            tokio::spawn(plain(
                pull.clone(),
                args.in_flight,
                tally.clone(),
                stopped.clone(),
            ))
        })
        .collect();
    tally.wait().await?;
    let elapsed = started.elapsed();
    let cpu = cpu.per_message(args.messages)?;
    stop.send_replace(true);
    for run in runs {
        run.await?;
    }
    drained(&pull).await?;
    js.delete_stream(&name).await?;
    Ok(Measured::new(
        args.messages,
        elapsed,
        tally.latencies(),
        cpu,
    ))
}

/// What the idem runs' handler does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Nothing (`run`).
    Noop,
    /// Writes an `orders` row in one transaction with the message's claim
    /// and outcome (`run_blocking` with `run_in_one_transaction`).
    OneTransaction,
    /// The same, for the messages in flight together (`run_batch_blocking`
    /// with `run_batch_in_one_transaction`): one commit per batch, a
    /// batcher per consumer.
    Batch,
    /// The same with one batcher that the consumers share (`run_batched`):
    /// the messages in flight in all of them make up a batch.
    SharedBatch,
}

/// The batch handler of the batched modes: each message's `orders` row in
/// the batch's one transaction.
fn orders(
    ms: Vec<Incoming>,
    engine: &Engine,
    requests: &[BeginRequest],
) -> Result<Vec<Result<RunOutcome, EngineError>>, EngineError> {
    engine.run_batch_in_one_transaction(requests, |i, _, conn| order(&ms[i].id, conn))
}

/// Writes the `orders` row of message `id`.
fn order(id: &str, conn: &rusqlite::Connection) -> ActionResult {
    // Prepared once per connection, as a service would: parsing the
    // statement again for every message cost about as much as the insert.
    let inserted = conn
        .prepare_cached("INSERT INTO orders VALUES (?1)")
        .and_then(|mut insert| insert.execute([id]));
    match inserted {
        Ok(_) => ActionResult::Succeeded(Success::with_ref(id)),
        Err(e) => ActionResult::retryable("db", e),
    }
}

/// The idem runs, with a handler as `mode` says.
async fn measure_idem(
    js: &Context,
    tag: &str,
    args: &Args,
    mode: Mode,
) -> anyhow::Result<Measured> {
    let name = format!("IDEM_BENCH_IDEM_{tag}_{}", mode as u8);
    let dlq_name = format!("{name}_DLQ");
    let dlq_subject = format!("idem_bench_dlq.{}", tag.to_lowercase());
    js.create_stream(stream::Config {
        name: dlq_name.clone(),
        subjects: vec![dlq_subject.clone()],
        storage: StorageType::Memory,
        ..Default::default()
    })
    .await?;
    let pull = loaded(js, &name, args.messages).await?;
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())?;
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| c.execute_batch("CREATE TABLE orders (idem_key TEXT NOT NULL)"))??;
    tx.commit()?;
    let consumer = Consumer::new(
        Engine::builder().storage(store).build()?,
        ConsumerConfig::new("bench.noop"),
    );
    let tally = Tally::new(args.messages);
    let mut config = AdapterConfig::new(&name, &dlq_subject);
    config.message_id = MessageId::header(KEY_HEADER)?;
    config.max_in_flight = args.in_flight;
    config.observer = Some(Observer::new({
        let tally = tally.clone();
        move |h| {
            if h.carried_out && h.verdict == Some(Verdict::Ack(Acked::Executed)) {
                tally.handled(h.elapsed);
            }
        }
    }));
    let (stop, stopped) = watch::channel(false);
    // Only the shared-batcher mode has one: an idle batcher's task would
    // sit in the other modes' runtime.
    let shared = matches!(mode, Mode::SharedBatch)
        .then(|| Batcher::new(&consumer, args.consumers * args.in_flight, orders));
    let cpu = CpuMeter::start()?;
    let started = Instant::now();
    let runs: Vec<_> = (0..args.consumers)
        .map(|_| {
            let adapter =
                JetStreamAdapter::new(js.clone(), pull.clone(), consumer.clone(), config.clone());
            let shared = shared.clone();
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                let shutdown = async move {
                    let _ = stopped.wait_for(|s| *s).await;
                };
                match mode {
                    Mode::OneTransaction => {
                        adapter
                            .run_blocking(
                                |m: Incoming, engine: &Engine, request: &BeginRequest| {
                                    engine.run_in_one_transaction(request, |_, conn| {
                                        order(&m.id, conn)
                                    })
                                },
                                shutdown,
                            )
                            .await
                    }
                    Mode::Batch => {
                        adapter
                            .run_batch_blocking(usize::MAX, orders, shutdown)
                            .await
                    }
                    Mode::SharedBatch => match shared {
                        Some(shared) => adapter.run_batched(shared, shutdown).await,
                        None => unreachable!("the shared-batcher mode builds its batcher"),
                    },
                    Mode::Noop => {
                        adapter
                            .run(
                                |_d: Delivery| async { Ok::<_, HandlerError>("done") },
                                shutdown,
                            )
                            .await
                    }
                }
            })
        })
        .collect();
    tally.wait().await?;
    let elapsed = started.elapsed();
    let cpu = cpu.per_message(args.messages)?;
    stop.send_replace(true);
    for run in runs {
        let report = run.await??;
        anyhow::ensure!(
            report.dead_lettered + report.store_errors == 0,
            "the idem run failed messages: {report:?}"
        );
    }
    drained(&pull).await?;
    js.delete_stream(&name).await?;
    js.delete_stream(&dlq_name).await?;
    Ok(Measured::new(
        args.messages,
        elapsed,
        tally.latencies(),
        cpu,
    ))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = args()?;
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
    let js = jetstream::new(
        async_nats::connect(&url)
            .await
            .context("connect to NATS (is nats-server -js running?)")?,
    );
    let tag = std::process::id().to_string();
    println!(
        "throughput: {} messages per mode, {} consumers x {} in flight, in-memory stream on {url}, \
         a handler that does nothing",
        args.messages, args.consumers, args.in_flight
    );
    let plain = measure_plain(&js, &tag, &args).await?;
    if args.only_batch {
        let (batch, shared) = measure_batched(&js, &tag, &args).await?;
        for (what, m) in [
            ("plain ack", &plain),
            ("idem, a business row, batched", &batch),
            ("idem, a business row, shared batcher", &shared),
        ] {
            print_row(what, m);
        }
        println!(
            "  batched / plain: {:.2}; shared batcher / plain: {:.2}; shared / batched: {:.2}",
            batch.rate / plain.rate,
            shared.rate / plain.rate,
            shared.rate / batch.rate
        );
        return Ok(());
    }
    let idem = measure_idem(&js, &tag, &args, Mode::Noop).await?;
    let one = measure_idem(&js, &tag, &args, Mode::OneTransaction).await?;
    let (batch, shared) = measure_batched(&js, &tag, &args).await?;
    for (what, m) in [
        ("plain ack", &plain),
        ("idem (SQLite)", &idem),
        ("idem, a business row, one transaction", &one),
        ("idem, a business row, batched", &batch),
        ("idem, a business row, shared batcher", &shared),
    ] {
        print_row(what, m);
    }
    println!(
        "  idem / plain: {:.2} of the plain rate; with a business row in one transaction {:.2}; \
         batched {:.2} (batched / one transaction {:.2}); shared batcher {:.2} (shared / batched \
         {:.2})",
        idem.rate / plain.rate,
        one.rate / plain.rate,
        batch.rate / plain.rate,
        batch.rate / one.rate,
        shared.rate / plain.rate,
        shared.rate / batch.rate
    );
    Ok(())
}

/// The two batched modes, one after the other.
async fn measure_batched(
    js: &Context,
    tag: &str,
    args: &Args,
) -> anyhow::Result<(Measured, Measured)> {
    let batch = measure_idem(js, tag, args, Mode::Batch).await?;
    let shared = measure_idem(js, tag, args, Mode::SharedBatch).await?;
    Ok((batch, shared))
}

/// Prints one mode's figures.
fn print_row(what: &str, m: &Measured) {
    println!(
        "  {what:<38} {:>9.0} msg/s   handling p50 {:>8.2?}   p99 {:>8.2?}   CPU per message: this process {:>6.1} us, nats-server {:>6.1} us",
        m.rate, m.p50, m.p99, m.cpu_us, m.server_cpu_us
    );
}
