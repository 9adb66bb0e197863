//! Host-side resources of a sandbox that the OCI runtime does not own:
//! the overlay mount, leftover cgroup directories and processes, and the
//! cgroup counters behind `usage()`.
//!
//! Everything here is plain syscalls and file reads (no child processes), so
//! it also works when the runtime's own state is gone after a host crash.

use aviary_core::SandboxId;
use aviary_runtime::{ResourceUsage, RuntimeError};
use nix::mount::{MntFlags, MsFlags};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One line of `/proc/self/mountinfo`, the parts we use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub source: String,
    pub super_options: String,
}

/// Undoes mountinfo's octal escapes (`\040` for space, ...).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = b[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split(' ').nth(4)?;
            let mut r = right.split(' ');
            let fs_type = r.next()?;
            let source = r.next()?;
            let super_options = r.next().unwrap_or("");
            Some(MountEntry {
                mount_point: PathBuf::from(unescape(mount_point)),
                fs_type: fs_type.to_string(),
                source: unescape(source),
                super_options: super_options.to_string(),
            })
        })
        .collect()
}

pub fn mounts() -> io::Result<Vec<MountEntry>> {
    Ok(parse_mountinfo(&std::fs::read_to_string(
        "/proc/self/mountinfo",
    )?))
}

/// Mount points at or below `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = mounts()?
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(dir))
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v.dedup();
    Ok(v)
}

/// Overlay options cannot carry `,` `:` or `\` in paths unescaped; refuse them.
fn overlay_safe(p: &Path) -> bool {
    p.to_str()
        .is_some_and(|s| !s.contains([',', ':', '\\', '\n']))
}

/// Mounts `lower` (read-only) + `upper`/`work` as an overlay on `target`.
pub fn mount_overlay(
    lower: &Path,
    upper: &Path,
    work: &Path,
    target: &Path,
) -> Result<(), RuntimeError> {
    for p in [lower, upper, work] {
        if !overlay_safe(p) {
            return Err(RuntimeError::InvalidSpec {
                reason: format!("path {p:?} cannot be used in an overlay mount"),
            });
        }
    }
    let data = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    nix::mount::mount(
        Some("overlay"),
        target,
        Some("overlay"),
        MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
        Some(data.as_str()),
    )
    .map_err(|e| RuntimeError::MountOverlay {
        path: target.to_path_buf(),
        source: e.into(),
    })
}

/// Mounts the overlay of one sandbox on `<dir>/rootfs` with option strings
/// that name no host path: the mount runs in a thread of its own whose
/// working directory (unshared from the process with `CLONE_FS`) is `dir`,
/// and the layers are given as `lowerdir=lower,upperdir=upper,workdir=work`,
/// where `<dir>/lower` is a symlink to `lower` made here. The kernel keeps
/// those strings as given, and they are what the sandbox reads in its
/// `/proc/self/mountinfo` — the host data dir stays out of sight.
pub fn mount_sandbox_overlay(dir: &Path, lower: &Path) -> Result<(), RuntimeError> {
    if !overlay_safe(lower) {
        return Err(RuntimeError::InvalidSpec {
            reason: format!("path {lower:?} cannot be used in an overlay mount"),
        });
    }
    let link = dir.join("lower");
    match std::fs::symlink_metadata(&link) {
        Ok(_) => std::fs::remove_file(&link).map_err(|source| RuntimeError::WriteFile {
            path: link.clone(),
            source,
        })?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(RuntimeError::ReadFile { path: link, source }),
    }
    std::os::unix::fs::symlink(lower, &link).map_err(|source| RuntimeError::WriteFile {
        path: link.clone(),
        source,
    })?;
    let dir_owned = dir.to_path_buf();
    let target = dir.join("rootfs");
    std::thread::scope(|scope| {
        scope
            .spawn(move || -> Result<(), nix::Error> {
                // Private cwd for this thread only; it ends with the thread.
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS)?;
                nix::unistd::chdir(&dir_owned)?;
                nix::mount::mount(
                    Some("overlay"),
                    "rootfs",
                    Some("overlay"),
                    MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
                    Some("lowerdir=lower,upperdir=upper,workdir=work"),
                )
            })
            .join()
            .unwrap_or(Err(nix::Error::EIO))
    })
    .map_err(|e| RuntimeError::MountOverlay {
        path: target,
        source: e.into(),
    })
}

