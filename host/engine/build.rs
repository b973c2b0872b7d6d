//! Builds the guest crate into a WebAssembly component and puts it in
//! `OUT_DIR/idem_guest.wasm`, where `engine.rs` embeds it.

use std::env;
use std::path::PathBuf;

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .ancestors()
        .nth(2)
        .expect("the engine crate sits in host/ of the workspace");
    // The guest and the HTTP rules it compiles in (`guest/http`).
    let watch = [
        "guest/src",
        "guest/Cargo.toml",
        "guest/http/src",
        "guest/http/Cargo.toml",
    ];
    idem_build::build_component(root, "idem-guest", "idem_guest", &[], "idem_guest", &watch);
}
