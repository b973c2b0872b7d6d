//! What `Consumer::handle` costs without a broker: messages per second and
//! CPU time per message through it (no-op handler, SQLite store), against
//! the engine's own `begin` + `complete` for the same work, in the same
//! run; and the engine's `run_batch_in_one_transaction` in batches of
//! [`BATCH`], as the broker adapters' `run_batch_blocking` runs it. The
//! broker benches (`idem-rabbitmq`, `idem-nats`) add the broker client's
//! share to this.
//!
//! ```text
//! cargo bench -p idem-consumer --bench handle [-- --messages N] [--only-batch] [--compare-guest FILE]
//! ```
//!
//! `--only-batch` runs the batches alone, for a profile of them.
//! `--compare-guest FILE` runs the engine's measures again, in the same
//! rounds and on the same store, with another build of the engine
//! component (an older `idem_guest.wasm`), and prints this build's ratios
//! to it.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use idem_consumer::{Consumer, ConsumerConfig, HandlerError, Message};
use idem_engine::testing::cpu_time_us;
use idem_engine::{
    ActionResult, BeginRequest, Decision, Engine, Policy, RecordKey, RunOutcome, Success,
};
use idem_sqlite::{RunInTransaction, SqliteOptions, SqliteStore};

/// Messages per round and mode.
const DEFAULT_MESSAGES: usize = 20_000;
/// Rounds, alternating the two modes: the machine is shared and noisy.
const ROUNDS: usize = 3;
const BODY: &[u8] = b"{\"sku\":\"A1\",\"qty\":1}";
/// Messages per batch: the RabbitMQ adapter's default prefetch.
const BATCH: usize = 16;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let messages = match args.iter().position(|a| a == "--messages") {
        Some(i) => args.get(i + 1).context("--messages N")?.parse()?,
        None => DEFAULT_MESSAGES,
    };
    let only_batch = args.iter().any(|a| a == "--only-batch");
    let other: Option<PathBuf> = match args.iter().position(|a| a == "--compare-guest") {
        Some(i) => Some(args.get(i + 1).context("--compare-guest FILE")?.into()),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!("{messages} messages per round, SQLite, a no-op handler");
    for round in 0..ROUNDS {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())?;
        let engine = Engine::builder().storage(store.clone()).build()?;
        let config = ConsumerConfig::new("bench");
        let policy = config.policy.clone();
        let mut engines = vec![("this build", engine)];
        if let Some(path) = &other {
            let guest = Engine::builder().storage(store).guest_file(path)?.build()?;
            engines.push(("--compare-guest", guest));
        }
        // Every other round runs the other guest first: the store grows
        // as a round goes on.
        let mut order: Vec<usize> = (0..engines.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        let mut figures = vec![None; engines.len()];
        for n in order {
            let (name, engine) = &engines[n];
            let tag = format!("{round}-{n}");
            let pair = match only_batch {
                true => None,
                false => Some(begin_complete(engine, &policy, &tag, messages)?),
            };
            let batch = batches(engine, &policy, &tag, messages)?;
            figures[n] = Some((*name, pair, batch));
        }
        let figures: Vec<_> = figures.into_iter().flatten().collect();
        for (name, pair, (batch_rate, batch_cpu)) in &figures {
            let pair = match pair {
                Some((rate, cpu)) => format!(
                    "begin + complete {rate:.0}/s ({cpu:.1} us CPU), batch {:.2}x; ",
                    batch_rate / rate
                ),
                None => String::new(),
            };
            println!(
                "round {round}, {name}: {pair}run_batch_in_one_transaction, {BATCH} per batch, \
                 {batch_rate:.0}/s ({batch_cpu:.1} us CPU)"
            );
        }
        if let [(_, this_pair, this_batch), (_, other_pair, other_batch)] = figures.as_slice() {
            let pair = match (this_pair, other_pair) {
                (Some(this), Some(other)) => format!(
                    "begin + complete {:.2}x the rate, {:.2}x the CPU; ",
                    this.0 / other.0,
                    this.1 / other.1
                ),
                _ => String::new(),
            };
            println!(
                "round {round}, this build against --compare-guest: {pair}batches {:.2}x the rate, \
                 {:.2}x the CPU",
                this_batch.0 / other_batch.0,
                this_batch.1 / other_batch.1
            );
        }
        if only_batch {
            continue;
        }
        let Some((_, engine)) = engines.into_iter().next() else {
            bail!("no engine");
        };
        let (engine_rate, _) = figures[0].1.context("measured above")?;
        let consumer = Consumer::new(engine, config);
        let (cpu, start) = (cpu_time_us("self")?, Instant::now());
        runtime.block_on(async {
            for i in 0..messages {
                let id = format!("consumer-{round}-{i}");
                let message = Message {
                    id: &id,
                    scope: "q",
                    body: BODY,
                };
                consumer
                    .handle(&message, |_ticket| async { Ok::<_, HandlerError>("done") })
                    .await?;
            }
            anyhow::Ok(())
        })?;
        let (handle_rate, handle_cpu) = per_message(messages, start, cpu)?;
        println!(
            "round {round}: Consumer::handle {handle_rate:.0}/s ({handle_cpu:.1} us CPU), \
             {:.2}x the engine's begin + complete",
            handle_rate / engine_rate,
        );
    }
    Ok(())
}

/// `messages` new keys through `begin` and `complete`, one at a time:
/// (messages per second, CPU microseconds per message).
fn begin_complete(
    engine: &Engine,
    policy: &Policy,
    tag: &str,
    messages: usize,
) -> Result<(f64, f64)> {
    let (cpu, start) = (cpu_time_us("self")?, Instant::now());
    for i in 0..messages {
        let request = BeginRequest::raw(
            RecordKey::new("q", "bench", format!("engine-{tag}-{i}")),
            BODY,
            policy.clone(),
        );
        let Decision::Execute(ticket) = engine.begin(&request)? else {
            bail!("a new key was not executed");
        };
        engine.complete(&ticket, policy, &Success::from("done"))?;
    }
    per_message(messages, start, cpu)
}

/// `messages` new keys through `run_batch_in_one_transaction`, [`BATCH`]
/// at a time: (messages per second, CPU microseconds per message).
fn batches(engine: &Engine, policy: &Policy, tag: &str, messages: usize) -> Result<(f64, f64)> {
    let (cpu, start) = (cpu_time_us("self")?, Instant::now());
    let requests: Vec<BeginRequest> = (0..messages)
        .map(|i| {
            BeginRequest::raw(
                RecordKey::new("q", "bench", format!("batch-{tag}-{i}")),
                BODY,
                policy.clone(),
            )
        })
        .collect();
    for batch in requests.chunks(BATCH) {
        for outcome in engine.run_batch_in_one_transaction(batch, |_, _, _| {
            ActionResult::Succeeded(Success::from("done"))
        })? {
            let RunOutcome::Executed { .. } = outcome? else {
                bail!("a new key was not executed");
            };
        }
    }
    per_message(messages, start, cpu)
}

/// (messages per second, CPU microseconds per message) since `start`, `cpu`.
fn per_message(messages: usize, start: Instant, cpu: f64) -> Result<(f64, f64)> {
    let rate = messages as f64 / start.elapsed().as_secs_f64();
    Ok((rate, (cpu_time_us("self")? - cpu) / messages as f64))
}
