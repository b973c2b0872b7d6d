//! The request fingerprint, version 1.
//!
//! A fingerprint tells whether two requests that carry the same key are the
//! same request. It is the lowercase hex SHA-256 (64 characters) of the
//! canonical form below. Stored records keep the fingerprint together with
//! [`FINGERPRINT_VERSION`]; the form is a published contract and never
//! changes within a version.
//!
//! # Canonical form, version 1
//!
//! The bytes hashed are, in order (all integers unsigned big-endian):
//!
//! 1. the 9 ASCII bytes `idem-fp/1`, then one byte `0x00`;
//! 2. the number of attributes, as a `u32`;
//! 3. for each attribute, in the order given: the length in bytes of its
//!    name as a `u32`, the name's UTF-8 bytes, the length in bytes of its
//!    value as a `u32`, the value's UTF-8 bytes;
//! 4. one byte giving the body kind: `J` (0x4a) for `json`, `R` (0x52) for
//!    `raw`;
//! 5. the length in bytes of the body form as a `u64`, then the body form:
//!    - `raw`: the body bytes exactly as given;
//!    - `json` with no fingerprint fields: the RFC 8785 canonical form of
//!      the body ([`crate::canonical::canonicalize`]);
//!    - `json` with fingerprint fields: the RFC 8785 canonical form of the
//!      JSON object whose member names are the fields (RFC 6901 JSON
//!      Pointers) and whose values are what each selects in the body; a
//!      field that selects nothing is left out, and a field listed twice
//!      appears once ([`crate::canonical::select`]).
//!
//! Attribute order matters: callers pass attributes in a fixed order.
//! Fingerprint fields apply to `json` bodies only.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use sha2::{Digest, Sha256};

use crate::bindings::exports::idem::engine::engine::{
    BodyKind, InputField, InputRule, InvalidInput,
};
use crate::canonical;

/// The version of the canonical form that [`fingerprint`] hashes; stored
/// with every fingerprint.
pub const FINGERPRINT_VERSION: u32 = 1;

/// The bytes that open the canonical form of version 1.
const DOMAIN: &[u8] = b"idem-fp/1\x00";

/// Computes the version-1 fingerprint of a request: 64 lowercase hex digits.
///
/// # Errors
///
/// - `body`/`not-json` when `kind` is `json` and `body` is not a valid JSON
///   text (or has duplicate object names);
/// - `policy`/`bad-format` when `fields` is non-empty and `kind` is `raw`,
///   or a field is not a JSON Pointer;
/// - `attributes`/`too-long` when a count or length does not fit its
///   length prefix (never for input that passed validation).
pub fn fingerprint(
    attributes: &[(String, String)],
    kind: BodyKind,
    body: &[u8],
    fields: &[String],
) -> Result<String, InvalidInput> {
    let body_form: Vec<u8>;
    let (kind_byte, form): (u8, &[u8]) = match kind {
        BodyKind::Raw => {
            if !fields.is_empty() {
                return Err(InvalidInput {
                    field: InputField::Policy,
                    rule: InputRule::BadFormat,
                    message: String::from(
                        "policy.fingerprint-fields has a bad format: fields need a json body, \
                         and the body kind is raw",
                    ),
                });
            }
            (b'R', body)
        }
        BodyKind::Json => {
            let result = if fields.is_empty() {
                canonical::canonicalize(body)
            } else {
                canonical::select(body, fields)
            };
            body_form = result.map_err(|err| match err {
                canonical::CanonError::InvalidPointer { .. } => InvalidInput {
                    field: InputField::Policy,
                    rule: InputRule::BadFormat,
                    message: format!("policy.fingerprint-fields has a bad format: {err}"),
                },
                _ => InvalidInput {
                    field: InputField::Body,
                    rule: InputRule::NotJson,
                    message: format!("body is not JSON (not-json): {err}"),
                },
            })?;
            (b'J', &body_form)
        }
    };

    let mut hasher = Sha256::new();
    hasher.update(DOMAIN);
    hasher.update(len_u32(attributes.len(), "the attribute count")?);
    for (name, value) in attributes {
        hasher.update(len_u32(name.len(), "an attribute name")?);
        hasher.update(name.as_bytes());
        hasher.update(len_u32(value.len(), "an attribute value")?);
        hasher.update(value.as_bytes());
    }
    hasher.update([kind_byte]);
    let form_len = u64::try_from(form.len()).map_err(|_| InvalidInput {
        field: InputField::Body,
        rule: InputRule::TooLong,
        message: String::from("body is too long: its length does not fit 64 bits"),
    })?;
    hasher.update(form_len.to_be_bytes());
    hasher.update(form);
    Ok(to_hex(&hasher.finalize()))
}

