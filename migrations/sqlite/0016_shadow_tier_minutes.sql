-- Requests per minute of each bucket by criticality tier, from the reports' `counts.tiers`.
-- See the Postgres migration. Times are integer unix milliseconds.
CREATE TABLE shadow_tier_minutes (
    service TEXT NOT NULL,
    bucket  TEXT NOT NULL,
    minute  INTEGER NOT NULL,
    sheddable_offered REAL NOT NULL DEFAULT 0,
    sheddable_dropped REAL NOT NULL DEFAULT 0,
    sheddable_shadow_dropped REAL NOT NULL DEFAULT 0,
    sheddable_plus_offered REAL NOT NULL DEFAULT 0,
    sheddable_plus_dropped REAL NOT NULL DEFAULT 0,
    sheddable_plus_shadow_dropped REAL NOT NULL DEFAULT 0,
    critical_offered REAL NOT NULL DEFAULT 0,
    critical_dropped REAL NOT NULL DEFAULT 0,
    critical_shadow_dropped REAL NOT NULL DEFAULT 0,
    critical_plus_offered REAL NOT NULL DEFAULT 0,
    critical_plus_dropped REAL NOT NULL DEFAULT 0,
    critical_plus_shadow_dropped REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (service, bucket, minute)
);
CREATE INDEX shadow_tier_minutes_minute ON shadow_tier_minutes (minute);
