//! The proxy's configuration file (TOML) and the route table built from it.
//!
//! Every key is optional. Unknown keys are an error that names the key, and
//! a value out of range is an error that names its field. The commented
//! example `host/idem.example.toml` shows every key with its default.

use std::fmt;
use std::path::Path;
use std::time::Duration;

use http::{HeaderName, Method};
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use idem_engine::api::{
    DEFAULT_MAX_BODY_BYTES, ExpiredLease, FailureMode, InProgressMode, KeyFormat, Policy, WaitSpec,
};
use idem_engine::bounds::GuestBounds;

/// The biz type of requests that match no route.
pub const DEFAULT_BIZ_TYPE: &str = "http";

/// Default `poll_ms` of a bounded in-progress wait.
pub const DEFAULT_POLL_MS: u64 = 50;

/// Default `header_read_timeout_ms`: 10 seconds. A client sends its whole
/// request head in well under a second even on a slow mobile link, so 10 s
/// leaves a wide margin, while a client that trickles headers (slowloris)
/// holds a connection for at most that long.
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;

/// Default `body_read_timeout_ms`: 30 seconds, time enough to upload the
/// default 1 MiB body limit at about 35 KB/s, and short enough that a body
/// that stops before its Content-Length does not hold a connection for long.
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;
/// Default `lookup_timeout_ms`: 5 seconds, as the stores' busy and
/// statement timeouts. A lookup is one indexed read in the business
/// database behind one HTTP hop; one that takes longer is overloaded or
/// stuck, and waiting longer would only hold a request (or the sweep) up.
pub const DEFAULT_LOOKUP_TIMEOUT_MS: u64 = 5_000;

/// Default `stuck_retention_ms`: 7 days. A stuck key needs a person (or a
/// lookup) to decide whether its action took effect; a week covers a
/// weekend and a holiday, and bounds how many stuck keys can pile up.
pub const DEFAULT_STUCK_RETENTION_MS: u64 = 7 * 24 * 60 * 60 * 1000;

