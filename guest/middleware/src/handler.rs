//! The exported `wasi:http/incoming-handler` wraps
//! the imported one so that a request with an `Idempotency-Key` runs the
//! wrapped handler at most once.
//!
//! Every decision is the engine's: the handler calls [`machine::begin`],
//! [`machine::complete`] and [`machine::fail`] through the same [`Imports`]
//! environment as the `engine` export. Every HTTP rule is `idem-http`'s,
//! the crate `idem serve` and the tower layer use: the key header, the
//! scope, which methods need a key, the body kind, what a status means,
//! the problem catalogue and the answer to each decision. This module only
//! moves values between `wasi:http` resources and those rules. What
//! differs per request (the biz type, the policy, whether a key is
//! required, how a client is identified, what a 5xx means) comes from the
//! host's configuration for the request's route, through
//! `http-bridge.request-route`.
//!
//! A wasm guest cannot run a heartbeat beside the wrapped handler, so a
//! handler must answer within the route policy's `lease-ms`; past it a
//! duplicate may take the key over (the first run's outcome is then
//! discarded by fencing).

use alloc::borrow::ToOwned;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use idem_http::{Answer, Problem};

use idem_guest::bindings::exports::idem::engine::engine::{
    BeginRequest, BodyKind, Completion, Decision, Disposition, EngineError, InputField, InputRule,
    Policy, Ticket,
};
use idem_guest::bindings::idem::engine::types::{Failure, RecordKey, StoredResponse, Success};
use idem_guest::component::Imports;
use idem_guest::machine;

use crate::Middleware;
use crate::bindings::exports::wasi::http::incoming_handler::Guest as HandlerGuest;
use crate::bindings::idem::engine::http_bridge::{
    self, AnonymousMode, BodyError, KeyRequirement, ResponseCapture, Route, ServerErrors,
};
use crate::bindings::wasi::http::incoming_handler as inner;
use crate::bindings::wasi::http::types::{
    Fields, IncomingRequest, Method, OutgoingBody, OutgoingResponse, ResponseOutparam,
};

/// The most bytes written to an output stream in one
/// `blocking-write-and-flush`, the limit `wasi:io` sets for that call.
const WRITE_CHUNK: usize = 4096;

/// The longest handler error message kept in a failure record: the
/// engine's limit for `failure-info.message`.
const MAX_FAILURE_MESSAGE_BYTES: usize = 4096;

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

/// Sends a response with `status`, `headers` and `body` through `out`.
/// Headers the host refuses (such as hop-by-hop ones) are left out.
fn send(out: ResponseOutparam, status: u16, headers: &[(&str, &[u8])], body: &[u8]) {
    let fields = Fields::new();
    for (name, value) in headers {
        let _ = fields.append(name, value);
    }
    let outgoing = OutgoingResponse::new(fields);
    if outgoing.set_status_code(status).is_err() {
        return send_problem(out, &Problem::not_replayable());
    }
    let Ok(outgoing_body) = outgoing.body() else {
        return;
    };
    ResponseOutparam::set(out, Ok(outgoing));
    if let Ok(stream) = outgoing_body.write() {
        for chunk in body.chunks(WRITE_CHUNK) {
            if stream.blocking_write_and_flush(chunk).is_err() {
                // The client went away; nothing more can be sent.
                return;
            }
        }
    }
    let _ = OutgoingBody::finish(outgoing_body, None);
}

/// Sends a stored response; when `replayed`, with the replay header
/// ([`idem_http::response_headers`]).
fn respond(out: ResponseOutparam, response: &StoredResponse, replayed: bool) {
    let headers = idem_http::response_headers(&response.headers, replayed);
    send(out, response.status, &headers, &response.body);
}

fn send_problem(out: ResponseOutparam, problem: &Problem) {
    let headers = problem.headers();
    let headers: Vec<(&str, &[u8])> = headers
        .iter()
        .map(|(name, value)| (*name, value.as_bytes()))
        .collect();
    send(out, problem.status, &headers, &problem.body());
}

