//! End-to-end tests of `idem serve`, the HTTP idempotency proxy: the real
//! `idem` binary in front of a real upstream (`support/upstream.rs`), both
//! on 127.0.0.1, driven by a blocking HTTP client (`support/serve.rs`).
//!
//! Each test has its own upstream, database and proxy process, and counts
//! what the upstream executed.

#[path = "support/serve.rs"]
mod serve;
#[path = "support/upstream.rs"]
mod upstream;
#[path = "support/world.rs"]
mod world;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serve::{Req, Resp, Serve, TEST_CLIENT, TestClock, idem, idem_ok};
use upstream::{Upstream, refused_port};
use world::World;

/// How long a test may wait for something to arrive.
const ARRIVAL: Duration = Duration::from_secs(10);

const BODY: &str = r#"{"sku":"A1-secret-sku","qty":2}"#;

impl World {
    fn db(&self) -> &str {
        self.db.to_str().expect("utf-8 temp path")
    }

    /// `idem ARGS... --db DB --json` on this world's database and clock:
    /// the command's JSON output.
    fn idem_json(&self, args: &[&str]) -> Result<serde_json::Value> {
        let common = ["--db", self.db(), "--json"];
        idem_ok(&[args, &common[..], &self.clock.args()].concat())?.json()
    }
}

/// A first answer: executed, not replayed.
fn expect_fresh(r: &Resp, status: u16) -> Result<()> {
    r.expect_status(status)?;
    ensure!(!r.replayed(), "a first answer marked as replayed: {r:?}");
    Ok(())
}

/// Headers a replay may add or set anew: the marker, and what belongs to
/// the connection or the message framing rather than to the response.
const NOT_REPLAYED: [&str; 6] = [
    "idempotent-replayed",
    "date",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
];

/// A replay of `first`: same status, same body bytes, the same headers
/// (but those in [`NOT_REPLAYED`]), and `Idempotent-Replayed: true`.
fn expect_replay_of(r: &Resp, first: &Resp) -> Result<()> {
    ensure!(
        r.replayed(),
        "expected Idempotent-Replayed: true, got status {} headers {:?} body {:?}",
        r.status,
        r.headers,
        r.text()
    );
    r.expect_status(first.status)?;
    ensure!(
        r.body == first.body,
        "replayed body differs: {:?} vs {:?}",
        r.text(),
        first.text()
    );
    let names = first.headers.keys().chain(r.headers.keys());
    for name in names.filter(|n| !NOT_REPLAYED.contains(&n.as_str())) {
        let replayed: Vec<_> = r.headers.get_all(name).iter().collect();
        let original: Vec<_> = first.headers.get_all(name).iter().collect();
        ensure!(
            replayed == original,
            "header {name}: replayed {replayed:?}, first {original:?}"
        );
    }
    Ok(())
}

/// No hop-by-hop header of the upstream's came through.
fn expect_no_hop_headers(r: &Resp) -> Result<()> {
    for name in ["x-upstream-hop", "keep-alive"] {
        ensure!(
            r.header(name).is_none(),
            "{name} forwarded: {:?}",
            r.headers
        );
    }
    ensure!(
        r.headers
            .get_all("connection")
            .iter()
            .all(|v| !v.as_bytes().eq_ignore_ascii_case(b"x-upstream-hop")),
        "the upstream's Connection header forwarded: {:?}",
        r.headers
    );
    Ok(())
}

fn expect_runs(up: &Upstream, key: &str, n: usize) -> Result<()> {
    let runs = up.count_for(key);
    ensure!(
        runs == n,
        "key {key}: the upstream ran {runs} times, not {n}"
    );
    Ok(())
}

fn expect_total(up: &Upstream, n: usize) -> Result<()> {
    let total = up.total();
    ensure!(
        total == n,
        "the upstream executed {total} requests, expected {n}: {:?}",
        up.executions()
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Replay, keys and fingerprints

#[test]
fn first_request_executes_and_duplicate_replays() -> Result<()> {
    let w = World::start(None)?;
    let req = w.proxy.post("/orders").key("\"order-1\"").json(BODY);
    let first = req.send()?;
    expect_fresh(&first, 201)?;
    ensure!(first.header("x-order-id") == Some("ord-1"), "{first:?}");
    ensure!(first.json()?["order_id"] == "ord-1");
    expect_no_hop_headers(&first)?;
    expect_total(&w.up, 1)?;
    let seen = &w.up.executions()[0];
    ensure!(
        seen.method == "POST" && seen.target == "/orders",
        "{seen:?}"
    );
    ensure!(
        seen.body == BODY.as_bytes(),
        "body forwarded as sent: {seen:?}"
    );

    for _ in 0..2 {
        let again = req.send()?;
        expect_replay_of(&again, &first)?;
        expect_no_hop_headers(&again)?;
    }
    expect_total(&w.up, 1)
}

#[test]
fn quoted_and_bare_keys_are_the_same_key() -> Result<()> {
    let w = World::start(None)?;
    let first = w.proxy.post("/orders").key("\"k-42\"").json(BODY).send()?;
    expect_fresh(&first, 201)?;
    let bare = w.proxy.post("/orders").key("k-42").json(BODY).send()?;
    expect_replay_of(&bare, &first)?;

    let first = w.proxy.post("/orders").key("k-43").json(BODY).send()?;
    expect_fresh(&first, 201)?;
    let quoted = w.proxy.post("/orders").key("\"k-43\"").json(BODY).send()?;
    expect_replay_of(&quoted, &first)?;
    expect_total(&w.up, 2)
}

#[test]
fn json_key_order_and_whitespace_do_not_change_the_fingerprint() -> Result<()> {
    let w = World::start(None)?;
    let first = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&first, 201)?;
    let reordered = "{\n  \"qty\" : 2 ,\t\"sku\":   \"A1-secret-sku\"\n}\n";
    let again = w.proxy.post("/orders").key("k").json(reordered).send()?;
    expect_replay_of(&again, &first)?;
    expect_total(&w.up, 1)
}

#[test]
fn same_key_with_another_body_is_422() -> Result<()> {
    let w = World::start(None)?;
    let first = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&first, 201)?;
    let other = r#"{"sku":"B2-other-secret","qty":3}"#;
    let r = w.proxy.post("/orders").key("k").json(other).send()?;
    let p = r.expect_problem(422, "key-reused")?;
    ensure!(p["title"] == "Idempotency-Key is already used", "{p}");
    r.expect_not_containing(&[b"B2-other-secret", b"A1-secret-sku", b"ord-1", &first.body])?;
    expect_total(&w.up, 1)?;
    // The mismatch changed nothing: the original request still replays.
    let again = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_replay_of(&again, &first)?;
    expect_total(&w.up, 1)
}

#[test]
fn same_key_on_another_endpoint_is_422() -> Result<()> {
    let w = World::start(None)?;
    let first = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&first, 201)?;
    for path in ["/invoices", "/orders?express=1"] {
        let r = w.proxy.post(path).key("k").json(BODY).send()?;
        r.expect_problem(422, "key-reused")
            .with_context(|| format!("POST {path}"))?;
        r.expect_not_containing(&[b"A1-secret-sku", &first.body])?;
    }
    let r = w
        .proxy
        .request("PUT", "/orders")
        .key("k")
        .json(BODY)
        .send()?;
    r.expect_problem(422, "key-reused").context("PUT /orders")?;
    expect_total(&w.up, 1)
}

#[test]
fn missing_key_on_post_and_patch_is_400() -> Result<()> {
    let w = World::start(None)?;
    for method in ["POST", "PATCH"] {
        let r = w.proxy.request(method, "/orders").json(BODY).send()?;
        let p = r
            .expect_problem(400, "key-missing")
            .with_context(|| method.to_string())?;
        ensure!(p["title"] == "Idempotency-Key is missing", "{p}");
        r.expect_not_containing(&[b"A1-secret-sku"])?;
    }
    expect_total(&w.up, 0)
}

