//! Input validation.
//!
//! Every check returns `Err(InvalidInput)` naming the offending field, the
//! broken rule and a sentence that says both. Messages give lengths, counts
//! and positions, never the offending value: keys, bodies, results and
//! failures may hold personal or secret data.
//!
//! JSON validity of a `json` body is checked by the fingerprint, which
//! parses the body anyway.

use alloc::format;
use alloc::string::String;

use crate::bindings::exports::idem::engine::engine::{
    BeginRequest, BodyKind, InProgressMode, InputField, InputRule, InvalidInput, KeyCharset,
    KeyFormat, Policy,
};
use crate::bindings::idem::engine::types::{Failure, RecordKey, StoredResponse, Success};
use crate::canonical::is_valid_pointer;

/// Longest `scope`, in bytes: room for a tenant id plus a provider name,
/// and small enough for a database index.
pub const MAX_SCOPE_BYTES: usize = 255;

/// Longest `biz-type`, in bytes: biz types are short names such as
/// `order.create`, chosen by the developers, not the callers.
pub const MAX_BIZ_TYPE_BYTES: usize = 64;

/// Longest `idem-key`, in bytes, that any policy may allow: Stripe's limit,
/// which fits every UUID, ULID and external event id in use.
pub const MAX_KEY_BYTES: u32 = 255;

/// Longest attribute name or value, in bytes: enough for a long URL path,
/// and small enough that attributes cannot replace the body.
pub const MAX_ATTRIBUTE_BYTES: usize = 4096;

/// Most attributes per request: identity needs a handful (method, path,
/// tenant, content type), never hundreds.
pub const MAX_ATTRIBUTES: usize = 64;

/// Longest `result-ref`, in bytes: a reference (an id, a URL), not the
/// result itself.
pub const MAX_RESULT_REF_BYTES: usize = 1024;

/// Longest failure `code`, in bytes: a short machine-readable code.
pub const MAX_FAILURE_CODE_BYTES: usize = 128;

/// Longest failure `message`, in bytes: a sentence or a short paragraph for
/// humans, not a stack trace dump.
pub const MAX_FAILURE_MESSAGE_BYTES: usize = 4096;

/// Largest stored response body, in bytes: replayed responses live in the
/// record row, which stores keep in one column.
pub const MAX_RESPONSE_BODY_BYTES: usize = 16 * 1024 * 1024;

/// Most headers in a stored response: more than any real response carries.
pub const MAX_RESPONSE_HEADERS: usize = 128;

/// Longest bounded wait, in milliseconds: a caller waiting longer than a
/// minute should be told to retry instead of holding a connection.
pub const MAX_WAIT_MS: u64 = 60_000;

/// Most fingerprint fields per policy: each is a pointer lookup on every
/// request, and identity never needs more.
pub const MAX_FINGERPRINT_FIELDS: usize = 64;

/// Largest `max-body-bytes` a policy may set: the body is held in memory
/// twice (as given and canonical) while it is fingerprinted.
pub const MAX_BODY_LIMIT: u32 = 64 * 1024 * 1024;

/// Longest retention, in milliseconds: ten years covers any legal record
/// keeping, and keeps every expiry far inside the stores' signed 64-bit
/// millisecond columns.
pub const MAX_RETENTION_MS: u64 = 10 * 366 * 24 * 60 * 60 * 1000;

/// Longest lease (and retry-after hint), in milliseconds: a week. An owner
/// that needs longer should `extend`; a longer lease only delays recovery
/// from a crash.
pub const MAX_LEASE_MS: u64 = 7 * 24 * 60 * 60 * 1000;

/// Builds the error value.
fn invalid(field: InputField, rule: InputRule, message: String) -> InvalidInput {
    InvalidInput {
        field,
        rule,
        message,
    }
}

/// The key format used where no policy is given (`inspect`): 1 to 255 bytes
/// of printable ASCII, the loosest format a policy can set.
pub fn default_key_format() -> KeyFormat {
    KeyFormat {
        min_length: 1,
        max_length: MAX_KEY_BYTES,
        charset: KeyCharset::PrintableAscii,
    }
}

/// Checks a `scope`: 1 to [`MAX_SCOPE_BYTES`] bytes, no control characters.
///
/// # Errors
///
/// `scope` with `required`, `too-long` or `bad-character`.
pub fn scope(s: &str) -> Result<(), InvalidInput> {
    let field = InputField::Scope;
    if s.is_empty() {
        return Err(invalid(
            field,
            InputRule::Required,
            String::from("scope is required: it must not be empty"),
        ));
    }
    if s.len() > MAX_SCOPE_BYTES {
        return Err(invalid(
            field,
            InputRule::TooLong,
            format!(
                "scope is too long: {} bytes, at most {MAX_SCOPE_BYTES} are allowed",
                s.len()
            ),
        ));
    }
    if let Some((at, _)) = s.char_indices().find(|(_, c)| c.is_control()) {
        return Err(invalid(
            field,
            InputRule::BadCharacter,
            format!("scope has a bad character: a control character at byte {at}"),
        ));
    }
    Ok(())
}

/// True for the characters of a token: ASCII letters, digits and `-_.:`.
fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':')
}

