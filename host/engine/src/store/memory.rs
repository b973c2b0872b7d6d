//! An in-memory [`Storage`] with the same semantics as the SQLite backend,
//! plus fault injection for tests.
//!
//! Every operation runs under one lock, so each is atomic with respect to
//! every other. Ids come from a counter that starts at 1 and never goes back,
//! so an id is never reused, even after its record is deleted. Unlike SQLite,
//! the memory store has no column limits: it accepts every `u64`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{StaleCursor, Storage, StoreError};
use crate::types::{InsertOutcome, RecordKey, Status, StoredRecord, SwapOutcome, Timestamp};

/// One [`Storage`] operation, for fault injection and call counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// [`Storage::insert_if_absent`].
    InsertIfAbsent,
    /// [`Storage::get`].
    Get,
    /// [`Storage::compare_and_swap`].
    CompareAndSwap,
    /// [`Storage::delete_expired`].
    DeleteExpired,
    /// [`Storage::list_stale`].
    ListStale,
    /// [`Storage::count_by_status`].
    CountByStatus,
}

impl Op {
    /// Every operation, in declaration order.
    pub const ALL: [Op; 6] = [
        Op::InsertIfAbsent,
        Op::Get,
        Op::CompareAndSwap,
        Op::DeleteExpired,
        Op::ListStale,
        Op::CountByStatus,
    ];

    fn index(self) -> usize {
        match self {
            Op::InsertIfAbsent => 0,
            Op::Get => 1,
            Op::CompareAndSwap => 2,
            Op::DeleteExpired => 3,
            Op::ListStale => 4,
            Op::CountByStatus => 5,
        }
    }
}

/// How an injected fault fails a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// Nothing is done; the call returns [`StoreError::Unavailable`].
    Unavailable,
    /// Nothing is done; the call returns [`StoreError::Internal`].
    Internal,
    /// The write is applied, then Unavailable is returned (a lost
    /// acknowledgement). On a read, the read happens and its answer is lost.
    LostAck,
}

#[derive(Debug)]
struct Fault {
    op: Option<Op>,
    remaining: u32,
    kind: FaultKind,
}

#[derive(Debug, Default)]
struct State {
    records: BTreeMap<RecordKey, StoredRecord>,
    /// The last id handed out; ids start at 1.
    last_id: u64,
    /// Pending faults, oldest first.
    faults: Vec<Fault>,
    disconnected: bool,
    calls: [u64; Op::ALL.len()],
}

impl State {
    /// Consumes one matching fault, the oldest registered first.
    fn take_fault(&mut self, op: Op) -> Option<FaultKind> {
        let index = self
            .faults
            .iter()
            .position(|f| f.remaining > 0 && f.op.is_none_or(|o| o == op))?;
        let fault = &mut self.faults[index];
        fault.remaining -= 1;
        let kind = fault.kind;
        if fault.remaining == 0 {
            self.faults.remove(index);
        }
        Some(kind)
    }
}

/// An in-memory [`Storage`] for tests and examples.
///
/// Cheap to clone: clones share the same records. Not durable.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the next `count` calls of `op` (of any operation when `None`)
    /// fail with `kind`. Faults registered earlier are used up first; a
    /// call consumes at most one fault. Calls while disconnected consume
    /// none.
    pub fn fail_next(&self, op: Option<Op>, count: u32, kind: FaultKind) {
        if count > 0 {
            self.lock().faults.push(Fault {
                op,
                remaining: count,
                kind,
            });
        }
    }

    /// Drops every pending fault registered with [`fail_next`](Self::fail_next).
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// From now on every call returns `Unavailable("connection lost")`
    /// without touching the records, until [`reconnect`](Self::reconnect).
    pub fn disconnect(&self) {
        self.lock().disconnected = true;
    }

    /// Ends a [`disconnect`](Self::disconnect).
    pub fn reconnect(&self) {
        self.lock().disconnected = false;
    }

    /// How many times `op` has been called, failed calls included.
    pub fn calls(&self, op: Op) -> u64 {
        self.lock().calls[op.index()]
    }

    /// A copy of every record, in key order.
    pub fn snapshot(&self) -> Vec<StoredRecord> {
        self.lock().records.values().cloned().collect()
    }

    /// How many records are stored.
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// True when no record is stored.
    pub fn is_empty(&self) -> bool {
        self.lock().records.is_empty()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every operation leaves the state consistent before it can panic,
        // so a poisoned lock still guards valid data.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` atomically under the lock, after counting the call and
    /// applying disconnection and injected faults.
    fn run<R>(
        &self,
        op: Op,
        f: impl FnOnce(&mut State) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let mut state = self.lock();
        state.calls[op.index()] += 1;
        if state.disconnected {
            return Err(StoreError::Unavailable("connection lost".to_owned()));
        }
        match state.take_fault(op) {
            None => f(&mut state),
            Some(FaultKind::Unavailable) => Err(StoreError::Unavailable(format!(
                "injected fault: {op:?} unavailable"
            ))),
            Some(FaultKind::Internal) => Err(StoreError::Internal(format!(
                "injected fault: {op:?} internal error"
            ))),
            Some(FaultKind::LostAck) => {
                f(&mut state)?;
                Err(StoreError::Unavailable(format!(
                    "injected fault: {op:?} acknowledgement lost"
                )))
            }
        }
    }
}

