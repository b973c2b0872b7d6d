//! Code shared by the examples.

use std::path::{Path, PathBuf};

/// A database file under the system temporary directory, removed (with its
/// WAL and shared-memory files) when dropped.
pub struct TempDb {
    path: PathBuf,
}

impl TempDb {
    pub fn new(name: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("idem-example-{name}-{}.db", std::process::id()));
        let db = TempDb { path };
        db.remove();
        db
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn remove(&self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut file = self.path.clone().into_os_string();
            file.push(suffix);
            // Absent files are fine: there is nothing to clean up.
            let _ = std::fs::remove_file(file);
        }
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        self.remove();
    }
}
