//! Bad input at the edge of `idem serve`: raw TCP clients send what no
//! well-behaved HTTP client would, and the proxy answers each with a 4xx,
//! forwards nothing and stores nothing. Keys and scopes full of quotes,
//! `%`, `_` and SQL behave like any other; problem bodies never echo a
//! stored response or another scope's data.
//!
//! Every socket read has a timeout ([`READ_TIMEOUT`]), so a proxy that
//! never answers fails the test instead of hanging it.

#[path = "support/serve.rs"]
mod serve;
#[path = "support/upstream.rs"]
mod upstream;
#[path = "support/world.rs"]
mod world;

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use world::World;

/// The longest wait for any answer; far above the proxy's timeouts below.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Short read timeouts for the slow-client cases.
const HEADER_TIMEOUT_MS: u64 = 400;
const BODY_TIMEOUT_MS: u64 = 400;

/// hyper's read buffer limit (`8192 + 4096 * 100`): a head that fills it
/// without ending is refused with 431.
const HYPER_MAX_BUF: usize = 8192 + 4096 * 100;

fn config() -> String {
    format!(
        "header_read_timeout_ms = {HEADER_TIMEOUT_MS}\n\
         body_read_timeout_ms = {BODY_TIMEOUT_MS}\n\
         scope_header = \"X-Tenant\"\n"
    )
}

impl World {
    /// A world whose proxy has the short read timeouts of [`config`].
    fn edge() -> Result<World> {
        World::start(Some(&config()))
    }

    fn addr(&self) -> Result<&str> {
        self.proxy
            .base
            .strip_prefix("http://")
            .context("proxy base URL")
    }

    fn connect(&self) -> Result<TcpStream> {
        let s = TcpStream::connect(self.addr()?)?;
        s.set_read_timeout(Some(READ_TIMEOUT))?;
        s.set_write_timeout(Some(READ_TIMEOUT))?;
        Ok(s)
    }

    fn records(&self) -> Result<Vec<(String, String)>> {
        let conn = rusqlite::Connection::open(&self.db)?;
        let mut stmt =
            conn.prepare("SELECT scope_key, idem_key FROM idempotency_record ORDER BY id")?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    fn expect_nothing_written(&self, what: &str) -> Result<()> {
        let records = self.records()?;
        ensure!(records.is_empty(), "{what}: records written: {records:?}");
        ensure!(
            self.up.total() == 0,
            "{what}: {} requests reached the upstream",
            self.up.total()
        );
        Ok(())
    }
}

/// An answer read off a raw socket.
#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Answer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn problem_type(&self) -> Option<String> {
        let v: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        v["type"].as_str().map(str::to_owned)
    }
}

/// Reads one answer; `None` when the connection closes before any byte.
fn read_answer(s: &mut TcpStream) -> Result<Option<Answer>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match s.read(&mut chunk) {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => bail!("the connection closed inside an answer: {buf:?}"),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                bail!("no answer within {READ_TIMEOUT:?} (read so far: {buf:?})")
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset && buf.is_empty() => return Ok(None),
            Err(e) => return Err(e.into()),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status: u16 = head
        .split(' ')
        .nth(1)
        .context("status line")?
        .parse()
        .with_context(|| format!("status in {head:?}"))?;
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        match s.read(&mut chunk) {
            Ok(0) => bail!("the connection closed inside a body"),
            Ok(n) => body.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(e).context("reading a body"),
        }
    }
    Ok(Some(Answer { status, head, body }))
}

