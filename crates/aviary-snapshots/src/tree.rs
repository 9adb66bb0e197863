//! Snapshot a directory tree into a [`ChunkStore`], and restore a manifest into an
//! empty directory.
//!
//! **Snapshot.** A blocking thread walks the tree (never following symlinks, never
//! crossing into another filesystem), streams every regular file through the
//! [`StreamChunker`], hashes each chunk and sends chunks not yet seen in this
//! snapshot over a bounded channel; async tasks check `has` and `put` only the
//! missing ones, a few at a time. Memory stays bounded: the chunker buffer plus
//! the channel and in-flight puts (~40 MiB with the default 4 MiB max chunk).
//! With a `parent`, a file whose size, mtime, ctime and inode are unchanged since the
//! parent (and whose ctime is safely older than the parent's scan start, so a write
//! racing the parent's read cannot hide) reuses the parent's chunk list unread.
//! With a shadow directory on a reflink filesystem, a changed large file is chunked
//! from a clone of itself and re-read only around the blocks that changed since
//! the previous snapshot's clone ([`crate::shadow`]).
//!
//! **Restore.** The manifest is validated first (relative, normalised paths only, no
//! duplicates, nothing below a symlink or a non-directory). Async tasks fetch chunks
//! in manifest order (a few ahead), verify each chunk's SHA-256 and hand them over a
//! bounded channel to a blocking writer thread. The writer creates directories, then
//! files (`O_CREAT|O_EXCL|O_NOFOLLOW`), then fifos, whiteouts and finally symlinks, so
//! no symlink exists while anything is written, and it checks with `lstat` that
//! every parent is a real directory. Metadata (owner, mode, times, overlay opaque
//! marker) is applied last, directories deepest first. On any error the partly
//! restored contents are removed; a corrupt chunk is never written.

use crate::chunker::{self, ChunkerConfig, StreamChunker};
use crate::error::SnapshotError;
use crate::hash::{validate_tenant, ChunkHash, SnapshotId};
use crate::manifest::{Entry, EntryKind, SnapshotManifest};
use crate::shadow::{self, ShadowEntry, ShadowSet, MIN_SHADOW_SIZE};
use crate::store::ChunkStore;
use aviary_core::SandboxId;
use futures_util::{stream, StreamExt, TryStreamExt};
use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::fs::OpenOptions;
use std::io::{ErrorKind, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use tokio::sync::mpsc;

/// Chunks in flight between the walker and the store (and between fetch and write).
const CHANNEL_DEPTH: usize = 4;
/// Concurrent `has`/`put` calls while snapshotting.
const PUT_CONCURRENCY: usize = 4;
/// Entries whose ctime is this close to the parent's scan start are re-read next
/// time: a write that lands in the same timestamp tick as our read would not change
/// ctime. Linux stamps files from the coarse clock (one jiffy, <= 10 ms); 100 ms is a
/// wide margin for filesystems with nanosecond timestamps (ext4, xfs, btrfs, tmpfs).
const RACY_WINDOW_NS: i64 = 100_000_000;

/// What to snapshot as.
#[derive(Clone, Debug)]
pub struct SnapshotRequest {
    pub tenant: String,
    pub sandbox_id: Option<SandboxId>,
    pub label: String,
    /// Parent snapshot (same tenant): recorded as lineage and used to skip
    /// re-reading unchanged files.
    pub parent: Option<SnapshotId>,
    pub chunker: ChunkerConfig,
    /// Host-only directory for reflink shadows (see [`crate::shadow`]): on the same
    /// filesystem as the tree, outside it and out of the sandbox's reach. `None`, or a
    /// filesystem without reflinks: changed files are read whole.
    pub shadow: Option<PathBuf>,
}

impl SnapshotRequest {
    pub fn new(tenant: impl Into<String>, label: impl Into<String>) -> Self {
        SnapshotRequest {
            tenant: tenant.into(),
            sandbox_id: None,
            label: label.into(),
            parent: None,
            chunker: ChunkerConfig::default(),
            shadow: None,
        }
    }

    /// Track changes inside large files with reflink shadows kept in `dir`.
    pub fn shadow(mut self, dir: impl Into<PathBuf>) -> Self {
        self.shadow = Some(dir.into());
        self
    }

    pub fn sandbox(mut self, id: SandboxId) -> Self {
        self.sandbox_id = Some(id);
        self
    }

    pub fn parent(mut self, id: SnapshotId) -> Self {
        self.parent = Some(id);
        self
    }
}

/// How to restore.
#[derive(Clone, Debug)]
pub struct RestoreOptions {
    /// `lchown` entries to their recorded uid/gid (needs root; default: when euid is 0).
    pub restore_ownership: bool,
    /// Chunks fetched ahead of the writer.
    pub fetch_concurrency: usize,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            restore_ownership: nix::unistd::geteuid().is_root(),
            fetch_concurrency: 8,
        }
    }
}

/// What a restore did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreStats {
    pub entries: u64,
    pub bytes: u64,
    pub chunks_fetched: u64,
}

fn time_ns(secs: i64, nsec: i64) -> i64 {
    secs.saturating_mul(1_000_000_000).saturating_add(nsec)
}

fn now_ns(t: time::OffsetDateTime) -> i64 {
    i64::try_from(t.unix_timestamp_nanos()).unwrap_or(i64::MAX)
}

