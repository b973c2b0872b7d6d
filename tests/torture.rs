//! Model-based torture: many threads drive the real engine component with
//! random interleavings of begin, complete, fail, extend, sweep and
//! reconcile, random clock advances (one shared `ManualClock`) and injected
//! store faults, on the memory store and on SQLite. Every call is logged with
//! a global sequence number; afterwards the log and the records read during
//! the run are checked against a reference model of the state machine:
//!
//! - at most one business execution per key per ownership generation, and
//!   never a second owner while a first one's (acknowledged) lease is live
//!   and unsettled;
//! - a succeeded record is never lost, changed or executed again before its
//!   retention ends;
//! - no record is ever in a state the model cannot reach.
//!
//! The size is small by default (a few seconds). The large size:
//!
//! ```sh
//! IDEM_TORTURE_CASES=64 IDEM_TORTURE_THREADS=8 IDEM_TORTURE_OPS=400 \
//!     cargo test --release --test torture -- --nocapture
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use idem::store::memory::Op as StoreOp;
use idem::{
    BeginRequest, Completion, Decision, Disposition, Engine, Error, ExpiredLease, Extension,
    Failure, FaultKind, InProgressMode, InsertOutcome, ManualClock, MemoryStore, Policy,
    RecordKey, SqliteOptions, SqliteStore, Status, Storage, StoreError, StoredRecord, Success,
    SwapOutcome, Ticket, Timestamp, WaitSpec,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// The start of virtual time.
const T0: u64 = 1_767_225_600_000;
/// A short lease, so that clock advances expire it often.
const LEASE_MS: u64 = 2_000;
/// A short retention, so that records expire, are swept and re-created.
const RETENTION_MS: u64 = 10_000;
const BIZ: &str = "order.create";

/// Default sizes: a few seconds in a debug build on a busy machine.
const DEFAULT_CASES: u32 = 6;
const DEFAULT_THREADS: usize = 4;
const DEFAULT_OPS: usize = 60;
const DEFAULT_KEYS: usize = 3;

fn env_size(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// How big a run is, from `IDEM_TORTURE_*` or the defaults.
#[derive(Debug, Clone, Copy)]
struct Size {
    cases: u32,
    threads: usize,
    ops: usize,
    keys: usize,
}

impl Size {
    fn from_env() -> Size {
        Size {
            cases: u32::try_from(env_size("IDEM_TORTURE_CASES", DEFAULT_CASES as usize))
                .unwrap_or(DEFAULT_CASES),
            threads: env_size("IDEM_TORTURE_THREADS", DEFAULT_THREADS).max(2),
            ops: env_size("IDEM_TORTURE_OPS", DEFAULT_OPS).max(1),
            keys: env_size("IDEM_TORTURE_KEYS", DEFAULT_KEYS).max(1),
        }
    }
}

// ---------------------------------------------------------------------------
// Faults: a wrapper over any store, shared by every thread of a case.

#[derive(Clone, Default)]
struct Faults {
    pending: Arc<Mutex<Vec<(Option<StoreOp>, FaultKind)>>>,
    lookup_failures: Arc<AtomicU64>,
}

impl Faults {
    fn arm(&self, op: Option<StoreOp>, kind: FaultKind) {
        self.pending.lock().unwrap().push((op, kind));
    }

    fn clear(&self) {
        self.pending.lock().unwrap().clear();
        self.lookup_failures.store(0, Ordering::SeqCst);
    }

    fn take(&self, op: StoreOp) -> Option<FaultKind> {
        let mut pending = self.pending.lock().unwrap();
        let i = pending
            .iter()
            .position(|(o, _)| o.is_none_or(|o| o == op))?;
        Some(pending.remove(i).1)
    }
}

/// Any store with injected faults: `Unavailable` and `Internal` fail before
/// the call, `LostAck` applies it and then reports `Unavailable`.
struct Faulty {
    inner: Arc<dyn Storage>,
    faults: Faults,
}

impl Faulty {
    fn run<R>(
        &self,
        op: StoreOp,
        f: impl FnOnce(&dyn Storage) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        match self.faults.take(op) {
            None => f(&*self.inner),
            Some(FaultKind::Unavailable) => {
                Err(StoreError::Unavailable(format!("torture: {op:?}")))
            }
            Some(FaultKind::Internal) => Err(StoreError::Internal(format!("torture: {op:?}"))),
            Some(FaultKind::LostAck) => {
                f(&*self.inner)?;
                Err(StoreError::Unavailable(format!("torture: {op:?} ack lost")))
            }
        }
    }
}

impl Storage for Faulty {
    fn insert_if_absent(&self, candidate: &StoredRecord) -> Result<InsertOutcome, StoreError> {
        self.run(StoreOp::InsertIfAbsent, |s| s.insert_if_absent(candidate))
    }

    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
        self.run(StoreOp::Get, |s| s.get(key))
    }

    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError> {
        self.run(StoreOp::CompareAndSwap, |s| {
            s.compare_and_swap(expected_revision, replacement)
        })
    }

    fn delete_expired(&self, now: Timestamp, limit: u32) -> Result<u32, StoreError> {
        self.run(StoreOp::DeleteExpired, |s| s.delete_expired(now, limit))
    }

    fn list_stale(
        &self,
        biz_type: &str,
        now: Timestamp,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        self.run(StoreOp::ListStale, |s| s.list_stale(biz_type, now, limit))
    }

    fn count_by_status(&self) -> Result<Vec<(Status, u64)>, StoreError> {
        self.run(StoreOp::CountByStatus, |s| s.count_by_status())
    }
}

// ---------------------------------------------------------------------------
// The plan: what each thread does, generated by proptest.

#[derive(Debug, Clone)]
enum Action {
    /// `begin` on key `key` with body variant `body` (two bodies: the second
    /// is a mismatch while the first is stored).
    Begin { key: usize, body: u8 },
    /// `complete` one of the thread's tickets.
    Complete { ticket: usize },
    /// `fail` one of the thread's tickets.
    Fail {
        ticket: usize,
        disposition: Disposition,
    },
    /// `extend` one of the thread's tickets.
    Extend { ticket: usize },
    /// Forget a ticket: the owner crashed.
    Abandon { ticket: usize },
    Sweep,
    Reconcile,
    /// Move the shared clock forward.
    Advance { ms: u64 },
    /// Arm one store fault for the next matching call of any thread.
    Fault {
        op: Option<StoreOp>,
        kind: FaultKind,
    },
    /// Make the next business lookups fail.
    LookupFault,
    /// Read every key's record for the checks.
    Snapshot,
}

fn action(keys: usize) -> impl Strategy<Value = Action> {
    let op = prop_oneof![
        Just(None),
        Just(Some(StoreOp::Get)),
        Just(Some(StoreOp::InsertIfAbsent)),
        Just(Some(StoreOp::CompareAndSwap)),
        Just(Some(StoreOp::DeleteExpired)),
        Just(Some(StoreOp::ListStale)),
    ];
    let kind = prop_oneof![
        Just(FaultKind::Unavailable),
        Just(FaultKind::Internal),
        Just(FaultKind::LostAck),
    ];
    let disposition = prop_oneof![
        Just(Disposition::Retryable),
        Just(Disposition::Final),
        Just(Disposition::OutcomeUnknown),
    ];
    prop_oneof![
        8 => (0..keys, 0..2u8).prop_map(|(key, body)| Action::Begin { key, body }),
        5 => any::<usize>().prop_map(|ticket| Action::Complete { ticket }),
        2 => (any::<usize>(), disposition)
            .prop_map(|(ticket, disposition)| Action::Fail { ticket, disposition }),
        2 => any::<usize>().prop_map(|ticket| Action::Extend { ticket }),
        1 => any::<usize>().prop_map(|ticket| Action::Abandon { ticket }),
        1 => Just(Action::Sweep),
        1 => Just(Action::Reconcile),
        4 => prop_oneof![
            0..LEASE_MS / 2,
            LEASE_MS / 2..LEASE_MS * 2,
            RETENTION_MS / 2..RETENTION_MS * 2,
        ]
        .prop_map(|ms| Action::Advance { ms }),
        2 => (op, kind).prop_map(|(op, kind)| Action::Fault { op, kind }),
        1 => Just(Action::LookupFault),
        2 => Just(Action::Snapshot),
    ]
}

#[derive(Debug, Clone)]
struct Plan {
    expired_lease: ExpiredLease,
    wait: bool,
    threads: Vec<Vec<Action>>,
}

fn plan(size: Size) -> impl Strategy<Value = Plan> {
    let expired = prop_oneof![
        Just(ExpiredLease::TakeOver),
        Just(ExpiredLease::Reconcile),
        Just(ExpiredLease::Manual),
    ];
    (
        expired,
        any::<bool>(),
        proptest::collection::vec(
            proptest::collection::vec(action(size.keys), size.ops),
            size.threads,
        ),
    )
        .prop_map(|(expired_lease, wait, threads)| Plan {
            expired_lease,
            wait,
            threads,
        })
}

// ---------------------------------------------------------------------------
// The log of what the callers saw.

#[derive(Debug, Clone)]
enum Event {
    /// `begin` answered `execute`: the business action ran once, now.
    Granted {
        ticket: Ticket,
        /// The engine's clock when it claimed the key.
        claim_now: u64,
        start: u64,
        end: u64,
    },
    /// `extend` acknowledged: no other owner before `until`.
    Extended {
        ticket: Ticket,
        until: u64,
        end: u64,
    },
    /// A `complete` or `fail` was called (whatever came of it).
    SettleCalled { ticket: Ticket, start: u64 },
    /// `complete` acknowledged: the record is succeeded with `result_ref`
    /// until at least `expires_low`.
    Succeeded {
        ticket: Ticket,
        result_ref: String,
        expires_low: u64,
        end: u64,
    },
    /// A record as read directly from the store.
    Snapshot {
        key: RecordKey,
        record: Option<StoredRecord>,
        /// The clock just after the read.
        clock_after: u64,
        start: u64,
        end: u64,
    },
}

#[derive(Default)]
struct Log {
    seq: AtomicU64,
    events: Mutex<Vec<Event>>,
    /// Business results: key → result refs of every execution that took
    /// effect (a retryable failure rolls its own back).
    business: Mutex<HashMap<RecordKey, Vec<String>>>,
    ops: AtomicU64,
}

impl Log {
    fn tick(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst)
    }

    fn push(&self, e: Event) {
        self.events.lock().unwrap().push(e);
    }
}

