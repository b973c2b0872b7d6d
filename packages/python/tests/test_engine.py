"""The engine through the real component and a real SQLite file."""

import pytest

from conftest import T0
from idem import EngineError, Idem, LostOwnership, Recorded, Response, SqliteStore, Success

S, B = "tenant-1", "order.create"


def test_execute_complete_replay_from_the_file(env):
    d = env.idem.begin(S, B, "k1", body={"sku": "A1", "qty": 2})
    assert d.decision == "execute" and d.fencing_token == 1 and d.attempt == 1
    resp = Response(201, [("content-type", b"application/json")], b'{"order":"order-1"}')
    c = env.idem.complete(d.ticket, result_ref="order-1", response=resp)
    assert c == Recorded("succeeded") and (c.completion, c.status) == ("recorded", "succeeded")
    other = Idem(SqliteStore(env.path), clock=env.clock)
    r = other.begin(S, B, "k1", body=b'{ "qty": 2, "sku": "A1" }', body_kind="json")
    assert r.decision == "replay"
    assert r.result_ref == "order-1"
    assert r.response == resp
    assert r.completed_at == T0


def test_mismatch(env):
    d = env.idem.begin(S, B, "k1", body={"sku": "A1"})
    env.idem.complete(d.ticket, result_ref="order-1")
    m = env.idem.begin(S, B, "k1", body={"sku": "B7"})
    assert m.decision == "mismatch" and len(m.stored_prefix) == 8 and m.stored_version == 2


def test_in_progress(env):
    assert env.idem.begin(S, B, "k1", body={}).decision == "execute"
    p = env.idem.begin(S, B, "k1", body={}, policy={"retry_after_ms": 700})
    assert p.decision == "in-progress" and p.retry_after_ms == 700 and p.lease_until == T0 + 60_000


def test_lease_take_over_with_fencing(env):
    policy = {"lease_ms": 1000}
    first = env.idem.begin(S, B, "k1", body={}, policy=policy)
    env.clock.advance(1001)
    second = env.idem.begin(S, B, "k1", body={}, policy=policy)
    assert second.decision == "execute" and second.fencing_token == 2 and second.attempt == 2
    lost = env.idem.complete(first.ticket, policy, result_ref="stale")
    assert lost == LostOwnership() and lost.completion == "lost-ownership"
    assert env.idem.fail(first.ticket, policy, code="stale", disposition="final") == LostOwnership()
    assert env.idem.extend(first.ticket, policy) is None
    assert env.idem.complete(second.ticket, policy, result_ref="fresh") == Recorded("succeeded")
    r = env.idem.begin(S, B, "k1", body={}, policy=policy)
    assert r.decision == "replay" and r.result_ref == "fresh"


def test_extend(env):
    d = env.idem.begin(S, B, "k1", body={})
    env.clock.advance(5000)
    assert env.idem.extend(d.ticket) == T0 + 5000 + 60_000


def test_final_and_retryable_failures(env):
    a = env.idem.begin(S, B, "final", body={})
    c = env.idem.fail(a.ticket, code="card-declined", message="the card was declined", disposition="final")
    assert c == Recorded("failed")
    f = env.idem.begin(S, B, "final", body={})
    assert f.decision == "failed" and f.failure.code == "card-declined" and f.failure.message == "the card was declined"
    b = env.idem.begin(S, B, "retry", body={})
    assert env.idem.fail(b.ticket, code="db-down", disposition="retryable") == Recorded("released")
    again = env.idem.begin(S, B, "retry", body={})
    assert again.decision == "execute" and again.attempt == 2


def test_always_final_stores_a_retryable_failure_as_final(env):
    policy = {"failure_mode": "always-final"}
    a = env.idem.begin(S, B, "k", body={}, policy=policy)
    assert env.idem.fail(a.ticket, policy, code="e500", disposition="retryable") == Recorded("failed")
    assert env.idem.begin(S, B, "k", body={}, policy=policy).decision == "failed"


def test_max_attempts_stores_the_retryable_failure_of_the_last_attempt_as_final(env):
    policy = {"max_attempts": 2}
    first = env.idem.begin(S, B, "k", body={}, policy=policy)
    assert first.decision == "execute" and first.attempt == 1
    c = env.idem.fail(first.ticket, policy, code="db-down", message="attempt 1", disposition="retryable")
    assert c == Recorded("released") and c.status == "released"
    second = env.idem.begin(S, B, "k", body={}, policy=policy)
    assert second.decision == "execute" and second.attempt == 2
    c = env.idem.fail(second.ticket, policy, code="db-down", message="attempt 2", disposition="retryable")
    assert c == Recorded("failed") and c.status == "failed"
    third = env.idem.begin(S, B, "k", body={}, policy=policy)
    assert third.decision == "failed" and third.failure.code == "db-down" and third.failure.message == "attempt 2"
    s = env.idem.inspect(S, B, "k")
    assert s["status"] == "failed" and s["attempts"] == 2
    # Without a limit (None, the default) the second retryable failure releases the key too.
    unlimited = {"max_attempts": None}
    for attempt in (1, 2):
        d = env.idem.begin(S, B, "open", body={}, policy=unlimited)
        assert d.attempt == attempt
        assert env.idem.fail(d.ticket, unlimited, code="db-down", disposition="retryable") == Recorded("released")
    assert env.idem.begin(S, B, "open", body={}).decision == "execute"