/// The engine's decision in `idem-http`'s terms.
fn http_decision(decision: Decision) -> idem_http::Decision<Ticket, StoredResponse> {
    match decision {
        Decision::Execute(ticket) => idem_http::Decision::Execute(ticket),
        Decision::Replay(replayed) => idem_http::Decision::Replay(replayed.response),
        Decision::InProgress(busy) => idem_http::Decision::InProgress {
            retry_after_ms: busy.retry_after_ms,
        },
        Decision::Mismatch(_) => idem_http::Decision::Mismatch,
        Decision::Failed(failure) => idem_http::Decision::Failed(failure.response),
        Decision::OutcomeUnknown(_) => idem_http::Decision::OutcomeUnknown,
        Decision::Invalid(i) => idem_http::Decision::Invalid(idem_http::Invalid {
            field: field(i.field),
            rule: rule(i.rule),
            message: i.message,
        }),
    }
}

fn field(field: InputField) -> idem_http::Field {
    use idem_http::Field;
    match field {
        InputField::Scope => Field::Scope,
        InputField::BizType => Field::BizType,
        InputField::IdemKey => Field::IdemKey,
        InputField::Attributes => Field::Attributes,
        InputField::Body => Field::Body,
        InputField::Policy => Field::Policy,
        InputField::SuccessResult => Field::SuccessResult,
        InputField::FailureInfo => Field::FailureInfo,
        InputField::Ticket => Field::Ticket,
    }
}

fn rule(rule: InputRule) -> idem_http::Rule {
    use idem_http::Rule;
    match rule {
        InputRule::Required => Rule::Required,
        InputRule::TooShort => Rule::TooShort,
        InputRule::TooLong => Rule::TooLong,
        InputRule::BadCharacter => Rule::BadCharacter,
        InputRule::BadFormat => Rule::BadFormat,
        InputRule::NotJson => Rule::NotJson,
        InputRule::OutOfRange => Rule::OutOfRange,
    }
}

/// The problem for an engine error: 503 when the store failed, 500
/// otherwise.
fn engine_error_problem(e: &EngineError) -> Problem {
    idem_http::engine_error_problem(match e {
        EngineError::Store(_) => idem_http::EngineFailure::Store,
        _ => idem_http::EngineFailure::Other,
    })
}

/// What the wrapped handler's response means for the key.
enum Outcome {
    Complete(Success),
    Fail(Failure, Disposition),
}

