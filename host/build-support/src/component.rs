//! Builds one workspace crate into a WebAssembly component, for the build
//! scripts of the host (the engine guest) and of the test suite (the
//! misbehaving guest).
//!
//! The crate is built by a nested `cargo` with a target directory of its own
//! (as wasmtime's test-programs do), so it never waits on the outer build's
//! lock. Every build script of one outer target directory shares that one
//! guest directory (`<target>/<profile>/../guest-target`): the guests'
//! dependencies (wit-bindgen and its macro stack) compile once, not once per
//! build script, feature set and `cargo check`. The target is checked (and
//! added where rustup can) before that build.

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
    let target_dir = guest_target_dir(&out_dir);
    std::fs::create_dir_all(&target_dir)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", target_dir.display()));
    // Builds of one package with different features write the same file:
    // hold the directory from the build until the copy, so that a build
    // script running beside this one cannot replace it in between.
    let lock_path = target_dir.join("idem-build.lock");
    let lock = std::fs::File::create(&lock_path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", lock_path.display()));
    lock.lock()
        .unwrap_or_else(|e| panic!("cannot lock {}: {e}", lock_path.display()));

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
    drop(lock);
}

/// The guest target directory for a build script whose `OUT_DIR` is
/// `out_dir`: `guest-target` beside the profile directories of the outer
/// target directory (`OUT_DIR` is `<target>[/<triple>]/<profile>/build/
/// <unit>/out`), or inside `out_dir` when it has no such shape.
fn guest_target_dir(out_dir: &Path) -> PathBuf {
    out_dir
        .ancestors()
        .find(|dir| dir.file_name().is_some_and(|name| name == "build"))
        .and_then(Path::parent)
        .and_then(Path::parent)
        .map(|outer| outer.join("guest-target"))
        .unwrap_or_else(|| out_dir.join("guest-target"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_build_script_of_a_target_dir_shares_one_guest_dir() {
        let host = Path::new("/w/target/debug/build/idem-0123/out");
        let suite = Path::new("/w/target/debug/build/idem-suite-4567/out");
        assert_eq!(guest_target_dir(host), Path::new("/w/target/guest-target"));
        assert_eq!(guest_target_dir(suite), guest_target_dir(host));
        let release = Path::new("/w/target/release/build/idem-89ab/out");
        assert_eq!(
            guest_target_dir(release),
            Path::new("/w/target/guest-target")
        );
        let cross = Path::new("/w/target/x86_64-unknown-linux-gnu/debug/build/idem-1/out");
        assert_eq!(
            guest_target_dir(cross),
            Path::new("/w/target/x86_64-unknown-linux-gnu/guest-target")
        );
        // No `build` component: the build script's own directory.
        assert_eq!(
            guest_target_dir(Path::new("/tmp/out")),
            Path::new("/tmp/out/guest-target")
        );
    }
}
