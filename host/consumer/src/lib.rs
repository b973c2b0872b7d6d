//! idem for message consumers: each message takes effect once, however
//! often the broker delivers it.
//!
//! Brokers deliver at least once: a consumer that died before its ack, an
//! ack that was lost, a nack with requeue or an ack timeout all bring a
//! message back, sometimes to another consumer while the first still works
//! on it. A [`Consumer`] keys each message by its id (or a natural key
//! derived from its body) within a scope (the queue, the subscription or
//! the tenant), runs the handler only when the engine says so, stores its
//! outcome, and answers with a [`Verdict`] that a broker adapter carries
//! out:
//!
//! | the engine's answer | verdict |
//! |---|---|
//! | executed, succeeded | [`Verdict::Ack`] ([`Acked::Executed`]) |
//! | already succeeded (a redelivery) | [`Verdict::Ack`] ([`Acked::Duplicate`]) |
//! | in progress elsewhere | [`Verdict::Retry`] after the engine's `retry_after_ms` |
//! | a retryable failure | [`Verdict::Retry`] with exponential backoff; the policy's `max_attempts`-th is stored as final by the engine and dead-lettered |
//! | a final failure, now or replayed | [`Verdict::DeadLetter`] ([`DeadLetterReason::Failed`]) |
//! | the same id with another body | [`Verdict::DeadLetter`] ([`DeadLetterReason::Conflict`]); the first effect stays |
//! | outcome unknown | [`Verdict::DeadLetter`] ([`DeadLetterReason::OutcomeUnknown`]): parked for an operator, never run again blindly |
//! | an id that breaks the key rules | [`Verdict::DeadLetter`] ([`DeadLetterReason::Invalid`]) |
//! | the store did not answer | [`ConsumerError`]: the adapter retries the delivery later; it never acks it |
//!
//! The handler's business write and the transition to succeeded can commit
//! together with [`Consumer::handle_blocking`] and a store's
//! `run_in_transaction` (SQLite, PostgreSQL); with `run_in_one_transaction`
//! the claim commits with them, so a consumer killed mid-message leaves
//! nothing for the redelivery to wait out.

#![warn(missing_docs)]

use std::future::Future;
use std::time::Duration;

use idem_engine::api::{BeginRequest, Decision, Disposition, Extension, Policy, Ticket};
use idem_engine::engine::{ActionResult, Engine, Error, RunOutcome};
use idem_engine::types::{Failure, RecordKey, Status, Success};

/// The `max_attempts` of [`ConsumerConfig::new`]'s policy: 5. A transient failure
/// (a dependency restarting, a lock timeout) clears within a few tries;
/// a message that fails five times with growing delays (1, 2, 4, 8 s) is
/// poison, and retrying it forever only delays the messages behind it.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;

/// The default [`ConsumerConfig::first_retry_delay`]: 1 s, long enough
/// for a restarted dependency to come back, short enough that one hiccup
/// costs a message about a second.
pub const DEFAULT_FIRST_RETRY_DELAY: Duration = Duration::from_secs(1);

/// The default [`ConsumerConfig::max_retry_delay`]: 5 minutes. Brokers
/// hold a delayed message in memory or in a retry queue; longer delays
/// belong to an operator, not to a backoff.
pub const DEFAULT_MAX_RETRY_DELAY: Duration = Duration::from_secs(300);

/// The shortest delay of a [`Verdict::Retry`]: a duplicate that arrives
/// while the first delivery runs is retried no sooner, so two consumers do
/// not spin on one message.
pub const MIN_RETRY_DELAY: Duration = Duration::from_millis(50);

/// How a consumer keys, runs and answers messages of one biz type.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// The biz type of the messages, e.g. `inventory.reserve`.
    pub biz_type: String,
    /// The engine policy of the biz type. Its lease bounds how long a
    /// handler may run without the consumer extending it; the consumer
    /// extends it every half lease while the handler runs. Its
    /// `max_attempts` is how many times a message may run before the
    /// engine stores a retryable failure as final and the message is
    /// dead-lettered ([`DEFAULT_MAX_ATTEMPTS`] from [`ConsumerConfig::new`];
    /// `None` retries for ever).
    pub policy: Policy,
    /// The delay before the first retry of a retryable failure; each
    /// further attempt doubles it. Default [`DEFAULT_FIRST_RETRY_DELAY`].
    pub first_retry_delay: Duration,
    /// The longest retry delay. Default [`DEFAULT_MAX_RETRY_DELAY`].
    pub max_retry_delay: Duration,
}

