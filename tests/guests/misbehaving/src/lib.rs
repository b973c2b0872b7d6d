//! A deliberately misbehaving idem engine component.
//!
//! It targets idem's world and behaves like the real engine (it calls the
//! real state machine) except when `begin` is asked, through the request's
//! biz type, to misbehave:
//!
//! - [`LOOP`]: compute forever;
//! - [`ALLOCATE`]: allocate memory without end;
//! - [`TRAP`]: trap before touching the store;
//! - [`TRAP_AFTER_CLAIM`]: make the real decision (which claims the key
//!   with a store write) and trap before answering;
//! - [`COUNT`]: answer `in-progress` with `retry-after-ms` set to the
//!   number of calls this instance has served, so a test can tell a fresh
//!   instance from a reused one;
//! - [`SLOW_HOST`]: spend [`SLOW_HOST_PAUSES`] × [`SLOW_HOST_PAUSE_MS`] in
//!   the host's `clock.pause`, then answer like [`COUNT`].
//!
//! With the `middleware` feature it builds the `middleware` world instead:
//! the real middleware (`idem_middleware_guest::wrap`) around the imported
//! handler, except that a request whose route has the biz type [`LOOP`] or
//! [`ALLOCATE`] (set by the host's configuration) runs, in place of the
//! handler, code that computes forever or allocates without end: after the
//! middleware claimed its key, as a handler that misbehaves would.
#![cfg_attr(target_arch = "wasm32", no_std)]
// Natively the crate is compiled (and linted) but exports nothing.
#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
#![warn(missing_docs)]

extern crate alloc;

use alloc::boxed::Box;
use alloc::string::String;
use alloc::vec::Vec;
use core::sync::atomic::{AtomicU64, Ordering};

use idem_guest::bindings::exports::idem::engine::engine::{
    BeginRequest, Busy, Completion, Decision, Disposition, EngineError, Extension, KeyStatus,
    Policy, ReconcileReport, Resolution, Settlement, Ticket,
};
// The engine interface this component exports: the engine world's, or the
// middleware world's (the same types, through the middleware crate's
// bindings).
#[cfg(not(feature = "middleware"))]
use idem_guest::bindings::exports::idem::engine::engine::Guest;
#[cfg(feature = "middleware")]
use idem_guest::bindings::exports::idem::engine::engine::Guest as _;
use idem_guest::bindings::idem::engine::types::{Failure, RecordKey, Success};
use idem_guest::component::{Component as Engine, Imports};
use idem_guest::machine::{self, Env};
#[cfg(feature = "middleware")]
use idem_middleware_guest::bindings::exports::idem::engine::engine::Guest;

/// Biz type: compute forever.
pub const LOOP: &str = "misbehave-loop";
/// Biz type: allocate without end.
pub const ALLOCATE: &str = "misbehave-allocate";
/// Biz type: trap at once.
pub const TRAP: &str = "misbehave-trap";
/// Biz type: claim the key through the real engine, then trap.
pub const TRAP_AFTER_CLAIM: &str = "misbehave-trap-after-claim";
/// Biz type: report how many calls this instance has served.
pub const COUNT: &str = "misbehave-count";
/// Biz type: wait in the host, then report like [`COUNT`].
pub const SLOW_HOST: &str = "misbehave-slow-host";
/// How many times [`SLOW_HOST`] calls `clock.pause`.
pub const SLOW_HOST_PAUSES: u64 = 4;
/// How long each of those pauses asks for, in ms.
pub const SLOW_HOST_PAUSE_MS: u64 = 100;

/// Calls served by this instance (its linear memory starts at zero).
static CALLS: AtomicU64 = AtomicU64::new(0);

fn served() -> Decision {
    Decision::InProgress(Busy {
        retry_after_ms: CALLS.load(Ordering::Relaxed),
        lease_until: 0,
    })
}

/// Computes forever.
fn spin() -> ! {
    let mut n = 0u64;
    loop {
        n = core::hint::black_box(n.wrapping_add(1));
    }
}

/// Allocates 1 MiB after 1 MiB, without end.
fn hoard() -> ! {
    let mut hoard: Vec<Box<[u8]>> = Vec::new();
    loop {
        hoard.push(core::hint::black_box(alloc::vec![1u8; 1 << 20]).into_boxed_slice());
    }
}

/// The exported engine interface (and, with the `middleware` feature, the
/// exported `incoming-handler`).
struct Misbehaving;

#[cfg(feature = "middleware")]
mod middleware {
    //! The exported `incoming-handler` of the `middleware` world.

    use idem_middleware_guest::bindings::exports::wasi::http::incoming_handler::Guest as HandlerGuest;
    use idem_middleware_guest::bindings::wasi::http::incoming_handler as inner;
    use idem_middleware_guest::bindings::wasi::http::types::{IncomingRequest, ResponseOutparam};

    use super::{ALLOCATE, LOOP, Misbehaving, hoard, spin};

    impl HandlerGuest for Misbehaving {
        fn handle(request: IncomingRequest, out: ResponseOutparam) {
            idem_middleware_guest::wrap(request, out, |ticket, request, out| {
                match ticket.key.biz_type.as_str() {
                    LOOP => spin(),
                    ALLOCATE => hoard(),
                    _ => inner::handle(request, out),
                }
            });
        }
    }
}

impl Guest for Misbehaving {
    fn begin(request: BeginRequest) -> Result<Decision, EngineError> {
        CALLS.fetch_add(1, Ordering::Relaxed);
        match request.key.biz_type.as_str() {
            LOOP => spin(),
            ALLOCATE => hoard(),
            TRAP => panic!("asked to trap"),
            TRAP_AFTER_CLAIM => {
                let decision = machine::begin(&Imports, &request)?;
                panic!(
                    "asked to trap after deciding {}",
                    matches!(decision, Decision::Execute(_))
                );
            }
            COUNT => Ok(served()),
            SLOW_HOST => {
                for _ in 0..SLOW_HOST_PAUSES {
                    Imports.pause(SLOW_HOST_PAUSE_MS);
                }
                Ok(served())
            }
            _ => Engine::begin(request),
        }
    }
    fn complete(t: Ticket, p: Policy, s: Success) -> Result<Completion, EngineError> {
        Engine::complete(t, p, s)
    }
    fn fail(t: Ticket, p: Policy, f: Failure, d: Disposition) -> Result<Completion, EngineError> {
        Engine::fail(t, p, f, d)
    }
    fn extend(t: Ticket, p: Policy) -> Result<Extension, EngineError> {
        Engine::extend(t, p)
    }
    fn reconcile(biz_type: String, p: Policy, limit: u32) -> Result<ReconcileReport, EngineError> {
        Engine::reconcile(biz_type, p, limit)
    }
    fn sweep(limit: u32) -> Result<u32, EngineError> {
        Engine::sweep(limit)
    }
    fn settle(k: RecordKey, p: Policy, r: Resolution) -> Result<Settlement, EngineError> {
        Engine::settle(k, p, r)
    }
    fn inspect(key: RecordKey) -> Result<Option<KeyStatus>, EngineError> {
        Engine::inspect(key)
    }
}

#[cfg(all(target_arch = "wasm32", not(feature = "middleware")))]
idem_guest::bindings::export!(Misbehaving with_types_in idem_guest::bindings);
#[cfg(all(target_arch = "wasm32", feature = "middleware"))]
idem_middleware_guest::bindings::export!(Misbehaving with_types_in idem_middleware_guest::bindings);
