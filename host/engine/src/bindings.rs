//! The generated component bindings, kept private, and the one place where
//! their types are converted to and from the public API types.

#![allow(missing_docs)]

use crate::api;
use crate::store::StoreError;
use crate::types;

wasmtime::component::bindgen!({
    path: "../../wit",
    world: "idem",
});

pub use self::idem::engine::store as wit_store;
pub use self::idem::engine::types as wit_types;
pub use exports::idem::engine::engine as wit_engine;

/// A conversion between a public type and its generated twin.
pub trait Conv<T> {
    fn conv(self) -> T;
}

macro_rules! identity {
    ($($t:ty),*) => { $(impl Conv<$t> for $t { fn conv(self) -> $t { self } })* };
}
identity!(u8, u16, u32, u64, bool, String);

impl<A: Conv<B>, B> Conv<Vec<B>> for Vec<A> {
    fn conv(self) -> Vec<B> {
        self.into_iter().map(Conv::conv).collect()
    }
}

impl<A: Conv<B>, B> Conv<Option<B>> for Option<A> {
    fn conv(self) -> Option<B> {
        self.map(Conv::conv)
    }
}

impl<A: Conv<C>, B: Conv<D>, C, D> Conv<(C, D)> for (A, B) {
    fn conv(self) -> (C, D) {
        (self.0.conv(), self.1.conv())
    }
}

/// Structs with the same field names on both sides, both directions.
macro_rules! structs {
    ($($a:ty => $b:ty { $($f:ident),* $(,)? })*) => {$(
        impl Conv<$b> for $a {
            fn conv(self) -> $b { <$b>::from_parts($(self.$f.conv()),*) }
        }
        impl Conv<$a> for $b {
            fn conv(self) -> $a { <$a>::from_parts($(self.$f.conv()),*) }
        }
    )*};
}

/// Fieldless enums with the same variant names, both directions.
macro_rules! enums {
    ($($a:ty => $b:ty { $($v:ident),* $(,)? })*) => {$(
        impl Conv<$b> for $a {
            fn conv(self) -> $b { match self { $(<$a>::$v => <$b>::$v),* } }
        }
        impl Conv<$a> for $b {
            fn conv(self) -> $a { match self { $(<$b>::$v => <$a>::$v),* } }
        }
    )*};
}

/// Gives each struct a constructor from its fields in declaration order, so
/// that `structs!` can build either side the same way.
macro_rules! from_parts {
    ($($t:ty { $($f:ident : $ft:ty),* $(,)? })*) => {$(
        impl $t {
            #[allow(clippy::too_many_arguments)]
            fn from_parts($($f: $ft),*) -> Self { Self { $($f),* } }
        }
    )*};
}

