//! The operator's commands: find stuck keys, and settle one by a decision
//! the engine cannot make (did the action take effect?).
//!
//! A key is named by its biz type, its idempotency key and its scope. The
//! scope can be given as stored (`--scope auth:<sha256>`) or as the client
//! sent it (`--auth 'Bearer …'`, `--scope-value tenant-7`, `--client-ip`),
//! derived by the very rules the proxy uses, so nobody hashes by hand.

use std::net::IpAddr;

use anyhow::{Context, Result, bail};
use clap::Args;
use http::{HeaderMap, HeaderName, HeaderValue, header};
use idem::clock::Clock;
use idem::layer::config::AnonymousMode;
use idem::{
    Engine, Failure, RecordKey, Resolution, Settlement, Status, Storage, StoredRecord,
    StoredResponse, Success, SystemClock,
};

/// The header name under which `--scope-value` is offered to the scope
/// rules; any name gives the same `hdr:<value>` scope.
const SCOPE_VALUE_HEADER: &str = "x-idem-scope";

/// Who the key belongs to: exactly one of these.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct Who {
    /// The scope as stored (e.g. auth:<sha256>, hdr:<tenant>, addr:<sha256>, anonymous).
    #[arg(long)]
    scope: Option<String>,
    /// The client's Authorization header value, as it sent it.
    #[arg(long)]
    auth: Option<String>,
    /// The value of the configured scope header (`scope_header`), as sent.
    #[arg(long)]
    scope_value: Option<String>,
    /// The client's IP address (routes with `anonymous = "client-address"`).
    #[arg(long)]
    client_ip: Option<IpAddr>,
}

impl Who {
    /// The stored scope.
    pub fn scope(&self) -> Result<String> {
        if let Some(scope) = &self.scope {
            return Ok(scope.clone());
        }
        let mut headers = HeaderMap::new();
        let mut scope_header = None;
        let mut anonymous = AnonymousMode::Reject;
        if let Some(auth) = &self.auth {
            let value =
                HeaderValue::from_str(auth).context("--auth is not a valid header value")?;
            headers.insert(header::AUTHORIZATION, value);
        }
        if let Some(value) = &self.scope_value {
            let name = HeaderName::from_static(SCOPE_VALUE_HEADER);
            let value = HeaderValue::from_str(value)
                .context("--scope-value is not a valid header value")?;
            headers.insert(name.clone(), value);
            scope_header = Some(name);
        }
        if self.client_ip.is_some() {
            anonymous = AnonymousMode::ClientAddress;
        }
        Ok(idem::layer::key::derive_scope(
            &headers,
            scope_header.as_ref(),
            anonymous,
            self.client_ip,
        )?)
    }
}

/// One key: its owner, biz type and idempotency key.
#[derive(Debug, Args)]
pub struct KeyArgs {
    #[command(flatten)]
    pub who: Who,
    /// The key's biz type (http unless a route names another).
    #[arg(long)]
    pub biz: String,
    /// The idempotency key.
    #[arg(long)]
    pub key: String,
}

impl KeyArgs {
    /// The record key these arguments name.
    pub fn record_key(&self) -> Result<RecordKey> {
        Ok(RecordKey::new(
            self.who.scope()?,
            self.biz.as_str(),
            self.key.as_str(),
        ))
    }
}

/// How to settle the key: exactly one of `--succeeded`, `--failed`,
/// `--release`.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct Decision {
    /// The action took effect: replay the response given by --status,
    /// --header and --body, and/or --result-ref.
    #[arg(long)]
    succeeded: bool,
    /// The action failed for good: replay this failure (--code, --message,
    /// and the response given by --status, --header and --body, if any).
    #[arg(long)]
    failed: bool,
    /// The action did not take effect: the next request executes it.
    #[arg(long)]
    release: bool,
}

/// `idem settle`.
#[derive(Debug, Args)]
pub struct SettleArgs {
    #[command(flatten)]
    pub key: KeyArgs,
    #[command(flatten)]
    decision: Decision,
    /// The status of the response to replay (100 to 599).
    #[arg(long)]
    status: Option<u16>,
    /// A header of the response to replay, as `name: value`; repeatable.
    #[arg(long = "header")]
    headers: Vec<String>,
    /// The body of the response to replay.
    #[arg(long)]
    body: Option<String>,
    /// A reference to the business result (--succeeded), e.g. an order id.
    #[arg(long)]
    result_ref: Option<String>,
    /// The failure's code (--failed), e.g. card-declined.
    #[arg(long)]
    code: Option<String>,
    /// The failure's message (--failed).
    #[arg(long, default_value = "")]
    message: String,
}

