//! Tests of the memory store: the conformance suite, and its fault
//! injection.

use super::{FaultKind, MemoryStore, Op, Storage, StoreError};
use crate::testing::{BIZ, T0, candidate, insert, key};
use crate::types::{RecordKey, Status, StoredRecord, SwapOutcome};

/// Runs a conformance case against a fresh memory store.
fn with_memory(case: fn(&dyn Storage)) {
    case(&MemoryStore::new());
}

mod memory_backend {
    crate::storage_conformance!(super::with_memory);
}

#[test]
fn memory_keeps_nul_characters_in_keys() {
    let s = MemoryStore::new();
    let k = RecordKey::new("tenant\u{0}1", BIZ, "k\u{0}");
    let r = insert(&s, &candidate(k.clone()));
    assert_eq!(s.get(&k).unwrap(), Some(r));
    assert_eq!(s.get(&key("k")).unwrap(), None);
}

#[test]
fn the_memory_store_is_clone_send_sync_static() {
    fn check<T: Clone + Send + Sync + 'static>() {}
    fn check_storage<T: Storage>() {}
    check::<MemoryStore>();
    check_storage::<MemoryStore>();
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
