//! [`Detach`]: a future that runs on its caller's task, and on a task of
//! its own once the caller stops waiting for it.
//!
//! A claimed request must reach its stored outcome even when its client
//! hangs up (hyper then drops the request's future): otherwise the key
//! stays in progress until its lease ends, and a retry may run the request
//! a second time. Spawning every request onto a task of its own gives that,
//! at the price of a task, a wake-up of another worker thread and a join
//! per request, which measured as much CPU as the engine's own decision.
//! `Detach` gives the same guarantee for free on the common path: it polls
//! the request inline, and only if it is dropped before the request
//! finished does it move the rest onto a new task.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

/// The request panicked; the payload's message, when it has one.
#[derive(Debug)]
pub(crate) struct Panicked(pub(crate) String);

impl Panicked {
    fn from_payload(payload: &(dyn Any + Send)) -> Panicked {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        Panicked(message)
    }
}

/// Runs `F` inline; spawns its remainder on the current tokio runtime when
/// dropped before it finished. A panic while it runs inline is caught and
/// returned as [`Panicked`] (the future is then dropped), as a task's
/// `JoinError` would report it.
pub(crate) struct Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    future: Option<Pin<Box<F>>>,
}

impl<F> Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    pub(crate) fn new(future: F) -> Self {
        Detach {
            future: Some(Box::pin(future)),
        }
    }
}

impl<F> Future for Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    type Output = Result<F::Output, Panicked>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(future) = self.future.as_mut() else {
            // Polled again after it finished: a caller's bug, answered as
            // the same panic a finished task's JoinHandle would be.
            return Poll::Ready(Err(Panicked("polled after completion".to_owned())));
        };
        match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => {
                self.future = None;
                Poll::Ready(Ok(output))
            }
            Err(payload) => {
                self.future = None;
                Poll::Ready(Err(Panicked::from_payload(&*payload)))
            }
        }
    }
}

impl<F> Drop for Detach<F>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(future);
            }
            Err(_) => tracing::error!(
                "a request was abandoned outside a tokio runtime and cannot finish; its key stays in progress until its lease ends"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::sync::oneshot;

    #[tokio::test]
    async fn a_finished_future_answers_inline() {
        let answer = Detach::new(async { 7 }).await;
        assert_eq!(answer.ok(), Some(7));
    }

    #[tokio::test]
    async fn a_dropped_future_finishes_on_a_task_of_its_own() {
        let (go, wait) = oneshot::channel::<()>();
        let (done_tx, done_rx) = oneshot::channel::<&'static str>();
        let started = Arc::new(AtomicBool::new(false));
        let flag = started.clone();
        let mut detach = Box::pin(Detach::new(async move {
            flag.store(true, Ordering::SeqCst);
            let _ = wait.await;
            let _ = done_tx.send("finished");
        }));
        // Poll once: it starts, then waits on `go`.
        let first = std::future::poll_fn(|cx| Poll::Ready(detach.as_mut().poll(cx))).await;
        assert!(first.is_pending());
        assert!(started.load(Ordering::SeqCst));
        // The caller goes away; the rest still runs once it can.
        drop(detach);
        go.send(()).expect("the detached future still waits");
        assert_eq!(done_rx.await.ok(), Some("finished"));
    }

    #[tokio::test]
    async fn a_panic_is_an_answer_not_an_unwind() {
        let answer = Detach::new(async {
            if true {
                panic!("inner service bug");
            }
        })
        .await;
        match answer {
            Err(Panicked(message)) => assert_eq!(message, "inner service bug"),
            Ok(()) => panic!("a panic must be reported"),
        }
    }
}
