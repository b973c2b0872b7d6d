//! The durable SQLite backend.
//!
//! One database file, opened in WAL mode by a small pool of connections. The
//! unique constraint on `(scope_key, biz_type, idem_key)` decides every
//! insert race, across threads and across processes that open the same file.
//!
//! Every operation is written once, as a function over a
//! [`rusqlite::Connection`]. [`SqliteStore`] runs it on a pooled connection,
//! wrapped in `BEGIN IMMEDIATE … COMMIT` where it reads and then writes;
//! [`SqliteTransaction`] runs the same function inside a transaction that the
//! caller controls, so that a business write and the record's transition
//! commit together: [`RunInTransaction::run_in_transaction`] on an
//! [`Engine`] built on a [`SqliteStore`].

#![warn(missing_docs)]

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use rusqlite::types::FromSql;
use rusqlite::{Connection, ErrorCode, OpenFlags, ToSql, TransactionBehavior};

use idem_engine::record_columns;
use idem_engine::store::StaleCursor;
use idem_engine::store::sql::{
    RecordColumns, RecordRow, TransactionSlot, column_name, cursor_values, parse_status, saturate,
    to_u64,
};
use idem_engine::types::{InsertOutcome, RecordKey, Status, StoredRecord, SwapOutcome, Timestamp};
use idem_engine::{
    ActionResult, BatchErrors, BeginRequest, Engine, Error, RunOutcome, Savepoint, Storage,
    StoreError, Ticket, Transaction,
};

/// The schema, one entry per version: the files `schema/1.sql` … `N.sql`
/// of this crate, which the Node and Python packages ship too (their SQLite
/// stores open the same files), so there is one copy of the on-disk
/// contract. Entry `i` moves the database from `user_version = i` to
/// `user_version = i + 1`. Entries are never edited once released; changes
/// are new files.
const MIGRATIONS: &[&str] = &[
    include_str!("../schema/1.sql"),
    include_str!("../schema/2.sql"),
    include_str!("../schema/3.sql"),
];

const SQL_INSERT: &str = "INSERT INTO idempotency_record (
        scope_key, biz_type, idem_key, request_hash, fingerprint_version, status,
        fencing_token, revision, attempts, lease_until, created_at, updated_at, expires_at,
        result_ref, response, failure)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)
    ON CONFLICT (scope_key, biz_type, idem_key) DO NOTHING";

const SQL_GET: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_record WHERE scope_key = ?1 AND biz_type = ?2 AND idem_key = ?3"
);

// The key columns are not written: the WHERE clause already pins them to the
// replacement's values. The id is matched too: a record deleted and created
// again starts over at revision 1, and only its new id (AUTOINCREMENT never
// reuses one) tells it from the record a stale writer read.
const SQL_SWAP: &str = "UPDATE idempotency_record SET
        request_hash = ?4, fingerprint_version = ?5, status = ?6, fencing_token = ?7,
        revision = ?8, attempts = ?9, lease_until = ?10, created_at = ?11, updated_at = ?12,
        expires_at = ?13, result_ref = ?14, response = ?15, failure = ?16
    WHERE scope_key = ?1 AND biz_type = ?2 AND idem_key = ?3 AND revision = ?17 AND id = ?18";

pub(crate) const SQL_DELETE_EXPIRED: &str = "DELETE FROM idempotency_record WHERE id IN (
        SELECT id FROM idempotency_record
        WHERE (status = 'succeeded' OR status = 'failed' OR status = 'released')
            AND expires_at <= ?1
        ORDER BY expires_at, id
        LIMIT ?2)";

pub(crate) const SQL_LIST_STALE: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_record
        WHERE biz_type = ?1 AND status = 'processing' AND lease_until <= ?2
            AND (updated_at, id) > (?4, ?5)
    UNION ALL
    SELECT ",
    record_columns!(),
    " FROM idempotency_record
        WHERE biz_type = ?1 AND status = 'outcome-unknown'
            AND (updated_at, id) > (?4, ?5)
    ORDER BY updated_at, id
    LIMIT ?3"
);

const SQL_COUNT_BY_STATUS: &str = "SELECT status, COUNT(*) FROM idempotency_record GROUP BY status";

/// The shortest wait for a pooled connection, whatever the busy timeout:
/// opening a connection (or replacing a discarded one) takes a few
/// milliseconds, and r2d2 refuses a zero timeout.
const MIN_POOL_WAIT: Duration = Duration::from_millis(250);

/// How hard SQLite works to make a commit durable (`PRAGMA synchronous`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// `synchronous = NORMAL`: in WAL mode a commit survives a crash of the
    /// process but the last commits may be lost on power failure or an
    /// operating-system crash. The database is never corrupted.
    #[default]
    Normal,
    /// `synchronous = FULL`: every commit is flushed to stable storage
    /// before it returns; it survives power failure too. Slower.
    Full,
}

impl Synchronous {
    fn pragma(self) -> &'static str {
        match self {
            Synchronous::Normal => "PRAGMA synchronous = NORMAL",
            Synchronous::Full => "PRAGMA synchronous = FULL",
        }
    }
}

