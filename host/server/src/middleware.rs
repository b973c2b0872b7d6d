//! `idem serve-component`: serves a `wasi:http` component built on idem's
//! `middleware` world (the middleware composed with a handler) over HTTP,
//! with idem's storage.
//!
//! `wasmtime serve` cannot run such a component: it supplies only the
//! `wasi:http/proxy` imports, and the middleware also imports idem's
//! `store`, `clock` and `results` and the small `http-bridge` interface.
//! This host supplies all of them: WASI and `wasi:http` from
//! `wasmtime-wasi` and `wasmtime-wasi-http`, the store from any
//! [`Storage`], and the bridge from here.
//!
//! It is configured as `idem serve` is, from the same [`ProxyConfig`]:
//!
//! - the guest is bounded as the engine is ([`idem_engine::bounds`]): the same
//!   Wasmtime configuration (epoch interruption and its ticker), the same
//!   deadline (`guest_deadline_ms`, per request, time in host calls not
//!   counted) and the same memory cap (`guest_memory_bytes`, all the
//!   component's memories together). A request whose component runs past
//!   either is answered `500` and its instance discarded; the server goes
//!   on serving;
//! - each request gets the route its method and path match in `[[routes]]`
//!   (or `[defaults]`): its biz type, policy, key requirement, `anonymous`
//!   mode and `server_errors`, with the configured `scope_header`, through
//!   `http-bridge.request-route`.
//!
//! Each request gets a fresh instance (as `wasmtime serve` does), so the
//! store, never the instance, carries state between requests. The whole
//! request body is read before the component runs, up to
//! [`MAX_REQUEST_BODY_BYTES`].
//!
//! # Threads
//!
//! The instance runs as a task of the async runtime, with Wasmtime's async
//! API, as `wasi:http` requires; the store calls never run on the
//! runtime's worker threads. Each call of idem's `store`, `clock.pause` and
//! `results` imports is an async import that hands the blocking call to
//! the runtime's blocking thread pool (`blocking`) and suspends the
//! instance until it returns. That is the same pool `idem serve` runs its
//! engine calls on, so every [`Storage`] works here as it does there,
//! including the PostgreSQL store, whose blocking client runs a runtime of
//! its own and cannot be called from a worker thread. The other designs
//! were worse: running the whole instance on a blocking thread (with a
//! runtime of its own, or `block_on`) would hold a thread for as long as a
//! client takes to read its response, and still need the store calls to
//! leave that thread's runtime; `block_in_place` in a synchronous import
//! would take a worker out of the runtime on every store call, and panic
//! on a current-thread runtime. Between two host calls the guest computes
//! on a worker, as every `wasi:http` host runs it, but it yields to the
//! runtime at every epoch tick (`idem_engine::bounds::Flavor::Async`), so a
//! guest that loops holds no worker for its whole deadline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Request, State as AxumState};
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Method, header};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use wasmtime::component::{Component, HasSelf, Linker, Resource, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};
use wasmtime_wasi_http::p2::bindings::ProxyPre;
use wasmtime_wasi_http::p2::bindings::http::types::{ErrorCode, Scheme};
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;
use wasmtime_wasi_http::p2::types::{HostIncomingRequest, HostResponseOutparam};
use wasmtime_wasi_http::{WasiBody, WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView};

use idem_engine::bindings::{Conv, wit_types};
use idem_engine::bounds::{Flavor, Guard, GuestBounds, Stopped};
use idem_engine::clock::Clock;
use idem_engine::engine::{NoLookup, ResultLookup};
use idem_engine::{store::StaleCursor, store::Storage, store::StoreError, types};
use idem_layer::response::closing;

use crate::proxy::config::{
    AnonymousMode, ConfigError, KeyRequirement, ProxyConfig, RouteTable, ServerErrors,
};
use crate::proxy::{Problem, ProblemType, ServeOptions};

/// The middleware component built from `guest/` with its `middleware`
/// feature by `build.rs`: compose it with a handler (`idem compose`).
pub const MIDDLEWARE_GUEST: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/idem_middleware.wasm"));

