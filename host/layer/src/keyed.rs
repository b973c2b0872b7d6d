//! One request through the layer: key, scope, body, decision, and for
//! `execute` the inner call, the heartbeat and the stored outcome.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::response::IntoResponse;
use http::{Request, Response, header, request};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower::{Service, ServiceExt};
use tracing::Instrument;

use super::body::{BufferedResponse, DRAIN_MAX_BYTES, drain, truncate};
use super::detach::{Detach, Panicked};
use super::pending::{FIRST_RETRY, Held, Outcome, backoff};
use super::{BoxError, Claim, InnerFailure, Shared};
use crate::config::is_safe_method;
use crate::config::{KeyRequirement, Route, ServerErrors};
use crate::key::{IDEMPOTENCY_KEY, ScopeError, derive_scope, parse_idempotency_key};
use crate::problem::Problem;
use crate::response::classify_status;
use crate::response::{closing, disposition, from_stored};
use crate::rules::{body_kind, engine_error_problem, http_decision};
use idem_engine::api::{
    BeginRequest, Completion, Decision, Disposition, Extension, InProgressMode, Policy, Ticket,
};
use idem_engine::engine::{Engine, Error};
use idem_engine::types::{Failure, RecordKey, StoredResponse, Success};

/// The longest failure message stored with a key.
const MAX_FAILURE_MESSAGE_BYTES: usize = 4096;

/// How many times an outcome is offered to the store when the engine
/// refuses the response it carries: once with it, once without.
const SETTLE_TRIES: usize = 2;

/// Answers one request.
pub(super) async fn handle<S, ResB>(
    shared: Arc<Shared>,
    inner: S,
    request: Request<Body>,
) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    if is_safe_method(request.method()) {
        return shared.passthrough(inner, request).await;
    }
    let route = shared
        .routes
        .find(request.method(), request.uri().path())
        .clone();
    // A DEBUG span, as tower-http's `TraceLayer` makes by default: at
    // INFO (`idem serve`'s default) an enabled span per request, entered on
    // every poll, cost 8-10 us of CPU per replay, 13-22 % of the replays'
    // rate at 32 connections, for lines that only warnings and errors
    // print. Those name their request's key themselves.
    let span = tracing::debug_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        biz_type = %route.biz_type,
        scope = tracing::field::Empty,
    );
    // The request runs on this task, and on a task of its own only if the
    // client hangs up before it finished (`Detach`): once claimed, a key
    // is run once and its outcome stored whatever the client does. The
    // tracker lets `IdempotencyLayer::finish` wait for it either way.
    let request = shared
        .tasks
        .track_future(shared.clone().keyed(inner, request, route))
        .instrument(span);
    detached(Detach::new(request).await)
}

/// The answer of a request; one that panicked is answered as not
/// completed.
fn detached(answer: Result<Response<Body>, Panicked>) -> Response<Body> {
    answer.unwrap_or_else(|Panicked(message)| {
        tracing::error!(panic = %message, "a request panicked");
        Problem::from(idem_http::Problem::not_completed()).into_response()
    })
}

/// The request's key: `None` when it has none and its route lets it pass
/// without one; the problem when it is missing, invalid or repeated.
fn key_of(request: &Request<Body>, route: &Route) -> Result<Option<String>, idem_http::Problem> {
    let mut keys = request.headers().get_all(IDEMPOTENCY_KEY).iter();
    match (keys.next(), keys.next()) {
        (None, _) => match route.key_requirement(request.method()) {
            KeyRequirement::Optional => Ok(None),
            KeyRequirement::Required => {
                Err(idem_http::Problem::key_missing(request.method().as_str()))
            }
        },
        (Some(value), None) => parse_idempotency_key(value)
            .map(Some)
            .map_err(|e| idem_http::Problem::key_invalid(&e)),
        (Some(_), Some(_)) => Err(idem_http::Problem::several_keys()),
    }
}

/// The request's `Content-Length`, when it has a valid one.
fn declared_length(parts: &request::Parts) -> Option<u64> {
    parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
}

/// `response`, to a request whose body was not read to its end.
///
/// The answer goes at once, and the body is read and discarded after it
/// on a task of its own ([`drain`], which nginx calls discarding the
/// request body), so that the connection carries the client's next
/// request. When it will not be read (the client waits for
/// `100 Continue`, or declares more than [`DRAIN_MAX_BYTES`]) the answer
/// says `Connection: close`. Without one or the other, hyper would answer
/// with keep-alive and then close the connection on finding the body
/// unread: a client that pooled the connection would lose its next
/// request, with nothing sent back.
fn unread(parts: &request::Parts, body: Body, response: Response<Body>) -> Response<Body> {
    if http_body::Body::is_end_stream(&body) {
        return response;
    }
    let waits_for_continue = parts
        .headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if waits_for_continue || declared_length(parts).is_some_and(|n| n > DRAIN_MAX_BYTES) {
        return closing(response);
    }
    tokio::spawn(drain(body));
    response
}

