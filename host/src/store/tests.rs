//! Store-level tests: one conformance suite, written once over `&dyn Storage`
//! and run against the memory store, the SQLite store and a SQLite
//! transaction; then tests of what only one backend has.

#[cfg(feature = "postgres")]
mod pg;

use std::path::Path;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use super::{
    FaultKind, MemoryStore, Op, SqliteOptions, SqliteStore, Storage, StoreError, Synchronous,
};
use crate::types::{
    Failure, InsertOutcome, RecordKey, Status, StoredRecord, StoredResponse, SwapOutcome,
};

// ---------------------------------------------------------------------------
// Helpers.

const BIZ: &str = "order.create";
const T0: u64 = 1_700_000_000_000;

fn key(idem_key: &str) -> RecordKey {
    RecordKey::new("tenant-1", BIZ, idem_key)
}

/// A freshly claimed record: processing, revision 1, lease 30 s.
fn candidate(key: RecordKey) -> StoredRecord {
    StoredRecord {
        id: 0,
        key,
        fingerprint: "ab".repeat(32),
        fingerprint_version: 1,
        status: Status::Processing,
        fencing_token: 1,
        revision: 1,
        attempts: 1,
        lease_until: Some(T0 + 30_000),
        created_at: T0,
        updated_at: T0,
        expires_at: None,
        result_ref: None,
        response: None,
        failure: None,
    }
}

fn insert(s: &dyn Storage, record: &StoredRecord) -> StoredRecord {
    match s.insert_if_absent(record).unwrap() {
        InsertOutcome::Inserted(r) => r,
        other => panic!("expected Inserted, got {other:?}"),
    }
}

/// Inserts a record with the given status and times.
fn insert_with(
    s: &dyn Storage,
    key: RecordKey,
    status: Status,
    lease_until: Option<u64>,
    updated_at: u64,
    expires_at: Option<u64>,
) -> StoredRecord {
    let mut r = candidate(key);
    r.status = status;
    r.lease_until = lease_until;
    r.updated_at = updated_at;
    r.expires_at = expires_at;
    insert(s, &r)
}

fn settle(s: &dyn Storage, record: &StoredRecord, status: Status, expires_at: u64) -> StoredRecord {
    let mut next = record.clone();
    next.status = status;
    next.revision += 1;
    next.lease_until = None;
    next.expires_at = Some(expires_at);
    assert_eq!(
        s.compare_and_swap(record.revision, &next).unwrap(),
        SwapOutcome::Swapped
    );
    next
}

fn ids(records: &[StoredRecord]) -> Vec<u64> {
    records.iter().map(|r| r.id).collect()
}

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

/// A record with every optional field set, binary headers included.
fn rich_record(key: RecordKey) -> StoredRecord {
    StoredRecord {
        id: 42,
        key,
        fingerprint: "0123456789abcdef".repeat(4),
        fingerprint_version: u32::MAX,
        status: Status::OutcomeUnknown,
        fencing_token: i64::MAX as u64,
        revision: 7,
        attempts: u32::MAX,
        lease_until: Some(T0 + 1),
        created_at: 0,
        updated_at: T0 + 2,
        expires_at: Some(i64::MAX as u64),
        result_ref: Some("order-№42 \u{1F600} \"quoted\" \\ \n".to_owned()),
        response: Some(StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".to_owned(), b"application/json".to_vec()),
                (
                    "x-binary".to_owned(),
                    vec![0xff, 0x00, 0xfe, 0x80, 0xc3, 0x28],
                ),
                ("x-empty".to_owned(), Vec::new()),
                ("x-binary".to_owned(), vec![0x00]),
            ],
            body: (0..=255u8).collect(),
        }),
        failure: Some(Failure {
            code: "card-declined".to_owned(),
            message: "déclinée \u{0} after NUL".to_owned(),
            response: Some(StoredResponse {
                status: 402,
                headers: vec![("retry-after".to_owned(), vec![0xc0, 0xaf])],
                body: Vec::new(),
            }),
        }),
    }
}

