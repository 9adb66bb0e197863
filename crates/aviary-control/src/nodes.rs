//! Nodes and placement: the local node plus `aviary node` agents reached
//! over the network (DESIGN §3 Scheduler, Nodes and runtimes).
//!
//! "What" a sandbox gets is decided before (planner + policy); this module
//! only decides *where*: it builds a scheduler view of every node (capacity,
//! committed limits, runtimes, templates present, warm count, health) and
//! lets `aviary-scheduler` filter and score them (best-of-K). The decision
//! and its score are events. Node agent registrations, tokens included, are
//! registry rows (`node_registration`, in the 0600 registry file; never
//! logged) so a restarted control plane reconnects. (Older versions kept
//! them in `<data>/nodes.json`; the server moves that into the registry once,
//! at start-up.) Agents are reached through the [`crate::NodeConnector`]
//! backend.
//!
//! Every placement goes through the scheduler's filters, the local node's
//! included, so no node is committed past its over-commit limit
//! (`capacity_exhausted`). Placements are serialized by the lock
//! `placement/nodes` of the control plane's [`aviary_leases::Locks`], held
//! until the new sandbox's row exists ([`Placement`]): the row is what
//! counts as committed, so two creates (of this replica or another one
//! sharing the lock backend) cannot both take the last slot. The lock is
//! renewed while held; a placement that waits longer than
//! `PLACEMENT_WAIT` answers `conflict`.
//!
//! In-process state here: the map of connected agents (their HTTP clients,
//! rebuilt from the registry's `node_registration` rows at start-up) is a
//! cache of live handles, not a record; nothing else.

use crate::backends::NodeAgent;
use crate::context::OpContext;
use crate::error::OpError;
use crate::ops::ControlPlane;
use aviary_core::ResourceLimits;
use aviary_leases::{LockGuard, LockName};
use aviary_registry::NodeRegistration;
use aviary_scheduler::{NodeView, PlacementRequest, Scheduler, SchedulerConfig};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub const LOCAL_NODE: &str = "local";

/// How long a placement waits for the one before it (which reads every
/// node's view, agents included, and inserts its row).
pub(crate) const PLACEMENT_WAIT: Duration = Duration::from_secs(300);

/// The lock every placement holds until its sandbox's row exists.
fn placement_lock() -> LockName {
    LockName::new("placement", "nodes")
}

pub struct RemoteNode {
    pub id: String,
    pub address: String,
    /// The agent's client (it holds the agent's token).
    pub runtime: Arc<dyn NodeAgent>,
}

pub struct Nodes {
    /// Connected agents (live handles; the registrations are registry rows).
    map: RwLock<HashMap<String, Arc<RemoteNode>>>,
    scheduler: Scheduler,
}

/// Which nodes a placement may choose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PlaceOn<'a> {
    /// Any node (a cold create).
    Any,
    /// Only node `n`: new compute for a sandbox that stays where it is
    /// (wake, recovery), or a warm sandbox for that node's pool.
    Node(&'a str),
    /// Nodes whose layers can be staged from a snapshot (a fork, a create
    /// from a snapshot): this control plane's own node, and the agents
    /// that snapshot.
    Stageable,
}

/// What a placement decides from.
pub(crate) struct PlaceRequest<'a> {
    pub tenant: &'a str,
    pub class: &'a str,
    pub limits: ResourceLimits,
    pub template_digest: &'a str,
    /// The approved runtime: only nodes offering it are candidates.
    pub runtime: &'a str,
    /// Which nodes may take it.
    pub on: PlaceOn<'a>,
    pub request_id: Option<&'a str>,
}

/// Where a new sandbox goes. Keep it until the sandbox's registry row is
/// inserted: until then the placed limits are not counted as committed, and
/// it holds the placement lock that keeps other placements out.
pub(crate) struct Placement {
    pub node: String,
    _placing: LockGuard,
}

/// `POST /v1/nodes` (admin): register a node agent.
#[derive(Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddNodeRequest {
    pub id: String,
    /// `host:port` of the agent.
    pub address: String,
    /// The agent's bearer token.
    pub token: String,
}

