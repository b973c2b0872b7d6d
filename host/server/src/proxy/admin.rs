//! The admin server: `GET /healthz` and `GET /metrics`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{HeaderValue, StatusCode, header};

use super::Inner;
use super::metrics::METRICS_CONTENT_TYPE;

pub(super) fn router(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .with_state(inner)
}

/// 200 `ok` when the store answers `count_by_status`, else 503.
async fn healthz(State(inner): State<Arc<Inner>>) -> Response {
    let store = inner.store.clone();
    let answer = tokio::task::spawn_blocking(move || store.count_by_status()).await;
    match answer {
        Ok(Ok(_)) => (StatusCode::OK, "ok").into_response(),
        Ok(Err(e)) => {
            inner.metrics.store_error();
            tracing::warn!(error = %e, "health check: the store did not answer");
            (StatusCode::SERVICE_UNAVAILABLE, "store unavailable").into_response()
        }
        Err(e) => {
            tracing::warn!(error = %e, "health check failed");
            (StatusCode::SERVICE_UNAVAILABLE, "store unavailable").into_response()
        }
    }
}

/// The metrics in the OpenMetrics text format.
async fn metrics(State(inner): State<Arc<Inner>>) -> Response {
    let mut response = inner.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(METRICS_CONTENT_TYPE),
    );
    response
}
