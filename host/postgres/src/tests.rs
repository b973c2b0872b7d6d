//! Tests of the PostgreSQL store: the conformance suite, then what only
//! PostgreSQL has. They run against the server named by
//! `IDEM_TEST_PG_URL`. Each test works in a schema of its own, so tests run
//! in parallel on one database without seeing each other; the schema is
//! dropped when the test ends. Without the variable every test prints why it
//! was skipped and passes.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use idem_engine::testing::{BIZ, T0, candidate, insert, insert_with, key, rich_record};
use idem_engine::types::{InsertOutcome, RecordKey, Status, StoredRecord, SwapOutcome};
use idem_engine::{Savepoint, Storage, StoreError};
use postgres::Client;

use super::{PostgresOptions, PostgresStore, map_err};

/// A conformance case in a schema of its own, dropped after; skipped with
/// a printed reason when `IDEM_TEST_PG_URL` is not set.
fn with_postgres(case: fn(&dyn Storage)) {
    let Some(schema) = TestSchema::new() else {
        return;
    };
    case(&schema.store());
}

mod postgres_backend {
    idem_engine::storage_conformance!(super::with_postgres);
}

/// A conformance case inside one business transaction, rolled back after:
/// nothing it wrote is left.
fn with_pg_transaction(case: fn(&dyn Storage)) {
    let Some(schema) = TestSchema::new() else {
        return;
    };
    let store = schema.store();
    let tx = store.begin_transaction().expect("begin");
    case(&tx);
    tx.rollback().expect("rollback");
    let total: u64 = store
        .count_by_status()
        .expect("count")
        .iter()
        .map(|c| c.1)
        .sum();
    assert_eq!(total, 0);
}

mod postgres_transaction_backend {
    idem_engine::storage_conformance!(super::with_pg_transaction);
}

/// A store owned by an async task (a consumer, a server) may be dropped on
/// a runtime's thread: its connections close elsewhere, and nothing panics.
#[test]
fn a_store_dropped_on_an_async_runtime_thread_closes_without_panicking() {
    let Some(schema) = TestSchema::new() else {
        return;
    };
    let store = schema.store();
    assert_eq!(store.count_by_status().map(|c| c.len()), Ok(5));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    runtime.block_on(async move { drop(store) });
}

#[test]
fn the_postgres_store_is_clone_send_sync_static() {
    fn check<T: Clone + Send + Sync + 'static>() {}
    fn check_storage<T: Storage>() {}
    check::<PostgresStore>();
    check_storage::<PostgresStore>();
}

/// The variable that names the test server.
const URL_VAR: &str = "IDEM_TEST_PG_URL";

/// How long a test waits for the server to reach a state it set up (a
/// statement blocked on a lock, a backend gone).
const SETTLE: Duration = Duration::from_secs(20);

/// The test server's URL, or `None` after printing why the test is skipped.
pub(super) fn url() -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            eprintln!(
                "skipped: {URL_VAR} is not set, so there is no PostgreSQL server to test \
                 against (CI sets it)"
            );
            None
        }
    }
}

/// A direct connection for the test's own SQL.
pub(super) fn raw(url: &str) -> postgres::Client {
    postgres::Client::connect(url, postgres::NoTls).expect("connect to the test server")
}

use idem_engine::testing::unique_name as unique;

/// A schema of the test's own, dropped with everything in it on drop.
pub(super) struct TestSchema {
    pub url: String,
    pub name: String,
}

impl TestSchema {
    /// `None` (after printing why) when no test server is configured.
    pub fn new() -> Option<TestSchema> {
        let url = url()?;
        Some(TestSchema {
            url,
            name: unique("idem_store_test"),
        })
    }

    pub fn options(&self) -> PostgresOptions {
        PostgresOptions {
            schema: self.name.clone(),
            pool_size: 2,
            ..PostgresOptions::default()
        }
    }

    pub fn store(&self) -> PostgresStore {
        PostgresStore::connect(&self.url, self.options()).expect("connect the store")
    }