/// Settings for [`SqliteStore::open`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqliteOptions {
    /// How many connections the pool keeps open. Default 8: SQLite has a
    /// single writer, so more connections only help concurrent readers,
    /// and 8 covers the reads of a typical thread pool without holding
    /// many file descriptors. Must be at least 1.
    pub pool_size: u32,
    /// How long a statement waits for another connection's write lock
    /// before it fails with [`StoreError::Unavailable`]; also how long an
    /// operation waits for a free pooled connection (at least 250 ms, time
    /// enough to open a replacement connection), and how long a write
    /// waits for its turn among this store's writers. Default 5 s: long
    /// enough to ride out a burst of writers or a checkpoint, short enough
    /// that a wedged writer surfaces as an error instead of a hang. Must be
    /// below 2^31 milliseconds (about 24 days).
    pub busy_timeout: Duration,
    /// The durability of each commit. Default [`Synchronous::Normal`]: in
    /// WAL mode it never corrupts the database and costs no fsync per
    /// commit; choose [`Synchronous::Full`] when losing the last commits on
    /// power failure is not acceptable (for example when the business
    /// effect lives outside this database and cannot be rolled back with
    /// it).
    pub synchronous: Synchronous,
    /// Group commit: claims and completions (`insert_if_absent` and
    /// `compare_and_swap`) that wait at the same moment share one
    /// transaction, written by whichever caller leads, and each caller is
    /// answered only after that transaction commits. A failure anywhere in
    /// the transaction fails every write in it with
    /// [`StoreError::Unavailable`] (nothing of it is stored). Reads are not
    /// grouped. Default off: it pays under concurrent writers with a core
    /// to spare (the suite measured 2.2x new-key throughput at 32 callers
    /// with `synchronous=NORMAL`, 8.7x with [`Synchronous::Full`]), but on
    /// a saturated machine the hand-off to the leader can cost more than a
    /// commit without fsync (see the README's Performance section).
    pub group_commit: bool,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        Self {
            pool_size: 8,
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::Normal,
            group_commit: false,
        }
    }
}

impl SqliteOptions {
    fn validate(&self) -> Result<(), StoreError> {
        if self.pool_size == 0 {
            return Err(StoreError::Rejected(
                "SqliteOptions::pool_size must be at least 1".to_owned(),
            ));
        }
        if i32::try_from(self.busy_timeout.as_millis()).is_err() {
            return Err(StoreError::Rejected(format!(
                "SqliteOptions::busy_timeout of {:?} is longer than SQLite accepts ({} ms)",
                self.busy_timeout,
                i32::MAX
            )));
        }
        Ok(())
    }
}

/// Maps a SQLite error onto the store contract.
///
/// Lock contention (`SQLITE_BUSY`, `SQLITE_LOCKED`, `SQLITE_PROTOCOL`), I/O
/// failures, a full disk and files that cannot be opened are
/// [`StoreError::Unavailable`]: the store may answer later, and whether a
/// write took effect is unknown. Constraint violations and values that are too
/// big are [`StoreError::Rejected`]. Everything else is
/// [`StoreError::Internal`].
///
/// Business code running inside [`SqliteTransaction::with_connection`] can
/// use it to report its own errors in the same terms.
pub fn map_err(e: rusqlite::Error) -> StoreError {
    let code = match &e {
        rusqlite::Error::SqliteFailure(err, _) => Some(err.code),
        rusqlite::Error::SqlInputError { error, .. } => Some(error.code),
        _ => None,
    };
    match code {
        Some(
            ErrorCode::DatabaseBusy
            | ErrorCode::DatabaseLocked
            | ErrorCode::FileLockingProtocolFailed
            | ErrorCode::SystemIoFailure
            | ErrorCode::DiskFull
            | ErrorCode::CannotOpen,
        ) => StoreError::Unavailable(format!("sqlite: {e}")),
        Some(ErrorCode::ConstraintViolation | ErrorCode::TooBig) => {
            StoreError::Rejected(format!("sqlite: {e}"))
        }
        _ => StoreError::Internal(format!("sqlite: {e}")),
    }
}

/// Maps a pool error: r2d2 reports only that no connection became free (or
/// could be opened) in time.
fn map_pool_err(e: r2d2::Error) -> StoreError {
    StoreError::Unavailable(format!("sqlite connection pool: {e}"))
}

/// Opens connections to one database file with the store's pragmas.
#[derive(Debug)]
struct ConnectionManager {
    path: PathBuf,
    busy_timeout: Duration,
    synchronous: Synchronous,
}

impl ConnectionManager {
    fn open(&self) -> rusqlite::Result<Connection> {
        // No SQLITE_OPEN_URI: a path is always a file name, never a URI.
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(&self.path, flags)?;
        // The busy timeout first, so that the pragmas below wait for locks
        // held by other connections instead of failing.
        conn.busy_timeout(self.busy_timeout)?;
        let mode = self.enable_wal(&conn)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(rusqlite::Error::SqliteFailure(
                rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_MISUSE),
                Some(format!(
                    "journal_mode=WAL was not accepted (the database stays in {mode} mode); \
                     the store needs a database file on a local file system"
                )),
            ));
        }
        conn.execute_batch(self.synchronous.pragma())?;
        conn.execute_batch("PRAGMA foreign_keys = ON")?;
        Ok(conn)
    }
}

impl ConnectionManager {
    /// Switches the database to WAL mode and returns the resulting mode.
    ///
    /// The switch needs an exclusive lock, and SQLite reports `SQLITE_BUSY`
    /// at once, without waiting in the busy handler, while another
    /// connection holds the file open in a shared state. That happens when
    /// several processes open a fresh file together, so retry until the
    /// busy timeout has passed. Once the file is in WAL mode (the mode is
    /// persistent) the pragma needs no lock and succeeds at once.
    fn enable_wal(&self, conn: &Connection) -> rusqlite::Result<String> {
        let deadline = Instant::now() + self.busy_timeout;
        let mut pause = Duration::from_millis(1);
        loop {
            match conn.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0)) {
                Err(e)
                    if e.sqlite_error_code() == Some(ErrorCode::DatabaseBusy)
                        && Instant::now() < deadline =>
                {
                    thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                other => return other,
            }
        }
    }
}

impl r2d2::ManageConnection for ConnectionManager {
    type Connection = Connection;
    type Error = rusqlite::Error;