// ---------------------------------------------------------------------------
// The conformance suite.

fn insert_then_existing(s: &dyn Storage) {
    let mut first = candidate(key("k1"));
    first.id = 999; // ignored
    let inserted = insert(s, &first);
    assert_ne!(inserted.id, 999);
    assert_eq!(
        StoredRecord {
            id: 999,
            ..inserted.clone()
        },
        first
    );

    let mut second = candidate(key("k1"));
    second.fingerprint = "cd".repeat(32);
    second.fencing_token = 5;
    match s.insert_if_absent(&second).unwrap() {
        InsertOutcome::Existing(existing) => assert_eq!(existing, inserted),
        other => panic!("expected Existing, got {other:?}"),
    }
    assert_eq!(s.get(&key("k1")).unwrap(), Some(inserted));
}

fn ids_are_assigned_and_never_reused(s: &dyn Storage) {
    let a = insert(s, &candidate(key("a")));
    let b = insert(s, &candidate(key("b")));
    let c = insert(s, &candidate(key("c")));
    assert_eq!(a.id, 1, "ids start at 1");
    assert!(a.id < b.id && b.id < c.id);

    // Delete the newest record; its id must not come back.
    let c = settle(s, &c, Status::Succeeded, T0);
    assert_eq!(s.delete_expired(T0, 10).unwrap(), 1);
    let c2 = insert(s, &candidate(key("c")));
    assert!(c2.id > c.id, "id {} reused (deleted id {})", c2.id, c.id);
    let d = insert(s, &candidate(key("d")));
    assert!(d.id > c2.id);
}

fn get_none_and_some(s: &dyn Storage) {
    assert_eq!(s.get(&key("missing")).unwrap(), None);
    let r = insert(s, &candidate(key("k")));
    assert_eq!(s.get(&key("k")).unwrap(), Some(r));
    // Each part of the key counts.
    assert_eq!(s.get(&RecordKey::new("tenant-2", BIZ, "k")).unwrap(), None);
    assert_eq!(
        s.get(&RecordKey::new("tenant-1", "other", "k")).unwrap(),
        None
    );
    assert_eq!(s.get(&key("K")).unwrap(), None);
}

fn same_idem_key_in_other_scope_is_independent(s: &dyn Storage) {
    let a = insert(s, &candidate(RecordKey::new("tenant-1", BIZ, "k")));
    let b = insert(s, &candidate(RecordKey::new("tenant-2", BIZ, "k")));
    let c = insert(s, &candidate(RecordKey::new("tenant-1", "refund", "k")));
    assert!(a.id != b.id && b.id != c.id && a.id != c.id);
}

fn cas_success_writes_every_field(s: &dyn Storage) {
    let r = insert(s, &candidate(key("k")));
    let mut next = rich_record(key("k"));
    next.id = r.id;
    next.revision = r.revision + 1;
    assert_eq!(
        s.compare_and_swap(r.revision, &next).unwrap(),
        SwapOutcome::Swapped
    );
    let stored = s.get(&key("k")).unwrap().unwrap();
    assert_eq!(stored, next);
}

fn cas_with_another_id_is_stale(s: &dyn Storage) {
    let r = insert(s, &candidate(key("k")));
    let mut next = r.clone();
    next.revision = 2;
    next.status = Status::Succeeded;
    for id in [r.id + 1, r.id - 1, u64::MAX] {
        next.id = id;
        assert_eq!(
            s.compare_and_swap(r.revision, &next).unwrap(),
            SwapOutcome::Stale(Some(r.clone())),
            "id {id}"
        );
    }
    assert_eq!(s.get(&key("k")).unwrap(), Some(r));
}

