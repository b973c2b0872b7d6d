//! A RabbitMQ consumer that reserves inventory once per message, however
//! often RabbitMQ delivers it. Needs RabbitMQ on 127.0.0.1:5672
//! (guest/guest), or AMQP_ADDR.
//!
//! The producer publishes five messages, each twice (a producer retry),
//! plus a message that reuses an id with another body. Two consumers share
//! the queue and one SQLite file; each reservation is written in the same
//! transaction as its idempotency record (`run_in_transaction`), so a
//! consumer that dies mid-message leaves no reservation behind.
//!
//! Run with `cargo run -p idem-rabbitmq --example rabbitmq_consumer`.

use std::time::Duration;

use anyhow::{Context, Result};
use idem_consumer::{Consumer, ConsumerConfig};
use idem_engine::Engine;
use idem_engine::engine::ActionResult;
use idem_engine::types::Success;
use idem_rabbitmq::lapin::options::ConfirmSelectOptions;
use idem_rabbitmq::lapin::{Connection, ConnectionProperties};
use idem_rabbitmq::{Options, RabbitConsumer, Stats, Topology, publish};
use idem_sqlite::{RunInTransaction, SqliteOptions, SqliteStore};

#[tokio::main]
async fn main() -> Result<()> {
    let addr = std::env::var("AMQP_ADDR")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let conn = Connection::connect(&addr, ConnectionProperties::default())
        .await
        .with_context(|| format!("cannot reach RabbitMQ at {addr}"))?;
    let producer = conn.create_channel().await?;
    producer
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let queue = format!("inventory-reservations-{}", std::process::id());
    let topology = Topology::declare(&producer, &queue).await?;

    for i in 1..=5 {
        let body = format!(r#"{{"sku":"A{i}","qty":1}}"#);
        for _ in 0..2 {
            publish(&producer, &queue, &format!("msg-{i}"), body.as_bytes()).await?;
        }
    }
    publish(&producer, &queue, "msg-1", br#"{"sku":"B9","qty":7}"#).await?;

    let dir = tempfile::tempdir()?;
    let db = dir.path().join("inventory.db");
    let store = SqliteStore::open(&db, SqliteOptions::default())?;
    // The business table, in the same file. A transaction dropped without
    // commit() rolls back.
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| {
        c.execute_batch("CREATE TABLE reservations (message_id TEXT NOT NULL, body TEXT NOT NULL)")
    })??;
    tx.commit()?;

    let mut consumers = Vec::new();
    for n in 0..2 {
        let engine = Engine::builder().storage(store.clone()).build()?;
        let consumer = Consumer::new(engine, ConsumerConfig::new("inventory.reserve"));
        let channel = conn.create_channel().await?;
        let rabbit =
            RabbitConsumer::new(channel, topology.clone(), consumer, Options::default()).await?;
        let stats = rabbit.stats();
        let task = tokio::spawn(async move {
            rabbit
                .run_blocking(
                    move |incoming, engine, request| {
                        engine.run_in_transaction(request, |_ticket, conn| {
                            let body = String::from_utf8_lossy(&incoming.body);
                            let written = conn.execute(
                                "INSERT INTO reservations (message_id, body) VALUES (?1, ?2)",
                                [incoming.id.as_str(), &body],
                            );
                            println!("consumer {n}: reserved {} {body}", incoming.id);
                            match written {
                                Ok(_) => {
                                    ActionResult::Succeeded(Success::with_ref(incoming.id.clone()))
                                }
                                Err(e) => ActionResult::retryable("db", e),
                            }
                        })
                    },
                    tokio::time::sleep(Duration::from_secs(3)),
                )
                .await
        });
        consumers.push((stats, task));
    }
    let mut all = Vec::new();
    for (stats, task) in consumers {
        task.await??;
        all.push(stats);
    }
    let sum = |f: fn(&Stats) -> &std::sync::atomic::AtomicU64| -> u64 {
        all.iter().map(|s| Stats::get(f(s))).sum()
    };
    let tx = store.begin_transaction()?;
    let reservations: i64 = tx.with_connection(|c| {
        c.query_row("SELECT COUNT(*) FROM reservations", [], |r| r.get(0))
    })??;
    tx.commit()?;
    println!(
        "{} deliveries: {} executed, {} duplicates acked, {} dead-lettered (the reused id), {} retried; {reservations} reservations",
        sum(|s| &s.delivered),
        sum(|s| &s.executed),
        sum(|s| &s.duplicates),
        sum(|s| &s.dead_lettered),
        sum(|s| &s.retried),
    );
    topology.delete(&producer).await?;
    Ok(())
}
