//! Properties of the header parser on arbitrary bytes, shared by the
//! cargo-fuzz target (`fuzz/fuzz_targets/key_header.rs`, built with
//! `--cfg fuzzing`) and the proptests. Each function panics when a
//! property breaks.

use alloc::format;
use alloc::string::String;

use crate::key::{KeyHeaderError, parse_idempotency_key};

/// `key` as an sf-string: quoted, with `\` and `"` escaped. Only
/// meaningful for printable ASCII.
fn quote(key: &str) -> String {
    format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The parser's properties on `bytes`:
///
/// - it never panics, and refuses exactly the non-UTF-8 values as not
///   UTF-8;
/// - a value with a control character is refused as such, and no key it
///   gives contains one;
/// - a bare value is returned as it is, trimmed of spaces and tabs;
/// - any printable ASCII value, quoted as an sf-string, gives itself back;
///   as a bare value, it gives itself back trimmed.
pub fn check_key_header(bytes: &[u8]) {
    let parsed = parse_idempotency_key(bytes);
    let text = match (core::str::from_utf8(bytes), &parsed) {
        (Err(_), Err(KeyHeaderError::NotUtf8)) => return,
        (Err(_), _) => panic!("non-UTF-8 bytes gave {parsed:?}"),
        (Ok(_), Err(KeyHeaderError::NotUtf8)) => panic!("UTF-8 text refused as not UTF-8"),
        (Ok(text), _) => text,
    };
    let trimmed = text.trim_matches([' ', '\t']);
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
    if !trimmed.starts_with('"') {
        assert_eq!(parsed.as_deref(), Ok(trimmed), "a bare value was refused");
    }
    // The same key as a Structured Field string means the same key.
    if text.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        let quoted = quote(text);
        assert_eq!(
            parse_idempotency_key(quoted.as_bytes()).as_deref(),
            Ok(text),
            "{quoted}"
        );
    }
}
