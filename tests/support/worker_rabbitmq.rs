//! `idem-test-worker rabbit-consume <queue> <db> <lease_ms>`: a RabbitMQ
//! consumer process for `tests/rabbitmq_kill.rs`. It consumes `queue`
//! through idem on `db` (a [`Business`]), writing each
//! message's business effect (an `orders` row) in one transaction with
//! its claim and its outcome, for every delivery that has arrived (up to
//! [`BATCH`]: `run_batch_in_one_transaction`; the JetStream worker does so
//! too in its mode `shared`, and in its mode `single` claims
//! first, `run_in_transaction`), slowly enough that a SIGKILL lands
//! mid-batch. Prints "ready" once it consumes.

use std::time::Duration;

use anyhow::{Context, Result};
use idem::{ActionResult, Engine, RunInTransaction, Success};
use idem_consumer::{Consumer, ConsumerConfig};
use idem_rabbitmq::lapin::{Connection, ConnectionProperties};
use idem_rabbitmq::{Options, RabbitConsumer, Topology};

/// How long the handler waits before and after its business write: a kill
/// at a random instant lands before, between or after them.
pub const STEP: Duration = Duration::from_millis(5);

/// The RabbitMQ worker's prefetch and largest batch: a kill lands in a
/// batch of several messages, whose redeliveries must all run again.
pub const BATCH: u16 = 4;

/// The business effect's outcome, as the idempotency record stores it.
pub fn effect(id: &str, written: Result<usize, impl std::fmt::Display>) -> ActionResult {
    match written {
        Ok(_) => ActionResult::Succeeded(Success::with_ref(id)),
        Err(e) => ActionResult::retryable("orders-write", e),
    }
}

/// The consumer of a worker process (biz type `order.create`, lease
/// `lease_ms`) and the runtime it runs on.
pub fn consumer(engine: Engine, lease_ms: u64) -> Result<(Consumer, tokio::runtime::Runtime)> {
    let mut config = ConsumerConfig::new("order.create");
    config.policy.lease_ms = lease_ms;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok((Consumer::new(engine, config), runtime))
}

/// Where a worker keeps its records and writes its business rows: the
/// SQLite file `db`, or `postgres://…#<schema>` (the store's schema, whose
/// `orders` table the test made).
#[derive(Clone)]
pub struct Business {
    insert: String,
    on_postgres: bool,
    me: String,
}

impl Business {
    /// Opens the engine on `db` and the business table's writer.
    pub fn open(db: &str) -> Result<(Engine, Self)> {
        let pg = db
            .split_once('#')
            .filter(|(url, _)| url.starts_with("postgres://"));
        let engine = match pg {
            Some((url, schema)) => Engine::builder()
                .storage(idem::PostgresStore::connect(
                    url,
                    idem::PostgresOptions {
                        schema: schema.to_owned(),
                        pool_size: 2,
                        ..idem::PostgresOptions::default()
                    },
                )?)
                .build()?,
            None => super::engine(db, None)?.0,
        };
        let insert = match pg {
            Some((_, schema)) => {
                format!("INSERT INTO \"{schema}\".orders (idem_key, worker) VALUES ($1, $2)")
            }
            None => "INSERT INTO orders (idem_key, worker) VALUES (?1, ?2)".to_owned(),
        };
        let business = Self {
            insert,
            on_postgres: pg.is_some(),
            me: std::process::id().to_string(),
        };
        Ok((engine, business))
    }

    /// Handles the messages `ids` in one transaction: each one's claim,
    /// `orders` row ([`STEP`] before and after) and outcome
    /// (`run_batch_in_one_transaction`).
    pub fn handle_batch(
        &self,
        ids: &[&str],
        engine: &Engine,
        requests: &[idem::BeginRequest],
    ) -> Result<Vec<Result<idem::RunOutcome, idem::Error>>, idem::Error> {
        use idem::postgres::RunInTransaction as Pg;
        let (insert, me) = (self.insert.as_str(), self.me.as_str());
        if self.on_postgres {
            Pg::run_batch_in_one_transaction(engine, requests, |i, _, client| {
                std::thread::sleep(STEP);
                let written = client.execute(insert, &[&ids[i], &me]);
                std::thread::sleep(STEP);
                effect(ids[i], written.map(|n| n as usize))
            })
        } else {
            RunInTransaction::run_batch_in_one_transaction(engine, requests, |i, _, conn| {
                std::thread::sleep(STEP);
                let written = conn.execute(insert, [ids[i], me]);
                std::thread::sleep(STEP);
                effect(ids[i], written)
            })
        }
    }

    /// Handles message `id`: its `orders` row written in the same
    /// transaction as its idempotency record's outcome, [`STEP`] before
    /// and after; the claim commits first (`run_in_transaction`).
    pub fn handle(
        &self,
        id: &str,
        engine: &Engine,
        request: &idem::BeginRequest,
    ) -> Result<idem::RunOutcome, idem::Error> {
        use idem::postgres::RunInTransaction as Pg;
        let (insert, me) = (self.insert.as_str(), self.me.as_str());
        if self.on_postgres {
            Pg::run_in_transaction(engine, request, |_, client| {
                std::thread::sleep(STEP);
                let written = client.execute(insert, &[&id, &me]);
                std::thread::sleep(STEP);
                effect(id, written.map(|n| n as usize))
            })
        } else {
            RunInTransaction::run_in_transaction(engine, request, |_, conn| {
                std::thread::sleep(STEP);
                let written = conn.execute(insert, [id, me]);
                std::thread::sleep(STEP);
                effect(id, written)
            })
        }
    }
}

pub fn consume(queue: &str, db: &str, lease_ms: u64) -> Result<()> {
    let (engine, business) = Business::open(db)?;
    let (consumer, runtime) = consumer(engine, lease_ms)?;
    runtime.block_on(async {
        let conn = Connection::connect(
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            ConnectionProperties::default(),
        )
        .await
        .context("RabbitMQ")?;
        let channel = conn.create_channel().await?;
        let options = Options {
            prefetch: BATCH,
            ..Options::default()
        };
        let rabbit =
            RabbitConsumer::new(channel, Topology::named(queue), consumer, options).await?;
        println!("ready");
        rabbit
            .run_batch_blocking(
                usize::from(BATCH),
                move |incoming, engine, requests| {
                    let ids: Vec<&str> = incoming.iter().map(|i| i.id.as_str()).collect();
                    business.handle_batch(&ids, engine, requests)
                },
                std::future::pending(),
            )
            .await?;
        Ok(())
    })
}
