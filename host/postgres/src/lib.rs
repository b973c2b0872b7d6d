//! The PostgreSQL backend: one store shared by many idem hosts.
//!
//! Every host that connects to the same database and schema shares the same
//! records, and the unique constraint on `(scope_key, biz_type, idem_key)`
//! decides every insert race, across threads, processes and machines.
//!
//! Each operation is a single statement in autocommit mode, or two where an
//! answer needs the current row after a write was refused; every statement
//! is prepared once per connection. Under READ COMMITTED (PostgreSQL's
//! default) each statement sees every transaction committed before it
//! started, which is all the operations need:
//!
//! - insert-if-absent is `INSERT … ON CONFLICT DO NOTHING RETURNING id`; a
//!   conflicting insert waits for the other inserter to commit, so the
//!   `SELECT` that follows sees its row. If that row was deleted in between
//!   (by a sweeper), the insert is tried again.
//! - compare-and-swap is `UPDATE … WHERE id = $id AND revision = $expected`
//!   (the id tells a re-created record, back at revision 1, from the one the
//!   writer read; identity values are never reused); a concurrent
//!   update makes PostgreSQL re-check the condition on the newest row
//!   version, so of two swaps expecting one revision only one matches.
//! - delete-expired locks its candidates (`FOR UPDATE SKIP LOCKED`, so two
//!   sweepers never wait for each other) and re-checks their status and
//!   expiry in the `DELETE` itself.
//!
//! The schema is versioned in a table of its own and migrated when a store
//! opens, under a transaction-scoped advisory lock, so hosts that start
//! together apply each migration exactly once.

#![warn(missing_docs)]

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use postgres::types::{FromSqlOwned, ToSql};
use postgres::{Client, NoTls, Statement};

use idem_engine::store::StaleCursor;
use idem_engine::store::sql::{
    COLUMNS, RecordColumns, RecordRow, TransactionSlot, column_name, cursor_values, parse_status,
    saturate, to_u64,
};
use idem_engine::types::{InsertOutcome, RecordKey, Status, StoredRecord, SwapOutcome, Timestamp};
use idem_engine::{
    ActionResult, BatchErrors, BeginRequest, Engine, Error, RunOutcome, Savepoint, Storage,
    StoreError, Ticket, Transaction,
};

/// The table that records which migrations a schema has had.
const VERSION_TABLE: &str = "idem_schema_version";

/// The schema, one entry per version; `{schema}` stands for the quoted
/// schema name. Entry `i` moves the schema from version `i` to `i + 1`.
/// Entries are never edited once released; changes are new entries.
///
/// Differences from the SQLite table, all forced by PostgreSQL's types: the
/// key columns use the "C" collation so that they compare byte for byte,
/// as SQLite's do; `result_ref` is `BYTEA` holding UTF-8, because a `TEXT`
/// value cannot hold the NUL character that a result reference may carry;
/// `response` and `failure` are `BYTEA` holding JSON, as SQLite's `BLOB`s.
const MIGRATIONS: &[&str] = &[
    // Version 1: the record table and the indexes behind the sweeper and the
    // reconciliation scan.
    r#"CREATE TABLE {schema}.idempotency_record (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        scope_key TEXT COLLATE "C" NOT NULL,
        biz_type TEXT COLLATE "C" NOT NULL,
        idem_key TEXT COLLATE "C" NOT NULL,
        request_hash TEXT NOT NULL,
        fingerprint_version BIGINT NOT NULL,
        status TEXT NOT NULL CHECK (status IN
            ('processing', 'succeeded', 'failed', 'released', 'outcome-unknown')),
        fencing_token BIGINT NOT NULL,
        revision BIGINT NOT NULL,
        attempts BIGINT NOT NULL,
        lease_until BIGINT,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        expires_at BIGINT,
        result_ref BYTEA,
        response BYTEA,
        failure BYTEA,
        CONSTRAINT idempotency_record_key UNIQUE (scope_key, biz_type, idem_key)
    );
    CREATE INDEX idempotency_record_sweep
        ON {schema}.idempotency_record (expires_at)
        WHERE status IN ('succeeded', 'failed', 'released');
    CREATE INDEX idempotency_record_stale_processing
        ON {schema}.idempotency_record (biz_type, lease_until)
        WHERE status = 'processing';
    CREATE INDEX idempotency_record_outcome_unknown
        ON {schema}.idempotency_record (biz_type, updated_at)
        WHERE status = 'outcome-unknown';"#,
    // Version 2: byte strings in the `response` and `failure` JSON are
    // base64 strings (`idem_engine::store::sql`). No row is rewritten:
    // rows written by version 1, with arrays of numbers, are still read.
    // The version number is what changes, so that a build that only knows
    // version 1 refuses the schema instead of failing on the new rows.
    r#"COMMENT ON COLUMN {schema}.idempotency_record.response IS
        'JSON {status, headers: [[name, base64]], body: base64}; arrays of numbers before schema version 2';
    COMMENT ON COLUMN {schema}.idempotency_record.failure IS
        'JSON {code, message, response}; the response as in the response column';"#,
];

/// How often insert-if-absent tries again when the row that refused its
/// insert is gone before it could be read. Each retry needs a sweeper to
/// delete the key's expired record between two statements, and a record is
/// deleted only once, so a second retry already means a new record was
/// inserted and expired in between; three is far beyond any real race.
const INSERT_ATTEMPTS: usize = 3;

/// The `application_name` the store gives its connections unless the URL
/// names one, so that operators (and the fault tests) can find them in
/// `pg_stat_activity`.
pub const DEFAULT_APPLICATION_NAME: &str = "idem";

