//! The `Idempotency-Key` header and the key's scope, over `http`'s types.
//!
//! The rules are `idem_http`'s ([`idem_http::key`], [`idem_http::scope`]),
//! shared with the middleware component; this module only reads the
//! header map.

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue, header};

pub use idem_http::{KeyHeaderError, ScopeError};

use crate::config::AnonymousMode;

/// The `Idempotency-Key` header name.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(idem_http::IDEMPOTENCY_KEY);

/// The key in an `Idempotency-Key` header value, as
/// [`idem_http::parse_idempotency_key`] reads it: a Structured Field string
/// (`"abc"`) or a bare value (`abc`), both the key `abc`.
///
/// # Errors
///
/// [`KeyHeaderError`] when the value is not UTF-8, contains a control
/// character, or starts with `"` without being a valid sf-string.
pub fn parse_idempotency_key(value: &HeaderValue) -> Result<String, KeyHeaderError> {
    idem_http::parse_idempotency_key(value.as_bytes())
}

/// The scope of the request's keys, as [`idem_http::derive_scope`] derives
/// it from `headers`: the `scope_header`'s value (`hdr:`), else the hash of
/// `Authorization` (`auth:`), else as `anonymous` says (`client` is the
/// connection's peer address, for `client-address`).
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
    let values = |name: &HeaderName| -> Vec<&[u8]> {
        headers
            .get_all(name)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect()
    };
    let scope_values = scope_header.map(values);
    let scope = scope_header
        .zip(scope_values.as_deref())
        .map(|(name, values)| idem_http::ScopeHeader {
            name: name.as_str(),
            values,
        });
    idem_http::derive_scope(scope, &values(&header::AUTHORIZATION), anonymous, client)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn header_values_are_read_as_the_crate_reads_bytes() {
        for bytes in [
            &b"\"abc\""[..],
            b" abc ",
            b"\"a\"x",
            b"a\tb",
            b"ab\xffc",
            b"",
        ] {
            let value = HeaderValue::from_bytes(bytes).unwrap();
            assert_eq!(
                parse_idempotency_key(&value),
                idem_http::parse_idempotency_key(bytes)
            );
        }
        assert_eq!(IDEMPOTENCY_KEY.as_str(), "idempotency-key");
    }

    #[test]
    fn the_scope_reads_every_value_of_the_headers_it_uses() {
        let tenant = HeaderName::from_static("x-tenant-id");
        let mode = AnonymousMode::Reject;
        // Header names are case-insensitive in the map.
        let h = headers(&[("X-Tenant-Id", b"t-1"), ("Authorization", b"Bearer abc")]);
        assert_eq!(
            derive_scope(&h, Some(&tenant), mode, None).unwrap(),
            "hdr:t-1"
        );
        let auth = derive_scope(&h, None, mode, None).unwrap();
        assert_eq!(
            auth,
            idem_http::derive_scope(None, &[b"Bearer abc"], mode, None::<IpAddr>).unwrap()
        );
        let h = headers(&[("x-tenant-id", b"a"), ("x-tenant-id", b"b")]);
        assert_eq!(
            derive_scope(&h, Some(&tenant), mode, None),
            Err(ScopeError::Repeated("x-tenant-id".to_owned()))
        );
        let h = headers(&[("authorization", b"a"), ("authorization", b"b")]);
        assert_eq!(
            derive_scope(&h, Some(&tenant), mode, None),
            Err(ScopeError::Repeated("authorization".to_owned()))
        );
        let h = headers(&[("x-tenant-id", b"t\xff")]);
        assert_eq!(
            derive_scope(&h, Some(&tenant), mode, None),
            Err(ScopeError::NotText("x-tenant-id".to_owned()))
        );
        // Forwarded headers identify no one.
        let forwarded = headers(&[
            ("x-forwarded-for", b"198.51.100.7"),
            ("forwarded", b"for=198.51.100.7"),
            ("x-real-ip", b"198.51.100.7"),
        ]);
        let peer = Some("192.0.2.1".parse().unwrap());
        assert_eq!(
            derive_scope(&forwarded, None, mode, peer),
            Err(ScopeError::Unidentified)
        );
        assert_eq!(
            derive_scope(&forwarded, None, AnonymousMode::ClientAddress, peer),
            derive_scope(&HeaderMap::new(), None, AnonymousMode::ClientAddress, peer)
        );
    }
}
