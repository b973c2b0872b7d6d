//! Prometheus metrics of the proxy, served by the admin server.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The media type of [`Metrics::render`]'s output.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The label of `idem_requests_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabel {
    decision: &'static str,
}

/// The label of `idem_stuck_keys`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StuckLabel {
    status: &'static str,
}

/// The labels `idem_requests_total` counts: the engine's decisions, plus
/// `passthrough` (forwarded without a key) and `error` (the engine could not
/// decide, or the proxy refused the request before asking it).
pub const DECISION_LABELS: [&str; 9] = [
    "execute",
    "replay",
    "in-progress",
    "mismatch",
    "failed",
    "outcome-unknown",
    "invalid",
    "passthrough",
    "error",
];

/// The outcomes of `idem_reconciled`.
const RECONCILED_LABELS: [&str; 4] = ["succeeded", "released", "left", "lookup-error"];

/// The proxy's counters and histogram. Cheap to clone.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    requests: Family<DecisionLabel, Counter>,
    replays: Counter,
    mismatches: Counter,
    store_errors: Counter,
    pending_outcomes: Gauge,
    stuck: Family<StuckLabel, Gauge>,
    stuck_expired: Counter,
    reconciled: Family<ReconciledLabel, Counter>,
    upstream_duration: Histogram,
}

/// The label of `idem_reconciled`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconciledLabel {
    outcome: &'static str,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric at zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<DecisionLabel, Counter>::default();
        let replays = Counter::default();
        let mismatches = Counter::default();
        let store_errors = Counter::default();
        let pending_outcomes = Gauge::default();
        let stuck = Family::<StuckLabel, Gauge>::default();
        let stuck_expired = Counter::default();
        let reconciled = Family::<ReconciledLabel, Counter>::default();
        // 5 ms to about 41 s.
        let upstream_duration = Histogram::new(exponential_buckets(0.005, 2.0, 14));
        registry.register(
            "idem_requests",
            "Requests by the engine's decision (or passthrough / error)",
            requests.clone(),
        );
        registry.register(
            "idem_replays",
            "Answers replayed from the store",
            replays.clone(),
        );
        registry.register(
            "idem_mismatches",
            "Keys reused with a different request",
            mismatches.clone(),
        );
        registry.register(
            "idem_store_errors",
            "Engine calls that failed because the store did not answer",
            store_errors.clone(),
        );
        registry.register(
            "idem_pending_outcomes",
            "Outcomes of answered requests that the store has not taken yet (held and retried)",
            pending_outcomes.clone(),
        );
        registry.register(
            "idem_stuck_keys",
            "Keys waiting for an operator or a lookup: in progress past their lease (status processing) or outcome-unknown; counted at each sweep",
            stuck.clone(),
        );
        for status in ["processing", "outcome-unknown"] {
            let _ = stuck.get_or_create(&StuckLabel { status });
        }
        registry.register(
            "idem_stuck_keys_expired",
            "Stuck keys released because they waited past stuck_retention_ms (each one is logged)",
            stuck_expired.clone(),
        );
        registry.register(
            "idem_reconciled",
            "Stuck keys the sweep's reconcile examined, by outcome: succeeded (the lookup found the result), released (not found: runs again), left (not found under manual), lookup-error",
            reconciled.clone(),
        );
        for outcome in RECONCILED_LABELS {
            let _ = reconciled.get_or_create(&ReconciledLabel { outcome });
        }
        registry.register(
            "idem_upstream_duration_seconds",
            "Time the upstream took to answer",
            upstream_duration.clone(),
        );
        // Every decision shows up from the first scrape, at zero.
        for decision in DECISION_LABELS {
            let _ = requests.get_or_create(&DecisionLabel { decision });
        }
        Metrics {
            registry: Arc::new(registry),
            requests,
            replays,
            mismatches,
            store_errors,
            pending_outcomes,
            stuck,
            stuck_expired,
            reconciled,
            upstream_duration,
        }
    }

    /// Counts stuck keys released past their retention.
    pub fn stuck_keys_expired(&self, n: u64) {
        self.stuck_expired.inc_by(n);
    }

    /// Counts what one reconcile did.
    pub fn reconciled(&self, r: &idem_engine::api::ReconcileReport) {
        for (outcome, n) in RECONCILED_LABELS.into_iter().zip([
            r.succeeded,
            r.released,
            r.left_for_manual,
            r.lookup_errors,
        ]) {
            self.reconciled
                .get_or_create(&ReconciledLabel { outcome })
                .inc_by(u64::from(n));
        }
    }

    /// Counts one request under `decision` (one of [`DECISION_LABELS`]).
    pub fn request(&self, decision: &'static str) {
        self.requests
            .get_or_create(&DecisionLabel { decision })
            .inc();
    }

    /// Counts one answer served from the store.
    pub fn replay(&self) {
        self.replays.inc();
    }

    /// Counts one mismatch.
    pub fn mismatch(&self) {
        self.mismatches.inc();
    }

    /// Counts one store error.
    pub fn store_error(&self) {
        self.store_errors.inc();
    }

    /// Sets how many outcomes are held for the store.
    pub fn pending_outcomes(&self, held: usize) {
        self.pending_outcomes
            .set(i64::try_from(held).unwrap_or(i64::MAX));
    }

    /// Sets how many keys are stuck: in progress past their lease, and
    /// outcome-unknown.
    pub fn stuck_keys(&self, processing: u64, outcome_unknown: u64) {
        for (status, n) in [
            ("processing", processing),
            ("outcome-unknown", outcome_unknown),
        ] {
            self.stuck
                .get_or_create(&StuckLabel { status })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// Records how long the upstream took.
    pub fn upstream_duration(&self, d: Duration) {
        self.upstream_duration.observe(d.as_secs_f64());
    }

    /// The OpenMetrics text exposition (which Prometheus reads).
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_have_the_documented_names() {
        let m = Metrics::new();
        m.request("execute");
        m.request("replay");
        m.replay();
        m.mismatch();
        m.store_error();
        m.upstream_duration(Duration::from_millis(20));
        let text = m.render();
        assert!(
            text.contains(r#"idem_requests_total{decision="execute"} 1"#),
            "{text}"
        );
        assert!(
            text.contains(r#"idem_requests_total{decision="passthrough"} 0"#),
            "{text}"
        );
        assert!(text.contains("idem_replays_total 1"), "{text}");
        assert!(text.contains("idem_mismatches_total 1"), "{text}");
        assert!(text.contains("idem_store_errors_total 1"), "{text}");
        assert!(
            text.contains("idem_upstream_duration_seconds_count 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
