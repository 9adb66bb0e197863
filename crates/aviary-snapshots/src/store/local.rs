//! Local directory store (the embedded default).
//!
//! Layout under the root: `chunks/<first two hex>/<hash>`, `manifests/<tenant>/<id>.json`
//! and `tmp/` for writes in progress. Every object is written to `tmp/` and renamed
//! into place, so a reader never sees a half-written object and a crash leaves at
//! most garbage in `tmp/` (cleared on open). Durability with `fsync` on (the
//! default): chunks are not synced one by one; [`ChunkStore::flush`] (called by every
//! snapshot before its manifest) does one `syncfs` of the store's filesystem, and
//! manifests are fsynced before their rename. So a manifest is never durable before
//! its chunks. File I/O runs on tokio's blocking pool.

use super::{decode_manifest, ChunkStore};
use crate::error::SnapshotError;
use crate::hash::{validate_tenant, ChunkHash, SnapshotId};
use crate::manifest::{ManifestKey, SnapshotManifest};
use async_trait::async_trait;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Clone)]
pub struct LocalStore {
    inner: Arc<Inner>,
}

struct Inner {
    root: PathBuf,
    fsync: bool,
    seq: AtomicU64,
}

impl LocalStore {
    /// Open (creating if needed) a store rooted at `root`, with fsync before rename.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, SnapshotError> {
        let root = root.into();
        for sub in ["chunks", "manifests", "tmp"] {
            let p = root.join(sub);
            std::fs::create_dir_all(&p).map_err(|e| SnapshotError::file("create", &p, e))?;
        }
        let tmp = root.join("tmp");
        if let Ok(rd) = std::fs::read_dir(&tmp) {
            for e in rd.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        Ok(LocalStore {
            inner: Arc::new(Inner {
                root,
                fsync: true,
                seq: AtomicU64::new(0),
            }),
        })
    }

    /// Turn fsync-before-rename on or off (off trades crash durability for speed).
    pub fn with_fsync(self, fsync: bool) -> Self {
        let inner = Inner {
            root: self.inner.root.clone(),
            fsync,
            seq: AtomicU64::new(0),
        };
        LocalStore {
            inner: Arc::new(inner),
        }
    }

    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Where the chunk `hash` lives on disk (tests use this to plant corruption).
    pub fn chunk_path(&self, hash: &ChunkHash) -> PathBuf {
        self.inner
            .root
            .join("chunks")
            .join(&hash.as_str()[..2])
            .join(hash.as_str())
    }

    fn manifest_path(&self, tenant: &str, id: &SnapshotId) -> Result<PathBuf, SnapshotError> {
        validate_tenant(tenant)?;
        Ok(self
            .inner
            .root
            .join("manifests")
            .join(tenant)
            .join(format!("{id}.json")))
    }
}

impl Inner {
    fn write_atomic(&self, dest: &Path, bytes: &[u8], sync: bool) -> Result<(), SnapshotError> {
        let tmp = self.root.join("tmp").join(format!(
            "{}.{}",
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        ));
        let result = (|| {
            let mut f =
                std::fs::File::create(&tmp).map_err(|e| SnapshotError::file("create", &tmp, e))?;
            f.write_all(bytes)
                .map_err(|e| SnapshotError::file("write", &tmp, e))?;
            if sync {
                f.sync_all()
                    .map_err(|e| SnapshotError::file("sync", &tmp, e))?;
            }
            let parent = dest.parent().expect("objects live in a directory");
            if let Err(e) = std::fs::rename(&tmp, dest) {
                if e.kind() != ErrorKind::NotFound {
                    return Err(SnapshotError::file("rename into", dest, e));
                }
                std::fs::create_dir_all(parent)
                    .map_err(|e| SnapshotError::file("create", parent, e))?;
                std::fs::rename(&tmp, dest)
                    .map_err(|e| SnapshotError::file("rename into", dest, e))?;
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, SnapshotError> + Send + 'static,
) -> Result<T, SnapshotError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| SnapshotError::backend("local", "join blocking task", e))?
}

#[async_trait]
impl ChunkStore for LocalStore {
    fn backend(&self) -> &'static str {
        "local"
    }

    async fn put(&self, hash: &ChunkHash, bytes: Vec<u8>) -> Result<(), SnapshotError> {
        let dest = self.chunk_path(hash);
        let inner = self.inner.clone();
        blocking(move || inner.write_atomic(&dest, &bytes, false)).await
    }

    async fn flush(&self) -> Result<(), SnapshotError> {
        if !self.inner.fsync {
            return Ok(());
        }
        let root = self.inner.root.clone();
        blocking(move || {
            let dir =
                std::fs::File::open(&root).map_err(|e| SnapshotError::file("open", &root, e))?;
            nix::unistd::syncfs(std::os::fd::AsRawFd::as_raw_fd(&dir))
                .map_err(|e| SnapshotError::file("syncfs", &root, e.into()))
        })
        .await
    }

    async fn get(&self, hash: &ChunkHash) -> Result<Vec<u8>, SnapshotError> {
        let path = self.chunk_path(hash);
        let hash = hash.clone();
        blocking(move || match std::fs::read(&path) {
            Ok(b) => Ok(b),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                Err(SnapshotError::not_found(format!("chunk {hash}")))
            }
            Err(e) => Err(SnapshotError::file("read", &path, e)),
        })
        .await
    }

