//! Builds one workspace crate into a WebAssembly component, for the build
//! scripts of the host (the engine guest) and of the test suite (the
//! misbehaving guest).
//!
//! The crate is built by a nested `cargo` with its own target directory (as
//! wasmtime's test-programs do), so it never waits on the outer build's lock.
//! The target is checked (and added where rustup can) before that build.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::target::{GUEST_TARGET, ensure_target_for_build};

/// The cargo profile the guests are built with (the workspace defines it).
const GUEST_PROFILE: &str = "guest";

/// Builds `package` (a workspace member under `root`) for `wasm32-wasip2`
/// with the `guest` profile and copies its component
/// (`<file_stem>.wasm`) to `OUT_DIR/<dest_stem>.wasm`. `features` are the
/// cargo features to build it with; builds of one package share their
/// output path, so each copy is taken right after its build. `watch` lists
/// the paths, relative to `root`, whose change rebuilds it.
pub fn build_component(
    root: &Path,
    package: &str,
    file_stem: &str,
    features: &[&str],
    dest_stem: &str,
    watch: &[&str],
) {
    ensure_target_for_build(root);
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let target_dir = out_dir.join("guest-target");

    for path in watch
        .iter()
        .chain(["wit", "Cargo.toml", "Cargo.lock"].iter())
    {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }

    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args(["build", "--locked", "-p", package, "--target", GUEST_TARGET])
        .args(["--profile", GUEST_PROFILE])
        .args(features.iter().flat_map(|f| ["--features", f]))
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer build's settings are not the guest's: clippy's wrapper,
    // host RUSTFLAGS and the outer target dir must not leak in.
    for var in [
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_MAKEFLAGS",
        "MAKEFLAGS",
        "MFLAGS",
    ] {
        cmd.env_remove(var);
    }
    let status = cmd.status().expect("failed to run cargo for the guest");
    assert!(status.success(), "building the {package} component failed");

    let built = target_dir
        .join(GUEST_TARGET)
        .join(GUEST_PROFILE)
        .join(format!("{file_stem}.wasm"));
    let dest = out_dir.join(format!("{dest_stem}.wasm"));
    std::fs::copy(&built, &dest)
        .unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", built.display(), dest.display()));
}
