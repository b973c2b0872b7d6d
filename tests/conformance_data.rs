//! The conformance scenarios written as data (`tests/conformance/`), run
//! through the real `.wasm` component against every Rust backend: the
//! in-memory mock and SQLite, each with store faults injected. The Node and
//! Python hosts run the same files against the same component; the file
//! format is described in `tests/conformance/README.md`.
//!
//! A backend is a [`Harness`]: anything that can make a fresh, empty store
//! with fault injection. Each test prints the component's SHA-256, one line
//! per failure, and `N passed, M failed`.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

#[path = "support/options.rs"]
mod options;

use anyhow::{Context, Result, anyhow, bail};
use idem::store::memory::Op;
use idem::{
    BeginRequest, BodyKind, Completion, Decision, Disposition, Engine, Error, ExpiredLease,
    Extension, Failure, FailureMode, FaultKind, InProgressMode, InputField, InputRule, KeyCharset,
    KeyFormat, KeyStatus, ManualClock, MemoryStore, Policy, ReconcileReport, RecordKey,
    SqliteStore, Status, Storage, StoreError, StoredRecord, StoredResponse, Success, SwapOutcome,
    Ticket, WaitSpec,
};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

#[path = "support/faulty.rs"]
mod faulty;
use faulty::Faulty;

/// Where every scenario's virtual clock starts: 2026-01-01T00:00:00Z. Every
/// time in the scenario files is relative to it.
const T0: u64 = 1_767_225_600_000;

/// The scope every scenario key has unless it names another.
const DEFAULT_SCOPE: &str = "tenant-1";

/// The biz type every scenario key has unless it names another.
const DEFAULT_BIZ_TYPE: &str = "order.create";

// ---------------------------------------------------------------- harness

/// A backend the scenarios run against: makes fresh, empty stores.
///
/// The PostgreSQL backend (or any other) plugs in here.
pub trait Harness {
    /// The backend's name, for the report.
    fn name(&self) -> &'static str;
    /// A fresh, empty store.
    fn fresh(&self) -> Result<Arc<dyn Fixture>>;
}

/// One fresh store of a [`Harness`], with fault injection.
pub trait Fixture: Send + Sync {
    /// An engine on this store (with faults applied) with `clock` and `results`.
    fn engine(&self, clock: HookClock, results: Results) -> Result<Engine>;
    /// Makes the next `count` calls of `op` (of any operation for `None`)
    /// fail with `kind`, as `MemoryStore::fail_next` does.
    fn inject(&self, op: Option<Op>, kind: FaultKind, count: u32);
    /// The store itself, without faults: for tampering.
    fn raw(&self) -> &dyn Storage;
    /// How many records the store holds, without using up a fault.
    fn count(&self) -> Result<u64> {
        Ok(self
            .raw()
            .count_by_status()?
            .into_iter()
            .map(|(_, n)| n)
            .sum())
    }
}

/// The in-memory mock, with its own fault injection.
struct MemoryHarness;

struct MemoryFixture(MemoryStore);

impl Harness for MemoryHarness {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn fresh(&self) -> Result<Arc<dyn Fixture>> {
        Ok(Arc::new(MemoryFixture(MemoryStore::new())))
    }
}

impl Fixture for MemoryFixture {
    fn engine(&self, clock: HookClock, results: Results) -> Result<Engine> {
        Ok(Engine::builder()
            .storage(self.0.clone())
            .clock(clock)
            .results(move |key: &RecordKey| results.lookup(key))
            .build()?)
    }
    fn inject(&self, op: Option<Op>, kind: FaultKind, count: u32) {
        self.0.fail_next(op, count, kind);
    }
    fn raw(&self) -> &dyn Storage {
        &self.0
    }
    fn count(&self) -> Result<u64> {
        Ok(u64::try_from(self.0.len())?)
    }
}

/// SQLite in a temporary directory, behind [`Faulty`].
struct SqliteHarness;

struct SqliteFixture {
    store: Faulty<SqliteStore>,
    _dir: tempfile::TempDir,
}

impl Harness for SqliteHarness {
    fn name(&self) -> &'static str {
        "sqlite"
    }
    fn fresh(&self) -> Result<Arc<dyn Fixture>> {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(dir.path().join("idem.db"), options::sqlite_options())?;
        Ok(Arc::new(SqliteFixture {
            store: Faulty::new(store),
            _dir: dir,
        }))
    }
}

