//! The history a plan is computed from: one regular series per (service, caller, procedure)
//! over the lookback, on one time grid. Missing samples stay missing (`NaN` in
//! [`RateSeries`]), never zero. Series that cannot be used (missing labels, non-finite values)
//! are listed in [`History::rejected`] with a reason.
//!
//! A plan reads history through [`SeriesSource`], one service at a time, so that a history
//! kept on disk (rlc's spill) never has to be in memory whole.

use std::borrow::Cow;
use std::collections::BTreeMap;

use policies::RateSeries;

/// Identifies one series: callee service, caller, procedure (at least one of the last two).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeriesKey {
    /// Callee service.
    pub service: String,
    /// Calling service.
    pub caller: Option<String>,
    /// Procedure of the callee.
    pub procedure: Option<String>,
}

impl SeriesKey {
    /// The bucket name: `<caller>.<procedure>`, or just the one present.
    pub fn bucket_name(&self) -> String {
        match (&self.caller, &self.procedure) {
            (Some(c), Some(p)) => format!("{c}.{p}"),
            (Some(c), None) => c.clone(),
            (None, Some(p)) => p.clone(),
            (None, None) => String::new(),
        }
    }
}

/// A series the source returned but that cannot be used, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// The service, when the label was there.
    pub service: Option<String>,
    /// The caller label, if any.
    pub caller: Option<String>,
    /// The procedure label, if any.
    pub procedure: Option<String>,
    /// Why it was rejected.
    pub reason: String,
    /// Whether none of its service's series can be believed either (the source merged
    /// series it could not tell apart): the whole service keeps its quotas.
    pub fails_service: bool,
}

/// The history of every series on one time grid.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// Unix time (s) of the first grid point.
    pub start: i64,
    /// Grid step, seconds.
    pub step: i64,
    /// Grid points.
    pub len: usize,
    /// One series per key, all on the grid.
    pub series: BTreeMap<SeriesKey, RateSeries>,
    /// Unusable series with the reason.
    pub rejected: Vec<Rejected>,
    /// Set when the whole source failed: every service keeps its current quotas.
    pub source_error: Option<String>,
}

impl History {
    /// A history whose source failed; [`crate::compute::compute_plan`] then keeps every
    /// service's current quotas and lists them in `skipped` with `reason`.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self {
            source_error: Some(reason.into()),
            ..Default::default()
        }
    }

    /// Unix time just after the last grid point.
    pub fn end(&self) -> i64 {
        self.start + self.len as i64 * self.step
    }

    /// The series of one service: a range of the map (keys sort by service first), not a scan
    /// of every series.
    pub fn service_series<'a>(
        &'a self,
        service: &'a str,
    ) -> impl Iterator<Item = (&'a SeriesKey, &'a RateSeries)> + 'a {
        let first = SeriesKey {
            service: service.to_string(),
            caller: None,
            procedure: None,
        };
        self.series
            .range(first..)
            .take_while(move |(k, _)| k.service == service)
    }

    /// Fraction of grid points since the service's first sample where at least one of its
    /// series has a sample (0 when it has none).
    pub fn service_coverage(&self, service: &str) -> f64 {
        let mut any = vec![false; self.len];
        for (_, s) in self.service_series(service) {
            for (a, v) in any.iter_mut().zip(&s.values) {
                *a |= !v.is_nan();
            }
        }
        match any.iter().position(|&a| a) {
            None => 0.0,
            Some(first) => {
                any[first..].iter().filter(|&&a| a).count() as f64 / (self.len - first) as f64
            }
        }
    }

    /// Every service with at least one series.
    pub fn services(&self) -> Vec<String> {
        let mut v: Vec<String> = self.series.keys().map(|k| k.service.clone()).collect();
        v.dedup();
        v
    }
}

/// Why the series of a service could not be read (the service then keeps its quotas): the
/// source's own words, e.g. the file and the series that would not read. Text, because each
/// source (rlc's spill file, its ring, a test's) has failures of its own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unreadable(pub String);

/// Where a plan reads its history from, one service at a time: a [`History`] in memory, or
/// one kept elsewhere (on disk) and loaded per service.
pub trait SeriesSource: Sync {
    /// Every service with at least one series.
    fn services(&self) -> Vec<String>;
    /// Series the source returned but that cannot be used.
    fn rejected(&self) -> &[Rejected];
    /// Set when the whole source failed: every service keeps its current quotas.
    fn source_error(&self) -> Option<&str>;
    /// A history holding (at least) the series of `service`; an error when they cannot be
    /// read (the service then keeps its quotas).
    fn service(&self, service: &str) -> Result<Cow<'_, History>, Unreadable>;
    /// The whole history, when it is in memory (a caller needing every series takes it as it
    /// is instead of reading it service by service).
    fn whole(&self) -> Option<&History> {
        None
    }
}

impl SeriesSource for History {
    fn services(&self) -> Vec<String> {
        History::services(self)
    }

    fn rejected(&self) -> &[Rejected] {
        &self.rejected
    }

    fn source_error(&self) -> Option<&str> {
        self.source_error.as_deref()
    }

    fn service(&self, _service: &str) -> Result<Cow<'_, History>, Unreadable> {
        Ok(Cow::Borrowed(self))
    }

    fn whole(&self) -> Option<&History> {
        Some(self)
    }
}
