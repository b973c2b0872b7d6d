//! What every part of the suite shares: the run settings, the paths and
//! their engine operation, the measuring loop, and the report.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use idem::{BeginRequest, Decision, Engine, Policy, RecordKey, Success};
use serde_json::{Value, json};

/// The request body of every path: a small order, as an API would see it.
pub const BODY: &str = r#"{"sku":"A1","qty":2,"note":"bench"}"#;
/// The body of the mismatch path: the same key with another request.
pub const OTHER_BODY: &str = r#"{"sku":"A1","qty":3,"note":"bench"}"#;

/// How much work each part does: the full run, `--quick` or `--smoke`.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Rounds per measurement; engine and baseline alternate round by round.
    pub rounds: usize,
    /// Operations per thread per round.
    pub ops: usize,
    /// The thread counts of the path measurements.
    pub threads: Vec<usize>,
    /// The paths measured (`--path`); all three unless picked.
    pub paths: Vec<Path>,
    /// The table sizes of the scale measurement.
    pub scale_sizes: Vec<u64>,
    /// Expired records the sweep measurement deletes.
    pub sweep_records: u64,
    /// Seconds of load per proxy measurement.
    pub proxy_seconds: u32,
    /// Repetitions of each guest-cost measurement.
    pub guest_reps: usize,
    /// Concurrent callers of the group-commit measurement.
    pub group_callers: usize,
    /// True for the CI smoke run: every part runs, with tiny counts.
    pub smoke: bool,
    /// Another `idem` binary (an earlier build) that the proxy part
    /// measures beside this one, in the same rounds.
    pub compare_bin: Option<std::path::PathBuf>,
    /// How long each thread sleeps before each operation of the `paths`
    /// and `pg` parts (`--idle-us`); zero runs them back to back.
    pub idle_gap: Duration,
    /// True to run wrk as `SCHED_BATCH` in the `proxy` and `layer` parts
    /// (`proxy::Wrk` says why); `--wrk-normal` makes it false.
    pub wrk_batch: bool,
}

impl Settings {
    /// The full run: 5 rounds of 2 000 operations per thread.
    pub fn full() -> Self {
        Self {
            rounds: 5,
            ops: 2_000,
            threads: vec![1, 2, 8],
            paths: Path::ALL.to_vec(),
            scale_sizes: vec![10_000, 1_000_000],
            sweep_records: 1_000_000,
            proxy_seconds: 5,
            guest_reps: 2_000,
            group_callers: 32,
            smoke: false,
            compare_bin: None,
            idle_gap: Duration::ZERO,
            wrk_batch: true,
        }
    }

    /// A shorter run for a quick look (about three minutes on two shared
    /// cores).
    pub fn quick() -> Self {
        Self {
            rounds: 3,
            ops: 300,
            scale_sizes: vec![10_000, 100_000],
            sweep_records: 100_000,
            proxy_seconds: 2,
            guest_reps: 200,
            ..Self::full()
        }
    }

    /// The CI smoke run: every part once, with counts so small that it
    /// checks only that the suite still works (seconds).
    pub fn smoke() -> Self {
        Self {
            rounds: 1,
            ops: 10,
            threads: vec![1, 2],
            paths: Path::ALL.to_vec(),
            scale_sizes: vec![1_000],
            sweep_records: 1_000,
            proxy_seconds: 1,
            guest_reps: 5,
            group_callers: 4,
            smoke: true,
            compare_bin: None,
            idle_gap: Duration::ZERO,
            wrk_batch: true,
        }
    }
}

/// The three paths of a decision.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Path {
    /// `begin` executes on a new key, then `complete`.
    NewKey,
    /// `begin` on a succeeded key: replay.
    Replay,
    /// `begin` on a succeeded key with another body: mismatch.
    Mismatch,
}

impl Path {
    /// All three, in table order.
    pub const ALL: [Path; 3] = [Path::NewKey, Path::Replay, Path::Mismatch];

    /// The path named `name` as `--path` spells it: `new-key`, `replay` or
    /// `mismatch`.
    pub fn parse(name: &str) -> Option<Path> {
        Path::ALL
            .into_iter()
            .find(|p| p.name().replace(' ', "-") == name)
    }

    /// The name in the table and the JSON summary.
    pub fn name(self) -> &'static str {
        match self {
            Path::NewKey => "new key",
            Path::Replay => "replay",
            Path::Mismatch => "mismatch",
        }
    }
}

/// Succeeded keys the replay and mismatch paths read, spread over threads.
pub const STORED_KEYS: usize = 2_000;

/// The key thread `t` uses for operation `i` of `round`: a new key (`who`
/// keeps the keys of different runs apart), or one of the first `stored`
/// stored keys.
pub fn key_for(
    path: Path,
    who: &str,
    round: usize,
    t: usize,
    i: usize,
    stored: usize,
) -> RecordKey {
    match path {
        Path::NewKey => RecordKey::new("bench", "order.create", format!("{who}-{round}-{t}-{i}")),
        Path::Replay | Path::Mismatch => stored_key((t * 7919 + i) % stored.max(1)),
    }
}

/// The `i`-th key the replay and mismatch paths read.
pub fn stored_key(i: usize) -> RecordKey {
    RecordKey::new("bench", "order.create", format!("stored-{i}"))
}

/// One operation of `path` through the engine; fails unless the engine
/// decides as the path expects.
pub fn engine_op(engine: &Engine, path: Path, key: &RecordKey) -> Result<()> {
    let body = if path == Path::Mismatch {
        OTHER_BODY
    } else {
        BODY
    };
    let req = BeginRequest::json(key.clone(), body, Policy::default());
    match (path, engine.begin(&req)?) {
        (Path::NewKey, Decision::Execute(t)) => {
            engine.complete(&t, &req.policy, &Success::with_ref("order-1"))?;
        }
        (Path::Replay, Decision::Replay(_)) | (Path::Mismatch, Decision::Mismatch(_)) => {}
        (p, d) => bail!("{p:?}: unexpected decision {}", d.name()),
    }
    Ok(())
}

