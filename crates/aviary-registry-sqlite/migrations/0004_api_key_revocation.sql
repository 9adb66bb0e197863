-- API keys get a public id (for listing and revocation) and can be revoked.
-- Existing keys get a random id; new ones get theirs from the backend.
ALTER TABLE api_key ADD COLUMN key_id TEXT;
ALTER TABLE api_key ADD COLUMN revoked_at INTEGER;
UPDATE api_key SET key_id = 'key-' || lower(hex(randomblob(10))) WHERE key_id IS NULL;
CREATE UNIQUE INDEX api_key_by_id ON api_key (key_id);
