//! Aviary's snapshot store.
//!
//! This crate owns snapshots of sandbox directories (the `/workspace` dir and the
//! overlay upper dir are plain host directories): content-defined chunking
//! ([`chunker`]), content-addressed chunk stores behind the [`ChunkStore`] trait
//! (local directory by default; S3-compatible, Redis and PostgreSQL behind the
//! `s3`, `redis` and `postgres` features), snapshot and verified restore of a tree
//! ([`snapshot_dir`], [`restore_dir`]), retention and mark-and-sweep GC ([`gc`]),
//! and the [`conformance`] suite every store passes.
//!
//! Invariants: a chunk is stored under the SHA-256 of its bytes and is written only
//! when `has` says it is missing; every chunk read back is verified before a byte of
//! it reaches disk; a manifest is stored only after all its chunks; a manifest is
//! visible only to its tenant; restore never writes outside its target.
//!
//! Concurrency: stores are `Send + Sync` and used concurrently; snapshot and restore
//! run their file I/O on one blocking thread each and talk to the store from async
//! tasks, with bounded channels in between. GC must not race snapshots
//! ([`SnapshotService`] serialises them in-process).
#![deny(unsafe_code)]

pub mod chunker;
pub mod conformance;
mod error;
pub mod gc;
mod hash;
mod manifest;
mod service;
pub mod shadow;
pub mod store;
mod tree;

pub use chunker::ChunkerConfig;
pub use error::SnapshotError;
pub use gc::{apply_retention, collect_garbage, GcReport, GraceSweep, RetentionPolicy};
pub use hash::{validate_tenant, ChunkHash, SnapshotId};
pub use manifest::{Entry, EntryKind, ManifestKey, SnapshotManifest};
pub use service::SnapshotService;
pub use store::local::LocalStore;
pub use store::memory::MemoryStore;
#[cfg(feature = "postgres")]
pub use store::postgres::PgStore;
#[cfg(feature = "redis")]
pub use store::redis::RedisStore;
#[cfg(feature = "s3")]
pub use store::s3::{S3Config, S3Store};
pub use store::ChunkStore;
pub use tree::{
    restore_dir, snapshot_dir, validate_manifest, RestoreOptions, RestoreStats, SnapshotRequest,
};
