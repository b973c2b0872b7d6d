//! The time the engine sees: the system clock, or a manual one for tests.

use std::path::PathBuf;
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

/// A shared clock is a clock: hosts that hand one clock to several parts
/// (the engine, the sweep, the operator endpoints) pass `Arc<dyn Clock>`.
impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }

    fn pause(&self, duration_ms: u64) {
        (**self).pause(duration_ms);
    }
}

/// The system clock shifted by the milliseconds written in a file: the
/// [`ManualClock`] of tests that drive separate processes (`idem serve`,
/// the `idem` CLI), which cannot share memory. A test moves time forward
/// for all of them at once by rewriting the file, instead of waiting a
/// lease out. Never meant for production.
///
/// The file holds one decimal number (surrounding whitespace ignored) and
/// is read again at every reading, so writers replace it atomically
/// (write a temporary file, then rename it over). A missing file reads as
/// no offset; a file that cannot be read or parsed keeps the last offset
/// read. The reading never goes backwards, whatever the file says.
#[derive(Debug, Clone)]
pub struct OffsetFileClock {
    shared: Arc<OffsetFileState>,
}

#[derive(Debug)]
struct OffsetFileState {
    path: PathBuf,
    system: SystemClock,
    offset: AtomicU64,
    last: AtomicU64,
}

impl OffsetFileClock {
    /// A clock offset by the milliseconds in `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            shared: Arc::new(OffsetFileState {
                path: path.into(),
                system: SystemClock::new(),
                offset: AtomicU64::new(0),
                last: AtomicU64::new(0),
            }),
        }
    }

    /// The offset in milliseconds, as the file says now.
    pub fn offset(&self) -> u64 {
        let s = &self.shared;
        match std::fs::read_to_string(&s.path) {
            Ok(text) => match text.trim().parse::<u64>() {
                Ok(offset) => {
                    s.offset.store(offset, Ordering::Release);
                    offset
                }
                Err(_) => s.offset.load(Ordering::Acquire),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                s.offset.store(0, Ordering::Release);
                0
            }
            Err(_) => s.offset.load(Ordering::Acquire),
        }
    }
}

impl Clock for OffsetFileClock {
    fn now(&self) -> Timestamp {
        let s = &self.shared;
        let at = s.system.now().saturating_add(self.offset());
        let prev = s.last.fetch_max(at, Ordering::AcqRel);
        prev.max(at)
    }

    fn pause(&self, duration_ms: u64) {
        self.shared.system.pause(duration_ms);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_offset_file_moves_the_clock_forward_and_never_back() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("offset");
        let clock = OffsetFileClock::new(&path);
        let system = SystemClock::new();
        // No file: no offset.
        assert_eq!(clock.offset(), 0);
        let before = system.now();
        let t0 = clock.now();
        assert!(t0 >= before && t0 <= system.now());
        // A day forward, for every reader of the file.
        std::fs::write(&path, " 86400000\n")?;
        let t1 = clock.now();
        assert!(t1 >= t0 + 86_400_000, "{t1} after {t0}");
        assert_eq!(OffsetFileClock::new(&path).offset(), 86_400_000);
        // A file that does not parse keeps the last offset.
        std::fs::write(&path, "soon")?;
        assert_eq!(clock.offset(), 86_400_000);
        assert!(clock.now() >= t1);
        // A smaller offset, or none: the reading does not go back.
        std::fs::write(&path, "5")?;
        assert!(clock.now() >= t1);
        std::fs::remove_file(&path)?;
        assert_eq!(clock.offset(), 0);
        assert!(clock.now() >= t1);
        Ok(())
    }

    #[test]
    fn a_shared_clock_reads_as_the_clock_it_shares() {
        let manual = ManualClock::new(1_000);
        let shared: Arc<dyn Clock> = Arc::new(manual.clone());
        shared.pause(250);
        assert_eq!(shared.now(), 1_250);
        assert_eq!(manual.read(), 1_250);
    }
}
