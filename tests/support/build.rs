//! The tests' own `cargo build`s (the `idem` binary, the axum example),
//! resolving features as the README's test command does.

/// A `cargo build` of this workspace, with the profile of this test build,
/// that resolves features as `cargo test --workspace` (the README's test
/// command) does, so that it finds every crate already built. The caller
/// selects its target and a target that needs the dev-dependencies
/// (examples). With `-p` alone cargo resolved other features for
/// Wasmtime's dependencies and compiled Wasmtime and the host again,
/// minutes of CI.
///
/// Without the variables cargo sets for the test process itself
/// ([`cargo_set`]): build scripts that declare `rerun-if-env-changed` for
/// one of them (ring's does for `CARGO_MANIFEST_DIR` and `CARGO_PKG_*`)
/// would see them change between the README's `cargo test` and this build,
/// and run again, recompiling ring and every crate above it (rustls, the
/// broker clients, the test binaries) in both, on every test run.
pub fn workspace_build() -> escargot::CargoBuild {
    let build = escargot::CargoBuild::new()
        .manifest_path(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .current_release()
        .args(["--locked", "--workspace"]);
    std::env::vars_os()
        .map(|(name, _)| name)
        .filter(|name| name.to_str().is_some_and(cargo_set))
        .fold(build, |build, name| build.env_remove(name))
}

/// True for a variable cargo sets when it runs a test binary, rather than
/// one a user sets to configure cargo (`CARGO_HOME`, `CARGO_TARGET_DIR`,
/// `CARGO_BUILD_*`, ...), which the build must keep.
fn cargo_set(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "OUT_DIR"
        )
}
