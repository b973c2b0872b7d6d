//! The scope of a request's keys: whose keys they are.

use alloc::borrow::ToOwned;
use alloc::format;
use alloc::string::{String, ToString};
use core::fmt;
use core::net::IpAddr;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::hex;

/// What a keyed request that names no client gets: one with neither the
/// configured scope header nor an `Authorization` header (the proxy's
/// `anonymous` route option; the middleware always rejects).
///
/// The scope decides whose stored responses a request may receive, so an
/// unidentified client cannot be told apart from another one. The default
/// fails closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AnonymousMode {
    /// `"reject"`: 401 `client-unidentified`; nothing is stored and the
    /// upstream is not called. The default: a client that sends another
    /// client's key can never receive that client's stored response.
    #[default]
    Reject,
    /// `"shared"`: the scope `anonymous`. Every unidentified client shares
    /// one key space, so one that sends another's key gets that client's
    /// stored response (or a 422 that tells it the key is taken).
    Shared,
    /// `"client-address"`: the scope `addr:<hex SHA-256 of the peer's IP
    /// address>`, from the TCP connection only (forwarded headers such as
    /// `X-Forwarded-For` are ignored: any client can write them). Only as
    /// good as the address: behind a load balancer or a NAT every client
    /// has the same one and they share a key space again.
    ClientAddress,
}

/// Why no scope could be derived from the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeError {
    /// The header (named, lowercase) occurs more than once.
    Repeated(String),
    /// The scope header (named) is not UTF-8 or contains a control
    /// character.
    NotText(String),
    /// The request names no client, and the anonymous mode is
    /// [`AnonymousMode::Reject`].
    Unidentified,
    /// The anonymous mode is [`AnonymousMode::ClientAddress`], but the
    /// connection's address is not known.
    NoClientAddress,
}

impl fmt::Display for ScopeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScopeError::Repeated(name) => write!(f, "the {name} header occurs more than once"),
            ScopeError::NotText(name) => write!(f, "the {name} header must be printable text"),
            ScopeError::Unidentified => f.write_str("the request does not identify its client"),
            ScopeError::NoClientAddress => f.write_str("the client's address is not known"),
        }
    }
}

impl core::error::Error for ScopeError {}

/// The address of a request's client, the TCP peer, for
/// [`AnonymousMode::ClientAddress`].
pub trait PeerAddress {
    /// The address as its scope hashes it: IPv4-mapped IPv6 addresses as
    /// the IPv4 one, in the standard text form.
    fn canonical_text(&self) -> String;
}

impl PeerAddress for IpAddr {
    fn canonical_text(&self) -> String {
        self.to_canonical().to_string()
    }
}

/// The peer address of a caller that can never know one (a `wasi:http`
/// 0.2 component is given none): with it, [`derive_scope`] carries no
/// address formatting code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoPeerAddress {}

impl PeerAddress for NoPeerAddress {
    fn canonical_text(&self) -> String {
        match *self {}
    }
}

/// A configured scope header and the values the request carries for it.
#[derive(Debug, Clone, Copy)]
pub struct ScopeHeader<'a> {
    /// The header's name, lowercase; errors name it.
    pub name: &'a str,
    /// Its values in the request, in order (none when it is absent).
    pub values: &'a [&'a [u8]],
}

/// The scope of the request's keys.
///
/// - `hdr:<value>` when a scope header is configured and present;
/// - else `auth:<hex SHA-256 of the Authorization value>`;
/// - else, for a request that names no client, as `anonymous` says:
///   [`AnonymousMode::Reject`] refuses it ([`ScopeError::Unidentified`]),
///   [`AnonymousMode::Shared`] gives every such request the one scope
///   `anonymous`, and [`AnonymousMode::ClientAddress`] gives
///   `addr:<hex SHA-256 of the client's IP address>` (`client`, the TCP
///   peer, as [`PeerAddress::canonical_text`] spells it: an IPv4-mapped
///   IPv6 address counts as the IPv4 one).
///
/// `authorization` holds the request's `Authorization` values, in order.
/// The prefixes keep the forms apart: no header value can produce the scope
/// of a credential or of an address. Forwarded headers (`Forwarded`,
/// `X-Forwarded-For`) are never read: a client can write any value there.
///
/// # Errors
///
/// [`ScopeError`] when the header used occurs more than once, the scope
/// header is not text, the request names no client under `reject`, or the
/// address is needed and `client` is `None`.
pub fn derive_scope<P: PeerAddress>(
    scope_header: Option<ScopeHeader<'_>>,
    authorization: &[&[u8]],
    anonymous: AnonymousMode,
    client: Option<P>,
) -> Result<String, ScopeError> {
    if let Some(header) = scope_header
        && let Some(value) = single(header.name, header.values)?
    {
        let text = core::str::from_utf8(value)
            .ok()
            .filter(|t| !t.chars().any(char::is_control))
            .ok_or_else(|| ScopeError::NotText(header.name.to_owned()))?;
        return Ok(format!("hdr:{text}"));
    }
    if let Some(value) = single("authorization", authorization)? {
        return Ok(format!("auth:{}", hex(&Sha256::digest(value))));
    }
    match anonymous {
        AnonymousMode::Reject => Err(ScopeError::Unidentified),
        AnonymousMode::Shared => Ok("anonymous".to_owned()),
        AnonymousMode::ClientAddress => {
            let ip = client.ok_or(ScopeError::NoClientAddress)?.canonical_text();
            Ok(format!("addr:{}", hex(&Sha256::digest(ip.as_bytes()))))
        }
    }
}

