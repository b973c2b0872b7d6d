//! Tests of the SQLite store: the conformance suite (plain, with group
//! commit, and inside one open transaction), then what only SQLite has.

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use idem_engine::testing::{BIZ, T0, candidate, insert, insert_with, key, rich_record};
use idem_engine::types::{InsertOutcome, RecordKey, Status, SwapOutcome};
use idem_engine::{Savepoint, Storage, StoreError};
use rusqlite::Connection;

use super::{SqliteOptions, SqliteStore, SqliteTransaction, Synchronous, Turns};

fn sqlite_at(path: &Path) -> SqliteStore {
    SqliteStore::open(path, SqliteOptions::default()).unwrap()
}

fn sqlite_store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = sqlite_at(&dir.path().join("idem.db"));
    (dir, store)
}

fn sqlite_group_store() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions {
        group_commit: true,
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(dir.path().join("idem.db"), options).unwrap();
    (dir, store)
}

/// A conformance case on a fresh store; the file must be intact after.
fn with_sqlite(case: fn(&dyn Storage)) {
    let (_dir, store) = sqlite_store();
    case(&store);
    assert!(store.integrity_check().unwrap());
}

/// The same with group commit: every write goes through the queue.
fn with_group_commit(case: fn(&dyn Storage)) {
    let (_dir, store) = sqlite_group_store();
    case(&store);
    assert!(store.integrity_check().unwrap());
}

/// The same inside one open transaction, rolled back after: nothing stays.
fn with_transaction(case: fn(&dyn Storage)) {
    let (_dir, store) = sqlite_store();
    let tx = store.begin_transaction().unwrap();
    case(&tx);
    tx.rollback().unwrap();
    assert_eq!(
        store
            .count_by_status()
            .unwrap()
            .iter()
            .map(|c| c.1)
            .sum::<u64>(),
        0
    );
}

mod sqlite_backend {
    idem_engine::storage_conformance!(super::with_sqlite);
}

mod sqlite_group_commit_backend {
    idem_engine::storage_conformance!(super::with_group_commit);
}

mod sqlite_transaction_backend {
    idem_engine::storage_conformance!(super::with_transaction);
}

#[test]
fn sqlite_keeps_nul_characters_in_keys() {
    let (_dir, s) = sqlite_store();
    let k = RecordKey::new("tenant\u{0}1", BIZ, "k\u{0}");
    let r = insert(&s, &candidate(k.clone()));
    assert_eq!(s.get(&k).unwrap(), Some(r));
    assert_eq!(s.get(&key("k")).unwrap(), None);
}

#[test]
fn sqlite_stores_are_clone_send_sync_static() {
    fn check<T: Clone + Send + Sync + 'static>() {}
    fn check_storage<T: Storage>() {}
    check::<SqliteStore>();
    check_storage::<SqliteStore>();
    check_storage::<SqliteTransaction>();
}

// ---------------------------------------------------------------------------
// SQLite only.

fn raw(store: &SqliteStore) -> rusqlite::Connection {
    rusqlite::Connection::open(store.path()).unwrap()
}

fn business_table(store: &SqliteStore) {
    raw(store)
        .execute_batch("CREATE TABLE orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL)")
        .unwrap();
}

fn order_count(store: &SqliteStore) -> i64 {
    raw(store)
        .query_row("SELECT COUNT(*) FROM orders", [], |r| r.get(0))
        .unwrap()
}

#[test]
fn sqlite_racing_processes_insert_each_key_exactly_once() {
    const THREADS: usize = 8;
    const KEYS: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("race.db");
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let path = path.clone();
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                let options = SqliteOptions {
                    pool_size: 2,
                    busy_timeout: Duration::from_secs(30),
                    ..SqliteOptions::default()
                };
                // Each thread opens its own store, like a separate process.
                let store = SqliteStore::open(&path, options).unwrap();
                barrier.wait();
                let mut won = Vec::new();
                for i in 0..KEYS {
                    // Threads walk the keys from different starting points.
                    let k = (i + t * 25) % KEYS;
                    let mut c = candidate(key(&format!("k{k}")));
                    c.fencing_token = t as u64;
                    match store.insert_if_absent(&c).unwrap() {
                        InsertOutcome::Inserted(r) => {
                            assert_eq!(r.fencing_token, t as u64);
                            won.push((k, r.id));
                        }
                        InsertOutcome::Existing(r) => assert_eq!(r.key, c.key),
                    }
                }
                won
            })
        })
        .collect();
    let mut winners = vec![0u32; KEYS];
    let mut ids = Vec::new();
    for h in handles {
        for (k, id) in h.join().unwrap() {
            winners[k] += 1;
            ids.push(id);
        }
    }
    assert!(winners.iter().all(|&w| w == 1), "{winners:?}");
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), KEYS);

    let store = sqlite_at(&path);
    for k in 0..KEYS {
        let r = store.get(&key(&format!("k{k}"))).unwrap().unwrap();
        assert!(ids.binary_search(&r.id).is_ok());
    }
    assert!(store.integrity_check().unwrap());
}

