//! The content digest of a rootfs tree.
//!
//! A template's digest is `sha256:` + the hex SHA-256 of this canonical byte
//! stream (format version 1, all integers little-endian):
//!
//! ```text
//! "aviary-tree-v1\0"
//! then for every entry below the root (the root directory itself is not
//! included), depth-first pre-order, siblings sorted by the bytes of their name:
//!   u32 len(path) | path       relative, '/'-separated, no leading "./"
//!   u8  type                   'd' dir, 'f' regular file, 'l' symlink, 'p' fifo,
//!                              'c' char device, 'b' block device, 's' socket
//!   u32 mode & 0o7777          permission bits incl. setuid/setgid/sticky
//!   u32 uid | u32 gid
//!   'f': u64 size | sha256(content) (32 raw bytes)
//!   'l': u32 len(target) | target bytes (never resolved)
//!   'c','b': u64 rdev
//! ```
//!
//! Not included: timestamps, extended attributes, hard-link identity (two
//! links to one inode hash like two equal files) and the root directory's own
//! metadata. Equal trees therefore get equal digests whoever built them and
//! whenever; any change to a byte, a name, a mode, an owner or a link target
//! changes the digest.
//!
//! File contents are hashed in parallel on up to `available_parallelism`
//! threads; the outer stream is then hashed in order on the caller's thread.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

use crate::error::{hash_err, IoContext, TemplateError};

/// The digest of a tree plus its apparent size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeDigest {
    /// `sha256:<64 hex>`.
    pub digest: String,
    /// Sum of the sizes of regular files, each inode counted once.
    pub size_bytes: u64,
}

impl TreeDigest {
    /// The hex part of the digest (the rootfs directory name).
    pub fn hex(&self) -> &str {
        self.digest.trim_start_matches("sha256:")
    }
}

struct Node {
    rel: Vec<u8>,
    kind: u8,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    rdev: u64,
    target: Vec<u8>,
    inode: (u64, u64),
}

/// Computes the canonical digest of the tree under `root` (see module docs).
pub fn digest_tree(root: &Path) -> Result<TreeDigest, TemplateError> {
    let mut nodes = Vec::new();
    collect(root, &mut Vec::new(), &mut nodes)?;

    let files: Vec<usize> = (0..nodes.len())
        .filter(|&i| nodes[i].kind == b'f')
        .collect();
    let hashes = hash_files(root, &nodes, &files)?;

    let mut outer = Sha256::new();
    outer.update(b"aviary-tree-v1\0");
    let mut seen_inodes = std::collections::HashSet::new();
    let mut size_bytes = 0u64;
    let mut file_no = 0;
    for n in &nodes {
        outer.update(len32(n.rel.len()).to_le_bytes());
        outer.update(&n.rel);
        outer.update([n.kind]);
        outer.update((n.mode & 0o7777).to_le_bytes());
        outer.update(n.uid.to_le_bytes());
        outer.update(n.gid.to_le_bytes());
        match n.kind {
            b'f' => {
                outer.update(n.size.to_le_bytes());
                outer.update(hashes[file_no]);
                file_no += 1;
                if seen_inodes.insert(n.inode) {
                    size_bytes += n.size;
                }
            }
            b'l' => {
                outer.update(len32(n.target.len()).to_le_bytes());
                outer.update(&n.target);
            }
            b'c' | b'b' => outer.update(n.rdev.to_le_bytes()),
            _ => {}
        }
    }
    Ok(TreeDigest {
        digest: format!("sha256:{}", hex::encode(outer.finalize())),
        size_bytes,
    })
}

