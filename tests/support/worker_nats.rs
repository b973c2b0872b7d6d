//! `idem-test-worker nats-consume <stream> <durable> <dlq-subject> <db>
//! <lease_ms>`: a NATS JetStream consumer process for
//! `tests/nats_kill.rs`. It consumes the durable pull consumer through idem
//! on `db`, a SQLite file or `postgres://…#<schema>` (a
//! [`Business`](super::worker_rabbitmq::Business); message ids from the
//! `Idem-Key` header),
//! writing each message's business effect (an `orders` row) in the same
//! transaction as its idempotency record, slowly enough that a SIGKILL
//! lands mid-message. Prints "ready" once it consumes.

use anyhow::{Context, Result};
use idem_nats::async_nats;
use idem_nats::{AdapterConfig, JetStreamAdapter, MessageId};

/// The header the test puts each message's id in.
pub const KEY_HEADER: &str = "Idem-Key";

pub fn consume(stream: &str, durable: &str, dlq: &str, db: &str, lease_ms: u64) -> Result<()> {
    let (engine, business) = super::worker_rabbitmq::Business::open(db)?;
    let (consumer, runtime) = super::worker_rabbitmq::consumer(engine, lease_ms)?;
    runtime.block_on(async {
        let client = async_nats::connect("127.0.0.1:4222")
            .await
            .context("NATS")?;
        let js = async_nats::jetstream::new(client);
        let pull: async_nats::jetstream::consumer::PullConsumer = js
            .get_stream(stream)
            .await?
            .get_consumer(durable)
            .await
            .map_err(|e| anyhow::anyhow!("the consumer {durable}: {e}"))?;
        let mut adapter_config = AdapterConfig::new(stream, dlq);
        adapter_config.message_id = MessageId::header(KEY_HEADER)?;
        adapter_config.max_in_flight = 1;
        let adapter = JetStreamAdapter::new(js, pull, consumer, adapter_config);
        println!("ready");
        adapter
            .run_blocking(
                move |incoming, engine, request| {
                    business.handle(incoming.id.as_str(), engine, request)
                },
                std::future::pending(),
            )
            .await?;
        Ok(())
    })
}
