-- RLC store: runs, quota history with evidence, shadow reports from the GRL controller,
-- and cursors (report position). JSON is kept as TEXT so both backends share every query.
CREATE TABLE runs (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    trigger        TEXT NOT NULL,
    started_at     TEXT NOT NULL,
    finished_at    TEXT NOT NULL,
    status         TEXT NOT NULL,
    commit_sha     TEXT,
    version_pushed TEXT,
    services       TEXT NOT NULL DEFAULT '[]',
    summary        TEXT NOT NULL DEFAULT '',
    error          TEXT
);
CREATE INDEX runs_started_at ON runs (started_at);

CREATE TABLE quota_history (
    id                 INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id             INTEGER NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    recorded_at        TEXT NOT NULL,
    service            TEXT NOT NULL,
    bucket             TEXT NOT NULL,
    change             TEXT NOT NULL,
    limit_rps          REAL,
    previous_limit_rps REAL,
    mode               TEXT,
    policy             TEXT,
    commit_sha         TEXT,
    evidence           TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX quota_history_bucket ON quota_history (service, bucket, recorded_at);

CREATE TABLE shadow_reports (
    seq            INTEGER NOT NULL,
    t              TEXT NOT NULL,
    service        TEXT NOT NULL,
    bucket         TEXT NOT NULL,
    caller         TEXT,
    procedure      TEXT,
    mode           TEXT NOT NULL,
    scope_key      TEXT NOT NULL DEFAULT '',
    offered        REAL NOT NULL,
    admitted       REAL NOT NULL,
    dropped        REAL NOT NULL,
    shadow_dropped REAL NOT NULL,
    limit_rps      REAL NOT NULL,
    drop_ratio     REAL NOT NULL,
    received_at    TEXT NOT NULL,
    PRIMARY KEY (seq, service, bucket, scope_key)
);
CREATE INDEX shadow_reports_bucket ON shadow_reports (service, bucket, seq);

CREATE TABLE cursors (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
