//! Coupon claims keyed by the business identity, with no client key at all.
//!
//! "One coupon per user per campaign" is the rule, so the key IS the rule:
//! `idem_key` = the campaign id, `scope` = the user id, biz type
//! `coupon.claim`. However many times a user taps "claim", from however many
//! tabs, there is one key, so one claim; another user has another scope and
//! claims independently. The claim's content (the channel) is fingerprinted,
//! so the same user claiming the same campaign with other details is a
//! conflict. A sold-out campaign is a FINAL failure: stored and replayed to
//! that user's duplicates, without running the claim again.
//!
//! The claim runs through `Engine::run`; its own business transaction takes
//! a coupon and records the claim. Should a claimer crash between that
//! write and `complete`, the `reconcile` policy asks the business table
//! (found by the same natural key) instead of claiming again.
//!
//! Run with `cargo run --example coupon_claim`.

use std::cell::Cell;
use std::path::Path;

use anyhow::{Result, bail};
use idem::{
    ActionResult, BeginRequest, Decision, Disposition, Engine, ExpiredLease, Failure, KeyCharset,
    KeyFormat, ManualClock, Policy, RecordKey, RunOutcome, SqliteOptions, SqliteStore, StoreError,
    StoredResponse, Success,
};

mod common;
use common::TempDb;

/// 2026-01-01T00:00:00Z: the example runs on a manual clock.
const START: u64 = 1_767_225_600_000;

const CAMPAIGN: &str = "spring-sale-2026";

fn main() -> Result<()> {
    let db = TempDb::new("coupon-claim");
    let store = SqliteStore::open(db.path(), SqliteOptions::default())?;
    // The business tables, in the same database file. A transaction dropped
    // without commit() rolls back, so commit the setup explicitly.
    let tx = store.begin_transaction()?;
    tx.with_connection(|c| {
        c.execute_batch(
            "CREATE TABLE campaigns (id TEXT PRIMARY KEY, remaining INTEGER NOT NULL);
             CREATE TABLE claims (
                 id          INTEGER PRIMARY KEY,
                 campaign_id TEXT NOT NULL,
                 user_id     TEXT NOT NULL,
                 channel     TEXT NOT NULL,
                 coupon_code TEXT NOT NULL,
                 UNIQUE (campaign_id, user_id)
             );",
        )?;
        // Two coupons left.
        c.execute(
            "INSERT INTO campaigns (id, remaining) VALUES (?1, 2)",
            [CAMPAIGN],
        )
    })??;
    tx.commit()?;

    let lookup_path = db.path().to_path_buf();
    let engine = Engine::builder()
        .storage(store)
        .clock(ManualClock::new(START))
        // Reconciliation looks the claim up by the same natural key.
        .results(move |key: &RecordKey| find_claim(&lookup_path, key))
        .build()?;
    let service = CouponService {
        engine,
        conn: rusqlite::Connection::open(db.path())?,
        executions: Cell::new(0),
    };

    println!("campaign {CAMPAIGN}: 2 coupons left");

    println!("(1) first request: alice claims {CAMPAIGN} in the app");
    let first = service.claim("alice", CAMPAIGN, "app")?;
    println!("    {first}");

    println!("(2) duplicate: alice taps \"claim\" again");
    println!("    {}", service.claim("alice", CAMPAIGN, "app")?);

    println!("(3) conflicting duplicate: alice claims the same campaign on the web");
    println!("    {}", service.claim("alice", CAMPAIGN, "web")?);

    println!("(4) bob claims the same campaign: another scope, so his own claim");
    println!("    {}", service.claim("bob", CAMPAIGN, "app")?);

    println!("(5) carol claims: the campaign is sold out");
    println!("    {}", service.claim("carol", CAMPAIGN, "app")?);

    println!("(6) duplicate of a final failure: carol tries again");
    println!("    {}", service.claim("carol", CAMPAIGN, "app")?);

    let mut counts = Vec::new();
    for user in ["alice", "bob", "carol"] {
        let n: i64 = service.conn.query_row(
            "SELECT count(*) FROM claims WHERE campaign_id = ?1 AND user_id = ?2",
            [CAMPAIGN, user],
            |r| r.get(0),
        )?;
        counts.push((user, n));
    }
    let remaining: i64 = service.conn.query_row(
        "SELECT remaining FROM campaigns WHERE id = ?1",
        [CAMPAIGN],
        |r| r.get(0),
    )?;
    let listed: Vec<String> = counts
        .iter()
        .map(|(user, n)| format!("{user} {n}"))
        .collect();
    println!(
        "side effects: the claim ran {} time(s) for 6 requests; coupons issued: {}; \
         coupons left: {remaining}",
        service.executions.get(),
        listed.join(", ")
    );
    if counts != [("alice", 1), ("bob", 1), ("carol", 0)] || remaining != 0 {
        bail!("expected one coupon each for alice and bob, none for carol, none left");
    }
    Ok(())
}

struct CouponService {
    engine: Engine,
    /// The service's own connection for the business writes.
    conn: rusqlite::Connection,
    /// How many times the claim action ran (for the final check).
    executions: Cell<u32>,
}

