//! The mount namespace the runtime binary runs in (issue 12: create time
//! must not grow with the number of sandboxes).
//!
//! Every sandbox holds two mounts on the host (its disk and its overlay
//! root). A process that makes a mount namespace copies the whole table,
//! and crun reads it and, in the container, unmounts the old root, so with
//! a thousand sandboxes alive each `crun run` walked ~2000 mounts several
//! times: measured here, `crun run` of `/bin/true` took 83 ms p50 in a
//! namespace with 2000 extra mounts against 55 ms without (same load,
//! interleaved).
//!
//! So the runtime prepares one namespace once — a private copy of the
//! host's, with the runtime's own mounts under its state dir detached (and,
//! for crun on hybrid cgroups, `/sys/fs/cgroup/unified`: see RUNTIME-NOTES)
//! — and keeps it open by fd. Each runtime command runs in a private copy of
//! that one ([`aviary_runtime::SpawnIsolation::JoinMountNamespace`]); a
//! `run` also gets its own sandbox's mounts, cloned with
//! `open_tree(OPEN_TREE_CLONE | AT_RECURSIVE)` from the host and attached at
//! the same path. Mounts made on the host later never reach the prepared
//! namespace (it is private), so the copy every command makes stays the
//! size of the host's table at start-up.
//!
//! Its `unsafe` is the `open_tree` system call, with a SAFETY note.

use std::ffi::CString;
use std::io::{self, BufRead, BufReader};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

pub(crate) const OPEN_TREE_CLONE: libc::c_uint = 1;
pub(crate) const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const AT_RECURSIVE: libc::c_uint = 0x8000;

/// Makes the prepared namespace: a private copy of this process's, with
/// every mount at or below `state_dir` and every path in `detach` lazily
/// unmounted. Returns an fd that keeps it alive.
pub(crate) fn prepare(state_dir: &Path, detach: &[std::path::PathBuf]) -> io::Result<OwnedFd> {
    let targets: Vec<CString> = detach
        .iter()
        .map(|p| CString::new(p.as_os_str().as_bytes()))
        .collect::<Result<_, _>>()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // The helper unmounts the state dir's mounts in its new namespace (a
    // sandbox's disk and overlay: children first), says so, and waits to be
    // killed; its namespace outlives it through the fd opened below.
    let script = r#"
d=$1
while read -r _ _ _ _ mp _; do
  case "$mp" in "$d"|"$d"/*) printf '%s\n' "$mp";; esac
done < /proc/self/mountinfo | sort -r | while read -r mp; do umount -l "$mp" 2>/dev/null; done
echo ready
exec sleep 60
"#;
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", script, "sh"])
        .arg(state_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // SAFETY: runs in the forked child before exec and only calls
    // `enter_private_namespace`, async-signal-safe (see there); the C strings
    // were built before fork.
    unsafe {
        cmd.pre_exec(move || crate::spawn::enter_private_namespace(&targets));
    }
    let mut child = cmd.spawn()?;
    let result = (|| {
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("no stdout"))?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        if line.trim() != "ready" {
            return Err(io::Error::other(format!(
                "namespace helper said {:?}",
                line.trim()
            )));
        }
        let ns = std::fs::File::open(format!("/proc/{}/ns/mnt", child.id()))?;
        let own = std::fs::metadata("/proc/self/ns/mnt")?;
        if ns.metadata()?.ino() == own.ino() {
            return Err(io::Error::other("the helper shares our mount namespace"));
        }
        Ok(OwnedFd::from(ns))
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// A detached copy of the mounts at and below `root` (a sandbox's disk and
/// overlay), to attach in a prepared namespace's copy.
pub(crate) fn clone_tree(root: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(root.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: open_tree takes a valid NUL-terminated path and flags; the
    // returned fd (checked below) is owned by nothing else yet.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            path.as_ptr(),
            OPEN_TREE_CLONE | AT_RECURSIVE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = libc::c_int::try_from(fd).map_err(io::Error::other)?;
    // SAFETY: `fd` was just returned by open_tree and is not owned elsewhere.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use aviary_runtime::{SpawnIsolation, SpawnRequest, Spawner};
    use std::os::fd::AsRawFd;

    fn mount_tmpfs(at: &Path) {
        std::fs::create_dir_all(at).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
    }

    /// The prepared namespace holds none of the state dir's mounts (another
    /// sandbox's), a command in it sees its own sandbox's mounts attached
    /// from a clone, and what it mounts stays in its copy.
    #[tokio::test]
    async fn commands_see_their_own_sandbox_and_no_other() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!(
                "SKIP commands_see_their_own_sandbox_and_no_other: needs root (unshare, mount)"
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let (other, own) = (state.join("sbx-other"), state.join("sbx-own"));
        mount_tmpfs(&other);
        std::fs::create_dir_all(&own).unwrap();
        let ns = prepare(&state, &[]).unwrap();
        // made after the namespace was prepared, like a new sandbox's disk
        mount_tmpfs(&own);
        std::fs::write(own.join("mark"), "own").unwrap();
        let tree = clone_tree(&own).unwrap();
        let mut req = SpawnRequest::new(
            "/bin/sh",
            vec![
                "-c".into(),
                format!(
                    "cat {}/mark; echo; cat /proc/self/mountinfo; mount -t tmpfs t {}",
                    own.display(),
                    other.display()
                ),
            ],
        );
        req.isolation = SpawnIsolation::JoinMountNamespace {
            ns: ns.as_raw_fd(),
            tree: Some((tree.as_raw_fd(), own.clone())),
        };
        let out = crate::spawn::ProcessSpawner.run(&req).await.unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.success(),
            "{text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.starts_with("own"), "its sandbox is attached: {text}");
        let mountpoints: Vec<&str> = text.lines().filter_map(|l| l.split(' ').nth(4)).collect();
        assert!(mountpoints.contains(&own.to_str().unwrap()), "{text}");
        assert!(
            !mountpoints.contains(&other.to_str().unwrap()),
            "another sandbox's mount is not there: {text}"
        );
        // the command's mount stayed in its own copy: not in the prepared
        // namespace, not on the host
        let again = SpawnRequest {
            isolation: SpawnIsolation::JoinMountNamespace {
                ns: ns.as_raw_fd(),
                tree: None,
            },
            ..SpawnRequest::new("/bin/cat", vec!["/proc/self/mountinfo".into()])
        };
        let out = crate::spawn::ProcessSpawner.run(&again).await.unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(!text.contains(other.to_str().unwrap()), "{text}");
        assert!(!text.contains(own.to_str().unwrap()), "{text}");
        let host = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert_eq!(
            host.lines()
                .filter(|l| l.split(' ').nth(4) == other.to_str())
                .count(),
            1,
            "the host keeps exactly its own mount of the other sandbox"
        );
        for m in [&own, &other] {
            nix::mount::umount2(m.as_path(), nix::mount::MntFlags::MNT_DETACH).unwrap();
        }
    }
}
