//! Builds the guest crate into a WebAssembly component and puts it in
//! `OUT_DIR/idem_guest.wasm`, where `engine.rs` embeds it; with the
//! `middleware` feature, also the guest's `middleware` world into
//! `OUT_DIR/idem_middleware.wasm`, which `middleware.rs` embeds.

use std::env;
use std::path::PathBuf;

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .parent()
        .expect("the host crate sits in the workspace");
    // The guest and the HTTP rules it compiles in (`guest/http`).
    let watch = [
        "guest/src",
        "guest/Cargo.toml",
        "guest/http/src",
        "guest/http/Cargo.toml",
    ];
    idem_build::build_component(root, "idem-guest", "idem_guest", &[], "idem_guest", &watch);
    if env::var_os("CARGO_FEATURE_MIDDLEWARE").is_some() {
        // The same crate with the `middleware` world: the same target
        // directory, so only the guest crate itself is compiled again.
        idem_build::build_component(
            root,
            "idem-guest",
            "idem_guest",
            &["middleware"],
            "idem_middleware",
            &watch,
        );
    }
}
