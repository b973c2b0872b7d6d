//! With the `middleware` feature, builds the middleware guest crate
//! (`guest/middleware`, the `middleware` world) into a WebAssembly component and puts it in
//! `OUT_DIR/idem_middleware.wasm`, where `middleware.rs` embeds it. The
//! engine component is `idem-engine`'s (host/engine/build.rs); both builds
//! share one guest target directory.

use std::env;
use std::path::PathBuf;

fn main() {
    if env::var_os("CARGO_FEATURE_MIDDLEWARE").is_none() {
        return;
    }
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .ancestors()
        .nth(2)
        .expect("the server crate sits in host/ of the workspace");
    // The middleware, the engine it builds on and the HTTP rules.
    let watch = [
        "guest/middleware/src",
        "guest/middleware/Cargo.toml",
        "guest/src",
        "guest/Cargo.toml",
        "guest/http/src",
        "guest/http/Cargo.toml",
    ];
    idem_build::build_component(
        root,
        "idem-middleware-guest",
        "idem_middleware_guest",
        &[],
        "idem_middleware",
        &watch,
    );
}
