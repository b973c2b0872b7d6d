//! The proxy under load: `idem serve` (the real binary, as a child
//! process) in front of a trivial upstream, against the upstream direct.
//!
//! The load generator is wrk (<https://github.com/wg/wrk>; `apt-get
//! install wrk`), with 32 connections on 2 threads. Four kinds alternate
//! for the same duration, round after round: direct with new keys, through
//! the proxy with new keys (first requests: claim, forward, store), direct
//! with one fixed key and through the proxy with that key (replays: the
//! upstream is not called); the proxy runs with `group_commit = false`.
//! A second `idem serve` with `group_commit = true` (the default) takes
//! new keys too, at 32 connections and at 1. Without wrk the part says it
//! was skipped.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, anyhow, bail};
use axum::Router;
use axum::routing::post;
use idem_engine::testing::{cpu_time_us, waited_children_cpu_time_us};
use serde_json::json;

use crate::common::{Report, Settings, median};

/// Concurrent connections, as the issue asks.
const CONNECTIONS: u32 = 32;
/// The rate of replays at 32 connections, as a share of the direct
/// upstream's, that issue 14 asks of `idem serve`: the budget line of the
/// proxy part is worked out against it.
const REPLAY_TARGET: f64 = 0.5;

/// wrk threads: one per core of the machine the figures come from.
const WRK_THREADS: u32 = 2;

/// The wrk script: a new key per request (`new`) or one fixed key
/// (`fixed`), as one client with credentials (the proxy refuses keyed
/// requests that name no client); prints one machine-readable line at the
/// end.
const SCRIPT: &str = r#"
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end
function init(args)
  mode = args[1]
  run = args[2]
  n = 0
end
function request()
  n = n + 1
  local key = "replayed-key"
  if mode == "new" then key = "k-" .. run .. "-" .. id .. "-" .. n end
  return wrk.format("POST", "/orders",
    {["Content-Type"] = "application/json", ["Idempotency-Key"] = key,
     ["Authorization"] = "Bearer bench-client"},
    '{"sku":"A1","qty":2}')
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("IDEM-RESULT %d %d %d %d %d %d\n", summary.requests,
    summary.duration, latency:percentile(50), latency:percentile(99), e.status,
    e.connect + e.read + e.write + e.timeout))
end
"#;

/// What one wrk run measured.
pub struct Load {
    /// Requests per second.
    pub rps: f64,
    /// Median latency.
    pub p50_us: f64,
    /// 99th percentile latency.
    pub p99_us: f64,
    /// CPU time (user + system) the measured server process used per
    /// request over the run.
    pub cpu_us_per_request: f64,
    /// CPU time (user + system) wrk used per request over the run: on a
    /// machine where wrk and the server share the cores, the rate is set
    /// by the two together.
    pub wrk_cpu_us_per_request: f64,
}

/// The server a load run measures: where to send, and the process whose
/// CPU time is counted.
#[derive(Clone, Copy)]
pub struct Target {
    /// Where wrk sends its requests.
    pub addr: SocketAddr,
    /// The process whose CPU time is counted.
    pub pid: u32,
}

