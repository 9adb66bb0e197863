//! Workspace projection (seed 000, issue 4 part 8): the configured
//! `[[projection]]` host roots (`AGENTS.md`, `skills/`, `knowledge/`, ...) are
//! synced one-way into a sandbox every time it starts — create, wake, pool
//! refill, and each time a scope hands a reused sandbox out.
//!
//! This module owns the server side of the sync: where the last synced index
//! lives, the [`ProjectionTarget`] over the sandbox's envd, fencing, and the
//! `projection_synced` / `projection_failed` events. Planning and applying are
//! `aviary_reuse::projection`'s.
//!
//! Invariants:
//! - A plan that fails (a symlink out of a root, e.g. to `/etc`, an unreadable
//!   root, a file over the size limit, ...) applies nothing; the start fails
//!   with `unavailable` (503: the operator's configuration is wrong, not the
//!   caller's request) and a `projection_failed` event is recorded.
//! - The index of the last sync (sandbox path → SHA-256) is kept in the
//!   registry per sandbox (`sandbox_projection`), stored only after a
//!   successful apply; a sync takes it out first, so after a failed apply
//!   (remote state unknown) the next sync starts from an empty index
//!   (uploads everything). A server restart, or another replica, finds it
//!   there: unchanged projected files are not uploaded again.
//! - The index is not trusted blindly: before planning, every indexed file is
//!   read back through envd and hashed here (not by a binary the sandbox could
//!   replace). A file the sandbox changed is re-uploaded (or deleted, when the
//!   host no longer has it); a file it removed is simply uploaded again. So
//!   a shared scope's next caller always sees the host's projected files.
//! - Writes carry the sandbox's current lease token: envd refuses tokenless
//!   writes while a fence is set. On a fence refusal the lease store's view
//!   is pushed to envd again and the operation retried once.
//!
//! Concurrency: planning (hashing host files) runs on a blocking thread. Two
//! syncs of one sandbox at once are safe but wasteful: the second finds no
//! index and uploads everything; both converge to the host's files.

use crate::error::OpError;
use crate::ops::{ControlPlane, LiveSandbox};
use async_trait::async_trait;
use aviary_core::SandboxId;
use aviary_envd_proto::EnvdError;
use aviary_reuse::projection::{
    apply, ProjectionPlanner, ProjectionRoot, ProjectionTarget, RemoteIndex, TargetError,
};
use sha2::Digest;
use tokio::io::AsyncReadExt;

/// Hash recorded for an indexed file the sandbox changed: never equal to a
/// real SHA-256, so the planner re-uploads (or deletes) it.
const TAMPERED: &str = "";

/// `e` and its sources, `: `-separated.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

fn is_fence_refusal(e: &EnvdError) -> bool {
    matches!(e, EnvdError::LeaseRequired | EnvdError::StaleToken)
}

/// Writes into the sandbox through its envd, with the current lease token.
struct EnvdTarget<'a> {
    cp: &'a ControlPlane,
    id: &'a SandboxId,
    live: &'a LiveSandbox,
    token: Option<u64>,
}

impl EnvdTarget<'_> {
    async fn current_token(cp: &ControlPlane, id: &SandboxId) -> Result<Option<u64>, OpError> {
        Ok(cp
            .leases
            .current(id, aviary_core::now())
            .await?
            .map(|l| l.token.fence()))
    }

    /// After a fence refusal: envd and the lease store disagree (a lease
    /// taken or expired since the token was read); align both and re-read.
    async fn refresh(&mut self) -> Result<(), TargetError> {
        self.cp.push_fence(self.id, self.live).await?;
        self.token = Self::current_token(self.cp, self.id).await?;
        Ok(())
    }
}

