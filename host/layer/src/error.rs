//! What an inner service's error means for the key.

use super::BoxError;
use crate::response::UpstreamError;
use idem_engine::api::Disposition;

/// How the inner service failed to answer a request.
///
/// The layer reads an error the inner service returns (or its response
/// body's error) as one of these, and stores the key's outcome from it:
/// only a request that certainly never reached the action is released for
/// a retry; every other failure leaves the outcome unknown, because the
/// action may have run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InnerFailure {
    /// The request never reached the action: the inner service did not
    /// become ready, or it returned [`UpstreamError::NotSent`]. The key is
    /// released (`retryable`).
    NotSent(String),
    /// No complete answer in time: [`UpstreamError::Timeout`], or tower's
    /// `timeout` middleware's `Elapsed`. The outcome is unknown.
    Timeout,
    /// The inner service failed after the request was handed to it (any
    /// other error, or an error in its response body). The outcome is
    /// unknown.
    Failed(String),
}

impl InnerFailure {
    /// The failure an error from the inner service's call stands for.
    pub fn from_call_error(e: BoxError) -> InnerFailure {
        let e = match e.downcast::<UpstreamError>() {
            Ok(upstream) => {
                return match *upstream {
                    UpstreamError::NotSent(why) => InnerFailure::NotSent(why),
                    UpstreamError::Timeout => InnerFailure::Timeout,
                    UpstreamError::Failed(why) => InnerFailure::Failed(why),
                };
            }
            Err(e) => e,
        };
        if e.is::<tower::timeout::error::Elapsed>() {
            return InnerFailure::Timeout;
        }
        InnerFailure::Failed(error_chain(&*e))
    }

    /// The failure an error from the response body stands for: the action
    /// ran, its answer was lost.
    pub fn from_body_error(e: BoxError) -> InnerFailure {
        match InnerFailure::from_call_error(e) {
            InnerFailure::NotSent(why) => InnerFailure::Failed(why),
            other => other,
        }
    }

    /// What the failure means for the key.
    pub fn disposition(&self) -> Disposition {
        match self {
            InnerFailure::NotSent(_) => Disposition::Retryable,
            InnerFailure::Timeout | InnerFailure::Failed(_) => Disposition::OutcomeUnknown,
        }
    }

    /// The failure code stored with the key.
    pub fn code(&self) -> &'static str {
        match self {
            InnerFailure::NotSent(_) => "upstream-unavailable",
            InnerFailure::Timeout => "upstream-timeout",
            InnerFailure::Failed(_) => "upstream-failed",
        }
    }
}

impl std::fmt::Display for InnerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InnerFailure::NotSent(why) => write!(f, "the request was not sent: {why}"),
            InnerFailure::Timeout => f.write_str("no answer in time"),
            InnerFailure::Failed(why) => write!(f, "the service failed: {why}"),
        }
    }
}

/// An error and its sources, joined with `: `.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_errors_keep_their_meaning() {
        let not_sent: BoxError = Box::new(UpstreamError::NotSent("refused".into()));
        assert_eq!(
            InnerFailure::from_call_error(not_sent).disposition(),
            Disposition::Retryable
        );
        let timeout: BoxError = Box::new(UpstreamError::Timeout);
        assert_eq!(
            InnerFailure::from_call_error(timeout),
            InnerFailure::Timeout
        );
        let elapsed: BoxError = Box::new(tower::timeout::error::Elapsed::new());
        assert_eq!(
            InnerFailure::from_call_error(elapsed),
            InnerFailure::Timeout
        );
    }

    #[test]
    fn any_other_error_leaves_the_outcome_unknown() {
        let io: BoxError = Box::new(std::io::Error::other("reset"));
        let failure = InnerFailure::from_call_error(io);
        assert_eq!(failure.disposition(), Disposition::OutcomeUnknown);
        assert!(failure.to_string().contains("reset"), "{failure}");
        // A body that fails after the head: the action ran.
        let body: BoxError = Box::new(UpstreamError::NotSent("late".into()));
        assert_eq!(
            InnerFailure::from_body_error(body).disposition(),
            Disposition::OutcomeUnknown
        );
    }
}