/// The longest schema name PostgreSQL keeps (NAMEDATALEN - 1 bytes).
const MAX_SCHEMA_BYTES: usize = 63;

/// How long a TCP connection may stay silent before the client probes it,
/// and how far apart the probes are: a server that vanished without closing
/// the connection (a crashed machine, a network partition) is noticed within
/// about 8 seconds instead of the operating system's 2 hours, a little after
/// the default statement timeout would have ended a slow statement.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
/// See [`KEEPALIVE_IDLE`].
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
/// See [`KEEPALIVE_IDLE`].
const KEEPALIVE_RETRIES: u32 = 3;

/// Settings for [`PostgresStore::connect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresOptions {
    /// The schema that holds idem's tables; created if missing. Default
    /// `public`. Several independent idem deployments (or tests) can share
    /// one database with a schema each. 1 to 63 ASCII letters, digits and
    /// underscores, not starting with a digit.
    pub schema: String,
    /// How many connections the pool keeps open. Default 8: each operation
    /// holds a connection for one or two short statements, so 8 serve
    /// thousands of operations a second, and several hosts with 8 each stay
    /// far below PostgreSQL's default limit of 100 connections. Must be at
    /// least 1.
    pub pool_size: u32,
    /// How long opening a connection may take, and how long an operation
    /// waits for a free pooled connection, before it fails with
    /// [`StoreError::Unavailable`]. Default 5 s: time enough for a
    /// connection across a data centre and for a burst of operations, short
    /// enough that an unreachable server surfaces as an error instead of a
    /// hang. At least 1 ms.
    pub connect_timeout: Duration,
    /// The server-side `statement_timeout` of every connection: a statement
    /// still running after it is cancelled and fails with
    /// [`StoreError::Unavailable`]. Default 5 s, as SQLite's busy timeout:
    /// the statements touch one row or a bounded batch, so only a lock held
    /// by a stuck transaction or an overloaded server makes one that slow.
    /// At least 1 ms and below 2^31 ms.
    pub statement_timeout: Duration,
    /// Whether a pooled connection is checked (with an empty query) each
    /// time it is taken from the pool. Default true: a connection that the
    /// server closed while it sat in the pool (a restart, a failover,
    /// `pg_terminate_backend`) is replaced instead of failing the next
    /// operation; the check costs one round trip per operation. When false,
    /// such a connection fails one operation with
    /// [`StoreError::Unavailable`] and is then discarded.
    pub check_on_checkout: bool,
    /// With `check_on_checkout`, a connection is checked only when it has
    /// sat in the pool at least this long. Default
    /// [`DEFAULT_CHECK_AFTER_IDLE`]; zero checks every checkout.
    pub check_after_idle: Duration,
}

/// The default [`PostgresOptions::check_after_idle`], 500 ms (HikariCP's
/// "alive bypass window" for the same reason): a connection handed back
/// moments ago was working then, so under load, when every connection is
/// reused within microseconds, the check would add one round trip to
/// every operation and catch next to nothing. A connection that the server
/// closed within that window fails one operation with
/// [`StoreError::Unavailable`] and is discarded, as without the check.
pub const DEFAULT_CHECK_AFTER_IDLE: Duration = Duration::from_millis(500);

impl Default for PostgresOptions {
    fn default() -> Self {
        Self {
            schema: "public".to_owned(),
            pool_size: 8,
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(5),
            check_on_checkout: true,
            check_after_idle: DEFAULT_CHECK_AFTER_IDLE,
        }
    }
}

impl PostgresOptions {
    fn validate(&self) -> Result<(), StoreError> {
        validate_schema(&self.schema)?;
        if self.pool_size == 0 {
            return Err(StoreError::Rejected(
                "PostgresOptions::pool_size must be at least 1".to_owned(),
            ));
        }
        if self.connect_timeout < Duration::from_millis(1) {
            return Err(StoreError::Rejected(format!(
                "PostgresOptions::connect_timeout of {:?} is below the minimum of 1 ms",
                self.connect_timeout
            )));
        }
        let ms = self.statement_timeout.as_millis();
        if ms < 1 || i32::try_from(ms).is_err() {
            return Err(StoreError::Rejected(format!(
                "PostgresOptions::statement_timeout of {:?} is outside 1 ms to {} ms",
                self.statement_timeout,
                i32::MAX
            )));
        }
        Ok(())
    }
}

/// Checks a schema name: 1 to 63 ASCII letters, digits and underscores, not
/// starting with a digit. Such a name never needs quoting rules beyond
/// enclosing it in double quotes.
fn validate_schema(schema: &str) -> Result<(), StoreError> {
    let first_ok = schema
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    let rest_ok = schema
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !first_ok || !rest_ok || schema.len() > MAX_SCHEMA_BYTES {
        return Err(StoreError::Rejected(format!(
            "PostgresOptions::schema {schema:?} is not allowed: it must be 1 to \
             {MAX_SCHEMA_BYTES} ASCII letters, digits and underscores, not starting with a digit"
        )));
    }
    Ok(())
}

