//! Errors of connecting to a cluster ([`KubeError`]), and the one mapping
//! from the API server's answers to [`RuntimeError`].

use aviary_runtime::RuntimeError;
use std::path::PathBuf;

/// Failures of [`crate::KubeRuntime::connect`]: reading the credentials and
/// settings, before any request reaches the API server.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    #[error("read kubeconfig {path:?}")]
    ReadKubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("load kubeconfig {path:?}")]
    LoadKubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("load in-cluster service account")]
    LoadInCluster {
        #[source]
        source: kube::config::InClusterError,
    },
    #[error("build kubernetes client")]
    BuildClient {
        #[source]
        source: kube::Error,
    },
    #[error("invalid kubernetes settings: {reason}")]
    InvalidSettings { reason: String },
    #[error("create relay dir {path:?}")]
    CreateRelayDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// An error and its sources, one line (`RuntimeError`'s string variants
/// carry no source, so the chain is kept in the text).
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        next = s.source();
    }
    out
}

/// The status code of an API answer, if the server answered.
pub(crate) fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(r) => Some(r.code),
        _ => None,
    }
}

/// Maps a failed request (`action`, e.g. `create pod sbx-…`) to the runtime
/// error the control plane understands. 404 and 409 have meanings per call
/// and are handled by the callers before this.
pub(crate) fn api_error(
    action: &str,
    namespace: &str,
    server: &str,
    e: kube::Error,
) -> RuntimeError {
    match &e {
        kube::Error::Api(r) => match r.code {
            401 => RuntimeError::ProbeRuntime {
                reason: format!(
                    "the Kubernetes API server {server} rejected the credentials on {action} \
                     (401 {}: {})",
                    r.reason, r.message
                ),
            },
            403 => RuntimeError::ProbeRuntime {
                reason: format!(
                    "the Kubernetes API server {server} forbade {action} in namespace \
                     {namespace:?} (403 {}: {}); the account needs get, list, create and \
                     delete on pods, secrets and networkpolicies there",
                    r.reason, r.message
                ),
            },
            422 => RuntimeError::InvalidSpec {
                reason: format!(
                    "the Kubernetes API server refused {action} as invalid: {}",
                    r.message
                ),
            },
            code => RuntimeError::InvokeRuntime {
                action: action.to_owned(),
                detail: format!("API server answered {code} {}: {}", r.reason, r.message),
            },
        },
        kube::Error::HyperError(_) | kube::Error::Service(_) => RuntimeError::ProbeRuntime {
            reason: format!(
                "the Kubernetes API server {server} is unreachable ({action}): {}",
                chain(&e)
            ),
        },
        _ => RuntimeError::InvokeRuntime {
            action: action.to_owned(),
            detail: chain(&e),
        },
    }
}
