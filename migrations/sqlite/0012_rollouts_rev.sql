-- Each rollout row's revision: a process writes a rollout only over the revision it read
-- (`UPDATE … WHERE rev = $read`, then `rev + 1`), so `rlc run --once` beside `rlc serve`
-- never overwrites the other's newer write with a stale copy.
ALTER TABLE rollouts ADD COLUMN rev INTEGER NOT NULL DEFAULT 0;
