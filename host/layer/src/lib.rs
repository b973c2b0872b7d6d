//! [`IdempotencyLayer`]: a tower layer that makes a service's unsafe
//! requests idempotent with an `Idempotency-Key` header.
//!
//! It wraps any `tower::Service<http::Request<Body>>`: an axum router in
//! the same process, or a client that forwards to an upstream (which is
//! what `idem serve` is: this layer over its upstream client).
//! Both get the same rules, the same configuration ([`ProxyConfig`]: routes,
//! biz types, policies), the same problems and the same [`Metrics`].
//!
//! For each request the layer reads the key and the client's scope, reads
//! the body (at most `max_body_bytes`), asks the [`Engine`], and only on
//! `execute` calls the inner service: once per key, with a [`Claim`] in
//! the request's extensions. While the inner service runs, the layer
//! extends the key's lease (the heartbeat); when it answers, the layer
//! stores the outcome and answers the caller. Duplicates are answered from
//! the store with `Idempotent-Replayed: true`. A request runs on its
//! caller's task, and moves to a task of its own if the client hangs up:
//! a client that goes away never cuts a claimed request between the inner
//! call and the stored outcome, and [`IdempotencyLayer::finish`] waits for
//! such requests at shutdown.
//!
//! The service needs no `spawn_blocking` of its own. Engine calls run on
//! the request's own thread when the store answers in microseconds (SQLite,
//! the memory store: a thread handoff would cost more than the call), and
//! on tokio's blocking pool when it waits on the network (PostgreSQL); see
//! [`Engine::blocks_on_io`].
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idem_layer::{IdempotencyLayer, ProxyConfig};
//! use idem_engine::{Engine, MemoryStore};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Engine::builder().storage(MemoryStore::new()).build()?;
//! let app = Router::new()
//!     .route("/orders", post(|| async { (http::StatusCode::CREATED, "order 1") }))
//!     .layer(IdempotencyLayer::new(engine, ProxyConfig::default())?);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

mod body;
pub mod config;
mod detach;
mod error;
mod future;
pub mod key;
mod keyed;
pub mod metrics;
mod pending;
pub mod problem;
pub mod response;
pub mod rules;

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use http::{Request, Response};
use tokio_util::task::TaskTracker;
use tower::{Layer, Service};

pub use body::BufferedResponse;
pub use config::{ConfigError, ProxyConfig};
pub use error::{InnerFailure, error_chain};
pub use future::ResponseFuture;
pub use metrics::Metrics;
pub use problem::{Problem, ProblemType};
pub use response::UpstreamError;

use crate::config::RouteTable;
use idem_engine::api::{ExpiredLease, Ticket};
use idem_engine::engine::{Engine, Error};

/// A boxed error, as tower services return them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The key a request executes under, put in the request's extensions for
/// the inner service: a handler can read it (axum: `Extension<Claim>`) to
/// pass the fencing token to its own writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The ownership of the key: its record, fencing token and attempt.
    pub ticket: Ticket,
}

/// What every service of one layer shares.
pub(crate) struct Shared {
    pub(crate) engine: Engine,
    pub(crate) config: ProxyConfig,
    pub(crate) routes: RouteTable,
    pub(crate) metrics: Metrics,
    /// Requests in flight, on their callers' tasks or, once their clients
    /// hung up, on tasks of their own.
    pub(crate) tasks: TaskTracker,
    /// Engine calls run on the request's own thread (the store answers in
    /// microseconds) rather than on the blocking pool.
    pub(crate) inline: bool,
    /// Outcomes the store has not taken yet.
    pub(crate) pending: pending::Pending,
}

