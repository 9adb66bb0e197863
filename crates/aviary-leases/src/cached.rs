//! [`CachedLeaseStore`]: a lease store's answers kept in memory, for a store
//! that this process alone writes (the embedded SQLite store, whose locks
//! are in-process too), so the fencing check of an exec or a file write is
//! a map lookup instead of a database read.
//!
//! Correctness rests on one rule: every change of a sandbox's lease is a
//! call on this wrapper. Each such call forgets the sandbox's entry and moves
//! the wrapper's epoch **before** it reaches the inner store and again
//! **after** it returns (whatever it returned), and a read fills the cache
//! only if the epoch did not move while it read the inner store. So:
//! - after a change returned (a revoke, a release, an expiry sweep, a
//!   grant that took the sandbox over), no check answers from the view
//!   before it: the entry is gone and no read that began earlier can put it
//!   back;
//! - a check that overlaps a change may answer either side of it, exactly
//!   as a check on the inner store may; the fencing that orders such a
//!   race is where it always was: the registry's counter check in the
//!   write's transaction, and envd, which refuses a fence it has moved past
//!   (a new grant reaches envd before it is answered).
//!
//! Expiry is by time: a cached lease counts as live only while
//! `now < expires_at`, the inner store's own rule, so a lease that ran out
//! is refused at once, before any sweep deletes it.
//!
//! A store that other processes write (Redis or PostgreSQL shared by
//! replicas) must not be wrapped: their changes would not pass through this
//! wrapper. The server wraps only the embedded store.

