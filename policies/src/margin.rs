//! `headroom: auto`: each bucket's margin chosen from how much its own history surprised the
//! policy.
//!
//! The policy is replayed at past origins a day apart (rolling origin): fitted with no margin on
//! the history before the origin, it gives a level; the week after the origin is the window that
//! level would have faced. Every minute of the window over the level is a surprise. Two
//! estimates of the throttling a margin `h` would have caused are made from them:
//! - **replayed**: the requests over `level × (1 + h)` in every window, ÷ all their requests;
//! - **tail**: the same from the windows' daily maxima, through an extreme-value fit (a
//!   generalised Pareto distribution over the upper half of the daily maxima, by moments), so
//!   that a handful of weeks does not hide a tail heavier than what they happened to show.
//!
//! The margin is the smallest one that keeps both under `target_throttled`, within
//! `[min_headroom, max_headroom]`; a bucket that needs more than `max_headroom` is flagged for
//! review (a quota alone does not protect a bucket that noisy). Spikes (one-off storms) are left
//! out of the windows as the policies leave them out of their fits, and so are the minutes a
//! run leaves out (throttled, under an override, excluded): they are missing in the series.

use schema::{Headroom, PolicyName, PolicySpec};
use serde_json::{json, Value};

use crate::round3;
use crate::{Policy, PolicyError, PolicyInput, Proposal, RateSeries, DEFAULT_HEADROOM};

/// Default `target_throttled`: 0.01 % of requests.
pub const DEFAULT_TARGET_THROTTLED: f64 = 0.0001;
/// Default `min_headroom`.
pub const DEFAULT_MIN_HEADROOM: f64 = 0.03;
/// Default `max_headroom`.
pub const DEFAULT_MAX_HEADROOM: f64 = 1.0;
const DAY: i64 = 86_400;
/// A replayed window: the week after its origin (or what the history has of it).
pub const WINDOW_SECS: i64 = 7 * DAY;
/// The least history before an origin: one whole weekly cycle.
pub const MIN_TRAIN_SECS: i64 = 7 * DAY;
/// Origins are a day apart; the newest this many are replayed (a bounded cost per bucket).
pub const MAX_ORIGINS: usize = 14;
/// Fewest exceedances of the median daily maximum the tail fit needs.
const MIN_EXCEEDANCES: usize = 5;

/// The `auto` settings of a spec, defaults filled in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    /// Share of requests the replay may throttle.
    pub target: f64,
    /// Smallest margin.
    pub min: f64,
    /// Largest margin.
    pub max: f64,
}

impl Settings {
    /// The settings of `spec` (values a validation would refuse fall back to the defaults).
    pub fn of(spec: &PolicySpec) -> Settings {
        let share = |v: Option<f64>, d: f64| v.filter(|v| *v > 0.0 && *v < 1.0).unwrap_or(d);
        let margin = |v: Option<f64>, d: f64| v.filter(|v| v.is_finite() && *v >= 0.0).unwrap_or(d);
        let min = margin(spec.min_headroom, DEFAULT_MIN_HEADROOM);
        Settings {
            target: share(spec.target_throttled, DEFAULT_TARGET_THROTTLED),
            min,
            max: margin(spec.max_headroom, DEFAULT_MAX_HEADROOM).max(min),
        }
    }
}

/// One replayed origin.
#[derive(Debug, Clone, PartialEq)]
pub struct Origin {
    /// Unix time of the origin.
    pub at: i64,
    /// The level the policy fitted on the history before it, no margin.
    pub level_rps: f64,
    /// The highest demand of the window after it.
    pub next_peak_rps: f64,
}

/// A window's day: its highest demand and its volume in units of the window's level, and its
/// highest demand against the same weekday's highest in the training history.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Day {
    /// Highest rate ÷ level.
    max: f64,
    /// Σ rate ÷ level over its minutes (level-minutes).
    volume: f64,
    /// Σ (rate ÷ level − 1)⁺: how much of the day was over the level.
    over: f64,
    /// Highest rate ÷ the highest of the same weekday in the training history (NaN: none):
    /// how much the day surprised its own kind of day.
    surprise: f64,
    /// The same weekday's training highest ÷ level: how close that kind of day comes to the
    /// level (a batch day 1, a quiet weekend 0.6).
    exposure: f64,
}

/// What the replay of a bucket's history found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Replay {
    /// Origins with a week of history before them (replayed or not).
    pub candidates: usize,
    /// The origins replayed, oldest first.
    pub origins: Vec<Origin>,
    /// `(rate ÷ level, level)` of every window minute over its level.
    over: Vec<(f64, f64)>,
    /// Σ rate over every window minute.
    total: f64,
    days: Vec<Day>,
}

