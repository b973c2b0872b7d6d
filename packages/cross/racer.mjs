// The Node side of the cross-language tests; the same job as the Rust
// `idem-test-worker race` (tests/support/worker.rs), on the same file:
//
//   node racer.mjs race <db> <keys>     print "ready", wait for a line on stdin, then claim and
//                                       execute keys k0..k<keys-1> (scope tenant-1, biz type
//                                       order.create, body {}), each writing one row into
//                                       orders (idem_key, worker) in the business transaction
//                                       with the completion; print "executed N"
//   node racer.mjs replay <db> <keys>   expect every key to replay with result ref order-<i>;
//                                       print "replayed N"
//
// Run it from a project that has the idem-engine package installed.
import { createInterface } from "node:readline";

import { Idem, SqliteStore } from "idem-engine";

const [mode, db, count] = process.argv.slice(2);
const keys = Number(count);
const store = new SqliteStore(db);
store.db.exec("CREATE TABLE IF NOT EXISTS orders (idem_key TEXT NOT NULL, worker TEXT NOT NULL)");
const idem = new Idem({ store });
const me = `node-${process.pid}`;
const insert = store.db.prepare("INSERT INTO orders (idem_key, worker) VALUES (?, ?)");
const begin = (i) => idem.begin({ scope: "tenant-1", bizType: "order.create", key: `k${i}`, body: "{}", bodyKind: "json" });

if (mode === "replay") {
  let replayed = 0;
  for (let i = 0; i < keys; i++) {
    const d = begin(i);
    if (d.decision !== "replay" || d.resultRef !== `order-${i}`) {
      console.log(`bad k${i}: ${JSON.stringify({ decision: d.decision, resultRef: d.resultRef })}`);
      process.exit(1);
    }
    replayed += 1;
  }
  console.log(`replayed ${replayed}`);
} else if (mode === "race") {
  console.log("ready");
  const rl = createInterface({ input: process.stdin });
  await new Promise((resolve) => rl.once("line", resolve));
  rl.close();
  let executed = 0;
  // A busy store past its timeout leaves the key as it was: try again.
  const retrying = (f) => {
    for (let attempt = 1; ; attempt++) {
      try {
        return f();
      } catch (e) {
        const busy = e.kind === "store" || /^SQLITE_BUSY/.test(e.code ?? "");
        if (!busy || attempt === 5) throw e;
      }
    }
  };
  for (let i = 0; i < keys; i++) {
    const d = retrying(() => begin(i));
    if (d.decision !== "execute") continue;
    retrying(() => store.transaction(() => {
      insert.run(`k${i}`, me);
      const c = idem.complete(d.ticket, {}, { resultRef: `order-${i}` });
      if (c.completion !== "recorded" || c.status !== "succeeded") throw new Error(`k${i}: ${JSON.stringify(c)}`);
    }));
    executed += 1;
  }
  console.log(`executed ${executed}`);
} else {
  console.error("usage: node racer.mjs race|replay <db> <keys>");
  process.exit(2);
}
