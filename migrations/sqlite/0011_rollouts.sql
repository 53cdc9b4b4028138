-- Rollouts (`rollout:` in rlc/policies.yaml): one row per change that could refuse more
-- traffic and went out as a candidate. `doc` is the rollout as JSON (stages, stage, specs,
-- figures, reason); `state` is baking | done | aborted | superseded. Times in milliseconds.
CREATE TABLE rollouts (
    id         TEXT    PRIMARY KEY,
    service    TEXT    NOT NULL,
    bucket     TEXT    NOT NULL,
    state      TEXT    NOT NULL,
    created_ms INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL,
    doc        TEXT    NOT NULL
);
CREATE INDEX rollouts_bucket ON rollouts (service, bucket, created_ms);
CREATE INDEX rollouts_state ON rollouts (state);
-- The counts `GET /v1/candidates` of a controller (by region) reported for a candidate, the
-- last cumulative figures per controller process (`epoch`): a controller restart starts a new
-- epoch from zero, so the sum over epochs loses and double-counts nothing.
CREATE TABLE rollout_counts (
    rollout_id       TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    epoch            TEXT    NOT NULL,
    seconds          REAL    NOT NULL,
    offered          REAL    NOT NULL,
    virtual_dropped  REAL    NOT NULL,
    enforced_dropped REAL    NOT NULL,
    updated_ms       INTEGER NOT NULL,
    PRIMARY KEY (rollout_id, region, epoch)
);