/// The token is a secret: never in a log line.
impl std::fmt::Debug for AddNodeRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddNodeRequest")
            .field("id", &self.id)
            .field("address", &self.address)
            .field("token", &"<redacted>")
            .finish()
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeList {
    #[schema(value_type = Vec<Object>)]
    pub nodes: Vec<NodeView>,
}

impl Nodes {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Nodes {
            map: RwLock::new(HashMap::new()),
            scheduler: Scheduler::new(cfg),
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<RemoteNode>> {
        self.map.read().expect("nodes poisoned").get(id).cloned()
    }

    /// Every registered node, by id.
    pub fn all(&self) -> Vec<Arc<RemoteNode>> {
        let mut v: Vec<_> = self
            .map
            .read()
            .expect("nodes poisoned")
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    pub fn is_empty(&self) -> bool {
        self.map.read().expect("nodes poisoned").is_empty()
    }
}

/// States in which a sandbox's limits count as committed on its node: from
/// the create's first row until its compute is gone (hibernated, lost,
/// failed or terminated sandboxes hold none).
fn holds_compute(s: aviary_core::SandboxState) -> bool {
    use aviary_core::SandboxState::*;
    !matches!(s, Hibernating | Terminated | Failed | Lost)
}

impl ControlPlane {
    /// Connects the node agents of the registry's registrations that are not
    /// connected yet: all of them at start-up, then (called periodically)
    /// the ones another replica registered since, and ones that did not
    /// answer before.
    pub async fn load_nodes(&self) {
        let saved = match self.registry.list_node_registrations().await {
            Ok(saved) => saved,
            Err(e) => {
                tracing::error!(error = %e, "reading node registrations failed; no node agents");
                return;
            }
        };
        for s in saved {
            if self
                .nodes
                .get(&s.id)
                .is_some_and(|n| n.address == s.address)
            {
                // connected already (re-registered elsewhere with the same
                // address: same agent)
                continue;
            }
            match self.connector.connect(&s.address, &s.token).await {
                Ok((rt, _)) => {
                    self.nodes.map.write().expect("nodes poisoned").insert(
                        s.id.clone(),
                        Arc::new(RemoteNode {
                            id: s.id,
                            address: s.address,
                            runtime: rt,
                        }),
                    );
                }
                Err(e) => {
                    tracing::warn!(node = %s.id, error = %e, "node did not answer; not placing there")
                }
            }
        }
    }

    pub async fn add_node(&self, cx: &OpContext, req: AddNodeRequest) -> Result<NodeList, OpError> {
        cx.require_admin("registering nodes")?;
        if req.id.is_empty()
            || req.id.len() > 64
            || req.id == LOCAL_NODE
            || req.id == self.cfg.local_node
            || !req
                .id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        {
            return Err(OpError::InvalidRequest(
                "node id must be 1-64 of [A-Za-z0-9._-] and not \"local\"".into(),
            ));
        }
        if req.address.parse::<std::net::SocketAddr>().is_err() {
            return Err(OpError::InvalidRequest(
                "node address must be ip:port".into(),
            ));
        }
        let (rt, info) = self
            .connector
            .connect(&req.address, &req.token)
            .await
            .map_err(|e| {
                OpError::InvalidRequest(format!(
                    "node {} at {} did not accept the registration: {e}",
                    req.id, req.address
                ))
            })?;
        self.registry
            .upsert_node(&aviary_registry::NodeRecord {
                id: req.id.clone(),
                address: req.address.clone(),
                runtimes: info.runtimes.clone(),
                cpu: info.cpu,
                memory_mb: info.memory_mb,
                healthy: true,
                last_seen: aviary_core::now(),
            })
            .await?;
        self.registry
            .upsert_node_registration(&NodeRegistration {
                id: req.id.clone(),
                address: req.address.clone(),
                token: req.token.clone(),
                registered_at: aviary_core::now(),
            })
            .await?;
        self.nodes.map.write().expect("nodes poisoned").insert(
            req.id.clone(),
            Arc::new(RemoteNode {
                id: req.id,
                address: req.address,
                runtime: rt,
            }),
        );
        self.node_list().await
    }

