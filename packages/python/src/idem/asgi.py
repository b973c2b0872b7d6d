"""The ASGI middleware for Starlette and FastAPI (and any ASGI app): the
proxy's rules, status for status.

    app.add_middleware(IdempotencyMiddleware, idem=Idem(SqliteStore("idem.db")))
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

from . import http
from ._host import DEFAULT_POLICY, EngineError
from .engine import Idem, Response

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


async def _answer(send: Send, status: int, headers: list[tuple[str, bytes]], body: bytes) -> None:
    raw = [(n.encode("latin-1"), v) for n, v in headers]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _problem(send: Send, p: http.Problem) -> None:
    await _answer(send, p.status, [(n, v.encode("latin-1")) for n, v in p.headers], p.body)


async def _replay(send: Send, stored: Response) -> None:
    headers = [(n, v) for n, v in stored.headers
               if n.lower() not in (http.IDEMPOTENT_REPLAYED, "content-length")]
    headers.append((http.IDEMPOTENT_REPLAYED, b"true"))
    await _answer(send, stored.status, headers, stored.body)


class IdempotencyMiddleware:
    """Deduplicates keyed requests as idem's proxy does.

    ``key``: "required" (every method needs a key), "optional" (none does),
    or None (the default: POST and PATCH need one). ``server_errors``: 5xx
    answers are not stored, so a retry runs again, unless "store".
    ``policy`` uses the Rust ``Policy`` field names.
    """

    def __init__(self, app: Callable[..., Any], idem: Idem, biz_type: str = "http",
                 policy: Optional[dict[str, Any]] = None, key: Optional[str] = None,
                 server_errors: str = "retry", on_error: Optional[Callable[[BaseException], None]] = None):
        if not isinstance(idem, Idem):
            raise TypeError("IdempotencyMiddleware: idem must be an Idem instance")
        if key not in (None, "required", "optional"):
            raise ValueError('IdempotencyMiddleware: key must be "required", "optional" or None')
        if server_errors not in ("retry", "store"):
            raise ValueError('IdempotencyMiddleware: server_errors must be "retry" or "store"')
        self.app = app
        self.idem = idem
        self.biz_type = biz_type
        self.policy = dict(policy or {})
        self.key = key
        self.server_errors = server_errors
        self.on_error = on_error or (lambda e: None)
        self.max_body = self.policy.get("max_body_bytes", DEFAULT_POLICY["max_body_bytes"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method = scope["method"]
        if method in http.SAFE_METHODS and self.key != "required":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        keys = [v for n, v in headers if n.lower() == b"idempotency-key"]
        if len(keys) > 1:
            return await _problem(send, http.several_keys())
        if not keys:
            needed = self.key == "required" or (self.key is None and http.needs_key_by_default(method))
            if needed:
                return await _problem(send, http.key_missing(method))
            return await self.app(scope, receive, send)
        try:
            idem_key = http.parse_idempotency_key(keys[0])
        except ValueError as e:
            return await _problem(send, http.key_invalid(str(e)))
        auth = [v for n, v in headers if n.lower() == b"authorization"]
        if len(auth) > 1:
            return await _problem(send, http.scope_repeated())
        if not auth:
            return await _problem(send, http.unidentified())
        client = http.auth_scope(auth[0])
        chunks = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return await _problem(send, http.body_too_large(self.max_body))
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        ctype = next((v for n, v in headers if n.lower() == b"content-type"), None)
        kind = http.body_kind(ctype)
        path = (scope.get("raw_path") or scope["path"].encode("utf-8")).decode("latin-1")
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        try:
            d = self.idem.begin(client, self.biz_type, idem_key, body=body, body_kind=kind,
                                attributes=[("method", method), ("path", path)], policy=self.policy)
        except EngineError as e:
            self.on_error(e)
            return await _problem(send, http.store_unavailable() if e.kind == "store" else http.engine_failed())
        if d.decision == "replay":
            return await (_replay(send, d.response) if d.response else _problem(send, http.response_not_stored()))
        if d.decision == "failed":
            r = d.failure.response
            return await (_replay(send, r) if r else _problem(send, http.request_failed()))
        if d.decision == "in-progress":
            return await _problem(send, http.in_progress(d.retry_after_ms))
        if d.decision == "mismatch":
            return await _problem(send, http.key_reused())
        if d.decision == "outcome-unknown":
            return await _problem(send, http.outcome_unknown())
        if d.decision == "invalid":
            return await _problem(send, http.invalid(d.field, d.rule, d.message))
        await self._execute(d.ticket, scope, receive, send, body)

    async def _execute(self, ticket: Any, scope: Scope, receive: Receive, send: Send, body: bytes) -> None:
        sent_body = False

        async def replay_receive() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        state: dict[str, Any] = {"status": None, "headers": [], "chunks": [], "size": 0, "done": False}

        async def capture(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                state["headers"] = [(bytes(n).decode("latin-1").lower(), bytes(v)) for n, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                state["size"] += len(chunk)
                if state["size"] <= http.MAX_STORED_BODY_BYTES:
                    state["chunks"].append(chunk)
                if not message.get("more_body", False):
                    state["done"] = True
            await send(message)
            if state["done"] and message["type"] == "http.response.body" and not message.get("more_body", False):
                self._settle(ticket)(state)

        try:
            await self.app(scope, replay_receive, capture)
        except BaseException as exc:
            if not state["done"]:
                # The handler gave no complete answer: it may or may not have taken effect.
                self._record(lambda: self.idem.fail(ticket, self.policy, code="no-response",
                                                    message="the handler gave no complete response",
                                                    disposition="outcome-unknown"))
                if state["status"] is None:
                    # Answered here: the exception is reported, not re-raised.
                    self.on_error(exc)
                    await _problem(send, http.outcome_unknown(500))
                    return None
            raise exc
        if not state["done"]:
            self._record(lambda: self.idem.fail(ticket, self.policy, code="no-response",
                                                message="the handler gave no complete response",
                                                disposition="outcome-unknown"))

    def _record(self, f: Callable[[], Any]) -> None:
        try:
            f()
        except Exception as e:  # noqa: BLE001 - the answer is sent; report the store failure
            self.on_error(e)

    def _settle(self, ticket: Any) -> Callable[[dict], None]:
        def settle(state: dict) -> None:
            status = state["status"]
            headers = [(n, v) for n, v in state["headers"] if n not in http.HOP_BY_HOP]
            storable = len(headers) <= http.MAX_STORED_HEADERS and state["size"] <= http.MAX_STORED_BODY_BYTES
            response = Response(status, headers, b"".join(state["chunks"])) if storable else None
            verdict = http.classify_status(status, self.server_errors)
            if verdict == "complete":
                self._record(lambda: self.idem.complete(ticket, self.policy, response=response))
            elif verdict == "final":
                self._record(lambda: self.idem.fail(ticket, self.policy, code=f"http-{status}", response=response,
                                                    disposition="final"))
            else:
                self._record(lambda: self.idem.fail(ticket, self.policy, code=f"http-{status}",
                                                    disposition="retryable"))
        return settle
