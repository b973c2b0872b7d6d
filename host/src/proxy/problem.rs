//! RFC 9457 problem details for every error the proxy makes itself.
//!
//! A problem names its type, title and status, says what the client should
//! do in `detail`, and carries extension members where useful. It never
//! echoes a stored response, the request body or another scope's data.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::{Map, Value, json};

/// The base of every problem type URI.
pub const PROBLEM_BASE: &str = "https://idem.dev/problems/";

/// The media type of problem bodies.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// The kinds of problem the proxy answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemType {
    /// 400: a request that needs an `Idempotency-Key` came without one.
    KeyMissing,
    /// 400: the `Idempotency-Key` is malformed or breaks the key rules.
    KeyInvalid,
    /// 422: the key was used for a different request.
    KeyReused,
    /// 409: the first request with this key is still running.
    RequestInProgress,
    /// 409 (504 to the request that timed out): an earlier attempt may or
    /// may not have taken effect.
    OutcomeUnknown,
    /// 413: the request body is over the limit.
    BodyTooLarge,
    /// 408: the request head or body did not arrive in time.
    RequestTimeout,
    /// 400: other invalid input (scope, body not JSON, …).
    InvalidRequest,
    /// 502: the upstream could not be reached; nothing was sent.
    UpstreamUnavailable,
    /// 504: a request without a key timed out at the upstream.
    UpstreamTimeout,
    /// 503: the idempotency store did not answer.
    StoreUnavailable,
    /// 500: the request failed for good and no response was kept.
    RequestFailed,
    /// 500: the request succeeded but its response was not kept.
    ResponseNotStored,
    /// 500: anything else.
    InternalError,
}

