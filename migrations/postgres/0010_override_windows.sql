-- The incident overrides rlc saw in force on the controller (`GET /v1/overrides`, read at each
-- report poll and at each run), one row per override and bucket it acted on: the minutes an
-- override acted on a bucket are not demand, so the policies leave them out. An override is in
-- force from `created_at` until `expires_at` or, when it was removed early, until shortly
-- after `last_seen` (the last time rlc saw it listed).
CREATE TABLE override_windows (
    override_id TEXT        NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL,
    service     TEXT        NOT NULL,
    bucket      TEXT        NOT NULL,
    reason      TEXT        NOT NULL,
    expires_at  TIMESTAMPTZ NOT NULL,
    last_seen   TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (override_id, created_at, service, bucket)
);
CREATE INDEX override_windows_expires_at ON override_windows (expires_at);
