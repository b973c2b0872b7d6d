//! A real HTTP upstream for the proxy tests (`tests/proxy.rs`), on
//! 127.0.0.1 with a port of its own, served by axum on a Tokio runtime of
//! its own. It counts every execution (in total and per `Idempotency-Key`)
//! and behaves by path:
//!
//! | path | answer |
//! |---|---|
//! | `/orders` | 201, JSON `{"order_id":"ord-N",...}`, `x-order-id: ord-N`, and hop-by-hop headers (`Connection: x-upstream-hop`, `x-upstream-hop`, `Keep-Alive`) |
//! | `/slow?ms=N` | waits N ms, then as `/orders` |
//! | `/fail/CODE` | that status, a JSON body naming the execution |
//! | `/hang` | never answers |
//! | `…/hang-once` | never answers the first execution of its `Idempotency-Key`; as `/orders` after |
//! | `/drop` | reads the request, then closes the connection without an answer |
//! | anything else | 200, JSON echo of method and path |
//!
//! An execution is counted when the request (head and body) has arrived,
//! before any waiting. The business lookups are not executions:
//!
//! | path | answer |
//! |---|---|
//! | `GET /lookup/KEY` | 200 `{"order_id":"ord-N","found":true}` (`x-order-id: ord-N`) for the first execution that carried `Idempotency-Key: KEY`; 404 when none did |
//! | `GET /lookup-none/KEY` | 404: "not done", whatever ran |
//! | `GET /lookup-down/KEY` | 503: the business side cannot tell |
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use axum::{Extension, Router};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::sync::Notify;

/// One request the upstream executed.
#[derive(Clone, Debug)]
pub struct Execution {
    /// 1-based, in arrival order.
    pub n: usize,
    pub method: String,
    /// Path and query as received.
    pub target: String,
    pub idempotency_key: Option<String>,
    pub authorization: Option<String>,
    pub content_type: Option<String>,
    pub body: Bytes,
}

#[derive(Default)]
struct Log {
    executions: Vec<Execution>,
    per_key: HashMap<String, usize>,
}

#[derive(Default)]
struct Shared {
    log: Mutex<Log>,
    changed: Condvar,
}

impl Shared {
    fn record(&self, mut e: Execution) -> usize {
        let mut log = self.log.lock().unwrap();
        e.n = log.executions.len() + 1;
        if let Some(k) = &e.idempotency_key {
            *log.per_key.entry(k.clone()).or_default() += 1;
        }
        let n = e.n;
        log.executions.push(e);
        self.changed.notify_all();
        n
    }
}

/// Closes the connection a request arrived on, without an answer.
#[derive(Clone, Default)]
struct ConnKill(Arc<Notify>);

/// A running upstream. Dropping it stops it.
pub struct Upstream {
    addr: SocketAddr,
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Upstream {
    pub fn start() -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("test-upstream")
            .enable_all()
            .build()?;
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .fallback(handle)
            .with_state(Arc::clone(&shared));
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        runtime.spawn(accept_loop(listener, app));
        Ok(Self {
            addr,
            shared,
            runtime: Some(runtime),
        })
    }

    /// `http://127.0.0.1:PORT`, for `--upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Executions in total.
    pub fn total(&self) -> usize {
        self.shared.log.lock().unwrap().executions.len()
    }

    /// Executions that carried this `Idempotency-Key` (as forwarded).
    pub fn count_for(&self, key: &str) -> usize {
        let log = self.shared.log.lock().unwrap();
        log.per_key.get(key).copied().unwrap_or(0)
    }

    /// Every execution so far, in arrival order.
    pub fn executions(&self) -> Vec<Execution> {
        self.shared.log.lock().unwrap().executions.clone()
    }

    /// Blocks until at least `n` executions have arrived (no polling: woken
    /// by each arrival), or fails after `timeout`.
    pub fn wait_for_total(&self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut log = self.shared.log.lock().unwrap();
        while log.executions.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                bail!(
                    "the upstream saw {} executions, expected {n} within {timeout:?}",
                    log.executions.len()
                );
            }
            log = self.shared.changed.wait_timeout(log, left).unwrap().0;
        }
        Ok(())
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// A port that refuses connections: a listener's port, with the listener
/// closed again.
pub fn refused_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    drop(listener);
    Ok(port)
}