impl Outcome {
    /// The outcome of `response` under the route's `server_errors`
    /// ([`idem_http::classify_status`]).
    fn of(response: &StoredResponse, server_errors: ServerErrors) -> Outcome {
        let server_errors = match server_errors {
            ServerErrors::Retry => idem_http::ServerErrors::Retry,
            ServerErrors::Store => idem_http::ServerErrors::Store,
        };
        let verdict = idem_http::classify_status(response.status, server_errors);
        let stored = (verdict.stores_response()
            && idem_http::storable(response.headers.len(), response.body.len()))
        .then(|| response.clone());
        let disposition = match verdict {
            idem_http::Verdict::Complete => {
                return Outcome::Complete(Success {
                    result_ref: None,
                    response: stored,
                });
            }
            idem_http::Verdict::Final => Disposition::Final,
            idem_http::Verdict::Retryable => Disposition::Retryable,
        };
        Outcome::Fail(
            Failure {
                code: format!("http-{}", response.status),
                message: format!("the handler answered {}", response.status),
                response: stored,
            },
            disposition,
        )
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
        return send_problem(out, &Problem::no_response_slot());
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
                message: truncate(&message, MAX_FAILURE_MESSAGE_BYTES).to_owned(),
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
fn truncate(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The client's address as the host gave it, for
/// [`idem_http::AnonymousMode::ClientAddress`]: hashed as given, the
/// host having put it in its canonical form (`http-bridge.client-address`).
struct HostAddress(String);

impl idem_http::PeerAddress for HostAddress {
    fn canonical_text(&self) -> String {
        self.0.clone()
    }
}

/// The scope of a keyed request's key ([`idem_http::derive_scope`]).
fn scope_of(
    request: &IncomingRequest,
    headers: &[(String, Vec<u8>)],
    route: &Route,
) -> Result<String, idem_http::ScopeError> {
    let scope_values = route
        .scope_header
        .as_deref()
        .map(|name| values(headers, name))
        .unwrap_or_default();
    let scope_header = route
        .scope_header
        .as_deref()
        .map(|name| idem_http::ScopeHeader {
            name,
            values: &scope_values,
        });
    let anonymous = match route.anonymous {
        AnonymousMode::Reject => idem_http::AnonymousMode::Reject,
        AnonymousMode::Shared => idem_http::AnonymousMode::Shared,
        AnonymousMode::ClientAddress => idem_http::AnonymousMode::ClientAddress,
    };
    // Ask the host for the address only when the scope needs it.
    let client = (anonymous == idem_http::AnonymousMode::ClientAddress)
        .then(|| http_bridge::client_address(request).map(HostAddress))
        .flatten();
    idem_http::derive_scope(
        scope_header,
        &values(headers, "authorization"),
        anonymous,
        client,
    )
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
    if idem_http::is_safe_method(&method) {
        return inner::handle(request, out);
    }
    let Some(route) = http_bridge::request_route(&request) else {
        return send_problem(out, &Problem::no_route());
    };
    // The headers are a child of the request: read them, then let them
    // go before the request is handed on.
    let headers = request.headers().entries();
    let key = match values(&headers, idem_http::IDEMPOTENCY_KEY).as_slice() {
        [] if route.key == KeyRequirement::Required => {
            return send_problem(out, &Problem::key_missing(&method));
        }
        [] => return inner::handle(request, out),
        [value] => match idem_http::parse_idempotency_key(value) {
            Ok(key) => key,
            Err(e) => return send_problem(out, &Problem::key_invalid(&e)),
        },
        _ => return send_problem(out, &Problem::several_keys()),
    };
    let scope = match scope_of(&request, &headers, &route) {
        Ok(scope) => scope,
        Err(e) => {
            return send_problem(out, &Problem::scope(&e, route.scope_header.as_deref()));
        }
    };
    let body = match http_bridge::request_body(&request) {
        Ok(body) => body,
        Err(BodyError::TooLarge(limit)) => {
            return send_problem(out, &Problem::body_too_large(limit));
        }
        Err(BodyError::Unreadable(_)) => return send_problem(out, &Problem::body_unreadable()),
    };
    let body_kind = match idem_http::body_kind(values(&headers, "content-type").first().copied()) {
        idem_http::BodyKind::Json => BodyKind::Json,
        idem_http::BodyKind::Raw => BodyKind::Raw,
    };
    let path = request.path_with_query().unwrap_or_else(|| "/".into());
    let begin = BeginRequest {
        key: RecordKey {
            scope,
            biz_type: route.biz_type.clone(),
            idem_key: key,
        },
        attributes: Vec::from([("method".into(), method), ("path".into(), path)]),
        body_kind,
        body,
        policy: route.policy.clone(),
    };
    let decision = match machine::begin(&Imports, &begin) {
        Ok(decision) => decision,
        Err(e) => return send_problem(out, &engine_error_problem(&e)),
    };
    match idem_http::answer(http_decision(decision)) {
        Answer::Execute(ticket) => execute(request, out, &ticket, &route, handler),
        Answer::Replay(stored) => respond(out, &stored, true),
        Answer::Problem(problem) => send_problem(out, &problem),
    }
}

impl HandlerGuest for Middleware {
    fn handle(request: IncomingRequest, out: ResponseOutparam) {
        wrap(request, out, |_, request, out| inner::handle(request, out));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_keeps_whole_characters() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abc", 2), "ab");
        // "é" is two bytes: cutting inside it drops it whole.
        assert_eq!(truncate("aé", 2), "a");
        assert_eq!(truncate("", 0), "");
    }
}
