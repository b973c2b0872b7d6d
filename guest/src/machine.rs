//! The record state machine: every decision idem makes.
//!
//! The logic is plain Rust over the [`Env`] trait, so unit tests run it
//! natively against an in-memory environment; `component.rs` binds `Env` to
//! the component's imports.
//!
//! States and transitions (`*` marks a write through compare-and-swap
//! guarded by the record's revision; the claim of an absent key goes through
//! `insert-if-absent`, decided by the store's unique index):
//!
//! ```text
//!   (absent | expired) --begin--> processing(token t)           execute
//!   processing --complete(t)-->* succeeded                       replay
//!   processing --fail(t, final)-->* failed                       failed
//!   processing --fail(t, retryable)-->* released                 execute again
//!   processing --fail(t, outcome-unknown)-->* outcome-unknown    blocked
//!   processing, lease live --begin--> (no write)                 in-progress
//!   processing, lease over --begin, take-over-->* processing(t+1)
//!   processing, lease over --begin, reconcile-->* processing(t+1), then
//!        found: * succeeded (replay); not found: execute as t+1
//!   processing, lease over --begin, manual--> (no write)         outcome-unknown
//!   released --begin (same fingerprint)-->* processing(t+1)      execute
//!   succeeded | failed | released, expired --begin-->* processing(t+1)
//!   processing(lease over) | outcome-unknown --reconcile-->* processing(t+1)
//!        found: * succeeded; not found: * released, or * outcome-unknown (manual)
//! ```
//!
//! A different fingerprint on a live record is a mismatch, whatever its
//! state. Every other combination is impossible and reported as `corrupt`.

use alloc::boxed::Box;
use alloc::collections::BTreeSet;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use crate::bindings::exports::idem::engine::engine::{
    BeginRequest, Busy, Completion, Decision, Disposition, EngineError, ExpiredLease, Extension,
    FailureMode, InProgressMode, KeyStatus, MismatchInfo, Policy, ReconcileReport, Replayed,
    Resolution, Settlement, Ticket, UnknownInfo,
};
use crate::bindings::idem::engine::store::{InsertOutcome, StaleCursor, StoreError, SwapOutcome};
use crate::bindings::idem::engine::types::{
    Failure, RecordKey, Status, StoredRecord, Success, Timestamp,
};
use crate::fingerprint::{FINGERPRINT_VERSION, fingerprint, fingerprint_of_version};
use crate::owned::OwnedRecords;
use crate::validate;

/// How many times one call re-reads and retries after another writer changed
/// the record under it. Each retry means another writer made progress, so a
/// small bound suffices; past it the caller is told to retry later.
pub const MAX_CONTENTION_ROUNDS: u32 = 16;

/// How many hex digits of the stored fingerprint a mismatch reveals: enough
/// to tell two payloads apart in a log, far too few to learn anything.
pub const MISMATCH_PREFIX_DIGITS: usize = 8;

