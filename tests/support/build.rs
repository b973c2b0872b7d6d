//! The tests' own `cargo build`s (the `idem` binary, the axum example),
//! resolving features as the README's test command does.

/// A `cargo build` of this workspace, with the profile of this test build,
/// that resolves features as `cargo test --workspace` (the README's test
/// command) does, so that it finds every crate already built. The caller
/// selects its target and a target that needs the dev-dependencies
/// (examples). With `-p` alone cargo resolved other features for
/// Wasmtime's dependencies and compiled Wasmtime and the host again,
/// minutes of CI.
pub fn workspace_build() -> escargot::CargoBuild {
    escargot::CargoBuild::new()
        .manifest_path(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .current_release()
        .args(["--locked", "--workspace"])
}
