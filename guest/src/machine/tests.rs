//! Native tests of the state machine over an in-memory [`Env`].
//!
//! [`Fake`] is a store, a virtual clock and a result lookup that keep
//! everything in memory and follow the WIT contracts (`wit/store.wit`,
//! `wit/clock.wit`, `wit/results.wit`). Tests script store failures and
//! concurrent writers through its switches and hooks.
//!
//! Tests marked `Regression:` guard bugs these tests found.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;

use proptest::prelude::*;

use super::*;
use crate::bindings::exports::idem::engine::engine::{
    BodyKind, InputField, InputRule, InvalidInput, WaitSpec,
};
use crate::bindings::idem::engine::types::StoredResponse;

// ---------------------------------------------------------------------------
// The fake environment
// ---------------------------------------------------------------------------

/// `(scope, biz-type, idem-key)`: the store's unique index.
type Key3 = (String, String, String);

/// Runs inside a fake call, with the fake itself (no borrow held).
type Hook = Box<dyn FnMut(&Fake)>;

/// Runs before a compare-and-swap is decided, with the replacement.
type CasHook = Box<dyn FnMut(&Fake, &StoredRecord)>;

fn k3(key: &RecordKey) -> Key3 {
    (
        key.scope.clone(),
        key.biz_type.clone(),
        key.idem_key.clone(),
    )
}

/// One call into the environment, as logged by [`Fake`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Get,
    Insert,
    Cas,
    DeleteExpired,
    ListStale,
    FindResult,
    Pause,
}

/// An in-memory `store`, `clock` and `results`.
struct Fake {
    /// The virtual clock; `pause` advances it.
    clock: Cell<u64>,
    /// The records, by unique key. A record's own `key` field may be
    /// tampered with to differ from its index key.
    records: RefCell<BTreeMap<Key3, StoredRecord>>,
    /// The next row id `insert-if-absent` assigns.
    next_id: Cell<u64>,
    /// What `find-result` answers, by key.
    results: RefCell<BTreeMap<Key3, Success>>,
    /// Makes every `find-result` fail.
    find_fails: Cell<bool>,
    /// Makes `find-result` fail for these keys only.
    find_fails_for: RefCell<BTreeSet<Key3>>,
    /// The next store call of this kind (any store call when `None`) fails
    /// with this error.
    fail_next: RefCell<Option<(Option<Op>, StoreError)>>,
    /// When set, the next `list-stale` answers this instead.
    stale_answer: RefCell<Option<Vec<StoredRecord>>>,
    /// Makes `list-stale` ignore its cursor (a store breaking the
    /// contract): every page starts from the oldest record.
    stale_ignores_cursor: Cell<bool>,
    /// How many records `list-stale` has returned.
    stale_listed: Cell<usize>,
    /// Every call, in order.
    calls: RefCell<Vec<Op>>,
    /// Every pause asked for.
    pauses: RefCell<Vec<u64>>,
    /// Every successful swap: the record before and after.
    swaps: RefCell<Vec<(StoredRecord, StoredRecord)>>,
    on_pause: RefCell<Option<Hook>>,
    on_find: RefCell<Option<Hook>>,
    /// Runs after `get` has read its answer.
    on_get: RefCell<Option<Hook>>,
    before_cas: RefCell<Option<CasHook>>,
    /// The engine instances' remembered claims ([`Fake::instances`]).
    instances: Vec<OwnedRecords>,
    /// Which of `instances` the calls run on; none keeps no claims.
    instance: Cell<Option<usize>>,
}

const T0: u64 = 1_700_000_000_000;
const FIRST_ID: u64 = 100;

impl Fake {
    fn new() -> Self {
        Fake {
            clock: Cell::new(T0),
            records: RefCell::new(BTreeMap::new()),
            next_id: Cell::new(FIRST_ID),
            results: RefCell::new(BTreeMap::new()),
            find_fails: Cell::new(false),
            find_fails_for: RefCell::new(BTreeSet::new()),
            fail_next: RefCell::new(None),
            stale_answer: RefCell::new(None),
            stale_ignores_cursor: Cell::new(false),
            stale_listed: Cell::new(0),
            calls: RefCell::new(Vec::new()),
            pauses: RefCell::new(Vec::new()),
            swaps: RefCell::new(Vec::new()),
            on_pause: RefCell::new(None),
            on_find: RefCell::new(None),
            on_get: RefCell::new(None),
            before_cas: RefCell::new(None),
            instances: Vec::new(),
            instance: Cell::new(None),
        }
    }

    /// A fake whose calls run on one of `n` engine instances, each keeping
    /// the claims it wrote ([`OwnedRecords`]); the first one to start with.
    fn instances(n: usize) -> Self {
        let mut fake = Fake::new();
        fake.instances = (0..n).map(|_| OwnedRecords::new()).collect();
        fake.instance.set(Some(0));
        fake
    }

    /// Runs the next calls on instance `i`.
    fn on_instance(&self, i: usize) {
        assert!(i < self.instances.len(), "no instance {i}");
        self.instance.set(Some(i));
    }

    fn time(&self) -> u64 {
        self.clock.get()
    }

    fn advance(&self, ms: u64) {
        self.clock.set(self.clock.get() + ms);
    }

    fn set_time(&self, at: u64) {
        assert!(at >= self.time(), "the clock must not go backwards");
        self.clock.set(at);
    }

    fn record(&self, key: &RecordKey) -> Option<StoredRecord> {
        self.records.borrow().get(&k3(key)).cloned()
    }

    fn snapshot(&self) -> BTreeMap<Key3, StoredRecord> {
        self.records.borrow().clone()
    }

    /// Changes the stored record of `key` behind the engine's back.
    fn edit(&self, key: &RecordKey, f: impl FnOnce(&mut StoredRecord)) {
        let mut records = self.records.borrow_mut();
        f(records.get_mut(&k3(key)).expect("a record to edit"));
    }

    fn remove(&self, key: &RecordKey) {
        self.records.borrow_mut().remove(&k3(key));
    }

    fn set_result(&self, key: &RecordKey, result_ref: &str) {
        self.set_found(key, found(result_ref));
    }

    fn set_found(&self, key: &RecordKey, found: Success) {
        self.results.borrow_mut().insert(k3(key), found);
    }

    fn fail_next(&self, op: Option<Op>, err: StoreError) {
        *self.fail_next.borrow_mut() = Some((op, err));
    }

    fn on_pause(&self, hook: impl FnMut(&Fake) + 'static) {
        *self.on_pause.borrow_mut() = Some(Box::new(hook));
    }

    fn on_find(&self, hook: impl FnMut(&Fake) + 'static) {
        *self.on_find.borrow_mut() = Some(Box::new(hook));
    }

    fn on_get(&self, hook: impl FnMut(&Fake) + 'static) {
        *self.on_get.borrow_mut() = Some(Box::new(hook));
    }

    fn before_cas(&self, hook: impl FnMut(&Fake, &StoredRecord) + 'static) {
        *self.before_cas.borrow_mut() = Some(Box::new(hook));
    }

    fn count(&self, op: Op) -> usize {
        self.calls.borrow().iter().filter(|&&c| c == op).count()
    }

    fn calls(&self) -> Vec<Op> {
        self.calls.borrow().clone()
    }

    fn clear_calls(&self) {
        self.calls.borrow_mut().clear();
    }

    /// Logs a store call and fails it if told to.
    fn enter(&self, op: Op) -> Result<(), StoreError> {
        self.calls.borrow_mut().push(op);
        let mut slot = self.fail_next.borrow_mut();
        if slot
            .as_ref()
            .is_some_and(|(which, _)| which.is_none_or(|w| w == op))
        {
            let (_, err) = slot.take().expect("checked above");
            return Err(err);
        }
        Ok(())
    }

    fn run(&self, slot: &RefCell<Option<Hook>>) {
        let hook = slot.borrow_mut().take();
        if let Some(mut hook) = hook {
            hook(self);
            let mut slot = slot.borrow_mut();
            if slot.is_none() {
                *slot = Some(hook);
            }
        }
    }
}

impl Env for Fake {
    fn now(&self) -> Timestamp {
        self.clock.get()
    }

    fn owned_records(&self) -> Option<&OwnedRecords> {
        self.instance.get().and_then(|i| self.instances.get(i))
    }

    fn pause(&self, duration_ms: u64) {
        self.calls.borrow_mut().push(Op::Pause);
        self.pauses.borrow_mut().push(duration_ms);
        self.advance(duration_ms);
        self.run(&self.on_pause);
    }

    fn insert_if_absent(&self, candidate: &StoredRecord) -> Result<InsertOutcome, StoreError> {
        self.enter(Op::Insert)?;
        let mut records = self.records.borrow_mut();
        if let Some(existing) = records.get(&k3(&candidate.key)) {
            return Ok(InsertOutcome::Existing(existing.clone()));
        }
        let mut rec = candidate.clone();
        rec.id = self.next_id.get();
        self.next_id.set(rec.id + 1);
        records.insert(k3(&rec.key), rec.clone());
        Ok(InsertOutcome::Inserted(rec))
    }

    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
        self.enter(Op::Get)?;
        let found = self.record(key);
        self.run(&self.on_get);
        Ok(found)
    }

    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError> {
        self.enter(Op::Cas)?;
        let hook = self.before_cas.borrow_mut().take();
        if let Some(mut hook) = hook {
            hook(self, replacement);
            let mut slot = self.before_cas.borrow_mut();
            if slot.is_none() {
                *slot = Some(hook);
            }
        }
        let mut records = self.records.borrow_mut();
        let Some(current) = records.get_mut(&k3(&replacement.key)) else {
            return Ok(SwapOutcome::Stale(None));
        };
        if current.id != replacement.id || current.revision != expected_revision {
            return Ok(SwapOutcome::Stale(Some(current.clone())));
        }
        let next = replacement.clone();
        self.swaps
            .borrow_mut()
            .push((current.clone(), next.clone()));
        *current = next;
        Ok(SwapOutcome::Swapped)
    }

    fn delete_expired(&self, now: Timestamp, limit: u32) -> Result<u32, StoreError> {
        self.enter(Op::DeleteExpired)?;
        let mut deleted = 0;
        self.records.borrow_mut().retain(|_, rec| {
            let settled = matches!(
                rec.status,
                Status::Succeeded | Status::Failed | Status::Released
            );
            let doomed = deleted < limit && settled && rec.expires_at.is_some_and(|at| at <= now);
            if doomed {
                deleted += 1;
            }
            !doomed
        });
        Ok(deleted)
    }

    fn list_stale(
        &self,
        biz_type: &str,
        now: Timestamp,
        after: Option<StaleCursor>,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        self.enter(Op::ListStale)?;
        if let Some(answer) = self.stale_answer.borrow_mut().take() {
            return Ok(answer);
        }
        let after = after.filter(|_| !self.stale_ignores_cursor.get());
        let mut stale: Vec<StoredRecord> = self
            .records
            .borrow()
            .values()
            .filter(|rec| rec.key.biz_type == biz_type)
            .filter(|rec| after.is_none_or(|a| (rec.updated_at, rec.id) > (a.updated_at, a.id)))
            .filter(|rec| match rec.status {
                Status::Processing => rec.lease_until.is_some_and(|until| until <= now),
                Status::OutcomeUnknown => true,
                _ => false,
            })
            .cloned()
            .collect();
        stale.sort_by_key(|rec| (rec.updated_at, rec.id));
        stale.truncate(limit as usize);
        self.stale_listed.set(self.stale_listed.get() + stale.len());
        Ok(stale)
    }

    fn find_result(&self, key: &RecordKey) -> Result<Option<Success>, StoreError> {
        self.calls.borrow_mut().push(Op::FindResult);
        self.run(&self.on_find);
        if self.find_fails.get() || self.find_fails_for.borrow().contains(&k3(key)) {
            return Err(StoreError::Unavailable("results service down".into()));
        }
        Ok(self.results.borrow().get(&k3(key)).cloned())
    }
}

// ---------------------------------------------------------------------------
// Requests, policies and outcomes
// ---------------------------------------------------------------------------

const BIZ: &str = "order.create";
const LEASE: u64 = 1_000;
const RETENTION: u64 = 10_000;
const RETRY: u64 = 300;

fn key(idem_key: &str) -> RecordKey {
    RecordKey {
        scope: "tenant-1".into(),
        biz_type: BIZ.into(),
        idem_key: idem_key.into(),
    }
}

/// A policy whose stale records of both kinds (an expired `processing`
/// lease, an `outcome-unknown` past its lease) follow `expired_lease`.
fn policy_with(expired_lease: ExpiredLease) -> Policy {
    Policy {
        retention_ms: RETENTION,
        lease_ms: LEASE,
        retry_after_ms: RETRY,
        expired_lease,
        outcome_unknown: expired_lease,
        failure_mode: FailureMode::HonorDisposition,
        max_attempts: None,
        in_progress: InProgressMode::Reject,
        fingerprint_fields: Vec::new(),
        key_format: validate::default_key_format(),
        max_body_bytes: 1024 * 1024,
    }
}

fn policy() -> Policy {
    policy_with(ExpiredLease::TakeOver)
}

fn waiting(max_wait_ms: u64, poll_interval_ms: u64) -> Policy {
    Policy {
        in_progress: InProgressMode::Wait(WaitSpec {
            max_wait_ms,
            poll_interval_ms,
        }),
        ..policy()
    }
}

const ALL_EXPIRED_LEASE: [ExpiredLease; 3] = [
    ExpiredLease::TakeOver,
    ExpiredLease::Reconcile,
    ExpiredLease::Manual,
];

fn attributes() -> Vec<(String, String)> {
    vec![
        ("method".into(), "POST".into()),
        ("path".into(), "/orders".into()),
    ]
}

/// Request body number `n`: different `n`, different fingerprint.
fn body(n: u32) -> Vec<u8> {
    format!(r#"{{"amount": {n}, "currency": "EUR"}}"#).into_bytes()
}

fn fp(n: u32) -> String {
    fingerprint(&attributes(), BodyKind::Json, &body(n), &[]).expect("a valid body")
}

fn request(key: &RecordKey, n: u32, policy: &Policy) -> BeginRequest {
    BeginRequest {
        key: key.clone(),
        attributes: attributes(),
        body_kind: BodyKind::Json,
        body: body(n),
        policy: policy.clone(),
    }
}

/// `begin` with body `n`, which must decide.
#[track_caller]
fn decide(env: &Fake, key: &RecordKey, n: u32, policy: &Policy) -> Decision {
    begin(env, &request(key, n, policy)).expect("begin decides")
}

#[track_caller]
fn executed(d: Decision) -> Ticket {
    match d {
        Decision::Execute(t) => t,
        other => panic!("expected execute, got {other:?}"),
    }
}

/// A first `begin` on an absent key, with body 1.
#[track_caller]
fn start(env: &Fake, key: &RecordKey, policy: &Policy) -> Ticket {
    executed(decide(env, key, 1, policy))
}

/// Claims `key` and reports its outcome unknown, with the reporting
/// attempt's lease made to run until `T0 + 10 * LEASE`: a record that
/// `list-stale` lists and `reconcile` must leave alone until then.
fn live_unknown_outcome(env: &Fake, key: &RecordKey, policy: &Policy) {
    let t = start(env, key, policy);
    let done = fail(
        env,
        &t,
        policy,
        &failure("timeout"),
        Disposition::OutcomeUnknown,
    );
    assert_eq!(done, Ok(Completion::Recorded(Status::OutcomeUnknown)));
    env.edit(key, |r| r.lease_until = Some(T0 + 10 * LEASE));
}

fn response(status: u16, body: &str) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: body.as_bytes().to_vec(),
    }
}

fn success(result_ref: &str) -> Success {
    Success {
        result_ref: Some(result_ref.into()),
        response: Some(response(201, &format!("created {result_ref}"))),
    }
}

/// A business result that only carries its reference, as a lookup finds it.
fn found(result_ref: &str) -> Success {
    Success {
        result_ref: Some(result_ref.into()),
        response: None,
    }
}

fn failure(code: &str) -> Failure {
    Failure {
        code: code.into(),
        message: format!("{code} happened"),
        response: Some(response(402, code)),
    }
}

#[track_caller]
fn corrupt_err<T: Debug>(r: Result<T, EngineError>) -> String {
    match r {
        Err(EngineError::Corrupt(why)) => why,
        other => panic!("expected corrupt, got {other:?}"),
    }
}

#[track_caller]
fn store_err<T: Debug>(r: Result<T, EngineError>) -> StoreError {
    match r {
        Err(EngineError::Store(e)) => e,
        other => panic!("expected a store error, got {other:?}"),
    }
}

