//! Reading the `Idempotency-Key` header and deriving the key's scope.
//!
//! The key's own rules (length, characters) are the engine's: this module
//! only turns the header into a string. An empty key is passed on, and the
//! engine answers `invalid`.

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue, header};
use sha2::{Digest, Sha256};

use super::config::AnonymousMode;

/// The `Idempotency-Key` header name.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Why an `Idempotency-Key` header value could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyHeaderError {
    /// The value is not UTF-8.
    #[error("the Idempotency-Key header is not valid UTF-8")]
    NotUtf8,
    /// The value contains a control character (such as a tab).
    #[error("the Idempotency-Key header contains a control character")]
    ControlCharacter,
    /// The value starts with `"` but is not a Structured Field string
    /// (RFC 9651), or carries parameters.
    #[error(
        "the Idempotency-Key header starts with '\"' but is not a valid Structured Field string (RFC 9651)"
    )]
    InvalidString,
}

/// The key in an `Idempotency-Key` header value.
///
/// Accepts the IETF draft's form, a Structured Field string (`"abc"`, with
/// `\"` and `\\` escapes), and a bare value (`abc`, taken as it is after
/// trimming surrounding whitespace); both mean the key `abc`. An empty
/// value gives an empty key, which the engine refuses.
///
/// # Errors
///
/// [`KeyHeaderError`] when the value is not UTF-8, contains a control
/// character, or starts with `"` without being a valid sf-string.
pub fn parse_idempotency_key(value: &HeaderValue) -> Result<String, KeyHeaderError> {
    let text = std::str::from_utf8(value.as_bytes()).map_err(|_| KeyHeaderError::NotUtf8)?;
    let text = text.trim_matches([' ', '\t']);
    if text.chars().any(char::is_control) {
        return Err(KeyHeaderError::ControlCharacter);
    }
    if !text.starts_with('"') {
        return Ok(text.to_owned());
    }
    let item: sfv::Item = sfv::Parser::new(text)
        .parse_item()
        .map_err(|_| KeyHeaderError::InvalidString)?;
    if !item.params.is_empty() {
        return Err(KeyHeaderError::InvalidString);
    }
    item.bare_item
        .as_string()
        .map(|s| s.as_str().to_owned())
        .ok_or(KeyHeaderError::InvalidString)
}

/// Why no scope could be derived from the request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScopeError {
    /// The header occurs more than once.
    #[error("the {0} header occurs more than once")]
    Repeated(String),
    /// The scope header's value is not UTF-8 or contains a control character.
    #[error("the {0} header must be printable text")]
    NotText(String),
    /// The request names no client, and the route's `anonymous` is
    /// `"reject"`.
    #[error("the request does not identify its client")]
    Unidentified,
    /// The route's `anonymous` is `"client-address"`, but the connection's
    /// address is not known (the router was served without it).
    #[error("the client's address is not known")]
    NoClientAddress,
}

/// The scope of the request's keys: whose keys they are.
///
/// - `hdr:<value>` when `scope_header` is configured and present;
/// - else `auth:<hex SHA-256 of the Authorization value>`;
/// - else, for a request that names no client, as `anonymous` says:
///   [`AnonymousMode::Reject`] refuses it ([`ScopeError::Unidentified`]),
///   [`AnonymousMode::Shared`] gives every such request the one scope
///   `anonymous`, and [`AnonymousMode::ClientAddress`] gives
///   `addr:<hex SHA-256 of the client's IP address>` (`client`, the TCP
///   peer; an IPv4-mapped IPv6 address counts as the IPv4 one).
///
/// The prefixes keep the forms apart: no header value can produce the scope
/// of a credential or of an address. Forwarded headers (`Forwarded`,
/// `X-Forwarded-For`) are never read: a client can write any value there.
///
/// # Errors
///
/// [`ScopeError`] when the header used occurs more than once, the scope
/// header is not text, the request names no client under `reject`, or the
/// address is needed and `client` is `None`.
pub fn derive_scope(
    headers: &HeaderMap,
    scope_header: Option<&HeaderName>,
    anonymous: AnonymousMode,
    client: Option<IpAddr>,
) -> Result<String, ScopeError> {
    if let Some(name) = scope_header
        && let Some(value) = single(headers, name)?
    {
        let text = std::str::from_utf8(value.as_bytes())
            .ok()
            .filter(|t| !t.chars().any(char::is_control))
            .ok_or_else(|| ScopeError::NotText(name.to_string()))?;
        return Ok(format!("hdr:{text}"));
    }
    if let Some(value) = single(headers, &header::AUTHORIZATION)? {
        return Ok(format!("auth:{}", hex(&Sha256::digest(value.as_bytes()))));
    }
    match anonymous {
        AnonymousMode::Reject => Err(ScopeError::Unidentified),
        AnonymousMode::Shared => Ok("anonymous".to_owned()),
        AnonymousMode::ClientAddress => {
            let ip = client.ok_or(ScopeError::NoClientAddress)?.to_canonical();
            Ok(format!(
                "addr:{}",
                hex(&Sha256::digest(ip.to_string().as_bytes()))
            ))
        }
    }
}