/// Maps a PostgreSQL client error onto the store contract.
///
/// A lost or refused connection, a timeout (statement, lock or connect), a
/// server shutting down, too many connections, a serialization failure or a
/// deadlock is [`StoreError::Unavailable`]: the store may answer later, and
/// whether a write took effect is unknown. Data the server refuses
/// (integrity constraints, data exceptions such as a NUL character in text,
/// values beyond a limit) is [`StoreError::Rejected`]. Everything else is
/// [`StoreError::Internal`].
pub fn map_err(e: postgres::Error) -> StoreError {
    if let Some(db) = e.as_db_error() {
        // The client's own message for a server error is only "db error".
        let code = db.code().code();
        let class = code.get(..2).unwrap_or("");
        let text = format!("postgres: {} (SQLSTATE {code})", db.message());
        return match (class, code) {
            // connection_exception, insufficient_resources,
            // transaction_rollback (serialization failure, deadlock).
            ("08" | "53" | "40", _) => StoreError::Unavailable(text),
            // admin_shutdown, crash_shutdown, cannot_connect_now,
            // query_canceled (statement_timeout), lock_not_available.
            (_, "57P01" | "57P02" | "57P03" | "57014" | "55P03") => StoreError::Unavailable(text),
            // data_exception, integrity_constraint_violation,
            // program_limit_exceeded.
            ("22" | "23" | "54", _) => StoreError::Rejected(text),
            _ => StoreError::Internal(text),
        };
    }
    if e.is_closed() || has_io_source(&e) || is_timeout(&e) {
        return StoreError::Unavailable(format!("postgres: {e}"));
    }
    StoreError::Internal(format!("postgres: {e}"))
}

/// True when an I/O error (a refused, reset or broken connection) is among
/// the causes of `e`.
fn has_io_source(e: &postgres::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// True for the client's own timeouts (connecting, or waiting for the
/// server), which carry no cause of their own.
fn is_timeout(e: &postgres::Error) -> bool {
    e.to_string().to_ascii_lowercase().contains("timeout")
}

/// Maps a pool error: r2d2 reports only that no connection became free (or
/// could be opened) in time.
fn map_pool_err(e: r2d2::Error) -> StoreError {
    StoreError::Unavailable(format!("postgres connection pool: {e}"))
}

/// The statements of one schema, as SQL text.
#[derive(Debug)]
struct Sql {
    insert: String,
    get: String,
    swap: String,
    delete_expired: String,
    list_stale: String,
    count_by_status: String,
}

impl Sql {
    fn new(schema: &str) -> Self {
        let table = format!("{}.idempotency_record", quote(schema));
        Self {
            insert: format!(
                "INSERT INTO {table} (
                    scope_key, biz_type, idem_key, request_hash, fingerprint_version, status,
                    fencing_token, revision, attempts, lease_until, created_at, updated_at,
                    expires_at, result_ref, response, failure)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)
                ON CONFLICT (scope_key, biz_type, idem_key) DO NOTHING
                RETURNING id"
            ),
            get: format!(
                "SELECT {COLUMNS} FROM {table}
                WHERE scope_key = $1 AND biz_type = $2 AND idem_key = $3"
            ),
            // The key columns are not written: the WHERE clause already pins
            // them to the replacement's values.
            swap: format!(
                "UPDATE {table} SET
                    request_hash = $4, fingerprint_version = $5, status = $6,
                    fencing_token = $7, revision = $8, attempts = $9, lease_until = $10,
                    created_at = $11, updated_at = $12, expires_at = $13, result_ref = $14,
                    response = $15, failure = $16
                WHERE scope_key = $1 AND biz_type = $2 AND idem_key = $3 AND revision = $17
                    AND id = $18"
            ),
            // The candidates are chosen and locked once, in a CTE (a
            // subquery could be run again for each row and pick more rows
            // than the limit); the outer conditions are checked again on the
            // rows as they are now.
            delete_expired: format!(
                "WITH doomed AS MATERIALIZED (
                    SELECT id FROM {table}
                    WHERE status IN ('succeeded', 'failed', 'released') AND expires_at <= $1
                    ORDER BY expires_at, id
                    LIMIT $2
                    FOR UPDATE SKIP LOCKED)
                DELETE FROM {table} AS r USING doomed
                WHERE r.id = doomed.id
                    AND r.status IN ('succeeded', 'failed', 'released') AND r.expires_at <= $1"
            ),
            list_stale: format!(
                "SELECT {COLUMNS} FROM {table}
                    WHERE biz_type = $1 AND status = 'processing' AND lease_until <= $2
                        AND (updated_at, id) > ($4, $5)
                UNION ALL
                SELECT {COLUMNS} FROM {table}
                    WHERE biz_type = $1 AND status = 'outcome-unknown'
                        AND (updated_at, id) > ($4, $5)
                ORDER BY updated_at, id
                LIMIT $3"
            ),
            count_by_status: format!("SELECT status, COUNT(*) FROM {table} GROUP BY status"),
        }
    }
}

/// A schema or table name in double quotes. Names are checked by
/// [`validate_schema`], so they hold no quote to double.
fn quote(name: &str) -> String {
    format!("\"{name}\"")
}

/// The statements prepared on one connection.
struct Prepared {
    insert: Statement,
    get: Statement,
    swap: Statement,
    delete_expired: Statement,
    list_stale: Statement,
    count_by_status: Statement,
}

/// A client that may be dropped anywhere. The synchronous `postgres`
/// client blocks on its own runtime when it closes, which panics on a
/// thread that drives a tokio runtime (a store dropped inside an async
/// task, with the consumer or the server that owned it); there it is
/// closed on a thread of its own.
struct OwnedClient(Option<Client>);

impl std::ops::Deref for OwnedClient {
    type Target = Client;

    fn deref(&self) -> &Client {
        self.0
            .as_ref()
            .expect("the client is present until dropped")
    }
}

