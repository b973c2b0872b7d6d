//! The `middleware` world: the exported `wasi:http/incoming-handler` wraps
//! the imported one so that a request with an `Idempotency-Key` runs the
//! wrapped handler at most once.
//!
//! Every decision is the engine's: the handler calls [`machine::begin`],
//! [`machine::complete`] and [`machine::fail`] through the same [`Imports`]
//! environment as the `engine` export, and only maps HTTP to a
//! `begin-request` and decisions back to HTTP, with the rules of
//! `idem serve` ([`crate::http`]). What differs per request (the biz type,
//! the policy, whether a key is required, how a client is identified, what
//! a 5xx means) comes from the host's configuration for the request's
//! route, through `http-bridge.request-route`.
//!
//! A wasm guest cannot run a heartbeat beside the wrapped handler, so a
//! handler must answer within the route policy's `lease-ms`; past it a
//! duplicate may take the key over (the first run's outcome is then
//! discarded by fencing).

use alloc::borrow::ToOwned;
use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

use crate::bindings::exports::idem::engine::engine::{
    BeginRequest, Completion, Decision, Disposition, EngineError, InputField, InputRule,
    InvalidInput, Policy, Ticket,
};
use crate::bindings::exports::wasi::http::incoming_handler::Guest as HandlerGuest;
use crate::bindings::idem::engine::http_bridge::{
    self, AnonymousMode, BodyError, KeyRequirement, ResponseCapture, Route, ServerErrors,
};
use crate::bindings::idem::engine::types::{Failure, RecordKey, StoredResponse, Success};
use crate::bindings::wasi::http::incoming_handler as inner;
use crate::bindings::wasi::http::types::{
    Fields, IncomingRequest, Method, OutgoingBody, OutgoingResponse, ResponseOutparam,
};
use crate::component::{Component, Imports};
use crate::http::{self, Problem, ProblemType};
use crate::machine;
use sha2::Digest;

/// The most bytes written to an output stream in one
/// `blocking-write-and-flush`, the limit `wasi:io` sets for that call.
const WRITE_CHUNK: usize = 4096;

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
    for (name, value) in &response.headers {
        if replayed && name.eq_ignore_ascii_case(http::IDEMPOTENT_REPLAYED) {
            continue;
        }
        let _ = fields.append(name, value);
    }
    if replayed {
        let _ = fields.append(http::IDEMPOTENT_REPLAYED, b"true");
    }
    let outgoing = OutgoingResponse::new(fields);
    if outgoing.set_status_code(response.status).is_err() {
        let problem = Problem::new(
            ProblemType::InternalError,
            "The stored response for this Idempotency-Key cannot be replayed.",
        );
        return send_problem(out, &problem);
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
    let body = serde_json::to_vec(&problem.to_json()).unwrap_or_default();
    let response = StoredResponse {
        status: problem.status,
        headers: problem.headers(),
        body,
    };
    respond(out, &response, false);
}

/// The problem for an `invalid` decision, as the proxy's `invalid_problem`.
fn invalid_problem(i: &InvalidInput) -> Problem {
    let kind = match (i.field, i.rule) {
        (InputField::IdemKey, _) => ProblemType::KeyInvalid,
        (InputField::Body, InputRule::TooLong) => ProblemType::BodyTooLarge,
        _ => ProblemType::InvalidRequest,
    };
    Problem::new(kind, i.message.clone())
        .with("field", field_name(i.field))
        .with("rule", rule_name(i.rule))
}

fn field_name(field: InputField) -> &'static str {
    match field {
        InputField::Scope => "scope",
        InputField::BizType => "biz-type",
        InputField::IdemKey => "idem-key",
        InputField::Attributes => "attributes",
        InputField::Body => "body",
        InputField::Policy => "policy",
        InputField::SuccessResult => "success-result",
        InputField::FailureInfo => "failure-info",
        InputField::Ticket => "ticket",
    }
}