fn upstream(runtime: &tokio::runtime::Runtime) -> Result<SocketAddr> {
    let counter = Arc::new(AtomicU64::new(0));
    let app = Router::new().route(
        "/orders",
        post(move || {
            let n = counter.fetch_add(1, Ordering::Relaxed);
            async move {
                (
                    axum::http::StatusCode::CREATED,
                    [("content-type", "application/json")],
                    format!("{{\"order\":\"order-{n}\"}}"),
                )
            }
        }),
    );
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    runtime.spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// A server run as a child process; killed on drop.
pub struct Child(pub std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `idem serve` (the binary `bin`) on `db` in front of `up`, with
/// the configuration file `config` if one is given.
fn serve(
    bin: &std::path::Path,
    db: &std::path::Path,
    up: SocketAddr,
    config: Option<&std::path::Path>,
) -> Result<(Child, Target)> {
    let mut cmd = Command::new(bin);
    cmd.arg("--db")
        .arg(db)
        .args(["serve", "--listen", "127.0.0.1:0"]);
    if let Some(config) = config {
        cmd.arg("--config").arg(config);
    }
    cmd.arg("--upstream").arg(format!("http://{up}"));
    start_server(cmd, "idem listening on http://")
}

/// Starts `cmd`, a server that prints `prefix` and its address on its
/// first line of output; the child is killed when the guard drops.
pub fn start_server(mut cmd: Command, prefix: &str) -> Result<(Child, Target)> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let pid = child.id();
    let guard = Child(child);
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let addr = line
        .trim()
        .strip_prefix(prefix)
        .ok_or_else(|| anyhow!("the server printed '{line}'"))?
        .parse()?;
    Ok((guard, Target { addr, pid }))
}

/// True when wrk can be run.
pub fn have_wrk() -> bool {
    Command::new("wrk").arg("--version").output().is_ok()
}

/// How wrk is run: its script, and whether as a `SCHED_BATCH` process.
///
/// wrk shares this machine's two cores with the server it measures. At
/// the normal policy, each answer that wakes one of wrk's threads lets it
/// preempt the server on the spot: on December 7, with `idem serve`
/// replaying at 32 connections, 80 % of the server's context switches were
/// wrk taking its core right after the `writev` of an answer, 0.6 per
/// request (`perf record -e sched:sched_switch`), and wrk's own CPU per
/// request rose with them. A client on another machine, as a deployed
/// server's clients are, costs the server no such switch. As
/// `SCHED_BATCH` (`chrt --batch 0`, which needs no privilege), wrk gets
/// the same share of the cores, at the scheduler's tick instead of at
/// every wake-up: 0.06 to 0.09 switches per request. `--wrk-normal`
/// measures as before.
pub struct Wrk {
    /// The script ([`SCRIPT`]).
    script: std::path::PathBuf,
    /// True to run wrk as `SCHED_BATCH`.
    batch: bool,
}

impl Wrk {
    /// Writes the wrk script into `dir`; wrk runs as `SCHED_BATCH` when
    /// `settings` ask for it and `chrt` can run it (else at the normal
    /// policy, said on the output).
    pub fn new(dir: &std::path::Path, settings: &Settings) -> Result<Self> {
        let script = dir.join("idem.lua");
        std::fs::File::create(&script)?.write_all(SCRIPT.as_bytes())?;
        let mut batch = settings.wrk_batch;
        if batch
            && !Command::new("chrt")
                .args(BATCH)
                .arg("true")
                .status()
                .is_ok_and(|s| s.success())
        {
            println!("chrt cannot run wrk as SCHED_BATCH here: wrk runs at the normal policy");
            batch = false;
        }
        Ok(Wrk { script, batch })
    }

    /// Runs wrk for `seconds` with `connections` connections against
    /// `target`, counting the CPU time of the target's process and wrk's.
    pub fn run(
        &self,
        target: Target,
        (seconds, connections): (u32, u32),
        mode: &str,
        run: &str,
    ) -> Result<Load> {
        let addr = target.addr;
        let pid = target.pid.to_string();
        let cpu_before = cpu_time_us(&pid)?;
        let wrk_before = waited_children_cpu_time_us()?;
        let out = self
            .command()
            .args([
                "-t",
                &WRK_THREADS.min(connections).to_string(),
                "-c",
                &connections.to_string(),
                "-d",
                &format!("{seconds}s"),
                "-s",
            ])
            .arg(&self.script)
            .arg(format!("http://{addr}/orders"))
            .args(["--", mode, run])
            .output()
            .context("running wrk")?;
        let cpu_used = cpu_time_us(&pid)? - cpu_before;
        let wrk_used = waited_children_cpu_time_us()? - wrk_before;
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix("IDEM-RESULT "))
            .ok_or_else(|| {
                anyhow!(
                    "wrk printed no result: {text} {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })?;
        let v: Vec<f64> = line
            .split_whitespace()
            .map(|x| x.parse::<f64>())
            .collect::<Result<_, _>>()?;
        let [requests, duration_us, p50, p99, bad_status, socket_errors] = v[..] else {
            bail!("wrk result line '{line}' has the wrong shape");
        };
        if bad_status > 0.0 || socket_errors > 0.0 {
            bail!("wrk saw {bad_status} error statuses and {socket_errors} socket errors ({mode})");
        }
        Ok(Load {
            rps: requests / (duration_us / 1e6),
            p50_us: p50,
            p99_us: p99,
            cpu_us_per_request: cpu_used / requests.max(1.0),
            wrk_cpu_us_per_request: wrk_used / requests.max(1.0),
        })
    }

    /// A sentence for the tables' headings.
    pub fn policy(&self) -> &'static str {
        if self.batch {
            "wrk runs as SCHED_BATCH (chrt --batch 0)"
        } else {
            "wrk runs at the normal scheduling policy"
        }
    }

    /// The command that runs wrk.
    fn command(&self) -> Command {
        if self.batch {
            let mut cmd = Command::new("chrt");
            cmd.args(BATCH).arg("wrk");
            cmd
        } else {
            Command::new("wrk")
        }
    }
}

/// `chrt`'s arguments for `SCHED_BATCH` (priority 0, the only one).
const BATCH: [&str; 2] = ["--batch", "0"];

/// One kind of load: its name, the server, the wrk mode (`new` or
/// `fixed` keys) and the connections.
pub type Kind<'a> = (&'a str, Target, &'a str, u32);

/// Runs every kind for the same time, round after round (so that noise
/// falls on all kinds alike), prints the medians over rounds as one table
/// headed by `section` and `cpu_note`, adds them to `report`, and returns
/// them in the order of `kinds`.
pub fn measure(
    settings: &Settings,
    wrk: &Wrk,
    kinds: &[Kind<'_>],
    section: &str,
    cpu_note: &str,
    report: &mut Report,
) -> Result<Vec<Load>> {
    let secs = settings.proxy_seconds;
    let rounds = settings.rounds.min(3);
    let mut results: Vec<Vec<Load>> = kinds.iter().map(|_| Vec::new()).collect();
    for r in 0..rounds {
        for (k, (_, target, mode, connections)) in kinds.iter().enumerate() {
            results[k].push(wrk.run(
                *target,
                (secs, *connections),
                mode,
                &format!("{section}{r}k{k}"),
            )?);
        }
    }
    println!(
        "\n{section}: wrk, {rounds} rounds x {secs} s per kind, medians over rounds; {}; {cpu_note}",
        wrk.policy()
    );
    println!(
        "{:<24} {:>5} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "kind", "conns", "req/s", "p50 us", "p99 us", "CPU us/req", "wrk us/req"
    );
    let mut rows = Vec::new();
    for ((name, _, _, connections), loads) in kinds.iter().zip(&results) {
        let of = |f: fn(&Load) -> f64| median(&loads.iter().map(f).collect::<Vec<_>>());
        let row = Load {
            rps: of(|l| l.rps),
            p50_us: of(|l| l.p50_us),
            p99_us: of(|l| l.p99_us),
            cpu_us_per_request: of(|l| l.cpu_us_per_request),
            wrk_cpu_us_per_request: of(|l| l.wrk_cpu_us_per_request),
        };
        println!(
            "{name:<24} {connections:>5} {:>9.0} {:>9.0} {:>9.0} {:>11.1} {:>11.1}",
            row.rps, row.p50_us, row.p99_us, row.cpu_us_per_request, row.wrk_cpu_us_per_request
        );
        report.add(json!({
            "section": section, "kind": name, "connections": connections,
            "requests_per_s": row.rps, "p50_us": row.p50_us, "p99_us": row.p99_us,
            "cpu_us_per_request": row.cpu_us_per_request,
            "wrk_cpu_us_per_request": row.wrk_cpu_us_per_request,
            "wrk_sched_batch": wrk.batch,
        }));
        rows.push(row);
    }
    Ok(rows)
}

/// Runs the proxy measurements.
pub fn run(settings: &Settings, report: &mut Report) -> Result<()> {
    if !have_wrk() {
        println!("\nproxy: skipped, wrk is not installed (apt-get install wrk)");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let wrk = Wrk::new(dir.path(), settings)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    // The upstream runs in this process: direct runs count its CPU time.
    let up = Target {
        addr: upstream(&runtime)?,
        pid: std::process::id(),
    };
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_idem"));
    // `group_commit` is on by default; the first `idem serve` turns it off.
    let plain_config = dir.path().join("plain.toml");
    std::fs::write(&plain_config, "group_commit = false\n")?;
    let (_serve, proxied) = serve(
        bin,
        &dir.path().join("idem.db"),
        up.addr,
        Some(&plain_config),
    )?;
    let grouped_config = dir.path().join("group.toml");
    std::fs::write(&grouped_config, "group_commit = true\n")?;
    let (_grouped, grouped) = serve(
        bin,
        &dir.path().join("group.db"),
        up.addr,
        Some(&grouped_config),
    )?;
    let compared = match &settings.compare_bin {
        Some(other) => Some((
            serve(
                other,
                &dir.path().join("other.db"),
                up.addr,
                Some(&plain_config),
            )?,
            serve(
                other,
                &dir.path().join("other-group.db"),
                up.addr,
                Some(&grouped_config),
            )?,
        )),
        None => None,
    };
    // The replayed key, completed by one connection before 32 replay it
    // (32 at once on a new key would be told it is in progress); and a
    // warm-up of every kind.
    wrk.run(proxied, (1, 1), "fixed", "warm")?;
    wrk.run(proxied, (1, CONNECTIONS), "new", "warm")?;
    wrk.run(up, (1, CONNECTIONS), "new", "warm")?;
    wrk.run(grouped, (1, CONNECTIONS), "new", "warm")?;
    let mut kinds: Vec<Kind<'_>> = vec![
        ("direct, new keys", up, "new", CONNECTIONS),
        ("proxy, first requests", proxied, "new", CONNECTIONS),
        ("direct, fixed key", up, "fixed", CONNECTIONS),
        ("proxy, replays", proxied, "fixed", CONNECTIONS),
        ("proxy, first, grouped", grouped, "new", CONNECTIONS),
        ("direct, new keys", up, "new", 1),
        ("proxy, first requests", proxied, "new", 1),
        ("proxy, replays", proxied, "fixed", 1),
        ("proxy, first, grouped", grouped, "new", 1),
    ];
    if let Some(((_, other), (_, other_grouped))) = &compared {
        wrk.run(*other, (1, 1), "fixed", "warm")?;
        wrk.run(*other, (1, CONNECTIONS), "new", "warm")?;
        wrk.run(*other_grouped, (1, CONNECTIONS), "new", "warm")?;
        kinds.extend([
            ("compared, first requests", *other, "new", CONNECTIONS),
            (
                "compared, first, grouped",
                *other_grouped,
                "new",
                CONNECTIONS,
            ),
            ("compared, replays", *other, "fixed", CONNECTIONS),
            ("compared, first requests", *other, "new", 1),
            ("compared, replays", *other, "fixed", 1),
        ]);
    }
    let rows = measure(
        settings,
        &wrk,
        &kinds,
        "proxy",
        "CPU is the server process's user + system time per request (idem serve's, or for \
         direct runs the upstream's)",
        report,
    )?;
    let p50s: Vec<f64> = rows.iter().map(|l| l.p50_us).collect();
    let rates: Vec<f64> = rows.iter().map(|l| l.rps).collect();
    println!(
        "first requests add {:+.0} us at p50 ({:+.0} us with group commit); replays {:+.0} us \
         against the same request direct; at {CONNECTIONS} connections first requests run at \
         {:.2}x and replays at {:.2}x the direct rate",
        p50s[1] - p50s[0],
        p50s[4] - p50s[0],
        p50s[3] - p50s[2],
        rates[1] / rates[0],
        rates[3] / rates[2],
    );
    print_replay_budget(&rows[2], &rows[3]);
    Ok(())
}

/// The CPU per replay `idem serve` may cost for replays at
/// [`REPLAY_TARGET`] of the direct rate, and what it cost, from the direct
/// fixed-key run `direct` and the replay run `replays` at the same
/// connections. wrk shares the cores, so the rate is set by the server's
/// CPU and wrk's together: at the cores the busier run kept busy, the
/// target rate leaves a budget per request for the two, and the server's
/// share is that less wrk's (wrk's own CPU per request grows as the server
/// slows: it sleeps and is woken more often, so both of its figures are
/// printed).
fn print_replay_budget(direct: &Load, replays: &Load) {
    let cores = |l: &Load| l.rps * (l.cpu_us_per_request + l.wrk_cpu_us_per_request) / 1e6;
    let busy = cores(direct).max(cores(replays));
    let target = REPLAY_TARGET * direct.rps;
    let budget = busy / target * 1e6;
    println!(
        "replays at {REPLAY_TARGET}x the direct rate ({target:.0} req/s) would leave {budget:.1} us \
         of CPU per request to idem serve and wrk together (at the {busy:.2} cores the busier of \
         the two runs kept busy): idem serve at {:.1} to {:.1} us per replay (wrk as against it, \
         {:.1} us, or as against the upstream, {:.1} us); it cost {:.1} us",
        budget - replays.wrk_cpu_us_per_request,
        budget - direct.wrk_cpu_us_per_request,
        replays.wrk_cpu_us_per_request,
        direct.wrk_cpu_us_per_request,
        replays.cpu_us_per_request,
    );
}