/// True when the server closes the connection (EOF or reset) within the
/// read timeout; false when it stays open.
fn closed_by_server(s: &mut TcpStream) -> Result<bool> {
    let mut byte = [0u8; 1];
    match s.read(&mut byte) {
        Ok(0) => Ok(true),
        Ok(_) => bail!("unexpected bytes after the answer"),
        Err(e) if e.kind() == ErrorKind::ConnectionReset => Ok(true),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Writes `bytes`; a server that answers and closes early may refuse the
/// rest, which is not an error here.
fn send(s: &mut TcpStream, bytes: &[u8]) -> Result<()> {
    match s.write_all(bytes) {
        Ok(()) => Ok(()),
        Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The tenant every raw request names (the proxy refuses keyed requests
/// that name no client).
const TENANT: &[u8] = b"X-Tenant: edge\r\n";

/// A POST to `/orders` from [`TENANT`] with `extra` header lines (each
/// ending in CRLF) and a JSON body with a matching Content-Length.
fn post(extra: &[u8], body: &[u8]) -> Vec<u8> {
    let mut r =
        b"POST /orders HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n".to_vec();
    r.extend_from_slice(TENANT);
    r.extend_from_slice(extra);
    r.extend_from_slice(format!("Content-Length: {}\r\n\r\n", body.len()).as_bytes());
    r.extend_from_slice(body);
    r
}

/// A POST with an `Idempotency-Key` header of these exact bytes.
fn with_key(key: &[u8]) -> Vec<u8> {
    let mut h = b"Idempotency-Key: ".to_vec();
    h.extend_from_slice(key);
    h.extend_from_slice(b"\r\n");
    post(&h, b"{\"sku\":\"A1\"}")
}

/// What a bad input must get.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// This status (hyper's own answers have no body).
    Status(u16),
    /// This status with a problem body of this type.
    Problem(u16, &'static str),
    /// The connection is closed without an answer.
    Closed,
}

/// How the client sends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Everything, then wait.
    Send,
    /// Everything, then close the sending side.
    HalfClose,
}

struct Case {
    what: &'static str,
    bytes: Vec<u8>,
    mode: Mode,
    expect: Expect,
}

fn case(what: &'static str, bytes: impl Into<Vec<u8>>, expect: Expect) -> Case {
    Case {
        what,
        bytes: bytes.into(),
        mode: Mode::Send,
        expect,
    }
}

fn bad_inputs() -> Vec<Case> {
    use Expect::{Closed, Problem, Status};
    let key = b"Idempotency-Key: k-bad\r\n";
    let with = |lines: &[u8]| {
        let mut h = key.to_vec();
        h.extend_from_slice(lines);
        post(&h, b"{}")
    };
    let mut many_headers = key.to_vec();
    for i in 0..150 {
        many_headers.extend_from_slice(format!("X-Filler-{i}: {i}\r\n").as_bytes());
    }
    let mut full_head = b"POST /orders HTTP/1.1\r\nIdempotency-Key: k-bad\r\nX-Big: ".to_vec();
    full_head.resize(HYPER_MAX_BUF, b'a');
    let long_uri = format!(
        "POST /{} HTTP/1.1\r\nIdempotency-Key: k-bad\r\nContent-Length: 0\r\n\r\n",
        "a".repeat(70_000)
    );
    let short_body = b"POST /orders HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: k-bad\r\n\
        X-Tenant: edge\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n\
        {\"sku\":\"A1\"";
    let short_chunk = b"POST /orders HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: k-bad\r\n\
        X-Tenant: edge\r\nTransfer-Encoding: chunked\r\n\r\n20\r\n{\"sku\"";
    let both = |first: &str, second: &str| {
        format!(
            "POST /orders HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: k-bad\r\n\
             Content-Type: application/json\r\n{first}\r\n{second}\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"
        )
        .into_bytes()
    };
    let key_invalid = Problem(400, "key-invalid");
    let mut cases = vec![
        // Malformed heads: hyper answers 400.
        case(
            "a header line without a colon",
            with(b"Bad Header Line\r\n"),
            Status(400),
        ),
        case(
            "a space in a header name",
            with(b"X Bad: 1\r\n"),
            Status(400),
        ),
        case(
            "a space before the colon",
            with(b"X-Bad : 1\r\n"),
            Status(400),
        ),
        case(
            "a NUL in a header value",
            with(b"X-Bad: a\0b\r\n"),
            Status(400),
        ),
        case(
            "a bare CR in a header value",
            with(b"X-Bad: a\rb\r\n"),
            Status(400),
        ),
        case(
            "an obsolete folded header",
            with(b"X-Bad: a\r\n folded\r\n"),
            Status(400),
        ),
        case(
            "braces in a header name",
            with(b"X{Bad}: 1\r\n"),
            Status(400),
        ),
        case(
            "a request line with extra words",
            b"POST /orders HTTP/1.1 extra\r\nIdempotency-Key: k-bad\r\n\r\n".to_vec(),
            Status(400),
        ),
        case(
            "a Content-Length that is no number",
            {
                let mut r = b"POST /orders HTTP/1.1\r\nIdempotency-Key: k-bad\r\n".to_vec();
                r.extend_from_slice(b"Content-Length: ten\r\n\r\n");
                r
            },
            Status(400),
        ),
        case(
            "two different Content-Lengths",
            {
                let mut r = b"POST /orders HTTP/1.1\r\nIdempotency-Key: k-bad\r\n".to_vec();
                r.extend_from_slice(b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}");
                r
            },
            Status(400),
        ),
        case(
            "a Transfer-Encoding that is not chunked",
            {
                let mut r = b"POST /orders HTTP/1.1\r\nIdempotency-Key: k-bad\r\n".to_vec();
                r.extend_from_slice(b"Transfer-Encoding: gzip\r\n\r\n");
                r
            },
            Status(400),
        ),
        case(
            "two Idempotency-Key headers",
            with(b"Idempotency-Key: k-other\r\n"),
            key_invalid,
        ),
        // Oversized heads.
        case("150 headers", post(&many_headers, b"{}"), Status(431)),
        case("a head that fills the read buffer", full_head, Status(431)),
        case("a 70 000-byte URI", long_uri, Status(414)),
        // Key bytes.
        case(
            "invalid UTF-8 in a bare key",
            with_key(b"ab\xffc"),
            key_invalid,
        ),
        case(
            "invalid UTF-8 in a quoted key",
            with_key(b"\"ab\xc3\x28\""),
            key_invalid,
        ),
        case("a lone continuation byte", with_key(b"\x80"), key_invalid),
        case("a tab inside a bare key", with_key(b"a\tb"), key_invalid),
        case(
            "a tab inside a quoted key",
            with_key(b"\"a\tb\""),
            key_invalid,
        ),
        case(
            "a control character (SOH)",
            with_key(b"a\x01b"),
            Status(400),
        ),
        case(
            "a control character (ESC)",
            with_key(b"a\x1bb"),
            Status(400),
        ),
        case("a DEL character", with_key(b"a\x7fb"), Status(400)),
        case("a key of one quote", with_key(b"\""), key_invalid),
        case("a key of two quotes", with_key(b"\"\""), key_invalid),
        case("a key of three quotes", with_key(b"\"\"\""), key_invalid),
        case("a key of four quotes", with_key(b"\"\"\"\""), key_invalid),
        case(
            "a key of seven quotes",
            with_key(b"\"\"\"\"\"\"\""),
            key_invalid,
        ),
        case(
            "a quoted key of only spaces",
            with_key(b"\"   \""),
            key_invalid,
        ),
        // Framing.
        case(
            "Content-Length, then Transfer-Encoding",
            both("Content-Length: 2", "Transfer-Encoding: chunked"),
            Problem(400, "invalid-request"),
        ),
        case(
            "Transfer-Encoding, then Content-Length",
            both("Transfer-Encoding: chunked", "Content-Length: 2"),
            Problem(400, "invalid-request"),
        ),
        case(
            "Content-Length with a chunked, gzip-free coding list",
            both("Content-Length: 9", "Transfer-Encoding: identity, chunked"),
            Problem(400, "invalid-request"),
        ),
        case(
            "a body shorter than its Content-Length, then silence",
            short_body.to_vec(),
            Problem(408, "request-timeout"),
        ),
        case(
            "a chunk cut short, then silence",
            short_chunk.to_vec(),
            Problem(408, "request-timeout"),
        ),
        // Slow heads.
        case(
            "a head that stops half-way",
            b"POST /orders HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: k-bad\r\nContent-Le"
                .to_vec(),
            Problem(408, "request-timeout"),
        ),
        case(
            "a request line that stops half-way",
            b"POST /ord".to_vec(),
            Problem(408, "request-timeout"),
        ),
        case("a connection that sends nothing", Vec::new(), Closed),
        case(
            "a keyed request that names no client",
            b"POST /orders HTTP/1.1\r\nHost: proxy\r\nIdempotency-Key: k-bad\r\n\
              X-Forwarded-For: 198.51.100.7\r\nContent-Type: application/json\r\n\
              Content-Length: 2\r\n\r\n{}"
                .to_vec(),
            Problem(401, "client-unidentified"),
        ),
    ];
    for (what, bytes) in [
        (
            "a body shorter than its Content-Length, then EOF",
            short_body.to_vec(),
        ),
        ("a chunk cut short, then EOF", short_chunk.to_vec()),
    ] {
        cases.push(Case {
            what,
            bytes,
            mode: Mode::HalfClose,
            expect: Problem(400, "invalid-request"),
        });
    }
    cases
}

#[test]
fn bad_input_at_the_edge_is_4xx_and_writes_nothing() -> Result<()> {
    let w = World::edge()?;
    let cases = bad_inputs();
    for c in &cases {
        let started = Instant::now();
        let mut s = w.connect()?;
        send(&mut s, &c.bytes)?;
        if c.mode == Mode::HalfClose {
            s.shutdown(Shutdown::Write)?;
        }
        let answer = read_answer(&mut s).context(c.what)?;
        match (c.expect, &answer) {
            (Expect::Closed, None) => {}
            (Expect::Status(status), Some(a)) => ensure!(
                a.status == status,
                "{}: expected {status}, got {a:?} ({})",
                c.what,
                a.text()
            ),
            (Expect::Problem(status, kind), Some(a)) => {
                ensure!(
                    a.status == status,
                    "{}: expected {status}, got {a:?} ({})",
                    c.what,
                    a.text()
                );
                ensure!(
                    a.head
                        .to_ascii_lowercase()
                        .contains("content-type: application/problem+json"),
                    "{}: not a problem: {}",
                    c.what,
                    a.head
                );
                let ty = a.problem_type().unwrap_or_default();
                ensure!(
                    ty == serve::problem_type(kind),
                    "{}: problem type {ty}",
                    c.what
                );
            }
            (expect, got) => bail!("{}: expected {expect:?}, got {got:?}", c.what),
        }
        if matches!(c.expect, Expect::Closed) || c.what.contains("stops half-way") {
            // A slow head ends the connection; it took about the timeout.
            ensure!(
                closed_by_server(&mut s)?,
                "{}: connection left open",
                c.what
            );
            let took = started.elapsed();
            ensure!(
                took >= Duration::from_millis(HEADER_TIMEOUT_MS),
                "{}: closed after {took:?}, before the timeout",
                c.what
            );
        }
        w.expect_nothing_written(c.what)?;
    }
    println!("bad inputs tried: {}", cases.len());

    // The proxy still works, so the checks above could have failed.
    let mut s = w.connect()?;
    send(&mut s, &with_key(b"k-good"))?;
    let a = read_answer(&mut s)?.context("no answer to a good request")?;
    ensure!(a.status == 201, "a good request: {a:?}");
    ensure!(w.up.total() == 1 && w.records()?.len() == 1);
    Ok(())
}

/// Keys and scopes that would break a query built by string pasting, or
/// match other keys under `LIKE`.
const ODD: [&str; 10] = [
    "a%",
    "a_",
    "%",
    "_",
    "'",
    "'OR'1'='1",
    "';DROP/**/TABLE/**/idempotency_record;--",
    "k\"q\"",
    "\\",
    "x%_'\"\\;--",
];

/// An `Idempotency-Key` value meaning `key`: a Structured Field string
/// (quotes and backslashes escaped).
fn sf_string(key: &str) -> String {
    format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
}

#[test]
fn odd_keys_and_scopes_behave_like_any_other() -> Result<()> {
    let w = World::edge()?;
    let mut expected = Vec::new();
    let mut executions = 0;
    for (i, odd) in ODD.iter().enumerate() {
        let body = format!("{{\"n\":{i}}}");
        // As a key, in a plain scope; then as a scope, with a plain key.
        for (scope, key) in [("plain", *odd), (*odd, "plain-key")] {
            let req = || {
                w.proxy
                    .post("/orders")
                    .header("X-Tenant", scope)
                    .key(sf_string(key))
                    .json(&body)
            };
            let first = req().send()?;
            first
                .expect_status(201)
                .context(format!("{scope:?} / {key:?}"))?;
            executions += 1;
            let again = req().send()?;
            again.expect_status(201)?;
            ensure!(again.replayed(), "{scope:?} / {key:?}: not replayed");
            ensure!(
                again.header("x-order-id") == first.header("x-order-id"),
                "{scope:?} / {key:?}: another order replayed"
            );
            ensure!(
                w.up.total() == executions,
                "{scope:?} / {key:?}: executed twice"
            );
            expected.push((format!("hdr:{scope}"), key.to_owned()));
        }
    }
    // Neighbours a LIKE pattern or a lost quote would confuse: new keys.
    for (scope, key) in [
        ("plain", "ab"),
        ("plain", "a"),
        ("plain", "aa"),
        ("pl", "plain-key"),
    ] {
        let r = w
            .proxy
            .post("/orders")
            .header("X-Tenant", scope)
            .key(key)
            .json("{\"n\":0}")
            .send()?;
        r.expect_status(201)?;
        ensure!(!r.replayed(), "{scope}/{key} answered from another key");
        executions += 1;
        expected.push((format!("hdr:{scope}"), key.to_owned()));
    }
    ensure!(w.up.total() == executions);
    // Stored verbatim, one record each, and the table is still there.
    let mut records = w.records()?;
    records.sort();
    expected.sort();
    ensure!(
        records == expected,
        "records {records:?}\nexpected {expected:?}"
    );
    // The operator commands read them too.
    let db = w.db.to_str().context("path")?;
    for odd in ODD {
        let scope = format!("hdr:{odd}");
        let out = serve::idem_ok(&[
            "inspect",
            "--db",
            db,
            "--scope",
            &scope,
            "--biz",
            "http",
            "--key",
            "plain-key",
            "--json",
        ])?;
        let v = out.json()?;
        ensure!(v["status"] == "succeeded", "inspect {odd:?}: {v}");
    }
    Ok(())
}

#[test]
fn problem_bodies_never_echo_stored_or_other_scopes_data() -> Result<()> {
    let w = World::edge()?;
    let secret_scope = "tenant-alpha-7f3a9c";
    let stored_path = "/orders?note=alpha-stored-3b8e1d";
    let secret_body = r#"{"card":"alpha-card-5d2c77"}"#;
    let first = w
        .proxy
        .post(stored_path)
        .header("X-Tenant", secret_scope)
        .key("shared-key")
        .json(secret_body)
        .send()?;
    first.expect_status(201)?;
    let order = first.header("x-order-id").context("order id")?.to_owned();
    let secrets: [&[u8]; 4] = [
        secret_scope.as_bytes(),
        &b"alpha-stored-3b8e1d"[..],
        &b"alpha-card-5d2c77"[..],
        order.as_bytes(),
    ];
    let mut problems = 0;
    // Same scope, same key, another request: 422, nothing of the first.
    let r = w
        .proxy
        .post("/orders")
        .header("X-Tenant", secret_scope)
        .key("shared-key")
        .json(r#"{"card":"other"}"#)
        .send()?;
    r.expect_problem(422, "key-reused")?;
    r.expect_not_containing(&secrets)?;
    problems += 1;
    // Other scopes with the same key execute on their own; their problems
    // reveal nothing of the first scope.
    let other = w
        .proxy
        .post("/orders")
        .header("X-Tenant", "tenant-beta")
        .key("shared-key")
        .json(r#"{"card":"beta"}"#)
        .send()?;
    other.expect_status(201)?;
    ensure!(!other.replayed());
    other.expect_not_containing(&secrets)?;
    for (what, req) in [
        (
            "mismatch in another scope",
            w.proxy
                .post("/orders")
                .header("X-Tenant", "tenant-beta")
                .key("shared-key")
                .json(secret_body),
        ),
        (
            "invalid key in the first scope",
            w.proxy
                .post(stored_path)
                .header("X-Tenant", secret_scope)
                .key("bad key")
                .json(secret_body),
        ),
        (
            "missing key in the first scope",
            w.proxy
                .post(stored_path)
                .header("X-Tenant", secret_scope)
                .json(secret_body),
        ),
        (
            "body not JSON in the first scope",
            w.proxy
                .post(stored_path)
                .header("X-Tenant", secret_scope)
                .key("shared-key-2")
                .body("application/json", b"{not json alpha-card-5d2c77"),
        ),
    ] {
        let r = req.send()?;
        ensure!((400..500).contains(&r.status), "{what}: {r:?}");
        // The request's own text may come back in a detail; the stored
        // response, the first scope's name and its order never do.
        let never: [&[u8]; 3] = [
            &b"alpha-stored-3b8e1d"[..],
            order.as_bytes(),
            secret_scope.as_bytes(),
        ];
        r.expect_not_containing(&never).context(what)?;
        problems += 1;
    }
    // An in-progress duplicate in the first scope.
    let slow_key = "slow-key";
    let w_ref = &w;
    std::thread::scope(|s| -> Result<()> {
        let slow = s.spawn(move || {
            w_ref
                .proxy
                .post("/slow?ms=1500")
                .header("X-Tenant", secret_scope)
                .key(slow_key)
                .json(secret_body)
                .send()
        });
        w_ref.up.wait_for_total(3, READ_TIMEOUT)?;
        let dup = w_ref
            .proxy
            .post("/slow?ms=1500")
            .header("X-Tenant", secret_scope)
            .key(slow_key)
            .json(secret_body)
            .send()?;
        dup.expect_problem(409, "request-in-progress")?;
        dup.expect_not_containing(&[
            &b"alpha-stored-3b8e1d"[..],
            order.as_bytes(),
            secret_scope.as_bytes(),
        ])?;
        slow.join()
            .map_err(|_| anyhow::anyhow!("slow request panicked"))??
            .expect_status(201)?;
        Ok(())
    })?;
    problems += 1;
    println!("problem answers checked: {problems}");
    ensure!(w.up.total() == 3, "executions: {}", w.up.total());
    Ok(())
}

/// A POST to `/orders` split where a client that writes its head and its
/// body apart splits it: `(head, body)`. `extra` as in [`post`].
fn post_split(extra: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let body = b"{\"sku\":\"A1\"}";
    let whole = post(extra, body);
    let (head, body) = whole.split_at(whole.len() - body.len());
    (head.to_vec(), body.to_vec())
}

/// A refusal answered before the request's body arrived (no key, a bad
/// key, two keys, no scope) leaves the connection usable for the next
/// request: the body is discarded after the answer. A client waiting for
/// `100 Continue` gets `Connection: close` instead, and the connection
/// closes. Never an answer that promises keep-alive on a connection then
/// closed: a client pools that connection, and its next request fails
/// with nothing sent back (the flake "PATCH: Peer disconnected" in
/// `tests/proxy.rs`).
#[test]
fn a_refusal_before_the_body_keeps_its_word_about_the_connection() -> Result<()> {
    let w = World::edge()?;
    let cases: [(&str, &[u8], u16, &str); 5] = [
        ("no key", b"", 400, "key-missing"),
        (
            "no key, waiting for 100 Continue",
            b"Expect: 100-continue\r\n",
            400,
            "key-missing",
        ),
        (
            "an invalid key",
            b"Idempotency-Key: \"unterminated\r\n",
            400,
            "key-invalid",
        ),
        (
            "two keys",
            b"Idempotency-Key: \"a\"\r\nIdempotency-Key: \"b\"\r\n",
            400,
            "key-invalid",
        ),
        ("no scope", b"", 401, "client-unidentified"),
    ];
    for (what, extra, status, kind) in cases {
        let (mut head, body) = post_split(extra);
        if what == "no scope" {
            let tenant = head
                .windows(TENANT.len())
                .position(|w| w == TENANT)
                .context("tenant line")?;
            head.drain(tenant..tenant + TENANT.len());
            // Keyed, so that the scope is asked for.
            let at = head.len() - 2;
            head.splice(at..at, b"Idempotency-Key: \"k\"\r\n".iter().copied());
        }
        let mut s = w.connect()?;
        send(&mut s, &head)?;
        let first = read_answer(&mut s)
            .context(what)?
            .with_context(|| format!("{what}: no answer before the body"))?;
        ensure!(
            first.status == status,
            "{what}: {first:?} ({})",
            first.text()
        );
        let ty = first.problem_type().unwrap_or_default();
        ensure!(ty == serve::problem_type(kind), "{what}: problem type {ty}");
        // The body the head announced, then a whole second request.
        send(&mut s, &body)?;
        send(&mut s, &post(b"", b"{\"sku\":\"A2\"}"))?;
        let closes = first
            .head
            .to_ascii_lowercase()
            .contains("connection: close");
        ensure!(
            closes == what.contains("100 Continue"),
            "{what}: connection: close said {closes}: {}",
            first.head
        );
        match read_answer(&mut s) {
            Ok(Some(second)) => ensure!(
                !closes,
                "{what}: answered on a connection said to close: {second:?}"
            ),
            Ok(None) | Err(_) if closes => {}
            Ok(None) => bail!("{what}: kept alive, then closed before the next answer"),
            Err(e) => bail!("{what}: kept alive, then the next request failed: {e:#}"),
        }
    }
    w.expect_nothing_written("refusals before the body")
}
