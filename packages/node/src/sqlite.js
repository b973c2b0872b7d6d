// The durable SQLite store, on better-sqlite3. The schema, the unique index
// and the encoding are the Rust crate's (its schema files,
// host/sqlite/schema/N.sql, are built into dist/schema.js): a file
// written by one is read by the other, and processes in any of the
// languages may use one file at once.

import Database from "better-sqlite3";

import { I64_MAX, StoreError } from "./host.js";

/**
 * The schema versions, exactly as the Rust store creates them: its files
 * host/sqlite/schema/N.sql, which scripts/build.js writes into dist/.
 */
export const MIGRATIONS = await loadMigrations();

async function loadMigrations() {
  try {
    return (await import("../dist/schema.js")).MIGRATIONS;
  } catch (e) {
    throw new Error(`idem: no SQLite schema in dist/ (build it with scripts/build.js): ${e.message}`);
  }
}

const COLUMNS = "id, scope_key, biz_type, idem_key, request_hash, fingerprint_version, status, "
  + "fencing_token, revision, attempts, lease_until, created_at, updated_at, expires_at, "
  + "result_ref, response, failure";

const SQL_INSERT = `INSERT INTO idempotency_record (
        scope_key, biz_type, idem_key, request_hash, fingerprint_version, status,
        fencing_token, revision, attempts, lease_until, created_at, updated_at, expires_at,
        result_ref, response, failure)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (scope_key, biz_type, idem_key) DO NOTHING
    RETURNING id`;
const SQL_GET = `SELECT ${COLUMNS} FROM idempotency_record WHERE scope_key = ? AND biz_type = ? AND idem_key = ?`;
// The Rust store's statement, with better-sqlite3's positional parameters:
// the SET values (parameters 4 to 16 of the insert), then the key, the
// expected revision and the id.
const SQL_SWAP = `UPDATE idempotency_record SET
        request_hash = ?, fingerprint_version = ?, status = ?, fencing_token = ?,
        revision = ?, attempts = ?, lease_until = ?, created_at = ?, updated_at = ?,
        expires_at = ?, result_ref = ?, response = ?, failure = ?
    WHERE scope_key = ? AND biz_type = ? AND idem_key = ? AND revision = ? AND id = ?`;
const SQL_DELETE_EXPIRED = `DELETE FROM idempotency_record WHERE id IN (
        SELECT id FROM idempotency_record
        WHERE (status = 'succeeded' OR status = 'failed' OR status = 'released')
            AND expires_at <= ?
        ORDER BY expires_at, id
        LIMIT ?)`;
const SQL_LIST_STALE = `SELECT ${COLUMNS} FROM idempotency_record
        WHERE biz_type = :biz AND status = 'processing' AND lease_until <= :now
            AND (updated_at, id) > (:afterAt, :afterId)
    UNION ALL
    SELECT ${COLUMNS} FROM idempotency_record
        WHERE biz_type = :biz AND status = 'outcome-unknown'
            AND (updated_at, id) > (:afterAt, :afterId)
    ORDER BY updated_at, id
    LIMIT :limit`;

const STATUSES = new Set(["processing", "succeeded", "failed", "released", "outcome-unknown"]);

/** Maps a SQLite error onto the store contract, as the Rust store does. */
export function mapError(e) {
  if (e instanceof StoreError) return e;
  const code = typeof e?.code === "string" ? e.code : "";
  const msg = `sqlite: ${e?.message ?? String(e)}`;
  if (/^SQLITE_(BUSY|LOCKED|PROTOCOL|IOERR|FULL|CANTOPEN)/.test(code)) return new StoreError("unavailable", msg);
  if (/^SQLITE_(CONSTRAINT|TOOBIG)/.test(code)) return new StoreError("rejected", msg);
  return new StoreError("internal", msg);
}

