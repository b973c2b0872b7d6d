//! Properties of the engine's pure-Rust core, shared by the cargo-fuzz
//! targets (`fuzz/`, built with `--cfg fuzzing`) and the proptest suites
//! that run them on stable in CI.
//!
//! Each `check_*` function takes input of any shape and panics when a
//! property breaks; an input the code refuses is fine, a panic inside the
//! code under test is a finding too.
//!
//! Not part of the engine: compiled only for tests and fuzzing.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::cell::{Cell, RefCell};

use crate::bindings::exports::idem::engine::engine::{
    BeginRequest, BodyKind, Completion, Decision, ExpiredLease, FailureMode, InProgressMode,
    KeyCharset, KeyFormat, Policy, WaitSpec,
};
use crate::bindings::idem::engine::store::{InsertOutcome, StaleCursor, StoreError, SwapOutcome};
use crate::bindings::idem::engine::types::{RecordKey, Status, StoredRecord, Success, Timestamp};
use crate::canonical::{Numbers, canonicalize, canonicalize_as, select};
use crate::fingerprint::{fingerprint, fingerprint_of_version};
use crate::machine::{self, Env};

// ---------------------------------------------------------------------------
// The JSON canonicalizer
// ---------------------------------------------------------------------------

/// The canonicalizer's properties on arbitrary bytes:
///
/// - it never panics, on any input, with or without field selection;
/// - a text it refuses is one `serde_json` refuses too, or one of the
///   documented stricter cases (it accepts nothing `serde_json` refuses);
/// - canonicalizing its output changes nothing;
/// - re-spelling the document (members in reverse order, whitespace between
///   every token, `seed` choosing which) keeps the canonical form and the
///   fingerprint;
/// - with exact numbers (fingerprint version 2): it never panics, accepts
///   every text RFC 8785's form accepts (but for exponents of more than 18
///   digits), is idempotent, and agrees with RFC 8785's form wherever no
///   number loses its value as a double.
pub fn check_canonical(bytes: &[u8], seed: u8) {
    let exact = canonicalize_as(bytes, Numbers::Exact);
    if let Ok(form) = &exact {
        assert_eq!(
            canonicalize_as(form, Numbers::Exact).as_ref(),
            Ok(form),
            "canonicalizing twice with exact numbers changed the text"
        );
    }
    let selected = select(bytes, &[String::from("/a"), String::from("/0")]);
    let Ok(canon) = canonicalize(bytes) else {
        assert!(
            selected.is_err(),
            "select accepted what canonicalize refused"
        );
        return;
    };
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .unwrap_or_else(|e| panic!("canonicalize accepted a text serde_json refuses: {e}"));
    match &exact {
        Ok(_) => {}
        Err(e) => assert!(
            e.to_string().contains("exponent has more than 18 digits"),
            "exact numbers refused what RFC 8785's form accepts: {e}"
        ),
    }
    assert_eq!(
        canonicalize(&canon).as_deref(),
        Ok(&canon[..]),
        "canonicalizing twice changed the text"
    );
    let mut respelled = Vec::new();
    respell(&value, seed, &mut respelled);
    assert_eq!(
        canonicalize(&respelled).as_deref(),
        Ok(&canon[..]),
        "a re-spelled document has another canonical form: {}",
        String::from_utf8_lossy(&respelled)
    );
    let v1 = |body: &[u8]| fingerprint_of_version(1, &[], BodyKind::Json, body, &[]);
    assert_eq!(
        v1(bytes),
        v1(&respelled),
        "re-spelling changed the version-1 fingerprint"
    );
    if exact.as_deref() == Ok(&canon[..]) {
        // No number lost its value: the re-spelling (through doubles) is
        // the same document for version 2 too.
        assert_eq!(
            canonicalize_as(&respelled, Numbers::Exact).as_deref(),
            Ok(&canon[..]),
            "a re-spelled document has another exact canonical form"
        );
        let digest = |body: &[u8]| fingerprint(&[], BodyKind::Json, body, &[]);
        assert_eq!(
            digest(bytes),
            digest(&respelled),
            "re-spelling changed the fingerprint"
        );
    }
}

