"""Runs idem's conformance scenarios (../scenarios/*.json, ../fingerprints.json)
against the engine component on Wasmtime's Python component API, with a
store, a clock and a result lookup in Python. The host code (loading the
component, its imports, the marshalling) is the Python package's
(packages/python/src/idem).

    python run.py PATH/TO/idem_guest.wasm                  the mock store below
    python run.py PATH/TO/idem_guest.wasm --store sqlite   the package's SQLite store,
                                                           one new file per scenario

Prints the component's SHA-256, one line per failure, and
"N passed, M failed"; exits non-zero on any failure. The file format is
described in ../README.md.
"""

import hashlib
import importlib.metadata
import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFORMANCE = HERE.parent
sys.path.insert(0, str(CONFORMANCE.parent.parent / "packages" / "python" / "src"))

from wasmtime.component import Record, Variant  # noqa: E402

from idem._host import Exports, Runtime, StoreError, get, record  # noqa: E402
from idem.engine import Success  # noqa: E402
from idem.sqlite import SqliteStore  # noqa: E402

# Every scenario's clock starts here (2026-01-01T00:00:00Z); file times are
# relative to it.
T0 = 1767225600000
DEFAULT_SCOPE = "tenant-1"
DEFAULT_BIZ_TYPE = "order.create"
# The largest integer a SQL store holds: the mock refuses more, as they do.
I64_MAX = (1 << 63) - 1


def copy_record(r):
    """A deep copy of a stored record (records, lists and tuples)."""
    if isinstance(r, Record):
        out = Record()
        for k, v in r.__dict__.items():
            setattr(out, k, copy_record(v))
        return out
    if isinstance(r, list):
        return [copy_record(x) for x in r]
    if isinstance(r, tuple):
        return tuple(copy_record(x) for x in r)
    return r


def key_id(k):
    return (get(k, "scope"), get(k, "biz-type"), get(k, "idem-key"))


SETTLED = ("succeeded", "failed", "released")


class Faults:
    """The mock's fault injection: the next `count` calls of `op` (None: any) fail as `kind`."""

    def __init__(self):
        self.faults = []

    def inject(self, op, kind, count):
        if count > 0:
            self.faults.append({"op": op, "kind": kind, "remaining": count})

    def run(self, op, f):
        for i, fault in enumerate(self.faults):
            if fault["remaining"] > 0 and fault["op"] in (None, op):
                break
        else:
            return f()
        fault["remaining"] -= 1
        if fault["remaining"] == 0:
            del self.faults[i]
        if fault["kind"] == "unavailable":
            raise StoreError("unavailable", f"injected fault: {op} unavailable")
        if fault["kind"] == "internal":
            raise StoreError("internal", f"injected fault: {op} internal error")
        f()
        raise StoreError("unavailable", f"injected fault: {op} acknowledgement lost")


class MockStore:
    """An in-memory store with the semantics of wit/store.wit."""

    def __init__(self, faults):
        self.records = {}
        self.last_id = 0
        self.faults = faults

    def run(self, op, f):
        return self.faults.run(op, f)

    def count(self):
        return len(self.records)

    def tamper(self, k, changes):
        rec = self.records.get(key_id(k))
        if rec is None:
            raise ValueError("no record to tamper with")
        if "lease-until" in changes:
            lease = changes["lease-until"]
            setattr(rec, "lease-until", None if lease is None else T0 + lease)
        if "fingerprint" in changes:
            setattr(rec, "fingerprint", changes["fingerprint"])
        if "fingerprint-version" in changes:
            setattr(rec, "fingerprint-version", changes["fingerprint-version"])
        rec.revision += 1

    @staticmethod
    def check_fits(r):
        for name in ("fencing-token", "revision", "lease-until", "created-at", "updated-at", "expires-at"):
            v = get(r, name)
            if v is not None and v > I64_MAX:
                raise StoreError("rejected", f"{name} is above i64::MAX, which a SQL store cannot hold")

    def insert_if_absent(self, candidate):
        self.check_fits(candidate)

        def op():
            existing = self.records.get(key_id(get(candidate, "key")))
            if existing is not None:
                return Variant("existing", copy_record(existing))
            self.last_id += 1
            rec = copy_record(candidate)
            rec.id = self.last_id
            self.records[key_id(get(candidate, "key"))] = rec
            return Variant("inserted", copy_record(rec))

        return self.run("insert-if-absent", op)

    def get(self, key):
        return self.run("get", lambda: copy_record(self.records.get(key_id(key))))

    def compare_and_swap(self, expected_revision, replacement):
        self.check_fits(replacement)

        def op():
            k = key_id(get(replacement, "key"))
            current = self.records.get(k)
            if current is None:
                return Variant("stale", None)
            # The id as well as the revision: a re-created record starts over at revision 1.
            if current.id != replacement.id or current.revision != expected_revision:
                return Variant("stale", copy_record(current))
            self.records[k] = copy_record(replacement)
            return Variant("swapped")

        return self.run("compare-and-swap", op)

    def delete_expired(self, now, limit):
        def op():
            expired = sorted(
                (get(r, "expires-at"), r.id, k)
                for k, r in self.records.items()
                if r.status in SETTLED and get(r, "expires-at") is not None and get(r, "expires-at") <= now
            )[:limit]
            for _, _, k in expired:
                del self.records[k]
            return len(expired)

        return self.run("delete-expired", op)

    def list_stale(self, biz_type, now, after, limit):
        def op():
            start = None if after is None else (get(after, "updated-at"), after.id)
            stale = [
                r
                for r in self.records.values()
                if get(get(r, "key"), "biz-type") == biz_type
                and (start is None or (get(r, "updated-at"), r.id) > start)
                and (
                    (r.status == "processing" and get(r, "lease-until") is not None and get(r, "lease-until") <= now)
                    or r.status == "outcome-unknown"
                )
            ]
            stale.sort(key=lambda r: (get(r, "updated-at"), r.id))
            return [copy_record(r) for r in stale[:limit]]

        return self.run("list-stale", op)


