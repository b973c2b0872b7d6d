//! The bounds every idem host puts on a guest component, shared by the
//! engine ([`crate::Engine`]) and the middleware host (`idem
//! serve-component`), so that both enforce the same deadline and the same
//! memory cap, read from the same configuration keys (`guest_deadline_ms`,
//! `guest_memory_bytes`).
//!
//! - One Wasmtime configuration ([`wasmtime_engine`]): epoch interruption,
//!   with a ticker thread per Wasmtime engine that advances its epoch every
//!   [`EPOCH_TICK`].
//! - One per-store [`Guard`]: the memory limiter, and the budget of guest
//!   time of the current call. Time spent in host calls does not count: a
//!   slow store or a slow client never makes a guest miss its deadline.
//!   The engine's imports (idem's own, the only ones its guest has) count
//!   their own time ([`Guard::install_counted`]); the middleware host's
//!   guest also calls WASI and `wasi:http`, whose calls a call hook
//!   measures ([`Guard::install`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use wasmtime::{CallHook, ResourceLimiter, Store, UpdateDeadline};

/// The most linear memory one guest instance may use, all its memories
/// together: 256 MiB holds a JSON body of the largest size a policy may
/// accept (64 MiB) while it is parsed, canonicalized and hashed (measured:
/// the body, its canonical form and a buffer no larger than its largest
/// object), and stops a runaway guest long before the host feels it.
pub const DEFAULT_MEMORY_LIMIT: usize = 256 * 1024 * 1024;

/// The longest one call into the guest may compute (wall time while the
/// guest runs; time in host calls, such as the store, the clock and the
/// result lookup, does not count). A decision is a few store round trips
/// and one pass over the body: with a 1 MiB JSON body (the default
/// `max_body_bytes`) a `begin` computes about 16 ms on a quiet 2-vCPU
/// machine (about 50 ms under load), far less than this, and a looping
/// guest still frees its thread within a second. JSON bodies of tens of MiB
/// come close (32 MiB took about 0.5 s, 64 MiB about 1 s there): raise it
/// for policies that accept them.
pub const DEFAULT_GUEST_DEADLINE: Duration = Duration::from_secs(1);

/// How often the ticker thread advances a Wasmtime engine's epoch: the
/// granularity of the guest deadline. 10 ms keeps a missed deadline within
/// 1% of a 1 s budget while the thread wakes only 100 times a second.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// At most this many elements in one table: idem's components hold a
/// handful of function references in their tables, so the bound only stops
/// a hostile component from making the host allocate without end. (The
/// counts of instances, tables and memories keep Wasmtime's defaults.)
const MAX_TABLE_ELEMENTS: usize = 100_000;

/// The environment variable that, set to `1`, makes Wasmtime write a perf
/// map (`/tmp/perf-<pid>.map`) for the compiled guest, so that `perf
/// report` names the guest's own functions instead of `[JIT]` addresses.
/// Read when an engine is built; off otherwise, because the map grows with
/// every compilation.
pub const PERF_MAP_VAR: &str = "IDEM_PERF_MAP";

/// How far one guest may go: the deadline of each call and the memory cap
/// of each instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestBounds {
    /// The longest one call into the guest may compute, time in host calls
    /// not counted; measured in steps of [`EPOCH_TICK`]. A call past it is
    /// stopped and its instance discarded.
    pub deadline: Duration,
    /// The most linear memory one instance may use, in bytes, all its
    /// memories together (a composed component has one per core module). A
    /// call that grows past it is stopped and its instance discarded.
    pub memory_bytes: usize,
}

impl Default for GuestBounds {
    fn default() -> Self {
        GuestBounds {
            deadline: DEFAULT_GUEST_DEADLINE,
            memory_bytes: DEFAULT_MEMORY_LIMIT,
        }
    }
}

/// How a guest was stopped by its bounds, read back from the trap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// It computed past its deadline.
    Deadline(Duration),
    /// It asked for more memory than its cap.
    Memory {
        /// The cap, in bytes.
        limit: usize,
        /// The total the instance would have used, in bytes.
        requested: usize,
    },
}

