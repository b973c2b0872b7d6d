// Runs idem's conformance scenarios (../scenarios/*.json, ../fingerprints.json)
// against the engine component, transpiled to JavaScript by jco, with a
// store, a clock and a result lookup in JavaScript. The host code (loading
// the component, its imports) is the Node package's (packages/node/src).
//
//   node run.mjs PATH/TO/idem_guest.wasm                 the mock store below
//   node run.mjs PATH/TO/idem_guest.wasm --store sqlite  the package's SQLite store,
//                                                        one new file per scenario
//                                                        (needs packages/node's npm ci)
//
// Prints the component's SHA-256, one line per failure, and
// "N passed, M failed"; exits non-zero on any failure. The file format is
// described in ../README.md.

import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdtempSync, readFileSync, readdirSync, mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const conformance = resolve(here, "..");

/** Every scenario's clock starts here (2026-01-01T00:00:00Z); file times are relative to it. */
const T0 = 1767225600000n;
const DEFAULT_SCOPE = "tenant-1";
const DEFAULT_BIZ_TYPE = "order.create";
/** The largest integer a SQL store holds: the mock refuses more, as they do. */
const I64_MAX = (1n << 63n) - 1n;

// ------------------------------------------------------------ loading the component

const args = process.argv.slice(2);
const storeKind = args.includes("--store") ? args[args.indexOf("--store") + 1] : "mock";
if (storeKind !== "mock" && storeKind !== "sqlite") throw new Error(`--store must be mock or sqlite, not ${storeKind}`);
const wasmArg = args.find((a, i) => !a.startsWith("--") && args[i - 1] !== "--store");
const wasmPath = resolve(wasmArg ?? join(conformance, "../../target/idem_guest.wasm"));
const wasm = readFileSync(wasmPath);
const outDir = join(here, "out");
rmSync(outDir, { recursive: true, force: true });
mkdirSync(outDir, { recursive: true });
execFileSync(
  process.execPath,
  [join(here, "node_modules/@bytecodealliance/jco/dist/jco.js"), "transpile", wasmPath,
    "--name", "idem", "--instantiation", "sync", "--no-typescript", "--quiet", "-o", outDir],
  { stdio: "inherit" },
);
const packageSrc = resolve(conformance, "../../packages/node/src");
const { StoreError, instantiateEngine, loadComponent } = await import(pathToFileURL(join(packageSrc, "host.js")).href);
const component = await loadComponent(outDir);
const SqliteStore = storeKind === "sqlite" ? (await import(pathToFileURL(join(packageSrc, "sqlite.js")).href)).SqliteStore : null;
const sqliteDir = storeKind === "sqlite" ? mkdtempSync(join(tmpdir(), "idem-conformance-")) : null;
let sqliteFiles = 0;

// ------------------------------------------------------------ the host: store, clock, results

const keyId = (k) => JSON.stringify([k.scope, k.bizType, k.idemKey]);
const copy = (v) => (v === undefined ? undefined : structuredClone(v));
const isSettled = (s) => s === "succeeded" || s === "failed" || s === "released";

/** The mock's fault injection: the next `count` calls of `op` (null: any) fail as `kind`. */
class Faults {
  constructor() {
    this.faults = [];
  }

  inject(op, kind, count) {
    if (count > 0) this.faults.push({ op, kind, remaining: count });
  }

  run(op, f) {
    const i = this.faults.findIndex((x) => x.remaining > 0 && (x.op === null || x.op === op));
    if (i < 0) return f();
    const fault = this.faults[i];
    fault.remaining -= 1;
    if (fault.remaining === 0) this.faults.splice(i, 1);
    if (fault.kind === "unavailable") throw new StoreError("unavailable", `injected fault: ${op} unavailable`);
    if (fault.kind === "internal") throw new StoreError("internal", `injected fault: ${op} internal error`);
    f();
    throw new StoreError("unavailable", `injected fault: ${op} acknowledgement lost`);
  }
}

