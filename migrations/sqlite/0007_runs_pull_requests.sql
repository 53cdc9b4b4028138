-- The pull (merge) request a run opened or updated: its number and web page (null when the
-- run opened none, or for runs recorded before). A quota change proposed through a pull
-- request carries it too (null when it was committed on the base branch directly), so the
-- dashboard links a bucket's change to the pull request that carries it.
ALTER TABLE runs ADD COLUMN pr_number INTEGER;
ALTER TABLE runs ADD COLUMN pr_url TEXT;
ALTER TABLE quota_history ADD COLUMN pr_number INTEGER;
ALTER TABLE quota_history ADD COLUMN pr_url TEXT;
