//! Change tracking below the file level: reflink shadows.
//!
//! On a filesystem with reflinks (XFS with `reflink=1`, btrfs), a snapshot given a
//! shadow directory (host-only, on the same filesystem as the tree, outside it)
//! clones every large file it reads (`FICLONE`: instant, no data copied) into that
//! directory and chunks the *clone*, never the live file: the clone is a
//! point-in-time copy the sandbox cannot touch, and the manifest's chunks describe
//! exactly its bytes. The clone is kept as the file's shadow, with its chunk list
//! and chunk lengths in the shadow index.
//!
//! At the next snapshot, a changed file is cloned again and the two clones' extent
//! maps (`FIEMAP`) are compared: a byte range mapped to the same physical blocks in
//! both is unchanged (copy-on-write never rewrites a block two files share).
//! Everything else is dirty: different blocks, holes, appended bytes, and any extent
//! whose flags make its mapping uncertain (unknown, delayed allocation, encoded,
//! encrypted, inline, tail-packed, unwritten). Parent chunks that lie wholly in clean
//! ranges — and far enough from either end of the file that the chunker's cut there
//! cannot depend on the file size — are reused unread; the chunker restarts at the
//! first other chunk and runs until one of its cuts lands on a reusable parent
//! boundary again. The chunk list is therefore the one a full re-read would produce.
//!
//! Trust: the shadow index is used for a file only when its chunk list equals the
//! parent manifest's entry for that path (so every chunk it names is in the store,
//! held by the parent) and the shadow file's size matches. Anything unexpected —
//! no reflink support, a clone or `FIEMAP` error, too many extents, a corrupt index —
//! falls back to reading the whole file, as without a shadow.
//!
//! Space: a shadow shares its blocks with the live file until the file is written;
//! from then on it pins the old blocks, so shadows cost up to the bytes changed
//! since the last snapshot (plus files deleted since). When the filesystem has less
//! than [`MIN_FREE_PERCENT`] free, a snapshot drops all shadows and reads in full.
//!
//! Layout: `<shadow>/index.json` and `<shadow>/files/<generation>-<n>`. Names never
//! derive from the (attacker-chosen) tree paths. A snapshot writes new clones under a
//! fresh generation, replaces the index only after its manifest is stored, then
//! deletes every file the new index does not name; an aborted snapshot deletes its
//! own clones. Only one snapshot uses a shadow directory at a time: `ShadowSet::open`
//! waits for an exclusive `flock` on it, held until the set is committed or dropped
//! (two snapshots of one sandbox at once take turns on its shadows).

use crate::chunker::ChunkerConfig;
use crate::hash::ChunkHash;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Files smaller than this are read whole (cloning costs more than reading them).
pub(crate) const MIN_SHADOW_SIZE: u64 = 1024 * 1024;
/// Below this much free space (percent of the filesystem) shadows are dropped.
pub const MIN_FREE_PERCENT: u64 = 10;
/// Extents examined per file before giving up and reading it whole.
const MAX_EXTENTS: usize = 1 << 20;
const INDEX: &str = "index.json";
const FILES: &str = "files";

/// One shadowed file: its clone and the chunks of the clone's bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ShadowEntry {
    pub name: String,
    pub size: u64,
    pub chunks: Vec<(ChunkHash, u64)>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Index {
    generation: u64,
    files: HashMap<String, ShadowEntry>,
}

/// The shadow directory during one snapshot.
pub(crate) struct ShadowSet {
    dir: PathBuf,
    files: PathBuf,
    old: Index,
    generation: u64,
    next: AtomicU64,
    /// Clones allowed (filesystem supports them and has room).
    enabled: AtomicBool,
    new: Mutex<HashMap<String, ShadowEntry>>,
    /// Clones made by this snapshot (deleted unless committed).
    created: Mutex<Vec<PathBuf>>,
    committed: bool,
    /// Exclusive `flock` on the directory, released with the set.
    _lock: nix::fcntl::Flock<File>,
}