/// Writes `value` as JSON with its object members in reverse order of
/// `serde_json`'s map (sorted by UTF-8 bytes, so reversed is a permutation
/// unlike the canonical one) and whitespace chosen by `seed`.
pub fn respell(value: &serde_json::Value, seed: u8, out: &mut Vec<u8>) {
    const SPACES: [&[u8]; 4] = [b"", b" ", b"\n\t", b"\r\n  "];
    let ws = |out: &mut Vec<u8>, n: usize| {
        out.extend_from_slice(SPACES[(usize::from(seed) + n) % SPACES.len()])
    };
    match value {
        serde_json::Value::Object(map) => {
            out.push(b'{');
            for (i, (k, v)) in map.iter().rev().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                ws(out, i);
                out.extend_from_slice(serde_json::to_string(k).unwrap_or_default().as_bytes());
                ws(out, i + 1);
                out.push(b':');
                ws(out, i + 2);
                respell(v, seed.wrapping_add(1), out);
            }
            ws(out, 3);
            out.push(b'}');
        }
        serde_json::Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                ws(out, i);
                respell(v, seed.wrapping_add(1), out);
            }
            out.push(b']');
        }
        other => out.extend_from_slice(serde_json::to_string(other).unwrap_or_default().as_bytes()),
    }
}

// ---------------------------------------------------------------------------
// The begin request
// ---------------------------------------------------------------------------

/// An in-memory `store`, `clock` and `results` that follows the WIT
/// contracts: enough to run the state machine natively.
#[derive(Default)]
pub struct MemoryEnv {
    /// The clock, in ms since the epoch; `pause` advances it.
    pub clock: Cell<u64>,
    /// The records, by `(scope, biz-type, idem-key)`.
    pub records: RefCell<BTreeMap<(String, String, String), StoredRecord>>,
    /// How many inserts and swaps were written.
    pub writes: Cell<u32>,
    next_id: Cell<u64>,
}

fn key3(key: &RecordKey) -> (String, String, String) {
    (
        key.scope.clone(),
        key.biz_type.clone(),
        key.idem_key.clone(),
    )
}

impl MemoryEnv {
    /// An empty store at time `now`.
    pub fn at(now: u64) -> Self {
        let env = Self::default();
        env.clock.set(now);
        env.next_id.set(1);
        env
    }
}

impl Env for MemoryEnv {
    fn now(&self) -> Timestamp {
        self.clock.get()
    }
    fn pause(&self, duration_ms: u64) {
        self.clock.set(self.clock.get().saturating_add(duration_ms));
    }
    fn insert_if_absent(&self, candidate: &StoredRecord) -> Result<InsertOutcome, StoreError> {
        let mut records = self.records.borrow_mut();
        if let Some(existing) = records.get(&key3(&candidate.key)) {
            return Ok(InsertOutcome::Existing(existing.clone()));
        }
        let mut rec = candidate.clone();
        rec.id = self.next_id.get();
        self.next_id.set(rec.id + 1);
        self.writes.set(self.writes.get() + 1);
        records.insert(key3(&rec.key), rec.clone());
        Ok(InsertOutcome::Inserted(rec))
    }
    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
        Ok(self.records.borrow().get(&key3(key)).cloned())
    }
    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError> {
        let mut records = self.records.borrow_mut();
        let Some(current) = records.get_mut(&key3(&replacement.key)) else {
            return Ok(SwapOutcome::Stale(None));
        };
        if current.revision != expected_revision {
            return Ok(SwapOutcome::Stale(Some(current.clone())));
        }
        let id = current.id;
        *current = replacement.clone();
        current.id = id;
        self.writes.set(self.writes.get() + 1);
        Ok(SwapOutcome::Swapped)
    }
    fn delete_expired(&self, _now: Timestamp, _limit: u32) -> Result<u32, StoreError> {
        Ok(0)
    }
    fn list_stale(
        &self,
        _biz_type: &str,
        _now: Timestamp,
        _after: Option<StaleCursor>,
        _limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        Ok(Vec::new())
    }
    fn find_result(&self, _key: &RecordKey) -> Result<Option<Success>, StoreError> {
        Ok(None)
    }
}