impl Fixture for SqliteFixture {
    fn engine(&self, clock: HookClock, results: Results) -> Result<Engine> {
        Ok(Engine::builder()
            .storage(self.store.clone())
            .clock(clock)
            .results(move |key: &RecordKey| results.lookup(key))
            .build()?)
    }
    fn inject(&self, op: Option<Op>, kind: FaultKind, count: u32) {
        self.store.inject(op, kind, count);
    }
    fn raw(&self) -> &dyn Storage {
        self.store.inner()
    }
}

/// A hook that runs once, at the first `pause`.
type PauseHook = Box<dyn FnOnce() + Send>;

/// A manual clock whose `pause` advances the time and then runs the hook
/// set for it, once: another request settling the key while this one waits.
#[derive(Clone)]
pub struct HookClock {
    inner: ManualClock,
    hook: Arc<Mutex<Option<PauseHook>>>,
}

impl HookClock {
    fn new(inner: ManualClock) -> Self {
        Self {
            inner,
            hook: Arc::default(),
        }
    }
}

impl idem::Clock for HookClock {
    fn now(&self) -> u64 {
        self.inner.read()
    }
    fn pause(&self, duration_ms: u64) {
        self.inner.advance(duration_ms);
        let hook = self
            .hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(hook) = hook {
            hook();
        }
    }
}

/// The business results the lookup knows, and a switch to make it fail.
#[derive(Clone, Default)]
pub struct Results {
    found: Arc<Mutex<HashMap<RecordKey, String>>>,
    failing: Arc<AtomicBool>,
}

impl Results {
    fn lookup(&self, key: &RecordKey) -> Result<Option<String>, StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable(
                "the business database is down".into(),
            ));
        }
        Ok(self
            .found
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .cloned())
    }
}

// ---------------------------------------------------------------- reading values

fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get(name).filter(|x| !x.is_null())
}

fn u64_of(v: &Value) -> Result<u64> {
    v.as_u64()
        .ok_or_else(|| anyhow!("expected an unsigned integer, got {v}"))
}

fn u32_of(v: &Value) -> Result<u32> {
    Ok(u32::try_from(u64_of(v)?)?)
}

fn repeat(v: &Map<String, Value>) -> Result<(&Value, usize)> {
    let item = v.get("repeat").context("repeat")?;
    let count = usize::try_from(u64_of(v.get("count").context("count")?)?)?;
    Ok((item, count))
}

/// A string: a JSON string or `{"repeat": S, "count": N}`.
fn str_of(v: &Value) -> Result<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Object(o) if o.contains_key("repeat") => {
            let (item, count) = repeat(o)?;
            Ok(str_of(item)?.repeat(count))
        }
        other => bail!("expected a string, got {other}"),
    }
}

/// Bytes: a string (UTF-8), `{"hex": ...}` or `{"repeat": S, "count": N}`.
fn bytes_of(v: &Value) -> Result<Vec<u8>> {
    match v {
        Value::Object(o) if o.contains_key("hex") => {
            let hex = o.get("hex").and_then(Value::as_str).context("hex")?;
            (0..hex.len())
                .step_by(2)
                .map(|i| {
                    hex.get(i..i + 2)
                        .and_then(|d| u8::from_str_radix(d, 16).ok())
                        .ok_or_else(|| anyhow!("bad hex {hex}"))
                })
                .collect()
        }
        other => Ok(str_of(other)?.into_bytes()),
    }
}

/// A list: a JSON array, or `{"repeat": ITEM, "count": N}` (N copies).
fn list_of(v: &Value) -> Result<Vec<Value>> {
    match v {
        Value::Array(a) => Ok(a.clone()),
        Value::Object(o) if o.contains_key("repeat") => {
            let (item, count) = repeat(o)?;
            Ok(vec![item.clone(); count])
        }
        other => bail!("expected a list, got {other}"),
    }
}

fn key_of(v: &Value) -> Result<RecordKey> {
    match v {
        Value::Object(o) if !o.contains_key("repeat") => {
            let part = |name: &str, default: &str| -> Result<String> {
                o.get(name).map_or(Ok(default.to_string()), str_of)
            };
            Ok(RecordKey::new(
                part("scope", DEFAULT_SCOPE)?,
                part("biz-type", DEFAULT_BIZ_TYPE)?,
                part("idem-key", "")?,
            ))
        }
        other => Ok(RecordKey::new(
            DEFAULT_SCOPE,
            DEFAULT_BIZ_TYPE,
            str_of(other)?,
        )),
    }
}