impl ProblemType {
    /// The last segment of the type URI, e.g. `key-missing`.
    pub fn slug(self) -> &'static str {
        match self {
            ProblemType::KeyMissing => "key-missing",
            ProblemType::KeyInvalid => "key-invalid",
            ProblemType::KeyReused => "key-reused",
            ProblemType::RequestInProgress => "request-in-progress",
            ProblemType::OutcomeUnknown => "outcome-unknown",
            ProblemType::BodyTooLarge => "body-too-large",
            ProblemType::RequestTimeout => "request-timeout",
            ProblemType::InvalidRequest => "invalid-request",
            ProblemType::UpstreamUnavailable => "upstream-unavailable",
            ProblemType::UpstreamTimeout => "upstream-timeout",
            ProblemType::StoreUnavailable => "store-unavailable",
            ProblemType::RequestFailed => "request-failed",
            ProblemType::ResponseNotStored => "response-not-stored",
            ProblemType::InternalError => "internal-error",
        }
    }

    /// The type URI.
    pub fn uri(self) -> String {
        format!("{PROBLEM_BASE}{}", self.slug())
    }

    /// The title; the IETF draft's titles where it has one.
    pub fn title(self) -> &'static str {
        match self {
            ProblemType::KeyMissing => "Idempotency-Key is missing",
            ProblemType::KeyInvalid => "Idempotency-Key is invalid",
            ProblemType::KeyReused => "Idempotency-Key is already used",
            ProblemType::RequestInProgress => "A request is outstanding for this Idempotency-Key",
            ProblemType::OutcomeUnknown => "The outcome of the request is unknown",
            ProblemType::BodyTooLarge => "Request body is too large",
            ProblemType::RequestTimeout => "The request did not arrive in time",
            ProblemType::InvalidRequest => "Request is invalid",
            ProblemType::UpstreamUnavailable => "Upstream is unavailable",
            ProblemType::UpstreamTimeout => "Upstream timed out",
            ProblemType::StoreUnavailable => "Idempotency store is unavailable",
            ProblemType::RequestFailed => "The request failed",
            ProblemType::ResponseNotStored => "The response was not stored",
            ProblemType::InternalError => "Internal error",
        }
    }

    /// The status the problem is usually answered with.
    pub fn status(self) -> StatusCode {
        match self {
            ProblemType::KeyMissing | ProblemType::KeyInvalid | ProblemType::InvalidRequest => {
                StatusCode::BAD_REQUEST
            }
            ProblemType::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemType::RequestInProgress | ProblemType::OutcomeUnknown => StatusCode::CONFLICT,
            ProblemType::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemType::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ProblemType::UpstreamUnavailable => StatusCode::BAD_GATEWAY,
            ProblemType::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ProblemType::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProblemType::RequestFailed
            | ProblemType::ResponseNotStored
            | ProblemType::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// One problem answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// The kind.
    pub kind: ProblemType,
    /// The status code; the kind's usual status unless overridden.
    pub status: StatusCode,
    /// What happened and what the client should do.
    pub detail: String,
    /// Extension members, such as `retry_after_ms`, `field` and `rule`.
    pub extensions: Map<String, Value>,
    /// The `Retry-After` header, in seconds.
    pub retry_after_secs: Option<u64>,
}

impl Problem {
    /// A problem of `kind` with its usual status.
    pub fn new(kind: ProblemType, detail: impl Into<String>) -> Self {
        Problem {
            kind,
            status: kind.status(),
            detail: detail.into(),
            extensions: Map::new(),
            retry_after_secs: None,
        }
    }

    /// Overrides the status.
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// Adds an extension member.
    pub fn with(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.extensions.insert(name.to_owned(), value.into());
        self
    }

    /// Sets `Retry-After` to `ms` rounded up to whole seconds, at least 1,
    /// and adds the `retry_after_ms` member.
    pub fn retry_after_ms(mut self, ms: u64) -> Self {
        self.retry_after_secs = Some(retry_after_secs(ms));
        self.with("retry_after_ms", ms)
    }

    /// The JSON body.
    pub fn to_json(&self) -> Value {
        let mut body = Map::new();
        body.insert("type".into(), json!(self.kind.uri()));
        body.insert("title".into(), json!(self.kind.title()));
        body.insert("status".into(), json!(self.status.as_u16()));
        body.insert("detail".into(), json!(self.detail));
        for (k, v) in &self.extensions {
            body.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Value::Object(body)
    }
}

/// Milliseconds as a `Retry-After` value: whole seconds rounded up, at
/// least 1.
pub fn retry_after_secs(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = self.to_json().to_string();
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(secs) = self.retry_after_secs {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_json_has_the_rfc_9457_members() {
        let p = Problem::new(
            ProblemType::KeyInvalid,
            "idem-key is too long: 300 bytes, at most 255 are allowed",
        )
        .with("field", "idem-key")
        .with("rule", "too-long");
        let v = p.to_json();
        assert_eq!(v["type"], "https://idem.dev/problems/key-invalid");
        assert_eq!(v["title"], "Idempotency-Key is invalid");
        assert_eq!(v["status"], 400);
        assert_eq!(
            v["detail"],
            "idem-key is too long: 300 bytes, at most 255 are allowed"
        );
        assert_eq!(v["field"], "idem-key");
        assert_eq!(v["rule"], "too-long");
        assert_eq!(v.as_object().unwrap().len(), 6);
    }

    #[test]
    fn titles_follow_the_ietf_draft() {
        assert_eq!(
            ProblemType::KeyMissing.title(),
            "Idempotency-Key is missing"
        );
        assert_eq!(
            ProblemType::KeyReused.title(),
            "Idempotency-Key is already used"
        );
        assert_eq!(
            ProblemType::RequestInProgress.title(),
            "A request is outstanding for this Idempotency-Key"
        );
        assert_eq!(ProblemType::KeyMissing.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            ProblemType::KeyReused.status(),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            ProblemType::RequestInProgress.status(),
            StatusCode::CONFLICT
        );
        assert_eq!(ProblemType::OutcomeUnknown.status(), StatusCode::CONFLICT);
        assert_eq!(
            ProblemType::BodyTooLarge.status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(
            ProblemType::UpstreamUnavailable.status(),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(
            ProblemType::StoreUnavailable.status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
    }

    #[test]
    fn extensions_cannot_replace_the_standard_members() {
        let v = Problem::new(ProblemType::InternalError, "x")
            .with("status", 200)
            .with("type", "about:blank")
            .to_json();
        assert_eq!(v["status"], 500);
        assert_eq!(v["type"], "https://idem.dev/problems/internal-error");
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1000), 1);
        assert_eq!(retry_after_secs(1001), 2);
        assert_eq!(retry_after_secs(2500), 3);
    }

    #[test]
    fn problem_responses_carry_the_media_type_and_retry_after() {
        let r = Problem::new(ProblemType::RequestInProgress, "retry later")
            .retry_after_ms(1500)
            .into_response();
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(
            r.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let r = Problem::new(ProblemType::OutcomeUnknown, "x")
            .with_status(StatusCode::GATEWAY_TIMEOUT)
            .into_response();
        assert_eq!(r.status(), StatusCode::GATEWAY_TIMEOUT);
        assert!(r.headers().get(header::RETRY_AFTER).is_none());
    }
}
