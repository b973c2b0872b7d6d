//! What an operator does with stuck keys, shared by the `idem` CLI and the
//! admin server: name a client as the proxy does, list stuck keys, and
//! describe a settlement.
//!
//! A key is stuck when its owner crashed (in progress past its lease) or
//! its outcome is unknown. Only the operator can say whether its action
//! took effect; [`idem_engine::Engine::settle`] records the answer.

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue, header};
use serde::{Deserialize, Serialize};

use idem_engine::StoreError;
use idem_engine::api::{Policy, Resolution, Settlement};
use idem_engine::engine::{Engine, Error};
use idem_engine::store::{StaleCursor, Storage};
use idem_engine::types::{Failure, RecordKey, StoredRecord, StoredResponse, Success, Timestamp};
use idem_layer::config::{AnonymousMode, ProxyConfig};

/// The header name under which a scope header's value is offered to the
/// scope rules; any name gives the same `hdr:<value>` scope.
const SCOPE_VALUE_HEADER: &str = "x-idem-scope";

/// Why a client or a request of the operator cannot be used; names the
/// field.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {message}")]
pub struct OperatorError {
    /// The field (or flag) at fault.
    pub field: &'static str,
    /// What is wrong with it.
    pub message: String,
}

impl OperatorError {
    fn new(field: &'static str, message: impl Into<String>) -> Self {
        Self {
            field,
            message: message.into(),
        }
    }
}

/// Who a key belongs to, as the operator knows the client: exactly one
/// field is set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Client {
    /// The scope as stored (`auth:<sha256>`, `hdr:<tenant>`,
    /// `addr:<sha256>`, `anonymous`).
    pub scope: Option<String>,
    /// The client's `Authorization` header value, as it sent it.
    pub auth: Option<String>,
    /// The value of the configured scope header, as sent.
    pub scope_value: Option<String>,
    /// The client's IP address (routes with `anonymous = "client-address"`).
    pub client_ip: Option<IpAddr>,
}

impl Client {
    /// The stored scope of this client's keys, derived by the rules the
    /// proxy uses.
    ///
    /// # Errors
    ///
    /// [`OperatorError`] when not exactly one field is set, or a value
    /// cannot be a header value.
    pub fn scope(&self) -> Result<String, OperatorError> {
        let given = [
            self.scope.is_some(),
            self.auth.is_some(),
            self.scope_value.is_some(),
            self.client_ip.is_some(),
        ];
        if given.iter().filter(|g| **g).count() != 1 {
            return Err(OperatorError::new(
                "client",
                "name the client with exactly one of scope, auth, scope_value and client_ip",
            ));
        }
        if let Some(scope) = &self.scope {
            return Ok(scope.clone());
        }
        let mut headers = HeaderMap::new();
        let mut scope_header = None;
        if let Some(auth) = &self.auth {
            let value = HeaderValue::from_str(auth)
                .map_err(|_| OperatorError::new("auth", "is not a valid header value"))?;
            headers.insert(header::AUTHORIZATION, value);
        }
        if let Some(value) = &self.scope_value {
            let name = HeaderName::from_static(SCOPE_VALUE_HEADER);
            let value = HeaderValue::from_str(value)
                .map_err(|_| OperatorError::new("scope_value", "is not a valid header value"))?;
            headers.insert(name.clone(), value);
            scope_header = Some(name);
        }
        let anonymous = if self.client_ip.is_some() {
            AnonymousMode::ClientAddress
        } else {
            AnonymousMode::Reject
        };
        idem_layer::key::derive_scope(&headers, scope_header.as_ref(), anonymous, self.client_ip)
            .map_err(|e| OperatorError::new("client", e.to_string()))
    }
}

/// One stuck key, as `idem stuck` and `GET /keys/stuck` list it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StuckKey {
    /// The key's scope.
    pub scope: String,
    /// Its biz type.
    pub biz_type: String,
    /// The idempotency key.
    pub key: String,
    /// `processing` (its owner's lease is over) or `outcome-unknown`.
    pub status: &'static str,
    /// When it became stuck (ms since the Unix epoch): the end of the
    /// lease of its owner (crashed) or of the owner that reported its
    /// unknown outcome (until then the action may still land, and the key
    /// counts as stuck for 0 ms), or, with no lease, its last update.
    pub stuck_since: Timestamp,
    /// For how long, at the time of listing.
    pub stuck_ms: u64,
    /// Attempts so far.
    pub attempts: u32,
    /// The current fencing token.
    pub fencing_token: u64,
    /// The code of the failure reported, if any (e.g. `upstream-timeout`).
    pub failure: Option<String>,
    /// Where the listing stands after this key: pass the last key's
    /// cursor as `after` for the next page.
    pub cursor: String,
}