fn response_of(v: &Value) -> Result<Option<StoredResponse>> {
    if v.is_null() {
        return Ok(None);
    }
    let headers = list_of(v.get("headers").unwrap_or(&json!([])))?
        .iter()
        .map(|h| Ok((str_of(&h[0])?, bytes_of(&h[1])?)))
        .collect::<Result<_>>()?;
    Ok(Some(StoredResponse {
        status: u16::try_from(u64_of(v.get("status").context("status")?)?)?,
        headers,
        body: bytes_of(v.get("body").unwrap_or(&json!("")))?,
    }))
}

fn success_of(v: &Value) -> Result<Success> {
    Ok(Success {
        result_ref: field(v, "result-ref").map(str_of).transpose()?,
        response: response_of(v.get("response").unwrap_or(&Value::Null))?,
    })
}

fn failure_of(v: &Value) -> Result<Failure> {
    Ok(Failure {
        code: str_of(v.get("code").context("failure code")?)?,
        message: v.get("message").map_or(Ok(String::new()), str_of)?,
        response: response_of(v.get("response").unwrap_or(&Value::Null))?,
    })
}

fn default_policy() -> Value {
    json!({
        "retention-ms": 3_600_000, "lease-ms": 30_000, "retry-after-ms": 1_000,
        "expired-lease": "take-over", "outcome-unknown": "manual",
        "failure-mode": "honor-disposition", "max-attempts": null, "in-progress": "reject",
        "fingerprint-fields": [],
        "key-format": { "min-length": 1, "max-length": 255, "charset": "printable-ascii" },
        "max-body-bytes": 1_048_576
    })
}

/// Merges `over` onto `base`; `key-format` field by field.
fn merge_policy(base: &mut Value, over: Option<&Value>) {
    let Some(Value::Object(over)) = over else {
        return;
    };
    for (k, v) in over {
        if k == "key-format"
            && let (Some(Value::Object(b)), Value::Object(o)) = (base.get_mut(k), v)
        {
            for (kk, vv) in o {
                b.insert(kk.clone(), vv.clone());
            }
            continue;
        }
        base[k.as_str()] = v.clone();
    }
}

fn policy_of(v: &Value) -> Result<Policy> {
    let name = |k: &str| v[k].as_str().map(str::to_owned).context(k.to_owned());
    let mode = |k: &str| -> Result<ExpiredLease> {
        Ok(match name(k)?.as_str() {
            "take-over" => ExpiredLease::TakeOver,
            "reconcile" => ExpiredLease::Reconcile,
            "manual" => ExpiredLease::Manual,
            other => bail!("{k} {other}"),
        })
    };
    let kf = &v["key-format"];
    Ok(Policy {
        retention_ms: u64_of(&v["retention-ms"])?,
        lease_ms: u64_of(&v["lease-ms"])?,
        retry_after_ms: u64_of(&v["retry-after-ms"])?,
        expired_lease: mode("expired-lease")?,
        outcome_unknown: mode("outcome-unknown")?,
        failure_mode: match name("failure-mode")?.as_str() {
            "honor-disposition" => FailureMode::HonorDisposition,
            "always-final" => FailureMode::AlwaysFinal,
            other => bail!("failure-mode {other}"),
        },
        max_attempts: match &v["max-attempts"] {
            Value::Null => None,
            n => Some(u32_of(n)?),
        },
        in_progress: match &v["in-progress"] {
            Value::String(s) if s == "reject" => InProgressMode::Reject,
            w => InProgressMode::Wait(WaitSpec {
                max_wait_ms: u64_of(&w["wait"]["max-wait-ms"])?,
                poll_interval_ms: u64_of(&w["wait"]["poll-interval-ms"])?,
            }),
        },
        fingerprint_fields: list_of(&v["fingerprint-fields"])?
            .iter()
            .map(str_of)
            .collect::<Result<_>>()?,
        key_format: KeyFormat {
            min_length: u32_of(&kf["min-length"])?,
            max_length: u32_of(&kf["max-length"])?,
            charset: match kf["charset"].as_str() {
                Some("printable-ascii") => KeyCharset::PrintableAscii,
                Some("uuid") => KeyCharset::Uuid,
                Some("token") => KeyCharset::Token,
                other => bail!("charset {other:?}"),
            },
        },
        max_body_bytes: u32_of(&v["max-body-bytes"])?,
    })
}

fn op_of(name: &str) -> Result<Option<Op>> {
    Ok(Some(match name {
        "insert-if-absent" => Op::InsertIfAbsent,
        "get" => Op::Get,
        "compare-and-swap" => Op::CompareAndSwap,
        "delete-expired" => Op::DeleteExpired,
        "list-stale" => Op::ListStale,
        "any" => return Ok(None),
        other => bail!("unknown store op {other}"),
    }))
}

// ---------------------------------------------------------------- results as JSON

