//! Build-script support shared by the idem crates whose build scripts
//! compile a guest into a WebAssembly component.
//!
//! [`target`] makes sure the compiler has the `wasm32-wasip2` target before
//! anything is compiled for it; [`component`] builds a guest crate with a
//! nested cargo and copies the component into `OUT_DIR`.

#![warn(missing_docs)]

pub mod component;
pub mod target;

pub use component::build_component;
pub use target::{Ensured, GUEST_TARGET, TargetError, Toolchain, ensure_target_for_build};