impl std::ops::DerefMut for OwnedClient {
    fn deref_mut(&mut self) -> &mut Client {
        self.0
            .as_mut()
            .expect("the client is present until dropped")
    }
}

impl Drop for OwnedClient {
    fn drop(&mut self) {
        if let Some(client) = self.0.take()
            && tokio::runtime::Handle::try_current().is_ok()
        {
            std::thread::spawn(move || drop(client));
        }
    }
}

/// A pooled connection with its prepared statements.
struct PgConnection {
    client: OwnedClient,
    prepared: Prepared,
    /// When the pool last took the connection back after a successful
    /// operation; none before its first use and after a failed one.
    returned_at: Option<Instant>,
    /// Whether the last operation on the connection succeeded.
    healthy: bool,
    /// Whether a business transaction is open on the connection: set by
    /// `BEGIN`, cleared once `COMMIT` or `ROLLBACK` succeeded. A connection
    /// still inside one never goes back to the pool.
    in_transaction: bool,
}

impl fmt::Debug for PgConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgConnection")
            .field("closed", &self.client.is_closed())
            .finish_non_exhaustive()
    }
}

/// Opens connections with the store's settings and prepares its statements.
struct ConnectionManager {
    config: postgres::Config,
    sql: Arc<Sql>,
    /// [`PostgresOptions::check_after_idle`].
    check_after_idle: Duration,
}

impl ConnectionManager {
    fn open(&self) -> Result<PgConnection, postgres::Error> {
        let mut client = self.config.connect(NoTls)?;
        let prepared = Prepared {
            insert: client.prepare(&self.sql.insert)?,
            get: client.prepare(&self.sql.get)?,
            swap: client.prepare(&self.sql.swap)?,
            delete_expired: client.prepare(&self.sql.delete_expired)?,
            list_stale: client.prepare(&self.sql.list_stale)?,
            count_by_status: client.prepare(&self.sql.count_by_status)?,
        };
        Ok(PgConnection {
            client: OwnedClient(Some(client)),
            prepared,
            returned_at: None,
            healthy: true,
            in_transaction: false,
        })
    }
}

impl r2d2::ManageConnection for ConnectionManager {
    type Connection = PgConnection;
    type Error = postgres::Error;

    fn connect(&self) -> Result<PgConnection, postgres::Error> {
        self.open()
    }

    /// Called on checkout when `check_on_checkout` is on: an empty query,
    /// unless the connection came back within `check_after_idle`.
    fn is_valid(&self, conn: &mut PgConnection) -> Result<(), postgres::Error> {
        if conn
            .returned_at
            .is_some_and(|at| at.elapsed() < self.check_after_idle)
        {
            return Ok(());
        }
        conn.client.simple_query("").map(|_| ())
    }

    /// A connection whose socket the client saw close, or that is still
    /// inside a business transaction (its rollback failed), is discarded on
    /// its way back to the pool: the server rolls back what it held. Every
    /// other one notes when it came back, if its last operation succeeded.
    fn has_broken(&self, conn: &mut PgConnection) -> bool {
        conn.returned_at = conn.healthy.then(Instant::now);
        conn.client.is_closed() || conn.in_transaction
    }
}

type Pool = r2d2::Pool<ConnectionManager>;

struct Inner {
    pool: Pool,
    schema: String,
}

/// A [`Storage`] backend on PostgreSQL, for several idem hosts that share
/// one source of truth.
///
/// Cheap to clone (the pool is shared) and safe to use from many threads.
/// Any number of stores, in this process or on other machines, may use the
/// same database and schema at once; the unique constraint and row-level
/// locking keep every operation atomic across all of them.
///
/// The client is synchronous: call it from plain threads or from
/// `tokio::task::spawn_blocking`, never directly on an async runtime's
/// worker (it runs a small runtime of its own per connection).
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("schema", &self.inner.schema)
            .field("pool_size", &self.inner.pool.max_size())
            .finish()
    }
}

impl PostgresStore {
    /// Connects to the database at `url` (a `postgres://` or
    /// `postgresql://` URL, or a `key=value` connection string) and brings
    /// the schema's tables up to date.
    ///
    /// Connections use no TLS: a URL with `sslmode=require` fails. Unless
    /// the URL sets `application_name`, connections are named
    /// [`DEFAULT_APPLICATION_NAME`].
    ///
    /// Errors: [`StoreError::Rejected`] for invalid options or an
    /// unparsable URL, [`StoreError::Unavailable`] when the server cannot
    /// be reached in time, [`StoreError::Internal`] when the schema is newer
    /// than this build understands or the server refuses the migration.
    pub fn connect(url: &str, options: PostgresOptions) -> Result<PostgresStore, StoreError> {
        options.validate()?;
        let mut config = postgres::Config::from_str(url).map_err(|e| {
            // The URL may hold a password: never repeat it.
            StoreError::Rejected(format!("the PostgreSQL connection URL is not valid: {e}"))
        })?;
        if config.get_application_name().is_none() {
            config.application_name(DEFAULT_APPLICATION_NAME);
        }
        config
            .connect_timeout(options.connect_timeout)
            .keepalives(true)
            .keepalives_idle(KEEPALIVE_IDLE)
            .keepalives_interval(KEEPALIVE_INTERVAL)
            .keepalives_retries(KEEPALIVE_RETRIES)
            .options(&format!(
                "-c statement_timeout={}",
                options.statement_timeout.as_millis()
            ));
        let sql = Arc::new(Sql::new(&options.schema));
        let manager = ConnectionManager {
            config: config.clone(),
            sql,
            check_after_idle: options.check_after_idle,
        };

        // One connection outside the pool: it reports an unreachable server
        // at once (the pool would retry until its timeout) and migrates.
        let mut client = config.connect(NoTls).map_err(map_err)?;
        migrate(&mut client, &options.schema)?;
        drop(client);

        // Every connection is opened now and kept open (min_idle defaults to
        // max_size), so an operation waits only when all are in use.
        let pool = r2d2::Pool::builder()
            .max_size(options.pool_size)
            .connection_timeout(options.connect_timeout)
            .test_on_check_out(options.check_on_checkout)
            .build(manager)
            .map_err(map_pool_err)?;
        Ok(PostgresStore {
            inner: Arc::new(Inner {
                pool,
                schema: options.schema,
            }),
        })
    }

