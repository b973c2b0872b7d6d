// The host side of the engine component: loading the jco-transpiled
// component, the import namespaces (store, clock, results), the policy in the
// Rust crate's field names, and the conversion of the component's answers.
//
// The conformance runner (tests/conformance/node/run.mjs) builds its mock
// store on these functions: there is one copy of the marshalling.

import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const dist = join(dirname(fileURLToPath(import.meta.url)), "..", "dist");

/** The largest integer a SQL column holds. */
export const I64_MAX = (1n << 63n) - 1n;

/**
 * A store failure, as the `store-error` variant of `wit/store.wit`.
 * `kind` is `unavailable`, `rejected` or `internal`.
 */
export class StoreError extends Error {
  /** @param {"unavailable"|"rejected"|"internal"} kind @param {string} message */
  constructor(kind, message) {
    super(`store ${kind}: ${message}`);
    this.name = "StoreError";
    this.kind = kind;
    /** What jco lowers as the `err` case of the import's result. */
    this.payload = { tag: kind, val: message };
  }
}

/**
 * Why the engine could not decide (`engine-error`): `kind` is `store`,
 * `corrupt` or `invalid`. A store failure is never read as "no record".
 */
export class EngineError extends Error {
  constructor(payload) {
    const v = payload.val;
    let message;
    if (payload.tag === "store") message = `the store failed (${v.tag}): ${v.val}`;
    else if (payload.tag === "corrupt") message = `a stored record is corrupt: ${v}`;
    else message = `invalid input: ${v.message} (field ${v.field}, rule ${v.rule})`;
    super(message);
    this.name = "EngineError";
    this.kind = payload.tag;
    this.storeKind = payload.tag === "store" ? v.tag : undefined;
    this.field = payload.tag === "invalid" ? v.field : undefined;
    this.rule = payload.tag === "invalid" ? v.rule : undefined;
  }
}

/**
 * Loads a component transpiled by jco (`jco transpile --instantiation sync
 * --name idem`) from `dir`: `{ instantiate, getCoreModule, dir }`.
 * The package's own is in dist/.
 */
export async function loadComponent(dir = dist) {
  let mod;
  try {
    mod = await import(pathToFileURL(join(dir, "idem.js")).href);
  } catch (e) {
    throw new Error(`idem: no transpiled component in ${dir} (build it with scripts/build.js): ${e.message}`);
  }
  const cache = new Map();
  const getCoreModule = (name) => {
    let m = cache.get(name);
    if (!m) {
      m = new WebAssembly.Module(readFileSync(join(dir, name)));
      cache.set(name, m);
    }
    return m;
  };
  return { instantiate: mod.instantiate, getCoreModule, dir };
}

/** The SHA-256 and size of the component this package ships. */
export function componentInfo() {
  return JSON.parse(readFileSync(join(dist, "component.json"), "utf8"));
}

/** Any error that is not a StoreError becomes an `internal` one: never "no record". */
function guard(op, f) {
  return (...args) => {
    try {
      return f(...args);
    } catch (e) {
      if (e instanceof StoreError || (e && typeof e === "object" && "payload" in e)) throw e;
      throw new StoreError("internal", `${op}: ${e && e.message ? e.message : String(e)}`);
    }
  };
}

/**
 * Instantiates `component` (from loadComponent) over `store` (an object with
 * insertIfAbsent, get, compareAndSwap, deleteExpired and listStale, in jco's
 * shapes; listStale(bizType, now, after, limit) gets `after` undefined or
 * the { updatedAt, id } of the last record of the page before), `clock`
 * ({ now(): bigint, pause(ms: bigint) }) and `results` ({ findResult(key) },
 * answering as `foundIn` reads). Returns the raw `engine` export.
 */
export function instantiateEngine(component, { store, clock, results }) {
  const s = {
    insertIfAbsent: guard("insert-if-absent", (c) => store.insertIfAbsent(c)),
    get: guard("get", (k) => store.get(k)),
    compareAndSwap: guard("compare-and-swap", (r, x) => store.compareAndSwap(r, x)),
    deleteExpired: guard("delete-expired", (n, l) => store.deleteExpired(n, l)),
    listStale: guard("list-stale", (b, n, a, l) => store.listStale(b, n, a, l)),
  };
  const c = { now: () => BigInt(clock.now()), pause: (d) => clock.pause(d) };
  const r = { findResult: guard("find-result", (k) => foundIn(results.findResult(k))) };
  const imports = {
    "idem:engine/store": s, "idem:engine/store@0.4.0": s,
    "idem:engine/clock": c, "idem:engine/clock@0.4.0": c,
    "idem:engine/results": r, "idem:engine/results@0.4.0": r,
    "idem:engine/types": {}, "idem:engine/types@0.4.0": {},
  };
  const exports = component.instantiate(component.getCoreModule, imports);
  return exports.engine ?? exports["idem:engine/engine@0.4.0"];
}