/// A generalised Pareto tail over the days' surprises above their median.
#[derive(Debug, Clone, PartialEq)]
pub struct Tail {
    /// The threshold: the median surprise.
    pub threshold: f64,
    /// Shape ξ (0: exponential; > 0 heavier).
    pub shape: f64,
    /// Scale σ.
    pub scale: f64,
    /// Share of days above the threshold.
    rate: f64,
    /// Minutes a day over its level is over it, in effect (≥ 1).
    width: f64,
    /// The surprises at or below the threshold.
    below: Vec<f64>,
    /// `(exposure, volume)` of every day with a surprise.
    days: Vec<(f64, f64)>,
}

/// The series a policy is refitted on at each origin: the hourly maxima when the policy's
/// level depends on nothing else (`peak`'s max, the forecast: the same levels for a sixtieth
/// of the work on a per-minute history), else the series itself; spikes taken out.
struct Fits {
    /// The fitted series, spikes missing.
    cleaned: RateSeries,
    /// Its missing steps, counted up to each index.
    missing: Vec<u32>,
}

impl Fits {
    /// `cleaned` (starting on a whole hour), as its hourly maxima when `hourly` and its step
    /// divides an hour.
    fn new(cleaned: &RateSeries, hourly: bool) -> Fits {
        let step = cleaned.step.max(1);
        let cleaned = if hourly && step < 3600 && 3600 % step == 0 {
            let (h0, h) = crate::spikes::hourly_maxima(cleaned);
            RateSeries {
                start: h0,
                step: 3600,
                values: h.into_iter().map(|v| v as f32).collect(),
            }
        } else {
            cleaned.clone()
        };
        let mut n = 0u32;
        let mut missing = Vec::with_capacity(cleaned.values.len() + 1);
        missing.push(0);
        for x in &cleaned.values {
            n += u32::from(x.is_nan());
            missing.push(n);
        }
        Fits { cleaned, missing }
    }

    /// The end of the fitted series, whole steps only.
    fn end(&self) -> i64 {
        self.cleaned.end()
    }

    /// The fitted series before `at`, and how many of its steps count as history although
    /// missing: every one (spikes, censored minutes and gaps alike), so that the replay depends
    /// on the values of its span only; an origin whose fit then takes another policy than the
    /// one that sets the limit is not used (see [`compute`]).
    fn before(&self, at: i64) -> (RateSeries, usize) {
        let train = self.cleaned.slice(self.cleaned.start, at);
        let n = train.values.len();
        (train, self.missing[n] as usize)
    }
}

impl Replay {
    /// Replays `policy` at origins a day apart back from the end of `fits`, each window the
    /// week after its origin or what there is of it: fitted on `fits` before the origin with
    /// `spec` (whose margin must be fixed), scored on `series` (spikes and censored minutes
    /// already missing). Origins where the policy produced its level through another policy
    /// than `via` (a forecast falling back to peak) are skipped, and so are windows across
    /// `changed`, a rise of level the policy saw.
    fn run(
        policy: &dyn Policy,
        input: &PolicyInput<'_>,
        (fits, series): (&Fits, &RateSeries),
        spec: &PolicySpec,
        (via, changed): (&PolicyName, Option<i64>),
    ) -> Replay {
        let mut r = Replay::default();
        let Some(first) = series.first_present() else {
            return r;
        };
        let first = series.time_of(first);
        let step = series.step.max(1);
        let end = fits.end();
        let mut origins: Vec<i64> = (1..=MAX_ORIGINS as i64)
            .map(|k| end - k * DAY)
            .filter(|o| *o - first >= MIN_TRAIN_SECS)
            // A window across a rise of level the policy saw (a launch) would count the rise as
            // a surprise: the policy already follows it.
            .filter(|o| !changed.is_some_and(|c| *o <= c && c < *o + WINDOW_SECS))
            .collect();
        origins.reverse();
        r.candidates = origins.len();
        for at in origins {
            let (train, left_out) = fits.before(at);
            let fit = policy.compute(&PolicyInput {
                series: &train,
                left_out,
                spec,
                capacity_share_rps: None,
                now: chrono::DateTime::from_timestamp(at, 0).unwrap_or(input.now),
                ..*input
            });
            let fit = match fit {
                Ok(fit) => fit,
                // A plugin that fails here would fail again: its host's restarts are not spent
                // on a replay.
                Err(PolicyError::Plugin { .. }) => break,
                Err(_) => continue,
            };
            let level = fit.limit_rps;
            if &fit.policy != via || !level.is_finite() || level <= 0.0 {
                continue;
            }
            // After the change, until the policy sees it too: it could not have followed it yet.
            if changed.is_some_and(|c| at > c && level_change(&fit) != Some(c)) {
                continue;
            }
            // Each weekday's highest in the training history, days counted back from the origin.
            let per_day = (DAY / train.step.max(1)).max(1) as usize;
            let mut weekday = [f64::NAN; 7];
            for (k, day) in train.values.rchunks(per_day).enumerate() {
                let w = &mut weekday[6 - k % 7];
                for v in day.iter().filter(|v| !v.is_nan()) {
                    *w = w.max(f64::from(*v));
                }
            }
            let window = series.slice(at, at + WINDOW_SECS);
            let per_day = (DAY / step).max(1) as usize;
            // Window day k is the weekday of training slot k % 7 (slot 6: the day before).
            let mut next_peak = f64::NAN;
            for (k, day) in window.values.chunks(per_day).enumerate() {
                let usual = weekday[k % 7];
                let mut d = Day {
                    max: f64::NAN,
                    volume: 0.0,
                    over: 0.0,
                    surprise: f64::NAN,
                    exposure: usual / level,
                };
                for v in day.iter().filter(|v| !v.is_nan()).map(|v| f64::from(*v)) {
                    let ratio = v / level;
                    r.total += v;
                    d.volume += ratio;
                    if ratio > 1.0 {
                        r.over.push((ratio, level));
                        d.over += ratio - 1.0;
                    }
                    d.max = d.max.max(ratio);
                }
                if !d.max.is_nan() {
                    if usual > 0.0 {
                        d.surprise = d.max * level / usual;
                    }
                    next_peak = next_peak.max(d.max * level);
                    r.days.push(d);
                }
            }
            if !next_peak.is_nan() {
                r.origins.push(Origin {
                    at,
                    level_rps: level,
                    next_peak_rps: next_peak,
                });
            }
        }
        r
    }

