-- Ten-minute roll-ups per (service, bucket), all scope keys together, written with the minute
-- roll-ups in the same transaction: the overview sums them instead of every minute of every
-- scope key, and the bucket page finds the last enforced period from them. Only sums,
-- extrema and counts, so an upsert keeps them exact however reports are batched. Times are
-- integer unix milliseconds.
CREATE TABLE shadow_blocks (
    service         TEXT NOT NULL,
    bucket          TEXT NOT NULL,
    block           INTEGER NOT NULL,
    reports         INTEGER NOT NULL,
    enforce_reports INTEGER NOT NULL,
    offered         REAL NOT NULL,
    admitted        REAL NOT NULL,
    dropped         REAL NOT NULL,
    shadow_dropped  REAL NOT NULL,
    max_offered     REAL NOT NULL,
    max_drop_ratio  REAL NOT NULL,
    first_t         INTEGER NOT NULL,
    last_t          INTEGER NOT NULL,
    PRIMARY KEY (service, bucket, block)
);
CREATE INDEX shadow_blocks_block ON shadow_blocks (block);

INSERT INTO shadow_blocks (service, bucket, block, reports, enforce_reports, offered, admitted,
                           dropped, shadow_dropped, max_offered, max_drop_ratio, first_t, last_t)
SELECT service, bucket, (minute / 600000) * 600000, SUM(reports),
       SUM(CASE WHEN mode = 'enforce' THEN reports ELSE 0 END), SUM(offered), SUM(admitted),
       SUM(dropped), SUM(shadow_dropped), MAX(max_offered), MAX(max_drop_ratio), MIN(first_t),
       MAX(last_t)
FROM shadow_minutes
GROUP BY service, bucket, (minute / 600000) * 600000;
