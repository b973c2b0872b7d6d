"""The Python side of the cross-language tests; the same job as the Rust
`idem-test-worker race` (tests/support/worker.rs), on the same file:

    python racer.py race <db> <keys>     print "ready", wait for a line on stdin, then claim and
                                         execute keys k0..k<keys-1> (scope tenant-1, biz type
                                         order.create, body {}), each writing one row into
                                         orders (idem_key, worker) in the business transaction
                                         with the completion; print "executed N"
    python racer.py replay <db> <keys>   expect every key to replay with result ref order-<i>;
                                         print "replayed N"

Run it with a Python that has the idem-engine package installed.
"""

import os
import sys

from idem import EngineError, Idem, Recorded, SqliteStore, StoreError


def main(mode, db, count):
    keys = int(count)
    store = SqliteStore(db)
    store.connection.execute("CREATE TABLE IF NOT EXISTS orders (idem_key TEXT NOT NULL, worker TEXT NOT NULL)")
    idem = Idem(store)
    me = f"python-{os.getpid()}"

    def begin(i):
        return idem.begin("tenant-1", "order.create", f"k{i}", body=b"{}", body_kind="json")

    if mode == "replay":
        for i in range(keys):
            d = begin(i)
            if d.decision != "replay" or d.result_ref != f"order-{i}":
                print(f"bad k{i}: {d}", flush=True)
                return 1
        print(f"replayed {keys}", flush=True)
        return 0
    if mode != "race":
        print("usage: python racer.py race|replay <db> <keys>", file=sys.stderr)
        return 2
    print("ready", flush=True)
    sys.stdin.readline()
    executed = 0
    def retrying(f):
        # A busy store past its timeout leaves the key as it was: try again.
        for attempt in range(1, 6):
            try:
                return f()
            except (EngineError, StoreError) as e:
                if getattr(e, "kind", None) not in ("store", "unavailable") or attempt == 5:
                    raise

    def business(i, ticket):
        with store.transaction() as conn:
            conn.execute("INSERT INTO orders (idem_key, worker) VALUES (?, ?)", (f"k{i}", me))
            c = idem.complete(ticket, result_ref=f"order-{i}")
            if c != Recorded("succeeded"):
                raise RuntimeError(f"k{i}: {c}")

    for i in range(keys):
        d = retrying(lambda: begin(i))
        if d.decision != "execute":
            continue
        retrying(lambda: business(i, d.ticket))
        executed += 1
    print(f"executed {executed}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