#[test]
fn sqlite_transaction_rollback_leaves_neither_write() {
    let (_dir, store) = sqlite_store();
    business_table(&store);
    let r = insert(&store, &candidate(key("k")));

    let tx = store.begin_transaction().unwrap();
    tx.with_connection(|c| c.execute("INSERT INTO orders VALUES ('o-1', 100)", []))
        .unwrap()
        .unwrap();
    let mut done = r.clone();
    done.status = Status::Succeeded;
    done.revision = 2;
    done.result_ref = Some("o-1".to_owned());
    assert_eq!(tx.compare_and_swap(1, &done).unwrap(), SwapOutcome::Swapped);
    // The transaction sees its own writes.
    assert_eq!(tx.get(&key("k")).unwrap(), Some(done));
    let n: i64 = tx
        .with_connection(|c| c.query_row("SELECT COUNT(*) FROM orders", [], |r| r.get(0)))
        .unwrap()
        .unwrap();
    assert_eq!(n, 1);
    tx.rollback().unwrap();

    assert_eq!(store.get(&key("k")).unwrap(), Some(r));
    assert_eq!(order_count(&store), 0);
}

#[test]
fn sqlite_transaction_commit_leaves_both_writes() {
    let (_dir, store) = sqlite_store();
    business_table(&store);
    let r = insert(&store, &candidate(key("k")));

    let tx = store.begin_transaction().unwrap();
    tx.with_connection(|c| c.execute("INSERT INTO orders VALUES ('o-1', 100)", []))
        .unwrap()
        .unwrap();
    let mut done = r.clone();
    done.status = Status::Succeeded;
    done.revision = 2;
    assert_eq!(tx.compare_and_swap(1, &done).unwrap(), SwapOutcome::Swapped);
    // Nothing is visible outside before the commit.
    assert_eq!(
        raw(&store)
            .query_row("SELECT COUNT(*) FROM orders", [], |r| r.get::<_, i64>(0))
            .unwrap(),
        0
    );
    tx.commit().unwrap();

    assert_eq!(store.get(&key("k")).unwrap(), Some(done));
    assert_eq!(order_count(&store), 1);
}

#[test]
fn sqlite_rollback_to_savepoint_undoes_only_what_came_after_it() {
    use idem_engine::Transaction as _;
    let (_dir, store) = sqlite_store();
    business_table(&store);
    let tx = store.begin_transaction().unwrap();
    let claim = insert(&tx, &candidate(key("k")));
    tx.savepoint(Savepoint::Action).unwrap();
    tx.with_connection(|c| c.execute("INSERT INTO orders VALUES ('o-1', 100)", []))
        .unwrap()
        .unwrap();
    // A failed statement after the savepoint does not end the transaction.
    assert!(
        tx.with_connection(|c| c.execute("INSERT INTO orders VALUES ('o-1', 1)", []))
            .unwrap()
            .is_err()
    );
    tx.rollback_to_savepoint(Savepoint::Action).unwrap();
    let mut done = claim.clone();
    done.status = Status::Failed;
    done.revision = 2;
    assert_eq!(tx.compare_and_swap(1, &done).unwrap(), SwapOutcome::Swapped);
    tx.commit().unwrap();
    assert_eq!(store.get(&key("k")).unwrap(), Some(done));
    assert_eq!(order_count(&store), 0);
}

