"""@idempotent through the real component and a real SQLite file."""

import asyncio

import pytest

from idem import (
    IdempotencyFailedError,
    IdempotencyInProgressError,
    IdempotencyKeyMismatchError,
    IdempotencyLostOwnershipError,
    IdempotencyValidationError,
    idempotent,
)


def test_runs_once_and_replays(env):
    runs = []

    @idempotent(env.idem, "payment.charge", key=lambda e: e["request_id"],
                fingerprint=lambda e: {"amount": e["amount"], "card": e["card"]})
    def charge(event):
        runs.append(event)
        return {"charge_id": f"ch-{len(runs)}", "amount": event["amount"]}

    first = charge({"request_id": "r1", "amount": 100, "card": "4242", "trace": "a"})
    second = charge({"request_id": "r1", "amount": 100, "card": "4242", "trace": "b"})
    assert first == second == {"charge_id": "ch-1", "amount": 100}
    assert len(runs) == 1
    with pytest.raises(IdempotencyKeyMismatchError):
        charge({"request_id": "r1", "amount": 200, "card": "4242"})
    assert len(runs) == 1
    assert charge.__name__ == "charge"


def test_async_def_runs_once(env):
    runs = []

    @idempotent(env.idem, "job", key=lambda k: k)
    async def job(k):
        runs.append(k)
        await asyncio.sleep(0)
        return len(runs)

    async def main():
        return await job("a"), await job("a"), await job("b")

    assert asyncio.run(main()) == (1, 1, 2)


def test_retryable_by_default(env):
    runs = []

    @idempotent(env.idem, "job", key=lambda k: k)
    def flaky(k):
        runs.append(k)
        if len(runs) == 1:
            raise RuntimeError("flaky")
        return "ok"

    with pytest.raises(RuntimeError):
        flaky("k")
    assert flaky("k") == "ok" and flaky("k") == "ok"
    assert len(runs) == 2


def test_final_failure_is_replayed(env):
    runs = []

    class Declined(Exception):
        code = "card-declined"

    @idempotent(env.idem, "job", key=lambda k: k, classify=lambda e: "final")
    def pay(k):
        runs.append(k)
        raise Declined("card declined")

    with pytest.raises(Declined):
        pay("k")
    with pytest.raises(IdempotencyFailedError) as e:
        pay("k")
    assert e.value.code == "card-declined" and e.value.failure_message == "card declined"
    assert len(runs) == 1


def test_concurrent_async_call_is_in_progress(env):
    @idempotent(env.idem, "job", key=lambda k, gate: k, fingerprint=lambda k, gate: k)
    async def slow(k, gate):
        await gate.wait()
        return 1

    async def main():
        gate = asyncio.Event()
        first = asyncio.create_task(slow("k", gate))
        await asyncio.sleep(0)
        with pytest.raises(IdempotencyInProgressError) as e:
            await slow("k", gate)
        assert e.value.retry_after_ms > 0
        gate.set()
        assert await first == 1
        assert await slow("k", gate) == 1

    asyncio.run(main())


def test_lost_ownership_is_reported(env):
    policy = {"lease_ms": 1000}
    runs = []

    @idempotent(env.idem, "job", key=lambda k, hook=None: k, fingerprint=lambda k, hook=None: k, policy=policy)
    def work(k, hook=None):
        runs.append(k)
        if hook:
            hook()
        return len(runs)

    def take_over():
        env.clock.advance(1001)
        assert work("k") == 2

    with pytest.raises(IdempotencyLostOwnershipError) as e:
        work("k", take_over)
    assert e.value.result == 2
    assert work("k") == 2


def test_bad_key_names_field_and_rule(env):
    @idempotent(env.idem, "job", key=lambda: "x" * 300)
    def f():
        return 1

    with pytest.raises(IdempotencyValidationError) as e:
        f()
    assert (e.value.field, e.value.rule) == ("idem-key", "too-long")
    with pytest.raises(TypeError, match="key must be a function"):
        idempotent(env.idem, "job", key="nope")