impl StuckKey {
    fn of(r: &StoredRecord, now: Timestamp) -> Self {
        let since = r.lease_until.unwrap_or(r.updated_at);
        Self {
            scope: r.key.scope.clone(),
            biz_type: r.key.biz_type.clone(),
            key: r.key.idem_key.clone(),
            status: r.status.as_str(),
            stuck_since: since,
            stuck_ms: now.saturating_sub(since),
            attempts: r.attempts,
            fencing_token: r.fencing_token,
            failure: r.failure.as_ref().map(|f| f.code.clone()),
            cursor: StaleCursor::after(r).to_string(),
        }
    }
}

/// The stuck keys of `biz_type` at `now`, oldest first, at most `limit`,
/// starting after the key whose `cursor` is `after` (the next page) or from
/// the first.
///
/// # Errors
///
/// The store's.
pub fn stuck(
    store: &dyn Storage,
    biz_type: &str,
    now: Timestamp,
    after: Option<StaleCursor>,
    limit: u32,
) -> Result<Vec<StuckKey>, StoreError> {
    Ok(store
        .list_stale_after(biz_type, now, after, limit)?
        .iter()
        .map(|r| StuckKey::of(r, now))
        .collect())
}

/// What the operator decided about a stuck key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// The action took effect: replay the answer given.
    Succeeded,
    /// The action failed for good: replay this failure.
    Failed,
    /// The action did not take effect: the next request runs it.
    Released,
}

/// One settlement, as `idem settle` and `POST /keys/settle` take it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SettleRequest {
    /// The key's biz type.
    pub biz: String,
    /// The idempotency key.
    pub key: String,
    /// Whose key it is.
    #[serde(flatten)]
    pub client: Client,
    /// The decision.
    #[serde(rename = "as")]
    pub decision: Decision,
    /// The status of the answer to replay (100 to 599).
    pub status: Option<u16>,
    /// Its headers, as (name, value) pairs.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// Its body.
    pub body: Option<String>,
    /// A reference to the business result (`succeeded`).
    pub result_ref: Option<String>,
    /// The failure's code (`failed`).
    pub code: Option<String>,
    /// The failure's message (`failed`).
    #[serde(default)]
    pub message: String,
}

impl SettleRequest {
    /// The key this settlement is about.
    ///
    /// # Errors
    ///
    /// As [`Client::scope`].
    pub fn record_key(&self) -> Result<RecordKey, OperatorError> {
        Ok(RecordKey::new(
            self.client.scope()?,
            self.biz.as_str(),
            self.key.as_str(),
        ))
    }

    /// The answer `status`, `headers` and `body` describe, if any.
    fn response(&self) -> Result<Option<StoredResponse>, OperatorError> {
        let Some(status) = self.status else {
            if !self.headers.is_empty() || self.body.is_some() {
                return Err(OperatorError::new(
                    "status",
                    "headers and a body need a status",
                ));
            }
            return Ok(None);
        };
        Ok(Some(StoredResponse {
            status,
            headers: self
                .headers
                .iter()
                .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().as_bytes().to_vec()))
                .collect(),
            body: self.body.clone().unwrap_or_default().into_bytes(),
        }))
    }

    /// The engine's resolution. The engine checks the content (status
    /// range, sizes) and names the field it refuses.
    ///
    /// # Errors
    ///
    /// [`OperatorError`] for a combination that says nothing or too much.
    pub fn resolution(&self) -> Result<Resolution, OperatorError> {
        let response = self.response()?;
        match self.decision {
            Decision::Succeeded => {
                if response.is_none() && self.result_ref.is_none() {
                    return Err(OperatorError::new(
                        "status",
                        "succeeded needs the answer to replay (a status) or a result_ref",
                    ));
                }
                Ok(Resolution::Succeeded(Success {
                    result_ref: self.result_ref.clone(),
                    response,
                }))
            }
            Decision::Failed => Ok(Resolution::Failed(Failure {
                code: self
                    .code
                    .clone()
                    .ok_or_else(|| OperatorError::new("code", "failed needs a code"))?,
                message: self.message.clone(),
                response,
            })),
            Decision::Released => {
                if response.is_some() || self.result_ref.is_some() || self.code.is_some() {
                    return Err(OperatorError::new(
                        "as",
                        "released takes no answer, result_ref or code",
                    ));
                }
                Ok(Resolution::Released)
            }
        }
    }
}

/// What a settlement did, as `idem settle --json` and `POST /keys/settle`
/// report it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SettleReport {
    /// `settled`, `absent` or `not-stuck`.
    pub settlement: &'static str,
    /// The key's scope.
    pub scope: String,
    /// Its biz type.
    pub biz_type: String,
    /// The idempotency key.
    pub key: String,
    /// The key's status afterwards; none without a record.
    pub status: Option<&'static str>,
    /// The key's lease afterwards, in milliseconds since the Unix epoch:
    /// an owner's while processing, the reporting attempt's while the
    /// outcome is unknown (a release waits for its end).
    pub lease_until: Option<Timestamp>,
}

