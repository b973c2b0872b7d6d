//! idem's RabbitMQ adapter: a queue consumer whose messages each take
//! effect once, however often RabbitMQ delivers them.
//!
//! [`Topology::declare`] declares three durable queues for a queue `Q`:
//!
//! - `Q`, the work queue, with manual acks. Its dead-letter exchange
//!   routes what RabbitMQ itself rejects or expires to `Q.dlq`.
//! - `Q.retry`, where a message waits before it is delivered again: it is
//!   published there with a per-message `expiration` (the delay), and when
//!   that ends RabbitMQ dead-letters it back to `Q`. (RabbitMQ expires
//!   only the message at the head of a queue, so a short delay behind a
//!   long one waits for it: the delays here are bounded by
//!   `ConsumerConfig::max_retry_delay`.)
//! - `Q.dlq`, the dead-letter queue: messages that will not be retried as
//!   they are, each with the `x-idem-dead-letter` header naming why
//!   (`failed`, `conflict`, `outcome-unknown`, `invalid`) and
//!   `x-idem-dead-letter-detail`.
//!
//! [`RabbitConsumer::run`] consumes `Q` and carries out each
//! [`Verdict`] of the [`Consumer`]: ack; retry (published to `Q.retry`,
//! confirmed, then the delivery is acked); dead-letter (published to
//! `Q.dlq`, confirmed, then acked). A publish that RabbitMQ does not
//! confirm leaves the delivery unacked (nack with requeue): a message is
//! never lost between two queues. When the store does not answer the
//! delivery is retried after [`STORE_RETRY_DELAY`], never acked.
//!
//! A message's id is its `message_id` property unless
//! [`Options::message_id`] derives one (for example a natural key from the
//! body); a message without one is dead-lettered as invalid.

#![warn(missing_docs)]

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::Confirmation;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel};

pub use idem_consumer::{
    Acked, Consumer, ConsumerConfig, ConsumerError, DeadLetterReason, HandlerError, Message,
    RetryReason, Verdict,
};
use idem_engine::api::BeginRequest;
use idem_engine::engine::{Engine, Error as EngineError, RunOutcome};
use idem_engine::types::Success;
pub use lapin;

/// The header that names why a message was dead-lettered.
pub const DEAD_LETTER_HEADER: &str = "x-idem-dead-letter";

/// The header with a sentence on why a message was dead-lettered.
pub const DEAD_LETTER_DETAIL_HEADER: &str = "x-idem-dead-letter-detail";

/// The header counting how often a message went through the retry queue.
pub const RETRIES_HEADER: &str = "x-idem-retries";

/// How long a delivery waits when the idempotency store did not answer: 1
/// s, as the consumer's first retry. The store is most likely restarting
/// or failing over; retrying at once would only spin.
pub const STORE_RETRY_DELAY: Duration = Duration::from_secs(1);

/// The default [`Options::prefetch`]: 16 unacked deliveries per consumer,
/// so the next message is already on its way while one is handled, without
/// one consumer hoarding the queue from the others.
pub const DEFAULT_PREFETCH: u16 = 16;

/// Why the adapter stopped.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// RabbitMQ failed: the connection or the channel closed, or a
    /// declaration was refused.
    #[error("rabbitmq: {0}")]
    Broker(#[from] lapin::Error),
}

/// The three queues of one work queue (see the crate documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The work queue.
    pub queue: String,
    /// Where a message waits before its next delivery.
    pub retry_queue: String,
    /// Where a message goes that will not be retried as it is.
    pub dead_letter_queue: String,
}

impl Topology {
    /// The names for work queue `queue`: `queue`, `queue.retry`,
    /// `queue.dlq`.
    pub fn named(queue: &str) -> Self {
        Self {
            queue: queue.to_owned(),
            retry_queue: format!("{queue}.retry"),
            dead_letter_queue: format!("{queue}.dlq"),
        }
    }

