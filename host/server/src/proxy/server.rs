//! The HTTP/1.1 server under the proxy: hyper, one task per connection,
//! with two guards hyper alone does not give.
//!
//! - A request head must arrive within the header read timeout, counted
//!   from its first byte (or from the connection's start for its first
//!   request). A slower head is answered `408` with a problem body and the
//!   connection is closed; a connection that sends nothing at all is closed.
//!   An idle keep-alive connection between requests is left alone.
//! - A request carrying both `Content-Length` and `Transfer-Encoding` is
//!   refused with `400` before it reaches the router (see `framing.rs`).
//!
//! Every request reaches the router with the connection's peer address as
//! an [`axum::extract::ConnectInfo`]`<SocketAddr>` extension.
//!
//! Malformed heads are hyper's: `400`; too many or too large headers:
//! `431`; too long a URI: `414`.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Request, header};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};
use tokio_util::task::TaskTracker;

use super::ProxyError;
use super::config::DEFAULT_HEADER_READ_TIMEOUT_MS;
use super::framing::Framing;
use super::problem::Problem;

/// How long the accept loop pauses after an error other than a client
/// hanging up (typically: out of file descriptors). Long enough not to spin
/// on the error, short enough to take connections again as soon as some
/// close.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// How the server treats clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeOptions {
    /// How long a request head may take to arrive, from its first byte (or
    /// from the connection's start for its first request).
    pub header_read_timeout: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            header_read_timeout: Duration::from_millis(DEFAULT_HEADER_READ_TIMEOUT_MS),
        }
    }
}

/// Serves `router` on `listener` until `shutdown` completes; then stops
/// accepting, lets each connection finish the request it is on, and waits
/// for them all.
///
/// # Errors
///
/// None today: accept errors are logged and retried. The `Result` leaves
/// room for a listener that can fail for good.
pub async fn serve_with(
    listener: TcpListener,
    router: Router,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ProxyError> {
    let connections = TaskTracker::new();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((tcp, peer)) => {
                connections.spawn(connection(
                    tcp,
                    peer,
                    router.clone(),
                    options,
                    stop_rx.clone(),
                ));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionRefused
                ) => {}
            Err(e) => {
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
            }
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    connections.close();
    connections.wait().await;
    Ok(())
}

fn lock(framing: &Mutex<Framing>) -> MutexGuard<'_, Framing> {
    // The framing is consistent between calls; a panic cannot leave it
    // half-updated in a way that matters more than losing track.
    framing.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The 400 for a request framed twice.
fn conflicting_framing() -> Response {
    let mut response = Problem::from(idem_http::Problem::conflicting_framing()).into_response();
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The raw 408 written when a request head is too slow: hyper has no
/// response of its own for it.
fn request_timeout_bytes(timeout: Duration) -> Vec<u8> {
    let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    let body = idem_http::Problem::head_timeout(ms).to_json().to_string();
    format!(
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: {}\r\ncache-control: no-store\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        super::problem::PROBLEM_CONTENT_TYPE,
        body.len()
    )
    .into_bytes()
}

async fn connection(
    tcp: TcpStream,
    peer: SocketAddr,
    router: Router,
    options: ServeOptions,
    mut stop: watch::Receiver<bool>,
) {
    let framing = Arc::new(Mutex::new(Framing::default()));
    let answered = Arc::new(AtomicU64::new(0));
    let io = TokioIo::new(Guarded::new(
        tcp,
        framing.clone(),
        answered.clone(),
        options.header_read_timeout,
    ));
    let router = TowerToHyperService::new(router);
    let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
        // The peer, as axum's `into_make_service_with_connect_info` gives
        // it: the proxy's `anonymous = "client-address"` reads it.
        request.extensions_mut().insert(ConnectInfo(peer));
        let conflicting = lock(&framing).take_verdict();
        let answer = (!conflicting).then(|| hyper::service::Service::call(&router, request));
        let answered = answered.clone();
        async move {
            let response = match answer {
                Some(answer) => answer.await?,
                None => {
                    tracing::info!("request refused: both Content-Length and Transfer-Encoding");
                    conflicting_framing()
                }
            };
            answered.fetch_add(1, Ordering::SeqCst);
            Ok::<Response<Body>, Infallible>(response)
        }
    });
    // Half-closed clients (the request sent, the sending side shut) still
    // get their answer, also when their body was cut short.
    let mut conn = pin!(
        http1::Builder::new()
            .half_close(true)
            .serve_connection(io, service)
    );
    let mut stopping = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stop.wait_for(|stop| *stop), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// The connection's socket, as hyper sees it: every byte read is followed
/// by [`Framing`], and a head that takes too long is answered 408 and ends
/// the stream.
struct Guarded {
    tcp: TcpStream,
    framing: Arc<Mutex<Framing>>,
    /// Requests the router has answered; fewer than the heads seen means a
    /// request is still being worked on.
    answered: Arc<AtomicU64>,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
    /// The deadline counts: a head has started (or the connection is new
    /// and nothing has arrived).
    armed: bool,
    /// The 408 still to write, and how much of it is written.
    expiring: Option<(Vec<u8>, usize)>,
    /// Reads end: the head timed out.
    closed: bool,
}

impl Guarded {
    fn new(
        tcp: TcpStream,
        framing: Arc<Mutex<Framing>>,
        answered: Arc<AtomicU64>,
        timeout: Duration,
    ) -> Self {
        Guarded {
            tcp,
            framing,
            answered,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            armed: true,
            expiring: None,
            closed: false,
        }
    }

    fn arm(&mut self) {
        self.armed = true;
        self.deadline.as_mut().reset(Instant::now() + self.timeout);
    }

    /// Writes the 408, then ends the stream.
    fn poll_expire(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some((bytes, written)) = &mut self.expiring {
            while *written < bytes.len() {
                match ready!(Pin::new(&mut self.tcp).poll_write(cx, &bytes[*written..])) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => *written += n,
                }
            }
            let _ = ready!(Pin::new(&mut self.tcp).poll_flush(cx));
        }
        self.expiring = None;
        self.closed = true;
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.expiring.is_some() {
            return this.poll_expire(cx);
        }
        if this.closed {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.tcp).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let started = {
                    let mut framing = lock(&this.framing);
                    let was = framing.head_started();
                    framing.feed(&buf.filled()[before..]);
                    let now = framing.head_started();
                    now.then_some(!was)
                };
                match started {
                    // The first byte of a head: its time starts now.
                    Some(true) => this.arm(),
                    Some(false) => {}
                    None => this.armed = false,
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                while this.armed && this.deadline.as_mut().poll(cx).is_ready() {
                    let (started, busy) = {
                        let framing = lock(&this.framing);
                        let busy = this.answered.load(Ordering::SeqCst) < framing.heads();
                        (framing.head_started(), busy)
                    };
                    if busy {
                        // A pipelined head behind a request still being
                        // answered: its time starts when the answer is out.
                        this.arm();
                        continue;
                    }
                    tracing::info!(started, "request head timed out; closing the connection");
                    if started {
                        this.expiring = Some((request_timeout_bytes(this.timeout), 0));
                        return this.poll_expire(cx);
                    }
                    this.closed = true;
                    return Poll::Ready(Ok(()));
                }
                Poll::Pending
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}
