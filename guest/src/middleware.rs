//! The `middleware` world: the exported `wasi:http/incoming-handler` wraps
//! the imported one so that a request with an `Idempotency-Key` runs the
//! wrapped handler at most once.
//!
//! Every decision is the engine's: the handler calls [`machine::begin`],
//! [`machine::complete`] and [`machine::fail`] through the same [`Imports`]
//! environment as the `engine` export, and only maps HTTP to a
//! `begin-request` and decisions back to HTTP, with the rules `idem serve`
//! runs too ([`idem_http`]; [`crate::http`] converts its types).
//!
//! A wasm guest cannot run a heartbeat beside the wrapped handler, so a
//! handler must answer within [`LEASE_MS`]; past it a duplicate takes the
//! key over (the first run's outcome is then discarded by fencing).

use alloc::borrow::ToOwned;
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

use crate::bindings::exports::idem::engine::engine::{
    BeginRequest, Completion, Disposition, EngineError, ExpiredLease, FailureMode, InProgressMode,
    KeyCharset, KeyFormat, Policy, Ticket,
};
use crate::bindings::exports::wasi::http::incoming_handler::Guest as HandlerGuest;
use crate::bindings::idem::engine::http_bridge::{self, BodyError, ResponseCapture};
use crate::bindings::idem::engine::types::{Failure, RecordKey, StoredResponse, Success};
use crate::bindings::wasi::http::incoming_handler as inner;
use crate::bindings::wasi::http::types::{
    Fields, IncomingRequest, Method, OutgoingBody, OutgoingResponse, ResponseOutparam,
};
use crate::component::{Component, Imports};
use crate::http;
use crate::machine;
use idem_http::{Answer, KeyRequirement, Problem, ServerErrors};

/// The biz type of every key the middleware stores: the same as the
/// proxy's default route, so `idem inspect --biz http` finds them.
pub const BIZ_TYPE: &str = "http";

/// How long a settled key is replayed: a day, the proxy's default, long
/// enough for any client's retries.
pub const RETENTION_MS: u64 = 24 * 60 * 60 * 1000;

/// How long the wrapped handler may run before a duplicate may take the key
/// over: a minute, the proxy's default lease. There is no heartbeat inside
/// a component, so this is the longest a handler may take.
pub const LEASE_MS: u64 = 60 * 1000;

/// The longest retry-after hint for an in-progress key: one second, the
/// proxy's default, short enough for a client to see the outcome soon.
pub const RETRY_AFTER_MS: u64 = 1000;

/// What a keyed request without `Authorization` gets: a 401
/// `client-unidentified`, nothing stored, the handler not run. The same as
/// `idem serve`'s default (`anonymous = "reject"`): without a credential
/// one client cannot be told from another, and a shared scope would give
/// one client another's stored response. The middleware has no
/// configuration of its own (its policy is fixed too), and `wasi:http` 0.2
/// gives it no client address, so `client-address` has no counterpart.
pub const ANONYMOUS: idem_http::AnonymousMode = idem_http::AnonymousMode::Reject;

/// What a 5xx from the wrapped handler means: retryable, `idem serve`'s
/// default (`server_errors = "retry"`).
pub const SERVER_ERRORS: ServerErrors = ServerErrors::Retry;

/// Whether POST and PATCH need a key: they do, as `idem serve`'s default;
/// other unsafe methods are deduplicated only when they carry one.
pub const POST_PATCH_KEY: KeyRequirement = KeyRequirement::Required;

/// The largest request body fingerprinted: 1 MiB, the proxy's default. The
/// host's bridge enforces its own limit on what it buffers.
pub const MAX_BODY_BYTES: u32 = 1024 * 1024;

/// The most bytes written to an output stream in one
/// `blocking-write-and-flush`, the limit `wasi:io` sets for that call.
const WRITE_CHUNK: usize = 4096;