#[test]
fn sqlite_savepoints_nest_and_a_release_keeps_what_was_written() {
    use idem_engine::Transaction as _;
    let (_dir, store) = sqlite_store();
    business_table(&store);
    let order = |id: &str| {
        let sql = format!("INSERT INTO orders VALUES ('{id}', 1)");
        move |c: &Connection| c.execute(&sql, []).map(drop)
    };
    let tx = store.begin_transaction().unwrap();
    // A request that is kept: its marks are released, its writes stay.
    tx.savepoint(Savepoint::Request).unwrap();
    insert(&tx, &candidate(key("kept")));
    tx.savepoint(Savepoint::Action).unwrap();
    tx.with_connection(order("o-kept")).unwrap().unwrap();
    tx.release_savepoint(Savepoint::Request).unwrap();
    // A request that is undone: back to its own mark, past its action's.
    tx.savepoint(Savepoint::Request).unwrap();
    insert(&tx, &candidate(key("undone")));
    tx.savepoint(Savepoint::Action).unwrap();
    tx.with_connection(order("o-undone")).unwrap().unwrap();
    tx.rollback_to_savepoint(Savepoint::Request).unwrap();
    tx.release_savepoint(Savepoint::Request).unwrap();
    // Both marks are gone now.
    assert!(matches!(
        tx.rollback_to_savepoint(Savepoint::Action),
        Err(StoreError::Internal(_))
    ));
    tx.commit().unwrap();
    assert!(store.get(&key("kept")).unwrap().is_some());
    assert_eq!(store.get(&key("undone")).unwrap(), None);
    assert_eq!(order_count(&store), 1);
}

#[test]
fn sqlite_dropped_transaction_rolls_back_and_frees_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions {
        pool_size: 1,
        busy_timeout: Duration::from_millis(500),
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(dir.path().join("idem.db"), options).unwrap();
    {
        let tx = store.begin_transaction().unwrap();
        insert(&tx, &candidate(key("dropped")));
    }
    // The only connection is back, outside any transaction.
    assert_eq!(store.get(&key("dropped")).unwrap(), None);
    insert(&store, &candidate(key("after")));

    // A transaction whose business write failed is still rolled back.
    let tx = store.begin_transaction().unwrap();
    insert(&tx, &candidate(key("failed")));
    let err = tx
        .with_connection(|c| c.execute("INSERT INTO no_such_table VALUES (1)", []))
        .unwrap();
    assert!(err.is_err());
    drop(tx);
    assert_eq!(store.get(&key("failed")).unwrap(), None);
    let tx = store.begin_transaction().unwrap();
    tx.commit().unwrap();
    assert!(store.get(&key("after")).unwrap().is_some());
}

#[test]
fn sqlite_transaction_refuses_to_continue_once_ended() {
    let (_dir, store) = sqlite_store();
    let tx = store.begin_transaction().unwrap();
    insert(&tx, &candidate(key("k")));
    tx.with_connection(|c| c.execute_batch("ROLLBACK"))
        .unwrap()
        .unwrap();
    // Anything more would run outside the transaction and commit at once.
    assert!(matches!(
        tx.insert_if_absent(&candidate(key("k2"))),
        Err(StoreError::Internal(_))
    ));
    assert!(matches!(
        tx.with_connection(|_| ()),
        Err(StoreError::Internal(_))
    ));
    assert!(matches!(tx.commit(), Err(StoreError::Internal(_))));
    assert_eq!(store.get(&key("k")).unwrap(), None);
    assert_eq!(store.get(&key("k2")).unwrap(), None);
}

#[test]
fn sqlite_fresh_file_migrations_race_safely() {
    for round in 0..10 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("fresh-{round}.db"));
        let barrier = Arc::new(Barrier::new(4));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let path = path.clone();
                let barrier = Arc::clone(&barrier);
                thread::spawn(move || {
                    barrier.wait();
                    SqliteStore::open(&path, SqliteOptions::default())
                })
            })
            .collect();
        let stores: Vec<SqliteStore> = handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect();
        let version: i64 = raw(&stores[0])
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, 3);
        let r = insert(&stores[1], &candidate(key("k")));
        assert_eq!(stores[3].get(&key("k")).unwrap(), Some(r));
        assert!(stores[2].integrity_check().unwrap());
    }
}