/// Checks a `biz-type`: 1 to [`MAX_BIZ_TYPE_BYTES`] bytes of ASCII letters,
/// digits and `-_.:`.
///
/// # Errors
///
/// `biz-type` with `required`, `too-long` or `bad-character`.
pub fn biz_type(s: &str) -> Result<(), InvalidInput> {
    let field = InputField::BizType;
    if s.is_empty() {
        return Err(invalid(
            field,
            InputRule::Required,
            String::from("biz-type is required: it must not be empty"),
        ));
    }
    if s.len() > MAX_BIZ_TYPE_BYTES {
        return Err(invalid(
            field,
            InputRule::TooLong,
            format!(
                "biz-type is too long: {} bytes, at most {MAX_BIZ_TYPE_BYTES} are allowed",
                s.len()
            ),
        ));
    }
    if let Some(at) = s.bytes().position(|b| !is_token_char(b)) {
        return Err(invalid(
            field,
            InputRule::BadCharacter,
            format!(
                "biz-type has a bad character at byte {at}: only ASCII letters, digits and -_.: are allowed"
            ),
        ));
    }
    Ok(())
}

/// Checks an `idem-key` against `format`: non-empty, `min-length` to
/// `max-length` bytes, and the charset.
///
/// # Errors
///
/// `idem-key` with `required`, `too-short`, `too-long`, `bad-character`
/// (printable ASCII, token) or `bad-format` (UUID).
pub fn idem_key(s: &str, format: &KeyFormat) -> Result<(), InvalidInput> {
    let field = InputField::IdemKey;
    if s.is_empty() {
        return Err(invalid(
            field,
            InputRule::Required,
            String::from("idem-key is required: it must not be empty"),
        ));
    }
    let len = s.len();
    if u64::try_from(len).unwrap_or(u64::MAX) < u64::from(format.min_length) {
        return Err(invalid(
            field,
            InputRule::TooShort,
            format!(
                "idem-key is too short: {len} bytes, the policy requires at least {}",
                format.min_length
            ),
        ));
    }
    if u64::try_from(len).unwrap_or(u64::MAX) > u64::from(format.max_length) {
        return Err(invalid(
            field,
            InputRule::TooLong,
            format!(
                "idem-key is too long: {len} bytes, the policy allows at most {}",
                format.max_length
            ),
        ));
    }
    match format.charset {
        KeyCharset::PrintableAscii => {
            if let Some((at, c)) = s
                .char_indices()
                .find(|&(_, c)| !matches!(c, '\u{21}'..='\u{7e}'))
            {
                let what = if c.is_whitespace() {
                    "whitespace"
                } else if !c.is_ascii() {
                    "non-ASCII"
                } else {
                    "a control character"
                };
                return Err(invalid(
                    field,
                    InputRule::BadCharacter,
                    format!(
                        "idem-key has a bad character: {what} at byte {at}; only printable ASCII (0x21 to 0x7e) is allowed"
                    ),
                ));
            }
        }
        KeyCharset::Uuid => {
            if !is_uuid(s) {
                return Err(invalid(
                    field,
                    InputRule::BadFormat,
                    String::from(
                        "idem-key has a bad format: expected a UUID, 8-4-4-4-12 hex digits with hyphens",
                    ),
                ));
            }
        }
        KeyCharset::Token => {
            if let Some(at) = s.bytes().position(|b| !is_token_char(b)) {
                return Err(invalid(
                    field,
                    InputRule::BadCharacter,
                    format!(
                        "idem-key has a bad character at byte {at}: only ASCII letters, digits and -_.: are allowed"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// True for the 36-character hyphenated UUID form, hex digits in any case.
fn is_uuid(s: &str) -> bool {
    let bytes = s.as_bytes();
    bytes.len() == 36
        && bytes.iter().enumerate().all(|(i, &b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// Checks a record key: [`scope`], [`biz_type`], then [`idem_key`] with
/// `format`.
///
/// # Errors
///
/// The first error of the three checks.
pub fn record_key(key: &RecordKey, format: &KeyFormat) -> Result<(), InvalidInput> {
    scope(&key.scope)?;
    biz_type(&key.biz_type)?;
    idem_key(&key.idem_key, format)
}

/// A `policy` error with `rule`.
fn policy_err(rule: InputRule, message: String) -> InvalidInput {
    invalid(InputField::Policy, rule, message)
}

/// Fails with `out-of-range` unless `value` is from 1 to `max`.
fn in_range(value: u64, max: u64, name: &str) -> Result<(), InvalidInput> {
    if !(1..=max).contains(&value) {
        return Err(policy_err(
            InputRule::OutOfRange,
            format!("policy.{name} is out of range: it must be from 1 to {max}"),
        ));
    }
    Ok(())
}

/// Checks a policy.
///
/// # Errors
///
/// `policy` with `out-of-range` (durations, max-attempts, key-format
/// lengths, wait, max-body-bytes), `too-long` (too many fingerprint fields) or `bad-format`
/// (a fingerprint field that is not a JSON Pointer).
pub fn policy(p: &Policy) -> Result<(), InvalidInput> {
    in_range(p.retention_ms, MAX_RETENTION_MS, "retention-ms")?;
    in_range(p.lease_ms, MAX_LEASE_MS, "lease-ms")?;
    in_range(p.retry_after_ms, MAX_LEASE_MS, "retry-after-ms")?;
    if let Some(n) = p.max_attempts {
        in_range(u64::from(n), u64::from(u32::MAX), "max-attempts")?;
    }

    let kf = &p.key_format;
    in_range(
        u64::from(kf.min_length),
        u64::from(MAX_KEY_BYTES),
        "key-format.min-length",
    )?;
    if kf.max_length > MAX_KEY_BYTES {
        return Err(policy_err(
            InputRule::OutOfRange,
            format!(
                "policy.key-format.max-length is out of range: {} is above the limit of {MAX_KEY_BYTES}",
                kf.max_length
            ),
        ));
    }
    if kf.min_length > kf.max_length {
        return Err(policy_err(
            InputRule::OutOfRange,
            format!(
                "policy.key-format.min-length is out of range: {} is above policy.key-format.max-length {}",
                kf.min_length, kf.max_length
            ),
        ));
    }

    if let InProgressMode::Wait(w) = &p.in_progress {
        if w.max_wait_ms > MAX_WAIT_MS {
            return Err(policy_err(
                InputRule::OutOfRange,
                format!(
                    "policy.in-progress.max-wait-ms is out of range: {} is above the limit of {MAX_WAIT_MS}",
                    w.max_wait_ms
                ),
            ));
        }
        in_range(
            w.poll_interval_ms,
            MAX_WAIT_MS,
            "in-progress.poll-interval-ms",
        )?;
        if w.max_wait_ms > 0 && w.poll_interval_ms > w.max_wait_ms {
            return Err(policy_err(
                InputRule::OutOfRange,
                format!(
                    "policy.in-progress.poll-interval-ms is out of range: {} is above policy.in-progress.max-wait-ms {}",
                    w.poll_interval_ms, w.max_wait_ms
                ),
            ));
        }
    }

    if p.fingerprint_fields.len() > MAX_FINGERPRINT_FIELDS {
        return Err(policy_err(
            InputRule::TooLong,
            format!(
                "policy.fingerprint-fields is too long: {} fields, at most {MAX_FINGERPRINT_FIELDS} are allowed",
                p.fingerprint_fields.len()
            ),
        ));
    }
    if let Some(i) = p
        .fingerprint_fields
        .iter()
        .position(|f| !is_valid_pointer(f))
    {
        return Err(policy_err(
            InputRule::BadFormat,
            format!(
                "policy.fingerprint-fields[{i}] has a bad format: it is not a JSON Pointer (RFC 6901)"
            ),
        ));
    }

    if p.max_body_bytes > MAX_BODY_LIMIT {
        return Err(policy_err(
            InputRule::OutOfRange,
            format!(
                "policy.max-body-bytes is out of range: {} is above the limit of {MAX_BODY_LIMIT}",
                p.max_body_bytes
            ),
        ));
    }
    Ok(())
}

/// Checks request attributes: at most [`MAX_ATTRIBUTES`], each name 1 to
/// [`MAX_ATTRIBUTE_BYTES`] bytes, each value at most [`MAX_ATTRIBUTE_BYTES`].
fn attributes(attrs: &[(String, String)]) -> Result<(), InvalidInput> {
    let field = InputField::Attributes;
    if attrs.len() > MAX_ATTRIBUTES {
        return Err(invalid(
            field,
            InputRule::TooLong,
            format!(
                "attributes is too long: {} attributes, at most {MAX_ATTRIBUTES} are allowed",
                attrs.len()
            ),
        ));
    }
    for (i, (name, value)) in attrs.iter().enumerate() {
        if name.is_empty() {
            return Err(invalid(
                field,
                InputRule::Required,
                format!("attributes[{i}] name is required: it must not be empty"),
            ));
        }
        if name.len() > MAX_ATTRIBUTE_BYTES {
            return Err(invalid(
                field,
                InputRule::TooLong,
                format!(
                    "attributes[{i}] name is too long: {} bytes, at most {MAX_ATTRIBUTE_BYTES} are allowed",
                    name.len()
                ),
            ));
        }
        if value.len() > MAX_ATTRIBUTE_BYTES {
            return Err(invalid(
                field,
                InputRule::TooLong,
                format!(
                    "attributes[{i}] value is too long: {} bytes, at most {MAX_ATTRIBUTE_BYTES} are allowed",
                    value.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Checks everything in a `begin` request except the JSON validity of the
/// body: the policy, the key (with the policy's key format), the attributes,
/// then the body's size and kind.
///
/// # Errors
///
/// The first rule broken, in that order.
pub fn begin(req: &BeginRequest) -> Result<(), InvalidInput> {
    policy(&req.policy)?;
    record_key(&req.key, &req.policy.key_format)?;
    attributes(&req.attributes)?;
    let limit = req.policy.max_body_bytes;
    if u64::try_from(req.body.len()).unwrap_or(u64::MAX) > u64::from(limit) {
        return Err(invalid(
            InputField::Body,
            InputRule::TooLong,
            format!(
                "body is too long: {} bytes, the policy allows at most {limit}",
                req.body.len()
            ),
        ));
    }
    if !req.policy.fingerprint_fields.is_empty() && req.body_kind == BodyKind::Raw {
        return Err(policy_err(
            InputRule::BadFormat,
            String::from(
                "policy.fingerprint-fields has a bad format: fields need a json body, and the body kind is raw",
            ),
        ));
    }
    Ok(())
}

/// Checks a stored response for `field`, whose name in messages is `name`.
fn response(r: &StoredResponse, field: InputField, name: &str) -> Result<(), InvalidInput> {
    if !(100..=599).contains(&r.status) {
        return Err(invalid(
            field,
            InputRule::OutOfRange,
            format!("{name}.response.status is out of range: it must be 100 to 599"),
        ));
    }
    if r.headers.len() > MAX_RESPONSE_HEADERS {
        return Err(invalid(
            field,
            InputRule::TooLong,
            format!(
                "{name}.response.headers is too long: {} headers, at most {MAX_RESPONSE_HEADERS} are allowed",
                r.headers.len()
            ),
        ));
    }
    if let Some(i) = r.headers.iter().position(|(n, _)| n.is_empty()) {
        return Err(invalid(
            field,
            InputRule::Required,
            format!("{name}.response.headers[{i}] name is required: it must not be empty"),
        ));
    }
    if r.body.len() > MAX_RESPONSE_BODY_BYTES {
        return Err(invalid(
            field,
            InputRule::TooLong,
            format!(
                "{name}.response.body is too long: {} bytes, at most {MAX_RESPONSE_BODY_BYTES} are allowed",
                r.body.len()
            ),
        ));
    }
    Ok(())
}

/// Checks a success: `result-ref` at most [`MAX_RESULT_REF_BYTES`], and the
/// response.
///
/// # Errors
///
/// `success-result` with `too-long`, `out-of-range` or `required`.
pub fn success(s: &Success) -> Result<(), InvalidInput> {
    let field = InputField::SuccessResult;
    if let Some(r) = &s.result_ref
        && r.len() > MAX_RESULT_REF_BYTES
    {
        return Err(invalid(
            field,
            InputRule::TooLong,
            format!(
                "success.result-ref is too long: {} bytes, at most {MAX_RESULT_REF_BYTES} are allowed",
                r.len()
            ),
        ));
    }
    if let Some(r) = &s.response {
        response(r, field, "success")?;
    }
    Ok(())
}

/// Checks a failure: `code` 1 to [`MAX_FAILURE_CODE_BYTES`] bytes of
/// printable ASCII, `message` at most [`MAX_FAILURE_MESSAGE_BYTES`], and the
/// response.
///
/// # Errors
///
/// `failure-info` with `required`, `too-long`, `bad-character` or
/// `out-of-range`.
pub fn failure(f: &Failure) -> Result<(), InvalidInput> {
    let field = InputField::FailureInfo;
    if f.code.is_empty() {
        return Err(invalid(
            field,
            InputRule::Required,
            String::from("failure.code is required: it must not be empty"),
        ));
    }
    if f.code.len() > MAX_FAILURE_CODE_BYTES {
        return Err(invalid(
            field,
            InputRule::TooLong,
            format!(
                "failure.code is too long: {} bytes, at most {MAX_FAILURE_CODE_BYTES} are allowed",
                f.code.len()
            ),
        ));
    }
    if let Some(at) = f.code.bytes().position(|b| !matches!(b, 0x21..=0x7e)) {
        return Err(invalid(
            field,
            InputRule::BadCharacter,
            format!(
                "failure.code has a bad character at byte {at}: only printable ASCII (0x21 to 0x7e) is allowed"
            ),
        ));
    }
    if f.message.len() > MAX_FAILURE_MESSAGE_BYTES {
        return Err(invalid(
            field,
            InputRule::TooLong,
            format!(
                "failure.message is too long: {} bytes, at most {MAX_FAILURE_MESSAGE_BYTES} are allowed",
                f.message.len()
            ),
        ));
    }
    if let Some(r) = &f.response {
        response(r, field, "failure")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::exports::idem::engine::engine::{ExpiredLease, FailureMode, WaitSpec};
    use alloc::string::ToString;
    use alloc::vec;
    use alloc::vec::Vec;

    #[track_caller]
    fn fails(r: Result<(), InvalidInput>, field: InputField, rule: InputRule) -> String {
        match r {
            Ok(()) => panic!("expected {field:?}/{rule:?}, got Ok"),
            Err(e) => {
                assert_eq!((e.field, e.rule), (field, rule), "{}", e.message);
                e.message
            }
        }
    }

    #[track_caller]
    fn ok(r: Result<(), InvalidInput>) {
        if let Err(e) = r {
            panic!("expected Ok, got {:?}/{:?}: {}", e.field, e.rule, e.message);
        }
    }

    fn good_policy() -> Policy {
        Policy {
            retention_ms: 86_400_000,
            lease_ms: 30_000,
            retry_after_ms: 1_000,
            expired_lease: ExpiredLease::TakeOver,
            outcome_unknown: ExpiredLease::Manual,
            failure_mode: FailureMode::HonorDisposition,
            max_attempts: None,
            in_progress: InProgressMode::Reject,
            fingerprint_fields: Vec::new(),
            key_format: default_key_format(),
            max_body_bytes: 1024 * 1024,
        }
    }

    fn good_request() -> BeginRequest {
        BeginRequest {
            key: RecordKey {
                scope: "tenant-1".to_string(),
                biz_type: "order.create".to_string(),
                idem_key: "key-1".to_string(),
            },
            attributes: vec![("method".to_string(), "POST".to_string())],
            body_kind: BodyKind::Json,
            body: b"{}".to_vec(),
            policy: good_policy(),
        }
    }

    fn response_of(status: u16) -> StoredResponse {
        StoredResponse {
            status,
            headers: vec![("content-type".to_string(), b"application/json".to_vec())],
            body: b"{}".to_vec(),
        }
    }

    fn fmt(min: u32, max: u32, charset: KeyCharset) -> KeyFormat {
        KeyFormat {
            min_length: min,
            max_length: max,
            charset,
        }
    }

    // ---- scope ----

    #[test]
    fn scope_rules() {
        ok(scope("a"));
        ok(scope("tenant 1 / provider \u{e9}"));
        ok(scope(&"s".repeat(255)));
        fails(scope(""), InputField::Scope, InputRule::Required);
        let m = fails(
            scope(&"s".repeat(256)),
            InputField::Scope,
            InputRule::TooLong,
        );
        assert!(m.contains("256 bytes") && m.contains("255"), "{m}");
        // 255 bytes of two-byte characters is 127 characters plus one byte.
        ok(scope(&"\u{e9}".repeat(127)));
        fails(
            scope(&"\u{e9}".repeat(128)),
            InputField::Scope,
            InputRule::TooLong,
        );
        for bad in ["a\nb", "a\u{0}", "\t", "a\u{7f}", "a\u{85}"] {
            fails(scope(bad), InputField::Scope, InputRule::BadCharacter);
        }
    }

    // ---- biz type ----

    #[test]
    fn biz_type_rules() {
        ok(biz_type("order.create"));
        ok(biz_type("A-z_0.9:x"));
        ok(biz_type(&"b".repeat(64)));
        fails(biz_type(""), InputField::BizType, InputRule::Required);
        fails(
            biz_type(&"b".repeat(65)),
            InputField::BizType,
            InputRule::TooLong,
        );
        for bad in ["order create", "order/create", "caf\u{e9}", "a\n", "a+b"] {
            fails(biz_type(bad), InputField::BizType, InputRule::BadCharacter);
        }
    }

    // ---- idem key ----

    #[test]
    fn idem_key_required_and_lengths() {
        let f = default_key_format();
        fails(idem_key("", &f), InputField::IdemKey, InputRule::Required);
        ok(idem_key("k", &f));
        ok(idem_key(&"k".repeat(255), &f));
        let m = fails(
            idem_key(&"k".repeat(256), &f),
            InputField::IdemKey,
            InputRule::TooLong,
        );
        assert!(m.contains("256 bytes") && m.contains("at most 255"), "{m}");
        let f = fmt(8, 16, KeyCharset::PrintableAscii);
        let m = fails(
            idem_key("1234567", &f),
            InputField::IdemKey,
            InputRule::TooShort,
        );
        assert!(m.contains("7 bytes") && m.contains("at least 8"), "{m}");
        ok(idem_key("12345678", &f));
        ok(idem_key("1234567890123456", &f));
        fails(
            idem_key("12345678901234567", &f),
            InputField::IdemKey,
            InputRule::TooLong,
        );
        // Empty is "required" even when min-length would also catch it.
        fails(idem_key("", &f), InputField::IdemKey, InputRule::Required);
    }

    #[test]
    fn idem_key_lengths_are_bytes() {
        let f = fmt(1, 4, KeyCharset::PrintableAscii);
        // Two characters, six bytes: too long before the charset is checked.
        fails(
            idem_key("\u{20ac}\u{20ac}", &f),
            InputField::IdemKey,
            InputRule::TooLong,
        );
    }

    #[test]
    fn idem_key_printable_ascii() {
        let f = default_key_format();
        ok(idem_key("!~azAZ09-_.:/+=", &f));
        let m = fails(
            idem_key("a b", &f),
            InputField::IdemKey,
            InputRule::BadCharacter,
        );
        assert!(m.contains("whitespace") && m.contains("byte 1"), "{m}");
        let m = fails(
            idem_key("a\tb", &f),
            InputField::IdemKey,
            InputRule::BadCharacter,
        );
        assert!(m.contains("whitespace"), "{m}");
        let m = fails(
            idem_key(" ", &f),
            InputField::IdemKey,
            InputRule::BadCharacter,
        );
        assert!(m.contains("whitespace"), "{m}");
        let m = fails(
            idem_key("caf\u{e9}", &f),
            InputField::IdemKey,
            InputRule::BadCharacter,
        );
        assert!(m.contains("non-ASCII"), "{m}");
        let m = fails(
            idem_key("a\u{0}", &f),
            InputField::IdemKey,
            InputRule::BadCharacter,
        );
        assert!(m.contains("control"), "{m}");
        fails(
            idem_key("a\u{7f}", &f),
            InputField::IdemKey,
            InputRule::BadCharacter,
        );
        // The value itself is not quoted.
        let m = fails(
            idem_key("secret value", &f),
            InputField::IdemKey,
            InputRule::BadCharacter,
        );
        assert!(!m.contains("secret"), "{m}");
    }

    #[test]
    fn idem_key_uuid() {
        let f = fmt(1, 255, KeyCharset::Uuid);
        ok(idem_key("123e4567-e89b-12d3-a456-426614174000", &f));
        ok(idem_key("123E4567-E89B-12D3-A456-426614174ABC", &f));
        for bad in [
            "123e4567e89b12d3a456426614174000",
            "123e4567-e89b-12d3-a456-42661417400",
            "123e4567-e89b-12d3-a456-4266141740000",
            "123e4567-e89b-12d3-a456_426614174000",
            "g23e4567-e89b-12d3-a456-426614174000",
            "{123e4567-e89b-12d3-a456-42661417400}",
            "123e4567-e89b-12d3-a4564-26614174000",
            "x",
        ] {
            fails(idem_key(bad, &f), InputField::IdemKey, InputRule::BadFormat);
        }
    }

    #[test]
    fn idem_key_token() {
        let f = fmt(1, 255, KeyCharset::Token);
        ok(idem_key("evt_1N2b3C:retry-1.0", &f));
        for bad in ["a b", "a/b", "a+b", "caf\u{e9}", "a=b"] {
            fails(
                idem_key(bad, &f),
                InputField::IdemKey,
                InputRule::BadCharacter,
            );
        }
    }

    #[test]
    fn record_key_checks_in_order() {
        let f = default_key_format();
        let key = |s: &str, b: &str, k: &str| RecordKey {
            scope: s.to_string(),
            biz_type: b.to_string(),
            idem_key: k.to_string(),
        };
        ok(record_key(&key("s", "b", "k"), &f));
        fails(
            record_key(&key("", "", ""), &f),
            InputField::Scope,
            InputRule::Required,
        );
        fails(
            record_key(&key("s", "", ""), &f),
            InputField::BizType,
            InputRule::Required,
        );
        fails(
            record_key(&key("s", "b", ""), &f),
            InputField::IdemKey,
            InputRule::Required,
        );
        fails(
            record_key(&key("s", "b", "a b"), &f),
            InputField::IdemKey,
            InputRule::BadCharacter,
        );
    }

    #[test]
    fn default_key_format_is_loosest() {
        let f = default_key_format();
        assert_eq!(f.min_length, 1);
        assert_eq!(f.max_length, 255);
        assert_eq!(f.charset, KeyCharset::PrintableAscii);
        ok(policy(&Policy {
            key_format: f,
            ..good_policy()
        }));
    }

    // ---- policy ----

    #[test]
    fn policy_good() {
        ok(policy(&good_policy()));
        ok(policy(&Policy {
            retention_ms: 1,
            lease_ms: 1,
            retry_after_ms: 1,
            ..good_policy()
        }));
    }

    #[test]
    fn policy_durations_have_upper_bounds() {
        ok(policy(&Policy {
            retention_ms: MAX_RETENTION_MS,
            lease_ms: MAX_LEASE_MS,
            retry_after_ms: MAX_LEASE_MS,
            ..good_policy()
        }));
        for p in [
            Policy {
                retention_ms: MAX_RETENTION_MS + 1,
                ..good_policy()
            },
            Policy {
                lease_ms: MAX_LEASE_MS + 1,
                ..good_policy()
            },
            Policy {
                retry_after_ms: u64::MAX,
                ..good_policy()
            },
        ] {
            fails(policy(&p), InputField::Policy, InputRule::OutOfRange);
        }
    }

    #[test]
    fn policy_durations_at_least_one() {
        let m = fails(
            policy(&Policy {
                retention_ms: 0,
                ..good_policy()
            }),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        assert!(
            m.contains("policy.retention-ms") && m.contains("from 1 to"),
            "{m}"
        );
        let m = fails(
            policy(&Policy {
                lease_ms: 0,
                ..good_policy()
            }),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        assert!(m.contains("policy.lease-ms"), "{m}");
        let m = fails(
            policy(&Policy {
                retry_after_ms: 0,
                ..good_policy()
            }),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        assert!(m.contains("policy.retry-after-ms"), "{m}");
    }

    #[test]
    fn policy_key_format() {
        let with = |min, max| Policy {
            key_format: fmt(min, max, KeyCharset::Token),
            ..good_policy()
        };
        ok(policy(&with(1, 1)));
        ok(policy(&with(1, 255)));
        ok(policy(&with(255, 255)));
        let m = fails(
            policy(&with(0, 10)),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        assert!(m.contains("min-length"), "{m}");
        let m = fails(
            policy(&with(1, 256)),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        assert!(m.contains("max-length"), "{m}");
        fails(
            policy(&with(11, 10)),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        ok(policy(&with(10, 10)));
    }

    #[test]
    fn policy_wait() {
        let with = |max_wait_ms, poll_interval_ms| Policy {
            in_progress: InProgressMode::Wait(WaitSpec {
                max_wait_ms,
                poll_interval_ms,
            }),
            ..good_policy()
        };
        ok(policy(&with(60_000, 100)));
        ok(policy(&with(60_000, 60_000)));
        ok(policy(&with(1, 1)));
        ok(policy(&with(0, 1)));
        ok(policy(&with(0, MAX_WAIT_MS)));
        fails(
            policy(&with(0, MAX_WAIT_MS + 1)),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        let m = fails(
            policy(&with(60_001, 100)),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        assert!(m.contains("max-wait-ms"), "{m}");
        let m = fails(
            policy(&with(1_000, 0)),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        assert!(m.contains("poll-interval-ms"), "{m}");
        fails(
            policy(&with(0, 0)),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        let m = fails(
            policy(&with(1_000, 1_001)),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        assert!(m.contains("poll-interval-ms"), "{m}");
        ok(policy(&with(1_000, 1_000)));
    }

    #[test]
    fn policy_fingerprint_fields() {
        let with = |fields: Vec<String>| Policy {
            fingerprint_fields: fields,
            ..good_policy()
        };
        ok(policy(&with(vec![
            "/a".to_string(),
            "".to_string(),
            "/a~1b/0".to_string(),
        ])));
        ok(policy(&with(vec!["/f".to_string(); 64])));
        let m = fails(
            policy(&with(vec!["/f".to_string(); 65])),
            InputField::Policy,
            InputRule::TooLong,
        );
        assert!(m.contains("fingerprint-fields") && m.contains("65"), "{m}");
        for bad in ["a", "/~2", "/a~"] {
            let m = fails(
                policy(&with(vec!["/ok".to_string(), bad.to_string()])),
                InputField::Policy,
                InputRule::BadFormat,
            );
            assert!(m.contains("fingerprint-fields[1]"), "{m}");
        }
    }

    #[test]
    fn policy_max_body_bytes() {
        let with = |max_body_bytes| Policy {
            max_body_bytes,
            ..good_policy()
        };
        ok(policy(&with(0)));
        ok(policy(&with(64 * 1024 * 1024)));
        let m = fails(
            policy(&with(64 * 1024 * 1024 + 1)),
            InputField::Policy,
            InputRule::OutOfRange,
        );
        assert!(m.contains("max-body-bytes"), "{m}");
    }

    // ---- begin ----

    #[test]
    fn begin_good() {
        ok(begin(&good_request()));
    }

    #[test]
    fn begin_checks_policy_first() {
        let mut req = good_request();
        req.policy.lease_ms = 0;
        req.key.scope = String::new();
        fails(begin(&req), InputField::Policy, InputRule::OutOfRange);
    }

    #[test]
    fn begin_uses_policy_key_format() {
        let mut req = good_request();
        req.policy.key_format = fmt(1, 255, KeyCharset::Uuid);
        fails(begin(&req), InputField::IdemKey, InputRule::BadFormat);
        req.key.idem_key = "123e4567-e89b-12d3-a456-426614174000".to_string();
        ok(begin(&req));
        req.key.scope = String::new();
        fails(begin(&req), InputField::Scope, InputRule::Required);
    }

    #[test]
    fn begin_attributes() {
        let attr = |n: &str, v: &str| (n.to_string(), v.to_string());
        let mut req = good_request();
        req.attributes = vec![attr("n", ""); 64];
        ok(begin(&req));
        req.attributes = vec![attr("n", ""); 65];
        fails(begin(&req), InputField::Attributes, InputRule::TooLong);
        req.attributes = vec![];
        ok(begin(&req));
        req.attributes = vec![attr("a", "1"), attr("", "2")];
        let m = fails(begin(&req), InputField::Attributes, InputRule::Required);
        assert!(m.contains("attributes[1]"), "{m}");
        req.attributes = vec![attr(&"n".repeat(4096), &"v".repeat(4096))];
        ok(begin(&req));
        req.attributes = vec![attr(&"n".repeat(4097), "v")];
        let m = fails(begin(&req), InputField::Attributes, InputRule::TooLong);
        assert!(m.contains("name"), "{m}");
        req.attributes = vec![attr("n", &"v".repeat(4097))];
        let m = fails(begin(&req), InputField::Attributes, InputRule::TooLong);
        assert!(m.contains("value") && !m.contains("vvvv"), "{m}");
    }

    #[test]
    fn begin_body_size() {
        let mut req = good_request();
        req.policy.max_body_bytes = 10;
        req.body = vec![b' '; 10];
        ok(begin(&req));
        req.body = vec![b' '; 11];
        let m = fails(begin(&req), InputField::Body, InputRule::TooLong);
        assert!(m.contains("11 bytes") && m.contains("at most 10"), "{m}");
        req.policy.max_body_bytes = 0;
        req.body = Vec::new();
        ok(begin(&req));
    }

    #[test]
    fn begin_fields_need_json() {
        let mut req = good_request();
        req.policy.fingerprint_fields = vec!["/a".to_string()];
        ok(begin(&req));
        req.body_kind = BodyKind::Raw;
        fails(begin(&req), InputField::Policy, InputRule::BadFormat);
        req.policy.fingerprint_fields = Vec::new();
        ok(begin(&req));
    }

    #[test]
    fn begin_does_not_parse_json() {
        let mut req = good_request();
        req.body = b"not json".to_vec();
        ok(begin(&req));
    }

    // ---- success ----

    #[test]
    fn success_rules() {
        ok(success(&Success {
            result_ref: None,
            response: None,
        }));
        ok(success(&Success {
            result_ref: Some("r".repeat(1024)),
            response: Some(response_of(200)),
        }));
        let m = fails(
            success(&Success {
                result_ref: Some("r".repeat(1025)),
                response: None,
            }),
            InputField::SuccessResult,
            InputRule::TooLong,
        );
        assert!(
            m.contains("result-ref") && m.contains("1025") && !m.contains("rrrr"),
            "{m}"
        );
    }

    #[test]
    fn response_rules() {
        let check = |r: StoredResponse| {
            success(&Success {
                result_ref: None,
                response: Some(r),
            })
        };
        let field = InputField::SuccessResult;
        ok(check(response_of(100)));
        ok(check(response_of(599)));
        fails(check(response_of(99)), field, InputRule::OutOfRange);
        fails(check(response_of(600)), field, InputRule::OutOfRange);
        fails(check(response_of(0)), field, InputRule::OutOfRange);

        let headers = |n: usize| vec![("x-h".to_string(), b"v".to_vec()); n];
        ok(check(StoredResponse {
            headers: headers(128),
            ..response_of(200)
        }));
        fails(
            check(StoredResponse {
                headers: headers(129),
                ..response_of(200)
            }),
            field,
            InputRule::TooLong,
        );
        ok(check(StoredResponse {
            headers: Vec::new(),
            ..response_of(200)
        }));
        let m = fails(
            check(StoredResponse {
                headers: vec![
                    ("a".to_string(), Vec::new()),
                    (String::new(), b"v".to_vec()),
                ],
                ..response_of(200)
            }),
            field,
            InputRule::Required,
        );
        assert!(m.contains("headers[1]"), "{m}");

        ok(check(StoredResponse {
            body: vec![0; MAX_RESPONSE_BODY_BYTES],
            ..response_of(200)
        }));
        let m = fails(
            check(StoredResponse {
                body: vec![0; MAX_RESPONSE_BODY_BYTES + 1],
                ..response_of(200)
            }),
            field,
            InputRule::TooLong,
        );
        assert!(m.contains("response.body"), "{m}");
    }

    // ---- failure ----

    fn failure_of(code: &str, message: &str) -> Failure {
        Failure {
            code: code.to_string(),
            message: message.to_string(),
            response: None,
        }
    }

    #[test]
    fn failure_rules() {
        let field = InputField::FailureInfo;
        ok(failure(&failure_of("card-declined", "")));
        ok(failure(&failure_of(&"c".repeat(128), &"m".repeat(4096))));
        fails(failure(&failure_of("", "m")), field, InputRule::Required);
        let m = fails(
            failure(&failure_of(&"c".repeat(129), "m")),
            field,
            InputRule::TooLong,
        );
        assert!(m.contains("failure.code") && !m.contains("cccc"), "{m}");
        for bad in ["card declined", "d\u{e9}clin\u{e9}", "a\n", "a\u{7f}"] {
            fails(
                failure(&failure_of(bad, "m")),
                field,
                InputRule::BadCharacter,
            );
        }
        let m = fails(
            failure(&failure_of("c", &"m".repeat(4097))),
            field,
            InputRule::TooLong,
        );
        assert!(m.contains("failure.message") && !m.contains("mmmm"), "{m}");
        // Messages may hold anything printable or not.
        ok(failure(&failure_of("c", "line 1\nline 2 \u{e9}")));
    }

    #[test]
    fn failure_response_checked() {
        let field = InputField::FailureInfo;
        ok(failure(&Failure {
            response: Some(response_of(402)),
            ..failure_of("c", "m")
        }));
        let m = fails(
            failure(&Failure {
                response: Some(response_of(700)),
                ..failure_of("c", "m")
            }),
            field,
            InputRule::OutOfRange,
        );
        assert!(m.starts_with("failure.response.status"), "{m}");
    }

    #[test]
    fn limits() {
        assert_eq!(MAX_SCOPE_BYTES, 255);
        assert_eq!(MAX_BIZ_TYPE_BYTES, 64);
        assert_eq!(MAX_KEY_BYTES, 255);
        assert_eq!(MAX_ATTRIBUTE_BYTES, 4096);
        assert_eq!(MAX_ATTRIBUTES, 64);
        assert_eq!(MAX_RESULT_REF_BYTES, 1024);
        assert_eq!(MAX_FAILURE_CODE_BYTES, 128);
        assert_eq!(MAX_FAILURE_MESSAGE_BYTES, 4096);
        assert_eq!(MAX_RESPONSE_BODY_BYTES, 16_777_216);
        assert_eq!(MAX_RESPONSE_HEADERS, 128);
        assert_eq!(MAX_WAIT_MS, 60_000);
        assert_eq!(MAX_FINGERPRINT_FIELDS, 64);
        assert_eq!(MAX_BODY_LIMIT, 67_108_864);
    }
}
