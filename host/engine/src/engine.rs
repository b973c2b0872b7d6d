//! The engine: loads the guest component once and calls it with a store, a
//! clock and a result lookup. Every decision comes from the guest; this
//! module only carries data across the boundary.

use std::any::Any;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use wasmtime::component::{Component, Linker};

use crate::api::{
    BeginRequest, Completion, Decision, Disposition, Extension, InProgressMode, InvalidInput,
    KeyStatus, Policy, ReconcileReport, Resolution, Settlement, Ticket,
};
use crate::bindings::{self, Conv, wit_engine};
use crate::bounds::{Flavor, Guard, GuestBounds, Stopped};
use crate::clock::Clock;
use crate::embed::{self, IdemCtx, IdemCtxBuilder};
use crate::store::{Storage, StoreError};
use crate::types::{Failure, RecordKey, Status, Success};

pub use crate::bounds::{DEFAULT_GUEST_DEADLINE, DEFAULT_MEMORY_LIMIT, EPOCH_TICK, PERF_MAP_VAR};

/// The guest component built from `guest/` by `build.rs`.
pub const DEFAULT_GUEST: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/idem_guest.wasm"));

/// Errors from the engine API.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The store failed; the key is as the store left it.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A stored record is in a state the engine cannot produce.
    #[error("corrupt record: {0}")]
    Corrupt(String),
    /// The input broke a rule; nothing was written.
    #[error("invalid input: {0}")]
    Invalid(InvalidInput),
    /// `reconcile` was asked to settle records, but no result lookup is
    /// registered ([`EngineBuilder::results`]). Nothing was read or
    /// written: without a lookup it cannot tell whether an action took
    /// effect. Stuck keys can be settled one by one ([`Engine::settle`]).
    #[error(
        "no result lookup is registered, so reconcile cannot tell whether an action took effect; nothing was changed (settle stuck keys one by one instead)"
    )]
    NoLookup,
    /// The guest trapped: a bug in the component. The instance was
    /// discarded; every store write is one atomic import call, so nothing is
    /// half-written.
    #[error("the engine component trapped: {0}")]
    Trap(String),
    /// The guest computed past its deadline ([`EngineBuilder::guest_deadline`];
    /// time in host imports does not count) and was stopped. The instance
    /// was discarded; the key is as its last atomic store write left it.
    #[error(
        "the engine component ran past its deadline of {} ms and was stopped; the instance was discarded",
        limit.as_millis()
    )]
    Deadline {
        /// The deadline that was missed.
        limit: Duration,
    },
    /// The guest tried to grow its linear memory past its limit
    /// ([`EngineBuilder::memory_limit`]) and was stopped. The instance was
    /// discarded; the key is as its last atomic store write left it.
    #[error(
        "the engine component needed more than its memory limit of {limit} bytes (it asked for {requested}) and was stopped; the instance was discarded"
    )]
    MemoryLimit {
        /// The limit, in bytes.
        limit: usize,
        /// The linear memory the instance asked for in total (its memories
        /// together, the refused growth included), in bytes.
        requested: usize,
    },
    /// The component could not be loaded or does not fit idem's world.
    #[error("cannot load the engine component: {0}")]
    Load(String),
    /// A call that needs a particular storage backend (such as a business
    /// transaction, which needs the backend's own database) was made on an
    /// engine built on another; the value names the backend it needs.
    #[error("the engine's storage is not {0}, which this call needs")]
    WrongStorage(&'static str),
}

impl From<wit_engine::EngineError> for Error {
    fn from(e: wit_engine::EngineError) -> Self {
        match e {
            wit_engine::EngineError::Store(e) => Error::Store(e.conv()),
            wit_engine::EngineError::Corrupt(m) => Error::Corrupt(m),
            wit_engine::EngineError::Invalid(i) => Error::Invalid(i.conv()),
        }
    }
}

/// The engine's `results` import: does the business result exist?
///
/// Implementations MUST return an error, never `None`, when they cannot
/// tell: `None` lets the engine execute the action again.
///
/// A closure returning `Result<Option<T>, StoreError>` is a lookup for any
/// `T` that converts into a [`Success`]: a `String` is the result's
/// reference (as `Success::with_ref`), a [`Success`] may also carry the
/// response to replay.
pub trait ResultLookup: Send + Sync + 'static {
    /// The business result recorded under `key`, stored as the key's
    /// success and replayed. It follows the rules of [`Engine::complete`]'s
    /// success; one that breaks them is a failed lookup and nothing is
    /// stored from it.
    fn find_result(&self, key: &RecordKey) -> Result<Option<Success>, StoreError>;

    /// Whether a lookup waits on I/O; as [`Storage::blocks_on_io`]. The
    /// default is `true`, which is always safe.
    fn blocks_on_io(&self) -> bool {
        true
    }
}

impl<F, T> ResultLookup for F
where
    F: Fn(&RecordKey) -> Result<Option<T>, StoreError> + Send + Sync + 'static,
    T: Into<Success>,
{
    fn find_result(&self, key: &RecordKey) -> Result<Option<Success>, StoreError> {
        Ok(self(key)?.map(Into::into))
    }
}

