//! The backtest corpus: generated traffic shapes (deterministic, seeded; nothing big is
//! committed) that guard the quality of the built-in policies. Each shape is 28 days of
//! per-minute rates; every policy is fitted on the first 21 days and scored on the held-out
//! last week by [`crate::backtest::fit_and_score`], the scoring path of `rlc backtest`.
//!
//! `rlc backtest --corpus` prints the table of `docs/rlc-policies.md`; the tests hold every
//! shape to its thresholds (throttled fraction and slack, with its default policy).

use policies::DEFAULT_HEADROOM;
use policies::{Policy, RateSeries};
use schema::{Headroom, PolicyName, PolicySpec};
use serde::Serialize;

use crate::backtest::fit_and_score;

/// splitmix64 → [0, 1): stable across versions and platforms, unlike a library RNG. The one
/// seeded generator of rlc's generated data (this corpus, the quickstart's history).
pub fn unit(mut x: u64) -> f64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

const DAY: i64 = 86_400;
const HOUR: i64 = 3_600;
/// Days of history per shape; the last [`HOLDOUT_DAYS`] are held out.
pub const DAYS: i64 = 28;
/// The held-out week.
pub const HOLDOUT_DAYS: i64 = 7;
/// Throttled fraction every shape must stay under with its default policy (0.01%).
pub const MAX_THROTTLED: f64 = 0.0001;
/// The median slack (limit ÷ real peak of the held-out week) over the corpus must stay under.
pub const MAX_MEDIAN_SLACK: f64 = 1.4;

/// End of every shape's history: Monday 2026-04-06 00:00 UTC, so that the week before the
/// held-out one contains Europe's switch to summer time (2026-03-29).
pub const END: i64 = 1_775_433_600;
/// Europe's switch to summer time in 2026 (01:00 UTC on 2026-03-29).
const DST_SWITCH: i64 = 1_774_746_000;

/// One shape of the corpus.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Name (also the service name in the table).
    pub name: &'static str,
    /// What it models.
    pub about: &'static str,
    /// The default policy of its service (what the thresholds hold).
    pub spec: PolicySpec,
    /// Highest slack the default policy may have on it (guards against a regression).
    pub max_slack: f64,
    /// The rate at unix time `t` (NaN = no sample), noise drawn from the seed included.
    pub rate: fn(i64, u64) -> f64,
    /// Windows a run would leave out: `(from, to, kind)`, kind `throttled` (an enforced
    /// bucket refused requests; controller reports) or `override` (an incident override).
    pub censored: fn() -> Vec<(i64, i64, &'static str)>,
}

fn none() -> Vec<(i64, i64, &'static str)> {
    Vec::new()
}

/// A retry storm: `times` the usual rate for `minutes` from `at`.
fn storm(t: i64, at: i64, minutes: i64, times: f64) -> f64 {
    if (at..at + minutes * 60).contains(&t) {
        times
    } else {
        1.0
    }
}

/// Start of every history.
pub const fn start() -> i64 {
    END - DAYS * DAY
}

fn noise(t: i64, seed: u64, id: u64, amp: f64) -> f64 {
    let u = unit(
        seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (t as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9),
    );
    1.0 + amp * (2.0 * u - 1.0)
}

/// Diurnal (peak at `peak_hour` of `local` time) × weekly (weekend factor) shape, 1 at the
/// daily mean of a weekday.
fn seasonal(local: i64, peak_hour: f64, amp: f64, weekend: f64) -> f64 {
    let day = local.div_euclid(DAY);
    let hour = local.rem_euclid(DAY) as f64 / 3600.0;
    let weekday = (day + 3).rem_euclid(7); // 0 = Monday
    let weekly = if weekday >= 5 { weekend } else { 1.0 };
    weekly * (1.0 + amp * (2.0 * std::f64::consts::PI * (hour - peak_hour + 6.0) / 24.0).sin())
}

fn weeks(t: i64) -> f64 {
    (t - start()) as f64 / (7 * DAY) as f64
}

fn base(t: i64) -> f64 {
    100.0 * seasonal(t, 15.0, 0.5, 0.6)
}

fn growth(t: i64, seed: u64, per_week: f64, id: u64) -> f64 {
    base(t) * (1.0 + per_week).powf(weeks(t)) * noise(t, seed, id, 0.05)
}