/// The regression: an owner reads its record (id A, revision 1); the key is
/// settled, swept and claimed again by a new owner (id B, revision 1 again).
/// The old owner's swap expects revision 1 and must not land on the new
/// generation.
fn cas_never_overwrites_a_recreated_record(s: &dyn Storage) {
    let first = insert(s, &candidate(key("k")));
    let stale_owner_view = first.clone();
    let settled = settle(s, &first, Status::Succeeded, T0);
    assert_eq!(s.delete_expired(T0, 10).unwrap(), 1);
    let second = insert(s, &candidate(key("k")));
    assert_ne!(second.id, first.id);
    assert_eq!(
        second.revision, stale_owner_view.revision,
        "the trap is set"
    );

    let mut late = stale_owner_view.clone();
    late.revision += 1;
    late.status = Status::Succeeded;
    late.lease_until = None;
    late.expires_at = Some(T0 + 1);
    late.result_ref = Some("stale-owner".to_owned());
    assert_eq!(
        s.compare_and_swap(stale_owner_view.revision, &late)
            .unwrap(),
        SwapOutcome::Stale(Some(second.clone()))
    );
    assert_eq!(s.get(&key("k")).unwrap(), Some(second.clone()));
    // The same with the revision the old record reached before the sweep.
    let mut late = settled.clone();
    late.revision += 1;
    assert_eq!(
        s.compare_and_swap(settled.revision, &late).unwrap(),
        SwapOutcome::Stale(Some(second.clone()))
    );
    // The new owner's own swap still lands.
    let mut next = second.clone();
    next.revision += 1;
    next.lease_until = Some(T0 + 60_000);
    assert_eq!(
        s.compare_and_swap(second.revision, &next).unwrap(),
        SwapOutcome::Swapped
    );
    assert_eq!(s.get(&key("k")).unwrap(), Some(next));
}

fn cas_stale_returns_current_record(s: &dyn Storage) {
    let r = insert(s, &candidate(key("k")));
    let mut next = r.clone();
    next.revision = 2;
    next.status = Status::Succeeded;

    // Wrong revision: nothing written, the current record comes back.
    assert_eq!(
        s.compare_and_swap(7, &next).unwrap(),
        SwapOutcome::Stale(Some(r.clone()))
    );
    assert_eq!(s.get(&key("k")).unwrap(), Some(r.clone()));

    // Two swaps expecting the same revision: only the first wins.
    assert_eq!(s.compare_and_swap(1, &next).unwrap(), SwapOutcome::Swapped);
    let mut other = r.clone();
    other.revision = 2;
    other.status = Status::Failed;
    assert_eq!(
        s.compare_and_swap(1, &other).unwrap(),
        SwapOutcome::Stale(Some(next.clone()))
    );
    assert_eq!(s.get(&key("k")).unwrap(), Some(next));
}

fn cas_expected_revision_beyond_i64_is_stale(s: &dyn Storage) {
    let r = insert(s, &candidate(key("k")));
    let mut next = r.clone();
    next.revision = 2;
    assert_eq!(
        s.compare_and_swap(u64::MAX, &next).unwrap(),
        SwapOutcome::Stale(Some(r.clone()))
    );
    assert_eq!(s.get(&key("k")).unwrap(), Some(r));
}

fn cas_after_delete_returns_stale_none(s: &dyn Storage) {
    let r = insert(s, &candidate(key("k")));
    let r = settle(s, &r, Status::Released, T0);
    assert_eq!(s.delete_expired(T0, 10).unwrap(), 1);
    let mut next = r.clone();
    next.revision += 1;
    assert_eq!(
        s.compare_and_swap(r.revision, &next).unwrap(),
        SwapOutcome::Stale(None)
    );
    // A swap never inserts.
    assert_eq!(
        s.compare_and_swap(1, &candidate(key("never"))).unwrap(),
        SwapOutcome::Stale(None)
    );
    assert_eq!(s.get(&key("k")).unwrap(), None);
    assert_eq!(s.get(&key("never")).unwrap(), None);
}

