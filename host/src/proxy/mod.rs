//! `idem serve`: an HTTP reverse proxy that makes unsafe requests
//! idempotent with an `Idempotency-Key` header.
//!
//! The proxy decides nothing about keys: it maps each HTTP request to a
//! [`BeginRequest`], asks the [`Engine`], and maps the [`Decision`] back to
//! HTTP. Only `execute` reaches the upstream; its answer is stored with
//! `complete` or `fail` and replayed to duplicates.
//!
//! ```no_run
//! use idem::proxy::{Proxy, ProxyConfig, serve};
//! use idem::{Engine, SqliteStore, Storage};
//! use std::sync::Arc;
//!
//! # async fn run() -> anyhow::Result<()> {
//! let store = SqliteStore::open("idem.db", Default::default())?;
//! let engine = Engine::builder().storage(store.clone()).build()?;
//! let store: Arc<dyn Storage> = Arc::new(store);
//! let proxy = Proxy::new(engine, store, ProxyConfig::default(), "http://127.0.0.1:9000".parse()?)?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! serve(listener, proxy.router(), async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```

pub mod admin;
pub mod config;
pub mod forward;
mod framing;
pub mod key;
pub mod metrics;
pub mod problem;
pub mod server;

#[cfg(test)]
mod service_tests;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use http::{HeaderMap, Uri, header};
use tower::Layer;

pub use config::{
    AnonymousMode, ConfigError, InProgressConfig, KeyRequirement, PolicyConfig, ProxyConfig, Route,
    RouteConfig, RouteTable, ServerErrors,
};
pub use forward::{Upstream, UpstreamError, Verdict, classify_status};
pub use key::{IDEMPOTENCY_KEY, KeyHeaderError, ScopeError, derive_scope, parse_idempotency_key};
pub use metrics::Metrics;
pub use problem::{Problem, ProblemType};
pub use server::{ServeOptions, serve_with};

use crate::api::{BodyKind, InputField, InputRule, InvalidInput};
use crate::api::{Decision, Ticket};
use crate::engine::{Engine, Error};
use crate::layer::IdempotencyLayer;
use crate::store::Storage;
use crate::types::StoredResponse;

/// Why the proxy could not be built or could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The upstream URI cannot be used.
    #[error("invalid upstream: {0}")]
    Upstream(String),
    /// The server failed.
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
}

/// What the admin server reads.
struct Inner {
    store: Arc<dyn Storage>,
    metrics: Metrics,
}

/// A store the proxy can share with its health check: any [`Storage`]
/// (such as a [`crate::SqliteStore`]) or an `Arc<dyn Storage>`.
pub trait SharedStorage {
    /// The store behind an `Arc`.
    fn into_shared(self) -> Arc<dyn Storage>;
}

impl<S: Storage> SharedStorage for S {
    fn into_shared(self) -> Arc<dyn Storage> {
        Arc::new(self)
    }
}

impl SharedStorage for Arc<dyn Storage> {
    fn into_shared(self) -> Arc<dyn Storage> {
        self
    }
}

