//! The `GET /metrics` answer of every daemon. The shared parts (escaped labels, build info,
//! the OpenMetrics encoder) are `grl_client::metrics`.

use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use grl_client::metrics::{encode, CONTENT_TYPE_OPENMETRICS};
use prometheus_client::registry::Registry;

/// `GET /metrics`: `reg` as OpenMetrics text.
pub fn response(reg: &Registry) -> impl IntoResponse {
    ([(CONTENT_TYPE, CONTENT_TYPE_OPENMETRICS)], encode(reg))
}