fn bytes_json(b: &[u8]) -> Value {
    match std::str::from_utf8(b) {
        Ok(s) => json!(s),
        Err(_) => json!({ "hex": b.iter().map(|x| format!("{x:02x}")).collect::<String>() }),
    }
}

fn time_json(t: u64) -> Value {
    json!(i128::from(t) - i128::from(T0))
}

fn opt_time(t: Option<u64>) -> Value {
    t.map_or(Value::Null, time_json)
}

fn response_json(r: Option<&StoredResponse>) -> Value {
    r.map_or(Value::Null, |r| {
        json!({
            "status": r.status,
            "headers": r.headers.iter().map(|(n, v)| json!([n, bytes_json(v)])).collect::<Vec<_>>(),
            "body": bytes_json(&r.body),
        })
    })
}

fn failure_json(f: &Failure) -> Value {
    json!({ "code": f.code, "message": f.message, "response": response_json(f.response.as_ref()) })
}

fn key_json(k: &RecordKey) -> Value {
    json!({ "scope": k.scope, "biz-type": k.biz_type, "idem-key": k.idem_key })
}

fn kebab<T: serde::Serialize>(v: &T) -> Value {
    // The API's enums serialize to their kebab-case WIT names.
    serde_json::to_value(v).unwrap_or(Value::Null)
}

fn invalid_json(tag: (&str, &str), field: InputField, rule: InputRule, message: &str) -> Value {
    json!({ tag.0: tag.1, "field": kebab(&field), "rule": kebab(&rule), "message": message })
}

fn decision_json(d: &Decision) -> Value {
    let mut v = match d {
        Decision::Execute(t) => json!({
            "key": key_json(&t.key), "record-id": t.record_id, "fencing-token": t.fencing_token,
            "lease-until": time_json(t.lease_until), "attempt": t.attempt,
        }),
        Decision::Replay(r) => json!({
            "result-ref": r.result_ref, "response": response_json(r.response.as_ref()),
            "completed-at": time_json(r.completed_at),
        }),
        Decision::InProgress(b) => json!({
            "retry-after-ms": b.retry_after_ms, "lease-until": time_json(b.lease_until),
        }),
        Decision::Mismatch(m) => json!({
            "stored-prefix": m.stored_prefix, "stored-version": m.stored_version,
        }),
        Decision::Failed(f) => failure_json(f),
        Decision::OutcomeUnknown(u) => json!({
            "since": time_json(u.since), "attempts": u.attempts,
            "failure": u.failure.as_ref().map_or(Value::Null, failure_json),
        }),
        Decision::Invalid(i) => {
            return invalid_json(("decision", "invalid"), i.field, i.rule, &i.message);
        }
    };
    v["decision"] = json!(d.name());
    v
}

fn error_json(e: &Error) -> Value {
    match e {
        Error::Store(s) => {
            let (kind, message) = match s {
                StoreError::Unavailable(m) => ("unavailable", m),
                StoreError::Rejected(m) => ("rejected", m),
                StoreError::Internal(m) => ("internal", m),
            };
            json!({ "error": "store", "kind": kind, "message": message })
        }
        Error::Corrupt(m) => json!({ "error": "corrupt", "message": m }),
        Error::Invalid(i) => invalid_json(("error", "invalid"), i.field, i.rule, &i.message),
        other => json!({ "error": "host", "message": other.to_string() }),
    }
}

fn status_json(s: &KeyStatus) -> Value {
    json!({
        "status": s.status.as_str(), "created-at": time_json(s.created_at),
        "updated-at": time_json(s.updated_at), "expires-at": opt_time(s.expires_at),
        "lease-until": opt_time(s.lease_until), "result-ref": s.result_ref,
        "attempts": s.attempts, "fencing-token": s.fencing_token, "fingerprint": s.fingerprint,
        "fingerprint-version": s.fingerprint_version, "expired": s.expired,
    })
}

fn report_json(r: &ReconcileReport) -> Value {
    json!({
        "examined": r.examined, "succeeded": r.succeeded, "released": r.released,
        "left-for-manual": r.left_for_manual, "skipped": r.skipped, "lookup-errors": r.lookup_errors,
    })
}

fn completion_json(c: Completion) -> Value {
    match c {
        Completion::Recorded(status) => {
            json!({ "completion": "recorded", "status": kebab(&status) })
        }
        Completion::LostOwnership => json!({ "completion": "lost-ownership" }),
    }
}

fn extension_json(e: Extension) -> Value {
    match e {
        Extension::Extended(t) => json!({ "extension": "extended", "lease-until": time_json(t) }),
        Extension::LostOwnership => json!({ "extension": "lost-ownership" }),
    }
}

