//! Which replica runs the registry-wide background loops: lease expiry and
//! chunk collection. With several replicas on one registry and coordination
//! store, exactly one may run them at a time, or two replicas would both end
//! one lease or both delete one chunk. (TTL expiry, idle hibernation, pool
//! refill and the envd health probe are per node: every replica runs them for
//! the compute it drives.) The leader is whoever holds the
//! lock `leader/background` (TTL [`LEADER_TTL`], kept alive in the
//! background); when it dies its lock runs out and another replica takes it
//! within one TTL plus one poll. In the embedded default the lock is the
//! in-process one and this process always leads.
//!
//! A deposed leader that is still mid-round finishes that round; every write
//! it makes goes through the registry's version check, so work it races a
//! new leader on is refused as a conflict rather than applied twice.

use aviary_leases::{LockName, LockRequest, Locks};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long a leader's lock lives without a renewal (renewed every third).
pub const LEADER_TTL: Duration = Duration::from_secs(6);

/// Whether this replica leads, updated by [`Leadership::run`].
#[derive(Clone)]
pub struct Leadership {
    rx: watch::Receiver<bool>,
}

impl Leadership {
    /// Starts campaigning for `leader/background` as `owner`; the returned
    /// task runs until aborted.
    pub fn run(
        locks: Arc<dyn Locks>,
        owner: String,
        ttl: Duration,
    ) -> (Leadership, tokio::task::JoinHandle<()>) {
        let (tx, rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let req = LockRequest::new(LockName::new("leader", "background"), owner, ttl);
            let poll = (ttl / 3).max(Duration::from_millis(50));
            loop {
                match locks.try_acquire(&req).await {
                    Ok(Some(guard)) => {
                        let guard = guard.keep_alive();
                        tracing::info!(owner = %req.owner, "this replica now runs the background loops");
                        let _ = tx.send(true);
                        while guard.is_held() {
                            tokio::time::sleep(poll).await;
                        }
                        let _ = tx.send(false);
                        tracing::warn!(owner = %req.owner, "lost the background-loop lock; campaigning again");
                    }
                    Ok(None) => {}
                    Err(e) => {
                        let _ = tx.send(false);
                        tracing::warn!(error = %e, "leader lock unavailable");
                    }
                }
                tokio::time::sleep(poll).await;
            }
        });
        (Leadership { rx }, task)
    }

    /// Whether this replica leads right now.
    pub fn is_leader(&self) -> bool {
        *self.rx.borrow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_leader_and_a_takeover_when_it_goes() {
        let locks: Arc<dyn Locks> = Arc::new(aviary_leases::InProcessLocks::new());
        let ttl = Duration::from_millis(300);
        let (a, task_a) = Leadership::run(locks.clone(), "replica-a".into(), ttl);
        let wait = |l: Leadership| async move {
            for _ in 0..100 {
                if l.is_leader() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            false
        };
        assert!(wait(a.clone()).await, "the only replica leads");
        let (b, task_b) = Leadership::run(locks.clone(), "replica-b".into(), ttl);
        tokio::time::sleep(ttl * 2).await;
        assert!(a.is_leader() && !b.is_leader(), "exactly one leader");
        // replica a dies: its keep-alive goes with it, the lock runs out
        task_a.abort();
        let _ = task_a.await;
        assert!(wait(b.clone()).await, "b takes over after a's ttl");
        task_b.abort();
    }
}