/// Snapshot the tree at `root` into `store` and store its manifest.
#[tracing::instrument(skip_all, fields(root = %root.display(), tenant = %req.tenant, label = %req.label))]
pub async fn snapshot_dir(
    store: &dyn ChunkStore,
    root: &Path,
    req: SnapshotRequest,
) -> Result<SnapshotManifest, SnapshotError> {
    validate_tenant(&req.tenant)?;
    let created_at = aviary_core::now();
    let (reuse, trust_before) = match &req.parent {
        Some(parent) => {
            let p = store.get_manifest(&req.tenant, parent).await?;
            let files = p
                .entries
                .into_iter()
                .filter(|e| e.kind == EntryKind::File)
                .map(|e| (e.path.clone(), e))
                .collect();
            (files, now_ns(p.created_at) - RACY_WINDOW_NS)
        }
        None => (HashMap::new(), i64::MIN),
    };
    let (tx, rx) = mpsc::channel::<(ChunkHash, Vec<u8>)>(CHANNEL_DEPTH);
    let walker = Walker {
        root: root.to_owned(),
        root_dev: 0,
        cfg: req.chunker,
        reuse,
        trust_before,
        shadow_dir: req.shadow.clone(),
        shadow: None,
        tx,
        entries: Vec::new(),
        to_read: Vec::new(),
    };
    let walk = tokio::task::spawn_blocking(move || walker.run());

    let chunks = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    let consumed: Result<(u64, u64), SnapshotError> = chunks
        .map(|(hash, data)| async move {
            if store.has(&hash).await? {
                return Ok(0u64);
            }
            let n = data.len() as u64;
            store.put(&hash, data).await?;
            Ok(n)
        })
        .buffer_unordered(PUT_CONCURRENCY)
        .try_fold((0u64, 0u64), |(bytes, count), n| async move {
            Ok((bytes + n, count + u64::from(n > 0)))
        })
        .await;
    let walked = walk
        .await
        .map_err(|e| SnapshotError::backend(store.backend(), "join walker", e))?;
    let (new_bytes, new_chunks) = consumed?;
    let (entries, read_bytes, shadow) = walked?;

    let manifest = SnapshotManifest {
        id: SnapshotId::generate(),
        parent: req.parent,
        created_at,
        tenant: req.tenant,
        sandbox_id: req.sandbox_id,
        label: req.label,
        total_bytes: entries.iter().map(|e| e.size).sum(),
        entries,
        new_bytes,
        new_chunks,
        read_bytes,
    };
    store.flush().await?;
    store.put_manifest(&manifest).await?;
    if let Some(shadow) = shadow {
        // The snapshot stands even if its shadows cannot be kept: the next one then
        // reads changed files whole.
        match tokio::task::spawn_blocking(move || shadow.commit()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "could not keep snapshot shadows"),
            Err(e) => tracing::warn!(error = %e, "could not keep snapshot shadows"),
        }
    }
    tracing::debug!(id = %manifest.id, new_bytes, read_bytes, "snapshot stored");
    Ok(manifest)
}

struct Walker {
    root: PathBuf,
    root_dev: u64,
    cfg: ChunkerConfig,
    /// The parent's files by path.
    reuse: HashMap<String, Entry>,
    /// Parent entries with a ctime before this may be reused unread.
    trust_before: i64,
    shadow_dir: Option<PathBuf>,
    shadow: Option<ShadowSet>,
    tx: mpsc::Sender<(ChunkHash, Vec<u8>)>,
    entries: Vec<Entry>,
    /// Indices into `entries` of files that must be read.
    to_read: Vec<usize>,
}

/// Files are read and hashed by this many threads (chunking and SHA-256 are
/// CPU-bound; one thread per core, at most 4).
fn hash_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4)
}

/// A file read: its index in `entries`, its entry, the bytes read.
type ReadDone = (usize, (Entry, u64));

/// State shared by the hashing threads.
struct Hashing<'a> {
    cfg: ChunkerConfig,
    root: &'a Path,
    reuse: &'a HashMap<String, Entry>,
    shadow: Option<&'a ShadowSet>,
    emitted: std::sync::Mutex<HashSet<ChunkHash>>,
    next: std::sync::atomic::AtomicUsize,
    failed: std::sync::atomic::AtomicBool,
}

impl Walker {
    fn run(mut self) -> Result<(Vec<Entry>, u64, Option<ShadowSet>), SnapshotError> {
        let root = self.root.clone();
        let md =
            std::fs::symlink_metadata(&root).map_err(|e| SnapshotError::file("stat", &root, e))?;
        if !md.is_dir() {
            return Err(SnapshotError::file(
                "snapshot",
                &root,
                std::io::Error::new(ErrorKind::InvalidInput, "not a directory"),
            ));
        }
        self.root_dev = md.dev();
        if let Some(dir) = &self.shadow_dir {
            self.shadow = Some(
                ShadowSet::open(dir, &root)
                    .map_err(|e| SnapshotError::file("open shadow", dir, e))?,
            );
        }
        let mut e = base_entry(String::new(), EntryKind::Dir, &md);
        e.opaque = has_opaque_xattr(&root);
        self.entries.push(e);
        self.walk_dir("", &root)?;
        let read_bytes = self.read_files()?;
        Ok((self.entries, read_bytes, self.shadow))
    }

    /// Read, chunk and hash every file in `to_read`, on several threads.
    fn read_files(&mut self) -> Result<u64, SnapshotError> {
        let todo = std::mem::take(&mut self.to_read);
        let shared = Hashing {
            cfg: self.cfg,
            root: &self.root,
            reuse: &self.reuse,
            shadow: self.shadow.as_ref().filter(|s| s.enabled()),
            emitted: std::sync::Mutex::new(HashSet::new()),
            next: std::sync::atomic::AtomicUsize::new(0),
            failed: std::sync::atomic::AtomicBool::new(false),
        };
        let entries = &self.entries;
        let results: Vec<Result<Vec<ReadDone>, SnapshotError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..hash_threads().min(todo.len().max(1)))
                .map(|_| {
                    let tx = self.tx.clone();
                    let (shared, todo) = (&shared, &todo);
                    scope.spawn(move || {
                        let mut done = Vec::new();
                        loop {
                            if shared.failed.load(std::sync::atomic::Ordering::Relaxed) {
                                break;
                            }
                            let i = shared
                                .next
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(&idx) = todo.get(i) else { break };
                            match read_file(shared, &tx, entries[idx].clone()) {
                                Ok(e) => done.push((idx, e)),
                                Err(err) => {
                                    shared
                                        .failed
                                        .store(true, std::sync::atomic::Ordering::Relaxed);
                                    return Err(err);
                                }
                            }
                        }
                        Ok(done)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("hashing thread panicked"))
                .collect()
        });
        let mut read_bytes = 0;
        for r in results {
            for (idx, (e, read)) in r? {
                read_bytes += read;
                self.entries[idx] = e;
            }
        }
        Ok(read_bytes)
    }

