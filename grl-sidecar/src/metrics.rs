//! The sidecar's own series: requests by decision, refusals, upstream errors, malformed
//! requests, the concurrency limit's state (with `--concurrency-limit`) and its info.

use super::*;

#[derive(Debug)]
pub(super) struct StatsCollector {
    pub(super) stats: Arc<Stats>,
    pub(super) concurrency: Option<Arc<ConcurrencyLimiter>>,
    pub(super) info: [(&'static str, String); 4],
}

impl prometheus_client::collector::Collector for StatsCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        let s = &self.stats;
        let mut fam = encoder.encode_descriptor(
            "grl_sidecar_requests",
            "Requests decided by the sidecar, by protocol (http, grpc) and decision (admit, drop, shadow_drop: passed, counted as a drop shadow mode would make).",
            None,
            MetricType::Counter,
        )?;
        for (p, protocol) in PROTOCOLS.iter().enumerate() {
            for (d, decision) in DECISIONS.iter().enumerate() {
                ConstCounter::new(s.requests[p][d].load(Ordering::Relaxed)).encode(
                    fam.encode_family(&[("protocol", *protocol), ("decision", *decision)])?,
                )?;
            }
        }
        counters(
            &mut encoder,
            "grl_sidecar_refusals",
            "Requests the sidecar answered itself instead of the upstream, by reason: rate_limited (429, gRPC RESOURCE_EXHAUSTED), upstream_unreachable (502, UNAVAILABLE), upstream_timeout (504, DEADLINE_EXCEEDED), connection_share (503), overloaded (503, UNAVAILABLE: no slot under --concurrency-limit).",
            ("reason", &REFUSALS),
            &s.refusals,
        )?;
        counters(
            &mut encoder,
            "grl_sidecar_upstream_errors",
            "Requests the upstream did not answer, by kind: connect (no connection), timeout (no response head in time), other (the connection failed mid-request).",
            ("kind", &UPSTREAM_ERRORS),
            &s.upstream_errors,
        )?;
        counters(
            &mut encoder,
            "grl_sidecar_bad_requests",
            "Requests refused as malformed (400), before or instead of the upstream, by reason: target (a request target no upstream would read as meant), body (a request body cut short or malformed, such as a bad chunk size), identity (an identity header given twice).",
            ("reason", &BAD_REQUESTS),
            &s.bad_requests,
        )?;
        if let Some(c) = &self.concurrency {
            encode_concurrency(c.stats(), &mut encoder)?;
        }
        let mut fam = encoder.encode_descriptor(
            "grl_sidecar_info",
            "The sidecar's service, zone, region and upstream.",
            None,
            MetricType::Gauge,
        )?;
        let labels: Vec<(&str, grl_client::metrics::Label<'_>)> = self
            .info
            .iter()
            .map(|(k, v)| (*k, grl_client::metrics::Label(v)))
            .collect();
        ConstGauge::new(1i64).encode(fam.encode_family(&labels)?)?;
        Ok(())
    }
}

/// A counter family with one label: a series per value of `label`, counted in `values`.
fn counters(
    encoder: &mut prometheus_client::encoding::DescriptorEncoder,
    name: &str,
    help: &str,
    (label, names): (&str, &[&str]),
    values: &[AtomicU64],
) -> std::fmt::Result {
    use prometheus_client::encoding::EncodeMetric;
    use prometheus_client::metrics::counter::ConstCounter;
    use prometheus_client::metrics::MetricType;
    debug_assert_eq!(names.len(), values.len(), "{name}");
    let mut fam = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (n, v) in names.iter().zip(values) {
        ConstCounter::new(v.load(Ordering::Relaxed)).encode(fam.encode_family(&[(label, *n)])?)?;
    }
    Ok(())
}

/// The series of `--concurrency-limit` (only when it is on).
fn encode_concurrency(
    c: &grl_client::concurrency::Stats,
    encoder: &mut prometheus_client::encoding::DescriptorEncoder,
) -> std::fmt::Result {
    use prometheus_client::encoding::EncodeMetric;
    use prometheus_client::metrics::counter::ConstCounter;
    use prometheus_client::metrics::gauge::ConstGauge;
    use prometheus_client::metrics::MetricType;
    for (name, help, v) in [
        ("grl_sidecar_concurrency_limit", "The limit on requests in flight to the upstream (--concurrency-limit: learned, or fixed).", &c.limit),
        ("grl_sidecar_concurrency_in_flight", "Requests in flight to the upstream under the concurrency limit.", &c.in_flight),
        ("grl_sidecar_concurrency_queued", "Requests waiting for a slot under the concurrency limit.", &c.queued),
    ] {
        let fam = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
        ConstGauge::new(v.load(Ordering::Relaxed) as i64).encode(fam)?;
    }
    let mut fam = encoder.encode_descriptor(
        "grl_sidecar_overload_refusals",
        "Requests refused for overload (503, gRPC UNAVAILABLE) by criticality tier and reason: queue_timeout (no slot within --queue-timeout-ms), queue_full (the queue was full).",
        None,
        MetricType::Counter,
    )?;
    for tier in Criticality::ALL {
        for (r, reason) in ["queue_timeout", "queue_full"].iter().enumerate() {
            ConstCounter::new(c.refused[tier as usize][r].load(Ordering::Relaxed)).encode(
                fam.encode_family(&[("criticality", tier.as_str()), ("reason", *reason)])?,
            )?;
        }
    }
    let mut fam = encoder.encode_descriptor(
        "grl_sidecar_concurrency_waits",
        "Requests that waited for a slot under the concurrency limit and got one, by criticality tier.",
        None,
        MetricType::Counter,
    )?;
    for tier in Criticality::ALL {
        ConstCounter::new(c.waited[tier as usize].load(Ordering::Relaxed))
            .encode(fam.encode_family(&[("criticality", tier.as_str())])?)?;
    }
    let mut fam = encoder.encode_descriptor(
        "grl_sidecar_concurrency_wait_seconds",
        "The summed wait of those requests, by criticality tier (÷ the waits: the mean wait).",
        None,
        MetricType::Counter,
    )?;
    for tier in Criticality::ALL {
        let secs = c.waited_us[tier as usize].load(Ordering::Relaxed) as f64 / 1e6;
        ConstCounter::new(secs).encode(fam.encode_family(&[("criticality", tier.as_str())])?)?;
    }
    Ok(())
}
