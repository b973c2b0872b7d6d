//! `idem-test-worker nats-consume <stream> <durable> <dlq-subject> <db>
//! <lease_ms> <mode>`: a NATS JetStream consumer process for
//! `tests/nats_kill.rs`. It consumes the durable pull consumer through idem
//! on `db`, a SQLite file or `postgres://…#<schema>` (a
//! [`Business`](super::worker_rabbitmq::Business); message ids from the
//! `Idem-Key` header), writing each message's business effect (an `orders`
//! row) in the same transaction as its idempotency record, slowly enough
//! that a SIGKILL lands mid-message. Mode `single`: one adapter, one
//! message at a time (`run_blocking`: the claim commits first). Mode
//! `shared`: [`SHARED_ADAPTERS`] adapters sharing one batcher
//! (`run_batched`), each batch in one transaction, so that a kill lands in
//! a batch holding several adapters' messages. Prints "ready" once it
//! consumes.

use anyhow::{Context, Result, bail};
use idem_consumer::Batcher;
use idem_nats::async_nats;
use idem_nats::{AdapterConfig, Incoming, JetStreamAdapter, MessageId};

/// The header the test puts each message's id in.
pub const KEY_HEADER: &str = "Idem-Key";

/// In mode `shared`: the adapters sharing the process's batcher, and the
/// messages each has in flight; a batch holds up to all of them.
const SHARED_ADAPTERS: usize = 2;
const SHARED_IN_FLIGHT: usize = 2;

pub fn consume(
    stream: &str,
    durable: &str,
    dlq: &str,
    db: &str,
    lease_ms: u64,
    mode: &str,
) -> Result<()> {
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
        match mode {
            "single" => {
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
            }
            "shared" => {
                adapter_config.max_in_flight = SHARED_IN_FLIGHT;
                let batcher = Batcher::new(
                    &consumer,
                    SHARED_ADAPTERS * SHARED_IN_FLIGHT,
                    move |batch: Vec<Incoming>, engine, requests| {
                        let ids: Vec<&str> = batch.iter().map(|i| i.id.as_str()).collect();
                        business.handle_batch(&ids, engine, requests)
                    },
                );
                let mut runs = tokio::task::JoinSet::new();
                for _ in 0..SHARED_ADAPTERS {
                    let adapter = JetStreamAdapter::new(
                        js.clone(),
                        pull.clone(),
                        consumer.clone(),
                        adapter_config.clone(),
                    );
                    let batcher = batcher.clone();
                    runs.spawn(async move {
                        adapter.run_batched(batcher, std::future::pending()).await
                    });
                }
                println!("ready");
                while let Some(run) = runs.join_next().await {
                    run??;
                }
            }
            other => bail!("nats-consume takes mode single or shared, not {other}"),
        }
        Ok(())
    })
}
