-- Shadow reports at fleet scale: the tick time becomes a real timestamp (it was the
-- controller's unix seconds kept as text), full-resolution rows are kept for a short window
-- (store.shadow_raw_retention) and rolled up per minute per (service, bucket, scope key) for
-- longer (store.shadow_rollup_retention). The dashboard and the readiness figures read the
-- roll-ups only.
ALTER TABLE shadow_reports ALTER COLUMN t TYPE TIMESTAMPTZ USING (
    CASE WHEN t ~ '^[0-9]+(\.[0-9]+)?$' THEN to_timestamp(t::double precision)
         ELSE received_at END);
DROP INDEX IF EXISTS shadow_reports_received_at;
DROP INDEX IF EXISTS shadow_reports_service_received_at;
DROP INDEX IF EXISTS shadow_reports_bucket;
-- Retention deletes by tick time.
CREATE INDEX shadow_reports_t ON shadow_reports (t);

CREATE TABLE shadow_minutes (
    service        TEXT NOT NULL,
    bucket         TEXT NOT NULL,
    scope_key      TEXT NOT NULL,
    minute         TIMESTAMPTZ NOT NULL,
    -- reports summed into this row (ticks of this scope key in the minute)
    reports        BIGINT NOT NULL,
    offered        DOUBLE PRECISION NOT NULL,
    admitted       DOUBLE PRECISION NOT NULL,
    dropped        DOUBLE PRECISION NOT NULL,
    shadow_dropped DOUBLE PRECISION NOT NULL,
    max_offered    DOUBLE PRECISION NOT NULL,
    max_drop_ratio DOUBLE PRECISION NOT NULL,
    -- first and last tick time in the minute
    first_t        TIMESTAMPTZ NOT NULL,
    last_t         TIMESTAMPTZ NOT NULL,
    -- limit and mode of the latest report (by controller sequence) in the minute
    limit_rps      DOUBLE PRECISION NOT NULL,
    mode           TEXT NOT NULL,
    last_seq       BIGINT NOT NULL,
    PRIMARY KEY (service, bucket, minute, scope_key)
);
-- Overview and retention scan by time.
CREATE INDEX shadow_minutes_minute ON shadow_minutes (minute);

-- Existing reports keep counting in the new views.
INSERT INTO shadow_minutes (service, bucket, scope_key, minute, reports, offered, admitted,
                            dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t,
                            limit_rps, mode, last_seq)
SELECT service, bucket, scope_key, date_trunc('minute', t), COUNT(*), SUM(offered),
       SUM(admitted), SUM(dropped), SUM(shadow_dropped), MAX(offered), MAX(drop_ratio), MIN(t), MAX(t),
       (array_agg(limit_rps ORDER BY seq DESC))[1], (array_agg(mode ORDER BY seq DESC))[1],
       MAX(seq)
FROM shadow_reports
GROUP BY service, bucket, scope_key, date_trunc('minute', t);