fn rule_name(rule: InputRule) -> &'static str {
    match rule {
        InputRule::Required => "required",
        InputRule::TooShort => "too-short",
        InputRule::TooLong => "too-long",
        InputRule::BadCharacter => "bad-character",
        InputRule::BadFormat => "bad-format",
        InputRule::NotJson => "not-json",
        InputRule::OutOfRange => "out-of-range",
    }
}

/// The problem for an engine error: 503 when the store failed, 500
/// otherwise, as the proxy's `engine_error_problem`.
fn engine_error_problem(e: &EngineError) -> Problem {
    match e {
        EngineError::Store(_) => Problem::new(
            ProblemType::StoreUnavailable,
            "The idempotency store did not answer and the request was not forwarded. Retry with the same Idempotency-Key.",
        )
        .retry_after_ms(1000),
        _ => Problem::new(
            ProblemType::InternalError,
            "The idempotency engine failed and the request was not forwarded.",
        ),
    }
}

/// The answer to a decision other than `execute`.
fn answer(out: ResponseOutparam, decision: Decision) {
    let problem = match decision {
        Decision::Execute(_) => Problem::new(
            ProblemType::InternalError,
            "The request could not be completed. Retry with the same Idempotency-Key.",
        ),
        Decision::Replay(replayed) => match replayed.response {
            Some(stored) => return respond(out, &stored, true),
            None => Problem::new(
                ProblemType::ResponseNotStored,
                "The request with this Idempotency-Key was already processed, but its response was not kept and cannot be replayed. Do not send it again.",
            ),
        },
        Decision::InProgress(busy) => Problem::new(
            ProblemType::RequestInProgress,
            format!(
                "The first request with this Idempotency-Key is still being processed. Retry after {} s with the same key and request.",
                http::retry_after_secs(busy.retry_after_ms)
            ),
        )
        .retry_after_ms(busy.retry_after_ms),
        Decision::Mismatch(_) => Problem::new(
            ProblemType::KeyReused,
            "This Idempotency-Key was already used with a different request (method, path or body). Use a new key for a new request.",
        ),
        Decision::Failed(failure) => match failure.response {
            Some(stored) => return respond(out, &stored, true),
            None => Problem::new(
                ProblemType::RequestFailed,
                "The request with this Idempotency-Key failed for good, and no response was kept. Use a new key to try again.",
            ),
        },
        Decision::OutcomeUnknown(_) => Problem::new(
            ProblemType::OutcomeUnknown,
            "An earlier attempt with this Idempotency-Key may or may not have taken effect. It will not be executed again until the outcome is settled; do not retry it with a new key before checking whether it took effect.",
        ),
        Decision::Invalid(i) => invalid_problem(&i),
    };
    send_problem(out, &problem);
}

/// What the wrapped handler's response means for the key.
enum Outcome {
    Complete(Success),
    Fail(Failure, Disposition),
}