fn forecast() -> PolicySpec {
    PolicySpec {
        policy: Some(PolicyName::Forecast),
        ..Default::default()
    }
}

/// A shape with the corpus's defaults: the forecast policy, slack at most 1.35, nothing
/// censored.
fn shape(name: &'static str, about: &'static str, rate: fn(i64, u64) -> f64) -> Shape {
    Shape {
        name,
        about,
        spec: forecast(),
        max_slack: 1.35,
        censored: none,
        rate,
    }
}

/// The shapes, in table order.
pub fn shapes() -> Vec<Shape> {
    [
        steady_and_growth(),
        level_shifts(),
        calendar_and_sparse(),
        storms(),
        noises(),
    ]
    .concat()
}

/// A Pareto (tail index `alpha`) burst on a share `p` of the minutes, `scale` × the rate at its
/// smallest: minute-to-minute noise with a heavy tail.
fn pareto(t: i64, seed: u64, id: u64, p: f64, scale: f64, alpha: f64) -> f64 {
    let key = seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    if unit(key ^ (t as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9)) >= p {
        return 1.0;
    }
    let u = unit(key.rotate_left(17) ^ (t as u64).wrapping_mul(0x94D0_49BB_1331_11EB));
    1.0 + scale * (1.0 - u).powf(-1.0 / alpha)
}

/// A Poisson count of mean `mean` (inverse transform of one uniform draw).
fn poisson(mean: f64, u: f64) -> f64 {
    let (mut k, mut p) = (0.0, (-mean).exp());
    let mut cdf = p;
    while u > cdf && k < 1000.0 {
        k += 1.0;
        p *= mean / k;
        cdf += p;
    }
    k
}

