"""The engine API for Python: one instance of the idem engine component over a
store, a clock and a result lookup."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Union

from wasmtime.component import Record

from ._host import Exports, Runtime, record, response_in, success_in, unwrap


class Clock(Protocol):
    def now(self) -> int: ...
    def pause(self, ms: int) -> None: ...


class SystemClock:
    """The real clock: milliseconds since the epoch; ``pause`` sleeps."""

    def now(self) -> int:
        return time.time_ns() // 1_000_000

    def pause(self, ms: int) -> None:
        time.sleep(ms / 1000)


class ManualClock:
    """A clock that moves only when told: for tests. A bounded wait on it
    advances it instead of sleeping."""

    def __init__(self, now: int):
        self.ms = int(now)

    def now(self) -> int:
        return self.ms

    def pause(self, ms: int) -> None:
        self.ms += ms

    def advance(self, ms: int) -> None:
        self.ms += int(ms)

    def set(self, ms: int) -> None:
        self.ms = int(ms)


@dataclass(frozen=True)
class Response:
    """An HTTP-shaped response kept for replay."""
    status: int
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    body: bytes = b""


@dataclass(frozen=True)
class Success:
    """What a successful action produced, as ``complete`` stores it: for a
    result lookup to return."""
    result_ref: Optional[str] = None
    response: Optional[Response] = None


class Results(Protocol):
    def find_result(self, key: Any) -> Union[None, str, Success, Response]:
        """The business result recorded under ``key`` (a record with
        ``scope``, ``biz-type``, ``idem-key``): its result reference (a
        str), a ``Success`` (result reference, response or both) or a
        ``Response``, as ``complete`` would have stored it; None when surely
        none exists. Raise StoreError when unsure: None lets the action run
        again. A result that breaks complete's rules (a result reference
        over 1024 bytes, a status outside 100..599) is a failed lookup:
        nothing is stored."""
        ...


class _NoResults:
    """No business lookup: every result is surely absent."""

    def find_result(self, key: Any) -> None:
        return None


@dataclass(frozen=True)
class Failure:
    """What a failed action reported."""
    code: str
    message: str = ""
    response: Optional[Response] = None


@dataclass(frozen=True)
class Execute:
    """The caller owns the key: run the action once, then complete or fail."""
    ticket: Any
    fencing_token: int
    attempt: int
    lease_until: int
    decision: str = "execute"


@dataclass(frozen=True)
class Replay:
    """The action already succeeded: return its result."""
    result_ref: Optional[str]
    response: Optional[Response]
    completed_at: int
    decision: str = "replay"


@dataclass(frozen=True)
class InProgress:
    """Another owner is running the action: retry after ``retry_after_ms``."""
    retry_after_ms: int
    lease_until: int
    decision: str = "in-progress"


@dataclass(frozen=True)
class Mismatch:
    """Same key, different request."""
    stored_prefix: str
    stored_version: int
    decision: str = "mismatch"


@dataclass(frozen=True)
class Failed:
    """The action failed for good: the stored failure."""
    failure: Failure
    decision: str = "failed"


@dataclass(frozen=True)
class OutcomeUnknown:
    """An earlier attempt may or may not have taken effect: do not run."""
    since: int
    attempts: int
    failure: Optional[Failure]
    decision: str = "outcome-unknown"


@dataclass(frozen=True)
class Invalid:
    """The input broke a rule (``field``, ``rule``); nothing was written."""
    field: str
    rule: str
    message: str
    decision: str = "invalid"


Decision = Union[Execute, Replay, InProgress, Mismatch, Failed, OutcomeUnknown, Invalid]


@dataclass(frozen=True)
class Recorded:
    """The outcome is stored, and the key is now in ``status``:
    "succeeded" after ``complete``; after ``fail``, "released" (a retryable
    failure: the next request executes again), "failed" (a final failure,
    or a retryable one made final by ``failure_mode="always-final"`` or
    ``max_attempts``) or "outcome-unknown". A caller that retries goes by
    ``status``, not by the disposition it passed."""
    status: str
    completion: str = "recorded"


@dataclass(frozen=True)
class LostOwnership:
    """The lease was taken over (or the record is gone): nothing was
    written; the caller's own outcome is discarded."""
    completion: str = "lost-ownership"


Completion = Union[Recorded, LostOwnership]

DISPOSITIONS = ("retryable", "final", "outcome-unknown")


def _response_out(r: Any) -> Optional[Response]:
    if r is None:
        return None
    return Response(r.status, [(n, bytes(v)) for n, v in r.headers], bytes(r.body))


def _failure_out(f: Any) -> Failure:
    return Failure(f.code, f.message, _response_out(f.response))


def decision_out(d: Any) -> Decision:
    """The component's decision as one of the decision classes."""
    v = d.payload
    tag = d.tag
    if tag == "execute":
        return Execute(v, getattr(v, "fencing-token"), v.attempt, getattr(v, "lease-until"))
    if tag == "replay":
        return Replay(getattr(v, "result-ref"), _response_out(v.response), getattr(v, "completed-at"))
    if tag == "in-progress":
        return InProgress(getattr(v, "retry-after-ms"), getattr(v, "lease-until"))
    if tag == "mismatch":
        return Mismatch(getattr(v, "stored-prefix"), getattr(v, "stored-version"))
    if tag == "failed":
        return Failed(_failure_out(v))
    if tag == "outcome-unknown":
        return OutcomeUnknown(v.since, v.attempts, None if v.failure is None else _failure_out(v.failure))
    if tag == "invalid":
        return Invalid(v.field, v.rule, v.message)
    raise ValueError(f"unknown decision {tag}")


