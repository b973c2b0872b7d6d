// Transpiles the engine component into dist/ with jco, in instantiation
// mode (the component imports no WASI, so no preview2 shim is needed).
//
//   node scripts/build.js PATH/TO/idem_guest.wasm   (or IDEM_WASM=PATH)
//   node scripts/build.js --check                   (fails when dist/ is missing)

import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const dist = join(root, "dist");

if (process.argv[2] === "--check") {
  if (!existsSync(join(dist, "idem.js"))) {
    console.error("dist/idem.js is missing: run `node scripts/build.js PATH/TO/idem_guest.wasm` first");
    process.exit(1);
  }
  process.exit(0);
}

const wasmArg = process.argv[2] ?? process.env.IDEM_WASM;
if (!wasmArg) {
  console.error("usage: node scripts/build.js PATH/TO/idem_guest.wasm (or set IDEM_WASM)");
  process.exit(2);
}
const wasm = resolve(wasmArg);
const jco = join(root, "node_modules/@bytecodealliance/jco/dist/jco.js");
rmSync(dist, { recursive: true, force: true });
mkdirSync(dist, { recursive: true });
execFileSync(process.execPath, [jco, "transpile", wasm,
  "--name", "idem", "--instantiation", "sync", "--no-typescript", "--quiet", "-o", dist], { stdio: "inherit" });
const bytes = readFileSync(wasm);
writeFileSync(join(dist, "component.json"), JSON.stringify({
  sha256: createHash("sha256").update(bytes).digest("hex"), bytes: bytes.length,
}, null, 2) + "\n");
console.log(`dist/: the component (${bytes.length} bytes) transpiled by jco`);
