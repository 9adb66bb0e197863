//! The snapshot manifest: the complete, self-contained description of one snapshot.
//!
//! A manifest lists every entry of the tree with its metadata and, for regular
//! files, the ordered chunk hashes of its content. Manifests never refer to another
//! manifest's entries (`parent` is lineage only), so deleting a parent never breaks a
//! child; chunks are shared through the content-addressed store instead.

use crate::hash::{ChunkHash, SnapshotId};
use aviary_core::SandboxId;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

/// Kinds of tree entries a snapshot records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    /// Named pipe.
    Fifo,
    /// Overlayfs whiteout: a character device 0/0 marking a deleted lower file.
    Whiteout,
}

/// One file, directory, symlink, fifo or whiteout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Relative to the snapshot root, `/`-separated; `""` is the root directory.
    pub path: String,
    pub kind: EntryKind,
    /// Permission bits including setuid/setgid/sticky (`0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Content bytes for files (the bytes actually read), 0 otherwise.
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub mtime_ns: i64,
    /// Status-change time and inode at snapshot time, used only to decide whether a
    /// later snapshot may reuse this entry's chunks without reading the file.
    #[serde(default)]
    pub ctime_ns: i64,
    #[serde(default)]
    pub ino: u64,
    /// Ordered content chunks (files only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<ChunkHash>,
    /// Target of a symlink (stored verbatim, never followed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    /// Directory carries the overlayfs opaque marker (`trusted.overlay.opaque=y`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opaque: bool,
}

/// A snapshot: metadata plus the full entry list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotManifest {
    pub id: SnapshotId,
    /// The snapshot this one was taken after (checkpoint tree / fork lineage).
    pub parent: Option<SnapshotId>,
    /// When the scan started (entries changed after this are never trusted unread).
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    pub tenant: String,
    pub sandbox_id: Option<SandboxId>,
    /// Free-form grouping for retention, e.g. `workspace` or `upper`.
    pub label: String,
    pub entries: Vec<Entry>,
    /// Sum of file sizes in the tree.
    pub total_bytes: u64,
    /// Chunk bytes this snapshot had to write (not already in the store).
    pub new_bytes: u64,
    /// Number of chunks this snapshot had to write.
    #[serde(default)]
    pub new_chunks: u64,
    /// File bytes read and hashed (files unchanged since the parent are not read;
    /// with reflink shadows, changed files only around their changed blocks).
    #[serde(default)]
    pub read_bytes: u64,
}

impl SnapshotManifest {
    /// Every chunk hash referenced, with repetitions.
    pub fn chunk_refs(&self) -> impl Iterator<Item = &ChunkHash> {
        self.entries.iter().flat_map(|e| e.chunks.iter())
    }

    /// Encoded form stored in a [`crate::ChunkStore`].
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("manifest serializes")
    }

    pub fn from_bytes(id: &str, bytes: &[u8]) -> Result<Self, crate::SnapshotError> {
        serde_json::from_slice(bytes).map_err(|e| crate::SnapshotError::InvalidManifest {
            id: id.to_owned(),
            detail: e.to_string(),
        })
    }
}

/// Name of a stored manifest.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ManifestKey {
    pub tenant: String,
    pub id: SnapshotId,
}
