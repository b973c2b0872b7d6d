//! The JSON canonicalizer: never panics, refuses what `serde_json` refuses,
//! is idempotent, and keeps its output (and the fingerprint) when members
//! are permuted and whitespace added. The properties are
//! `idem_guest::props::check_canonical`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // The first byte picks the re-spelling; the rest is the document.
    let (seed, json) = data.split_first().map_or((0, data), |(s, j)| (*s, j));
    idem_guest::props::check_canonical(json, seed);
});
