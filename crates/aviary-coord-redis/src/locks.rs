//! [`RedisLocks`]: named locks shared by every replica on one Redis.
//!
//! A lock is one string key, `SET NX PX` with the value `<token> <owner>`:
//! the token is random per grant, so extend and release (Lua scripts that
//! compare the whole value first) only ever touch the grant they belong to,
//! and a release never undoes a later holder's lock. TTLs run on Redis'
//! clock, so all replicas agree on when a crashed holder's lock is free.
//!
//! Waiting polls with a short, growing backoff (capped, and never past the
//! holder's remaining TTL or the caller's deadline): Redis does not notify.
//!
//! Dropping a guard sends its release in the background (`Drop` must not
//! block). Until that release has landed, this process's next call on the
//! same lock name waits for it, so "drop, then take it again" works within
//! a process as it does with the in-process locks; other replicas see the
//! lock free a moment later, or after its TTL if the release never arrives.

use crate::ttl_millis;
use async_trait::async_trait;
use aviary_leases::{HeldLock, LockError, LockGuard, LockHolder, LockName, LockRequest, Locks};
use redis::aio::ConnectionManager;
use redis::Script;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

/// First and longest pause between two attempts of a waiting acquire.
const FIRST_BACKOFF: Duration = Duration::from_millis(2);
const MAX_BACKOFF: Duration = Duration::from_millis(50);

/// KEYS: lock. ARGV: value, ttl ms. Taken → empty; else the holder's value
/// and its remaining ms.
static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {} end
return {redis.call('GET', KEYS[1]), tostring(redis.call('PTTL', KEYS[1]))}
"#,
    )
});

/// KEYS: lock. ARGV: value, ttl ms. 1 if the grant was still live and is
/// extended, else 0.
static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"#,
    )
});

/// KEYS: lock. ARGV: value. Deletes the lock if it is still this grant.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"#,
    )
});

/// KEYS: lock. The holder's value and remaining ms, or empty.
static HOLDER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r#"
local v = redis.call('GET', KEYS[1])
if not v then return {} end
return {v, tostring(redis.call('PTTL', KEYS[1]))}
"#,
    )
});

/// The [`Locks`] on Redis (see the module docs). Cheap to clone; clones
/// share the connection and the releases in flight.
#[derive(Clone)]
pub struct RedisLocks {
    conn: ConnectionManager,
    prefix: String,
    releasing: Arc<Releasing>,
}

impl fmt::Debug for RedisLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLocks")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Releases sent by dropped guards and not yet answered, per lock key. Each
/// is a tokio mutex its release task holds until Redis answered.
#[derive(Default)]
struct Releasing {
    in_flight: Mutex<HashMap<String, Vec<Arc<tokio::sync::Mutex<()>>>>>,
}

impl Releasing {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<Arc<tokio::sync::Mutex<()>>>>> {
        // every update is one push or retain, so a poisoned map is whole
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a release of `key`: it counts as in flight until the
    /// returned marker guard is dropped and [`Self::landed`] is called.
    fn start(
        &self,
        key: &str,
    ) -> (
        Arc<tokio::sync::Mutex<()>>,
        tokio::sync::OwnedMutexGuard<()>,
    ) {
        let marker = Arc::new(tokio::sync::Mutex::new(()));
        let held = marker
            .clone()
            .try_lock_owned()
            .expect("a new mutex is unlocked");
        self.lock()
            .entry(key.to_owned())
            .or_default()
            .push(marker.clone());
        (marker, held)
    }

    /// Forgets a release of `key` that has landed.
    fn landed(&self, key: &str, marker: &Arc<tokio::sync::Mutex<()>>) {
        let mut map = self.lock();
        if let Some(list) = map.get_mut(key) {
            list.retain(|m| !Arc::ptr_eq(m, marker));
            if list.is_empty() {
                map.remove(key);
            }
        }
    }

    /// Waits until every release of `key` sent so far has landed.
    async fn settle(&self, key: &str) {
        let pending: Vec<_> = self.lock().get(key).cloned().unwrap_or_default();
        for marker in pending {
            drop(marker.lock().await);
        }
    }
}

fn storage(op: &str, e: redis::RedisError) -> LockError {
    if crate::unreachable(&e) {
        return LockError::Unavailable(format!("redis {op}: {e}"));
    }
    LockError::Storage(format!("redis {op}: {e}"))
}

/// The key of a lock: the scope's length first, so no scope/key pair can
/// collide with another (`a/b` + `c` vs `a` + `b/c`).
fn lock_key(prefix: &str, name: &LockName) -> String {
    format!(
        "{prefix}:lock:{}:{}:{}",
        name.scope().len(),
        name.scope(),
        name.key()
    )
}

/// A holder's value and remaining ms, as the scripts return them.
fn parse_holder(reply: &[String]) -> Result<Option<LockHolder>, LockError> {
    match reply {
        [] => Ok(None),
        [value, pttl] => {
            let (_token, owner) = value
                .split_once(' ')
                .ok_or_else(|| LockError::Storage("redis: corrupt lock value".into()))?;
            // -1 (no expiry) cannot happen for these keys; read it as 0
            let ms = pttl.parse::<i64>().unwrap_or(0).max(0);
            Ok(Some(LockHolder {
                owner: owner.to_owned(),
                expires_in: Duration::from_millis(ms.unsigned_abs()),
            }))
        }
        _ => Err(LockError::Storage("redis: unexpected lock reply".into())),
    }
}

/// The outcome of one attempt.
enum Attempt {
    Taken(LockGuard),
    Held(LockHolder),
}

impl RedisLocks {
    /// Locks on `conn` (see [`crate::connect`]), their keys under
    /// `key_prefix`. Every replica using the same Redis and prefix shares
    /// the same locks.
    pub fn new(conn: ConnectionManager, key_prefix: impl Into<String>) -> Self {
        RedisLocks {
            conn,
            prefix: key_prefix.into(),
            releasing: Arc::default(),
        }
    }

