//! The record model shared by the engine API and the storage backends.
//!
//! These types mirror `wit/types.wit` one to one; the WIT comments are the
//! specification, repeated here in short.

use serde::{Deserialize, Serialize};

/// Milliseconds since the Unix epoch, UTC.
pub type Timestamp = u64;

/// The three parts that identify one business action. Stores enforce
/// `UNIQUE (scope, biz_type, idem_key)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RecordKey {
    /// Whose key this is: a user, a tenant, a tenant + provider pair.
    pub scope: String,
    /// The kind of business action, e.g. `order.create`.
    pub biz_type: String,
    /// The idempotency key.
    pub idem_key: String,
}

impl RecordKey {
    /// Builds a key from its three parts.
    pub fn new(
        scope: impl Into<String>,
        biz_type: impl Into<String>,
        idem_key: impl Into<String>,
    ) -> Self {
        Self {
            scope: scope.into(),
            biz_type: biz_type.into(),
            idem_key: idem_key.into(),
        }
    }
}

/// The lifecycle state of a stored record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// An owner holds a lease and is executing the business action.
    Processing,
    /// The business action succeeded; its result is replayed.
    Succeeded,
    /// The business action failed for good; the failure is replayed.
    Failed,
    /// The key is free for a new attempt with the same fingerprint.
    Released,
    /// Nobody may execute until reconciliation settles the key.
    OutcomeUnknown,
}

impl Status {
    /// Every status, in declaration order.
    pub const ALL: [Status; 5] = [
        Status::Processing,
        Status::Succeeded,
        Status::Failed,
        Status::Released,
        Status::OutcomeUnknown,
    ];

    /// The name stored in databases and printed by the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Processing => "processing",
            Status::Succeeded => "succeeded",
            Status::Failed => "failed",
            Status::Released => "released",
            Status::OutcomeUnknown => "outcome-unknown",
        }
    }

    /// Parses a name produced by [`Status::as_str`].
    pub fn parse(name: &str) -> Option<Status> {
        Status::ALL.into_iter().find(|s| s.as_str() == name)
    }

    /// True for the states that `delete-expired` may remove once expired.
    pub fn is_settled(self) -> bool {
        matches!(self, Status::Succeeded | Status::Failed | Status::Released)
    }
}

/// An HTTP-shaped response kept for replay.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The status code.
    pub status: u16,
    /// Header names and values, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The response body.
    pub body: Vec<u8>,
}

/// What a successful business action produced.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Success {
    /// A reference to the business result, such as an order number.
    pub result_ref: Option<String>,
    /// The response to replay to duplicates, if any.
    pub response: Option<StoredResponse>,
}

impl From<&str> for Success {
    /// A success that only carries a result reference (`Success::with_ref`).
    fn from(result_ref: &str) -> Self {
        Self::with_ref(result_ref)
    }
}

impl From<String> for Success {
    /// A success that only carries a result reference (`Success::with_ref`).
    fn from(result_ref: String) -> Self {
        Self::with_ref(result_ref)
    }
}

impl Success {
    /// A success that only carries a result reference.
    pub fn with_ref(result_ref: impl Into<String>) -> Self {
        Self {
            result_ref: Some(result_ref.into()),
            response: None,
        }
    }
}

/// What a failed business action reported.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Failure {
    /// A short machine-readable code.
    pub code: String,
    /// A human-readable message.
    pub message: String,
    /// The response to replay to duplicates, if any.
    pub response: Option<StoredResponse>,
}

/// One row of the idempotency record table, exactly as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredRecord {
    /// The row id, assigned by the store on insert.
    pub id: u64,
    /// The unique key.
    pub key: RecordKey,
    /// Lowercase hex SHA-256 of the canonical request form.
    pub fingerprint: String,
    /// The version of the canonical form.
    pub fingerprint_version: u32,
    /// The lifecycle state.
    pub status: Status,
    /// The ownership generation.
    pub fencing_token: u64,
    /// Incremented by every write; guards compare-and-swap.
    pub revision: u64,
    /// How many times an owner has been granted this key.
    pub attempts: u32,
    /// While processing: when the owner's lease ends. An outcome-unknown
    /// record keeps the lease of the owner that reported it: until then
    /// nothing may run, and `reconcile` leaves it alone.
    pub lease_until: Option<Timestamp>,
    /// When the record was first created.
    pub created_at: Timestamp,
    /// When the record was last written.
    pub updated_at: Timestamp,
    /// When a settled record stops counting.
    pub expires_at: Option<Timestamp>,
    /// The result reference, when succeeded.
    pub result_ref: Option<String>,
    /// The response kept for replay.
    pub response: Option<StoredResponse>,
    /// The failure, when failed, released after a failure, or unknown.
    pub failure: Option<Failure>,
}

/// The result of [`Storage::insert_if_absent`](crate::Storage::insert_if_absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InsertOutcome {
    /// The record is stored, with the id the store assigned.
    Inserted(StoredRecord),
    /// Another record had the key; nothing was written.
    Existing(StoredRecord),
}

/// The result of [`Storage::compare_and_swap`](crate::Storage::compare_and_swap).
// Returned once per call and consumed at once: boxing the stale record
// would add an allocation to the contended path for no gain.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SwapOutcome {
    /// The record was replaced.
    Swapped,
    /// The revision did not match; carries the current record, if any.
    Stale(Option<StoredRecord>),
}
