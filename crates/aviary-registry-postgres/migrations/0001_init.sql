-- Aviary registry on PostgreSQL, schema 1: the tables of the SQLite registry
-- (aviary-registry-sqlite, its schema 6) in PostgreSQL types. Times are BIGINT
-- microseconds since the Unix epoch (UTC), as in SQLite, so both backends
-- share their time code; JSON is JSONB. A `seq` identity column gives the
-- insertion order that SQLite's rowid gives, for ties in `created_at`.

CREATE TABLE tenant (
    tenant_id   TEXT PRIMARY KEY,
    created_at  BIGINT NOT NULL
);

-- `key_id` is the public id (listing, revocation); the secret is only hashed.
CREATE TABLE api_key (
    key_hash    TEXT PRIMARY KEY,
    key_id      TEXT NOT NULL UNIQUE,
    tenant_id   TEXT NOT NULL REFERENCES tenant (tenant_id),
    admin       BOOLEAN NOT NULL,
    created_at  BIGINT NOT NULL,
    revoked_at  BIGINT,
    seq         BIGINT GENERATED ALWAYS AS IDENTITY
);

CREATE TABLE sandbox_instance (
    sandbox_id          TEXT PRIMARY KEY,
    tenant_id           TEXT NOT NULL,
    user_id             TEXT,
    session_id          TEXT,
    agent               TEXT,
    scope               TEXT NOT NULL,
    runtime_provider    TEXT NOT NULL,
    runtime_instance_id TEXT,
    node_id             TEXT NOT NULL,
    resource_class      TEXT NOT NULL,
    cpu                 DOUBLE PRECISION NOT NULL,
    memory_mb           BIGINT NOT NULL,
    disk_mb             BIGINT NOT NULL,
    pids                BIGINT NOT NULL,
    template_id         TEXT NOT NULL,
    template_digest     TEXT NOT NULL,
    network_profile     TEXT NOT NULL,
    state               TEXT NOT NULL,
    created_at          BIGINT NOT NULL,
    last_active_at      BIGINT NOT NULL,
    expires_at          BIGINT,
    version             BIGINT NOT NULL,
    tainted             BOOLEAN NOT NULL,
    -- the platform only stops sandboxes whose life the user manages
    user_managed        BOOLEAN NOT NULL DEFAULT FALSE,
    -- set by claim_sandbox: the sandbox came out of a warm pool
    pool_claimed_at     BIGINT,
    -- highest fence ever granted (lease table or FenceAuthority); never
    -- decreases, and every grant bumps it under this row's lock
    fence_token         BIGINT NOT NULL DEFAULT 0 CHECK (fence_token >= 0),
    seq                 BIGINT GENERATED ALWAYS AS IDENTITY
);
CREATE INDEX sandbox_instance_by_tenant ON sandbox_instance (tenant_id, created_at, seq);
CREATE INDEX sandbox_instance_pool_handouts ON sandbox_instance (pool_claimed_at)
    WHERE pool_claimed_at IS NOT NULL AND state <> 'Terminated';

-- At most one lease row per sandbox. A token is FENCE.SECRET: the fence
-- (lease_version) orders writes, the random hex secret makes the token a
-- capability that cannot be guessed from the small, public fence number.
CREATE TABLE sandbox_lease (
    sandbox_id    TEXT PRIMARY KEY REFERENCES sandbox_instance (sandbox_id) ON DELETE CASCADE,
    lease_owner   TEXT NOT NULL,
    lease_version BIGINT NOT NULL,
    lease_secret  TEXT NOT NULL,
    acquired_at   BIGINT NOT NULL,
    heartbeat_at  BIGINT NOT NULL,
    expires_at    BIGINT NOT NULL
);
CREATE INDEX sandbox_lease_by_expiry ON sandbox_lease (expires_at);

-- The whole environment manifest beside the summary columns the reuse
-- checker filters on.
CREATE TABLE sandbox_environment (
    sandbox_id          TEXT PRIMARY KEY REFERENCES sandbox_instance (sandbox_id) ON DELETE CASCADE,
    base_image_digest   TEXT NOT NULL,
    dependency_hash     TEXT NOT NULL,
    workspace_id        TEXT,
    snapshot_id         TEXT,
    environment_version BIGINT NOT NULL,
    dirty_level         INTEGER NOT NULL,
    manifest            JSONB NOT NULL DEFAULT '{}'
);