fn delete_expired_respects_status(s: &dyn Storage) {
    for status in Status::ALL {
        // Every time in the past, whatever the status.
        insert_with(
            s,
            key(status.as_str()),
            status,
            Some(T0 - 10),
            T0 - 10,
            Some(T0 - 5),
        );
    }
    assert_eq!(s.delete_expired(T0, 100).unwrap(), 3);
    assert_eq!(s.delete_expired(u64::MAX, 100).unwrap(), 0);
    for status in Status::ALL {
        let kept = s.get(&key(status.as_str())).unwrap();
        assert_eq!(kept.is_some(), !status.is_settled(), "{status:?}");
    }
}

fn delete_expired_time_boundary(s: &dyn Storage) {
    let now = T0;
    insert_with(s, key("at-now"), Status::Succeeded, None, T0, Some(now));
    insert_with(s, key("after-now"), Status::Failed, None, T0, Some(now + 1));
    insert_with(s, key("no-expiry"), Status::Released, None, T0, None);

    assert_eq!(s.delete_expired(now - 1, 100).unwrap(), 0);
    assert_eq!(s.delete_expired(now, 100).unwrap(), 1);
    assert_eq!(s.get(&key("at-now")).unwrap(), None);
    assert!(s.get(&key("after-now")).unwrap().is_some());
    assert!(s.get(&key("no-expiry")).unwrap().is_some());

    // A bound beyond SQLite's integers still means "everything expired".
    assert_eq!(s.delete_expired(u64::MAX, 100).unwrap(), 1);
    assert!(s.get(&key("no-expiry")).unwrap().is_some());
}

fn delete_expired_respects_limit(s: &dyn Storage) {
    for i in 0..5u64 {
        // Inserted newest expiry first, so id order is not expiry order.
        insert_with(
            s,
            key(&format!("k{i}")),
            Status::Succeeded,
            None,
            T0,
            Some(T0 - i),
        );
    }
    assert_eq!(s.delete_expired(T0, 0).unwrap(), 0);
    assert_eq!(s.delete_expired(T0, 2).unwrap(), 2);
    // The oldest expiries went first.
    assert_eq!(s.get(&key("k4")).unwrap(), None);
    assert_eq!(s.get(&key("k3")).unwrap(), None);
    assert!(s.get(&key("k2")).unwrap().is_some());
    assert_eq!(s.delete_expired(T0, 10).unwrap(), 3);
    assert_eq!(s.delete_expired(T0, 10).unwrap(), 0);
}

fn list_stale_boundaries(s: &dyn Storage) {
    let now = T0;
    let at_now = insert_with(
        s,
        key("lease-at-now"),
        Status::Processing,
        Some(now),
        T0,
        None,
    );
    insert_with(
        s,
        key("lease-after"),
        Status::Processing,
        Some(now + 1),
        T0 + 1,
        None,
    );
    insert_with(s, key("no-lease"), Status::Processing, None, T0 + 2, None);
    let unknown = insert_with(
        s,
        key("unknown"),
        Status::OutcomeUnknown,
        Some(now + 1_000),
        T0 + 3,
        None,
    );
    for status in [Status::Succeeded, Status::Failed, Status::Released] {
        insert_with(
            s,
            key(status.as_str()),
            status,
            Some(now - 1),
            T0 - 1,
            Some(now - 1),
        );
    }
    let listed = s.list_stale(BIZ, now, 100).unwrap();
    assert_eq!(listed, vec![at_now.clone(), unknown.clone()]);
    let listed = s.list_stale(BIZ, now - 1, 100).unwrap();
    assert_eq!(listed, vec![unknown]);
    assert_eq!(s.list_stale(BIZ, u64::MAX, 100).unwrap().len(), 3);
}

