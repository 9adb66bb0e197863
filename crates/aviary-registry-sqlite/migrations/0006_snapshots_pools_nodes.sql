-- The registry takes over what JSON files beside it held until now: the
-- snapshot index (`snapshot-index/<id>.json`), the pool bounds of
-- `pool set` (`pools.json`) and the node agent registrations (`nodes.json`).
-- It also remembers which sandboxes a warm pool handed out, so a pool's
-- hand-out count ends with the sandbox and survives restarts.

-- One row per checkpoint: its two chunk-store manifests and its lineage. No
-- foreign key to sandbox_instance: the index is imported from files that
-- may name sandboxes an older registry no longer has.
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
    total_bytes        INTEGER NOT NULL,
    new_bytes          INTEGER NOT NULL,
    created_at         INTEGER NOT NULL
);
-- the latest snapshot of a sandbox (restore, wake, parent of the next one)
CREATE INDEX sandbox_snapshot_by_sandbox ON sandbox_snapshot (tenant_id, sandbox_id, created_at);
-- a tenant's snapshots, and those with a label (`clean` for resets)
CREATE INDEX sandbox_snapshot_by_tenant ON sandbox_snapshot (tenant_id, created_at);
CREATE INDEX sandbox_snapshot_by_label ON sandbox_snapshot (tenant_id, label, created_at);

-- `pool set` bounds per resource class, over the configuration's.
CREATE TABLE pool_bounds (
    resource_class TEXT PRIMARY KEY,
    pool_min       INTEGER NOT NULL,
    pool_max       INTEGER NOT NULL,
    updated_at     INTEGER NOT NULL
);

-- Node agents the control plane connects to. `token` is the agent's bearer
-- token, which the control plane must present, so it is kept as given (the
-- database file is 0600, like the nodes.json it replaces).
CREATE TABLE node_registration (
    node_id       TEXT PRIMARY KEY,
    address       TEXT NOT NULL,
    token         TEXT NOT NULL,
    registered_at INTEGER NOT NULL
);

-- Set by claim_sandbox: the sandbox came out of a warm pool.
ALTER TABLE sandbox_instance ADD COLUMN pool_claimed_at INTEGER;
CREATE INDEX sandbox_instance_pool_handouts ON sandbox_instance (pool_claimed_at)
    WHERE pool_claimed_at IS NOT NULL AND state <> 'Terminated';
