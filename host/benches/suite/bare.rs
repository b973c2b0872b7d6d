//! The bare-SQL baseline on SQLite: the least SQL an idempotency check
//! cannot avoid, hand-written with rusqlite, no component.
//!
//! - new key: `INSERT … ON CONFLICT DO NOTHING RETURNING id` of a
//!   processing row (its own commit), then a second commit that `UPDATE`s
//!   it to succeeded: two commits, because the business action runs
//!   between them;
//! - replay and mismatch: one `SELECT` of the whole row by the unique key.
//!
//! Same database settings as the store: a file on disk, WAL,
//! `synchronous=NORMAL`, the store's own schema (created by a store), one
//! connection per thread, statements prepared once and cached.

use std::path::Path as FsPath;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use idem::{RecordKey, SqliteOptions, SqliteStore};
use rusqlite::{Connection, OptionalExtension, params};

use crate::common::Path;

/// How long a bare connection waits for the write lock: the store's
/// default, so that both sides ride out contention alike.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

const INSERT: &str = "INSERT INTO idempotency_record (scope_key, biz_type, idem_key, \
    request_hash, fingerprint_version, status, fencing_token, revision, attempts, lease_until, \
    created_at, updated_at) VALUES (?1, ?2, ?3, ?4, 1, 'processing', 1, 1, 1, ?5, ?6, ?6) \
    ON CONFLICT (scope_key, biz_type, idem_key) DO NOTHING RETURNING id";

const SETTLE: &str = "UPDATE idempotency_record SET status = 'succeeded', revision = 2, \
    lease_until = NULL, expires_at = ?2, updated_at = ?3, result_ref = ?4, \
    response = ?5 WHERE id = ?1 AND revision = 1";

const SELECT: &str = "SELECT id, scope_key, biz_type, idem_key, request_hash, \
    fingerprint_version, status, fencing_token, revision, attempts, lease_until, created_at, \
    updated_at, expires_at, result_ref, response, failure FROM idempotency_record \
    WHERE scope_key = ?1 AND biz_type = ?2 AND idem_key = ?3";

/// Creates the store's schema in a new database file, as a store would.
pub fn create(path: &FsPath) -> Result<()> {
    drop(SqliteStore::open(path, SqliteOptions::default())?);
    Ok(())
}

/// One baseline connection.
pub struct Bare {
    conn: Connection,
}

impl Bare {
    /// Opens a connection with the store's settings.
    pub fn open(path: &FsPath) -> Result<Bare> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;")?;
        Ok(Bare { conn })
    }

    /// One operation of `path` on `key`.
    pub fn op(&self, path: Path, key: &RecordKey) -> Result<()> {
        match path {
            Path::NewKey => {
                let id = self
                    .claim(key)?
                    .with_context(|| format!("new key {key:?} already stored"))?;
                self.settle(id, Some("order-1"), None)?;
            }
            Path::Replay | Path::Mismatch => {
                ensure!(self.find(key)?.is_some(), "stored key {key:?} missing");
            }
        }
        Ok(())
    }

    /// The row of `key`, when it has one, as its stored response: one
    /// `SELECT` of the whole row, every column read as the store decodes
    /// the record.
    pub fn find(&self, key: &RecordKey) -> Result<Option<Option<Vec<u8>>>> {
        let mut stmt = self.conn.prepare_cached(SELECT)?;
        let mut rows = stmt.query(params![key.scope, key.biz_type, key.idem_key])?;
        let Some(row) = rows.next()? else {
            return Ok(None);
        };
        let _: (i64, String, String, String, String) = (
            row.get(0)?,
            row.get(1)?,
            row.get(2)?,
            row.get(3)?,
            row.get(4)?,
        );
        let _: (i64, String, i64, i64, i64, Option<i64>) = (
            row.get(5)?,
            row.get(6)?,
            row.get(7)?,
            row.get(8)?,
            row.get(9)?,
            row.get(10)?,
        );
        let _: (i64, i64, Option<i64>, Option<String>) =
            (row.get(11)?, row.get(12)?, row.get(13)?, row.get(14)?);
        let (response, _failure): (Option<Vec<u8>>, Option<Vec<u8>>) = (row.get(15)?, row.get(16)?);
        Ok(Some(response))
    }

    /// Claims `key` (a processing row, its own commit): the new row's id,
    /// or `None` when the key has a row already.
    pub fn claim(&self, key: &RecordKey) -> Result<Option<i64>> {
        let now = now_ms();
        let id = self
            .conn
            .prepare_cached(INSERT)?
            .query_row(
                params![
                    key.scope,
                    key.biz_type,
                    key.idem_key,
                    FINGERPRINT,
                    now + 60_000,
                    now
                ],
                |r| r.get(0),
            )
            .optional()?;
        Ok(id)
    }

    /// Marks the claimed row `id` succeeded with `result_ref` and
    /// `response` (a second commit).
    pub fn settle(&self, id: i64, result_ref: Option<&str>, response: Option<&[u8]>) -> Result<()> {
        let now = now_ms();
        let n = self.conn.prepare_cached(SETTLE)?.execute(params![
            id,
            now + 86_400_000,
            now,
            result_ref,
            response
        ])?;
        ensure!(n == 1, "the baseline's update changed {n} rows");
        Ok(())
    }
}

/// A well-formed fingerprint for baseline rows.
const FINGERPRINT: &str = "abababababababababababababababababababababababababababababababab";

/// The wall clock in milliseconds since the epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