/// What the engine needs from its host: the `store`, `clock` and `results`
/// imports.
pub trait Env {
    /// `clock.now`.
    fn now(&self) -> Timestamp;
    /// `clock.pause`.
    fn pause(&self, duration_ms: u64);
    /// `store.insert-if-absent`.
    fn insert_if_absent(&self, candidate: &StoredRecord) -> Result<InsertOutcome, StoreError>;
    /// `store.get`.
    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError>;
    /// `store.compare-and-swap`.
    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError>;
    /// `store.delete-expired`.
    fn delete_expired(&self, now: Timestamp, limit: u32) -> Result<u32, StoreError>;
    /// `store.list-stale`.
    fn list_stale(
        &self,
        biz_type: &str,
        now: Timestamp,
        after: Option<StaleCursor>,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError>;
    /// `results.find-result`.
    fn find_result(&self, key: &RecordKey) -> Result<Option<Success>, StoreError>;
    /// The records this environment's engine wrote as an owner, which
    /// spare an owner's write its read ([`OwnedRecords`]); `None` (the
    /// default) when it keeps none, and every owner's write reads first.
    fn owned_records(&self) -> Option<&OwnedRecords> {
        None
    }
}

/// Remembers `rec`, just written by its owner, where the environment keeps
/// such records.
fn remember(env: &impl Env, rec: &StoredRecord) {
    if let Some(owned) = env.owned_records() {
        owned.remember(rec);
    }
}

/// Asks the host for the business result of `key` ([`Env::find_result`]).
/// A result that breaks the rules of `complete`'s success is a failed
/// lookup (`internal`): nothing is stored from it, and the key stays as it
/// was for the next lookup.
fn find_result(env: &impl Env, key: &RecordKey) -> Result<Option<Success>, StoreError> {
    let found = env.find_result(key)?;
    if let Some(s) = &found {
        validate::success(s).map_err(|e| {
            StoreError::Internal(format!(
                "the result lookup answered a result that breaks the rules: {}",
                e.message
            ))
        })?;
    }
    Ok(found)
}

fn store(e: StoreError) -> EngineError {
    EngineError::Store(e)
}

fn corrupt(rec: &StoredRecord, why: &str) -> EngineError {
    EngineError::Corrupt(format!(
        "record {} ({} / {}): {}",
        rec.id, rec.key.biz_type, rec.key.scope, why
    ))
}

fn same_key(a: &RecordKey, b: &RecordKey) -> bool {
    a.scope == b.scope && a.biz_type == b.biz_type && a.idem_key == b.idem_key
}

/// Checks the invariants every stored record must hold. A record that
/// breaks one was not written by this engine: fail loudly.
pub fn check_record(rec: &StoredRecord, key: &RecordKey) -> Result<(), EngineError> {
    if !same_key(&rec.key, key) {
        return Err(corrupt(rec, "the store returned a record for another key"));
    }
    if rec.fencing_token == 0 || rec.revision == 0 || rec.attempts == 0 {
        return Err(corrupt(
            rec,
            "fencing token, revision and attempts start at 1",
        ));
    }
    if rec.fingerprint.len() != 64
        || !rec
            .fingerprint
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(corrupt(
            rec,
            "the fingerprint is not 64 lowercase hex digits",
        ));
    }
    let ok = match rec.status {
        Status::Processing => rec.lease_until.is_some() && rec.expires_at.is_none(),
        Status::Succeeded => {
            rec.expires_at.is_some() && rec.lease_until.is_none() && rec.failure.is_none()
        }
        Status::Failed => {
            rec.expires_at.is_some() && rec.lease_until.is_none() && rec.failure.is_some()
        }
        Status::Released => rec.expires_at.is_some() && rec.lease_until.is_none(),
        // An unknown outcome keeps the lease of the owner that reported it.
        Status::OutcomeUnknown => rec.expires_at.is_none(),
    };
    if ok {
        Ok(())
    } else {
        Err(corrupt(
            rec,
            "its lease, expiry and outcome fields do not fit its status",
        ))
    }
}

fn is_settled(status: Status) -> bool {
    matches!(
        status,
        Status::Succeeded | Status::Failed | Status::Released
    )
}

/// True when a settled record has passed its retention and counts as absent.
pub fn is_expired(rec: &StoredRecord, now: Timestamp) -> bool {
    is_settled(rec.status) && rec.expires_at.is_some_and(|at| at <= now)
}

/// True while the owner's lease is live: until, not including, its end.
pub fn lease_live(rec: &StoredRecord, now: Timestamp) -> bool {
    rec.lease_until.is_some_and(|until| now < until)
}

fn ticket(rec: &StoredRecord) -> Ticket {
    Ticket {
        key: rec.key.clone(),
        record_id: rec.id,
        fencing_token: rec.fencing_token,
        lease_until: rec.lease_until.unwrap_or(0),
        attempt: rec.attempts,
    }
}

fn next_token(rec: &StoredRecord) -> Result<u64, EngineError> {
    rec.fencing_token
        .checked_add(1)
        .ok_or_else(|| corrupt(rec, "the fencing token cannot grow any further"))
}

fn next_revision(rec: &StoredRecord) -> Result<u64, EngineError> {
    rec.revision
        .checked_add(1)
        .ok_or_else(|| corrupt(rec, "the revision cannot grow any further"))
}

/// The same record, written again: next revision, `updated-at` now.
fn rewrite(rec: &StoredRecord, now: Timestamp) -> Result<StoredRecord, EngineError> {
    let mut next = rec.clone();
    next.revision = next_revision(rec)?;
    next.updated_at = now;
    Ok(next)
}

/// The record handed to a new owner: processing, next fencing token, a
/// fresh lease and nothing settled.
fn owned_by_next(
    rec: &StoredRecord,
    now: Timestamp,
    lease_ms: u64,
    count_attempt: bool,
) -> Result<StoredRecord, EngineError> {
    let mut next = rewrite(rec, now)?;
    next.status = Status::Processing;
    next.fencing_token = next_token(rec)?;
    next.lease_until = Some(now.saturating_add(lease_ms));
    next.expires_at = None;
    if count_attempt {
        next.attempts = rec.attempts.saturating_add(1);
    }
    Ok(next)
}

fn fresh(key: &RecordKey, fp: &str, now: Timestamp, policy: &Policy) -> StoredRecord {
    StoredRecord {
        id: 0,
        key: key.clone(),
        fingerprint: fp.into(),
        fingerprint_version: FINGERPRINT_VERSION,
        status: Status::Processing,
        fencing_token: 1,
        revision: 1,
        attempts: 1,
        lease_until: Some(now.saturating_add(policy.lease_ms)),
        created_at: now,
        updated_at: now,
        expires_at: None,
        result_ref: None,
        response: None,
        failure: None,
    }
}