/// The proxy: an [`IdempotencyLayer`] over the [`Upstream`]. Its routers
/// share one engine, one store and one set of metrics. Cheap to clone.
#[derive(Clone)]
pub struct Proxy {
    layer: IdempotencyLayer,
    upstream: Upstream,
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("upstream", &self.upstream)
            .field("config", self.layer.config())
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// A proxy in front of `upstream` (`http://host:port`, optionally with
    /// a base path). `store` is the engine's store (a [`Storage`] or an
    /// `Arc<dyn Storage>`), read directly only by the health check.
    ///
    /// Each route's biz type and policy are checked by the engine here (a
    /// `reconcile` of zero records), so a policy the engine would refuse
    /// fails now rather than on every request.
    ///
    /// # Errors
    ///
    /// [`ProxyError::Config`] for an invalid configuration,
    /// [`ProxyError::Upstream`] for an unusable upstream URI.
    pub fn new(
        engine: Engine,
        store: impl SharedStorage,
        config: ProxyConfig,
        upstream: Uri,
    ) -> Result<Proxy, ProxyError> {
        let store = store.into_shared();
        let timeout = Duration::from_millis(config.upstream_timeout_ms);
        let layer = IdempotencyLayer::new(engine, config)?;
        for biz_type in layer.reconciling_biz_types() {
            tracing::warn!(
                "biz type '{biz_type}' uses expired_lease = \"reconcile\", but the proxy has no business lookup: a key whose lease expires stays blocked (answered 503) until an operator settles it; \"manual\" says so with 409 outcome-unknown"
            );
        }
        let upstream = Upstream::new(&upstream, timeout).map_err(ProxyError::Upstream)?;
        let inner = Arc::new(Inner {
            store,
            metrics: layer.metrics().clone(),
        });
        Ok(Proxy {
            layer,
            upstream,
            inner,
        })
    }

    /// Waits for every keyed request still in flight (including those whose
    /// client hung up) to store its outcome. Call after [`serve`] returns.
    pub async fn finish(&self) {
        self.layer.finish().await;
    }

    /// The proxy's router: every method and path, through the layer to the
    /// upstream.
    pub fn router(&self) -> Router {
        Router::new().fallback_service(self.layer.layer(self.upstream.clone()))
    }

    /// The layer the proxy runs its requests through.
    pub fn layer(&self) -> &IdempotencyLayer {
        &self.layer
    }

    /// The admin router: `GET /healthz` and `GET /metrics`.
    pub fn admin_router(&self) -> Router {
        admin::router(self.inner.clone())
    }

    /// The proxy's metrics.
    pub fn metrics(&self) -> &Metrics {
        self.layer.metrics()
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        self.layer.config()
    }

    /// How [`serve_with`] should treat the proxy's clients, from the
    /// configuration.
    pub fn serve_options(&self) -> ServeOptions {
        ServeOptions {
            header_read_timeout: Duration::from_millis(self.config().header_read_timeout_ms),
        }
    }

    /// Deletes expired keys in batches of `sweep_batch` until a batch
    /// deletes fewer; returns how many were deleted.
    ///
    /// # Errors
    ///
    /// The engine's error; the batches before it stay deleted.
    pub async fn sweep(&self) -> Result<u64, Error> {
        let batch = self.config().sweep_batch;
        let mut total = 0u64;
        loop {
            let engine = self.layer.engine().clone();
            let deleted = match tokio::task::spawn_blocking(move || engine.sweep(batch)).await {
                Ok(deleted) => deleted,
                Err(e) => Err(Error::Trap(format!("the sweep did not finish: {e}"))),
            };
            if let Err(Error::Store(_)) = &deleted {
                self.metrics().store_error();
            }
            let deleted = deleted?;
            total += u64::from(deleted);
            if deleted < batch {
                return Ok(total);
            }
        }
    }

    /// Starts the background sweep every `sweep_interval_ms`; `None` when
    /// it is disabled (0). Abort the task to stop it: a batch already
    /// started finishes on its blocking thread, and is one atomic delete.
    pub fn spawn_sweeper(&self) -> Option<tokio::task::JoinHandle<()>> {
        let interval = self.config().sweep_interval_ms;
        if interval == 0 {
            return None;
        }
        let proxy = self.clone();
        Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(interval)).await;
                match proxy.sweep().await {
                    Ok(0) => tracing::debug!("sweep: nothing expired"),
                    Ok(n) => tracing::info!(deleted = n, "sweep: expired keys deleted"),
                    Err(e) => tracing::warn!(error = %e, "sweep failed"),
                }
            }
        }))
    }
}

/// Serves `router` on `listener` until `shutdown` completes; then stops
/// accepting and waits for the requests in flight to finish. Uses the
/// default [`ServeOptions`]; [`serve_with`] takes others (for the proxy:
/// [`Proxy::serve_options`]).
///
/// # Errors
///
/// [`ProxyError::Io`] when the server fails.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ProxyError> {
    serve_with(listener, router, ServeOptions::default(), shutdown).await
}