#[test]
fn put_and_delete_honour_a_key_only_when_present() -> Result<()> {
    let w = World::start(None)?;
    // Without a key: passed through, executed every time.
    for i in 1..=2 {
        let r = w
            .proxy
            .request("PUT", "/things/1")
            .json(r#"{"v":1}"#)
            .send()?;
        expect_fresh(&r, 200)?;
        expect_total(&w.up, i)?;
    }
    // With a key: deduplicated.
    let first = w
        .proxy
        .request("PUT", "/things/2")
        .key("put-1")
        .json(r#"{"v":2}"#)
        .send()?;
    expect_fresh(&first, 200)?;
    let again = w
        .proxy
        .request("PUT", "/things/2")
        .key("put-1")
        .json(r#"{"v":2}"#)
        .send()?;
    expect_replay_of(&again, &first)?;
    expect_total(&w.up, 3)?;

    let first = w.proxy.request("DELETE", "/things/3").key("del-1").send()?;
    expect_fresh(&first, 200)?;
    let again = w.proxy.request("DELETE", "/things/3").key("del-1").send()?;
    expect_replay_of(&again, &first)?;
    let r = w.proxy.request("DELETE", "/things/4").send()?;
    expect_fresh(&r, 200)?;
    expect_total(&w.up, 5)
}

#[test]
fn safe_methods_pass_through() -> Result<()> {
    let w = World::start(None)?;
    for i in 1..=2 {
        // Even with a key: a read is not deduplicated.
        let r = w.proxy.get("/things/1").key("get-key").send()?;
        expect_fresh(&r, 200)?;
        ensure!(r.json()?["execution"] == i, "{r:?}");
    }
    let r = w.proxy.get("/things/1").send()?;
    expect_fresh(&r, 200)?;
    let r = w.proxy.request("HEAD", "/things/1").send()?;
    expect_fresh(&r, 200)?;
    let r = w.proxy.request("OPTIONS", "/things/1").send()?;
    expect_fresh(&r, 200)?;
    expect_total(&w.up, 5)?;
    let methods: Vec<String> = w.up.executions().into_iter().map(|e| e.method).collect();
    ensure!(
        methods == ["GET", "GET", "GET", "HEAD", "OPTIONS"],
        "{methods:?}"
    );
    Ok(())
}

#[test]
fn invalid_keys_are_400_and_execute_nothing() -> Result<()> {
    let w = World::start(None)?;
    let too_long = "a".repeat(256);
    let quoted_too_long = format!("\"{too_long}\"");
    let invalid: [(&str, &[u8]); 7] = [
        ("256 characters", too_long.as_bytes()),
        ("256 characters, quoted", quoted_too_long.as_bytes()),
        ("a space in a bare key", b"abc def"),
        ("non-ASCII bytes", "cl\u{e9}-\u{1f511}".as_bytes()),
        ("empty string", b"\"\""),
        ("unterminated string", b"\"abc"),
        ("a list, not one item", b"\"a\", \"b\""),
    ];
    for (what, key) in invalid {
        let r = w.proxy.post("/orders").key(key).json(BODY).send()?;
        r.expect_problem(400, "key-invalid").context(what)?;
        r.expect_not_containing(&[b"A1-secret-sku"])?;
    }
    expect_total(&w.up, 0)?;
    // The longest valid key.
    let r = w
        .proxy
        .post("/orders")
        .key("a".repeat(255))
        .json(BODY)
        .send()?;
    expect_fresh(&r, 201).context("a 255-character key is valid")?;
    expect_total(&w.up, 1)
}

/// Unidentified clients share the one scope `anonymous`.
const SHARED: &str = "[defaults]\nanonymous = \"shared\"\n";

#[test]
fn clients_are_scoped_by_authorization() -> Result<()> {
    // `shared`, so that the client without credentials is served too.
    let w = World::start(Some(SHARED))?;
    let send = |auth: Option<&str>| {
        let mut r = w.proxy.post("/orders").key("shared-key").json(BODY);
        r = match auth {
            Some(a) => r.auth(a),
            None => r.anonymous(),
        };
        r.send()
    };
    let alice = send(Some("Bearer alice-token"))?;
    expect_fresh(&alice, 201)?;
    let bob = send(Some("Bearer bob-token"))?;
    expect_fresh(&bob, 201)?;
    let anon = send(None)?;
    expect_fresh(&anon, 201)?;
    expect_total(&w.up, 3)?;
    let ids: Vec<_> = [&alice, &bob, &anon]
        .iter()
        .map(|r| r.header("x-order-id").map(str::to_string))
        .collect();
    ensure!(
        ids == [
            Some("ord-1".into()),
            Some("ord-2".into()),
            Some("ord-3".into())
        ],
        "{ids:?}"
    );

    expect_replay_of(&send(Some("Bearer alice-token"))?, &alice)?;
    let bob_again = send(Some("Bearer bob-token"))?;
    expect_replay_of(&bob_again, &bob)?;
    bob_again.expect_not_containing(&[b"ord-1", b"ord-3"])?;
    expect_replay_of(&send(None)?, &anon)?;
    // Each client's own request reached the upstream with its own credentials.
    let auths: Vec<_> =
        w.up.executions()
            .into_iter()
            .map(|e| e.authorization)
            .collect();
    ensure!(
        auths
            == [
                Some("Bearer alice-token".to_string()),
                Some("Bearer bob-token".to_string()),
                None
            ],
        "{auths:?}"
    );
    expect_total(&w.up, 3)
}

#[test]
fn scope_header_names_the_client_when_configured() -> Result<()> {
    let w = World::start(Some("scope_header = \"X-Tenant-Id\"\n"))?;
    let send = |tenant: &str, auth: &str| {
        w.proxy
            .post("/orders")
            .key("k")
            .header("X-Tenant-Id", tenant)
            .auth(auth)
            .json(BODY)
            .send()
    };
    let t1 = send("t-1", "Bearer alice")?;
    expect_fresh(&t1, 201)?;
    // The tenant is the scope, whatever the credentials.
    expect_replay_of(&send("t-1", "Bearer bob")?, &t1)?;
    let t2 = send("t-2", "Bearer alice")?;
    expect_fresh(&t2, 201)?;
    t2.expect_not_containing(&[b"ord-1"])?;
    expect_total(&w.up, 2)
}

/// The record count in the proxy's database (`idem stats`).
fn stored(w: &World) -> Result<u64> {
    let stats = idem_ok(&["stats", "--db", w.db(), "--json"])?.json()?;
    stats["total"].as_u64().context("stats without a total")
}

#[test]
fn unidentified_clients_are_refused_by_default() -> Result<()> {
    let w = World::start(None)?;
    let anonymous = || w.proxy.post("/orders").anonymous().key("k-anon").json(BODY);
    let r = anonymous().send()?;
    let p = r.expect_problem(401, "client-unidentified")?;
    ensure!(p["title"] == "The client is not identified", "{p}");
    let detail = p["detail"].as_str().unwrap_or_default();
    ensure!(detail.contains("Authorization"), "{p}");
    ensure!(
        r.header("www-authenticate") == Some("Bearer realm=\"idem\""),
        "a 401 needs a challenge: {:?}",
        r.headers
    );
    r.expect_not_containing(&[b"A1-secret-sku"])?;
    // Addresses a client writes itself identify no one.
    anonymous()
        .header("X-Forwarded-For", "198.51.100.7")
        .header("Forwarded", "for=198.51.100.7")
        .send()?
        .expect_problem(401, "client-unidentified")?;
    // PATCH and a keyed PUT too; nothing reached the upstream or the store.
    for method in ["PATCH", "PUT", "DELETE"] {
        w.proxy
            .request(method, "/things/1")
            .anonymous()
            .key("k-anon")
            .json(BODY)
            .send()?
            .expect_problem(401, "client-unidentified")
            .context(method)?;
    }
    expect_total(&w.up, 0)?;
    ensure!(stored(&w)? == 0, "a refused request was stored");
    // Without a key nothing would be stored: the key rules apply as before.
    anonymous_keyless(&w, "POST")?.expect_problem(400, "key-missing")?;
    expect_fresh(&anonymous_keyless(&w, "PUT")?, 200)?;
    expect_total(&w.up, 1)?;
    // The same key with credentials is a first request: nothing was kept.
    let r = w.proxy.post("/orders").key("k-anon").json(BODY).send()?;
    expect_fresh(&r, 201)?;
    expect_total(&w.up, 2)?;
    // With a scope header configured, the detail names it too.
    let tenant = World::start(Some("scope_header = \"X-Tenant-Id\"\n"))?;
    let r = tenant
        .proxy
        .post("/orders")
        .anonymous()
        .key("k")
        .json(BODY)
        .send()?;
    let p = r.expect_problem(401, "client-unidentified")?;
    let detail = p["detail"].as_str().unwrap_or_default();
    ensure!(
        detail.contains("Authorization") && detail.contains("X-Tenant-Id header"),
        "{p}"
    );
    let r = tenant
        .proxy
        .post("/orders")
        .anonymous()
        .header("X-Tenant-Id", "t-1")
        .key("k")
        .json(BODY)
        .send()?;
    expect_fresh(&r, 201)?;
    expect_total(&tenant.up, 1)
}

fn anonymous_keyless(w: &World, method: &str) -> Result<Resp> {
    w.proxy
        .request(method, "/things/9")
        .anonymous()
        .json(BODY)
        .send()
}

#[test]
fn shared_anonymous_clients_share_one_key_space() -> Result<()> {
    let w = World::start(Some(SHARED))?;
    let anonymous = |body: &str| w.proxy.post("/orders").anonymous().key("k").json(body);
    // One unidentified client's request...
    let first = anonymous(BODY).send()?;
    expect_fresh(&first, 201)?;
    // ...is what every other unidentified client gets for the same key and
    // request: that is what `shared` means.
    let other = anonymous(BODY).send()?;
    expect_replay_of(&other, &first)?;
    anonymous(r#"{"sku":"B2","qty":1}"#)
        .send()?
        .expect_problem(422, "key-reused")?;
    expect_total(&w.up, 1)?;
    ensure!(inspect(&w, "anonymous", "http", "k")?["status"] == "succeeded");
    // An identified client keeps its own scope.
    let own = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&own, 201)?;
    own.expect_not_containing(&[b"ord-1"])?;
    expect_total(&w.up, 2)
}

/// A raw `POST /orders` with key `key` from a socket bound to `source`
/// (any 127.0.0.0/8 address is the loopback on Linux); returns the status
/// and the `x-order-id` header.
fn post_from(source: &str, base: &str, key: &str) -> Result<(u16, Option<String>)> {
    use std::io::{Read, Write};
    let target: std::net::SocketAddr = base.trim_start_matches("http://").parse()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let socket = runtime.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(format!("{source}:0").parse()?)?;
        anyhow::Ok(socket.connect(target).await?)
    })?;
    let mut s = socket.into_std()?;
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(ARRIVAL))?;
    // A forwarded address that would be another client's, were it believed.
    let request = format!(
        "POST /orders HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: {key}\r\n\
         X-Forwarded-For: 198.51.100.7\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    s.write_all(request.as_bytes())?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status in {answer:?}"))?;
    let order = answer.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("x-order-id")
            .then(|| value.trim().to_string())
    });
    Ok((status, order))
}

