//! Shared by the integration tests: the real Redis they run against
//! (`AVIARY_TEST_REDIS_URL`), a fresh key prefix per test, and dropping a
//! prefix's keys (a Redis restart without persistence, for that test only:
//! other tests share the database).
#![allow(dead_code)]

use aviary_coord_redis::ConnectionManager;

const NOT_SET: &str = "AVIARY_TEST_REDIS_URL not set (run scripts/services.sh start)";

/// The test Redis' URL; `None` (after printing why) when it is not
/// configured, a panic instead when `AVIARY_REQUIRE_SERVICES=1`.
pub fn redis_url() -> Option<String> {
    match std::env::var("AVIARY_TEST_REDIS_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var("AVIARY_REQUIRE_SERVICES").as_deref() == Ok("1") => {
            panic!("AVIARY_REQUIRE_SERVICES=1 but {NOT_SET}")
        }
        _ => {
            eprintln!("SKIPPED: {NOT_SET}");
            None
        }
    }
}

/// A connection to the test Redis, or `None` (skipped).
pub async fn redis() -> Option<(String, ConnectionManager)> {
    let url = redis_url()?;
    let conn = aviary_coord_redis::connect(&url).await.unwrap();
    Some((url, conn))
}

/// A key prefix no other test uses.
pub fn prefix() -> String {
    aviary_core::new_id("aviary-test")
}

/// Deletes every key under `prefix` (never FLUSHDB: the database is shared).
pub async fn flush_prefix(conn: &ConnectionManager, prefix: &str) -> usize {
    let mut conn = conn.clone();
    let mut cursor = 0u64;
    let mut deleted = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        if !keys.is_empty() {
            let n: usize = redis::cmd("DEL")
                .arg(&keys)
                .query_async(&mut conn)
                .await
                .unwrap();
            deleted += n;
        }
        if next == 0 {
            return deleted;
        }
        cursor = next;
    }
}