class SqliteBacked:
    """The package's SQLite store, one new file per scenario, behind the same fault injection."""

    def __init__(self, faults, path):
        self.faults = faults
        self.sqlite = SqliteStore(str(path))

    def count(self):
        return self.sqlite.count()

    def tamper(self, k, changes):
        sets, params = [], []
        if "lease-until" in changes:
            lease = changes["lease-until"]
            sets.append("lease_until = ?")
            params.append(None if lease is None else T0 + lease)
        if "fingerprint" in changes:
            sets.append("request_hash = ?")
            params.append(changes["fingerprint"])
        if "fingerprint-version" in changes:
            sets.append("fingerprint_version = ?")
            params.append(changes["fingerprint-version"])
        sets.append("revision = revision + 1")
        cur = self.sqlite.connection.execute(
            f"UPDATE idempotency_record SET {', '.join(sets)} WHERE scope_key = ? AND biz_type = ? AND idem_key = ?",
            (*params, k.scope, get(k, "biz-type"), get(k, "idem-key")))
        if cur.rowcount != 1:
            raise ValueError("no record to tamper with")

    def insert_if_absent(self, c):
        return self.faults.run("insert-if-absent", lambda: self.sqlite.insert_if_absent(c))

    def get(self, k):
        return self.faults.run("get", lambda: self.sqlite.get(k))

    def compare_and_swap(self, rev, r):
        return self.faults.run("compare-and-swap", lambda: self.sqlite.compare_and_swap(rev, r))

    def delete_expired(self, now, limit):
        return self.faults.run("delete-expired", lambda: self.sqlite.delete_expired(now, limit))

    def list_stale(self, biz_type, now, after, limit):
        return self.faults.run("list-stale", lambda: self.sqlite.list_stale(biz_type, now, after, limit))


class Clock:
    """The host's virtual clock; `pause` runs the scenario's pause hook once."""

    def __init__(self, host):
        self.host = host

    def now(self):
        return self.host.now

    def pause(self, duration):
        host = self.host
        host.now += duration
        hook, host.pause_hook = host.pause_hook, None
        if hook is not None:
            hook()


class Results:
    def __init__(self, host):
        self.host = host

    def find_result(self, key):
        if self.host.failing:
            raise StoreError("unavailable", "the business database is down")
        return self.host.found.get(key_id(key))


class Host:
    """The host side of one scenario: store, virtual clock, result lookup, and the component's instances."""

    def __init__(self, runtime):
        self.runtime = runtime.runtime
        self.faults = Faults()
        if runtime.sqlite_dir is not None:
            runtime.files += 1
            self.store = SqliteBacked(self.faults, runtime.sqlite_dir / f"scenario-{runtime.files}.db")
        else:
            self.store = MockStore(self.faults)
        self.now = T0
        self.pause_hook = None
        self.found = {}
        self.failing = False
        self.linker = self.runtime.linker(self.store, Clock(self), Results(self))
        self.engine = self.instance()

    def instance(self):
        """A new instance of the component over this host, in its own Wasmtime store."""
        return Exports(self.runtime, self.linker)


