//! The request fingerprint, versions 1 and 2.
//!
//! A fingerprint tells whether two requests that carry the same key are the
//! same request. It is the lowercase hex SHA-256 (64 characters) of the
//! canonical form below. Stored records keep the fingerprint together with
//! its version; the form is a published contract and never changes within
//! a version. New records get [`FINGERPRINT_VERSION`]; a record of an older
//! version is compared with the fingerprint of that version
//! ([`fingerprint_of_version`]), so an upgrade never turns a live key's
//! retry into a mismatch.
//!
//! # Canonical form, version 2 (current)
//!
//! As version 1 below, with two differences:
//!
//! - the domain bytes are `idem-fp/2` and `0x00`;
//! - JSON numbers keep their exact value where a double would lose it
//!   ([`crate::canonical::Numbers::Exact`], defined in [`crate::number`]):
//!   a number is written as RFC 8785 writes it when that is its exact
//!   decimal value (`1`, `1.0` and `1e0` are `1`; `0.1` is `0.1`), and
//!   otherwise as `[-]DIGITS E EXPONENT`, its significant digits without
//!   leading or trailing zeros and the power of ten (`9007199254740993` is
//!   `9007199254740993E0`, `1e400` is `1E400`). Two numbers then agree
//!   exactly when they are the same decimal value: 64-bit ids, card and
//!   account numbers sent as JSON numbers never collide. Numbers beyond the
//!   double range are accepted; an exponent of more than 18 digits is not.
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
//!      the body ([`crate::canonical::canonicalize`]; every number read as
//!      a double, so integers beyond 2^53 round, and numbers beyond the
//!      double range are `not-json`);
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
use crate::canonical::{self, Numbers};

/// The version of the canonical form that [`fingerprint`] hashes; stored
/// with every new record.
pub const FINGERPRINT_VERSION: u32 = 2;

/// Each version this engine computes: its number, the bytes that open its
/// canonical form, and how it writes numbers.
const VERSIONS: [(u32, &[u8], Numbers); 2] = [
    (1, b"idem-fp/1\x00", Numbers::Double),
    (2, b"idem-fp/2\x00", Numbers::Exact),
];

/// Computes the current ([`FINGERPRINT_VERSION`]) fingerprint of a
/// request: 64 lowercase hex digits.
///
/// # Errors
///
/// As [`fingerprint_of_version`].
pub fn fingerprint(
    attributes: &[(String, String)],
    kind: BodyKind,
    body: &[u8],
    fields: &[String],
) -> Result<String, InvalidInput> {
    let (_, domain, numbers) = CURRENT;
    hash(domain, numbers, attributes, kind, body, fields)
}

/// The current version's entry of [`VERSIONS`].
const CURRENT: (u32, &[u8], Numbers) = VERSIONS[VERSIONS.len() - 1];
const _: () = assert!(CURRENT.0 == FINGERPRINT_VERSION);

/// Computes the fingerprint of a request with the canonical form of
/// `version`, or `None` when this engine does not know that version (a
/// record written by a newer engine).
///
/// # Errors
///
/// As below, inside the `Some`.
pub fn fingerprint_of_version(
    version: u32,
    attributes: &[(String, String)],
    kind: BodyKind,
    body: &[u8],
    fields: &[String],
) -> Option<Result<String, InvalidInput>> {
    let (_, domain, numbers) = VERSIONS.iter().find(|(v, _, _)| *v == version)?;
    Some(hash(domain, *numbers, attributes, kind, body, fields))
}