    /// The schema holding the store's tables.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// Starts a business transaction (`BEGIN`) on a pooled connection.
    ///
    /// The returned [`PostgresTransaction`] implements [`Storage`] inside
    /// the transaction and lets business code write through
    /// [`PostgresTransaction::with_connection`], so that both commit or roll
    /// back together. Rows it changes stay locked until it ends: a request
    /// for the same key reads the record as it was (in progress) meanwhile.
    ///
    /// Errors: as any operation ([`StoreError::Unavailable`] when no
    /// connection or no server answers).
    pub fn begin_transaction(&self) -> Result<PostgresTransaction, StoreError> {
        let mut conn = self.inner.pool.get().map_err(map_pool_err)?;
        conn.in_transaction = true;
        if let Err(e) = conn.client.batch_execute("BEGIN") {
            conn.healthy = false;
            return Err(map_err(e));
        }
        Ok(PostgresTransaction {
            conn: TransactionSlot::new(conn),
        })
    }

    /// Runs one operation on a pooled connection.
    fn with<R>(
        &self,
        op: impl FnOnce(&mut PgConnection) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let mut conn = self.inner.pool.get().map_err(map_pool_err)?;
        let out = op(&mut conn);
        // A failed operation may have lost the connection without the
        // client noticing yet: check it on its next checkout, however soon.
        conn.healthy = out.is_ok();
        out
    }
}

/// The [`Storage`] operations of `$type`, each run on a connection by its
/// method `$on`: in autocommit mode (`PostgresStore::with`) or inside a
/// business transaction (`PostgresTransaction::run`).
macro_rules! storage_over {
    ($type:ty, $on:ident) => {
        impl Storage for $type {
            fn insert_if_absent(
                &self,
                candidate: &StoredRecord,
            ) -> Result<InsertOutcome, StoreError> {
                let row = EncodedRecord::new(candidate)?;
                self.$on(|c| insert_if_absent(c, candidate, &row))
            }

            fn get(&self, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
                self.$on(|c| get(c, key))
            }

            fn compare_and_swap(
                &self,
                expected_revision: u64,
                replacement: &StoredRecord,
            ) -> Result<SwapOutcome, StoreError> {
                let row = EncodedRecord::new(replacement)?;
                self.$on(|c| compare_and_swap(c, expected_revision, replacement, &row))
            }

            fn delete_expired(&self, now: Timestamp, limit: u32) -> Result<u32, StoreError> {
                self.$on(|c| delete_expired(c, now, limit))
            }

            fn list_stale_after(
                &self,
                biz_type: &str,
                now: Timestamp,
                after: Option<StaleCursor>,
                limit: u32,
            ) -> Result<Vec<StoredRecord>, StoreError> {
                self.$on(|c| list_stale(c, biz_type, now, after, limit))
            }

            fn count_by_status(&self) -> Result<Vec<(Status, u64)>, StoreError> {
                self.$on(count_by_status)
            }
        }
    };
}

storage_over!(PostgresStore, with);

// ---------------------------------------------------------------------------
// The operations, each written once over a connection: in autocommit mode
// (PostgresStore) or inside an open business transaction
// (PostgresTransaction).

fn insert_if_absent(
    c: &mut PgConnection,
    candidate: &StoredRecord,
    row: &EncodedRecord<'_>,
) -> Result<InsertOutcome, StoreError> {
    for _ in 0..INSERT_ATTEMPTS {
        let inserted = c
            .client
            .query_opt(&c.prepared.insert, &row.params())
            .map_err(map_err)?;
        if let Some(r) = inserted {
            let mut inserted = candidate.clone();
            inserted.id = to_u64(column(&r, 0)?, "id")?;
            return Ok(InsertOutcome::Inserted(inserted));
        }
        // The conflicting row is committed (a conflicting insert waits for
        // its inserter), so this statement sees it unless it was deleted
        // since; then the insert is tried again.
        if let Some(existing) = get(c, &candidate.key)? {
            return Ok(InsertOutcome::Existing(existing));
        }
    }
    Err(StoreError::Unavailable(format!(
        "the key's record was deleted and re-created {INSERT_ATTEMPTS} times while it was \
         being inserted; try again"
    )))
}

fn compare_and_swap(
    c: &mut PgConnection,
    expected_revision: u64,
    replacement: &StoredRecord,
    row: &EncodedRecord<'_>,
) -> Result<SwapOutcome, StoreError> {
    // A revision or id the column cannot hold is not stored: nothing
    // matches it.
    if let (Ok(expected), Ok(id)) = (
        i64::try_from(expected_revision),
        i64::try_from(replacement.id),
    ) {
        let mut params = row.params();
        params.push(&expected);
        params.push(&id);
        let changed = c
            .client
            .execute(&c.prepared.swap, &params)
            .map_err(map_err)?;
        if changed > 0 {
            return Ok(SwapOutcome::Swapped);
        }
    }
    Ok(SwapOutcome::Stale(get(c, &replacement.key)?))
}

