//! The admin server: `GET /healthz` and `GET /metrics`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{HeaderValue, StatusCode, header};

use idem_engine::types::RecordKey;

use super::Inner;
use super::metrics::METRICS_CONTENT_TYPE;

pub(super) fn router(inner: Arc<Inner>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .with_state(inner)
}

/// The key the health check reads: in no biz type a route can name (biz
/// types are letters, digits and `-_.:`), so it never has a record.
fn probe_key() -> RecordKey {
    RecordKey::new("idem-health", "idem health probe", "probe")
}

/// 200 `ok` when the store answers, else 503. The probe is one read by the
/// unique key, as cheap as a replay's (it used to count every record by
/// status, a full-table scan on every probe).
async fn healthz(State(inner): State<Arc<Inner>>) -> Response {
    let store = inner.store.clone();
    let answer = tokio::task::spawn_blocking(move || store.get(&probe_key())).await;
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
