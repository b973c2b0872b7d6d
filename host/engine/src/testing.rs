//! The storage conformance suite (feature `testing`): every case the
//! contract in [`Storage`] implies, written once over `&dyn Storage`, for
//! every backend to run. idem's own backends (memory, SQLite with and
//! without group commit, a SQLite transaction, PostgreSQL) run it; a
//! backend outside this workspace runs it the same way:
//!
//! ```
//! /// Runs one case against a fresh, empty store, then checks the store.
//! fn with_my_store(case: idem_engine::testing::Case) {
//!     let store = idem_engine::MemoryStore::new(); // your backend, connected to an empty database
//!     case(&store);
//! }
//!
//! mod my_store_conformance {
//!     idem_engine::storage_conformance!(super::with_my_store);
//! }
//! ```
//!
//! [`storage_conformance!`](crate::storage_conformance) makes one `#[test]`
//! per case; [`CASES`] lists them for a harness of its own. Each case
//! expects an empty store and panics, naming what it expected, on a
//! failure.

use crate::store::{StaleCursor, Storage, StoreError};
use crate::types::{
    Failure, InsertOutcome, RecordKey, Status, StoredRecord, StoredResponse, SwapOutcome,
};

// ---------------------------------------------------------------------------
// Helpers.

/// The biz type of every record the cases write.
pub const BIZ: &str = "order.create";
/// The time, in milliseconds since the epoch, the cases start at.
pub const T0: u64 = 1_700_000_000_000;

/// The key `idem_key` in scope `tenant-1` and biz type [`BIZ`].
pub fn key(idem_key: &str) -> RecordKey {
    RecordKey::new("tenant-1", BIZ, idem_key)
}

