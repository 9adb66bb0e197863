//! Warm pools: per (resource class, template, runtime), sandboxes started
//! ahead of demand so a create only has to claim one (DESIGN §3 Pool manager).
//!
//! A pooled sandbox is a registry row in `Ready` with no tenant
//! ([`aviary_registry::POOL_TENANT`]); handing it out is
//! `Registry::claim_sandbox`, a version-checked transaction, so one pooled
//! sandbox can never be handed out twice, whatever the concurrency. A
//! background task refills each pool (see `aviary.example.toml` for the
//! meaning of `pool_min / pool_max / buffer_min / buffer_max`).
//!
//! All of a pool's state that matters lives in the registry: bounds changed
//! with `aviary pool set` (`pool_bounds`; older versions kept them in
//! `<data dir>/pools.json`, imported once at start-up), and the hand-outs:
//! `claim_sandbox` marks the sandbox, and a pool's `handed_out` is the number
//! of its marked sandboxes that still hold compute, read from the registry
//! on every refill pass. So a hand-out stops counting when its sandbox is
//! deleted, expires, fails, is lost or hibernates, whichever path ends it,
//! and the count survives restarts. (A process-local set of handed-out ids
//! that only a `forget` call emptied — and nothing called it — once made
//! pools stop refilling after `pool_min` hand-outs.) Hits and misses are
//! process-local counters, like every metric.
//!
//! Pools are per node: every node that serves a pool's runtime keeps its
//! own warm sandboxes of it — a replica's own node (`ControlConfig::local_node`),
//! refilled by that replica, and each `aviary node` agent, refilled by the
//! replica holding the leader lock ([`crate::Reconciling`] says which). A
//! create is handed a warm sandbox from any node this replica drives (its
//! own node's first: no agent hop), never one on another replica's node,
//! which is not reachable from here. Bounds are shared (one `pool set` row
//! per class, read by every replica) and apply to each node;
//! `GET /v1/pools` adds the nodes up.
//!
//! Concurrency: a pool's bounds are read from the registry on every refill
//! pass and view (`pool set` on any replica takes effect on the next pass;
//! there is no in-process copy to keep in step). A refill pass of one pool
//! holds the lock `pool/<node>/<class>/<template>/<runtime>` of the control plane's
//! [`aviary_leases::Locks`] (tried, never waited for: a pool another pass is
//! refilling is skipped), so two passes — of this replica or of another one
//! sharing the lock backend — never both start the same missing sandboxes.
//! Claims take no lock: `claim_sandbox` is version-checked, so of two
//! claims of one sandbox exactly one wins and the other tries the next, and
//! a hit never waits behind a refill that is provisioning.

use crate::context::OpContext;
use crate::error::OpError;
use crate::ops::ControlPlane;
use crate::requests::PoolUpdate;
use aviary_config::PoolSettings;
use aviary_core::{SandboxId, SandboxState};
use aviary_leases::{LockName, LockRequest};
use aviary_registry::{
    FenceCheck, NewSandbox, PoolBoundsRecord, SandboxRecord, TransitionCtx, POOL_TENANT,
};
use serde::{Deserialize, Serialize};

/// One pool: its configured settings (the bounds `pool set` stored in the
/// registry override them, see `Pool::effective`) and its counters.
pub struct Pool {
    pub settings: PoolSettings,
    pub hits: prometheus_client::metrics::counter::Counter,
    pub misses: prometheus_client::metrics::counter::Counter,
    /// Hand-outs that still hold compute, as of the last registry read (the
    /// refill pass or `GET /v1/pools`); for the metrics, which are sync.
    handed_out: prometheus_client::metrics::gauge::Gauge,
}

impl Pool {
    fn key(&self) -> (String, String, String) {
        let s = &self.settings;
        (
            s.class.clone(),
            s.template.clone(),
            s.runtime.as_str().to_owned(),
        )
    }