impl SettleReport {
    /// True when the key was settled as asked.
    pub fn settled(&self) -> bool {
        self.settlement == settlement_name(Settlement::Settled)
    }
}

/// Settles `request` with `engine` under `policy` (the engine decides
/// whether the key is stuck) and reports the key's status afterwards.
///
/// # Errors
///
/// The engine's: [`Error::Invalid`] naming the field of the resolution it
/// refused, [`Error::Store`], [`Error::Corrupt`].
pub fn settle(
    engine: &Engine,
    policy: &Policy,
    key: RecordKey,
    resolution: &Resolution,
) -> Result<SettleReport, Error> {
    let settlement = engine.settle(&key, policy, resolution)?;
    let after = engine.inspect(&key)?;
    Ok(SettleReport {
        settlement: settlement_name(settlement),
        scope: key.scope,
        biz_type: key.biz_type,
        key: key.idem_key,
        status: after.as_ref().map(|s| s.status.as_str()),
        lease_until: after.and_then(|s| s.lease_until),
    })
}

/// Releases the stuck keys of `biz_type` that have waited `retention_ms`
/// or longer (at most `limit` examined, oldest first) and returns them,
/// each logged as a warning: the bound on stuck keys
/// (`stuck_retention_ms`), which never drops one silently. A released key
/// runs again on its next request; one settled meanwhile by someone else is
/// left alone.
///
/// # Errors
///
/// The store's or the engine's; the keys released before it stay released.
pub fn expire_stuck(
    engine: &Engine,
    store: &dyn Storage,
    policy: &Policy,
    biz_type: &str,
    retention_ms: u64,
    now: Timestamp,
    limit: u32,
) -> Result<Vec<StuckKey>, Error> {
    let mut expired = Vec::new();
    for stuck in stuck(store, biz_type, now, None, limit)? {
        if stuck.stuck_ms < retention_ms {
            continue;
        }
        let key = RecordKey {
            scope: stuck.scope.clone(),
            biz_type: stuck.biz_type.clone(),
            idem_key: stuck.key.clone(),
        };
        if engine.settle(&key, policy, &Resolution::Released)? == Settlement::Settled {
            tracing::warn!(
                biz_type = %stuck.biz_type,
                scope = %stuck.scope,
                key = %stuck.key,
                status = stuck.status,
                stuck_ms = stuck.stuck_ms,
                failure = stuck.failure.as_deref().unwrap_or(""),
                "a stuck key waited past stuck_retention_ms without a lookup or an operator settling it: released, so its next request runs again"
            );
            expired.push(stuck);
        }
    }
    Ok(expired)
}

/// [`expire_stuck`] for every biz type of `config` that has a
/// `stuck_retention_ms`, at most `batch` keys examined per biz type: the
/// sweep of `idem serve` and `idem sweep`. Returns the keys released.
///
/// # Errors
///
/// As [`expire_stuck`].
pub fn expire_stuck_keys(
    engine: &Engine,
    store: &dyn Storage,
    config: &ProxyConfig,
    now: Timestamp,
    batch: u32,
) -> Result<Vec<StuckKey>, Error> {
    let mut released = Vec::new();
    for biz_type in config.biz_types() {
        if let Some(retention) = config.stuck_retention_for(&biz_type) {
            let policy = config.policy_for(&biz_type);
            released.extend(expire_stuck(
                engine, store, &policy, &biz_type, retention, now, batch,
            )?);
        }
    }
    Ok(released)
}

fn settlement_name(s: Settlement) -> &'static str {
    match s {
        Settlement::Settled => "settled",
        Settlement::Absent => "absent",
        Settlement::NotStuck => "not-stuck",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_is_named_once_and_hashed_as_the_proxy_does() {
        let auth = Client {
            auth: Some("Bearer abc".into()),
            ..Client::default()
        };
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer abc"),
        );
        let proxy =
            idem_layer::key::derive_scope(&headers, None, AnonymousMode::Reject, None).unwrap();
        assert_eq!(auth.scope().unwrap(), proxy);
        let tenant = Client {
            scope_value: Some("tenant-7".into()),
            ..Client::default()
        };
        assert_eq!(tenant.scope().unwrap(), "hdr:tenant-7");
        let none = Client::default().scope().unwrap_err();
        assert_eq!(none.field, "client");
        let two = Client {
            scope: Some("anonymous".into()),
            ..auth
        };
        assert_eq!(two.scope().unwrap_err().field, "client");
        let bad = Client {
            auth: Some("line\nbreak".into()),
            ..Client::default()
        };
        assert_eq!(bad.scope().unwrap_err().field, "auth");
    }
}
