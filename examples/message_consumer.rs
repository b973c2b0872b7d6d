//! A queue consumer that reserves inventory once per message, however often
//! the broker delivers it.
//!
//! Brokers deliver at least once: a lost ack, a consumer restart or an
//! expired visibility timeout all bring a message back. The key is the
//! message id (`idem_key`), scoped to the queue name, biz type
//! `inventory.reserve`; the fingerprint covers the payload. The consumer
//! drives the engine by hand (`begin`, then `complete` or `fail` with the
//! ticket) and answers the broker per delivery:
//!
//! - executed: the reservation was made, ack;
//! - skipped as duplicate: already done, ack without doing it again;
//! - requeued: another worker is still processing the message (in-progress),
//!   or the handler failed retryably; nack, redeliver later;
//! - conflict: the message id was seen with another payload; dead-letter it.
//!
//! The simulated broker delivers a redelivery, a redelivery that arrives
//! while the first delivery is still being processed, a poison message
//! whose first attempt fails retryably, and a conflicting duplicate. Time
//! comes from a manual clock: a requeued message becomes visible again when
//! the clock reaches its delay, without sleeping.
//!
//! Run with `cargo run --example message_consumer`.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::path::Path;

use anyhow::{Result, anyhow, bail};
use idem::{
    BeginRequest, Completion, Decision, Disposition, Engine, ExpiredLease, Failure, KeyCharset,
    KeyFormat, ManualClock, Policy, RecordKey, SqliteOptions, SqliteStore, StoreError, Success,
    Timestamp,
};

mod common;
use common::TempDb;

/// 2026-01-01T00:00:00Z: the example runs on a manual clock.
const START: u64 = 1_767_225_600_000;

const QUEUE: &str = "inventory-reservations";

/// How long a retryably failed message waits before it is redelivered.
const RETRY_BACKOFF_MS: u64 = 5_000;

/// A message on the queue.
#[derive(Debug, Clone)]
struct Message {
    id: &'static str,
    sku: &'static str,
    qty: u32,
}

