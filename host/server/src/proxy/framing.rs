//! A passive reader of HTTP/1.1 message framing, for what hyper does not
//! tell the proxy.
//!
//! hyper accepts a request with both `Content-Length` and
//! `Transfer-Encoding` (RFC 9112 lets a server frame it by the latter) and
//! drops `Content-Length` before the handler sees the request. Such a
//! request is a classic request-smuggling vector, so the proxy refuses it
//! with 400; to know, [`Framing`] follows the bytes of a connection as they
//! are read, finds where each request head starts and ends, and records for
//! each head whether it carried both headers. It also tells whether a head
//! has started and not ended, for the header read timeout.
//!
//! It never changes the bytes. When it cannot follow them (a head or a
//! chunk it cannot parse, which hyper refuses too, or an upgrade), it stops
//! and reports nothing more for the connection.

use std::collections::VecDeque;
use std::mem::MaybeUninit;

/// The longest head followed: more than hyper's own read buffer (about
/// 400 KB), so hyper has always refused a longer head first.
const MAX_HEAD_BYTES: usize = 1024 * 1024;

/// The longest chunk-size or trailer line followed; hyper refuses far
/// shorter ones.
const MAX_LINE_BYTES: usize = 64 * 1024;

/// The most headers parsed in one head: hyper refuses more than 100.
const MAX_HEADERS: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Reading a head; `head` holds its bytes so far.
    Head,
    /// A body with this many bytes left.
    Body(u64),
    /// A chunk-size line of a chunked body; `line` holds it so far.
    ChunkSize,
    /// Chunk data with this many bytes left.
    ChunkData(u64),
    /// The CRLF after chunk data: this many bytes of it left.
    ChunkEnd(u8),
    /// Trailer lines after the last chunk; `line` holds the current one.
    Trailers,
    /// Lost: nothing more is reported.
    Off,
}

/// Follows the requests of one connection. Feed it every byte read, in
/// order; take one verdict per request the server parses.
#[derive(Debug)]
pub(crate) struct Framing {
    state: State,
    head: Vec<u8>,
    line: Vec<u8>,
    /// For each head seen and not yet taken: did it carry both
    /// Content-Length and Transfer-Encoding?
    verdicts: VecDeque<bool>,
    heads: u64,
}

impl Default for Framing {
    fn default() -> Self {
        Framing {
            state: State::Head,
            head: Vec::new(),
            line: Vec::new(),
            verdicts: VecDeque::new(),
            heads: 0,
        }
    }
}

/// How a parsed head frames its body.
enum Body {
    None,
    Length(u64),
    Chunked,
}

impl Framing {
    /// True while a request head has started (at least one byte of it has
    /// arrived) and not ended.
    pub(crate) fn head_started(&self) -> bool {
        self.state == State::Head && !self.head.is_empty()
    }

    /// True while the connection waits for a head (none started, none
    /// lost track of).
    #[cfg(test)]
    pub(crate) fn between_requests(&self) -> bool {
        self.state == State::Head && self.head.is_empty()
    }

    /// How many complete heads have been seen.
    pub(crate) fn heads(&self) -> u64 {
        self.heads
    }

    /// The verdict for the next request in order: true when its head had
    /// both Content-Length and Transfer-Encoding. False when unknown.
    pub(crate) fn take_verdict(&mut self) -> bool {
        self.verdicts.pop_front().unwrap_or(false)
    }

