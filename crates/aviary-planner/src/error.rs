//! The planner's error type.

/// Why a plan could not be made (or why one planner of the chain failed).
///
/// `RejectContext` and `RejectCatalog` are the caller's fault (HTTP 400 /
/// config error); the `*Llm*` variants never reach the caller of
/// [`ChainPlanner`](crate::ChainPlanner), which falls back to the heuristic.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("invalid task context: {0}")]
    RejectContext(String),
    #[error("invalid class catalog: {0}")]
    RejectCatalog(String),
    #[error("build llm http client")]
    BuildLlmClient(#[source] reqwest::Error),
    #[error("llm request failed")]
    SendLlmRequest(#[source] reqwest::Error),
    #[error("timeout after {}", format_ms(*after_ms))]
    AwaitLlmAnswer { after_ms: u64 },
    #[error("llm endpoint answered http {status}")]
    ReceiveLlmStatus { status: u16 },
    #[error("llm response larger than {limit} bytes")]
    LimitLlmBody { limit: usize },
    #[error("llm response is not a chat completion: {0}")]
    ParseLlmResponse(String),
    #[error("llm answer is not valid json: {0}")]
    ParseLlmAnswer(String),
    #[error("llm answer rejected: {0}")]
    ValidateLlmAnswer(String),
}

impl PlanError {
    /// True when the input (context or catalog) is at fault rather than a
    /// planner: the server maps this to 400.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            PlanError::RejectContext(_) | PlanError::RejectCatalog(_)
        )
    }

    /// The stable API error code of this error.
    pub fn code(&self) -> aviary_core::ErrorCode {
        use aviary_core::ErrorCode;
        match self {
            PlanError::RejectContext(_) | PlanError::RejectCatalog(_) => ErrorCode::InvalidRequest,
            PlanError::BuildLlmClient(_) => ErrorCode::Internal,
            // the LLM endpoint failed or answered nonsense: a dependency
            // that is not usable right now (the chain planner falls back
            // before any of these reaches a caller)
            PlanError::SendLlmRequest(_)
            | PlanError::AwaitLlmAnswer { .. }
            | PlanError::ReceiveLlmStatus { .. }
            | PlanError::LimitLlmBody { .. }
            | PlanError::ParseLlmResponse(_)
            | PlanError::ParseLlmAnswer(_)
            | PlanError::ValidateLlmAnswer(_) => ErrorCode::Unavailable,
        }
    }
}

fn format_ms(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// The error and all its sources on one line (`a: b: c`), for reasons and
/// traces that are stored rather than printed at an edge.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_message_names_the_duration() {
        assert_eq!(
            PlanError::AwaitLlmAnswer { after_ms: 2000 }.to_string(),
            "timeout after 2s"
        );
        assert_eq!(
            PlanError::AwaitLlmAnswer { after_ms: 250 }.to_string(),
            "timeout after 250ms"
        );
    }

    #[test]
    fn bad_input_classification() {
        assert!(PlanError::RejectContext("x".into()).is_bad_input());
        assert!(!PlanError::ReceiveLlmStatus { status: 500 }.is_bad_input());
    }

    #[test]
    fn codes_follow_the_table() {
        use aviary_core::ErrorCode;
        let cases = [
            (
                PlanError::RejectContext("x".into()),
                ErrorCode::InvalidRequest,
            ),
            (
                PlanError::RejectCatalog("x".into()),
                ErrorCode::InvalidRequest,
            ),
            (
                PlanError::AwaitLlmAnswer { after_ms: 1 },
                ErrorCode::Unavailable,
            ),
            (
                PlanError::ReceiveLlmStatus { status: 500 },
                ErrorCode::Unavailable,
            ),
            (PlanError::LimitLlmBody { limit: 1 }, ErrorCode::Unavailable),
            (
                PlanError::ParseLlmResponse("x".into()),
                ErrorCode::Unavailable,
            ),
            (
                PlanError::ParseLlmAnswer("x".into()),
                ErrorCode::Unavailable,
            ),
            (
                PlanError::ValidateLlmAnswer("x".into()),
                ErrorCode::Unavailable,
            ),
        ];
        for (e, code) in cases {
            assert_eq!(e.code(), code, "{e:?}");
            // the 400s are exactly the bad inputs
            assert_eq!(e.is_bad_input(), code == ErrorCode::InvalidRequest, "{e:?}");
        }
    }
}