/** An in-memory store with the semantics of wit/store.wit. */
class MockStore {
  constructor(faults) {
    this.records = new Map();
    this.lastId = 0n;
    this.faults = faults;
  }

  run(op, f) {
    return this.faults.run(op, f);
  }

  count() {
    return this.records.size;
  }

  tamper(k, set) {
    const rec = this.records.get(keyId(k));
    if (!rec) throw new Error("no record to tamper with");
    if ("lease-until" in set) rec.leaseUntil = set["lease-until"] === null ? undefined : T0 + BigInt(set["lease-until"]);
    if ("fingerprint" in set) rec.fingerprint = str(set.fingerprint);
    if ("fingerprint-version" in set) rec.fingerprintVersion = set["fingerprint-version"];
    rec.revision += 1n;
  }

  static checkFits(r) {
    for (const [name, v] of [["fencing-token", r.fencingToken], ["revision", r.revision], ["lease-until", r.leaseUntil],
      ["created-at", r.createdAt], ["updated-at", r.updatedAt], ["expires-at", r.expiresAt]]) {
      if (v !== undefined && v !== null && v > I64_MAX) {
        throw new StoreError("rejected", `${name} is above i64::MAX, which a SQL store cannot hold`);
      }
    }
  }

  imports() {
    return {
      insertIfAbsent: (candidate) => {
        MockStore.checkFits(candidate);
        return this.run("insert-if-absent", () => {
          const existing = this.records.get(keyId(candidate.key));
          if (existing) return { tag: "existing", val: copy(existing) };
          this.lastId += 1n;
          const record = { ...copy(candidate), id: this.lastId };
          this.records.set(keyId(candidate.key), record);
          return { tag: "inserted", val: copy(record) };
        });
      },
      get: (key) => this.run("get", () => copy(this.records.get(keyId(key)))),
      compareAndSwap: (expectedRevision, replacement) => {
        MockStore.checkFits(replacement);
        return this.run("compare-and-swap", () => {
          const current = this.records.get(keyId(replacement.key));
          if (!current) return { tag: "stale", val: undefined };
          // The id as well as the revision: a re-created record starts over at revision 1.
          if (current.id !== replacement.id || current.revision !== expectedRevision) {
            return { tag: "stale", val: copy(current) };
          }
          this.records.set(keyId(replacement.key), copy(replacement));
          return { tag: "swapped" };
        });
      },
      deleteExpired: (now, limit) => this.run("delete-expired", () => {
        const expired = [...this.records.entries()]
          .filter(([, r]) => isSettled(r.status) && r.expiresAt !== undefined && r.expiresAt !== null && r.expiresAt <= now)
          .sort(([, a], [, b]) => (a.expiresAt === b.expiresAt ? cmp(a.id, b.id) : cmp(a.expiresAt, b.expiresAt)))
          .slice(0, limit);
        for (const [k] of expired) this.records.delete(k);
        return expired.length;
      }),
      listStale: (bizType, now, after, limit) => this.run("list-stale", () =>
        [...this.records.values()]
          .filter((r) => r.key.bizType === bizType)
          .filter((r) => !after || r.updatedAt > after.updatedAt || (r.updatedAt === after.updatedAt && r.id > after.id))
          .filter((r) => (r.status === "processing" && r.leaseUntil !== undefined && r.leaseUntil !== null && r.leaseUntil <= now)
            || r.status === "outcome-unknown")
          .sort((a, b) => (a.updatedAt === b.updatedAt ? cmp(a.id, b.id) : cmp(a.updatedAt, b.updatedAt)))
          .slice(0, limit)
          .map(copy)),
    };
  }
}

const cmp = (a, b) => (a < b ? -1 : a > b ? 1 : 0);

/** The package's SQLite store, one new file per scenario, behind the same fault injection. */
class SqliteBacked {
  constructor(faults) {
    this.faults = faults;
    sqliteFiles += 1;
    this.sqlite = new SqliteStore(join(sqliteDir, `scenario-${sqliteFiles}.db`));
  }

