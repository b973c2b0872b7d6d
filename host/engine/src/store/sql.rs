//! Conversions between the engine's record fields and SQL columns, for SQL
//! backends: the SQLite and PostgreSQL backends use them, and both store
//! integers as signed 64-bit values and encode outcomes as JSON. They name
//! the field or column in every error, as [`StoreError`]s.

use super::StoreError;
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
