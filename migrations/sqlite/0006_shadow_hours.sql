-- Hourly roll-ups per (service, bucket, scope key), computed from the minute roll-ups by a
-- periodic pass (`Store::roll_up_hours`), not per report. Ingest marks every hour it writes
-- minutes in as dirty (`shadow_dirty_hours`); the pass recomputes a closed dirty hour from
-- its minutes and clears the mark in one transaction; readers use the rows of an hour only
-- while it is not marked, else its minutes. Times are integer unix milliseconds. See the
-- Postgres migration for the columns.
CREATE TABLE shadow_hours (
    service        TEXT NOT NULL,
    bucket         TEXT NOT NULL,
    scope_key      TEXT NOT NULL,
    hour           INTEGER NOT NULL,
    reports        INTEGER NOT NULL,
    offered        REAL NOT NULL,
    admitted       REAL NOT NULL,
    dropped        REAL NOT NULL,
    shadow_dropped REAL NOT NULL,
    max_offered    REAL NOT NULL,
    max_drop_ratio REAL NOT NULL,
    first_t        INTEGER NOT NULL,
    last_t         INTEGER NOT NULL,
    rates          INTEGER NOT NULL,
    rate_sum       REAL NOT NULL,
    rate_min       REAL NOT NULL,
    rate_max       REAL NOT NULL,
    max_vd_rps     REAL NOT NULL,
    max_drop_rps   REAL NOT NULL,
    last_minute    INTEGER NOT NULL,
    last_minute_t  INTEGER NOT NULL,
    limit_rps      REAL NOT NULL,
    mode           TEXT NOT NULL,
    bucket_minutes INTEGER NOT NULL,
    peak_share     REAL NOT NULL,
    peak_minute    INTEGER,
    PRIMARY KEY (service, bucket, hour, scope_key)
);
CREATE INDEX shadow_hours_hour ON shadow_hours (hour);

CREATE TABLE shadow_dirty_hours (
    hour  INTEGER PRIMARY KEY,
    marks INTEGER NOT NULL
);

INSERT INTO shadow_dirty_hours (hour, marks)
SELECT DISTINCT (minute / 3600000) * 3600000, 1 FROM shadow_minutes;
