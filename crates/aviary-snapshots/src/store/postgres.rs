//! PostgreSQL backend (the seed's JDBC store).
//!
//! Two tables, created on connect if missing: `aviary_snapshot_chunk(namespace, hash,
//! data bytea)` and `aviary_snapshot_manifest(namespace, tenant, id, body bytea)`.
//! `namespace` lets several stores share one database. Plain `sqlx::query` with
//! bound parameters (no compile-time macros, no string-built SQL with data in it).
//! The pool is shared by all callers.

use super::{decode_manifest, ChunkStore};
use crate::error::SnapshotError;
use crate::hash::{validate_tenant, ChunkHash, SnapshotId};
use crate::manifest::{ManifestKey, SnapshotManifest};
use async_trait::async_trait;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Row;

pub struct PgStore {
    pool: PgPool,
    namespace: String,
}

fn err(op: &str, e: sqlx::Error) -> SnapshotError {
    SnapshotError::backend("postgres", op, e)
}

const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS aviary_snapshot_chunk (
        namespace text NOT NULL,
        hash text NOT NULL,
        data bytea NOT NULL,
        PRIMARY KEY (namespace, hash))",
    "CREATE TABLE IF NOT EXISTS aviary_snapshot_manifest (
        namespace text NOT NULL,
        tenant text NOT NULL,
        id text NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        body bytea NOT NULL,
        PRIMARY KEY (namespace, tenant, id))",
];

impl PgStore {
    /// Connect to `url` (`postgres://user@host:port/db`), create the tables if needed.
    pub async fn connect(url: &str, namespace: &str) -> Result<Self, SnapshotError> {
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(url)
            .await
            .map_err(|e| err("connect", e))?;
        for stmt in SCHEMA {
            // Concurrent first connects can race on CREATE TABLE IF NOT EXISTS (a
            // unique violation on pg_type); the loser simply finds the table there.
            if let Err(e) = sqlx::query(stmt).execute(&pool).await {
                let exists = e
                    .as_database_error()
                    .and_then(|d| d.code())
                    .is_some_and(|c| c == "23505" || c == "42P07");
                if !exists {
                    return Err(err("create schema", e));
                }
            }
        }
        Ok(PgStore {
            pool,
            namespace: namespace.to_owned(),
        })
    }
}

