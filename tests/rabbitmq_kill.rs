//! Consumers killed with SIGKILL mid-message, on the real RabbitMQ
//! (127.0.0.1:5672): RabbitMQ redelivers what a dead consumer held, the
//! next consumer replays or takes the message over once its lease ends,
//! and every message takes effect exactly once. The consumers are
//! `idem-test-worker rabbit-consume` processes on one SQLite file; each
//! writes its business row in the same transaction as its idempotency
//! record.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, ensure};
use idem_rabbitmq::lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
use idem_rabbitmq::lapin::types::FieldTable;
use idem_rabbitmq::lapin::{Channel, Connection, ConnectionProperties};
use idem_rabbitmq::{Topology, publish};

#[path = "support/killing.rs"]
mod killing;
use killing::{Business, Postgres, Rng, Sqlite, Worker};

const MESSAGES: usize = 200;
use killing::{CONSUMERS, KILLS, LEASE_MS};
/// The longest the consumers may take to drain the queue after the kills.
const DRAIN: Duration = Duration::from_secs(90);

async fn ready(channel: &Channel, queue: &str) -> Result<u32> {
    Ok(channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?
        .message_count())
}

#[test]
fn consumers_killed_mid_message_lose_nothing_and_run_nothing_twice() -> Result<()> {
    kill_run("sqlite", &mut Sqlite::new()?)
}

/// Two consumer processes on one PostgreSQL database.
#[test]
fn consumer_processes_on_postgres_killed_mid_message_run_nothing_twice() -> Result<()> {
    match Postgres::new()? {
        Some(mut business) => kill_run("postgres", &mut business),
        None => Ok(()),
    }
}

/// Publishes [`MESSAGES`] twice each, runs [`CONSUMERS`] worker processes,
/// kills one with SIGKILL [`KILLS`] times at random instants (starting a
/// new one each time), waits for the queue to drain, and counts the
/// business rows.
fn kill_run(name: &str, business: &mut dyn Business) -> Result<()> {
    let db = business.db();
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let queue = format!("idem-test-kill-{name}-{}-{nanos}", std::process::id());
    let seed = (nanos as u64) | 1;
    println!("{name}: seed {seed}");
    let mut rng = Rng(seed);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (conn, channel) = runtime.block_on(async {
        let conn = Connection::connect(
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            ConnectionProperties::default(),
        )
        .await
        .context("RabbitMQ on 127.0.0.1:5672 must answer: `.ci/run` checks it")?;
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Topology::declare(&channel, &queue).await?;
        // Each message twice: a producer retry.
        for i in 0..MESSAGES {
            for _ in 0..2 {
                publish(&channel, &queue, &format!("m-{i}"), b"{}").await?;
            }
        }
        anyhow::Ok((conn, channel))
    })?;

    let mut workers = (0..CONSUMERS)
        .map(|_| Worker::start(&["rabbit-consume", &queue, &db, LEASE_MS]))
        .collect::<Result<Vec<_>>>()?;
    killing::kill_repeatedly(
        &mut workers,
        &["rabbit-consume", &queue, &db, LEASE_MS],
        &mut rng,
    )?;

    let topology = Topology::named(&queue);
    let rows = killing::drain_and_count(business, MESSAGES, DRAIN, workers, || {
        runtime.block_on(async {
            let waiting = ready(&channel, &topology.queue).await?
                + ready(&channel, &topology.retry_queue).await?;
            anyhow::Ok(u64::from(waiting))
        })
    })?;
    let dead = runtime.block_on(ready(&channel, &topology.dead_letter_queue))?;
    ensure!(dead == 0, "{dead} messages dead-lettered");
    println!(
        "rabbitmq kills on {name}: {MESSAGES} messages published twice, {KILLS} consumers killed with SIGKILL, {rows} effects"
    );
    runtime.block_on(async {
        topology.delete(&channel).await?;
        conn.close(200, "done".into()).await?;
        anyhow::Ok(())
    })
}
