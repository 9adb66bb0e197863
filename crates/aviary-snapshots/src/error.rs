//! The one error type of the snapshot layer.

use crate::hash::ChunkHash;
use aviary_core::ErrorCode;

/// Everything that can go wrong while snapshotting, restoring or talking to a store.
///
/// Backends map their driver errors into [`SnapshotError::Backend`] (with the driver
/// error as source) or into the semantic variants (`NotFound`), so callers never
/// match on driver types.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// No such chunk or manifest (a manifest of another tenant is not found either).
    #[error("{what} not found")]
    NotFound { what: String },
    /// A chunk's bytes do not hash to its name: bit rot, truncation or tampering.
    #[error("chunk {hash} is corrupt ({detail})")]
    Corrupt { hash: ChunkHash, detail: String },
    /// A manifest could not be decoded or is internally inconsistent.
    #[error("manifest {id} is invalid: {detail}")]
    InvalidManifest { id: String, detail: String },
    /// A manifest path would leave the restore root (`..`, absolute, through a symlink).
    #[error("path {path:?} escapes the restore root")]
    PathEscape { path: String },
    /// A name (tenant, snapshot id, chunk hash) is not well formed.
    #[error("invalid {kind}: {value:?}")]
    InvalidName { kind: &'static str, value: String },
    /// The restore target exists and is not an empty directory.
    #[error("restore target {path:?} is not an empty directory")]
    TargetNotEmpty { path: String },
    /// A local file operation failed.
    #[error("{op} {path:?}")]
    AccessFile {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The store backend failed (network, server, driver).
    #[error("{backend} backend: {op}")]
    Backend {
        backend: &'static str,
        op: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl SnapshotError {
    pub(crate) fn not_found(what: impl Into<String>) -> Self {
        SnapshotError::NotFound { what: what.into() }
    }

    pub(crate) fn file(op: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        SnapshotError::AccessFile {
            op,
            path: path.display().to_string(),
            source,
        }
    }

    pub(crate) fn backend(
        backend: &'static str,
        op: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        SnapshotError::Backend {
            backend,
            op: op.into(),
            source: source.into(),
        }
    }

    /// Whether this is a `NotFound` (handy for callers mapping to HTTP 404).
    pub fn is_not_found(&self) -> bool {
        matches!(self, SnapshotError::NotFound { .. })
    }

    /// The stable API error code of this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            SnapshotError::NotFound { .. } => ErrorCode::NotFound,
            // the snapshot's stored data is damaged or was tampered with: it
            // cannot be restored, and retrying will not change that
            SnapshotError::Corrupt { .. }
            | SnapshotError::InvalidManifest { .. }
            | SnapshotError::PathEscape { .. } => ErrorCode::InvalidState,
            // names come from the caller (snapshot ids, tenants)
            SnapshotError::InvalidName { .. } => ErrorCode::InvalidRequest,
            // the store (network, server) failed: retry later
            SnapshotError::Backend { .. } => ErrorCode::Unavailable,
            // restore targets and local files are the control plane's own
            SnapshotError::TargetNotEmpty { .. } | SnapshotError::AccessFile { .. } => {
                ErrorCode::Internal
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_its_code() {
        let io = || std::io::Error::other("disk");
        let cases = [
            (SnapshotError::not_found("manifest m"), ErrorCode::NotFound),
            (
                SnapshotError::Corrupt {
                    hash: ChunkHash::of(b"x"),
                    detail: "truncated".into(),
                },
                ErrorCode::InvalidState,
            ),
            (
                SnapshotError::InvalidManifest {
                    id: "m".into(),
                    detail: "bad json".into(),
                },
                ErrorCode::InvalidState,
            ),
            (
                SnapshotError::PathEscape {
                    path: "../etc".into(),
                },
                ErrorCode::InvalidState,
            ),
            (
                SnapshotError::InvalidName {
                    kind: "snapshot id",
                    value: "..".into(),
                },
                ErrorCode::InvalidRequest,
            ),
            (
                SnapshotError::TargetNotEmpty { path: "/t".into() },
                ErrorCode::Internal,
            ),
            (
                SnapshotError::file("read", std::path::Path::new("/f"), io()),
                ErrorCode::Internal,
            ),
            (
                SnapshotError::backend("s3", "get chunk", io()),
                ErrorCode::Unavailable,
            ),
        ];
        for (e, code) in cases {
            assert_eq!(e.code(), code, "{e:?}");
        }
    }
}