  count() {
    return this.sqlite.count();
  }

  tamper(k, set) {
    const sets = [];
    const params = [];
    if ("lease-until" in set) { sets.push("lease_until = ?"); params.push(set["lease-until"] === null ? null : T0 + BigInt(set["lease-until"])); }
    if ("fingerprint" in set) { sets.push("request_hash = ?"); params.push(str(set.fingerprint)); }
    if ("fingerprint-version" in set) { sets.push("fingerprint_version = ?"); params.push(BigInt(set["fingerprint-version"])); }
    sets.push("revision = revision + 1");
    const changed = this.sqlite.db.prepare(`UPDATE idempotency_record SET ${sets.join(", ")} WHERE scope_key = ? AND biz_type = ? AND idem_key = ?`)
      .run(...params, k.scope, k.bizType, k.idemKey).changes;
    if (changed !== 1) throw new Error("no record to tamper with");
  }

  imports() {
    const s = this.sqlite;
    return {
      insertIfAbsent: (c) => this.faults.run("insert-if-absent", () => s.insertIfAbsent(c)),
      get: (k) => this.faults.run("get", () => s.get(k)),
      compareAndSwap: (r, x) => this.faults.run("compare-and-swap", () => s.compareAndSwap(r, x)),
      deleteExpired: (n, l) => this.faults.run("delete-expired", () => s.deleteExpired(n, l)),
      listStale: (b, n, a, l) => this.faults.run("list-stale", () => s.listStale(b, n, a, l)),
    };
  }
}

/** The host side of one scenario: store, virtual clock, result lookup, and the component's instances. */
class Host {
  constructor() {
    const faults = new Faults();
    this.store = storeKind === "sqlite" ? new SqliteBacked(faults) : new MockStore(faults);
    this.faults = faults;
    this.now = T0;
    this.pauseHook = null;
    this.found = new Map();
    this.failing = false;
    this.storeImports = this.store.imports();
    this.clock = {
      now: () => this.now,
      pause: (duration) => {
        this.now += duration;
        const hook = this.pauseHook;
        this.pauseHook = null;
        if (hook) hook();
      },
    };
    this.results = {
      findResult: (key) => {
        if (this.failing) throw new StoreError("unavailable", "the business database is down");
        return this.found.get(keyId(key));
      },
    };
    this.engine = this.instance();
  }

  instance() {
    return instantiateEngine(component, { store: this.storeImports, clock: this.clock, results: this.results });
  }
}

// ------------------------------------------------------------ reading scenario values

function repeat(v) {
  return [v.repeat, Number(v.count)];
}

function str(v) {
  if (typeof v === "string") return v;
  if (v && typeof v === "object" && "repeat" in v) {
    const [item, count] = repeat(v);
    return str(item).repeat(count);
  }
  throw new Error(`expected a string, got ${JSON.stringify(v)}`);
}

function bytes(v) {
  if (v && typeof v === "object" && "hex" in v) return Uint8Array.from(Buffer.from(v.hex, "hex"));
  return new Uint8Array(Buffer.from(str(v), "utf8"));
}

function list(v) {
  if (Array.isArray(v)) return v;
  if (v && typeof v === "object" && "repeat" in v) {
    const [item, count] = repeat(v);
    return Array.from({ length: count }, () => item);
  }
  throw new Error(`expected a list, got ${JSON.stringify(v)}`);
}

function key(v) {
  if (v && typeof v === "object" && !("repeat" in v)) {
    return {
      scope: "scope" in v ? str(v.scope) : DEFAULT_SCOPE,
      bizType: "biz-type" in v ? str(v["biz-type"]) : DEFAULT_BIZ_TYPE,
      idemKey: "idem-key" in v ? str(v["idem-key"]) : "",
    };
  }
  return { scope: DEFAULT_SCOPE, bizType: DEFAULT_BIZ_TYPE, idemKey: str(v) };
}