/// Buckets whose noise differs (what `headroom: auto` is for): heavy-tailed minute-to-minute
/// noise at three strengths, the level moving week to week, short bursts that are real demand,
/// a sparse caller's counting noise, a very smooth caller.
fn noises() -> Vec<Shape> {
    vec![
        Shape {
            max_slack: 2.2,
            ..shape(
                "heavy-tail-light",
                "diurnal-weekly, 0.5% of minutes a Pareto (α 3) burst of at least +20%",
                |t, seed| base(t) * pareto(t, seed, 21, 0.005, 0.2, 3.0) * noise(t, seed, 22, 0.05),
            )
        },
        Shape {
            max_slack: 2.2,
            ..shape(
                "heavy-tail-medium",
                "diurnal-weekly, 1% of minutes a Pareto (α 2.5) burst of at least +30%",
                |t, seed| base(t) * pareto(t, seed, 23, 0.01, 0.3, 2.5) * noise(t, seed, 24, 0.05),
            )
        },
        Shape {
            // The limit covers bursts of up to 15× an hour's usual peak.
            max_slack: 8.0,
            spec: PolicySpec {
                spike_factor: Some(20.0),
                ..forecast()
            },
            ..shape(
                "heavy-tail-strong",
                "diurnal-weekly, 2% of minutes a Pareto (α 2) burst of at least +50%, up to 15× the hour's usual peak (real demand: spike_factor 20)",
                |t, seed| base(t) * pareto(t, seed, 25, 0.02, 0.5, 2.0) * noise(t, seed, 26, 0.05),
            )
        },
        Shape {
            max_slack: 2.0,
            ..shape(
                "weekly-levels",
                "diurnal-weekly, each week's level drawn in 85–115%",
                |t, seed| {
                    let week = (t - start()).div_euclid(7 * DAY) as u64;
                    let level = 0.85 + 0.3 * unit(seed ^ 27 ^ week.wrapping_mul(0xBF58_476D_1CE4_E5B9));
                    base(t) * level * noise(t, seed, 28, 0.05)
                },
            )
        },
        shape(
            "real-bursts",
            "diurnal-weekly, plus 2× bursts of 5 minutes four times a day at random hours (real demand, recurring)",
            |t, seed| {
                let day = t.div_euclid(DAY) as u64;
                let minute = t.rem_euclid(DAY) / 60;
                let burst = (0..4u64).any(|k| {
                    let at = (unit(seed ^ 29 ^ (day * 4 + k).wrapping_mul(0x9E37_79B9_7F4A_7C15)) * 1435.0) as i64;
                    (at..at + 5).contains(&minute)
                });
                base(t) * if burst { 2.0 } else { 1.0 } * noise(t, seed, 30, 0.05)
            },
        ),
        Shape {
            max_slack: 1.6,
            ..shape(
                "sparse-counts",
                "a sparse caller: a Poisson count a minute, 3 on average at the daily peak",
                |t, seed| {
                    let mean = 3.0 * base(t) / 150.0;
                    let u = unit(seed ^ 31 ^ (t as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
                    poisson(mean, u) / 60.0
                },
            )
        },
        shape(
            "smooth",
            "diurnal-weekly, ±0.5% noise",
            |t, seed| base(t) * noise(t, seed, 32, 0.005),
        ),
    ]
}

/// Flat, diurnal-weekly, and diurnal-weekly growing week on week.
fn steady_and_growth() -> Vec<Shape> {
    vec![
        shape("steady", "flat 100 rps, ±5% noise", |t, seed| {
            100.0 * noise(t, seed, 1, 0.05)
        }),
        shape(
            "diurnal-weekly",
            "daily cycle ±50% peaking 15:00, weekends at 60%",
            |t, seed| base(t) * noise(t, seed, 2, 0.05),
        ),
        shape(
            "growth-5",
            "diurnal-weekly growing 5% a week (compounded)",
            |t, seed| growth(t, seed, 0.05, 3),
        ),
        shape(
            "growth-20",
            "diurnal-weekly growing 20% a week",
            |t, seed| growth(t, seed, 0.20, 4),
        ),
        shape(
            "growth-40",
            "diurnal-weekly growing 40% a week",
            |t, seed| growth(t, seed, 0.40, 5),
        ),
        shape(
            "growth-60",
            "diurnal-weekly growing 60% a week",
            |t, seed| growth(t, seed, 0.60, 6),
        ),
    ]
}

/// Diurnal-weekly with its level moved for a while or for good: a holiday, a short spike, a
/// launch, a migration away.
fn level_shifts() -> Vec<Shape> {
    vec![
        shape(
            "holiday-dip",
            "diurnal-weekly, the whole week before the scored one at 50% (a holiday)",
            |t, seed| {
                let split = END - HOLDOUT_DAYS * DAY;
                let dip = if (split - 7 * DAY..split).contains(&t) { 0.5 } else { 1.0 };
                base(t) * dip * noise(t, seed, 7, 0.05)
            },
        ),
        shape(
            "spike",
            "diurnal-weekly with a 6× retry storm for 20 minutes on day 10",
            |t, seed| {
                let at = start() + 9 * DAY + 11 * HOUR;
                let spike = if (at..at + 20 * 60).contains(&t) { 6.0 } else { 1.0 };
                base(t) * spike * noise(t, seed, 8, 0.05)
            },
        ),
        shape(
            "level-up",
            "diurnal-weekly doubling 5 days before the scored week (a launch)",
            |t, seed| {
                let at = END - HOLDOUT_DAYS * DAY - 5 * DAY;
                base(t) * if t >= at { 2.0 } else { 1.0 } * noise(t, seed, 9, 0.05)
            },
        ),
        shape(
            "level-down",
            "diurnal-weekly halved on day 8, for the 14 days before the scored week (a migration away)",
            |t, seed| {
                let at = start() + 7 * DAY;
                base(t) * if t >= at { 0.5 } else { 1.0 } * noise(t, seed, 10, 0.05)
            },
        ),
    ]
}

/// Shapes the calendar or the caller make hard: a switch to summer time, a weekly batch, a
/// few requests an hour, a caller with days of history only.
fn calendar_and_sparse() -> Vec<Shape> {
    vec![
        Shape {
            spec: PolicySpec {
                timezone: Some("Europe/Berlin".into()),
                ..forecast()
            },
            ..shape(
                "dst",
                "sharp 09:00 Europe/Berlin morning peak; summer time starts the day before the scored week",
                |t, seed| {
                    let local = t + if t >= DST_SWITCH { 2 * HOUR } else { HOUR };
                    let h = local.rem_euclid(DAY) as f64 / 3600.0;
                    let bump = (-((h - 9.0) / 0.75).powi(2)).exp();
                    100.0 * (1.0 + 2.0 * bump) * seasonal(local, 15.0, 0.0, 0.7) * noise(t, seed, 11, 0.05)
                },
            )
        },
        Shape {
            max_slack: 1.45,
            ..shape(
                "weekly-batch",
                "20 rps, plus a 2-hour batch at 400 rps every Sunday 02:00",
                |t, seed| {
                    let wd = (t.div_euclid(DAY) + 3).rem_euclid(7);
                    let h = t.rem_euclid(DAY) / HOUR;
                    let batch = if wd == 6 && (2..4).contains(&h) { 400.0 } else { 0.0 };
                    (20.0 + batch) * noise(t, seed, 12, 0.05)
                },
            )
        },
        Shape {
            max_slack: 1.4,
            ..shape(
                "sparse",
                "a few requests an hour: 0 most minutes, bursts up to 1 rps",
                |t, seed| {
                    let u = unit(seed ^ 13 ^ (t as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
                    if u < 0.95 {
                        0.0
                    } else {
                        ((u - 0.95) * 20.0 * 60.0).ceil() / 60.0
                    }
                },
            )
        },
        Shape {
            max_slack: 1.6,
            ..shape(
                "new-caller",
                "diurnal-weekly, first sample 5 days before the scored week",
                |t, seed| {
                    if t < END - HOLDOUT_DAYS * DAY - 5 * DAY {
                        f64::NAN
                    } else {
                        base(t) * noise(t, seed, 14, 0.05)
                    }
                },
            )
        },
    ]
}

/// Diurnal-weekly with retry storms: short and tall to long and low, the last three with the
/// minutes a run leaves out (throttled, under an override).
fn storms() -> Vec<Shape> {
    vec![
        shape(
            "storm-20x-1m",
            "diurnal-weekly with a 20× retry storm for 1 minute at the day's peak on day 8",
            |t, seed| base(t) * storm(t, start() + 7 * DAY + 15 * HOUR, 1, 20.0) * noise(t, seed, 15, 0.05),
        ),
        shape(
            "storm-8x-10m",
            "diurnal-weekly with an 8× retry storm for 10 minutes one afternoon (day 7)",
            |t, seed| base(t) * storm(t, start() + 6 * DAY + 14 * HOUR, 10, 8.0) * noise(t, seed, 16, 0.05),
        ),
        shape(
            "storm-4x-60m",
            "diurnal-weekly with a 4× retry storm for an hour one morning (day 15)",
            |t, seed| base(t) * storm(t, start() + 14 * DAY + 10 * HOUR, 60, 4.0) * noise(t, seed, 17, 0.05),
        ),
        Shape {
            censored: || {
                let at = start() + 18 * DAY + 15 * HOUR;
                vec![(at, at + 30 * 60, "throttled")]
            },
            ..shape(
                "storm-2x-30m-throttled",
                "diurnal-weekly with a 2× storm for 30 minutes at the peak (day 19) that the enforced limit refused (throttled minutes)",
                |t, seed| base(t) * storm(t, start() + 18 * DAY + 15 * HOUR, 30, 2.0) * noise(t, seed, 18, 0.05),
            )
        },
        Shape {
            censored: || {
                let at = start() + 16 * DAY;
                vec![(at, at + DAY, "throttled")]
            },
            ..shape(
                "throttled-day",
                "diurnal-weekly with a whole day at 1.6× (a retry loop held at the limit, throttled all day, day 17)",
                |t, seed| base(t) * storm(t, start() + 16 * DAY, 24 * 60, 1.6) * noise(t, seed, 19, 0.05),
            )
        },
        Shape {
            censored: || {
                let at = start() + 19 * DAY + 13 * HOUR;
                vec![(at, at + 3 * HOUR, "override")]
            },
            ..shape(
                "override-window",
                "diurnal-weekly with 3 hours at 2.5× under an incident override (day 20)",
                |t, seed| base(t) * storm(t, start() + 19 * DAY + 13 * HOUR, 180, 2.5) * noise(t, seed, 20, 0.05),
            )
        },
    ]
}

/// The seed of the corpus in the docs table.
pub const SEED: u64 = 42;

/// A shape's 28 days at one minute, noise from `seed`.
pub fn series(shape: &Shape, seed: u64) -> RateSeries {
    let start = start();
    RateSeries {
        start,
        step: 60,
        values: (0..DAYS * 1440)
            .map(|i| (shape.rate)(start + i * 60, seed) as f32)
            .collect(),
    }
}

/// One policy's score on one shape.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ShapeScore {
    /// Policy scored (`forecast` may have fallen back to `peak`; see `via`).
    pub policy: String,
    /// The policy that produced the limit.
    pub via: String,
    /// Fitted limit.
    pub limit_rps: f64,
    /// Real peak of the held-out week.
    pub holdout_peak_rps: f64,
    /// Requests over the limit ÷ requests.
    pub throttled_fraction: f64,
    /// limit ÷ real peak.
    pub slack: f64,
    /// The margin the limit was computed with (`headroom: auto` resolved).
    pub headroom: f64,
    /// The evidence's one-line explanation, if any.
    pub explain: Option<String>,
}

/// All policies on one shape.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ShapeRow {
    /// Shape name.
    pub shape: String,
    /// What it models.
    pub about: String,
    /// Its default policy.
    pub default_policy: String,
    /// Slack threshold of the default policy.
    pub max_slack: f64,
    /// One score per policy.
    pub scores: Vec<ShapeScore>,
}

impl ShapeRow {
    /// The score of the shape's default policy.
    pub fn default_score(&self) -> Option<&ShapeScore> {
        self.scores.iter().find(|s| s.policy == self.default_policy)
    }
}

/// Scores `policies` on every shape (noise from [`SEED`]).
pub fn run(policies: &[(&str, &dyn Policy)]) -> Vec<ShapeRow> {
    run_seeded(policies, SEED)
}

/// How the corpus is scored: as runs compute today, or as they did before robust learning
/// (throttled and overridden minutes learned from, `peak` keeping one-off spikes), for the
/// before/after table of `docs/rlc-policies.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Learning {
    /// Censored windows left out, spikes left out of `peak`.
    Robust,
    /// Every minute learned from; `peak` keeps spikes (`forecast` left spikes out already).
    Before,
}

/// Scores `policies` on every shape, noise from `seed`.
pub fn run_seeded(policies: &[(&str, &dyn Policy)], seed: u64) -> Vec<ShapeRow> {
    run_as(policies, seed, Learning::Robust)
}

/// Scores `policies` on every shape, noise from `seed`, learning as `learning` says.
pub fn run_as(policies: &[(&str, &dyn Policy)], seed: u64, learning: Learning) -> Vec<ShapeRow> {
    let variants: Vec<Variant<'_>> = policies
        .iter()
        .map(|(name, policy)| Variant {
            label: name.to_string(),
            policy: *policy,
            policy_name: name.parse().ok(),
            headroom: None,
        })
        .collect();
    score_variants(&variants, seed, learning)
}

/// The margins `rlc backtest --corpus` compares: the built-in default, a thin one and `auto`.
pub fn margins() -> Vec<Headroom> {
    vec![Headroom::Fixed(0.10), Headroom::Fixed(0.25), Headroom::Auto]
}

/// Scores each shape's default policy at each of `margins` (labelled `0.1`, `0.25`, `auto`),
/// noise from `seed`.
pub fn run_margins(margins: &[Headroom], seed: u64) -> Vec<ShapeRow> {
    static FORECAST: policies::forecast::Forecast = policies::forecast::Forecast;
    let variants: Vec<Variant<'_>> = margins
        .iter()
        .map(|h| Variant {
            label: h.to_string(),
            policy: &FORECAST,
            policy_name: None,
            headroom: Some(*h),
        })
        .collect();
    score_variants(&variants, seed, Learning::Robust)
}

/// One column of a corpus table: a policy, and the spec changes it is scored with.
struct Variant<'a> {
    /// The column's name.
    label: String,
    /// The policy (for margins: the shape's default policy, see [`score_variants`]).
    policy: &'a dyn Policy,
    /// The policy named in the spec; `None` keeps the shape's (margin columns).
    policy_name: Option<PolicyName>,
    /// The margin, `None` keeps the shape's.
    headroom: Option<Headroom>,
}