impl CouponService {
    fn policy() -> Policy {
        Policy {
            // Campaign ids are tokens.
            key_format: KeyFormat {
                min_length: 1,
                max_length: 64,
                charset: KeyCharset::Token,
            },
            expired_lease: ExpiredLease::Reconcile,
            ..Policy::default()
        }
    }

    /// Claims a coupon of `campaign` for `user`; returns what happened.
    fn claim(&self, user: &str, campaign: &str, channel: &str) -> Result<String> {
        // No client key: the key is the business identity itself.
        let key = RecordKey::new(user, "coupon.claim", campaign);
        let body = format!(r#"{{"channel":"{channel}"}}"#);
        let request = BeginRequest::json(key, body, Self::policy());

        let outcome = self.engine.run(&request, |_ticket| {
            self.executions.set(self.executions.get() + 1);
            match take_coupon(&self.conn, user, campaign, channel) {
                Ok(Some(code)) => ActionResult::Succeeded(Success::with_ref(code)),
                Ok(None) => ActionResult::Failed(
                    Failure {
                        code: "sold-out".into(),
                        message: format!("campaign {campaign} is sold out"),
                        response: Some(StoredResponse {
                            status: 410,
                            headers: Vec::new(),
                            body: b"sold out".to_vec(),
                        }),
                    },
                    // Stored and replayed: this user's claim is over.
                    Disposition::Final,
                ),
                // The business transaction rolled back: nothing was taken,
                // so the user may try again.
                Err(e) => ActionResult::retryable("db-error", e),
            }
        })?;

        Ok(match outcome {
            RunOutcome::Executed {
                result: ActionResult::Succeeded(s),
                ..
            } => format!(
                "executed: {user} got coupon {}",
                s.result_ref.as_deref().unwrap_or("?")
            ),
            RunOutcome::Executed {
                result: ActionResult::Failed(f, d),
                ..
            } => match d {
                Disposition::Final => format!(
                    "executed and failed for good (final, stored for duplicates): {}",
                    f.message
                ),
                _ => format!(
                    "executed and failed ({d:?}): {}; the user may retry",
                    f.message
                ),
            },
            RunOutcome::LostOwnership { .. } => {
                "executed, but a newer attempt took the claim over; this outcome was discarded"
                    .into()
            }
            RunOutcome::NotExecuted(decision) => match decision {
                Decision::Replay(r) => format!(
                    "skipped as duplicate: the first claim is returned, coupon {}; no new coupon taken",
                    r.result_ref.as_deref().unwrap_or("?")
                ),
                Decision::Mismatch(m) => format!(
                    "conflict: {user} already claimed {campaign} with different details \
                     (stored fingerprint {}…); refused, no coupon taken",
                    m.stored_prefix
                ),
                Decision::Failed(f) => format!(
                    "skipped as duplicate: the stored final failure is replayed ({}: {}), \
                     the claim did not run again",
                    f.code, f.message
                ),
                Decision::InProgress(b) => format!(
                    "the first claim is still running; retry in {} ms",
                    b.retry_after_ms
                ),
                Decision::OutcomeUnknown(_) => {
                    "an earlier claim's outcome is being reconciled".into()
                }
                Decision::Invalid(i) => format!("rejected: {}", i.message),
                Decision::Execute(_) => bail!("execute is never returned as not executed"),
            },
        })
    }
}

/// The business transaction: takes one coupon and records the claim.
/// `None` when the campaign is sold out.
fn take_coupon(
    conn: &rusqlite::Connection,
    user: &str,
    campaign: &str,
    channel: &str,
) -> rusqlite::Result<Option<String>> {
    // Dropped without commit (an early return), it rolls back.
    let tx = conn.unchecked_transaction()?;
    let taken = tx.execute(
        "UPDATE campaigns SET remaining = remaining - 1 WHERE id = ?1 AND remaining > 0",
        [campaign],
    )?;
    if taken == 0 {
        return Ok(None);
    }
    tx.execute(
        "INSERT INTO claims (campaign_id, user_id, channel, coupon_code) VALUES (?1, ?2, ?3, '')",
        [campaign, user, channel],
    )?;
    let code = format!("SPRING-{:04}", tx.last_insert_rowid());
    tx.execute(
        "UPDATE claims SET coupon_code = ?1 WHERE id = ?2",
        rusqlite::params![code, tx.last_insert_rowid()],
    )?;
    tx.commit()?;
    Ok(Some(code))
}

/// The results lookup for reconciliation: the coupon code of the claim
/// recorded under the natural key, if any. Errors are errors, never "none".
fn find_claim(path: &Path, key: &RecordKey) -> Result<Option<String>, StoreError> {
    let unavailable = |e: rusqlite::Error| StoreError::Unavailable(e.to_string());
    let conn = rusqlite::Connection::open(path).map_err(unavailable)?;
    match conn.query_row(
        "SELECT coupon_code FROM claims WHERE campaign_id = ?1 AND user_id = ?2",
        [&key.idem_key, &key.scope],
        |r| r.get::<_, String>(0),
    ) {
        Ok(code) => Ok(Some(code)),
        Err(rusqlite::Error::QueryReturnedNoRows) => Ok(None),
        Err(e) => Err(unavailable(e)),
    }
}
