#!/usr/bin/env bash
# CI for the Node and Python packages (issue 17): each package is built from
# the repository, installed into a clean project, and its own test suite runs
# there; then the cross-language tests (Rust, Node and Python on one SQLite
# file) and the conformance scenarios against the packages' SQLite stores.
#
#   bash packages/ci.sh PATH/TO/idem_guest.wasm PATH/TO/idem-test-worker
#
# Every step ends with its runner's summary; any failure exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
wasm=$(realpath "$1")
worker=$(realpath "$2")
work=$(mktemp -d "${TMPDIR:-/tmp}/idem-packages.XXXXXX")
trap 'rm -rf "$work"' EXIT
quiet=(--no-audit --no-fund --loglevel=error)

# better-sqlite3 has no prebuilt binary it can fetch here (its install
# script downloads one from outside the package registry), so it compiles
# from source: minutes on this machine. The binary compiled once is kept in
# a local prebuild directory, which its install script reads before it
# tries to download, so later installs (the clean project below, later CI
# runs on this machine) take seconds.
export npm_config_better_sqlite3_local_prebuilds="${IDEM_PREBUILDS:-$HOME/.cache/idem-prebuilds}"
mkdir -p "$npm_config_better_sqlite3_local_prebuilds"

echo "== packages: node $(node --version): build and pack"
(
    cd packages/node
    npm ci "${quiet[@]}"
    node scripts/build.js "$wasm"
    npm pack --pack-destination "$work" "${quiet[@]}" >/dev/null
)
bsq=packages/node/node_modules/better-sqlite3
bsq_version=$(node -p "require('./$bsq/package.json').version")
prebuild="$npm_config_better_sqlite3_local_prebuilds/better-sqlite3-v$bsq_version-node-v$(node -p process.versions.modules)-$(node -p process.platform)-$(node -p process.arch).tar.gz"
if [ ! -f "$prebuild" ]; then
    tar -C "$bsq" -czf "$prebuild" build/Release/better_sqlite3.node
fi

echo "== packages: node: install the tarball into a clean project, run its tests there"
node_project="$work/node-project"
mkdir -p "$node_project"
cp -r packages/node/test "$node_project/test"
cp packages/cross/racer.mjs "$node_project/racer.mjs"
(
    cd "$node_project"
    printf '{ "name": "idem-node-ci", "private": true, "type": "module" }\n' > package.json
    npm install "${quiet[@]}" "$work"/idem-engine-*.tgz express@4.21.2
    node --test test/*.test.js
)

echo "== packages: python $(python3 --version | cut -d' ' -f2): build the wheel"
build_venv="$work/build-venv"
python3 -m venv "$build_venv"
"$build_venv/bin/pip" install --quiet --disable-pip-version-check build==1.2.2.post1
cp -r packages/python "$work/python-src"
rm -rf "$work/python-src/build" "$work/python-src/dist"
cp "$wasm" "$work/python-src/src/idem/idem_guest.wasm"
rm -rf "$work/python-src/src/idem/schema"
cp -r host/sqlite/schema "$work/python-src/src/idem/schema"
"$build_venv/bin/python" -m build --wheel --outdir "$work/wheels" "$work/python-src" >/dev/null
ls "$work/wheels"

echo "== packages: python: install the wheel into a clean venv, run its tests there"
venv="$work/test-venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "$work"/wheels/idem_engine-*.whl \
    pytest==8.3.4 starlette==0.46.1 httpx==0.28.1 fastapi==0.115.14
cp -r packages/python/tests "$work/python-tests"
status=0
(cd "$work/python-tests" && "$venv/bin/python" -m pytest -q -p no:cacheprovider) || status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
elif [ "$status" -ne 0 ]; then
    exit "$status"
fi

echo "== packages: cross-language (Rust, Node, Python on one SQLite file)"
"$venv/bin/python" packages/cross/cross.py --rust "$worker" --node-racer "$node_project/racer.mjs" \
    --python-racer packages/cross/racer.py --python "$venv/bin/python" --keys 500 --dir "$work"

echo "== packages: conformance scenarios against the packages' SQLite stores"
# .ci/run installed the runner's jco already; install it when run alone.
[ -d tests/conformance/node/node_modules ] || (cd tests/conformance/node && npm ci "${quiet[@]}")
node tests/conformance/node/run.mjs "$wasm" --store sqlite
"$venv/bin/python" tests/conformance/python/run.py "$wasm" --store sqlite
