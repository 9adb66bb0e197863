//! The JSON side files older versions kept in the data dir (snapshot index,
//! pool bounds, node registrations), moved into the registry once at start-up.
//!
//! Each file is removed after its content is stored; a repeated import (after
//! a crash in between) stores the same rows again. This is the server's job,
//! not the control plane's: only the server knows where its data dir is.

use anyhow::Context;
use aviary_control::snapshots::SandboxSnapshot;
use aviary_registry::{NodeRegistration, PoolBoundsRecord, Registry, RegistryError};
use serde::Deserialize;
use std::path::Path;

/// `<data dir>/pools.json` of older versions: `pool set` bounds per class.
#[derive(Deserialize)]
struct LegacyOverride {
    class: String,
    min: u32,
    max: u32,
}

/// One entry of `<data>/nodes.json` of older versions.
#[derive(Deserialize)]
struct LegacyNode {
    id: String,
    address: String,
    token: String,
}

/// Imports all three kinds; logs what it moved.
pub async fn import_all(registry: &dyn Registry, data_dir: &Path) -> anyhow::Result<()> {
    let snapshots = import_snapshot_index_files(registry, data_dir)
        .await
        .context("importing snapshot-index/")?;
    let pools = import_pools_file(registry, data_dir)
        .await
        .context("importing pools.json")?;
    let nodes = import_nodes_file(registry, data_dir)
        .await
        .context("importing nodes.json")?;
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

/// Moves the index files of older versions (`<data>/snapshot-index/*.json`)
/// into the registry and removes them. Safe to repeat after a crash: an
/// entry already in the registry is kept. A file that cannot be read or
/// parsed stays where it is (older versions ignored it too) and is logged.
async fn import_snapshot_index_files(
    registry: &dyn Registry,
    data_dir: &Path,
) -> anyhow::Result<usize> {
    let dir = data_dir.join("snapshot-index");
    let entries = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e.into()),
    };
    let mut imported = 0;
    for e in entries {
        let path = e?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        // `.<id>.tmp`: a write the old version never finished
        if name.starts_with('.') && name.ends_with(".tmp") {
            std::fs::remove_file(&path)?;
            continue;
        }
        let record = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<SandboxSnapshot>(&b).ok())
            .and_then(|s| s.to_record());
        let Some(record) = record else {
            tracing::warn!(file = %path.display(), "snapshot index file not imported: unreadable");
            continue;
        };
        match registry.insert_snapshot(&record).await {
            Ok(_) | Err(RegistryError::Duplicate) => {}
            Err(e) => return Err(e.into()),
        }
        std::fs::remove_file(&path)?;
        imported += 1;
    }
    // only succeeds once nothing is left in it
    let _ = std::fs::remove_dir(&dir);
    Ok(imported)
}

/// Moves `<data dir>/pools.json` of older versions into the registry and
/// removes it. The file wins over bounds already stored: only an older
/// version writes it, after this one last ran. Safe to repeat.
async fn import_pools_file(registry: &dyn Registry, data_dir: &Path) -> anyhow::Result<usize> {
    let file = data_dir.join("pools.json");
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e.into()),
    };
    let overrides: Vec<LegacyOverride> = match serde_json::from_slice(&bytes) {
        Ok(o) => o,
        Err(e) => {
            // older versions ignored an unreadable file too
            tracing::warn!(file = %file.display(), error = %e, "pools.json not imported: unreadable");
            return Ok(0);
        }
    };
    let now = aviary_core::now();
    for o in &overrides {
        registry
            .set_pool_bounds(&PoolBoundsRecord {
                class: o.class.clone(),
                pool_min: o.min,
                pool_max: o.max,
                updated_at: now,
            })
            .await?;
    }
    remove_legacy_file(&file)?;
    Ok(overrides.len())
}

/// Moves `<data>/nodes.json` of older versions into the registry and
/// removes it. The file wins over a stored registration of the same id:
/// only an older version writes it, after this one last ran. Safe to
/// repeat.
async fn import_nodes_file(registry: &dyn Registry, data_dir: &Path) -> anyhow::Result<usize> {
    let file = data_dir.join("nodes.json");
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e.into()),
    };
    let saved: Vec<LegacyNode> = match serde_json::from_slice(&bytes) {
        Ok(s) => s,
        Err(_) => {
            // the serde error could quote a token: only the file is named
            tracing::warn!(file = %file.display(), "nodes.json not imported: unreadable");
            return Ok(0);
        }
    };
    let now = aviary_core::now();
    for n in &saved {
        registry
            .upsert_node_registration(&NodeRegistration {
                id: n.id.clone(),
                address: n.address.clone(),
                token: n.token.clone(),
                registered_at: now,
            })
            .await?;
    }
    remove_legacy_file(&file)?;
    Ok(saved.len())
}

/// Removes a side file of an older version once its content is in the
/// registry; a file already gone (a repeated import) is fine.
fn remove_legacy_file(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}
