//! The engine's answers in HTTP terms: the body kind of a request, and the
//! problem or response for each decision and error, as [`idem_http`] says.

use http::{HeaderMap, header};
use idem_engine::api::{BodyKind, Decision, InputField, InputRule, InvalidInput, Ticket};
use idem_engine::engine::Error;
use idem_engine::types::StoredResponse;

use crate::problem::Problem;

/// The body kind for the fingerprint, from the (first) `Content-Type`:
/// JSON for `application/json` and `*/*+json`, raw otherwise
/// ([`idem_http::body_kind`]).
pub fn body_kind(headers: &HeaderMap) -> BodyKind {
    let content_type = headers.get(header::CONTENT_TYPE).map(|v| v.as_bytes());
    match idem_http::body_kind(content_type) {
        idem_http::BodyKind::Json => BodyKind::Json,
        idem_http::BodyKind::Raw => BodyKind::Raw,
    }
}

/// The problem for an `invalid` decision ([`idem_http::invalid_problem`]):
/// `key-invalid` for the key, `body-too-large` (413) for a body over the
/// limit, `invalid-request` otherwise; the engine's message is the detail.
pub fn invalid_problem(i: &InvalidInput) -> Problem {
    idem_http::invalid_problem(&invalid(i.clone())).into()
}

/// The problem for an engine error ([`idem_http::engine_error_problem`]):
/// 503 with `Retry-After: 1` when the store failed, 500 otherwise.
pub fn engine_error_problem(e: &Error) -> Problem {
    let failure = match e {
        Error::Store(_) => idem_http::EngineFailure::Store,
        _ => idem_http::EngineFailure::Other,
    };
    idem_http::engine_error_problem(failure).into()
}

/// The engine's decision in `idem_http`'s terms, to be answered by
/// [`idem_http::answer`].
pub fn http_decision(decision: Decision) -> idem_http::Decision<Ticket, StoredResponse> {
    match decision {
        Decision::Execute(ticket) => idem_http::Decision::Execute(ticket),
        Decision::Replay(replayed) => idem_http::Decision::Replay(replayed.response),
        Decision::InProgress(busy) => idem_http::Decision::InProgress {
            retry_after_ms: busy.retry_after_ms,
        },
        Decision::Mismatch(_) => idem_http::Decision::Mismatch,
        Decision::Failed(failure) => idem_http::Decision::Failed(failure.response),
        Decision::OutcomeUnknown(_) => idem_http::Decision::OutcomeUnknown,
        Decision::Invalid(i) => idem_http::Decision::Invalid(invalid(i)),
    }
}