/// The schema files are the one copy that the Rust store compiles in and
/// the Node and Python packages ship: `schema/` holds `1.sql` … `N.sql`,
/// each one entry of `MIGRATIONS`, and nothing else, so a version added as
/// a file reaches every store or fails here. No comment line holds a `;`:
/// the Python store runs a version statement by statement, split at `;`.
#[test]
fn sqlite_schema_files_are_the_migrations_every_store_runs() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("schema");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort_by_key(|n| {
        n.trim_end_matches(".sql")
            .parse::<usize>()
            .unwrap_or(usize::MAX)
    });
    let expected: Vec<String> = (1..=super::MIGRATIONS.len())
        .map(|v| format!("{v}.sql"))
        .collect();
    assert_eq!(names, expected);
    for (name, migration) in names.iter().zip(super::MIGRATIONS) {
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        assert_eq!(&text, migration, "{name}");
        for line in text.lines().filter(|l| l.trim_start().starts_with("--")) {
            assert!(!line.contains(';'), "{name}: a comment holds a ';': {line}");
        }
    }
}

#[test]
fn sqlite_reopen_keeps_records_and_schema() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let r = {
        let store = sqlite_at(&path);
        assert_eq!(store.path(), path);
        insert(&store, &rich_record(key("k")))
    };
    let store = SqliteStore::open(
        &path,
        SqliteOptions {
            synchronous: Synchronous::Full,
            ..SqliteOptions::default()
        },
    )
    .unwrap();
    assert_eq!(store.get(&key("k")).unwrap(), Some(r));
    let mode: String = raw(&store)
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    assert!(store.integrity_check().unwrap());
}

#[test]
fn sqlite_rows_written_by_schema_version_1_are_read_after_the_upgrade() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    // A version-1 database: a row whose byte strings are arrays of numbers
    // (serde's JSON of the host types, as version 1 wrote), and the
    // version number 1.
    let record = insert(&sqlite_at(&path), &rich_record(key("k")));
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute(
            "UPDATE idempotency_record SET response = ?1, failure = ?2",
            rusqlite::params![
                serde_json::to_vec(&record.response).unwrap(),
                serde_json::to_vec(&record.failure).unwrap()
            ],
        )
        .unwrap();
        let legacy: Vec<u8> = conn
            .query_row("SELECT response FROM idempotency_record", [], |r| r.get(0))
            .unwrap();
        assert!(legacy.starts_with(br#"{"status":201,"headers":[["content-type",[97,"#));
        conn.execute_batch("PRAGMA user_version = 1").unwrap();
    }
    let store = sqlite_at(&path);
    let version: i64 = raw(&store)
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, 3);
    assert_eq!(store.get(&key("k")).unwrap(), Some(record.clone()));
    // A write stores the new form, read back the same.
    let mut next = record.clone();
    next.revision += 1;
    assert_eq!(
        store.compare_and_swap(record.revision, &next).unwrap(),
        SwapOutcome::Swapped
    );
    let column: Vec<u8> = raw(&store)
        .query_row("SELECT response FROM idempotency_record", [], |r| r.get(0))
        .unwrap();
    assert!(
        column.starts_with(
            br#"{"status":201,"headers":[["content-type","YXBwbGljYXRpb24vanNvbg=="]"#
        )
    );
    assert_eq!(store.get(&key("k")).unwrap(), Some(next));
}

/// How many temporary b-trees (`OpenEphemeral`) a statement builds each
/// time it runs.
fn ephemeral_tables(conn: &Connection, sql: &str) -> usize {
    let mut stmt = conn.prepare(&format!("EXPLAIN {sql}")).unwrap();
    // Unbound parameters are NULL: enough to compile the program.
    let mut rows = stmt.raw_query();
    let mut count = 0;
    while let Some(row) = rows.next().unwrap() {
        if row.get::<_, String>(1).unwrap() == "OpenEphemeral" {
            count += 1;
        }
    }
    count
}

