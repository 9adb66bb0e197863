//! The embedded registry: Aviary's [`Registry`] and [`LeaseStore`] on one
//! SQLite file (DESIGN §2, embedded mode).
//!
//! This crate owns the SQLite schema (`migrations/`, applied on open and
//! tracked in `PRAGMA user_version`) and the mapping of driver errors to the
//! semantic [`RegistryError`] / [`LeaseError`] variants. The file holds
//! secrets (node agent tokens), so callers create it 0600; SQLite gives its
//! `-wal`/`-shm` files the database file's mode.
//!
//! Invariants: the sandbox's fencing counter lives in its
//! `sandbox_instance.fence_token` column, so tokens keep increasing across
//! lease deletion and restarts; the fencing check of
//! [`Registry::transition`] reads `sandbox_lease` inside the transaction that
//! writes the state, so a lease taken or lost concurrently cannot slip
//! between check and write.
//!
//! Concurrency: SQLite has one writer. All writes go through a one-connection
//! writer pool (so writers in this process queue in the pool instead of
//! spinning on `SQLITE_BUSY`), and every read-modify-write transaction starts
//! with `BEGIN IMMEDIATE`, which takes the write lock up front, so two
//! processes on the same file cannot both win a race either (the busy
//! timeout makes the loser wait). Reads use a separate read-only pool and
//! see the last committed state (WAL).
#![forbid(unsafe_code)]

mod leases;
mod registry;

use aviary_leases::LeaseError;
use aviary_registry::RegistryError;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Executor, Sqlite, SqlitePool, Transaction};
use std::path::Path;
use std::time::Duration;
use time::OffsetDateTime;

pub use aviary_leases::LeaseStore;
pub use aviary_registry::Registry;

/// Schema migrations, applied in order; migration `i` brings the schema to
/// version `i + 1`. Never edit a released one: append a new file.
const MIGRATIONS: &[&str] = &[
    include_str!("../migrations/0001_init.sql"),
    include_str!("../migrations/0002_environment_manifest.sql"),
    include_str!("../migrations/0003_user_managed.sql"),
    include_str!("../migrations/0004_api_key_revocation.sql"),
    include_str!("../migrations/0005_lease_secret.sql"),
    include_str!("../migrations/0006_snapshots_pools_nodes.sql"),
    include_str!("../migrations/0007_paused.sql"),
    include_str!("../migrations/0008_labels_env_secrets.sql"),
    include_str!("../migrations/0009_reuse_state.sql"),
    include_str!("../migrations/0010_live_index.sql"),
];

/// How long a writer from another process waits for the write lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
const READ_CONNECTIONS: u32 = 4;

/// The registry and lease store on one SQLite database file. Cheap to clone
/// (the pools are shared).
#[derive(Clone, Debug)]
pub struct SqliteRegistry {
    writer: SqlitePool,
    reader: SqlitePool,
}

impl SqliteRegistry {
    /// Opens (creating if missing) the database at `path`, in WAL mode with
    /// `synchronous=NORMAL`, foreign keys on and a busy timeout, and applies
    /// pending migrations.
    pub async fn open(path: &Path) -> Result<Self, RegistryError> {
        let base = SqliteConnectOptions::new()
            .filename(path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true);
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .connect_with(base.clone().create_if_missing(true))
            .await
            .map_err(storage)?;
        migrate(&writer).await?;
        let reader = SqlitePoolOptions::new()
            .max_connections(READ_CONNECTIONS)
            .connect_with(base.read_only(true))
            .await
            .map_err(storage)?;
        tracing::debug!(path = %path.display(), "registry opened");
        Ok(SqliteRegistry { writer, reader })
    }

    /// Closes both pools, waiting for their connections to finish. Dropping
    /// the registry closes them too, without waiting.
    pub async fn close(&self) {
        self.reader.close().await;
        self.writer.close().await;
    }

    /// The schema version the database is at.
    pub async fn schema_version(&self) -> Result<i64, RegistryError> {
        sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(&self.reader)
            .await
            .map_err(storage)
    }

