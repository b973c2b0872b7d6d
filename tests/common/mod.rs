//! Shared test harness: an engine on a chosen backend with a manual clock
//! and a controllable business-result lookup.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use idem::{
    BeginRequest, Engine, ManualClock, MemoryStore, Policy, RecordKey, SqliteOptions, SqliteStore,
    StoreError,
};

/// The start of every test's virtual time: 2026-01-01T00:00:00Z.
pub const T0: u64 = 1_767_225_600_000;

/// Business results the lookup reports, and a switch to make it fail.
#[derive(Clone, Default)]
pub struct Results {
    found: Arc<Mutex<HashMap<RecordKey, String>>>,
    failing: Arc<AtomicBool>,
}

impl Results {
    pub fn insert(&self, key: &RecordKey, result_ref: &str) {
        self.found
            .lock()
            .unwrap()
            .insert(key.clone(), result_ref.to_string());
    }

    pub fn set_failing(&self, failing: bool) {
        self.failing.store(failing, Ordering::SeqCst);
    }

    pub fn lookup(&self, key: &RecordKey) -> Result<Option<String>, StoreError> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("business database down".into()));
        }
        Ok(self.found.lock().unwrap().get(key).cloned())
    }
}

pub enum Backend {
    Memory(MemoryStore),
    Sqlite(SqliteStore, tempfile::TempDir),
}

pub struct Harness {
    pub engine: Engine,
    pub clock: ManualClock,
    pub results: Results,
    pub backend: Backend,
}

impl Harness {
    pub fn memory() -> anyhow::Result<Harness> {
        let store = MemoryStore::new();
        Self::with(Backend::Memory(store.clone()), store)
    }

    pub fn sqlite() -> anyhow::Result<Harness> {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(dir.path().join("idem.db"), SqliteOptions::default())?;
        Self::with(Backend::Sqlite(store.clone(), dir), store)
    }

    fn with(backend: Backend, storage: impl idem::Storage) -> anyhow::Result<Harness> {
        let clock = ManualClock::new(T0);
        let results = Results::default();
        let lookup = results.clone();
        let engine = Engine::builder()
            .storage(storage)
            .clock(clock.clone())
            .results(move |key: &RecordKey| lookup.lookup(key))
            .build()?;
        Ok(Harness {
            engine,
            clock,
            results,
            backend,
        })
    }

    /// Another engine on the same store, with its own clock.
    pub fn engine_with_clock(&self, clock: impl idem::Clock) -> anyhow::Result<Engine> {
        let builder = Engine::builder().clock(clock);
        let builder = match &self.backend {
            Backend::Memory(m) => builder.storage(m.clone()),
            Backend::Sqlite(s, _) => builder.storage(s.clone()),
        };
        Ok(builder.build()?)
    }

    pub fn now(&self) -> u64 {
        self.clock.read()
    }

    pub fn memory_store(&self) -> Option<&MemoryStore> {
        match &self.backend {
            Backend::Memory(m) => Some(m),
            Backend::Sqlite(..) => None,
        }
    }

    pub fn storage(&self) -> &dyn idem::Storage {
        match &self.backend {
            Backend::Memory(m) => m,
            Backend::Sqlite(s, _) => s,
        }
    }

    /// How many records the store holds, whatever their state.
    pub fn record_count(&self) -> anyhow::Result<u64> {
        Ok(self
            .storage()
            .count_by_status()?
            .into_iter()
            .map(|(_, n)| n)
            .sum())
    }
}

pub fn key(k: &str) -> RecordKey {
    RecordKey::new("tenant-1", "order.create", k)
}

pub fn policy() -> Policy {
    Policy {
        retention_ms: 3_600_000,
        lease_ms: 30_000,
        retry_after_ms: 1_000,
        ..Policy::default()
    }
}

pub fn request(k: &str, body: &str) -> BeginRequest {
    BeginRequest::json(key(k), body, policy())
}
