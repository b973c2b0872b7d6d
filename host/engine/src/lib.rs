//! idem's engine: the idempotency decisions of the idem component, run on
//! Wasmtime.
//!
//! The decisions are made by a WebAssembly component (the guest, built from
//! `guest/` and embedded here); this crate runs it and supplies its
//! imports: storage ([`Storage`], with the in-memory [`MemoryStore`]), the
//! time ([`clock`]) and a business result lookup ([`ResultLookup`]).
//! Durable backends are crates of their own (`idem-sqlite`,
//! `idem-postgres`), so a service compiles only the database it uses; the
//! `testing` feature exports the conformance suite every backend runs
//! (`testing`).
//!
//! ```
//! use idem_engine::{BeginRequest, Decision, Engine, MemoryStore, Policy, RecordKey, Success};
//!
//! # fn main() -> Result<(), idem_engine::Error> {
//! let engine = Engine::builder().storage(MemoryStore::new()).build()?;
//! let key = RecordKey::new("user-42", "order.create", "8e03978e-40d5-43e8-bc93-6894a57f9324");
//! let request = BeginRequest::json(key, r#"{"sku":"A1","qty":2}"#, Policy::default());
//! match engine.begin(&request)? {
//!     Decision::Execute(ticket) => {
//!         // ... create the order once ...
//!         engine.complete(&ticket, &request.policy, &Success::with_ref("order-1001"))?;
//!     }
//!     Decision::Replay(stored) => println!("already done: {:?}", stored.result_ref),
//!     other => println!("not executed: {}", other.name()),
//! }
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod api;
#[doc(hidden)]
pub mod bindings;
pub mod bounds;
pub mod clock;
pub mod embed;
pub mod engine;
pub mod reconciler;
pub mod store;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod types;

pub use api::{
    BeginRequest, BodyKind, Busy, Completion, Decision, Disposition, ExpiredLease, Extension,
    FailureMode, InProgressMode, InputField, InputRule, InvalidInput, KeyCharset, KeyFormat,
    KeyStatus, MismatchInfo, Policy, ReconcileReport, Replayed, Resolution, Settlement, Ticket,
    UnknownInfo, WaitSpec,
};
pub use bounds::GuestBounds;
pub use clock::{Clock, ManualClock, OffsetFileClock, SystemClock};
pub use engine::{
    ActionResult, BatchErrors, Engine, EngineBuilder, Error, PERF_MAP_VAR, ResultLookup,
    RunOutcome, Savepoint, Transaction,
};
pub use reconciler::{ReconcileTotals, Reconciler};
pub use store::{FaultKind, MemoryStore, Storage, StoreError};
pub use types::{
    Failure, InsertOutcome, RecordKey, Status, StoredRecord, StoredResponse, Success, SwapOutcome,
    Timestamp,
};