    fn walk_dir(&mut self, rel: &str, abs: &Path) -> Result<(), SnapshotError> {
        let rd = std::fs::read_dir(abs).map_err(|e| SnapshotError::file("list", abs, e))?;
        let mut names = Vec::new();
        for entry in rd {
            names.push(
                entry
                    .map_err(|e| SnapshotError::file("list", abs, e))?
                    .file_name(),
            );
        }
        names.sort();
        for name in names {
            let child_abs = abs.join(&name);
            let name = name.to_str().ok_or_else(|| SnapshotError::InvalidName {
                kind: "file name (not UTF-8)",
                value: child_abs.display().to_string(),
            })?;
            let child_rel = if rel.is_empty() {
                name.to_owned()
            } else {
                format!("{rel}/{name}")
            };
            let md = match std::fs::symlink_metadata(&child_abs) {
                Ok(md) => md,
                // Deleted while we walked: it is simply not in the snapshot.
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) => return Err(SnapshotError::file("stat", &child_abs, e)),
            };
            let ft = md.file_type();
            if ft.is_dir() {
                if md.dev() != self.root_dev {
                    tracing::warn!(path = %child_abs.display(), "skipping mount point");
                    continue;
                }
                let mut e = base_entry(child_rel.clone(), EntryKind::Dir, &md);
                e.opaque = has_opaque_xattr(&child_abs);
                self.entries.push(e);
                self.walk_dir(&child_rel, &child_abs)?;
            } else if ft.is_file() {
                let mut entry = base_entry(child_rel, EntryKind::File, &md);
                match self.reuse.get(&entry.path) {
                    Some(prev)
                        if prev.ctime_ns < self.trust_before
                            && prev.size == md.len()
                            && prev.mtime_ns == entry.mtime_ns
                            && prev.ctime_ns == entry.ctime_ns
                            && prev.ino == entry.ino =>
                    {
                        entry.size = prev.size;
                        entry.chunks = prev.chunks.clone();
                        if let Some(shadow) = &self.shadow {
                            shadow.carry(&entry.path, &entry.chunks);
                        }
                    }
                    _ => self.to_read.push(self.entries.len()),
                }
                self.entries.push(entry);
            } else if ft.is_symlink() {
                let target = std::fs::read_link(&child_abs)
                    .map_err(|e| SnapshotError::file("read link", &child_abs, e))?;
                let target = target.to_str().ok_or_else(|| SnapshotError::InvalidName {
                    kind: "symlink target (not UTF-8)",
                    value: child_abs.display().to_string(),
                })?;
                let mut e = base_entry(child_rel, EntryKind::Symlink, &md);
                e.symlink_target = Some(target.to_owned());
                self.entries.push(e);
            } else if ft.is_fifo() {
                self.entries
                    .push(base_entry(child_rel, EntryKind::Fifo, &md));
            } else if ft.is_char_device() && md.rdev() == 0 {
                self.entries
                    .push(base_entry(child_rel, EntryKind::Whiteout, &md));
            } else {
                tracing::warn!(path = %child_abs.display(), "skipping socket or device node");
            }
        }
        Ok(())
    }
}

/// Chunk and hash one file, handing chunks not yet seen in this snapshot to the store.
/// Returns the entry and the bytes read.
fn read_file(
    shared: &Hashing<'_>,
    tx: &mpsc::Sender<(ChunkHash, Vec<u8>)>,
    mut entry: Entry,
) -> Result<(Entry, u64), SnapshotError> {
    let abs = shared.root.join(&entry.path);
    let abs = abs.as_path();
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(abs)
        .map_err(|e| SnapshotError::file("open", abs, e))?;
    let fmd = file
        .metadata()
        .map_err(|e| SnapshotError::file("stat", abs, e))?;
    if !fmd.is_file() {
        return Err(SnapshotError::file(
            "snapshot",
            abs,
            std::io::Error::new(ErrorKind::InvalidData, "replaced while snapshotting"),
        ));
    }
    // Times as of the open, so that a later change is seen by the next snapshot.
    entry.mtime_ns = time_ns(fmd.mtime(), fmd.mtime_nsec());
    entry.ctime_ns = time_ns(fmd.ctime(), fmd.ctime_nsec());
    entry.ino = fmd.ino();
    if let Some(shadow) = shared.shadow {
        if fmd.len() >= MIN_SHADOW_SIZE && shadow.enabled() {
            match read_via_shadow(shared, shadow, tx, &mut entry, &file) {
                Ok(Some(read)) => return Ok((entry, read)),
                Ok(None) => {}
                Err(ShadowError::Snapshot(e)) => return Err(e),
                Err(ShadowError::Io(e)) => {
                    tracing::debug!(path = %abs.display(), error = %e, "shadow unusable, reading the whole file");
                }
            }
        }
    }
    let mut chunker = StreamChunker::new(file, shared.cfg);
    let mut size = 0u64;
    while let Some(chunk) = chunker
        .next_chunk()
        .map_err(|e| SnapshotError::file("read", abs, e))?
    {
        size += chunk.len() as u64;
        entry.chunks.push(emit(shared, tx, chunk)?);
    }
    entry.size = size;
    Ok((entry, size))
}

/// Hash a chunk and hand it to the store unless this snapshot already did.
fn emit(
    shared: &Hashing<'_>,
    tx: &mpsc::Sender<(ChunkHash, Vec<u8>)>,
    chunk: &[u8],
) -> Result<ChunkHash, SnapshotError> {
    let hash = ChunkHash::of(chunk);
    let first = shared
        .emitted
        .lock()
        .expect("dedup set poisoned")
        .insert(hash.clone());
    if first {
        tx.blocking_send((hash.clone(), chunk.to_vec()))
            .map_err(|_| {
                SnapshotError::backend("snapshot", "hand chunk to store", "store writer stopped")
            })?;
    }
    Ok(hash)
}

enum ShadowError {
    /// The snapshot itself failed (the store stopped): give up.
    Snapshot(SnapshotError),
    /// The shadow path failed: read the live file instead.
    Io(std::io::Error),
}

