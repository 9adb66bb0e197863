//! S3-compatible object storage backend (path-style URLs, SigV4 presigned requests).
//!
//! Requests are signed with `rusty-s3` (a sans-IO signer) and sent with `reqwest`.
//! Object keys: `<prefix>chunks/<hash>` and `<prefix>manifests/<tenant>/<id>.json`, so
//! several stores (or test runs) can share a bucket under different prefixes.
//! `reqwest::Client` pools connections and is safe to share across tasks.
//! TLS is not compiled in (the default deployment talks to a gateway on loopback or
//! a private network); an `https` endpoint fails at request time.

use super::{decode_manifest, ChunkStore};
use crate::error::SnapshotError;
use crate::hash::{validate_tenant, ChunkHash, SnapshotId};
use crate::manifest::{ManifestKey, SnapshotManifest};
use async_trait::async_trait;
use reqwest::{StatusCode, Url};
use rusty_s3::actions::ListObjectsV2;
use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
use std::time::Duration;

const SIGN_FOR: Duration = Duration::from_secs(600);

/// Where and how to reach the object store.
#[derive(Clone)]
pub struct S3Config {
    /// e.g. `http://127.0.0.1:9000`
    pub endpoint: String,
    pub region: String,
    pub bucket: String,
    pub access_key: String,
    pub secret_key: String,
    /// Key prefix, e.g. `aviary/` (may be empty).
    pub prefix: String,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("bucket", &self.bucket)
            .field("access_key", &self.access_key)
            .field("secret_key", &"<redacted>")
            .field("prefix", &self.prefix)
            .finish()
    }
}

pub struct S3Store {
    bucket: Bucket,
    credentials: Credentials,
    client: reqwest::Client,
    prefix: String,
}