#[track_caller]
fn invalid_err<T: Debug>(r: Result<T, EngineError>) -> InvalidInput {
    match r {
        Err(EngineError::Invalid(i)) => i,
        other => panic!("expected invalid, got {other:?}"),
    }
}

fn all_store_errors() -> [StoreError; 3] {
    [
        StoreError::Unavailable("connection reset".into()),
        StoreError::Rejected("value too large".into()),
        StoreError::Internal("disk I/O error".into()),
    ]
}

/// A store with key `a` in `status` (body 1), reached through the engine.
/// Returns the key and the ticket that settled it.
fn settled_in(env: &Fake, status: Status, p: &Policy) -> (RecordKey, Ticket) {
    let k = key("a");
    let t = start(env, &k, p);
    env.advance(10);
    let done = match status {
        Status::Processing => return (k, t),
        Status::Succeeded => complete(env, &t, p, &success("order-1")),
        Status::Failed => fail(env, &t, p, &failure("card-declined"), Disposition::Final),
        Status::Released => fail(env, &t, p, &failure("busy"), Disposition::Retryable),
        Status::OutcomeUnknown => {
            fail(env, &t, p, &failure("timeout"), Disposition::OutcomeUnknown)
        }
    };
    assert_eq!(done, Ok(Completion::Recorded(status)));
    assert_eq!(env.record(&k).expect("settled").status, status);
    (k, t)
}

// ---------------------------------------------------------------------------
// begin: every decision
// ---------------------------------------------------------------------------

#[test]
fn begin_on_absent_key_executes_with_the_first_ticket() {
    let env = Fake::new();
    let k = key("a");
    let t = start(&env, &k, &policy());
    assert_eq!(
        t,
        Ticket {
            key: k.clone(),
            record_id: FIRST_ID,
            fencing_token: 1,
            lease_until: T0 + LEASE,
            attempt: 1,
        }
    );
    let rec = env.record(&k).expect("stored");
    assert_eq!(rec.status, Status::Processing);
    assert_eq!(rec.fingerprint, fp(1));
    assert_eq!(rec.fingerprint_version, FINGERPRINT_VERSION);
    assert_eq!(
        (rec.revision, rec.attempts, rec.created_at, rec.updated_at),
        (1, 1, T0, T0)
    );
    assert_eq!((rec.lease_until, rec.expires_at), (Some(T0 + LEASE), None));
    assert_eq!(env.calls(), vec![Op::Get, Op::Insert]);
    assert_eq!(check_record(&rec, &k), Ok(()));
}

#[test]
fn begin_after_complete_replays_without_writing() {
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::Succeeded, &p);
    let completed_at = T0 + 10;
    env.advance(500);
    env.clear_calls();
    let before = env.snapshot();
    assert_eq!(
        decide(&env, &k, 1, &p),
        Decision::Replay(Replayed {
            result_ref: Some("order-1".into()),
            response: Some(response(201, "created order-1")),
            completed_at,
        })
    );
    assert_eq!(env.snapshot(), before);
    assert_eq!(env.calls(), vec![Op::Get], "a replay costs one read");
}

#[test]
fn begin_while_leased_is_in_progress_capped_by_the_policy() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    start(&env, &k, &p);
    env.advance(100);
    let before = env.snapshot();
    assert_eq!(
        decide(&env, &k, 1, &p),
        Decision::InProgress(Busy {
            retry_after_ms: RETRY,
            lease_until: T0 + LEASE,
        })
    );
    assert_eq!(env.snapshot(), before);
    assert_eq!(env.count(Op::Cas), 0);
}

#[test]
fn begin_while_leased_is_in_progress_capped_by_the_lease_left() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    start(&env, &k, &p);
    for left in [RETRY, RETRY - 1, 120, 2, 1] {
        env.set_time(T0 + LEASE - left);
        assert_eq!(
            decide(&env, &k, 1, &p),
            Decision::InProgress(Busy {
                retry_after_ms: left,
                lease_until: T0 + LEASE,
            }),
            "{left} ms left"
        );
    }
    assert_eq!(env.count(Op::Cas), 0);
}

#[test]
fn begin_with_another_request_is_a_mismatch_that_reveals_only_a_prefix() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t = start(&env, &k, &p);
    let secret = Success {
        result_ref: Some("order-SECRET-REF".into()),
        response: Some(response(201, "SECRET-RESPONSE-BODY")),
    };
    assert_eq!(
        complete(&env, &t, &p, &secret),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    let before = env.snapshot();
    let d = decide(&env, &k, 2, &p);
    let stored = fp(1);
    assert_eq!(
        d,
        Decision::Mismatch(MismatchInfo {
            stored_prefix: stored[..8].into(),
            stored_version: FINGERPRINT_VERSION,
        })
    );
    let Decision::Mismatch(info) = &d else {
        unreachable!()
    };
    assert_eq!(info.stored_prefix.len(), MISMATCH_PREFIX_DIGITS);
    assert!(
        info.stored_prefix
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    );
    let shown = format!("{d:?}");
    assert!(!shown.contains("SECRET"), "{shown}");
    assert!(!shown.contains(&stored[8..]), "{shown}");
    assert_eq!(env.snapshot(), before);

    // Different attributes, same body: also a mismatch.
    let mut other = request(&k, 1, &p);
    other.attributes[1].1 = "/refunds".into();
    assert!(matches!(
        begin(&env, &other),
        Ok(Decision::Mismatch(MismatchInfo { .. }))
    ));
}

#[test]
fn begin_with_another_request_is_a_mismatch_in_every_state() {
    let states = [
        Status::Processing,
        Status::Succeeded,
        Status::Failed,
        Status::Released,
        Status::OutcomeUnknown,
    ];
    for status in states {
        for expired_lease in ALL_EXPIRED_LEASE {
            for past_lease in [false, true] {
                let env = Fake::new();
                let p = policy_with(expired_lease);
                let (k, _) = settled_in(&env, status, &p);
                if past_lease {
                    // Past the lease, still within retention.
                    env.set_time(T0 + LEASE + 1);
                }
                env.set_result(&k, "order-found");
                let before = env.snapshot();
                let d = decide(&env, &k, 2, &p);
                assert_eq!(
                    d,
                    Decision::Mismatch(MismatchInfo {
                        stored_prefix: fp(1)[..8].into(),
                        stored_version: FINGERPRINT_VERSION,
                    }),
                    "{status:?} {expired_lease:?} past lease: {past_lease}"
                );
                assert_eq!(env.snapshot(), before);
                assert_eq!(env.count(Op::FindResult), 0);
            }
        }
    }
}

#[test]
fn begin_on_a_record_of_another_fingerprint_version_is_a_mismatch() {
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::Succeeded, &p);
    env.edit(&k, |r| r.fingerprint_version = FINGERPRINT_VERSION + 1);
    assert_eq!(
        decide(&env, &k, 1, &p),
        Decision::Mismatch(MismatchInfo {
            stored_prefix: fp(1)[..8].into(),
            stored_version: FINGERPRINT_VERSION + 1,
        })
    );
}

/// The version-1 fingerprint of `begin` with body `n`.
fn fp_v1(n: u32) -> String {
    crate::fingerprint::fingerprint_of_version(1, &attributes(), BodyKind::Json, &body(n), &[])
        .expect("version 1 is known")
        .expect("a valid body")
}

#[test]
fn begin_on_a_version_1_record_compares_the_version_1_fingerprint() {
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::Succeeded, &p);
    env.edit(&k, |r| {
        r.fingerprint = fp_v1(1);
        r.fingerprint_version = 1;
    });
    let before = env.snapshot();
    assert!(matches!(decide(&env, &k, 1, &p), Decision::Replay(_)));
    assert_eq!(
        decide(&env, &k, 2, &p),
        Decision::Mismatch(MismatchInfo {
            stored_prefix: fp_v1(1)[..8].into(),
            stored_version: 1,
        })
    );
    // Nothing was rewritten: the record keeps its version.
    assert_eq!(env.snapshot(), before);
    // A record whose version-1 fingerprint is another request's mismatches.
    env.edit(&k, |r| r.fingerprint = fp_v1(2));
    assert!(matches!(decide(&env, &k, 1, &p), Decision::Mismatch(_)));
}

#[test]
fn begin_after_a_final_failure_answers_failed() {
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::Failed, &p);
    env.advance(100);
    let before = env.snapshot();
    assert_eq!(
        decide(&env, &k, 1, &p),
        Decision::Failed(failure("card-declined"))
    );
    assert_eq!(env.snapshot(), before);
}

#[test]
fn begin_after_an_unknown_outcome_is_blocked_while_the_lease_lasts() {
    let env = Fake::new();
    let p = policy_with(ExpiredLease::Manual);
    let (k, t) = settled_in(&env, Status::OutcomeUnknown, &p);
    let expected = Decision::OutcomeUnknown(UnknownInfo {
        since: T0 + 10,
        attempts: 1,
        failure: Some(failure("timeout")),
    });
    let before = env.snapshot();
    assert_eq!(decide(&env, &k, 1, &p), expected);
    env.set_time(t.lease_until - 1);
    assert_eq!(decide(&env, &k, 1, &p), expected);
    // Under `manual` it stays blocked for good: not past retention, not
    // through sweep.
    env.advance(RETENTION * 3);
    assert_eq!(decide(&env, &k, 1, &p), expected);
    assert_eq!(sweep(&env, 100), Ok(0));
    assert_eq!(env.snapshot(), before);
}

#[test]
fn an_unknown_outcome_is_handled_by_the_policy_once_the_lease_ends() {
    for expired in ALL_EXPIRED_LEASE {
        let env = Fake::new();
        let p = policy_with(expired);
        let (k, t) = settled_in(&env, Status::OutcomeUnknown, &p);
        env.set_time(t.lease_until - 1);
        assert!(matches!(
            decide(&env, &k, 1, &p),
            Decision::OutcomeUnknown(_)
        ));
        env.set_time(t.lease_until);
        match (expired, decide(&env, &k, 1, &p)) {
            (ExpiredLease::TakeOver | ExpiredLease::Reconcile, Decision::Execute(t2)) => {
                assert_eq!((t2.fencing_token, t2.attempt), (2, 2), "{expired:?}");
            }
            (ExpiredLease::Manual, Decision::OutcomeUnknown(u)) => assert_eq!(u.since, T0 + 10),
            (e, d) => panic!("{e:?}: unexpected {d:?}"),
        }
    }
}

#[test]
fn an_unknown_outcome_follows_its_own_policy_and_a_crashed_owner_the_expired_lease() {
    // Every pair of modes: the status of the stale record picks which one
    // decides, the other is never consulted.
    for expired_lease in ALL_EXPIRED_LEASE {
        for outcome_unknown in ALL_EXPIRED_LEASE {
            let p = Policy {
                outcome_unknown,
                ..policy_with(expired_lease)
            };
            for (status, mode) in [
                (Status::Processing, expired_lease),
                (Status::OutcomeUnknown, outcome_unknown),
            ] {
                let env = Fake::new();
                let (k, t) = settled_in(&env, status, &p);
                // The lookup finds nothing: `reconcile` then executes.
                env.set_time(t.lease_until);
                let before = env.snapshot();
                let d = decide(&env, &k, 1, &p);
                let what = format!(
                    "{status:?} under expired-lease {expired_lease:?}, outcome-unknown {outcome_unknown:?}"
                );
                match (mode, d) {
                    (ExpiredLease::TakeOver, Decision::Execute(t2)) => {
                        assert_eq!(t2.fencing_token, 2, "{what}");
                        assert_eq!(env.count(Op::FindResult), 0, "{what}");
                    }
                    (ExpiredLease::Reconcile, Decision::Execute(t2)) => {
                        assert_eq!(t2.fencing_token, 2, "{what}");
                        assert_eq!(env.count(Op::FindResult), 1, "{what}");
                    }
                    (ExpiredLease::Manual, Decision::OutcomeUnknown(_)) => {
                        assert_eq!(env.snapshot(), before, "{what}");
                        assert_eq!(env.count(Op::FindResult), 0, "{what}");
                    }
                    (mode, d) => panic!("{what}: {mode:?} decided {d:?}"),
                }
            }
        }
    }
}

#[test]
fn reconcile_settles_each_stale_record_by_the_policy_for_its_status() {
    // Crashed owners may be run again; unknown outcomes wait for a person.
    let p = Policy {
        outcome_unknown: ExpiredLease::Manual,
        ..policy_with(ExpiredLease::TakeOver)
    };
    let env = Fake::new();
    let (crashed, t1) = settled_in(&env, Status::Processing, &p);
    let unknown = key("unknown");
    let t2 = start(&env, &unknown, &p);
    fail(
        &env,
        &t2,
        &p,
        &failure("timeout"),
        Disposition::OutcomeUnknown,
    )
    .expect("the outcome-unknown report is stored");
    env.set_time(t1.lease_until.max(t2.lease_until));
    let r = reconcile(&env, BIZ, &p, 10).expect("reconcile");
    assert_eq!(
        (r.examined, r.released, r.left_for_manual),
        (2, 1, 1),
        "{r:?}"
    );
    assert_eq!(
        env.record(&crashed).map(|r| r.status),
        Some(Status::Released)
    );
    assert_eq!(
        env.record(&unknown).map(|r| r.status),
        Some(Status::OutcomeUnknown)
    );
    assert!(matches!(
        decide(&env, &unknown, 1, &p),
        Decision::OutcomeUnknown(_)
    ));
}

#[test]
fn reconcile_waits_out_the_lease_of_an_unknown_outcome() {
    // Under take-over a result that is not found releases the key; within
    // the reporting owner's lease that would let a retry run while the
    // first attempt may still land, so reconcile leaves the key alone,
    // asks nothing, and counts nothing until the lease ends.
    let p = Policy {
        outcome_unknown: ExpiredLease::TakeOver,
        ..policy()
    };
    let env = Fake::new();
    let (k, t) = settled_in(&env, Status::OutcomeUnknown, &p);
    let before = env.record(&k).expect("stored");
    env.set_time(t.lease_until - 1);
    env.clear_calls();
    let r = reconcile(&env, BIZ, &p, 10).expect("reconcile");
    assert_eq!(r, empty_report(), "examined within the lease");
    assert_eq!(env.count(Op::FindResult), 0, "the lookup was asked");
    assert_eq!(env.record(&k), Some(before), "the record changed");
    assert!(matches!(
        decide(&env, &k, 1, &p),
        Decision::OutcomeUnknown(_)
    ));
    env.set_time(t.lease_until);
    let r = reconcile(&env, BIZ, &p, 10).expect("reconcile");
    assert_eq!((r.examined, r.released), (1, 1), "{r:?}");
    assert_eq!(env.count(Op::FindResult), 1);
    let again = executed(decide(&env, &k, 1, &p));
    assert_eq!(again.attempt, 2);
}

#[test]
fn reconcile_reaches_stale_records_behind_live_unknown_outcomes() {
    // `list-stale` lists every unknown outcome, oldest first, and those
    // within their lease are left alone: five of them ahead of two stale
    // processing records must not use up a run's limit of 2.
    let p = Policy {
        outcome_unknown: ExpiredLease::TakeOver,
        ..policy()
    };
    let env = Fake::new();
    let mut unknown = Vec::new();
    for i in 0..5 {
        let k = key(&format!("unknown-{i}"));
        live_unknown_outcome(&env, &k, &p);
        unknown.push(k);
        env.advance(1);
    }
    let stale = [key("stale-1"), key("stale-2")];
    for k in &stale {
        start(&env, k, &p);
        env.advance(1);
    }
    // The stale records' leases have ended; the unknown outcomes' lease
    // (of the attempts that reported them) runs on.
    env.set_time(T0 + 2 * LEASE);
    let before: Vec<_> = unknown.iter().map(|k| env.record(k)).collect();
    env.clear_calls();
    let r = reconcile(&env, BIZ, &p, 2).expect("reconcile");
    assert_eq!((r.examined, r.released), (2, 2), "{r:?}");
    for k in &stale {
        assert_eq!(env.record(k).expect("stale").status, Status::Released);
    }
    let after: Vec<_> = unknown.iter().map(|k| env.record(k)).collect();
    assert_eq!(after, before, "a live unknown outcome was touched");
    assert_eq!(env.count(Op::FindResult), 2);
    // Pages of 2, each after the last: [u0 u1] [u2 u3] [u4 s1] [s2], so
    // every record was read once.
    assert_eq!(env.count(Op::ListStale), 4);
    assert_eq!(env.stale_listed.get(), 7);
    // Nothing else is stale: the live unknown outcomes are read once more,
    // and the run ends at the page that comes back shorter than asked.
    env.clear_calls();
    env.stale_listed.set(0);
    assert_eq!(reconcile(&env, BIZ, &p, 2), Ok(empty_report()));
    assert_eq!(env.count(Op::ListStale), 3);
    assert_eq!(env.stale_listed.get(), 5);
}

