//! The registry and lease conformance suites, and the PostgreSQL-specific
//! behaviour (schemas, migrations, restarts, races between control planes),
//! against the real server at `AVIARY_TEST_POSTGRES_URL`
//! (`scripts/services.sh start`). Each test works in a fresh random schema
//! and drops it at the end, even when it fails. Without the variable the
//! tests print why and pass, unless `AVIARY_REQUIRE_SERVICES=1`.
#![allow(clippy::tests_outside_test_module)] // integration tests are their own crate

use async_trait::async_trait;
use aviary_core::{SandboxId, SandboxState};
use aviary_leases::conformance::LeaseHarness;
use aviary_leases::{FenceAuthority, LeaseError, LeaseStore};
use aviary_registry::conformance::{sample_sandbox, RegistryHarness};
use aviary_registry::{
    EventFilter, FenceCheck, NewEvent, Registry, RegistryError, TransitionCtx, MAX_LIMIT,
};
use aviary_registry_postgres::{PostgresOptions, PostgresRegistry, SCHEMA_VERSION};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SKIPPED: &str = "SKIPPED: AVIARY_TEST_POSTGRES_URL not set (run scripts/services.sh start)";
const MINUTE: Duration = Duration::from_secs(60);

/// The test server's URL; `None` (after saying so) when there is none.
fn test_url() -> Option<String> {
    match std::env::var("AVIARY_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() == Ok("1") => panic!("{SKIPPED}"),
        _ => {
            eprintln!("{SKIPPED}");
            None
        }
    }
}

/// A fresh schema on the test server; dropped (with everything in it) when
/// the value is, so a failing test cleans up too.
struct TestSchema {
    url: String,
    schema: String,
}

impl TestSchema {
    fn new() -> Option<Self> {
        let url = test_url()?;
        let schema = aviary_core::new_id("aviary_test")
            .replace('-', "_")
            .to_ascii_lowercase();
        Some(TestSchema { url, schema })
    }

    fn options(&self) -> PostgresOptions {
        PostgresOptions {
            max_connections: 4,
            ..PostgresOptions::default()
        }
        .schema(&self.schema)
    }

    /// A new registry (a new pool) on this schema: a control plane
    /// starting, or restarting.
    async fn registry(&self) -> PostgresRegistry {
        PostgresRegistry::connect(&self.url, self.options())
            .await
            .unwrap()
    }

    /// One connection to the server, outside any registry, with the
    /// schema as its search path (for what the API does not offer).
    async fn raw(&self) -> sqlx::PgConnection {
        use sqlx::{Connection, Executor};
        let mut conn = sqlx::PgConnection::connect(&self.url).await.unwrap();
        conn.execute(format!("SET search_path TO \"{}\"", self.schema).as_str())
            .await
            .unwrap();
        conn
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        // Drop runs inside the test's runtime, which must not block on
        // itself: drop the schema from a thread with its own runtime.
        let (url, schema) = (self.url.clone(), self.schema.clone());
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                use sqlx::{Connection, Executor};
                let mut conn = sqlx::PgConnection::connect(&url).await?;
                conn.execute(format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE").as_str())
                    .await?;
                conn.close().await
            })
            .map_err(std::io::Error::other)
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("dropping test schema {}: {e}", self.schema),
            Err(_) => eprintln!("dropping test schema {}: the thread panicked", self.schema),
        }
    }
}

#[async_trait]
impl RegistryHarness for TestSchema {
    type Registry = PostgresRegistry;
    async fn open(&self) -> PostgresRegistry {
        self.registry().await
    }
}

