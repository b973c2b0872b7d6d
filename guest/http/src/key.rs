//! Reading the `Idempotency-Key` header.
//!
//! The key's own rules (length, characters) are the engine's: this module
//! only turns the header into a string. An empty key is passed on, and the
//! engine answers `invalid`.

use alloc::borrow::ToOwned;
use alloc::string::String;
use core::fmt;

/// The request header that carries the key (lowercase, as HTTP/2 and
/// `wasi:http` spell field names).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The header set to `true` on every answer served from the store.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

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

impl core::error::Error for KeyHeaderError {}

/// The key in an `Idempotency-Key` header value.
///
/// Accepts the IETF draft's form, a Structured Field string (`"abc"`, with
/// `\"` and `\\` escapes), and a bare value (`abc`, taken as it is after
/// trimming surrounding spaces and tabs); both mean the key `abc`. An
/// empty value gives an empty key, which the engine refuses.
///
/// # Errors
///
/// [`KeyHeaderError`] when the value is not UTF-8, contains a control
/// character, or starts with `"` without being exactly one sf-string (no
/// parameters, nothing after it).
pub fn parse_idempotency_key(value: &[u8]) -> Result<String, KeyHeaderError> {
    let text = core::str::from_utf8(value).map_err(|_| KeyHeaderError::NotUtf8)?;
    let text = text.trim_matches([' ', '\t']);
    if text.chars().any(char::is_control) {
        return Err(KeyHeaderError::ControlCharacter);
    }
    if !text.starts_with('"') {
        return Ok(text.to_owned());
    }
    parse_sf_string(text).ok_or(KeyHeaderError::InvalidString)
}