#[test]
fn reconcile_reads_pages_of_at_most_max_stale_page_records() {
    // However large the limit, one listing copies at most a page of
    // records into the guest, and the run still reaches every record.
    let p = policy();
    let env = Fake::new();
    let n = MAX_STALE_PAGE as usize * 2 + 5;
    for i in 0..n {
        start(&env, &key(&format!("k{i}")), &p);
    }
    env.set_time(T0 + 2 * LEASE);
    env.clear_calls();
    let r = reconcile(&env, BIZ, &p, u32::MAX).expect("reconcile");
    assert_eq!((r.examined, r.released), (n as u32, n as u32), "{r:?}");
    assert_eq!(env.count(Op::ListStale), 3);
    assert_eq!(env.stale_listed.get(), n);
}

#[test]
fn reconcile_examines_a_record_it_put_back_once() {
    // A failed lookup puts the record back with a later `updated-at`, so a
    // later page lists it again: it is not examined a second time.
    let p = Policy {
        outcome_unknown: ExpiredLease::TakeOver,
        ..policy()
    };
    let env = Fake::new();
    let stale = key("stale");
    start(&env, &stale, &p);
    env.advance(1);
    for i in 0..2 {
        live_unknown_outcome(&env, &key(&format!("unknown-{i}")), &p);
    }
    env.set_time(T0 + 2 * LEASE);
    env.find_fails.set(true);
    env.clear_calls();
    // Pages of 3: [stale u0 u1], then [stale], put back after u1.
    let r = reconcile(&env, BIZ, &p, 3).expect("reconcile");
    assert_eq!((r.examined, r.lookup_errors), (1, 1), "{r:?}");
    assert_eq!(env.count(Op::FindResult), 1);
    assert_eq!(env.count(Op::ListStale), 2);
    assert_eq!(
        env.record(&stale).expect("stored").status,
        Status::Processing
    );
}

#[test]
fn reconcile_rejects_a_store_that_ignores_the_cursor() {
    // A store that lists from the start again would make a run read the
    // same page forever: the record that is not after the cursor is
    // corrupt, and nothing more is written.
    let p = Policy {
        outcome_unknown: ExpiredLease::TakeOver,
        ..policy()
    };
    let env = Fake::new();
    for i in 0..3 {
        live_unknown_outcome(&env, &key(&format!("unknown-{i}")), &p);
    }
    env.stale_ignores_cursor.set(true);
    env.clear_calls();
    let before = env.snapshot();
    let why = corrupt_err(reconcile(&env, BIZ, &p, 2));
    assert!(why.contains("not after"), "{why}");
    assert_eq!(env.snapshot(), before);
    assert_eq!(env.count(Op::Cas), 0);
}

#[test]
fn an_unknown_outcome_without_a_lease_is_blocked_for_good() {
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::OutcomeUnknown, &p);
    env.edit(&k, |r| r.lease_until = None);
    env.advance(RETENTION * 3);
    assert!(matches!(
        decide(&env, &k, 1, &p),
        Decision::OutcomeUnknown(_)
    ));
}

#[test]
fn invalid_begin_touches_nothing() {
    let env = Fake::new();
    let p = policy();
    // An existing record must not even be read.
    start(&env, &key("taken"), &p);
    env.clear_calls();
    let before = env.snapshot();

    let mut cases: Vec<(BeginRequest, InputField, Option<InputRule>)> = Vec::new();
    cases.push((request(&key(""), 1, &p), InputField::IdemKey, None));
    cases.push((
        request(&key("has space"), 1, &p),
        InputField::IdemKey,
        Some(InputRule::BadCharacter),
    ));
    let mut r = request(&key("taken"), 1, &p);
    r.key.scope = String::new();
    cases.push((r, InputField::Scope, None));
    let mut r = request(&key("taken"), 1, &p);
    r.key.biz_type = "order create".into();
    cases.push((r, InputField::BizType, None));
    let mut r = request(&key("taken"), 1, &p);
    r.policy.lease_ms = 0;
    cases.push((r, InputField::Policy, Some(InputRule::OutOfRange)));
    let mut r = request(&key("taken"), 1, &p);
    r.body = b"{\"amount\": ".to_vec();
    cases.push((r, InputField::Body, Some(InputRule::NotJson)));
    let mut r = request(&key("taken"), 1, &p);
    r.body = b"{\"a\":1,\"a\":2}".to_vec();
    cases.push((r, InputField::Body, Some(InputRule::NotJson)));
    let mut r = request(&key("taken"), 1, &p);
    r.policy.max_body_bytes = 4;
    cases.push((r, InputField::Body, Some(InputRule::TooLong)));
    let mut r = request(&key("taken"), 1, &p);
    r.body_kind = BodyKind::Raw;
    r.policy.fingerprint_fields = vec!["/amount".into()];
    cases.push((r, InputField::Policy, Some(InputRule::BadFormat)));
    let mut r = request(&key("taken"), 1, &p);
    r.attributes.push((String::new(), "x".into()));
    cases.push((r, InputField::Attributes, Some(InputRule::Required)));

    for (req, field, rule) in cases {
        match begin(&env, &req) {
            Ok(Decision::Invalid(i)) => {
                assert_eq!(i.field, field, "{}", i.message);
                if let Some(rule) = rule {
                    assert_eq!(i.rule, rule, "{}", i.message);
                }
            }
            other => panic!("expected invalid {field:?}, got {other:?}"),
        }
        assert_eq!(env.calls(), Vec::new(), "{field:?}: no store call");
        assert_eq!(env.snapshot(), before);
    }
}

#[test]
fn other_calls_refuse_bad_input_without_store_calls() {
    let env = Fake::new();
    let p = policy();
    let t = start(&env, &key("a"), &p);
    env.clear_calls();
    let before = env.snapshot();

    let too_long = Success {
        result_ref: Some("r".repeat(validate::MAX_RESULT_REF_BYTES + 1)),
        response: None,
    };
    assert_eq!(
        invalid_err(complete(&env, &t, &p, &too_long)).field,
        InputField::SuccessResult
    );
    let bad_status = Success {
        result_ref: None,
        response: Some(response(99, "")),
    };
    assert_eq!(
        invalid_err(complete(&env, &t, &p, &bad_status)).field,
        InputField::SuccessResult
    );
    let no_code = Failure {
        code: String::new(),
        ..failure("x")
    };
    for d in [
        Disposition::Retryable,
        Disposition::Final,
        Disposition::OutcomeUnknown,
    ] {
        assert_eq!(
            invalid_err(fail(&env, &t, &p, &no_code, d)).field,
            InputField::FailureInfo
        );
    }
    let mut bad_ticket = t.clone();
    bad_ticket.key.scope = String::new();
    assert_eq!(
        invalid_err(extend(&env, &bad_ticket, &p)).field,
        InputField::Scope
    );
    assert_eq!(
        invalid_err(complete(&env, &bad_ticket, &p, &success("x"))).field,
        InputField::Scope
    );
    let bad_policy = Policy {
        retention_ms: 0,
        ..policy()
    };
    assert_eq!(
        invalid_err(extend(&env, &t, &bad_policy)).field,
        InputField::Policy
    );
    assert_eq!(
        invalid_err(reconcile(&env, BIZ, &bad_policy, 10)).field,
        InputField::Policy
    );
    assert_eq!(
        invalid_err(reconcile(&env, "", &p, 10)).field,
        InputField::BizType
    );
    assert_eq!(
        invalid_err(inspect(&env, &key(""))).field,
        InputField::IdemKey
    );
    assert_eq!(env.calls(), Vec::new());
    assert_eq!(env.snapshot(), before);
}

// ---------------------------------------------------------------------------
// The lease boundary, under each expired-lease policy
// ---------------------------------------------------------------------------

#[test]
fn lease_is_live_until_its_last_millisecond_under_every_policy() {
    for expired_lease in ALL_EXPIRED_LEASE {
        let env = Fake::new();
        let p = policy_with(expired_lease);
        let k = key("a");
        let t = start(&env, &k, &p);
        env.set_result(&k, "order-found");
        env.set_time(t.lease_until - 1);
        let before = env.snapshot();
        assert_eq!(
            decide(&env, &k, 1, &p),
            Decision::InProgress(Busy {
                retry_after_ms: 1,
                lease_until: t.lease_until,
            }),
            "{expired_lease:?}"
        );
        assert_eq!(env.snapshot(), before);
        assert_eq!(env.count(Op::FindResult), 0);
    }
}

#[test]
fn take_over_at_and_after_the_lease_end() {
    for offset in [0, 1] {
        let env = Fake::new();
        let p = policy_with(ExpiredLease::TakeOver);
        let k = key("a");
        let t1 = start(&env, &k, &p);
        let at = t1.lease_until + offset;
        env.set_time(at);
        let t2 = executed(decide(&env, &k, 1, &p));
        assert_eq!(
            t2,
            Ticket {
                key: k.clone(),
                record_id: t1.record_id,
                fencing_token: t1.fencing_token + 1,
                lease_until: at + LEASE,
                attempt: t1.attempt + 1,
            },
            "offset {offset}"
        );
        let rec = env.record(&k).expect("stored");
        assert_eq!(rec.status, Status::Processing);
        assert_eq!((rec.revision, rec.updated_at), (2, at));
        assert_eq!(rec.created_at, T0);
        assert_eq!(env.count(Op::FindResult), 0);
        // The first owner is fenced off.
        assert_eq!(
            complete(&env, &t1, &p, &success("late")),
            Ok(Completion::LostOwnership)
        );
        assert_eq!(
            complete(&env, &t2, &p, &success("order-2")),
            Ok(Completion::Recorded(Status::Succeeded))
        );
    }
}

#[test]
fn reconcile_policy_found_marks_succeeded_and_replays() {
    for offset in [0, 1] {
        let env = Fake::new();
        let p = policy_with(ExpiredLease::Reconcile);
        let k = key("a");
        let t1 = start(&env, &k, &p);
        env.set_result(&k, "order-found");
        let at = t1.lease_until + offset;
        env.set_time(at);
        assert_eq!(
            decide(&env, &k, 1, &p),
            Decision::Replay(Replayed {
                result_ref: Some("order-found".into()),
                response: None,
                completed_at: at,
            }),
            "offset {offset}"
        );
        assert_eq!(env.count(Op::FindResult), 1);
        let rec = env.record(&k).expect("stored");
        assert_eq!(rec.status, Status::Succeeded);
        assert_eq!(rec.fencing_token, 2);
        assert_eq!(rec.result_ref.as_deref(), Some("order-found"));
        assert_eq!(
            (rec.expires_at, rec.lease_until),
            (Some(at + RETENTION), None)
        );
        assert_eq!(check_record(&rec, &k), Ok(()));
        // Replayed from now on, without asking again.
        env.advance(5);
        assert!(matches!(decide(&env, &k, 1, &p), Decision::Replay(_)));
        assert_eq!(env.count(Op::FindResult), 1);
        assert_eq!(
            complete(&env, &t1, &p, &success("late")),
            Ok(Completion::LostOwnership)
        );
    }
}

#[test]
fn reconcile_policy_not_found_executes_again() {
    for offset in [0, 1] {
        let env = Fake::new();
        let p = policy_with(ExpiredLease::Reconcile);
        let k = key("a");
        let t1 = start(&env, &k, &p);
        let at = t1.lease_until + offset;
        env.set_time(at);
        let t2 = executed(decide(&env, &k, 1, &p));
        assert_eq!(
            (t2.record_id, t2.fencing_token, t2.attempt, t2.lease_until),
            (t1.record_id, 2, 2, at + LEASE)
        );
        assert_eq!(env.count(Op::FindResult), 1);
        assert_eq!(env.record(&k).expect("stored").fencing_token, 2);
    }
}

#[test]
fn reconcile_policy_found_response_is_stored_and_replayed() {
    let env = Fake::new();
    let p = policy_with(ExpiredLease::Reconcile);
    let k = key("a");
    let t1 = start(&env, &k, &p);
    let answer = response(200, "{\"order\":7}");
    env.set_found(
        &k,
        Success {
            result_ref: None,
            response: Some(answer.clone()),
        },
    );
    env.set_time(t1.lease_until);
    let Decision::Replay(replayed) = decide(&env, &k, 1, &p) else {
        panic!("not replayed");
    };
    assert_eq!(replayed.response, Some(answer.clone()));
    let rec = env.record(&k).expect("stored");
    assert_eq!(
        (rec.status, rec.response),
        (Status::Succeeded, Some(answer))
    );
}

#[test]
fn reconcile_policy_found_result_breaking_the_rules_is_a_failed_lookup() {
    for bad in [
        Success {
            result_ref: Some("r".repeat(validate::MAX_RESULT_REF_BYTES + 1)),
            response: None,
        },
        Success {
            result_ref: None,
            response: Some(response(99, "")),
        },
    ] {
        let env = Fake::new();
        let p = policy_with(ExpiredLease::Reconcile);
        let k = key("a");
        let t1 = start(&env, &k, &p);
        env.set_found(&k, bad);
        env.set_time(t1.lease_until);
        let StoreError::Internal(message) = store_err(begin(&env, &request(&k, 1, &p))) else {
            panic!("not an internal store error");
        };
        assert!(message.contains("result lookup"), "{message}");
        // Nothing stored from it: the key is stale as before, and the next
        // request asks again.
        let rec = env.record(&k).expect("stored");
        assert_eq!(rec.status, Status::Processing);
        assert!(rec.result_ref.is_none() && rec.response.is_none());
        assert_eq!(check_record(&rec, &k), Ok(()));
        let _ = begin(&env, &request(&k, 1, &p));
        assert_eq!(env.count(Op::FindResult), 2);
    }
}

#[test]
fn reconcile_policy_lookup_error_is_an_error_and_never_executes() {
    for offset in [0, 1] {
        let env = Fake::new();
        let p = policy_with(ExpiredLease::Reconcile);
        let k = key("a");
        let t1 = start(&env, &k, &p);
        env.find_fails.set(true);
        env.set_time(t1.lease_until + offset);
        assert!(matches!(
            store_err(begin(&env, &request(&k, 1, &p))),
            StoreError::Unavailable(_)
        ));
        // Nobody runs the action while the lookup keeps failing.
        for _ in 0..3 {
            env.advance(LEASE / 2);
            match begin(&env, &request(&k, 1, &p)) {
                Ok(Decision::Execute(t)) => panic!("executed {t:?} without a lookup"),
                Ok(_) | Err(EngineError::Store(_)) => {}
                Err(e) => panic!("unexpected {e:?}"),
            }
        }
        let rec = env.record(&k).expect("stored");
        assert_ne!(rec.status, Status::Succeeded);
        assert_eq!(check_record(&rec, &k), Ok(()));
    }
}

#[test]
fn manual_policy_answers_outcome_unknown_without_writing() {
    for offset in [0, 1] {
        let env = Fake::new();
        let p = policy_with(ExpiredLease::Manual);
        let k = key("a");
        let t1 = start(&env, &k, &p);
        env.set_result(&k, "order-found");
        env.set_time(t1.lease_until + offset);
        env.clear_calls();
        let before = env.snapshot();
        assert_eq!(
            decide(&env, &k, 1, &p),
            Decision::OutcomeUnknown(UnknownInfo {
                since: t1.lease_until,
                attempts: 1,
                failure: None,
            }),
            "offset {offset}"
        );
        assert_eq!(env.snapshot(), before);
        assert_eq!(env.calls(), vec![Op::Get]);
        // Nobody took the key over: the late owner may still complete it.
        assert_eq!(
            complete(&env, &t1, &p, &success("order-1")),
            Ok(Completion::Recorded(Status::Succeeded))
        );
        assert!(matches!(decide(&env, &k, 1, &p), Decision::Replay(_)));
    }
}

// ---------------------------------------------------------------------------
// Fencing and owner writes
// ---------------------------------------------------------------------------

