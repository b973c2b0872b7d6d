//! The engine's request and decision types, mirroring `wit/engine.wit`.
//!
//! The WIT comments are the specification; the docs here repeat them in
//! short. Conversions to and from the component's types live in one private
//! module, `bindings`.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::types::{Failure, RecordKey, Status, StoredResponse, Success, Timestamp};

/// How long a settled record is kept and replayed by default: 24 hours, the
/// window after which Stripe prunes keys.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// How long an owner holds a key by default: 60 seconds, longer than the
/// usual 30-second upstream timeout, so a live request is never taken over.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);

/// The longest retry-after hint by default: 1 second, short enough for an
/// interactive retry and long enough not to hammer the store.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The largest body fingerprinted by default: 1 MiB, as the proxy's limit.
pub const DEFAULT_MAX_BODY_BYTES: u32 = 1024 * 1024;

/// How the request body is interpreted for the fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BodyKind {
    /// A JSON text, hashed in its RFC 8785 canonical form.
    Json,
    /// Bytes, hashed as they are.
    Raw,
}

/// Which characters an idempotency key may contain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeyCharset {
    /// Printable ASCII, 0x21 to 0x7e.
    PrintableAscii,
    /// A hyphenated UUID.
    Uuid,
    /// Letters, digits and `-_.:`.
    Token,
}

/// The rules a key must follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyFormat {
    /// Minimum length in bytes.
    pub min_length: u32,
    /// Maximum length in bytes, at most 255.
    pub max_length: u32,
    /// Allowed characters.
    pub charset: KeyCharset,
}

impl Default for KeyFormat {
    /// 1 to 255 printable ASCII characters, Stripe's rule.
    fn default() -> Self {
        Self {
            min_length: 1,
            max_length: 255,
            charset: KeyCharset::PrintableAscii,
        }
    }
}

/// What `begin` does with a stale record: a processing record whose lease
/// has expired ([`Policy::expired_lease`]), or an outcome-unknown record
/// whose reporting owner's lease has ended ([`Policy::outcome_unknown`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExpiredLease {
    /// Take the key over at once and execute again.
    TakeOver,
    /// Ask the registered result lookup first; execute only if not found.
    Reconcile,
    /// Answer outcome-unknown; leave the key to reconcile or an operator.
    Manual,
}

/// What a retryable failure does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailureMode {
    /// Follow the disposition given to `fail`.
    HonorDisposition,
    /// Store every failure as final and replay it.
    AlwaysFinal,
}

/// A bounded wait for the first request's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitSpec {
    /// The longest total wait in milliseconds, at most 60000.
    pub max_wait_ms: u64,
    /// Milliseconds between two reads of the record.
    pub poll_interval_ms: u64,
}

/// What `begin` does while another owner holds a live lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InProgressMode {
    /// Answer in-progress at once.
    Reject,
    /// Poll until the record settles or the wait runs out.
    Wait(WaitSpec),
}

/// The rules for one biz type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// How long a settled record is kept and replayed, in milliseconds.
    pub retention_ms: u64,
    /// How long an owner may hold a key without extending, in milliseconds.
    pub lease_ms: u64,
    /// The longest retry-after hint, in milliseconds.
    pub retry_after_ms: u64,
    /// What to do with a processing record whose lease has expired: its
    /// owner crashed, hung or timed out.
    pub expired_lease: ExpiredLease,
    /// What to do with an outcome-unknown record once the lease of the
    /// owner that reported it has ended. The action may have taken effect,
    /// so the default is [`ExpiredLease::Manual`]: the key stays blocked
    /// until a lookup or an operator settles it. Executing again without
    /// asking is the blind retry that runs one action twice. Absent from a
    /// serialized policy written before it existed: `manual`.
    #[serde(default = "blocked")]
    pub outcome_unknown: ExpiredLease,
    /// What a retryable failure does.
    pub failure_mode: FailureMode,
    /// The most attempts a key may take when its failures are retryable
    /// (at least 1): the engine stores the retryable failure of attempt
    /// `max_attempts` as final, and [`Completion::Recorded`] says so.
    /// `None`, the default: no limit. Attempts are counted by the record,
    /// across owners and processes, so a crashed attempt counts too.
    /// Absent from a serialized policy written before it existed: `None`.
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// What to do while another owner is executing.
    pub in_progress: InProgressMode,
    /// JSON Pointers selecting the fingerprinted fields; empty for all.
    pub fingerprint_fields: Vec<String>,
    /// The rules for the idempotency key.
    pub key_format: KeyFormat,
    /// The largest body accepted for fingerprinting, in bytes.
    pub max_body_bytes: u32,
}

