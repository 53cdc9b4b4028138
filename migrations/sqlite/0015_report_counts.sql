-- Controllers now send, with each report row, the requests their zones counted for it since
-- the row before (exact), beside the rates of the moment. `offered`, `admitted`, `dropped` and
-- `shadow_dropped` then hold those counts (so sums are the requests counted), and
-- `offered_rate` the offered rate, from which the roll-ups take the busiest second. Rows of
-- controllers without counts keep their rates in both (as before, `offered_rate` null).
ALTER TABLE shadow_reports ADD COLUMN offered_rate REAL;