impl ConsumerConfig {
    /// A configuration for `biz_type` with the engine's default policy,
    /// except that a message runs at most [`DEFAULT_MAX_ATTEMPTS`] times.
    /// Message bodies are fingerprinted as raw bytes.
    pub fn new(biz_type: impl Into<String>) -> Self {
        Self {
            biz_type: biz_type.into(),
            policy: Policy {
                max_attempts: Some(DEFAULT_MAX_ATTEMPTS),
                ..Policy::default()
            },
            first_retry_delay: DEFAULT_FIRST_RETRY_DELAY,
            max_retry_delay: DEFAULT_MAX_RETRY_DELAY,
        }
    }

    /// The delay before attempt `attempt + 1`, after attempt `attempt`
    /// failed retryably.
    pub fn retry_delay(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(31);
        self.first_retry_delay
            .saturating_mul(1u32 << doublings)
            .min(self.max_retry_delay)
            .max(MIN_RETRY_DELAY)
    }
}

/// One delivery, as the consumer keys it.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    /// The message's id: the broker's message id, or a natural key derived
    /// from the body (an order number). Its rules are the policy's key
    /// format.
    pub id: &'a str,
    /// Whose id space it is: the queue, the subscription or the tenant.
    pub scope: &'a str,
    /// The body, fingerprinted as raw bytes: the same id with another body
    /// is a conflict.
    pub body: &'a [u8],
}

/// Why a handler failed, and what that means for the message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct HandlerError {
    /// What the failure means.
    pub disposition: Disposition,
    /// A short machine-readable code, e.g. `card-declined`.
    pub code: String,
    /// A sentence for humans.
    pub message: String,
}

impl HandlerError {
    /// A failure that took no effect: the message is retried later.
    pub fn retryable(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Disposition::Retryable, code, message)
    }

    /// A failure for good: the message is dead-lettered, and so is every
    /// redelivery of it.
    pub fn final_failure(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Disposition::Final, code, message)
    }

    /// The handler cannot tell whether its effect happened (a timeout
    /// after the write was sent): the message is parked for an operator.
    pub fn outcome_unknown(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Disposition::OutcomeUnknown, code, message)
    }

    fn new(disposition: Disposition, code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            disposition,
            code: code.into(),
            message: message.into(),
        }
    }
}

/// What the adapter does with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Acknowledge: the message took effect, now or before.
    Ack(Acked),
    /// Deliver it again after `after` (a nack with a delay): it is in
    /// progress elsewhere, or failed retryably.
    Retry {
        /// How long the broker should wait.
        after: Duration,
        /// Why.
        why: RetryReason,
    },
    /// Move it to the dead-letter queue; never retry it as is.
    DeadLetter(DeadLetterReason),
}

/// Why a message is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acked {
    /// This delivery ran the handler, and its success is stored.
    Executed,
    /// A redelivery of a message that already took effect.
    Duplicate,
}

/// Why a message is retried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetryReason {
    /// Another delivery of it runs now (the broker redelivered it after an
    /// ack timeout, or to a second consumer).
    InProgress,
    /// The handler failed retryably on this attempt.
    Failed {
        /// The failure's code.
        code: String,
        /// Which attempt failed (1 for the first).
        attempt: u32,
    },
    /// This delivery ran the handler, but its lease ended and another
    /// owner took the message over; the redelivery finds what they stored.
    LostOwnership,
}

/// Why a message is dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadLetterReason {
    /// A final failure: the handler's, or a retryable one that the engine
    /// stored as final (the policy's `max_attempts` or `failure_mode`); a
    /// redelivery replays it.
    Failed {
        /// The failure's code.
        code: String,
    },
    /// The id was used before with another body; the first effect stays.
    Conflict,
    /// An earlier delivery may have taken effect and nobody knows: an
    /// operator (or a reconcile with a lookup) decides; running it again
    /// could do it twice.
    OutcomeUnknown {
        /// The code reported with the unknown outcome.
        code: String,
    },
    /// The message breaks a key rule (its id is empty or too long); the
    /// message names the field and the rule.
    Invalid {
        /// What is wrong.
        message: String,
    },
}

impl DeadLetterReason {
    /// A short code for a dead-letter header: `failed`, `conflict`,
    /// `outcome-unknown` or `invalid`.
    pub fn code(&self) -> &'static str {
        match self {
            DeadLetterReason::Failed { .. } => "failed",
            DeadLetterReason::Conflict => "conflict",
            DeadLetterReason::OutcomeUnknown { .. } => "outcome-unknown",
            DeadLetterReason::Invalid { .. } => "invalid",
        }
    }
}

impl std::fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeadLetterReason::Failed { code } => write!(f, "failed for good: {code}"),
            DeadLetterReason::Conflict => {
                f.write_str("the message id was used before with another body")
            }
            DeadLetterReason::OutcomeUnknown { code } => {
                write!(f, "an earlier delivery's outcome is unknown ({code})")
            }
            DeadLetterReason::Invalid { message } => f.write_str(message),
        }
    }
}

