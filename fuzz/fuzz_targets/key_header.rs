//! The `Idempotency-Key` header parser, on any bytes: Structured Field
//! strings and bare values. The properties are
//! `idem_http::props::check_key_header`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idem_http::props::check_key_header(data));