fn result_ref(t: &Ticket) -> String {
    format!("r-{}-{}-{}", t.key.idem_key, t.record_id, t.fencing_token)
}

fn key(i: usize) -> RecordKey {
    RecordKey::new("tenant-1", BIZ, format!("key-{i}"))
}

fn body(variant: u8) -> String {
    format!("{{\"sku\":\"A{variant}\",\"qty\":1}}")
}

// ---------------------------------------------------------------------------
// One case.

struct World {
    engine: Engine,
    clock: ManualClock,
    faults: Faults,
    inner: Arc<dyn Storage>,
    policy: Policy,
    log: Arc<Log>,
    keys: usize,
}

fn world(backend: &Backend, plan: &Plan, keys: usize) -> anyhow::Result<(World, Option<tempfile::TempDir>)> {
    let (inner, dir): (Arc<dyn Storage>, _) = match backend {
        Backend::Memory => (Arc::new(MemoryStore::new()), None),
        Backend::Sqlite => {
            let dir = tempfile::tempdir()?;
            let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())?;
            (Arc::new(store), Some(dir))
        }
    };
    let clock = ManualClock::new(T0);
    let faults = Faults::default();
    let log = Arc::new(Log::default());
    let lookup = {
        let (log, faults) = (log.clone(), faults.clone());
        move |k: &RecordKey| -> Result<Option<String>, StoreError> {
            if faults
                .lookup_failures
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(StoreError::Unavailable("torture: lookup".into()));
            }
            Ok(log
                .business
                .lock()
                .unwrap()
                .get(k)
                .and_then(|refs| refs.last().cloned()))
        }
    };
    let engine = Engine::builder()
        .storage(Faulty {
            inner: inner.clone(),
            faults: faults.clone(),
        })
        .clock(clock.clone())
        .results(lookup)
        .build()?;
    let policy = Policy {
        retention_ms: RETENTION_MS,
        lease_ms: LEASE_MS,
        retry_after_ms: 500,
        expired_lease: plan.expired_lease,
        in_progress: if plan.wait {
            InProgressMode::Wait(WaitSpec {
                max_wait_ms: 300,
                poll_interval_ms: 100,
            })
        } else {
            InProgressMode::Reject
        },
        ..Policy::default()
    };
    Ok((
        World {
            engine,
            clock,
            faults,
            inner,
            policy,
            log,
            keys,
        },
        dir,
    ))
}

