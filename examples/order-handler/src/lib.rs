//! An example `wasi:http` handler for the idem middleware: every `POST
//! /orders` creates a new order with a random id and answers `201` with
//! the order as JSON. Each execution prints one line to stdout
//! (`order-handler: executed POST /orders -> 201`), its visible side
//! effect.
//!
//! It knows nothing about idempotency. Composed with the middleware
//! (`wac plug`), its duplicates are answered from the store and print
//! nothing.
//!
//! Other answers, to exercise the middleware's rules: `POST /reject`
//! answers `422` (a final failure, replayed), `POST /overloaded` answers
//! `503` (retryable: the next duplicate runs again), any other path `404`.

#![warn(missing_docs)]

#[allow(missing_docs)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "wasi:http/proxy@0.2.12",
        generate_all,
    });
}

use bindings::exports::wasi::http::incoming_handler::Guest;
use bindings::wasi::http::types::{
    Fields, IncomingRequest, Method, OutgoingBody, OutgoingResponse, ResponseOutparam,
};

/// The most body bytes read from one request: orders are small.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// The most bytes `blocking-write-and-flush` takes in one call (`wasi:io`).
const WRITE_CHUNK: usize = 4096;

/// What the handler answers to `method` on `path` with `body`: the status,
/// the content type and the body. Plain Rust, so it is tested natively.
pub fn route(method: &str, path: &str, body: &[u8], order_id: u64) -> (u16, String) {
    match (method, path) {
        ("POST", "/orders") => {
            let order = String::from_utf8_lossy(body);
            (
                201,
                format!(
                    "{{\"order_id\":\"ord-{order_id:016x}\",\"request\":{}}}",
                    json_string(&order)
                ),
            )
        }
        ("POST", "/reject") => (422, "{\"error\":\"rejected\"}".into()),
        ("POST", "/overloaded") => (503, "{\"error\":\"overloaded\"}".into()),
        _ => (404, "{\"error\":\"not found\"}".into()),
    }
}

/// `text` as a JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn read_body(request: &IncomingRequest) -> Vec<u8> {
    let mut body = Vec::new();
    let Ok(incoming) = request.consume() else {
        return body;
    };
    if let Ok(stream) = incoming.stream() {
        while body.len() < MAX_BODY_BYTES {
            match stream.blocking_read(WRITE_CHUNK as u64) {
                Ok(chunk) => body.extend_from_slice(&chunk),
                Err(_) => break,
            }
        }
    }
    body
}

struct Handler;

impl Guest for Handler {
    fn handle(request: IncomingRequest, out: ResponseOutparam) {
        let method = match request.method() {
            Method::Post => "POST".to_string(),
            Method::Get => "GET".to_string(),
            other => format!("{other:?}"),
        };
        let path = request.path_with_query().unwrap_or_default();
        let body = read_body(&request);
        let order_id = bindings::wasi::random::random::get_random_u64();
        let (status, text) = route(&method, &path, &body, order_id);
        // The visible side effect: one line per execution.
        println!("order-handler: executed {method} {path} -> {status}");
        let headers = Fields::new();
        let _ = headers.append("content-type", b"application/json");
        let response = OutgoingResponse::new(headers);
        let _ = response.set_status_code(status);
        let Ok(outgoing) = response.body() else {
            return;
        };
        ResponseOutparam::set(out, Ok(response));
        if let Ok(stream) = outgoing.write() {
            for chunk in text.as_bytes().chunks(WRITE_CHUNK) {
                if stream.blocking_write_and_flush(chunk).is_err() {
                    return;
                }
            }
        }
        let _ = OutgoingBody::finish(outgoing, None);
    }
}

#[cfg(target_arch = "wasm32")]
bindings::export!(Handler with_types_in bindings);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_are_created_with_their_id() {
        let (status, body) = route("POST", "/orders", br#"{"sku":"A1"}"#, 0xabc);
        assert_eq!(status, 201);
        assert_eq!(
            body,
            r#"{"order_id":"ord-0000000000000abc","request":"{\"sku\":\"A1\"}"}"#
        );
    }

    #[test]
    fn other_routes() {
        assert_eq!(route("POST", "/reject", b"", 1).0, 422);
        assert_eq!(route("POST", "/overloaded", b"", 1).0, 503);
        assert_eq!(route("GET", "/orders", b"", 1).0, 404);
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_string("a\"b\\c\n"), r#""a\"b\\c\u000a""#);
    }
}