#[test]
fn sqlite_version_3_keeps_rows_and_ids_and_writes_without_temporary_tables() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    // A version-2 database holding ids 1 to 3, the last one deleted since
    // (the sweeper's work): its AUTOINCREMENT counter is above every id.
    {
        let conn = Connection::open(&path).unwrap();
        for sql in &super::MIGRATIONS[..2] {
            conn.execute_batch(sql).unwrap();
        }
        conn.execute_batch("PRAGMA user_version = 2").unwrap();
        for (i, status) in ["succeeded", "processing", "failed"].iter().enumerate() {
            conn.execute(
                "INSERT INTO idempotency_record (scope_key, biz_type, idem_key, request_hash,
                    fingerprint_version, status, fencing_token, revision, attempts, lease_until,
                    created_at, updated_at, expires_at)
                 VALUES ('scope', ?1, ?2, ?4, 1, ?3, 1, 1, 1, 5, 1, 1, 9)",
                rusqlite::params![BIZ, format!("k{i}"), status, "ab".repeat(32)],
            )
            .unwrap();
        }
        conn.execute("DELETE FROM idempotency_record WHERE idem_key = 'k2'", [])
            .unwrap();
        // Version 2 builds temporary tables: the check below can fail.
        assert!(ephemeral_tables(&conn, super::SQL_INSERT) > 0);
    }
    let store = sqlite_at(&path);
    let conn = raw(&store);
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, 3);
    let rows: Vec<(i64, String, String)> = conn
        .prepare("SELECT id, idem_key, status FROM idempotency_record ORDER BY id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        rows,
        [
            (1, "k0".to_owned(), "succeeded".to_owned()),
            (2, "k1".to_owned(), "processing".to_owned())
        ]
    );
    // The counter came along: the deleted id 3 is not given again.
    let fresh = insert(&store, &candidate(key("new")));
    assert_eq!(fresh.id, 4);
    // The unique key, the status check and the indexes are all there.
    let taken = store.insert_if_absent(&candidate(RecordKey::new("scope", BIZ, "k0")));
    assert!(matches!(taken, Ok(InsertOutcome::Existing(_))), "{taken:?}");
    let refused = conn.execute("UPDATE idempotency_record SET status = 'paused'", []);
    assert!(refused.is_err(), "the status check is gone");
    let indexes: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'index' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        indexes,
        [
            "idempotency_record_outcome_unknown",
            "idempotency_record_stale_processing",
            "idempotency_record_sweep",
            "sqlite_autoindex_idempotency_record_1"
        ]
    );
    let plan = conn
        .prepare(&format!("EXPLAIN QUERY PLAN {}", super::SQL_DELETE_EXPIRED))
        .unwrap()
        .query_map(rusqlite::params![10, 10], |r| r.get::<_, String>(3))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
        .join("; ");
    assert!(plan.contains("idempotency_record_sweep"), "{plan}");
    // What version 3 is for: no temporary b-tree per write. (The sweep's
    // `id IN (SELECT …)` keeps its one, per batch of expired rows.)
    for sql in [super::SQL_INSERT, super::SQL_SWAP] {
        assert_eq!(ephemeral_tables(&conn, sql), 0, "{sql}");
    }
    assert!(store.integrity_check().unwrap());
}

#[test]
fn sqlite_newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    drop(sqlite_at(&path));
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("PRAGMA user_version = 99")
        .unwrap();
    match SqliteStore::open(&path, SqliteOptions::default()) {
        Err(StoreError::Internal(msg)) => assert!(msg.contains("99"), "{msg}"),
        other => panic!("expected Internal, got {other:?}"),
    }
}

#[test]
fn sqlite_unopenable_path_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    // A directory is not a database file.
    assert!(SqliteStore::open(dir.path(), SqliteOptions::default()).is_err());
    // Nor is a file inside a missing directory.
    assert!(matches!(
        SqliteStore::open(dir.path().join("missing/idem.db"), SqliteOptions::default()),
        Err(StoreError::Unavailable(_))
    ));
    // Nor a file that is not SQLite.
    let junk = dir.path().join("junk.db");
    std::fs::write(&junk, vec![0x5a; 8192]).unwrap();
    assert!(SqliteStore::open(&junk, SqliteOptions::default()).is_err());
}

#[test]
fn sqlite_invalid_options_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let zero_pool = SqliteOptions {
        pool_size: 0,
        ..SqliteOptions::default()
    };
    assert!(matches!(
        SqliteStore::open(&path, zero_pool),
        Err(StoreError::Rejected(_))
    ));
    let forever = SqliteOptions {
        busy_timeout: Duration::from_secs(u64::MAX),
        ..SqliteOptions::default()
    };
    assert!(matches!(
        SqliteStore::open(&path, forever),
        Err(StoreError::Rejected(_))
    ));
    // A zero busy timeout is allowed.
    let impatient = SqliteOptions {
        busy_timeout: Duration::ZERO,
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(&path, impatient).unwrap();
    assert_eq!(store.get(&key("k")).unwrap(), None);
}

