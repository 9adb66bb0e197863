//! [`Registry`] on the SQLite tables of `migrations/`.

use crate::{from_micros, micros, storage, to_i64, to_u64, truncate, SqliteRegistry};
use async_trait::async_trait;
use aviary_core::api::Event;
use aviary_core::{NetworkProfile, ResourceLimits, SandboxId, SandboxState, Scope};
use aviary_leases::fence_rule;
use aviary_registry::*;
use sqlx::sqlite::SqliteRow;
use sqlx::{Executor, QueryBuilder, Row, Sqlite};
use std::collections::BTreeMap;
use std::str::FromStr;
use time::OffsetDateTime;

/// The columns [`sandbox_row`] reads.
const SANDBOX_COLUMNS: &str = "sandbox_id, tenant_id, user_id, session_id, agent, scope, \
    runtime_provider, runtime_instance_id, node_id, resource_class, cpu, memory_mb, disk_mb, \
    pids, template_id, template_digest, network_profile, state, created_at, last_active_at, \
    expires_at, version, tainted, user_managed, paused, labels_json, env_json, workdir, run_as";

fn col<'r, T>(row: &'r SqliteRow, name: &str) -> Result<T, RegistryError>
where
    T: sqlx::Decode<'r, Sqlite> + sqlx::Type<Sqlite>,
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

fn sandbox_row(row: &SqliteRow) -> Result<SandboxRecord, RegistryError> {
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

fn event_row(row: &SqliteRow) -> Result<Event, RegistryError> {
    let metadata: String = col(row, "metadata")?;
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
        metadata: serde_json::from_str(&metadata)
            .map_err(|e| RegistryError::Storage(format!("bad stored metadata: {e}")))?,
    })
}

fn allocation_row(row: &SqliteRow) -> Result<AllocationRecord, RegistryError> {
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

/// Stored form of event metadata: JSON text, `{}` for `null`.
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

/// Writes `rows` with one multi-row `INSERT`.
async fn insert_events<'e, E>(ex: E, rows: &[EventRow<'_>]) -> Result<(), RegistryError>
where
    E: Executor<'e, Database = Sqlite>,
{
    if rows.is_empty() {
        return Ok(());
    }
    let mut q = QueryBuilder::<Sqlite>::new(
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
            .push_bind(r.metadata);
    });
    q.build().execute(ex).await.map_err(storage)?;
    Ok(())
}

/// The query of [`Registry::list_sandboxes`] (`?` = the tenant, when
/// `by_tenant`). Live rows are selected with the state as a literal, so
/// SQLite proves the query implies the live-rows partial indexes (migration
/// 10) and never walks the terminated history.
pub(crate) fn list_sandboxes_sql(by_tenant: bool, include_terminated: bool) -> String {
    let mut sql = format!("SELECT {SANDBOX_COLUMNS} FROM sandbox_instance WHERE 1 = 1");
    if by_tenant {
        sql.push_str(" AND tenant_id = ?");
    }
    if !include_terminated {
        sql.push_str(" AND state <> 'Terminated'");
    }
    sql.push_str(" ORDER BY created_at, rowid");
    sql
}

/// [`Registry::live_totals`]'s query. The state is a literal, so the live
/// partial indexes apply.
pub(crate) fn live_totals_sql(by_tenant: bool) -> String {
    format!(
        "SELECT node_id, state, count(*) AS n, total(cpu) AS cpu, total(memory_mb) AS memory_mb \
         FROM sandbox_instance WHERE {} state <> 'Terminated' \
         GROUP BY node_id, state ORDER BY node_id, state",
        if by_tenant { "tenant_id = ? AND" } else { "" }
    )
}

impl SqliteRegistry {
    async fn exists(&self, id: &SandboxId) -> Result<bool, RegistryError> {
        let found: Option<i64> =
            sqlx::query_scalar("SELECT 1 FROM sandbox_instance WHERE sandbox_id = ?")
                .bind(id.as_str())
                .fetch_optional(&self.writer)
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
            "UPDATE sandbox_instance SET {column} = ?, version = version + 1 \
             WHERE sandbox_id = ? AND version = ? RETURNING {SANDBOX_COLUMNS}"
        ))
        .bind(value)
        .bind(id.as_str())
        .bind(expected_version)
        .fetch_optional(&self.writer)
        .await
        .map_err(storage)?;
        self.versioned(id, row).await
    }

    /// The answer of a versioned single-row `UPDATE ... RETURNING`: the new
    /// record, or why no row matched.
    async fn versioned(
        &self,
        id: &SandboxId,
        row: Option<SqliteRow>,
    ) -> Result<SandboxRecord, RegistryError> {
        match row {
            Some(row) => sandbox_row(&row),
            None if self.exists(id).await? => Err(RegistryError::Conflict),
            None => Err(RegistryError::NotFound),
        }
    }
}

