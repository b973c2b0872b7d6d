//! Conversions between the engine's record fields and SQL columns, for SQL
//! backends: the SQLite and PostgreSQL backends use them, and both store
//! integers as signed 64-bit values and encode outcomes as JSON (the
//! `response` and `failure` columns, below). They name
//! the field or column in every error, as [`StoreError`]s.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;

use super::{StaleCursor, StoreError};
use crate::types::{Failure, RecordKey, Status, StoredRecord, StoredResponse};

/// The record table's columns, `id` to `failure`, as one SQL list in the
/// order [`RecordRow`] holds them: a backend selects them and reads column
/// `i` into field `i`. A macro, so that a backend can `concat!` it into
/// its statements at compile time; [`COLUMNS`] is the same as a constant.
#[macro_export]
macro_rules! record_columns {
    () => {
        "id, scope_key, biz_type, idem_key, request_hash, fingerprint_version, status, \
         fencing_token, revision, attempts, lease_until, created_at, updated_at, expires_at, \
         result_ref, response, failure"
    };
}

/// [`record_columns!`] as a constant.
pub const COLUMNS: &str = record_columns!();

/// The names in [`COLUMNS`], by index.
pub const COLUMN_NAMES: [&str; 17] = [
    "id",
    "scope_key",
    "biz_type",
    "idem_key",
    "request_hash",
    "fingerprint_version",
    "status",
    "fencing_token",
    "revision",
    "attempts",
    "lease_until",
    "created_at",
    "updated_at",
    "expires_at",
    "result_ref",
    "response",
    "failure",
];

/// The name of column `index` of [`COLUMNS`], for an error message; `?`
/// past the last.
pub fn column_name(index: usize) -> &'static str {
    COLUMN_NAMES.get(index).copied().unwrap_or("?")
}

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

// ---------------------------------------------------------------------------
// The `response` and `failure` columns.
//
// Both are JSON: a response is `{"status", "headers": [[name, value]],
// "body"}` and a failure `{"code", "message", "response"}`. Byte strings
// (header values and bodies) are written as base64 strings (RFC 4648,
// standard alphabet, padded): a third larger than the bytes, where the
// arrays of numbers of schema version 1 were three to four times larger
// and cost a parse per byte in every language's store. Both forms are
// read, so rows written before version 2 still replay.

/// A byte string in a column: written as base64, read from base64 or from
/// the array of numbers that schema version 1 wrote.
struct ColumnBytes(Vec<u8>);

/// A byte string being written, borrowed from the record.
struct ColumnBytesRef<'a>(&'a [u8]);

impl serde::Serialize for ColumnBytesRef<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&BASE64.encode(self.0))
    }
}

impl<'de> serde::Deserialize<'de> for ColumnBytes {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = ColumnBytes;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a base64 string or an array of bytes")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ColumnBytes, E> {
                BASE64
                    .decode(v)
                    .map(ColumnBytes)
                    .map_err(|e| E::custom(format!("invalid base64: {e}")))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<ColumnBytes, A::Error> {
                let mut bytes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(b) = seq.next_element::<u8>()? {
                    bytes.push(b);
                }
                Ok(ColumnBytes(bytes))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[derive(serde::Serialize)]
struct ResponseOut<'a> {
    status: u16,
    headers: Vec<(&'a str, ColumnBytesRef<'a>)>,
    body: ColumnBytesRef<'a>,
}

impl<'a> From<&'a StoredResponse> for ResponseOut<'a> {
    fn from(r: &'a StoredResponse) -> Self {
        Self {
            status: r.status,
            headers: r
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), ColumnBytesRef(v)))
                .collect(),
            body: ColumnBytesRef(&r.body),
        }
    }
}

#[derive(serde::Deserialize)]
struct ResponseIn {
    status: u16,
    headers: Vec<(String, ColumnBytes)>,
    body: ColumnBytes,
}

impl From<ResponseIn> for StoredResponse {
    fn from(r: ResponseIn) -> Self {
        Self {
            status: r.status,
            headers: r.headers.into_iter().map(|(n, v)| (n, v.0)).collect(),
            body: r.body.0,
        }
    }
}

#[derive(serde::Serialize)]
struct FailureOut<'a> {
    code: &'a str,
    message: &'a str,
    response: Option<ResponseOut<'a>>,
}

#[derive(serde::Deserialize)]
struct FailureIn {
    code: String,
    message: String,
    #[serde(default)]
    response: Option<ResponseIn>,
}

fn encode<T: serde::Serialize>(value: &T, column: &str) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value)
        .map_err(|e| StoreError::Internal(format!("cannot encode {column}: {e}")))
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], column: &str) -> Result<T, StoreError> {
    serde_json::from_slice(bytes)
        .map_err(|e| StoreError::Internal(format!("column {column} cannot be decoded: {e}")))
}

/// The `response` column's bytes for `response`.
pub fn encode_response(response: &StoredResponse) -> Result<Vec<u8>, StoreError> {
    encode(&ResponseOut::from(response), "response")
}

