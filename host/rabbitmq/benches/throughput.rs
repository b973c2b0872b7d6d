//! Messages per second through the RabbitMQ adapter with idem, against the
//! same consumers acking without idem: same run, same broker, same
//! prefetch, 4 consumers on one queue (or `--consumers N`). Prints both rates, the ratio
//! and the p99 of the time from a delivery's arrival to its settlement.
//! The batched row has a second baseline, `bare-batch`, which acks the
//! deliveries that have arrived with one multiple ack, as that row does.
//! The consumers are set up (channels, engines, the component compiled)
//! before each row's clock starts.
//!
//! ```text
//! cargo bench -p idem-rabbitmq --bench throughput [-- --messages N] [--consumers N] [--prefetch N] [--batch N] [--only MODE,...] [--smoke]
//! ```
//!
//! `--prefetch N` sets every mode's prefetch, the bare consumers' included
//! (default [`DEFAULT_PREFETCH`]); `--batch N` the batched mode's largest
//! batch (default: the prefetch).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures_lite::StreamExt;
use idem_consumer::{Consumer, ConsumerConfig};
use idem_engine::Engine;
use idem_engine::testing::{cpu_time_us, find_process};
use idem_engine::{ActionResult, BeginRequest, Success};
use idem_rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
};
use idem_rabbitmq::lapin::types::FieldTable;
use idem_rabbitmq::lapin::{Channel, Connection, ConnectionProperties};
use idem_rabbitmq::{
    DEFAULT_PREFETCH, Incoming, Options, RabbitConsumer, Stats, Topology, publish,
};
use idem_sqlite::{RunInTransaction, SqliteOptions, SqliteStore};

/// The issue's measure point; `--consumers N` changes it.
const DEFAULT_CONSUMERS: usize = 4;
const DEFAULT_MESSAGES: usize = 5_000;
const SMOKE_MESSAGES: usize = 100;

type Latencies = Arc<Mutex<Vec<Duration>>>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let consumers = match args.iter().position(|a| a == "--consumers") {
        Some(i) => args.get(i + 1).context("--consumers N")?.parse()?,
        None => DEFAULT_CONSUMERS,
    };
    let prefetch: u16 = match args.iter().position(|a| a == "--prefetch") {
        Some(i) => args.get(i + 1).context("--prefetch N")?.parse()?,
        None => DEFAULT_PREFETCH,
    };
    let max_batch: usize = match args.iter().position(|a| a == "--batch") {
        Some(i) => args.get(i + 1).context("--batch N")?.parse()?,
        None => usize::from(prefetch),
    };
    let messages = if args.iter().any(|a| a == "--smoke") {
        SMOKE_MESSAGES
    } else {
        match args.iter().position(|a| a == "--messages") {
            Some(i) => args.get(i + 1).context("--messages N")?.parse()?,
            None => DEFAULT_MESSAGES,
        }
    };
    let conn = Connection::connect(
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        ConnectionProperties::default(),
    )
    .await
    .context("RabbitMQ on 127.0.0.1:5672")?;
    let producer = conn.create_channel().await?;
    producer
        .confirm_select(ConfirmSelectOptions::default())
        .await?;

    let only: Option<Vec<String>> = args
        .iter()
        .position(|a| a == "--only")
        .map(|i| -> Result<Vec<String>> {
            Ok(args
                .get(i + 1)
                .context("--only MODE[,MODE]")?
                .split(',')
                .map(str::to_owned)
                .collect())
        })
        .transpose()?;
    let modes: Vec<Mode> = match &only {
        None => Mode::MEASURED.to_vec(),
        Some(names) => names
            .iter()
            .map(|n| {
                Mode::MEASURED
                    .into_iter()
                    .find(|m| m.name() == n)
                    .with_context(|| format!("--only: no mode {n:?}"))
            })
            .collect::<Result<_>>()?,
    };
    println!(
        "rabbitmq, {consumers} consumers, prefetch {prefetch}, batches of at most {max_batch}, \
         {messages} messages per mode, \
         idem on SQLite; CPU per message from /proc (this process / beam.smp)"
    );
    let shape = Shape {
        messages,
        consumers,
        prefetch,
        max_batch,
    };
    let bare = run(&conn, &producer, shape, Mode::Bare).await?;
    bare.print(Mode::Bare, &bare);
    // The batched row's own baseline: acking in batches costs the broker
    // client less per message than acking one by one.
    let bare_batch = match modes.contains(&Mode::Batch) {
        true => {
            let figures = run(&conn, &producer, shape, Mode::BareBatch).await?;
            figures.print(Mode::BareBatch, &bare);
            Some(figures)
        }
        false => None,
    };
    let mut measured = Vec::new();
    for mode in modes {
        let figures = run(&conn, &producer, shape, mode).await?;
        figures.print(mode, &bare);
        measured.push((mode, figures));
    }
    let rate = |mode| {
        measured
            .iter()
            .find(|(m, _)| *m == mode)
            .map(|(_, f)| f.rate)
    };
    if let (Some(first), Some(one)) = (rate(Mode::ClaimFirst), rate(Mode::OneTransaction)) {
        println!("  one-tx / claim-first: {:.2}", one / first);
    }
    if let (Some(one), Some(batch)) = (rate(Mode::OneTransaction), rate(Mode::Batch)) {
        println!("  batch / one-tx: {:.2}", batch / one);
    }
    if let (Some(bare), Some(batch)) = (&bare_batch, rate(Mode::Batch)) {
        println!("  batch / bare-batch: {:.2}", batch / bare.rate);
    }
    Ok(())
}

