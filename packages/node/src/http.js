// The HTTP rules of idem's proxy (crate idem-http): the key header, the
// scope, the body kind, the status classification and the problem
// catalogue. The middlewares answer as the proxy does.

import { createHash } from "node:crypto";

export const PROBLEM_BASE = "tag:idem.invalid,2026:problems/";
export const IDEMPOTENT_REPLAYED = "idempotent-replayed";
export const MAX_STORED_BODY_BYTES = 16 * 1024 * 1024;
export const MAX_STORED_HEADERS = 128;

/** slug -> [status, title], as in the README's "Problem types". */
export const PROBLEMS = {
  "key-missing": [400, "Idempotency-Key is missing"],
  "key-invalid": [400, "Idempotency-Key is invalid"],
  "key-reused": [422, "Idempotency-Key is already used"],
  "request-in-progress": [409, "A request is outstanding for this Idempotency-Key"],
  "outcome-unknown": [409, "The outcome of the request is unknown"],
  "body-too-large": [413, "Request body is too large"],
  "invalid-request": [400, "Request is invalid"],
  "client-unidentified": [401, "The client is not identified"],
  "store-unavailable": [503, "Idempotency store is unavailable"],
  "request-failed": [500, "The request failed"],
  "response-not-stored": [500, "The response was not stored"],
  "internal-error": [500, "Internal error"],
};

const retryAfterSecs = (ms) => Math.max(1, Math.ceil(ms / 1000));

/** One problem answer: `{ status, headers, body }` (body a Buffer). */
export function problem(slug, detail, { extensions = {}, retryAfterMs, status } = {}) {
  const [usual, title] = PROBLEMS[slug];
  const st = status ?? usual;
  const ext = { ...extensions };
  const headers = [["content-type", "application/problem+json"], ["cache-control", "no-store"]];
  if (retryAfterMs !== undefined) {
    ext.retry_after_ms = retryAfterMs;
    headers.push(["retry-after", String(retryAfterSecs(retryAfterMs))]);
  }
  if (st === 401) headers.push(["www-authenticate", 'Bearer realm="idem"']);
  const obj = { ...ext, type: PROBLEM_BASE + slug, title, status: st, detail };
  // serde_json's map is ordered by key: the same bytes as the proxy.
  const sorted = Object.fromEntries(Object.keys(obj).sort().map((k) => [k, obj[k]]));
  return { status: st, headers, body: Buffer.from(JSON.stringify(sorted), "utf8") };
}

export const problems = {
  keyMissing: (method) => problem("key-missing", `${method} requests to this endpoint need an Idempotency-Key header. Send a new unique key (e.g. a UUID) with each new request, and the same key when you retry it.`),
  keyInvalid: (why) => problem("key-invalid", `${why}. Send the key as a Structured Field string such as "8e03978e-40d5-43e8-bc93-6894a57f9324", or as the bare value.`),
  severalKeys: () => problem("key-invalid", "Several Idempotency-Key headers were sent. Send exactly one."),
  scopeRepeated: () => problem("invalid-request", "the Authorization header is repeated. Send it once, as printable text.", { extensions: { field: "scope" } }),
  unidentified: () => problem("client-unidentified", "Requests with an Idempotency-Key must say who the client is, so that no client receives another's stored response. Send an Authorization header, then retry with the same Idempotency-Key: nothing was stored."),
  bodyTooLarge: (limit) => problem("body-too-large", `The request body is over the limit of ${limit} bytes. Send a smaller body.`, { extensions: { max_body_bytes: limit } }),
  storeUnavailable: () => problem("store-unavailable", "The idempotency store did not answer and the request was not forwarded. Retry with the same Idempotency-Key.", { retryAfterMs: 1000 }),
  engineFailed: () => problem("internal-error", "The idempotency engine failed and the request was not forwarded."),
  responseNotStored: () => problem("response-not-stored", "The request with this Idempotency-Key was already processed, but its response was not kept and cannot be replayed. Do not send it again."),
  inProgress: (ms) => problem("request-in-progress", `The first request with this Idempotency-Key is still being processed. Retry after ${retryAfterSecs(ms)} s with the same key and request.`, { retryAfterMs: ms }),
  keyReused: () => problem("key-reused", "This Idempotency-Key was already used with a different request (method, path or body). Use a new key for a new request."),
  requestFailed: () => problem("request-failed", "The request with this Idempotency-Key failed for good, and no response was kept. Use a new key to try again."),
  outcomeUnknown: (status) => problem("outcome-unknown", "An earlier attempt with this Idempotency-Key may or may not have taken effect. It will not be executed again until the outcome is settled; do not retry it with a new key before checking whether it took effect.", { status }),
  invalid: (d) => problem(d.field === "idem-key" ? "key-invalid" : d.field === "body" && d.rule === "too-long" ? "body-too-large" : "invalid-request",
    d.message, { extensions: { field: d.field, rule: d.rule } }),
};

export const isSafeMethod = (m) => ["GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"].includes(m);
export const needsKeyByDefault = (m) => m === "POST" || m === "PATCH";

/** The Idempotency-Key header's key: `{ key }` or `{ error }` (RFC 9651 sf-string, or the bare value). */
export function parseIdempotencyKey(raw) {
  const bytes = Buffer.from(raw, "latin1");
  let text;
  try {
    text = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
  } catch {
    return { error: "the Idempotency-Key header is not valid UTF-8" };
  }
  text = text.replace(/^[ \t]+|[ \t]+$/g, "");
  // Rust's char::is_control: C0, DEL and C1.
  if (/[\u0000-\u001f\u007f-\u009f]/.test(text)) return { error: "the Idempotency-Key header contains a control character" };
  if (!text.startsWith('"')) return { key: text };
  const bad = { error: "the Idempotency-Key header starts with '\"' but is not a valid Structured Field string (RFC 9651)" };
  let key = "";
  let i = 1;
  for (;;) {
    if (i >= text.length) return bad;
    const c = text[i++];
    if (c === '"') break;
    if (c === "\\") {
      if (i >= text.length) return bad;
      const e = text[i++];
      if (e !== '"' && e !== "\\") return bad;
      key += e;
    } else if (c >= " " && c <= "~") key += c;
    else return bad;
  }
  return i === text.length ? { key } : bad;
}

/** The scope from the Authorization header: `auth:<hex SHA-256>`. */
export const authScope = (value) => `auth:${createHash("sha256").update(Buffer.from(value, "latin1")).digest("hex")}`;

/** JSON for application/json and any `+json` media type, else raw. */
export function bodyKind(contentType) {
  if (typeof contentType !== "string" || !/^[\t\x20-\x7e]*$/.test(contentType)) return "raw";
  const essence = contentType.split(";")[0].trim().toLowerCase();
  if (essence === "application/json") return "json";
  const slash = essence.indexOf("/");
  if (slash > 0) {
    const sub = essence.slice(slash + 1);
    if (sub.length > 5 && sub.endsWith("+json")) return "json";
  }
  return "raw";
}

/** What an answer's status means: "complete", "final" or "retryable". */
export function classifyStatus(status, serverErrors = "retry") {
  if (status >= 100 && status <= 399) return "complete";
  if ([408, 409, 425, 429].includes(status)) return "retryable";
  if (status >= 400 && status <= 499) return "final";
  return serverErrors === "store" ? "final" : "retryable";
}

const HOP_BY_HOP = new Set(["connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding", "upgrade", "proxy-connection"]);
export const isHopByHop = (name) => HOP_BY_HOP.has(name.toLowerCase());
