//! The response future of [`crate::Idempotency`].

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use http::Response;

/// The future of an [`crate::Idempotency`] call: the answer to the request
/// (never an error).
pub struct ResponseFuture {
    inner: Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>,
}

impl ResponseFuture {
    pub(super) fn new(
        f: impl Future<Output = Result<Response<Body>, Infallible>> + Send + 'static,
    ) -> ResponseFuture {
        ResponseFuture { inner: Box::pin(f) }
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<Response<Body>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
