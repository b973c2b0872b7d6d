//! The idem middleware component: a `wasi:http` handler that wraps
//! another one so that a request with an `Idempotency-Key` runs it at most
//! once (the `middleware` world).
//!
//! Every decision is the engine's: this crate builds on `idem-guest` (the
//! engine component's crate) and calls its state machine through the same
//! imports, and it exports the same `engine` interface, delegated to the
//! engine crate's own. Every HTTP rule is `idem-http`'s, the crate that
//! `idem serve` and the tower layer use. Only [`handler`] is new code: it
//! moves values between `wasi:http` resources and those rules.
//!
//! The bindings share every type with the engine crate's: the imported
//! idem interfaces are the engine crate's modules, and the exported
//! `engine` interface's types are the engine crate's types (wit-bindgen's
//! `with`), so one state machine serves both components.
#![cfg_attr(target_arch = "wasm32", no_std)]
#![warn(missing_docs)]

extern crate alloc;

pub mod handler;

pub use handler::wrap;

pub mod bindings {
    //! Types and functions generated from `wit/` by wit-bindgen for the
    //! `middleware` world: the `idem` world plus `wasi:http`. idem's own
    //! interfaces and types are the engine crate's.
    #![allow(missing_docs)]
    wit_bindgen::generate!({
        path: "../../wit",
        world: "middleware",
        generate_all,
        pub_export_macro: true,
        additional_derives: [PartialEq, Eq],
        // Holds a resource, which has no equality.
        additional_derives_ignore: ["stream-error"],
        with: {
            "idem:engine/types@0.4.0": idem_guest::bindings::idem::engine::types,
            "idem:engine/store@0.4.0": idem_guest::bindings::idem::engine::store,
            "idem:engine/clock@0.4.0": idem_guest::bindings::idem::engine::clock,
            "idem:engine/results@0.4.0": idem_guest::bindings::idem::engine::results,
            "idem:engine/engine@0.4.0/body-kind": idem_guest::bindings::exports::idem::engine::engine::BodyKind,
            "idem:engine/engine@0.4.0/begin-request": idem_guest::bindings::exports::idem::engine::engine::BeginRequest,
            "idem:engine/engine@0.4.0/ticket": idem_guest::bindings::exports::idem::engine::engine::Ticket,
            "idem:engine/engine@0.4.0/replayed": idem_guest::bindings::exports::idem::engine::engine::Replayed,
            "idem:engine/engine@0.4.0/busy": idem_guest::bindings::exports::idem::engine::engine::Busy,
            "idem:engine/engine@0.4.0/mismatch-info": idem_guest::bindings::exports::idem::engine::engine::MismatchInfo,
            "idem:engine/engine@0.4.0/unknown-info": idem_guest::bindings::exports::idem::engine::engine::UnknownInfo,
            "idem:engine/engine@0.4.0/input-field": idem_guest::bindings::exports::idem::engine::engine::InputField,
            "idem:engine/engine@0.4.0/input-rule": idem_guest::bindings::exports::idem::engine::engine::InputRule,
            "idem:engine/engine@0.4.0/invalid-input": idem_guest::bindings::exports::idem::engine::engine::InvalidInput,
            "idem:engine/engine@0.4.0/decision": idem_guest::bindings::exports::idem::engine::engine::Decision,
            "idem:engine/engine@0.4.0/engine-error": idem_guest::bindings::exports::idem::engine::engine::EngineError,
            "idem:engine/engine@0.4.0/completion": idem_guest::bindings::exports::idem::engine::engine::Completion,
            "idem:engine/engine@0.4.0/disposition": idem_guest::bindings::exports::idem::engine::engine::Disposition,
            "idem:engine/engine@0.4.0/extension": idem_guest::bindings::exports::idem::engine::engine::Extension,
            "idem:engine/engine@0.4.0/reconcile-report": idem_guest::bindings::exports::idem::engine::engine::ReconcileReport,
            "idem:engine/engine@0.4.0/key-status": idem_guest::bindings::exports::idem::engine::engine::KeyStatus,
            "idem:engine/engine@0.4.0/resolution": idem_guest::bindings::exports::idem::engine::engine::Resolution,
            "idem:engine/engine@0.4.0/settlement": idem_guest::bindings::exports::idem::engine::engine::Settlement,
        },
    });
}

use idem_guest::bindings::exports::idem::engine::engine::{
    BeginRequest, Completion, Decision, Disposition, EngineError, Extension, Guest as EngineGuest,
    KeyStatus, Policy, ReconcileReport, Resolution, Settlement, Ticket,
};
use idem_guest::bindings::idem::engine::types::{Failure, RecordKey, Success};
use idem_guest::component::Component as Engine;

/// The middleware component: the exported `incoming-handler`
/// ([`handler`]) and the exported `engine` interface, which is the engine
/// crate's. Public for component crates that build on this one (the
/// misbehaving test guest).
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
pub struct Middleware;

impl bindings::exports::idem::engine::engine::Guest for Middleware {
    fn begin(request: BeginRequest) -> Result<Decision, EngineError> {
        <Engine as EngineGuest>::begin(request)
    }
    fn complete(t: Ticket, p: Policy, s: Success) -> Result<Completion, EngineError> {
        <Engine as EngineGuest>::complete(t, p, s)
    }
    fn fail(t: Ticket, p: Policy, f: Failure, d: Disposition) -> Result<Completion, EngineError> {
        <Engine as EngineGuest>::fail(t, p, f, d)
    }
    fn extend(t: Ticket, p: Policy) -> Result<Extension, EngineError> {
        <Engine as EngineGuest>::extend(t, p)
    }
    fn reconcile(
        biz_type: alloc::string::String,
        p: Policy,
        limit: u32,
    ) -> Result<ReconcileReport, EngineError> {
        <Engine as EngineGuest>::reconcile(biz_type, p, limit)
    }
    fn sweep(limit: u32) -> Result<u32, EngineError> {
        <Engine as EngineGuest>::sweep(limit)
    }
    fn settle(k: RecordKey, p: Policy, r: Resolution) -> Result<Settlement, EngineError> {
        <Engine as EngineGuest>::settle(k, p, r)
    }
    fn inspect(key: RecordKey) -> Result<Option<KeyStatus>, EngineError> {
        <Engine as EngineGuest>::inspect(key)
    }
}

// Off (feature `export`) when another component crate builds on this one
// and exports the interfaces itself.
#[cfg(all(target_arch = "wasm32", feature = "export"))]
bindings::export!(Middleware with_types_in bindings);
