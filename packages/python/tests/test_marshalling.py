"""The package's own conversions of component values (src/idem/_host.py):
the policy lowered once per distinct value, records lowered into a copy of
a per-type template and lifted from one snapshot, `list<u8>` in one pass."""

import ctypes

import pytest

from conftest import T0
from idem import Recorded, Response
from idem import _host as h
from idem._host import Lowered, record, wit_policy

S, B = "tenant-1", "order.create"


def test_a_policy_is_lowered_once_and_a_changed_one_again(env):
    ex = env.idem._exports
    policy = {"lease_ms": 1000}
    first = ex.policy(policy)
    assert isinstance(first, Lowered) and ex.policy({"lease_ms": 1000}) is first
    d = env.idem.begin(S, B, "k1", body={}, policy=policy)
    assert d.lease_until == T0 + 1000
    policy["lease_ms"] = 2000  # the same dict, changed: looked up by its content
    assert ex.policy(policy) is not first
    env.clock.advance(1001)
    e = env.idem.begin(S, B, "k1", body={}, policy=policy)
    assert e.decision == "execute" and e.lease_until == T0 + 1001 + 2000
    assert env.idem.begin(S, B, "k2", body={}).lease_until == T0 + 1001 + 60_000


@pytest.mark.parametrize("max_attempts", [None, 1, 3, (1 << 32) - 1])
def test_the_policy_record_with_max_attempts_round_trips(env, max_attempts):
    """The policy's `max-attempts` (an option<u32> after the failure-mode
    enum), through the generated lowering and lifting and through
    wasmtime-py's conversions (the record template, `some` built in place)."""
    ty = env.idem._exports._policy_type
    names = [n for n, _ in ty.fields]
    assert names[names.index("failure-mode"):names.index("failure-mode") + 3] == ["failure-mode", "max-attempts", "in-progress"]
    value = wit_policy({"failure_mode": "always-final", "max_attempts": max_attempts, "lease_ms": 1234})
    low = Lowered(ty, value)
    raw = h._VAL()
    ty.convert_to_c(env.idem._exports.store, value, ctypes.pointer(raw))
    for got in (h._lifter(ty)(low.top, 0), ty.convert_from_c(raw)):
        assert getattr(got, "max-attempts") == max_attempts
        assert getattr(got, "failure-mode") == "always-final" and getattr(got, "in-progress") is None
        assert getattr(got, "lease-ms") == 1234 and getattr(got, "key-format").charset == "printable-ascii"


def test_max_attempts_is_part_of_the_lowered_policy(env):
    ex = env.idem._exports
    assert ex.policy({"max_attempts": 1}) is not ex.policy({"max_attempts": 2})
    d = env.idem.begin(S, B, "k1", body={}, policy={"max_attempts": 2})
    assert env.idem.fail(d.ticket, {"max_attempts": 2}, code="e", disposition="retryable") == Recorded("released")
    d = env.idem.begin(S, B, "k1", body={}, policy={"max_attempts": 2})
    assert env.idem.fail(d.ticket, {"max_attempts": 3}, code="e", disposition="retryable") == Recorded("released")
    d = env.idem.begin(S, B, "k1", body={})
    assert d.attempt == 3
    assert env.idem.fail(d.ticket, {"max_attempts": 3}, code="e", disposition="retryable") == Recorded("failed")


def test_a_wrong_policy_is_refused_on_every_call(env):
    for _ in range(2):
        with pytest.raises(ValueError, match="lease_ms"):
            env.idem.begin(S, B, "k1", body={}, policy={"lease_ms": -1})
        with pytest.raises(ValueError, match="not a policy field"):
            env.idem.begin(S, B, "k1", body={}, policy={"nope": 1})
    assert env.idem.begin(S, B, "k1", body={}).decision == "execute"


