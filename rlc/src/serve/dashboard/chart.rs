//! What the bucket page's charts share: the frame (geometry, rate and time axes), the SVG
//! paths of a series, the tick ladders and the charts' CSS. Below the pages that draw charts
//! ([`super::bucket`], [`super::lookback`], [`super::run_page`]); uses only the formatting
//! helpers of [`super`].

use std::fmt::Write;

use chrono::{DateTime, Utc};
use maud::{html, Markup};

use super::rate;

/// Chart geometry (px): the plot sits between the margins; the legend is above it. The
/// height is each chart's own ([`Frame::new`]).
pub(super) const W: f64 = 900.0;
pub(super) const LEFT: f64 = 64.0;
const RIGHT: f64 = 12.0;
pub(super) const TOP: f64 = 30.0;
const BOTTOM: f64 = 26.0;

/// A chart's frame: its height, the window `[start, end)` cut into `steps` equal steps, and the
/// rate scale (round ticks from 0 to `top`, just above the highest value drawn).
pub(super) struct Frame {
    pub height: f64,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
    steps: usize,
    ticks: Vec<f64>,
    /// The rate at the top of the plot (the last tick).
    pub top: f64,
}

impl Frame {
    /// The frame of a chart `height` px high over `[start, end)` in `steps` steps (at least
    /// one), its scale reaching above `max`.
    pub fn new(
        height: f64,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
        steps: usize,
        max: f64,
    ) -> Self {
        let (ticks, top) = rate_ticks(max);
        Self {
            height,
            start,
            end,
            steps: steps.max(1),
            ticks,
            top,
        }
    }

    /// Width of the plot (px).
    pub fn plot_w(&self) -> f64 {
        W - LEFT - RIGHT
    }

    /// Height of the plot (px).
    pub fn plot_h(&self) -> f64 {
        self.height - TOP - BOTTOM
    }

    /// Where step `i` starts.
    pub fn x(&self, i: usize) -> f64 {
        LEFT + self.plot_w() * i as f64 / self.steps as f64
    }

    /// The middle of step `i`.
    pub fn mid(&self, i: usize) -> f64 {
        self.x(i) + self.plot_w() / self.steps as f64 / 2.0
    }

    /// Where rate `v` sits.
    pub fn y(&self, v: f64) -> f64 {
        TOP + self.plot_h() * (1.0 - v / self.top)
    }

    /// Where time `t` sits.
    fn tx(&self, t: DateTime<Utc>) -> f64 {
        let span = (self.end - self.start).num_seconds().max(1) as f64;
        LEFT + self.plot_w() * (t - self.start).num_seconds() as f64 / span
    }

    /// The axes: the rate grid with its labels and unit, the time axis with ticks at round
    /// times and "UTC". SVG elements get an end tag each: in HTML, `<line …>` without one
    /// would hold what follows it.
    pub fn axes(&self) -> Markup {
        let (plot_w, plot_h) = (self.plot_w(), self.plot_h());
        html! {
            // Rate axis: 0, a quarter, half, three quarters and the top of the scale.
            @for v in self.ticks.iter().copied() {
                line class="grid" x1=(LEFT) x2=(dec1(LEFT + plot_w)) y1=(dec1(self.y(v)))
                    y2=(dec1(self.y(v))) {}
                text class="tick" x=(dec1(LEFT - 4.0)) y=(dec1(self.y(v) + 4.0)) text-anchor="end" {
                    (rate(v))
                }
            }
            text class="unit" x="12" y=(dec1(TOP + plot_h / 2.0)) text-anchor="middle"
                transform={ "rotate(-90 12 " (dec1(TOP + plot_h / 2.0)) ")" } { "requests/s" }
            // Time axis: ticks at round times, UTC.
            line class="axis" x1=(LEFT) x2=(dec1(LEFT + plot_w)) y1=(dec1(TOP + plot_h))
                y2=(dec1(TOP + plot_h)) {}
            @for (t, label) in time_ticks(self.start, self.end) {
                @let tx = self.tx(t);
                line class="tick" x1=(dec1(tx)) x2=(dec1(tx)) y1=(dec1(TOP + plot_h))
                    y2=(dec1(TOP + plot_h + 4.0)) {}
                text class="tick time" x=(dec1(tx)) y=(dec1(self.height - 6.0)) text-anchor="middle" { (label) }
            }
            text class="tick" x=(dec1(LEFT + plot_w)) y=(dec1(TOP - 6.0)) text-anchor="end" { "UTC" }
        }
    }
}

