//! Metrics of the `grl` binary's tiers: the shared parts (escaped [`Label`]s, build info, the
//! OpenMetrics encoder) are `grl_client::metrics`, re-exported here; this module adds the
//! `GET /metrics` answer and the controller's per-bucket collector.
//!
//! Per-bucket series are not kept in the registry: a [`Collector`] reads them from the state
//! that already holds them (the controller's engine, the aggregator's client map) when
//! Prometheus scrapes, so a bucket removed from the config disappears from `/metrics` and
//! nothing is updated per request.
//!
//! [`Collector`]: prometheus_client::collector::Collector

use std::fmt::Write as _;

use grl_client::metrics::Label;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

use crate::engine::{BucketState, Engine};

/// The controller's per-bucket series, read from its engine at every scrape:
///
/// - `grl_requests_{offered,admitted,dropped,shadow_dropped}_total{service,bucket,caller,procedure,zone,criticality}`
/// - `grl_drop_ratio{service,bucket,caller,procedure,zone,scope_key}`
/// - `grl_bucket_limit_rps{service,bucket}` (the limit in force, overrides included)
/// - `grl_bucket_info{service,bucket,caller,procedure,mode,scope,policy}` = 1
/// - `grl_config_info{version}` = 1 and `grl_controller_zones` (zones reporting)
/// - `grl_candidate_{offered,virtual_dropped}_total{service,bucket}` and `grl_candidates`
///   (candidate limits, see [`crate::engine::Engine::evaluate_candidates`])
///
/// The counters carry no `mode` label: a bucket moved from shadow to enforce keeps one
/// series per counter; its mode is `grl_bucket_info`'s (join `on(service, bucket)`).
pub struct EngineCollector {
    engine: std::sync::Arc<std::sync::Mutex<crate::engine::Engine>>,
}

impl EngineCollector {
    /// A collector over `engine` (locked for the length of one scrape).
    pub fn new(engine: std::sync::Arc<std::sync::Mutex<crate::engine::Engine>>) -> Self {
        EngineCollector { engine }
    }
}

impl std::fmt::Debug for EngineCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineCollector")
    }
}

const REQUEST_COUNTERS: [(&str, &str); 4] = [
    (
        "grl_requests_offered",
        "Requests offered to a bucket (before dropping).",
    ),
    (
        "grl_requests_admitted",
        "Requests admitted (shadow drops included).",
    ),
    ("grl_requests_dropped", "Requests dropped in enforce mode."),
    (
        "grl_requests_shadow_dropped",
        "Requests that shadow mode would have dropped.",
    ),
];

impl prometheus_client::collector::Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let e = self.engine.lock().expect("engine lock");
        encode_request_counters(&e, &mut encoder)?;
        encode_drop_ratios(&e, &mut encoder)?;
        encode_bucket_limits(&e, &mut encoder)?;
        encode_bucket_info(&e, &mut encoder)?;
        encode_config_info(&e, &mut encoder)?;
        encode_overrides(&e, &mut encoder)?;
        encode_candidates(&e, &mut encoder)?;
        encode_zones(&e, &mut encoder)
    }
}

/// A bucket's identifying labels: service, bucket, caller and procedure.
fn ids(b: &BucketState) -> [(&'static str, Label<'_>); 4] {
    [
        ("service", Label(b.service.as_str())),
        ("bucket", Label(b.bucket.name.as_str())),
        ("caller", Label(b.bucket.caller.as_deref().unwrap_or(""))),
        (
            "procedure",
            Label(b.bucket.procedure.as_deref().unwrap_or("")),
        ),
    ]
}

/// `grl_requests_*_total`, one series per bucket, zone and criticality tier that counted
/// requests: `criticality` is the tier's name, or empty (no label, to Prometheus) for the
/// requests of clients that do not count tiers.
fn encode_request_counters(e: &Engine, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    for (i, (name, help)) in REQUEST_COUNTERS.iter().enumerate() {
        let mut fam = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for (b, zone, split) in e.totals() {
            for (j, t) in split.iter().enumerate() {
                if t.iter().all(|&x| x == 0) {
                    continue;
                }
                let tier = schema::Criticality::from_index(j).map_or("", |c| c.as_str());
                let [s, n, c, p] = ids(b);
                let labels = [
                    s,
                    n,
                    c,
                    p,
                    ("zone", Label(zone)),
                    ("criticality", Label(tier)),
                ];
                ConstCounter::new(t[i]).encode(fam.encode_family(&labels)?)?;
            }
        }
    }
    Ok(())
}

