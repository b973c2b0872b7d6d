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
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Uri, header, request};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

pub use config::{
    AnonymousMode, ConfigError, InProgressConfig, KeyRequirement, PolicyConfig, ProxyConfig, Route,
    RouteConfig, RouteTable, ServerErrors,
};
pub use forward::{UpstreamError, Verdict, classify_status};
pub use key::{IDEMPOTENCY_KEY, KeyHeaderError, ScopeError, derive_scope, parse_idempotency_key};
pub use metrics::Metrics;
pub use problem::{Problem, ProblemType};
pub use server::{ServeOptions, serve_with};

use crate::api::{BeginRequest, BodyKind, Completion, Decision, Disposition, Extension};
use crate::api::{InputField, InputRule, InvalidInput, Policy, Ticket};
use crate::engine::{Engine, Error};
use crate::store::Storage;
use crate::types::{Failure, RecordKey, StoredResponse, Success};
use forward::{BufferedResponse, Upstream};

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

/// What the handlers share.
struct Inner {
    engine: Engine,
    store: Arc<dyn Storage>,
    config: ProxyConfig,
    routes: RouteTable,
    upstream: Upstream,
    metrics: Metrics,
    /// Keyed requests in flight. Each runs as its own task, so that a
    /// client that hangs up never cuts a request between the upstream call
    /// and the stored outcome; shutdown waits for them.
    tasks: TaskTracker,
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

/// The proxy: its routers share one engine, one store and one set of
/// metrics. Cheap to clone.
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("upstream", &self.inner.upstream)
            .field("config", &self.inner.config)
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
        let routes = config.resolve()?;
        for route in routes.all() {
            let field = match route.index() {
                Some(i) => format!("routes[{i}]"),
                None => "defaults".into(),
            };
            if route.policy.expired_lease == crate::api::ExpiredLease::Reconcile {
                tracing::warn!(
                    "{field} (biz type '{}') uses expired_lease = \"reconcile\", but the proxy has no business lookup: a key whose lease expires stays blocked (answered 503) until an operator settles it; \"manual\" says so with 409 outcome-unknown",
                    route.biz_type
                );
            }
            match engine.reconcile(&route.biz_type, &route.policy, 0) {
                Ok(_) => {}
                Err(Error::Invalid(i)) => {
                    return Err(ConfigError::Invalid {
                        field,
                        message: i.message,
                    }
                    .into());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not check the policy of {field}");
                }
            }
        }
        let timeout = Duration::from_millis(config.upstream_timeout_ms);
        let upstream = Upstream::new(&upstream, timeout).map_err(ProxyError::Upstream)?;
        Ok(Proxy {
            inner: Arc::new(Inner {
                engine,
                store,
                config,
                routes,
                upstream,
                metrics: Metrics::new(),
                tasks: TaskTracker::new(),
            }),
        })
    }

    /// Waits for every keyed request still in flight (including those whose
    /// client hung up) to store its outcome. Call after [`serve`] returns.
    pub async fn finish(&self) {
        self.inner.tasks.close();
        self.inner.tasks.wait().await;
    }

    /// The proxy's router: every method and path.
    pub fn router(&self) -> Router {
        Router::new()
            .fallback(handle)
            .with_state(self.inner.clone())
    }

    /// The admin router: `GET /healthz` and `GET /metrics`.
    pub fn admin_router(&self) -> Router {
        admin::router(self.inner.clone())
    }

    /// The proxy's metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.inner.config
    }

    /// How [`serve_with`] should treat the proxy's clients, from the
    /// configuration.
    pub fn serve_options(&self) -> ServeOptions {
        ServeOptions {
            header_read_timeout: Duration::from_millis(self.inner.config.header_read_timeout_ms),
        }
    }

    /// Deletes expired keys in batches of `sweep_batch` until a batch
    /// deletes fewer; returns how many were deleted.
    ///
    /// # Errors
    ///
    /// The engine's error; the batches before it stay deleted.
    pub async fn sweep(&self) -> Result<u64, Error> {
        let batch = self.inner.config.sweep_batch;
        let mut total = 0u64;
        loop {
            let deleted = self.inner.blocking(move |e| e.sweep(batch)).await?;
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
        let interval = self.inner.config.sweep_interval_ms;
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
fn http_decision(decision: Decision) -> idem_http::Decision<Ticket, StoredResponse> {
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

/// `text` cut to at most `max` bytes at a character boundary.
fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// The most bytes read and discarded past the body limit before a 413.
const DRAIN_MAX_BYTES: u64 = 8 * 1024 * 1024;

/// The longest time spent discarding an oversized body.
const DRAIN_MAX_TIME: Duration = Duration::from_secs(5);

/// Reads and discards the rest of a body, within [`DRAIN_MAX_BYTES`] and
/// [`DRAIN_MAX_TIME`].
async fn drain(mut body: axum::body::Body) {
    let discard = async {
        let mut seen = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref() {
                seen = seen.saturating_add(u64::try_from(data.len()).unwrap_or(u64::MAX));
                if seen > DRAIN_MAX_BYTES {
                    return;
                }
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_MAX_TIME, discard).await;
}

async fn handle(State(inner): State<Arc<Inner>>, request: Request) -> Response {
    if config::is_safe_method(request.method()) {
        return inner.passthrough(request).await;
    }
    let route = inner
        .routes
        .find(request.method(), request.uri().path())
        .clone();
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        biz_type = %route.biz_type,
        scope = tracing::field::Empty,
    );
    // A task of its own: if the client hangs up, this handler is dropped,
    // but the claimed key is still forwarded once and its outcome stored.
    let task = {
        let inner = inner.clone();
        inner
            .tasks
            .clone()
            .spawn(async move { inner.keyed(request, route).await }.instrument(span))
    };
    match task.await {
        Ok(response) => response,
        Err(e) => {
            tracing::error!(error = %e, "a request task failed");
            Problem::from(idem_http::Problem::not_completed()).into_response()
        }
    }
}

impl Inner {
    /// Runs an engine call on a blocking thread; counts store errors.
    async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Engine) -> Result<R, Error> + Send + 'static,
    ) -> Result<R, Error> {
        let engine = self.engine.clone();
        let answer = match tokio::task::spawn_blocking(move || f(&engine)).await {
            Ok(answer) => answer,
            Err(e) => Err(Error::Trap(format!("the engine call did not finish: {e}"))),
        };
        if let Err(Error::Store(_)) = &answer {
            self.metrics.store_error();
        }
        answer
    }

    /// A refusal made by the proxy before asking the engine.
    fn refuse(&self, problem: impl Into<Problem>) -> Response {
        let problem = problem.into();
        self.metrics.request("invalid");
        tracing::info!(problem = problem.kind.slug(), "request refused");
        problem.into_response()
    }

    /// The answer to a request whose scope could not be derived.
    fn scope_problem(&self, e: &ScopeError) -> idem_http::Problem {
        if let ScopeError::NoClientAddress = e {
            tracing::error!(
                "anonymous = \"client-address\", but the request carries no connection address; serve the router with serve_with or with ConnectInfo<SocketAddr>"
            );
        }
        idem_http::Problem::scope(e, self.config.scope_header.as_deref())
    }

    /// Forwards a request that stores nothing.
    async fn passthrough(&self, request: Request) -> Response {
        self.metrics.request("passthrough");
        let (parts, body) = request.into_parts();
        let started = Instant::now();
        let answer = self.upstream.forward(&parts, body).await;
        self.metrics.upstream_duration(started.elapsed());
        match answer {
            Ok(response) => response,
            Err(e) => {
                tracing::warn!(error = %e, method = %parts.method, "upstream call failed");
                let problem = match e {
                    UpstreamError::Timeout => {
                        idem_http::Problem::passthrough_timeout(self.config.upstream_timeout_ms)
                    }
                    UpstreamError::NotSent(_) | UpstreamError::Failed(_) => {
                        idem_http::Problem::passthrough_unavailable()
                    }
                };
                Problem::from(problem).into_response()
            }
        }
    }

    /// A request that may carry a key.
    async fn keyed(&self, request: Request, route: Route) -> Response {
        let mut keys = request.headers().get_all(IDEMPOTENCY_KEY).iter();
        let key = match (keys.next(), keys.next()) {
            (None, _) => match route.key_requirement(request.method()) {
                KeyRequirement::Optional => return self.passthrough(request).await,
                KeyRequirement::Required => {
                    return self.refuse(idem_http::Problem::key_missing(request.method().as_str()));
                }
            },
            (Some(value), None) => match parse_idempotency_key(value) {
                Ok(key) => key,
                Err(e) => return self.refuse(idem_http::Problem::key_invalid(&e)),
            },
            (Some(_), Some(_)) => return self.refuse(idem_http::Problem::several_keys()),
        };
        let client = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(peer)| peer.ip());
        let scope = match derive_scope(
            request.headers(),
            self.routes.scope_header(),
            route.anonymous,
            client,
        ) {
            Ok(scope) => scope,
            Err(e) => return self.refuse(self.scope_problem(&e)),
        };
        tracing::Span::current().record("scope", scope.as_str());
        tracing::debug!(idempotency_key = %key, "key read");

        let kind = body_kind(request.headers());
        let (parts, mut body) = request.into_parts();
        let limit = self.config.max_body_bytes;
        let limit_usize = usize::try_from(limit).unwrap_or(usize::MAX);
        let too_large = || idem_http::Problem::body_too_large(u64::from(limit));
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let drain_cap = u64::from(limit).saturating_add(DRAIN_MAX_BYTES);
        if declared.is_some_and(|len| len > drain_cap) {
            // Too large even to read and discard: answer at once (the
            // connection is closed after the answer).
            return self.refuse(too_large());
        }
        let body_timeout = Duration::from_millis(self.config.body_read_timeout_ms);
        let read =
            tokio::time::timeout(body_timeout, Limited::new(&mut body, limit_usize).collect());
        let Ok(read) = read.await else {
            // A body that stops before its Content-Length (or trickles):
            // nothing was asked of the engine, nothing is stored.
            let mut response = self.refuse(idem_http::Problem::body_timeout(
                self.config.body_read_timeout_ms,
            ));
            response
                .headers_mut()
                .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
            return response;
        };
        let bytes = match read {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                // Read the rest without keeping it, so that a client that
                // sends the whole body before reading gets the answer.
                drain(body).await;
                return self.refuse(too_large());
            }
            Err(e) => {
                tracing::info!(error = %e, "the request body could not be read");
                return self.refuse(idem_http::Problem::body_unreadable());
            }
        };

        let path_and_query = parts
            .uri
            .path_and_query()
            .map(|pq| pq.as_str())
            .unwrap_or("/")
            .to_owned();
        let begin = BeginRequest {
            key: RecordKey::new(scope, route.biz_type.clone(), key),
            attributes: vec![
                ("method".to_owned(), parts.method.as_str().to_owned()),
                ("path".to_owned(), path_and_query),
            ],
            body_kind: kind,
            body: bytes.to_vec(),
            policy: route.policy.clone(),
        };
        let decision = match self.blocking(move |e| e.begin(&begin)).await {
            Ok(decision) => decision,
            Err(e) => {
                self.metrics.request("error");
                tracing::error!(error = %e, "the engine could not decide");
                return engine_error_problem(&e).into_response();
            }
        };
        self.metrics.request(decision.name());
        tracing::info!(decision = decision.name(), "decided");
        if let Decision::Mismatch(_) = decision {
            self.metrics.mismatch();
        }
        match idem_http::answer(http_decision(decision)) {
            idem_http::Answer::Execute(ticket) => self.execute(parts, bytes, ticket, &route).await,
            idem_http::Answer::Replay(stored) => self.replay(&stored),
            idem_http::Answer::Problem(problem) => Problem::from(problem).into_response(),
        }
    }

    /// An answer served from the store.
    fn replay(&self, stored: &StoredResponse) -> Response {
        self.metrics.replay();
        forward::from_stored(stored, true).unwrap_or_else(|| {
            tracing::error!(
                status = stored.status,
                "a stored response has an invalid status"
            );
            Problem::from(idem_http::Problem::not_replayable()).into_response()
        })
    }

    /// Runs the request once at the upstream and stores its outcome.
    async fn execute(
        &self,
        parts: request::Parts,
        body: Bytes,
        ticket: Ticket,
        route: &Route,
    ) -> Response {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let heartbeat = tokio::spawn(heartbeat(
            self.engine.clone(),
            self.metrics.clone(),
            ticket.clone(),
            route.policy.clone(),
            stopped,
        ));
        let started = Instant::now();
        let answer = self.upstream.forward_buffered(&parts, body).await;
        self.metrics.upstream_duration(started.elapsed());
        // Stop the heartbeat and wait for an extend in flight, so that it
        // never races the outcome below.
        let _ = stop.send(());
        let _ = heartbeat.await;

        let policy = &route.policy;
        match answer {
            Ok(response) => {
                self.settle_response(&ticket, policy, route.server_errors, &response)
                    .await;
                response.into_response()
            }
            Err(e) => {
                tracing::warn!(error = %e, "upstream call failed");
                let (code, disposition) = match &e {
                    UpstreamError::NotSent(_) => ("upstream-unavailable", Disposition::Retryable),
                    UpstreamError::Timeout => ("upstream-timeout", Disposition::OutcomeUnknown),
                    UpstreamError::Failed(_) => ("upstream-failed", Disposition::OutcomeUnknown),
                };
                let failure = Failure {
                    code: code.to_owned(),
                    message: truncate(&e.to_string(), 4096),
                    response: None,
                };
                self.settle(&ticket, policy, Outcome::Fail(failure, disposition))
                    .await;
                let problem = match e {
                    UpstreamError::NotSent(_) => idem_http::Problem::upstream_not_sent(),
                    UpstreamError::Timeout => {
                        idem_http::Problem::upstream_timed_out(self.config.upstream_timeout_ms)
                    }
                    UpstreamError::Failed(_) => idem_http::Problem::upstream_failed(),
                };
                Problem::from(problem).into_response()
            }
        }
    }

    /// Stores what the upstream's answer means for the key.
    async fn settle_response(
        &self,
        ticket: &Ticket,
        policy: &Policy,
        server_errors: ServerErrors,
        response: &BufferedResponse,
    ) {
        let stored = if response.storable() {
            Some(response.to_stored())
        } else {
            tracing::warn!(
                status = response.status.as_u16(),
                "the upstream response is larger than the store keeps; it is not stored"
            );
            None
        };
        let outcome = match forward::disposition(classify_status(response.status, server_errors)) {
            None => Outcome::Complete(Success {
                result_ref: None,
                response: stored,
            }),
            Some(disposition) => Outcome::Fail(
                Failure {
                    code: format!("http-{}", response.status.as_u16()),
                    message: format!("the upstream answered {}", response.status),
                    response: if disposition == Disposition::Final {
                        stored
                    } else {
                        None
                    },
                },
                disposition,
            ),
        };
        self.settle(ticket, policy, outcome).await;
    }

    /// Calls `complete` or `fail`. A response the engine refuses to store
    /// is dropped and the outcome stored without it.
    async fn settle(&self, ticket: &Ticket, policy: &Policy, outcome: Outcome) {
        let mut outcome = outcome;
        for _ in 0..2 {
            let (t, p, o) = (ticket.clone(), policy.clone(), outcome.clone());
            let answer = self
                .blocking(move |e| match &o {
                    Outcome::Complete(s) => e.complete(&t, &p, s),
                    Outcome::Fail(f, d) => e.fail(&t, &p, f, *d),
                })
                .await;
            match answer {
                Ok(Completion::Recorded) => {
                    tracing::info!(outcome = outcome.name(), "outcome stored");
                    return;
                }
                Ok(Completion::LostOwnership) => {
                    tracing::warn!(
                        "the key was taken over while the upstream ran; this outcome was discarded"
                    );
                    return;
                }
                Err(Error::Invalid(i)) if outcome.has_response() => {
                    tracing::warn!(error = %i, "the engine refused to store the response; storing the outcome without it");
                    outcome = outcome.without_response();
                }
                Err(e) => {
                    tracing::error!(error = %e, "the outcome could not be stored; the key stays in progress until its lease ends");
                    return;
                }
            }
        }
    }
}