fn delete_expired(c: &mut PgConnection, now: Timestamp, limit: u32) -> Result<u32, StoreError> {
    let deleted = c
        .client
        .execute(
            &c.prepared.delete_expired,
            &[&saturate(now), &i64::from(limit)],
        )
        .map_err(map_err)?;
    u32::try_from(deleted)
        .map_err(|_| StoreError::Internal(format!("deleted {deleted} rows, more than the limit")))
}

fn list_stale(
    c: &mut PgConnection,
    biz_type: &str,
    now: Timestamp,
    after: Option<StaleCursor>,
    limit: u32,
) -> Result<Vec<StoredRecord>, StoreError> {
    let (after_at, after_id) = cursor_values(after);
    // No stored biz type holds a NUL character (PostgreSQL text cannot).
    if biz_type.contains('\0') {
        return Ok(Vec::new());
    }
    let rows = c
        .client
        .query(
            &c.prepared.list_stale,
            &[
                &biz_type,
                &saturate(now),
                &i64::from(limit),
                &after_at,
                &after_id,
            ],
        )
        .map_err(map_err)?;
    rows.iter().map(decode_row).collect()
}

fn count_by_status(c: &mut PgConnection) -> Result<Vec<(Status, u64)>, StoreError> {
    let rows = c
        .client
        .query(&c.prepared.count_by_status, &[])
        .map_err(map_err)?;
    let mut counts = Status::ALL.map(|status| (status, 0u64));
    for row in &rows {
        let name: String = column(row, 0)?;
        let count: i64 = column(row, 1)?;
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
// Business transactions.

type PooledConnection = r2d2::PooledConnection<ConnectionManager>;

/// A business transaction on one pooled connection, opened by
/// [`PostgresStore::begin_transaction`]: the record's transitions and the
/// business writes made through [`PostgresTransaction::with_connection`]
/// commit together or not at all.
///
/// Dropped without [`PostgresTransaction::commit`], it rolls back. If the
/// process dies, the server rolls it back when the connection closes.
pub struct PostgresTransaction {
    conn: TransactionSlot<PooledConnection>,
}

impl fmt::Debug for PostgresTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresTransaction")
            .finish_non_exhaustive()
    }
}

impl PostgresTransaction {
    /// Runs `f` on the transaction's connection, e.g. a business write that
    /// must commit together with the record's transition.
    ///
    /// `f` must not end the transaction itself (`COMMIT`, `ROLLBACK`, or
    /// `Client::transaction`, which would commit it). A statement that
    /// fails inside `f` aborts the transaction on the server: every later
    /// statement fails and [`PostgresTransaction::commit`] refuses.
    /// Fails with [`StoreError::Internal`], without calling `f`, once the
    /// transaction has ended.
    pub fn with_connection<R>(&self, f: impl FnOnce(&mut Client) -> R) -> Result<R, StoreError> {
        self.run(|c| Ok(f(&mut c.client)))
    }

    /// Commits every write made in the transaction.
    ///
    /// A transaction that a failed statement aborted is rolled back and
    /// refused with [`StoreError::Internal`] (PostgreSQL answers `COMMIT`
    /// of an aborted transaction with a rollback, not an error, so it is
    /// checked first). A lost connection is [`StoreError::Unavailable`]: the
    /// commit may or may not have happened, as for any write.
    pub fn commit(self) -> Result<(), StoreError> {
        let mut conn = self.conn.take_for_commit()?;
        if let Err(e) = conn.client.batch_execute("SELECT 1") {
            let refused = StoreError::Internal(format!(
                "the transaction was aborted by an earlier failed statement; nothing was \
                 committed: {}",
                map_err(e)
            ));
            end(&mut conn, "ROLLBACK")?;
            return Err(refused);
        }
        end(&mut conn, "COMMIT")
    }

    /// Rolls back every write made in the transaction.
    pub fn rollback(self) -> Result<(), StoreError> {
        match self.conn.take_for_rollback() {
            Some(mut conn) => end(&mut conn, "ROLLBACK"),
            None => Ok(()),
        }
    }

    fn run<R>(
        &self,
        op: impl FnOnce(&mut PgConnection) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        self.conn.run(|conn| {
            let out = op(conn);
            conn.healthy = out.is_ok();
            out
        })
    }
}

/// Ends the transaction on `conn` with `COMMIT` or `ROLLBACK`. On failure
/// the connection stays marked as inside a transaction, so the pool
/// discards it and the server rolls back whatever is left.
fn end(conn: &mut PooledConnection, statement: &str) -> Result<(), StoreError> {
    match conn.client.batch_execute(statement) {
        Ok(()) => {
            conn.in_transaction = false;
            Ok(())
        }
        Err(e) => {
            conn.healthy = false;
            Err(map_err(e))
        }
    }
}

impl Drop for PostgresTransaction {
    fn drop(&mut self) {
        if let Some(mut conn) = self.conn.take_for_rollback()
            && let Err(e) = end(&mut conn, "ROLLBACK")
        {
            // The pool discards the connection; the server rolls back.
            tracing::warn!(error = %e, "rollback of a dropped PostgreSQL transaction failed");
        }
    }
}

impl Transaction for PostgresTransaction {
    fn commit(self) -> Result<(), StoreError> {
        PostgresTransaction::commit(self)
    }