/// Calls the inner service once it is ready.
async fn call<S, ResB>(inner: S, request: Request<Body>) -> Result<Response<ResB>, InnerFailure>
where
    S: Service<Request<Body>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
{
    let ready = inner.ready_oneshot().await.map_err(|e| {
        let e: BoxError = e.into();
        InnerFailure::NotSent(super::error::error_chain(&*e))
    })?;
    ready
        .oneshot(request)
        .await
        .map_err(|e| InnerFailure::from_call_error(e.into()))
}

impl Shared {
    /// True when `begin` under `policy` runs on the request's own thread:
    /// the store answers in microseconds and the policy never makes the
    /// engine wait for another request (`in_progress = "wait"` polls,
    /// which would hold the thread that other requests, the first one's
    /// included, need), and no write would now wait for other callers'
    /// writes ([`Engine::write_would_wait`]: with group commit, a claim
    /// that waits on a blocking thread joins the next group, while one
    /// that waited here would keep this thread's other requests, and
    /// their writes, out of it).
    fn on_thread(&self, policy: &Policy) -> bool {
        self.settle_on_thread() && matches!(policy.in_progress, InProgressMode::Reject)
    }

    /// True when a call other than `begin` runs on the request's own
    /// thread: the store answers in microseconds and no write would wait
    /// for other callers' writes now.
    fn settle_on_thread(&self) -> bool {
        self.inline && !self.engine.write_would_wait()
    }

