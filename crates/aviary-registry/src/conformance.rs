//! The conformance suite every [`Registry`] backend runs (SQLite now,
//! PostgreSQL later).
//!
//! A backend provides a [`RegistryHarness`] that opens a registry which is
//! also the [`LeaseStore`] on the same storage (the fencing check of
//! [`Registry::transition`] reads that lease table). Each check works in a
//! fresh random tenant, so checks can share one database; they panic with a
//! message naming the broken rule. Timestamps the caller supplies are whole
//! seconds, so backends with microsecond precision round-trip them exactly.

use crate::*;
use aviary_core::{new_id, NetworkProfile, ResourceLimits, Scope};
use aviary_leases::LeaseStore;
use std::sync::Arc;
use std::time::Duration;
use time::macros::datetime;
use time::OffsetDateTime;

/// How the suite reaches a backend.
#[async_trait]
pub trait RegistryHarness: Send + Sync {
    type Registry: Registry + LeaseStore + aviary_leases::FenceAuthority + 'static;
    /// Opens a registry on this harness's storage.
    async fn open(&self) -> Self::Registry;
}

/// Runs every check, in order, printing each name.
pub async fn run_all<H: RegistryHarness>(h: &H) {
    let r = Arc::new(h.open().await);
    macro_rules! run {
        ($($check:ident),* $(,)?) => {$(
            eprintln!("registry conformance: {}", stringify!($check));
            $check(&*r).await;
        )*};
    }
    run!(
        insert_then_get,
        list_filters_tenant_and_terminated,
        live_totals_sum_the_live_rows,
        transition_walks_a_path,
        transition_refuses_stale_version,
        transition_refuses_illegal_steps,
        transition_checks_the_fence,
        transition_checks_the_counter,
        field_updates_bump_version,
        touch_keeps_version,
        events_filter_and_page,
        templates_upsert,
        nodes_upsert,
        api_keys_map_to_tenants,
        api_keys_list_and_revoke,
        allocations_record_usage,
        environments_upsert,
        snapshots_index,
        projection_index_round_trips,
        pool_bounds_upsert,
        pool_handouts_follow_claims,
        node_registrations_upsert,
        server_secrets_are_written_once,
    );
    eprintln!("registry conformance: spawned_transitions_have_one_winner");
    spawned_transitions_have_one_winner(r, 10).await;
}