/// Reads a begin request out of arbitrary bytes. Each field is either one
/// of a few well-formed values (most of the time, so that most requests
/// get past validation) or taken raw from the bytes (so that every rule is
/// tried); the end of the bytes reads as zeros.
pub fn begin_request(bytes: &[u8]) -> BeginRequest {
    let mut r = Reader(bytes);
    let key = RecordKey {
        scope: r.text(&["tenant-1", "auth:0f", "hdr:a\"b%_'--", "anonymous"]),
        biz_type: r.text(&["order", "pay.v2", "coupon:claim", "a_b-c"]),
        idem_key: r.text(&[
            "k-1",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
            "%_\"'; DROP",
            "x",
        ]),
    };
    let attributes = (0..r.byte() % 3)
        .map(|_| (r.text(&["method", "path"]), r.text(&["POST", "/orders"])))
        .collect();
    let body_kind = if r.byte() % 4 == 0 {
        BodyKind::Raw
    } else {
        BodyKind::Json
    };
    let body = r.bytes(&[br#"{"amount":1,"currency":"EUR"}"#, b"[1,2.5e3,null]", b""]);
    let fingerprint_fields = (0..r.byte() % 3)
        .map(|_| r.text(&["/amount", "/0", "", "/a~1b"]))
        .collect();
    let charset = match r.byte() % 3 {
        0 => KeyCharset::PrintableAscii,
        1 => KeyCharset::Uuid,
        _ => KeyCharset::Token,
    };
    let policy = Policy {
        retention_ms: r.number(&[60_000, 1, 86_400_000]),
        lease_ms: r.number(&[30_000, 1, 100]),
        retry_after_ms: r.number(&[1_000, 1]),
        expired_lease: match r.byte() % 3 {
            0 => ExpiredLease::TakeOver,
            1 => ExpiredLease::Reconcile,
            _ => ExpiredLease::Manual,
        },
        outcome_unknown: match r.byte() % 3 {
            0 => ExpiredLease::TakeOver,
            1 => ExpiredLease::Reconcile,
            _ => ExpiredLease::Manual,
        },
        failure_mode: if r.byte() % 2 == 0 {
            FailureMode::HonorDisposition
        } else {
            FailureMode::AlwaysFinal
        },
        max_attempts: match r.byte() % 3 {
            0 => None,
            _ => Some(r.number(&[1, 2, 3, 5]) as u32),
        },
        in_progress: if r.byte() % 2 == 0 {
            InProgressMode::Reject
        } else {
            InProgressMode::Wait(WaitSpec {
                max_wait_ms: r.number(&[500, 60_000]),
                poll_interval_ms: r.number(&[50, 1]),
            })
        },
        fingerprint_fields,
        key_format: KeyFormat {
            min_length: r.number(&[1, 8]) as u32,
            max_length: r.number(&[255, 64, 36]) as u32,
            charset,
        },
        max_body_bytes: r.number(&[1 << 20, 16]) as u32,
    };
    BeginRequest {
        key,
        attributes,
        body_kind,
        body,
        policy,
    }
}

/// Selector bytes from this value on read a raw field instead of a
/// well-formed one: one field in eight is raw, so most requests pass
/// validation and reach the state machine, and every rule still gets tried.
const RAW_FROM: usize = 224;

/// A cursor over fuzz bytes.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn byte(&mut self) -> u8 {
        let (first, rest) = self.0.split_first().unwrap_or((&0, &[]));
        self.0 = rest;
        *first
    }

    /// A length-prefixed run of raw bytes.
    fn raw(&mut self) -> &[u8] {
        let len = usize::from(self.byte()).min(self.0.len());
        let (taken, rest) = self.0.split_at(len);
        self.0 = rest;
        taken
    }

    /// One of `choices`, or raw bytes for a selector from [`RAW_FROM`] on.
    fn bytes(&mut self, choices: &[&[u8]]) -> Vec<u8> {
        let selector = usize::from(self.byte());
        if selector < RAW_FROM {
            choices[selector % choices.len()].to_vec()
        } else {
            self.raw().to_vec()
        }
    }

    fn text(&mut self, choices: &[&str]) -> String {
        let choices: Vec<&[u8]> = choices.iter().map(|c| c.as_bytes()).collect();
        String::from_utf8_lossy(&self.bytes(&choices)).into_owned()
    }

    fn number(&mut self, choices: &[u64]) -> u64 {
        let selector = usize::from(self.byte());
        if selector < RAW_FROM {
            return choices[selector % choices.len()];
        }
        let mut n = 0u64;
        for _ in 0..(selector % 9) {
            n = (n << 8) | u64::from(self.byte());
        }
        n
    }
}

/// The instant every `check_begin` run starts at.
const START: u64 = 1_700_000_000_000;

