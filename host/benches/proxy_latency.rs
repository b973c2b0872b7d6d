//! The latency `idem serve` adds in front of an upstream.
//!
//! Three request kinds are measured interleaved, one after the other in the
//! same run, over one keep-alive connection each: straight to the upstream,
//! through the proxy with a new key (first request: claim, forward, store),
//! and through the proxy with a completed key (replay: the upstream is not
//! called). The figures are medians and 99th percentiles of many samples;
//! the machine is shared, so compare the columns of one run, not runs.
//!
//! Run with `cargo bench -p idem --bench proxy_latency` (add `-- --samples N`
//! to change the sample count; `--quick` is what CI runs to check that the
//! bench still works).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use axum::Router;
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem::proxy::{Proxy, ProxyConfig};
use idem::{Engine, SqliteOptions, SqliteStore};

/// Samples per request kind by default: enough for a stable median and a
/// meaningful p99 in a few seconds.
const DEFAULT_SAMPLES: usize = 2_000;

/// Samples per kind with `--quick`, the smoke run CI does.
const QUICK_SAMPLES: usize = 20;

/// Requests sent before measuring, to warm connections, caches and the
/// guest instances.
const WARMUP: usize = 200;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn upstream() -> Result<SocketAddr> {
    let counter = Arc::new(AtomicU64::new(0));
    let app = Router::new().route(
        "/orders",
        post(move || {
            let n = counter.fetch_add(1, Ordering::Relaxed);
            async move {
                (
                    axum::http::StatusCode::CREATED,
                    [("content-type", "application/json")],
                    format!("{{\"order\":\"order-{n}\"}}"),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

async fn post_order(client: &HttpClient, addr: SocketAddr, key: &str) -> Result<Duration> {
    let req = hyper::Request::post(format!("http://{addr}/orders"))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"{\"sku\":\"A1\",\"qty\":2}")))?;
    let started = Instant::now();
    let resp = client.request(req).await?;
    let status = resp.status();
    resp.into_body().collect().await?;
    let took = started.elapsed();
    anyhow::ensure!(status.as_u16() == 201, "unexpected status {status}");
    Ok(took)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let samples = if args.iter().any(|a| a == "--quick") {
        QUICK_SAMPLES
    } else {
        args.iter()
            .position(|a| a == "--samples")
            .and_then(|i| args.get(i + 1))
            .map(|n| n.parse())
            .transpose()?
            .unwrap_or(DEFAULT_SAMPLES)
    };
    let dir = tempfile::tempdir()?;
    let up = upstream().await?;
    let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())?;
    let engine = Engine::builder().storage(store.clone()).build()?;
    let proxy = Proxy::new(
        engine,
        store,
        ProxyConfig::default(),
        format!("http://{up}").parse()?,
    )?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let proxied = listener.local_addr()?;
    let router = proxy.router();
    tokio::spawn(idem::proxy::serve(listener, router, std::future::pending()));

    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    // The replayed key, completed once.
    post_order(&client, proxied, "replayed-key")
        .await
        .context("first request through the proxy")?;
    for i in 0..WARMUP {
        post_order(&client, up, &format!("warm-direct-{i}")).await?;
        post_order(&client, proxied, &format!("warm-first-{i}")).await?;
        post_order(&client, proxied, "replayed-key").await?;
    }
    let (mut direct, mut first, mut replay) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..samples {
        direct.push(post_order(&client, up, &format!("direct-{i}")).await?);
        first.push(post_order(&client, proxied, &format!("first-{i}")).await?);
        replay.push(post_order(&client, proxied, "replayed-key").await?);
    }
    for v in [&mut direct, &mut first, &mut replay] {
        v.sort();
    }
    let base = percentile(&direct, 0.5);
    println!("proxy latency, {samples} interleaved samples per kind (µs)");
    println!(
        "{:<28} {:>10} {:>10} {:>14}",
        "kind", "p50", "p99", "p50 - direct"
    );
    let mut json = Vec::new();
    for (name, v) in [
        ("direct to upstream", &direct),
        ("proxy, first request", &first),
        ("proxy, replay", &replay),
    ] {
        let (p50, p99) = (percentile(v, 0.5), percentile(v, 0.99));
        let added = micros(p50) - micros(base);
        println!(
            "{name:<28} {:>10.1} {:>10.1} {:>+14.1}",
            micros(p50),
            micros(p99),
            added
        );
        json.push(serde_json::json!({
            "kind": name, "p50_us": micros(p50), "p99_us": micros(p99), "added_p50_us": added,
        }));
    }
    let out =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/idem-proxy-latency.json");
    std::fs::write(&out, serde_json::to_vec_pretty(&json)?)?;
    println!("written to {}", out.display());
    Ok(())
}
