//! The bounds of [`Builder`]: series per pull, runs per series in the spill.

use super::*;

fn metric(labels: &[(&str, &str)]) -> BTreeMap<String, String> {
    labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Feeds one series with a sample at the first step, as a decoder does.
fn feed(b: &mut Builder, labels: &[(&str, &str)]) {
    if let Some(k) = b.key(&metric(labels)) {
        b.add_many(&k, std::iter::once((1000.0, 1.0)));
    }
}

#[test]
fn a_pull_takes_at_most_max_series_label_sets() {
    for spill in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let b = if spill {
            Builder::spilled(1000, 60, 10, LabelNames::default(), dir.path()).unwrap()
        } else {
            Builder::new(1000, 60, 10, LabelNames::default())
        };
        let mut b = b.bounded(5, 100);
        // Three series, each listed again (as every request of a pull lists them), and two
        // rejected ones (one without a caller, listed twice): five label sets, within.
        for _ in 0..3 {
            for c in ["a", "b", "c"] {
                feed(&mut b, &[("service", "s"), ("caller", c)]);
            }
            feed(&mut b, &[("service", "s")]);
            feed(&mut b, &[("caller", "nobody")]);
        }
        assert_eq!(b.exceeded(), None);
        // A sixth label set (a key seen before, with one more label) is one too many: it is
        // not taken, nor anything after it.
        feed(&mut b, &[("service", "s"), ("caller", "a"), ("pod", "p2")]);
        assert_eq!(b.exceeded(), Some(&Bound::Series(5)));
        feed(&mut b, &[("service", "s"), ("caller", "d")]);
        assert_eq!(b.key(&metric(&[("service", "s"), ("caller", "a")])), None);
        if spill {
            let h = b.finish_spilled().unwrap();
            assert_eq!(h.series_count(), 3);
        } else {
            let h = b.finish();
            assert_eq!(h.series.len(), 3, "{:?}", h.series.keys());
            assert_eq!(h.rejected.len(), 2, "{:?}", h.rejected);
        }
    }
}

#[test]
fn a_series_repeated_in_answers_is_refused_in_the_spill() {
    let dir = tempfile::tempdir().unwrap();
    // Two requests × one attempt: two runs per series at most.
    let mut b = Builder::spilled(1000, 60, 10, LabelNames::default(), dir.path())
        .unwrap()
        .bounded(100, 2);
    let web = [("service", "s"), ("caller", "web")];
    feed(&mut b, &web);
    feed(&mut b, &web);
    assert_eq!(b.exceeded(), None);
    feed(&mut b, &web);
    assert_eq!(
        b.exceeded(),
        Some(&Bound::Repeated {
            series: "s/web".into(),
            max: 2
        })
    );
    let e = HistoryError::Exceeded {
        url: "http://p:9090".into(),
        request: request_range("remote read", 0, 86_400),
        bound: b.exceeded().unwrap().clone(),
    };
    assert_eq!(
        e.to_string(),
        "prometheus at http://p:9090: series s/web comes more than 2 times, once per request and attempt at most, in the answer to remote read [1970-01-01T00:00:00Z, 1970-01-02T00:00:00Z]: not an answer Prometheus sends"
    );

    // Several label sets for one key (a query without `sum by`): legitimate, each listed per
    // request; the service keeps its quotas anyway, so their runs are not written, and the
    // bound is not crossed however many there are.
    let mut b = Builder::spilled(1000, 60, 10, LabelNames::default(), dir.path())
        .unwrap()
        .bounded(100, 2);
    for _ in 0..2 {
        for pod in ["a", "b", "c", "d"] {
            feed(&mut b, &[("service", "s"), ("caller", "web"), ("pod", pod)]);
        }
    }
    assert_eq!(b.exceeded(), None);
    let h = b.finish_spilled().unwrap();
    assert_eq!(h.bytes(), 4, "the first label set's first run only");
    assert!(h
        .rejected
        .iter()
        .any(|r| r.fails_service && r.reason.contains("`pod`")));
}