impl ShadowSet {
    /// Open (creating if needed) the shadow directory for a snapshot of `root`.
    /// Refuses a shadow directory inside the tree or containing it.
    pub fn open(dir: &Path, root: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir.join(FILES))?;
        let lock = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(dir)?;
        let lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| std::io::Error::from(e))?;
        let (cdir, croot) = (dir.canonicalize()?, root.canonicalize()?);
        if cdir.starts_with(&croot) || croot.starts_with(&cdir) {
            return Err(std::io::Error::new(
                ErrorKind::InvalidInput,
                "the shadow directory must be outside the snapshotted tree",
            ));
        }
        let old: Index = std::fs::read(dir.join(INDEX))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let enabled = free_percent(dir).is_some_and(|p| p >= MIN_FREE_PERCENT);
        if !enabled {
            tracing::info!(dir = %dir.display(), "filesystem nearly full: dropping snapshot shadows");
        }
        Ok(ShadowSet {
            dir: dir.to_owned(),
            files: dir.join(FILES),
            generation: old.generation + 1,
            old: if enabled { old } else { Index::default() },
            next: AtomicU64::new(0),
            enabled: AtomicBool::new(enabled),
            new: Mutex::new(HashMap::new()),
            created: Mutex::new(Vec::new()),
            committed: false,
            _lock: lock,
        })
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Clone `src` into a new shadow file. `Ok(None)`: this filesystem cannot clone
    /// (shadows are then off for the rest of the snapshot).
    pub fn clone_new(&self, src: &File) -> std::io::Result<Option<(String, File)>> {
        let name = format!(
            "{}-{}",
            self.generation,
            self.next.fetch_add(1, Ordering::Relaxed)
        );
        let path = self.files.join(&name);
        let dst = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?;
        self.created.lock().expect("poisoned").push(path.clone());
        match ficlone(&dst, src) {
            Ok(()) => Ok(Some((name, dst))),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                match e.raw_os_error() {
                    Some(libc::EXDEV | libc::EOPNOTSUPP | libc::EINVAL | libc::ENOTTY) => {
                        self.enabled.store(false, Ordering::Relaxed);
                        Ok(None)
                    }
                    _ => Err(e),
                }
            }
        }
    }

    /// The previous shadow of `path`, if it holds exactly `parent_chunks`.
    pub fn previous(
        &self,
        path: &str,
        parent_chunks: &[ChunkHash],
    ) -> Option<(File, &ShadowEntry)> {
        let e = self.old.files.get(path)?;
        if e.chunks.len() != parent_chunks.len()
            || e.chunks.iter().zip(parent_chunks).any(|((h, _), p)| h != p)
            || e.chunks.iter().map(|c| c.1).sum::<u64>() != e.size
            || !valid_name(&e.name)
        {
            return None;
        }
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.files.join(&e.name))
            .ok()?;
        let md = f.metadata().ok()?;
        (md.is_file() && md.len() == e.size).then_some((f, e))
    }

    /// Keep the previous shadow of an unchanged file, if it holds `chunks`.
    pub fn carry(&self, path: &str, chunks: &[ChunkHash]) {
        if let Some(e) = self.old.files.get(path) {
            if e.chunks.len() == chunks.len() && e.chunks.iter().zip(chunks).all(|(a, b)| &a.0 == b)
            {
                self.record(path, e.clone());
            }
        }
    }

    pub fn record(&self, path: &str, entry: ShadowEntry) {
        self.new
            .lock()
            .expect("poisoned")
            .insert(path.to_owned(), entry);
    }

    /// Make this snapshot's shadows current and delete all others.
    pub fn commit(mut self) -> std::io::Result<()> {
        let files = std::mem::take(&mut *self.new.lock().expect("poisoned"));
        let index = Index {
            generation: self.generation,
            files,
        };
        let tmp = self.dir.join("index.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&index).expect("index serializes"))?;
        std::fs::rename(&tmp, self.dir.join(INDEX))?;
        self.committed = true;
        let keep: std::collections::HashSet<&str> =
            index.files.values().map(|e| e.name.as_str()).collect();
        for entry in std::fs::read_dir(&self.files)? {
            let entry = entry?;
            if !entry.file_name().to_str().is_some_and(|n| keep.contains(n)) {
                std::fs::remove_file(entry.path())?;
            }
        }
        Ok(())
    }
}

