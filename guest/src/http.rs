//! The WIT side of the middleware's HTTP rules.
//!
//! The rules themselves are `idem_http`'s, the same code `idem serve` runs
//! natively; this module only converts between its plain types and the
//! component's bindings. Nothing here touches the component's imports: the
//! unit tests run natively.

use alloc::string::ToString;

use crate::bindings::exports::idem::engine::engine::{
    BodyKind, Decision, Disposition, EngineError, InputField, InputRule, InvalidInput, Ticket,
};
use crate::bindings::idem::engine::types::StoredResponse;

/// The engine's body kind for `idem_http`'s.
pub fn body_kind(kind: idem_http::BodyKind) -> BodyKind {
    match kind {
        idem_http::BodyKind::Json => BodyKind::Json,
        idem_http::BodyKind::Raw => BodyKind::Raw,
    }
}

/// The engine's disposition for a failure verdict; `None` for a success.
pub fn disposition(verdict: idem_http::Verdict) -> Option<Disposition> {
    match verdict {
        idem_http::Verdict::Complete => None,
        idem_http::Verdict::Final => Some(Disposition::Final),
        idem_http::Verdict::Retryable => Some(Disposition::Retryable),
    }
}

/// The engine's decision in `idem_http`'s terms, to be answered by
/// [`idem_http::answer`].
pub fn decision(decision: Decision) -> idem_http::Decision<Ticket, StoredResponse> {
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

/// What kind of engine error `e` is, for its problem.
pub fn engine_failure(e: &EngineError) -> idem_http::EngineFailure {
    match e {
        EngineError::Store(_) => idem_http::EngineFailure::Store,
        _ => idem_http::EngineFailure::Other,
    }
}

/// A problem as a response to send: its status, headers and JSON body.
pub fn problem_response(problem: &idem_http::Problem) -> StoredResponse {
    StoredResponse {
        status: problem.status,
        headers: problem
            .headers()
            .into_iter()
            .map(|(name, value)| (name.to_string(), value.into_bytes()))
            .collect(),
        body: problem.body(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::exports::idem::engine::engine::{Busy, MismatchInfo, Replayed};
    use crate::bindings::idem::engine::store::StoreError;
    use crate::bindings::idem::engine::types::Failure;
    use crate::validate;

    #[test]
    fn the_stored_limits_are_the_engines() {
        assert_eq!(
            idem_http::MAX_STORED_BODY_BYTES,
            validate::MAX_RESPONSE_BODY_BYTES
        );
        assert_eq!(
            idem_http::MAX_STORED_HEADERS,
            validate::MAX_RESPONSE_HEADERS
        );
    }

    fn stored() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: Vec::from([
                ("content-type".to_string(), b"text/plain".to_vec()),
                ("idempotent-replayed".to_string(), b"false".to_vec()),
            ]),
            body: b"done".to_vec(),
        }
    }

    #[test]
    fn decisions_convert_one_to_one() {
        let replay = Decision::Replay(Replayed {
            result_ref: None,
            response: Some(stored()),
            completed_at: 0,
        });
        assert_eq!(
            decision(replay),
            idem_http::Decision::Replay(Some(stored()))
        );
        assert_eq!(
            decision(Decision::InProgress(Busy {
                retry_after_ms: 250,
                lease_until: 9,
            })),
            idem_http::Decision::InProgress {
                retry_after_ms: 250
            }
        );
        let mismatch = Decision::Mismatch(MismatchInfo {
            stored_prefix: "0123abcd".into(),
            stored_version: 2,
        });
        assert_eq!(decision(mismatch), idem_http::Decision::Mismatch);
        let failed = Decision::Failed(Failure {
            code: "http-400".into(),
            message: "m".into(),
            response: None,
        });
        assert_eq!(decision(failed), idem_http::Decision::Failed(None));
        let i = Decision::Invalid(InvalidInput {
            field: InputField::Body,
            rule: InputRule::NotJson,
            message: "body is not json".into(),
        });
        let idem_http::Decision::Invalid(i) = decision(i) else {
            panic!("not invalid");
        };
        assert_eq!(
            (i.field, i.rule, i.message.as_str()),
            (
                idem_http::Field::Body,
                idem_http::Rule::NotJson,
                "body is not json"
            )
        );
    }

    #[test]
    fn engine_errors_are_store_or_other() {
        assert_eq!(
            engine_failure(&EngineError::Store(StoreError::Unavailable("down".into()))),
            idem_http::EngineFailure::Store
        );
        assert_eq!(
            engine_failure(&EngineError::Corrupt("bad record".into())),
            idem_http::EngineFailure::Other
        );
    }

    #[test]
    fn problems_become_responses() {
        let p = idem_http::Problem::in_progress(1500);
        let r = problem_response(&p);
        assert_eq!(r.status, 409);
        assert!(
            r.headers
                .contains(&("retry-after".to_string(), b"2".to_vec()))
        );
        assert!(r.headers.contains(&(
            "content-type".to_string(),
            b"application/problem+json".to_vec()
        )));
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body, p.to_json());
    }

    #[test]
    fn verdicts_map_to_dispositions() {
        assert_eq!(disposition(idem_http::Verdict::Complete), None);
        assert_eq!(
            disposition(idem_http::Verdict::Final),
            Some(Disposition::Final)
        );
        assert_eq!(
            disposition(idem_http::Verdict::Retryable),
            Some(Disposition::Retryable)
        );
        assert_eq!(body_kind(idem_http::BodyKind::Json), BodyKind::Json);
        assert_eq!(body_kind(idem_http::BodyKind::Raw), BodyKind::Raw);
    }
}