/// `text` as exactly one sf-string item without parameters (RFC 9651
/// section 4.2.5, the same in RFC 8941 section 4.2.5): a `"`, printable
/// ASCII (0x20 to 0x7e) in which `\` escapes only `"` and `\`, the closing
/// `"`, and nothing after it. `None` otherwise.
///
/// An item with parameters (`"a";p=1`) or a list (`"a", "b"`) is refused:
/// whatever follows the closing quote is either not a valid item or a
/// parameter, and a key has none.
fn parse_sf_string(text: &str) -> Option<String> {
    let mut chars = text.strip_prefix('"')?.chars();
    let mut key = String::new();
    loop {
        match chars.next()? {
            '"' => break,
            '\\' => match chars.next()? {
                c @ ('"' | '\\') => key.push(c),
                _ => return None,
            },
            c @ ' '..='~' => key.push(c),
            _ => return None,
        }
    }
    chars.next().is_none().then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::format;
    use alloc::vec::Vec;

    fn parse(bytes: &[u8]) -> Result<String, KeyHeaderError> {
        parse_idempotency_key(bytes)
    }

    #[test]
    fn quoted_and_bare_keys_are_the_same() {
        assert_eq!(parse(b"\"abc\"").unwrap(), "abc");
        assert_eq!(parse(b"abc").unwrap(), "abc");
        assert_eq!(parse(b"  abc  ").unwrap(), "abc");
        assert_eq!(parse(b"  abc\t").unwrap(), "abc");
        assert_eq!(parse(b" \"abc\" ").unwrap(), "abc");
        let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        assert_eq!(parse(format!("\"{uuid}\"").as_bytes()).unwrap(), uuid);
        assert_eq!(parse(uuid.as_bytes()).unwrap(), uuid);
    }

    #[test]
    fn escapes_in_sf_strings_are_decoded() {
        assert_eq!(parse(br#""a\"b""#).unwrap(), r#"a"b"#);
        assert_eq!(parse(br#""a\\b""#).unwrap(), r"a\b");
        assert_eq!(parse(br#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert_eq!(parse(br#""a b""#).unwrap(), "a b");
    }

    #[test]
    fn bad_sf_strings_are_refused() {
        for bad in [
            &br#""abc"#[..],
            br#""abc"x"#,
            br#""a\x""#,
            br#""abc";p=1"#,
            br#""abc";"#,
            br#""abc" ;p=1"#,
            br#""a","b""#,
            br#""a" "b""#,
            br#"""#,
            br#""\"#,
            "\"é\"".as_bytes(),
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
        assert_eq!(parse("é".as_bytes()).unwrap(), "é");
    }

    #[test]
    fn non_utf8_and_control_characters_are_refused() {
        assert_eq!(parse(b"ab\xffc"), Err(KeyHeaderError::NotUtf8));
        assert_eq!(parse(b"a\tb"), Err(KeyHeaderError::ControlCharacter));
        assert_eq!(parse(b"a\x01b"), Err(KeyHeaderError::ControlCharacter));
        assert_eq!(parse(b"a\x7fb"), Err(KeyHeaderError::ControlCharacter));
        assert_eq!(parse(b"\"a\tb\""), Err(KeyHeaderError::ControlCharacter));
        assert_eq!(
            parse("a\u{85}b".as_bytes()),
            Err(KeyHeaderError::ControlCharacter)
        );
    }

    #[test]
    fn empty_keys_go_to_the_engine() {
        assert_eq!(parse(b"").unwrap(), "");
        assert_eq!(parse(b"\"\"").unwrap(), "");
        assert_eq!(parse(b"   ").unwrap(), "");
    }

    #[test]
    fn errors_say_what_is_wrong() {
        assert_eq!(
            format!("{}", KeyHeaderError::NotUtf8),
            "the Idempotency-Key header is not valid UTF-8"
        );
        assert!(format!("{}", KeyHeaderError::InvalidString).contains("RFC 9651"));
    }

    /// What `sfv` (a complete RFC 9651 parser) makes of `text` as an item:
    /// the string when it is one sf-string without parameters.
    fn sfv_string(text: &str) -> Option<String> {
        let item: sfv::Item = sfv::Parser::new(text).parse_item().ok()?;
        if !item.params.is_empty() {
            return None;
        }
        item.bare_item.as_string().map(|s| s.as_str().to_owned())
    }

    /// A string that sfv serialises, as its serialisation.
    fn sfv_serialised(key: &str) -> Option<String> {
        let s = sfv::StringRef::from_str(key).ok()?;
        Some(sfv::ItemSerializer::new().bare_item(s).finish())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 4096,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Never panics, on any bytes; the properties of `props`.
        #[test]
        fn prop_any_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..48)) {
            crate::props::check_key_header(&bytes);
        }

        #[test]
        fn prop_key_like_text(text in r#"[ \t]{0,2}"?([a-zA-Z0-9\-_:%'; ,=]|\\"|\\\\|\\|"){0,24}"?[ \t]{0,2}"#) {
            crate::props::check_key_header(text.as_bytes());
        }

        /// Any printable ASCII key, serialised as an sf-string by sfv, is
        /// read back as itself.
        #[test]
        fn prop_serialised_sf_strings_round_trip(key in "[ -~]{0,40}") {
            let quoted = sfv_serialised(&key).expect("printable ASCII is an sf-string");
            proptest::prop_assert_eq!(parse(quoted.as_bytes()), Ok(key));
        }

        /// On values that start with `"`, the parser agrees with sfv: it
        /// accepts exactly the single sf-strings without parameters, with
        /// the same content.
        #[test]
        fn prop_quoted_values_agree_with_sfv(
            text in r#""([ -~]|\\"|\\\\|é|\t|\x7f){0,16}"?([;,= a-z0-9"]{0,6})"#,
        ) {
            let ours = parse(text.as_bytes()).ok();
            let trimmed = text.trim_matches([' ', '\t']);
            proptest::prop_assert_eq!(ours, sfv_string(trimmed), "{}", text);
        }
    }

    #[test]
    fn hand_picked_quoted_values_agree_with_sfv() {
        let cases: Vec<&str> = Vec::from([
            r#""abc""#,
            r#""abc"#,
            r#""a\"b""#,
            r#""a\\b""#,
            r#""a\b""#,
            r#""abc";p=1"#,
            r#""abc";p"#,
            r#""abc";"#,
            r#""abc","d""#,
            r#""abc" x"#,
            r#""""#,
            r#"""#,
            r#""\"#,
            r#"" ~!#$""#,
        ]);
        for text in cases {
            assert_eq!(parse(text.as_bytes()).ok(), sfv_string(text), "{text}");
        }
    }
}
