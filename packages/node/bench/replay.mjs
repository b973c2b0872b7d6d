// Per-call cost of a replay: idem's `begin` (the Node package: the engine
// component transpiled by jco, the better-sqlite3 store) against
// Powertools' cache (Redis) persistence layer doing the same job (a
// makeIdempotent call whose key is already completed), in the same run.
//
//   cd packages/node/bench && npm ci && node replay.mjs [--calls 5000] [--redis redis://127.0.0.1:6379]
//
// Not run by CI.
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { randomUUID } from "node:crypto";

import { Idem, SqliteStore } from "idem-engine";

const arg = (name, dflt) => {
  const i = process.argv.indexOf(name);
  return i < 0 ? dflt : process.argv[i + 1];
};
const calls = Number(arg("--calls", "5000"));
const redisUrl = arg("--redis", "redis://127.0.0.1:6379");

async function measure(name, f) {
  for (let i = 0; i < Math.min(200, calls); i++) await f();
  const samples = new Array(calls);
  const start = process.hrtime.bigint();
  for (let i = 0; i < calls; i++) {
    const t = process.hrtime.bigint();
    await f();
    samples[i] = Number(process.hrtime.bigint() - t) / 1000;
  }
  const total = Number(process.hrtime.bigint() - start) / 1e9;
  samples.sort((a, b) => a - b);
  const p50 = samples[Math.floor(calls / 2)];
  const p99 = samples[Math.min(calls - 1, Math.floor(calls * 0.99))];
  console.log(`${name.padEnd(60)} ${(calls / total).toFixed(0).padStart(10)} ops/s   p50 ${p50.toFixed(1).padStart(8)} us   p99 ${p99.toFixed(1).padStart(8)} us`);
}

async function idemSide(bodyBytes) {
  const idem = new Idem({ store: new SqliteStore(join(mkdtempSync(join(tmpdir(), "idem-bench-")), "idem.db")) });
  const payload = Buffer.from(JSON.stringify({ sku: "A1", qty: 2, note: "x".repeat(Math.max(0, bodyBytes - 40)) }));
  const key = `bench-${randomUUID()}`;
  const d = idem.begin({ scope: "tenant-1", bizType: "order.create", key, body: payload, bodyKind: "json" });
  if (d.decision !== "execute") throw new Error(d.decision);
  idem.complete(d.ticket, {}, { resultRef: "order-1", response: { status: 201, headers: [["content-type", "application/json"]], body: "y".repeat(bodyBytes) } });
  await measure(`idem begin, replay (${payload.length} B request, ${bodyBytes} B response)`, () => {
    const r = idem.begin({ scope: "tenant-1", bizType: "order.create", key, body: payload, bodyKind: "json" });
    if (r.decision !== "replay") throw new Error(r.decision);
  });
}

async function powertoolsSide(bodyBytes) {
  const { makeIdempotent, IdempotencyConfig } = await import("@aws-lambda-powertools/idempotency");
  const { CachePersistenceLayer } = await import("@aws-lambda-powertools/idempotency/cache");
  const { createClient } = await import("@redis/client");
  const client = await createClient({ url: redisUrl }).connect();
  const persistenceStore = new CachePersistenceLayer({ client });
  const stored = "y".repeat(bodyBytes);
  let runs = 0;
  const config = new IdempotencyConfig({ expiresAfterSeconds: 3600 });
  // Outside Lambda: a context, so that Powertools does not warn on every call.
  config.registerLambdaContext({ getRemainingTimeInMillis: () => 60_000 });
  const create = makeIdempotent(async (order) => {
    runs += 1;
    return { status: 201, body: stored };
  }, { persistenceStore, config });
  const order = { id: randomUUID(), sku: "A1", qty: 2, note: "x".repeat(Math.max(0, bodyBytes - 80)) };
  await create(order);
  await measure(`Powertools CachePersistenceLayer (Redis), replay (${bodyBytes} B)`, () => create(order));
  if (runs !== 1) throw new Error(`Powertools ran the function ${runs} times`);
  await client.quit();
}

console.log(`node ${process.version}`);
await idemSide(16);
await idemSide(1024);
process.env.AWS_LAMBDA_FUNCTION_NAME ??= "idem-bench";
await powertoolsSide(16);
await powertoolsSide(1024);
