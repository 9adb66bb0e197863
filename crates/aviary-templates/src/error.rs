//! The one error type of the template layer.

use std::path::PathBuf;

use aviary_core::ErrorCode;

/// Everything that can go wrong in the template store.
///
/// `InvalidArchive` is the only variant caused by untrusted input; it always
/// means "nothing was stored". I/O variants name the operation and the path;
/// the underlying error is the `#[source]` and is not repeated in the message.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(
        "invalid template name {0:?}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit"
    )]
    InvalidName(String),
    #[error("template {0:?} not found")]
    NotFound(String),
    #[error("template {name:?} points to digest {digest} whose rootfs is missing")]
    MissingRootfs { name: String, digest: String },
    #[error("invalid archive: {0}")]
    InvalidArchive(String),
    #[error("{tool} not found: {hint}")]
    MissingTool {
        tool: &'static str,
        hint: &'static str,
    },
    #[error("busybox at {0} is not statically linked; install busybox-static (apt-get install busybox-static)")]
    CheckBusybox(PathBuf),
    #[error("no debian mirror: set AVIARY_DEBIAN_MIRROR or add a deb source to /etc/apt/sources.list(.d)")]
    FindMirror,
    #[error("spawn {tool}")]
    SpawnTool {
        tool: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{tool} failed ({status}); last output:\n{tail}")]
    RunTool {
        tool: &'static str,
        status: String,
        tail: String,
    },
    #[error("rootfs sanity check failed: {0}")]
    CheckRootfs(String),
    #[error("open template store at {path}")]
    OpenStore {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("lock {path}")]
    LockFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("read template metadata {path}")]
    ReadMetadata {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parse template metadata {path}")]
    ParseMetadata {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("write template metadata {path}")]
    WriteMetadata {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("read archive {path}")]
    ReadArchive {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("write rootfs entry {path}")]
    WriteRootfs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("hash rootfs entry {path}")]
    HashTree {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("move rootfs into place at {path}")]
    CommitRootfs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("remove {path}")]
    RemoveRootfs {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl TemplateError {
    /// The stable API error code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            TemplateError::InvalidName(_) => ErrorCode::InvalidRequest,
            TemplateError::NotFound(_) => ErrorCode::NotFound,
            TemplateError::InvalidArchive(_) => ErrorCode::InvalidArchive,
            TemplateError::MissingTool { .. } | TemplateError::FindMirror => ErrorCode::Unavailable,
            _ => ErrorCode::Internal,
        }
    }

    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        TemplateError::InvalidArchive(msg.into())
    }
}

/// Shorthand for mapping `io::Error`s to a path-carrying variant.
pub(crate) trait IoContext<T> {
    fn ctx(
        self,
        make: fn(PathBuf, std::io::Error) -> TemplateError,
        path: &std::path::Path,
    ) -> Result<T, TemplateError>;
}

impl<T> IoContext<T> for Result<T, std::io::Error> {
    fn ctx(
        self,
        make: fn(PathBuf, std::io::Error) -> TemplateError,
        path: &std::path::Path,
    ) -> Result<T, TemplateError> {
        self.map_err(|e| make(path.to_path_buf(), e))
    }
}

pub(crate) fn write_err(path: PathBuf, source: std::io::Error) -> TemplateError {
    TemplateError::WriteRootfs { path, source }
}
pub(crate) fn remove_err(path: PathBuf, source: std::io::Error) -> TemplateError {
    TemplateError::RemoveRootfs { path, source }
}
pub(crate) fn hash_err(path: PathBuf, source: std::io::Error) -> TemplateError {
    TemplateError::HashTree { path, source }
}
pub(crate) fn open_err(path: PathBuf, source: std::io::Error) -> TemplateError {
    TemplateError::OpenStore { path, source }
}
pub(crate) fn lock_err(path: PathBuf, source: std::io::Error) -> TemplateError {
    TemplateError::LockFile { path, source }
}
pub(crate) fn read_meta_err(path: PathBuf, source: std::io::Error) -> TemplateError {
    TemplateError::ReadMetadata { path, source }
}
pub(crate) fn write_meta_err(path: PathBuf, source: std::io::Error) -> TemplateError {
    TemplateError::WriteMetadata { path, source }
}
pub(crate) fn read_archive_err(path: PathBuf, source: std::io::Error) -> TemplateError {
    TemplateError::ReadArchive { path, source }
}
pub(crate) fn commit_err(path: PathBuf, source: std::io::Error) -> TemplateError {
    TemplateError::CommitRootfs { path, source }
}