#[async_trait]
impl LeaseHarness for TestSchema {
    type Store = PostgresRegistry;
    async fn open(&self) -> PostgresRegistry {
        self.registry().await
    }
    async fn create_sandbox(&self, store: &PostgresRegistry) -> SandboxId {
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
    let Some(db) = TestSchema::new() else { return };
    aviary_registry::conformance::run_all(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_conformance() {
    let Some(db) = TestSchema::new() else { return };
    aviary_leases::conformance::run_all(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopen_keeps_data_and_migrates_once() {
    let Some(db) = TestSchema::new() else { return };
    use SandboxState::*;
    let new = sample_sandbox("t");
    // one step of the creation path per control plane
    for (round, step) in (0..).zip([Planning, Allocating, Provisioning]) {
        let reg = db.registry().await;
        assert_eq!(reg.schema_version().await.unwrap(), SCHEMA_VERSION);
        if round == 0 {
            reg.insert_sandbox(&new, TransitionCtx::default())
                .await
                .unwrap();
        }
        let rec = reg.get_sandbox(&new.id).await.unwrap();
        assert_eq!(rec.version, round, "round {round}");
        reg.transition(
            &new.id,
            round,
            &[step],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap();
        reg.close().await;
        // a closed registry refuses work instead of silently reconnecting;
        // it is a replica going away, so callers hear 503 and retry elsewhere
        let e = reg.get_sandbox(&new.id).await.unwrap_err();
        assert!(matches!(e, RegistryError::Unavailable(_)), "{e:?}");
    }
    let mut raw = db.raw().await;
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM registry_migrations ORDER BY version")
            .fetch_all(&mut raw)
            .await
            .unwrap();
    assert_eq!(
        applied,
        (1..=SCHEMA_VERSION).collect::<Vec<_>>(),
        "each migration once"
    );
    let events = db
        .registry()
        .await
        .list_events(&EventFilter {
            sandbox_id: Some(new.id.clone()),
            limit: MAX_LIMIT,
            ..EventFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(events.len(), 4, "created + one per round");
    assert_eq!(events[3].new_state, Some(Provisioning));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_connects_migrate_once() {
    let Some(db) = TestSchema::new() else { return };
    let db = Arc::new(db);
    let connects: Vec<_> = (0..4)
        .map(|_| {
            let db = Arc::clone(&db);
            tokio::spawn(async move { db.registry().await.schema_version().await })
        })
        .collect();
    for c in connects {
        assert_eq!(c.await.unwrap().unwrap(), SCHEMA_VERSION);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_schema_is_refused() {
    let Some(db) = TestSchema::new() else { return };
    db.registry().await.close().await;
    let mut raw = db.raw().await;
    sqlx::query(
        "INSERT INTO registry_migrations (version, description, applied_at) \
         VALUES (999, 'from the future', 0)",
    )
    .execute(&mut raw)
    .await
    .unwrap();
    let e = PostgresRegistry::connect(&db.url, db.options())
        .await
        .unwrap_err();
    assert!(
        matches!(&e, RegistryError::Storage(m) if m.contains("newer")),
        "{e:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_keep_registries_apart() {
    let (Some(a), Some(b)) = (TestSchema::new(), TestSchema::new()) else {
        return;
    };
    let (ra, rb) = (a.registry().await, b.registry().await);
    let new = sample_sandbox("t");
    ra.insert_sandbox(&new, TransitionCtx::default())
        .await
        .unwrap();
    assert_eq!(
        rb.get_sandbox(&new.id).await.unwrap_err(),
        RegistryError::NotFound
    );
    // the same id in the other schema is no duplicate
    rb.insert_sandbox(&new, TransitionCtx::default())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_schema_names_are_refused_before_connecting() {
    // no server needed: the name is checked first
    for bad in ["", "a-b", "x\"; DROP SCHEMA public; --", "pg_catalog"] {
        let e = PostgresRegistry::connect(
            "postgres://u@127.0.0.1:1/db",
            PostgresOptions::default().schema(bad),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&e, RegistryError::Storage(m) if m.contains("bad schema name")),
            "{bad:?}: {e:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_url_is_refused_without_echoing_it() {
    for url in [
        "postgres://aviary:hunter2-secret@127.0.0.1:notaport/db",
        "postgres://aviary:hunter2-secret@[::1/db",
        "hunter2-secret",
    ] {
        let e = PostgresRegistry::connect(url, PostgresOptions::default())
            .await
            .unwrap_err();
        let RegistryError::Storage(msg) = &e else {
            panic!("{url}: {e:?}")
        };
        assert!(msg.contains("bad postgres url"), "{url}: {msg}");
        assert!(!msg.contains("hunter2"), "the password leaked: {msg}");
    }
}

/// A loopback port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_closed_port_fails_at_once_naming_the_address() {
    let port = closed_port();
    let url = format!("postgres://aviary:hunter2-secret@127.0.0.1:{port}/aviary");
    let opts = PostgresOptions {
        connect_timeout: Duration::from_secs(2),
        ..PostgresOptions::default()
    };
    let started = Instant::now();
    let e = PostgresRegistry::connect(&url, opts).await.unwrap_err();
    let took = started.elapsed();
    eprintln!("refused connect failed after {took:?}: {e}");
    let RegistryError::Storage(msg) = &e else {
        panic!("{e:?}")
    };
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    assert!(
        msg.to_lowercase().contains("refused"),
        "the cause is kept: {msg}"
    );
    assert!(!msg.contains("hunter2"), "the password leaked: {msg}");
    // refused is answered at once; the pool's retry loop would wait out its
    // timeout (and lose the cause)
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_silent_server_times_out_naming_the_address() {
    // accepts the TCP connection (the kernel does) but never answers
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let url = format!("postgres://aviary:hunter2-secret@127.0.0.1:{port}/aviary");
    let opts = PostgresOptions {
        connect_timeout: Duration::from_millis(500),
        ..PostgresOptions::default()
    };
    let e = PostgresRegistry::connect(&url, opts).await.unwrap_err();
    let RegistryError::Storage(msg) = &e else {
        panic!("{e:?}")
    };
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    assert!(msg.contains("timed out"), "{msg}");
    assert!(!msg.contains("hunter2"), "the password leaked: {msg}");
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_never_shows_the_password() {
    let Some(db) = TestSchema::new() else { return };
    let reg = db.registry().await;
    let shown = format!("{reg:?}");
    assert!(shown.contains(&db.schema), "{shown}");
    if let Some(password) = url_password(&db.url) {
        assert!(!shown.contains(&password), "{shown}");
    }
}

fn url_password(url: &str) -> Option<String> {
    let creds = url.split("://").nth(1)?.split('@').next()?;
    creds.split_once(':').map(|(_, p)| p.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_fences_survive_restarts() {
    let Some(db) = TestSchema::new() else { return };
    let now = aviary_core::now();
    let new = sample_sandbox("t");
    let mut last = 0;
    let mut live = None;
    for round in 0..4 {
        let reg = db.registry().await;
        if round == 0 {
            reg.insert_sandbox(&new, TransitionCtx::default())
                .await
                .unwrap();
        }
        // what the previous control plane left is still there
        assert_eq!(reg.current(&new.id, now).await.unwrap(), live.take());
        assert_eq!(reg.current_fence(&new.id).await.unwrap(), last);
        if let Some(held) = reg.current(&new.id, now).await.unwrap() {
            reg.release(&new.id, held.token, now).await.unwrap();
        }
        let l = reg.acquire(&new.id, "o", MINUTE, now).await.unwrap();
        assert_eq!(
            l.token.fence(),
            last + 1,
            "round {round}: one step per grant"
        );
        // alternate the ways a control plane goes away: with the lease
        // live, after release, after revoke, after a fence handed elsewhere
        match round {
            0 => live = Some(l.clone()),
            1 => reg.release(&new.id, l.token, now).await.unwrap(),
            2 => reg.revoke(&new.id).await.unwrap(),
            _ => {
                reg.revoke(&new.id).await.unwrap();
                assert_eq!(reg.next_fence(&new.id).await.unwrap(), l.token.fence() + 1);
            }
        }
        last = reg.current_fence(&new.id).await.unwrap();
        reg.close().await;
        reg.current(&new.id, now).await.unwrap_err();
    }
    let reg = db.registry().await;
    let l = reg.acquire(&new.id, "o", MINUTE, now).await.unwrap();
    assert_eq!(
        l.token.fence(),
        6,
        "four grants, one fence elsewhere, then this one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_control_planes_race_fairly() {
    // Two registries (two pools, as two control planes have) on one schema:
    // the row lock makes exactly one acquire and one transition win.
    let Some(db) = TestSchema::new() else { return };
    let a = Arc::new(db.registry().await);
    let b = Arc::new(db.registry().await);
    let new = sample_sandbox("t");
    a.insert_sandbox(&new, TransitionCtx::default())
        .await
        .unwrap();
    let now = aviary_core::now();
    let pick = |i: usize| {
        if i.is_multiple_of(2) {
            a.clone()
        } else {
            b.clone()
        }
    };
    let acquires: Vec<_> = (0..20)
        .map(|i| {
            let (reg, id) = (pick(i), new.id.clone());
            tokio::spawn(async move { reg.acquire(&id, &format!("o{i}"), MINUTE, now).await })
        })
        .collect();
    let mut winners = Vec::new();
    for h in acquires {
        match h.await.unwrap() {
            Ok(l) => winners.push(l),
            Err(LeaseError::Held { .. }) => {}
            Err(e) => panic!("acquire failed: {e:?}"),
        }
    }
    assert_eq!(winners.len(), 1);
    assert_eq!(winners[0].token.fence(), 1);
    let token = winners[0].token;

    let transitions: Vec<_> = (0..20)
        .map(|i| {
            let (reg, id) = (pick(i), new.id.clone());
            tokio::spawn(async move {
                reg.transition(
                    &id,
                    0,
                    &[SandboxState::Planning],
                    FenceCheck::Require(Some(token)),
                    TransitionCtx::default(),
                )
                .await
            })
        })
        .collect();
    let mut wins = 0;
    for h in transitions {
        match h.await.unwrap() {
            Ok(_) => wins += 1,
            Err(RegistryError::Conflict) => {}
            Err(e) => panic!("transition failed: {e:?}"),
        }
    }
    assert_eq!(wins, 1);
    assert_eq!(b.get_sandbox(&new.id).await.unwrap().version, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fence_racing_an_unleased_write_is_ordered_cleanly() {
    // An unleased writer (FenceCheck::Counter at the counter it saw) races a
    // fence handed to a networked lease store. Both queue on the sandbox
    // row: the write either commits first or is refused as LeaseRequired,
    // never fails otherwise (no deadlock, no serialization error).
    let Some(db) = TestSchema::new() else { return };
    let reg = Arc::new(db.registry().await);
    for _ in 0..10 {
        let new = sample_sandbox("t");
        reg.insert_sandbox(&new, TransitionCtx::default())
            .await
            .unwrap();
        let seen = reg.current_fence(&new.id).await.unwrap();
        let (r1, r2, id1, id2) = (reg.clone(), reg.clone(), new.id.clone(), new.id.clone());
        let grant = tokio::spawn(async move { r1.next_fence(&id1).await });
        let write = tokio::spawn(async move {
            r2.transition(
                &id2,
                0,
                &[SandboxState::Planning],
                FenceCheck::Counter {
                    seen,
                    leased: false,
                },
                TransitionCtx::default(),
            )
            .await
        });
        let fence = grant.await.unwrap().unwrap();
        assert_eq!(fence, seen + 1);
        match write.await.unwrap() {
            // it committed first: the grant came after it
            Ok(rec) => assert_eq!(rec.version, 1),
            Err(e) => assert_eq!(e, RegistryError::LeaseRequired),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_follower_never_skips_a_row() {
    // Writers on two pools append concurrently while followers page with
    // `after_id`: ids must become visible in increasing order, so each
    // follower sees every event exactly once.
    const WRITERS: usize = 8;
    const EACH: usize = 20;
    const FOLLOWERS: usize = 4;
    let Some(db) = TestSchema::new() else { return };
    let tenant = aviary_core::new_id("tenant");
    let (a, b) = (Arc::new(db.registry().await), Arc::new(db.registry().await));
    // Widen the race: every event insert now waits a little before its
    // transaction can commit, so without commit-ordered ids a later id
    // would routinely become visible before an earlier one.
    let mut raw = db.raw().await;
    sqlx::raw_sql(
        "CREATE FUNCTION slow_event_commit() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_sleep(random() * 0.01); RETURN NULL; END $$; \
         CREATE TRIGGER slow_event_commit AFTER INSERT ON sandbox_event \
         FOR EACH ROW EXECUTE FUNCTION slow_event_commit();",
    )
    .execute(&mut raw)
    .await
    .unwrap();
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let reg = if w.is_multiple_of(2) {
                a.clone()
            } else {
                b.clone()
            };
            let tenant = tenant.clone();
            tokio::spawn(async move {
                for i in 0..EACH {
                    // a sandbox's creation writes its event in a longer
                    // transaction than an append does
                    if i % 5 == 0 {
                        reg.insert_sandbox(&sample_sandbox(&tenant), TransitionCtx::default())
                            .await
                            .unwrap();
                    } else {
                        reg.append_event(NewEvent {
                            sandbox_id: None,
                            tenant: tenant.clone(),
                            event_type: format!("w{w}-{i}"),
                            old_state: None,
                            new_state: None,
                            request_id: None,
                            metadata: serde_json::json!({"w": w, "i": i}),
                        })
                        .await
                        .unwrap();
                    }
                }
            })
        })
        .collect();
    let writing_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // several followers: each catches a skip only if it reads in the short
    // window between two commits
    let followers: Vec<_> = (0..FOLLOWERS)
        .map(|f| {
            let reg = if f % 2 == 0 { a.clone() } else { b.clone() };
            let (tenant, writing_done) = (tenant.clone(), writing_done.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                loop {
                    // read before the page: once set, every event committed
                    // before the page's snapshot, so an empty page is the end
                    let finished = writing_done.load(std::sync::atomic::Ordering::SeqCst);
                    let page = reg
                        .list_events(&EventFilter {
                            tenant: Some(tenant.clone()),
                            after_id: seen.last().copied(),
                            limit: 3,
                            ..EventFilter::default()
                        })
                        .await
                        .unwrap();
                    if page.is_empty() && finished {
                        return seen;
                    }
                    seen.extend(page.iter().map(|e| e.id));
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    writing_done.store(true, std::sync::atomic::Ordering::SeqCst);
    let all: Vec<i64> = a
        .list_events(&EventFilter {
            tenant: Some(tenant),
            limit: MAX_LIMIT,
            ..EventFilter::default()
        })
        .await
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(all.len(), WRITERS * EACH);
    for (f, follower) in followers.into_iter().enumerate() {
        let followed = follower.await.unwrap();
        assert_eq!(followed, all, "follower {f} saw every event, in order");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pooled_sandbox_is_claimed_exactly_once() {
    use SandboxState::*;
    let Some(db) = TestSchema::new() else { return };
    let (a, b) = (Arc::new(db.registry().await), Arc::new(db.registry().await));
    let new = sample_sandbox(aviary_registry::POOL_TENANT);
    let rec = a
        .insert_sandbox(&new, TransitionCtx::default())
        .await
        .unwrap();
    let rec = a
        .transition(
            &new.id,
            rec.version,
            &[Planning, Allocating, Provisioning, Ready],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap();
    let claims: Vec<_> = (0..20)
        .map(|i| {
            let reg = if i % 2 == 0 { a.clone() } else { b.clone() };
            let id = new.id.clone();
            let claim = aviary_registry::SandboxClaim {
                tenant: format!("tenant-{i}"),
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
            let v = rec.version;
            tokio::spawn(async move {
                reg.claim_sandbox(&id, v, &claim, TransitionCtx::default())
                    .await
            })
        })
        .collect();
    let mut winners = Vec::new();
    for c in claims {
        match c.await.unwrap() {
            Ok(r) => winners.push(r),
            Err(e) => assert_eq!(e, RegistryError::Conflict),
        }
    }
    assert_eq!(winners.len(), 1);
    assert_eq!(winners[0].state, Locking);
    let handouts = b.list_pool_handouts().await.unwrap();
    assert_eq!(handouts.len(), 1);
    assert_eq!(handouts[0].tenant, winners[0].tenant);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_round_trips_through_jsonb() {
    let Some(db) = TestSchema::new() else { return };
    let reg = db.registry().await;
    let tenant = aviary_core::new_id("tenant");
    let metadata = serde_json::json!({
        "big": u64::MAX,
        "float": 1.5,
        "unicode": "héllo ✓",
        "quote": "a\"b\\c",
        "nested": {"list": [1, null, true, "x"], "empty": {}},
    });
    reg.append_event(NewEvent {
        sandbox_id: None,
        tenant: tenant.clone(),
        event_type: "json".into(),
        old_state: None,
        new_state: None,
        request_id: None,
        metadata: metadata.clone(),
    })
    .await
    .unwrap();
    let events = reg
        .list_events(&EventFilter {
            tenant: Some(tenant),
            ..EventFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(events[0].metadata, metadata);
}

fn any_state() -> impl Strategy<Value = SandboxState> {
    (0..SandboxState::ALL.len()).prop_map(|i| SandboxState::ALL[i])
}

/// Random paths either succeed exactly when the state machine allows every
/// step, or fail with IllegalTransition and leave state, version and the
/// event log untouched (a failed PostgreSQL transaction rolls back whole).
#[test]
fn random_transitions_follow_the_state_machine() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let Some(db) = TestSchema::new() else { return };
    let reg = rt.block_on(db.registry());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(32));
    let strategy = proptest::collection::vec(proptest::collection::vec(any_state(), 1..4), 1..12);
    let events = |reg: &PostgresRegistry, id: &SandboxId| {
        let filter = EventFilter {
            sandbox_id: Some(id.clone()),
            limit: MAX_LIMIT,
            ..EventFilter::default()
        };
        let reg = reg.clone();
        async move { reg.list_events(&filter).await.unwrap().len() }
    };
    runner
        .run(&strategy, |paths| {
            rt.block_on(async {
                let new = sample_sandbox("prop");
                let mut rec = reg
                    .insert_sandbox(&new, TransitionCtx::default())
                    .await
                    .unwrap();
                let mut n_events = events(&reg, &new.id).await;
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
                    prop_assert_eq!(events(&reg, &new.id).await, n_events);
                }
                Ok(())
            })
        })
        .unwrap();
    rt.block_on(reg.close());
    drop(reg);
    // the schema is dropped outside the runtime's threads
    drop(rt);
    drop(db);
}
