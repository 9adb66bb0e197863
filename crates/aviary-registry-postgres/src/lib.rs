//! The distributed registry: Aviary's [`Registry`], [`LeaseStore`] and
//! [`FenceAuthority`] on PostgreSQL (DESIGN §2, distributed mode), the
//! counterpart of `aviary-registry-sqlite`, with the same behaviour.
//!
//! This crate owns the PostgreSQL schema (`migrations/`, embedded in the
//! binary, applied on connect in one transaction under a per-schema advisory
//! lock and recorded in `registry_migrations`; a database at a newer version
//! than this build is refused) and the mapping of driver errors to the
//! semantic [`RegistryError`] / [`LeaseError`] variants. One database can hold several registries, one per
//! schema ([`PostgresOptions::schema`]). The tables hold secrets (node agent
//! tokens), so the database's roles are part of the access control.
//!
//! Invariants, as in SQLite: the sandbox's fencing counter lives in its
//! `sandbox_instance.fence_token` column, so fences keep increasing across
//! lease deletion, restarts and every control plane sharing the schema;
//! a lease grant bumps it in the transaction that writes the lease row, and
//! [`FenceAuthority::next_fence`] bumps the same column.
//!
//! Concurrency: any number of control planes may share one schema, each with
//! its own pool. Transactions run at READ COMMITTED and every
//! read-modify-write of a sandbox (transition, claim, lease grant) starts by
//! locking its `sandbox_instance` row (`SELECT … FOR NO KEY UPDATE`: the
//! row lock an `UPDATE` takes, which still lets foreign-key checks of other
//! tables through), so racing writers of one sandbox queue on that lock and
//! the loser sees the winner's commit. The statements after the lock read a fresh snapshot:
//! the lease a fenced transition checks is the committed one, and no grant
//! can slip between its check and its write (a grant bumps the counter in
//! the locked row). Single-row writes (renew, release, field updates) are one
//! conditional statement. Event ids come from an identity column, which
//! PostgreSQL hands out in call order, not commit order; every transaction
//! that writes events therefore takes a per-schema advisory lock right before
//! the insert and holds it to its commit, so ids become visible in
//! increasing order and `after_id` paging never skips a row.
#![forbid(unsafe_code)]

mod leases;
mod registry;

use aviary_leases::LeaseError;
use aviary_registry::RegistryError;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{Connection, Executor, PgPool, Postgres, Transaction};
use std::fmt;
use std::time::Duration;
use time::OffsetDateTime;

pub use aviary_leases::{FenceAuthority, LeaseStore};
pub use aviary_registry::Registry;

/// Schema migrations as (version, description, SQL), in order; applied ones
/// are recorded in `registry_migrations`. Never edit a released one: append
/// a new file.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("../migrations/0001_init.sql")),
    (2, "paused", include_str!("../migrations/0002_paused.sql")),
    (
        3,
        "labels_env_secrets",
        include_str!("../migrations/0003_labels_env_secrets.sql"),
    ),
    (
        4,
        "reuse state",
        include_str!("../migrations/0004_reuse_state.sql"),
    ),
    (
        5,
        "live_index",
        include_str!("../migrations/0005_live_index.sql"),
    ),
];

/// The schema version this build brings a database to.
pub const SCHEMA_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].0;

/// PostgreSQL truncates longer identifiers, which would silently alias two
/// schema names.
const MAX_IDENTIFIER_LEN: usize = 63;

/// How to connect; `Default` is a sane production setting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostgresOptions {
    /// The schema holding this registry's tables, created if missing and set
    /// as the `search_path` of every pooled connection. `None` keeps the
    /// server's `search_path` (usually `public`). ASCII letters, digits and
    /// `_`, not starting with a digit or `pg_`, at most 63 bytes.
    pub schema: Option<String>,
    /// Most connections the pool opens (default 10).
    pub max_connections: u32,
    /// How long establishing the first connection may take before
    /// [`PostgresRegistry::connect`] gives up (default 5 s).
    pub connect_timeout: Duration,
    /// How long a call waits for a pooled connection, including opening a
    /// new one, before it fails with a storage error (default 10 s).
    pub acquire_timeout: Duration,
}

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions {
            schema: None,
            max_connections: 10,
            connect_timeout: Duration::from_secs(5),
            acquire_timeout: Duration::from_secs(10),
        }
    }
}