/// The smallest `guest_memory_bytes` accepted: the engine component starts
/// with about 1.1 MiB (its 1 MiB stack and its data), so a lower limit
/// would leave no room to canonicalize even a small body.
pub const MIN_GUEST_MEMORY_BYTES: u64 = 4 * 1024 * 1024;

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// The file is not valid TOML, has an unknown key, or a value of the
    /// wrong type; the message names the key.
    #[error("invalid config: {0}")]
    Parse(String),
    /// A value is out of range or malformed.
    #[error("invalid config: {field}: {message}")]
    Invalid {
        /// The offending field, e.g. `routes[1].path`.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

impl ConfigError {
    fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Whether a request must carry an `Idempotency-Key` header (`key`); what
/// an upstream 5xx means for the key (`server_errors`); what a keyed
/// request that names no client gets (`anonymous`). The rules are
/// `idem_http`'s, shared with the middleware component.
pub use idem_http::{AnonymousMode, KeyRequirement, ServerErrors};

/// What a duplicate does while the first request is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InProgressConfig {
    /// `"reject"`: answer 409 with `Retry-After` at once.
    #[default]
    Reject,
    /// `{ wait_ms = 5000, poll_ms = 50 }`: the engine waits (bounded) for
    /// the first request to settle and answers with its replay.
    Wait {
        /// The longest total wait, in milliseconds (at most 60 000).
        wait_ms: u64,
        /// Milliseconds between two reads of the record (at least 1).
        poll_ms: u64,
    },
}

impl InProgressConfig {
    /// The engine's mode.
    pub fn mode(self) -> InProgressMode {
        match self {
            InProgressConfig::Reject => InProgressMode::Reject,
            InProgressConfig::Wait { wait_ms, poll_ms } => InProgressMode::Wait(WaitSpec {
                max_wait_ms: wait_ms,
                poll_interval_ms: poll_ms,
            }),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WaitTable {
    wait_ms: u64,
    #[serde(default = "default_poll_ms")]
    poll_ms: u64,
}

fn default_poll_ms() -> u64 {
    DEFAULT_POLL_MS
}

impl<'de> Deserialize<'de> for InProgressConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = InProgressConfig;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(r#""reject" or a table { wait_ms = N, poll_ms = N }"#)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                if v == "reject" {
                    Ok(InProgressConfig::Reject)
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(v), &self))
                }
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let t = WaitTable::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(InProgressConfig::Wait {
                    wait_ms: t.wait_ms,
                    poll_ms: t.poll_ms,
                })
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// The policy keys shared by `[defaults]` and every `[[routes]]` entry.
/// A key left out takes its value from `[defaults]`, then from the engine's
/// defaults ([`Policy::default`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    /// `retention_ms`: how long a settled key is kept and replayed, in
    /// milliseconds. Default 86 400 000 (24 h).
    pub retention_ms: Option<u64>,
    /// `lease_ms`: how long a request may hold its key before a duplicate
    /// may take it over, in milliseconds; the proxy extends the lease while
    /// the upstream call runs. Default 60 000.
    pub lease_ms: Option<u64>,
    /// `retry_after_ms`: the longest `Retry-After` hint given to a duplicate
    /// that arrives while the first request runs, in milliseconds.
    /// Default 1 000.
    pub retry_after_ms: Option<u64>,
    /// `expired_lease`: what a duplicate does when the first request's lease
    /// ran out (the proxy crashed or hung): `"take-over"` (execute again),
    /// `"manual"` (answer 409 outcome-unknown until an operator settles the
    /// key) or `"reconcile"` (ask the biz type's [`PolicyConfig::lookup`]
    /// first; without one the key answers 503 until an operator settles
    /// it). Default `"take-over"`.
    pub expired_lease: Option<ExpiredLease>,
    /// `outcome_unknown`: what a duplicate does once the lease of a request
    /// whose outcome is unknown has ended (the upstream timed out, or the
    /// connection broke after the request was sent, so it may have acted):
    /// `"manual"` (answer 409 outcome-unknown until an operator settles
    /// the key), `"reconcile"` (ask the biz type's [`PolicyConfig::lookup`]
    /// first; without one the key answers 503 until an operator settles
    /// it) or
    /// `"take-over"` (execute again: only for actions that are safe to
    /// repeat). Default `"manual"`: retrying an unknown outcome blindly is
    /// how one payment is charged twice.
    pub outcome_unknown: Option<ExpiredLease>,
    /// `in_progress`: `"reject"` (409 with `Retry-After`) or
    /// `{ wait_ms = 5000, poll_ms = 50 }` (wait, bounded, for the first
    /// request's result). Default `"reject"`.
    pub in_progress: Option<InProgressConfig>,
    /// `server_errors`: what an upstream 5xx means: `"retry"` (not stored,
    /// the next retry executes again) or `"store"` (stored and replayed).
    /// Default `"retry"`.
    pub server_errors: Option<ServerErrors>,
    /// `key`: whether POST and PATCH requests must carry an
    /// `Idempotency-Key`: `"required"` or `"optional"`. Default
    /// `"required"`. Other unsafe methods (PUT, DELETE, …) honour a key when
    /// present and do not require one, unless a route sets `key` itself: a
    /// route's `key` applies to every method the route matches.
    pub key: Option<KeyRequirement>,
    /// `fingerprint_fields`: JSON Pointers (RFC 6901) of the body fields
    /// that make up the request's identity; empty means the whole body. A
    /// non-empty list requires JSON bodies. Default `[]`.
    pub fingerprint_fields: Option<Vec<String>>,
    /// `anonymous`: what a keyed request gets when it names no client
    /// (neither `scope_header` nor `Authorization`): `"reject"` (401
    /// `client-unidentified`, nothing stored), `"shared"` (the one scope
    /// `anonymous` for all of them) or `"client-address"` (a scope from the
    /// connection's IP address). Default `"reject"`, see [`AnonymousMode`].
    pub anonymous: Option<AnonymousMode>,
    /// `lookup`: where `idem serve` asks the business data whether a key's
    /// action took effect, for a key stuck in progress past its lease or
    /// with an unknown outcome: an `http://` URL template with `{key}` (the
    /// idempotency key) and optionally `{scope}` and `{biz_type}`, each
    /// percent-encoded, e.g. `"http://orders.internal/by-key/{key}"`. A
    /// 2xx answer is the action's result, stored and replayed as the key's
    /// answer; 404 means the action did not take effect; anything else (or
    /// no answer within `lookup_timeout_ms`) means "cannot tell", and the
    /// key stays as it is. With a lookup, `"reconcile"` asks it on the
    /// request and the background sweep reconciles stuck keys with it;
    /// without one, nothing is reconciled. Default: none.
    pub lookup: Option<String>,
    /// `stuck_retention_ms`: how long a stuck key (outcome-unknown, or in
    /// progress past its lease) waits for a lookup or an operator before
    /// the sweep reports it (a warning naming the key, and
    /// `idem_stuck_keys_expired_total`) and releases it, so that the next
    /// request with the same key runs again. 0 keeps stuck keys until an
    /// operator settles them. Default [`DEFAULT_STUCK_RETENTION_MS`].
    pub stuck_retention_ms: Option<u64>,
}

impl PolicyConfig {
    /// `self` with every unset key taken from `base`.
    fn or(&self, base: &PolicyConfig) -> PolicyConfig {
        PolicyConfig {
            retention_ms: self.retention_ms.or(base.retention_ms),
            lease_ms: self.lease_ms.or(base.lease_ms),
            retry_after_ms: self.retry_after_ms.or(base.retry_after_ms),
            expired_lease: self.expired_lease.or(base.expired_lease),
            outcome_unknown: self.outcome_unknown.or(base.outcome_unknown),
            in_progress: self.in_progress.or(base.in_progress),
            server_errors: self.server_errors.or(base.server_errors),
            key: self.key.or(base.key),
            fingerprint_fields: self
                .fingerprint_fields
                .clone()
                .or_else(|| base.fingerprint_fields.clone()),
            anonymous: self.anonymous.or(base.anonymous),
            lookup: self.lookup.clone().or_else(|| base.lookup.clone()),
            stuck_retention_ms: self.stuck_retention_ms.or(base.stuck_retention_ms),
        }
    }

    /// The engine policy, with `max_body_bytes` from the top level.
    fn policy(&self, max_body_bytes: u32) -> Policy {
        let d = Policy::default();
        Policy {
            retention_ms: self.retention_ms.unwrap_or(d.retention_ms),
            lease_ms: self.lease_ms.unwrap_or(d.lease_ms),
            retry_after_ms: self.retry_after_ms.unwrap_or(d.retry_after_ms),
            expired_lease: self.expired_lease.unwrap_or(d.expired_lease),
            outcome_unknown: self.outcome_unknown.unwrap_or(d.outcome_unknown),
            // 5xx answers are made final by the proxy calling `fail` with
            // `final` (see `server_errors`); `always-final` would also store
            // the failures that must stay retryable (429, connection refused).
            failure_mode: FailureMode::HonorDisposition,
            // HTTP clients choose their own retries, and the failures that
            // stay retryable here (429, an unreachable upstream) never
            // reached the action: no attempt limit makes them final.
            max_attempts: None,
            in_progress: self.in_progress.unwrap_or_default().mode(),
            fingerprint_fields: self.fingerprint_fields.clone().unwrap_or_default(),
            key_format: KeyFormat::default(),
            max_body_bytes,
        }
    }

    /// Range checks the proxy needs before the engine sees the policy; the
    /// engine's own rules are checked by `Proxy::new` of `idem serve`.
    fn check(&self, at: &str) -> Result<(), ConfigError> {
        for (name, v) in [
            ("retention_ms", self.retention_ms),
            ("lease_ms", self.lease_ms),
            ("retry_after_ms", self.retry_after_ms),
        ] {
            if v == Some(0) {
                return Err(ConfigError::invalid(
                    format!("{at}.{name}"),
                    "must be at least 1",
                ));
            }
        }
        if let Some(InProgressConfig::Wait { wait_ms, poll_ms }) = self.in_progress {
            if wait_ms > 60_000 {
                return Err(ConfigError::invalid(
                    format!("{at}.in_progress.wait_ms"),
                    "must be at most 60000",
                ));
            }
            if poll_ms == 0 {
                return Err(ConfigError::invalid(
                    format!("{at}.in_progress.poll_ms"),
                    "must be at least 1",
                ));
            }
        }
        if let Some(template) = &self.lookup {
            LookupTemplate::parse(template)
                .map_err(|m| ConfigError::invalid(format!("{at}.lookup"), m))?;
        }
        Ok(())
    }
}

/// One `[[routes]]` entry: which requests it matches, their biz type, and
/// policy keys overriding `[defaults]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// `method`: an unsafe HTTP method such as `"POST"`, or `"*"` for every
    /// method. Default `"*"`. Safe methods (GET, HEAD, OPTIONS, TRACE,
    /// CONNECT) are always passed through and cannot be routed.
    #[serde(default = "any_method")]
    pub method: String,
    /// `path`: the request path (without the query) the route matches:
    /// exact (`"/orders"`), a prefix (`"/orders/*"` matches `/orders` and
    /// everything below it), or with `{name}` segments that match any one
    /// non-empty segment (`"/users/{id}/orders"`). Required.
    pub path: String,
    /// `biz_type`: the biz type of the route's keys, 1 to 64 letters, digits
    /// and `-_.:`. Each biz type has one policy: routes that share a biz
    /// type must resolve to the same policy. Default `"http"`.
    #[serde(default = "default_biz_type")]
    pub biz_type: String,
    /// See [`PolicyConfig::retention_ms`].
    pub retention_ms: Option<u64>,
    /// See [`PolicyConfig::lease_ms`].
    pub lease_ms: Option<u64>,
    /// See [`PolicyConfig::retry_after_ms`].
    pub retry_after_ms: Option<u64>,
    /// See [`PolicyConfig::expired_lease`].
    pub expired_lease: Option<ExpiredLease>,
    /// See [`PolicyConfig::outcome_unknown`].
    pub outcome_unknown: Option<ExpiredLease>,
    /// See [`PolicyConfig::in_progress`].
    pub in_progress: Option<InProgressConfig>,
    /// See [`PolicyConfig::server_errors`].
    pub server_errors: Option<ServerErrors>,
    /// See [`PolicyConfig::key`]; on a route it applies to every method
    /// the route matches.
    pub key: Option<KeyRequirement>,
    /// See [`PolicyConfig::fingerprint_fields`].
    pub fingerprint_fields: Option<Vec<String>>,
    /// See [`PolicyConfig::anonymous`].
    pub anonymous: Option<AnonymousMode>,
    /// See [`PolicyConfig::lookup`].
    pub lookup: Option<String>,
    /// See [`PolicyConfig::stuck_retention_ms`].
    pub stuck_retention_ms: Option<u64>,
}