async fn accept_loop(listener: tokio::net::TcpListener, app: Router) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let kill = ConnKill::default();
        let service = TowerToHyperService::new(app.clone().layer(Extension(kill.clone())));
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = conn => {}
                // Dropping the connection future closes the socket unanswered.
                () = kill.0.notified() => {}
            }
        });
    }
}

fn header(req: &Request, name: &str) -> Option<String> {
    req.headers()
        .get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

fn json_response(status: u16, body: String, extra: &[(&'static str, String)]) -> Response {
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::IM_A_TEAPOT);
    let headers = resp.headers_mut();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    for (name, value) in extra {
        headers.insert(*name, HeaderValue::from_str(value).unwrap());
    }
    resp
}

/// The business lookups (see the table above); none for other paths.
fn lookup(shared: &Shared, path: &str) -> Option<Response> {
    if path.starts_with("/lookup-none/") {
        return Some(json_response(404, r#"{"found":false}"#.into(), &[]));
    }
    if path.starts_with("/lookup-down/") {
        return Some(json_response(503, r#"{"error":"down"}"#.into(), &[]));
    }
    let key = path.strip_prefix("/lookup/")?;
    let log = shared.log.lock().unwrap();
    let first = log
        .executions
        .iter()
        .find(|e| e.idempotency_key.as_deref() == Some(key));
    Some(match first {
        Some(e) => {
            let id = format!("ord-{}", e.n);
            let body = serde_json::json!({ "order_id": id, "found": true });
            json_response(200, body.to_string(), &[("x-order-id", id)])
        }
        None => json_response(404, r#"{"found":false}"#.into(), &[]),
    })
}

fn order(n: usize, exec: &Execution) -> Response {
    let id = format!("ord-{n}");
    let body = serde_json::json!({
        "order_id": id,
        "execution": n,
        "method": exec.method,
        "target": exec.target,
        "request_bytes": exec.body.len(),
    });
    json_response(
        201,
        body.to_string(),
        &[
            ("x-order-id", id),
            ("x-execution", n.to_string()),
            // Hop-by-hop: a proxy must neither forward nor store these.
            ("connection", "x-upstream-hop".into()),
            ("x-upstream-hop", "1".into()),
            ("keep-alive", "timeout=30".into()),
        ],
    )
}

async fn handle(
    State(shared): State<Arc<Shared>>,
    Extension(kill): Extension<ConnKill>,
    req: Request,
) -> Response {
    let method = req.method().as_str().to_string();
    let target = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or_default().to_string();
    let idempotency_key = header(&req, "idempotency-key");
    let authorization = header(&req, "authorization");
    let content_type = header(&req, "content-type");
    let Ok(body) = axum::body::to_bytes(req.into_body(), 64 << 20).await else {
        return json_response(400, r#"{"error":"unreadable body"}"#.into(), &[]);
    };
    if let Some(answer) = lookup(&shared, &path) {
        return answer;
    }
    let mut exec = Execution {
        n: 0,
        method,
        target,
        idempotency_key,
        authorization,
        content_type,
        body,
    };
    let n = shared.record(exec.clone());
    exec.n = n;
    match path.as_str() {
        "/orders" => order(n, &exec),
        "/slow" => {
            let ms = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("ms="))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(500);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            order(n, &exec)
        }
        "/hang" => std::future::pending().await,
        p if p.ends_with("/hang-once") => {
            let first = exec
                .idempotency_key
                .as_ref()
                .is_some_and(|k| shared.log.lock().unwrap().per_key.get(k) == Some(&1));
            if first {
                std::future::pending::<()>().await;
            }
            order(n, &exec)
        }
        "/drop" => {
            kill.0.notify_one();
            std::future::pending().await
        }
        p if p.starts_with("/fail/") => {
            let code: u16 = p["/fail/".len()..].parse().unwrap_or(500);
            let body = serde_json::json!({
                "error": format!("upstream failure {code}"),
                "execution": n,
            });
            json_response(code, body.to_string(), &[("x-execution", n.to_string())])
        }
        _ => {
            let body = serde_json::json!({
                "method": exec.method,
                "target": exec.target,
                "execution": n,
            });
            json_response(200, body.to_string(), &[("x-execution", n.to_string())])
        }
    }
}