#[test]
fn exceeded_errors_name_the_bound_the_key_and_the_request() {
    let request = request_range("query_range", 1_796_000_000, 1_796_043_140);
    for (bound, text) in [
        (
            Bound::ResponseBytes(2 << 30),
            "the answer exceeds 2147483648 bytes (history.prometheus.max_response_bytes)",
        ),
        (
            Bound::PullBytes(32 << 30),
            "the pull exceeds 34359738368 bytes in all (history.prometheus.max_pull_bytes)",
        ),
        (
            Bound::Series(200_000),
            "the pull exceeds 200000 series (history.prometheus.max_series)",
        ),
    ] {
        let key = bound.key().unwrap();
        let e = HistoryError::Exceeded {
            url: "http://p:9090".into(),
            request: request.clone(),
            bound,
        };
        assert_eq!(
            e.to_string(),
            format!("prometheus at http://p:9090: {text}, in the answer to query_range [2026-11-30T00:53:20Z, 2026-11-30T12:52:20Z]: raise `{key}` if such answers are legitimate")
        );
    }
}

/// The last failure of a request reads as it did when it was kept as text.
#[test]
fn unavailable_errors_name_the_last_failure() {
    let status = reqwest::StatusCode::SERVICE_UNAVAILABLE;
    let timeout: schema::HumanDuration = "2m".parse().unwrap();
    for (source, text) in [
        (
            RequestFailure::Partial,
            "partial response (isPartial: some storage nodes did not answer)",
        ),
        (
            RequestFailure::Status {
                status,
                error_type: "unavailable".into(),
                error: "not ready".into(),
            },
            "HTTP 503 Service Unavailable: unavailable not ready",
        ),
        (
            RequestFailure::ErrorText {
                status,
                text: "try later".into(),
            },
            "HTTP 503 Service Unavailable: try later",
        ),
        (
            RequestFailure::TooLong(timeout),
            "the request took longer than history.prometheus.max_request_duration (2m)",
        ),
        (
            RequestFailure::Corrupt(super::error::Corrupt::Cut(3)),
            "bad answer: the answer ended inside a frame (3 bytes left)",
        ),
        (
            RequestFailure::Settings("http://p:9090/api/v1/status/flags: timed out".into()),
            "reading the server's settings failed: http://p:9090/api/v1/status/flags: timed out",
        ),
    ] {
        let e = HistoryError::Unavailable {
            url: "http://p:9090".into(),
            attempts: 3,
            source,
        };
        assert_eq!(
            e.to_string(),
            format!("prometheus at http://p:9090 failed after 3 attempts: {text}")
        );
    }
}

#[test]
fn a_rejected_series_keeps_a_bounded_reason() {
    let mut b = Builder::new(1000, 60, 10, LabelNames::default());
    let long = "x".repeat(100_000);
    feed(&mut b, &[("caller", "web"), ("huge", &long)]);
    feed(&mut b, &[("service", &long), ("caller", "web")]);
    let h = b.finish();
    assert_eq!(h.rejected.len(), 2);
    for r in &h.rejected {
        assert!(r.reason.len() < 1024, "{} bytes", r.reason.len());
    }
}

/// Several label sets for one key are named by the labels they differ in; the first set is
/// kept small (as text up to 1 KiB, else as its hash), so a long one is named as such.
#[test]
fn merged_label_sets_are_named_from_a_small_copy_of_the_first() {
    let mut b = Builder::new(1000, 60, 10, LabelNames::default());
    feed(
        &mut b,
        &[
            ("service", "s"),
            ("caller", "web"),
            ("instance", "a"),
            ("job", "j"),
        ],
    );
    feed(
        &mut b,
        &[
            ("service", "s"),
            ("caller", "web"),
            ("instance", "b"),
            ("job", "j"),
        ],
    );
    feed(&mut b, &[("service", "s"), ("caller", "web"), ("pod", "p")]);
    let long = "x".repeat(2000);
    feed(
        &mut b,
        &[("service", "s"), ("caller", "api"), ("huge", &long)],
    );
    feed(&mut b, &[("service", "s"), ("caller", "api")]);
    let h = b.finish();
    let reason = |caller: &str| {
        h.rejected
            .iter()
            .find(|r| r.caller.as_deref() == Some(caller))
            .map(|r| r.reason.clone())
            .unwrap()
    };
    assert!(
        reason("web").contains("they differ in `instance`, `job`, `pod`;"),
        "{}",
        reason("web")
    );
    assert!(
        reason("api").contains("`(the first one's labels, over 1024 bytes)`"),
        "{}",
        reason("api")
    );
}
