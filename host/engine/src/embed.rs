//! idem's imports for embedders that own their Wasmtime `Store<T>`.
//!
//! [`Engine`](crate::Engine) runs the guest in stores of its own. A host
//! that already runs components (a plugin host, a serverless runtime, a
//! proxy with its own instance pools) may instead want the idem component
//! in *its* stores, beside its other state, and call the `engine` export
//! itself. It puts an [`IdemCtx`] in its store data and calls
//! [`add_to_linker`] once:
//!
//! ```
//! use idem_engine::embed::{self, IdemCtx};
//! use idem_engine::MemoryStore;
//! use wasmtime::component::{Component, Linker};
//!
//! struct MyState {
//!     idem: IdemCtx,
//!     // ... the host's own state ...
//! }
//!
//! # fn main() -> wasmtime::Result<()> {
//! let engine = wasmtime::Engine::default();
//! let mut linker = Linker::<MyState>::new(&engine);
//! embed::add_to_linker(&mut linker, |state| &mut state.idem)?;
//! let component = Component::new(&engine, idem_engine::engine::DEFAULT_GUEST)?;
//! let pre = linker.instantiate_pre(&component)?;
//! let ctx = IdemCtx::builder().storage(MemoryStore::new()).build()?;
//! let mut store = wasmtime::Store::new(&engine, MyState { idem: ctx });
//! let _instance = pre.instantiate(&mut store)?;
//! // Call `idem:engine/engine` through bindings generated from `wit/`
//! // (`wasmtime::component::bindgen!`) or the dynamic `Func` API.
//! # Ok(()) }
//! ```
//!
//! The host functions are synchronous: each one calls the [`Storage`], the
//! [`Clock`] or the [`ResultLookup`] and returns. Store errors reach the
//! guest as its `store-error`, never as a trap, exactly as under
//! [`Engine`](crate::Engine), which links its own stores through this very
//! function.
//!
//! What stays the embedder's: the store's limits. `Engine` bounds every
//! call with an epoch deadline and a memory limiter
//! ([`GuestBounds`](crate::GuestBounds)); an embedder sets its own with
//! `Store::limiter` and `Store::set_epoch_deadline`, or its store runs the
//! guest unbounded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::component::{HasSelf, Linker};

use crate::bindings::{self, Conv, wit_store, wit_types};
use crate::clock::{Clock, SystemClock};
use crate::engine::{NoLookup, ResultLookup};
use crate::store::Storage;
use crate::types::Timestamp;

/// Why an [`IdemCtx`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CtxError {
    /// [`IdemCtxBuilder::storage`] was not called: the guest cannot run
    /// without a store.
    #[error("no storage was given to the IdemCtx builder; call IdemCtxBuilder::storage")]
    NoStorage,
}

/// What idem's imports (`store`, `clock`, `results`) reach in one Wasmtime
/// store. Cheap to clone: clones share the storage, clock and lookup.
#[derive(Clone)]
pub struct IdemCtx {
    pub(crate) storage: Arc<dyn Storage>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) results: Arc<dyn ResultLookup>,
    /// The time the host functions below spent since
    /// [`IdemCtx::reset_host_time`]: what [`Engine`](crate::Engine) leaves
    /// out of a guest's deadline, measured here rather than by a Wasmtime
    /// call hook, which would run on every crossing between host and guest
    /// (every string the host lowers into the guest is one), at about 6 %
    /// of a replay's CPU.
    host_time: Duration,
}

impl IdemCtx {
    /// A builder with the system clock and no result lookup.
    pub fn builder() -> IdemCtxBuilder {
        IdemCtxBuilder {
            storage: None,
            clock: Arc::new(SystemClock::new()),
            results: Arc::new(NoLookup),
        }
    }

    /// The time spent in this context's host functions since the last
    /// [`IdemCtx::reset_host_time`].
    pub(crate) fn host_time(&self) -> Duration {
        self.host_time
    }

    /// Starts counting the host functions' time from zero.
    pub(crate) fn reset_host_time(&mut self) {
        self.host_time = Duration::ZERO;
    }

    /// Runs one host function, adding its time to [`IdemCtx::host_time`].
    fn timed<R>(&mut self, call: impl FnOnce(&IdemCtx) -> R) -> R {
        let started = Instant::now();
        let answer = call(self);
        self.host_time += started.elapsed();
        answer
    }
}

