//! Aviary's HTTP server: the v1 API over the control-plane library
//! (`aviary-control`), and the place where backends are chosen.
//!
//! [`build`] picks the backends from the configuration (the embedded
//! default: SQLite registry with its lease table, in-process locks, the OCI
//! runtime on crun or runc, the local template store and chunk store, `aviary
//! node` agents over HTTP) and hands them to `ControlPlane::new`; [`http`]
//! turns requests into one control-plane operation each (handlers parse,
//! call, map the error through [`error::ApiError`]); [`edge`] is the accept
//! loop with its timeouts, connection caps and rate limits; [`start`] runs
//! the background tasks (lease/TTL sweep, envd health probe, the periodic
//! reconciler, pool refill, chunk collection).
//!
//! In-process state here: the edge's per-key rate-limit buckets and per-IP
//! connection counts (limits of this process's listener). The control
//! plane's own in-process state is listed in `aviary-control`'s crate doc.
#![forbid(unsafe_code)]

pub mod backends;
pub mod config;
pub mod console;
pub mod edge;
pub mod error;
pub mod http;
pub mod leader;
pub mod ports;
pub mod procs;
mod side_files;
pub mod tty;
pub mod usage;

// The control plane's modules, where callers of the server found them.
pub use aviary_control::{keys, lifecycle, metrics, nodes, ops, planning, pools, projection};
pub use aviary_control::{scopes, snapshots, validate};

use anyhow::Context;
use aviary_control::ControlPlane;
use config::ServerConfig;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Opens the registry, the runtime and the template store.
pub async fn build(cfg: ServerConfig) -> anyhow::Result<Arc<ControlPlane>> {
    create_private_dir(&cfg.data_dir)?;
    check_static_binary(&cfg.control.envd_binary)?;
    let stores = open_stores(&cfg).await?;
    // the default runtime first, then the others the node serves; each in
    // its own state dir, all claiming user-id ranges in the default's
    let mut names = vec![cfg.runtime];
    names.extend(
        cfg.control
            .settings
            .server
            .runtimes
            .iter()
            .copied()
            .filter(|r| *r != cfg.runtime),
    );
    let mut runtimes = Vec::new();
    let mut state_dirs = Vec::new();
    // the node's egress proxy (the `allowlist` profile), shared by its runtimes
    let (egress, denials) = aviary_egress::EgressProxy::new(tokio::runtime::Handle::current());
    // the `open` profile, when the operator turned it on: NAT by slirp4netns
    let open_network = if cfg.control.settings.server.open_network {
        Some(find_in_path("slirp4netns").context(
            "[server] open_network = true needs slirp4netns (scripts/deps.sh installs it)",
        )?)
    } else {
        None
    };
    for name in names {
        if name == aviary_core::RuntimeName::Kubernetes {
            runtimes.push(kubernetes_runtime(&cfg).await?);
            continue;
        }
        let state = cfg.runtime_state_dir_of(name);
        if name == aviary_core::RuntimeName::Docker {
            runtimes.push(docker_runtime(&cfg, state.clone()).await?);
            state_dirs.push(state);
            continue;
        }
        if name.is_remote() {
            runtimes.push(remote_runtime(&cfg, name, state).await?);
            continue;
        }
        let binary = aviary_runtime_oci::OciBinary::try_from(name)?;
        let mut oci = aviary_runtime_oci::OciConfig::new(binary, state.clone())
            .with_template_store(cfg.templates_root());
        oci.id_dir = Some(cfg.runtime_state_dir());
        oci.disk_pool = cfg.control.settings.server.disk_pool;
        oci.disk_fs = match cfg.control.settings.server.disk_fs {
            aviary_config::DiskFs::Ext4 => aviary_runtime_oci::DiskFs::Ext4,
            aviary_config::DiskFs::Xfs => aviary_runtime_oci::DiskFs::Xfs,
        };
        let mut runtime = aviary_runtime_oci::OciRuntime::new(oci)
            .with_context(|| format!("setting up the OCI runtime {name}"))?
            .with_egress(Arc::new(egress.clone()));
        if let Some(slirp) = &open_network {
            runtime = runtime.with_open_network(slirp);
        }
        runtime
            .probe()
            .await
            .with_context(|| format!("OCI runtime {name}: self-check failed"))?;
        let runtime = Arc::new(runtime);
        runtimes.push(if name == aviary_core::RuntimeName::Runsc {
            // gVisor: hibernate keeps memory (runsc checkpoint / restore)
            aviary_runtime::CapableRuntime::checkpointable(runtime)
        } else {
            aviary_runtime::CapableRuntime::snapshottable(runtime)
        });
        state_dirs.push(state);
    }
    let templates = Arc::new(
        aviary_templates::TemplateStore::open(cfg.templates_root()).with_context(|| {
            format!("opening template store {}", cfg.templates_root().display())
        })?,
    );
    let chunk_store = open_snapshot_store(&cfg).await?;
    tighten_data_dir(&cfg.data_dir, &state_dirs)?;
    let data_dir = cfg.data_dir.clone();
    // Backends are chosen here, and only here: a new registry, coordination
    // store, runtime or chunk store is one more arm where its kind is read
    // from the configuration.
    let registry = stores.registry.clone();
    let backends = aviary_control::Backends {
        coordination: stores.coordination,
        registry: stores.registry,
        runtimes: aviary_control::RuntimeSet::new(runtimes).map_err(anyhow::Error::msg)?,
        chunks: chunk_store,
        trees: Arc::new(backends::HostTrees),
        templates: Arc::new(backends::LocalTemplates(templates)),
        nodes: Arc::new(backends::AgentConnector),
    };
    let cp = ControlPlane::new(cfg.control, backends)?;
    tokio::spawn(report_egress_denials(Arc::downgrade(&cp), denials));
    side_files::import_all(registry.as_ref(), &data_dir).await?;
    Ok(cp)
}