from_parts! {
    types::RecordKey { scope: String, biz_type: String, idem_key: String }
    wit_types::RecordKey { scope: String, biz_type: String, idem_key: String }
    types::StoredResponse { status: u16, headers: Vec<(String, Vec<u8>)>, body: Vec<u8> }
    wit_types::StoredResponse { status: u16, headers: Vec<(String, Vec<u8>)>, body: Vec<u8> }
    types::Success { result_ref: Option<String>, response: Option<types::StoredResponse> }
    wit_types::Success { result_ref: Option<String>, response: Option<wit_types::StoredResponse> }
    types::Failure { code: String, message: String, response: Option<types::StoredResponse> }
    wit_types::Failure { code: String, message: String, response: Option<wit_types::StoredResponse> }
    types::StoredRecord {
        id: u64, key: types::RecordKey, fingerprint: String, fingerprint_version: u32,
        status: types::Status, fencing_token: u64, revision: u64, attempts: u32,
        lease_until: Option<u64>, created_at: u64, updated_at: u64, expires_at: Option<u64>,
        result_ref: Option<String>, response: Option<types::StoredResponse>,
        failure: Option<types::Failure>,
    }
    wit_types::StoredRecord {
        id: u64, key: wit_types::RecordKey, fingerprint: String, fingerprint_version: u32,
        status: wit_types::Status, fencing_token: u64, revision: u64, attempts: u32,
        lease_until: Option<u64>, created_at: u64, updated_at: u64, expires_at: Option<u64>,
        result_ref: Option<String>, response: Option<wit_types::StoredResponse>,
        failure: Option<wit_types::Failure>,
    }
    crate::store::StaleCursor { updated_at: u64, id: u64 }
    wit_store::StaleCursor { updated_at: u64, id: u64 }
    api::KeyFormat { min_length: u32, max_length: u32, charset: api::KeyCharset }
    wit_engine::KeyFormat { min_length: u32, max_length: u32, charset: wit_engine::KeyCharset }
    api::WaitSpec { max_wait_ms: u64, poll_interval_ms: u64 }
    wit_engine::WaitSpec { max_wait_ms: u64, poll_interval_ms: u64 }
    api::Policy {
        retention_ms: u64, lease_ms: u64, retry_after_ms: u64,
        expired_lease: api::ExpiredLease, outcome_unknown: api::ExpiredLease,
        failure_mode: api::FailureMode, max_attempts: Option<u32>,
        in_progress: api::InProgressMode, fingerprint_fields: Vec<String>,
        key_format: api::KeyFormat, max_body_bytes: u32,
    }
    wit_engine::Policy {
        retention_ms: u64, lease_ms: u64, retry_after_ms: u64,
        expired_lease: wit_engine::ExpiredLease, outcome_unknown: wit_engine::ExpiredLease,
        failure_mode: wit_engine::FailureMode, max_attempts: Option<u32>,
        in_progress: wit_engine::InProgressMode, fingerprint_fields: Vec<String>,
        key_format: wit_engine::KeyFormat, max_body_bytes: u32,
    }
    api::BeginRequest {
        key: types::RecordKey, attributes: Vec<(String, String)>, body_kind: api::BodyKind,
        body: Vec<u8>, policy: api::Policy,
    }
    wit_engine::BeginRequest {
        key: wit_types::RecordKey, attributes: Vec<(String, String)>,
        body_kind: wit_engine::BodyKind, body: Vec<u8>, policy: wit_engine::Policy,
    }
    api::Ticket { key: types::RecordKey, record_id: u64, fencing_token: u64, lease_until: u64, attempt: u32 }
    wit_engine::Ticket { key: wit_types::RecordKey, record_id: u64, fencing_token: u64, lease_until: u64, attempt: u32 }
    api::Replayed { result_ref: Option<String>, response: Option<types::StoredResponse>, completed_at: u64 }
    wit_engine::Replayed { result_ref: Option<String>, response: Option<wit_types::StoredResponse>, completed_at: u64 }
    api::Busy { retry_after_ms: u64, lease_until: u64 }
    wit_engine::Busy { retry_after_ms: u64, lease_until: u64 }
    api::MismatchInfo { stored_prefix: String, stored_version: u32 }
    wit_engine::MismatchInfo { stored_prefix: String, stored_version: u32 }
    api::UnknownInfo { since: u64, attempts: u32, failure: Option<types::Failure> }
    wit_engine::UnknownInfo { since: u64, attempts: u32, failure: Option<wit_types::Failure> }
    api::InvalidInput { field: api::InputField, rule: api::InputRule, message: String }
    wit_engine::InvalidInput { field: wit_engine::InputField, rule: wit_engine::InputRule, message: String }
    api::ReconcileReport {
        examined: u32, succeeded: u32, released: u32, left_for_manual: u32, skipped: u32,
        lookup_errors: u32,
    }
    wit_engine::ReconcileReport {
        examined: u32, succeeded: u32, released: u32, left_for_manual: u32, skipped: u32,
        lookup_errors: u32,
    }
    api::KeyStatus {
        status: types::Status, created_at: u64, updated_at: u64, expires_at: Option<u64>,
        lease_until: Option<u64>, result_ref: Option<String>, attempts: u32,
        fencing_token: u64, fingerprint: String, fingerprint_version: u32, expired: bool,
    }
    wit_engine::KeyStatus {
        status: wit_types::Status, created_at: u64, updated_at: u64, expires_at: Option<u64>,
        lease_until: Option<u64>, result_ref: Option<String>, attempts: u32,
        fencing_token: u64, fingerprint: String, fingerprint_version: u32, expired: bool,
    }
}