    /// Declares the three durable queues on `channel` (idempotent: a
    /// second declaration with the same arguments changes nothing).
    ///
    /// # Errors
    ///
    /// RabbitMQ's, for instance when a queue of that name exists with other
    /// arguments.
    pub async fn declare(channel: &Channel, queue: &str) -> Result<Self, AdapterError> {
        let t = Self::named(queue);
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let dead_letter_to = |target: &str| {
            let mut args = FieldTable::default();
            args.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString(LongString::from("")),
            );
            args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(LongString::from(target)),
            );
            args
        };
        channel
            .queue_declare(
                t.dead_letter_queue.as_str().into(),
                durable,
                FieldTable::default(),
            )
            .await?;
        channel
            .queue_declare(
                t.queue.as_str().into(),
                durable,
                dead_letter_to(&t.dead_letter_queue),
            )
            .await?;
        channel
            .queue_declare(
                t.retry_queue.as_str().into(),
                durable,
                dead_letter_to(&t.queue),
            )
            .await?;
        Ok(t)
    }

    /// Deletes the three queues and the messages in them (a test's or a
    /// demo's topology, at its end).
    ///
    /// # Errors
    ///
    /// [`AdapterError::Broker`] when RabbitMQ refuses a deletion.
    pub async fn delete(&self, channel: &Channel) -> Result<(), AdapterError> {
        for queue in [&self.queue, &self.retry_queue, &self.dead_letter_queue] {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

/// Derives a message id from a delivery, when the `message_id` property is
/// not the id to use.
pub type MessageId = Arc<dyn Fn(&Delivery) -> Option<String> + Send + Sync>;

/// Called after each delivery is settled with what was done (`executed`,
/// `duplicate`, `retried`, `dead-lettered`, `store-error`) and how long it
/// took from its arrival: for metrics.
pub type OnSettled = Arc<dyn Fn(&'static str, Duration) + Send + Sync>;

/// How a [`RabbitConsumer`] consumes.
#[derive(Clone)]
pub struct Options {
    /// The idempotency scope of the messages. Default: the queue's name.
    pub scope: Option<String>,
    /// Unacked deliveries per consumer. Default [`DEFAULT_PREFETCH`].
    pub prefetch: u16,
    /// The consumer tag. Default: RabbitMQ picks one.
    pub consumer_tag: String,
    /// Derives the message id. Default: the `message_id` property.
    pub message_id: Option<MessageId>,
    /// Observes each settled delivery. Default: none.
    pub on_settled: Option<OnSettled>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            scope: None,
            prefetch: DEFAULT_PREFETCH,
            consumer_tag: String::new(),
            message_id: None,
            on_settled: None,
        }
    }
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("scope", &self.scope)
            .field("prefetch", &self.prefetch)
            .field("consumer_tag", &self.consumer_tag)
            .field("message_id", &self.message_id.is_some())
            .field("on_settled", &self.on_settled.is_some())
            .finish()
    }
}

/// What a handler is given for one delivery.
#[derive(Debug, Clone)]
pub struct Incoming {
    /// The message id idem keyed it by.
    pub id: String,
    /// The body.
    pub body: Vec<u8>,
    /// Whether RabbitMQ says it delivered the message before.
    pub redelivered: bool,
}

/// What a [`RabbitConsumer`] did, so far.
#[derive(Debug, Default)]
pub struct Stats {
    /// Deliveries received.
    pub delivered: AtomicU64,
    /// Deliveries that ran the handler and were acked.
    pub executed: AtomicU64,
    /// Deliveries acked as duplicates of a message that took effect.
    pub duplicates: AtomicU64,
    /// Deliveries sent to the retry queue.
    pub retried: AtomicU64,
    /// Deliveries sent to the dead-letter queue.
    pub dead_lettered: AtomicU64,
    /// Deliveries retried because the store did not answer.
    pub store_errors: AtomicU64,
}