/// Unmounts everything at or below `dir`, deepest first. A busy mount is
/// detached lazily rather than left behind.
pub fn unmount_all_under(dir: &Path) -> Result<(), RuntimeError> {
    let list = mounts_under(dir).map_err(|source| RuntimeError::ReadFile {
        path: "/proc/self/mountinfo".into(),
        source,
    })?;
    for m in list {
        match nix::mount::umount2(&m, MntFlags::empty()) {
            Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
            Err(nix::errno::Errno::EBUSY) => nix::mount::umount2(&m, MntFlags::MNT_DETACH)
                .map_err(|e| RuntimeError::Unmount {
                    path: m.clone(),
                    source: e.into(),
                })?,
            Err(e) => {
                return Err(RuntimeError::Unmount {
                    path: m,
                    source: e.into(),
                })
            }
        }
    }
    Ok(())
}

/// One mounted cgroup hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupHierarchy {
    pub mount: PathBuf,
    /// cgroup2 (unified) rather than a v1 hierarchy.
    pub unified: bool,
    /// v1 controllers (and `name=...`) of this hierarchy; empty for cgroup2.
    pub controllers: Vec<String>,
}

pub fn parse_cgroup_hierarchies(entries: &[MountEntry]) -> Vec<CgroupHierarchy> {
    let mut out: Vec<CgroupHierarchy> = Vec::new();
    for m in entries {
        let h = match m.fs_type.as_str() {
            "cgroup2" => CgroupHierarchy {
                mount: m.mount_point.clone(),
                unified: true,
                controllers: Vec::new(),
            },
            "cgroup" => CgroupHierarchy {
                mount: m.mount_point.clone(),
                unified: false,
                controllers: m
                    .super_options
                    .split(',')
                    .filter(|o| !matches!(*o, "rw" | "ro") && !o.starts_with("release_agent"))
                    .map(str::to_string)
                    .collect(),
            },
            _ => continue,
        };
        // The same hierarchy can be mounted twice; keep the first mount.
        if !out
            .iter()
            .any(|o| o.unified == h.unified && o.controllers == h.controllers)
        {
            out.push(h);
        }
    }
    out
}

/// The host's cgroup hierarchies, read from mountinfo.
pub fn cgroup_hierarchies() -> io::Result<Vec<CgroupHierarchy>> {
    Ok(parse_cgroup_hierarchies(&mounts()?))
}

/// Where one sandbox's cgroups live: `<hierarchy>/<parent>/<id>` in each.
#[derive(Debug, Clone)]
pub struct CgroupLayout {
    pub hierarchies: Vec<CgroupHierarchy>,
    /// Relative parent, e.g. `aviary`.
    pub parent: String,
}

impl CgroupLayout {
    pub fn dirs(&self, id: &SandboxId) -> Vec<PathBuf> {
        self.hierarchies
            .iter()
            .map(|h| h.mount.join(&self.parent).join(id.as_str()))
            .collect()
    }

    fn v1(&self, controller: &str) -> Option<&CgroupHierarchy> {
        self.hierarchies
            .iter()
            .find(|h| !h.unified && h.controllers.iter().any(|c| c == controller))
    }

    fn unified(&self) -> Option<&CgroupHierarchy> {
        self.hierarchies.iter().find(|h| h.unified)
    }

    fn dir_in(&self, h: &CgroupHierarchy, id: &SandboxId) -> PathBuf {
        h.mount.join(&self.parent).join(id.as_str())
    }

