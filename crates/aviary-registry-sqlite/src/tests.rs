use super::*;
use async_trait::async_trait;
use aviary_core::{SandboxId, SandboxState};
use aviary_leases::conformance::LeaseHarness;
use aviary_registry::conformance::{sample_sandbox, RegistryHarness};
use aviary_registry::{EventFilter, FenceCheck, TransitionCtx, MAX_LIMIT};
use proptest::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

/// A database file in a temporary directory that lives as long as the harness.
struct FileDb {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl FileDb {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("registry.db");
        FileDb { _dir: dir, path }
    }
}

#[async_trait]
impl RegistryHarness for FileDb {
    type Registry = SqliteRegistry;
    async fn open(&self) -> SqliteRegistry {
        SqliteRegistry::open(&self.path).await.unwrap()
    }
}

#[async_trait]
impl LeaseHarness for FileDb {
    type Store = SqliteRegistry;
    async fn open(&self) -> SqliteRegistry {
        SqliteRegistry::open(&self.path).await.unwrap()
    }
    async fn create_sandbox(&self, store: &SqliteRegistry) -> SandboxId {
        let new = sample_sandbox("lease-conformance");
        store
            .insert_sandbox(&new, TransitionCtx::default())
            .await
            .unwrap();
        new.id
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_conformance() {
    aviary_registry::conformance::run_all(&FileDb::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_conformance() {
    aviary_leases::conformance::run_all(&FileDb::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopen_keeps_schema_and_tokens() {
    let db = FileDb::new();
    let now = aviary_core::now();
    let ttl = std::time::Duration::from_secs(30);
    let new = sample_sandbox("t");
    let mut last = 0;
    for round in 0..4 {
        let reg = SqliteRegistry::open(&db.path).await.unwrap();
        assert_eq!(
            reg.schema_version().await.unwrap(),
            crate::MIGRATIONS.len() as i64,
            "migrations run once"
        );
        if round == 0 {
            reg.insert_sandbox(&new, TransitionCtx::default())
                .await
                .unwrap();
        }
        assert_eq!(reg.get_sandbox(&new.id).await.unwrap().id, new.id);
        let l = reg.acquire(&new.id, "o", ttl, now).await.unwrap();
        assert!(
            l.token.fence() > last,
            "round {round}: {} <= {last}",
            l.token
        );
        last = l.token.fence();
        // alternate the ways a lease ends; neither may lower the counter
        if round % 2 == 0 {
            reg.release(&new.id, l.token, now).await.unwrap();
        } else {
            reg.revoke(&new.id).await.unwrap();
        }
        reg.close().await;
        // a closed registry refuses work instead of silently reopening
        reg.get_sandbox(&new.id).await.unwrap_err();
    }
    assert_eq!(last, 4, "one step per grant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_schema_is_refused() {
    let db = FileDb::new();
    let reg = SqliteRegistry::open(&db.path).await.unwrap();
    sqlx::raw_sql("PRAGMA user_version = 99")
        .execute(&reg.writer)
        .await
        .unwrap();
    reg.close().await;
    let e = SqliteRegistry::open(&db.path).await.unwrap_err();
    assert!(
        matches!(&e, RegistryError::Storage(m) if m.contains("newer")),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handles_on_one_file_race_fairly() {
    // Two independent registries (as two processes would have) on one file:
    // BEGIN IMMEDIATE + busy_timeout make exactly one acquire win.
    let db = FileDb::new();
    let a = std::sync::Arc::new(SqliteRegistry::open(&db.path).await.unwrap());
    let b = std::sync::Arc::new(SqliteRegistry::open(&db.path).await.unwrap());
    let new = sample_sandbox("t");
    a.insert_sandbox(&new, TransitionCtx::default())
        .await
        .unwrap();
    let now = aviary_core::now();
    let handles: Vec<_> = (0..20)
        .map(|i| {
            let reg = if i % 2 == 0 { a.clone() } else { b.clone() };
            let id = new.id.clone();
            tokio::spawn(async move {
                reg.acquire(
                    &id,
                    &format!("o{i}"),
                    std::time::Duration::from_secs(30),
                    now,
                )
                .await
            })
        })
        .collect();
    let mut wins = 0;
    for h in handles {
        match h.await.unwrap() {
            Ok(l) => {
                wins += 1;
                assert_eq!(l.token.fence(), 1);
            }
            Err(LeaseError::Held { .. }) => {}
            Err(e) => panic!("acquire failed: {e:?}"),
        }
    }
    assert_eq!(wins, 1);
}

fn median_us(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Measures; asserts only behaviour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measure_latency() {
    const N: usize = 300;
    let db = FileDb::new();
    let reg = SqliteRegistry::open(&db.path).await.unwrap();
    let mut inserts = Vec::with_capacity(N);
    let mut ids = Vec::with_capacity(N);
    for _ in 0..N {
        let new = sample_sandbox("bench");
        let t = Instant::now();
        reg.insert_sandbox(&new, TransitionCtx::default())
            .await
            .unwrap();
        inserts.push(t.elapsed().as_secs_f64() * 1e6);
        ids.push(new.id);
    }
    let id = &ids[0];
    let mut rec = reg
        .transition(
            id,
            0,
            &[
                SandboxState::Planning,
                SandboxState::Allocating,
                SandboxState::Locking,
                SandboxState::Idle,
            ],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap();
    let mut transitions = Vec::with_capacity(N);
    for i in 0..N {
        let to = if i % 2 == 0 {
            SandboxState::Leased
        } else {
            SandboxState::Idle
        };
        let t = Instant::now();
        rec = reg
            .transition(
                id,
                rec.version,
                &[to],
                FenceCheck::Require(None),
                TransitionCtx::default(),
            )
            .await
            .unwrap();
        transitions.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut acquires = Vec::with_capacity(N);
    let now = aviary_core::now();
    for _ in 0..N {
        let t = Instant::now();
        let l = reg
            .acquire(id, "bench", std::time::Duration::from_secs(30), now)
            .await
            .unwrap();
        acquires.push(t.elapsed().as_secs_f64() * 1e6);
        reg.release(id, l.token, now).await.unwrap();
    }
    let mut gets = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        reg.get_sandbox(id).await.unwrap();
        gets.push(t.elapsed().as_secs_f64() * 1e6);
    }
    eprintln!(
        "sqlite registry latency (median of {N}): insert_sandbox {:.0} us, transition {:.0} us, \
         acquire {:.0} us, get_sandbox {:.0} us",
        median_us(inserts),
        median_us(transitions),
        median_us(acquires),
        median_us(gets)
    );
    assert_eq!(rec.version, 4 + i64::try_from(N).unwrap());
}

fn any_state() -> impl Strategy<Value = SandboxState> {
    (0..SandboxState::ALL.len()).prop_map(|i| SandboxState::ALL[i])
}

/// Random paths either succeed exactly when the state machine allows every
/// step, or fail with IllegalTransition and leave state, version and the
/// event log untouched.
#[test]
fn random_transitions_follow_the_state_machine() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let db = FileDb::new();
    let reg = rt.block_on(SqliteRegistry::open(&db.path)).unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(48));
    let strategy = proptest::collection::vec(proptest::collection::vec(any_state(), 1..4), 1..16);
    runner
        .run(&strategy, |paths| {
            rt.block_on(async {
                let new = sample_sandbox("prop");
                let mut rec = reg
                    .insert_sandbox(&new, TransitionCtx::default())
                    .await
                    .unwrap();
                let events = |reg: &SqliteRegistry| {
                    let filter = EventFilter {
                        sandbox_id: Some(new.id.clone()),
                        limit: MAX_LIMIT,
                        ..EventFilter::default()
                    };
                    let reg = reg.clone();
                    async move { reg.list_events(&filter).await.unwrap().len() }
                };
                let mut n_events = events(&reg).await;
                for path in paths {
                    let model = aviary_registry::validate_path(rec.state, &path);
                    let got = reg
                        .transition(
                            &new.id,
                            rec.version,
                            &path,
                            FenceCheck::Skip,
                            TransitionCtx::default(),
                        )
                        .await;
                    match (model, got) {
                        (Ok(()), Ok(next)) => {
                            prop_assert_eq!(next.state, *path.last().unwrap());
                            prop_assert_eq!(next.version, rec.version + path.len() as i64);
                            n_events += path.len();
                            rec = next;
                        }
                        (Err(want), Err(got)) => {
                            prop_assert_eq!(got, want);
                            let now = reg.get_sandbox(&new.id).await.unwrap();
                            prop_assert_eq!(now.state, rec.state);
                            prop_assert_eq!(now.version, rec.version);
                        }
                        (model, got) => {
                            return Err(TestCaseError::fail(format!(
                                "{:?} via {path:?}: model {model:?}, registry {got:?}",
                                rec.state
                            )));
                        }
                    }
                    prop_assert_eq!(events(&reg).await, n_events);
                }
                Ok(())
            })
        })
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_sandbox_is_claimed_exactly_once() {
    let db = FileDb::new();
    let reg = std::sync::Arc::new(SqliteRegistry::open(&db.path).await.unwrap());
    let new = sample_sandbox(aviary_registry::POOL_TENANT);
    let rec = reg
        .insert_sandbox(&new, TransitionCtx::default())
        .await
        .unwrap();
    use SandboxState::*;
    let rec = reg
        .transition(
            &new.id,
            rec.version,
            &[Planning, Allocating, Provisioning, Ready],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap();
    let claim = |t: &str| aviary_registry::SandboxClaim {
        tenant: t.into(),
        user_id: None,
        session_id: None,
        agent: None,
        scope: aviary_core::Scope::Session,
        expires_at: None,
        user_managed: false,
        metadata: Default::default(),
        env: Default::default(),
        run_as: Default::default(),
        workdir: Default::default(),
    };
    // 20 concurrent claimers, one winner
    let mut tasks = Vec::new();
    for i in 0..20 {
        let reg = reg.clone();
        let id = new.id.clone();
        let c = claim(&format!("tenant-{i}"));
        let v = rec.version;
        tasks.push(tokio::spawn(async move {
            reg.claim_sandbox(&id, v, &c, TransitionCtx::default())
                .await
        }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Ok(r) => winners.push(r),
            Err(e) => assert!(matches!(e, RegistryError::Conflict), "{e:?}"),
        }
    }
    assert_eq!(winners.len(), 1);
    assert_eq!(winners[0].state, Locking);
    assert!(winners[0].tenant.starts_with("tenant-"));
    // an owned sandbox cannot be claimed again, even with its current version
    let e = reg
        .claim_sandbox(
            &new.id,
            winners[0].version,
            &claim("other"),
            TransitionCtx::default(),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, RegistryError::Conflict), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_from_before_revocation_get_ids_and_keep_working() {
    let db = FileDb::new();
    // a schema-3 database with two keys, as an older build left it
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&db.path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    for m in &MIGRATIONS[..3] {
        sqlx::raw_sql(m).execute(&pool).await.unwrap();
    }
    sqlx::raw_sql(
        "PRAGMA user_version = 3; \
         INSERT INTO tenant (tenant_id, created_at) VALUES ('t', 1); \
         INSERT INTO api_key (key_hash, tenant_id, admin, created_at) VALUES ('h1', 't', 1, 1), ('h2', 't', 0, 2);",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;

    let reg = SqliteRegistry::open(&db.path).await.unwrap();
    let keys = reg.list_api_keys().await.unwrap();
    assert_eq!(keys.len(), 2);
    assert!(keys.iter().all(|k| k.id.starts_with("key-")), "{keys:?}");
    assert_ne!(keys[0].id, keys[1].id);
    assert!(reg.find_api_key("h1").await.unwrap().unwrap().admin);
    reg.revoke_api_key(&keys[0].id, aviary_core::now())
        .await
        .unwrap();
    assert_eq!(reg.find_api_key("h1").await.unwrap(), None);
}

/// The plan SQLite picks for `sql` (bind parameters left unbound: NULL).
async fn query_plan(reg: &SqliteRegistry, sql: &str) -> String {
    let rows = sqlx::query(&format!("EXPLAIN QUERY PLAN {sql}"))
        .fetch_all(&reg.reader)
        .await
        .unwrap();
    rows.iter()
        .map(|r| sqlx::Row::get::<String, _>(r, "detail"))
        .collect::<Vec<_>>()
        .join("; ")
}

#[tokio::test]
async fn the_servers_queries_use_their_indexes() {
    let db = FileDb::new();
    let reg = SqliteRegistry::open(&db.path).await.unwrap();
    let latest = query_plan(&reg, &crate::registry::latest_snapshot_sql()).await;
    assert!(
        latest.contains("sandbox_snapshot_by_sandbox") && !latest.contains("TEMP B-TREE"),
        "latest snapshot: {latest}"
    );
    let by_label = query_plan(
        &reg,
        "SELECT snapshot_id FROM sandbox_snapshot WHERE tenant_id = ? AND label = ? \
         ORDER BY created_at, rowid",
    )
    .await;
    assert!(
        by_label.contains("sandbox_snapshot_by_label") && !by_label.contains("TEMP B-TREE"),
        "by label: {by_label}"
    );
    let of_sandbox = query_plan(
        &reg,
        "SELECT snapshot_id FROM sandbox_snapshot WHERE tenant_id = ? AND sandbox_id = ? \
         ORDER BY created_at, rowid",
    )
    .await;
    assert!(
        of_sandbox.contains("sandbox_snapshot_by_sandbox") && !of_sandbox.contains("TEMP B-TREE"),
        "of a sandbox: {of_sandbox}"
    );
    let by_tenant = query_plan(
        &reg,
        "SELECT snapshot_id FROM sandbox_snapshot WHERE tenant_id = ? ORDER BY created_at, rowid",
    )
    .await;
    assert!(
        by_tenant.contains("sandbox_snapshot_by_tenant") && !by_tenant.contains("TEMP B-TREE"),
        "by tenant: {by_tenant}"
    );
    let handouts = query_plan(&reg, &crate::registry::pool_handouts_sql()).await;
    assert!(
        handouts.contains("sandbox_instance_pool_handouts") && !handouts.contains("TEMP B-TREE"),
        "pool hand-outs: {handouts}"
    );
}

#[tokio::test]
async fn sandboxes_from_before_schema_6_are_no_pool_handouts() {
    let db = FileDb::new();
    // a schema-5 database with a claimed pooled sandbox, as an older build left it
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&db.path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    for m in &MIGRATIONS[..5] {
        sqlx::raw_sql(m).execute(&pool).await.unwrap();
    }
    sqlx::raw_sql(
        "PRAGMA user_version = 5; \
         INSERT INTO sandbox_instance (sandbox_id, tenant_id, scope, runtime_provider, node_id, \
         resource_class, cpu, memory_mb, disk_mb, pids, template_id, template_digest, \
         network_profile, state, created_at, last_active_at, version, tainted) VALUES \
         ('sbx-abcdefghijklmnopqrst', 'acme', 'session', 'crun', 'local', 'python-small', 1.0, \
         512, 1024, 64, 'busybox', 'sha256:aa', 'none', 'Leased', 1, 1, 7, 0);",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
    let reg = SqliteRegistry::open(&db.path).await.unwrap();
    assert_eq!(reg.schema_version().await.unwrap(), MIGRATIONS.len() as i64);
    let old = reg.list_sandboxes(Some("acme"), false).await.unwrap();
    assert_eq!((old.len(), old[0].version), (1, 7), "{old:?}");
    assert!(!old[0].paused, "an older row is not paused");
    assert!(reg.list_pool_handouts().await.unwrap().is_empty());
    assert!(reg.list_pool_bounds().await.unwrap().is_empty());
    assert!(reg.list_node_registrations().await.unwrap().is_empty());
    assert!(reg
        .list_snapshots(&Default::default())
        .await
        .unwrap()
        .is_empty());
}

/// The live listings a create reads (quota by tenant, pool claims, the
/// scheduler's view) are answered from the live-rows partial indexes, so
/// their cost does not grow with the terminated history: SQLite's own query
/// plan names the index, and the listing is right over a history of
/// terminated rows.
#[tokio::test]
async fn live_listings_use_the_live_index_not_the_history() {
    let db = FileDb::new();
    let reg = SqliteRegistry::open(&db.path).await.unwrap();
    for (by_tenant, index) in [
        (true, "sandbox_instance_live_by_tenant"),
        (false, "sandbox_instance_live"),
    ] {
        let sql = crate::registry::list_sandboxes_sql(by_tenant, false);
        let explain = format!("EXPLAIN QUERY PLAN {sql}");
        let mut q = sqlx::query(&explain);
        if by_tenant {
            q = q.bind("acme");
        }
        let plan: Vec<String> = q
            .fetch_all(&reg.reader)
            .await
            .unwrap()
            .iter()
            .map(|r| sqlx::Row::get::<String, _>(r, "detail"))
            .collect();
        assert!(
            plan.iter().any(|d| d.contains(index)),
            "by_tenant={by_tenant}: {plan:?}"
        );
        assert!(
            !plan.iter().any(|d| d.contains("TEMP B-TREE")),
            "the index gives the order: {plan:?}"
        );
        // the sums a create reads (quota, scheduler) scan the same index
        let sql = format!(
            "EXPLAIN QUERY PLAN {}",
            crate::registry::live_totals_sql(by_tenant)
        );
        let mut q = sqlx::query(&sql);
        if by_tenant {
            q = q.bind("acme");
        }
        let plan: Vec<String> = q
            .fetch_all(&reg.reader)
            .await
            .unwrap()
            .iter()
            .map(|r| sqlx::Row::get::<String, _>(r, "detail"))
            .collect();
        assert!(
            plan.iter().any(|d| d.contains(index)),
            "live totals, by_tenant={by_tenant}: {plan:?}"
        );
    }
    // a history of terminated rows, and live rows of two tenants
    let mut live = Vec::new();
    for i in 0..40 {
        let tenant = if i % 2 == 0 { "acme" } else { "other" };
        let rec = reg
            .insert_sandbox(&sample_sandbox(tenant), TransitionCtx::default())
            .await
            .unwrap();
        if i % 4 == 0 && tenant == "acme" {
            live.push(rec.id);
        } else if tenant == "acme" {
            reg.transition(
                &rec.id,
                rec.version,
                &[SandboxState::Terminated],
                FenceCheck::Skip,
                TransitionCtx::default(),
            )
            .await
            .unwrap();
        }
    }
    let listed: Vec<SandboxId> = reg
        .list_sandboxes(Some("acme"), false)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(listed, live, "live rows of the tenant, oldest first");
    assert_eq!(
        reg.list_sandboxes(Some("acme"), true).await.unwrap().len(),
        20
    );
    assert_eq!(reg.list_sandboxes(None, false).await.unwrap().len(), 30);
}
