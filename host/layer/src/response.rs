//! What an inner service's answer means for the key, and how a stored
//! answer is served again: the HTTP side of [`idem_http`]'s status and
//! header rules, on `http` types.

use axum::body::Body;
use axum::response::Response;
use http::StatusCode;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use idem_engine::api::Disposition;
use idem_engine::types::StoredResponse;

pub use idem_http::{MAX_STORED_BODY_BYTES, MAX_STORED_HEADERS, ServerErrors, Verdict};

/// The header added to every answer served from the store.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static(idem_http::IDEMPOTENT_REPLAYED);

/// `response`, saying that the connection closes after it: for an answer
/// given before the request's body was read to its end, after which the
/// connection cannot carry another request.
pub fn closing<B>(mut response: http::Response<B>) -> http::Response<B> {
    response
        .headers_mut()
        .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Why the upstream call did not produce a response.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    /// Nothing was sent (connection refused, no route, connect timeout):
    /// the action did not run.
    #[error("the upstream could not be reached: {0}")]
    NotSent(String),
    /// No complete answer within the timeout, after the request may have
    /// been sent: the action may have run.
    #[error("the upstream did not answer in time")]
    Timeout,
    /// The connection failed after the request may have been sent (reset,
    /// truncated answer): the action may have run.
    #[error("the upstream connection failed: {0}")]
    Failed(String),
}

/// What an upstream status means for the key, as
/// [`idem_http::classify_status`] says: 1xx to 3xx complete; 408, 409,
/// 425 and 429 are retryable; other 4xx final; 5xx retryable, or final
/// with `server_errors = "store"`.
pub fn classify_status(status: StatusCode, server_errors: ServerErrors) -> Verdict {
    idem_http::classify_status(status.as_u16(), server_errors)
}

/// The engine's disposition for a failure verdict; `None` for a success.
pub fn disposition(verdict: Verdict) -> Option<Disposition> {
    match verdict {
        Verdict::Complete => None,
        Verdict::Final => Some(Disposition::Final),
        Verdict::Retryable => Some(Disposition::Retryable),
    }
}

/// The response as the engine stores it: status, headers in order (names
/// lowercase), body.
pub fn to_stored(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> StoredResponse {
    StoredResponse {
        status: status.as_u16(),
        headers: headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect(),
        body: body.to_vec(),
    }
}

/// True when the engine can store the response whole.
pub fn storable(headers: &HeaderMap, body_len: usize) -> bool {
    idem_http::storable(headers.len(), body_len)
}

/// The HTTP response for a stored one, with the headers of
/// [`idem_http::response_headers`] (`Idempotent-Replayed: true` when
/// `replayed`). `None` when the stored status is not a valid code.
pub fn from_stored(stored: &StoredResponse, replayed: bool) -> Option<Response> {
    let status = StatusCode::from_u16(stored.status).ok()?;
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in idem_http::response_headers(&stored.headers, replayed) {
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            (Ok(n), Ok(v)) => {
                headers.append(n, v);
            }
            _ => tracing::warn!("a stored response header could not be rebuilt; it is left out"),
        }
    }
    Some(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified_by_the_shared_rules() {
        for code in [100, 201, 304, 408, 409, 425, 429, 400, 422, 500, 503, 599] {
            let status = StatusCode::from_u16(code).unwrap();
            for policy in [ServerErrors::Retry, ServerErrors::Store] {
                assert_eq!(
                    classify_status(status, policy),
                    idem_http::classify_status(code, policy),
                    "{code}"
                );
            }
        }
        assert_eq!(disposition(Verdict::Complete), None);
        assert_eq!(disposition(Verdict::Final), Some(Disposition::Final));
        assert_eq!(
            disposition(Verdict::Retryable),
            Some(Disposition::Retryable)
        );
    }

    #[test]
    fn stored_responses_round_trip() {
        let mut h = HeaderMap::new();
        h.append("set-cookie", HeaderValue::from_static("a=1"));
        h.append("set-cookie", HeaderValue::from_static("b=2"));
        h.append("content-type", HeaderValue::from_static("text/plain"));
        let stored = to_stored(StatusCode::CREATED, &h, b"hello");
        assert_eq!(stored.status, 201);
        assert_eq!(stored.headers.len(), 3);
        let r = from_stored(&stored, true).unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        assert_eq!(r.headers().get_all("set-cookie").iter().count(), 2);
        assert_eq!(r.headers()[&IDEMPOTENT_REPLAYED], "true");
        let first = from_stored(&stored, false).unwrap();
        assert!(first.headers().get(&IDEMPOTENT_REPLAYED).is_none());
        // A stored Idempotent-Replayed is replaced, never repeated.
        let mut own = stored.clone();
        own.headers
            .push(("idempotent-replayed".to_owned(), b"false".to_vec()));
        let r = from_stored(&own, true).unwrap();
        let values: Vec<_> = r.headers().get_all(&IDEMPOTENT_REPLAYED).iter().collect();
        assert_eq!(values, ["true"]);
        let r = from_stored(&own, false).unwrap();
        assert_eq!(r.headers()[&IDEMPOTENT_REPLAYED], "false");
        let bad = StoredResponse {
            status: 1000,
            ..stored
        };
        assert!(from_stored(&bad, true).is_none());
    }

    #[test]
    fn storable_follows_the_engine_limits() {
        let h = HeaderMap::new();
        assert!(storable(&h, MAX_STORED_BODY_BYTES));
        assert!(!storable(&h, MAX_STORED_BODY_BYTES + 1));
    }
}