#[test]
fn client_address_gives_each_address_its_own_scope() -> Result<()> {
    let w = World::start(Some("[defaults]\nanonymous = \"client-address\"\n"))?;
    let addr_scope = |ip: &str| {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(ip.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        format!("addr:{hex}")
    };
    // The harness's client connects from 127.0.0.1.
    let first = w
        .proxy
        .post("/orders")
        .anonymous()
        .key("k")
        .json(BODY)
        .send()?;
    expect_fresh(&first, 201)?;
    let rec = inspect(&w, &addr_scope("127.0.0.1"), "http", "k")?;
    ensure!(rec["status"] == "succeeded", "{rec}");
    // The same address again: the same client, a replay, whatever it
    // claims in X-Forwarded-For.
    let (status, order) = post_from("127.0.0.1", &w.proxy.base, "k")?;
    ensure!(
        (status, order.as_deref()) == (201, Some("ord-1")),
        "{status} {order:?}"
    );
    expect_total(&w.up, 1)?;
    // Another address: another client with the same key runs on its own.
    let (status, order) = post_from("127.0.0.2", &w.proxy.base, "k")?;
    ensure!(
        (status, order.as_deref()) == (201, Some("ord-2")),
        "{status} {order:?}"
    );
    let rec = inspect(&w, &addr_scope("127.0.0.2"), "http", "k")?;
    ensure!(rec["status"] == "succeeded", "{rec}");
    // The forwarded address was never used as a scope.
    ensure!(inspect(&w, &addr_scope("198.51.100.7"), "http", "k")?.is_null());
    // An identified client is scoped by its credentials, not its address.
    let own = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&own, 201)?;
    ensure!(inspect(&w, &auth_scope(TEST_CLIENT), "http", "k")?["status"] == "succeeded");
    expect_total(&w.up, 3)
}

#[test]
fn optional_key_route_passes_requests_without_a_key() -> Result<()> {
    let config = r#"
[[routes]]
method = "POST"
path = "/orders"
biz_type = "order.create"
key = "optional"
"#;
    let w = World::start(Some(config))?;
    for i in 1..=2 {
        expect_fresh(&w.proxy.post("/orders").json(BODY).send()?, 201)?;
        expect_total(&w.up, i)?;
    }
    let first = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&first, 201)?;
    expect_replay_of(&w.proxy.post("/orders").key("k").json(BODY).send()?, &first)?;
    // Other paths keep the default: POST requires a key.
    w.proxy
        .post("/invoices")
        .json(BODY)
        .send()?
        .expect_problem(400, "key-missing")?;
    expect_total(&w.up, 3)
}