fn single<'a>(
    headers: &'a HeaderMap,
    name: &HeaderName,
) -> Result<Option<&'a HeaderValue>, ScopeError> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(ScopeError::Repeated(name.to_string()));
    }
    Ok(first)
}

/// Lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// The header parser's properties on arbitrary bytes, shared by the
/// cargo-fuzz target (`fuzz/`, built with `--cfg fuzzing`) and the
/// proptests below. Panics when one breaks.
#[cfg(any(test, fuzzing))]
pub(crate) fn check_key_header(bytes: &[u8]) {
    // Bytes no header can carry (NUL, CR, LF) never reach the parser.
    let Ok(value) = HeaderValue::from_bytes(bytes) else {
        return;
    };
    let parsed = parse_idempotency_key(&value);
    let text = std::str::from_utf8(bytes).ok();
    match (&parsed, text) {
        (Err(KeyHeaderError::NotUtf8), None) => return,
        (_, None) => panic!("non-UTF-8 bytes gave {parsed:?}"),
        (Err(KeyHeaderError::NotUtf8), Some(_)) => panic!("UTF-8 text refused as not UTF-8"),
        _ => {}
    }
    let trimmed = text.unwrap_or_default().trim_matches([' ', '\t']);
    if let Ok(key) = &parsed {
        assert!(
            !key.chars().any(char::is_control),
            "a control character in {key:?}"
        );
        if !trimmed.starts_with('"') {
            assert_eq!(key, trimmed, "a bare value was changed");
        }
    }
    if trimmed.chars().any(char::is_control) {
        assert_eq!(parsed, Err(KeyHeaderError::ControlCharacter));
        return;
    }
    // The same key as a Structured Field string means the same key.
    if let Some(key) = text.filter(|t| t.bytes().all(|b| (0x20..0x7f).contains(&b))) {
        let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
        let value = HeaderValue::from_str(&quoted).expect("printable ASCII is a header value");
        assert_eq!(
            parse_idempotency_key(&value).as_deref(),
            Ok(key),
            "{quoted}"
        );
        if !trimmed.starts_with('"') && trimmed == key {
            assert_eq!(parsed.as_deref(), Ok(key));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 4096,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        #[test]
        fn prop_any_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..48)) {
            check_key_header(&bytes);
        }

        #[test]
        fn prop_key_like_text(text in r#"[ \t]{0,2}"?([a-zA-Z0-9\-_:%'; ]|\\"|\\\\|"){0,24}"?[ \t]{0,2}"#) {
            check_key_header(text.as_bytes());
        }
    }

    fn parse(bytes: &[u8]) -> Result<String, KeyHeaderError> {
        parse_idempotency_key(&HeaderValue::from_bytes(bytes).unwrap())
    }

    #[test]
    fn quoted_and_bare_keys_are_the_same() {
        assert_eq!(parse(b"\"abc\"").unwrap(), "abc");
        assert_eq!(parse(b"abc").unwrap(), "abc");
        assert_eq!(parse(b"  abc  ").unwrap(), "abc");
        assert_eq!(parse(b" \"abc\" ").unwrap(), "abc");
        let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        assert_eq!(parse(format!("\"{uuid}\"").as_bytes()).unwrap(), uuid);
        assert_eq!(parse(uuid.as_bytes()).unwrap(), uuid);
    }

    #[test]
    fn escapes_in_sf_strings_are_decoded() {
        assert_eq!(parse(br#""a\"b""#).unwrap(), r#"a"b"#);
        assert_eq!(parse(br#""a\\b""#).unwrap(), r"a\b");
        assert_eq!(parse(br#""a b""#).unwrap(), "a b");
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
        ] {
            assert_eq!(
                parse(bad),
                Err(KeyHeaderError::InvalidString),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn bare_values_are_taken_as_they_are() {
        // The engine judges the characters; the parser does not.
        assert_eq!(parse(b"a b").unwrap(), "a b");
        assert_eq!(parse(b"abc\"").unwrap(), "abc\"");
        assert_eq!(parse(b":YWJj:").unwrap(), ":YWJj:");
    }

    #[test]
    fn non_utf8_and_control_characters_are_refused() {
        assert_eq!(parse(b"ab\xffc"), Err(KeyHeaderError::NotUtf8));
        assert_eq!(parse(b"a\tb"), Err(KeyHeaderError::ControlCharacter));
        assert_eq!(parse(b"\"a\tb\""), Err(KeyHeaderError::ControlCharacter));
    }

    #[test]
    fn empty_keys_go_to_the_engine() {
        assert_eq!(parse(b"").unwrap(), "");
        assert_eq!(parse(b"\"\"").unwrap(), "");
        assert_eq!(parse(b"   ").unwrap(), "");
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    /// The scope under `shared` with no known address: the forms that do
    /// not depend on the anonymous mode.
    fn scope(h: &HeaderMap, name: Option<&HeaderName>) -> Result<String, ScopeError> {
        derive_scope(h, name, AnonymousMode::Shared, None)
    }

    const MODES: [AnonymousMode; 3] = [
        AnonymousMode::Reject,
        AnonymousMode::Shared,
        AnonymousMode::ClientAddress,
    ];

    fn ip(text: &str) -> Option<IpAddr> {
        Some(text.parse().unwrap())
    }

    #[test]
    fn scope_from_authorization_is_a_hash() {
        let s = scope(&headers(&[("authorization", "Bearer abc")]), None).unwrap();
        // sha256("Bearer abc")
        let expected = hex(&Sha256::digest(b"Bearer abc"));
        assert_eq!(s, format!("auth:{expected}"));
        assert_eq!(s.len(), 5 + 64);
        assert!(!s.contains("Bearer"));
        let other = scope(&headers(&[("authorization", "Bearer abd")]), None).unwrap();
        assert_ne!(s, other);
        // An identified client's scope never depends on the anonymous mode
        // or its address.
        for mode in MODES {
            let h = headers(&[("authorization", "Bearer abc")]);
            assert_eq!(derive_scope(&h, None, mode, ip("192.0.2.1")).unwrap(), s);
            assert_eq!(derive_scope(&h, None, mode, None).unwrap(), s);
        }
    }

    #[test]
    fn scope_from_a_configured_header() {
        let name = HeaderName::from_static("x-tenant-id");
        let h = headers(&[("x-tenant-id", "t-1"), ("authorization", "Bearer abc")]);
        assert_eq!(scope(&h, Some(&name)).unwrap(), "hdr:t-1");
        for mode in MODES {
            assert_eq!(
                derive_scope(&h, Some(&name), mode, None).unwrap(),
                "hdr:t-1"
            );
            let only = headers(&[("x-tenant-id", "t-1")]);
            assert_eq!(
                derive_scope(&only, Some(&name), mode, None).unwrap(),
                "hdr:t-1"
            );
        }
        // Not configured: the header is ignored.
        assert!(scope(&h, None).unwrap().starts_with("auth:"));
        let only = headers(&[("x-tenant-id", "t-1")]);
        assert_eq!(
            derive_scope(&only, None, AnonymousMode::Reject, None),
            Err(ScopeError::Unidentified)
        );
        // Configured but absent: Authorization, then the anonymous mode.
        let h = headers(&[("authorization", "Bearer abc")]);
        assert!(scope(&h, Some(&name)).unwrap().starts_with("auth:"));
        assert_eq!(scope(&HeaderMap::new(), Some(&name)).unwrap(), "anonymous");
        assert_eq!(
            derive_scope(&HeaderMap::new(), Some(&name), AnonymousMode::Reject, None),
            Err(ScopeError::Unidentified)
        );
    }

    #[test]
    fn unidentified_requests_are_refused_under_reject() {
        let none = HeaderMap::new();
        for client in [None, ip("192.0.2.1")] {
            assert_eq!(
                derive_scope(&none, None, AnonymousMode::Reject, client),
                Err(ScopeError::Unidentified)
            );
        }
        // Forwarded headers identify no one.
        let forwarded = headers(&[
            ("x-forwarded-for", "198.51.100.7"),
            ("forwarded", "for=198.51.100.7"),
            ("x-real-ip", "198.51.100.7"),
        ]);
        assert_eq!(
            derive_scope(&forwarded, None, AnonymousMode::Reject, ip("192.0.2.1")),
            Err(ScopeError::Unidentified)
        );
        // The default mode is reject.
        assert_eq!(AnonymousMode::default(), AnonymousMode::Reject);
    }

    #[test]
    fn unidentified_requests_share_one_scope_under_shared() {
        for client in [None, ip("192.0.2.1"), ip("192.0.2.2")] {
            assert_eq!(
                derive_scope(&HeaderMap::new(), None, AnonymousMode::Shared, client).unwrap(),
                "anonymous"
            );
        }
    }

    #[test]
    fn unidentified_requests_are_scoped_by_address_under_client_address() {
        let mode = AnonymousMode::ClientAddress;
        let none = HeaderMap::new();
        let a = derive_scope(&none, None, mode, ip("192.0.2.1")).unwrap();
        assert_eq!(a, format!("addr:{}", hex(&Sha256::digest(b"192.0.2.1"))));
        assert_eq!(a.len(), 5 + 64);
        assert!(!a.contains("192.0.2.1"));
        // Another address, another scope; the same address, the same one.
        let b = derive_scope(&none, None, mode, ip("192.0.2.2")).unwrap();
        assert_ne!(a, b);
        assert_eq!(derive_scope(&none, None, mode, ip("192.0.2.1")).unwrap(), a);
        // An IPv4-mapped IPv6 peer (a dual-stack listener) is the IPv4 one.
        assert_eq!(
            derive_scope(&none, None, mode, ip("::ffff:192.0.2.1")).unwrap(),
            a
        );
        let v6 = derive_scope(&none, None, mode, ip("2001:db8::1")).unwrap();
        assert_eq!(v6, format!("addr:{}", hex(&Sha256::digest(b"2001:db8::1"))));
        // Forwarded headers are ignored: the connection's address decides.
        let forged = headers(&[
            ("x-forwarded-for", "192.0.2.2"),
            ("forwarded", "for=192.0.2.2"),
        ]);
        assert_eq!(
            derive_scope(&forged, None, mode, ip("192.0.2.1")).unwrap(),
            a
        );
        // Without an address the request is refused, never shared.
        assert_eq!(
            derive_scope(&none, None, mode, None),
            Err(ScopeError::NoClientAddress)
        );
    }

    #[test]
    fn the_forms_never_collide() {
        let name = HeaderName::from_static("x-tenant-id");
        let auth = scope(&headers(&[("authorization", "x")]), Some(&name)).unwrap();
        // A tenant header spelling out the credential's scope still differs.
        let forged = scope(&headers(&[("x-tenant-id", &auth)]), Some(&name)).unwrap();
        assert_ne!(auth, forged);
        assert!(forged.starts_with("hdr:auth:"));
        let anon = scope(&headers(&[("x-tenant-id", "anonymous")]), Some(&name)).unwrap();
        assert_ne!(anon, "anonymous");
        let addr = derive_scope(
            &HeaderMap::new(),
            Some(&name),
            AnonymousMode::ClientAddress,
            ip("192.0.2.1"),
        )
        .unwrap();
        let forged = scope(&headers(&[("x-tenant-id", &addr)]), Some(&name)).unwrap();
        assert_ne!(addr, forged);
        assert!(forged.starts_with("hdr:addr:"));
        // An Authorization value spelling an address hashes alike; the
        // prefixes keep the two apart.
        let cred = scope(&headers(&[("authorization", "192.0.2.1")]), None).unwrap();
        assert_eq!(cred[5..], addr[5..]);
        assert_ne!(cred, addr);
    }

    #[test]
    fn repeated_or_binary_scope_headers_are_refused() {
        let name = HeaderName::from_static("x-tenant-id");
        let h = headers(&[("x-tenant-id", "a"), ("x-tenant-id", "b")]);
        assert!(matches!(
            scope(&h, Some(&name)),
            Err(ScopeError::Repeated(_))
        ));
        let h = headers(&[("authorization", "a"), ("authorization", "b")]);
        assert!(matches!(scope(&h, None), Err(ScopeError::Repeated(_))));
        let mut h = HeaderMap::new();
        h.insert(name.clone(), HeaderValue::from_bytes(b"t\xff").unwrap());
        assert!(matches!(
            scope(&h, Some(&name)),
            Err(ScopeError::NotText(_))
        ));
    }
}
