//! idem for NATS JetStream: a pull consumer whose messages each take effect
//! once, however often JetStream delivers them.
//!
//! JetStream delivers at least once. A message comes back when its ack was
//! lost, when the handler outlived the consumer's `ack_wait` (often to
//! another consumer while the first still works on it), after a nak, or when
//! a producer retried a publish that the stream did not deduplicate (its
//! `duplicate_window` had passed, or it had no `Nats-Msg-Id`). A
//! [`JetStreamAdapter`] keys each message by its id within a scope, lets an
//! [`idem_consumer::Consumer`] decide whether the handler runs, and carries
//! out the [`Verdict`]:
//!
//! | verdict | what the adapter does |
//! |---|---|
//! | [`Verdict::Ack`] (executed, or a duplicate of a message that took effect) | `+ACK` |
//! | [`Verdict::Retry`] (in progress elsewhere, a retryable failure, lost ownership) | `-NAK` with the verdict's delay |
//! | [`Verdict::DeadLetter`] (conflict, failed, outcome unknown, invalid id) | publishes the message to the dead-letter subject with [`REASON_HEADER`] and [`DETAIL_HEADER`], awaits the stream's ack, then `+TERM` |
//! | the store did not answer ([`ConsumerError`]) | `-NAK` after [`AdapterConfig::error_delay`]; never an ack |
//! | a message without an id | dead-lettered as `invalid` |
//!
//! While a handler runs, the adapter tells JetStream every half `ack_wait`
//! that it is still working (`+WPI`), so the message is not redelivered
//! meanwhile; the engine's lease is extended by the consumer on its own.
//!
//! The dead-letter subject must belong to a stream other than the one the
//! consumer reads (the adapter awaits that stream's ack before `+TERM`, and
//! refuses to start when its own consumer would pull the dead letters
//! back). A dead letter keeps the message's payload and headers, less the
//! server's `Nats-*` directives, and adds the `Idem-*` headers named below.
//!
//! [`JetStreamAdapter::run_blocking`] takes a blocking handler that drives
//! the engine itself, typically through a store's `run_in_transaction`, so
//! that the business write and the record's transition to succeeded commit
//! together.
//!
//! Producers can set `Nats-Msg-Id` with [`publish_with_id`]: the stream
//! then drops a retry within its `duplicate_window`, and idem, keyed by the
//! same id (the default [`MessageId`]), catches every later one.
//!
//! ```no_run
//! use idem_consumer::{Consumer, ConsumerConfig, HandlerError};
//! use idem_nats::{AdapterConfig, Delivery, JetStreamAdapter};
//!
//! # async fn run(engine: idem_engine::Engine) -> Result<(), async_nats::Error> {
//! let client = async_nats::connect("127.0.0.1:4222").await?;
//! let js = async_nats::jetstream::new(client);
//! let stream = js.get_stream("ORDERS").await?;
//! let pull = stream.get_consumer("inventory").await?;
//! let consumer = Consumer::new(engine, ConsumerConfig::new("inventory.reserve"));
//! let adapter = JetStreamAdapter::new(
//!     js,
//!     pull,
//!     consumer,
//!     AdapterConfig::new("ORDERS/inventory", "dlq.orders"),
//! );
//! let report = adapter
//!     .run(
//!         |d: Delivery| async move {
//!             // The business effect, keyed by d.id.
//!             Ok::<_, HandlerError>(format!("reserved {}", d.id))
//!         },
//!         async {
//!             let _ = tokio::signal::ctrl_c().await;
//!         },
//!     )
//!     .await?;
//! println!("{report:?}");
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

/// The client this adapter is built on, for building a context and a
/// consumer with the same version.
pub use async_nats;

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::header::{HeaderMap, HeaderName, NATS_MESSAGE_ID};
use async_nats::jetstream::consumer::pull::MessagesErrorKind;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind, Context};
use bytes::Bytes;
use futures_util::StreamExt;
use idem_consumer::{
    Acked, Batcher, Consumer, ConsumerError, DeadLetterReason, HandlerError, Message, RetryReason,
    Verdict,
};
use idem_engine::api::{BeginRequest, Ticket};
use idem_engine::engine::{Engine, Error as EngineError, RunOutcome};
use idem_engine::types::Success;
use tokio::task::JoinSet;