impl Message {
    fn to_json(&self) -> String {
        format!(r#"{{"sku":"{}","qty":{}}}"#, self.sku, self.qty)
    }
}

/// One delivery of a message by the broker.
#[derive(Debug, Clone)]
struct Delivery {
    message: Message,
    /// The broker makes the delivery visible at this instant.
    not_before: Timestamp,
    /// Why the broker delivers it (for the printout).
    note: &'static str,
    /// The handler takes so long that the broker redelivers the message to
    /// another worker meanwhile.
    slow: bool,
}

/// What the consumer tells the broker about one delivery.
enum Verdict {
    /// The reservation was made (on this attempt of the key): ack.
    Executed { reservation: String, attempt: u32 },
    /// Already handled: ack without doing it again.
    Duplicate(String),
    /// Not handled now: nack, redeliver after the delay.
    Requeue { after_ms: u64, why: String },
    /// The message id was used with another payload: dead-letter it.
    Conflict(String),
}

fn main() -> Result<()> {
    let db = TempDb::new("message-consumer");
    let store = SqliteStore::open(db.path(), SqliteOptions::default())?;
    // The business table, in the same database file. A transaction dropped
    // without commit() rolls back, so commit the setup explicitly.
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE reservations (
                 id         INTEGER PRIMARY KEY,
                 message_id TEXT NOT NULL,
                 sku        TEXT NOT NULL,
                 qty        INTEGER NOT NULL
             )",
        )
    })??;
    tx.commit()?;

    let clock = ManualClock::new(START);
    let lookup_path = db.path().to_path_buf();
    let engine = Engine::builder()
        .storage(store)
        .clock(clock.clone())
        // Should a worker crash between its reservation and `complete`,
        // the next delivery asks the business table before reserving again.
        .results(move |key: &RecordKey| find_reservation(&lookup_path, key))
        .build()?;
    let consumer = Consumer {
        engine,
        conn: rusqlite::Connection::open(db.path())?,
        fail_once: RefCell::new(vec!["msg-0003"]),
        executions: Cell::new(0),
    };

    let reserve_a1 = Message {
        id: "msg-0001",
        sku: "A1",
        qty: 2,
    };
    let reserve_b7 = Message {
        id: "msg-0002",
        sku: "B7",
        qty: 1,
    };
    let poison = Message {
        id: "msg-0003",
        sku: "C3",
        qty: 4,
    };
    let at = |message: &Message, note, slow| Delivery {
        message: message.clone(),
        not_before: START,
        note,
        slow,
    };
    let mut queue: VecDeque<Delivery> = VecDeque::from([
        at(&reserve_a1, "first delivery", false),
        at(
            &reserve_a1,
            "redelivered: the broker never got our ack",
            false,
        ),
        at(&reserve_b7, "first delivery, with a slow handler", true),
        at(&poison, "first delivery of a poison message", false),
        at(
            &Message {
                qty: 5,
                ..reserve_a1.clone()
            },
            "the same message id with a different payload",
            false,
        ),
    ]);

    let mut seq = 0u32;
    let mut dead_letters = Vec::new();
    while let Some(delivery) = queue.pop_front() {
        // A requeued delivery becomes visible once its delay has passed.
        clock.set(delivery.not_before);
        seq += 1;
        let this_seq = seq;
        announce(this_seq, "worker-a", &delivery);
        let verdict = consumer.handle(&delivery, || {
            if !delivery.slow {
                return Ok(());
            }
            // While worker-a is still working, the broker's visibility
            // timeout runs out and it hands the message to worker-b.
            seq += 1;
            let copy = Delivery {
                note: "redelivered to another worker while worker-a is still processing it",
                slow: false,
                ..delivery.clone()
            };
            announce(seq, "worker-b", &copy);
            let verdict = consumer.handle(&copy, || Ok(()))?;
            settle(seq, copy, verdict, &clock, &mut queue, &mut dead_letters);
            Ok(())
        })?;
        settle(
            this_seq,
            delivery,
            verdict,
            &clock,
            &mut queue,
            &mut dead_letters,
        );
    }

    let mut counts = Vec::new();
    for id in [reserve_a1.id, reserve_b7.id, poison.id] {
        let n: i64 = consumer.conn.query_row(
            "SELECT count(*) FROM reservations WHERE message_id = ?1",
            [id],
            |r| r.get(0),
        )?;
        counts.push((id, n));
    }
    let listed: Vec<String> = counts.iter().map(|(id, n)| format!("{id} {n}")).collect();
    println!(
        "dead-lettered: {}",
        if dead_letters.is_empty() {
            "none".to_owned()
        } else {
            dead_letters.join(", ")
        }
    );
    println!(
        "side effects: {seq} deliveries, the handler ran {} time(s) (one failed before \
         writing anything); reservations per message: {}",
        consumer.executions.get(),
        listed.join(", ")
    );
    if counts.iter().any(|(_, n)| *n != 1) {
        bail!("expected exactly one reservation per message");
    }
    Ok(())
}

struct Consumer {
    engine: Engine,
    /// The consumer's own connection for the business writes.
    conn: rusqlite::Connection,
    /// Message ids whose next attempt fails with a transient error.
    fail_once: RefCell<Vec<&'static str>>,
    /// How many times the handler ran (for the final check).
    executions: Cell<u32>,
}

impl Consumer {
    fn policy() -> Policy {
        Policy {
            // Message ids are tokens.
            key_format: KeyFormat {
                min_length: 1,
                max_length: 128,
                charset: KeyCharset::Token,
            },
            expired_lease: ExpiredLease::Reconcile,
            ..Policy::default()
        }
    }

