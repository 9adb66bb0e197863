//! The lease store against a real Redis: the lease conformance suite, Redis
//! losing everything, two replicas racing, grants behind a stale claim and
//! expiry in batches.

#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

mod support;

use async_trait::async_trait;
use aviary_coord_redis::{ConnectionManager, RedisLeaseStore};
use aviary_core::SandboxId;
use aviary_leases::conformance::{self, LeaseHarness};
use aviary_leases::{counter_rule, Fence, FenceAuthority, LeaseError, LeaseStore, MemoryFences};
use std::sync::Arc;
use std::time::Duration;
use time::macros::datetime;
use time::OffsetDateTime;

const T0: OffsetDateTime = datetime!(2030-01-01 0:00 UTC);
const MINUTE: Duration = Duration::from_secs(60);

fn at(secs: i64) -> OffsetDateTime {
    T0 + time::Duration::seconds(secs)
}

/// Stores on one Redis prefix, their fences from one registry (a
/// `MemoryFences` shared by every `open`, as the registry outlives a
/// control-plane restart).
struct Harness {
    url: String,
    prefix: String,
    fences: MemoryFences,
}

impl Harness {
    async fn new() -> Option<(Harness, ConnectionManager)> {
        let (url, conn) = support::redis().await?;
        let h = Harness {
            url,
            prefix: support::prefix(),
            fences: MemoryFences::new(),
        };
        Some((h, conn))
    }

    /// A store as a (re)started replica has it: its own connection.
    async fn replica(&self) -> RedisLeaseStore {
        let conn = aviary_coord_redis::connect(&self.url).await.unwrap();
        RedisLeaseStore::new(conn, Arc::new(self.fences.clone()), &self.prefix)
    }

    fn sandbox(&self) -> SandboxId {
        let id = SandboxId::generate();
        self.fences.register(&id);
        id
    }
}

#[async_trait]
impl LeaseHarness for Harness {
    type Store = RedisLeaseStore;

    async fn open(&self) -> RedisLeaseStore {
        self.replica().await
    }

