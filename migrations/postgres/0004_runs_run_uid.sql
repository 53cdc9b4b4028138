-- The id rlc gives a run when it is asked for (POST /v1/runs answers it) or started, so that
-- GET /v1/runs/{id} finds the run once it is recorded. Null for runs recorded before.
ALTER TABLE runs ADD COLUMN run_uid TEXT;
CREATE UNIQUE INDEX runs_run_uid ON runs (run_uid);