    /// The share of the windows' requests over `level × (1 + h)`.
    pub fn replayed(&self, h: f64) -> f64 {
        if self.total <= 0.0 {
            return 0.0;
        }
        // A fold from +0: an empty sum is -0 in Rust, which the evidence would print.
        let over = self
            .over
            .iter()
            .map(|&(ratio, level)| level * (ratio - 1.0 - h).max(0.0))
            .fold(0.0, |a, b| a + b);
        over / self.total
    }

    /// The extreme-value fit of the days' surprises (each day's highest ÷ its weekday's
    /// training highest), when enough days exceed their median.
    pub fn tail(&self) -> Option<Tail> {
        let mut surprises: Vec<f64> = self
            .days
            .iter()
            .map(|d| d.surprise)
            .filter(|s| s.is_finite())
            .collect();
        let threshold = crate::spikes::median(&mut surprises)?;
        let ys: Vec<f64> = surprises
            .iter()
            .filter(|m| **m > threshold)
            .map(|m| m - threshold)
            .collect();
        if ys.len() < MIN_EXCEEDANCES {
            return None;
        }
        let n = ys.len() as f64;
        let mean = ys.iter().sum::<f64>() / n;
        let var = ys.iter().map(|y| (y - mean).powi(2)).sum::<f64>() / (n - 1.0);
        // Method of moments; ξ kept where the mean excess exists and the fit is stable.
        let (shape, scale) = if var > 0.0 && mean > 0.0 {
            let k = mean * mean / var;
            let shape = (0.5 * (1.0 - k)).clamp(-0.5, 0.45);
            (shape, mean * (1.0 - shape))
        } else {
            (0.0, mean.max(f64::MIN_POSITIVE))
        };
        // How many minutes a day over its level spends over it, in effect: Σ excess ÷ the
        // highest excess, the median over the days that went over.
        let mut widths: Vec<f64> = self
            .days
            .iter()
            .filter(|d| d.max > 1.0)
            .map(|d| (d.over / (d.max - 1.0)).max(1.0))
            .collect();
        let width = crate::spikes::median(&mut widths).unwrap_or(1.0);
        Some(Tail {
            threshold,
            shape,
            scale,
            rate: n / surprises.len() as f64,
            width,
            below: surprises.into_iter().filter(|s| *s <= threshold).collect(),
            days: self
                .days
                .iter()
                .filter(|d| d.surprise.is_finite())
                .map(|d| (d.exposure, d.volume))
                .collect(),
        })
    }
}

impl Tail {
    /// The expected share of the requests over `level × (1 + h)`: for each replayed day, a
    /// surprise drawn from the fit (the observed ones below the threshold, the Pareto tail
    /// above) on that day's exposure.
    pub fn throttled(&self, h: f64) -> f64 {
        let volume: f64 = self.days.iter().map(|d| d.1).sum();
        if volume <= 0.0 {
            return 0.0;
        }
        let over: f64 = self
            .days
            .iter()
            .filter(|d| d.0 > 0.0)
            .map(|&(exposure, _)| exposure * self.excess_over((1.0 + h) / exposure))
            .sum();
        over * self.width / volume
    }

    /// E[(S − b)⁺] of a day's surprise S: the observed surprises below the threshold, the
    /// fitted tail above it.
    fn excess_over(&self, b: f64) -> f64 {
        let n = self.below.len() as f64 / (1.0 - self.rate).max(f64::MIN_POSITIVE);
        let body: f64 = self.below.iter().map(|s| (s - b).max(0.0)).sum::<f64>() / n.max(1.0);
        let z = b - self.threshold;
        let tail = if z < 0.0 {
            self.scale / (1.0 - self.shape) - z
        } else {
            self.mean_excess_over(z)
        };
        body + self.rate * tail
    }