/// The header that names why a message was dead-lettered: `conflict`,
/// `failed`, `outcome-unknown` or `invalid` ([`DeadLetterReason::code`]).
pub const REASON_HEADER: &str = "Idem-Dead-Letter-Reason";
/// The header with a sentence on the dead-letter reason (the failure code,
/// the broken key rule).
pub const DETAIL_HEADER: &str = "Idem-Dead-Letter-Detail";
/// The header of a dead-lettered message that carries its idem message id
/// (absent when the message had none).
pub const MESSAGE_ID_HEADER: &str = "Idem-Message-Id";
/// The header of a dead-lettered message that carries the adapter's scope.
pub const SCOPE_HEADER: &str = "Idem-Scope";
/// The header of a dead-lettered message with the subject it was published
/// to.
pub const ORIGINAL_SUBJECT_HEADER: &str = "Idem-Original-Subject";
/// The header of a dead-lettered message with the stream it came from.
pub const ORIGINAL_STREAM_HEADER: &str = "Idem-Original-Stream";
/// The header of a dead-lettered message with its sequence in that stream.
pub const ORIGINAL_SEQUENCE_HEADER: &str = "Idem-Original-Sequence";
/// The header of a dead-lettered message with how many times JetStream had
/// delivered it.
pub const DELIVERED_HEADER: &str = "Idem-Delivered";

/// The default [`AdapterConfig::max_in_flight`]: 8 handlers at once per
/// [`JetStreamAdapter::run`]. Enough to overlap handlers that wait on I/O
/// and the store's round trips; few enough that the messages a run holds
/// (JetStream counts them against `ack_wait` from their delivery) are
/// started well within the default 30 s `ack_wait`. Run several adapters,
/// or raise it, for more.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 8;

/// The default [`AdapterConfig::error_delay`]: 2 s before a delivery is
/// tried again when the store or the dead-letter stream did not answer.
/// Long enough not to hammer a database or a stream that is restarting,
/// short enough that a blip costs a message about two seconds.
pub const DEFAULT_ERROR_DELAY: Duration = Duration::from_secs(2);

/// How often the server sends an idle heartbeat on a waiting pull request:
/// a connection or server that vanished without closing is noticed after
/// two missed beats, 10 s; one tiny status message every 5 s per waiting
/// run costs nothing.
const PULL_HEARTBEAT: Duration = Duration::from_secs(5);

/// The prefix of the `Nats-Msg-Id` a dead-letter publish carries, followed
/// by the source stream and sequence: if the adapter dies between the
/// publish and the `+TERM`, the redelivery's dead-letter publish is dropped
/// as a duplicate by a dead-letter stream with a `duplicate_window`.
const DEAD_LETTER_ID_PREFIX: &str = "idem-dlq";

/// A function that derives a message's id from the message.
pub type IdFn = dyn Fn(&async_nats::Message) -> Option<String> + Send + Sync;

/// Where the adapter finds a message's id.
#[derive(Clone)]
pub enum MessageId {
    /// A header, by default `Nats-Msg-Id` (the id that JetStream's
    /// publisher-side deduplication uses too).
    Header(HeaderName),
    /// A function of the message, e.g. a natural key (an order number)
    /// parsed from the body. `None` when the message has no id.
    With(Arc<IdFn>),
}

impl MessageId {
    /// The `Nats-Msg-Id` header.
    pub fn nats_msg_id() -> Self {
        MessageId::Header(NATS_MESSAGE_ID)
    }

    /// The header called `name`.
    ///
    /// # Errors
    ///
    /// [`NatsError::Config`] when `name` cannot be a header name (empty,
    /// a control character, a non-ASCII character or `:`).
    pub fn header(name: &str) -> Result<Self, NatsError> {
        name.parse::<HeaderName>()
            .map(MessageId::Header)
            .map_err(|_| NatsError::Config(format!("{name:?} is not a valid NATS header name")))
    }

    /// The id `f` derives from the message.
    pub fn with(
        f: impl Fn(&async_nats::Message) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        MessageId::With(Arc::new(f))
    }

    /// The id of `message`, if it has one.
    pub fn of(&self, message: &async_nats::Message) -> Option<String> {
        match self {
            MessageId::Header(name) => message
                .headers
                .as_ref()?
                .get(name.clone())
                .map(|v| v.as_str().to_owned()),
            MessageId::With(f) => f(message),
        }
    }

    /// Why a message has no id, for the dead-letter detail.
    fn missing(&self) -> String {
        match self {
            MessageId::Header(name) => format!("the message has no {name} header"),
            MessageId::With(_) => "no message id could be derived from the message".to_owned(),
        }
    }
}

impl Default for MessageId {
    fn default() -> Self {
        MessageId::nats_msg_id()
    }
}

impl std::fmt::Debug for MessageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MessageId::Header(name) => f.debug_tuple("Header").field(name).finish(),
            MessageId::With(_) => f.write_str("With(..)"),
        }
    }
}