/// The lookup used when none is registered: it cannot tell, so it says so.
pub struct NoLookup;

impl ResultLookup for NoLookup {
    fn blocks_on_io(&self) -> bool {
        false
    }

    fn find_result(&self, key: &RecordKey) -> Result<Option<Success>, StoreError> {
        Err(StoreError::Internal(format!(
            "no result lookup is registered, so the result of biz type '{}' cannot be checked",
            key.biz_type
        )))
    }
}

/// What the guest's imports reach, and the call's bounds: one per wasmtime
/// store.
pub(crate) struct HostState {
    /// The imports, linked by [`embed::add_to_linker`] as any embedder's.
    ctx: IdemCtx,
    /// The memory cap and the current call's budget of guest time.
    guard: Guard,
}

/// A compiled component, ready to instantiate.
struct Loaded {
    engine: wasmtime::Engine,
    pre: bindings::IdemPre<HostState>,
}

fn load(engine: &wasmtime::Engine, wasm: &[u8]) -> Result<bindings::IdemPre<HostState>, Error> {
    let component = Component::new(engine, wasm).map_err(|e| Error::Load(format!("{e:#}")))?;
    let mut linker = Linker::<HostState>::new(engine);
    embed::add_to_linker(&mut linker, |s| &mut s.ctx).map_err(|e| Error::Load(format!("{e:#}")))?;
    let pre = linker
        .instantiate_pre(&component)
        .map_err(|e| Error::Load(format!("{e:#}")))?;
    bindings::IdemPre::new(pre).map_err(|e| Error::Load(format!("{e:#}")))
}

fn new_wasmtime_engine() -> Result<wasmtime::Engine, Error> {
    crate::bounds::wasmtime_engine().map_err(Error::Load)
}

/// The default guest, compiled once per process and shared by every engine.
fn default_loaded() -> Result<Loaded, Error> {
    static DEFAULT: OnceLock<Result<Loaded, String>> = OnceLock::new();
    let loaded = DEFAULT.get_or_init(|| {
        let engine = new_wasmtime_engine().map_err(|e| e.to_string())?;
        let pre = load(&engine, DEFAULT_GUEST).map_err(|e| e.to_string())?;
        Ok(Loaded { engine, pre })
    });
    match loaded {
        Ok(l) => Ok(Loaded {
            engine: l.engine.clone(),
            pre: l.pre.clone(),
        }),
        Err(e) => Err(Error::Load(e.clone())),
    }
}

/// One instance of the guest with its wasmtime store.
struct Instance {
    store: wasmtime::Store<HostState>,
    idem: bindings::Idem,
    /// This instance's number in its engine, for [`Pool::claimed_on`].
    serial: u64,
}

/// How many claims the pool remembers the instance of
/// ([`Pool::claimed_on`]) before it forgets them all. An entry leaves when
/// its owner writes; only the claims of owners that never write again (a
/// client gone for good, a handler that crashed) stay, so the map
/// reaching this size means those piled up. Forgetting is always safe: it
/// costs each claim still running one read of its record when its owner
/// writes, which is what every owner's write paid before the pool
/// remembered anything. 4096 is far above the calls in flight of a busy
/// server (hundreds), and the map then holds under 100 KiB.
const CLAIMS_REMEMBERED_BY_POOL: usize = 4096;

/// The idle instances of an engine, and which instance claimed each
/// record still being run.
#[derive(Default)]
struct Pool {
    /// Idle instances, reused across calls, the most recently used last;
    /// an instance that trapped is never put back.
    idle: Vec<Instance>,
    /// Record id → serial of the instance whose call last wrote the record
    /// as its owner (`begin` that answered `execute`, `extend`). That
    /// instance's guest remembers the record it wrote, so the owner's next
    /// write (`complete`, `fail`, `extend`) run on it swaps without reading
    /// the record back first; run on any other instance, it reads. Only a
    /// preference, never a decision: the guest's swap checks the record's
    /// id and revision either way (the guest's `owned` module).
    claimed_on: std::collections::HashMap<u64, u64>,
}

impl Pool {
    /// An idle instance: the one `record` was claimed on when it is idle,
    /// else the most recently used.
    fn take(&mut self, record: Option<u64>) -> Option<Instance> {
        if let Some(serial) = record.and_then(|id| self.claimed_on.remove(&id))
            && let Some(at) = self.idle.iter().position(|i| i.serial == serial)
        {
            return Some(self.idle.remove(at));
        }
        self.idle.pop()
    }

    /// Puts `inst` back, noting that it claimed `record`.
    fn give_back(&mut self, inst: Instance, record: Option<u64>) {
        if let Some(id) = record {
            if self.claimed_on.len() >= CLAIMS_REMEMBERED_BY_POOL {
                self.claimed_on.clear();
            }
            self.claimed_on.insert(id, inst.serial);
        }
        self.idle.push(inst);
    }
}

