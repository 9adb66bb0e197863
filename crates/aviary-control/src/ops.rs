//! The control plane's operations. Every HTTP handler calls exactly one
//! method here; the tests drive the same methods through the real HTTP API.
//! A client operation takes the [`OpContext`] (caller, request id, lease
//! token) and one request value.
//!
//! Invariants:
//! - every state change goes through `Registry::transition` (legal moves only,
//!   optimistic version, one event per step);
//! - a sandbox is visible only to its tenant: another tenant's id is
//!   `not_found`, never `forbidden`, so ids cannot be probed;
//! - mutating calls are fenced twice: by the registry/lease store before the
//!   call, and by the sandbox's envd, which holds the current fence and
//!   refuses stale tokens on its own;
//! - fence updates to an envd are serialized per sandbox (the lock
//!   `fence/<id>` of the control plane's `Locks`, so also across replicas)
//!   and always push the lease store's *current* view, read while the lock
//!   is held, so they cannot reorder into a stale state.

use crate::backends::{Backends, RuntimeSet, TemplateCatalog, TreeArchive};
use crate::config::ControlConfig;
pub use crate::context::Caller;
use crate::context::OpContext;
use crate::error::OpError;
use crate::requests::{
    EventQuery, FileRequest, FileUpload, OnSandbox, RemoveFileRequest, SandboxQuery, SandboxRef,
    SetTtlRequest, TemplateImport,
};
use aviary_core::api::*;
use aviary_core::{LeaseToken, SandboxId, SandboxState, Scope};
use aviary_envd_proto::{EnvdClient, EnvdError, ExecSpec};
use aviary_leases::LeaseStore;
use aviary_registry::TemplateRecord;
use aviary_registry::{
    EventFilter, FenceCheck, NewEvent, NewSandbox, Registry, SandboxRecord, TransitionCtx,
};
use aviary_runtime::{BindMount, Runtime, SandboxSpec};
use sha2::Digest;
use std::collections::HashMap;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;
use time::OffsetDateTime;
use tokio::sync::watch;
use tracing::Instrument;

/// Where envd sits inside every sandbox, and where it listens.
pub const ENVD_IN_SANDBOX: &str = "/.aviary/envd";
/// PID 1's arguments after the envd path: serve the listening socket the
/// runtime binds on the host and passes as fd 3 (socket activation).
pub const ENVD_INIT_ARGS: [&str; 2] = ["--listen-fd", "3"];

/// A control call to envd (fence move, kill-all) within [`FENCE_PUSH_TIMEOUT`]:
/// a hung envd must not hang the operation waiting on it, and `busy` is
/// retried (envd keeps a reserved lane for control calls, which a burst of
/// refused calls can fill for a moment).
async fn envd_control<F, Fut>(what: &str, call: F) -> Result<(), OpError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), aviary_envd_proto::EnvdError>>,
{
    let attempt = async {
        loop {
            match call().await {
                Err(aviary_envd_proto::EnvdError::Busy) => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                other => break other,
            }
        }
    };
    match tokio::time::timeout(FENCE_PUSH_TIMEOUT, attempt).await {
        Ok(r) => r.map_err(OpError::from),
        Err(_) => Err(OpError::Unavailable(format!(
            "envd did not {what} within {FENCE_PUSH_TIMEOUT:?}"
        ))),
    }
}

/// The client of a local sandbox's envd: its host-only socket, and every
/// connection's peer checked to be the sandbox's init (a socket the sandbox
/// could have swapped in would belong to another process).
pub(crate) fn envd_client(ep: &aviary_runtime::EnvdEndpoint) -> EnvdClient {
    EnvdClient::new(ep.socket.clone()).expect_peer_pid(ep.peer_pid)
}

/// Below this many writable bytes a sandbox's disk counts as full (its
/// writes fail with ENOSPC; ext4 keeps a little for its own metadata).
const DISK_FULL_BYTES: u64 = 1 << 20;

/// Longest a fence push may take; an envd that does not answer by then is
/// treated as one that refused.
const FENCE_PUSH_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a fence push waits for the pushes of the same sandbox before it
/// (each bounded by [`FENCE_PUSH_TIMEOUT`]); longer answers `conflict`.
const FENCE_LOCK_WAIT: Duration = Duration::from_secs(300);

/// The server's readiness.
#[derive(Clone, Debug, PartialEq)]
pub enum Readiness {
    Preparing(String),
    Ready,
    Failed(String),
}

/// A running sandbox the control plane can talk to.
pub struct LiveSandbox {
    pub envd: EnvdClient,
    /// The `sandbox_allocation` row whose usage is filled in at the end
    /// (-1: none; a pooled sandbox gets its row when it is claimed).
    pub(crate) allocation_id: std::sync::atomic::AtomicI64,
    /// Frozen by `pause` (the cgroup freezer); exec and files are refused.
    pub paused: std::sync::atomic::AtomicBool,
    /// Some exec in this sandbox ran into its timeout (telemetry).
    timed_out: std::sync::atomic::AtomicBool,
    /// Execs running now (an idle sandbox is one with none).
    pub(crate) active_execs: std::sync::atomic::AtomicUsize,
    /// Last exec start or end, for the idle timeout.
    pub(crate) last_activity: StdMutex<std::time::Instant>,
}

/// Counts a running exec on its sandbox until dropped.
pub struct ExecGuard(Arc<LiveSandbox>);

impl ExecGuard {
    pub(crate) fn new(live: Arc<LiveSandbox>) -> Self {
        live.active_execs
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        *live.last_activity.lock().expect("activity poisoned") = std::time::Instant::now();
        ExecGuard(live)
    }
}

impl Drop for ExecGuard {
    fn drop(&mut self) {
        self.0
            .active_execs
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        *self.0.last_activity.lock().expect("activity poisoned") = std::time::Instant::now();
    }
}

pub struct ControlPlane {
    pub cfg: ControlConfig,
    pub registry: Arc<dyn Registry>,
    pub leases: Arc<dyn LeaseStore>,
    /// The durable fencing counter client-initiated writes are checked
    /// against (the registry, in both modes).
    pub(crate) fences: Arc<dyn aviary_leases::FenceAuthority>,
    /// The local runtimes; a sandbox runs on the one its record names.
    pub runtimes: RuntimeSet,
    pub templates: Arc<dyn TemplateCatalog>,
    /// Reads and writes the directories runtimes export and stage.
    pub(crate) trees: Arc<dyn TreeArchive>,
    /// Connects `aviary node` agents.
    pub(crate) connector: Arc<dyn crate::backends::NodeConnector>,
    live: StdMutex<HashMap<SandboxId, Arc<LiveSandbox>>>,
    pub key_cache: crate::keys::KeyCache,
    /// Named locks with a TTL: scope buckets' execution guards and
    /// hibernate/wake of one sandbox (see `scopes`, `lifecycle`).
    pub locks: Arc<dyn aviary_leases::Locks>,
    /// When `last_active_at` was last written per sandbox: execs update it
    /// at most every few seconds, off the request path.
    last_touch: StdMutex<HashMap<SandboxId, std::time::Instant>>,
    ready_tx: watch::Sender<Readiness>,
    pub metrics: crate::metrics::Metrics,
    pub planning: crate::planning::Planning,
    pub pools: crate::pools::Pools,
    pub snapshots: aviary_snapshots::SnapshotService,
    pub nodes: crate::nodes::Nodes,
    /// What the reconciler saw on earlier passes (unclaimed compute, silent
    /// agents): observations, not records.
    pub(crate) reconciler: crate::reconciler::Observations,
    /// Compute reclaimed in the background after its destroy was answered.
    pub reclaims: crate::reclaim::Reclaims,
    /// Hash of the bootstrap admin key (set by [`Self::ensure_admin_key`]),
    /// which `revoke_key` refuses.
    pub(crate) bootstrap_key_hash: std::sync::RwLock<Option<String>>,
    /// The key of per-sandbox access tokens (see `access`), read from the
    /// registry once.
    pub(crate) access_key: tokio::sync::OnceCell<Vec<u8>>,
}

pub fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
}

pub fn hash_key(key: &str) -> String {
    hex::encode(sha2::Sha256::digest(key.as_bytes()))
}

fn ctx(
    request_id: Option<&str>,
    event_type: Option<&str>,
    metadata: serde_json::Value,
) -> TransitionCtx {
    TransitionCtx {
        request_id: request_id.map(str::to_owned),
        event_type: event_type.map(str::to_owned),
        metadata,
    }
}

fn valid_name(what: &str, s: &str) -> Result<(), OpError> {
    if s.is_empty() || s.len() > 128 || s.chars().any(|c| c.is_control()) {
        return Err(OpError::InvalidRequest(format!(
            "{what} must be 1-128 printable characters"
        )));
    }
    Ok(())
}

/// Validates a path given by a client: absolute, no NUL, bounded.
/// (envd confines it again inside the sandbox; this is the early, clear error.)
pub fn check_sandbox_path(p: &str) -> Result<(), OpError> {
    aviary_core::paths::check_client_path(p).map_err(|e| match e {
        aviary_core::paths::ClientPathError::TooLong
        | aviary_core::paths::ClientPathError::ContainsNul => {
            OpError::InvalidPath(format!("path {e}"))
        }
        _ => OpError::InvalidPath(format!("path {p:?} {e}")),
    })
}

impl ControlPlane {
    /// A control plane over `backends`.
    pub fn new(cfg: ControlConfig, backends: Backends) -> anyhow::Result<Arc<Self>> {
        let Backends {
            registry,
            coordination,
            runtimes,
            chunks,
            trees,
            templates,
            nodes: connector,
        } = backends;
        let aviary_leases::Coordination {
            leases,
            locks,
            fences,
        } = coordination;
        let (ready_tx, _) = watch::channel(Readiness::Preparing("starting".into()));
        let planning = crate::planning::Planning::new(
            &cfg.settings,
            runtimes.default_runtime().runtime.name(),
        )?;
        let metrics = crate::metrics::Metrics::default();
        let pools = crate::pools::Pools::new(&cfg.settings.pools, &metrics);
        let snapshots = aviary_snapshots::SnapshotService::new(chunks);
        let nodes = crate::nodes::Nodes::new(aviary_scheduler::SchedulerConfig {
            cpu_overcommit: cfg.settings.overcommit.cpu_ratio,
            memory_overcommit: cfg.settings.overcommit.memory_ratio,
            ..Default::default()
        });
        Ok(Arc::new(ControlPlane {
            cfg,
            registry,
            leases,
            fences,
            runtimes,
            templates,
            trees,
            connector,
            live: StdMutex::new(HashMap::new()),
            key_cache: Default::default(),
            locks,
            last_touch: StdMutex::new(HashMap::new()),
            ready_tx,
            metrics,
            planning,
            pools,
            snapshots,
            nodes,
            reconciler: Default::default(),
            reclaims: Default::default(),
            bootstrap_key_hash: std::sync::RwLock::new(None),
            access_key: tokio::sync::OnceCell::new(),
        }))
    }

    /// The default local runtime (what a create gets unless its class or
    /// request names another).
    pub fn runtime(&self) -> &Arc<dyn Runtime> {
        &self.runtimes.default_runtime().runtime
    }

    pub fn readiness(&self) -> Readiness {
        self.ready_tx.borrow().clone()
    }

    pub fn set_readiness(&self, r: Readiness) {
        self.ready_tx.send_replace(r);
    }

    pub async fn wait_ready(&self) -> Readiness {
        let mut rx = self.ready_tx.subscribe();
        loop {
            let r = rx.borrow_and_update().clone();
            if !matches!(r, Readiness::Preparing(_)) {
                return r;
            }
            if rx.changed().await.is_err() {
                return self.readiness();
            }
        }
    }

