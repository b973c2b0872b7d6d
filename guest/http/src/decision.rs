//! The answer to each engine decision.
//!
//! The host (`idem::Decision`) and the guest (the WIT bindings' `decision`)
//! each turn their decision into a [`Decision`] in one function; [`answer`]
//! says what to send.

use alloc::string::String;
use alloc::vec::Vec;

use crate::key::IDEMPOTENT_REPLAYED;
use crate::problem::{Problem, ProblemType};

/// The input field that broke a rule (the engine's `input-field`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
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

impl Field {
    /// The WIT name, sent as the problem's `field` member.
    pub fn name(self) -> &'static str {
        match self {
            Field::Scope => "scope",
            Field::BizType => "biz-type",
            Field::IdemKey => "idem-key",
            Field::Attributes => "attributes",
            Field::Body => "body",
            Field::Policy => "policy",
            Field::SuccessResult => "success-result",
            Field::FailureInfo => "failure-info",
            Field::Ticket => "ticket",
        }
    }
}

/// The rule that was broken (the engine's `input-rule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
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

impl Rule {
    /// The WIT name, sent as the problem's `rule` member.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Required => "required",
            Rule::TooShort => "too-short",
            Rule::TooLong => "too-long",
            Rule::BadCharacter => "bad-character",
            Rule::BadFormat => "bad-format",
            Rule::NotJson => "not-json",
            Rule::OutOfRange => "out-of-range",
        }
    }
}

/// An `invalid` decision: the engine refused the input; nothing was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// The offending field.
    pub field: Field,
    /// The broken rule.
    pub rule: Rule,
    /// The engine's sentence naming the field and the rule.
    pub message: String,
}

/// An engine decision, as far as its HTTP answer goes. `T` is the ticket
/// (handed back to run the request), `R` the stored response type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<T, R> {
    /// Run the request once with this ticket.
    Execute(T),
    /// The request already succeeded; its response, if one was kept.
    Replay(Option<R>),
    /// Another request with the key is running.
    InProgress {
        /// The engine's retry hint.
        retry_after_ms: u64,
    },
    /// The key was used for another request.
    Mismatch,
    /// The request failed for good; its response, if one was kept.
    Failed(Option<R>),
    /// An earlier attempt may or may not have taken effect.
    OutcomeUnknown,
    /// The input broke a rule.
    Invalid(Invalid),
}

/// What to do about a decision.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer<T, R> {
    /// Run the request with the ticket, store its outcome and send its
    /// answer.
    Execute(T),
    /// Send the stored response, replayed: with the headers of
    /// [`response_headers`] (`Idempotent-Replayed: true`).
    Replay(R),
    /// Send this problem; nothing runs.
    Problem(Problem),
}

/// The answer to `decision`:
///
/// | decision | answer |
/// |---|---|
/// | `execute` | run it |
/// | `replay` with a response | the response, replayed |
/// | `replay` without | 500 `response-not-stored` |
/// | `in-progress` | 409 `request-in-progress`, `Retry-After` |
/// | `mismatch` | 422 `key-reused` |
/// | `failed` with a response | the response, replayed |
/// | `failed` without | 500 `request-failed` |
/// | `outcome-unknown` | 409 `outcome-unknown` |
/// | `invalid` | [`invalid_problem`] |
pub fn answer<T, R>(decision: Decision<T, R>) -> Answer<T, R> {
    match decision {
        Decision::Execute(ticket) => Answer::Execute(ticket),
        Decision::Replay(Some(stored)) | Decision::Failed(Some(stored)) => Answer::Replay(stored),
        Decision::Replay(None) => Answer::Problem(Problem::response_not_stored()),
        Decision::InProgress { retry_after_ms } => {
            Answer::Problem(Problem::in_progress(retry_after_ms))
        }
        Decision::Mismatch => Answer::Problem(Problem::key_reused()),
        Decision::Failed(None) => Answer::Problem(Problem::request_failed()),
        Decision::OutcomeUnknown => Answer::Problem(Problem::outcome_unknown()),
        Decision::Invalid(i) => Answer::Problem(invalid_problem(&i)),
    }
}

/// The problem for an `invalid` decision: `key-invalid` for the key,
/// `body-too-large` (413) for a body over the limit, `invalid-request`
/// otherwise; the engine's message is the detail, and the `field` and
/// `rule` members name what was broken.
pub fn invalid_problem(i: &Invalid) -> Problem {
    let kind = match (i.field, i.rule) {
        (Field::IdemKey, _) => ProblemType::KeyInvalid,
        (Field::Body, Rule::TooLong) => ProblemType::BodyTooLarge,
        _ => ProblemType::InvalidRequest,
    };
    Problem::new(kind, i.message.clone())
        .with("field", i.field.name())
        .with("rule", i.rule.name())
}

/// Why an engine call gave no decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineFailure {
    /// The store failed or did not answer.
    Store,
    /// Anything else (a trap, a bug, an invalid call).
    Other,
}

/// The problem for an engine error: 503 with `Retry-After: 1` when the
/// store failed, 500 otherwise. The error's own message is not echoed.
pub fn engine_error_problem(failure: EngineFailure) -> Problem {
    match failure {
        EngineFailure::Store => Problem::store_unavailable(),
        EngineFailure::Other => Problem::engine_failed(),
    }
}

