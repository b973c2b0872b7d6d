//! `idem-test-worker rabbit-consume <queue> <db> <lease_ms>`: a RabbitMQ
//! consumer process for `tests/rabbitmq_kill.rs`. It consumes `queue`
//! through idem on the SQLite file `db`, writing each message's business
//! effect (an `orders` row) in the same transaction as its idempotency
//! record (`run_in_transaction`), slowly enough that a SIGKILL lands
//! mid-message. Prints "ready" once it consumes.

use std::time::Duration;

use anyhow::Result;
use idem::{ActionResult, RunInTransaction, Success};
use idem_consumer::{Consumer, ConsumerConfig};
use idem_rabbitmq::lapin::{Connection, ConnectionProperties};
use idem_rabbitmq::{Options, RabbitConsumer, Topology};

/// How long the handler waits before and after its business write: a kill
/// at a random instant lands before, between or after them.
const STEP: Duration = Duration::from_millis(5);

pub fn consume(queue: &str, db: &str, lease_ms: u64) -> Result<()> {
    let (engine, _store) = super::engine(db, None)?;
    let mut config = ConsumerConfig::new("order.create");
    config.policy.lease_ms = lease_ms;
    let consumer = Consumer::new(engine, config);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let conn = Connection::connect(
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            ConnectionProperties::default(),
        )
        .await?;
        let channel = conn.create_channel().await?;
        let options = Options {
            prefetch: 1,
            ..Options::default()
        };
        let rabbit =
            RabbitConsumer::new(channel, Topology::named(queue), consumer, options).await?;
        let me = std::process::id().to_string();
        println!("ready");
        rabbit
            .run_blocking(
                move |incoming, engine, request, budget| {
                    engine.run_in_transaction(request, |ticket, conn| {
                        std::thread::sleep(STEP);
                        let written = conn.execute(
                            "INSERT INTO orders (idem_key, worker) VALUES (?1, ?2)",
                            [&incoming.id, &me],
                        );
                        std::thread::sleep(STEP);
                        budget.apply(
                            ticket,
                            match written {
                                Ok(_) => {
                                    ActionResult::Succeeded(Success::with_ref(incoming.id.clone()))
                                }
                                Err(e) => ActionResult::retryable("orders-write", e),
                            },
                        )
                    })
                },
                std::future::pending(),
            )
            .await?;
        Ok(())
    })
}