use crate::{fence_rule, Fence, Lease, LeaseError, LeaseStore};
use async_trait::async_trait;
use aviary_core::{LeaseToken, SandboxId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use time::OffsetDateTime;

/// Entries kept at most; past it the cache starts over (a sandbox's entry
/// goes with its revoke on destroy, so this bounds only a burst).
const MAX_ENTRIES: usize = 65_536;

/// A [`LeaseStore`] whose reads of one sandbox's lease are answered from
/// memory until that sandbox's lease changes through this wrapper.
pub struct CachedLeaseStore {
    inner: Arc<dyn LeaseStore>,
    state: Mutex<CacheState>,
}

#[derive(Default)]
struct CacheState {
    /// Moves on every change (before and after it reaches the store).
    epoch: u64,
    /// The stored lease row per sandbox as last read (`None`: no lease row;
    /// an expired row is kept as it is and judged by `now`).
    views: HashMap<SandboxId, Option<Lease>>,
}

impl CachedLeaseStore {
    pub fn new(inner: Arc<dyn LeaseStore>) -> Self {
        CachedLeaseStore {
            inner,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CacheState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets `sandbox` (every sandbox when `None`) and moves the epoch.
    fn forget(&self, sandbox: Option<&SandboxId>) {
        let mut s = self.lock();
        s.epoch += 1;
        match sandbox {
            Some(id) => {
                s.views.remove(id);
            }
            None => s.views.clear(),
        }
    }

    /// Runs a change on the inner store, forgetting the sandbox before
    /// and after it.
    async fn changing<T>(
        &self,
        sandbox: Option<&SandboxId>,
        change: impl std::future::Future<Output = Result<T, LeaseError>>,
    ) -> Result<T, LeaseError> {
        self.forget(sandbox);
        let r = change.await;
        self.forget(sandbox);
        r
    }

    /// The sandbox's live lease at `now`, from memory when known.
    async fn live(
        &self,
        sandbox: &SandboxId,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, LeaseError> {
        let epoch = {
            let s = self.lock();
            if let Some(view) = s.views.get(sandbox) {
                return Ok(view.clone().filter(|l| now < l.expires_at));
            }
            s.epoch
        };
        // The inner store judges expiry by the `now` it is given; what it
        // answers is the row as it stands (a lease it calls expired is no
        // row for this `now`, and is not cached as one: a later `now` must
        // not see it either, and `None` says that).
        let read = self.inner.current(sandbox, now).await?;
        let mut s = self.lock();
        if s.epoch == epoch {
            if s.views.len() >= MAX_ENTRIES {
                s.views.clear();
            }
            s.views.insert(sandbox.clone(), read.clone());
        }
        Ok(read)
    }
}

#[async_trait]
impl LeaseStore for CachedLeaseStore {
    async fn acquire(
        &self,
        sandbox: &SandboxId,
        owner: &str,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        self.changing(Some(sandbox), self.inner.acquire(sandbox, owner, ttl, now))
            .await
    }

    async fn renew(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        self.changing(Some(sandbox), self.inner.renew(sandbox, token, ttl, now))
            .await
    }

    async fn release(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        now: OffsetDateTime,
    ) -> Result<(), LeaseError> {
        self.changing(Some(sandbox), self.inner.release(sandbox, token, now))
            .await
    }

    async fn current(
        &self,
        sandbox: &SandboxId,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, LeaseError> {
        self.live(sandbox, now).await
    }

    async fn check(
        &self,
        sandbox: &SandboxId,
        token: Option<LeaseToken>,
        now: OffsetDateTime,
    ) -> Result<Fence, LeaseError> {
        let live = self.live(sandbox, now).await?;
        fence_rule(live.map(|l| l.token), token)
    }

    async fn expire_due(&self, now: OffsetDateTime) -> Result<Vec<Lease>, LeaseError> {
        // which sandboxes it touches is known only afterwards: forget all
        self.changing(None, self.inner.expire_due(now)).await
    }

    async fn revoke(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
        self.changing(Some(sandbox), self.inner.revoke(sandbox))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::{self, LeaseHarness};
    use crate::MemoryLeaseStore;
    use time::macros::datetime;

    const T0: OffsetDateTime = datetime!(2030-01-01 0:00 UTC);
    const MINUTE: Duration = Duration::from_secs(60);

    struct Harness(MemoryLeaseStore);

    #[async_trait]
    impl LeaseHarness for Harness {
        type Store = CachedLeaseStore;
        async fn open(&self) -> Self::Store {
            // a restart is a new process: a new, empty cache
            CachedLeaseStore::new(Arc::new(self.0.clone()))
        }
        async fn create_sandbox(&self, _store: &Self::Store) -> SandboxId {
            let id = aviary_core::SandboxId::generate();
            self.0.add_sandbox(&id);
            id
        }
    }

    #[tokio::test]
    async fn passes_the_lease_conformance_suite() {
        conformance::run_all(&Harness(MemoryLeaseStore::new())).await;
    }

    fn store_with_sandbox() -> (CachedLeaseStore, SandboxId) {
        let inner = MemoryLeaseStore::new();
        let id = aviary_core::SandboxId::generate();
        inner.add_sandbox(&id);
        (CachedLeaseStore::new(Arc::new(inner)), id)
    }

    #[tokio::test]
    async fn a_check_after_each_change_sees_it() {
        let (s, id) = store_with_sandbox();
        // cached: no lease
        assert_eq!(s.check(&id, None, T0).await.unwrap(), Fence::Unleased);
        let a = s.acquire(&id, "a", MINUTE, T0).await.unwrap();
        assert_eq!(
            s.check(&id, None, T0).await.unwrap_err(),
            LeaseError::LeaseRequired
        );
        assert_eq!(
            s.check(&id, Some(a.token), T0).await.unwrap(),
            Fence::Leased(a.token)
        );
        // revoked: the cached lease is gone with it
        s.revoke(&id).await.unwrap();
        assert_eq!(
            s.check(&id, Some(a.token), T0).await.unwrap_err(),
            LeaseError::StaleToken
        );
        // taken over: the old token is stale, the new one good
        let b = s.acquire(&id, "b", MINUTE, T0).await.unwrap();
        assert_eq!(
            s.check(&id, Some(b.token), T0).await.unwrap(),
            Fence::Leased(b.token)
        );
        s.release(&id, b.token, T0).await.unwrap();
        let c = s.acquire(&id, "c", MINUTE, T0).await.unwrap();
        assert_eq!(
            s.check(&id, Some(b.token), T0).await.unwrap_err(),
            LeaseError::StaleToken
        );
        assert_eq!(
            s.check(&id, Some(a.token), T0).await.unwrap_err(),
            LeaseError::StaleToken
        );
        // a cached lease runs out by the clock, before any sweep
        let later = T0 + time::Duration::minutes(2);
        assert_eq!(
            s.check(&id, Some(c.token), later).await.unwrap_err(),
            LeaseError::StaleToken
        );
        assert_eq!(s.current(&id, later).await.unwrap(), None);
        // a renewal is seen at once
        let renewed = s.renew(&id, c.token, MINUTE * 10, T0).await.unwrap();
        assert_eq!(
            s.check(&id, Some(c.token), later).await.unwrap(),
            Fence::Leased(renewed.token)
        );
        // and the expiry sweep
        let much_later = T0 + time::Duration::hours(1);
        assert_eq!(s.expire_due(much_later).await.unwrap().len(), 1);
        assert_eq!(s.check(&id, None, T0).await.unwrap(), Fence::Unleased);
    }

    /// A store whose reads wait, once armed, between reading and
    /// answering: a read that began before a change and ends after it.
    #[derive(Clone)]
    struct SlowReads {
        inner: MemoryLeaseStore,
        gate: Arc<Mutex<Option<SlowRead>>>,
    }

    struct SlowRead {
        read: tokio::sync::oneshot::Sender<()>,
        answer: tokio::sync::oneshot::Receiver<()>,
    }

    #[async_trait]
    impl LeaseStore for SlowReads {
        async fn acquire(
            &self,
            sandbox: &SandboxId,
            owner: &str,
            ttl: Duration,
            now: OffsetDateTime,
        ) -> Result<Lease, LeaseError> {
            self.inner.acquire(sandbox, owner, ttl, now).await
        }
        async fn renew(
            &self,
            sandbox: &SandboxId,
            token: LeaseToken,
            ttl: Duration,
            now: OffsetDateTime,
        ) -> Result<Lease, LeaseError> {
            self.inner.renew(sandbox, token, ttl, now).await
        }
        async fn release(
            &self,
            sandbox: &SandboxId,
            token: LeaseToken,
            now: OffsetDateTime,
        ) -> Result<(), LeaseError> {
            self.inner.release(sandbox, token, now).await
        }
        async fn current(
            &self,
            sandbox: &SandboxId,
            now: OffsetDateTime,
        ) -> Result<Option<Lease>, LeaseError> {
            let read = self.inner.current(sandbox, now).await;
            let slow = self.gate.lock().unwrap().take();
            if let Some(SlowRead { read: done, answer }) = slow {
                let _ = done.send(());
                let _ = answer.await;
            }
            read
        }
        async fn check(
            &self,
            sandbox: &SandboxId,
            token: Option<LeaseToken>,
            now: OffsetDateTime,
        ) -> Result<Fence, LeaseError> {
            self.inner.check(sandbox, token, now).await
        }
        async fn expire_due(&self, now: OffsetDateTime) -> Result<Vec<Lease>, LeaseError> {
            self.inner.expire_due(now).await
        }
        async fn revoke(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
            self.inner.revoke(sandbox).await
        }
    }

    #[tokio::test]
    async fn a_read_that_overlapped_a_change_is_not_kept() {
        let inner = MemoryLeaseStore::new();
        let id = aviary_core::SandboxId::generate();
        inner.add_sandbox(&id);
        let slow = SlowReads {
            inner,
            gate: Default::default(),
        };
        let s = Arc::new(CachedLeaseStore::new(Arc::new(slow.clone())));
        let a = s.acquire(&id, "a", MINUTE, T0).await.unwrap();
        // a check reads the lease, then waits before answering
        let (read_tx, read_rx) = tokio::sync::oneshot::channel();
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel();
        *slow.gate.lock().unwrap() = Some(SlowRead {
            read: read_tx,
            answer: answer_rx,
        });
        let overlapping = tokio::spawn({
            let (s, id) = (s.clone(), id.clone());
            async move { s.check(&id, Some(a.token), T0).await }
        });
        read_rx.await.unwrap();
        // the lease is revoked meanwhile, then the read answers
        s.revoke(&id).await.unwrap();
        answer_tx.send(()).unwrap();
        // overlapping the revoke, it may answer either side of it
        let _ = overlapping.await.unwrap();
        // but what it read is not kept: the next check sees the revoke
        assert_eq!(
            s.check(&id, Some(a.token), T0).await.unwrap_err(),
            LeaseError::StaleToken
        );
        // and the same with a take-over
        let b = s.acquire(&id, "b", MINUTE, T0).await.unwrap();
        assert_eq!(
            s.check(&id, Some(b.token), T0).await.unwrap(),
            Fence::Leased(b.token)
        );
        let (read_tx, read_rx) = tokio::sync::oneshot::channel();
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel();
        s.revoke(&id).await.unwrap(); // empties the cache: the next check reads
        *slow.gate.lock().unwrap() = Some(SlowRead {
            read: read_tx,
            answer: answer_rx,
        });
        let overlapping = tokio::spawn({
            let (s, id) = (s.clone(), id.clone());
            async move { s.check(&id, None, T0).await }
        });
        read_rx.await.unwrap();
        let c = s.acquire(&id, "c", MINUTE, T0).await.unwrap();
        answer_tx.send(()).unwrap();
        let _ = overlapping.await.unwrap();
        assert_eq!(
            s.check(&id, None, T0).await.unwrap_err(),
            LeaseError::LeaseRequired,
            "the grant made while the read was under way is seen"
        );
        assert_eq!(
            s.check(&id, Some(c.token), T0).await.unwrap(),
            Fence::Leased(c.token)
        );
    }
}
