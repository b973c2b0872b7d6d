//! The HTTP rules of idem, in one place: `idem serve` (the host's proxy)
//! uses them natively and the `middleware` component compiles them to
//! wasm, so a client gets the same answers from both.
//!
//! - [`key`]: the `Idempotency-Key` header (an RFC 8941 sf-string or a bare
//!   value) and the header names;
//! - [`scope`]: whose keys a request's keys are, from its credentials, a
//!   configured scope header or the anonymous mode;
//! - [`method`]: which methods are passed through and which need a key;
//! - [`body`]: the body kind the fingerprint uses, from `Content-Type`;
//! - [`status`]: what a response status means for the key, and what fits
//!   in the store;
//! - [`problem`]: the RFC 9457 problem catalogue, with every detail text,
//!   and its JSON rendering;
//! - [`decision`]: the answer to each engine decision.
//!
//! Nothing here does I/O or knows an HTTP library: inputs are `&str` and
//! `&[u8]`, outputs plain types that each side turns into its own
//! responses.
#![cfg_attr(not(test), no_std)]
#![warn(missing_docs)]

extern crate alloc;

pub mod body;
pub mod decision;
pub mod key;
pub mod method;
pub mod problem;
pub mod scope;
pub mod status;

#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod props;

pub use body::{BodyKind, body_kind};
pub use decision::{
    Answer, Decision, EngineFailure, Field, Invalid, Rule, answer, engine_error_problem,
    invalid_problem, response_headers,
};
pub use key::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, KeyHeaderError, parse_idempotency_key};
pub use method::{KeyRequirement, is_safe_method, key_requirement, needs_key_by_default};
pub use problem::{
    PROBLEM_BASE, PROBLEM_CONTENT_TYPE, Problem, ProblemType, WWW_AUTHENTICATE, retry_after_secs,
};
pub use scope::{AnonymousMode, NoPeerAddress, PeerAddress, ScopeError, ScopeHeader, derive_scope};
pub use status::{
    MAX_STORED_BODY_BYTES, MAX_STORED_HEADERS, ServerErrors, Verdict, classify_status, storable,
};

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> alloc::string::String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = alloc::string::String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}