fn any_method() -> String {
    "*".into()
}

fn default_biz_type() -> String {
    DEFAULT_BIZ_TYPE.into()
}

impl RouteConfig {
    /// A route for `method` and `path` with the default biz type and no
    /// policy overrides.
    pub fn new(method: impl Into<String>, path: impl Into<String>) -> Self {
        RouteConfig {
            method: method.into(),
            path: path.into(),
            biz_type: default_biz_type(),
            retention_ms: None,
            lease_ms: None,
            retry_after_ms: None,
            expired_lease: None,
            outcome_unknown: None,
            in_progress: None,
            server_errors: None,
            key: None,
            fingerprint_fields: None,
            anonymous: None,
            lookup: None,
            stuck_retention_ms: None,
        }
    }

    fn overrides(&self) -> PolicyConfig {
        PolicyConfig {
            retention_ms: self.retention_ms,
            lease_ms: self.lease_ms,
            retry_after_ms: self.retry_after_ms,
            expired_lease: self.expired_lease,
            outcome_unknown: self.outcome_unknown,
            in_progress: self.in_progress,
            server_errors: self.server_errors,
            key: self.key,
            fingerprint_fields: self.fingerprint_fields.clone(),
            anonymous: self.anonymous,
            lookup: self.lookup.clone(),
            stuck_retention_ms: self.stuck_retention_ms,
        }
    }
}

/// The whole configuration file. Every key is optional.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProxyConfig {
    /// `upstream_timeout_ms`: how long the proxy waits for the upstream's
    /// complete answer, in milliseconds. A timeout after the request was
    /// sent leaves the key outcome-unknown (the caller gets 504). Default
    /// 30 000.
    pub upstream_timeout_ms: u64,
    /// `sweep_interval_ms`: how often the background sweep deletes expired
    /// keys, in milliseconds; 0 disables it. Default 60 000.
    pub sweep_interval_ms: u64,
    /// `sweep_batch`: how many keys one sweep batch deletes at most (a
    /// sweep runs batches until one deletes fewer). Default 1 000.
    pub sweep_batch: u32,
    /// `scope_header`: a request header whose value names the client (e.g.
    /// `"X-Tenant-Id"`, set by a gateway in front of the proxy). When set
    /// and present it is the key's scope; otherwise the scope is the
    /// SHA-256 of the `Authorization` header, and without either the
    /// route's `anonymous` decides ([`PolicyConfig::anonymous`]).
    /// Default: none.
    pub scope_header: Option<String>,
    /// `max_body_bytes`: the largest request body accepted on a keyed
    /// request, in bytes; a larger body is refused with 413 and never
    /// buffered whole. Default 1 048 576 (1 MiB).
    pub max_body_bytes: u32,
    /// `header_read_timeout_ms`: how long a client may take to send a
    /// request head, from its first byte (or from connecting) to the blank
    /// line that ends it, in milliseconds. A slower head is answered 408
    /// and the connection closed. Default
    /// [`DEFAULT_HEADER_READ_TIMEOUT_MS`].
    pub header_read_timeout_ms: u64,
    /// `body_read_timeout_ms`: how long a keyed request's body may take to
    /// arrive, in milliseconds. A slower body (for example one that stops
    /// before its Content-Length) is answered 408; nothing is stored.
    /// Default [`DEFAULT_BODY_READ_TIMEOUT_MS`].
    pub body_read_timeout_ms: u64,
    /// `guest_deadline_ms`: the longest one call into the engine component
    /// may compute, in milliseconds; time in the store, the clock and the
    /// result lookup does not count. A call past it fails (500) and its
    /// instance is discarded. `idem serve-component` gives each request to
    /// the component it serves the same budget. Default 1 000
    /// ([`idem_engine::engine::DEFAULT_GUEST_DEADLINE`]).
    pub guest_deadline_ms: u64,
    /// `guest_memory_bytes`: the most linear memory one instance of the
    /// engine component may use, in bytes, at least 4 MiB. A call that
    /// needs more fails (500) and its instance is discarded. `idem
    /// serve-component` caps each instance of the component it serves the
    /// same way, all its memories together. Default 268 435 456 (256 MiB,
    /// [`idem_engine::engine::DEFAULT_MEMORY_LIMIT`]).
    pub guest_memory_bytes: u64,
    /// `group_commit`: with a SQLite `--db`, batch the claims and
    /// completions of concurrent requests into one transaction, each
    /// answered only after it commits ((`SqliteOptions::group_commit` of `idem-sqlite`)).
    /// Default true: a write that would wait for a group runs on a
    /// blocking thread and joins the next group, the others stay on the
    /// request's thread, so it costs nothing without concurrent writers
    /// and gave 1.2-1.4x the first requests at 32 connections (README,
    /// "Performance"). Ignored for PostgreSQL.
    pub group_commit: bool,
    /// `outcome_journal`: a local file where the outcome of an answered
    /// request is kept (synced to disk) while the store cannot take it,
    /// and read back at start, so that a store outage or a restart never
    /// runs an answered request a second time. `idem serve` with a SQLite
    /// `--db` uses `<db>-outcomes` unless this is set. Default: none (held
    /// in memory only).
    pub outcome_journal: Option<std::path::PathBuf>,
    /// `lookup_timeout_ms`: how long one business lookup (a route's
    /// `lookup`) may take, in milliseconds, connecting and reading the
    /// whole answer; a slower one means "cannot tell". Default
    /// [`DEFAULT_LOOKUP_TIMEOUT_MS`].
    pub lookup_timeout_ms: u64,
    /// `[defaults]`: the policy of every route and of unmatched requests.
    pub defaults: PolicyConfig,
    /// `[[routes]]`: the first route matching a request's method and path
    /// gives its biz type and policy; unmatched unsafe requests get the
    /// defaults and biz type `http`.
    pub routes: Vec<RouteConfig>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            upstream_timeout_ms: 30_000,
            sweep_interval_ms: 60_000,
            sweep_batch: 1_000,
            scope_header: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            header_read_timeout_ms: DEFAULT_HEADER_READ_TIMEOUT_MS,
            body_read_timeout_ms: DEFAULT_BODY_READ_TIMEOUT_MS,
            guest_deadline_ms: u64::try_from(
                idem_engine::engine::DEFAULT_GUEST_DEADLINE.as_millis(),
            )
            .unwrap_or(u64::MAX),
            guest_memory_bytes: idem_engine::engine::DEFAULT_MEMORY_LIMIT as u64,
            group_commit: true,
            outcome_journal: None,
            lookup_timeout_ms: DEFAULT_LOOKUP_TIMEOUT_MS,
            defaults: PolicyConfig::default(),
            routes: Vec::new(),
        }
    }
}

