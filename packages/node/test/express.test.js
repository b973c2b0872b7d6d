// The Express middleware answers the README's curl session as the proxy does.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import express from "express";

import { idempotency, idempotencyErrors } from "idem-engine";

import { setup } from "./helpers.js";

const KEY = "8e03978e-40d5-43e8-bc93-6894a57f9324";
const TYPE = "tag:idem.invalid,2026:problems/";
let server;
let base;
let orders = 0;
let ctx;
let slowStarted;
let releaseSlow;
const started = new Promise((r) => { slowStarted = r; });
const slowGate = new Promise((r) => { releaseSlow = r; });

before(async () => {
  ctx = setup();
  const app = express();
  app.use(idempotency({ idem: ctx.idem, policy: { lease_ms: 30_000 } }));
  app.post("/orders", (req, res) => {
    orders += 1;
    res.status(201).type("application/json").send(`{"order":"order-${1000 + orders}"}\n`);
  });
  app.post("/slow", async (req, res) => {
    slowStarted();
    await slowGate;
    res.status(201).send("done");
  });
  app.post("/teapot", (req, res) => res.status(418).send("short and stout"));
  app.post("/flaky", (req, res) => res.status(503).send("try later"));
  app.get("/orders", (req, res) => res.json({ orders }));
  app.post("/boom", () => { throw new Error("the handler crashed"); });
  app.use(idempotencyErrors());
  await new Promise((resolve) => { server = app.listen(0, "127.0.0.1", resolve); });
  base = `http://127.0.0.1:${server.address().port}`;
});

after(() => server.close());

const post = (path, { key, auth = "Bearer alice-token", body = '{"sku":"A1","qty":2}', type = "application/json" } = {}) => {
  const headers = { "content-type": type };
  if (key !== undefined) headers["idempotency-key"] = key;
  if (auth !== null) headers.authorization = auth;
  return fetch(base + path, { method: "POST", headers, body });
};

async function problem(res, status, slug, title) {
  assert.equal(res.status, status);
  assert.equal(res.headers.get("content-type"), "application/problem+json");
  assert.equal(res.headers.get("cache-control"), "no-store");
  const body = await res.json();
  assert.equal(body.type, TYPE + slug);
  assert.equal(body.title, title);
  assert.equal(body.status, status);
  return body;
}

test("the README's curl session, answer by answer", async () => {
  const first = await post("/orders", { key: `"${KEY}"` });
  assert.equal(first.status, 201);
  assert.equal(first.headers.get("idempotent-replayed"), null);
  assert.equal(await first.text(), '{"order":"order-1001"}\n');

  const retry = await post("/orders", { key: KEY, body: '{ "qty": 2, "sku": "A1" }' });
  assert.equal(retry.status, 201);
  assert.equal(retry.headers.get("idempotent-replayed"), "true");
  assert.equal(retry.headers.get("content-type"), "application/json; charset=utf-8");
  assert.equal(retry.headers.get("content-length"), "23");
  assert.equal(await retry.text(), '{"order":"order-1001"}\n');
  assert.equal(orders, 1);

  const reused = await post("/orders", { key: KEY, body: '{"sku":"B7","qty":1}' });
  const reusedBody = await problem(reused, 422, "key-reused", "Idempotency-Key is already used");
  assert.equal(JSON.stringify(reusedBody), '{"detail":"This Idempotency-Key was already used with a different request (method, path or body). Use a new key for a new request.","status":422,"title":"Idempotency-Key is already used","type":"tag:idem.invalid,2026:problems/key-reused"}');

  await problem(await post("/orders", {}), 400, "key-missing", "Idempotency-Key is missing");

  const anon = await post("/orders", { key: KEY, auth: null });
  await problem(anon, 401, "client-unidentified", "The client is not identified");
  assert.equal(anon.headers.get("www-authenticate"), 'Bearer realm="idem"');
  assert.equal(orders, 1);
});