impl World {
    /// An engine error the model allows: a store failure (injected, or
    /// SQLite busy). Anything else fails the case.
    fn allowed(&self, what: &str, e: Error) -> Result<(), TestCaseError> {
        match e {
            Error::Store(_) => Ok(()),
            other => Err(TestCaseError::fail(format!("{what}: {other}"))),
        }
    }

    fn snapshot(&self) {
        for i in 0..self.keys {
            let k = key(i);
            let start = self.log.tick();
            let Ok(record) = self.inner.get(&k) else {
                continue;
            };
            let clock_after = self.clock.read();
            let end = self.log.tick();
            self.log.push(Event::Snapshot {
                key: k,
                record,
                clock_after,
                start,
                end,
            });
        }
    }

    fn begin(&self, tickets: &mut Vec<Ticket>, k: usize, variant: u8) -> Result<(), TestCaseError> {
        let req = BeginRequest::json(key(k), body(variant), self.policy.clone());
        let start = self.log.tick();
        let decision = self.engine.begin(&req);
        let end = self.log.tick();
        match decision {
            Ok(Decision::Execute(ticket)) => {
                // The business action takes effect at once.
                self.log
                    .business
                    .lock()
                    .unwrap()
                    .entry(ticket.key.clone())
                    .or_default()
                    .push(result_ref(&ticket));
                self.log.push(Event::Granted {
                    claim_now: ticket.lease_until - self.policy.lease_ms,
                    ticket: ticket.clone(),
                    start,
                    end,
                });
                tickets.push(ticket);
                Ok(())
            }
            Ok(Decision::Invalid(i)) => Err(TestCaseError::fail(format!("begin: invalid {i:?}"))),
            Ok(_) => Ok(()),
            Err(e) => self.allowed("begin", e),
        }
    }

