//! Bodies: reading a request body within its limit, and reading an inner
//! service's answer into memory so that it can be stored.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use http::{HeaderMap, StatusCode};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;

use super::BoxError;
use crate::response::{MAX_STORED_BODY_BYTES, storable, to_stored};
use idem_engine::types::StoredResponse;

/// The most bytes read and discarded past the body limit before a 413.
pub(super) const DRAIN_MAX_BYTES: u64 = 8 * 1024 * 1024;

/// The longest time spent discarding an oversized body.
const DRAIN_MAX_TIME: Duration = Duration::from_secs(5);

/// Reads and discards the rest of a body, within [`DRAIN_MAX_BYTES`] and
/// [`DRAIN_MAX_TIME`], so that a client still sending it gets the answer
/// and its connection can carry its next request. Past either bound the
/// body is dropped, and hyper closes the connection after the answer.
pub(super) async fn drain(mut body: Body) {
    let discard = async {
        let mut seen = 0u64;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref() {
                seen = seen.saturating_add(u64::try_from(data.len()).unwrap_or(u64::MAX));
                if seen > DRAIN_MAX_BYTES {
                    return;
                }
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_MAX_TIME, discard).await;
}

/// An answer of the inner service read into memory, up to
/// [`MAX_STORED_BODY_BYTES`].
#[derive(Debug)]
pub struct BufferedResponse {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body, or its first part when `rest` is set.
    pub body: Bytes,
    /// The unread rest of a body larger than the store keeps.
    pub rest: Option<Body>,
}

impl BufferedResponse {
    /// Reads `response`'s body, up to one byte over what the store keeps.
    ///
    /// # Errors
    ///
    /// The body's error: the answer is lost.
    pub async fn read<B>(response: http::Response<B>) -> Result<BufferedResponse, BoxError>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let (head, body) = response.into_parts();
        let mut body = Body::new(body);
        // Most answers arrive as one frame: keep it without copying.
        let mut first: Option<Bytes> = None;
        let mut buf: Vec<u8> = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(BoxError::from)?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            match first.take() {
                None if buf.is_empty() => first = Some(data),
                None => buf.extend_from_slice(&data),
                Some(earlier) => {
                    buf.extend_from_slice(&earlier);
                    buf.extend_from_slice(&data);
                }
            }
            let len = first.as_ref().map_or(buf.len(), Bytes::len);
            if len > MAX_STORED_BODY_BYTES {
                let read = first.take().unwrap_or_else(|| Bytes::from(buf));
                return Ok(BufferedResponse {
                    status: head.status,
                    headers: head.headers,
                    body: read,
                    rest: Some(body),
                });
            }
        }
        Ok(BufferedResponse {
            status: head.status,
            headers: head.headers,
            body: first.unwrap_or_else(|| Bytes::from(buf)),
            rest: None,
        })
    }

    /// True when the whole response fits in the store.
    pub fn storable(&self) -> bool {
        self.rest.is_none() && storable(&self.headers, self.body.len())
    }

    /// The stored form; only meaningful when [`Self::storable`].
    pub fn to_stored(&self) -> StoredResponse {
        to_stored(self.status, &self.headers, &self.body)
    }

    /// The response to send to this caller.
    pub fn into_response(self) -> http::Response<Body> {
        let body = match self.rest {
            None => Body::from(self.body),
            Some(rest) => Body::new(PrefixedBody {
                prefix: Some(self.body),
                rest,
            }),
        };
        let mut response = http::Response::new(body);
        *response.status_mut() = self.status;
        *response.headers_mut() = self.headers;
        response
    }
}

/// A body whose first bytes were already read.
struct PrefixedBody {
    prefix: Option<Bytes>,
    rest: Body,
}

impl http_body::Body for PrefixedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.rest.size_hint();
        if let Some(p) = &self.prefix {
            let len = u64::try_from(p.len()).unwrap_or(u64::MAX);
            hint.set_lower(hint.lower().saturating_add(len));
            if let Some(upper) = hint.upper() {
                hint.set_upper(upper.saturating_add(len));
            }
        }
        hint
    }
}

/// `text` cut to at most `max` bytes at a character boundary.
pub(super) fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcdef", 3), "abc");
        assert_eq!(truncate("aé", 2), "a");
    }

    /// A body sent in the given frames.
    struct Frames(std::collections::VecDeque<&'static [u8]>);

    impl http_body::Body for Frames {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            Poll::Ready(
                self.0
                    .pop_front()
                    .map(|p| Ok(Frame::data(Bytes::from_static(p)))),
            )
        }
    }

    fn chunked(parts: &'static [&'static [u8]]) -> http::Response<Body> {
        http::Response::new(Body::new(Frames(parts.iter().copied().collect())))
    }

    #[tokio::test]
    async fn answers_are_read_whole_in_one_or_many_frames() {
        let one = BufferedResponse::read(http::Response::new(Body::from("abc")))
            .await
            .unwrap();
        assert_eq!(&one.body[..], b"abc");
        assert!(one.storable());
        let many = BufferedResponse::read(chunked(&[b"ab", b"", b"cd", b"e"]))
            .await
            .unwrap();
        assert_eq!(&many.body[..], b"abcde");
        let stored = many.to_stored();
        assert_eq!(stored.body, b"abcde");
        let replay = many.into_response().into_body().collect().await.unwrap();
        assert_eq!(&replay.to_bytes()[..], b"abcde");
    }
}
