//! Aviary's coordination seam (DESIGN §3 "Lease manager", principle 4):
//! leases with fencing tokens, and named locks.
//!
//! Locks ([`Locks`], module [`locks`]) serialise work across requests (scope
//! buckets, hibernate/wake) with an owner and a TTL; [`InProcessLocks`] is
//! the embedded default, and every backend must pass
//! [`lock_conformance::run_all`].
//!
//! This crate owns the [`LeaseStore`] trait: acquire / renew (heartbeat) /
//! release / expire / revoke of the one lease a sandbox may have, and the
//! fencing check every mutating call goes through. Backends: the embedded
//! SQLite store (`aviary-registry-sqlite`), [`MemoryLeaseStore`] for unit
//! tests at the seams, and Redis (`aviary-coord-redis`). Every backend must
//! pass [`conformance::run_all`]. [`CachedLeaseStore`] keeps a store's
//! reads in memory for a store this process alone writes (the embedded one),
//! and passes the same suite.
//!
//! Invariants every backend keeps:
//! - A sandbox has at most one *live* lease; a lease is live while
//!   `now < expires_at`. An expired lease counts as no lease, whether or not
//!   [`LeaseStore::expire_due`] has deleted it yet.
//! - The fencing token of a new lease is the sandbox's fencing counter + 1,
//!   persisted atomically with the grant: tokens are strictly increasing per
//!   sandbox, forever — across release, expiry, revoke and restarts.
//! - Time is always passed in (`now`); no backend reads the clock, so tests
//!   can move it.
//!
//! Concurrency: backends are `Send + Sync` and serialise the
//! read-modify-write of one sandbox's lease, so of N concurrent acquires on a
//! free sandbox exactly one wins.
#![forbid(unsafe_code)]

mod cached;
pub mod conformance;
pub mod fences;
mod in_process_locks;
pub mod lock_conformance;
pub mod locks;
mod memory;

pub use aviary_core::api::Lease;
pub use cached::CachedLeaseStore;
pub use fences::{FenceAuthority, MemoryFences};
pub use in_process_locks::InProcessLocks;
pub use locks::{HeldLock, LockError, LockGuard, LockHolder, LockName, LockRequest, Locks};
pub use memory::{LeaseSlot, MemoryLeaseStore};

use async_trait::async_trait;
use aviary_core::{LeaseToken, SandboxId};
use std::sync::Arc;
use std::time::Duration;
use time::OffsetDateTime;

/// The coordination backends a control plane runs on: leases (with fencing)
/// and locks. The embedded default is the registry's SQLite lease table and
/// [`InProcessLocks`]; a replicated deployment swaps both for shared ones.
///
/// `fences` is the durable fencing counter ([`FenceAuthority`]) the lease
/// store's grants bump and every client-initiated registry write is checked
/// against; it is the registry itself in both modes.
#[derive(Clone)]
pub struct Coordination {
    pub leases: Arc<dyn LeaseStore>,
    pub locks: Arc<dyn Locks>,
    pub fences: Arc<dyn FenceAuthority>,
}

/// The outcome of a successful fencing check.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Fence {
    /// No live lease; the call carried no token and may proceed.
    Unleased,
    /// A live lease exists and the call carried its token.
    Leased(LeaseToken),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LeaseError {
    /// No such sandbox.
    #[error("sandbox not found")]
    NotFound,
    /// The sandbox already has a live lease.
    #[error("sandbox is leased by {owner} until {expires_at}")]
    Held {
        owner: String,
        expires_at: OffsetDateTime,
    },
    /// The sandbox is leased and the call carried no token.
    #[error("sandbox is leased; the call needs its token")]
    LeaseRequired,
    /// The token is not the one of the sandbox's live lease.
    #[error("stale lease token")]
    StaleToken,
    /// A ttl of zero, or one so long the expiry cannot be represented.
    #[error("invalid lease ttl")]
    InvalidTtl,
    /// The backing store failed; the message is for the server log.
    #[error("lease storage: {0}")]
    Storage(String),
    /// The backing service cannot be reached (down, restarting, partitioned):
    /// nothing was changed and the call may be retried.
    #[error("lease store unavailable: {0}")]
    Unavailable(String),
}

impl LeaseError {
    /// The stable API error code of this error.
    pub fn code(&self) -> aviary_core::ErrorCode {
        use aviary_core::ErrorCode;
        match self {
            LeaseError::NotFound => ErrorCode::NotFound,
            LeaseError::Held { .. } => ErrorCode::LeaseHeld,
            LeaseError::LeaseRequired => ErrorCode::LeaseRequired,
            LeaseError::StaleToken => ErrorCode::StaleToken,
            LeaseError::InvalidTtl => ErrorCode::InvalidRequest,
            LeaseError::Storage(_) => ErrorCode::Internal,
            LeaseError::Unavailable(_) => ErrorCode::Unavailable,
        }
    }
}