/// The largest request body the host reads before running the component:
/// 16 MiB, over the engine's largest stored body, so any body a policy can
/// fingerprint fits. Larger requests are refused with 413 before the
/// component runs.
pub const MAX_REQUEST_BODY_BYTES: usize = 16 * 1024 * 1024;

/// The largest response body a capture keeps: 64 MiB. A wrapped handler
/// that writes more gets an error from `finish`; its key is then settled as
/// outcome-unknown by the middleware.
pub const MAX_CAPTURED_BODY_BYTES: usize = 64 * 1024 * 1024;

/// How long `response-capture.finish` waits for the wrapped handler to
/// finish its response body after it returned: a handler that returned
/// has normally finished already, so a few seconds only cover a slow
/// writer task.
pub const CAPTURE_FINISH_TIMEOUT: Duration = Duration::from_secs(5);

mod bridge {
    //! Host bindings of the `middleware` world's imports beyond WASI and
    //! `wasi:http`: idem's `store`, `clock` and `results` as async imports
    //! (see the module docs, "Threads"), and `http-bridge`. The records
    //! are the engine bindings' own, so the engine's conversions apply.
    #![allow(missing_docs)]
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "middleware",
        imports: { default: async | trappable },
        with: {
            "wasi:http/types": wasmtime_wasi_http::p2::bindings::http::types,
            "wasi:io": wasmtime_wasi::p2::bindings::io,
            "wasi:clocks": wasmtime_wasi::p2::bindings::clocks,
            "idem:engine/types": idem_engine::bindings::idem::engine::types,
            "idem:engine/http-bridge.response-capture": super::Capture,
        },
    });
}

use bridge::idem::engine::http_bridge::{self, BodyError};
use bridge::idem::engine::{clock as wit_clock, results as wit_results, store as wit_store};

/// A `response-capture`: the outparam handed to the wrapped handler, and
/// the task that collects what the handler sets.
pub struct Capture {
    outparam: Option<Resource<HostResponseOutparam>>,
    collected: Option<tokio::task::JoinHandle<Result<wit_types::StoredResponse, String>>>,
}

/// The `wasi:http` hooks of a served component: outgoing requests are
/// refused. The middleware and the handlers it wraps answer from the store
/// and their own logic, and no TLS client is linked in.
struct DenyOutgoing;

/// What `send_request` answers: a future of the response, or the error.
type SendFuture = Box<
    dyn std::future::Future<
            Output = wasmtime_wasi_http::Result<(
                http::Response<WasiBody>,
                Box<dyn std::future::Future<Output = wasmtime_wasi_http::Result<()>> + Send>,
            )>,
        > + Send,
>;

impl WasiHttpHooks for DenyOutgoing {
    fn send_request(
        &mut self,
        _request: http::Request<WasiBody>,
        _options: Option<wasmtime_wasi_http::RequestOptions>,
        _fut: Box<dyn std::future::Future<Output = wasmtime_wasi_http::Result<()>> + Send>,
    ) -> SendFuture {
        Box::new(async { Err(wasmtime_wasi_http::Error::HttpRequestDenied) })
    }
}

/// The request the host made for one call, and what the bridge tells the
/// component about it.
struct Call {
    /// The `incoming-request` resource's handle.
    rep: u32,
    /// Its whole body.
    body: Bytes,
    /// Its route.
    route: http_bridge::Route,
    /// The client's address, as `client-address` gives it.
    client: Option<String>,
}

/// What one instance's imports reach.
struct State {
    wasi: WasiCtx,
    http: WasiHttpCtx,
    hooks: DenyOutgoing,
    table: ResourceTable,
    storage: Arc<dyn Storage>,
    clock: Arc<dyn Clock>,
    results: Arc<dyn ResultLookup>,
    /// The memory cap and this request's budget of guest time.
    guard: Guard,
    call: Option<Call>,
}