/// The layer: holds the engine and the configuration; cheap to clone.
/// Every service it makes shares one engine, one route table and one set
/// of metrics.
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer deciding with `engine` under `config`.
    ///
    /// Each route's biz type and policy are checked by the engine here (a
    /// `reconcile` of zero records), so a policy the engine would refuse
    /// fails now rather than on every request.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] for an invalid configuration; the error names the
    /// field (`defaults` or `routes[i]`).
    pub fn new(engine: Engine, config: ProxyConfig) -> Result<IdempotencyLayer, ConfigError> {
        let routes = config.resolve()?;
        for route in routes.all() {
            let field = match route.index() {
                Some(i) => format!("routes[{i}]"),
                None => "defaults".into(),
            };
            match engine.reconcile(&route.biz_type, &route.policy, 0) {
                Ok(_) => {}
                Err(Error::Invalid(i)) => {
                    return Err(ConfigError::Invalid {
                        field,
                        message: i.message,
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not check the policy of {field}");
                }
            }
        }
        let inline = !engine.blocks_on_io();
        let pending = match &config.outcome_journal {
            Some(path) => {
                pending::Pending::with_journal(path.clone()).map_err(|e| ConfigError::Invalid {
                    field: "outcome_journal".into(),
                    message: e.to_string(),
                })?
            }
            None => pending::Pending::in_memory(),
        };
        let metrics = Metrics::new();
        metrics.pending_outcomes(pending.len());
        Ok(IdempotencyLayer {
            shared: Arc::new(Shared {
                inline,
                pending,
                engine,
                config,
                routes,
                metrics,
                tasks: TaskTracker::new(),
            }),
        })
    }

    /// Stores the outcomes a previous run left in the outcome journal
    /// ([`ProxyConfig::outcome_journal`]) and returns how many are still
    /// held; those are offered again in the background until the store
    /// takes them. Call it once at start, before serving: a request for
    /// such a key waits for its outcome to be stored either way, but
    /// nothing else would store an outcome whose key is never retried.
    pub async fn recover_outcomes(&self) -> usize {
        for held in self.shared.pending.all() {
            if let Err(e) = self.shared.store_held(&held).await {
                tracing::warn!(error = %e, key = %held.ticket.key.idem_key, "a journaled outcome is not stored yet; offering it again in the background");
                tokio::spawn(self.shared.clone().retry_held(held));
            }
        }
        self.shared.pending.len()
    }

    /// The metrics of every service this layer made.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.shared.config
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.shared.engine
    }

    /// The routes whose stale keys are reconciled (`expired_lease` or
    /// `outcome_unknown` is `"reconcile"`), by biz type: such keys need a
    /// result lookup.
    pub fn reconciling_biz_types(&self) -> impl Iterator<Item = &str> {
        self.shared
            .routes
            .all()
            .filter(|r| {
                r.policy.expired_lease == ExpiredLease::Reconcile
                    || r.policy.outcome_unknown == ExpiredLease::Reconcile
            })
            .map(|r| r.biz_type.as_str())
    }

    /// Every biz type a request can be given: the routes' and the
    /// defaults', once each.
    pub fn biz_types(&self) -> Vec<String> {
        self.config().biz_types()
    }

    /// Waits for every claimed request still in flight (including those
    /// whose client hung up) to store its outcome. Call at shutdown, after
    /// the server stopped taking requests.
    pub async fn finish(&self) {
        self.shared.tasks.close();
        self.shared.tasks.wait().await;
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Idempotency<S> {
        Idempotency {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] makes around `S`.
///
/// It never fails: every refusal, store failure or inner error is answered
/// with an RFC 9457 problem (see the README's "Problem types"). It is
/// always ready; the inner service's readiness is awaited per request, and
/// an inner service that cannot become ready is answered as "not sent"
/// (the key is released for a retry).
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency").finish_non_exhaustive()
    }
}

impl<S, B, ResB> Service<Request<B>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> ResponseFuture {
        let shared = self.shared.clone();
        let inner = self.inner.clone();
        let request = request.map(Body::new);
        ResponseFuture::new(async move { Ok(keyed::handle(shared, inner, request).await) })
    }
}