/// An outcome to store.
#[derive(Debug, Clone)]
enum Outcome {
    Complete(Success),
    Fail(Failure, Disposition),
}

impl Outcome {
    fn name(&self) -> &'static str {
        match self {
            Outcome::Complete(_) => "succeeded",
            Outcome::Fail(_, Disposition::Final) => "failed",
            Outcome::Fail(_, Disposition::Retryable) => "released",
            Outcome::Fail(_, Disposition::OutcomeUnknown) => "outcome-unknown",
        }
    }

    fn has_response(&self) -> bool {
        match self {
            Outcome::Complete(s) => s.response.is_some(),
            Outcome::Fail(f, _) => f.response.is_some(),
        }
    }

    fn without_response(self) -> Outcome {
        match self {
            Outcome::Complete(s) => Outcome::Complete(Success {
                response: None,
                ..s
            }),
            Outcome::Fail(f, d) => Outcome::Fail(
                Failure {
                    response: None,
                    ..f
                },
                d,
            ),
        }
    }
}

/// Extends the lease every half lease until stopped or ownership is lost.
async fn heartbeat(
    engine: Engine,
    metrics: Metrics,
    ticket: Ticket,
    policy: Policy,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let period = Duration::from_millis((policy.lease_ms / 2).max(1));
    loop {
        tokio::select! {
            _ = &mut stop => return,
            () = tokio::time::sleep(period) => {}
        }
        let (e, t, p) = (engine.clone(), ticket.clone(), policy.clone());
        match tokio::task::spawn_blocking(move || e.extend(&t, &p)).await {
            Ok(Ok(Extension::Extended(until))) => {
                tracing::debug!(lease_until = until, "lease extended");
            }
            Ok(Ok(Extension::LostOwnership)) => {
                tracing::warn!("the lease could not be extended: the key was taken over");
                return;
            }
            Ok(Err(e)) => {
                if let Error::Store(_) = e {
                    metrics.store_error();
                }
                tracing::warn!(error = %e, "the lease could not be extended");
            }
            Err(_) => return,
        }
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

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcdef", 3), "abc");
        assert_eq!(truncate("aé", 2), "a");
    }
}
