//! RFC 9457 problem details for every error the proxy or the middleware
//! makes itself: the catalogue of types, and every detail text.
//!
//! A problem names its type, title and status, says what the client should
//! do in `detail`, and carries extension members where useful. It never
//! echoes a stored response, the request body or another scope's data.

use alloc::borrow::ToOwned;
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

use serde_json::{Map, Value};

use crate::key::KeyHeaderError;
use crate::scope::ScopeError;

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

/// The kinds of problem idem answers with.
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
    /// 409 (504 to the request whose upstream timed out, 500 to the one
    /// whose handler gave no response): an earlier attempt may or may not
    /// have taken effect.
    OutcomeUnknown,
    /// 413: the request body is over the limit.
    BodyTooLarge,
    /// 408: the request head or body did not arrive in time.
    RequestTimeout,
    /// 400: other invalid input (scope, body not JSON, …).
    InvalidRequest,
    /// 401: a keyed request names no client (neither the scope header nor
    /// `Authorization`) and unidentified clients are refused.
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
    /// Every kind, in the order of the README's table. The proxy can send
    /// each of them.
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

    /// True for the kinds the middleware component sends too: all but the
    /// proxy's own timeouts and upstream failures (a component reads no
    /// request head and calls no upstream).
    pub fn sent_by_middleware(self) -> bool {
        !matches!(
            self,
            ProblemType::RequestTimeout
                | ProblemType::UpstreamUnavailable
                | ProblemType::UpstreamTimeout
        )
    }

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

    /// The type URI: [`PROBLEM_BASE`] and the slug.
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
    pub fn status(self) -> u16 {
        match self {
            ProblemType::KeyMissing | ProblemType::KeyInvalid | ProblemType::InvalidRequest => 400,
            ProblemType::ClientUnidentified => 401,
            ProblemType::KeyReused => 422,
            ProblemType::RequestInProgress | ProblemType::OutcomeUnknown => 409,
            ProblemType::BodyTooLarge => 413,
            ProblemType::RequestTimeout => 408,
            ProblemType::UpstreamUnavailable => 502,
            ProblemType::UpstreamTimeout => 504,
            ProblemType::StoreUnavailable => 503,
            ProblemType::RequestFailed
            | ProblemType::ResponseNotStored
            | ProblemType::InternalError => 500,
        }
    }
}

/// Milliseconds as a `Retry-After` value: whole seconds rounded up, at
/// least 1.
pub fn retry_after_secs(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

/// One problem answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// The kind.
    pub kind: ProblemType,
    /// The status code; the kind's usual status unless overridden.
    pub status: u16,
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
    pub fn with_status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    /// Adds an extension member. It never replaces a standard member
    /// (`type`, `title`, `status`, `detail`) in the body.
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
        body.insert("type".into(), Value::String(self.kind.uri()));
        body.insert("title".into(), Value::String(self.kind.title().into()));
        body.insert("status".into(), Value::from(self.status));
        body.insert("detail".into(), Value::String(self.detail.clone()));
        for (k, v) in &self.extensions {
            body.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Value::Object(body)
    }

    /// The JSON body, serialised.
    pub fn body(&self) -> Vec<u8> {
        // A `Value` with string keys always serialises.
        serde_json::to_vec(&self.to_json()).unwrap_or_default()
    }

    /// The response headers (names lowercase): the media type,
    /// `Cache-Control: no-store`, `Retry-After` when set, and the
    /// `WWW-Authenticate` challenge on a 401.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = Vec::from([
            ("content-type", PROBLEM_CONTENT_TYPE.to_owned()),
            ("cache-control", "no-store".to_owned()),
        ]);
        if let Some(secs) = self.retry_after_secs {
            headers.push(("retry-after", secs.to_string()));
        }
        if self.status == 401 {
            headers.push(("www-authenticate", WWW_AUTHENTICATE.to_owned()));
        }
        headers
    }
}

/// The detail texts: one constructor for each situation in which idem
/// answers with a problem of its own.
impl Problem {
    /// A request with `method` that needs a key came without one.
    pub fn key_missing(method: &str) -> Self {
        Problem::new(
            ProblemType::KeyMissing,
            format!(
                "{method} requests to this endpoint need an Idempotency-Key header. Send a new unique key (e.g. a UUID) with each new request, and the same key when you retry it."
            ),
        )
    }