#[async_trait]
impl ProjectionTarget for EnvdTarget<'_> {
    async fn write_file(
        &mut self,
        path: &str,
        content: &[u8],
        mode: u32,
    ) -> Result<(), TargetError> {
        let mut retried = false;
        loop {
            match self
                .live
                .envd
                .write_file(path, Some(mode), content, self.token)
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if !retried && is_fence_refusal(&e) => {
                    retried = true;
                    self.refresh().await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn remove(&mut self, path: &str) -> Result<(), TargetError> {
        let mut retried = false;
        loop {
            match self.live.envd.remove(path, true, self.token).await {
                Ok(()) | Err(EnvdError::NotFound(_)) => return Ok(()),
                Err(e) if !retried && is_fence_refusal(&e) => {
                    retried = true;
                    self.refresh().await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn mkdir(&mut self, path: &str) -> Result<(), TargetError> {
        let mut retried = false;
        loop {
            match self.live.envd.mkdir(path, true, self.token).await {
                Ok(()) => return Ok(()),
                Err(e) if !retried && is_fence_refusal(&e) => {
                    retried = true;
                    self.refresh().await?;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// SHA-256 (hex) of a sandbox file read through envd, at most `limit` bytes;
/// `None` when it is missing, `Some(TAMPERED)` when it cannot be read whole
/// (a directory now, too large, a read error).
async fn remote_sha256(live: &LiveSandbox, path: &str, limit: u64) -> Option<String> {
    let reader = match live.envd.read_file(path, None).await {
        Ok(r) => r,
        Err(EnvdError::NotFound(_)) => return None,
        Err(_) => return Some(TAMPERED.into()),
    };
    if reader.size() > limit {
        return Some(TAMPERED.into());
    }
    let mut bytes = Vec::new();
    // +1: a file that grew past the limit since it was opened is not hashed whole
    match reader.take(limit + 1).read_to_end(&mut bytes).await {
        Ok(n) if (n as u64) <= limit => Some(hex::encode(sha2::Sha256::digest(&bytes))),
        _ => Some(TAMPERED.into()),
    }
}

/// What the sandbox really holds of `index`: missing files dropped, changed
/// ones marked [`TAMPERED`]. Returns it with the number of changed files.
async fn verify_index(live: &LiveSandbox, index: RemoteIndex, limit: u64) -> (RemoteIndex, usize) {
    let mut out = RemoteIndex::default();
    let mut changed = 0;
    for (path, want) in index.files {
        match remote_sha256(live, &path, limit).await {
            Some(got) if got == want => {
                out.files.insert(path, want);
            }
            Some(_) => {
                changed += 1;
                out.files.insert(path, TAMPERED.into());
            }
            None => changed += 1,
        }
    }
    (out, changed)
}

impl ControlPlane {
    /// Takes this sandbox's stored index out of the registry (a failed sync
    /// leaves none: the remote state is then unknown).
    async fn take_index(&self, id: &SandboxId) -> Result<RemoteIndex, OpError> {
        let files = self.registry.get_projection_index(id).await?;
        if files.is_some() {
            self.registry.delete_projection_index(id).await?;
        }
        Ok(RemoteIndex {
            files: files.unwrap_or_default(),
        })
    }

    async fn store_index(&self, id: &SandboxId, index: &RemoteIndex) -> Result<(), OpError> {
        self.registry
            .put_projection_index(id, &index.files)
            .await
            .map_err(OpError::from)
    }

    /// Syncs the configured projection roots into the sandbox (a no-op when
    /// none are configured). Fails with `unavailable` when the roots cannot be
    /// projected; records `projection_synced` or `projection_failed`.
    pub(crate) async fn sync_projection(
        &self,
        id: &SandboxId,
        live: &LiveSandbox,
    ) -> Result<(), OpError> {
        let settings = &self.cfg.settings.projections;
        if settings.is_empty() {
            return Ok(());
        }
        if live.paused.load(std::sync::atomic::Ordering::SeqCst) {
            // a frozen envd cannot answer; the sandbox is synced when it next starts
            tracing::warn!(sandbox.id = %id, "sandbox is paused: projection skipped");
            return Ok(());
        }
        let started = std::time::Instant::now();
        let roots: Vec<ProjectionRoot> = settings
            .iter()
            .map(|p| ProjectionRoot::new(p.host.clone(), p.sandbox.clone()))
            .collect();
        let planner = ProjectionPlanner::default();
        let (index, repaired) =
            verify_index(live, self.take_index(id).await?, planner.max_file_bytes).await;
        let result = async {
            let plan = tokio::task::spawn_blocking(move || planner.plan(&roots, &index))
                .await
                .map_err(|e| format!("projection planner panicked: {e}"))?
                .map_err(|e| error_chain(&e))?;
            let token = EnvdTarget::current_token(self, id)
                .await
                .map_err(|e| error_chain(&e))?;
            let mut target = EnvdTarget {
                cp: self,
                id,
                live,
                token,
            };
            let report = apply(&plan, &mut target)
                .await
                .map_err(|e| error_chain(&e))?;
            Ok::<_, String>((plan.next_index, report))
        }
        .await;
        let tenant = self.registry.get_sandbox(id).await?.tenant;
        match result {
            Ok((next_index, report)) => {
                self.store_index(id, &next_index).await?;
                let ms = started.elapsed().as_millis() as u64;
                tracing::debug!(sandbox.id = %id, uploaded = report.uploaded, deleted = report.deleted, skipped = report.skipped, ms, "projection synced");
                self.record_event(
                    &tenant,
                    Some(id),
                    None,
                    "projection_synced",
                    None,
                    serde_json::json!({
                        "uploaded": report.uploaded,
                        "deleted": report.deleted,
                        "skipped": report.skipped,
                        "bytes_uploaded": report.bytes_uploaded,
                        "repaired": repaired,
                        "roots": settings.len(),
                        "duration_ms": ms,
                    }),
                )
                .await?;
                Ok(())
            }
            Err(why) => {
                tracing::warn!(sandbox.id = %id, error = %why, "workspace projection failed");
                self.record_event(
                    &tenant,
                    Some(id),
                    None,
                    "projection_failed",
                    None,
                    serde_json::json!({"error": why}),
                )
                .await?;
                Err(OpError::Unavailable(format!(
                    "workspace projection failed: {why}"
                )))
            }
        }
    }
}
