//! What a response status means for the key, and what fits in the store.

use serde::Deserialize;

/// The largest response body the engine stores (its
/// `MAX_RESPONSE_BODY_BYTES`). A larger body is sent to the caller and not
/// stored.
pub const MAX_STORED_BODY_BYTES: usize = 16 * 1024 * 1024;

/// The most headers the engine stores with a response (its
/// `MAX_RESPONSE_HEADERS`).
pub const MAX_STORED_HEADERS: usize = 128;

/// True when the engine can store a response with this many headers and
/// this body length.
pub fn storable(headers: usize, body_len: usize) -> bool {
    headers <= MAX_STORED_HEADERS && body_len <= MAX_STORED_BODY_BYTES
}

/// What a 5xx answer means for the key (the proxy's `server_errors`; the
/// middleware always retries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServerErrors {
    /// `"retry"`: a retryable failure, not stored: the next retry executes
    /// again. The default.
    #[default]
    Retry,
    /// `"store"`: a final failure, stored and replayed to every duplicate.
    Store,
}

/// What a response means for the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A success: the key is completed with the response, which is stored
    /// and replayed.
    Complete,
    /// A failure for good (disposition `final`): stored and replayed to
    /// every duplicate.
    Final,
    /// A failure the same request may retry (disposition `retryable`): the
    /// response is never stored and the next retry executes again.
    Retryable,
}

impl Verdict {
    /// True when the response is stored with the outcome (if it fits).
    pub fn stores_response(self) -> bool {
        !matches!(self, Verdict::Retryable)
    }
}

/// Maps a response status to what it means for the key.
///
/// - 1xx to 3xx: success;
/// - 408, 409, 425, 429: retryable (the request may be repeated as is);
/// - other 4xx: final (stored and replayed);
/// - 5xx (and anything else): retryable, or final with
///   [`ServerErrors::Store`].
pub fn classify_status(status: u16, server_errors: ServerErrors) -> Verdict {
    match status {
        100..=399 => Verdict::Complete,
        408 | 409 | 425 | 429 => Verdict::Retryable,
        400..=499 => Verdict::Final,
        _ => match server_errors {
            ServerErrors::Retry => Verdict::Retryable,
            ServerErrors::Store => Verdict::Final,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICIES: [ServerErrors; 2] = [ServerErrors::Retry, ServerErrors::Store];

    #[test]
    fn successes_complete() {
        for code in [100, 200, 201, 204, 299, 301, 302, 304, 399] {
            for p in POLICIES {
                assert_eq!(classify_status(code, p), Verdict::Complete, "{code}");
            }
        }
        assert!(Verdict::Complete.stores_response());
    }

    #[test]
    fn retryable_client_errors_are_never_stored() {
        for code in [408, 409, 425, 429] {
            for p in POLICIES {
                assert_eq!(classify_status(code, p), Verdict::Retryable, "{code}");
            }
        }
        assert!(!Verdict::Retryable.stores_response());
    }

    #[test]
    fn other_client_errors_are_final() {
        for code in [400, 401, 403, 404, 405, 410, 413, 415, 422, 451, 499] {
            for p in POLICIES {
                assert_eq!(classify_status(code, p), Verdict::Final, "{code}");
            }
        }
        assert!(Verdict::Final.stores_response());
    }

    #[test]
    fn server_errors_follow_the_policy() {
        for code in [500, 502, 503, 504, 599, 600, 999, 0, 99] {
            assert_eq!(
                classify_status(code, ServerErrors::Retry),
                Verdict::Retryable,
                "{code}"
            );
            assert_eq!(
                classify_status(code, ServerErrors::Store),
                Verdict::Final,
                "{code}"
            );
        }
        assert_eq!(ServerErrors::default(), ServerErrors::Retry);
    }

    #[test]
    fn storable_follows_the_engine_limits() {
        assert!(storable(MAX_STORED_HEADERS, MAX_STORED_BODY_BYTES));
        assert!(storable(0, 0));
        assert!(!storable(MAX_STORED_HEADERS + 1, 0));
        assert!(!storable(0, MAX_STORED_BODY_BYTES + 1));
    }
}