impl State {
    /// The call `request` belongs to, when it is the host's request.
    fn call(&self, request: &Resource<HostIncomingRequest>) -> Option<&Call> {
        self.call.as_ref().filter(|c| c.rep == request.rep())
    }
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl WasiHttpView for State {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: &mut self.hooks,
        }
    }
}

/// Runs `call`, a blocking call of a store, a clock or a result lookup, on
/// the async runtime's blocking thread pool and waits for it without
/// holding a worker thread (see the module docs, "Threads"). A call that
/// panicked is a store error, never a trap: the middleware answers it as
/// the store being unavailable.
async fn blocking<R: Send + 'static>(
    call: impl FnOnce() -> Result<R, StoreError> + Send + 'static,
) -> Result<R, StoreError> {
    tokio::task::spawn_blocking(call)
        .await
        .unwrap_or_else(|e| Err(StoreError::Internal(format!("the store call failed: {e}"))))
}

impl From<StoreError> for wit_store::StoreError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Unavailable(m) => wit_store::StoreError::Unavailable(m),
            StoreError::Rejected(m) => wit_store::StoreError::Rejected(m),
            StoreError::Internal(m) => wit_store::StoreError::Internal(m),
        }
    }
}

impl From<wit_store::StaleCursor> for StaleCursor {
    fn from(c: wit_store::StaleCursor) -> Self {
        StaleCursor {
            updated_at: c.updated_at,
            id: c.id,
        }
    }
}

impl From<types::InsertOutcome> for wit_store::InsertOutcome {
    fn from(o: types::InsertOutcome) -> Self {
        match o {
            types::InsertOutcome::Inserted(r) => wit_store::InsertOutcome::Inserted(r.conv()),
            types::InsertOutcome::Existing(r) => wit_store::InsertOutcome::Existing(r.conv()),
        }
    }
}

impl From<types::SwapOutcome> for wit_store::SwapOutcome {
    fn from(o: types::SwapOutcome) -> Self {
        match o {
            types::SwapOutcome::Swapped => wit_store::SwapOutcome::Swapped,
            types::SwapOutcome::Stale(r) => wit_store::SwapOutcome::Stale(r.conv()),
        }
    }
}

/// What a store import answers the component.
type StoreAnswer<T> = wasmtime::Result<Result<T, wit_store::StoreError>>;

impl wit_store::Host for State {
    async fn insert_if_absent(
        &mut self,
        candidate: wit_types::StoredRecord,
    ) -> StoreAnswer<wit_store::InsertOutcome> {
        let storage = self.storage.clone();
        let answer = blocking(move || storage.insert_if_absent(&candidate.conv())).await;
        Ok(answer.map(Into::into).map_err(Into::into))
    }

    async fn get(
        &mut self,
        key: wit_types::RecordKey,
    ) -> StoreAnswer<Option<wit_types::StoredRecord>> {
        let storage = self.storage.clone();
        let answer = blocking(move || storage.get(&key.conv())).await;
        Ok(answer.map(Conv::conv).map_err(Into::into))
    }

    async fn compare_and_swap(
        &mut self,
        expected_revision: u64,
        replacement: wit_types::StoredRecord,
    ) -> StoreAnswer<wit_store::SwapOutcome> {
        let storage = self.storage.clone();
        let answer =
            blocking(move || storage.compare_and_swap(expected_revision, &replacement.conv()))
                .await;
        Ok(answer.map(Into::into).map_err(Into::into))
    }

    async fn delete_expired(&mut self, now: u64, limit: u32) -> StoreAnswer<u32> {
        let storage = self.storage.clone();
        let answer = blocking(move || storage.delete_expired(now, limit)).await;
        Ok(answer.map_err(Into::into))
    }

    async fn list_stale(
        &mut self,
        biz_type: String,
        now: u64,
        after: Option<wit_store::StaleCursor>,
        limit: u32,
    ) -> StoreAnswer<Vec<wit_types::StoredRecord>> {
        let storage = self.storage.clone();
        let after = after.map(StaleCursor::from);
        let answer = blocking(move || storage.list_stale_after(&biz_type, now, after, limit)).await;
        Ok(answer.map(Conv::conv).map_err(Into::into))
    }
}

