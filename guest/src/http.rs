//! Plain-Rust HTTP rules of the middleware: reading the `Idempotency-Key`
//! header, the key's scope, the body kind, what a response status means for
//! the key, and RFC 9457 problem bodies.
//!
//! They follow `idem serve` (the host's `proxy` module) rule for rule, so a
//! client sees the same answers from the proxy and from the middleware.
//! Nothing here touches the component's imports: the unit tests run
//! natively.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::bindings::exports::idem::engine::engine::{BodyKind, Disposition};

/// The request header that carries the key (lowercase, as `wasi:http`
/// field names are compared).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The header set on every replayed response.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The base of every problem type URI: the same tag URIs (RFC 4151) as
/// `idem serve` (the host's `proxy::problem::PROBLEM_BASE`, where the
/// choice is explained). Each type is documented in the README's "Problem
/// types" table; a test keeps [`ProblemType::ALL`] in step with it.
pub const PROBLEM_BASE: &str = "tag:idem.invalid,2026:problems/";

/// The challenge sent with every 401, as `idem serve` sends it (RFC 9110
/// requires one; any `Authorization` scheme is accepted).
pub const WWW_AUTHENTICATE: &str = "Bearer realm=\"idem\"";

/// The media type of problem bodies.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// The most headers a stored response may have: the engine's limit.
pub const MAX_STORED_HEADERS: usize = 128;

/// The largest stored response body: the engine's limit.
pub const MAX_STORED_BODY_BYTES: usize = 16 * 1024 * 1024;

/// True for methods that store nothing and are passed straight through.
pub fn is_safe_method(method: &str) -> bool {
    matches!(method, "GET" | "HEAD" | "OPTIONS" | "TRACE" | "CONNECT")
}

/// True when a request with this method must carry a key: POST and PATCH,
/// as `idem serve` requires by default. Other unsafe methods (PUT, DELETE)
/// are idempotent by definition and pass through without one.
pub fn key_required(method: &str) -> bool {
    matches!(method, "POST" | "PATCH")
}

/// Why an `Idempotency-Key` header value could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyHeaderError {
    /// The value is not UTF-8.
    NotUtf8,
    /// The value contains a control character (such as a tab).
    ControlCharacter,
    /// The value starts with `"` but is not a Structured Field string
    /// (RFC 9651), or carries parameters.
    InvalidString,
}

impl fmt::Display for KeyHeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyHeaderError::NotUtf8 => "the Idempotency-Key header is not valid UTF-8",
            KeyHeaderError::ControlCharacter => {
                "the Idempotency-Key header contains a control character"
            }
            KeyHeaderError::InvalidString => {
                "the Idempotency-Key header starts with '\"' but is not a valid Structured Field string (RFC 9651)"
            }
        })
    }
}

/// The key in an `Idempotency-Key` header value: a Structured Field string
/// (`"abc"`, with `\"` and `\\` escapes) or a bare value taken as it is
/// after trimming spaces and tabs; both mean `abc`. An empty value gives an
/// empty key, which the engine refuses with its own message.
///
/// # Errors
///
/// [`KeyHeaderError`] when the value is not UTF-8, contains a control
/// character, or starts with `"` without being exactly one sf-string.
pub fn parse_idempotency_key(value: &[u8]) -> Result<String, KeyHeaderError> {
    let text = core::str::from_utf8(value).map_err(|_| KeyHeaderError::NotUtf8)?;
    let text = text.trim_matches([' ', '\t']);
    if text.chars().any(char::is_control) {
        return Err(KeyHeaderError::ControlCharacter);
    }
    let Some(quoted) = text.strip_prefix('"') else {
        return Ok(text.to_string());
    };
    // RFC 9651 section 4.2.5: printable ASCII, `\` escapes only `"` and
    // `\`, and nothing after the closing quote (no parameters, no list).
    let mut key = String::new();
    let mut chars = quoted.chars();
    loop {
        match chars.next() {
            None => return Err(KeyHeaderError::InvalidString),
            Some('"') => break,
            Some('\\') => match chars.next() {
                Some(c @ ('"' | '\\')) => key.push(c),
                _ => return Err(KeyHeaderError::InvalidString),
            },
            Some(c) if (' '..='~').contains(&c) => key.push(c),
            Some(_) => return Err(KeyHeaderError::InvalidString),
        }
    }
    if chars.next().is_some() {
        return Err(KeyHeaderError::InvalidString);
    }
    Ok(key)
}

