// The engine through the real component and a real SQLite file.
import assert from "node:assert/strict";
import { test } from "node:test";

import { EngineError, Idem, MIGRATIONS, SqliteStore } from "idem-engine";

import { T0, key, setup } from "./helpers.js";

const ok = (status, body) => ({ status, headers: [["content-type", "application/json"]], body });

test("execute, complete, then replay the stored response from the file", () => {
  const { idem, path, clock } = setup();
  const d = idem.begin({ ...key("k1"), body: { sku: "A1", qty: 2 } });
  assert.equal(d.decision, "execute");
  assert.equal(d.fencingToken, 1);
  assert.equal(d.attempt, 1);
  assert.deepEqual(idem.complete(d.ticket, {}, { resultRef: "order-1", response: ok(201, '{"order":"order-1"}') }), { completion: "recorded", status: "succeeded" });
  // A second engine over a second connection to the same file.
  const other = new Idem({ store: new SqliteStore(path), clock });
  const r = other.begin({ ...key("k1"), body: '{ "qty": 2, "sku": "A1" }', bodyKind: "json" });
  assert.equal(r.decision, "replay");
  assert.equal(r.resultRef, "order-1");
  assert.equal(r.response.status, 201);
  assert.equal(r.response.body.toString(), '{"order":"order-1"}');
  assert.deepEqual(r.response.headers.map(([n, v]) => [n, v.toString()]), [["content-type", "application/json"]]);
  assert.equal(r.completedAt, T0);
});

test("the same key with another request is a mismatch", () => {
  const { idem } = setup();
  const d = idem.begin({ ...key("k1"), body: { sku: "A1" } });
  idem.complete(d.ticket, {}, { resultRef: "order-1" });
  const m = idem.begin({ ...key("k1"), body: { sku: "B7" } });
  assert.equal(m.decision, "mismatch");
  assert.equal(m.storedPrefix.length, 8);
  assert.equal(m.storedVersion, 2);
});

test("a duplicate while the first runs is in progress, with a retry-after hint", () => {
  const { idem } = setup();
  assert.equal(idem.begin({ ...key("k1"), body: {} }).decision, "execute");
  const p = idem.begin({ ...key("k1"), body: {}, policy: { retry_after_ms: 700 } });
  assert.equal(p.decision, "in-progress");
  assert.equal(p.retryAfterMs, 700);
  assert.equal(p.leaseUntil, T0 + 60_000);
});

test("an expired lease is taken over with a new fencing token; the old owner is fenced off", () => {
  const { idem, clock } = setup();
  const policy = { lease_ms: 1000 };
  const first = idem.begin({ ...key("k1"), body: {}, policy });
  clock.advance(1001);
  const second = idem.begin({ ...key("k1"), body: {}, policy });
  assert.equal(second.decision, "execute");
  assert.equal(second.fencingToken, 2);
  assert.equal(second.attempt, 2);
  assert.deepEqual(idem.complete(first.ticket, policy, { resultRef: "stale" }), { completion: "lost-ownership" });
  assert.deepEqual(idem.fail(first.ticket, policy, { code: "stale" }, "final"), { completion: "lost-ownership" });
  assert.deepEqual(idem.extend(first.ticket, policy), { extended: false });
  assert.deepEqual(idem.complete(second.ticket, policy, { resultRef: "fresh" }), { completion: "recorded", status: "succeeded" });
  const r = idem.begin({ ...key("k1"), body: {}, policy });
  assert.equal(r.decision, "replay");
  assert.equal(r.resultRef, "fresh");
});

test("extend moves the lease to now plus lease_ms", () => {
  const { idem, clock } = setup();
  const d = idem.begin({ ...key("k1"), body: {} });
  clock.advance(5000);
  assert.deepEqual(idem.extend(d.ticket, {}), { extended: true, leaseUntil: T0 + 5000 + 60_000 });
});

test("a final failure is replayed; a retryable one lets the next request execute", () => {
  const { idem } = setup();
  const a = idem.begin({ ...key("final"), body: {} });
  assert.deepEqual(idem.fail(a.ticket, {}, { code: "card-declined", message: "the card was declined" }, "final"), { completion: "recorded", status: "failed" });
  const f = idem.begin({ ...key("final"), body: {} });
  assert.equal(f.decision, "failed");
  assert.equal(f.failure.code, "card-declined");
  assert.equal(f.failure.message, "the card was declined");

  const b = idem.begin({ ...key("retry"), body: {} });
  assert.deepEqual(idem.fail(b.ticket, {}, { code: "db-down" }, "retryable"), { completion: "recorded", status: "released" });
  const again = idem.begin({ ...key("retry"), body: {} });
  assert.equal(again.decision, "execute");
  assert.equal(again.attempt, 2);
});

