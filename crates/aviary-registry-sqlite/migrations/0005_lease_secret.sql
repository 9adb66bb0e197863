-- A lease token is FENCE.SECRET: the fence (lease_version) orders writes, the
-- random secret makes the token a capability that cannot be guessed from the
-- small, public fence number. Leases granted before this migration have the
-- empty secret and match no token; they simply expire.
ALTER TABLE sandbox_lease ADD COLUMN lease_secret TEXT NOT NULL DEFAULT '';