function response(v) {
  if (v === undefined || v === null) return undefined;
  return {
    status: v.status,
    headers: list(v.headers ?? []).map(([n, b]) => [str(n), bytes(b)]),
    body: bytes(v.body ?? ""),
  };
}

const success = (v = {}) => ({
  resultRef: v["result-ref"] === undefined || v["result-ref"] === null ? undefined : str(v["result-ref"]),
  response: response(v.response),
});

const failure = (v) => ({ code: str(v.code), message: v.message === undefined ? "" : str(v.message), response: response(v.response) });

const DEFAULT_POLICY = {
  "retention-ms": 3600000, "lease-ms": 30000, "retry-after-ms": 1000, "expired-lease": "take-over",
  "outcome-unknown": "manual", "failure-mode": "honor-disposition", "max-attempts": null, "in-progress": "reject",
  "fingerprint-fields": [], "key-format": { "min-length": 1, "max-length": 255, "charset": "printable-ascii" },
  "max-body-bytes": 1048576,
};

function merge(base, over) {
  const out = { ...base, "key-format": { ...base["key-format"] } };
  for (const [k, v] of Object.entries(over ?? {})) {
    if (k === "key-format") Object.assign(out["key-format"], v);
    else out[k] = v;
  }
  return out;
}

function policy(p) {
  const ip = p["in-progress"];
  return {
    retentionMs: BigInt(p["retention-ms"]),
    leaseMs: BigInt(p["lease-ms"]),
    retryAfterMs: BigInt(p["retry-after-ms"]),
    expiredLease: p["expired-lease"],
    outcomeUnknown: p["outcome-unknown"],
    failureMode: p["failure-mode"],
    // option<u32>: null (or absent) is none.
    maxAttempts: p["max-attempts"] === null || p["max-attempts"] === undefined ? undefined : p["max-attempts"],
    inProgress: ip === "reject" ? { tag: "reject" }
      : { tag: "wait", val: { maxWaitMs: BigInt(ip.wait["max-wait-ms"]), pollIntervalMs: BigInt(ip.wait["poll-interval-ms"]) } },
    fingerprintFields: list(p["fingerprint-fields"]).map(str),
    keyFormat: { minLength: p["key-format"]["min-length"], maxLength: p["key-format"]["max-length"], charset: p["key-format"].charset },
    maxBodyBytes: p["max-body-bytes"],
  };
}

// ------------------------------------------------------------ results as JSON

const opt = (v) => (v === undefined || v === null ? null : v);
const time = (t) => (t === undefined || t === null ? null : Number(BigInt(t) - T0));

function bytesJson(b) {
  try {
    return new TextDecoder("utf-8", { fatal: true }).decode(b);
  } catch {
    return { hex: Buffer.from(b).toString("hex") };
  }
}

const responseJson = (r) => (r === undefined || r === null ? null
  : { status: r.status, headers: r.headers.map(([n, v]) => [n, bytesJson(v)]), body: bytesJson(r.body) });
const failureJson = (f) => ({ code: f.code, message: f.message, response: responseJson(f.response) });

function decisionJson(d) {
  const v = d.val;
  switch (d.tag) {
    case "execute": return {
      decision: "execute", key: { scope: v.key.scope, "biz-type": v.key.bizType, "idem-key": v.key.idemKey },
      "record-id": Number(v.recordId), "fencing-token": Number(v.fencingToken), "lease-until": time(v.leaseUntil), attempt: v.attempt,
    };
    case "replay": return { decision: "replay", "result-ref": opt(v.resultRef), response: responseJson(v.response), "completed-at": time(v.completedAt) };
    case "in-progress": return { decision: "in-progress", "retry-after-ms": Number(v.retryAfterMs), "lease-until": time(v.leaseUntil) };
    case "mismatch": return { decision: "mismatch", "stored-prefix": v.storedPrefix, "stored-version": v.storedVersion };
    case "failed": return { decision: "failed", ...failureJson(v) };
    case "outcome-unknown": return { decision: "outcome-unknown", since: time(v.since), attempts: v.attempts, failure: v.failure ? failureJson(v.failure) : null };
    case "invalid": return { decision: "invalid", field: v.field, rule: v.rule, message: v.message };
    default: throw new Error(`unknown decision ${d.tag}`);
  }
}