/// A record past retention, replaced in place by a new first attempt. The
/// fencing token keeps growing so that no ticket of the old life matches.
fn replacement(
    rec: &StoredRecord,
    fp: &str,
    now: Timestamp,
    policy: &Policy,
) -> Result<StoredRecord, EngineError> {
    let mut next = fresh(&rec.key, fp, now, policy);
    next.id = rec.id;
    next.fencing_token = next_token(rec)?;
    next.revision = next_revision(rec)?;
    Ok(next)
}

fn busy(rec: &StoredRecord, now: Timestamp, policy: &Policy) -> Busy {
    let lease_until = rec.lease_until.unwrap_or(now);
    let left = lease_until.saturating_sub(now);
    Busy {
        retry_after_ms: left.clamp(1, policy.retry_after_ms.max(1)),
        lease_until,
    }
}

fn replayed(rec: &StoredRecord) -> Replayed {
    Replayed {
        result_ref: rec.result_ref.clone(),
        response: rec.response.clone(),
        completed_at: rec.updated_at,
    }
}

fn unknown(rec: &StoredRecord, since: Timestamp) -> UnknownInfo {
    UnknownInfo {
        since,
        attempts: rec.attempts,
        failure: rec.failure.clone(),
    }
}

/// A request's fingerprint, and how it compares with a stored record's,
/// whatever version the record was written with.
struct RequestPrint<'r> {
    req: &'r BeginRequest,
    /// The current version's fingerprint, which new records get.
    current: String,
}

impl RequestPrint<'_> {
    /// True when `rec` was written for this request. A record of an older
    /// version is compared with the request's fingerprint of that version,
    /// computed here only then: an upgrade never turns a live key's retry
    /// into a mismatch. A version this engine does not know (a newer
    /// engine's), or a body that the record's version refuses, is never
    /// the same request.
    fn matches(&self, rec: &StoredRecord) -> bool {
        if rec.fingerprint_version == FINGERPRINT_VERSION {
            return rec.fingerprint == self.current;
        }
        let policy = &self.req.policy;
        fingerprint_of_version(
            rec.fingerprint_version,
            &self.req.attributes,
            self.req.body_kind,
            &self.req.body,
            &policy.fingerprint_fields,
        )
        .and_then(Result::ok)
        .is_some_and(|old| old == rec.fingerprint)
    }
}

/// What the stored record means for a new request.
enum Assessment {
    /// Answer with this decision; nothing to write.
    Answer(Decision),
    /// Another owner is live.
    Busy(Busy),
    /// Write this record with compare-and-swap; on success the caller owns
    /// the key. With `reconcile_first`, ask the host for the result first.
    Claim {
        next: Box<StoredRecord>,
        reconcile_first: bool,
    },
}

fn assess(
    rec: &StoredRecord,
    print: &RequestPrint<'_>,
    now: Timestamp,
    policy: &Policy,
) -> Result<Assessment, EngineError> {
    if is_expired(rec, now) {
        return Ok(Assessment::Claim {
            next: Box::new(replacement(rec, &print.current, now, policy)?),
            reconcile_first: false,
        });
    }
    if !print.matches(rec) {
        let prefix = rec
            .fingerprint
            .get(..MISMATCH_PREFIX_DIGITS)
            .unwrap_or_default();
        return Ok(Assessment::Answer(Decision::Mismatch(MismatchInfo {
            stored_prefix: prefix.into(),
            stored_version: rec.fingerprint_version,
        })));
    }
    Ok(match rec.status {
        Status::Succeeded => Assessment::Answer(Decision::Replay(replayed(rec))),
        Status::Failed => match &rec.failure {
            Some(f) => Assessment::Answer(Decision::Failed(f.clone())),
            None => return Err(corrupt(rec, "failed without a failure")),
        },
        Status::Released => Assessment::Claim {
            next: Box::new(owned_by_next(rec, now, policy.lease_ms, true)?),
            reconcile_first: false,
        },
        Status::Processing if lease_live(rec, now) => Assessment::Busy(busy(rec, now, policy)),
        // An unknown outcome blocks the key while the reporting owner's
        // lease lasts (and for good when it had none).
        Status::OutcomeUnknown if rec.lease_until.is_none() || lease_live(rec, now) => {
            Assessment::Answer(Decision::OutcomeUnknown(unknown(rec, rec.updated_at)))
        }
        // The owner is gone, or its outcome is unknown and its lease over:
        // the policy for that case decides.
        Status::Processing | Status::OutcomeUnknown => match stale_mode(rec.status, policy) {
            ExpiredLease::TakeOver => Assessment::Claim {
                next: Box::new(owned_by_next(rec, now, policy.lease_ms, true)?),
                reconcile_first: false,
            },
            ExpiredLease::Reconcile => Assessment::Claim {
                next: Box::new(owned_by_next(rec, now, policy.lease_ms, true)?),
                reconcile_first: true,
            },
            ExpiredLease::Manual => {
                let since = match rec.status {
                    Status::OutcomeUnknown => rec.updated_at,
                    _ => rec.lease_until.unwrap_or(rec.updated_at),
                };
                Assessment::Answer(Decision::OutcomeUnknown(unknown(rec, since)))
            }
        },
    })
}