impl wit_clock::Host for State {
    async fn now(&mut self) -> wasmtime::Result<types::Timestamp> {
        // Reading the clock does not block.
        Ok(self.clock.now())
    }

    async fn pause(&mut self, duration: u64) -> wasmtime::Result<()> {
        let clock = self.clock.clone();
        // Pausing may sleep the thread (the system clock does).
        let _ = blocking(move || {
            clock.pause(duration);
            Ok(())
        })
        .await;
        Ok(())
    }
}

impl wit_results::Host for State {
    async fn find_result(
        &mut self,
        key: wit_types::RecordKey,
    ) -> StoreAnswer<Option<wit_types::Success>> {
        let results = self.results.clone();
        let answer = blocking(move || results.find_result(&key.conv())).await;
        Ok(answer
            .map(|found| found.map(|s| s.conv()))
            .map_err(Into::into))
    }
}

impl http_bridge::Host for State {
    async fn request_body(
        &mut self,
        request: Resource<HostIncomingRequest>,
    ) -> wasmtime::Result<Result<Vec<u8>, BodyError>> {
        Ok(match self.call(&request) {
            Some(call) => Ok(call.body.to_vec()),
            None => Err(BodyError::Unreadable(
                "this request was not made by the host for this call".into(),
            )),
        })
    }

    async fn request_route(
        &mut self,
        request: Resource<HostIncomingRequest>,
    ) -> wasmtime::Result<Option<http_bridge::Route>> {
        Ok(self.call(&request).map(|call| call.route.clone()))
    }

    async fn client_address(
        &mut self,
        request: Resource<HostIncomingRequest>,
    ) -> wasmtime::Result<Option<String>> {
        Ok(self.call(&request).and_then(|call| call.client.clone()))
    }
}

/// Reads the response the wrapped handler sets, with its whole body.
async fn collect(
    set: tokio::sync::oneshot::Receiver<Result<hyper::Response<HyperOutgoingBody>, ErrorCode>>,
) -> Result<wit_types::StoredResponse, String> {
    let response = match set.await {
        Ok(Ok(response)) => response,
        Ok(Err(code)) => return Err(format!("the handler answered with an error: {code:?}")),
        Err(_) => return Err("the handler set no response".into()),
    };
    let (parts, body) = response.into_parts();
    let body = Limited::new(body, MAX_CAPTURED_BODY_BYTES)
        .collect()
        .await
        .map_err(|e| format!("the handler's response body could not be read: {e}"))?
        .to_bytes();
    let headers = parts
        .headers
        .iter()
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect();
    Ok(wit_types::StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body: body.to_vec(),
    })
}

impl http_bridge::HostResponseCapture for State {
    async fn new(&mut self) -> wasmtime::Result<Resource<Capture>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let outparam = self.http().new_response_outparam(tx)?;
        // Collect at once: the handler's body writes wait for a reader.
        let collected = tokio::spawn(collect(rx));
        Ok(self.table.push(Capture {
            outparam: Some(outparam),
            collected: Some(collected),
        })?)
    }

    async fn outparam(
        &mut self,
        capture: Resource<Capture>,
    ) -> wasmtime::Result<Option<Resource<HostResponseOutparam>>> {
        Ok(self.table.get_mut(&capture)?.outparam.take())
    }

    async fn finish(
        &mut self,
        capture: Resource<Capture>,
    ) -> wasmtime::Result<Result<wit_types::StoredResponse, String>> {
        let Some(task) = self.table.get_mut(&capture)?.collected.take() else {
            return Ok(Err("the response was already taken".into()));
        };
        Ok(
            match tokio::time::timeout(CAPTURE_FINISH_TIMEOUT, task).await {
                Ok(Ok(answer)) => answer,
                Ok(Err(e)) => Err(format!("the response could not be collected: {e}")),
                Err(_) => Err(format!(
                    "the handler did not finish its response within {} ms",
                    CAPTURE_FINISH_TIMEOUT.as_millis()
                )),
            },
        )
    }

    async fn drop(&mut self, capture: Resource<Capture>) -> wasmtime::Result<()> {
        let capture = self.table.delete(capture)?;
        if let Some(task) = capture.collected {
            task.abort();
        }
        if let Some(outparam) = capture.outparam {
            self.table.delete(outparam)?;
        }
        Ok(())
    }
}