#[test]
fn a_stale_ticket_is_fenced_off_and_writes_nothing() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t1 = start(&env, &k, &p);
    env.set_time(t1.lease_until);
    let t2 = executed(decide(&env, &k, 1, &p));
    env.clear_calls();
    let before = env.snapshot();
    assert_eq!(
        complete(&env, &t1, &p, &success("late")),
        Ok(Completion::LostOwnership)
    );
    for d in [
        Disposition::Retryable,
        Disposition::Final,
        Disposition::OutcomeUnknown,
    ] {
        assert_eq!(
            fail(&env, &t1, &p, &failure("late"), d),
            Ok(Completion::LostOwnership)
        );
    }
    assert_eq!(extend(&env, &t1, &p), Ok(Extension::LostOwnership));
    assert_eq!(env.snapshot(), before);
    assert_eq!(env.count(Op::Cas), 0);

    // The new owner is unaffected, and the old one stays fenced off after.
    assert_eq!(
        complete(&env, &t2, &p, &success("order-2")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    let after = env.snapshot();
    assert_eq!(
        complete(&env, &t1, &p, &success("order-2")),
        Ok(Completion::LostOwnership)
    );
    assert_eq!(extend(&env, &t1, &p), Ok(Extension::LostOwnership));
    assert_eq!(env.snapshot(), after);
}

#[test]
fn a_ticket_for_another_row_or_a_missing_record_is_lost() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t = start(&env, &k, &p);
    let mut other_row = t.clone();
    other_row.record_id += 1;
    let mut newer = t.clone();
    newer.fencing_token += 1;
    let before = env.snapshot();
    for stale in [&other_row, &newer] {
        assert_eq!(
            complete(&env, stale, &p, &success("x")),
            Ok(Completion::LostOwnership)
        );
        assert_eq!(
            fail(&env, stale, &p, &failure("x"), Disposition::Final),
            Ok(Completion::LostOwnership)
        );
        assert_eq!(extend(&env, stale, &p), Ok(Extension::LostOwnership));
    }
    assert_eq!(env.snapshot(), before);

    env.remove(&k);
    assert_eq!(
        complete(&env, &t, &p, &success("x")),
        Ok(Completion::LostOwnership)
    );
    assert_eq!(
        fail(&env, &t, &p, &failure("x"), Disposition::Retryable),
        Ok(Completion::LostOwnership)
    );
    assert_eq!(extend(&env, &t, &p), Ok(Extension::LostOwnership));
    assert_eq!(env.record(&k), None);
}

#[test]
fn extend_moves_the_lease_forward() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t = start(&env, &k, &p);
    env.advance(800);
    assert_eq!(
        extend(&env, &t, &p),
        Ok(Extension::Extended(T0 + 800 + LEASE))
    );
    let rec = env.record(&k).expect("stored");
    assert_eq!(rec.lease_until, Some(T0 + 800 + LEASE));
    assert_eq!((rec.revision, rec.updated_at), (2, T0 + 800));
    assert_eq!((rec.fencing_token, rec.attempts), (1, 1));
    // Past the original lease the key is still held.
    env.set_time(T0 + LEASE + 100);
    assert!(matches!(
        decide(&env, &k, 1, &p),
        Decision::InProgress(Busy { lease_until, .. }) if lease_until == T0 + 800 + LEASE
    ));
    // The old ticket's lease-until is informative only: it still works.
    assert_eq!(
        complete(&env, &t, &p, &success("order-1")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    // A settled key cannot be extended.
    assert_eq!(extend(&env, &t, &p), Ok(Extension::LostOwnership));
}

#[test]
fn extend_never_shortens_the_lease() {
    let env = Fake::new();
    let long = Policy {
        lease_ms: 5_000,
        ..policy()
    };
    let k = key("a");
    let t = start(&env, &k, &long);
    env.advance(10);
    assert_eq!(
        extend(&env, &t, &policy()),
        Ok(Extension::Extended(T0 + 5_000))
    );
    assert_eq!(
        env.record(&k).expect("stored").lease_until,
        Some(T0 + 5_000)
    );
}

#[test]
fn complete_retried_with_the_same_outcome_is_recorded_once() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t = start(&env, &k, &p);
    env.advance(10);
    assert_eq!(
        complete(&env, &t, &p, &success("order-1")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    let rec = env.record(&k).expect("stored");
    assert_eq!(rec.status, Status::Succeeded);
    assert_eq!(rec.result_ref.as_deref(), Some("order-1"));
    assert_eq!(rec.response, Some(response(201, "created order-1")));
    assert_eq!(
        (rec.updated_at, rec.expires_at),
        (T0 + 10, Some(T0 + 10 + RETENTION))
    );
    assert_eq!((rec.lease_until, rec.failure.clone()), (None, None));
    assert_eq!(rec.fencing_token, t.fencing_token);

    env.advance(10);
    env.clear_calls();
    assert_eq!(
        complete(&env, &t, &p, &success("order-1")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    assert_eq!(env.record(&k), Some(rec.clone()), "nothing written again");
    assert_eq!(env.count(Op::Cas), 0);

    // Another outcome for the same ticket is refused.
    for other in [
        success("order-2"),
        Success {
            result_ref: Some("order-1".into()),
            response: None,
        },
        Success {
            result_ref: Some("order-2".into()),
            response: success("order-1").response,
        },
        Success {
            result_ref: None,
            response: success("order-1").response,
        },
    ] {
        assert_eq!(
            complete(&env, &t, &p, &other),
            Ok(Completion::LostOwnership)
        );
    }
    assert_eq!(
        fail(&env, &t, &p, &failure("x"), Disposition::Final),
        Ok(Completion::LostOwnership)
    );
    assert_eq!(env.record(&k), Some(rec));
}

#[test]
fn fail_retried_with_the_same_outcome_is_recorded_once() {
    for d in [
        Disposition::Retryable,
        Disposition::Final,
        Disposition::OutcomeUnknown,
    ] {
        let env = Fake::new();
        let p = policy();
        let k = key("a");
        let t = start(&env, &k, &p);
        let stored = failed_status(d);
        assert_eq!(
            fail(&env, &t, &p, &failure("boom"), d),
            Ok(Completion::Recorded(stored))
        );
        let rec = env.record(&k).expect("stored");
        env.advance(5);
        assert_eq!(
            fail(&env, &t, &p, &failure("boom"), d),
            Ok(Completion::Recorded(stored)),
            "{d:?}"
        );
        assert_eq!(env.record(&k), Some(rec.clone()));
        assert_eq!(
            fail(&env, &t, &p, &failure("other"), d),
            Ok(Completion::LostOwnership),
            "{d:?}"
        );
        assert_eq!(
            complete(&env, &t, &p, &success("x")),
            Ok(Completion::LostOwnership),
            "{d:?}"
        );
        assert_eq!(env.record(&k), Some(rec));
    }
}

// ---------------------------------------------------------------------------
// fail: dispositions and failure modes
// ---------------------------------------------------------------------------

#[test]
fn fail_retryable_releases_the_key() {
    let env = Fake::new();
    let p = policy();
    let (k, t1) = settled_in(&env, Status::Released, &p);
    let rec = env.record(&k).expect("stored");
    assert_eq!(rec.failure, Some(failure("busy")));
    assert_eq!((rec.response.clone(), rec.result_ref.clone()), (None, None));
    assert_eq!(
        (rec.lease_until, rec.expires_at),
        (None, Some(T0 + 10 + RETENTION))
    );
    assert_eq!(rec.fencing_token, 1);
    assert_eq!(check_record(&rec, &k), Ok(()));

    env.advance(10);
    let t2 = executed(decide(&env, &k, 1, &p));
    assert_eq!(
        (t2.record_id, t2.fencing_token, t2.attempt, t2.lease_until),
        (t1.record_id, 2, 2, T0 + 20 + LEASE)
    );
    let rec = env.record(&k).expect("stored");
    assert_eq!((rec.status, rec.expires_at), (Status::Processing, None));
    assert_eq!(
        complete(&env, &t1, &p, &success("x")),
        Ok(Completion::LostOwnership)
    );
}

#[test]
fn fail_final_stores_and_replays_the_failure() {
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::Failed, &p);
    let rec = env.record(&k).expect("stored");
    assert_eq!(rec.failure, Some(failure("card-declined")));
    assert_eq!(rec.response, failure("card-declined").response);
    assert_eq!(rec.expires_at, Some(T0 + 10 + RETENTION));
    assert_eq!(check_record(&rec, &k), Ok(()));
    assert_eq!(
        decide(&env, &k, 1, &p),
        Decision::Failed(failure("card-declined"))
    );
}

#[test]
fn fail_outcome_unknown_blocks_the_key() {
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::OutcomeUnknown, &p);
    let rec = env.record(&k).expect("stored");
    let lease = env.record(&k).and_then(|r| r.lease_until);
    assert!(lease.is_some(), "the reporting owner's lease is kept");
    assert_eq!(rec.expires_at, None);
    assert_eq!(rec.failure, Some(failure("timeout")));
    assert_eq!(check_record(&rec, &k), Ok(()));
    assert!(matches!(
        decide(&env, &k, 1, &p),
        Decision::OutcomeUnknown(_)
    ));
}

#[test]
fn always_final_stores_retryable_failures_as_final() {
    let p = Policy {
        failure_mode: FailureMode::AlwaysFinal,
        ..policy()
    };
    let cases = [
        (Disposition::Retryable, Status::Failed),
        (Disposition::Final, Status::Failed),
        (Disposition::OutcomeUnknown, Status::OutcomeUnknown),
    ];
    for (given, stored) in cases {
        let env = Fake::new();
        let k = key("a");
        let t = start(&env, &k, &p);
        assert_eq!(
            fail(&env, &t, &p, &failure("e500"), given),
            Ok(Completion::Recorded(stored))
        );
        let rec = env.record(&k).expect("stored");
        assert_eq!(rec.status, stored, "{given:?}");
        let d = decide(&env, &k, 1, &p);
        match stored {
            Status::Failed => {
                assert_eq!(rec.response, failure("e500").response);
                assert_eq!(d, Decision::Failed(failure("e500")));
            }
            _ => assert!(matches!(d, Decision::OutcomeUnknown(_)), "{d:?}"),
        }
        // A retried call with the caller's own disposition is recognised.
        assert_eq!(
            fail(&env, &t, &p, &failure("e500"), given),
            Ok(Completion::Recorded(stored))
        );
    }
}

#[test]
fn effective_disposition_follows_the_failure_mode() {
    let honor = policy();
    let always = Policy {
        failure_mode: FailureMode::AlwaysFinal,
        ..policy()
    };
    for d in [
        Disposition::Retryable,
        Disposition::Final,
        Disposition::OutcomeUnknown,
    ] {
        assert_eq!(effective_disposition(&honor, d, 1), d);
        assert_eq!(effective_disposition(&honor, d, u32::MAX), d);
    }
    assert_eq!(
        effective_disposition(&always, Disposition::Retryable, 1),
        Disposition::Final
    );
    assert_eq!(
        effective_disposition(&always, Disposition::Final, 1),
        Disposition::Final
    );
    assert_eq!(
        effective_disposition(&always, Disposition::OutcomeUnknown, 1),
        Disposition::OutcomeUnknown
    );
    let three = Policy {
        max_attempts: Some(3),
        ..policy()
    };
    for (attempt, stored) in [
        (1, Disposition::Retryable),
        (2, Disposition::Retryable),
        (3, Disposition::Final),
        (4, Disposition::Final),
    ] {
        assert_eq!(
            effective_disposition(&three, Disposition::Retryable, attempt),
            stored,
            "attempt {attempt}"
        );
        assert_eq!(
            effective_disposition(&three, Disposition::OutcomeUnknown, attempt),
            Disposition::OutcomeUnknown,
            "an unknown outcome stays unknown at attempt {attempt}"
        );
    }
}

#[test]
fn a_record_written_after_the_clock_reading_is_taken_over_from_its_own_time() {
    // Another writer released the key at a later instant than this begin's
    // clock reading (the store answered after it): the take-over must not
    // write an update or a lease that starts before that write.
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::Released, &p);
    // As if written 5 s after the clock reading that begin is about to make.
    env.edit(&k, |r| {
        r.created_at += 5_000;
        r.updated_at += 5_000;
        r.expires_at = r.expires_at.map(|at| at + 5_000);
    });
    let released = env.record(&k).expect("released");
    assert!(released.updated_at > env.time());
    let t = executed(decide(&env, &k, 1, &p));
    let rec = env.record(&k).expect("taken over");
    assert!(rec.updated_at >= released.updated_at, "{rec:?}");
    assert!(rec.created_at <= rec.updated_at, "{rec:?}");
    assert_eq!(t.lease_until, released.updated_at + LEASE);
}

#[test]
fn max_attempts_makes_the_last_retryable_failure_final() {
    let env = Fake::new();
    let k = key("a");
    let p = Policy {
        max_attempts: Some(3),
        ..policy()
    };
    for attempt in 1..=2 {
        let t = start(&env, &k, &p);
        assert_eq!(t.attempt, attempt);
        assert_eq!(
            fail(&env, &t, &p, &failure("e503"), Disposition::Retryable),
            Ok(Completion::Recorded(Status::Released)),
            "attempt {attempt}"
        );
        assert_eq!(env.record(&k).expect("stored").status, Status::Released);
    }
    let t = start(&env, &k, &p);
    assert_eq!(t.attempt, 3);
    assert_eq!(
        fail(&env, &t, &p, &failure("e503"), Disposition::Retryable),
        Ok(Completion::Recorded(Status::Failed))
    );
    let rec = env.record(&k).expect("stored");
    assert_eq!(rec.status, Status::Failed);
    assert_eq!(rec.response, failure("e503").response);
    // Every duplicate now gets the failure; nobody runs a fourth attempt.
    assert_eq!(decide(&env, &k, 1, &p), Decision::Failed(failure("e503")));
    // A retried `fail` of the last attempt is recognised as stored.
    assert_eq!(
        fail(&env, &t, &p, &failure("e503"), Disposition::Retryable),
        Ok(Completion::Recorded(Status::Failed))
    );
}

#[test]
fn max_attempts_counts_owners_that_crashed() {
    // A crashed owner's attempt counts: the record, not the caller, counts
    // the attempts.
    let env = Fake::new();
    let k = key("a");
    let p = Policy {
        max_attempts: Some(2),
        ..policy()
    };
    let crashed = start(&env, &k, &p);
    assert_eq!(crashed.attempt, 1);
    env.advance(LEASE + 1);
    let t = match decide(&env, &k, 1, &p) {
        Decision::Execute(t) => t,
        other => panic!("expected a take-over, got {other:?}"),
    };
    assert_eq!(t.attempt, 2);
    assert_eq!(
        fail(&env, &t, &p, &failure("e503"), Disposition::Retryable),
        Ok(Completion::Recorded(Status::Failed))
    );
    // The crashed owner's late report is fenced off.
    assert_eq!(
        fail(&env, &crashed, &p, &failure("e503"), Disposition::Retryable),
        Ok(Completion::LostOwnership)
    );
}

#[test]
fn without_max_attempts_retryable_failures_release_the_key_every_time() {
    let env = Fake::new();
    let k = key("a");
    let p = policy();
    for attempt in 1..=20 {
        let t = start(&env, &k, &p);
        assert_eq!(t.attempt, attempt);
        assert_eq!(
            fail(&env, &t, &p, &failure("e503"), Disposition::Retryable),
            Ok(Completion::Recorded(Status::Released))
        );
    }
}

#[test]
fn max_attempts_of_zero_is_refused_and_writes_nothing() {
    let env = Fake::new();
    let k = key("a");
    let p = policy();
    let t = start(&env, &k, &p);
    let zero = Policy {
        max_attempts: Some(0),
        ..policy()
    };
    let before = env.record(&k);
    match fail(&env, &t, &zero, &failure("e503"), Disposition::Retryable) {
        Err(EngineError::Invalid(i)) => {
            assert_eq!(i.field, InputField::Policy);
            assert_eq!(i.rule, InputRule::OutOfRange);
            assert!(i.message.contains("max-attempts"), "{}", i.message);
        }
        other => panic!("expected an invalid policy, got {other:?}"),
    }
    assert_eq!(env.record(&k), before, "an invalid policy wrote");
}

#[test]
fn a_released_key_executes_again_only_for_the_same_request() {
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::Released, &p);
    let before = env.snapshot();
    assert!(matches!(
        decide(&env, &k, 2, &p),
        Decision::Mismatch(MismatchInfo { .. })
    ));
    assert_eq!(env.snapshot(), before);
    let t2 = executed(decide(&env, &k, 1, &p));
    assert_eq!((t2.fencing_token, t2.attempt), (2, 2));
    // Release again, then a third attempt.
    assert_eq!(
        fail(&env, &t2, &p, &failure("busy"), Disposition::Retryable),
        Ok(Completion::Recorded(Status::Released))
    );
    let t3 = executed(decide(&env, &k, 1, &p));
    assert_eq!((t3.fencing_token, t3.attempt), (3, 3));
}

// ---------------------------------------------------------------------------
// Retention, sweep and inspect
// ---------------------------------------------------------------------------

