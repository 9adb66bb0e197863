//! [`Registry`] on the PostgreSQL tables of `migrations/`.

use crate::{
    from_micros, lock_event_order, micros, storage, to_i64, to_u64, truncate, PostgresRegistry,
};
use async_trait::async_trait;
use aviary_core::api::Event;
use aviary_core::{NetworkProfile, ResourceLimits, SandboxId, SandboxState, Scope};
use aviary_leases::fence_rule;
use aviary_registry::*;
use sqlx::postgres::PgRow;
use sqlx::{Postgres, QueryBuilder, Row};
use std::collections::BTreeMap;
use std::str::FromStr;
use time::OffsetDateTime;

/// The columns [`sandbox_row`] reads.
const SANDBOX_COLUMNS: &str = "sandbox_id, tenant_id, user_id, session_id, agent, scope, \
    runtime_provider, runtime_instance_id, node_id, resource_class, cpu, memory_mb, disk_mb, \
    pids, template_id, template_digest, network_profile, state, created_at, last_active_at, \
    expires_at, version, tainted, user_managed, paused, labels_json, env_json, workdir, run_as";

fn col<'r, T>(row: &'r PgRow, name: &str) -> Result<T, RegistryError>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    row.try_get(name).map_err(storage)
}

fn parse<T: FromStr>(what: &str, s: &str) -> Result<T, RegistryError> {
    s.parse()
        .map_err(|_| RegistryError::Storage(format!("bad stored {what} {s:?}")))
}

/// A stored JSON object of strings (labels, env).
fn string_map(what: &str, s: &str) -> Result<BTreeMap<String, String>, RegistryError> {
    serde_json::from_str(s).map_err(|e| RegistryError::Storage(format!("bad stored {what}: {e}")))
}

fn map_text(m: &BTreeMap<String, String>) -> String {
    serde_json::to_string(m).unwrap_or_else(|_| "{}".to_owned())
}

fn parse_state(s: Option<String>) -> Result<Option<SandboxState>, RegistryError> {
    s.map(|s| parse("state", &s)).transpose()
}

fn parse_json(what: &str, s: &str) -> Result<serde_json::Value, RegistryError> {
    serde_json::from_str(s).map_err(|e| RegistryError::Storage(format!("bad stored {what}: {e}")))
}

fn sandbox_row(row: &PgRow) -> Result<SandboxRecord, RegistryError> {
    let pids: i64 = col(row, "pids")?;
    Ok(SandboxRecord {
        id: parse("sandbox id", &col::<String>(row, "sandbox_id")?)?,
        tenant: col(row, "tenant_id")?,
        user_id: col(row, "user_id")?,
        session_id: col(row, "session_id")?,
        agent: col(row, "agent")?,
        scope: parse::<Scope>("scope", &col::<String>(row, "scope")?)?,
        resource_class: col(row, "resource_class")?,
        resources: ResourceLimits {
            cpu: col(row, "cpu")?,
            memory_mb: to_u64(col(row, "memory_mb")?)?,
            disk_mb: to_u64(col(row, "disk_mb")?)?,
            pids: u32::try_from(pids)
                .map_err(|_| RegistryError::Storage(format!("bad stored pids {pids}")))?,
        },
        template: col(row, "template_id")?,
        template_digest: col(row, "template_digest")?,
        runtime: col(row, "runtime_provider")?,
        runtime_instance_id: col(row, "runtime_instance_id")?,
        node: col(row, "node_id")?,
        network_profile: parse::<NetworkProfile>(
            "network profile",
            &col::<String>(row, "network_profile")?,
        )?,
        state: parse("state", &col::<String>(row, "state")?)?,
        created_at: from_micros(col(row, "created_at")?)?,
        last_active_at: from_micros(col(row, "last_active_at")?)?,
        expires_at: col::<Option<i64>>(row, "expires_at")?
            .map(from_micros)
            .transpose()?,
        version: col(row, "version")?,
        tainted: col(row, "tainted")?,
        user_managed: col(row, "user_managed")?,
        paused: col(row, "paused")?,
        metadata: string_map("labels", &col::<String>(row, "labels_json")?)?,
        env: string_map("env", &col::<String>(row, "env_json")?)?,
        workdir: col(row, "workdir")?,
        run_as: col(row, "run_as")?,
    })
}

/// The columns [`event_row`] reads (JSONB read back as text).
const EVENT_COLUMNS: &str = "event_id, sandbox_id, tenant_id, event_type, old_state, new_state, \
    request_id, timestamp, metadata::text AS metadata";

fn event_row(row: &PgRow) -> Result<Event, RegistryError> {
    Ok(Event {
        id: col(row, "event_id")?,
        sandbox_id: col::<Option<String>>(row, "sandbox_id")?
            .map(|s| parse("sandbox id", &s))
            .transpose()?,
        tenant: col(row, "tenant_id")?,
        event_type: col(row, "event_type")?,
        old_state: parse_state(col(row, "old_state")?)?,
        new_state: parse_state(col(row, "new_state")?)?,
        request_id: col(row, "request_id")?,
        timestamp: from_micros(col(row, "timestamp")?)?,
        metadata: parse_json("metadata", &col::<String>(row, "metadata")?)?,
    })
}

const ALLOCATION_COLUMNS: &str = "SELECT allocation_id, task_id, tenant_id, sandbox_id, \
    planner_input_hash, workload_signature, recommended_class, actual_class, reason, confidence, \
    source, cpu, memory_mb, created_at, duration_s, peak_cpu, peak_memory_mb, oom, timed_out \
    FROM sandbox_allocation";