/// An SVG path through `values` (x by index): a missing value ends the line, so gaps show as
/// gaps. An isolated point is drawn as a dot.
pub(super) fn path(
    values: &[Option<f64>],
    x: impl Fn(usize) -> f64,
    y: impl Fn(f64) -> f64,
) -> String {
    let mut d = String::new();
    let mut open = false;
    for (i, v) in values.iter().enumerate() {
        match v {
            Some(v) => {
                let _ = write!(
                    d,
                    "{}{:.1} {:.1} ",
                    if open { "L" } else { "M" },
                    x(i),
                    y(*v)
                );
                let lone = !open && values.get(i + 1).is_none_or(|n| n.is_none());
                if lone {
                    d.push_str("l0.1 0 ");
                }
                open = true;
            }
            None => open = false,
        }
    }
    d.trim_end().to_string()
}

/// A step line through `values`: each value held flat over its whole step (`x(i)` to
/// `x(i + 1)`), joined by vertical segments; a missing value ends it.
pub(super) fn step_path(
    values: &[Option<f64>],
    x: impl Fn(usize) -> f64,
    y: impl Fn(f64) -> f64,
) -> String {
    let mut d = String::new();
    let mut open = false;
    for (i, v) in values.iter().enumerate() {
        match v {
            Some(v) => {
                let _ = write!(
                    d,
                    "{}{:.1} {:.1} L{:.1} {:.1} ",
                    if open { "L" } else { "M" },
                    x(i),
                    y(*v),
                    x(i + 1),
                    y(*v)
                );
                open = true;
            }
            None => open = false,
        }
    }
    d.trim_end().to_string()
}

/// `v` with one decimal: coordinates and figures.
pub(super) fn dec1(v: f64) -> String {
    format!("{v:.1}")
}

/// Round rate ticks from 0 up to above `max` (a step of 1, 2, 2.5 or 5 × 10^k, four to six
/// intervals), and the scale's top (the last tick).
pub fn rate_ticks(max: f64) -> (Vec<f64>, f64) {
    let max = if max.is_finite() { max.max(1.0) } else { 1.0 };
    let raw = max / 4.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    // A little room above the highest value.
    let n = ((max * 1.05) / step).ceil().max(1.0) as usize;
    let ticks: Vec<f64> = (0..=n).map(|i| i as f64 * step).collect();
    let top = n as f64 * step;
    (ticks, top)
}

/// Time ticks for `[start, end)`: the first interval of a fixed ladder (1 min to 7 days) that
/// gives at most 8 ticks, at its multiples (unix time, so days start at 00:00 UTC), each
/// with its label (`HH:MM`, with the date when the window spans more than a day).
pub fn time_ticks(start: DateTime<Utc>, end: DateTime<Utc>) -> Vec<(DateTime<Utc>, String)> {
    const LADDER: [i64; 14] = [
        60, 120, 300, 600, 900, 1_800, 3_600, 7_200, 10_800, 21_600, 43_200, 86_400, 172_800,
        604_800,
    ];
    let span = (end - start).num_seconds().max(60);
    let every = LADDER
        .into_iter()
        .find(|s| span / s <= 8)
        .unwrap_or(604_800);
    let first = (start.timestamp() + every - 1).div_euclid(every) * every;
    let long = span > 86_400;
    (0..)
        .map(|k| first + k * every)
        .take_while(|t| *t <= end.timestamp())
        .filter_map(|t| DateTime::<Utc>::from_timestamp(t, 0))
        .map(|t| {
            let label = if long && every >= 86_400 {
                t.format("%b %-d").to_string()
            } else if long {
                t.format("%b %-d %H:%M").to_string()
            } else {
                t.format("%H:%M").to_string()
            };
            (t, label)
        })
        .collect()
}