fn score_variants(variants: &[Variant<'_>], seed: u64, learning: Learning) -> Vec<ShapeRow> {
    let split = END - HOLDOUT_DAYS * DAY;
    shapes()
        .iter()
        .map(|shape| {
            let raw = series(shape, seed);
            let windows: Vec<crate::censor::Ignored> = (shape.censored)()
                .into_iter()
                .map(|(from, to, kind)| crate::censor::Ignored {
                    kind: kind.into(),
                    from: chrono::DateTime::from_timestamp(from, 0).unwrap_or_default(),
                    to: chrono::DateTime::from_timestamp(to, 0).unwrap_or_default(),
                    reason: kind.into(),
                })
                .collect();
            let (full, left_out) = match learning {
                Learning::Robust => crate::censor::apply(&raw, &windows),
                Learning::Before => (raw, 0),
            };
            let scores = variants
                .iter()
                .filter_map(|v| {
                    let mut spec = shape.spec.clone();
                    if let Some(name) = &v.policy_name {
                        spec.policy = Some(name.clone());
                    }
                    if let Some(h) = v.headroom {
                        spec.headroom = Some(h);
                    }
                    let policy = match (&v.policy_name, &spec.policy) {
                        (None, Some(PolicyName::Peak)) => &PEAK_POLICY as &dyn Policy,
                        _ => v.policy,
                    };
                    if learning == Learning::Before && spec.policy == Some(PolicyName::Peak) {
                        spec.spike_factor = Some(f64::MAX);
                    }
                    let (sc, p) = fit_and_score(
                        policy,
                        &spec,
                        0.0,
                        (shape.name, Some("caller"), None),
                        (&full, left_out),
                        split,
                    )
                    .ok()??;
                    Some(ShapeScore {
                        policy: v.label.clone(),
                        via: p.policy.to_string(),
                        limit_rps: sc.limit_rps,
                        holdout_peak_rps: sc.holdout_peak_rps,
                        throttled_fraction: sc.throttled_fraction,
                        slack: sc.slack,
                        headroom: policies::headroom_of(&p, &spec),
                        explain: p.evidence["explain"].as_str().map(str::to_string),
                    })
                })
                .collect();
            ShapeRow {
                shape: shape.name.into(),
                about: shape.about.into(),
                default_policy: if variants.iter().all(|v| v.headroom.is_some()) {
                    shape
                        .spec
                        .headroom
                        .unwrap_or(Headroom::Fixed(DEFAULT_HEADROOM))
                        .to_string()
                } else {
                    shape
                        .spec
                        .policy
                        .as_ref()
                        .map_or("peak".into(), |p| p.to_string())
                },
                max_slack: shape.max_slack,
                scores,
            }
        })
        .collect()
}

static PEAK_POLICY: policies::peak::Peak = policies::peak::Peak;

/// The built-in policies, side by side.
pub fn builtin() -> Vec<(&'static str, &'static dyn Policy)> {
    static PEAK: policies::peak::Peak = policies::peak::Peak;
    static FORECAST: policies::forecast::Forecast = policies::forecast::Forecast;
    vec![("peak", &PEAK), ("forecast", &FORECAST)]
}

/// Median of the default policies' slack over the corpus.
pub fn median_slack(rows: &[ShapeRow]) -> f64 {
    let mut v: Vec<f64> = rows
        .iter()
        .filter_map(|r| r.default_score().map(|s| s.slack))
        .collect();
    policies::spikes::median(&mut v).unwrap_or(f64::NAN)
}

/// The columns of a table of `rows`: its scores' labels.
fn columns(rows: &[ShapeRow]) -> Vec<String> {
    rows.first()
        .map(|r| r.scores.iter().map(|s| s.policy.clone()).collect())
        .unwrap_or_default()
}

/// Every row's score of column `n`.
fn scores_of<'a>(rows: &'a [ShapeRow], n: &'a str) -> impl Iterator<Item = &'a ShapeScore> + 'a {
    rows.iter()
        .flat_map(move |r| r.scores.iter().filter(move |s| s.policy == n))
}