test("the key is scoped by Authorization: another client's key executes", async () => {
  const before = orders;
  const res = await post("/orders", { key: "scoped-key", auth: "Bearer bob-token" });
  assert.equal(res.status, 201);
  const res2 = await post("/orders", { key: "scoped-key", auth: "Bearer carol-token" });
  assert.equal(res2.status, 201);
  assert.equal(orders, before + 2);
});

test("safe methods pass through; invalid keys are 400 key-invalid", async () => {
  const get = await fetch(`${base}/orders`);
  assert.equal(get.status, 200);
  await problem(await post("/orders", { key: '"unterminated' }), 400, "key-invalid", "Idempotency-Key is invalid");
  const long = await problem(await post("/orders", { key: "x".repeat(256) }), 400, "key-invalid", "Idempotency-Key is invalid");
  assert.equal(long.field, "idem-key");
  assert.equal(long.rule, "too-long");
  await problem(await post("/orders", { key: "bad-json", body: "{" }), 400, "invalid-request", "Request is invalid");
});

test("a duplicate while the first runs is 409 request-in-progress with Retry-After", async () => {
  const first = post("/slow", { key: "slow-1" });
  await started;
  const dup = await post("/slow", { key: "slow-1" });
  await problem(dup, 409, "request-in-progress", "A request is outstanding for this Idempotency-Key");
  assert.ok(Number(dup.headers.get("retry-after")) >= 1);
  releaseSlow();
  assert.equal((await first).status, 201);
  const replay = await post("/slow", { key: "slow-1" });
  assert.equal(replay.headers.get("idempotent-replayed"), "true");
});

test("4xx answers are stored and replayed; 5xx are not", async () => {
  const t1 = await post("/teapot", { key: "tea" });
  assert.equal(t1.status, 418);
  const t2 = await post("/teapot", { key: "tea" });
  assert.equal(t2.status, 418);
  assert.equal(t2.headers.get("idempotent-replayed"), "true");
  assert.equal(await t2.text(), "short and stout");
  const f1 = await post("/flaky", { key: "flaky" });
  assert.equal(f1.status, 503);
  const f2 = await post("/flaky", { key: "flaky" });
  assert.equal(f2.status, 503);
  assert.equal(f2.headers.get("idempotent-replayed"), null);
});

test("a body over max_body_bytes is 413 body-too-large", async () => {
  const app = express();
  app.use(idempotency({ idem: ctx.idem, policy: { max_body_bytes: 10 } }));
  app.post("/x", (req, res) => res.send("no"));
  const s = await new Promise((resolve) => { const x = app.listen(0, "127.0.0.1", () => resolve(x)); });
  try {
    const res = await fetch(`http://127.0.0.1:${s.address().port}/x`, { method: "POST", headers: { "idempotency-key": "big", authorization: "Bearer a" }, body: "x".repeat(11) });
    const body = await problem(res, 413, "body-too-large", "Request body is too large");
    assert.equal(body.max_body_bytes, 10);
  } finally {
    s.close();
  }
});

test("a store failure is 503 store-unavailable and nothing runs", async () => {
  const local = setup();
  const app = express();
  app.use(idempotency({ idem: local.idem }));
  let ran = false;
  app.post("/x", (req, res) => { ran = true; res.send("no"); });
  const s = await new Promise((resolve) => { const x = app.listen(0, "127.0.0.1", () => resolve(x)); });
  local.store.db.exec("DROP TABLE idempotency_record");
  try {
    const res = await fetch(`http://127.0.0.1:${s.address().port}/x`, { method: "POST", headers: { "idempotency-key": "k", authorization: "Bearer a" }, body: "{}" });
    await problem(res, 503, "store-unavailable", "Idempotency store is unavailable");
    assert.equal(res.headers.get("retry-after"), "1");
    assert.equal(ran, false);
  } finally {
    s.close();
  }
});

test("a handler that fails leaves the outcome unknown: 500, then 409 outcome-unknown", async () => {
  const first = await post("/boom", { key: "boom" });
  await problem(first, 500, "outcome-unknown", "The outcome of the request is unknown");
  const again = await post("/boom", { key: "boom" });
  await problem(again, 409, "outcome-unknown", "The outcome of the request is unknown");
});
