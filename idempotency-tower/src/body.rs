//! The request body the wrapped service receives, and the response body the layer returns.

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The request body the wrapped service receives: the buffered body of a covered request,
    /// or the original body of a request that passed through. A named type, so that its
    /// insides can change without breaking users.
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    enum RequestKind<B> {
        Buffered { #[pin] body: Full<Bytes> },
        Passed { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    /// The bytes the layer read (and fingerprinted) from a covered request.
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        Self {
            kind: RequestKind::Buffered {
                body: Full::new(bytes),
            },
        }
    }

    /// The request's own body, untouched.
    pub(crate) fn passed(body: B) -> Self {
        Self {
            kind: RequestKind::Passed { body },
        }
    }
}

impl<B> fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            RequestKind::Buffered { .. } => "buffered",
            RequestKind::Passed { .. } => "passed",
        };
        f.debug_struct("RequestBody")
            .field("kind", &kind)
            .finish_non_exhaustive()
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            RequestKindProj::Buffered { body } => {
                body.poll_frame(cx).map_err(|never| match never {})
            }
            RequestKindProj::Passed { body } => body.poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Buffered { body } => body.is_end_stream(),
            RequestKind::Passed { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Buffered { body } => body.size_hint(),
            RequestKind::Passed { body } => body.size_hint(),
        }
    }
}

pin_project! {
    /// The response body the layer returns: a stored, replayed or refusal body, the handler's
    /// own body when it was not buffered, or the part of the handler's body read while trying
    /// to store it followed by the rest (a body that turned out larger than the response
    /// limit). A named type, so that its insides can change without breaking users.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Full { #[pin] body: Full<Bytes> },
        Inner { #[pin] body: B },
        Spliced { head: Option<Bytes>, rest: Pin<Box<B>> },
    }
}

impl<B> ResponseBody<B> {
    /// A body of these bytes.
    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                body: Full::new(bytes),
            },
        }
    }

    /// The handler's body, untouched.
    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    /// `head` (already read from the handler's body), then the rest of that body.
    pub(crate) fn spliced(head: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: Kind::Spliced {
                head: (!head.is_empty()).then_some(head),
                rest,
            },
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Full { .. } => "full",
            Kind::Inner { .. } => "inner",
            Kind::Spliced { .. } => "spliced",
        };
        f.debug_struct("ResponseBody")
            .field("kind", &kind)
            .finish_non_exhaustive()
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Full { body } => body.poll_frame(cx).map_err(|never| match never {}),
            KindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
            KindProj::Spliced { head, rest } => match head.take() {
                Some(head) => Poll::Ready(Some(Ok(Frame::data(head)))),
                None => rest.as_mut().poll_frame(cx).map_err(Into::into),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { body } => body.is_end_stream(),
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Spliced { head, rest } => head.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { body } => body.size_hint(),
            Kind::Inner { body } => body.size_hint(),
            Kind::Spliced { head, rest } => {
                let extra = head.as_ref().map_or(0, |h| h.len() as u64);
                let hint = rest.size_hint();
                let mut out = SizeHint::new();
                out.set_lower(hint.lower().saturating_add(extra));
                if let Some(upper) = hint.upper() {
                    out.set_upper(upper.saturating_add(extra));
                }
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn request_bodies_forward_to_what_they_hold() {
        let buffered = RequestBody::<Full<Bytes>>::buffered(Bytes::from_static(b"read"));
        assert_eq!(buffered.size_hint().exact(), Some(4));
        assert!(!buffered.is_end_stream());
        assert_eq!(&buffered.collect().await.unwrap().to_bytes()[..], b"read");
        let passed = RequestBody::passed(Full::new(Bytes::from_static(b"as sent")));
        assert_eq!(passed.size_hint().exact(), Some(7));
        assert_eq!(&passed.collect().await.unwrap().to_bytes()[..], b"as sent");
        assert!(RequestBody::<Full<Bytes>>::buffered(Bytes::new()).is_end_stream());
    }

    #[tokio::test]
    async fn spliced_body_is_the_head_then_the_rest() {
        let body = ResponseBody::spliced(
            Bytes::from_static(b"head;"),
            Box::pin(Full::new(Bytes::from_static(b"rest"))),
        );
        assert_eq!(body.size_hint().exact(), Some(9));
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(&all[..], b"head;rest");
        let empty_head =
            ResponseBody::spliced(Bytes::new(), Box::pin(Full::new(Bytes::from_static(b"r"))));
        assert_eq!(&empty_head.collect().await.unwrap().to_bytes()[..], b"r");
    }
}