/// The guest used up its time; raised from the epoch callback.
#[derive(Debug, thiserror::Error)]
#[error("the guest ran past its deadline of {0:?}")]
struct DeadlineExceeded(Duration);

/// The guest asked for more memory than allowed; raised from the limiter.
#[derive(Debug, thiserror::Error)]
#[error("the guest asked for {requested} bytes of memory, more than its limit of {limit}")]
struct MemoryLimitExceeded {
    limit: usize,
    requested: usize,
}

/// Whether `e`, the error of a call into a guest, is one of its bounds
/// stopping it.
pub fn stopped(e: &wasmtime::Error) -> Option<Stopped> {
    if let Some(DeadlineExceeded(limit)) = e.downcast_ref::<DeadlineExceeded>() {
        return Some(Stopped::Deadline(*limit));
    }
    e.downcast_ref::<MemoryLimitExceeded>()
        .map(|m| Stopped::Memory {
            limit: m.limit,
            requested: m.requested,
        })
}

/// How a host calls its guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// With Wasmtime's synchronous API, each call on a thread of its own
    /// (the engine).
    Sync,
    /// With Wasmtime's async API, as tasks of an async runtime (the
    /// middleware host: `wasi:http` is async). Such guests yield to the
    /// runtime at every epoch tick, so a guest that computes does not hold
    /// a runtime thread for its whole deadline.
    #[cfg(feature = "async")]
    Async,
}

/// A Wasmtime engine whose code checks an epoch deadline, with its own
/// ticker thread that advances the epoch every [`EPOCH_TICK`] for as long
/// as the engine lives, and a perf map when [`PERF_MAP_VAR`] is `1`. Both
/// flavors of host use it as it is: Wasmtime 48 supports its async API on
/// every engine once its `async` feature is on (this crate's `async`
/// feature turns it on).
///
/// # Errors
///
/// A sentence when Wasmtime refuses the configuration or the ticker thread
/// cannot start.
pub fn wasmtime_engine() -> Result<wasmtime::Engine, String> {
    let mut config = wasmtime::Config::new();
    config.epoch_interruption(true);
    if std::env::var_os(PERF_MAP_VAR).is_some_and(|v| v == "1") {
        config.profiler(wasmtime::ProfilingStrategy::PerfMap);
    }
    let engine = wasmtime::Engine::new(&config).map_err(|e| format!("{e:#}"))?;
    let weak = engine.weak();
    std::thread::Builder::new()
        .name("idem-epoch-ticker".into())
        .spawn(move || {
            loop {
                std::thread::sleep(EPOCH_TICK);
                match weak.upgrade() {
                    Some(engine) => engine.increment_epoch(),
                    None => break,
                }
            }
        })
        .map_err(|e| format!("cannot start the epoch ticker thread: {e}"))?;
    Ok(engine)
}

/// Epoch ticks that cover `d`: at least one.
fn ticks(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(EPOCH_TICK.as_nanos()))
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The bounds of one Wasmtime store: lives in the store's data, wired to
/// the store by [`Guard::install`], and reset at the start of every call by
/// [`Guard::start`].
pub struct Guard {
    bounds: GuestBounds,
    flavor: Flavor,
    /// Linear memory of the store's instances, all memories together.
    memory_used: usize,
    /// The growth the limiter last allowed, taken back if it then failed.
    last_growth: usize,
    /// When the current call started.
    started: Instant,
    /// Time the current call spent in host calls that have returned.
    in_host: Duration,
    /// When the host call under way (if any) started.
    host_since: Option<Instant>,
    /// Nanoseconds the current call spent yielded to the async runtime
    /// ([`Flavor::Async`]); written by the yield futures.
    yielded: Arc<AtomicU64>,
}

