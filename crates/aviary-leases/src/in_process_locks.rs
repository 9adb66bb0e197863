//! [`InProcessLocks`]: the embedded default [`Locks`] backend, for one
//! control-plane process.
//!
//! One map from name to slot behind a `std::sync::Mutex` (held for a few
//! map operations, never across an await). A slot has the current holding
//! (owner, a token unique to this grant, expiry on tokio's clock, so tests
//! can pause time) and a `Notify` that wakes waiters when the holding is
//! released. Waiters also wake when the holder's TTL runs out. Waiting is
//! not FIFO: whoever retries first after a release wins. A slot goes away
//! when it is neither held nor waited for, so the map is as small as the
//! number of locks in use.

use crate::locks::{HeldLock, LockError, LockGuard, LockHolder, LockName, LockRequest, Locks};
use async_trait::async_trait;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Locks that live in this process (the embedded default).
#[derive(Clone, Default)]
pub struct InProcessLocks {
    state: Arc<State>,
}

impl InProcessLocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of locks held or waited for (for tests of the map's cleanup).
    pub fn slots_in_use(&self) -> usize {
        self.state.lock().len()
    }
}

#[derive(Default)]
struct State {
    slots: Mutex<HashMap<LockName, Slot>>,
    next_token: AtomicU64,
}

struct Slot {
    holding: Option<Holding>,
    /// Wakes waiters on release; every waiter holds a clone while it waits.
    freed: Arc<Notify>,
}

struct Holding {
    owner: String,
    token: u64,
    expires_at: Instant,
}

/// The outcome of one attempt.
enum Attempt {
    Taken(LockGuard),
    Held {
        holder: String,
        expires_at: Instant,
        freed: tokio::sync::futures::OwnedNotified,
    },
}

impl State {
    fn lock(&self) -> MutexGuard<'_, HashMap<LockName, Slot>> {
        // every update of the map is one assignment, so a map poisoned by a
        // panic elsewhere is still consistent
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the lock, or says who holds it and registers for its release.
    fn attempt(self: &Arc<Self>, req: &LockRequest) -> Result<Attempt, LockError> {
        let now = Instant::now();
        let expires_at = expiry(now, req.ttl)?;
        let mut slots = self.lock();
        let slot = slots.entry(req.name.clone()).or_insert_with(|| Slot {
            holding: None,
            freed: Arc::new(Notify::new()),
        });
        if let Some(h) = slot.holding.as_ref().filter(|h| h.expires_at > now) {
            return Ok(Attempt::Held {
                holder: h.owner.clone(),
                expires_at: h.expires_at,
                // registered while the map is locked: a release from now on
                // wakes it
                freed: slot.freed.clone().notified_owned(),
            });
        }
        let token = self.next_token.fetch_add(1, Ordering::SeqCst);
        slot.holding = Some(Holding {
            owner: req.owner.clone(),
            token,
            expires_at,
        });
        let held = Arc::new(InProcessHolding {
            state: self.clone(),
            name: req.name.clone(),
            token,
        });
        Ok(Attempt::Taken(LockGuard::new(req, held)))
    }

    /// Drops the slot when nobody holds or waits for it.
    fn forget_if_unused(slots: &mut HashMap<LockName, Slot>, name: &LockName) {
        if slots
            .get(name)
            .is_some_and(|s| s.holding.is_none() && Arc::strong_count(&s.freed) == 1)
        {
            slots.remove(name);
        }
    }

    /// Ends the holding `token` of `name` (if it is still that one) and
    /// wakes the waiters.
    fn end(&self, slots: &mut HashMap<LockName, Slot>, name: &LockName, token: u64) {
        let Some(slot) = slots.get_mut(name) else {
            return;
        };
        if slot.holding.as_ref().is_some_and(|h| h.token == token) {
            slot.holding = None;
            slot.freed.notify_waiters();
            Self::forget_if_unused(slots, name);
        }
    }
}

fn expiry(now: Instant, ttl: Duration) -> Result<Instant, LockError> {
    if ttl.is_zero() {
        return Err(LockError::InvalidTtl);
    }
    now.checked_add(ttl).ok_or(LockError::InvalidTtl)
}

