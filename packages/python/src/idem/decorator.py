"""``@idempotent``: run a function once per key and replay its result, for
plain functions and ``async def`` alike (like Powertools' ``@idempotent``)."""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Callable, Optional, TypeVar, Union

from .engine import Idem, Response

F = TypeVar("F", bound=Callable[..., Any])


class IdempotencyError(Exception):
    """The base of every error ``@idempotent`` raises instead of running the function."""


class IdempotencyInProgressError(IdempotencyError):
    """Another call with the same key is running: retry after ``retry_after_ms``."""

    def __init__(self, message: str, retry_after_ms: int):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class IdempotencyKeyMismatchError(IdempotencyError):
    """The key was used with other arguments (another fingerprint)."""


class IdempotencyFailedError(IdempotencyError):
    """An earlier call with the key failed for good (``code``, ``failure_message``)."""

    def __init__(self, message: str, code: str, failure_message: str):
        super().__init__(message)
        self.code = code
        self.failure_message = failure_message


class IdempotencyOutcomeUnknownError(IdempotencyError):
    """An earlier attempt may or may not have taken effect; nothing ran."""


class IdempotencyValidationError(IdempotencyError, ValueError):
    """The key or the arguments broke a rule: ``field`` and ``rule`` name it."""

    def __init__(self, message: str, field: str, rule: str):
        super().__init__(message)
        self.field = field
        self.rule = rule


class IdempotencyLostOwnershipError(IdempotencyError):
    """The function ran, but its lease was taken over: ``result`` was not stored."""

    def __init__(self, message: str, result: Any):
        super().__init__(message)
        self.result = result


_JSON = [("content-type", b"application/json")]


def _default_fingerprint(*args: Any, **kwargs: Any) -> Any:
    return {"args": list(args), "kwargs": kwargs}


def idempotent(idem: Idem, biz_type: str, *, key: Callable[..., str],
               scope: Union[str, Callable[..., str]] = "default",
               fingerprint: Callable[..., Any] = _default_fingerprint,
               policy: Optional[dict[str, Any]] = None,
               classify: Callable[[BaseException], str] = lambda e: "retryable",
               result_ref: Optional[Callable[[Any], Optional[str]]] = None) -> Callable[[F], F]:
    """Makes calls with the same key run the function once and replay its
    (JSON-serialisable) result.

    ``key(*args, **kwargs)`` selects the idempotency key; ``fingerprint``
    selects what must be equal for a replay (default: every argument, as
    JSON); ``classify(exc)`` says what an exception means: "retryable" (the
    default: the next call runs again), "final" (replayed as
    IdempotencyFailedError) or "outcome-unknown".

    >>> @idempotent(idem, "order.create", key=lambda order: order["id"])
    ... def create_order(order): ...
    """
    if not isinstance(idem, Idem):
        raise TypeError("idempotent: idem must be an Idem instance")
    if not isinstance(biz_type, str):
        raise TypeError('idempotent: biz_type must be a str, e.g. "order.create"')
    if not callable(key):
        raise TypeError("idempotent: key must be a function that returns the idempotency key from the arguments")

    def start(args: tuple, kwargs: dict) -> tuple[Any, Any]:
        k = key(*args, **kwargs)
        if not isinstance(k, str):
            raise IdempotencyValidationError(f"key returned {type(k).__name__}, not a str", "idem-key", "required")
        s = scope(*args, **kwargs) if callable(scope) else scope
        # The fingerprinted value always as its JSON text, a str too.
        body = json.dumps(fingerprint(*args, **kwargs), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        d = idem.begin(s, biz_type, k, body=body, body_kind="json", policy=policy)
        if d.decision == "execute":
            return d.ticket, None
        if d.decision == "replay":
            if d.response is None or not d.response.body:
                return None, (None,)
            return None, (json.loads(d.response.body),)
        if d.decision == "in-progress":
            raise IdempotencyInProgressError(
                f"a call with idempotency key {k!r} is in progress; retry after {d.retry_after_ms} ms", d.retry_after_ms)
        if d.decision == "mismatch":
            raise IdempotencyKeyMismatchError(f"idempotency key {k!r} was already used with other arguments")
        if d.decision == "failed":
            raise IdempotencyFailedError(f"the call with idempotency key {k!r} failed for good: {d.failure.code}: "
                                         f"{d.failure.message}", d.failure.code, d.failure.message)
        if d.decision == "outcome-unknown":
            raise IdempotencyOutcomeUnknownError(
                f"the outcome of the call with idempotency key {k!r} is unknown; it is not run again until it is settled")
        raise IdempotencyValidationError(d.message, d.field, d.rule)

    def failed(ticket: Any, exc: BaseException) -> None:
        code = (getattr(exc, "code", None) or type(exc).__name__)
        idem.fail(ticket, policy, code=str(code)[:128] or "error", message=str(exc)[:4096],
                  disposition=classify(exc))

    def succeeded(ticket: Any, result: Any) -> Any:
        body = b"" if result is None else json.dumps(result, separators=(",", ":")).encode("utf-8")
        ref = result_ref(result) if result_ref else None
        c = idem.complete(ticket, policy, result_ref=ref, response=Response(200, _JSON, body))
        if c.completion == "lost-ownership":
            raise IdempotencyLostOwnershipError(
                "the call ran, but its lease was taken over; its result was not stored", result)
        return result

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                ticket, replayed = start(args, kwargs)
                if replayed is not None:
                    return replayed[0]
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    failed(ticket, exc)
                    raise
                return succeeded(ticket, result)
            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            ticket, replayed = start(args, kwargs)
            if replayed is not None:
                return replayed[0]
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                failed(ticket, exc)
                raise
            return succeeded(ticket, result)
        return run  # type: ignore[return-value]

    return decorate
