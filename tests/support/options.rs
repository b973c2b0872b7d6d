//! The SQLite options every SQLite test opens its stores with: the
//! defaults, with group commit on when `IDEM_TEST_GROUP_COMMIT=1`, so that
//! the same concurrency, process and conformance tests check both ways of
//! committing (`IDEM_TEST_GROUP_COMMIT=1 cargo test --test concurrency`).

use idem::SqliteOptions;

/// The environment variable that turns group commit on in the tests.
pub const GROUP_COMMIT_VAR: &str = "IDEM_TEST_GROUP_COMMIT";

/// The defaults, with group commit as `IDEM_TEST_GROUP_COMMIT` says.
pub fn sqlite_options() -> SqliteOptions {
    SqliteOptions {
        group_commit: std::env::var(GROUP_COMMIT_VAR).is_ok_and(|v| v == "1"),
        ..SqliteOptions::default()
    }
}
