-- Requests per minute and criticality tier of each bucket, all scope keys together, from the
-- `counts.tiers` of the controllers' report rows. Written with the minute roll-ups, in the
-- same transaction and for the same new reports only; sums only, so an upsert stays exact
-- however reports are batched. Kept as long as the minute roll-ups. A bucket's clients that
-- count no tiers leave no row here: the whole is in `shadow_minutes`.
CREATE TABLE shadow_tier_minutes (
    service        TEXT NOT NULL,
    bucket         TEXT NOT NULL,
    minute         TIMESTAMPTZ NOT NULL,
    -- CRITICAL_PLUS, CRITICAL, SHEDDABLE_PLUS or SHEDDABLE
    tier           TEXT NOT NULL,
    offered        DOUBLE PRECISION NOT NULL,
    admitted       DOUBLE PRECISION NOT NULL,
    dropped        DOUBLE PRECISION NOT NULL,
    shadow_dropped DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (service, bucket, minute, tier)
);
-- Retention scans by time.
CREATE INDEX shadow_tier_minutes_minute ON shadow_tier_minutes (minute);