struct Shared {
    loaded: Loaded,
    /// The imports every instance's store starts with.
    ctx: IdemCtx,
    /// The storage as given to the builder, for [`Engine::storage`].
    storage: Option<Arc<dyn Any + Send + Sync>>,
    /// Whether a result lookup was registered ([`EngineBuilder::results`]).
    has_lookup: bool,
    bounds: GuestBounds,
    /// Idle instances, and where records were claimed.
    pool: Mutex<Pool>,
    /// The number the next new instance gets.
    next_serial: std::sync::atomic::AtomicU64,
}

/// Builds an [`Engine`].
pub struct EngineBuilder {
    ctx: IdemCtxBuilder,
    storage: Option<Arc<dyn Any + Send + Sync>>,
    has_lookup: bool,
    guest: Option<Vec<u8>>,
    memory_limit: usize,
    guest_deadline: Duration,
}

impl EngineBuilder {
    /// The most linear memory one guest instance may use, in bytes;
    /// [`DEFAULT_MEMORY_LIMIT`] by default. A call that needs more is
    /// stopped: it fails with [`Error::MemoryLimit`] and its instance is
    /// discarded.
    pub fn memory_limit(mut self, bytes: usize) -> Self {
        self.memory_limit = bytes;
        self
    }

    /// The longest one call into the guest may compute, time in host
    /// imports not counted; [`DEFAULT_GUEST_DEADLINE`] by default, measured
    /// in steps of [`EPOCH_TICK`]. A call that runs longer is stopped: it
    /// fails with [`Error::Deadline`] and its instance is discarded.
    pub fn guest_deadline(mut self, deadline: Duration) -> Self {
        self.guest_deadline = deadline;
        self
    }

    /// Both bounds at once: [`GuestBounds::deadline`] as
    /// [`EngineBuilder::guest_deadline`], [`GuestBounds::memory_bytes`] as
    /// [`EngineBuilder::memory_limit`].
    pub fn bounds(self, bounds: GuestBounds) -> Self {
        self.guest_deadline(bounds.deadline)
            .memory_limit(bounds.memory_bytes)
    }

    /// The storage backend. Required.
    pub fn storage<S: Storage>(mut self, storage: S) -> Self {
        let storage = Arc::new(storage);
        self.storage = Some(storage.clone());
        self.ctx = self.ctx.storage_arc(storage);
        self
    }

    /// The clock; the system clock by default.
    pub fn clock<C: Clock>(mut self, clock: C) -> Self {
        self.ctx = self.ctx.clock(clock);
        self
    }

    /// The business-result lookup used by reconciliation. Without one,
    /// [`Engine::reconcile`] refuses to run ([`Error::NoLookup`]), and a
    /// `reconcile` policy answers that it cannot tell.
    pub fn results<R: ResultLookup>(mut self, results: R) -> Self {
        self.ctx = self.ctx.results(results);
        self.has_lookup = true;
        self
    }

    /// Runs this component instead of the embedded default guest.
    pub fn guest_bytes(mut self, wasm: impl Into<Vec<u8>>) -> Self {
        self.guest = Some(wasm.into());
        self
    }

    /// Runs the component in this `.wasm` file instead of the default guest.
    pub fn guest_file(self, path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let wasm = std::fs::read(path)
            .map_err(|e| Error::Load(format!("cannot read {}: {e}", path.display())))?;
        Ok(self.guest_bytes(wasm))
    }

