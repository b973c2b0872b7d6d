//! The upstream side: the HTTP client, header filtering, and what an
//! upstream answer means for the key.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Uri, Version, request};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use thread_local::ThreadLocal;

use idem_layer::{BufferedResponse, Claim, error_chain};

pub use idem_layer::response::{
    IDEMPOTENT_REPLAYED, MAX_STORED_BODY_BYTES, MAX_STORED_HEADERS, UpstreamError, Verdict,
    classify_status, disposition, from_stored, storable, to_stored,
};

/// The longest time spent connecting to the upstream: a connection that
/// takes longer is "not sent" (retryable), well before the request timeout.
const MAX_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// True for the hop-by-hop headers a proxy must not forward.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection" | "keep-alive" | "te" | "trailer" | "transfer-encoding" | "upgrade"
    ) || name.as_str().starts_with("proxy-")
}

/// Removes the hop-by-hop headers, and those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in listed {
        headers.remove(name);
    }
    let hop: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n))
        .cloned()
        .collect();
    for name in hop {
        headers.remove(name);
    }
}

/// The upstream server and the client that reaches it; cheap to clone.
///
/// As a [`tower::Service`] it is the inner service of `idem serve`'s
/// [`idem_layer::IdempotencyLayer`]: a request without a
/// [`idem_layer::Claim`] is forwarded and its answer streamed back, its
/// head within the timeout; a claimed request's whole answer, body
/// included, must arrive within the timeout, because it is stored.
#[derive(Clone, Debug)]
pub struct Upstream {
    target: Arc<Target>,
}

/// Where the upstream is, and the client.
#[derive(Debug)]
struct Target {
    scheme: Scheme,
    authority: Authority,
    host: HeaderValue,
    base_path: String,
    timeout: Duration,
    /// One client per thread: a pooled connection's task runs on the
    /// runtime that opened it, so a connection shared between `idem
    /// serve`'s per-thread runtimes would wake another thread for every
    /// request it carries.
    clients: ThreadLocal<Client<HttpConnector, Body>>,
}

impl Target {
    /// This thread's client.
    fn client(&self) -> &Client<HttpConnector, Body> {
        self.clients.get_or(|| {
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            connector.set_connect_timeout(Some(self.timeout.min(MAX_CONNECT_TIMEOUT)));
            Client::builder(TokioExecutor::new()).build(connector)
        })
    }
}

impl Upstream {
    /// A client for `uri` (`http://host:port`, optionally with a base
    /// path), giving up on an answer after `timeout`.
    ///
    /// # Errors
    ///
    /// A sentence when the URI is not an absolute `http` URI.
    pub fn new(uri: &Uri, timeout: Duration) -> Result<Upstream, String> {
        let scheme = uri.scheme().cloned().ok_or_else(|| {
            format!("the upstream URI '{uri}' has no scheme; use http://host:port")
        })?;
        if scheme != Scheme::HTTP {
            return Err(format!(
                "the upstream URI '{uri}' is not http: only plain HTTP upstreams are supported"
            ));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("the upstream URI '{uri}' has no host"))?;
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|_| format!("the upstream URI '{uri}' has an invalid host"))?;
        if uri.query().is_some() {
            return Err(format!("the upstream URI '{uri}' must not have a query"));
        }
        let base_path = uri.path().trim_end_matches('/').to_owned();
        Ok(Upstream {
            target: Arc::new(Target {
                scheme,
                authority,
                host,
                base_path,
                timeout,
                clients: ThreadLocal::new(),
            }),
        })
    }

    /// How long the proxy waits for an answer.
    pub fn timeout(&self) -> Duration {
        self.target.timeout
    }
}

