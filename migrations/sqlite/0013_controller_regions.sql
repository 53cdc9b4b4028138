-- Whether rlc could read each region's controller (`controller:` / `controllers:` in rlc.yaml):
-- one row per region, written at each report poll. A region whose controller could not be
-- read has `unread_since` (the first failed poll since the last good one) and `error`; every
-- view of the shadow figures then says they are incomplete, and no candidate is promoted on
-- them. Reports of several regions are told apart by their scope key (`global@<region>`).
-- Times in milliseconds (UTC).
CREATE TABLE controller_regions (
    region       TEXT PRIMARY KEY,
    read_at      INTEGER,
    unread_since INTEGER,
    error        TEXT
);
