//! The missing-target path of the build scripts, against the real `rustc`
//! pointed at sysroots that lack the target, and against stand-in `rustup`
//! commands, so that no run downloads anything.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use idem_build::{Ensured, GUEST_TARGET, TargetError, Toolchain};

/// The compiler this test suite was built with: the pinned toolchain.
fn real_rustc() -> PathBuf {
    std::env::var_os("RUSTC").map_or_else(|| PathBuf::from("rustc"), PathBuf::from)
}

/// The workspace root, which holds `rust-toolchain.toml`.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Writes an executable shell script.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write script");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("chmod script");
    path
}

/// A toolchain of the real rustc with an empty sysroot: no target at all.
fn empty_sysroot(dir: &Path, rustup: Option<PathBuf>) -> Toolchain {
    let sysroot = dir.join("sysroot");
    fs::create_dir_all(&sysroot).expect("sysroot");
    Toolchain::new(real_rustc(), Some("1.95.0".to_owned()), rustup)
        .with_rustc_args(["--sysroot".as_ref(), sysroot.as_os_str()])
}

/// A stand-in rustup that logs its arguments to `log` and installs a `core`
/// library into `libdir`, as `rustup target add` does.
fn installing_rustup(dir: &Path, log: &Path, libdir: &Path) -> PathBuf {
    script(
        dir,
        "rustup",
        &format!(
            "echo \"$@\" >> '{}'\nmkdir -p '{}' && touch '{}/libcore-0123abcd.rlib'",
            log.display(),
            libdir.display(),
            libdir.display()
        ),
    )
}

#[test]
fn the_pinned_toolchain_has_the_target() {
    // The toolchain that builds the workspace: the build scripts found the
    // target present or added it, so it is there now.
    let toolchain = Toolchain::new(real_rustc(), None, None);
    assert!(toolchain.has_target().expect("rustc answers"));
    assert_eq!(
        toolchain.ensure_target().expect("present"),
        Ensured::Present
    );
}

#[test]
fn the_pinned_channel_is_read_from_the_toolchain_file() {
    let channel = idem_build::target::pinned_channel(&root()).expect("channel");
    let text = fs::read_to_string(root().join("rust-toolchain.toml")).expect("toolchain file");
    assert!(
        text.contains(&format!("channel = \"{channel}\"")),
        "{channel}"
    );
    assert!(channel.chars().next().is_some_and(|c| c.is_ascii_digit()));
}

#[test]
fn a_sysroot_without_the_target_and_no_rustup_fails_at_once_with_the_command() {
    let dir = tempfile::tempdir().expect("tempdir");
    let toolchain = empty_sysroot(dir.path(), None);
    assert!(!toolchain.has_target().expect("rustc answers"));
    let started = Instant::now();
    let err = toolchain.ensure_target().expect_err("missing");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let TargetError::Missing { command, reason } = &err else {
        panic!("expected Missing, got {err:?}");
    };
    assert_eq!(
        command,
        "rustup target add --toolchain 1.95.0 wasm32-wasip2"
    );
    assert!(reason.contains("rustup was not found"), "{reason}");
    let message = err.to_string();
    assert!(
        message.ends_with("Run: rustup target add --toolchain 1.95.0 wasm32-wasip2"),
        "{message}"
    );
}

#[test]
fn a_missing_target_is_added_with_rustup_for_the_pinned_toolchain() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("rustup.log");
    let libdir = dir
        .path()
        .join("sysroot/lib/rustlib")
        .join(GUEST_TARGET)
        .join("lib");
    let rustup = installing_rustup(dir.path(), &log, &libdir);
    let toolchain = empty_sysroot(dir.path(), Some(rustup));
    assert!(!toolchain.has_target().expect("rustc answers"));

    let ensured = toolchain.ensure_target().expect("added");
    assert_eq!(
        ensured,
        Ensured::Added {
            command: "rustup target add --toolchain 1.95.0 wasm32-wasip2".to_owned()
        }
    );
    assert_eq!(
        fs::read_to_string(&log).expect("log"),
        "target add --toolchain 1.95.0 wasm32-wasip2\n"
    );
    // Now present: a second check runs no rustup.
    assert_eq!(
        toolchain.ensure_target().expect("present"),
        Ensured::Present
    );
    assert_eq!(fs::read_to_string(&log).expect("log").lines().count(), 1);
}

#[test]
fn a_failing_rustup_is_reported_with_its_error_and_the_command() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rustup = script(
        dir.path(),
        "rustup",
        "echo 'error: could not download component' >&2\nexit 1",
    );
    let toolchain = empty_sysroot(dir.path(), Some(rustup));
    let err = toolchain.ensure_target().expect_err("missing");
    let TargetError::Missing { command, reason } = &err else {
        panic!("expected Missing, got {err:?}");
    };
    assert_eq!(
        command,
        "rustup target add --toolchain 1.95.0 wasm32-wasip2"
    );
    assert!(reason.contains("could not download component"), "{reason}");
}

#[test]
fn a_rustup_that_installs_elsewhere_is_not_taken_for_success() {
    // rustup succeeds but the compiler in use is not rustup's (a distro
    // rustc, say): the target is still missing, and the error says so.
    let dir = tempfile::tempdir().expect("tempdir");
    let rustup = script(dir.path(), "rustup", "exit 0");
    let toolchain = empty_sysroot(dir.path(), Some(rustup));
    let err = toolchain.ensure_target().expect_err("missing");
    assert!(
        err.to_string().contains("still has no wasm32-wasip2"),
        "{err}"
    );
}

#[test]
fn a_compiler_that_cannot_run_is_a_rustc_error() {
    let toolchain = Toolchain::new("/nonexistent/rustc", None, None);
    let err = toolchain.ensure_target().expect_err("no rustc");
    assert!(matches!(err, TargetError::Rustc { .. }), "{err:?}");
    assert!(err.to_string().contains("/nonexistent/rustc"), "{err}");
}

#[test]
fn without_a_toolchain_name_the_command_uses_rustups_default() {
    let toolchain = Toolchain::new(real_rustc(), None, None);
    assert_eq!(toolchain.add_command(), "rustup target add wasm32-wasip2");
}
