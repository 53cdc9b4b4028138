-- The regions whose controller (`controller:` / `controllers:` in rlc.yaml) rlc could not read
-- at its last report poll: a row from the first failed poll since the last good one
-- (`unread_since`) with the latest `error`, deleted by the next good poll. While a region has
-- a row every view of the shadow figures says they are incomplete, and no candidate is
-- promoted on them. Reports of several regions are told apart by their scope key
-- (`global@<region>`).
CREATE TABLE controller_regions (
    region       TEXT PRIMARY KEY,
    unread_since TIMESTAMPTZ NOT NULL,
    error        TEXT NOT NULL
);
