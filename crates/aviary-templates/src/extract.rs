//! Applying untrusted image layers (tar streams) to a rootfs directory.
//!
//! Invariants, for any input:
//! - nothing is ever written outside `root`: entry paths and hard-link targets
//!   must be relative without `..`; every parent component is checked with
//!   `lstat` to be a real directory inside `root` (a symlink in a parent
//!   position is an error, never followed); files are created with
//!   `O_CREAT|O_EXCL` after removing whatever was at the path, so an existing
//!   symlink is replaced, not written through;
//! - hard links may only point at an existing non-directory already inside
//!   `root`;
//! - character and block devices are skipped (the runtime provides `/dev`);
//!   fifos are created; sparse files and unknown entry types are rejected;
//! - setuid/setgid bits are kept (images rely on them, e.g. `su`); the store
//!   keeps rootfs trees below a 0700 directory so host users cannot reach them,
//!   and sandboxes run them under no-new-privileges;
//! - the decompressed size and the entry count are bounded by [`ImportLimits`].
//!
//! The lstat walk is race-free because the target is a private staging
//! directory that only this thread writes while the import runs.
//!
//! OCI whiteouts: `.wh.NAME` deletes `NAME` from lower layers, `.wh..wh..opq`
//! empties its directory of everything that lower layers put there; other
//! `.wh..wh.*` entries (aufs bookkeeping) are ignored.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::fs::{self, OpenOptions};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use tar::EntryType;

use crate::error::{remove_err, write_err, IoContext, TemplateError};

/// Bounds on what one import may unpack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImportLimits {
    /// Total decompressed bytes of all layer streams (tar headers included).
    pub max_total_bytes: u64,
    /// Total tar entries over all layers.
    pub max_entries: u64,
}

impl Default for ImportLimits {
    /// 8 GiB and one million entries.
    fn default() -> Self {
        ImportLimits {
            max_total_bytes: 8 << 30,
            max_entries: 1_000_000,
        }
    }
}

/// What is left of the limits while an import runs.
#[derive(Debug)]
pub(crate) struct Budget {
    pub(crate) bytes_left: Cell<u64>,
    pub(crate) entries_left: Cell<u64>,
    pub(crate) limits: ImportLimits,
}

impl Budget {
    pub(crate) fn new(limits: ImportLimits) -> Self {
        Budget {
            bytes_left: Cell::new(limits.max_total_bytes),
            entries_left: Cell::new(limits.max_entries),
            limits,
        }
    }

    /// Charges `n` decompressed bytes; an error once the limit is passed.
    pub(crate) fn charge_bytes(&self, n: u64) -> io::Result<()> {
        let left = self.bytes_left.get();
        if n > left {
            return Err(io::Error::other(format!(
                "decompressed size exceeds the limit of {} bytes",
                self.limits.max_total_bytes
            )));
        }
        self.bytes_left.set(left - n);
        Ok(())
    }
}

/// Directory metadata applied after all layers, so that a read-only directory
/// mode never blocks writing its children.
#[derive(Default)]
pub(crate) struct DeferredDirs {
    dirs: HashMap<PathBuf, Meta>,
}

#[derive(Clone, Copy)]
struct Meta {
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: u64,
}

/// Counters for the caller's log line.
#[derive(Debug, Default)]
pub(crate) struct LayerStats {
    pub(crate) entries: u64,
    pub(crate) skipped_devices: u64,
}

pub(crate) fn is_root_user() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Normalizes an archive path: strips `./`, rejects absolute paths and `..`.
/// Returns an empty path for the root itself.
pub(crate) fn normalize(raw: &Path, what: &str) -> Result<PathBuf, TemplateError> {
    let mut out = PathBuf::new();
    for c in raw.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err(TemplateError::invalid(format!(
                    "{what} {} is absolute",
                    raw.display()
                )))
            }
            Component::ParentDir => {
                return Err(TemplateError::invalid(format!(
                    "{what} {} contains `..`",
                    raw.display()
                )))
            }
        }
    }
    Ok(out)
}