/// What the policy does with a stale record of `status`: an expired lease
/// of a `processing` owner (`expired-lease`) or an `outcome-unknown` record
/// whose reporting owner's lease has ended (`outcome-unknown`).
fn stale_mode(status: Status, policy: &Policy) -> ExpiredLease {
    match status {
        Status::OutcomeUnknown => policy.outcome_unknown,
        _ => policy.expired_lease,
    }
}

/// `engine.begin`.
pub fn begin(env: &impl Env, req: &BeginRequest) -> Result<Decision, EngineError> {
    if let Err(invalid) = validate::begin(req) {
        return Ok(Decision::Invalid(invalid));
    }
    let policy = &req.policy;
    let print = match fingerprint(
        &req.attributes,
        req.body_kind,
        &req.body,
        &policy.fingerprint_fields,
    ) {
        Ok(current) => RequestPrint { req, current },
        Err(invalid) => return Ok(Decision::Invalid(invalid)),
    };
    let key = &req.key;
    // Read first: a replay then costs one read and no write lock.
    let mut current = env.get(key).map_err(store)?;
    let mut contention = 0;
    // Set from the first round's clock reading: one call to the host's
    // clock per round, which is one crossing of the component boundary.
    let mut wait_until: Option<Option<Timestamp>> = None;
    loop {
        let now = env.now();
        let wait_until = *wait_until.get_or_insert(match policy.in_progress {
            InProgressMode::Wait(w) => Some(now.saturating_add(w.max_wait_ms)),
            InProgressMode::Reject => None,
        });
        let rec = match current.take() {
            Some(rec) => rec,
            None => match env
                .insert_if_absent(&fresh(key, &print.current, now, policy))
                .map_err(store)?
            {
                InsertOutcome::Inserted(rec) => {
                    check_record(&rec, key)?;
                    remember(env, &rec);
                    return Ok(Decision::Execute(ticket(&rec)));
                }
                InsertOutcome::Existing(rec) => rec,
            },
        };
        check_record(&rec, key)?;
        // The clock was read before the store answered: another writer may
        // have written `rec` after that reading. Time is at least its last
        // write, so nothing written from here (a lease, `updated-at`)
        // starts before it.
        let now = now.max(rec.updated_at);
        match assess(&rec, &print, now, policy)? {
            Assessment::Answer(decision) => return Ok(decision),
            Assessment::Busy(b) => {
                let (Some(until), InProgressMode::Wait(w)) = (wait_until, policy.in_progress)
                else {
                    return Ok(Decision::InProgress(b));
                };
                if now >= until {
                    return Ok(Decision::InProgress(b));
                }
                env.pause(w.poll_interval_ms.min(until - now).max(1));
                current = env.get(key).map_err(store)?;
            }
            Assessment::Claim {
                next,
                reconcile_first,
            } => match env.compare_and_swap(rec.revision, &next).map_err(store)? {
                SwapOutcome::Swapped if reconcile_first => {
                    return settle_after_takeover(env, &rec, *next, policy);
                }
                SwapOutcome::Swapped => {
                    remember(env, &next);
                    return Ok(Decision::Execute(ticket(&next)));
                }
                SwapOutcome::Stale(now_stored) => {
                    contention += 1;
                    if contention >= MAX_CONTENTION_ROUNDS {
                        return Ok(Decision::InProgress(Busy {
                            retry_after_ms: policy.retry_after_ms.max(1),
                            lease_until: now,
                        }));
                    }
                    current = now_stored;
                }
            },
        }
    }
}

