//! Outcomes the store did not take: held until it does, so that an answer
//! already given is never produced a second time.
//!
//! When the upstream answered but `complete` (or `fail`) could not be
//! stored, the key stays `processing` in the store. Once its lease ends,
//! a retry would take it over and run the request again, although the
//! first run succeeded and its answer is known here. So such an outcome
//! is *pending*:
//!
//! - it is retried in the background with backoff until the store takes it
//!   (the owner's `complete` succeeds after its lease too, as long as
//!   nobody took the key over: the fencing token decides);
//! - a request for a key with a pending outcome first stores that outcome;
//!   if it cannot, it is answered 503 and nothing runs (this only ever
//!   withholds an execution, it never grants one: the store still decides);
//! - with [`ProxyConfig::outcome_journal`](crate::config::ProxyConfig), it
//!   is also written to a local file (fsync'd) before the caller is
//!   answered, and read back when the layer starts, so a restart keeps it.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use idem_engine::api::{Disposition, Policy, Ticket};
use idem_engine::types::{Failure, RecordKey, Success};

/// The first pause before an outcome the store refused is offered again:
/// short, since most outages (a lock held a moment, a failover) are.
pub(crate) const FIRST_RETRY: Duration = Duration::from_millis(50);

/// The longest pause between two offers: an outcome still pending after a
/// long outage reaches the store within a second of its return.
pub(crate) const MAX_RETRY: Duration = Duration::from_secs(1);

/// An outcome to store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Outcome {
    /// `complete` with this success.
    Complete(Success),
    /// `fail` with this failure and disposition.
    Fail(Failure, Disposition),
}

/// An outcome waiting for the store, with what storing it needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Held {
    pub ticket: Ticket,
    pub policy: Policy,
    pub outcome: Outcome,
}

/// Why the journal could not be used; the file is named.
#[derive(Debug, thiserror::Error)]
#[error("outcome journal {path}: {message}")]
pub struct JournalError {
    path: PathBuf,
    message: String,
}

impl JournalError {
    fn new(path: &Path, message: impl std::fmt::Display) -> Self {
        Self {
            path: path.to_owned(),
            message: message.to_string(),
        }
    }
}

/// The pending outcomes of one layer, by key.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    held: Mutex<HashMap<RecordKey, Held>>,
    journal: Option<PathBuf>,
}

impl Pending {
    /// Pending outcomes kept in memory only.
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// Pending outcomes also kept in the file at `path`, with those a
    /// previous run left there. A line that cannot be read is an error:
    /// an outcome is never dropped silently.
    ///
    /// Several processes may share one journal (proxies on one database
    /// file): each change is made under an exclusive lock of
    /// `<path>.lock`, and a process removes only the lines it stored. One
    /// that starts takes over every outcome in the file, another live
    /// process's included; storing an outcome twice is harmless (the
    /// second `complete` finds it recorded).
    pub fn with_journal(path: PathBuf) -> Result<Self, JournalError> {
        let entries = locked(&path, || read(&path))?;
        let mut held = HashMap::new();
        for entry in entries {
            // A later line for the same key is the newer outcome.
            held.insert(entry.ticket.key.clone(), entry);
        }
        Ok(Self {
            held: Mutex::new(held),
            journal: Some(path),
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<RecordKey, Held>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds `entry` until [`Pending::settled`]; with a journal, the entry
    /// is on disk when this returns.
    pub fn hold(&self, entry: Held) -> Result<(), JournalError> {
        let mut held = self.lock();
        if let Some(path) = &self.journal {
            locked(path, || append(path, &entry))?;
        }
        held.insert(entry.ticket.key.clone(), entry);
        Ok(())
    }

    /// The outcome held for `key`, if any.
    pub fn get(&self, key: &RecordKey) -> Option<Held> {
        self.lock().get(key).cloned()
    }

    /// Every outcome held.
    pub fn all(&self) -> Vec<Held> {
        self.lock().values().cloned().collect()
    }

    /// How many outcomes are held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Forgets the outcome of `entry`'s key once the store took it (or the
    /// key was taken over: the store holds another owner's outcome then),
    /// unless a newer one was held meanwhile.
    pub fn settled(&self, entry: &Held) -> Result<(), JournalError> {
        let mut held = self.lock();
        if held.get(&entry.ticket.key) != Some(entry) {
            return Ok(());
        }
        held.remove(&entry.ticket.key);
        match &self.journal {
            Some(path) => locked(path, || {
                // This outcome, and any older one of the same ownership
                // that it replaced, are done; another process's lines stay.
                let mut lines = read(path)?;
                lines.retain(|line| !superseded(line, entry));
                rewrite(path, lines.iter())
            }),
            None => Ok(()),
        }
    }
}

/// True when `line` is `stored` or an outcome it replaced: same record,
/// same or an older fencing token.
fn superseded(line: &Held, stored: &Held) -> bool {
    let (l, s) = (&line.ticket, &stored.ticket);
    l.key == s.key && l.record_id == s.record_id && l.fencing_token <= s.fencing_token
}

/// Runs `f` holding the exclusive lock of the journal at `path` (an
/// advisory lock of `<path>.lock`, released when `f` returns).
fn locked<T>(path: &Path, f: impl FnOnce() -> Result<T, JournalError>) -> Result<T, JournalError> {
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| JournalError::new(&lock_path, e))?;
    lock.lock().map_err(|e| JournalError::new(&lock_path, e))?;
    f()
}

/// Every entry in the journal at `path`, in order; none when it does not
/// exist.
fn read(path: &Path) -> Result<Vec<Held>, JournalError> {
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(JournalError::new(path, e)),
    };
    let mut entries = Vec::new();
    for (n, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| JournalError::new(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        entries.push(
            serde_json::from_str(&line).map_err(|e| {
                JournalError::new(path, format!("line {} cannot be read: {e}", n + 1))
            })?,
        );
    }
    Ok(entries)
}

/// Appends one entry as a JSON line and syncs it to disk.
fn append(path: &Path, entry: &Held) -> Result<(), JournalError> {
    let mut line = serde_json::to_vec(entry).map_err(|e| JournalError::new(path, e))?;
    line.push(b'\n');
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| JournalError::new(path, e))?;
    file.write_all(&line)
        .and_then(|()| file.sync_data())
        .map_err(|e| JournalError::new(path, e))
}

/// Replaces the journal with `entries`: written to a file beside it,
/// synced, then renamed over it, so a crash leaves the old or the new one.
fn rewrite<'a>(path: &Path, entries: impl Iterator<Item = &'a Held>) -> Result<(), JournalError> {
    let mut next = path.as_os_str().to_owned();
    next.push(".next");
    let next = PathBuf::from(next);
    let mut text = Vec::new();
    for entry in entries {
        serde_json::to_writer(&mut text, entry).map_err(|e| JournalError::new(path, e))?;
        text.push(b'\n');
    }
    let mut file = File::create(&next).map_err(|e| JournalError::new(&next, e))?;
    file.write_all(&text)
        .and_then(|()| file.sync_data())
        .map_err(|e| JournalError::new(&next, e))?;
    std::fs::rename(&next, path).map_err(|e| JournalError::new(path, e))
}