pub(super) const CHART_CSS: &str = "
header code { color: #fff; font-size: inherit; }
header a { color: #c9d6ea; }
.windows a, .windows b { margin: 0 4px; }
figure.chart { margin: 8px 0 16px; }
figure.chart figcaption { font-size: 13px; color: #56627a; }
svg { max-width: 100%; height: auto; background: #fbfcfe; border: 1px solid #edf0f5; }
svg path { fill: none; stroke-width: 2; stroke-linecap: round; stroke-linejoin: round; }
svg path.offered { stroke: #1f6feb; }
svg path.limit { stroke: #7a8499; stroke-dasharray: 6 4; }
svg path.virtual-drops { stroke: #e36209; }
svg path.drops { stroke: #c1121f; }
svg path.admitted { stroke: #2a9d4b; stroke-width: 6; opacity: .35; }
svg circle.admitted { opacity: .45; }
svg line.key { stroke-width: 3; }
svg line.key.offered, svg circle.offered { stroke: #1f6feb; fill: #1f6feb; }
svg line.key.admitted, svg circle.admitted { stroke: #2a9d4b; fill: #2a9d4b; }
svg line.key.admitted { stroke-width: 6; opacity: .35; }
svg line.key.limit { stroke: #7a8499; stroke-dasharray: 6 4; }
svg line.key.virtual-drops, svg circle.virtual-drops { stroke: #e36209; fill: #e36209; }
svg line.key.drops, svg circle.drops { stroke: #c1121f; fill: #c1121f; }
svg line.axis, svg line.tick { stroke: #9aa5b8; }
svg .tier-critical-plus { fill: #1b4332; }
svg .tier-critical { fill: #40916c; }
svg .tier-sheddable-plus { fill: #f4a261; }
svg .tier-sheddable { fill: #e76f51; }
svg text.legend { font-size: 12px; fill: #39445a; }
svg text.unit { font-size: 11px; fill: #56627a; }
.big { font-size: 22px; font-weight: 700; }
svg path.history { stroke: #1f6feb; stroke-width: 1.5; }
svg line.key.history { stroke: #1f6feb; }
svg line.level { stroke-width: 1.5; }
svg line.level.statistic, svg line.level.forecast { stroke: #e36209; stroke-dasharray: 4 3; }
svg line.level.proposed { stroke: #2a9d4b; }
svg text.level { font-size: 11px; font-weight: 600; }
svg text.level.statistic, svg text.level.forecast { fill: #b24d05; }
svg text.level.proposed { fill: #1e7a3a; }
svg rect.headroom { fill: #2a9d4b; opacity: .10; }
pre.summary { white-space: pre-wrap; font-size: 13px; background: #f7f9fc; padding: 10px; }
svg rect.gap { fill: #eceff4; }
svg line.grid { stroke: #e3e7ee; }
svg text.tick { font-size: 11px; fill: #56627a; }
.key { padding: 0 6px; border-left: 14px solid; margin-right: 6px; }
.key.offered { border-color: #1f6feb; } .key.limit { border-color: #7a8499; }
.key.virtual-drops { border-color: #e36209; } .key.drops { border-color: #c1121f; }
.key.admitted { border-color: #2a9d4b; }
table.facts th { text-transform: none; font-size: 13px; width: 320px; }
tr.proposed td { color: #7a8499; font-style: italic; }
";
