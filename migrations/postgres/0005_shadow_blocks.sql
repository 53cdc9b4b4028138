-- Ten-minute roll-ups per (service, bucket), all scope keys together, written with the minute
-- roll-ups in the same statement: the overview sums them instead of every minute of every
-- scope key (at 10,000 buckets × 3 zones an hour is 1.8 million minute rows but 60,000
-- blocks), and the bucket page finds the last enforced period from them. Only sums, extrema
-- and counts, so an upsert keeps them exact however reports are batched.
CREATE TABLE shadow_blocks (
    service         TEXT NOT NULL,
    bucket          TEXT NOT NULL,
    -- start of the ten minutes (unix time a multiple of 600 s)
    block           TIMESTAMPTZ NOT NULL,
    reports         BIGINT NOT NULL,
    -- reports in mode enforce (the bucket page looks back for the last enforced minute)
    enforce_reports BIGINT NOT NULL,
    offered         DOUBLE PRECISION NOT NULL,
    admitted        DOUBLE PRECISION NOT NULL,
    dropped         DOUBLE PRECISION NOT NULL,
    shadow_dropped  DOUBLE PRECISION NOT NULL,
    max_offered     DOUBLE PRECISION NOT NULL,
    max_drop_ratio  DOUBLE PRECISION NOT NULL,
    first_t         TIMESTAMPTZ NOT NULL,
    last_t          TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (service, bucket, block)
);
-- Overview and retention scan by time.
CREATE INDEX shadow_blocks_block ON shadow_blocks (block);

INSERT INTO shadow_blocks (service, bucket, block, reports, enforce_reports, offered, admitted,
                           dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t)
SELECT service, bucket, to_timestamp(floor(extract(epoch FROM minute) / 600) * 600),
       SUM(reports), COALESCE(SUM(reports) FILTER (WHERE mode = 'enforce'), 0), SUM(offered),
       SUM(admitted), SUM(dropped), SUM(shadow_dropped), MAX(max_offered), MAX(max_drop_ratio),
       MIN(first_t), MAX(last_t)
FROM shadow_minutes
GROUP BY 1, 2, 3;