/// The headers to send with a stored response: as stored, in order; when
/// `replayed` (served from the store to a duplicate), without any stored
/// `Idempotent-Replayed` and with `idempotent-replayed: true` last.
pub fn response_headers(stored: &[(String, Vec<u8>)], replayed: bool) -> Vec<(&str, &[u8])> {
    let headers = stored
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_slice()));
    if !replayed {
        return headers.collect();
    }
    headers
        .filter(|(name, _)| !name.eq_ignore_ascii_case(IDEMPOTENT_REPLAYED))
        .chain([(IDEMPOTENT_REPLAYED, &b"true"[..])])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::borrow::ToOwned;

    type D = Decision<u32, &'static str>;

    fn problem(d: D) -> Problem {
        match answer(d) {
            Answer::Problem(p) => p,
            other => panic!("not a problem: {other:?}"),
        }
    }

    #[test]
    fn execute_and_replays() {
        assert_eq!(answer(D::Execute(7)), Answer::Execute(7));
        assert_eq!(answer(D::Replay(Some("r"))), Answer::Replay("r"));
        assert_eq!(answer(D::Failed(Some("f"))), Answer::Replay("f"));
    }

    #[test]
    fn the_other_decisions_are_problems() {
        let cases = [
            (D::Replay(None), ProblemType::ResponseNotStored, 500),
            (
                D::InProgress {
                    retry_after_ms: 1500,
                },
                ProblemType::RequestInProgress,
                409,
            ),
            (D::Mismatch, ProblemType::KeyReused, 422),
            (D::Failed(None), ProblemType::RequestFailed, 500),
            (D::OutcomeUnknown, ProblemType::OutcomeUnknown, 409),
        ];
        for (decision, kind, status) in cases {
            let p = problem(decision);
            assert_eq!((p.kind, p.status), (kind, status));
        }
        let busy = problem(D::InProgress {
            retry_after_ms: 1500,
        });
        assert_eq!(busy.retry_after_secs, Some(2));
        assert_eq!(busy.to_json()["retry_after_ms"], 1500);
    }

    fn invalid(field: Field, rule: Rule) -> Invalid {
        Invalid {
            field,
            rule,
            message: "the engine's words".to_owned(),
        }
    }

    #[test]
    fn invalid_decisions_map_to_problems() {
        let p = problem(D::Invalid(invalid(Field::IdemKey, Rule::TooLong)));
        assert_eq!((p.kind, p.status), (ProblemType::KeyInvalid, 400));
        let v = p.to_json();
        assert_eq!(v["field"], "idem-key");
        assert_eq!(v["rule"], "too-long");
        assert_eq!(v["detail"], "the engine's words");
        let p = invalid_problem(&invalid(Field::IdemKey, Rule::BadCharacter));
        assert_eq!(p.kind, ProblemType::KeyInvalid);

        let p = invalid_problem(&invalid(Field::Body, Rule::TooLong));
        assert_eq!((p.kind, p.status), (ProblemType::BodyTooLarge, 413));
        let p = invalid_problem(&invalid(Field::Body, Rule::NotJson));
        assert_eq!((p.kind, p.status), (ProblemType::InvalidRequest, 400));
        assert_eq!(p.to_json()["rule"], "not-json");
        let p = invalid_problem(&invalid(Field::Scope, Rule::TooLong));
        assert_eq!(p.kind, ProblemType::InvalidRequest);
        assert_eq!(p.to_json()["field"], "scope");
    }

    #[test]
    fn names_are_the_wit_names() {
        let fields = [
            (Field::Scope, "scope"),
            (Field::BizType, "biz-type"),
            (Field::IdemKey, "idem-key"),
            (Field::Attributes, "attributes"),
            (Field::Body, "body"),
            (Field::Policy, "policy"),
            (Field::SuccessResult, "success-result"),
            (Field::FailureInfo, "failure-info"),
            (Field::Ticket, "ticket"),
        ];
        for (f, name) in fields {
            assert_eq!(f.name(), name);
        }
        let rules = [
            (Rule::Required, "required"),
            (Rule::TooShort, "too-short"),
            (Rule::TooLong, "too-long"),
            (Rule::BadCharacter, "bad-character"),
            (Rule::BadFormat, "bad-format"),
            (Rule::NotJson, "not-json"),
            (Rule::OutOfRange, "out-of-range"),
        ];
        for (r, name) in rules {
            assert_eq!(r.name(), name);
        }
    }

    #[test]
    fn engine_errors_map_to_503_or_500() {
        let store = engine_error_problem(EngineFailure::Store);
        assert_eq!(
            (store.kind, store.status),
            (ProblemType::StoreUnavailable, 503)
        );
        assert_eq!(store.retry_after_secs, Some(1));
        let other = engine_error_problem(EngineFailure::Other);
        assert_eq!(
            (other.kind, other.status),
            (ProblemType::InternalError, 500)
        );
        assert_eq!(other.retry_after_secs, None);
    }

    #[test]
    fn replays_say_so_once() {
        let stored = Vec::from([
            ("set-cookie".to_owned(), b"a=1".to_vec()),
            ("Idempotent-Replayed".to_owned(), b"false".to_vec()),
            ("set-cookie".to_owned(), b"b=2".to_vec()),
        ]);
        assert_eq!(
            response_headers(&stored, true),
            Vec::from([
                ("set-cookie", &b"a=1"[..]),
                ("set-cookie", &b"b=2"[..]),
                ("idempotent-replayed", &b"true"[..]),
            ])
        );
        assert_eq!(
            response_headers(&[], true),
            Vec::from([("idempotent-replayed", &b"true"[..])])
        );
        // The first answer is sent as it came.
        assert_eq!(
            response_headers(&stored, false),
            Vec::from([
                ("set-cookie", &b"a=1"[..]),
                ("Idempotent-Replayed", &b"false"[..]),
                ("set-cookie", &b"b=2"[..]),
            ])
        );
        assert!(response_headers(&[], false).is_empty());
    }
}