    /// E[(Y − z)⁺] of the fitted Pareto tail, z ≥ 0.
    fn mean_excess_over(&self, z: f64) -> f64 {
        let (xi, sigma) = (self.shape, self.scale);
        if xi.abs() < 1e-9 {
            return sigma * (-z / sigma).exp();
        }
        let t = 1.0 + xi * z / sigma;
        if t <= 0.0 {
            return 0.0; // beyond the end of a bounded tail
        }
        t.powf(-1.0 / xi) * (sigma + xi * z) / (1.0 - xi)
    }
}

/// The start of the rise of level a proposal's evidence names (`level_change` of kind
/// `shift_up`): a fall or a dip makes no surprise to leave out.
fn level_change(p: &Proposal) -> Option<i64> {
    let l = &p.evidence["level_change"];
    (l["kind"] == "shift_up").then_some(())?;
    l["from"]
        .as_str()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.timestamp())
}

/// The smallest margin in `[lo, hi]` at which `throttled` is at most `target` (`throttled`
/// falls as the margin grows); `None` when even `hi` throttles more.
fn smallest(lo: f64, hi: f64, target: f64, throttled: impl Fn(f64) -> f64) -> Option<f64> {
    // A share that is not a number (an infinite rate in the series) meets no target.
    let meets = |h: f64| throttled(h) <= target;
    if meets(lo) {
        return Some(lo);
    }
    if !meets(hi) {
        return None;
    }
    let (mut a, mut b) = (lo, hi);
    while b - a > 1e-4 {
        let m = (a + b) / 2.0;
        if meets(m) {
            b = m;
        } else {
            a = m;
        }
    }
    Some(b)
}

/// The margin `auto` chose for a bucket, and what it came from: small (the memo keeps one a
/// bucket).
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// The margin.
    pub headroom: f64,
    /// The policy that produced the replayed levels (`None`: nothing replayed).
    pub via: Option<PolicyName>,
    /// Origins with a week of history before them.
    pub candidates: usize,
    /// The origins replayed.
    pub origins: Vec<Origin>,
    /// The margin the replayed windows alone need (`None`: more than `max_headroom`).
    pub by_replay: Option<f64>,
    /// The margin the tail fit needs (`None`: more than `max_headroom`), when there is a fit.
    pub by_tail: Option<Option<f64>>,
    /// The replayed windows' throttling at the chosen margin.
    pub replayed: f64,
    /// The tail fit (threshold, shape, scale) and its throttling at the chosen margin.
    pub tail: Option<(f64, f64, f64, f64)>,
    /// The bucket needed more than `max_headroom`.
    pub review: bool,
}

/// Chooses the margin from `replay` with `settings`, the levels produced by `via`.
pub fn choose(replay: Replay, settings: Settings, via: Option<PolicyName>) -> Choice {
    let Settings { target, min, max } = settings;
    if replay.origins.is_empty() {
        return Choice {
            headroom: DEFAULT_HEADROOM.clamp(min, max),
            via: None,
            candidates: replay.candidates,
            origins: Vec::new(),
            by_replay: None,
            by_tail: None,
            replayed: 0.0,
            tail: None,
            review: false,
        };
    }
    let by_replay = smallest(min, max, target, |h| replay.replayed(h));
    let tail = replay.tail();
    let by_tail = tail
        .as_ref()
        .map(|t| smallest(min, max, target, |h| t.throttled(h)));
    let (headroom, review) = match (by_replay, by_tail) {
        // Rounded up to a thousandth: the margin written is the margin shown.
        (Some(a), None | Some(Some(_))) => {
            let need = a.max(by_tail.flatten().unwrap_or(min));
            (((need * 1000.0).ceil() / 1000.0).min(max), false)
        }
        _ => (max, true),
    };
    Choice {
        headroom,
        via,
        candidates: replay.candidates,
        replayed: replay.replayed(headroom),
        tail: tail.map(|t| (t.threshold, t.shape, t.scale, t.throttled(headroom))),
        origins: replay.origins,
        by_replay,
        by_tail,
        review,
    }
}

