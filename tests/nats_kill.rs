//! Consumers killed with SIGKILL mid-message, on the real NATS JetStream
//! (127.0.0.1:4222): JetStream redelivers what a dead consumer held once
//! its `ack_wait` ends, the next consumer replays or takes the message
//! over once its lease ends, and every message takes effect exactly once.
//! The consumers are two `idem-test-worker nats-consume` processes on one
//! SQLite file, or on one PostgreSQL database, each writing its business
//! row in the same transaction as its idempotency record: either one
//! message at a time (`run_blocking`), or with two adapters per process
//! sharing one batcher (`run_batched`), each batch of both adapters'
//! messages in one transaction, so that a kill drops a batch whose
//! messages JetStream then redelivers to two adapters, maybe in two
//! processes.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, ensure};
use idem_nats::async_nats;
use idem_nats::async_nats::jetstream::consumer::{AckPolicy, pull};
use idem_nats::async_nats::jetstream::message::PublishMessage;
use idem_nats::async_nats::jetstream::stream::{self, StorageType};

#[path = "support/killing.rs"]
mod killing;
use killing::{Business, CONSUMERS, LEASE_MS, Postgres, Rng, Sqlite, Worker};

const MESSAGES: usize = 200;
/// JetStream hands a dead consumer's message to another after this.
const ACK_WAIT: Duration = Duration::from_secs(1);
/// The longest the consumers may take to drain the stream after the kills.
const DRAIN: Duration = Duration::from_secs(90);
/// The header the workers read each message's id from (no `Nats-Msg-Id`:
/// the stream delivers both copies of every message).
const KEY_HEADER: &str = "Idem-Key";

#[test]
fn jetstream_consumers_killed_mid_message_lose_nothing_and_run_nothing_twice() -> Result<()> {
    kill_run("sqlite", "single", &mut Sqlite::new()?)
}

/// Two consumer processes on one PostgreSQL database.
#[test]
fn jetstream_consumer_processes_on_postgres_killed_mid_message_run_nothing_twice() -> Result<()> {
    match Postgres::new()? {
        Some(mut business) => kill_run("postgres", "single", &mut business),
        None => Ok(()),
    }
}

/// Adapters sharing a batcher, killed mid-batch, on one SQLite file.
#[test]
fn jetstream_adapters_sharing_a_batcher_killed_mid_batch_run_nothing_twice() -> Result<()> {
    kill_run("sqlite", "shared", &mut Sqlite::new()?)
}

/// Adapters sharing a batcher, killed mid-batch, on one PostgreSQL
/// database.
#[test]
fn jetstream_adapters_sharing_a_batcher_on_postgres_killed_mid_batch_run_nothing_twice()
-> Result<()> {
    match Postgres::new()? {
        Some(mut business) => kill_run("postgres", "shared", &mut business),
        None => Ok(()),
    }
}

/// Publishes [`MESSAGES`] twice each to a new stream, runs [`CONSUMERS`]
/// worker processes in `mode` (`single` or `shared`) on one durable
/// consumer, kills one with SIGKILL
/// [`killing::KILLS`] times at random instants (starting a new one each
/// time), waits for the stream to drain, and counts the business rows.
fn kill_run(store: &str, mode: &str, business: &mut dyn Business) -> Result<()> {
    let db = business.db();
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let name = format!("IDEM_KILL_{store}_{mode}_{}_{nanos}", std::process::id());
    let (subject, dlq_stream, dlq_subject) = (
        format!("idem_kill.{name}"),
        format!("{name}_DLQ"),
        format!("idem_kill_dlq.{name}"),
    );
    let seed = (nanos as u64) | 1;
    println!("{store}, {mode}: seed {seed}");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let js = runtime.block_on(async {
        let client = async_nats::connect("127.0.0.1:4222")
            .await
            .context("NATS with JetStream on 127.0.0.1:4222 must answer: `.ci/run` checks it")?;
        let js = async_nats::jetstream::new(client);
        for (stream, subject) in [(&name, &subject), (&dlq_stream, &dlq_subject)] {
            js.create_stream(stream::Config {
                name: stream.clone(),
                subjects: vec![subject.clone()],
                storage: StorageType::Memory,
                ..Default::default()
            })
            .await?;
        }
        js.get_stream(&name)
            .await?
            .create_consumer(pull::Config {
                durable_name: Some("workers".to_owned()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                max_deliver: -1,
                ..Default::default()
            })
            .await?;
        // Each message twice: a producer retry the stream does not drop.
        for i in 0..MESSAGES {
            for _ in 0..2 {
                js.send_publish(
                    subject.clone(),
                    PublishMessage::build()
                        .payload("{}".into())
                        .header(KEY_HEADER, format!("m-{i}").as_str()),
                )
                .await?
                .await?;
            }
        }
        anyhow::Ok(js)
    })?;

    let args = [
        "nats-consume",
        &name,
        "workers",
        &dlq_subject,
        &db,
        LEASE_MS,
        mode,
    ];
    let mut workers = (0..CONSUMERS)
        .map(|_| Worker::start(&args))
        .collect::<Result<Vec<_>>>()?;
    killing::kill_repeatedly(&mut workers, &args, &mut Rng(seed))?;

    let rows = killing::drain_and_count(business, MESSAGES, DRAIN, workers, || {
        runtime.block_on(async {
            let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
                .get_stream(&name)
                .await?
                .get_consumer("workers")
                .await
                .map_err(|e| anyhow::anyhow!("the consumer: {e}"))?;
            let info = consumer.info().await?;
            anyhow::Ok(info.num_pending + info.num_ack_pending as u64)
        })
    })?;
    let dead = runtime.block_on(async {
        anyhow::Ok(
            js.get_stream(&dlq_stream)
                .await?
                .info()
                .await?
                .state
                .messages,
        )
    })?;
    ensure!(dead == 0, "{dead} messages dead-lettered");
    println!(
        "nats kills on {store}, {mode}: {MESSAGES} messages published twice, {} consumers killed with SIGKILL, {rows} effects",
        killing::KILLS
    );
    runtime.block_on(async {
        js.delete_stream(&name).await?;
        js.delete_stream(&dlq_stream).await?;
        anyhow::Ok(())
    })
}