fn list_stale_filters_biz_type(s: &dyn Storage) {
    let mine = insert_with(s, key("a"), Status::Processing, Some(T0), T0, None);
    let other_scope = insert_with(
        s,
        RecordKey::new("tenant-2", BIZ, "b"),
        Status::OutcomeUnknown,
        None,
        T0 + 1,
        None,
    );
    insert_with(
        s,
        RecordKey::new("tenant-1", "refund.create", "c"),
        Status::Processing,
        Some(T0),
        T0,
        None,
    );
    insert_with(
        s,
        RecordKey::new("tenant-1", "order.create2", "d"),
        Status::OutcomeUnknown,
        None,
        T0,
        None,
    );
    assert_eq!(s.list_stale(BIZ, T0, 100).unwrap(), vec![mine, other_scope]);
    assert_eq!(s.list_stale("refund.create", T0, 100).unwrap().len(), 1);
    assert!(s.list_stale("nope", T0, 100).unwrap().is_empty());
}

fn list_stale_orders_by_updated_at_and_limits(s: &dyn Storage) {
    let updated = [50u64, 10, 40, 20, 30];
    let mut records = Vec::new();
    for (i, at) in updated.iter().enumerate() {
        let status = if i % 2 == 0 {
            Status::Processing
        } else {
            Status::OutcomeUnknown
        };
        records.push(insert_with(
            s,
            key(&format!("k{i}")),
            status,
            Some(T0),
            T0 + at,
            None,
        ));
    }
    // Two records with the same updated_at come in id order.
    let tie = insert_with(s, key("tie"), Status::OutcomeUnknown, None, T0 + 10, None);

    let all = s.list_stale(BIZ, T0, 100).unwrap();
    let order: Vec<u64> = all.iter().map(|r| r.updated_at - T0).collect();
    assert_eq!(order, vec![10, 10, 20, 30, 40, 50]);
    assert_eq!(all[0].id, records[1].id);
    assert_eq!(all[1].id, tie.id);

    let first_two = s.list_stale(BIZ, T0, 2).unwrap();
    assert_eq!(ids(&first_two), ids(&all[..2]));
    assert!(s.list_stale(BIZ, T0, 0).unwrap().is_empty());
}

fn round_trip_every_field(s: &dyn Storage) {
    // A NUL character in a key is tested apart: PostgreSQL text cannot
    // hold one.
    let rich = rich_record(key("rich key \u{1F511} \"quoted\" \\ \n"));
    let inserted = insert(s, &rich);
    assert_eq!(
        StoredRecord {
            id: rich.id,
            ..inserted.clone()
        },
        rich
    );
    assert_eq!(s.get(&rich.key).unwrap(), Some(inserted.clone()));
    // The same record through the scan.
    let listed = s.list_stale(BIZ, T0, 10).unwrap();
    assert_eq!(listed, vec![inserted.clone()]);

    // And back to empty optional fields.
    let mut plain = candidate(rich.key.clone());
    plain.id = inserted.id;
    plain.revision = inserted.revision + 1;
    plain.response = Some(StoredResponse::default());
    plain.failure = Some(Failure::default());
    plain.result_ref = Some(String::new());
    assert_eq!(
        s.compare_and_swap(inserted.revision, &plain).unwrap(),
        SwapOutcome::Swapped
    );
    assert_eq!(s.get(&rich.key).unwrap(), Some(plain.clone()));
    plain.response = None;
    plain.failure = None;
    plain.result_ref = None;
    plain.revision += 1;
    assert_eq!(
        s.compare_and_swap(plain.revision - 1, &plain).unwrap(),
        SwapOutcome::Swapped
    );
    assert_eq!(s.get(&rich.key).unwrap(), Some(plain));
}

