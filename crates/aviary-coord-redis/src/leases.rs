//! [`RedisLeaseStore`]: the live lease of each sandbox in Redis, its fence
//! from the registry's durable counter ([`FenceAuthority`]).
//!
//! Every read-modify-write of a lease is one Lua script, so it is atomic on
//! the Redis primary whichever replica sends it. Liveness compares the
//! caller's `now` with the stored expiry (unix seconds + nanoseconds, exact
//! in Lua's doubles), never Redis' clock.
//!
//! A grant takes three steps: a *claim* (a short real-time reservation of
//! the sandbox's grant, only when no lease is live), `next_fence` from the
//! registry, then the *commit* of the lease (only while the claim is still
//! this grant's). The claim serialises grants, so concurrent acquires on
//! one sandbox draw one fence, not one each: a drawn fence that is not
//! granted would leave the counter above the winner's fence, and the
//! registry's write check (counter == the holder's fence) would then refuse
//! the winner. Callers that find the claim taken wait for the grant to land
//! (and then see `Held`) or for the claim to run out. A commit that finds
//! its claim gone (the registry call outlived it, or Redis lost it) skips
//! its fence and starts over.
//!
//! Whether a sandbox exists is the registry's word
//! ([`FenceAuthority::current_fence`], asked alongside the Redis call).

use crate::ttl_millis;
use async_trait::async_trait;
use aviary_core::{LeaseToken, SandboxId};
use aviary_leases::{expiry, fence_rule, Fence, FenceAuthority, Lease, LeaseError, LeaseStore};
use redis::aio::ConnectionManager;
use redis::Script;
use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;
use time::OffsetDateTime;
use tokio::time::Instant;

/// How long a grant in progress keeps other grants of the sandbox out
/// (real time; a grant is a Redis call, a registry call and a Redis call).
const CLAIM_TTL: Duration = Duration::from_secs(10);
/// How long a lease hash outlives its ttl before Redis deletes it: long
/// enough for `expire_due` to have reaped and reported it first.
const GC_MARGIN: Duration = Duration::from_secs(3600);
/// Commits that may find their claim gone before acquire gives up.
const MAX_LOST_CLAIMS: u32 = 3;
/// Leases one `expire_due` script looks at.
const EXPIRE_BATCH: usize = 256;

/// The fields of a lease hash, in the order the scripts return them.
const LEASE_FIELDS: [&str; 7] = [
    "owner",
    "fence",
    "secret",
    "acquired_s",
    "acquired_ns",
    "expires_s",
    "expires_ns",
];

/// `before(a, b)`: time `a` is strictly earlier than time `b`, each given
/// as unix seconds and nanoseconds (strings or numbers).
const LUA_PRELUDE: &str = r#"
local function before(as, ans, bs, bns)
  as, ans, bs, bns = tonumber(as), tonumber(ans), tonumber(bs), tonumber(bns)
  return as < bs or (as == bs and ans < bns)
end
local FIELDS = {'owner', 'fence', 'secret', 'acquired_s', 'acquired_ns', 'expires_s', 'expires_ns'}
local function read_lease(key)
  local l = redis.call('HMGET', key, unpack(FIELDS))
  for i = 1, #FIELDS do
    if not l[i] then return nil end
  end
  return l
end
"#;

fn lua(body: &str) -> Script {
    Script::new(&format!("{LUA_PRELUDE}{body}"))
}

/// KEYS: lease, claim. ARGV: now_s, now_ns, claim id, claim ttl ms.
/// A live lease → `held owner expires_s expires_ns`; else the claim is
/// taken → `claimed`, or someone else's → `busy`.
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    lua(r#"
local l = read_lease(KEYS[1])
if l and before(ARGV[1], ARGV[2], l[6], l[7]) then
  return {'held', l[1], l[6], l[7]}
end
if redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4]) then
  return {'claimed'}
end
return {'busy'}
"#)
});

/// KEYS: lease, claim, expiry index. ARGV: claim id, sandbox, owner, fence,
/// secret, acquired_s, acquired_ns, expires_s, expires_ns, gc ms.
/// 1 when the lease was written under this claim, else 0.
static COMMIT: LazyLock<Script> = LazyLock::new(|| {
    lua(r#"
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
local l = read_lease(KEYS[1])
if l and before(ARGV[6], ARGV[7], l[6], l[7]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'owner', ARGV[3], 'fence', ARGV[4], 'secret', ARGV[5],
  'acquired_s', ARGV[6], 'acquired_ns', ARGV[7], 'expires_s', ARGV[8], 'expires_ns', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[10])
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[2])
return 1
"#)
});

