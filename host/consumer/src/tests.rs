//! Every row of the verdict table, through the real engine component on
//! the memory store and a manual clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use idem_engine::ManualClock;
use idem_engine::store::MemoryStore;
use idem_engine::types::Status;

use super::*;

const T0: u64 = 1_767_225_600_000;
const LEASE_MS: u64 = 10_000;

struct World {
    consumer: Consumer,
    store: MemoryStore,
    clock: ManualClock,
    runs: Arc<AtomicU32>,
}

fn world(max_attempts: Option<u32>) -> World {
    let store = MemoryStore::new();
    let clock = ManualClock::new(T0);
    let engine = Engine::builder()
        .storage(store.clone())
        .clock(clock.clone())
        .build()
        .expect("engine");
    let mut config = ConsumerConfig::new("inventory.reserve");
    config.policy.lease_ms = LEASE_MS;
    config.policy.max_attempts = max_attempts;
    World {
        consumer: Consumer::new(engine, config),
        store,
        clock,
        runs: Arc::new(AtomicU32::new(0)),
    }
}

fn msg<'a>(id: &'a str, body: &'a [u8]) -> Message<'a> {
    Message {
        id,
        scope: "orders-queue",
        body,
    }
}

impl World {
    /// Handles `m` with a handler that counts its runs and answers `answer`.
    async fn deliver(
        &self,
        m: Message<'_>,
        answer: Result<&str, HandlerError>,
    ) -> Result<Verdict, ConsumerError> {
        let runs = self.runs.clone();
        self.consumer
            .handle(&m, move |_ticket| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                answer.map(str::to_owned)
            })
            .await
    }

    fn runs(&self) -> u32 {
        self.runs.load(Ordering::SeqCst)
    }

    fn status(&self, id: &str) -> Option<Status> {
        self.store
            .snapshot()
            .into_iter()
            .find(|r| r.key.idem_key == id)
            .map(|r| r.status)
    }
}

#[tokio::test]
async fn a_message_runs_once_and_every_redelivery_is_acked_as_a_duplicate() {
    let w = world(Some(DEFAULT_MAX_ATTEMPTS));
    let m = msg("m-1", b"{\"sku\":\"A1\"}");
    assert_eq!(
        w.deliver(m, Ok("reserved")).await.unwrap(),
        Verdict::Ack(Acked::Executed)
    );
    for _ in 0..3 {
        assert_eq!(
            w.deliver(m, Ok("again")).await.unwrap(),
            Verdict::Ack(Acked::Duplicate)
        );
    }
    assert_eq!(w.runs(), 1);
    assert_eq!(w.status("m-1"), Some(Status::Succeeded));
}

#[tokio::test]
async fn a_retryable_failure_backs_off_then_is_dead_lettered_and_stays_so() {
    let w = world(Some(3));
    let m = msg("poison", b"x");
    let retry = || Err(HandlerError::retryable("stock-db-down", "timeout"));
    for (attempt, delay) in [(1, 1), (2, 2)] {
        assert_eq!(
            w.deliver(m, retry()).await.unwrap(),
            Verdict::Retry {
                after: Duration::from_secs(delay),
                why: RetryReason::Failed {
                    code: "stock-db-down".into(),
                    attempt,
                },
            }
        );
    }
    // The last allowed attempt is stored as final.
    let dead = Verdict::DeadLetter(DeadLetterReason::Failed {
        code: "stock-db-down".into(),
    });
    assert_eq!(w.deliver(m, retry()).await.unwrap(), dead);
    assert_eq!(w.status("poison"), Some(Status::Failed));
    // A redelivery replays the final failure without running.
    assert_eq!(w.deliver(m, Ok("late")).await.unwrap(), dead);
    assert_eq!(w.runs(), 3);
}

#[tokio::test]
async fn without_max_attempts_a_retryable_failure_is_retried_every_time() {
    let w = world(None);
    let m = msg("flaky", b"x");
    for attempt in 1..=8 {
        let verdict = w
            .deliver(m, Err(HandlerError::retryable("stock-db-down", "timeout")))
            .await
            .unwrap();
        assert!(
            matches!(verdict, Verdict::Retry { why: RetryReason::Failed { attempt: a, .. }, .. } if a == attempt),
            "attempt {attempt}: {verdict:?}"
        );
        assert_eq!(w.status("flaky"), Some(Status::Released));
    }
    assert_eq!(
        w.deliver(m, Ok("at last")).await.unwrap(),
        Verdict::Ack(Acked::Executed)
    );
}

/// The verdict follows what the engine stored: under `always-final` a
/// retryable failure is stored as failed, so the delivery is dead-lettered
/// at once instead of being retried into a replayed failure.
#[tokio::test]
async fn under_always_final_a_retryable_failure_is_dead_lettered_at_once() {
    let mut w = world(Some(DEFAULT_MAX_ATTEMPTS));
    let mut config = w.consumer.config().clone();
    config.policy.failure_mode = idem_engine::api::FailureMode::AlwaysFinal;
    w.consumer = Consumer::new(w.consumer.engine().clone(), config);
    let m = msg("m-500", b"x");
    let dead = Verdict::DeadLetter(DeadLetterReason::Failed {
        code: "upstream-500".into(),
    });
    assert_eq!(
        w.deliver(m, Err(HandlerError::retryable("upstream-500", "boom")))
            .await
            .unwrap(),
        dead
    );
    assert_eq!(w.status("m-500"), Some(Status::Failed));
    assert_eq!(w.deliver(m, Ok("late")).await.unwrap(), dead);
    assert_eq!(w.runs(), 1);
}