#[async_trait]
pub trait LeaseStore: Send + Sync {
    /// Grants a lease if none is live (an expired lease counts as none). The
    /// token is the sandbox's fencing counter + 1, persisted atomically:
    /// strictly increasing per sandbox, forever, across restarts and across
    /// expiry/release. A live lease, even the caller's own, is `Held`.
    async fn acquire(
        &self,
        sandbox: &SandboxId,
        owner: &str,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError>;

    /// Heartbeat/renew: sets the expiry to `now + ttl`; only with the current
    /// token of a live lease (else `StaleToken`).
    async fn renew(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError>;

    /// Ends the live lease carrying `token` (else `StaleToken`).
    async fn release(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        now: OffsetDateTime,
    ) -> Result<(), LeaseError>;

    /// The live lease, if any.
    async fn current(
        &self,
        sandbox: &SandboxId,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, LeaseError>;

    /// The fencing check for a mutating call: live lease → token must equal
    /// it (`None` → `LeaseRequired`, other → `StaleToken`); no live lease →
    /// `None` is fine ([`Fence::Unleased`]), any token → `StaleToken`.
    async fn check(
        &self,
        sandbox: &SandboxId,
        token: Option<LeaseToken>,
        now: OffsetDateTime,
    ) -> Result<Fence, LeaseError>;

    /// Deletes leases whose expiry passed (`expires_at <= now`) and returns
    /// them; the caller writes events and tells the sandbox's envd.
    async fn expire_due(&self, now: OffsetDateTime) -> Result<Vec<Lease>, LeaseError>;

    /// Drops any lease of the sandbox (on destroy) without lowering its
    /// fencing counter.
    async fn revoke(&self, sandbox: &SandboxId) -> Result<(), LeaseError>;
}

/// `now + ttl`, refusing a zero ttl and one that overflows the calendar.
pub fn expiry(now: OffsetDateTime, ttl: Duration) -> Result<OffsetDateTime, LeaseError> {
    if ttl.is_zero() {
        return Err(LeaseError::InvalidTtl);
    }
    let ttl = time::Duration::try_from(ttl).map_err(|_| LeaseError::InvalidTtl)?;
    now.checked_add(ttl).ok_or(LeaseError::InvalidTtl)
}

/// The fencing rule of [`LeaseStore::check`] applied to the live lease's
/// token (`None` when the sandbox has no live lease). Backends call this so
/// the rule is written once.
pub fn fence_rule(
    live: Option<LeaseToken>,
    presented: Option<LeaseToken>,
) -> Result<Fence, LeaseError> {
    match (live, presented) {
        (None, None) => Ok(Fence::Unleased),
        (None, Some(_)) => Err(LeaseError::StaleToken),
        (Some(_), None) => Err(LeaseError::LeaseRequired),
        (Some(live), Some(t)) if live.matches(&t) => Ok(Fence::Leased(live)),
        (Some(_), Some(_)) => Err(LeaseError::StaleToken),
    }
}

/// The write-time fencing rule against the durable counter
/// ([`FenceAuthority`]): a write is valid only while the sandbox's counter is
/// still `seen`, the fence the caller's lease check saw (its token's fence
/// when `leased`, the current counter when not). A lease granted since moves
/// the counter: a leased writer is then `StaleToken`, an unleased one
/// `LeaseRequired`. A `seen` above the counter was never issued
/// (`StaleToken`).
pub fn counter_rule(counter: u64, seen: u64, leased: bool) -> Result<(), LeaseError> {
    match (counter == seen, leased) {
        (true, _) => Ok(()),
        (false, true) => Err(LeaseError::StaleToken),
        (false, false) if seen > counter => Err(LeaseError::StaleToken),
        (false, false) => Err(LeaseError::LeaseRequired),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    #[test]
    fn expiry_refuses_zero_and_overflow() {
        let now = datetime!(2030-01-01 0:00 UTC);
        assert_eq!(
            expiry(now, Duration::ZERO).unwrap_err(),
            LeaseError::InvalidTtl
        );
        assert_eq!(
            expiry(now, Duration::from_secs(u64::MAX)).unwrap_err(),
            LeaseError::InvalidTtl
        );
        assert_eq!(
            expiry(now, Duration::from_secs(60)).unwrap(),
            datetime!(2030-01-01 0:01 UTC)
        );
    }

    #[test]
    fn counter_rule_table() {
        assert_eq!(counter_rule(3, 3, true), Ok(()));
        assert_eq!(counter_rule(3, 3, false), Ok(()));
        assert_eq!(counter_rule(4, 3, true), Err(LeaseError::StaleToken));
        assert_eq!(counter_rule(4, 3, false), Err(LeaseError::LeaseRequired));
        assert_eq!(counter_rule(3, 4, true), Err(LeaseError::StaleToken));
        assert_eq!(counter_rule(3, 4, false), Err(LeaseError::StaleToken));
    }

    #[test]
    fn fence_rule_table() {
        let t = LeaseToken::generate(7);
        assert_eq!(fence_rule(None, None).unwrap(), Fence::Unleased);
        assert_eq!(
            fence_rule(None, Some(t)).unwrap_err(),
            LeaseError::StaleToken
        );
        assert_eq!(
            fence_rule(Some(t), None).unwrap_err(),
            LeaseError::LeaseRequired
        );
        assert_eq!(fence_rule(Some(t), Some(t)).unwrap(), Fence::Leased(t));
        assert_eq!(
            fence_rule(Some(t), Some(LeaseToken::generate(6))).unwrap_err(),
            LeaseError::StaleToken
        );
        assert_eq!(
            fence_rule(Some(t), Some(LeaseToken::generate(8))).unwrap_err(),
            LeaseError::StaleToken
        );
        // The right fence with a guessed secret is no capability.
        assert_eq!(
            fence_rule(Some(t), Some(LeaseToken::from_parts(7, [0; 16]))).unwrap_err(),
            LeaseError::StaleToken
        );
    }
}