def test_a_policy_that_is_not_plain_json_is_converted_each_time(env):
    class Weird(dict):
        pass

    policy = {"fingerprint_fields": ("/sku",), "key_format": Weird(max_length=64)}
    assert env.idem.begin(S, B, "k1", body={"sku": "A1"}, policy=policy).decision == "execute"
    with pytest.raises(ValueError, match="lease_ms"):  # not JSON: converted, and refused, as before
        env.idem._exports.policy({"lease_ms": object()})


def test_a_wrong_field_type_fails_cleanly_and_the_instance_goes_on(env):
    ex = env.idem._exports
    with pytest.raises(TypeError):
        ex.call("inspect", record(scope=1, biz_type=B, idem_key="k1"))
    with pytest.raises(TypeError):
        ex.call("inspect", record(scope=S, biz_type=B, idem_key=b"k1"))
    d = env.idem.begin(S, B, "k1", body={})
    with pytest.raises(TypeError):
        env.idem.complete(d.ticket, response=Response(201, [("a", b"b")], "not bytes"))
    assert env.idem.complete(d.ticket, result_ref="r") == Recorded("succeeded")
    assert env.idem.inspect(S, B, "k1")["status"] == "succeeded"


@pytest.mark.parametrize("size", [0, 1, 1024, 70_000])
def test_bodies_and_records_round_trip(env, size):
    body = bytes(i % 256 for i in range(size))
    resp = Response(299, [("x-a", b""), ("x-b", bytes(range(256)))], body)
    d = env.idem.begin(S, B, f"k{size}", body=body)
    assert env.idem.complete(d.ticket, result_ref=None, response=resp) == Recorded("succeeded")
    for _ in range(3):
        r = env.idem.begin(S, B, f"k{size}", body=body)
        assert r.decision == "replay" and r.response == resp and r.result_ref is None
    status = env.idem.inspect(S, B, f"k{size}")
    assert status["status"] == "succeeded" and status["attempts"] == 1


# An import's result is owned by the C API, which frees it after the
# callback. Run in a child process: handing it Python memory aborts the
# process (free(): invalid pointer).
_IMPORT_RESULT_CHILD = r"""
import ctypes, os, sys, tempfile
from idem import Idem, SqliteStore
import idem._host as h

ex = Idem(SqliteStore(os.path.join(tempfile.mkdtemp(), "idem.db")))._exports
policy_type = ex._policy_type
variant_type = dict(policy_type.fields)["in-progress"]  # `reject` has no payload, only its case name
cases = ((variant_type, None, lambda got: got is None),
         (policy_type, ex.policy(None),
          lambda got: getattr(got, "lease-ms") == 60_000 and getattr(got, "max-attempts") is None),
         (policy_type, ex.policy({"max_attempts": 3}),
          lambda got: getattr(got, "max-attempts") == 3 and getattr(got, "in-progress") is None))
for ty, value, check in cases:
    sig = object.__new__(h._Signature)
    sig.params, sig.lift_params, sig.result = [], [], ty
    sig.lower_result, sig.result_flat = h._lowerer(ty), type(ty) in h._FLAT
    idx = h._next_import[0]
    h._next_import[0] += 1
    h._IMPORTS[idx] = [lambda _store, v=value: v, sig]
    results = h._VAL()
    assert h._import_impl(idx, None, None, None, 0, ctypes.addressof(results), 1) == 0
    got = h._lifter(ty)(ctypes.string_at(ctypes.addressof(results), 32), 0)
    h._val_delete(ctypes.byref(results))  # what the C API does once the callback returns
    del h._IMPORTS[idx]
    assert check(got), got
print("ok")
"""


def test_an_import_result_is_handed_over_as_memory_the_c_api_owns(tmp_path):
    """A `variant` case without payload and a `Lowered` record point
    outside the call's buffer with no fixup: they are copied too."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _IMPORT_RESULT_CHILD], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and child.stdout.strip() == "ok", (child.returncode, child.stdout, child.stderr)
