-- Shadow reports at fleet scale: the tick time becomes a real timestamp (it was the
-- controller's unix seconds kept as text; now integer unix milliseconds, as every time column
-- this migration adds), full-resolution rows are kept for a short window
-- (store.shadow_raw_retention) and rolled up per minute per (service, bucket, scope key) for
-- longer (store.shadow_rollup_retention). The dashboard and the readiness figures read the
-- roll-ups only.
CREATE TABLE shadow_reports_new (
    seq            INTEGER NOT NULL,
    t              INTEGER NOT NULL,
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
    received_at    INTEGER NOT NULL,
    PRIMARY KEY (seq, service, bucket, scope_key)
);
INSERT INTO shadow_reports_new
SELECT seq,
       CASE WHEN t NOT GLOB '*[^0-9.]*' AND t <> '' THEN CAST(CAST(t AS REAL) * 1000 AS INTEGER)
            ELSE CAST(strftime('%s', received_at) AS INTEGER) * 1000 END,
       service, bucket, caller, procedure, mode, scope_key, offered, admitted, dropped,
       shadow_dropped, limit_rps, drop_ratio,
       CAST(strftime('%s', received_at) AS INTEGER) * 1000
FROM shadow_reports;
DROP TABLE shadow_reports;
ALTER TABLE shadow_reports_new RENAME TO shadow_reports;
-- Retention deletes by tick time.
CREATE INDEX shadow_reports_t ON shadow_reports (t);

CREATE TABLE shadow_minutes (
    service        TEXT NOT NULL,
    bucket         TEXT NOT NULL,
    scope_key      TEXT NOT NULL,
    minute         INTEGER NOT NULL,
    reports        INTEGER NOT NULL,
    offered        REAL NOT NULL,
    admitted       REAL NOT NULL,
    dropped        REAL NOT NULL,
    shadow_dropped REAL NOT NULL,
    max_offered    REAL NOT NULL,
    max_drop_ratio REAL NOT NULL,
    -- first and last tick time in the minute
    first_t        INTEGER NOT NULL,
    last_t         INTEGER NOT NULL,
    limit_rps      REAL NOT NULL,
    mode           TEXT NOT NULL,
    last_seq       INTEGER NOT NULL,
    PRIMARY KEY (service, bucket, minute, scope_key)
);
CREATE INDEX shadow_minutes_minute ON shadow_minutes (minute);

-- Existing reports keep counting in the new views; limit and mode are those of the row with
-- the highest sequence in the minute.
INSERT INTO shadow_minutes (service, bucket, scope_key, minute, reports, offered, admitted,
                            dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t,
                            limit_rps, mode, last_seq)
SELECT service, bucket, scope_key, (t / 60000) * 60000, COUNT(*), SUM(offered), SUM(admitted),
       SUM(dropped), SUM(shadow_dropped), MAX(offered), MAX(drop_ratio), MIN(t),
       MAX(t), 0, '', MAX(seq)
FROM shadow_reports
GROUP BY service, bucket, scope_key, (t / 60000) * 60000;
UPDATE shadow_minutes SET
    limit_rps = (SELECT r.limit_rps FROM shadow_reports r WHERE r.seq = shadow_minutes.last_seq
                 AND r.service = shadow_minutes.service AND r.bucket = shadow_minutes.bucket
                 AND r.scope_key = shadow_minutes.scope_key),
    mode = (SELECT r.mode FROM shadow_reports r WHERE r.seq = shadow_minutes.last_seq
            AND r.service = shadow_minutes.service AND r.bucket = shadow_minutes.bucket
            AND r.scope_key = shadow_minutes.scope_key);