/// One grant, owned by its [`LockGuard`].
struct InProcessHolding {
    state: Arc<State>,
    name: LockName,
    token: u64,
}

#[async_trait]
impl HeldLock for InProcessHolding {
    async fn extend(&self, ttl: Duration) -> Result<bool, LockError> {
        let now = Instant::now();
        let expires_at = expiry(now, ttl)?;
        let mut slots = self.state.lock();
        let Some(h) = slots
            .get_mut(&self.name)
            .and_then(|s| s.holding.as_mut())
            .filter(|h| h.token == self.token)
        else {
            return Ok(false);
        };
        if h.expires_at <= now {
            // expired: gone, even though nobody took it yet
            self.state.end(&mut slots, &self.name, self.token);
            return Ok(false);
        }
        h.expires_at = expires_at;
        Ok(true)
    }

    fn release(&self) {
        let mut slots = self.state.lock();
        self.state.end(&mut slots, &self.name, self.token);
    }
}

/// Removes a slot a cancelled or timed-out waiter leaves unused.
struct ForgetIfUnused<'a> {
    state: &'a State,
    name: &'a LockName,
}

impl Drop for ForgetIfUnused<'_> {
    fn drop(&mut self) {
        State::forget_if_unused(&mut self.state.lock(), self.name);
    }
}

#[async_trait]
impl Locks for InProcessLocks {
    async fn try_acquire(&self, req: &LockRequest) -> Result<Option<LockGuard>, LockError> {
        match self.state.attempt(req)? {
            Attempt::Taken(g) => Ok(Some(g)),
            Attempt::Held { .. } => Ok(None),
        }
    }

    async fn acquire(&self, req: &LockRequest, wait: Duration) -> Result<LockGuard, LockError> {
        let _cleanup = ForgetIfUnused {
            state: &self.state,
            name: &req.name,
        };
        let start = Instant::now();
        let deadline = start.checked_add(wait).unwrap_or_else(far_future);
        loop {
            match self.state.attempt(req)? {
                Attempt::Taken(g) => return Ok(g),
                Attempt::Held {
                    holder,
                    expires_at,
                    freed,
                } => {
                    if Instant::now() >= deadline {
                        return Err(LockError::Timeout {
                            name: req.name.to_string(),
                            holder,
                            waited: start.elapsed(),
                        });
                    }
                    // released, expired or out of time: look again
                    let _ = tokio::time::timeout_at(expires_at.min(deadline), freed).await;
                }
            }
        }
    }

    async fn holder(&self, name: &LockName) -> Result<Option<LockHolder>, LockError> {
        let now = Instant::now();
        Ok(self
            .state
            .lock()
            .get(name)
            .and_then(|s| s.holding.as_ref())
            .filter(|h| h.expires_at > now)
            .map(|h| LockHolder {
                owner: h.owner.clone(),
                expires_in: h.expires_at - now,
            }))
    }
}

/// A deadline no wait reaches (about 30 years).
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86400 * 365 * 30)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock_conformance;

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn in_process_locks_pass_the_conformance_suite() {
        let locks = Arc::new(InProcessLocks::new());
        lock_conformance::run_all(locks.clone()).await;
        assert_eq!(
            locks.slots_in_use(),
            0,
            "every slot is gone after the suite"
        );
    }

    /// The same suite with tokio's clock paused: TTLs and waits run out
    /// without sleeping, and in a fixed order.
    #[tokio::test(start_paused = true)]
    async fn in_process_locks_pass_the_conformance_suite_on_a_paused_clock() {
        let locks = Arc::new(InProcessLocks::new());
        lock_conformance::run_all(locks.clone()).await;
        assert_eq!(
            locks.slots_in_use(),
            0,
            "every slot is gone after the suite"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_waiter_leaves_no_slot_behind() {
        let locks = InProcessLocks::new();
        let req =
            |owner: &str| LockRequest::new(LockName::new("t", "k"), owner, Duration::from_secs(60));
        let held = locks.try_acquire(&req("a")).await.unwrap().unwrap();
        let b = req("b");
        let waiter = locks.acquire(&b, Duration::from_secs(30));
        // the waiter gives up (is dropped) while the lock is held
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap_err();
        drop(held);
        assert_eq!(locks.slots_in_use(), 0);
    }
}