    /// Reads the sandbox's counters: cgroup v1 files when a v1 memory
    /// hierarchy exists (hybrid hosts), cgroup2 files otherwise.
    pub fn usage(&self, id: &SandboxId) -> Result<ResourceUsage, RuntimeError> {
        if let Some(mem) = self.v1("memory") {
            let mem_dir = self.dir_in(mem, id);
            if !mem_dir.is_dir() {
                return Err(RuntimeError::NotFound { id: id.clone() });
            }
            let cpu_usage_ns = match self.v1("cpuacct") {
                Some(h) => read_u64(&self.dir_in(h, id).join("cpuacct.usage"))?,
                None => 0,
            };
            let pids_current = match self.v1("pids") {
                Some(h) => read_u64(&self.dir_in(h, id).join("pids.current"))?,
                None => 0,
            };
            return Ok(ResourceUsage {
                memory_current_bytes: read_u64(&mem_dir.join("memory.usage_in_bytes"))?,
                memory_peak_bytes: read_u64(&mem_dir.join("memory.max_usage_in_bytes"))?,
                cpu_usage_ns,
                oom_kills: read_key(&mem_dir.join("memory.oom_control"), "oom_kill")?,
                pids_current,
                disk_free_bytes: None,
            });
        }
        let Some(u) = self.unified() else {
            return Err(RuntimeError::ProbeRuntime {
                reason: "no memory cgroup hierarchy is mounted".into(),
            });
        };
        let dir = self.dir_in(u, id);
        if !dir.is_dir() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        let current = read_u64(&dir.join("memory.current"))?;
        let peak = read_u64(&dir.join("memory.peak")).unwrap_or(current);
        Ok(ResourceUsage {
            memory_current_bytes: current,
            memory_peak_bytes: peak,
            cpu_usage_ns: read_key(&dir.join("cpu.stat"), "usage_usec")?.saturating_mul(1000),
            oom_kills: read_key(&dir.join("memory.events"), "oom_kill")?,
            pids_current: read_u64(&dir.join("pids.current"))?,
            disk_free_bytes: None,
        })
    }

    /// The OOM-kill counter of [`Self::usage`] alone: one file read.
    pub fn oom_kills(&self, id: &SandboxId) -> Result<u64, RuntimeError> {
        let file = match (self.v1("memory"), self.unified()) {
            (Some(mem), _) => self.dir_in(mem, id).join("memory.oom_control"),
            (None, Some(u)) => self.dir_in(u, id).join("memory.events"),
            (None, None) => {
                return Err(RuntimeError::ProbeRuntime {
                    reason: "no memory cgroup hierarchy is mounted".into(),
                })
            }
        };
        match std::fs::read_to_string(&file) {
            Ok(text) => Ok(parse_key(&text, "oom_kill")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(RuntimeError::NotFound { id: id.clone() })
            }
            Err(source) => Err(RuntimeError::ReadFile { path: file, source }),
        }
    }

    /// Pids of every process in any of the sandbox's cgroups (any depth).
    pub fn processes(&self, id: &SandboxId) -> Vec<i32> {
        let mut pids = Vec::new();
        for d in self.dirs(id) {
            collect_procs(&d, &mut pids);
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Thaws, SIGKILLs and waits out every process still in the sandbox's
    /// cgroups, then removes the cgroup directories (children first).
    pub async fn kill_and_remove(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pids = self.processes(id);
            if pids.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                return Err(RuntimeError::KillProcesses {
                    id: id.clone(),
                    detail: format!("pids {pids:?} survived SIGKILL for 10 s"),
                });
            }
            self.thaw(id);
            for pid in pids {
                // ESRCH: already gone.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for d in self.dirs(id) {
            remove_cgroup_tree(&d).await?;
        }
        Ok(())
    }

    /// Whether every task of the sandbox is frozen: `FROZEN` in the v1
    /// freezer (not `FREEZING`), `frozen 1` in cgroup2's `cgroup.events`.
    /// True when the host has neither (nothing to wait for).
    pub fn is_frozen(&self, id: &SandboxId) -> bool {
        if let Some(f) = self.v1("freezer") {
            return std::fs::read_to_string(self.dir_in(f, id).join("freezer.state"))
                .is_ok_and(|s| s.trim() == "FROZEN");
        }
        if let Some(u) = self.unified() {
            return std::fs::read_to_string(self.dir_in(u, id).join("cgroup.events"))
                .is_ok_and(|s| s.lines().any(|l| l.trim() == "frozen 1"));
        }
        true
    }

    pub fn thaw(&self, id: &SandboxId) {
        // Frozen tasks do not die from SIGKILL until thawed. Best effort: the
        // files are absent when the sandbox was never frozen in that version.
        if let Some(f) = self.v1("freezer") {
            let _ = std::fs::write(self.dir_in(f, id).join("freezer.state"), "THAWED");
        }
        if let Some(u) = self.unified() {
            let _ = std::fs::write(self.dir_in(u, id).join("cgroup.freeze"), "0");
        }
    }
}

fn collect_procs(dir: &Path, out: &mut Vec<i32>) {
    if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect_procs(&e.path(), out);
            }
        }
    }
}

