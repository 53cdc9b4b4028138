//! Metrics of every binary, through one registry crate (`prometheus-client`): its OpenMetrics
//! text encoder writes `/metrics` for the controller, the aggregators, `rlc serve` and the
//! registry an embedding service serves for its [`GrlClient`](crate::client::GrlClient).
//!
//! What lives here is the little the crate leaves to its users:
//! - [`Label`]: a label value escaped as the text format requires (`\` → `\\`, `"` → `\"`,
//!   line feed → `\n`). `prometheus-client` writes label values as they are, and bucket,
//!   caller and procedure names come from config files: a hostile name must not be able to
//!   break a scrape or forge a series.
//! - [`register_build_info`]: `<prefix>_build_info{version,component}` = 1 on every binary.
//! - [`encode`] / [`response`]: the registry (and collectors evaluated at scrape time) as the
//!   body of `GET /metrics`.
//!
//! Per-bucket series are not kept in the registry: a [`Collector`] reads them from the state
//! that already holds them (the controller's engine, the aggregator's client map) when
//! Prometheus scrapes, so a bucket removed from the config disappears from `/metrics` and
//! nothing is updated per request.

use std::fmt::Write as _;

use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

pub use prometheus_client;

/// `Content-Type` of the OpenMetrics text format (Prometheus negotiates and parses it).
pub const CONTENT_TYPE_OPENMETRICS: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Buckets (seconds) of the latency histograms: 1 ms … ~30 s.
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

/// Buckets (seconds) of run-length histograms (rlc runs, history pulls): 0.1 s … ~1 h.
pub const RUN_BUCKETS: [f64; 12] = [
    0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0,
];

/// A label value, escaped when encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Label<'a>(pub &'a str);

impl EncodeLabelValue for Label<'_> {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        write_escaped(encoder, self.0)
    }
}

/// Writes `v` with `\`, `"` and line feeds escaped, in runs of plain characters.
fn write_escaped(w: &mut impl std::fmt::Write, v: &str) -> std::fmt::Result {
    let mut start = 0;
    for (i, c) in v.char_indices() {
        let esc = match c {
            '\\' => "\\\\",
            '"' => "\\\"",
            '\n' => "\\n",
            _ => continue,
        };
        w.write_str(&v[start..i])?;
        w.write_str(esc)?;
        start = i + c.len_utf8();
    }
    w.write_str(&v[start..])
}