fn invalid(i: InvalidInput) -> idem_http::Invalid {
    use idem_http::{Field, Rule};
    idem_http::Invalid {
        field: match i.field {
            InputField::Scope => Field::Scope,
            InputField::BizType => Field::BizType,
            InputField::IdemKey => Field::IdemKey,
            InputField::Attributes => Field::Attributes,
            InputField::Body => Field::Body,
            InputField::Policy => Field::Policy,
            InputField::SuccessResult => Field::SuccessResult,
            InputField::FailureInfo => Field::FailureInfo,
            InputField::Ticket => Field::Ticket,
        },
        rule: match i.rule {
            InputRule::Required => Rule::Required,
            InputRule::TooShort => Rule::TooShort,
            InputRule::TooLong => Rule::TooLong,
            InputRule::BadCharacter => Rule::BadCharacter,
            InputRule::BadFormat => Rule::BadFormat,
            InputRule::NotJson => Rule::NotJson,
            InputRule::OutOfRange => Rule::OutOfRange,
        },
        message: i.message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::ProblemType;
    use http::HeaderValue;

    fn kind(ct: &str) -> BodyKind {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        body_kind(&h)
    }

    #[test]
    fn the_first_content_type_decides_the_body_kind() {
        assert_eq!(kind("application/json"), BodyKind::Json);
        assert_eq!(
            kind("application/merge-patch+json; charset=utf-8"),
            BodyKind::Json
        );
        assert_eq!(kind("text/plain"), BodyKind::Raw);
        assert_eq!(body_kind(&HeaderMap::new()), BodyKind::Raw);
        let mut h = HeaderMap::new();
        h.append(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.append(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        assert_eq!(body_kind(&h), BodyKind::Json);
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_bytes(b"application/json\xff").unwrap(),
        );
        assert_eq!(body_kind(&h), BodyKind::Raw);
    }

    #[test]
    fn invalid_decisions_map_to_problems() {
        let key = InvalidInput {
            field: InputField::IdemKey,
            rule: InputRule::TooLong,
            message: "idem-key is too long".into(),
        };
        let p = invalid_problem(&key);
        assert_eq!(p.kind, ProblemType::KeyInvalid);
        assert_eq!(p.status, 400);
        let v = p.to_json();
        assert_eq!(v["field"], "idem-key");
        assert_eq!(v["rule"], "too-long");
        assert_eq!(v["detail"], "idem-key is too long");

        let body = InvalidInput {
            field: InputField::Body,
            rule: InputRule::TooLong,
            message: "body is too long".into(),
        };
        assert_eq!(invalid_problem(&body).status, 413);
    }

    /// The names the problem's `field` and `rule` members carry are the
    /// engine's (its serde names).
    #[test]
    fn field_and_rule_names_are_the_engines() {
        use InputField as F;
        use InputRule as R;
        let fields = [
            F::Scope,
            F::BizType,
            F::IdemKey,
            F::Attributes,
            F::Body,
            F::Policy,
            F::SuccessResult,
            F::FailureInfo,
            F::Ticket,
        ];
        let rules = [
            R::Required,
            R::TooShort,
            R::TooLong,
            R::BadCharacter,
            R::BadFormat,
            R::NotJson,
            R::OutOfRange,
        ];
        for field in fields {
            for rule in rules {
                let i = invalid(InvalidInput {
                    field,
                    rule,
                    message: String::new(),
                });
                assert_eq!(serde_json::to_value(field).unwrap(), i.field.name());
                assert_eq!(serde_json::to_value(rule).unwrap(), i.rule.name());
            }
        }
    }

    #[test]
    fn decisions_convert_one_to_one() {
        use idem_engine::api::{Busy, MismatchInfo, Replayed, UnknownInfo};
        use idem_engine::types::Failure;
        let stored = StoredResponse {
            status: 201,
            headers: vec![],
            body: b"done".to_vec(),
        };
        let replay = Decision::Replay(Replayed {
            result_ref: None,
            response: Some(stored.clone()),
            completed_at: 0,
        });
        assert_eq!(
            http_decision(replay),
            idem_http::Decision::Replay(Some(stored.clone()))
        );
        assert_eq!(
            http_decision(Decision::InProgress(Busy {
                retry_after_ms: 250,
                lease_until: 9,
            })),
            idem_http::Decision::InProgress {
                retry_after_ms: 250
            }
        );
        let failed = Decision::Failed(Failure {
            code: "http-400".into(),
            message: "m".into(),
            response: None,
        });
        assert_eq!(http_decision(failed), idem_http::Decision::Failed(None));
        let mismatch = Decision::Mismatch(MismatchInfo {
            stored_prefix: "0123abcd".into(),
            stored_version: 2,
        });
        assert_eq!(http_decision(mismatch), idem_http::Decision::Mismatch);
        let unknown = Decision::OutcomeUnknown(UnknownInfo {
            since: 0,
            attempts: 1,
            failure: None,
        });
        assert_eq!(http_decision(unknown), idem_http::Decision::OutcomeUnknown);
    }

    #[test]
    fn engine_errors_map_to_503_or_500() {
        let store = engine_error_problem(&Error::Store(idem_engine::StoreError::Unavailable(
            "down".into(),
        )));
        assert_eq!(store.status, 503);
        assert_eq!(store.retry_after_secs, Some(1));
        // The store's message is not echoed.
        assert!(!store.to_json().to_string().contains("down"));
        let trap = engine_error_problem(&Error::Trap("boom".into()));
        assert_eq!(trap.status, 500);
    }
}