function sleepMs(ms) {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

function i64(v, field) {
  const b = BigInt(v);
  if (b > I64_MAX) throw new StoreError("rejected", `${field} = ${b} is above ${I64_MAX}, the largest integer SQLite stores`);
  return b;
}

// A time or id beyond SQLite's integers compares as its largest one, as the
// Rust store's `saturate` does.
const clampI64 = (v) => (BigInt(v) > I64_MAX ? I64_MAX : BigInt(v));

const optI64 = (v, field) => (v === undefined || v === null ? null : i64(v, field));

// The Rust store's JSON: byte strings are base64 (schema version 2).
const b64 = (v) => Buffer.from(v.buffer, v.byteOffset, v.byteLength).toString("base64");
const responseJson = (r) => ({ status: r.status, headers: r.headers.map(([n, v]) => [n, b64(v)]), body: b64(r.body) });
const encodeResponse = (r) => (r === undefined || r === null ? null : Buffer.from(JSON.stringify(responseJson(r))));
const encodeFailure = (f) => (f === undefined || f === null ? null
  : Buffer.from(JSON.stringify({ code: f.code, message: f.message, response: f.response ? responseJson(f.response) : null })));

function decodeJson(buf, column) {
  try {
    return JSON.parse(Buffer.from(buf).toString("utf8"));
  } catch (e) {
    throw new StoreError("internal", `column ${column} cannot be decoded: ${e.message}`);
  }
}

// Padded base64 of the standard alphabet, as the Rust store writes it.
const BASE64 = /^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/;

/** A stored byte string: base64, or the array of numbers that schema version 1 wrote. */
function bytesOf(v, column) {
  if (typeof v === "string") {
    if (!BASE64.test(v)) throw new StoreError("internal", `column ${column} cannot be decoded: invalid base64`);
    return new Uint8Array(Buffer.from(v, "base64"));
  }
  if (!Array.isArray(v) || v.some((x) => !Number.isInteger(x) || x < 0 || x > 255)) {
    throw new StoreError("internal", `column ${column} cannot be decoded: expected a base64 string or an array of bytes`);
  }
  return Uint8Array.from(v);
}

function responseOf(j, column) {
  if (j === null || j === undefined) return undefined;
  if (typeof j !== "object" || !Number.isInteger(j.status) || !Array.isArray(j.headers)) {
    throw new StoreError("internal", `column ${column} cannot be decoded: not a stored response`);
  }
  return {
    status: j.status,
    headers: j.headers.map((h) => {
      if (!Array.isArray(h) || h.length !== 2 || typeof h[0] !== "string") throw new StoreError("internal", `column ${column} cannot be decoded: a header is not a [name, bytes] pair`);
      return [h[0], bytesOf(h[1], column)];
    }),
    body: bytesOf(j.body, column),
  };
}

function u64(v, column) {
  const b = BigInt(v);
  if (b < 0n) throw new StoreError("internal", `column ${column} holds negative value ${b}`);
  return b;
}

function u32(v, column) {
  const b = BigInt(v);
  if (b < 0n || b > 0xffffffffn) throw new StoreError("internal", `column ${column} holds ${b}, outside 0..=u32::MAX`);
  return Number(b);
}

/** Decodes one row (safe integers: every INTEGER is a BigInt). */
function decodeRow(r) {
  if (!STATUSES.has(r.status)) throw new StoreError("internal", `column status holds unknown status ${JSON.stringify(r.status)}`);
  let failure;
  if (r.failure !== null) {
    const f = decodeJson(r.failure, "failure");
    if (!f || typeof f.code !== "string" || typeof f.message !== "string") throw new StoreError("internal", "column failure cannot be decoded: not a failure");
    failure = { code: f.code, message: f.message, response: responseOf(f.response, "failure") };
  }
  return {
    id: u64(r.id, "id"),
    key: { scope: r.scope_key, bizType: r.biz_type, idemKey: r.idem_key },
    fingerprint: r.request_hash,
    fingerprintVersion: u32(r.fingerprint_version, "fingerprint_version"),
    status: r.status,
    fencingToken: u64(r.fencing_token, "fencing_token"),
    revision: u64(r.revision, "revision"),
    attempts: u32(r.attempts, "attempts"),
    leaseUntil: r.lease_until === null ? undefined : u64(r.lease_until, "lease_until"),
    createdAt: u64(r.created_at, "created_at"),
    updatedAt: u64(r.updated_at, "updated_at"),
    expiresAt: r.expires_at === null ? undefined : u64(r.expires_at, "expires_at"),
    resultRef: r.result_ref === null ? undefined : r.result_ref,
    response: r.response === null ? undefined : responseOf(decodeJson(r.response, "response"), "response"),
    failure,
  };
}

/** Parameters 1 to 16 of the insert and the swap. */
function encode(rec) {
  return [
    rec.key.scope, rec.key.bizType, rec.key.idemKey, rec.fingerprint, BigInt(rec.fingerprintVersion), rec.status,
    i64(rec.fencingToken, "fencing_token"), i64(rec.revision, "revision"), BigInt(rec.attempts),
    optI64(rec.leaseUntil, "lease_until"), i64(rec.createdAt, "created_at"), i64(rec.updatedAt, "updated_at"),
    optI64(rec.expiresAt, "expires_at"), rec.resultRef ?? null, encodeResponse(rec.response), encodeFailure(rec.failure),
  ];
}

/**
 * The durable store: one SQLite database file in WAL mode, the Rust store's
 * schema. Several processes (in Node, Python or Rust) may open one file at
 * once; the unique index decides every insert race.
 *
 * `store.db` is the better-sqlite3 connection, for business tables;
 * `store.transaction(fn)` runs `fn` in one `BEGIN IMMEDIATE` transaction,
 * in which the store's own writes (e.g. `complete`) join the business write.
 */
export class SqliteStore {
  /**
   * @param {string} path the database file (created if missing)
   * @param {{ busyTimeoutMs?: number, synchronous?: "NORMAL" | "FULL" }} [options]
   */
  constructor(path, { busyTimeoutMs = 5000, synchronous = "NORMAL" } = {}) {
    if (typeof path !== "string" || path.length === 0) throw new TypeError("SqliteStore: path must be a non-empty string");
    if (!Number.isInteger(busyTimeoutMs) || busyTimeoutMs < 0 || busyTimeoutMs >= 2 ** 31) {
      throw new TypeError("SqliteStore: busyTimeoutMs must be an integer from 0 to 2^31 - 1");
    }
    if (synchronous !== "NORMAL" && synchronous !== "FULL") throw new TypeError('SqliteStore: synchronous must be "NORMAL" or "FULL"');
    this.path = path;
    try {
      this.db = new Database(path, { timeout: busyTimeoutMs });
      this.db.defaultSafeIntegers(true);
      this.#enableWal(busyTimeoutMs);
      this.db.pragma(`synchronous = ${synchronous}`);
      this.db.pragma("foreign_keys = ON");
      this.#migrate();
    } catch (e) {
      throw mapError(e);
    }
    this.stmts = {
      insert: this.db.prepare(SQL_INSERT),
      get: this.db.prepare(SQL_GET),
      swap: this.db.prepare(SQL_SWAP),
      deleteExpired: this.db.prepare(SQL_DELETE_EXPIRED),
      listStale: this.db.prepare(SQL_LIST_STALE),
    };
  }

  /** WAL needs an exclusive lock for the switch: retry while another process opens the file. */
  #enableWal(timeoutMs) {
    const deadline = Date.now() + timeoutMs;
    let pause = 1;
    for (;;) {
      try {
        const mode = String(this.db.pragma("journal_mode = WAL", { simple: true }));
        if (mode.toLowerCase() !== "wal") {
          throw new StoreError("internal", `journal_mode=WAL was not accepted (the database stays in ${mode} mode); the store needs a database file on a local file system`);
        }
        return;
      } catch (e) {
        if (!(e?.code === "SQLITE_BUSY" && Date.now() < deadline)) throw e;
        sleepMs(pause);
        pause = Math.min(pause * 2, 50);
      }
    }
  }

  #migrate() {
    const version = () => Number(this.db.pragma("user_version", { simple: true }));
    const check = (v) => {
      if (v > MIGRATIONS.length) throw new StoreError("internal", `the database has schema version ${v}; this build knows versions up to ${MIGRATIONS.length}`);
      return v;
    };
    if (check(version()) === MIGRATIONS.length) return;
    this.db.transaction(() => {
      for (let i = check(version()); i < MIGRATIONS.length; i++) {
        this.db.exec(MIGRATIONS[i]);
        this.db.pragma(`user_version = ${i + 1}`);
      }
    }).immediate();
  }

  /**
   * Runs `fn(db)` in one write transaction (`BEGIN IMMEDIATE`; a savepoint
   * when one is open already) and returns its result. A throw rolls back.
   */
  transaction(fn) {
    return this.db.transaction(() => fn(this.db)).immediate();
  }

  #write(f) {
    try {
      return this.db.transaction(f).immediate();
    } catch (e) {
      throw mapError(e);
    }
  }

  #read(f) {
    try {
      return f();
    } catch (e) {
      throw mapError(e);
    }
  }

  #get(key) {
    const row = this.stmts.get.get(key.scope, key.bizType, key.idemKey);
    return row === undefined ? undefined : decodeRow(row);
  }

  /** `store.insert-if-absent`: decided by the unique index, atomically. */
  insertIfAbsent(candidate) {
    const params = encode(candidate);
    return this.#write(() => {
      const row = this.stmts.insert.get(...params);
      if (row !== undefined) return { tag: "inserted", val: { ...candidate, id: u64(row.id, "id") } };
      const existing = this.#get(candidate.key);
      if (existing === undefined) throw new StoreError("internal", "the insert was refused by the unique key, yet no record has the key");
      return { tag: "existing", val: existing };
    });
  }

  /** `store.get`: none only when no record has the key. */
  get(key) {
    return this.#read(() => this.#get(key));
  }

  /** `store.compare-and-swap`, on id and revision. */
  compareAndSwap(expectedRevision, replacement) {
    const params = encode(replacement);
    return this.#write(() => {
      // A revision or id SQLite cannot store is not stored: nothing matches it.
      if (BigInt(expectedRevision) <= I64_MAX && BigInt(replacement.id) <= I64_MAX) {
        const changed = this.stmts.swap.run(...params.slice(3), ...params.slice(0, 3), BigInt(expectedRevision), BigInt(replacement.id)).changes;
        if (changed > 0) return { tag: "swapped" };
      }
      return { tag: "stale", val: this.#get(replacement.key) };
    });
  }

  /** `store.delete-expired`. */
  deleteExpired(now, limit) {
    return this.#read(() => this.stmts.deleteExpired.run(clampI64(now), BigInt(limit)).changes);
  }

  /**
   * `store.list-stale`: oldest (`updated_at`, `id`) first, strictly after
   * `after` ({ updatedAt, id }) when given.
   */
  listStale(bizType, now, after, limit) {
    const params = {
      biz: bizType,
      now: clampI64(now),
      // Before every stored row (times and ids are never negative).
      afterAt: after ? clampI64(after.updatedAt) : -1n,
      afterId: after ? clampI64(after.id) : -1n,
      limit: BigInt(limit),
    };
    return this.#read(() => this.stmts.listStale.all(params).map(decodeRow));
  }

  /** How many records the file holds. */
  count() {
    return Number(this.#read(() => this.db.prepare("SELECT COUNT(*) AS n FROM idempotency_record").get().n));
  }

  close() {
    this.db.close();
  }
}