/// The pause after `pause`: doubled, at most [`MAX_RETRY`].
pub(crate) fn backoff(pause: Duration) -> Duration {
    (pause * 2).min(MAX_RETRY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_engine::api::Policy;

    fn held(k: &str, code: &str) -> Held {
        Held {
            ticket: Ticket {
                key: RecordKey::new("s", "b", k),
                record_id: 1,
                fencing_token: 1,
                lease_until: 5,
                attempt: 1,
            },
            policy: Policy::default(),
            outcome: Outcome::Fail(
                Failure {
                    code: code.into(),
                    message: String::new(),
                    response: None,
                },
                Disposition::Final,
            ),
        }
    }

    #[test]
    fn the_journal_keeps_what_is_held_across_a_restart() -> Result<(), JournalError> {
        let dir = std::env::temp_dir().join(format!("idem-journal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| JournalError::new(&dir, e))?;
        let path = dir.join("outcomes");
        let _ = std::fs::remove_file(&path);
        let pending = Pending::with_journal(path.clone())?;
        pending.hold(held("a", "x"))?;
        pending.hold(held("b", "y"))?;
        pending.hold(held("a", "z"))?;
        pending.settled(&held("b", "y"))?;
        // A stale settle (an older outcome of `a`) forgets nothing.
        pending.settled(&held("a", "x"))?;
        let again = Pending::with_journal(path.clone())?;
        assert_eq!(again.all(), vec![held("a", "z")]);
        again.settled(&held("a", "z"))?;
        assert_eq!(Pending::with_journal(path.clone())?.len(), 0);
        std::fs::write(&path, "not json\n").map_err(|e| JournalError::new(&path, e))?;
        let err = Pending::with_journal(path.clone()).expect_err("an unreadable line");
        assert!(err.to_string().contains("line 1"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn processes_sharing_a_journal_remove_only_what_they_stored() -> Result<(), JournalError> {
        let dir = std::env::temp_dir().join(format!("idem-journal-2-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| JournalError::new(&dir, e))?;
        let path = dir.join("outcomes");
        let _ = std::fs::remove_file(&path);
        let a = Pending::with_journal(path.clone())?;
        let b = Pending::with_journal(path.clone())?;
        a.hold(held("a", "x"))?;
        b.hold(held("b", "y"))?;
        // `b` settles its own outcome: `a`'s stays on disk.
        b.settled(&held("b", "y"))?;
        assert_eq!(
            Pending::with_journal(path.clone())?.all(),
            vec![held("a", "x")]
        );
        a.settled(&held("a", "x"))?;
        assert_eq!(Pending::with_journal(path.clone())?.len(), 0);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        assert_eq!(backoff(FIRST_RETRY), FIRST_RETRY * 2);
        assert_eq!(backoff(MAX_RETRY), MAX_RETRY);
    }
}