/// The caller has taken over an abandoned key under policy `reconcile`: ask
/// whether the business result exists before executing again.
fn settle_after_takeover(
    env: &impl Env,
    abandoned: &StoredRecord,
    owned: StoredRecord,
    policy: &Policy,
) -> Result<Decision, EngineError> {
    let found = find_result(env, &owned.key);
    let now = env.now();
    let next = match &found {
        Ok(None) => {
            remember(env, &owned);
            return Ok(Decision::Execute(ticket(&owned)));
        }
        Ok(Some(result)) => {
            let result = result.clone();
            let mut done = succeeded(&owned, now, policy, result.result_ref, result.response)?;
            // Nothing was executed: the claim's attempt does not count.
            done.attempts = abandoned.attempts;
            done
        }
        Err(_) => {
            // Hand the key back as it was (stale, under the new token), so
            // the next request asks again instead of waiting out a lease
            // that nobody holds.
            let mut back = rewrite(&owned, now)?;
            back.status = abandoned.status;
            back.lease_until = abandoned.lease_until;
            back.attempts = abandoned.attempts;
            back
        }
    };
    let swapped = env.compare_and_swap(owned.revision, &next).map_err(store)?;
    match (found, swapped) {
        (Err(e), _) => Err(store(e)),
        (Ok(_), SwapOutcome::Swapped) => Ok(Decision::Replay(replayed(&next))),
        // Someone overtook us within our own fresh lease: only a clock far
        // out of step can do that. The next request sees what they wrote.
        (Ok(_), SwapOutcome::Stale(_)) => Ok(Decision::InProgress(Busy {
            retry_after_ms: policy.retry_after_ms.max(1),
            lease_until: now,
        })),
    }
}

fn succeeded(
    rec: &StoredRecord,
    now: Timestamp,
    policy: &Policy,
    result_ref: Option<String>,
    response: Option<crate::bindings::idem::engine::types::StoredResponse>,
) -> Result<StoredRecord, EngineError> {
    let mut next = rewrite(rec, now)?;
    next.status = Status::Succeeded;
    next.lease_until = None;
    next.expires_at = Some(now.saturating_add(policy.retention_ms));
    next.result_ref = result_ref;
    next.response = response;
    next.failure = None;
    Ok(next)
}

/// Where a ticket stands against the stored record.
enum Ownership {
    /// The ticket is current and the record is processing.
    Owner(Box<StoredRecord>),
    /// The ticket's own outcome is already stored (a retried call), with
    /// this status.
    AlreadyRecorded(Status),
    /// Someone else owns the key now, or the record is gone.
    Lost,
}

fn ownership(
    t: &Ticket,
    current: Option<StoredRecord>,
    already: impl Fn(&StoredRecord) -> bool,
) -> Result<Ownership, EngineError> {
    let Some(rec) = current else {
        return Ok(Ownership::Lost);
    };
    check_record(&rec, &t.key)?;
    if rec.id != t.record_id || rec.fencing_token != t.fencing_token {
        return Ok(Ownership::Lost);
    }
    if rec.status == Status::Processing {
        return Ok(Ownership::Owner(Box::new(rec)));
    }
    if already(&rec) {
        Ok(Ownership::AlreadyRecorded(rec.status))
    } else {
        Ok(Ownership::Lost)
    }
}

fn validate_ticket(t: &Ticket, policy: &Policy) -> Result<(), EngineError> {
    validate::policy(policy).map_err(EngineError::Invalid)?;
    validate::record_key(&t.key, &policy.key_format).map_err(EngineError::Invalid)
}

/// What an owner's write came to.
enum OwnerWrite {
    /// This record is now stored.
    Written(Box<StoredRecord>),
    /// An earlier try of this same call already stored the outcome, with
    /// this status.
    AlreadyRecorded(Status),
    /// Someone else owns the key now, or the record is gone.
    Lost,
}

/// Writes on behalf of the ticket's owner: reads the record (or takes the
/// one this engine wrote for the ticket, [`OwnedRecords`]), checks the
/// ticket, swaps in what `build` makes of it, and starts over if another
/// writer got in between. `already` recognises an outcome stored by an
/// earlier try of this same call.
fn write_as_owner(
    env: &impl Env,
    t: &Ticket,
    build: impl Fn(&StoredRecord, Timestamp) -> Result<StoredRecord, EngineError>,
    already: impl Fn(&StoredRecord) -> bool,
) -> Result<OwnerWrite, EngineError> {
    let mut current = match env.owned_records().and_then(|owned| owned.take(t)) {
        Some(rec) => Some(rec),
        None => env.get(&t.key).map_err(store)?,
    };
    for _ in 0..MAX_CONTENTION_ROUNDS {
        let rec = match ownership(t, current.take(), &already)? {
            Ownership::Owner(rec) => rec,
            Ownership::AlreadyRecorded(s) => return Ok(OwnerWrite::AlreadyRecorded(s)),
            Ownership::Lost => return Ok(OwnerWrite::Lost),
        };
        let next = build(&rec, env.now())?;
        match env.compare_and_swap(rec.revision, &next).map_err(store)? {
            SwapOutcome::Swapped => {
                remember(env, &next);
                return Ok(OwnerWrite::Written(Box::new(next)));
            }
            SwapOutcome::Stale(now_stored) => current = now_stored,
        }
    }
    Err(EngineError::Store(StoreError::Unavailable(format!(
        "the record changed {MAX_CONTENTION_ROUNDS} times during one call; retry"
    ))))
}

