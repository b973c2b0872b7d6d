// Types of idem-engine (hand-written; the package is plain ESM JavaScript).

import type { IncomingMessage, ServerResponse } from "node:http";
import type { Database } from "better-sqlite3";

/** A policy in the Rust crate's `Policy` field names. Every field is optional; the defaults are `DEFAULT_POLICY`. */
export interface Policy {
  /** How long a settled record is kept and replayed, in ms (default 86400000). */
  retention_ms?: number | bigint;
  /** How long an owner may hold a key without `extend`, in ms (default 60000). */
  lease_ms?: number | bigint;
  /** The longest retry-after hint, in ms (default 1000). */
  retry_after_ms?: number | bigint;
  /** What to do with a processing record whose lease expired: its owner crashed (default "take-over"). */
  expired_lease?: "take-over" | "reconcile" | "manual";
  /**
   * What to do with an outcome-unknown record once its lease ended (default
   * "manual": blocked until reconciled or settled; the action may have run).
   */
  outcome_unknown?: "take-over" | "reconcile" | "manual";
  /** What a retryable failure does (default "honor-disposition"). */
  failure_mode?: "honor-disposition" | "always-final";
  /**
   * The most attempts a key may take when its failures are retryable, at
   * least 1 (default null: no limit). A retryable failure of attempt
   * `max_attempts` or a later one is stored as final: `fail` answers
   * `{ completion: "recorded", status: "failed" }` and duplicates get the
   * failure. Attempts are counted by the record, across processes. 0 is an
   * `invalid` policy (rule "out-of-range").
   */
  max_attempts?: number | null;
  /** What to do while another owner is executing (default "reject"). */
  in_progress?: "reject" | { wait: { max_wait_ms: number | bigint; poll_interval_ms: number | bigint } };
  /** JSON Pointers selecting the fingerprinted fields; empty for the whole body. */
  fingerprint_fields?: string[];
  /** The rules for the idempotency key. */
  key_format?: { min_length?: number; max_length?: number; charset?: "printable-ascii" | "uuid" | "token" };
  /** The largest body accepted for fingerprinting, in bytes (default 1048576). */
  max_body_bytes?: number;
}

export declare const DEFAULT_POLICY: Readonly<Required<Policy>>;

/** The unique key of a business action. */
export interface Key {
  scope: string;
  bizType: string;
  key: string;
}

export interface StoredResponse {
  status: number;
  headers: Array<[string, Buffer]>;
  body: Buffer;
}

export interface ResponseInput {
  status: number;
  headers?: Array<[string, Uint8Array | string]>;
  body?: Uint8Array | string;
}

export interface FailureInfo {
  code: string;
  message: string;
  response: StoredResponse | null;
}

/** Proof of ownership; pass it back to complete, fail and extend. */
export interface Ticket {
  readonly key: { scope: string; bizType: string; idemKey: string };
  readonly recordId: bigint;
  readonly fencingToken: bigint;
  readonly leaseUntil: bigint;
  readonly attempt: number;
}

export type Decision =
  | { decision: "execute"; ticket: Ticket; fencingToken: number; attempt: number; leaseUntil: number }
  | { decision: "replay"; resultRef: string | null; response: StoredResponse | null; completedAt: number }
  | { decision: "in-progress"; retryAfterMs: number; leaseUntil: number }
  | { decision: "mismatch"; storedPrefix: string; storedVersion: number }
  | { decision: "failed"; failure: FailureInfo }
  | { decision: "outcome-unknown"; since: number; attempts: number; failure: FailureInfo | null }
  | { decision: "invalid"; field: string; rule: string; message: string };

/** The stored state of a key. */
export type Status = "processing" | "succeeded" | "failed" | "released" | "outcome-unknown";

/**
 * The answer to `complete` and `fail`. `recorded`: the outcome is stored and
 * the key is now in `status`: "succeeded" after `complete`; after `fail`,
 * "released" (a retryable failure: the next request executes again),
 * "failed" (a final failure, or a retryable one made final by
 * `failure_mode: "always-final"` or `max_attempts`) or "outcome-unknown".
 * A caller that retries goes by `status`, not by the disposition it passed.
 * `lost-ownership`: the lease was taken over (or the record is gone);
 * nothing was written.
 */
export type Completion =
  | { completion: "recorded"; status: Status }
  | { completion: "lost-ownership" };

export interface Clock {
  now(): bigint | number;
  pause(ms: bigint): void;
}

export declare const systemClock: Clock;

/** A clock that moves only when told: for tests. */
export declare class ManualClock implements Clock {
  constructor(now: number | bigint);
  now(): bigint;
  pause(ms: bigint): void;
  advance(ms: number | bigint): void;
  set(ms: number | bigint): void;
}

/** What a successful action produced: `complete`'s argument, and what a result lookup finds. */
export interface SuccessInput {
  resultRef?: string;
  /** The response to replay to duplicates; the rules of `complete`'s (status 100 to 599). */
  response?: ResponseInput;
}

export interface Results {
  /**
   * The business result recorded under the key: its result reference (a
   * string) or `{ resultRef?, response? }` as given to `complete`; undefined
   * or null when surely none exists. Throw a StoreError when unsure. A result
   * that breaks complete's rules (a result reference over 1024 bytes, a
   * status outside 100..599) is a failed lookup: nothing is stored.
   */
  findResult(key: { scope: string; bizType: string; idemKey: string }): string | SuccessInput | undefined | null;
}

