//! [`LeaseStore`] on the `sandbox_lease` table and [`FenceAuthority`] on
//! `sandbox_instance.fence_token`. A grant locks the sandbox row, bumps the
//! counter and writes the lease row in one transaction; everything else is
//! one conditional statement.

use crate::{from_micros, lease_from_registry, lease_storage, micros, truncate, PostgresRegistry};
use async_trait::async_trait;
use aviary_core::{LeaseToken, SandboxId};
use aviary_leases::{expiry, fence_rule, Fence, FenceAuthority, Lease, LeaseError, LeaseStore};
use sqlx::postgres::PgRow;
use sqlx::{Executor, Postgres, Row};
use std::time::Duration;
use time::OffsetDateTime;

/// The columns [`lease_row`] reads.
const LEASE_COLUMNS: &str =
    "sandbox_id, lease_owner, lease_version, lease_secret, acquired_at, expires_at";

/// The stored token: fence `lease_version` + hex `lease_secret`. A secret
/// that does not decode gets the all-zero secret, which no client can
/// present (a grant never hands out zeros), so that lease only expires.
pub(crate) fn token_of(v: i64, secret_hex: &str) -> Result<LeaseToken, LeaseError> {
    let fence =
        u64::try_from(v).map_err(|_| LeaseError::Storage(format!("bad stored token {v}")))?;
    let secret =
        LeaseToken::secret_from_hex(secret_hex).unwrap_or([0; aviary_core::LEASE_SECRET_LEN]);
    Ok(LeaseToken::from_parts(fence, secret))
}

fn token_param(t: LeaseToken) -> i64 {
    // A token above i64::MAX was never granted, so it can match no row.
    i64::try_from(t.fence()).unwrap_or(-1)
}

fn fence_of(v: i64) -> Result<u64, LeaseError> {
    u64::try_from(v).map_err(|_| LeaseError::Storage(format!("bad stored fence {v}")))
}

fn lease_row(row: &PgRow) -> Result<Lease, LeaseError> {
    let id: String = row.try_get("sandbox_id").map_err(lease_storage)?;
    Ok(Lease {
        sandbox_id: id
            .parse()
            .map_err(|_| LeaseError::Storage(format!("bad stored sandbox id {id:?}")))?,
        owner: row.try_get("lease_owner").map_err(lease_storage)?,
        token: token_of(
            row.try_get("lease_version").map_err(lease_storage)?,
            &row.try_get::<String, _>("lease_secret")
                .map_err(lease_storage)?,
        )?,
        acquired_at: from_micros(row.try_get("acquired_at").map_err(lease_storage)?)
            .map_err(lease_from_registry)?,
        expires_at: from_micros(row.try_get("expires_at").map_err(lease_storage)?)
            .map_err(lease_from_registry)?,
    })
}

/// The sandbox's live lease: `Err(NotFound)` without the sandbox,
/// `Ok(None)` without a live lease.
async fn live_lease<'e, E>(
    ex: E,
    sandbox: &SandboxId,
    now: i64,
) -> Result<Option<Lease>, LeaseError>
where
    E: Executor<'e, Database = Postgres>,
{
    let row = sqlx::query(
        "SELECT i.sandbox_id, l.lease_owner, l.lease_version, l.lease_secret, l.acquired_at, \
         l.expires_at FROM sandbox_instance i \
         LEFT JOIN sandbox_lease l ON l.sandbox_id = i.sandbox_id AND l.expires_at > $2 \
         WHERE i.sandbox_id = $1",
    )
    .bind(sandbox.as_str())
    .bind(now)
    .fetch_optional(ex)
    .await
    .map_err(lease_storage)?
    .ok_or(LeaseError::NotFound)?;
    let owner: Option<String> = row.try_get("lease_owner").map_err(lease_storage)?;
    match owner {
        None => Ok(None),
        Some(_) => lease_row(&row).map(Some),
    }
}