#[async_trait]
impl Registry for SqliteRegistry {
    async fn insert_sandbox(
        &self,
        new: &NewSandbox,
        ctx: TransitionCtx,
    ) -> Result<SandboxRecord, RegistryError> {
        let now = truncate(aviary_core::now());
        let expires_at = new.expires_at.map(truncate);
        let mut tx = self.begin_write().await.map_err(storage)?;
        sqlx::query(
            "INSERT INTO sandbox_instance (sandbox_id, tenant_id, user_id, session_id, agent, \
             scope, runtime_provider, runtime_instance_id, node_id, resource_class, cpu, \
             memory_mb, disk_mb, pids, template_id, template_digest, network_profile, state, \
             created_at, last_active_at, expires_at, version, tainted, user_managed, labels_json, \
             env_json, workdir, run_as) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, ?, ?, ?)",
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
            &mut *tx,
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
            "SELECT {SANDBOX_COLUMNS} FROM sandbox_instance WHERE sandbox_id = ?"
        ))
        .bind(id.as_str())
        .fetch_optional(&self.reader)
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
        let sql = list_sandboxes_sql(tenant.is_some(), include_terminated);
        let mut q = sqlx::query(&sql);
        if let Some(t) = tenant {
            q = q.bind(t);
        }
        let rows = q.fetch_all(&self.reader).await.map_err(storage)?;
        rows.iter().map(sandbox_row).collect()
    }

    async fn live_totals(&self, tenant: Option<&str>) -> Result<Vec<LiveTotal>, RegistryError> {
        let sql = live_totals_sql(tenant.is_some());
        let mut q = sqlx::query(&sql);
        if let Some(t) = tenant {
            q = q.bind(t);
        }
        let rows = q.fetch_all(&self.reader).await.map_err(storage)?;
        rows.iter()
            .map(|row| {
                Ok(LiveTotal {
                    node: col(row, "node_id")?,
                    state: parse("state", &col::<String>(row, "state")?)?,
                    sandboxes: to_u64(col(row, "n")?)?,
                    cpu: col(row, "cpu")?,
                    // total() is REAL in SQLite; memory sums are whole MiB
                    memory_mb: col::<f64>(row, "memory_mb")?.max(0.0) as u64,
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
        let mut tx = self.begin_write().await.map_err(storage)?;
        // the live lease is read in the transaction that writes the state
        let row = sqlx::query(
            "SELECT i.state, i.version, i.tenant_id, i.fence_token, l.lease_version, l.lease_secret \
             FROM sandbox_instance i \
             LEFT JOIN sandbox_lease l ON l.sandbox_id = i.sandbox_id AND l.expires_at > ?2 \
             WHERE i.sandbox_id = ?1",
        )
        .bind(id.as_str())
        .bind(micros(now))
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
                let secret = col::<Option<String>>(&row, "lease_secret")?.unwrap_or_default();
                let live = col::<Option<i64>>(&row, "lease_version")?
                    .map(|t| {
                        to_u64(t)?;
                        crate::leases::token_of(t, &secret)
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
            drop(tx);
            return self.get_sandbox(id).await;
        };
        let tenant: String = col(&row, "tenant_id")?;
        let steps = i64::try_from(path.len())
            .map_err(|_| RegistryError::Storage("path too long".into()))?;

        let updated = sqlx::query(&format!(
            "UPDATE sandbox_instance SET state = ?, version = version + ?, last_active_at = ? \
             WHERE sandbox_id = ? RETURNING {SANDBOX_COLUMNS}"
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
        insert_events(&mut *tx, &events).await?;
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
        let mut tx = self.begin_write().await.map_err(storage)?;
        let row = sqlx::query(
            "SELECT state, version, tenant_id, tainted FROM sandbox_instance WHERE sandbox_id = ?",
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
            "UPDATE sandbox_instance SET tenant_id = ?, user_id = ?, session_id = ?, agent = ?, scope = ?, \
             expires_at = ?, user_managed = ?, state = ?, version = version + 1, last_active_at = ?, \
             pool_claimed_at = ?, labels_json = ?, env_json = ?, workdir = ?, run_as = ? \
             WHERE sandbox_id = ? \
             RETURNING {SANDBOX_COLUMNS}"
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
        .bind(micros(now))
        .bind(map_text(&claim.metadata))
        .bind(map_text(&claim.env))
        .bind(&claim.workdir)
        .bind(&claim.run_as)
        .bind(id.as_str())
        .fetch_one(&mut *tx)
        .await
        .map_err(storage)?;
        let metadata = metadata_text(&ctx.metadata);
        insert_events(
            &mut *tx,
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
            "UPDATE sandbox_instance SET runtime_instance_id = ?, node_id = ?, \
             version = version + 1 WHERE sandbox_id = ? AND version = ? \
             RETURNING {SANDBOX_COLUMNS}"
        ))
        .bind(runtime_instance_id)
        .bind(node)
        .bind(id.as_str())
        .bind(expected_version)
        .fetch_optional(&self.writer)
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
            "UPDATE sandbox_instance SET expires_at = ?, version = version + 1 \
             WHERE sandbox_id = ? AND version = ? RETURNING {SANDBOX_COLUMNS}"
        ))
        .bind(expires_at.map(truncate).map(micros))
        .bind(id.as_str())
        .bind(expected_version)
        .fetch_optional(&self.writer)
        .await
        .map_err(storage)?;
        self.versioned(id, row).await
    }

    async fn server_secret(&self, name: &str, candidate: &str) -> Result<String, RegistryError> {
        sqlx::query(
            "INSERT INTO server_secret (name, value) VALUES (?, ?) ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .bind(candidate)
        .execute(&self.writer)
        .await
        .map_err(storage)?;
        sqlx::query_scalar("SELECT value FROM server_secret WHERE name = ?")
            .bind(name)
            .fetch_one(&self.writer)
            .await
            .map_err(storage)
    }

    async fn touch(&self, id: &SandboxId, now: OffsetDateTime) -> Result<(), RegistryError> {
        let done =
            sqlx::query("UPDATE sandbox_instance SET last_active_at = ? WHERE sandbox_id = ?")
                .bind(micros(now))
                .bind(id.as_str())
                .execute(&self.writer)
                .await
                .map_err(storage)?;
        if done.rows_affected() == 0 {
            return Err(RegistryError::NotFound);
        }
        Ok(())
    }

    async fn append_event(&self, ev: NewEvent) -> Result<i64, RegistryError> {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO sandbox_event (sandbox_id, tenant_id, event_type, old_state, \
             new_state, request_id, timestamp, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?) \
             RETURNING event_id",
        )
        .bind(ev.sandbox_id.as_ref().map(SandboxId::as_str))
        .bind(&ev.tenant)
        .bind(&ev.event_type)
        .bind(ev.old_state.map(SandboxState::as_str))
        .bind(ev.new_state.map(SandboxState::as_str))
        .bind(&ev.request_id)
        .bind(micros(aviary_core::now()))
        .bind(metadata_text(&ev.metadata))
        .fetch_one(&self.writer)
        .await
        .map_err(storage)?;
        Ok(id)
    }

    async fn list_events(&self, filter: &EventFilter) -> Result<Vec<Event>, RegistryError> {
        let mut q = QueryBuilder::<Sqlite>::new(
            "SELECT event_id, sandbox_id, tenant_id, event_type, old_state, new_state, \
             request_id, timestamp, metadata FROM sandbox_event WHERE event_id > ",
        );
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
        let rows = q.build().fetch_all(&self.reader).await.map_err(storage)?;
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
             VALUES (?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET digest = excluded.digest, \
             size_bytes = excluded.size_bytes, source = excluded.source, \
             created_at = excluded.created_at",
        )
        .bind(&t.name)
        .bind(&t.digest)
        .bind(to_i64(t.size_bytes)?)
        .bind(&t.source)
        .bind(micros(t.created_at))
        .execute(&self.writer)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn list_templates(&self) -> Result<Vec<TemplateRecord>, RegistryError> {
        let rows = sqlx::query(
            "SELECT name, digest, size_bytes, source, created_at FROM template ORDER BY name",
        )
        .fetch_all(&self.reader)
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
             VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE SET \
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
        .execute(&self.writer)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, RegistryError> {
        let rows = sqlx::query(
            "SELECT node_id, address, runtimes, cpu, memory_mb, healthy, last_seen \
             FROM node ORDER BY node_id",
        )
        .fetch_all(&self.reader)
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
        let mut tx = self.begin_write().await.map_err(storage)?;
        sqlx::query(
            "INSERT INTO tenant (tenant_id, created_at) VALUES (?, ?) \
             ON CONFLICT (tenant_id) DO NOTHING",
        )
        .bind(tenant)
        .bind(now)
        .execute(&mut *tx)
        .await
        .map_err(storage)?;
        sqlx::query(
            "INSERT INTO api_key (key_id, key_hash, tenant_id, admin, created_at) \
             VALUES (?, ?, ?, ?, ?)",
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
            "{API_KEY_COLUMNS} WHERE key_hash = ? AND revoked_at IS NULL"
        ))
        .bind(key_hash)
        .fetch_optional(&self.reader)
        .await
        .map_err(storage)?;
        row.map(|r| api_key_record(&r)).transpose()
    }

    async fn list_api_keys(&self) -> Result<Vec<ApiKeyRecord>, RegistryError> {
        sqlx::query(&format!("{API_KEY_COLUMNS} ORDER BY created_at, rowid"))
            .fetch_all(&self.reader)
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
        let mut tx = self.begin_write().await.map_err(storage)?;
        sqlx::query("UPDATE api_key SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL")
            .bind(micros(at))
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(storage)?;
        let row = sqlx::query(&format!("{API_KEY_COLUMNS} WHERE key_id = ?"))
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
             cpu, memory_mb, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) \
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
        .fetch_one(&self.writer)
        .await
        .map_err(storage)
    }

    async fn update_allocation_usage(
        &self,
        id: i64,
        usage: &AllocationUsage,
    ) -> Result<(), RegistryError> {
        let done = sqlx::query(
            "UPDATE sandbox_allocation SET duration_s = ?, peak_cpu = ?, peak_memory_mb = ?, \
             oom = ?, timed_out = ? WHERE allocation_id = ?",
        )
        .bind(usage.duration_s)
        .bind(usage.peak_cpu)
        .bind(to_i64(usage.peak_memory_mb)?)
        .bind(usage.oom)
        .bind(usage.timed_out)
        .bind(id)
        .execute(&self.writer)
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
        let mut q = QueryBuilder::<Sqlite>::new("SELECT * FROM sandbox_allocation");
        if let Some(t) = tenant {
            q.push(" WHERE tenant_id = ").push_bind(t);
        }
        q.push(" ORDER BY allocation_id DESC LIMIT ")
            .push_bind(i64::from(effective_limit(limit)));
        let rows = q.build().fetch_all(&self.reader).await.map_err(storage)?;
        rows.iter().map(allocation_row).collect()
    }

    async fn upsert_environment(&self, e: &EnvironmentRecord) -> Result<(), RegistryError> {
        // a missing sandbox fails the foreign key: `storage` maps it to NotFound
        sqlx::query(
            "INSERT INTO sandbox_environment (sandbox_id, base_image_digest, dependency_hash, \
             workspace_id, snapshot_id, environment_version, dirty_level, manifest) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (sandbox_id) DO UPDATE SET \
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
        .execute(&self.writer)
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
             environment_version, dirty_level, manifest FROM sandbox_environment WHERE sandbox_id = ?",
        )
        .bind(id.as_str())
        .fetch_optional(&self.reader)
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
                manifest: serde_json::from_str(&col::<String>(&r, "manifest")?)
                    .unwrap_or(serde_json::Value::Null),
            })
        })
        .transpose()
    }

    async fn get_projection_index(
        &self,
        id: &SandboxId,
    ) -> Result<Option<BTreeMap<String, String>>, RegistryError> {
        let text: Option<String> =
            sqlx::query_scalar("SELECT files FROM sandbox_projection WHERE sandbox_id = ?")
                .bind(id.as_str())
                .fetch_optional(&self.reader)
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
            "INSERT INTO sandbox_projection (sandbox_id, files, updated_at) VALUES (?, ?, ?) \
             ON CONFLICT (sandbox_id) DO UPDATE SET files = excluded.files, \
             updated_at = excluded.updated_at",
        )
        .bind(id.as_str())
        .bind(text)
        .bind(micros(truncate(aviary_core::now())))
        .execute(&self.writer)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn delete_projection_index(&self, id: &SandboxId) -> Result<(), RegistryError> {
        sqlx::query("DELETE FROM sandbox_projection WHERE sandbox_id = ?")
            .bind(id.as_str())
            .execute(&self.writer)
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
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
        .execute(&self.writer)
        .await
        .map_err(storage)?;
        Ok(stored)
    }

    async fn get_snapshot(&self, id: &str) -> Result<SnapshotRecord, RegistryError> {
        let row = sqlx::query(&format!("{SNAPSHOT_COLUMNS} WHERE snapshot_id = ?"))
            .bind(id)
            .fetch_optional(&self.reader)
            .await
            .map_err(storage)?
            .ok_or(RegistryError::NotFound)?;
        snapshot_row(&row)
    }

    async fn list_snapshots(
        &self,
        filter: &SnapshotFilter,
    ) -> Result<Vec<SnapshotRecord>, RegistryError> {
        let mut q = QueryBuilder::<Sqlite>::new(format!("{SNAPSHOT_COLUMNS} WHERE 1 = 1"));
        if let Some(t) = &filter.tenant {
            q.push(" AND tenant_id = ").push_bind(t);
        }
        if let Some(s) = &filter.sandbox_id {
            q.push(" AND sandbox_id = ").push_bind(s.as_str());
        }
        if let Some(l) = &filter.label {
            q.push(" AND label = ").push_bind(l);
        }
        q.push(" ORDER BY created_at, rowid");
        let rows = q.build().fetch_all(&self.reader).await.map_err(storage)?;
        rows.iter().map(snapshot_row).collect()
    }

    async fn latest_snapshot(
        &self,
        tenant: &str,
        sandbox: &SandboxId,
    ) -> Result<Option<SnapshotRecord>, RegistryError> {
        let row = sqlx::query(&latest_snapshot_sql())
            .bind(sandbox.as_str())
            .bind(tenant)
            .fetch_optional(&self.reader)
            .await
            .map_err(storage)?;
        row.map(|r| snapshot_row(&r)).transpose()
    }

    async fn delete_snapshot(&self, id: &str) -> Result<(), RegistryError> {
        let done = sqlx::query("DELETE FROM sandbox_snapshot WHERE snapshot_id = ?")
            .bind(id)
            .execute(&self.writer)
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
             VALUES (?, ?, ?, ?) ON CONFLICT (resource_class) DO UPDATE SET \
             pool_min = excluded.pool_min, pool_max = excluded.pool_max, \
             updated_at = excluded.updated_at",
        )
        .bind(&b.class)
        .bind(i64::from(b.pool_min))
        .bind(i64::from(b.pool_max))
        .bind(micros(b.updated_at))
        .execute(&self.writer)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn list_pool_bounds(&self) -> Result<Vec<PoolBoundsRecord>, RegistryError> {
        let rows = sqlx::query(
            "SELECT resource_class, pool_min, pool_max, updated_at FROM pool_bounds \
             ORDER BY resource_class",
        )
        .fetch_all(&self.reader)
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
        let rows = sqlx::query(&pool_handouts_sql())
            .fetch_all(&self.reader)
            .await
            .map_err(storage)?;
        rows.iter().map(sandbox_row).collect()
    }

    async fn upsert_node_registration(&self, n: &NodeRegistration) -> Result<(), RegistryError> {
        sqlx::query(
            "INSERT INTO node_registration (node_id, address, token, registered_at) \
             VALUES (?, ?, ?, ?) ON CONFLICT (node_id) DO UPDATE SET \
             address = excluded.address, token = excluded.token, \
             registered_at = excluded.registered_at",
        )
        .bind(&n.id)
        .bind(&n.address)
        .bind(&n.token)
        .bind(micros(n.registered_at))
        .execute(&self.writer)
        .await
        .map_err(storage)?;
        Ok(())
    }

    async fn list_node_registrations(&self) -> Result<Vec<NodeRegistration>, RegistryError> {
        let rows = sqlx::query(
            "SELECT node_id, address, token, registered_at FROM node_registration \
             ORDER BY node_id",
        )
        .fetch_all(&self.reader)
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

fn api_key_record(r: &SqliteRow) -> Result<ApiKeyRecord, RegistryError> {
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

fn snapshot_row(r: &SqliteRow) -> Result<SnapshotRecord, RegistryError> {
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

/// Answered by `sandbox_snapshot_by_sandbox` without a sort.
pub(crate) fn latest_snapshot_sql() -> String {
    format!(
        "{SNAPSHOT_COLUMNS} WHERE sandbox_id = ? AND tenant_id = ? \
         ORDER BY created_at DESC, rowid DESC LIMIT 1"
    )
}

/// The predicate is the partial index `sandbox_instance_pool_handouts`' own,
/// so only live hand-outs are read.
pub(crate) fn pool_handouts_sql() -> String {
    format!(
        "SELECT {SANDBOX_COLUMNS} FROM sandbox_instance \
         WHERE pool_claimed_at IS NOT NULL AND state <> 'Terminated' \
         ORDER BY pool_claimed_at"
    )
}