/// Stores an owner's outcome: `complete` and `fail`.
fn settle(
    env: &impl Env,
    t: &Ticket,
    build: impl Fn(&StoredRecord, Timestamp) -> Result<StoredRecord, EngineError>,
    already: impl Fn(&StoredRecord) -> bool,
) -> Result<Completion, EngineError> {
    Ok(match write_as_owner(env, t, build, already)? {
        OwnerWrite::Written(rec) => Completion::Recorded(rec.status),
        OwnerWrite::AlreadyRecorded(status) => Completion::Recorded(status),
        OwnerWrite::Lost => Completion::LostOwnership,
    })
}

/// `engine.complete`.
pub fn complete(
    env: &impl Env,
    t: &Ticket,
    policy: &Policy,
    success: &Success,
) -> Result<Completion, EngineError> {
    validate_ticket(t, policy)?;
    validate::success(success).map_err(EngineError::Invalid)?;
    settle(
        env,
        t,
        |rec, now| {
            succeeded(
                rec,
                now,
                policy,
                success.result_ref.clone(),
                success.response.clone(),
            )
        },
        |rec| {
            rec.status == Status::Succeeded
                && rec.result_ref == success.result_ref
                && rec.response == success.response
        },
    )
}

/// The stored meaning of a failure of attempt `attempt` under the policy:
/// `always-final`, or a retryable failure of the last attempt the policy's
/// `max-attempts` allows, is final.
pub fn effective_disposition(
    policy: &Policy,
    disposition: Disposition,
    attempt: u32,
) -> Disposition {
    let out_of_attempts = policy.max_attempts.is_some_and(|max| attempt >= max);
    match (policy.failure_mode, disposition) {
        (FailureMode::AlwaysFinal, Disposition::Retryable) => Disposition::Final,
        (FailureMode::HonorDisposition, Disposition::Retryable) if out_of_attempts => {
            Disposition::Final
        }
        (_, d) => d,
    }
}

/// The status a failure with `disposition` (already made effective) leaves.
fn failed_status(disposition: Disposition) -> Status {
    match disposition {
        Disposition::Retryable => Status::Released,
        Disposition::Final => Status::Failed,
        Disposition::OutcomeUnknown => Status::OutcomeUnknown,
    }
}

/// `engine.fail`.
pub fn fail(
    env: &impl Env,
    t: &Ticket,
    policy: &Policy,
    failure: &Failure,
    disposition: Disposition,
) -> Result<Completion, EngineError> {
    validate_ticket(t, policy)?;
    validate::failure(failure).map_err(EngineError::Invalid)?;
    // The attempt is the record's: while the ticket's fencing token is
    // current, no other owner has been granted the key since this one, so
    // `attempts` counts this owner's attempt (and a ticket cannot claim
    // another).
    let effective = |rec: &StoredRecord| effective_disposition(policy, disposition, rec.attempts);
    settle(
        env,
        t,
        |rec, now| failed(rec, now, policy, failure, effective(rec)),
        |rec| rec.status == failed_status(effective(rec)) && rec.failure.as_ref() == Some(failure),
    )
}

/// `rec` after `failure` with `disposition` (already made effective).
fn failed(
    rec: &StoredRecord,
    now: Timestamp,
    policy: &Policy,
    failure: &Failure,
    disposition: Disposition,
) -> Result<StoredRecord, EngineError> {
    let mut next = rewrite(rec, now)?;
    next.status = failed_status(disposition);
    // An unknown outcome keeps the lease: duplicates are told the outcome
    // is unknown until it ends, then the policy decides.
    next.lease_until = match disposition {
        Disposition::OutcomeUnknown => rec.lease_until,
        _ => None,
    };
    next.result_ref = None;
    next.failure = Some(failure.clone());
    next.response = match disposition {
        Disposition::Final => failure.response.clone(),
        _ => None,
    };
    next.expires_at = match disposition {
        Disposition::OutcomeUnknown => None,
        _ => Some(now.saturating_add(policy.retention_ms)),
    };
    Ok(next)
}