    /// Follows `data`, the next bytes read from the connection.
    pub(crate) fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            match self.state {
                State::Off => return,
                State::Head => {
                    if self.head.is_empty() {
                        // Blank lines between requests are ignored, as
                        // RFC 9112 section 2.2 allows.
                        let skip = data
                            .iter()
                            .take_while(|b| matches!(b, b'\r' | b'\n'))
                            .count();
                        data = &data[skip..];
                        if data.is_empty() {
                            return;
                        }
                    }
                    // Only the bytes up to the blank line that ends the
                    // head are kept, so a read holding many pipelined
                    // requests is not copied once per request.
                    let tail = &self.head[self.head.len().saturating_sub(2)..];
                    let Some(end) = blank_line_end(tail, data) else {
                        self.head.extend_from_slice(data);
                        if self.head.len() > MAX_HEAD_BYTES {
                            self.lose();
                        }
                        return;
                    };
                    let parsed = if self.head.is_empty() {
                        // The whole head came in this read (as it nearly
                        // always does): parse it where it is, no copy.
                        self.parse_head(&data[..end]) == Some(end)
                    } else {
                        self.head.extend_from_slice(&data[..end]);
                        let head = std::mem::take(&mut self.head);
                        self.parse_head(&head) == Some(head.len())
                    };
                    data = &data[end..];
                    if !parsed {
                        // Not a head hyper would take: stop following.
                        self.lose();
                        return;
                    }
                }
                State::Body(left) => {
                    let n = data.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    data = &data[n..];
                    let left = left - n as u64;
                    self.state = if left == 0 {
                        State::Head
                    } else {
                        State::Body(left)
                    };
                }
                State::ChunkData(left) => {
                    let n = data.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    data = &data[n..];
                    let left = left - n as u64;
                    self.state = if left == 0 {
                        State::ChunkEnd(2)
                    } else {
                        State::ChunkData(left)
                    };
                }
                State::ChunkEnd(left) => {
                    let expected = if left == 2 { b'\r' } else { b'\n' };
                    if data[0] != expected {
                        self.lose();
                        return;
                    }
                    data = &data[1..];
                    self.state = if left == 2 {
                        State::ChunkEnd(1)
                    } else {
                        State::ChunkSize
                    };
                }
                State::ChunkSize | State::Trailers => {
                    let Some(nl) = data.iter().position(|&b| b == b'\n') else {
                        self.line.extend_from_slice(data);
                        if self.line.len() > MAX_LINE_BYTES {
                            self.lose();
                        }
                        return;
                    };
                    self.line.extend_from_slice(&data[..nl]);
                    data = &data[nl + 1..];
                    let line = std::mem::take(&mut self.line);
                    let line = line.strip_suffix(b"\r").unwrap_or(&line);
                    if self.state == State::Trailers {
                        if line.is_empty() {
                            self.state = State::Head;
                        }
                        continue;
                    }
                    match chunk_size(line) {
                        Some(0) => self.state = State::Trailers,
                        Some(n) => self.state = State::ChunkData(n),
                        None => {
                            self.lose();
                            return;
                        }
                    }
                }
            }
        }
    }

    fn lose(&mut self) {
        self.state = State::Off;
        self.head = Vec::new();
        self.line = Vec::new();
    }

    /// Parses a complete head; records its verdict and moves to its body.
    /// Returns where the head ends, or `None` when it cannot be parsed or
    /// its body cannot be followed (the caller then stops).
    fn parse_head(&mut self, head: &[u8]) -> Option<usize> {
        // On the stack and left uninitialised: this runs for every request
        // of `idem serve`, where a heap array of `MAX_HEADERS` zeroed
        // headers (8 KiB) was an allocation and a fill per request.
        let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut []);
        let end = match request.parse_with_uninit_headers(head, &mut headers) {
            Ok(httparse::Status::Complete(end)) => end,
            Ok(httparse::Status::Partial) | Err(_) => return None,
        };
        // `Some(Some(n))` while every Content-Length seen is the length
        // `n`; `Some(None)` once one is not a length or differs.
        let mut length = None::<Option<u64>>;
        let mut codings = None::<&[u8]>;
        let mut upgrade = request.method == Some("CONNECT");
        for h in request.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                let this = content_length(h.value);
                length = Some(match length {
                    None => this,
                    Some(first) => first.filter(|_| first == this),
                });
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                // The last coding of the last field counts (hyper's rule).
                codings = Some(h.value);
            } else if h.name.eq_ignore_ascii_case("upgrade") {
                upgrade = true;
            }
        }
        self.heads += 1;
        self.verdicts
            .push_back(length.is_some() && codings.is_some());
        let body = match (codings, length) {
            (Some(codings), _) if is_chunked(codings) && request.version == Some(1) => {
                Body::Chunked
            }
            (Some(_), _) => {
                self.lose();
                return None;
            }
            (None, Some(Some(len))) => Body::Length(len),
            (None, Some(None)) => {
                self.lose();
                return None;
            }
            (None, None) => Body::None,
        };
        if upgrade {
            // The connection may switch protocols: stop here.
            self.lose();
            return Some(end);
        }
        self.state = match body {
            Body::None | Body::Length(0) => State::Head,
            Body::Length(n) => State::Body(n),
            Body::Chunked => State::ChunkSize,
        };
        Some(end)
    }
}