impl ProxyConfig {
    /// Parses and checks a TOML configuration.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Parse`] for bad TOML, an unknown key or a value of
    /// the wrong type; [`ConfigError::Invalid`] for a value out of range.
    pub fn from_toml_str(text: &str) -> Result<ProxyConfig, ConfigError> {
        let config: ProxyConfig =
            toml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        config.resolve()?;
        Ok(config)
    }

    /// Reads, parses and checks a TOML configuration file.
    ///
    /// # Errors
    ///
    /// As [`ProxyConfig::from_toml_str`], and [`ConfigError::Read`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<ProxyConfig, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        ProxyConfig::from_toml_str(&text)
    }

    /// The bounds `guest_deadline_ms` and `guest_memory_bytes` put on every
    /// guest component this configuration runs: the engine of `idem serve`
    /// and of the operator commands, and the component `idem
    /// serve-component` serves.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] when `guest_memory_bytes` does not fit this
    /// machine's address space.
    pub fn guest_bounds(&self) -> Result<GuestBounds, ConfigError> {
        let memory_bytes = usize::try_from(self.guest_memory_bytes).map_err(|_| {
            ConfigError::invalid(
                "guest_memory_bytes",
                "does not fit this machine's address space",
            )
        })?;
        Ok(GuestBounds {
            deadline: Duration::from_millis(self.guest_deadline_ms),
            memory_bytes,
        })
    }

    /// The policy of `biz_type`: the first route with that biz type, or the
    /// defaults (for `http` and any biz type no route names).
    pub fn policy_for(&self, biz_type: &str) -> Policy {
        self.merged_for(biz_type).policy(self.max_body_bytes)
    }

    /// The `lookup` of `biz_type` (see [`ProxyConfig::policy_for`]), parsed;
    /// none when it has none. A configuration from
    /// [`ProxyConfig::from_toml_str`] has valid templates; one built in code
    /// and not resolved may not, and an invalid one counts as none.
    pub fn lookup_for(&self, biz_type: &str) -> Option<LookupTemplate> {
        LookupTemplate::parse(self.merged_for(biz_type).lookup.as_deref()?).ok()
    }

    /// The `stuck_retention_ms` of `biz_type`; none when its stuck keys
    /// are kept until an operator settles them (0).
    pub fn stuck_retention_for(&self, biz_type: &str) -> Option<u64> {
        match self
            .merged_for(biz_type)
            .stuck_retention_ms
            .unwrap_or(DEFAULT_STUCK_RETENTION_MS)
        {
            0 => None,
            ms => Some(ms),
        }
    }

    /// Every biz type this configuration names: `http` (the default route)
    /// and each route's, each once, in order.
    pub fn biz_types(&self) -> Vec<String> {
        let mut all = vec![DEFAULT_BIZ_TYPE.to_owned()];
        for r in &self.routes {
            if !all.contains(&r.biz_type) {
                all.push(r.biz_type.clone());
            }
        }
        all
    }

    /// The policy keys of `biz_type`: its first route's over `[defaults]`.
    fn merged_for(&self, biz_type: &str) -> PolicyConfig {
        self.routes
            .iter()
            .find(|r| r.biz_type == biz_type)
            .map(|r| r.overrides().or(&self.defaults))
            .unwrap_or_else(|| self.defaults.clone())
    }

    /// Checks the configuration and builds its route table.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] naming the first bad field.
    pub fn resolve(&self) -> Result<RouteTable, ConfigError> {
        if self.upstream_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "upstream_timeout_ms",
                "must be at least 1",
            ));
        }
        if self.sweep_batch == 0 {
            return Err(ConfigError::invalid("sweep_batch", "must be at least 1"));
        }
        if self.header_read_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "header_read_timeout_ms",
                "must be at least 1",
            ));
        }
        if self.body_read_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "body_read_timeout_ms",
                "must be at least 1",
            ));
        }
        if self.lookup_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "lookup_timeout_ms",
                "must be at least 1",
            ));
        }
        if self.guest_deadline_ms == 0 {
            return Err(ConfigError::invalid(
                "guest_deadline_ms",
                "must be at least 1",
            ));
        }
        if self.guest_memory_bytes < MIN_GUEST_MEMORY_BYTES
            || usize::try_from(self.guest_memory_bytes).is_err()
        {
            return Err(ConfigError::invalid(
                "guest_memory_bytes",
                format!(
                    "must be at least {MIN_GUEST_MEMORY_BYTES} (4 MiB) and fit this machine's address space"
                ),
            ));
        }
        let scope_header = match &self.scope_header {
            None => None,
            Some(h) => Some(HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                ConfigError::invalid("scope_header", "is not a valid HTTP header name")
            })?),
        };
        self.defaults.check("defaults")?;
        let default = Route {
            index: None,
            method: None,
            pattern: PathPattern::parse("/*").map_err(|m| ConfigError::invalid("path", m))?,
            biz_type: DEFAULT_BIZ_TYPE.into(),
            policy: self.defaults.policy(self.max_body_bytes),
            key: None,
            post_patch_key: self.defaults.key.unwrap_or(KeyRequirement::Required),
            server_errors: self.defaults.server_errors.unwrap_or_default(),
            anonymous: self.defaults.anonymous.unwrap_or_default(),
            lookup: self.defaults.lookup.clone(),
            stuck_retention_ms: self.defaults.stuck_retention_ms,
        };
        let mut routes = Vec::with_capacity(self.routes.len());
        for (i, r) in self.routes.iter().enumerate() {
            let at = format!("routes[{i}]");
            let method = parse_route_method(&r.method)
                .map_err(|m| ConfigError::invalid(format!("{at}.method"), m))?;
            let pattern = PathPattern::parse(&r.path)
                .map_err(|m| ConfigError::invalid(format!("{at}.path"), m))?;
            if r.biz_type.is_empty() {
                return Err(ConfigError::invalid(
                    format!("{at}.biz_type"),
                    "must not be empty",
                ));
            }
            let overrides = r.overrides();
            overrides.check(&at)?;
            let merged = overrides.or(&self.defaults);
            routes.push(Route {
                index: Some(i),
                method,
                pattern,
                biz_type: r.biz_type.clone(),
                policy: merged.policy(self.max_body_bytes),
                key: r.key,
                post_patch_key: merged.key.unwrap_or(KeyRequirement::Required),
                server_errors: merged.server_errors.unwrap_or_default(),
                anonymous: merged.anonymous.unwrap_or_default(),
                lookup: merged.lookup.clone(),
                stuck_retention_ms: merged.stuck_retention_ms,
            });
        }
        // One biz type, one policy: the engine requires every call about a
        // key to pass the same policy.
        for (i, r) in routes.iter().enumerate() {
            let earlier = routes[..i]
                .iter()
                .chain(std::iter::once(&default))
                .find(|o| {
                    o.biz_type == r.biz_type
                        && (o.policy != r.policy
                            || o.lookup != r.lookup
                            || o.stuck_retention_ms != r.stuck_retention_ms)
                });
            if let Some(o) = earlier {
                let other = match o.index {
                    Some(j) => format!("routes[{j}]"),
                    None => "[defaults] (the policy of unmatched requests)".into(),
                };
                return Err(ConfigError::invalid(
                    format!("routes[{i}].biz_type"),
                    format!(
                        "biz type '{}' has another policy (or lookup, or stuck_retention_ms) in {other}; routes sharing a biz type must share its policy",
                        r.biz_type
                    ),
                ));
            }
        }
        Ok(RouteTable {
            routes,
            default,
            scope_header,
        })
    }
}

