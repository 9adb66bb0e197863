//! The one reaper of the process: every child, including orphans re-parented to
//! envd (as PID 1 or as a child subreaper), is reaped here and nowhere else.
//!
//! Invariants: children are spawned with the waiter table locked, and the reaper
//! only reaps while holding that same lock after finding the exited pid with
//! `waitid(WNOWAIT)`. So a child that exits before `spawn` returns is still
//! reported to its waiter (it is registered before the reaper can reap it), and a
//! child that std's `Command::spawn` reaps itself (exec failure) is never stolen
//! from under it. Exits of unregistered pids (orphans) are reaped and dropped.
//!
//! Concurrency: one signal thread calls [`Reaper::reap_available`] on every
//! SIGCHLD; connection threads call [`Reaper::spawn`] and block on the returned
//! receiver.

use std::collections::HashMap;
use std::io;
use std::process::{Child, Command};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;

use crate::sys;

#[derive(Default)]
pub struct Reaper {
    waiters: Mutex<HashMap<i32, Sender<libc::c_int>>>,
}

impl Reaper {
    /// Spawns `cmd` and registers its pid; the receiver yields the raw wait status.
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, Receiver<libc::c_int>)> {
        let mut waiters = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        let child = cmd.spawn()?;
        let (tx, rx) = channel();
        waiters.insert(child.id() as i32, tx);
        Ok((child, rx))
    }

    /// Reaps every child that has exited; returns how many were reaped.
    pub fn reap_available(&self) -> usize {
        let mut reaped = 0;
        while let Some(pid) = sys::peek_exited_child() {
            let mut waiters = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(status) = sys::reap(pid) {
                reaped += 1;
                if let Some(tx) = waiters.remove(&pid) {
                    // The waiter may have gone away (connection thread died): fine.
                    let _ = tx.send(status);
                }
            }
        }
        reaped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn reap_until(reaper: &Reaper, rx: &Receiver<libc::c_int>) -> libc::c_int {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            reaper.reap_available();
            if let Ok(s) = rx.try_recv() {
                return s;
            }
            assert!(Instant::now() < deadline, "child never reaped");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn reports_exit_of_fast_child_and_reaps_orphans() {
        sys::set_child_subreaper().unwrap();
        let reaper = Reaper::default();
        // Exits (very likely) before spawn returns: must still be reported.
        let (_c, rx) = reaper
            .spawn(Command::new("/bin/sh").args(["-c", "exit 3"]))
            .unwrap();
        // Leaves an orphan that is re-parented to us (subreaper) and must be reaped.
        let (_c2, rx2) = reaper
            .spawn(Command::new("/bin/sh").args(["-c", "sleep 0.2 & exit 0"]))
            .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(sys::decode_wait_status(reap_until(&reaper, &rx)), (3, None));
        assert_eq!(
            sys::decode_wait_status(reap_until(&reaper, &rx2)),
            (0, None)
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut orphans = 0;
        while orphans == 0 {
            orphans += reaper.reap_available();
            assert!(Instant::now() < deadline, "orphan never reaped");
            std::thread::sleep(Duration::from_millis(5));
        }
        // A spawn that fails in the child (exec error) is reported as an error, not stolen.
        let err = reaper
            .spawn(&mut Command::new("/nonexistent/prog"))
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
