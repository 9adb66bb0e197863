//! `aviary-bench leases [CYCLES]`: lease acquire → renew → release, one
//! client, one operation at a time, on each lease store, beside the floor of
//! a networked store: `redis-benchmark` sending `SET k v NX` on one
//! connection against the same Redis, in the same run.
//!
//! Stores: the embedded SQLite registry's lease table; PostgreSQL's (the
//! registry alone, leases in the same database); Redis with fences from
//! PostgreSQL (distributed mode as `aviary serve --registry --coordination`
//! runs it); Redis with fences from memory (Redis' own share). The
//! services come from `AVIARY_TEST_POSTGRES_URL` / `AVIARY_TEST_REDIS_URL`
//! (scripts/bench.sh starts them with scripts/services.sh).

use anyhow::Context;
use aviary_core::SandboxId;
use aviary_leases::{FenceAuthority, LeaseStore, MemoryFences};
use aviary_registry::{Registry, TransitionCtx};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Measured {
    store: &'static str,
    per_cycle: Vec<Duration>,
}

impl Measured {
    fn ops_per_s(&self) -> f64 {
        let total: Duration = self.per_cycle.iter().sum();
        (self.per_cycle.len() * 3) as f64 / total.as_secs_f64()
    }

    fn percentile_ms(&self, p: f64) -> f64 {
        let mut v: Vec<_> = self
            .per_cycle
            .iter()
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[((v.len() - 1) as f64 * p).round() as usize]
    }
}

/// `cycles` rounds of acquire → renew → release on one sandbox.
async fn cycle(
    store: &'static str,
    leases: &dyn LeaseStore,
    id: &SandboxId,
    cycles: usize,
) -> anyhow::Result<Measured> {
    let ttl = Duration::from_secs(60);
    let mut per_cycle = Vec::with_capacity(cycles);
    for _ in 0..cycles {
        let t = Instant::now();
        let now = aviary_core::now();
        let lease = leases.acquire(id, "bench", ttl, now).await?;
        leases.renew(id, lease.token, ttl, now).await?;
        leases.release(id, lease.token, now).await?;
        per_cycle.push(t.elapsed());
    }
    Ok(Measured { store, per_cycle })
}

async fn sandbox_in(r: &dyn Registry) -> anyhow::Result<SandboxId> {
    let new = aviary_registry::conformance::sample_sandbox("bench");
    Ok(r.insert_sandbox(&new, TransitionCtx::default()).await?.id)
}

/// `redis-benchmark`'s requests per second for `SET k v NX` on one
/// connection.
fn redis_floor(url: &str, n: usize) -> anyhow::Result<f64> {
    let rest = url.trim_start_matches("redis://");
    let hostport = rest.split(['/', '?']).next().unwrap_or(rest);
    let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "6379"));
    let out = std::process::Command::new("redis-benchmark")
        .args([
            "-h",
            host,
            "-p",
            port,
            "-c",
            "1",
            "-q",
            "-n",
            &n.to_string(),
        ])
        .args(["SET", "aviary-bench-floor", "v", "NX"])
        .output()
        .context("running redis-benchmark")?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    // "SET aviary-bench-floor v NX: 12345.68 requests per second, p50=..."
    let rps = text
        .rsplit(':')
        .find_map(|part| {
            part.split_whitespace()
                .next()
                .and_then(|v| v.parse::<f64>().ok())
        })
        .with_context(|| format!("redis-benchmark said: {text:?}"))?;
    Ok(rps)
}

pub async fn run(cycles: usize) -> anyhow::Result<()> {
    let pg_url = std::env::var("AVIARY_TEST_POSTGRES_URL")
        .context("AVIARY_TEST_POSTGRES_URL (scripts/services.sh start)")?;
    let redis_url = std::env::var("AVIARY_TEST_REDIS_URL")
        .context("AVIARY_TEST_REDIS_URL (scripts/services.sh start)")?;
    let dir = tempfile::Builder::new()
        .prefix("avbench")
        .tempdir_in("/var/tmp")?;
    let space = format!("bench_{}", std::process::id());
    let mut rows = Vec::new();

    let sqlite = aviary_registry_sqlite::SqliteRegistry::open(&dir.path().join("r.db")).await?;
    let id = sandbox_in(&sqlite).await?;
    rows.push(cycle("embedded: SQLite lease table", &sqlite, &id, cycles).await?);

    let pg = Arc::new(
        aviary_registry_postgres::PostgresRegistry::connect(
            &pg_url,
            aviary_registry_postgres::PostgresOptions::default().schema(space.clone()),
        )
        .await?,
    );
    let id = sandbox_in(pg.as_ref()).await?;
    rows.push(cycle("PostgreSQL lease table", pg.as_ref(), &id, cycles).await?);

    let conn = aviary_coord_redis::connect(&redis_url).await?;
    let fences: Arc<dyn FenceAuthority> = pg.clone();
    let redis_pg = aviary_coord_redis::RedisLeaseStore::new(conn.clone(), fences, space.clone());
    let id = sandbox_in(pg.as_ref()).await?;
    rows.push(
        cycle(
            "distributed: Redis leases, fences from PostgreSQL",
            &redis_pg,
            &id,
            cycles,
        )
        .await?,
    );

    let mem = MemoryFences::new();
    let id = SandboxId::generate();
    mem.register(&id);
    let redis_mem =
        aviary_coord_redis::RedisLeaseStore::new(conn, Arc::new(mem), format!("{space}_mem"));
    rows.push(cycle("Redis leases, fences from memory", &redis_mem, &id, cycles).await?);

    let floor = redis_floor(&redis_url, cycles * 3)?;

    println!("| lease store | ops/s (acquire, renew, release; one client) | one cycle p50 / p90 ms | vs the Redis floor |");
    println!("|---|---|---|---|");
    for m in &rows {
        println!(
            "| {} | {:.0} | {:.2} / {:.2} | {:.2}× slower |",
            m.store,
            m.ops_per_s(),
            m.percentile_ms(0.5),
            m.percentile_ms(0.9),
            floor / m.ops_per_s()
        );
    }
    println!(
        "| floor: `redis-benchmark -c 1 SET k v NX` | {floor:.0} | {:.2} (3 requests) | 1× |",
        3.0 * 1e3 / floor
    );
    println!();
    println!("{cycles} cycles each (3 operations per cycle), sequential, on loopback.");
    Ok(())
}