/// Registers `<prefix>_build_info{component, version}` = 1 (`prefix` is `grl` or `rlc`).
pub fn register_build_info(reg: &mut Registry, prefix: &str, component: &'static str) {
    #[derive(Debug)]
    struct BuildInfo {
        name: String,
        component: &'static str,
    }
    impl prometheus_client::collector::Collector for BuildInfo {
        fn encode(
            &self,
            mut encoder: prometheus_client::encoding::DescriptorEncoder,
        ) -> std::fmt::Result {
            use prometheus_client::encoding::EncodeMetric;
            let mut fam = encoder.encode_descriptor(
                &self.name,
                "1, labelled with the running version and component.",
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            let labels = [
                ("component", Label(self.component)),
                ("version", Label(env!("CARGO_PKG_VERSION"))),
            ];
            ConstGauge::new(1i64).encode(fam.encode_family(&labels)?)
        }
    }
    reg.register_collector(Box::new(BuildInfo {
        name: format!("{prefix}_build_info"),
        component,
    }));
}

/// The OpenMetrics text of `reg` (collectors are evaluated now), `# EOF` included.
pub fn encode(reg: &Registry) -> String {
    let mut out = String::with_capacity(4096);
    // Writing to a String cannot fail; a collector's own error would end the text early,
    // which Prometheus reports as a failed scrape (no `# EOF`).
    if prometheus_client::encoding::text::encode(&mut out, reg).is_err() {
        let _ = writeln!(out);
    }
    out
}

/// `GET /metrics`: `reg` as OpenMetrics text.
pub fn response(reg: &Registry) -> impl IntoResponse {
    ([(CONTENT_TYPE, CONTENT_TYPE_OPENMETRICS)], encode(reg))
}

/// A gauge = 1 labelled with one changing value (a version): one series at a time, the
/// value escaped. Clones share the value.
#[derive(Debug, Clone)]
pub struct InfoGauge {
    name: &'static str,
    help: &'static str,
    label: &'static str,
    value: std::sync::Arc<std::sync::RwLock<Option<String>>>,
}

impl InfoGauge {
    /// `name{label="…"} 1`, absent until [`InfoGauge::set`].
    pub fn new(name: &'static str, help: &'static str, label: &'static str) -> InfoGauge {
        InfoGauge {
            name,
            help,
            label,
            value: Default::default(),
        }
    }

    /// Sets the label value (the series with the previous value disappears).
    pub fn set(&self, value: &str) {
        let mut v = self.value.write().expect("info lock");
        if v.as_deref() != Some(value) {
            *v = Some(value.to_string());
        }
    }
}

impl prometheus_client::collector::Collector for InfoGauge {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        let v = self.value.read().expect("info lock");
        let mut fam = encoder.encode_descriptor(
            self.name,
            self.help,
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        if let Some(v) = v.as_deref() {
            ConstGauge::new(1i64).encode(fam.encode_family(&[(self.label, Label(v))])?)?;
        }
        Ok(())
    }
}

/// The controller's per-bucket series, read from its engine at every scrape:
///
/// - `grl_requests_{offered,admitted,dropped,shadow_dropped}_total{service,bucket,caller,procedure,zone}`
/// - `grl_drop_ratio{service,bucket,caller,procedure,zone,scope_key}`
/// - `grl_bucket_limit_rps{service,bucket}` (the limit in force, overrides included)
/// - `grl_bucket_info{service,bucket,caller,procedure,mode,scope,policy}` = 1
/// - `grl_config_info{version}` = 1 and `grl_controller_zones` (zones reporting)
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
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::MetricType;
        let e = self.engine.lock().expect("engine lock");
        fn ids(b: &crate::engine::BucketState) -> [(&'static str, Label<'_>); 4] {
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
        for (i, (name, help)) in REQUEST_COUNTERS.iter().enumerate() {
            let mut fam = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (b, zone, t) in e.totals() {
                let [s, n, c, p] = ids(b);
                let labels = [s, n, c, p, ("zone", Label(zone))];
                ConstCounter::new(t[i]).encode(fam.encode_family(&labels)?)?;
            }
        }
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
        let mut fam = encoder.encode_descriptor(
            "grl_config_info",
            "1, labelled with the config version the controller serves.",
            None,
            MetricType::Gauge,
        )?;
        let version = [("version", Label(&e.base_config().version))];
        ConstGauge::new(1i64).encode(fam.encode_family(&version)?)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let active: Vec<_> = e.overrides().iter().filter(|o| o.active(now)).collect();
        let kind =
            |o: &crate::overrides::Override| if o.is_traffic() { "traffic" } else { "bucket" };
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
        let fam = encoder.encode_descriptor(
            "grl_controller_zones",
            "Zones (aggregators) heard from within the zone TTL.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(e.zones_reporting() as i64).encode(fam)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_as_the_text_format_requires() {
        let check = |v: &str, want: &str| {
            let mut s = String::new();
            write_escaped(&mut s, v).unwrap();
            assert_eq!(s, want, "{v:?}");
        };
        check("plain", "plain");
        check("", "");
        check("a\"b", "a\\\"b");
        check("x\\", "x\\\\");
        check("l1\nl2", "l1\\nl2");
        check("é\"\n\\ü", "é\\\"\\n\\\\ü");
    }

    #[test]
    fn build_info_names_the_component_and_version() {
        let mut reg = Registry::default();
        register_build_info(&mut reg, "grl", "controller");
        let text = encode(&reg);
        assert!(text.contains("# TYPE grl_build_info gauge"), "{text}");
        let want = format!(
            "grl_build_info{{component=\"controller\",version=\"{}\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        );
        assert!(text.contains(&want), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