    /// The `Idempotency-Key` header could not be read.
    pub fn key_invalid(error: &KeyHeaderError) -> Self {
        Problem::new(
            ProblemType::KeyInvalid,
            format!(
                "{error}. Send the key as a Structured Field string such as \"8e03978e-40d5-43e8-bc93-6894a57f9324\", or as the bare value."
            ),
        )
    }

    /// The request carries several `Idempotency-Key` headers.
    pub fn several_keys() -> Self {
        Problem::new(
            ProblemType::KeyInvalid,
            "Several Idempotency-Key headers were sent. Send exactly one.",
        )
    }

    /// No scope could be derived; `scope_header` is the configured scope
    /// header's name, if any, which an unidentified client is told to send.
    pub fn scope(error: &ScopeError, scope_header: Option<&str>) -> Self {
        match error {
            ScopeError::Repeated(_) | ScopeError::NotText(_) => Problem::new(
                ProblemType::InvalidRequest,
                format!("{error}. Send it once, as printable text."),
            )
            .with("field", "scope"),
            ScopeError::Unidentified => {
                let how = match scope_header {
                    Some(name) => format!("an Authorization header or the {name} header"),
                    None => "an Authorization header".to_owned(),
                };
                Problem::new(
                    ProblemType::ClientUnidentified,
                    format!(
                        "Requests with an Idempotency-Key must say who the client is, so that no client receives another's stored response. Send {how}, then retry with the same Idempotency-Key: nothing was stored."
                    ),
                )
            }
            ScopeError::NoClientAddress => Problem::new(
                ProblemType::InternalError,
                "idem cannot tell this client apart from others, and the request was not run. Send an Authorization header.",
            ),
        }
    }

    /// The request body is over `limit` bytes.
    pub fn body_too_large(limit: u64) -> Self {
        Problem::new(
            ProblemType::BodyTooLarge,
            format!("The request body is over the limit of {limit} bytes. Send a smaller body."),
        )
        .with("max_body_bytes", limit)
    }

    /// The request body could not be read to its end.
    pub fn body_unreadable() -> Self {
        Problem::new(
            ProblemType::InvalidRequest,
            "The request body could not be read completely. Send it again with the same Idempotency-Key.",
        )
    }

    /// The request body did not arrive within `ms` milliseconds.
    pub fn body_timeout(ms: u64) -> Self {
        Problem::new(
            ProblemType::RequestTimeout,
            format!(
                "The request body did not arrive within {ms} ms. Send it again, whole, with the same Idempotency-Key."
            ),
        )
    }

    /// The request head did not arrive within `ms` milliseconds.
    pub fn head_timeout(ms: u64) -> Self {
        Problem::new(
            ProblemType::RequestTimeout,
            format!("The request head did not arrive within {ms} ms. Send the whole head at once."),
        )
    }

    /// The request has both `Content-Length` and `Transfer-Encoding`.
    pub fn conflicting_framing() -> Self {
        Problem::new(
            ProblemType::InvalidRequest,
            "The request has both Content-Length and Transfer-Encoding, which frame its body in two different ways. Send exactly one of them.",
        )
        .with("field", "framing")
    }

    /// The request was not completed for a reason of idem's own (a task
    /// that failed, a decision that cannot be answered).
    pub fn not_completed() -> Self {
        Problem::new(
            ProblemType::InternalError,
            "The request could not be completed. Retry with the same Idempotency-Key.",
        )
    }

    /// The stored response cannot be sent (its status is not valid).
    pub fn not_replayable() -> Self {
        Problem::new(
            ProblemType::InternalError,
            "The stored response for this Idempotency-Key cannot be replayed.",
        )
    }

    /// The idempotency store did not answer: 503, `Retry-After: 1`. The
    /// store's own message is not echoed.
    pub fn store_unavailable() -> Self {
        Problem::new(
            ProblemType::StoreUnavailable,
            "The idempotency store did not answer and the request was not forwarded. Retry with the same Idempotency-Key.",
        )
        .retry_after_ms(1000)
    }