/// The engine could not decide or store an outcome (most often the store
/// did not answer). The adapter must neither ack nor dead-letter the
/// delivery: it retries it later.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the engine failed: {0}")]
pub struct ConsumerError(#[from] pub Error);

/// Runs each message's handler at most once per id, and says what to do
/// with each delivery. Cheap to clone.
#[derive(Clone)]
pub struct Consumer {
    engine: Engine,
    config: ConsumerConfig,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Consumer {
    /// A consumer of `config.biz_type` on `engine`.
    pub fn new(engine: Engine, config: ConsumerConfig) -> Self {
        Self { engine, config }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The configuration.
    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    /// The engine request for `message`.
    pub fn request(&self, message: &Message<'_>) -> BeginRequest {
        BeginRequest::raw(
            RecordKey {
                scope: message.scope.to_owned(),
                biz_type: self.config.biz_type.clone(),
                idem_key: message.id.to_owned(),
            },
            message.body,
            self.config.policy.clone(),
        )
    }

    /// Runs `handler` for `message` if the engine says so, extending the
    /// lease every half lease while it runs, stores its outcome, and says
    /// what to do with the delivery.
    ///
    /// # Errors
    ///
    /// [`ConsumerError`] when the engine could not decide or store: the
    /// delivery must be retried, never acked.
    pub async fn handle<F, Fut, T>(
        &self,
        message: &Message<'_>,
        handler: F,
    ) -> Result<Verdict, ConsumerError>
    where
        F: FnOnce(Ticket) -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
        T: Into<Success>,
    {
        let request = self.request(message);
        let ticket = match self.call(move |e| e.begin(&request)).await? {
            Decision::Execute(ticket) => ticket,
            other => return Ok(self.verdict(RunOutcome::NotExecuted(other))),
        };
        let result = match self
            .run_with_heartbeat(&ticket, handler(ticket.clone()))
            .await
        {
            Ok(done) => ActionResult::Succeeded(done.into()),
            Err(e) => ActionResult::Failed(
                Failure {
                    code: e.code,
                    message: e.message,
                    response: None,
                },
                e.disposition,
            ),
        };
        let (t, p, r) = (ticket.clone(), self.config.policy.clone(), result.clone());
        let completion = self
            .call(move |e| match &r {
                ActionResult::Succeeded(s) => e.complete(&t, &p, s),
                ActionResult::Failed(f, d) => e.fail(&t, &p, f, *d),
            })
            .await?;
        Ok(self.verdict(RunOutcome::settled(ticket, result, completion)))
    }

    /// Like [`Consumer::handle`], for a blocking `run` that drives the
    /// engine itself on a blocking thread, typically a store's
    /// `run_in_transaction` so that the business write and the transition
    /// to succeeded commit together. `run` gets the engine and the request.
    ///
    /// # Errors
    ///
    /// As [`Consumer::handle`].
    pub async fn handle_blocking<F>(
        &self,
        message: &Message<'_>,
        run: F,
    ) -> Result<Verdict, ConsumerError>
    where
        F: FnOnce(&Engine, &BeginRequest) -> Result<RunOutcome, Error> + Send + 'static,
    {
        let request = self.request(message);
        let engine = self.engine.clone();
        let outcome = tokio::task::spawn_blocking(move || run(&engine, &request))
            .await
            .map_err(|e| Error::Trap(format!("the handler did not finish: {e}")))??;
        Ok(self.verdict(outcome))
    }

    /// Like [`Consumer::handle_blocking`], for several deliveries at once:
    /// `run` drives the engine for all of them on one blocking thread,
    /// typically with a store's `run_batch_in_one_transaction`, so that
    /// the batch's claims, business writes and outcomes commit together,
    /// once. `run` gets the requests in the order of `messages` and
    /// answers one slot per request, in that order.
    ///
    /// # Errors
    ///
    /// [`ConsumerError`] when the batch as a whole could not be run or
    /// committed: every delivery must be retried, never acked. A slot's
    /// own error means the same for that delivery alone.
    pub async fn handle_batch_blocking<F>(
        &self,
        messages: &[Message<'_>],
        run: F,
    ) -> Result<Vec<Result<Verdict, ConsumerError>>, ConsumerError>
    where
        F: FnOnce(&Engine, &[BeginRequest]) -> Result<Vec<Result<RunOutcome, Error>>, Error>
            + Send
            + 'static,
    {
        let requests: Vec<BeginRequest> = messages.iter().map(|m| self.request(m)).collect();
        let expected = requests.len();
        let engine = self.engine.clone();
        let outcomes = tokio::task::spawn_blocking(move || run(&engine, &requests))
            .await
            .map_err(|e| Error::Trap(format!("the handler did not finish: {e}")))??;
        if outcomes.len() != expected {
            return Err(Error::Corrupt(format!(
                "a batch of {expected} deliveries was answered with {} outcomes",
                outcomes.len()
            ))
            .into());
        }
        Ok(outcomes
            .into_iter()
            .map(|outcome| outcome.map(|o| self.verdict(o)).map_err(ConsumerError))
            .collect())
    }

    /// The verdict for what the engine did with a delivery. An executed
    /// delivery's verdict follows the status the engine stored, not the
    /// disposition the handler gave: the engine makes a retryable failure
    /// final at the policy's `max_attempts` (or under `always-final`).
    pub fn verdict(&self, outcome: RunOutcome) -> Verdict {
        match outcome {
            RunOutcome::Executed {
                ticket,
                result,
                stored,
            } => {
                let code = match result {
                    ActionResult::Succeeded(_) => return Verdict::Ack(Acked::Executed),
                    ActionResult::Failed(f, _) => f.code,
                };
                match stored {
                    Status::Released => Verdict::Retry {
                        after: self.config.retry_delay(ticket.attempt),
                        why: RetryReason::Failed {
                            code,
                            attempt: ticket.attempt,
                        },
                    },
                    Status::Failed => Verdict::DeadLetter(DeadLetterReason::Failed { code }),
                    Status::OutcomeUnknown => {
                        Verdict::DeadLetter(DeadLetterReason::OutcomeUnknown { code })
                    }
                    // A failure the engine says it stored as succeeded or
                    // processing: it cannot happen, and the redelivery asks
                    // the engine again rather than dropping the message.
                    Status::Succeeded | Status::Processing => {
                        tracing::error!(
                            key = %ticket.key.idem_key,
                            ?stored,
                            "the engine stored a failure with an impossible status; the delivery is retried"
                        );
                        Verdict::Retry {
                            after: MIN_RETRY_DELAY,
                            why: RetryReason::LostOwnership,
                        }
                    }
                }
            }
            RunOutcome::LostOwnership { .. } => Verdict::Retry {
                after: MIN_RETRY_DELAY,
                why: RetryReason::LostOwnership,
            },
            RunOutcome::NotExecuted(decision) => match decision {
                // Unreachable from `handle`; a `run` that returns it did not
                // execute, so the redelivery asks again.
                Decision::Execute(_) => Verdict::Retry {
                    after: MIN_RETRY_DELAY,
                    why: RetryReason::LostOwnership,
                },
                Decision::Replay(_) => Verdict::Ack(Acked::Duplicate),
                Decision::InProgress(busy) => Verdict::Retry {
                    after: Duration::from_millis(busy.retry_after_ms).max(MIN_RETRY_DELAY),
                    why: RetryReason::InProgress,
                },
                Decision::Mismatch(_) => Verdict::DeadLetter(DeadLetterReason::Conflict),
                Decision::Failed(f) => {
                    Verdict::DeadLetter(DeadLetterReason::Failed { code: f.code })
                }
                Decision::OutcomeUnknown(u) => {
                    Verdict::DeadLetter(DeadLetterReason::OutcomeUnknown {
                        code: u.failure.map_or_else(|| "unknown".to_owned(), |f| f.code),
                    })
                }
                Decision::Invalid(i) => {
                    Verdict::DeadLetter(DeadLetterReason::Invalid { message: i.message })
                }
            },
        }
    }

    /// Runs `handler`, extending `ticket`'s lease every half lease.
    async fn run_with_heartbeat<Fut: Future>(&self, ticket: &Ticket, handler: Fut) -> Fut::Output {
        let half_lease = Duration::from_millis((self.config.policy.lease_ms / 2).max(1));
        let mut handler = std::pin::pin!(handler);
        loop {
            tokio::select! {
                out = &mut handler => return out,
                () = tokio::time::sleep(half_lease) => {
                    let (t, p) = (ticket.clone(), self.config.policy.clone());
                    match self.call(move |e| e.extend(&t, &p)).await {
                        Ok(Extension::Extended(_)) => {}
                        Ok(Extension::LostOwnership) => tracing::warn!(
                            key = %ticket.key.idem_key,
                            "the handler outlived its lease and another delivery took the message over; its outcome will not be stored"
                        ),
                        Err(e) => tracing::warn!(error = %e, "extending the lease failed; the handler goes on"),
                    }
                }
            }
        }
    }

    /// Runs an engine call on this thread when the engine answers from
    /// memory or a local file, else on the blocking pool.
    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Engine) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        if !self.engine.blocks_on_io() {
            return f(&self.engine);
        }
        let engine = self.engine.clone();
        tokio::task::spawn_blocking(move || f(&engine))
            .await
            .map_err(|e| Error::Trap(format!("the engine call did not finish: {e}")))?
    }
}

mod batcher;
pub use batcher::Batcher;

#[cfg(test)]
mod tests;
