//! The Kubernetes runtime: one Pod per sandbox, driven through the API
//! server with `kube` (rustls, no OpenSSL) and the `k8s-openapi` types of
//! one Kubernetes version (1.30).
//!
//! **Untested against a live cluster.** No API server can run where this
//! project is built; the tests replay exchanges written from the Kubernetes
//! API reference (`tests/fixtures/`), not captured from a cluster.
//!
//! What it owns: turning a [`SandboxSpec`] into a NetworkPolicy, a Secret
//! and a Pod (`pod.rs`: the image the template maps to, limits = requests
//! from the class, the tier's `runtimeClassName`, every security setting
//! locked down, no host path, no service-account token); waiting for the
//! Pod to run; serving the host end of envd's transport; deleting all of it
//! and waiting until the Pod is gone.
//!
//! **How the control plane reaches envd in a Pod.** envd is the sandbox
//! container's entrypoint with `--socket /run/aviary/envd.sock` (the Pod's
//! in-memory control volume) and its bridge (`--bridge 0.0.0.0:<envd_port>
//! --bridge-secret-file …`: HTTP/1.1 upgrades carrying a secret, spliced to
//! that socket; `aviary-envd`'s `bridge.rs`). The secret is 32 random bytes
//! (hex) made per sandbox and sent only in the sandbox's Secret; an init
//! container mounts the Secret read-only (0400) and copies it onto the
//! control volume (`envd --stage-secret`), where envd reads and removes it
//! before it runs anything. The sandbox container never mounts the Secret,
//! and nothing of it is in the Pod's env or args. Once the Pod runs with an
//! address (`status.podIPs`/`podIP`, checked: the cluster's answer is not
//! trusted), this process serves a relay socket, `<relay_dir>/<id>/envd.sock`
//! (0600 in a 0700 dir), whose every connection is carried over one
//! upgraded TCP connection to `podIP:envd_port` (`aviary-relay`, shared with
//! the remote runtime). [`SandboxHandle::envd`] names that socket and this
//! process's pid, which the control plane checks as the socket's peer. After
//! a restart [`Runtime::envd_endpoint`] reads the Pod and the Secret again
//! and starts the relay anew; destroy stops it and removes the socket.
//! Only the bridge's connections may move envd's fence; code in the sandbox
//! can reach the bridge port over loopback but lacks the secret.
//!
//! Invariants:
//! - every object carries `aviary.dev/sandbox=<id>` and
//!   `aviary.dev/deployment=<deployment>`; the runtime reads, lists and
//!   deletes only objects with both (a Pod of the same name without them is
//!   another party's and is never deleted);
//! - the NetworkPolicy exists before the Secret and the Pod, so the Pod
//!   never runs without it, and is deleted last, so `list` (Pods and
//!   policies) finds every partial sandbox. It allows no egress and one
//!   ingress: TCP to `envd_port` from the `envd_from` CIDRs. The cluster's
//!   network plugin enforces it; one without NetworkPolicy support does
//!   not, and then `none` is not loopback-only: say so to the operator,
//!   this runtime cannot see it;
//! - a create that fails after the policy was sent deletes what it made
//!   and reports a failed cleanup together with the original failure;
//! - what the API server answers is the cluster's: parsed by typed structs,
//!   quantities and addresses checked, never a host path.
//!
//! Not here (plainly): **untested against a live cluster**, and the
//! transport assumes the control plane can open TCP connections to Pod IPs
//! (in the cluster, or on a network that routes to the Pod network). The
//! API server's port-forward, for a control plane outside the Pod network,
//! is **not built**. Kubernetes has no pause, so this runtime is not
//! `Pausable` (the control plane answers `unsupported` for pause and skips
//! freezing); it cannot snapshot. A per-Pod pids limit has no field in the
//! Pod spec (the kubelet's `podPidsLimit` is node-wide), so `pids` is not
//! applied. The Pod's image must carry an envd that knows
//! `--stage-secret` (this version's).
//!
//! Concurrency: the runtime holds a `kube::Client` (cheap to clone, shared
//! connection pool), a map of memory peaks and a map of relays (each a
//! mutex never held across an await); it is called concurrently for
//! different sandboxes.
#![forbid(unsafe_code)]

mod error;
pub mod pod;

pub use error::KubeError;