/// Applies one layer (an uncompressed tar stream) on top of `root`.
pub(crate) fn apply_layer(
    root: &Path,
    layer: impl Read,
    layer_name: &str,
    budget: &Budget,
    deferred: &mut DeferredDirs,
) -> Result<LayerStats, TemplateError> {
    let mut archive = tar::Archive::new(layer);
    let mut stats = LayerStats::default();
    let mut written: HashSet<PathBuf> = HashSet::new();
    let as_root = is_root_user();
    let bad = |e: io::Error| TemplateError::invalid(format!("layer {layer_name}: {e}"));
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let left = budget.entries_left.get();
        if left == 0 {
            return Err(TemplateError::invalid(format!(
                "more than {} entries",
                budget.limits.max_entries
            )));
        }
        budget.entries_left.set(left - 1);
        stats.entries += 1;

        let raw_path = entry.path().map_err(bad)?.into_owned();
        let rel = normalize(&raw_path, "entry")?;
        let kind = entry.header().entry_type();
        if matches!(kind, EntryType::XGlobalHeader | EntryType::XHeader) {
            continue;
        }
        let Some(file_name) = rel.file_name().map(|n| n.to_os_string()) else {
            // The root directory entry ("./"): its metadata is the store's choice.
            continue;
        };
        let parent_rel = rel.parent().unwrap_or(Path::new("")).to_path_buf();
        let name = file_name.as_bytes();

        if name.starts_with(b".wh.") {
            let parent = ensure_parent(root, &rel, &mut written)?;
            if name == b".wh..wh..opq" {
                clear_lower(&parent_rel, &parent, &written)?;
            } else if !name.starts_with(b".wh..wh.") {
                let victim = parent.join(OsStr::from_bytes(&name[4..]));
                remove_any(&victim)?;
            }
            continue;
        }

        let header = entry.header();
        let meta = Meta {
            mode: header.mode().map_err(bad)? & 0o7777,
            uid: header.uid().map_err(bad)?,
            gid: header.gid().map_err(bad)?,
            mtime: header.mtime().unwrap_or(0),
        };

        match kind {
            EntryType::Char | EntryType::Block => {
                stats.skipped_devices += 1;
                continue;
            }
            EntryType::GNUSparse => {
                return Err(TemplateError::invalid(format!(
                    "{}: sparse files are not supported",
                    raw_path.display()
                )))
            }
            EntryType::Directory
            | EntryType::Regular
            | EntryType::Continuous
            | EntryType::Symlink
            | EntryType::Link
            | EntryType::Fifo => {}
            other => {
                return Err(TemplateError::invalid(format!(
                    "{}: unsupported entry type {other:?}",
                    raw_path.display()
                )))
            }
        }

        let parent = ensure_parent(root, &rel, &mut written)?;
        let path = parent.join(&file_name);
        written.insert(rel.clone());

        match kind {
            EntryType::Directory => {
                match fs::symlink_metadata(&path) {
                    Ok(md) if md.is_dir() => {}
                    Ok(_) => {
                        remove_any(&path)?;
                        fs::create_dir(&path).ctx(write_err, &path)?;
                    }
                    Err(_) => fs::create_dir(&path).ctx(write_err, &path)?,
                }
                deferred.dirs.insert(rel, meta);
            }
            EntryType::Regular | EntryType::Continuous => {
                remove_any(&path)?;
                let mut file = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(nix::libc::O_NOFOLLOW)
                    .open(&path)
                    .ctx(write_err, &path)?;
                // The layer stream is already counted by the budgeted reader;
                // copying can only fail on a truncated or over-limit stream,
                // or on a host write error.
                io::copy(&mut entry, &mut file).map_err(|e| classify_copy_error(e, &path))?;
                if as_root {
                    std::os::unix::fs::fchown(&file, Some(id32(meta.uid)?), Some(id32(meta.gid)?))
                        .ctx(write_err, &path)?;
                }
                // chmod after chown: chown clears setuid/setgid bits.
                file.set_permissions(fs::Permissions::from_mode(meta.mode))
                    .ctx(write_err, &path)?;
                let _ = file.set_modified(mtime(meta.mtime));
                deferred.dirs.remove(&rel);
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| {
                        TemplateError::invalid(format!(
                            "symlink {} has no target",
                            raw_path.display()
                        ))
                    })?
                    .into_owned();
                if target.as_os_str().is_empty() {
                    return Err(TemplateError::invalid(format!(
                        "symlink {} has an empty target",
                        raw_path.display()
                    )));
                }
                remove_any(&path)?;
                std::os::unix::fs::symlink(&target, &path).ctx(write_err, &path)?;
                if as_root {
                    std::os::unix::fs::lchown(&path, Some(id32(meta.uid)?), Some(id32(meta.gid)?))
                        .ctx(write_err, &path)?;
                }
                deferred.dirs.remove(&rel);
            }
            EntryType::Link => {
                let raw_target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| {
                        TemplateError::invalid(format!(
                            "hard link {} has no target",
                            raw_path.display()
                        ))
                    })?
                    .into_owned();
                let target_rel = normalize(&raw_target, "hard link target")?;
                let target = resolve_existing(root, &target_rel).map_err(|why| {
                    TemplateError::invalid(format!(
                        "hard link {} -> {}: {why}",
                        raw_path.display(),
                        raw_target.display()
                    ))
                })?;
                if target_rel != rel {
                    remove_any(&path)?;
                    fs::hard_link(&target, &path).ctx(write_err, &path)?;
                }
                deferred.dirs.remove(&rel);
            }
            EntryType::Fifo => {
                remove_any(&path)?;
                nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600))
                    .map_err(|e| write_err(path.clone(), e.into()))?;
                if as_root {
                    std::os::unix::fs::lchown(&path, Some(id32(meta.uid)?), Some(id32(meta.gid)?))
                        .ctx(write_err, &path)?;
                }
                fs::set_permissions(&path, fs::Permissions::from_mode(meta.mode))
                    .ctx(write_err, &path)?;
                deferred.dirs.remove(&rel);
            }
            _ => unreachable!("filtered above"),
        }
    }
    Ok(stats)
}