/// A remote provider's runtime (`[remote_e2b]`, `[remote_opensandbox]`),
/// its key read from the variable or file the configuration names (never
/// logged), checked before the server takes requests: the provider must
/// answer a listing of this runtime's sandboxes (start-up needs it anyway,
/// and a refused key or a wrong URL is clearest said here).
async fn remote_runtime(
    cfg: &ServerConfig,
    name: aviary_core::RuntimeName,
    state_dir: std::path::PathBuf,
) -> anyhow::Result<aviary_runtime::CapableRuntime> {
    use aviary_runtime_remote::{RemoteConfig, RemoteRuntime};
    let settings = &cfg.control.settings;
    let missing = || format!("runtime {name} needs a [remote_{name}] table");
    let capable = |runtime: Arc<dyn aviary_runtime::Runtime>,
                   pausable: Option<Arc<dyn aviary_runtime::Pausable>>| async move {
        let found = runtime.list().await.with_context(|| {
            format!("runtime {name}: the provider did not answer as configured in [remote_{name}]")
        })?;
        tracing::info!(runtime = %name, sandboxes = found.len(), "remote runtime ready");
        anyhow::Ok(aviary_runtime::CapableRuntime {
            runtime,
            pausable,
            snapshottable: None,
            checkpointable: None,
        })
    };
    match name {
        aviary_core::RuntimeName::Opensandbox => {
            let s = settings.remote_opensandbox.as_ref().with_context(missing)?;
            let api_key =
                remote_api_key(name, s.api_key_env.as_deref(), s.api_key_file.as_deref())?;
            let runtime = RemoteRuntime::opensandbox(
                RemoteConfig {
                    name: name.as_str().to_owned(),
                    state_dir,
                    templates: s.templates.clone(),
                    timeout_s: s.timeout_s,
                },
                aviary_runtime_remote::opensandbox::OsbEndpoint {
                    url: s.url.clone(),
                    api_key,
                    request_timeout: Duration::from_secs(s.request_timeout_s),
                    ready_timeout: Duration::from_secs(s.ready_timeout_s),
                    deny_egress: s.deny_egress,
                },
            )
            .with_context(|| format!("setting up runtime {name}"))?;
            let runtime = Arc::new(runtime);
            // a provider that cannot pause: the runtime has no Pausable
            let pausable = s
                .pausable
                .then(|| runtime.clone() as Arc<dyn aviary_runtime::Pausable>);
            capable(runtime, pausable).await
        }
        _ => {
            let s = settings.remote_e2b.as_ref().with_context(missing)?;
            let api_key =
                remote_api_key(name, s.api_key_env.as_deref(), s.api_key_file.as_deref())?;
            let runtime = RemoteRuntime::e2b(
                RemoteConfig {
                    name: name.as_str().to_owned(),
                    state_dir,
                    templates: s.templates.clone(),
                    timeout_s: s.timeout_s,
                },
                aviary_runtime_remote::e2b::E2bEndpoint {
                    api_url: s.api_url.clone(),
                    sandbox_url: s.sandbox_url.clone(),
                    domain: s.domain.clone(),
                    port_url: s.port_url.clone(),
                    proxy_key: s.proxy_key,
                    api_key,
                },
            )
            .with_context(|| format!("setting up runtime {name}"))?;
            let runtime = Arc::new(runtime);
            capable(runtime.clone(), Some(runtime)).await
        }
    }
}

