//! The proxy in process, in front of a small upstream on 127.0.0.1: what
//! the pure unit tests cannot show (the heartbeat, store failures, the
//! admin server).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::{Proxy, ProxyConfig};
use idem_engine::store::Op;
use idem_engine::{Engine, FaultKind, MemoryStore};

/// An upstream that counts its executions; `/slow` takes a second.
async fn upstream() -> (String, Arc<AtomicUsize>) {
    let count = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/slow",
            axum::routing::post(|State(n): State<Arc<AtomicUsize>>| async move {
                let k = n.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(Duration::from_millis(1000)).await;
                (StatusCode::CREATED, format!("slow {k}"))
            }),
        )
        .fallback(|State(n): State<Arc<AtomicUsize>>| async move {
            let k = n.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("done {k}"))
        })
        .with_state(count.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), count)
}

/// Serves `router` on a free port; returns its base URL.
async fn spawn(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(super::serve(listener, router, std::future::pending()));
    format!("http://{addr}")
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
}

impl Answer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn problem_type(&self) -> String {
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_default();
        v["type"].as_str().unwrap_or("").to_owned()
    }
}

/// The credentials of every request: the proxy refuses keyed requests
/// that name no client (`anonymous = "reject"`, the default).
const CLIENT: &str = "Bearer service-tests";

async fn send(method: &str, url: &str, key: Option<&str>) -> Answer {
    send_as(method, url, key, Some(CLIENT)).await
}

async fn send_as(method: &str, url: &str, key: Option<&str>, auth: Option<&str>) -> Answer {
    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).build_http();
    let mut req = Request::builder().method(method).uri(url);
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let response = client
        .request(req.body(Body::from("payload")).unwrap())
        .await
        .unwrap();
    let (head, body) = response.into_parts();
    Answer {
        status: head.status,
        headers: head.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

fn proxy(store: MemoryStore, config: ProxyConfig, upstream: &str) -> Proxy {
    let engine = Engine::builder().storage(store.clone()).build().unwrap();
    Proxy::new(engine, store, config, upstream.parse().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_keeps_a_slow_request_owned() {
    let (up, count) = upstream().await;
    let config = ProxyConfig::from_toml_str("[defaults]\nlease_ms = 300\n").unwrap();
    let base = spawn(proxy(MemoryStore::new(), config, &up).router()).await;
    let url = format!("{base}/slow");
    let first = tokio::spawn({
        let url = url.clone();
        async move { send("POST", &url, Some("k")).await }
    });
    // Well past the first lease (300 ms): without the heartbeat the key
    // would be taken over and executed again.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let dup = send("POST", &url, Some("k")).await;
    assert_eq!(dup.status, StatusCode::CONFLICT, "{}", dup.text());
    assert_eq!(
        dup.problem_type(),
        "tag:idem.invalid,2026:problems/request-in-progress"
    );
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.text(), "slow 1");
    let again = send("POST", &url, Some("k")).await;
    assert_eq!(again.text(), "slow 1");
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failure_is_503_and_nothing_is_forwarded() {
    let (up, count) = upstream().await;
    let store = MemoryStore::new();
    let p = proxy(store.clone(), ProxyConfig::default(), &up);
    let base = spawn(p.router()).await;
    let admin = spawn(p.admin_router()).await;

    let health = send("GET", &format!("{admin}/healthz"), None).await;
    assert_eq!(health.status, StatusCode::OK);
    assert_eq!(health.text(), "ok");
    // One read by key: no count, no scan.
    assert_eq!(store.calls(Op::Get), 1);
    assert_eq!(store.calls(Op::CountByStatus), 0);

    store.disconnect();
    let r = send("POST", &format!("{base}/orders"), Some("k")).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.text());
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(
        r.problem_type(),
        "tag:idem.invalid,2026:problems/store-unavailable"
    );
    assert!(!r.text().contains("connection lost"), "{}", r.text());
    assert_eq!(count.load(Ordering::SeqCst), 0);
    let health = send("GET", &format!("{admin}/healthz"), None).await;
    assert_eq!(health.status, StatusCode::SERVICE_UNAVAILABLE);

    store.reconnect();
    let r = send("POST", &format!("{base}/orders"), Some("k")).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(count.load(Ordering::SeqCst), 1);

    let metrics = send("GET", &format!("{admin}/metrics"), None).await;
    let text = metrics.text();
    assert!(
        text.contains(r#"idem_requests_total{decision="error"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"idem_requests_total{decision="execute"} 1"#),
        "{text}"
    );
    assert!(text.contains("idem_store_errors_total 2"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_complete_still_answers_the_caller() {
    let (up, count) = upstream().await;
    let store = MemoryStore::new();
    let base = spawn(proxy(store.clone(), ProxyConfig::default(), &up).router()).await;
    // begin reads and inserts; the compare-and-swap of complete fails.
    store.fail_next(
        Some(idem_engine::store::Op::CompareAndSwap),
        1,
        FaultKind::Unavailable,
    );
    let r = send("POST", &format!("{base}/orders"), Some("k")).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.text(), "done 1");
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_refused_policy_fails_at_start() {
    let store = MemoryStore::new();
    let engine = Engine::builder().storage(store.clone()).build().unwrap();
    let config =
        ProxyConfig::from_toml_str("[[routes]]\npath = \"/a\"\nbiz_type = \"bad type!\"\n")
            .unwrap();
    let err = Proxy::new(engine, store, config, "http://127.0.0.1:9".parse().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("routes[0]") && err.contains("biz"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_address_scopes_need_the_connection_address() {
    let (up, count) = upstream().await;
    let config =
        ProxyConfig::from_toml_str("[defaults]\nanonymous = \"client-address\"\n").unwrap();
    let p = proxy(MemoryStore::new(), config, &up);
    // Served by the proxy's own server: the peer address is known, and an
    // unidentified client gets a scope of its own.
    let base = spawn(p.router()).await;
    let r = send_as("POST", &format!("{base}/orders"), Some("k"), None).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    let again = send_as("POST", &format!("{base}/orders"), Some("k"), None).await;
    assert_eq!(again.text(), r.text());
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(count.load(Ordering::SeqCst), 1);
    // Served without it (plain axum::serve): refused, never shared.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, p.router()).await });
    let r = send_as("POST", &format!("http://{addr}/orders"), Some("k2"), None).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR, "{}", r.text());
    assert_eq!(
        r.problem_type(),
        "tag:idem.invalid,2026:problems/internal-error"
    );
    assert_eq!(count.load(Ordering::SeqCst), 1);
    // An identified client needs no address.
    let r = send("POST", &format!("http://{addr}/orders"), Some("k2")).await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.text());
    assert_eq!(count.load(Ordering::SeqCst), 2);
}