    fn rollback(self) -> Result<(), StoreError> {
        PostgresTransaction::rollback(self)
    }

    fn savepoint(&self, mark: Savepoint) -> Result<(), StoreError> {
        self.run(|c| c.client.batch_execute(mark.take_sql()).map_err(map_err))
    }

    /// Also ends the "aborted" state a failed statement after the
    /// savepoint left the transaction in.
    fn rollback_to_savepoint(&self, mark: Savepoint) -> Result<(), StoreError> {
        self.run(|c| c.client.batch_execute(mark.rollback_sql()).map_err(map_err))
    }

    fn release_savepoint(&self, mark: Savepoint) -> Result<(), StoreError> {
        self.run(|c| c.client.batch_execute(mark.release_sql()).map_err(map_err))
    }
}

storage_over!(PostgresTransaction, run);

/// The business action and the transition to succeeded in one PostgreSQL
/// transaction, for an [`Engine`] built on a [`PostgresStore`].
pub trait RunInTransaction {
    /// Like [`Engine::run`], with the action's writes (through the
    /// `postgres::Client` it is given) and the transition to succeeded in
    /// one PostgreSQL transaction ([`Engine::run_with_transaction`]):
    /// "business written, status not updated" cannot happen. If ownership
    /// was lost meanwhile, the action's writes are rolled back. A failed
    /// action's writes are rolled back too, and the failure is stored as
    /// its disposition says.
    ///
    /// # Errors
    ///
    /// [`Error::WrongStorage`] when the engine's storage is not a
    /// [`PostgresStore`]; otherwise as [`Engine::run`].
    fn run_in_transaction(
        &self,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket, &mut Client) -> ActionResult,
    ) -> Result<RunOutcome, Error>;

    /// Like [`RunInTransaction::run_in_transaction`], with the claim in
    /// the same PostgreSQL transaction ([`Engine::run_with_one_transaction`]):
    /// one commit per execution, and a crash leaves no processing record
    /// to wait out. A duplicate's claim waits for the transaction (it
    /// holds the key's index entry) and then replays; so keep the action
    /// short.
    ///
    /// # Errors
    ///
    /// As [`RunInTransaction::run_in_transaction`].
    fn run_in_one_transaction(
        &self,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket, &mut Client) -> ActionResult,
    ) -> Result<RunOutcome, Error>;

    /// [`RunInTransaction::run_in_one_transaction`] for a batch of
    /// requests in one transaction, one commit for all
    /// ([`Engine::run_batch_with_one_transaction`]): `action` gets each
    /// executed request's index in `requests`. A request that ends in an
    /// error is undone alone, its slot holds the error, and the others
    /// commit. Keep the batch bounded and its actions short: the
    /// transaction holds each claimed key's index entry, so two batches that claim the same keys in opposite orders can deadlock; PostgreSQL then fails one request of one batch, which is answered as that request's error until it ends.
    ///
    /// # Errors
    ///
    /// [`Error::WrongStorage`] when the engine's storage is not a
    /// [`PostgresStore`]. Opening or committing the transaction, or a transaction
    /// that can no longer be used: nothing of the batch is kept.
    fn run_batch_in_one_transaction(
        &self,
        requests: &[BeginRequest],
        action: impl FnMut(usize, &Ticket, &mut Client) -> ActionResult,
    ) -> Result<Vec<Result<RunOutcome, Error>>, Error>;
}

/// The engine's own store, for its business transactions.
fn own_store(engine: &Engine) -> Result<&PostgresStore, Error> {
    engine
        .storage::<PostgresStore>()
        .ok_or(Error::WrongStorage("a PostgresStore"))
}

impl RunInTransaction for Engine {
    fn run_in_transaction(
        &self,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket, &mut Client) -> ActionResult,
    ) -> Result<RunOutcome, Error> {
        let store = own_store(self)?;
        self.run_with_transaction(
            request,
            || store.begin_transaction(),
            |ticket, tx| tx.with_connection(|client| action(ticket, client)),
        )
    }

    fn run_in_one_transaction(
        &self,
        request: &BeginRequest,
        action: impl FnOnce(&Ticket, &mut Client) -> ActionResult,
    ) -> Result<RunOutcome, Error> {
        let store = own_store(self)?;
        self.run_with_one_transaction(
            request,
            || store.begin_transaction(),
            |ticket, tx| tx.with_connection(|client| action(ticket, client)),
        )
    }

    fn run_batch_in_one_transaction(
        &self,
        requests: &[BeginRequest],
        mut action: impl FnMut(usize, &Ticket, &mut Client) -> ActionResult,
    ) -> Result<Vec<Result<RunOutcome, Error>>, Error> {
        let store = own_store(self)?;
        self.run_batch_with_one_transaction(
            requests,
            || store.begin_transaction(),
            |index, ticket, tx| tx.with_connection(|client| action(index, ticket, client)),
            BatchErrors::SkipRequest,
        )
    }
}

fn get(c: &mut PgConnection, key: &RecordKey) -> Result<Option<StoredRecord>, StoreError> {
    // No stored key holds a NUL character (PostgreSQL text cannot), so
    // such a key surely has no record.
    if [&key.scope, &key.biz_type, &key.idem_key]
        .iter()
        .any(|part| part.contains('\0'))
    {
        return Ok(None);
    }
    let row = c
        .client
        .query_opt(&c.prepared.get, &[&key.scope, &key.biz_type, &key.idem_key])
        .map_err(map_err)?;
    row.as_ref().map(decode_row).transpose()
}

