//! The conformance suite every [`Locks`] backend runs (the in-process
//! locks, later Redis).
//!
//! Each check uses fresh lock names (a random run id in the scope), so the
//! checks can share one backend and one server. They panic with a message
//! naming the broken rule. Durations are real (a networked backend keeps its
//! own clock) but short; the in-process backend also runs the suite on a
//! paused tokio clock.

use crate::locks::{LockError, LockGuard, LockName, LockRequest, Locks};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Long enough never to run out during a check.
const LONG: Duration = Duration::from_secs(600);
/// A TTL that runs out during a check.
const SHORT: Duration = Duration::from_millis(300);
/// How long a check waits for a lock that must become free: a broken
/// backend fails the check instead of hanging it.
const WAIT: Duration = Duration::from_secs(20);

fn fresh(check: &str) -> LockName {
    LockName::new(aviary_core::new_id("lockconf"), check)
}

fn req(name: &LockName, owner: &str, ttl: Duration) -> LockRequest {
    LockRequest::new(name.clone(), owner, ttl)
}

async fn holder_of<L: Locks>(locks: &L, name: &LockName) -> Option<String> {
    locks.holder(name).await.unwrap().map(|h| h.owner)
}

async fn take<L: Locks>(locks: &L, name: &LockName, owner: &str, ttl: Duration) -> LockGuard {
    locks
        .try_acquire(&req(name, owner, ttl))
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{name} should be free for {owner}"))
}

/// Runs every check, in order, printing each name.
pub async fn run_all<L: Locks + 'static>(locks: Arc<L>) {
    macro_rules! run {
        ($($check:ident),* $(,)?) => {$(
            eprintln!("lock conformance: {}", stringify!($check));
            $check(&locks).await;
        )*};
    }
    run!(
        a_free_lock_has_no_holder,
        a_held_lock_refuses_everyone_else,
        scopes_are_separate,
        dropping_the_guard_releases,
        a_waiter_gets_in_when_the_holder_releases,
        acquire_times_out_while_held,
        ttl_expiry_lets_the_next_holder_in,
        extend_keeps_the_lock_until_it_is_lost,
        keep_alive_holds_past_the_ttl,
        invalid_ttl_is_refused,
        mutual_exclusion_under_contention,
    );
}

pub async fn a_free_lock_has_no_holder<L: Locks + 'static>(locks: &Arc<L>) {
    let name = fresh("free");
    assert_eq!(holder_of(&**locks, &name).await, None, "fresh lock");
    let g = take(&**locks, &name, "a", LONG).await;
    let h = locks
        .holder(&name)
        .await
        .unwrap()
        .expect("held lock has a holder");
    assert_eq!(h.owner, "a");
    assert!(
        h.expires_in <= LONG,
        "expires_in {:?} beyond the ttl",
        h.expires_in
    );
    assert_eq!(g.name(), &name);
    assert_eq!(g.owner(), "a");
    assert!(g.is_held());
}

pub async fn a_held_lock_refuses_everyone_else<L: Locks + 'static>(locks: &Arc<L>) {
    let name = fresh("held");
    let _g = take(&**locks, &name, "a", LONG).await;
    let other = locks.try_acquire(&req(&name, "b", LONG)).await.unwrap();
    assert!(other.is_none(), "a held lock was granted to another owner");
    // not reentrant: the same owner waits like everyone else
    let again = locks.try_acquire(&req(&name, "a", LONG)).await.unwrap();
    assert!(
        again.is_none(),
        "a held lock was granted twice to its owner"
    );
    assert_eq!(holder_of(&**locks, &name).await.as_deref(), Some("a"));
}

pub async fn scopes_are_separate<L: Locks + 'static>(locks: &Arc<L>) {
    let a = fresh("same-key");
    let b = LockName::new(format!("{}-other", a.scope()), a.key());
    let _ga = take(&**locks, &a, "a", LONG).await;
    let _gb = take(&**locks, &b, "b", LONG).await;
    let c = LockName::new(a.scope(), "another-key");
    let _gc = take(&**locks, &c, "c", LONG).await;
}

pub async fn dropping_the_guard_releases<L: Locks + 'static>(locks: &Arc<L>) {
    let name = fresh("drop");
    let g = take(&**locks, &name, "a", LONG).await;
    drop(g);
    assert_eq!(holder_of(&**locks, &name).await, None, "dropped guard");
    let g = take(&**locks, &name, "b", LONG).await;
    g.release();
    assert_eq!(holder_of(&**locks, &name).await, None, "released guard");
    let _g = take(&**locks, &name, "c", LONG).await;
}

