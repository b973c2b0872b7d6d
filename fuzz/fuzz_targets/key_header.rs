//! The `Idempotency-Key` header parser, on any bytes: Structured Field
//! strings and bare tokens. The properties are `key::check_key_header`.
#![no_main]

// The parser's own file, compiled here without the rest of the host.
#[allow(dead_code)]
#[path = "../../host/src/proxy/key.rs"]
mod key;

libfuzzer_sys::fuzz_target!(|data: &[u8]| key::check_key_header(data));