/// The markdown table of `docs/rlc-policies.md`.
pub fn markdown(rows: &[ShapeRow]) -> String {
    let names = columns(rows);
    let mut out = String::from("| shape |");
    for n in &names {
        out.push_str(&format!(" {n} throttled | {n} slack |"));
    }
    out.push_str("\n|---|");
    for _ in &names {
        out.push_str("---:|---:|");
    }
    out.push('\n');
    for r in rows {
        out.push_str(&format!("| {} |", r.shape));
        for s in &r.scores {
            let mark = if s.policy == r.default_policy {
                "**"
            } else {
                ""
            };
            out.push_str(&format!(
                " {mark}{:.4}%{mark} | {mark}{:.2}{mark} |",
                s.throttled_fraction * 100.0,
                s.slack
            ));
        }
        out.push('\n');
    }
    for n in &names {
        let mut v: Vec<f64> = scores_of(rows, n).map(|s| s.slack).collect();
        v.sort_by(f64::total_cmp);
        let worst = scores_of(rows, n)
            .map(|s| s.throttled_fraction)
            .fold(0.0, f64::max);
        out.push_str(&format!(
            "\n{n}: median slack {:.2}, worst throttled {:.4}%",
            v.get(v.len() / 2).copied().unwrap_or(f64::NAN),
            worst * 100.0
        ));
    }
    out.push('\n');
    out
}