fn allocation_row(row: &PgRow) -> Result<AllocationRecord, RegistryError> {
    let duration_s: Option<f64> = col(row, "duration_s")?;
    let usage = match duration_s {
        None => None,
        Some(duration_s) => Some(AllocationUsage {
            duration_s,
            peak_cpu: col::<Option<f64>>(row, "peak_cpu")?.unwrap_or(0.0),
            peak_memory_mb: to_u64(col::<Option<i64>>(row, "peak_memory_mb")?.unwrap_or(0))?,
            oom: col::<Option<bool>>(row, "oom")?.unwrap_or(false),
            timed_out: col::<Option<bool>>(row, "timed_out")?.unwrap_or(false),
        }),
    };
    Ok(AllocationRecord {
        id: Some(col(row, "allocation_id")?),
        task_id: col(row, "task_id")?,
        tenant: col(row, "tenant_id")?,
        sandbox_id: col::<Option<String>>(row, "sandbox_id")?
            .map(|s| parse("sandbox id", &s))
            .transpose()?,
        planner_input_hash: col(row, "planner_input_hash")?,
        workload_signature: col(row, "workload_signature")?,
        recommended_class: col(row, "recommended_class")?,
        actual_class: col(row, "actual_class")?,
        reason: col(row, "reason")?,
        confidence: col(row, "confidence")?,
        source: col(row, "source")?,
        cpu: col(row, "cpu")?,
        memory_mb: to_u64(col(row, "memory_mb")?)?,
        created_at: from_micros(col(row, "created_at")?)?,
        usage,
    })
}

/// Stored form of event metadata and manifests: JSON text (bound as text,
/// cast to JSONB in the statement), `{}` for `null`.
fn metadata_text(v: &serde_json::Value) -> String {
    if v.is_null() {
        "{}".to_owned()
    } else {
        v.to_string()
    }
}

/// One row of `sandbox_event`, before it is written.
struct EventRow<'a> {
    sandbox_id: Option<&'a str>,
    tenant: &'a str,
    event_type: &'a str,
    old_state: Option<SandboxState>,
    new_state: Option<SandboxState>,
    request_id: Option<&'a str>,
    timestamp: i64,
    metadata: &'a str,
}

