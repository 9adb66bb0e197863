-- The environment manifest a snapshot was taken with (JSON text; NULL when
-- none was known): the reuse checker forks a scope's clean checkpoint only
-- when it fits the request.
ALTER TABLE sandbox_snapshot ADD COLUMN manifest TEXT;

-- The projection index of a sandbox: sandbox path -> SHA-256 of what the
-- last successful projection sync put there (JSON object text), so a
-- restart does not upload unchanged projected files again.
CREATE TABLE sandbox_projection (
    sandbox_id TEXT PRIMARY KEY REFERENCES sandbox_instance (sandbox_id) ON DELETE CASCADE,
    files      TEXT NOT NULL,
    updated_at BIGINT NOT NULL
);
