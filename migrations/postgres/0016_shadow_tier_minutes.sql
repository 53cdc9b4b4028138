-- Requests per minute of each bucket by criticality tier, all scope keys together, from the
-- `counts.tiers` of the controllers' report rows: one row per bucket and minute (one upsert
-- per bucket and minute whatever the number of tiers), with, for each tier, the requests
-- offered, dropped and virtually dropped (admitted = offered - dropped). Written with the
-- minute roll-ups, in the same transaction and for the same new reports only; sums only, so
-- an upsert stays exact however reports are batched. Kept as long as the minute roll-ups. A
-- bucket whose clients count no tiers has no row here: the whole is in `shadow_minutes`.
CREATE TABLE shadow_tier_minutes (
    service TEXT NOT NULL,
    bucket  TEXT NOT NULL,
    minute  TIMESTAMPTZ NOT NULL,
    sheddable_offered DOUBLE PRECISION NOT NULL DEFAULT 0,
    sheddable_dropped DOUBLE PRECISION NOT NULL DEFAULT 0,
    sheddable_shadow_dropped DOUBLE PRECISION NOT NULL DEFAULT 0,
    sheddable_plus_offered DOUBLE PRECISION NOT NULL DEFAULT 0,
    sheddable_plus_dropped DOUBLE PRECISION NOT NULL DEFAULT 0,
    sheddable_plus_shadow_dropped DOUBLE PRECISION NOT NULL DEFAULT 0,
    critical_offered DOUBLE PRECISION NOT NULL DEFAULT 0,
    critical_dropped DOUBLE PRECISION NOT NULL DEFAULT 0,
    critical_shadow_dropped DOUBLE PRECISION NOT NULL DEFAULT 0,
    critical_plus_offered DOUBLE PRECISION NOT NULL DEFAULT 0,
    critical_plus_dropped DOUBLE PRECISION NOT NULL DEFAULT 0,
    critical_plus_shadow_dropped DOUBLE PRECISION NOT NULL DEFAULT 0,
    PRIMARY KEY (service, bucket, minute)
);
-- Retention and the critical peaks scan by time.
CREATE INDEX shadow_tier_minutes_minute ON shadow_tier_minutes (minute);