/// How a [`JetStreamAdapter`] keys messages and carries out verdicts.
#[derive(Debug, Clone)]
pub struct AdapterConfig {
    /// Whose id space the message ids are ([`Message::scope`]), e.g. the
    /// stream and durable consumer names.
    pub scope: String,
    /// Where each message's id comes from. Default: the `Nats-Msg-Id`
    /// header.
    pub message_id: MessageId,
    /// The subject dead-lettered messages are published to. A stream must
    /// capture it (the adapter awaits the stream's ack before it
    /// terminates the message), and the adapter's own consumer must not:
    /// [`JetStreamAdapter::run`] refuses to start when it would.
    pub dead_letter_subject: String,
    /// How many handlers one run executes at once (at least 1); it also
    /// pulls no more messages than that per request, since JetStream counts
    /// a pulled message against `ack_wait` while it waits for a free slot.
    /// Default [`DEFAULT_MAX_IN_FLIGHT`].
    pub max_in_flight: usize,
    /// Whether to send `+WPI` (work in progress) every half `ack_wait`
    /// while a handler runs, so that JetStream does not redeliver a message
    /// whose handler is merely slow. Default true.
    pub progress: bool,
    /// The nak delay when the store did not answer, or the dead-letter
    /// publish was not acked. Default [`DEFAULT_ERROR_DELAY`].
    pub error_delay: Duration,
    /// Told what became of each delivery once its verdict is carried out,
    /// e.g. for metrics. Default none.
    pub observer: Option<Observer>,
}

impl AdapterConfig {
    /// A configuration with `scope`, the dead-letter subject, and the
    /// defaults: the id is the `Nats-Msg-Id` header, up to
    /// [`DEFAULT_MAX_IN_FLIGHT`] handlers, progress on, and
    /// [`DEFAULT_ERROR_DELAY`].
    pub fn new(scope: impl Into<String>, dead_letter_subject: impl Into<String>) -> Self {
        Self {
            scope: scope.into(),
            message_id: MessageId::default(),
            dead_letter_subject: dead_letter_subject.into(),
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            progress: true,
            error_delay: DEFAULT_ERROR_DELAY,
            observer: None,
        }
    }
}

/// What became of one delivery, for an [`Observer`].
#[derive(Debug, Clone)]
pub struct Handled {
    /// The message id, if the message had one.
    pub id: Option<String>,
    /// How many times JetStream has delivered the message, this time
    /// included (0 when the reply subject could not be read).
    pub delivered: u64,
    /// The consumer's verdict; `None` when the store did not answer (the
    /// delivery was nakked after [`AdapterConfig::error_delay`]).
    pub verdict: Option<Verdict>,
    /// Whether JetStream was told as the verdict says: false when the ack,
    /// nak or termination could not be sent, or a dead letter was not
    /// stored (the delivery was nakked instead).
    pub carried_out: bool,
    /// From taking the delivery off the pull stream to sending the
    /// verdict's ack, nak or termination.
    pub elapsed: Duration,
}

/// A function told about each delivery ([`AdapterConfig::observer`]). It
/// runs on the delivery's task: keep it short.
#[derive(Clone)]
pub struct Observer(Arc<dyn Fn(&Handled) + Send + Sync>);

impl Observer {
    /// An observer that calls `f`.
    pub fn new(f: impl Fn(&Handled) + Send + Sync + 'static) -> Self {
        Observer(Arc::new(f))
    }
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Observer(..)")
    }
}

/// What a blocking handler ([`JetStreamAdapter::run_blocking`]) gets for
/// one delivery.
#[derive(Debug, Clone)]
pub struct Incoming {
    /// The message id the delivery is keyed by.
    pub id: String,
    /// The message: subject, headers and payload.
    pub message: async_nats::Message,
    /// How many times JetStream has delivered it, this time included
    /// (0 when the reply subject could not be read).
    pub delivered: u64,
}

/// What a handler ([`JetStreamAdapter::run`]) gets for one delivery.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The message id the delivery is keyed by.
    pub id: String,
    /// The message: subject, headers and payload.
    pub message: async_nats::Message,
    /// How many times JetStream has delivered it, this time included
    /// (0 when the reply subject could not be read).
    pub delivered: u64,
    /// The engine's ticket for this execution (its attempt number, its
    /// fencing token).
    pub ticket: Ticket,
}

/// Why the adapter could not start or go on.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    /// The configuration cannot work; the message says why.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// JetStream refused or failed a request the adapter needs (the pull
    /// stream, the stream's info), or the consumer was deleted.
    #[error("JetStream failed to {what}: {source}")]
    JetStream {
        /// What the adapter was doing.
        what: &'static str,
        /// The client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The pull stream ended: the connection was closed.
    #[error("the pull stream ended (the connection is closed)")]
    StreamEnded,
}

impl NatsError {
    fn jetstream(
        what: &'static str,
    ) -> impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> NatsError {
        move |source| NatsError::JetStream { what, source }
    }
}