#[test]
fn sqlite_undecodable_row_is_internal_naming_the_column() {
    let cases = [
        (
            "response",
            "UPDATE idempotency_record SET response = x'00ff'",
        ),
        (
            "failure",
            "UPDATE idempotency_record SET failure = '{\"code\":1}'",
        ),
        ("revision", "UPDATE idempotency_record SET revision = -1"),
        (
            "attempts",
            "UPDATE idempotency_record SET attempts = 4294967296",
        ),
        (
            "lease_until",
            "UPDATE idempotency_record SET lease_until = 'soon'",
        ),
        (
            "status",
            "PRAGMA ignore_check_constraints = ON; UPDATE idempotency_record SET status = 'paused'",
        ),
    ];
    for (column, sql) in cases {
        let (_dir, store) = sqlite_store();
        insert_with(&store, key("k"), Status::OutcomeUnknown, Some(T0), T0, None);
        raw(&store).execute_batch(sql).unwrap();
        let mut results = vec![
            store.get(&key("k")).map(|_| ()),
            store.insert_if_absent(&candidate(key("k"))).map(|_| ()),
        ];
        if column == "status" {
            // The scan selects by status, so it never reads this row.
            results.push(store.count_by_status().map(|_| ()));
        } else {
            results.push(store.list_stale(BIZ, T0, 10).map(|_| ()));
        }
        for result in results {
            match result {
                Err(StoreError::Internal(msg)) => {
                    assert!(msg.contains(column), "{column}: {msg}")
                }
                other => panic!("{column}: expected Internal, got {other:?}"),
            }
        }
    }
}

/// Sixteen threads write through one store at once: every write takes its
/// turn and succeeds, and each thread's records are all there. (That the
/// turns cut the wait is measured by the bench suite's proxy part: the
/// p99 of first requests at 32 connections.)
#[test]
fn writers_of_one_store_take_turns_and_all_succeed() {
    const THREADS: usize = 16;
    const WRITES: usize = 100;
    let (_dir, store) = sqlite_store();
    let barrier = Barrier::new(THREADS);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (store, barrier) = (&store, &barrier);
            s.spawn(move || {
                barrier.wait();
                for i in 0..WRITES {
                    let r = insert(store, &candidate(key(&format!("t{t}-{i}"))));
                    let mut next = r.clone();
                    next.revision = 2;
                    let swapped = store.compare_and_swap(1, &next);
                    assert!(matches!(swapped, Ok(SwapOutcome::Swapped)), "{swapped:?}");
                }
            });
        }
    });
    let total: u64 = store.count_by_status().unwrap().iter().map(|c| c.1).sum();
    assert_eq!(total, (THREADS * WRITES) as u64);
}

/// A writer asleep on the turn is woken when the turn is handed back, not
/// left to its timeout: the hand-back wakes a thread only when one waits
/// (it counts them), and this one does.
#[test]
fn a_returned_turn_wakes_the_writer_that_waits_for_it() {
    const PATIENCE: Duration = Duration::from_secs(30);
    let turns = Arc::new(Turns::default());
    let held = turns.take(PATIENCE).unwrap();
    thread::scope(|s| {
        let waiter = s.spawn(|| {
            let started = Instant::now();
            let turn = turns.take(PATIENCE);
            (turn.is_some(), started.elapsed())
        });
        // Hand the turn back once the waiter is asleep on it.
        while turns.state.lock().unwrap().waiting == 0 {
            thread::yield_now();
        }
        drop(held);
        let (got, waited) = waiter.join().unwrap();
        assert!(got, "the waiter never got the turn");
        assert!(
            waited < PATIENCE / 2,
            "the waiter slept {waited:?}: it was not woken"
        );
    });
    assert_eq!(turns.state.lock().unwrap().waiting, 0);
    assert!(!turns.state.lock().unwrap().busy);
}

/// A write that cannot get its turn within the busy timeout (another write
/// of this process holds it) is unavailable, and writes nothing.
#[test]
fn a_write_without_a_turn_within_the_busy_timeout_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions {
        busy_timeout: Duration::from_millis(30),
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(dir.path().join("idem.db"), options).unwrap();
    let held = store.inner.writers.take(Duration::from_secs(1)).unwrap();
    assert!(matches!(
        store.insert_if_absent(&candidate(key("k"))),
        Err(StoreError::Unavailable(_))
    ));
    drop(held);
    assert_eq!(store.get(&key("k")).unwrap(), None);
    insert(&store, &candidate(key("k")));
}

