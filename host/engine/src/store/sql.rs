//! Conversions between the engine's record fields and SQL columns, for SQL
//! backends: the SQLite and PostgreSQL backends use them, and both store
//! integers as signed 64-bit values and encode outcomes as JSON. They name
//! the field or column in every error, as [`StoreError`]s.

use super::{StaleCursor, StoreError};
use crate::types::Status;

/// `value` as a signed 64-bit column value; a larger value is refused
/// ([`StoreError::Rejected`]), naming `field` and `limit` (what the
/// database can store).
pub fn to_i64(value: u64, field: &str, limit: &str) -> Result<i64, StoreError> {
    i64::try_from(value).map_err(|_| {
        StoreError::Rejected(format!("{field} = {value} is above {}, {limit}", i64::MAX))
    })
}

/// A bound for comparisons: every stored value is at most `i64::MAX`, so a
/// larger bound compares exactly like `i64::MAX`.
pub fn saturate(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The (`updated_at`, `id`) a stale listing starts after, as SQL values:
/// before every stored row (times and ids are never negative) when there
/// is no cursor.
pub fn cursor_values(after: Option<StaleCursor>) -> (i64, i64) {
    after.map_or((-1, -1), |c| (saturate(c.updated_at), saturate(c.id)))
}

/// `value` as the JSON bytes of a column; an error names `field`.
pub fn to_json<T: serde::Serialize>(value: &T, field: &str) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value)
        .map_err(|e| StoreError::Internal(format!("cannot encode {field}: {e}")))
}

/// A column's signed value as the record's `u64`; a negative value is
/// [`StoreError::Internal`], naming `column`.
pub fn to_u64(value: i64, column: &str) -> Result<u64, StoreError> {
    u64::try_from(value)
        .map_err(|_| StoreError::Internal(format!("column {column} holds negative value {value}")))
}

/// A column's signed value as the record's `u32`; a value out of range is
/// [`StoreError::Internal`], naming `column`.
pub fn to_u32(value: i64, column: &str) -> Result<u32, StoreError> {
    u32::try_from(value).map_err(|_| {
        StoreError::Internal(format!(
            "column {column} holds {value}, outside 0..=u32::MAX"
        ))
    })
}

/// A status column's text as a [`Status`]; an unknown name is
/// [`StoreError::Internal`].
pub fn parse_status(name: &str) -> Result<Status, StoreError> {
    Status::parse(name)
        .ok_or_else(|| StoreError::Internal(format!("column status holds unknown status {name:?}")))
}

/// The connection of an open business transaction, shared by `&self`
/// calls (a transaction is a [`Storage`](super::Storage)): `commit` and
/// `rollback` take it out; once taken, every call is refused.
///
/// A panic inside a caller's closure poisons the slot: from then on only a
/// rollback is possible, since the transaction may hold half of what the
/// panicking code meant to write.
#[derive(Debug)]
pub struct TransactionSlot<C> {
    conn: std::sync::Mutex<Option<C>>,
}

impl<C> TransactionSlot<C> {
    /// A slot holding `conn`, on which a transaction is open.
    pub fn new(conn: C) -> Self {
        Self {
            conn: std::sync::Mutex::new(Some(conn)),
        }
    }

    /// The connection to roll back: taken even after a panic, when rolling
    /// back is exactly right; none once taken.
    pub fn take_for_rollback(&self) -> Option<C> {
        self.lock().take()
    }

    /// The connection to commit. [`StoreError::Internal`] after a panic
    /// (the transaction is rolled back when the slot drops) or once taken.
    pub fn take_for_commit(&self) -> Result<C, StoreError> {
        if self.conn.is_poisoned() {
            return Err(StoreError::Internal(
                "a panic interrupted the transaction; it was rolled back".to_owned(),
            ));
        }
        self.lock()
            .take()
            .ok_or_else(|| StoreError::Internal("the transaction has ended".to_owned()))
    }

    /// Runs `op` on the connection. [`StoreError::Internal`], without
    /// running it, after a panic or once the connection was taken.
    pub fn run<R>(
        &self,
        op: impl FnOnce(&mut C) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        if self.conn.is_poisoned() {
            return Err(StoreError::Internal(
                "a panic interrupted the transaction; it can only be rolled back".to_owned(),
            ));
        }
        let mut guard = self.lock();
        let conn = guard
            .as_mut()
            .ok_or_else(|| StoreError::Internal("the transaction has ended".to_owned()))?;
        op(conn)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<C>> {
        // The poison is checked by `run` and `take_for_commit`; the
        // connection itself is still fine for a rollback.
        self.conn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transaction_slot_refuses_every_call_once_taken() {
        let slot = TransactionSlot::new(1);
        assert_eq!(slot.run(|c| Ok(*c + 1)), Ok(2));
        assert_eq!(slot.take_for_commit(), Ok(1));
        assert!(matches!(slot.run(|c| Ok(*c)), Err(StoreError::Internal(_))));
        assert!(matches!(
            slot.take_for_commit(),
            Err(StoreError::Internal(_))
        ));
        assert_eq!(slot.take_for_rollback(), None);
    }

    #[test]
    fn after_a_panic_a_transaction_slot_can_only_roll_back() {
        let slot = TransactionSlot::new(7);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = slot.run(|_| -> Result<(), StoreError> { panic!("business code") });
        }));
        assert!(panicked.is_err());
        assert!(
            matches!(slot.run(|c| Ok(*c)), Err(StoreError::Internal(m)) if m.contains("panic"))
        );
        assert!(
            matches!(slot.take_for_commit(), Err(StoreError::Internal(m)) if m.contains("rolled back"))
        );
        assert_eq!(slot.take_for_rollback(), Some(7));
    }
}