impl Default for Policy {
    /// The defaults named by this module's constants; expired leases are
    /// taken over (fencing stops the old owner), unknown outcomes wait for
    /// a lookup or an operator, failures follow their disposition, and
    /// in-progress duplicates are answered at once.
    fn default() -> Self {
        Self {
            retention_ms: millis(DEFAULT_RETENTION),
            lease_ms: millis(DEFAULT_LEASE),
            retry_after_ms: millis(DEFAULT_RETRY_AFTER),
            expired_lease: ExpiredLease::TakeOver,
            outcome_unknown: blocked(),
            failure_mode: FailureMode::HonorDisposition,
            max_attempts: None,
            in_progress: InProgressMode::Reject,
            fingerprint_fields: Vec::new(),
            key_format: KeyFormat::default(),
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

/// The default for [`Policy::outcome_unknown`].
fn blocked() -> ExpiredLease {
    ExpiredLease::Manual
}

/// A duration in whole milliseconds, saturating.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Everything `begin` needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BeginRequest {
    /// The unique key.
    pub key: RecordKey,
    /// Request attributes bound into the fingerprint (method, path, ...).
    pub attributes: Vec<(String, String)>,
    /// How to read `body`.
    pub body_kind: BodyKind,
    /// The request body.
    pub body: Vec<u8>,
    /// The biz type's policy.
    pub policy: Policy,
}

impl BeginRequest {
    /// A request with a JSON body and no attributes.
    pub fn json(key: RecordKey, body: impl Into<Vec<u8>>, policy: Policy) -> Self {
        Self {
            key,
            attributes: Vec::new(),
            body_kind: BodyKind::Json,
            body: body.into(),
            policy,
        }
    }

    /// A request with a raw body and no attributes.
    pub fn raw(key: RecordKey, body: impl Into<Vec<u8>>, policy: Policy) -> Self {
        Self {
            body_kind: BodyKind::Raw,
            ..Self::json(key, body, policy)
        }
    }
}

/// Proof of ownership, handed out with [`Decision::Execute`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ticket {
    /// The key owned.
    pub key: RecordKey,
    /// The record's row id.
    pub record_id: u64,
    /// The ownership generation.
    pub fencing_token: u64,
    /// When the lease ends unless extended.
    pub lease_until: Timestamp,
    /// Which attempt this is, from 1.
    pub attempt: u32,
}

/// A stored success, replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replayed {
    /// The reference of the business result.
    pub result_ref: Option<String>,
    /// The stored response, if one was kept.
    pub response: Option<StoredResponse>,
    /// When the first request completed.
    pub completed_at: Timestamp,
}

/// Another owner is executing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Busy {
    /// Retry after this many milliseconds.
    pub retry_after_ms: u64,
    /// When the current owner's lease ends.
    pub lease_until: Timestamp,
}

/// The key was used with a different request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MismatchInfo {
    /// The first 8 hex digits of the stored fingerprint.
    pub stored_prefix: String,
    /// The stored fingerprint's version.
    pub stored_version: u32,
}

/// The outcome of an earlier attempt is not known.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnknownInfo {
    /// Since when the outcome has been unknown.
    pub since: Timestamp,
    /// How many attempts were made.
    pub attempts: u32,
    /// The failure the owner reported, if any.
    pub failure: Option<Failure>,
}

/// The input field that broke a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InputField {
    /// `key.scope`.
    Scope,
    /// `key.biz-type`.
    BizType,
    /// `key.idem-key`.
    IdemKey,
    /// `attributes`.
    Attributes,
    /// `body`.
    Body,
    /// `policy`.
    Policy,
    /// The success given to `complete`.
    SuccessResult,
    /// The failure given to `fail`.
    FailureInfo,
    /// The ticket.
    Ticket,
}

/// The rule that was broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum InputRule {
    /// Empty or missing.
    Required,
    /// Shorter than the minimum.
    TooShort,
    /// Longer than the maximum.
    TooLong,
    /// A character the field does not allow.
    BadCharacter,
    /// Not in the required format.
    BadFormat,
    /// Declared JSON but not JSON.
    NotJson,
    /// Outside the allowed range.
    OutOfRange,
}

