// The HTTP middleware for Express (and any (req, res, next) framework on
// Node's http): the proxy's rules, status for status.

import { EngineError } from "./host.js";
import {
  IDEMPOTENT_REPLAYED, MAX_STORED_BODY_BYTES, MAX_STORED_HEADERS, authScope, bodyKind, classifyStatus,
  isHopByHop, isSafeMethod, needsKeyByDefault, parseIdempotencyKey, problems,
} from "./http.js";
import { DEFAULT_POLICY } from "./host.js";

const CRASHED = Symbol("idem.crashed");

function send(res, { status, headers, body }) {
  res.statusCode = status;
  for (const [n, v] of headers) res.setHeader(n, v);
  res.setHeader("content-length", String(body.length));
  res.end(body);
}

function replay(res, stored) {
  res.statusCode = stored.status;
  const grouped = new Map();
  for (const [n, v] of stored.headers) {
    if (n.toLowerCase() === IDEMPOTENT_REPLAYED) continue;
    const list = grouped.get(n.toLowerCase()) ?? [];
    list.push(Buffer.from(v).toString("latin1"));
    grouped.set(n.toLowerCase(), list);
  }
  for (const [n, vs] of grouped) res.setHeader(n, vs.length === 1 ? vs[0] : vs);
  res.setHeader(IDEMPOTENT_REPLAYED, "true");
  res.setHeader("content-length", String(stored.body.length));
  res.end(stored.body);
}

function readBody(req, limit) {
  return new Promise((resolve, reject) => {
    const chunks = [];
    let size = 0;
    let over = false;
    req.on("data", (c) => {
      size += c.length;
      if (size > limit) over = true;
      else chunks.push(c);
    });
    req.on("end", () => resolve(over ? null : Buffer.concat(chunks)));
    req.on("error", reject);
  });
}

/**
 * The idempotency middleware: mount it before the routes it guards (and
 * before body parsers: it reads the body itself, then sets `req.body` to the
 * parsed JSON or the raw Buffer, and `req.rawBody`).
 *
 * @param {{ idem: import("./engine.js").Idem, bizType?: string, policy?: object,
 *           key?: "required" | "optional", serverErrors?: "retry" | "store",
 *           onError?: (error: Error) => void }} options
 *   `key`: every method needs a key ("required") or none does ("optional");
 *   by default POST and PATCH need one. `serverErrors`: 5xx answers are
 *   not stored (the retry runs again) unless "store".
 */
export function idempotency({ idem, bizType = "http", policy = {}, key, serverErrors = "retry", onError = () => {} } = {}) {
  if (!idem || typeof idem.begin !== "function") throw new TypeError("idempotency: options.idem must be an Idem instance");
  if (key !== undefined && key !== "required" && key !== "optional") throw new TypeError('idempotency: options.key must be "required" or "optional"');
  if (serverErrors !== "retry" && serverErrors !== "store") throw new TypeError('idempotency: options.serverErrors must be "retry" or "store"');
  const maxBody = policy.max_body_bytes ?? DEFAULT_POLICY.max_body_bytes;
  return async function idemMiddleware(req, res, next) {
    try {
      const method = req.method;
      const keys = req.headersDistinct?.["idempotency-key"] ?? [];
      if (isSafeMethod(method) && key !== "required") return next();
      if (keys.length > 1) return send(res, problems.severalKeys());
      if (keys.length === 0) {
        const needed = key === "required" || (key === undefined && needsKeyByDefault(method));
        return needed ? send(res, problems.keyMissing(method)) : next();
      }
      const parsed = parseIdempotencyKey(keys[0]);
      if (parsed.error) return send(res, problems.keyInvalid(parsed.error));
      const auth = req.headersDistinct?.authorization ?? [];
      if (auth.length > 1) return send(res, problems.scopeRepeated());
      if (auth.length === 0) return send(res, problems.unidentified());
      const scope = authScope(auth[0]);
      const body = await readBody(req, maxBody);
      if (body === null) return send(res, problems.bodyTooLarge(maxBody));
      const kind = bodyKind(req.headers["content-type"]);
      const path = req.originalUrl ?? req.url;
      let d;
      try {
        d = idem.begin({ scope, bizType, key: parsed.key, attributes: [["method", method], ["path", path]], body, bodyKind: kind, policy });
      } catch (e) {
        onError(e);
        return send(res, e instanceof EngineError && e.kind === "store" ? problems.storeUnavailable() : problems.engineFailed());
      }
      switch (d.decision) {
        case "execute": break;
        case "replay": return d.response ? replay(res, d.response) : send(res, problems.responseNotStored());
        case "failed": return d.failure.response ? replay(res, d.failure.response) : send(res, problems.requestFailed());
        case "in-progress": return send(res, problems.inProgress(d.retryAfterMs));
        case "mismatch": return send(res, problems.keyReused());
        case "outcome-unknown": return send(res, problems.outcomeUnknown());
        case "invalid": return send(res, problems.invalid(d));
        default: return send(res, problems.engineFailed());
      }
      req.rawBody = body;
      req.body = kind === "json" && body.length > 0 ? JSON.parse(body.toString("utf8")) : body;
      req._body = true; // body-parser: already read
      const state = capture(idem, d.ticket, policy, serverErrors, res, onError);
      req[CRASHED] = () => { state.crashed = true; };
      return next();
    } catch (e) {
      onError(e);
      if (!res.headersSent) return send(res, problems.engineFailed());
      return undefined;
    }
  };
}

