//! Which methods the rules apply to.
//!
//! Methods are compared as sent (case-sensitively, as RFC 9110 says):
//! `get` is not `GET`.

use serde::Deserialize;

/// True for the safe methods, which store nothing and are always passed
/// through: GET, HEAD, OPTIONS, TRACE and CONNECT. Every other method is
/// keyed: deduplicated when it carries an `Idempotency-Key`.
pub fn is_safe_method(method: &str) -> bool {
    matches!(method, "GET" | "HEAD" | "OPTIONS" | "TRACE" | "CONNECT")
}

/// True for the methods that need a key unless configured otherwise: POST
/// and PATCH. Other unsafe methods (PUT, DELETE) are idempotent by
/// definition and pass through without one.
pub fn needs_key_by_default(method: &str) -> bool {
    matches!(method, "POST" | "PATCH")
}

/// Whether a request must carry an `Idempotency-Key` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeyRequirement {
    /// A request without a key is refused with 400 (`key-missing`).
    Required,
    /// A request without a key is forwarded as it is and nothing is stored.
    Optional,
}

/// Whether a keyed request with `method` must carry a key: `every_method`
/// when set (a route's own setting); else `post_patch` for POST and PATCH
/// ([`KeyRequirement::Required`] unless configured otherwise); else
/// optional.
pub fn key_requirement(
    method: &str,
    every_method: Option<KeyRequirement>,
    post_patch: KeyRequirement,
) -> KeyRequirement {
    match every_method {
        Some(k) => k,
        None if needs_key_by_default(method) => post_patch,
        None => KeyRequirement::Optional,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use KeyRequirement::{Optional, Required};

    #[test]
    fn safe_methods_are_passed_through() {
        for m in ["GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"] {
            assert!(is_safe_method(m), "{m}");
        }
        for m in ["POST", "PATCH", "PUT", "DELETE", "PURGE", "get", ""] {
            assert!(!is_safe_method(m), "{m}");
        }
    }

    #[test]
    fn post_and_patch_need_a_key_by_default() {
        assert!(needs_key_by_default("POST") && needs_key_by_default("PATCH"));
        for m in ["PUT", "DELETE", "GET", "post", "PURGE"] {
            assert!(!needs_key_by_default(m), "{m}");
        }
        assert_eq!(key_requirement("POST", None, Required), Required);
        assert_eq!(key_requirement("PATCH", None, Required), Required);
        assert_eq!(key_requirement("PUT", None, Required), Optional);
        assert_eq!(key_requirement("DELETE", None, Required), Optional);
    }

    #[test]
    fn configured_requirements_win() {
        assert_eq!(key_requirement("POST", None, Optional), Optional);
        assert_eq!(key_requirement("PUT", None, Optional), Optional);
        assert_eq!(key_requirement("PUT", Some(Required), Optional), Required);
        assert_eq!(key_requirement("POST", Some(Optional), Required), Optional);
    }
}