    /// The engine failed for another reason.
    pub fn engine_failed() -> Self {
        Problem::new(
            ProblemType::InternalError,
            "The idempotency engine failed and the request was not forwarded.",
        )
    }

    /// A replay without a stored response.
    pub fn response_not_stored() -> Self {
        Problem::new(
            ProblemType::ResponseNotStored,
            "The request with this Idempotency-Key was already processed, but its response was not kept and cannot be replayed. Do not send it again.",
        )
    }

    /// The first request with the key is still running: retry after
    /// `retry_after_ms`.
    pub fn in_progress(retry_after_ms: u64) -> Self {
        Problem::new(
            ProblemType::RequestInProgress,
            format!(
                "The first request with this Idempotency-Key is still being processed. Retry after {} s with the same key and request.",
                retry_after_secs(retry_after_ms)
            ),
        )
        .retry_after_ms(retry_after_ms)
    }

    /// The key was used for another request.
    pub fn key_reused() -> Self {
        Problem::new(
            ProblemType::KeyReused,
            "This Idempotency-Key was already used with a different request (method, path or body). Use a new key for a new request.",
        )
    }

    /// The key's request failed for good without a stored response.
    pub fn request_failed() -> Self {
        Problem::new(
            ProblemType::RequestFailed,
            "The request with this Idempotency-Key failed for good, and no response was kept. Use a new key to try again.",
        )
    }

    /// An earlier attempt with the key may or may not have taken effect.
    pub fn outcome_unknown() -> Self {
        Problem::new(
            ProblemType::OutcomeUnknown,
            "An earlier attempt with this Idempotency-Key may or may not have taken effect. It will not be executed again until the outcome is settled; do not retry it with a new key before checking whether it took effect.",
        )
    }

    /// A keyed request's upstream could not be reached; nothing was sent.
    pub fn upstream_not_sent() -> Self {
        Problem::new(
            ProblemType::UpstreamUnavailable,
            "The upstream could not be reached and the request was not sent. Retry with the same Idempotency-Key.",
        )
    }

    /// A keyed request's upstream did not answer within `ms`: 504, the
    /// outcome unknown.
    pub fn upstream_timed_out(ms: u64) -> Self {
        Problem::new(
            ProblemType::OutcomeUnknown,
            format!(
                "The upstream did not answer within {ms} ms; the request may or may not have taken effect. Requests with this Idempotency-Key are refused until the outcome is settled."
            ),
        )
        .with_status(504)
    }

    /// A keyed request's upstream connection failed after sending: 504, the
    /// outcome unknown.
    pub fn upstream_failed() -> Self {
        Problem::new(
            ProblemType::OutcomeUnknown,
            "The connection to the upstream failed after the request was sent; it may or may not have taken effect. Requests with this Idempotency-Key are refused until the outcome is settled.",
        )
        .with_status(504)
    }

    /// A request without a key (passed through) got no answer within `ms`.
    pub fn passthrough_timeout(ms: u64) -> Self {
        Problem::new(
            ProblemType::UpstreamTimeout,
            format!("The upstream did not answer within {ms} ms."),
        )
    }

    /// A request without a key (passed through) could not reach the
    /// upstream.
    pub fn passthrough_unavailable() -> Self {
        Problem::new(
            ProblemType::UpstreamUnavailable,
            "The upstream could not be reached. Retry later.",
        )
    }

    /// The middleware's wrapped handler gave no complete response: 500, the
    /// outcome unknown.
    pub fn handler_incomplete() -> Self {
        Problem::new(
            ProblemType::OutcomeUnknown,
            "The handler gave no complete response; the request may or may not have taken effect. Requests with this Idempotency-Key are refused until the outcome is settled.",
        )
        .with_status(500)
    }

    /// The middleware's host gave no response slot for the wrapped handler.
    pub fn no_response_slot() -> Self {
        Problem::new(
            ProblemType::InternalError,
            "The host gave no response slot for the handler.",
        )
    }