/// `grl_drop_ratio`, one series per bucket and scope key.
fn encode_drop_ratios(e: &Engine, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let mut fam = encoder.encode_descriptor(
        "grl_drop_ratio",
        "Drop ratio in force per bucket and scope key.",
        None,
        MetricType::Gauge,
    )?;
    for b in e.buckets() {
        for k in &b.keys {
            let zone = k.scope_key.strip_prefix("zone:").unwrap_or("");
            let [s, n, c, p] = ids(b);
            let labels = [
                s,
                n,
                c,
                p,
                ("zone", Label(zone)),
                ("scope_key", Label(&k.scope_key)),
            ];
            ConstGauge::new(k.ratio).encode(fam.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// `grl_bucket_limit_rps`, one series per bucket.
fn encode_bucket_limits(e: &Engine, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let mut fam = encoder.encode_descriptor(
        "grl_bucket_limit_rps",
        "Limit in force (requests/s), incident overrides included.",
        None,
        MetricType::Gauge,
    )?;
    for b in e.buckets() {
        let [s, n, ..] = ids(b);
        ConstGauge::new(b.limit_rps).encode(fam.encode_family(&[s, n])?)?;
    }
    Ok(())
}

/// `grl_bucket_info`, 1 per bucket with its mode, scope and policy.
fn encode_bucket_info(e: &Engine, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let mut fam = encoder.encode_descriptor(
        "grl_bucket_info",
        "1 per bucket, labelled with its mode (enforce|shadow), scope and policy.",
        None,
        MetricType::Gauge,
    )?;
    let mut policy = String::new();
    for b in e.buckets() {
        policy.clear();
        let _ = write!(policy, "{}", b.bucket.policy);
        let [s, n, c, p] = ids(b);
        let labels = [
            s,
            n,
            c,
            p,
            ("mode", Label(b.bucket.mode.as_str())),
            ("scope", Label(b.bucket.scope.as_str())),
            ("policy", Label(&policy)),
        ];
        ConstGauge::new(1i64).encode(fam.encode_family(&labels)?)?;
    }
    Ok(())
}

/// `grl_config_info{version}` = 1.
fn encode_config_info(e: &Engine, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let mut fam = encoder.encode_descriptor(
        "grl_config_info",
        "1, labelled with the config version the controller serves.",
        None,
        MetricType::Gauge,
    )?;
    let version = [("version", Label(&e.base_config().version))];
    ConstGauge::new(1i64).encode(fam.encode_family(&version)?)
}

/// `grl_overrides_active` by kind and `grl_override_expires_in_seconds` per override in force.
fn encode_overrides(e: &Engine, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let active: Vec<_> = e.overrides().iter().filter(|o| o.active(now)).collect();
    let kind = |o: &crate::overrides::Override| if o.is_traffic() { "traffic" } else { "bucket" };
    let mut fam = encoder.encode_descriptor(
        "grl_overrides_active",
        "Incident overrides in force, by kind (bucket: one bucket's limit; traffic: a caller's or procedure's traffic as a whole).",
        None,
        MetricType::Gauge,
    )?;
    for k in ["bucket", "traffic"] {
        let n = active.iter().filter(|o| kind(o) == k).count();
        ConstGauge::new(n as i64).encode(fam.encode_family(&[("kind", Label(k))])?)?;
    }
    let mut fam = encoder.encode_descriptor(
        "grl_override_expires_in_seconds",
        "Seconds until each override in force expires (at most --max-overrides series).",
        None,
        MetricType::Gauge,
    )?;
    for o in &active {
        let labels = [("id", Label(o.id.as_str())), ("kind", Label(kind(o)))];
        ConstGauge::new(o.expires_at.saturating_sub(now) as i64)
            .encode(fam.encode_family(&labels)?)?;
    }
    Ok(())
}

/// `grl_candidate_{offered,virtual_dropped}_total` per replaced bucket, and `grl_candidates`.
fn encode_candidates(e: &Engine, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let mut fam = encoder.encode_descriptor(
        "grl_candidate_offered",
        "Requests offered to candidate limits' matches while evaluated (rate x tick length, summed over scope keys), by the bucket they would replace.",
        None,
        MetricType::Counter,
    )?;
    for (s, b, t) in e.candidate_totals() {
        let labels = [("service", Label(s)), ("bucket", Label(b))];
        ConstCounter::new(t[0]).encode(fam.encode_family(&labels)?)?;
    }
    let mut fam = encoder.encode_descriptor(
        "grl_candidate_virtual_dropped",
        "Requests candidate limits would have dropped (their drop ratio per scope key), by the bucket they would replace; nothing was dropped.",
        None,
        MetricType::Counter,
    )?;
    for (s, b, t) in e.candidate_totals() {
        let labels = [("service", Label(s)), ("bucket", Label(b))];
        ConstCounter::new(t[1]).encode(fam.encode_family(&labels)?)?;
    }
    let fam = encoder.encode_descriptor(
        "grl_candidates",
        "Candidate limits evaluated beside the limits in force.",
        None,
        MetricType::Gauge,
    )?;
    ConstGauge::new(e.candidates().count() as i64).encode(fam)
}

/// `grl_controller_zones`: zones whose reports count in the sums.
fn encode_zones(e: &Engine, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let fam = encoder.encode_descriptor(
        "grl_controller_zones",
        "Zones (aggregators) whose reports count in the sums (heard from within 3 of their forwarding intervals, at least 3 ticks).",
        None,
        MetricType::Gauge,
    )?;
    ConstGauge::new(e.zones_reporting() as i64).encode(fam)
}