#[async_trait]
impl ChunkStore for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn put(&self, hash: &ChunkHash, bytes: Vec<u8>) -> Result<(), SnapshotError> {
        sqlx::query(
            "INSERT INTO aviary_snapshot_chunk (namespace, hash, data) VALUES ($1, $2, $3)
             ON CONFLICT (namespace, hash) DO UPDATE SET data = EXCLUDED.data",
        )
        .bind(&self.namespace)
        .bind(hash.as_str())
        .bind(bytes)
        .execute(&self.pool)
        .await
        .map_err(|e| err("put chunk", e))?;
        Ok(())
    }

    async fn get(&self, hash: &ChunkHash) -> Result<Vec<u8>, SnapshotError> {
        let row = sqlx::query(
            "SELECT data FROM aviary_snapshot_chunk WHERE namespace = $1 AND hash = $2",
        )
        .bind(&self.namespace)
        .bind(hash.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| err("get chunk", e))?;
        let row = row.ok_or_else(|| SnapshotError::not_found(format!("chunk {hash}")))?;
        row.try_get::<Vec<u8>, _>(0)
            .map_err(|e| err("decode chunk", e))
    }

    async fn has(&self, hash: &ChunkHash) -> Result<bool, SnapshotError> {
        let row =
            sqlx::query("SELECT 1 FROM aviary_snapshot_chunk WHERE namespace = $1 AND hash = $2")
                .bind(&self.namespace)
                .bind(hash.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| err("check chunk", e))?;
        Ok(row.is_some())
    }

    async fn delete(&self, hash: &ChunkHash) -> Result<(), SnapshotError> {
        sqlx::query("DELETE FROM aviary_snapshot_chunk WHERE namespace = $1 AND hash = $2")
            .bind(&self.namespace)
            .bind(hash.as_str())
            .execute(&self.pool)
            .await
            .map_err(|e| err("delete chunk", e))?;
        Ok(())
    }

    async fn list(
        &self,
        after: Option<&ChunkHash>,
        limit: usize,
    ) -> Result<Vec<ChunkHash>, SnapshotError> {
        let rows = sqlx::query(
            "SELECT hash FROM aviary_snapshot_chunk WHERE namespace = $1 AND hash > $2
             ORDER BY hash COLLATE \"C\" LIMIT $3",
        )
        .bind(&self.namespace)
        .bind(after.map_or("", |h| h.as_str()))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| err("list chunks", e))?;
        rows.iter()
            .map(|r| {
                let s: String = r.try_get(0).map_err(|e| err("decode hash", e))?;
                s.parse()
            })
            .collect()
    }

    async fn put_manifest(&self, manifest: &SnapshotManifest) -> Result<(), SnapshotError> {
        validate_tenant(&manifest.tenant)?;
        sqlx::query(
            "INSERT INTO aviary_snapshot_manifest (namespace, tenant, id, body) VALUES ($1, $2, $3, $4)
             ON CONFLICT (namespace, tenant, id) DO UPDATE SET body = EXCLUDED.body",
        )
        .bind(&self.namespace)
        .bind(&manifest.tenant)
        .bind(manifest.id.as_str())
        .bind(manifest.to_bytes())
        .execute(&self.pool)
        .await
        .map_err(|e| err("put manifest", e))?;
        Ok(())
    }

    async fn get_manifest(
        &self,
        tenant: &str,
        id: &SnapshotId,
    ) -> Result<SnapshotManifest, SnapshotError> {
        validate_tenant(tenant)?;
        let row = sqlx::query(
            "SELECT body FROM aviary_snapshot_manifest WHERE namespace = $1 AND tenant = $2 AND id = $3",
        )
        .bind(&self.namespace)
        .bind(tenant)
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| err("get manifest", e))?;
        let row = row.ok_or_else(|| SnapshotError::not_found(format!("snapshot {id}")))?;
        let body: Vec<u8> = row.try_get(0).map_err(|e| err("decode manifest", e))?;
        decode_manifest(tenant, id, &body)
    }

    async fn list_manifests(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<ManifestKey>, SnapshotError> {
        if let Some(t) = tenant {
            validate_tenant(t)?;
        }
        let rows = sqlx::query(
            "SELECT tenant, id FROM aviary_snapshot_manifest
             WHERE namespace = $1 AND ($2::text IS NULL OR tenant = $2) ORDER BY tenant, id",
        )
        .bind(&self.namespace)
        .bind(tenant)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| err("list manifests", e))?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let tenant: String = r.try_get(0).map_err(|e| err("decode tenant", e))?;
            let id: String = r.try_get(1).map_err(|e| err("decode id", e))?;
            out.push(ManifestKey {
                tenant,
                id: id.parse()?,
            });
        }
        out.sort();
        Ok(out)
    }

    async fn delete_manifest(&self, tenant: &str, id: &SnapshotId) -> Result<(), SnapshotError> {
        validate_tenant(tenant)?;
        let done = sqlx::query(
            "DELETE FROM aviary_snapshot_manifest WHERE namespace = $1 AND tenant = $2 AND id = $3",
        )
        .bind(&self.namespace)
        .bind(tenant)
        .bind(id.as_str())
        .execute(&self.pool)
        .await
        .map_err(|e| err("delete manifest", e))?;
        if done.rows_affected() == 0 {
            return Err(SnapshotError::not_found(format!("snapshot {id}")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn postgres_store_passes_conformance() {
        let Ok(url) = std::env::var("AVIARY_TEST_POSTGRES_URL") else {
            let why = "SKIPPED: AVIARY_TEST_POSTGRES_URL not set (run scripts/services.sh start)";
            assert!(
                std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("{why}");
            return;
        };
        let store = PgStore::connect(&url, &aviary_core::new_id("test"))
            .await
            .unwrap();
        crate::conformance::run_all(&store).await;
    }
}