/// Why a component could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The component could not be compiled, or does not fit: it must
    /// export `wasi:http/incoming-handler` and import nothing beyond WASI,
    /// `wasi:http` and idem's interfaces.
    #[error("cannot load the component: {0}")]
    Load(String),
    /// The configuration's routes or guest bounds are invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// A compiled middleware component, ready to serve. Cheap to clone.
#[derive(Clone)]
pub struct ComponentServer {
    inner: Arc<Inner>,
}

struct Inner {
    pre: ProxyPre<State>,
    storage: Arc<dyn Storage>,
    clock: Arc<dyn Clock>,
    routes: RouteTable,
    bounds: GuestBounds,
    serve: ServeOptions,
}

impl ComponentServer {
    /// Compiles `wasm` and links it against WASI, `wasi:http`, `storage`,
    /// `clock` and the bridge, configured by `config` as `idem serve` is:
    /// its routes and policies, its `scope_header`, its guest bounds
    /// (`guest_deadline_ms`, `guest_memory_bytes`) and its
    /// `header_read_timeout_ms`. Its upstream, sweep and group-commit keys
    /// have no meaning here.
    ///
    /// # Errors
    ///
    /// [`ServeError::Load`] when the component does not compile or link;
    /// [`ServeError::Config`] when `config` does not resolve.
    pub fn new(
        wasm: &[u8],
        storage: Arc<dyn Storage>,
        clock: Arc<dyn Clock>,
        config: &ProxyConfig,
    ) -> Result<Self, ServeError> {
        let routes = config.resolve()?;
        let bounds = config.guest_bounds()?;
        let load = |e: wasmtime::Error| ServeError::Load(format!("{e:#}"));
        let engine = idem_engine::bounds::wasmtime_engine().map_err(ServeError::Load)?;
        let component = Component::new(&engine, wasm).map_err(load)?;
        let mut linker = Linker::<State>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(load)?;
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker).map_err(load)?;
        wit_store::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s).map_err(load)?;
        wit_clock::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s).map_err(load)?;
        wit_results::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s).map_err(load)?;
        http_bridge::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s).map_err(load)?;
        let pre = linker.instantiate_pre(&component).map_err(load)?;
        let pre = ProxyPre::new(pre).map_err(load)?;
        Ok(Self {
            inner: Arc::new(Inner {
                pre,
                storage,
                clock,
                routes,
                bounds,
                serve: ServeOptions {
                    header_read_timeout: Duration::from_millis(config.header_read_timeout_ms),
                },
            }),
        })
    }

    /// The router that runs the component for every method and path.
    pub fn router(&self) -> Router {
        Router::new()
            .fallback(handle)
            .with_state(self.inner.clone())
    }

    /// How to serve [`ComponentServer::router`] (with
    /// [`crate::proxy::serve_with`]): the configuration's
    /// `header_read_timeout_ms`.
    pub fn serve_options(&self) -> ServeOptions {
        self.inner.serve
    }
}

fn problem(problem: idem_http::Problem) -> Response {
    Problem::from(problem).into_response()
}

/// What the bridge's `route` answers for a request to `method` and `path`.
fn route_for(routes: &RouteTable, method: &Method, path: &str) -> http_bridge::Route {
    let route = routes.find(method, path);
    http_bridge::Route {
        biz_type: route.biz_type.clone(),
        policy: route.policy.clone().conv(),
        key: match route.key_requirement(method) {
            KeyRequirement::Required => http_bridge::KeyRequirement::Required,
            KeyRequirement::Optional => http_bridge::KeyRequirement::Optional,
        },
        anonymous: match route.anonymous {
            AnonymousMode::Reject => http_bridge::AnonymousMode::Reject,
            AnonymousMode::Shared => http_bridge::AnonymousMode::Shared,
            AnonymousMode::ClientAddress => http_bridge::AnonymousMode::ClientAddress,
        },
        server_errors: match route.server_errors {
            ServerErrors::Retry => http_bridge::ServerErrors::Retry,
            ServerErrors::Store => http_bridge::ServerErrors::Store,
        },
        scope_header: routes.scope_header().map(|h| h.as_str().to_owned()),
    }
}