/// A freshly claimed record: processing, revision 1, lease 30 s.
pub fn candidate(key: RecordKey) -> StoredRecord {
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

/// Inserts `record`, which must be absent, and returns it as stored.
pub fn insert(s: &dyn Storage, record: &StoredRecord) -> StoredRecord {
    match s.insert_if_absent(record).unwrap() {
        InsertOutcome::Inserted(r) => r,
        other => panic!("expected Inserted, got {other:?}"),
    }
}

/// Inserts a record with the given status and times.
pub fn insert_with(
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

/// Swaps `record` to `status`, settled with `expires_at`, and returns it
/// as stored.
pub fn settle(
    s: &dyn Storage,
    record: &StoredRecord,
    status: Status,
    expires_at: u64,
) -> StoredRecord {
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

/// The ids of `records`, in order.
pub fn ids(records: &[StoredRecord]) -> Vec<u64> {
    records.iter().map(|r| r.id).collect()
}

/// A record with every optional field set, binary headers included.
pub fn rich_record(key: RecordKey) -> StoredRecord {
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

/// Conformance case: insert then existing.
pub fn insert_then_existing(s: &dyn Storage) {
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

/// Conformance case: ids are assigned and never reused.
pub fn ids_are_assigned_and_never_reused(s: &dyn Storage) {
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

/// Conformance case: get none and some.
pub fn get_none_and_some(s: &dyn Storage) {
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

/// Conformance case: same idem key in other scope is independent.
pub fn same_idem_key_in_other_scope_is_independent(s: &dyn Storage) {
    let a = insert(s, &candidate(RecordKey::new("tenant-1", BIZ, "k")));
    let b = insert(s, &candidate(RecordKey::new("tenant-2", BIZ, "k")));
    let c = insert(s, &candidate(RecordKey::new("tenant-1", "refund", "k")));
    assert!(a.id != b.id && b.id != c.id && a.id != c.id);
}

/// Conformance case: cas success writes every field.
pub fn cas_success_writes_every_field(s: &dyn Storage) {
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

/// Conformance case: cas with another id is stale.
pub fn cas_with_another_id_is_stale(s: &dyn Storage) {
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
pub fn cas_never_overwrites_a_recreated_record(s: &dyn Storage) {
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

/// Conformance case: cas stale returns current record.
pub fn cas_stale_returns_current_record(s: &dyn Storage) {
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

/// Conformance case: cas expected revision beyond i64 is stale.
pub fn cas_expected_revision_beyond_i64_is_stale(s: &dyn Storage) {
    let r = insert(s, &candidate(key("k")));
    let mut next = r.clone();
    next.revision = 2;
    assert_eq!(
        s.compare_and_swap(u64::MAX, &next).unwrap(),
        SwapOutcome::Stale(Some(r.clone()))
    );
    assert_eq!(s.get(&key("k")).unwrap(), Some(r));
}

/// Conformance case: cas after delete returns stale none.
pub fn cas_after_delete_returns_stale_none(s: &dyn Storage) {
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

/// Conformance case: delete expired respects status.
pub fn delete_expired_respects_status(s: &dyn Storage) {
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

/// Conformance case: delete expired time boundary.
pub fn delete_expired_time_boundary(s: &dyn Storage) {
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

/// Conformance case: delete expired respects limit.
pub fn delete_expired_respects_limit(s: &dyn Storage) {
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

/// Conformance case: list stale boundaries.
pub fn list_stale_boundaries(s: &dyn Storage) {
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

/// Conformance case: list stale filters biz type.
pub fn list_stale_filters_biz_type(s: &dyn Storage) {
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

/// Conformance case: list stale orders by updated at and limits.
pub fn list_stale_orders_by_updated_at_and_limits(s: &dyn Storage) {
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

    // Paging: each page starts after the last record of the one before,
    // ties on updated_at included, and the pages add up to the whole list.
    let mut paged = Vec::new();
    let mut after = None;
    loop {
        let page = s.list_stale_after(BIZ, T0, after, 2).unwrap();
        paged.extend(page.iter().cloned());
        match page.last() {
            Some(last) if page.len() == 2 => after = Some(StaleCursor::after(last)),
            _ => break,
        }
    }
    assert_eq!(ids(&paged), ids(&all));
    let after_tie = s
        .list_stale_after(BIZ, T0, Some(StaleCursor::after(&all[1])), 100)
        .unwrap();
    assert_eq!(ids(&after_tie), ids(&all[2..]));
    let after_last = StaleCursor::after(&all[5]);
    assert!(
        s.list_stale_after(BIZ, T0, Some(after_last), 100)
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        after_last.to_string().parse::<StaleCursor>(),
        Ok(after_last)
    );
}

/// Conformance case: round trip every field.
pub fn round_trip_every_field(s: &dyn Storage) {
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

/// Conformance case: count by status counts every status.
pub fn count_by_status_counts_every_status(s: &dyn Storage) {
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

/// Conformance case: a value above `i64::MAX` in any integer field is
/// [`StoreError::Rejected`](crate::StoreError::Rejected) and writes
/// nothing, as SQL backends must.
pub fn rejects_u64_above_i64_max(store: &dyn Storage) {
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

/// One conformance case: it panics when the store breaks the contract.
pub type Case = fn(&dyn Storage);

/// Every case of the suite, by name.
pub const CASES: &[(&str, Case)] = &[
    ("insert_then_existing", insert_then_existing),
    (
        "ids_are_assigned_and_never_reused",
        ids_are_assigned_and_never_reused,
    ),
    ("get_none_and_some", get_none_and_some),
    (
        "same_idem_key_in_other_scope_is_independent",
        same_idem_key_in_other_scope_is_independent,
    ),
    (
        "cas_success_writes_every_field",
        cas_success_writes_every_field,
    ),
    ("cas_with_another_id_is_stale", cas_with_another_id_is_stale),
    (
        "cas_never_overwrites_a_recreated_record",
        cas_never_overwrites_a_recreated_record,
    ),
    (
        "cas_stale_returns_current_record",
        cas_stale_returns_current_record,
    ),
    (
        "cas_expected_revision_beyond_i64_is_stale",
        cas_expected_revision_beyond_i64_is_stale,
    ),
    (
        "cas_after_delete_returns_stale_none",
        cas_after_delete_returns_stale_none,
    ),
    (
        "delete_expired_respects_status",
        delete_expired_respects_status,
    ),
    ("delete_expired_time_boundary", delete_expired_time_boundary),
    (
        "delete_expired_respects_limit",
        delete_expired_respects_limit,
    ),
    ("list_stale_boundaries", list_stale_boundaries),
    ("list_stale_filters_biz_type", list_stale_filters_biz_type),
    (
        "list_stale_orders_by_updated_at_and_limits",
        list_stale_orders_by_updated_at_and_limits,
    ),
    ("round_trip_every_field", round_trip_every_field),
    (
        "count_by_status_counts_every_status",
        count_by_status_counts_every_status,
    ),
    ("rejects_u64_above_i64_max", rejects_u64_above_i64_max),
];

/// One `#[test]` per conformance case, each calling `$with_store` (a
/// `fn(Case)`) with the case: it gives the case a fresh, empty
/// store, and may check the store afterwards. Invoke it in a module of its
/// own per backend; see [`testing`](crate::testing).
#[macro_export]
macro_rules! storage_conformance {
    ($with_store:path) => {
        $crate::storage_conformance!(@cases $with_store; insert_then_existing, ids_are_assigned_and_never_reused, get_none_and_some, same_idem_key_in_other_scope_is_independent, cas_success_writes_every_field, cas_with_another_id_is_stale, cas_never_overwrites_a_recreated_record, cas_stale_returns_current_record, cas_expected_revision_beyond_i64_is_stale, cas_after_delete_returns_stale_none, delete_expired_respects_status, delete_expired_time_boundary, delete_expired_respects_limit, list_stale_boundaries, list_stale_filters_biz_type, list_stale_orders_by_updated_at_and_limits, round_trip_every_field, count_by_status_counts_every_status, rejects_u64_above_i64_max);
    };
    (@cases $with_store:path; $($case:ident),*) => {
        $(
            #[test]
            fn $case() {
                $with_store($crate::testing::$case);
            }
        )*
    };
}

/// A gate that blocking code waits at until the test opens it: how a test
/// holds a batch, a handler or a writer at a known point while it lines up
/// what comes next, without sleeping. Once open it stays open.
#[derive(Debug, Default)]
pub struct Gate {
    open: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
}

impl Gate {
    /// Blocks the calling thread until the gate is open.
    pub fn wait(&self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        while !*open {
            open = self.opened.wait(open).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Opens the gate and wakes every waiter.
    pub fn open(&self) {
        *self.open.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.opened.notify_all();
    }
}

/// A name nobody else uses, for a test's own schema, queue or stream on a
/// server that tests share: `prefix`, this process, a counter and the
/// time, joined by `_` (valid in SQL identifiers and broker names).
pub fn unique_name(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// The CPU time (user + system) process `pid` has used so far, in
/// microseconds, from `/proc/PID/stat` (fields 14 and 15, in clock ticks):
/// what the benchmarks report per request or message, because on shared
/// cores it is far steadier than a rate. `pid` may be `"self"`. Linux only.
///
/// # Errors
///
/// When the file cannot be read or parsed.
pub fn cpu_time_us(pid: &str) -> std::io::Result<f64> {
    stat_cpu_time_us(pid, 14)
}

/// The CPU time (user + system) that this process's children have used,
/// in microseconds, counting only the children it has waited for
/// (`/proc/self/stat` fields 16 and 17, in clock ticks): the CPU of a
/// load generator run to its end with [`std::process::Command::output`] is
/// the difference across that run. Linux only.
///
/// # Errors
///
/// When the file cannot be read or parsed.
pub fn waited_children_cpu_time_us() -> std::io::Result<f64> {
    stat_cpu_time_us("self", 16)
}

/// The sum of the user time at field `user_field` of `/proc/PID/stat` and
/// the system time in the field after it, in microseconds.
fn stat_cpu_time_us(pid: &str, user_field: usize) -> std::io::Result<f64> {
    let invalid = |what: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("/proc/{pid}/stat: {what}"),
        )
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let (_, rest) = stat
        .rsplit_once(')')
        .ok_or_else(|| invalid("no command name"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (the state), so field `n` is at `n - 3`.
    let ticks = |field: usize| -> std::io::Result<f64> {
        fields
            .get(field - 3)
            .and_then(|f| f.parse::<f64>().ok())
            .ok_or_else(|| invalid("too short"))
    };
    Ok((ticks(user_field)? + ticks(user_field + 1)?) / clock_ticks_per_s() * 1e6)
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`), the unit of
/// `/proc/PID/stat`'s CPU times; 100, Linux's value, if `getconf` fails.
fn clock_ticks_per_s() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8_lossy(&out.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// The pid of a running process whose command name starts with `prefix`
/// (`beam` for RabbitMQ's Erlang VM, `nats-server`), if there is one.
pub fn find_process(prefix: &str) -> Option<String> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid = entry.file_name().to_string_lossy().into_owned();
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            comm.trim().starts_with(prefix).then_some(pid)
        })
}

#[cfg(test)]
mod cpu_time_tests {
    use super::waited_children_cpu_time_us;

    /// A shell loop that costs about 0.1 s of CPU here: ten clock ticks.
    const CHILD_LOOP: &str = "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done";

    #[test]
    fn a_child_s_cpu_time_is_counted_once_it_was_waited_for() -> std::io::Result<()> {
        let before = waited_children_cpu_time_us()?;
        let status = std::process::Command::new("sh")
            .args(["-c", CHILD_LOOP])
            .status()?;
        assert!(status.success());
        let child_cpu = waited_children_cpu_time_us()? - before;
        assert!(
            child_cpu >= 20_000.0,
            "the child's loop counted {child_cpu} us of CPU, fewer than two clock ticks"
        );
        Ok(())
    }
}
