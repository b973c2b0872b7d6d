//! Builds the deliberately misbehaving guest (`tests/guests/misbehaving`)
//! into `OUT_DIR/idem_misbehaving_guest.wasm`, for `tests/bounded.rs`.

use std::env;
use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    idem_build::build_component(
        &root,
        "idem-misbehaving-guest",
        "idem_misbehaving_guest",
        &[],
        "idem_misbehaving_guest",
        &[
            "tests/guests/misbehaving/src",
            "tests/guests/misbehaving/Cargo.toml",
            "guest/src",
            "guest/Cargo.toml",
            "guest/http/src",
            "guest/http/Cargo.toml",
        ],
    );
}
