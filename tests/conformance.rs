//! The engine conformance suite: every decision and transition, through the
//! real `.wasm` component, written once and run against every backend.

mod common;

use anyhow::{Result, bail, ensure};
use common::{Harness, T0, key, policy, request};
use idem::{
    ActionResult, BeginRequest, BodyKind, Completion, Decision, Disposition, Error, ExpiredLease,
    Extension, Failure, FailureMode, InProgressMode, InputField, InputRule, Policy, Resolution,
    RunOutcome, Settlement, Status, StoredResponse, Success, Ticket, WaitSpec,
};

fn execute(h: &Harness, req: &BeginRequest) -> Result<Ticket> {
    match h.engine.begin(req)? {
        Decision::Execute(t) => Ok(t),
        other => bail!("expected execute, got {other:?}"),
    }
}

fn response(body: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            ("x-raw".into(), vec![0xff, 0x00, 0x80]),
        ],
        body: body.as_bytes().to_vec(),
    }
}

fn failure(code: &str) -> Failure {
    Failure {
        code: code.into(),
        message: "the card was declined".into(),
        response: Some(StoredResponse {
            status: 402,
            headers: vec![],
            body: b"{\"error\":\"declined\"}".to_vec(),
        }),
    }
}

fn status_of(h: &Harness, k: &str) -> Result<Option<Status>> {
    Ok(h.engine.inspect(&key(k))?.map(|s| s.status))
}

// ---------------------------------------------------------------- execute

