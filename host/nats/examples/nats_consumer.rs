//! A first look at idem on NATS JetStream: a producer sends each order
//! twice (it timed out waiting for the stream's ack and sent it again, too
//! late for the stream's duplicate window), and a consumer with idem over a
//! SQLite file reserves stock once per order.
//!
//! Needs a NATS server with JetStream on 127.0.0.1:4222 (`nats-server -js`;
//! `NATS_URL` overrides the address):
//!
//! ```text
//! cargo run -p idem-nats --example nats_consumer
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use idem_consumer::{Consumer, ConsumerConfig, HandlerError};
use idem_engine::Engine;
use idem_nats::{AdapterConfig, Delivery, JetStreamAdapter, MessageId};
use idem_sqlite::{SqliteOptions, SqliteStore};

const ORDERS: u32 = 5;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
    let js = jetstream::new(async_nats::connect(url).await?);

    // A stream for the orders, and one for the messages idem dead-letters.
    let tag = std::process::id();
    let (orders, dead) = (format!("ORDERS_{tag}"), format!("ORDERS_{tag}_DLQ"));
    let subject = format!("example.{tag}.orders");
    let dlq_subject = format!("example.{tag}.dead");
    for (name, subject) in [(&orders, &subject), (&dead, &dlq_subject)] {
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await?;
    }

    // The producer: every order twice, without a Nats-Msg-Id, so the
    // stream keeps both copies.
    for n in 1..=ORDERS {
        for _ in 0..2 {
            let body = format!("order-{n} sku=A{n} qty={n}");
            js.publish(subject.clone(), body.into()).await?.await?;
        }
    }

    // The consumer: idem over a SQLite file, keyed by the order number at
    // the start of each body.
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())?;
    let engine = Engine::builder().storage(store).build()?;
    let consumer = Consumer::new(engine, ConsumerConfig::new("inventory.reserve"));
    let pull = js
        .get_stream(&orders)
        .await?
        .create_consumer(pull::Config {
            durable_name: Some("inventory".to_owned()),
            ..Default::default()
        })
        .await?;
    let mut config = AdapterConfig::new("orders/inventory", &dlq_subject);
    config.message_id = MessageId::with(|m| {
        let body = std::str::from_utf8(&m.payload).ok()?;
        body.split_whitespace().next().map(str::to_owned)
    });
    let adapter = JetStreamAdapter::new(js.clone(), pull.clone(), consumer, config);

    let reserved = Arc::new(AtomicU32::new(0));
    let handler = {
        let reserved = reserved.clone();
        move |d: Delivery| {
            let reserved = reserved.clone();
            async move {
                // The business effect: here, a line and a counter.
                println!("reserving stock for {}", d.id);
                reserved.fetch_add(1, Ordering::SeqCst);
                Ok::<_, HandlerError>(format!("reservation for {}", d.id))
            }
        }
    };

    // Run until JetStream has nothing left for the consumer.
    let drained = async {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            match pull.get_info().await {
                Ok(i) if i.num_pending == 0 && i.num_ack_pending == 0 => break,
                _ => {}
            }
        }
    };
    let report = adapter.run(handler, drained).await?;

    println!(
        "{} copies of {ORDERS} orders, {} deliveries:",
        2 * ORDERS,
        report.deliveries
    );
    println!("  {} ran the handler", report.executed);
    println!(
        "  {} were duplicates, acked without running",
        report.duplicates
    );
    println!(
        "  {} came while their twin was running, and were delivered again later",
        report.in_progress
    );
    println!("stock reserved {} times", reserved.load(Ordering::SeqCst));
    js.delete_stream(&orders).await?;
    js.delete_stream(&dead).await?;
    Ok(())
}