/// The margins table of `docs/rlc-policies.md`: each shape's default policy at each margin
/// (throttled share and slack), with the margin `auto` chose.
pub fn markdown_margins(rows: &[ShapeRow]) -> String {
    let names = columns(rows);
    let mut out = String::from("| shape |");
    for n in &names {
        out.push_str(&format!(" {n}: throttled / slack |"));
    }
    out.push_str(" auto chose |\n|---|");
    for _ in &names {
        out.push_str("---:|");
    }
    out.push_str("---:|\n");
    for r in rows {
        out.push_str(&format!("| {} |", r.shape));
        for s in &r.scores {
            out.push_str(&format!(
                " {:.4}% / {:.2} |",
                s.throttled_fraction * 100.0,
                s.slack
            ));
        }
        let chose = r.scores.iter().find(|s| s.policy == "auto");
        out.push_str(&chose.map_or(" - |\n".into(), |s| format!(" {:.2} |\n", s.headroom)));
    }
    for n in &names {
        let scores = || scores_of(rows, n);
        let mut v: Vec<f64> = scores().map(|s| s.slack).collect();
        let worst = scores().map(|s| s.throttled_fraction).fold(0.0, f64::max);
        let over = scores()
            .filter(|s| s.throttled_fraction > MAX_THROTTLED)
            .count();
        out.push_str(&format!(
            "\n{n}: median slack {:.3}, worst throttled {:.4}%, {over} shapes over {:.2}%",
            policies::spikes::median(&mut v).unwrap_or(f64::NAN),
            worst * 100.0,
            MAX_THROTTLED * 100.0
        ));
    }
    out.push('\n');
    out
}