/// The `failure` column's bytes for `failure`.
pub fn encode_failure(failure: &Failure) -> Result<Vec<u8>, StoreError> {
    let out = FailureOut {
        code: &failure.code,
        message: &failure.message,
        response: failure.response.as_ref().map(ResponseOut::from),
    };
    encode(&out, "failure")
}

/// A `response` column's value (`None` for SQL NULL); bytes that are not
/// a stored response are [`StoreError::Internal`], naming the column.
pub fn decode_response(column: Option<&[u8]>) -> Result<Option<StoredResponse>, StoreError> {
    column
        .map(|bytes| decode::<ResponseIn>(bytes, "response").map(StoredResponse::from))
        .transpose()
}

/// A `failure` column's value (`None` for SQL NULL); bytes that are not a
/// stored failure are [`StoreError::Internal`], naming the column.
pub fn decode_failure(column: Option<&[u8]>) -> Result<Option<Failure>, StoreError> {
    column
        .map(|bytes| {
            decode::<FailureIn>(bytes, "failure").map(|f| Failure {
                code: f.code,
                message: f.message,
                response: f.response.map(StoredResponse::from),
            })
        })
        .transpose()
}

/// A record as the columns of the record table hold it, `scope_key` to
/// `failure` in the order of both backends' insert and swap parameters
/// (`id` is the database's): integers as signed 64-bit values, `response`
/// and `failure` as their JSON ([`encode_response`], [`encode_failure`]).
#[derive(Debug)]
pub struct RecordColumns<'a> {
    /// `scope_key`.
    pub scope: &'a str,
    /// `biz_type`.
    pub biz_type: &'a str,
    /// `idem_key`.
    pub idem_key: &'a str,
    /// `request_hash`.
    pub fingerprint: &'a str,
    /// `fingerprint_version`.
    pub fingerprint_version: i64,
    /// `status`.
    pub status: &'static str,
    /// `fencing_token`.
    pub fencing_token: i64,
    /// `revision`.
    pub revision: i64,
    /// `attempts`.
    pub attempts: i64,
    /// `lease_until`.
    pub lease_until: Option<i64>,
    /// `created_at`.
    pub created_at: i64,
    /// `updated_at`.
    pub updated_at: i64,
    /// `expires_at`.
    pub expires_at: Option<i64>,
    /// `result_ref`.
    pub result_ref: Option<&'a str>,
    /// `response`.
    pub response: Option<Vec<u8>>,
    /// `failure`.
    pub failure: Option<Vec<u8>>,
}

impl<'a> RecordColumns<'a> {
    /// The columns of `record`. An integer above `i64::MAX` is
    /// [`StoreError::Rejected`], naming its field and `limit` (see
    /// [`to_i64`]).
    pub fn new(record: &'a StoredRecord, limit: &str) -> Result<Self, StoreError> {
        let int = |value: u64, field: &str| to_i64(value, field, limit);
        let opt = |value: Option<u64>, field: &str| value.map(|v| int(v, field)).transpose();
        Ok(Self {
            scope: &record.key.scope,
            biz_type: &record.key.biz_type,
            idem_key: &record.key.idem_key,
            fingerprint: &record.fingerprint,
            fingerprint_version: i64::from(record.fingerprint_version),
            status: record.status.as_str(),
            fencing_token: int(record.fencing_token, "fencing_token")?,
            revision: int(record.revision, "revision")?,
            attempts: i64::from(record.attempts),
            lease_until: opt(record.lease_until, "lease_until")?,
            created_at: int(record.created_at, "created_at")?,
            updated_at: int(record.updated_at, "updated_at")?,
            expires_at: opt(record.expires_at, "expires_at")?,
            result_ref: record.result_ref.as_deref(),
            response: record.response.as_ref().map(encode_response).transpose()?,
            failure: record.failure.as_ref().map(encode_failure).transpose()?,
        })
    }
}

/// One row of the record table as a backend read it, `id` to `failure`;
/// [`RecordRow::into_record`] checks and decodes it.
#[derive(Debug)]
pub struct RecordRow {
    /// `id`.
    pub id: i64,
    /// `scope_key`.
    pub scope: String,
    /// `biz_type`.
    pub biz_type: String,
    /// `idem_key`.
    pub idem_key: String,
    /// `request_hash`.
    pub fingerprint: String,
    /// `fingerprint_version`.
    pub fingerprint_version: i64,
    /// `status`.
    pub status: String,
    /// `fencing_token`.
    pub fencing_token: i64,
    /// `revision`.
    pub revision: i64,
    /// `attempts`.
    pub attempts: i64,
    /// `lease_until`.
    pub lease_until: Option<i64>,
    /// `created_at`.
    pub created_at: i64,
    /// `updated_at`.
    pub updated_at: i64,
    /// `expires_at`.
    pub expires_at: Option<i64>,
    /// `result_ref`.
    pub result_ref: Option<String>,
    /// `response`.
    pub response: Option<Vec<u8>>,
    /// `failure`.
    pub failure: Option<Vec<u8>>,
}

