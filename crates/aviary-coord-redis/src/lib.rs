//! Aviary's coordination backends on Redis, for distributed mode: several
//! control-plane replicas sharing one Redis and one PostgreSQL registry.
//!
//! - [`RedisLeaseStore`]: the [`aviary_leases::LeaseStore`] — the one live
//!   lease per sandbox, with its fencing token;
//! - [`RedisLocks`]: the [`aviary_leases::Locks`] — named locks with a TTL;
//! - [`RedisRoutes`]: hot routing — which node runs a sandbox (a cache in
//!   front of the registry) and which nodes are alive (heartbeats);
//! - [`connect`]: one connection, shared by all three, that fails fast.
//!
//! # Where the fencing counter lives, and why losing Redis is safe
//!
//! Redis holds only the *live* lease (owner, token, expiry). The
//! authoritative fencing counter — the number the next token's fence is
//! drawn from — lives in the registry (SQLite or PostgreSQL), behind
//! [`aviary_leases::FenceAuthority`]: every grant asks it for
//! `next_fence`, which is durable and transactional. Redis never makes up a
//! fence.
//!
//! So when Redis restarts empty, or fails over to a replica that missed the
//! last writes, leases vanish (or an older one reappears), and only
//! *liveness* is lost: holders must acquire again. Safety holds, because
//! - the next grant still gets a fence above every fence ever issued (the
//!   counter never went away);
//! - every client-initiated registry write re-checks the fence it carries
//!   against that durable counter, in the same transaction
//!   (`FenceCheck::Counter` in `aviary-registry`), so a holder whose lease
//!   was superseded is refused even if Redis still shows its old lease;
//! - envd refuses any fence older than the newest it has seen.
//!
//! # Key layout
//!
//! Every key starts with the prefix given to the constructors (`P` below);
//! replicas of one deployment share a prefix, tests use a random one.
//!
//! | key | type | what |
//! | --- | --- | --- |
//! | `P:lease:<sandbox>` | hash | the live lease: `owner`, `fence`, `secret` (hex), `acquired_s`/`acquired_ns`, `expires_s`/`expires_ns` (unix seconds + nanoseconds) |
//! | `P:lease-claim:<sandbox>` | string | a grant in progress (a random claim id), 10 s real-time TTL |
//! | `P:lease-expiry` | sorted set | sandbox ids scored by `expires_s`, the index `expire_due` pops from |
//! | `P:lock:<len(scope)>:<scope>:<key>` | string | a held lock: `<token> <owner>`, PX = its TTL |
//! | `P:route:<sandbox>` | string | the node running the sandbox, PX = the route's TTL |
//! | `P:nodes` | sorted set | node names scored by heartbeat expiry (ms, Redis' clock) |
//!
//! # Clocks
//!
//! Lease liveness is judged only by the `now` the caller passes (the lease
//! contract: no backend reads the clock); the PEXPIRE on a lease hash is
//! garbage collection, long after the lease ran out. Locks, routes and
//! heartbeats are real time on Redis' clock (PX, `TIME`), one clock for
//! every replica.
//!
//! # Deployment
//!
//! One Redis primary at one address (standalone, or behind a failover that
//! keeps the address; [`connect`] does not speak Sentinel). The Lua scripts
//! are atomic on it; some touch keys they compute from an argument, so
//! Redis Cluster is not supported.
#![forbid(unsafe_code)]

mod leases;
mod locks;
mod routes;

pub use leases::RedisLeaseStore;
pub use locks::RedisLocks;
pub use redis::aio::ConnectionManager;
pub use routes::{RedisRoutes, RouteError};

use std::time::Duration;

/// Whether Redis could not be reached (connection refused or dropped, a
/// timeout, a server still loading its data): the call changed nothing and
/// is answered 503.
pub(crate) fn unreachable(e: &redis::RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || matches!(
            e.kind(),
            redis::ErrorKind::BusyLoadingError | redis::ErrorKind::TryAgain
        )
}

/// How long [`connect`] tries before giving up.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one command may take before it fails (a partitioned Redis
/// fails calls instead of hanging them).
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connecting to Redis failed. Messages name the server as `host:port`
/// (never the URL, which may carry a password).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("invalid redis url")]
    ParseUrl(#[source] redis::RedisError),
    #[error("connect to redis at {addr}")]
    Connect {
        addr: String,
        #[source]
        source: redis::RedisError,
    },
    #[error("connect to redis at {addr}: no answer within {waited:?}")]
    Timeout { addr: String, waited: Duration },
    #[error("ping redis at {addr}")]
    Ping {
        addr: String,
        #[source]
        source: redis::RedisError,
    },
}

/// Connects to `url` (`redis://[:password@]host:port/db`) and checks the
/// server with PING, giving up after [`CONNECT_TIMEOUT`]. The connection
/// reconnects by itself after Redis restarts; it is cheap to clone, and one
/// is meant to be shared by the lease store, the locks and the routes.
pub async fn connect(url: &str) -> Result<ConnectionManager, ConnectError> {
    let client = redis::Client::open(url).map_err(ConnectError::ParseUrl)?;
    let addr = client.get_connection_info().addr.to_string();
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(CONNECT_TIMEOUT)
        .set_response_timeout(RESPONSE_TIMEOUT)
        // no retries inside one attempt (they back off for seconds): a
        // refused connection is reported at once, and after a disconnect
        // every later command tries to reconnect again
        .set_number_of_retries(0);
    let connecting = redis::aio::ConnectionManager::new_with_config(client, config);
    let mut conn = match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(source)) => return Err(ConnectError::Connect { addr, source }),
        Err(_) => {
            return Err(ConnectError::Timeout {
                addr,
                waited: CONNECT_TIMEOUT,
            })
        }
    };
    let pong: Result<String, _> = redis::cmd("PING").query_async(&mut conn).await;
    pong.map_err(|source| ConnectError::Ping { addr, source })?;
    Ok(conn)
}

/// `ttl` in whole milliseconds, rounded up (a holder keeps at least what it
/// asked for); `None` for zero and for a ttl Redis cannot add to its clock.
fn ttl_millis(ttl: Duration) -> Option<u64> {
    /// About 285 000 years: far below what overflows Redis' expiry.
    const MAX_MS: u64 = 1 << 53;
    if ttl.is_zero() {
        return None;
    }
    let ms = u64::try_from(ttl.as_nanos().div_ceil(1_000_000)).ok()?;
    (ms <= MAX_MS).then_some(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_millis_rounds_up_and_refuses_zero_and_huge() {
        assert_eq!(ttl_millis(Duration::ZERO), None);
        assert_eq!(ttl_millis(Duration::from_nanos(1)), Some(1));
        assert_eq!(ttl_millis(Duration::from_micros(1500)), Some(2));
        assert_eq!(ttl_millis(Duration::from_secs(600)), Some(600_000));
        assert_eq!(ttl_millis(Duration::MAX), None);
    }

    #[tokio::test]
    async fn a_bad_url_is_refused_without_echoing_it() {
        let Err(e) = connect("http://:hunter2@example.invalid/").await else {
            panic!("connected with an http url");
        };
        assert!(matches!(e, ConnectError::ParseUrl(_)), "{e:?}");
        let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert!(!chain.contains("hunter2"), "{chain}");
    }
}