structs! {
    types::RecordKey => wit_types::RecordKey { scope, biz_type, idem_key }
    types::StoredResponse => wit_types::StoredResponse { status, headers, body }
    types::Success => wit_types::Success { result_ref, response }
    types::Failure => wit_types::Failure { code, message, response }
    types::StoredRecord => wit_types::StoredRecord {
        id, key, fingerprint, fingerprint_version, status, fencing_token, revision, attempts,
        lease_until, created_at, updated_at, expires_at, result_ref, response, failure,
    }
    crate::store::StaleCursor => wit_store::StaleCursor { updated_at, id }
    api::KeyFormat => wit_engine::KeyFormat { min_length, max_length, charset }
    api::WaitSpec => wit_engine::WaitSpec { max_wait_ms, poll_interval_ms }
    api::Policy => wit_engine::Policy {
        retention_ms, lease_ms, retry_after_ms, expired_lease, outcome_unknown, failure_mode,
        max_attempts, in_progress, fingerprint_fields, key_format, max_body_bytes,
    }
    api::BeginRequest => wit_engine::BeginRequest { key, attributes, body_kind, body, policy }
    api::Ticket => wit_engine::Ticket { key, record_id, fencing_token, lease_until, attempt }
    api::Replayed => wit_engine::Replayed { result_ref, response, completed_at }
    api::Busy => wit_engine::Busy { retry_after_ms, lease_until }
    api::MismatchInfo => wit_engine::MismatchInfo { stored_prefix, stored_version }
    api::UnknownInfo => wit_engine::UnknownInfo { since, attempts, failure }
    api::InvalidInput => wit_engine::InvalidInput { field, rule, message }
    api::ReconcileReport => wit_engine::ReconcileReport {
        examined, succeeded, released, left_for_manual, skipped, lookup_errors,
    }
    api::KeyStatus => wit_engine::KeyStatus {
        status, created_at, updated_at, expires_at, lease_until, result_ref, attempts,
        fencing_token, fingerprint, fingerprint_version, expired,
    }
}

enums! {
    types::Status => wit_types::Status { Processing, Succeeded, Failed, Released, OutcomeUnknown }
    api::BodyKind => wit_engine::BodyKind { Json, Raw }
    api::KeyCharset => wit_engine::KeyCharset { PrintableAscii, Uuid, Token }
    api::ExpiredLease => wit_engine::ExpiredLease { TakeOver, Reconcile, Manual }
    api::FailureMode => wit_engine::FailureMode { HonorDisposition, AlwaysFinal }
    api::InputField => wit_engine::InputField {
        Scope, BizType, IdemKey, Attributes, Body, Policy, SuccessResult, FailureInfo, Ticket,
    }
    api::InputRule => wit_engine::InputRule {
        Required, TooShort, TooLong, BadCharacter, BadFormat, NotJson, OutOfRange,
    }
    api::Disposition => wit_engine::Disposition { Retryable, Final, OutcomeUnknown }
    api::Settlement => wit_engine::Settlement { Settled, Absent, NotStuck }
}

impl Conv<wit_engine::Resolution> for api::Resolution {
    fn conv(self) -> wit_engine::Resolution {
        match self {
            api::Resolution::Succeeded(s) => wit_engine::Resolution::Succeeded(s.conv()),
            api::Resolution::Failed(f) => wit_engine::Resolution::Failed(f.conv()),
            api::Resolution::Released => wit_engine::Resolution::Released,
        }
    }
}