impl Outcome {
    /// The outcome of `response`; a 5xx is made final when the route says
    /// `server-errors: store`, as `idem serve` does.
    fn of(response: &StoredResponse, server_errors: ServerErrors) -> Outcome {
        let stored =
            http::storable(response.headers.len(), response.body.len()).then(|| response.clone());
        let disposition = match http::classify_status(response.status) {
            Some(Disposition::Retryable)
                if response.status >= 500 && server_errors == ServerErrors::Store =>
            {
                Some(Disposition::Final)
            }
            other => other,
        };
        match disposition {
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
fn execute(
    request: IncomingRequest,
    out: ResponseOutparam,
    ticket: &Ticket,
    route: &Route,
    handler: impl FnOnce(&Ticket, IncomingRequest, ResponseOutparam),
) {
    let capture = ResponseCapture::new();
    let Some(param) = capture.outparam() else {
        return send_problem(
            out,
            &Problem::new(
                ProblemType::InternalError,
                "The host gave no response slot for the handler.",
            ),
        );
    };
    handler(ticket, request, param);
    let policy = &route.policy;
    match capture.finish() {
        Ok(response) => {
            // The client gets the handler's answer whatever the store says:
            // the handler ran. A store failure leaves the key in progress
            // until its lease ends, then a retry may run it again.
            let _ = settle(ticket, policy, Outcome::of(&response, route.server_errors));
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
            send_problem(
                out,
                &Problem::new(
                    ProblemType::OutcomeUnknown,
                    "The handler gave no complete response; the request may or may not have taken effect. Requests with this Idempotency-Key are refused until the outcome is settled.",
                )
                .with_status(500),
            );
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

/// Why no scope could be derived from a keyed request.
enum ScopeProblem {
    /// The header that names the client is repeated or not text: 400.
    Invalid(String),
    /// The request names no client and the route refuses such requests.
    Unidentified(Option<String>),
    /// The route identifies unnamed clients by address and the host gave
    /// none.
    NoAddress,
}

/// Lowercase hex.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// The scope of a keyed request's key, as `idem serve` derives it:
/// `hdr:<value>` from the route's scope header, else `auth:<hex SHA-256>`
/// of `Authorization`, else as the route's `anonymous` says.
fn scope_of(
    request: &IncomingRequest,
    headers: &[(String, Vec<u8>)],
    route: &Route,
) -> Result<String, ScopeProblem> {
    if let Some(name) = &route.scope_header {
        match values(headers, name).as_slice() {
            [] => {}
            [value] => {
                return core::str::from_utf8(value)
                    .ok()
                    .filter(|t| !t.chars().any(char::is_control))
                    .map(|t| format!("hdr:{t}"))
                    .ok_or_else(|| {
                        ScopeProblem::Invalid(format!("the {name} header is not printable text"))
                    });
            }
            _ => {
                return Err(ScopeProblem::Invalid(format!(
                    "the {name} header occurs more than once"
                )));
            }
        }
    }
    let authorization = values(headers, "authorization");
    let anonymous = match route.anonymous {
        AnonymousMode::Shared => http::Anonymous::Shared,
        AnonymousMode::Reject | AnonymousMode::ClientAddress => http::Anonymous::Reject,
    };
    match http::scope(&authorization, anonymous) {
        Ok(scope) => Ok(scope),
        Err(e @ http::ScopeError::RepeatedAuthorization) => {
            Err(ScopeProblem::Invalid(e.to_string()))
        }
        Err(http::ScopeError::Unidentified) if route.anonymous == AnonymousMode::ClientAddress => {
            let address = http_bridge::client_address(request).ok_or(ScopeProblem::NoAddress)?;
            Ok(format!(
                "addr:{}",
                hex(&sha2::Sha256::digest(address.as_bytes()))
            ))
        }
        Err(http::ScopeError::Unidentified) => {
            Err(ScopeProblem::Unidentified(route.scope_header.clone()))
        }
    }
}

fn scope_problem(problem: ScopeProblem) -> Problem {
    match problem {
        ScopeProblem::Invalid(what) => Problem::new(
            ProblemType::InvalidRequest,
            format!("{what}. Send it once, as printable text."),
        )
        .with("field", "scope"),
        ScopeProblem::Unidentified(header) => {
            let how = match header {
                Some(name) => format!("an Authorization header or the {name} header"),
                None => "an Authorization header".to_owned(),
            };
            Problem::new(
                ProblemType::ClientUnidentified,
                format!(
                    "Requests with an Idempotency-Key must say who the client is, so that no client receives another's stored response. Send {how}, then retry with the same Idempotency-Key: nothing was stored."
                ),
            )
        }
        ScopeProblem::NoAddress => Problem::new(
            ProblemType::InternalError,
            "The host cannot tell this client apart from others and the request was not run. Send an Authorization header.",
        ),
    }
}

/// The middleware around `handler`: what the exported `incoming-handler`
/// does with the imported one, for any wrapped handler.
///
/// Safe methods, and unkeyed requests where the route makes a key
/// optional, go to the imported handler as they are, and nothing is
/// stored. A keyed request runs `handler`, with the ticket that owns its
/// key, only when the engine decides `execute`; every other decision is
/// answered from the store. Public for component crates that build on
/// this one and put code of their own around the imported handler (the
/// misbehaving test guest).
pub fn wrap(
    request: IncomingRequest,
    out: ResponseOutparam,
    handler: impl FnOnce(&Ticket, IncomingRequest, ResponseOutparam),
) {
    let method = method_name(&request.method());
    if http::is_safe_method(&method) {
        return inner::handle(request, out);
    }
    let Some(route) = http_bridge::request_route(&request) else {
        return send_problem(
            out,
            &Problem::new(
                ProblemType::InternalError,
                "The host gave no route for this request, and it was not run.",
            ),
        );
    };
    // The headers are a child of the request: read them, then let them
    // go before the request is handed on.
    let headers = request.headers().entries();
    let keys = values(&headers, http::IDEMPOTENCY_KEY);
    let key = match keys.as_slice() {
        [] if route.key == KeyRequirement::Required => {
            return send_problem(
                out,
                &Problem::new(
                    ProblemType::KeyMissing,
                    format!(
                        "{method} requests to this endpoint need an Idempotency-Key header. Send a new unique key (e.g. a UUID) with each new request, and the same key when you retry it."
                    ),
                ),
            );
        }
        [] => return inner::handle(request, out),
        [value] => match http::parse_idempotency_key(value) {
            Ok(key) => key,
            Err(e) => {
                return send_problem(
                    out,
                    &Problem::new(
                        ProblemType::KeyInvalid,
                        format!(
                            "{e}. Send the key as a Structured Field string such as \"8e03978e-40d5-43e8-bc93-6894a57f9324\", or as the bare value."
                        ),
                    ),
                );
            }
        },
        _ => {
            return send_problem(
                out,
                &Problem::new(
                    ProblemType::KeyInvalid,
                    "Several Idempotency-Key headers were sent. Send exactly one.",
                ),
            );
        }
    };
    let scope = match scope_of(&request, &headers, &route) {
        Ok(scope) => scope,
        Err(problem) => return send_problem(out, &scope_problem(problem)),
    };
    let body = match http_bridge::request_body(&request) {
        Ok(body) => body,
        Err(BodyError::TooLarge(limit)) => {
            return send_problem(
                out,
                &Problem::new(
                    ProblemType::BodyTooLarge,
                    format!(
                        "The request body is over the limit of {limit} bytes. Send a smaller body."
                    ),
                )
                .with("max_body_bytes", limit),
            );
        }
        Err(BodyError::Unreadable(_)) => {
            return send_problem(
                out,
                &Problem::new(
                    ProblemType::InvalidRequest,
                    "The request body could not be read completely. Send it again with the same Idempotency-Key.",
                ),
            );
        }
    };
    let content_type = values(&headers, "content-type");
    let kind = http::body_kind(match content_type.as_slice() {
        [one] => Some(one),
        _ => None,
    });
    let path = request.path_with_query().unwrap_or_else(|| "/".into());
    let begin = BeginRequest {
        key: RecordKey {
            scope,
            biz_type: route.biz_type.clone(),
            idem_key: key,
        },
        attributes: Vec::from([("method".into(), method), ("path".into(), path)]),
        body_kind: kind,
        body,
        policy: route.policy.clone(),
    };
    match machine::begin(&Imports, &begin) {
        Ok(Decision::Execute(ticket)) => execute(request, out, &ticket, &route, handler),
        Ok(decision) => answer(out, decision),
        Err(e) => send_problem(out, &engine_error_problem(&e)),
    }
}

impl HandlerGuest for Component {
    fn handle(request: IncomingRequest, out: ResponseOutparam) {
        wrap(request, out, |_, request, out| inner::handle(request, out));
    }
}