    async fn has(&self, hash: &ChunkHash) -> Result<bool, SnapshotError> {
        let path = self.chunk_path(hash);
        match tokio::fs::symlink_metadata(&path).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(e) => Err(SnapshotError::file("stat", &path, e)),
        }
    }

    async fn delete(&self, hash: &ChunkHash) -> Result<(), SnapshotError> {
        let path = self.chunk_path(hash);
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(SnapshotError::file("remove", &path, e)),
        }
    }

    async fn list(
        &self,
        after: Option<&ChunkHash>,
        limit: usize,
    ) -> Result<Vec<ChunkHash>, SnapshotError> {
        let chunks = self.inner.root.join("chunks");
        let after = after.cloned();
        blocking(move || {
            let mut out = Vec::new();
            let first = after.as_ref().map_or(0, |h| {
                u8::from_str_radix(&h.as_str()[..2], 16).expect("hash is hex")
            });
            for prefix in first..=255u8 {
                let dir = chunks.join(format!("{prefix:02x}"));
                let rd = match std::fs::read_dir(&dir) {
                    Ok(rd) => rd,
                    Err(e) if e.kind() == ErrorKind::NotFound => continue,
                    Err(e) => return Err(SnapshotError::file("list", &dir, e)),
                };
                let mut names: Vec<ChunkHash> = Vec::new();
                for entry in rd {
                    let entry = entry.map_err(|e| SnapshotError::file("list", &dir, e))?;
                    if let Some(h) = entry.file_name().to_str().and_then(|s| s.parse().ok()) {
                        if after.as_ref().is_none_or(|a| &h > a) {
                            names.push(h);
                        }
                    }
                }
                names.sort();
                out.extend(names);
                if out.len() >= limit {
                    out.truncate(limit);
                    break;
                }
            }
            Ok(out)
        })
        .await
    }

    async fn put_manifest(&self, manifest: &SnapshotManifest) -> Result<(), SnapshotError> {
        let dest = self.manifest_path(&manifest.tenant, &manifest.id)?;
        let bytes = manifest.to_bytes();
        let inner = self.inner.clone();
        let sync = inner.fsync;
        blocking(move || inner.write_atomic(&dest, &bytes, sync)).await
    }

    async fn get_manifest(
        &self,
        tenant: &str,
        id: &SnapshotId,
    ) -> Result<SnapshotManifest, SnapshotError> {
        let path = self.manifest_path(tenant, id)?;
        let bytes = match tokio::fs::read(&path).await {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(SnapshotError::not_found(format!("snapshot {id}")))
            }
            Err(e) => return Err(SnapshotError::file("read", &path, e)),
        };
        decode_manifest(tenant, id, &bytes)
    }

    async fn list_manifests(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<ManifestKey>, SnapshotError> {
        if let Some(t) = tenant {
            validate_tenant(t)?;
        }
        let root = self.inner.root.join("manifests");
        let tenant = tenant.map(str::to_owned);
        blocking(move || {
            let tenants: Vec<String> = match tenant {
                Some(t) => vec![t],
                None => std::fs::read_dir(&root)
                    .map_err(|e| SnapshotError::file("list", &root, e))?
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter(|t| validate_tenant(t).is_ok())
                    .collect(),
            };
            let mut out = Vec::new();
            for t in tenants {
                let dir = root.join(&t);
                let rd = match std::fs::read_dir(&dir) {
                    Ok(rd) => rd,
                    Err(e) if e.kind() == ErrorKind::NotFound => continue,
                    Err(e) => return Err(SnapshotError::file("list", &dir, e)),
                };
                for entry in rd {
                    let entry = entry.map_err(|e| SnapshotError::file("list", &dir, e))?;
                    let name = entry.file_name();
                    if let Some(id) = name
                        .to_str()
                        .and_then(|s| s.strip_suffix(".json"))
                        .and_then(|s| s.parse::<SnapshotId>().ok())
                    {
                        out.push(ManifestKey {
                            tenant: t.clone(),
                            id,
                        });
                    }
                }
            }
            out.sort();
            Ok(out)
        })
        .await
    }

    async fn delete_manifest(&self, tenant: &str, id: &SnapshotId) -> Result<(), SnapshotError> {
        let path = self.manifest_path(tenant, id)?;
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                Err(SnapshotError::not_found(format!("snapshot {id}")))
            }
            Err(e) => Err(SnapshotError::file("remove", &path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn local_store_passes_conformance() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path().join("store")).unwrap();
        crate::conformance::run_all(&store).await;
    }

    #[tokio::test]
    async fn flipped_byte_on_disk_fails_restore_with_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path().join("store")).unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        std::fs::write(src.join("f"), vec![42u8; 300_000]).unwrap();
        let m = crate::snapshot_dir(&store, &src, crate::SnapshotRequest::new("t1", "ws"))
            .await
            .unwrap();
        let hash = m.entries.iter().find(|e| e.path == "f").unwrap().chunks[0].clone();
        let path = store.chunk_path(&hash);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[1000] ^= 0x01;
        std::fs::write(&path, &bytes).unwrap();
        let err = crate::restore_dir(&store, &m, &dir.path().join("out"), &Default::default())
            .await
            .unwrap_err();
        assert!(matches!(err, SnapshotError::Corrupt { .. }), "{err}");
        // Nothing of the failed restore is left behind.
        assert_eq!(
            std::fs::read_dir(dir.path().join("out")).unwrap().count(),
            0
        );
    }
}
