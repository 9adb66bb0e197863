//! Named, scoped locks: the coordination seam that serialises work across
//! requests (the execution guard of a scope bucket, hibernate/wake of one
//! sandbox, later pool claims) without a process-local `Mutex`, so a second
//! control-plane replica can share them through a networked backend.
//!
//! A lock is a [`LockName`] (a scope such as `bucket` or `lifecycle`, and a
//! key inside it) held by an *owner* for a *TTL*. The TTL is what makes a
//! crashed holder harmless: its lock expires and the next caller gets in. A
//! holder whose work may outlast the TTL renews it ([`LockGuard::extend`], or
//! [`LockGuard::keep_alive`] in the background); a holder that could not
//! renew in time has lost the lock ([`LockGuard::is_held`]).
//!
//! Holding is RAII: [`Locks::acquire`] (waits, up to a timeout) and
//! [`Locks::try_acquire`] (never waits) hand out a [`LockGuard`]; dropping it
//! releases the lock. A release never undoes a later holder's lock: a guard
//! whose TTL ran out and whose lock was taken since releases nothing.
//!
//! Backends: [`crate::InProcessLocks`] for the embedded default (one
//! process), later Redis. Every backend must pass
//! [`crate::lock_conformance::run_all`].
//!
//! Invariants every backend keeps:
//! - at most one live holder per name (live: its TTL has not run out);
//! - locks are not reentrant: a second acquire of a held name waits, even by
//!   the same owner;
//! - names in different scopes are different locks.

use async_trait::async_trait;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// What a lock protects: a scope (the kind of thing) and a key inside it.
/// Shown as `scope/key`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LockName {
    scope: String,
    key: String,
}

impl LockName {
    pub fn new(scope: impl Into<String>, key: impl Into<String>) -> Self {
        LockName {
            scope: scope.into(),
            key: key.into(),
        }
    }

    pub fn scope(&self) -> &str {
        &self.scope
    }

    pub fn key(&self) -> &str {
        &self.key
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.scope, self.key)
    }
}

/// One request for a lock: which, for whom, for how long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockRequest {
    pub name: LockName,
    /// Who holds it (a replica and what it does there), for diagnostics and
    /// for the `Timeout` error of the next caller.
    pub owner: String,
    /// How long the lock lives without a renewal. Must be > 0.
    pub ttl: Duration,
}

impl LockRequest {
    pub fn new(name: LockName, owner: impl Into<String>, ttl: Duration) -> Self {
        LockRequest {
            name,
            owner: owner.into(),
            ttl,
        }
    }
}

/// The live holder of a lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockHolder {
    pub owner: String,
    /// Time left before the lock expires unless renewed.
    pub expires_in: Duration,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LockError {
    /// The lock stayed held for the whole wait.
    #[error("{name} is held by {holder}; gave up after {waited:?}")]
    Timeout {
        name: String,
        holder: String,
        waited: Duration,
    },
    /// A ttl of zero, or one so long the expiry cannot be represented.
    #[error("invalid lock ttl")]
    InvalidTtl,
    /// The backing store failed; the message is for the server log.
    #[error("lock storage: {0}")]
    Storage(String),
    /// The backing service cannot be reached; nothing is held.
    #[error("lock store unavailable: {0}")]
    Unavailable(String),
}

impl LockError {
    /// The stable API error code of this error.
    pub fn code(&self) -> aviary_core::ErrorCode {
        use aviary_core::ErrorCode;
        match self {
            // another request is working on the same thing: retry later
            LockError::Timeout { .. } => ErrorCode::Conflict,
            // the ttl is chosen by the control plane, never by a client
            LockError::InvalidTtl | LockError::Storage(_) => ErrorCode::Internal,
            LockError::Unavailable(_) => ErrorCode::Unavailable,
        }
    }
}

/// A lock backend.
#[async_trait]
pub trait Locks: Send + Sync {
    /// Takes the lock if it is free (or its holder's TTL ran out); `None`
    /// when it is held.
    async fn try_acquire(&self, req: &LockRequest) -> Result<Option<LockGuard>, LockError>;

    /// Takes the lock, waiting up to `wait` for its holder to release it or
    /// for its TTL to run out; [`LockError::Timeout`] after that.
    async fn acquire(&self, req: &LockRequest, wait: Duration) -> Result<LockGuard, LockError>;

    /// The live holder of a lock, if any.
    async fn holder(&self, name: &LockName) -> Result<Option<LockHolder>, LockError>;
}

/// The backend's side of one holding, for the [`LockGuard`] that owns it.
#[async_trait]
pub trait HeldLock: Send + Sync {
    /// Moves the expiry to now + `ttl`; `false` when the holding is gone
    /// (its TTL ran out first; the lock may be someone else's by now).
    async fn extend(&self, ttl: Duration) -> Result<bool, LockError>;
    /// Gives the holding back, unless it is gone. Called from `Drop`: it
    /// must not block (a networked backend sends the release in the
    /// background; the TTL covers a release that never arrives).
    fn release(&self);
}

/// A held lock; dropping it releases the lock.
pub struct LockGuard {
    name: LockName,
    owner: String,
    ttl: Duration,
    held: Arc<dyn HeldLock>,
    /// Set once a renewal found the holding gone.
    lost: Arc<AtomicBool>,
    keep_alive: Option<tokio::task::JoinHandle<()>>,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("name", &self.name)
            .field("owner", &self.owner)
            .field("ttl", &self.ttl)
            .field("held", &self.is_held())
            .finish()
    }
}

impl LockGuard {
    /// For backends: the guard of a holding granted for `req`.
    pub fn new(req: &LockRequest, held: Arc<dyn HeldLock>) -> Self {
        LockGuard {
            name: req.name.clone(),
            owner: req.owner.clone(),
            ttl: req.ttl,
            held,
            lost: Arc::new(AtomicBool::new(false)),
            keep_alive: None,
        }
    }

    pub fn name(&self) -> &LockName {
        &self.name
    }

    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// False once a renewal found that the TTL ran out before it: the lock
    /// may have another holder now. (Without renewals the guard cannot know,
    /// and says true.)
    pub fn is_held(&self) -> bool {
        !self.lost.load(Ordering::SeqCst)
    }

    /// Moves the expiry to now + `ttl`; `false` when the lock was lost.
    pub async fn extend(&self, ttl: Duration) -> Result<bool, LockError> {
        let kept = self.held.extend(ttl).await?;
        if !kept {
            self.lost.store(true, Ordering::SeqCst);
        }
        Ok(kept)
    }

    /// Renews the lock in the background every third of its TTL for as long
    /// as the guard lives, so work longer than the TTL stays exclusive while
    /// a crashed holder's lock still expires. Needs a tokio runtime. Stops
    /// when a renewal finds the lock lost ([`Self::is_held`] turns false).
    pub fn keep_alive(mut self) -> Self {
        let (held, lost, ttl) = (self.held.clone(), self.lost.clone(), self.ttl);
        let every = (ttl / 3).max(Duration::from_millis(1));
        self.keep_alive = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                // an error is a storage hiccup: the next round may
                // succeed, and the TTL is three rounds long
                if let Ok(false) = held.extend(ttl).await {
                    lost.store(true, Ordering::SeqCst);
                    return;
                }
            }
        }));
        self
    }

    /// Releases the lock now (the same as dropping the guard).
    pub fn release(self) {}
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if let Some(task) = self.keep_alive.take() {
            task.abort();
        }
        self.held.release();
    }
}
