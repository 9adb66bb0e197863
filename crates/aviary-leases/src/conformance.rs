//! The conformance suite every [`LeaseStore`] backend runs (the embedded
//! SQLite store, the in-memory store, later Redis).
//!
//! A backend provides a [`LeaseHarness`]: how to open a store on its storage
//! (opening again models a restart) and how to create a sandbox the store
//! knows. Each check uses fresh sandboxes, so the checks can share storage;
//! they panic with a message naming the broken rule.
//!
//! The suite's clock starts in 2030 and is moved by hand; it never reads the
//! wall clock.

use crate::{Fence, LeaseError, LeaseStore};
use async_trait::async_trait;
use aviary_core::{LeaseToken, SandboxId};
use std::sync::Arc;
use std::time::Duration;
use time::macros::datetime;
use time::OffsetDateTime;

/// How the suite reaches a backend.
#[async_trait]
pub trait LeaseHarness: Send + Sync {
    type Store: LeaseStore + 'static;
    /// Opens a store on this harness's storage. Opening again is a restart: a
    /// new instance that must see everything the previous one persisted.
    async fn open(&self) -> Self::Store;
    /// Creates a sandbox the store knows (leases are only granted on those).
    async fn create_sandbox(&self, store: &Self::Store) -> SandboxId;
}

const T0: OffsetDateTime = datetime!(2030-01-01 0:00 UTC);
const MINUTE: Duration = Duration::from_secs(60);

fn at(secs: i64) -> OffsetDateTime {
    T0 + time::Duration::seconds(secs)
}

/// Runs every check, in order, printing each name.
pub async fn run_all<H: LeaseHarness>(h: &H) {
    macro_rules! run {
        ($($check:ident),* $(,)?) => {$(
            eprintln!("lease conformance: {}", stringify!($check));
            $check(h).await;
        )*};
    }
    run!(
        unknown_sandbox_is_not_found,
        zero_ttl_is_invalid,
        tokens_increase_across_release,
        tokens_increase_across_expiry,
        held_lease_is_refused,
        renew_extends_only_with_current_token,
        release_needs_current_token,
        expiry_frees_the_sandbox,
        check_follows_the_fencing_rules,
        revoke_keeps_the_counter,
        restart_keeps_tokens_monotonic,
        concurrent_acquires_have_one_winner,
    );
}

pub async fn unknown_sandbox_is_not_found<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let ghost = SandboxId::generate();
    let e = s.acquire(&ghost, "a", MINUTE, T0).await.unwrap_err();
    assert_eq!(e, LeaseError::NotFound, "acquire on an unknown sandbox");
    let e = s.current(&ghost, T0).await.unwrap_err();
    assert_eq!(e, LeaseError::NotFound, "current on an unknown sandbox");
    let e = s.check(&ghost, None, T0).await.unwrap_err();
    assert_eq!(e, LeaseError::NotFound, "check on an unknown sandbox");
    let e = s
        .renew(&ghost, LeaseToken::generate(1), MINUTE, T0)
        .await
        .unwrap_err();
    assert_eq!(e, LeaseError::NotFound, "renew on an unknown sandbox");
    let e = s
        .release(&ghost, LeaseToken::generate(1), T0)
        .await
        .unwrap_err();
    assert_eq!(e, LeaseError::NotFound, "release on an unknown sandbox");
    let e = s.revoke(&ghost).await.unwrap_err();
    assert_eq!(e, LeaseError::NotFound, "revoke on an unknown sandbox");
}

pub async fn zero_ttl_is_invalid<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let sb = h.create_sandbox(&s).await;
    let e = s.acquire(&sb, "a", Duration::ZERO, T0).await.unwrap_err();
    assert_eq!(e, LeaseError::InvalidTtl);
    assert_eq!(s.current(&sb, T0).await.unwrap(), None);
    let l = s.acquire(&sb, "a", MINUTE, T0).await.unwrap();
    let e = s.renew(&sb, l.token, Duration::ZERO, T0).await.unwrap_err();
    assert_eq!(e, LeaseError::InvalidTtl);
}

pub async fn tokens_increase_across_release<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let sb = h.create_sandbox(&s).await;
    let mut last = LeaseToken::from_parts(0, [0; aviary_core::LEASE_SECRET_LEN]);
    for i in 0..4 {
        let l = s.acquire(&sb, "owner-a", MINUTE, at(i)).await.unwrap();
        assert!(l.token > last, "token {} after {}", l.token, last);
        assert_eq!(l.owner, "owner-a");
        assert_eq!(l.sandbox_id, sb);
        assert_eq!(l.acquired_at, at(i));
        assert_eq!(l.expires_at, at(i + 60));
        s.release(&sb, l.token, at(i)).await.unwrap();
        last = l.token;
    }
    assert!(last.fence() >= 4, "four grants, last token {last:?}");
}