impl Target {
    fn request(&self, parts: &request::Parts, body: Body) -> Result<http::Request<Body>, String> {
        let pq = parts
            .uri
            .path_and_query()
            .map(PathAndQuery::as_str)
            .unwrap_or("/");
        let target = format!("{}{pq}", self.base_path);
        let uri = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(target)
            .build()
            .map_err(|e| format!("cannot build the upstream URI: {e}"))?;
        let mut headers = parts.headers.clone();
        strip_hop_by_hop(&mut headers);
        headers.insert(header::HOST, self.host.clone());
        let mut request = http::Request::new(body);
        *request.method_mut() = parts.method.clone();
        *request.uri_mut() = uri;
        *request.version_mut() = Version::HTTP_11;
        *request.headers_mut() = headers;
        Ok(request)
    }

    /// Forwards a request and streams the answer back (for requests that
    /// store nothing). The timeout covers the answer's head only.
    ///
    /// # Errors
    ///
    /// [`UpstreamError`] when no answer came.
    async fn forward(&self, parts: &request::Parts, body: Body) -> Result<Response, UpstreamError> {
        let request = self.request(parts, body).map_err(UpstreamError::NotSent)?;
        let is_head = parts.method == Method::HEAD;
        let answer = tokio::time::timeout(self.timeout, self.client().request(request))
            .await
            .map_err(|_| UpstreamError::Timeout)?
            .map_err(client_error)?;
        let (mut head, incoming) = answer.into_parts();
        strip_hop_by_hop(&mut head.headers);
        let body = if is_head {
            Body::empty()
        } else {
            Body::new(incoming)
        };
        Ok(Response::from_parts(head, body))
    }

    /// Forwards a claimed request and reads its whole answer (up to one
    /// byte over what the store keeps) within the timeout, counted from
    /// the start.
    async fn forward_claimed(
        &self,
        parts: &request::Parts,
        body: Body,
    ) -> Result<Response, UpstreamError> {
        let request = self.request(parts, body).map_err(UpstreamError::NotSent)?;
        let exchange = async {
            let answer = self.client().request(request).await.map_err(client_error)?;
            let (mut head, incoming) = answer.into_parts();
            strip_hop_by_hop(&mut head.headers);
            let read = BufferedResponse::read(Response::from_parts(head, incoming))
                .await
                .map_err(|e| UpstreamError::Failed(error_chain(&*e)))?;
            Ok(read.into_response())
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| UpstreamError::Timeout)?
    }
}

impl tower::Service<http::Request<Body>> for Upstream {
    type Response = Response;
    type Error = UpstreamError;
    type Future = Pin<Box<dyn Future<Output = Result<Response, UpstreamError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let target = self.target.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            if parts.extensions.get::<Claim>().is_some() {
                target.forward_claimed(&parts, body).await
            } else {
                target.forward(&parts, body).await
            }
        })
    }
}

fn client_error(e: hyper_util::client::legacy::Error) -> UpstreamError {
    let text = error_chain(&e);
    if e.is_connect() {
        UpstreamError::NotSent(text)
    } else {
        UpstreamError::Failed(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_stripped() {
        let mut h = HeaderMap::new();
        for (n, v) in [
            ("connection", "keep-alive, x-private"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic x"),
            ("proxy-connection", "close"),
            ("te", "trailers"),
            ("trailer", "x-sum"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("x-private", "1"),
            ("idempotency-key", "k"),
            ("authorization", "Bearer t"),
            ("content-type", "application/json"),
        ] {
            h.append(
                HeaderName::from_static(n),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "content-type", "idempotency-key"]);
    }

    #[test]
    fn upstream_uris_are_checked() {
        let ok = |s: &str| Upstream::new(&s.parse().unwrap(), Duration::from_secs(1));
        assert!(ok("http://127.0.0.1:9000").is_ok());
        assert_eq!(
            ok("http://127.0.0.1:9000/api/").unwrap().target.base_path,
            "/api"
        );
        assert!(ok("https://example.com").is_err());
        assert!(ok("/relative").is_err());
        assert!(ok("http://h/?q=1").is_err());
    }
}