fn new_key_executes(h: &Harness) -> Result<()> {
    let req = request("k1", r#"{"sku":"A1","qty":2}"#);
    let t = execute(h, &req)?;
    ensure!(t.fencing_token == 1 && t.attempt == 1, "{t:?}");
    ensure!(t.lease_until == T0 + req.policy.lease_ms, "{t:?}");
    ensure!(t.record_id > 0, "{t:?}");
    let s = h.engine.inspect(&key("k1"))?.expect("record exists");
    ensure!(s.status == Status::Processing, "{s:?}");
    ensure!(
        s.lease_until == Some(t.lease_until) && s.attempts == 1,
        "{s:?}"
    );
    ensure!(
        s.fingerprint.len() == 64 && s.fingerprint_version == 2,
        "{s:?}"
    );
    Ok(())
}

fn success_is_replayed(h: &Harness) -> Result<()> {
    let req = request("k1", r#"{"sku":"A1","qty":2}"#);
    let t = execute(h, &req)?;
    h.clock.advance(250);
    let success = Success {
        result_ref: Some("order-1001".into()),
        response: Some(response(r#"{"order":"order-1001"}"#)),
    };
    ensure!(
        h.engine.complete(&t, &req.policy, &success)? == Completion::Recorded(Status::Succeeded)
    );
    // The same logical JSON, another key order and spacing: still a replay.
    let again = request("k1", "{ \"qty\" : 2.0, \"sku\" : \"A1\" }");
    for _ in 0..3 {
        match h.engine.begin(&again)? {
            Decision::Replay(r) => {
                ensure!(r.result_ref.as_deref() == Some("order-1001"));
                ensure!(
                    r.response == success.response,
                    "the response is replayed verbatim"
                );
                ensure!(r.completed_at == T0 + 250);
            }
            other => bail!("expected replay, got {other:?}"),
        }
    }
    let s = h.engine.inspect(&key("k1"))?.expect("record");
    ensure!(s.status == Status::Succeeded && s.attempts == 1, "{s:?}");
    ensure!(
        s.expires_at == Some(T0 + 250 + req.policy.retention_ms),
        "{s:?}"
    );
    Ok(())
}

fn in_flight_duplicate_is_in_progress(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    let t = execute(h, &req)?;
    h.clock.advance(29_500);
    match h.engine.begin(&req)? {
        Decision::InProgress(b) => {
            ensure!(b.lease_until == t.lease_until);
            ensure!(
                b.retry_after_ms == 500,
                "capped by what the lease has left: {b:?}"
            );
        }
        other => bail!("expected in-progress, got {other:?}"),
    }
    let fresh = request("k2", "{}");
    execute(h, &fresh)?;
    h.clock.advance(1);
    match h.engine.begin(&fresh)? {
        Decision::InProgress(b) => ensure!(b.retry_after_ms == 1_000, "capped by policy: {b:?}"),
        other => bail!("expected in-progress, got {other:?}"),
    }
    Ok(())
}

// ---------------------------------------------------------------- leases

fn lease_boundary(h: &Harness, offset: i64, expect_takeover: bool) -> Result<()> {
    let req = request("k1", "{}");
    let t = execute(h, &req)?;
    h.clock
        .set(t.lease_until.checked_add_signed(offset).expect("time"));
    match (h.engine.begin(&req)?, expect_takeover) {
        (Decision::InProgress(_), false) => Ok(()),
        (Decision::Execute(t2), true) => {
            ensure!(t2.fencing_token == t.fencing_token + 1, "{t2:?}");
            ensure!(t2.attempt == 2 && t2.record_id == t.record_id, "{t2:?}");
            ensure!(t2.lease_until == h.now() + req.policy.lease_ms);
            Ok(())
        }
        (other, _) => bail!("offset {offset}: unexpected {other:?}"),
    }
}

fn lease_one_ms_before_deadline_is_live(h: &Harness) -> Result<()> {
    lease_boundary(h, -1, false)
}

fn lease_at_deadline_is_expired(h: &Harness) -> Result<()> {
    lease_boundary(h, 0, true)
}

fn lease_one_ms_after_deadline_is_expired(h: &Harness) -> Result<()> {
    lease_boundary(h, 1, true)
}

fn stale_owner_is_fenced(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    let old = execute(h, &req)?;
    h.clock.set(old.lease_until);
    let new = execute(h, &req)?;
    let p = &req.policy;
    ensure!(h.engine.complete(&old, p, &Success::with_ref("stale"))? == Completion::LostOwnership);
    ensure!(
        h.engine.fail(&old, p, &failure("x"), Disposition::Final)? == Completion::LostOwnership
    );
    ensure!(h.engine.extend(&old, p)? == Extension::LostOwnership);
    ensure!(status_of(h, "k1")? == Some(Status::Processing));
    ensure!(
        h.engine.complete(&new, p, &Success::with_ref("fresh"))?
            == Completion::Recorded(Status::Succeeded)
    );
    // The stale owner cannot overwrite the newer outcome either.
    ensure!(h.engine.complete(&old, p, &Success::with_ref("stale"))? == Completion::LostOwnership);
    match h.engine.begin(&req)? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("fresh")),
        other => bail!("{other:?}"),
    }
    Ok(())
}

fn extend_keeps_the_key(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    let t = execute(h, &req)?;
    h.clock.advance(20_000);
    let until = match h.engine.extend(&t, &req.policy)? {
        Extension::Extended(until) => until,
        other => bail!("{other:?}"),
    };
    ensure!(until == T0 + 20_000 + 30_000);
    h.clock.set(t.lease_until + 5);
    ensure!(matches!(h.engine.begin(&req)?, Decision::InProgress(_)));
    // The extended owner still completes with its original ticket.
    ensure!(
        h.engine.complete(&t, &req.policy, &Success::default())?
            == Completion::Recorded(Status::Succeeded)
    );
    Ok(())
}

fn late_owner_completes_when_nobody_took_over(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    let t = execute(h, &req)?;
    h.clock.set(t.lease_until + 10_000);
    ensure!(
        h.engine
            .complete(&t, &req.policy, &Success::with_ref("late"))?
            == Completion::Recorded(Status::Succeeded)
    );
    ensure!(matches!(h.engine.begin(&req)?, Decision::Replay(_)));
    Ok(())
}

fn expired_lease_manual_is_outcome_unknown(h: &Harness) -> Result<()> {
    let mut req = request("k1", "{}");
    req.policy.expired_lease = ExpiredLease::Manual;
    let t = execute(h, &req)?;
    h.clock.set(t.lease_until);
    match h.engine.begin(&req)? {
        Decision::OutcomeUnknown(u) => ensure!(u.since == t.lease_until && u.attempts == 1),
        other => bail!("{other:?}"),
    }
    let s = h.engine.inspect(&key("k1"))?.expect("record");
    ensure!(s.fencing_token == 1, "manual never takes over: {s:?}");
    Ok(())
}

fn expired_lease_reconcile_finds_result(h: &Harness) -> Result<()> {
    let mut req = request("k1", "{}");
    req.policy.expired_lease = ExpiredLease::Reconcile;
    let t = execute(h, &req)?;
    h.results.insert(&key("k1"), "order-7");
    h.clock.set(t.lease_until);
    match h.engine.begin(&req)? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-7")),
        other => bail!("{other:?}"),
    }
    let s = h.engine.inspect(&key("k1"))?.expect("record");
    ensure!(
        s.status == Status::Succeeded && s.attempts == 1,
        "nothing ran again: {s:?}"
    );
    ensure!(h.engine.complete(&t, &req.policy, &Success::default())? == Completion::LostOwnership);
    Ok(())
}

fn expired_lease_reconcile_not_found_executes(h: &Harness) -> Result<()> {
    let mut req = request("k1", "{}");
    req.policy.expired_lease = ExpiredLease::Reconcile;
    let t = execute(h, &req)?;
    h.clock.set(t.lease_until + 1);
    let t2 = execute(h, &req)?;
    ensure!(t2.fencing_token == 2 && t2.attempt == 2, "{t2:?}");
    Ok(())
}

fn expired_lease_reconcile_lookup_error_is_an_error(h: &Harness) -> Result<()> {
    let mut req = request("k1", "{}");
    req.policy.expired_lease = ExpiredLease::Reconcile;
    let t = execute(h, &req)?;
    h.results.set_failing(true);
    h.clock.set(t.lease_until);
    match h.engine.begin(&req) {
        Err(Error::Store(_)) => {}
        other => bail!("a failed lookup must never let the action run: {other:?}"),
    }
    // The key is handed back, still stale: the next request asks again
    // instead of waiting out a lease nobody holds.
    let s = h.engine.inspect(&key("k1"))?.expect("record");
    ensure!(
        s.lease_until == Some(t.lease_until) && s.attempts == 1,
        "{s:?}"
    );
    h.results.set_failing(false);
    let t2 = execute(h, &req)?;
    ensure!(t2.attempt == 2, "{t2:?}");
    Ok(())
}

// ---------------------------------------------------------------- mismatch

fn different_body_is_mismatch(h: &Harness) -> Result<()> {
    let req = request("k1", r#"{"sku":"A1"}"#);
    let t = execute(h, &req)?;
    let other = request("k1", r#"{"sku":"B2"}"#);
    let stored_fp = h.engine.inspect(&key("k1"))?.expect("record").fingerprint;
    match h.engine.begin(&other)? {
        Decision::Mismatch(m) => {
            ensure!(
                m.stored_prefix == stored_fp[..8] && m.stored_version == 2,
                "{m:?}"
            )
        }
        d => bail!("mismatch while in flight, got {d:?}"),
    }
    let success = Success {
        result_ref: Some("order-1".into()),
        response: Some(response("secret")),
    };
    h.engine.complete(&t, &req.policy, &success)?;
    match h.engine.begin(&other)? {
        Decision::Mismatch(m) => ensure!(!format!("{m:?}").contains("secret")),
        d => bail!("mismatch after success, got {d:?}"),
    }
    Ok(())
}

fn different_attributes_are_mismatch(h: &Harness) -> Result<()> {
    let mut req = request("k1", "{}");
    req.attributes = vec![
        ("method".into(), "POST".into()),
        ("path".into(), "/orders".into()),
    ];
    execute(h, &req)?;
    let mut other = req.clone();
    other.attributes[1].1 = "/refunds".into();
    ensure!(matches!(h.engine.begin(&other)?, Decision::Mismatch(_)));
    Ok(())
}

fn fingerprint_fields_ignore_volatile_data(h: &Harness) -> Result<()> {
    let mut p = policy();
    p.fingerprint_fields = vec!["/amount".into(), "/currency".into()];
    let first = BeginRequest::json(
        key("k1"),
        r#"{"amount":10,"currency":"EUR","ts":1}"#,
        p.clone(),
    );
    let t = execute(h, &first)?;
    h.engine.complete(&t, &p, &Success::with_ref("pay-1"))?;
    let retry = BeginRequest::json(
        key("k1"),
        r#"{"ts":2,"currency":"EUR","amount":10}"#,
        p.clone(),
    );
    ensure!(matches!(h.engine.begin(&retry)?, Decision::Replay(_)));
    let changed = BeginRequest::json(key("k1"), r#"{"amount":11,"currency":"EUR","ts":1}"#, p);
    ensure!(matches!(h.engine.begin(&changed)?, Decision::Mismatch(_)));
    Ok(())
}

fn scopes_are_isolated(h: &Harness) -> Result<()> {
    let a = request("k1", "{}");
    let t = execute(h, &a)?;
    h.engine
        .complete(&t, &a.policy, &Success::with_ref("a's order"))?;
    let mut b = request("k1", r#"{"other":"payload"}"#);
    b.key.scope = "tenant-2".into();
    let tb = execute(h, &b)?;
    ensure!(tb.record_id != t.record_id);
    let mut c = request("k1", "{}");
    c.key.biz_type = "refund.create".into();
    execute(h, &c)?;
    Ok(())
}

// ---------------------------------------------------------------- failures

fn final_failure_is_replayed(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    let t = execute(h, &req)?;
    let f = failure("card-declined");
    ensure!(
        h.engine.fail(&t, &req.policy, &f, Disposition::Final)?
            == Completion::Recorded(Status::Failed)
    );
    for _ in 0..2 {
        match h.engine.begin(&req)? {
            Decision::Failed(got) => ensure!(got == f, "{got:?}"),
            other => bail!("{other:?}"),
        }
    }
    ensure!(status_of(h, "k1")? == Some(Status::Failed));
    Ok(())
}

fn retryable_failure_releases_the_key(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    let t = execute(h, &req)?;
    ensure!(
        h.engine.fail(
            &t,
            &req.policy,
            &failure("upstream-503"),
            Disposition::Retryable
        )? == Completion::Recorded(Status::Released)
    );
    ensure!(status_of(h, "k1")? == Some(Status::Released));
    let t2 = execute(h, &req)?;
    ensure!(t2.attempt == 2 && t2.fencing_token == 2, "{t2:?}");
    ensure!(h.engine.complete(&t, &req.policy, &Success::default())? == Completion::LostOwnership);
    // A different payload under a released key is still a mismatch.
    h.engine
        .fail(&t2, &req.policy, &failure("again"), Disposition::Retryable)?;
    ensure!(matches!(
        h.engine.begin(&request("k1", "[1]"))?,
        Decision::Mismatch(_)
    ));
    Ok(())
}

fn always_final_stores_retryable_failures(h: &Harness) -> Result<()> {
    let mut req = request("k1", "{}");
    req.policy.failure_mode = FailureMode::AlwaysFinal;
    let t = execute(h, &req)?;
    h.engine.fail(
        &t,
        &req.policy,
        &failure("http-500"),
        Disposition::Retryable,
    )?;
    ensure!(matches!(h.engine.begin(&req)?, Decision::Failed(_)));
    Ok(())
}

/// Executes `req` and reports its outcome unknown (a timeout).
fn unknown_outcome(h: &Harness, req: &BeginRequest) -> Result<Ticket> {
    let t = execute(h, req)?;
    h.engine.fail(
        &t,
        &req.policy,
        &failure("timeout"),
        Disposition::OutcomeUnknown,
    )?;
    Ok(t)
}

fn outcome_unknown_blocks_the_key(h: &Harness) -> Result<()> {
    let mut req = request("k1", "{}");
    req.policy.expired_lease = ExpiredLease::Manual;
    unknown_outcome(h, &req)?;
    h.clock.advance(10 * req.policy.retention_ms);
    match h.engine.begin(&req)? {
        Decision::OutcomeUnknown(u) => {
            ensure!(u.failure.as_ref().map(|f| f.code.as_str()) == Some("timeout"));
            ensure!(u.since == T0 && u.attempts == 1, "{u:?}");
        }
        other => bail!("{other:?}"),
    }
    ensure!(h.engine.sweep(100)? == 0, "outcome-unknown is never swept");
    ensure!(status_of(h, "k1")? == Some(Status::OutcomeUnknown));
    Ok(())
}

fn outcome_unknown_follows_the_policy_once_the_lease_ends(h: &Harness) -> Result<()> {
    // By default an unknown outcome stays blocked, although expired leases
    // are taken over: the action may have run.
    let req = request("k0", "{}");
    ensure!(req.policy.expired_lease == ExpiredLease::TakeOver);
    ensure!(req.policy.outcome_unknown == ExpiredLease::Manual);
    let t = unknown_outcome(h, &req)?;
    h.clock.set(t.lease_until + req.policy.retention_ms * 2);
    ensure!(matches!(h.engine.begin(&req)?, Decision::OutcomeUnknown(_)));
    ensure!(status_of(h, "k0")? == Some(Status::OutcomeUnknown));
    // Under `take-over`, it runs again once the lease has ended.
    let mut req = request("k1", "{}");
    req.policy.outcome_unknown = ExpiredLease::TakeOver;
    let t = unknown_outcome(h, &req)?;
    h.clock.set(t.lease_until - 1);
    ensure!(matches!(h.engine.begin(&req)?, Decision::OutcomeUnknown(_)));
    h.clock.set(t.lease_until);
    let t2 = execute(h, &req)?;
    ensure!(
        t2.fencing_token == 2 && t2.attempt == 2,
        "take-over: {t2:?}"
    );
    // Under `reconcile`, the business data is asked first.
    let mut req = request("k2", "{}");
    req.policy.outcome_unknown = ExpiredLease::Reconcile;
    let t = unknown_outcome(h, &req)?;
    h.results.insert(&key("k2"), "order-2");
    h.clock.set(t.lease_until);
    match h.engine.begin(&req)? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-2")),
        other => bail!("{other:?}"),
    }
    Ok(())
}

fn retried_complete_is_idempotent(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    let t = execute(h, &req)?;
    let s = Success::with_ref("order-1");
    ensure!(h.engine.complete(&t, &req.policy, &s)? == Completion::Recorded(Status::Succeeded));
    ensure!(h.engine.complete(&t, &req.policy, &s)? == Completion::Recorded(Status::Succeeded));
    ensure!(
        h.engine
            .complete(&t, &req.policy, &Success::with_ref("other"))?
            == Completion::LostOwnership,
        "a different outcome never overwrites the stored one"
    );
    Ok(())
}

// ---------------------------------------------------------------- expiry and sweep

fn expired_record_is_replaced(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    let t = execute(h, &req)?;
    h.engine
        .complete(&t, &req.policy, &Success::with_ref("first"))?;
    h.clock.set(T0 + req.policy.retention_ms - 1);
    ensure!(matches!(h.engine.begin(&req)?, Decision::Replay(_)));
    h.clock.set(T0 + req.policy.retention_ms);
    let s = h.engine.inspect(&key("k1"))?.expect("record");
    ensure!(s.expired, "{s:?}");
    // Past retention the key counts as absent, even for another payload.
    let t2 = execute(h, &request("k1", r#"{"new":true}"#))?;
    ensure!(
        t2.record_id == t.record_id && t2.fencing_token == 2 && t2.attempt == 1,
        "{t2:?}"
    );
    ensure!(h.engine.complete(&t, &req.policy, &Success::default())? == Completion::LostOwnership);
    Ok(())
}

fn expired_failures_are_replaced_too(h: &Harness) -> Result<()> {
    let p = policy();
    let t = execute(h, &request("failed", "{}"))?;
    h.engine.fail(&t, &p, &failure("x"), Disposition::Final)?;
    let t = execute(h, &request("released", "{}"))?;
    h.engine
        .fail(&t, &p, &failure("x"), Disposition::Retryable)?;
    h.clock.advance(p.retention_ms);
    for k in ["failed", "released"] {
        let t = execute(h, &request(k, r#"{"another":"request"}"#))?;
        ensure!(t.attempt == 1 && t.fencing_token == 2, "{k}: {t:?}");
    }
    Ok(())
}

fn impossible_records_are_reported_corrupt(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    execute(h, &req)?;
    let mut rec = h.storage().get(&key("k1"))?.expect("record");
    let revision = rec.revision;
    rec.revision += 1;
    rec.lease_until = None; // processing without a lease: never written by the engine
    ensure!(h.storage().compare_and_swap(revision, &rec)? == idem::SwapOutcome::Swapped);
    match h.engine.begin(&req) {
        Err(Error::Corrupt(msg)) => ensure!(msg.contains("status"), "{msg}"),
        other => bail!("expected corrupt, got {other:?}"),
    }
    ensure!(matches!(
        h.engine.inspect(&key("k1")),
        Err(Error::Corrupt(_))
    ));
    Ok(())
}

fn sweep_deletes_only_expired_settled_records(h: &Harness) -> Result<()> {
    let p = policy();
    for i in 0..5 {
        let req = request(&format!("done-{i}"), "{}");
        let t = execute(h, &req)?;
        h.engine.complete(&t, &p, &Success::default())?;
    }
    let t = execute(h, &request("failed", "{}"))?;
    h.engine.fail(&t, &p, &failure("x"), Disposition::Final)?;
    let t = execute(h, &request("released", "{}"))?;
    h.engine
        .fail(&t, &p, &failure("x"), Disposition::Retryable)?;
    let t = execute(h, &request("unknown", "{}"))?;
    h.engine
        .fail(&t, &p, &failure("x"), Disposition::OutcomeUnknown)?;
    execute(h, &request("processing", "{}"))?;
    ensure!(h.engine.sweep(100)? == 0, "nothing has expired yet");
    h.clock.advance(p.retention_ms - 1);
    ensure!(h.engine.sweep(100)? == 0);
    h.clock.advance(1);
    ensure!(h.engine.sweep(3)? == 3, "bounded batch");
    ensure!(h.engine.sweep(100)? == 4);
    ensure!(h.engine.sweep(100)? == 0);
    ensure!(h.record_count()? == 2);
    ensure!(status_of(h, "processing")? == Some(Status::Processing));
    ensure!(status_of(h, "unknown")? == Some(Status::OutcomeUnknown));
    Ok(())
}

// ---------------------------------------------------------------- reconcile

fn abandon(h: &Harness, k: &str, p: &Policy) -> Result<Ticket> {
    execute(h, &BeginRequest::json(key(k), "{}", p.clone()))
}

fn an_operator_settles_stuck_keys_and_only_those(h: &Harness) -> Result<()> {
    let p = policy();
    // Stuck: an owner that crashed (past its lease) and an unknown outcome.
    let crashed = abandon(h, "crashed", &p)?;
    let unknown_req = request("unknown", "{}");
    let unknown = unknown_outcome(h, &unknown_req)?;
    let live = abandon(h, "live", &p)?;
    // Within the lease of the attempt that reported it, the unknown
    // outcome's action may still land: no release yet.
    h.clock.set(unknown.lease_until - 1);
    ensure!(
        h.engine
            .settle(&key("unknown"), &p, &Resolution::Released)?
            == Settlement::NotStuck
    );
    h.clock.set(crashed.lease_until.max(unknown.lease_until));
    // `live` was claimed at the same time, so extend it first.
    ensure!(matches!(
        h.engine.extend(&live, &p)?,
        Extension::Extended(_)
    ));
    let response = response("{\"order\":\"o-7\"}");
    let succeeded = Resolution::Succeeded(Success {
        result_ref: Some("o-7".into()),
        response: Some(response.clone()),
    });
    ensure!(h.engine.settle(&key("crashed"), &p, &succeeded)? == Settlement::Settled);
    ensure!(
        h.engine
            .settle(&key("unknown"), &p, &Resolution::Released)?
            == Settlement::Settled
    );
    ensure!(h.engine.settle(&key("live"), &p, &Resolution::Released)? == Settlement::NotStuck);
    ensure!(h.engine.settle(&key("none"), &p, &Resolution::Released)? == Settlement::Absent);
    // A settled key is not stuck any more.
    ensure!(
        h.engine
            .settle(&key("crashed"), &p, &Resolution::Released)?
            == Settlement::NotStuck
    );
    // The crashed owner's late completion is refused; the operator's
    // answer is replayed.
    let late = h
        .engine
        .complete(&crashed, &p, &Success::with_ref("late"))?;
    ensure!(late == Completion::LostOwnership, "{late:?}");
    match h.engine.begin(&request("crashed", "{}"))? {
        Decision::Replay(r) => {
            ensure!(r.result_ref.as_deref() == Some("o-7") && r.response == Some(response));
        }
        other => bail!("expected the settled answer, got {other:?}"),
    }
    // A released key runs again, under a new token.
    let t = execute(h, &unknown_req)?;
    ensure!(t.fencing_token == unknown.fencing_token + 2, "{t:?}");
    // A bad resolution names its field and writes nothing.
    let stuck = abandon(h, "stuck", &p)?;
    h.clock.set(stuck.lease_until);
    let bad = Resolution::Failed(Failure {
        code: "has space".into(),
        message: String::new(),
        response: None,
    });
    match h.engine.settle(&key("stuck"), &p, &bad) {
        Err(Error::Invalid(i)) => ensure!(i.field == InputField::FailureInfo, "{i:?}"),
        other => bail!("expected invalid, got {other:?}"),
    }
    ensure!(status_of(h, "stuck")? == Some(Status::Processing));
    Ok(())
}

fn a_background_reconciler_settles_stale_records_by_policy(h: &Harness) -> Result<()> {
    let p = policy();
    let found = abandon(h, "found", &p)?;
    abandon(h, "missing", &p)?;
    unknown_outcome(h, &request("unknown", "{}"))?;
    h.results.insert(&key("found"), "order-1");
    h.clock.set(found.lease_until);
    // Batches of one: the reconciler goes on until a batch comes back
    // short, then waits for the next round.
    let one = std::num::NonZeroU32::MIN;
    let reconciler = h.engine.spawn_reconciler(
        vec![("order.create".into(), p.clone())],
        std::time::Duration::from_millis(5),
        one,
    )?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while reconciler.totals().rounds < 2 {
        ensure!(
            std::time::Instant::now() < deadline,
            "{:?}",
            reconciler.totals()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let totals = reconciler.stop();
    ensure!(
        totals.succeeded == 1 && totals.released == 1 && totals.errors == 0,
        "{totals:?}"
    );
    // The unknown outcome is examined each round and left for an operator
    // (outcome_unknown = manual): never released.
    ensure!(totals.left_for_manual >= 2, "{totals:?}");
    ensure!(status_of(h, "found")? == Some(Status::Succeeded));
    ensure!(status_of(h, "missing")? == Some(Status::Released));
    ensure!(status_of(h, "unknown")? == Some(Status::OutcomeUnknown));
    Ok(())
}

fn reconcile_found_marks_succeeded(h: &Harness) -> Result<()> {
    let p = policy();
    let t = abandon(h, "k1", &p)?;
    abandon(h, "live", &p)?;
    h.results.insert(&key("k1"), "order-9");
    h.clock.set(t.lease_until - 1);
    ensure!(
        h.engine.reconcile("order.create", &p, 10)?.examined == 0,
        "live leases are left"
    );
    h.clock.set(t.lease_until);
    let r = h.engine.reconcile("order.create", &p, 10)?;
    ensure!(
        r.examined == 2 && r.succeeded == 1 && r.released == 1,
        "{r:?}"
    );
    match h
        .engine
        .begin(&BeginRequest::json(key("k1"), "{}", p.clone()))?
    {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-9")),
        other => bail!("{other:?}"),
    }
    ensure!(h.engine.complete(&t, &p, &Success::default())? == Completion::LostOwnership);
    Ok(())
}

fn reconcile_not_found_releases(h: &Harness) -> Result<()> {
    let p = policy();
    let t = abandon(h, "k1", &p)?;
    h.clock.set(t.lease_until);
    let r = h.engine.reconcile("order.create", &p, 10)?;
    ensure!(r.examined == 1 && r.released == 1, "{r:?}");
    ensure!(status_of(h, "k1")? == Some(Status::Released));
    let t2 = execute(h, &BeginRequest::json(key("k1"), "{}", p))?;
    ensure!(
        t2.attempt == 2 && t2.fencing_token == 3,
        "reconcile took a token too: {t2:?}"
    );
    Ok(())
}

fn reconcile_not_found_manual_is_left(h: &Harness) -> Result<()> {
    let mut p = policy();
    p.expired_lease = ExpiredLease::Manual;
    let t = abandon(h, "k1", &p)?;
    h.clock.set(t.lease_until);
    let r = h.engine.reconcile("order.create", &p, 10)?;
    ensure!(r.left_for_manual == 1, "{r:?}");
    ensure!(status_of(h, "k1")? == Some(Status::OutcomeUnknown));
    ensure!(matches!(
        h.engine
            .begin(&BeginRequest::json(key("k1"), "{}", p.clone()))?,
        Decision::OutcomeUnknown(_)
    ));
    // Found later: the operator's next reconcile settles it.
    h.results.insert(&key("k1"), "order-3");
    let r = h.engine.reconcile("order.create", &p, 10)?;
    ensure!(r.succeeded == 1, "{r:?}");
    ensure!(status_of(h, "k1")? == Some(Status::Succeeded));
    Ok(())
}

fn outcome_unknown_is_reconciled(h: &Harness) -> Result<()> {
    // By default (`outcome_unknown = manual`) a result that is not found
    // leaves the key blocked for an operator; under `take-over` it is
    // released for a new attempt.
    // (`take-over` first: the key `manual` leaves blocked stays stale, and
    // a later run would examine it again.)
    for (mode, found, missing) in [
        (ExpiredLease::TakeOver, "found-t", "missing-t"),
        (ExpiredLease::Manual, "found-m", "missing-m"),
    ] {
        let p = Policy {
            outcome_unknown: mode,
            ..policy()
        };
        let mut lease_until = 0;
        for k in [found, missing] {
            let t = abandon(h, k, &p)?;
            h.engine
                .fail(&t, &p, &failure("timeout"), Disposition::OutcomeUnknown)?;
            lease_until = lease_until.max(t.lease_until);
        }
        h.results.insert(&key(found), "order-5");
        // Within the reporting owner's lease the action may still land:
        // nothing is examined, and the key stays blocked.
        h.clock.set(lease_until - 1);
        let r = h.engine.reconcile("order.create", &p, 10)?;
        ensure!(
            r.examined == 0,
            "{mode:?}: examined within the lease: {r:?}"
        );
        ensure!(status_of(h, found)? == Some(Status::OutcomeUnknown));
        let req = BeginRequest::json(key(missing), "{}", p.clone());
        ensure!(matches!(h.engine.begin(&req)?, Decision::OutcomeUnknown(_)));
        // Once it has ended, both are examined.
        h.clock.set(lease_until);
        let r = h.engine.reconcile("order.create", &p, 10)?;
        ensure!(r.examined == 2 && r.succeeded == 1, "{mode:?}: {r:?}");
        ensure!(status_of(h, found)? == Some(Status::Succeeded));
        if mode == ExpiredLease::Manual {
            ensure!(r.left_for_manual == 1 && r.released == 0, "{r:?}");
            ensure!(status_of(h, missing)? == Some(Status::OutcomeUnknown));
            ensure!(matches!(h.engine.begin(&req)?, Decision::OutcomeUnknown(_)));
        } else {
            ensure!(r.released == 1 && r.left_for_manual == 0, "{r:?}");
            ensure!(status_of(h, missing)? == Some(Status::Released));
            let t = execute(h, &req)?;
            ensure!(t.attempt == 2, "{t:?}");
            // Settled, so that the next round's reconcile leaves it alone.
            let done = h.engine.complete(&t, &p, &Success::with_ref("order-6"))?;
            ensure!(done == Completion::Recorded(Status::Succeeded), "{done:?}");
        }
    }
    Ok(())
}

fn reconcile_respects_its_limit(h: &Harness) -> Result<()> {
    let p = policy();
    for i in 0..5 {
        abandon(h, &format!("k{i}"), &p)?;
    }
    h.clock.advance(p.lease_ms);
    ensure!(h.engine.reconcile("order.create", &p, 2)?.examined == 2);
    ensure!(h.engine.reconcile("order.create", &p, 10)?.examined == 3);
    ensure!(h.engine.reconcile("order.create", &p, 10)?.examined == 0);
    Ok(())
}

fn reconcile_lookup_error_leaves_record(h: &Harness) -> Result<()> {
    let p = policy();
    let t = abandon(h, "k1", &p)?;
    h.clock.set(t.lease_until);
    h.results.set_failing(true);
    let r = h.engine.reconcile("order.create", &p, 10)?;
    ensure!(
        r.lookup_errors == 1 && r.succeeded == 0 && r.released == 0,
        "{r:?}"
    );
    ensure!(status_of(h, "k1")? == Some(Status::Processing));
    h.results.set_failing(false);
    let r = h.engine.reconcile("order.create", &p, 10)?;
    ensure!(r.released == 1, "still stale, examined again: {r:?}");
    Ok(())
}

fn reconcile_only_touches_its_biz_type(h: &Harness) -> Result<()> {
    let p = policy();
    let t = abandon(h, "k1", &p)?;
    h.clock.set(t.lease_until);
    let r = h.engine.reconcile("refund.create", &p, 10)?;
    ensure!(r.examined == 0, "{r:?}");
    Ok(())
}

// ---------------------------------------------------------------- waiting

fn wait_mode_gives_up_after_max_wait(h: &Harness) -> Result<()> {
    let mut req = request("k1", "{}");
    req.policy.in_progress = InProgressMode::Wait(WaitSpec {
        max_wait_ms: 2_000,
        poll_interval_ms: 300,
    });
    execute(h, &req)?;
    let before = h.now();
    ensure!(matches!(h.engine.begin(&req)?, Decision::InProgress(_)));
    ensure!(h.now() - before == 2_000, "waited {} ms", h.now() - before);
    Ok(())
}

/// A clock whose first `pause` runs a hook: another request completing
/// while this one waits, without any real sleeping.
struct HookClock {
    inner: idem::ManualClock,
    hook: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl idem::Clock for HookClock {
    fn now(&self) -> u64 {
        self.inner.read()
    }
    fn pause(&self, duration_ms: u64) {
        self.inner.advance(duration_ms);
        let hook = self.hook.lock().expect("hook").take();
        if let Some(hook) = hook {
            hook();
        }
    }
}

fn wait_mode_replays_when_the_first_completes(h: &Harness) -> Result<()> {
    let mut req = request("k1", "{}");
    req.policy.in_progress = InProgressMode::Wait(WaitSpec {
        max_wait_ms: 5_000,
        poll_interval_ms: 250,
    });
    let t = execute(h, &req)?;
    let (first, policy) = (h.engine.clone(), req.policy.clone());
    let waiter = h.engine_with_clock(HookClock {
        inner: h.clock.clone(),
        hook: std::sync::Mutex::new(Some(Box::new(move || {
            let done = first.complete(&t, &policy, &Success::with_ref("order-1"));
            assert_eq!(
                done.expect("complete"),
                Completion::Recorded(Status::Succeeded)
            );
        }))),
    })?;
    let before = h.now();
    match waiter.begin(&req)? {
        Decision::Replay(r) => ensure!(r.result_ref.as_deref() == Some("order-1")),
        other => bail!("expected the waiter to get the replay, got {other:?}"),
    }
    ensure!(
        h.now() - before == 250,
        "one poll interval, not the whole wait"
    );
    Ok(())
}

// ---------------------------------------------------------------- run API

fn run_executes_the_action_once(h: &Harness) -> Result<()> {
    let req = request("k1", r#"{"sku":"A1"}"#);
    let mut runs = 0;
    for _ in 0..3 {
        let outcome = h.engine.run(&req, |_| {
            runs += 1;
            ActionResult::Succeeded(Success::with_ref("order-1"))
        })?;
        if runs == 1 {
            continue;
        }
        ensure!(matches!(
            outcome,
            RunOutcome::NotExecuted(Decision::Replay(_))
        ));
    }
    ensure!(runs == 1);
    Ok(())
}

// ---------------------------------------------------------------- bad input

fn assert_invalid(
    h: &Harness,
    req: &BeginRequest,
    field: InputField,
    rule: InputRule,
) -> Result<()> {
    match h.engine.begin(req)? {
        Decision::Invalid(i) => {
            ensure!(i.field == field && i.rule == rule, "{i:?}");
            ensure!(!i.message.is_empty());
        }
        other => bail!("expected invalid {field:?}/{rule:?}, got {other:?}"),
    }
    ensure!(h.record_count()? == 0, "invalid input wrote nothing");
    Ok(())
}

fn bad_input_is_invalid_and_writes_nothing(h: &Harness) -> Result<()> {
    use InputField as F;
    use InputRule as R;
    assert_invalid(h, &request("", "{}"), F::IdemKey, R::Required)?;
    assert_invalid(h, &request(&"k".repeat(256), "{}"), F::IdemKey, R::TooLong)?;
    assert_invalid(h, &request("clé", "{}"), F::IdemKey, R::BadCharacter)?;
    assert_invalid(h, &request("a b", "{}"), F::IdemKey, R::BadCharacter)?;
    assert_invalid(h, &request("a\tb", "{}"), F::IdemKey, R::BadCharacter)?;
    let mut no_scope = request("k1", "{}");
    no_scope.key.scope = String::new();
    assert_invalid(h, &no_scope, F::Scope, R::Required)?;
    let mut no_biz = request("k1", "{}");
    no_biz.key.biz_type = String::new();
    assert_invalid(h, &no_biz, F::BizType, R::Required)?;
    assert_invalid(h, &request("k1", "{\"a\":"), F::Body, R::NotJson)?;
    assert_invalid(h, &request("k1", "{\"a\":1,\"a\":2}"), F::Body, R::NotJson)?;
    let mut big = request("k1", "[]");
    big.policy.max_body_bytes = 4;
    big.body = b"[1,2,3]".to_vec();
    assert_invalid(h, &big, F::Body, R::TooLong)?;
    let mut bad_policy = request("k1", "{}");
    bad_policy.policy.lease_ms = 0;
    assert_invalid(h, &bad_policy, F::Policy, R::OutOfRange)?;
    let mut raw_fields = BeginRequest::raw(key("k1"), "x", policy());
    raw_fields.policy.fingerprint_fields = vec!["/a".into()];
    assert_invalid(h, &raw_fields, F::Policy, R::BadFormat)?;
    let mut uuid = request("not-a-uuid", "{}");
    uuid.policy.key_format.charset = idem::KeyCharset::Uuid;
    assert_invalid(h, &uuid, F::IdemKey, R::BadFormat)?;
    // The boundary itself is accepted.
    ensure!(matches!(
        h.engine.begin(&request(&"k".repeat(255), "{}"))?,
        Decision::Execute(_)
    ));
    Ok(())
}

fn raw_bodies_are_hashed_as_bytes(h: &Harness) -> Result<()> {
    let mut req = BeginRequest::raw(key("k1"), b"\xff\x00not json".to_vec(), policy());
    req.body_kind = BodyKind::Raw;
    execute(h, &req)?;
    let mut other = req.clone();
    other.body = b"\xff\x00not json ".to_vec();
    ensure!(matches!(h.engine.begin(&other)?, Decision::Mismatch(_)));
    Ok(())
}

fn bad_completion_input_is_an_error(h: &Harness) -> Result<()> {
    let req = request("k1", "{}");
    let t = execute(h, &req)?;
    let huge = Success::with_ref("r".repeat(1025));
    match h.engine.complete(&t, &req.policy, &huge) {
        Err(Error::Invalid(i)) => ensure!(i.field == InputField::SuccessResult, "{i:?}"),
        other => bail!("{other:?}"),
    }
    let empty_code = Failure::default();
    match h
        .engine
        .fail(&t, &req.policy, &empty_code, Disposition::Final)
    {
        Err(Error::Invalid(i)) => ensure!(i.field == InputField::FailureInfo, "{i:?}"),
        other => bail!("{other:?}"),
    }
    ensure!(
        status_of(h, "k1")? == Some(Status::Processing),
        "nothing was written"
    );
    Ok(())
}

macro_rules! suite {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(#[test] fn $name() -> anyhow::Result<()> { super::$name(&super::Harness::memory()?) })*
        }
        mod sqlite {
            $(#[test] fn $name() -> anyhow::Result<()> { super::$name(&super::Harness::sqlite()?) })*
        }
        /// Skipped, with a printed reason, when IDEM_TEST_PG_URL is not set.
        mod postgres {
            $(#[test] fn $name() -> anyhow::Result<()> {
                let Some(h) = super::Harness::postgres()? else { return Ok(()) };
                super::$name(&h)
            })*
        }
    };
}

suite!(
    new_key_executes,
    success_is_replayed,
    in_flight_duplicate_is_in_progress,
    lease_one_ms_before_deadline_is_live,
    lease_at_deadline_is_expired,
    lease_one_ms_after_deadline_is_expired,
    stale_owner_is_fenced,
    extend_keeps_the_key,
    late_owner_completes_when_nobody_took_over,
    expired_lease_manual_is_outcome_unknown,
    expired_lease_reconcile_finds_result,
    expired_lease_reconcile_not_found_executes,
    expired_lease_reconcile_lookup_error_is_an_error,
    different_body_is_mismatch,
    different_attributes_are_mismatch,
    fingerprint_fields_ignore_volatile_data,
    scopes_are_isolated,
    final_failure_is_replayed,
    retryable_failure_releases_the_key,
    always_final_stores_retryable_failures,
    outcome_unknown_blocks_the_key,
    outcome_unknown_follows_the_policy_once_the_lease_ends,
    retried_complete_is_idempotent,
    expired_record_is_replaced,
    sweep_deletes_only_expired_settled_records,
    reconcile_found_marks_succeeded,
    reconcile_not_found_releases,
    reconcile_not_found_manual_is_left,
    reconcile_lookup_error_leaves_record,
    outcome_unknown_is_reconciled,
    an_operator_settles_stuck_keys_and_only_those,
    a_background_reconciler_settles_stale_records_by_policy,
    reconcile_respects_its_limit,
    expired_failures_are_replaced_too,
    impossible_records_are_reported_corrupt,
    wait_mode_replays_when_the_first_completes,
    reconcile_only_touches_its_biz_type,
    wait_mode_gives_up_after_max_wait,
    run_executes_the_action_once,
    bad_input_is_invalid_and_writes_nothing,
    raw_bodies_are_hashed_as_bytes,
    bad_completion_input_is_an_error,
);