/// KEYS: claim. ARGV: claim id. Drops the claim if it is still this one.
static DROP_CLAIM: LazyLock<Script> = LazyLock::new(|| {
    lua(r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"#)
});

/// KEYS: lease, expiry index. ARGV: fence, secret, now_s, now_ns,
/// expires_s, expires_ns, gc ms, sandbox. The live lease with this token
/// gets the new expiry → `owner acquired_s acquired_ns`; else empty.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    lua(r#"
local l = read_lease(KEYS[1])
if not l or l[2] ~= ARGV[1] or l[3] ~= ARGV[2] or not before(ARGV[3], ARGV[4], l[6], l[7]) then
  return {}
end
redis.call('HSET', KEYS[1], 'expires_s', ARGV[5], 'expires_ns', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[8])
return {l[1], l[4], l[5]}
"#)
});

/// KEYS: lease, expiry index. ARGV: fence, secret, now_s, now_ns, sandbox.
/// Deletes the live lease with this token → 1; else 0.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    lua(r#"
local l = read_lease(KEYS[1])
if not l or l[2] ~= ARGV[1] or l[3] ~= ARGV[2] or not before(ARGV[3], ARGV[4], l[6], l[7]) then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[5])
return 1
"#)
});

/// KEYS: expiry index. ARGV: now_s, now_ns, lease key prefix, batch size.
/// Pops up to a batch of due leases → `scanned` then, per lease, the
/// sandbox id and the seven fields.
static EXPIRE_DUE: LazyLock<Script> = LazyLock::new(|| {
    lua(r#"
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[4])
local out = {tostring(#ids)}
for _, id in ipairs(ids) do
  local key = ARGV[3] .. id
  local l = read_lease(key)
  if not l then
    -- collected by its PEXPIRE (or never whole): nothing to report
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[1], id)
  elseif not before(ARGV[1], ARGV[2], l[6], l[7]) then
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[1], id)
    table.insert(out, id)
    for i = 1, 7 do table.insert(out, l[i]) end
  end
end
return out
"#)
});

/// The [`LeaseStore`] on Redis (see the module docs). Cheap to clone;
/// clones share the connection.
#[derive(Clone)]
pub struct RedisLeaseStore {
    conn: ConnectionManager,
    fences: Arc<dyn FenceAuthority>,
    prefix: String,
}

impl fmt::Debug for RedisLeaseStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLeaseStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// The outcome of a claim.
enum Claim {
    Claimed,
    /// Another grant is in progress.
    Busy,
    Held {
        owner: String,
        expires_at: OffsetDateTime,
    },
}

fn storage(op: &str, e: redis::RedisError) -> LeaseError {
    if crate::unreachable(&e) {
        return LeaseError::Unavailable(format!("redis {op}: {e}"));
    }
    LeaseError::Storage(format!("redis {op}: {e}"))
}

fn corrupt(what: &str) -> LeaseError {
    LeaseError::Storage(format!("redis: corrupt lease record ({what})"))
}

/// A time as unix seconds and nanoseconds, as the scripts compare it.
fn split(t: OffsetDateTime) -> (String, String) {
    (t.unix_timestamp().to_string(), t.nanosecond().to_string())
}

fn join(secs: &str, nanos: &str) -> Result<OffsetDateTime, LeaseError> {
    let secs: i64 = secs.parse().map_err(|_| corrupt("time"))?;
    let nanos: i64 = nanos.parse().map_err(|_| corrupt("time"))?;
    OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| t.checked_add(time::Duration::nanoseconds(nanos)))
        .ok_or_else(|| corrupt("time"))
}

/// The lease from its seven fields (in [`LEASE_FIELDS`] order).
fn parse_lease(sandbox: SandboxId, f: &[String]) -> Result<Lease, LeaseError> {
    let [owner, fence, secret, acquired_s, acquired_ns, expires_s, expires_ns] = f else {
        return Err(corrupt("fields"));
    };
    let fence: u64 = fence.parse().map_err(|_| corrupt("fence"))?;
    let secret = LeaseToken::secret_from_hex(secret).ok_or_else(|| corrupt("secret"))?;
    Ok(Lease {
        sandbox_id: sandbox,
        owner: owner.clone(),
        token: LeaseToken::from_parts(fence, secret),
        acquired_at: join(acquired_s, acquired_ns)?,
        expires_at: join(expires_s, expires_ns)?,
    })
}