fn err(
    op: impl Into<String>,
    e: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> SnapshotError {
    SnapshotError::backend("s3", op, e)
}

#[derive(Debug, thiserror::Error)]
#[error("http status {0}")]
struct HttpStatus(StatusCode);

impl S3Store {
    /// Connect and create the bucket if it does not exist.
    pub async fn connect(cfg: S3Config) -> Result<Self, SnapshotError> {
        let endpoint: Url = cfg
            .endpoint
            .parse()
            .map_err(|e| err(format!("parse endpoint {}", cfg.endpoint), e))?;
        let bucket = Bucket::new(
            endpoint,
            UrlStyle::Path,
            cfg.bucket.clone(),
            cfg.region.clone(),
        )
        .map_err(|e| err("configure bucket", e))?;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .map_err(|e| err("build http client", e))?;
        let store = S3Store {
            bucket,
            credentials: Credentials::new(cfg.access_key, cfg.secret_key),
            client,
            prefix: cfg.prefix,
        };
        let head = store
            .bucket
            .head_bucket(Some(&store.credentials))
            .sign(SIGN_FOR);
        let status = store
            .send(store.client.head(head), "head bucket")
            .await?
            .status();
        if status == StatusCode::NOT_FOUND {
            let url = store
                .bucket
                .create_bucket(&store.credentials)
                .sign(SIGN_FOR);
            let resp = store.send(store.client.put(url), "create bucket").await?;
            if !resp.status().is_success() && resp.status() != StatusCode::CONFLICT {
                return Err(err("create bucket", HttpStatus(resp.status())));
            }
        } else if !status.is_success() {
            return Err(err("head bucket", HttpStatus(status)));
        }
        Ok(store)
    }

    async fn send(
        &self,
        req: reqwest::RequestBuilder,
        op: &str,
    ) -> Result<reqwest::Response, SnapshotError> {
        req.send().await.map_err(|e| err(op.to_owned(), e))
    }

    fn chunk_key(&self, hash: &ChunkHash) -> String {
        format!("{}chunks/{hash}", self.prefix)
    }

    fn manifest_key(&self, tenant: &str, id: &SnapshotId) -> Result<String, SnapshotError> {
        validate_tenant(tenant)?;
        Ok(format!("{}manifests/{tenant}/{id}.json", self.prefix))
    }

    async fn put_object(&self, key: &str, body: Vec<u8>) -> Result<(), SnapshotError> {
        let url = self
            .bucket
            .put_object(Some(&self.credentials), key)
            .sign(SIGN_FOR);
        let resp = self
            .send(self.client.put(url).body(body), "put object")
            .await?;
        if !resp.status().is_success() {
            return Err(err(format!("put {key}"), HttpStatus(resp.status())));
        }
        Ok(())
    }

    async fn get_object(&self, key: &str, what: String) -> Result<Vec<u8>, SnapshotError> {
        let url = self
            .bucket
            .get_object(Some(&self.credentials), key)
            .sign(SIGN_FOR);
        let resp = self.send(self.client.get(url), "get object").await?;
        match resp.status() {
            s if s.is_success() => Ok(resp
                .bytes()
                .await
                .map_err(|e| err(format!("read {key}"), e))?
                .to_vec()),
            StatusCode::NOT_FOUND => Err(SnapshotError::not_found(what)),
            s => Err(err(format!("get {key}"), HttpStatus(s))),
        }
    }

    async fn head_object(&self, key: &str) -> Result<bool, SnapshotError> {
        let url = self
            .bucket
            .head_object(Some(&self.credentials), key)
            .sign(SIGN_FOR);
        let resp = self.send(self.client.head(url), "head object").await?;
        match resp.status() {
            s if s.is_success() => Ok(true),
            StatusCode::NOT_FOUND => Ok(false),
            s => Err(err(format!("head {key}"), HttpStatus(s))),
        }
    }

    async fn delete_object(&self, key: &str) -> Result<(), SnapshotError> {
        let url = self
            .bucket
            .delete_object(Some(&self.credentials), key)
            .sign(SIGN_FOR);
        let resp = self.send(self.client.delete(url), "delete object").await?;
        match resp.status() {
            s if s.is_success() || s == StatusCode::NOT_FOUND => Ok(()),
            s => Err(err(format!("delete {key}"), HttpStatus(s))),
        }
    }

    /// One page of keys under `prefix`, after `start_after` / continuing `token`.
    async fn list_page(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        token: Option<&str>,
        max_keys: usize,
    ) -> Result<(Vec<String>, Option<String>), SnapshotError> {
        let mut action = ListObjectsV2::new(&self.bucket, Some(&self.credentials));
        action.with_prefix(prefix);
        if let Some(s) = start_after {
            action.with_start_after(s);
        }
        if let Some(t) = token {
            action.with_continuation_token(t);
        }
        action.with_max_keys(max_keys.clamp(1, 1000));
        let url = action.sign(SIGN_FOR);
        let resp = self.send(self.client.get(url), "list objects").await?;
        if !resp.status().is_success() {
            return Err(err(format!("list {prefix}"), HttpStatus(resp.status())));
        }
        let body = resp.text().await.map_err(|e| err("read listing", e))?;
        Ok(parse_listing(&body))
    }
}

/// Keys and continuation token of a ListObjectsV2 response.
///
/// Parsed by hand rather than with `rusty-s3`'s typed parser because that one
/// requires fields (`ETag`) some S3-compatible servers (s3s-fs) leave out of listings;
/// only `Contents/Key` and `NextContinuationToken` matter here.
fn parse_listing(xml: &str) -> (Vec<String>, Option<String>) {
    fn between<'a>(s: &'a str, open: &str, close: &str) -> Option<(&'a str, &'a str)> {
        let start = s.find(open)? + open.len();
        let end = start + s[start..].find(close)?;
        Some((&s[start..end], &s[end + close.len()..]))
    }
    fn unescape(s: &str) -> String {
        s.replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&amp;", "&")
    }
    let mut keys = Vec::new();
    let mut rest = xml;
    while let Some((contents, after)) = between(rest, "<Contents>", "</Contents>") {
        if let Some((key, _)) = between(contents, "<Key>", "</Key>") {
            keys.push(unescape(key));
        }
        rest = after;
    }
    let token = between(xml, "<NextContinuationToken>", "</NextContinuationToken>")
        .map(|(t, _)| unescape(t))
        .filter(|t| !t.is_empty());
    (keys, token)
}