    async fn create_sandbox(&self, _store: &RedisLeaseStore) -> SandboxId {
        self.sandbox()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_lease_store_passes_the_conformance_suite() {
    let Some((h, conn)) = Harness::new().await else {
        return;
    };
    conformance::run_all(&h).await;
    support::flush_prefix(&conn, &h.prefix).await;
}

/// Redis restarting without persistence (modelled by deleting this test's
/// keys): the live lease is gone, so only liveness is lost. The old token
/// is refused, and the next grant's fence is above it because the counter
/// lives in the registry.
#[tokio::test]
async fn losing_redis_costs_liveness_not_safety() {
    let Some((h, conn)) = Harness::new().await else {
        return;
    };
    let store = h.replica().await;
    let sb = h.sandbox();
    let old = store.acquire(&sb, "before", MINUTE, T0).await.unwrap();
    assert!(support::flush_prefix(&conn, &h.prefix).await > 0);

    assert_eq!(store.current(&sb, at(1)).await.unwrap(), None);
    assert_eq!(
        store.check(&sb, Some(old.token), at(1)).await.unwrap_err(),
        LeaseError::StaleToken,
        "the old holder's token after Redis lost its lease"
    );
    assert_eq!(
        store
            .renew(&sb, old.token, MINUTE, at(1))
            .await
            .unwrap_err(),
        LeaseError::StaleToken
    );
    assert_eq!(
        store.check(&sb, None, at(1)).await.unwrap(),
        Fence::Unleased
    );

    let new = store.acquire(&sb, "after", MINUTE, at(2)).await.unwrap();
    assert!(
        new.token.fence() > old.token.fence(),
        "fence {} after Redis lost {}",
        new.token.fence(),
        old.token.fence()
    );
    assert_eq!(
        h.fences.current_fence(&sb).await.unwrap(),
        new.token.fence(),
        "the registry's counter is the new holder's fence"
    );
    // and a registry write fenced by the old token is refused there too
    let counter = h.fences.current_fence(&sb).await.unwrap();
    assert_eq!(
        counter_rule(counter, old.token.fence(), true),
        Err(LeaseError::StaleToken)
    );
    assert_eq!(counter_rule(counter, new.token.fence(), true), Ok(()));
    support::flush_prefix(&conn, &h.prefix).await;
}

/// Two replicas (two stores, two connections) racing acquires on one
/// sandbox, round after round: exactly one winner per round, and its fence
/// is the registry's counter (a lost race draws no fence, so the winner's
/// registry writes pass the counter check).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_racing_have_one_winner() {
    const PER_REPLICA: usize = 10;
    let Some((h, conn)) = Harness::new().await else {
        return;
    };
    let replicas = [Arc::new(h.replica().await), Arc::new(h.replica().await)];
    let sb = h.sandbox();
    for round in 0..5i64 {
        let before = h.fences.current_fence(&sb).await.unwrap();
        let mut tasks = Vec::new();
        for (r, store) in replicas.iter().enumerate() {
            for i in 0..PER_REPLICA {
                let (store, sb) = (store.clone(), sb.clone());
                tasks.push(tokio::spawn(async move {
                    store
                        .acquire(&sb, &format!("replica-{r}/task-{i}"), MINUTE, at(round))
                        .await
                }));
            }
        }
        let mut winners = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok(lease) => winners.push(lease),
                Err(LeaseError::Held { .. }) => {}
                Err(e) => panic!("round {round}: acquire failed with {e:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: {winners:?}");
        let w = &winners[0];
        assert_eq!(
            w.token.fence(),
            before + 1,
            "round {round}: one grant, one fence"
        );
        assert_eq!(h.fences.current_fence(&sb).await.unwrap(), w.token.fence());
        for store in &replicas {
            assert_eq!(
                store.current(&sb, at(round)).await.unwrap().as_ref(),
                Some(w),
                "both replicas see the winner"
            );
        }
        replicas[1].release(&sb, w.token, at(round)).await.unwrap();
    }
    support::flush_prefix(&conn, &h.prefix).await;
}

/// A grant a crashed replica left half done (its claim, no lease) holds
/// other grants back only until the claim runs out.
#[tokio::test]
async fn a_crashed_grant_delays_the_next_only_until_its_claim_runs_out() {
    let Some((h, conn)) = Harness::new().await else {
        return;
    };
    let store = h.replica().await;
    let sb = h.sandbox();
    let () = redis::cmd("SET")
        .arg(format!("{}:lease-claim:{sb}", h.prefix))
        .arg("claim-of-a-crashed-replica")
        .arg("PX")
        .arg(300)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let l = store.acquire(&sb, "a", MINUTE, T0).await.unwrap();
    assert_eq!(l.token.fence(), 1, "the crashed grant drew no fence");
    assert_eq!(store.current(&sb, at(1)).await.unwrap(), Some(l));
    support::flush_prefix(&conn, &h.prefix).await;
}

/// Redis' own expiry of a lease hash is garbage collection only: well
/// past the lease's ttl, whatever the caller's clock says.
#[tokio::test]
async fn the_lease_hash_outlives_its_ttl() {
    let Some((h, conn)) = Harness::new().await else {
        return;
    };
    let store = h.replica().await;
    let sb = h.sandbox();
    store.acquire(&sb, "a", MINUTE, T0).await.unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(format!("{}:lease:{sb}", h.prefix))
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert!(pttl > 60_000, "gc ttl {pttl} ms is not past the lease ttl");
    support::flush_prefix(&conn, &h.prefix).await;
}

/// More due leases than one expire script takes: all are reaped, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expire_due_reaps_every_due_lease_across_batches() {
    const LEASES: usize = 600;
    let Some((h, conn)) = Harness::new().await else {
        return;
    };
    let store = Arc::new(h.replica().await);
    let sandboxes: Vec<SandboxId> = (0..LEASES).map(|_| h.sandbox()).collect();
    let mut tasks = Vec::new();
    for (i, sb) in sandboxes.iter().enumerate() {
        let (store, sb) = (store.clone(), sb.clone());
        // half run out at 10 s, half at 100 s
        let ttl = Duration::from_secs(if i % 2 == 0 { 10 } else { 100 });
        tasks.push(tokio::spawn(async move {
            store.acquire(&sb, "a", ttl, T0).await.unwrap()
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let early = store.expire_due(at(50)).await.unwrap();
    assert_eq!(early.len(), LEASES / 2);
    assert!(early.iter().all(|l| l.expires_at == at(10)));
    assert_eq!(
        store
            .current(&sandboxes[1], at(50))
            .await
            .unwrap()
            .map(|l| l.expires_at),
        Some(at(100))
    );
    let late = store.expire_due(at(100)).await.unwrap();
    assert_eq!(late.len(), LEASES / 2);
    assert!(store.expire_due(at(1000)).await.unwrap().is_empty());
    support::flush_prefix(&conn, &h.prefix).await;
}