/// A `lookup` URL template: `http://` and literal text with `{key}`,
/// `{scope}` and `{biz_type}` placeholders, each replaced by its value,
/// percent-encoded (every byte but ASCII letters, digits and `-._~`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupTemplate {
    parts: Vec<TemplatePart>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum TemplatePart {
    Literal(String),
    Key,
    Scope,
    BizType,
}

/// What a placeholder's value may keep unencoded: RFC 3986's unreserved
/// characters, so that a value never adds a `/`, `?`, `#` or `%` of its own.
const LOOKUP_VALUE: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

impl LookupTemplate {
    /// Parses a template; the error says what is wrong.
    ///
    /// # Errors
    ///
    /// A sentence when the template is not an `http://` URL, has no
    /// `{key}`, names an unknown placeholder, or leaves a brace unclosed.
    pub fn parse(template: &str) -> Result<LookupTemplate, String> {
        if !template.starts_with("http://") {
            return Err(format!(
                "'{template}' must start with http:// (the lookup is a plain HTTP request to a service beside the proxy)"
            ));
        }
        let mut parts = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(TemplatePart::Literal(rest[..open].to_owned()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(format!("'{template}' has a '{{' without its '}}'"));
            };
            parts.push(match &rest[open + 1..open + close] {
                "key" => TemplatePart::Key,
                "scope" => TemplatePart::Scope,
                "biz_type" => TemplatePart::BizType,
                other => {
                    return Err(format!(
                        "'{template}' names {{{other}}}: only {{key}}, {{scope}} and {{biz_type}} are known"
                    ));
                }
            });
            rest = &rest[open + close + 1..];
        }
        if !rest.is_empty() {
            parts.push(TemplatePart::Literal(rest.to_owned()));
        }
        if !parts.contains(&TemplatePart::Key) {
            return Err(format!(
                "'{template}' has no {{key}}: every key would get the same answer"
            ));
        }
        let t = LookupTemplate { parts };
        t.render("key", "scope", "biz")
            .parse::<http::Uri>()
            .map_err(|e| format!("'{template}' does not make a valid URL: {e}"))?;
        Ok(t)
    }

    /// The URL for one key.
    pub fn render(&self, key: &str, scope: &str, biz_type: &str) -> String {
        let mut url = String::new();
        for part in &self.parts {
            let value = match part {
                TemplatePart::Literal(text) => {
                    url.push_str(text);
                    continue;
                }
                TemplatePart::Key => key,
                TemplatePart::Scope => scope,
                TemplatePart::BizType => biz_type,
            };
            url.extend(percent_encoding::utf8_percent_encode(value, LOOKUP_VALUE));
        }
        url
    }
}

/// True for the methods the proxy always passes through: GET, HEAD,
/// OPTIONS, TRACE and CONNECT ([`idem_http::is_safe_method`]).
pub fn is_safe_method(method: &Method) -> bool {
    idem_http::is_safe_method(method.as_str())
}

fn parse_route_method(text: &str) -> Result<Option<Method>, String> {
    if text == "*" {
        return Ok(None);
    }
    let method = Method::from_bytes(text.to_ascii_uppercase().as_bytes())
        .map_err(|_| format!("'{text}' is not an HTTP method or \"*\""))?;
    if is_safe_method(&method) {
        return Err(format!(
            "{method} is a safe method: safe methods are always passed through and cannot be routed"
        ));
    }
    Ok(Some(method))
}

/// One segment of a route path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
}

/// A route's path pattern: exact, prefix (`/*`) or with `{param}` segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    segments: Vec<Segment>,
    prefix: bool,
}

impl PathPattern {
    /// Parses a pattern; the error says what is wrong.
    ///
    /// # Errors
    ///
    /// A sentence when the path does not start with `/`, has `*` anywhere
    /// but as the last segment, or has a malformed `{param}`.
    pub fn parse(path: &str) -> Result<PathPattern, String> {
        let Some(rest) = path.strip_prefix('/') else {
            return Err(format!("'{path}' must start with '/'"));
        };
        let mut parts: Vec<&str> = rest.split('/').collect();
        let prefix = parts.last() == Some(&"*");
        if prefix {
            parts.pop();
        }
        let mut segments = Vec::with_capacity(parts.len());
        for part in parts {
            if part.contains('*') {
                return Err(format!(
                    "'{path}': '*' is only allowed as the last segment, as in \"/orders/*\""
                ));
            }
            if let Some(inner) = part.strip_prefix('{') {
                let name = inner.strip_suffix('}').ok_or_else(|| {
                    format!("'{path}': a parameter segment must be '{{name}}', a whole segment")
                })?;
                if name.is_empty() || name.contains(['{', '}']) {
                    return Err(format!(
                        "'{path}': a parameter needs a name, as in '{{id}}'"
                    ));
                }
                segments.push(Segment::Param);
            } else if part.contains(['{', '}']) {
                return Err(format!(
                    "'{path}': a parameter segment must be '{{name}}', a whole segment"
                ));
            } else {
                segments.push(Segment::Literal(part.to_owned()));
            }
        }
        Ok(PathPattern { segments, prefix })
    }

    /// True when `path` (without its query) matches.
    pub fn matches(&self, path: &str) -> bool {
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        let mut parts = rest.split('/');
        for seg in &self.segments {
            match (seg, parts.next()) {
                (Segment::Literal(l), Some(p)) if l == p => {}
                (Segment::Param, Some(p)) if !p.is_empty() => {}
                _ => return false,
            }
        }
        self.prefix || parts.next().is_none()
    }
}

/// A resolved route: what the proxy does with the requests it matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    index: Option<usize>,
    method: Option<Method>,
    pattern: PathPattern,
    /// The biz type of the keys.
    pub biz_type: String,
    /// The engine policy passed with every call about these keys.
    pub policy: Policy,
    /// The route's own `key` setting, applying to every method.
    key: Option<KeyRequirement>,
    /// The `key` setting for POST and PATCH when the route has none.
    post_patch_key: KeyRequirement,
    /// What an upstream 5xx means.
    pub server_errors: ServerErrors,
    /// What a keyed request that names no client gets.
    pub anonymous: AnonymousMode,
    /// The `lookup` template, as written.
    lookup: Option<String>,
    /// The `stuck_retention_ms`, as written.
    stuck_retention_ms: Option<u64>,
}

