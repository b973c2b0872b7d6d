//! Shared test harness: an engine on a chosen backend with a manual clock
//! and a controllable business-result lookup.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

#[path = "../support/options.rs"]
mod options;

use idem::{
    BeginRequest, Engine, ManualClock, MemoryStore, Policy, PostgresOptions, PostgresStore,
    RecordKey, SqliteStore, StoreError,
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
    Postgres(PostgresStore, PgSchema),
}

/// The variable naming the PostgreSQL server of the tests.
pub const PG_URL_VAR: &str = "IDEM_TEST_PG_URL";

/// The PostgreSQL test server's URL, or `None` after printing why the test
/// is skipped.
pub fn pg_url() -> Option<String> {
    match std::env::var(PG_URL_VAR) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            eprintln!(
                "skipped: {PG_URL_VAR} is not set, so there is no PostgreSQL server to test \
                 against (CI sets it)"
            );
            None
        }
    }
}

pub use idem_engine::testing::unique_name;

/// A PostgreSQL schema of one test's own (so that tests run in parallel on
/// one database), dropped with its tables when the test ends.
pub struct PgSchema {
    pub url: String,
    pub name: String,
}

impl PgSchema {
    /// `None` (after printing why) when no test server is configured.
    pub fn new() -> Option<PgSchema> {
        Some(PgSchema {
            url: pg_url()?,
            name: unique_name("idem_test"),
        })
    }

    /// Store options for this schema, with a small pool.
    pub fn options(&self) -> PostgresOptions {
        PostgresOptions {
            schema: self.name.clone(),
            pool_size: 2,
            ..PostgresOptions::default()
        }
    }

    /// The URL with one more query parameter, e.g. an `application_name`.
    pub fn url_with(&self, name: &str, value: &str) -> String {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{sep}{name}={value}", self.url)
    }

    /// A direct connection for the test's own SQL.
    pub fn raw(&self) -> anyhow::Result<postgres::Client> {
        Ok(postgres::Client::connect(&self.url, postgres::NoTls)?)
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        if let Ok(mut c) = postgres::Client::connect(&self.url, postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name));
        }
    }
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
        let store = SqliteStore::open(dir.path().join("idem.db"), options::sqlite_options())?;
        Self::with(Backend::Sqlite(store.clone(), dir), store)
    }

    /// An engine on PostgreSQL, in a schema of its own; `None` (after
    /// printing why) without a test server.
    pub fn postgres() -> anyhow::Result<Option<Harness>> {
        let Some(schema) = PgSchema::new() else {
            return Ok(None);
        };
        let store = PostgresStore::connect(&schema.url, schema.options())?;
        Ok(Some(Self::with(
            Backend::Postgres(store.clone(), schema),
            store,
        )?))
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
            Backend::Postgres(p, _) => builder.storage(p.clone()),
        };
        Ok(builder.build()?)
    }

    pub fn now(&self) -> u64 {
        self.clock.read()
    }

    pub fn memory_store(&self) -> Option<&MemoryStore> {
        match &self.backend {
            Backend::Memory(m) => Some(m),
            Backend::Sqlite(..) | Backend::Postgres(..) => None,
        }
    }

    pub fn storage(&self) -> &dyn idem::Storage {
        match &self.backend {
            Backend::Memory(m) => m,
            Backend::Sqlite(s, _) => s,
            Backend::Postgres(p, _) => p,
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
