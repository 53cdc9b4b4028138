-- The controller's durable state when `grl controller` runs with a database (schema
-- grl_controller, so the database can be shared with rlc's store). Every change (a config
-- push, an override added or removed) bumps `state.rev` in the transaction that writes it, so
-- replicas catch up by comparing one number.

CREATE TABLE state (
    id INT PRIMARY KEY CHECK (id = 1),
    -- Revision of the whole state; increases by one per change.
    rev BIGINT NOT NULL,
    -- The revision whose config is the current one (0: no config pushed yet).
    config_rev BIGINT NOT NULL,
    -- The last override id handed out (`ovr-N`).
    next_override_id BIGINT NOT NULL
);
INSERT INTO state (id, rev, config_rev, next_override_id) VALUES (1, 0, 0, 0);

-- Pushed configs, newest kept plus a few before it (older rows are pruned).
CREATE TABLE configs (
    rev BIGINT PRIMARY KEY,
    version TEXT NOT NULL,
    -- The config document as JSON text (what PUT /v1/config accepted).
    doc TEXT NOT NULL,
    credential TEXT NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Overrides in force or not yet purged (an expired one is deleted by the next replica that
-- purges; removed ones are deleted).
CREATE TABLE overrides (
    id TEXT PRIMARY KEY,
    -- The override as JSON text (id, request, created_at, expires_at, credential).
    doc TEXT NOT NULL,
    who TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    rev BIGINT NOT NULL
);
CREATE INDEX overrides_expires_at ON overrides (expires_at);