fn len32(n: usize) -> u32 {
    // Linux paths and link targets are far below 4 GiB (PATH_MAX is 4096).
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn collect(root: &Path, rel: &mut Vec<u8>, out: &mut Vec<Node>) -> Result<(), TemplateError> {
    let dir = if rel.is_empty() {
        root.to_path_buf()
    } else {
        root.join(std::ffi::OsStr::from_bytes(rel))
    };
    let mut names: Vec<_> = fs::read_dir(&dir)
        .ctx(hash_err, &dir)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .ctx(hash_err, &dir)?;
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    for name in names {
        let saved = rel.len();
        if !rel.is_empty() {
            rel.push(b'/');
        }
        rel.extend_from_slice(name.as_bytes());
        let path = dir.join(&name);
        let md = fs::symlink_metadata(&path).ctx(hash_err, &path)?;
        let ft = md.file_type();
        let kind = if ft.is_dir() {
            b'd'
        } else if ft.is_file() {
            b'f'
        } else if ft.is_symlink() {
            b'l'
        } else if ft.is_fifo() {
            b'p'
        } else if ft.is_char_device() {
            b'c'
        } else if ft.is_block_device() {
            b'b'
        } else {
            b's'
        };
        let target = if kind == b'l' {
            fs::read_link(&path)
                .ctx(hash_err, &path)?
                .into_os_string()
                .as_bytes()
                .to_vec()
        } else {
            Vec::new()
        };
        out.push(Node {
            rel: rel.clone(),
            kind,
            mode: md.mode(),
            uid: md.uid(),
            gid: md.gid(),
            size: md.size(),
            rdev: md.rdev(),
            target,
            inode: (md.dev(), md.ino()),
        });
        if kind == b'd' {
            collect(root, rel, out)?;
        }
        rel.truncate(saved);
    }
    Ok(())
}

fn hash_files(
    root: &Path,
    nodes: &[Node],
    files: &[usize],
) -> Result<Vec<[u8; 32]>, TemplateError> {
    let results: Vec<Mutex<[u8; 32]>> = files.iter().map(|_| Mutex::new([0u8; 32])).collect();
    let next = AtomicUsize::new(0);
    let first_error: Mutex<Option<TemplateError>> = Mutex::new(None);
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 8)
        .min(files.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut buf = vec![0u8; 256 * 1024];
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= files.len() || first_error.lock().map(|e| e.is_some()).unwrap_or(true) {
                        return;
                    }
                    let path = root.join(std::ffi::OsStr::from_bytes(&nodes[files[i]].rel));
                    match hash_file(&path, &mut buf) {
                        Ok(h) => {
                            if let Ok(mut slot) = results[i].lock() {
                                *slot = h;
                            }
                        }
                        Err(e) => {
                            if let Ok(mut slot) = first_error.lock() {
                                slot.get_or_insert(hash_err(path, e));
                            }
                            return;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok(results
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect())
}

fn hash_file(path: &PathBuf, buf: &mut [u8]) -> io::Result<[u8; 32]> {
    let mut f = File::options()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)?;
    let mut h = Sha256::new();
    loop {
        let n = f.read(buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    fn sample(dir: &Path) {
        fs::create_dir_all(dir.join("etc/sub")).unwrap();
        fs::write(dir.join("etc/passwd"), b"root:x:0:0::/root:/bin/sh\n").unwrap();
        fs::write(dir.join("etc/sub/a"), vec![7u8; 300_000]).unwrap();
        symlink("/etc/passwd", dir.join("link")).unwrap();
        fs::write(dir.join("a-b"), b"x").unwrap();
    }

    #[test]
    fn same_content_same_digest_and_changes_are_seen() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        sample(a.path());
        // Build b in a different creation order; mtimes differ too.
        fs::write(b.path().join("a-b"), b"x").unwrap();
        symlink("/etc/passwd", b.path().join("link")).unwrap();
        fs::create_dir_all(b.path().join("etc/sub")).unwrap();
        fs::write(b.path().join("etc/sub/a"), vec![7u8; 300_000]).unwrap();
        fs::write(b.path().join("etc/passwd"), b"root:x:0:0::/root:/bin/sh\n").unwrap();
        let da = digest_tree(a.path()).unwrap();
        let db = digest_tree(b.path()).unwrap();
        assert_eq!(da, db);
        assert!(da.digest.starts_with("sha256:"));
        assert_eq!(da.hex().len(), 64);
        assert_eq!(da.size_bytes, 300_000 + 26 + 1);

        // One byte of content.
        let mut data = vec![7u8; 300_000];
        data[123_456] = 8;
        fs::write(b.path().join("etc/sub/a"), &data).unwrap();
        let changed = digest_tree(b.path()).unwrap();
        assert_ne!(changed.digest, da.digest);
        fs::write(b.path().join("etc/sub/a"), vec![7u8; 300_000]).unwrap();
        assert_eq!(digest_tree(b.path()).unwrap().digest, da.digest);

        // A mode bit.
        fs::set_permissions(b.path().join("a-b"), fs::Permissions::from_mode(0o4755)).unwrap();
        assert_ne!(digest_tree(b.path()).unwrap().digest, da.digest);
        fs::set_permissions(b.path().join("a-b"), fs::Permissions::from_mode(0o644)).unwrap();
        fs::set_permissions(a.path().join("a-b"), fs::Permissions::from_mode(0o644)).unwrap();

        // A symlink target.
        fs::remove_file(b.path().join("link")).unwrap();
        symlink("/etc/passwe", b.path().join("link")).unwrap();
        assert_ne!(
            digest_tree(b.path()).unwrap().digest,
            digest_tree(a.path()).unwrap().digest
        );
    }

    #[test]
    fn name_moves_between_directories_change_digest() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        fs::create_dir(a.path().join("d")).unwrap();
        fs::write(a.path().join("d/f"), b"1").unwrap();
        fs::create_dir(b.path().join("d")).unwrap();
        fs::write(b.path().join("f"), b"1").unwrap();
        assert_ne!(
            digest_tree(a.path()).unwrap().digest,
            digest_tree(b.path()).unwrap().digest
        );
    }
}
