// makeIdempotent: a Powertools-style wrapper for any async function.

/** The base of every error makeIdempotent throws instead of running the function. */
export class IdempotencyError extends Error {
  constructor(message, props = {}) {
    super(message);
    this.name = this.constructor.name;
    Object.assign(this, props);
  }
}
/** Another call with the same key is running: retry after `retryAfterMs`. */
export class IdempotencyInProgressError extends IdempotencyError {}
/** The key was used with other arguments (a different fingerprint). */
export class IdempotencyKeyMismatchError extends IdempotencyError {}
/** An earlier call with the key failed for good: `code`, `failureMessage`. */
export class IdempotencyFailedError extends IdempotencyError {}
/** An earlier attempt may or may not have taken effect; nothing ran. */
export class IdempotencyOutcomeUnknownError extends IdempotencyError {}
/** The key or the arguments broke a rule: `field` and `rule` name it. */
export class IdempotencyValidationError extends IdempotencyError {}
/** The function ran, but its lease was taken over: its result (`result`) was not stored. */
export class IdempotencyLostOwnershipError extends IdempotencyError {}

const JSON_HEADERS = [["content-type", Buffer.from("application/json")]];

/**
 * Wraps `fn` so that calls with the same key run it once and replay its
 * result (like Powertools' `makeIdempotent`).
 *
 * @param {(...args: any[]) => Promise<any>|any} fn
 * @param {{
 *   idem: import("./engine.js").Idem,
 *   bizType: string,
 *   key: (...args: any[]) => string,
 *   scope?: string | ((...args: any[]) => string),
 *   fingerprint?: (...args: any[]) => any,
 *   policy?: object,
 *   classify?: (error: any) => "retryable" | "final" | "outcome-unknown",
 *   resultRef?: (result: any) => string | undefined,
 * }} options `key` selects the idempotency key from the arguments;
 *   `fingerprint` selects what must be equal for a replay (default: all
 *   arguments, as JSON); `classify` decides what a thrown error means
 *   (default "retryable": the next call runs again).
 */
export function makeIdempotent(fn, options) {
  if (typeof fn !== "function") throw new TypeError("makeIdempotent: fn must be a function");
  const { idem, bizType, key, scope = "default", fingerprint = (...args) => args, policy = {}, classify = () => "retryable", resultRef } = options ?? {};
  if (!idem || typeof idem.begin !== "function") throw new TypeError("makeIdempotent: options.idem must be an Idem instance");
  if (typeof bizType !== "string") throw new TypeError("makeIdempotent: options.bizType must be a string, e.g. \"order.create\"");
  if (typeof key !== "function") throw new TypeError("makeIdempotent: options.key must be a function that returns the idempotency key from the arguments");
  return async function idempotent(...args) {
    const k = key(...args);
    if (typeof k !== "string") throw new IdempotencyValidationError(`options.key returned ${typeof k}, not a string`, { field: "idem-key", rule: "required" });
    const s = typeof scope === "function" ? scope(...args) : scope;
    // The fingerprinted value always as its JSON text, a string too.
    const fp = Buffer.from(JSON.stringify(fingerprint(...args) ?? null), "utf8");
    const d = idem.begin({ scope: s, bizType, key: k, body: fp, bodyKind: "json", policy });
    switch (d.decision) {
      case "execute": break;
      case "replay": {
        if (!d.response) return undefined;
        const text = d.response.body.toString("utf8");
        return text === "" ? undefined : JSON.parse(text);
      }
      case "in-progress":
        throw new IdempotencyInProgressError(`a call with idempotency key ${JSON.stringify(k)} is in progress; retry after ${d.retryAfterMs} ms`, { retryAfterMs: d.retryAfterMs });
      case "mismatch":
        throw new IdempotencyKeyMismatchError(`idempotency key ${JSON.stringify(k)} was already used with other arguments`, { storedPrefix: d.storedPrefix });
      case "failed":
        throw new IdempotencyFailedError(`the call with idempotency key ${JSON.stringify(k)} failed for good: ${d.failure.code}: ${d.failure.message}`, { code: d.failure.code, failureMessage: d.failure.message });
      case "outcome-unknown":
        throw new IdempotencyOutcomeUnknownError(`the outcome of the call with idempotency key ${JSON.stringify(k)} is unknown; it is not run again until it is settled`, { since: d.since, attempts: d.attempts });
      case "invalid":
        throw new IdempotencyValidationError(d.message, { field: d.field, rule: d.rule });
      default:
        throw new Error(`unknown decision ${d.decision}`);
    }
    const ticket = d.ticket;
    let result;
    try {
      result = await fn(...args);
    } catch (err) {
      const disposition = classify(err);
      const code = String(err?.code ?? err?.name ?? "error").slice(0, 128) || "error";
      idem.fail(ticket, policy, { code, message: String(err?.message ?? err).slice(0, 4096) }, disposition);
      throw err;
    }
    const body = result === undefined ? Buffer.alloc(0) : Buffer.from(JSON.stringify(result), "utf8");
    const ref = resultRef ? resultRef(result) : undefined;
    const c = idem.complete(ticket, policy, { resultRef: ref, response: { status: 200, headers: JSON_HEADERS, body } });
    if (c.completion === "lost-ownership") {
      throw new IdempotencyLostOwnershipError(`the call with idempotency key ${JSON.stringify(k)} ran, but its lease was taken over; its result was not stored`, { result });
    }
    return result;
  };
}