#[test]
fn an_expired_settled_record_is_replaced_in_place() {
    for status in [Status::Succeeded, Status::Failed, Status::Released] {
        for n in [1, 2] {
            let env = Fake::new();
            let p = policy();
            let (k, t1) = settled_in(&env, status, &p);
            let old = env.record(&k).expect("stored");
            let at = old.expires_at.expect("settled");
            env.set_time(at);
            env.clear_calls();
            let t2 = executed(decide(&env, &k, n, &p));
            assert_eq!(
                t2,
                Ticket {
                    key: k.clone(),
                    record_id: old.id,
                    fencing_token: old.fencing_token + 1,
                    lease_until: at + LEASE,
                    attempt: 1,
                },
                "{status:?} body {n}"
            );
            assert_eq!(env.calls(), vec![Op::Get, Op::Cas], "never deleted first");
            let rec = env.record(&k).expect("stored");
            assert_eq!(rec.fingerprint, fp(n));
            assert_eq!(rec.revision, old.revision + 1);
            assert_eq!((rec.created_at, rec.updated_at), (at, at));
            assert_eq!(
                (rec.result_ref, rec.response, rec.failure, rec.expires_at),
                (None, None, None, None)
            );
            assert_eq!(
                complete(&env, &t1, &p, &success("old")),
                Ok(Completion::LostOwnership)
            );
        }
    }
}

#[test]
fn retention_ends_at_expires_at() {
    let env = Fake::new();
    let p = policy();
    let (k, _) = settled_in(&env, Status::Succeeded, &p);
    let at = env.record(&k).and_then(|r| r.expires_at).expect("settled");
    env.set_time(at - 1);
    assert!(matches!(decide(&env, &k, 1, &p), Decision::Replay(_)));
    assert!(matches!(decide(&env, &k, 2, &p), Decision::Mismatch(_)));
    env.set_time(at);
    assert!(matches!(decide(&env, &k, 1, &p), Decision::Execute(_)));
}

#[test]
fn is_expired_and_lease_live_boundaries() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t = start(&env, &k, &p);
    let processing = env.record(&k).expect("stored");
    assert!(lease_live(&processing, t.lease_until - 1));
    assert!(!lease_live(&processing, t.lease_until));
    assert!(!lease_live(&processing, t.lease_until + 1));
    for now in [T0, t.lease_until, u64::MAX] {
        assert!(!is_expired(&processing, now), "processing never expires");
    }
    let mut rec = processing.clone();
    rec.lease_until = None;
    rec.expires_at = Some(T0 + 50);
    for status in [Status::Succeeded, Status::Failed, Status::Released] {
        rec.status = status;
        assert!(!is_expired(&rec, T0 + 49), "{status:?}");
        assert!(is_expired(&rec, T0 + 50), "{status:?}");
        assert!(is_expired(&rec, T0 + 51), "{status:?}");
    }
    rec.status = Status::OutcomeUnknown;
    rec.expires_at = None;
    assert!(!is_expired(&rec, u64::MAX));
}

#[test]
fn sweep_deletes_only_expired_settled_records() {
    let env = Fake::new();
    let p = policy();
    let names = [
        ("succeeded", Status::Succeeded),
        ("failed", Status::Failed),
        ("released", Status::Released),
        ("unknown", Status::OutcomeUnknown),
        ("processing", Status::Processing),
    ];
    for (name, status) in names {
        let k = key(name);
        let t = start(&env, &k, &p);
        let done = match status {
            Status::Succeeded => complete(&env, &t, &p, &success("r")),
            Status::Failed => fail(&env, &t, &p, &failure("f"), Disposition::Final),
            Status::Released => fail(&env, &t, &p, &failure("f"), Disposition::Retryable),
            Status::OutcomeUnknown => {
                fail(&env, &t, &p, &failure("f"), Disposition::OutcomeUnknown)
            }
            Status::Processing => Ok(Completion::Recorded(Status::Processing)),
        };
        assert_eq!(done, Ok(Completion::Recorded(status)));
    }
    env.set_time(T0 + RETENTION - 1);
    assert_eq!(sweep(&env, 100), Ok(0));
    env.set_time(T0 + RETENTION);
    assert_eq!(sweep(&env, 2), Ok(2), "the limit holds");
    assert_eq!(sweep(&env, 100), Ok(1));
    assert_eq!(sweep(&env, 100), Ok(0));
    let left: Vec<Status> = env.snapshot().values().map(|r| r.status).collect();
    assert_eq!(left.len(), 2);
    assert!(left.contains(&Status::Processing));
    assert!(left.contains(&Status::OutcomeUnknown));
    assert_eq!(sweep(&env, 0), Ok(0));
}

#[test]
fn a_swept_key_starts_a_new_life() {
    let env = Fake::new();
    let p = policy();
    let (k, t1) = settled_in(&env, Status::Succeeded, &p);
    env.advance(RETENTION);
    assert_eq!(sweep(&env, 10), Ok(1));
    assert_eq!(inspect(&env, &k), Ok(None));
    let t2 = executed(decide(&env, &k, 2, &p));
    assert_ne!(t2.record_id, t1.record_id);
    assert_eq!((t2.fencing_token, t2.attempt), (1, 1));
    // The ticket of the old life does not match the new row.
    assert_eq!(
        complete(&env, &t1, &p, &success("order-1")),
        Ok(Completion::LostOwnership)
    );
}

#[test]
fn inspect_reports_the_stored_record() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    assert_eq!(inspect(&env, &k), Ok(None));
    let t = start(&env, &k, &p);
    let status = inspect(&env, &k).expect("inspect").expect("present");
    assert_eq!(
        status,
        KeyStatus {
            status: Status::Processing,
            created_at: T0,
            updated_at: T0,
            expires_at: None,
            lease_until: Some(t.lease_until),
            result_ref: None,
            attempts: 1,
            fencing_token: 1,
            fingerprint: fp(1),
            fingerprint_version: FINGERPRINT_VERSION,
            expired: false,
        }
    );
    env.advance(10);
    assert_eq!(
        complete(&env, &t, &p, &success("order-1")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    let expires = T0 + 10 + RETENTION;
    env.set_time(expires - 1);
    let s = inspect(&env, &k).expect("inspect").expect("present");
    assert_eq!(
        (s.status, s.result_ref.as_deref(), s.expires_at, s.expired),
        (Status::Succeeded, Some("order-1"), Some(expires), false)
    );
    env.set_time(expires);
    assert!(
        inspect(&env, &k)
            .expect("inspect")
            .expect("present")
            .expired
    );
}

// ---------------------------------------------------------------------------
// reconcile
// ---------------------------------------------------------------------------

fn empty_report() -> ReconcileReport {
    ReconcileReport {
        examined: 0,
        succeeded: 0,
        released: 0,
        left_for_manual: 0,
        skipped: 0,
        lookup_errors: 0,
    }
}

#[test]
fn reconcile_reports_what_it_did_with_each_record() {
    let env = Fake::new();
    let p = policy_with(ExpiredLease::Reconcile);
    let found = key("found");
    let missing = key("missing");
    let broken = key("broken");
    let raced = key("raced");
    let unknown = key("unknown");
    let live = key("live");
    let mut raced_ticket = None;
    for k in [&found, &missing, &broken, &raced, &unknown] {
        let t = start(&env, k, &p);
        if k == &unknown {
            assert_eq!(
                fail(
                    &env,
                    &t,
                    &p,
                    &failure("timeout"),
                    Disposition::OutcomeUnknown
                ),
                Ok(Completion::Recorded(Status::OutcomeUnknown))
            );
        }
        if k == &raced {
            raced_ticket = Some(t);
        }
        env.advance(1);
    }
    env.set_result(&found, "order-found");
    env.set_result(&unknown, "order-unknown");
    env.find_fails_for.borrow_mut().insert(k3(&broken));
    // The owner of `raced` sends a late heartbeat between list-stale and the
    // reconciler's take-over.
    let raced_ticket = raced_ticket.expect("started");
    let hook_policy = p.clone();
    let mut fired = false;
    env.before_cas(move |env, replacement| {
        if replacement.key.idem_key == "raced" && !fired {
            fired = true;
            assert!(matches!(
                extend(env, &raced_ticket, &hook_policy),
                Ok(Extension::Extended(_))
            ));
        }
    });
    env.set_time(T0 + 10 + LEASE);
    start(&env, &live, &p);
    let at = env.time();

    let report = reconcile(&env, BIZ, &p, 100).expect("reconcile");
    assert_eq!(
        report,
        ReconcileReport {
            examined: 5,
            succeeded: 2,
            released: 1,
            left_for_manual: 0,
            skipped: 1,
            lookup_errors: 1,
        }
    );
    let rec = env.record(&found).expect("stored");
    assert_eq!(rec.status, Status::Succeeded);
    assert_eq!(rec.result_ref.as_deref(), Some("order-found"));
    assert_eq!((rec.fencing_token, rec.attempts), (2, 1));
    assert_eq!(rec.expires_at, Some(at + RETENTION));
    let rec = env.record(&unknown).expect("stored");
    assert_eq!(rec.status, Status::Succeeded);
    assert_eq!(rec.failure, None);
    let rec = env.record(&missing).expect("stored");
    assert_eq!(rec.status, Status::Released);
    assert_eq!(rec.expires_at, Some(at + RETENTION));
    let rec = env.record(&broken).expect("stored");
    assert_eq!(rec.status, Status::Processing, "left as it was");
    assert!(!lease_live(&rec, at), "still stale");
    let rec = env.record(&raced).expect("stored");
    assert_eq!(rec.status, Status::Processing);
    assert_eq!(rec.fencing_token, 1, "the heartbeat won");
    assert!(lease_live(&rec, at));
    let rec = env.record(&live).expect("stored");
    assert_eq!((rec.status, rec.revision), (Status::Processing, 1));
    for rec in env.snapshot().values() {
        assert_eq!(check_record(rec, &rec.key), Ok(()));
    }

    // What was settled is answered from the record.
    assert!(matches!(decide(&env, &found, 1, &p), Decision::Replay(_)));
    assert!(matches!(
        decide(&env, &missing, 1, &p),
        Decision::Execute(_)
    ));
}

#[test]
fn reconcile_under_manual_leaves_missing_results_for_an_operator() {
    let env = Fake::new();
    let p = policy_with(ExpiredLease::Manual);
    let found = key("found");
    let missing = key("missing");
    let unknown = key("unknown");
    for k in [&found, &missing, &unknown] {
        let t = start(&env, k, &p);
        if k == &unknown {
            assert_eq!(
                fail(
                    &env,
                    &t,
                    &p,
                    &failure("timeout"),
                    Disposition::OutcomeUnknown
                ),
                Ok(Completion::Recorded(Status::OutcomeUnknown))
            );
        }
    }
    env.set_result(&found, "order-found");
    env.set_time(T0 + LEASE);
    let report = reconcile(&env, BIZ, &p, 100).expect("reconcile");
    assert_eq!(
        report,
        ReconcileReport {
            examined: 3,
            succeeded: 1,
            left_for_manual: 2,
            ..empty_report()
        }
    );
    for k in [&missing, &unknown] {
        let rec = env.record(k).expect("stored");
        assert_eq!(rec.status, Status::OutcomeUnknown);
        assert_eq!(rec.fencing_token, 2);
        assert_eq!(check_record(&rec, k), Ok(()));
        assert!(matches!(
            decide(&env, k, 1, &p),
            Decision::OutcomeUnknown(_)
        ));
    }
    assert_eq!(
        env.record(&unknown).and_then(|r| r.failure),
        Some(failure("timeout"))
    );
    assert_eq!(
        env.record(&found).expect("stored").status,
        Status::Succeeded
    );
    // Left-for-manual records are examined again on the next run.
    env.set_result(&missing, "order-late");
    let report = reconcile(&env, BIZ, &p, 100).expect("reconcile");
    assert_eq!(
        (report.examined, report.succeeded, report.left_for_manual),
        (2, 1, 1)
    );
}

#[test]
fn reconcile_fences_off_the_old_owner() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t = start(&env, &k, &p);
    env.set_time(t.lease_until);
    assert_eq!(reconcile(&env, BIZ, &p, 10).map(|r| r.released), Ok(1));
    let rec = env.record(&k).expect("stored");
    assert_eq!(
        (rec.status, rec.fencing_token, rec.attempts),
        (Status::Released, 2, 1)
    );
    assert_eq!(
        complete(&env, &t, &p, &success("late")),
        Ok(Completion::LostOwnership)
    );
    assert_eq!(extend(&env, &t, &p), Ok(Extension::LostOwnership));
    let t2 = executed(decide(&env, &k, 1, &p));
    assert_eq!((t2.fencing_token, t2.attempt), (3, 2));
}

#[test]
fn reconcile_honours_limit_lease_boundary_and_biz_type() {
    let env = Fake::new();
    let p = policy();
    let mut other = key("a");
    other.biz_type = "refund.create".into();
    executed(decide(&env, &other, 1, &p));
    for name in ["a", "b", "c"] {
        start(&env, &key(name), &p);
        env.advance(1);
    }
    // "a" and "b" end their lease at or before now; "c" one ms later.
    env.set_time(T0 + 1 + LEASE);
    let report = reconcile(&env, BIZ, &p, 1).expect("reconcile");
    assert_eq!((report.examined, report.released), (1, 1));
    assert_eq!(env.record(&key("a")).expect("a").status, Status::Released);
    let report = reconcile(&env, BIZ, &p, 10).expect("reconcile");
    assert_eq!((report.examined, report.released), (1, 1));
    assert_eq!(env.record(&key("b")).expect("b").status, Status::Released);
    assert_eq!(env.record(&key("c")).expect("c").status, Status::Processing);
    assert_eq!(env.record(&other).expect("o").status, Status::Processing);
    assert_eq!(reconcile(&env, BIZ, &p, 0), Ok(empty_report()));
}

#[test]
fn reconcile_lookup_error_leaves_the_record_for_the_next_run() {
    let env = Fake::new();
    let p = policy_with(ExpiredLease::Manual);
    let k = key("a");
    let t = start(&env, &k, &p);
    env.set_time(t.lease_until + 5);
    env.find_fails.set(true);
    let report = reconcile(&env, BIZ, &p, 10).expect("reconcile");
    assert_eq!(
        report,
        ReconcileReport {
            examined: 1,
            lookup_errors: 1,
            ..empty_report()
        }
    );
    let rec = env.record(&k).expect("stored");
    assert_eq!(
        (rec.status, rec.lease_until, rec.attempts),
        (Status::Processing, Some(t.lease_until), 1)
    );
    assert!(matches!(
        decide(&env, &k, 1, &p),
        Decision::OutcomeUnknown(_)
    ));
    env.find_fails.set(false);
    env.set_result(&k, "order-1");
    let report = reconcile(&env, BIZ, &p, 10).expect("reconcile");
    assert_eq!((report.examined, report.succeeded), (1, 1));
    assert!(matches!(decide(&env, &k, 1, &p), Decision::Replay(_)));
}

#[test]
fn reconcile_rejects_a_listed_record_that_is_not_stale() {
    let p = policy();
    for status in [
        Status::Processing,
        Status::Succeeded,
        Status::Failed,
        Status::Released,
    ] {
        let env = Fake::new();
        let (k, _) = settled_in(&env, status, &p);
        // A live lease, or a settled record: neither is stale.
        let rec = env.record(&k).expect("stored");
        *env.stale_answer.borrow_mut() = Some(vec![rec]);
        env.clear_calls();
        let before = env.snapshot();
        let why = corrupt_err(reconcile(&env, BIZ, &p, 10));
        assert!(why.contains("not stale"), "{status:?}: {why}");
        assert_eq!(env.snapshot(), before);
        assert_eq!(env.count(Op::Cas), 0);
        assert_eq!(env.count(Op::FindResult), 0);
    }
    // A processing record whose lease ends one ms later is not stale.
    let env = Fake::new();
    let k = key("a");
    let t = start(&env, &k, &p);
    env.set_time(t.lease_until - 1);
    *env.stale_answer.borrow_mut() = Some(vec![env.record(&k).expect("stored")]);
    corrupt_err(reconcile(&env, BIZ, &p, 10));
    // An impossible record in the answer is corrupt too.
    env.set_time(t.lease_until);
    let mut rec = env.record(&k).expect("stored");
    rec.lease_until = None;
    *env.stale_answer.borrow_mut() = Some(vec![rec]);
    corrupt_err(reconcile(&env, BIZ, &p, 10));
}

#[test]
fn reconcile_rejects_a_listed_record_of_another_biz_type() {
    let env = Fake::new();
    let p = policy();
    let mut k = key("a");
    k.biz_type = "refund.create".into();
    let t = executed(decide(&env, &k, 1, &p));
    env.set_time(t.lease_until);
    *env.stale_answer.borrow_mut() = Some(vec![env.record(&k).expect("stored")]);
    let before = env.snapshot();
    let why = corrupt_err(reconcile(&env, BIZ, &p, 10));
    assert!(why.contains("biz type"), "{why}");
    assert_eq!(env.snapshot(), before);
    // Its own biz type reconciles it.
    assert_eq!(
        reconcile(&env, "refund.create", &p, 10).map(|r| r.released),
        Ok(1)
    );
}