/// The policy of every key, as the proxy's defaults: expired leases are
/// taken over, failures follow their disposition, duplicates of a running
/// request are answered at once.
pub fn policy() -> Policy {
    Policy {
        retention_ms: RETENTION_MS,
        lease_ms: LEASE_MS,
        retry_after_ms: RETRY_AFTER_MS,
        expired_lease: ExpiredLease::TakeOver,
        failure_mode: FailureMode::HonorDisposition,
        in_progress: InProgressMode::Reject,
        fingerprint_fields: Vec::new(),
        key_format: KeyFormat {
            min_length: 1,
            max_length: 255,
            charset: KeyCharset::PrintableAscii,
        },
        max_body_bytes: MAX_BODY_BYTES,
    }
}

fn method_name(method: &Method) -> String {
    match method {
        Method::Get => "GET".into(),
        Method::Head => "HEAD".into(),
        Method::Post => "POST".into(),
        Method::Put => "PUT".into(),
        Method::Delete => "DELETE".into(),
        Method::Connect => "CONNECT".into(),
        Method::Options => "OPTIONS".into(),
        Method::Trace => "TRACE".into(),
        Method::Patch => "PATCH".into(),
        Method::Other(other) => other.clone(),
    }
}

/// The values of header `name` (lowercase), in order.
fn values<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Vec<&'a [u8]> {
    headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_slice())
        .collect()
}

/// Sends `response` through `out`, with `Idempotent-Replayed: true` when
/// `replayed`. Headers the host refuses (such as hop-by-hop ones) are left
/// out.
fn respond(out: ResponseOutparam, response: &StoredResponse, replayed: bool) {
    let fields = Fields::new();
    for (name, value) in idem_http::response_headers(&response.headers, replayed) {
        let _ = fields.append(name, value);
    }
    let outgoing = OutgoingResponse::new(fields);
    if outgoing.set_status_code(response.status).is_err() {
        return send_problem(out, &Problem::not_replayable());
    }
    let Ok(body) = outgoing.body() else {
        return;
    };
    ResponseOutparam::set(out, Ok(outgoing));
    if let Ok(stream) = body.write() {
        for chunk in response.body.chunks(WRITE_CHUNK) {
            if stream.blocking_write_and_flush(chunk).is_err() {
                // The client went away; nothing more can be sent.
                return;
            }
        }
    }
    let _ = OutgoingBody::finish(body, None);
}

fn send_problem(out: ResponseOutparam, problem: &Problem) {
    respond(out, &http::problem_response(problem), false);
}

/// The answer to a decision other than `execute`.
fn answer(out: ResponseOutparam, answer: Answer<Ticket, StoredResponse>) {
    match answer {
        // `handle` runs an `execute` itself; one here cannot be run.
        Answer::Execute(_) => send_problem(out, &Problem::not_completed()),
        Answer::Replay(stored) => respond(out, &stored, true),
        Answer::Problem(problem) => send_problem(out, &problem),
    }
}

/// What the wrapped handler's response means for the key.
enum Outcome {
    Complete(Success),
    Fail(Failure, Disposition),
}

impl Outcome {
    fn of(response: &StoredResponse) -> Outcome {
        let stored = idem_http::storable(response.headers.len(), response.body.len())
            .then(|| response.clone());
        match http::disposition(idem_http::classify_status(response.status, SERVER_ERRORS)) {
            None => Outcome::Complete(Success {
                result_ref: None,
                response: stored,
            }),
            Some(disposition) => Outcome::Fail(
                Failure {
                    code: format!("http-{}", response.status),
                    message: format!("the handler answered {}", response.status),
                    response: stored.filter(|_| disposition == Disposition::Final),
                },
                disposition,
            ),
        }
    }

    fn without_response(self) -> Outcome {
        match self {
            Outcome::Complete(s) => Outcome::Complete(Success {
                response: None,
                ..s
            }),
            Outcome::Fail(f, d) => Outcome::Fail(
                Failure {
                    response: None,
                    ..f
                },
                d,
            ),
        }
    }

    fn has_response(&self) -> bool {
        match self {
            Outcome::Complete(s) => s.response.is_some(),
            Outcome::Fail(f, _) => f.response.is_some(),
        }
    }
}