-- Identity values are never reused; writers take the event-order lock
-- before inserting, so ids also become visible in increasing order and
-- `after_id` paging never skips a row.
CREATE TABLE sandbox_event (
    event_id    BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    sandbox_id  TEXT,
    tenant_id   TEXT NOT NULL,
    event_type  TEXT NOT NULL,
    old_state   TEXT,
    new_state   TEXT,
    request_id  TEXT,
    timestamp   BIGINT NOT NULL,
    metadata    JSONB NOT NULL
);
CREATE INDEX sandbox_event_by_tenant ON sandbox_event (tenant_id, event_id);
CREATE INDEX sandbox_event_by_sandbox ON sandbox_event (sandbox_id, event_id);

CREATE TABLE sandbox_allocation (
    allocation_id      BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    task_id            TEXT NOT NULL,
    tenant_id          TEXT NOT NULL,
    sandbox_id         TEXT,
    planner_input_hash TEXT NOT NULL,
    workload_signature TEXT NOT NULL,
    recommended_class  TEXT NOT NULL,
    actual_class       TEXT NOT NULL,
    reason             TEXT NOT NULL,
    confidence         DOUBLE PRECISION NOT NULL,
    source             TEXT NOT NULL,
    cpu                DOUBLE PRECISION NOT NULL,
    memory_mb          BIGINT NOT NULL,
    created_at         BIGINT NOT NULL,
    -- measured usage; NULL until the sandbox is released
    duration_s         DOUBLE PRECISION,
    peak_cpu           DOUBLE PRECISION,
    peak_memory_mb     BIGINT,
    oom                BOOLEAN,
    timed_out          BOOLEAN
);
CREATE INDEX sandbox_allocation_by_tenant ON sandbox_allocation (tenant_id, allocation_id);
CREATE INDEX sandbox_allocation_by_signature ON sandbox_allocation (workload_signature, allocation_id);

CREATE TABLE template (
    name        TEXT PRIMARY KEY,
    digest      TEXT NOT NULL,
    size_bytes  BIGINT NOT NULL,
    source      TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);

CREATE TABLE node (
    node_id     TEXT PRIMARY KEY,
    address     TEXT NOT NULL,
    runtimes    JSONB NOT NULL,
    cpu         DOUBLE PRECISION NOT NULL,
    memory_mb   BIGINT NOT NULL,
    healthy     BOOLEAN NOT NULL,
    last_seen   BIGINT NOT NULL
);

-- One row per checkpoint: its two chunk-store manifests and its lineage. No
-- foreign key to sandbox_instance: the index may name sandboxes the registry
-- no longer has (imported from older registries).
CREATE TABLE sandbox_snapshot (
    snapshot_id        TEXT PRIMARY KEY,
    tenant_id          TEXT NOT NULL,
    sandbox_id         TEXT NOT NULL,
    parent_id          TEXT,
    workspace_manifest TEXT NOT NULL,
    upper_manifest     TEXT NOT NULL,
    template_id        TEXT NOT NULL,
    template_digest    TEXT NOT NULL,
    resource_class     TEXT NOT NULL,
    label              TEXT NOT NULL,
    total_bytes        BIGINT NOT NULL,
    new_bytes          BIGINT NOT NULL,
    created_at         BIGINT NOT NULL,
    seq                BIGINT GENERATED ALWAYS AS IDENTITY
);
-- the latest snapshot of a sandbox (restore, wake, parent of the next one)
CREATE INDEX sandbox_snapshot_by_sandbox ON sandbox_snapshot (tenant_id, sandbox_id, created_at, seq);
-- a tenant's snapshots, and those with a label (`clean` for resets)
CREATE INDEX sandbox_snapshot_by_tenant ON sandbox_snapshot (tenant_id, created_at, seq);
CREATE INDEX sandbox_snapshot_by_label ON sandbox_snapshot (tenant_id, label, created_at, seq);

-- `pool set` bounds per resource class, over the configuration's.
CREATE TABLE pool_bounds (
    resource_class TEXT PRIMARY KEY,
    pool_min       BIGINT NOT NULL,
    pool_max       BIGINT NOT NULL,
    updated_at     BIGINT NOT NULL
);

-- Node agents the control plane connects to. `token` is the agent's bearer
-- token, which the control plane must present, so it is kept as given: the
-- database's roles guard it.
CREATE TABLE node_registration (
    node_id       TEXT PRIMARY KEY,
    address       TEXT NOT NULL,
    token         TEXT NOT NULL,
    registered_at BIGINT NOT NULL
);