/** Records the handler's answer once it is sent. */
function capture(idem, ticket, policy, serverErrors, res, onError) {
  const chunks = [];
  let size = 0;
  const write = res.write;
  const end = res.end;
  const keep = (chunk, encoding) => {
    if (chunk === undefined || chunk === null || typeof chunk === "function") return;
    const b = Buffer.isBuffer(chunk) ? chunk : Buffer.from(chunk, typeof encoding === "string" ? encoding : "utf8");
    size += b.length;
    if (size <= MAX_STORED_BODY_BYTES) chunks.push(b);
  };
  res.write = function (chunk, encoding, cb) {
    keep(chunk, encoding);
    return write.call(this, chunk, encoding, cb);
  };
  res.end = function (chunk, encoding, cb) {
    keep(chunk, encoding);
    return end.call(this, chunk, encoding, cb);
  };
  let settled = false;
  const state = { crashed: false };
  const settle = (finished) => {
    if (settled) return;
    settled = true;
    try {
      if (!finished || state.crashed) {
        // The handler gave no complete answer: it may or may not have taken effect.
        idem.fail(ticket, policy, { code: "no-response", message: "the handler gave no complete response" }, "outcome-unknown");
        return;
      }
      const status = res.statusCode;
      const headers = [];
      for (const [n, v] of Object.entries(res.getHeaders())) {
        if (isHopByHop(n)) continue;
        for (const one of Array.isArray(v) ? v : [v]) headers.push([n, Buffer.from(String(one), "latin1")]);
      }
      const storable = headers.length <= MAX_STORED_HEADERS && size <= MAX_STORED_BODY_BYTES;
      const response = storable ? { status, headers, body: Buffer.concat(chunks) } : undefined;
      const verdict = classifyStatus(status, serverErrors);
      if (verdict === "complete") idem.complete(ticket, policy, { response });
      else if (verdict === "final") idem.fail(ticket, policy, { code: `http-${status}`, message: "", response }, "final");
      else idem.fail(ticket, policy, { code: `http-${status}`, message: "" }, "retryable");
    } catch (e) {
      onError(e);
    }
  };
  res.on("finish", () => settle(true));
  res.on("close", () => settle(res.writableFinished));
  return state;
}

/**
 * The error handler to mount after the routes: a handler that failed
 * (threw, or called next(err)) on a keyed request gave no complete answer,
 * so the key's outcome is unknown, as in the proxy: the client gets 500
 * `outcome-unknown` and duplicates 409 `outcome-unknown` until the lease
 * ends (then the policy's `outcome_unknown` decides). Without it, Express's
 * own 500 is an ordinary 5xx answer: not stored, and the retry runs again.
 */
export function idempotencyErrors() {
  return function idemErrors(err, req, res, next) {
    const crashed = req[CRASHED];
    if (typeof crashed !== "function" || res.headersSent) return next(err);
    crashed();
    return send(res, problems.outcomeUnknown(500));
  };
}