use async_trait::async_trait;
use aviary_core::{NetworkProfile, SandboxId};
use aviary_relay::{Relay, TcpBridge};
use aviary_runtime::{
    validate_spec, EnvdEndpoint, ResourceUsage, Runtime, RuntimeError, RuntimeStatus,
    SandboxHandle, SandboxSpec, ENVD_SOCKET_NAME,
};
use error::{api_error, chain, status_code};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

/// The name this runtime is recorded and placed by.
pub const RUNTIME_NAME: &str = "kubernetes";

/// Where a [`SandboxHandle`]'s workspace of this runtime points on the
/// host: nowhere (nothing can exist below `/dev/null`). A Pod's workspace
/// is its own `emptyDir`.
pub const NO_HOST_DIR: &str = "/dev/null/aviary-kubernetes";

/// How the runtime authenticates to the API server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiAccess {
    /// A kubeconfig file, and optionally one of its contexts.
    Kubeconfig {
        path: PathBuf,
        context: Option<String>,
    },
    /// The Pod's own service account (when Aviary runs in the cluster).
    InCluster,
}

/// Everything the runtime needs besides credentials.
#[derive(Clone, Debug, PartialEq)]
pub struct KubeSettings {
    /// Namespace of every sandbox object.
    pub namespace: String,
    /// Value of `aviary.dev/deployment` on every object: several Aviary
    /// deployments may share a namespace without seeing each other.
    pub deployment: String,
    /// `runtimeClassName` of every sandbox Pod (the isolation tier, e.g.
    /// `gvisor` or `kata`); `None` leaves the cluster's default.
    pub runtime_class: Option<String>,
    /// Template name → container image. The image must hold the template's
    /// tree and the static envd at the path the control plane starts
    /// (`/.aviary/envd`); pin it by digest (`repo@sha256:…`).
    pub images: BTreeMap<String, String>,
    /// uid (and gid, fsGroup) of the sandbox's processes; any value but 0
    /// also sets `runAsNonRoot`. 0 runs as root (still without
    /// capabilities, privilege escalation or host access).
    pub run_as_user: i64,
    /// Longest a new Pod may take to run (scheduling and image pull
    /// included) before the create fails and the Pod is deleted.
    pub ready_timeout: Duration,
    /// Longest a deleted Pod may take to disappear.
    pub delete_timeout: Duration,
    /// Interval between two reads of a Pod while waiting.
    pub poll_interval: Duration,
    /// The port envd's bridge listens on in every Pod.
    pub envd_port: u16,
    /// CIDRs the control plane reaches Pods from: the only sources the
    /// NetworkPolicy admits, and only to `envd_port`.
    pub envd_from: Vec<String>,
    /// Host-only directory (made 0700) where this process serves each
    /// sandbox's relay socket (`<relay_dir>/<id>/envd.sock`).
    pub relay_dir: PathBuf,
}

