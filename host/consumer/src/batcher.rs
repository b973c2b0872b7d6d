//! Deliveries handled concurrently, committed together: a [`Batcher`]
//! gathers the messages that are waiting while a batch runs and hands them
//! to one blocking call, typically a store's `run_batch_in_one_transaction`.

use std::sync::Arc;

use idem_engine::api::BeginRequest;
use idem_engine::engine::{Engine, Error, RunOutcome};
use tokio::sync::{mpsc, oneshot};

use crate::{Consumer, ConsumerError, Message, Verdict};

/// How many deliveries may wait for a [`Batcher`] beyond the batch it
/// runs: as many as two batches. More would only queue work that the
/// store cannot take any faster, while the broker's own flow control
/// (prefetch, `max_ack_pending`) holds the rest.
const QUEUED_BATCHES: usize = 2;

/// What a [`Batcher`]'s blocking call is given: the batch's items, the
/// engine and one engine request per item (in order).
/// It answers one slot per request, in order.
pub type BatchRun<I> = dyn Fn(Vec<I>, &Engine, &[BeginRequest]) -> Result<Vec<Result<RunOutcome, Error>>, Error>
    + Send
    + Sync;

struct Job<I> {
    id: String,
    scope: String,
    body: Vec<u8>,
    item: I,
    answer: oneshot::Sender<Result<Verdict, ConsumerError>>,
}

/// Hands the messages of concurrent deliveries to one blocking call per
/// batch, so that a batch costs one commit: a delivery that arrives while
/// a batch runs waits for the next, which takes every delivery waiting by
/// then (up to the batch size). A lone delivery is run at once. One batch
/// runs at a time per batcher.
///
/// Cheap to clone; the batch task ends when the last clone is dropped.
pub struct Batcher<I> {
    jobs: mpsc::Sender<Job<I>>,
    /// The consumer whose requests and verdicts the batches make.
    consumer: Consumer,
}

impl<I> Clone for Batcher<I> {
    fn clone(&self) -> Self {
        Self {
            jobs: self.jobs.clone(),
            consumer: self.consumer.clone(),
        }
    }
}

impl<I> std::fmt::Debug for Batcher<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").finish_non_exhaustive()
    }
}

impl<I: Send + 'static> Batcher<I> {
    /// A batcher of `consumer`'s messages, in batches of at most
    /// `max_batch` (at least 1), each run by `run` on a blocking thread.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime: its batch task runs on the current one.
    pub fn new(
        consumer: &Consumer,
        max_batch: usize,
        run: impl Fn(Vec<I>, &Engine, &[BeginRequest]) -> Result<Vec<Result<RunOutcome, Error>>, Error>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        let max_batch = max_batch.max(1);
        let (jobs, queue) = mpsc::channel(max_batch * QUEUED_BATCHES);
        let run: Arc<BatchRun<I>> = Arc::new(run);
        tokio::spawn(batches(consumer.clone(), max_batch, queue, run));
        Self {
            jobs,
            consumer: consumer.clone(),
        }
    }

    /// The consumer this batcher was built on: it makes each message's
    /// engine request and verdict.
    pub fn consumer(&self) -> &Consumer {
        &self.consumer
    }

    /// How many deliveries wait for a batch (not counting the batch that
    /// runs): how far the store is behind the deliveries, for metrics.
    pub fn waiting(&self) -> usize {
        self.jobs.max_capacity() - self.jobs.capacity()
    }

    /// Runs `message` in the next batch, with `item` (what the batch's
    /// call needs of it, such as the delivery), and says what to do with
    /// the delivery.
    ///
    /// # Errors
    ///
    /// As [`Consumer::handle_batch_blocking`]: when the batch as a whole,
    /// or this message's slot, failed. The delivery must be retried, never
    /// acked.
    pub async fn handle(&self, message: &Message<'_>, item: I) -> Result<Verdict, ConsumerError> {
        let (answer, answered) = oneshot::channel();
        let job = Job {
            id: message.id.to_owned(),
            scope: message.scope.to_owned(),
            body: message.body.to_vec(),
            item,
            answer,
        };
        self.jobs
            .send(job)
            .await
            .map_err(|_| gone("the batch task has stopped"))?;
        answered
            .await
            .map_err(|_| gone("the batch ended without an answer"))?
    }
}

fn gone(what: &str) -> ConsumerError {
    ConsumerError(Error::Trap(format!("{what}; the delivery is retried")))
}

