//! Aviary's control plane.
//!
//! Owns the lifecycle of sandboxes: it turns API calls into registry
//! transitions, runtime actions and envd calls ([`ops::ControlPlane`]),
//! serves them over HTTP ([`http`]), and runs the background tasks: the
//! sweep that expires leases and TTLs, the envd health probe that finds lost
//! sandboxes, pool refill, and the collection of unreferenced snapshot chunks.
//!
//! Concurrency: one tokio runtime; per-sandbox ordering comes from the
//! registry's optimistic versions and the lease store's fencing tokens. Work
//! that must not overlap across requests takes a named lock of the
//! coordination backend (`aviary_leases::Locks`), never an in-process
//! `Mutex`: `bucket/<bucket>` (a scope bucket's find-or-create, `scopes`),
//! `lifecycle/<id>` (hibernate/wake, `lifecycle`), `placement/nodes` (a
//! placement until its row exists, `nodes`), `pool/<class>/<template>/<runtime>`
//! (one refill pass of a pool, `pools`; claims are version-checked in the
//! registry instead) and `fence/<id>` (fence pushes to one envd, `ops`).
//!
//! In-process state that remains, none of it a record or a serialisation of
//! cross-request work:
//! - live handles: the attached sandboxes' envd clients and their per-process
//!   flags (paused, running execs, last activity; `ops::LiveSandbox`), and
//!   the connected node agents' clients (`nodes`). They are rebuilt from the
//!   registry and the runtimes at start-up; a replica knows the sandboxes it
//!   attached.
//! - caches: resolved API keys (`keys`, emptied on every revocation), when
//!   `last_active_at` was last written per sandbox (to rate-limit that
//!   write), the last projection index per sandbox (`projection`; a missing
//!   one costs a full upload, not correctness).
//! - metrics and counters: request metrics, pool hits/misses and the last
//!   read hand-out count (`metrics`, `pools`), per process like every metric.
//! - the edge's per-key rate-limit buckets and per-IP connection counts
//!   (`edge`): limits of this process's listener.
//! - readiness, and the planner and policy built from the configuration.
#![forbid(unsafe_code)]

pub mod config;
pub mod edge;
pub mod error;
pub mod http;
pub mod keys;
pub mod lifecycle;
pub mod metrics;
pub mod nodes;
pub mod ops;
pub mod planning;
pub mod pools;
pub mod projection;
pub mod scopes;
pub mod snapshots;
pub mod validate;

use anyhow::Context;
use config::ServerConfig;
use ops::ControlPlane;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Opens the registry, the runtime and the template store.
pub async fn build(cfg: ServerConfig) -> anyhow::Result<Arc<ControlPlane>> {
    create_private_dir(&cfg.data_dir)?;
    check_static_binary(&cfg.envd_binary)?;
    let registry = Arc::new(
        aviary_registry_sqlite::SqliteRegistry::open(&cfg.registry_path())
            .await
            .with_context(|| format!("opening registry {}", cfg.registry_path().display()))?,
    );
    let runtime = aviary_runtime_oci::OciRuntime::new(
        aviary_runtime_oci::OciConfig::new(
            aviary_runtime_oci::OciBinary::from(cfg.runtime),
            cfg.runtime_state_dir(),
        )
        .with_template_store(cfg.templates_root()),
    )
    .context("setting up the OCI runtime")?;
    runtime
        .probe()
        .await
        .context("OCI runtime self-check failed")?;
    let templates = Arc::new(
        aviary_templates::TemplateStore::open(cfg.templates_root()).with_context(|| {
            format!("opening template store {}", cfg.templates_root().display())
        })?,
    );
    let chunk_store = open_snapshot_store(&cfg).await?;
    tighten_data_dir(&cfg.data_dir, &cfg.runtime_state_dir())?;
    let runtime = Arc::new(runtime);
    // the embedded default: leases in the registry's database, locks in
    // this process
    let coordination = aviary_leases::Coordination {
        leases: registry.clone(),
        locks: Arc::new(aviary_leases::InProcessLocks::new()),
    };
    let cp = ControlPlane::new(
        cfg,
        registry,
        coordination,
        aviary_runtime::CapableRuntime::snapshottable(runtime),
        templates,
        chunk_store,
    )?;
    import_side_files(&cp).await?;
    Ok(cp)
}