#[test]
fn sqlite_held_write_lock_is_unavailable_not_absent() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions {
        busy_timeout: Duration::from_millis(50),
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(dir.path().join("idem.db"), options).unwrap();
    let r = insert(&store, &candidate(key("k")));

    let blocker = raw(&store);
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    assert!(matches!(
        store.insert_if_absent(&candidate(key("k2"))),
        Err(StoreError::Unavailable(_))
    ));
    let mut next = r.clone();
    next.revision = 2;
    assert!(matches!(
        store.compare_and_swap(1, &next),
        Err(StoreError::Unavailable(_))
    ));
    assert!(matches!(
        store.delete_expired(u64::MAX, 10),
        Err(StoreError::Unavailable(_))
    ));
    // WAL readers are not blocked by the writer.
    assert_eq!(store.get(&key("k")).unwrap(), Some(r));
    blocker.execute_batch("ROLLBACK").unwrap();
    insert(&store, &candidate(key("k2")));
}

#[test]
fn sqlite_exhausted_pool_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions {
        pool_size: 1,
        busy_timeout: Duration::from_millis(50),
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(dir.path().join("idem.db"), options).unwrap();
    let tx = store.begin_transaction().unwrap();
    assert!(matches!(
        store.get(&key("k")),
        Err(StoreError::Unavailable(_))
    ));
    tx.rollback().unwrap();
    assert_eq!(store.get(&key("k")).unwrap(), None);
}

#[test]
fn sqlite_transaction_holds_the_write_lock_until_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.db");
    let options = SqliteOptions {
        busy_timeout: Duration::from_millis(50),
        ..SqliteOptions::default()
    };
    let store = SqliteStore::open(&path, options).unwrap();
    let other = SqliteStore::open(&path, options).unwrap();
    let tx = store.begin_transaction().unwrap();
    insert(&tx, &candidate(key("k")));
    // Another writer waits, then gives up; readers see the last commit.
    assert!(matches!(
        other.insert_if_absent(&candidate(key("k"))),
        Err(StoreError::Unavailable(_))
    ));
    assert_eq!(other.get(&key("k")).unwrap(), None);
    tx.commit().unwrap();
    match other.insert_if_absent(&candidate(key("k"))).unwrap() {
        InsertOutcome::Existing(r) => assert_eq!(r.id, 1),
        inserted => panic!("expected Existing, got {inserted:?}"),
    }
}

#[test]
fn sqlite_error_mapping() {
    use rusqlite::ffi;
    let failure = |code| rusqlite::Error::SqliteFailure(ffi::Error::new(code), None);
    for code in [
        ffi::SQLITE_BUSY,
        ffi::SQLITE_LOCKED,
        ffi::SQLITE_IOERR,
        ffi::SQLITE_IOERR_FSYNC,
        ffi::SQLITE_CANTOPEN,
        ffi::SQLITE_FULL,
        ffi::SQLITE_PROTOCOL,
    ] {
        assert!(
            matches!(super::map_err(failure(code)), StoreError::Unavailable(_)),
            "{code}"
        );
    }
    for code in [
        ffi::SQLITE_CONSTRAINT,
        ffi::SQLITE_CONSTRAINT_UNIQUE,
        ffi::SQLITE_TOOBIG,
    ] {
        assert!(
            matches!(super::map_err(failure(code)), StoreError::Rejected(_)),
            "{code}"
        );
    }
    for e in [
        failure(ffi::SQLITE_CORRUPT),
        failure(ffi::SQLITE_NOTADB),
        rusqlite::Error::QueryReturnedNoRows,
        rusqlite::Error::InvalidColumnIndex(3),
    ] {
        assert!(matches!(super::map_err(e), StoreError::Internal(_)));
    }
}

#[test]
fn sqlite_scans_use_their_partial_indexes() {
    let (_dir, store) = sqlite_store();
    let conn = raw(&store);
    let plan = |sql: &str| -> String {
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let params = (0..stmt.parameter_count()).map(|_| 0i64);
        let rows = stmt
            .query_map(rusqlite::params_from_iter(params), |r| {
                r.get::<_, String>(3)
            })
            .unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("\n")
    };
    let sweep = plan(super::SQL_DELETE_EXPIRED);
    assert!(sweep.contains("idempotency_record_sweep"), "{sweep}");
    let stale = plan(super::SQL_LIST_STALE);
    assert!(
        stale.contains("idempotency_record_stale_processing"),
        "{stale}"
    );
    assert!(
        stale.contains("idempotency_record_outcome_unknown"),
        "{stale}"
    );
}