/// `engine.settle`: an operator's decision on a stuck key, written in one
/// compare-and-swap under the next fencing token.
pub fn settle_stuck(
    env: &impl Env,
    key: &RecordKey,
    policy: &Policy,
    resolution: &Resolution,
) -> Result<Settlement, EngineError> {
    validate::policy(policy).map_err(EngineError::Invalid)?;
    validate::record_key(key, &policy.key_format).map_err(EngineError::Invalid)?;
    match resolution {
        Resolution::Succeeded(s) => validate::success(s).map_err(EngineError::Invalid)?,
        Resolution::Failed(f) => validate::failure(f).map_err(EngineError::Invalid)?,
        Resolution::Released => {}
    }
    let mut current = env.get(key).map_err(store)?;
    for _ in 0..MAX_CONTENTION_ROUNDS {
        let Some(rec) = current.take() else {
            return Ok(Settlement::Absent);
        };
        check_record(&rec, key)?;
        let now = env.now();
        if is_expired(&rec, now) {
            return Ok(Settlement::Absent);
        }
        let stuck = match rec.status {
            Status::Processing => !lease_live(&rec, now),
            // The action may still land while the reporting owner's lease
            // lasts: recording what it came to runs nothing again, but a
            // release would let the next request run it a second time.
            Status::OutcomeUnknown => {
                !(matches!(resolution, Resolution::Released) && lease_live(&rec, now))
            }
            _ => false,
        };
        if !stuck {
            return Ok(Settlement::NotStuck);
        }
        // Fenced: the owner that left the key stuck can no longer write.
        let mut fenced = rec.clone();
        fenced.fencing_token = next_token(&rec)?;
        let next = match resolution {
            Resolution::Succeeded(s) => succeeded(
                &fenced,
                now,
                policy,
                s.result_ref.clone(),
                s.response.clone(),
            )?,
            Resolution::Failed(f) => failed(&fenced, now, policy, f, Disposition::Final)?,
            Resolution::Released => {
                let mut next = rewrite(&fenced, now)?;
                next.status = Status::Released;
                next.lease_until = None;
                next.result_ref = None;
                next.response = None;
                next.expires_at = Some(now.saturating_add(policy.retention_ms));
                next
            }
        };
        match env.compare_and_swap(rec.revision, &next).map_err(store)? {
            SwapOutcome::Swapped => return Ok(Settlement::Settled),
            SwapOutcome::Stale(now_stored) => current = now_stored,
        }
    }
    Err(EngineError::Store(StoreError::Unavailable(format!(
        "the record changed {MAX_CONTENTION_ROUNDS} times during one call; retry"
    ))))
}

/// `engine.extend`.
pub fn extend(env: &impl Env, t: &Ticket, policy: &Policy) -> Result<Extension, EngineError> {
    validate_ticket(t, policy)?;
    let written = write_as_owner(
        env,
        t,
        |rec, now| {
            let mut next = rewrite(rec, now)?;
            // A heartbeat never shortens a lease.
            let until = now.saturating_add(policy.lease_ms);
            next.lease_until = Some(until.max(rec.lease_until.unwrap_or(0)));
            Ok(next)
        },
        |_| false,
    )?;
    Ok(match written {
        OwnerWrite::Written(next) => match next.lease_until {
            Some(until) => Extension::Extended(until),
            None => return Err(corrupt(&next, "an extended lease has no end")),
        },
        OwnerWrite::AlreadyRecorded(_) | OwnerWrite::Lost => Extension::LostOwnership,
    })
}

/// The most records one `list-stale` page of `reconcile` asks for. Every
/// record of a page is copied into the guest's memory at once, and an
/// outcome-unknown record keeps its failure, whose response may be large,
/// so a page stays small next to the memory cap, while a run over
/// thousands of records still takes few crossings of the component
/// boundary.
pub const MAX_STALE_PAGE: u32 = 100;

/// `engine.reconcile`.
pub fn reconcile(
    env: &impl Env,
    biz_type: &str,
    policy: &Policy,
    limit: u32,
) -> Result<ReconcileReport, EngineError> {
    validate::policy(policy).map_err(EngineError::Invalid)?;
    validate::biz_type(biz_type).map_err(EngineError::Invalid)?;
    let mut report = ReconcileReport {
        examined: 0,
        succeeded: 0,
        released: 0,
        left_for_manual: 0,
        skipped: 0,
        lookup_errors: 0,
    };
    // Pages of `list-stale`, each after the last record of the one before,
    // until `limit` records are examined or the store has no more. The
    // outcome-unknown records whose lease still runs are listed but left
    // alone; reading on past them is what keeps enough of them from
    // hiding the stale records behind them from every run.
    let now = env.now();
    let page = limit.min(MAX_STALE_PAGE);
    let mut after: Option<StaleCursor> = None;
    // A record this run examined and rewrote without settling it (left
    // for manual work, or put back after a failed lookup) gets a later
    // `updated-at`, so a later page lists it again: it is examined once.
    // At most `limit` ids.
    let mut seen = BTreeSet::new();
    while report.examined < limit {
        let listed = env.list_stale(biz_type, now, after, page).map_err(store)?;
        let exhausted = listed.len() < usize::try_from(page).unwrap_or(usize::MAX);
        for rec in listed {
            check_listed(&rec, biz_type, now, after)?;
            after = Some(StaleCursor {
                updated_at: rec.updated_at,
                id: rec.id,
            });
            if report.examined >= limit {
                break;
            }
            // An unknown outcome whose reporting owner's lease still runs
            // is not examined yet: the action may still be landing, so a
            // lookup that finds nothing now proves nothing, and releasing
            // the key would let a retry run the action a second time.
            // `begin` keeps the key blocked for that lease too.
            if rec.status == Status::OutcomeUnknown && lease_live(&rec, now) {
                continue;
            }
            if !seen.insert(rec.id) {
                continue;
            }
            report.examined += 1;
            settle_stale(env, &rec, policy, &mut report)?;
        }
        if exhausted {
            break;
        }
    }
    Ok(report)
}