/// Hashes a request's canonical form, opened with `domain`.
///
/// # Errors
///
/// - `body`/`not-json` when `kind` is `json` and `body` is not a valid JSON
///   text (or has duplicate object names);
/// - `policy`/`bad-format` when `fields` is non-empty and `kind` is `raw`,
///   or a field is not a JSON Pointer;
/// - `attributes`/`too-long` when a count or length does not fit its
///   length prefix (never for input that passed validation).
fn hash(
    domain: &[u8],
    numbers: Numbers,
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
                canonical::canonicalize_as(body, numbers)
            } else {
                canonical::select_as(body, fields, numbers)
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
    hasher.update(domain);
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

    /// Version 1, whose digests below are pinned: records written by
    /// earlier engines keep matching.
    fn fp(a: &[(&str, &str)], kind: BodyKind, body: &str, f: &[&str]) -> String {
        match fingerprint_of_version(1, &attrs(a), kind, body.as_bytes(), &fields(f)) {
            Some(Ok(d)) => d,
            Some(Err(e)) => panic!("fingerprint failed: {}", e.message),
            None => panic!("version 1 is unknown"),
        }
    }

    /// The current version.
    fn fp2(a: &[(&str, &str)], body: &str) -> String {
        match fingerprint(&attrs(a), BodyKind::Json, body.as_bytes(), &[]) {
            Ok(d) => d,
            Err(e) => panic!("fingerprint failed: {}", e.message),
        }
    }

    #[test]
    fn version_is_two() {
        assert_eq!(FINGERPRINT_VERSION, 2);
    }

    #[test]
    fn version_two_digests_are_pinned() {
        // Computed independently: SHA-256 of "idem-fp/2\0", a u32 0, "J",
        // the u64 length and the canonical form.
        assert_eq!(
            fp2(&[], r#"{"b":2,"a":1}"#),
            "8c1c7ea25b460c0bb65f799baeed47aa70ba98012cbbfca9d29cd503401978b0"
        );
        assert_eq!(
            fp2(&[], "[9007199254740993]"),
            "d7ef08c2ff267e93cb5fa7d16a5b3570552ab9b6ed90f178ee49ecdc2937d369"
        );
    }

    #[test]
    fn version_two_tells_large_numbers_apart() {
        for (a, b) in [
            ("[9007199254740993]", "[9007199254740992]"),
            (
                r#"{"account":-9223372036854775808}"#,
                r#"{"account":-9223372036854775807}"#,
            ),
            ("[18446744073709551616]", "[18446744073709551615]"),
            ("[1e400]", "[1e401]"),
            ("[0.1]", "[0.10000000000000000001]"),
        ] {
            assert_ne!(fp2(&[], a), fp2(&[], b), "{a} vs {b}");
        }
        // Version 1 could not.
        assert_eq!(
            fp(&[], BodyKind::Json, "[9007199254740993]", &[]),
            fp(&[], BodyKind::Json, "[9007199254740992]", &[])
        );
        // Spellings of one value still agree.
        assert_eq!(fp2(&[], "[1.0]"), fp2(&[], "[1e0]"));
        assert_eq!(fp2(&[], "[1]"), fp2(&[], "[1.0]"));
        assert_eq!(
            fp2(&[], "[9007199254740993]"),
            fp2(&[], "[9.007199254740993e15]")
        );
    }

    #[test]
    fn versions_are_domain_separated_and_unknown_ones_are_none() {
        let body = br#"{"a":1}"#;
        let one = fingerprint_of_version(1, &[], BodyKind::Json, body, &[]);
        let two = fingerprint_of_version(2, &[], BodyKind::Json, body, &[]);
        assert_ne!(one, two);
        assert_eq!(
            two.clone().map(|r| r.ok()),
            Some(fingerprint(&[], BodyKind::Json, body, &[]).ok())
        );
        assert!(fingerprint_of_version(0, &[], BodyKind::Json, body, &[]).is_none());
        assert!(fingerprint_of_version(3, &[], BodyKind::Json, body, &[]).is_none());
        // A body version 1 refuses is fine for version 2.
        assert!(matches!(
            fingerprint_of_version(1, &[], BodyKind::Json, b"[1e400]", &[]),
            Some(Err(_))
        ));
        assert!(fingerprint(&[], BodyKind::Json, b"[1e400]", &[]).is_ok());
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