    /// Compiles (or reuses) the component and checks that it fits idem's
    /// world: a missing or mismatched import or export fails here.
    pub fn build(self) -> Result<Engine, Error> {
        let ctx = self
            .ctx
            .build()
            .map_err(|_| Error::Load("no storage was given to the engine builder".into()))?;
        let loaded = match self.guest {
            None => default_loaded()?,
            Some(wasm) => {
                let engine = new_wasmtime_engine()?;
                let pre = load(&engine, &wasm)?;
                Loaded { engine, pre }
            }
        };
        Ok(Engine {
            shared: Arc::new(Shared {
                loaded,
                storage: self.storage,
                has_lookup: self.has_lookup,
                ctx,
                bounds: GuestBounds {
                    deadline: self.guest_deadline,
                    memory_bytes: self.memory_limit,
                },
                pool: Mutex::new(Pool::default()),
                next_serial: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }
}

/// What a failed call into the guest means: a missed deadline, the memory
/// limit, or any other trap.
fn guest_error(e: &wasmtime::Error, context: &str) -> Error {
    match crate::bounds::stopped(e) {
        Some(Stopped::Deadline(limit)) => Error::Deadline { limit },
        Some(Stopped::Memory { limit, requested }) => Error::MemoryLimit { limit, requested },
        None => Error::Trap(format!("{context}{e:#}")),
    }
}

/// How a business action ended, for [`Engine::run`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActionResult {
    /// The action succeeded.
    Succeeded(Success),
    /// The action failed, with what that means for the key.
    Failed(Failure, Disposition),
}

impl ActionResult {
    /// A failure that took no effect, so the next request may execute
    /// again: typically a business transaction that rolled back.
    pub fn retryable(code: impl Into<String>, message: impl std::fmt::Display) -> Self {
        ActionResult::Failed(
            Failure {
                code: code.into(),
                message: message.to_string(),
                response: None,
            },
            Disposition::Retryable,
        )
    }
}

/// What [`Engine::run`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    /// The action ran once and its outcome is stored.
    Executed {
        /// The ownership the action ran under.
        ticket: Ticket,
        /// What the action reported.
        result: ActionResult,
        /// The status its outcome left the key in, as the engine stored it
        /// under the policy: a retryable failure can be stored as failed
        /// (`failure_mode`, `max_attempts`). A caller that retries goes by
        /// this, not by `result`'s disposition.
        stored: Status,
    },
    /// The action ran, but a newer owner took the key over before the
    /// outcome could be stored; the outcome was discarded (and, inside a
    /// business transaction, rolled back).
    LostOwnership {
        /// The ownership the action ran under.
        ticket: Ticket,
    },
    /// The action did not run; the decision says why.
    NotExecuted(Decision),
}

impl RunOutcome {
    /// What an executed action came to, once `complete` or `fail` answered
    /// `completion` for its `result`.
    pub fn settled(ticket: Ticket, result: ActionResult, completion: Completion) -> Self {
        match completion {
            Completion::Recorded(stored) => RunOutcome::Executed {
                ticket,
                result,
                stored,
            },
            Completion::LostOwnership => RunOutcome::LostOwnership { ticket },
        }
    }
}

/// The idempotency engine. Cheap to clone and safe to share across threads.
#[derive(Clone)]
pub struct Engine {
    shared: Arc<Shared>,
}

impl Engine {
    /// A builder with the system clock and the default guest.
    pub fn builder() -> EngineBuilder {
        EngineBuilder {
            ctx: IdemCtx::builder(),
            storage: None,
            has_lookup: false,
            guest: None,
            memory_limit: DEFAULT_MEMORY_LIMIT,
            guest_deadline: DEFAULT_GUEST_DEADLINE,
        }
    }

    /// Whether a call may wait on I/O: its store or its result lookup does
    /// ([`Storage::blocks_on_io`]). Async hosts run such calls on a
    /// blocking thread, and the others on the calling thread.
    pub fn blocks_on_io(&self) -> bool {
        let ctx = &self.shared.ctx;
        ctx.storage.blocks_on_io() || ctx.results.blocks_on_io()
    }

    /// Whether a call that writes would now wait for other callers' writes
    /// ([`Storage::write_would_wait`]). Async hosts that run calls on the
    /// calling thread (see [`Engine::blocks_on_io`]) move a call to a
    /// blocking thread while this is true.
    pub fn write_would_wait(&self) -> bool {
        self.shared.ctx.storage.write_would_wait()
    }

    /// The clock the engine reads.
    pub fn clock(&self) -> &dyn Clock {
        &*self.shared.ctx.clock
    }

    /// The names of the component's imports, as `interface#function`-free
    /// instance names (e.g. `idem:engine/store@0.4.0`).
    pub fn component_imports(&self) -> Vec<String> {
        let engine = &self.shared.loaded.engine;
        let component = self.shared.loaded.pre.instance_pre().component();
        component
            .component_type()
            .imports(engine)
            .map(|(name, _)| name.to_string())
            .collect()
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.shared
            .pool
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// An idle instance, preferring the one `record` was claimed on; a
    /// new one when none is idle.
    fn instance(&self, record: Option<u64>) -> Result<Instance, Error> {
        let idle = self.pool().take(record);
        if let Some(inst) = idle {
            return Ok(inst);
        }
        let state = HostState {
            ctx: self.shared.ctx.clone(),
            guard: Guard::new(self.shared.bounds, Flavor::Sync),
        };
        let mut store = wasmtime::Store::new(&self.shared.loaded.engine, state);
        Guard::install_counted(
            &mut store,
            |state| &mut state.guard,
            |state| state.ctx.host_time(),
        );
        let idem = self
            .shared
            .loaded
            .pre
            .instantiate(&mut store)
            .map_err(|e| guest_error(&e, "instantiation failed: "))?;
        let serial = self
            .shared
            .next_serial
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Instance {
            store,
            idem,
            serial,
        })
    }

    /// Runs one export call on an idle instance, with `storage` in place of
    /// the engine's own for this call only. Traps discard the instance.
    fn call<R>(
        &self,
        storage: Option<Arc<dyn Storage>>,
        f: impl FnOnce(
            &wit_engine::Guest,
            &mut wasmtime::Store<HostState>,
        ) -> wasmtime::Result<Result<R, wit_engine::EngineError>>,
    ) -> Result<R, Error> {
        self.owner_call(storage, None, f, |_| None)
    }

    /// [`Engine::call`] for a call that may write a record as its owner:
    /// it runs on the instance that claimed `record` when that one is idle
    /// (see [`Pool::claimed_on`]), and `claimed` names the record its
    /// answer says this instance now owns.
    fn owner_call<R>(
        &self,
        storage: Option<Arc<dyn Storage>>,
        record: Option<u64>,
        f: impl FnOnce(
            &wit_engine::Guest,
            &mut wasmtime::Store<HostState>,
        ) -> wasmtime::Result<Result<R, wit_engine::EngineError>>,
        claimed: impl FnOnce(&R) -> Option<u64>,
    ) -> Result<R, Error> {
        let mut inst = self.instance(record)?;
        if let Some(storage) = storage {
            inst.store.data_mut().ctx.storage = storage;
        }
        inst.store.data_mut().ctx.reset_host_time();
        Guard::start(&mut inst.store, |state| &mut state.guard);
        let outcome = f(inst.idem.idem_engine_engine(), &mut inst.store);
        inst.store.data_mut().ctx.storage = self.shared.ctx.storage.clone();
        match outcome {
            Ok(answer) => {
                let owns = answer.as_ref().ok().and_then(claimed);
                self.pool().give_back(inst, owns);
                answer.map_err(Error::from)
            }
            Err(trap) => Err(guest_error(&trap, "")),
        }
    }

    /// Decides what to do with a request (`engine.begin`).
    pub fn begin(&self, request: &BeginRequest) -> Result<Decision, Error> {
        self.begin_on(None, request)
    }

    fn begin_on(
        &self,
        storage: Option<Arc<dyn Storage>>,
        request: &BeginRequest,
    ) -> Result<Decision, Error> {
        let request: wit_engine::BeginRequest = request.clone().conv();
        self.owner_call(
            storage,
            None,
            |g, s| g.call_begin(s, &request),
            |decision| match decision {
                wit_engine::Decision::Execute(t) => Some(t.record_id),
                _ => None,
            },
        )
        .map(Conv::conv)
    }

    /// Stores the success of the action owned by `ticket`.
    pub fn complete(
        &self,
        ticket: &Ticket,
        policy: &Policy,
        success: &Success,
    ) -> Result<Completion, Error> {
        self.complete_on(None, ticket, policy, success)
    }

    fn complete_on(
        &self,
        storage: Option<Arc<dyn Storage>>,
        ticket: &Ticket,
        policy: &Policy,
        success: &Success,
    ) -> Result<Completion, Error> {
        let (t, p, s) = (
            ticket.clone().conv(),
            policy.clone().conv(),
            success.clone().conv(),
        );
        let record = Some(t.record_id);
        self.owner_call(
            storage,
            record,
            |g, st| g.call_complete(st, &t, &p, &s),
            |_| None,
        )
        .map(Conv::conv)
    }

    /// Stores the failure of the action owned by `ticket`.
    pub fn fail(
        &self,
        ticket: &Ticket,
        policy: &Policy,
        failure: &Failure,
        disposition: Disposition,
    ) -> Result<Completion, Error> {
        self.fail_on(None, ticket, policy, failure, disposition)
    }

    fn fail_on(
        &self,
        storage: Option<Arc<dyn Storage>>,
        ticket: &Ticket,
        policy: &Policy,
        failure: &Failure,
        disposition: Disposition,
    ) -> Result<Completion, Error> {
        let (t, p, f, d) = (
            ticket.clone().conv(),
            policy.clone().conv(),
            failure.clone().conv(),
            disposition.conv(),
        );
        let record = Some(t.record_id);
        self.owner_call(
            storage,
            record,
            |g, st| g.call_fail(st, &t, &p, &f, d),
            |_| None,
        )
        .map(Conv::conv)
    }

    /// Extends the lease of `ticket` (a heartbeat).
    pub fn extend(&self, ticket: &Ticket, policy: &Policy) -> Result<Extension, Error> {
        let (t, p) = (ticket.clone().conv(), policy.clone().conv());
        let record = Some(t.record_id);
        self.owner_call(
            None,
            record,
            |g, st| g.call_extend(st, &t, &p),
            |extension| match extension {
                wit_engine::Extension::Extended(_) => record,
                _ => None,
            },
        )
        .map(Conv::conv)
    }

    /// Whether a result lookup is registered ([`EngineBuilder::results`]).
    pub fn has_lookup(&self) -> bool {
        self.shared.has_lookup
    }

    /// Settles up to `limit` stale records of `biz_type`.
    ///
    /// # Errors
    ///
    /// [`Error::NoLookup`] when `limit` is above 0 and no result lookup is
    /// registered: nothing is read or written (a `limit` of 0 only checks
    /// the biz type and policy). Otherwise [`Error::Invalid`],
    /// [`Error::Store`], [`Error::Corrupt`].
    pub fn reconcile(
        &self,
        biz_type: &str,
        policy: &Policy,
        limit: u32,
    ) -> Result<ReconcileReport, Error> {
        // Without a lookup, every record would be taken over (fencing off
        // an owner that may still complete) only to be put back.
        if limit > 0 && !self.shared.has_lookup {
            return Err(Error::NoLookup);
        }
        let p = policy.clone().conv();
        self.call(None, |g, st| g.call_reconcile(st, biz_type, &p, limit))
            .map(Conv::conv)
    }

    /// Deletes up to `limit` settled records past retention.
    pub fn sweep(&self, limit: u32) -> Result<u32, Error> {
        self.call(None, |g, st| g.call_sweep(st, limit))
    }

    /// Settles a stuck key by an operator's decision: a processing record
    /// whose lease has ended, or an outcome-unknown record. The record's
    /// fencing token moves on, so the owner that left it stuck can no
    /// longer write. A key that is not stuck is left as it is
    /// ([`Settlement::NotStuck`]).
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for a bad key, policy, success or failure
    /// (nothing written); [`Error::Store`]; [`Error::Corrupt`].
    pub fn settle(
        &self,
        key: &RecordKey,
        policy: &Policy,
        resolution: &Resolution,
    ) -> Result<Settlement, Error> {
        let (k, p, r) = (
            key.clone().conv(),
            policy.clone().conv(),
            resolution.clone().conv(),
        );
        self.call(None, |g, st| g.call_settle(st, &k, &p, &r))
            .map(Conv::conv)
    }

    /// The status of one key.
    pub fn inspect(&self, key: &RecordKey) -> Result<Option<KeyStatus>, Error> {
        let k = key.clone().conv();
        self.call(None, |g, st| g.call_inspect(st, &k))
            .map(Conv::conv)
    }

    /// Runs `action` at most once per key: begins, runs the action only on
    /// `execute`, then stores its outcome. The gap between the action and
    /// the stored outcome is covered by the lease and by reconciliation;
    /// with business data in the store's own database,
    /// [`Engine::run_with_transaction`] closes it.
    pub fn run(
        &self,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket) -> ActionResult,
    ) -> Result<RunOutcome, Error> {
        let ticket = match self.begin(request)? {
            Decision::Execute(ticket) => ticket,
            other => return Ok(RunOutcome::NotExecuted(other)),
        };
        let result = action(&ticket);
        let completion = match &result {
            ActionResult::Succeeded(success) => self.complete(&ticket, &request.policy, success)?,
            ActionResult::Failed(failure, disposition) => {
                self.fail(&ticket, &request.policy, failure, *disposition)?
            }
        };
        Ok(RunOutcome::settled(ticket, result, completion))
    }

    /// Like [`Engine::run`], for business data in the storage backend's
    /// own database: `open` starts a business transaction there, `action`
    /// writes through it, and the transition to succeeded is written
    /// through it too, so the business writes and the status commit
    /// together and "business written, status not updated" cannot happen.
    /// If ownership was lost meanwhile, the action's writes are rolled
    /// back. A failed action's writes are rolled back too, and the failure
    /// is stored as its disposition says.
    ///
    /// Backends offer this with their own connection type: the SQLite
    /// backend's `run_in_transaction` is this call with its
    /// `SqliteTransaction`.
    pub fn run_with_transaction<T: Transaction>(
        &self,
        request: &BeginRequest,
        open: impl FnOnce() -> Result<T, StoreError>,
        action: impl FnOnce(&Ticket, &T) -> Result<ActionResult, StoreError>,
    ) -> Result<RunOutcome, Error> {
        let ticket = match self.begin(request)? {
            Decision::Execute(ticket) => ticket,
            other => return Ok(RunOutcome::NotExecuted(other)),
        };
        let tx = Arc::new(open()?);
        let result = action(&ticket, &tx)?;
        let completion = match &result {
            ActionResult::Succeeded(success) => {
                let storage: Arc<dyn Storage> = tx.clone();
                let completion = self.complete_on(Some(storage), &ticket, &request.policy, success);
                let tx = Arc::into_inner(tx).ok_or_else(|| {
                    Error::Corrupt("the business transaction is still shared".into())
                })?;
                match completion {
                    Ok(recorded @ Completion::Recorded(_)) => {
                        tx.commit()?;
                        recorded
                    }
                    Ok(Completion::LostOwnership) => {
                        tx.rollback()?;
                        Completion::LostOwnership
                    }
                    Err(e) => {
                        tx.rollback()?;
                        return Err(e);
                    }
                }
            }
            ActionResult::Failed(failure, disposition) => {
                let tx = Arc::into_inner(tx).ok_or_else(|| {
                    Error::Corrupt("the business transaction is still shared".into())
                })?;
                tx.rollback()?;
                self.fail(&ticket, &request.policy, failure, *disposition)?
            }
        };
        Ok(RunOutcome::settled(ticket, result, completion))
    }

    /// Like [`Engine::run_with_transaction`], with the claim in the
    /// business transaction too: the claim, the action's writes and the
    /// stored outcome commit together, or nothing does.
    ///
    /// - **One commit** per execution instead of two.
    /// - **Nothing to wait out after a crash**: a process that dies
    ///   mid-action leaves no processing record behind (the database rolls
    ///   the transaction back), so the next delivery or retry runs at once
    ///   instead of after the lease.
    /// - **A duplicate waits instead of being told "in progress"**: its
    ///   claim waits for the transaction (the write lock in SQLite, the
    ///   key's index entry in PostgreSQL) and then replays what was
    ///   committed. So use it for short actions. The policy's
    ///   `in_progress` wait is not used: a record another caller claimed
    ///   outside a transaction is answered with
    ///   [`Decision::InProgress`] at once, because waiting would hold the
    ///   transaction open.
    /// - A failed action's writes are rolled back to a savepoint taken
    ///   after the claim, and the failure is stored in the same
    ///   transaction, as its disposition says.
    /// - A decision other than `execute` commits what `begin` wrote (a
    ///   take-over settled from the result lookup, say) and is returned
    ///   as [`RunOutcome::NotExecuted`].
    ///
    /// Backends offer this with their own connection type: the SQLite
    /// backend's `run_in_one_transaction`, say.
    ///
    /// # Errors
    ///
    /// As [`Engine::run_with_transaction`]. An error from `begin`, from the
    /// action or from storing the outcome rolls everything back, the claim
    /// included: the caller may retry.
    pub fn run_with_one_transaction<T: Transaction>(
        &self,
        request: &BeginRequest,
        open: impl FnOnce() -> Result<T, StoreError>,
        action: impl FnOnce(&Ticket, &T) -> Result<ActionResult, StoreError>,
    ) -> Result<RunOutcome, Error> {
        let mut action = Some(action);
        let mut outcomes = self.run_batch_with_one_transaction(
            std::slice::from_ref(request),
            open,
            |_, ticket, tx| match action.take() {
                Some(action) => action(ticket, tx),
                None => Err(StoreError::Internal(
                    "the action of a one-request batch was called twice".into(),
                )),
            },
            BatchErrors::AbortBatch,
        )?;
        match outcomes.pop() {
            Some(outcome) if outcomes.is_empty() => outcome,
            _ => Err(Error::Corrupt(
                "a one-request batch did not answer once".into(),
            )),
        }
    }

    /// [`Engine::run_with_one_transaction`] for several requests in one
    /// transaction: each request is claimed, its action run and its
    /// outcome stored in turn, and everything commits together, so a batch
    /// of `n` deliveries costs one commit instead of `n`. This is how a
    /// consumer keeps up with a broker that delivers faster than the store
    /// commits.
    ///
    /// - Requests run in order, on this thread. A request whose key an
    ///   earlier request of the batch settled sees that outcome (a
    ///   duplicate in the batch replays).
    /// - A failed action's writes are rolled back to a savepoint taken
    ///   after its claim, and its failure stored, as in
    ///   [`Engine::run_with_one_transaction`]. The other requests' writes
    ///   stay.
    /// - A request that ends in an error (from `begin`, its action, or
    ///   storing its outcome; a guest trap) is rolled back to a savepoint
    ///   taken before its claim, so it leaves nothing, not half a record.
    ///   With [`BatchErrors::SkipRequest`] its slot holds the error and the
    ///   batch goes on; with [`BatchErrors::AbortBatch`] the whole
    ///   transaction is rolled back and the error returned.
    /// - The transaction holds the store's write lock (SQLite) or the
    ///   batch's keys (PostgreSQL) until it ends, so a batch's actions
    ///   should be short and the batch bounded.
    ///
    /// The answer has one slot per request, in order.
    ///
    /// # Errors
    ///
    /// Opening or committing the transaction, or a transaction that can no
    /// longer be used (a savepoint that cannot be taken or returned to):
    /// nothing of the batch is kept, except that a commit that failed as
    /// [`StoreError::Unavailable`] leaves the batch unknown, as any write.
    /// The caller may retry every request: what did commit replays.
    pub fn run_batch_with_one_transaction<T: Transaction>(
        &self,
        requests: &[BeginRequest],
        open: impl FnOnce() -> Result<T, StoreError>,
        mut action: impl FnMut(usize, &Ticket, &T) -> Result<ActionResult, StoreError>,
        errors: BatchErrors,
    ) -> Result<Vec<Result<RunOutcome, Error>>, Error> {
        let tx = Arc::new(open()?);
        let storage: Arc<dyn Storage> = tx.clone();
        let mut outcomes = Vec::with_capacity(requests.len());
        // Everything that can fail before the commit: an error here rolls
        // the whole transaction back.
        let batch = (|| {
            for (index, request) in requests.iter().enumerate() {
                tx.savepoint(Savepoint::Request)?;
                let outcome = self.one_in_transaction(&*tx, &storage, request, |ticket, tx| {
                    action(index, ticket, tx)
                });
                let outcome = match (outcome, errors) {
                    (Err(e), BatchErrors::AbortBatch) => return Err(e),
                    (outcome, _) => outcome,
                };
                let keep = matches!(
                    outcome,
                    Ok(RunOutcome::Executed { .. } | RunOutcome::NotExecuted(_))
                );
                if !keep {
                    tx.rollback_to_savepoint(Savepoint::Request)?;
                }
                tx.release_savepoint(Savepoint::Request)?;
                outcomes.push(outcome);
            }
            Ok::<_, Error>(())
        })();
        drop(storage);
        let tx = Arc::into_inner(tx)
            .ok_or_else(|| Error::Corrupt("the business transaction is still shared".into()))?;
        match batch {
            Ok(()) => {
                tx.commit()?;
                Ok(outcomes)
            }
            Err(e) => {
                tx.rollback()?;
                Err(e)
            }
        }
    }

    /// One request of a one-transaction run: the claim, the action and the
    /// outcome, all written through `tx`. A lost ownership is answered as
    /// such, for the caller to roll back: nobody else can write the
    /// claimed record before the commit, so a store that says otherwise
    /// keeps nothing of it.
    fn one_in_transaction<T: Transaction>(
        &self,
        tx: &T,
        storage: &Arc<dyn Storage>,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket, &T) -> Result<ActionResult, StoreError>,
    ) -> Result<RunOutcome, Error> {
        // Waiting on a key claimed elsewhere would hold the transaction
        // open; the caller hears "in progress" at once.
        let mut request = request.clone();
        request.policy.in_progress = InProgressMode::Reject;
        let ticket = match self.begin_on(Some(storage.clone()), &request)? {
            Decision::Execute(ticket) => ticket,
            other => return Ok(RunOutcome::NotExecuted(other)),
        };
        tx.savepoint(Savepoint::Action)?;
        let result = action(&ticket, tx)?;
        let completion = match &result {
            ActionResult::Succeeded(success) => {
                self.complete_on(Some(storage.clone()), &ticket, &request.policy, success)?
            }
            ActionResult::Failed(failure, disposition) => {
                tx.rollback_to_savepoint(Savepoint::Action)?;
                self.fail_on(
                    Some(storage.clone()),
                    &ticket,
                    &request.policy,
                    failure,
                    *disposition,
                )?
            }
        };
        Ok(RunOutcome::settled(ticket, result, completion))
    }

