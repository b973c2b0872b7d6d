//! The body kind for the fingerprint.

/// How the engine fingerprints a request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// A JSON text, canonicalised before hashing.
    Json,
    /// Bytes, hashed as they are.
    Raw,
}

/// The body kind of a request with this `Content-Type` value (its first
/// one, when it has several): JSON for `application/json` and `*/*+json`
/// (case-insensitive, parameters ignored), raw otherwise, and raw without a
/// `Content-Type` or with one that is not visible ASCII.
pub fn body_kind(content_type: Option<&[u8]>) -> BodyKind {
    let Some(value) = content_type
        .filter(|v| v.iter().all(|&b| b == b'\t' || (0x20..0x7f).contains(&b)))
        .and_then(|v| core::str::from_utf8(v).ok())
    else {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(ct: &str) -> BodyKind {
        body_kind(Some(ct.as_bytes()))
    }

    #[test]
    fn json_content_types_are_fingerprinted_as_json() {
        assert_eq!(kind("application/json"), BodyKind::Json);
        assert_eq!(kind("Application/JSON; charset=utf-8"), BodyKind::Json);
        assert_eq!(kind(" application/json ;q=1"), BodyKind::Json);
        assert_eq!(kind("application/merge-patch+json"), BodyKind::Json);
        assert_eq!(kind("application/problem+json"), BodyKind::Json);
        assert_eq!(kind("text/x+JSON"), BodyKind::Json);
    }

    #[test]
    fn other_content_types_are_raw() {
        assert_eq!(kind("text/plain"), BodyKind::Raw);
        assert_eq!(kind("application/jsonx"), BodyKind::Raw);
        assert_eq!(kind("application/+json"), BodyKind::Raw);
        assert_eq!(kind("/x+json"), BodyKind::Raw);
        assert_eq!(kind("+json"), BodyKind::Raw);
        assert_eq!(kind(""), BodyKind::Raw);
        assert_eq!(body_kind(None), BodyKind::Raw);
    }

    #[test]
    fn content_types_that_are_not_visible_ascii_are_raw() {
        assert_eq!(body_kind(Some(b"\xff")), BodyKind::Raw);
        // UTF-8, but not a header value HTTP libraries read as text.
        assert_eq!(kind("é/x+json"), BodyKind::Raw);
        assert_eq!(kind("application/json\u{1}"), BodyKind::Raw);
        assert_eq!(kind("application/json;\tcharset=utf-8"), BodyKind::Json);
    }
}
