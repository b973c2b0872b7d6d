//! The begin request as the guest receives it: arbitrary scopes, keys, biz
//! types, bodies and policies, run natively against the engine's state
//! machine over an in-memory store. The properties are
//! `idem_guest::props::check_begin`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    idem_guest::props::check_begin(&idem_guest::props::begin_request(data));
});