/// The body kind for the fingerprint, from the (first) `Content-Type`:
/// JSON for `application/json` and `*/*+json`, raw otherwise
/// ([`idem_http::body_kind`]).
pub fn body_kind(headers: &HeaderMap) -> BodyKind {
    let content_type = headers.get(header::CONTENT_TYPE).map(|v| v.as_bytes());
    match idem_http::body_kind(content_type) {
        idem_http::BodyKind::Json => BodyKind::Json,
        idem_http::BodyKind::Raw => BodyKind::Raw,
    }
}

/// The problem for an `invalid` decision ([`idem_http::invalid_problem`]):
/// `key-invalid` for the key, `body-too-large` (413) for a body over the
/// limit, `invalid-request` otherwise; the engine's message is the detail.
pub fn invalid_problem(i: &InvalidInput) -> Problem {
    idem_http::invalid_problem(&invalid(i.clone())).into()
}

/// The problem for an engine error ([`idem_http::engine_error_problem`]):
/// 503 with `Retry-After: 1` when the store failed, 500 otherwise.
pub fn engine_error_problem(e: &Error) -> Problem {
    let failure = match e {
        Error::Store(_) => idem_http::EngineFailure::Store,
        _ => idem_http::EngineFailure::Other,
    };
    idem_http::engine_error_problem(failure).into()
}

/// The engine's decision in `idem_http`'s terms, to be answered by
/// [`idem_http::answer`].
pub(crate) fn http_decision(decision: Decision) -> idem_http::Decision<Ticket, StoredResponse> {
    match decision {
        Decision::Execute(ticket) => idem_http::Decision::Execute(ticket),
        Decision::Replay(replayed) => idem_http::Decision::Replay(replayed.response),
        Decision::InProgress(busy) => idem_http::Decision::InProgress {
            retry_after_ms: busy.retry_after_ms,
        },
        Decision::Mismatch(_) => idem_http::Decision::Mismatch,
        Decision::Failed(failure) => idem_http::Decision::Failed(failure.response),
        Decision::OutcomeUnknown(_) => idem_http::Decision::OutcomeUnknown,
        Decision::Invalid(i) => idem_http::Decision::Invalid(invalid(i)),
    }
}