/// Applies the deferred directory metadata (owner, mode, mtime), deepest first.
pub(crate) fn finish_dirs(root: &Path, deferred: DeferredDirs) -> Result<(), TemplateError> {
    let as_root = is_root_user();
    let mut dirs: Vec<_> = deferred.dirs.into_iter().collect();
    dirs.sort_by_key(|(rel, _)| std::cmp::Reverse(rel.components().count()));
    for (rel, meta) in dirs {
        // Re-check the whole path: later layers may have replaced a parent.
        let Ok(path) = resolve_existing_dir(root, &rel) else {
            continue;
        };
        if as_root {
            std::os::unix::fs::lchown(&path, Some(id32(meta.uid)?), Some(id32(meta.gid)?))
                .ctx(write_err, &path)?;
        }
        fs::set_permissions(&path, fs::Permissions::from_mode(meta.mode)).ctx(write_err, &path)?;
        if let Ok(dir) = fs::File::open(&path) {
            let _ = dir.set_modified(mtime(meta.mtime));
        }
    }
    Ok(())
}

fn mtime(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

fn id32(id: u64) -> Result<u32, TemplateError> {
    u32::try_from(id).map_err(|_| TemplateError::invalid(format!("uid/gid {id} out of range")))
}

fn classify_copy_error(e: io::Error, path: &Path) -> TemplateError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof | io::ErrorKind::InvalidData | io::ErrorKind::Other => {
            TemplateError::invalid(format!("reading data for {}: {e}", path.display()))
        }
        _ => write_err(path.to_path_buf(), e),
    }
}

