"""The HTTP rules of idem's proxy (crate idem-http): the key header, the
scope, the body kind, the status classification and the problem catalogue.
The middlewares answer as the proxy does."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Optional

PROBLEM_BASE = "tag:idem.invalid,2026:problems/"
IDEMPOTENT_REPLAYED = "idempotent-replayed"
MAX_STORED_BODY_BYTES = 16 * 1024 * 1024
MAX_STORED_HEADERS = 128

PROBLEMS = {
    "key-missing": (400, "Idempotency-Key is missing"),
    "key-invalid": (400, "Idempotency-Key is invalid"),
    "key-reused": (422, "Idempotency-Key is already used"),
    "request-in-progress": (409, "A request is outstanding for this Idempotency-Key"),
    "outcome-unknown": (409, "The outcome of the request is unknown"),
    "body-too-large": (413, "Request body is too large"),
    "invalid-request": (400, "Request is invalid"),
    "client-unidentified": (401, "The client is not identified"),
    "store-unavailable": (503, "Idempotency store is unavailable"),
    "request-failed": (500, "The request failed"),
    "response-not-stored": (500, "The response was not stored"),
    "internal-error": (500, "Internal error"),
}
"""slug -> (status, title), as in the README's "Problem types"."""


def retry_after_secs(ms: int) -> int:
    return max(1, math.ceil(ms / 1000))


class Problem:
    """One problem answer: ``status``, ``headers`` (lowercase names) and the JSON ``body``."""

    def __init__(self, slug: str, detail: str, *, extensions: Optional[dict[str, Any]] = None,
                 retry_after_ms: Optional[int] = None, status: Optional[int] = None):
        usual, title = PROBLEMS[slug]
        self.status = status or usual
        ext = dict(extensions or {})
        self.headers = [("content-type", "application/problem+json"), ("cache-control", "no-store")]
        if retry_after_ms is not None:
            ext["retry_after_ms"] = retry_after_ms
            self.headers.append(("retry-after", str(retry_after_secs(retry_after_ms))))
        if self.status == 401:
            self.headers.append(("www-authenticate", 'Bearer realm="idem"'))
        obj = {**ext, "type": PROBLEM_BASE + slug, "title": title, "status": self.status, "detail": detail}
        # serde_json's map is ordered by key: the same bytes as the proxy.
        self.body = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def key_missing(method: str) -> Problem:
    return Problem("key-missing", f"{method} requests to this endpoint need an Idempotency-Key header. Send a new unique key (e.g. a UUID) with each new request, and the same key when you retry it.")


def key_invalid(why: str) -> Problem:
    return Problem("key-invalid", f'{why}. Send the key as a Structured Field string such as "8e03978e-40d5-43e8-bc93-6894a57f9324", or as the bare value.')


def several_keys() -> Problem:
    return Problem("key-invalid", "Several Idempotency-Key headers were sent. Send exactly one.")


def scope_repeated() -> Problem:
    return Problem("invalid-request", "the Authorization header is repeated. Send it once, as printable text.", extensions={"field": "scope"})


def unidentified() -> Problem:
    return Problem("client-unidentified", "Requests with an Idempotency-Key must say who the client is, so that no client receives another's stored response. Send an Authorization header, then retry with the same Idempotency-Key: nothing was stored.")


def body_too_large(limit: int) -> Problem:
    return Problem("body-too-large", f"The request body is over the limit of {limit} bytes. Send a smaller body.", extensions={"max_body_bytes": limit})


def store_unavailable() -> Problem:
    return Problem("store-unavailable", "The idempotency store did not answer and the request was not forwarded. Retry with the same Idempotency-Key.", retry_after_ms=1000)


def engine_failed() -> Problem:
    return Problem("internal-error", "The idempotency engine failed and the request was not forwarded.")


def response_not_stored() -> Problem:
    return Problem("response-not-stored", "The request with this Idempotency-Key was already processed, but its response was not kept and cannot be replayed. Do not send it again.")


def in_progress(ms: int) -> Problem:
    return Problem("request-in-progress", f"The first request with this Idempotency-Key is still being processed. Retry after {retry_after_secs(ms)} s with the same key and request.", retry_after_ms=ms)


def key_reused() -> Problem:
    return Problem("key-reused", "This Idempotency-Key was already used with a different request (method, path or body). Use a new key for a new request.")


def request_failed() -> Problem:
    return Problem("request-failed", "The request with this Idempotency-Key failed for good, and no response was kept. Use a new key to try again.")


def outcome_unknown(status: Optional[int] = None) -> Problem:
    return Problem("outcome-unknown", "An earlier attempt with this Idempotency-Key may or may not have taken effect. It will not be executed again until the outcome is settled; do not retry it with a new key before checking whether it took effect.", status=status)


def invalid(field: str, rule: str, message: str) -> Problem:
    slug = "key-invalid" if field == "idem-key" else "body-too-large" if (field, rule) == ("body", "too-long") else "invalid-request"
    return Problem(slug, message, extensions={"field": field, "rule": rule})


SAFE_METHODS = ("GET", "HEAD", "OPTIONS", "TRACE", "CONNECT")


def needs_key_by_default(method: str) -> bool:
    return method in ("POST", "PATCH")



def parse_idempotency_key(raw: bytes) -> str:
    """The key of an Idempotency-Key header value: an RFC 9651 sf-string or
    the bare value. Raises ValueError with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the Idempotency-Key header is not valid UTF-8") from None
    text = text.strip(" \t")
    if any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text):
        raise ValueError("the Idempotency-Key header contains a control character")
    if not text.startswith('"'):
        return text
    bad = "the Idempotency-Key header starts with '\"' but is not a valid Structured Field string (RFC 9651)"
    out = []
    i = 1
    while True:
        if i >= len(text):
            raise ValueError(bad)
        c = text[i]
        i += 1
        if c == '"':
            break
        if c == "\\":
            if i >= len(text) or text[i] not in '"\\':
                raise ValueError(bad)
            out.append(text[i])
            i += 1
        elif " " <= c <= "~":
            out.append(c)
        else:
            raise ValueError(bad)
    if i != len(text):
        raise ValueError(bad)
    return "".join(out)


def auth_scope(value: bytes) -> str:
    """The scope from the Authorization header: ``auth:<hex SHA-256>``."""
    return "auth:" + hashlib.sha256(value).hexdigest()


def body_kind(content_type: Optional[bytes]) -> str:
    """"json" for application/json and any ``+json`` media type, else "raw"."""
    if content_type is None or not all(b == 9 or 0x20 <= b < 0x7F for b in content_type):
        return "raw"
    essence = content_type.decode("ascii").split(";")[0].strip().lower()
    if essence == "application/json":
        return "json"
    t, slash, sub = essence.partition("/")
    if slash and t and len(sub) > 5 and sub.endswith("+json"):
        return "json"
    return "raw"


def classify_status(status: int, server_errors: str = "retry") -> str:
    """What an answer's status means: "complete", "final" or "retryable"."""
    if 100 <= status <= 399:
        return "complete"
    if status in (408, 409, 425, 429):
        return "retryable"
    if 400 <= status <= 499:
        return "final"
    return "final" if server_errors == "store" else "retryable"


HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
              "transfer-encoding", "upgrade", "proxy-connection"}