fn invalid(i: InvalidInput) -> idem_http::Invalid {
    use idem_http::{Field, Rule};
    idem_http::Invalid {
        field: match i.field {
            InputField::Scope => Field::Scope,
            InputField::BizType => Field::BizType,
            InputField::IdemKey => Field::IdemKey,
            InputField::Attributes => Field::Attributes,
            InputField::Body => Field::Body,
            InputField::Policy => Field::Policy,
            InputField::SuccessResult => Field::SuccessResult,
            InputField::FailureInfo => Field::FailureInfo,
            InputField::Ticket => Field::Ticket,
        },
        rule: match i.rule {
            InputRule::Required => Rule::Required,
            InputRule::TooShort => Rule::TooShort,
            InputRule::TooLong => Rule::TooLong,
            InputRule::BadCharacter => Rule::BadCharacter,
            InputRule::BadFormat => Rule::BadFormat,
            InputRule::NotJson => Rule::NotJson,
            InputRule::OutOfRange => Rule::OutOfRange,
        },
        message: i.message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn kind(ct: &str) -> BodyKind {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        body_kind(&h)
    }

    #[test]
    fn the_first_content_type_decides_the_body_kind() {
        assert_eq!(kind("application/json"), BodyKind::Json);
        assert_eq!(
            kind("application/merge-patch+json; charset=utf-8"),
            BodyKind::Json
        );
        assert_eq!(kind("text/plain"), BodyKind::Raw);
        assert_eq!(body_kind(&HeaderMap::new()), BodyKind::Raw);
        let mut h = HeaderMap::new();
        h.append(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.append(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        assert_eq!(body_kind(&h), BodyKind::Json);
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_bytes(b"application/json\xff").unwrap(),
        );
        assert_eq!(body_kind(&h), BodyKind::Raw);
    }

    #[test]
    fn invalid_decisions_map_to_problems() {
        let key = InvalidInput {
            field: InputField::IdemKey,
            rule: InputRule::TooLong,
            message: "idem-key is too long".into(),
        };
        let p = invalid_problem(&key);
        assert_eq!(p.kind, ProblemType::KeyInvalid);
        assert_eq!(p.status, 400);
        let v = p.to_json();
        assert_eq!(v["field"], "idem-key");
        assert_eq!(v["rule"], "too-long");
        assert_eq!(v["detail"], "idem-key is too long");

        let body = InvalidInput {
            field: InputField::Body,
            rule: InputRule::TooLong,
            message: "body is too long".into(),
        };
        assert_eq!(invalid_problem(&body).status, 413);
    }

    /// The names the problem's `field` and `rule` members carry are the
    /// engine's (its serde names).
    #[test]
    fn field_and_rule_names_are_the_engines() {
        use InputField as F;
        use InputRule as R;
        let fields = [
            F::Scope,
            F::BizType,
            F::IdemKey,
            F::Attributes,
            F::Body,
            F::Policy,
            F::SuccessResult,
            F::FailureInfo,
            F::Ticket,
        ];
        let rules = [
            R::Required,
            R::TooShort,
            R::TooLong,
            R::BadCharacter,
            R::BadFormat,
            R::NotJson,
            R::OutOfRange,
        ];
        for field in fields {
            for rule in rules {
                let i = invalid(InvalidInput {
                    field,
                    rule,
                    message: String::new(),
                });
                assert_eq!(serde_json::to_value(field).unwrap(), i.field.name());
                assert_eq!(serde_json::to_value(rule).unwrap(), i.rule.name());
            }
        }
    }

    #[test]
    fn decisions_convert_one_to_one() {
        use crate::api::{Busy, MismatchInfo, Replayed, UnknownInfo};
        use crate::types::Failure;
        let stored = StoredResponse {
            status: 201,
            headers: vec![],
            body: b"done".to_vec(),
        };
        let replay = Decision::Replay(Replayed {
            result_ref: None,
            response: Some(stored.clone()),
            completed_at: 0,
        });
        assert_eq!(
            http_decision(replay),
            idem_http::Decision::Replay(Some(stored.clone()))
        );
        assert_eq!(
            http_decision(Decision::InProgress(Busy {
                retry_after_ms: 250,
                lease_until: 9,
            })),
            idem_http::Decision::InProgress {
                retry_after_ms: 250
            }
        );
        let failed = Decision::Failed(Failure {
            code: "http-400".into(),
            message: "m".into(),
            response: None,
        });
        assert_eq!(http_decision(failed), idem_http::Decision::Failed(None));
        let mismatch = Decision::Mismatch(MismatchInfo {
            stored_prefix: "0123abcd".into(),
            stored_version: 2,
        });
        assert_eq!(http_decision(mismatch), idem_http::Decision::Mismatch);
        let unknown = Decision::OutcomeUnknown(UnknownInfo {
            since: 0,
            attempts: 1,
            failure: None,
        });
        assert_eq!(http_decision(unknown), idem_http::Decision::OutcomeUnknown);
    }

    #[test]
    fn engine_errors_map_to_503_or_500() {
        let store =
            engine_error_problem(&Error::Store(crate::StoreError::Unavailable("down".into())));
        assert_eq!(store.status, 503);
        assert_eq!(store.retry_after_secs, Some(1));
        // The store's message is not echoed.
        assert!(!store.to_json().to_string().contains("down"));
        let trap = engine_error_problem(&Error::Trap("boom".into()));
        assert_eq!(trap.status, 500);
    }
}