impl PostgresOptions {
    /// These options with `schema` as the registry's schema.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }
}

/// The registry, lease store and fence authority on one PostgreSQL schema.
/// Cheap to clone (the pool is shared).
#[derive(Clone)]
pub struct PostgresRegistry {
    pool: PgPool,
    /// `host:port/database`, for logs and `Debug`; never the password.
    target: String,
    schema: Option<String>,
}

impl fmt::Debug for PostgresRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresRegistry")
            .field("target", &self.target)
            .field("schema", &self.schema)
            .field("pool", &self.pool)
            .finish()
    }
}

impl PostgresRegistry {
    /// Connects to the database at `url` (`postgres://user:pass@host:port/db`),
    /// creates `opts.schema` if missing, applies pending migrations and
    /// returns a registry on a pool of at most `opts.max_connections`.
    ///
    /// The first connection is made directly, within `opts.connect_timeout`,
    /// so an unreachable or refusing server fails at once with an error naming
    /// `host:port` (never the password) instead of the pool's retry loop.
    pub async fn connect(url: &str, opts: PostgresOptions) -> Result<Self, RegistryError> {
        let connect = url
            .parse::<PgConnectOptions>()
            .map_err(|e| RegistryError::Storage(format!("bad postgres url: {e}")))?;
        if let Some(schema) = &opts.schema {
            check_schema(schema)?;
        }
        let address = format!("{}:{}", connect.get_host(), connect.get_port());
        let target = format!("{address}/{}", connect.get_database().unwrap_or_default());
        let unreachable = |why: String| {
            RegistryError::Storage(format!("connect to postgres at {address}: {why}"))
        };

        let mut conn =
            tokio::time::timeout(opts.connect_timeout, PgConnection::connect_with(&connect))
                .await
                .map_err(|_| unreachable(format!("timed out after {:?}", opts.connect_timeout)))?
                .map_err(|e| unreachable(e.to_string()))?;
        let prepared = prepare(&mut conn, opts.schema.as_deref()).await;
        if let Err(e) = conn.close().await {
            // the schema work is done (or failed on its own); a failed
            // goodbye on this one connection changes nothing
            tracing::debug!(error = %e, "closing the setup connection");
        }
        prepared?;

        let search_path = opts.schema.as_deref().map(set_search_path);
        let pool = PgPoolOptions::new()
            .max_connections(opts.max_connections.max(1))
            .acquire_timeout(opts.acquire_timeout)
            .after_connect(move |conn, _meta| Box::pin(run_setup(conn, search_path.clone())))
            .connect_lazy_with(connect);
        tracing::debug!(postgres = %target, schema = ?opts.schema, "registry connected");
        Ok(PostgresRegistry {
            pool,
            target,
            schema: opts.schema,
        })
    }

    /// Closes the pool, waiting for its connections to finish. Dropping the
    /// registry closes it too, without waiting. A closed registry refuses
    /// every call.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// The schema version the database is at (the highest applied migration).
    pub async fn schema_version(&self) -> Result<i64, RegistryError> {
        sqlx::query_scalar("SELECT coalesce(max(version), 0) FROM registry_migrations")
            .fetch_one(&self.pool)
            .await
            .map_err(storage)
    }

    async fn begin(&self) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        self.pool.begin().await
    }
}

/// Refuses schema names that would need escaping or that PostgreSQL would
/// truncate or reserve.
fn check_schema(schema: &str) -> Result<(), RegistryError> {
    let bad = |why: &str| RegistryError::Storage(format!("bad schema name {schema:?}: {why}"));
    let mut chars = schema.chars();
    match chars.next() {
        None => return Err(bad("empty")),
        Some(c) if !(c.is_ascii_alphabetic() || c == '_') => {
            return Err(bad("must start with a letter or _"))
        }
        Some(_) => {}
    }
    if !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(bad("only ASCII letters, digits and _"));
    }
    if schema.len() > MAX_IDENTIFIER_LEN {
        return Err(bad("longer than 63 bytes"));
    }
    if schema.to_ascii_lowercase().starts_with("pg_") {
        return Err(bad("pg_ is reserved"));
    }
    Ok(())
}