/// Latencies of every operation and the throughput of each round.
#[derive(Default)]
pub struct Samples {
    latencies: Vec<Duration>,
    rates: Vec<f64>,
}

impl Samples {
    /// The median throughput over rounds, in operations per second.
    pub fn rate(&self) -> f64 {
        median(&self.rates)
    }

    /// The `p` quantile (0 to 1) of the latencies, in microseconds.
    pub fn percentile_us(&mut self, p: f64) -> f64 {
        self.latencies.sort_unstable();
        percentile(&self.latencies, p).as_secs_f64() * 1e6
    }

    /// Records one latency.
    pub fn push(&mut self, d: Duration) {
        self.latencies.push(d);
    }

    /// Records one round's throughput.
    pub fn push_rate(&mut self, r: f64) {
        self.rates.push(r);
    }
}

/// What the headers of the `paths` and `pg` parts add for `--idle-us`.
pub fn idle_note(settings: &Settings) -> String {
    if settings.idle_gap.is_zero() {
        String::new()
    } else {
        format!(
            "; each operation after a {} us sleep, ops/s over the time in operations",
            settings.idle_gap.as_micros()
        )
    }
}

/// The median of `values` (0 when empty).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The `p` quantile of sorted durations (zero when empty).
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Runs one round on `threads` threads; `op(thread, i)` does operation `i`
/// of the thread, after the thread slept `gap` when it is not zero.
/// Records each latency and the round's throughput: operations over the
/// round's wall time, or with a gap over the threads' time in operations
/// (the sleeps left out).
pub fn round<F>(
    threads: usize,
    ops: usize,
    gap: Duration,
    samples: &mut Samples,
    op: F,
) -> Result<()>
where
    F: Fn(usize, usize) -> Result<()> + Sync,
{
    let started = Instant::now();
    let latencies = std::thread::scope(|s| -> Result<Vec<Duration>> {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let op = &op;
                s.spawn(move || -> Result<Vec<Duration>> {
                    let mut mine = Vec::with_capacity(ops);
                    for i in 0..ops {
                        if !gap.is_zero() {
                            std::thread::sleep(gap);
                        }
                        let at = Instant::now();
                        op(t, i)?;
                        mine.push(at.elapsed());
                    }
                    Ok(mine)
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            all.extend(
                h.join()
                    .map_err(|_| anyhow::anyhow!("a thread panicked"))??,
            );
        }
        Ok(all)
    })?;
    let busy = if gap.is_zero() {
        started.elapsed().as_secs_f64()
    } else {
        latencies.iter().sum::<Duration>().as_secs_f64() / threads as f64
    };
    samples.push_rate((threads * ops) as f64 / busy);
    for l in latencies {
        samples.push(l);
    }
    Ok(())
}

/// One engine-against-baseline line of the table.
pub struct Compared<'a> {
    /// The part of the suite (`sqlite`, `postgres`, ...).
    pub section: &'a str,
    /// The path measured.
    pub path: Path,
    /// Concurrent threads.
    pub threads: usize,
    /// The baseline's samples.
    pub bare: Samples,
    /// The engine's samples.
    pub idem: Samples,
}

/// The printed table and the JSON summary, built as the parts run.
pub struct Report {
    entries: Vec<Value>,
}

impl Report {
    /// An empty report.
    pub fn new() -> Self {
        Self {
            entries: Vec::new(),
        }
    }

    /// Adds one entry to the JSON summary.
    pub fn add(&mut self, entry: Value) {
        self.entries.push(entry);
    }

    /// The header of engine-against-baseline lines.
    pub fn compared_header(title: &str) {
        println!("\n{title}");
        println!(
            "{:<9} {:>7}  {:>10} {:>10} {:>6}  {:>9} {:>9} {:>9} {:>9}",
            "path",
            "threads",
            "bare op/s",
            "idem op/s",
            "ratio",
            "bare p50",
            "bare p99",
            "idem p50",
            "idem p99"
        );
    }

    /// Prints and records one engine-against-baseline line.
    pub fn compared(&mut self, mut c: Compared<'_>) {
        let (bare, idem) = (c.bare.rate(), c.idem.rate());
        let ratio = if bare > 0.0 { idem / bare } else { 0.0 };
        let (bp50, bp99) = (c.bare.percentile_us(0.5), c.bare.percentile_us(0.99));
        let (ip50, ip99) = (c.idem.percentile_us(0.5), c.idem.percentile_us(0.99));
        println!(
            "{:<9} {:>7}  {:>10.0} {:>10.0} {:>6.2}  {:>7.0}us {:>7.0}us {:>7.0}us {:>7.0}us",
            c.path.name(),
            c.threads,
            bare,
            idem,
            ratio,
            bp50,
            bp99,
            ip50,
            ip99
        );
        self.add(json!({
            "section": c.section, "path": c.path.name(), "threads": c.threads,
            "bare_ops_per_s": bare, "idem_ops_per_s": idem, "ratio": ratio,
            "bare_p50_us": bp50, "bare_p99_us": bp99, "idem_p50_us": ip50, "idem_p99_us": ip99,
        }));
    }

    /// Writes the JSON summary.
    pub fn write(&self, path: &std::path::Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_vec_pretty(&self.entries)?)?;
        Ok(())
    }
}

/// A small deterministic generator (xorshift64*), so the suite needs no
/// random-number crate and every run reads the same keys.
pub struct Rng(u64);

impl Rng {
    /// A generator from a non-zero seed.
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// The next number below `n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}