/// Checks a record `list-stale` returned against its contract: the biz
/// type asked for, stale at `now`, and strictly after `after` (the last
/// record listed before it) in (`updated-at`, `id`) order. A store that
/// breaks the order could make a run skip records or never end.
fn check_listed(
    rec: &StoredRecord,
    biz_type: &str,
    now: Timestamp,
    after: Option<StaleCursor>,
) -> Result<(), EngineError> {
    if rec.key.biz_type != biz_type {
        return Err(corrupt(rec, "list-stale returned another biz type"));
    }
    check_record(rec, &rec.key)?;
    let stale = match rec.status {
        Status::Processing => !lease_live(rec, now),
        Status::OutcomeUnknown => true,
        _ => false,
    };
    if !stale {
        return Err(corrupt(
            rec,
            "list-stale returned a record that is not stale",
        ));
    }
    if after.is_some_and(|a| (rec.updated_at, rec.id) <= (a.updated_at, a.id)) {
        return Err(corrupt(
            rec,
            "list-stale returned a record that is not after the one before it \
             in (updated-at, id) order",
        ));
    }
    Ok(())
}

/// Takes over one stale record, asks the host for its business result and
/// settles it by `policy`, counting what it did in `report`.
fn settle_stale(
    env: &impl Env,
    rec: &StoredRecord,
    policy: &Policy,
    report: &mut ReconcileReport,
) -> Result<(), EngineError> {
    // Take the key over first, so that no other reconciler or request
    // acts on it while the host is asked.
    let owned = owned_by_next(rec, env.now(), policy.lease_ms, false)?;
    if let SwapOutcome::Stale(_) = env.compare_and_swap(rec.revision, &owned).map_err(store)? {
        report.skipped += 1;
        return Ok(());
    }
    let found = find_result(env, &rec.key);
    // The lookup may have taken a while: stamp the write with the time
    // it is made.
    let now = env.now();
    let mut next = rewrite(&owned, now)?;
    next.lease_until = None;
    let outcome = match found {
        Ok(Some(result)) => {
            next = succeeded(&owned, now, policy, result.result_ref, result.response)?;
            &mut report.succeeded
        }
        Ok(None) if stale_mode(rec.status, policy) == ExpiredLease::Manual => {
            next.status = Status::OutcomeUnknown;
            &mut report.left_for_manual
        }
        Ok(None) => {
            next.status = Status::Released;
            next.expires_at = Some(now.saturating_add(policy.retention_ms));
            &mut report.released
        }
        Err(_) => {
            // Put the record back as it was, under the new token, so
            // that it stays stale and is examined again next time.
            next.status = rec.status;
            next.lease_until = rec.lease_until;
            &mut report.lookup_errors
        }
    };
    // Counted only once written: a request that took the key over
    // during a slow lookup wins, and the record counts as skipped.
    match env.compare_and_swap(owned.revision, &next).map_err(store)? {
        SwapOutcome::Swapped => *outcome += 1,
        SwapOutcome::Stale(_) => report.skipped += 1,
    }
    Ok(())
}

/// `engine.sweep`.
pub fn sweep(env: &impl Env, limit: u32) -> Result<u32, EngineError> {
    let now = env.now();
    env.delete_expired(now, limit).map_err(store)
}

/// `engine.inspect`.
pub fn inspect(env: &impl Env, key: &RecordKey) -> Result<Option<KeyStatus>, EngineError> {
    validate::record_key(key, &validate::default_key_format()).map_err(EngineError::Invalid)?;
    let Some(rec) = env.get(key).map_err(store)? else {
        return Ok(None);
    };
    check_record(&rec, key)?;
    let now = env.now();
    Ok(Some(KeyStatus {
        status: rec.status,
        created_at: rec.created_at,
        updated_at: rec.updated_at,
        expires_at: rec.expires_at,
        lease_until: rec.lease_until,
        result_ref: rec.result_ref.clone(),
        attempts: rec.attempts,
        fencing_token: rec.fencing_token,
        fingerprint: rec.fingerprint.clone(),
        fingerprint_version: rec.fingerprint_version,
        expired: is_expired(&rec, now),
    }))
}
#[cfg(test)]
mod tests;
