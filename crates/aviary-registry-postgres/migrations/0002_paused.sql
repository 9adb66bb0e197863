-- Whether a sandbox is frozen by `pause` (shown in `get`, `ls` and the API).
ALTER TABLE sandbox_instance ADD COLUMN paused BOOLEAN NOT NULL DEFAULT FALSE;