test("always-final stores a retryable failure as final", () => {
  const { idem } = setup();
  const policy = { failure_mode: "always-final" };
  const a = idem.begin({ ...key("k"), body: {}, policy });
  assert.deepEqual(idem.fail(a.ticket, policy, { code: "e500" }, "retryable"), { completion: "recorded", status: "failed" });
  assert.equal(idem.begin({ ...key("k"), body: {}, policy }).decision, "failed");
});

test("max_attempts stores the retryable failure of the last attempt as final", () => {
  const { idem } = setup();
  const policy = { max_attempts: 2 };
  const first = idem.begin({ ...key("k"), body: {}, policy });
  assert.equal(first.decision, "execute");
  assert.equal(first.attempt, 1);
  assert.deepEqual(idem.fail(first.ticket, policy, { code: "db-down", message: "attempt 1" }, "retryable"), { completion: "recorded", status: "released" });
  const second = idem.begin({ ...key("k"), body: {}, policy });
  assert.equal(second.decision, "execute");
  assert.equal(second.attempt, 2);
  assert.deepEqual(idem.fail(second.ticket, policy, { code: "db-down", message: "attempt 2" }, "retryable"), { completion: "recorded", status: "failed" });
  const third = idem.begin({ ...key("k"), body: {}, policy });
  assert.equal(third.decision, "failed");
  assert.equal(third.failure.code, "db-down");
  assert.equal(third.failure.message, "attempt 2");
  const s = idem.inspect(key("k"));
  assert.equal(s.status, "failed");
  assert.equal(s.attempts, 2);
  // Without a limit (null, the default) the second retryable failure releases the key too.
  const open = { max_attempts: null };
  for (let attempt = 1; attempt <= 2; attempt++) {
    const d = idem.begin({ ...key("open"), body: {}, policy: open });
    assert.equal(d.attempt, attempt);
    assert.deepEqual(idem.fail(d.ticket, open, { code: "db-down" }, "retryable"), { completion: "recorded", status: "released" });
  }
  assert.equal(idem.begin({ ...key("open"), body: {} }).decision, "execute");
});

test("max_attempts 0 is an invalid policy and writes nothing; a wrong type is refused before the engine", () => {
  const { idem, store, clock } = setup();
  const zero = { max_attempts: 0 };
  const d = idem.begin({ ...key("k"), body: {}, policy: zero });
  assert.deepEqual([d.decision, d.field, d.rule], ["invalid", "policy", "out-of-range"]);
  assert.equal(store.count(), 0);
  assert.equal(idem.inspect(key("k")), null);
  // fail refuses it too, before writing: the key stays processing.
  const e = idem.begin({ ...key("k"), body: {} });
  clock.advance(10);
  assert.throws(() => idem.fail(e.ticket, zero, { code: "db-down" }, "retryable"),
    (err) => err instanceof EngineError && err.kind === "invalid" && err.field === "policy" && err.rule === "out-of-range");
  const s = idem.inspect(key("k"));
  assert.equal(s.status, "processing");
  assert.equal(s.updatedAt, T0);
  assert.equal(s.attempts, 1);
  assert.equal(idem.begin({ ...key("k"), body: {}, policy: { max_attempts: 1 } }).decision, "in-progress");
  assert.throws(() => idem.begin({ ...key("k2"), body: {}, policy: { max_attempts: -1 } }), /policy\.max_attempts must be a non-negative integer/);
  assert.throws(() => idem.begin({ ...key("k2"), body: {}, policy: { max_attempts: "3" } }), /policy\.max_attempts must be a non-negative integer/);
  assert.throws(() => idem.begin({ ...key("k2"), body: {}, policy: { max_attempts: 2 ** 32 } }), /policy\.max_attempts must be at most 4294967295/);
  assert.equal(store.count(), 1);
});

test("outcome-unknown blocks the key while the lease lasts; manual keeps it blocked", () => {
  const { idem, clock } = setup();
  const policy = { expired_lease: "manual", lease_ms: 1000 };
  const a = idem.begin({ ...key("k"), body: {}, policy });
  assert.deepEqual(idem.fail(a.ticket, policy, { code: "timeout" }, "outcome-unknown"), { completion: "recorded", status: "outcome-unknown" });
  const u = idem.begin({ ...key("k"), body: {}, policy });
  assert.equal(u.decision, "outcome-unknown");
  assert.equal(u.failure.code, "timeout");
  clock.advance(5000);
  assert.equal(idem.begin({ ...key("k"), body: {}, policy }).decision, "outcome-unknown");
});

