//! A container's cgroups, found from its init's `/proc/<pid>/cgroup`
//! (written by the kernel, never by the sandbox): usage counters and the
//! process list, read from the host's cgroup file systems — faster than
//! Docker's stats endpoint, which samples for a second.

use aviary_runtime::{ResourceUsage, RuntimeError};
use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";

/// Where the cgroups of process `pid` are: per v1 controller, or the one
/// unified (v2) dir.
struct Cgroups {
    v1: Vec<(String, String)>,
    unified: Option<String>,
}

impl Cgroups {
    fn of(pid: u32) -> Result<Self, RuntimeError> {
        let path = PathBuf::from(format!("/proc/{pid}/cgroup"));
        let text = std::fs::read_to_string(&path)
            .map_err(|source| RuntimeError::ReadFile { path, source })?;
        Ok(Self::parse(&text))
    }

    fn parse(text: &str) -> Self {
        let mut v1 = Vec::new();
        let mut unified = None;
        for line in text.lines() {
            let mut f = line.splitn(3, ':');
            let (Some(_), Some(ctrls), Some(path)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            if ctrls.is_empty() {
                unified = Some(path.to_string());
            } else {
                for c in ctrls.split(',') {
                    v1.push((c.to_string(), path.to_string()));
                }
            }
        }
        Cgroups { v1, unified }
    }

    /// The dir of v1 controller `ctrl`, or the unified dir on a pure v2 host.
    fn dir(&self, ctrl: &str) -> Option<PathBuf> {
        if let Some((c, p)) = self.v1.iter().find(|(c, _)| c == ctrl) {
            return Some(Path::new(ROOT).join(c).join(p.trim_start_matches('/')));
        }
        if Path::new(ROOT).join("cgroup.controllers").exists() {
            let p = self.unified.as_deref()?;
            return Some(Path::new(ROOT).join(p.trim_start_matches('/')));
        }
        None
    }

    fn is_v1(&self, ctrl: &str) -> bool {
        self.v1.iter().any(|(c, _)| c == ctrl)
    }
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn number(path: &Path) -> u64 {
    read(path)
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or_default()
}

/// `key N` in a keyed file.
fn keyed(path: &Path, key: &str) -> u64 {
    read(path)
        .and_then(|t| {
            t.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse().ok()).flatten()
            })
        })
        .unwrap_or_default()
}

/// The counters of the container whose init is `pid`.
pub fn usage(pid: u32) -> Result<ResourceUsage, RuntimeError> {
    let cg = Cgroups::of(pid)?;
    let mut u = ResourceUsage::default();
    if let Some(mem) = cg.dir("memory") {
        if cg.is_v1("memory") {
            u.memory_current_bytes = number(&mem.join("memory.usage_in_bytes"));
            u.memory_peak_bytes = number(&mem.join("memory.max_usage_in_bytes"));
            u.oom_kills = keyed(&mem.join("memory.oom_control"), "oom_kill");
        } else {
            u.memory_current_bytes = number(&mem.join("memory.current"));
            u.memory_peak_bytes = number(&mem.join("memory.peak")).max(u.memory_current_bytes);
            u.oom_kills = keyed(&mem.join("memory.events"), "oom_kill");
        }
    }
    if cg.is_v1("cpuacct") {
        if let Some(cpu) = cg.dir("cpuacct") {
            u.cpu_usage_ns = number(&cpu.join("cpuacct.usage"));
        }
    } else if let Some(cpu) = cg.dir("cpu") {
        u.cpu_usage_ns = keyed(&cpu.join("cpu.stat"), "usage_usec").saturating_mul(1000);
    }
    if let Some(pids) = cg.dir("pids") {
        u.pids_current = number(&pids.join("pids.current"));
    }
    Ok(u)
}

/// Every process of the container whose init is `pid` (its freezer cgroup
/// and the cgroups below it).
pub fn processes(id: &aviary_core::SandboxId, pid: u32) -> Result<Vec<u32>, RuntimeError> {
    let cg = Cgroups::of(pid)?;
    let dir = cg
        .dir("freezer")
        .ok_or_else(|| RuntimeError::KillProcesses {
            id: id.clone(),
            detail: format!("no freezer cgroup for its init {pid}"),
        })?;
    let mut out = Vec::new();
    collect(&dir, &mut out);
    Ok(out)
}

fn collect(dir: &Path, out: &mut Vec<u32>) {
    if let Some(text) = read(&dir.join("cgroup.procs")) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
    }
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect(&e.path(), out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_v1_hybrid_and_v2_lines() {
        let cg = Cgroups::parse(
            "9:name=systemd:/docker/abc\n4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/docker/abc\n",
        );
        assert!(cg.is_v1("memory") && cg.is_v1("cpuacct") && cg.is_v1("cpu"));
        assert_eq!(
            cg.dir("memory").unwrap(),
            PathBuf::from("/sys/fs/cgroup/memory/docker/abc")
        );
        assert_eq!(cg.unified.as_deref(), Some("/docker/abc"));
    }

    #[test]
    fn keyed_files_are_read_by_key() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("memory.oom_control");
        std::fs::write(&p, "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n").unwrap();
        assert_eq!(keyed(&p, "oom_kill"), 3);
        assert_eq!(keyed(&p, "missing"), 0);
    }
}