// ---------------------------------------------------------------------------
// Schema migrations.

/// The schema's version: 0 when it has no version table yet.
fn schema_version(client: &mut Client, schema: &str) -> Result<usize, StoreError> {
    let table = format!("{}.{}", quote(schema), quote(VERSION_TABLE));
    let exists: Option<String> = client
        .query_one("SELECT to_regclass($1)::text", &[&table])
        .map_err(map_err)?
        .try_get(0)
        .map_err(map_err)?;
    if exists.is_none() {
        return Ok(0);
    }
    let version: i32 = client
        .query_one(
            &format!("SELECT COALESCE(MAX(version), 0) FROM {table}"),
            &[],
        )
        .map_err(map_err)?
        .try_get(0)
        .map_err(map_err)?;
    usize::try_from(version)
        .map_err(|_| StoreError::Internal(format!("negative schema version {version}")))
}

fn migrate(client: &mut Client, schema: &str) -> Result<(), StoreError> {
    let target = MIGRATIONS.len();
    let check = |version: usize| {
        if version > target {
            Err(StoreError::Internal(format!(
                "schema {schema} has version {version}; this build knows versions up to {target}"
            )))
        } else {
            Ok(version)
        }
    };
    if check(schema_version(client, schema)?)? == target {
        return Ok(());
    }
    let mut tx = client.transaction().map_err(map_err)?;
    // Every host that migrates this schema takes the same lock first; it is
    // released when the transaction ends, however it ends.
    let lock = format!("idem migrations of schema {schema}");
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
        &[&lock],
    )
    .map_err(map_err)?;
    let quoted = quote(schema);
    tx.batch_execute(&format!(
        "CREATE SCHEMA IF NOT EXISTS {quoted};
        CREATE TABLE IF NOT EXISTS {quoted}.{version_table} (
            version INTEGER PRIMARY KEY,
            applied_at TIMESTAMPTZ NOT NULL DEFAULT now());",
        version_table = quote(VERSION_TABLE)
    ))
    .map_err(map_err)?;
    // Another host may have migrated between the check and the lock.
    let current: i32 = tx
        .query_one(
            &format!(
                "SELECT COALESCE(MAX(version), 0) FROM {quoted}.{}",
                quote(VERSION_TABLE)
            ),
            &[],
        )
        .map_err(map_err)?
        .try_get(0)
        .map_err(map_err)?;
    let current = check(
        usize::try_from(current)
            .map_err(|_| StoreError::Internal(format!("negative schema version {current}")))?,
    )?;
    for (index, sql) in MIGRATIONS.iter().enumerate().skip(current) {
        tx.batch_execute(&sql.replace("{schema}", &quoted))
            .map_err(map_err)?;
        let version = i32::try_from(index + 1)
            .map_err(|_| StoreError::Internal("too many migrations".to_owned()))?;
        tx.execute(
            &format!(
                "INSERT INTO {quoted}.{} (version) VALUES ($1)",
                quote(VERSION_TABLE)
            ),
            &[&version],
        )
        .map_err(map_err)?;
    }
    tx.commit().map_err(map_err)
}

// ---------------------------------------------------------------------------
// Encoding and decoding.

/// A record as PostgreSQL values ([`RecordColumns`]): numbers above
/// `i64::MAX` and text with a NUL character are refused; `response` and
/// `failure` are JSON, as in the SQLite store; `result_ref` is `bytea`.
struct EncodedRecord<'a> {
    columns: RecordColumns<'a>,
    result_ref: Option<&'a [u8]>,
}

impl<'a> EncodedRecord<'a> {
    fn new(record: &'a StoredRecord) -> Result<Self, StoreError> {
        check_text(&record.key.scope, "scope")?;
        check_text(&record.key.biz_type, "biz_type")?;
        check_text(&record.key.idem_key, "idem_key")?;
        check_text(&record.fingerprint, "fingerprint")?;
        Ok(Self {
            columns: RecordColumns::new(record, "the largest integer PostgreSQL's BIGINT stores")?,
            result_ref: record.result_ref.as_deref().map(str::as_bytes),
        })
    }

    /// Parameters `$1` to `$16` of the insert and swap statements.
    fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        let c = &self.columns;
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
            &self.result_ref,
            &c.response,
            &c.failure,
        ]
    }
}

/// PostgreSQL text cannot hold the NUL character; refuse it by name rather
/// than with the server's encoding error.
fn check_text(value: &str, field: &str) -> Result<(), StoreError> {
    if value.contains('\0') {
        return Err(StoreError::Rejected(format!(
            "{field} contains a NUL character, which PostgreSQL text cannot hold"
        )));
    }
    Ok(())
}

/// Reads column `index` of a row, naming it in any error.
fn column<T: FromSqlOwned>(row: &postgres::Row, index: usize) -> Result<T, StoreError> {
    row.try_get(index).map_err(|e| {
        StoreError::Internal(format!("column {} cannot be read: {e}", column_name(index)))
    })
}

/// Decodes one row selected with [`COLUMNS`].
fn decode_row(row: &postgres::Row) -> Result<StoredRecord, StoreError> {
    let result_ref = column::<Option<Vec<u8>>>(row, 14)?
        .map(|bytes| {
            String::from_utf8(bytes)
                .map_err(|e| StoreError::Internal(format!("column result_ref is not UTF-8: {e}")))
        })
        .transpose()?;
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
        result_ref,
        response: column(row, 15)?,
        failure: column(row, 16)?,
    }
    .into_record()
}

#[cfg(test)]
mod tests;
