//! An axum service made idempotent with one `.layer(...)`: `POST /orders`
//! creates an order once per `Idempotency-Key`, whatever the client
//! retries; the keys live in a SQLite file.
//!
//! ```text
//! cargo run --example axum_service            # serves on 127.0.0.1:3000
//! curl -i -X POST localhost:3000/orders -H 'Authorization: Bearer me' \
//!      -H 'Idempotency-Key: "order-1"' -H 'Content-Type: application/json' \
//!      -d '{"sku":"A1","qty":2}'
//! ```
//!
//! Send the same `curl` again: the same answer comes back with
//! `Idempotent-Replayed: true`, and no second order is made. Change the body
//! and keep the key: 422 `key-reused`.
//!
//! `cargo run --example axum_service -- --check` serves on a free port,
//! sends those three requests itself, prints the answers and exits (non-zero
//! if any answer is not the expected one).

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use axum::extract::{Extension, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idem::layer::{Claim, IdempotencyLayer};
use idem::proxy::ProxyConfig;
use idem::{Engine, SqliteStore};
use serde::Deserialize;

/// Where the service listens unless `--listen` says otherwise.
const DEFAULT_LISTEN: &str = "127.0.0.1:3000";

/// The idempotency settings: `POST /orders` keys are of biz type
/// `order.create`; everything else keeps the defaults (POST and PATCH need
/// a key, keys live 24 h).
const CONFIG: &str = r#"
[[routes]]
method = "POST"
path = "/orders"
biz_type = "order.create"
"#;

/// The business data: the orders made, in memory for the example.
#[derive(Clone, Default)]
struct Orders(Arc<Mutex<Vec<String>>>);

#[derive(Deserialize)]
struct NewOrder {
    sku: String,
    qty: u32,
}

/// Makes an order. The layer runs this at most once per key; the claim
/// carries the key's fencing token for writes that want to check it.
async fn create_order(
    State(orders): State<Orders>,
    Extension(claim): Extension<Claim>,
    Json(order): Json<NewOrder>,
) -> (StatusCode, Json<serde_json::Value>) {
    let mut all = orders.0.lock().unwrap_or_else(|p| p.into_inner());
    all.push(format!("{} x {}", order.qty, order.sku));
    let id = all.len();
    (
        StatusCode::CREATED,
        Json(serde_json::json!({
            "order": id,
            "sku": order.sku,
            "qty": order.qty,
            "fencing_token": claim.ticket.fencing_token,
        })),
    )
}

async fn list_orders(State(orders): State<Orders>) -> Json<Vec<String>> {
    Json(orders.0.lock().unwrap_or_else(|p| p.into_inner()).clone())
}

/// The service: the business routes, then the idempotency layer.
fn app(db: &std::path::Path) -> Result<Router> {
    let store = SqliteStore::open(db, Default::default())?;
    let engine = Engine::builder().storage(store).build()?;
    let idempotency = IdempotencyLayer::new(engine, ProxyConfig::from_toml_str(CONFIG)?)?;
    Ok(Router::new()
        .route("/orders", post(create_order).get(list_orders))
        .with_state(Orders::default())
        .layer(idempotency))
}

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let mut listen = DEFAULT_LISTEN.to_owned();
    let mut check = false;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--check" => check = true,
            "--listen" => listen = args.next().context("--listen needs an address")?,
            other => bail!("unknown argument '{other}' (expected --check or --listen ADDR)"),
        }
    }
    let dir = std::env::temp_dir().join(format!("idem-axum-service-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let db = dir.join("idem.db");
    let app = app(&db)?;
    if check {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        let result = self_check(&format!("http://{addr}")).await;
        let _ = std::fs::remove_dir_all(&dir);
        return result;
    }
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!(
        "orders service on http://{listen} (keys in {})",
        db.display()
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// Sends the first request, its retry and a changed request with the same
/// key; checks the three answers.
async fn self_check(base: &str) -> Result<()> {
    let send = |body: &'static str| {
        let url = format!("{base}/orders");
        tokio::task::spawn_blocking(move || -> Result<(u16, bool, String)> {
            let agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .build()
                .new_agent();
            let mut response = agent
                .post(&url)
                .header("authorization", "Bearer me")
                .header("idempotency-key", "\"order-1\"")
                .header("content-type", "application/json")
                .send(body)?;
            let replayed = response.headers().contains_key("idempotent-replayed");
            let text = response.body_mut().read_to_string()?;
            Ok((response.status().as_u16(), replayed, text))
        })
    };
    let first = send(r#"{"sku":"A1","qty":2}"#).await??;
    let retry = send(r#"{"qty":2,"sku":"A1"}"#).await??;
    let changed = send(r#"{"sku":"A1","qty":3}"#).await??;
    for (name, answer) in [("first", &first), ("retry", &retry), ("changed", &changed)] {
        println!("{name}: {} replayed={} {}", answer.0, answer.1, answer.2);
    }
    if first.0 != 201 || first.1 {
        bail!("the first request was not executed: {first:?}");
    }
    if retry != (201, true, first.2.clone()) {
        bail!("the retry was not replayed: {retry:?}");
    }
    if changed.0 != 422 || !changed.2.contains("key-reused") {
        bail!("the changed request was not refused with 422 key-reused: {changed:?}");
    }
    println!("ok: one order for three requests");
    Ok(())
}