def test_max_attempts_0_is_an_invalid_policy_and_writes_nothing(env):
    zero = {"max_attempts": 0}
    d = env.idem.begin(S, B, "k", body={}, policy=zero)
    assert (d.decision, d.field, d.rule) == ("invalid", "policy", "out-of-range")
    assert env.store.count() == 0 and env.idem.inspect(S, B, "k") is None
    # fail refuses it too, before writing: the key stays processing.
    e = env.idem.begin(S, B, "k", body={})
    env.clock.advance(10)
    with pytest.raises(EngineError) as err:
        env.idem.fail(e.ticket, zero, code="db-down", disposition="retryable")
    assert (err.value.kind, err.value.field, err.value.rule) == ("invalid", "policy", "out-of-range")
    s = env.idem.inspect(S, B, "k")
    assert s["status"] == "processing" and s["updated_at"] == T0 and s["attempts"] == 1
    assert env.idem.begin(S, B, "k", body={}, policy={"max_attempts": 1}).decision == "in-progress"
    # A wrong type or a value no u32 holds is refused before the engine.
    for bad in (-1, "3", True, 1 << 32):
        with pytest.raises(ValueError, match="policy.max_attempts must be an integer from 0 to 4294967295"):
            env.idem.begin(S, B, "k2", body={}, policy={"max_attempts": bad})
    assert env.store.count() == 1


def test_outcome_unknown_manual(env):
    policy = {"expired_lease": "manual", "lease_ms": 1000}
    a = env.idem.begin(S, B, "k", body={}, policy=policy)
    c = env.idem.fail(a.ticket, policy, code="timeout", disposition="outcome-unknown")
    assert c == Recorded("outcome-unknown")
    u = env.idem.begin(S, B, "k", body={}, policy=policy)
    assert u.decision == "outcome-unknown" and u.failure.code == "timeout"
    env.clock.advance(5000)
    assert env.idem.begin(S, B, "k", body={}, policy=policy).decision == "outcome-unknown"


def test_outcome_unknown_stays_blocked_by_default_where_expired_leases_are_taken_over(env):
    policy = {"lease_ms": 1000}
    a = env.idem.begin(S, B, "k", body={}, policy=policy)
    env.idem.fail(a.ticket, policy, code="timeout", disposition="outcome-unknown")
    assert env.idem.begin(S, B, "crashed", body={}, policy=policy).decision == "execute"
    env.clock.advance(5000)
    assert env.idem.begin(S, B, "crashed", body={}, policy=policy).decision == "execute"
    assert env.idem.begin(S, B, "k", body={}, policy=policy).decision == "outcome-unknown"
    retried = dict(policy, outcome_unknown="take-over")
    assert env.idem.begin(S, B, "k", body={}, policy=retried).decision == "execute"


def test_reconcile(make_env):
    class Results:
        def find_result(self, key):
            return "order-77" if getattr(key, "idem-key") == "k" else None

    env = make_env(results=Results())
    policy = {"expired_lease": "reconcile", "lease_ms": 1000}
    env.idem.begin(S, B, "k", body={}, policy=policy)
    env.clock.advance(1001)
    report = env.idem.reconcile(B, policy, 10)
    assert report["examined"] == 1 and report["succeeded"] == 1
    r = env.idem.begin(S, B, "k", body={}, policy=policy)
    assert r.decision == "replay" and r.result_ref == "order-77"


def test_lookup_finds_a_full_response_stored_and_replayed_under_reconcile(make_env):
    resp = Response(201, [("content-type", b"application/json")], b'{"order":"order-8"}')
    lookups = []

    class Results:
        def find_result(self, key):
            lookups.append(getattr(key, "idem-key"))
            return Success(result_ref="order-8", response=resp) if getattr(key, "idem-key") == "k" else None

    env = make_env(results=Results())
    policy = {"expired_lease": "reconcile", "lease_ms": 1000}
    assert env.idem.begin(S, B, "k", body={}, policy=policy).decision == "execute"
    env.clock.advance(1001)
    r = env.idem.begin(S, B, "k", body={}, policy=policy)
    assert lookups == ["k"]
    assert r.decision == "replay" and r.result_ref == "order-8" and r.response == resp
    assert r.completed_at == T0 + 1001
    # Stored: another engine over the file replays it without asking again.
    other = Idem(SqliteStore(env.path), clock=env.clock)
    again = other.begin(S, B, "k", body={}, policy=policy)
    assert lookups == ["k"]
    assert again.decision == "replay" and again.result_ref == "order-8" and again.response == resp
    assert env.idem.inspect(S, B, "k")["status"] == "succeeded"