/// A remote runtime's API key, from the variable or the file (its first
/// line) its table names; never empty.
fn remote_api_key(
    name: aviary_core::RuntimeName,
    env: Option<&str>,
    file: Option<&std::path::Path>,
) -> anyhow::Result<String> {
    let api_key = match (env, file) {
        (Some(var), _) => std::env::var(var)
            .with_context(|| format!("[remote_{name}] api_key_env: {var} is not set"))?,
        (None, Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("[remote_{name}] api_key_file: reading {}", file.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned(),
        (None, None) => anyhow::bail!("[remote_{name}] names no API key"),
    };
    anyhow::ensure!(
        !api_key.trim().is_empty(),
        "[remote_{name}]: the API key is empty"
    );
    Ok(api_key.trim().to_owned())
}

/// The `docker` runtime on the dockerd of `[server] docker_socket`, checked
/// before the server takes requests.
async fn docker_runtime(
    cfg: &ServerConfig,
    state: std::path::PathBuf,
) -> anyhow::Result<aviary_runtime::CapableRuntime> {
    let socket = &cfg.control.settings.server.docker_socket;
    let config = aviary_runtime_docker::DockerConfig::new(socket, state)
        .with_template_store(cfg.templates_root());
    let docker = aviary_runtime_docker::DockerRuntime::connect(config)
        .await
        .with_context(|| format!("docker runtime: dockerd at {}", socket.display()))?;
    let version = docker
        .probe()
        .await
        .context("docker runtime: self-check failed")?;
    tracing::info!(%version, "docker runtime ready");
    Ok(aviary_runtime::CapableRuntime::snapshottable(Arc::new(
        docker,
    )))
}

/// The Kubernetes runtime of `[kubernetes]` (the configuration guarantees
/// the table when `server.runtimes` lists it). Connecting reads the
/// credentials and makes the relay dir (default: the runtime's state dir
/// under the data dir) only: an unreachable API server shows on the first
/// create.
#[cfg(feature = "kubernetes")]
async fn kubernetes_runtime(cfg: &ServerConfig) -> anyhow::Result<aviary_runtime::CapableRuntime> {
    let k = cfg
        .control
        .settings
        .kubernetes
        .as_ref()
        .context("server.runtimes lists kubernetes but [kubernetes] is missing")?;
    let access = match &k.kubeconfig {
        Some(path) => aviary_runtime_kube::ApiAccess::Kubeconfig {
            path: path.clone(),
            context: k.context.clone(),
        },
        None => aviary_runtime_kube::ApiAccess::InCluster,
    };
    let runtime = aviary_runtime_kube::KubeRuntime::connect(
        &access,
        aviary_runtime_kube::KubeSettings {
            namespace: k.namespace.clone(),
            deployment: k.deployment.clone(),
            runtime_class: k.runtime_class.clone(),
            images: k.images.clone(),
            run_as_user: k.run_as_user,
            ready_timeout: Duration::from_secs(k.ready_timeout_s),
            delete_timeout: Duration::from_secs(k.delete_timeout_s),
            poll_interval: Duration::from_millis(500),
            envd_port: k.envd_port,
            envd_from: k.envd_from.clone(),
            relay_dir: k
                .relay_dir
                .clone()
                .unwrap_or_else(|| cfg.runtime_state_dir_of(aviary_core::RuntimeName::Kubernetes)),
        },
    )
    .await
    .context("setting up the Kubernetes runtime")?;
    Ok(aviary_runtime::CapableRuntime::basic(Arc::new(runtime)))
}

#[cfg(not(feature = "kubernetes"))]
async fn kubernetes_runtime(_cfg: &ServerConfig) -> anyhow::Result<aviary_runtime::CapableRuntime> {
    anyhow::bail!(
        "this build has no Kubernetes runtime (cargo feature `kubernetes` of aviary-server)"
    )
}

/// `program` in `PATH`, or an error naming it.
fn find_in_path(program: &str) -> anyhow::Result<std::path::PathBuf> {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow::anyhow!("{program} not found in PATH"))
}

/// Every refusal of the egress proxy becomes an `egress_denied` event and a
/// taint (`ControlPlane::egress_denied`), until the control plane is gone.
async fn report_egress_denials(
    cp: std::sync::Weak<ControlPlane>,
    mut denials: tokio::sync::mpsc::Receiver<aviary_core::egress::EgressDenial>,
) {
    while let Some(d) = denials.recv().await {
        let Some(cp) = cp.upgrade() else { return };
        if let Err(e) = cp.egress_denied(&d).await {
            tracing::warn!(sandbox.id = %d.sandbox, error = %e, "recording an egress denial failed");
        }
    }
}

/// The registry and the coordination store a control plane runs on.
struct Stores {
    registry: Arc<dyn aviary_registry::Registry>,
    coordination: aviary_leases::Coordination,
}

/// The embedded default (SQLite in the data dir: the registry, its lease
/// table and fencing counter; locks in this process), or `[distributed]`:
/// the PostgreSQL registry (source of record and fencing counter) and Redis
/// (leases, locks) every replica shares. An unreachable service stops the
/// start with an error naming it (host:port, never a password).
async fn open_stores(cfg: &ServerConfig) -> anyhow::Result<Stores> {
    let d = &cfg.control.settings.distributed;
    d.check_complete().map_err(anyhow::Error::msg)?;
    let (Some(reg_url), Some(coord_url)) = (&d.registry, &d.coordination) else {
        create_registry_file(&cfg.registry_path())?;
        let registry = Arc::new(
            aviary_registry_sqlite::SqliteRegistry::open(&cfg.registry_path())
                .await
                .with_context(|| format!("opening registry {}", cfg.registry_path().display()))?,
        );
        return Ok(Stores {
            registry: registry.clone(),
            coordination: aviary_leases::Coordination {
                // this process alone writes the embedded lease table (its
                // locks are in-process too): a lease check is answered from
                // memory until the sandbox's lease changes
                leases: Arc::new(aviary_leases::CachedLeaseStore::new(registry.clone())),
                locks: Arc::new(aviary_leases::InProcessLocks::new()),
                fences: registry,
            },
        });
    };
    let url = reg_url.resolve_from_env().map_err(anyhow::Error::msg)?;
    let opts = aviary_registry_postgres::PostgresOptions {
        schema: d.schema.clone(),
        ..Default::default()
    };
    let pg = Arc::new(
        aviary_registry_postgres::PostgresRegistry::connect(&url, opts)
            .await
            .map_err(|e| anyhow::anyhow!("registry {reg_url}: {e}"))?,
    );
    let url = coord_url.resolve_from_env().map_err(anyhow::Error::msg)?;
    let conn = aviary_coord_redis::connect(&url)
        .await
        .map_err(|e| anyhow::anyhow!("coordination {coord_url}: {}", error_chain(&e)))?;
    Ok(Stores {
        registry: pg.clone(),
        coordination: aviary_leases::Coordination {
            leases: Arc::new(aviary_coord_redis::RedisLeaseStore::new(
                conn.clone(),
                pg.clone(),
                d.key_prefix.clone(),
            )),
            locks: Arc::new(aviary_coord_redis::RedisLocks::new(
                conn,
                d.key_prefix.clone(),
            )),
            fences: pg,
        },
    })
}

/// An error and its sources, `: `-joined.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// Registers the bootstrap admin key kept in `<data dir>/admin.key` (made
/// and written, 0600, on the first start).
async fn ensure_admin_key(cp: &ControlPlane, path: &Path) -> anyhow::Result<String> {
    let existing = std::fs::read_to_string(path).ok();
    let key = cp
        .ensure_admin_key(existing.as_deref())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    if existing.as_deref().map(str::trim) != Some(key.as_str()) {
        write_secret_file(path, &key)
            .with_context(|| format!("writing the admin key to {}", path.display()))?;
    }
    Ok(key)
}

fn write_secret_file(path: &Path, content: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(content.as_bytes())?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    std::fs::rename(tmp, path)
}

/// The configured snapshot store (`[snapshots]`).
pub async fn open_snapshot_store(
    cfg: &ServerConfig,
) -> anyhow::Result<Arc<dyn aviary_snapshots::ChunkStore>> {
    use aviary_config::SnapshotStore;
    let env = |name: &str| {
        std::env::var(name)
            .with_context(|| format!("snapshot store: environment variable {name} is not set"))
    };
    Ok(match &cfg.control.settings.snapshots.store {
        SnapshotStore::Local => Arc::new(aviary_snapshots::LocalStore::open(
            cfg.data_dir.join("snapshots"),
        )?),
        SnapshotStore::S3 {
            endpoint,
            region,
            bucket,
            prefix,
            access_key_env,
            secret_key_env,
        } => Arc::new(
            aviary_snapshots::S3Store::connect(aviary_snapshots::S3Config {
                endpoint: endpoint.clone(),
                region: region.clone(),
                bucket: bucket.clone(),
                access_key: env(access_key_env)?,
                secret_key: env(secret_key_env)?,
                prefix: prefix.clone(),
            })
            .await
            .context("connecting to the S3 snapshot store")?,
        ),
        SnapshotStore::Redis { url, prefix } => Arc::new(
            aviary_snapshots::RedisStore::connect(url, prefix)
                .await
                .context("connecting to the Redis snapshot store")?,
        ),
        SnapshotStore::Postgres { url_env, namespace } => Arc::new(
            aviary_snapshots::PgStore::connect(&env(url_env)?, namespace)
                .await
                .context("connecting to the PostgreSQL snapshot store")?,
        ),
    })
}

/// A server started in this process (used by `aviary serve` and the tests).
pub struct RunningServer {
    pub addr: SocketAddr,
    /// The configuration it was started with.
    pub cfg: ServerConfig,
    pub admin_key: String,
    pub control_plane: Arc<ControlPlane>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningServer {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting requests and waits for the server task. Sandboxes keep
    /// running; the next start re-attaches to them.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        (&mut self.task).await.context("server task panicked")?
    }

    /// Waits until the server task ends (e.g. on a signal).
    pub async fn wait(mut self) -> anyhow::Result<()> {
        (&mut self.task).await.context("server task panicked")?
    }
}

/// How often the registry's node registrations are re-read.
const NODE_REFRESH: Duration = Duration::from_secs(3);

/// Starts the server: binds, begins preparing templates in the background
/// (`/readyz` says when done), and runs the lease/TTL sweep.
pub async fn start(
    cfg: ServerConfig,
    progress: impl Fn(&str) + Send + Sync + 'static,
) -> anyhow::Result<RunningServer> {
    let listen = cfg.listen;
    let sweep_every = Duration::from_millis(cfg.control.sweep_interval_ms.max(50));
    let admin_key_path = cfg.admin_key_path();
    let server = Arc::new(http::ServerSettings {
        max_json_bytes: cfg.max_json_bytes,
        max_upload_bytes: cfg.max_upload_bytes,
        max_archive_bytes: cfg.max_archive_bytes,
        spool_dir: cfg.spool_dir(),
    });
    let started_with = cfg.clone();
    let cp = build(cfg).await?;
    let admin_key = ensure_admin_key(&cp, &admin_key_path).await?;
    cp.load_nodes().await;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let addr = listener.local_addr()?;
    let (leader, leader_task) = leader::Leadership::run(
        cp.locks.clone(),
        format!("replica {addr} pid {}", std::process::id()),
        leader::LEADER_TTL,
    );
    let prep = cp.clone();
    tokio::spawn(async move {
        if let Err(e) = prep.prepare(progress).await {
            tracing::error!(error = %e, "server could not get ready");
        }
    });
    let sweeper = cp.clone();
    let sweep_leader = leader.clone();
    let sweep_task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(sweep_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if sweeper.readiness() != aviary_control::Readiness::Ready {
                continue;
            }
            // the leader: leases registry-wide and the shared agents'
            // sandboxes; every replica: its own node's
            let scope = if sweep_leader.is_leader() {
                if let Err(e) = sweeper.sweep_leases().await {
                    tracing::warn!(error = %e, "lease sweep failed");
                }
                aviary_control::Reconciling::OwnNodeAndAgents
            } else {
                aviary_control::Reconciling::OwnNode
            };
            if let Err(e) = sweeper.sweep_node_as(scope).await {
                tracing::warn!(error = %e, "ttl/idle sweep failed");
            }
        }
    });
    let refiller = cp.clone();
    let refill_leader = leader.clone();
    let refill_task = tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = refiller.pools.refill.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            // pools are per node: every replica keeps its own node's, the
            // leader the agents'
            if refiller.readiness() != aviary_control::Readiness::Ready {
                continue;
            }
            let scope = if refill_leader.is_leader() {
                aviary_control::Reconciling::OwnNodeAndAgents
            } else {
                aviary_control::Reconciling::OwnNode
            };
            if let Err(e) = refiller.refill_pools_as(scope).await {
                tracing::warn!(error = %e, "pool refill failed");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    });
    let probe_task = tokio::spawn(probe_envds(cp.clone()));
    // every replica reconciles its own node; the leader also the agents
    let reconcile_task = tokio::spawn(reconcile(cp.clone(), leader.clone()));
    // node agents another replica registered (or that were down) are
    // connected on the next pass
    let nodes_cp = cp.clone();
    let nodes_task = tokio::spawn(async move {
        loop {
            tokio::time::sleep(NODE_REFRESH).await;
            nodes_cp.load_nodes().await;
        }
    });
    let gc_task = tokio::spawn(collect_chunks(cp.clone(), leader));
    let history_task = tokio::spawn(sample_metrics(cp.clone()));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let e2b = aviary_compat_e2b::E2bSettings {
        max_json_bytes: server.max_json_bytes,
        max_upload_bytes: server.max_upload_bytes,
        body_read_timeout: Duration::from_millis(cp.cfg.settings.server.edge.body_read_timeout_ms),
        // the v1 API's budgets (own buckets): per key, and per client
        // address for refused keys and tokens
        rate_limit: Some({
            let limiter = edge::RateLimiter::from_settings(&cp.cfg.settings.server.edge);
            Arc::new(
                move |charge: aviary_compat_e2b::Charge<'_>, ext: &axum::http::Extensions| {
                    let now = std::time::Instant::now();
                    match charge {
                        aviary_compat_e2b::Charge::Key(key) => limiter.take(key, now),
                        aviary_compat_e2b::Charge::FailedAuth => {
                            match ext.get::<edge::ClientAddr>() {
                                Some(a) => {
                                    limiter.take(&format!("e2b unauthenticated {}", a.0.ip()), now)
                                }
                                None => Ok(()),
                            }
                        }
                    }
                },
            )
        }),
    };
    // the E2B SDKs' API (E2B_API_URL=…/e2b) and envd (E2B_SANDBOX_URL=…/e2b/envd)
    let app = http::router(cp.clone(), server)
        .nest_service("/e2b", aviary_compat_e2b::router(cp.clone(), e2b));
    let edge_cp = cp.clone();
    let stopping_cp = cp.clone();
    let task = tokio::spawn(async move {
        let res = edge::serve(listener, app, edge_cp, async move {
            let _ = rx.await;
        })
        .await;
        sweep_task.abort();
        refill_task.abort();
        probe_task.abort();
        reconcile_task.abort();
        nodes_task.abort();
        gc_task.abort();
        history_task.abort();
        leader_task.abort();
        stopping_cp.release_spares();
        res.context("http server failed")
    });
    Ok(RunningServer {
        addr,
        cfg: started_with,
        admin_key,
        control_plane: cp,
        shutdown: Some(tx),
        task,
    })
}

