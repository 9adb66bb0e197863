-- Live sandboxes, without the terminated history: the quota check, the pool
-- claim and the scheduler read them on every create, so their cost must not
-- grow with the number of sandboxes that ever existed. Queries name the state
-- as a literal ('Terminated') so SQLite can prove they imply these indexes'
-- WHERE clause (a bound parameter cannot be).
CREATE INDEX sandbox_instance_live_by_tenant ON sandbox_instance (tenant_id, created_at)
    WHERE state <> 'Terminated';
CREATE INDEX sandbox_instance_live ON sandbox_instance (created_at)
    WHERE state <> 'Terminated';