    fn complete(&self, t: &Ticket) -> Result<(), TestCaseError> {
        let start = self.log.tick();
        self.log.push(Event::SettleCalled {
            ticket: t.clone(),
            start,
        });
        let before = self.clock.read();
        let r = result_ref(t);
        let answer = self
            .engine
            .complete(t, &self.policy, &Success::with_ref(r.clone()));
        let end = self.log.tick();
        match answer {
            Ok(Completion::Recorded) => {
                self.log.push(Event::Succeeded {
                    ticket: t.clone(),
                    result_ref: r,
                    expires_low: before + self.policy.retention_ms,
                    end,
                });
                Ok(())
            }
            Ok(Completion::LostOwnership) => Ok(()),
            Err(e) => self.allowed("complete", e),
        }
    }

    fn fail(&self, t: &Ticket, disposition: Disposition) -> Result<(), TestCaseError> {
        let start = self.log.tick();
        self.log.push(Event::SettleCalled {
            ticket: t.clone(),
            start,
        });
        let failure = Failure {
            code: format!("{disposition:?}").to_lowercase(),
            message: "torture".into(),
            response: None,
        };
        let answer = self.engine.fail(t, &self.policy, &failure, disposition);
        if disposition == Disposition::Retryable && matches!(answer, Ok(Completion::Recorded)) {
            // Nothing took effect: roll the business write back.
            let r = result_ref(t);
            if let Some(refs) = self.log.business.lock().unwrap().get_mut(&t.key) {
                refs.retain(|x| *x != r);
            }
        }
        match answer {
            Ok(_) => Ok(()),
            Err(e) => self.allowed("fail", e),
        }
    }

