import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { Idem, ManualClock, SqliteStore } from "idem-engine";

/** 2026-01-01T00:00:00Z: every test's clock starts here. */
export const T0 = 1767225600000;

/** A fresh SQLite file, a manual clock and an engine over them. */
export function setup({ results } = {}) {
  const dir = mkdtempSync(join(tmpdir(), "idem-node-"));
  const path = join(dir, "idem.db");
  const store = new SqliteStore(path);
  const clock = new ManualClock(T0);
  const idem = new Idem({ store, clock, results });
  return { dir, path, store, clock, idem };
}

export const key = (k, more = {}) => ({ scope: "tenant-1", bizType: "order.create", key: k, ...more });
