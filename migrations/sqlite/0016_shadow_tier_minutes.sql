-- Requests per minute and criticality tier of each bucket, all scope keys together, from the
-- `counts.tiers` of the controllers' report rows. See the Postgres migration. Times are
-- integer unix milliseconds.
CREATE TABLE shadow_tier_minutes (
    service        TEXT NOT NULL,
    bucket         TEXT NOT NULL,
    minute         INTEGER NOT NULL,
    tier           TEXT NOT NULL,
    offered        REAL NOT NULL,
    admitted       REAL NOT NULL,
    dropped        REAL NOT NULL,
    shadow_dropped REAL NOT NULL,
    PRIMARY KEY (service, bucket, minute, tier)
);
CREATE INDEX shadow_tier_minutes_minute ON shadow_tier_minutes (minute);