    fn extend(&self, t: &Ticket) -> Result<(), TestCaseError> {
        match self.engine.extend(t, &self.policy) {
            Ok(Extension::Extended(until)) => {
                let end = self.log.tick();
                self.log.push(Event::Extended {
                    ticket: t.clone(),
                    until,
                    end,
                });
                Ok(())
            }
            Ok(Extension::LostOwnership) => Ok(()),
            Err(e) => self.allowed("extend", e),
        }
    }

    fn run(&self, actions: &[Action]) -> Result<(), TestCaseError> {
        let mut tickets: Vec<Ticket> = Vec::new();
        let pick = |tickets: &Vec<Ticket>, i: usize| -> Option<Ticket> {
            (!tickets.is_empty()).then(|| tickets[i % tickets.len()].clone())
        };
        for a in actions {
            self.log.ops.fetch_add(1, Ordering::Relaxed);
            match a {
                Action::Begin { key, body } => self.begin(&mut tickets, *key, *body)?,
                Action::Complete { ticket } => {
                    if let Some(t) = pick(&tickets, *ticket) {
                        self.complete(&t)?;
                    }
                }
                Action::Fail {
                    ticket,
                    disposition,
                } => {
                    if let Some(t) = pick(&tickets, *ticket) {
                        self.fail(&t, *disposition)?;
                    }
                }
                Action::Extend { ticket } => {
                    if let Some(t) = pick(&tickets, *ticket) {
                        self.extend(&t)?;
                    }
                }
                Action::Abandon { ticket } => {
                    if !tickets.is_empty() {
                        let i = *ticket % tickets.len();
                        tickets.swap_remove(i);
                    }
                }
                Action::Sweep => {
                    if let Err(e) = self.engine.sweep(100) {
                        self.allowed("sweep", e)?;
                    }
                }
                Action::Reconcile => {
                    if let Err(e) = self.engine.reconcile(BIZ, &self.policy, 100) {
                        self.allowed("reconcile", e)?;
                    }
                }
                Action::Advance { ms } => self.clock.advance(*ms),
                Action::Fault { op, kind } => self.faults.arm(*op, *kind),
                Action::LookupFault => {
                    self.faults.lookup_failures.fetch_add(1, Ordering::SeqCst);
                }
                Action::Snapshot => self.snapshot(),
            }
        }
        Ok(())
    }