    /// The storage backend this engine was built on, if it is an `S`: how
    /// a backend crate reaches its own store behind an engine (for its
    /// business transactions). `None` for another backend, and for an
    /// engine built on an [`IdemCtx`] whose storage is not known.
    pub fn storage<S: Storage>(&self) -> Option<&S> {
        self.shared.storage.as_deref()?.downcast_ref::<S>()
    }
}

/// A business transaction in a storage backend's own database, for
/// [`Engine::run_with_transaction`]: as a [`Storage`] it reads and writes
/// records inside the transaction, so they commit or roll back with the
/// business writes made through the same transaction.
pub trait Transaction: Storage {
    /// Commits every write made through the transaction, together.
    fn commit(self) -> Result<(), StoreError>
    where
        Self: Sized;

    /// Undoes every write made through the transaction.
    fn rollback(self) -> Result<(), StoreError>
    where
        Self: Sized;

    /// Marks a point that [`Transaction::rollback_to_savepoint`] returns
    /// to. A second mark of the same [`Savepoint`] nests inside the first.
    fn savepoint(&self, mark: Savepoint) -> Result<(), StoreError>;

    /// Undoes every write made since the latest `mark`, keeping the
    /// transaction, what was written before the mark, and the mark itself;
    /// marks taken after it are forgotten. Without such a mark it is
    /// [`StoreError::Internal`].
    fn rollback_to_savepoint(&self, mark: Savepoint) -> Result<(), StoreError>;

