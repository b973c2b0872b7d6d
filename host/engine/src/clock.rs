//! The time the engine sees: the system clock, or a manual one for tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::types::Timestamp;

/// The engine's `clock` import.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch. Never goes backwards.
    fn now(&self) -> Timestamp;
    /// Pauses the caller for about `duration_ms` (bounded waits only).
    fn pause(&self, duration_ms: u64);
}

/// The system's wall clock, made monotonic: a step backwards of the system
/// time reads as no time passing.
#[derive(Debug, Default)]
pub struct SystemClock {
    last: AtomicU64,
}

impl SystemClock {
    /// A new system clock.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(crate::api::millis)
            .unwrap_or(0);
        let prev = self.last.fetch_max(wall, Ordering::AcqRel);
        prev.max(wall)
    }

    fn pause(&self, duration_ms: u64) {
        std::thread::sleep(Duration::from_millis(duration_ms));
    }
}

/// A clock that moves only when told to: tests inject it instead of
/// sleeping. `pause` advances it by the duration asked for.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock that reads `start`.
    pub fn new(start: Timestamp) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start)),
        }
    }

    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.now.fetch_add(ms, Ordering::AcqRel);
    }

    /// Sets the clock to `at`, if that is not earlier than now.
    pub fn set(&self, at: Timestamp) {
        self.now.fetch_max(at, Ordering::AcqRel);
    }

    /// The current reading.
    pub fn read(&self) -> Timestamp {
        self.now.load(Ordering::Acquire)
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        self.read()
    }

    fn pause(&self, duration_ms: u64) {
        self.advance(duration_ms);
        std::thread::yield_now();
    }
}
