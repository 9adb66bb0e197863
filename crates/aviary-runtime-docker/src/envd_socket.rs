//! Taking envd's socket out of a directory the sandbox can write.
//!
//! Docker cannot hand PID 1 a descriptor, so envd binds its socket itself,
//! at [`ENVD_SOCKET_IN_SANDBOX`] in a directory bind-mounted from the host
//! (`<sandbox>/envd/`). Everything in that directory belongs to the sandbox:
//! an entry may be a symlink to another sandbox's socket, or a socket some
//! other process of the sandbox bound. The host therefore never connects
//! through it. Once, right after start (envd is then the only process in the
//! sandbox), [`adopt`] hard-links the socket inode into the host-only
//! control dir — `linkat` without `AT_SYMLINK_FOLLOW` links a symlink itself,
//! never its target, and the result must be a socket — and removes the name
//! inside. From then on the host connects only to `<control>/envd.sock`,
//! which nothing in the sandbox can reach or replace, and the envd client
//! still checks that the peer of every connection is the sandbox's init
//! (`SO_PEERCRED`), which envd is because it called `listen()` itself.

use aviary_runtime::RuntimeError;
use nix::fcntl::AtFlags;
use nix::sys::stat::{fstatat, SFlag};
use nix::unistd::{linkat, unlinkat, UnlinkatFlags};
use std::fs::File;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Where envd listens inside a Docker sandbox (the dir is the host's
/// `<sandbox>/envd/`).
pub const ENVD_SOCKET_DIR_IN_SANDBOX: &str = "/.aviary/run";
/// The socket path envd is started with (`--socket`).
pub const ENVD_SOCKET_IN_SANDBOX: &str = "/.aviary/run/envd.sock";

/// What [`probe`] saw at the socket's name in the sandbox-writable dir.
#[derive(Debug, PartialEq, Eq)]
pub enum Seen {
    Nothing,
    Socket,
    /// Anything else (a symlink, a file, a dir): never adopted.
    Other,
}

/// `dir` itself, not followed if it is a symlink.
fn open_dir(dir: &Path) -> Result<File, RuntimeError> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)
        .map_err(|source| RuntimeError::ReadFile {
            path: dir.to_path_buf(),
            source,
        })
}

fn kind_at(dir: RawFd, name: &str) -> Result<Seen, nix::Error> {
    match fstatat(Some(dir), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFSOCK => {
            Ok(Seen::Socket)
        }
        Ok(_) => Ok(Seen::Other),
        Err(nix::Error::ENOENT) => Ok(Seen::Nothing),
        Err(e) => Err(e),
    }
}

/// What is at `name` in `dir`, without following a symlink.
pub fn probe(dir: &Path, name: &str) -> Result<Seen, RuntimeError> {
    let fd = open_dir(dir)?;
    kind_at(fd.as_raw_fd(), name).map_err(|e| RuntimeError::ReadFile {
        path: dir.join(name),
        source: e.into(),
    })
}

/// Hard-links the socket `name` of the sandbox-writable `from` dir as
/// `name` in the host-only `to` dir (both on one file system, both made by
/// the runtime, so neither path itself is the sandbox's), refusing anything
/// that is not a socket, then removes the name in `from`.
pub fn adopt(from: &Path, to: &Path, name: &str) -> Result<(), RuntimeError> {
    let (src_dir, dst_dir) = (open_dir(from)?, open_dir(to)?);
    let (src, dst) = (src_dir.as_raw_fd(), dst_dir.as_raw_fd());
    let fail = |what: &str, e: nix::Error| RuntimeError::WriteFile {
        path: to.join(name),
        source: std::io::Error::new(
            std::io::Error::from(e).kind(),
            format!("{what}: {}", std::io::Error::from(e)),
        ),
    };
    if kind_at(src, name).map_err(|e| fail("inspect envd's socket", e))? != Seen::Socket {
        return Err(RuntimeError::InvokeRuntime {
            action: "adopt envd's socket".into(),
            detail: format!("{:?} is not a socket", from.join(name)),
        });
    }
    // No AT_SYMLINK_FOLLOW: had the entry become a symlink since the check,
    // the link is a symlink, which the check below refuses.
    linkat(Some(src), name, Some(dst), name, AtFlags::empty())
        .map_err(|e| fail("link envd's socket into the control dir", e))?;
    match kind_at(dst, name) {
        Ok(Seen::Socket) => {}
        other => {
            let _ = unlinkat(Some(dst), name, UnlinkatFlags::NoRemoveDir);
            return Err(RuntimeError::InvokeRuntime {
                action: "adopt envd's socket".into(),
                detail: format!("the linked entry is not a socket ({other:?})"),
            });
        }
    }
    // The sandbox loses its way to envd (as in the crun tier, where the
    // socket is never visible inside).
    unlinkat(Some(src), name, UnlinkatFlags::NoRemoveDir)
        .map_err(|e| fail("remove envd's socket name in the sandbox", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn a_socket_is_linked_into_the_control_dir_and_removed_inside() {
        let d = tempfile::tempdir().unwrap();
        let (from, to) = (d.path().join("envd"), d.path().join("control"));
        std::fs::create_dir(&from).unwrap();
        std::fs::create_dir(&to).unwrap();
        let listener = UnixListener::bind(from.join("envd.sock")).unwrap();
        assert_eq!(probe(&from, "envd.sock").unwrap(), Seen::Socket);
        adopt(&from, &to, "envd.sock").unwrap();
        assert_eq!(probe(&from, "envd.sock").unwrap(), Seen::Nothing);
        // the linked name reaches the same listener
        let _c = std::os::unix::net::UnixStream::connect(to.join("envd.sock")).unwrap();
        listener.accept().unwrap();
    }

    #[test]
    fn a_symlink_to_another_socket_is_never_adopted() {
        let d = tempfile::tempdir().unwrap();
        let (from, to) = (d.path().join("envd"), d.path().join("control"));
        std::fs::create_dir(&from).unwrap();
        std::fs::create_dir(&to).unwrap();
        // another sandbox's socket, which a hostile sandbox points at
        let other = d.path().join("other.sock");
        let _l = UnixListener::bind(&other).unwrap();
        std::os::unix::fs::symlink(&other, from.join("envd.sock")).unwrap();
        assert_eq!(probe(&from, "envd.sock").unwrap(), Seen::Other);
        adopt(&from, &to, "envd.sock").unwrap_err();
        assert_eq!(
            probe(&to, "envd.sock").unwrap(),
            Seen::Nothing,
            "nothing was linked into the control dir"
        );
        std::fs::write(from.join("plain"), "x").unwrap();
        adopt(&from, &to, "plain").unwrap_err();
    }
}