async fn handle(AxumState(inner): AxumState<Arc<Inner>>, request: Request) -> Response {
    let (mut parts, body) = request.into_parts();
    let body = match Limited::new(body, MAX_REQUEST_BODY_BYTES).collect().await {
        Ok(collected) => collected.to_bytes(),
        // The body is not read to its end: the connection cannot carry
        // another request, and the answer says so. Without it hyper would
        // answer with keep-alive and then close the connection, and a
        // client that pooled it would lose its next request.
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            let limit = u64::try_from(MAX_REQUEST_BODY_BYTES).unwrap_or(u64::MAX);
            return closing(problem(idem_http::Problem::body_too_large(limit)));
        }
        Err(_) => return closing(problem(idem_http::Problem::body_unreadable())),
    };
    if !parts.headers.contains_key(header::HOST) {
        parts
            .headers
            .insert(header::HOST, HeaderValue::from_static("localhost"));
    }
    let route = route_for(&inner.routes, &parts.method, parts.uri.path());
    let client = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(peer)| peer.ip().to_canonical().to_string());
    let request = hyper::Request::from_parts(parts, body);
    match run(&inner, request, route, client).await {
        Ok(response) => response,
        Err(e) => failure_problem(&inner, &e),
    }
}

/// The answer to a request whose component failed before it answered.
fn failure_problem(inner: &Inner, e: &wasmtime::Error) -> Response {
    match idem_engine::bounds::stopped(e) {
        Some(Stopped::Deadline(limit)) => {
            tracing::error!(
                deadline_ms = limit.as_millis(),
                "the component ran past its deadline and was stopped"
            );
            problem(
                idem_http::Problem::new(
                    ProblemType::InternalError,
                    format!(
                        "The component ran past its deadline of {} ms and was stopped. Retry with the same Idempotency-Key.",
                        limit.as_millis()
                    ),
                )
                .with(
                    "guest_deadline_ms",
                    u64::try_from(inner.bounds.deadline.as_millis()).unwrap_or(u64::MAX),
                ),
            )
        }
        Some(Stopped::Memory { limit, requested }) => {
            tracing::error!(
                limit,
                requested,
                "the component needed more than its memory limit and was stopped"
            );
            problem(
                idem_http::Problem::new(
                    ProblemType::InternalError,
                    format!(
                        "The component needed more than its memory limit of {limit} bytes and was stopped. Retry with the same Idempotency-Key."
                    ),
                )
                .with("guest_memory_bytes", limit),
            )
        }
        None => {
            tracing::error!(error = %e, "the component failed");
            problem(idem_http::Problem::component_failed())
        }
    }
}

