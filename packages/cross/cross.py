"""Cross-language tests: the Rust host, the Node package and the Python
package on one SQLite file.

    python cross.py --rust PATH/idem-test-worker --node-racer PROJECT/racer.mjs \
        --python-racer racer.py [--python PYTHON] [--keys 500] [--dir DIR]

1. A key claimed and completed by one language is replayed by the two others,
   each way round: Rust -> Node and Python, Node -> Rust and Python, Python ->
   Rust and Node (a replay in a racer; an "executed 0" from the Rust worker,
   which only executes keys that are free).
2. The three languages create the same schema: the files each one created
   in (1) hold the same schema version and the same tables and indexes, with
   the same SQL up to whitespace. The schema's text is written in each
   language's store; this is what keeps the three copies one.
3. Three processes, one per language, race on `--keys` keys in one file:
   every key is executed exactly once (one business row per key, the sum of
   the executions is the number of keys).

Prints one line per check and "N passed, M failed"; exits non-zero on any failure.
"""

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile


def start(cmd):
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if line != "ready":
        out, errs = p.communicate(timeout=60)
        raise RuntimeError(f"{cmd[0]} did not get ready: {line!r} {out!r} {errs!r}")
    return p


def finish(p, cmd):
    out, errs = p.communicate(timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {out!r} {errs[-2000:]!r}")
    return out.strip().splitlines()[-1]


def run_race(cmd, go=True):
    p = start(cmd)
    p.stdin.write("go\n")
    p.stdin.flush()
    last = finish(p, cmd)
    if not last.startswith("executed "):
        raise RuntimeError(f"{' '.join(cmd)}: {last!r}")
    return int(last.split()[1])


def run_replay(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    last = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode != 0 or not last.startswith("replayed "):
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stdout[-2000:]!r} {out.stderr[-2000:]!r}")
    return int(last.split()[1])


def rows(db):
    c = sqlite3.connect(db)
    try:
        total, distinct = c.execute("SELECT COUNT(*), COUNT(DISTINCT idem_key) FROM orders").fetchone()
        by_worker = dict(c.execute("SELECT substr(worker, 1, instr(worker || '-', '-') - 1), COUNT(*) FROM orders GROUP BY 1"))
        return total, distinct, by_worker
    finally:
        c.close()


def schema(db):
    """The idempotency store's schema in `db`: its version, and each table's
    and index's SQL with whitespace collapsed (the business `orders` table
    is the racers' own)."""
    c = sqlite3.connect(db)
    try:
        version = c.execute("PRAGMA user_version").fetchone()[0]
        objects = [
            (kind, name, " ".join((sql or "").split()))
            for kind, name, sql in c.execute(
                "SELECT type, name, sql FROM sqlite_master "
                "WHERE tbl_name = 'idempotency_record' ORDER BY type, name")
        ]
        return version, objects
    finally:
        c.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rust", required=True)
    ap.add_argument("--node-racer", required=True)
    ap.add_argument("--python-racer", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--node", default="node")
    ap.add_argument("--keys", type=int, default=500)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="idem-cross-")
    racers = {
        "rust": lambda mode, db, n: [a.rust, mode, db, str(n)],
        "node": lambda mode, db, n: [a.node, a.node_racer, mode, db, str(n)],
        "python": lambda mode, db, n: [a.python, a.python_racer, mode, db, str(n)],
    }
    passed = failed = 0

    def check(name, f):
        nonlocal passed, failed
        try:
            f()
            passed += 1
            print(f"ok   {name}", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported and counted
            failed += 1
            print(f"FAIL {name}: {e}", flush=True)

    n = 20
    for first in ("rust", "node", "python"):
        def handoff(first=first):
            db = os.path.join(work, f"handoff-{first}.db")
            executed = run_race(racers[first]("race", db, n))
            if executed != n:
                raise AssertionError(f"{first} executed {executed} of {n} fresh keys")
            for other in ("rust", "node", "python"):
                if other == first:
                    continue
                if other == "rust":
                    # The Rust worker replays what is stored and executes only free keys.
                    again = run_race(racers["rust"]("race", db, n))
                    if again != 0:
                        raise AssertionError(f"rust executed {again} keys that {first} had completed")
                else:
                    replayed = run_replay(racers[other]("replay", db, n))
                    if replayed != n:
                        raise AssertionError(f"{other} replayed {replayed} of {n}")
            total, distinct, _ = rows(db)
            if (total, distinct) != (n, n):
                raise AssertionError(f"{total} business rows for {distinct} keys, expected {n}")
        check(f"keys completed by {first} are replayed by the two other languages", handoff)

    def same_schema():
        made = {first: schema(os.path.join(work, f"handoff-{first}.db")) for first in ("rust", "node", "python")}
        version, objects = made["rust"]
        if version < 1 or len(objects) < 2:
            raise AssertionError(f"the Rust store made no schema: version {version}, {objects}")
        for other in ("node", "python"):
            if made[other] != made["rust"]:
                theirs = dict(((k, n), q) for k, n, q in made[other][1])
                ours = dict(((k, n), q) for k, n, q in objects)
                differ = sorted(set(theirs.items()) ^ set(ours.items()))
                raise AssertionError(
                    f"{other}'s schema differs from Rust's: version {made[other][0]} against {version}; {differ}")
        print(f"     schema version {version}: {len(objects)} tables and indexes, the same in the three files", flush=True)
    check("rust, node and python create the same schema", same_schema)

    def race():
        db = os.path.join(work, "race.db")
        # Create the file and its tables before the start, as the Rust test does.
        run_race(racers["rust"]("race", db, 0))
        procs = [(name, racers[name]("race", db, a.keys)) for name in ("rust", "node", "python")]
        started = [(name, cmd, start(cmd)) for name, cmd in procs]
        for _, _, p in started:
            p.stdin.write("go\n")
            p.stdin.flush()
        executed = {}
        for name, cmd, p in started:
            last = finish(p, cmd)
            if not last.startswith("executed "):
                raise RuntimeError(f"{name}: {last!r}")
            executed[name] = int(last.split()[1])
        total, distinct, by_worker = rows(db)
        print(f"     race on {a.keys} keys: executed {executed}, business rows {total} ({distinct} keys) by {by_worker}", flush=True)
        if sum(executed.values()) != a.keys or total != a.keys or distinct != a.keys:
            raise AssertionError(f"each key must run exactly once: executed {executed}, {total} rows for {distinct} keys")
    check(f"3 processes (rust, node, python) racing on {a.keys} keys execute each key once", race)

    print(f"{passed} passed, {failed} failed")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())
