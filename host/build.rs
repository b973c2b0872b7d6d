//! Builds the guest crate into a WebAssembly component and puts it in
//! `OUT_DIR/idem_guest.wasm`, where `engine.rs` embeds it; with the
//! `middleware` feature, also the guest's `middleware` world into
//! `OUT_DIR/idem_middleware.wasm`, which `middleware.rs` embeds.
//!
//! The guest is built by a nested `cargo` with its own target directory (as
//! wasmtime's test-programs do), so it never waits on the outer build's lock.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const GUEST_TARGET: &str = "wasm32-wasip2";
const GUEST_PROFILE: &str = "guest";

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .parent()
        .expect("the host crate sits in the workspace")
        .to_path_buf();
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let target_dir = out_dir.join("guest-target");

    for path in [
        "guest/src",
        "guest/Cargo.toml",
        "wit",
        "Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }

    build_guest(&root, &target_dir, &out_dir, &[], "idem_guest.wasm");
    if env::var_os("CARGO_FEATURE_MIDDLEWARE").is_some() {
        // The same crate with the `middleware` world: the same target
        // directory, so only the guest crate itself is compiled again.
        build_guest(
            &root,
            &target_dir,
            &out_dir,
            &["--features", "middleware"],
            "idem_middleware.wasm",
        );
    }
}

/// Builds the guest with `extra` cargo arguments and copies the component
/// to `OUT_DIR/dest_name`. The builds share one output path, so each copy
/// is taken right after its build.
fn build_guest(root: &Path, target_dir: &Path, out_dir: &Path, extra: &[&str], dest_name: &str) {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args([
            "build",
            "--locked",
            "-p",
            "idem-guest",
            "--target",
            GUEST_TARGET,
        ])
        .args(["--profile", GUEST_PROFILE])
        .args(extra)
        .arg("--target-dir")
        .arg(target_dir);
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
    assert!(status.success(), "building the guest component failed");

    let built = target_dir
        .join(GUEST_TARGET)
        .join(GUEST_PROFILE)
        .join("idem_guest.wasm");
    let dest = out_dir.join(dest_name);
    std::fs::copy(&built, &dest)
        .unwrap_or_else(|e| panic!("cannot copy {} to {}: {e}", built.display(), dest.display()));
}
