//! [`Snapshottable`] on Docker: the workspace is the runtime's own host dir;
//! the writable layer is the container's overlay2 upper dir, which dockerd
//! names in the container's inspect (`GraphDriver.Data.UpperDir`). That dir
//! is dockerd's: this runtime only reads it (an export, with the sandbox
//! paused), and writes into it only for a container it has just created and
//! not yet started (a staged layer adopted by `create`, copied with `cp -a`
//! so overlay whiteouts and opaque-dir xattrs keep their meaning). It is
//! refused unless dockerd's storage driver is `overlay2`. Without a user
//! namespace, ids inside are host ids: nothing is shifted.

use crate::{api_error, container_name, make_dir, remove_tree, DockerRuntime};
use async_trait::async_trait;
use aviary_core::SandboxId;
use aviary_runtime::{LayerExport, LayerStage, RuntimeError, Snapshottable, SpawnRequest};
use std::path::{Path, PathBuf};
use std::time::Duration;

impl DockerRuntime {
    /// The overlay2 upper dir of the sandbox's container.
    async fn upper_dir(&self, id: &SandboxId) -> Result<PathBuf, RuntimeError> {
        let info = self
            .timed(
                "inspect",
                self.docker.inspect_container(
                    &container_name(id),
                    None::<bollard::query_parameters::InspectContainerOptions>,
                ),
            )
            .await?
            .map_err(|e| api_error("inspect", Some(id), e))?;
        let driver = info.graph_driver.unwrap_or_default();
        if driver.name != "overlay2" {
            return Err(RuntimeError::Unsupported {
                what: format!(
                    "snapshots of docker's {:?} storage driver (overlay2 only)",
                    driver.name
                ),
            });
        }
        let upper = driver
            .data
            .get("UpperDir")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .ok_or_else(|| RuntimeError::ParseState {
                detail: "dockerd names no UpperDir for the container".into(),
            })?;
        if !upper.is_dir() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        Ok(upper)
    }

    /// Copies the staged writable layer into the upper dir of the created,
    /// not yet started container of `id`.
    pub(crate) async fn adopt_writable(
        &self,
        id: &SandboxId,
        staged: &Path,
    ) -> Result<(), RuntimeError> {
        let upper = self.upper_dir(id).await?;
        let mut req = SpawnRequest::new(
            "cp",
            vec![
                "-a".into(),
                "--no-target-directory".into(),
                "--".into(),
                staged.display().to_string(),
                upper.display().to_string(),
            ],
        );
        req.timeout = Duration::from_secs(1800);
        let out = self
            .spawner
            .run(&req)
            .await
            .map_err(|source| RuntimeError::Spawn {
                program: "cp".into(),
                source,
            })?;
        if !out.success() {
            return Err(RuntimeError::InvokeRuntime {
                action: format!("copy staged layer {staged:?}"),
                detail: format!(
                    "exit {:?}: {}",
                    out.code,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        Ok(())
    }
}

/// Runs blocking file work off the async workers.
async fn blocking<T: Send + 'static>(
    path: &Path,
    f: impl FnOnce() -> Result<T, RuntimeError> + Send + 'static,
) -> Result<T, RuntimeError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|join| {
        Err(RuntimeError::WriteFile {
            path: path.to_path_buf(),
            source: std::io::Error::other(join.to_string()),
        })
    })
}

#[async_trait]
impl Snapshottable for DockerRuntime {
    async fn export_layers(&self, id: &SandboxId) -> Result<LayerExport, RuntimeError> {
        let dirs = self.dirs(id);
        if self.container(id).await?.is_none() || !dirs.workspace().is_dir() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        Ok(LayerExport {
            writable: self.upper_dir(id).await?,
            workspace: dirs.workspace(),
            // the upper dir is on Docker's storage, not beside the workspace
            shadows: None,
        })
    }

    async fn stage_layers(&self, id: &SandboxId) -> Result<LayerStage, RuntimeError> {
        let dirs = self.dirs(id);
        if dirs.root.exists() || self.container(id).await?.is_some() {
            return Err(RuntimeError::AlreadyExists { id: id.clone() });
        }
        let seed = dirs.seed();
        let stage = LayerStage {
            writable: seed.join("writable"),
            workspace: seed.join("workspace"),
        };
        let made = stage.clone();
        blocking(&seed.clone(), move || {
            remove_tree(&seed)?;
            // host-only: a staged tree may hold set-id files of any owner
            make_dir(&seed, 0o700)?;
            make_dir(&made.writable, 0o755)?;
            make_dir(&made.workspace, 0o755)
        })
        .await?;
        Ok(stage)
    }

    async fn stage_workspace(&self, id: &SandboxId) -> Result<PathBuf, RuntimeError> {
        let dirs = self.dirs(id);
        if !dirs.workspace().is_dir() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        let stage = dirs.workspace_stage();
        let made = stage.clone();
        blocking(&stage, move || {
            remove_tree(&made)?;
            make_dir(&made, 0o700)
        })
        .await?;
        Ok(stage)
    }

    async fn merge_workspace(&self, id: &SandboxId) -> Result<(), RuntimeError> {
        let dirs = self.dirs(id);
        let (stage, workspace) = (dirs.workspace_stage(), dirs.workspace());
        if !workspace.is_dir() {
            return Err(RuntimeError::NotFound { id: id.clone() });
        }
        if !stage.is_dir() {
            return Err(RuntimeError::InvalidSpec {
                reason: format!("no workspace tree is staged for sandbox {id}"),
            });
        }
        blocking(&stage.clone(), move || {
            let entries = std::fs::read_dir(&stage).map_err(|source| RuntimeError::ReadFile {
                path: stage.clone(),
                source,
            })?;
            for e in entries.flatten() {
                let target = workspace.join(e.file_name());
                // symlink_metadata: a dangling symlink is an entry too
                if std::fs::symlink_metadata(&target).is_ok() {
                    continue;
                }
                std::fs::rename(e.path(), &target).map_err(|source| RuntimeError::WriteFile {
                    path: target.clone(),
                    source,
                })?;
            }
            remove_tree(&stage)
        })
        .await
    }
}
