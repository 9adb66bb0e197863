//! The error every runtime backend maps its failures into.

use aviary_core::{ErrorCode, SandboxId};
use std::path::PathBuf;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Failures of a [`crate::Runtime`]. Messages are short and never repeat the
/// `#[source]`; print the chain at the edge.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("sandbox {id} not found")]
    NotFound { id: SandboxId },
    #[error("sandbox {id} already exists")]
    AlreadyExists { id: SandboxId },
    #[error("{what} is not supported by this runtime")]
    Unsupported { what: String },
    #[error("invalid sandbox spec: {reason}")]
    InvalidSpec { reason: String },
    #[error("runtime is not usable: {reason}")]
    ProbeRuntime { reason: String },
    /// A per-host resource the sandbox needs is used up (user-id ranges, …).
    #[error("host capacity exhausted: {what}")]
    CapacityExhausted { what: String },
    #[error("spawn {program}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// The runtime binary ran but reported failure.
    #[error("{action} failed: {detail}")]
    InvokeRuntime { action: String, detail: String },
    #[error("create directory {path:?}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("remove {path:?}")]
    RemoveDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("mount overlay at {path:?}")]
    MountOverlay {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("mount sandbox disk at {path:?}")]
    MountDisk {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unmount {path:?}")]
    Unmount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("build runtime config")]
    BuildConfig {
        #[source]
        source: BoxError,
    },
    #[error("write {path:?}")]
    WriteFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("read {path:?}")]
    ReadFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parse runtime state: {detail}")]
    ParseState { detail: String },
    #[error("remove cgroup {path:?}")]
    RemoveCgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kill processes of sandbox {id}: {detail}")]
    KillProcesses { id: SandboxId, detail: String },
    /// An operation failed and undoing its partial effects failed too; both
    /// are reported (the original as the source).
    #[error("cleanup after failure also failed: {cleanup}")]
    Cleanup {
        #[source]
        original: Box<RuntimeError>,
        cleanup: Box<RuntimeError>,
    },
}

impl RuntimeError {
    /// The stable API error code this failure maps to.
    pub fn code(&self) -> ErrorCode {
        match self {
            RuntimeError::NotFound { .. } => ErrorCode::NotFound,
            RuntimeError::AlreadyExists { .. } => ErrorCode::Conflict,
            RuntimeError::Unsupported { .. } | RuntimeError::InvalidSpec { .. } => {
                ErrorCode::InvalidRequest
            }
            RuntimeError::ProbeRuntime { .. } | RuntimeError::Spawn { .. } => {
                ErrorCode::Unavailable
            }
            RuntimeError::CapacityExhausted { .. } => ErrorCode::CapacityExhausted,
            RuntimeError::Cleanup { original, .. } => original.code(),
            _ => ErrorCode::Internal,
        }
    }

    /// Combines `self` (the original failure) with a failure of the cleanup
    /// that followed it, keeping both.
    pub fn with_cleanup(self, cleanup: Result<(), RuntimeError>) -> RuntimeError {
        match cleanup {
            Ok(()) => self,
            Err(c) => RuntimeError::Cleanup {
                original: Box::new(self),
                cleanup: Box::new(c),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cleanup_keeps_the_original_as_source() {
        let id = SandboxId::generate();
        let e = RuntimeError::NotFound { id: id.clone() }.with_cleanup(Err(
            RuntimeError::InvokeRuntime {
                action: "crun delete".into(),
                detail: "boom".into(),
            },
        ));
        assert_eq!(e.code(), ErrorCode::NotFound);
        assert_eq!(
            e.to_string(),
            "cleanup after failure also failed: crun delete failed: boom"
        );
        let source = std::error::Error::source(&e).unwrap();
        assert_eq!(source.to_string(), format!("sandbox {id} not found"));
    }

    #[test]
    fn host_capacity_is_a_503_not_a_500() {
        let e = RuntimeError::CapacityExhausted {
            what: "all 4096 user-id ranges are in use".into(),
        };
        assert_eq!(e.code(), ErrorCode::CapacityExhausted);
        assert_eq!(e.code().http_status(), 503);
    }
}