pub async fn a_waiter_gets_in_when_the_holder_releases<L: Locks + 'static>(locks: &Arc<L>) {
    let name = fresh("wait");
    let g = take(&**locks, &name, "a", LONG).await;
    let waiter = {
        let (locks, name) = (locks.clone(), name.clone());
        tokio::spawn(async move { locks.acquire(&req(&name, "b", LONG), WAIT).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "the waiter got a held lock");
    drop(g);
    let g = waiter.await.unwrap().unwrap();
    assert_eq!(g.owner(), "b");
    assert_eq!(holder_of(&**locks, &name).await.as_deref(), Some("b"));
}

pub async fn acquire_times_out_while_held<L: Locks + 'static>(locks: &Arc<L>) {
    let name = fresh("timeout");
    let _g = take(&**locks, &name, "a", LONG).await;
    let e = locks
        .acquire(&req(&name, "b", LONG), Duration::from_millis(200))
        .await
        .unwrap_err();
    match &e {
        LockError::Timeout {
            name: n, holder, ..
        } => {
            assert_eq!(n, &name.to_string());
            assert_eq!(holder, "a", "the timeout names the holder");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_eq!(e.code(), aviary_core::ErrorCode::Conflict);
    // a zero wait is one attempt
    let e = locks
        .acquire(&req(&name, "b", LONG), Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(e, LockError::Timeout { .. }), "{e:?}");
    assert_eq!(holder_of(&**locks, &name).await.as_deref(), Some("a"));
}

pub async fn ttl_expiry_lets_the_next_holder_in<L: Locks + 'static>(locks: &Arc<L>) {
    let name = fresh("ttl");
    // a holder that crashed: it never releases and never renews
    let crashed = take(&**locks, &name, "crashed", SHORT).await;
    let next = locks
        .acquire(&req(&name, "next", LONG), WAIT)
        .await
        .unwrap();
    assert_eq!(holder_of(&**locks, &name).await.as_deref(), Some("next"));
    // the crashed holder finds out on its next renewal…
    assert!(
        !crashed.extend(LONG).await.unwrap(),
        "an expired lock was renewed"
    );
    assert!(!crashed.is_held());
    // …and its late release does not free the next holder's lock
    drop(crashed);
    assert_eq!(holder_of(&**locks, &name).await.as_deref(), Some("next"));
    let third = locks.try_acquire(&req(&name, "third", LONG)).await.unwrap();
    assert!(
        third.is_none(),
        "a stale guard released its successor's lock"
    );
    assert!(next.is_held());
}

pub async fn extend_keeps_the_lock_until_it_is_lost<L: Locks + 'static>(locks: &Arc<L>) {
    let name = fresh("extend");
    let g = take(&**locks, &name, "a", SHORT).await;
    assert!(g.extend(LONG).await.unwrap(), "extend of a live lock");
    tokio::time::sleep(SHORT * 2).await;
    let other = locks.try_acquire(&req(&name, "b", LONG)).await.unwrap();
    assert!(other.is_none(), "an extended lock expired at its first ttl");
    assert!(g.is_held());
    // expired, even with nobody waiting: lost
    let lapsed = fresh("lapsed");
    let g = take(&**locks, &lapsed, "a", SHORT).await;
    tokio::time::sleep(SHORT * 2).await;
    assert!(
        !g.extend(LONG).await.unwrap(),
        "an expired lock was renewed"
    );
    assert!(!g.is_held());
    drop(g);
    let _b = take(&**locks, &lapsed, "b", LONG).await;
}

pub async fn keep_alive_holds_past_the_ttl<L: Locks + 'static>(locks: &Arc<L>) {
    let name = fresh("keepalive");
    let ttl = Duration::from_millis(900);
    let g = take(&**locks, &name, "a", ttl).await.keep_alive();
    tokio::time::sleep(ttl * 3).await;
    let other = locks.try_acquire(&req(&name, "b", LONG)).await.unwrap();
    assert!(other.is_none(), "a kept-alive lock expired");
    assert!(g.is_held());
    drop(g);
    let _b = take(&**locks, &name, "b", LONG).await;
}

pub async fn invalid_ttl_is_refused<L: Locks + 'static>(locks: &Arc<L>) {
    let name = fresh("ttl0");
    let e = locks
        .try_acquire(&req(&name, "a", Duration::ZERO))
        .await
        .unwrap_err();
    assert_eq!(e, LockError::InvalidTtl);
    let e = locks
        .acquire(&req(&name, "a", Duration::ZERO), LONG)
        .await
        .unwrap_err();
    assert_eq!(e, LockError::InvalidTtl);
    assert_eq!(e.code(), aviary_core::ErrorCode::Internal);
    assert_eq!(holder_of(&**locks, &name).await, None);
}

/// Many tasks take one lock many times; never two inside at once, and
/// everyone gets in.
pub async fn mutual_exclusion_under_contention<L: Locks + 'static>(locks: &Arc<L>) {
    const TASKS: usize = 16;
    const ROUNDS: usize = 20;
    let name = fresh("contention");
    let inside = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (locks, name, inside, done) =
            (locks.clone(), name.clone(), inside.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let g = locks
                    .acquire(&req(&name, &format!("task-{t}"), LONG), WAIT * 3)
                    .await
                    .unwrap();
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders of {name} at once"
                );
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(1)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                drop(g);
                done.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(done.load(Ordering::SeqCst), TASKS * ROUNDS);
    assert_eq!(holder_of(&**locks, &name).await, None);
}