class Runner:
    """The package's runtime (the compiled component) and where SQLite files go."""

    def __init__(self, wasm_path, store_kind):
        self.runtime = Runtime.get(wasm_path)
        self.sqlite_dir = Path(tempfile.mkdtemp(prefix="idem-conformance-")) if store_kind == "sqlite" else None
        self.files = 0


# ------------------------------------------------------------ reading scenario values


def is_repeat(v):
    return isinstance(v, dict) and "repeat" in v


def text(v):
    if isinstance(v, str):
        return v
    if is_repeat(v):
        return text(v["repeat"]) * v["count"]
    raise ValueError(f"expected a string, got {v!r}")


def data(v):
    if isinstance(v, dict) and "hex" in v:
        return bytes.fromhex(v["hex"])
    return text(v).encode("utf-8")


def items(v):
    if isinstance(v, list):
        return v
    if is_repeat(v):
        return [v["repeat"]] * v["count"]
    raise ValueError(f"expected a list, got {v!r}")


def key(v):
    if isinstance(v, dict) and not is_repeat(v):
        return record(
            scope=text(v.get("scope", DEFAULT_SCOPE)),
            biz_type=text(v.get("biz-type", DEFAULT_BIZ_TYPE)),
            idem_key=text(v.get("idem-key", "")),
        )
    return record(scope=DEFAULT_SCOPE, biz_type=DEFAULT_BIZ_TYPE, idem_key=text(v))


def response(v):
    if v is None:
        return None
    return record(
        status=v["status"],
        headers=[(text(n), data(b)) for n, b in items(v.get("headers", []))],
        body=data(v.get("body", "")),
    )


def success(v):
    v = v or {}
    ref = v.get("result-ref")
    return record(result_ref=None if ref is None else text(ref), response=response(v.get("response")))


def failure(v):
    return record(code=text(v["code"]), message=text(v.get("message", "")), response=response(v.get("response")))


DEFAULT_POLICY = {
    "retention-ms": 3600000, "lease-ms": 30000, "retry-after-ms": 1000, "expired-lease": "take-over",
    "outcome-unknown": "manual", "failure-mode": "honor-disposition", "max-attempts": None, "in-progress": "reject",
    "fingerprint-fields": [], "key-format": {"min-length": 1, "max-length": 255, "charset": "printable-ascii"},
    "max-body-bytes": 1048576,
}


def merge(base, over):
    out = dict(base)
    out["key-format"] = dict(base["key-format"])
    for k, v in (over or {}).items():
        if k == "key-format":
            out["key-format"].update(v)
        else:
            out[k] = v
    return out


def policy(p):
    ip = p["in-progress"]
    kf = p["key-format"]
    return record(
        retention_ms=p["retention-ms"],
        lease_ms=p["lease-ms"],
        retry_after_ms=p["retry-after-ms"],
        expired_lease=p["expired-lease"],
        outcome_unknown=p["outcome-unknown"],
        failure_mode=p["failure-mode"],
        max_attempts=p["max-attempts"],  # option<u32>: None is none
        # in-progress-mode is untagged in wasmtime-py: None is `reject`, a record is `wait`.
        in_progress=None if ip == "reject" else record(
            max_wait_ms=ip["wait"]["max-wait-ms"], poll_interval_ms=ip["wait"]["poll-interval-ms"]),
        fingerprint_fields=[text(f) for f in items(p["fingerprint-fields"])],
        key_format=record(min_length=kf["min-length"], max_length=kf["max-length"], charset=kf["charset"]),
        max_body_bytes=p["max-body-bytes"],
    )


# ------------------------------------------------------------ results as JSON


def time(t):
    return None if t is None else t - T0


def bytes_json(b):
    try:
        return bytes(b).decode("utf-8")
    except UnicodeDecodeError:
        return {"hex": bytes(b).hex()}


def response_json(r):
    if r is None:
        return None
    return {"status": r.status, "headers": [[n, bytes_json(v)] for n, v in r.headers], "body": bytes_json(r.body)}


def failure_json(f):
    return {"code": f.code, "message": f.message, "response": response_json(f.response)}