impl RecordRow {
    /// The record the row holds; a value no record can have (a negative
    /// time, an unknown status, an outcome that is not JSON of one) is
    /// [`StoreError::Internal`], naming the column.
    pub fn into_record(self) -> Result<StoredRecord, StoreError> {
        let opt = |value: Option<i64>, column: &str| value.map(|v| to_u64(v, column)).transpose();
        Ok(StoredRecord {
            id: to_u64(self.id, "id")?,
            key: RecordKey {
                scope: self.scope,
                biz_type: self.biz_type,
                idem_key: self.idem_key,
            },
            fingerprint: self.fingerprint,
            fingerprint_version: to_u32(self.fingerprint_version, "fingerprint_version")?,
            status: parse_status(&self.status)?,
            fencing_token: to_u64(self.fencing_token, "fencing_token")?,
            revision: to_u64(self.revision, "revision")?,
            attempts: to_u32(self.attempts, "attempts")?,
            lease_until: opt(self.lease_until, "lease_until")?,
            created_at: to_u64(self.created_at, "created_at")?,
            updated_at: to_u64(self.updated_at, "updated_at")?,
            expires_at: opt(self.expires_at, "expires_at")?,
            result_ref: self.result_ref,
            response: decode_response(self.response.as_deref())?,
            failure: decode_failure(self.failure.as_deref())?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_column_names_are_the_column_list() {
        assert_eq!(COLUMN_NAMES.join(", "), COLUMNS);
        assert_eq!(column_name(14), "result_ref");
        assert_eq!(column_name(17), "?");
    }

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

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".to_owned(), b"application/json".to_vec()),
                ("x-binary".to_owned(), vec![0xff, 0x00, 0x80]),
                ("x-empty".to_owned(), Vec::new()),
            ],
            body: (0..=255u8).collect(),
        }
    }

    #[test]
    fn byte_strings_are_written_as_base64() {
        let column = encode_response(&response()).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&column).unwrap();
        assert_eq!(json["status"], 201);
        assert_eq!(json["headers"][0][1], "YXBwbGljYXRpb24vanNvbg==");
        assert_eq!(json["headers"][1][1], "/wCA");
        assert_eq!(json["headers"][2][1], "");
        assert_eq!(json["body"], BASE64.encode((0..=255u8).collect::<Vec<_>>()));
        assert_eq!(decode_response(Some(&column)).unwrap().unwrap(), response());
        // A quarter of the bytes of schema version 1's arrays of numbers.
        let version_1 = serde_json::to_vec(&response()).unwrap();
        assert!(
            column.len() * 2 < version_1.len(),
            "{} {}",
            column.len(),
            version_1.len()
        );
    }

    #[test]
    fn failures_round_trip_with_and_without_a_response() {
        for response in [None, Some(response())] {
            let failure = Failure {
                code: "card-declined".to_owned(),
                message: "déclinée \u{0} \"quoted\"".to_owned(),
                response,
            };
            let column = encode_failure(&failure).unwrap();
            assert_eq!(decode_failure(Some(&column)).unwrap().unwrap(), failure);
        }
    }

    #[test]
    fn columns_written_by_schema_version_1_are_read() {
        // Version 1 wrote serde's JSON of the host types: byte strings as
        // arrays of numbers.
        let version_1 = serde_json::to_vec(&response()).unwrap();
        assert!(version_1.starts_with(br#"{"status":201,"headers":[["content-type",[97,"#));
        assert_eq!(
            decode_response(Some(&version_1)).unwrap().unwrap(),
            response()
        );
        let failure = Failure {
            code: "c".to_owned(),
            message: "m".to_owned(),
            response: Some(response()),
        };
        let version_1 = serde_json::to_vec(&failure).unwrap();
        assert_eq!(decode_failure(Some(&version_1)).unwrap().unwrap(), failure);
        // A failure without its `response` field is one without a response.
        let bare = decode_failure(Some(br#"{"code":"c","message":"m"}"#)).unwrap();
        assert_eq!(bare.unwrap().response, None);
        assert_eq!(decode_failure(None), Ok(None));
        assert_eq!(decode_response(None), Ok(None));
    }

    #[test]
    fn a_column_that_is_not_a_stored_value_is_an_error_naming_it() {
        for (bytes, rule) in [
            (
                &br#"{"status":200,"headers":[],"body":"not base64!"}"#[..],
                "invalid base64",
            ),
            (br#"{"status":200,"headers":[],"body":[256]}"#, "256"),
            (
                br#"{"status":200,"headers":[],"body":7}"#,
                "a base64 string or an array of bytes",
            ),
            (br#"{"status":200,"headers":[]}"#, "missing field `body`"),
            (b"\xff", "expected value"),
        ] {
            match decode_response(Some(bytes)) {
                Err(StoreError::Internal(m)) => {
                    assert!(m.starts_with("column response cannot be decoded"), "{m}");
                    assert!(m.contains(rule), "{m}");
                }
                other => panic!("expected Internal, got {other:?}"),
            }
        }
        match decode_failure(Some(br#"{"code":"c"}"#)) {
            Err(StoreError::Internal(m)) => {
                assert!(m.starts_with("column failure cannot be decoded"), "{m}");
                assert!(m.contains("message"), "{m}");
            }
            other => panic!("expected Internal, got {other:?}"),
        }
    }
}