/// Background task: asks every attached sandbox's envd for its health; a
/// sandbox whose envd is gone becomes `Lost` without waiting for a call.
async fn probe_envds(cp: Arc<ControlPlane>) {
    if cp.wait_ready().await != aviary_control::Readiness::Ready {
        return;
    }
    let every = Duration::from_millis(cp.cfg.health_probe_interval_ms.max(100));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        cp.probe_envds().await;
    }
}

/// Background task: the periodic reconciler (`ControlPlane::reconcile_as`):
/// its own node on every replica, the shared node agents only on the one
/// holding the leader lock. Start-up reconciled already, so the first pass
/// comes one interval after the server is ready.
async fn reconcile(cp: Arc<ControlPlane>, leader: leader::Leadership) {
    if cp.wait_ready().await != aviary_control::Readiness::Ready {
        return;
    }
    let every = Duration::from_millis(cp.cfg.reconcile_interval_ms.max(50));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let scope = if leader.is_leader() {
            aviary_control::Reconciling::OwnNodeAndAgents
        } else {
            aviary_control::Reconciling::OwnNode
        };
        match cp.reconcile_as(scope).await {
            Ok(r) if !r.is_quiet() => tracing::info!(report = ?r, "reconciler pass"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "reconciler pass failed"),
        }
    }
}