// ---------------------------------------------------------------------------
// Group commit.

/// Many threads claim the same keys and swap them at once through group
/// commit: the unique constraint still lets exactly one claim per key win,
/// every swap expecting the same revision but one is stale, and every
/// answer matches what the database holds after the commits.
#[test]
fn group_commit_keeps_one_winner_per_key_under_concurrency() {
    const THREADS: usize = 16;
    const KEYS: usize = 50;
    let (_dir, store) = sqlite_group_store();
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (store, barrier) = (store.clone(), barrier.clone());
            thread::spawn(move || {
                let (mut inserted, mut swapped) = (0, 0);
                for k in 0..KEYS {
                    barrier.wait();
                    let mut c = candidate(key(&format!("k{k}")));
                    c.fingerprint = format!("{t:064x}");
                    let current = match store.insert_if_absent(&c).unwrap() {
                        InsertOutcome::Inserted(r) => {
                            inserted += 1;
                            r
                        }
                        InsertOutcome::Existing(r) => r,
                    };
                    barrier.wait();
                    let mut next = current.clone();
                    next.revision = 2;
                    next.result_ref = Some(format!("t{t}"));
                    match store.compare_and_swap(1, &next).unwrap() {
                        SwapOutcome::Swapped => swapped += 1,
                        SwapOutcome::Stale(Some(r)) => assert_eq!(r.revision, 2),
                        SwapOutcome::Stale(None) => panic!("the record vanished"),
                    }
                }
                (inserted, swapped)
            })
        })
        .collect();
    let (mut inserted, mut swapped) = (0, 0);
    for h in handles {
        let (i, s) = h.join().unwrap();
        inserted += i;
        swapped += s;
    }
    assert_eq!(inserted, KEYS);
    assert_eq!(swapped, KEYS);
    assert!(store.integrity_check().unwrap());
}

/// A write that fails inside a group transaction fails as unavailable (as
/// would every other write of its group) and stores nothing; the queue
/// keeps working.
#[test]
fn group_commit_failure_is_unavailable_and_stores_nothing() {
    let (_dir, store) = sqlite_group_store();
    // A trigger makes one key's insert fail inside the transaction.
    raw(&store)
        .execute_batch(
            "CREATE TRIGGER refuse BEFORE INSERT ON idempotency_record
             WHEN NEW.idem_key = 'poison' BEGIN SELECT RAISE(ABORT, 'refused'); END;",
        )
        .unwrap();
    match store.insert_if_absent(&candidate(key("poison"))) {
        Err(StoreError::Unavailable(m)) => assert!(m.contains("rolled back"), "{m}"),
        other => panic!("expected unavailable, got {other:?}"),
    }
    assert_eq!(store.get(&key("poison")).unwrap(), None);
    let r = insert(&store, &candidate(key("fine")));
    assert_eq!(store.get(&key("fine")).unwrap(), Some(r));
}

/// While a group is being written, the store says a write would wait (the
/// hint async hosts use to move a call off their event loop), and says so
/// no longer once the group committed. Without group commit it never does.
#[test]
fn a_store_says_a_write_would_wait_while_a_group_is_written() {
    let (_dir, store) = sqlite_group_store();
    assert!(!store.write_would_wait());
    // The leader of the next group blocks on the write turn held here.
    let held = store.inner.writers.take(Duration::from_secs(1)).unwrap();
    let leader = {
        let store = store.clone();
        thread::spawn(move || store.insert_if_absent(&candidate(key("k"))))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !store.write_would_wait() {
        assert!(
            std::time::Instant::now() < deadline,
            "the leader never started its group"
        );
        thread::yield_now();
    }
    drop(held);
    assert!(matches!(
        leader.join().unwrap(),
        Ok(InsertOutcome::Inserted(_))
    ));
    assert!(!store.write_would_wait());

    let (_dir, plain) = sqlite_store();
    let held = plain.inner.writers.take(Duration::from_secs(1)).unwrap();
    assert!(!plain.write_would_wait());
    drop(held);
}
