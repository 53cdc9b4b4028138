-- Proposals and applied changes are different records: a change rlc only proposed (pushed to
-- the pull-request branch, waiting for review) has not changed the limit in force, so it must
-- not count toward `rails.decrease_interval` nor show on the dashboard as a change of the
-- limit. `applied`: committed on the base branch (or merged); `proposed`: on the pull-request
-- branch. Rows recorded before carry `applied`, except those a pull request carried or a run
-- pushed to the pull-request branch.
ALTER TABLE quota_history ADD COLUMN state TEXT NOT NULL DEFAULT 'applied';
UPDATE quota_history SET state = 'proposed'
WHERE pr_number IS NOT NULL
   OR run_id IN (SELECT id FROM runs WHERE services LIKE '%"outcome":"pushed branch%'
                                      OR services LIKE '%"outcome":"branch % already up to date%');
-- The decrease guard asks for the applied decreases of a window, every bucket at once.
CREATE INDEX quota_history_recorded_at ON quota_history (recorded_at);