fn or_error<T>(r: Result<T, Error>, f: impl FnOnce(T) -> Value) -> Value {
    match r {
        Ok(v) => f(v),
        Err(e) => error_json(&e),
    }
}

// ---------------------------------------------------------------- matching

/// Checks `actual` against `expected` as the README's "Matching" says.
fn check(
    expected: &Value,
    actual: &Value,
    saved: &HashMap<String, Value>,
    path: &str,
) -> Result<(), String> {
    if let Value::Object(e) = expected {
        if let Some(needle) = e.get("$contains") {
            let (Some(n), Some(a)) = (needle.as_str(), actual.as_str()) else {
                return Err(format!(
                    "{path}: expected a string containing {needle}, got {actual}"
                ));
            };
            return if a.contains(n) {
                Ok(())
            } else {
                Err(format!(
                    "{path}: expected a string containing {n:?}, got {a:?}"
                ))
            };
        }
        if let Some(reference) = e.get("$ref").and_then(Value::as_str) {
            let mut parts = reference.split('.');
            let name = parts.next().unwrap_or_default();
            let mut target = saved
                .get(name)
                .ok_or_else(|| format!("{path}: nothing saved as {name}"))?;
            for p in parts {
                target = target
                    .get(p)
                    .ok_or_else(|| format!("{path}: {reference} does not exist"))?;
            }
            return if target == actual {
                Ok(())
            } else {
                Err(format!(
                    "{path}: expected {reference} = {target}, got {actual}"
                ))
            };
        }
        let Value::Object(a) = actual else {
            return Err(format!("{path}: expected {expected}, got {actual}"));
        };
        for (k, ev) in e {
            let av = a
                .get(k)
                .ok_or_else(|| format!("{path}.{k}: missing in {actual}"))?;
            check(ev, av, saved, &format!("{path}.{k}"))?;
        }
        return Ok(());
    }
    if let (Value::Array(e), Value::Array(a)) = (expected, actual) {
        if e.len() != a.len() {
            return Err(format!("{path}: expected {expected}, got {actual}"));
        }
        for (i, (ev, av)) in e.iter().zip(a).enumerate() {
            check(ev, av, saved, &format!("{path}[{i}]"))?;
        }
        return Ok(());
    }
    if expected == actual {
        Ok(())
    } else {
        Err(format!("{path}: expected {expected}, got {actual}"))
    }
}

// ---------------------------------------------------------------- running

/// Everything one scenario's steps work on. Cheap to clone: a clone on a
/// second engine runs the steps of `during-first-pause`.
#[derive(Clone)]
struct Ctx {
    fixture: Arc<dyn Fixture>,
    engine: Engine,
    clock: ManualClock,
    hook: Arc<Mutex<Option<PauseHook>>>,
    results: Results,
    policy: Value,
    saved: HashMap<String, Value>,
    tickets: HashMap<String, Ticket>,
}

impl Ctx {
    fn new(fixture: Arc<dyn Fixture>, policy: Option<&Value>) -> Result<Ctx> {
        let clock = ManualClock::new(T0);
        let hooked = HookClock::new(clock.clone());
        let results = Results::default();
        let engine = fixture.engine(hooked.clone(), results.clone())?;
        let mut p = default_policy();
        merge_policy(&mut p, policy);
        Ok(Ctx {
            fixture,
            engine,
            clock,
            hook: hooked.hook,
            results,
            policy: p,
            saved: HashMap::new(),
            tickets: HashMap::new(),
        })
    }

    fn policy(&self, step: &Value) -> Result<Policy> {
        let mut p = self.policy.clone();
        merge_policy(&mut p, step.get("policy"));
        policy_of(&p)
    }

    fn ticket(&self, step: &Value) -> Result<Ticket> {
        let name = step["ticket"].as_str().context("ticket")?;
        let mut t = self
            .tickets
            .get(name)
            .cloned()
            .with_context(|| format!("no ticket saved as {name}"))?;
        if let Some(o) = step.get("ticket-override") {
            if let Some(v) = o.get("fencing-token") {
                t.fencing_token = u64_of(v)?;
            }
            if let Some(v) = o.get("record-id") {
                t.record_id = u64_of(v)?;
            }
        }
        Ok(t)
    }

