//! A payment provider's webhook, deduplicated on the provider's event id.
//!
//! Providers deliver webhooks at least once: a missed or slow `200` makes
//! them send the same event again, with a new `delivered_at`. The key is the
//! external event id (`idem_key`, key format `Token`), scoped to the tenant
//! and the provider (`tenant-7:stripe`), biz type `payment.callback`. Only
//! the fields that make up the event's meaning are fingerprinted
//! (`/type`, `/data/amount`, `/data/currency`), so a redelivery with another
//! `delivered_at` is a duplicate, while the same event id with another
//! amount is a conflict. Marking the payment as paid and recording the
//! callback as succeeded commit in one SQLite transaction
//! (`Engine::run_in_transaction`).
//!
//! Run with `cargo run --example payment_callback`.

use anyhow::{Result, bail};
use idem::{
    ActionResult, BeginRequest, Decision, Disposition, Engine, Failure, KeyCharset, KeyFormat,
    ManualClock, Policy, RecordKey, RunInTransaction, RunOutcome, SqliteOptions, SqliteStore,
    StoredResponse, Success,
};

mod common;
use common::TempDb;

/// 2026-01-01T00:00:00Z: the example runs on a manual clock.
const START: u64 = 1_767_225_600_000;

const TENANT: &str = "tenant-7";
const PROVIDER: &str = "stripe";
const PAYMENT_ID: &str = "pi_3QxA7Lk2eZvKYlo2";

/// The webhook as the provider posts it.
#[derive(Debug, Clone)]
struct Webhook {
    event_id: &'static str,
    event_type: &'static str,
    payment_id: &'static str,
    amount: i64,
    currency: &'static str,
    /// Set by the provider on every delivery attempt; not part of the event.
    delivered_at: u64,
}

impl Webhook {
    fn to_json(&self) -> String {
        format!(
            r#"{{"id":"{}","type":"{}","delivered_at":{},"data":{{"payment_id":"{}","amount":{},"currency":"{}"}}}}"#,
            self.event_id,
            self.event_type,
            self.delivered_at,
            self.payment_id,
            self.amount,
            self.currency
        )
    }
}

fn main() -> Result<()> {
    let db = TempDb::new("payment-callback");
    let store = SqliteStore::open(db.path(), SqliteOptions::default())?;
    // The business table, in the same database file. A transaction dropped
    // without commit() rolls back, so commit the setup explicitly.
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE payments (
                 tenant            TEXT NOT NULL,
                 payment_id        TEXT NOT NULL,
                 amount            INTEGER NOT NULL,
                 currency          TEXT NOT NULL,
                 status            TEXT NOT NULL,
                 paid_by_event     TEXT,
                 times_marked_paid INTEGER NOT NULL DEFAULT 0,
                 PRIMARY KEY (tenant, payment_id)
             )",
        )?;
        c.execute(
            "INSERT INTO payments (tenant, payment_id, amount, currency, status)
             VALUES (?1, ?2, 4200, 'eur', 'pending')",
            [TENANT, PAYMENT_ID],
        )
    })??;
    tx.commit()?;

    let clock = ManualClock::new(START);
    let engine = Engine::builder()
        .storage(store)
        .clock(clock.clone())
        .build()?;

    let event = Webhook {
        event_id: "evt_1QxA8Bk2eZvKYlo2Hq3nT9sW",
        event_type: "payment_intent.succeeded",
        payment_id: PAYMENT_ID,
        amount: 4200,
        currency: "eur",
        delivered_at: clock.read(),
    };
    println!("payment {PAYMENT_ID} of {TENANT}: 42.00 EUR, pending");

    println!(
        "(1) first delivery of {}: {}",
        event.event_id,
        event.to_json()
    );
    let (status, what) = handle_webhook(&engine, TENANT, PROVIDER, &event)?;
    println!("    {what}\n    -> HTTP {status} to the provider");

    // Our 200 got lost; the provider redelivers five minutes later.
    clock.advance(5 * 60 * 1000);
    let redelivery = Webhook {
        delivered_at: clock.read(),
        ..event.clone()
    };
    println!(
        "(2) duplicate: the provider redelivers the event with a new delivered_at: {}",
        redelivery.to_json()
    );
    let (status, what) = handle_webhook(&engine, TENANT, PROVIDER, &redelivery)?;
    println!("    {what}\n    -> HTTP {status} to the provider (so it stops redelivering)");

    clock.advance(60 * 1000);
    let tampered = Webhook {
        amount: 99_00,
        delivered_at: clock.read(),
        ..event.clone()
    };
    println!(
        "(3) conflicting duplicate: the same event id with another amount: {}",
        tampered.to_json()
    );
    let (status, what) = handle_webhook(&engine, TENANT, PROVIDER, &tampered)?;
    println!("    {what}\n    -> HTTP {status} to the provider, and an alert for a human");

    let conn = rusqlite::Connection::open(db.path())?;
    let (pay_status, by_event, times): (String, Option<String>, i64) = conn.query_row(
        "SELECT status, paid_by_event, times_marked_paid FROM payments
         WHERE tenant = ?1 AND payment_id = ?2",
        [TENANT, PAYMENT_ID],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )?;
    println!(
        "side effects: payment {PAYMENT_ID} is {pay_status} (by {}), \
         marked paid {times} time(s) for 3 deliveries",
        by_event.as_deref().unwrap_or("no event")
    );
    if times != 1 {
        bail!("expected the payment to be marked paid exactly once");
    }
    Ok(())
}