fn count_by_status_counts_every_status(s: &dyn Storage) {
    let empty = s.count_by_status().unwrap();
    assert_eq!(empty, Status::ALL.map(|st| (st, 0)).to_vec());
    let mut n = 0;
    for (i, status) in Status::ALL.into_iter().enumerate() {
        for _ in 0..=i {
            insert_with(s, key(&format!("k{n}")), status, None, T0, None);
            n += 1;
        }
    }
    let counts = s.count_by_status().unwrap();
    let expected: Vec<(Status, u64)> = Status::ALL
        .into_iter()
        .enumerate()
        .map(|(i, st)| (st, i as u64 + 1))
        .collect();
    assert_eq!(counts, expected);
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod memory_backend {
            $(
                #[test]
                fn $name() {
                    super::$name(&super::MemoryStore::new());
                }
            )*
        }

        mod sqlite_backend {
            $(
                #[test]
                fn $name() {
                    let (_dir, store) = super::sqlite_store();
                    super::$name(&store);
                    assert!(store.integrity_check().unwrap());
                }
            )*
        }

        /// SQLite with group commit: every write goes through the queue.
        mod sqlite_group_commit_backend {
            $(
                #[test]
                fn $name() {
                    let (_dir, store) = super::sqlite_group_store();
                    super::$name(&store);
                    assert!(store.integrity_check().unwrap());
                }
            )*
        }

        /// Each test in a schema of its own, dropped after; skipped with a
        /// printed reason when `IDEM_TEST_PG_URL` is not set.
        #[cfg(feature = "postgres")]
        mod postgres_backend {
            $(
                #[test]
                fn $name() {
                    let Some(schema) = super::pg::TestSchema::new() else { return };
                    super::$name(&schema.store());
                }
            )*
        }

        /// The same suite inside one open transaction, rolled back after.
        mod sqlite_transaction_backend {
            use crate::store::Storage;

            $(
                #[test]
                fn $name() {
                    let (_dir, store) = super::sqlite_store();
                    let tx = store.begin_transaction().unwrap();
                    super::$name(&tx);
                    tx.rollback().unwrap();
                    assert_eq!(
                        store.count_by_status().unwrap().iter().map(|c| c.1).sum::<u64>(),
                        0
                    );
                }
            )*
        }
    };
}

conformance!(
    insert_then_existing,
    ids_are_assigned_and_never_reused,
    get_none_and_some,
    same_idem_key_in_other_scope_is_independent,
    cas_success_writes_every_field,
    cas_with_another_id_is_stale,
    cas_never_overwrites_a_recreated_record,
    cas_stale_returns_current_record,
    cas_expected_revision_beyond_i64_is_stale,
    cas_after_delete_returns_stale_none,
    delete_expired_respects_status,
    delete_expired_time_boundary,
    delete_expired_respects_limit,
    list_stale_boundaries,
    list_stale_filters_biz_type,
    list_stale_orders_by_updated_at_and_limits,
    round_trip_every_field,
    count_by_status_counts_every_status,
);