function errorJson(e) {
  switch (e.tag) {
    case "store": return { error: "store", kind: e.val.tag, message: e.val.val };
    case "corrupt": return { error: "corrupt", message: e.val };
    case "invalid": return { error: "invalid", field: e.val.field, rule: e.val.rule, message: e.val.message };
    default: throw new Error(`unknown engine error ${e.tag}`);
  }
}

const completionJson = (c) => (c.tag === "recorded" ? { completion: "recorded", status: c.val } : { completion: c.tag });

const statusJson = (s) => (s === undefined || s === null ? null : {
  status: s.status, "created-at": time(s.createdAt), "updated-at": time(s.updatedAt), "expires-at": time(s.expiresAt),
  "lease-until": time(s.leaseUntil), "result-ref": opt(s.resultRef), attempts: s.attempts,
  "fencing-token": Number(s.fencingToken), fingerprint: s.fingerprint, "fingerprint-version": s.fingerprintVersion, expired: s.expired,
});

const reportJson = (r) => ({
  examined: r.examined, succeeded: r.succeeded, released: r.released, "left-for-manual": r.leftForManual,
  skipped: r.skipped, "lookup-errors": r.lookupErrors,
});

/** Calls an export; an engine error (the result's err) becomes its JSON, a trap is rethrown. */
function call(f, toJson) {
  let value;
  try {
    value = f();
  } catch (e) {
    if (e && typeof e === "object" && "payload" in e) return errorJson(e.payload);
    throw e;
  }
  return toJson(value);
}

// ------------------------------------------------------------ matching

function check(expected, actual, saved, path) {
  if (expected !== null && typeof expected === "object" && !Array.isArray(expected)) {
    if ("$contains" in expected) {
      if (typeof actual !== "string" || !actual.includes(expected.$contains)) {
        throw new Error(`${path}: expected a string containing ${JSON.stringify(expected.$contains)}, got ${JSON.stringify(actual)}`);
      }
      return;
    }
    if ("$ref" in expected) {
      const [name, ...parts] = expected.$ref.split(".");
      if (!(name in saved)) throw new Error(`${path}: nothing saved as ${name}`);
      let target = saved[name];
      for (const p of parts) target = target?.[p];
      if (JSON.stringify(target) !== JSON.stringify(actual)) {
        throw new Error(`${path}: expected ${expected.$ref} = ${JSON.stringify(target)}, got ${JSON.stringify(actual)}`);
      }
      return;
    }
    if (actual === null || typeof actual !== "object" || Array.isArray(actual)) {
      throw new Error(`${path}: expected ${JSON.stringify(expected)}, got ${JSON.stringify(actual)}`);
    }
    for (const [k, v] of Object.entries(expected)) {
      if (!(k in actual)) throw new Error(`${path}.${k}: missing in ${JSON.stringify(actual)}`);
      check(v, actual[k], saved, `${path}.${k}`);
    }
    return;
  }
  if (Array.isArray(expected) && Array.isArray(actual)) {
    if (expected.length !== actual.length) throw new Error(`${path}: expected ${JSON.stringify(expected)}, got ${JSON.stringify(actual)}`);
    expected.forEach((e, i) => check(e, actual[i], saved, `${path}[${i}]`));
    return;
  }
  if (expected !== actual) throw new Error(`${path}: expected ${JSON.stringify(expected)}, got ${JSON.stringify(actual)}`);
}

// ------------------------------------------------------------ running