/// What one [`JetStreamAdapter::run`] did, counted per delivery.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    /// Deliveries taken from JetStream.
    pub deliveries: u64,
    /// Of those, redeliveries (JetStream's delivery count above 1).
    pub redeliveries: u64,
    /// Deliveries that ran the handler to success, acked.
    pub executed: u64,
    /// Deliveries of messages that had already taken effect, acked.
    pub duplicates: u64,
    /// Deliveries that found the message in progress elsewhere, nakked
    /// with the engine's delay.
    pub in_progress: u64,
    /// Deliveries nakked after a retryable failure or a lost lease.
    pub retried: u64,
    /// Deliveries published to the dead-letter subject and terminated.
    pub dead_lettered: u64,
    /// Deliveries nakked because the store did not answer.
    pub store_errors: u64,
    /// Acks, naks, progress notes and dead-letter publishes that the
    /// client or the server did not take (JetStream redelivers such a
    /// message after `ack_wait`; idem answers it then).
    pub broker_errors: u64,
}

#[derive(Default)]
struct Counters {
    deliveries: AtomicU64,
    redeliveries: AtomicU64,
    executed: AtomicU64,
    duplicates: AtomicU64,
    in_progress: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    store_errors: AtomicU64,
    broker_errors: AtomicU64,
}

impl Counters {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn report(&self) -> Report {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Report {
            deliveries: get(&self.deliveries),
            redeliveries: get(&self.redeliveries),
            executed: get(&self.executed),
            duplicates: get(&self.duplicates),
            in_progress: get(&self.in_progress),
            retried: get(&self.retried),
            dead_lettered: get(&self.dead_lettered),
            store_errors: get(&self.store_errors),
            broker_errors: get(&self.broker_errors),
        }
    }
}

/// A JetStream pull consumer run through idem: each message's handler
/// takes effect once per id, and each delivery is acked, nakked with a
/// delay, or dead-lettered as the [`Consumer`] says.
#[derive(Clone)]
pub struct JetStreamAdapter {
    inner: Arc<Inner>,
}

struct Inner {
    context: Context,
    pull: PullConsumer,
    consumer: Consumer,
    config: AdapterConfig,
}