/// The batch task: takes a job, then every job already waiting (up to
/// `max_batch`), runs them as one batch, answers each.
async fn batches<I: Send + 'static>(
    consumer: Consumer,
    max_batch: usize,
    mut queue: mpsc::Receiver<Job<I>>,
    run: Arc<BatchRun<I>>,
) {
    let mut jobs = Vec::with_capacity(max_batch);
    while queue.recv_many(&mut jobs, max_batch).await > 0 {
        let mut answers = Vec::with_capacity(jobs.len());
        let mut items = Vec::with_capacity(jobs.len());
        let mut owned = Vec::with_capacity(jobs.len());
        for job in jobs.drain(..) {
            answers.push(job.answer);
            items.push(job.item);
            owned.push((job.id, job.scope, job.body));
        }
        let keyed: Vec<Message<'_>> = owned
            .iter()
            .map(|(id, scope, body)| Message { id, scope, body })
            .collect();
        let run = run.clone();
        let verdicts = consumer
            .handle_batch_blocking(&keyed, move |engine, requests| run(items, engine, requests))
            .await;
        // A delivery whose task is gone is redelivered anyway, so a failed
        // send needs nothing more.
        match verdicts {
            Ok(verdicts) => {
                for (answer, verdict) in answers.into_iter().zip(verdicts) {
                    let _ = answer.send(verdict);
                }
            }
            Err(e) => {
                for answer in answers {
                    let _ = answer.send(Err(e.clone()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use idem_engine::engine::ActionResult;
    use idem_engine::store::StoreError;
    use idem_engine::testing::Gate;
    use idem_engine::types::Success;
    use idem_sqlite::{RunInTransaction, SqliteOptions, SqliteStore};

    use super::*;
    use crate::{Acked, ConsumerConfig};

    fn sqlite_consumer(dir: &tempfile::TempDir) -> Consumer {
        let path = dir.path().join("idem.db");
        let store = SqliteStore::open(&path, SqliteOptions::default()).expect("store");
        let tx = store.begin_transaction().expect("tx");
        tx.with_connection(|c| c.execute_batch("CREATE TABLE orders (id TEXT NOT NULL)"))
            .expect("connection")
            .expect("table");
        tx.commit().expect("commit");
        let engine = Engine::builder().storage(store).build().expect("engine");
        Consumer::new(engine, ConsumerConfig::new("inventory.reserve"))
    }

    /// Polls `done` between yields, for at most 10 s.
    async fn until(mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "the condition never held");
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deliveries_that_wait_while_a_batch_runs_make_up_the_next_one() {
        const DELIVERIES: usize = 8;
        let dir = tempfile::tempdir().expect("dir");
        let consumer = sqlite_consumer(&dir);
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(Gate::default());
        let (s, g) = (sizes.clone(), gate.clone());
        let batcher = Batcher::new(
            &consumer,
            DELIVERIES,
            move |ids: Vec<String>, engine: &Engine, requests: &[BeginRequest]| {
                let first = {
                    let mut sizes = s.lock().expect("sizes");
                    sizes.push(ids.len());
                    sizes.len() == 1
                };
                if first {
                    g.wait();
                }
                engine.run_batch_in_one_transaction(requests, |i, _, conn| {
                    match conn.execute("INSERT INTO orders VALUES (?1)", [&ids[i]]) {
                        Ok(_) => ActionResult::Succeeded(Success::with_ref(ids[i].as_str())),
                        Err(e) => ActionResult::retryable("db", e),
                    }
                })
            },
        );
        let deliver = |n: usize| {
            let batcher = batcher.clone();
            tokio::spawn(async move {
                let id = format!("m-{}", n % 4);
                let message = Message {
                    id: &id,
                    scope: "orders-queue",
                    body: b"{}",
                };
                batcher.handle(&message, id.clone()).await
            })
        };
        // One delivery first, held in its batch; then the rest (four
        // messages in all, each delivered twice), all at once, while it
        // runs.
        let mut tasks = vec![deliver(0)];
        until(|| !sizes.lock().expect("sizes").is_empty()).await;
        tasks.extend((1..DELIVERIES).map(deliver));
        let first = sizes.lock().expect("sizes")[0];
        assert_eq!(first, 1);
        until(|| batcher.waiting() == DELIVERIES - first).await;
        gate.open();
        let mut executed = 0;
        let mut duplicates = 0;
        for task in tasks {
            match task.await.expect("task") {
                Ok(Verdict::Ack(Acked::Executed)) => executed += 1,
                Ok(Verdict::Ack(Acked::Duplicate)) => duplicates += 1,
                other => panic!("unexpected verdict {other:?}"),
            }
        }
        assert_eq!((executed, duplicates), (4, 4));
        // Everything that waited went in one batch, one commit.
        assert_eq!(
            *sizes.lock().expect("sizes"),
            vec![first, DELIVERIES - first]
        );
        let rows: i64 = rusqlite::Connection::open(dir.path().join("idem.db"))
            .and_then(|c| c.query_row("SELECT count(*) FROM orders", [], |r| r.get(0)))
            .expect("rows");
        assert_eq!(rows, 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_that_fails_as_a_whole_fails_every_delivery_and_a_wrong_answer_too() {
        let dir = tempfile::tempdir().expect("dir");
        let consumer = sqlite_consumer(&dir);
        let failing = Batcher::new(
            &consumer,
            4,
            |_: Vec<()>, _: &Engine, _: &[BeginRequest]| {
                Err(Error::Store(StoreError::Unavailable(
                    "the disk is gone".into(),
                )))
            },
        );
        let short = Batcher::new(
            &consumer,
            4,
            |_: Vec<()>, _: &Engine, _: &[BeginRequest]| Ok(Vec::new()),
        );
        for batcher in [failing, short] {
            let message = Message {
                id: "m-1",
                scope: "orders-queue",
                body: b"{}",
            };
            let verdict = batcher.handle(&message, ()).await;
            assert!(
                matches!(
                    verdict,
                    Err(ConsumerError(
                        Error::Store(StoreError::Unavailable(_)) | Error::Corrupt(_)
                    ))
                ),
                "{verdict:?}"
            );
        }
        // Nothing was claimed: the redelivery runs.
        let status = consumer
            .engine()
            .inspect(
                &consumer
                    .request(&Message {
                        id: "m-1",
                        scope: "orders-queue",
                        body: b"{}",
                    })
                    .key,
            )
            .expect("inspect");
        assert_eq!(status, None);
    }
}