pub async fn tokens_increase_across_expiry<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let sb = h.create_sandbox(&s).await;
    let a = s
        .acquire(&sb, "a", Duration::from_secs(10), T0)
        .await
        .unwrap();
    // the lease has expired but was not reaped: acquire still succeeds
    let b = s.acquire(&sb, "b", MINUTE, at(11)).await.unwrap();
    assert!(b.token > a.token, "token after expiry must grow");
    assert_eq!(s.current(&sb, at(12)).await.unwrap(), Some(b.clone()));
    // reaped this time
    let reaped = s.expire_due(at(200)).await.unwrap();
    assert!(reaped
        .iter()
        .any(|l| l.sandbox_id == sb && l.token == b.token));
    let c = s.acquire(&sb, "c", MINUTE, at(201)).await.unwrap();
    assert!(c.token > b.token, "token after reaping must grow");
}

pub async fn held_lease_is_refused<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let sb = h.create_sandbox(&s).await;
    let a = s.acquire(&sb, "a", MINUTE, T0).await.unwrap();
    for who in ["b", "a"] {
        let e = s.acquire(&sb, who, MINUTE, at(30)).await.unwrap_err();
        assert_eq!(
            e,
            LeaseError::Held {
                owner: "a".into(),
                expires_at: a.expires_at
            },
            "second acquire by {who}"
        );
    }
    assert_eq!(s.current(&sb, at(30)).await.unwrap(), Some(a));
}

pub async fn renew_extends_only_with_current_token<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let sb = h.create_sandbox(&s).await;
    let old = s.acquire(&sb, "a", MINUTE, T0).await.unwrap();
    s.release(&sb, old.token, T0).await.unwrap();
    let l = s.acquire(&sb, "a", MINUTE, at(1)).await.unwrap();

    let renewed = s.renew(&sb, l.token, MINUTE, at(50)).await.unwrap();
    assert_eq!(renewed.token, l.token, "renew keeps the token");
    assert_eq!(
        renewed.acquired_at, l.acquired_at,
        "renew keeps acquired_at"
    );
    assert_eq!(renewed.expires_at, at(110));
    // alive past the original expiry
    assert_eq!(s.current(&sb, at(100)).await.unwrap(), Some(renewed));

    for bad in [old.token, LeaseToken::generate(l.token.fence() + 1)] {
        let e = s.renew(&sb, bad, MINUTE, at(60)).await.unwrap_err();
        assert_eq!(e, LeaseError::StaleToken, "renew with token {bad}");
    }
    // too late: the lease expired at 110
    let e = s.renew(&sb, l.token, MINUTE, at(110)).await.unwrap_err();
    assert_eq!(e, LeaseError::StaleToken, "renew after expiry");
    assert_eq!(s.current(&sb, at(110)).await.unwrap(), None);
}

pub async fn release_needs_current_token<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let sb = h.create_sandbox(&s).await;
    let l = s.acquire(&sb, "a", MINUTE, T0).await.unwrap();
    let stale = LeaseToken::generate(l.token.fence() - 1);
    let e = s.release(&sb, stale, at(1)).await.unwrap_err();
    assert_eq!(e, LeaseError::StaleToken);
    assert_eq!(s.current(&sb, at(1)).await.unwrap(), Some(l.clone()));
    s.release(&sb, l.token, at(2)).await.unwrap();
    assert_eq!(s.current(&sb, at(2)).await.unwrap(), None);
    let e = s.release(&sb, l.token, at(3)).await.unwrap_err();
    assert_eq!(e, LeaseError::StaleToken, "second release");
    let l = s.acquire(&sb, "a", MINUTE, at(4)).await.unwrap();
    let e = s.release(&sb, l.token, at(64)).await.unwrap_err();
    assert_eq!(e, LeaseError::StaleToken, "release after expiry");
}

pub async fn expiry_frees_the_sandbox<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let sb = h.create_sandbox(&s).await;
    let l = s
        .acquire(&sb, "a", Duration::from_secs(5), T0)
        .await
        .unwrap();
    assert_eq!(s.current(&sb, at(4)).await.unwrap(), Some(l.clone()));
    // expires_at itself is already expired
    assert_eq!(s.current(&sb, at(5)).await.unwrap(), None);

    let early = s.expire_due(at(4)).await.unwrap();
    assert!(
        !early.iter().any(|x| x.sandbox_id == sb),
        "reaped too early"
    );
    let due = s.expire_due(at(5)).await.unwrap();
    let mine: Vec<_> = due.into_iter().filter(|x| x.sandbox_id == sb).collect();
    assert_eq!(mine, vec![l.clone()], "expire_due returns the lease once");
    let again = s.expire_due(at(6)).await.unwrap();
    assert!(!again.iter().any(|x| x.sandbox_id == sb), "reaped twice");

    let next = s.acquire(&sb, "b", MINUTE, at(6)).await.unwrap();
    assert!(next.token > l.token);
}