#[tokio::test]
async fn a_final_failure_is_dead_lettered_at_once_and_replayed_as_final() {
    let w = world(Some(DEFAULT_MAX_ATTEMPTS));
    let m = msg("declined", b"x");
    let dead = Verdict::DeadLetter(DeadLetterReason::Failed {
        code: "card-declined".into(),
    });
    assert_eq!(
        w.deliver(m, Err(HandlerError::final_failure("card-declined", "no")))
            .await
            .unwrap(),
        dead
    );
    assert_eq!(w.deliver(m, Ok("late")).await.unwrap(), dead);
    assert_eq!(w.runs(), 1);
}

#[tokio::test]
async fn the_same_id_with_another_body_is_a_conflict_and_the_first_effect_stays() {
    let w = world(Some(DEFAULT_MAX_ATTEMPTS));
    w.deliver(msg("m-1", b"first"), Ok("r1")).await.unwrap();
    assert_eq!(
        w.deliver(msg("m-1", b"second"), Ok("r2")).await.unwrap(),
        Verdict::DeadLetter(DeadLetterReason::Conflict)
    );
    assert_eq!(w.runs(), 1);
    let stored = w.store.snapshot();
    assert_eq!(stored[0].result_ref.as_deref(), Some("r1"));
}

#[tokio::test]
async fn an_unknown_outcome_is_parked_and_never_run_again() {
    let w = world(Some(DEFAULT_MAX_ATTEMPTS));
    let m = msg("m-1", b"x");
    let parked = Verdict::DeadLetter(DeadLetterReason::OutcomeUnknown {
        code: "ledger-timeout".into(),
    });
    assert_eq!(
        w.deliver(m, Err(HandlerError::outcome_unknown("ledger-timeout", "?")))
            .await
            .unwrap(),
        parked
    );
    // Within the lease and long after it (the default policy keeps an
    // unknown outcome blocked): never run again.
    for advance in [0, 10 * LEASE_MS] {
        w.clock.advance(advance);
        let again = w.deliver(m, Ok("again")).await.unwrap();
        assert!(
            matches!(
                again,
                Verdict::DeadLetter(DeadLetterReason::OutcomeUnknown { .. })
            ),
            "{again:?}"
        );
    }
    assert_eq!(w.runs(), 1);
}

#[tokio::test]
async fn an_id_that_breaks_the_key_rules_is_dead_lettered_naming_the_rule() {
    let w = world(Some(DEFAULT_MAX_ATTEMPTS));
    let verdict = w.deliver(msg("", b"x"), Ok("r")).await.unwrap();
    let Verdict::DeadLetter(DeadLetterReason::Invalid { message }) = verdict else {
        panic!("{verdict:?}");
    };
    assert!(message.contains("key"), "{message}");
    assert_eq!(w.runs(), 0);
    assert!(w.store.is_empty());
}

#[tokio::test]
async fn a_store_that_does_not_answer_is_an_error_never_an_ack() {
    let w = world(Some(DEFAULT_MAX_ATTEMPTS));
    w.store.disconnect();
    let e = w.deliver(msg("m-1", b"x"), Ok("r")).await.unwrap_err();
    assert!(matches!(e.0, Error::Store(_)), "{e}");
    assert_eq!(w.runs(), 0);
    w.store.reconnect();
    assert_eq!(
        w.deliver(msg("m-1", b"x"), Ok("r")).await.unwrap(),
        Verdict::Ack(Acked::Executed)
    );
}

/// A redelivery while the first delivery still runs (the broker's ack
/// timeout) is retried later, not run; the first delivery's heartbeat keeps
/// its lease, so even past the first lease nobody takes it over.
#[tokio::test(start_paused = true)]
async fn a_redelivery_during_a_long_handler_is_retried_not_run() {
    let w = world(Some(DEFAULT_MAX_ATTEMPTS));
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let first = {
        let consumer = w.consumer.clone();
        tokio::spawn(async move {
            consumer
                .handle(&msg("slow", b"x"), move |_t| async move {
                    let _ = released.await;
                    Ok::<_, HandlerError>("done")
                })
                .await
        })
    };
    // Three half-leases of handler time on both clocks: the heartbeat
    // extends the lease each time.
    for _ in 0..3 {
        tokio::time::advance(Duration::from_millis(LEASE_MS / 2)).await;
        tokio::task::yield_now().await;
        w.clock.advance(LEASE_MS / 2);
    }
    let verdict = w.deliver(msg("slow", b"x"), Ok("second")).await.unwrap();
    assert!(
        matches!(
            verdict,
            Verdict::Retry {
                why: RetryReason::InProgress,
                ..
            }
        ),
        "{verdict:?}"
    );
    assert_eq!(w.runs(), 0);
    let _ = release.send(());
    assert_eq!(first.await.unwrap().unwrap(), Verdict::Ack(Acked::Executed));
    assert_eq!(
        w.deliver(msg("slow", b"x"), Ok("third")).await.unwrap(),
        Verdict::Ack(Acked::Duplicate)
    );
}

#[test]
fn retry_delays_double_up_to_the_cap() {
    let mut c = ConsumerConfig::new("b");
    c.max_retry_delay = Duration::from_secs(5);
    let delays: Vec<u64> = (1..=5).map(|a| c.retry_delay(a).as_secs()).collect();
    assert_eq!(delays, [1, 2, 4, 5, 5]);
    assert_eq!(c.retry_delay(u32::MAX), Duration::from_secs(5));
}