    /// Forgets the latest `mark` and every mark taken after it, keeping
    /// what was written. Without such a mark it is [`StoreError::Internal`].
    fn release_savepoint(&self, mark: Savepoint) -> Result<(), StoreError>;
}

/// The savepoints of a one-transaction run
/// ([`Engine::run_batch_with_one_transaction`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Savepoint {
    /// Taken before a request is claimed: a request that ends in an error
    /// is undone back to it, claim included, and the batch goes on.
    Request,
    /// Taken after a request's claim: a failed action's writes are undone
    /// back to it, and the claim kept for the failure to be stored on.
    Action,
}

/// The savepoint statements, in the SQL that SQLite and PostgreSQL both
/// accept, as fixed text so that a backend can keep them prepared.
impl Savepoint {
    /// `SAVEPOINT name`: takes the mark.
    pub fn take_sql(self) -> &'static str {
        match self {
            Savepoint::Request => "SAVEPOINT idem_request",
            Savepoint::Action => "SAVEPOINT idem_action",
        }
    }

    /// `ROLLBACK TO SAVEPOINT name`: returns to the latest mark.
    pub fn rollback_sql(self) -> &'static str {
        match self {
            Savepoint::Request => "ROLLBACK TO SAVEPOINT idem_request",
            Savepoint::Action => "ROLLBACK TO SAVEPOINT idem_action",
        }
    }

    /// `RELEASE SAVEPOINT name`: forgets the latest mark.
    pub fn release_sql(self) -> &'static str {
        match self {
            Savepoint::Request => "RELEASE SAVEPOINT idem_request",
            Savepoint::Action => "RELEASE SAVEPOINT idem_action",
        }
    }
}

/// What [`Engine::run_batch_with_one_transaction`] does with a request that
/// ends in an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchErrors {
    /// Undo that request alone, answer its slot with the error, go on.
    SkipRequest,
    /// Roll the whole transaction back and return the error.
    AbortBatch,
}

#[cfg(test)]
mod pool_tests;