// ------------------------------------------------------------ policy

/** The Rust `Policy::default()`, in its field names. */
export const DEFAULT_POLICY = Object.freeze({
  retention_ms: 86_400_000,
  lease_ms: 60_000,
  retry_after_ms: 1_000,
  expired_lease: "take-over",
  outcome_unknown: "manual",
  failure_mode: "honor-disposition",
  max_attempts: null,
  in_progress: "reject",
  fingerprint_fields: [],
  key_format: Object.freeze({ min_length: 1, max_length: 255, charset: "printable-ascii" }),
  max_body_bytes: 1_048_576,
});

const POLICY_FIELDS = new Set(Object.keys(DEFAULT_POLICY));
const ENUMS = {
  expired_lease: ["take-over", "reconcile", "manual"],
  outcome_unknown: ["take-over", "reconcile", "manual"],
  failure_mode: ["honor-disposition", "always-final"],
  charset: ["printable-ascii", "uuid", "token"],
};

function uint(path, v, max) {
  if (typeof v === "bigint") {
    if (v < 0n || v > max) throw new TypeError(`policy.${path} must be an integer from 0 to ${max}, got ${v}`);
    return v;
  }
  if (!Number.isSafeInteger(v) || v < 0) {
    throw new TypeError(`policy.${path} must be a non-negative integer, got ${JSON.stringify(v)}`);
  }
  if (BigInt(v) > max) throw new TypeError(`policy.${path} must be at most ${max}, got ${v}`);
  return BigInt(v);
}

function oneOf(path, v, allowed) {
  if (!allowed.includes(v)) {
    throw new TypeError(`policy.${path} must be one of ${allowed.map((a) => JSON.stringify(a)).join(", ")}, got ${JSON.stringify(v)}`);
  }
  return v;
}

/**
 * A policy in the Rust crate's field names (snake_case, enum values in
 * kebab-case, `max_attempts` as null for no limit, `in_progress` as
 * `"reject"` or `{ wait: { max_wait_ms, poll_interval_ms } }`), merged over
 * the defaults and converted to the component's shape. Unknown fields and
 * wrong types are refused, naming the field and the rule; value ranges are
 * the engine's to check.
 */
export function toWitPolicy(policy = {}) {
  if (policy === null || typeof policy !== "object") throw new TypeError("policy must be an object");
  for (const k of Object.keys(policy)) {
    if (!POLICY_FIELDS.has(k)) throw new TypeError(`policy.${k} is not a policy field (the fields are ${[...POLICY_FIELDS].join(", ")})`);
  }
  const p = { ...DEFAULT_POLICY, ...policy, key_format: { ...DEFAULT_POLICY.key_format, ...(policy.key_format ?? {}) } };
  for (const k of Object.keys(policy.key_format ?? {})) {
    if (!(k in DEFAULT_POLICY.key_format)) throw new TypeError(`policy.key_format.${k} is not a key_format field (min_length, max_length, charset)`);
  }
  const U64 = (1n << 64n) - 1n;
  const U32 = 0xffffffffn;
  let inProgress;
  if (p.in_progress === "reject") inProgress = { tag: "reject" };
  else if (p.in_progress && typeof p.in_progress === "object" && p.in_progress.wait && typeof p.in_progress.wait === "object") {
    const w = p.in_progress.wait;
    inProgress = { tag: "wait", val: { maxWaitMs: uint("in_progress.wait.max_wait_ms", w.max_wait_ms, U64), pollIntervalMs: uint("in_progress.wait.poll_interval_ms", w.poll_interval_ms, U64) } };
  } else {
    throw new TypeError(`policy.in_progress must be "reject" or { wait: { max_wait_ms, poll_interval_ms } }, got ${JSON.stringify(p.in_progress)}`);
  }
  if (!Array.isArray(p.fingerprint_fields) || p.fingerprint_fields.some((f) => typeof f !== "string")) {
    throw new TypeError("policy.fingerprint_fields must be an array of strings (JSON Pointers)");
  }
  return {
    retentionMs: uint("retention_ms", p.retention_ms, U64),
    leaseMs: uint("lease_ms", p.lease_ms, U64),
    retryAfterMs: uint("retry_after_ms", p.retry_after_ms, U64),
    expiredLease: oneOf("expired_lease", p.expired_lease, ENUMS.expired_lease),
    outcomeUnknown: oneOf("outcome_unknown", p.outcome_unknown, ENUMS.outcome_unknown),
    failureMode: oneOf("failure_mode", p.failure_mode, ENUMS.failure_mode),
    maxAttempts: p.max_attempts === null || p.max_attempts === undefined ? undefined : Number(uint("max_attempts", p.max_attempts, U32)),
    inProgress,
    fingerprintFields: [...p.fingerprint_fields],
    keyFormat: {
      minLength: Number(uint("key_format.min_length", p.key_format.min_length, U32)),
      maxLength: Number(uint("key_format.max_length", p.key_format.max_length, U32)),
      charset: oneOf("key_format.charset", p.key_format.charset, ENUMS.charset),
    },
    maxBodyBytes: Number(uint("max_body_bytes", p.max_body_bytes, U32)),
  };
}

