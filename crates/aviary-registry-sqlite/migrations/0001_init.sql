-- Aviary registry, schema 1. Times are INTEGER microseconds since the Unix
-- epoch (UTC); booleans are INTEGER 0/1; JSON is TEXT.

CREATE TABLE tenant (
    tenant_id   TEXT PRIMARY KEY,
    created_at  INTEGER NOT NULL
);

CREATE TABLE api_key (
    key_hash    TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenant (tenant_id),
    admin       INTEGER NOT NULL,
    created_at  INTEGER NOT NULL
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
    cpu                 REAL NOT NULL,
    memory_mb           INTEGER NOT NULL,
    disk_mb             INTEGER NOT NULL,
    pids                INTEGER NOT NULL,
    template_id         TEXT NOT NULL,
    template_digest     TEXT NOT NULL,
    network_profile     TEXT NOT NULL,
    state               TEXT NOT NULL,
    created_at          INTEGER NOT NULL,
    last_active_at      INTEGER NOT NULL,
    expires_at          INTEGER,
    version             INTEGER NOT NULL,
    tainted             INTEGER NOT NULL,
    -- highest lease token ever granted; never decreases (fencing)
    fence_token         INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX sandbox_instance_by_tenant ON sandbox_instance (tenant_id, created_at);

-- at most one lease row per sandbox; lease_version is its fencing token
CREATE TABLE sandbox_lease (
    sandbox_id    TEXT PRIMARY KEY REFERENCES sandbox_instance (sandbox_id) ON DELETE CASCADE,
    lease_owner   TEXT NOT NULL,
    lease_version INTEGER NOT NULL,
    acquired_at   INTEGER NOT NULL,
    heartbeat_at  INTEGER NOT NULL,
    expires_at    INTEGER NOT NULL
);
CREATE INDEX sandbox_lease_by_expiry ON sandbox_lease (expires_at);

CREATE TABLE sandbox_environment (
    sandbox_id          TEXT PRIMARY KEY REFERENCES sandbox_instance (sandbox_id) ON DELETE CASCADE,
    base_image_digest   TEXT NOT NULL,
    dependency_hash     TEXT NOT NULL,
    workspace_id        TEXT,
    snapshot_id         TEXT,
    environment_version INTEGER NOT NULL,
    dirty_level         INTEGER NOT NULL
);

-- AUTOINCREMENT: ids are never reused, so `after_id` paging never skips
CREATE TABLE sandbox_event (
    event_id    INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id  TEXT,
    tenant_id   TEXT NOT NULL,
    event_type  TEXT NOT NULL,
    old_state   TEXT,
    new_state   TEXT,
    request_id  TEXT,
    timestamp   INTEGER NOT NULL,
    metadata    TEXT NOT NULL
);
CREATE INDEX sandbox_event_by_tenant ON sandbox_event (tenant_id, event_id);
CREATE INDEX sandbox_event_by_sandbox ON sandbox_event (sandbox_id, event_id);

CREATE TABLE sandbox_allocation (
    allocation_id      INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id            TEXT NOT NULL,
    tenant_id          TEXT NOT NULL,
    sandbox_id         TEXT,
    planner_input_hash TEXT NOT NULL,
    workload_signature TEXT NOT NULL,
    recommended_class  TEXT NOT NULL,
    actual_class       TEXT NOT NULL,
    reason             TEXT NOT NULL,
    confidence         REAL NOT NULL,
    source             TEXT NOT NULL,
    cpu                REAL NOT NULL,
    memory_mb          INTEGER NOT NULL,
    created_at         INTEGER NOT NULL,
    -- measured usage; NULL until the sandbox is released
    duration_s         REAL,
    peak_cpu           REAL,
    peak_memory_mb     INTEGER,
    oom                INTEGER,
    timed_out          INTEGER
);
CREATE INDEX sandbox_allocation_by_tenant ON sandbox_allocation (tenant_id, allocation_id);
CREATE INDEX sandbox_allocation_by_signature ON sandbox_allocation (workload_signature, allocation_id);

CREATE TABLE template (
    name        TEXT PRIMARY KEY,
    digest      TEXT NOT NULL,
    size_bytes  INTEGER NOT NULL,
    source      TEXT NOT NULL,
    created_at  INTEGER NOT NULL
);

CREATE TABLE node (
    node_id     TEXT PRIMARY KEY,
    address     TEXT NOT NULL,
    runtimes    TEXT NOT NULL,
    cpu         REAL NOT NULL,
    memory_mb   INTEGER NOT NULL,
    healthy     INTEGER NOT NULL,
    last_seen   INTEGER NOT NULL
);