    fn ensure_ready(&self) -> Result<(), OpError> {
        match self.readiness() {
            Readiness::Ready => Ok(()),
            Readiness::Preparing(what) => Err(OpError::Unavailable(format!(
                "server is not ready yet: {what}"
            ))),
            Readiness::Failed(why) => Err(OpError::Unavailable(format!(
                "server failed to get ready: {why}"
            ))),
        }
    }

    // ---- authentication -------------------------------------------------

    /// Resolves an API key to its tenant. Keys are stored hashed.
    pub async fn authenticate(&self, key: Option<&str>) -> Result<Caller, OpError> {
        let key = key.ok_or(OpError::Unauthorized)?;
        if key.is_empty() || key.len() > 256 {
            return Err(OpError::Unauthorized);
        }
        let h = hash_key(key);
        if let Some(c) = self.key_cache.get(&h) {
            return Ok(c);
        }
        let epoch = self.key_cache.epoch();
        let rec = self
            .registry
            .find_api_key(&h)
            .await?
            .ok_or(OpError::Unauthorized)?;
        let caller = Caller {
            tenant: rec.tenant,
            admin: rec.admin,
        };
        self.key_cache.insert(h, caller.clone(), epoch);
        Ok(caller)
    }

    /// Creates a key for a tenant (admin only). The plain key is returned once.
    pub async fn create_key(
        &self,
        cx: &OpContext,
        req: CreateKeyRequest,
    ) -> Result<CreatedKey, OpError> {
        cx.require_admin("creating keys")?;
        valid_name("tenant", &req.tenant)?;
        let key = new_api_key();
        self.registry
            .insert_api_key(&hash_key(&key), &req.tenant, req.admin)
            .await?;
        Ok(CreatedKey {
            tenant: req.tenant,
            admin: req.admin,
            key,
        })
    }

    /// Registers the bootstrap admin key: `existing` (the key the server
    /// kept from an earlier start) when given, else a new one. Returns the
    /// key, which the caller stores.
    pub async fn ensure_admin_key(&self, existing: Option<&str>) -> Result<String, OpError> {
        let key = match existing.map(str::trim).filter(|k| !k.is_empty()) {
            Some(k) => k.to_owned(),
            None => new_api_key(),
        };
        let hash = hash_key(&key);
        if self.registry.find_api_key(&hash).await?.is_none() {
            self.registry.insert_api_key(&hash, "default", true).await?;
        }
        *self
            .bootstrap_key_hash
            .write()
            .expect("bootstrap key poisoned") = Some(hash);
        Ok(key)
    }

    // ---- startup ----------------------------------------------------------

