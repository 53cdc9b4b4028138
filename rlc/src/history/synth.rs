//! A deterministic generator of realistic RPS history (diurnal and weekly cycles, growth,
//! noise) for the quickstart and tests: [`generate`] writes the CSV the file source reads.

use std::io::Write;
use std::path::Path;

use chrono::{DateTime, Utc};

/// The shape of one series' traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// Mean rate at the start, rps.
    pub base_rps: f64,
    /// Relative amplitude of the daily cycle (0–1).
    pub diurnal: f64,
    /// Saturday and Sunday traffic relative to weekdays.
    pub weekend: f64,
    /// Growth per day, as a fraction of `base_rps`.
    pub growth_per_day: f64,
    /// Relative noise amplitude (uniform, ±).
    pub noise: f64,
    /// Hour (UTC) of the daily peak.
    pub peak_hour: f64,
}

impl Default for Profile {
    fn default() -> Self {
        Self {
            base_rps: 100.0,
            diurnal: 0.5,
            weekend: 0.6,
            growth_per_day: 0.0,
            noise: 0.05,
            peak_hour: 15.0,
        }
    }
}

impl Profile {
    /// The noiseless rate at unix time `t`, `origin` being the start of growth.
    pub fn rate(&self, t: i64, origin: i64) -> f64 {
        let day = t.div_euclid(86_400);
        let hour = t.rem_euclid(86_400) as f64 / 3600.0;
        // 1970-01-01 was a Thursday: weekday 0 = Thursday, 2 = Saturday, 3 = Sunday.
        let weekday = (day + 3).rem_euclid(7); // 0 = Monday
        let weekly = if weekday >= 5 { self.weekend } else { 1.0 };
        let daily = 1.0
            + self.diurnal
                * (2.0 * std::f64::consts::PI * (hour - self.peak_hour + 6.0) / 24.0).sin();
        let growth = 1.0 + self.growth_per_day * (t - origin) as f64 / 86_400.0;
        (self.base_rps * weekly * daily * growth).max(0.0)
    }

    /// The rate with deterministic noise for series `id` under `seed`.
    pub fn sample(&self, t: i64, origin: i64, seed: u64, id: u64) -> f64 {
        let u = unit(
            seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ (t as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9),
        );
        self.rate(t, origin) * (1.0 + self.noise * (2.0 * u - 1.0))
    }
}

use rlc_plan::corpus::unit;

/// One series of the quickstart set.
#[derive(Debug, Clone)]
pub struct SynthSeries {
    /// Callee.
    pub service: &'static str,
    /// Caller.
    pub caller: &'static str,
    /// Procedure.
    pub procedure: &'static str,
    /// Traffic shape.
    pub profile: Profile,
}

/// The quickstart set: 3 services × a few callers and procedures, one growing.
pub fn quickstart_series() -> Vec<SynthSeries> {
    let p = |base: f64, growth: f64, peak_hour: f64| Profile {
        base_rps: base,
        growth_per_day: growth,
        peak_hour,
        ..Default::default()
    };
    vec![
        SynthSeries {
            service: "maps",
            caller: "web",
            procedure: "route",
            profile: p(800.0, 0.0, 17.0),
        },
        SynthSeries {
            service: "maps",
            caller: "mobile",
            procedure: "route",
            profile: p(400.0, 0.02, 19.0),
        },
        SynthSeries {
            service: "maps",
            caller: "partner-x",
            procedure: "geocode",
            profile: p(300.0, 0.0, 11.0),
        },
        SynthSeries {
            service: "payments",
            caller: "api-gateway",
            procedure: "charge",
            profile: p(1000.0, 0.0, 14.0),
        },
        SynthSeries {
            service: "payments",
            caller: "api-gateway",
            procedure: "refund",
            profile: p(50.0, 0.0, 10.0),
        },
        SynthSeries {
            service: "payments",
            caller: "billing",
            procedure: "charge",
            profile: p(120.0, 0.0, 3.0),
        },
        SynthSeries {
            service: "search",
            caller: "web",
            procedure: "query",
            profile: p(1500.0, 0.01, 16.0),
        },
        SynthSeries {
            service: "search",
            caller: "batch",
            procedure: "reindex",
            profile: Profile {
                diurnal: 0.1,
                weekend: 1.0,
                ..p(60.0, 0.0, 2.0)
            },
        },
    ]
}

/// Writes `days` of the quickstart history at `step_secs`, ending at `end` (rounded down to the
/// step), as CSV `ts,service,caller,procedure,rps`. Same `seed` and `end` → same bytes.
/// Returns the number of rows written. 28 days at 1 m is ≈ 320,000 rows (≈ 15 MB).
pub fn generate(
    out: &Path,
    seed: u64,
    end: DateTime<Utc>,
    days: u32,
    step_secs: u32,
) -> std::io::Result<usize> {
    let step = step_secs.max(1) as i64;
    let end = end.timestamp().div_euclid(step) * step;
    let start = end - days as i64 * 86_400;
    let mut w = std::io::BufWriter::new(std::fs::File::create(out)?);
    writeln!(w, "ts,service,caller,procedure,rps")?;
    let series = quickstart_series();
    let mut rows = 0;
    let mut t = start;
    while t < end {
        for (id, s) in series.iter().enumerate() {
            let v = s.profile.sample(t, start, seed, id as u64);
            writeln!(w, "{t},{},{},{},{:.3}", s.service, s.caller, s.procedure, v)?;
            rows += 1;
        }
        t += step;
    }
    w.flush()?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_shaped() {
        let dir = tempfile::tempdir().unwrap();
        let end: DateTime<Utc> = "2026-01-05T00:00:00Z".parse().unwrap();
        let (a, b) = (dir.path().join("a.csv"), dir.path().join("b.csv"));
        assert_eq!(generate(&a, 7, end, 1, 60).unwrap(), 1440 * 8);
        generate(&b, 7, end, 1, 60).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        let p = Profile {
            noise: 0.0,
            ..Default::default()
        };
        // Peak at 15:00 is 1.5× base on a weekday, trough at 03:00 is 0.5×; weekends 0.6×.
        let monday = end.timestamp(); // 2026-01-05 is a Monday
        assert!((p.rate(monday + 15 * 3600, 0) - 150.0).abs() < 1e-9);
        assert!((p.rate(monday + 3 * 3600, 0) - 50.0).abs() < 1e-9);
        assert!((p.rate(monday - 86_400 + 15 * 3600, 0) - 90.0).abs() < 1e-9);
    }
}
