-- The overrides' audit log: every override created, removed or expired (who, when, what,
-- why), kept after the override's row is gone. Written in the transaction of the change; an
-- expiry by the replica whose purge deleted the row. Trimmed to the newest events by the purge.
CREATE TABLE override_audit (
    seq BIGSERIAL PRIMARY KEY,
    -- Unix seconds of the event.
    at BIGINT NOT NULL,
    -- created | removed | expired
    action TEXT NOT NULL,
    override_id TEXT NOT NULL,
    -- The event as JSON text (the shape of GET /v1/overrides/history's events).
    doc TEXT NOT NULL
);