/// Moves the JSON side files older versions kept in the data dir (snapshot
/// index, pool bounds, node registrations) into the registry, once: each is
/// removed after its content is stored, and a repeated import (after a crash
/// in between) stores the same rows again.
async fn import_side_files(cp: &ControlPlane) -> anyhow::Result<()> {
    let snapshots = cp
        .import_snapshot_index_files()
        .await
        .map_err(|e| anyhow::anyhow!("importing snapshot-index/: {e}"))?;
    let pools = cp
        .import_pools_file()
        .await
        .map_err(|e| anyhow::anyhow!("importing pools.json: {e}"))?;
    let nodes = cp
        .import_nodes_file()
        .await
        .map_err(|e| anyhow::anyhow!("importing nodes.json: {e}"))?;
    if snapshots + pools + nodes > 0 {
        tracing::info!(
            snapshots,
            pools,
            nodes,
            "data dir side files imported into the registry"
        );
    }
    Ok(())
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
    Ok(match &cfg.settings.snapshots.store {
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

/// Starts the server: binds, begins preparing templates in the background
/// (`/readyz` says when done), and runs the lease/TTL sweep.
pub async fn start(
    cfg: ServerConfig,
    progress: impl Fn(&str) + Send + Sync + 'static,
) -> anyhow::Result<RunningServer> {
    let listen = cfg.listen;
    let sweep_every = Duration::from_millis(cfg.sweep_interval_ms.max(50));
    let cp = build(cfg).await?;
    let admin_key = cp
        .ensure_admin_key()
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    cp.load_nodes().await;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let addr = listener.local_addr()?;
    let prep = cp.clone();
    tokio::spawn(async move {
        if let Err(e) = prep.prepare(progress).await {
            tracing::error!(error = %e, "server could not get ready");
        }
    });
    let sweeper = cp.clone();
    let sweep_task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(sweep_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if sweeper.readiness() != ops::Readiness::Ready {
                continue;
            }
            if let Err(e) = sweeper.sweep().await {
                tracing::warn!(error = %e, "sweep failed");
            }
        }
    });
    let refiller = cp.clone();
    let refill_task = tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = refiller.pools.refill.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            if refiller.readiness() != ops::Readiness::Ready {
                continue;
            }
            if let Err(e) = refiller.refill_pools().await {
                tracing::warn!(error = %e, "pool refill failed");
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        }
    });
    let probe_task = tokio::spawn(probe_envds(cp.clone()));
    let gc_task = tokio::spawn(collect_chunks(cp.clone()));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = http::router(cp.clone());
    let edge_cp = cp.clone();
    let task = tokio::spawn(async move {
        let res = edge::serve(listener, app, edge_cp, async move {
            let _ = rx.await;
        })
        .await;
        sweep_task.abort();
        refill_task.abort();
        probe_task.abort();
        gc_task.abort();
        res.context("http server failed")
    });
    Ok(RunningServer {
        addr,
        admin_key,
        control_plane: cp,
        shutdown: Some(tx),
        task,
    })
}

/// Background task: asks every attached sandbox's envd for its health; a
/// sandbox whose envd is gone becomes `Lost` without waiting for a call.
async fn probe_envds(cp: Arc<ControlPlane>) {
    if cp.wait_ready().await != ops::Readiness::Ready {
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

/// Background task: collects snapshot chunks no snapshot references, once
/// right after start-up and then periodically, so what a snapshot
/// interrupted by a crash wrote does not stay until an admin GC.
async fn collect_chunks(cp: Arc<ControlPlane>) {
    if cp.wait_ready().await != ops::Readiness::Ready {
        return;
    }
    let every = Duration::from_secs(cp.cfg.chunk_gc_interval_s.max(1));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
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
/// read by other users. The registry file is pre-created 0600 (SQLite gives
/// its -wal/-shm files the same mode).
fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    std::fs::create_dir_all(dir).with_context(|| format!("creating data dir {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
        .with_context(|| format!("restricting data dir {}", dir.display()))?;
    let db = dir.join("registry.db");
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&db)
        .with_context(|| format!("creating registry file {}", db.display()))?;
    Ok(())
}

/// Everything in the data dir but the runtime's state dir (which manages its
/// own modes) becomes owner-only: dirs 0700, files 0600.
fn tighten_data_dir(dir: &Path, runtime_state: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        if path == runtime_state {
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
