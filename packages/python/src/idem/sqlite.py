"""The durable SQLite store, on the standard library's sqlite3. The schema,
the unique index and the encoding are the Rust crate's (its schema files,
host/sqlite/schema/N.sql, ship in this package as idem/schema): a file
written by one is read by the other, and processes in any of the languages
may use one file at once."""

from __future__ import annotations

import binascii
import contextlib
import functools
import json
import sqlite3
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from wasmtime.component import Record, Variant

from ._host import I64_MAX, StoreError, get, record

T = TypeVar("T")


@functools.lru_cache(maxsize=None)
def migrations() -> tuple[str, ...]:
    """The schema versions, exactly as the Rust store creates them: files
    1.sql … N.sql of the package's copy of host/sqlite/schema (package data
    in a wheel), or of host/sqlite/schema itself when this module runs from
    the repository's source tree."""
    for schema in (resources.files("idem").joinpath("schema"), *_repository_schema()):
        found: list[str] = []
        while schema.joinpath(f"{len(found) + 1}.sql").is_file():
            found.append(schema.joinpath(f"{len(found) + 1}.sql").read_text(encoding="utf-8"))
        if found:
            return tuple(found)
    raise StoreError("internal", "the package holds no SQLite schema (idem/schema/1.sql): build the wheel "
                     "with host/sqlite/schema copied into src/idem/schema")


def _repository_schema() -> list[Path]:
    """host/sqlite/schema, when this file is the repository's
    packages/python/src/idem/sqlite.py."""
    here = Path(__file__).resolve()
    if len(here.parents) < 5 or here.parents[3].name != "packages":
        return []
    return [here.parents[4] / "host" / "sqlite" / "schema"]

COLUMNS = ("id, scope_key, biz_type, idem_key, request_hash, fingerprint_version, status, "
           "fencing_token, revision, attempts, lease_until, created_at, updated_at, expires_at, "
           "result_ref, response, failure")

SQL_INSERT = """INSERT INTO idempotency_record (
        scope_key, biz_type, idem_key, request_hash, fingerprint_version, status,
        fencing_token, revision, attempts, lease_until, created_at, updated_at, expires_at,
        result_ref, response, failure)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)
    ON CONFLICT (scope_key, biz_type, idem_key) DO NOTHING
    RETURNING id"""
SQL_GET = f"SELECT {COLUMNS} FROM idempotency_record WHERE scope_key = ?1 AND biz_type = ?2 AND idem_key = ?3"
SQL_SWAP = """UPDATE idempotency_record SET
        request_hash = ?4, fingerprint_version = ?5, status = ?6, fencing_token = ?7,
        revision = ?8, attempts = ?9, lease_until = ?10, created_at = ?11, updated_at = ?12,
        expires_at = ?13, result_ref = ?14, response = ?15, failure = ?16
    WHERE scope_key = ?1 AND biz_type = ?2 AND idem_key = ?3 AND revision = ?17 AND id = ?18"""
SQL_DELETE_EXPIRED = """DELETE FROM idempotency_record WHERE id IN (
        SELECT id FROM idempotency_record
        WHERE (status = 'succeeded' OR status = 'failed' OR status = 'released')
            AND expires_at <= ?1
        ORDER BY expires_at, id
        LIMIT ?2)"""
SQL_LIST_STALE = f"""SELECT {COLUMNS} FROM idempotency_record
        WHERE biz_type = ?1 AND status = 'processing' AND lease_until <= ?2
            AND (updated_at, id) > (?4, ?5)
    UNION ALL
    SELECT {COLUMNS} FROM idempotency_record
        WHERE biz_type = ?1 AND status = 'outcome-unknown'
            AND (updated_at, id) > (?4, ?5)
    ORDER BY updated_at, id
    LIMIT ?3"""

STATUSES = ("processing", "succeeded", "failed", "released", "outcome-unknown")


