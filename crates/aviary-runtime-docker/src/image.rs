//! Templates as Docker images: the template store's rootfs tree of a digest
//! becomes the image `<repo>:<digest hex>` on first use, imported through the
//! Engine API's image create from a tar stream (`docker import`; no registry
//! is involved). The tar is written on a blocking thread straight into the
//! request body, never to disk. Owners, modes (set-id bits included), symlinks
//! and device nodes are kept; hard links become copies and extended
//! attributes (file capabilities) are not carried — a template that needs
//! them is better run on the crun tier. The tag names the tree's digest, so a
//! present image is never imported again; templates never change under a
//! digest.

use crate::{api_error, DockerRuntime};
use aviary_runtime::{RuntimeError, TemplateRef};
use bollard::query_parameters::CreateImageOptionsBuilder;
use bytes::Bytes;
use futures_util::StreamExt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Chunks of the tar stream.
const CHUNK: usize = 256 * 1024;
/// Longest an import may take (a 200 MB Debian tree takes seconds).
const IMPORT_TIMEOUT: Duration = Duration::from_secs(600);

/// The rootfs tree of `template` in the store.
fn rootfs(rt: &DockerRuntime, template: &TemplateRef, hex: &str) -> Result<PathBuf, RuntimeError> {
    let store = rt
        .config
        .template_store
        .as_ref()
        .ok_or_else(|| RuntimeError::InvalidSpec {
            reason: "this runtime has no template store".into(),
        })?;
    let rootfs = store.join("rootfs").join(hex);
    if !rootfs.is_dir() {
        return Err(RuntimeError::InvalidSpec {
            reason: format!(
                "template {} ({}) is not in the template store {store:?}",
                template.name, template.digest
            ),
        });
    }
    Ok(rootfs)
}

/// The image of `template`, imported when dockerd does not have it yet.
pub(crate) async fn ensure(
    rt: &DockerRuntime,
    template: &TemplateRef,
) -> Result<String, RuntimeError> {
    let hex = template
        .digest_hex()
        .ok_or_else(|| RuntimeError::InvalidSpec {
            reason: format!(
                "template digest {:?} is not sha256:<64 hex>",
                template.digest
            ),
        })?;
    let tag = format!("{}:{hex}", rt.config.image_repo);
    if has_image(rt, &tag).await? {
        return Ok(tag);
    }
    let rootfs = rootfs(rt, template, hex)?;
    let _one_import = rt.imports.lock().await;
    if has_image(rt, &tag).await? {
        return Ok(tag);
    }
    tracing::info!(template = %template.name, image = %tag, "importing template into dockerd");
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let writer = tokio::task::spawn_blocking(move || write_tar(&rootfs, tx));
    let body = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let options = CreateImageOptionsBuilder::default()
        .from_src("-")
        .repo(&rt.config.image_repo)
        .tag(hex)
        .build();
    let import = async {
        let mut progress =
            rt.docker
                .create_image(Some(options), Some(bollard::body_try_stream(body)), None);
        while let Some(step) = progress.next().await {
            step.map_err(|e| api_error("import template", None, e))?;
        }
        Ok::<(), RuntimeError>(())
    };
    let imported = tokio::time::timeout(IMPORT_TIMEOUT, import)
        .await
        .unwrap_or_else(|_| {
            Err(RuntimeError::InvokeRuntime {
                action: "docker import template".into(),
                detail: format!("not done within {IMPORT_TIMEOUT:?}"),
            })
        });
    let written = writer.await.unwrap_or_else(|join| {
        Err(RuntimeError::ReadFile {
            path: PathBuf::from(hex),
            source: std::io::Error::other(join.to_string()),
        })
    });
    // the writer's failure explains a cut-off import best
    written?;
    imported?;
    if !has_image(rt, &tag).await? {
        return Err(RuntimeError::InvokeRuntime {
            action: "docker import template".into(),
            detail: format!("dockerd has no image {tag} after the import"),
        });
    }
    Ok(tag)
}

async fn has_image(rt: &DockerRuntime, tag: &str) -> Result<bool, RuntimeError> {
    match rt
        .timed("inspect image", rt.docker.inspect_image(tag))
        .await?
    {
        Ok(_) => Ok(true),
        Err(e) if crate::is_not_found(&e) => Ok(false),
        Err(e) => Err(api_error("inspect image", None, e)),
    }
}

/// Sends the bytes written to it as chunks of a request body.
struct ChannelWriter {
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    buf: Vec<u8>,
}

impl ChannelWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "import ended"))
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

/// The tree at `rootfs` as a tar stream into `tx` (paths relative to it,
/// symlinks as symlinks, owners and modes as they are).
fn write_tar(
    rootfs: &Path,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
) -> Result<(), RuntimeError> {
    let writer = ChannelWriter {
        tx: tx.clone(),
        buf: Vec::with_capacity(CHUNK),
    };
    let mut tar = tar::Builder::new(writer);
    tar.follow_symlinks(false);
    tar.mode(tar::HeaderMode::Complete);
    let result = tar
        .append_dir_all(".", rootfs)
        .and_then(|()| tar.into_inner())
        .and_then(|mut w| w.flush());
    if let Err(e) = &result {
        // the request body ends in an error, so dockerd drops the import
        let _ = tx.blocking_send(Err(std::io::Error::new(e.kind(), e.to_string())));
    }
    result.map_err(|source| RuntimeError::ReadFile {
        path: rootfs.to_path_buf(),
        source,
    })
}