/// Encodes a length as the 4 big-endian bytes of a `u32`.
fn len_u32(len: usize, what: &str) -> Result<[u8; 4], InvalidInput> {
    u32::try_from(len)
        .map(u32::to_be_bytes)
        .map_err(|_| InvalidInput {
            field: InputField::Attributes,
            rule: InputRule::TooLong,
            message: format!("attributes are too long: {what} does not fit 32 bits"),
        })
}

/// Lowercase hex of `bytes`.
fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    fn attrs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    fn fields(ps: &[&str]) -> Vec<String> {
        ps.iter().map(|p| p.to_string()).collect()
    }

    fn fp(a: &[(&str, &str)], kind: BodyKind, body: &str, f: &[&str]) -> String {
        match fingerprint(&attrs(a), kind, body.as_bytes(), &fields(f)) {
            Ok(d) => d,
            Err(e) => panic!("fingerprint failed: {}", e.message),
        }
    }

    #[test]
    fn version_is_one() {
        assert_eq!(FINGERPRINT_VERSION, 1);
    }

    #[test]
    fn hex_encoding() {
        assert_eq!(to_hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(to_hex(&[]), "");
    }

    #[test]
    fn empty_raw_body_no_attributes() {
        let d = fp(&[], BodyKind::Raw, "", &[]);
        assert_eq!(
            d,
            "bb92ae5cda92ea290a11c23f7883652c27138db671db41499e57b33c15b46573"
        );
        assert_eq!(d.len(), 64);
        assert!(d.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    }

    #[test]
    fn json_key_order_whitespace_and_number_spelling_do_not_matter() {
        let a = fp(&[], BodyKind::Json, r#"{"b":2,"a":1}"#, &[]);
        let b = fp(&[], BodyKind::Json, r#" { "a" : 1 , "b" : 2.0 } "#, &[]);
        assert_eq!(
            a,
            "5e24360572dce84ce2edcfad44b6a830ddd54ec670473a7c3b507e274fe0722f"
        );
        assert_eq!(a, b);
        // The same bytes hashed as raw give another fingerprint.
        assert_ne!(a, fp(&[], BodyKind::Raw, r#"{"a":1,"b":2}"#, &[]));
    }

    #[test]
    fn attributes_are_hashed() {
        let d = fp(
            &[("method", "POST"), ("path", "/v1/orders")],
            BodyKind::Json,
            r#"{"a":1,"b":2}"#,
            &[],
        );
        assert_eq!(
            d,
            "a5fe5d1b0c8c4df126355f8e6cbc24342fd2069104ac75225c79c525cfa910e1"
        );
    }

    #[test]
    fn attribute_order_matters() {
        let ab = fp(&[("a", "1"), ("b", "2")], BodyKind::Raw, "x", &[]);
        let ba = fp(&[("b", "2"), ("a", "1")], BodyKind::Raw, "x", &[]);
        assert_eq!(
            ab,
            "b5e408bf11ff94441d1d58bc80b0a7858cf7fcf9214b8838773eba1fff16533a"
        );
        assert_eq!(
            ba,
            "1979259d441c9b2695f9624d88ed727a2d8652aa14612c2a925425f9080c0eeb"
        );
        assert_ne!(ab, ba);
    }

    #[test]
    fn length_prefixes_prevent_ambiguity() {
        // Moving bytes between name and value, or between attributes, changes
        // the fingerprint.
        let one = fp(&[("ab", "c")], BodyKind::Raw, "", &[]);
        let two = fp(&[("a", "bc")], BodyKind::Raw, "", &[]);
        let three = fp(&[("a", ""), ("", "bc")], BodyKind::Raw, "", &[]);
        assert_ne!(one, two);
        assert_ne!(two, three);
        assert_ne!(one, three);
    }

    #[test]
    fn field_selection_ignores_volatile_fields() {
        let f = ["/amount", "/currency"];
        let first = fp(
            &[],
            BodyKind::Json,
            r#"{"amount":100,"currency":"EUR","ts":"2024-01-01T00:00:00Z"}"#,
            &f,
        );
        let second = fp(
            &[],
            BodyKind::Json,
            r#"{"ts":"2024-06-30T12:34:56Z","currency":"EUR","amount":1e2}"#,
            &f,
        );
        assert_eq!(
            first,
            "6a27bffc1f7eb24aacce501a97ec33b419bc9cb0c8fa22daab3aee2f5b4115c9"
        );
        assert_eq!(first, second);
        let changed = fp(
            &[],
            BodyKind::Json,
            r#"{"amount":101,"currency":"EUR","ts":"2024-01-01T00:00:00Z"}"#,
            &f,
        );
        assert_ne!(first, changed);
    }

    #[test]
    fn missing_field_differs_from_null() {
        let f = ["/a", "/b"];
        let missing = fp(&[], BodyKind::Json, r#"{"a":1}"#, &f);
        let null = fp(&[], BodyKind::Json, r#"{"a":1,"b":null}"#, &f);
        assert_eq!(
            missing,
            "ee218d25943682a045680dc5b81e400ba03e521e0aa4dd410e59d4a37d6e11ab"
        );
        assert_eq!(
            null,
            "6e3c191eea1d6bd731d8ccdc65a7be213c34e79d336378a43184b52416c125ac"
        );
        assert_ne!(missing, null);
    }

    #[test]
    fn invalid_json_is_not_json() {
        for body in [&b"{"[..], b"{\"a\":1,\"a\":2}", b"\xff", b""] {
            let err = fingerprint(&[], BodyKind::Json, body, &[]).expect_err("invalid");
            assert_eq!(err.field, InputField::Body);
            assert_eq!(err.rule, InputRule::NotJson);
            assert!(
                err.message.starts_with("body is not JSON"),
                "{}",
                err.message
            );
        }
        let err = fingerprint(&[], BodyKind::Json, br#"{"secret":tru}"#, &fields(&["/a"]))
            .expect_err("invalid");
        assert_eq!(err.rule, InputRule::NotJson);
        assert!(
            err.message.contains("invalid JSON at line 1"),
            "{}",
            err.message
        );
        assert!(!err.message.contains("secret"), "{}", err.message);
    }

    #[test]
    fn raw_with_fields_is_a_policy_error() {
        let err = fingerprint(&[], BodyKind::Raw, b"x", &fields(&["/a"])).expect_err("invalid");
        assert_eq!(err.field, InputField::Policy);
        assert_eq!(err.rule, InputRule::BadFormat);
        assert!(err.message.contains("fingerprint-fields"));
    }

    #[test]
    fn bad_pointer_is_a_policy_error() {
        let err = fingerprint(&[], BodyKind::Json, b"{}", &fields(&["a"])).expect_err("invalid");
        assert_eq!(err.field, InputField::Policy);
        assert_eq!(err.rule, InputRule::BadFormat);
    }

    #[test]
    fn raw_body_is_hashed_byte_for_byte() {
        let a = fingerprint(&[], BodyKind::Raw, b"{\"a\":1}", &[]).expect("ok");
        let b = fingerprint(&[], BodyKind::Raw, b"{\"a\": 1}", &[]).expect("ok");
        assert_ne!(a, b);
        // Raw bodies need not be UTF-8.
        let c = fingerprint(&[], BodyKind::Raw, &[0xff, 0x00], &[]).expect("ok");
        assert_eq!(c.len(), 64);
    }
}
