-- Whether a sandbox is frozen by `pause` (shown in `get`, `ls` and the API).
ALTER TABLE sandbox_instance ADD COLUMN paused INTEGER NOT NULL DEFAULT 0;
