//! `idem serve`: an HTTP reverse proxy that makes unsafe requests
//! idempotent with an `Idempotency-Key` header.
//!
//! The proxy decides nothing about keys: it maps each HTTP request to a
//! `BeginRequest`, asks the [`Engine`], and maps the `Decision` back to
//! HTTP. Only `execute` reaches the upstream; its answer is stored with
//! `complete` or `fail` and replayed to duplicates.
//!
//! ```no_run
//! use idem_engine::{Engine, MemoryStore, Storage};
//! use idem_server::proxy::{Proxy, ProxyConfig, serve};
//! use std::sync::Arc;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryStore::new();
//! let engine = Engine::builder().storage(store.clone()).build()?;
//! let store: Arc<dyn Storage> = Arc::new(store);
//! let proxy = Proxy::new(engine, store, ProxyConfig::default(), "http://127.0.0.1:9000".parse()?)?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! serve(listener, proxy.router(), async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```

pub mod admin;
pub mod forward;
mod framing;
pub mod server;

// The HTTP rules, the configuration and the metrics are the layer's: the
// proxy is the layer over an upstream.
pub use idem_layer::rules::{body_kind, engine_error_problem, invalid_problem};
pub use idem_layer::{config, key, metrics, problem};

#[cfg(test)]
mod service_tests;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use http::Uri;
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

pub use idem_engine::store::SharedStorage;
use idem_engine::types::Status;
use idem_engine::{Engine, Error, ReconcileReport, Storage};
use idem_layer::IdempotencyLayer;

/// The most stuck keys counted per biz type and sweep: enough to see a
/// problem grow, few enough that a count stays one bounded, indexed read.
pub const STUCK_COUNT_LIMIT: u32 = 10_000;

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
    /// The engine and its configuration, for the operator endpoints.
    engine: Engine,
    config: ProxyConfig,
}