/// The one value of a header, if any.
fn single<'a>(name: &str, values: &[&'a [u8]]) -> Result<Option<&'a [u8]>, ScopeError> {
    match values {
        [] => Ok(None),
        [value] => Ok(Some(value)),
        _ => Err(ScopeError::Repeated(name.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODES: [AnonymousMode; 3] = [
        AnonymousMode::Reject,
        AnonymousMode::Shared,
        AnonymousMode::ClientAddress,
    ];

    fn ip(text: &str) -> Option<IpAddr> {
        Some(text.parse().unwrap())
    }

    const TENANT: &str = "x-tenant-id";

    fn tenant<'a>(values: &'a [&'a [u8]]) -> Option<ScopeHeader<'a>> {
        Some(ScopeHeader {
            name: TENANT,
            values,
        })
    }

    /// The scope under `shared` with no known address: the forms that do
    /// not depend on the anonymous mode.
    fn scope(header: Option<ScopeHeader<'_>>, auth: &[&[u8]]) -> Result<String, ScopeError> {
        derive_scope(header, auth, AnonymousMode::Shared, NONE)
    }

    /// No known address.
    const NONE: Option<IpAddr> = None;

    #[test]
    fn scope_from_authorization_is_a_hash() {
        let s = scope(None, &[b"Bearer abc"]).unwrap();
        assert_eq!(s, format!("auth:{}", hex(&Sha256::digest(b"Bearer abc"))));
        assert_eq!(s.len(), 5 + 64);
        assert!(!s.contains("Bearer"));
        assert_ne!(s, scope(None, &[b"Bearer abd"]).unwrap());
        // An identified client's scope never depends on the anonymous mode
        // or its address.
        for mode in MODES {
            let auth: &[&[u8]] = &[b"Bearer abc"];
            assert_eq!(derive_scope(None, auth, mode, ip("192.0.2.1")).unwrap(), s);
            assert_eq!(derive_scope(None, auth, mode, NONE).unwrap(), s);
        }
    }

    #[test]
    fn the_hash_is_sha_256() {
        // A known vector: SHA-256("abc").
        assert_eq!(
            scope(None, &[b"abc"]).unwrap(),
            "auth:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn scope_from_a_configured_header() {
        let auth: &[&[u8]] = &[b"Bearer abc"];
        assert_eq!(scope(tenant(&[b"t-1"]), auth).unwrap(), "hdr:t-1");
        for mode in MODES {
            assert_eq!(
                derive_scope(tenant(&[b"t-1"]), auth, mode, NONE).unwrap(),
                "hdr:t-1"
            );
            assert_eq!(
                derive_scope(tenant(&[b"t-1"]), &[], mode, NONE).unwrap(),
                "hdr:t-1"
            );
        }
        // Not configured: the header is ignored.
        assert!(scope(None, auth).unwrap().starts_with("auth:"));
        assert_eq!(
            derive_scope(None, &[], AnonymousMode::Reject, NONE),
            Err(ScopeError::Unidentified)
        );
        // Configured but absent: Authorization, then the anonymous mode.
        assert!(scope(tenant(&[]), auth).unwrap().starts_with("auth:"));
        assert_eq!(scope(tenant(&[]), &[]).unwrap(), "anonymous");
        assert_eq!(
            derive_scope(tenant(&[]), &[], AnonymousMode::Reject, NONE),
            Err(ScopeError::Unidentified)
        );
    }

    #[test]
    fn unidentified_requests_are_refused_under_reject() {
        for client in [None, ip("192.0.2.1")] {
            assert_eq!(
                derive_scope(None, &[], AnonymousMode::Reject, client),
                Err(ScopeError::Unidentified)
            );
        }
        // The default mode is reject.
        assert_eq!(AnonymousMode::default(), AnonymousMode::Reject);
    }

    #[test]
    fn unidentified_requests_share_one_scope_under_shared() {
        for client in [None, ip("192.0.2.1"), ip("192.0.2.2")] {
            assert_eq!(
                derive_scope(None, &[], AnonymousMode::Shared, client).unwrap(),
                "anonymous"
            );
        }
    }

    #[test]
    fn unidentified_requests_are_scoped_by_address_under_client_address() {
        let mode = AnonymousMode::ClientAddress;
        let a = derive_scope(None, &[], mode, ip("192.0.2.1")).unwrap();
        assert_eq!(a, format!("addr:{}", hex(&Sha256::digest(b"192.0.2.1"))));
        assert_eq!(a.len(), 5 + 64);
        assert!(!a.contains("192.0.2.1"));
        // Another address, another scope; the same address, the same one.
        let b = derive_scope(None, &[], mode, ip("192.0.2.2")).unwrap();
        assert_ne!(a, b);
        assert_eq!(derive_scope(None, &[], mode, ip("192.0.2.1")).unwrap(), a);
        // An IPv4-mapped IPv6 peer (a dual-stack listener) is the IPv4 one.
        assert_eq!(
            derive_scope(None, &[], mode, ip("::ffff:192.0.2.1")).unwrap(),
            a
        );
        let v6 = derive_scope(None, &[], mode, ip("2001:db8::1")).unwrap();
        assert_eq!(v6, format!("addr:{}", hex(&Sha256::digest(b"2001:db8::1"))));
        // Without an address the request is refused, never shared.
        assert_eq!(
            derive_scope(None, &[], mode, NONE),
            Err(ScopeError::NoClientAddress)
        );
        assert_eq!(
            derive_scope(None, &[], mode, None::<NoPeerAddress>),
            Err(ScopeError::NoClientAddress)
        );
        // Callers without addresses get the same scopes otherwise.
        let none = None::<NoPeerAddress>;
        assert_eq!(
            derive_scope(None, &[b"Bearer abc"], mode, none),
            derive_scope(None, &[b"Bearer abc"], mode, ip("192.0.2.1"))
        );
        assert_eq!(
            derive_scope(None, &[], AnonymousMode::Reject, none),
            Err(ScopeError::Unidentified)
        );
    }

    #[test]
    fn the_forms_never_collide() {
        let auth = scope(tenant(&[]), &[b"x"]).unwrap();
        // A tenant header spelling out the credential's scope still differs.
        let forged = scope(tenant(&[auth.as_bytes()]), &[]).unwrap();
        assert_ne!(auth, forged);
        assert!(forged.starts_with("hdr:auth:"));
        let anon = scope(tenant(&[b"anonymous"]), &[]).unwrap();
        assert_ne!(anon, "anonymous");
        let addr = derive_scope(
            tenant(&[]),
            &[],
            AnonymousMode::ClientAddress,
            ip("192.0.2.1"),
        )
        .unwrap();
        let forged = scope(tenant(&[addr.as_bytes()]), &[]).unwrap();
        assert_ne!(addr, forged);
        assert!(forged.starts_with("hdr:addr:"));
        // An Authorization value spelling an address hashes alike; the
        // prefixes keep the two apart.
        let cred = scope(None, &[b"192.0.2.1"]).unwrap();
        assert_eq!(cred[5..], addr[5..]);
        assert_ne!(cred, addr);
    }

    #[test]
    fn repeated_or_binary_scope_headers_are_refused() {
        assert_eq!(
            scope(tenant(&[b"a", b"b"]), &[b"Bearer abc"]),
            Err(ScopeError::Repeated(TENANT.to_owned()))
        );
        for mode in MODES {
            assert_eq!(
                derive_scope(None, &[b"a", b"b"], mode, ip("192.0.2.1")),
                Err(ScopeError::Repeated("authorization".to_owned()))
            );
        }
        assert_eq!(
            scope(tenant(&[b"t\xff"]), &[]),
            Err(ScopeError::NotText(TENANT.to_owned()))
        );
        assert_eq!(
            scope(tenant(&[b"t\tu"]), &[]),
            Err(ScopeError::NotText(TENANT.to_owned()))
        );
        // Non-ASCII text is text.
        assert_eq!(scope(tenant(&["té".as_bytes()]), &[]).unwrap(), "hdr:té");
    }

    #[test]
    fn errors_say_which_header() {
        assert_eq!(
            ScopeError::Repeated("authorization".to_owned()).to_string(),
            "the authorization header occurs more than once"
        );
        assert_eq!(
            ScopeError::NotText(TENANT.to_owned()).to_string(),
            "the x-tenant-id header must be printable text"
        );
    }

    #[test]
    fn anonymous_modes_are_read_from_their_config_names() {
        #[derive(Deserialize)]
        struct Wrap {
            anonymous: AnonymousMode,
        }
        for (text, mode) in [
            ("reject", AnonymousMode::Reject),
            ("shared", AnonymousMode::Shared),
            ("client-address", AnonymousMode::ClientAddress),
        ] {
            let json = format!("{{\"anonymous\":\"{text}\"}}");
            let w: Wrap = serde_json::from_str(&json).unwrap();
            assert_eq!(w.anonymous, mode);
        }
        assert!(serde_json::from_str::<Wrap>("{\"anonymous\":\"Shared\"}").is_err());
    }
}