/// Writes `rows` with one multi-row `INSERT`, under the event-order lock,
/// which `tx` then holds to its end: call it last before the commit.
async fn insert_events(
    tx: &mut sqlx::Transaction<'static, Postgres>,
    rows: &[EventRow<'_>],
) -> Result<(), RegistryError> {
    if rows.is_empty() {
        return Ok(());
    }
    lock_event_order(tx).await?;
    let mut q = QueryBuilder::<Postgres>::new(
        "INSERT INTO sandbox_event (sandbox_id, tenant_id, event_type, old_state, new_state, \
         request_id, timestamp, metadata) ",
    );
    q.push_values(rows, |mut b, r| {
        b.push_bind(r.sandbox_id)
            .push_bind(r.tenant)
            .push_bind(r.event_type)
            .push_bind(r.old_state.map(SandboxState::as_str))
            .push_bind(r.new_state.map(SandboxState::as_str))
            .push_bind(r.request_id)
            .push_bind(r.timestamp)
            .push_bind(r.metadata)
            .push_unseparated("::jsonb");
    });
    q.build().execute(&mut **tx).await.map_err(storage)?;
    Ok(())
}

impl PostgresRegistry {
    async fn exists(&self, id: &SandboxId) -> Result<bool, RegistryError> {
        let found: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM sandbox_instance WHERE sandbox_id = $1")
                .bind(id.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(storage)?;
        Ok(found.is_some())
    }

    /// Sets one boolean column of a sandbox row (`column` is one of this
    /// crate's own names, never input), version-checked; bumps `version`.
    async fn set_flag(
        &self,
        id: &SandboxId,
        expected_version: i64,
        column: &'static str,
        value: bool,
    ) -> Result<SandboxRecord, RegistryError> {
        let row = sqlx::query(&format!(
            "UPDATE sandbox_instance SET {column} = $1, version = version + 1 \
             WHERE sandbox_id = $2 AND version = $3 RETURNING {SANDBOX_COLUMNS}"
        ))
        .bind(value)
        .bind(id.as_str())
        .bind(expected_version)
        .fetch_optional(&self.pool)
        .await
        .map_err(storage)?;
        self.versioned(id, row).await
    }

    /// The answer of a versioned single-row `UPDATE ... RETURNING`: the new
    /// record, or why no row matched.
    async fn versioned(
        &self,
        id: &SandboxId,
        row: Option<PgRow>,
    ) -> Result<SandboxRecord, RegistryError> {
        match row {
            Some(row) => sandbox_row(&row),
            None if self.exists(id).await? => Err(RegistryError::Conflict),
            None => Err(RegistryError::NotFound),
        }
    }
}

#[async_trait]
impl Registry for PostgresRegistry {
    async fn insert_sandbox(
        &self,
        new: &NewSandbox,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError> {
        let now = truncate(aviary_core::now());
        let expires_at = new.expires_at.map(truncate);
        let mut tx = self.begin().await.map_err(storage)?;
        sqlx::query(
            "INSERT INTO sandbox_instance (sandbox_id, tenant_id, user_id, session_id, agent, \
             scope, runtime_provider, runtime_instance_id, node_id, resource_class, cpu, \
             memory_mb, disk_mb, pids, template_id, template_digest, network_profile, state, \
             created_at, last_active_at, expires_at, version, tainted, user_managed, labels_json, \
             env_json, workdir, run_as) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, \
             $18, $19, $19, $20, 0, $21, $22, $23, $24, $25, $26)",
        )
        .bind(new.id.as_str())
        .bind(&new.tenant)
        .bind(&new.user_id)
        .bind(&new.session_id)
        .bind(&new.agent)
        .bind(new.scope.as_str())
        .bind(&new.runtime)
        .bind(&new.runtime_instance_id)
        .bind(&new.node)
        .bind(&new.resource_class)
        .bind(new.resources.cpu)
        .bind(to_i64(new.resources.memory_mb)?)
        .bind(to_i64(new.resources.disk_mb)?)
        .bind(i64::from(new.resources.pids))
        .bind(&new.template)
        .bind(&new.template_digest)
        .bind(new.network_profile.as_str())
        .bind(SandboxState::Requested.as_str())
        .bind(micros(now))
        .bind(expires_at.map(micros))
        .bind(new.tainted)
        .bind(new.user_managed)
        .bind(map_text(&new.metadata))
        .bind(map_text(&new.env))
        .bind(&new.workdir)
        .bind(&new.run_as)
        .execute(&mut *tx)
        .await
        .map_err(storage)?;
        let metadata = metadata_text(&ctx.metadata);
        insert_events(
            &mut tx,
            &[EventRow {
                sandbox_id: Some(new.id.as_str()),
                tenant: &new.tenant,
                event_type: ctx.event_type.as_deref().unwrap_or("created"),
                old_state: None,
                new_state: Some(SandboxState::Requested),
                request_id: ctx.request_id.as_deref(),
                timestamp: micros(now),
                metadata: &metadata,
            }],
        )
        .await?;
        tx.commit().await.map_err(storage)?;
        Ok(SandboxRecord {
            id: new.id.clone(),
            tenant: new.tenant.clone(),
            user_id: new.user_id.clone(),
            session_id: new.session_id.clone(),
            agent: new.agent.clone(),
            scope: new.scope,
            resource_class: new.resource_class.clone(),
            resources: new.resources,
            template: new.template.clone(),
            template_digest: new.template_digest.clone(),
            runtime: new.runtime.clone(),
            runtime_instance_id: new.runtime_instance_id.clone(),
            node: new.node.clone(),
            network_profile: new.network_profile,
            state: SandboxState::Requested,
            created_at: now,
            last_active_at: now,
            expires_at,
            version: 0,
            tainted: new.tainted,
            user_managed: new.user_managed,
            paused: false,
            metadata: new.metadata.clone(),
            env: new.env.clone(),
            workdir: new.workdir.clone(),
            run_as: new.run_as.clone(),
        })
    }

    async fn get_sandbox(&self, id: &SandboxId) -> Result<SandboxRecord, RegistryError> {
        let row = sqlx::query(&format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandbox_instance WHERE sandbox_id = $1"
        ))
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(storage)?
        .ok_or(RegistryError::NotFound)?;
        sandbox_row(&row)
    }

    async fn list_sandboxes(
        &self,
        tenant: Option<&str>,
        include_terminated: bool,
    ) -> Result<Vec<SandboxRecord>, RegistryError> {
        let mut q = QueryBuilder::<Postgres>::new(format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandbox_instance WHERE TRUE"
        ));
        if let Some(t) = tenant {
            q.push(" AND tenant_id = ").push_bind(t);
        }
        if !include_terminated {
            // a literal, so the live-rows partial index applies (migration
            // `live_index`): the cost stays with the live rows, not history
            q.push(" AND state <> 'Terminated'");
        }
        q.push(" ORDER BY created_at, seq");
        let rows = q.build().fetch_all(&self.pool).await.map_err(storage)?;
        rows.iter().map(sandbox_row).collect()
    }

    async fn live_totals(&self, tenant: Option<&str>) -> Result<Vec<LiveTotal>, RegistryError> {
        let mut q = QueryBuilder::<Postgres>::new(
            "SELECT node_id, state, count(*) AS n, COALESCE(SUM(cpu), 0)::float8 AS cpu, \
             COALESCE(SUM(memory_mb), 0)::bigint AS memory_mb FROM sandbox_instance WHERE TRUE",
        );
        if let Some(t) = tenant {
            q.push(" AND tenant_id = ").push_bind(t);
        }
        // a literal, so the live-rows partial index applies
        q.push(" AND state <> 'Terminated' GROUP BY node_id, state ORDER BY node_id, state");
        let rows = q.build().fetch_all(&self.pool).await.map_err(storage)?;
        rows.iter()
            .map(|row| {
                Ok(LiveTotal {
                    node: col(row, "node_id")?,
                    state: parse("state", &col::<String>(row, "state")?)?,
                    sandboxes: to_u64(col(row, "n")?)?,
                    cpu: col(row, "cpu")?,
                    memory_mb: to_u64(col(row, "memory_mb")?)?,
                })
            })
            .collect()
    }

    async fn transition(
        &self,
        id: &SandboxId,
        expected_version: i64,
        path: &[SandboxState],
        fence: FenceCheck,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError> {
        let now = truncate(aviary_core::now());
        let mut tx = self.begin().await.map_err(storage)?;
        // The row lock queues racing writers of this sandbox (and its lease
        // grants, which bump `fence_token`) behind this transaction.
        let row = sqlx::query(&format!(
            "SELECT {SANDBOX_COLUMNS}, fence_token FROM sandbox_instance \
             WHERE sandbox_id = $1 FOR NO KEY UPDATE"
        ))
        .bind(id.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(storage)?
        .ok_or(RegistryError::NotFound)?;
        let version: i64 = col(&row, "version")?;
        if version != expected_version {
            return Err(RegistryError::Conflict);
        }
        match fence {
            FenceCheck::Skip => {}
            FenceCheck::Require(token) => {
                // a statement after the lock: it sees every committed grant,
                // and no new one can commit before this transaction ends
                let lease = sqlx::query(
                    "SELECT lease_version, lease_secret FROM sandbox_lease \
                     WHERE sandbox_id = $1 AND expires_at > $2",
                )
                .bind(id.as_str())
                .bind(micros(now))
                .fetch_optional(&mut *tx)
                .await
                .map_err(storage)?;
                let live = lease
                    .map(|l| {
                        crate::leases::token_of(
                            col(&l, "lease_version")?,
                            &col::<String>(&l, "lease_secret")?,
                        )
                        .map_err(|e| RegistryError::Storage(e.to_string()))
                    })
                    .transpose()?;
                fence_rule(live, token)?;
            }
            FenceCheck::Counter { seen, leased } => {
                let counter = to_u64(col::<i64>(&row, "fence_token")?)?;
                aviary_leases::counter_rule(counter, seen, leased)?;
            }
        }
        let from: SandboxState = parse("state", &col::<String>(&row, "state")?)?;
        validate_path(from, path)?;
        let Some(&last) = path.last() else {
            // only the checks: nothing to write (dropping `tx` rolls back)
            return sandbox_row(&row);
        };
        let tenant: String = col(&row, "tenant_id")?;
        let steps = i64::try_from(path.len())
            .map_err(|_| RegistryError::Storage("path too long".into()))?;

        let updated = sqlx::query(&format!(
            "UPDATE sandbox_instance SET state = $1, version = version + $2, last_active_at = $3 \
             WHERE sandbox_id = $4 RETURNING {SANDBOX_COLUMNS}"
        ))
        .bind(last.as_str())
        .bind(steps)
        .bind(micros(now))
        .bind(id.as_str())
        .fetch_one(&mut *tx)
        .await
        .map_err(storage)?;

        let metadata = metadata_text(&ctx.metadata);
        let event_type = ctx.event_type.as_deref().unwrap_or("state_changed");
        let olds = std::iter::once(from).chain(path.iter().copied());
        let events: Vec<EventRow<'_>> = olds
            .zip(path.iter().copied())
            .map(|(old, new)| EventRow {
                sandbox_id: Some(id.as_str()),
                tenant: &tenant,
                event_type,
                old_state: Some(old),
                new_state: Some(new),
                request_id: ctx.request_id.as_deref(),
                timestamp: micros(now),
                metadata: &metadata,
            })
            .collect();
        insert_events(&mut tx, &events).await?;
        let record = sandbox_row(&updated)?;
        tx.commit().await.map_err(storage)?;
        tracing::debug!(
            sandbox.id = %id,
            from = %from,
            to = %last,
            version = record.version,
            "sandbox transitioned"
        );
        Ok(record)
    }

    async fn claim_sandbox(
        &self,
        id: &SandboxId,
        expected_version: i64,
        claim: &SandboxClaim,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError> {
        let now = truncate(aviary_core::now());
        let mut tx = self.begin().await.map_err(storage)?;
        let row = sqlx::query(
            "SELECT state, version, tenant_id, tainted FROM sandbox_instance \
             WHERE sandbox_id = $1 FOR NO KEY UPDATE",
        )
        .bind(id.as_str())
        .fetch_optional(&mut *tx)
        .await
        .map_err(storage)?
        .ok_or(RegistryError::NotFound)?;
        let version: i64 = col(&row, "version")?;
        let state: SandboxState = parse("state", &col::<String>(&row, "state")?)?;
        let tenant: String = col(&row, "tenant_id")?;
        let tainted: bool = col(&row, "tainted")?;
        // a tainted sandbox is never handed out of a pool
        if version != expected_version
            || state != SandboxState::Ready
            || tenant != POOL_TENANT
            || tainted
        {
            return Err(RegistryError::Conflict);
        }
        validate_path(state, &[SandboxState::Locking])?;
        let updated = sqlx::query(&format!(
            "UPDATE sandbox_instance SET tenant_id = $1, user_id = $2, session_id = $3, \
             agent = $4, scope = $5, expires_at = $6, user_managed = $7, state = $8, \
             version = version + 1, last_active_at = $9, pool_claimed_at = $9, \
             labels_json = $11, env_json = $12, workdir = $13, run_as = $14 \
             WHERE sandbox_id = $10 RETURNING {SANDBOX_COLUMNS}"
        ))
        .bind(&claim.tenant)
        .bind(&claim.user_id)
        .bind(&claim.session_id)
        .bind(&claim.agent)
        .bind(claim.scope.as_str())
        .bind(claim.expires_at.map(truncate).map(micros))
        .bind(claim.user_managed)
        .bind(SandboxState::Locking.as_str())
        .bind(micros(now))
        .bind(id.as_str())
        .bind(map_text(&claim.metadata))
        .bind(map_text(&claim.env))
        .bind(&claim.workdir)
        .bind(&claim.run_as)
        .fetch_one(&mut *tx)
        .await
        .map_err(storage)?;
        let metadata = metadata_text(&ctx.metadata);
        insert_events(
            &mut tx,
            &[EventRow {
                sandbox_id: Some(id.as_str()),
                tenant: &claim.tenant,
                event_type: ctx.event_type.as_deref().unwrap_or("pool_claimed"),
                old_state: Some(SandboxState::Ready),
                new_state: Some(SandboxState::Locking),
                request_id: ctx.request_id.as_deref(),
                timestamp: micros(now),
                metadata: &metadata,
            }],
        )
        .await?;
        let record = sandbox_row(&updated)?;
        tx.commit().await.map_err(storage)?;
        Ok(record)
    }

    async fn set_runtime_instance(
        &self,
        id: &SandboxId,
        expected_version: i64,
        runtime_instance_id: &str,
        node: &str,
    ) -> Result<SandboxRecord, RegistryError> {
        let row = sqlx::query(&format!(
            "UPDATE sandbox_instance SET runtime_instance_id = $1, node_id = $2, \
             version = version + 1 WHERE sandbox_id = $3 AND version = $4 \
             RETURNING {SANDBOX_COLUMNS}"
        ))
        .bind(runtime_instance_id)
        .bind(node)
        .bind(id.as_str())
        .bind(expected_version)
        .fetch_optional(&self.pool)
        .await
        .map_err(storage)?;
        self.versioned(id, row).await
    }

    async fn set_tainted(
        &self,
        id: &SandboxId,
        expected_version: i64,
        tainted: bool,
    ) -> Result<SandboxRecord, RegistryError> {
        self.set_flag(id, expected_version, "tainted", tainted)
            .await
    }

    async fn set_paused(
        &self,
        id: &SandboxId,
        expected_version: i64,
        paused: bool,
    ) -> Result<SandboxRecord, RegistryError> {
        self.set_flag(id, expected_version, "paused", paused).await
    }

    async fn set_expiry(
        &self,
        id: &SandboxId,
        expected_version: i64,
        expires_at: Option<OffsetDateTime>,
    ) -> Result<SandboxRecord, RegistryError> {
        let row = sqlx::query(&format!(
            "UPDATE sandbox_instance SET expires_at = $1, version = version + 1 \
             WHERE sandbox_id = $2 AND version = $3 RETURNING {SANDBOX_COLUMNS}"
        ))
        .bind(expires_at.map(truncate).map(micros))
        .bind(id.as_str())
        .bind(expected_version)
        .fetch_optional(&self.pool)
        .await
        .map_err(storage)?;
        self.versioned(id, row).await
    }

    async fn server_secret(&self, name: &str, candidate: &str) -> Result<String, RegistryError> {
        sqlx::query(
            "INSERT INTO server_secret (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .bind(candidate)
        .execute(&self.pool)
        .await
        .map_err(storage)?;
        sqlx::query_scalar("SELECT value FROM server_secret WHERE name = $1")
            .bind(name)
            .fetch_one(&self.pool)
            .await
            .map_err(storage)
    }

    async fn touch(&self, id: &SandboxId, now: OffsetDateTime) -> Result<(), RegistryError> {
        let done =
            sqlx::query("UPDATE sandbox_instance SET last_active_at = $1 WHERE sandbox_id = $2")
                .bind(micros(now))
                .bind(id.as_str())
                .execute(&self.pool)
                .await
                .map_err(storage)?;
        if done.rows_affected() == 0 {
            return Err(RegistryError::NotFound);
        }
        Ok(())
    }

    async fn append_event(&self, ev: NewEvent) -> Result<i64, RegistryError> {
        let mut tx = self.begin().await.map_err(storage)?;
        lock_event_order(&mut tx).await?;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO sandbox_event (sandbox_id, tenant_id, event_type, old_state, \
             new_state, request_id, timestamp, metadata) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb) RETURNING event_id",
        )
        .bind(ev.sandbox_id.as_ref().map(SandboxId::as_str))
        .bind(&ev.tenant)
        .bind(&ev.event_type)
        .bind(ev.old_state.map(SandboxState::as_str))
        .bind(ev.new_state.map(SandboxState::as_str))
        .bind(&ev.request_id)
        .bind(micros(aviary_core::now()))
        .bind(metadata_text(&ev.metadata))
        .fetch_one(&mut *tx)
        .await
        .map_err(storage)?;
        tx.commit().await.map_err(storage)?;
        Ok(id)
    }

    async fn list_events(&self, filter: &EventFilter) -> Result<Vec<Event>, RegistryError> {
        let mut q = QueryBuilder::<Postgres>::new(format!(
            "SELECT {EVENT_COLUMNS} FROM sandbox_event WHERE event_id > "
        ));
        q.push_bind(filter.after_id.unwrap_or(0));
        if let Some(t) = &filter.tenant {
            q.push(" AND tenant_id = ").push_bind(t);
        }
        if let Some(s) = &filter.sandbox_id {
            q.push(" AND sandbox_id = ").push_bind(s.as_str());
        }
        q.push(if filter.newest {
            " ORDER BY event_id DESC LIMIT "
        } else {
            " ORDER BY event_id LIMIT "
        })
        .push_bind(i64::from(effective_limit(filter.limit)));
        let rows = q.build().fetch_all(&self.pool).await.map_err(storage)?;
        let mut events: Vec<Event> = rows.iter().map(event_row).collect::<Result<_, _>>()?;
        if filter.newest {
            // the last ones, still oldest first
            events.reverse();
        }
        Ok(events)
    }

    async fn upsert_template(&self, t: &TemplateRecord) -> Result<(), RegistryError> {
        sqlx::query(
            "INSERT INTO template (name, digest, size_bytes, source, created_at) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO UPDATE SET \
             digest = excluded.digest, size_bytes = excluded.size_bytes, \
             source = excluded.source, created_at = excluded.created_at",
        )
        .bind(&t.name)
        .bind(&t.digest)
        .bind(to_i64(t.size_bytes)?)
        .bind(&t.source)
        .bind(micros(t.created_at))
        .execute(&self.pool)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn list_templates(&self) -> Result<Vec<TemplateRecord>, RegistryError> {
        let rows = sqlx::query(
            "SELECT name, digest, size_bytes, source, created_at FROM template ORDER BY name",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(storage)?;
        rows.iter()
            .map(|r| {
                Ok(TemplateRecord {
                    name: col(r, "name")?,
                    digest: col(r, "digest")?,
                    size_bytes: to_u64(col(r, "size_bytes")?)?,
                    source: col(r, "source")?,
                    created_at: from_micros(col(r, "created_at")?)?,
                    defaults: Default::default(),
                })
            })
            .collect()
    }

    async fn upsert_node(&self, n: &NodeRecord) -> Result<(), RegistryError> {
        let runtimes = serde_json::to_string(&n.runtimes)
            .map_err(|e| RegistryError::Storage(e.to_string()))?;
        sqlx::query(
            "INSERT INTO node (node_id, address, runtimes, cpu, memory_mb, healthy, last_seen) \
             VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7) ON CONFLICT (node_id) DO UPDATE SET \
             address = excluded.address, runtimes = excluded.runtimes, cpu = excluded.cpu, \
             memory_mb = excluded.memory_mb, healthy = excluded.healthy, \
             last_seen = excluded.last_seen",
        )
        .bind(&n.id)
        .bind(&n.address)
        .bind(runtimes)
        .bind(n.cpu)
        .bind(to_i64(n.memory_mb)?)
        .bind(n.healthy)
        .bind(micros(n.last_seen))
        .execute(&self.pool)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, RegistryError> {
        let rows = sqlx::query(
            "SELECT node_id, address, runtimes::text AS runtimes, cpu, memory_mb, healthy, \
             last_seen FROM node ORDER BY node_id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(storage)?;
        rows.iter()
            .map(|r| {
                let runtimes: String = col(r, "runtimes")?;
                Ok(NodeRecord {
                    id: col(r, "node_id")?,
                    address: col(r, "address")?,
                    runtimes: serde_json::from_str(&runtimes)
                        .map_err(|e| RegistryError::Storage(format!("bad stored runtimes: {e}")))?,
                    cpu: col(r, "cpu")?,
                    memory_mb: to_u64(col(r, "memory_mb")?)?,
                    healthy: col(r, "healthy")?,
                    last_seen: from_micros(col(r, "last_seen")?)?,
                })
            })
            .collect()
    }

    async fn insert_api_key(
        &self,
        key_hash: &str,
        tenant: &str,
        admin: bool,
    ) -> Result<(), RegistryError> {
        let now = micros(aviary_core::now());
        let mut tx = self.begin().await.map_err(storage)?;
        sqlx::query(
            "INSERT INTO tenant (tenant_id, created_at) VALUES ($1, $2) \
             ON CONFLICT (tenant_id) DO NOTHING",
        )
        .bind(tenant)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(storage)?;
        sqlx::query(
            "INSERT INTO api_key (key_id, key_hash, tenant_id, admin, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(aviary_core::new_id("key"))
        .bind(key_hash)
        .bind(tenant)
        .bind(admin)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(storage)?;
        tx.commit().await.map_err(storage)
    }

    async fn find_api_key(&self, key_hash: &str) -> Result<Option<ApiKeyRecord>, RegistryError> {
        let row = sqlx::query(&format!(
            "{API_KEY_COLUMNS} WHERE key_hash = $1 AND revoked_at IS NULL"
        ))
        .bind(key_hash)
        .fetch_optional(&self.pool)
        .await
        .map_err(storage)?;
        row.map(|r| api_key_record(&r)).transpose()
    }

    async fn list_api_keys(&self) -> Result<Vec<ApiKeyRecord>, RegistryError> {
        sqlx::query(&format!("{API_KEY_COLUMNS} ORDER BY created_at, seq"))
            .fetch_all(&self.pool)
            .await
            .map_err(storage)?
            .iter()
            .map(api_key_record)
            .collect()
    }

    async fn revoke_api_key(
        &self,
        id: &str,
        at: OffsetDateTime,
    ) -> Result<ApiKeyRecord, RegistryError> {
        let mut tx = self.begin().await.map_err(storage)?;
        sqlx::query("UPDATE api_key SET revoked_at = $1 WHERE key_id = $2 AND revoked_at IS NULL")
            .bind(micros(at))
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(storage)?;
        let row = sqlx::query(&format!("{API_KEY_COLUMNS} WHERE key_id = $1"))
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(storage)?
            .ok_or(RegistryError::NotFound)?;
        let rec = api_key_record(&row)?;
        tx.commit().await.map_err(storage)?;
        Ok(rec)
    }

    async fn insert_allocation(&self, a: &AllocationRecord) -> Result<i64, RegistryError> {
        sqlx::query_scalar(
            "INSERT INTO sandbox_allocation (task_id, tenant_id, sandbox_id, planner_input_hash, \
             workload_signature, recommended_class, actual_class, reason, confidence, source, \
             cpu, memory_mb, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) \
             RETURNING allocation_id",
        )
        .bind(&a.task_id)
        .bind(&a.tenant)
        .bind(a.sandbox_id.as_ref().map(SandboxId::as_str))
        .bind(&a.planner_input_hash)
        .bind(&a.workload_signature)
        .bind(&a.recommended_class)
        .bind(&a.actual_class)
        .bind(&a.reason)
        .bind(a.confidence)
        .bind(&a.source)
        .bind(a.cpu)
        .bind(to_i64(a.memory_mb)?)
        .bind(micros(a.created_at))
        .fetch_one(&self.pool)
        .await
        .map_err(storage)
    }

    async fn update_allocation_usage(
        &self,
        id: i64,
        usage: &AllocationUsage,
    ) -> Result<(), RegistryError> {
        let done = sqlx::query(
            "UPDATE sandbox_allocation SET duration_s = $1, peak_cpu = $2, peak_memory_mb = $3, \
             oom = $4, timed_out = $5 WHERE allocation_id = $6",
        )
        .bind(usage.duration_s)
        .bind(usage.peak_cpu)
        .bind(to_i64(usage.peak_memory_mb)?)
        .bind(usage.oom)
        .bind(usage.timed_out)
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(storage)?;
        if done.rows_affected() == 0 {
            return Err(RegistryError::NotFound);
        }
        Ok(())
    }

    async fn list_allocations(
        &self,
        tenant: Option<&str>,
        limit: u32,
    ) -> Result<Vec<AllocationRecord>, RegistryError> {
        let mut q = QueryBuilder::<Postgres>::new(ALLOCATION_COLUMNS);
        if let Some(t) = tenant {
            q.push(" WHERE tenant_id = ").push_bind(t);
        }
        q.push(" ORDER BY allocation_id DESC LIMIT ")
            .push_bind(i64::from(effective_limit(limit)));
        let rows = q.build().fetch_all(&self.pool).await.map_err(storage)?;
        rows.iter().map(allocation_row).collect()
    }

    async fn upsert_environment(&self, e: &EnvironmentRecord) -> Result<(), RegistryError> {
        // a missing sandbox fails the foreign key: `storage` maps it to NotFound
        sqlx::query(
            "INSERT INTO sandbox_environment (sandbox_id, base_image_digest, dependency_hash, \
             workspace_id, snapshot_id, environment_version, dirty_level, manifest) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb) ON CONFLICT (sandbox_id) DO UPDATE SET \
             base_image_digest = excluded.base_image_digest, \
             dependency_hash = excluded.dependency_hash, workspace_id = excluded.workspace_id, \
             snapshot_id = excluded.snapshot_id, \
             environment_version = excluded.environment_version, \
             dirty_level = excluded.dirty_level, manifest = excluded.manifest",
        )
        .bind(e.sandbox_id.as_str())
        .bind(&e.base_image_digest)
        .bind(&e.dependency_hash)
        .bind(&e.workspace_id)
        .bind(&e.snapshot_id)
        .bind(e.environment_version)
        .bind(e.dirty_level)
        .bind(metadata_text(&e.manifest))
        .execute(&self.pool)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn get_environment(
        &self,
        id: &SandboxId,
    ) -> Result<Option<EnvironmentRecord>, RegistryError> {
        let row = sqlx::query(
            "SELECT sandbox_id, base_image_digest, dependency_hash, workspace_id, snapshot_id, \
             environment_version, dirty_level, manifest::text AS manifest \
             FROM sandbox_environment WHERE sandbox_id = $1",
        )
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(storage)?;
        row.map(|r| {
            Ok(EnvironmentRecord {
                sandbox_id: parse("sandbox id", &col::<String>(&r, "sandbox_id")?)?,
                base_image_digest: col(&r, "base_image_digest")?,
                dependency_hash: col(&r, "dependency_hash")?,
                workspace_id: col(&r, "workspace_id")?,
                snapshot_id: col(&r, "snapshot_id")?,
                environment_version: col(&r, "environment_version")?,
                dirty_level: col(&r, "dirty_level")?,
                manifest: parse_json("manifest", &col::<String>(&r, "manifest")?)?,
            })
        })
        .transpose()
    }

    async fn get_projection_index(
        &self,
        id: &SandboxId,
    ) -> Result<Option<BTreeMap<String, String>>, RegistryError> {
        let text: Option<String> =
            sqlx::query_scalar("SELECT files FROM sandbox_projection WHERE sandbox_id = $1")
                .bind(id.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(storage)?;
        text.map(|t| {
            serde_json::from_str(&t)
                .map_err(|e| RegistryError::Storage(format!("bad stored projection index: {e}")))
        })
        .transpose()
    }

    async fn put_projection_index(
        &self,
        id: &SandboxId,
        files: &BTreeMap<String, String>,
    ) -> Result<(), RegistryError> {
        let text = serde_json::to_string(files)
            .map_err(|e| RegistryError::Storage(format!("encode projection index: {e}")))?;
        // a missing sandbox fails the foreign key: `storage` maps it to NotFound
        sqlx::query(
            "INSERT INTO sandbox_projection (sandbox_id, files, updated_at) VALUES ($1, $2, $3) \
             ON CONFLICT (sandbox_id) DO UPDATE SET files = excluded.files, \
             updated_at = excluded.updated_at",
        )
        .bind(id.as_str())
        .bind(text)
        .bind(micros(truncate(aviary_core::now())))
        .execute(&self.pool)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn delete_projection_index(&self, id: &SandboxId) -> Result<(), RegistryError> {
        sqlx::query("DELETE FROM sandbox_projection WHERE sandbox_id = $1")
            .bind(id.as_str())
            .execute(&self.pool)
            .await
            .map_err(storage)?;
        Ok(())
    }

    async fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<SnapshotRecord, RegistryError> {
        let mut stored = s.clone();
        stored.created_at = truncate(s.created_at);
        sqlx::query(
            "INSERT INTO sandbox_snapshot (snapshot_id, tenant_id, sandbox_id, parent_id, \
             workspace_manifest, upper_manifest, template_id, template_digest, resource_class, \
             label, total_bytes, new_bytes, created_at, manifest) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
        )
        .bind(&s.id)
        .bind(&s.tenant)
        .bind(s.sandbox_id.as_str())
        .bind(&s.parent)
        .bind(&s.workspace_manifest)
        .bind(&s.upper_manifest)
        .bind(&s.template)
        .bind(&s.template_digest)
        .bind(&s.resource_class)
        .bind(&s.label)
        .bind(to_i64(s.total_bytes)?)
        .bind(to_i64(s.new_bytes)?)
        .bind(micros(stored.created_at))
        .bind(s.manifest.as_ref().map(|m| m.to_string()))
        .execute(&self.pool)
        .await
        .map_err(storage)?;
        Ok(stored)
    }

    async fn get_snapshot(&self, id: &str) -> Result<SnapshotRecord, RegistryError> {
        let row = sqlx::query(&format!("{SNAPSHOT_COLUMNS} WHERE snapshot_id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(storage)?
            .ok_or(RegistryError::NotFound)?;
        snapshot_row(&row)
    }

    async fn list_snapshots(
        &self,
        filter: &SnapshotFilter,
    ) -> Result<Vec<SnapshotRecord>, RegistryError> {
        let mut q = QueryBuilder::<Postgres>::new(format!("{SNAPSHOT_COLUMNS} WHERE TRUE"));
        if let Some(t) = &filter.tenant {
            q.push(" AND tenant_id = ").push_bind(t);
        }
        if let Some(s) = &filter.sandbox_id {
            q.push(" AND sandbox_id = ").push_bind(s.as_str());
        }
        if let Some(l) = &filter.label {
            q.push(" AND label = ").push_bind(l);
        }
        q.push(" ORDER BY created_at, seq");
        let rows = q.build().fetch_all(&self.pool).await.map_err(storage)?;
        rows.iter().map(snapshot_row).collect()
    }

    async fn latest_snapshot(
        &self,
        tenant: &str,
        sandbox: &SandboxId,
    ) -> Result<Option<SnapshotRecord>, RegistryError> {
        // answered by `sandbox_snapshot_by_sandbox` without a sort
        let row = sqlx::query(&format!(
            "{SNAPSHOT_COLUMNS} WHERE tenant_id = $1 AND sandbox_id = $2 \
             ORDER BY created_at DESC, seq DESC LIMIT 1"
        ))
        .bind(tenant)
        .bind(sandbox.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(storage)?;
        row.map(|r| snapshot_row(&r)).transpose()
    }

    async fn delete_snapshot(&self, id: &str) -> Result<(), RegistryError> {
        let done = sqlx::query("DELETE FROM sandbox_snapshot WHERE snapshot_id = $1")
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(storage)?;
        if done.rows_affected() == 0 {
            return Err(RegistryError::NotFound);
        }
        Ok(())
    }

    async fn set_pool_bounds(&self, b: &PoolBoundsRecord) -> Result<(), RegistryError> {
        sqlx::query(
            "INSERT INTO pool_bounds (resource_class, pool_min, pool_max, updated_at) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (resource_class) DO UPDATE SET \
             pool_min = excluded.pool_min, pool_max = excluded.pool_max, \
             updated_at = excluded.updated_at",
        )
        .bind(&b.class)
        .bind(i64::from(b.pool_min))
        .bind(i64::from(b.pool_max))
        .bind(micros(b.updated_at))
        .execute(&self.pool)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn list_pool_bounds(&self) -> Result<Vec<PoolBoundsRecord>, RegistryError> {
        let rows = sqlx::query(
            "SELECT resource_class, pool_min, pool_max, updated_at FROM pool_bounds \
             ORDER BY resource_class",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(storage)?;
        rows.iter()
            .map(|r| {
                Ok(PoolBoundsRecord {
                    class: col(r, "resource_class")?,
                    pool_min: to_u32(col(r, "pool_min")?)?,
                    pool_max: to_u32(col(r, "pool_max")?)?,
                    updated_at: from_micros(col(r, "updated_at")?)?,
                })
            })
            .collect()
    }

    async fn list_pool_handouts(&self) -> Result<Vec<SandboxRecord>, RegistryError> {
        // the predicate is the partial index `sandbox_instance_pool_handouts`'
        // own, so only live hand-outs are read
        let rows = sqlx::query(&format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandbox_instance \
             WHERE pool_claimed_at IS NOT NULL AND state <> 'Terminated' \
             ORDER BY pool_claimed_at, seq"
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(storage)?;
        rows.iter().map(sandbox_row).collect()
    }

    async fn upsert_node_registration(&self, n: &NodeRegistration) -> Result<(), RegistryError> {
        sqlx::query(
            "INSERT INTO node_registration (node_id, address, token, registered_at) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (node_id) DO UPDATE SET \
             address = excluded.address, token = excluded.token, \
             registered_at = excluded.registered_at",
        )
        .bind(&n.id)
        .bind(&n.address)
        .bind(&n.token)
        .bind(micros(n.registered_at))
        .execute(&self.pool)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn list_node_registrations(&self) -> Result<Vec<NodeRegistration>, RegistryError> {
        let rows = sqlx::query(
            "SELECT node_id, address, token, registered_at FROM node_registration \
             ORDER BY node_id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(storage)?;
        rows.iter()
            .map(|r| {
                Ok(NodeRegistration {
                    id: col(r, "node_id")?,
                    address: col(r, "address")?,
                    token: col(r, "token")?,
                    registered_at: from_micros(col(r, "registered_at")?)?,
                })
            })
            .collect()
    }
}

const API_KEY_COLUMNS: &str =
    "SELECT key_id, key_hash, tenant_id, admin, created_at, revoked_at FROM api_key";

fn api_key_record(r: &PgRow) -> Result<ApiKeyRecord, RegistryError> {
    Ok(ApiKeyRecord {
        id: col(r, "key_id")?,
        key_hash: col(r, "key_hash")?,
        tenant: col(r, "tenant_id")?,
        admin: col(r, "admin")?,
        created_at: from_micros(col(r, "created_at")?)?,
        revoked_at: col::<Option<i64>>(r, "revoked_at")?
            .map(from_micros)
            .transpose()?,
    })
}

const SNAPSHOT_COLUMNS: &str = "SELECT snapshot_id, tenant_id, sandbox_id, parent_id, \
    workspace_manifest, upper_manifest, template_id, template_digest, resource_class, label, \
    total_bytes, new_bytes, created_at, manifest FROM sandbox_snapshot";

fn snapshot_row(r: &PgRow) -> Result<SnapshotRecord, RegistryError> {
    Ok(SnapshotRecord {
        id: col(r, "snapshot_id")?,
        tenant: col(r, "tenant_id")?,
        sandbox_id: parse("sandbox id", &col::<String>(r, "sandbox_id")?)?,
        parent: col(r, "parent_id")?,
        workspace_manifest: col(r, "workspace_manifest")?,
        upper_manifest: col(r, "upper_manifest")?,
        template: col(r, "template_id")?,
        template_digest: col(r, "template_digest")?,
        resource_class: col(r, "resource_class")?,
        label: col(r, "label")?,
        total_bytes: to_u64(col(r, "total_bytes")?)?,
        new_bytes: to_u64(col(r, "new_bytes")?)?,
        created_at: from_micros(col(r, "created_at")?)?,
        manifest: col::<Option<String>>(r, "manifest")?.and_then(|t| serde_json::from_str(&t).ok()),
    })
}

fn to_u32(v: i64) -> Result<u32, RegistryError> {
    u32::try_from(v).map_err(|_| RegistryError::Storage(format!("bad stored value {v}")))
}
