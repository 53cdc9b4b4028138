//! Metrics of every binary, through one registry crate (`prometheus-client`): its OpenMetrics
//! text encoder writes `/metrics` for the controller, the aggregators, `rlc serve` and the
//! registry an embedding service serves for its [`GrlClient`](crate::client::GrlClient)
//! (the `grl` binary adds the `GET /metrics` answer and the controller's collector).
//!
//! What lives here is the little the crate leaves to its users:
//! - [`Label`]: a label value escaped as the text format requires (`\` → `\\`, `"` → `\"`,
//!   line feed → `\n`). `prometheus-client` writes label values as they are, and bucket,
//!   caller and procedure names come from config files: a hostile name must not be able to
//!   break a scrape or forge a series.
//! - [`register_build_info`]: `<prefix>_build_info{version,component}` = 1 on every binary.
//! - [`encode`]: the registry (and collectors evaluated at scrape time) as the body of
//!   `GET /metrics`.
//!
//! Per-bucket series are not kept in the registry: a `Collector` reads them from the state
//! that already holds them (the controller's engine, the aggregator's client map) when
//! Prometheus scrapes, so a bucket removed from the config disappears from `/metrics` and
//! nothing is updated per request.

use std::fmt::Write as _;

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