/// rmdir of a cgroup and its child cgroups. Retries EBUSY briefly: the
/// kernel releases a cgroup a moment after its last task is reaped.
async fn remove_cgroup_tree(dir: &Path) -> Result<(), RuntimeError> {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                Box::pin(remove_cgroup_tree(&e.path())).await?;
            }
        }
    }
    let mut tries = 0;
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 200 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(source) => {
                return Err(RuntimeError::RemoveCgroup {
                    path: dir.to_path_buf(),
                    source,
                })
            }
        }
    }
}

fn read_u64(path: &Path) -> Result<u64, RuntimeError> {
    let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::ReadFile {
        path: path.to_path_buf(),
        source,
    })?;
    let t = text.trim();
    if t == "max" {
        return Ok(u64::MAX);
    }
    t.parse().map_err(|_| RuntimeError::ParseState {
        detail: format!("{path:?} holds {t:?}, not a number"),
    })
}

/// The value of `key N` in a flat keyed file (memory.events, cpu.stat,
/// memory.oom_control); 0 when the key is absent (older kernels).
fn read_key(path: &Path, key: &str) -> Result<u64, RuntimeError> {
    let text = std::fs::read_to_string(path).map_err(|source| RuntimeError::ReadFile {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(parse_key(&text, key))
}

pub fn parse_key(text: &str, key: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
90 23 0:99 / /var/lib/a\\040b/rootfs rw - overlay overlay rw,lowerdir=/t
91 23 0:32 / /elsewhere/memory rw,relatime - cgroup cgroup rw,memory
";

    #[test]
    fn parses_mountinfo_with_escapes() {
        let m = parse_mountinfo(MOUNTINFO);
        assert_eq!(m.len(), 7);
        assert_eq!(m[5].mount_point, PathBuf::from("/var/lib/a b/rootfs"));
        assert_eq!(m[5].fs_type, "overlay");
    }

    #[test]
    fn finds_hierarchies_once_each() {
        let h = parse_cgroup_hierarchies(&parse_mountinfo(MOUNTINFO));
        assert_eq!(h.len(), 4);
        assert_eq!(h[1].controllers, vec!["memory".to_string()]);
        assert_eq!(h[2].controllers, vec!["name=systemd".to_string()]);
        assert!(h[3].unified);
        let layout = CgroupLayout {
            hierarchies: h,
            parent: "aviary".into(),
        };
        let id: SandboxId = "sbx-abcdefghijklmnopqrst".parse().unwrap();
        assert_eq!(
            layout.dirs(&id)[1],
            PathBuf::from("/sys/fs/cgroup/memory/aviary/sbx-abcdefghijklmnopqrst")
        );
    }

    #[test]
    fn keyed_files() {
        let oom = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_key(oom, "oom_kill"), 3);
        assert_eq!(parse_key(oom, "missing"), 0);
    }
}