def map_error(e: BaseException) -> StoreError:
    """A SQLite error in the store contract's terms, as the Rust store maps them."""
    if isinstance(e, StoreError):
        return e
    name = getattr(e, "sqlite_errorname", "") or ""
    msg = f"sqlite: {e}"
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_PROTOCOL", "SQLITE_IOERR", "SQLITE_FULL", "SQLITE_CANTOPEN")):
        return StoreError("unavailable", msg)
    if isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "unable to open" in str(e) or "disk" in str(e)):
        return StoreError("unavailable", msg)
    if name.startswith(("SQLITE_CONSTRAINT", "SQLITE_TOOBIG")) or isinstance(e, (sqlite3.IntegrityError, OverflowError)):
        return StoreError("rejected", msg)
    return StoreError("internal", msg)


def _i64(v: int, field: str) -> int:
    if v > I64_MAX:
        raise StoreError("rejected", f"{field} = {v} is above {I64_MAX}, the largest integer SQLite stores")
    return v


def _opt_i64(v: int | None, field: str) -> int | None:
    return None if v is None else _i64(v, field)


def _b64(b: bytes) -> str:
    return binascii.b2a_base64(b, newline=False).decode("ascii")


def _response_json(r: Any) -> dict[str, Any]:
    # The Rust store's JSON: byte strings are base64 (schema version 2).
    return {"status": r.status, "headers": [[n, _b64(v)] for n, v in r.headers], "body": _b64(r.body)}


def _encode_response(r: Any) -> bytes | None:
    return None if r is None else json.dumps(_response_json(r), separators=(",", ":")).encode()


def _encode_failure(f: Any) -> bytes | None:
    if f is None:
        return None
    resp = None if f.response is None else _response_json(f.response)
    return json.dumps({"code": f.code, "message": f.message, "response": resp}, separators=(",", ":"), ensure_ascii=False).encode()


