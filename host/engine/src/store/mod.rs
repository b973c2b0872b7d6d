//! Storage backends for the engine's `store` import.
//!
//! [`Storage`] is the narrow contract every backend implements; the engine
//! component makes every decision on top of it. One conformance suite runs
//! against every backend (the `testing` module, behind the feature of
//! that name). Durable backends live in
//! crates of their own (`idem-sqlite`, `idem-postgres`).

pub mod memory;
pub mod sql;

use crate::types::{InsertOutcome, RecordKey, StoredRecord, SwapOutcome, Timestamp};

#[cfg(test)]
mod tests;

pub use memory::{FaultKind, MemoryStore, Op};

/// Why a storage operation failed. Mirrors `store-error` in `wit/store.wit`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached, timed out or lost its connection.
    /// Whether a write took effect is unknown.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store refused the data; nothing was written.
    #[error("store rejected the data: {0}")]
    Rejected(String),
    /// Any other failure inside the store.
    #[error("store failure: {0}")]
    Internal(String),
}

/// The storage contract behind the engine's `store` import.
///
/// Implementers store records verbatim and decide nothing: all decisions are
/// the engine's. Every method is one atomic operation, safe to call from
/// many threads at once (and, for durable stores, from many processes).
///
/// A method that cannot answer MUST return an error; it MUST NOT report a
/// record as absent unless it is sure that none exists. The full contract of
/// each method is in `wit/store.wit`.
pub trait Storage: Send + Sync + 'static {
    /// Inserts `candidate` unless a record with its key exists, atomically,
    /// decided by the unique constraint on (scope, biz type, idem key). The
    /// id of `candidate` is ignored; the store assigns one. When the key is
    /// taken, returns the existing record read in the same operation.
    fn insert_if_absent(&self, candidate: &StoredRecord) -> Result<InsertOutcome, StoreError>;

    /// Reads the record with `key`.
    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError>;

    /// Replaces the record with `replacement.key` by `replacement` only if
    /// the stored record is the one the caller read: its id is
    /// `replacement.id` and its revision is `expected_revision`. A record
    /// deleted and created again has a new id, so a writer holding the old
    /// one never overwrites it. On a mismatch writes nothing and returns the
    /// current record.
    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError>;

    /// Deletes at most `limit` settled records (succeeded, failed, released)
    /// whose `expires_at` is at or before `now`, and returns how many. Never
    /// deletes a processing or outcome-unknown record.
    fn delete_expired(&self, now: Timestamp, limit: u32) -> Result<u32, StoreError>;

    /// Lists at most `limit` records of `biz_type` awaiting reconciliation:
    /// processing records whose lease ended at or before `now`, and every
    /// outcome-unknown record, oldest `updated_at` first.
    fn list_stale(
        &self,
        biz_type: &str,
        now: Timestamp,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError>;

    /// Counts records by status (for `idem stats`).
    fn count_by_status(&self) -> Result<Vec<(crate::types::Status, u64)>, StoreError>;

    /// Whether an operation waits on I/O, such as a round trip to a
    /// database server. Async hosts (the tower layer, `idem serve`) run the
    /// engine's calls on a blocking thread when it does, and on the
    /// request's own thread when it does not: a store that answers from
    /// memory or a local file in microseconds costs less than the thread
    /// handoff. Such a store may still wait now and then (SQLite waits for
    /// another process's write lock, up to its busy timeout); the request's
    /// thread waits with it.
    ///
    /// The default is `true`, which is always safe.
    fn blocks_on_io(&self) -> bool {
        true
    }
}

/// A store that can be shared behind an `Arc`: any [`Storage`], or an
/// `Arc<dyn Storage>` already shared (`idem serve`'s proxy shares its store
/// with its health check).
pub trait SharedStorage {
    /// The store behind an `Arc`.
    fn into_shared(self) -> std::sync::Arc<dyn Storage>;
}

impl<S: Storage> SharedStorage for S {
    fn into_shared(self) -> std::sync::Arc<dyn Storage> {
        std::sync::Arc::new(self)
    }
}

impl SharedStorage for std::sync::Arc<dyn Storage> {
    fn into_shared(self) -> std::sync::Arc<dyn Storage> {
        self
    }
}