    fn connect(&self) -> Result<Connection, rusqlite::Error> {
        self.open()
    }

    fn is_valid(&self, conn: &mut Connection) -> Result<(), rusqlite::Error> {
        conn.query_row("SELECT 1", [], |_| Ok(()))
    }

    /// A connection comes back clean: if a transaction is still open (a
    /// rollback failed, or a caller left one behind), roll it back here; a
    /// connection that still cannot leave its transaction is discarded.
    fn has_broken(&self, conn: &mut Connection) -> bool {
        if !conn.is_autocommit()
            && let Err(e) = conn.execute_batch("ROLLBACK")
        {
            tracing::warn!(error = %e, "rollback of a returned SQLite connection failed");
        }
        !conn.is_autocommit()
    }
}

/// Turns for one store's write transactions: one writer at a time, the
/// others asleep until it is done (no spinning, no yielding: on a busy
/// machine those cost more CPU time than the write they wait for).
#[derive(Default)]
struct Turns {
    state: Mutex<TurnState>,
    free: std::sync::Condvar,
}

/// Who holds the turn, and who waits for it.
#[derive(Default)]
struct TurnState {
    busy: bool,
    /// Writers asleep on [`Turns::free`]. A turn handed back with nobody
    /// waiting wakes nobody: `Condvar::notify_one` makes a system call
    /// whether or not a thread waits, twice per claimed key.
    waiting: usize,
}

impl Turns {
    /// Waits at most `timeout` for the turn; `None` when it did not come.
    fn take(self: &Arc<Self>, timeout: Duration) -> Option<Turn> {
        let deadline = Instant::now() + timeout;
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while state.busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            state.waiting += 1;
            state = self
                .free
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
            state.waiting -= 1;
        }
        state.busy = true;
        Some(Turn(self.clone()))
    }
}

/// A writer's turn; the next writer's when dropped.
struct Turn(Arc<Turns>);

impl Drop for Turn {
    fn drop(&mut self) {
        let mut state = self.0.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.busy = false;
        let wake = state.waiting > 0;
        drop(state);
        if wake {
            self.0.free.notify_one();
        }
    }
}

type Pool = r2d2::Pool<ConnectionManager>;
type PooledConnection = r2d2::PooledConnection<ConnectionManager>;

struct Inner {
    pool: Pool,
    path: PathBuf,
    /// The write queue, when group commit is on.
    group: Option<GroupCommit>,
    /// The turn of this store's write transactions ([`SqliteStore::write`]).
    writers: Arc<Turns>,
    /// How long a write waits for its turn, as for SQLite's own lock.
    busy_timeout: Duration,
}