impl Route {
    /// The index in `[[routes]]`, or `None` for the default route.
    pub fn index(&self) -> Option<usize> {
        self.index
    }

    /// Whether a request with `method` must carry an `Idempotency-Key`.
    pub fn key_requirement(&self, method: &Method) -> KeyRequirement {
        idem_http::key_requirement(method.as_str(), self.key, self.post_patch_key)
    }

    fn matches(&self, method: &Method, path: &str) -> bool {
        self.method.as_ref().is_none_or(|m| m == method) && self.pattern.matches(path)
    }
}

/// The routes of a configuration, in order, and the default route.
#[derive(Debug, Clone)]
pub struct RouteTable {
    routes: Vec<Route>,
    default: Route,
    scope_header: Option<HeaderName>,
}

impl RouteTable {
    /// The first route matching `method` and `path`, or the default route.
    pub fn find(&self, method: &Method, path: &str) -> &Route {
        self.routes
            .iter()
            .find(|r| r.matches(method, path))
            .unwrap_or(&self.default)
    }

    /// Every configured route, then the default route.
    pub fn all(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter().chain(std::iter::once(&self.default))
    }

    /// The parsed `scope_header`.
    pub fn scope_header(&self) -> Option<&HeaderName> {
        self.scope_header.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_the_defaults() {
        let c = ProxyConfig::from_toml_str("").unwrap();
        assert_eq!(c, ProxyConfig::default());
        assert_eq!(c.upstream_timeout_ms, 30_000);
        assert_eq!(c.sweep_interval_ms, 60_000);
        assert_eq!(c.sweep_batch, 1_000);
        assert_eq!(c.max_body_bytes, Policy::default().max_body_bytes);
        let t = c.resolve().unwrap();
        let r = t.find(&Method::POST, "/anything");
        assert_eq!(r.index(), None);
        assert_eq!(r.biz_type, "http");
        assert_eq!(r.policy, Policy::default());
        assert_eq!(r.server_errors, ServerErrors::Retry);
        assert_eq!(r.key_requirement(&Method::POST), KeyRequirement::Required);
        assert_eq!(r.key_requirement(&Method::PATCH), KeyRequirement::Required);
        assert_eq!(r.key_requirement(&Method::PUT), KeyRequirement::Optional);
        assert_eq!(r.key_requirement(&Method::DELETE), KeyRequirement::Optional);
        assert_eq!(r.anonymous, AnonymousMode::Reject);
        assert!(t.scope_header().is_none());
    }

    #[test]
    fn anonymous_is_layered_like_every_policy_key() -> Result<(), ConfigError> {
        let c = ProxyConfig::from_toml_str(
            r#"
            [defaults]
            anonymous = "shared"
            [[routes]]
            path = "/public/*"
            biz_type = "public"
            anonymous = "client-address"
            [[routes]]
            path = "/strict"
            biz_type = "strict"
            anonymous = "reject"
            [[routes]]
            path = "/inherits"
            biz_type = "inherits"
            "#,
        )?;
        let t = c.resolve()?;
        let mode = |path: &str| t.find(&Method::POST, path).anonymous;
        assert_eq!(mode("/elsewhere"), AnonymousMode::Shared);
        assert_eq!(mode("/public/x"), AnonymousMode::ClientAddress);
        assert_eq!(mode("/strict"), AnonymousMode::Reject);
        assert_eq!(mode("/inherits"), AnonymousMode::Shared);
        // Without [defaults], a route without the key fails closed.
        let t = ProxyConfig::from_toml_str("[[routes]]\npath = \"/a\"\nanonymous = \"shared\"\n")?
            .resolve()?;
        assert_eq!(t.find(&Method::POST, "/a").anonymous, AnonymousMode::Shared);
        assert_eq!(t.find(&Method::POST, "/b").anonymous, AnonymousMode::Reject);
        Ok(())
    }

    #[test]
    fn every_field_is_read() {
        let c = ProxyConfig::from_toml_str(
            r#"
            upstream_timeout_ms = 5000
            sweep_interval_ms = 0
            sweep_batch = 10
            scope_header = "X-Tenant-Id"
            max_body_bytes = 2048
            [defaults]
            retention_ms = 1000
            lease_ms = 2000
            retry_after_ms = 300
            expired_lease = "reconcile"
            outcome_unknown = "take-over"
            in_progress = "reject"
            server_errors = "store"
            key = "optional"
            fingerprint_fields = ["/a"]
            anonymous = "shared"
            [[routes]]
            method = "post"
            path = "/orders"
            biz_type = "order.create"
            retention_ms = 5
            lease_ms = 6
            retry_after_ms = 7
            expired_lease = "manual"
            outcome_unknown = "reconcile"
            in_progress = { wait_ms = 5000, poll_ms = 20 }
            server_errors = "retry"
            key = "required"
            fingerprint_fields = ["/sku", "/qty"]
            anonymous = "client-address"
            [[routes]]
            path = "/payments/*"
            biz_type = "payment"
            in_progress = { wait_ms = 100 }
            "#,
        )
        .unwrap();
        assert_eq!(c.upstream_timeout_ms, 5000);
        assert_eq!(c.sweep_interval_ms, 0);
        assert_eq!(c.sweep_batch, 10);
        assert_eq!(c.scope_header.as_deref(), Some("X-Tenant-Id"));
        assert_eq!(c.max_body_bytes, 2048);
        let t = c.resolve().unwrap();
        assert_eq!(t.scope_header().unwrap().as_str(), "x-tenant-id");

        let d = t.find(&Method::POST, "/elsewhere");
        assert_eq!(d.biz_type, "http");
        assert_eq!(d.policy.retention_ms, 1000);
        assert_eq!(d.policy.lease_ms, 2000);
        assert_eq!(d.policy.retry_after_ms, 300);
        assert_eq!(d.policy.expired_lease, ExpiredLease::Reconcile);
        assert_eq!(d.policy.outcome_unknown, ExpiredLease::TakeOver);
        assert_eq!(d.policy.in_progress, InProgressMode::Reject);
        assert_eq!(d.policy.failure_mode, FailureMode::HonorDisposition);
        assert_eq!(d.policy.fingerprint_fields, vec!["/a".to_string()]);
        assert_eq!(d.policy.max_body_bytes, 2048);
        assert_eq!(d.server_errors, ServerErrors::Store);
        assert_eq!(d.key_requirement(&Method::POST), KeyRequirement::Optional);
        assert_eq!(d.anonymous, AnonymousMode::Shared);

        let o = t.find(&Method::POST, "/orders");
        assert_eq!(o.index(), Some(0));
        assert_eq!(o.biz_type, "order.create");
        assert_eq!(o.policy.retention_ms, 5);
        assert_eq!(o.policy.lease_ms, 6);
        assert_eq!(o.policy.retry_after_ms, 7);
        assert_eq!(o.policy.expired_lease, ExpiredLease::Manual);
        assert_eq!(o.policy.outcome_unknown, ExpiredLease::Reconcile);
        assert_eq!(
            o.policy.in_progress,
            InProgressMode::Wait(WaitSpec {
                max_wait_ms: 5000,
                poll_interval_ms: 20
            })
        );
        assert_eq!(o.server_errors, ServerErrors::Retry);
        assert_eq!(o.key_requirement(&Method::POST), KeyRequirement::Required);
        assert_eq!(o.anonymous, AnonymousMode::ClientAddress);
        assert_eq!(
            o.policy.fingerprint_fields,
            vec!["/sku".to_string(), "/qty".to_string()]
        );
        // A PUT to /orders does not match the POST route.
        assert_eq!(t.find(&Method::PUT, "/orders").index(), None);

        let p = t.find(&Method::PUT, "/payments/7");
        assert_eq!(p.index(), Some(1));
        // Unset keys come from [defaults].
        assert_eq!(p.policy.retention_ms, 1000);
        assert_eq!(p.server_errors, ServerErrors::Store);
        assert_eq!(p.anonymous, AnonymousMode::Shared);
        assert_eq!(
            p.policy.in_progress,
            InProgressMode::Wait(WaitSpec {
                max_wait_ms: 100,
                poll_interval_ms: DEFAULT_POLL_MS
            })
        );
        assert_eq!(c.policy_for("payment"), p.policy);
        assert_eq!(c.policy_for("http"), d.policy);
        assert_eq!(c.policy_for("unknown.type"), d.policy);
    }

    fn parse_err(text: &str) -> String {
        match ProxyConfig::from_toml_str(text) {
            Ok(_) => panic!("expected an error for {text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn unknown_keys_are_named() {
        let m = parse_err("upstream_timeout = 5");
        assert!(m.contains("unknown field `upstream_timeout`"), "{m}");
        let m = parse_err("[defaults]\nlease = 5");
        assert!(m.contains("unknown field `lease`"), "{m}");
        let m = parse_err("[[routes]]\npath = \"/a\"\nbiz = \"x\"");
        assert!(m.contains("unknown field `biz`"), "{m}");
        let m = parse_err("[defaults]\nin_progress = { wait_ms = 5, pol_ms = 1 }");
        assert!(m.contains("unknown field `pol_ms`"), "{m}");
    }

    #[test]
    fn bad_values_are_named() {
        let m = parse_err("[defaults]\nexpired_lease = \"sometimes\"");
        assert!(
            m.contains("expired_lease") && m.contains("take-over"),
            "{m}"
        );
        let m = parse_err("[defaults]\nin_progress = \"wait\"");
        assert!(m.contains("in_progress") && m.contains("reject"), "{m}");
        let m = parse_err("[defaults]\nserver_errors = \"ignore\"");
        assert!(m.contains("server_errors"), "{m}");
        let m = parse_err("[defaults]\nkey = \"maybe\"");
        assert!(m.contains("key"), "{m}");
        let m = parse_err("[defaults]\nanonymous = \"allow\"");
        assert!(
            m.contains("anonymous") && m.contains("client-address"),
            "{m}"
        );
        let m = parse_err("anonymous = \"shared\"");
        assert!(m.contains("unknown field `anonymous`"), "{m}");
        let m = parse_err("sweep_batch = -1");
        assert!(m.contains("sweep_batch"), "{m}");
        let m = parse_err("upstream_timeout_ms = 0");
        assert!(m.contains("upstream_timeout_ms"), "{m}");
        let m = parse_err("sweep_batch = 0");
        assert!(m.contains("sweep_batch"), "{m}");
        let m = parse_err("header_read_timeout_ms = 0");
        assert!(m.contains("header_read_timeout_ms"), "{m}");
        let m = parse_err("body_read_timeout_ms = 0");
        assert!(m.contains("body_read_timeout_ms"), "{m}");
        let m = parse_err("scope_header = \"bad header\"");
        assert!(m.contains("scope_header"), "{m}");
        let m = parse_err("[defaults]\nlease_ms = 0");
        assert!(m.contains("defaults.lease_ms"), "{m}");
        let m = parse_err("[[routes]]\npath = \"/a\"\nretention_ms = 0");
        assert!(m.contains("routes[0].retention_ms"), "{m}");
        let m = parse_err("[defaults]\nin_progress = { wait_ms = 60001 }");
        assert!(m.contains("defaults.in_progress.wait_ms"), "{m}");
        let m = parse_err("[defaults]\nin_progress = { wait_ms = 10, poll_ms = 0 }");
        assert!(m.contains("defaults.in_progress.poll_ms"), "{m}");
        let m = parse_err("[[routes]]\nmethod = \"GET\"\npath = \"/a\"");
        assert!(m.contains("routes[0].method"), "{m}");
        let m = parse_err("[[routes]]\nmethod = \"PO ST\"\npath = \"/a\"");
        assert!(m.contains("routes[0].method"), "{m}");
        let m = parse_err("[[routes]]\npath = \"a\"");
        assert!(m.contains("routes[0].path"), "{m}");
        let m = parse_err("[[routes]]\npath = \"/a/*/b\"");
        assert!(m.contains("routes[0].path"), "{m}");
        let m = parse_err("[[routes]]\npath = \"/a/{}\"");
        assert!(m.contains("routes[0].path"), "{m}");
        let m = parse_err("[[routes]]\npath = \"/a/x{id}\"");
        assert!(m.contains("routes[0].path"), "{m}");
        let m = parse_err("[[routes]]\nbiz_type = \"x\"");
        assert!(m.contains("path"), "{m}");
        let m = parse_err(
            "[[routes]]\npath = \"/a\"\nbiz_type = \"x\"\n[[routes]]\npath = \"/b\"\nbiz_type = \"x\"\nlease_ms = 5",
        );
        assert!(m.contains("routes[1].biz_type"), "{m}");
        let m = parse_err("[[routes]]\npath = \"/a\"\nlease_ms = 5");
        assert!(
            m.contains("routes[0].biz_type") && m.contains("[defaults]"),
            "{m}"
        );
    }

    #[test]
    fn guest_limits_are_read_and_checked() {
        let c = ProxyConfig::from_toml_str("guest_deadline_ms = 250\nguest_memory_bytes = 8388608")
            .unwrap();
        assert_eq!((c.guest_deadline_ms, c.guest_memory_bytes), (250, 8 << 20));
        assert_eq!(
            c.guest_bounds().unwrap(),
            GuestBounds {
                deadline: Duration::from_millis(250),
                memory_bytes: 8 << 20
            }
        );
        assert_eq!(
            ProxyConfig::default().guest_bounds().unwrap(),
            GuestBounds::default()
        );
        let m = parse_err("guest_deadline_ms = 0");
        assert!(
            m.contains("guest_deadline_ms") && m.contains("at least 1"),
            "{m}"
        );
        let m = parse_err("guest_memory_bytes = 65536");
        assert!(
            m.contains("guest_memory_bytes") && m.contains("4 MiB"),
            "{m}"
        );
    }

    #[test]
    fn group_commit_is_on_unless_turned_off() -> Result<(), ConfigError> {
        assert!(ProxyConfig::default().group_commit);
        assert!(ProxyConfig::from_toml_str("")?.group_commit);
        assert!(!ProxyConfig::from_toml_str("group_commit = false")?.group_commit);
        assert!(ProxyConfig::from_toml_str("group_commit = 1").is_err());
        Ok(())
    }

    #[test]
    fn lookup_templates_encode_their_values_and_name_what_is_wrong() {
        let t =
            LookupTemplate::parse("http://orders.internal/by-key/{key}?biz={biz_type}&s={scope}")
                .unwrap();
        assert_eq!(
            t.render("a/b?c#d%e f", "auth:ab", "order.create"),
            "http://orders.internal/by-key/a%2Fb%3Fc%23d%25e%20f?biz=order.create&s=auth%3Aab"
        );
        for (bad, says) in [
            ("https://x/{key}", "http://"),
            ("http://x/orders", "no {key}"),
            ("http://x/{key}/{tenant}", "{tenant}"),
            ("http://x/{key", "without its"),
            ("http://x y/{key}", "valid URL"),
        ] {
            let e = LookupTemplate::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let e = ProxyConfig::from_toml_str(
            "[[routes]]\npath = \"/orders\"\nbiz_type = \"o\"\nlookup = \"http://x/orders\"",
        )
        .unwrap_err();
        assert!(e.to_string().contains("routes[0].lookup"), "{e}");
        // Routes sharing a biz type share its lookup.
        let e = ProxyConfig::from_toml_str(
            "[[routes]]\npath = \"/a\"\nbiz_type = \"o\"\nlookup = \"http://x/{key}\"\n\
             [[routes]]\npath = \"/b\"\nbiz_type = \"o\"",
        )
        .unwrap_err();
        assert!(e.to_string().contains("routes[1].biz_type"), "{e}");
        let c = ProxyConfig::from_toml_str(
            "[defaults]\nstuck_retention_ms = 0\n\
             [[routes]]\npath = \"/a\"\nbiz_type = \"o\"\nlookup = \"http://x/{key}\"\nstuck_retention_ms = 5",
        )
        .unwrap();
        assert_eq!(c.biz_types(), ["http", "o"]);
        assert!(c.lookup_for("o").is_some() && c.lookup_for("http").is_none());
        assert_eq!(
            (c.stuck_retention_for("o"), c.stuck_retention_for("http")),
            (Some(5), None)
        );
        assert_eq!(
            ProxyConfig::default().stuck_retention_for("http"),
            Some(DEFAULT_STUCK_RETENTION_MS)
        );
        assert!(ProxyConfig::from_toml_str("lookup_timeout_ms = 0").is_err());
    }

    #[test]
    fn the_example_file_gives_the_defaults() {
        let text = include_str!("../../idem.example.toml");
        assert_eq!(
            ProxyConfig::from_toml_str(text).unwrap(),
            ProxyConfig {
                defaults: PolicyConfig {
                    retention_ms: Some(86_400_000),
                    lease_ms: Some(60_000),
                    retry_after_ms: Some(1_000),
                    expired_lease: Some(ExpiredLease::TakeOver),
                    outcome_unknown: Some(ExpiredLease::Manual),
                    in_progress: Some(InProgressConfig::Reject),
                    server_errors: Some(ServerErrors::Retry),
                    key: Some(KeyRequirement::Required),
                    fingerprint_fields: Some(Vec::new()),
                    anonymous: Some(AnonymousMode::Reject),
                    lookup: None,
                    stuck_retention_ms: Some(DEFAULT_STUCK_RETENTION_MS),
                },
                ..ProxyConfig::default()
            }
        );
        let resolved = ProxyConfig::from_toml_str(text).unwrap().resolve().unwrap();
        assert_eq!(resolved.find(&Method::POST, "/x").policy, Policy::default());
        // Its commented examples are valid too.
        let uncommented: String = text
            .lines()
            .map(|l| l.strip_prefix("# ").unwrap_or(l))
            .filter(|l| l.starts_with('[') || (!l.starts_with(' ') && l.contains(" = ")))
            .map(|l| format!("{l}\n"))
            .collect();
        let c = ProxyConfig::from_toml_str(&uncommented).unwrap();
        assert_eq!(c.routes.len(), 3);
        assert_eq!(c.scope_header.as_deref(), Some("X-Tenant-Id"));
    }

    #[test]
    fn exact_routes_match_only_their_path() {
        let p = PathPattern::parse("/orders").unwrap();
        assert!(p.matches("/orders"));
        assert!(!p.matches("/orders/"));
        assert!(!p.matches("/orders/1"));
        assert!(!p.matches("/order"));
        assert!(!p.matches("/ordersx"));
        assert!(!p.matches("/"));
        let root = PathPattern::parse("/").unwrap();
        assert!(root.matches("/"));
        assert!(!root.matches("/a"));
    }

    #[test]
    fn prefix_routes_match_below_their_path() {
        let p = PathPattern::parse("/orders/*").unwrap();
        assert!(p.matches("/orders"));
        assert!(p.matches("/orders/"));
        assert!(p.matches("/orders/1"));
        assert!(p.matches("/orders/1/items"));
        assert!(!p.matches("/ordersx"));
        assert!(!p.matches("/other"));
        let all = PathPattern::parse("/*").unwrap();
        assert!(all.matches("/"));
        assert!(all.matches("/x/y"));
    }

    #[test]
    fn param_routes_match_one_segment() {
        let p = PathPattern::parse("/users/{id}/orders").unwrap();
        assert!(p.matches("/users/42/orders"));
        assert!(p.matches("/users/abc/orders"));
        assert!(!p.matches("/users//orders"));
        assert!(!p.matches("/users/42/orders/1"));
        assert!(!p.matches("/users/42"));
        let q = PathPattern::parse("/users/{id}/*").unwrap();
        assert!(q.matches("/users/1"));
        assert!(q.matches("/users/1/a/b"));
        assert!(!q.matches("/users"));
    }

    #[test]
    fn first_matching_route_wins() {
        let c = ProxyConfig::from_toml_str(
            r#"
            [[routes]]
            method = "POST"
            path = "/orders/{id}/cancel"
            biz_type = "order.cancel"
            [[routes]]
            path = "/orders/*"
            biz_type = "order"
            key = "required"
            "#,
        )
        .unwrap();
        let t = c.resolve().unwrap();
        assert_eq!(
            t.find(&Method::POST, "/orders/9/cancel").biz_type,
            "order.cancel"
        );
        assert_eq!(
            t.find(&Method::DELETE, "/orders/9/cancel").biz_type,
            "order"
        );
        let r = t.find(&Method::DELETE, "/orders/9");
        assert_eq!(r.biz_type, "order");
        // A route's own `key` applies to every method it matches.
        assert_eq!(r.key_requirement(&Method::DELETE), KeyRequirement::Required);
        assert_eq!(t.find(&Method::POST, "/carts").biz_type, "http");
        assert_eq!(t.all().count(), 3);
    }
}