test("outcome-unknown stays blocked by default even where expired leases are taken over", () => {
  const { idem, clock } = setup();
  const policy = { lease_ms: 1000 };
  const a = idem.begin({ ...key("k"), body: {}, policy });
  idem.fail(a.ticket, policy, { code: "timeout" }, "outcome-unknown");
  const crashed = idem.begin({ ...key("crashed"), body: {}, policy });
  assert.equal(crashed.decision, "execute");
  clock.advance(5000);
  assert.equal(idem.begin({ ...key("crashed"), body: {}, policy }).decision, "execute");
  assert.equal(idem.begin({ ...key("k"), body: {}, policy }).decision, "outcome-unknown");
  const retried = { ...policy, outcome_unknown: "take-over" };
  assert.equal(idem.begin({ ...key("k"), body: {}, policy: retried }).decision, "execute");
});

test("reconcile asks the business side and settles the key", () => {
  const found = new Map([["k", "order-77"]]);
  const { idem, clock } = setup({ results: { findResult: (k) => found.get(k.idemKey) } });
  const policy = { expired_lease: "reconcile", lease_ms: 1000 };
  idem.begin({ ...key("k"), body: {}, policy });
  clock.advance(1001);
  const report = idem.reconcile("order.create", policy, 10);
  assert.equal(report.examined, 1);
  assert.equal(report.succeeded, 1);
  const r = idem.begin({ ...key("k"), body: {}, policy });
  assert.equal(r.decision, "replay");
  assert.equal(r.resultRef, "order-77");
});

test("a lookup may find a full response: stored, and replayed once the lease expired under reconcile", () => {
  const found = new Map([["k", { resultRef: "order-8", response: ok(201, '{"order":"order-8"}') }]]);
  let lookups = 0;
  const { idem, clock, path } = setup({ results: { findResult: (k) => (lookups++, found.get(k.idemKey)) } });
  const policy = { expired_lease: "reconcile", lease_ms: 1000 };
  assert.equal(idem.begin({ ...key("k"), body: {}, policy }).decision, "execute");
  clock.advance(1001);
  const r = idem.begin({ ...key("k"), body: {}, policy });
  assert.equal(lookups, 1);
  assert.equal(r.decision, "replay");
  assert.equal(r.resultRef, "order-8");
  assert.equal(r.response.status, 201);
  assert.deepEqual(r.response.headers.map(([n, v]) => [n, v.toString()]), [["content-type", "application/json"]]);
  assert.equal(r.response.body.toString(), '{"order":"order-8"}');
  assert.equal(r.completedAt, T0 + 1001);
  // Stored: another engine over the file replays it without asking again.
  const other = new Idem({ store: new SqliteStore(path), clock });
  const again = other.begin({ ...key("k"), body: {}, policy });
  assert.equal(lookups, 1);
  assert.equal(again.decision, "replay");
  assert.equal(again.response.status, 201);
  assert.equal(again.response.body.toString(), '{"order":"order-8"}');
  assert.equal(idem.inspect(key("k")).status, "succeeded");
});

test("a found result that breaks complete's rules (status 99) is a failed lookup: nothing is stored", () => {
  const found = new Map([["k", { resultRef: "order-9", response: { status: 99, body: "x" } }]]);
  const { idem, clock } = setup({ results: { findResult: (k) => found.get(k.idemKey) } });
  const policy = { expired_lease: "reconcile", lease_ms: 1000 };
  assert.equal(idem.begin({ ...key("k"), body: {}, policy }).decision, "execute");
  clock.advance(1001);
  assert.throws(() => idem.begin({ ...key("k"), body: {}, policy }), (e) => e instanceof EngineError && e.kind === "store" && e.storeKind === "internal");
  const s = idem.inspect(key("k"));
  assert.equal(s.status, "processing");
  assert.equal(s.resultRef, null);
  assert.equal(s.attempts, 1);
  assert.equal(s.leaseUntil, T0 + 1000);
  // reconcile() reads it as a lookup error too and leaves the key.
  const report = idem.reconcile("order.create", policy, 10);
  assert.equal(report.lookupErrors, 1);
  assert.equal(report.succeeded, 0);
  assert.equal(idem.inspect(key("k")).status, "processing");
  // The key stayed stale: once the lookup answers a valid result, the next begin stores and replays it.
  found.set("k", { resultRef: "order-9", response: ok(201, "{}") });
  const r = idem.begin({ ...key("k"), body: {}, policy });
  assert.equal(r.decision, "replay");
  assert.equal(r.response.status, 201);
});