    /// Handles one delivery; `while_processing` runs after the key is
    /// claimed and before the work is done (the simulation's hook for a
    /// concurrent redelivery).
    fn handle(
        &self,
        delivery: &Delivery,
        while_processing: impl FnOnce() -> Result<()>,
    ) -> Result<Verdict> {
        let message = &delivery.message;
        let key = RecordKey::new(QUEUE, "inventory.reserve", message.id);
        let policy = Self::policy();
        let request = BeginRequest::json(key, message.to_json(), policy.clone());

        let ticket = match self.engine.begin(&request)? {
            Decision::Execute(ticket) => ticket,
            Decision::Replay(r) => {
                return Ok(Verdict::Duplicate(format!(
                    "already reserved as {}",
                    r.result_ref.as_deref().unwrap_or("?")
                )));
            }
            Decision::Failed(f) => {
                return Ok(Verdict::Duplicate(format!(
                    "already failed for good ({})",
                    f.code
                )));
            }
            Decision::InProgress(busy) => {
                return Ok(Verdict::Requeue {
                    after_ms: busy.retry_after_ms,
                    why: "in-progress: another worker is processing this message".into(),
                });
            }
            Decision::OutcomeUnknown(_) => {
                return Ok(Verdict::Requeue {
                    after_ms: policy.lease_ms,
                    why: "an earlier attempt's outcome is being reconciled".into(),
                });
            }
            Decision::Mismatch(m) => {
                return Ok(Verdict::Conflict(format!(
                    "message id {} was already processed with another payload \
                     (stored fingerprint {}…)",
                    message.id, m.stored_prefix
                )));
            }
            Decision::Invalid(i) => return Ok(Verdict::Conflict(i.message)),
        };

        while_processing()?;
        self.executions.set(self.executions.get() + 1);
        match self.reserve(message) {
            Ok(reservation) => {
                match self
                    .engine
                    .complete(&ticket, &policy, &Success::with_ref(&reservation))?
                {
                    Completion::Recorded => Ok(Verdict::Executed {
                        reservation,
                        attempt: ticket.attempt,
                    }),
                    // A newer owner holds the key; its outcome is the one
                    // kept, and the next delivery will see it.
                    Completion::LostOwnership => Ok(Verdict::Requeue {
                        after_ms: policy.retry_after_ms,
                        why: "lost ownership of the message".into(),
                    }),
                }
            }
            Err(e) => {
                // Nothing was written: release the key for the redelivery.
                let failure = Failure {
                    code: "transient".into(),
                    message: e.to_string(),
                    response: None,
                };
                self.engine
                    .fail(&ticket, &policy, &failure, Disposition::Retryable)?;
                Ok(Verdict::Requeue {
                    after_ms: RETRY_BACKOFF_MS,
                    why: format!("handler failed retryably: {e}"),
                })
            }
        }
    }

    /// The business work: one reservation row. Fails, before writing
    /// anything, for a message listed in `fail_once`.
    fn reserve(&self, message: &Message) -> Result<String> {
        let mut faults = self.fail_once.borrow_mut();
        if let Some(at) = faults.iter().position(|id| *id == message.id) {
            faults.remove(at);
            return Err(anyhow!("the warehouse service timed out"));
        }
        self.conn.execute(
            "INSERT INTO reservations (message_id, sku, qty) VALUES (?1, ?2, ?3)",
            rusqlite::params![message.id, message.sku, message.qty],
        )?;
        Ok(format!("RSV-{}", self.conn.last_insert_rowid()))
    }
}

fn announce(seq: u32, worker: &str, d: &Delivery) {
    println!(
        "delivery {seq}: {} {} to {worker} ({})",
        d.message.id,
        d.message.to_json(),
        d.note
    );
}

/// Prints the verdict and does what it says with the delivery.
fn settle(
    seq: u32,
    delivery: Delivery,
    verdict: Verdict,
    clock: &ManualClock,
    queue: &mut VecDeque<Delivery>,
    dead_letters: &mut Vec<String>,
) {
    match verdict {
        Verdict::Executed {
            reservation,
            attempt,
        } => {
            println!(
                "    delivery {seq}: executed (attempt {attempt}): reserved as {reservation} -> ack"
            )
        }
        Verdict::Duplicate(why) => {
            println!("    delivery {seq}: skipped as duplicate ({why}) -> ack")
        }
        Verdict::Requeue { after_ms, why } => {
            println!("    delivery {seq}: requeued ({why}) -> nack, redeliver in {after_ms} ms");
            queue.push_back(Delivery {
                not_before: clock.read().saturating_add(after_ms),
                note: "redelivered after a nack",
                slow: false,
                ..delivery
            });
        }
        Verdict::Conflict(why) => {
            println!("    delivery {seq}: conflict: {why} -> dead-letter queue, ack");
            dead_letters.push(format!(
                "{} {}",
                delivery.message.id,
                delivery.message.to_json()
            ));
        }
    }
}

/// The results lookup for reconciliation: the reservation made for a
/// message, if any. Errors are errors, never "none".
fn find_reservation(path: &Path, key: &RecordKey) -> Result<Option<String>, StoreError> {
    let unavailable = |e: rusqlite::Error| StoreError::Unavailable(e.to_string());
    let conn = rusqlite::Connection::open(path).map_err(unavailable)?;
    match conn.query_row(
        "SELECT 'RSV-' || id FROM reservations WHERE message_id = ?1",
        [&key.idem_key],
        |r| r.get::<_, String>(0),
    ) {
        Ok(reservation) => Ok(Some(reservation)),
        Err(rusqlite::Error::QueryReturnedNoRows) => Ok(None),
        Err(e) => Err(unavailable(e)),
    }
}