impl std::fmt::Debug for JetStreamAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let info = self.inner.pull.cached_info();
        f.debug_struct("JetStreamAdapter")
            .field("stream", &info.stream_name)
            .field("consumer", &info.name)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl JetStreamAdapter {
    /// An adapter that pulls from `pull` (a consumer with explicit acks),
    /// decides with `consumer`, and publishes dead letters through
    /// `context`.
    ///
    /// JetStream's `max_deliver` counts naks too: leave it unlimited (-1)
    /// or well above the policy's `max_attempts`, or JetStream gives up
    /// on a message before idem dead-letters it.
    pub fn new(
        context: Context,
        pull: PullConsumer,
        consumer: Consumer,
        config: AdapterConfig,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                context,
                pull,
                consumer,
                config,
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &AdapterConfig {
        &self.inner.config
    }

    /// The idem consumer.
    pub fn consumer(&self) -> &Consumer {
        &self.inner.consumer
    }

    /// Pulls and handles messages until `shutdown` completes, then waits
    /// for the handlers in flight to finish and carry out their verdicts,
    /// and reports what it did. Messages pulled but not started when
    /// `shutdown` completes are redelivered by JetStream after `ack_wait`.
    ///
    /// `handler` runs at most once per message id to success (a retryable
    /// failure may run it again, up to the policy's `max_attempts`).
    ///
    /// # Errors
    ///
    /// [`NatsError::Config`] when the consumer's ack policy is not explicit,
    /// or the dead-letter subject is empty, holds a wildcard or would be
    /// consumed by this consumer; [`NatsError::JetStream`] when the stream's
    /// info or the pull stream cannot be had, or the consumer was deleted;
    /// [`NatsError::StreamEnded`] when the connection closed.
    pub async fn run<H, Fut, T>(
        &self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, NatsError>
    where
        H: Fn(Delivery) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T, HandlerError>> + Send + 'static,
        T: Into<Success> + Send + 'static,
    {
        self.consume(AsyncHandler(handler), shutdown).await
    }

    /// Like [`JetStreamAdapter::run`], for a blocking handler that drives
    /// the engine itself on a blocking thread ([`Consumer::handle_blocking`]):
    /// typically a store's `run_in_transaction`, so that the message's
    /// business write and its transition to succeeded commit together.
    /// The handler gets the delivery, the engine, the engine request for
    /// the message.
    ///
    /// # Errors
    ///
    /// As [`JetStreamAdapter::run`].
    pub async fn run_blocking<H>(
        &self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, NatsError>
    where
        H: Fn(Incoming, &Engine, &BeginRequest) -> Result<RunOutcome, EngineError>
            + Send
            + Sync
            + 'static,
    {
        self.consume(BlockingHandler(Arc::new(handler)), shutdown)
            .await
    }

    /// Like [`JetStreamAdapter::run_blocking`], with the deliveries in
    /// flight handled together: the messages waiting while a batch runs
    /// make up the next one (up to `max_batch`, and at most
    /// [`AdapterConfig::max_in_flight`] are ever pulled), and `handler` runs
    /// each batch on a blocking thread ([`Batcher`]), typically with a
    /// store's `run_batch_in_one_transaction` so that the batch costs one
    /// commit. A lone message runs at once. `handler` gets the batch's
    /// messages and the matching engine requests, and answers one slot per
    /// request. The batcher is this adapter's own; several adapters of one
    /// process on SQLite do better sharing one
    /// ([`JetStreamAdapter::run_batched`]).
    ///
    /// # Errors
    ///
    /// As [`JetStreamAdapter::run`].
    pub async fn run_batch_blocking<H>(
        &self,
        max_batch: usize,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, NatsError>
    where
        H: Fn(
                Vec<Incoming>,
                &Engine,
                &[BeginRequest],
            ) -> Result<Vec<Result<RunOutcome, EngineError>>, EngineError>
            + Send
            + Sync
            + 'static,
    {
        let max_batch = max_batch.clamp(1, self.inner.config.max_in_flight.max(1));
        let batcher = Batcher::new(&self.inner.consumer, max_batch, handler);
        self.run_batched(batcher, shutdown).await
    }

    /// Like [`JetStreamAdapter::run_batch_blocking`], with a [`Batcher`]
    /// that several adapters of this process share: the deliveries in
    /// flight in all of them make up one batch, so four adapters with 8
    /// messages in flight each commit batches of up to 32 (the batcher's
    /// `max_batch` allowing), one batch at a time, instead of four batches
    /// of up to 8 that queue for SQLite's one writer. Use it when the
    /// store has one writer (SQLite); with PostgreSQL, a batcher per
    /// adapter lets batches of different keys commit side by side.
    ///
    /// `batcher` MUST be built on a [`Consumer`] with this adapter's
    /// configuration (its biz type and policy): it makes the engine
    /// requests and the verdicts.
    ///
    /// # Errors
    ///
    /// [`NatsError::Config`] when `batcher`'s consumer has another biz
    /// type or policy than this adapter's, before anything is pulled;
    /// otherwise as [`JetStreamAdapter::run`].
    pub async fn run_batched(
        &self,
        batcher: Batcher<Incoming>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, NatsError> {
        let (ours, theirs) = (self.inner.consumer.config(), batcher.consumer().config());
        if ours.biz_type != theirs.biz_type || ours.policy != theirs.policy {
            return Err(NatsError::Config(format!(
                "the batcher's consumer (biz type {:?}) is not configured as this adapter's \
                 (biz type {:?}): its messages would be keyed and answered under other rules; \
                 build the batcher on the adapter's consumer",
                theirs.biz_type, ours.biz_type
            )));
        }
        self.consume(BatchingHandler(batcher), shutdown).await
    }

    /// The consume loop: pulls, hands each delivery to a task of its own
    /// that asks `decide` for its verdict and carries it out.
    async fn consume<D: Decide>(
        &self,
        decide: D,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, NatsError> {
        self.check_setup().await?;
        let max_deliver = self.inner.pull.cached_info().config.max_deliver;
        let max_attempts = self.inner.consumer.config().policy.max_attempts;
        if max_deliver > 0 && max_attempts.is_none_or(|max| max_deliver <= i64::from(max)) {
            tracing::warn!(
                max_deliver,
                max_attempts,
                "JetStream's max_deliver (naks count too) is not above the policy's max_attempts, \
                 or the policy has none: JetStream may give up on a message before idem \
                 dead-letters it"
            );
        }
        let max_in_flight = self.inner.config.max_in_flight.max(1);
        let ack_wait = self.inner.pull.cached_info().config.ack_wait;
        let progress_every = (self.inner.config.progress && !ack_wait.is_zero())
            .then(|| (ack_wait / 2).max(Duration::from_millis(1)));
        let mut messages = self
            .inner
            .pull
            .stream()
            .max_messages_per_batch(max_in_flight)
            .heartbeat(PULL_HEARTBEAT)
            .messages()
            .await
            .map_err(|e| NatsError::jetstream("start the pull stream")(Box::new(e)))?;

        let decide = Arc::new(decide);
        let counters = Arc::new(Counters::default());
        let mut in_flight = JoinSet::new();
        let mut shutdown = pin!(shutdown);
        let outcome = loop {
            tokio::select! {
                () = &mut shutdown => break Ok(()),
                Some(done) = in_flight.join_next(), if !in_flight.is_empty() => {
                    if let Err(e) = done {
                        tracing::error!(error = %e, "a delivery's task panicked; JetStream redelivers the message after ack_wait");
                    }
                }
                next = messages.next(), if in_flight.len() < max_in_flight => match next {
                    Some(Ok(message)) => {
                        let task = Task {
                            inner: self.inner.clone(),
                            counters: counters.clone(),
                            progress_every,
                        };
                        let decide = decide.clone();
                        in_flight.spawn(async move { task.deliver(message, &*decide).await });
                    }
                    Some(Err(e)) => match e.kind() {
                        MessagesErrorKind::ConsumerDeleted
                        | MessagesErrorKind::PushBasedConsumer
                        | MessagesErrorKind::RequestLimitExceeded => {
                            break Err(NatsError::jetstream("pull messages")(Box::new(e)));
                        }
                        _ => {
                            Counters::bump(&counters.broker_errors);
                            tracing::warn!(error = %e, "pulling messages failed; pulling again");
                        }
                    },
                    None => break Err(NatsError::StreamEnded),
                },
            }
        };
        drop(messages);
        while let Some(done) = in_flight.join_next().await {
            if let Err(e) = done {
                tracing::error!(error = %e, "a delivery's task panicked; JetStream redelivers the message after ack_wait");
            }
        }
        outcome.map(|()| counters.report())
    }

    /// Refuses a consumer without explicit acks (a nak or a termination
    /// would mean nothing, and with `AckPolicy::All` one ack would settle
    /// messages still running), and a dead-letter subject that is not a
    /// plain subject or that this consumer would pull again (a dead letter
    /// without an id would be dead-lettered again, forever).
    async fn check_setup(&self) -> Result<(), NatsError> {
        let info = self.inner.pull.cached_info();
        if info.config.ack_policy != AckPolicy::Explicit {
            return Err(NatsError::Config(format!(
                "the consumer {:?} has ack policy {:?}: the adapter acks, naks and terminates \
                 each message itself, which needs AckPolicy::Explicit",
                info.name, info.config.ack_policy
            )));
        }
        let subject = &self.inner.config.dead_letter_subject;
        if subject.is_empty()
            || subject
                .split('.')
                .any(|t| t.is_empty() || t == "*" || t == ">")
            || subject.contains(char::is_whitespace)
        {
            return Err(NatsError::Config(format!(
                "the dead-letter subject {subject:?} must be a subject without wildcards"
            )));
        }
        let mut filters: Vec<String> = Vec::new();
        if !info.config.filter_subject.is_empty() {
            filters.push(info.config.filter_subject.clone());
        }
        filters.extend(info.config.filter_subjects.iter().cloned());
        if filters.is_empty() {
            let stream = self
                .inner
                .context
                .get_stream(&info.stream_name)
                .await
                .map_err(|e| NatsError::jetstream("read the stream's info")(Box::new(e)))?;
            filters = stream.cached_info().config.subjects.clone();
        }
        if let Some(filter) = filters.iter().find(|f| subject_matches(f, subject)) {
            return Err(NatsError::Config(format!(
                "the dead-letter subject {subject:?} is consumed by the consumer {:?} itself \
                 (through {filter:?}): dead letters would come back to it; give them a subject \
                 of another stream",
                info.name
            )));
        }
        Ok(())
    }
}

/// How a run gets a delivery's verdict from the consumer: through an async
/// handler ([`JetStreamAdapter::run`]), a blocking one
/// ([`JetStreamAdapter::run_blocking`]) or a batch
/// ([`JetStreamAdapter::run_batch_blocking`], [`JetStreamAdapter::run_batched`]).
trait Decide: Send + Sync + 'static {
    fn decide<'a>(
        &'a self,
        consumer: &'a Consumer,
        keyed: Message<'a>,
        incoming: Incoming,
    ) -> impl Future<Output = Result<Verdict, ConsumerError>> + Send + 'a;
}

struct AsyncHandler<H>(H);

impl<H, Fut, T> Decide for AsyncHandler<H>
where
    H: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<T, HandlerError>> + Send + 'static,
    T: Into<Success> + Send + 'static,
{
    async fn decide<'a>(
        &'a self,
        consumer: &'a Consumer,
        keyed: Message<'a>,
        incoming: Incoming,
    ) -> Result<Verdict, ConsumerError> {
        let run = move |ticket| {
            (self.0)(Delivery {
                id: incoming.id,
                message: incoming.message,
                delivered: incoming.delivered,
                ticket,
            })
        };
        consumer.handle(&keyed, run).await
    }
}

struct BlockingHandler<H>(Arc<H>);

impl<H> Decide for BlockingHandler<H>
where
    H: Fn(Incoming, &Engine, &BeginRequest) -> Result<RunOutcome, EngineError>
        + Send
        + Sync
        + 'static,
{
    fn decide<'a>(
        &'a self,
        consumer: &'a Consumer,
        keyed: Message<'a>,
        incoming: Incoming,
    ) -> impl Future<Output = Result<Verdict, ConsumerError>> + Send + 'a {
        let handler = self.0.clone();
        async move {
            let run =
                move |engine: &Engine, request: &BeginRequest| handler(incoming, engine, request);
            consumer.handle_blocking(&keyed, run).await
        }
    }
}

struct BatchingHandler(Batcher<Incoming>);

impl Decide for BatchingHandler {
    async fn decide<'a>(
        &'a self,
        _consumer: &'a Consumer,
        keyed: Message<'a>,
        incoming: Incoming,
    ) -> Result<Verdict, ConsumerError> {
        self.0.handle(&keyed, incoming).await
    }
}