def decision_json(d):
    v = d.payload
    if d.tag == "execute":
        k = v.key
        return {"decision": "execute",
                "key": {"scope": k.scope, "biz-type": get(k, "biz-type"), "idem-key": get(k, "idem-key")},
                "record-id": get(v, "record-id"), "fencing-token": get(v, "fencing-token"),
                "lease-until": time(get(v, "lease-until")), "attempt": v.attempt}
    if d.tag == "replay":
        return {"decision": "replay", "result-ref": get(v, "result-ref"), "response": response_json(v.response),
                "completed-at": time(get(v, "completed-at"))}
    if d.tag == "in-progress":
        return {"decision": "in-progress", "retry-after-ms": get(v, "retry-after-ms"), "lease-until": time(get(v, "lease-until"))}
    if d.tag == "mismatch":
        return {"decision": "mismatch", "stored-prefix": get(v, "stored-prefix"), "stored-version": get(v, "stored-version")}
    if d.tag == "failed":
        return {"decision": "failed", **failure_json(v)}
    if d.tag == "outcome-unknown":
        return {"decision": "outcome-unknown", "since": time(v.since), "attempts": v.attempts,
                "failure": None if v.failure is None else failure_json(v.failure)}
    if d.tag == "invalid":
        return {"decision": "invalid", "field": v.field, "rule": v.rule, "message": v.message}
    raise ValueError(f"unknown decision {d.tag}")


def error_json(e):
    # engine-error is untagged in wasmtime-py: a Variant is `store`, a str
    # is `corrupt`, a record is `invalid`.
    if isinstance(e, Variant):
        return {"error": "store", "kind": e.tag, "message": e.payload}
    if isinstance(e, str):
        return {"error": "corrupt", "message": e}
    return {"error": "invalid", "field": e.field, "rule": e.rule, "message": e.message}


def status_json(s):
    if s is None:
        return None
    return {"status": s.status, "created-at": time(get(s, "created-at")), "updated-at": time(get(s, "updated-at")),
            "expires-at": time(get(s, "expires-at")), "lease-until": time(get(s, "lease-until")),
            "result-ref": get(s, "result-ref"), "attempts": s.attempts, "fencing-token": get(s, "fencing-token"),
            "fingerprint": s.fingerprint, "fingerprint-version": get(s, "fingerprint-version"), "expired": s.expired}


def report_json(r):
    return {"examined": r.examined, "succeeded": r.succeeded, "released": r.released,
            "left-for-manual": get(r, "left-for-manual"), "skipped": r.skipped, "lookup-errors": get(r, "lookup-errors")}


def completion_json(c):
    # completion is untagged in wasmtime-py: a str (the status) is `recorded`, None is `lost-ownership`.
    if isinstance(c, str):
        return {"completion": "recorded", "status": c}
    if c is None:
        return {"completion": "lost-ownership"}
    raise ValueError(f"unknown completion {c!r}")


def extension_json(x):
    # extension is untagged in wasmtime-py: an int is `extended`, None is `lost-ownership`.
    if isinstance(x, int):
        return {"extension": "extended", "lease-until": time(x)}
    return {"extension": "lost-ownership"}


def outcome(result, to_json):
    if not isinstance(result, Variant) or result.tag not in ("ok", "err"):
        raise ValueError(f"expected a result, got {result!r}")
    if result.tag == "err":
        return error_json(result.payload)
    return to_json(result.payload)


# ------------------------------------------------------------ matching


class Mismatch(Exception):
    pass


def dumps(v):
    return json.dumps(v, ensure_ascii=False)