/// Regression: `reconcile` counted a record both as `succeeded` and as
/// `skipped` when another writer overtakes it while the host is asked (a lookup slower
/// than the reconciler's lease). Per `reconcile-report` a record counts as
/// `succeeded` only when it is now succeeded; this one was skipped.
#[test]
fn reconcile_counts_a_record_overtaken_during_lookup_only_as_skipped() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t = start(&env, &k, &p);
    env.set_result(&k, "order-found");
    env.set_time(t.lease_until);
    let hook_policy = p.clone();
    let mut fired = false;
    env.on_find(move |env| {
        if !fired {
            fired = true;
            // The lookup takes longer than the reconciler's lease, and a
            // request takes the key over meanwhile.
            env.advance(LEASE);
            let k = key("a");
            assert!(matches!(
                begin(env, &request(&k, 1, &hook_policy)),
                Ok(Decision::Execute(_))
            ));
        }
    });
    let report = reconcile(&env, BIZ, &p, 10).expect("reconcile");
    let rec = env.record(&k).expect("stored");
    assert_eq!(rec.status, Status::Processing, "the request owns the key");
    assert_eq!(rec.fencing_token, 3);
    let accounted = report.succeeded
        + report.released
        + report.left_for_manual
        + report.skipped
        + report.lookup_errors;
    assert_eq!(
        report,
        ReconcileReport {
            examined: 1,
            skipped: 1,
            ..empty_report()
        },
        "each examined record is counted once (counted {accounted})"
    );
}

/// Regression: `reconcile` read the clock once per run and stamped every
/// later write with that instant. When lookups take time, a record settled late in
/// the run gets an `updated-at` before it was written and an `expires-at`
/// less than `retention-ms` after it; its take-over lease (meant to keep
/// others off while the host is asked) may already be over when written.
#[test]
fn reconcile_stamps_each_write_with_the_current_time() {
    let env = Fake::new();
    let p = policy();
    for name in ["a", "b"] {
        start(&env, &key(name), &p);
        env.set_result(&key(name), "found");
    }
    env.set_time(T0 + LEASE);
    // Each lookup takes two leases.
    env.on_find(|env| env.advance(2 * LEASE));
    let leases_during_lookup = std::rc::Rc::new(RefCell::new(Vec::new()));
    let seen = leases_during_lookup.clone();
    env.before_cas(move |env, replacement| {
        if replacement.status == Status::Processing {
            seen.borrow_mut()
                .push((env.time(), replacement.lease_until.expect("leased")));
        }
    });
    let report = reconcile(&env, BIZ, &p, 10).expect("reconcile");
    assert_eq!((report.examined, report.succeeded), (2, 2));
    for (at, until) in leases_during_lookup.borrow().iter() {
        assert!(until > at, "a take-over lease already over when written");
    }
    let b = env.record(&key("b")).expect("stored");
    let written_after = T0 + LEASE + 4 * LEASE;
    assert!(
        b.updated_at >= written_after,
        "updated-at {} is before the write at {written_after}",
        b.updated_at
    );
    assert!(
        b.expires_at
            .is_some_and(|at| at >= written_after + RETENTION)
    );
}

// ---------------------------------------------------------------------------
// check_record: impossible records are corrupt
// ---------------------------------------------------------------------------

type Tamper = fn(&mut StoredRecord);

fn settle_fields(r: &mut StoredRecord, status: Status) {
    r.status = status;
    r.lease_until = None;
    r.expires_at = Some(r.updated_at + RETENTION);
}

fn corruptions() -> Vec<(&'static str, Tamper)> {
    vec![
        ("processing without a lease", |r| r.lease_until = None),
        ("processing with an expiry", |r| {
            r.expires_at = Some(r.updated_at + RETENTION)
        }),
        ("succeeded with a failure", |r| {
            settle_fields(r, Status::Succeeded);
            r.failure = Some(failure("x"));
        }),
        ("succeeded without an expiry", |r| {
            settle_fields(r, Status::Succeeded);
            r.expires_at = None;
        }),
        ("succeeded with a lease", |r| {
            settle_fields(r, Status::Succeeded);
            r.lease_until = Some(r.updated_at + LEASE);
        }),
        ("failed without a failure", |r| {
            settle_fields(r, Status::Failed);
            r.failure = None;
        }),
        ("failed without an expiry", |r| {
            settle_fields(r, Status::Failed);
            r.failure = Some(failure("x"));
            r.expires_at = None;
        }),
        ("released with a lease", |r| {
            settle_fields(r, Status::Released);
            r.lease_until = Some(r.updated_at + LEASE);
        }),
        ("released without an expiry", |r| {
            settle_fields(r, Status::Released);
            r.expires_at = None;
        }),
        ("outcome-unknown with an expiry", |r| {
            settle_fields(r, Status::OutcomeUnknown);
        }),
        ("fencing token 0", |r| r.fencing_token = 0),
        ("revision 0", |r| r.revision = 0),
        ("attempts 0", |r| r.attempts = 0),
        ("short fingerprint", |r| {
            r.fingerprint.pop();
        }),
        ("long fingerprint", |r| r.fingerprint.push('0')),
        ("non-hex fingerprint", |r| {
            r.fingerprint.replace_range(0..1, "g");
        }),
        ("empty fingerprint", |r| r.fingerprint.clear()),
        ("non-ASCII fingerprint", |r| {
            r.fingerprint.replace_range(0..2, "é");
        }),
        ("record of another idem-key", |r| {
            r.key.idem_key = "b".into()
        }),
        ("record of another scope", |r| {
            r.key.scope = "tenant-2".into()
        }),
        ("record of another biz type", |r| {
            r.key.biz_type = "refund.create".into()
        }),
    ]
}

#[test]
fn impossible_records_are_corrupt_for_every_call() {
    for (name, tamper) in corruptions() {
        let env = Fake::new();
        let p = policy();
        let k = key("a");
        let t = start(&env, &k, &p);
        env.edit(&k, tamper);
        let rec = env.record(&k).expect("stored");
        assert!(check_record(&rec, &k).is_err(), "{name}");
        env.clear_calls();
        let before = env.snapshot();

        corrupt_err(begin(&env, &request(&k, 1, &p)));
        corrupt_err(begin(&env, &request(&k, 2, &p)));
        corrupt_err(inspect(&env, &k));
        corrupt_err(complete(&env, &t, &p, &success("x")));
        corrupt_err(fail(&env, &t, &p, &failure("x"), Disposition::Final));
        corrupt_err(extend(&env, &t, &p));
        // Even long after, when a valid record would have expired.
        env.advance(10 * RETENTION);
        corrupt_err(begin(&env, &request(&k, 1, &p)));

        assert_eq!(env.snapshot(), before, "{name}: nothing written");
        assert_eq!(env.count(Op::Cas) + env.count(Op::Insert), 0, "{name}");
    }
}

#[test]
fn a_corrupt_record_met_on_insert_is_rejected() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let mut corrupt = fresh(&k, &fp(1), T0, &p);
    corrupt.id = 7;
    corrupt.attempts = 0;
    // Another writer stores it between the engine's read and its insert.
    let mut pending = Some(corrupt);
    env.on_get(move |env| {
        if let Some(rec) = pending.take() {
            env.records.borrow_mut().insert(k3(&rec.key), rec);
        }
    });
    corrupt_err(begin(&env, &request(&k, 1, &p)));
    assert_eq!(env.calls(), vec![Op::Get, Op::Insert]);
    assert_eq!(env.record(&k).map(|r| r.attempts), Some(0));
}

#[test]
fn valid_records_of_every_status_pass_check_record() {
    let p = policy();
    for status in [
        Status::Processing,
        Status::Succeeded,
        Status::Failed,
        Status::Released,
        Status::OutcomeUnknown,
    ] {
        let env = Fake::new();
        let (k, _) = settled_in(&env, status, &p);
        let rec = env.record(&k).expect("stored");
        assert_eq!(check_record(&rec, &k), Ok(()), "{status:?}");
        assert!(inspect(&env, &k).is_ok());
    }
}

/// Regression: `check_record` accepted an upper-case fingerprint. `stored-record`
/// says `fingerprint` is lowercase hex, so the engine can never have written
/// one: per `engine-error.corrupt` it must be reported, not answered with a
/// mismatch.
#[test]
fn an_upper_case_fingerprint_is_corrupt() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    start(&env, &k, &p);
    env.edit(&k, |r| r.fingerprint = r.fingerprint.to_ascii_uppercase());
    assert!(env.record(&k).expect("stored").fingerprint != fp(1));
    corrupt_err(begin(&env, &request(&k, 1, &p)));
    corrupt_err(inspect(&env, &k));
}

// ---------------------------------------------------------------------------
// Contention
// ---------------------------------------------------------------------------

/// Every compare-and-swap of `key` loses: another writer bumps the revision
/// first (without changing anything that matters).
fn lose_every_swap(env: &Fake) {
    env.before_cas(|env, replacement| {
        let key = replacement.key.clone();
        env.edit(&key, |r| {
            r.revision += 1;
        });
    });
}

#[test]
fn begin_gives_up_after_max_contention_rounds() {
    for status in [Status::Processing, Status::Released, Status::Succeeded] {
        let env = Fake::new();
        let p = policy();
        let (k, _) = settled_in(&env, status, &p);
        // Past the lease (take-over), or past retention (replacement).
        env.advance(RETENTION + LEASE);
        lose_every_swap(&env);
        env.clear_calls();
        let d = decide(&env, &k, 1, &p);
        match d {
            Decision::InProgress(b) => {
                assert!((1..=RETRY).contains(&b.retry_after_ms), "{b:?}");
            }
            other => panic!("{status:?}: expected in-progress, got {other:?}"),
        }
        assert_eq!(
            env.count(Op::Cas),
            MAX_CONTENTION_ROUNDS as usize,
            "{status:?}"
        );
        let rec = env.record(&k).expect("stored");
        assert_eq!((rec.status, rec.fencing_token), (status, 1));
    }
}

#[test]
fn owner_writes_give_up_after_max_contention_rounds() {
    type Call = fn(&Fake, &Ticket, &Policy) -> Result<(), EngineError>;
    let calls: [(&str, Call); 3] = [
        ("complete", |env, t, p| {
            complete(env, t, p, &success("x")).map(drop)
        }),
        ("fail", |env, t, p| {
            fail(env, t, p, &failure("x"), Disposition::Final).map(drop)
        }),
        ("extend", |env, t, p| extend(env, t, p).map(drop)),
    ];
    for (name, call) in calls {
        let env = Fake::new();
        let p = policy();
        let k = key("a");
        let t = start(&env, &k, &p);
        lose_every_swap(&env);
        env.clear_calls();
        assert!(
            matches!(
                call(&env, &t, &p),
                Err(EngineError::Store(StoreError::Unavailable(_)))
            ),
            "{name}"
        );
        assert_eq!(env.count(Op::Cas), MAX_CONTENTION_ROUNDS as usize, "{name}");
        let rec = env.record(&k).expect("stored");
        assert_eq!(
            (rec.status, rec.lease_until),
            (Status::Processing, Some(t.lease_until))
        );
    }
}

