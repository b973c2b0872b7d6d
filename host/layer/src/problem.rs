//! RFC 9457 problem details as axum responses.
//!
//! The catalogue (types, titles, statuses, every detail text) and the JSON
//! body are `idem_http`'s ([`idem_http::problem`]), shared with the
//! middleware component; this module only turns a problem into a
//! [`Response`].

use std::ops::{Deref, DerefMut};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, StatusCode};

pub use idem_http::problem::{
    PROBLEM_BASE, PROBLEM_CONTENT_TYPE, ProblemType, WWW_AUTHENTICATE, retry_after_secs,
};

/// One problem answer: [`idem_http::Problem`], which it derefs to, as an
/// axum response.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem(pub idem_http::Problem);

impl Problem {
    /// A problem of `kind` with its usual status.
    pub fn new(kind: ProblemType, detail: impl Into<String>) -> Self {
        Problem(idem_http::Problem::new(kind, detail))
    }

    /// The status as an [`http`] status code (500 if the status is not a
    /// valid code, which the catalogue never gives).
    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl From<idem_http::Problem> for Problem {
    fn from(problem: idem_http::Problem) -> Self {
        Problem(problem)
    }
}

impl Deref for Problem {
    type Target = idem_http::Problem;

    fn deref(&self) -> &idem_http::Problem {
        &self.0
    }
}

impl DerefMut for Problem {
    fn deref_mut(&mut self) -> &mut idem_http::Problem {
        &mut self.0
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut response = Response::new(Body::from(self.0.body()));
        *response.status_mut() = self.status_code();
        let headers = response.headers_mut();
        for (name, value) in self.0.headers() {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(&value),
            ) {
                headers.append(name, value);
            }
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header;

    #[test]
    fn a_401_carries_a_challenge() {
        let r = Problem::new(ProblemType::ClientUnidentified, "who are you").into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            r.headers()[header::WWW_AUTHENTICATE],
            "Bearer realm=\"idem\""
        );
        let r = Problem::new(ProblemType::KeyMissing, "x").into_response();
        assert!(r.headers().get(header::WWW_AUTHENTICATE).is_none());
    }

    #[test]
    fn problem_responses_carry_the_media_type_and_retry_after() {
        let r = Problem::from(idem_http::Problem::in_progress(1500)).into_response();
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(
            r.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        assert_eq!(r.headers()[header::CACHE_CONTROL], "no-store");
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let r = Problem::from(idem_http::Problem::upstream_failed()).into_response();
        assert_eq!(r.status(), StatusCode::GATEWAY_TIMEOUT);
        assert!(r.headers().get(header::RETRY_AFTER).is_none());
    }

    #[tokio::test]
    async fn the_body_is_the_catalogues_json() {
        use http_body_util::BodyExt;
        let p = Problem::from(idem_http::Problem::key_missing("POST"));
        let json = p.to_json();
        let body = p.into_response().into_body().collect().await.unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body.to_bytes()).unwrap();
        assert_eq!(v, json);
        assert_eq!(v["type"], "tag:idem.invalid,2026:problems/key-missing");
    }

    #[test]
    fn an_invalid_status_is_a_500() {
        let p = Problem::new(ProblemType::InternalError, "x");
        let mut bad = p.clone();
        bad.status = 1000;
        assert_eq!(bad.status_code(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(p.status_code(), StatusCode::INTERNAL_SERVER_ERROR);
        let p = Problem::new(ProblemType::KeyReused, "x");
        assert_eq!(p.status_code(), StatusCode::UNPROCESSABLE_ENTITY);
    }
}
