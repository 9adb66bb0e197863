-- The whole environment manifest (runtime versions, package sets,
-- capabilities, dirty paths) as JSON, beside the summary columns the reuse
-- checker filters on.
ALTER TABLE sandbox_environment ADD COLUMN manifest TEXT NOT NULL DEFAULT '{}';
