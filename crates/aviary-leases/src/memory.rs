//! [`MemoryLeaseStore`]: the lease store in a mutex-guarded map, for unit
//! tests at the seams. Clones share one storage, so "restarting" it is
//! cloning it; nothing survives the process.

use crate::{expiry, fence_rule, Fence, Lease, LeaseError, LeaseStore};
use async_trait::async_trait;
use aviary_core::{LeaseToken, SandboxId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use time::OffsetDateTime;

#[derive(Default)]
struct Slot {
    /// The highest token ever granted for this sandbox.
    counter: u64,
    lease: Option<Lease>,
}

impl Slot {
    fn live(&self, now: OffsetDateTime) -> Option<&Lease> {
        self.lease.as_ref().filter(|l| now < l.expires_at)
    }
}

/// An in-memory [`LeaseStore`]. Sandboxes must be made known with
/// [`MemoryLeaseStore::add_sandbox`] first (others are `NotFound`, as in the
/// database-backed stores).
#[derive(Clone, Default)]
pub struct MemoryLeaseStore {
    slots: Arc<Mutex<HashMap<SandboxId, Slot>>>,
}

impl MemoryLeaseStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes a sandbox known to the store (idempotent; keeps its counter).
    pub fn add_sandbox(&self, sandbox: &SandboxId) {
        self.lock().entry(sandbox.clone()).or_default();
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<SandboxId, Slot>> {
        // A panic while holding the lock cannot leave a slot half-written
        // (every update is a single assignment), so a poisoned map is usable.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
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
        let mut slots = self.lock();
        let slot = slots.get_mut(sandbox).ok_or(LeaseError::NotFound)?;
        if let Some(l) = slot.live(now) {
            return Err(LeaseError::Held {
                owner: l.owner.clone(),
                expires_at: l.expires_at,
            });
        }
        slot.counter += 1;
        let lease = Lease {
            sandbox_id: sandbox.clone(),
            owner: owner.to_owned(),
            token: LeaseToken::generate(slot.counter),
            acquired_at: now,
            expires_at,
        };
        slot.lease = Some(lease.clone());
        Ok(lease)
    }

    async fn renew(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let expires_at = expiry(now, ttl)?;
        let mut slots = self.lock();
        let slot = slots.get_mut(sandbox).ok_or(LeaseError::NotFound)?;
        match slot.lease.as_mut() {
            Some(l) if now < l.expires_at && l.token.matches(&token) => {
                l.expires_at = expires_at;
                Ok(l.clone())
            }
            _ => Err(LeaseError::StaleToken),
        }
    }

    async fn release(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        now: OffsetDateTime,
    ) -> Result<(), LeaseError> {
        let mut slots = self.lock();
        let slot = slots.get_mut(sandbox).ok_or(LeaseError::NotFound)?;
        match slot.live(now) {
            Some(l) if l.token.matches(&token) => {
                slot.lease = None;
                Ok(())
            }
            _ => Err(LeaseError::StaleToken),
        }
    }

    async fn current(
        &self,
        sandbox: &SandboxId,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, LeaseError> {
        let slots = self.lock();
        let slot = slots.get(sandbox).ok_or(LeaseError::NotFound)?;
        Ok(slot.live(now).cloned())
    }

    async fn check(
        &self,
        sandbox: &SandboxId,
        token: Option<LeaseToken>,
        now: OffsetDateTime,
    ) -> Result<Fence, LeaseError> {
        let slots = self.lock();
        let slot = slots.get(sandbox).ok_or(LeaseError::NotFound)?;
        fence_rule(slot.live(now).map(|l| l.token), token)
    }

    async fn expire_due(&self, now: OffsetDateTime) -> Result<Vec<Lease>, LeaseError> {
        let mut slots = self.lock();
        let mut expired = Vec::new();
        for slot in slots.values_mut() {
            if slot.lease.as_ref().is_some_and(|l| l.expires_at <= now) {
                expired.extend(slot.lease.take());
            }
        }
        Ok(expired)
    }

    async fn revoke(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
        let mut slots = self.lock();
        let slot = slots.get_mut(sandbox).ok_or(LeaseError::NotFound)?;
        slot.lease = None;
        Ok(())
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
