-- The dashboard aggregates the reports received within a window (GET /, GET /v1/shadow):
-- without these indexes each request would scan every stored report.
CREATE INDEX shadow_reports_received_at ON shadow_reports (received_at);
CREATE INDEX shadow_reports_service_received_at ON shadow_reports (service, received_at);
