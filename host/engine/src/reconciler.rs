//! A background reconciler: settles stale records (expired leases,
//! outcome-unknown) through the engine's result lookup, round after round,
//! until it is stopped.

use std::num::NonZeroU32;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::api::{Policy, ReconcileReport};
use crate::engine::{Engine, Error};

/// What the reconciler did so far, summed over its rounds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReconcileTotals {
    /// Rounds finished (every biz type reconciled once).
    pub rounds: u64,
    /// Records examined.
    pub examined: u64,
    /// Records whose business result was found: now succeeded.
    pub succeeded: u64,
    /// Records released for a new attempt (not found).
    pub released: u64,
    /// Records left for an operator (not found, policy `manual`).
    pub left_for_manual: u64,
    /// Records whose lookup failed; left as they were.
    pub lookup_errors: u64,
    /// Reconcile calls that failed (the store, most likely).
    pub errors: u64,
    /// The last such failure.
    pub last_error: Option<String>,
}

impl ReconcileTotals {
    fn add(&mut self, r: &ReconcileReport) {
        self.examined += u64::from(r.examined);
        self.succeeded += u64::from(r.succeeded);
        self.released += u64::from(r.released);
        self.left_for_manual += u64::from(r.left_for_manual);
        self.lookup_errors += u64::from(r.lookup_errors);
    }
}

/// State shared with the reconciler's thread.
#[derive(Default)]
struct Control {
    stopped: Mutex<bool>,
    wake: Condvar,
    totals: Mutex<ReconcileTotals>,
}

/// A running background reconciler ([`Engine::spawn_reconciler`]). It stops
/// when [`Reconciler::stop`] is called or the handle is dropped; a round in
/// progress finishes its current batch first.
pub struct Reconciler {
    control: Arc<Control>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler")
            .field("totals", &self.totals())
            .finish_non_exhaustive()
    }
}

impl Reconciler {
    /// What it did so far.
    pub fn totals(&self) -> ReconcileTotals {
        self.control
            .totals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops it and waits for its thread; returns what it did.
    pub fn stop(mut self) -> ReconcileTotals {
        self.halt();
        self.totals()
    }

    fn halt(&mut self) {
        *self
            .control
            .stopped
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = true;
        self.control.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            // A panic in the thread is a bug; its totals say what it did.
            let _ = thread.join();
        }
    }
}

impl Drop for Reconciler {
    fn drop(&mut self) {
        self.halt();
    }
}

impl Engine {
    /// Starts a thread that reconciles every `(biz type, policy)` of `jobs`
    /// every `interval`, in batches of `batch` records until a batch comes
    /// back short: the compensation task that repairs records whose owner
    /// crashed or whose outcome is unknown, from the business result the
    /// lookup ([`EngineBuilder::results`](crate::EngineBuilder::results))
    /// finds. What each record becomes is the policy's, as in
    /// [`Engine::reconcile`].
    ///
    /// # Errors
    ///
    /// [`Error::NoLookup`] without a result lookup; [`Error::Invalid`] for
    /// a bad biz type or policy; [`Error::Load`] if the thread cannot
    /// start.
    pub fn spawn_reconciler(
        &self,
        jobs: Vec<(String, Policy)>,
        interval: Duration,
        batch: NonZeroU32,
    ) -> Result<Reconciler, Error> {
        let batch = batch.get();
        for (biz_type, policy) in &jobs {
            // Checks the biz type, the policy and the lookup; reads nothing.
            self.reconcile(biz_type, policy, 0)?;
        }
        if !self.has_lookup() {
            return Err(Error::NoLookup);
        }
        let control = Arc::new(Control::default());
        let engine = self.clone();
        let shared = control.clone();
        let thread = std::thread::Builder::new()
            .name("idem-reconciler".into())
            .spawn(move || run(&engine, &jobs, interval, batch, &shared))
            .map_err(|e| Error::Load(format!("cannot start the reconciler thread: {e}")))?;
        Ok(Reconciler {
            control,
            thread: Some(thread),
        })
    }
}

/// The reconciler's loop: a round, then a pause of `interval` (cut short
/// by a stop).
fn run(engine: &Engine, jobs: &[(String, Policy)], interval: Duration, batch: u32, c: &Control) {
    loop {
        for (biz_type, policy) in jobs {
            loop {
                if *c.stopped.lock().unwrap_or_else(PoisonError::into_inner) {
                    return;
                }
                let answer = engine.reconcile(biz_type, policy, batch);
                let mut totals = c.totals.lock().unwrap_or_else(PoisonError::into_inner);
                match answer {
                    Ok(report) => {
                        totals.add(&report);
                        // A short batch: nothing more is stale now. A batch
                        // that settled nothing (records left for an
                        // operator, failed lookups, records others changed)
                        // waits for the next round: those records stay
                        // stale, and would be examined again at once.
                        if report.examined < batch || report.succeeded + report.released == 0 {
                            break;
                        }
                    }
                    Err(e) => {
                        totals.errors += 1;
                        totals.last_error = Some(e.to_string());
                        break;
                    }
                }
            }
        }
        c.totals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .rounds += 1;
        let stopped = c.stopped.lock().unwrap_or_else(PoisonError::into_inner);
        let (stopped, _) = c
            .wake
            .wait_timeout_while(stopped, interval, |stopped| !*stopped)
            .unwrap_or_else(PoisonError::into_inner);
        if *stopped {
            return;
        }
    }
}