#[test]
fn owner_writes_retry_after_an_unrelated_change() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t = start(&env, &k, &p);
    let mut left = 3;
    env.before_cas(move |env, replacement| {
        if left > 0 {
            left -= 1;
            env.edit(&replacement.key, |r| r.revision += 1);
        }
    });
    env.clear_calls();
    assert_eq!(
        complete(&env, &t, &p, &success("order-1")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    assert_eq!(env.count(Op::Cas), 4);
    assert_eq!(env.record(&k).expect("stored").status, Status::Succeeded);
}

#[test]
fn begin_claims_a_key_deleted_under_it() {
    let env = Fake::new();
    let p = policy();
    let (k, t1) = settled_in(&env, Status::Succeeded, &p);
    env.advance(RETENTION);
    let mut once = true;
    env.before_cas(move |env, replacement| {
        if once {
            once = false;
            env.remove(&replacement.key);
        }
    });
    env.clear_calls();
    let t2 = executed(decide(&env, &k, 2, &p));
    assert_eq!(env.calls(), vec![Op::Get, Op::Cas, Op::Insert]);
    assert_ne!(t2.record_id, t1.record_id);
    assert_eq!((t2.fencing_token, t2.attempt), (1, 1));
    assert_eq!(env.record(&k).expect("stored").fingerprint, fp(2));
}

/// An owner reads its record (revision 1); before its swap lands, the key
/// is swept and claimed again by a new owner, whose record starts over at
/// revision 1 with fencing token 1. The old owner's swap expects revision 1
/// and must not land on the new generation: the store matches the id too.
#[test]
fn a_stale_owner_never_writes_over_a_recreated_key() {
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t1 = start(&env, &k, &p);
    let hook_policy = p.clone();
    let mut once = true;
    env.before_cas(move |env, _| {
        if once {
            once = false;
            env.remove(&k);
            let t2 = start(env, &k, &hook_policy);
            assert_eq!((t2.fencing_token, t2.attempt), (1, 1));
        }
    });
    assert_eq!(
        complete(&env, &t1, &p, &success("order-1")),
        Ok(Completion::LostOwnership)
    );
    let rec = env.record(&key("a")).expect("the new generation");
    assert_ne!(rec.id, t1.record_id);
    assert_eq!((rec.status, rec.revision), (Status::Processing, 1));
    assert_eq!(rec.result_ref, None);
}

#[test]
fn begin_follows_the_record_another_writer_stored() {
    // The take-over loses to a completion by the late owner: replay.
    let env = Fake::new();
    let p = policy();
    let k = key("a");
    let t1 = start(&env, &k, &p);
    env.set_time(t1.lease_until);
    let hook_policy = p.clone();
    let mut once = true;
    env.before_cas(move |env, _| {
        if once {
            once = false;
            assert_eq!(
                complete(env, &t1, &hook_policy, &success("order-1")),
                Ok(Completion::Recorded(Status::Succeeded))
            );
        }
    });
    assert!(matches!(
        decide(&env, &k, 1, &p),
        Decision::Replay(Replayed { result_ref: Some(r), .. }) if r == "order-1"
    ));
}

// ---------------------------------------------------------------------------
// Store errors
// ---------------------------------------------------------------------------

#[test]
fn begin_passes_store_errors_on_and_never_executes() {
    for err in all_store_errors() {
        // get fails: no insert is tried.
        let env = Fake::new();
        let p = policy();
        let k = key("a");
        env.fail_next(Some(Op::Get), err.clone());
        assert_eq!(store_err(begin(&env, &request(&k, 1, &p))), err);
        assert_eq!(env.calls(), vec![Op::Get]);
        assert_eq!(env.record(&k), None);

        // insert fails.
        env.clear_calls();
        env.fail_next(Some(Op::Insert), err.clone());
        assert_eq!(store_err(begin(&env, &request(&k, 1, &p))), err);
        assert_eq!(env.calls(), vec![Op::Get, Op::Insert]);

        // compare-and-swap fails: on take-over, re-claim of a released key,
        // replacement of an expired record, and a reconcile-policy take-over.
        let cases = [
            (Status::Processing, ExpiredLease::TakeOver, LEASE),
            (Status::Processing, ExpiredLease::Reconcile, LEASE),
            (Status::Released, ExpiredLease::TakeOver, 0),
            (Status::Succeeded, ExpiredLease::TakeOver, RETENTION),
            (Status::Failed, ExpiredLease::TakeOver, RETENTION),
        ];
        for (status, expired_lease, wait) in cases {
            let env = Fake::new();
            let p = policy_with(expired_lease);
            let (k, _) = settled_in(&env, status, &p);
            env.set_result(&k, "order-found");
            env.advance(wait);
            let before = env.snapshot();
            env.fail_next(Some(Op::Cas), err.clone());
            assert_eq!(
                store_err(begin(&env, &request(&k, 1, &p))),
                err,
                "{status:?} {expired_lease:?}"
            );
            assert_eq!(env.snapshot(), before);
            assert_eq!(env.count(Op::FindResult), 0);
        }
    }
}

#[test]
fn a_store_error_on_the_settling_swap_never_executes() {
    // Reconcile policy: the take-over is stored, the lookup finds the
    // result, and storing `succeeded` fails.
    let env = Fake::new();
    let p = policy_with(ExpiredLease::Reconcile);
    let k = key("a");
    let t = start(&env, &k, &p);
    env.set_result(&k, "order-found");
    env.set_time(t.lease_until);
    let mut swaps = 0;
    env.before_cas(move |env, _| {
        swaps += 1;
        if swaps == 1 {
            env.fail_next(Some(Op::Cas), StoreError::Internal("x".into()));
        }
    });
    assert!(matches!(
        store_err(begin(&env, &request(&k, 1, &p))),
        StoreError::Internal(_)
    ));
    let rec = env.record(&k).expect("stored");
    assert_eq!((rec.status, rec.fencing_token), (Status::Processing, 2));
    // The next request sees the reconciler's live lease, not an empty key.
    assert!(matches!(decide(&env, &k, 1, &p), Decision::InProgress(_)));
}

#[test]
fn owner_calls_pass_store_errors_on() {
    for op in [Op::Get, Op::Cas] {
        for err in all_store_errors() {
            let env = Fake::new();
            let p = policy();
            let k = key("a");
            let t = start(&env, &k, &p);
            let before = env.snapshot();
            env.fail_next(Some(op), err.clone());
            assert_eq!(store_err(complete(&env, &t, &p, &success("x"))), err);
            env.fail_next(Some(op), err.clone());
            assert_eq!(
                store_err(fail(&env, &t, &p, &failure("x"), Disposition::Final)),
                err
            );
            env.fail_next(Some(op), err.clone());
            assert_eq!(store_err(extend(&env, &t, &p)), err);
            assert_eq!(env.snapshot(), before, "{op:?}");
        }
    }
}

#[test]
fn reconcile_sweep_and_inspect_pass_store_errors_on() {
    for err in all_store_errors() {
        let env = Fake::new();
        let p = policy();
        let k = key("a");
        let t = start(&env, &k, &p);
        env.set_time(t.lease_until);
        let before = env.snapshot();
        env.fail_next(Some(Op::ListStale), err.clone());
        assert_eq!(store_err(reconcile(&env, BIZ, &p, 10)), err);
        env.fail_next(Some(Op::Cas), err.clone());
        assert_eq!(store_err(reconcile(&env, BIZ, &p, 10)), err);
        assert_eq!(env.snapshot(), before);
        env.fail_next(Some(Op::DeleteExpired), err.clone());
        assert_eq!(store_err(sweep(&env, 10)), err);
        env.fail_next(Some(Op::Get), err.clone());
        assert_eq!(store_err(inspect(&env, &k)), err);
        assert_eq!(env.snapshot(), before);
    }
}

// ---------------------------------------------------------------------------
// The wait mode
// ---------------------------------------------------------------------------

#[test]
fn wait_replays_when_the_record_settles_during_the_wait() {
    let env = Fake::new();
    let p = Policy {
        lease_ms: 5_000,
        ..waiting(1_000, 100)
    };
    let k = key("a");
    let t = start(&env, &k, &p);
    let hook_policy = p.clone();
    let mut polls = 0;
    env.on_pause(move |env| {
        polls += 1;
        if polls == 3 {
            assert_eq!(
                complete(env, &t, &hook_policy, &success("order-1")),
                Ok(Completion::Recorded(Status::Succeeded))
            );
        }
    });
    env.clear_calls();
    assert_eq!(
        decide(&env, &k, 1, &p),
        Decision::Replay(Replayed {
            result_ref: Some("order-1".into()),
            response: Some(response(201, "created order-1")),
            completed_at: T0 + 300,
        })
    );
    assert_eq!(*env.pauses.borrow(), vec![100, 100, 100]);
    assert_eq!(env.time(), T0 + 300);
}

#[test]
fn wait_answers_in_progress_after_exactly_max_wait() {
    let env = Fake::new();
    let p = Policy {
        lease_ms: 5_000,
        retry_after_ms: 10_000,
        ..waiting(1_000, 300)
    };
    let k = key("a");
    let t = start(&env, &k, &p);
    let before = env.snapshot();
    assert_eq!(
        decide(&env, &k, 1, &p),
        Decision::InProgress(Busy {
            retry_after_ms: t.lease_until - (T0 + 1_000),
            lease_until: t.lease_until,
        })
    );
    assert_eq!(*env.pauses.borrow(), vec![300, 300, 300, 100]);
    assert_eq!(env.time(), T0 + 1_000, "exactly max-wait elapsed");
    assert_eq!(env.snapshot(), before);
    assert_eq!(env.count(Op::Cas), 0);
}

#[test]
fn wait_of_zero_answers_at_once() {
    let env = Fake::new();
    let p = waiting(0, 50);
    let k = key("a");
    start(&env, &k, &p);
    assert!(matches!(decide(&env, &k, 1, &p), Decision::InProgress(_)));
    assert_eq!(env.count(Op::Pause), 0);
    assert_eq!(env.time(), T0);
}

#[test]
fn wait_sees_other_outcomes_and_an_expiring_lease() {
    // A final failure during the wait.
    let env = Fake::new();
    let p = Policy {
        lease_ms: 5_000,
        ..waiting(1_000, 100)
    };
    let k = key("a");
    let t = start(&env, &k, &p);
    let hook_policy = p.clone();
    env.on_pause(move |env| {
        let _ = fail(
            env,
            &t,
            &hook_policy,
            &failure("card-declined"),
            Disposition::Final,
        );
    });
    assert_eq!(
        decide(&env, &k, 1, &p),
        Decision::Failed(failure("card-declined"))
    );
    assert_eq!(env.count(Op::Pause), 1);

    // The owner's lease runs out during the wait: take over.
    let env = Fake::new();
    let p = Policy {
        lease_ms: 250,
        ..waiting(1_000, 100)
    };
    let t1 = start(&env, &k, &p);
    let t2 = executed(decide(&env, &k, 1, &p));
    assert_eq!(*env.pauses.borrow(), vec![100, 100, 100]);
    assert_eq!((t2.fencing_token, t2.attempt), (t1.fencing_token + 1, 2));
    assert_eq!(t2.lease_until, T0 + 300 + 250);

    // A store error while polling is passed on.
    let env = Fake::new();
    let p = waiting(1_000, 100);
    start(&env, &k, &p);
    env.on_pause(|env| env.fail_next(Some(Op::Get), StoreError::Unavailable("x".into())));
    store_err(begin(&env, &request(&k, 1, &p)));
    assert_eq!(env.count(Op::Pause), 1);
}

// ---------------------------------------------------------------------------
// Property: random interleavings keep every invariant
// ---------------------------------------------------------------------------

const KEYS: usize = 3;
const OWNERS: usize = 2;

#[derive(Clone, Copy, Debug)]
enum Lookup {
    Found,
    Missing,
    Fails,
}

#[derive(Clone, Debug)]
enum Step {
    Begin {
        owner: usize,
        key: usize,
        body: u32,
        lookup: Lookup,
    },
    Complete {
        owner: usize,
        key: usize,
        variant: u8,
    },
    Fail {
        owner: usize,
        key: usize,
        disposition: Disposition,
        variant: u8,
    },
    Extend {
        owner: usize,
        key: usize,
    },
    Reconcile {
        limit: u32,
        lookup: Lookup,
    },
    Sweep {
        limit: u32,
    },
    Advance(u64),
}

fn prop_key(i: usize) -> RecordKey {
    key(&format!("k{i}"))
}

fn lookup_strategy() -> impl Strategy<Value = Lookup> {
    prop_oneof![
        Just(Lookup::Found),
        Just(Lookup::Missing),
        Just(Lookup::Fails)
    ]
}

fn step_strategy() -> impl Strategy<Value = Step> {
    let disposition = prop_oneof![
        Just(Disposition::Retryable),
        Just(Disposition::Final),
        Just(Disposition::OutcomeUnknown),
    ];
    prop_oneof![
        4 => (0..OWNERS, 0..KEYS, 1..3u32, lookup_strategy()).prop_map(
            |(owner, key, body, lookup)| Step::Begin { owner, key, body, lookup }
        ),
        2 => (0..OWNERS, 0..KEYS, 0..2u8)
            .prop_map(|(owner, key, variant)| Step::Complete { owner, key, variant }),
        2 => (0..OWNERS, 0..KEYS, disposition, 0..2u8).prop_map(
            |(owner, key, disposition, variant)| Step::Fail { owner, key, disposition, variant }
        ),
        1 => (0..OWNERS, 0..KEYS).prop_map(|(owner, key)| Step::Extend { owner, key }),
        1 => (0..4u32, lookup_strategy()).prop_map(|(limit, lookup)| Step::Reconcile { limit, lookup }),
        1 => (0..4u32).prop_map(|limit| Step::Sweep { limit }),
        3 => prop_oneof![0..60u64, 0..400u64].prop_map(Step::Advance),
    ]
}

fn policy_strategy() -> impl Strategy<Value = Policy> {
    let mode = || {
        prop_oneof![
            Just(ExpiredLease::TakeOver),
            Just(ExpiredLease::Reconcile),
            Just(ExpiredLease::Manual),
        ]
    };
    (
        (mode(), mode()),
        prop_oneof![
            Just(FailureMode::HonorDisposition),
            Just(FailureMode::AlwaysFinal),
        ],
        prop_oneof![
            Just(InProgressMode::Reject),
            Just(InProgressMode::Wait(WaitSpec {
                max_wait_ms: 120,
                poll_interval_ms: 40,
            })),
        ],
        prop_oneof![Just(None), (1u32..4).prop_map(Some)],
    )
        .prop_map(
            |((expired_lease, outcome_unknown), failure_mode, in_progress, max_attempts)| Policy {
                retention_ms: 400,
                lease_ms: 100,
                retry_after_ms: 30,
                expired_lease,
                outcome_unknown,
                failure_mode,
                max_attempts,
                in_progress,
                ..policy()
            },
        )
}

/// The fake plus what the test knows: the tickets each owner holds, and
/// every outcome recorded per ownership generation.
struct World {
    env: Fake,
    /// How many engine instances the owners' calls run on (owner `o` on
    /// instance `o % instances`), each remembering its claims; 0 for
    /// none.
    instances: usize,
    policy: Policy,
    tickets: [[Option<Ticket>; KEYS]; OWNERS],
    /// `(key, record id, fencing token)` -> the one outcome recorded for it.
    outcomes: BTreeMap<(usize, u64, u64), String>,
    /// `(key, record id, fencing token)` that were settled by a swap.
    settled: BTreeSet<(Key3, u64, u64)>,
}

impl World {
    fn new(policy: Policy, instances: usize) -> Self {
        World {
            env: Fake::instances(instances),
            instances,
            policy,
            tickets: Default::default(),
            outcomes: BTreeMap::new(),
            settled: BTreeSet::new(),
        }
    }

    fn set_lookup(&self, lookup: Lookup) {
        self.env.find_fails.set(matches!(lookup, Lookup::Fails));
        let mut results = self.env.results.borrow_mut();
        results.clear();
        if matches!(lookup, Lookup::Found) {
            for i in 0..KEYS {
                results.insert(k3(&prop_key(i)), found(&format!("found-{i}")));
            }
        }
    }

    /// Whether `t` is the current ownership generation of its key.
    fn owns(&self, t: &Ticket) -> (bool, Option<StoredRecord>) {
        let rec = self.env.record(&t.key);
        let owns = rec
            .as_ref()
            .is_some_and(|r| r.id == t.record_id && r.fencing_token == t.fencing_token);
        (owns, rec)
    }

    fn note_outcome(&mut self, key: usize, t: &Ticket, outcome: String) {
        let slot = self
            .outcomes
            .entry((key, t.record_id, t.fencing_token))
            .or_insert_with(|| outcome.clone());
        assert_eq!(
            *slot, outcome,
            "two different outcomes recorded for one fencing token"
        );
    }

    fn apply(&mut self, step: &Step) {
        let before = self.env.snapshot();
        let owner = match *step {
            Step::Begin { owner, .. }
            | Step::Complete { owner, .. }
            | Step::Fail { owner, .. }
            | Step::Extend { owner, .. } => Some(owner),
            _ => None,
        };
        // An owner's calls run on its instance; the others (reconcile,
        // sweep) on instance 0, as a host's pool would.
        if self.instances > 0 {
            self.env
                .on_instance(owner.map_or(0, |o| o % self.instances));
        }
        match *step {
            Step::Begin {
                owner,
                key,
                body,
                lookup,
            } => self.begin(owner, key, body, lookup),
            Step::Complete {
                owner,
                key,
                variant,
            } => self.complete(owner, key, variant),
            Step::Fail {
                owner,
                key,
                disposition,
                variant,
            } => self.fail(owner, key, disposition, variant),
            Step::Extend { owner, key } => self.extend(owner, key),
            Step::Reconcile { limit, lookup } => {
                self.set_lookup(lookup);
                let r = reconcile(&self.env, BIZ, &self.policy, limit).expect("reconcile");
                assert!(r.examined <= limit);
                assert_eq!(
                    r.succeeded + r.released + r.left_for_manual + r.skipped + r.lookup_errors,
                    r.examined,
                    "{r:?}"
                );
                let manual = [self.policy.expired_lease, self.policy.outcome_unknown]
                    .map(|mode| mode == ExpiredLease::Manual);
                if manual == [true, true] {
                    assert_eq!(r.released, 0);
                } else if manual == [false, false] {
                    assert_eq!(r.left_for_manual, 0);
                }
            }
            Step::Sweep { limit } => {
                let n = sweep(&self.env, limit).expect("sweep");
                assert!(n <= limit);
                assert_eq!(before.len() - self.env.snapshot().len(), n as usize);
            }
            Step::Advance(ms) => self.env.advance(ms),
        }
        self.check(&before);
    }

    fn begin(&mut self, owner: usize, key: usize, body: u32, lookup: Lookup) {
        self.set_lookup(lookup);
        let k = prop_key(key);
        let prior = self.env.record(&k);
        match begin(&self.env, &request(&k, body, &self.policy)) {
            Ok(Decision::Execute(t)) => {
                let rec = self.env.record(&k).expect("an executed key has a record");
                assert_eq!(rec.status, Status::Processing);
                assert_eq!(
                    (rec.id, rec.fencing_token, rec.lease_until, rec.attempts),
                    (t.record_id, t.fencing_token, Some(t.lease_until), t.attempt)
                );
                assert_eq!(rec.fingerprint, fp(body));
                if let Some(prior) = prior.filter(|p| p.id == t.record_id) {
                    assert!(
                        t.fencing_token > prior.fencing_token,
                        "a new owner, a new token"
                    );
                    assert!(
                        prior.status != Status::Processing || !lease_live(&prior, self.env.time()),
                        "a live lease was taken over"
                    );
                }
                self.tickets[owner][key] = Some(t);
            }
            Ok(Decision::Replay(r)) => {
                let rec = self.env.record(&k).expect("a replayed key has a record");
                assert_eq!(rec.status, Status::Succeeded);
                assert_eq!(rec.result_ref, r.result_ref);
                assert_eq!(rec.fingerprint, fp(body));
            }
            Ok(Decision::Failed(f)) => {
                let rec = self.env.record(&k).expect("a failed key has a record");
                assert_eq!(rec.status, Status::Failed);
                assert_eq!(rec.failure, Some(f));
            }
            Ok(Decision::Mismatch(m)) => {
                let rec = self.env.record(&k).expect("a mismatched key has a record");
                assert_ne!(rec.fingerprint, fp(body));
                assert_eq!(m.stored_prefix, rec.fingerprint[..8]);
            }
            Ok(Decision::InProgress(b)) => {
                assert!((1..=self.policy.retry_after_ms).contains(&b.retry_after_ms));
            }
            Ok(Decision::OutcomeUnknown(_)) => {}
            Ok(Decision::Invalid(i)) => panic!("invalid: {}", i.message),
            Err(EngineError::Store(_)) => assert!(
                matches!(lookup, Lookup::Fails)
                    && ExpiredLease::Reconcile == self.policy.expired_lease
                    || ExpiredLease::Reconcile == self.policy.outcome_unknown,
                "only a failed lookup is an error here"
            ),
            Err(e) => panic!("begin: {e:?}"),
        }
    }

    fn complete(&mut self, owner: usize, key: usize, variant: u8) {
        let Some(t) = self.tickets[owner][key].clone() else {
            return;
        };
        let (owns, prior) = self.owns(&t);
        let s = Success {
            result_ref: Some(format!("r{variant}")),
            response: None,
        };
        let c = complete(&self.env, &t, &self.policy, &s).expect("complete");
        if let Completion::Recorded(stored) = c {
            assert_eq!(stored, Status::Succeeded);
            assert!(owns, "recorded for a stale ticket");
            let rec = self.env.record(&t.key).expect("recorded");
            assert_eq!(rec.status, Status::Succeeded);
            assert_eq!(rec.result_ref, s.result_ref);
            self.note_outcome(key, &t, format!("succeeded r{variant}"));
        }
        if !owns {
            assert_eq!(c, Completion::LostOwnership);
            assert_eq!(self.env.record(&t.key), prior, "a stale ticket wrote");
        }
    }

    fn fail(&mut self, owner: usize, key: usize, disposition: Disposition, variant: u8) {
        let Some(t) = self.tickets[owner][key].clone() else {
            return;
        };
        let (owns, prior) = self.owns(&t);
        let f = Failure {
            code: format!("e{variant}"),
            message: String::new(),
            response: None,
        };
        let c = fail(&self.env, &t, &self.policy, &f, disposition).expect("fail");
        if let Completion::Recorded(stored) = c {
            assert!(owns, "recorded for a stale ticket");
            let rec = self.env.record(&t.key).expect("recorded");
            let status = match effective_disposition(&self.policy, disposition, t.attempt) {
                Disposition::Retryable => Status::Released,
                Disposition::Final => Status::Failed,
                Disposition::OutcomeUnknown => Status::OutcomeUnknown,
            };
            assert_eq!(rec.status, status);
            assert_eq!(stored, status, "recorded names another status than stored");
            assert_eq!(rec.failure, Some(f));
            self.note_outcome(key, &t, format!("{status:?} e{variant}"));
        }
        if !owns {
            assert_eq!(c, Completion::LostOwnership);
            assert_eq!(self.env.record(&t.key), prior, "a stale ticket wrote");
        }
    }

    fn extend(&mut self, owner: usize, key: usize) {
        let Some(t) = self.tickets[owner][key].clone() else {
            return;
        };
        let (owns, prior) = self.owns(&t);
        match extend(&self.env, &t, &self.policy).expect("extend") {
            Extension::Extended(until) => {
                assert!(owns, "extended a stale ticket");
                let rec = self.env.record(&t.key).expect("extended");
                assert_eq!(rec.status, Status::Processing);
                assert_eq!(rec.lease_until, Some(until));
                assert!(until >= self.env.time() + self.policy.lease_ms);
            }
            Extension::LostOwnership => {
                assert_eq!(self.env.record(&t.key), prior, "a lost extend wrote");
            }
        }
    }

    /// The invariants that hold after every step.
    fn check(&mut self, before: &BTreeMap<Key3, StoredRecord>) {
        let now = self.env.time();
        let after = self.env.snapshot();
        for (k, rec) in &after {
            assert_eq!(&k3(&rec.key), k);
            assert_eq!(check_record(rec, &rec.key), Ok(()), "{rec:?}");
            if let Some(prev) = before.get(k) {
                assert_eq!(prev.id, rec.id, "a row changed its id");
                assert!(rec.fencing_token >= prev.fencing_token, "token went back");
                assert!(rec.revision >= prev.revision, "revision went back");
                assert!(rec.attempts >= 1);
            }
        }
        for (k, prev) in before {
            // A succeeded record stays exactly as it is until it expires.
            if prev.status == Status::Succeeded && prev.expires_at.is_some_and(|at| now < at) {
                assert_eq!(after.get(k), Some(prev), "a live succeeded record changed");
            }
            if !after.contains_key(k) {
                assert!(is_expired(prev, now), "deleted before it expired: {prev:?}");
            }
        }
        for (old, new) in self.env.swaps.borrow_mut().drain(..) {
            assert!(
                new.revision > old.revision,
                "a write without a new revision"
            );
            assert!(new.fencing_token >= old.fencing_token);
            assert!(
                old.status == Status::Processing || new.status == Status::Processing,
                "{:?} -> {:?} without an owner",
                old.status,
                new.status
            );
            if new.status == Status::Processing && old.status != Status::Processing {
                assert_eq!(new.fencing_token, old.fencing_token + 1, "a new owner");
            }
            if old.status == Status::Processing && new.status != Status::Processing {
                assert_eq!(new.fencing_token, old.fencing_token, "settled by its owner");
                assert!(
                    self.settled
                        .insert((k3(&new.key), new.id, new.fencing_token)),
                    "settled twice under one fencing token: {new:?}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn prop_random_interleavings_keep_the_invariants(
        policy in policy_strategy(),
        instances in 0usize..=2,
        steps in proptest::collection::vec(step_strategy(), 1..80),
    ) {
        let mut world = World::new(policy, instances);
        for step in &steps {
            world.apply(step);
        }
    }
}

// ---------------------------------------------------------------------------
// An operator settles a stuck key
// ---------------------------------------------------------------------------

#[test]
fn settle_writes_nothing_unless_the_key_is_stuck() {
    let p = policy();
    let env = Fake::new();
    let released = Resolution::Released;
    assert_eq!(
        settle_stuck(&env, &key("none"), &p, &released),
        Ok(Settlement::Absent)
    );
    let live = key("live");
    start(&env, &live, &p);
    let (done, _) = settled_in(&env, Status::Succeeded, &p);
    let before = env.snapshot();
    for k in [&live, &done] {
        assert_eq!(
            settle_stuck(&env, k, &p, &released),
            Ok(Settlement::NotStuck)
        );
    }
    // Past its retention a settled record counts as absent.
    env.advance(RETENTION + LEASE);
    assert_eq!(
        settle_stuck(&env, &done, &p, &released),
        Ok(Settlement::Absent)
    );
    assert_eq!(env.snapshot(), before);
}

#[test]
fn settle_refuses_a_bad_resolution_and_writes_nothing() {
    let p = policy();
    let env = Fake::new();
    let (k, _) = settled_in(&env, Status::OutcomeUnknown, &p);
    let before = env.snapshot();
    let bad = Resolution::Failed(failure(""));
    let err = settle_stuck(&env, &k, &p, &bad).expect_err("an empty failure code");
    assert!(
        matches!(&err, EngineError::Invalid(i) if i.field == InputField::FailureInfo),
        "{err:?}"
    );
    assert_eq!(env.snapshot(), before);
}

#[test]
fn settle_decides_a_stuck_key_and_fences_off_its_owner() {
    let p = policy();
    for status in [Status::Processing, Status::OutcomeUnknown] {
        for resolution in [
            Resolution::Succeeded(Success {
                result_ref: Some("order-7".into()),
                response: Some(response(201, "{\"order\":7}")),
            }),
            Resolution::Failed(failure("card-declined")),
            Resolution::Released,
        ] {
            let env = Fake::new();
            let (k, t) = settled_in(&env, status, &p);
            // A crashed owner's key is stuck once its lease is over; an
            // unknown outcome is released only then (see
            // `settle_never_releases_an_unknown_outcome_within_its_lease`).
            if status == Status::Processing || resolution == Resolution::Released {
                assert_eq!(
                    settle_stuck(&env, &k, &p, &resolution),
                    Ok(Settlement::NotStuck)
                );
                env.set_time(t.lease_until);
            }
            assert_eq!(
                settle_stuck(&env, &k, &p, &resolution),
                Ok(Settlement::Settled),
                "{status:?} {resolution:?}"
            );
            let rec = env.record(&k).expect("the record stays");
            assert_eq!(rec.fencing_token, t.fencing_token + 1);
            // The owner that left it stuck can no longer write.
            assert_eq!(
                complete(&env, &t, &p, &success("late")),
                Ok(Completion::LostOwnership)
            );
            match (&resolution, decide(&env, &k, 1, &p)) {
                (Resolution::Succeeded(s), Decision::Replay(r)) => {
                    assert_eq!(
                        (r.result_ref, r.response),
                        (s.result_ref.clone(), s.response.clone())
                    );
                }
                (Resolution::Failed(f), Decision::Failed(got)) => assert_eq!(&got, f),
                (Resolution::Released, Decision::Execute(next)) => {
                    assert_eq!(next.fencing_token, t.fencing_token + 2);
                }
                (r, d) => panic!("{status:?} settled as {r:?}, then decided {d:?}"),
            }
            // Settled is not stuck.
            assert_eq!(
                settle_stuck(&env, &k, &p, &Resolution::Released),
                Ok(Settlement::NotStuck)
            );
        }
    }
}

#[test]
fn settle_never_releases_an_unknown_outcome_within_its_lease() {
    // The action of an unknown outcome may still land while the reporting
    // owner's lease lasts. An operator who knows what it came to may record
    // that at once; a release, which lets the next request run the action
    // again, waits for the lease's end, as `begin` and `reconcile` do.
    let p = policy();
    let env = Fake::new();
    let (k, t) = settled_in(&env, Status::OutcomeUnknown, &p);
    let known_env = Fake::new();
    let (known, _) = settled_in(&known_env, Status::OutcomeUnknown, &p);
    env.set_time(t.lease_until - 1);
    known_env.set_time(t.lease_until - 1);
    let before = env.record(&k).expect("stored");
    assert_eq!(
        settle_stuck(&env, &k, &p, &Resolution::Released),
        Ok(Settlement::NotStuck)
    );
    assert_eq!(env.record(&k), Some(before), "the record changed");
    assert!(matches!(
        decide(&env, &k, 1, &p),
        Decision::OutcomeUnknown(_)
    ));
    // What the action came to may be recorded within the lease.
    let s = Success {
        result_ref: Some("order-7".into()),
        response: None,
    };
    assert_eq!(
        settle_stuck(&known_env, &known, &p, &Resolution::Succeeded(s)),
        Ok(Settlement::Settled)
    );
    assert!(matches!(
        decide(&known_env, &known, 1, &p),
        Decision::Replay(_)
    ));
    // At the lease's end the release goes through, and the next request
    // executes under the next fencing token.
    env.set_time(t.lease_until);
    assert_eq!(
        settle_stuck(&env, &k, &p, &Resolution::Released),
        Ok(Settlement::Settled)
    );
    let next = executed(decide(&env, &k, 1, &p));
    assert_eq!(next.fencing_token, t.fencing_token + 2);
}

// ---------------------------------------------------------------------------
// An instance's remembered claims (`OwnedRecords`)
// ---------------------------------------------------------------------------

#[test]
fn an_owner_write_after_its_own_claim_swaps_without_reading() {
    let p = policy();
    let env = Fake::instances(1);
    let k = key("a");
    let t = start(&env, &k, &p);
    assert_eq!(env.calls(), vec![Op::Get, Op::Insert]);
    env.clear_calls();
    env.advance(10);
    assert_eq!(
        complete(&env, &t, &p, &success("order-1")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    assert_eq!(env.calls(), vec![Op::Cas], "no read before the swap");
    let rec = env.record(&k).expect("stored");
    assert_eq!(rec.status, Status::Succeeded);
    assert_eq!(rec.updated_at, T0 + 10);
    // A settled record is not kept: the retried call reads, and is
    // recognised.
    assert!(env.instances[0].is_empty());
    env.clear_calls();
    assert_eq!(
        complete(&env, &t, &p, &success("order-1")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    assert_eq!(env.calls(), vec![Op::Get]);
    // The same for `fail`, after a take-over claim.
    let k = key("b");
    let t = start(&env, &k, &p);
    env.advance(LEASE);
    let next = executed(decide(&env, &k, 1, &p));
    assert_eq!(next.fencing_token, t.fencing_token + 1);
    env.clear_calls();
    assert_eq!(
        fail(&env, &next, &p, &failure("declined"), Disposition::Final),
        Ok(Completion::Recorded(Status::Failed))
    );
    assert_eq!(env.calls(), vec![Op::Cas]);
}

#[test]
fn a_remembered_claim_that_changed_since_is_refused_by_the_swap_and_read_again() {
    let p = policy();
    // Another instance took the key over after the lease: the first
    // owner's late write is fenced, whatever its instance remembers.
    let env = Fake::instances(2);
    let k = key("a");
    let t = start(&env, &k, &p);
    env.advance(LEASE);
    env.on_instance(1);
    let next = executed(decide(&env, &k, 1, &p));
    let taken = env.record(&k);
    env.on_instance(0);
    env.clear_calls();
    assert_eq!(
        complete(&env, &t, &p, &success("late")),
        Ok(Completion::LostOwnership)
    );
    assert_eq!(
        env.calls(),
        vec![Op::Cas],
        "the refused swap answers the record"
    );
    assert_eq!(env.record(&k), taken, "a fenced owner wrote");
    env.on_instance(1);
    assert_eq!(
        complete(&env, &next, &p, &success("order-1")),
        Ok(Completion::Recorded(Status::Succeeded))
    );

    // The owner extended its lease through another instance: the record
    // moved on under the same ticket. The swap is refused once, and the
    // write goes on from the record as it is, keeping the longer lease
    // until it settles.
    let k = key("b");
    env.on_instance(0);
    let t = start(&env, &k, &p);
    env.on_instance(1);
    env.advance(100);
    assert_eq!(
        extend(&env, &t, &p),
        Ok(Extension::Extended(T0 + LEASE + 100 + LEASE))
    );
    env.on_instance(0);
    env.clear_calls();
    assert_eq!(
        fail(&env, &t, &p, &failure("busy"), Disposition::OutcomeUnknown),
        Ok(Completion::Recorded(Status::OutcomeUnknown))
    );
    assert_eq!(env.calls(), vec![Op::Cas, Op::Cas]);
    let rec = env.record(&k).expect("stored");
    assert_eq!(rec.lease_until, Some(T0 + LEASE + 100 + LEASE));
    assert_eq!(rec.revision, 3);

    // The record was swept and claimed again: the same revision, another
    // id. The old ticket cannot write the new record.
    let k = key("c");
    let t = start(&env, &k, &p);
    env.remove(&k);
    env.on_instance(1);
    let again = executed(decide(&env, &k, 2, &p));
    assert_eq!(
        env.record(&k).map(|r| r.revision),
        Some(1),
        "a new record starts over"
    );
    assert_ne!(again.record_id, t.record_id);
    let fresh = env.record(&k);
    env.on_instance(0);
    assert_eq!(
        complete(&env, &t, &p, &success("late")),
        Ok(Completion::LostOwnership)
    );
    assert_eq!(env.record(&k), fresh);
}

/// Keys that share their idempotency key but not their scope or biz type
/// are different keys to the remembered claims too: each is remembered,
/// and each owner swaps its own record without reading.
#[test]
fn remembered_claims_tell_keys_apart_by_every_part() {
    let p = policy();
    let env = Fake::instances(1);
    let keys = [
        key("same"),
        RecordKey {
            scope: "tenant-2".into(),
            ..key("same")
        },
        RecordKey {
            biz_type: "refund".into(),
            ..key("same")
        },
    ];
    let tickets: Vec<Ticket> = keys.iter().map(|k| start(&env, k, &p)).collect();
    assert_eq!(env.instances[0].len(), keys.len());
    env.clear_calls();
    for (i, t) in tickets.iter().enumerate() {
        assert_eq!(
            complete(&env, t, &p, &success(&format!("r-{i}"))),
            Ok(Completion::Recorded(Status::Succeeded))
        );
    }
    assert_eq!(env.calls(), vec![Op::Cas; keys.len()]);
    for (i, k) in keys.iter().enumerate() {
        let rec = env.record(k).expect("stored");
        assert_eq!(rec.result_ref.as_deref(), Some(format!("r-{i}").as_str()));
    }
}

#[test]
fn an_instance_remembers_a_bounded_number_of_claims_and_the_oldest_read_again() {
    use crate::owned::REMEMBERED_CLAIMS;
    let p = policy();
    let env = Fake::instances(1);
    let tickets: Vec<Ticket> = (0..=REMEMBERED_CLAIMS)
        .map(|i| start(&env, &key(&format!("k-{i}")), &p))
        .collect();
    assert_eq!(env.instances[0].len(), REMEMBERED_CLAIMS);
    env.clear_calls();
    // The first claim was pushed out: its owner reads.
    assert_eq!(
        complete(&env, &tickets[0], &p, &success("r-0")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    assert_eq!(env.calls(), vec![Op::Get, Op::Cas]);
    env.clear_calls();
    for (i, t) in tickets.iter().enumerate().skip(1) {
        assert_eq!(
            complete(&env, t, &p, &success(&format!("r-{i}"))),
            Ok(Completion::Recorded(Status::Succeeded))
        );
    }
    assert_eq!(env.calls(), vec![Op::Cas; REMEMBERED_CLAIMS]);
    assert!(env.instances[0].is_empty());
}

#[test]
fn a_store_failure_on_a_remembered_claim_leaves_the_next_try_to_read() {
    let p = policy();
    let env = Fake::instances(1);
    let k = key("a");
    let t = start(&env, &k, &p);
    env.fail_next(Some(Op::Cas), StoreError::Unavailable("gone".into()));
    assert!(matches!(
        complete(&env, &t, &p, &success("order-1")),
        Err(EngineError::Store(StoreError::Unavailable(_)))
    ));
    // Whether the swap took effect is unknown: the retry reads.
    env.clear_calls();
    assert_eq!(
        complete(&env, &t, &p, &success("order-1")),
        Ok(Completion::Recorded(Status::Succeeded))
    );
    assert_eq!(env.calls(), vec![Op::Get, Op::Cas]);
}