impl KubeSettings {
    /// Checks names the API server would refuse later, with a clearer
    /// message now.
    pub fn validate(&self) -> Result<(), KubeError> {
        let invalid = |reason: String| Err(KubeError::InvalidSettings { reason });
        if !is_dns_label(&self.namespace) {
            return invalid(format!(
                "namespace {:?} is not a DNS label (lowercase letters, digits, '-', at most 63)",
                self.namespace
            ));
        }
        if !is_label_value(&self.deployment) {
            return invalid(format!(
                "deployment {:?} is not a label value (letters, digits, '-', '_', '.', at most 63)",
                self.deployment
            ));
        }
        if let Some(rc) = &self.runtime_class {
            if !is_dns_label(rc) {
                return invalid(format!("runtime class {rc:?} is not a DNS label"));
            }
        }
        for (template, image) in &self.images {
            if image.is_empty() || image.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return invalid(format!(
                    "image {image:?} of template {template:?} is not an image reference"
                ));
            }
        }
        if self.run_as_user < 0 {
            return invalid(format!("run_as_user {} is negative", self.run_as_user));
        }
        if self.poll_interval.is_zero() {
            return invalid("poll interval is zero".into());
        }
        if self.envd_port < 1024 {
            return invalid(format!(
                "envd_port {} is below 1024 (envd runs without capabilities)",
                self.envd_port
            ));
        }
        if self.envd_from.is_empty() {
            return invalid(
                "envd_from names no CIDR: nothing could reach envd's bridge in a Pod".into(),
            );
        }
        if let Some(bad) = self.envd_from.iter().find(|c| !pod::is_cidr(c)) {
            return invalid(format!(
                "envd_from entry {bad:?} is not a CIDR (e.g. \"10.0.0.0/8\", no host bits set)"
            ));
        }
        if !self.relay_dir.is_absolute() {
            return invalid(format!(
                "relay_dir {:?} is not an absolute path",
                self.relay_dir
            ));
        }
        Ok(())
    }

    /// Settings for unit tests: runtime class `gvisor`, uid 1000, one
    /// template `python`.
    #[doc(hidden)]
    pub fn for_tests(namespace: &str, deployment: &str) -> Self {
        KubeSettings {
            namespace: namespace.into(),
            deployment: deployment.into(),
            runtime_class: Some("gvisor".into()),
            images: BTreeMap::from([(
                "python".to_owned(),
                "registry.example/aviary/python@sha256:00".to_owned(),
            )]),
            run_as_user: 1000,
            ready_timeout: Duration::from_secs(120),
            delete_timeout: Duration::from_secs(60),
            poll_interval: Duration::from_millis(500),
            envd_port: aviary_relay::BRIDGE_PORT,
            envd_from: vec!["10.0.0.0/8".into()],
            relay_dir: std::env::temp_dir().join("aviary-kube-relays"),
        }
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_label_value(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
}

/// Longest a connection to the API server may take to open.
const API_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest one request may wait for its answer (or to be sent).
const API_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Container waiting reasons after which a Pod with `restartPolicy: Never`
/// will not run: the create fails at once instead of at the timeout.
const FATAL_WAITING: [&str; 7] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// The Kubernetes runtime (see the crate docs).
pub struct KubeRuntime {
    client: kube::Client,
    settings: KubeSettings,
    /// The API server's URL, for messages.
    server: String,
    /// Highest memory each sandbox was seen using (the metrics API gives
    /// only the current value).
    memory_peaks: Mutex<HashMap<SandboxId, u64>>,
    /// The relay of each sandbox whose envd this process serves (never held
    /// across an await).
    relays: Mutex<HashMap<SandboxId, Relay>>,
}

impl std::fmt::Debug for KubeRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeRuntime")
            .field("server", &self.server)
            .field("namespace", &self.settings.namespace)
            .field("deployment", &self.settings.deployment)
            .finish()
    }
}

/// How a Pod the runtime waits for stands.
enum Progress {
    Running,
    Waiting(String),
    Failed(String),
}

impl KubeRuntime {
    /// Loads the credentials and builds the client. No request is sent: an
    /// unreachable API server shows on the first operation, as
    /// [`RuntimeError::ProbeRuntime`].
    pub async fn connect(access: &ApiAccess, settings: KubeSettings) -> Result<Self, KubeError> {
        settings.validate()?;
        let config = match access {
            ApiAccess::Kubeconfig { path, context } => {
                let kc = kube::config::Kubeconfig::read_from(path).map_err(|source| {
                    KubeError::ReadKubeconfig {
                        path: path.clone(),
                        source,
                    }
                })?;
                let options = kube::config::KubeConfigOptions {
                    context: context.clone(),
                    ..Default::default()
                };
                kube::Config::from_custom_kubeconfig(kc, &options)
                    .await
                    .map_err(|source| KubeError::LoadKubeconfig {
                        path: path.clone(),
                        source,
                    })?
            }
            ApiAccess::InCluster => {
                kube::Config::incluster().map_err(|source| KubeError::LoadInCluster { source })?
            }
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&settings.relay_dir)
            .map_err(|source| KubeError::CreateRelayDir {
                path: settings.relay_dir.clone(),
                source,
            })?;
        let mut config = config;
        // No request of this runtime streams (no watch, no exec): one that
        // hangs longer is an API server in trouble, not a slow answer.
        config.connect_timeout = Some(API_CONNECT_TIMEOUT);
        config.read_timeout = Some(API_REQUEST_TIMEOUT);
        config.write_timeout = Some(API_REQUEST_TIMEOUT);
        let server = config.cluster_url.to_string();
        let client =
            kube::Client::try_from(config).map_err(|source| KubeError::BuildClient { source })?;
        Ok(KubeRuntime {
            client,
            settings,
            server,
            memory_peaks: Mutex::new(HashMap::new()),
            relays: Mutex::new(HashMap::new()),
        })
    }