/// What the consumers do with each delivery.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Ack it, without idem.
    Bare,
    /// Ack the deliveries that have arrived (up to the batch size) with
    /// one multiple ack, without idem: the batched row's baseline.
    BareBatch,
    /// `RabbitConsumer::run` with a handler that does nothing.
    Idem,
    /// `run_blocking` with `run_in_transaction`: the claim commits, then an
    /// `orders` row and the outcome commit together.
    ClaimFirst,
    /// `run_blocking` with `run_in_one_transaction`: the claim, the row and
    /// the outcome commit together.
    OneTransaction,
    /// `run_batch_blocking` with `run_batch_in_one_transaction`: the
    /// deliveries that have arrived (up to the prefetch) commit their
    /// claims, rows and outcomes together, once.
    Batch,
}

impl Mode {
    /// The modes measured against [`Mode::Bare`], in order.
    const MEASURED: [Mode; 4] = [
        Mode::Idem,
        Mode::ClaimFirst,
        Mode::OneTransaction,
        Mode::Batch,
    ];

    /// The mode's name, for `--only` and the output.
    fn name(self) -> &'static str {
        match self {
            Mode::Bare => "bare",
            Mode::BareBatch => "bare-batch",
            Mode::Idem => "idem",
            Mode::ClaimFirst => "claim-first",
            Mode::OneTransaction => "one-tx",
            Mode::Batch => "batch",
        }
    }

    /// What the mode does, for the output.
    fn what(self) -> &'static str {
        match self {
            Mode::Bare => "ack only, no idem",
            Mode::BareBatch => "ack only, one multiple ack per batch, no idem",
            Mode::Idem => "run, a no-op handler",
            Mode::ClaimFirst => "a business row, run_in_transaction",
            Mode::OneTransaction => "a business row, run_in_one_transaction",
            Mode::Batch => "a business row, run_batch_in_one_transaction",
        }
    }
}

/// How many messages a run publishes, and how they are consumed.
#[derive(Clone, Copy)]
struct Shape {
    messages: usize,
    consumers: usize,
    /// Unacked deliveries per consumer, in every mode.
    prefetch: u16,
    /// The batched mode's largest batch.
    max_batch: usize,
}