impl std::fmt::Debug for IdemCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemCtx").finish_non_exhaustive()
    }
}

/// Builds an [`IdemCtx`].
pub struct IdemCtxBuilder {
    storage: Option<Arc<dyn Storage>>,
    clock: Arc<dyn Clock>,
    results: Arc<dyn ResultLookup>,
}

impl IdemCtxBuilder {
    /// The storage backend. Required.
    pub fn storage<S: Storage>(mut self, storage: S) -> Self {
        self.storage = Some(Arc::new(storage));
        self
    }

    /// The storage backend, already shared.
    pub(crate) fn storage_arc(mut self, storage: Arc<dyn Storage>) -> Self {
        self.storage = Some(storage);
        self
    }

    /// The clock; the system clock by default.
    pub fn clock<C: Clock>(mut self, clock: C) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The business-result lookup the guest asks during reconciliation.
    /// Without one, every lookup answers an error ("cannot tell"), never
    /// "no result".
    pub fn results<R: ResultLookup>(mut self, results: R) -> Self {
        self.results = Arc::new(results);
        self
    }

    /// The context. Errors: [`CtxError::NoStorage`] when no storage was
    /// given.
    pub fn build(self) -> Result<IdemCtx, CtxError> {
        Ok(IdemCtx {
            storage: self.storage.ok_or(CtxError::NoStorage)?,
            clock: self.clock,
            results: self.results,
            host_time: Duration::ZERO,
        })
    }
}

/// Adds idem's imports (`idem:engine/store`, `clock`, `results` and
/// `types`) to `linker`, each reaching the [`IdemCtx`] that `get` finds in
/// the store's data. Errors: Wasmtime's, when one of these imports is
/// already defined in `linker` (and shadowing is off).
pub fn add_to_linker<T: 'static>(
    linker: &mut Linker<T>,
    get: fn(&mut T) -> &mut IdemCtx,
) -> wasmtime::Result<()> {
    bindings::Idem::add_to_linker::<T, HasSelf<IdemCtx>>(linker, get)
}

impl bindings::idem::engine::types::Host for IdemCtx {}

impl wit_store::Host for IdemCtx {
    fn insert_if_absent(
        &mut self,
        candidate: wit_types::StoredRecord,
    ) -> Result<wit_store::InsertOutcome, wit_store::StoreError> {
        self.timed(|c| c.storage.insert_if_absent(&candidate.conv()).conv())
    }

    fn get(
        &mut self,
        key: wit_types::RecordKey,
    ) -> Result<Option<wit_types::StoredRecord>, wit_store::StoreError> {
        self.timed(|c| c.storage.get(&key.conv()).conv())
    }

    fn compare_and_swap(
        &mut self,
        expected_revision: u64,
        replacement: wit_types::StoredRecord,
    ) -> Result<wit_store::SwapOutcome, wit_store::StoreError> {
        self.timed(|c| {
            c.storage
                .compare_and_swap(expected_revision, &replacement.conv())
                .conv()
        })
    }

    fn delete_expired(&mut self, now: u64, limit: u32) -> Result<u32, wit_store::StoreError> {
        self.timed(|c| c.storage.delete_expired(now, limit).conv())
    }

    fn list_stale(
        &mut self,
        biz_type: String,
        now: u64,
        after: Option<wit_store::StaleCursor>,
        limit: u32,
    ) -> Result<Vec<wit_types::StoredRecord>, wit_store::StoreError> {
        self.timed(|c| {
            c.storage
                .list_stale_after(&biz_type, now, after.conv(), limit)
                .conv()
        })
    }
}

impl bindings::idem::engine::clock::Host for IdemCtx {
    fn now(&mut self) -> Timestamp {
        self.timed(|c| c.clock.now())
    }

    fn pause(&mut self, duration: u64) {
        self.timed(|c| c.clock.pause(duration))
    }
}

impl bindings::idem::engine::results::Host for IdemCtx {
    fn find_result(
        &mut self,
        key: wit_types::RecordKey,
    ) -> Result<Option<wit_types::Success>, wit_store::StoreError> {
        self.timed(|c| c.results.find_result(&key.conv()).conv())
    }
}