    pub fn settings(&self) -> &KubeSettings {
        &self.settings
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.settings.namespace)
    }

    fn policies(&self) -> Api<NetworkPolicy> {
        Api::namespaced(self.client.clone(), &self.settings.namespace)
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.settings.namespace)
    }

    /// The host-only directory of sandbox `id`'s relay socket.
    fn relay_dir_of(&self, id: &SandboxId) -> PathBuf {
        self.settings.relay_dir.join(id.as_str())
    }

    /// Starts (or keeps) the relay of `id` to `bridge`; its socket.
    fn ensure_relay(&self, id: &SandboxId, bridge: TcpBridge) -> Result<PathBuf, RuntimeError> {
        let dir = self.relay_dir_of(id);
        let socket = dir.join(ENVD_SOCKET_NAME);
        let mut relays = self.relays.lock().unwrap_or_else(|e| e.into_inner());
        if relays.contains_key(id) {
            return Ok(socket);
        }
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(source) => return Err(RuntimeError::CreateDir { path: dir, source }),
        }
        let relay =
            aviary_relay::start(&socket, bridge).map_err(|source| RuntimeError::WriteFile {
                path: socket.clone(),
                source,
            })?;
        relays.insert(id.clone(), relay);
        Ok(socket)
    }

    /// Stops the relay of `id` and removes its socket and directory.
    fn stop_relay(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.relays
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        let dir = self.relay_dir_of(id);
        let gone = |r: std::io::Result<()>| match r {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
        gone(std::fs::remove_file(dir.join(ENVD_SOCKET_NAME)))
            .and_then(|()| gone(std::fs::remove_dir(&dir)))
            .map_err(|source| RuntimeError::RemoveDir { path: dir, source })
    }

    /// The bridge of sandbox `id`'s envd in running Pod `p`, with `secret`.
    fn bridge(&self, p: &Pod, secret: String) -> Result<TcpBridge, RuntimeError> {
        let name = p.metadata.name.clone().unwrap_or_default();
        let ip = pod::pod_address(p).map_err(|detail| RuntimeError::ParseState {
            detail: format!("pod {name}: {detail}"),
        })?;
        TcpBridge::new(SocketAddr::new(ip, self.settings.envd_port), secret).ok_or_else(|| {
            RuntimeError::ParseState {
                detail: format!(
                    "secret {name}: key {} is not a bridge secret (16 to 1024 printable bytes)",
                    pod::SECRET_KEY
                ),
            }
        })
    }

    /// The bridge secret of sandbox `id`, read back from its Secret.
    async fn read_secret(&self, id: &SandboxId) -> Result<String, RuntimeError> {
        let name = pod::object_name(id);
        let found = self
            .secrets()
            .get_opt(&name)
            .await
            .map_err(|e| self.error(&format!("read secret {name}"), e))?;
        let Some(secret) =
            found.filter(|s| pod::is_ours(&self.settings, id, s.metadata.labels.as_ref()))
        else {
            return Err(RuntimeError::InvokeRuntime {
                action: format!("reach envd of {id}"),
                detail: format!(
                    "its secret {name} is missing (or not labelled for this deployment)"
                ),
            });
        };
        let bytes = secret
            .data
            .and_then(|mut d| d.remove(pod::SECRET_KEY))
            .map(|b| b.0)
            .unwrap_or_default();
        String::from_utf8(bytes).map_err(|_| RuntimeError::ParseState {
            detail: format!("secret {name}: key {} is not text", pod::SECRET_KEY),
        })
    }

    fn error(&self, action: &str, e: kube::Error) -> RuntimeError {
        api_error(action, &self.settings.namespace, &self.server, e)
    }

    /// The Pod of sandbox `id` if it exists and is ours.
    async fn our_pod(&self, id: &SandboxId) -> Result<Option<Pod>, RuntimeError> {
        let name = pod::object_name(id);
        let found = self
            .pods()
            .get_opt(&name)
            .await
            .map_err(|e| self.error(&format!("read pod {name}"), e))?;
        Ok(found.filter(|p| pod::is_ours(&self.settings, id, p.metadata.labels.as_ref())))
    }

    fn progress(&self, p: Pod) -> Progress {
        let status = p.status.clone().unwrap_or_default();
        let phase = status.phase.clone().unwrap_or_else(|| "Unknown".into());
        let containers = status.container_statuses.clone().unwrap_or_default();
        for c in &containers {
            let state = c.state.clone().unwrap_or_default();
            if let Some(w) = &state.waiting {
                let reason = w.reason.clone().unwrap_or_default();
                if FATAL_WAITING.contains(&reason.as_str()) {
                    return Progress::Failed(format!(
                        "container {} cannot start: {reason}: {}",
                        c.name,
                        w.message.clone().unwrap_or_default()
                    ));
                }
            }
            if let Some(t) = &state.terminated {
                return Progress::Failed(format!(
                    "container {} exited ({} {}): {}",
                    c.name,
                    t.exit_code,
                    t.reason.clone().unwrap_or_default(),
                    t.message.clone().unwrap_or_default()
                ));
            }
        }
        match phase.as_str() {
            "Running"
                if containers
                    .iter()
                    .any(|c| c.state.as_ref().is_some_and(|s| s.running.is_some())) =>
            {
                Progress::Running
            }
            "Failed" | "Succeeded" => Progress::Failed(format!(
                "pod ended in phase {phase}: {} {}",
                status.reason.unwrap_or_default(),
                status.message.unwrap_or_default()
            )),
            _ => {
                let mut why = format!("phase {phase}");
                for cond in status.conditions.unwrap_or_default() {
                    if cond.status != "True" {
                        why.push_str(&format!(
                            "; {}={} {}: {}",
                            cond.type_,
                            cond.status,
                            cond.reason.unwrap_or_default(),
                            cond.message.unwrap_or_default()
                        ));
                    }
                }
                for c in containers {
                    if let Some(w) = c.state.and_then(|s| s.waiting) {
                        why.push_str(&format!(
                            "; container {} waiting: {}",
                            c.name,
                            w.reason.unwrap_or_default()
                        ));
                    }
                }
                Progress::Waiting(why)
            }
        }
    }

    /// Polls the Pod until it runs, fails, vanishes or the timeout passes.
    async fn wait_running(&self, id: &SandboxId, uid: &str) -> Result<Pod, RuntimeError> {
        let action = format!("start pod {id}");
        let deadline = tokio::time::Instant::now() + self.settings.ready_timeout;
        loop {
            let p = match self.our_pod(id).await? {
                Some(p) if p.metadata.uid.as_deref() == Some(uid) => p,
                _ => {
                    return Err(RuntimeError::InvokeRuntime {
                        action,
                        detail: "the pod disappeared before it ran".into(),
                    })
                }
            };
            let why = match self.progress(p.clone()) {
                Progress::Running => return Ok(p),
                Progress::Failed(detail) => {
                    return Err(RuntimeError::InvokeRuntime { action, detail })
                }
                Progress::Waiting(why) => why,
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(RuntimeError::InvokeRuntime {
                    action,
                    detail: format!(
                        "the pod did not run within {:?} ({why})",
                        self.settings.ready_timeout
                    ),
                });
            }
            tokio::time::sleep(self.settings.poll_interval).await;
        }
    }

    /// Deletes the Pod and the policy of `id` (what exists of them and is
    /// ours) and waits until the Pod is gone.
    async fn delete_all(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let name = pod::object_name(id);
        if let Some(p) = self
            .pods()
            .get_opt(&name)
            .await
            .map_err(|e| self.error(&format!("read pod {name}"), e))?
        {
            if !pod::is_ours(&self.settings, id, p.metadata.labels.as_ref()) {
                return Err(RuntimeError::InvokeRuntime {
                    action: format!("delete pod {name}"),
                    detail: format!(
                        "the pod is not labelled {}={} and {}={id}: not ours, not deleted",
                        pod::DEPLOYMENT_LABEL,
                        self.settings.deployment,
                        pod::SANDBOX_LABEL
                    ),
                });
            }
            let uid = p.metadata.uid.clone();
            // Grace 1 s, not 0: an API delete with grace 0 is a force
            // delete, which removes the object at once while the kubelet may
            // still be running the containers. With 1 s the Pod object goes
            // only once the kubelet has killed them.
            let dp = DeleteParams {
                grace_period_seconds: Some(1),
                preconditions: Some(Preconditions {
                    uid: uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match self.pods().delete(&name, &dp).await {
                Ok(_) => {}
                Err(e) if status_code(&e) == Some(404) => {}
                Err(e) => return Err(self.error(&format!("delete pod {name}"), e)),
            }
            self.wait_gone(&name, uid.as_deref()).await?;
        }
        self.delete_rest(id).await
    }

    /// Deletes the Secret, then the policy, of `id`: the policy is the
    /// first object a create makes and the last one deleted, so `list`
    /// finds every partial sandbox through it.
    async fn delete_rest(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.delete_labelled(self.secrets(), "secret", id).await?;
        self.delete_labelled(self.policies(), "networkpolicy", id)
            .await
    }

    /// Deletes object `id` of `api` (a `kind`) if it exists and carries
    /// both labels, bound to the uid it read.
    async fn delete_labelled<K>(
        &self,
        api: Api<K>,
        kind: &str,
        id: &SandboxId,
    ) -> Result<(), RuntimeError>
    where
        K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let name = pod::object_name(id);
        let action = format!("delete {kind} {name}");
        let found = match api.get_opt(&name).await {
            Ok(p) => p,
            Err(e) => return Err(self.error(&format!("read {kind} {name}"), e)),
        };
        let Some(object) = found else { return Ok(()) };
        if !pod::is_ours(&self.settings, id, object.meta().labels.as_ref()) {
            return Err(RuntimeError::InvokeRuntime {
                action,
                detail: format!(
                    "the {kind} is not labelled for this deployment: not ours, not deleted"
                ),
            });
        }
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: object.meta().uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&name, &dp).await {
            Ok(_) => Ok(()),
            Err(e) if status_code(&e) == Some(404) => Ok(()),
            Err(e) => Err(self.error(&action, e)),
        }
    }

    async fn wait_gone(&self, name: &str, uid: Option<&str>) -> Result<(), RuntimeError> {
        let deadline = tokio::time::Instant::now() + self.settings.delete_timeout;
        loop {
            let found = self
                .pods()
                .get_opt(name)
                .await
                .map_err(|e| self.error(&format!("read pod {name}"), e))?;
            match found {
                None => return Ok(()),
                // A new Pod of the same name is not the one we deleted.
                Some(p) if p.metadata.uid.as_deref() != uid => return Ok(()),
                Some(_) => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(RuntimeError::InvokeRuntime {
                    action: format!("delete pod {name}"),
                    detail: format!(
                        "the pod was still there {:?} after its deletion",
                        self.settings.delete_timeout
                    ),
                });
            }
            tokio::time::sleep(self.settings.poll_interval).await;
        }
    }

    async fn create_inner(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        validate_spec(spec)?;
        if spec.network != NetworkProfile::None {
            return Err(RuntimeError::Unsupported {
                what: format!(
                    "network profile {:?} on the kubernetes runtime (only \"none\")",
                    spec.network.as_str()
                ),
            });
        }
        // The control plane binds envd into local sandboxes; in a Pod the
        // image carries it at the same path. Any other host path is refused.
        if let Some(b) = spec.binds.iter().find(|b| b.sandbox != spec.init[0]) {
            return Err(RuntimeError::Unsupported {
                what: format!(
                    "bind mount of a host path at {:?} on the kubernetes runtime",
                    b.sandbox
                ),
            });
        }
        let image = self
            .settings
            .images
            .get(&spec.template.name)
            .ok_or_else(|| RuntimeError::InvalidSpec {
                reason: format!(
                    "template {:?} has no image in [kubernetes.images]",
                    spec.template.name
                ),
            })?;
        let id = &spec.id;
        let name = pod::object_name(id);
        let pp = PostParams::default();
        match self
            .policies()
            .create(&pp, &pod::network_policy(&self.settings, id))
            .await
        {
            Ok(_) => {}
            // Left by an earlier create of the same id: its destroy removes it.
            Err(e) if status_code(&e) == Some(409) => {
                return Err(RuntimeError::AlreadyExists { id: id.clone() })
            }
            Err(e) => return Err(self.error(&format!("create networkpolicy {name}"), e)),
        }
        // A fresh secret per sandbox; it leaves this process only in the
        // Secret (and in this process's memory, for the relay).
        let secret = hex::encode(rand::random::<[u8; 32]>());
        match self
            .secrets()
            .create(&pp, &pod::bridge_secret(&self.settings, id, &secret))
            .await
        {
            Ok(_) => {}
            // The policy stays (as below): destroy(id) removes all of it.
            Err(e) if status_code(&e) == Some(409) => {
                return Err(RuntimeError::AlreadyExists { id: id.clone() })
            }
            Err(e) => {
                let err = self.error(&format!("create secret {name}"), e);
                return Err(err.with_cleanup(self.delete_rest(id).await));
            }
        }
        let created = match self
            .pods()
            .create(&pp, &pod::pod(&self.settings, spec, image))
            .await
        {
            Ok(p) => p,
            // The policy and the secret stay: the policy denies traffic to
            // the existing Pod of this id too, and destroy(id) removes all.
            Err(e) if status_code(&e) == Some(409) => {
                return Err(RuntimeError::AlreadyExists { id: id.clone() })
            }
            Err(e) => {
                let err = self.error(&format!("create pod {name}"), e);
                return Err(err.with_cleanup(self.delete_rest(id).await));
            }
        };
        let Some(uid) = created.metadata.uid.clone() else {
            let err = RuntimeError::ParseState {
                detail: format!("the API server's answer to create pod {name} has no uid"),
            };
            return Err(err.with_cleanup(self.delete_all(id).await));
        };
        let relayed = async {
            let running = self.wait_running(id, &uid).await?;
            let bridge = self.bridge(&running, secret)?;
            self.ensure_relay(id, bridge)
        }
        .await;
        match relayed {
            Ok(socket) => Ok(SandboxHandle {
                id: id.clone(),
                runtime: RUNTIME_NAME.into(),
                runtime_instance_id: uid,
                control_dir: self.relay_dir_of(id),
                workspace_dir: PathBuf::from(NO_HOST_DIR),
                // the relay's listener: this process
                init_pid: std::process::id(),
                envd: Some(EnvdEndpoint {
                    socket,
                    peer_pid: std::process::id(),
                }),
            }),
            Err(e) => {
                let cleanup = self.stop_relay(id).and(self.delete_all(id).await);
                Err(e.with_cleanup(cleanup))
            }
        }
    }
}

#[derive(serde::Deserialize)]
struct PodMetrics {
    containers: Vec<ContainerMetrics>,
}

#[derive(serde::Deserialize)]
struct ContainerMetrics {
    usage: BTreeMap<String, String>,
}

#[async_trait]
impl Runtime for KubeRuntime {
    fn name(&self) -> &str {
        RUNTIME_NAME
    }

    #[tracing::instrument(skip_all, fields(sandbox.id = %spec.id))]
    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle, RuntimeError> {
        self.create_inner(spec).await
    }

    #[tracing::instrument(skip_all, fields(sandbox.id = %id))]
    async fn destroy(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        self.stop_relay(id)?;
        self.delete_all(id).await?;
        self.memory_peaks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        Ok(())
    }

    async fn status(&self, id: &SandboxId) -> Result<RuntimeStatus, RuntimeError> {
        let Some(p) = self.our_pod(id).await? else {
            return Ok(RuntimeStatus::NotFound);
        };
        if p.metadata.deletion_timestamp.is_some() {
            return Ok(RuntimeStatus::Stopped);
        }
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        // Pending and Unknown are not running either: Kubernetes has no
        // paused state, and nothing but Running runs PID 1.
        Ok(match phase {
            Some("Running") => RuntimeStatus::Running,
            _ => RuntimeStatus::Stopped,
        })
    }

    async fn usage(&self, id: &SandboxId) -> Result<ResourceUsage, RuntimeError> {
        let Some(p) = self.our_pod(id).await? else {
            return Err(RuntimeError::NotFound { id: id.clone() });
        };
        let oom_kills = p
            .status
            .and_then(|s| s.container_statuses)
            .unwrap_or_default()
            .iter()
            .filter(|c| {
                [c.state.as_ref(), c.last_state.as_ref()]
                    .into_iter()
                    .flatten()
                    .any(|s| {
                        s.terminated
                            .as_ref()
                            .is_some_and(|t| t.reason.as_deref() == Some("OOMKilled"))
                    })
            })
            .count() as u64;
        let name = pod::object_name(id);
        let action = format!("read metrics of pod {name} (metrics.k8s.io)");
        let req = http::Request::get(format!(
            "/apis/metrics.k8s.io/v1beta1/namespaces/{}/pods/{name}",
            self.settings.namespace
        ))
        .body(Vec::new())
        .map_err(|e| RuntimeError::InvokeRuntime {
            action: action.clone(),
            detail: e.to_string(),
        })?;
        let metrics: PodMetrics = match self.client.request(req).await {
            Ok(m) => m,
            Err(e) if status_code(&e) == Some(404) => {
                return Err(RuntimeError::InvokeRuntime {
                    action,
                    detail: format!(
                    "no metrics (is metrics-server installed, and has it scraped the pod yet?): {}",
                    chain(&e)
                ),
                })
            }
            Err(e) => return Err(self.error(&action, e)),
        };
        let mut memory = 0u64;
        for c in &metrics.containers {
            let raw = c.usage.get("memory").map(String::as_str).unwrap_or("0");
            let bytes = pod::quantity_bytes(raw).ok_or_else(|| RuntimeError::ParseState {
                detail: format!("memory quantity {raw:?} in the metrics of pod {name}"),
            })?;
            memory = memory.saturating_add(bytes);
        }
        let peak = {
            let mut peaks = self.memory_peaks.lock().unwrap_or_else(|e| e.into_inner());
            let peak = peaks.entry(id.clone()).or_insert(0);
            *peak = (*peak).max(memory);
            *peak
        };
        Ok(ResourceUsage {
            memory_current_bytes: memory,
            memory_peak_bytes: peak,
            // metrics.k8s.io gives a CPU rate over a window, not a counter,
            // and no process count: both stay 0 on this runtime.
            cpu_usage_ns: 0,
            oom_kills,
            pids_current: 0,
            disk_free_bytes: None,
        })
    }

    /// The relay of `id`, started again if this process has none (after a
    /// restart): the Pod's address and the Secret are read back.
    async fn envd_endpoint(&self, id: &SandboxId) -> Result<EnvdEndpoint, RuntimeError> {
        let known = self
            .relays
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(id);
        if !known {
            let Some(p) = self.our_pod(id).await? else {
                return Err(RuntimeError::NotFound { id: id.clone() });
            };
            if !matches!(self.progress(p.clone()), Progress::Running)
                || p.metadata.deletion_timestamp.is_some()
            {
                return Err(RuntimeError::InvokeRuntime {
                    action: format!("reach envd of {id}"),
                    detail: "its pod is not running".into(),
                });
            }
            let secret = self.read_secret(id).await?;
            let bridge = self.bridge(&p, secret)?;
            self.ensure_relay(id, bridge)?;
        }
        Ok(EnvdEndpoint {
            socket: self.relay_dir_of(id).join(ENVD_SOCKET_NAME),
            peer_pid: std::process::id(),
        })
    }

    async fn list(&self) -> Result<Vec<SandboxId>, RuntimeError> {
        let lp = ListParams::default().labels(&pod::deployment_selector(&self.settings));
        let pods = self
            .pods()
            .list(&lp)
            .await
            .map_err(|e| self.error("list pods", e))?;
        let policies = self
            .policies()
            .list(&lp)
            .await
            .map_err(|e| self.error("list networkpolicies", e))?;
        let labels = pods
            .items
            .iter()
            .map(|p| p.metadata.labels.as_ref())
            .chain(policies.items.iter().map(|p| p.metadata.labels.as_ref()));
        let mut ids = BTreeSet::new();
        for l in labels.flatten() {
            let Some(value) = l.get(pod::SANDBOX_LABEL) else {
                continue;
            };
            match value.parse::<SandboxId>() {
                // A policy left alone by a crashed create is listed too, so
                // the reconciler's destroy removes it.
                Ok(id) => {
                    ids.insert(id);
                }
                Err(_) => {
                    tracing::warn!(label = %value, "object with a malformed sandbox label ignored")
                }
            }
        }
        Ok(ids.into_iter().collect())
    }
}