/// Refuses what a SQL store cannot hold: integers above `i64::MAX`. The mock
/// must fail where the durable stores fail, or tests would pass on it alone.
fn check_fits(record: &StoredRecord) -> Result<(), StoreError> {
    let integers = [
        ("fencing_token", Some(record.fencing_token)),
        ("revision", Some(record.revision)),
        ("lease_until", record.lease_until),
        ("created_at", Some(record.created_at)),
        ("updated_at", Some(record.updated_at)),
        ("expires_at", record.expires_at),
    ];
    for (field, value) in integers {
        if value.is_some_and(|v| i64::try_from(v).is_err()) {
            return Err(StoreError::Rejected(format!(
                "{field} is above i64::MAX, which a SQL store cannot hold"
            )));
        }
    }
    Ok(())
}

impl Storage for MemoryStore {
    fn insert_if_absent(&self, candidate: &StoredRecord) -> Result<InsertOutcome, StoreError> {
        check_fits(candidate)?;
        self.run(Op::InsertIfAbsent, |state| {
            if let Some(existing) = state.records.get(&candidate.key) {
                return Ok(InsertOutcome::Existing(existing.clone()));
            }
            let id = state
                .last_id
                .checked_add(1)
                .ok_or_else(|| StoreError::Internal("record ids are exhausted".to_owned()))?;
            state.last_id = id;
            let mut record = candidate.clone();
            record.id = id;
            state.records.insert(record.key.clone(), record.clone());
            Ok(InsertOutcome::Inserted(record))
        })
    }

    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
        self.run(Op::Get, |state| Ok(state.records.get(key).cloned()))
    }

    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError> {
        check_fits(replacement)?;
        self.run(Op::CompareAndSwap, |state| {
            match state.records.get_mut(&replacement.key) {
                Some(current)
                    if current.id == replacement.id && current.revision == expected_revision =>
                {
                    *current = replacement.clone();
                    Ok(SwapOutcome::Swapped)
                }
                Some(current) => Ok(SwapOutcome::Stale(Some(current.clone()))),
                None => Ok(SwapOutcome::Stale(None)),
            }
        })
    }

    fn delete_expired(&self, now: Timestamp, limit: u32) -> Result<u32, StoreError> {
        self.run(Op::DeleteExpired, |state| {
            // Oldest expiry first, like the SQLite backend.
            let mut expired: Vec<(Timestamp, u64, RecordKey)> = state
                .records
                .values()
                .filter(|r| r.status.is_settled())
                .filter_map(|r| {
                    r.expires_at
                        .filter(|&at| at <= now)
                        .map(|at| (at, r.id, r.key.clone()))
                })
                .collect();
            expired.sort();
            let mut deleted = 0u32;
            for (_, _, key) in expired.into_iter().take(limit as usize) {
                state.records.remove(&key);
                deleted += 1;
            }
            Ok(deleted)
        })
    }

    fn list_stale_after(
        &self,
        biz_type: &str,
        now: Timestamp,
        after: Option<StaleCursor>,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        self.run(Op::ListStale, |state| {
            let mut stale: Vec<&StoredRecord> = state
                .records
                .values()
                .filter(|r| r.key.biz_type == biz_type)
                .filter(|r| after.is_none_or(|a| StaleCursor::after(r) > a))
                .filter(|r| match r.status {
                    Status::Processing => r.lease_until.is_some_and(|until| until <= now),
                    Status::OutcomeUnknown => true,
                    _ => false,
                })
                .collect();
            stale.sort_by_key(|r| (r.updated_at, r.id));
            Ok(stale.into_iter().take(limit as usize).cloned().collect())
        })
    }

    fn count_by_status(&self) -> Result<Vec<(Status, u64)>, StoreError> {
        self.run(Op::CountByStatus, |state| {
            let mut counts = Status::ALL.map(|status| (status, 0u64));
            for record in state.records.values() {
                for (status, count) in counts.iter_mut() {
                    if *status == record.status {
                        *count += 1;
                    }
                }
            }
            Ok(counts.to_vec())
        })
    }

    /// Memory: an operation takes microseconds.
    fn blocks_on_io(&self) -> bool {
        false
    }
}
