//! The idem engine guest.
//!
//! Every idempotency decision is made here: key validation, the request
//! fingerprint, the record state machine and the answer to each duplicate.
//! The crate compiles to a WebAssembly component (`wasm32-wasip2`) that
//! imports only idem's own interfaces, and natively for unit tests.
//!
//! Layout: [`machine`] holds the decision logic, written against the
//! [`machine::Env`] trait; [`component`] is the thin layer that binds it to
//! the component's imports and exports.
//!
//! The middleware component (`guest/middleware`, the `middleware` world)
//! builds on this crate: it runs the same state machine through the same
//! [`component::Imports`], and its bindings use this crate's types.
#![cfg_attr(target_arch = "wasm32", no_std)]
#![warn(missing_docs)]

extern crate alloc;

pub mod canonical;
pub mod fingerprint;
pub mod machine;
pub mod number;
pub mod owned;
pub mod validate;

#[cfg(any(test, fuzzing))]
#[doc(hidden)]
pub mod props;

pub mod component;

pub mod bindings {
    //! Types and functions generated from `wit/` by wit-bindgen.
    #![allow(missing_docs)]
    wit_bindgen::generate!({
        path: "../wit",
        world: "idem",
        generate_all,
        pub_export_macro: true,
        additional_derives: [PartialEq, Eq],
    });
}

#[cfg(target_arch = "wasm32")]
mod runtime {
    //! What `no_std` needs on wasm: an allocator and a panic handler.

    // `memcmp` and friends come from the target's own wasi-libc, which the
    // toolchain ships (`self-contained/libc.a`). Only the pure memory
    // routines are linked: they import nothing.
    #[link(name = "c")]
    unsafe extern "C" {}

    #[global_allocator]
    static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

    /// The canonical ABI's allocator hook. On `wasm32-wasip2` the standard
    /// library usually provides it; a `no_std` guest must, over the global
    /// allocator.
    ///
    /// # Safety
    /// Called only by the component runtime, with the canonical ABI's
    /// arguments: a block it got from here (or null with `old_len` 0), its
    /// length and alignment, and the new length.
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn cabi_realloc(
        old_ptr: *mut u8,
        old_len: usize,
        align: usize,
        new_len: usize,
    ) -> *mut u8 {
        use alloc::alloc::{Layout, alloc, realloc};
        let ptr = if old_len == 0 {
            if new_len == 0 {
                return align as *mut u8;
            }
            // SAFETY: the runtime passes a power-of-two alignment and a size
            // that fits its address space.
            unsafe { alloc(Layout::from_size_align_unchecked(new_len, align)) }
        } else {
            // SAFETY: `old_ptr` came from this allocator with this layout.
            unsafe {
                realloc(
                    old_ptr,
                    Layout::from_size_align_unchecked(old_len, align),
                    new_len,
                )
            }
        };
        if ptr.is_null() {
            core::arch::wasm32::unreachable();
        }
        ptr
    }

    /// A panic is a bug in the engine: trap, so that the host discards the
    /// instance. Nothing is half-written, because every store write is one
    /// atomic import call.
    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
        core::arch::wasm32::unreachable()
    }
}