    /// Prepares the default template (building it when missing) and registers
    /// every stored template; then marks the server ready.
    pub async fn prepare(
        self: &Arc<Self>,
        progress: impl Fn(&str) + Send + 'static,
    ) -> Result<(), OpError> {
        self.set_readiness(Readiness::Preparing("preparing default template".into()));
        let res = self
            .templates
            .prepare(
                &self.cfg.default_template,
                self.cfg.default_template_source,
                Box::new(progress),
            )
            .await;
        let res = match res {
            Ok(_) => {
                self.set_readiness(Readiness::Preparing(
                    "re-attaching to running sandboxes".into(),
                ));
                match self.sync_templates().await {
                    Ok(()) => self.reconcile_on_start().await,
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        match res {
            Ok(()) => {
                self.set_readiness(Readiness::Ready);
                Ok(())
            }
            Err(e) => {
                // never "preparing" forever: a failed start-up says so
                self.set_readiness(Readiness::Failed(format!("{:#}", anyhow_of(&e))));
                Err(e)
            }
        }
    }

    async fn sync_templates(&self) -> Result<(), OpError> {
        for t in self.templates.list().await? {
            self.registry.upsert_template(&t).await?;
        }
        Ok(())
    }

    /// Re-attaches to sandboxes that survived a restart; marks the ones the
    /// runtime lost, and destroys runtime sandboxes the registry does not know.
    /// One sandbox that cannot be brought back never holds up the others: it
    /// is marked lost (tainted, with an event) and start-up goes on.
    pub async fn reconcile_on_start(&self) -> Result<(), OpError> {
        let records = self.registry.list_sandboxes(None, false).await?;
        let mut actual = Vec::new();
        for rt in self.runtimes.all() {
            for id in rt
                .runtime
                .list()
                .await
                .map_err(OpError::runtime("list the runtime's sandboxes"))?
            {
                actual.push((rt.runtime.clone(), id));
            }
        }
        for rec in &records {
            if let Err(e) = self.reconcile_one(rec, &actual).await {
                tracing::warn!(sandbox.id = %rec.id, error = format!("{:#}", anyhow_of(&e)), "could not reconcile the sandbox after a restart");
                if rec.state.is_live() {
                    let _ = self
                        .mark_lost(&rec.id, crate::lifecycle::LOST_ENVD_GONE, None)
                        .await;
                }
            }
        }
        for (runtime, id) in actual {
            // a sandbox of this runtime the registry does not know (or
            // knows on another runtime) is left over
            if !records
                .iter()
                .any(|r| r.id == id && r.runtime == runtime.name())
            {
                tracing::warn!(sandbox.id = %id, runtime = runtime.name(), "destroying runtime sandbox unknown to the registry");
                let destroyed = runtime.destroy(&id).await;
                // a terminated row whose compute was still here: a destroy
                // answered before a crash, or a reclaim that failed
                if let (Ok(()), Ok(rec)) = (&destroyed, self.registry.get_sandbox(&id).await) {
                    if rec.state.is_terminal() {
                        let _ = self
                            .event(
                                &rec,
                                "compute_reclaimed",
                                None,
                                serde_json::json!({"by": "start-up"}),
                            )
                            .await;
                    }
                }
            }
        }
        Ok(())
    }

    /// Start-up reconciliation of one sandbox.
    async fn reconcile_one(
        &self,
        rec: &SandboxRecord,
        actual: &[(Arc<dyn Runtime>, SandboxId)],
    ) -> Result<(), OpError> {
        // envd calls here are bounded: a hung envd must not hold up start-up
        const ANSWER: Duration = Duration::from_secs(3);
        if rec.node != self.cfg.local_node {
            // on another node (an agent's, or another replica's own): re-attach through its agent when it answers
            if let (Some(n), true) = (self.nodes.get(&rec.node), rec.state.is_live()) {
                let envd = n.runtime.envd(&rec.id);
                if let Ok(Ok(())) =
                    tokio::time::timeout(ANSWER, envd.wait_ready(Duration::from_secs(2))).await
                {
                    let live = self.attach(&rec.id, envd, None);
                    let _ = self.push_fence_or_lose(&rec.id, &live, None).await;
                }
            }
            return Ok(());
        }
        let capable = self.local_runtime(&rec.runtime)?;
        let runtime = capable.runtime.clone();
        let on_runtime = actual
            .iter()
            .any(|(rt, id)| id == &rec.id && rt.name() == rec.runtime);
        match rec.state {
            // no compute: a hibernated sandbox wakes from its snapshot (a
            // crash may have left its old compute behind), a lost one waits
            // for its owner to delete it
            SandboxState::Hibernating => {
                // (a memory checkpoint is the compute it wakes from)
                let checkpointed = match &capable.checkpointable {
                    Some(c) => c.has_checkpoint(&rec.id).await.unwrap_or(false),
                    None => false,
                };
                if on_runtime && !checkpointed {
                    let _ = runtime.destroy(&rec.id).await;
                }
                return Ok(());
            }
            SandboxState::Lost => return Ok(()),
            _ => {}
        }
        let mut status = if on_runtime {
            runtime.status(&rec.id).await.ok()
        } else {
            None
        };
        if rec.state.is_live() && status == Some(aviary_runtime::RuntimeStatus::Paused) {
            if self.paused_on_record(&rec.id).await? {
                // a frozen envd cannot answer; its fence is pushed on resume
                if let Ok(envd) = self.local_envd(rec).await {
                    let live = self.attach(&rec.id, envd, None);
                    live.paused.store(true, std::sync::atomic::Ordering::SeqCst);
                    return Ok(());
                }
            } else if let Some(p) = &capable.pausable {
                // frozen without a pause on record: a snapshot the crash interrupted
                p.resume(&rec.id)
                    .await
                    .map_err(OpError::runtime("thaw after a restart"))?;
                self.event(
                    rec,
                    "thawed",
                    None,
                    serde_json::json!({"reason": "frozen after a restart without a pause on record (interrupted snapshot)"}),
                )
                .await?;
                status = Some(aviary_runtime::RuntimeStatus::Running);
            }
        }
        if rec.state.is_live() && status == Some(aviary_runtime::RuntimeStatus::Running) {
            if let Ok(envd) = self.local_envd(rec).await {
                if let Ok(Ok(())) =
                    tokio::time::timeout(ANSWER, envd.wait_ready(Duration::from_secs(2))).await
                {
                    let live = self.attach(&rec.id, envd, None);
                    // one envd refusing its fence makes one sandbox lost, not the server
                    let _ = self.push_fence_or_lose(&rec.id, &live, None).await;
                    return Ok(());
                }
            }
        }
        if rec.state.is_terminal() {
            return Ok(());
        }
        if rec.state.is_live()
            && !matches!(
                status,
                Some(
                    aviary_runtime::RuntimeStatus::Running | aviary_runtime::RuntimeStatus::Paused
                )
            )
            && rec.tenant != aviary_registry::POOL_TENANT
            && self.last_snapshot(&rec.tenant, &rec.id).await?.is_some()
        {
            // its compute went while the server was down, but its last
            // snapshot can bring it back: lost now, restored by the
            // reconciler's first pass like compute that goes while it runs
            let extra = [
                ("cause", crate::reconciler::CAUSE_COMPUTE_GONE),
                ("found", "at start-up"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), serde_json::Value::String(v.to_owned())))
            .collect();
            self.lose(&rec.id, crate::lifecycle::LOST_COMPUTE_GONE, None, extra)
                .await?;
            return Ok(());
        }
        // Lost: the runtime no longer has it (or it never finished starting).
        let _ = runtime.destroy(&rec.id).await;
        let _ = self.leases.revoke(&rec.id).await;
        let path: &[SandboxState] = if rec.state.can_transition_to(SandboxState::Lost) {
            &[SandboxState::Lost, SandboxState::Terminated]
        } else if rec.state.can_transition_to(SandboxState::Failed) {
            &[SandboxState::Failed, SandboxState::Terminated]
        } else {
            &[SandboxState::Terminated]
        };
        self.registry
            .transition(
                &rec.id,
                rec.version,
                path,
                FenceCheck::Skip,
                ctx(
                    None,
                    Some("reconciled"),
                    serde_json::json!({"reason": "runtime has no such sandbox after restart"}),
                ),
            )
            .await?;
        Ok(())
    }

    /// The envd client of a sandbox on the local runtime, found through the
    /// runtime (never a path built here) and bound to its init's pid.
    async fn local_envd(&self, rec: &SandboxRecord) -> Result<EnvdClient, OpError> {
        let ep = self
            .local_runtime(&rec.runtime)?
            .runtime
            .envd_endpoint(&rec.id)
            .await
            .map_err(OpError::runtime("find the envd endpoint"))?;
        Ok(envd_client(&ep))
    }

    pub(crate) fn attach(
        &self,
        id: &SandboxId,
        envd: EnvdClient,
        allocation_id: Option<i64>,
    ) -> Arc<LiveSandbox> {
        let live = Arc::new(LiveSandbox {
            envd,
            allocation_id: std::sync::atomic::AtomicI64::new(allocation_id.unwrap_or(-1)),
            timed_out: std::sync::atomic::AtomicBool::new(false),
            paused: std::sync::atomic::AtomicBool::new(false),
            active_execs: std::sync::atomic::AtomicUsize::new(0),
            last_activity: StdMutex::new(std::time::Instant::now()),
        });
        self.live
            .lock()
            .expect("live map poisoned")
            .insert(id.clone(), live.clone());
        live
    }

    pub(crate) fn live(&self, id: &SandboxId) -> Result<Arc<LiveSandbox>, OpError> {
        self.live
            .lock()
            .expect("live map poisoned")
            .get(id)
            .cloned()
            .ok_or_else(|| OpError::Unavailable("sandbox runtime is not reachable".into()))
    }

    /// [`Self::live`] for a record. A sandbox on a connected `aviary node`
    /// agent that another replica created is attached here on first use (its
    /// envd already has the current fence; the attach pushes it again, which
    /// changes nothing). A sandbox on a node this control plane does not
    /// drive (another replica's own runtimes) is named as such.
    pub(crate) async fn live_rec(&self, rec: &SandboxRecord) -> Result<Arc<LiveSandbox>, OpError> {
        if !self.drives_node(&rec.node) {
            return Err(OpError::Unavailable(format!(
                "the sandbox runs on node {}, which this replica does not drive \
                 (another replica's own runtimes, or an agent not connected here): \
                 send the request to that replica",
                rec.node
            )));
        }
        if let Some(live) = self.live_opt(&rec.id) {
            return Ok(live);
        }
        match self.nodes.get(&rec.node) {
            Some(node) if rec.state.is_live() => {
                let envd = node.runtime.envd(&rec.id);
                envd.wait_ready(Duration::from_secs(2)).await.map_err(|e| {
                    OpError::Unavailable(format!(
                        "the sandbox's envd on node {} does not answer: {e}",
                        rec.node
                    ))
                })?;
                let live = self.attach(&rec.id, envd, None);
                self.push_fence_or_lose(&rec.id, &live, None).await?;
                Ok(live)
            }
            _ => self.live(&rec.id),
        }
    }

    pub(crate) fn live_opt(&self, id: &SandboxId) -> Option<Arc<LiveSandbox>> {
        self.live
            .lock()
            .expect("live map poisoned")
            .get(id)
            .cloned()
    }

    /// Pushes the lease store's current view of the lease to the sandbox's
    /// envd. Pushes to one envd hold the lock `fence/<id>` and read the view
    /// under it, so a slower push can never overwrite a newer fence.
    pub(crate) async fn push_fence(
        &self,
        id: &SandboxId,
        live: &LiveSandbox,
    ) -> Result<(), OpError> {
        let _pushing = self
            .hold_lock(
                aviary_leases::LockName::new("fence", id.as_str()),
                "fence push",
                FENCE_LOCK_WAIT,
            )
            .await?;
        let current = self.leases.current(id, aviary_core::now()).await?;
        let fence = current.map(|l| l.token.fence());
        // A frozen envd cannot answer, and a thaw before the push would let
        // the previous holder's processes run until envd ends them. So the
        // runtime ends them while they are frozen (they die on the thaw
        // without running again), then: thaw, move the fence, freeze again.
        // A runtime that cannot end them fails the push (the sandbox is
        // then lost, never written to by the old holder).
        // A runtime that cannot pause never froze it: nothing to thaw.
        let frozen_on = if live.paused.load(std::sync::atomic::Ordering::SeqCst) {
            let rec = self.registry.get_sandbox(id).await?;
            self.runtime_for(&rec.node, &rec.runtime)?
                .can_pause()
                .cloned()
        } else {
            None
        };
        let thawed = if let Some(runtime) = frozen_on {
            runtime
                .end_frozen_processes(id)
                .await
                .map_err(OpError::runtime(
                    "end the paused sandbox's processes for a fence move",
                ))?;
            runtime
                .resume(id)
                .await
                .map_err(OpError::runtime("thaw the paused sandbox for a fence move"))?;
            Some(runtime)
        } else {
            None
        };
        let pushed = envd_control("take the fence", || live.envd.set_fence(fence)).await;
        if let Some(runtime) = thawed {
            if let Err(e) = runtime.pause(id).await {
                // reported with the push's own outcome, never instead of it
                tracing::error!(sandbox.id = %id, error = %e, "could not freeze the sandbox again after a fence move");
                live.paused
                    .store(false, std::sync::atomic::Ordering::SeqCst);
            }
        }
        pushed
    }

    /// Kills every process of the sandbox but envd (level-1 reset).
    pub(crate) async fn kill_all(&self, live: &LiveSandbox) -> Result<(), OpError> {
        envd_control("end the sandbox's processes", || live.envd.kill_all()).await
    }

    /// Every attached sandbox (for the background probe).
    pub(crate) fn live_snapshot(&self) -> Vec<(SandboxId, Arc<LiveSandbox>)> {
        self.live
            .lock()
            .expect("live map poisoned")
            .iter()
            .map(|(id, l)| (id.clone(), l.clone()))
            .collect()
    }

    // ---- sandboxes ------------------------------------------------------

    /// The caller's sandbox, or `not_found` (also for other tenants' ids).
    pub(crate) async fn sandbox_for(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<SandboxRecord, OpError> {
        let sid: SandboxId = id
            .parse()
            .map_err(|_| OpError::NotFound(format!("sandbox {id:?}")))?;
        match self.registry.get_sandbox(&sid).await {
            Ok(rec) if rec.tenant == caller.tenant => Ok(rec),
            Ok(_) | Err(aviary_registry::RegistryError::NotFound) => {
                Err(OpError::NotFound(format!("sandbox {id}")))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Any tenant's sandbox, for an admin's cross-tenant view (the caller
    /// was checked to be an admin).
    pub(crate) async fn any_sandbox(&self, id: &str) -> Result<SandboxRecord, OpError> {
        let sid: SandboxId = id
            .parse()
            .map_err(|_| OpError::NotFound(format!("sandbox {id:?}")))?;
        match self.registry.get_sandbox(&sid).await {
            Ok(rec) => Ok(rec),
            Err(aviary_registry::RegistryError::NotFound) => {
                Err(OpError::NotFound(format!("sandbox {id}")))
            }
            Err(e) => Err(e.into()),
        }
    }

    pub(crate) async fn view(&self, rec: &SandboxRecord) -> Result<Sandbox, OpError> {
        let owner = if rec.state.is_terminal() {
            None
        } else {
            self.leases
                .current(&rec.id, aviary_core::now())
                .await?
                .map(|l| l.owner)
        };
        Ok(rec.to_api(owner))
    }

    pub async fn get(&self, cx: &OpContext, req: SandboxRef) -> Result<Sandbox, OpError> {
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        self.view(&rec).await
    }

    /// Any tenant's sandbox, read only: admin keys only (`forbidden` for
    /// any other caller, before anything is read).
    pub async fn get_any_tenant(
        &self,
        cx: &OpContext,
        req: SandboxRef,
    ) -> Result<Sandbox, OpError> {
        cx.require_admin("reading another tenant's sandbox")?;
        let rec = self.any_sandbox(&req.id).await?;
        self.view(&rec).await
    }

    pub async fn list(&self, cx: &OpContext, req: SandboxQuery) -> Result<Vec<Sandbox>, OpError> {
        let tenant = if req.all_tenants {
            cx.require_admin("listing every tenant's sandboxes")?;
            None
        } else {
            Some(cx.caller.tenant.as_str())
        };
        crate::validate::labels(&req.metadata)?;
        let include_terminated =
            req.include_terminated || req.state == Some(SandboxState::Terminated);
        let recs = self
            .registry
            .list_sandboxes(tenant, include_terminated)
            .await?;
        let mut out = Vec::with_capacity(recs.len());
        for r in recs.iter().filter(|r| {
            req.metadata
                .iter()
                .all(|(k, v)| r.metadata.get(k) == Some(v))
                && req.state.is_none_or(|s| r.state == s)
                && req
                    .user_id
                    .as_ref()
                    .is_none_or(|u| r.user_id.as_ref() == Some(u))
                && req
                    .session_id
                    .as_ref()
                    .is_none_or(|u| r.session_id.as_ref() == Some(u))
        }) {
            out.push(self.view(r).await?);
        }
        Ok(out)
    }

    /// Sets when a sandbox expires: `now + ttl_s`, which may shorten its
    /// life. Fenced like every write: a leased sandbox needs its token.
    pub async fn set_ttl(&self, cx: &OpContext, req: SetTtlRequest) -> Result<Sandbox, OpError> {
        if req.ttl_s == 0 || req.ttl_s > self.cfg.max_sandbox_ttl_s {
            return Err(OpError::InvalidRequest(format!(
                "ttl_s must be between 1 and {}",
                self.cfg.max_sandbox_ttl_s
            )));
        }
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        if matches!(rec.state, SandboxState::Terminated | SandboxState::Failed) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it has ended".into(),
            });
        }
        self.check_fence(&rec.id, cx.token).await?;
        let expires_at = aviary_core::now() + time::Duration::seconds(req.ttl_s as i64);
        let rec = self
            .registry
            .set_expiry(&rec.id, rec.version, Some(expires_at))
            .await?;
        self.event(
            &rec,
            "ttl_set",
            cx.request_id(),
            serde_json::json!({"ttl_s": req.ttl_s, "expires_at": rfc3339(expires_at)}),
        )
        .await?;
        self.view(&rec).await
    }

    #[tracing::instrument(skip_all, fields(tenant = %cx.caller.tenant))]
    pub async fn create(
        &self,
        cx: &OpContext,
        req: CreateSandboxRequest,
    ) -> Result<CreateSandboxResponse, OpError> {
        let seed = match &req.from_snapshot {
            Some(snap) => {
                let s = self.load_snapshot(&cx.caller.tenant, snap).await?;
                if req.template.as_ref().is_some_and(|t| *t != s.template) {
                    return Err(OpError::InvalidRequest(format!(
                        "snapshot {snap} was taken on template {:?}; it cannot be restored into {:?}",
                        s.template,
                        req.template.as_deref().unwrap_or_default()
                    )));
                }
                let current = self.template_info(&s.template).await?;
                if current.digest != s.template_digest {
                    return Err(OpError::InvalidRequest(format!(
                        "snapshot {snap} needs template {:?} at {}, which now has {}",
                        s.template, s.template_digest, current.digest
                    )));
                }
                Some(s)
            }
            None => None,
        };
        let mut req = req;
        if let Some(s) = &seed {
            req.template = Some(s.template.clone());
        }
        self.create_seeded(cx, req, seed).await
    }

    /// Create, optionally from a snapshot's layers (fork, restore branch C).
    pub(crate) async fn create_seeded(
        &self,
        cx: &OpContext,
        req: CreateSandboxRequest,
        seed: Option<crate::snapshots::SandboxSnapshot>,
    ) -> Result<CreateSandboxResponse, OpError> {
        self.create_from(cx, req, seed, None).await
    }

    /// A create: empty, seeded from a snapshot (`seed`), or a live fork of
    /// running `live_parent` (its processes and files, on its node; see
    /// `snapshots::fork`).
    pub(crate) async fn create_from(
        &self,
        cx: &OpContext,
        req: CreateSandboxRequest,
        seed: Option<crate::snapshots::SandboxSnapshot>,
        live_parent: Option<&SandboxRecord>,
    ) -> Result<CreateSandboxResponse, OpError> {
        let mut seed = seed;
        let (caller, request_id) = (&cx.caller, cx.request_id());
        self.ensure_ready()?;
        // every surface's create passes here, not only the v1 API's
        crate::validate::create_request(&req)?;
        for (what, v) in [
            ("user_id", &req.user_id),
            ("session_id", &req.session_id),
            ("agent", &req.agent),
        ] {
            if let Some(v) = v {
                valid_name(what, v)?;
            }
        }
        let ttl_s = req.ttl_s.unwrap_or(24 * 3600);
        if ttl_s == 0 || ttl_s > self.cfg.max_sandbox_ttl_s {
            return Err(OpError::InvalidRequest(format!(
                "ttl_s must be between 1 and {}",
                self.cfg.max_sandbox_ttl_s
            )));
        }
        let lease_req = match &req.lease {
            Some(l) => {
                valid_name("lease owner", &l.owner)?;
                Some((l.owner.clone(), self.lease_ttl(l.ttl_s)?))
            }
            None => None,
        };
        let template_name = req
            .template
            .clone()
            .unwrap_or_else(|| self.cfg.default_template.clone());
        valid_name("template", &template_name)?;
        let template = self.template_info(&template_name).await?;
        // the image's environment counts against the same bounds
        crate::validate::sandbox_env(&exec_env(&template, &req))?;
        let scope =
            aviary_reuse::effective_scope(req.scope.unwrap_or_default(), req.user_id.as_deref());

        let approved = self.decide(cx, &req).await?;
        let class = approved.class.clone();
        let resources = approved.limits;
        let network = approved.network;
        let expires_at = aviary_core::now() + time::Duration::seconds(ttl_s as i64);
        let mut lease_req = lease_req;
        let mut new_decision = None;
        // the checker's `fork_clean_snapshot`: the decision is final as it is
        let mut forked = false;
        let bucket = if seed.is_some() || live_parent.is_some() {
            None
        } else {
            self.bucket_of(caller, &req, scope)?
        };
        let _guard = match &bucket {
            Some(b) => Some(self.bucket_guard(b).await?),
            None => None,
        };
        let mut stage = CreateStage {
            cx,
            req: &req,
            approved: &approved,
            template: &template,
            scope,
            expires_at,
            lease_req: lease_req.clone(),
        };
        if let Some(b) = &bucket {
            match self.reuse_in_bucket(&stage, b).await? {
                crate::scopes::BucketOutcome::Reused(resp) => return Ok(*resp),
                crate::scopes::BucketOutcome::New(d) => new_decision = Some(d),
                crate::scopes::BucketOutcome::Fork(snap, d) => {
                    if snap.template_digest != template.digest {
                        new_decision = Some(Decision {
                            action: "new_sandbox".into(),
                            branch: "D".into(),
                            reason: format!(
                                "the scope's clean checkpoint {} was taken on template {} at {}, which now has {}",
                                snap.id, snap.template, snap.template_digest, template.digest
                            ),
                            score: 0.0,
                        });
                    } else {
                        seed = Some(*snap);
                        new_decision = Some(d);
                        forked = true;
                    }
                }
            }
            if lease_req.is_none() && scope != Scope::Session {
                // shared scopes hand out their sandbox under a lease
                lease_req = Some((
                    format!("scope:{b}"),
                    Duration::from_secs(self.cfg.default_lease_ttl_s),
                ));
                stage.lease_req = lease_req.clone();
            }
        }
        // from here on the create adds a sandbox: it must fit the quota,
        // counted under a lock held until its row exists
        let mut quota = Some(self.quota_stage(cx, &approved).await?);
        if seed.is_some() || live_parent.is_some() {
            // a fork restores into fresh layers: no pooled sandbox fits
        } else if let Some(hit) = self.try_pool(&stage, &mut quota).await? {
            return Ok(hit);
        }
        let id = SandboxId::generate();
        let now = aviary_core::now();
        // a fork's layers are restored on this host: it runs here
        let placement = self
            .place(crate::nodes::PlaceRequest {
                tenant: &caller.tenant,
                class: &class,
                limits: resources,
                template_digest: &template.digest,
                runtime: &approved.runtime,
                on: if let Some(parent) = live_parent {
                    // a live fork runs beside its parent's memory image
                    crate::nodes::PlaceOn::Node(&parent.node)
                } else if seed.is_some() {
                    crate::nodes::PlaceOn::Stageable
                } else {
                    crate::nodes::PlaceOn::Any
                },
                request_id,
            })
            .await?;
        let node = placement.node.clone();
        let new = NewSandbox {
            id: id.clone(),
            tenant: caller.tenant.clone(),
            user_id: req.user_id.clone(),
            session_id: req.session_id.clone(),
            agent: req.agent.clone(),
            scope,
            resource_class: class.clone(),
            resources,
            template: template.name.clone(),
            template_digest: template.digest.clone(),
            runtime: approved.runtime.clone(),
            runtime_instance_id: None,
            node: node.clone(),
            network_profile: network,
            expires_at: Some(now + time::Duration::seconds(ttl_s as i64)),
            tainted: false,
            user_managed: req.user_managed,
            metadata: req.metadata.clone(),
            env: network_env(exec_env(&template, &req), &approved),
            run_as: template.defaults.user.clone(),
            workdir: req
                .workdir
                .clone()
                .or_else(|| template.defaults.working_dir.clone()),
        };
        let rec = self
            .registry
            .insert_sandbox(
                &new,
                ctx(
                    request_id,
                    Some("created"),
                    serde_json::json!({"class": class, "template": template.name}),
                ),
            )
            .await?;
        // the row now counts as committed on its node and against the quota
        drop(placement);
        drop(quota);
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
                ctx(
                    request_id,
                    None,
                    serde_json::json!({
                        "resource_class": class,
                        "recommended_class": approved.allocation.recommended_class,
                        "source": approved.allocation.source,
                        "reason": approved.reason,
                        "placement": "local",
                    }),
                ),
            )
            .await?;
        self.metrics.inc_create();
        self.record_plan(&rec, &approved, request_id).await?;
        let mut allocation = approved.allocation.clone();
        allocation.sandbox_id = Some(id.clone());
        let allocation_id = Some(self.registry.insert_allocation(&allocation).await?);

        let egress = self.egress_named(network, Some(&approved.network_name))?;
        let spec = self.sandbox_spec(&id, &template, resources, network, egress);
        if let Some(snap) = &seed {
            if let Err(e) = self.stage_seed(snap, &rec).await {
                self.fail_sandbox(&id, request_id, &e).await;
                return Err(e);
            }
        }
        let started = match live_parent {
            Some(parent) => {
                self.start_live_fork(&spec, rec, parent, allocation_id, request_id)
                    .await
            }
            None => {
                self.start_runtime(&spec, rec, lease_req, allocation_id, request_id)
                    .await
            }
        };
        match started {
            Ok((rec, lease)) => {
                let sandbox = self.view(&rec).await?;
                if forked {
                    if let (Some(snap), Some(d)) = (&seed, &new_decision) {
                        self.event(
                            &rec,
                            "restore_branch",
                            request_id,
                            serde_json::json!({"branch": "C", "action": d.action, "snapshot": snap.id,
                                               "from_sandbox": snap.sandbox_id, "reason": d.reason}),
                        )
                        .await?;
                    }
                }
                Ok(CreateSandboxResponse {
                    sandbox,
                    decision: match new_decision {
                        Some(d) if forked => d,
                        Some(mut d) => {
                            d.reason = format!(
                                "cold create; {}; class {class}: {}",
                                d.reason, approved.reason
                            );
                            d
                        }
                        None => Decision {
                            action: "new_sandbox".into(),
                            branch: "D".into(),
                            reason: format!("cold create; class {class}: {}", approved.reason),
                            score: 0.0,
                        },
                    },
                    lease,
                })
            }
            Err(e) => {
                self.fail_sandbox(&id, request_id, &e).await;
                Err(e)
            }
        }
    }

    /// The runtime spec of a sandbox: the template as read-only lower
    /// layer and the static envd as PID 1.
    pub(crate) fn sandbox_spec(
        &self,
        id: &SandboxId,
        template: &TemplateRecord,
        resources: aviary_core::ResourceLimits,
        network: aviary_core::NetworkProfile,
        egress: Option<aviary_core::egress::EgressPolicy>,
    ) -> SandboxSpec {
        SandboxSpec {
            id: id.clone(),
            template: aviary_runtime::TemplateRef {
                name: template.name.clone(),
                digest: template.digest.clone(),
            },
            resources,
            network,
            egress,
            hostname: "sandbox".into(),
            init: vec![
                ENVD_IN_SANDBOX.into(),
                ENVD_INIT_ARGS[0].into(),
                ENVD_INIT_ARGS[1].into(),
            ],
            env: vec![
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
                "HOME=/root".into(),
                "LANG=C.UTF-8".into(),
            ],
            binds: vec![BindMount {
                host: self.cfg.envd_binary.clone(),
                sandbox: ENVD_IN_SANDBOX.into(),
                read_only: true,
            }],
        }
    }

    pub(crate) async fn fail_pooled(&self, id: &SandboxId, cause: &OpError) {
        self.fail_sandbox(id, None, cause).await;
    }

    pub(crate) async fn destroy_pooled(&self, rec: SandboxRecord) -> Result<Sandbox, OpError> {
        self.destroy_unattended(rec, "pool trimmed").await
    }

    /// Destroys a sandbox for the platform's own reason (no lease check).
    pub(crate) async fn destroy_unattended(
        &self,
        rec: SandboxRecord,
        why: &str,
    ) -> Result<Sandbox, OpError> {
        self.destroy(rec, FenceCheck::Skip, None, why).await
    }

    /// Hands out a warm pooled sandbox when a pool matches the approved
    /// class, template and runtime.
    async fn try_pool(
        &self,
        stage: &CreateStage<'_>,
        quota: &mut Option<crate::planning::QuotaHold>,
    ) -> Result<Option<CreateSandboxResponse>, OpError> {
        let CreateStage {
            cx,
            req,
            approved,
            template,
            scope,
            expires_at,
            ..
        } = *stage;
        let (caller, request_id) = (&cx.caller, cx.request_id());
        let lease_req = stage.lease_req.clone();
        let Some(pool) = self
            .pools
            .find(&approved.class, &template.name, &approved.runtime)
        else {
            return Ok(None);
        };
        if approved.network != aviary_core::NetworkProfile::None {
            return Ok(None);
        }
        let claim = aviary_registry::SandboxClaim {
            tenant: caller.tenant.clone(),
            user_id: req.user_id.clone(),
            session_id: req.session_id.clone(),
            agent: req.agent.clone(),
            scope,
            expires_at: Some(expires_at),
            user_managed: req.user_managed,
            metadata: req.metadata.clone(),
            env: exec_env(template, req),
            run_as: template.defaults.user.clone(),
            workdir: req
                .workdir
                .clone()
                .or_else(|| template.defaults.working_dir.clone()),
        };
        let Some(rec) = self.claim_pooled(pool, &claim, request_id).await? else {
            return Ok(None);
        };
        // the claimed row counts against the quota now
        drop(quota.take());
        self.record_plan(&rec, approved, request_id).await?;
        let id = rec.id.clone();
        let mut allocation = approved.allocation.clone();
        allocation.sandbox_id = Some(id.clone());
        let alloc_id = self.registry.insert_allocation(&allocation).await?;
        let live = self.live(&id)?;
        live.allocation_id
            .store(alloc_id, std::sync::atomic::Ordering::Relaxed);
        // host files may have changed while it waited in the pool
        if let Err(e) = self.sync_projection(&id, &live).await {
            self.fail_sandbox(&id, request_id, &e).await;
            return Err(e);
        }
        self.metrics.inc_create();
        match self
            .finish_lock(rec, &live, &[], lease_req, request_id)
            .await
        {
            Ok((rec, lease)) => Ok(Some(CreateSandboxResponse {
                sandbox: self.view(&rec).await?,
                decision: Decision {
                    action: "new_sandbox".into(),
                    branch: "D".into(),
                    reason: format!(
                        "warm pool hit; class {}: {}",
                        approved.class, approved.reason
                    ),
                    score: 0.0,
                },
                lease,
            })),
            Err(e) => {
                self.fail_sandbox(&id, request_id, &e).await;
                Err(e)
            }
        }
    }

    pub(crate) fn forget_live(&self, id: &SandboxId) {
        self.live.lock().expect("live map poisoned").remove(id);
        self.last_touch
            .lock()
            .expect("touch map poisoned")
            .remove(id);
    }

    pub(crate) async fn template_info(&self, name: &str) -> Result<TemplateRecord, OpError> {
        self.templates
            .get(name)
            .await?
            .ok_or_else(|| OpError::InvalidRequest(format!("unknown template {name:?}")))
    }

    fn lease_ttl(&self, ttl_s: Option<u64>) -> Result<Duration, OpError> {
        let t = ttl_s.unwrap_or(self.cfg.default_lease_ttl_s);
        if t == 0 || t > self.cfg.max_lease_ttl_s {
            return Err(OpError::InvalidRequest(format!(
                "lease ttl_s must be between 1 and {}",
                self.cfg.max_lease_ttl_s
            )));
        }
        Ok(Duration::from_secs(t))
    }

    async fn start_runtime(
        &self,
        spec: &SandboxSpec,
        rec: SandboxRecord,
        lease_req: Option<(String, Duration)>,
        allocation_id: Option<i64>,
        request_id: Option<&str>,
    ) -> Result<(SandboxRecord, Option<Lease>), OpError> {
        let (rec, live) = self.provision(spec, rec, allocation_id).await?;
        self.finish_lock(rec, &live, &[SandboxState::Locking], lease_req, request_id)
            .await
    }

    /// Starts the sandbox's compute and waits for its envd (state stays
    /// `Provisioning`; the runtime instance is recorded).
    pub(crate) async fn provision(
        &self,
        spec: &SandboxSpec,
        rec: SandboxRecord,
        allocation_id: Option<i64>,
    ) -> Result<(SandboxRecord, Arc<LiveSandbox>), OpError> {
        let runtime = self.runtime_for(&rec.node, &rec.runtime)?;
        let handle = runtime
            .create(spec)
            .await
            .map_err(OpError::runtime("runtime could not create the sandbox"))?;
        self.attach_compute(&handle, rec, allocation_id).await
    }

    /// Attaches new compute (a create, or a restore of a memory
    /// checkpoint): waits for its envd, records the runtime instance.
    pub(crate) async fn attach_compute(
        &self,
        handle: &aviary_runtime::SandboxHandle,
        rec: SandboxRecord,
        allocation_id: Option<i64>,
    ) -> Result<(SandboxRecord, Arc<LiveSandbox>), OpError> {
        let id = &handle.id;
        let envd = match self.nodes.get(&rec.node) {
            Some(n) => n.runtime.envd(id),
            None => envd_client(&handle.envd_endpoint()),
        };
        envd.wait_ready(Duration::from_secs(10))
            .await
            .map_err(|e| {
                OpError::Internal(
                    anyhow::Error::new(e).context("envd did not come up in the sandbox"),
                )
            })?;
        let live = self.attach(id, envd, allocation_id);
        self.sync_projection(id, &live).await?;
        let mut rec = self
            .registry
            .set_runtime_instance(id, rec.version, &handle.runtime_instance_id, &rec.node)
            .await?;
        if rec.paused {
            // new compute (a wake, a recovery) runs: nothing of it is frozen
            rec = self.registry.set_paused(id, rec.version, false).await?;
        }
        Ok((rec, live))
    }

    /// Takes the lease if asked for and settles the sandbox in `Leased` or
    /// `Idle`, walking `prefix` first.
    pub(crate) async fn finish_lock(
        &self,
        rec: SandboxRecord,
        live: &LiveSandbox,
        prefix: &[SandboxState],
        lease_req: Option<(String, Duration)>,
        request_id: Option<&str>,
    ) -> Result<(SandboxRecord, Option<Lease>), OpError> {
        let id = &rec.id;
        let mut path = prefix.to_vec();
        match lease_req {
            Some((owner, ttl)) => {
                let lease = self
                    .leases
                    .acquire(id, &owner, ttl, aviary_core::now())
                    .await?;
                self.push_fence(id, live).await?;
                path.push(SandboxState::Leased);
                let rec = self
                    .registry
                    .transition(
                        id,
                        rec.version,
                        &path,
                        FenceCheck::Skip,
                        ctx(
                            request_id,
                            None,
                            serde_json::json!({"lease_owner": owner, "fence": lease.token.fence()}),
                        ),
                    )
                    .await?;
                Ok((rec, Some(lease)))
            }
            None => {
                path.push(SandboxState::Idle);
                let rec = self
                    .registry
                    .transition(
                        id,
                        rec.version,
                        &path,
                        FenceCheck::Skip,
                        ctx(request_id, None, serde_json::json!({})),
                    )
                    .await?;
                Ok((rec, None))
            }
        }
    }

    /// Records a failed create and removes whatever the runtime made.
    async fn fail_sandbox(&self, id: &SandboxId, request_id: Option<&str>, cause: &OpError) {
        tracing::warn!(sandbox.id = %id, error = format!("{:#}", anyhow_of(cause)), "create failed");
        self.live.lock().expect("live map poisoned").remove(id);
        let rec = self.registry.get_sandbox(id).await;
        let (node, runtime) = rec
            .as_ref()
            .map(|r| (r.node.as_str(), r.runtime.as_str()))
            .unwrap_or((self.cfg.local_node.as_str(), self.runtime().name()));
        let destroy = self.destroy_compute(node, runtime, id).await;
        let _ = self.leases.revoke(id).await;
        if let Ok(rec) = rec {
            let path: &[SandboxState] = if rec.state.can_transition_to(SandboxState::Failed) {
                &[SandboxState::Failed, SandboxState::Terminated]
            } else {
                &[SandboxState::Terminated]
            };
            let mut meta = serde_json::json!({"error": cause.public_message()});
            if let Err(d) = &destroy {
                // cleanup failure is reported together with the original one
                meta["cleanup_error"] = serde_json::Value::String(format!("{:#}", anyhow_of(d)));
            }
            let _ = self
                .registry
                .transition(
                    id,
                    rec.version,
                    path,
                    FenceCheck::Skip,
                    ctx(request_id, Some("create_failed"), meta),
                )
                .await;
        }
    }

    #[tracing::instrument(skip_all, fields(sandbox.id = %req.id))]
    pub async fn delete(&self, cx: &OpContext, req: SandboxRef) -> Result<Sandbox, OpError> {
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        let fence = self.client_fence(&rec.id, cx.token).await?;
        self.destroy(rec, fence, cx.request_id(), "deleted").await
    }

    /// Removes a sandbox's compute from the runtime of its node.
    async fn destroy_compute(
        &self,
        node: &str,
        runtime: &str,
        id: &SandboxId,
    ) -> Result<(), OpError> {
        self.runtime_for(node, runtime)?
            .destroy(id)
            .await
            .map_err(OpError::runtime("runtime teardown"))
    }

    /// Sanitizing → Terminated, answered once the sandbox is out of reach
    /// (lease revoked, envd client forgotten, network cut); its compute is
    /// reclaimed in the background (`reclaim`).
    async fn destroy(
        &self,
        rec: SandboxRecord,
        fence: FenceCheck,
        request_id: Option<&str>,
        why: &str,
    ) -> Result<Sandbox, OpError> {
        let id = rec.id.clone();
        let rec = if rec.state.can_transition_to(SandboxState::Sanitizing) {
            self.registry
                .transition(
                    &id,
                    rec.version,
                    &[SandboxState::Sanitizing],
                    fence,
                    ctx(request_id, None, serde_json::json!({"reason": why})),
                )
                .await?
        } else if rec.state.can_transition_to(SandboxState::Terminated) {
            if let FenceCheck::Require(t) = fence {
                self.check_fence(&id, t).await?;
            }
            rec
        } else {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it cannot be deleted".into(),
            });
        };
        let live = self.live.lock().expect("live map poisoned").remove(&id);
        self.last_touch
            .lock()
            .expect("touch map poisoned")
            .remove(&id);
        let usage = live.as_ref().map(|l| crate::reclaim::UsageTarget {
            allocation_id: l.allocation_id.load(std::sync::atomic::Ordering::Relaxed),
            timed_out: l.timed_out.load(std::sync::atomic::Ordering::Relaxed),
        });
        let mut meta = serde_json::json!({"reason": why});
        let runtime = self.runtime_for(&rec.node, &rec.runtime);
        match &runtime {
            Ok(rt) => {
                if let Some(u) = &usage {
                    crate::reclaim::record_usage(&*self.registry, &**rt, &rec, u).await;
                }
                if let Err(e) = rt.quiesce(&id).await {
                    // the background destroy cuts it again, and the rest
                    meta["cleanup_error"] = serde_json::Value::String(format!("{e:#}"));
                }
            }
            Err(e) => {
                meta["cleanup_error"] = serde_json::Value::String(format!("{:#}", anyhow_of(e)));
            }
        }
        self.leases.revoke(&id).await?;
        if runtime.is_ok() {
            // before the row says terminated: no reconciler pass sees its
            // compute as a leftover while the reclaim is on its way
            self.reclaims.begin(&id);
            meta["compute"] = serde_json::Value::String("reclaiming".into());
        }
        let terminated = self
            .registry
            .transition(
                &id,
                rec.version,
                &[SandboxState::Terminated],
                FenceCheck::Skip,
                ctx(request_id, None, meta),
            )
            .await;
        // the lease is gone and envd forgotten: the compute goes whatever
        // the registry answered (a row left in Sanitizing is settled by
        // start-up reconciliation)
        let runtime = match runtime {
            Ok(rt) => rt,
            Err(e) => {
                // terminated, its compute out of reach here: the node's
                // reconciliation destroys it when it answers
                self.metrics.inc_destroy();
                terminated?;
                return Err(e);
            }
        };
        self.reclaims.spawn(
            rec,
            runtime.shared(),
            self.registry.clone(),
            self.pools.refill.clone(),
        );
        let rec = terminated?;
        self.metrics.inc_destroy();
        self.view(&rec).await
    }

    /// The fence check a client-initiated registry write carries: the
    /// lease checked now against the coordination store, and the write then
    /// re-checked against the durable counter in the same transaction
    /// ([`FenceCheck::Counter`]), so a lease granted in between (on any
    /// replica, through any lease store) fences the write out.
    pub(crate) async fn client_fence(
        &self,
        id: &SandboxId,
        token: Option<LeaseToken>,
    ) -> Result<FenceCheck, OpError> {
        let fence = self
            .token_checked(id, self.leases.check(id, token, aviary_core::now()).await)
            .await?;
        let counter = match fence {
            aviary_leases::Fence::Leased(_) => 0,
            aviary_leases::Fence::Unleased => self.fences.current_fence(id).await?,
        };
        Ok(FenceCheck::after(fence, counter))
    }

    pub(crate) async fn check_fence(
        &self,
        id: &SandboxId,
        token: Option<LeaseToken>,
    ) -> Result<(), OpError> {
        let checked = self.leases.check(id, token, aviary_core::now()).await;
        self.token_checked(id, checked).await.map(|_| ())
    }

    /// A lease store's answer about a token the caller presented: a stale
    /// or foreign token taints the sandbox (its presenter is not who holds
    /// it now), then the refusal is answered as it is.
    pub(crate) async fn token_checked<T>(
        &self,
        id: &SandboxId,
        r: Result<T, aviary_leases::LeaseError>,
    ) -> Result<T, OpError> {
        let r = r.map_err(OpError::from);
        if matches!(r, Err(OpError::StaleToken | OpError::LeaseRequired)) {
            self.metrics.inc_fence_refusal();
        }
        if matches!(r, Err(OpError::StaleToken)) {
            self.taint_or_log(
                id,
                crate::taint::TaintCause::StaleToken,
                "a stale or foreign lease token was presented",
                None,
            )
            .await;
        }
        r
    }

    /// A sandbox that can run commands, with the context's fence checked.
    pub(crate) async fn writable(
        &self,
        cx: &OpContext,
        id: &str,
    ) -> Result<(SandboxRecord, Arc<LiveSandbox>), OpError> {
        let rec = self
            .sandbox_for(&cx.caller, id)
            .instrument(tracing::trace_span!("exec.lookup"))
            .await?;
        Self::running(&rec)?;
        self.check_fence(&rec.id, cx.token)
            .instrument(tracing::trace_span!("exec.fence"))
            .await?;
        let live = self
            .live_rec(&rec)
            .instrument(tracing::trace_span!("exec.live"))
            .await?;
        Self::not_paused(&rec, &live)?;
        Ok((rec, live))
    }

    /// A sandbox that can run commands; a lost one says so (`sandbox_lost`).
    pub(crate) fn running(rec: &SandboxRecord) -> Result<(), OpError> {
        match rec.state {
            s if s.is_live() => Ok(()),
            SandboxState::Lost => Err(OpError::SandboxLost(format!(
                "sandbox {} is lost (its envd is gone or refused its lease fence); delete it and create a new one",
                rec.id
            ))),
            s => Err(OpError::InvalidState {
                state: s,
                what: "it is not running".into(),
            }),
        }
    }

    fn not_paused(rec: &SandboxRecord, live: &LiveSandbox) -> Result<(), OpError> {
        if live.paused.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "it is paused; resume it first".into(),
            });
        }
        Ok(())
    }

    pub(crate) async fn readable(
        &self,
        cx: &OpContext,
        id: &str,
    ) -> Result<(SandboxRecord, Arc<LiveSandbox>), OpError> {
        let rec = self.sandbox_for(&cx.caller, id).await?;
        Self::running(&rec)?;
        let live = self.live_rec(&rec).await?;
        Self::not_paused(&rec, &live)?;
        Ok((rec, live))
    }

    // ---- exec -------------------------------------------------------------

    pub(crate) fn exec_spec(req: &ExecRequest) -> Result<ExecSpec, OpError> {
        let argv = match (&req.cmd, &req.shell) {
            (Some(cmd), None) if !cmd.is_empty() => cmd.clone(),
            (None, Some(sh)) => vec!["/bin/sh".into(), "-c".into(), sh.clone()],
            _ => {
                return Err(OpError::InvalidRequest(
                    "exactly one of `cmd` (non-empty argv) and `shell` is required".into(),
                ))
            }
        };
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(OpError::InvalidRequest(
                "arguments must not contain NUL".into(),
            ));
        }
        if let Some(cwd) = &req.cwd {
            check_sandbox_path(cwd)?;
        }
        for k in req.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(OpError::InvalidRequest(format!("invalid env name {k:?}")));
            }
        }
        let timeout = match req.timeout_s {
            None => None,
            Some(t) if t > 0.0 && t <= 86_400.0 => Some(Duration::from_secs_f64(t)),
            Some(_) => {
                return Err(OpError::InvalidRequest(
                    "timeout_s must be > 0 and at most 86400".into(),
                ))
            }
        };
        Ok(ExecSpec {
            argv,
            cwd: req.cwd.clone(),
            env: req
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            stdin: req.stdin.as_ref().map(|s| s.as_bytes().to_vec()),
            timeout,
            user: Default::default(),
        })
    }

    /// Starts a command; the caller drains the stream and hands the exit to
    /// [`Self::exec_finish`]. Fenced by the context's token (the request's
    /// `token` field is the HTTP body's, moved into the context there).
    pub async fn exec_start(
        &self,
        cx: &OpContext,
        req: OnSandbox<ExecRequest>,
    ) -> Result<ExecRun, OpError> {
        self.exec_start_with(cx, req, None).await
    }

    /// [`Self::exec_start`] with the process's stdin streamed from `stdin`
    /// (bytes, forwarded as they arrive; the request's own `stdin` must be
    /// absent).
    pub async fn exec_start_piped(
        &self,
        cx: &OpContext,
        req: OnSandbox<ExecRequest>,
        stdin: aviary_envd_proto::StdinSource,
    ) -> Result<ExecRun, OpError> {
        if req.request.stdin.is_some() {
            return Err(OpError::InvalidRequest(
                "give stdin either in the request or as the streamed part, not both".into(),
            ));
        }
        self.exec_start_with(cx, req, Some(stdin)).await
    }

    async fn exec_start_with(
        &self,
        cx: &OpContext,
        req: OnSandbox<ExecRequest>,
        stdin: Option<aviary_envd_proto::StdinSource>,
    ) -> Result<ExecRun, OpError> {
        let mut spec = Self::exec_spec(&req.request)?;
        let (rec, live) = self.writable(cx, &req.id).await?;
        // (read after the row, not beside it: on this 2-core class of host
        // the two reads at once took longer than one after the other;
        // BENCHMARKS.md, exec path)
        let venv = self
            .active_venv(&rec.id)
            .instrument(tracing::trace_span!("exec.venv"))
            .await;
        if let Some(venv) = venv? {
            // the task's fresh venv (a `new_venv` hand-out) comes first,
            // unless the caller set these variables itself
            for (k, v) in venv.exec_env(aviary_envd_proto::DEFAULT_PATH) {
                if !spec.env.iter().any(|(have, _)| *have == k) {
                    spec.env.push((k, v));
                }
            }
        }
        // the sandbox's defaults (create, then the template's image config),
        // under the exec's own
        for (k, v) in &rec.env {
            if !spec.env.iter().any(|(name, _)| name == k) {
                spec.env.push((k.clone(), v.clone()));
            }
        }
        if spec.cwd.is_none() {
            spec.cwd = rec.workdir.clone();
        }
        spec.user = rec.run_as.clone();
        let runtime = self.runtime_for(&rec.node, &rec.runtime)?;
        let oom_before = runtime
            .oom_kills(&rec.id)
            .instrument(tracing::trace_span!("exec.usage"))
            .await
            .ok();
        let started = async {
            match stdin {
                Some(stdin) => {
                    live.envd
                        .exec_piped(spec, stdin, cx.token.map(|t| t.fence()))
                        .await
                }
                None => live.envd.exec(spec, cx.token.map(|t| t.fence())).await,
            }
        }
        .instrument(tracing::trace_span!("exec.envd_start"))
        .await;
        let stream = self.via_envd(&rec, &live, started).await?;
        self.metrics.inc_exec();
        Ok(ExecRun {
            id: rec.id,
            stream,
            oom_before,
            runtime: runtime.shared(),
            busy: ExecGuard::new(live.clone()),
            shared: rec.scope != Scope::Session && rec.tenant != aviary_registry::POOL_TENANT,
        })
    }

    /// Finishes an exec: the sandbox's activity is recorded, and the answer
    /// is whether the exit was an OOM kill (from the sandbox's cgroup).
    pub async fn exec_finish(&self, run: &ExecRun, exit: &aviary_envd_proto::ExitInfo) -> bool {
        let oom = self.exec_oom(run, exit).await;
        self.touch_lazily(&run.id);
        // a limit that was hit shows as a failed command: only then is the
        // runtime asked (an agent's usage is a network round trip)
        if run.shared && exit.exit_code != 0 {
            self.limits_hit(run, oom).await;
        }
        oom
    }

    /// A shared sandbox whose exec ended in an OOM kill or with its disk
    /// full is tainted: the next caller would inherit a broken state.
    async fn limits_hit(&self, run: &ExecRun, oom: bool) {
        use crate::taint::TaintCause;
        if oom {
            self.taint_or_log(
                &run.id,
                TaintCause::MemoryLimit,
                "an exec was OOM-killed while the sandbox was shared",
                None,
            )
            .await;
        }
        if let Ok(u) = run.runtime.usage(&run.id).await {
            if u.disk_free_bytes.is_some_and(|free| free < DISK_FULL_BYTES) {
                self.taint_or_log(
                    &run.id,
                    TaintCause::DiskLimit,
                    "its disk was full after an exec while the sandbox was shared",
                    None,
                )
                .await;
            }
        }
    }

    /// OOM attribution of an exec's exit; a timeout is noted for telemetry.
    async fn exec_oom(&self, run: &ExecRun, exit: &aviary_envd_proto::ExitInfo) -> bool {
        let (run_id, oom_before) = (&run.id, run.oom_before);
        if exit.timed_out {
            if let Some(l) = self.live_opt(run_id) {
                l.timed_out
                    .store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        // A process the kernel OOM-kills dies of SIGKILL, but a shell running
        // it reports 137 as a plain exit: trust the cgroup's counter instead.
        if exit.exit_code == 0 {
            return false;
        }
        match (oom_before, run.runtime.oom_kills(run_id).await) {
            (Some(b), Ok(after)) => after > b,
            _ => false,
        }
    }

    /// Writes one event row: the single path for events that are not
    /// state transitions (those are written by `Registry::transition`).
    pub(crate) async fn record_event(
        &self,
        tenant: &str,
        sandbox_id: Option<&SandboxId>,
        state: Option<SandboxState>,
        event_type: &str,
        request_id: Option<&str>,
        metadata: serde_json::Value,
    ) -> Result<(), OpError> {
        self.registry
            .append_event(NewEvent {
                sandbox_id: sandbox_id.cloned(),
                tenant: tenant.to_owned(),
                event_type: event_type.to_owned(),
                old_state: state,
                new_state: state,
                request_id: request_id.map(str::to_owned),
                metadata,
            })
            .await?;
        Ok(())
    }

    /// An event about a sandbox that leaves its state as it is.
    /// The planner's reasoning for a create that carried a task context, as
    /// the sandbox's `planned` event (its trace: each planner tried, what it
    /// answered, how long it took; the recommendation and the approved class).
    async fn record_plan(
        &self,
        rec: &SandboxRecord,
        approved: &crate::planning::Approved,
        request_id: Option<&str>,
    ) -> Result<(), OpError> {
        let Some(trace) = &approved.planner_trace else {
            return Ok(());
        };
        let a = &approved.allocation;
        self.event(
            rec,
            "planned",
            request_id,
            serde_json::json!({
                "task_id": a.task_id,
                "recommended_class": a.recommended_class,
                "approved_class": approved.class,
                "source": a.source,
                "confidence": a.confidence,
                "reason": approved.reason,
                "trace": trace,
            }),
        )
        .await
    }

    pub(crate) async fn event(
        &self,
        rec: &SandboxRecord,
        event_type: &str,
        request_id: Option<&str>,
        metadata: serde_json::Value,
    ) -> Result<(), OpError> {
        self.record_event(
            &rec.tenant,
            Some(&rec.id),
            Some(rec.state),
            event_type,
            request_id,
            metadata,
        )
        .await
    }

    /// Records activity on a sandbox without a registry write per exec.
    pub(crate) fn touch_lazily(&self, id: &SandboxId) {
        let now = std::time::Instant::now();
        {
            let mut m = self.last_touch.lock().expect("touch map poisoned");
            if m.get(id)
                .is_some_and(|t| now.duration_since(*t) < Duration::from_secs(5))
            {
                return;
            }
            m.insert(id.clone(), now);
        }
        let reg = self.registry.clone();
        let id = id.clone();
        tokio::spawn(async move {
            if let Err(e) = reg.touch(&id, aviary_core::now()).await {
                tracing::debug!(sandbox.id = %id, error = %e, "could not record activity");
            }
        });
    }

    /// Runs a command to completion; output is capped at `exec_output_cap`
    /// per stream (`truncated` says so), the rest is drained, not buffered.
    pub async fn exec(
        &self,
        cx: &OpContext,
        req: OnSandbox<ExecRequest>,
    ) -> Result<ExecResult, OpError> {
        async {
            let mut run = self.exec_start(cx, req).await?;
            self.exec_collect(&mut run)
                .instrument(tracing::trace_span!("exec.envd_wait"))
                .await
        }
        .instrument(tracing::trace_span!("exec.op"))
        .await
    }

    /// Drains a started exec's output (capped) to its exit.
    async fn exec_collect(&self, run: &mut ExecRun) -> Result<ExecResult, OpError> {
        let cap = self.cfg.exec_output_cap;
        let (mut out, mut err, mut truncated) = (Vec::new(), Vec::new(), false);
        loop {
            let event = match run.stream.next().await {
                Ok(ev) => ev,
                Err(e) => {
                    let rec = self.registry.get_sandbox(&run.id).await?;
                    return Err(self.envd_failed(&rec, &run.busy.0, e).await);
                }
            };
            match event {
                aviary_envd_proto::ExecEvent::Stdout(d) => {
                    append_capped(&mut out, &d, cap, &mut truncated)
                }
                aviary_envd_proto::ExecEvent::Stderr(d) => {
                    append_capped(&mut err, &d, cap, &mut truncated)
                }
                aviary_envd_proto::ExecEvent::Exit(exit) => {
                    let oom = self
                        .exec_finish(run, &exit)
                        .instrument(tracing::trace_span!("exec.finish"))
                        .await;
                    return Ok(ExecResult {
                        exit_code: exit.exit_code,
                        stdout: String::from_utf8_lossy(&out).into_owned(),
                        stderr: String::from_utf8_lossy(&err).into_owned(),
                        duration_ms: exit.duration.as_secs_f64() * 1000.0,
                        timed_out: exit.timed_out,
                        oom_killed: oom,
                        truncated,
                    });
                }
            }
        }
    }

    // ---- files -------------------------------------------------------------

    pub async fn read_file(
        &self,
        cx: &OpContext,
        req: FileRequest,
    ) -> Result<aviary_envd_proto::FileReader, OpError> {
        check_sandbox_path(&req.path)?;
        let (rec, live) = self.readable(cx, &req.id).await?;
        self.via_envd(&rec, &live, live.envd.read_file(&req.path, None).await)
            .await
    }

    /// Writes the upload's body to its path (fenced; the body is streamed
    /// to envd, never buffered whole).
    pub async fn write_file<R>(&self, cx: &OpContext, req: FileUpload<R>) -> Result<u64, OpError>
    where
        R: tokio::io::AsyncRead + Unpin + Send,
    {
        let FileUpload { id, path, body } = req;
        check_sandbox_path(&path)?;
        let (rec, live) = self.writable(cx, &id).await?;
        let r = live
            .envd
            .write_file(&path, None, body, cx.token.map(|t| t.fence()))
            .await;
        if matches!(r, Err(EnvdError::NoSpace(_)))
            && rec.scope != Scope::Session
            && rec.tenant != aviary_registry::POOL_TENANT
        {
            self.taint_or_log(
                &rec.id,
                crate::taint::TaintCause::DiskLimit,
                "a file upload filled its disk while the sandbox was shared",
                cx.request_id(),
            )
            .await;
        }
        self.via_envd(&rec, &live, r).await
    }

    pub async fn list_files(&self, cx: &OpContext, req: FileRequest) -> Result<FileList, OpError> {
        check_sandbox_path(&req.path)?;
        let (rec, live) = self.readable(cx, &req.id).await?;
        let entries = self
            .via_envd(&rec, &live, live.envd.list_dir(&req.path).await)
            .await?;
        Ok(FileList {
            entries: entries.into_iter().map(file_info).collect(),
            truncated: false,
        })
    }

    /// Every entry below a directory, depth first, directories before
    /// their content (symlinks are listed, never followed); at most
    /// [`MAX_LISTED`] entries, `truncated` saying when there were more.
    pub async fn list_tree(&self, cx: &OpContext, req: FileRequest) -> Result<FileList, OpError> {
        check_sandbox_path(&req.path)?;
        let (rec, live) = self.readable(cx, &req.id).await?;
        let mut entries = Vec::new();
        let mut dirs = vec![req.path.clone()];
        while let Some(dir) = dirs.pop() {
            let listed = self
                .via_envd(&rec, &live, live.envd.list_dir(&dir).await)
                .await?;
            let mut subdirs = Vec::new();
            for e in listed.into_iter().map(file_info) {
                if entries.len() == MAX_LISTED {
                    return Ok(FileList {
                        entries,
                        truncated: true,
                    });
                }
                if e.kind == "dir" {
                    subdirs.push(e.path.clone());
                }
                entries.push(e);
            }
            // visit them in listing order
            dirs.extend(subdirs.into_iter().rev());
        }
        Ok(FileList {
            entries,
            truncated: false,
        })
    }

    pub async fn stat(&self, cx: &OpContext, req: FileRequest) -> Result<FileInfo, OpError> {
        check_sandbox_path(&req.path)?;
        let (rec, live) = self.readable(cx, &req.id).await?;
        Ok(file_info(
            self.via_envd(&rec, &live, live.envd.stat(&req.path).await)
                .await?,
        ))
    }

    /// Creates a directory and its parents (fenced).
    pub async fn mkdir(&self, cx: &OpContext, req: FileRequest) -> Result<(), OpError> {
        check_sandbox_path(&req.path)?;
        let (rec, live) = self.writable(cx, &req.id).await?;
        let r = live
            .envd
            .mkdir(&req.path, true, cx.token.map(|t| t.fence()))
            .await;
        self.via_envd(&rec, &live, r).await
    }

    /// Removes a file, or a directory (its content too when `recursive`);
    /// fenced. `/` is refused.
    pub async fn remove(&self, cx: &OpContext, req: RemoveFileRequest) -> Result<(), OpError> {
        check_sandbox_path(&req.path)?;
        if req.path.trim_end_matches('/').is_empty() {
            return Err(OpError::InvalidPath("refusing to remove /".into()));
        }
        let (rec, live) = self.writable(cx, &req.id).await?;
        let r = live
            .envd
            .remove(&req.path, req.recursive, cx.token.map(|t| t.fence()))
            .await;
        self.via_envd(&rec, &live, r).await
    }

    // ---- leases ------------------------------------------------------------

    pub async fn lease_acquire(
        &self,
        cx: &OpContext,
        req: OnSandbox<AcquireLeaseRequest>,
    ) -> Result<Lease, OpError> {
        let OnSandbox { id, request: req } = req;
        let request_id = cx.request_id();
        valid_name("lease owner", &req.owner)?;
        let ttl = self.lease_ttl(req.ttl_s)?;
        let rec = self.sandbox_for(&cx.caller, &id).await?;
        Self::running(&rec)?;
        if !matches!(rec.state, SandboxState::Idle | SandboxState::Leased) {
            return Err(OpError::InvalidState {
                state: rec.state,
                what: "only an idle sandbox can be leased".into(),
            });
        }
        let live = self.live_rec(&rec).await?;
        let lease = self
            .leases
            .acquire(&rec.id, &req.owner, ttl, aviary_core::now())
            .await?;
        // the token is handed out only once envd enforces it (and has
        // stopped what ran under the previous one); else it is never handed out
        self.push_fence_or_lose(&rec.id, &live, request_id).await?;
        let meta = serde_json::json!({"owner": lease.owner, "fence": lease.token.fence(), "expires_at": rfc3339(lease.expires_at)});
        if rec.state == SandboxState::Idle {
            self.transition_fresh(
                &rec.id,
                SandboxState::Idle,
                SandboxState::Leased,
                request_id,
                "lease_acquired",
                meta,
            )
            .await?;
        } else {
            self.record_event(
                &rec.tenant,
                Some(&rec.id),
                Some(rec.state),
                "lease_acquired",
                request_id,
                meta,
            )
            .await?;
        }
        self.metrics.inc_lease(crate::metrics::LeaseOp::Acquired);
        Ok(lease)
    }

    /// Renews the lease whose token the request names (the lease's own
    /// token, not the context's).
    pub async fn lease_renew(
        &self,
        cx: &OpContext,
        req: OnSandbox<RenewLeaseRequest>,
    ) -> Result<Lease, OpError> {
        let ttl = self.lease_ttl(req.request.ttl_s)?;
        let rec = self.sandbox_for(&cx.caller, &req.id).await?;
        let renewed = self
            .leases
            .renew(&rec.id, req.request.token, ttl, aviary_core::now())
            .await;
        let lease = self.token_checked(&rec.id, renewed).await?;
        self.metrics.inc_lease(crate::metrics::LeaseOp::Renewed);
        Ok(lease)
    }

    /// Releases the lease whose token the request names.
    pub async fn lease_release(
        &self,
        cx: &OpContext,
        req: OnSandbox<ReleaseLeaseRequest>,
    ) -> Result<(), OpError> {
        let OnSandbox { id, request: req } = req;
        let request_id = cx.request_id();
        let rec = self.sandbox_for(&cx.caller, &id).await?;
        let released = self
            .leases
            .release(&rec.id, req.token, aviary_core::now())
            .await;
        self.token_checked(&rec.id, released).await?;
        if let Some(live) = self.live_opt(&rec.id) {
            self.push_fence_or_lose(&rec.id, &live, request_id).await?;
        }
        self.transition_fresh(
            &rec.id,
            SandboxState::Leased,
            SandboxState::Idle,
            request_id,
            "lease_released",
            serde_json::json!({"fence": req.token.fence()}),
        )
        .await?;
        self.metrics.inc_lease(crate::metrics::LeaseOp::Released);
        Ok(())
    }

    /// Moves `from → to` if the sandbox is (still) in `from`, retrying on
    /// version conflicts with a fresh read.
    async fn transition_fresh(
        &self,
        id: &SandboxId,
        from: SandboxState,
        to: SandboxState,
        request_id: Option<&str>,
        event: &str,
        meta: serde_json::Value,
    ) -> Result<(), OpError> {
        for _ in 0..8 {
            let rec = self.registry.get_sandbox(id).await?;
            if rec.state != from {
                return Ok(());
            }
            match self
                .registry
                .transition(
                    id,
                    rec.version,
                    &[to],
                    FenceCheck::Skip,
                    ctx(request_id, Some(event), meta.clone()),
                )
                .await
            {
                Err(aviary_registry::RegistryError::Conflict) => continue,
                other => return other.map(|_| ()).map_err(OpError::from),
            }
        }
        Err(OpError::Conflict)
    }

    // ---- background sweeps --------------------------------------------------

    /// Expires leases and sandboxes whose time is up. Runs periodically.
    /// Whether this control plane drives the compute of `node`: its own
    /// runtimes, or an `aviary node` agent it is connected to (not another
    /// replica's own runtimes).
    pub(crate) fn drives_node(&self, node: &str) -> bool {
        self.drives_own_node(node) || self.nodes.get(node).is_some()
    }

    /// Whether `node` is this control plane's own node (it runs sandboxes).
    pub(crate) fn drives_own_node(&self, node: &str) -> bool {
        self.cfg.runs_sandboxes && node == self.cfg.local_node
    }

    /// Whether a background pass over `scope` looks after `node`.
    pub(crate) fn looks_after(&self, scope: crate::Reconciling, node: &str) -> bool {
        match scope {
            crate::Reconciling::OwnNode => self.drives_own_node(node),
            crate::Reconciling::OwnNodeAndAgents => self.drives_node(node),
        }
    }

    /// Both sweeps, as the single server runs them.
    pub async fn sweep(&self) -> Result<(), OpError> {
        self.sweep_leases().await?;
        self.sweep_node().await
    }

    /// Expired leases end (registry-wide: the replica that leads runs it;
    /// the fence is pushed to envd where the sandbox is attached here).
    pub async fn sweep_leases(&self) -> Result<(), OpError> {
        let now = aviary_core::now();
        for lease in self.leases.expire_due(now).await? {
            if let Some(live) = self.live_opt(&lease.sandbox_id) {
                // envd stops what ran under the expired lease; one that does
                // not take the fence makes its sandbox lost
                if self
                    .push_fence_or_lose(&lease.sandbox_id, &live, None)
                    .await
                    .is_err()
                {
                    continue;
                }
            }
            if self
                .leases
                .current(&lease.sandbox_id, aviary_core::now())
                .await?
                .is_some()
            {
                // already leased again (acquired before this sweep got here)
                continue;
            }
            self.transition_fresh(
                &lease.sandbox_id,
                SandboxState::Leased,
                SandboxState::Idle,
                None,
                "lease_expired",
                serde_json::json!({"owner": lease.owner, "fence": lease.token.fence()}),
            )
            .await?;
        }
        Ok(())
    }

    /// TTL expiry and idle hibernation of the sandboxes this control plane
    /// drives: its own node and the agents connected here.
    pub async fn sweep_node(&self) -> Result<(), OpError> {
        self.sweep_node_as(crate::Reconciling::OwnNodeAndAgents)
            .await
    }

    /// TTL expiry and idle hibernation over `scope`: every replica runs it
    /// for its own node (the compute is reachable only from there), the
    /// leader also for the shared node agents.
    pub async fn sweep_node_as(&self, scope: crate::Reconciling) -> Result<(), OpError> {
        let now = aviary_core::now();
        for rec in self.registry.list_sandboxes(None, false).await? {
            if !self.looks_after(scope, &rec.node) {
                continue;
            }
            if rec.user_managed {
                // the platform only stops a user-managed sandbox (on TTL
                // expiry: snapshot and hibernate), it never destroys it
                if rec.expires_at.is_some_and(|t| t <= now) && rec.state == SandboxState::Idle {
                    if let Err(e) = self
                        .hibernate_record(
                            rec.clone(),
                            None,
                            "ttl expired (user-managed: stopped, not destroyed)",
                        )
                        .await
                    {
                        tracing::warn!(sandbox.id = %rec.id, error = %e, "ttl stop failed");
                    }
                }
                continue;
            }
            if rec.expires_at.is_some_and(|t| t <= now) && !rec.state.is_terminal() {
                if let Err(e) = self
                    .destroy(rec.clone(), FenceCheck::Skip, None, "ttl expired")
                    .await
                {
                    tracing::warn!(sandbox.id = %rec.id, error = %e, "ttl teardown failed");
                }
            }
        }
        self.hibernate_idle(scope).await?;
        Ok(())
    }

    // ---- events and templates -----------------------------------------------

    pub async fn events(&self, cx: &OpContext, req: EventQuery) -> Result<Vec<Event>, OpError> {
        let tenant = if req.all_tenants {
            cx.require_admin("reading every tenant's events")?;
            None
        } else {
            Some(cx.caller.tenant.clone())
        };
        let sandbox_id = match (&req.sandbox, &tenant) {
            (Some(s), Some(_)) => Some(self.sandbox_for(&cx.caller, s).await?.id),
            (Some(s), None) => Some(self.any_sandbox(s).await?.id),
            (None, _) => None,
        };
        let limit = req.limit.unwrap_or(100).clamp(1, 1000);
        Ok(self
            .registry
            .list_events(&EventFilter {
                tenant,
                sandbox_id,
                after_id: req.after,
                limit,
                newest: req.newest,
            })
            .await?)
    }

    /// Every template (any caller may list them).
    pub async fn templates(&self, _cx: &OpContext) -> Result<Vec<Template>, OpError> {
        Ok(self
            .templates
            .list()
            .await?
            .iter()
            .map(template_api)
            .collect())
    }

    /// Removes a template (admin). Refused while anything still needs it:
    /// the default template, a configured warm pool, a sandbox that has not
    /// ended (any tenant's, warm ones included), or a snapshot (it restores
    /// onto that template). Its tree is deleted when no other name shares it.
    pub async fn remove_template(&self, cx: &OpContext, name: &str) -> Result<(), OpError> {
        cx.require_admin("removing templates")?;
        crate::validate::template_name(name)?;
        if self.templates.get(name).await?.is_none() {
            return Err(OpError::NotFound(format!("template {name}")));
        }
        let in_use = |what: String| {
            OpError::layer(
                aviary_core::ErrorCode::Conflict,
                format!("template {name:?} is in use: {what}"),
                anyhow::anyhow!("template {name} in use"),
            )
        };
        if name == self.cfg.default_template {
            return Err(in_use("it is the server's default template".into()));
        }
        if self.pools.uses_template(name) {
            return Err(in_use(
                "a warm pool starts sandboxes from it (see [[pool]] in the configuration)".into(),
            ));
        }
        let live = self
            .registry
            .list_sandboxes(None, false)
            .await?
            .into_iter()
            .filter(|r| r.template == name)
            .count();
        if live > 0 {
            return Err(in_use(format!(
                "{live} sandbox(es) that have not ended run on it"
            )));
        }
        let snapshots = self
            .registry
            .list_snapshots(&aviary_registry::SnapshotFilter::default())
            .await?
            .into_iter()
            .filter(|s| s.template == name)
            .count();
        if snapshots > 0 {
            return Err(in_use(format!(
                "{snapshots} snapshot(s) restore onto it (delete them first: aviary snapshot rm)"
            )));
        }
        self.templates.remove(name).await?;
        self.record_event(
            &cx.caller.tenant,
            None,
            None,
            "template_removed",
            cx.request_id(),
            serde_json::json!({"template": name}),
        )
        .await
    }

    /// Imports an archive already spooled to `archive` (the caller removes it).
    pub async fn import_template(
        &self,
        cx: &OpContext,
        req: TemplateImport,
    ) -> Result<Template, OpError> {
        let name = req.name.as_str();
        cx.require_admin("importing templates")?;
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
            || name.starts_with('.')
        {
            return Err(OpError::InvalidRequest(
                "template name must be 1-64 of [A-Za-z0-9._-], not starting with '.'".into(),
            ));
        }
        if !req.force && self.templates.get(name).await?.is_some() {
            return Err(OpError::layer(
                aviary_core::ErrorCode::Conflict,
                format!(
                    "template {name:?} exists already: import with force (aviary template import --force) to replace it"
                ),
                anyhow::anyhow!("template {name} exists"),
            ));
        }
        let info = self.templates.import(name, req.archive).await?;
        self.registry.upsert_template(&info).await?;
        self.record_event(
            &cx.caller.tenant,
            None,
            None,
            "template_imported",
            None,
            serde_json::json!({"name": info.name, "digest": info.digest}),
        )
        .await?;
        Ok(template_api(&info))
    }

    /// Stops every background resource of the server; sandboxes keep running
    /// and are re-attached on the next start.
    /// How many of the registry's sandboxes (every tenant's, ended ones
    /// not counted) are in each state, for `/metrics`.
    pub async fn sandbox_counts_by_state(&self) -> Result<Vec<(String, usize)>, OpError> {
        let mut counts: std::collections::BTreeMap<&'static str, usize> = Default::default();
        for t in self.registry.live_totals(None).await? {
            *counts.entry(t.state.as_str()).or_default() += t.sandboxes as usize;
        }
        Ok(counts.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }

    /// The server is stopping: every runtime lets go of what it keeps
    /// ready ahead of need (pre-made disks); sandboxes keep running.
    pub fn release_spares(&self) {
        for rt in self.runtimes.all() {
            rt.runtime.release_spares();
        }
    }

    pub fn live_count(&self) -> usize {
        self.live.lock().expect("live map poisoned").len()
    }
}

/// What the create pipeline's later stages (scope and reuse, warm pool)
/// decide from: the caller's request and what planning and policy approved.
#[derive(Clone)]
pub(crate) struct CreateStage<'a> {
    pub cx: &'a OpContext,
    pub req: &'a CreateSandboxRequest,
    pub approved: &'a crate::planning::Approved,
    pub template: &'a TemplateRecord,
    pub scope: Scope,
    pub expires_at: OffsetDateTime,
    pub lease_req: Option<(String, Duration)>,
}

/// A started exec.
pub struct ExecRun {
    pub id: SandboxId,
    pub stream: aviary_envd_proto::ExecStream,
    pub oom_before: Option<u64>,
    /// The runtime the sandbox runs on (for the OOM counter after the exit).
    pub runtime: Arc<dyn aviary_runtime::Runtime>,
    /// Keeps the sandbox counted busy while the exec runs.
    pub busy: ExecGuard,
    /// The sandbox serves a shared scope (user, agent, global): a limit
    /// its exec hits taints it.
    pub shared: bool,
}

fn append_capped(buf: &mut Vec<u8>, data: &[u8], cap: usize, truncated: &mut bool) {
    let room = cap.saturating_sub(buf.len());
    if data.len() > room {
        *truncated = true;
    }
    buf.extend_from_slice(&data[..data.len().min(room)]);
}

/// The most entries one recursive listing answers.
pub const MAX_LISTED: usize = 10_000;

fn file_info(s: aviary_envd_proto::FileStat) -> FileInfo {
    FileInfo {
        name: s.name,
        path: s.path,
        kind: match s.kind {
            aviary_envd_proto::FileKind::File => "file",
            aviary_envd_proto::FileKind::Dir => "dir",
            aviary_envd_proto::FileKind::Symlink => "symlink",
            aviary_envd_proto::FileKind::Other => "other",
        }
        .to_owned(),
        size: s.size,
        mode: s.mode,
        modified_unix: s.modified_unix,
    }
}

fn template_api(t: &TemplateRecord) -> Template {
    Template {
        name: t.name.clone(),
        digest: t.digest.clone(),
        size_bytes: t.size_bytes,
        source: t.source.clone(),
        created_at: t.created_at,
        defaults: t.defaults.clone(),
    }
}

/// A new sandbox's default exec environment: the template image's `Env`
/// under the create's own `env`.
/// The sandbox's default env with its network profile's entries: the
/// profile's name (read back by [`ControlPlane::egress_of`]; the caller's
/// own value of it never survives) and, for `allowlist`, the proxy envd
/// serves on the sandbox's own loopback.
fn network_env(
    mut env: std::collections::BTreeMap<String, String>,
    approved: &crate::planning::Approved,
) -> std::collections::BTreeMap<String, String> {
    use aviary_core::egress::{EGRESS_PROXY_PORT, NETWORK_PROFILE_ENV};
    env.insert(NETWORK_PROFILE_ENV.into(), approved.network_name.clone());
    if approved.network == aviary_core::NetworkProfile::Allowlist {
        let proxy = format!("http://127.0.0.1:{EGRESS_PROXY_PORT}");
        for k in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
            env.insert(k.into(), proxy.clone());
        }
        for k in ["NO_PROXY", "no_proxy"] {
            env.insert(k.into(), "localhost,127.0.0.1".into());
        }
    }
    env
}

