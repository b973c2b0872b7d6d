//! The instance pool's preference for the instance that claimed a record,
//! through the real component on the in-memory store.

use super::*;
use crate::clock::ManualClock;
use crate::store::memory::{MemoryStore, Op};

fn engine() -> (Engine, MemoryStore) {
    let store = MemoryStore::new();
    let engine = Engine::builder()
        .storage(store.clone())
        .clock(ManualClock::new(1_700_000_000_000))
        .build()
        .expect("engine");
    (engine, store)
}

fn claim(engine: &Engine, key: &str) -> Ticket {
    let request = BeginRequest::json(
        RecordKey::new("tenant-1", "order.create", key),
        "{}",
        Policy::default(),
    );
    match engine.begin(&request).expect("begin") {
        Decision::Execute(ticket) => ticket,
        other => panic!("a new key is executed, not {other:?}"),
    }
}

fn complete(engine: &Engine, ticket: &Ticket) {
    let done = engine
        .complete(ticket, &Policy::default(), &Success::with_ref("order"))
        .expect("complete");
    assert_eq!(done, Completion::Recorded(Status::Succeeded));
}

/// Two owners whose claims ran on different instances each write on
/// their own instance, so neither reads its record back, whatever order
/// the instances went back to the pool in.
#[test]
fn an_owners_write_runs_on_the_instance_that_claimed() {
    let (engine, store) = engine();
    let first = claim(&engine, "k1");
    // The instance that claimed k1 is busy while k2 is claimed, so k2 is
    // claimed on a second instance, which goes back to the pool first.
    let busy = engine.instance(None).expect("instance");
    let second = claim(&engine, "k2");
    engine.pool().give_back(busy, None);
    // The most recently used instance is now k1's: without the preference
    // k2's owner would run there and read.
    let gets = store.calls(Op::Get);
    complete(&engine, &second);
    complete(&engine, &first);
    assert_eq!(store.calls(Op::Get), gets, "an owner read its record back");
    assert!(engine.pool().claimed_on.is_empty());
}

/// When the instance that claimed is busy, the owner's write runs on
/// another one: it reads the record first, and is stored all the same.
#[test]
fn a_busy_claiming_instance_costs_a_read_not_the_write() {
    let (engine, store) = engine();
    let ticket = claim(&engine, "k1");
    let busy = engine.instance(None).expect("instance");
    let gets = store.calls(Op::Get);
    complete(&engine, &ticket);
    assert_eq!(store.calls(Op::Get), gets + 1);
    engine.pool().give_back(busy, None);
    assert!(engine.pool().claimed_on.is_empty());
}

/// The pool forgets every claim when it remembers too many (owners that
/// never wrote again); the claims made after are remembered, and an owner
/// forgotten is still stored.
#[test]
fn the_pool_forgets_claims_beyond_its_bound() {
    let (engine, store) = engine();
    let ticket = claim(&engine, "k1");
    {
        let mut pool = engine.pool();
        for id in 1..CLAIMS_REMEMBERED_BY_POOL as u64 {
            pool.claimed_on.entry(u64::MAX - id).or_insert(u64::MAX);
        }
        assert_eq!(pool.claimed_on.len(), CLAIMS_REMEMBERED_BY_POOL);
    }
    let after = claim(&engine, "k2");
    assert_eq!(
        engine.pool().claimed_on.len(),
        1,
        "the claims were forgotten"
    );
    let gets = store.calls(Op::Get);
    complete(&engine, &after);
    assert_eq!(store.calls(Op::Get), gets);
    // k1's claim was forgotten with the rest: its owner runs on whichever
    // instance is idle (here the only one, whose guest still has it).
    complete(&engine, &ticket);
}
