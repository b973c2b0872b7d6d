//! idem: an idempotency engine for APIs and message consumers.
//!
//! The decisions are made by a WebAssembly component (the guest, built from
//! `guest/` and embedded here); this crate runs it on Wasmtime and supplies
//! its imports: storage ([`store`]), the time ([`clock`]) and a business
//! result lookup ([`ResultLookup`]).
//!
//! ```no_run
//! use idem::{BeginRequest, Decision, Engine, Policy, RecordKey, SqliteStore, Success};
//!
//! # fn main() -> anyhow::Result<()> {
//! let store = SqliteStore::open("idem.db", Default::default())?;
//! let engine = Engine::builder().storage(store).build()?;
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
mod bindings;
pub mod bounds;
pub mod clock;
pub mod embed;
pub mod engine;
pub mod layer;
#[cfg(feature = "middleware")]
pub mod middleware;
pub mod proxy;
pub mod store;
pub mod types;

pub use api::{
    BeginRequest, BodyKind, Busy, Completion, Decision, Disposition, ExpiredLease, Extension,
    FailureMode, InProgressMode, InputField, InputRule, InvalidInput, KeyCharset, KeyFormat,
    KeyStatus, MismatchInfo, Policy, ReconcileReport, Replayed, Ticket, UnknownInfo, WaitSpec,
};
pub use bounds::GuestBounds;
pub use clock::{Clock, ManualClock, SystemClock};
pub use engine::{
    ActionResult, Engine, EngineBuilder, Error, PERF_MAP_VAR, ResultLookup, RunOutcome,
};
#[cfg(feature = "postgres")]
pub use store::{DEFAULT_CHECK_AFTER_IDLE, PostgresOptions, PostgresStore};
pub use store::{FaultKind, MemoryStore, SqliteOptions, SqliteStore, Storage, StoreError};
pub use types::{
    Failure, InsertOutcome, RecordKey, Status, StoredRecord, StoredResponse, Success, SwapOutcome,
    Timestamp,
};