/// Where the first empty line ends in `data` (just after its `\n`), when
/// `tail` (the last bytes already read) comes before it. An empty line is
/// `\n\n` or `\n\r\n`, as httparse accepts.
fn blank_line_end(tail: &[u8], data: &[u8]) -> Option<usize> {
    let at = |i: isize| -> Option<u8> {
        if i >= 0 {
            data.get(usize::try_from(i).ok()?).copied()
        } else {
            let back = usize::try_from(-i).ok()?;
            tail.len().checked_sub(back).map(|j| tail[j])
        }
    };
    data.iter().enumerate().find_map(|(i, &b)| {
        let i = isize::try_from(i).ok()?;
        let ends = b == b'\n'
            && (at(i - 1) == Some(b'\n') || (at(i - 1) == Some(b'\r') && at(i - 2) == Some(b'\n')));
        ends.then_some(usize::try_from(i).ok()? + 1)
    })
}

fn is_chunked(codings: &[u8]) -> bool {
    codings
        .rsplit(|&b| b == b',')
        .next()
        .map(|last| last.trim_ascii())
        .is_some_and(|last| last.eq_ignore_ascii_case(b"chunked"))
}

fn content_length(value: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(value).ok()?.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn chunk_size(line: &[u8]) -> Option<u64> {
    let digits = line
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    if digits.is_empty() || digits.len() > 16 {
        return None;
    }
    u64::from_str_radix(std::str::from_utf8(digits).ok()?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdicts(input: &[u8], step: usize) -> (Vec<bool>, Framing) {
        let mut f = Framing::default();
        for part in input.chunks(step.max(1)) {
            f.feed(part);
        }
        let n = f.heads();
        let v = (0..n).map(|_| f.take_verdict()).collect();
        (v, f)
    }

    const PIPELINE: &[u8] = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello\
        \r\nPOST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
        5;ext=1\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n\
        POST /c HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n\
        3\r\nabc\r\n0\r\n\r\n\
        GET /d HTTP/1.1\r\nHost: x\r\n\r\n";

    #[test]
    fn follows_pipelined_requests_in_any_split() {
        for step in [1, 2, 3, 7, 64, PIPELINE.len()] {
            let (v, f) = verdicts(PIPELINE, step);
            assert_eq!(v, vec![false, false, true, false], "step {step}");
            assert!(f.between_requests(), "step {step}");
        }
    }

    #[test]
    fn both_orders_of_the_conflicting_headers_are_seen() {
        let (v, _) = verdicts(
            b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n0\r\n\r\n",
            5,
        );
        assert_eq!(v, vec![true]);
    }

    #[test]
    fn a_started_head_is_reported_until_it_ends() {
        let mut f = Framing::default();
        assert!(f.between_requests() && !f.head_started());
        f.feed(b"\r\n");
        assert!(!f.head_started());
        f.feed(b"POST / HTTP/1.1\r\nHost: x\r\n");
        assert!(f.head_started());
        f.feed(b"Content-Length: 2\r\n\r\na");
        assert!(!f.head_started() && !f.between_requests());
        f.feed(b"b");
        assert!(f.between_requests());
        assert_eq!(
            (f.heads(), f.take_verdict(), f.take_verdict()),
            (1, false, false)
        );
    }

    #[test]
    fn a_head_with_many_headers_is_followed_whole_or_split() {
        let mut head = b"POST / HTTP/1.1\r\n".to_vec();
        for i in 0..MAX_HEADERS - 2 {
            head.extend_from_slice(format!("X-H{i}: v\r\n").as_bytes());
        }
        head.extend_from_slice(b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n");
        head.extend_from_slice(b"2\r\nab\r\n0\r\n\r\nGET / HTTP/1.1\r\n\r\n");
        for step in [5, 64, head.len()] {
            let (v, f) = verdicts(&head, step);
            assert_eq!(v, vec![true, false], "step {step}");
            assert!(f.between_requests(), "step {step}");
        }
        // One header more than it parses: it stops, as hyper refuses far fewer.
        let mut over = b"POST / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_HEADERS {
            over.extend_from_slice(format!("X-H{i}: v\r\n").as_bytes());
        }
        over.extend_from_slice(b"\r\n");
        let (v, f) = verdicts(&over, over.len());
        assert!(v.is_empty() && !f.between_requests());
    }

    #[test]
    fn what_it_cannot_follow_stops_it() {
        for bad in [
            &b"NOT A REQUEST\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab\r\n",
            b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
        ] {
            let mut f = Framing::default();
            f.feed(bad);
            f.feed(b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n");
            assert!(!f.between_requests() && !f.head_started());
            assert!(f.heads() <= 1, "{}", String::from_utf8_lossy(bad));
        }
    }
}