/// The state machine's properties for one begin request, run on an empty
/// [`MemoryEnv`]:
///
/// - `begin` never panics and never fails (the store never does);
/// - an `invalid` answer writes nothing;
/// - any other first answer is `execute`, with a processing record for the
///   exact key given, owned by token 1;
/// - the same request again does not execute while that lease lives, and is
///   never a mismatch;
/// - once completed, the same request replays the stored result.
pub fn check_begin(req: &BeginRequest) {
    let env = MemoryEnv::at(START);
    let first = machine::begin(&env, req).unwrap_or_else(|e| panic!("begin failed: {e:?}"));
    let ticket = match first {
        Decision::Invalid(_) => {
            assert_eq!(env.writes.get(), 0, "an invalid request wrote");
            assert!(env.records.borrow().is_empty(), "an invalid request wrote");
            return;
        }
        Decision::Execute(ticket) => ticket,
        other => panic!("a fresh key was answered {other:?}"),
    };
    assert_eq!(ticket.key, req.key);
    assert_eq!((ticket.fencing_token, ticket.attempt), (1, 1));
    {
        let records = env.records.borrow();
        let rec = records
            .get(&key3(&req.key))
            .expect("execute without a record");
        assert_eq!(
            rec.key, req.key,
            "the stored key differs from the request's"
        );
        assert_eq!(rec.status, Status::Processing);
        assert_eq!(rec.fencing_token, 1);
    }

    let second = machine::begin(&env, req).unwrap_or_else(|e| panic!("begin failed: {e:?}"));
    let taken_over = match &second {
        Decision::Execute(t) => {
            assert!(
                env.now() >= ticket.lease_until,
                "executed twice within one lease"
            );
            assert!(t.fencing_token > ticket.fencing_token);
            true
        }
        Decision::InProgress(_) | Decision::OutcomeUnknown(_) => false,
        other => panic!("the same request was answered {other:?} while processing"),
    };

    let success = Success {
        result_ref: Some(String::from("result-1")),
        response: None,
    };
    let completion = machine::complete(&env, &ticket, &req.policy, &success)
        .unwrap_or_else(|e| panic!("complete failed: {e:?}"));
    if taken_over {
        assert_eq!(
            completion,
            Completion::LostOwnership,
            "a stale owner completed"
        );
        return;
    }
    assert_eq!(completion, Completion::Recorded(Status::Succeeded));
    match machine::begin(&env, req).unwrap_or_else(|e| panic!("begin failed: {e:?}")) {
        Decision::Replay(replayed) => assert_eq!(replayed.result_ref, success.result_ref),
        other => panic!("a completed request was answered {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    //! The fuzz targets' properties on stable, through proptest.

    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 2048,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        #[test]
        fn prop_canonical_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..96), seed in any::<u8>()) {
            check_canonical(&bytes, seed);
        }

        #[test]
        fn prop_canonical_on_numbers(
            numbers in prop::collection::vec(r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,4})?", 1..6),
            seed in any::<u8>(),
        ) {
            // Large, long and out-of-range numbers, where version 2 keeps
            // what version 1 rounds.
            let text = format!("[{}]", numbers.join(","));
            check_canonical(text.as_bytes(), seed);
        }

        #[test]
        fn prop_canonical_on_json_like_text(
            text in r#"[\[\]{}:, "a-c0-9.eE+\-]{0,40}|\{("[a-c]{0,2}": ?(-?[0-9]{1,3}(\.[0-9])?|"x"|null|\[\]|\{\}), ?){0,4}"z": ?true\}"#,
            seed in any::<u8>(),
        ) {
            check_canonical(text.as_bytes(), seed);
        }

        #[test]
        fn prop_begin_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..160)) {
            check_begin(&begin_request(&bytes));
        }
    }

    #[test]
    fn the_generator_reaches_the_state_machine() {
        // Zero bytes pick the first well-formed value of every field.
        let req = begin_request(&[]);
        let env = MemoryEnv::at(START);
        assert!(matches!(
            machine::begin(&env, &req),
            Ok(Decision::Execute(_))
        ));
        check_begin(&req);
    }

    #[test]
    fn respelling_permutes_members() {
        let value: serde_json::Value =
            serde_json::from_str(r#"{"a":1,"b":[true,{"c":null,"d":"e"}]}"#).unwrap();
        let mut out = Vec::new();
        respell(&value, 1, &mut out);
        let text = String::from_utf8(out).unwrap();
        assert!(text.find("\"b\"") < text.find("\"a\""), "{text}");
        assert_eq!(
            canonicalize(text.as_bytes()).unwrap(),
            br#"{"a":1,"b":[true,{"c":null,"d":"e"}]}"#
        );
    }
}
