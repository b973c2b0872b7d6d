//! A fault-injecting wrapper over any [`Storage`], shared by the suites
//! that inject store faults into durable stores (`tests/conformance_data.rs`,
//! `tests/torture.rs`).
#![allow(dead_code)]

use std::sync::{Arc, Mutex, PoisonError};

use idem::store::memory::Op;
use idem::{FaultKind, RecordKey, Status, Storage, StoreError, StoredRecord, SwapOutcome};

/// A pending fault of [`Faulty`].
struct Fault {
    op: Option<Op>,
    remaining: u32,
    kind: FaultKind,
}

/// Wraps any [`Storage`] with the mock's fault injection, so that fault
/// scenarios run on durable stores too. Same semantics as `MemoryStore`:
/// the oldest matching fault is used first, one per call; `unavailable` and
/// `internal` fail before the call, `lost-ack` after it.
#[derive(Clone)]
pub struct Faulty<S> {
    inner: S,
    faults: Arc<Mutex<Vec<Fault>>>,
}

impl<S: Storage> Faulty<S> {
    /// `inner` with no fault pending.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            faults: Arc::default(),
        }
    }

    /// Makes the next `count` calls of `op` (of any operation when `None`)
    /// fail with `kind`.
    pub fn inject(&self, op: Option<Op>, kind: FaultKind, count: u32) {
        if count > 0 {
            self.faults
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(Fault {
                    op,
                    remaining: count,
                    kind,
                });
        }
    }

    /// Drops every pending fault.
    pub fn clear(&self) {
        self.faults
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }

    /// The store itself, without faults.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn take(&self, op: Op) -> Option<FaultKind> {
        let mut faults = self.faults.lock().unwrap_or_else(PoisonError::into_inner);
        let i = faults
            .iter()
            .position(|f| f.remaining > 0 && f.op.is_none_or(|o| o == op))?;
        faults[i].remaining -= 1;
        let kind = faults[i].kind;
        if faults[i].remaining == 0 {
            faults.remove(i);
        }
        Some(kind)
    }

    fn run<R>(&self, op: Op, f: impl FnOnce(&S) -> Result<R, StoreError>) -> Result<R, StoreError> {
        match self.take(op) {
            None => f(&self.inner),
            Some(FaultKind::Unavailable) => Err(StoreError::Unavailable(format!(
                "injected fault: {op:?} unavailable"
            ))),
            Some(FaultKind::Internal) => Err(StoreError::Internal(format!(
                "injected fault: {op:?} internal error"
            ))),
            Some(FaultKind::LostAck) => {
                f(&self.inner)?;
                Err(StoreError::Unavailable(format!(
                    "injected fault: {op:?} acknowledgement lost"
                )))
            }
        }
    }
}

impl<S: Storage + Clone> Storage for Faulty<S> {
    fn insert_if_absent(
        &self,
        candidate: &StoredRecord,
    ) -> Result<idem::InsertOutcome, StoreError> {
        self.run(Op::InsertIfAbsent, |s| s.insert_if_absent(candidate))
    }
    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
        self.run(Op::Get, |s| s.get(key))
    }
    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError> {
        self.run(Op::CompareAndSwap, |s| {
            s.compare_and_swap(expected_revision, replacement)
        })
    }
    fn delete_expired(&self, now: u64, limit: u32) -> Result<u32, StoreError> {
        self.run(Op::DeleteExpired, |s| s.delete_expired(now, limit))
    }
    fn list_stale_after(
        &self,
        biz_type: &str,
        now: u64,
        after: Option<idem::store::StaleCursor>,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        self.run(Op::ListStale, |s| {
            s.list_stale_after(biz_type, now, after, limit)
        })
    }
    fn count_by_status(&self) -> Result<Vec<(Status, u64)>, StoreError> {
        self.run(Op::CountByStatus, |s| s.count_by_status())
    }
}