/// Makes sure every parent directory of `rel` exists as a real directory under
/// `root` (creating missing ones) and returns the parent's host path.
fn ensure_parent(
    root: &Path,
    rel: &Path,
    written: &mut HashSet<PathBuf>,
) -> Result<PathBuf, TemplateError> {
    let mut cur = root.to_path_buf();
    let mut cur_rel = PathBuf::new();
    let parent = rel.parent().unwrap_or(Path::new(""));
    for comp in parent.components() {
        cur.push(comp);
        cur_rel.push(comp);
        match fs::symlink_metadata(&cur) {
            Ok(md) if md.is_dir() => {}
            Ok(md) => {
                let what = if md.file_type().is_symlink() {
                    "a symlink"
                } else {
                    "not a directory"
                };
                return Err(TemplateError::invalid(format!(
                    "entry {} goes through {} which is {what}",
                    rel.display(),
                    cur_rel.display()
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir(&cur).ctx(write_err, &cur)?;
                fs::set_permissions(&cur, fs::Permissions::from_mode(0o755))
                    .ctx(write_err, &cur)?;
                written.insert(cur_rel.clone());
            }
            Err(e) => return Err(write_err(cur, e)),
        }
    }
    Ok(cur)
}

/// Resolves an existing non-directory `rel` under `root` without following
/// any symlink on the way (the final component may itself be a symlink; a
/// hard link to it links the symlink, not its target).
fn resolve_existing(root: &Path, rel: &Path) -> Result<PathBuf, String> {
    let parent = rel.parent().ok_or("empty target")?;
    let dir = resolve_existing_dir(root, parent)?;
    let name = rel.file_name().ok_or("empty target")?;
    let path = dir.join(name);
    match fs::symlink_metadata(&path) {
        Ok(md) if md.is_dir() => Err("target is a directory".into()),
        Ok(_) => Ok(path),
        Err(_) => Err("target does not exist in the image".into()),
    }
}

fn resolve_existing_dir(root: &Path, rel: &Path) -> Result<PathBuf, String> {
    let mut cur = root.to_path_buf();
    for comp in rel.components() {
        cur.push(comp);
        match fs::symlink_metadata(&cur) {
            Ok(md) if md.is_dir() => {}
            Ok(_) => return Err(format!("{} is not a directory", cur.display())),
            Err(_) => return Err(format!("{} does not exist", cur.display())),
        }
    }
    Ok(cur)
}

/// Removes whatever is at `path` (file, symlink, or directory tree; symlinks
/// are removed, never followed). Missing is fine.
fn remove_any(path: &Path) -> Result<(), TemplateError> {
    match fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => fs::remove_dir_all(path).ctx(remove_err, path),
        Ok(_) => fs::remove_file(path).ctx(remove_err, path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(remove_err(path.to_path_buf(), e)),
    }
}

/// Opaque whiteout: removes from `dir` everything this layer did not write.
fn clear_lower(
    dir_rel: &Path,
    dir: &Path,
    written: &HashSet<PathBuf>,
) -> Result<(), TemplateError> {
    for child in fs::read_dir(dir).ctx(remove_err, dir)? {
        let child = child.ctx(remove_err, dir)?;
        let rel = dir_rel.join(child.file_name());
        let path = child.path();
        if !written.contains(&rel) {
            remove_any(&path)?;
        } else if fs::symlink_metadata(&path)
            .map(|m| m.is_dir())
            .unwrap_or(false)
        {
            clear_lower(&rel, &path, written)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_accepts_relative_and_rejects_escapes() {
        assert_eq!(
            normalize(Path::new("./a/./b"), "entry").unwrap(),
            PathBuf::from("a/b")
        );
        assert_eq!(normalize(Path::new("./"), "entry").unwrap(), PathBuf::new());
        let e = normalize(Path::new("a/../../evil"), "entry").unwrap_err();
        assert!(matches!(e, TemplateError::InvalidArchive(_)), "{e}");
        let e = normalize(Path::new("/etc/x"), "entry").unwrap_err();
        assert!(e.to_string().contains("absolute"), "{e}");
    }
}