def test_lookup_result_breaking_completes_rules_is_a_failed_lookup(make_env):
    found = {"k": Response(99, [], b"x")}

    class Results:
        def find_result(self, key):
            return found.get(getattr(key, "idem-key"))

    env = make_env(results=Results())
    policy = {"expired_lease": "reconcile", "lease_ms": 1000}
    assert env.idem.begin(S, B, "k", body={}, policy=policy).decision == "execute"
    env.clock.advance(1001)
    with pytest.raises(EngineError) as e:
        env.idem.begin(S, B, "k", body={}, policy=policy)
    assert e.value.kind == "store" and e.value.store_kind == "internal"
    s = env.idem.inspect(S, B, "k")
    assert s["status"] == "processing" and s["result_ref"] is None and s["attempts"] == 1
    assert s["lease_until"] == T0 + 1000
    # reconcile() reads it as a lookup error too and leaves the key.
    report = env.idem.reconcile(B, policy, 10)
    assert report["lookup_errors"] == 1 and report["succeeded"] == 0
    assert env.idem.inspect(S, B, "k")["status"] == "processing"
    # The key stayed stale: once the lookup answers a valid result, the next begin stores and replays it.
    found["k"] = Success(result_ref="order-9", response=Response(201, [], b"{}"))
    r = env.idem.begin(S, B, "k", body={}, policy=policy)
    assert r.decision == "replay" and r.result_ref == "order-9" and r.response.status == 201


def test_sweep(env):
    policy = {"retention_ms": 1000}
    a = env.idem.begin(S, B, "done", body={}, policy=policy)
    env.idem.complete(a.ticket, policy, result_ref="x")
    env.idem.begin(S, B, "running", body={}, policy=policy)
    env.clock.advance(999)
    assert env.idem.sweep(100) == 0
    env.clock.advance(1)
    assert env.idem.sweep(100) == 1
    assert env.idem.inspect(S, B, "done") is None
    assert env.idem.inspect(S, B, "running")["status"] == "processing"
    assert env.store.count() == 1


def test_bounded_wait_uses_the_injected_clock(env):
    policy = {"in_progress": {"wait": {"max_wait_ms": 3000, "poll_interval_ms": 500}}}
    assert env.idem.begin(S, B, "k", body={}, policy=policy).decision == "execute"
    before = env.clock.now()
    assert env.idem.begin(S, B, "k", body={}, policy=policy).decision == "in-progress"
    assert env.clock.now() - before >= 3000


def test_bad_input_names_the_field_and_the_rule(env):
    bad = env.idem.begin(S, B, "", body={})
    assert (bad.decision, bad.field, bad.rule) == ("invalid", "idem-key", "required")
    nj = env.idem.begin(S, B, "k", body=b"{", body_kind="json")
    assert (nj.decision, nj.field, nj.rule) == ("invalid", "body", "not-json")
    lease = env.idem.begin(S, B, "k", body={}, policy={"lease_ms": 0})
    assert (lease.decision, lease.field) == ("invalid", "policy")
    with pytest.raises(ValueError, match="policy.leaseMs is not a policy field"):
        env.idem.begin(S, B, "k", body={}, policy={"leaseMs": 5})
    with pytest.raises(ValueError, match="policy.expired_lease must be one of"):
        env.idem.begin(S, B, "k", body={}, policy={"expired_lease": "later"})
    with pytest.raises(TypeError, match="key must be a str"):
        env.idem.begin(S, B, 7)


def test_store_failure_is_an_error_not_no_record(env):
    env.store.connection.execute("DROP TABLE idempotency_record")
    with pytest.raises(EngineError) as e:
        env.idem.begin(S, B, "k", body={})
    assert e.value.kind == "store" and "no such table" in str(e.value)
    with pytest.raises(EngineError):
        env.idem.inspect(S, B, "k")


def test_busy_database_is_unavailable(env):
    blocker = SqliteStore(env.path, busy_timeout_ms=0)
    locked = Idem(SqliteStore(env.path, busy_timeout_ms=0))
    blocker.connection.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(EngineError) as e:
            locked.begin(S, B, "k", body={})
        assert e.value.kind == "store" and e.value.store_kind == "unavailable"
    finally:
        blocker.connection.execute("ROLLBACK")
    assert env.idem.begin(S, B, "k", body={}).decision == "execute"