/// Whether the subject `pattern` (with `*` and `>` wildcards) matches
/// `subject`.
fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for p in pattern.split('.') {
        match (p, subject_tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (p, Some(s)) if p == s => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

/// One delivery's work, on a task of its own.
struct Task {
    inner: Arc<Inner>,
    counters: Arc<Counters>,
    progress_every: Option<Duration>,
}

impl Task {
    async fn deliver<D: Decide>(self, message: jetstream::Message, decide: &D) {
        let started = Instant::now();
        Counters::bump(&self.counters.deliveries);
        let delivered = message
            .info()
            .ok()
            .and_then(|i| u64::try_from(i.delivered).ok())
            .unwrap_or(0);
        if delivered > 1 {
            Counters::bump(&self.counters.redeliveries);
        }
        let config = &self.inner.config;
        let id = config.message_id.of(&message.message);
        let verdict = match &id {
            None => Ok(Verdict::DeadLetter(DeadLetterReason::Invalid {
                message: config.message_id.missing(),
            })),
            Some(id) => {
                let keyed = Message {
                    id,
                    scope: &config.scope,
                    body: &message.payload,
                };
                let incoming = Incoming {
                    id: id.clone(),
                    message: message.message.clone(),
                    delivered,
                };
                let verdict = decide.decide(&self.inner.consumer, keyed, incoming);
                self.with_progress(&message, verdict).await
            }
        };
        let carried_out = self
            .carry_out(&message, id.as_deref(), delivered, &verdict)
            .await;
        if let Some(observer) = &config.observer {
            (observer.0)(&Handled {
                id,
                delivered,
                verdict: verdict.ok(),
                carried_out,
                elapsed: started.elapsed(),
            });
        }
    }

    /// Awaits `work`, telling JetStream every half `ack_wait` that the
    /// message is still being worked on.
    async fn with_progress<F: Future>(&self, message: &jetstream::Message, work: F) -> F::Output {
        let Some(every) = self.progress_every else {
            return work.await;
        };
        let mut work = pin!(work);
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                out = &mut work => return out,
                _ = ticks.tick() => {
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        Counters::bump(&self.counters.broker_errors);
                        tracing::warn!(error = %e, "sending work-in-progress failed");
                    }
                }
            }
        }
    }

    async fn carry_out(
        &self,
        message: &jetstream::Message,
        id: Option<&str>,
        delivered: u64,
        verdict: &Result<Verdict, ConsumerError>,
    ) -> bool {
        let c = &self.counters;
        let mut carried_out = true;
        let (kind, what) = match verdict {
            Ok(Verdict::Ack(acked)) => {
                Counters::bump(match acked {
                    Acked::Executed => &c.executed,
                    Acked::Duplicate => &c.duplicates,
                });
                (AckKind::Ack, "ack")
            }
            Ok(Verdict::Retry { after, why }) => {
                Counters::bump(match why {
                    RetryReason::InProgress => &c.in_progress,
                    RetryReason::Failed { .. } | RetryReason::LostOwnership => &c.retried,
                });
                (AckKind::Nak(Some(*after)), "nak")
            }
            Ok(Verdict::DeadLetter(reason)) => {
                match self.dead_letter(message, id, delivered, reason).await {
                    Ok(()) => {
                        Counters::bump(&c.dead_lettered);
                        tracing::warn!(id, reason = %reason, "message dead-lettered");
                        (AckKind::Term, "terminate")
                    }
                    Err(e) => {
                        Counters::bump(&c.broker_errors);
                        tracing::warn!(id, error = %e, "the dead-letter publish failed; the message is retried");
                        carried_out = false;
                        (AckKind::Nak(Some(self.inner.config.error_delay)), "nak")
                    }
                }
            }
            Err(e) => {
                Counters::bump(&c.store_errors);
                tracing::warn!(id, error = %e, "the engine failed; the message is retried");
                (AckKind::Nak(Some(self.inner.config.error_delay)), "nak")
            }
        };
        if let Err(e) = message.ack_with(kind).await {
            Counters::bump(&c.broker_errors);
            tracing::warn!(id, error = %e, "sending the {what} failed; JetStream redelivers after ack_wait");
            carried_out = false;
        }
        carried_out
    }

    /// Publishes `message` to the dead-letter subject with headers naming
    /// why, and awaits the stream's ack.
    async fn dead_letter(
        &self,
        message: &jetstream::Message,
        id: Option<&str>,
        delivered: u64,
        reason: &DeadLetterReason,
    ) -> Result<(), async_nats::Error> {
        let config = &self.inner.config;
        let mut headers = HeaderMap::new();
        // The original headers, less the server directives (`Nats-Msg-Id`,
        // `Nats-Expected-*`, ...) that would apply to the dead-letter stream.
        if let Some(original) = &message.headers {
            for (name, values) in original.iter() {
                let name_str: &str = name.as_ref();
                if name_str
                    .get(..5)
                    .is_some_and(|p| p.eq_ignore_ascii_case("nats-"))
                {
                    continue;
                }
                for value in values {
                    headers.append(name.clone(), value.clone());
                }
            }
        }
        headers.insert(REASON_HEADER, reason.code());
        headers.insert(DETAIL_HEADER, reason.to_string());
        if let Some(id) = id {
            headers.insert(MESSAGE_ID_HEADER, id);
        }
        headers.insert(SCOPE_HEADER, config.scope.as_str());
        headers.insert(ORIGINAL_SUBJECT_HEADER, message.subject.as_str());
        headers.insert(DELIVERED_HEADER, delivered.to_string());
        let mut publish = PublishMessage::build()
            .payload(message.payload.clone())
            .headers(headers);
        if let Ok(info) = message.info() {
            publish = publish
                .header(ORIGINAL_STREAM_HEADER, info.stream)
                .header(ORIGINAL_SEQUENCE_HEADER, info.stream_sequence.to_string())
                .message_id(format!(
                    "{DEAD_LETTER_ID_PREFIX}.{}.{}",
                    info.stream, info.stream_sequence
                ));
        }
        let ack: PublishAckFuture = self
            .inner
            .context
            .send_publish(config.dead_letter_subject.clone(), publish)
            .await?;
        ack.await?;
        Ok(())
    }
}