    /// Every node as the scheduler sees it now (admin only: capacity and
    /// commitments are server-wide).
    pub async fn list_nodes(&self, cx: &OpContext) -> Result<NodeList, OpError> {
        cx.require_admin("listing nodes")?;
        self.node_list().await
    }

    async fn node_list(&self) -> Result<NodeList, OpError> {
        Ok(NodeList {
            nodes: self.node_views(PlaceOn::Any, None).await?,
        })
    }

    /// The scheduler's view of the nodes `on` allows: the local node (when
    /// this control plane runs sandboxes) and every such agent that answers.
    /// `placing` is the template digest of a placement: it is known to be
    /// in the local store, which then need not be listed when only the
    /// local node is considered.
    async fn node_views(
        &self,
        on: PlaceOn<'_>,
        placing: Option<&str>,
    ) -> Result<Vec<NodeView>, OpError> {
        let local_only = match on {
            PlaceOn::Node(n) => n == self.cfg.local_node,
            PlaceOn::Any | PlaceOn::Stageable => false,
        };
        let now = aviary_core::now();
        let (cpu, mem) = (self.cfg.local_cpu, self.cfg.local_memory_mb);
        let mut committed = (0.0, 0u64);
        for t in self.registry.live_totals(None).await? {
            if t.node == self.cfg.local_node && holds_compute(t.state) {
                committed.0 += t.cpu;
                committed.1 += t.memory_mb;
            }
        }
        let templates = match placing {
            Some(digest) if local_only => vec![digest.to_owned()],
            _ => self
                .templates
                .list()
                .await?
                .into_iter()
                .map(|t| t.digest)
                .collect(),
        };
        let mut views = vec![NodeView {
            id: self.cfg.local_node.clone(),
            address: self.cfg.local_node.clone(),
            runtimes: self.runtimes.names(),
            templates,
            cpu_capacity: cpu,
            memory_capacity_mb: mem,
            cpu_committed: committed.0,
            memory_committed_mb: committed.1,
            cpu_used: 0.0,
            memory_used_mb: 0,
            warm: HashMap::new(),
            healthy: true,
            last_seen: now,
        }];
        let local_allowed = match on {
            PlaceOn::Node(n) => n == self.cfg.local_node,
            PlaceOn::Any | PlaceOn::Stageable => true,
        };
        if !self.cfg.runs_sandboxes || !local_allowed {
            // a stateless replica: placement only among the agents
            views.clear();
        }
        for n in self.nodes.all() {
            let allowed = match on {
                PlaceOn::Any => true,
                PlaceOn::Node(id) => id == n.id,
                PlaceOn::Stageable => n.runtime.layers().is_some(),
            };
            if !allowed {
                continue;
            }
            match n.runtime.view(&n.address, now).await {
                Ok(view) => views.push(view),
                Err(e) => {
                    tracing::warn!(node = %n.id, error = %e, "node info failed; not placing there")
                }
            }
        }
        Ok(views)
    }

    /// Where a new sandbox runs: the scheduler's choice among the nodes
    /// [`PlaceOn`] allows. A node past its over-commit limit is never
    /// chosen; when none has room the answer is `capacity_exhausted`. The
    /// decision is an event when agents are registered.
    pub(crate) async fn place(&self, place: PlaceRequest<'_>) -> Result<Placement, OpError> {
        let PlaceRequest {
            tenant,
            class,
            limits,
            template_digest,
            runtime,
            on,
            request_id,
        } = place;
        let placing = self
            .hold_lock(placement_lock(), "placement", PLACEMENT_WAIT)
            .await?;
        let views = self.node_views(on, Some(template_digest)).await?;
        let req = PlacementRequest {
            class: class.to_owned(),
            limits,
            template_digest: template_digest.to_owned(),
            runtime: runtime.to_owned(),
        };
        let decision = match self.nodes.scheduler.place(&views, &req, aviary_core::now()) {
            Ok(d) => d,
            Err(e) => {
                // node capacities are not the tenant's business: details go to the log
                tracing::info!(tenant, class, error = ?e, "placement refused");
                return Err(if e.is_capacity() {
                    OpError::CapacityExhausted(format!(
                        "no node has room for a {class} sandbox ({} CPU, {} MiB) within its over-commit limit; retry later",
                        limits.cpu, limits.memory_mb
                    ))
                } else {
                    OpError::Unavailable(format!("no node can take the sandbox: {e}"))
                });
            }
        };
        if !self.nodes.is_empty() {
            self.record_event(
                tenant,
                None,
                None,
                "placement",
                request_id,
                serde_json::to_value(&decision).unwrap_or_default(),
            )
            .await?;
        }
        Ok(Placement {
            node: decision.node_id,
            _placing: placing,
        })
    }