    /// The settings the pool runs with: the configured ones, with the
    /// bounds `pool set` stored for its class (`bounds`, the registry's
    /// rows) applied.
    fn effective(&self, bounds: &[PoolBoundsRecord]) -> PoolSettings {
        let mut s = self.settings.clone();
        if let Some(b) = bounds.iter().find(|b| b.class == s.class) {
            apply_bounds(&mut s, b.pool_min, b.pool_max);
        }
        s
    }

    /// The lock a refill pass of this pool on `node` holds.
    fn refill_lock(&self, node: &str) -> LockName {
        let (class, template, runtime) = self.key();
        LockName::new("pool", format!("{node}/{class}/{template}/{runtime}"))
    }
}

pub struct Pools {
    pub pools: Vec<Pool>,
    /// Wakes the refill task (shared with background reclaims, which end
    /// a hand-out's compute after its destroy was answered).
    pub refill: std::sync::Arc<tokio::sync::Notify>,
}

/// `GET /v1/pools` entry.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PoolView {
    pub class: String,
    pub template: String,
    pub runtime: String,
    pub pool_min: u32,
    pub pool_max: u32,
    pub buffer_min: u32,
    pub buffer_max: u32,
    /// Warm sandboxes ready to be handed out.
    pub idle: u32,
    /// Sandboxes this pool handed out that still hold compute (not yet
    /// deleted, expired, failed, lost or hibernated).
    pub handed_out: u32,
    pub hits: u64,
    pub misses: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PoolList {
    pub pools: Vec<PoolView>,
}

/// `PUT /v1/pools/{class}`: new bounds for every pool of that class.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetPoolRequest {
    pub min: u32,
    pub max: u32,
}

