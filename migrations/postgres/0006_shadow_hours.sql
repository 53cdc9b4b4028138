-- Hourly roll-ups per (service, bucket, scope key), computed from the minute roll-ups by a
-- periodic pass (`Store::roll_up_hours`), not per report: the bucket page over long windows
-- reads one row per scope key and hour instead of sixty. Ingest marks every hour it writes
-- minutes in as dirty (`shadow_dirty_hours`); the pass recomputes a closed dirty hour from
-- its minutes and clears the mark in one transaction. Readers use the rows of an hour only
-- while it is not marked, else its minutes, so every figure stays exact.
CREATE TABLE shadow_hours (
    service        TEXT NOT NULL,
    bucket         TEXT NOT NULL,
    scope_key      TEXT NOT NULL,
    hour           TIMESTAMPTZ NOT NULL,
    -- sums and extrema of the hour's minute rows of this scope key
    reports        BIGINT NOT NULL,
    offered        DOUBLE PRECISION NOT NULL,
    admitted       DOUBLE PRECISION NOT NULL,
    dropped        DOUBLE PRECISION NOT NULL,
    shadow_dropped DOUBLE PRECISION NOT NULL,
    max_offered    DOUBLE PRECISION NOT NULL,
    max_drop_ratio DOUBLE PRECISION NOT NULL,
    first_t        TIMESTAMPTZ NOT NULL,
    last_t         TIMESTAMPTZ NOT NULL,
    -- per-minute average offered rates above zero: how many, their sum, lowest and highest
    -- (the suggested limit is computed from these, reading minutes only where needed)
    rates          BIGINT NOT NULL,
    rate_sum       DOUBLE PRECISION NOT NULL,
    rate_min       DOUBLE PRECISION NOT NULL,
    rate_max       DOUBLE PRECISION NOT NULL,
    -- highest per-minute average virtual-drop and drop rates (chart)
    max_vd_rps     DOUBLE PRECISION NOT NULL,
    max_drop_rps   DOUBLE PRECISION NOT NULL,
    -- the hour's newest minute of this scope key: its start, last tick, limit and mode
    last_minute    TIMESTAMPTZ NOT NULL,
    last_minute_t  TIMESTAMPTZ NOT NULL,
    limit_rps      DOUBLE PRECISION NOT NULL,
    mode           TEXT NOT NULL,
    -- of the bucket (all scope keys; the same in every scope key's row of the hour): minutes
    -- with a report, and the largest per-minute virtual-drop share with its minute
    bucket_minutes BIGINT NOT NULL,
    peak_share     DOUBLE PRECISION NOT NULL,
    peak_minute    TIMESTAMPTZ,
    PRIMARY KEY (service, bucket, hour, scope_key)
);
-- The pass and retention work by hour.
CREATE INDEX shadow_hours_hour ON shadow_hours (hour);

CREATE TABLE shadow_dirty_hours (
    hour  TIMESTAMPTZ PRIMARY KEY,
    -- batches that marked it (an update takes the row lock the pass waits for)
    marks BIGINT NOT NULL
);

-- Existing minutes: their hours are rolled up by the next passes (readers use the minutes
-- until then).
INSERT INTO shadow_dirty_hours (hour, marks)
SELECT DISTINCT date_trunc('hour', minute AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', 1 FROM shadow_minutes;

-- Every minute row and block is updated once per report batch: room on each page lets
-- Postgres update in place (HOT) instead of adding index entries for every new version.
ALTER TABLE shadow_minutes SET (fillfactor = 70);
ALTER TABLE shadow_blocks SET (fillfactor = 70);
