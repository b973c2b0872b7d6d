//! Builds the guest crate into a WebAssembly component and puts it in
//! `OUT_DIR/idem_guest.wasm`, where `engine.rs` embeds it.

use std::env;
use std::path::PathBuf;

mod build_component;

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .parent()
        .expect("the host crate sits in the workspace");
    build_component::build_component(
        root,
        "idem-guest",
        "idem_guest",
        &["guest/src", "guest/Cargo.toml"],
    );
}