    /// The middleware's host gave no route for the request, so nothing
    /// says how to treat it: it is not run.
    pub fn no_route() -> Self {
        Problem::new(
            ProblemType::InternalError,
            "The host gave no route for this request, and it was not run.",
        )
    }

    /// The component failed (trapped) and gave no response.
    pub fn component_failed() -> Self {
        Problem::new(
            ProblemType::InternalError,
            "The component failed and gave no response. Retry with the same Idempotency-Key.",
        )
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
        let parsed: Value = serde_json::from_slice(&p.body()).unwrap();
        assert_eq!(parsed, v);
    }

    #[test]
    fn titles_and_statuses_follow_the_ietf_draft() {
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
        assert_eq!(ProblemType::KeyMissing.status(), 400);
        assert_eq!(ProblemType::KeyReused.status(), 422);
        assert_eq!(ProblemType::RequestInProgress.status(), 409);
        assert_eq!(ProblemType::OutcomeUnknown.status(), 409);
        assert_eq!(ProblemType::BodyTooLarge.status(), 413);
        assert_eq!(ProblemType::RequestTimeout.status(), 408);
        assert_eq!(ProblemType::UpstreamUnavailable.status(), 502);
        assert_eq!(ProblemType::UpstreamTimeout.status(), 504);
        assert_eq!(ProblemType::StoreUnavailable.status(), 503);
        assert_eq!(ProblemType::ClientUnidentified.status(), 401);
        assert_eq!(ProblemType::InternalError.status(), 500);
    }

