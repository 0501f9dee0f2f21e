//! The future the service returns.

use crate::ResponseBody;
use http::Response;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

type Inner<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// The response future of [`IdempotencyService`](crate::IdempotencyService): the layer's
/// answer, with `B` the wrapped service's response body and `E` its error. A named type, so
/// that its insides can change without breaking users.
pub struct ResponseFuture<B, E> {
    inner: Inner<B, E>,
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new<F>(future: F) -> Self
    where
        F: Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
    {
        Self {
            inner: Box::pin(future),
        }
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