/// A checked schema name as an identifier: quoted, so it is taken as written
/// (case included); its characters need no escaping.
fn quote_schema(schema: &str) -> String {
    format!("\"{schema}\"")
}

/// The statement every pooled connection runs first.
fn set_search_path(schema: &str) -> String {
    format!("SET search_path TO {}", quote_schema(schema))
}

/// What every pooled connection runs before its first use.
async fn run_setup(conn: &mut PgConnection, sql: Option<String>) -> Result<(), sqlx::Error> {
    if let Some(sql) = sql {
        conn.execute(sql.as_str()).await?;
    }
    Ok(())
}

/// Creates the schema if missing and brings it to [`SCHEMA_VERSION`], on the
/// setup connection.
async fn prepare(conn: &mut PgConnection, schema: Option<&str>) -> Result<(), RegistryError> {
    if let Some(name) = schema {
        // checked first: CREATE SCHEMA IF NOT EXISTS needs the CREATE
        // privilege even when the schema exists
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
                .bind(name)
                .fetch_one(&mut *conn)
                .await
                .map_err(storage)?;
        if !exists {
            let create = format!("CREATE SCHEMA IF NOT EXISTS {}", quote_schema(name));
            let created = conn.execute(create.as_str()).await;
            // a concurrent connect may create it between check and create
            if let Err(e) = created {
                if !has_code(&e, &["23505", "42P06"]) {
                    return Err(storage(e));
                }
            }
        }
        conn.execute(set_search_path(name).as_str())
            .await
            .map_err(storage)?;
    }
    migrate(conn).await
}

/// Brings the current schema to [`SCHEMA_VERSION`] in one transaction
/// (PostgreSQL's DDL is transactional: a failed migration leaves nothing
/// behind), under an advisory lock per schema so that concurrent connects
/// migrate once and the others find the work done.
async fn migrate(conn: &mut PgConnection) -> Result<(), RegistryError> {
    let mut tx = conn.begin().await.map_err(storage)?;
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtext('aviary.registry_migrations'), \
         hashtext(coalesce(current_schema(), '')))",
    )
    .execute(&mut *tx)
    .await
    .map_err(storage)?;
    tx.execute(
        "CREATE TABLE IF NOT EXISTS registry_migrations (\
         version BIGINT PRIMARY KEY, description TEXT NOT NULL, applied_at BIGINT NOT NULL)",
    )
    .await
    .map_err(storage)?;
    let current: i64 =
        sqlx::query_scalar("SELECT coalesce(max(version), 0) FROM registry_migrations")
            .fetch_one(&mut *tx)
            .await
            .map_err(storage)?;
    if current > SCHEMA_VERSION {
        return Err(RegistryError::Storage(format!(
            "database schema version {current} is newer than this build's {SCHEMA_VERSION}"
        )));
    }
    for &(version, description, sql) in MIGRATIONS.iter().filter(|m| m.0 > current) {
        // a statement without arguments goes by the simple-query protocol,
        // which runs the several statements of a migration
        tx.execute(sql).await.map_err(|e| {
            RegistryError::Storage(format!("migration {version} ({description}): {e}"))
        })?;
        sqlx::query(
            "INSERT INTO registry_migrations (version, description, applied_at) \
             VALUES ($1, $2, $3)",
        )
        .bind(version)
        .bind(description)
        .bind(micros(aviary_core::now()))
        .execute(&mut *tx)
        .await
        .map_err(storage)?;
        tracing::info!(version, "registry schema migrated");
    }
    tx.commit().await.map_err(storage)
}

