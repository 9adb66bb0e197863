//! Ending every process of the previous lease holder before the fence moves.
//!
//! Invariant: when the fence changes value, envd first kills every process in
//! the sandbox except itself and waits until they are gone and reaped, so a new
//! lease starts with no process left from the previous holder: no exec still
//! running under an old token, and no daemon an exec left behind (`setsid`,
//! double fork and all).
//!
//! - As PID 1: `kill(-1, SIGKILL)` reaches every process of the sandbox's PID
//!   namespace but envd itself (including processes that joined it from
//!   outside, e.g. a runtime exec); `kill(-1, 0)` failing with `ESRCH` means
//!   nothing is left.
//! - As an ordinary process (tests): the process groups of running execs and
//!   every descendant of envd, found through the parent links in `/proc`.
//!   envd is then a child subreaper, so the orphans of its execs (daemons
//!   included) stay its descendants. Pids are read and then signalled, so a
//!   pid recycled in between could be hit: acceptable for the test mode only.
//!
//! The wait is bounded by [`SWEEP_TIMEOUT`]: a process stuck in uninterruptible
//! sleep survives SIGKILL until it wakes, and the caller must then report an
//! error rather than pretend the sandbox is clean.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::server::Envd;
use crate::sys;

/// Longest envd waits for killed processes to disappear.
pub const SWEEP_TIMEOUT: Duration = Duration::from_secs(5);
const SWEEP_TICK: Duration = Duration::from_millis(5);

/// Kills every process of the sandbox but envd and waits until all are reaped.
/// `Err(n)`: `n` processes (0 when they cannot be counted) were still there
/// after [`SWEEP_TIMEOUT`].
pub fn end_all_processes(envd: &Envd) -> Result<(), usize> {
    let deadline = Instant::now() + SWEEP_TIMEOUT;
    loop {
        envd.reaper.reap_available();
        let left = if envd.pid1 {
            if !sys::any_other_process() {
                return Ok(());
            }
            sys::kill_all(libc::SIGKILL);
            count_other_processes()
        } else {
            envd.kill_running_groups();
            let descendants = descendants_of(sys::getpid());
            if descendants.is_empty() {
                return Ok(());
            }
            for &pid in &descendants {
                sys::kill_pid(pid, libc::SIGKILL);
            }
            descendants.len()
        };
        if Instant::now() >= deadline {
            return Err(left);
        }
        std::thread::sleep(SWEEP_TICK);
    }
}

/// Processes visible in `/proc` other than PID 1 (0 when `/proc` is unreadable).
fn count_other_processes() -> usize {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
                .filter(|&pid| pid != 1)
                .count()
        })
        .unwrap_or(0)
}

/// Every live or zombie descendant of `root`, from the parent links in `/proc`.
fn descendants_of(root: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // Processes that exit meanwhile are simply skipped.
        if let Some(ppid) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .as_deref()
            .and_then(parent_pid)
        {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut out = Vec::new();
    let mut queue = vec![root];
    while let Some(p) = queue.pop() {
        if let Some(kids) = children.get(&p) {
            out.extend_from_slice(kids);
            queue.extend_from_slice(kids);
        }
    }
    out
}

/// The parent pid from the text of `/proc/<pid>/stat`: `pid (comm) state ppid …`,
/// where comm may itself contain spaces and parentheses.
fn parent_pid(stat: &str) -> Option<i32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parent_pid_survives_hostile_command_names() {
        assert_eq!(parent_pid("42 (sh) S 7 42 42 0"), Some(7));
        assert_eq!(parent_pid("42 (a) b) R 9 1 1"), Some(9));
        assert_eq!(parent_pid("42 (x"), None);
    }

    #[test]
    fn descendants_include_grandchildren() {
        let mut child = std::process::Command::new("/bin/sh")
            .args(["-c", "sleep 5 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        let grandchild: i32 = line.trim().parse().unwrap();
        let found = descendants_of(sys::getpid());
        let _ = child.kill();
        sys::kill_pid(grandchild, libc::SIGKILL);
        let _ = child.wait();
        assert!(found.contains(&(child.id() as i32)), "{found:?}");
        assert!(found.contains(&grandchild), "{found:?}");
    }
}