/// The policy of `payment.callback`.
fn callback_policy() -> Policy {
    Policy {
        // Only what the event means; delivery metadata is left out.
        fingerprint_fields: vec![
            "/type".into(),
            "/data/amount".into(),
            "/data/currency".into(),
        ],
        // External event ids: letters, digits and `-_.:`.
        key_format: KeyFormat {
            min_length: 1,
            max_length: 255,
            charset: KeyCharset::Token,
        },
        ..Policy::default()
    }
}

/// The webhook endpoint: answers the HTTP status for the provider and a
/// sentence saying what happened.
fn handle_webhook(
    engine: &Engine,
    tenant: &str,
    provider: &str,
    hook: &Webhook,
) -> Result<(u16, String)> {
    let key = RecordKey::new(
        format!("{tenant}:{provider}"),
        "payment.callback",
        hook.event_id,
    );
    let request = BeginRequest::json(key, hook.to_json(), callback_policy());

    let outcome = engine.run_in_transaction(&request, |_ticket, conn| {
        match mark_paid(conn, tenant, hook) {
            Ok(1) => ActionResult::Succeeded(Success {
                result_ref: Some(hook.payment_id.to_owned()),
                response: Some(StoredResponse {
                    status: 200,
                    headers: Vec::new(),
                    body: b"received".to_vec(),
                }),
            }),
            // No pending payment with this amount: a final answer, replayed
            // to every redelivery of this event.
            Ok(_) => ActionResult::Failed(
                Failure {
                    code: "no-pending-payment".into(),
                    message: format!(
                        "no pending payment {} of {} {}",
                        hook.payment_id, hook.amount, hook.currency
                    ),
                    response: Some(StoredResponse {
                        status: 200,
                        headers: Vec::new(),
                        body: b"ignored".to_vec(),
                    }),
                },
                Disposition::Final,
            ),
            // Rolled back; the provider's next delivery tries again.
            Err(e) => ActionResult::retryable("db-error", e),
        }
    })?;

    Ok(match outcome {
        RunOutcome::Executed {
            result: ActionResult::Succeeded(_),
            ..
        } => (
            200,
            format!("executed: payment {} marked as paid", hook.payment_id),
        ),
        RunOutcome::Executed {
            result: ActionResult::Failed(f, Disposition::Final),
            ..
        } => (200, format!("executed, failed for good: {}", f.message)),
        RunOutcome::Executed {
            result: ActionResult::Failed(f, _),
            ..
        } => (
            500,
            format!("executed, failed ({}); the provider will retry", f.message),
        ),
        RunOutcome::LostOwnership { .. } => (
            500,
            "a newer delivery took the event over; this attempt was rolled back".into(),
        ),
        RunOutcome::NotExecuted(decision) => match decision {
            Decision::Replay(r) => (
                r.response.map_or(200, |r| r.status),
                format!(
                    "skipped as duplicate: event already processed (payment {}), not marked paid again",
                    r.result_ref.as_deref().unwrap_or("?")
                ),
            ),
            Decision::Mismatch(m) => (
                422,
                format!(
                    "conflict: event id {} was already processed with different content \
                     (stored fingerprint {}…); the payment was not touched",
                    hook.event_id, m.stored_prefix
                ),
            ),
            Decision::InProgress(b) => (
                409,
                format!(
                    "the first delivery is still being processed; retry in {} ms",
                    b.retry_after_ms
                ),
            ),
            Decision::Failed(f) => (
                f.response.map_or(200, |r| r.status),
                format!("skipped: the event already failed for good ({})", f.code),
            ),
            Decision::OutcomeUnknown(_) => (
                409,
                "an earlier attempt's outcome is being reconciled".into(),
            ),
            Decision::Invalid(i) => (400, format!("rejected: {}", i.message)),
            Decision::Execute(_) => bail!("execute is never returned as not executed"),
        },
    })
}

/// The business write: marks the pending payment paid; returns the number
/// of payments changed (0 or 1).
fn mark_paid(conn: &rusqlite::Connection, tenant: &str, hook: &Webhook) -> rusqlite::Result<usize> {
    conn.execute(
        "UPDATE payments
            SET status = 'paid', paid_by_event = ?1, times_marked_paid = times_marked_paid + 1
          WHERE tenant = ?2 AND payment_id = ?3 AND amount = ?4 AND currency = ?5
            AND status = 'pending'",
        rusqlite::params![
            hook.event_id,
            tenant,
            hook.payment_id,
            hook.amount,
            hook.currency
        ],
    )
}