/** A store failure: `kind` is "unavailable", "rejected" or "internal". */
export declare class StoreError extends Error {
  constructor(kind: "unavailable" | "rejected" | "internal", message: string);
  kind: "unavailable" | "rejected" | "internal";
}

/** The engine could not decide: `kind` is "store", "corrupt" or "invalid". */
export declare class EngineError extends Error {
  kind: "store" | "corrupt" | "invalid";
  storeKind?: "unavailable" | "rejected" | "internal";
  field?: string;
  rule?: string;
}

/** The durable SQLite store, with the Rust store's schema. */
export declare class SqliteStore {
  constructor(path: string, options?: { busyTimeoutMs?: number; synchronous?: "NORMAL" | "FULL" });
  readonly path: string;
  /** The better-sqlite3 connection, for business tables. */
  readonly db: Database;
  /** Runs fn in one BEGIN IMMEDIATE transaction (a savepoint when nested); the store's writes inside join it. */
  transaction<T>(fn: (db: Database) => T): T;
  count(): number;
  close(): void;
}

export declare const MIGRATIONS: readonly string[];

export interface BeginRequest extends Key {
  attributes?: Array<[string, string]>;
  /** Bytes or a string (raw unless bodyKind is "json"), or any value, sent as its JSON text. */
  body?: Uint8Array | string | unknown;
  bodyKind?: "json" | "raw";
  policy?: Policy;
}

export interface ReconcileReport {
  examined: number;
  succeeded: number;
  released: number;
  leftForManual: number;
  skipped: number;
  lookupErrors: number;
}

export interface KeyStatus {
  status: Status;
  createdAt: number;
  updatedAt: number;
  expiresAt: number | null;
  leaseUntil: number | null;
  resultRef: string | null;
  attempts: number;
  fencingToken: number;
  fingerprint: string;
  fingerprintVersion: number;
  expired: boolean;
}

/** The idem engine component in this process. */
export declare class Idem {
  constructor(options: { store: SqliteStore | object; clock?: Clock; results?: Results });
  begin(request: BeginRequest): Decision;
  complete(ticket: Ticket, policy: Policy | undefined, success?: SuccessInput): Completion;
  fail(ticket: Ticket, policy: Policy | undefined, failure: { code: string; message?: string; response?: ResponseInput },
    disposition?: "retryable" | "final" | "outcome-unknown"): Completion;
  extend(ticket: Ticket, policy?: Policy): { extended: true; leaseUntil: number } | { extended: false };
  reconcile(bizType: string, policy?: Policy, limit?: number): ReconcileReport;
  sweep(limit?: number): number;
  inspect(key: Key): KeyStatus | null;
}

export interface MakeIdempotentOptions<A extends unknown[], R> {
  idem: Idem;
  bizType: string;
  /** Selects the idempotency key from the arguments. */
  key: (...args: A) => string;
  /** The key's scope (default "default"). */
  scope?: string | ((...args: A) => string);
  /** Selects what must be equal for a replay (default: every argument). */
  fingerprint?: (...args: A) => unknown;
  policy?: Policy;
  /** What a thrown error means (default "retryable"). */
  classify?: (error: unknown) => "retryable" | "final" | "outcome-unknown";
  resultRef?: (result: R) => string | undefined;
}

/** Powertools-style wrapper: calls with the same key run `fn` once and replay its (JSON) result. */
export declare function makeIdempotent<A extends unknown[], R>(
  fn: (...args: A) => Promise<R> | R, options: MakeIdempotentOptions<A, R>): (...args: A) => Promise<R>;

export declare class IdempotencyError extends Error {}
export declare class IdempotencyInProgressError extends IdempotencyError { retryAfterMs: number }
export declare class IdempotencyKeyMismatchError extends IdempotencyError { storedPrefix: string }
export declare class IdempotencyFailedError extends IdempotencyError { code: string; failureMessage: string }
export declare class IdempotencyOutcomeUnknownError extends IdempotencyError { since: number; attempts: number }
export declare class IdempotencyValidationError extends IdempotencyError { field: string; rule: string }
export declare class IdempotencyLostOwnershipError extends IdempotencyError { result: unknown }

export interface MiddlewareOptions {
  idem: Idem;
  /** Default "http", as the proxy. */
  bizType?: string;
  policy?: Policy;
  /** Every method needs a key ("required") or none does ("optional"); default: POST and PATCH need one. */
  key?: "required" | "optional";
  /** 5xx answers are not stored unless "store". */
  serverErrors?: "retry" | "store";
  onError?: (error: Error) => void;
}

/** The idempotency middleware for Express (or any (req, res, next) framework): the proxy's HTTP rules. */
export declare function idempotency(options: MiddlewareOptions):
  (req: IncomingMessage, res: ServerResponse, next: (err?: unknown) => void) => Promise<void>;

export declare function componentInfo(): { sha256: string; bytes: number };

/** The error handler to mount after the routes: a failed handler leaves the key's outcome unknown (500, then 409 outcome-unknown). */
export declare function idempotencyErrors():
  (err: unknown, req: IncomingMessage, res: ServerResponse, next: (err?: unknown) => void) => void;