def completion_out(c: Any) -> Completion:
    """The component's answer to ``complete`` and ``fail``."""
    # completion is untagged in wasmtime-py: a str (the status) is `recorded`, None is `lost-ownership`.
    if c is None:
        return LostOwnership()
    if isinstance(c, str):
        return Recorded(c)
    raise ValueError(f"unknown completion {c!r}")


def _key(scope: str, biz_type: str, key: str, what: str) -> Record:
    for name, value in (("scope", scope), ("biz_type", biz_type), ("key", key)):
        if not isinstance(value, str):
            raise TypeError(f"{what}: {name} must be a str, got {type(value).__name__}")
    return record(scope=scope, biz_type=biz_type, idem_key=key)


class Idem:
    """The idem engine in this process; every decision is the component's.

    >>> idem = Idem(SqliteStore("idem.db"))
    >>> d = idem.begin("tenant-1", "order.create", "k1", body={"sku": "A1"})

    Thread-safe: calls into the component are serialised by a lock.
    """

    def __init__(self, store: Any, *, clock: Optional[Clock] = None, results: Optional[Results] = None,
                 wasm_path: Union[str, Path, None] = None):
        if store is None:
            raise TypeError("Idem: store is required (e.g. SqliteStore(path))")
        self.store = store
        self.clock = clock if clock is not None else SystemClock()
        self.results = results if results is not None else _NoResults()
        self.runtime = Runtime.get(wasm_path)
        self._exports = Exports(self.runtime, self.runtime.linker(store, self.clock, self.results))
        self._lock = threading.RLock()

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            return unwrap(self._exports.call(name, *args))

    def begin(self, scope: str, biz_type: str, key: str, *, body: Any = b"", body_kind: Optional[str] = None,
              attributes: Optional[list[tuple[str, str]]] = None, policy: Optional[dict[str, Any]] = None) -> Decision:
        """Decides what to do with a request. ``body`` is bytes (raw unless
        ``body_kind="json"``), a str, or any other value, sent as its JSON
        text. ``policy`` uses the Rust ``Policy`` field names. Raises
        EngineError when the engine could not decide."""
        kind = body_kind
        if isinstance(body, (bytes, bytearray, memoryview)):
            data = bytes(body)
        elif isinstance(body, str):
            data = body.encode("utf-8")
        else:
            data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
            kind = kind or "json"
        kind = kind or "raw"
        if kind not in ("json", "raw"):
            raise ValueError(f'begin: body_kind must be "json" or "raw", got {kind!r}')
        attrs = list(attributes or [])
        if not all(isinstance(a, tuple) and len(a) == 2 and all(isinstance(x, str) for x in a) for a in attrs):
            raise TypeError("begin: attributes must be a list of (name, value) str pairs")
        req = record(key=_key(scope, biz_type, key, "begin"), attributes=attrs, body_kind=kind, body=data,
                     policy=self._exports.policy(policy))
        with self._lock:
            return decision_out(unwrap(self._exports.call("begin", req)))

    def complete(self, ticket: Any, policy: Optional[dict[str, Any]] = None, *, result_ref: Optional[str] = None,
                 response: Optional[Response] = None) -> Completion:
        """Stores the success of the action owned by ``ticket``:
        ``Recorded(status="succeeded")``, or ``LostOwnership()`` (nothing
        was written). Both have ``completion``, "recorded" or
        "lost-ownership"."""
        success = success_in(result_ref, response)
        return completion_out(self._call("complete", ticket, self._exports.policy(policy), success))

    def fail(self, ticket: Any, policy: Optional[dict[str, Any]] = None, *, code: str, message: str = "",
             response: Optional[Response] = None, disposition: str = "retryable") -> Completion:
        """Stores a failure with its disposition ("retryable", "final",
        "outcome-unknown"): ``Recorded(status)`` with the status the key was
        left in, or ``LostOwnership()``. The status follows the policy, not
        only the disposition: a retryable failure is "released" (the next
        request executes again), or "failed" under
        ``failure_mode="always-final"`` or once the attempt reaches
        ``max_attempts``."""
        if disposition not in DISPOSITIONS:
            raise ValueError(f"fail: disposition must be one of {', '.join(DISPOSITIONS)}, got {disposition!r}")
        if not isinstance(code, str):
            raise TypeError("fail: code must be a str")
        failure = record(code=code, message=str(message), response=response_in(response))
        return completion_out(self._call("fail", ticket, self._exports.policy(policy), failure, disposition))

    def extend(self, ticket: Any, policy: Optional[dict[str, Any]] = None) -> Optional[int]:
        """Extends the lease: the new end, or None when ownership was lost."""
        x = self._call("extend", ticket, self._exports.policy(policy))
        # extension is untagged in wasmtime-py: an int is `extended`, None is `lost-ownership`.
        return x if isinstance(x, int) else None

    def reconcile(self, biz_type: str, policy: Optional[dict[str, Any]] = None, limit: int = 100) -> dict[str, int]:
        """Settles up to ``limit`` stale records of ``biz_type``; the report."""
        r = self._call("reconcile", biz_type, self._exports.policy(policy), limit)
        return {k.replace("-", "_"): v for k, v in r.__dict__.items()}

    def sweep(self, limit: int = 100) -> int:
        """Deletes up to ``limit`` settled records past retention; how many."""
        return self._call("sweep", limit)

    def inspect(self, scope: str, biz_type: str, key: str) -> Optional[dict[str, Any]]:
        """The status of one key, or None."""
        s = self._call("inspect", _key(scope, biz_type, key, "inspect"))
        return None if s is None else {k.replace("-", "_"): v for k, v in s.__dict__.items()}