impl Stats {
    fn count(&self, counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// A counter's value.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Consumes one work queue through a [`Consumer`].
pub struct RabbitConsumer {
    channel: Channel,
    topology: Topology,
    consumer: Consumer,
    options: Options,
    stats: Arc<Stats>,
}

impl std::fmt::Debug for RabbitConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConsumer")
            .field("topology", &self.topology)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl RabbitConsumer {
    /// A consumer of `topology.queue` on `channel` (which it puts in
    /// publisher-confirm mode with its prefetch), through `consumer`.
    ///
    /// With [`RabbitConsumer::run_batch_blocking`] the channel MUST be this
    /// consumer's alone: delivery tags are per channel, and a run of acked
    /// deliveries is acked with one `basic.ack` with `multiple`, which
    /// would also ack another consumer's deliveries on the same channel.
    ///
    /// # Errors
    ///
    /// RabbitMQ's.
    pub async fn new(
        channel: Channel,
        topology: Topology,
        consumer: Consumer,
        options: Options,
    ) -> Result<Self, AdapterError> {
        channel
            .basic_qos(options.prefetch, BasicQosOptions::default())
            .await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self {
            channel,
            topology,
            consumer,
            options,
            stats: Arc::new(Stats::default()),
        })
    }

    /// The counters, shared with a running [`RabbitConsumer::run`].
    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Consumes until `shutdown` completes (after the delivery in hand is
    /// settled) or the channel closes, running `handler` for each message
    /// that the engine says to execute. Each delivery is handled to the end
    /// before the next: run several consumers for parallelism.
    ///
    /// # Errors
    ///
    /// [`AdapterError::Broker`] when the channel fails; unacked deliveries
    /// go back to the queue.
    pub async fn run<H, Fut, T>(
        &self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), AdapterError>
    where
        H: Fn(Incoming) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
        T: Into<Success>,
    {
        let handler = &handler;
        self.consume(
            |incoming: Incoming| async move {
                let message = Message {
                    id: &incoming.id,
                    scope: self.scope(),
                    body: &incoming.body,
                };
                self.consumer
                    .handle(&message, |_ticket| handler(incoming.clone()))
                    .await
            },
            shutdown,
        )
        .await
    }

    /// Like [`RabbitConsumer::run`], for a blocking handler that drives
    /// the engine itself on a blocking thread
    /// ([`Consumer::handle_blocking`]): typically a store's
    /// `run_in_transaction`, so that the message's business write and its
    /// transition to succeeded commit together.
    ///
    /// # Errors
    ///
    /// As [`RabbitConsumer::run`].
    pub async fn run_blocking<H>(
        &self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), AdapterError>
    where
        H: Fn(Incoming, &Engine, &BeginRequest) -> Result<RunOutcome, EngineError>
            + Clone
            + Send
            + 'static,
    {
        let handler = &handler;
        self.consume(
            |incoming: Incoming| async move {
                let message = Message {
                    id: &incoming.id,
                    scope: self.scope(),
                    body: &incoming.body,
                };
                let handler = handler.clone();
                let owned = incoming.clone();
                self.consumer
                    .handle_blocking(&message, move |engine, request| {
                        handler(owned, engine, request)
                    })
                    .await
            },
            shutdown,
        )
        .await
    }

    /// Like [`RabbitConsumer::run_blocking`], with the deliveries that have
    /// already arrived handled together
    /// ([`Consumer::handle_batch_blocking`]): typically a store's
    /// `run_batch_in_one_transaction`, so that up to `max_batch`
    /// deliveries (at most the prefetch, and at least 1) cost one commit.
    /// It never waits for a batch to fill: a lone delivery is handled at
    /// once. `handler` gets the batch's messages and the matching engine
    /// requests, and answers one slot per request. A run of acked
    /// deliveries is acked at once, so the channel MUST be this consumer's
    /// alone ([`RabbitConsumer::new`]).
    ///
    /// # Errors
    ///
    /// As [`RabbitConsumer::run`].
    pub async fn run_batch_blocking<H>(
        &self,
        max_batch: usize,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), AdapterError>
    where
        H: Fn(
                Vec<Incoming>,
                &Engine,
                &[BeginRequest],
            ) -> Result<Vec<Result<RunOutcome, EngineError>>, EngineError>
            + Clone
            + Send
            + 'static,
    {
        let handler = &handler;
        // A prefetch of 0 is RabbitMQ's "no limit".
        let max_batch = match self.options.prefetch {
            0 => max_batch.max(1),
            prefetch => max_batch.clamp(1, usize::from(prefetch)),
        };
        self.consume_batches(
            max_batch,
            |incoming: Vec<Incoming>| async move {
                let scope = self.scope();
                let messages: Vec<Message<'_>> = incoming
                    .iter()
                    .map(|i| Message {
                        id: &i.id,
                        scope,
                        body: &i.body,
                    })
                    .collect();
                let handler = handler.clone();
                let owned = incoming.clone();
                self.consumer
                    .handle_batch_blocking(&messages, move |engine, requests| {
                        handler(owned, engine, requests)
                    })
                    .await
            },
            shutdown,
        )
        .await
    }

    fn scope(&self) -> &str {
        self.options
            .scope
            .as_deref()
            .unwrap_or(&self.topology.queue)
    }

    /// The consume loop, one delivery at a time: `decide` says what to do
    /// with each delivery that has an id; this carries it out.
    async fn consume<D, DFut>(
        &self,
        decide: D,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), AdapterError>
    where
        D: Fn(Incoming) -> DFut,
        DFut: Future<Output = Result<Verdict, ConsumerError>>,
    {
        let decide = &decide;
        self.consume_batches(
            1,
            |mut batch: Vec<Incoming>| async move {
                match batch.pop() {
                    Some(incoming) => Ok(vec![decide(incoming).await]),
                    None => Ok(Vec::new()),
                }
            },
            shutdown,
        )
        .await
    }

    /// The consume loop: waits for a delivery, takes up to `max_batch - 1`
    /// more that have already arrived (it never waits for a batch to
    /// fill), lets `decide` say what to do with those that have an id,
    /// and carries out each verdict in delivery order.
    async fn consume_batches<D, DFut>(
        &self,
        max_batch: usize,
        decide: D,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), AdapterError>
    where
        D: Fn(Vec<Incoming>) -> DFut,
        DFut: Future<Output = Result<Vec<Result<Verdict, ConsumerError>>, ConsumerError>>,
    {
        let mut deliveries = self
            .channel
            .basic_consume(
                self.topology.queue.as_str().into(),
                self.options.consumer_tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut batch = Vec::with_capacity(max_batch);
        loop {
            let first = tokio::select! {
                () = &mut shutdown => return Ok(()),
                next = deliveries.next() => match next {
                    Some(delivery) => delivery?,
                    None => return Ok(()),
                },
            };
            batch.push((first, std::time::Instant::now()));
            while batch.len() < max_batch {
                match futures_lite::future::poll_once(deliveries.next()).await {
                    Some(Some(delivery)) => batch.push((delivery?, std::time::Instant::now())),
                    // Nothing more has arrived, or the stream ended (seen
                    // again at the top of the loop).
                    Some(None) | None => break,
                }
            }
            let mut keyed = Vec::with_capacity(batch.len());
            let mut incoming = Vec::with_capacity(batch.len());
            for (delivery, arrived) in batch.drain(..) {
                self.stats.count(&self.stats.delivered);
                match self.message_id(&delivery) {
                    Some(id) => {
                        incoming.push(Incoming {
                            id: id.clone(),
                            body: delivery.data.clone(),
                            redelivered: delivery.redelivered,
                        });
                        keyed.push((delivery, arrived, id));
                    }
                    None => {
                        let reason = DeadLetterReason::Invalid {
                            message: "the message has no id: set its message_id property (or derive one with Options::message_id)".into(),
                        };
                        self.dead_letter(&delivery, &reason).await?;
                        self.observe("dead-lettered", arrived);
                    }
                }
            }
            if keyed.is_empty() {
                continue;
            }
            match decide(incoming).await {
                Ok(verdicts) if verdicts.len() == keyed.len() => {
                    // A run of acks is one ack of its last delivery with
                    // `multiple`: every delivery before it on this channel is
                    // settled by then (this loop settles them in order).
                    let mut acks: Vec<(&'static str, &AtomicU64, std::time::Instant)> = Vec::new();
                    let mut last_ack = None;
                    for ((delivery, arrived, id), verdict) in keyed.iter().zip(verdicts) {
                        if let Ok(Verdict::Ack(acked)) = verdict {
                            let (counter, done) = self.acked(acked);
                            acks.push((done, counter, *arrived));
                            last_ack = Some(delivery);
                            continue;
                        }
                        self.ack_up_to(last_ack.take(), &mut acks).await?;
                        let done = self.carry_out(delivery, id, verdict).await?;
                        self.observe(done, *arrived);
                    }
                    self.ack_up_to(last_ack, &mut acks).await?;
                }
                answer => {
                    // The batch as a whole failed: nothing of it was kept,
                    // and every delivery is retried.
                    let error = match answer {
                        Err(e) => e.to_string(),
                        Ok(verdicts) => format!(
                            "{} deliveries were answered with {} verdicts",
                            keyed.len(),
                            verdicts.len()
                        ),
                    };
                    for (delivery, arrived, id) in keyed {
                        let done = self.store_error(&delivery, &id, &error).await?;
                        self.observe(done, arrived);
                    }
                }
            }
        }
    }

    /// The delivery's message id: derived, or its `message_id` property.
    fn message_id(&self, delivery: &Delivery) -> Option<String> {
        match &self.options.message_id {
            Some(derive) => derive(delivery),
            None => delivery
                .properties
                .message_id()
                .as_ref()
                .map(|id| id.as_str().to_owned()),
        }
    }

    fn observe(&self, done: &'static str, arrived: std::time::Instant) {
        if let Some(f) = &self.options.on_settled {
            f(done, arrived.elapsed());
        }
    }

    /// Acks, retries or dead-letters `delivery` as `verdict` says; returns
    /// what it did, as [`OnSettled`] names it.
    async fn carry_out(
        &self,
        delivery: &Delivery,
        id: &str,
        verdict: Result<Verdict, ConsumerError>,
    ) -> Result<&'static str, AdapterError> {
        match verdict {
            Ok(Verdict::Ack(acked)) => {
                let (counter, done) = self.acked(acked);
                delivery.ack(BasicAckOptions::default()).await?;
                self.stats.count(counter);
                Ok(done)
            }
            Ok(Verdict::Retry { after, why }) => {
                tracing::debug!(id, ?why, ?after, "retrying the message later");
                self.retry(delivery, after).await?;
                Ok("retried")
            }
            Ok(Verdict::DeadLetter(reason)) => {
                tracing::warn!(id, %reason, "dead-lettering the message");
                self.dead_letter(delivery, &reason).await?;
                Ok("dead-lettered")
            }
            Err(e) => self.store_error(delivery, id, &e).await,
        }
    }

    /// The counter and the [`OnSettled`] name of an acked delivery.
    fn acked(&self, acked: Acked) -> (&AtomicU64, &'static str) {
        match acked {
            Acked::Executed => (&self.stats.executed, "executed"),
            Acked::Duplicate => (&self.stats.duplicates, "duplicate"),
        }
    }

    /// Acks `last` and every delivery before it on the channel, in one
    /// `basic.ack` with `multiple` (a plain ack when `acks` holds one
    /// delivery, so a consumer that handles one delivery at a time never
    /// acks beyond it), then counts and observes `acks`.
    async fn ack_up_to(
        &self,
        last: Option<&Delivery>,
        acks: &mut Vec<(&'static str, &AtomicU64, std::time::Instant)>,
    ) -> Result<(), AdapterError> {
        let Some(last) = last else {
            return Ok(());
        };
        last.ack(BasicAckOptions {
            multiple: acks.len() > 1,
        })
        .await?;
        for (done, counter, arrived) in acks.drain(..) {
            self.stats.count(counter);
            self.observe(done, arrived);
        }
        Ok(())
    }

    /// Retries `delivery` after [`STORE_RETRY_DELAY`]: the engine could not
    /// decide or store, so the delivery is never acked.
    async fn store_error(
        &self,
        delivery: &Delivery,
        id: &str,
        error: &(dyn std::fmt::Display + Sync),
    ) -> Result<&'static str, AdapterError> {
        tracing::warn!(id, error = %error, "the store did not answer; the message is retried");
        self.stats.count(&self.stats.store_errors);
        self.retry(delivery, STORE_RETRY_DELAY).await?;
        Ok("store-error")
    }

    /// Publishes a copy to the retry queue with `after` as its expiration,
    /// then acks the delivery; or, when RabbitMQ does not confirm the copy,
    /// requeues the delivery.
    async fn retry(&self, delivery: &Delivery, after: Duration) -> Result<(), AdapterError> {
        let mut headers = headers_of(delivery);
        let retries = match headers.inner().get(RETRIES_HEADER) {
            Some(AMQPValue::LongLongInt(n)) => *n + 1,
            _ => 1,
        };
        headers.insert(RETRIES_HEADER.into(), AMQPValue::LongLongInt(retries));
        let properties = delivery
            .properties
            .clone()
            .with_headers(headers)
            .with_expiration(after.as_millis().max(1).to_string().into());
        self.stats.count(&self.stats.retried);
        self.forward(delivery, &self.topology.retry_queue, properties)
            .await
    }

    /// Publishes a copy to the dead-letter queue, with the reason in its
    /// headers, then acks the delivery; or requeues it when RabbitMQ does
    /// not confirm the copy.
    async fn dead_letter(
        &self,
        delivery: &Delivery,
        reason: &DeadLetterReason,
    ) -> Result<(), AdapterError> {
        let mut headers = headers_of(delivery);
        headers.insert(
            DEAD_LETTER_HEADER.into(),
            AMQPValue::LongString(LongString::from(reason.code())),
        );
        headers.insert(
            DEAD_LETTER_DETAIL_HEADER.into(),
            AMQPValue::LongString(LongString::from(reason.to_string())),
        );
        let properties = delivery.properties.clone().with_headers(headers);
        self.stats.count(&self.stats.dead_lettered);
        self.forward(delivery, &self.topology.dead_letter_queue, properties)
            .await
    }

    async fn forward(
        &self,
        delivery: &Delivery,
        queue: &str,
        properties: BasicProperties,
    ) -> Result<(), AdapterError> {
        let confirm = self
            .channel
            .basic_publish(
                ShortString::from(""),
                queue.into(),
                BasicPublishOptions::default(),
                &delivery.data,
                properties,
            )
            .await?
            .await?;
        if matches!(confirm, Confirmation::Ack(_)) {
            delivery.ack(BasicAckOptions::default()).await?;
        } else {
            tracing::warn!(
                queue,
                "RabbitMQ did not confirm the copy; the delivery is requeued"
            );
            delivery
                .nack(BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                })
                .await?;
        }
        Ok(())
    }
}

fn headers_of(delivery: &Delivery) -> FieldTable {
    delivery.properties.headers().clone().unwrap_or_default()
}

/// Publishes `body` to `queue` with `message_id` (through the default
/// exchange, persistent) and waits for RabbitMQ's confirm; for producers
/// and tests. `channel` must be in confirm mode
/// (`confirm_select`) for the confirm to mean anything.
///
/// # Errors
///
/// RabbitMQ's.
pub async fn publish(
    channel: &Channel,
    queue: &str,
    message_id: &str,
    body: &[u8],
) -> Result<Confirmation, AdapterError> {
    Ok(channel
        .basic_publish(
            ShortString::from(""),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default()
                .with_message_id(message_id.into())
                .with_delivery_mode(2),
        )
        .await?
        .await?)
}
