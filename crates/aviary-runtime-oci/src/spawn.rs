//! The real [`Spawner`]: runs programs with tokio, optionally inside a private
//! mount namespace prepared between fork and exec.
//!
//! Its `unsafe` is the `pre_exec` hooks; the crate's other unsafe blocks are the loop
//! device ioctls in `quota` and the mount-API calls in `idmap`, each with a SAFETY note.

use async_trait::async_trait;
use aviary_runtime::{SpawnIsolation, SpawnOutput, SpawnRequest, SpawnStdio, Spawner};
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::process::Stdio;

/// Moves the calling process into a new, recursively private mount
/// namespace and lazily unmounts `targets` there (missing ones are skipped).
/// Meant for a forked child before exec: it only calls unshare(2), mount(2)
/// and umount2(2), async-signal-safe system calls, and neither allocates
/// nor takes locks (`targets` were built before fork and are only read).
pub(crate) fn enter_private_namespace(targets: &[CString]) -> std::io::Result<()> {
    // SAFETY: plain system calls on a valid flag set and on NUL-terminated
    // strings that live for the call; no memory is handed to the kernel
    // beyond the call.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        for t in targets {
            // EINVAL / ENOENT: not a mount point here, nothing to hide.
            libc::umount2(t.as_ptr(), libc::MNT_DETACH);
        }
    }
    Ok(())
}

/// Runs [`SpawnRequest`]s as host processes.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessSpawner;

#[async_trait]
impl Spawner for ProcessSpawner {
    async fn run(&self, request: &SpawnRequest) -> std::io::Result<SpawnOutput> {
        let mut cmd = tokio::process::Command::new(&request.program);
        cmd.args(&request.args)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        match request.stdio {
            SpawnStdio::Capture => cmd.stdout(Stdio::piped()).stderr(Stdio::piped()),
            SpawnStdio::Null => cmd.stdout(Stdio::null()).stderr(Stdio::null()),
        };
        if let SpawnIsolation::PrivateMountNamespace { detach } = &request.isolation {
            // Allocate before fork: only async-signal-safe calls may run in the child.
            let targets: Vec<CString> = detach
                .iter()
                .map(|p| CString::new(p.as_os_str().as_bytes()))
                .collect::<Result<_, _>>()
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
            // SAFETY: the closure runs in the forked child before exec and
            // only calls `enter_private_namespace`, which is async-signal-safe
            // (see there); the C strings were built before fork.
            unsafe {
                cmd.pre_exec(move || enter_private_namespace(&targets));
            }
        }
        if let SpawnIsolation::JoinMountNamespace { ns, tree } = &request.isolation {
            let ns = *ns;
            let tree = match tree {
                Some((fd, at)) => Some((
                    *fd,
                    CString::new(at.as_os_str().as_bytes())
                        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
                )),
                None => None,
            };
            // SAFETY: the closure runs in the forked child before exec and only
            // calls setns(2), unshare(2) and move_mount(2), async-signal-safe
            // system calls, on fds the caller keeps open until `run` returns
            // and on a C string built before fork; no allocation, no locks.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setns(ns, libc::CLONE_NEWNS) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    // a copy: nothing the child mounts reaches the prepared one
                    if libc::unshare(libc::CLONE_NEWNS) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if let Some((fd, at)) = &tree {
                        if libc::syscall(
                            libc::SYS_move_mount,
                            *fd,
                            c"".as_ptr(),
                            libc::AT_FDCWD,
                            at.as_ptr(),
                            crate::mount_ns::MOVE_MOUNT_F_EMPTY_PATH,
                        ) != 0
                        {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        if let Some(fd) = request.pass_fd {
            let target = aviary_runtime::ENVD_LISTEN_FD;
            // SAFETY: runs in the forked child before exec and only calls
            // dup2(2) and fcntl(2), async-signal-safe system calls, on plain
            // integers; no allocation, no locks. `fd` is kept open by the
            // caller until `run` returns, so it is valid in the child.
            unsafe {
                cmd.pre_exec(move || {
                    if fd == target {
                        // dup2 onto itself keeps FD_CLOEXEC: clear it by hand.
                        let flags = libc::fcntl(fd, libc::F_GETFD);
                        if flags < 0
                            || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0
                        {
                            return Err(std::io::Error::last_os_error());
                        }
                    } else if libc::dup2(fd, target) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn()?;
        match tokio::time::timeout(request.timeout, child.wait_with_output()).await {
            Ok(out) => {
                let out = out?;
                Ok(SpawnOutput {
                    code: out.status.code(),
                    timed_out: false,
                    stdout: out.stdout,
                    stderr: out.stderr,
                })
            }
            // Dropping the future drops the child, which kill_on_drop kills.
            Err(_) => Ok(SpawnOutput {
                code: None,
                timed_out: true,
                ..Default::default()
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn captures_output_and_exit_code() {
        let out = ProcessSpawner
            .run(&SpawnRequest::new(
                "/bin/sh",
                vec!["-c".into(), "echo out; echo err >&2; exit 3".into()],
            ))
            .await
            .unwrap();
        assert_eq!(out.code, Some(3));
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
    }

    #[tokio::test]
    async fn times_out() {
        let mut req = SpawnRequest::new("/bin/sleep", vec!["5".into()]);
        req.timeout = Duration::from_millis(100);
        let out = ProcessSpawner.run(&req).await.unwrap();
        assert!(out.timed_out);
        assert_eq!(out.code, None);
    }

    #[tokio::test]
    async fn private_mount_namespace_hides_detached_mounts() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP private_mount_namespace_hides_detached_mounts: needs root for unshare(CLONE_NEWNS)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("m");
        std::fs::create_dir(&target).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &target,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=1m"),
        )
        .unwrap();
        let mut req = SpawnRequest::new(
            "/bin/sh",
            vec![
                "-c".into(),
                format!("grep -c ' {} ' /proc/self/mountinfo", target.display()),
            ],
        );
        req.isolation = SpawnIsolation::PrivateMountNamespace {
            detach: vec![target.clone(), "/no/such/mount".into()],
        };
        let inside = ProcessSpawner.run(&req).await.unwrap();
        req.isolation = SpawnIsolation::None;
        let outside = ProcessSpawner.run(&req).await.unwrap();
        nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH).unwrap();
        assert_eq!(String::from_utf8_lossy(&inside.stdout).trim(), "0");
        assert_eq!(String::from_utf8_lossy(&outside.stdout).trim(), "1");
    }
}