/// Whether `e` is a database error with one of these SQLSTATEs.
fn has_code(e: &sqlx::Error, codes: &[&str]) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| codes.contains(&c.as_ref()))
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
    if unreachable(&e) {
        return RegistryError::Unavailable(format!("postgres: {e}"));
    }
    RegistryError::Storage(e.to_string())
}

fn lease_storage(e: sqlx::Error) -> LeaseError {
    if unreachable(&e) {
        return LeaseError::Unavailable(format!("postgres: {e}"));
    }
    LeaseError::Storage(e.to_string())
}

/// Whether the database could not be reached at all (down, restarting,
/// the pool could not open a connection in time, or this replica closed its
/// pool on the way out), as opposed to a query that reached it and failed:
/// the caller answers 503 (retry, elsewhere if need be), not 500.
fn unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed => true,
        sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed => true,
        // the server is shutting down or restarting (admin_shutdown,
        // crash_shutdown, cannot_connect_now)
        sqlx::Error::Database(db) => {
            matches!(db.code().as_deref(), Some("57P01" | "57P02" | "57P03"))
        }
        _ => false,
    }
}

/// Registry-side decode errors inside lease code.
fn lease_from_registry(e: RegistryError) -> LeaseError {
    match e {
        RegistryError::NotFound => LeaseError::NotFound,
        RegistryError::Unavailable(m) => LeaseError::Unavailable(m),
        other => LeaseError::Storage(other.to_string()),
    }
}

/// Takes the schema's event-order lock for the rest of `tx`: event writers
/// commit one at a time, so identity values become visible in increasing
/// order (see the crate doc). Taken right before the insert, so it is held
/// only for the insert and the commit.
async fn lock_event_order(tx: &mut Transaction<'static, Postgres>) -> Result<(), RegistryError> {
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtext('aviary.sandbox_event'), \
         hashtext(coalesce(current_schema(), '')))",
    )
    .execute(&mut **tx)
    .await
    .map_err(storage)?;
    Ok(())
}

/// Microseconds since the epoch: the precision of the time columns (and of
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
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_checked_and_quoted() {
        for good in ["aviary", "_t_01", "Mixed"] {
            check_schema(good).unwrap();
        }
        assert_eq!(set_search_path("Mixed"), "SET search_path TO \"Mixed\"");
        let at_limit = "a".repeat(MAX_IDENTIFIER_LEN);
        check_schema(&at_limit).unwrap();
        for bad in [
            "",
            "1abc",
            "a-b",
            "a b",
            "a\"b",
            "a;drop",
            "pg_temp",
            "PG_x",
            "é",
            &"a".repeat(MAX_IDENTIFIER_LEN + 1),
        ] {
            let e = check_schema(bad).unwrap_err();
            assert!(
                matches!(&e, RegistryError::Storage(m) if m.contains("bad schema name")),
                "{bad:?}: {e:?}"
            );
        }
    }

    #[test]
    fn migrations_are_numbered_in_order() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(MIGRATIONS[0].0, 1);
        assert_eq!(SCHEMA_VERSION, MIGRATIONS.last().unwrap().0);
    }

    #[test]
    fn times_round_trip_at_microseconds() {
        let t = time::macros::datetime!(2030-01-02 3:04:05.123_456_789 UTC);
        let stored = truncate(t);
        assert_eq!(stored.nanosecond(), 123_456_000);
        assert_eq!(from_micros(micros(t)).unwrap(), stored);
        to_u64(-1).unwrap_err();
        to_i64(u64::MAX).unwrap_err();
    }

    /// Compiles only while `connect`'s future is `Send` (see [`migrate`]).
    #[test]
    fn connect_is_send() {
        fn is_send<T: Send>(_: &T) {}
        let connecting = PostgresRegistry::connect("postgres://u@h/d", PostgresOptions::default());
        is_send(&connecting);
    }

    #[test]
    fn default_options_are_bounded() {
        let o = PostgresOptions::default().schema("s");
        assert_eq!(o.schema.as_deref(), Some("s"));
        assert!(o.max_connections > 0);
        assert!(o.connect_timeout > Duration::ZERO);
    }
}