// ------------------------------------------------------------ answers

const num = (t) => (t === undefined || t === null ? null : Number(t));

function responseOut(r) {
  if (r === undefined || r === null) return null;
  return { status: r.status, headers: r.headers.map(([n, v]) => [n, Buffer.from(v)]), body: Buffer.from(r.body) };
}

function failureOut(f) {
  return { code: f.code, message: f.message, response: responseOut(f.response) };
}

/**
 * The component's decision as a plain object with a `decision` tag:
 * execute (with `ticket`), replay, in-progress, mismatch, failed,
 * outcome-unknown or invalid. Times are numbers of milliseconds.
 */
export function decisionOut(d) {
  const v = d.val;
  switch (d.tag) {
    case "execute": return { decision: "execute", ticket: v, fencingToken: Number(v.fencingToken), attempt: v.attempt, leaseUntil: num(v.leaseUntil) };
    case "replay": return { decision: "replay", resultRef: v.resultRef ?? null, response: responseOut(v.response), completedAt: num(v.completedAt) };
    case "in-progress": return { decision: "in-progress", retryAfterMs: Number(v.retryAfterMs), leaseUntil: num(v.leaseUntil) };
    case "mismatch": return { decision: "mismatch", storedPrefix: v.storedPrefix, storedVersion: v.storedVersion };
    case "failed": return { decision: "failed", failure: failureOut(v) };
    case "outcome-unknown": return { decision: "outcome-unknown", since: num(v.since), attempts: v.attempts, failure: v.failure ? failureOut(v.failure) : null };
    case "invalid": return { decision: "invalid", field: v.field, rule: v.rule, message: v.message };
    default: throw new Error(`unknown decision ${d.tag}`);
  }
}

/**
 * The component's answer to `complete` and `fail` as a plain object with a
 * `completion` tag: `{ completion: "recorded", status }`, `status` being the
 * key's status now ("succeeded" after complete; "released", "failed" or
 * "outcome-unknown" after fail), or `{ completion: "lost-ownership" }`.
 */
export function completionOut(c) {
  switch (c.tag) {
    case "recorded": return { completion: "recorded", status: c.val };
    case "lost-ownership": return { completion: "lost-ownership" };
    default: throw new Error(`unknown completion ${c.tag}`);
  }
}

/** Calls an export; the component's `engine-error` becomes an EngineError. */
export function callEngine(f) {
  try {
    return f();
  } catch (e) {
    if (e && typeof e === "object" && "payload" in e && e.payload && typeof e.payload.tag === "string") throw new EngineError(e.payload);
    throw e;
  }
}

/**
 * A success as the component wants it (`complete`'s argument, and the
 * result a lookup found): `{ resultRef?, response? }`, the response as
 * `responseIn` reads it (`what` names it in errors).
 */
export function successIn({ resultRef, response } = {}, what = "response") {
  return { resultRef: resultRef ?? undefined, response: responseIn(response, what) };
}

/**
 * What `results.findResult(key)` answered, as jco's `option<success>`:
 * undefined or null (surely no result) is none; a string is a success with
 * that result reference; an object `{ resultRef?, response? }` is the
 * success, converted as `complete`'s (`successIn`). Anything else, or a
 * response that breaks complete's rules, throws: the lookup failed.
 */
export function foundIn(found) {
  if (found === undefined || found === null) return undefined;
  if (typeof found === "string") return successIn({ resultRef: found });
  if (typeof found === "object") return successIn(found, "findResult().response");
  throw new TypeError(`findResult must return undefined, a string or { resultRef, response }, got ${typeof found}`);
}

/** A response as the component wants it: bytes as Uint8Array. */
export function responseIn(r, what = "response") {
  if (r === undefined || r === null) return undefined;
  if (!Number.isInteger(r.status) || r.status < 100 || r.status > 599) throw new TypeError(`${what}.status must be an integer from 100 to 599, got ${JSON.stringify(r.status)}`);
  return {
    status: r.status,
    headers: (r.headers ?? []).map(([n, v]) => [String(n), toBytes(v, `${what}.headers`)]),
    body: toBytes(r.body ?? new Uint8Array(0), `${what}.body`),
  };
}

/** Bytes from a Uint8Array, a Buffer or a string (UTF-8). */
export function toBytes(v, what) {
  if (v instanceof Uint8Array) return v;
  if (typeof v === "string") return new Uint8Array(Buffer.from(v, "utf8"));
  throw new TypeError(`${what} must be a Uint8Array, a Buffer or a string`);
}