/// Stores the outcome; a response the engine refuses to keep is dropped
/// and the outcome stored without it, as the proxy does. The outcome of a
/// run that lost its key, or that the store could not take, is not kept:
/// the key stays in progress until its lease ends.
fn settle(ticket: &Ticket, policy: &Policy, outcome: Outcome) -> Result<Completion, EngineError> {
    let mut outcome = outcome;
    loop {
        let answer = match &outcome {
            Outcome::Complete(s) => machine::complete(&Imports, ticket, policy, s),
            Outcome::Fail(f, d) => machine::fail(&Imports, ticket, policy, f, *d),
        };
        match answer {
            Err(EngineError::Invalid(_)) if outcome.has_response() => {
                outcome = outcome.without_response();
            }
            other => return other,
        }
    }
}

/// Runs the wrapped handler once for the key `ticket` owns, stores what it
/// answered and sends the answer.
fn execute(request: IncomingRequest, out: ResponseOutparam, ticket: &Ticket, policy: &Policy) {
    let capture = ResponseCapture::new();
    let Some(param) = capture.outparam() else {
        return send_problem(out, &Problem::no_response_slot());
    };
    inner::handle(request, param);
    match capture.finish() {
        Ok(response) => {
            // The client gets the handler's answer whatever the store says:
            // the handler ran. A store failure leaves the key in progress
            // until its lease ends, then a retry may run it again.
            let _ = settle(ticket, policy, Outcome::of(&response));
            respond(out, &response, false);
        }
        Err(message) => {
            let failure = Failure {
                code: "handler-failed".to_owned(),
                message: truncate(&message, 4096),
                response: None,
            };
            let _ = settle(
                ticket,
                policy,
                Outcome::Fail(failure, Disposition::OutcomeUnknown),
            );
            send_problem(out, &Problem::handler_incomplete());
        }
    }
}

/// `text` cut to at most `max` bytes at a character boundary.
fn truncate(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

impl HandlerGuest for Component {
    fn handle(request: IncomingRequest, out: ResponseOutparam) {
        let method = method_name(&request.method());
        if idem_http::is_safe_method(&method) {
            return inner::handle(request, out);
        }
        // The headers are a child of the request: read them, then let them
        // go before the request is handed on.
        let headers = request.headers().entries();
        let keys = values(&headers, idem_http::IDEMPOTENCY_KEY);
        let key = match keys.as_slice() {
            [] => match idem_http::key_requirement(&method, None, POST_PATCH_KEY) {
                KeyRequirement::Required => {
                    return send_problem(out, &Problem::key_missing(&method));
                }
                KeyRequirement::Optional => return inner::handle(request, out),
            },
            [value] => match idem_http::parse_idempotency_key(value) {
                Ok(key) => key,
                Err(e) => return send_problem(out, &Problem::key_invalid(&e)),
            },
            _ => return send_problem(out, &Problem::several_keys()),
        };
        // No scope header is configured, and `wasi:http` gives no peer
        // address.
        let scope = match idem_http::derive_scope(
            None,
            &values(&headers, "authorization"),
            ANONYMOUS,
            None::<idem_http::NoPeerAddress>,
        ) {
            Ok(scope) => scope,
            Err(e) => return send_problem(out, &Problem::scope(&e, None)),
        };
        let body = match http_bridge::request_body(&request) {
            Ok(body) => body,
            Err(BodyError::TooLarge(limit)) => {
                return send_problem(out, &Problem::body_too_large(limit));
            }
            Err(BodyError::Unreadable(_)) => {
                return send_problem(out, &Problem::body_unreadable());
            }
        };
        // The first Content-Type, as the proxy reads it.
        let content_type = values(&headers, "content-type").first().copied();
        let kind = http::body_kind(idem_http::body_kind(content_type));
        let path = request.path_with_query().unwrap_or_else(|| "/".into());
        let policy = policy();
        let begin = BeginRequest {
            key: RecordKey {
                scope,
                biz_type: BIZ_TYPE.into(),
                idem_key: key,
            },
            attributes: Vec::from([("method".into(), method), ("path".into(), path)]),
            body_kind: kind,
            body,
            policy: policy.clone(),
        };
        match machine::begin(&Imports, &begin).map(|d| idem_http::answer(http::decision(d))) {
            Ok(Answer::Execute(ticket)) => execute(request, out, &ticket, &policy),
            Ok(other) => answer(out, other),
            Err(e) => send_problem(
                out,
                &idem_http::engine_error_problem(http::engine_failure(&e)),
            ),
        }
    }
}
