-- What the dashboard shows of an incident override, and when rlc saw it go: who added it, what
-- it does (`limit 50 rps`, `drop 90 %`), the region of the controller it was seen on, and
-- `gone_at`, the first poll of that region's controller that no longer listed it before its
-- expiry (removed early). Rows recorded before have empty texts and no `gone_at`: they end
-- shortly after rlc last saw them, as before.
ALTER TABLE override_windows ADD COLUMN who TEXT NOT NULL DEFAULT '';
ALTER TABLE override_windows ADD COLUMN action TEXT NOT NULL DEFAULT '';
ALTER TABLE override_windows ADD COLUMN region TEXT NOT NULL DEFAULT '';
ALTER TABLE override_windows ADD COLUMN gone_at TIMESTAMPTZ;
