-- A sandbox's labels (`metadata` in the API, filterable) and the default
-- environment of its execs, as JSON objects of strings; and the server's
-- named secrets (the key of per-sandbox access tokens), written once by the
-- first replica that needs one.
ALTER TABLE sandbox_instance ADD COLUMN labels_json TEXT NOT NULL DEFAULT '{}';
ALTER TABLE sandbox_instance ADD COLUMN env_json TEXT NOT NULL DEFAULT '{}';
CREATE TABLE server_secret (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
