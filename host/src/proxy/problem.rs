//! RFC 9457 problem details for every error the proxy makes itself.
//!
//! A problem names its type, title and status, says what the client should
//! do in `detail`, and carries extension members where useful. It never
//! echoes a stored response, the request body or another scope's data.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use serde_json::{Map, Value, json};

/// The base of every problem type URI: a tag URI (RFC 4151), an identifier
/// that is not meant to be dereferenced (RFC 9457, section 3.1.1 allows
/// it).
///
/// idem has no domain or published documentation address of its own, so
/// an `https` type would point at a page nobody serves. `idem.invalid` is
/// a name reserved never to be assigned (RFC 6761): no one else can mint
/// a tag under it, so the types cannot collide with anyone's, and nobody
/// is led to look them up. Each type is documented in the README's
/// "Problem types" table, which a test keeps in step with [`ProblemType::ALL`].
pub const PROBLEM_BASE: &str = "tag:idem.invalid,2026:problems/";

/// The challenge sent with every 401: RFC 9110 requires one. idem accepts
/// any `Authorization` scheme (it only hashes the value), so this names the
/// usual one for APIs.
pub const WWW_AUTHENTICATE: &str = "Bearer realm=\"idem\"";

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
    /// 401: a keyed request names no client (neither the scope header nor
    /// `Authorization`) on a route whose `anonymous` is `"reject"`.
    ClientUnidentified,
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
    /// Every kind, in the order of the README's table.
    pub const ALL: [ProblemType; 15] = [
        ProblemType::KeyMissing,
        ProblemType::KeyInvalid,
        ProblemType::KeyReused,
        ProblemType::RequestInProgress,
        ProblemType::OutcomeUnknown,
        ProblemType::BodyTooLarge,
        ProblemType::RequestTimeout,
        ProblemType::InvalidRequest,
        ProblemType::ClientUnidentified,
        ProblemType::UpstreamUnavailable,
        ProblemType::UpstreamTimeout,
        ProblemType::StoreUnavailable,
        ProblemType::RequestFailed,
        ProblemType::ResponseNotStored,
        ProblemType::InternalError,
    ];

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
            ProblemType::ClientUnidentified => "client-unidentified",
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
            ProblemType::ClientUnidentified => "The client is not identified",
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
            ProblemType::ClientUnidentified => StatusCode::UNAUTHORIZED,
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
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(WWW_AUTHENTICATE),
            );
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
        assert_eq!(v["type"], "tag:idem.invalid,2026:problems/key-invalid");
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
        assert_eq!(
            ProblemType::ClientUnidentified.status(),
            StatusCode::UNAUTHORIZED
        );
    }

    #[test]
    fn type_uris_are_tag_uris_and_unique() {
        let mut seen = std::collections::HashSet::new();
        for kind in ProblemType::ALL {
            let uri = kind.uri();
            // RFC 4151: tag:<authority>,<date>:<specific>.
            assert!(uri.starts_with("tag:idem.invalid,2026:problems/"), "{uri}");
            assert!(
                kind.slug()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'-'),
                "{uri}"
            );
            assert!(seen.insert(uri), "{kind:?} repeats a type");
            assert!(
                seen.insert(kind.title().to_owned()),
                "{kind:?} repeats a title"
            );
        }
    }

    /// The rows of the README's "Problem types" table, as cells.
    fn readme_problem_rows(readme: &str) -> Vec<Vec<String>> {
        let Some(start) = readme.find("\n### Problem types\n") else {
            panic!("README.md has no \"### Problem types\" section");
        };
        readme[start..]
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .skip(2) // the header and the separator
            .map(|l| {
                l.trim_matches('|')
                    .split(" | ")
                    .map(|c| c.trim().to_owned())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_readme_table_lists_exactly_the_catalogue() {
        let rows = readme_problem_rows(include_str!("../../../README.md"));
        let mut documented = Vec::new();
        for row in &rows {
            assert_eq!(
                row.len(),
                6,
                "a README problem row without 6 cells: {row:?}"
            );
            let uri = row[0].trim_matches('`');
            let Some(kind) = ProblemType::ALL.into_iter().find(|k| k.uri() == uri) else {
                panic!("the README documents {uri}, which the proxy does not send");
            };
            let status = kind.status().as_u16().to_string();
            assert!(
                row[1].starts_with(&status),
                "{uri}: the README says status {:?}, the proxy sends {status}",
                row[1]
            );
            assert_eq!(row[2], kind.title(), "{uri}: the README's title differs");
            assert!(
                !row[3].is_empty() && !row[4].is_empty(),
                "{uri}: empty cells"
            );
            assert!(
                row[5].contains("proxy"),
                "{uri}: the proxy sends it: {:?}",
                row[5]
            );
            documented.push(kind);
        }
        assert_eq!(
            documented,
            ProblemType::ALL,
            "the README's problem table must list every type once, in catalogue order"
        );
    }

    #[test]
    fn a_401_carries_a_challenge() {
        let r = Problem::new(ProblemType::ClientUnidentified, "who are you").into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            r.headers()[header::WWW_AUTHENTICATE],
            "Bearer realm=\"idem\""
        );
        let r = Problem::new(ProblemType::KeyMissing, "x").into_response();
        assert!(r.headers().get(header::WWW_AUTHENTICATE).is_none());
    }

    #[test]
    fn extensions_cannot_replace_the_standard_members() {
        let v = Problem::new(ProblemType::InternalError, "x")
            .with("status", 200)
            .with("type", "about:blank")
            .to_json();
        assert_eq!(v["status"], 500);
        assert_eq!(v["type"], "tag:idem.invalid,2026:problems/internal-error");
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