impl Drop for ShadowSet {
    fn drop(&mut self) {
        if !self.committed {
            for p in self.created.lock().expect("poisoned").drain(..) {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit() || b == b'-')
}

/// Free space of the filesystem holding `dir`, in percent.
fn free_percent(dir: &Path) -> Option<u64> {
    let st = nix::sys::statvfs::statvfs(dir).ok()?;
    let blocks = st.blocks() as u64;
    (blocks > 0).then(|| st.blocks_available() as u64 * 100 / blocks)
}

/// `ioctl(dst, FICLONE, src)`: make `dst` share all of `src`'s blocks.
#[allow(unsafe_code)] // FICLONE: std has no reflink API
fn ficlone(dst: &File, src: &File) -> std::io::Result<()> {
    // SAFETY: both descriptors are open for the duration of the call (borrowed
    // `File`s); FICLONE takes the source descriptor as its integer argument and
    // touches no user memory.
    let rc = unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONE, src.as_raw_fd()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One mapped extent, as `FIEMAP` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Extent {
    pub logical: u64,
    pub physical: u64,
    pub length: u64,
    /// Mapping known, on disk, plain (not encoded, inline, delayed or unwritten).
    pub trusted: bool,
}

const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// UNKNOWN | DELALLOC | ENCODED | DATA_ENCRYPTED | NOT_ALIGNED | DATA_INLINE |
/// DATA_TAIL | UNWRITTEN.
const FIEMAP_UNTRUSTED: u32 = 0x2 | 0x4 | 0x8 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800;
const BATCH: usize = 256;

/// `struct fiemap` followed by room for [`BATCH`] `struct fiemap_extent`s
/// (linux/fiemap.h).
#[repr(C)]
struct FiemapBuf {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
    extents: [FiemapExtent; BATCH],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct FiemapExtent {
    fe_logical: u64,
    fe_physical: u64,
    fe_length: u64,
    fe_reserved64: [u64; 2],
    fe_flags: u32,
    fe_reserved: [u32; 3],
}

/// `FS_IOC_FIEMAP` = `_IOWR('f', 11, struct fiemap)` (the header is 32 bytes).
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;

/// The extents of `file` over `[0, size)`, flushed first (`FIEMAP_FLAG_SYNC`).
/// `None` when there are more than [`MAX_EXTENTS`] or the kernel says nothing sane.
#[allow(unsafe_code)] // FS_IOC_FIEMAP: std has no extent-map API
pub(crate) fn extents(file: &File, size: u64) -> std::io::Result<Option<Vec<Extent>>> {
    let empty = FiemapExtent {
        fe_logical: 0,
        fe_physical: 0,
        fe_length: 0,
        fe_reserved64: [0; 2],
        fe_flags: 0,
        fe_reserved: [0; 3],
    };
    let mut buf = Box::new(FiemapBuf {
        fm_start: 0,
        fm_length: 0,
        fm_flags: 0,
        fm_mapped_extents: 0,
        fm_extent_count: 0,
        fm_reserved: 0,
        extents: [empty; BATCH],
    });
    let mut out: Vec<Extent> = Vec::new();
    let mut start = 0u64;
    while start < size {
        buf.fm_start = start;
        buf.fm_length = size - start;
        buf.fm_flags = FIEMAP_FLAG_SYNC;
        buf.fm_mapped_extents = 0;
        buf.fm_extent_count = BATCH as u32;
        // SAFETY: `buf` is a live, exclusively borrowed `struct fiemap` with room for
        // exactly `fm_extent_count` extents after its header, as the ioctl expects;
        // the kernel writes at most that many.
        let rc = unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                FS_IOC_FIEMAP as _,
                std::ptr::from_mut::<FiemapBuf>(&mut buf),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = (buf.fm_mapped_extents as usize).min(BATCH);
        if n == 0 {
            break;
        }
        let mut last = false;
        for x in &buf.extents[..n] {
            let end = x.fe_logical.checked_add(x.fe_length);
            // Extents must come sorted, non-overlapping and move forward.
            if x.fe_length == 0
                || end.is_none()
                || out
                    .last()
                    .is_some_and(|p| p.logical + p.length > x.fe_logical)
                || x.fe_logical + x.fe_length <= start
            {
                return Ok(None);
            }
            out.push(Extent {
                logical: x.fe_logical,
                physical: x.fe_physical,
                length: x.fe_length,
                trusted: x.fe_flags & FIEMAP_UNTRUSTED == 0,
            });
            last |= x.fe_flags & FIEMAP_EXTENT_LAST != 0;
        }
        if out.len() > MAX_EXTENTS {
            return Ok(None);
        }
        if last {
            break;
        }
        let p = out.last().expect("n > 0");
        start = p.logical + p.length;
    }
    Ok(Some(out))
}

/// Byte ranges of the new file (`[0, new_size)`) not proven equal to the old file:
/// the complement of the ranges both map to the same physical blocks through trusted
/// extents, within `[0, min(old_size, new_size))`.
pub(crate) fn dirty_ranges(
    old: &[Extent],
    old_size: u64,
    new: &[Extent],
    new_size: u64,
) -> Vec<Range<u64>> {
    let limit = old_size.min(new_size);
    let mut clean: Vec<Range<u64>> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < old.len() && j < new.len() {
        let (a, b) = (&old[i], &new[j]);
        let lo = a.logical.max(b.logical);
        let hi = (a.logical + a.length).min(b.logical + b.length).min(limit);
        if lo < hi
            && a.trusted
            && b.trusted
            && a.physical.wrapping_sub(a.logical) == b.physical.wrapping_sub(b.logical)
        {
            match clean.last_mut() {
                Some(c) if c.end == lo => c.end = hi,
                _ => clean.push(lo..hi),
            }
        }
        if a.logical + a.length <= b.logical + b.length {
            i += 1;
        } else {
            j += 1;
        }
    }
    let mut dirty = Vec::new();
    let mut pos = 0;
    for c in clean {
        if c.start > pos {
            dirty.push(pos..c.start);
        }
        pos = c.end;
    }
    if pos < new_size {
        dirty.push(pos..new_size);
    }
    dirty
}

/// Which old chunks may be reused unread in the new file: chunks overlapping no dirty
/// range whose cut the chunker would make identically in the new file — the whole
/// file if its size is unchanged, else only chunks starting at least one maximum
/// chunk before the smaller end (near the end the cut depends on the bytes left).
pub(crate) fn reusable(
    old: &[(ChunkHash, u64)],
    new_size: u64,
    dirty: &[Range<u64>],
    cfg: &ChunkerConfig,
) -> Vec<bool> {
    let old_size: u64 = old.iter().map(|c| c.1).sum();
    let mut out = Vec::with_capacity(old.len());
    let mut off = 0u64;
    let mut d = 0;
    for (_, len) in old {
        let (start, end) = (off, off + len);
        off = end;
        while d < dirty.len() && dirty[d].end <= start {
            d += 1;
        }
        let overlaps = d < dirty.len() && dirty[d].start < end;
        let in_place = if old_size == new_size {
            end <= new_size
        } else {
            start + cfg.max_size as u64 <= old_size.min(new_size)
        };
        out.push(!overlaps && in_place && *len > 0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_snapshot_at_a_time_uses_a_shadow_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, root) = (tmp.path().join("shadow"), tmp.path().join("tree"));
        std::fs::create_dir(&root).unwrap();
        let try_lock = || {
            let f = File::open(&dir).unwrap();
            nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).map(drop)
        };
        let first = ShadowSet::open(&dir, &root).unwrap();
        // another snapshot's open would wait: the lock is taken
        assert_eq!(
            try_lock().map_err(|(_, e)| e),
            Err(nix::errno::Errno::EWOULDBLOCK)
        );
        drop(first);
        assert!(try_lock().is_ok(), "released with the set");
        let second = ShadowSet::open(&dir, &root).unwrap();
        second.commit().unwrap();
        assert!(try_lock().is_ok(), "released by commit");
    }

    fn ext(logical: u64, physical: u64, length: u64) -> Extent {
        Extent {
            logical,
            physical,
            length,
            trusted: true,
        }
    }

    #[test]
    fn shared_extents_are_clean_and_the_rest_dirty() {
        let old = [ext(0, 1000, 100), ext(100, 5000, 100)];
        // The second half of the first extent was rewritten elsewhere, and 50 bytes
        // were appended.
        let new = [ext(0, 1000, 50), ext(50, 9000, 50), ext(100, 5000, 150)];
        assert_eq!(dirty_ranges(&old, 200, &new, 250), vec![50..100, 200..250]);
        // Untrusted extents are dirty even when their blocks match.
        let mut delalloc = new;
        delalloc[2].trusted = false;
        assert_eq!(dirty_ranges(&old, 200, &delalloc, 250), vec![50..250]);
        // Holes in either file are dirty; truncation leaves nothing past the end.
        let holey = [ext(0, 1000, 20), ext(60, 1060, 40)];
        assert_eq!(dirty_ranges(&old, 200, &holey, 80), vec![20..60]);
        // Same blocks at a different logical offset are different content.
        let moved = [ext(100, 1000, 100)];
        assert_eq!(dirty_ranges(&old, 200, &moved, 200), vec![0..200]);
        assert_eq!(dirty_ranges(&[], 0, &[], 0), Vec::<Range<u64>>::new());
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one dirty range each
    fn reusable_chunks_avoid_dirty_ranges_and_size_dependent_cuts() {
        let cfg = ChunkerConfig {
            min_size: 64,
            avg_size: 256,
            max_size: 1024,
        };
        let h = ChunkHash::of(b"x");
        let old: Vec<(ChunkHash, u64)> = [500u64, 500, 500, 500, 500, 500]
            .iter()
            .map(|l| (h.clone(), *l))
            .collect();
        // Same size: only the chunk holding the edit is re-chunked.
        assert_eq!(
            reusable(&old, 3000, &[1200..1300], &cfg),
            vec![true, true, false, true, true, true]
        );
        // Grown: chunks within max_size of the old end are re-chunked too.
        assert_eq!(
            reusable(&old, 3100, &[3000..3100], &cfg),
            vec![true, true, true, true, false, false]
        );
        // An edit spanning a boundary dirties both neighbours.
        assert_eq!(
            reusable(&old, 3000, &[999..1001], &cfg),
            vec![true, false, false, true, true, true]
        );
    }
}
