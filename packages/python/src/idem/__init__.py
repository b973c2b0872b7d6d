"""idem for Python: the idem idempotency engine (a WebAssembly component on
Wasmtime) with a SQLite store, an ``@idempotent`` decorator and an ASGI
middleware. The engine is the same component the Rust crate and the Node
package run: the same decisions in every language."""

from ._host import DEFAULT_POLICY, EngineError, StoreError
from .asgi import IdempotencyMiddleware
from .decorator import (
    IdempotencyError,
    IdempotencyFailedError,
    IdempotencyInProgressError,
    IdempotencyKeyMismatchError,
    IdempotencyLostOwnershipError,
    IdempotencyOutcomeUnknownError,
    IdempotencyValidationError,
    idempotent,
)
from .engine import (
    Execute,
    Failed,
    Failure,
    Idem,
    InProgress,
    Invalid,
    LostOwnership,
    ManualClock,
    Mismatch,
    OutcomeUnknown,
    Recorded,
    Replay,
    Response,
    Success,
    SystemClock,
)
from .sqlite import SqliteStore

__all__ = [
    "DEFAULT_POLICY", "EngineError", "StoreError", "IdempotencyMiddleware", "IdempotencyError",
    "IdempotencyFailedError", "IdempotencyInProgressError", "IdempotencyKeyMismatchError",
    "IdempotencyLostOwnershipError", "IdempotencyOutcomeUnknownError", "IdempotencyValidationError",
    "idempotent", "Execute", "Failed", "Failure", "Idem", "InProgress", "Invalid", "LostOwnership", "ManualClock",
    "Mismatch", "OutcomeUnknown", "Recorded", "Replay", "Response", "Success", "SystemClock", "SqliteStore",
]
__version__ = "0.1.0"