/// `policy` on `input` with `headroom: auto` resolved: the policy's own proposal at the margin
/// [`choose`] picked from a replay of the bucket's history, the choice in the evidence
/// (`headroom_auto`) and in its explanation.
pub fn compute(policy: &dyn Policy, input: &PolicyInput<'_>) -> Result<Proposal, PolicyError> {
    let settings = Settings::of(input.spec);
    // The margin is chosen from the whole days of the history (UTC): the same span, so the same
    // margin, all day; a run every few minutes finds it in the memo instead of replaying.
    let s = input.series;
    let from = (s.start + DAY - 1).div_euclid(DAY) * DAY;
    let cut = s.end().div_euclid(DAY) * DAY;
    let history = s.slice(from, cut.max(from));
    let key = memo_key(policy, input, &history);
    let choice = match memo::get(key) {
        Some(hit) => hit,
        None => {
            let choice = replay_and_choose(policy, input, &history, settings);
            memo::put(key, cut, choice.clone());
            choice
        }
    };
    let with = |h: f64| {
        let spec = PolicySpec {
            headroom: Some(Headroom::Fixed(h)),
            ..input.spec.clone()
        };
        policy.compute(&PolicyInput {
            spec: &spec,
            ..*input
        })
    };
    let mut applied = choice.headroom;
    let mut p = with(applied)?;
    let mut line = None;
    if choice.via.as_ref().is_some_and(|v| *v != p.policy) {
        // The replay fitted another policy than the one that sets the limit (a forecast that
        // falls back to peak on a history with gaps): its surprises are not this limit's.
        let h = DEFAULT_HEADROOM.clamp(settings.min, settings.max);
        applied = h;
        p = with(h)?;
        line = Some(format!(
            "margin auto: the replay fitted {} but {} set the limit, the default {h}",
            choice.via.as_ref().map_or(String::new(), |v| v.to_string()),
            p.policy
        ));
    }
    let (mut evidence, default_line) = evidence(&choice, settings);
    let line = line.unwrap_or(default_line);
    if let Some(o) = evidence.as_object_mut() {
        o.insert("why".into(), json!(line));
    }
    if let Some(o) = p.evidence.as_object_mut() {
        // A plugin's evidence need not say which margin it applied: the one handed to it.
        o.entry("headroom").or_insert(json!(applied));
        o.insert("headroom_auto".into(), evidence);
        if let Some(e) = o.get("explain").and_then(Value::as_str) {
            let e = format!("{e}; {line}");
            o.insert("explain".into(), json!(e));
        }
    }
    Ok(p)
}