    /// Runs one step; returns its result, if the step has one.
    fn step(&mut self, step: &Value) -> Result<Option<Value>> {
        let op = step["op"].as_str().context("op")?;
        let result = match op {
            "begin" => {
                let req = BeginRequest {
                    key: key_of(step.get("key").context("key")?)?,
                    attributes: list_of(step.get("attributes").unwrap_or(&json!([])))?
                        .iter()
                        .map(|a| Ok((str_of(&a[0])?, str_of(&a[1])?)))
                        .collect::<Result<_>>()?,
                    body_kind: match step.get("body-kind").and_then(Value::as_str) {
                        None | Some("json") => BodyKind::Json,
                        Some("raw") => BodyKind::Raw,
                        Some(other) => bail!("body-kind {other}"),
                    },
                    body: bytes_of(step.get("body").unwrap_or(&json!("{}")))?,
                    policy: self.policy(step)?,
                };
                let nested = self.arm_pause_hook(step)?;
                let outcome = self.engine.begin(&req);
                // Drop a hook the call never used.
                self.hook
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take();
                if let Some(errors) = nested {
                    let errors = errors.lock().unwrap_or_else(PoisonError::into_inner);
                    if !errors.is_empty() {
                        bail!("during the first pause: {}", errors.join("; "));
                    }
                }
                if let (Ok(Decision::Execute(t)), Some(name)) =
                    (&outcome, step.get("save").and_then(Value::as_str))
                {
                    self.tickets.insert(name.to_owned(), t.clone());
                }
                or_error(outcome, |d| decision_json(&d))
            }
            "complete" => {
                let success = success_of(step.get("success").unwrap_or(&json!({})))?;
                or_error(
                    self.engine
                        .complete(&self.ticket(step)?, &self.policy(step)?, &success),
                    completion_json,
                )
            }
            "fail" => {
                let failure = failure_of(step.get("failure").context("failure")?)?;
                let disposition = match step["disposition"].as_str() {
                    Some("retryable") => Disposition::Retryable,
                    Some("final") => Disposition::Final,
                    Some("outcome-unknown") => Disposition::OutcomeUnknown,
                    other => bail!("disposition {other:?}"),
                };
                or_error(
                    self.engine.fail(
                        &self.ticket(step)?,
                        &self.policy(step)?,
                        &failure,
                        disposition,
                    ),
                    completion_json,
                )
            }
            "extend" => or_error(
                self.engine.extend(&self.ticket(step)?, &self.policy(step)?),
                extension_json,
            ),
            "reconcile" => {
                let biz = step
                    .get("biz-type")
                    .map_or(Ok(DEFAULT_BIZ_TYPE.to_owned()), str_of)?;
                let limit = step.get("limit").map_or(Ok(100), u32_of)?;
                or_error(
                    self.engine.reconcile(&biz, &self.policy(step)?, limit),
                    |r| report_json(&r),
                )
            }
            "sweep" => {
                let limit = step.get("limit").map_or(Ok(100), u32_of)?;
                or_error(self.engine.sweep(limit), |n| json!({ "deleted": n }))
            }
            "inspect" => or_error(
                self.engine
                    .inspect(&key_of(step.get("key").context("key")?)?),
                |s| s.as_ref().map_or(Value::Null, status_json),
            ),
            "records" => json!({ "count": self.fixture.count()? }),
            "clock" => {
                if let Some(ms) = step.get("advance") {
                    self.clock.advance(u64_of(ms)?);
                } else {
                    self.clock.set(T0 + u64_of(&step["set"])?);
                }
                return Ok(None);
            }
            "fault" => {
                let kind = match step["kind"].as_str() {
                    Some("unavailable") => FaultKind::Unavailable,
                    Some("internal") => FaultKind::Internal,
                    Some("lost-ack") => FaultKind::LostAck,
                    other => bail!("fault kind {other:?}"),
                };
                let op = op_of(step["store-op"].as_str().context("store-op")?)?;
                let count = step.get("count").map_or(Ok(1), u32_of)?;
                self.fixture.inject(op, kind, count);
                return Ok(None);
            }
            "results" => {
                if let Some(found) = step.get("found") {
                    self.results
                        .found
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(key_of(&found["key"])?, str_of(&found["result-ref"])?);
                }
                if let Some(failing) = step.get("failing").and_then(Value::as_bool) {
                    self.results.failing.store(failing, Ordering::SeqCst);
                }
                return Ok(None);
            }
            "tamper" => {
                let key = key_of(&step["key"])?;
                let store = self.fixture.raw();
                let mut rec = store.get(&key)?.context("no record to tamper with")?;
                let revision = rec.revision;
                if let Some(lease) = step["set"].get("lease-until") {
                    rec.lease_until = lease.as_u64().map(|t| T0 + t);
                }
                if let Some(fingerprint) = step["set"].get("fingerprint") {
                    rec.fingerprint = str_of(fingerprint)?;
                }
                if let Some(version) = step["set"].get("fingerprint-version") {
                    rec.fingerprint_version =
                        u32::try_from(version.as_u64().context("fingerprint-version")?)?;
                }
                rec.revision += 1;
                if store.compare_and_swap(revision, &rec)? != SwapOutcome::Swapped {
                    bail!("the tampering write did not land");
                }
                return Ok(None);
            }
            other => bail!("unknown op {other}"),
        };
        Ok(Some(result))
    }