/// Publishes `payload` to `subject` with `id` as its `Nats-Msg-Id`, and
/// awaits the stream's ack: within the stream's `duplicate_window`, a
/// producer's retry of the same id is dropped by the server
/// ([`PublishAck::duplicate`](async_nats::jetstream::publish::PublishAck::duplicate)),
/// and after it the adapter's idem key catches the redelivery.
///
/// # Errors
///
/// The client's error when the publish was not acked (no stream captures
/// `subject`, a timeout).
pub async fn publish_with_id(
    context: &Context,
    subject: impl Into<String>,
    id: &str,
    payload: impl Into<Bytes>,
) -> Result<async_nats::jetstream::publish::PublishAck, async_nats::Error> {
    let publish = PublishMessage::build()
        .payload(payload.into())
        .message_id(id);
    Ok(context.send_publish(subject.into(), publish).await?.await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subject_patterns_match_as_nats_does() {
        assert!(subject_matches("orders.>", "orders.dlq"));
        assert!(subject_matches("orders.>", "orders.a.b"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(subject_matches("orders.*", "orders.dlq"));
        assert!(!subject_matches("orders.*", "orders.a.dlq"));
        assert!(subject_matches("orders.dlq", "orders.dlq"));
        assert!(!subject_matches("orders.created", "orders.dlq"));
        assert!(!subject_matches("orders.*.x", "orders.a"));
        assert!(subject_matches(">", "dlq"));
    }

    #[test]
    fn a_message_id_comes_from_its_header_or_the_callers_function() {
        let mut headers = HeaderMap::new();
        headers.insert("Idem-Key", "order-7");
        let message = async_nats::Message {
            subject: "orders".into(),
            reply: None,
            payload: Bytes::from_static(b"{\"order\":\"o-9\"}"),
            headers: Some(headers),
            status: None,
            description: None,
            length: 0,
        };
        assert_eq!(MessageId::nats_msg_id().of(&message), None);
        assert_eq!(
            MessageId::header("Idem-Key").unwrap().of(&message),
            Some("order-7".to_owned())
        );
        let from_body = MessageId::with(|m| {
            std::str::from_utf8(&m.payload)
                .ok()?
                .split('"')
                .nth(3)
                .map(str::to_owned)
        });
        assert_eq!(from_body.of(&message), Some("o-9".to_owned()));
        assert!(matches!(
            MessageId::header("bad:name"),
            Err(NatsError::Config(_))
        ));
    }
}