/// Runs one request on a fresh instance, bounded by the server's guest
/// bounds.
async fn run(
    inner: &Inner,
    request: hyper::Request<Bytes>,
    route: http_bridge::Route,
    client: Option<String>,
) -> wasmtime::Result<Response> {
    let state = State {
        wasi: WasiCtx::builder().inherit_stdout().inherit_stderr().build(),
        http: WasiHttpCtx::new(),
        hooks: DenyOutgoing,
        table: ResourceTable::new(),
        storage: inner.storage.clone(),
        clock: inner.clock.clone(),
        results: Arc::new(NoLookup),
        guard: Guard::new(inner.bounds, Flavor::Async),
        call: None,
    };
    let mut store = wasmtime::Store::new(inner.pre.engine(), state);
    Guard::install(&mut store, |s| &mut s.guard);
    let (parts, body) = request.into_parts();
    let bytes = body.clone();
    let full = Full::new(body);
    let req = store
        .data_mut()
        .http()
        .new_incoming_request(Scheme::Http, hyper::Request::from_parts(parts, full))?;
    store.data_mut().call = Some(Call {
        rep: req.rep(),
        body: bytes,
        route,
        client,
    });
    let (tx, rx) = tokio::sync::oneshot::channel();
    let out = store.data_mut().http().new_response_outparam(tx)?;
    let pre = inner.pre.clone();
    let task = tokio::spawn(async move {
        let proxy = pre.instantiate_async(&mut store).await?;
        proxy
            .wasi_http_incoming_handler()
            .call_handle(&mut store, req, out)
            .await
    });
    match rx.await {
        Ok(Ok(response)) => Ok(response.map(|b| Body::new(b.map_err(|e| format!("{e:?}"))))),
        Ok(Err(code)) => Err(wasmtime::format_err!(
            "the component answered an error: {code:?}"
        )),
        Err(_) => match task.await {
            Ok(Ok(())) => Err(wasmtime::format_err!("the component set no response")),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(wasmtime::format_err!("the component task failed: {e}")),
        },
    }
}

/// Why two components could not be composed.
#[derive(Debug, thiserror::Error)]
#[error("cannot compose the components: {0}")]
pub struct ComposeError(String);