impl ControlPlane {
    /// The egress rules of a sandbox of profile `kind` named `name` (from
    /// the configuration as it is now). `None` unless `allowlist`.
    pub(crate) fn egress_named(
        &self,
        kind: aviary_core::NetworkProfile,
        name: Option<&str>,
    ) -> Result<Option<aviary_core::egress::EgressPolicy>, OpError> {
        if kind != aviary_core::NetworkProfile::Allowlist {
            return Ok(None);
        }
        let name = name.ok_or_else(|| {
            OpError::InvalidRequest("allowlist sandbox without a recorded network profile".into())
        })?;
        self.cfg
            .settings
            .network_profile(name)
            .and_then(|p| p.egress_policy())
            .map(Some)
            .ok_or_else(|| {
                OpError::InvalidRequest(format!(
                    "network profile {name:?} is no longer an allowlist profile in the configuration"
                ))
            })
    }

    /// The egress rules of an existing sandbox (new compute for it: wake,
    /// reset, restore), by the profile name recorded at its create.
    pub(crate) fn egress_of(
        &self,
        rec: &SandboxRecord,
    ) -> Result<Option<aviary_core::egress::EgressPolicy>, OpError> {
        self.egress_named(
            rec.network_profile,
            rec.env
                .get(aviary_core::egress::NETWORK_PROFILE_ENV)
                .map(String::as_str),
        )
    }
}

fn exec_env(
    template: &TemplateRecord,
    req: &CreateSandboxRequest,
) -> std::collections::BTreeMap<String, String> {
    let mut env = template.defaults.env.clone();
    env.extend(req.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

fn new_api_key() -> String {
    use rand::RngCore;
    let mut b = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut b);
    format!("avk_{}", hex::encode(b))
}

pub(crate) fn anyhow_of(e: &OpError) -> anyhow::Error {
    match e {
        OpError::Internal(inner) => anyhow::anyhow!("{inner:#}"),
        other => anyhow::anyhow!("{other}"),
    }
}