test("sweep deletes settled records past retention, never a processing one", () => {
  const { idem, clock, store } = setup();
  const policy = { retention_ms: 1000 };
  const a = idem.begin({ ...key("done"), body: {}, policy });
  idem.complete(a.ticket, policy, { resultRef: "x" });
  idem.begin({ ...key("running"), body: {}, policy });
  clock.advance(999);
  assert.equal(idem.sweep(100), 0);
  clock.advance(1);
  assert.equal(idem.sweep(100), 1);
  assert.equal(idem.inspect(key("done")), null);
  assert.equal(idem.inspect(key("running")).status, "processing");
  assert.equal(store.count(), 1);
});

test("a bounded wait polls on the injected clock and replays", () => {
  const { idem, clock } = setup();
  const policy = { in_progress: { wait: { max_wait_ms: 3000, poll_interval_ms: 500 } } };
  const a = idem.begin({ ...key("k"), body: {}, policy });
  idem.complete(a.ticket, policy, { resultRef: "r" });
  assert.equal(idem.begin({ ...key("k"), body: {}, policy }).decision, "replay");
  const b = idem.begin({ ...key("k2"), body: {}, policy });
  assert.equal(b.decision, "execute");
  const before = clock.now();
  assert.equal(idem.begin({ ...key("k2"), body: {}, policy }).decision, "in-progress");
  assert.ok(clock.now() - before >= 3000n, "the wait advanced the manual clock");
});

test("bad input is a decision naming the field and the rule", () => {
  const { idem } = setup();
  const bad = idem.begin({ ...key(""), body: {} });
  assert.deepEqual([bad.decision, bad.field, bad.rule], ["invalid", "idem-key", "required"]);
  const notJson = idem.begin({ ...key("k"), body: "{", bodyKind: "json" });
  assert.deepEqual([notJson.decision, notJson.field, notJson.rule], ["invalid", "body", "not-json"]);
  const lease = idem.begin({ ...key("k"), body: {}, policy: { lease_ms: 0 } });
  assert.deepEqual([lease.decision, lease.field], ["invalid", "policy"]);
  assert.throws(() => idem.begin({ ...key("k"), body: {}, policy: { leaseMs: 5 } }), /policy\.leaseMs is not a policy field/);
  assert.throws(() => idem.begin({ ...key("k"), body: {}, policy: { expired_lease: "later" } }), /policy\.expired_lease must be one of/);
  assert.throws(() => idem.begin({ scope: "s", bizType: "b", key: 7 }), /begin\.key must be a string/);
});

test("a store failure is an error to the caller, never 'no record'", () => {
  const { idem, store } = setup();
  store.db.exec("DROP TABLE idempotency_record");
  assert.throws(() => idem.begin({ ...key("k"), body: {} }), (e) => e instanceof EngineError && e.kind === "store" && /no such table/.test(e.message));
  assert.throws(() => idem.inspect(key("k")), (e) => e instanceof EngineError && e.kind === "store");
});

test("a busy database is 'unavailable', not 'no record'", () => {
  const { idem, path } = setup();
  const blocker = new SqliteStore(path, { busyTimeoutMs: 0 });
  const locked = new Idem({ store: new SqliteStore(path, { busyTimeoutMs: 0 }) });
  blocker.db.exec("BEGIN EXCLUSIVE");
  try {
    assert.throws(() => locked.begin({ ...key("k"), body: {} }), (e) => e.kind === "store" && e.storeKind === "unavailable");
  } finally {
    blocker.db.exec("ROLLBACK");
  }
  assert.equal(idem.begin({ ...key("k"), body: {} }).decision, "execute");
});

test("the file has the Rust store's schema: version 3 and the unique index", () => {
  const { store } = setup();
  assert.equal(Number(store.db.pragma("user_version", { simple: true })), 3);
  const idx = store.db.prepare("SELECT name FROM sqlite_master WHERE type = 'index' ORDER BY name").all().map((r) => r.name);
  assert.deepEqual(idx, ["idempotency_record_outcome_unknown", "idempotency_record_stale_processing", "idempotency_record_sweep", "sqlite_autoindex_idempotency_record_1"]);
  assert.equal(String(store.db.pragma("journal_mode", { simple: true })), "wal");
});