    #[test]
    fn type_uris_are_tag_uris_and_unique() {
        let mut uris = Vec::new();
        let mut titles = Vec::new();
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
            assert!(!uris.contains(&uri), "{kind:?} repeats a type");
            assert!(!titles.contains(&kind.title()), "{kind:?} repeats a title");
            uris.push(uri);
            titles.push(kind.title());
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

    /// The one check of the README's table: every type, in catalogue
    /// order, with its status, title and who sends it.
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
                panic!("the README documents {uri}, which is not in the catalogue");
            };
            let status = kind.status().to_string();
            assert!(
                row[1].starts_with(&status),
                "{uri}: the README says status {:?}, the catalogue {status}",
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
            assert_eq!(
                row[5].contains("middleware"),
                kind.sent_by_middleware(),
                "{uri}: the README's \"sent by\" is {:?}",
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
        let p = Problem::scope(&ScopeError::Unidentified, None);
        assert_eq!(p.status, 401);
        assert!(
            p.headers()
                .contains(&("www-authenticate", "Bearer realm=\"idem\"".to_owned()))
        );
        assert!(
            Problem::key_missing("POST")
                .headers()
                .iter()
                .all(|(n, _)| *n != "www-authenticate")
        );
    }

    #[test]
    fn extensions_cannot_replace_the_standard_members() {
        let v = Problem::new(ProblemType::InternalError, "x")
            .with("status", 200)
            .with("type", "about:blank")
            .with("title", "t")
            .with("detail", "d")
            .to_json();
        assert_eq!(v["status"], 500);
        assert_eq!(v["type"], "tag:idem.invalid,2026:problems/internal-error");
        assert_eq!(v["title"], "Internal error");
        assert_eq!(v["detail"], "x");
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1000), 1);
        assert_eq!(retry_after_secs(1001), 2);
        assert_eq!(retry_after_secs(2500), 3);
        assert_eq!(retry_after_secs(u64::MAX), u64::MAX.div_ceil(1000));
    }

    #[test]
    fn headers_carry_the_media_type_and_retry_after() {
        let busy = Problem::in_progress(1500);
        assert_eq!(busy.status, 409);
        assert_eq!(busy.to_json()["retry_after_ms"], 1500);
        assert!(busy.detail.contains("Retry after 2 s"), "{}", busy.detail);
        assert_eq!(
            busy.headers(),
            Vec::from([
                ("content-type", "application/problem+json".to_owned()),
                ("cache-control", "no-store".to_owned()),
                ("retry-after", "2".to_owned()),
            ])
        );
        let p = Problem::key_reused();
        assert!(p.headers().iter().all(|(n, _)| *n != "retry-after"));
        assert_eq!(p.headers().len(), 2);
    }

    #[test]
    fn key_problems_name_the_error() {
        let p = Problem::key_invalid(&KeyHeaderError::NotUtf8);
        assert_eq!(p.kind, ProblemType::KeyInvalid);
        assert!(
            p.detail
                .starts_with("the Idempotency-Key header is not valid UTF-8. Send the key as"),
            "{}",
            p.detail
        );
        let p = Problem::key_missing("PATCH");
        assert_eq!((p.kind, p.status), (ProblemType::KeyMissing, 400));
        assert!(p.detail.starts_with("PATCH requests to this endpoint"));
        assert_eq!(Problem::several_keys().kind, ProblemType::KeyInvalid);
    }

    #[test]
    fn scope_problems() {
        let p = Problem::scope(&ScopeError::Repeated("authorization".into()), None);
        assert_eq!((p.kind, p.status), (ProblemType::InvalidRequest, 400));
        assert_eq!(
            p.detail,
            "the authorization header occurs more than once. Send it once, as printable text."
        );
        assert_eq!(p.to_json()["field"], "scope");
        let p = Problem::scope(&ScopeError::NotText("x-tenant-id".into()), None);
        assert_eq!(p.kind, ProblemType::InvalidRequest);
        let p = Problem::scope(&ScopeError::Unidentified, Some("x-tenant-id"));
        assert_eq!(p.kind, ProblemType::ClientUnidentified);
        assert!(
            p.detail
                .contains("Send an Authorization header or the x-tenant-id header, then retry"),
            "{}",
            p.detail
        );
        let p = Problem::scope(&ScopeError::Unidentified, None);
        assert!(
            p.detail
                .contains("Send an Authorization header, then retry")
        );
        let p = Problem::scope(&ScopeError::NoClientAddress, None);
        assert_eq!((p.kind, p.status), (ProblemType::InternalError, 500));
    }

    #[test]
    fn body_and_upstream_problems() {
        let p = Problem::body_too_large(1024);
        assert_eq!((p.kind, p.status), (ProblemType::BodyTooLarge, 413));
        assert_eq!(p.to_json()["max_body_bytes"], 1024);
        assert!(p.detail.contains("limit of 1024 bytes"));
        assert_eq!(Problem::body_unreadable().status, 400);
        let p = Problem::body_timeout(250);
        assert_eq!((p.kind, p.status), (ProblemType::RequestTimeout, 408));
        assert!(p.detail.contains("within 250 ms"));
        assert_eq!(Problem::head_timeout(5).status, 408);
        assert_eq!(Problem::conflicting_framing().to_json()["field"], "framing");
        let p = Problem::upstream_timed_out(30);
        assert_eq!((p.kind, p.status), (ProblemType::OutcomeUnknown, 504));
        assert!(p.detail.contains("within 30 ms"));
        let p = Problem::upstream_failed();
        assert_eq!((p.kind, p.status), (ProblemType::OutcomeUnknown, 504));
        let p = Problem::upstream_not_sent();
        assert_eq!((p.kind, p.status), (ProblemType::UpstreamUnavailable, 502));
        let p = Problem::passthrough_timeout(7);
        assert_eq!((p.kind, p.status), (ProblemType::UpstreamTimeout, 504));
        assert_eq!(Problem::passthrough_unavailable().status, 502);
        let p = Problem::handler_incomplete();
        assert_eq!((p.kind, p.status), (ProblemType::OutcomeUnknown, 500));
        for p in [
            Problem::no_response_slot(),
            Problem::component_failed(),
            Problem::not_completed(),
            Problem::not_replayable(),
            Problem::engine_failed(),
            Problem::no_route(),
        ] {
            assert_eq!((p.kind, p.status), (ProblemType::InternalError, 500));
        }
    }

    #[test]
    fn the_store_problem_asks_for_a_retry() {
        let p = Problem::store_unavailable();
        assert_eq!((p.kind, p.status), (ProblemType::StoreUnavailable, 503));
        assert_eq!(p.retry_after_secs, Some(1));
        assert!(p.headers().contains(&("retry-after", "1".to_owned())));
    }
}