/// What a keyed request without `Authorization` gets, as `idem serve`'s
/// `anonymous` route option (without its `client-address`: `wasi:http` 0.2
/// gives a component no client address).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anonymous {
    /// A 401 `client-unidentified`; nothing is stored.
    Reject,
    /// The one scope `anonymous`, shared by every unidentified client.
    Shared,
}

/// Why no scope could be derived from the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeError {
    /// The `Authorization` header occurs more than once.
    RepeatedAuthorization,
    /// There is no `Authorization` header and unidentified clients are
    /// refused.
    Unidentified,
}

impl fmt::Display for ScopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScopeError::RepeatedAuthorization => "the authorization header occurs more than once",
            ScopeError::Unidentified => "the request does not identify its client",
        })
    }
}

/// The scope of the request's keys, from its `Authorization` values:
/// `auth:<hex SHA-256 of the value>`; without one, as `anonymous` says
/// (`anonymous` under [`Anonymous::Shared`]). The same scopes as
/// `idem serve` without a configured scope header, so one client never
/// receives another's stored response.
///
/// # Errors
///
/// [`ScopeError::RepeatedAuthorization`] when the header occurs more than
/// once; [`ScopeError::Unidentified`] without one under
/// [`Anonymous::Reject`].
pub fn scope(authorization: &[&[u8]], anonymous: Anonymous) -> Result<String, ScopeError> {
    match (authorization, anonymous) {
        ([], Anonymous::Reject) => Err(ScopeError::Unidentified),
        ([], Anonymous::Shared) => Ok("anonymous".to_string()),
        ([value], _) => Ok(format!("auth:{}", hex(&Sha256::digest(value)))),
        _ => Err(ScopeError::RepeatedAuthorization),
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// The body kind for the fingerprint: JSON for `application/json` and
/// `*/*+json`, raw otherwise (and without a readable `Content-Type`).
pub fn body_kind(content_type: Option<&[u8]>) -> BodyKind {
    let Some(value) = content_type.and_then(|v| core::str::from_utf8(v).ok()) else {
        return BodyKind::Raw;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let json = essence == "application/json"
        || essence
            .split_once('/')
            .is_some_and(|(t, sub)| !t.is_empty() && sub.len() > 5 && sub.ends_with("+json"));
    if json { BodyKind::Json } else { BodyKind::Raw }
}

/// What a response status means for the key: `None` to complete (1xx to
/// 3xx), otherwise the failure's disposition. 408, 409, 425 and 429 are
/// retryable; other 4xx are final; 5xx are retryable, as `idem serve`'s
/// default (`server_errors = "retry"`).
pub fn classify_status(status: u16) -> Option<Disposition> {
    match status {
        100..=399 => None,
        408 | 409 | 425 | 429 => Some(Disposition::Retryable),
        400..=499 => Some(Disposition::Final),
        _ => Some(Disposition::Retryable),
    }
}

/// True when a response fits in the store and can be replayed.
pub fn storable(headers: usize, body_len: usize) -> bool {
    headers <= MAX_STORED_HEADERS && body_len <= MAX_STORED_BODY_BYTES
}

/// Milliseconds as a `Retry-After` value: whole seconds rounded up, at
/// least 1.
pub fn retry_after_secs(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

/// The kinds of problem the middleware answers with, as `idem serve`.
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
    /// 409: an earlier attempt may or may not have taken effect.
    OutcomeUnknown,
    /// 413: the request body is over the limit.
    BodyTooLarge,
    /// 400: other invalid input.
    InvalidRequest,
    /// 401: a keyed request without `Authorization`, refused under
    /// [`Anonymous::Reject`].
    ClientUnidentified,
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
    /// Every kind the middleware sends, in the order of the README's table.
    pub const ALL: [ProblemType; 12] = [
        ProblemType::KeyMissing,
        ProblemType::KeyInvalid,
        ProblemType::KeyReused,
        ProblemType::RequestInProgress,
        ProblemType::OutcomeUnknown,
        ProblemType::BodyTooLarge,
        ProblemType::InvalidRequest,
        ProblemType::ClientUnidentified,
        ProblemType::StoreUnavailable,
        ProblemType::RequestFailed,
        ProblemType::ResponseNotStored,
        ProblemType::InternalError,
    ];

    /// The last segment of the type URI.
    pub fn slug(self) -> &'static str {
        match self {
            ProblemType::KeyMissing => "key-missing",
            ProblemType::KeyInvalid => "key-invalid",
            ProblemType::KeyReused => "key-reused",
            ProblemType::RequestInProgress => "request-in-progress",
            ProblemType::OutcomeUnknown => "outcome-unknown",
            ProblemType::BodyTooLarge => "body-too-large",
            ProblemType::InvalidRequest => "invalid-request",
            ProblemType::ClientUnidentified => "client-unidentified",
            ProblemType::StoreUnavailable => "store-unavailable",
            ProblemType::RequestFailed => "request-failed",
            ProblemType::ResponseNotStored => "response-not-stored",
            ProblemType::InternalError => "internal-error",
        }
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
            ProblemType::InvalidRequest => "Request is invalid",
            ProblemType::ClientUnidentified => "The client is not identified",
            ProblemType::StoreUnavailable => "Idempotency store is unavailable",
            ProblemType::RequestFailed => "The request failed",
            ProblemType::ResponseNotStored => "The response was not stored",
            ProblemType::InternalError => "Internal error",
        }
    }

    /// The status the problem is answered with.
    pub fn status(self) -> u16 {
        match self {
            ProblemType::KeyMissing | ProblemType::KeyInvalid | ProblemType::InvalidRequest => 400,
            ProblemType::ClientUnidentified => 401,
            ProblemType::KeyReused => 422,
            ProblemType::RequestInProgress | ProblemType::OutcomeUnknown => 409,
            ProblemType::BodyTooLarge => 413,
            ProblemType::StoreUnavailable => 503,
            ProblemType::RequestFailed
            | ProblemType::ResponseNotStored
            | ProblemType::InternalError => 500,
        }
    }
}

/// One problem answer, ready to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// The kind.
    pub kind: ProblemType,
    /// The status code; the kind's own unless overridden.
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

    /// Adds an extension member.
    pub fn with(mut self, name: &str, value: impl Into<Value>) -> Self {
        self.extensions.insert(name.to_string(), value.into());
        self
    }

    /// Sets `Retry-After` to `ms` rounded up to whole seconds and adds the
    /// `retry_after_ms` member.
    pub fn retry_after_ms(mut self, ms: u64) -> Self {
        self.retry_after_secs = Some(retry_after_secs(ms));
        self.with("retry_after_ms", ms)
    }

    /// The JSON body; extensions never replace the standard members.
    pub fn to_json(&self) -> Value {
        let mut body = Map::new();
        body.insert(
            "type".into(),
            Value::String(format!("{PROBLEM_BASE}{}", self.kind.slug())),
        );
        body.insert("title".into(), Value::String(self.kind.title().into()));
        body.insert("status".into(), Value::from(self.status));
        body.insert("detail".into(), Value::String(self.detail.clone()));
        for (k, v) in &self.extensions {
            body.entry(k.clone()).or_insert_with(|| v.clone());
        }
        Value::Object(body)
    }

    /// The response headers: the media type, `Cache-Control: no-store`,
    /// `Retry-After` when set, and `WWW-Authenticate` on a 401.
    pub fn headers(&self) -> Vec<(String, Vec<u8>)> {
        let mut headers = Vec::from([
            ("content-type".to_string(), PROBLEM_CONTENT_TYPE.into()),
            ("cache-control".to_string(), b"no-store".to_vec()),
        ]);
        if let Some(secs) = self.retry_after_secs {
            headers.push(("retry-after".to_string(), secs.to_string().into_bytes()));
        }
        if self.status == 401 {
            headers.push(("www-authenticate".to_string(), WWW_AUTHENTICATE.into()));
        }
        headers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_and_bare_keys_are_the_same() {
        assert_eq!(parse_idempotency_key(b"\"abc\"").unwrap(), "abc");
        assert_eq!(parse_idempotency_key(b"abc").unwrap(), "abc");
        assert_eq!(parse_idempotency_key(b"  abc\t").unwrap(), "abc");
        assert_eq!(parse_idempotency_key(b" \"abc\" ").unwrap(), "abc");
        assert_eq!(parse_idempotency_key(br#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert_eq!(parse_idempotency_key(br#""a b""#).unwrap(), "a b");
    }

    #[test]
    fn bad_sf_strings_are_refused() {
        for bad in [
            &br#""abc"#[..],
            br#""abc"x"#,
            br#""a\x""#,
            br#""abc";p=1"#,
            br#""a","b""#,
            br#"""#,
            "\"é\"".as_bytes(),
        ] {
            assert_eq!(
                parse_idempotency_key(bad),
                Err(KeyHeaderError::InvalidString),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn bare_values_and_empty_keys_go_to_the_engine() {
        assert_eq!(parse_idempotency_key(b"abc\"").unwrap(), "abc\"");
        assert_eq!(parse_idempotency_key(b"").unwrap(), "");
        assert_eq!(parse_idempotency_key(b"\"\"").unwrap(), "");
    }

    #[test]
    fn non_utf8_and_control_characters_are_refused() {
        assert_eq!(
            parse_idempotency_key(b"ab\xffc"),
            Err(KeyHeaderError::NotUtf8)
        );
        assert_eq!(
            parse_idempotency_key(b"a\x01b"),
            Err(KeyHeaderError::ControlCharacter)
        );
        assert_eq!(
            parse_idempotency_key(b"\"a\tb\""),
            Err(KeyHeaderError::ControlCharacter)
        );
    }

    #[test]
    fn scopes_hash_the_credential() {
        for mode in [Anonymous::Reject, Anonymous::Shared] {
            let s = scope(&[b"Bearer abc"], mode).unwrap();
            assert_eq!(s, format!("auth:{}", hex(&Sha256::digest(b"Bearer abc"))));
            assert_eq!(s.len(), 5 + 64);
            assert_ne!(s, scope(&[b"Bearer abd"], mode).unwrap());
            assert_eq!(
                scope(&[b"a", b"b"], mode),
                Err(ScopeError::RepeatedAuthorization)
            );
        }
    }

    #[test]
    fn unidentified_clients_are_refused_or_share_one_scope() {
        assert_eq!(scope(&[], Anonymous::Reject), Err(ScopeError::Unidentified));
        assert_eq!(scope(&[], Anonymous::Shared).unwrap(), "anonymous");
        let p = Problem::new(ProblemType::ClientUnidentified, "who");
        assert_eq!(p.status, 401);
        assert!(
            p.headers()
                .contains(&("www-authenticate".to_string(), WWW_AUTHENTICATE.into()))
        );
        assert!(
            Problem::new(ProblemType::KeyMissing, "x")
                .headers()
                .iter()
                .all(|(n, _)| n != "www-authenticate")
        );
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
            .skip(2)
            .map(|l| {
                l.trim_matches('|')
                    .split(" | ")
                    .map(|c| c.trim().to_string())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_readme_table_lists_exactly_what_the_middleware_sends() {
        let rows = readme_problem_rows(include_str!("../../README.md"));
        let mut documented = Vec::new();
        for row in &rows {
            assert_eq!(
                row.len(),
                6,
                "a README problem row without 6 cells: {row:?}"
            );
            let uri = row[0].trim_matches('`');
            assert!(uri.starts_with(PROBLEM_BASE), "{uri}");
            if !row[5].contains("middleware") {
                assert!(
                    ProblemType::ALL
                        .iter()
                        .all(|k| format!("{PROBLEM_BASE}{}", k.slug()) != uri),
                    "{uri}: the middleware sends it, the README says it does not"
                );
                continue;
            }
            let Some(kind) = ProblemType::ALL
                .into_iter()
                .find(|k| format!("{PROBLEM_BASE}{}", k.slug()) == uri)
            else {
                panic!("the README says the middleware sends {uri}; it does not");
            };
            assert!(
                row[1].starts_with(&kind.status().to_string()),
                "{uri}: the README says status {:?}, the middleware sends {}",
                row[1],
                kind.status()
            );
            assert_eq!(row[2], kind.title(), "{uri}: the README's title differs");
            documented.push(kind);
        }
        assert_eq!(
            documented,
            ProblemType::ALL,
            "the README's problem table must list every middleware type once, in order"
        );
    }

    #[test]
    fn json_content_types_are_fingerprinted_as_json() {
        let kind = |ct: &str| body_kind(Some(ct.as_bytes()));
        assert_eq!(kind("application/json"), BodyKind::Json);
        assert_eq!(kind("Application/JSON; charset=utf-8"), BodyKind::Json);
        assert_eq!(kind("application/merge-patch+json"), BodyKind::Json);
        assert_eq!(kind("text/plain"), BodyKind::Raw);
        assert_eq!(kind("application/jsonx"), BodyKind::Raw);
        assert_eq!(kind("application/+json"), BodyKind::Raw);
        assert_eq!(kind("+json"), BodyKind::Raw);
        assert_eq!(body_kind(None), BodyKind::Raw);
        assert_eq!(body_kind(Some(b"\xff")), BodyKind::Raw);
    }

    #[test]
    fn statuses_settle_the_key_as_the_proxy_does() {
        assert_eq!(classify_status(200), None);
        assert_eq!(classify_status(201), None);
        assert_eq!(classify_status(302), None);
        assert_eq!(classify_status(400), Some(Disposition::Final));
        assert_eq!(classify_status(422), Some(Disposition::Final));
        for retry in [408, 409, 425, 429, 500, 503] {
            assert_eq!(classify_status(retry), Some(Disposition::Retryable));
        }
    }

    #[test]
    fn methods() {
        assert!(is_safe_method("GET") && is_safe_method("HEAD"));
        assert!(!is_safe_method("POST") && !is_safe_method("DELETE"));
        assert!(key_required("POST") && key_required("PATCH"));
        assert!(!key_required("PUT") && !key_required("DELETE"));
    }

    #[test]
    fn problems_have_the_rfc_9457_members() {
        let p = Problem::new(ProblemType::KeyReused, "used")
            .with("status", 200)
            .with("field", "idem-key");
        let v = p.to_json();
        assert_eq!(v["type"], "tag:idem.invalid,2026:problems/key-reused");
        assert_eq!(v["title"], "Idempotency-Key is already used");
        assert_eq!(v["status"], 422);
        assert_eq!(v["detail"], "used");
        assert_eq!(v["field"], "idem-key");
        assert_eq!(v.as_object().unwrap().len(), 5);
        assert!(p.headers().iter().all(|(n, _)| n != "retry-after"));

        let busy = Problem::new(ProblemType::RequestInProgress, "later").retry_after_ms(1500);
        assert_eq!(busy.status, 409);
        assert_eq!(busy.to_json()["retry_after_ms"], 1500);
        assert!(
            busy.headers()
                .contains(&("retry-after".to_string(), b"2".to_vec()))
        );
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1001), 2);
    }

    #[test]
    fn storable_follows_the_engine_limits() {
        assert!(storable(MAX_STORED_HEADERS, MAX_STORED_BODY_BYTES));
        assert!(!storable(MAX_STORED_HEADERS + 1, 0));
        assert!(!storable(0, MAX_STORED_BODY_BYTES + 1));
    }
}
