//! [`LeaseStore`] on the `sandbox_lease` table. The fencing counter is
//! `sandbox_instance.fence_token`; a grant bumps it and writes the lease row
//! in one `BEGIN IMMEDIATE` transaction.

use crate::{from_micros, lease_from_registry, lease_storage, micros, truncate, SqliteRegistry};
use async_trait::async_trait;
use aviary_core::{LeaseToken, SandboxId};
use aviary_leases::{expiry, fence_rule, Fence, Lease, LeaseError, LeaseStore};
use sqlx::sqlite::SqliteRow;
use sqlx::{Executor, Row, Sqlite};
use std::time::Duration;
use time::OffsetDateTime;

/// The stored token: fence `lease_version` + hex `lease_secret`. A lease
/// from before secrets existed (empty secret) gets the all-zero secret, which
/// no client can present (tokens it parses are whatever it sent, and a grant
/// never hands out zeros), so it only expires.
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

fn lease_row(row: &SqliteRow) -> Result<Lease, LeaseError> {
    let get = |e: sqlx::Error| LeaseError::Storage(e.to_string());
    let id: String = row.try_get("sandbox_id").map_err(get)?;
    Ok(Lease {
        sandbox_id: id
            .parse()
            .map_err(|_| LeaseError::Storage(format!("bad stored sandbox id {id:?}")))?,
        owner: row.try_get("lease_owner").map_err(get)?,
        token: token_of(
            row.try_get("lease_version").map_err(get)?,
            &row.try_get::<Option<String>, _>("lease_secret")
                .map_err(get)?
                .unwrap_or_default(),
        )?,
        acquired_at: from_micros(row.try_get("acquired_at").map_err(get)?)
            .map_err(lease_from_registry)?,
        expires_at: from_micros(row.try_get("expires_at").map_err(get)?)
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
    E: Executor<'e, Database = Sqlite>,
{
    let row = sqlx::query(
        "SELECT i.sandbox_id, l.lease_owner, l.lease_version, l.lease_secret, l.acquired_at, l.expires_at \
         FROM sandbox_instance i \
         LEFT JOIN sandbox_lease l ON l.sandbox_id = i.sandbox_id AND l.expires_at > ?2 \
         WHERE i.sandbox_id = ?1",
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

impl SqliteRegistry {
    async fn sandbox_exists(&self, sandbox: &SandboxId) -> Result<bool, LeaseError> {
        let found: Option<i64> =
            sqlx::query_scalar("SELECT 1 FROM sandbox_instance WHERE sandbox_id = ?")
                .bind(sandbox.as_str())
                .fetch_optional(&self.writer)
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
impl LeaseStore for SqliteRegistry {
    async fn acquire(
        &self,
        sandbox: &SandboxId,
        owner: &str,
        ttl: Duration,
        now: OffsetDateTime,
    ) -> Result<Lease, LeaseError> {
        let now = truncate(now);
        let expires_at = expiry(now, ttl)?;
        let mut tx = self.begin_write().await.map_err(lease_storage)?;
        if let Some(held) = live_lease(&mut *tx, sandbox, micros(now)).await? {
            return Err(LeaseError::Held {
                owner: held.owner,
                expires_at: held.expires_at,
            });
        }
        let token: i64 = sqlx::query_scalar(
            "UPDATE sandbox_instance SET fence_token = fence_token + 1 \
             WHERE sandbox_id = ? RETURNING fence_token",
        )
        .bind(sandbox.as_str())
        .fetch_one(&mut *tx)
        .await
        .map_err(lease_storage)?;
        let fence = u64::try_from(token)
            .map_err(|_| LeaseError::Storage(format!("bad stored token {token}")))?;
        let granted = LeaseToken::generate(fence);
        sqlx::query(
            "INSERT INTO sandbox_lease \
             (sandbox_id, lease_owner, lease_version, lease_secret, acquired_at, heartbeat_at, expires_at) \
             VALUES (?1, ?2, ?3, ?6, ?4, ?4, ?5) \
             ON CONFLICT (sandbox_id) DO UPDATE SET lease_owner = excluded.lease_owner, \
             lease_version = excluded.lease_version, lease_secret = excluded.lease_secret, \
             acquired_at = excluded.acquired_at, \
             heartbeat_at = excluded.heartbeat_at, expires_at = excluded.expires_at",
        )
        .bind(sandbox.as_str())
        .bind(owner)
        .bind(token)
        .bind(micros(now))
        .bind(micros(expires_at))
        .bind(granted.secret_hex())
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
        let row = sqlx::query(
            "UPDATE sandbox_lease SET expires_at = ?3, heartbeat_at = ?4 \
             WHERE sandbox_id = ?1 AND lease_version = ?2 AND lease_secret = ?5 AND expires_at > ?4 \
             RETURNING sandbox_id, lease_owner, lease_version, lease_secret, acquired_at, expires_at",
        )
        .bind(sandbox.as_str())
        .bind(token_param(token))
        .bind(micros(expires_at))
        .bind(micros(now))
        .bind(token.secret_hex())
        .fetch_optional(&self.writer)
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
            "DELETE FROM sandbox_lease \
             WHERE sandbox_id = ?1 AND lease_version = ?2 AND lease_secret = ?4 AND expires_at > ?3",
        )
        .bind(sandbox.as_str())
        .bind(token_param(token))
        .bind(micros(truncate(now)))
        .bind(token.secret_hex())
        .execute(&self.writer)
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
        live_lease(&self.reader, sandbox, micros(truncate(now))).await
    }

    async fn check(
        &self,
        sandbox: &SandboxId,
        token: Option<LeaseToken>,
        now: OffsetDateTime,
    ) -> Result<Fence, LeaseError> {
        let live = live_lease(&self.reader, sandbox, micros(truncate(now))).await?;
        fence_rule(live.map(|l| l.token), token)
    }

    async fn expire_due(&self, now: OffsetDateTime) -> Result<Vec<Lease>, LeaseError> {
        let rows = sqlx::query(
            "DELETE FROM sandbox_lease WHERE expires_at <= ? \
             RETURNING sandbox_id, lease_owner, lease_version, lease_secret, acquired_at, expires_at",
        )
        .bind(micros(truncate(now)))
        .fetch_all(&self.writer)
        .await
        .map_err(lease_storage)?;
        rows.iter().map(lease_row).collect()
    }

    async fn revoke(&self, sandbox: &SandboxId) -> Result<(), LeaseError> {
        let done = sqlx::query("DELETE FROM sandbox_lease WHERE sandbox_id = ?")
            .bind(sandbox.as_str())
            .execute(&self.writer)
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
impl aviary_leases::FenceAuthority for SqliteRegistry {
    async fn next_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError> {
        let mut tx = self.begin_write().await.map_err(lease_storage)?;
        let v: Option<i64> = sqlx::query_scalar(
            "UPDATE sandbox_instance SET fence_token = fence_token + 1 \
             WHERE sandbox_id = ? RETURNING fence_token",
        )
        .bind(sandbox.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(lease_storage)?;
        let v = v.ok_or(LeaseError::NotFound)?;
        tx.commit().await.map_err(lease_storage)?;
        u64::try_from(v).map_err(|_| LeaseError::Storage(format!("bad stored fence {v}")))
    }

    async fn current_fence(&self, sandbox: &SandboxId) -> Result<u64, LeaseError> {
        let v: Option<i64> =
            sqlx::query_scalar("SELECT fence_token FROM sandbox_instance WHERE sandbox_id = ?")
                .bind(sandbox.as_str())
                .fetch_optional(&self.writer)
                .await
                .map_err(lease_storage)?;
        let v = v.ok_or(LeaseError::NotFound)?;
        u64::try_from(v).map_err(|_| LeaseError::Storage(format!("bad stored fence {v}")))
    }
}