impl From<std::io::Error> for ShadowError {
    fn from(e: std::io::Error) -> Self {
        ShadowError::Io(e)
    }
}

/// Clone `live` into a new shadow and chunk the clone: only the ranges that changed
/// since the previous shadow when there is a usable one, else all of it. `Ok(None)`:
/// the filesystem cannot clone.
fn read_via_shadow(
    shared: &Hashing<'_>,
    shadow: &ShadowSet,
    tx: &mpsc::Sender<(ChunkHash, Vec<u8>)>,
    entry: &mut Entry,
    live: &std::fs::File,
) -> Result<Option<u64>, ShadowError> {
    let Some((name, clone)) = shadow.clone_new(live)? else {
        return Ok(None);
    };
    let new_size = clone.metadata()?.len();
    let cfg = &shared.cfg;
    let previous = shared
        .reuse
        .get(&entry.path)
        .and_then(|p| shadow.previous(&entry.path, &p.chunks));
    let plan = match previous {
        Some((old_file, old)) => {
            let old_ext = shadow::extents(&old_file, old.size)?;
            let new_ext = shadow::extents(&clone, new_size)?;
            match (old_ext, new_ext) {
                (Some(a), Some(b)) => {
                    let dirty = shadow::dirty_ranges(&a, old.size, &b, new_size);
                    let ok = shadow::reusable(&old.chunks, new_size, &dirty, cfg);
                    Some((old.chunks.as_slice(), ok))
                }
                _ => None,
            }
        }
        None => None,
    };
    let (old, ok): (&[(ChunkHash, u64)], Vec<bool>) = plan.unwrap_or((&[], Vec::new()));
    // Parent chunk starts, for finding a cut that lands on one.
    let mut starts = HashMap::with_capacity(old.len());
    let mut off = 0u64;
    for (i, (_, len)) in old.iter().enumerate() {
        starts.insert(off, i);
        off += len;
    }
    let mut chunks: Vec<(ChunkHash, u64)> = Vec::new();
    let mut read = 0u64;
    let mut buf: Vec<u8> = Vec::new();
    let mut buf_off = 0u64;
    let mut pos = 0u64;
    while pos < new_size {
        if let Some(&i) = starts.get(&pos) {
            if ok[i] {
                chunks.push(old[i].clone());
                pos += old[i].1;
                continue;
            }
        }
        // Re-chunk at `pos`: the chunker sees the bytes a full read would show it
        // there (up to a maximum chunk, or to the end).
        let want = (cfg.max_size as u64).min(new_size - pos) as usize;
        if pos >= buf_off && pos <= buf_off + buf.len() as u64 {
            buf.drain(..(pos - buf_off) as usize);
        } else {
            buf.clear();
        }
        buf_off = pos;
        while buf.len() < want {
            let have = buf.len();
            buf.resize(want, 0);
            let n = std::os::unix::fs::FileExt::read_at(
                &clone,
                &mut buf[have..],
                buf_off + have as u64,
            )?;
            buf.truncate(have + n);
            if n == 0 {
                return Err(std::io::Error::from(ErrorKind::UnexpectedEof).into());
            }
            read += n as u64;
        }
        let cut = chunker::cut_point(&buf[..want], cfg);
        let hash = emit(shared, tx, &buf[..cut]).map_err(ShadowError::Snapshot)?;
        chunks.push((hash, cut as u64));
        pos += cut as u64;
    }
    entry.size = new_size;
    entry.chunks = chunks.iter().map(|c| c.0.clone()).collect();
    shadow.record(
        &entry.path,
        ShadowEntry {
            name,
            size: new_size,
            chunks,
        },
    );
    Ok(Some(read))
}

fn base_entry(path: String, kind: EntryKind, md: &std::fs::Metadata) -> Entry {
    Entry {
        path,
        kind,
        mode: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        size: 0,
        mtime_ns: time_ns(md.mtime(), md.mtime_nsec()),
        ctime_ns: time_ns(md.ctime(), md.ctime_nsec()),
        ino: md.ino(),
        chunks: Vec::new(),
        symlink_target: None,
        opaque: false,
    }
}

fn c_path(path: &Path) -> Option<CString> {
    CString::new(path.as_os_str().as_bytes()).ok()
}