impl Conv<wit_engine::InProgressMode> for api::InProgressMode {
    fn conv(self) -> wit_engine::InProgressMode {
        match self {
            api::InProgressMode::Reject => wit_engine::InProgressMode::Reject,
            api::InProgressMode::Wait(w) => wit_engine::InProgressMode::Wait(w.conv()),
        }
    }
}

impl Conv<api::InProgressMode> for wit_engine::InProgressMode {
    fn conv(self) -> api::InProgressMode {
        match self {
            wit_engine::InProgressMode::Reject => api::InProgressMode::Reject,
            wit_engine::InProgressMode::Wait(w) => api::InProgressMode::Wait(w.conv()),
        }
    }
}

impl Conv<api::Decision> for wit_engine::Decision {
    fn conv(self) -> api::Decision {
        use wit_engine::Decision as D;
        match self {
            D::Execute(t) => api::Decision::Execute(t.conv()),
            D::Replay(r) => api::Decision::Replay(r.conv()),
            D::InProgress(b) => api::Decision::InProgress(b.conv()),
            D::Mismatch(m) => api::Decision::Mismatch(m.conv()),
            D::Failed(f) => api::Decision::Failed(f.conv()),
            D::OutcomeUnknown(u) => api::Decision::OutcomeUnknown(u.conv()),
            D::Invalid(i) => api::Decision::Invalid(i.conv()),
        }
    }
}

impl Conv<api::Completion> for wit_engine::Completion {
    fn conv(self) -> api::Completion {
        match self {
            wit_engine::Completion::Recorded(s) => api::Completion::Recorded(s.conv()),
            wit_engine::Completion::LostOwnership => api::Completion::LostOwnership,
        }
    }
}

impl Conv<api::Extension> for wit_engine::Extension {
    fn conv(self) -> api::Extension {
        match self {
            wit_engine::Extension::Extended(at) => api::Extension::Extended(at),
            wit_engine::Extension::LostOwnership => api::Extension::LostOwnership,
        }
    }
}

impl Conv<wit_store::StoreError> for StoreError {
    fn conv(self) -> wit_store::StoreError {
        match self {
            StoreError::Unavailable(m) => wit_store::StoreError::Unavailable(m),
            StoreError::Rejected(m) => wit_store::StoreError::Rejected(m),
            StoreError::Internal(m) => wit_store::StoreError::Internal(m),
        }
    }
}

impl Conv<StoreError> for wit_store::StoreError {
    fn conv(self) -> StoreError {
        match self {
            wit_store::StoreError::Unavailable(m) => StoreError::Unavailable(m),
            wit_store::StoreError::Rejected(m) => StoreError::Rejected(m),
            wit_store::StoreError::Internal(m) => StoreError::Internal(m),
        }
    }
}

impl Conv<wit_store::InsertOutcome> for types::InsertOutcome {
    fn conv(self) -> wit_store::InsertOutcome {
        match self {
            types::InsertOutcome::Inserted(r) => wit_store::InsertOutcome::Inserted(r.conv()),
            types::InsertOutcome::Existing(r) => wit_store::InsertOutcome::Existing(r.conv()),
        }
    }
}

impl Conv<wit_store::SwapOutcome> for types::SwapOutcome {
    fn conv(self) -> wit_store::SwapOutcome {
        match self {
            types::SwapOutcome::Swapped => wit_store::SwapOutcome::Swapped,
            types::SwapOutcome::Stale(r) => wit_store::SwapOutcome::Stale(r.conv()),
        }
    }
}

impl<A: Conv<B>, B, E: Conv<F>, F> Conv<Result<B, F>> for Result<A, E> {
    fn conv(self) -> Result<B, F> {
        match self {
            Ok(a) => Ok(a.conv()),
            Err(e) => Err(e.conv()),
        }
    }
}
