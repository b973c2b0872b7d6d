//! One test's world for the `idem serve` suites: a temporary directory
//! with the database, an upstream and a proxy in front of it. Needs the
//! `serve` and `upstream` support modules beside it.

use std::path::{Path, PathBuf};

use anyhow::Result;

use crate::serve::{Proxy, Serve, TestClock};
use crate::upstream::Upstream;

/// Dropped in field order: the proxy is killed first, the directory
/// removed last.
pub struct World {
    /// The `idem serve` process.
    pub proxy: Proxy,
    /// The counting upstream behind it.
    pub up: Upstream,
    /// The proxy's SQLite database file.
    pub db: PathBuf,
    /// The time the proxy (and the test's `idem` commands that pass
    /// `clock.args()`) read.
    pub clock: TestClock,
    _dir: tempfile::TempDir,
}

impl World {
    /// Starts an upstream and a proxy with the configuration text `config`
    /// (none: the defaults).
    pub fn start(config: Option<&str>) -> Result<Self> {
        Self::start_on(|_| config.map(str::to_owned))
    }

    /// As [`World::start`], with the configuration made from the
    /// upstream's URL (for settings that name it, such as `lookup`).
    #[allow(dead_code)] // Not every suite configures a lookup.
    pub fn start_with(config: impl FnOnce(&str) -> String) -> Result<Self> {
        Self::start_on(|upstream| Some(config(upstream)))
    }

    fn start_on(config: impl FnOnce(&str) -> Option<String>) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let db = dir.path().join("idem.db");
        let up = Upstream::start()?;
        let clock = TestClock::new(dir.path())?;
        let proxy = serve(&up.url(), &db, &clock, config(&up.url()).as_deref())?;
        Ok(Self {
            proxy,
            up,
            db,
            clock,
            _dir: dir,
        })
    }

    /// Replaces the proxy with a new process on the same database.
    #[allow(dead_code)] // Not every suite restarts its proxy.
    pub fn restart(&mut self, config: Option<&str>) -> Result<()> {
        self.proxy.kill()?;
        self.proxy = serve(&self.up.url(), &self.db, &self.clock, config)?;
        Ok(())
    }
}

/// Starts `idem serve` on `db` in front of `upstream`, reading `clock`.
pub fn serve(upstream: &str, db: &Path, clock: &TestClock, config: Option<&str>) -> Result<Proxy> {
    let mut s = Serve::new(upstream, db).clock(clock);
    if let Some(c) = config {
        s = s.config(c);
    }
    s.start()
}
