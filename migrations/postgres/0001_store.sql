-- RLC store: runs, quota history with evidence, shadow reports from the GRL controller,
-- and cursors (report position). JSON is kept as TEXT so both backends share every query.
CREATE TABLE runs (
    id             BIGSERIAL PRIMARY KEY,
    trigger        TEXT NOT NULL,
    started_at     TIMESTAMPTZ NOT NULL,
    finished_at    TIMESTAMPTZ NOT NULL,
    status         TEXT NOT NULL,
    commit_sha     TEXT,
    version_pushed TEXT,
    services       TEXT NOT NULL DEFAULT '[]',
    summary        TEXT NOT NULL DEFAULT '',
    error          TEXT
);
CREATE INDEX runs_started_at ON runs (started_at);

CREATE TABLE quota_history (
    id                 BIGSERIAL PRIMARY KEY,
    run_id             BIGINT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    recorded_at        TIMESTAMPTZ NOT NULL,
    service            TEXT NOT NULL,
    bucket             TEXT NOT NULL,
    change             TEXT NOT NULL,
    limit_rps          DOUBLE PRECISION,
    previous_limit_rps DOUBLE PRECISION,
    mode               TEXT,
    policy             TEXT,
    commit_sha         TEXT,
    evidence           TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX quota_history_bucket ON quota_history (service, bucket, recorded_at);

CREATE TABLE shadow_reports (
    seq            BIGINT NOT NULL,
    t              TEXT NOT NULL,
    service        TEXT NOT NULL,
    bucket         TEXT NOT NULL,
    caller         TEXT,
    procedure      TEXT,
    mode           TEXT NOT NULL,
    scope_key      TEXT NOT NULL DEFAULT '',
    offered        DOUBLE PRECISION NOT NULL,
    admitted       DOUBLE PRECISION NOT NULL,
    dropped        DOUBLE PRECISION NOT NULL,
    shadow_dropped DOUBLE PRECISION NOT NULL,
    limit_rps      DOUBLE PRECISION NOT NULL,
    drop_ratio     DOUBLE PRECISION NOT NULL,
    received_at    TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (seq, service, bucket, scope_key)
);
CREATE INDEX shadow_reports_bucket ON shadow_reports (service, bucket, seq);

CREATE TABLE cursors (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
