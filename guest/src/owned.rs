//! The records an engine instance wrote as an owner, so that the owner's
//! next write (`complete`, `fail`, `extend`) need not read the record back
//! first.
//!
//! Only ever a guess. A remembered record is used as the record the write
//! expects: the store's compare-and-swap checks its id and revision, and a
//! record that changed since (another owner took over, an operator settled
//! it, the sweeper deleted it) fails the swap, which answers the record as
//! it is now; the write then goes on from that, as after a read. A wrong
//! guess costs one refused swap, never a wrong write.
//!
//! This leans on the store contract's identity of a record: its key, its
//! id (never reused) and its revision (raised by every write). A record
//! whose insert the host rolled back (its own business transaction) may
//! leave its id free for the next insert; the remembered copy then only
//! matches the ticket minted for that rolled-back record, which the host
//! dropped with its transaction, and the next claim of the key on this
//! instance replaces it.

use alloc::collections::VecDeque;
use core::cell::RefCell;

use crate::bindings::exports::idem::engine::engine::Ticket;
use crate::bindings::idem::engine::types::{RecordKey, Status, StoredRecord};

/// How many claims one instance remembers: an instance runs one call at a
/// time, but a host that pools instances runs other requests' calls on it
/// between a `begin` and its `complete`. 64 covers the requests in flight
/// per instance of a busy pool (tens), while the oldest guess, if pushed
/// out, only costs the read that it would have saved.
pub const REMEMBERED_CLAIMS: usize = 64;

/// Records written as an owner, in processing, newest last; at most
/// [`REMEMBERED_CLAIMS`], one per key.
#[derive(Debug, Default)]
pub struct OwnedRecords {
    recent: RefCell<VecDeque<StoredRecord>>,
}

impl OwnedRecords {
    /// Remembers nothing yet.
    pub const fn new() -> Self {
        Self {
            recent: RefCell::new(VecDeque::new()),
        }
    }

    /// Takes out the record that `ticket` was given for, if it is the last
    /// one this instance wrote for the key: the same record id, fencing
    /// token, attempt and lease. The caller remembers what it writes next.
    pub fn take(&self, ticket: &Ticket) -> Option<StoredRecord> {
        let mut recent = self.recent.borrow_mut();
        let at = recent.iter().position(|rec| {
            rec.id == ticket.record_id
                && rec.fencing_token == ticket.fencing_token
                && rec.attempts == ticket.attempt
                && rec.lease_until == Some(ticket.lease_until)
                && rec.status == Status::Processing
                && same_key(&rec.key, &ticket.key)
        })?;
        recent.remove(at)
    }

    /// Remembers `rec`, just written by its owner, in place of anything
    /// remembered for its key. A record that is not processing has no
    /// owner left to write it, and is only forgotten.
    pub fn remember(&self, rec: &StoredRecord) {
        let mut recent = self.recent.borrow_mut();
        recent.retain(|r| !same_key(&r.key, &rec.key));
        if rec.status != Status::Processing {
            return;
        }
        if recent.len() >= REMEMBERED_CLAIMS {
            recent.pop_front();
        }
        recent.push_back(rec.clone());
    }

    /// How many records are remembered.
    pub fn len(&self) -> usize {
        self.recent.borrow().len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether `a` and `b` are the same key, the idempotency key compared
/// first: it is what tells one request's record from another's, where the
/// scope and the biz type are most often the same for every record an
/// instance remembers (one client, one route). Compared in the record's
/// field order, every entry of a full list cost a whole comparison of the
/// scope: 5 to 7 % of `idem serve`'s CPU on first requests at 32
/// connections, in a profile.
fn same_key(a: &RecordKey, b: &RecordKey) -> bool {
    a.idem_key == b.idem_key && a.biz_type == b.biz_type && a.scope == b.scope
}
