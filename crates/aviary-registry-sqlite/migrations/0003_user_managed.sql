-- Sandboxes whose life the user manages: the platform only stops them.
ALTER TABLE sandbox_instance ADD COLUMN user_managed INTEGER NOT NULL DEFAULT 0;
