// The engine API for Node: one instance of the idem engine component over a
// store, a clock and a result lookup.

import { callEngine, completionOut, decisionOut, instantiateEngine, loadComponent, responseIn, successIn, toBytes, toWitPolicy } from "./host.js";

/** The component this package ships, loaded once per process. */
const component = await loadComponent();

/** The real clock: milliseconds since the epoch; `pause` blocks the thread. */
export const systemClock = Object.freeze({
  now: () => BigInt(Date.now()),
  pause: (ms) => Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, Number(ms)),
});

/** A clock that moves only when told: for tests (the engine never sleeps on it). */
export class ManualClock {
  /** @param {number|bigint} now milliseconds since the epoch */
  constructor(now) {
    this.ms = BigInt(now);
  }

  now() {
    return this.ms;
  }

  /** A bounded wait on this clock advances it instead of sleeping. */
  pause(ms) {
    this.ms += BigInt(ms);
  }

  /** @param {number|bigint} ms */
  advance(ms) {
    this.ms += BigInt(ms);
  }

  /** @param {number|bigint} ms */
  set(ms) {
    this.ms = BigInt(ms);
  }
}

const noResults = Object.freeze({ findResult: () => undefined });
const DISPOSITIONS = ["retryable", "final", "outcome-unknown"];

function keyIn(k, what = "key") {
  if (k === null || typeof k !== "object") throw new TypeError(`${what} must be { scope, bizType, key }`);
  for (const f of ["scope", "bizType", "key"]) {
    if (typeof k[f] !== "string") throw new TypeError(`${what}.${f} must be a string, got ${JSON.stringify(k[f])}`);
  }
  return { scope: k.scope, bizType: k.bizType, idemKey: k.key };
}

/**
 * The idem engine in this process: every decision is the component's.
 *
 * ```js
 * const idem = new Idem({ store: new SqliteStore("idem.db") });
 * const d = idem.begin({ scope: "tenant-1", bizType: "order.create", key: "k1", body: { sku: "A1" } });
 * ```
 */
export class Idem {
  /**
   * @param {{ store: object, clock?: { now(): bigint|number, pause(ms: bigint): void },
   *           results?: { findResult(key: { scope: string, bizType: string, idemKey: string }):
   *             undefined | null | string | { resultRef?: string, response?: object } } }} options
   *
   * `results.findResult` is the business lookup of `expired_lease` /
   * `outcome_unknown: "reconcile"` and `reconcile()`: undefined or null when
   * surely no result exists, the result reference (a string), or
   * `{ resultRef, response }` as given to `complete` (the response is then
   * replayed to duplicates). Throw a StoreError when unsure. A result that
   * breaks complete's rules is a failed lookup: nothing is stored.
   */
  constructor({ store, clock = systemClock, results = noResults } = {}) {
    if (!store) throw new TypeError("Idem: options.store is required (e.g. new SqliteStore(path))");
    this.store = store;
    this.clock = clock;
    this.engine = instantiateEngine(component, { store, clock, results });
  }

  /**
   * Decides what to do with a request. `body` is bytes (raw, unless
   * `bodyKind: "json"`), a string, or any other value, which is sent as
   * its JSON text. `policy` uses the Rust `Policy` field names.
   * Returns `{ decision, ... }`; throws EngineError when the engine could not decide.
   */
  begin({ scope, bizType, key, attributes = [], body = new Uint8Array(0), bodyKind, policy } = {}) {
    const k = keyIn({ scope, bizType, key }, "begin");
    let kind = bodyKind;
    let bytes;
    if (body instanceof Uint8Array) bytes = body;
    else if (typeof body === "string") bytes = toBytes(body);
    else {
      bytes = new Uint8Array(Buffer.from(JSON.stringify(body ?? null), "utf8"));
      kind = kind ?? "json";
    }
    kind = kind ?? "raw";
    if (kind !== "json" && kind !== "raw") throw new TypeError(`begin: bodyKind must be "json" or "raw", got ${JSON.stringify(kind)}`);
    if (!Array.isArray(attributes) || attributes.some((a) => !Array.isArray(a) || a.length !== 2 || typeof a[0] !== "string" || typeof a[1] !== "string")) {
      throw new TypeError("begin: attributes must be an array of [name, value] string pairs");
    }
    const req = { key: k, attributes, bodyKind: kind, body: bytes, policy: toWitPolicy(policy) };
    return callEngine(() => decisionOut(this.engine.begin(req)));
  }

  /**
   * Stores the success of the action owned by `ticket`:
   * `{ completion: "recorded", status: "succeeded" }` or
   * `{ completion: "lost-ownership" }` (nothing was written).
   */
  complete(ticket, policy, { resultRef, response } = {}) {
    const success = successIn({ resultRef, response });
    return callEngine(() => completionOut(this.engine.complete(ticket, toWitPolicy(policy), success)));
  }

  /**
   * Stores a failure with its disposition ("retryable", "final",
   * "outcome-unknown"): `{ completion: "recorded", status }` with the status
   * the key was left in, or `{ completion: "lost-ownership" }`. The status
   * follows the policy, not only the disposition: a retryable failure is
   * "released" (the next request executes again), or "failed" under
   * `failure_mode: "always-final"` or once the attempt reaches `max_attempts`.
   */
  fail(ticket, policy, { code, message = "", response } = {}, disposition = "retryable") {
    if (!DISPOSITIONS.includes(disposition)) throw new TypeError(`fail: disposition must be one of ${DISPOSITIONS.join(", ")}, got ${JSON.stringify(disposition)}`);
    if (typeof code !== "string") throw new TypeError("fail: failure.code must be a string");
    const failure = { code, message: String(message), response: responseIn(response) };
    return callEngine(() => completionOut(this.engine.fail(ticket, toWitPolicy(policy), failure, disposition)));
  }

  /** Extends the lease: `{ extended: true, leaseUntil }` or `{ extended: false }` (lost ownership). */
  extend(ticket, policy) {
    const x = callEngine(() => this.engine.extend(ticket, toWitPolicy(policy)));
    return x.tag === "extended" ? { extended: true, leaseUntil: Number(x.val) } : { extended: false };
  }

  /** Settles up to `limit` stale records of `bizType`; returns the report. */
  reconcile(bizType, policy, limit = 100) {
    return callEngine(() => this.engine.reconcile(bizType, toWitPolicy(policy), limit));
  }

  /** Deletes up to `limit` settled records past retention; returns how many. */
  sweep(limit = 100) {
    return callEngine(() => this.engine.sweep(limit));
  }

  /** The status of one key, or null. */
  inspect({ scope, bizType, key }) {
    const s = callEngine(() => this.engine.inspect(keyIn({ scope, bizType, key }, "inspect")));
    if (!s) return null;
    const n = (t) => (t === undefined ? null : Number(t));
    return {
      status: s.status, createdAt: n(s.createdAt), updatedAt: n(s.updatedAt), expiresAt: n(s.expiresAt),
      leaseUntil: n(s.leaseUntil), resultRef: s.resultRef ?? null, attempts: s.attempts,
      fencingToken: Number(s.fencingToken), fingerprint: s.fingerprint, fingerprintVersion: s.fingerprintVersion, expired: s.expired,
    };
  }
}
