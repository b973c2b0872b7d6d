//! Store failures injected through the in-memory mock: every one reaches
//! the caller as an error, never as "no record", and leaves a record the
//! next call can continue from.

mod common;

use anyhow::{Result, bail, ensure};
use common::{Harness, key, request};
use idem::store::memory::Op;
use idem::{Completion, Decision, Disposition, Error, Failure, FaultKind, Status, Success};

fn harness() -> Result<(Harness, idem::MemoryStore)> {
    let h = Harness::memory()?;
    let m = h.memory_store().expect("memory backend").clone();
    Ok((h, m))
}

#[test]
fn failed_read_during_begin_is_an_error_not_a_new_key() -> Result<()> {
    let (h, m) = harness()?;
    m.fail_next(Some(Op::Get), 1, FaultKind::Unavailable);
    match h.engine.begin(&request("k1", "{}")) {
        Err(Error::Store(idem::StoreError::Unavailable(_))) => {}
        other => bail!("{other:?}"),
    }
    ensure!(m.is_empty(), "nothing was written");
    ensure!(matches!(
        h.engine.begin(&request("k1", "{}"))?,
        Decision::Execute(_)
    ));
    Ok(())
}

#[test]
fn failed_claim_is_an_error_and_writes_nothing() -> Result<()> {
    let (h, m) = harness()?;
    m.fail_next(Some(Op::InsertIfAbsent), 1, FaultKind::Internal);
    ensure!(matches!(
        h.engine.begin(&request("k1", "{}")),
        Err(Error::Store(_))
    ));
    ensure!(m.is_empty());
    Ok(())
}

#[test]
fn lost_ack_on_claim_blocks_until_the_lease_ends() -> Result<()> {
    let (h, m) = harness()?;
    let req = request("k1", "{}");
    m.fail_next(Some(Op::InsertIfAbsent), 1, FaultKind::LostAck);
    ensure!(matches!(h.engine.begin(&req), Err(Error::Store(_))));
    // The claim landed but the caller never learnt it: nobody may execute
    // until the lease ends, then exactly one caller takes over.
    ensure!(matches!(h.engine.begin(&req)?, Decision::InProgress(_)));
    h.clock.advance(req.policy.lease_ms);
    let Decision::Execute(t) = h.engine.begin(&req)? else {
        bail!("expected a take-over");
    };
    ensure!(t.fencing_token == 2);
    Ok(())
}

#[test]
fn failed_complete_leaves_processing_and_can_be_retried() -> Result<()> {
    let (h, m) = harness()?;
    let req = request("k1", "{}");
    let Decision::Execute(t) = h.engine.begin(&req)? else {
        bail!("execute");
    };
    m.fail_next(Some(Op::CompareAndSwap), 1, FaultKind::Unavailable);
    let s = Success::with_ref("order-1");
    ensure!(matches!(
        h.engine.complete(&t, &req.policy, &s),
        Err(Error::Store(_))
    ));
    let st = h.engine.inspect(&key("k1"))?.expect("record");
    ensure!(st.status == Status::Processing && st.fencing_token == t.fencing_token);
    ensure!(h.engine.complete(&t, &req.policy, &s)? == Completion::Recorded(Status::Succeeded));
    ensure!(matches!(h.engine.begin(&req)?, Decision::Replay(_)));
    Ok(())
}

#[test]
fn lost_ack_on_complete_is_recognised_on_retry() -> Result<()> {
    let (h, m) = harness()?;
    let req = request("k1", "{}");
    let Decision::Execute(t) = h.engine.begin(&req)? else {
        bail!("execute");
    };
    m.fail_next(Some(Op::CompareAndSwap), 1, FaultKind::LostAck);
    let s = Success::with_ref("order-1");
    ensure!(matches!(
        h.engine.complete(&t, &req.policy, &s),
        Err(Error::Store(_))
    ));
    ensure!(h.engine.complete(&t, &req.policy, &s)? == Completion::Recorded(Status::Succeeded));
    match h.engine.begin(&req)? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-1")),
        other => bail!("{other:?}"),
    }
    Ok(())
}

#[test]
fn lost_connection_fails_every_call() -> Result<()> {
    let (h, m) = harness()?;
    let req = request("k1", "{}");
    m.disconnect();
    ensure!(matches!(h.engine.begin(&req), Err(Error::Store(_))));
    ensure!(matches!(h.engine.inspect(&key("k1")), Err(Error::Store(_))));
    ensure!(matches!(h.engine.sweep(10), Err(Error::Store(_))));
    ensure!(matches!(
        h.engine.reconcile("order.create", &req.policy, 10),
        Err(Error::Store(_))
    ));
    m.reconnect();
    ensure!(matches!(h.engine.begin(&req)?, Decision::Execute(_)));
    Ok(())
}

/// An engine remembers the records it claimed: the owner's write that
/// follows swaps without reading the record back. The swap still decides:
/// a record that another engine took over meanwhile is refused, nothing is
/// written, and the late owner hears that it lost the key.
#[test]
fn an_owners_write_after_its_claim_does_not_read_and_the_swap_still_fences() -> Result<()> {
    let (h, m) = harness()?;
    let req = request("k1", "{}");
    let Decision::Execute(t) = h.engine.begin(&req)? else {
        bail!("execute");
    };
    let (gets, swaps) = (m.calls(Op::Get), m.calls(Op::CompareAndSwap));
    let s = Success::with_ref("order-1");
    ensure!(h.engine.complete(&t, &req.policy, &s)? == Completion::Recorded(Status::Succeeded));
    ensure!(
        m.calls(Op::Get) == gets,
        "complete read the record it had claimed"
    );
    ensure!(m.calls(Op::CompareAndSwap) == swaps + 1);
    ensure!(matches!(h.engine.begin(&req)?, Decision::Replay(_)));

    // Another engine (other instances) takes the key over after the lease.
    let req = request("k2", "{}");
    let Decision::Execute(late) = h.engine.begin(&req)? else {
        bail!("execute");
    };
    h.clock.advance(req.policy.lease_ms);
    let other = h.engine_with_clock(h.clock.clone())?;
    let Decision::Execute(owner) = other.begin(&req)? else {
        bail!("the lease is over: taken over");
    };
    ensure!(owner.fencing_token == late.fencing_token + 1);
    let taken = m.snapshot();
    let gets = m.calls(Op::Get);
    let too_late = Failure {
        code: "late".into(),
        message: "too late".into(),
        response: None,
    };
    ensure!(
        h.engine
            .fail(&late, &req.policy, &too_late, Disposition::Final)?
            == Completion::LostOwnership
    );
    ensure!(m.snapshot() == taken, "a fenced owner wrote");
    ensure!(
        m.calls(Op::Get) == gets,
        "the refused swap answered the record"
    );
    ensure!(other.complete(&owner, &req.policy, &s)? == Completion::Recorded(Status::Succeeded));
    Ok(())
}
