//! The tower layer in front of an in-process axum app: every row of the
//! README's "What the proxy does" table, answered by the layer the way
//! `idem serve` answers it, with the handler's executions counted.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::routing::{get, post};
use idem::layer::{Claim, IdempotencyLayer};
use idem::proxy::{ProxyConfig, UpstreamError};
use idem::{Engine, ManualClock, MemoryStore, SqliteStore, Storage};
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

#[path = "support/build.rs"]
mod build;

/// The credentials every request sends unless a test says otherwise.
const CLIENT: &str = "Bearer layer-tests";

/// A time for the engine's clock.
const T0: u64 = 1_700_000_000_000;

/// The app's executions, and what a handler blocked in `/slow` waits for.
#[derive(Clone, Default)]
struct App {
    runs: Arc<AtomicUsize>,
    started: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
}

impl App {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn count(&self) -> usize {
        self.runs.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn router(&self) -> Router {
        Router::new()
            .route(
                "/orders",
                post(|State(app): State<App>, body: String| async move {
                    let n = app.count();
                    (
                        StatusCode::CREATED,
                        [("x-order", n.to_string())],
                        format!("order {n}: {body}"),
                    )
                })
                .put(|State(app): State<App>| async move { format!("put {}", app.count()) })
                .get(|State(app): State<App>| async move { format!("get {}", app.count()) }),
            )
            .route(
                "/status/{code}",
                post(
                    |State(app): State<App>,
                     axum::extract::Path(code): axum::extract::Path<u16>| async move {
                        let n = app.count();
                        let status =
                            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                        (status, format!("status {code}, run {n}"))
                    },
                ),
            )
            .route(
                "/slow",
                post(|State(app): State<App>| async move {
                    let n = app.count();
                    app.started.notify_one();
                    app.release.notified().await;
                    (StatusCode::CREATED, format!("slow {n}"))
                }),
            )
            .route(
                "/claim",
                post(
                    |State(app): State<App>, Extension(claim): Extension<Claim>| async move {
                        app.count();
                        format!("fencing {}", claim.ticket.fencing_token)
                    },
                ),
            )
            .route(
                "/panic",
                post(|State(app): State<App>| async move {
                    app.count();
                    if app.runs() > 0 {
                        panic!("a handler bug");
                    }
                    "unreachable"
                }),
            )
            .route("/health", get(|| async { "ok" }))
            .with_state(self.clone())
    }
}

/// What a client got.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn problem_type(&self) -> String {
        let v: serde_json::Value = serde_json::from_str(&self.body).unwrap_or_default();
        let t = v["type"].as_str().unwrap_or("");
        t.strip_prefix("tag:idem.invalid,2026:problems/")
            .unwrap_or(t)
            .to_owned()
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

/// One request built the usual way: a JSON body, the test client's
/// credentials, an optional key.
fn request(method: &str, path: &str, key: Option<&str>, body: &str) -> Request<Body> {
    let mut r = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .header("authorization", CLIENT);
    if let Some(k) = key {
        r = r.header("idempotency-key", k);
    }
    r.body(Body::from(body.to_owned()))
        .unwrap_or_else(|_| Request::new(Body::empty()))
}

async fn send(router: &Router, request: Request<Body>) -> Result<Answer> {
    let response: Response<Body> = router.clone().oneshot(request).await?;
    let (head, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await?;
    Ok(Answer {
        status: head.status,
        headers: head.headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn engine(store: impl Storage + Clone) -> Result<Engine> {
    Ok(Engine::builder()
        .storage(store)
        .clock(ManualClock::new(T0))
        .build()?)
}

fn layer(store: MemoryStore, toml: &str) -> Result<IdempotencyLayer> {
    Ok(IdempotencyLayer::new(
        engine(store)?,
        ProxyConfig::from_toml_str(toml)?,
    )?)
}

/// The app behind a layer on a fresh in-memory store.
fn app(toml: &str) -> Result<(App, Router, MemoryStore)> {
    let store = MemoryStore::new();
    let app = App::default();
    let router = app.router().layer(layer(store.clone(), toml)?);
    Ok((app, router, store))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safe_methods_pass_straight_through() -> Result<()> {
    let (app, router, _) = app("")?;
    for _ in 0..2 {
        let r = send(&router, request("GET", "/orders", Some("k"), "")).await?;
        assert_eq!(r.status, StatusCode::OK);
        assert!(!r.replayed());
    }
    assert_eq!(app.runs(), 2, "GET is never deduplicated");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_needs_a_key_and_put_only_when_it_has_one() -> Result<()> {
    let (app, router, _) = app("")?;
    let r = send(&router, request("POST", "/orders", None, "{}")).await?;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", r.body);
    assert_eq!(r.problem_type(), "key-missing");
    assert_eq!(app.runs(), 0);

    let (_, optional, _) = self::app("[defaults]\nkey = \"optional\"\n")?;
    let r = send(&optional, request("POST", "/orders", None, "{}")).await?;
    assert_eq!(r.status, StatusCode::CREATED);

    for _ in 0..2 {
        let r = send(&router, request("PUT", "/orders", None, "")).await?;
        assert_eq!(r.status, StatusCode::OK);
    }
    assert_eq!(app.runs(), 2, "PUT without a key passes through");
    let first = send(&router, request("PUT", "/orders", Some("p"), "{}")).await?;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    let again = send(&router, request("PUT", "/orders", Some("p"), "{}")).await?;
    assert_eq!(again.body, first.body);
    assert!(again.replayed());
    assert_eq!(app.runs(), 3, "PUT with a key runs once");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_keys_and_unidentified_clients_are_refused() -> Result<()> {
    let (app, router, _) = app("")?;
    for bad in ["\"unterminated", "a b", "\"\""] {
        let r = send(&router, request("POST", "/orders", Some(bad), "{}")).await?;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {}", r.body);
        assert_eq!(r.problem_type(), "key-invalid", "{bad}");
    }
    let mut twice = request("POST", "/orders", Some("a"), "{}");
    twice
        .headers_mut()
        .append("idempotency-key", "b".parse().context("header")?);
    let r = send(&router, twice).await?;
    assert_eq!(r.problem_type(), "key-invalid");

    let mut anonymous = request("POST", "/orders", Some("k"), "{}");
    anonymous.headers_mut().remove("authorization");
    let r = send(&router, anonymous).await?;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{}", r.body);
    assert_eq!(r.problem_type(), "client-unidentified");
    assert_eq!(r.headers["www-authenticate"], "Bearer realm=\"idem\"");
    assert_eq!(app.runs(), 0, "nothing reached the handler");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_gets_the_stored_answer_and_a_changed_request_422() -> Result<()> {
    let (app, router, _) = app("")?;
    let first = send(
        &router,
        request("POST", "/orders", Some("k1"), r#"{"a":1}"#),
    )
    .await?;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, r#"order 1: {"a":1}"#);
    assert!(!first.replayed());
    // The same JSON spelled differently is the same request.
    let again = send(
        &router,
        request("POST", "/orders", Some("k1"), r#"{ "a" : 1.0 }"#),
    )
    .await?;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["x-order"], "1");
    assert!(again.replayed());
    assert_eq!(app.runs(), 1);

    let other_body = send(
        &router,
        request("POST", "/orders", Some("k1"), r#"{"a":2}"#),
    )
    .await?;
    assert_eq!(other_body.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other_body.problem_type(), "key-reused");
    let other_path = send(
        &router,
        request("POST", "/orders?x=1", Some("k1"), r#"{"a":1}"#),
    )
    .await?;
    assert_eq!(other_path.problem_type(), "key-reused");
    assert_eq!(app.runs(), 1);

    // Another client's same key is another key.
    let mut other = request("POST", "/orders", Some("k1"), r#"{"a":1}"#);
    other
        .headers_mut()
        .insert("authorization", "Bearer someone-else".parse()?);
    let r = send(&router, other).await?;
    assert!(!r.replayed());
    assert_eq!(app.runs(), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_while_the_first_runs_is_409_and_a_lost_client_does_not_cancel() -> Result<()> {
    let idem = layer(MemoryStore::new(), "")?;
    let app = App::default();
    let router = app.router().layer(idem.clone());
    // The first request's client gives up while the handler runs.
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, request("POST", "/slow", Some("s"), "{}")).await }
    });
    app.started.notified().await;
    first.abort();

    let dup = send(&router, request("POST", "/slow", Some("s"), "{}")).await?;
    assert_eq!(dup.status, StatusCode::CONFLICT, "{}", dup.body);
    assert_eq!(dup.problem_type(), "request-in-progress");
    assert!(dup.headers.contains_key("retry-after"));

    // The handler finishes although its caller is gone; the answer is
    // stored for the retry.
    app.release.notify_one();
    // Waits for the claimed request's own task to store its outcome.
    idem.finish().await;
    let replay = send(&router, request("POST", "/slow", Some("s"), "{}")).await?;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.body, "slow 1");
    assert!(replay.replayed());
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_gets_a_500_and_its_key_is_not_run_again() -> Result<()> {
    let (app, router, store) = app("")?;
    let first = send(&router, request("POST", "/panic", Some("p"), "{}")).await?;
    assert_eq!(
        first.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        first.body
    );
    assert_eq!(first.problem_type(), "internal-error");
    // The handler may have taken effect before it panicked: the key stays
    // claimed until its lease ends, and a retry is not run meanwhile.
    let retry = send(&router, request("POST", "/panic", Some("p"), "{}")).await?;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{}", retry.body);
    assert_eq!(retry.problem_type(), "request-in-progress");
    assert_eq!(app.runs(), 1);
    assert_eq!(store.len(), 1);
    // The service still answers other requests.
    let other = send(&router, request("POST", "/orders", Some("o"), "{}")).await?;
    assert_eq!(other.status, StatusCode::CREATED);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_the_limit_is_413_and_stores_nothing() -> Result<()> {
    let (app, router, _) = app("max_body_bytes = 16\n")?;
    let big = "x".repeat(17);
    let r = send(&router, request("POST", "/orders", Some("b"), &big)).await?;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", r.body);
    assert_eq!(r.problem_type(), "body-too-large");
    let r = send(&router, request("POST", "/orders", Some("b"), "{}")).await?;
    assert_eq!(r.status, StatusCode::CREATED, "the key was never claimed");
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_statuses_are_stored_or_not_as_the_proxy_stores_them() -> Result<()> {
    let (app, router, _) = app("")?;
    // 5xx: returned, not stored; the retry runs again.
    for (code, stored) in [
        (500, false),
        (503, false),
        (409, false),
        (429, false),
        (404, true),
        (400, true),
        (202, true),
    ] {
        let key = format!("status-{code}");
        let path = format!("/status/{code}");
        let before = app.runs();
        let first = send(&router, request("POST", &path, Some(&key), "{}")).await?;
        assert_eq!(first.status.as_u16(), code);
        let again = send(&router, request("POST", &path, Some(&key), "{}")).await?;
        assert_eq!(again.status.as_u16(), code);
        if stored {
            assert!(again.replayed(), "{code} is stored and replayed");
            assert_eq!(again.body, first.body);
            assert_eq!(app.runs(), before + 1, "{code}");
        } else {
            assert!(!again.replayed(), "{code} is never stored");
            assert_eq!(app.runs(), before + 2, "{code}");
        }
    }
    // server_errors = "store": a 5xx is final, stored and replayed.
    let (stored_app, store_5xx, _) = self::app("[defaults]\nserver_errors = \"store\"\n")?;
    send(&store_5xx, request("POST", "/status/500", Some("s5"), "{}")).await?;
    let again = send(&store_5xx, request("POST", "/status/500", Some("s5"), "{}")).await?;
    assert_eq!(again.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(again.replayed());
    assert_eq!(stored_app.runs(), 1);
    Ok(())
}

/// A service that fails every call with `error`, counting the calls.
fn failing(
    calls: Arc<AtomicUsize>,
    error: fn() -> idem::layer::BoxError,
) -> BoxCloneSyncService<Request<Body>, Response<Body>, idem::layer::BoxError> {
    BoxCloneSyncService::new(tower::service_fn(move |_request: Request<Body>| {
        calls.fetch_add(1, Ordering::SeqCst);
        async move { Err::<Response<Body>, _>(error()) }
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inner_service_that_never_got_the_request_releases_the_key() -> Result<()> {
    let store = MemoryStore::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let service = tower::Layer::layer(
        &layer(store, "")?,
        failing(calls.clone(), || {
            Box::new(UpstreamError::NotSent("connection refused".into()))
        }),
    );
    let router = Router::new().fallback_service(service);
    for _ in 0..2 {
        let r = send(&router, request("POST", "/orders", Some("n"), "{}")).await?;
        assert_eq!(r.status, StatusCode::BAD_GATEWAY, "{}", r.body);
        assert_eq!(r.problem_type(), "upstream-unavailable");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2, "a released key runs again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inner_error_after_the_request_leaves_the_outcome_unknown() -> Result<()> {
    let errors: [fn() -> idem::layer::BoxError; 3] = [
        || Box::new(std::io::Error::other("connection reset")),
        || Box::new(UpstreamError::Timeout),
        || Box::new(tower::timeout::error::Elapsed::new()),
    ];
    for error in errors {
        let store = MemoryStore::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let service = tower::Layer::layer(&layer(store, "")?, failing(calls.clone(), error));
        let router = Router::new().fallback_service(service);
        let r = send(&router, request("POST", "/orders", Some("u"), "{}")).await?;
        assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", r.body);
        assert_eq!(r.problem_type(), "outcome-unknown");
        let dup = send(&router, request("POST", "/orders", Some("u"), "{}")).await?;
        assert_eq!(dup.status, StatusCode::CONFLICT, "{}", dup.body);
        assert_eq!(dup.problem_type(), "outcome-unknown");
        assert_eq!(calls.load(Ordering::SeqCst), 1, "never run blindly again");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_outcome_is_not_run_again_after_its_lease_unless_the_policy_says_so()
-> Result<()> {
    // (policy, runs after the lease ended): by default a timed-out request
    // stays blocked although `expired_lease` is take-over; only an
    // explicit `outcome_unknown = "take-over"` runs it again.
    for (toml, runs) in [
        ("[defaults]\nlease_ms = 1000\n", 1),
        (
            "[defaults]\nlease_ms = 1000\noutcome_unknown = \"manual\"\n",
            1,
        ),
        (
            "[defaults]\nlease_ms = 1000\noutcome_unknown = \"take-over\"\n",
            2,
        ),
    ] {
        let store = MemoryStore::new();
        let clock = ManualClock::new(T0);
        let engine = Engine::builder()
            .storage(store)
            .clock(clock.clone())
            .build()?;
        let calls = Arc::new(AtomicUsize::new(0));
        let layer = IdempotencyLayer::new(engine, ProxyConfig::from_toml_str(toml)?)?;
        let service = tower::Layer::layer(
            &layer,
            failing(calls.clone(), || Box::new(UpstreamError::Timeout)),
        );
        let router = Router::new().fallback_service(service);
        let r = send(&router, request("POST", "/orders", Some("u"), "{}")).await?;
        assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT, "{}", r.body);
        // Long past the lease, and past the retention of settled keys.
        clock.advance(1000 * 3600 * 48);
        let dup = send(&router, request("POST", "/orders", Some("u"), "{}")).await?;
        assert_eq!(calls.load(Ordering::SeqCst), runs, "{toml}");
        if runs == 1 {
            assert_eq!(dup.status, StatusCode::CONFLICT, "{}", dup.body);
            assert_eq!(dup.problem_type(), "outcome-unknown", "{toml}");
        } else {
            assert_eq!(dup.status, StatusCode::GATEWAY_TIMEOUT, "{}", dup.body);
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failure_is_503_and_the_handler_never_runs() -> Result<()> {
    let (app, router, store) = app("")?;
    store.disconnect();
    let r = send(&router, request("POST", "/orders", Some("k"), "{}")).await?;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    assert_eq!(r.problem_type(), "store-unavailable");
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(app.runs(), 0);
    store.reconnect();
    let r = send(&router, request("POST", "/orders", Some("k"), "{}")).await?;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(app.runs(), 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_sees_its_claim_and_routes_pick_their_biz_type() -> Result<()> {
    let store = MemoryStore::new();
    let toml = "[[routes]]\nmethod = \"POST\"\npath = \"/claim\"\nbiz_type = \"claim.test\"\n";
    let idem = layer(store.clone(), toml)?;
    let app = App::default();
    let router = app.router().layer(idem.clone());
    let r = send(&router, request("POST", "/claim", Some("c"), "{}")).await?;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(r.body, "fencing 1");
    let key = idem::RecordKey::new(format!("auth:{}", sha256_hex(CLIENT)), "claim.test", "c");
    let status = idem
        .engine()
        .inspect(&key)?
        .context("the key is stored under the route's biz type")?;
    assert_eq!(status.status, idem::Status::Succeeded);
    Ok(())
}

fn sha256_hex(text: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_over_a_real_connection_with_metrics() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("idem.db"), Default::default())?;
    let idem = IdempotencyLayer::new(engine(store)?, ProxyConfig::default())?;
    let app = App::default();
    let router = app.router().layer(idem.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Body>();
    let mut bodies = Vec::new();
    for _ in 0..3 {
        let mut r = request("POST", "/orders", Some("sqlite"), r#"{"sku":"A1"}"#);
        *r.uri_mut() = format!("http://{addr}/orders").parse()?;
        let answer = client.request(r).await?;
        let replayed = answer.headers().contains_key("idempotent-replayed");
        let body = axum::body::to_bytes(Body::new(answer.into_body()), usize::MAX).await?;
        bodies.push((replayed, String::from_utf8_lossy(&body).into_owned()));
    }
    assert_eq!(bodies[0], (false, r#"order 1: {"sku":"A1"}"#.to_owned()));
    assert_eq!(bodies[1], (true, bodies[0].1.clone()));
    assert_eq!(bodies[2], bodies[1]);
    assert_eq!(app.runs(), 1);
    let metrics = idem.metrics().render();
    assert!(
        metrics.contains(r#"idem_requests_total{decision="execute"} 1"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"idem_requests_total{decision="replay"} 2"#),
        "{metrics}"
    );
    server.abort();
    idem.finish().await;
    Ok(())
}

/// On SQLite with group commit, 40 keys sent 3 times each, all 120 requests
/// at once: claims that find a group being written move to blocking
/// threads and share the next group's commit; each key still runs once,
/// its duplicates get its stored answer or 409, and every key replays
/// afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_group_commit_concurrent_first_requests_run_once_per_key() -> Result<()> {
    const KEYS: usize = 40;
    let dir = tempfile::tempdir()?;
    let options = idem::SqliteOptions {
        group_commit: true,
        ..Default::default()
    };
    let store = SqliteStore::open(dir.path().join("idem.db"), options)?;
    let idem = IdempotencyLayer::new(engine(store)?, ProxyConfig::default())?;
    let app = App::default();
    let router = app.router().layer(idem.clone());
    let mut calls = tokio::task::JoinSet::new();
    for copy in 0..3 {
        for k in 0..KEYS {
            let router = router.clone();
            calls.spawn(async move {
                let key = format!("group-{k}");
                let body = format!(r#"{{"sku":"{k}"}}"#);
                (
                    copy,
                    k,
                    send(&router, request("POST", "/orders", Some(&key), &body)).await,
                )
            });
        }
    }
    let mut executed = vec![0usize; KEYS];
    while let Some(joined) = calls.join_next().await {
        let (_, k, answer) = joined?;
        let answer = answer?;
        match answer.status {
            StatusCode::CREATED if !answer.replayed() => executed[k] += 1,
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => assert_eq!(answer.problem_type(), "request-in-progress"),
            other => panic!("key {k}: unexpected {other}: {}", answer.body),
        }
    }
    assert_eq!(executed, vec![1; KEYS], "one execution per key");
    assert_eq!(app.runs(), KEYS);
    for k in 0..KEYS {
        let body = format!(r#"{{"sku":"{k}"}}"#);
        let key = format!("group-{k}");
        let answer = send(&router, request("POST", "/orders", Some(&key), &body)).await?;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(answer.replayed(), "key {k} replays");
        assert!(answer.body.ends_with(&format!(r#"{{"sku":"{k}"}}"#)));
    }
    assert_eq!(app.runs(), KEYS);
    idem.finish().await;
    Ok(())
}

/// `examples/axum_service.rs`, as the README tells a user to run it, checks
/// its own answers: one order for a request, its retry and a changed
/// request.
#[test]
fn the_axum_example_runs_once_per_key() -> Result<()> {
    // Over the whole workspace, as `cargo test --workspace` builds it:
    // after that, nothing compiles.
    let run = build::workspace_build()
        .example("axum_service")
        .run()
        .map_err(|e| anyhow::anyhow!("building the example failed: {e:#}"))?;
    let out = run.command().arg("--check").output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("first: 201 replayed=false"), "{stdout}");
    assert!(stdout.contains("retry: 201 replayed=true"), "{stdout}");
    assert!(stdout.contains("changed: 422"), "{stdout}");
    Ok(())
}

// ---------------------------------------------------------------------------
// An answer given while the store was down is never produced again (the
// seed's compensation path: a result already produced is not produced
// twice).

/// A router whose `/orders` handler counts its runs and, on its first run,
/// cuts the store off after doing its work: the answer is given, its
/// outcome cannot be stored.
fn outage_app(store: &MemoryStore, runs: &Arc<AtomicUsize>) -> Router {
    let (store, runs) = (store.clone(), runs.clone());
    Router::new().route(
        "/orders",
        post(move || {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                store.disconnect();
            }
            async move { (StatusCode::CREATED, format!("order {n}")) }
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_the_store_could_not_take_is_replayed_never_run_again() -> Result<()> {
    let store = MemoryStore::new();
    let clock = ManualClock::new(T0);
    let engine = Engine::builder()
        .storage(store.clone())
        .clock(clock.clone())
        .build()?;
    let lease_ms = 1000;
    let config = ProxyConfig::from_toml_str(&format!("[defaults]\nlease_ms = {lease_ms}\n"))?;
    let runs = Arc::new(AtomicUsize::new(0));
    let router = outage_app(&store, &runs).layer(IdempotencyLayer::new(engine, config)?);
    let first = send(&router, request("POST", "/orders", Some("k"), "{}")).await?;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    assert_eq!(first.body, "order 1");
    // The store is still down, ten leases later: a retry is refused, and
    // does not run.
    clock.advance(10 * lease_ms);
    let refused = send(&router, request("POST", "/orders", Some("k"), "{}")).await?;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        refused.body
    );
    assert_eq!(refused.problem_type(), "store-unavailable");
    // The store is back, the lease long over: the retry gets the first
    // answer, not a second run.
    store.reconnect();
    let again = send(&router, request("POST", "/orders", Some("k"), "{}")).await?;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.body);
    assert_eq!(again.body, "order 1");
    assert!(again.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the action ran once");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_answer_reaches_the_store_by_itself_once_it_is_back() -> Result<()> {
    let store = MemoryStore::new();
    let engine = Engine::builder()
        .storage(store.clone())
        .clock(ManualClock::new(T0))
        .build()?;
    let layer = IdempotencyLayer::new(engine, ProxyConfig::default())?;
    let runs = Arc::new(AtomicUsize::new(0));
    let router = outage_app(&store, &runs).layer(layer.clone());
    let first = send(&router, request("POST", "/orders", Some("k"), "{}")).await?;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(layer.metrics().render().contains("idem_pending_outcomes 1"));
    store.reconnect();
    // No request comes: the background retry stores it (its pauses grow
    // to one second at most).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let succeeded = || -> Result<u64> {
        Ok(store
            .count_by_status()?
            .iter()
            .find(|(s, _)| *s == idem::Status::Succeeded)
            .map_or(0, |(_, n)| *n))
    };
    while succeeded()? == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the held outcome was never stored"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(layer.metrics().render().contains("idem_pending_outcomes 0"));
    Ok(())
}

#[test]
fn a_held_answer_survives_a_restart_through_the_outcome_journal() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let journal = dir.path().join("outcomes");
    let config = || -> Result<ProxyConfig> {
        Ok(ProxyConfig {
            outcome_journal: Some(journal.clone()),
            ..ProxyConfig::default()
        })
    };
    let store = MemoryStore::new();
    let clock = ManualClock::new(T0);
    let engine = || -> Result<Engine> {
        Ok(Engine::builder()
            .storage(store.clone())
            .clock(clock.clone())
            .build()?)
    };
    let runs = Arc::new(AtomicUsize::new(0));
    // The first run answers, cannot store, and stops (its runtime and
    // every task on it are gone, as after a crash).
    {
        let runtime = tokio::runtime::Runtime::new()?;
        let router = outage_app(&store, &runs).layer(IdempotencyLayer::new(engine()?, config()?)?);
        let first = runtime.block_on(send(&router, request("POST", "/orders", Some("k"), "{}")))?;
        assert_eq!(first.body, "order 1");
    }
    assert_eq!(
        std::fs::read_to_string(&journal)?.lines().count(),
        1,
        "one outcome held"
    );
    // A new layer on the same journal, the store back, long after the
    // lease: the outcome is stored first, then replayed.
    store.reconnect();
    clock.advance(10 * 60_000);
    let runtime = tokio::runtime::Runtime::new()?;
    let layer = IdempotencyLayer::new(engine()?, config()?)?;
    assert_eq!(
        runtime.block_on(layer.recover_outcomes()),
        0,
        "nothing left held"
    );
    assert_eq!(std::fs::read_to_string(&journal)?, "");
    let router = outage_app(&store, &runs).layer(layer);
    let again = runtime.block_on(send(&router, request("POST", "/orders", Some("k"), "{}")))?;
    assert_eq!(again.body, "order 1");
    assert!(again.replayed());
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    Ok(())
}