def test_schema_is_the_rust_stores(env):
    c = env.store.connection
    assert c.execute("PRAGMA user_version").fetchone()[0] == 3
    names = [r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'index' ORDER BY name")]
    assert names == ["idempotency_record_outcome_unknown", "idempotency_record_stale_processing",
                     "idempotency_record_sweep", "sqlite_autoindex_idempotency_record_1"]
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_the_schema_ships_in_the_package_and_made_the_file(env):
    from importlib import resources

    from idem.sqlite import migrations

    shipped = resources.files("idem").joinpath("schema")
    assert [shipped.joinpath(f"{v}.sql").read_text(encoding="utf-8") for v in (1, 2, 3)] == list(migrations())
    assert not shipped.joinpath("4.sql").is_file()
    # SQLite keeps each CREATE INDEX as written: the file's text made it.
    sweep = env.store.connection.execute(
        "SELECT sql FROM sqlite_master WHERE name = 'idempotency_record_sweep'").fetchone()[0]
    assert sweep in migrations()[2]


def test_rows_written_by_schema_version_1_are_read_after_the_upgrade(env):
    import json
    import sqlite3

    d = env.idem.begin(S, B, "k", body={})
    env.idem.complete(d.ticket, response=Response(201, [("x-bin", bytes([0, 255]))], b"body"))
    # Version 1 wrote byte strings as arrays of numbers.
    v1 = json.dumps({"status": 201, "headers": [["x-bin", [0, 255]]], "body": list(b"body")}).encode()
    c = sqlite3.connect(env.path)
    c.execute("UPDATE idempotency_record SET response = ?", (v1,))
    c.execute("PRAGMA user_version = 1")
    c.commit()
    c.close()
    store = SqliteStore(env.path)
    assert store.connection.execute("PRAGMA user_version").fetchone()[0] == 3
    r = Idem(store, clock=env.clock).begin(S, B, "k", body={})
    assert r.decision == "replay" and r.response == Response(201, [("x-bin", bytes([0, 255]))], b"body")
    # What this build writes: base64, as the Rust store.
    d = env.idem.begin(S, B, "k2", body={})
    env.idem.complete(d.ticket, response=Response(200, [("x-bin", bytes([255, 0, 128]))], b"{}"))
    column = env.store.connection.execute(
        "SELECT response FROM idempotency_record WHERE idem_key = 'k2'").fetchone()[0]
    assert json.loads(column) == {"status": 200, "headers": [["x-bin", "/wCA"]], "body": "e30="}


def test_a_column_that_is_not_a_stored_response_is_a_store_error_naming_it(env):
    import sqlite3

    d = env.idem.begin(S, B, "k", body={})
    env.idem.complete(d.ticket, response=Response(200, [], b"ok"))
    for column, rule in [(b'{"status":200,"headers":[],"body":"not base64!"}', "invalid base64"),
                         (b'{"status":200,"headers":[],"body":[256]}', "column response"),
                         (b'{"status":200,"headers":[],"body":7}', "a base64 string or an array of bytes")]:
        c = sqlite3.connect(env.path)
        c.execute("UPDATE idempotency_record SET response = ?", (column,))
        c.commit()
        c.close()
        with pytest.raises(EngineError) as e:
            env.idem.begin(S, B, "k", body={})
        assert e.value.kind == "store" and "column response cannot be decoded" in str(e.value), str(e.value)
        assert rule in str(e.value), str(e.value)


def test_large_bodies_round_trip_exactly(env):
    body = bytes(range(256)) * 64
    d = env.idem.begin(S, B, "big", body=body)
    env.idem.complete(d.ticket, response=Response(200, [("x-bin", bytes([0, 255, 10]))], body))
    r = env.idem.begin(S, B, "big", body=body)
    assert r.response.body == body and r.response.headers == [("x-bin", bytes([0, 255, 10]))]



def test_business_write_and_completion_commit_together(env):
    c = env.store.connection
    c.execute("CREATE TABLE orders (idem_key TEXT NOT NULL)")
    d = env.idem.begin(S, B, "k", body={})
    with pytest.raises(RuntimeError):
        with env.store.transaction() as conn:
            conn.execute("INSERT INTO orders VALUES ('k')")
            assert env.idem.complete(d.ticket, result_ref="order-1") == Recorded("succeeded")
            raise RuntimeError("the business transaction fails after the completion")
    # Both rolled back: no row, and the key is still being processed.
    assert c.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 0
    assert env.idem.inspect(S, B, "k")["status"] == "processing"
    with env.store.transaction() as conn:
        conn.execute("INSERT INTO orders VALUES ('k')")
        assert env.idem.complete(d.ticket, result_ref="order-1") == Recorded("succeeded")
    assert c.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 1
    assert env.idem.begin(S, B, "k", body={}).decision == "replay"