class Ctx {
  constructor(host, scenarioPolicy) {
    this.host = host;
    this.engine = host.engine;
    this.policyJson = merge(DEFAULT_POLICY, scenarioPolicy);
    this.saved = {};
    this.tickets = {};
  }

  policy(step) {
    return policy(merge(this.policyJson, step.policy));
  }

  ticket(step) {
    const t = this.tickets[step.ticket];
    if (!t) throw new Error(`no ticket saved as ${step.ticket}`);
    const o = step["ticket-override"] ?? {};
    return {
      ...t,
      fencingToken: "fencing-token" in o ? BigInt(o["fencing-token"]) : t.fencingToken,
      recordId: "record-id" in o ? BigInt(o["record-id"]) : t.recordId,
    };
  }

  step(step) {
    const e = this.engine;
    switch (step.op) {
      case "begin": {
        const req = {
          key: key(step.key),
          attributes: list(step.attributes ?? []).map(([n, v]) => [str(n), str(v)]),
          bodyKind: step["body-kind"] ?? "json",
          body: bytes(step.body ?? "{}"),
          policy: this.policy(step),
        };
        const errors = this.armPauseHook(step);
        let decision;
        const result = call(() => (decision = e.begin(req)), decisionJson);
        this.host.pauseHook = null;
        if (errors && errors.length) throw new Error(`during the first pause: ${errors.join("; ")}`);
        if (decision?.tag === "execute" && step.save) this.tickets[step.save] = decision.val;
        return result;
      }
      case "complete":
        return call(() => e.complete(this.ticket(step), this.policy(step), success(step.success)), completionJson);
      case "fail":
        return call(() => e.fail(this.ticket(step), this.policy(step), failure(step.failure), step.disposition), completionJson);
      case "extend":
        return call(() => e.extend(this.ticket(step), this.policy(step)),
          (x) => (x.tag === "extended" ? { extension: "extended", "lease-until": time(x.val) } : { extension: x.tag }));
      case "reconcile":
        return call(() => e.reconcile(step["biz-type"] === undefined ? DEFAULT_BIZ_TYPE : str(step["biz-type"]), this.policy(step), step.limit ?? 100), reportJson);
      case "sweep":
        return call(() => e.sweep(step.limit ?? 100), (n) => ({ deleted: n }));
      case "inspect":
        return call(() => e.inspect(key(step.key)), statusJson);
      case "records":
        return { count: this.host.store.count() };
      case "clock":
        if ("advance" in step) this.host.now += BigInt(step.advance);
        else this.host.now = T0 + BigInt(step.set);
        return undefined;
      case "fault":
        this.host.faults.inject(step["store-op"] === "any" ? null : step["store-op"], step.kind, step.count ?? 1);
        return undefined;
      case "results":
        // The success the lookup answers (find-result's option<success>), in the
        // package's shape; host.js converts it as complete's.
        if (step.found) this.host.found.set(keyId(key(step.found.key)), { resultRef: str(step.found["result-ref"]) });
        if (typeof step.failing === "boolean") this.host.failing = step.failing;
        return undefined;
      case "tamper":
        this.host.store.tamper(key(step.key), step.set);
        return undefined;
      default:
        throw new Error(`unknown op ${step.op}`);
    }
  }

  /** For `during-first-pause`: its steps run on a second instance over the same host. */
  armPauseHook(step) {
    if (!step["during-first-pause"]) return null;
    const second = Object.assign(new Ctx(this.host, {}), this, { engine: this.host.instance() });
    const errors = [];
    this.host.pauseHook = () => {
      for (const s of step["during-first-pause"]) {
        try {
          second.run(s);
        } catch (err) {
          errors.push(err.message);
        }
      }
    };
    return errors;
  }

  run(step) {
    let result;
    try {
      result = this.step(step);
    } catch (err) {
      throw new Error(`${step.op}: ${err.message}`);
    }
    if (result !== undefined) {
      if ("expect" in step) check(step.expect, result, this.saved, step.op);
      if (step.save) this.saved[step.save] = result;
    }
  }
}