/// One run's figures.
struct Figures {
    /// Messages per second.
    rate: f64,
    /// The p99 from a delivery's arrival to its settlement.
    p99: Duration,
    /// This process's CPU time (user + system) per message.
    cpu_us: f64,
    /// The broker's CPU time per message (0 when its process is not found).
    broker_cpu_us: f64,
}

impl Figures {
    /// One line: the rate, its ratio to `bare`, the p99 and the CPU.
    fn print(&self, mode: Mode, bare: &Figures) {
        println!(
            "  {:<12} {:>7.0} msg/s  ratio {:.2}  p99 {:>9.2?}  CPU/msg {:>6.1} us / {:>5.1} us  ({})",
            mode.name(),
            self.rate,
            self.rate / bare.rate,
            self.p99,
            self.cpu_us,
            self.broker_cpu_us,
            mode.what()
        );
    }
}

/// Publishes the shape's messages to a fresh queue, then consumes them
/// with its consumers; returns its [`Figures`].
async fn run(conn: &Connection, producer: &Channel, shape: Shape, mode: Mode) -> Result<Figures> {
    let Shape {
        messages,
        consumers,
        prefetch,
        max_batch,
    } = shape;
    let name = mode.name();
    let queue = format!("idem-bench-{name}-{}", std::process::id());
    let topology = Topology::declare(producer, &queue).await?;
    for i in 0..messages {
        publish(
            producer,
            &queue,
            &format!("m-{i}"),
            b"{\"sku\":\"A1\",\"qty\":1}",
        )
        .await?;
    }
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(
        dir.path().join("idem.db"),
        SqliteOptions {
            group_commit: std::env::var_os("IDEM_BENCH_GROUP_COMMIT").is_some(),
            ..SqliteOptions::default()
        },
    )?;
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| c.execute_batch("CREATE TABLE orders (idem_key TEXT NOT NULL)"))??;
    tx.commit()?;
    let latencies: Latencies = Arc::default();
    let broker = find_process("beam");
    let broker_cpu = || broker.as_deref().map_or(Ok(0.0), cpu_time_us);
    let mut tasks = Vec::new();
    let mut stats = Vec::new();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // The consumers are set up (channels, engines, the component compiled)
    // before the clock starts; they start consuming together at `go`.
    let (go, gate) = tokio::sync::watch::channel(false);
    let started = |mut gate: tokio::sync::watch::Receiver<bool>| async move {
        let _ = gate.wait_for(|go| *go).await;
    };
    for _ in 0..consumers {
        let started = started(gate.clone());
        let channel = conn.create_channel().await?;
        let lat = latencies.clone();
        let mut stopped = stopped.clone();
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        if !matches!(mode, Mode::Bare | Mode::BareBatch) {
            let engine = Engine::builder().storage(store.clone()).build()?;
            let consumer = Consumer::new(engine, ConsumerConfig::new("bench"));
            let options = Options {
                on_settled: Some(Arc::new(move |_, took| {
                    lat.lock().expect("latencies").push(took);
                })),
                prefetch,
                ..Options::default()
            };
            let rabbit = RabbitConsumer::new(channel, topology.clone(), consumer, options).await?;
            stats.push(rabbit.stats());
            tasks.push(tokio::spawn(async move {
                started.await;
                // Prepared once per connection, as a service would.
                let write = |id: &str, conn: &rusqlite::Connection| match conn
                    .prepare_cached("INSERT INTO orders VALUES (?1)")
                    .and_then(|mut insert| insert.execute([id]))
                {
                    Ok(_) => ActionResult::Succeeded(Success::with_ref(id)),
                    Err(e) => ActionResult::retryable("db", e),
                };
                let done = match mode {
                    Mode::Bare | Mode::BareBatch | Mode::Idem => {
                        rabbit
                            .run(
                                |_m: Incoming| async {
                                    Ok::<_, idem_consumer::HandlerError>("done")
                                },
                                shutdown,
                            )
                            .await
                    }
                    Mode::Batch => {
                        rabbit
                            .run_batch_blocking(
                                max_batch,
                                move |ms: Vec<Incoming>,
                                      engine: &Engine,
                                      requests: &[BeginRequest]| {
                                    engine.run_batch_in_one_transaction(requests, |i, _, c| {
                                        write(&ms[i].id, c)
                                    })
                                },
                                shutdown,
                            )
                            .await
                    }
                    Mode::ClaimFirst | Mode::OneTransaction => {
                        let one = mode == Mode::OneTransaction;
                        rabbit
                            .run_blocking(
                                move |m: Incoming, engine: &Engine, request: &BeginRequest| {
                                    if one {
                                        engine
                                            .run_in_one_transaction(request, |_, c| write(&m.id, c))
                                    } else {
                                        engine.run_in_transaction(request, |_, c| write(&m.id, c))
                                    }
                                },
                                shutdown,
                            )
                            .await
                    }
                };
                done.map_err(anyhow::Error::from)
            }));
        } else {
            let queue = queue.clone();
            let done = Arc::new(Stats::default());
            stats.push(done.clone());
            let batch = match mode {
                Mode::BareBatch => max_batch,
                _ => 1,
            };
            tasks.push(tokio::spawn(async move {
                started.await;
                bare_consumer(channel, queue, prefetch, batch, lat, done, shutdown).await
            }));
        }
    }
    let (cpu0, broker0) = (cpu_time_us("self")?, broker_cpu()?);
    let start = Instant::now();
    go.send(true)?;
    let deadline = Instant::now() + Duration::from_secs(600);
    while stats.iter().map(|s| Stats::get(&s.executed)).sum::<u64>() < messages as u64 {
        if Instant::now() > deadline {
            bail!("{name}: not done within 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    let cpu_us = (cpu_time_us("self")? - cpu0) / messages as f64;
    let broker_cpu_us = (broker_cpu()? - broker0) / messages as f64;
    let _ = stop.send(true);
    for t in tasks {
        t.await??;
    }
    topology.delete(producer).await?;
    let mut l = latencies.lock().expect("latencies").clone();
    l.sort();
    let p99 = l.get(l.len() * 99 / 100).copied().unwrap_or_default();
    Ok(Figures {
        rate: messages as f64 / elapsed.as_secs_f64(),
        p99,
        cpu_us,
        broker_cpu_us,
    })
}

/// The same work without idem: ack each delivery, or (`batch` > 1) the
/// deliveries that have arrived, up to `batch`, with one multiple ack.
async fn bare_consumer(
    channel: Channel,
    queue: String,
    prefetch: u16,
    batch: usize,
    latencies: Latencies,
    done: Arc<Stats>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut shutdown = std::pin::pin!(shutdown);
    let mut arrived = Vec::with_capacity(batch);
    loop {
        let mut last = tokio::select! {
            () = &mut shutdown => return Ok(()),
            next = deliveries.next() => match next {
                Some(d) => d?,
                None => return Ok(()),
            },
        };
        // As the adapter measures it: from the delivery's arrival to its ack.
        arrived.push(Instant::now());
        while arrived.len() < batch {
            match futures_lite::future::poll_once(deliveries.next()).await {
                Some(Some(delivery)) => {
                    last = delivery?;
                    arrived.push(Instant::now());
                }
                Some(None) | None => break,
            }
        }
        last.ack(BasicAckOptions {
            multiple: arrived.len() > 1,
        })
        .await?;
        let mut latencies = latencies.lock().expect("latencies");
        latencies.extend(arrived.iter().map(Instant::elapsed));
        done.executed
            .fetch_add(arrived.len() as u64, std::sync::atomic::Ordering::Relaxed);
        arrived.clear();
    }
}