impl Guard {
    /// A guard for a store of `flavor` bounded by `bounds`.
    pub fn new(bounds: GuestBounds, flavor: Flavor) -> Self {
        Guard {
            bounds,
            flavor,
            memory_used: 0,
            last_growth: 0,
            started: Instant::now(),
            in_host: Duration::ZERO,
            host_since: None,
            yielded: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Wires the guard that `guard` finds in the store's data to `store`:
    /// the memory limiter, the epoch deadline and a call hook that measures
    /// every host call, whoever defined the import (WASI, `wasi:http`).
    pub fn install<T: Send + 'static>(store: &mut Store<T>, guard: fn(&mut T) -> &mut Guard) {
        // Nothing counted by the imports: the hook measures every host call.
        Guard::install_counted(store, guard, |_| Duration::ZERO);
        store.call_hook(move |mut ctx, hook| {
            guard(ctx.data_mut()).on_call(hook);
            Ok(())
        });
    }

    /// As [`Guard::install`], for a store whose every import measures its
    /// own time: `host_time` reads, from the store's data, the time the
    /// imports spent since the current call started (the host resets it
    /// with each [`Guard::start`]). No call hook: Wasmtime runs one on
    /// every crossing between host and guest, also for each string it
    /// lowers into the guest, where the imports know exactly when they run.
    pub fn install_counted<T: Send + 'static>(
        store: &mut Store<T>,
        guard: fn(&mut T) -> &mut Guard,
        host_time: fn(&T) -> Duration,
    ) {
        store.limiter(move |data| guard(data));
        store.epoch_deadline_callback(move |mut ctx| {
            let counted = host_time(ctx.data());
            guard(ctx.data_mut()).on_epoch(counted)
        });
        Guard::start(store, guard);
    }

    /// Starts the budget of a new call into the guest.
    pub fn start<T>(store: &mut Store<T>, guard: fn(&mut T) -> &mut Guard) {
        let g = guard(store.data_mut());
        g.started = Instant::now();
        g.in_host = Duration::ZERO;
        g.host_since = None;
        g.yielded.store(0, Ordering::Relaxed);
        let first = g.check_interval(g.bounds.deadline);
        store.set_epoch_deadline(first);
    }

    /// Ticks until the next check, with `remaining` guest time left.
    fn check_interval(&self, remaining: Duration) -> u64 {
        match self.flavor {
            Flavor::Sync => ticks(remaining),
            #[cfg(feature = "async")]
            Flavor::Async => 1,
        }
    }

    /// Guest time used by the current call so far: its wall time less the
    /// time in host calls (measured by the call hook, the one under way
    /// included, plus `counted` by the imports themselves) and yielded.
    fn used(&self, counted: Duration) -> Duration {
        let now = Instant::now();
        let until = self.host_since.unwrap_or(now);
        until
            .saturating_duration_since(self.started)
            .saturating_sub(self.in_host)
            .saturating_sub(counted)
            .saturating_sub(Duration::from_nanos(self.yielded.load(Ordering::Relaxed)))
    }

    /// Reached at the epoch deadline: stops the guest once it has used its
    /// budget, else lets it go on until the next check (yielding first, in
    /// an async store). Time in host calls passes the epoch on but is given
    /// back here: the hook's measure, and `counted` by the imports.
    fn on_epoch(&mut self, counted: Duration) -> wasmtime::Result<UpdateDeadline> {
        let used = self.used(counted);
        if used >= self.bounds.deadline {
            return Err(wasmtime::Error::new(DeadlineExceeded(self.bounds.deadline)));
        }
        let next = self.check_interval(self.bounds.deadline - used);
        Ok(match self.flavor {
            Flavor::Sync => UpdateDeadline::Continue(next),
            #[cfg(feature = "async")]
            Flavor::Async => {
                let yielded = self.yielded.clone();
                UpdateDeadline::YieldCustom(
                    next,
                    Box::pin(async move {
                        let since = Instant::now();
                        tokio::task::yield_now().await;
                        let nanos = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
                        yielded.fetch_add(nanos, Ordering::Relaxed);
                    }),
                )
            }
        })
    }

    /// Measures the time in host calls.
    fn on_call(&mut self, hook: CallHook) {
        match hook {
            CallHook::CallingHost => self.host_since = Some(Instant::now()),
            CallHook::ReturningFromHost => {
                if let Some(since) = self.host_since.take() {
                    self.in_host += since.elapsed();
                }
            }
            CallHook::CallingWasm | CallHook::ReturningFromWasm => {}
        }
    }
}

