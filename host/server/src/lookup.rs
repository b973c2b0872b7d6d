//! The business lookup of `idem serve`: each route's `lookup` URL, asked
//! over HTTP whether a stuck key's action took effect.
//!
//! The engine asks ([`ResultLookup`]) when a key is stale under
//! `"reconcile"` (on the request, or in the sweep's reconcile), and stores
//! the answer: a 2xx response is the action's result, stored and replayed
//! as the key's answer; 404 means the action did not take effect, so the
//! key runs again; anything else means the business side cannot tell, and
//! the key stays as it is for the next lookup. A stuck key is never run
//! again on a guess.

use std::collections::HashMap;
use std::time::Duration;

use http::{HeaderMap, StatusCode};
use idem_engine::ResultLookup;
use idem_engine::store::StoreError;
use idem_engine::types::{RecordKey, Success};
use idem_layer::config::{LookupTemplate, ProxyConfig};

/// Response headers that describe one connection or one transfer, not the
/// answer: a stored answer is replayed on another connection, with its own
/// length.
const NOT_STORED: [&str; 9] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-authenticate",
    "proxy-connection",
    "content-length",
];

/// The lookups of every biz type that has one, over one HTTP client.
pub struct HttpLookup {
    templates: HashMap<String, LookupTemplate>,
    agent: ureq::Agent,
}

impl std::fmt::Debug for HttpLookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpLookup")
            .field("biz_types", &self.templates.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl HttpLookup {
    /// The lookups `config` names (each biz type's `lookup`, each request
    /// bounded by `lookup_timeout_ms`); none when no biz type has one.
    pub fn from_config(config: &ProxyConfig) -> Option<HttpLookup> {
        let templates: HashMap<_, _> = config
            .biz_types()
            .into_iter()
            .filter_map(|biz| config.lookup_for(&biz).map(|t| (biz, t)))
            .collect();
        if templates.is_empty() {
            return None;
        }
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_millis(config.lookup_timeout_ms)))
            // Every status is an answer to read, not an error.
            .http_status_as_error(false)
            .build()
            .into();
        Some(HttpLookup { templates, agent })
    }

    /// Whether `biz_type` has a lookup.
    pub fn covers(&self, biz_type: &str) -> bool {
        self.templates.contains_key(biz_type)
    }

    /// The biz types that have a lookup.
    pub fn biz_types(&self) -> impl Iterator<Item = &str> {
        self.templates.keys().map(String::as_str)
    }
}

impl ResultLookup for HttpLookup {
    fn find_result(&self, key: &RecordKey) -> Result<Option<Success>, StoreError> {
        let Some(template) = self.templates.get(&key.biz_type) else {
            return Err(StoreError::Internal(format!(
                "biz type '{}' has no lookup, so whether its action took effect cannot be checked",
                key.biz_type
            )));
        };
        let url = template.render(&key.idem_key, &key.scope, &key.biz_type);
        let mut response = self
            .agent
            .get(&url)
            .call()
            .map_err(|e| StoreError::Unavailable(format!("lookup {url}: {e}")))?;
        let status = response.status();
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(StoreError::Unavailable(format!(
                "lookup {url} answered {status}: it cannot tell whether the action took effect"
            )));
        }
        let limit = u64::try_from(idem_http::MAX_STORED_BODY_BYTES).unwrap_or(u64::MAX);
        let body = response
            .body_mut()
            .with_config()
            .limit(limit)
            .read_to_vec()
            .map_err(|e| {
                StoreError::Unavailable(format!("lookup {url}: reading the answer: {e}"))
            })?;
        let mut headers = HeaderMap::new();
        for (name, value) in response.headers() {
            if !NOT_STORED.contains(&name.as_str()) {
                headers.append(name.clone(), value.clone());
            }
        }
        if !idem_layer::response::storable(&headers, body.len()) {
            return Err(StoreError::Internal(format!(
                "lookup {url}: the answer is too large to store ({} headers, {} bytes)",
                headers.len(),
                body.len()
            )));
        }
        Ok(Some(Success {
            result_ref: None,
            response: Some(idem_layer::response::to_stored(status, &headers, &body)),
        }))
    }
}