    /// A store whose connections carry their own `application_name`, so
    /// that the test can find (and kill) exactly them.
    pub fn named_store(&self, options: PostgresOptions) -> (PostgresStore, String) {
        let app = unique("idem_app");
        let url = with_param(&self.url, "application_name", &app);
        (
            PostgresStore::connect(&url, options).expect("connect the store"),
            app,
        )
    }

    pub fn table(&self) -> String {
        format!("\"{}\".idempotency_record", self.name)
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        if let Ok(mut c) = postgres::Client::connect(&self.url, postgres::NoTls) {
            let _ = c.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name));
        }
    }
}

/// `url` with one more query parameter.
fn with_param(url: &str, name: &str, value: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{name}={value}")
}

/// Terminates every backend whose `application_name` is `app`; returns how
/// many there were.
fn kill_backends(admin: &mut postgres::Client, app: &str) -> i64 {
    let row = admin
        .query_one(
            "SELECT COUNT(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1) AS killed",
            &[&app],
        )
        .expect("terminate backends");
    row.get(0)
}

/// Polls the server until `query` (a count) returns at least `n`.
fn wait_until(admin: &mut postgres::Client, query: &str, app: &str, n: i64) {
    let deadline = Instant::now() + SETTLE;
    loop {
        let count: i64 = admin.query_one(query, &[&app]).expect("poll").get(0);
        if count >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the server did not reach `{query}` >= {n} within {SETTLE:?}"
        );
        thread::yield_now();
    }
}

/// The count of `app`'s backends waiting for a lock.
const WAITING_FOR_LOCK: &str = "SELECT COUNT(*) FROM pg_stat_activity \
    WHERE application_name = $1 AND wait_event_type = 'Lock'";

// ---------------------------------------------------------------------------

#[test]
fn pg_nul_characters_are_rejected_by_name_in_keys_and_kept_in_result_refs() {
    let Some(t) = TestSchema::new() else { return };
    let store = t.store();
    for (field, k) in [
        ("scope", RecordKey::new("tenant\u{0}", BIZ, "k")),
        ("biz_type", RecordKey::new("tenant-1", "order\u{0}", "k")),
        ("idem_key", RecordKey::new("tenant-1", BIZ, "k\u{0}")),
    ] {
        match store.insert_if_absent(&candidate(k.clone())) {
            Err(StoreError::Rejected(msg)) => {
                assert!(msg.contains(field) && msg.contains("NUL"), "{msg}")
            }
            other => panic!("{field}: expected Rejected, got {other:?}"),
        }
        // No stored key can hold one, so none has a record.
        assert_eq!(store.get(&k).unwrap(), None);
    }
    assert!(store.list_stale("order\u{0}", T0, 10).unwrap().is_empty());
    assert_eq!(
        store
            .count_by_status()
            .unwrap()
            .iter()
            .map(|c| c.1)
            .sum::<u64>(),
        0
    );

    // A result reference may carry one: it is stored as bytes.
    let r = insert(&store, &candidate(key("k")));
    let mut done = r.clone();
    done.revision += 1;
    done.status = Status::Succeeded;
    done.result_ref = Some("order\u{0}42 ✓".to_owned());
    assert_eq!(
        store.compare_and_swap(r.revision, &done).unwrap(),
        SwapOutcome::Swapped
    );
    assert_eq!(store.get(&key("k")).unwrap(), Some(done));
}

