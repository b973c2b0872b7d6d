//! The admin server: `GET /healthz` and `GET /metrics` for anyone; the
//! operator endpoints (`/keys/...`) for a bearer of the admin token.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use idem_engine::types::RecordKey;
use idem_engine::{Error, StoreError};

use super::Inner;
use super::metrics::METRICS_CONTENT_TYPE;
use crate::operator::{self, Client, OperatorError, SettleRequest};

/// The most stuck keys one `GET /keys/stuck` lists when it names no limit.
const DEFAULT_STUCK_LIMIT: u32 = 100;

/// The admin server's state: what it reads, and the operator's token.
#[derive(Clone)]
struct Admin {
    inner: Arc<Inner>,
    token: Option<Arc<str>>,
}

pub(super) fn router(inner: Arc<Inner>, token: Option<Arc<str>>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/keys/stuck", get(stuck))
        .route("/keys", get(inspect))
        .route("/keys/settle", post(settle))
        .with_state(Admin { inner, token })
}

/// The key the health check reads: in no biz type a route can name (biz
/// types are letters, digits and `-_.:`), so it never has a record.
fn probe_key() -> RecordKey {
    RecordKey::new("idem-health", "idem health probe", "probe")
}

/// 200 `ok` when the store answers, else 503. The probe is one read by the
/// unique key, as cheap as a replay's (it used to count every record by
/// status, a full-table scan on every probe).
async fn healthz(State(admin): State<Admin>) -> Response {
    let inner = admin.inner;
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
async fn metrics(State(admin): State<Admin>) -> Response {
    let mut response = admin.inner.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(METRICS_CONTENT_TYPE),
    );
    response
}

/// A JSON error answer: `{"error": message, "field": field}`.
fn refusal(status: StatusCode, field: &str, message: impl Into<String>) -> Response {
    let body = serde_json::json!({ "error": message.into(), "field": field });
    (status, Json(body)).into_response()
}

/// The refusal of a request without the operator's bearer token (checked
/// in constant time); none when it carries it. Without a configured token
/// the operator endpoints are closed.
fn unauthorized(admin: &Admin, headers: &HeaderMap) -> Option<Response> {
    let Some(token) = &admin.token else {
        return Some(refusal(
            StatusCode::FORBIDDEN,
            "authorization",
            "the operator endpoints are off: start idem serve with an admin token",
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
        None
    } else {
        let mut refused = refusal(
            StatusCode::UNAUTHORIZED,
            "authorization",
            "a bearer token is required: Authorization: Bearer <admin token>",
        );
        refused
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        Some(refused)
    }
}

/// An engine or store failure as an answer.
fn failure(e: Error) -> Response {
    match e {
        Error::Invalid(i) => {
            let field = serde_json::to_value(i.field)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            refusal(StatusCode::UNPROCESSABLE_ENTITY, &field, i.message)
        }
        Error::Store(StoreError::Unavailable(m)) => {
            refusal(StatusCode::SERVICE_UNAVAILABLE, "store", m)
        }
        other => refusal(
            StatusCode::INTERNAL_SERVER_ERROR,
            "engine",
            other.to_string(),
        ),
    }
}

fn bad(e: OperatorError) -> Response {
    refusal(StatusCode::BAD_REQUEST, e.field, e.message)
}

/// Runs `f` on the blocking pool: the operator endpoints may use a store
/// that blocks (PostgreSQL).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Response> {
    match tokio::task::spawn_blocking(f).await {
        Ok(answer) => answer.map_err(failure),
        Err(e) => Err(refusal(
            StatusCode::INTERNAL_SERVER_ERROR,
            "engine",
            format!("the call did not finish: {e}"),
        )),
    }
}

#[derive(Deserialize)]
struct StuckQuery {
    biz: String,
    limit: Option<u32>,
    after: Option<String>,
}

/// `GET /keys/stuck?biz=B[&limit=N][&after=CURSOR]`: as `idem stuck
/// --json`; `after` is the last listed key's `cursor`, for the next page.
async fn stuck(
    State(admin): State<Admin>,
    headers: HeaderMap,
    Query(q): Query<StuckQuery>,
) -> Response {
    if let Some(refused) = unauthorized(&admin, &headers) {
        return refused;
    }
    let store = admin.inner.store.clone();
    let limit = q.limit.unwrap_or(DEFAULT_STUCK_LIMIT);
    let after = match q.after.as_deref().map(str::parse).transpose() {
        Ok(after) => after,
        Err(message) => return refusal(StatusCode::BAD_REQUEST, "after", message),
    };
    let now = admin.inner.engine.clock().now();
    match blocking(move || Ok(operator::stuck(store.as_ref(), &q.biz, now, after, limit)?)).await {
        Ok(keys) => Json(keys).into_response(),
        Err(refused) => refused,
    }
}

#[derive(Deserialize)]
struct KeyQuery {
    biz: String,
    key: String,
    scope: Option<String>,
    auth: Option<String>,
    scope_value: Option<String>,
    client_ip: Option<IpAddr>,
}

/// `GET /keys?biz=B&key=K&scope=S` (or `auth=`, `scope_value=`,
/// `client_ip=`): as `idem inspect --json`; `null` without a record.
async fn inspect(
    State(admin): State<Admin>,
    headers: HeaderMap,
    Query(q): Query<KeyQuery>,
) -> Response {
    if let Some(refused) = unauthorized(&admin, &headers) {
        return refused;
    }
    let client = Client {
        scope: q.scope,
        auth: q.auth,
        scope_value: q.scope_value,
        client_ip: q.client_ip,
    };
    let key = match client.scope() {
        Ok(scope) => RecordKey::new(scope, q.biz, q.key),
        Err(e) => return bad(e),
    };
    let engine = admin.inner.engine.clone();
    match blocking(move || engine.inspect(&key)).await {
        Ok(status) => Json(status).into_response(),
        Err(refused) => refused,
    }
}

/// `POST /keys/settle` with a [`SettleRequest`] as JSON: as `idem settle
/// --json`. 200 when settled; 409 when the key is not stuck or has no
/// record (nothing changed).
async fn settle(
    State(admin): State<Admin>,
    headers: HeaderMap,
    request: Result<Json<SettleRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if let Some(refused) = unauthorized(&admin, &headers) {
        return refused;
    }
    let Json(request) = match request {
        Ok(r) => r,
        Err(e) => return refusal(StatusCode::BAD_REQUEST, "body", e.body_text()),
    };
    let (key, resolution) = match request
        .record_key()
        .and_then(|k| Ok((k, request.resolution()?)))
    {
        Ok(both) => both,
        Err(e) => return bad(e),
    };
    let policy = admin.inner.config.policy_for(&request.biz);
    let engine = admin.inner.engine.clone();
    match blocking(move || operator::settle(&engine, &policy, key, &resolution)).await {
        Ok(report) => {
            tracing::info!(
                settlement = report.settlement,
                scope = %report.scope,
                biz_type = %report.biz_type,
                key = %report.key,
                "an operator settled a key"
            );
            let code = if report.settled() {
                StatusCode::OK
            } else {
                StatusCode::CONFLICT
            };
            (code, Json(report)).into_response()
        }
        Err(refused) => refused,
    }
}
