-- A sandbox's labels (`metadata` in the API, filterable), the default
-- environment, working directory and user of its execs, as JSON objects of strings; and the server's
-- named secrets (the key of per-sandbox access tokens), written once by the
-- first replica that needs one.
ALTER TABLE sandbox_instance ADD COLUMN labels_json TEXT NOT NULL DEFAULT '{}';
ALTER TABLE sandbox_instance ADD COLUMN env_json TEXT NOT NULL DEFAULT '{}';
-- The default working directory of its execs and the user they run as
-- (from the create and the template's image config).
ALTER TABLE sandbox_instance ADD COLUMN workdir TEXT;
ALTER TABLE sandbox_instance ADD COLUMN run_as TEXT;
CREATE TABLE server_secret (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
