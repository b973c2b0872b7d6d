// makeIdempotent through the real component and a real SQLite file.
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  IdempotencyFailedError, IdempotencyInProgressError, IdempotencyKeyMismatchError,
  IdempotencyLostOwnershipError, IdempotencyValidationError, makeIdempotent,
} from "idem-engine";

import { setup } from "./helpers.js";

test("runs once per key and replays the result", async () => {
  const { idem } = setup();
  let runs = 0;
  const charge = makeIdempotent(async (event) => {
    runs += 1;
    return { chargeId: `ch-${runs}`, amount: event.amount };
  }, { idem, bizType: "payment.charge", key: (e) => e.requestId, fingerprint: (e) => ({ amount: e.amount, card: e.card }) });
  const first = await charge({ requestId: "r1", amount: 100, card: "4242", traceId: "a" });
  const second = await charge({ requestId: "r1", amount: 100, card: "4242", traceId: "b" });
  assert.deepEqual(first, { chargeId: "ch-1", amount: 100 });
  assert.deepEqual(second, first);
  assert.equal(runs, 1);
  await assert.rejects(charge({ requestId: "r1", amount: 200, card: "4242" }), IdempotencyKeyMismatchError);
  assert.equal(runs, 1);
});

test("a thrown error is retryable by default: the next call runs again", async () => {
  const { idem } = setup();
  let runs = 0;
  const f = makeIdempotent(async () => {
    runs += 1;
    if (runs === 1) throw new Error("flaky");
    return "ok";
  }, { idem, bizType: "job", key: (k) => k });
  await assert.rejects(f("k"), /flaky/);
  assert.equal(await f("k"), "ok");
  assert.equal(await f("k"), "ok");
  assert.equal(runs, 2);
});

test("an error classified final is replayed as IdempotencyFailedError", async () => {
  const { idem } = setup();
  let runs = 0;
  const f = makeIdempotent(async () => {
    runs += 1;
    throw Object.assign(new Error("card declined"), { code: "card-declined" });
  }, { idem, bizType: "job", key: (k) => k, classify: () => "final" });
  await assert.rejects(f("k"), /card declined/);
  await assert.rejects(f("k"), (e) => e instanceof IdempotencyFailedError && e.code === "card-declined");
  assert.equal(runs, 1);
});

test("a concurrent call with the same key is refused as in progress", async () => {
  const { idem } = setup();
  let release;
  const gate = new Promise((r) => { release = r; });
  const f = makeIdempotent(async () => { await gate; return 1; }, { idem, bizType: "job", key: (k) => k });
  const first = f("k");
  await assert.rejects(f("k"), (e) => e instanceof IdempotencyInProgressError && e.retryAfterMs > 0);
  release();
  assert.equal(await first, 1);
  assert.equal(await f("k"), 1);
});

test("a call whose lease was taken over is told its result was not stored", async () => {
  const { idem, clock } = setup();
  const policy = { lease_ms: 1000 };
  let release;
  const gate = new Promise((r) => { release = r; });
  let runs = 0;
  const f = makeIdempotent(async () => { runs += 1; const n = runs; if (n === 1) await gate; return n; }, { idem, bizType: "job", key: (k) => k, policy });
  const slow = f("k");
  clock.advance(1001);
  assert.equal(await f("k"), 2);
  release();
  await assert.rejects(slow, (e) => e instanceof IdempotencyLostOwnershipError && e.result === 1);
  assert.equal(await f("k"), 2);
});

test("bad keys and options name the field and the rule", async () => {
  const { idem } = setup();
  const f = makeIdempotent(async () => 1, { idem, bizType: "job", key: () => "x".repeat(300) });
  await assert.rejects(f(), (e) => e instanceof IdempotencyValidationError && e.field === "idem-key" && e.rule === "too-long");
  assert.throws(() => makeIdempotent(async () => 1, { idem, bizType: "job" }), /options\.key must be a function/);
  assert.throws(() => makeIdempotent(async () => 1, { bizType: "job", key: () => "k" }), /options\.idem must be an Idem/);
});