def check(expected, actual, saved, path):
    if isinstance(expected, dict):
        if "$contains" in expected:
            if not isinstance(actual, str) or expected["$contains"] not in actual:
                raise Mismatch(f"{path}: expected a string containing {dumps(expected['$contains'])}, got {dumps(actual)}")
            return
        if "$ref" in expected:
            name, *parts = expected["$ref"].split(".")
            if name not in saved:
                raise Mismatch(f"{path}: nothing saved as {name}")
            target = saved[name]
            for p in parts:
                target = target.get(p) if isinstance(target, dict) else None
            if target != actual:
                raise Mismatch(f"{path}: expected {expected['$ref']} = {dumps(target)}, got {dumps(actual)}")
            return
        if not isinstance(actual, dict):
            raise Mismatch(f"{path}: expected {dumps(expected)}, got {dumps(actual)}")
        for k, v in expected.items():
            if k not in actual:
                raise Mismatch(f"{path}.{k}: missing in {dumps(actual)}")
            check(v, actual[k], saved, f"{path}.{k}")
        return
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            raise Mismatch(f"{path}: expected {dumps(expected)}, got {dumps(actual)}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            check(e, a, saved, f"{path}[{i}]")
        return
    # True == 1 in Python: compare booleans as booleans.
    if expected != actual or isinstance(expected, bool) != isinstance(actual, bool):
        raise Mismatch(f"{path}: expected {dumps(expected)}, got {dumps(actual)}")


# ------------------------------------------------------------ running


# What steps without a result (clock, fault, results, tamper) return.
NO_RESULT = object()


class Ctx:
    def __init__(self, host, scenario_policy):
        self.host = host
        self.engine = host.engine
        self.policy_json = merge(DEFAULT_POLICY, scenario_policy)
        self.saved = {}
        self.tickets = {}

    def policy(self, step):
        return policy(merge(self.policy_json, step.get("policy")))

    def ticket(self, step):
        name = step["ticket"]
        if name not in self.tickets:
            raise ValueError(f"no ticket saved as {name}")
        t = copy_record(self.tickets[name])
        o = step.get("ticket-override", {})
        if "fencing-token" in o:
            setattr(t, "fencing-token", o["fencing-token"])
        if "record-id" in o:
            setattr(t, "record-id", o["record-id"])
        return t

    def step(self, step):
        e = self.engine
        op = step["op"]
        if op == "begin":
            req = record(
                key=key(step["key"]),
                attributes=[(text(n), text(v)) for n, v in items(step.get("attributes", []))],
                body_kind=step.get("body-kind", "json"),
                body=data(step.get("body", "{}")),
                policy=self.policy(step),
            )
            errors = self.arm_pause_hook(step)
            result = e.call("begin", req)
            self.host.pause_hook = None
            if errors:
                raise ValueError("during the first pause: " + "; ".join(errors))
            if result.tag == "ok" and result.payload.tag == "execute" and "save" in step:
                self.tickets[step["save"]] = result.payload.payload
            return outcome(result, decision_json)
        if op == "complete":
            return outcome(e.call("complete", self.ticket(step), self.policy(step), success(step.get("success"))),
                           completion_json)
        if op == "fail":
            return outcome(e.call("fail", self.ticket(step), self.policy(step), failure(step["failure"]), step["disposition"]),
                           completion_json)
        if op == "extend":
            return outcome(e.call("extend", self.ticket(step), self.policy(step)), extension_json)
        if op == "reconcile":
            biz = text(step.get("biz-type", DEFAULT_BIZ_TYPE))
            return outcome(e.call("reconcile", biz, self.policy(step), step.get("limit", 100)), report_json)
        if op == "sweep":
            return outcome(e.call("sweep", step.get("limit", 100)), lambda n: {"deleted": n})
        if op == "inspect":
            return outcome(e.call("inspect", key(step["key"])), status_json)
        if op == "records":
            return {"count": self.host.store.count()}
        if op == "clock":
            if "advance" in step:
                self.host.now += step["advance"]
            else:
                self.host.now = T0 + step["set"]
            return NO_RESULT
        if op == "fault":
            store_op = None if step["store-op"] == "any" else step["store-op"]
            self.host.faults.inject(store_op, step["kind"], step.get("count", 1))
            return NO_RESULT
        if op == "results":
            if "found" in step:
                # The success the lookup answers (find-result's option<success>), in
                # the package's type; the package's linker converts it as complete's.
                self.host.found[key_id(key(step["found"]["key"]))] = Success(result_ref=text(step["found"]["result-ref"]))
            if isinstance(step.get("failing"), bool):
                self.host.failing = step["failing"]
            return NO_RESULT
        if op == "tamper":
            self.host.store.tamper(key(step["key"]), step["set"])
            return NO_RESULT
        raise ValueError(f"unknown op {op}")

    def arm_pause_hook(self, step):
        """For `during-first-pause`: its steps run on a second instance over the same host."""
        steps = step.get("during-first-pause")
        if steps is None:
            return None
        second = Ctx(self.host, {})
        second.__dict__.update(self.__dict__)
        # A second store of the Wasmtime engine: the first is inside a call.
        second.engine = self.host.instance()
        errors = []

        def hook():
            for s in steps:
                try:
                    second.run(s)
                except Exception as ex:  # noqa: BLE001 - reported as the scenario's failure
                    errors.append(str(ex))

        self.host.pause_hook = hook
        return errors

    def run(self, step):
        try:
            result = self.step(step)
        except Mismatch:
            raise
        except Exception as ex:  # noqa: BLE001 - a failing step is a scenario failure
            raise Mismatch(f"{step['op']}: {type(ex).__name__}: {ex}") from ex
        if result is not NO_RESULT:
            if "expect" in step:
                check(step["expect"], result, self.saved, step["op"])
            if "save" in step:
                self.saved[step["save"]] = result


def run_scenario(runtime, scenario):
    ctx = Ctx(Host(runtime), scenario.get("policy"))
    for i, step in enumerate(scenario["steps"], 1):
        try:
            ctx.run(step)
        except Mismatch as ex:
            raise Mismatch(f"step {i}: {ex}") from ex


# The fingerprint version the vectors are for: the component's current one.
FINGERPRINT_VERSION = 2


def fingerprint(attributes, raw, form):
    """The version-2 fingerprint, computed here with hashlib, independently of the guest."""
    out = f"idem-fp/{FINGERPRINT_VERSION}\x00".encode() + struct.pack(">I", len(attributes))
    for name, value in attributes:
        n, v = name.encode("utf-8"), value.encode("utf-8")
        out += struct.pack(">I", len(n)) + n + struct.pack(">I", len(v)) + v
    out += (b"R" if raw else b"J") + struct.pack(">Q", len(form)) + form
    return hashlib.sha256(out).hexdigest()


def run_pair(runtime, pair):
    ctx = Ctx(Host(runtime), {})
    digests = []
    for side in ("a", "b"):
        r = pair[side]
        attributes = [(text(n), text(v)) for n, v in items(r.get("attributes", []))]
        mine = fingerprint(attributes, r["body-kind"] == "raw", data(r["canonical"]))
        if mine != r["sha256"]:
            raise Mismatch(f"{side}: sha256 is {r['sha256']}, this host computes {mine}")
        k = f"fp-{side}"
        ctx.run({"op": "begin", "key": k, "attributes": r.get("attributes", []), "body-kind": r["body-kind"],
                 "body": r["body"], "policy": {"fingerprint-fields": r.get("fingerprint-fields", [])},
                 "expect": {"decision": "execute"}})
        try:
            ctx.run({"op": "inspect", "key": k, "expect": {"fingerprint": r["sha256"]}})
        except Mismatch as ex:
            raise Mismatch(f"{side}: the component's fingerprint differs: {ex}") from ex
        digests.append(mine)
    if (digests[0] == digests[1]) != (pair["expect"] == "same"):
        raise Mismatch(f"expected {pair['expect']}, the digests are {digests}")


def main(argv):
    args = argv[1:]
    store_kind = "mock"
    if "--store" in args:
        i = args.index("--store")
        store_kind = args[i + 1]
        del args[i:i + 2]
    if store_kind not in ("mock", "sqlite"):
        raise ValueError(f"--store must be mock or sqlite, not {store_kind}")
    wasm_path = Path(args[0] if args else CONFORMANCE / "../../target/idem_guest.wasm").resolve()
    wasm = wasm_path.read_bytes()
    print(f"component sha256 {hashlib.sha256(wasm).hexdigest()} ({len(wasm)} bytes); "
          f"host python {sys.version.split()[0]} with wasmtime {importlib.metadata.version('wasmtime')}; "
          f"store {'SQLite (the package' + chr(39) + 's)' if store_kind == 'sqlite' else 'mock'}")
    runtime = Runner(wasm_path, store_kind)
    passed = failed = 0

    def tally(name, f):
        nonlocal passed, failed
        try:
            f()
            passed += 1
        except Exception as ex:  # noqa: BLE001 - every failure is reported and counted
            failed += 1
            print(f"FAIL [python, {store_kind}] {name}: {ex}")

    for file in sorted((CONFORMANCE / "scenarios").glob("*.json")):
        for s in json.loads(file.read_text(encoding="utf-8"))["scenarios"]:
            tally(s["name"], lambda s=s: run_scenario(runtime, s))
    vectors = json.loads((CONFORMANCE / "fingerprints.json").read_text(encoding="utf-8"))
    if vectors["version"] != FINGERPRINT_VERSION:
        raise ValueError(f"fingerprints.json is for version {vectors['version']}, "
                         f"this runner computes version {FINGERPRINT_VERSION}")
    for p in vectors["pairs"]:
        tally(f"fingerprint {p['name']}", lambda p=p: run_pair(runtime, p))
    print(f"{passed} passed, {failed} failed")
    if runtime.sqlite_dir is not None:
        shutil.rmtree(runtime.sqlite_dir, ignore_errors=True)
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