impl ResourceLimiter for Guard {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            // Past the memory's own declared maximum: `memory.grow` fails
            // as the wasm spec says.
            return Ok(false);
        }
        let growth = desired.saturating_sub(current);
        let total = self.memory_used.saturating_add(growth);
        if total > self.bounds.memory_bytes {
            // Trap at once rather than hand the guest a failed
            // `memory.grow`, which it would turn into an anonymous trap
            // anyway.
            return Err(wasmtime::Error::new(MemoryLimitExceeded {
                limit: self.bounds.memory_bytes,
                requested: total,
            }));
        }
        self.memory_used = total;
        self.last_growth = growth;
        Ok(true)
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        self.memory_used = self.memory_used.saturating_sub(self.last_growth);
        self.last_growth = 0;
        Ok(())
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS && maximum.is_none_or(|max| desired <= max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_cover_the_duration_and_are_at_least_one() {
        assert_eq!(ticks(Duration::ZERO), 1);
        assert_eq!(ticks(Duration::from_millis(1)), 1);
        assert_eq!(ticks(EPOCH_TICK), 1);
        assert_eq!(ticks(EPOCH_TICK + Duration::from_nanos(1)), 2);
        assert_eq!(ticks(Duration::from_secs(1)), 100);
    }

    #[test]
    fn the_memory_cap_counts_every_memory_of_the_store() -> wasmtime::Result<()> {
        let mut guard = Guard::new(
            GuestBounds {
                deadline: DEFAULT_GUEST_DEADLINE,
                memory_bytes: 10 << 20,
            },
            Flavor::Sync,
        );
        // Two memories of 4 MiB each fit; growing either past 10 MiB in
        // total does not.
        assert!(guard.memory_growing(0, 4 << 20, None)?);
        assert!(guard.memory_growing(0, 4 << 20, None)?);
        let e = guard
            .memory_growing(4 << 20, 7 << 20, None)
            .err()
            .and_then(|e| stopped(&e));
        assert_eq!(
            e,
            Some(Stopped::Memory {
                limit: 10 << 20,
                requested: 11 << 20
            })
        );
        // A growth that the memory itself then fails is taken back.
        assert!(guard.memory_growing(4 << 20, 6 << 20, None)?);
        guard.memory_grow_failed(wasmtime::format_err!("no address space"))?;
        assert!(guard.memory_growing(4 << 20, 6 << 20, None)?);
        // The memory's own maximum is a failed grow, not a trap.
        assert!(!guard.memory_growing(0, 2 << 20, Some(1 << 20))?);
        Ok(())
    }

    #[test]
    fn time_in_host_calls_is_not_guest_time() {
        let mut guard = Guard::new(GuestBounds::default(), Flavor::Sync);
        guard.started = Instant::now() - Duration::from_millis(500);
        guard.on_call(CallHook::CallingHost);
        // A host call under way: its time does not count either.
        guard.host_since = Some(Instant::now() - Duration::from_millis(300));
        let used = guard.used(Duration::ZERO);
        assert!(used <= Duration::from_millis(250), "{used:?}");
        assert!(used >= Duration::from_millis(150), "{used:?}");
        guard.on_call(CallHook::ReturningFromHost);
        assert!(guard.in_host >= Duration::from_millis(300));
        assert!(guard.used(Duration::ZERO) <= Duration::from_millis(250));
    }

    #[test]
    fn time_the_imports_counted_is_not_guest_time() {
        let mut guard = Guard::new(GuestBounds::default(), Flavor::Sync);
        guard.started = Instant::now() - Duration::from_millis(500);
        let used = guard.used(Duration::from_millis(300));
        assert!(used <= Duration::from_millis(250), "{used:?}");
        assert!(used >= Duration::from_millis(150), "{used:?}");
        // More counted than has passed: nothing used, never an underflow.
        assert_eq!(guard.used(Duration::from_secs(2)), Duration::ZERO);
    }
}
