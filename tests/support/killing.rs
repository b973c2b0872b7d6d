//! What the consumer kill tests (`tests/rabbitmq_kill.rs`,
//! `tests/nats_kill.rs`) share: worker processes to kill, and a seeded
//! generator for the kill instants.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, ensure};

/// Kills per test run.
pub const KILLS: usize = 20;
/// Consumer processes at a time.
pub const CONSUMERS: usize = 2;
/// The consumers' lease, in ms: short, so that a message whose consumer
/// died is taken over soon.
pub const LEASE_MS: &str = "500";

/// Sleeps 10 to 99 ms, then kills one of `workers` (in turn) and starts a
/// new one with `args`, [`KILLS`] times.
pub fn kill_repeatedly(workers: &mut [Worker], args: &[&str], rng: &mut Rng) -> Result<()> {
    for kill in 0..KILLS {
        std::thread::sleep(std::time::Duration::from_millis(10 + rng.below(90)));
        let w = kill % workers.len();
        workers[w].kill()?;
        workers[w] = Worker::start(args)?;
    }
    Ok(())
}

/// A consumer process, killed when dropped.
pub struct Worker {
    child: Child,
}

impl Worker {
    /// Starts `idem-test-worker ARGS` and waits for its "ready".
    pub fn start(args: &[&str]) -> Result<Self> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem-test-worker"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdout = child.stdout.take().context("stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        ensure!(line.trim() == "ready", "the worker said {line:?}");
        Ok(Self { child })
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A small deterministic generator (xorshift), seeded from the clock and
/// printed, so a failing run can be repeated.
pub struct Rng(pub u64);

impl Rng {
    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}
