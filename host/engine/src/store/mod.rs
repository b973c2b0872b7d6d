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
use std::fmt;

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
    /// outcome-unknown record, ordered by (`updated_at`, `id`), oldest
    /// first, starting after `after` (a page's last record, for the next
    /// page) or from the first.
    fn list_stale_after(
        &self,
        biz_type: &str,
        now: Timestamp,
        after: Option<StaleCursor>,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError>;

    /// The first page of [`Storage::list_stale_after`]: the `store`
    /// import's `list-stale`.
    fn list_stale(
        &self,
        biz_type: &str,
        now: Timestamp,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        self.list_stale_after(biz_type, now, None, limit)
    }

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

    /// Whether a write asked now would wait for other callers' writes, as
    /// a write of a store with group commit waits while another caller
    /// commits a group. A store that answers `false` from
    /// [`Storage::blocks_on_io`] may answer `true` here for a moment; async
    /// hosts then run the call on a blocking thread, where its write joins
    /// the next group instead of holding an event loop while it waits.
    /// A hint: the answer may be stale by the time the call writes.
    ///
    /// The default is `false`.
    fn write_would_wait(&self) -> bool {
        false
    }
}

/// Where a page of [`Storage::list_stale_after`] ended: the (`updated_at`,
/// `id`) of its last record. The next page starts after it, so a record
/// settled or added meanwhile never shifts a page by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StaleCursor {
    /// The last record's `updated_at`.
    pub updated_at: Timestamp,
    /// The last record's id.
    pub id: u64,
}

impl StaleCursor {
    /// The cursor after `record`.
    pub fn after(record: &StoredRecord) -> Self {
        Self {
            updated_at: record.updated_at,
            id: record.id,
        }
    }
}

impl fmt::Display for StaleCursor {
    /// `<updated_at>-<id>`, as its [`FromStr`](std::str::FromStr) reads it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.updated_at, self.id)
    }
}

impl std::str::FromStr for StaleCursor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("'{s}' is not a cursor: expected <updated_at>-<id>, as a listing gives it");
        let (at, id) = s.split_once('-').ok_or_else(bad)?;
        Ok(Self {
            updated_at: at.parse().map_err(|_| bad())?,
            id: id.parse().map_err(|_| bad())?,
        })
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