/// The durable [`Storage`] backend: one SQLite database file in WAL mode.
///
/// Cheap to clone (the pool is shared) and safe to use from many threads.
/// Several processes, or several `SqliteStore`s in one process, may open the
/// same file at once; SQLite's locking and the unique constraint keep every
/// operation atomic across all of them.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.inner.path)
            .field("pool_size", &self.inner.pool.max_size())
            .finish()
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` and brings its
    /// schema up to date.
    ///
    /// Every connection uses `journal_mode=WAL`, the configured busy timeout
    /// and `synchronous`, and `foreign_keys=ON`. Migrations run inside
    /// `BEGIN IMMEDIATE`, so processes that open a fresh file at the same
    /// time apply each one exactly once.
    ///
    /// Errors: [`StoreError::Rejected`] for invalid options,
    /// [`StoreError::Unavailable`] when the file cannot be opened or stays
    /// locked, [`StoreError::Internal`] when it is not a database this build
    /// understands (for example a newer schema version).
    pub fn open(path: impl AsRef<Path>, options: SqliteOptions) -> Result<SqliteStore, StoreError> {
        options.validate()?;
        let path = path.as_ref().to_path_buf();
        let manager = ConnectionManager {
            path: path.clone(),
            busy_timeout: options.busy_timeout,
            synchronous: options.synchronous,
        };
        // One connection outside the pool: it reports an unopenable file at
        // once (the pool would retry until its timeout) and runs migrations.
        let mut conn = manager.open().map_err(map_err)?;
        migrate(&mut conn)?;
        drop(conn);

        // Every connection is opened now and kept open (min_idle defaults to
        // max_size), so an operation waits only when all are in use.
        let pool = r2d2::Pool::builder()
            .max_size(options.pool_size)
            .connection_timeout(options.busy_timeout.max(MIN_POOL_WAIT))
            // SQLite connections do not go stale like network connections;
            // `has_broken` cleans up connections on their way back instead.
            .test_on_check_out(false)
            .build(manager)
            .map_err(map_pool_err)?;
        Ok(SqliteStore {
            inner: Arc::new(Inner {
                pool,
                path,
                group: options.group_commit.then(GroupCommit::default),
                writers: Arc::default(),
                busy_timeout: options.busy_timeout,
            }),
        })
    }

    /// The path the store was opened with.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Runs `PRAGMA integrity_check`; true when SQLite reports `ok`.
    pub fn integrity_check(&self) -> Result<bool, StoreError> {
        let conn = self.checkout()?;
        let mut stmt = conn.prepare("PRAGMA integrity_check").map_err(map_err)?;
        let mut rows = stmt.query([]).map_err(map_err)?;
        let mut ok = false;
        let mut lines = 0usize;
        while let Some(row) = rows.next().map_err(map_err)? {
            let line: String = row.get(0).map_err(map_err)?;
            ok = line == "ok";
            lines += 1;
        }
        Ok(ok && lines == 1)
    }

    /// Starts a write transaction (`BEGIN IMMEDIATE`) on a pooled connection.
    ///
    /// The returned [`SqliteTransaction`] implements [`Storage`] inside the
    /// transaction and lets business code write through
    /// [`SqliteTransaction::with_connection`], so that both commit or roll
    /// back together. It holds SQLite's write lock until it ends: other
    /// writers, in this process or others, wait up to the busy timeout.
    ///
    /// It takes the store's write turn first, as the store's own writes do, and
    /// holds it until it ends: a write of this store made meanwhile outside
    /// the transaction waits for it, at most the busy timeout.
    pub fn begin_transaction(&self) -> Result<SqliteTransaction, StoreError> {
        let turn = self.turn()?;
        let conn = self.checkout()?;
        run_statement(&conn, SQL_BEGIN)?;
        Ok(SqliteTransaction {
            conn: TransactionSlot::new(conn),
            _turn: turn,
        })
    }

    /// This store's write turn, waiting at most the busy timeout.
    fn turn(&self) -> Result<Turn, StoreError> {
        self.inner
            .writers
            .take(self.inner.busy_timeout)
            .ok_or_else(|| {
                StoreError::Unavailable(format!(
                    "no turn to write within the busy timeout of {:?}: other writes of this \
                     process held the database",
                    self.inner.busy_timeout
                ))
            })
    }

    fn checkout(&self) -> Result<PooledConnection, StoreError> {
        self.inner.pool.get().map_err(map_pool_err)
    }

    /// Runs a single-statement operation (atomic by itself, in autocommit
    /// mode) on a pooled connection.
    fn single<R>(
        &self,
        op: impl FnOnce(&Connection) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let conn = self.checkout()?;
        op(&conn)
    }

    /// Runs an operation inside `BEGIN IMMEDIATE … COMMIT` on a pooled
    /// connection; any error rolls it back.
    ///
    /// The store's writers take turns first, on an in-process lock, waiting
    /// at most the busy timeout ([`StoreError::Unavailable`] past it). SQLite
    /// lets one writer at a time hold the database anyway; without turns,
    /// the others of this process would wait in SQLite's busy handler,
    /// which polls with sleeps growing to 100 ms, so a write that waited on
    /// another for a few microseconds was answered milliseconds later (the
    /// p99 of `idem serve`'s first requests was 30 to 90 ms at 32
    /// connections). The turn decides nothing: every write still runs in
    /// its own SQLite transaction, where the unique constraint decides, and
    /// writers in other processes still meet this one at SQLite's lock.
    fn write<R>(
        &self,
        op: impl FnOnce(&Connection) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let _turn = self.turn()?;
        let conn = self.checkout()?;
        run_statement(&conn, SQL_BEGIN)?;
        let out = op(&conn).and_then(|out| run_statement(&conn, SQL_COMMIT).map(|()| out));
        if out.is_err()
            && !conn.is_autocommit()
            && let Err(e) = conn.execute_batch("ROLLBACK")
        {
            // The pool retries the rollback, or discards the connection.
            tracing::warn!(error = %e, "rollback of a failed SQLite write failed");
        }
        out
    }
}

/// Starts a write transaction. Taking the write lock at the start means a
/// write never fails half-way on a lock another connection took after its
/// read.
const SQL_BEGIN: &str = "BEGIN IMMEDIATE";
const SQL_COMMIT: &str = "COMMIT";

/// Runs `sql`, a statement without parameters or rows, from the
/// connection's statement cache: `BEGIN` and `COMMIT` run twice for every
/// claimed key, and `execute_batch` would parse them again each time.
fn run_statement(conn: &Connection, sql: &str) -> Result<(), StoreError> {
    conn.prepare_cached(sql)
        .and_then(|mut stmt| stmt.execute([]))
        .map(drop)
        .map_err(map_err)
}

impl Storage for SqliteStore {
    fn insert_if_absent(&self, candidate: &StoredRecord) -> Result<InsertOutcome, StoreError> {
        if let Some(group) = &self.inner.group {
            // Bad values are refused here, for this caller alone.
            EncodedRecord::new(candidate)?;
            return match group.submit(self, GroupWrite::Insert(candidate.clone()))? {
                GroupDone::Insert(outcome) => Ok(outcome),
                GroupDone::Swap(_) => Err(StoreError::Internal(
                    "group commit answered an insert with a swap".to_owned(),
                )),
            };
        }
        self.write(|conn| insert_if_absent(conn, candidate))
    }

    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
        self.single(|conn| get(conn, key))
    }

    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError> {
        if let Some(group) = &self.inner.group {
            EncodedRecord::new(replacement)?;
            return match group.submit(
                self,
                GroupWrite::Swap(expected_revision, replacement.clone()),
            )? {
                GroupDone::Swap(outcome) => Ok(outcome),
                GroupDone::Insert(_) => Err(StoreError::Internal(
                    "group commit answered a swap with an insert".to_owned(),
                )),
            };
        }
        self.write(|conn| compare_and_swap(conn, expected_revision, replacement))
    }

    fn delete_expired(&self, now: Timestamp, limit: u32) -> Result<u32, StoreError> {
        self.single(|conn| delete_expired(conn, now, limit))
    }

    fn list_stale_after(
        &self,
        biz_type: &str,
        now: Timestamp,
        after: Option<StaleCursor>,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        self.single(|conn| list_stale(conn, biz_type, now, after, limit))
    }

    fn count_by_status(&self) -> Result<Vec<(Status, u64)>, StoreError> {
        self.single(count_by_status)
    }

    /// A local file: an operation takes microseconds.
    fn blocks_on_io(&self) -> bool {
        false
    }

    /// With group commit, while a group is being written.
    fn write_would_wait(&self) -> bool {
        self.inner
            .group
            .as_ref()
            .is_some_and(|group| group.leading.load(Ordering::Relaxed))
    }
}

/// A write transaction on one pooled connection, opened by
/// [`SqliteStore::begin_transaction`].
///
/// Its [`Storage`] methods run inside the transaction (no nested
/// transactions), and [`with_connection`](Self::with_connection) lets
/// business code write in it too. Nothing is visible to other connections
/// until [`commit`](Self::commit). Dropping it without committing rolls
/// back; the connection always returns to the pool outside any transaction.
pub struct SqliteTransaction {
    conn: TransactionSlot<PooledConnection>,
    /// The store's write turn, handed on after the connection is back in
    /// the pool (fields drop in order).
    _turn: Turn,
}

impl fmt::Debug for SqliteTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTransaction").finish_non_exhaustive()
    }
}

impl SqliteTransaction {
    /// Runs `f` on the transaction's connection, e.g. a business write that
    /// must commit together with the record's transition.
    ///
    /// `f` must not end the transaction itself (`COMMIT`, `ROLLBACK`).
    /// Fails with [`StoreError::Internal`], without calling `f`, when the
    /// transaction is no longer active (SQLite rolls a transaction back by
    /// itself after some errors, such as a full disk).
    pub fn with_connection<R>(&self, f: impl FnOnce(&Connection) -> R) -> Result<R, StoreError> {
        self.run(|conn| Ok(f(conn)))
    }

    /// Commits every write made in the transaction.
    ///
    /// On error nothing is committed by this call (the transaction is rolled
    /// back), except that an [`StoreError::Unavailable`] leaves it unknown,
    /// as for any write.
    pub fn commit(self) -> Result<(), StoreError> {
        let conn = self.conn.take_for_commit()?;
        if conn.is_autocommit() {
            return Err(StoreError::Internal(
                "the transaction is no longer active; nothing was committed".to_owned(),
            ));
        }
        // On failure, `conn` goes back to the pool, which rolls back what is
        // left of the transaction.
        run_statement(&conn, SQL_COMMIT)
    }

    /// Rolls back every write made in the transaction.
    pub fn rollback(self) -> Result<(), StoreError> {
        match self.conn.take_for_rollback() {
            // SQLite may have rolled it back already, after an error.
            Some(conn) if !conn.is_autocommit() => conn.execute_batch("ROLLBACK").map_err(map_err),
            _ => Ok(()),
        }
    }

    fn run<R>(
        &self,
        op: impl FnOnce(&Connection) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        self.conn.run(|conn| {
            if conn.is_autocommit() {
                return Err(StoreError::Internal(
                    "the transaction is no longer active (SQLite rolled it back after an \
                     error, or it was ended inside with_connection)"
                        .to_owned(),
                ));
            }
            op(conn)
        })
    }
}

impl Drop for SqliteTransaction {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take_for_rollback()
            && !conn.is_autocommit()
            && let Err(e) = conn.execute_batch("ROLLBACK")
        {
            // The pool retries the rollback, or discards the connection.
            tracing::warn!(error = %e, "rollback of a dropped SQLite transaction failed");
        }
    }
}

impl Transaction for SqliteTransaction {
    fn commit(self) -> Result<(), StoreError> {
        SqliteTransaction::commit(self)
    }

    fn rollback(self) -> Result<(), StoreError> {
        SqliteTransaction::rollback(self)
    }

    fn savepoint(&self, mark: Savepoint) -> Result<(), StoreError> {
        self.run(|conn| run_statement(conn, mark.take_sql()))
    }

    fn rollback_to_savepoint(&self, mark: Savepoint) -> Result<(), StoreError> {
        self.run(|conn| run_statement(conn, mark.rollback_sql()))
    }

    fn release_savepoint(&self, mark: Savepoint) -> Result<(), StoreError> {
        self.run(|conn| run_statement(conn, mark.release_sql()))
    }
}

/// Business transactions on an [`Engine`] built on a [`SqliteStore`], for
/// business data in the engine's own database.
pub trait RunInTransaction {
    /// Like [`Engine::run`], with the action's writes and the transition to
    /// succeeded in one SQLite transaction
    /// ([`Engine::run_with_transaction`]): "business written, status not
    /// updated" cannot happen. If ownership was lost meanwhile, the
    /// action's writes are rolled back. A failed action's writes are rolled
    /// back too, and the failure is stored as its disposition says.
    ///
    /// # Errors
    ///
    /// [`Error::WrongStorage`] when the engine's storage is not a
    /// [`SqliteStore`]; otherwise as [`Engine::run`].
    fn run_in_transaction(
        &self,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket, &Connection) -> ActionResult,
    ) -> Result<RunOutcome, Error>;

    /// Like [`RunInTransaction::run_in_transaction`], with the claim in
    /// the same SQLite transaction ([`Engine::run_with_one_transaction`]):
    /// one commit per execution, and a crash leaves no processing record
    /// to wait out. A duplicate waits for the transaction (up to the busy
    /// timeout) and then replays; so keep the action short, because the
    /// transaction holds the database's write lock while it runs.
    ///
    /// # Errors
    ///
    /// As [`RunInTransaction::run_in_transaction`].
    fn run_in_one_transaction(
        &self,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket, &Connection) -> ActionResult,
    ) -> Result<RunOutcome, Error>;

    /// [`RunInTransaction::run_in_one_transaction`] for a batch of
    /// requests in one transaction, one commit for all
    /// ([`Engine::run_batch_with_one_transaction`]): `action` gets each
    /// executed request's index in `requests`. A request that ends in an
    /// error is undone alone, its slot holds the error, and the others
    /// commit. Keep the batch bounded and its actions short: the
    /// transaction holds the database's write lock until it ends.
    ///
    /// # Errors
    ///
    /// [`Error::WrongStorage`] when the engine's storage is not a
    /// [`SqliteStore`]. Opening or committing the transaction, or a transaction
    /// that can no longer be used: nothing of the batch is kept.
    fn run_batch_in_one_transaction(
        &self,
        requests: &[BeginRequest],
        action: impl FnMut(usize, &Ticket, &Connection) -> ActionResult,
    ) -> Result<Vec<Result<RunOutcome, Error>>, Error>;
}

/// The engine's own store, for its business transactions.
fn own_store(engine: &Engine) -> Result<&SqliteStore, Error> {
    engine
        .storage::<SqliteStore>()
        .ok_or(Error::WrongStorage("a SqliteStore"))
}

impl RunInTransaction for Engine {
    fn run_in_transaction(
        &self,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket, &Connection) -> ActionResult,
    ) -> Result<RunOutcome, Error> {
        let store = own_store(self)?;
        self.run_with_transaction(
            request,
            || store.begin_transaction(),
            |ticket, tx| tx.with_connection(|conn| action(ticket, conn)),
        )
    }

    fn run_in_one_transaction(
        &self,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket, &Connection) -> ActionResult,
    ) -> Result<RunOutcome, Error> {
        let store = own_store(self)?;
        self.run_with_one_transaction(
            request,
            || store.begin_transaction(),
            |ticket, tx| tx.with_connection(|conn| action(ticket, conn)),
        )
    }

    fn run_batch_in_one_transaction(
        &self,
        requests: &[BeginRequest],
        mut action: impl FnMut(usize, &Ticket, &Connection) -> ActionResult,
    ) -> Result<Vec<Result<RunOutcome, Error>>, Error> {
        let store = own_store(self)?;
        self.run_batch_with_one_transaction(
            requests,
            || store.begin_transaction(),
            |index, ticket, tx| tx.with_connection(|conn| action(index, ticket, conn)),
            BatchErrors::SkipRequest,
        )
    }
}

impl Storage for SqliteTransaction {
    fn insert_if_absent(&self, candidate: &StoredRecord) -> Result<InsertOutcome, StoreError> {
        self.run(|conn| insert_if_absent(conn, candidate))
    }

    fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
        self.run(|conn| get(conn, key))
    }

    fn compare_and_swap(
        &self,
        expected_revision: u64,
        replacement: &StoredRecord,
    ) -> Result<SwapOutcome, StoreError> {
        self.run(|conn| compare_and_swap(conn, expected_revision, replacement))
    }

    fn delete_expired(&self, now: Timestamp, limit: u32) -> Result<u32, StoreError> {
        self.run(|conn| delete_expired(conn, now, limit))
    }

    fn list_stale_after(
        &self,
        biz_type: &str,
        now: Timestamp,
        after: Option<StaleCursor>,
        limit: u32,
    ) -> Result<Vec<StoredRecord>, StoreError> {
        self.run(|conn| list_stale(conn, biz_type, now, after, limit))
    }

    fn count_by_status(&self) -> Result<Vec<(Status, u64)>, StoreError> {
        self.run(count_by_status)
    }

    /// A local file: an operation takes microseconds.
    fn blocks_on_io(&self) -> bool {
        false
    }
}

// ---------------------------------------------------------------------------
// Schema migrations.

fn user_version(conn: &Connection) -> Result<usize, StoreError> {
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |row| row.get(0))
        .map_err(map_err)?;
    usize::try_from(version)
        .map_err(|_| StoreError::Internal(format!("negative schema version {version}")))
}

fn migrate(conn: &mut Connection) -> Result<(), StoreError> {
    let target = MIGRATIONS.len();
    let check = |version: usize| {
        if version > target {
            Err(StoreError::Internal(format!(
                "the database has schema version {version}; this build knows versions up to \
                 {target}"
            )))
        } else {
            Ok(version)
        }
    };
    if check(user_version(conn)?)? == target {
        return Ok(());
    }
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(map_err)?;
    // Another process may have migrated between the check and the lock.
    let current = check(user_version(&tx)?)?;
    for (index, sql) in MIGRATIONS.iter().enumerate().skip(current) {
        tx.execute_batch(sql).map_err(map_err)?;
        tx.execute_batch(&format!("PRAGMA user_version = {}", index + 1))
            .map_err(map_err)?;
    }
    tx.commit().map_err(map_err)
}

// ---------------------------------------------------------------------------
// The operations, each written once over a connection. The caller decides
// whether they run in their own transaction (SqliteStore) or in an open one
// (SqliteTransaction).

/// Inserts `candidate` unless its key is taken: the inserted record, or
/// none when the key is taken (nothing written). Run inside a transaction
/// by [`insert_if_absent`].
fn try_insert(
    conn: &Connection,
    candidate: &StoredRecord,
) -> Result<Option<StoredRecord>, StoreError> {
    let row = EncodedRecord::new(candidate)?;
    let mut stmt = conn.prepare_cached(SQL_INSERT).map_err(map_err)?;
    // Not `RETURNING id`: SQLite buffers RETURNING rows in a temporary
    // table, opened and closed for every insert. `ON CONFLICT DO NOTHING`
    // changes no row when the key is taken, and the new row's id is the
    // connection's last insert rowid otherwise.
    if stmt.execute(row.params().as_slice()).map_err(map_err)? == 0 {
        return Ok(None);
    }
    let mut inserted = candidate.clone();
    inserted.id = to_u64(conn.last_insert_rowid(), "id")?;
    Ok(Some(inserted))
}

/// The whole `insert_if_absent`; inside a transaction, the existing
/// record is read as it was when the insert was refused.
fn insert_if_absent(
    conn: &Connection,
    candidate: &StoredRecord,
) -> Result<InsertOutcome, StoreError> {
    match try_insert(conn, candidate)? {
        Some(inserted) => Ok(InsertOutcome::Inserted(inserted)),
        None => match get(conn, &candidate.key)? {
            Some(existing) => Ok(InsertOutcome::Existing(existing)),
            None => Err(StoreError::Internal(
                "the insert was refused by the unique key, yet no record has the key".to_owned(),
            )),
        },
    }
}

fn get(conn: &Connection, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
    let mut stmt = conn.prepare_cached(SQL_GET).map_err(map_err)?;
    let mut rows = stmt
        .query((&key.scope, &key.biz_type, &key.idem_key))
        .map_err(map_err)?;
    match rows.next().map_err(map_err)? {
        Some(row) => decode_row(row).map(Some),
        None => Ok(None),
    }
}

/// Replaces the record if its revision is `expected_revision`; false when
/// it is not (nothing written).
fn try_swap(
    conn: &Connection,
    expected_revision: u64,
    replacement: &StoredRecord,
) -> Result<bool, StoreError> {
    let row = EncodedRecord::new(replacement)?;
    // A revision or id SQLite cannot store is not stored: nothing matches it.
    let (Ok(expected), Ok(id)) = (
        i64::try_from(expected_revision),
        i64::try_from(replacement.id),
    ) else {
        return Ok(false);
    };
    let mut params = row.params();
    params.push(&expected);
    params.push(&id);
    let mut stmt = conn.prepare_cached(SQL_SWAP).map_err(map_err)?;
    let changed = stmt.execute(params.as_slice()).map_err(map_err)?;
    Ok(changed > 0)
}

/// The whole `compare_and_swap`; inside a transaction, a stale swap returns
/// the record as it was when the swap was refused.
fn compare_and_swap(
    conn: &Connection,
    expected_revision: u64,
    replacement: &StoredRecord,
) -> Result<SwapOutcome, StoreError> {
    if try_swap(conn, expected_revision, replacement)? {
        return Ok(SwapOutcome::Swapped);
    }
    Ok(SwapOutcome::Stale(get(conn, &replacement.key)?))
}

fn delete_expired(conn: &Connection, now: Timestamp, limit: u32) -> Result<u32, StoreError> {
    let mut stmt = conn.prepare_cached(SQL_DELETE_EXPIRED).map_err(map_err)?;
    let deleted = stmt
        .execute((saturate(now), i64::from(limit)))
        .map_err(map_err)?;
    u32::try_from(deleted)
        .map_err(|_| StoreError::Internal(format!("deleted {deleted} rows, more than the limit")))
}

fn list_stale(
    conn: &Connection,
    biz_type: &str,
    now: Timestamp,
    after: Option<StaleCursor>,
    limit: u32,
) -> Result<Vec<StoredRecord>, StoreError> {
    let (after_at, after_id) = cursor_values(after);
    let mut stmt = conn.prepare_cached(SQL_LIST_STALE).map_err(map_err)?;
    let mut rows = stmt
        .query((
            biz_type,
            saturate(now),
            i64::from(limit),
            after_at,
            after_id,
        ))
        .map_err(map_err)?;
    let mut records = Vec::new();
    while let Some(row) = rows.next().map_err(map_err)? {
        records.push(decode_row(row)?);
    }
    Ok(records)
}

fn count_by_status(conn: &Connection) -> Result<Vec<(Status, u64)>, StoreError> {
    let mut stmt = conn.prepare_cached(SQL_COUNT_BY_STATUS).map_err(map_err)?;
    let mut rows = stmt.query([]).map_err(map_err)?;
    let mut counts = Status::ALL.map(|status| (status, 0u64));
    while let Some(row) = rows.next().map_err(map_err)? {
        let name: String = row.get(0).map_err(map_err)?;
        let count: i64 = row.get(1).map_err(map_err)?;
        let status = parse_status(&name)?;
        let slot = counts
            .iter_mut()
            .find(|(s, _)| *s == status)
            .ok_or_else(|| StoreError::Internal(format!("status {name} is not counted")))?;
        slot.1 = to_u64(count, "count")?;
    }
    Ok(counts.to_vec())
}

// ---------------------------------------------------------------------------
// Encoding and decoding.

/// A record as SQLite values ([`RecordColumns`]): numbers above
/// `i64::MAX` are refused; `response` and `failure` are JSON, byte strings
/// as base64, so the round trip is exact.
struct EncodedRecord<'a>(RecordColumns<'a>);

impl<'a> EncodedRecord<'a> {
    fn new(record: &'a StoredRecord) -> Result<Self, StoreError> {
        RecordColumns::new(record, "the largest integer SQLite stores").map(Self)
    }

    /// Parameters `?1` to `?16` of [`SQL_INSERT`] and [`SQL_SWAP`].
    fn params(&self) -> Vec<&dyn ToSql> {
        let c = &self.0;
        vec![
            &c.scope,
            &c.biz_type,
            &c.idem_key,
            &c.fingerprint,
            &c.fingerprint_version,
            &c.status,
            &c.fencing_token,
            &c.revision,
            &c.attempts,
            &c.lease_until,
            &c.created_at,
            &c.updated_at,
            &c.expires_at,
            &c.result_ref,
            &c.response,
            &c.failure,
        ]
    }
}

/// Reads column `index` of [`record_columns!`], naming it in any error.
fn column<T: FromSql>(row: &rusqlite::Row<'_>, index: usize) -> Result<T, StoreError> {
    row.get(index).map_err(|e| {
        StoreError::Internal(format!("column {} cannot be read: {e}", column_name(index)))
    })
}

/// Decodes one row selected with [`record_columns!`].
fn decode_row(row: &rusqlite::Row<'_>) -> Result<StoredRecord, StoreError> {
    RecordRow {
        id: column(row, 0)?,
        scope: column(row, 1)?,
        biz_type: column(row, 2)?,
        idem_key: column(row, 3)?,
        fingerprint: column(row, 4)?,
        fingerprint_version: column(row, 5)?,
        status: column(row, 6)?,
        fencing_token: column(row, 7)?,
        revision: column(row, 8)?,
        attempts: column(row, 9)?,
        lease_until: column(row, 10)?,
        created_at: column(row, 11)?,
        updated_at: column(row, 12)?,
        expires_at: column(row, 13)?,
        result_ref: column(row, 14)?,
        response: column(row, 15)?,
        failure: column(row, 16)?,
    }
    .into_record()
}

// ---------------------------------------------------------------------------
// Group commit.

/// The most writes one group transaction carries: enough for every caller
/// of a busy server to share one commit, few enough that one failure fails
/// a bounded number of callers and the write lock is held briefly.
const MAX_GROUP: usize = 64;

/// A write waiting for a group transaction.
enum GroupWrite {
    Insert(StoredRecord),
    Swap(u64, StoredRecord),
}

/// The answer to a [`GroupWrite`], given after the commit.
enum GroupDone {
    Insert(InsertOutcome),
    Swap(SwapOutcome),
}

/// Where a waiting caller stands.
enum SlotState {
    Waiting,
    /// The previous leader handed the queue to this caller.
    Lead,
    Done(Box<Result<GroupDone, StoreError>>),
}

/// One waiting caller: its state and the signal that it changed.
struct Slot {
    state: Mutex<SlotState>,
    changed: std::sync::Condvar,
}

impl Slot {
    fn set(&self, state: SlotState) {
        *self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = state;
        self.changed.notify_one();
    }

    /// Waits until the caller is answered or asked to lead.
    fn wait(&self) -> SlotState {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            match std::mem::replace(&mut *state, SlotState::Waiting) {
                SlotState::Waiting => {
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                other => return other,
            }
        }
    }
}

#[derive(Default)]
struct GroupQueue {
    waiting: Vec<(GroupWrite, Arc<Slot>)>,
}

/// Leader-based group commit: the first caller to find no leader writes
/// every queued write in one transaction, answers each caller after the
/// commit, and hands the queue to the next waiting caller.
#[derive(Default)]
struct GroupCommit {
    queue: Mutex<GroupQueue>,
    /// True while some caller leads: it alone takes writes off the queue.
    /// Changed only under `queue`'s lock; read without it by
    /// [`Storage::write_would_wait`].
    leading: AtomicBool,
}

impl GroupCommit {
    fn lock(&self) -> MutexGuard<'_, GroupQueue> {
        self.queue
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn submit(&self, store: &SqliteStore, write: GroupWrite) -> Result<GroupDone, StoreError> {
        let slot = Arc::new(Slot {
            state: Mutex::new(SlotState::Waiting),
            changed: std::sync::Condvar::new(),
        });
        let lead = {
            let mut queue = self.lock();
            queue.waiting.push((write, Arc::clone(&slot)));
            !self.leading.swap(true, Ordering::Relaxed)
        };
        if !lead && let SlotState::Done(result) = slot.wait() {
            return *result;
        }
        // This caller leads; its own write is still queued (only a leader
        // takes writes off the queue), so the batch below answers it.
        let batch: Vec<_> = {
            let mut queue = self.lock();
            let n = queue.waiting.len().min(MAX_GROUP);
            queue.waiting.drain(..n).collect()
        };
        let handoff = Handoff(self);
        let (writes, slots): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        let results =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_group(store, &writes)));
        drop(handoff);
        let results = match results {
            Ok(results) => results,
            Err(panic) => {
                // Nobody may wait forever: answer everyone, then go on
                // unwinding. The transaction was rolled back on unwind.
                for slot in &slots {
                    slot.set(SlotState::Done(Box::new(Err(StoreError::Internal(
                        "a panic interrupted the group commit; nothing of it was stored".to_owned(),
                    )))));
                }
                std::panic::resume_unwind(panic);
            }
        };
        for (slot, result) in slots.iter().zip(results) {
            slot.set(SlotState::Done(Box::new(result)));
        }
        match slot.wait() {
            SlotState::Done(result) => *result,
            _ => Err(StoreError::Internal(
                "group commit lost this caller's answer".to_owned(),
            )),
        }
    }
}

/// Ends a leader's turn, even if the batch panicked: the next waiting
/// caller leads, or nobody does while the queue is empty.
struct Handoff<'a>(&'a GroupCommit);

impl Drop for Handoff<'_> {
    fn drop(&mut self) {
        let queue = self.0.lock();
        match queue.waiting.first() {
            Some((_, next)) => next.set(SlotState::Lead),
            None => self.0.leading.store(false, Ordering::Relaxed),
        }
    }
}

/// Writes `writes` in order in one `BEGIN IMMEDIATE … COMMIT`; every
/// answer is given only once the commit succeeded. Any failure rolls the
/// whole transaction back and fails every write with
/// [`StoreError::Unavailable`].
fn run_group(store: &SqliteStore, writes: &[GroupWrite]) -> Vec<Result<GroupDone, StoreError>> {
    let attempt = || -> Result<Vec<GroupDone>, StoreError> {
        store.write(|conn| {
            writes
                .iter()
                .map(|w| match w {
                    GroupWrite::Insert(candidate) => {
                        insert_if_absent(conn, candidate).map(GroupDone::Insert)
                    }
                    GroupWrite::Swap(expected, replacement) => {
                        compare_and_swap(conn, *expected, replacement).map(GroupDone::Swap)
                    }
                })
                .collect()
        })
    };
    match attempt() {
        Ok(done) => done.into_iter().map(Ok).collect(),
        Err(e) => writes
            .iter()
            .map(|_| {
                Err(StoreError::Unavailable(format!(
                    "the group commit of {} writes was rolled back: {e}",
                    writes.len()
                )))
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests;