test("the schema is the Rust store's files, built into the package, and made the file", () => {
  const { store } = setup();
  assert.equal(MIGRATIONS.length, 3);
  assert.ok(MIGRATIONS[0].startsWith("-- Schema version 1:"));
  // SQLite keeps each CREATE INDEX as written: the file's text made it.
  const sweep = store.db.prepare("SELECT sql FROM sqlite_master WHERE name = 'idempotency_record_sweep'").get().sql;
  assert.ok(MIGRATIONS[2].includes(sweep), sweep);
});

test("rows written by schema version 1 are read after the upgrade; new rows are base64", () => {
  const { idem, path, clock, store } = setup();
  const d = idem.begin({ ...key("k"), body: {} });
  idem.complete(d.ticket, {}, { response: { status: 201, headers: [["x-bin", Uint8Array.of(0, 255)]], body: "body" } });
  // Version 1 wrote byte strings as arrays of numbers.
  const v1 = JSON.stringify({ status: 201, headers: [["x-bin", [0, 255]]], body: Array.from(Buffer.from("body")) });
  store.db.prepare("UPDATE idempotency_record SET response = ?").run(Buffer.from(v1));
  store.db.pragma("user_version = 1");
  const upgraded = new SqliteStore(path);
  assert.equal(Number(upgraded.db.pragma("user_version", { simple: true })), 3);
  const r = new Idem({ store: upgraded, clock }).begin({ ...key("k"), body: {} });
  assert.equal(r.decision, "replay");
  assert.equal(r.response.status, 201);
  assert.deepEqual(Array.from(r.response.headers[0][1]), [0, 255]);
  assert.equal(r.response.body.toString(), "body");
  const d2 = idem.begin({ ...key("k2"), body: {} });
  idem.complete(d2.ticket, {}, { response: { status: 200, headers: [["x-bin", Uint8Array.of(255, 0, 128)]], body: "{}" } });
  const column = store.db.prepare("SELECT response FROM idempotency_record WHERE idem_key = 'k2'").get().response;
  assert.deepEqual(JSON.parse(column.toString()), { status: 200, headers: [["x-bin", "/wCA"]], body: "e30=" });
});

test("a column that is not a stored response is a store error naming it", () => {
  const { idem, store } = setup();
  const d = idem.begin({ ...key("k"), body: {} });
  idem.complete(d.ticket, {}, { response: { status: 200, headers: [], body: "ok" } });
  for (const [column, rule] of [
    ['{"status":200,"headers":[],"body":"not base64!"}', /invalid base64/],
    ['{"status":200,"headers":[],"body":[256]}', /a base64 string or an array of bytes/],
    ['{"status":200,"headers":[],"body":7}', /a base64 string or an array of bytes/],
  ]) {
    store.db.prepare("UPDATE idempotency_record SET response = ?").run(Buffer.from(column));
    assert.throws(() => idem.begin({ ...key("k"), body: {} }),
      (e) => e instanceof EngineError && e.kind === "store" && /column response cannot be decoded/.test(e.message) && rule.test(e.message));
  }
});

test("the business write and the completion commit together, or not at all", () => {
  const { idem, store } = setup();
  store.db.exec("CREATE TABLE orders (idem_key TEXT NOT NULL)");
  const d = idem.begin({ ...key("k"), body: {} });
  assert.throws(() => store.transaction((db) => {
    db.prepare("INSERT INTO orders VALUES ('k')").run();
    assert.deepEqual(idem.complete(d.ticket, {}, { resultRef: "order-1" }), { completion: "recorded", status: "succeeded" });
    throw new Error("the business transaction fails after the completion");
  }), /fails after the completion/);
  assert.equal(Number(store.db.prepare("SELECT COUNT(*) AS n FROM orders").get().n), 0);
  assert.equal(idem.inspect(key("k")).status, "processing");
  store.transaction((db) => {
    db.prepare("INSERT INTO orders VALUES ('k')").run();
    assert.deepEqual(idem.complete(d.ticket, {}, { resultRef: "order-1" }), { completion: "recorded", status: "succeeded" });
  });
  assert.equal(Number(store.db.prepare("SELECT COUNT(*) AS n FROM orders").get().n), 1);
  assert.equal(idem.begin({ ...key("k"), body: {} }).decision, "replay");
});