    /// Runs an engine call: on this thread when `on_thread` (see
    /// [`Shared::on_thread`]; calls other than `begin` never wait, so they
    /// pass [`Shared::inline`]), else on tokio's blocking pool. Counts
    /// store errors.
    pub(crate) async fn engine_call<R: Send + 'static>(
        &self,
        on_thread: bool,
        f: impl FnOnce(&Engine) -> Result<R, Error> + Send + 'static,
    ) -> Result<R, Error> {
        let answer = if on_thread {
            f(&self.engine)
        } else {
            let engine = self.engine.clone();
            match tokio::task::spawn_blocking(move || f(&engine)).await {
                Ok(answer) => answer,
                Err(e) => Err(Error::Trap(format!("the engine call did not finish: {e}"))),
            }
        };
        if let Err(Error::Store(_)) = &answer {
            self.metrics.store_error();
        }
        answer
    }

    /// A refusal made before asking the engine.
    fn refuse(&self, problem: impl Into<Problem>) -> Response<Body> {
        let problem = problem.into();
        self.metrics.request("invalid");
        tracing::debug!(problem = problem.kind.slug(), "request refused");
        problem.into_response()
    }

    /// A refusal made before the request's body was read: see [`unread`].
    fn refuse_unread(&self, request: Request<Body>, problem: impl Into<Problem>) -> Response<Body> {
        let (parts, body) = request.into_parts();
        unread(&parts, body, self.refuse(problem))
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

    /// The answer to a request the inner service failed, when it stores
    /// nothing.
    fn passthrough_problem(&self, failure: &InnerFailure) -> idem_http::Problem {
        match failure {
            InnerFailure::Timeout => {
                idem_http::Problem::passthrough_timeout(self.config.upstream_timeout_ms)
            }
            InnerFailure::NotSent(_) | InnerFailure::Failed(_) => {
                idem_http::Problem::passthrough_unavailable()
            }
        }
    }

    /// Passes a request that stores nothing to the inner service.
    async fn passthrough<S, ResB>(&self, inner: S, request: Request<Body>) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<ResB>>,
        S::Error: Into<BoxError>,
        ResB: http_body::Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        self.metrics.request("passthrough");
        let method = request.method().clone();
        let started = Instant::now();
        let answer = call(inner, request).await;
        self.metrics.upstream_duration(started.elapsed());
        match answer {
            Ok(response) => response.map(Body::new),
            Err(e) => {
                tracing::warn!(error = %e, %method, "upstream call failed");
                Problem::from(self.passthrough_problem(&e)).into_response()
            }
        }
    }

    /// A request that may carry a key.
    async fn keyed<S, ResB>(
        self: Arc<Self>,
        inner: S,
        request: Request<Body>,
        route: Route,
    ) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<ResB>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
        ResB: http_body::Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        let key = match key_of(&request, &route) {
            Ok(Some(key)) => key,
            Ok(None) => return self.passthrough(inner, request).await,
            Err(problem) => return self.refuse_unread(request, problem),
        };
        let client = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(peer)| peer.ip());
        let scope = derive_scope(
            request.headers(),
            self.routes.scope_header(),
            route.anonymous,
            client,
        );
        let scope = match scope {
            Ok(scope) => scope,
            Err(e) => {
                let problem = self.scope_problem(&e);
                return self.refuse_unread(request, problem);
            }
        };
        tracing::Span::current().record("scope", scope.as_str());
        tracing::debug!(idempotency_key = %key, "key read");

        let kind = body_kind(request.headers());
        let (parts, body) = request.into_parts();
        let bytes = match self.read_body(&parts, body).await {
            Ok(bytes) => bytes,
            Err(response) => return *response,
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
        // An outcome of this key that the store has not taken yet goes
        // first: the request it answered must not run again.
        if let Some(held) = self.pending.get(&begin.key)
            && let Err(e) = self.store_held(&held).await
        {
            self.metrics.request("error");
            tracing::error!(error = %e, biz_type = %begin.key.biz_type, idempotency_key = %begin.key.idem_key, "an earlier outcome of this key is still not stored; the request waits");
            return engine_error_problem(&e).into_response();
        }
        let on_thread = self.on_thread(&route.policy);
        let decision = match self.engine_call(on_thread, move |e| e.begin(&begin)).await {
            Ok(decision) => decision,
            Err(e) => {
                self.metrics.request("error");
                tracing::error!(error = %e, method = %parts.method, path = parts.uri.path(), biz_type = %route.biz_type, "the engine could not decide");
                return engine_error_problem(&e).into_response();
            }
        };
        self.metrics.request(decision.name());
        tracing::debug!(decision = decision.name(), "decided");
        if let Decision::Mismatch(_) = decision {
            self.metrics.mismatch();
        }
        match idem_http::answer(http_decision(decision)) {
            idem_http::Answer::Execute(ticket) => {
                self.execute(inner, parts, bytes, ticket, &route).await
            }
            idem_http::Answer::Replay(stored) => self.replay(&stored),
            idem_http::Answer::Problem(problem) => Problem::from(problem).into_response(),
        }
    }

    /// Reads a keyed request's body within `max_body_bytes` and
    /// `body_read_timeout_ms`; the refusal when it cannot.
    async fn read_body(
        &self,
        parts: &request::Parts,
        mut body: Body,
    ) -> Result<Bytes, Box<Response<Body>>> {
        let limit = self.config.max_body_bytes;
        let limit_usize = usize::try_from(limit).unwrap_or(usize::MAX);
        let too_large = || idem_http::Problem::body_too_large(u64::from(limit));
        let drain_cap = u64::from(limit).saturating_add(DRAIN_MAX_BYTES);
        if declared_length(parts).is_some_and(|len| len > drain_cap) {
            // Too large even to read and discard: answer at once, and
            // close the connection after the answer.
            return Err(Box::new(closing(self.refuse(too_large()))));
        }
        let body_timeout = Duration::from_millis(self.config.body_read_timeout_ms);
        let read =
            tokio::time::timeout(body_timeout, Limited::new(&mut body, limit_usize).collect());
        let Ok(read) = read.await else {
            // A body that stops before its Content-Length (or trickles):
            // nothing was asked of the engine, nothing is stored.
            let response = self.refuse(idem_http::Problem::body_timeout(
                u64::try_from(body_timeout.as_millis()).unwrap_or(u64::MAX),
            ));
            return Err(Box::new(closing(response)));
        };
        match read {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                Err(Box::new(unread(parts, body, self.refuse(too_large()))))
            }
            Err(e) => {
                tracing::debug!(error = %e, "the request body could not be read");
                let response = self.refuse(idem_http::Problem::body_unreadable());
                Err(Box::new(closing(response)))
            }
        }
    }

    /// An answer served from the store.
    fn replay(&self, stored: &StoredResponse) -> Response<Body> {
        self.metrics.replay();
        from_stored(stored, true).unwrap_or_else(|| {
            tracing::error!(
                status = stored.status,
                "a stored response has an invalid status"
            );
            Problem::from(idem_http::Problem::not_replayable()).into_response()
        })
    }

    /// Runs the request once in the inner service and stores its outcome.
    async fn execute<S, ResB>(
        self: &Arc<Self>,
        inner: S,
        parts: request::Parts,
        body: Bytes,
        ticket: Ticket,
        route: &Route,
    ) -> Response<Body>
    where
        S: Service<Request<Body>, Response = Response<ResB>>,
        S::Error: Into<BoxError>,
        ResB: http_body::Body<Data = Bytes> + Send + 'static,
        ResB::Error: Into<BoxError>,
    {
        let mut request = Request::from_parts(parts, Body::from(body));
        request.extensions_mut().insert(Claim {
            ticket: ticket.clone(),
        });
        let started = Instant::now();
        let work = async {
            match call(inner, request).await {
                Ok(response) => BufferedResponse::read(response)
                    .await
                    .map_err(InnerFailure::from_body_error),
                Err(e) => Err(e),
            }
        };
        let answer = self.with_heartbeat(&ticket, &route.policy, work).await;
        self.metrics.upstream_duration(started.elapsed());

        let policy = &route.policy;
        match answer {
            Ok(response) => {
                let outcome = outcome_of(&response, route.server_errors);
                self.settle(&ticket, policy, outcome).await;
                response.into_response()
            }
            Err(e) => {
                tracing::warn!(error = %e, biz_type = %ticket.key.biz_type, idempotency_key = %ticket.key.idem_key, "upstream call failed");
                let failure = Failure {
                    code: e.code().to_owned(),
                    message: truncate(&e.to_string(), MAX_FAILURE_MESSAGE_BYTES),
                    response: None,
                };
                self.settle(&ticket, policy, Outcome::Fail(failure, e.disposition()))
                    .await;
                Problem::from(self.execute_problem(&e)).into_response()
            }
        }
    }

    /// The answer to the caller whose claimed request the inner service
    /// failed.
    fn execute_problem(&self, failure: &InnerFailure) -> idem_http::Problem {
        match failure {
            InnerFailure::NotSent(_) => idem_http::Problem::upstream_not_sent(),
            InnerFailure::Timeout => {
                idem_http::Problem::upstream_timed_out(self.config.upstream_timeout_ms)
            }
            InnerFailure::Failed(_) => idem_http::Problem::upstream_failed(),
        }
    }

    /// Stores a claimed request's outcome. One the store does not take is
    /// held (see [`super::pending`]) and offered again until it does.
    async fn settle(self: &Arc<Self>, ticket: &Ticket, policy: &Policy, outcome: Outcome) {
        let held = Held {
            ticket: ticket.clone(),
            policy: policy.clone(),
            outcome,
        };
        let e = match self.store_outcome(&held).await {
            Ok(()) => return,
            // Refused for what it is: offering it again cannot help.
            Err(e @ Error::Invalid(_)) => {
                tracing::error!(error = %e, biz_type = %ticket.key.biz_type, idempotency_key = %ticket.key.idem_key, "the engine refused the outcome; the key stays in progress until its lease ends");
                return;
            }
            Err(e) => e,
        };
        tracing::error!(error = %e, biz_type = %ticket.key.biz_type, idempotency_key = %ticket.key.idem_key, "the outcome could not be stored; it is held and offered again until the store takes it");
        if let Err(j) = self.pending.hold(held.clone()) {
            tracing::error!(error = %j, biz_type = %ticket.key.biz_type, idempotency_key = %ticket.key.idem_key, "the held outcome could not be written to the journal; it is kept in memory only");
        }
        self.metrics.pending_outcomes(self.pending.len());
        let shared = self.clone();
        tokio::spawn(async move { shared.retry_held(held).await });
    }

    /// Offers `held` to the store with growing pauses until it is stored,
    /// or until another path stored it or a newer outcome replaced it.
    pub(crate) async fn retry_held(self: Arc<Self>, held: Held) {
        let mut pause = FIRST_RETRY;
        while self.pending.get(&held.ticket.key).as_ref() == Some(&held) {
            tokio::time::sleep(pause).await;
            if self.store_held(&held).await.is_ok() {
                return;
            }
            pause = backoff(pause);
        }
    }

    /// Stores a held outcome and forgets it.
    pub(crate) async fn store_held(&self, held: &Held) -> Result<(), Error> {
        self.store_outcome(held).await?;
        if let Err(j) = self.pending.settled(held) {
            tracing::error!(error = %j, "a stored outcome could not be removed from the journal; it will be offered again, which is harmless");
        }
        self.metrics.pending_outcomes(self.pending.len());
        Ok(())
    }

    /// Calls `complete` or `fail`. A response the engine refuses to store
    /// is dropped and the outcome stored without it. A key taken over
    /// meanwhile counts as done: the store holds the new owner's outcome.
    async fn store_outcome(&self, held: &Held) -> Result<(), Error> {
        let mut outcome = held.outcome.clone();
        for _ in 0..SETTLE_TRIES {
            let (t, p, o) = (held.ticket.clone(), held.policy.clone(), outcome.clone());
            let answer = self
                .engine_call(self.settle_on_thread(), move |e| match &o {
                    Outcome::Complete(s) => e.complete(&t, &p, s),
                    Outcome::Fail(f, d) => e.fail(&t, &p, f, *d),
                })
                .await;
            match answer {
                Ok(Completion::Recorded(_)) => {
                    tracing::debug!(outcome = outcome.name(), "outcome stored");
                    return Ok(());
                }
                Ok(Completion::LostOwnership) => {
                    tracing::warn!(
                        biz_type = %held.ticket.key.biz_type,
                        idempotency_key = %held.ticket.key.idem_key,
                        "the key was taken over while the upstream ran; this outcome was discarded"
                    );
                    return Ok(());
                }
                Err(Error::Invalid(i)) if outcome.has_response() => {
                    tracing::warn!(error = %i, biz_type = %held.ticket.key.biz_type, idempotency_key = %held.ticket.key.idem_key, "the engine refused to store the response; storing the outcome without it");
                    outcome = outcome.without_response();
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::Corrupt(
            "the engine refused the outcome with and without its response".to_owned(),
        ))
    }
}

/// What the inner service's answer means for the key.
fn outcome_of(response: &BufferedResponse, server_errors: ServerErrors) -> Outcome {
    let stored = if response.storable() {
        Some(response.to_stored())
    } else {
        tracing::warn!(
            status = response.status.as_u16(),
            "the response is larger than the store keeps; it is not stored"
        );
        None
    };
    match disposition(classify_status(response.status, server_errors)) {
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
    }
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

impl Shared {
    /// Runs `work` while extending the key's lease every half lease (the
    /// heartbeat), on this task: no task and no channel per request. An
    /// extend in flight when `work` finishes is waited for, so that it
    /// never races the outcome stored next. The heartbeat stops when the
    /// key was taken over.
    async fn with_heartbeat<T>(
        &self,
        ticket: &Ticket,
        policy: &Policy,
        work: impl Future<Output = T>,
    ) -> T {
        let period = Duration::from_millis((policy.lease_ms / 2).max(1));
        let beat = tokio::time::sleep(period);
        tokio::pin!(work, beat);
        let mut extending: Extending<'_> = None;
        let mut beating = true;
        loop {
            tokio::select! {
                biased;
                output = &mut work => {
                    if let Some(extend) = extending.take() {
                        log_extension(ticket, extend.await);
                    }
                    return output;
                }
                answer = in_flight(&mut extending), if extending.is_some() => {
                    extending = None;
                    beating = log_extension(ticket, answer);
                    beat.as_mut().reset(tokio::time::Instant::now() + period);
                }
                () = &mut beat, if beating && extending.is_none() => {
                    let (t, p) = (ticket.clone(), policy.clone());
                    extending = Some(Box::pin(
                        self.engine_call(self.settle_on_thread(), move |e| e.extend(&t, &p)),
                    ));
                }
            }
        }
    }
}

/// An extend in flight.
type Extending<'a> = Option<Pin<Box<dyn Future<Output = Result<Extension, Error>> + Send + 'a>>>;

/// The answer of the extend in flight; never, when there is none.
async fn in_flight(extending: &mut Extending<'_>) -> Result<Extension, Error> {
    match extending {
        Some(extend) => extend.as_mut().await,
        None => std::future::pending().await,
    }
}

/// Logs what an extend did; false once the key was taken over (the
/// heartbeat stops).
fn log_extension(ticket: &Ticket, answer: Result<Extension, Error>) -> bool {
    let key = &ticket.key;
    match answer {
        Ok(Extension::Extended(until)) => {
            tracing::debug!(lease_until = until, "lease extended");
            true
        }
        Ok(Extension::LostOwnership) => {
            tracing::warn!(biz_type = %key.biz_type, idempotency_key = %key.idem_key, "the lease could not be extended: the key was taken over");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, biz_type = %key.biz_type, idempotency_key = %key.idem_key, "the lease could not be extended");
            true
        }
    }
}