    /// The runtime that runs the sandboxes of `node` on `runtime`: a local
    /// runtime of the [`crate::RuntimeSet`] by name, or the node's agent
    /// (which can always pause). A local runtime need not be able to pause
    /// (Kubernetes cannot): [`SandboxRuntime::pausable`] says so.
    pub(crate) fn runtime_for(&self, node: &str, runtime: &str) -> Result<SandboxRuntime, OpError> {
        if node == self.cfg.local_node {
            let capable = self.local_runtime(runtime)?;
            return Ok(SandboxRuntime {
                runtime: capable.runtime.clone(),
                pausable: capable.pausable.clone(),
            });
        }
        self.nodes
            .get(node)
            .map(|n| {
                let agent = n.runtime.runtime();
                SandboxRuntime {
                    runtime: agent.clone(),
                    pausable: Some(agent),
                }
            })
            .ok_or_else(|| {
                OpError::Unavailable(format!(
                    "the sandbox runs on node {node}, which is not connected here \
                     (an agent that is down, or another replica's own runtimes: \
                     send the request to that replica)"
                ))
            })
    }

    /// The local runtime called `name` (a record names the runtime it runs
    /// on; one this control plane does not serve is `unavailable`).
    pub(crate) fn local_runtime(
        &self,
        name: &str,
    ) -> Result<&aviary_runtime::CapableRuntime, OpError> {
        self.runtimes.get(name).ok_or_else(|| {
            OpError::Unavailable(format!(
                "runtime {name:?} is not served here (serving: {})",
                self.runtimes.names().join(", ")
            ))
        })
    }
}

/// The runtime a sandbox runs on, seen through the capabilities it has.
/// Calls every runtime has go through `Deref`; freezing needs
/// [`SandboxRuntime::pausable`], which a runtime without `Pausable` answers
/// `unsupported` (and the internal paths that freeze skip it: such a sandbox
/// is never paused).
#[derive(Clone)]
pub(crate) struct SandboxRuntime {
    runtime: Arc<dyn aviary_runtime::Runtime>,
    pausable: Option<Arc<dyn aviary_runtime::Pausable>>,
}

impl SandboxRuntime {
    /// The runtime as one that can pause, or `unsupported` naming it
    /// (`what`: the operation asked for). Nothing has been changed then.
    pub(crate) fn pausable(
        &self,
        what: &str,
    ) -> Result<&Arc<dyn aviary_runtime::Pausable>, OpError> {
        self.pausable.as_ref().ok_or_else(|| OpError::Coded {
            code: aviary_core::ErrorCode::Unsupported,
            message: format!(
                "{what} is not supported on runtime {}: it cannot pause a sandbox",
                self.runtime.name()
            ),
        })
    }

    /// The runtime itself, to keep.
    pub(crate) fn shared(&self) -> Arc<dyn aviary_runtime::Runtime> {
        self.runtime.clone()
    }

    /// The runtime as one that can pause, if it can.
    pub(crate) fn can_pause(&self) -> Option<&Arc<dyn aviary_runtime::Pausable>> {
        self.pausable.as_ref()
    }
}

impl std::ops::Deref for SandboxRuntime {
    type Target = dyn aviary_runtime::Runtime;

    fn deref(&self) -> &Self::Target {
        self.runtime.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn add_node_request_debug_hides_the_token() {
        let req = AddNodeRequest {
            id: "node-a".into(),
            address: "127.0.0.1:7401".into(),
            token: "very-secret".into(),
        };
        let shown = format!("{req:?}");
        assert!(!shown.contains("very-secret"), "{shown}");
        assert!(shown.contains("node-a"));
    }
}