/// Background task: collects snapshot chunks no snapshot references, once
/// right after start-up and then periodically, so what a snapshot
/// interrupted by a crash wrote does not stay until an admin GC.
/// Samples the server's own metrics into the history `GET /v1/metrics/history`
/// serves (the console's charts), from the first moment the server is ready.
async fn sample_metrics(cp: Arc<ControlPlane>) {
    let every = Duration::from_millis(cp.cfg.metrics_history_interval_ms.max(100));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if cp.readiness() != aviary_control::Readiness::Ready {
            continue;
        }
        match cp.sandbox_counts_by_state().await {
            Ok(by_state) => {
                cp.metrics.record_sample(cp.live_count(), &by_state);
            }
            Err(e) => tracing::warn!(error = %e, "metrics history sample failed"),
        }
    }
}

async fn collect_chunks(cp: Arc<ControlPlane>, leader: leader::Leadership) {
    if cp.wait_ready().await != aviary_control::Readiness::Ready {
        return;
    }
    let every = Duration::from_secs(cp.cfg.chunk_gc_interval_s.max(1));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !leader.is_leader() {
            continue;
        }
        match cp.collect_unreferenced_chunks().await {
            Ok(r) if r.chunks_deleted > 0 => {
                tracing::info!(
                    deleted = r.chunks_deleted,
                    kept = r.chunks_kept,
                    "unreferenced snapshot chunks collected"
                )
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "background chunk collection failed"),
        }
    }
}

