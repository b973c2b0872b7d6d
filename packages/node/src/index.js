// idem for Node: the engine component, the SQLite store, makeIdempotent and
// the HTTP middleware.

export { Idem, ManualClock, systemClock } from "./engine.js";
export { SqliteStore, MIGRATIONS } from "./sqlite.js";
export { StoreError, EngineError, DEFAULT_POLICY, componentInfo } from "./host.js";
export {
  makeIdempotent, IdempotencyError, IdempotencyInProgressError, IdempotencyKeyMismatchError,
  IdempotencyFailedError, IdempotencyOutcomeUnknownError, IdempotencyValidationError, IdempotencyLostOwnershipError,
} from "./idempotent.js";
export { idempotency, idempotencyErrors } from "./express.js";