    /// Sets the pause hook for a `begin` with `during-first-pause`: its steps
    /// run on a second engine over the same store, clock and lookup.
    fn arm_pause_hook(&self, step: &Value) -> Result<Option<Arc<Mutex<Vec<String>>>>> {
        let Some(steps) = step.get("during-first-pause").and_then(Value::as_array) else {
            return Ok(None);
        };
        let mut second = self.clone();
        second.engine = self
            .fixture
            .engine(HookClock::new(self.clock.clone()), self.results.clone())?;
        let errors = Arc::new(Mutex::new(Vec::new()));
        let sink = errors.clone();
        let steps = steps.clone();
        *self.hook.lock().unwrap_or_else(PoisonError::into_inner) = Some(Box::new(move || {
            for s in &steps {
                if let Err(e) = second.run(s) {
                    sink.lock().unwrap_or_else(PoisonError::into_inner).push(e);
                }
            }
        }));
        Ok(Some(errors))
    }

    /// Runs a step and checks its `expect`.
    fn run(&mut self, step: &Value) -> Result<(), String> {
        let op = step["op"].as_str().unwrap_or("?");
        let result = self.step(step).map_err(|e| format!("{op}: {e:#}"))?;
        if let Some(result) = result {
            if let Some(expected) = step.get("expect") {
                check(expected, &result, &self.saved, op)?;
            }
            if let Some(name) = step.get("save").and_then(Value::as_str) {
                self.saved.insert(name.to_owned(), result);
            }
        }
        Ok(())
    }
}

fn run_scenario(harness: &dyn Harness, scenario: &Value) -> Result<(), String> {
    let fixture = harness.fresh().map_err(|e| format!("{e:#}"))?;
    let mut ctx = Ctx::new(fixture, scenario.get("policy")).map_err(|e| format!("{e:#}"))?;
    let steps = scenario["steps"].as_array().ok_or("no steps")?;
    for (i, step) in steps.iter().enumerate() {
        ctx.run(step).map_err(|e| format!("step {}: {e}", i + 1))?;
    }
    Ok(())
}

/// The fingerprint version the vectors are for: the component's current one.
const FINGERPRINT_VERSION: u64 = 2;

/// The version-2 fingerprint computed here, independently of the guest.
fn fingerprint(attributes: &[(String, String)], raw: bool, form: &[u8]) -> Result<String> {
    let mut h = Sha256::new();
    h.update(format!("idem-fp/{FINGERPRINT_VERSION}\0").as_bytes());
    h.update(u32::try_from(attributes.len())?.to_be_bytes());
    for (n, v) in attributes {
        h.update(u32::try_from(n.len())?.to_be_bytes());
        h.update(n.as_bytes());
        h.update(u32::try_from(v.len())?.to_be_bytes());
        h.update(v.as_bytes());
    }
    h.update([if raw { b'R' } else { b'J' }]);
    h.update(u64::try_from(form.len())?.to_be_bytes());
    h.update(form);
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One fingerprint pair: both sides hashed here and by the component.
fn run_pair(harness: &dyn Harness, pair: &Value) -> Result<(), String> {
    let fixture = harness.fresh().map_err(|e| format!("{e:#}"))?;
    let mut ctx = Ctx::new(fixture, None).map_err(|e| format!("{e:#}"))?;
    let mut digests = Vec::new();
    for side in ["a", "b"] {
        let r = &pair[side];
        let attributes: Vec<(String, String)> = list_of(r.get("attributes").unwrap_or(&json!([])))
            .and_then(|l| {
                l.iter()
                    .map(|a| Ok((str_of(&a[0])?, str_of(&a[1])?)))
                    .collect()
            })
            .map_err(|e| format!("{side}: {e:#}"))?;
        let raw = r["body-kind"] == "raw";
        let form = bytes_of(&r["canonical"]).map_err(|e| format!("{side}: {e:#}"))?;
        let mine = fingerprint(&attributes, raw, &form).map_err(|e| format!("{e:#}"))?;
        let want = r["sha256"].as_str().unwrap_or_default();
        if mine != want {
            return Err(format!(
                "{side}: sha256 is {want}, this host computes {mine}"
            ));
        }
        let key = format!("fp-{side}");
        let begin = json!({
            "op": "begin", "key": key, "attributes": r.get("attributes").unwrap_or(&json!([])),
            "body-kind": r["body-kind"], "body": r["body"],
            "policy": { "fingerprint-fields": r.get("fingerprint-fields").unwrap_or(&json!([])) },
            "expect": { "decision": "execute" },
        });
        ctx.run(&begin).map_err(|e| format!("{side}: {e}"))?;
        let inspect = json!({ "op": "inspect", "key": key, "expect": { "fingerprint": want } });
        ctx.run(&inspect)
            .map_err(|e| format!("{side}: the component's fingerprint differs: {e}"))?;
        digests.push(mine);
    }
    let same = digests[0] == digests[1];
    match (pair["expect"].as_str(), same) {
        (Some("same"), true) | (Some("differ"), false) => Ok(()),
        (want, _) => Err(format!("expected {want:?}, the digests are {digests:?}")),
    }
}

fn conformance_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/conformance")
}