/// The proxy: an [`IdempotencyLayer`] over the [`Upstream`]. Its routers
/// share one engine, one store and one set of metrics. Cheap to clone.
#[derive(Clone)]
pub struct Proxy {
    layer: IdempotencyLayer,
    upstream: Upstream,
    inner: Arc<Inner>,
    /// The bearer token the admin server's operator endpoints require.
    admin_token: Option<Arc<str>>,
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
        let with_lookup = config
            .biz_types()
            .into_iter()
            .find(|b| config.lookup_for(b).is_some());
        if let Some(biz_type) = with_lookup
            && !engine.has_lookup()
        {
            return Err(ConfigError::Invalid {
                field: "lookup".into(),
                message: format!(
                    "biz type '{biz_type}' has a lookup, but the engine was built without one: build it with .results(idem_server::lookup::HttpLookup::from_config(&config))"
                ),
            }
            .into());
        }
        let layer = IdempotencyLayer::new(engine, config)?;
        let config = layer.config();
        for biz_type in layer
            .reconciling_biz_types()
            .filter(|b| config.lookup_for(b).is_none())
        {
            tracing::warn!(
                "biz type '{biz_type}' uses \"reconcile\" for expired_lease or outcome_unknown, but has no lookup: a key whose lease expires stays blocked (answered 503) until an operator settles it; \"manual\" says so with 409 outcome-unknown"
            );
        }
        let upstream = Upstream::new(&upstream, timeout).map_err(ProxyError::Upstream)?;
        let inner = Arc::new(Inner {
            store,
            metrics: layer.metrics().clone(),
            engine: layer.engine().clone(),
            config: layer.config().clone(),
        });
        Ok(Proxy {
            layer,
            upstream,
            inner,
            admin_token: None,
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

    /// The proxy with `token` as the bearer token of the admin server's
    /// operator endpoints (`/keys/...`); without one they are refused.
    pub fn with_admin_token(mut self, token: impl Into<Arc<str>>) -> Self {
        self.admin_token = Some(token.into());
        self
    }

    /// Whether the operator endpoints have a token ([`Proxy::with_admin_token`]).
    pub fn has_admin_token(&self) -> bool {
        self.admin_token.is_some()
    }

    /// The admin router: `GET /healthz` and `GET /metrics` for anyone, and
    /// for an operator with the admin token (`Authorization: Bearer …`):
    /// `GET /keys/stuck?biz=B[&limit=N]`, `GET /keys?biz=B&key=K&<client>`
    /// and `POST /keys/settle` (see [`crate::operator`]).
    pub fn admin_router(&self) -> Router {
        admin::router(self.inner.clone(), self.admin_token.clone())
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

    /// Counts the stuck keys of every biz type (in progress past their
    /// lease, and outcome-unknown; at most [`STUCK_COUNT_LIMIT`] per biz
    /// type, both kinds together) and sets `idem_stuck_keys`.
    ///
    /// # Errors
    ///
    /// The store's.
    pub async fn count_stuck(&self) -> Result<(u64, u64), Error> {
        let store = self.inner.store.clone();
        let engine = self.layer.engine().clone();
        let biz_types = self.layer.biz_types();
        let counted = tokio::task::spawn_blocking(move || -> Result<(u64, u64), Error> {
            let now = engine.clock().now();
            let (mut processing, mut unknown) = (0, 0);
            for biz_type in &biz_types {
                for key in
                    crate::operator::stuck(store.as_ref(), biz_type, now, None, STUCK_COUNT_LIMIT)?
                {
                    if key.status == Status::OutcomeUnknown.as_str() {
                        unknown += 1;
                    } else {
                        processing += 1;
                    }
                }
            }
            Ok((processing, unknown))
        })
        .await
        .map_err(|e| Error::Trap(format!("the count did not finish: {e}")))??;
        self.metrics().stuck_keys(counted.0, counted.1);
        Ok(counted)
    }

    /// Reconciles the stuck keys of every biz type that has a `lookup`
    /// (at most `sweep_batch` each): a key whose result the lookup finds
    /// is settled as succeeded and replays it; one it does not find is
    /// released or left for an operator, as the biz type's policy says.
    /// Biz types without a lookup are left alone: a reconcile that cannot
    /// ask anyone changes nothing.
    ///
    /// # Errors
    ///
    /// The engine's; the biz types before it stay reconciled.
    pub async fn reconcile(&self) -> Result<ReconcileReport, Error> {
        let config = self.config().clone();
        let engine = self.layer.engine().clone();
        let metrics = self.metrics().clone();
        tokio::task::spawn_blocking(move || -> Result<ReconcileReport, Error> {
            let mut total = ReconcileReport::default();
            for biz_type in config.biz_types() {
                if config.lookup_for(&biz_type).is_none() {
                    continue;
                }
                let policy = config.policy_for(&biz_type);
                let r = engine.reconcile(&biz_type, &policy, config.sweep_batch)?;
                metrics.reconciled(&r);
                total.examined += r.examined;
                total.succeeded += r.succeeded;
                total.released += r.released;
                total.left_for_manual += r.left_for_manual;
                total.skipped += r.skipped;
                total.lookup_errors += r.lookup_errors;
            }
            Ok(total)
        })
        .await
        .map_err(|e| Error::Trap(format!("the reconcile did not finish: {e}")))?
    }

    /// Releases the stuck keys that waited past their biz type's
    /// `stuck_retention_ms` (at most `sweep_batch` examined per biz type),
    /// logging each one ([`crate::operator::expire_stuck`]), and counts them
    /// in `idem_stuck_keys_expired`. Returns how many were released.
    ///
    /// # Errors
    ///
    /// The engine's; the keys released before it stay released.
    pub async fn expire_stuck(&self) -> Result<u64, Error> {
        let config = self.config().clone();
        let engine = self.layer.engine().clone();
        let store = self.inner.store.clone();
        let released = tokio::task::spawn_blocking(move || -> Result<u64, Error> {
            let now = engine.clock().now();
            let expired = crate::operator::expire_stuck_keys(
                &engine,
                store.as_ref(),
                &config,
                now,
                config.sweep_batch,
            )?;
            Ok(expired.len() as u64)
        })
        .await
        .map_err(|e| Error::Trap(format!("the stuck-key expiry did not finish: {e}")))??;
        self.metrics().stuck_keys_expired(released);
        Ok(released)
    }

    /// Starts the background sweep every `sweep_interval_ms`; `None` when
    /// it is disabled (0). Each sweep deletes expired keys, reconciles the
    /// biz types that have a lookup ([`Proxy::reconcile`]), releases the
    /// stuck keys past their retention ([`Proxy::expire_stuck`]) and counts
    /// those left ([`Proxy::count_stuck`]). Abort the task to stop it: a batch already
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
                match proxy.reconcile().await {
                    Ok(r) if r.examined == 0 => {}
                    Ok(r) => tracing::info!(
                        examined = r.examined,
                        succeeded = r.succeeded,
                        released = r.released,
                        left_for_manual = r.left_for_manual,
                        lookup_errors = r.lookup_errors,
                        "reconcile: stuck keys examined with their lookup"
                    ),
                    Err(e) => tracing::warn!(error = %e, "reconcile failed"),
                }
                if let Err(e) = proxy.expire_stuck().await {
                    tracing::warn!(error = %e, "releasing the stuck keys past their retention failed");
                }
                match proxy.count_stuck().await {
                    Ok((0, 0)) => {}
                    Ok((processing, outcome_unknown)) => tracing::warn!(
                        processing,
                        outcome_unknown,
                        "keys are stuck until an operator settles them (idem stuck, idem settle)"
                    ),
                    Err(e) => tracing::warn!(error = %e, "counting the stuck keys failed"),
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