impl SettleArgs {
    /// The response `--status`, `--header` and `--body` give, if any.
    fn response(&self) -> Result<Option<StoredResponse>> {
        let Some(status) = self.status else {
            if !self.headers.is_empty() || self.body.is_some() {
                bail!("--header and --body need --status");
            }
            return Ok(None);
        };
        let headers = self
            .headers
            .iter()
            .map(|h| {
                let (name, value) = h
                    .split_once(':')
                    .with_context(|| format!("--header '{h}' is not `name: value`"))?;
                Ok((
                    name.trim().to_ascii_lowercase(),
                    value.trim().as_bytes().to_vec(),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(StoredResponse {
            status,
            headers,
            body: self.body.clone().unwrap_or_default().into_bytes(),
        }))
    }

    /// The resolution these arguments describe. The engine checks its
    /// content (status range, sizes) and names the field it refuses.
    pub fn resolution(&self) -> Result<Resolution> {
        let response = self.response()?;
        if self.decision.succeeded {
            if response.is_none() && self.result_ref.is_none() {
                bail!("--succeeded needs the response to replay (--status ...) or --result-ref");
            }
            return Ok(Resolution::Succeeded(Success {
                result_ref: self.result_ref.clone(),
                response,
            }));
        }
        if self.decision.failed {
            let code = self.code.clone().context("--failed needs --code")?;
            return Ok(Resolution::Failed(Failure {
                code,
                message: self.message.clone(),
                response,
            }));
        }
        if response.is_some() || self.result_ref.is_some() || self.code.is_some() {
            bail!("--release takes no response, --result-ref or --code");
        }
        Ok(Resolution::Released)
    }
}

/// Runs `idem settle` and prints what it did.
pub fn settle(engine: &Engine, policy: &idem::Policy, args: &SettleArgs, json: bool) -> Result<()> {
    let key = args.key.record_key()?;
    let resolution = args.resolution()?;
    let settlement = engine.settle(&key, policy, &resolution)?;
    let name = match settlement {
        Settlement::Settled => "settled",
        Settlement::Absent => "absent",
        Settlement::NotStuck => "not-stuck",
    };
    if json {
        println!(
            "{}",
            serde_json::json!({
                "settlement": name,
                "scope": key.scope, "biz_type": key.biz_type, "key": key.idem_key,
                "status": engine.inspect(&key)?.map(|s| s.status.as_str()),
            })
        );
    } else {
        match settlement {
            Settlement::Settled => println!(
                "settled: key '{}' is now {}",
                key.idem_key,
                resolution_status(&resolution)
            ),
            Settlement::Absent => println!(
                "no record for key '{}' in scope '{}'",
                key.idem_key, key.scope
            ),
            Settlement::NotStuck => println!(
                "key '{}' is not stuck (in progress under a live lease, or settled): nothing changed",
                key.idem_key
            ),
        }
    }
    if settlement == Settlement::Settled {
        Ok(())
    } else {
        bail!("nothing was settled ({name})")
    }
}

fn resolution_status(r: &Resolution) -> &'static str {
    match r {
        Resolution::Succeeded(_) => Status::Succeeded.as_str(),
        Resolution::Failed(_) => Status::Failed.as_str(),
        Resolution::Released => Status::Released.as_str(),
    }
}

/// Runs `idem stuck`: the biz type's processing records whose lease has
/// ended and its outcome-unknown records, oldest first.
pub fn stuck(store: &dyn Storage, biz: &str, limit: u32, json: bool) -> Result<()> {
    let now = SystemClock::new().now();
    let records = store.list_stale(biz, now, limit)?;
    if json {
        let rows: Vec<_> = records.iter().map(|r| row(r, now)).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if records.is_empty() {
        println!("no stuck keys of biz type '{biz}'");
    }
    for r in &records {
        println!(
            "{}  scope {}  key {}  stuck for {} s  attempts {}  fencing token {}",
            r.status.as_str(),
            r.key.scope,
            r.key.idem_key,
            now.saturating_sub(stuck_since(r)) / 1000,
            r.attempts,
            r.fencing_token
        );
    }
    Ok(())
}

/// When a stale record became stuck: its lease's end, or the report of its
/// unknown outcome.
fn stuck_since(r: &StoredRecord) -> u64 {
    match r.status {
        Status::Processing => r.lease_until.unwrap_or(r.updated_at),
        _ => r.updated_at,
    }
}

fn row(r: &StoredRecord, now: u64) -> serde_json::Value {
    serde_json::json!({
        "scope": r.key.scope,
        "biz_type": r.key.biz_type,
        "key": r.key.idem_key,
        "status": r.status.as_str(),
        "stuck_since": stuck_since(r),
        "stuck_ms": now.saturating_sub(stuck_since(r)),
        "attempts": r.attempts,
        "fencing_token": r.fencing_token,
        "failure": r.failure.as_ref().map(|f| &f.code),
    })
}