thread_local! {
    /// Replays this thread ran (tests count them to see the memo work).
    static REPLAYS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Replays run on this thread so far.
pub fn replays_on_this_thread() -> usize {
    REPLAYS.with(|r| r.get())
}

/// The replay of `history` (a bucket's whole days) and the margin chosen from it.
fn replay_and_choose(
    policy: &dyn Policy,
    input: &PolicyInput<'_>,
    history: &RateSeries,
    settings: Settings,
) -> Choice {
    REPLAYS.with(|r| r.set(r.get() + 1));
    // The replay fits without margin, bounds or the short-history widening: a level.
    let level_spec = PolicySpec {
        headroom: Some(Headroom::Fixed(0.0)),
        floor_rps: None,
        ceiling_rps: None,
        confident_history: Some(schema::HumanDuration(std::time::Duration::from_secs(60))),
        ..input.spec.clone()
    };
    let input = &PolicyInput {
        series: history,
        left_out: 0,
        capacity_share_rps: None,
        ..*input
    };
    let (h0, hours) = crate::spikes::hourly_maxima(history);
    let spikes = crate::spikes::spikes(h0, &hours, crate::spike_factor(input.spec));
    let cleaned = (!spikes.is_empty()).then(|| crate::spikes::without(history, &spikes));
    let series = cleaned.as_ref().unwrap_or(history);
    let hourly = input.spec.percentile.is_none()
        && matches!(policy.name(), PolicyName::Peak | PolicyName::Forecast);
    let fits = Fits::new(series, hourly);
    // The level at the end, on the same footing as the replayed ones: which policy produced it
    // (a forecast may fall back to peak) and the rise of level it saw.
    let (all, left_out) = fits.before(fits.end());
    let now = policy.compute(&PolicyInput {
        series: &all,
        left_out,
        spec: &level_spec,
        ..*input
    });
    match now {
        Ok(now) => {
            let replay = Replay::run(
                policy,
                input,
                (&fits, series),
                &level_spec,
                (&now.policy, level_change(&now)),
            );
            choose(replay, settings, Some(now.policy))
        }
        Err(_) => choose(Replay::default(), settings, None),
    }
}

/// What the choice depends on: the policy, its spec, the bucket (a plugin sees it), the
/// history's grid and every value; `FNV-1a` over them.
fn memo_key(policy: &dyn Policy, input: &PolicyInput<'_>, history: &RateSeries) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    };
    eat(policy.name().to_string().as_bytes());
    eat(serde_json::to_string(input.spec)
        .unwrap_or_default()
        .as_bytes());
    for part in [Some(input.service), input.caller, input.procedure] {
        eat(part.unwrap_or("\u{0}").as_bytes());
    }
    eat(&history.start.to_le_bytes());
    eat(&history.step.to_le_bytes());
    for x in &history.values {
        h = (h ^ u64::from(x.to_bits())).wrapping_mul(0x0100_0000_01b3);
    }
    h ^ (history.values.len() as u64)
}

/// The margins chosen today, by [`memo_key`]: a run every few minutes replays a bucket once a
/// day. Only the newest day's choices are kept, at most [`memo::MAX_ENTRIES`] (a few hundred
/// bytes each).
mod memo {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use super::Choice;

    /// At most this many buckets' choices; more empties the memo.
    pub(super) const MAX_ENTRIES: usize = 100_000;

    /// The newest day seen and its choices.
    static MEMO: Mutex<Option<(i64, HashMap<u64, Choice>)>> = Mutex::new(None);

    pub(super) fn get(key: u64) -> Option<Choice> {
        let memo = MEMO.lock().unwrap_or_else(|e| e.into_inner());
        memo.as_ref()?.1.get(&key).cloned()
    }

    pub(super) fn put(key: u64, day: i64, choice: Choice) {
        let mut memo = MEMO.lock().unwrap_or_else(|e| e.into_inner());
        let (newest, map) = memo.get_or_insert_with(|| (day, HashMap::new()));
        if day > *newest {
            // A new day: yesterday's choices are not asked for again.
            *newest = day;
            map.clear();
        }
        if map.len() >= MAX_ENTRIES {
            map.clear();
        }
        map.insert(key, choice);
    }
}

/// The evidence of a choice, and its line in the explanation.
fn evidence(c: &Choice, s: Settings) -> (Value, String) {
    let bounds =
        json!({"target_throttled": s.target, "min_headroom": s.min, "max_headroom": s.max});
    if c.origins.is_empty() {
        let line = if c.candidates == 0 {
            format!(
                "margin auto: too little history to replay (a week before a day), the default {}",
                c.headroom
            )
        } else {
            format!(
                "margin auto: none of {} origins could be replayed (the policy fell back or failed), the default {}",
                c.candidates, c.headroom
            )
        };
        let mut v =
            json!({"chosen": round3(c.headroom), "origins": 0, "review": false, "why": line});
        merge(&mut v, bounds);
        return (v, line);
    }
    let surprises: Vec<Value> = c
        .origins
        .iter()
        .map(|o| {
            json!({
                "origin": chrono::DateTime::from_timestamp(o.at, 0).map(|t| t.to_rfc3339()),
                "level_rps": round3(o.level_rps),
                "next_peak_rps": round3(o.next_peak_rps),
                "surprise": round3(o.next_peak_rps / o.level_rps),
            })
        })
        .collect();
    let worst = c
        .origins
        .iter()
        .map(|o| o.next_peak_rps / o.level_rps)
        .fold(f64::NAN, f64::max);
    let tail = c.tail.map(|t| t.3);
    let pct = |v: f64| format!("{:.4} %", v * 100.0);
    let line = if c.review {
        format!(
            "margin auto {:.2} = max_headroom: review, too noisy for a quota alone ({} origins replayed throttle {}, target {})",
            c.headroom,
            c.origins.len(),
            pct(c.replayed.max(tail.unwrap_or(0.0))),
            pct(s.target)
        )
    } else {
        format!(
            "margin auto {:.2} ({} origins replayed, worst surprise {:.2}×)",
            c.headroom,
            c.origins.len(),
            worst,
        )
    };
    let mut v = json!({
        "chosen": round3(c.headroom),
        "origins": c.origins.len(),
        "window_days": WINDOW_SECS / DAY,
        "needed_by_replay": c.by_replay.map(round3),
        "needed_by_tail": c.by_tail.flatten().map(round3),
        "replayed_throttled": c.replayed,
        "tail_throttled": tail,
        "tail_fit": c.tail.map(|t| json!({
            "threshold": round3(t.0), "shape": round3(t.1), "scale": t.2,
        })),
        "worst_surprise": round3(worst),
        "surprises": surprises,
        "review": c.review,
        "why": line,
    });
    merge(&mut v, bounds);
    (v, line)
}

/// `extra`'s members added to `v` (both objects).
fn merge(v: &mut Value, extra: Value) {
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peak::Peak;

    fn input<'a>(s: &'a RateSeries, spec: &'a PolicySpec) -> PolicyInput<'a> {
        PolicyInput {
            service: "s",
            caller: Some("c"),
            procedure: None,
            series: s,
            left_out: 0,
            spec,
            capacity_share_rps: None,
            now: chrono::Utc::now(),
        }
    }

    fn auto() -> PolicySpec {
        PolicySpec {
            headroom: Some(Headroom::Auto),
            ..Default::default()
        }
    }

    /// `days` of a daily cycle peaking at 100 rps, each minute × (1 + noise(i)).
    fn daily(days: usize, noise: impl Fn(usize) -> f64) -> RateSeries {
        RateSeries {
            start: 0,
            step: 60,
            values: (0..days * 1440)
                .map(|i| {
                    let h = (i % 1440) as f64 / 60.0;
                    let cycle = 0.75 + 0.25 * (2.0 * std::f64::consts::PI * (h - 9.0) / 24.0).sin();
                    (100.0 * cycle * (1.0 + noise(i))) as f32
                })
                .collect(),
        }
    }

    fn unit(i: usize, seed: u64) -> f64 {
        let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((x ^ (x >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    #[test]
    fn a_smooth_bucket_gets_the_smallest_margin() {
        let s = daily(28, |i| 0.02 * (2.0 * unit(i, 1) - 1.0));
        let p = Peak.compute(&input(&s, &auto())).unwrap();
        let a = &p.evidence["headroom_auto"];
        assert_eq!(a["chosen"], 0.03, "{a}");
        assert_eq!(a["origins"], MAX_ORIGINS, "{a}");
        assert_eq!(p.evidence["headroom"], 0.03);
        assert!(
            (p.limit_rps / s.max().unwrap() - 1.03).abs() < 1e-6,
            "{p:?}"
        );
        let why = p.evidence["explain"].as_str().unwrap();
        assert!(
            why.ends_with("; margin auto 0.03 (14 origins replayed, worst surprise 1.00×)"),
            "{why}"
        );
    }

    #[test]
    fn a_heavy_tailed_bucket_gets_a_wider_margin_than_a_smooth_one() {
        // Pareto (α = 2.5) bursts on 0.5 % of the minutes.
        let noise = |i: usize| {
            if unit(i, 2) < 0.005 {
                0.3 * ((1.0 - unit(i, 3)).powf(-1.0 / 2.5) - 1.0)
            } else {
                0.0
            }
        };
        let s = daily(28, noise);
        // On its 99th percentile, the bursts above it are the surprises.
        let spec = PolicySpec {
            percentile: Some(99.0),
            ..auto()
        };
        let p = Peak.compute(&input(&s, &spec)).unwrap();
        let a = &p.evidence["headroom_auto"];
        let h = a["chosen"].as_f64().unwrap();
        // The worked bucket of docs/rlc-policies.md: the replayed weeks alone ask for 0.356,
        // the tail fit for more.
        assert_eq!(a["worst_surprise"], 2.28, "{a}");
        assert_eq!(a["needed_by_replay"], 0.356, "{a}");
        assert_eq!(a["needed_by_tail"], 0.61, "{a}");
        assert_eq!(h, 0.611, "{a}");
        assert_eq!(a["tail_fit"]["shape"], 0.17, "{a}");
        // The margin meets the target on the replay it came from.
        assert!(a["replayed_throttled"].as_f64().unwrap() <= 0.0001, "{a}");
        assert!(a["tail_throttled"].as_f64().unwrap() <= 0.0001, "{a}");
        // And the level it multiplies is the policy's own: p99 × (1 + h).
        let p99 = s.percentile(99.0).unwrap();
        assert!((p.limit_rps - p99 * (1.0 + h)).abs() < 1e-3 * p.limit_rps);
    }

    #[test]
    fn a_bucket_too_noisy_for_a_quota_is_flagged_at_max_headroom() {
        // Traffic tripling every week: no margin under 1.0 covers the next week.
        let s = RateSeries {
            start: 0,
            step: 60,
            values: (0..28 * 1440)
                .map(|i| 100.0 * 3f32.powf(i as f32 / (7.0 * 1440.0)))
                .collect(),
        };
        let p = Peak.compute(&input(&s, &auto())).unwrap();
        let a = &p.evidence["headroom_auto"];
        assert_eq!(a["chosen"], 1.0, "{a}");
        assert_eq!(a["review"], true, "{a}");
        assert!(p.evidence["explain"].as_str().unwrap().contains("review"));
    }

    #[test]
    fn too_little_history_keeps_the_default_margin() {
        // A week: no origin with a week before it and a day after.
        let s = daily(7, |_| 0.0);
        let p = Peak.compute(&input(&s, &auto())).unwrap();
        assert_eq!(p.evidence["headroom_auto"]["origins"], 0);
        assert_eq!(p.evidence["headroom"], DEFAULT_HEADROOM);
    }

    #[test]
    fn the_margin_stays_within_its_bounds() {
        let spec = PolicySpec {
            min_headroom: Some(0.1),
            max_headroom: Some(0.2),
            ..auto()
        };
        let s = daily(28, |_| 0.0);
        let p = Peak.compute(&input(&s, &spec)).unwrap();
        assert_eq!(p.evidence["headroom"], 0.1);
        let grows = RateSeries {
            start: 0,
            step: 60,
            values: (0..28 * 1440).map(|i| 100.0 + i as f32 / 100.0).collect(),
        };
        let p = Peak.compute(&input(&grows, &spec)).unwrap();
        assert_eq!(p.evidence["headroom"], 0.2);
        assert_eq!(p.evidence["headroom_auto"]["review"], true);
    }

    /// A weekly batch at 20× the rest of the week: the quiet days' maxima are far under the
    /// level and the batch days' at it; neither is a surprise for its own kind of day.
    #[test]
    fn a_weekly_batch_is_not_a_heavy_tail() {
        let s = RateSeries {
            start: 0,
            step: 60,
            values: (0..28 * 1440)
                .map(|i| {
                    let batch = i / 1440 % 7 == 3 && (120..240).contains(&(i % 1440));
                    let v = if batch { 400.0 } else { 20.0 };
                    (v * (1.0 + 0.05 * (2.0 * unit(i, 4) - 1.0))) as f32
                })
                .collect(),
        };
        let p = Peak.compute(&input(&s, &auto())).unwrap();
        let a = &p.evidence["headroom_auto"];
        assert_eq!(a["chosen"], 0.03, "{a}");
        assert!(a["tail_fit"].is_object(), "{a}");
    }

    /// The same bucket five minutes later (the history's window slid, the same values where
    /// they overlap) is not replayed again: the whole days are the same, so is the margin.
    #[test]
    fn a_run_later_the_same_day_finds_the_margin_in_the_memo() {
        // A 28-day lookback ending at 10:00, then at 10:05.
        let n = 28 * 1440;
        let all = daily(30, |i| 0.05 * (2.0 * unit(i, 11) - 1.0));
        let at = |from: usize| RateSeries {
            start: (600 + from as i64) * 60,
            step: 60,
            values: all.values[600 + from..600 + from + n].to_vec(),
        };
        let before = replays_on_this_thread();
        let first = Peak.compute(&input(&at(0), &auto())).unwrap();
        assert_eq!(replays_on_this_thread(), before + 1);
        let later = Peak.compute(&input(&at(5), &auto())).unwrap();
        assert_eq!(replays_on_this_thread(), before + 1, "found in the memo");
        assert_eq!(
            first.evidence["headroom_auto"],
            later.evidence["headroom_auto"]
        );
        // Another bucket with the same values is its own entry.
        let (later_series, spec) = (at(5), auto());
        let other = PolicyInput {
            caller: Some("d"),
            ..input(&later_series, &spec)
        };
        Peak.compute(&other).unwrap();
        assert_eq!(replays_on_this_thread(), before + 2);
    }

    /// A bucket capped by its share of planned capacity: the cap bounds the limit, not the
    /// levels replayed (the demand above the cap is no surprise).
    #[test]
    fn a_capacity_cap_is_not_a_surprise() {
        let (s, spec) = (daily(28, |i| 0.02 * (2.0 * unit(i, 12) - 1.0)), auto());
        let capped = PolicyInput {
            capacity_share_rps: Some(60.0),
            ..input(&s, &spec)
        };
        let p = Peak.compute(&capped).unwrap();
        let a = &p.evidence["headroom_auto"];
        assert_eq!(
            (a["chosen"].as_f64(), &a["review"]),
            (Some(0.03), &json!(false)),
            "{a}"
        );
        assert_eq!(p.limit_rps, 60.0);
    }

    /// The refits on hourly maxima give `peak` the levels the per-minute series gives it.
    #[test]
    fn hourly_refits_give_the_per_minute_levels() {
        let s = daily(28, |i| 0.3 * unit(i, 13).powi(8));
        let spec = PolicySpec {
            headroom: Some(Headroom::Fixed(0.0)),
            ..Default::default()
        };
        let (hourly, minutes) = (Fits::new(&s, true), Fits::new(&s, false));
        assert_eq!(hourly.cleaned.step, 3600);
        for k in 7..28 {
            let at = k * DAY;
            let level = |f: &Fits| {
                let (train, left_out) = f.before(at);
                Peak.compute(&PolicyInput {
                    left_out,
                    ..input(&train, &spec)
                })
                .unwrap()
                .limit_rps
            };
            assert_eq!(level(&hourly), level(&minutes), "origin day {k}");
        }
    }

    #[test]
    fn the_tail_fit_recovers_an_exponential_tail() {
        // Daily maxima 1 + Exp(0.05) around a median: shape ≈ 0, scale ≈ 0.05.
        let days: Vec<Day> = (0..400)
            .map(|i| {
                let s = 1.0 + 0.05 * -(1.0 - unit(i, 9)).ln();
                Day {
                    max: s,
                    volume: 1000.0,
                    over: 0.0,
                    surprise: s,
                    exposure: 1.0,
                }
            })
            .collect();
        let r = Replay {
            days,
            ..Default::default()
        };
        let t = r.tail().unwrap();
        assert!(t.shape.abs() < 0.15, "{t:?}");
        assert!((t.scale - 0.05).abs() < 0.01, "{t:?}");
        // More margin, less throttling.
        assert!(t.throttled(0.3) < t.throttled(0.1));
        assert!(t.throttled(0.1) < t.throttled(0.0));
    }
}