/// Whether a directory carries overlayfs' opaque marker (trusted or user namespace).
#[allow(unsafe_code)] // lgetxattr: std has no xattr API
fn has_opaque_xattr(path: &Path) -> bool {
    let Some(cpath) = c_path(path) else {
        return false;
    };
    for name in [c"trusted.overlay.opaque", c"user.overlay.opaque"] {
        let mut buf = [0u8; 4];
        // SAFETY: `cpath` and `name` are valid NUL-terminated strings that outlive the
        // call; `buf` is a writable buffer of exactly `buf.len()` bytes.
        let n = unsafe {
            libc::lgetxattr(
                cpath.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n >= 1 && buf[0] == b'y' {
            return true;
        }
    }
    false
}

#[allow(unsafe_code)] // lsetxattr: std has no xattr API
fn set_opaque_xattr(path: &Path) -> std::io::Result<()> {
    let cpath = c_path(path).ok_or_else(|| std::io::Error::from(ErrorKind::InvalidInput))?;
    // SAFETY: `cpath` and the attribute name are valid NUL-terminated strings; the
    // value pointer refers to 1 readable byte, matching the size argument.
    let rc = unsafe {
        libc::lsetxattr(
            cpath.as_ptr(),
            c"trusted.overlay.opaque".as_ptr(),
            b"y".as_ptr().cast(),
            1,
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Check a manifest before anything is written: paths relative and normalised, no
/// duplicates, nothing below a symlink or a non-directory, kinds consistent.
pub fn validate_manifest(m: &SnapshotManifest) -> Result<(), SnapshotError> {
    let invalid = |detail: String| SnapshotError::InvalidManifest {
        id: m.id.to_string(),
        detail,
    };
    let mut kinds: HashMap<&str, EntryKind> = HashMap::new();
    for (i, e) in m.entries.iter().enumerate() {
        if e.path.is_empty() {
            if i != 0 || e.kind != EntryKind::Dir {
                return Err(invalid(
                    "root entry must be the first entry and a directory".into(),
                ));
            }
        } else if !aviary_core::paths::is_clean_relative(&e.path) {
            return Err(SnapshotError::PathEscape {
                path: e.path.clone(),
            });
        }
        if kinds.insert(e.path.as_str(), e.kind).is_some() {
            return Err(invalid(format!("duplicate path {:?}", e.path)));
        }
        if e.kind != EntryKind::File && !e.chunks.is_empty() {
            return Err(invalid(format!(
                "{:?} has content but is not a file",
                e.path
            )));
        }
        if (e.kind == EntryKind::Symlink) != e.symlink_target.is_some() {
            return Err(invalid(format!("{:?}: symlink target mismatch", e.path)));
        }
        if e.symlink_target
            .as_deref()
            .is_some_and(|t| t.is_empty() || t.contains('\0'))
        {
            return Err(invalid(format!("{:?}: bad symlink target", e.path)));
        }
    }
    for e in &m.entries {
        let mut prefix = e.path.as_str();
        while let Some((parent, _)) = prefix.rsplit_once('/') {
            match kinds.get(parent) {
                Some(EntryKind::Dir) | None => {}
                Some(EntryKind::Symlink) => {
                    return Err(SnapshotError::PathEscape {
                        path: e.path.clone(),
                    })
                }
                Some(_) => return Err(invalid(format!("{:?} is below a non-directory", e.path))),
            }
            prefix = parent;
        }
    }
    Ok(())
}

/// Restore `manifest` into `target`, which must be missing or an empty directory.
#[tracing::instrument(skip_all, fields(snapshot = %manifest.id, target = %target.display()))]
pub async fn restore_dir(
    store: &dyn ChunkStore,
    manifest: &SnapshotManifest,
    target: &Path,
    opts: &RestoreOptions,
) -> Result<RestoreStats, SnapshotError> {
    validate_manifest(manifest)?;
    match std::fs::symlink_metadata(target) {
        Ok(md) if md.is_dir() => {
            let mut rd =
                std::fs::read_dir(target).map_err(|e| SnapshotError::file("list", target, e))?;
            if rd.next().is_some() {
                return Err(SnapshotError::TargetNotEmpty {
                    path: target.display().to_string(),
                });
            }
        }
        Ok(_) => {
            return Err(SnapshotError::TargetNotEmpty {
                path: target.display().to_string(),
            })
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {
            std::fs::create_dir(target).map_err(|e| SnapshotError::file("create", target, e))?;
        }
        Err(e) => return Err(SnapshotError::file("stat", target, e)),
    }

    let result = restore_into(store, manifest, target, opts).await;
    if result.is_err() {
        clear_dir(target);
    }
    result
}

async fn restore_into(
    store: &dyn ChunkStore,
    manifest: &SnapshotManifest,
    target: &Path,
    opts: &RestoreOptions,
) -> Result<RestoreStats, SnapshotError> {
    let (tx, rx) = mpsc::channel::<Vec<u8>>(CHANNEL_DEPTH);
    let writer = Writer {
        root: target.to_owned(),
        entries: manifest.entries.clone(),
        ownership: opts.restore_ownership,
        verified_dirs: HashSet::new(),
        rx,
    };
    let write = tokio::task::spawn_blocking(move || writer.run());
    let wanted = manifest
        .entries
        .iter()
        .filter(|e| e.kind == EntryKind::File)
        .flat_map(|e| e.chunks.iter());
    let fetched: Result<u64, SnapshotError> = stream::iter(wanted)
        .map(|hash| async move {
            let data = store.get(hash).await?;
            hash.verify(&data)?;
            Ok::<_, SnapshotError>(data)
        })
        .buffered(opts.fetch_concurrency.max(1))
        .try_fold(0u64, |n, data| {
            let tx = tx.clone();
            async move {
                // A closed channel means the writer failed; its error is reported below.
                let _ = tx.send(data).await;
                Ok(n + 1)
            }
        })
        .await;
    drop(tx);
    let written = write
        .await
        .map_err(|e| SnapshotError::backend(store.backend(), "join writer", e))?;
    let chunks_fetched = fetched?;
    let (entries, bytes) = written?;
    Ok(RestoreStats {
        entries,
        bytes,
        chunks_fetched,
    })
}

fn clear_dir(target: &Path) {
    let Ok(rd) = std::fs::read_dir(target) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let res = match e.file_type() {
            Ok(ft) if ft.is_dir() => std::fs::remove_dir_all(&p),
            _ => std::fs::remove_file(&p),
        };
        if let Err(err) = res {
            tracing::warn!(path = %p.display(), error = %err, "could not remove partly restored entry");
        }
    }
}

struct Writer {
    root: PathBuf,
    entries: Vec<Entry>,
    ownership: bool,
    verified_dirs: HashSet<String>,
    rx: mpsc::Receiver<Vec<u8>>,
}

impl Writer {
    fn run(mut self) -> Result<(u64, u64), SnapshotError> {
        let entries = std::mem::take(&mut self.entries);
        let mut bytes = 0u64;
        for e in entries
            .iter()
            .filter(|e| e.kind == EntryKind::Dir && !e.path.is_empty())
        {
            let p = self.prepare(&e.path)?;
            match std::fs::create_dir(&p) {
                Ok(()) => {}
                Err(err)
                    if err.kind() == ErrorKind::AlreadyExists
                        && self.verified_dirs.contains(&e.path) => {}
                Err(err) => return Err(SnapshotError::file("create", &p, err)),
            }
            self.verified_dirs.insert(e.path.clone());
        }
        for e in entries.iter().filter(|e| e.kind == EntryKind::File) {
            let p = self.prepare(&e.path)?;
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&p)
                .map_err(|err| SnapshotError::file("create", &p, err))?;
            let mut written = 0u64;
            for hash in &e.chunks {
                let Some(data) = self.rx.blocking_recv() else {
                    return Err(SnapshotError::not_found(format!(
                        "chunk {hash} (fetch stopped)"
                    )));
                };
                f.write_all(&data)
                    .map_err(|err| SnapshotError::file("write", &p, err))?;
                written += data.len() as u64;
            }
            if written != e.size {
                return Err(SnapshotError::InvalidManifest {
                    id: String::new(),
                    detail: format!(
                        "{:?}: chunks hold {written} bytes, entry says {}",
                        e.path, e.size
                    ),
                });
            }
            bytes += written;
        }
        for e in entries
            .iter()
            .filter(|e| matches!(e.kind, EntryKind::Fifo | EntryKind::Whiteout))
        {
            let p = self.prepare(&e.path)?;
            let res = if e.kind == EntryKind::Fifo {
                nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600))
            } else {
                nix::sys::stat::mknod(
                    &p,
                    nix::sys::stat::SFlag::S_IFCHR,
                    nix::sys::stat::Mode::from_bits_truncate(0o600),
                    0,
                )
            };
            res.map_err(|err| SnapshotError::file("create", &p, err.into()))?;
        }
        for e in entries.iter().filter(|e| e.kind == EntryKind::Symlink) {
            let p = self.prepare(&e.path)?;
            let target = e.symlink_target.as_deref().unwrap_or_default();
            std::os::unix::fs::symlink(target, &p)
                .map_err(|err| SnapshotError::file("create symlink", &p, err))?;
        }
        for e in entries.iter().filter(|e| e.kind != EntryKind::Dir) {
            self.apply_metadata(e)?;
        }
        let mut dirs: Vec<&Entry> = entries
            .iter()
            .filter(|e| e.kind == EntryKind::Dir)
            .collect();
        dirs.sort_by_key(|e| {
            std::cmp::Reverse(e.path.matches('/').count() + usize::from(!e.path.is_empty()))
        });
        for e in dirs {
            if e.opaque {
                let p = self.root.join(&e.path);
                set_opaque_xattr(&p)
                    .map_err(|err| SnapshotError::file("set opaque xattr on", &p, err))?;
            }
            self.apply_metadata(e)?;
        }
        Ok((entries.len() as u64, bytes))
    }

    /// The absolute path of `rel`, after checking every parent is a real directory
    /// (creating missing ones) so nothing can be redirected through a symlink.
    fn prepare(&mut self, rel: &str) -> Result<PathBuf, SnapshotError> {
        for (i, _) in rel.match_indices('/') {
            let parent = &rel[..i];
            if self.verified_dirs.contains(parent) {
                continue;
            }
            let p = self.root.join(parent);
            match std::fs::symlink_metadata(&p) {
                Ok(md) if md.file_type().is_dir() => {}
                Ok(_) => {
                    return Err(SnapshotError::PathEscape {
                        path: rel.to_owned(),
                    })
                }
                Err(err) if err.kind() == ErrorKind::NotFound => {
                    std::fs::create_dir(&p)
                        .map_err(|err| SnapshotError::file("create", &p, err))?;
                }
                Err(err) => return Err(SnapshotError::file("stat", &p, err)),
            }
            self.verified_dirs.insert(parent.to_owned());
        }
        Ok(self.root.join(rel))
    }

    fn apply_metadata(&self, e: &Entry) -> Result<(), SnapshotError> {
        let p = if e.path.is_empty() {
            self.root.clone()
        } else {
            self.root.join(&e.path)
        };
        if self.ownership {
            std::os::unix::fs::lchown(&p, Some(e.uid), Some(e.gid))
                .map_err(|err| SnapshotError::file("chown", &p, err))?;
        }
        if e.kind != EntryKind::Symlink {
            // After chown, which clears setuid/setgid bits.
            nix::sys::stat::fchmodat(
                None,
                &p,
                nix::sys::stat::Mode::from_bits_truncate(e.mode & 0o7777),
                nix::sys::stat::FchmodatFlags::FollowSymlink,
            )
            .map_err(|err| SnapshotError::file("chmod", &p, err.into()))?;
        }
        let ts = nix::sys::time::TimeSpec::new(
            e.mtime_ns.div_euclid(1_000_000_000),
            e.mtime_ns.rem_euclid(1_000_000_000),
        );
        nix::sys::stat::utimensat(
            None,
            &p,
            &ts,
            &ts,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .map_err(|err| SnapshotError::file("set times on", &p, err.into()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::local::LocalStore;
    use rand::{Rng, SeedableRng};
    use std::os::unix::fs::PermissionsExt;

    fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut v = vec![0u8; len];
        rng.fill(&mut v[..]);
        v
    }

    fn setup() -> (tempfile::TempDir, LocalStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path().join("store")).unwrap();
        (dir, store)
    }

    /// Everything a restore must reproduce, keyed by path.
    fn describe(root: &Path) -> Vec<(String, String)> {
        let mut out = Vec::new();
        fn walk(root: &Path, rel: &Path, out: &mut Vec<(String, String)>) {
            let mut names: Vec<_> = std::fs::read_dir(root.join(rel))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            names.sort();
            for n in names {
                let r = rel.join(&n);
                let p = root.join(&r);
                let md = std::fs::symlink_metadata(&p).unwrap();
                let ft = md.file_type();
                let what = if ft.is_symlink() {
                    format!("link->{}", std::fs::read_link(&p).unwrap().display())
                } else if ft.is_dir() {
                    format!("dir {:o} {}", md.mode() & 0o7777, md.mtime())
                } else if ft.is_file() {
                    let data = std::fs::read(&p).unwrap();
                    format!(
                        "file {:o} {} {} {}",
                        md.mode() & 0o7777,
                        data.len(),
                        ChunkHash::of(&data),
                        md.mtime()
                    )
                } else if ft.is_fifo() {
                    format!("fifo {:o}", md.mode() & 0o7777)
                } else {
                    format!("other {}", md.rdev())
                };
                out.push((r.display().to_string(), what));
                if ft.is_dir() {
                    walk(root, &r, out);
                }
            }
        }
        walk(root, Path::new(""), &mut out);
        out
    }

    fn build_tree(src: &Path) {
        std::fs::create_dir_all(src.join("a/b/c")).unwrap();
        std::fs::create_dir(src.join("empty")).unwrap();
        std::fs::write(src.join("zero"), b"").unwrap();
        std::fs::write(src.join("one"), b"x").unwrap();
        std::fs::write(src.join("a/big.bin"), random_bytes(1, 10 * 1024 * 1024)).unwrap();
        std::fs::write(src.join("a/b/mid.bin"), random_bytes(2, 700_000)).unwrap();
        for i in 0..50 {
            std::fs::write(
                src.join(format!("a/b/c/text{i}.txt")),
                format!("line {i}\n").repeat(i * 40),
            )
            .unwrap();
        }
        std::fs::write(src.join("run.sh"), b"#!/bin/sh\necho hi\n").unwrap();
        std::fs::set_permissions(src.join("run.sh"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        std::fs::set_permissions(src.join("one"), std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::set_permissions(src.join("empty"), std::fs::Permissions::from_mode(0o750))
            .unwrap();
        std::os::unix::fs::symlink("a/big.bin", src.join("link-rel")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", src.join("a/link-abs")).unwrap();
        std::os::unix::fs::symlink("missing", src.join("dangling")).unwrap();
        nix::unistd::mkfifo(
            &src.join("pipe"),
            nix::sys::stat::Mode::from_bits_truncate(0o640),
        )
        .unwrap();
    }

    #[tokio::test]
    async fn round_trip_reproduces_files_links_dirs_and_modes() {
        let (dir, store) = setup();
        let src = dir.path().join("src");
        build_tree(&src);
        let m = snapshot_dir(&store, &src, SnapshotRequest::new("t", "ws"))
            .await
            .unwrap();
        assert_eq!(
            m.new_bytes, m.total_bytes,
            "first snapshot writes everything once"
        );
        assert!(m.total_bytes > 10 * 1024 * 1024);
        let out = dir.path().join("out");
        let stats = restore_dir(&store, &m, &out, &RestoreOptions::default())
            .await
            .unwrap();
        assert_eq!(stats.bytes, m.total_bytes);
        assert_eq!(describe(&src), describe(&out));
        let md = std::fs::symlink_metadata(&out).unwrap();
        assert_eq!(
            md.mode() & 0o7777,
            std::fs::symlink_metadata(&src).unwrap().mode() & 0o7777
        );
        // A second restore into a non-empty target is refused.
        let err = restore_dir(&store, &m, &out, &RestoreOptions::default())
            .await
            .unwrap_err();
        assert!(matches!(err, SnapshotError::TargetNotEmpty { .. }), "{err}");
    }

    #[tokio::test]
    async fn second_snapshot_writes_only_changed_chunks() {
        let (dir, store) = setup();
        let src = dir.path().join("src");
        build_tree(&src);
        let first = snapshot_dir(&store, &src, SnapshotRequest::new("t", "ws"))
            .await
            .unwrap();
        // Change a few bytes in the middle of the 10 MiB file, append to a text file,
        // add a small file.
        let big = src.join("a/big.bin");
        let mut data = std::fs::read(&big).unwrap();
        data[5_000_000..5_000_100].fill(7);
        std::fs::write(&big, &data).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(src.join("a/b/c/text3.txt"))
            .unwrap()
            .write_all(b"more\n")
            .unwrap();
        std::fs::write(src.join("new.txt"), b"fresh").unwrap();

        let second = snapshot_dir(
            &store,
            &src,
            SnapshotRequest::new("t", "ws").parent(first.id.clone()),
        )
        .await
        .unwrap();
        assert_eq!(second.parent.as_ref(), Some(&first.id));
        assert!(
            second.new_bytes <= 2 * 4 * 1024 * 1024 + 4096,
            "incremental wrote {} bytes",
            second.new_bytes
        );
        assert!(second.new_bytes > 0);
        let out = dir.path().join("out");
        restore_dir(&store, &second, &out, &RestoreOptions::default())
            .await
            .unwrap();
        assert_eq!(describe(&src), describe(&out));
        // Without a parent nothing is trusted unread, and still nothing new is written.
        let third = snapshot_dir(&store, &src, SnapshotRequest::new("t", "ws"))
            .await
            .unwrap();
        assert_eq!(third.new_bytes, 0);
        assert_eq!(third.read_bytes, third.total_bytes);
    }

    #[tokio::test]
    async fn parent_skips_reading_unchanged_files_but_sees_changes() {
        let (dir, store) = setup();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        std::fs::write(src.join("stable"), random_bytes(3, 300_000)).unwrap();
        std::fs::write(src.join("edited"), b"version 1").unwrap();
        // Make the files look older than the racy window.
        let old = nix::sys::time::TimeSpec::new(1_600_000_000, 0);
        for f in ["stable", "edited"] {
            nix::sys::stat::utimensat(
                None,
                &src.join(f),
                &old,
                &old,
                nix::sys::stat::UtimensatFlags::NoFollowSymlink,
            )
            .unwrap();
        }
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let first = snapshot_dir(&store, &src, SnapshotRequest::new("t", "ws"))
            .await
            .unwrap();
        // Same size, and mtime forced back: only ctime betrays the change.
        std::fs::write(src.join("edited"), b"version 2").unwrap();
        nix::sys::stat::utimensat(
            None,
            &src.join("edited"),
            &old,
            &old,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();
        let second = snapshot_dir(
            &store,
            &src,
            SnapshotRequest::new("t", "ws").parent(first.id.clone()),
        )
        .await
        .unwrap();
        assert_eq!(second.read_bytes, 9, "only the edited file is read");
        let out = dir.path().join("out");
        restore_dir(&store, &second, &out, &RestoreOptions::default())
            .await
            .unwrap();
        assert_eq!(std::fs::read(out.join("edited")).unwrap(), b"version 2");
        assert_eq!(
            std::fs::read(out.join("stable")).unwrap(),
            random_bytes(3, 300_000)
        );
    }

    #[tokio::test]
    async fn fork_from_a_checkpoint_does_not_touch_the_parent() {
        let (dir, store) = setup();
        let src = dir.path().join("src");
        build_tree(&src);
        let base = snapshot_dir(&store, &src, SnapshotRequest::new("t", "ws"))
            .await
            .unwrap();
        let fork = dir.path().join("fork");
        restore_dir(&store, &base, &fork, &RestoreOptions::default())
            .await
            .unwrap();
        std::fs::write(fork.join("one"), b"changed in the fork").unwrap();
        std::fs::remove_dir_all(fork.join("a/b/c")).unwrap();
        let child = snapshot_dir(
            &store,
            &fork,
            SnapshotRequest::new("t", "ws").parent(base.id.clone()),
        )
        .await
        .unwrap();
        assert_eq!(child.parent.as_ref(), Some(&base.id));
        assert!(
            child.new_bytes < 100,
            "fork wrote {} new bytes",
            child.new_bytes
        );
        // The parent still restores to the original tree, the child to the fork.
        let p = dir.path().join("parent-again");
        restore_dir(
            &store,
            &store.get_manifest("t", &base.id).await.unwrap(),
            &p,
            &RestoreOptions::default(),
        )
        .await
        .unwrap();
        assert_eq!(describe(&src), describe(&p));
        let c = dir.path().join("child");
        restore_dir(&store, &child, &c, &RestoreOptions::default())
            .await
            .unwrap();
        assert_eq!(describe(&fork), describe(&c));
        assert_eq!(
            std::fs::read(c.join("one")).unwrap(),
            b"changed in the fork"
        );
    }

    #[tokio::test]
    async fn parent_of_another_tenant_is_not_found() {
        let (dir, store) = setup();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        let m = snapshot_dir(&store, &src, SnapshotRequest::new("tenant-a", "ws"))
            .await
            .unwrap();
        let err = snapshot_dir(
            &store,
            &src,
            SnapshotRequest::new("tenant-b", "ws").parent(m.id),
        )
        .await
        .unwrap_err();
        assert!(err.is_not_found(), "{err}");
    }

    fn entry(path: &str, kind: EntryKind) -> Entry {
        Entry {
            path: path.into(),
            kind,
            mode: 0o644,
            uid: 0,
            gid: 0,
            size: 0,
            mtime_ns: 0,
            ctime_ns: 0,
            ino: 0,
            chunks: Vec::new(),
            symlink_target: None,
            opaque: false,
        }
    }

    fn manifest_of(entries: Vec<Entry>) -> SnapshotManifest {
        SnapshotManifest {
            id: SnapshotId::generate(),
            parent: None,
            created_at: aviary_core::now(),
            tenant: "t".into(),
            sandbox_id: None,
            label: "ws".into(),
            entries,
            total_bytes: 0,
            new_bytes: 0,
            new_chunks: 0,
            read_bytes: 0,
        }
    }

    #[tokio::test]
    async fn malicious_manifests_cannot_escape_the_target() {
        let (dir, store) = setup();
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let mut link = entry("evil", EntryKind::Symlink);
        link.symlink_target = Some(outside.display().to_string());
        let cases = vec![
            vec![entry("../escaped", EntryKind::File)],
            vec![entry("/tmp/abs", EntryKind::File)],
            vec![entry("a/../../x", EntryKind::File)],
            vec![entry("a//b", EntryKind::File)],
            vec![entry("./x", EntryKind::File)],
            vec![link.clone(), entry("evil/pwned", EntryKind::File)],
            vec![
                link,
                entry("evil/sub", EntryKind::Dir),
                entry("evil/sub/x", EntryKind::File),
            ],
        ];
        for (i, entries) in cases.into_iter().enumerate() {
            let m = manifest_of(entries);
            let out = dir.path().join(format!("out{i}"));
            let err = restore_dir(&store, &m, &out, &RestoreOptions::default())
                .await
                .unwrap_err();
            assert!(
                matches!(err, SnapshotError::PathEscape { .. }),
                "case {i}: {err}"
            );
        }
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        assert!(!dir.path().join("escaped").exists());

        // Duplicates (e.g. a file then a symlink of the same name) are refused too.
        let mut dup_link = entry("x", EntryKind::Symlink);
        dup_link.symlink_target = Some("/etc".into());
        let m = manifest_of(vec![entry("x", EntryKind::File), dup_link]);
        let err = restore_dir(
            &store,
            &m,
            &dir.path().join("dup"),
            &RestoreOptions::default(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, SnapshotError::InvalidManifest { .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn lying_entry_size_fails_and_cleans_up() {
        let (dir, store) = setup();
        let data = b"twelve bytes".to_vec();
        let h = ChunkHash::of(&data);
        store.put(&h, data).await.unwrap();
        let mut f = entry("f", EntryKind::File);
        f.chunks = vec![h];
        f.size = 100;
        let out = dir.path().join("out");
        let err = restore_dir(
            &store,
            &manifest_of(vec![f]),
            &out,
            &RestoreOptions::default(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, SnapshotError::InvalidManifest { .. }),
            "{err}"
        );
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn overlay_whiteouts_and_opaque_dirs_round_trip() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: whiteouts (mknod) and trusted.* xattrs need root");
            return;
        }
        let (dir, store) = setup();
        let src = dir.path().join("upper");
        std::fs::create_dir_all(src.join("opaque-dir")).unwrap();
        nix::sys::stat::mknod(
            &src.join("deleted"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            0,
        )
        .unwrap();
        set_opaque_xattr(&src.join("opaque-dir")).unwrap();
        let m = snapshot_dir(&store, &src, SnapshotRequest::new("t", "upper"))
            .await
            .unwrap();
        let wo = m.entries.iter().find(|e| e.path == "deleted").unwrap();
        assert_eq!(wo.kind, EntryKind::Whiteout);
        assert!(
            m.entries
                .iter()
                .find(|e| e.path == "opaque-dir")
                .unwrap()
                .opaque
        );
        let out = dir.path().join("out");
        restore_dir(&store, &m, &out, &RestoreOptions::default())
            .await
            .unwrap();
        let md = std::fs::symlink_metadata(out.join("deleted")).unwrap();
        assert!(md.file_type().is_char_device() && md.rdev() == 0);
        assert!(has_opaque_xattr(&out.join("opaque-dir")));
        assert!(!has_opaque_xattr(&out));
    }
}