impl PostgresRegistry {
    async fn sandbox_exists(&self, sandbox: &SandboxId) -> Result<bool, LeaseError> {
        let found: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM sandbox_instance WHERE sandbox_id = $1")
                .bind(sandbox.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(lease_storage)?;
        Ok(found.is_some())
    }

    /// The error of a lease write that matched no row.
    async fn stale_or_missing(&self, sandbox: &SandboxId) -> LeaseError {
        match self.sandbox_exists(sandbox).await {
            Ok(true) => LeaseError::StaleToken,
            Ok(false) => LeaseError::NotFound,
            Err(e) => e,
        }
    }
}

#[async_trait]
impl LeaseStore for PostgresRegistry {
    async fn acquire(
        &self,
        sandbox: &SandboxId,
        owner: &str,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let now = truncate(now);
        let expires_at = expiry(now, ttl)?;
        let mut tx = self.begin().await.map_err(lease_storage)?;
        // Racing grants (and fenced transitions) of this sandbox queue here;
        // the loser then reads the winner's lease below.
        let locked: Option<i64> = sqlx::query_scalar(
            "SELECT fence_token FROM sandbox_instance WHERE sandbox_id = $1 FOR NO KEY UPDATE",
        )
        .bind(sandbox.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(lease_storage)?;
        locked.ok_or(LeaseError::NotFound)?;
        if let Some(held) = live_lease(&mut *tx, sandbox, micros(now)).await? {
            return Err(LeaseError::Held {
                owner: held.owner,
                expires_at: held.expires_at,
            });
        }
        let token: i64 = sqlx::query_scalar(
            "UPDATE sandbox_instance SET fence_token = fence_token + 1 \
             WHERE sandbox_id = $1 RETURNING fence_token",
        )
        .bind(sandbox.as_str())
        .fetch_one(&mut *tx)
        .await
        .map_err(lease_storage)?;
        let granted = LeaseToken::generate(fence_of(token)?);
        sqlx::query(
            "INSERT INTO sandbox_lease (sandbox_id, lease_owner, lease_version, lease_secret, \
             acquired_at, heartbeat_at, expires_at) VALUES ($1, $2, $3, $4, $5, $5, $6) \
             ON CONFLICT (sandbox_id) DO UPDATE SET lease_owner = excluded.lease_owner, \
             lease_version = excluded.lease_version, lease_secret = excluded.lease_secret, \
             acquired_at = excluded.acquired_at, heartbeat_at = excluded.heartbeat_at, \
             expires_at = excluded.expires_at",
        )
        .bind(sandbox.as_str())
        .bind(owner)
        .bind(token)
        .bind(granted.secret_hex())
        .bind(micros(now))
        .bind(micros(expires_at))
        .execute(&mut *tx)
        .await
        .map_err(lease_storage)?;
        tx.commit().await.map_err(lease_storage)?;
        Ok(Lease {
            sandbox_id: sandbox.clone(),
            owner: owner.to_owned(),
            token: granted,
            acquired_at: now,
            expires_at,
        })
    }

    async fn renew(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let now = truncate(now);
        let expires_at = expiry(now, ttl)?;
        let row = sqlx::query(&format!(
            "UPDATE sandbox_lease SET expires_at = $3, heartbeat_at = $4 \
             WHERE sandbox_id = $1 AND lease_version = $2 AND lease_secret = $5 \
             AND expires_at > $4 RETURNING {LEASE_COLUMNS}"
        ))
        .bind(sandbox.as_str())
        .bind(token_param(token))
        .bind(micros(expires_at))
        .bind(micros(now))
        .bind(token.secret_hex())
        .fetch_optional(&self.pool)
        .await
        .map_err(lease_storage)?;
        match row {
            Some(row) => lease_row(&row),
            None => Err(self.stale_or_missing(sandbox).await),
        }
    }

    async fn release(
        &self,
        sandbox: &SandboxId,
        token: LeaseToken,
        now: OffsetDateTime,
    ) -> Result<(), LeaseError> {
        let done = sqlx::query(
            "DELETE FROM sandbox_lease WHERE sandbox_id = $1 AND lease_version = $2 \
             AND lease_secret = $4 AND expires_at > $3",
        )
        .bind(sandbox.as_str())
        .bind(token_param(token))
        .bind(micros(truncate(now)))
        .bind(token.secret_hex())
        .execute(&self.pool)
        .await
        .map_err(lease_storage)?;
        if done.rows_affected() == 1 {
            Ok(())
        } else {
            Err(self.stale_or_missing(sandbox).await)
        }
    }

    async fn current(
        &self,
        sandbox: &SandboxId,
        now: OffsetDateTime,
    ) -> Result<Option<Lease>, LeaseError> {
        live_lease(&self.pool, sandbox, micros(truncate(now))).await
    }

    async fn check(
        &self,
        sandbox: &SandboxId,
        token: Option<LeaseToken>,
        now: OffsetDateTime,
    ) -> Result<Fence, LeaseError> {
        let live = live_lease(&self.pool, sandbox, micros(truncate(now))).await?;
        fence_rule(live.map(|l| l.token), token)
    }

    async fn expire_due(&self, now: OffsetDateTime) -> Result<Vec<Lease>, LeaseError> {
        // a row deleted by a concurrent call is skipped, so each expired
        // lease is returned once
        let rows = sqlx::query(&format!(
            "DELETE FROM sandbox_lease WHERE expires_at <= $1 RETURNING {LEASE_COLUMNS}"
        ))
        .bind(micros(truncate(now)))
        .fetch_all(&self.pool)
        .await
        .map_err(lease_storage)?;
        rows.iter().map(lease_row).collect()
    }

    async fn revoke(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
        let done = sqlx::query("DELETE FROM sandbox_lease WHERE sandbox_id = $1")
            .bind(sandbox.as_str())
            .execute(&self.pool)
            .await
            .map_err(lease_storage)?;
        if done.rows_affected() == 0 && !self.sandbox_exists(sandbox).await? {
            return Err(LeaseError::NotFound);
        }
        Ok(())
    }
}

/// The counter is `sandbox_instance.fence_token`, the one the lease table's
/// grants bump, so a networked lease store and this one never reuse a fence.
#[async_trait]
impl FenceAuthority for PostgresRegistry {
    async fn next_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError> {
        // one statement: the row lock makes concurrent bumps queue
        let v: Option<i64> = sqlx::query_scalar(
            "UPDATE sandbox_instance SET fence_token = fence_token + 1 \
             WHERE sandbox_id = $1 RETURNING fence_token",
        )
        .bind(sandbox.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(lease_storage)?;
        fence_of(v.ok_or(LeaseError::NotFound)?)
    }

    async fn current_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError> {
        let v: Option<i64> =
            sqlx::query_scalar("SELECT fence_token FROM sandbox_instance WHERE sandbox_id = $1")
                .bind(sandbox.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(lease_storage)?;
        fence_of(v.ok_or(LeaseError::NotFound)?)
    }
}