fn load(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}", path.display()))
}

/// Runs every scenario and fingerprint pair against `harness`; reports like
/// the other hosts' runners and fails on any failure.
fn run_all(harness: &dyn Harness) -> Result<()> {
    let mut out = std::io::stderr();
    writeln!(
        out,
        "component sha256 {} ({} bytes); backend {}",
        hex(&Sha256::digest(idem::engine::DEFAULT_GUEST)),
        idem::engine::DEFAULT_GUEST.len(),
        harness.name()
    )?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(conformance_dir().join("scenarios"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "json"));
    files.sort();
    let (mut passed, mut failed) = (0usize, 0usize);
    let mut tally = |name: String, outcome: Result<(), String>| -> Result<()> {
        match outcome {
            Ok(()) => passed += 1,
            Err(e) => {
                failed += 1;
                writeln!(out, "FAIL [{}] {name}: {e}", harness.name())?;
            }
        }
        Ok(())
    };
    for file in &files {
        let doc = load(file)?;
        for s in doc["scenarios"].as_array().context("scenarios")? {
            let name = s["name"].as_str().unwrap_or("?").to_string();
            tally(name, run_scenario(harness, s))?;
        }
    }
    let vectors = load(&conformance_dir().join("fingerprints.json"))?;
    if vectors["version"].as_u64() != Some(FINGERPRINT_VERSION) {
        bail!(
            "fingerprints.json is for version {}, this runner computes version {FINGERPRINT_VERSION}",
            vectors["version"]
        );
    }
    for p in vectors["pairs"].as_array().context("pairs")? {
        let name = format!("fingerprint {}", p["name"].as_str().unwrap_or("?"));
        tally(name, run_pair(harness, p))?;
    }
    writeln!(std::io::stderr(), "{passed} passed, {failed} failed")?;
    if failed > 0 || passed == 0 {
        bail!("{failed} conformance cases failed on {}", harness.name());
    }
    Ok(())
}

#[test]
fn memory() -> Result<()> {
    run_all(&MemoryHarness)
}

#[test]
fn sqlite() -> Result<()> {
    run_all(&SqliteHarness)
}

#[test]
fn faulty_wrapper_follows_the_mock() -> Result<()> {
    // The wrapper must fail where the mock fails, or SQLite fault scenarios
    // would test something else.
    let mem = MemoryStore::new();
    let faulty = Faulty::new(MemoryStore::new());
    let rec = |k: &str| StoredRecord {
        id: 0,
        key: RecordKey::new("s", "b", k),
        fingerprint: "0".repeat(64),
        fingerprint_version: 1,
        status: Status::Processing,
        fencing_token: 1,
        revision: 1,
        attempts: 1,
        lease_until: Some(1),
        created_at: 0,
        updated_at: 0,
        expires_at: None,
        result_ref: None,
        response: None,
        failure: None,
    };
    mem.fail_next(Some(Op::InsertIfAbsent), 1, FaultKind::LostAck);
    faulty.inject(Some(Op::InsertIfAbsent), FaultKind::LostAck, 1);
    mem.fail_next(None, 1, FaultKind::Internal);
    faulty.inject(None, FaultKind::Internal, 1);
    for k in ["a", "b", "c"] {
        let (m, f) = (
            mem.insert_if_absent(&rec(k)),
            faulty.insert_if_absent(&rec(k)),
        );
        assert_eq!(m.is_ok(), f.is_ok(), "{k}: {m:?} / {f:?}");
    }
    assert_eq!(mem.len(), 2);
    assert_eq!(faulty.inner().len(), 2);
    Ok(())
}
