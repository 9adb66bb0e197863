//! Redis backend.
//!
//! Keys (under a configurable prefix `P`): `P:chunk:<hash>` holds chunk bytes,
//! `P:chunks` is a sorted set of all chunk hashes (score 0, so `ZRANGEBYLEX` pages
//! them in order), `P:manifest:<tenant>:<id>` holds a manifest and `P:manifests` is a
//! sorted set of `<tenant>/<id>` members. Object and index are written in one
//! `MULTI/EXEC` so they never disagree. One multiplexed connection is shared by all
//! callers (it is `Clone` and pipelines concurrent requests).

use super::{decode_manifest, ChunkStore};
use crate::error::SnapshotError;
use crate::hash::{validate_tenant, ChunkHash, SnapshotId};
use crate::manifest::{ManifestKey, SnapshotManifest};
use async_trait::async_trait;
use redis::aio::MultiplexedConnection;

pub struct RedisStore {
    conn: MultiplexedConnection,
    prefix: String,
}

fn err(op: impl Into<String>, e: redis::RedisError) -> SnapshotError {
    SnapshotError::backend("redis", op, e)
}

impl RedisStore {
    /// Connect to `url` (`redis://host:port/db`), namespacing every key under `prefix`.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, SnapshotError> {
        let client = redis::Client::open(url).map_err(|e| err("parse url", e))?;
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| err("connect", e))?;
        Ok(RedisStore {
            conn,
            prefix: prefix.to_owned(),
        })
    }

    fn chunk_key(&self, hash: &ChunkHash) -> String {
        format!("{}:chunk:{hash}", self.prefix)
    }

    fn manifest_key(&self, tenant: &str, id: &SnapshotId) -> Result<String, SnapshotError> {
        validate_tenant(tenant)?;
        Ok(format!("{}:manifest:{tenant}:{id}", self.prefix))
    }
}

#[async_trait]
impl ChunkStore for RedisStore {
    fn backend(&self) -> &'static str {
        "redis"
    }

    async fn put(&self, hash: &ChunkHash, bytes: Vec<u8>) -> Result<(), SnapshotError> {
        let mut conn = self.conn.clone();
        redis::pipe()
            .atomic()
            .cmd("SET")
            .arg(self.chunk_key(hash))
            .arg(bytes)
            .ignore()
            .cmd("ZADD")
            .arg(format!("{}:chunks", self.prefix))
            .arg(0)
            .arg(hash.as_str())
            .ignore()
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| err("put chunk", e))
    }

    async fn get(&self, hash: &ChunkHash) -> Result<Vec<u8>, SnapshotError> {
        let mut conn = self.conn.clone();
        let v: Option<Vec<u8>> = redis::cmd("GET")
            .arg(self.chunk_key(hash))
            .query_async(&mut conn)
            .await
            .map_err(|e| err("get chunk", e))?;
        v.ok_or_else(|| SnapshotError::not_found(format!("chunk {hash}")))
    }

    async fn has(&self, hash: &ChunkHash) -> Result<bool, SnapshotError> {
        let mut conn = self.conn.clone();
        let n: i64 = redis::cmd("EXISTS")
            .arg(self.chunk_key(hash))
            .query_async(&mut conn)
            .await
            .map_err(|e| err("check chunk", e))?;
        Ok(n > 0)
    }

    async fn delete(&self, hash: &ChunkHash) -> Result<(), SnapshotError> {
        let mut conn = self.conn.clone();
        redis::pipe()
            .atomic()
            .cmd("DEL")
            .arg(self.chunk_key(hash))
            .ignore()
            .cmd("ZREM")
            .arg(format!("{}:chunks", self.prefix))
            .arg(hash.as_str())
            .ignore()
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| err("delete chunk", e))
    }

    async fn list(
        &self,
        after: Option<&ChunkHash>,
        limit: usize,
    ) -> Result<Vec<ChunkHash>, SnapshotError> {
        let mut conn = self.conn.clone();
        let min = after.map_or_else(|| "-".to_owned(), |h| format!("({h}"));
        let members: Vec<String> = redis::cmd("ZRANGEBYLEX")
            .arg(format!("{}:chunks", self.prefix))
            .arg(min)
            .arg("+")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut conn)
            .await
            .map_err(|e| err("list chunks", e))?;
        Ok(members.into_iter().filter_map(|m| m.parse().ok()).collect())
    }

    async fn put_manifest(&self, manifest: &SnapshotManifest) -> Result<(), SnapshotError> {
        let key = self.manifest_key(&manifest.tenant, &manifest.id)?;
        let mut conn = self.conn.clone();
        redis::pipe()
            .atomic()
            .cmd("SET")
            .arg(key)
            .arg(manifest.to_bytes())
            .ignore()
            .cmd("ZADD")
            .arg(format!("{}:manifests", self.prefix))
            .arg(0)
            .arg(format!("{}/{}", manifest.tenant, manifest.id))
            .ignore()
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| err("put manifest", e))
    }

    async fn get_manifest(
        &self,
        tenant: &str,
        id: &SnapshotId,
    ) -> Result<SnapshotManifest, SnapshotError> {
        let key = self.manifest_key(tenant, id)?;
        let mut conn = self.conn.clone();
        let v: Option<Vec<u8>> = redis::cmd("GET")
            .arg(key)
            .query_async(&mut conn)
            .await
            .map_err(|e| err("get manifest", e))?;
        let bytes = v.ok_or_else(|| SnapshotError::not_found(format!("snapshot {id}")))?;
        decode_manifest(tenant, id, &bytes)
    }

    async fn list_manifests(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<ManifestKey>, SnapshotError> {
        let (min, max) = match tenant {
            Some(t) => {
                validate_tenant(t)?;
                (format!("[{t}/"), format!("[{t}/\u{7f}"))
            }
            None => ("-".to_owned(), "+".to_owned()),
        };
        let mut conn = self.conn.clone();
        let members: Vec<String> = redis::cmd("ZRANGEBYLEX")
            .arg(format!("{}:manifests", self.prefix))
            .arg(min)
            .arg(max)
            .query_async(&mut conn)
            .await
            .map_err(|e| err("list manifests", e))?;
        Ok(members
            .iter()
            .filter_map(|m| {
                let (t, id) = m.split_once('/')?;
                Some(ManifestKey {
                    tenant: t.to_owned(),
                    id: id.parse().ok()?,
                })
            })
            .collect())
    }

    async fn delete_manifest(&self, tenant: &str, id: &SnapshotId) -> Result<(), SnapshotError> {
        let key = self.manifest_key(tenant, id)?;
        let mut conn = self.conn.clone();
        let (deleted, _): (i64, i64) = redis::pipe()
            .atomic()
            .cmd("DEL")
            .arg(key)
            .cmd("ZREM")
            .arg(format!("{}:manifests", self.prefix))
            .arg(format!("{tenant}/{id}"))
            .query_async(&mut conn)
            .await
            .map_err(|e| err("delete manifest", e))?;
        if deleted == 0 {
            return Err(SnapshotError::not_found(format!("snapshot {id}")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn redis_store_passes_conformance() {
        let Ok(url) = std::env::var("AVIARY_TEST_REDIS_URL") else {
            let why = "SKIPPED: AVIARY_TEST_REDIS_URL not set (run scripts/services.sh start)";
            assert!(
                std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("{why}");
            return;
        };
        let prefix = aviary_core::new_id("test");
        let store = RedisStore::connect(&url, &prefix).await.unwrap();
        crate::conformance::run_all(&store).await;
    }
}
