//! Builds the deliberately misbehaving guest (`tests/guests/misbehaving`)
//! into `OUT_DIR/idem_misbehaving_guest.wasm`, for `tests/bounded.rs`, and
//! its `middleware` world into `OUT_DIR/idem_misbehaving_middleware.wasm`,
//! for `tests/middleware.rs`; and the example handler component
//! (`examples/order-handler`) into `OUT_DIR/order_handler.wasm`, which
//! `tests/middleware.rs` composes with the middleware.

use std::env;
use std::path::PathBuf;

fn main() {
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let watch = [
        "tests/guests/misbehaving/src",
        "tests/guests/misbehaving/Cargo.toml",
        "guest/src",
        "guest/Cargo.toml",
        "guest/middleware/src",
        "guest/middleware/Cargo.toml",
        "guest/http/src",
        "guest/http/Cargo.toml",
    ];
    idem_build::build_component(
        &root,
        "idem-misbehaving-guest",
        "idem_misbehaving_guest",
        &[],
        "idem_misbehaving_guest",
        &watch,
    );
    // The same crate with the `middleware` world: the same target
    // directory, so only the two guest crates are compiled again.
    idem_build::build_component(
        &root,
        "idem-misbehaving-guest",
        "idem_misbehaving_guest",
        &["middleware"],
        "idem_misbehaving_middleware",
        &watch,
    );
    // The handler the middleware tests compose. Built here, in the guest
    // target directory the guests share, it compiles only its own crate:
    // the test built it in a directory of its own, compiling wit-bindgen
    // and its macro stack again, minutes of CI on two cores.
    idem_build::build_component(
        &root,
        "order-handler",
        "order_handler",
        &[],
        "order_handler",
        &[
            "examples/order-handler/src",
            "examples/order-handler/Cargo.toml",
        ],
    );
}
