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
//! Each request gets a fresh instance (as `wasmtime serve` does), so the
//! store, never the instance, carries state between requests. The whole
//! request body is read before the component runs, up to
//! [`MAX_REQUEST_BODY_BYTES`].

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State as AxumState};
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, header};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use wasmtime::component::{Component, HasSelf, Linker, Resource, ResourceTable};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};
use wasmtime_wasi_http::p2::bindings::ProxyPre;
use wasmtime_wasi_http::p2::bindings::http::types::{ErrorCode, Scheme};
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;
use wasmtime_wasi_http::p2::types::{HostIncomingRequest, HostResponseOutparam};
use wasmtime_wasi_http::{WasiBody, WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView};

use crate::bindings::{self as idem_bindings, wit_types};
use crate::clock::Clock;
use crate::engine::{DEFAULT_GUEST_DEADLINE, DEFAULT_MEMORY_LIMIT, HostState};
use crate::proxy::Problem;
use crate::store::Storage;

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
    //! Host bindings of the `middleware` world's `http-bridge` import.
    #![allow(missing_docs)]
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "middleware",
        imports: { default: async | trappable },
        with: {
            "wasi:http/types": wasmtime_wasi_http::p2::bindings::http::types,
            "wasi:io": wasmtime_wasi::p2::bindings::io,
            "wasi:clocks": wasmtime_wasi::p2::bindings::clocks,
            "idem:engine/types": crate::bindings::idem::engine::types,
            "idem:engine/store": crate::bindings::idem::engine::store,
            "idem:engine/clock": crate::bindings::idem::engine::clock,
            "idem:engine/results": crate::bindings::idem::engine::results,
            "idem:engine/http-bridge.response-capture": super::Capture,
        },
    });
}

use bridge::idem::engine::http_bridge::{self, BodyError};

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

/// What one instance's imports reach.
struct State {
    wasi: WasiCtx,
    http: WasiHttpCtx,
    hooks: DenyOutgoing,
    table: ResourceTable,
    idem: HostState,
    /// The request the host made for this call, and its whole body.
    request: Option<(u32, Bytes)>,
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

impl http_bridge::Host for State {
    async fn request_body(
        &mut self,
        request: Resource<HostIncomingRequest>,
    ) -> wasmtime::Result<Result<Vec<u8>, BodyError>> {
        Ok(match &self.request {
            Some((rep, body)) if *rep == request.rep() => Ok(body.to_vec()),
            _ => Err(BodyError::Unreadable(
                "this request was not made by the host for this call".into(),
            )),
        })
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
}

impl ComponentServer {
    /// Compiles `wasm` and links it against WASI, `wasi:http`, `storage`,
    /// `clock` and the bridge.
    ///
    /// # Errors
    ///
    /// [`ServeError::Load`] when the component does not compile or link.
    pub fn new(
        wasm: &[u8],
        storage: Arc<dyn Storage>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, ServeError> {
        let load = |e: wasmtime::Error| ServeError::Load(format!("{e:#}"));
        let engine = wasmtime::Engine::default();
        let component = Component::new(&engine, wasm).map_err(load)?;
        let mut linker = Linker::<State>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(load)?;
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker).map_err(load)?;
        idem_bindings::Idem::add_to_linker::<State, HasSelf<HostState>>(&mut linker, |s| {
            &mut s.idem
        })
        .map_err(load)?;
        http_bridge::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s).map_err(load)?;
        let pre = linker.instantiate_pre(&component).map_err(load)?;
        let pre = ProxyPre::new(pre).map_err(load)?;
        Ok(Self {
            inner: Arc::new(Inner {
                pre,
                storage,
                clock,
            }),
        })
    }

    /// The router that runs the component for every method and path.
    pub fn router(&self) -> Router {
        Router::new()
            .fallback(handle)
            .with_state(self.inner.clone())
    }
}

fn problem(problem: idem_http::Problem) -> Response {
    Problem::from(problem).into_response()
}

async fn handle(AxumState(inner): AxumState<Arc<Inner>>, request: Request) -> Response {
    let (mut parts, body) = request.into_parts();
    let body = match Limited::new(body, MAX_REQUEST_BODY_BYTES).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            let limit = u64::try_from(MAX_REQUEST_BODY_BYTES).unwrap_or(u64::MAX);
            return problem(idem_http::Problem::body_too_large(limit));
        }
        Err(_) => return problem(idem_http::Problem::body_unreadable()),
    };
    if !parts.headers.contains_key(header::HOST) {
        parts
            .headers
            .insert(header::HOST, HeaderValue::from_static("localhost"));
    }
    match run(&inner, hyper::Request::from_parts(parts, body)).await {
        Ok(response) => response,
        Err(e) => {
            tracing::error!(error = %e, "the component failed");
            problem(idem_http::Problem::component_failed())
        }
    }
}

/// Runs one request on a fresh instance.
async fn run(inner: &Inner, request: hyper::Request<Bytes>) -> wasmtime::Result<Response> {
    let state = State {
        wasi: WasiCtx::builder().inherit_stdout().inherit_stderr().build(),
        http: WasiHttpCtx::new(),
        hooks: DenyOutgoing,
        table: ResourceTable::new(),
        idem: HostState::new(
            inner.storage.clone(),
            inner.clock.clone(),
            DEFAULT_MEMORY_LIMIT,
            DEFAULT_GUEST_DEADLINE,
        ),
        request: None,
    };
    let mut store = wasmtime::Store::new(inner.pre.engine(), state);
    store.limiter(|s| s.idem.limits());
    let (parts, body) = request.into_parts();
    let bytes = body.clone();
    let full = Full::new(body);
    let req = store
        .data_mut()
        .http()
        .new_incoming_request(Scheme::Http, hyper::Request::from_parts(parts, full))?;
    store.data_mut().request = Some((req.rep(), bytes));
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
            "idem:engine/store@0.1.0",
            "idem:engine/clock@0.1.0",
            "idem:engine/http-bridge@0.1.0",
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
        assert!(exports.iter().any(|e| e == "idem:engine/engine@0.1.0"));
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
        let e = compose(MIDDLEWARE_GUEST, crate::engine::DEFAULT_GUEST).unwrap_err();
        assert!(e.to_string().contains("plugging"), "{e}");
    }
}