/// The before/after table of `docs/rlc-policies.md`: each policy's throttled share and slack
/// on each shape, learning as before robust learning and as today.
pub fn markdown_before_after(before: &[ShapeRow], after: &[ShapeRow]) -> String {
    let names = columns(after);
    let mut out = String::from("| shape |");
    for n in &names {
        out.push_str(&format!(" {n} before | {n} after |"));
    }
    out.push_str("\n|---|");
    for _ in &names {
        out.push_str("---:|---:|");
    }
    out.push('\n');
    let cell = |r: Option<&ShapeRow>, n: &str| {
        r.and_then(|r| r.scores.iter().find(|s| s.policy == n))
            .map_or("-".to_string(), |s| {
                format!("{:.4}% / {:.2}", s.throttled_fraction * 100.0, s.slack)
            })
    };
    for a in after {
        let b = before.iter().find(|b| b.shape == a.shape);
        out.push_str(&format!("| {} |", a.shape));
        for n in &names {
            out.push_str(&format!(" {} | {} |", cell(b, n), cell(Some(a), n)));
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The storm shapes (a retry storm, a throttled day, an override window) set no limit:
    /// today every policy stays within the shape's slack threshold at 0% throttled, where
    /// learning as before set limits from the storm (the table of `docs/rlc-policies.md`,
    /// printed with `--nocapture`); the shapes without storms score as before.
    #[test]
    fn storms_before_and_after() {
        let before = run_as(&builtin(), SEED, Learning::Before);
        let after = run_as(&builtin(), SEED, Learning::Robust);
        eprintln!("{}", markdown_before_after(&before, &after));
        for (b, a) in before.iter().zip(&after) {
            for (sb, sa) in b.scores.iter().zip(&a.scores) {
                if a.shape.starts_with("storm")
                    || a.shape == "throttled-day"
                    || a.shape == "override-window"
                {
                    assert!(
                        sa.slack <= a.max_slack && sa.throttled_fraction <= MAX_THROTTLED,
                        "{} {}: {sa:?}",
                        a.shape,
                        sa.policy
                    );
                    if sa.policy == "peak" {
                        assert!(
                            sb.slack > 1.5,
                            "{} learned from its storm before: {sb:?}",
                            a.shape
                        );
                    }
                } else if !((a.shape == "spike" || a.shape.starts_with("heavy-tail"))
                    && sa.policy == "peak")
                {
                    assert_eq!(
                        (sb.slack, sb.throttled_fraction),
                        (sa.slack, sa.throttled_fraction),
                        "{} {}",
                        a.shape,
                        sa.policy
                    );
                }
            }
        }
    }

    /// `headroom: auto` on every shape: within the throttling target on each held-out week,
    /// a median slack of at most 1.08, the storms still out of the limits (slack ≤ 1.5); the
    /// fixed margins beside it (the table of `docs/rlc-policies.md`, `--nocapture`).
    #[test]
    fn auto_margins_meet_the_targets() {
        for seed in [SEED, 7] {
            let rows = run_margins(&margins(), seed);
            eprintln!("seed {seed}\n{}", markdown_margins(&rows));
            let auto: Vec<(&ShapeRow, &ShapeScore)> = rows
                .iter()
                .filter_map(|r| Some((r, r.scores.iter().find(|s| s.policy == "auto")?)))
                .collect();
            assert_eq!(auto.len(), shapes().len());
            for (r, s) in &auto {
                assert!(
                    s.throttled_fraction <= MAX_THROTTLED,
                    "seed {seed}: {}: {s:?}",
                    r.shape
                );
                if r.shape.starts_with("storm") || r.shape.ends_with("-throttled") {
                    assert!(s.slack <= 1.5, "seed {seed}: {}: {s:?}", r.shape);
                }
            }
            let mut slack: Vec<f64> = auto.iter().map(|(_, s)| s.slack).collect();
            let m = policies::spikes::median(&mut slack).unwrap();
            assert!(m <= 1.08, "seed {seed}: median slack {m}");
        }
    }

    #[test]
    fn corpus_is_deterministic() {
        let s = &shapes()[1];
        assert_eq!(series(s, SEED), series(s, SEED));
        assert_ne!(series(s, SEED), series(s, 7));
        assert_eq!(series(s, SEED).values.len(), (DAYS * 1440) as usize);
    }

    /// Every shape within its thresholds with its default policy; the median slack bounded.
    #[test]
    fn every_shape_within_thresholds() {
        within_thresholds(SEED);
    }

    /// The same thresholds hold for other noise draws: the policy is not tuned to one.
    #[test]
    fn thresholds_hold_for_other_seeds() {
        for seed in [7, 1234, 99_991] {
            within_thresholds(seed);
        }
    }

    fn within_thresholds(seed: u64) {
        let rows = run_seeded(&builtin(), seed);
        eprintln!("seed {seed}\n{}", markdown(&rows));
        let mut bad = Vec::new();
        for r in &rows {
            let s = r.default_score().expect("default policy scored");
            if s.throttled_fraction > MAX_THROTTLED || s.slack > r.max_slack {
                bad.push(format!(
                    "seed {seed}: {}: {} throttled {:.4}% (max {:.4}%), slack {:.2} (max {:.2})",
                    r.shape,
                    s.policy,
                    s.throttled_fraction * 100.0,
                    MAX_THROTTLED * 100.0,
                    s.slack,
                    r.max_slack
                ));
            }
        }
        assert!(bad.is_empty(), "{bad:#?}");
        let m = median_slack(&rows);
        assert!(m <= MAX_MEDIAN_SLACK, "median slack {m}");
    }
}