/// How long Redis keeps a lease hash: its ttl plus [`GC_MARGIN`].
fn gc_millis(ttl: Duration) -> u64 {
    ttl_millis(ttl.saturating_add(GC_MARGIN)).unwrap_or(1 << 53)
}

impl RedisLeaseStore {
    /// A lease store on `conn` (see [`crate::connect`]), drawing fences from
    /// `fences` (the registry), its keys under `key_prefix`. Stores on the
    /// same Redis and prefix are one store: replicas share it, and a new one
    /// sees everything an old one wrote.
    pub fn new(
        conn: ConnectionManager,
        fences: Arc<dyn FenceAuthority>,
        key_prefix: impl Into<String>,
    ) -> Self {
        RedisLeaseStore {
            conn,
            fences,
            prefix: key_prefix.into(),
        }
    }

    fn lease_key(&self, sandbox: &SandboxId) -> String {
        format!("{}:lease:{sandbox}", self.prefix)
    }

    fn claim_key(&self, sandbox: &SandboxId) -> String {
        format!("{}:lease-claim:{sandbox}", self.prefix)
    }

    fn index_key(&self) -> String {
        format!("{}:lease-expiry", self.prefix)
    }

    /// `NotFound` unless the registry knows the sandbox.
    async fn known(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
        self.fences.current_fence(sandbox).await.map(|_| ())
    }

    /// The stored lease, live or not.
    async fn stored(&self, sandbox: &SandboxId) -> Result<Option<Lease>, LeaseError> {
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(self.lease_key(sandbox))
            .arg(&LEASE_FIELDS[..])
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| storage("read lease", e))?;
        match fields.into_iter().collect::<Option<Vec<String>>>() {
            Some(f) => parse_lease(sandbox.clone(), &f).map(Some),
            // no hash, or not a whole one (the scripts never write half)
            None => Ok(None),
        }
    }

    /// The live lease, after asking the registry whether the sandbox exists.
    async fn live(
        &self,
        sandbox: &SandboxId,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, LeaseError> {
        let (known, stored) = tokio::join!(self.known(sandbox), self.stored(sandbox));
        known?;
        Ok(stored?.filter(|l| now < l.expires_at))
    }

    async fn claim(
        &self,
        sandbox: &SandboxId,
        claim_id: &str,
        now: OffsetDateTime,
    ) -> Result<Claim, LeaseError> {
        let (now_s, now_ns) = split(now);
        let claim_ms = ttl_millis(CLAIM_TTL).unwrap_or(10_000);
        let reply: Vec<String> = CLAIM
            .prepare_invoke()
            .key(self.lease_key(sandbox))
            .key(self.claim_key(sandbox))
            .arg(now_s)
            .arg(now_ns)
            .arg(claim_id)
            .arg(claim_ms)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| storage("claim grant", e))?;
        match reply.as_slice() {
            [c] if c == "claimed" => Ok(Claim::Claimed),
            [c] if c == "busy" => Ok(Claim::Busy),
            [c, owner, s, ns] if c == "held" => Ok(Claim::Held {
                owner: owner.clone(),
                expires_at: join(s, ns)?,
            }),
            _ => Err(LeaseError::Storage(
                "redis claim grant: unexpected reply".into(),
            )),
        }
    }

    /// Writes `lease` if `claim_id` still holds the grant; false if not.
    async fn commit(&self, lease: &Lease, claim_id: &str, gc_ms: u64) -> Result<bool, LeaseError> {
        let sandbox = &lease.sandbox_id;
        let (acq_s, acq_ns) = split(lease.acquired_at);
        let (exp_s, exp_ns) = split(lease.expires_at);
        let written: i64 = COMMIT
            .prepare_invoke()
            .key(self.lease_key(sandbox))
            .key(self.claim_key(sandbox))
            .key(self.index_key())
            .arg(claim_id)
            .arg(sandbox.as_str())
            .arg(&lease.owner)
            .arg(lease.token.fence())
            .arg(lease.token.secret_hex())
            .arg(acq_s)
            .arg(acq_ns)
            .arg(exp_s)
            .arg(exp_ns)
            .arg(gc_ms)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| storage("commit grant", e))?;
        Ok(written == 1)
    }

    /// Gives up a claim (the grant failed before its commit).
    async fn drop_claim(&self, sandbox: &SandboxId, claim_id: &str) {
        let dropped: Result<i64, _> = DROP_CLAIM
            .prepare_invoke()
            .key(self.claim_key(sandbox))
            .arg(claim_id)
            .invoke_async(&mut self.conn.clone())
            .await;
        if let Err(e) = dropped {
            // the claim runs out by itself
            tracing::warn!(sandbox.id = %sandbox, error = %e, "could not drop a lease claim");
        }
    }
}