impl Pools {
    /// The configured pools (bounds set with `pool set` are read from the
    /// registry when they are used).
    pub fn new(settings: &[PoolSettings], metrics: &crate::metrics::Metrics) -> Self {
        let pools = settings
            .iter()
            .map(|p| {
                let (hits, misses, handed_out) =
                    metrics.pool_metrics(&crate::metrics::PoolLabels {
                        class: p.class.clone(),
                        template: p.template.clone(),
                        runtime: p.runtime.as_str().to_owned(),
                    });
                Pool {
                    settings: p.clone(),
                    hits,
                    misses,
                    handed_out,
                }
            })
            .collect();
        Pools {
            pools,
            refill: std::sync::Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// Whether a configured pool starts sandboxes from `template`.
    pub fn uses_template(&self, template: &str) -> bool {
        self.pools.iter().any(|p| p.key().1 == template)
    }

    pub fn find(&self, class: &str, template: &str, runtime: &str) -> Option<&Pool> {
        self.pools.iter().find(|p| {
            let (c, t, r) = p.key();
            c == class && t == template && r == runtime
        })
    }
}

/// `pool_min`/`pool_max` from `pool set`; the buffer bounds follow so the
/// configuration stays consistent (`buffer_min ≤ buffer_max ≤ pool_max`).
fn apply_bounds(p: &mut PoolSettings, min: u32, max: u32) {
    p.pool_min = min;
    p.pool_max = max;
    p.buffer_max = p.buffer_max.min(max);
    p.buffer_min = p.buffer_min.min(p.buffer_max);
}

fn is_pooled(r: &SandboxRecord, node: &str, class: &str, template: &str) -> bool {
    r.tenant == POOL_TENANT
        && r.node == node
        && r.state == SandboxState::Ready
        && !r.tainted
        && r.resource_class == class
        && r.template == template
}

/// Whether a hand-out of the registry (see `Registry::list_pool_handouts`)
/// counts for the pool of `s`: it came out of this pool and still holds
/// compute. A hibernated one holds none (waking it is a new placement), so
/// it no longer keeps the pool from refilling.
fn counts_as_handed_out(r: &SandboxRecord, node: &str, s: &PoolSettings) -> bool {
    use SandboxState::*;
    r.node == node
        && r.resource_class == s.class
        && r.template == s.template
        && r.runtime == s.runtime.as_str()
        && !matches!(r.state, Hibernating | Terminated | Failed | Lost)
}

impl ControlPlane {
    /// Per pool (in `self.pools.pools` order), its hand-outs on each of
    /// `nodes` that still hold compute, read from the registry (summed over
    /// the nodes); also refreshes the metrics' copy.
    async fn handed_out_counts(&self, nodes: &[String]) -> Result<Vec<u32>, OpError> {
        let handouts = self.registry.list_pool_handouts().await?;
        Ok(self
            .pools
            .pools
            .iter()
            .map(|p| {
                let n = handouts
                    .iter()
                    .filter(|r| {
                        nodes
                            .iter()
                            .any(|n| counts_as_handed_out(r, n, &p.settings))
                    })
                    .count();
                p.handed_out.set(i64::try_from(n).unwrap_or(i64::MAX));
                u32::try_from(n).unwrap_or(u32::MAX)
            })
            .collect())
    }

    /// The nodes whose pools a pass over `scope` keeps, each with the
    /// runtimes it serves: this control plane's own node (when it runs
    /// sandboxes) and, with the agents, every connected agent.
    fn pool_nodes(&self, scope: crate::Reconciling) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        if self.cfg.runs_sandboxes {
            out.push((self.cfg.local_node.clone(), self.runtimes.names()));
        }
        if scope == crate::Reconciling::OwnNodeAndAgents {
            for n in self.nodes.all() {
                out.push((n.id.clone(), vec![n.runtime.runtime().name().to_owned()]));
            }
        }
        out
    }

    /// Every pool with its sizes and hit/miss counts (admin only: the
    /// counts are server-wide).
    pub async fn pools_view(&self, cx: &OpContext) -> Result<PoolList, OpError> {
        cx.require_admin("listing pools")?;
        self.pool_list().await
    }

    async fn pool_list(&self) -> Result<PoolList, OpError> {
        let rows = self
            .registry
            .list_sandboxes(Some(POOL_TENANT), false)
            .await?;
        let nodes: Vec<String> = self
            .pool_nodes(crate::Reconciling::OwnNodeAndAgents)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let handed_out = self.handed_out_counts(&nodes).await?;
        let bounds = self.registry.list_pool_bounds().await?;
        let mut out = Vec::new();
        for (p, handed_out) in self.pools.pools.iter().zip(handed_out) {
            let s = p.effective(&bounds);
            out.push(PoolView {
                idle: rows
                    .iter()
                    .filter(|r| nodes.iter().any(|n| is_pooled(r, n, &s.class, &s.template)))
                    .count() as u32,
                handed_out,
                class: s.class,
                template: s.template,
                runtime: s.runtime.as_str().to_owned(),
                pool_min: s.pool_min,
                pool_max: s.pool_max,
                buffer_min: s.buffer_min,
                buffer_max: s.buffer_max,
                hits: p.hits.get(),
                misses: p.misses.get(),
            });
        }
        Ok(PoolList { pools: out })
    }

    pub async fn set_pool(&self, cx: &OpContext, update: PoolUpdate) -> Result<PoolList, OpError> {
        cx.require_admin("changing pools")?;
        let PoolUpdate { class, bounds: req } = update;
        let class = class.as_str();
        if req.min > req.max || req.max > 10_000 {
            return Err(OpError::InvalidRequest(
                "pool bounds need min <= max <= 10000".into(),
            ));
        }
        let known = self.pools.pools.iter().any(|p| p.settings.class == class);
        if !known {
            return Err(OpError::NotFound(format!("pool for class {class:?}")));
        }
        // the registry is the only copy: every refill pass (of any replica)
        // and every view reads it
        self.registry
            .set_pool_bounds(&PoolBoundsRecord {
                class: class.to_owned(),
                pool_min: req.min,
                pool_max: req.max,
                updated_at: aviary_core::now(),
            })
            .await?;
        self.pools.refill.notify_one();
        self.pool_list().await
    }

    /// Claims a warm sandbox of this pool for the caller, if one is there.
    pub(crate) async fn claim_pooled(
        &self,
        pool: &Pool,
        claim: &aviary_registry::SandboxClaim,
        request_id: Option<&str>,
    ) -> Result<Option<SandboxRecord>, OpError> {
        let (class, template, _) = pool.key();
        let mut rows: Vec<SandboxRecord> = self
            .registry
            .list_sandboxes(Some(POOL_TENANT), false)
            .await?
            .into_iter()
            .filter(|r| self.drives_node(&r.node) && is_pooled(r, &r.node, &class, &template))
            .collect();
        // this node's own first: no agent in between
        rows.sort_by_key(|r| r.node != self.cfg.local_node);
        for r in &rows {
            // one on an agent that another replica started is attached here
            // on first use
            let Ok(live) = self.live_rec(r).await else {
                continue;
            };
            // its compute may have gone since the last probe: one health
            // call (a socket round trip) before it is handed out
            if Self::envd_unreachable(&r.id, &live).await {
                self.fail_pooled(
                    &r.id,
                    &OpError::SandboxLost("the pooled sandbox's envd does not answer".into()),
                )
                .await;
                continue;
            }
            let ctx = TransitionCtx {
                request_id: request_id.map(str::to_owned),
                event_type: Some("pool_claimed".into()),
                metadata: serde_json::json!({"pool": {"class": class, "template": template}}),
            };
            match self
                .registry
                .claim_sandbox(&r.id, r.version, claim, ctx)
                .await
            {
                Ok(rec) => {
                    // the registry now counts it as handed out (claim_sandbox)
                    pool.hits.inc();
                    self.pools.refill.notify_one();
                    return Ok(Some(rec));
                }
                Err(aviary_registry::RegistryError::Conflict) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        pool.misses.inc();
        self.pools.refill.notify_one();
        Ok(None)
    }

    /// One pass of the refill over this control plane's own node and every
    /// connected agent (the single server; see [`Self::refill_pools_as`]).
    pub async fn refill_pools(&self) -> Result<usize, OpError> {
        self.refill_pools_as(crate::Reconciling::OwnNodeAndAgents)
            .await
    }

    /// One pass of the refill over the nodes `scope` names: brings every
    /// pool of each node to its target and trims idle sandboxes above
    /// `buffer_max`. Returns how many were started. A pool whose refill
    /// lock is held (another pass is at it) is skipped.
    pub async fn refill_pools_as(&self, scope: crate::Reconciling) -> Result<usize, OpError> {
        let mut started = 0;
        for (node, runtimes) in self.pool_nodes(scope) {
            started += self.refill_node(&node, &runtimes).await?;
        }
        Ok(started)
    }

    /// [`Self::refill_pools_as`] for the pools of one node.
    async fn refill_node(&self, node: &str, runtimes: &[String]) -> Result<usize, OpError> {
        let mut started = 0;
        let bounds = self.registry.list_pool_bounds().await?;
        let nodes = [node.to_owned()];
        for (i, pool) in self.pools.pools.iter().enumerate() {
            let s = pool.effective(&bounds);
            if !runtimes.iter().any(|r| r == s.runtime.as_str()) {
                continue;
            }
            let owner = format!("aviary-server[{}] pool refill", std::process::id());
            let req = LockRequest::new(pool.refill_lock(node), owner, crate::lifecycle::LOCK_TTL);
            let Some(guard) = self.locks.try_acquire(&req).await? else {
                continue;
            };
            let _refilling = guard.keep_alive();
            // read under the lock: what another pass started is counted
            let handed = self.handed_out_counts(&nodes).await?[i];
            // a pool whose template is not (yet) there has nothing to start
            let Ok(template) = self.template_info(&s.template).await else {
                continue;
            };
            let Some(class) = self.cfg.settings.class(&s.class).cloned() else {
                continue;
            };
            let rows = self
                .registry
                .list_sandboxes(Some(POOL_TENANT), false)
                .await?;
            let idle: Vec<_> = rows
                .iter()
                .filter(|r| is_pooled(r, node, &s.class, &s.template))
                .cloned()
                .collect();
            // pool_min is a floor on the total (idle + handed out), buffer_min
            // a floor on idle ones; pool_max caps the total. Idle sandboxes
            // above both buffer_max and what pool_min needs are trimmed.
            let room = s.pool_max.saturating_sub(handed);
            let target = s
                .buffer_min
                .max(s.pool_min.saturating_sub(handed))
                .min(room);
            let keep = s.buffer_max.max(target).min(room);
            let mut have = idle.len() as u32;
            while have < target {
                match self
                    .start_pooled(&class, &template, s.runtime.as_str(), node)
                    .await
                {
                    Ok(()) => {}
                    // a full node is not a failure: the pool waits for room
                    Err(OpError::CapacityExhausted(why)) => {
                        tracing::debug!(pool = %s.class, %why, "pool refill waits for capacity");
                        break;
                    }
                    Err(e) => return Err(e),
                }
                started += 1;
                have += 1;
            }
            for extra in idle.iter().skip(keep as usize) {
                let _ = self.destroy_pooled(extra.clone()).await;
            }
        }
        Ok(started)
    }

    async fn start_pooled(
        &self,
        class: &aviary_config::ResourceClass,
        template: &aviary_registry::TemplateRecord,
        runtime: &str,
        node: &str,
    ) -> Result<(), OpError> {
        // warm sandboxes are committed like any other: only within the
        // node's over-commit limit
        let placement = self
            .place(crate::nodes::PlaceRequest {
                tenant: POOL_TENANT,
                class: &class.name,
                limits: class.limits(),
                template_digest: &template.digest,
                runtime,
                on: crate::nodes::PlaceOn::Node(node),
                request_id: None,
            })
            .await?;
        let id = SandboxId::generate();
        let new = NewSandbox {
            id: id.clone(),
            tenant: POOL_TENANT.to_owned(),
            user_id: None,
            session_id: None,
            agent: None,
            scope: aviary_core::Scope::Session,
            resource_class: class.name.clone(),
            resources: class.limits(),
            template: template.name.clone(),
            template_digest: template.digest.clone(),
            runtime: runtime.to_owned(),
            runtime_instance_id: None,
            node: node.to_owned(),
            network_profile: aviary_core::NetworkProfile::None,
            expires_at: None,
            tainted: false,
            user_managed: false,
            metadata: Default::default(),
            env: Default::default(),
            run_as: Default::default(),
            workdir: Default::default(),
        };
        let meta = serde_json::json!({"pool": {"class": class.name, "template": template.name}});
        let rec = self
            .registry
            .insert_sandbox(
                &new,
                TransitionCtx {
                    request_id: None,
                    event_type: Some("pool_refill".into()),
                    metadata: meta.clone(),
                },
            )
            .await?;
        drop(placement);
        let rec = self
            .registry
            .transition(
                &id,
                rec.version,
                &[
                    SandboxState::Planning,
                    SandboxState::Allocating,
                    SandboxState::Provisioning,
                ],
                FenceCheck::Skip,
                TransitionCtx {
                    request_id: None,
                    event_type: Some("pool_refill".into()),
                    metadata: meta.clone(),
                },
            )
            .await?;
        let spec = self.sandbox_spec(
            &id,
            template,
            class.limits(),
            aviary_core::NetworkProfile::None,
            None,
        );
        match self.provision(&spec, rec, None).await {
            Ok((rec, _live)) => {
                self.registry
                    .transition(
                        &id,
                        rec.version,
                        &[SandboxState::Ready],
                        FenceCheck::Skip,
                        TransitionCtx {
                            request_id: None,
                            event_type: Some("pool_refill".into()),
                            metadata: meta,
                        },
                    )
                    .await?;
                Ok(())
            }
            Err(e) => {
                self.fail_pooled(&id, &e).await;
                Err(e)
            }
        }
    }
}