#[test]
fn pg_racing_stores_insert_each_key_exactly_once() {
    const THREADS: usize = 8;
    const KEYS: usize = 200;
    let Some(t) = TestSchema::new() else { return };
    drop(t.store()); // migrate once, outside the race
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|n| {
            let barrier = Arc::clone(&barrier);
            let options = PostgresOptions {
                pool_size: 1,
                ..t.options()
            };
            let url = t.url.clone();
            thread::spawn(move || {
                // Each thread has its own store, like a separate host.
                let store = PostgresStore::connect(&url, options).unwrap();
                barrier.wait();
                let mut won = Vec::new();
                for i in 0..KEYS {
                    let k = (i + n * 25) % KEYS;
                    let mut c = candidate(key(&format!("k{k}")));
                    c.fencing_token = n as u64;
                    match store.insert_if_absent(&c).unwrap() {
                        InsertOutcome::Inserted(r) => {
                            assert_eq!(r.fencing_token, n as u64);
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
    assert_eq!(ids.len(), KEYS, "every winner got its own id");
    let store = t.store();
    for k in 0..KEYS {
        let r = store.get(&key(&format!("k{k}"))).unwrap().unwrap();
        assert!(ids.binary_search(&r.id).is_ok());
    }
}

#[test]
fn pg_racing_swaps_on_one_revision_have_one_winner() {
    const THREADS: usize = 8;
    let Some(t) = TestSchema::new() else { return };
    let store = PostgresStore::connect(
        &t.url,
        PostgresOptions {
            pool_size: THREADS as u32,
            ..t.options()
        },
    )
    .unwrap();
    let mut current = insert(&store, &candidate(key("k")));
    for _round in 0..20 {
        let barrier = Arc::new(Barrier::new(THREADS));
        let winners: Vec<StoredRecord> = thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|n| {
                    let barrier = Arc::clone(&barrier);
                    let store = &store;
                    let current = &current;
                    s.spawn(move || {
                        let mut next = current.clone();
                        next.revision += 1;
                        next.fencing_token = 100 + n as u64;
                        barrier.wait();
                        match store.compare_and_swap(current.revision, &next).unwrap() {
                            SwapOutcome::Swapped => Some(next),
                            SwapOutcome::Stale(Some(now)) => {
                                assert_eq!(now.revision, current.revision + 1);
                                None
                            }
                            SwapOutcome::Stale(None) => panic!("the record vanished"),
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(winners.len(), 1, "{winners:?}");
        current = store.get(&key("k")).unwrap().unwrap();
        assert_eq!(current, winners[0]);
    }
}

#[test]
fn pg_concurrent_connects_migrate_exactly_once() {
    const HOSTS: usize = 8;
    let Some(t) = TestSchema::new() else { return };
    let barrier = Arc::new(Barrier::new(HOSTS));
    let handles: Vec<_> = (0..HOSTS)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            let url = t.url.clone();
            let options = PostgresOptions {
                pool_size: 1,
                ..t.options()
            };
            thread::spawn(move || {
                barrier.wait();
                PostgresStore::connect(&url, options)
            })
        })
        .collect();
    let stores: Vec<PostgresStore> = handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap())
        .collect();
    assert_eq!(schema_versions(&t), vec![1, 2]);
    let r = insert(&stores[1], &candidate(key("k")));
    assert_eq!(stores[5].get(&key("k")).unwrap(), Some(r));
    assert_eq!(stores[0].schema(), t.name);
}

/// The schema versions applied to the test's schema, in order.
fn schema_versions(t: &TestSchema) -> Vec<i32> {
    raw(&t.url)
        .query(
            &format!(
                "SELECT version FROM \"{}\".idem_schema_version ORDER BY version",
                t.name
            ),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[test]
fn pg_rows_written_by_schema_version_1_are_read_after_the_upgrade() {
    let Some(t) = TestSchema::new() else { return };
    // A version-1 schema: a row whose byte strings are arrays of numbers
    // (serde's JSON of the host types, as version 1 wrote), and version 2
    // not applied.
    let record = insert(&t.store(), &rich_record(key("k")));
    let mut conn = raw(&t.url);
    conn.execute(
        &format!(
            "UPDATE \"{}\".idempotency_record SET response = $1, failure = $2",
            t.name
        ),
        &[
            &serde_json::to_vec(&record.response).unwrap(),
            &serde_json::to_vec(&record.failure).unwrap(),
        ],
    )
    .unwrap();
    conn.batch_execute(&format!(
        "DELETE FROM \"{}\".idem_schema_version WHERE version = 2",
        t.name
    ))
    .unwrap();
    let store = t.store();
    assert_eq!(schema_versions(&t), vec![1, 2]);
    assert_eq!(store.get(&key("k")).unwrap(), Some(record.clone()));
    // A write stores the new form, read back the same.
    let mut next = record.clone();
    next.revision += 1;
    assert_eq!(
        store.compare_and_swap(record.revision, &next).unwrap(),
        SwapOutcome::Swapped
    );
    let column: Vec<u8> = conn
        .query_one(
            &format!("SELECT response FROM \"{}\".idempotency_record", t.name),
            &[],
        )
        .unwrap()
        .get(0);
    assert!(
        column.starts_with(
            br#"{"status":201,"headers":[["content-type","YXBwbGljYXRpb24vanNvbg=="]"#
        )
    );
    assert_eq!(store.get(&key("k")).unwrap(), Some(next));
}

#[test]
fn pg_reconnect_keeps_records_and_newer_schema_is_refused() {
    let Some(t) = TestSchema::new() else { return };
    let r = insert(&t.store(), &candidate(key("k")));
    assert_eq!(t.store().get(&key("k")).unwrap(), Some(r));
    raw(&t.url)
        .batch_execute(&format!(
            "INSERT INTO \"{}\".idem_schema_version (version) VALUES (99)",
            t.name
        ))
        .unwrap();
    match PostgresStore::connect(&t.url, t.options()) {
        Err(StoreError::Internal(msg)) => assert!(msg.contains("99"), "{msg}"),
        other => panic!("expected Internal, got {other:?}"),
    }
}

#[test]
fn pg_invalid_options_and_urls_are_rejected_by_name() {
    // No server is needed: every one is refused before connecting.
    let url = "postgres://postgres@127.0.0.1:1/none";
    let bad = |options: PostgresOptions, field: &str| match PostgresStore::connect(url, options) {
        Err(StoreError::Rejected(msg)) => assert!(msg.contains(field), "{field}: {msg}"),
        other => panic!("{field}: expected Rejected, got {other:?}"),
    };
    for schema in ["", "1abc", "a-b", "a\"b", "a b", &"s".repeat(64), "é"] {
        bad(
            PostgresOptions {
                schema: schema.to_owned(),
                ..Default::default()
            },
            "schema",
        );
    }
    bad(
        PostgresOptions {
            pool_size: 0,
            ..Default::default()
        },
        "pool_size",
    );
    bad(
        PostgresOptions {
            connect_timeout: Duration::ZERO,
            ..Default::default()
        },
        "connect_timeout",
    );
    for timeout in [Duration::ZERO, Duration::from_secs(u64::from(u32::MAX))] {
        bad(
            PostgresOptions {
                statement_timeout: timeout,
                ..Default::default()
            },
            "statement_timeout",
        );
    }
    let secret = "postgres://user:hunter2@127.0.0.1:5432/db?sslmode=sometimes";
    match PostgresStore::connect(secret, PostgresOptions::default()) {
        Err(StoreError::Rejected(msg)) => {
            assert!(msg.contains("URL") && !msg.contains("hunter2"), "{msg}")
        }
        other => panic!("expected Rejected, got {other:?}"),
    }
}

#[test]
fn pg_unreachable_server_is_unavailable() {
    // A port nobody listens on: no server is needed.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let url = format!("postgres://postgres@127.0.0.1:{port}/test");
    match PostgresStore::connect(&url, PostgresOptions::default()) {
        Err(StoreError::Unavailable(msg)) => assert!(msg.contains("postgres"), "{msg}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn pg_lost_connection_mid_statement_is_unavailable_and_the_pool_recovers() {
    let Some(t) = TestSchema::new() else { return };
    let (store, app) = t.named_store(PostgresOptions {
        pool_size: 1,
        ..t.options()
    });
    let r = insert(&store, &candidate(key("k")));
    let mut next = r.clone();
    next.revision += 1;
    next.status = Status::Succeeded;

    // Another session holds the row, so the swap waits for its lock; the
    // store's connection is killed while it waits.
    let mut blocker = raw(&t.url);
    let mut admin = raw(&t.url);
    let mut tx = blocker.transaction().unwrap();
    tx.execute(&format!("SELECT 1 FROM {} FOR UPDATE", t.table()), &[])
        .unwrap();
    let result = thread::scope(|s| {
        let swap = s.spawn(|| store.compare_and_swap(r.revision, &next));
        wait_until(&mut admin, WAITING_FOR_LOCK, &app, 1);
        assert_eq!(kill_backends(&mut admin, &app), 1);
        swap.join().unwrap()
    });
    match result {
        Err(StoreError::Unavailable(msg)) => assert!(msg.contains("postgres"), "{msg}"),
        other => panic!("a lost connection must be an error, got {other:?}"),
    }
    tx.rollback().unwrap();
    // The swap never committed; the pool opens a new connection.
    assert_eq!(store.get(&key("k")).unwrap(), Some(r.clone()));
    assert_eq!(
        store.compare_and_swap(r.revision, &next).unwrap(),
        SwapOutcome::Swapped
    );
}

#[test]
fn pg_lost_connection_mid_insert_never_reports_a_new_key() {
    let Some(t) = TestSchema::new() else { return };
    let (store, app) = t.named_store(PostgresOptions {
        pool_size: 1,
        ..t.options()
    });
    drop(t.store());
    // Another session inserts the key and has not committed: the store's
    // insert waits to learn whether the key is taken.
    let mut blocker = raw(&t.url);
    let mut admin = raw(&t.url);
    let mut tx = blocker.transaction().unwrap();
    let theirs = candidate(key("k"));
    tx.execute(
        &format!(
            "INSERT INTO {} (scope_key, biz_type, idem_key, request_hash, fingerprint_version, \
             status, fencing_token, revision, attempts, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, 1, 'processing', 7, 1, 1, 0, 0)",
            t.table()
        ),
        &[
            &theirs.key.scope,
            &theirs.key.biz_type,
            &theirs.key.idem_key,
            &theirs.fingerprint,
        ],
    )
    .unwrap();
    let result = thread::scope(|s| {
        let ins = s.spawn(|| store.insert_if_absent(&candidate(key("k"))));
        wait_until(&mut admin, WAITING_FOR_LOCK, &app, 1);
        assert_eq!(kill_backends(&mut admin, &app), 1);
        ins.join().unwrap()
    });
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "a lost connection must be an error, got {result:?}"
    );
    tx.commit().unwrap();
    // Retried, the insert finds the other session's record.
    match store.insert_if_absent(&candidate(key("k"))).unwrap() {
        InsertOutcome::Existing(r) => assert_eq!(r.fencing_token, 7),
        other => panic!("expected Existing, got {other:?}"),
    }
}

#[test]
fn pg_statement_timeout_is_unavailable() {
    let Some(t) = TestSchema::new() else { return };
    let store = PostgresStore::connect(
        &t.url,
        PostgresOptions {
            statement_timeout: Duration::from_millis(100),
            ..t.options()
        },
    )
    .unwrap();
    let r = insert(&store, &candidate(key("k")));
    let mut blocker = raw(&t.url);
    let mut tx = blocker.transaction().unwrap();
    tx.execute(&format!("SELECT 1 FROM {} FOR UPDATE", t.table()), &[])
        .unwrap();
    let mut next = r.clone();
    next.revision += 1;
    match store.compare_and_swap(r.revision, &next) {
        Err(StoreError::Unavailable(msg)) => assert!(msg.contains("timeout"), "{msg}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    tx.rollback().unwrap();
    assert_eq!(store.get(&key("k")).unwrap(), Some(r));
}

#[test]
fn pg_connections_killed_in_the_pool_are_replaced_when_checked() {
    let Some(t) = TestSchema::new() else { return };
    let mut admin = raw(&t.url);
    // (check on checkout, skip the check for connections back within):
    // checked every time; never checked; checked only after an hour in the
    // pool, which the connections killed here, just used, have not spent.
    let hour = Duration::from_secs(3600);
    for (n, (check, idle)) in [
        (true, Duration::ZERO),
        (false, Duration::ZERO),
        (true, hour),
    ]
    .into_iter()
    .enumerate()
    {
        let silent = check && idle.is_zero();
        let (store, app) = t.named_store(PostgresOptions {
            pool_size: 2,
            check_on_checkout: check,
            check_after_idle: idle,
            ..t.options()
        });
        insert_with(
            &store,
            key(&format!("k{n}")),
            Status::Processing,
            None,
            T0,
            None,
        );
        assert_eq!(kill_backends(&mut admin, &app), 2);
        let deadline = Instant::now() + SETTLE;
        while admin
            .query_one(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = $1",
                &[&app],
            )
            .unwrap()
            .get::<_, i64>(0)
            > 0
        {
            assert!(Instant::now() < deadline, "the backends did not exit");
            thread::yield_now();
        }
        let mut errors = 0;
        for _ in 0..4 {
            match store.get(&key(&format!("k{n}"))) {
                Ok(Some(_)) => {}
                Err(StoreError::Unavailable(_)) => errors += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        if silent {
            assert_eq!(errors, 0, "checked connections are replaced silently");
        } else {
            // Each dead connection fails one operation, then is replaced.
            assert!((1..=2).contains(&errors), "{errors} errors");
        }
        assert!(store.get(&key(&format!("k{n}"))).unwrap().is_some());
    }
}

#[test]
fn pg_undecodable_row_is_internal_naming_the_column() {
    let Some(t) = TestSchema::new() else { return };
    let cases = [
        ("response", "UPDATE {t} SET response = '\\x00ff'"),
        (
            "failure",
            "UPDATE {t} SET failure = convert_to('{\"code\":1}', 'UTF8')",
        ),
        ("revision", "UPDATE {t} SET revision = -1"),
        ("attempts", "UPDATE {t} SET attempts = 4294967296"),
        ("result_ref", "UPDATE {t} SET result_ref = '\\xff'"),
    ];
    let mut admin = raw(&t.url);
    for (column, sql) in cases {
        let store = t.store();
        admin
            .batch_execute(&format!("TRUNCATE {}", t.table()))
            .unwrap();
        insert_with(&store, key("k"), Status::OutcomeUnknown, Some(T0), T0, None);
        admin
            .batch_execute(&sql.replace("{t}", &t.table()))
            .unwrap();
        for result in [
            store.get(&key("k")).map(|_| ()),
            store.insert_if_absent(&candidate(key("k"))).map(|_| ()),
            store.list_stale(BIZ, T0, 10).map(|_| ()),
        ] {
            match result {
                Err(StoreError::Internal(msg)) => assert!(msg.contains(column), "{column}: {msg}"),
                other => panic!("{column}: expected Internal, got {other:?}"),
            }
        }
    }
}

#[test]
fn pg_server_errors_map_onto_the_contract() {
    let Some(t) = TestSchema::new() else { return };
    let mut c = raw(&t.url);
    let err = |c: &mut postgres::Client, sql: &str| map_err(c.batch_execute(sql).unwrap_err());
    assert!(matches!(err(&mut c, "SELECT 1/0"), StoreError::Rejected(_)));
    assert!(matches!(
        err(&mut c, "SELECT no_such_column FROM pg_class"),
        StoreError::Internal(_)
    ));
    assert!(matches!(
        err(&mut c, "SET statement_timeout = 1; SELECT pg_sleep(1)"),
        StoreError::Unavailable(_)
    ));
    c.batch_execute("RESET statement_timeout").unwrap();
    assert!(matches!(
        err(
            &mut c,
            "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'serialization_failure'; END $$"
        ),
        StoreError::Unavailable(_)
    ));
    assert!(matches!(
        err(
            &mut c,
            "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'unique_violation'; END $$"
        ),
        StoreError::Rejected(_)
    ));
    // A session that was terminated.
    let pid: i32 = c.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    raw(&t.url)
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .unwrap();
    assert!(matches!(
        map_err(c.simple_query("SELECT 1").unwrap_err()),
        StoreError::Unavailable(_)
    ));
}

#[test]
fn pg_delete_expired_never_deletes_a_record_revived_meanwhile() {
    let Some(t) = TestSchema::new() else { return };
    let store = PostgresStore::connect(
        &t.url,
        PostgresOptions {
            pool_size: 2,
            ..t.options()
        },
    )
    .unwrap();
    let (sweeper, app) = t.named_store(PostgresOptions {
        pool_size: 1,
        ..t.options()
    });
    let expired = insert_with(&store, key("k"), Status::Succeeded, None, T0, Some(T0));
    // An engine replaces the expired record (a new attempt) in a
    // transaction that has not committed yet; the sweep starts meanwhile.
    let mut writer = raw(&t.url);
    let mut admin = raw(&t.url);
    let mut tx = writer.transaction().unwrap();
    tx.execute(
        &format!(
            "UPDATE {} SET status = 'processing', expires_at = NULL, revision = revision + 1",
            t.table()
        ),
        &[],
    )
    .unwrap();
    // SKIP LOCKED: the sweep passes over the locked row instead of waiting
    // for it (a wait would end in the statement timeout, an error).
    let deleted = sweeper.delete_expired(T0, 10).unwrap();
    let waiting: i64 = admin.query_one(WAITING_FOR_LOCK, &[&app]).unwrap().get(0);
    assert_eq!(waiting, 0);
    assert_eq!(deleted, 0);
    tx.commit().unwrap();
    let now = store.get(&key("k")).unwrap().unwrap();
    assert_eq!(now.status, Status::Processing);
    assert_eq!(now.id, expired.id);
    assert_eq!(store.delete_expired(u64::MAX, 10).unwrap(), 0);
}

// ---------------------------------------------------------------------------
// Business transactions.

/// The schema's business table, as a service would have it beside the
/// records: no unique constraint, so a second execution is a second row.
fn orders_table(t: &TestSchema) -> String {
    let table = format!("\"{}\".orders", t.name);
    raw(&t.url)
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (id TEXT NOT NULL, amount BIGINT NOT NULL)"
        ))
        .expect("create the business table");
    table
}

fn order_count(t: &TestSchema, table: &str) -> i64 {
    raw(&t.url)
        .query_one(&format!("SELECT COUNT(*) FROM {table}"), &[])
        .expect("count orders")
        .get(0)
}

/// The inserted record of `k`, marked succeeded at revision 2.
fn succeeded(r: &StoredRecord) -> StoredRecord {
    let mut done = r.clone();
    done.status = Status::Succeeded;
    done.revision = 2;
    done.result_ref = Some("o-1".to_owned());
    done
}

#[test]
fn pg_transaction_commit_leaves_both_writes_and_rollback_neither() {
    let Some(t) = TestSchema::new() else { return };
    let store = t.store();
    let orders = orders_table(&t);
    for commit in [false, true] {
        let k = key(if commit { "committed" } else { "rolled-back" });
        let r = insert(&store, &candidate(k.clone()));
        let tx = store.begin_transaction().unwrap();
        tx.with_connection(|c| {
            c.execute(&format!("INSERT INTO {orders} VALUES ('o-1', 100)"), &[])
        })
        .unwrap()
        .unwrap();
        let done = succeeded(&r);
        assert_eq!(tx.compare_and_swap(1, &done).unwrap(), SwapOutcome::Swapped);
        // The transaction sees its own writes; nobody else does yet.
        assert_eq!(tx.get(&k).unwrap(), Some(done.clone()));
        assert_eq!(store.get(&k).unwrap(), Some(r.clone()));
        let before = order_count(&t, &orders);
        if commit {
            tx.commit().unwrap();
            assert_eq!(store.get(&k).unwrap(), Some(done));
            assert_eq!(order_count(&t, &orders), before + 1);
        } else {
            tx.rollback().unwrap();
            assert_eq!(store.get(&k).unwrap(), Some(r));
            assert_eq!(order_count(&t, &orders), before);
        }
    }
}

#[test]
fn pg_rollback_to_savepoint_undoes_only_what_came_after_it_even_an_aborted_statement() {
    use idem_engine::Transaction as _;
    let Some(t) = TestSchema::new() else { return };
    let store = t.store();
    let orders = orders_table(&t);
    let tx = store.begin_transaction().unwrap();
    let claim = insert(&tx, &candidate(key("k")));
    tx.savepoint(Savepoint::Action).unwrap();
    tx.with_connection(|c| c.execute(&format!("INSERT INTO {orders} VALUES ('o-1', 100)"), &[]))
        .unwrap()
        .unwrap();
    // A failed statement aborts a PostgreSQL transaction; the rollback to
    // the savepoint makes it usable again.
    assert!(
        tx.with_connection(|c| c.execute("SELECT 1/0", &[]))
            .unwrap()
            .is_err()
    );
    tx.rollback_to_savepoint(Savepoint::Action).unwrap();
    let done = succeeded(&claim);
    assert_eq!(tx.compare_and_swap(1, &done).unwrap(), SwapOutcome::Swapped);
    tx.commit().unwrap();
    assert_eq!(store.get(&key("k")).unwrap(), Some(done));
    assert_eq!(order_count(&t, &orders), 0);
}

#[test]
fn pg_savepoints_nest_and_a_release_keeps_what_was_written() {
    use idem_engine::Transaction as _;
    let Some(t) = TestSchema::new() else { return };
    let store = t.store();
    let orders = orders_table(&t);
    let order = |id: &str| {
        let sql = format!("INSERT INTO {orders} VALUES ('{id}', 1)");
        move |c: &mut Client| c.execute(&sql, &[]).map(drop)
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
    tx.commit().unwrap();
    assert!(store.get(&key("kept")).unwrap().is_some());
    assert_eq!(store.get(&key("undone")).unwrap(), None);
    assert_eq!(order_count(&t, &orders), 1);
}

#[test]
fn pg_dropped_transaction_rolls_back_and_frees_the_connection() {
    let Some(t) = TestSchema::new() else { return };
    let store = PostgresStore::connect(
        &t.url,
        PostgresOptions {
            pool_size: 1,
            connect_timeout: Duration::from_secs(2),
            ..t.options()
        },
    )
    .unwrap();
    {
        let tx = store.begin_transaction().unwrap();
        insert(&tx, &candidate(key("dropped")));
    }
    // The only connection is back, outside any transaction: this write
    // commits by itself and the dropped one is gone.
    assert_eq!(store.get(&key("dropped")).unwrap(), None);
    insert(&store, &candidate(key("after")));
    assert!(
        raw(&t.url)
            .query_opt(
                &format!("SELECT 1 FROM {} WHERE idem_key = 'after'", t.table()),
                &[]
            )
            .unwrap()
            .is_some()
    );
}

#[test]
fn pg_transaction_aborted_by_a_failed_statement_is_never_reported_committed() {
    let Some(t) = TestSchema::new() else { return };
    let store = t.store();
    let tx = store.begin_transaction().unwrap();
    insert(&tx, &candidate(key("k")));
    let failed = tx
        .with_connection(|c| c.execute("INSERT INTO no_such_table VALUES (1)", &[]))
        .unwrap();
    assert!(failed.is_err());
    // Every later statement fails, and so does the commit: PostgreSQL
    // would have answered COMMIT with a silent rollback.
    assert!(tx.get(&key("k")).is_err());
    let refused = tx.commit().unwrap_err();
    assert!(
        matches!(&refused, StoreError::Internal(m) if m.contains("aborted")),
        "{refused:?}"
    );
    assert_eq!(store.get(&key("k")).unwrap(), None);
}
