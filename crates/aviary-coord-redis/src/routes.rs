//! [`RedisRoutes`]: hot routing for distributed mode — which node runs a
//! sandbox, and which nodes are alive.
//!
//! A route is a cache in front of the registry (the source of record for
//! placement): it has a TTL, a miss means "ask the registry", and a wrong
//! or stale route costs a redirect, never correctness. Node heartbeats are
//! one sorted set of node names scored by when their heartbeat runs out
//! (milliseconds on Redis' clock, so replicas with skewed clocks agree);
//! reading the live nodes prunes the dead ones.

use crate::ttl_millis;
use aviary_core::SandboxId;
use redis::aio::ConnectionManager;
use redis::Script;
use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

/// KEYS: nodes. ARGV: node, ttl ms. The node's heartbeat now runs out at
/// Redis' now + ttl.
static HEARTBEAT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 0
"#,
    )
});

/// KEYS: nodes. Drops the nodes whose heartbeat ran out → the others.
static ALIVE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"#,
    )
});

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RouteError {
    /// A ttl of zero, or one Redis cannot add to its clock.
    #[error("invalid route ttl")]
    InvalidTtl,
    /// The backing store failed; the message is for the server log.
    #[error("route storage: {0}")]
    Storage(String),
}

fn storage(op: &str, e: redis::RedisError) -> RouteError {
    RouteError::Storage(format!("redis {op}: {e}"))
}

/// Sandbox routes and node heartbeats on Redis. Cheap to clone.
#[derive(Clone)]
pub struct RedisRoutes {
    conn: ConnectionManager,
    prefix: String,
}

impl fmt::Debug for RedisRoutes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRoutes")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisRoutes {
    /// Routes on `conn` (see [`crate::connect`]), their keys under
    /// `key_prefix`.
    pub fn new(conn: ConnectionManager, key_prefix: impl Into<String>) -> Self {
        RedisRoutes {
            conn,
            prefix: key_prefix.into(),
        }
    }

    fn route_key(&self, sandbox: &SandboxId) -> String {
        format!("{}:route:{sandbox}", self.prefix)
    }

    fn nodes_key(&self) -> String {
        format!("{}:nodes", self.prefix)
    }

    /// Records that `node` runs `sandbox`, for `ttl`.
    pub async fn set_route(
        &self,
        sandbox: &SandboxId,
        node: &str,
        ttl: Duration,
    ) -> Result<(), RouteError> {
        let ms = ttl_millis(ttl).ok_or(RouteError::InvalidTtl)?;
        redis::cmd("SET")
            .arg(self.route_key(sandbox))
            .arg(node)
            .arg("PX")
            .arg(ms)
            .query_async::<()>(&mut self.conn.clone())
            .await
            .map_err(|e| storage("set route", e))
    }

    /// The node that runs `sandbox`, if a live route says so (`None`: ask
    /// the registry).
    pub async fn route(&self, sandbox: &SandboxId) -> Result<Option<String>, RouteError> {
        redis::cmd("GET")
            .arg(self.route_key(sandbox))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| storage("read route", e))
    }

    /// Forgets the route of `sandbox` (it moved, stopped or is gone).
    pub async fn clear_route(&self, sandbox: &SandboxId) -> Result<(), RouteError> {
        redis::cmd("DEL")
            .arg(self.route_key(sandbox))
            .query_async::<()>(&mut self.conn.clone())
            .await
            .map_err(|e| storage("clear route", e))
    }

    /// Says `node` is alive for the next `ttl`.
    pub async fn heartbeat(&self, node: &str, ttl: Duration) -> Result<(), RouteError> {
        let ms = ttl_millis(ttl).ok_or(RouteError::InvalidTtl)?;
        HEARTBEAT
            .prepare_invoke()
            .key(self.nodes_key())
            .arg(node)
            .arg(ms)
            .invoke_async::<()>(&mut self.conn.clone())
            .await
            .map_err(|e| storage("heartbeat", e))
    }

    /// Takes `node` out of the live nodes now (a clean shutdown), instead
    /// of when its heartbeat runs out.
    pub async fn forget_node(&self, node: &str) -> Result<(), RouteError> {
        redis::cmd("ZREM")
            .arg(self.nodes_key())
            .arg(node)
            .query_async::<()>(&mut self.conn.clone())
            .await
            .map_err(|e| storage("forget node", e))
    }

    /// The nodes whose heartbeat has not run out, by name.
    pub async fn alive_nodes(&self) -> Result<Vec<String>, RouteError> {
        let mut nodes: Vec<String> = ALIVE
            .prepare_invoke()
            .key(self.nodes_key())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| storage("read nodes", e))?;
        nodes.sort();
        Ok(nodes)
    }
}
