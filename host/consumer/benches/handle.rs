//! What `Consumer::handle` costs without a broker: messages per second and
//! CPU time per message through it (no-op handler, SQLite store), against
//! the engine's own `begin` + `complete` for the same work, in the same
//! run; and the engine's `run_batch_in_one_transaction` in batches of
//! [`BATCH`], as the broker adapters' `run_batch_blocking` runs it. The
//! broker benches (`idem-rabbitmq`, `idem-nats`) add the broker client's
//! share to this.
//!
//! ```text
//! cargo bench -p idem-consumer --bench handle [-- --messages N]
//! ```

use std::time::Instant;

use anyhow::{Context, Result, bail};
use idem_consumer::{Consumer, ConsumerConfig, HandlerError, Message};
use idem_engine::testing::cpu_time_us;
use idem_engine::{ActionResult, BeginRequest, Decision, Engine, RecordKey, RunOutcome, Success};
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
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    println!("{messages} messages per round, SQLite, a no-op handler");
    for round in 0..ROUNDS {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())?;
        let engine = Engine::builder().storage(store).build()?;
        let config = ConsumerConfig::new("bench");
        let policy = config.policy.clone();

        let (cpu, start) = (cpu_time_us("self")?, Instant::now());
        for i in 0..messages {
            let request = BeginRequest::raw(
                RecordKey::new("q", "bench", format!("engine-{round}-{i}")),
                BODY,
                policy.clone(),
            );
            let Decision::Execute(ticket) = engine.begin(&request)? else {
                bail!("a new key was not executed");
            };
            engine.complete(&ticket, &policy, &Success::from("done"))?;
        }
        let (engine_rate, engine_cpu) = per_message(messages, start, cpu)?;

        let (cpu, start) = (cpu_time_us("self")?, Instant::now());
        let requests: Vec<BeginRequest> = (0..messages)
            .map(|i| {
                BeginRequest::raw(
                    RecordKey::new("q", "bench", format!("batch-{round}-{i}")),
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
        let (batch_rate, batch_cpu) = per_message(messages, start, cpu)?;

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
            "round {round}: engine begin + complete {engine_rate:.0}/s ({engine_cpu:.1} us CPU), \
             Consumer::handle {handle_rate:.0}/s ({handle_cpu:.1} us CPU), ratio {:.2}; \
             run_batch_in_one_transaction, {BATCH} per batch, {batch_rate:.0}/s ({batch_cpu:.1} us CPU), \
             {:.2}x begin + complete",
            handle_rate / engine_rate,
            batch_rate / engine_rate
        );
    }
    Ok(())
}

/// (messages per second, CPU microseconds per message) since `start`, `cpu`.
fn per_message(messages: usize, start: Instant, cpu: f64) -> Result<(f64, f64)> {
    let rate = messages as f64 / start.elapsed().as_secs_f64();
    Ok((rate, (cpu_time_us("self")? - cpu) / messages as f64))
}