    /// Benchmarks only: adds `rows` terminated sandboxes (half of them
    /// `tenant`'s, half another tenant's) in one statement, then `ANALYZE`s,
    /// so a registry can be measured with a long history without creating
    /// it one sandbox at a time. Ids are `sbx-h<n>`; nothing else refers to
    /// them.
    #[doc(hidden)]
    pub async fn seed_terminated_history(
        &self,
        tenant: &str,
        rows: u64,
    ) -> Result<(), RegistryError> {
        sqlx::query(
            "INSERT INTO sandbox_instance (sandbox_id, tenant_id, scope, runtime_provider, node_id, \
             resource_class, cpu, memory_mb, disk_mb, pids, template_id, template_digest, \
             network_profile, state, created_at, last_active_at, version, tainted) \
             WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1) \
             SELECT printf('sbx-h%019d', i), CASE i % 2 WHEN 0 THEN ?2 ELSE 'history-other' END, \
             'session', 'crun', 'local', 'python-small', 1.0, 512, 1024, 64, 'busybox', \
             'sha256:aa', 'none', 'Terminated', i, i, 3, 0 FROM n",
        )
        .bind(i64::try_from(rows).map_err(|_| RegistryError::Storage("too many rows".into()))?)
        .bind(tenant)
        .execute(&self.writer)
        .await
        .map_err(storage)?;
        sqlx::query("ANALYZE")
            .execute(&self.writer)
            .await
            .map_err(storage)?;
        Ok(())
    }

    /// A write transaction holding the database's write lock from its start.
    async fn begin_write(&self) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
        self.writer.begin_with("BEGIN IMMEDIATE").await
    }
}

async fn migrate(writer: &SqlitePool) -> Result<(), RegistryError> {
    let mut tx = writer
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(storage)?;
    let current: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(&mut *tx)
        .await
        .map_err(storage)?;
    let known = i64::try_from(MIGRATIONS.len()).unwrap_or(i64::MAX);
    if current > known {
        return Err(RegistryError::Storage(format!(
            "database schema version {current} is newer than this build's {known}"
        )));
    }
    for (version, sql) in (1..)
        .zip(MIGRATIONS)
        .skip(usize::try_from(current).unwrap_or(0))
    {
        // `Executor::execute` on a plain string runs every statement in it
        tx.execute(*sql).await.map_err(storage)?;
        // PRAGMA takes no bind parameters; `version` is our own integer.
        let pragma = format!("PRAGMA user_version = {version}");
        tx.execute(pragma.as_str()).await.map_err(storage)?;
        tracing::info!(version, "registry schema migrated");
    }
    tx.commit().await.map_err(storage)
}

/// A driver error as a registry error: unique violations are `Duplicate`,
/// foreign-key violations `NotFound` (the referenced row is missing),
/// anything else `Storage`.
fn storage(e: sqlx::Error) -> RegistryError {
    if let sqlx::Error::Database(db) = &e {
        match db.kind() {
            sqlx::error::ErrorKind::UniqueViolation => return RegistryError::Duplicate,
            sqlx::error::ErrorKind::ForeignKeyViolation => return RegistryError::NotFound,
            _ => {}
        }
    }
    RegistryError::Storage(e.to_string())
}

fn lease_storage(e: sqlx::Error) -> LeaseError {
    LeaseError::Storage(e.to_string())
}

/// Registry-side decode errors inside lease code.
fn lease_from_registry(e: RegistryError) -> LeaseError {
    match e {
        RegistryError::NotFound => LeaseError::NotFound,
        other => LeaseError::Storage(other.to_string()),
    }
}

/// Microseconds since the epoch: the precision of the `time` columns (and of
/// PostgreSQL's `timestamptz`). Every `OffsetDateTime` (years ±9999) fits.
fn micros(t: OffsetDateTime) -> i64 {
    i64::try_from(t.unix_timestamp_nanos() / 1000).unwrap_or(i64::MAX)
}

/// `t` truncated to the stored precision, so what a call returns equals what
/// a later read returns.
fn truncate(t: OffsetDateTime) -> OffsetDateTime {
    let nanos = t.nanosecond();
    t.replace_nanosecond(nanos - nanos % 1000).unwrap_or(t)
}

fn from_micros(us: i64) -> Result<OffsetDateTime, RegistryError> {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(us) * 1000)
        .map_err(|e| RegistryError::Storage(format!("bad stored time {us}: {e}")))
}

fn to_i64(v: u64) -> Result<i64, RegistryError> {
    i64::try_from(v).map_err(|_| RegistryError::Storage(format!("value {v} out of range")))
}

fn to_u64(v: i64) -> Result<u64, RegistryError> {
    u64::try_from(v).map_err(|_| RegistryError::Storage(format!("bad stored value {v}")))
}

#[cfg(test)]
mod tests;