    /// After the threads: no faults, every lease over, reconcile, then one
    /// more `begin` per key, and a last snapshot.
    fn settle_everything(&self) -> Result<(), TestCaseError> {
        self.faults.clear();
        self.clock.advance(LEASE_MS * 4);
        self.snapshot();
        if let Err(e) = self.engine.reconcile(BIZ, &self.policy, 1000) {
            return Err(TestCaseError::fail(format!("final reconcile: {e}")));
        }
        let mut tickets = Vec::new();
        for k in 0..self.keys {
            self.begin(&mut tickets, k, 0)?;
        }
        for t in &tickets {
            self.complete(t)?;
        }
        self.snapshot();
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// The checks.

fn fail<T>(msg: String) -> Result<T, TestCaseError> {
    Err(TestCaseError::fail(msg))
}

/// The states the engine can write, field by field.
fn check_shape(r: &StoredRecord, clock_after: u64) -> Result<(), TestCaseError> {
    let ok = r.fencing_token >= 1
        && r.revision >= 1
        && r.attempts >= 1
        && u64::from(r.attempts) <= r.fencing_token
        && r.created_at <= r.updated_at
        && r.updated_at <= clock_after
        && r.fingerprint.len() == 64;
    if !ok {
        return fail(format!("impossible counters or times: {r:?}"));
    }
    let settled_expiry = r
        .expires_at
        .is_some_and(|e| e > r.updated_at && e <= r.updated_at + RETENTION_MS);
    let ok = match r.status {
        Status::Processing => {
            r.expires_at.is_none()
                && r.lease_until.is_some_and(|l| l <= clock_after + LEASE_MS)
                && r.result_ref.is_none()
        }
        Status::Succeeded => {
            settled_expiry
                && r.lease_until.is_none()
                && r.failure.is_none()
                && r
                    .result_ref
                    .as_deref()
                    .is_some_and(|x| x.starts_with(&format!("r-{}-", r.key.idem_key)))
        }
        Status::Failed => {
            settled_expiry
                && r.lease_until.is_none()
                && r.result_ref.is_none()
                && r.failure.as_ref().is_some_and(|f| f.code == "final")
        }
        // Released by a retryable failure, or by reconciliation (which
        // keeps the failure an earlier owner reported).
        Status::Released => {
            settled_expiry
                && r.lease_until.is_none()
                && r.result_ref.is_none()
                && r.failure.as_ref().is_none_or(|f| f.code != "final")
        }
        Status::OutcomeUnknown => {
            r.expires_at.is_none()
                && r.result_ref.is_none()
                && r.failure.as_ref().is_none_or(|f| f.code != "final")
        }
    };
    if ok {
        Ok(())
    } else {
        fail(format!("a record in a state the model cannot reach: {r:?}"))
    }
}

fn check(log: &Log) -> Result<(), TestCaseError> {
    let events = log.events.lock().unwrap().clone();
    let mut granted: Vec<(&Ticket, u64, u64, u64)> = Vec::new();
    let mut extended: Vec<(&Ticket, u64, u64)> = Vec::new();
    let mut settle_called: Vec<(&Ticket, u64)> = Vec::new();
    let mut succeeded: Vec<(&Ticket, &str, u64, u64)> = Vec::new();
    let mut snapshots: Vec<(&RecordKey, Option<&StoredRecord>, u64, u64, u64)> = Vec::new();
    for e in &events {
        match e {
            Event::Granted {
                ticket,
                claim_now,
                start,
                end,
            } => granted.push((ticket, *claim_now, *start, *end)),
            Event::Extended { ticket, until, end } => extended.push((ticket, *until, *end)),
            Event::SettleCalled { ticket, start } => settle_called.push((ticket, *start)),
            Event::Succeeded {
                ticket,
                result_ref,
                expires_low,
                end,
            } => succeeded.push((ticket, result_ref, *expires_low, *end)),
            Event::Snapshot {
                key,
                record,
                clock_after,
                start,
                end,
            } => snapshots.push((key, record.as_ref(), *clock_after, *start, *end)),
        }
    }
    let same = |a: &Ticket, b: &Ticket| {
        a.key == b.key && a.record_id == b.record_id && a.fencing_token == b.fencing_token
    };

    // 1. One execution per key per ownership generation.
    let mut generations = HashSet::new();
    for (t, ..) in &granted {
        if !generations.insert((t.key.clone(), t.record_id, t.fencing_token)) {
            return fail(format!("two executions under one generation: {t:?}"));
        }
        if u64::from(t.attempt) > t.fencing_token {
            return fail(format!("a ticket with more attempts than tokens: {t:?}"));
        }
    }
    // ... and no second owner while the first one's lease is live.
    for &(a, _, _, a_end) in &granted {
        for &(b, b_claim, b_start, b_end) in &granted {
            if a.key != b.key || same(a, b) || b_start < a_end {
                continue;
            }
            let lease = extended
                .iter()
                .filter(|(t, _, end)| same(t, a) && *end < b_start)
                .map(|(_, until, _)| *until)
                .fold(a.lease_until, u64::max);
            let settled = settle_called
                .iter()
                .any(|(t, start)| same(t, a) && *start < b_end);
            if b_claim < lease && !settled {
                return fail(format!(
                    "{b:?} claimed at {b_claim} while {a:?} held a live lease until {lease}"
                ));
            }
        }
    }

    // 2. A success stands until its retention ends.
    for &(s, r, expires_low, s_end) in &succeeded {
        for &(b, b_claim, b_start, _) in &granted {
            if b.key == s.key && b_start > s_end && b_claim < expires_low {
                return fail(format!(
                    "{b:?} executed at {b_claim}, inside the retention of the success of {s:?} \
                     (until at least {expires_low})"
                ));
            }
        }
        for &(k, record, clock_after, start, _) in &snapshots {
            if *k != s.key || start < s_end || clock_after >= expires_low {
                continue;
            }
            let intact = record.is_some_and(|rec| {
                rec.id == s.record_id
                    && rec.status == Status::Succeeded
                    && rec.result_ref.as_deref() == Some(r)
            });
            if !intact {
                return fail(format!(
                    "the success {r} of {s:?} was lost or overwritten before {expires_low}: \
                     read {record:?} at {clock_after}"
                ));
            }
        }
    }

    // 3. Every record read is one the model can reach, and records only
    //    move forward.
    let issued: HashSet<String> = granted.iter().map(|(t, ..)| result_ref(t)).collect();
    let mut by_key: BTreeMap<&str, Vec<(u64, u64, &StoredRecord)>> = BTreeMap::new();
    for &(k, record, clock_after, start, end) in &snapshots {
        let Some(rec) = record else { continue };
        check_shape(rec, clock_after)?;
        if rec.key != *k {
            return fail(format!("a record under another key: {rec:?}"));
        }
        if let Some(r) = &rec.result_ref
            && !issued.contains(r)
        {
            return fail(format!("a result nobody produced: {rec:?}"));
        }
        by_key
            .entry(k.idem_key.as_str())
            .or_default()
            .push((start, end, rec));
    }
    for reads in by_key.values() {
        for &(_, a_end, a) in reads {
            for &(b_start, _, b) in reads {
                if b_start <= a_end {
                    continue;
                }
                let backwards = b.id < a.id
                    || (b.id == a.id
                        && (b.revision < a.revision
                            || b.fencing_token < a.fencing_token
                            || b.created_at < a.created_at));
                if backwards {
                    return fail(format!("a record went back: {a:?} then {b:?}"));
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The runner.

#[derive(Debug, Clone, Copy)]
enum Backend {
    Memory,
    Sqlite,
}

fn run_case(backend: Backend, plan: &Plan, size: Size) -> Result<u64, TestCaseError> {
    let (world, _dir) = world(&backend, plan, size.keys)
        .map_err(|e| TestCaseError::fail(format!("setup: {e:#}")))?;
    let world = Arc::new(world);
    let handles: Vec<_> = plan
        .threads
        .iter()
        .cloned()
        .map(|actions| {
            let world = world.clone();
            std::thread::spawn(move || world.run(&actions))
        })
        .collect();
    for h in handles {
        h.join()
            .map_err(|_| TestCaseError::fail("a thread panicked"))??;
    }
    world.settle_everything()?;
    check(&world.log)?;
    Ok(world.log.ops.load(Ordering::Relaxed))
}

fn torture(backend: Backend) {
    let size = Size::from_env();
    let started = Instant::now();
    let ops = AtomicU64::new(0);
    let config = Config {
        cases: size.cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&plan(size), |plan| {
        ops.fetch_add(run_case(backend, &plan, size)?, Ordering::Relaxed);
        Ok(())
    });
    println!(
        "torture {backend:?}: {} cases x {} threads x {} ops on {} keys: {} operations in {:.1} s",
        size.cases,
        size.threads,
        size.ops,
        size.keys,
        ops.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn torture_memory_store() {
    torture(Backend::Memory);
}

#[test]
fn torture_sqlite_store() {
    torture(Backend::Sqlite);
}