/// Plugs `handler` (a component exporting `wasi:http/incoming-handler`)
/// into `middleware`'s imported `incoming-handler`, as `wac plug` does: the
/// result exports the middleware's handler and imports what both import,
/// each import once.
///
/// # Errors
///
/// [`ComposeError`] when either is not a component, or the handler exports
/// nothing the middleware imports.
pub fn compose(middleware: &[u8], handler: &[u8]) -> Result<Vec<u8>, ComposeError> {
    use wac_graph::types::Package;
    use wac_graph::{CompositionGraph, EncodeOptions};
    let err = |what: &str, e: &dyn std::fmt::Display| ComposeError(format!("{what}: {e:#}"));
    let mut graph = CompositionGraph::new();
    let socket = Package::from_bytes(
        "idem:middleware",
        None,
        middleware.to_vec(),
        graph.types_mut(),
    )
    .map_err(|e| err("the middleware", &e))?;
    let socket = graph
        .register_package(socket)
        .map_err(|e| err("the middleware", &e))?;
    let plug = Package::from_bytes("idem:handler", None, handler.to_vec(), graph.types_mut())
        .map_err(|e| err("the handler", &e))?;
    let plug = graph
        .register_package(plug)
        .map_err(|e| err("the handler", &e))?;
    wac_graph::plug(&mut graph, vec![plug], socket).map_err(|e| err("plugging", &e))?;
    graph
        .encode(EncodeOptions::default())
        .map_err(|e| err("encoding", &e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_middleware_imports_idem_and_wasi_http_and_exports_both_worlds() {
        let engine = wasmtime::Engine::default();
        let component = Component::new(&engine, MIDDLEWARE_GUEST).unwrap();
        let ty = component.component_type();
        let imports: Vec<String> = ty.imports(&engine).map(|(n, _)| n.to_string()).collect();
        let exports: Vec<String> = ty.exports(&engine).map(|(n, _)| n.to_string()).collect();
        for name in [
            "idem:engine/store@0.4.0",
            "idem:engine/clock@0.4.0",
            "idem:engine/http-bridge@0.4.0",
            "wasi:http/types@0.2.12",
            "wasi:http/incoming-handler@0.2.12",
        ] {
            assert!(imports.iter().any(|i| i == name), "{name} in {imports:?}");
        }
        // No WASI beyond what wasi:http needs: no CLI, no filesystem.
        assert!(
            imports.iter().all(|i| i.starts_with("idem:")
                || i.starts_with("wasi:http/")
                || i.starts_with("wasi:io/")
                || i.starts_with("wasi:clocks/")),
            "{imports:?}"
        );
        assert!(
            exports
                .iter()
                .any(|e| e == "wasi:http/incoming-handler@0.2.12")
        );
        assert!(exports.iter().any(|e| e == "idem:engine/engine@0.4.0"));
    }

    #[test]
    fn each_request_gets_the_settings_of_its_route() {
        let config = ProxyConfig::from_toml_str(
            r#"
            scope_header = "X-Tenant-Id"
            [defaults]
            anonymous = "shared"
            [[routes]]
            method = "POST"
            path = "/orders"
            biz_type = "order.create"
            lease_ms = 5000
            server_errors = "store"
            [[routes]]
            path = "/public/*"
            biz_type = "public"
            key = "optional"
            anonymous = "client-address"
            "#,
        )
        .unwrap();
        let routes = config.resolve().unwrap();
        let orders = route_for(&routes, &Method::POST, "/orders");
        assert_eq!(orders.biz_type, "order.create");
        assert_eq!(orders.policy.lease_ms, 5000);
        let policy: idem_engine::api::Policy = orders.policy.clone().conv();
        assert_eq!(
            policy,
            config.policy_for("order.create"),
            "the policy of its biz type"
        );
        assert!(matches!(orders.key, http_bridge::KeyRequirement::Required));
        assert!(matches!(
            orders.anonymous,
            http_bridge::AnonymousMode::Shared
        ));
        assert!(matches!(
            orders.server_errors,
            http_bridge::ServerErrors::Store
        ));
        assert_eq!(orders.scope_header.as_deref(), Some("x-tenant-id"));

        let public = route_for(&routes, &Method::POST, "/public/x");
        assert_eq!(public.biz_type, "public");
        assert!(matches!(public.key, http_bridge::KeyRequirement::Optional));
        assert!(matches!(
            public.anonymous,
            http_bridge::AnonymousMode::ClientAddress
        ));
        assert!(matches!(
            public.server_errors,
            http_bridge::ServerErrors::Retry
        ));

        // Unrouted: the defaults, biz type `http`; a key is required of
        // POST only.
        let post = route_for(&routes, &Method::POST, "/elsewhere");
        assert_eq!(post.biz_type, "http");
        assert!(matches!(post.key, http_bridge::KeyRequirement::Required));
        let put = route_for(&routes, &Method::PUT, "/orders");
        assert_eq!(put.biz_type, "http");
        assert!(matches!(put.key, http_bridge::KeyRequirement::Optional));
    }

    #[test]
    fn a_server_refuses_a_bad_config_and_an_uncomposed_middleware() {
        let store: Arc<dyn Storage> = Arc::new(idem_engine::MemoryStore::new());
        let clock: Arc<dyn Clock> = Arc::new(idem_engine::SystemClock::new());
        let error = |config: &ProxyConfig| {
            ComponentServer::new(MIDDLEWARE_GUEST, store.clone(), clock.clone(), config)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        let bad = ProxyConfig {
            guest_deadline_ms: 0,
            ..ProxyConfig::default()
        };
        let e = error(&bad);
        assert!(e.contains("guest_deadline_ms"), "{e}");
        // The middleware alone still imports the handler it wraps.
        let e = error(&ProxyConfig::default());
        assert!(
            e.contains("cannot load") && e.contains("wasi:http/incoming-handler"),
            "{e}"
        );
    }

    #[test]
    fn compose_names_the_input_that_is_not_a_component() {
        let e = compose(b"not wasm", MIDDLEWARE_GUEST).unwrap_err();
        assert!(e.to_string().contains("the middleware"), "{e}");
        let e = compose(MIDDLEWARE_GUEST, b"\0asm").unwrap_err();
        assert!(e.to_string().contains("the handler"), "{e}");
    }

    #[test]
    fn compose_refuses_a_handler_that_exports_no_incoming_handler() {
        // The engine component exports only idem's `engine`.
        let e = compose(MIDDLEWARE_GUEST, idem_engine::engine::DEFAULT_GUEST).unwrap_err();
        assert!(e.to_string().contains("plugging"), "{e}");
    }
}
