//! [`MemoryLeaseStore`]: the lease store in a mutex-guarded map, for unit
//! tests at the seams. Clones share one storage, so "restarting" it is
//! cloning it; nothing survives the process. [`LeaseSlot`] is one sandbox's
//! lease state with the store's rules, which every in-memory store (this
//! one, the in-memory registry's lease table) keeps under its own lock.

use crate::{expiry, fence_rule, Fence, Lease, LeaseError, LeaseStore};
use async_trait::async_trait;
use aviary_core::{LeaseToken, SandboxId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use time::OffsetDateTime;

/// One sandbox's lease and fencing counter, with the [`LeaseStore`] rules
/// as plain methods (`now` and the expiry are the caller's).
#[derive(Clone, Debug, Default)]
pub struct LeaseSlot {
    /// The highest fence ever granted for this sandbox; never decreases.
    counter: u64,
    lease: Option<Lease>,
}

impl LeaseSlot {
    /// The highest fence ever granted (0 before the first).
    pub fn counter(&self) -> u64 {
        self.counter
    }

    /// Bumps the counter without granting a lease (a [`crate::FenceAuthority`]
    /// handing a fence to another lease store) and returns it.
    pub fn next_fence(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    /// The lease, unless it has run out at `now`.
    pub fn live(&self, now: OffsetDateTime) -> Option<&Lease> {
        self.lease.as_ref().filter(|l| now < l.expires_at)
    }

    /// A new lease with the next fence, unless one is live (`Held`).
    pub fn acquire(
        &mut self,
        sandbox: &SandboxId,
        owner: &str,
        expires_at: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        if let Some(l) = self.live(now) {
            return Err(LeaseError::Held {
                owner: l.owner.clone(),
                expires_at: l.expires_at,
            });
        }
        self.counter += 1;
        let lease = Lease {
            sandbox_id: sandbox.clone(),
            owner: owner.to_owned(),
            token: LeaseToken::generate(self.counter),
            acquired_at: now,
            expires_at,
        };
        self.lease = Some(lease.clone());
        Ok(lease)
    }

    /// Extends the live lease `token` names (else `StaleToken`).
    pub fn renew(
        &mut self,
        token: LeaseToken,
        expires_at: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        match self.lease.as_mut() {
            Some(l) if now < l.expires_at && l.token.matches(&token) => {
                l.expires_at = expires_at;
                Ok(l.clone())
            }
            _ => Err(LeaseError::StaleToken),
        }
    }

    /// Ends the live lease `token` names (else `StaleToken`).
    pub fn release(&mut self, token: LeaseToken, now: OffsetDateTime) -> Result<(), LeaseError> {
        match self.live(now) {
            Some(l) if l.token.matches(&token) => {
                self.lease = None;
                Ok(())
            }
            _ => Err(LeaseError::StaleToken),
        }
    }

    /// The fencing rule against the live lease.
    pub fn check(
        &self,
        token: Option<LeaseToken>,
        now: OffsetDateTime,
    ) -> Result<Fence, LeaseError> {
        fence_rule(self.live(now).map(|l| l.token), token)
    }

    /// Takes the lease out when it has run out at `now`.
    pub fn expire(&mut self, now: OffsetDateTime) -> Option<Lease> {
        if self.lease.as_ref().is_some_and(|l| l.expires_at <= now) {
            self.lease.take()
        } else {
            None
        }
    }

    /// Drops the lease (the counter stays).
    pub fn revoke(&mut self) {
        self.lease = None;
    }
}

/// An in-memory [`LeaseStore`]. Sandboxes must be made known with
/// [`MemoryLeaseStore::add_sandbox`] first (others are `NotFound`, as in the
/// database-backed stores).
#[derive(Clone, Default)]
pub struct MemoryLeaseStore {
    slots: Arc<Mutex<HashMap<SandboxId, LeaseSlot>>>,
}

impl MemoryLeaseStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes a sandbox known to the store (idempotent; keeps its counter).
    pub fn add_sandbox(&self, sandbox: &SandboxId) {
        self.lock().entry(sandbox.clone()).or_default();
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<SandboxId, LeaseSlot>> {
        // A panic while holding the lock cannot leave a slot half-written
        // (every update is a single assignment), so a poisoned map is usable.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot<T>(
        &self,
        sandbox: &SandboxId,
        f: impl FnOnce(&mut LeaseSlot) -> Result<T, LeaseError>,
    ) -> Result<T, LeaseError> {
        f(self.lock().get_mut(sandbox).ok_or(LeaseError::NotFound)?)
    }
}

#[async_trait]
impl LeaseStore for MemoryLeaseStore {
    async fn acquire(
        &self,
        sandbox: &SandboxId,
        owner: &str,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let expires_at = expiry(now, ttl)?;
        self.slot(sandbox, |s| s.acquire(sandbox, owner, expires_at, now))
    }

    async fn renew(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let expires_at = expiry(now, ttl)?;
        self.slot(sandbox, |s| s.renew(token, expires_at, now))
    }

    async fn release(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        now: OffsetDateTime,
    ) -> Result<(), LeaseError> {
        self.slot(sandbox, |s| s.release(token, now))
    }

    async fn current(
        &self,
        sandbox: &SandboxId,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, LeaseError> {
        self.slot(sandbox, |s| Ok(s.live(now).cloned()))
    }

    async fn check(
        &self,
        sandbox: &SandboxId,
        token: Option<LeaseToken>,
        now: OffsetDateTime,
    ) -> Result<Fence, LeaseError> {
        self.slot(sandbox, |s| s.check(token, now))
    }

    async fn expire_due(&self, now: OffsetDateTime) -> Result<Vec<Lease>, LeaseError> {
        Ok(self
            .lock()
            .values_mut()
            .filter_map(|s| s.expire(now))
            .collect())
    }

    async fn revoke(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
        self.slot(sandbox, |s| {
            s.revoke();
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::{self, LeaseHarness};

    struct MemoryHarness(MemoryLeaseStore);

    #[async_trait]
    impl LeaseHarness for MemoryHarness {
        type Store = MemoryLeaseStore;
        async fn open(&self) -> MemoryLeaseStore {
            self.0.clone()
        }
        async fn create_sandbox(&self, store: &MemoryLeaseStore) -> SandboxId {
            let id = SandboxId::generate();
            store.add_sandbox(&id);
            id
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn memory_store_passes_the_conformance_suite() {
        conformance::run_all(&MemoryHarness(MemoryLeaseStore::new())).await;
    }
}