/// The data dir is 0711: the OCI runtimes look a sandbox's rootfs up from
/// inside its user namespace (an unprivileged host uid), so every parent of
/// the runtime state dir must be traversable; nothing in it may be listed or
/// read by other users.
fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("creating data dir {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
        .with_context(|| format!("restricting data dir {}", dir.display()))?;
    Ok(())
}

/// The embedded registry file, pre-created 0600 (SQLite gives its -wal/-shm
/// files the same mode).
fn create_registry_file(db: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(db)
        .with_context(|| format!("creating registry file {}", db.display()))?;
    Ok(())
}

/// Everything in the data dir but the runtime's state dir (which manages its
/// own modes) becomes owner-only: dirs 0700, files 0600.
fn tighten_data_dir(dir: &Path, runtime_states: &[std::path::PathBuf]) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        if runtime_states.contains(&path) {
            continue;
        }
        let meta = std::fs::symlink_metadata(&path)?;
        let mode = if meta.is_dir() {
            0o700
        } else if meta.is_file() {
            0o600
        } else {
            continue;
        };
        if meta.permissions().mode() & 0o777 != mode {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                .with_context(|| format!("restricting {}", path.display()))?;
        }
    }
    Ok(())
}

/// envd is bind-mounted into templates with any libc (or none), so it must be
/// statically linked: refuse an ELF with a program interpreter.
pub fn check_static_binary(path: &Path) -> anyhow::Result<()> {
    let data = std::fs::read(path).with_context(|| {
        format!(
            "reading envd binary {} (build it with scripts/build-envd.sh, or set AVIARY_ENVD)",
            path.display()
        )
    })?;
    anyhow::ensure!(
        data.len() > 64 && &data[..4] == b"\x7fELF" && data[4] == 2,
        "{} is not a 64-bit ELF binary",
        path.display()
    );
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(data[0x20..0x28].try_into()?) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    for i in 0..phnum {
        let off = phoff + i * phentsize;
        anyhow::ensure!(off + 4 <= data.len(), "truncated ELF program headers");
        let p_type = u32::from_le_bytes(data[off..off + 4].try_into()?);
        anyhow::ensure!(
            p_type != 3,
            "{} is dynamically linked; envd must be static (scripts/build-envd.sh)",
            path.display()
        );
    }
    Ok(())
}