/// Why the input was refused. Nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvalidInput {
    /// The offending field.
    pub field: InputField,
    /// The broken rule.
    pub rule: InputRule,
    /// A sentence naming the field and the rule.
    pub message: String,
}

impl fmt::Display for InvalidInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The answer to `begin`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "decision", content = "detail")]
pub enum Decision {
    /// Run the action once, then complete or fail with the ticket.
    Execute(Ticket),
    /// The action already succeeded: return its result.
    Replay(Replayed),
    /// Another owner is running the action: retry later.
    InProgress(Busy),
    /// Same key, different request.
    Mismatch(MismatchInfo),
    /// The action failed for good: return the stored failure.
    Failed(Failure),
    /// An earlier attempt may have taken effect: do not run the action.
    OutcomeUnknown(UnknownInfo),
    /// The input broke a rule; nothing was written.
    Invalid(InvalidInput),
}

impl Decision {
    /// The decision's WIT name, e.g. `in-progress`.
    pub fn name(&self) -> &'static str {
        match self {
            Decision::Execute(_) => "execute",
            Decision::Replay(_) => "replay",
            Decision::InProgress(_) => "in-progress",
            Decision::Mismatch(_) => "mismatch",
            Decision::Failed(_) => "failed",
            Decision::OutcomeUnknown(_) => "outcome-unknown",
            Decision::Invalid(_) => "invalid",
        }
    }
}

/// The answer to `complete` and `fail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Completion {
    /// The outcome is stored, and the key is now in this status:
    /// succeeded after `complete`; after `fail`, released (retryable),
    /// failed (final, or made final by the policy's `failure_mode` or
    /// `max_attempts`) or outcome-unknown. A caller that retries goes by
    /// this status, not by the disposition it passed.
    Recorded(Status),
    /// A newer owner holds the key; nothing was written.
    LostOwnership,
}

/// An operator's decision on a stuck key ([`Engine::settle`](crate::Engine::settle)).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Resolution {
    /// The action took effect: the key becomes succeeded and replays this.
    Succeeded(Success),
    /// The action failed for good: the key becomes failed and replays this.
    Failed(Failure),
    /// The action did not take effect: the key is released, and the next
    /// request with the same fingerprint executes.
    Released,
}

/// The answer to [`Engine::settle`](crate::Engine::settle).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Settlement {
    /// The key is settled as asked; its old owner is fenced off.
    Settled,
    /// The key has no record, or only one past its retention.
    Absent,
    /// The key is not stuck (in progress under a live lease, or already
    /// settled); nothing was written.
    NotStuck,
}

/// What `fail` means for the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Disposition {
    /// Nothing took effect: the next request may execute again.
    Retryable,
    /// Store the failure and replay it.
    Final,
    /// The action may have taken effect: block the key until reconciled.
    OutcomeUnknown,
}

/// The answer to `extend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Extension {
    /// The lease now ends at this instant.
    Extended(Timestamp),
    /// The caller no longer owns the key.
    LostOwnership,
}

/// What one `reconcile` run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ReconcileReport {
    /// Records examined.
    pub examined: u32,
    /// Records found and marked succeeded.
    pub succeeded: u32,
    /// Records released for retry.
    pub released: u32,
    /// Records left as outcome-unknown for an operator.
    pub left_for_manual: u32,
    /// Records changed by another writer meanwhile.
    pub skipped: u32,
    /// Records whose lookup failed.
    pub lookup_errors: u32,
}

/// The status of one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStatus {
    /// The stored state.
    pub status: Status,
    /// When the record was created.
    pub created_at: Timestamp,
    /// When the record was last written.
    pub updated_at: Timestamp,
    /// When a settled record expires.
    pub expires_at: Option<Timestamp>,
    /// The current lease, while processing.
    pub lease_until: Option<Timestamp>,
    /// The result reference, when succeeded.
    pub result_ref: Option<String>,
    /// How many owners have been granted the key.
    pub attempts: u32,
    /// The current ownership generation.
    pub fencing_token: u64,
    /// The stored fingerprint.
    pub fingerprint: String,
    /// The fingerprint's version.
    pub fingerprint_version: u32,
    /// True when the record has expired and counts as absent.
    pub expired: bool,
}
