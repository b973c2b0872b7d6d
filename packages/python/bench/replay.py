"""Per-call cost of a replay: idem's ``begin`` (the Python package: the engine
component on wasmtime-py, the SQLite store) against Powertools' cache
(Redis) persistence layer doing the same job (an ``@idempotent_function``
call whose key is already completed), in the same run.

    pip install 'idem-engine[bench]'   (aws-lambda-powertools[redis], redis)
    python bench/replay.py [--calls 5000] [--redis redis://127.0.0.1:6379/0]

Also times the Python side of one 1 KiB ``list<u8>`` with wasmtime-py's
per-element conversion and with the package's; and splits a 16 B and a
1 KiB replay into the component call (wasm and wasmtime's C API),
the Python import callbacks and the Python around the call. Not run by CI.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid


def measure(name, f, calls):
    for _ in range(min(200, calls)):
        f()
    samples = []
    start = time.perf_counter()
    for _ in range(calls):
        t = time.perf_counter_ns()
        f()
        samples.append(time.perf_counter_ns() - t)
    total = time.perf_counter() - start
    samples.sort()
    p50 = samples[len(samples) // 2] / 1000
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000
    mean = sum(samples) / len(samples) / 1000
    print(f"{name:<58} {calls / total:>8.0f} ops/s   mean {mean:>7.1f} us   p50 {p50:>7.1f} us   p99 {p99:>7.1f} us",
          flush=True)
    return {"name": name, "ops_per_s": calls / total, "mean_us": mean, "p50_us": p50, "p99_us": p99}


def idem_side(calls, body_bytes):
    """Replays of one key: each reads the row and decodes the stored
    response, as every replay does."""
    from idem import Idem, Response, SqliteStore

    path = os.path.join(tempfile.mkdtemp(prefix="idem-bench-"), "idem.db")
    idem = Idem(SqliteStore(path))
    payload = json.dumps({"sku": "A1", "qty": 2, "note": "x" * max(0, body_bytes - 40)}).encode()
    stored = b"y" * body_bytes
    key = f"bench-{uuid.uuid4()}"
    d = idem.begin("tenant-1", "order.create", key, body=payload, body_kind="json")
    assert d.decision == "execute"
    idem.complete(d.ticket, result_ref="order-1",
                  response=Response(201, [("content-type", b"application/json")], stored))

    def replay():
        r = idem.begin("tenant-1", "order.create", key, body=payload, body_kind="json")
        if r.decision != "replay":
            raise AssertionError(r)

    return measure(f"idem begin, replay ({len(payload)} B request, {body_bytes} B response)", replay, calls)


def powertools_side(calls, body_bytes, url):
    os.environ.setdefault("AWS_LAMBDA_FUNCTION_NAME", "idem-bench")
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import CachePersistenceLayer

    layer = CachePersistenceLayer(url=url)
    config = IdempotencyConfig(use_local_cache=False, expires_after_seconds=3600)
    stored = "y" * body_bytes
    runs = []

    @idempotent_function(data_keyword_argument="order", persistence_store=layer, config=config)
    def create(order):
        runs.append(1)
        return {"status": 201, "body": stored}

    order = {"id": str(uuid.uuid4()), "sku": "A1", "qty": 2, "note": "x" * max(0, body_bytes - 80)}
    create(order=order)

    def replay():
        create(order=order)

    result = measure(f"Powertools CachePersistenceLayer (Redis), replay ({body_bytes} B)", replay, calls)
    if len(runs) != 1:
        raise AssertionError(f"Powertools ran the function {len(runs)} times")
    return result


def time_split(calls, body_bytes):
    """Where a replay's time goes: the component call (the wasm code and
    wasmtime's C API, which converts every value, a `list<u8>` one value per
    byte), the Python import callbacks inside it (the store's SQLite read and
    decoding, lowering the stored record), and the Python outside it
    (lowering the request, lifting the decision). Means of the fastest of 5
    rounds; both clocks are wrapped around the calls for this only."""
    import idem._host as host
    from idem import Idem, Response, SqliteStore
    from wasmtime import _ffi as ffi

    path = os.path.join(tempfile.mkdtemp(prefix="idem-bench-"), "idem.db")
    idem = Idem(SqliteStore(path))
    payload = json.dumps({"sku": "A1", "qty": 2, "note": "x" * max(0, body_bytes - 40)}).encode()
    key = f"bench-{uuid.uuid4()}"
    d = idem.begin("tenant-1", "order.create", key, body=payload, body_kind="json")
    idem.complete(d.ticket, result_ref="order-1", response=Response(201, [("content-type", b"application/json")],
                                                                     b"y" * body_bytes))
    spent = {"call": 0, "imports": 0}
    catch, call = host.catch_exceptions, ffi.wasmtime_component_func_call

    def timed(what, f):
        def g(*a):
            t = time.perf_counter_ns()
            try:
                return f(*a)
            finally:
                spent[what] += time.perf_counter_ns() - t
        return g

    host.catch_exceptions = timed("imports", catch)
    ffi.wasmtime_component_func_call = timed("call", call)
    try:
        n = max(100, calls // 5)
        for _ in range(min(200, n)):
            idem.begin("tenant-1", "order.create", key, body=payload, body_kind="json")
        rounds = []
        for _ in range(5):
            spent.update(call=0, imports=0)
            start = time.perf_counter_ns()
            for _ in range(n):
                idem.begin("tenant-1", "order.create", key, body=payload, body_kind="json")
            rounds.append(((time.perf_counter_ns() - start) / n, spent["call"] / n, spent["imports"] / n))
    finally:
        host.catch_exceptions, ffi.wasmtime_component_func_call = catch, call
    total, inside, imports = (v / 1000 for v in min(rounds))
    print(f"  {body_bytes:>5} B replay, {total:6.1f} us: wasm + wasmtime C API {inside - imports:6.1f} us, "
          f"Python import callbacks {imports:6.1f} us, Python outside the call {total - inside:6.1f} us", flush=True)
    return {"body_bytes": body_bytes, "total_us": total, "wasm_and_c_api_us": inside - imports,
            "python_imports_us": imports, "python_outside_us": total - inside}


def list_u8_breakdown(calls):
    """The Python side of one 1 KiB list<u8> (lowered, then lifted back;
    the C API's own conversion is in the split below): with wasmtime-py's
    per-element conversion, and as the package does it (laid out in the
    call's arena with two slice assignments, read back from one snapshot)."""
    import ctypes

    import idem._host as host
    from idem import Idem, SqliteStore
    from wasmtime import _ffi as ffi

    idem = Idem(SqliteStore(os.path.join(tempfile.mkdtemp(prefix="idem-bench-"), "idem.db")))
    request = idem._exports.funcs["begin"][1].params[0]
    body = dict(request.fields)["body"]  # list<u8>
    data = bytes(range(256)) * 4

    def per_element():
        c = ffi.wasmtime_component_val_t()
        host._orig_to_c(body, None, data, ctypes.pointer(c))
        return host._orig_from_c(body, c)  # frees it

    low, lift = host._lowerer(body), host._lifter(body)

    def package():
        _buf, _pinned, base = host._lower_all([low], (data,))
        return lift(ctypes.string_at(base, 32), 0)

    assert per_element() == package() == data
    return [measure("list<u8> 1 KiB, lower + lift: wasmtime-py per element", per_element, max(50, calls // 20)),
            measure("list<u8> 1 KiB, lower + lift: the package (arena)", package, calls)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    print(f"python {sys.version.split()[0]}", flush=True)
    out = [idem_side(a.calls, 16), idem_side(a.calls, 1024)]
    try:
        out += [powertools_side(a.calls, 16, a.redis), powertools_side(a.calls, 1024, a.redis)]
    except ImportError as e:
        print(f"Powertools is not installed ({e}): pip install 'idem-engine[bench]'", flush=True)
    out += list_u8_breakdown(a.calls)
    print("where a replay's time goes (fastest of 5 rounds):", flush=True)
    out += [time_split(a.calls, 16), time_split(a.calls, 1024)]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
