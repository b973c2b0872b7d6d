//! The thin layer between the component model and [`crate::machine`]:
//! the exports call the machine with an [`Env`] backed by the imports.

use alloc::string::String;
use alloc::vec::Vec;

use crate::bindings::exports::idem::engine::engine::{
    BeginRequest, Completion, Decision, Disposition, EngineError, Extension, Guest, KeyStatus,
    Policy, ReconcileReport, Resolution, Settlement, Ticket,
};
use crate::bindings::idem::engine::store::{InsertOutcome, StaleCursor, StoreError, SwapOutcome};
use crate::bindings::idem::engine::types::{Failure, RecordKey, StoredRecord, Success, Timestamp};
use crate::bindings::idem::engine::{clock, results, store};
use crate::machine::{self, Env};
#[cfg(target_arch = "wasm32")]
use crate::owned::OwnedRecords;

/// The records this instance wrote as an owner ([`OwnedRecords`]).
#[cfg(target_arch = "wasm32")]
struct InstanceRecords(OwnedRecords);

// SAFETY: a component instance runs on one thread: `wasm32-wasip2` code is
// built without the threads proposal, so nothing else can reach the cell,
// and the component model forbids re-entering an instance during a call,
// so no borrow is ever taken twice.
#[cfg(target_arch = "wasm32")]
unsafe impl Sync for InstanceRecords {}

#[cfg(target_arch = "wasm32")]
static OWNED: InstanceRecords = InstanceRecords(OwnedRecords::new());

/// The engine's environment inside a component: every call is an import.
/// Public for components built on this crate (the misbehaving test guest).
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
pub struct Imports;

impl Env for Imports {
    fn now(&self) -> Timestamp {
        clock::now()
    }
    fn pause(&self, duration_ms: u64) {
        clock::pause(duration_ms)
    }
    fn insert_if_absent(&self, candidate: &StoredRecord) -> Result<InsertOutcome, StoreError> {
        store::insert_if_absent(candidate)
    }
    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
        store::get(key)
    }
    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError> {
        store::compare_and_swap(expected_revision, replacement)
    }
    fn delete_expired(&self, now: Timestamp, limit: u32) -> Result<u32, StoreError> {
        store::delete_expired(now, limit)
    }
    fn list_stale(
        &self,
        biz_type: &str,
        now: Timestamp,
        after: Option<StaleCursor>,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        store::list_stale(biz_type, now, after, limit)
    }
    fn find_result(&self, key: &RecordKey) -> Result<Option<Success>, StoreError> {
        results::find_result(key)
    }
    #[cfg(target_arch = "wasm32")]
    fn owned_records(&self) -> Option<&OwnedRecords> {
        Some(&OWNED.0)
    }
}

/// The exported `engine` interface. Natively it is compiled (and linted)
/// but not exported: native symbol names cannot hold WIT's `:` and `@`.
/// Public for components built on this crate, which export the interface
/// themselves and call this one where they behave like the engine.
#[cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]
pub struct Component;

impl Guest for Component {
    fn begin(request: BeginRequest) -> Result<Decision, EngineError> {
        machine::begin(&Imports, &request)
    }
    fn complete(
        ticket: Ticket,
        policy: Policy,
        success: Success,
    ) -> Result<Completion, EngineError> {
        machine::complete(&Imports, &ticket, &policy, &success)
    }
    fn fail(
        ticket: Ticket,
        policy: Policy,
        failure: Failure,
        disposition: Disposition,
    ) -> Result<Completion, EngineError> {
        machine::fail(&Imports, &ticket, &policy, &failure, disposition)
    }
    fn extend(ticket: Ticket, policy: Policy) -> Result<Extension, EngineError> {
        machine::extend(&Imports, &ticket, &policy)
    }
    fn reconcile(
        biz_type: String,
        policy: Policy,
        limit: u32,
    ) -> Result<ReconcileReport, EngineError> {
        machine::reconcile(&Imports, &biz_type, &policy, limit)
    }
    fn sweep(limit: u32) -> Result<u32, EngineError> {
        machine::sweep(&Imports, limit)
    }
    fn settle(
        key: RecordKey,
        policy: Policy,
        resolution: Resolution,
    ) -> Result<Settlement, EngineError> {
        machine::settle_stuck(&Imports, &key, &policy, &resolution)
    }
    fn inspect(key: RecordKey) -> Result<Option<KeyStatus>, EngineError> {
        machine::inspect(&Imports, &key)
    }
}

// Off (feature `export`) when another component crate builds on this one
// and exports the engine interface itself.
#[cfg(all(target_arch = "wasm32", feature = "export"))]
crate::bindings::export!(Component with_types_in crate::bindings);