def _decode_json(b: bytes, column: str) -> Any:
    try:
        return json.loads(bytes(b).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreError("internal", f"column {column} cannot be decoded: {e}") from e


def _bytes_of(v: Any, column: str) -> bytes:
    """A stored byte string: base64, or the array of numbers that schema
    version 1 wrote."""
    if isinstance(v, str):
        try:
            return binascii.a2b_base64(v, strict_mode=True)
        except (binascii.Error, ValueError) as e:
            raise StoreError("internal", f"column {column} cannot be decoded: invalid base64: {e}") from e
    if isinstance(v, list):
        try:
            return bytes(v)
        except (TypeError, ValueError) as e:
            raise StoreError("internal", f"column {column} cannot be decoded: {e}") from e
    raise StoreError("internal", f"column {column} cannot be decoded: expected a base64 string or an array of bytes")


def _response_of(j: Any, column: str) -> Record | None:
    if j is None:
        return None
    if not isinstance(j, dict) or not isinstance(j.get("status"), int) or not isinstance(j.get("headers"), list):
        raise StoreError("internal", f"column {column} cannot be decoded: not a stored response")
    headers = []
    for h in j["headers"]:
        if not (isinstance(h, list) and len(h) == 2 and isinstance(h[0], str)):
            raise StoreError("internal", f"column {column} cannot be decoded: a header is not a [name, bytes] pair")
        headers.append((h[0], _bytes_of(h[1], column)))
    return record(status=j["status"], headers=headers, body=_bytes_of(j.get("body"), column))


def _u64(v: Any, column: str) -> int:
    if not isinstance(v, int) or v < 0:
        raise StoreError("internal", f"column {column} holds negative value {v}")
    return v


def _u32(v: Any, column: str) -> int:
    if not isinstance(v, int) or v < 0 or v > 0xFFFFFFFF:
        raise StoreError("internal", f"column {column} holds {v}, outside 0..=u32::MAX")
    return v


def decode_row(r: tuple) -> Record:
    """One row selected with COLUMNS as a component `stored-record`."""
    (id_, scope, biz, idem_key, fp, fpv, status, token, rev, attempts, lease, created, updated, expires,
     result_ref, response, failure) = r
    if status not in STATUSES:
        raise StoreError("internal", f"column status holds unknown status {status!r}")
    fail = None
    if failure is not None:
        f = _decode_json(failure, "failure")
        if not (isinstance(f, dict) and isinstance(f.get("code"), str) and isinstance(f.get("message"), str)):
            raise StoreError("internal", "column failure cannot be decoded: not a failure")
        fail = record(code=f["code"], message=f["message"], response=_response_of(f.get("response"), "failure"))
    return record(
        id=_u64(id_, "id"),
        key=record(scope=scope, biz_type=biz, idem_key=idem_key),
        fingerprint=fp,
        fingerprint_version=_u32(fpv, "fingerprint_version"),
        status=status,
        fencing_token=_u64(token, "fencing_token"),
        revision=_u64(rev, "revision"),
        attempts=_u32(attempts, "attempts"),
        lease_until=None if lease is None else _u64(lease, "lease_until"),
        created_at=_u64(created, "created_at"),
        updated_at=_u64(updated, "updated_at"),
        expires_at=None if expires is None else _u64(expires, "expires_at"),
        result_ref=result_ref,
        response=None if response is None else _response_of(_decode_json(response, "response"), "response"),
        failure=fail,
    )


def _encode(rec: Any) -> tuple:
    k = rec.key
    return (
        k.scope, get(k, "biz-type"), get(k, "idem-key"), rec.fingerprint, get(rec, "fingerprint-version"), rec.status,
        _i64(get(rec, "fencing-token"), "fencing_token"), _i64(rec.revision, "revision"), rec.attempts,
        _opt_i64(get(rec, "lease-until"), "lease_until"), _i64(get(rec, "created-at"), "created_at"),
        _i64(get(rec, "updated-at"), "updated_at"), _opt_i64(get(rec, "expires-at"), "expires_at"),
        get(rec, "result-ref"), _encode_response(rec.response), _encode_failure(rec.failure),
    )


class SqliteStore:
    """The durable store: one SQLite file in WAL mode with the Rust store's
    schema. Several processes (Python, Node or Rust) may open one file at
    once; the unique index decides every insert race.

    ``store.connection`` is the sqlite3 connection (autocommit mode), for
    business tables; ``with store.transaction() as conn:`` opens one
    ``BEGIN IMMEDIATE`` transaction in which the store's own writes (e.g.
    ``complete``) join the business write, committed together.
    """

    def __init__(self, path: str, *, busy_timeout_ms: int = 5000, synchronous: str = "NORMAL"):
        if not isinstance(path, str) or not path:
            raise ValueError("SqliteStore: path must be a non-empty string")
        if isinstance(busy_timeout_ms, bool) or not isinstance(busy_timeout_ms, int) or not 0 <= busy_timeout_ms < 2**31:
            raise ValueError("SqliteStore: busy_timeout_ms must be an integer from 0 to 2^31 - 1")
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError('SqliteStore: synchronous must be "NORMAL" or "FULL"')
        self.path = path
        self._lock = threading.RLock()
        # Used under self._lock (every read and write holds it).
        self._depth = 0
        try:
            self.connection = sqlite3.connect(path, timeout=busy_timeout_ms / 1000, isolation_level=None,
                                              check_same_thread=False)
            self._enable_wal(busy_timeout_ms)
            self.connection.execute(f"PRAGMA synchronous = {synchronous}")
            self.connection.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except (sqlite3.Error, OverflowError) as e:
            raise map_error(e) from e

    def _enable_wal(self, timeout_ms: int) -> None:
        # The switch needs an exclusive lock: retry while another process opens the file.
        deadline = time.monotonic() + timeout_ms / 1000
        pause = 0.001
        while True:
            try:
                mode = self.connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() >= deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        if str(mode).lower() != "wal":
            raise StoreError("internal", f"journal_mode=WAL was not accepted (the database stays in {mode} mode); "
                             "the store needs a database file on a local file system")

    def _migrate(self) -> None:
        versions = migrations()

        def version() -> int:
            v = self.connection.execute("PRAGMA user_version").fetchone()[0]
            if v > len(versions):
                raise StoreError("internal", f"the database has schema version {v}; this build knows versions up to {len(versions)}")
            return v

        if version() == len(versions):
            return
        c = self.connection
        c.execute("BEGIN IMMEDIATE")
        try:
            for i in range(version(), len(versions)):
                for stmt in versions[i].split(";"):
                    if stmt.strip():
                        c.execute(stmt)
                c.execute(f"PRAGMA user_version = {i + 1}")
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``; a savepoint inside an
        open one): committed when the block ends, rolled back on an exception."""
        with self._lock:
            c = self.connection
            name = f"idem_sp{self._depth}"
            try:
                c.execute("BEGIN IMMEDIATE" if self._depth == 0 else f"SAVEPOINT {name}")
            except (sqlite3.Error, OverflowError) as e:
                raise map_error(e) from e
            self._depth += 1
            try:
                yield c
            except BaseException:
                self._depth -= 1
                if self._depth == 0:
                    if c.in_transaction:
                        c.execute("ROLLBACK")
                else:
                    c.execute(f"ROLLBACK TO {name}")
                    c.execute(f"RELEASE {name}")
                raise
            self._depth -= 1
            try:
                c.execute("COMMIT" if self._depth == 0 else f"RELEASE {name}")
            except (sqlite3.Error, OverflowError) as e:
                if self._depth == 0 and c.in_transaction:
                    c.execute("ROLLBACK")
                raise map_error(e) from e

    def _write(self, f: Callable[[sqlite3.Connection], T]) -> T:
        try:
            with self.transaction() as c:
                return f(c)
        except (sqlite3.Error, OverflowError) as e:
            raise map_error(e) from e

    def _read(self, f: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            try:
                return f(self.connection)
            except (sqlite3.Error, OverflowError) as e:
                raise map_error(e) from e

    def _get(self, c: sqlite3.Connection, key: Any) -> Record | None:
        row = c.execute(SQL_GET, (key.scope, get(key, "biz-type"), get(key, "idem-key"))).fetchone()
        return None if row is None else decode_row(row)

    def insert_if_absent(self, candidate: Any) -> Variant:
        """`store.insert-if-absent`: decided by the unique index, atomically."""
        params = _encode(candidate)

        def op(c: sqlite3.Connection) -> Variant:
            row = c.execute(SQL_INSERT, params).fetchone()
            if row is not None:
                inserted = Record()
                inserted.__dict__.update(candidate.__dict__)
                inserted.id = _u64(row[0], "id")
                return Variant("inserted", inserted)
            existing = self._get(c, candidate.key)
            if existing is None:
                raise StoreError("internal", "the insert was refused by the unique key, yet no record has the key")
            return Variant("existing", existing)

        return self._write(op)

    def get(self, key: Any) -> Record | None:
        """`store.get`: None only when no record has the key."""
        return self._read(lambda c: self._get(c, key))

    def compare_and_swap(self, expected_revision: int, replacement: Any) -> Variant:
        """`store.compare-and-swap`, on id and revision."""
        params = _encode(replacement)

        def op(c: sqlite3.Connection) -> Variant:
            # A revision or id SQLite cannot store is not stored: nothing matches it.
            if expected_revision <= I64_MAX and replacement.id <= I64_MAX:
                if c.execute(SQL_SWAP, params + (expected_revision, replacement.id)).rowcount > 0:
                    return Variant("swapped")
            return Variant("stale", self._get(c, replacement.key))

        return self._write(op)

    def delete_expired(self, now: int, limit: int) -> int:
        """`store.delete-expired`."""
        return self._read(lambda c: c.execute(SQL_DELETE_EXPIRED, (min(now, I64_MAX), limit)).rowcount)

    def list_stale(self, biz_type: str, now: int, after: Any, limit: int) -> list[Record]:
        """`store.list-stale`: oldest (`updated_at`, `id`) first, strictly
        after `after` (a `stale-cursor` record: `updated-at`, `id`) when
        given."""
        # Without a cursor, before every stored row (times and ids are never
        # negative); beyond SQLite's integers, its largest one.
        after_at, after_id = (-1, -1) if after is None else (min(get(after, "updated-at"), I64_MAX), min(after.id, I64_MAX))
        params = (biz_type, min(now, I64_MAX), limit, after_at, after_id)
        return self._read(lambda c: [decode_row(r) for r in c.execute(SQL_LIST_STALE, params)])

    def count(self) -> int:
        """How many records the file holds."""
        return self._read(lambda c: c.execute("SELECT COUNT(*) FROM idempotency_record").fetchone()[0])

    def close(self) -> None:
        self.connection.close()