#[test]
fn memory_and_sqlite_keep_nul_characters_in_keys() {
    let (_dir, sqlite) = sqlite_store();
    for s in [&MemoryStore::new() as &dyn Storage, &sqlite] {
        let k = RecordKey::new("tenant\u{0}1", BIZ, "k\u{0}");
        let r = insert(s, &candidate(k.clone()));
        assert_eq!(s.get(&k).unwrap(), Some(r));
        assert_eq!(s.get(&key("k")).unwrap(), None);
    }
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
fn sqlite_rejects_u64_above_i64_max() {
    let (_dir, store) = sqlite_store();
    rejects_u64_above_i64_max(&store);
}

#[test]
fn memory_rejects_u64_above_i64_max_like_sqlite() {
    rejects_u64_above_i64_max(&MemoryStore::new());
}

fn rejects_u64_above_i64_max(store: &dyn Storage) {
    let big = i64::MAX as u64 + 1;
    type Setter = fn(&mut StoredRecord, u64);
    let variants: [(&str, Setter); 6] = [
        ("fencing_token", |r, v| r.fencing_token = v),
        ("revision", |r, v| r.revision = v),
        ("lease_until", |r, v| r.lease_until = Some(v)),
        ("created_at", |r, v| r.created_at = v),
        ("updated_at", |r, v| r.updated_at = v),
        ("expires_at", |r, v| r.expires_at = Some(v)),
    ];
    for (field, set) in variants {
        let mut r = candidate(key(field));
        set(&mut r, big);
        match store.insert_if_absent(&r) {
            Err(StoreError::Rejected(msg)) => assert!(msg.contains(field), "{msg}"),
            other => panic!("{field}: expected Rejected, got {other:?}"),
        }
        assert_eq!(store.get(&key(field)).unwrap(), None, "{field} was written");
    }

    let r = insert(store, &candidate(key("k")));
    let mut next = r.clone();
    next.revision = u64::MAX;
    assert!(matches!(
        store.compare_and_swap(r.revision, &next),
        Err(StoreError::Rejected(_))
    ));
    assert_eq!(store.get(&key("k")).unwrap(), Some(r));
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
        assert_eq!(version, 1);
        let r = insert(&stores[1], &candidate(key("k")));
        assert_eq!(stores[3].get(&key("k")).unwrap(), Some(r));
        assert!(stores[2].integrity_check().unwrap());
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
fn stores_are_clone_send_sync_static() {
    fn check<T: Clone + Send + Sync + 'static>() {}
    fn check_storage<T: Storage>() {}
    check::<SqliteStore>();
    check::<MemoryStore>();
    check_storage::<SqliteStore>();
    check_storage::<MemoryStore>();
    check_storage::<super::SqliteTransaction>();
    #[cfg(feature = "postgres")]
    {
        check::<super::PostgresStore>();
        check_storage::<super::PostgresStore>();
    }
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
            matches!(
                super::sqlite::map_err(failure(code)),
                StoreError::Unavailable(_)
            ),
            "{code}"
        );
    }
    for code in [
        ffi::SQLITE_CONSTRAINT,
        ffi::SQLITE_CONSTRAINT_UNIQUE,
        ffi::SQLITE_TOOBIG,
    ] {
        assert!(
            matches!(
                super::sqlite::map_err(failure(code)),
                StoreError::Rejected(_)
            ),
            "{code}"
        );
    }
    for e in [
        failure(ffi::SQLITE_CORRUPT),
        failure(ffi::SQLITE_NOTADB),
        rusqlite::Error::QueryReturnedNoRows,
        rusqlite::Error::InvalidColumnIndex(3),
    ] {
        assert!(matches!(super::sqlite::map_err(e), StoreError::Internal(_)));
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
    let sweep = plan(super::sqlite::SQL_DELETE_EXPIRED);
    assert!(sweep.contains("idempotency_record_sweep"), "{sweep}");
    let stale = plan(super::sqlite::SQL_LIST_STALE);
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
// Memory only.

#[test]
fn memory_fault_unavailable_writes_nothing() {
    let store = MemoryStore::new();
    store.fail_next(Some(Op::InsertIfAbsent), 2, FaultKind::Unavailable);
    for _ in 0..2 {
        assert!(matches!(
            store.insert_if_absent(&candidate(key("k"))),
            Err(StoreError::Unavailable(_))
        ));
        // Other operations are not affected.
        assert_eq!(store.get(&key("k")).unwrap(), None);
    }
    assert!(store.is_empty());
    let r = insert(&store, &candidate(key("k")));
    assert_eq!(r.id, 1, "failed inserts consume no id");
    assert_eq!(store.calls(Op::InsertIfAbsent), 3);
    assert_eq!(store.calls(Op::Get), 2);
}

#[test]
fn memory_fault_internal_on_any_op() {
    let store = MemoryStore::new();
    let r = insert(&store, &candidate(key("k")));
    store.fail_next(None, 3, FaultKind::Internal);
    assert!(matches!(store.get(&key("k")), Err(StoreError::Internal(_))));
    let mut next = r.clone();
    next.revision = 2;
    assert!(matches!(
        store.compare_and_swap(1, &next),
        Err(StoreError::Internal(_))
    ));
    assert!(matches!(
        store.count_by_status(),
        Err(StoreError::Internal(_))
    ));
    assert_eq!(store.get(&key("k")).unwrap(), Some(r));
    assert_eq!(
        store.compare_and_swap(1, &next).unwrap(),
        SwapOutcome::Swapped
    );
}

#[test]
fn memory_fault_lost_ack_applies_the_write() {
    let store = MemoryStore::new();
    store.fail_next(Some(Op::InsertIfAbsent), 1, FaultKind::LostAck);
    assert!(matches!(
        store.insert_if_absent(&candidate(key("k"))),
        Err(StoreError::Unavailable(_))
    ));
    let r = store.get(&key("k")).unwrap().unwrap();
    assert_eq!(r.id, 1);

    store.fail_next(Some(Op::CompareAndSwap), 1, FaultKind::LostAck);
    let next = settle_candidate(&r);
    assert!(matches!(
        store.compare_and_swap(1, &next),
        Err(StoreError::Unavailable(_))
    ));
    assert_eq!(store.get(&key("k")).unwrap(), Some(next.clone()));

    store.fail_next(Some(Op::DeleteExpired), 1, FaultKind::LostAck);
    assert!(matches!(
        store.delete_expired(u64::MAX, 10),
        Err(StoreError::Unavailable(_))
    ));
    assert!(store.is_empty());

    // A read loses its answer the same way.
    store.fail_next(Some(Op::Get), 1, FaultKind::LostAck);
    assert!(matches!(
        store.get(&key("k")),
        Err(StoreError::Unavailable(_))
    ));
    assert_eq!(store.calls(Op::Get), 3);
}

fn settle_candidate(r: &StoredRecord) -> StoredRecord {
    let mut next = r.clone();
    next.revision = 2;
    next.status = Status::Succeeded;
    next.expires_at = Some(T0);
    next
}

#[test]
fn memory_faults_are_used_in_order() {
    let store = MemoryStore::new();
    store.fail_next(Some(Op::Get), 1, FaultKind::Internal);
    store.fail_next(None, 1, FaultKind::Unavailable);
    store.fail_next(Some(Op::Get), 0, FaultKind::Internal); // no-op
    assert!(matches!(store.get(&key("k")), Err(StoreError::Internal(_))));
    assert!(matches!(
        store.get(&key("k")),
        Err(StoreError::Unavailable(_))
    ));
    assert_eq!(store.get(&key("k")).unwrap(), None);

    store.fail_next(None, 5, FaultKind::Internal);
    store.clear_faults();
    assert_eq!(store.get(&key("k")).unwrap(), None);
}

#[test]
fn memory_disconnect_fails_everything_until_reconnect() {
    let store = MemoryStore::new();
    let r = insert(&store, &candidate(key("k")));
    store.fail_next(None, 1, FaultKind::Internal);
    store.disconnect();
    let lost = StoreError::Unavailable("connection lost".to_owned());
    assert_eq!(
        store.insert_if_absent(&candidate(key("k2"))),
        Err(lost.clone())
    );
    assert_eq!(store.get(&key("k")), Err(lost.clone()));
    assert_eq!(
        store.compare_and_swap(1, &settle_candidate(&r)),
        Err(lost.clone())
    );
    assert_eq!(store.delete_expired(u64::MAX, 10), Err(lost.clone()));
    assert_eq!(store.list_stale(BIZ, u64::MAX, 10), Err(lost.clone()));
    assert_eq!(store.count_by_status(), Err(lost));
    assert_eq!(store.snapshot(), vec![r.clone()]);
    store.reconnect();
    // The pending fault was not consumed while disconnected.
    assert!(matches!(store.get(&key("k")), Err(StoreError::Internal(_))));
    assert_eq!(store.get(&key("k")).unwrap(), Some(r));
    for op in Op::ALL {
        assert!(store.calls(op) >= 1, "{op:?}");
    }
}

#[test]
fn memory_clones_share_records_and_snapshot_is_key_ordered() {
    let store = MemoryStore::new();
    let other = store.clone();
    insert(&store, &candidate(key("b")));
    insert(&other, &candidate(key("a")));
    assert_eq!(store.len(), 2);
    let keys: Vec<String> = other
        .snapshot()
        .into_iter()
        .map(|r| r.key.idem_key)
        .collect();
    assert_eq!(keys, ["a", "b"]);
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