function runScenario(scenario) {
  const ctx = new Ctx(new Host(), scenario.policy);
  scenario.steps.forEach((step, i) => {
    try {
      ctx.run(step);
    } catch (err) {
      throw new Error(`step ${i + 1}: ${err.message}`);
    }
  });
}

/** The fingerprint version the vectors are for: the component's current one. */
const FINGERPRINT_VERSION = 2;

/** The version-2 fingerprint, computed here with node:crypto, independently of the guest. */
function fingerprint(attributes, raw, form) {
  const h = createHash("sha256");
  const u32 = (n) => { const b = Buffer.alloc(4); b.writeUInt32BE(n); return b; };
  const u64 = (n) => { const b = Buffer.alloc(8); b.writeBigUInt64BE(BigInt(n)); return b; };
  h.update(Buffer.from(`idem-fp/${FINGERPRINT_VERSION}\0`, "latin1"));
  h.update(u32(attributes.length));
  for (const [n, v] of attributes) {
    const nb = Buffer.from(n, "utf8");
    const vb = Buffer.from(v, "utf8");
    h.update(u32(nb.length)); h.update(nb); h.update(u32(vb.length)); h.update(vb);
  }
  h.update(Buffer.from(raw ? "R" : "J"));
  h.update(u64(form.length));
  h.update(form);
  return h.digest("hex");
}

function runPair(pair) {
  const ctx = new Ctx(new Host(), {});
  const digests = [];
  for (const side of ["a", "b"]) {
    const r = pair[side];
    const attributes = list(r.attributes ?? []).map(([n, v]) => [str(n), str(v)]);
    const mine = fingerprint(attributes, r["body-kind"] === "raw", bytes(r.canonical));
    if (mine !== r.sha256) throw new Error(`${side}: sha256 is ${r.sha256}, this host computes ${mine}`);
    const k = `fp-${side}`;
    ctx.run({ op: "begin", key: k, attributes: r.attributes ?? [], "body-kind": r["body-kind"], body: r.body,
      policy: { "fingerprint-fields": r["fingerprint-fields"] ?? [] }, expect: { decision: "execute" } });
    try {
      ctx.run({ op: "inspect", key: k, expect: { fingerprint: r.sha256 } });
    } catch (err) {
      throw new Error(`${side}: the component's fingerprint differs: ${err.message}`);
    }
    digests.push(mine);
  }
  if ((digests[0] === digests[1]) !== (pair.expect === "same")) {
    throw new Error(`expected ${pair.expect}, the digests are ${digests.join(", ")}`);
  }
}

console.log(`component sha256 ${createHash("sha256").update(wasm).digest("hex")} (${wasm.length} bytes); host node ${process.version} with jco; store ${storeKind === "sqlite" ? "SQLite (the package's)" : "mock"}`);
let passed = 0;
let failed = 0;
const tally = (name, f) => {
  try {
    f();
    passed += 1;
  } catch (err) {
    failed += 1;
    console.log(`FAIL [node, ${storeKind}] ${name}: ${err.message}`);
  }
};
const dir = join(conformance, "scenarios");
for (const file of readdirSync(dir).filter((f) => f.endsWith(".json")).sort()) {
  for (const s of JSON.parse(readFileSync(join(dir, file), "utf8")).scenarios) tally(s.name, () => runScenario(s));
}
const vectors = JSON.parse(readFileSync(join(conformance, "fingerprints.json"), "utf8"));
if (vectors.version !== FINGERPRINT_VERSION) {
  throw new Error(`fingerprints.json is for version ${vectors.version}, this runner computes version ${FINGERPRINT_VERSION}`);
}
for (const p of vectors.pairs) {
  tally(`fingerprint ${p.name}`, () => runPair(p));
}
console.log(`${passed} passed, ${failed} failed`);
if (sqliteDir) rmSync(sqliteDir, { recursive: true, force: true });
process.exit(failed > 0 || passed === 0 ? 1 : 0);