#[async_trait]
impl LeaseStore for RedisLeaseStore {
    #[tracing::instrument(skip_all, fields(sandbox.id = %sandbox))]
    async fn acquire(
        &self,
        sandbox: &SandboxId,
        owner: &str,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let expires_at = expiry(now, ttl)?;
        let claim_id = aviary_core::new_id("claim");
        // a claim left by a crashed replica runs out within CLAIM_TTL
        let give_up = Instant::now() + CLAIM_TTL * 2;
        let mut backoff = Duration::from_millis(1);
        let mut lost_claims = 0;
        loop {
            match self.claim(sandbox, &claim_id, now).await? {
                Claim::Held { owner, expires_at } => {
                    return Err(LeaseError::Held { owner, expires_at })
                }
                Claim::Busy if Instant::now() >= give_up => {
                    return Err(LeaseError::Storage(
                        "another grant of this sandbox did not finish".into(),
                    ))
                }
                Claim::Busy => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(20));
                    continue;
                }
                Claim::Claimed => {}
            }
            let fence = match self.fences.next_fence(sandbox).await {
                Ok(fence) => fence,
                Err(e) => {
                    self.drop_claim(sandbox, &claim_id).await;
                    return Err(e);
                }
            };
            let lease = Lease {
                sandbox_id: sandbox.clone(),
                owner: owner.to_owned(),
                token: LeaseToken::generate(fence),
                acquired_at: now,
                expires_at,
            };
            if self.commit(&lease, &claim_id, gc_millis(ttl)).await? {
                return Ok(lease);
            }
            // the claim ran out (or Redis lost it) before the commit: this
            // fence is skipped, and a later grant's is above it
            lost_claims += 1;
            tracing::warn!(fence, lost_claims, "lease claim lost before its commit");
            if lost_claims >= MAX_LOST_CLAIMS {
                return Err(LeaseError::Storage(
                    "lease grant kept losing its claim".into(),
                ));
            }
        }
    }

    #[tracing::instrument(skip_all, fields(sandbox.id = %sandbox))]
    async fn renew(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let expires_at = expiry(now, ttl)?;
        let (now_s, now_ns) = split(now);
        let (exp_s, exp_ns) = split(expires_at);
        let renew = async {
            RENEW
                .prepare_invoke()
                .key(self.lease_key(sandbox))
                .key(self.index_key())
                .arg(token.fence())
                .arg(token.secret_hex())
                .arg(now_s)
                .arg(now_ns)
                .arg(exp_s)
                .arg(exp_ns)
                .arg(gc_millis(ttl))
                .arg(sandbox.as_str())
                .invoke_async::<Vec<String>>(&mut self.conn.clone())
                .await
                .map_err(|e| storage("renew lease", e))
        };
        let (known, renewed) = tokio::join!(self.known(sandbox), renew);
        known?;
        match renewed?.as_slice() {
            [] => Err(LeaseError::StaleToken),
            [owner, acq_s, acq_ns] => Ok(Lease {
                sandbox_id: sandbox.clone(),
                owner: owner.clone(),
                token,
                acquired_at: join(acq_s, acq_ns)?,
                expires_at,
            }),
            _ => Err(corrupt("renew reply")),
        }
    }

    #[tracing::instrument(skip_all, fields(sandbox.id = %sandbox))]
    async fn release(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        now: OffsetDateTime,
    ) -> Result<(), LeaseError> {
        let (now_s, now_ns) = split(now);
        let release = async {
            RELEASE
                .prepare_invoke()
                .key(self.lease_key(sandbox))
                .key(self.index_key())
                .arg(token.fence())
                .arg(token.secret_hex())
                .arg(now_s)
                .arg(now_ns)
                .arg(sandbox.as_str())
                .invoke_async::<i64>(&mut self.conn.clone())
                .await
                .map_err(|e| storage("release lease", e))
        };
        let (known, released) = tokio::join!(self.known(sandbox), release);
        known?;
        match released? {
            1 => Ok(()),
            _ => Err(LeaseError::StaleToken),
        }
    }

    async fn current(
        &self,
        sandbox: &SandboxId,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, LeaseError> {
        self.live(sandbox, now).await
    }

    async fn check(
        &self,
        sandbox: &SandboxId,
        token: Option<LeaseToken>,
        now: OffsetDateTime,
    ) -> Result<Fence, LeaseError> {
        let live = self.live(sandbox, now).await?;
        fence_rule(live.map(|l| l.token), token)
    }

    #[tracing::instrument(skip_all)]
    async fn expire_due(&self, now: OffsetDateTime) -> Result<Vec<Lease>, LeaseError> {
        let (now_s, now_ns) = split(now);
        let lease_prefix = format!("{}:lease:", self.prefix);
        let mut due = Vec::new();
        loop {
            let reply: Vec<String> = EXPIRE_DUE
                .prepare_invoke()
                .key(self.index_key())
                .arg(&now_s)
                .arg(&now_ns)
                .arg(&lease_prefix)
                .arg(EXPIRE_BATCH)
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(|e| storage("expire leases", e))?;
            let Some((scanned, reaped)) = reply.split_first() else {
                return Err(corrupt("expire reply"));
            };
            let scanned: usize = scanned.parse().map_err(|_| corrupt("expire reply"))?;
            let before = due.len();
            for lease in reaped.chunks(1 + LEASE_FIELDS.len()) {
                let (id, fields) = lease.split_first().ok_or_else(|| corrupt("expire reply"))?;
                let id: SandboxId = id.parse().map_err(|_| corrupt("sandbox id"))?;
                due.push(parse_lease(id, fields)?);
            }
            // a short batch was the last; a full one that reaped nothing
            // is leases due later in the current second
            if scanned < EXPIRE_BATCH || due.len() == before {
                return Ok(due);
            }
        }
    }

    #[tracing::instrument(skip_all, fields(sandbox.id = %sandbox))]
    async fn revoke(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
        self.known(sandbox).await?;
        redis::pipe()
            .atomic()
            .del(self.lease_key(sandbox))
            .ignore()
            .zrem(self.index_key(), sandbox.as_str())
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await
            .map_err(|e| storage("revoke lease", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    #[test]
    fn times_split_and_join_exactly() {
        for t in [
            datetime!(2030-01-01 0:00:00.000000001 UTC),
            datetime!(1969-12-31 23:59:59.5 UTC),
            datetime!(9999-12-31 23:59:59.999999999 UTC),
            aviary_core::now(),
        ] {
            let (s, ns) = split(t);
            assert_eq!(join(&s, &ns).unwrap(), t, "{t}");
        }
        join("x", "0").unwrap_err();
    }

    #[test]
    fn a_lease_parses_from_its_fields() {
        let token = LeaseToken::generate(7);
        let id = SandboxId::generate();
        let fields = [
            "agent".to_owned(),
            "7".to_owned(),
            token.secret_hex(),
            "1893456000".to_owned(),
            "5".to_owned(),
            "1893456060".to_owned(),
            "0".to_owned(),
        ];
        let l = parse_lease(id.clone(), &fields).unwrap();
        assert_eq!(l.sandbox_id, id);
        assert_eq!(l.owner, "agent");
        assert!(l.token.matches(&token));
        assert_eq!(l.acquired_at, datetime!(2030-01-01 0:00:00.000000005 UTC));
        assert_eq!(l.expires_at, datetime!(2030-01-01 0:01 UTC));
        parse_lease(id.clone(), &fields[..6]).unwrap_err();
        let mut bad = fields.clone();
        bad[2] = "zz".into();
        parse_lease(id, &bad).unwrap_err();
    }

    #[test]
    fn gc_outlives_the_ttl() {
        assert_eq!(gc_millis(Duration::from_secs(60)), 3_660_000);
        assert_eq!(gc_millis(Duration::MAX), 1 << 53);
    }
}
