//! Runs the handler in the request's own task, and hands it to a task of its own only if the
//! request's future is dropped before it ends.

use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};

/// What a panic carried.
pub(crate) type Panic = Box<dyn Any + Send + 'static>;

/// A future that is polled where it is awaited (no task spawned, no scheduler round trip),
/// and that is not cancelled by a drop: dropped before its end, it moves to a task of its own
/// on the Tokio runtime it was created on (wherever the drop happens) and runs to its end
/// there. Created outside a runtime, or dropped while that runtime shuts down, it is dropped,
/// as a spawned task would be (its lease then holds the key until it passes).
///
/// A panic while it is polled in place ends it and is returned as `Err`; it is not run any
/// further.
pub(crate) struct Detachable<F: Future + Send + 'static> {
    inner: Option<Pin<Box<F>>>,
    /// The runtime the rest moves to if it is dropped before its end.
    runtime: Option<tokio::runtime::Handle>,
}

impl<F: Future + Send + 'static> Detachable<F> {
    pub(crate) fn new(future: F) -> Self {
        Self {
            inner: Some(Box::pin(future)),
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }
}

impl<F: Future + Send + 'static> Future for Detachable<F> {
    type Output = Result<F::Output, Panic>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(inner) = self.inner.as_mut() else {
            panic!("Detachable polled after its end");
        };
        let polled = catch_unwind(AssertUnwindSafe(|| inner.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => {
                self.inner = None;
                Poll::Ready(Ok(out))
            }
            Err(panic) => {
                // A future that panicked is not polled again; it is dropped here.
                self.inner = None;
                Poll::Ready(Err(panic))
            }
        }
    }
}

impl<F: Future + Send + 'static> Drop for Detachable<F> {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        match &self.runtime {
            // The output was the dropped caller's; the work's own effects (the stored
            // outcome) are what matters.
            Some(runtime) => drop(runtime.spawn(async move {
                let _ = inner.await;
            })),
            None => tracing::warn!(
                "the request was dropped while its handler ran, outside a Tokio runtime: the \
                 handler is dropped with it, and its key is held until its lease passes"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    /// Whether `finished` is set within 30 s (the work runs on another task meanwhile).
    async fn finishes(finished: &AtomicBool) -> bool {
        tokio::time::timeout(Duration::from_secs(30), async {
            while !finished.load(Ordering::SeqCst) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .is_ok()
    }

    #[tokio::test]
    async fn runs_in_place_to_its_end() {
        let out = Detachable::new(async { 7 }).await;
        assert_eq!(out.ok(), Some(7));
    }

    #[tokio::test]
    async fn dropped_mid_way_it_finishes_on_a_task_of_its_own() {
        let finished = Arc::new(AtomicBool::new(false));
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let work = {
            let finished = finished.clone();
            async move {
                started_tx.send(()).expect("listening");
                go_rx.await.expect("sent");
                finished.store(true, Ordering::SeqCst);
            }
        };
        let waiting = tokio::spawn(Detachable::new(work));
        started_rx.await.expect("the work started");
        // The caller goes away while the work waits.
        waiting.abort();
        assert!(waiting.await.is_err_and(|e| e.is_cancelled()));
        assert!(!finished.load(Ordering::SeqCst));
        go_tx.send(()).expect("the work survived its caller");
        assert!(
            finishes(&finished).await,
            "the work finished on its own task"
        );
    }

    #[tokio::test]
    async fn dropped_off_its_runtime_it_finishes_on_the_runtime_it_was_made_on() {
        let finished = Arc::new(AtomicBool::new(false));
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let work = {
            let finished = finished.clone();
            async move {
                go_rx.await.expect("sent");
                finished.store(true, Ordering::SeqCst);
            }
        };
        let mut waiting = Box::pin(Detachable::new(work));
        assert!(
            futures::poll!(waiting.as_mut()).is_pending(),
            "the work waits"
        );
        // Dropped on a thread outside any runtime.
        std::thread::spawn(move || drop(waiting))
            .join()
            .expect("dropped");
        go_tx.send(()).expect("the work survived the drop");
        assert!(
            finishes(&finished).await,
            "the work finished on its runtime"
        );
    }

    #[tokio::test]
    async fn a_panic_is_returned_and_the_work_not_run_again() {
        let out = Detachable::new(async {
            if true {
                panic!("boom");
            }
        })
        .await;
        let panic = out.expect_err("the panic");
        assert_eq!(panic.downcast_ref::<&str>(), Some(&"boom"));
    }
}