    async fn attempt(&self, req: &LockRequest, ttl_ms: u64) -> Result<Attempt, LockError> {
        let key = lock_key(&self.prefix, &req.name);
        self.releasing.settle(&key).await;
        let value = format!("{} {}", aviary_core::new_id("lock"), req.owner);
        let reply: Vec<String> = ACQUIRE
            .prepare_invoke()
            .key(&key)
            .arg(&value)
            .arg(ttl_ms)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| storage("acquire lock", e))?;
        if let Some(holder) = parse_holder(&reply)? {
            return Ok(Attempt::Held(holder));
        }
        let held = Arc::new(RedisHolding {
            conn: self.conn.clone(),
            key,
            value,
            releasing: self.releasing.clone(),
        });
        Ok(Attempt::Taken(LockGuard::new(req, held)))
    }
}

#[async_trait]
impl Locks for RedisLocks {
    async fn try_acquire(&self, req: &LockRequest) -> Result<Option<LockGuard>, LockError> {
        let ttl_ms = ttl_millis(req.ttl).ok_or(LockError::InvalidTtl)?;
        match self.attempt(req, ttl_ms).await? {
            Attempt::Taken(g) => Ok(Some(g)),
            Attempt::Held(_) => Ok(None),
        }
    }

    async fn acquire(&self, req: &LockRequest, wait: Duration) -> Result<LockGuard, LockError> {
        let ttl_ms = ttl_millis(req.ttl).ok_or(LockError::InvalidTtl)?;
        let start = Instant::now();
        let deadline = start.checked_add(wait);
        let mut backoff = FIRST_BACKOFF;
        loop {
            let holder = match self.attempt(req, ttl_ms).await? {
                Attempt::Taken(g) => return Ok(g),
                Attempt::Held(holder) => holder,
            };
            let now = Instant::now();
            let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(now));
            if left.is_zero() {
                return Err(LockError::Timeout {
                    name: req.name.to_string(),
                    holder: holder.owner,
                    waited: start.elapsed(),
                });
            }
            // look again when the holder's TTL runs out, if that is sooner
            let pause = backoff.min(left).min(holder.expires_in.max(FIRST_BACKOFF));
            tokio::time::sleep(pause).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    async fn holder(&self, name: &LockName) -> Result<Option<LockHolder>, LockError> {
        let key = lock_key(&self.prefix, name);
        self.releasing.settle(&key).await;
        let reply: Vec<String> = HOLDER
            .prepare_invoke()
            .key(&key)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| storage("read lock", e))?;
        parse_holder(&reply)
    }
}

/// One grant, owned by its [`LockGuard`].
struct RedisHolding {
    conn: ConnectionManager,
    key: String,
    /// `<token> <owner>`: the token makes it this grant's.
    value: String,
    releasing: Arc<Releasing>,
}

#[async_trait]
impl HeldLock for RedisHolding {
    async fn extend(&self, ttl: Duration) -> Result<bool, LockError> {
        let ttl_ms = ttl_millis(ttl).ok_or(LockError::InvalidTtl)?;
        let kept: i64 = EXTEND
            .prepare_invoke()
            .key(&self.key)
            .arg(&self.value)
            .arg(ttl_ms)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| storage("extend lock", e))?;
        Ok(kept == 1)
    }

    fn release(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // no runtime to send it on: the TTL frees the lock
            return;
        };
        let (marker, in_flight) = self.releasing.start(&self.key);
        let (mut conn, key, value, releasing) = (
            self.conn.clone(),
            self.key.clone(),
            self.value.clone(),
            self.releasing.clone(),
        );
        runtime.spawn(async move {
            let released: Result<i64, _> = RELEASE
                .prepare_invoke()
                .key(&key)
                .arg(&value)
                .invoke_async(&mut conn)
                .await;
            if let Err(e) = released {
                tracing::warn!(lock = %key, error = %e, "lock release failed; its ttl will free it");
            }
            drop(in_flight);
            releasing.landed(&key, &marker);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_keys_do_not_collide_across_scope_and_key() {
        let a = lock_key("p", &LockName::new("a/b", "c"));
        let b = lock_key("p", &LockName::new("a", "b/c"));
        let c = lock_key("p", &LockName::new("a:1", "c"));
        let d = lock_key("p", &LockName::new("a", "1:c"));
        assert_ne!(a, b);
        assert_ne!(c, d);
        assert_eq!(
            lock_key("p", &LockName::new("bucket", "k")),
            "p:lock:6:bucket:k"
        );
    }

    #[test]
    fn holder_replies_parse() {
        assert_eq!(parse_holder(&[]).unwrap(), None);
        let h = parse_holder(&["lock-abc the owner".into(), "1500".into()])
            .unwrap()
            .unwrap();
        assert_eq!(h.owner, "the owner");
        assert_eq!(h.expires_in, Duration::from_millis(1500));
        parse_holder(&["no-space".into(), "1".into()]).unwrap_err();
    }

    #[tokio::test]
    async fn settle_waits_for_releases_in_flight() {
        let r = Arc::new(Releasing::default());
        let (marker, in_flight) = r.start("k");
        let settled = {
            let r = r.clone();
            tokio::spawn(async move { r.settle("k").await })
        };
        tokio::task::yield_now().await;
        assert!(!settled.is_finished(), "settled before the release landed");
        drop(in_flight);
        r.landed("k", &marker);
        settled.await.unwrap();
        assert!(r.lock().is_empty(), "landed releases are forgotten");
        // nothing in flight: no wait
        r.settle("other").await;
    }
}
