//! A small upstream that was never written to be idempotent: every POST to
//! `/orders` creates a new order. Put `idem serve` in front of it and
//! retried POSTs stop creating duplicates (see the README's "Running
//! `idem serve`" section).
//!
//! Run with `cargo run --example upstream` (listens on 127.0.0.1:9000, or
//! the address given as the first argument).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;

#[tokio::main]
async fn main() -> Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:9000".into());
    let orders = Arc::new(AtomicU64::new(1000));
    let app = Router::new().route(
        "/orders",
        post(move |body: String| {
            let n = orders.fetch_add(1, Ordering::SeqCst) + 1;
            println!("created order-{n} from {body}");
            async move {
                (
                    StatusCode::CREATED,
                    [("content-type", "application/json")],
                    format!("{{\"order\":\"order-{n}\"}}\n"),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("upstream listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