/// A sandbox to insert for `tenant`, with every optional field set.
pub fn sample_sandbox(tenant: &str) -> NewSandbox {
    NewSandbox {
        id: SandboxId::generate(),
        tenant: tenant.to_owned(),
        user_id: Some("user-1".into()),
        session_id: Some("session-1".into()),
        agent: Some("agent-1".into()),
        scope: Scope::User,
        resource_class: "python-small".into(),
        resources: ResourceLimits {
            cpu: 1.5,
            memory_mb: 2048,
            disk_mb: 4096,
            pids: 256,
        },
        template: "debian-12".into(),
        template_digest: "sha256:0123abcd".into(),
        runtime: "crun".into(),
        runtime_instance_id: None,
        node: "local".into(),
        network_profile: NetworkProfile::None,
        expires_at: Some(datetime!(2031-01-01 0:00 UTC)),
        tainted: false,
        user_managed: false,
        metadata: [("agentscope.workspace.id", "ws-1"), ("team", "a b=c")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        env: [("LANG", "C.UTF-8")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        run_as: Some("1000:1000".into()),
        workdir: Some("/workspace/src".into()),
    }
}

fn tenant() -> String {
    new_id("tenant")
}

async fn events_of<R: Registry>(r: &R, id: &SandboxId) -> Vec<aviary_core::api::Event> {
    r.list_events(&EventFilter {
        sandbox_id: Some(id.clone()),
        limit: MAX_LIMIT,
        ..EventFilter::default()
    })
    .await
    .unwrap()
}

async fn insert<R: Registry>(r: &R, tenant: &str) -> SandboxRecord {
    r.insert_sandbox(&sample_sandbox(tenant), TransitionCtx::default())
        .await
        .unwrap()
}

pub async fn insert_then_get<R: Registry>(r: &R) {
    let t = tenant();
    let new = sample_sandbox(&t);
    let before = aviary_core::now() - time::Duration::seconds(1);
    let rec = r
        .insert_sandbox(&new, TransitionCtx::request("req-1"))
        .await
        .unwrap();
    assert_eq!(rec.state, SandboxState::Requested);
    assert_eq!(rec.version, 0);
    assert_eq!(rec.id, new.id);
    assert_eq!(rec.tenant, t);
    assert_eq!(rec.user_id, new.user_id);
    assert_eq!(rec.session_id, new.session_id);
    assert_eq!(rec.agent, new.agent);
    assert_eq!(rec.scope, new.scope);
    assert_eq!(rec.resource_class, new.resource_class);
    assert_eq!(rec.resources, new.resources);
    assert_eq!(rec.template, new.template);
    assert_eq!(rec.template_digest, new.template_digest);
    assert_eq!(rec.runtime, new.runtime);
    assert_eq!(rec.runtime_instance_id, None);
    assert_eq!(rec.node, new.node);
    assert_eq!(rec.network_profile, new.network_profile);
    assert_eq!(rec.expires_at, new.expires_at);
    assert!(!rec.tainted);
    assert_eq!((&rec.metadata, &rec.env), (&new.metadata, &new.env));
    assert_eq!((&rec.workdir, &rec.run_as), (&new.workdir, &new.run_as));
    assert!(rec.created_at >= before, "created_at is now");
    assert_eq!(rec.last_active_at, rec.created_at);
    assert_eq!(r.get_sandbox(&new.id).await.unwrap(), rec, "get = insert");

    let events = events_of(r, &new.id).await;
    assert_eq!(events.len(), 1, "one created event");
    assert_eq!(events[0].event_type, "created");
    assert_eq!(events[0].tenant, t);
    assert_eq!(events[0].old_state, None);
    assert_eq!(events[0].new_state, Some(SandboxState::Requested));
    assert_eq!(events[0].request_id.as_deref(), Some("req-1"));

    let e = r
        .insert_sandbox(&new, TransitionCtx::default())
        .await
        .unwrap_err();
    assert_eq!(e, RegistryError::Duplicate, "same id twice");
    assert_eq!(events_of(r, &new.id).await.len(), 1, "no event on failure");

    let e = r.get_sandbox(&SandboxId::generate()).await.unwrap_err();
    assert_eq!(e, RegistryError::NotFound);

    let api = rec.to_api(Some("owner".into()));
    assert_eq!(api.id, rec.id);
    assert_eq!(api.lease_owner.as_deref(), Some("owner"));
}

pub async fn list_filters_tenant_and_terminated<R: Registry>(r: &R) {
    let (t1, t2) = (tenant(), tenant());
    let a = insert(r, &t1).await;
    let b = insert(r, &t1).await;
    let c = insert(r, &t2).await;
    r.transition(
        &b.id,
        0,
        &[SandboxState::Terminated],
        FenceCheck::Skip,
        TransitionCtx::default(),
    )
    .await
    .unwrap();

    let ids = |v: Vec<SandboxRecord>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();
    let live = ids(r.list_sandboxes(Some(&t1), false).await.unwrap());
    assert_eq!(live, vec![a.id.clone()], "terminated hidden");
    let all = ids(r.list_sandboxes(Some(&t1), true).await.unwrap());
    assert_eq!(all, vec![a.id.clone(), b.id.clone()], "oldest first");
    let everyone = ids(r.list_sandboxes(None, true).await.unwrap());
    for id in [&a.id, &b.id, &c.id] {
        assert!(everyone.contains(id), "unfiltered list has {id}");
    }
    assert!(r
        .list_sandboxes(Some(&tenant()), true)
        .await
        .unwrap()
        .is_empty());
}

/// `live_totals` agrees with summing `list_sandboxes` by hand: per node and
/// state, terminated rows left out, one tenant or all.
pub async fn live_totals_sum_the_live_rows<R: Registry>(r: &R) {
    let (t1, t2) = (tenant(), tenant());
    let mut on_other = sample_sandbox(&t1);
    on_other.node = "node-b".into();
    on_other.resources.cpu = 0.25;
    on_other.resources.memory_mb = 300;
    r.insert_sandbox(&on_other, TransitionCtx::default())
        .await
        .unwrap();
    let a = insert(r, &t1).await;
    insert(r, &t1).await;
    let gone = insert(r, &t1).await;
    insert(r, &t2).await;
    r.transition(
        &a.id,
        0,
        &[SandboxState::Planning],
        FenceCheck::Skip,
        TransitionCtx::default(),
    )
    .await
    .unwrap();
    r.transition(
        &gone.id,
        0,
        &[SandboxState::Terminated],
        FenceCheck::Skip,
        TransitionCtx::default(),
    )
    .await
    .unwrap();
    let mut totals = r.live_totals(Some(&t1)).await.unwrap();
    totals.sort_by(|x, y| (&x.node, x.state.as_str()).cmp(&(&y.node, y.state.as_str())));
    let row = |node: &str, state, sandboxes, cpu, memory_mb| LiveTotal {
        node: node.into(),
        state,
        sandboxes,
        cpu,
        memory_mb,
    };
    assert_eq!(
        totals,
        vec![
            row("local", SandboxState::Planning, 1, 1.5, 2048),
            row("local", SandboxState::Requested, 1, 1.5, 2048),
            row("node-b", SandboxState::Requested, 1, 0.25, 300),
        ],
        "one tenant, by node and state, the terminated one left out"
    );
    // every tenant's: the same as summing the live listing
    let mut all = r.live_totals(None).await.unwrap();
    let mut by_hand = LiveTotal::sum(&r.list_sandboxes(None, false).await.unwrap());
    for v in [&mut all, &mut by_hand] {
        v.sort_by(|x, y| (&x.node, x.state.as_str()).cmp(&(&y.node, y.state.as_str())));
    }
    assert_eq!(all, by_hand);
    assert!(r.live_totals(Some(&tenant())).await.unwrap().is_empty());
}

pub async fn transition_walks_a_path<R: Registry>(r: &R) {
    use SandboxState::*;
    let s = insert(r, &tenant()).await;
    let ctx = TransitionCtx {
        request_id: Some("req-2".into()),
        event_type: None,
        metadata: serde_json::json!({"why": "create"}),
    };
    let path = [Planning, Allocating, Provisioning, Locking];
    let rec = r
        .transition(&s.id, 0, &path, FenceCheck::Skip, ctx)
        .await
        .unwrap();
    assert_eq!(rec.state, Locking);
    assert_eq!(rec.version, 4, "one bump per step");
    assert!(rec.last_active_at >= s.last_active_at);
    assert_eq!(r.get_sandbox(&s.id).await.unwrap(), rec);

    let events = events_of(r, &s.id).await;
    assert_eq!(events.len(), 5, "created + one per step");
    let mut from = Requested;
    for (ev, &to) in events[1..].iter().zip(&path) {
        assert_eq!(ev.event_type, "state_changed");
        assert_eq!(ev.old_state, Some(from));
        assert_eq!(ev.new_state, Some(to));
        assert_eq!(ev.request_id.as_deref(), Some("req-2"));
        assert_eq!(ev.metadata, serde_json::json!({"why": "create"}));
        assert_eq!(ev.sandbox_id.as_ref(), Some(&s.id));
        from = to;
    }
    assert!(events.windows(2).all(|w| w[0].id < w[1].id), "ids increase");

    let ctx = TransitionCtx {
        event_type: Some("lease_granted".into()),
        ..TransitionCtx::default()
    };
    let rec = r
        .transition(&s.id, 4, &[Leased], FenceCheck::Skip, ctx)
        .await
        .unwrap();
    assert_eq!((rec.state, rec.version), (Leased, 5));
    let last = events_of(r, &s.id).await.pop().unwrap();
    assert_eq!(last.event_type, "lease_granted");
    assert_eq!(
        last.metadata,
        serde_json::json!({}),
        "null metadata is {{}}"
    );

    // an empty path only checks
    let same = r
        .transition(&s.id, 5, &[], FenceCheck::Skip, TransitionCtx::default())
        .await
        .unwrap();
    assert_eq!(same.version, 5);
    assert_eq!(events_of(r, &s.id).await.len(), 6);

    let e = r
        .transition(
            &SandboxId::generate(),
            0,
            &[Planning],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(e, RegistryError::NotFound);
}

pub async fn transition_refuses_stale_version<R: Registry>(r: &R) {
    let s = insert(r, &tenant()).await;
    for wrong in [-1, 1, 7] {
        let e = r
            .transition(
                &s.id,
                wrong,
                &[SandboxState::Planning],
                FenceCheck::Skip,
                TransitionCtx::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(e, RegistryError::Conflict, "expected version {wrong}");
    }
    assert_eq!(r.get_sandbox(&s.id).await.unwrap(), s, "unchanged");
    assert_eq!(events_of(r, &s.id).await.len(), 1, "no event on conflict");
}

pub async fn transition_refuses_illegal_steps<R: Registry>(r: &R) {
    use SandboxState::*;
    let s = insert(r, &tenant()).await;
    // the third step is illegal: nothing of the path may stick
    let e = r
        .transition(
            &s.id,
            0,
            &[Planning, Allocating, Running],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        e,
        RegistryError::IllegalTransition(StateError::IllegalTransition {
            from: Allocating,
            to: Running
        })
    );
    assert_eq!(r.get_sandbox(&s.id).await.unwrap(), s, "unchanged");
    assert_eq!(events_of(r, &s.id).await.len(), 1, "no event");

    let t = r
        .transition(
            &s.id,
            0,
            &[Terminated],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap();
    for to in SandboxState::ALL {
        let e = r
            .transition(
                &s.id,
                t.version,
                &[to],
                FenceCheck::Skip,
                TransitionCtx::default(),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(e, RegistryError::IllegalTransition(_)),
            "Terminated -> {to} gave {e:?}"
        );
    }
}

pub async fn transition_checks_the_fence<R: Registry + LeaseStore>(r: &R) {
    use SandboxState::*;
    let s = insert(r, &tenant()).await;
    let mut rec = r
        .transition(
            &s.id,
            0,
            &[Planning, Allocating, Locking, Idle],
            FenceCheck::Require(None),
            TransitionCtx::default(),
        )
        .await
        .unwrap();
    let e = r
        .transition(
            &s.id,
            rec.version,
            &[Leased],
            FenceCheck::Require(Some(LeaseToken::generate(1))),
            TransitionCtx::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(e, RegistryError::StaleToken, "token on an unleased sandbox");

    let now = aviary_core::now();
    let lease = r
        .acquire(&s.id, "agent-1", Duration::from_secs(300), now)
        .await
        .unwrap();
    let e = r
        .transition(
            &s.id,
            rec.version,
            &[Leased],
            FenceCheck::Require(None),
            TransitionCtx::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(e, RegistryError::LeaseRequired);
    let stale = LeaseToken::generate(lease.token.fence() + 1);
    let e = r
        .transition(
            &s.id,
            rec.version,
            &[Leased],
            FenceCheck::Require(Some(stale)),
            TransitionCtx::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(e, RegistryError::StaleToken);
    assert_eq!(
        r.get_sandbox(&s.id).await.unwrap(),
        rec,
        "fenced out: unchanged"
    );

    rec = r
        .transition(
            &s.id,
            rec.version,
            &[Leased, Running],
            FenceCheck::Require(Some(lease.token)),
            TransitionCtx::default(),
        )
        .await
        .unwrap();
    assert_eq!(rec.state, Running);
    // the system bypasses the fence
    rec = r
        .transition(
            &s.id,
            rec.version,
            &[Idle],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap();

    r.release(&s.id, lease.token, aviary_core::now())
        .await
        .unwrap();
    let e = r
        .transition(
            &s.id,
            rec.version,
            &[Sanitizing],
            FenceCheck::Require(Some(lease.token)),
            TransitionCtx::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(e, RegistryError::StaleToken, "token of a released lease");
    r.transition(
        &s.id,
        rec.version,
        &[Sanitizing],
        FenceCheck::Require(None),
        TransitionCtx::default(),
    )
    .await
    .unwrap();
}

/// [`FenceCheck::Counter`]: the write-time check against the durable
/// fencing counter that a networked lease store's grants bump through
/// [`aviary_leases::FenceAuthority`], and that this registry's own lease
/// grants share.
pub async fn transition_checks_the_counter<
    R: Registry + LeaseStore + aviary_leases::FenceAuthority,
>(
    r: &R,
) {
    use SandboxState::*;
    let s = insert(r, &tenant()).await;
    let ghost = SandboxId::generate();
    assert_eq!(
        r.next_fence(&ghost).await.unwrap_err(),
        LeaseError::NotFound
    );
    assert_eq!(
        r.current_fence(&ghost).await.unwrap_err(),
        LeaseError::NotFound
    );
    let mut rec = r
        .transition(
            &s.id,
            0,
            &[Planning, Allocating, Locking, Idle],
            FenceCheck::Counter {
                seen: 0,
                leased: false,
            },
            TransitionCtx::default(),
        )
        .await
        .expect("unleased write at the current counter");
    assert_eq!(r.current_fence(&s.id).await.unwrap(), 0);

    // a grant by this registry's own lease table moves the same counter
    let lease = r
        .acquire(
            &s.id,
            "agent-1",
            Duration::from_secs(300),
            aviary_core::now(),
        )
        .await
        .unwrap();
    assert_eq!(r.current_fence(&s.id).await.unwrap(), lease.token.fence());
    let e = r
        .transition(
            &s.id,
            rec.version,
            &[Leased],
            FenceCheck::Counter {
                seen: 0,
                leased: false,
            },
            TransitionCtx::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        e,
        RegistryError::LeaseRequired,
        "unleased write after a grant"
    );
    rec = r
        .transition(
            &s.id,
            rec.version,
            &[Leased],
            FenceCheck::Counter {
                seen: lease.token.fence(),
                leased: true,
            },
            TransitionCtx::default(),
        )
        .await
        .expect("the holder's write");

    // a grant elsewhere (a networked lease store) fences the holder out
    let newer = r.next_fence(&s.id).await.unwrap();
    assert_eq!(newer, lease.token.fence() + 1, "next_fence is counter + 1");
    for seen in [lease.token.fence(), newer + 1] {
        let e = r
            .transition(
                &s.id,
                rec.version,
                &[Running],
                FenceCheck::Counter { seen, leased: true },
                TransitionCtx::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(
            e,
            RegistryError::StaleToken,
            "fence {seen} against counter {newer}"
        );
    }
    assert_eq!(
        r.get_sandbox(&s.id).await.unwrap(),
        rec,
        "fenced out: unchanged"
    );
    r.transition(
        &s.id,
        rec.version,
        &[Running],
        FenceCheck::Counter {
            seen: newer,
            leased: true,
        },
        TransitionCtx::default(),
    )
    .await
    .expect("the newest holder's write");

    // and the lease table's next grant is above both
    r.revoke(&s.id).await.unwrap();
    let again = r
        .acquire(
            &s.id,
            "agent-2",
            Duration::from_secs(300),
            aviary_core::now(),
        )
        .await
        .unwrap();
    assert!(again.token.fence() > newer, "grants never reuse a fence");
}

pub async fn field_updates_bump_version<R: Registry>(r: &R) {
    let s = insert(r, &tenant()).await;
    let rec = r
        .set_runtime_instance(&s.id, 0, "ctr-123", "node-7")
        .await
        .unwrap();
    assert_eq!(rec.runtime_instance_id.as_deref(), Some("ctr-123"));
    assert_eq!(rec.node, "node-7");
    assert_eq!(rec.version, 1);
    let e = r
        .set_runtime_instance(&s.id, 0, "ctr-999", "node-8")
        .await
        .unwrap_err();
    assert_eq!(e, RegistryError::Conflict);
    let rec = r.set_tainted(&s.id, 1, true).await.unwrap();
    assert!(rec.tainted);
    assert_eq!(rec.version, 2);
    assert_eq!(
        r.set_tainted(&s.id, 1, false).await.unwrap_err(),
        RegistryError::Conflict
    );
    assert_eq!(r.get_sandbox(&s.id).await.unwrap(), rec);
    let ghost = SandboxId::generate();
    assert_eq!(
        r.set_runtime_instance(&ghost, 0, "x", "y")
            .await
            .unwrap_err(),
        RegistryError::NotFound
    );
    assert_eq!(
        r.set_tainted(&ghost, 0, true).await.unwrap_err(),
        RegistryError::NotFound
    );
    // paused: stored, version-checked, read back, and cleared
    assert!(!rec.paused, "a new sandbox is not paused");
    let paused = r.set_paused(&s.id, 2, true).await.unwrap();
    assert!(paused.paused);
    assert_eq!(paused.version, 3);
    assert_eq!(
        r.set_paused(&s.id, 2, false).await.unwrap_err(),
        RegistryError::Conflict
    );
    assert!(r.get_sandbox(&s.id).await.unwrap().paused);
    assert!(!r.set_paused(&s.id, 3, false).await.unwrap().paused);
    assert_eq!(
        r.set_paused(&ghost, 0, true).await.unwrap_err(),
        RegistryError::NotFound
    );
    // expiry: set, version-checked, cleared
    let at = datetime!(2032-02-03 4:05:06.789 UTC);
    let later = r.set_expiry(&s.id, 4, Some(at)).await.unwrap();
    assert_eq!((later.expires_at, later.version), (Some(at), 5));
    assert_eq!(
        r.set_expiry(&s.id, 4, None).await.unwrap_err(),
        RegistryError::Conflict
    );
    assert_eq!(r.get_sandbox(&s.id).await.unwrap().expires_at, Some(at));
    assert_eq!(r.set_expiry(&s.id, 5, None).await.unwrap().expires_at, None);
    assert_eq!(
        r.set_expiry(&ghost, 0, None).await.unwrap_err(),
        RegistryError::NotFound
    );
}

/// The first candidate stored under a name is what every later call gets.
pub async fn server_secrets_are_written_once<R: Registry>(r: &R) {
    let name = new_id("secret");
    let first = r.server_secret(&name, "one").await.unwrap();
    assert_eq!(first, "one");
    assert_eq!(r.server_secret(&name, "two").await.unwrap(), "one");
    let other = new_id("secret");
    assert_eq!(r.server_secret(&other, "two").await.unwrap(), "two");
}

pub async fn touch_keeps_version<R: Registry>(r: &R) {
    let s = insert(r, &tenant()).await;
    let later = datetime!(2032-06-01 12:00 UTC);
    r.touch(&s.id, later).await.unwrap();
    let rec = r.get_sandbox(&s.id).await.unwrap();
    assert_eq!(rec.last_active_at, later);
    assert_eq!(rec.version, 0, "touch is not a version bump");
    assert_eq!(events_of(r, &s.id).await.len(), 1, "touch writes no event");
    let e = r.touch(&SandboxId::generate(), later).await.unwrap_err();
    assert_eq!(e, RegistryError::NotFound);
}

pub async fn events_filter_and_page<R: Registry>(r: &R) {
    let (t1, t2) = (tenant(), tenant());
    let s = insert(r, &t1).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let id = r
            .append_event(NewEvent {
                sandbox_id: if i % 2 == 0 { Some(s.id.clone()) } else { None },
                tenant: t1.clone(),
                event_type: format!("custom_{i}"),
                old_state: None,
                new_state: None,
                request_id: Some(format!("req-{i}")),
                metadata: serde_json::json!({"i": i, "nested": {"ok": true}}),
            })
            .await
            .unwrap();
        ids.push(id);
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "append ids increase");
    r.append_event(NewEvent {
        sandbox_id: None,
        tenant: t2.clone(),
        event_type: "other_tenant".into(),
        old_state: Some(SandboxState::Idle),
        new_state: Some(SandboxState::Lost),
        request_id: None,
        metadata: serde_json::Value::Null,
    })
    .await
    .unwrap();

    let by_tenant = |after_id, limit| EventFilter {
        tenant: Some(t1.clone()),
        sandbox_id: None,
        after_id,
        limit,
        newest: false,
    };
    let all = r.list_events(&by_tenant(None, 0)).await.unwrap();
    assert_eq!(all.len(), 6, "created + 5 appended, other tenant excluded");
    assert_eq!(all[0].event_type, "created");
    let custom = &all[1..];
    for (i, ev) in custom.iter().enumerate() {
        assert_eq!(ev.id, ids[i]);
        assert_eq!(ev.event_type, format!("custom_{i}"));
        assert_eq!(
            ev.metadata,
            serde_json::json!({"i": i, "nested": {"ok": true}})
        );
        assert_eq!(ev.request_id, Some(format!("req-{i}")));
    }
    let page = r.list_events(&by_tenant(Some(ids[1]), 2)).await.unwrap();
    let page_ids: Vec<i64> = page.iter().map(|e| e.id).collect();
    assert_eq!(page_ids, vec![ids[2], ids[3]], "after_id + limit");
    // the newest ones, still oldest first (and after_id still applies)
    let last_two = r
        .list_events(&EventFilter {
            newest: true,
            ..by_tenant(None, 2)
        })
        .await
        .unwrap();
    let last_ids: Vec<i64> = last_two.iter().map(|e| e.id).collect();
    assert_eq!(last_ids, vec![ids[3], ids[4]], "newest + limit");
    let tail = r
        .list_events(&EventFilter {
            newest: true,
            ..by_tenant(Some(ids[2]), 10)
        })
        .await
        .unwrap();
    let tail_ids: Vec<i64> = tail.iter().map(|e| e.id).collect();
    assert_eq!(tail_ids, vec![ids[3], ids[4]], "newest after an id");

    let mine = events_of(r, &s.id).await;
    assert_eq!(mine.len(), 4, "created + 3 with this sandbox");
    let other = r
        .list_events(&EventFilter {
            tenant: Some(t2.clone()),
            ..EventFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(other.len(), 1);
    assert_eq!(other[0].old_state, Some(SandboxState::Idle));
    assert_eq!(other[0].new_state, Some(SandboxState::Lost));
    assert_eq!(other[0].sandbox_id, None);
    let newest = r
        .list_events(&EventFilter {
            after_id: Some(other[0].id),
            tenant: Some(t2),
            ..EventFilter::default()
        })
        .await
        .unwrap();
    assert!(newest.is_empty(), "nothing after the newest");
}

pub async fn templates_upsert<R: Registry>(r: &R) {
    let name = new_id("tpl");
    let mut t = TemplateRecord {
        name: name.clone(),
        digest: "sha256:aa".into(),
        size_bytes: 123_456_789_012,
        source: "debootstrap".into(),
        created_at: datetime!(2030-02-03 4:05:06 UTC),
        defaults: Default::default(),
    };
    r.upsert_template(&t).await.unwrap();
    t.digest = "sha256:bb".into();
    t.source = "oci-archive:x.tar".into();
    r.upsert_template(&t).await.unwrap();
    let mine: Vec<_> = r
        .list_templates()
        .await
        .unwrap()
        .into_iter()
        .filter(|x| x.name == name)
        .collect();
    assert_eq!(mine, vec![t], "upsert replaces");
}

pub async fn nodes_upsert<R: Registry>(r: &R) {
    let id = new_id("node");
    let mut n = NodeRecord {
        id: id.clone(),
        address: "127.0.0.1:7401".into(),
        runtimes: vec!["crun".into(), "runc".into()],
        cpu: 2.0,
        memory_mb: 3900,
        healthy: true,
        last_seen: datetime!(2030-02-03 4:05:06 UTC),
    };
    r.upsert_node(&n).await.unwrap();
    n.healthy = false;
    n.runtimes = vec![];
    n.last_seen = datetime!(2030-02-03 4:06:00 UTC);
    r.upsert_node(&n).await.unwrap();
    let mine: Vec<_> = r
        .list_nodes()
        .await
        .unwrap()
        .into_iter()
        .filter(|x| x.id == id)
        .collect();
    assert_eq!(mine, vec![n], "upsert replaces");
}

pub async fn api_keys_map_to_tenants<R: Registry>(r: &R) {
    let t = tenant();
    let hash = new_id("hash");
    r.insert_api_key(&hash, &t, false).await.unwrap();
    let admin_hash = new_id("hash");
    r.insert_api_key(&admin_hash, &t, true).await.unwrap();
    let k = r.find_api_key(&hash).await.unwrap().unwrap();
    assert_eq!(
        (k.key_hash.as_str(), k.tenant.as_str(), k.admin),
        (hash.as_str(), t.as_str(), false)
    );
    assert!(r.find_api_key(&admin_hash).await.unwrap().unwrap().admin);
    assert_eq!(r.find_api_key("no-such-hash").await.unwrap(), None);
    assert_eq!(
        r.insert_api_key(&hash, &tenant(), true).await.unwrap_err(),
        RegistryError::Duplicate
    );
    assert!(!format!("{k:?}").contains(&hash), "Debug redacts the hash");
}

pub async fn api_keys_list_and_revoke<R: Registry>(r: &R) {
    let t = tenant();
    let (h1, h2) = (new_id("hash"), new_id("hash"));
    r.insert_api_key(&h1, &t, false).await.unwrap();
    r.insert_api_key(&h2, &t, true).await.unwrap();
    let mine = |all: Vec<ApiKeyRecord>| -> Vec<ApiKeyRecord> {
        all.into_iter().filter(|k| k.tenant == t).collect()
    };
    let listed = mine(r.list_api_keys().await.unwrap());
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert_eq!(
        listed
            .iter()
            .map(|k| k.key_hash.as_str())
            .collect::<Vec<_>>(),
        vec![h1.as_str(), h2.as_str()],
        "oldest first"
    );
    assert!(listed.iter().all(|k| k.revoked_at.is_none()));
    assert_ne!(listed[0].id, listed[1].id, "ids are unique");
    assert!(!listed[0].id.contains(&h1), "the id is not the hash");
    let k1 = r.find_api_key(&h1).await.unwrap().unwrap();
    assert_eq!(k1, listed[0], "find and list agree");

    let at = time::macros::datetime!(2031-02-03 4:05:06 UTC);
    let revoked = r.revoke_api_key(&k1.id, at).await.unwrap();
    assert_eq!(revoked.revoked_at, Some(at));
    assert_eq!(revoked.id, k1.id);
    assert_eq!(
        r.find_api_key(&h1).await.unwrap(),
        None,
        "a revoked key is not found"
    );
    assert!(r.find_api_key(&h2).await.unwrap().is_some(), "others stay");
    // revoking again keeps the first time
    let later = at + time::Duration::hours(1);
    assert_eq!(
        r.revoke_api_key(&k1.id, later).await.unwrap().revoked_at,
        Some(at)
    );
    let listed = mine(r.list_api_keys().await.unwrap());
    assert_eq!(listed[0].revoked_at, Some(at), "listing shows revoked keys");
    assert_eq!(listed[1].revoked_at, None);
    assert_eq!(
        r.revoke_api_key("key-no-such", at).await.unwrap_err(),
        RegistryError::NotFound
    );
    // a revoked hash cannot be registered again
    assert_eq!(
        r.insert_api_key(&h1, &t, false).await.unwrap_err(),
        RegistryError::Duplicate
    );
}

pub async fn allocations_record_usage<R: Registry>(r: &R) {
    let t = tenant();
    let s = insert(r, &t).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let a = AllocationRecord {
            id: None,
            task_id: format!("task-{i}"),
            tenant: t.clone(),
            sandbox_id: (i == 0).then(|| s.id.clone()),
            planner_input_hash: format!("hash-{i}"),
            workload_signature: "python+pip".into(),
            recommended_class: "python-medium".into(),
            actual_class: "python-small".into(),
            reason: "quota clamp".into(),
            confidence: 0.75,
            source: "heuristic".into(),
            cpu: 1.0,
            memory_mb: 2048,
            created_at: datetime!(2030-01-01 0:00 UTC) + time::Duration::seconds(i),
            usage: Some(AllocationUsage {
                duration_s: 99.0,
                peak_cpu: 9.0,
                peak_memory_mb: 9,
                oom: true,
                timed_out: true,
            }),
        };
        ids.push(r.insert_allocation(&a).await.unwrap());
    }
    let listed = r.list_allocations(Some(&t), 0).await.unwrap();
    assert_eq!(listed.len(), 3);
    assert_eq!(listed[0].id, Some(ids[2]), "newest first");
    assert_eq!(listed[2].sandbox_id.as_ref(), Some(&s.id));
    assert!(
        listed.iter().all(|a| a.usage.is_none()),
        "usage ignored on insert"
    );
    assert_eq!(listed[1].reason, "quota clamp");
    assert_eq!(listed[1].confidence, 0.75);

    let usage = AllocationUsage {
        duration_s: 12.5,
        peak_cpu: 0.8,
        peak_memory_mb: 1500,
        oom: false,
        timed_out: true,
    };
    r.update_allocation_usage(ids[0], &usage).await.unwrap();
    let listed = r.list_allocations(Some(&t), 2).await.unwrap();
    assert_eq!(listed.len(), 2, "limit");
    let all = r.list_allocations(Some(&t), 10).await.unwrap();
    assert_eq!(all[2].usage.as_ref(), Some(&usage));
    assert_eq!(
        r.update_allocation_usage(i64::MAX, &usage)
            .await
            .unwrap_err(),
        RegistryError::NotFound
    );
    assert!(r.list_allocations(None, 1).await.unwrap().len() == 1);
}

pub async fn environments_upsert<R: Registry>(r: &R) {
    let s = insert(r, &tenant()).await;
    assert_eq!(r.get_environment(&s.id).await.unwrap(), None);
    let mut e = EnvironmentRecord {
        sandbox_id: s.id.clone(),
        base_image_digest: "sha256:base".into(),
        dependency_hash: "deps-1".into(),
        workspace_id: Some("ws-1".into()),
        snapshot_id: None,
        environment_version: 1,
        dirty_level: 0,
        manifest: serde_json::json!({}),
    };
    r.upsert_environment(&e).await.unwrap();
    assert_eq!(r.get_environment(&s.id).await.unwrap(), Some(e.clone()));
    e.dependency_hash = "deps-2".into();
    e.snapshot_id = Some("snap-1".into());
    e.environment_version = 2;
    e.dirty_level = 2;
    r.upsert_environment(&e).await.unwrap();
    assert_eq!(r.get_environment(&s.id).await.unwrap(), Some(e.clone()));
    e.sandbox_id = SandboxId::generate();
    assert_eq!(
        r.upsert_environment(&e).await.unwrap_err(),
        RegistryError::NotFound
    );
}

fn sample_snapshot(
    tenant: &str,
    sandbox: &SandboxId,
    label: &str,
    at: OffsetDateTime,
) -> SnapshotRecord {
    SnapshotRecord {
        id: new_id("snap"),
        tenant: tenant.to_owned(),
        sandbox_id: sandbox.clone(),
        parent: None,
        workspace_manifest: new_id("snap"),
        upper_manifest: new_id("snap"),
        template: "debian-12".into(),
        template_digest: "sha256:0123abcd".into(),
        resource_class: "python-small".into(),
        label: label.to_owned(),
        total_bytes: 5_000_000_000,
        new_bytes: 1234,
        created_at: at,
        manifest: (label == "clean").then(|| {
            serde_json::json!({"base_template_digest": "sha256:0123abcd", "dirty_level": 1,
                               "pip": {"leftpad": "1.0"}})
        }),
    }
}

/// The projection index survives the process (it is what keeps a restart
/// from re-uploading unchanged projected files): stored, replaced, read
/// back exactly, per sandbox, dropped on request; a missing sandbox is
/// `NotFound`.
pub async fn projection_index_round_trips<R: Registry>(r: &R) {
    let t = tenant();
    let a = r
        .insert_sandbox(&sample_sandbox(&t), TransitionCtx::default())
        .await
        .unwrap();
    let b = r
        .insert_sandbox(&sample_sandbox(&t), TransitionCtx::default())
        .await
        .unwrap();
    assert_eq!(r.get_projection_index(&a.id).await.unwrap(), None);
    let mut files = std::collections::BTreeMap::new();
    files.insert("/workspace/AGENTS.md".to_owned(), "ab".repeat(32));
    files.insert("/workspace/skills/ünï code.md".to_owned(), "cd".repeat(32));
    r.put_projection_index(&a.id, &files).await.unwrap();
    assert_eq!(
        r.get_projection_index(&a.id).await.unwrap().as_ref(),
        Some(&files)
    );
    assert_eq!(r.get_projection_index(&b.id).await.unwrap(), None);
    // replaced whole, never merged
    let mut next = std::collections::BTreeMap::new();
    next.insert("/workspace/AGENTS.md".to_owned(), "ef".repeat(32));
    r.put_projection_index(&a.id, &next).await.unwrap();
    assert_eq!(
        r.get_projection_index(&a.id).await.unwrap().as_ref(),
        Some(&next)
    );
    r.put_projection_index(&b.id, &files).await.unwrap();
    r.delete_projection_index(&a.id).await.unwrap();
    assert_eq!(r.get_projection_index(&a.id).await.unwrap(), None);
    assert_eq!(
        r.get_projection_index(&b.id).await.unwrap().as_ref(),
        Some(&files)
    );
    r.delete_projection_index(&a.id).await.unwrap();
    let ghost = SandboxId::generate();
    assert_eq!(
        r.put_projection_index(&ghost, &files).await.unwrap_err(),
        RegistryError::NotFound
    );
}

pub async fn snapshots_index<R: Registry>(r: &R) {
    let (t, other) = (tenant(), tenant());
    let (a, b) = (SandboxId::generate(), SandboxId::generate());
    assert_eq!(r.latest_snapshot(&t, &a).await.unwrap(), None);
    let first = sample_snapshot(&t, &a, "checkpoint", datetime!(2030-02-03 4:05:06 UTC));
    assert_eq!(
        r.insert_snapshot(&first).await.unwrap(),
        first,
        "insert returns the row"
    );
    let mut second = sample_snapshot(&t, &a, "clean", datetime!(2030-02-03 4:05:07 UTC));
    second.parent = Some(first.id.clone());
    // inserted out of order: lists go by time, not by insertion
    let mut zeroth = sample_snapshot(&t, &a, "checkpoint", datetime!(2030-02-03 4:05:05 UTC));
    zeroth.total_bytes = 0;
    let of_b = sample_snapshot(&t, &b, "clean", datetime!(2030-02-03 4:05:08 UTC));
    let others = sample_snapshot(&other, &a, "clean", datetime!(2030-02-03 4:05:09 UTC));
    for s in [&second, &zeroth, &of_b, &others] {
        r.insert_snapshot(s).await.unwrap();
    }
    assert_eq!(r.get_snapshot(&second.id).await.unwrap(), second);
    assert_eq!(
        r.get_snapshot(&new_id("snap")).await.unwrap_err(),
        RegistryError::NotFound
    );
    assert_eq!(
        r.insert_snapshot(&first).await.unwrap_err(),
        RegistryError::Duplicate,
        "same id twice"
    );
    let ids = |v: Vec<SnapshotRecord>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();
    let list =
        |tenant: Option<&str>, sandbox: Option<&SandboxId>, label: Option<&str>| SnapshotFilter {
            tenant: tenant.map(str::to_owned),
            sandbox_id: sandbox.cloned(),
            label: label.map(str::to_owned),
        };
    assert_eq!(
        ids(r.list_snapshots(&list(Some(&t), None, None)).await.unwrap()),
        vec![
            zeroth.id.clone(),
            first.id.clone(),
            second.id.clone(),
            of_b.id.clone()
        ],
        "a tenant's snapshots, oldest first"
    );
    assert_eq!(
        ids(r
            .list_snapshots(&list(Some(&t), Some(&a), None))
            .await
            .unwrap()),
        vec![zeroth.id.clone(), first.id.clone(), second.id.clone()],
        "one sandbox's"
    );
    assert_eq!(
        ids(r
            .list_snapshots(&list(Some(&t), None, Some("clean")))
            .await
            .unwrap()),
        vec![second.id.clone(), of_b.id.clone()],
        "by label"
    );
    let everyone = ids(r.list_snapshots(&SnapshotFilter::default()).await.unwrap());
    assert!(everyone.contains(&others.id) && everyone.contains(&first.id));
    assert_eq!(
        r.latest_snapshot(&t, &a).await.unwrap(),
        Some(second.clone()),
        "latest of the sandbox, within the tenant"
    );
    assert_eq!(
        r.latest_snapshot(&other, &a).await.unwrap(),
        Some(others.clone())
    );
    assert_eq!(r.latest_snapshot(&other, &b).await.unwrap(), None);

    r.delete_snapshot(&second.id).await.unwrap();
    assert_eq!(
        r.delete_snapshot(&second.id).await.unwrap_err(),
        RegistryError::NotFound
    );
    assert_eq!(
        r.latest_snapshot(&t, &a).await.unwrap(),
        Some(first.clone())
    );
    // equal times: the later insert is the latest
    let tie = sample_snapshot(&t, &a, "checkpoint", first.created_at);
    r.insert_snapshot(&tie).await.unwrap();
    assert_eq!(r.latest_snapshot(&t, &a).await.unwrap(), Some(tie.clone()));
    // sub-second times keep their order (backends keep at least microseconds)
    let fine = sample_snapshot(
        &t,
        &a,
        "checkpoint",
        first.created_at + time::Duration::microseconds(1),
    );
    r.insert_snapshot(&fine).await.unwrap();
    assert_eq!(r.latest_snapshot(&t, &a).await.unwrap(), Some(fine));
}

pub async fn pool_bounds_upsert<R: Registry>(r: &R) {
    let class = new_id("class");
    let mut b = PoolBoundsRecord {
        class: class.clone(),
        pool_min: 4,
        pool_max: 8,
        updated_at: datetime!(2030-02-03 4:05:06 UTC),
    };
    r.set_pool_bounds(&b).await.unwrap();
    b.pool_min = 0;
    b.pool_max = 10_000;
    b.updated_at = datetime!(2030-02-03 4:06:00 UTC);
    r.set_pool_bounds(&b).await.unwrap();
    let mine: Vec<_> = r
        .list_pool_bounds()
        .await
        .unwrap()
        .into_iter()
        .filter(|x| x.class == class)
        .collect();
    assert_eq!(mine, vec![b], "set replaces");
}

/// A warm pooled sandbox: no tenant, `Ready`.
async fn warm_sandbox<R: Registry>(r: &R) -> SandboxRecord {
    use SandboxState::*;
    let mut new = sample_sandbox(POOL_TENANT);
    (new.user_id, new.session_id, new.agent) = (None, None, None);
    let s = r
        .insert_sandbox(&new, TransitionCtx::default())
        .await
        .unwrap();
    r.transition(
        &s.id,
        0,
        &[Planning, Allocating, Provisioning, Ready],
        FenceCheck::Skip,
        TransitionCtx::default(),
    )
    .await
    .unwrap()
}

pub async fn pool_handouts_follow_claims<R: Registry>(r: &R) {
    use SandboxState::*;
    let (claimed, unclaimed) = (warm_sandbox(r).await, warm_sandbox(r).await);
    let cold = insert(r, &tenant()).await;
    let handouts = || async {
        r.list_pool_handouts()
            .await
            .unwrap()
            .into_iter()
            .map(|s| s.id)
            .filter(|id| [&claimed.id, &unclaimed.id, &cold.id].contains(&id))
            .collect::<Vec<_>>()
    };
    assert!(handouts().await.is_empty(), "nothing handed out yet");
    let t = tenant();
    let claim = SandboxClaim {
        tenant: t.clone(),
        user_id: Some("user-1".into()),
        session_id: None,
        agent: None,
        scope: Scope::Session,
        expires_at: Some(datetime!(2031-01-01 0:00 UTC)),
        user_managed: true,
        metadata: [("owner".to_owned(), "claimer".to_owned())].into(),
        env: [("CLAIMED".to_owned(), "1".to_owned())].into(),
        run_as: Some("app".into()),
        workdir: Some("/srv".into()),
    };
    let rec = r
        .claim_sandbox(
            &claimed.id,
            claimed.version,
            &claim,
            TransitionCtx::default(),
        )
        .await
        .unwrap();
    assert_eq!((rec.state, rec.tenant.as_str()), (Locking, t.as_str()));
    assert_eq!(rec.version, claimed.version + 1);
    assert!(rec.user_managed, "the claim's user_managed is recorded");
    assert_eq!((&rec.metadata, &rec.env), (&claim.metadata, &claim.env));
    assert_eq!((&rec.workdir, &rec.run_as), (&claim.workdir, &claim.run_as));
    assert_eq!(r.get_sandbox(&claimed.id).await.unwrap(), rec);
    assert_eq!(
        r.claim_sandbox(&claimed.id, rec.version, &claim, TransitionCtx::default())
            .await
            .unwrap_err(),
        RegistryError::Conflict,
        "a pooled sandbox is handed out once"
    );
    assert_eq!(
        r.claim_sandbox(
            &unclaimed.id,
            unclaimed.version + 1,
            &claim,
            TransitionCtx::default()
        )
        .await
        .unwrap_err(),
        RegistryError::Conflict,
        "stale version"
    );
    assert_eq!(handouts().await, vec![claimed.id.clone()]);
    // the hand-out stays one through its life (Hibernating, Lost, …) until it ends
    let rec = r
        .transition(
            &rec.id,
            rec.version,
            &[Idle, Hibernating],
            FenceCheck::Skip,
            TransitionCtx::default(),
        )
        .await
        .unwrap();
    let listed = r.list_pool_handouts().await.unwrap();
    let mine = listed.iter().find(|s| s.id == claimed.id).unwrap();
    assert_eq!(mine.state, Hibernating, "hand-outs come with their state");
    r.transition(
        &rec.id,
        rec.version,
        &[Terminated],
        FenceCheck::Skip,
        TransitionCtx::default(),
    )
    .await
    .unwrap();
    assert!(
        handouts().await.is_empty(),
        "a terminated sandbox is no hand-out"
    );
}

pub async fn node_registrations_upsert<R: Registry>(r: &R) {
    let id = new_id("node");
    let mut n = NodeRegistration {
        id: id.clone(),
        address: "127.0.0.1:7401".into(),
        token: new_id("secret"),
        registered_at: datetime!(2030-02-03 4:05:06 UTC),
    };
    r.upsert_node_registration(&n).await.unwrap();
    n.address = "127.0.0.1:7402".into();
    n.token = new_id("secret");
    n.registered_at = datetime!(2030-02-03 4:06:00 UTC);
    r.upsert_node_registration(&n).await.unwrap();
    let mine: Vec<_> = r
        .list_node_registrations()
        .await
        .unwrap()
        .into_iter()
        .filter(|x| x.id == id)
        .collect();
    assert_eq!(mine, vec![n.clone()], "upsert replaces");
    assert!(
        !format!("{n:?}").contains(&n.token),
        "Debug redacts the token"
    );
}

/// Races `tasks` spawned transitions holding the same version on a shared
/// registry: exactly one wins, the rest get `Conflict`.
pub async fn spawned_transitions_have_one_winner<R: Registry + 'static>(r: Arc<R>, tasks: usize) {
    let s = insert(&*r, &tenant()).await;
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let r = Arc::clone(&r);
            let id = s.id.clone();
            tokio::spawn(async move {
                r.transition(
                    &id,
                    0,
                    &[SandboxState::Planning],
                    FenceCheck::Skip,
                    TransitionCtx::request(format!("racer-{i}")),
                )
                .await
            })
        })
        .collect();
    let mut wins = 0;
    for h in handles {
        match h.await.expect("transition task panicked") {
            Ok(_) => wins += 1,
            Err(RegistryError::Conflict) => {}
            Err(e) => panic!("racing transition failed with {e:?}"),
        }
    }
    assert_eq!(wins, 1, "one writer wins");
    assert_eq!(r.get_sandbox(&s.id).await.unwrap().version, 1);
    assert_eq!(events_of(&*r, &s.id).await.len(), 2);
}
