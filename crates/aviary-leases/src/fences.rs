//! [`FenceAuthority`]: where fencing numbers come from when the live lease
//! is kept in a store that may lose it.
//!
//! In the embedded default the lease table and the fencing counter sit in
//! one SQLite row, so one transaction grants the lease and bumps the
//! counter. A networked lease store (Redis) is fast and has TTLs, but it can
//! restart empty or fail over to a replica that missed the last writes. If it
//! also kept the counter, a restart could hand out a fence that was already
//! used, and a holder that lost its lease would look current again.
//!
//! So the counter lives with the source of record (the registry: SQLite or
//! PostgreSQL), which is durable and transactional, and a networked lease
//! store asks it for every new fence. Losing the lease store then costs
//! only liveness (leases vanish early and must be re-acquired), never
//! safety: the next grant still gets a fence above every fence ever issued,
//! and every registry write checks the fence it carries against this
//! counter ([`crate::Fence`], `FenceCheck::Counter` in `aviary-registry`).

use crate::LeaseError;
use async_trait::async_trait;
use aviary_core::SandboxId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The durable, per-sandbox fencing counter.
#[async_trait]
pub trait FenceAuthority: Send + Sync {
    /// Atomically increments the sandbox's counter and returns the new
    /// value: strictly increasing per sandbox, forever, across restarts.
    /// `NotFound` for a sandbox the authority does not know.
    async fn next_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError>;

    /// The highest fence handed out so far (0 before the first).
    /// `NotFound` for a sandbox the authority does not know.
    async fn current_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError>;
}

/// A [`FenceAuthority`] in a map, for unit tests at the seams. Clones share
/// one map; nothing survives the process.
#[derive(Clone, Default)]
pub struct MemoryFences {
    counters: Arc<Mutex<HashMap<SandboxId, u64>>>,
}

impl MemoryFences {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `sandbox` known, with its counter at 0 (kept if already known).
    pub fn register(&self, sandbox: &SandboxId) {
        self.lock().entry(sandbox.clone()).or_insert(0);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SandboxId, u64>> {
        self.counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl FenceAuthority for MemoryFences {
    async fn next_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError> {
        let mut map = self.lock();
        let c = map.get_mut(sandbox).ok_or(LeaseError::NotFound)?;
        *c += 1;
        Ok(*c)
    }

    async fn current_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError> {
        self.lock()
            .get(sandbox)
            .copied()
            .ok_or(LeaseError::NotFound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_fences_increase_and_know_their_sandboxes() {
        let f = MemoryFences::new();
        let s = SandboxId::generate();
        assert_eq!(f.next_fence(&s).await.unwrap_err(), LeaseError::NotFound);
        f.register(&s);
        assert_eq!(f.current_fence(&s).await.unwrap(), 0);
        assert_eq!(f.next_fence(&s).await.unwrap(), 1);
        assert_eq!(f.next_fence(&s).await.unwrap(), 2);
        f.register(&s);
        assert_eq!(
            f.current_fence(&s).await.unwrap(),
            2,
            "register keeps the counter"
        );
    }
}
