//! The operator's commands: find stuck keys, and settle one by a decision
//! the engine cannot make (did the action take effect?). The rules are
//! `idem::operator`'s, which the admin server uses too.
//!
//! A key is named by its biz type, its idempotency key and its scope. The
//! scope can be given as stored (`--scope auth:<sha256>`) or as the client
//! sent it (`--auth 'Bearer …'`, `--scope-value tenant-7`, `--client-ip`),
//! derived by the very rules the proxy uses, so nobody hashes by hand.

use std::net::IpAddr;

use anyhow::{Context, Result, bail};
use clap::Args;
use idem::operator::{self, Client, SettleRequest};
use idem::{Engine, RecordKey, Storage, Timestamp};

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
    /// The client these flags name.
    fn client(&self) -> Client {
        Client {
            scope: self.scope.clone(),
            auth: self.auth.clone(),
            scope_value: self.scope_value.clone(),
            client_ip: self.client_ip,
        }
    }

    /// The stored scope.
    pub fn scope(&self) -> Result<String> {
        Ok(self.client().scope()?)
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
    /// The settlement these flags describe, as the admin server takes it.
    fn request(&self) -> Result<SettleRequest> {
        let headers = self
            .headers
            .iter()
            .map(|h| {
                let (name, value) = h
                    .split_once(':')
                    .with_context(|| format!("--header '{h}' is not `name: value`"))?;
                Ok((name.to_owned(), value.to_owned()))
            })
            .collect::<Result<Vec<_>>>()?;
        let decision = match (self.decision.succeeded, self.decision.failed) {
            (true, _) => operator::Decision::Succeeded,
            (_, true) => operator::Decision::Failed,
            _ => operator::Decision::Released,
        };
        Ok(SettleRequest {
            biz: self.key.biz.clone(),
            key: self.key.key.clone(),
            client: self.key.who.client(),
            decision,
            status: self.status,
            headers,
            body: self.body.clone(),
            result_ref: self.result_ref.clone(),
            code: self.code.clone(),
            message: self.message.clone(),
        })
    }
}

/// Runs `idem settle` and prints what it did.
pub fn settle(engine: &Engine, policy: &idem::Policy, args: &SettleArgs, json: bool) -> Result<()> {
    let request = args.request()?;
    let report = operator::settle(
        engine,
        policy,
        request.record_key()?,
        &request.resolution()?,
    )?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else if report.settled() {
        println!(
            "settled: key '{}' is now {}",
            report.key,
            report.status.unwrap_or("-")
        );
    } else if report.settlement == "absent" {
        println!(
            "no record (or only an expired one) for key '{}' in scope '{}'",
            report.key, report.scope
        );
    } else if let (Some("outcome-unknown"), Some(until)) = (report.status, report.lease_until) {
        println!(
            "key '{}' is not stuck yet: its outcome is unknown and its action may still land until the lease of the attempt that reported it ends ({until} ms since the epoch); release it after that, or settle it now with --succeeded or --failed: nothing changed",
            report.key
        );
    } else {
        println!(
            "key '{}' is not stuck (in progress under a live lease, or settled): nothing changed",
            report.key
        );
    }
    if report.settled() {
        Ok(())
    } else {
        bail!("nothing was settled ({})", report.settlement)
    }
}

/// Runs `idem stuck`: the biz type's processing records whose lease has
/// ended by `now` and its outcome-unknown records, oldest first.
pub fn stuck(
    store: &dyn Storage,
    biz: &str,
    now: Timestamp,
    after: Option<&str>,
    limit: u32,
    json: bool,
) -> Result<()> {
    let after = after
        .map(str::parse)
        .transpose()
        .map_err(|e: String| anyhow::anyhow!("--after: {e}"))?;
    let keys = operator::stuck(store, biz, now, after, limit)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&keys)?);
        return Ok(());
    }
    if keys.is_empty() {
        println!("no stuck keys of biz type '{biz}'");
    }
    for k in &keys {
        // An unknown outcome within the lease of the attempt that reported
        // it: its action may still land, so it may not be released yet.
        let wait = match k.stuck_since.saturating_sub(now) {
            0 => String::new(),
            ms => format!(
                "  may still land: release no sooner than in {} s",
                ms.div_ceil(1000)
            ),
        };
        println!(
            "{}  scope {}  key {}  stuck for {} s  attempts {}  fencing token {}{wait}",
            k.status,
            k.scope,
            k.key,
            k.stuck_ms / 1000,
            k.attempts,
            k.fencing_token
        );
    }
    if let Some(last) = keys.last().filter(|_| keys.len() == limit as usize) {
        println!("more may follow: --after {}", last.cursor);
    }
    Ok(())
}