#[test]
fn fingerprint_fields_limit_the_request_identity() -> Result<()> {
    let config = r#"
[[routes]]
method = "POST"
path = "/orders"
biz_type = "order.create"
fingerprint_fields = ["/sku", "/qty"]
"#;
    let w = World::start(Some(config))?;
    let first = w
        .proxy
        .post("/orders")
        .key("k")
        .json(r#"{"sku":"A1","qty":2,"note":"first"}"#)
        .send()?;
    expect_fresh(&first, 201)?;
    // A field outside the fingerprint does not make another request.
    let again = w
        .proxy
        .post("/orders")
        .key("k")
        .json(r#"{"note":"second","qty":2,"sku":"A1"}"#)
        .send()?;
    expect_replay_of(&again, &first)?;
    // A field inside it does.
    let r = w
        .proxy
        .post("/orders")
        .key("k")
        .json(r#"{"sku":"A1","qty":3,"note":"first"}"#)
        .send()?;
    r.expect_problem(422, "key-reused")?;
    expect_total(&w.up, 1)
}

// ---------------------------------------------------------------------------
// Concurrency

#[test]
fn duplicate_in_flight_is_409_with_retry_after() -> Result<()> {
    let w = World::start(None)?;
    let req = w.proxy.post("/slow?ms=700").key("slow-1").json(BODY);
    let first = std::thread::scope(|s| -> Result<Resp> {
        let h = s.spawn(|| req.send());
        w.up.wait_for_total(1, ARRIVAL)?;
        let dup = req.send()?;
        let p = dup.expect_problem(409, "request-in-progress")?;
        ensure!(
            p["title"] == "A request is outstanding for this Idempotency-Key",
            "{p}"
        );
        let retry_after = dup
            .header("retry-after")
            .context("409 without Retry-After")?;
        retry_after
            .trim()
            .parse::<u64>()
            .with_context(|| format!("Retry-After {retry_after:?} is not delay-seconds"))?;
        dup.expect_not_containing(&[b"A1-secret-sku"])?;
        h.join().expect("client thread")
    })?;
    expect_fresh(&first, 201)?;
    expect_replay_of(&req.send()?, &first)?;
    expect_total(&w.up, 1)
}

/// A client that hangs up while its request is at the upstream must not
/// leave the key unsettled: the request still completes once and its
/// outcome is stored, so the retry is a replay, not a second execution.
#[test]
fn a_client_hanging_up_mid_request_still_settles_the_key() -> Result<()> {
    use std::io::Write as _;
    let w = World::start(Some(WAIT))?;
    let url = w.proxy.url("/slow?ms=700");
    let authority = url
        .strip_prefix("http://")
        .and_then(|rest| rest.split('/').next())
        .context("proxy url")?;
    let mut conn = std::net::TcpStream::connect(authority)?;
    write!(
        conn,
        "POST /slow?ms=700 HTTP/1.1\r\nHost: {authority}\r\nIdempotency-Key: hangup-1\r\n\
         Authorization: {TEST_CLIENT}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{BODY}",
        BODY.len()
    )?;
    conn.flush()?;
    w.up.wait_for_total(1, ARRIVAL)?;
    drop(conn); // the client gives up while the upstream works
    let retry = w
        .proxy
        .post("/slow?ms=700")
        .key("hangup-1")
        .json(BODY)
        .send()?;
    ensure!(
        retry.status == 201 && retry.replayed(),
        "expected the stored answer, got {} {:?}",
        retry.status,
        retry.text()
    );
    expect_total(&w.up, 1)
}

const WAIT: &str = r#"
[defaults]
in_progress = { wait_ms = 10000, poll_ms = 20 }
"#;

#[test]
fn duplicate_in_flight_waits_for_the_result_when_configured() -> Result<()> {
    let w = World::start(Some(WAIT))?;
    let req = w.proxy.post("/slow?ms=500").key("slow-1").json(BODY);
    let (first, dup) = std::thread::scope(|s| -> Result<(Resp, Resp)> {
        let h = s.spawn(|| req.send());
        w.up.wait_for_total(1, ARRIVAL)?;
        let dup = req.send()?;
        Ok((h.join().expect("client thread")?, dup))
    })?;
    expect_fresh(&first, 201)?;
    expect_replay_of(&dup, &first)?;
    expect_total(&w.up, 1)
}

/// Sends every request at the same moment, one thread each.
fn all_at_once(reqs: Vec<Req>) -> Result<Vec<Resp>> {
    let barrier = Arc::new(Barrier::new(reqs.len()));
    std::thread::scope(|s| {
        let handles: Vec<_> = reqs
            .into_iter()
            .map(|req| {
                let barrier = Arc::clone(&barrier);
                s.spawn(move || {
                    barrier.wait();
                    req.send()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    })
}

fn fifty_at_once(w: &World) -> Result<Vec<Resp>> {
    const N: usize = 50;
    let req = w.proxy.post("/slow?ms=400").key("storm").json(BODY);
    all_at_once(vec![req; N])
}

#[test]
fn fifty_concurrent_duplicates_execute_once() -> Result<()> {
    let w = World::start(None)?;
    let answers = fifty_at_once(&w)?;
    expect_total(&w.up, 1)?;
    expect_one_execution(&answers)
}

/// `--workers 4`: four threads accept on one port, so the fifty
/// connections land on different workers; the store still lets one of
/// them execute, and fifty distinct keys run once each.
#[test]
fn workers_sharing_one_port_execute_each_key_once() -> Result<()> {
    let mut w = World::start(None)?;
    w.proxy.kill()?;
    w.proxy = Serve::new(&w.up.url(), &w.db).workers(4).start()?;
    let answers = fifty_at_once(&w)?;
    expect_total(&w.up, 1)?;
    expect_one_execution(&answers)?;
    fifty_keys_run_once(&w, "w", 1)
}

/// The workers' listeners share their port with each other only: a second
/// `idem serve` on a port in use fails to start, as any server would.
#[test]
fn a_second_proxy_on_a_port_in_use_does_not_start() -> Result<()> {
    let w = World::start(None)?;
    let addr = w
        .proxy
        .url("")
        .strip_prefix("http://")
        .context("the proxy's URL")?
        .to_owned();
    let mut second = std::process::Command::new(serve::idem_bin()?)
        .args(["serve", "--listen", &addr, "--upstream", &w.up.url()])
        .arg("--db")
        .arg(w.db.with_extension("second.db"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // A second proxy that did start would serve forever: give it a while
    // to fail, then stop it and fail the test.
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = second.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            second.kill()?;
            second.wait()?;
            bail!("the second proxy started on {addr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    ensure!(!status.success(), "the second proxy exited with success");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut second.stderr.take().context("stderr")?, &mut stderr)?;
    ensure!(
        stderr.contains("cannot listen on --listen"),
        "stderr: {stderr}"
    );
    // The first proxy still answers.
    expect_fresh(
        &w.proxy.post("/orders").key("after").json(BODY).send()?,
        201,
    )
}

/// Fifty distinct keys (`PREFIX-0` to `PREFIX-49`) sent at once, after
/// `before` executions: each executes once, and each replays its answer.
fn fifty_keys_run_once(w: &World, prefix: &str, before: usize) -> Result<()> {
    const KEYS: usize = 50;
    let post = |i: usize| {
        w.proxy
            .post("/orders")
            .key(format!("{prefix}-{i}"))
            .json(BODY)
    };
    let firsts = all_at_once((0..KEYS).map(&post).collect())?;
    for first in &firsts {
        expect_fresh(first, 201)?;
    }
    expect_total(&w.up, before + KEYS)?;
    for (i, first) in firsts.iter().enumerate() {
        expect_replay_of(&post(i).send()?, first)?;
    }
    expect_total(&w.up, before + KEYS)
}

/// Fifty answers to one key: one executed, every other the same body
/// replayed or "in progress".
fn expect_one_execution(answers: &[Resp]) -> Result<()> {
    let fresh: Vec<&Resp> = answers
        .iter()
        .filter(|r| r.status == 201 && !r.replayed())
        .collect();
    ensure!(fresh.len() == 1, "{} executed answers", fresh.len());
    for r in answers {
        match r.status {
            201 => ensure!(r.body == fresh[0].body, "another body: {:?}", r.text()),
            409 => {
                r.expect_problem(409, "request-in-progress")?;
            }
            other => bail!("status {other}: {:?}", r.text()),
        }
    }
    Ok(())
}

#[test]
fn with_or_without_group_commit_each_key_runs_once() -> Result<()> {
    // `group_commit = true` (the default): concurrent claims and
    // completions share SQLite transactions; `false`: each has its own.
    // Fifty duplicates of one key, then fifty distinct keys at once: one
    // execution each, and every key replays afterwards.
    for config in ["group_commit = true", "group_commit = false"] {
        let w = World::start(Some(config))?;
        let answers = fifty_at_once(&w)?;
        expect_total(&w.up, 1)?;
        ensure!(
            answers
                .iter()
                .filter(|r| r.status == 201 && !r.replayed())
                .count()
                == 1,
            "{config}: one executed answer for the duplicated key"
        );
        fifty_keys_run_once(&w, "gc", 1)?;
    }
    Ok(())
}

#[test]
fn fifty_concurrent_duplicates_with_wait_all_get_the_result() -> Result<()> {
    let w = World::start(Some(WAIT))?;
    let answers = fifty_at_once(&w)?;
    expect_total(&w.up, 1)?;
    let fresh: Vec<&Resp> = answers.iter().filter(|r| !r.replayed()).collect();
    ensure!(fresh.len() == 1, "{} answers not replayed", fresh.len());
    expect_fresh(fresh[0], 201)?;
    for r in &answers {
        if r.replayed() {
            expect_replay_of(r, fresh[0])?;
        }
    }
    ensure!(answers.iter().filter(|r| r.replayed()).count() == 49);
    Ok(())
}

// ---------------------------------------------------------------------------
// Body limit

#[test]
fn body_over_the_configured_limit_is_413() -> Result<()> {
    let w = World::start(Some("max_body_bytes = 1024\n"))?;
    let big = format!(r#"{{"pad":"{}"}}"#, "x".repeat(2000));
    let r = w.proxy.post("/orders").key("big").json(&big).send()?;
    r.expect_problem(413, "body-too-large")?;
    r.expect_not_containing(&[b"xxxxxxxxxxxxxxxx"])?;
    expect_total(&w.up, 0)?;
    // Under the limit: executed.
    let r = w.proxy.post("/orders").key("small").json(BODY).send()?;
    expect_fresh(&r, 201)?;
    expect_total(&w.up, 1)
}

#[test]
fn default_body_limit_is_one_mib() -> Result<()> {
    let w = World::start(None)?;
    let exact = vec![b'x'; 1 << 20];
    let r = w
        .proxy
        .post("/orders")
        .key("exact")
        .body("application/octet-stream", &exact)
        .send()?;
    expect_fresh(&r, 201).context("exactly 1 MiB is within the limit")?;
    expect_total(&w.up, 1)?;
    let over = vec![b'x'; (1 << 20) + 1];
    let r = w
        .proxy
        .post("/orders")
        .key("over")
        .body("application/octet-stream", &over)
        .send()?;
    r.expect_problem(413, "body-too-large")?;
    expect_total(&w.up, 1)
}

// ---------------------------------------------------------------------------
// Upstream failures

#[test]
fn server_errors_are_not_stored() -> Result<()> {
    let w = World::start(None)?;
    let mut expected = 0;
    for code in [500u16, 503] {
        let path = format!("/fail/{code}");
        for _ in 0..2 {
            let r = w
                .proxy
                .post(&path)
                .key(format!("k-{code}"))
                .json(BODY)
                .send()?;
            expected += 1;
            expect_fresh(&r, code)?;
            // The upstream's own answer, passed through.
            ensure!(r.json()?["execution"] == expected, "{r:?}");
        }
    }
    expect_total(&w.up, 4)
}

#[test]
fn server_errors_are_stored_on_a_store_route() -> Result<()> {
    let config = r#"
[[routes]]
method = "POST"
path = "/fail/500"
biz_type = "fail.store"
server_errors = "store"
"#;
    let w = World::start(Some(config))?;
    let first = w.proxy.post("/fail/500").key("k").json(BODY).send()?;
    expect_fresh(&first, 500)?;
    let again = w.proxy.post("/fail/500").key("k").json(BODY).send()?;
    expect_replay_of(&again, &first)?;
    expect_total(&w.up, 1)?;
    // Other routes keep the default: 503 is retried.
    for _ in 0..2 {
        let r = w.proxy.post("/fail/503").key("k2").json(BODY).send()?;
        expect_fresh(&r, 503)?;
    }
    expect_total(&w.up, 3)
}

#[test]
fn retryable_client_errors_are_never_stored() -> Result<()> {
    let w = World::start(None)?;
    for code in [408u16, 409, 425, 429] {
        let before = w.up.total();
        for _ in 0..2 {
            let r = w
                .proxy
                .post(&format!("/fail/{code}"))
                .key(format!("k-{code}"))
                .json(BODY)
                .send()?;
            expect_fresh(&r, code).with_context(|| format!("upstream {code}"))?;
        }
        ensure!(w.up.total() == before + 2, "{code} was not retried");
    }
    Ok(())
}

#[test]
fn other_client_errors_are_stored_and_replayed() -> Result<()> {
    let w = World::start(None)?;
    for code in [404u16, 400] {
        // Same key on another path would be a mismatch: a key per code.
        let path = format!("/fail/{code}");
        let key = format!("k-{code}");
        let first = w.proxy.post(&path).key(&key).json(BODY).send()?;
        expect_fresh(&first, code)?;
        let again = w.proxy.post(&path).key(&key).json(BODY).send()?;
        expect_replay_of(&again, &first)?;
    }
    expect_total(&w.up, 2)
}

#[test]
fn connection_refused_is_502_and_retryable() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    let dead = format!("http://127.0.0.1:{}", refused_port()?);
    let mut proxy = Serve::new(&dead, &db).start()?;
    for _ in 0..2 {
        let r = proxy.post("/orders").key("k").json(BODY).send()?;
        r.expect_problem(502, "upstream-unavailable")?;
        r.expect_not_containing(&[b"A1-secret-sku"])?;
    }
    proxy.kill()?;
    // The same database behind a live upstream: the key executes.
    let up = Upstream::start()?;
    let proxy = Serve::new(&up.url(), &db).start()?;
    let first = proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&first, 201)?;
    expect_replay_of(&proxy.post("/orders").key("k").json(BODY).send()?, &first)?;
    expect_total(&up, 1)
}

fn expect_outcome_unknown(w: &World, path: &str) -> Result<()> {
    let req = w.proxy.post(path).key("k").json(BODY);
    let r = req.send()?;
    r.expect_problem(504, "outcome-unknown")?;
    r.expect_not_containing(&[b"A1-secret-sku"])?;
    expect_total(&w.up, 1)?;
    for _ in 0..2 {
        let dup = req.send()?;
        dup.expect_problem(409, "outcome-unknown")?;
        dup.expect_not_containing(&[b"A1-secret-sku"])?;
    }
    expect_total(&w.up, 1)
}

#[test]
fn upstream_timeout_is_504_outcome_unknown() -> Result<()> {
    let w = World::start(Some("upstream_timeout_ms = 300\n"))?;
    expect_outcome_unknown(&w, "/hang")
}

#[test]
fn dropped_connection_is_504_outcome_unknown() -> Result<()> {
    let w = World::start(None)?;
    expect_outcome_unknown(&w, "/drop")
}

// ---------------------------------------------------------------------------
// Processes: restart, crash, signals

#[test]
fn a_restarted_proxy_still_replays() -> Result<()> {
    let mut w = World::start(None)?;
    let first = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&first, 201)?;
    w.proxy.signal(libc::SIGTERM)?;
    let status = w.proxy.wait_exit(ARRIVAL)?;
    ensure!(status.success(), "exit after SIGTERM: {status}");
    w.restart(None)?;
    let again = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_replay_of(&again, &first)?;
    expect_total(&w.up, 1)
}

/// Starts `POST /slow` through the proxy, kills the proxy (SIGKILL) while
/// the upstream works on it, and starts a new proxy on the same database.
fn kill_mid_request(config: &str) -> Result<World> {
    kill_mid_request_with(|_| config.to_owned())
}

/// As [`kill_mid_request`], with the configuration made from the
/// upstream's URL.
fn kill_mid_request_with(config: impl Fn(&str) -> String) -> Result<World> {
    let mut w = World::start_with(&config)?;
    let config = config(&w.up.url());
    std::thread::scope(|s| -> Result<()> {
        let req = w.proxy.post("/slow?ms=300").key("k").json(BODY);
        let h = s.spawn(move || req.send());
        w.up.wait_for_total(1, ARRIVAL)?;
        w.proxy.kill()?;
        // The client sees its connection closed; no answer was made.
        let answer = h.join().expect("client thread");
        ensure!(answer.is_err(), "an answer from a killed proxy: {answer:?}");
        Ok(())
    })?;
    w.restart(Some(&config))?;
    Ok(w)
}

/// The lease of the tests that wait one out: far longer than a test runs,
/// so only the test clock ends it.
const LONG_LEASE_MS: u64 = 60_000;

/// `[defaults]` with [`LONG_LEASE_MS`], then `rest`.
fn long_lease(rest: &str) -> String {
    format!("[defaults]\nlease_ms = {LONG_LEASE_MS}\n{rest}")
}

/// A configuration whose upstream times out after 300 ms (below the
/// `/hang` endpoints' wait) with top-level settings `top`, and whose
/// `[defaults]` have [`LONG_LEASE_MS`] and then `defaults`.
fn timing_out(top: &str, defaults: &str) -> String {
    format!("upstream_timeout_ms = 300\n{top}{}", long_lease(defaults))
}

/// Retries the killed request: within the lease it is still "in progress";
/// once the test clock has moved past the lease, the answer is whatever
/// the policy makes of the abandoned attempt.
fn retry_after_lease(w: &World) -> Result<Resp> {
    w.proxy
        .post("/slow?ms=300")
        .key("k")
        .json(BODY)
        .send()?
        .expect_problem(409, "request-in-progress")?;
    w.clock.advance(LONG_LEASE_MS + 1)?;
    w.proxy.post("/slow?ms=300").key("k").json(BODY).send()
}

#[test]
fn killed_mid_request_is_taken_over_after_the_lease() -> Result<()> {
    let w = kill_mid_request(&long_lease("expired_lease = \"take-over\"\n"))?;
    let r = retry_after_lease(&w)?;
    expect_fresh(&r, 201)?;
    expect_total(&w.up, 2)?;
    expect_replay_of(
        &w.proxy.post("/slow?ms=300").key("k").json(BODY).send()?,
        &r,
    )?;
    expect_total(&w.up, 2)
}

/// Pitfall 6 with a lookup: the proxy is killed after the upstream ran and
/// before the outcome was stored; after a restart, the retry past the lease
/// asks the lookup, which finds the order: it is replayed, never run again.
#[test]
fn killed_mid_request_is_settled_from_the_lookup_after_a_restart() -> Result<()> {
    let w = kill_mid_request_with(|up| {
        long_lease(&format!(
            "expired_lease = \"reconcile\"\nlookup = \"{up}/lookup/{{key}}\"\n"
        ))
    })?;
    let r = retry_after_lease(&w)?;
    r.expect_status(200)?;
    ensure!(
        r.replayed() && r.header("x-order-id") == Some("ord-1"),
        "{r:?}"
    );
    expect_total(&w.up, 1)?;
    expect_replay_of(
        &w.proxy.post("/slow?ms=300").key("k").json(BODY).send()?,
        &r,
    )?;
    expect_total(&w.up, 1)
}

#[test]
fn killed_mid_request_waits_for_an_operator_under_manual() -> Result<()> {
    let w = kill_mid_request(&long_lease("expired_lease = \"manual\"\n"))?;
    let r = retry_after_lease(&w)?;
    r.expect_problem(409, "outcome-unknown")?;
    expect_total(&w.up, 1)
}

#[test]
fn sigterm_lets_the_request_in_flight_finish() -> Result<()> {
    let mut w = World::start(None)?;
    let req = w.proxy.post("/slow?ms=600").key("k").json(BODY);
    let answer = std::thread::scope(|s| -> Result<Result<Resp>> {
        let h = s.spawn(|| req.send());
        w.up.wait_for_total(1, ARRIVAL)?;
        w.proxy.signal(libc::SIGTERM)?;
        Ok(h.join().expect("client thread"))
    })?;
    let answer = answer.context("the request in flight at SIGTERM")?;
    expect_fresh(&answer, 201)?;
    let status = w.proxy.wait_exit(ARRIVAL)?;
    ensure!(status.success(), "exit after SIGTERM: {status}");
    let listening = w
        .proxy
        .stdout_lines()
        .iter()
        .filter(|l| l.starts_with("idem listening on "))
        .count();
    ensure!(listening == 1, "{:?}", w.proxy.stdout_lines());
    // The completed request was recorded before the exit.
    w.restart(None)?;
    expect_replay_of(&req_again(&w)?, &answer)?;
    expect_total(&w.up, 1)
}

fn req_again(w: &World) -> Result<Resp> {
    w.proxy.post("/slow?ms=600").key("k").json(BODY).send()
}

#[test]
fn sigint_stops_an_idle_proxy_cleanly() -> Result<()> {
    let mut w = World::start(None)?;
    w.proxy.signal(libc::SIGINT)?;
    let status = w.proxy.wait_exit(ARRIVAL)?;
    ensure!(status.success(), "exit after SIGINT: {status}");
    Ok(())
}

#[test]
fn admin_listener_is_announced_first() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let up = Upstream::start()?;
    let proxy = Serve::new(&up.url(), &dir.path().join("idem.db"))
        .admin()
        .start()?;
    let admin = proxy.admin.clone().context("admin url")?;
    ensure!(admin.starts_with("http://127.0.0.1:"), "{admin}");
    let lines = proxy.stdout_lines();
    ensure!(
        lines
            .first()
            .is_some_and(|l| l.starts_with("idem admin on "))
            && lines
                .get(1)
                .is_some_and(|l| l.starts_with("idem listening on ")),
        "{lines:?}"
    );
    let addr = admin.trim_start_matches("http://");
    std::net::TcpStream::connect(addr).context("connecting to the admin listener")?;
    Ok(())
}

// ---------------------------------------------------------------------------
// The CLI on the proxy's database

const ORDER_ROUTE: &str = r#"
[[routes]]
method = "POST"
path = "/orders"
biz_type = "order.create"
"#;

/// The scope the proxy derives from an `Authorization` value.
fn auth_scope(authorization: &str) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(authorization.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("auth:{hex}")
}

fn inspect(w: &World, scope: &str, biz: &str, key: &str) -> Result<serde_json::Value> {
    idem_ok(&[
        "inspect",
        "--db",
        w.db(),
        "--scope",
        scope,
        "--biz",
        biz,
        "--key",
        key,
        "--json",
    ])?
    .json()
}

#[test]
fn inspect_stats_and_reconcile_report_the_records() -> Result<()> {
    let w = World::start(Some(&format!("{SHARED}{ORDER_ROUTE}")))?;
    let anon = w
        .proxy
        .post("/orders")
        .anonymous()
        .key("k-anon")
        .json(BODY)
        .send()?;
    expect_fresh(&anon, 201)?;
    let r = w
        .proxy
        .post("/orders")
        .key("k-auth")
        .auth("Bearer inspector")
        .json(BODY)
        .send()?;
    expect_fresh(&r, 201)?;
    let anonymous = |path: &str, key: &str| w.proxy.post(path).anonymous().key(key).json(BODY);
    expect_fresh(&anonymous("/fail/404", "k-404").send()?, 404)?;
    expect_fresh(&anonymous("/fail/500", "k-500").send()?, 500)?;
    w.proxy
        .post("/drop")
        .anonymous()
        .key("k-drop")
        .json(BODY)
        .send()?
        .expect_problem(504, "outcome-unknown")?;

    let rec = inspect(&w, "anonymous", "order.create", "k-anon")?;
    ensure!(rec["status"] == "succeeded", "{rec}");
    ensure!(rec["attempts"] == 1 && rec["expired"] == false, "{rec}");
    let rec = inspect(
        &w,
        &auth_scope("Bearer inspector"),
        "order.create",
        "k-auth",
    )?;
    ensure!(rec["status"] == "succeeded", "{rec}");
    // Another client's scope has no such record.
    let rec = inspect(&w, "anonymous", "order.create", "k-auth")?;
    ensure!(rec.is_null(), "{rec}");
    let rec = inspect(&w, "anonymous", "http", "k-404")?;
    ensure!(rec["status"] == "failed", "{rec}");
    let rec = inspect(&w, "anonymous", "http", "k-500")?;
    ensure!(rec["status"] == "released", "{rec}");
    let rec = inspect(&w, "anonymous", "http", "k-drop")?;
    ensure!(rec["status"] == "outcome-unknown", "{rec}");

    let stats = idem_ok(&["stats", "--db", w.db(), "--json"])?.json()?;
    let expected = serde_json::json!({
        "processing": 0, "succeeded": 2, "failed": 1, "released": 1,
        "outcome-unknown": 1, "total": 5,
    });
    ensure!(stats == expected, "stats {stats}, expected {expected}");

    // The biz type has no lookup: reconcile refuses, and changes nothing
    // (not even the fencing token of the outcome-unknown key).
    let before = inspect(&w, "anonymous", "http", "k-drop")?;
    let refused = idem(&["reconcile", "--db", w.db(), "--biz", "http", "--json"])?;
    ensure!(
        !refused.status.success() && refused.stderr.contains("has no lookup"),
        "{refused:?}"
    );
    let rec = inspect(&w, "anonymous", "http", "k-drop")?;
    ensure!(rec == before && rec["status"] == "outcome-unknown", "{rec}");
    Ok(())
}

#[test]
fn sweep_deletes_records_after_retention() -> Result<()> {
    let config = format!("sweep_interval_ms = 0\n[defaults]\nretention_ms = 60000\n{ORDER_ROUTE}");
    let w = World::start(Some(&config))?;
    let first = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&first, 201)?;
    let client = auth_scope(TEST_CLIENT);
    ensure!(inspect(&w, &client, "order.create", "k")?["status"] == "succeeded");
    let sweep = || -> Result<u64> {
        w.idem_json(&["sweep"])?["deleted"]
            .as_u64()
            .context("deleted")
    };
    // Within retention the record stays; past it, the sweep deletes it.
    ensure!(sweep()? == 0, "swept within retention");
    expect_replay_of(&w.proxy.post("/orders").key("k").json(BODY).send()?, &first)?;
    w.clock.advance(60_001)?;
    let deleted = sweep()?;
    ensure!(deleted == 1, "deleted {deleted}");
    ensure!(inspect(&w, &client, "order.create", "k")?.is_null());
    // Gone: the key executes again.
    let again = w.proxy.post("/orders").key("k").json(BODY).send()?;
    expect_fresh(&again, 201)?;
    expect_total(&w.up, 2)
}

/// The seed's compensation path through the real binary: the upstream
/// answered, but the database was locked by another process for longer than
/// the busy timeout and the lease, so the outcome could not be stored; the
/// proxy is then killed with SIGKILL. After a restart the retry, long after
/// the lease, gets the first answer from the outcome journal, and the
/// upstream ran once.
#[test]
fn an_answer_the_database_could_not_take_survives_sigkill_and_is_replayed() -> Result<()> {
    let config = "[defaults]\nlease_ms = 1000\n";
    let mut w = World::start(Some(config))?;
    let db = w.db().to_owned();
    let req = w.proxy.post("/slow?ms=400").key("k").json(BODY);
    let (answer, lock) = std::thread::scope(|s| -> Result<_> {
        let h = s.spawn(|| req.send());
        w.up.wait_for_total(1, ARRIVAL)?;
        // The upstream is at work: another process takes the write lock
        // and keeps it until after the proxy is gone.
        let lock = rusqlite::Connection::open(&db)?;
        lock.execute_batch("BEGIN EXCLUSIVE")?;
        let answer = h
            .join()
            .map_err(|_| anyhow::anyhow!("client thread panicked"))??;
        Ok((answer, lock))
    })?;
    // The client got its answer although the store took nothing.
    expect_fresh(&answer, 201)?;
    w.proxy.kill()?;
    lock.execute_batch("ROLLBACK")?;
    drop(lock);
    let journal = std::fs::read_to_string(format!("{db}-outcomes"))?;
    ensure!(journal.lines().count() == 1, "journal: {journal}");
    w.restart(Some(config))?;
    let again = w.proxy.post("/slow?ms=400").key("k").json(BODY).send()?;
    expect_replay_of(&again, &answer)?;
    expect_total(&w.up, 1)?;
    ensure!(std::fs::read_to_string(format!("{db}-outcomes"))?.is_empty());
    Ok(())
}

/// Issue 15's operator path through the real binaries: an upstream timeout
/// leaves a key outcome-unknown, blocked by default; `idem stuck` lists it,
/// `idem inspect --auth` finds it by the client's own credentials, and
/// `idem settle` decides it: the proxy then replays the operator's answer,
/// or, once released, runs the request again.
#[test]
fn an_operator_lists_inspects_and_settles_outcome_unknown_keys() -> Result<()> {
    let w = World::start(Some(&timing_out("", "")))?;
    for k in ["paid", "not-paid"] {
        time_out(&w.proxy, k)?;
    }
    expect_total(&w.up, 2)?;
    let stuck = idem_ok(&["stuck", "--db", w.db(), "--biz", "http", "--json"])?.json()?;
    let keys: Vec<&str> = stuck
        .as_array()
        .context("a list")?
        .iter()
        .filter_map(|r| r["key"].as_str())
        .collect();
    ensure!(keys.len() == 2 && keys.contains(&"paid"), "{stuck}");
    ensure!(stuck[0]["status"] == "outcome-unknown", "{stuck}");
    // The listing says when each may be released: after the lease of the
    // attempt that timed out.
    let text = idem_ok(
        &[
            &["stuck", "--db", w.db(), "--biz", "http"][..],
            &w.clock.args(),
        ]
        .concat(),
    )?;
    let waits: Vec<u64> = text
        .stdout
        .split("release no sooner than in ")
        .skip(1)
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .collect();
    ensure!(
        waits.len() == 2 && waits.iter().all(|s| (50..=60).contains(s)),
        "{text:?}"
    );
    // Paging: one key a page, each page after the last key's cursor.
    let mut paged = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut args = vec![
            "stuck",
            "--db",
            w.db(),
            "--biz",
            "http",
            "--json",
            "--limit",
            "1",
        ];
        if let Some(a) = &after {
            args.extend(["--after", a.as_str()]);
        }
        let page = idem_ok(&args)?.json()?;
        let Some(last) = page.as_array().context("a list")?.last() else {
            break;
        };
        paged.push(last["key"].as_str().context("key")?.to_owned());
        after = Some(last["cursor"].as_str().context("cursor")?.to_owned());
    }
    ensure!(paged == keys, "pages {paged:?}, whole list {keys:?}");
    let bad = idem(&[
        "stuck",
        "--db",
        w.db(),
        "--biz",
        "http",
        "--after",
        "yesterday",
    ])?;
    ensure!(
        !bad.status.success() && bad.stderr.contains("--after"),
        "{bad:?}"
    );
    let who = ["--auth", TEST_CLIENT, "--biz", "http"];
    let rec = idem_ok(
        &[
            &["inspect", "--db", w.db(), "--json", "--key", "paid"],
            &who[..],
        ]
        .concat(),
    )?
    .json()?;
    ensure!(rec["status"] == "outcome-unknown", "{rec}");

    // The operator checked the business data: "paid" took effect.
    let body = r#"{"order":"o-42"}"#;
    let settled = idem_ok(
        &[
            &[
                "settle",
                "--db",
                w.db(),
                "--json",
                "--key",
                "paid",
                "--succeeded",
            ][..],
            &who[..],
            &[
                "--status",
                "201",
                "--header",
                "content-type: application/json",
                "--body",
                body,
            ],
        ]
        .concat(),
    )?
    .json()?;
    ensure!(
        settled["settlement"] == "settled" && settled["status"] == "succeeded",
        "{settled}"
    );
    let replay = w.proxy.post("/hang").key("paid").json(BODY).send()?;
    ensure!(replay.status == 201 && replay.text() == body, "{replay:?}");
    ensure!(
        replay.header("idempotent-replayed") == Some("true"),
        "{replay:?}"
    );
    // "not-paid" did not. Its action may still land while the lease of
    // the attempt that timed out lasts, so a release waits for its end:
    // refused by name, nothing changed, the key still blocked.
    let release = [
        &["settle", "--db", w.db(), "--key", "not-paid", "--release"][..],
        &who[..],
        &w.clock.args(),
    ]
    .concat();
    let early = idem(&release)?;
    ensure!(
        !early.status.success()
            && early.stdout.contains("not stuck yet")
            && early.stdout.contains("--succeeded"),
        "{early:?}"
    );
    expect_blocked(&w.proxy, "/hang", "not-paid")?;
    expect_total(&w.up, 2)?;
    // Past the lease: released, the retry runs once more.
    w.clock.advance(LONG_LEASE_MS + 1)?;
    idem_ok(&release)?;
    w.proxy
        .post("/hang")
        .key("not-paid")
        .json(BODY)
        .send()?
        .expect_problem(504, "outcome-unknown")?;
    expect_total(&w.up, 3)?;
    // A key that is not stuck is refused by name, and left as it is.
    let again = idem(
        &[
            &["settle", "--db", w.db(), "--key", "paid", "--release"][..],
            &who[..],
        ]
        .concat(),
    )?;
    ensure!(
        !again.status.success() && again.stdout.contains("not stuck"),
        "{again:?}"
    );
    // Bad input names the field: a status out of range is the engine's
    // refusal of the success, nothing written.
    let bad = idem(
        &[
            &[
                "settle",
                "--db",
                w.db(),
                "--key",
                "not-paid",
                "--succeeded",
                "--status",
                "42",
            ][..],
            &who[..],
        ]
        .concat(),
    )?;
    ensure!(
        !bad.status.success() && bad.stderr.contains("status"),
        "{bad:?}"
    );
    let rec = idem_ok(
        &[
            &["inspect", "--db", w.db(), "--json", "--key", "not-paid"],
            &who[..],
        ]
        .concat(),
    )?
    .json()?;
    ensure!(rec["status"] == "outcome-unknown", "{rec}");
    Ok(())
}

/// The operator endpoints of the admin listener: closed without a token,
/// refused without the right bearer token, and with it the same list,
/// inspect and settle as the CLI. An admin address other machines can
/// reach is refused at start without a token.
#[test]
fn the_admin_operator_endpoints_need_the_token_and_settle_stuck_keys() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let up = Upstream::start()?;
    let config = "upstream_timeout_ms = 300\n";
    // Without a token: health and metrics only.
    let closed = Serve::new(&up.url(), &dir.path().join("closed.db"))
        .config(config)
        .admin()
        .start()?;
    let admin = closed.admin.clone().context("admin url")?;
    let r = Req::new("GET", &format!("{admin}/keys/stuck?biz=http")).send()?;
    ensure!(r.status == 403, "{r:?}");
    ensure!(Req::new("GET", &format!("{admin}/healthz")).send()?.status == 200);

    let token = "s3cret-admin-token";
    let proxy = Serve::new(&up.url(), &dir.path().join("idem.db"))
        .config(config)
        .admin()
        .admin_token(token)
        .start()?;
    let admin = proxy.admin.clone().context("admin url")?;
    time_out(&proxy, "k")?;
    let stuck_url = format!("{admin}/keys/stuck?biz=http");
    for bad in [None, Some("Bearer wrong"), Some(token)] {
        let mut req = Req::new("GET", &stuck_url);
        if let Some(value) = bad {
            req = req.header("Authorization", value);
        }
        let r = req.send()?;
        ensure!(r.status == 401, "{bad:?}: {r:?}");
        ensure!(r.header("www-authenticate") == Some("Bearer"), "{r:?}");
    }
    let bearer = format!("Bearer {token}");
    let stuck = Req::new("GET", &stuck_url)
        .header("Authorization", &bearer)
        .send()?;
    ensure!(stuck.status == 200, "{stuck:?}");
    let stuck = stuck.json()?;
    ensure!(
        stuck[0]["key"] == "k" && stuck[0]["status"] == "outcome-unknown",
        "{stuck}"
    );
    // The next page, after the only key, is empty; a bad cursor is 400.
    let cursor = stuck[0]["cursor"].as_str().context("cursor")?;
    let next = Req::new("GET", &format!("{stuck_url}&after={cursor}"))
        .header("Authorization", &bearer)
        .send()?
        .json()?;
    ensure!(next == serde_json::json!([]), "{next}");
    let bad = Req::new("GET", &format!("{stuck_url}&after=soon"))
        .header("Authorization", &bearer)
        .send()?;
    ensure!(bad.status == 400 && bad.text().contains("after"), "{bad:?}");
    let who = urlencode(TEST_CLIENT);
    let rec = Req::new("GET", &format!("{admin}/keys?biz=http&key=k&auth={who}"))
        .header("Authorization", &bearer)
        .send()?
        .json()?;
    ensure!(rec["status"] == "outcome-unknown", "{rec}");
    let settle = |body: serde_json::Value| {
        Req::new("POST", &format!("{admin}/keys/settle"))
            .header("Authorization", &bearer)
            .json(&body.to_string())
            .send()
    };
    // Within the lease of the attempt that timed out, its action may
    // still land: a release is refused, with the lease's end.
    let early = settle(serde_json::json!({
        "biz": "http", "key": "k", "auth": TEST_CLIENT, "as": "released",
    }))?;
    ensure!(early.status == 409, "{early:?}");
    let early = early.json()?;
    ensure!(
        early["settlement"] == "not-stuck"
            && early["status"] == "outcome-unknown"
            && early["lease_until"].is_u64(),
        "{early}"
    );
    let request = serde_json::json!({
        "biz": "http", "key": "k", "auth": TEST_CLIENT, "as": "succeeded",
        "status": 201, "headers": [["content-type", "application/json"]],
        "body": "{\"order\":\"o-5\"}",
    });
    // A bad status is the engine's refusal, by field; nothing changes.
    let mut bad = request.clone();
    bad["status"] = 42.into();
    let refused = settle(bad)?;
    ensure!(refused.status == 422, "{refused:?}");
    ensure!(refused.json()?["field"] == "success-result", "{refused:?}");
    let done = settle(request.clone())?;
    ensure!(done.status == 200, "{done:?}");
    ensure!(done.json()?["settlement"] == "settled", "{done:?}");
    let again = settle(request)?;
    ensure!(
        again.status == 409 && again.json()?["settlement"] == "not-stuck",
        "{again:?}"
    );
    let replay = proxy.post("/hang").key("k").json(BODY).send()?;
    ensure!(
        replay.status == 201 && replay.text() == "{\"order\":\"o-5\"}",
        "{replay:?}"
    );
    expect_total(&up, 1)?;

    // Reachable from other machines without a token: refused at start.
    let open = idem(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &up.url(),
        "--db",
        dir.path().join("open.db").to_str().context("path")?,
        "--admin",
        "0.0.0.0:0",
    ])?;
    ensure!(
        !open.status.success() && open.stderr.contains("IDEM_ADMIN_TOKEN"),
        "{open:?}"
    );
    Ok(())
}

/// `value` percent-encoded for a query string.
fn urlencode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Stuck keys are visible: each sweep counts them into `idem_stuck_keys`,
/// and settling one takes it off the count.
#[test]
fn stuck_keys_are_counted_on_the_metrics_until_settled() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let db = dir.path().join("idem.db");
    let up = Upstream::start()?;
    let clock = TestClock::new(dir.path())?;
    let proxy = Serve::new(&up.url(), &db)
        .config(&timing_out("sweep_interval_ms = 20\n", ""))
        .clock(&clock)
        .admin()
        .start()?;
    let admin = proxy.admin.clone().context("admin url")?;
    let metric = |n: u32| format!("idem_stuck_keys{{status=\"outcome-unknown\"}} {n}");
    let wait_for = |wanted: &str| -> Result<()> {
        let deadline = Instant::now() + ARRIVAL;
        loop {
            let text = Req::new("GET", &format!("{admin}/metrics")).send()?.text();
            if text.contains(wanted) {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "no `{wanted}` in:\n{text}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for(&metric(0))?;
    time_out(&proxy, "k")?;
    wait_for(&metric(1))?;
    // Released once the lease of the attempt that timed out has ended.
    clock.advance(LONG_LEASE_MS + 1)?;
    idem_ok(
        &[
            &[
                "settle",
                "--db",
                db.to_str().context("path")?,
                "--auth",
                TEST_CLIENT,
                "--biz",
                "http",
                "--key",
                "k",
                "--release",
            ][..],
            &clock.args(),
        ]
        .concat(),
    )?;
    wait_for(&metric(0))
}

/// Leaves key `k` outcome-unknown: its request times out at the upstream
/// (`upstream_timeout_ms` below the `/hang` endpoint's wait).
fn time_out(proxy: &serve::Proxy, k: &str) -> Result<()> {
    hang_once(proxy, "/hang", k)
}

/// Sends `path` (an upstream path that hangs: `/hang` always, `/hang-once`
/// on a key's first execution) with key `k`: the upstream timeout leaves
/// its outcome unknown (504).
fn hang_once(proxy: &serve::Proxy, path: &str, k: &str) -> Result<()> {
    proxy
        .post(path)
        .key(k)
        .json(BODY)
        .send()?
        .expect_problem(504, "outcome-unknown")?;
    Ok(())
}

/// Sends `path` with key `k`, whose outcome is unknown: 409, nothing run.
fn expect_blocked(proxy: &serve::Proxy, path: &str, k: &str) -> Result<()> {
    proxy
        .post(path)
        .key(k)
        .json(BODY)
        .send()?
        .expect_problem(409, "outcome-unknown")?;
    Ok(())
}

/// Retries `path` with key `k`: within the first attempt's lease the key
/// is blocked (409); once the test clock has moved past the lease, returns
/// the answer.
fn retry_past_the_lease(w: &World, path: &str, k: &str) -> Result<Resp> {
    let r = w.proxy.post(path).key(k).json(BODY).send()?;
    ensure!(r.status == 409, "{k}: not blocked within the lease: {r:?}");
    w.clock.advance(LONG_LEASE_MS + 1)?;
    w.proxy.post(path).key(k).json(BODY).send()
}

/// Seed step 5 with a business lookup: an upstream timeout leaves the
/// outcome unknown; once the lease ends, the retry asks the route's lookup,
/// which finds the order the first attempt created. The key is settled
/// with the lookup's answer and replays it; the upstream ran once.
#[test]
fn an_unknown_outcome_is_settled_by_the_lookup_and_never_runs_twice() -> Result<()> {
    let w = World::start_with(|up| {
        timing_out(
            "",
            &format!("outcome_unknown = \"reconcile\"\nlookup = \"{up}/lookup/{{key}}\"\n"),
        )
    })?;
    time_out(&w.proxy, "k")?;
    expect_total(&w.up, 1)?;
    expect_blocked(&w.proxy, "/hang", "k")?;
    let r = retry_past_the_lease(&w, "/hang", "k")?;
    r.expect_status(200)?;
    ensure!(r.replayed(), "the lookup's answer is replayed: {r:?}");
    ensure!(r.header("x-order-id") == Some("ord-1"), "{r:?}");
    ensure!(r.json()?["found"] == true, "{}", r.text());
    let again = w.proxy.post("/hang").key("k").json(BODY).send()?;
    expect_replay_of(&again, &r)?;
    expect_runs(&w.up, "k", 1)?;
    Ok(())
}

/// The lookup answers 404 (the action did not take effect): the retry
/// after the lease executes, once; a lookup that cannot tell (503) keeps
/// the key blocked, never executed.
#[test]
fn a_lookup_that_finds_nothing_lets_the_retry_run_once_and_one_that_cannot_tell_blocks()
-> Result<()> {
    let w = World::start_with(|up| {
        timing_out(
            "",
            &format!(
                "outcome_unknown = \"reconcile\"\nlookup = \"{up}/lookup-none/{{key}}\"\n\
                 [[routes]]\npath = \"/down/*\"\nbiz_type = \"down\"\n\
                 lookup = \"{up}/lookup-down/{{key}}\"\n"
            ),
        )
    })?;
    hang_once(&w.proxy, "/hang-once", "k")?;
    let r = retry_past_the_lease(&w, "/hang-once", "k")?;
    expect_fresh(&r, 201)?;
    expect_runs(&w.up, "k", 2)?;
    expect_replay_of(&w.proxy.post("/hang-once").key("k").json(BODY).send()?, &r)?;
    expect_runs(&w.up, "k", 2)?;

    hang_once(&w.proxy, "/down/hang-once", "d")?;
    let r = retry_past_the_lease(&w, "/down/hang-once", "d")?;
    r.expect_problem(503, "store-unavailable")?;
    for _ in 0..3 {
        w.proxy
            .post("/down/hang-once")
            .key("d")
            .json(BODY)
            .send()?
            .expect_problem(503, "store-unavailable")?;
    }
    expect_runs(&w.up, "d", 1)?;
    Ok(())
}

/// Under "manual", `idem reconcile` (and the sweep) settle a stuck key
/// through the lookup; a biz type without a lookup is refused, not
/// "reconciled" into a changed record.
#[test]
fn idem_reconcile_settles_stuck_keys_through_the_lookup() -> Result<()> {
    let up_url = std::cell::RefCell::new(String::new());
    let w = World::start_with(|up| {
        *up_url.borrow_mut() = up.to_owned();
        timing_out("", "")
    })?;
    time_out(&w.proxy, "k")?;
    let dir = tempfile::tempdir()?;
    let without = dir.path().join("without.toml");
    std::fs::write(&without, long_lease(""))?;
    let refused = idem(&[
        "reconcile",
        "--db",
        w.db(),
        "--config",
        without.to_str().context("utf-8")?,
        "--biz",
        "http",
    ])?;
    ensure!(
        !refused.status.success() && refused.stderr.contains("has no lookup"),
        "{refused:?}"
    );
    let with = dir.path().join("with.toml");
    std::fs::write(
        &with,
        long_lease(&format!(
            "lookup = \"{}/lookup/{{key}}\"\n",
            up_url.borrow()
        )),
    )?;
    let with = with.to_str().context("utf-8")?;
    let reconcile = || w.idem_json(&["reconcile", "--config", with, "--biz", "http"]);
    // The key is examined once the lease of the attempt that reported it
    // has ended; until then, and after it, "manual" answers 409.
    expect_blocked(&w.proxy, "/hang", "k")?;
    let report = reconcile()?;
    ensure!(
        report["examined"] == 0,
        "examined within the lease: {report}"
    );
    w.clock.advance(LONG_LEASE_MS + 1)?;
    expect_blocked(&w.proxy, "/hang", "k")?;
    let report = reconcile()?;
    ensure!(
        report["succeeded"] == 1 && report["examined"] == 1,
        "{report}"
    );
    let r = w.proxy.post("/hang").key("k").json(BODY).send()?;
    r.expect_status(200)?;
    ensure!(
        r.replayed() && r.header("x-order-id") == Some("ord-1"),
        "{r:?}"
    );
    expect_runs(&w.up, "k", 1)?;
    Ok(())
}

/// Checklist item 7, the compensation task: under "manual", nobody asks;
/// the background sweep reconciles the stuck key through the lookup, and
/// the next request replays what the lookup found.
#[test]
fn the_sweep_settles_stuck_keys_through_the_lookup_in_the_background() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let up = Upstream::start()?;
    let clock = TestClock::new(dir.path())?;
    let proxy = Serve::new(&up.url(), &dir.path().join("idem.db"))
        .admin()
        .clock(&clock)
        .config(&timing_out(
            "sweep_interval_ms = 50\n",
            &format!("lookup = \"{}/lookup/{{key}}\"\n", up.url()),
        ))
        .start()?;
    let admin = proxy.admin.clone().context("admin")?;
    hang_once(&proxy, "/hang-once", "k")?;
    expect_blocked(&proxy, "/hang-once", "k")?;
    // Past the lease, the next sweep (every 50 ms) reconciles the key.
    clock.advance(LONG_LEASE_MS + 1)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = ureq::get(&format!("{admin}/metrics"))
            .call()?
            .into_body()
            .read_to_string()?;
        if metrics.contains("idem_reconciled_total{outcome=\"succeeded\"} 1") {
            break;
        }
        ensure!(Instant::now() < deadline, "never reconciled: {metrics}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = proxy.post("/hang-once").key("k").json(BODY).send()?;
    r.expect_status(200)?;
    ensure!(
        r.replayed() && r.header("x-order-id") == Some("ord-1"),
        "{r:?}"
    );
    expect_runs(&up, "k", 1)
}

/// An unknown outcome is stuck only from the end of the lease of the
/// attempt that reported it (until then the action may still land): `idem
/// stuck` lists it as stuck for 0 s, and `idem sweep` leaves it alone
/// whatever `stuck_retention_ms` says; past the lease and the retention,
/// the sweep releases it and the next request runs again.
#[test]
fn a_stuck_key_is_released_only_past_its_lease_and_its_retention() -> Result<()> {
    let config = timing_out("sweep_interval_ms = 0\n", "stuck_retention_ms = 1000\n");
    let w = World::start(Some(&config))?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("sweep.toml");
    std::fs::write(&path, &config)?;
    let path = path.to_str().context("utf-8")?;
    hang_once(&w.proxy, "/hang-once", "k")?;
    // Well inside the lease (the real time the test takes is the margin).
    w.clock.advance(LONG_LEASE_MS - 10_000)?;
    let listed = w.idem_json(&["stuck", "--biz", "http", "--config", path])?;
    ensure!(
        listed[0]["key"] == "k" && listed[0]["stuck_ms"] == 0,
        "{listed}"
    );
    let swept = w.idem_json(&["sweep", "--config", path])?;
    ensure!(swept["stuck_released"] == serde_json::json!([]), "{swept}");
    expect_blocked(&w.proxy, "/hang-once", "k")?;
    // Past the lease, and the retention after it.
    w.clock.advance(10_000 + 1_000 + 1)?;
    let swept = w.idem_json(&["sweep", "--config", path])?;
    ensure!(swept["stuck_released"][0]["key"] == "k", "{swept}");
    expect_fresh(&w.proxy.post("/hang-once").key("k").json(BODY).send()?, 201)?;
    expect_runs(&w.up, "k", 2)
}

/// A stuck key is bounded: past `stuck_retention_ms` the sweep logs it
/// (naming the key) and releases it, and the next request runs again.
#[test]
fn a_stuck_key_past_its_retention_is_reported_and_released() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let up = Upstream::start()?;
    let clock = TestClock::new(dir.path())?;
    let proxy = Serve::new(&up.url(), &dir.path().join("idem.db"))
        .admin()
        .clock(&clock)
        .config(&timing_out(
            "sweep_interval_ms = 50\n",
            "stuck_retention_ms = 1\n",
        ))
        .start()?;
    hang_once(&proxy, "/hang-once", "k")?;
    // Past the lease, the next sweep (every 50 ms) releases the key.
    clock.advance(LONG_LEASE_MS + 1)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let r = loop {
        let r = proxy.post("/hang-once").key("k").json(BODY).send()?;
        if r.status != 409 || Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    expect_fresh(&r, 201)?;
    expect_runs(&up, "k", 2)?;
    let log = proxy.stderr_with("stuck_retention_ms", Duration::from_secs(5));
    ensure!(
        log.contains("stuck_retention_ms") && log.contains("key=k"),
        "the release is reported: {log}"
    );
    let metrics = ureq::get(&format!(
        "{}/metrics",
        proxy.admin.as_deref().context("admin")?
    ))
    .call()?
    .into_body()
    .read_to_string()?;
    ensure!(
        metrics.contains("idem_stuck_keys_expired_total 1"),
        "{metrics}"
    );
    Ok(())
}