#[async_trait]
impl ChunkStore for S3Store {
    fn backend(&self) -> &'static str {
        "s3"
    }

    async fn put(&self, hash: &ChunkHash, bytes: Vec<u8>) -> Result<(), SnapshotError> {
        self.put_object(&self.chunk_key(hash), bytes).await
    }

    async fn get(&self, hash: &ChunkHash) -> Result<Vec<u8>, SnapshotError> {
        self.get_object(&self.chunk_key(hash), format!("chunk {hash}"))
            .await
    }

    async fn has(&self, hash: &ChunkHash) -> Result<bool, SnapshotError> {
        self.head_object(&self.chunk_key(hash)).await
    }

    async fn delete(&self, hash: &ChunkHash) -> Result<(), SnapshotError> {
        self.delete_object(&self.chunk_key(hash)).await
    }

    async fn list(
        &self,
        after: Option<&ChunkHash>,
        limit: usize,
    ) -> Result<Vec<ChunkHash>, SnapshotError> {
        let prefix = format!("{}chunks/", self.prefix);
        let start = after.map(|h| format!("{prefix}{h}"));
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        while out.len() < limit {
            let (keys, next) = self
                .list_page(
                    &prefix,
                    start.as_deref(),
                    token.as_deref(),
                    limit - out.len(),
                )
                .await?;
            out.extend(
                keys.iter()
                    .filter_map(|k| k.strip_prefix(&prefix)?.parse::<ChunkHash>().ok()),
            );
            match next {
                Some(t) => token = Some(t),
                None => break,
            }
        }
        // Stores sort keys in UTF-8 byte order already; sort anyway for servers that don't.
        out.sort();
        out.truncate(limit);
        Ok(out)
    }

    async fn put_manifest(&self, manifest: &SnapshotManifest) -> Result<(), SnapshotError> {
        let key = self.manifest_key(&manifest.tenant, &manifest.id)?;
        self.put_object(&key, manifest.to_bytes()).await
    }

    async fn get_manifest(
        &self,
        tenant: &str,
        id: &SnapshotId,
    ) -> Result<SnapshotManifest, SnapshotError> {
        let key = self.manifest_key(tenant, id)?;
        let bytes = self.get_object(&key, format!("snapshot {id}")).await?;
        decode_manifest(tenant, id, &bytes)
    }

    async fn list_manifests(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<ManifestKey>, SnapshotError> {
        let base = format!("{}manifests/", self.prefix);
        let prefix = match tenant {
            Some(t) => {
                validate_tenant(t)?;
                format!("{base}{t}/")
            }
            None => base.clone(),
        };
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let (keys, next) = self
                .list_page(&prefix, None, token.as_deref(), 1000)
                .await?;
            for k in keys {
                let Some((t, file)) = k.strip_prefix(&base).and_then(|r| r.split_once('/')) else {
                    continue;
                };
                if let Some(id) = file.strip_suffix(".json").and_then(|s| s.parse().ok()) {
                    if validate_tenant(t).is_ok() {
                        out.push(ManifestKey {
                            tenant: t.to_owned(),
                            id,
                        });
                    }
                }
            }
            match next {
                Some(t) => token = Some(t),
                None => break,
            }
        }
        out.sort();
        Ok(out)
    }

    async fn delete_manifest(&self, tenant: &str, id: &SnapshotId) -> Result<(), SnapshotError> {
        let key = self.manifest_key(tenant, id)?;
        if !self.head_object(&key).await? {
            return Err(SnapshotError::not_found(format!("snapshot {id}")));
        }
        self.delete_object(&key).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store configured by `scripts/services.sh start`, under a fresh prefix.
    pub(crate) async fn test_store() -> Option<S3Store> {
        let Ok(endpoint) = std::env::var("AVIARY_TEST_S3_ENDPOINT") else {
            let why = "SKIPPED: AVIARY_TEST_S3_ENDPOINT not set (run scripts/services.sh start)";
            assert!(
                std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("{why}");
            return None;
        };
        let var = |k: &str| {
            std::env::var(k)
                .unwrap_or_else(|_| panic!("{k} must be set with AVIARY_TEST_S3_ENDPOINT"))
        };
        let cfg = S3Config {
            endpoint,
            region: "us-east-1".into(),
            bucket: var("AVIARY_TEST_S3_BUCKET"),
            access_key: var("AVIARY_TEST_S3_ACCESS_KEY"),
            secret_key: var("AVIARY_TEST_S3_SECRET_KEY"),
            prefix: format!("test-{}/", aviary_core::new_id("run")),
        };
        Some(S3Store::connect(cfg).await.unwrap())
    }

    #[tokio::test]
    async fn s3_wrong_secret_is_refused_by_the_server() {
        let Some(good) = test_store().await else {
            return;
        };
        drop(good);
        let cfg = S3Config {
            endpoint: std::env::var("AVIARY_TEST_S3_ENDPOINT").unwrap(),
            region: "us-east-1".into(),
            bucket: std::env::var("AVIARY_TEST_S3_BUCKET").unwrap(),
            access_key: std::env::var("AVIARY_TEST_S3_ACCESS_KEY").unwrap(),
            secret_key: "not-the-secret".into(),
            prefix: "x/".into(),
        };
        let err = S3Store::connect(cfg)
            .await
            .err()
            .expect("a bad signature must be refused");
        assert!(matches!(err, SnapshotError::Backend { .. }), "{err}");
    }

    #[test]
    fn listing_parser_reads_keys_and_token() {
        let xml = r#"<?xml version="1.0"?><ListBucketResult><Name>b</Name>
            <Contents><Key>p/chunks/a&amp;b</Key><Size>3</Size></Contents>
            <Contents><LastModified>x</LastModified><Key>p/chunks/c</Key></Contents>
            <NextContinuationToken>tok&lt;1</NextContinuationToken></ListBucketResult>"#;
        let (keys, token) = parse_listing(xml);
        assert_eq!(
            keys,
            vec!["p/chunks/a&b".to_owned(), "p/chunks/c".to_owned()]
        );
        assert_eq!(token.as_deref(), Some("tok<1"));
        assert_eq!(
            parse_listing("<ListBucketResult></ListBucketResult>"),
            (vec![], None)
        );
    }

    #[tokio::test]
    async fn s3_store_passes_conformance() {
        let Some(store) = test_store().await else {
            return;
        };
        crate::conformance::run_all(&store).await;
    }

    #[tokio::test]
    async fn s3_listing_pages_past_one_request() {
        let Some(store) = test_store().await else {
            return;
        };
        let mut hashes: Vec<ChunkHash> = (0..25u32)
            .map(|i| ChunkHash::of(&i.to_le_bytes()))
            .collect();
        for h in &hashes {
            store.put(h, b"x".to_vec()).await.unwrap();
        }
        hashes.sort();
        let mut seen = Vec::new();
        let mut cursor: Option<ChunkHash> = None;
        loop {
            let page = store.list(cursor.as_ref(), 7).await.unwrap();
            if page.is_empty() {
                break;
            }
            assert!(page.len() <= 7);
            cursor = page.last().cloned();
            seen.extend(page);
        }
        assert_eq!(seen, hashes);
    }
}