pub async fn check_follows_the_fencing_rules<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let sb = h.create_sandbox(&s).await;
    // unleased
    assert_eq!(s.check(&sb, None, T0).await.unwrap(), Fence::Unleased);
    let e = s
        .check(&sb, Some(LeaseToken::generate(1)), T0)
        .await
        .unwrap_err();
    assert_eq!(e, LeaseError::StaleToken, "token on an unleased sandbox");
    // leased
    let l = s.acquire(&sb, "a", MINUTE, T0).await.unwrap();
    assert_eq!(
        s.check(&sb, Some(l.token), at(1)).await.unwrap(),
        Fence::Leased(l.token)
    );
    let e = s.check(&sb, None, at(1)).await.unwrap_err();
    assert_eq!(e, LeaseError::LeaseRequired);
    for bad in [
        LeaseToken::generate(l.token.fence() - 1),
        LeaseToken::generate(l.token.fence() + 1),
        // the current fence with a guessed secret
        LeaseToken::generate(l.token.fence()),
    ] {
        let e = s.check(&sb, Some(bad), at(1)).await.unwrap_err();
        assert_eq!(e, LeaseError::StaleToken, "token {bad}");
    }
    // expired counts as unleased, and its token is stale
    assert_eq!(s.check(&sb, None, at(60)).await.unwrap(), Fence::Unleased);
    let e = s.check(&sb, Some(l.token), at(60)).await.unwrap_err();
    assert_eq!(e, LeaseError::StaleToken, "token of an expired lease");
}

pub async fn revoke_keeps_the_counter<H: LeaseHarness>(h: &H) {
    let s = h.open().await;
    let sb = h.create_sandbox(&s).await;
    let l = s.acquire(&sb, "a", MINUTE, T0).await.unwrap();
    s.revoke(&sb).await.unwrap();
    assert_eq!(s.current(&sb, at(1)).await.unwrap(), None);
    let e = s.check(&sb, Some(l.token), at(1)).await.unwrap_err();
    assert_eq!(e, LeaseError::StaleToken, "token of a revoked lease");
    s.revoke(&sb).await.unwrap(); // idempotent
    let next = s.acquire(&sb, "b", MINUTE, at(2)).await.unwrap();
    assert!(next.token > l.token, "token after revoke must grow");
}

pub async fn restart_keeps_tokens_monotonic<H: LeaseHarness>(h: &H) {
    let before = h.open().await;
    let sb = h.create_sandbox(&before).await;
    let a = before.acquire(&sb, "a", MINUTE, T0).await.unwrap();
    before.release(&sb, a.token, T0).await.unwrap();
    let b = before.acquire(&sb, "b", MINUTE, at(1)).await.unwrap();
    drop(before);

    let after = h.open().await;
    assert_eq!(
        after.current(&sb, at(2)).await.unwrap(),
        Some(b.clone()),
        "a live lease survives a restart"
    );
    after.release(&sb, b.token, at(2)).await.unwrap();
    let c = after.acquire(&sb, "c", MINUTE, at(3)).await.unwrap();
    assert!(
        c.token > b.token,
        "token after restart {} <= {}",
        c.token,
        b.token
    );
    drop(after);

    let again = h.open().await;
    again.revoke(&sb).await.unwrap();
    let d = again.acquire(&sb, "d", MINUTE, at(4)).await.unwrap();
    assert!(d.token > c.token, "token after revoke + restart");
}

pub async fn concurrent_acquires_have_one_winner<H: LeaseHarness>(h: &H) {
    const TASKS: usize = 20;
    let s = Arc::new(h.open().await);
    let sb = h.create_sandbox(&s).await;
    let first = s.acquire(&sb, "warmup", MINUTE, T0).await.unwrap();
    s.release(&sb, first.token, T0).await.unwrap();

    let handles: Vec<_> = (0..TASKS)
        .map(|i| {
            let s = Arc::clone(&s);
            let sb = sb.clone();
            tokio::spawn(async move { s.acquire(&sb, &format!("task-{i}"), MINUTE, at(1)).await })
        })
        .collect();
    let mut winners = Vec::new();
    let mut held = 0;
    for handle in handles {
        match handle.await.expect("acquire task panicked") {
            Ok(l) => winners.push(l),
            Err(LeaseError::Held { .. }) => held += 1,
            Err(e) => panic!("concurrent acquire failed with {e:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one concurrent acquire wins");
    assert_eq!(held, TASKS - 1);
    let w = &winners[0];
    assert_eq!(
        w.token.fence(),
        first.token.fence() + 1,
        "one grant, one step"
    );
    assert_eq!(s.current(&sb, at(2)).await.unwrap().as_ref(), Some(w));
}
