//! idem: an idempotency engine for APIs and message consumers.
//!
//! This crate is the one dependency most Rust services need: it gathers
//! idem's crates behind one name, and holds the `idem` CLI. Each part is a
//! crate of its own, so a service that wants less can depend on less:
//!
//! | crate | what it is | here as |
//! |---|---|---|
//! | `idem-engine` | the engine component on Wasmtime, the [`Storage`] contract, the memory store, the conformance suite (`testing`) | the crate root, [`engine`], [`store`] |
//! | `idem-sqlite` | the SQLite backend and business transactions ([`RunInTransaction`]) | [`SqliteStore`] |
//! | `idem-postgres` | the PostgreSQL backend and its business transactions | [`PostgresStore`], [`postgres`] (feature `postgres`) |
//! | `idem-layer` | the tower layer: HTTP rules, routes, problems, metrics | [`layer`] |
//! | `idem-server` | `idem serve` (the layer over a forwarding client) and `idem serve-component` | [`proxy`], [`middleware`] |
//!
//! The decisions are made by a WebAssembly component (the guest, built from
//! `guest/`), which `idem-engine` embeds and runs.
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

pub use idem_server::lookup;
#[cfg(feature = "middleware")]
pub use idem_server::middleware;
pub use idem_server::operator;
pub use idem_server::proxy;

pub use idem_engine::{
    ActionResult, BatchErrors, BeginRequest, BodyKind, Busy, Clock, Completion, Decision,
    Disposition, Engine, EngineBuilder, Error, ExpiredLease, Extension, Failure, FailureMode,
    FaultKind, GuestBounds, InProgressMode, InputField, InputRule, InsertOutcome, InvalidInput,
    KeyCharset, KeyFormat, KeyStatus, ManualClock, MemoryStore, MismatchInfo, OffsetFileClock,
    PERF_MAP_VAR, Policy, ReconcileReport, ReconcileTotals, Reconciler, RecordKey, Replayed,
    Resolution, ResultLookup, RunOutcome, Savepoint, Settlement, Status, Storage, StoreError,
    StoredRecord, StoredResponse, Success, SwapOutcome, SystemClock, Ticket, Timestamp,
    Transaction, UnknownInfo, WaitSpec,
};
pub use idem_engine::{api, bounds, clock, embed, engine, types};
/// The HTTP idempotency layer (`idem-layer`).
pub use idem_layer as layer;
#[cfg(feature = "postgres")]
pub use idem_postgres::{DEFAULT_CHECK_AFTER_IDLE, PostgresOptions, PostgresStore};
/// Business transactions on PostgreSQL: `use idem::postgres::RunInTransaction`
/// for [`Engine::run_in_transaction`](idem_postgres::RunInTransaction) on a
/// [`PostgresStore`] (the crate-level [`RunInTransaction`] is SQLite's).
#[cfg(feature = "postgres")]
pub mod postgres {
    pub use idem_postgres::{PostgresTransaction, RunInTransaction};
}
pub use idem_sqlite::{RunInTransaction, SqliteOptions, SqliteStore};

/// Storage: the contract and the memory store (`idem-engine`), and the
/// durable backends (`idem-sqlite`, `idem-postgres`).
pub mod store {
    pub use idem_engine::store::*;
    #[cfg(feature = "postgres")]
    pub use idem_postgres::{
        DEFAULT_CHECK_AFTER_IDLE, PostgresOptions, PostgresStore, PostgresTransaction,
    };
    pub use idem_sqlite::{SqliteOptions, SqliteStore, SqliteTransaction, Synchronous};
}
