//! The history a bucket's quota is computed from, on its page: the bucket's series of the
//! daemon's history snapshot (the lookback, `history.lookback`: 28 days by default), cut into
//! at most [`MAX_POINTS`] steps each holding its busiest sample (a one-minute peak stays
//! visible), with what the latest computed plan read from it (the statistic or forecast bound,
//! the headroom, the limit it proposes). Read from memory only: nothing is pulled or computed
//! for a page (before the first pull or plan the chart says so).

use chrono::{DateTime, Utc};
use maud::{html, Markup};
use schemars::JsonSchema;
use serde::Serialize;

use super::chart::{dec1, path, Frame, LEFT, W};
use super::{rate, when};

/// Most points drawn.
pub const MAX_POINTS: usize = 360;

/// The history behind a bucket's quota (`lookback` of the bucket JSON).
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct Lookback {
    /// First step.
    pub start: DateTime<Utc>,
    /// End of the last step.
    pub end: DateTime<Utc>,
    /// Seconds per point (a multiple of the history's step).
    pub step_secs: i64,
    /// The busiest sample of each step in requests/s, summed over the bucket's series (a
    /// bucket without caller or procedure covers several); null when no series had a sample.
    pub points: Vec<Option<f64>>,
    /// How many series of the history the bucket covers.
    pub series: usize,
    /// When the snapshot was pulled, and from where.
    pub pulled_at: DateTime<Utc>,
    /// The history source (Prometheus URL and query, or file).
    pub source: String,
    /// What the latest computed plan read from it, when one was computed from this snapshot.
    pub computed: Option<Computed>,
}

/// What the latest plan computed for the bucket.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
pub struct Computed {
    /// The policy.
    pub policy: String,
    /// The statistic the limit is based on (`max`, `p99.9`), when the policy has one.
    pub statistic: Option<String>,
    /// Its value (requests/s).
    pub statistic_rps: Option<f64>,
    /// The forecast's upper bound over the horizon (forecast policy).
    pub forecast_upper_bound_rps: Option<f64>,
    /// The headroom multiplied in (0.25 = +25 %).
    pub headroom: Option<f64>,
    /// How `headroom: auto` chose it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headroom_auto: Option<rlc_plan::evidence::HeadroomAuto>,
    /// The limit the plan proposes (what the next run would write).
    pub limit_rps: f64,
    /// The policy's limit before a rail moved it (floor, ceiling, per-run cap, small change).
    pub capped_from_rps: Option<f64>,
    /// What set the limit and what was left out, in one line (the preview's WHY).
    pub explain: Option<String>,
    /// When the plan was computed.
    pub computed_at: DateTime<Utc>,
}

/// The bucket's lookback from `history`, or None when it has no series there. `caller` and
/// `procedure` are the bucket's (None: any).
pub fn from_history(
    history: &rlc_plan::history::History,
    service: &str,
    caller: Option<&str>,
    procedure: Option<&str>,
) -> Option<(i64, i64, Vec<Option<f64>>, usize)> {
    let series: Vec<_> = history
        .service_series(service)
        .filter(|(k, _)| caller.is_none_or(|c| k.caller.as_deref() == Some(c)))
        .filter(|(k, _)| procedure.is_none_or(|p| k.procedure.as_deref() == Some(p)))
        .map(|(_, s)| s)
        .collect();
    let first = series.first()?;
    let (start, step) = (first.start, first.step.max(1));
    let len = series.iter().map(|s| s.values.len()).max().unwrap_or(0);
    if len == 0 {
        return None;
    }
    let per = len.div_ceil(MAX_POINTS).max(1);
    let n = len.div_ceil(per);
    let mut out: Vec<Option<f64>> = vec![None; n];
    // Per sample, the sum over the series with a value; per step, the busiest sample.
    for i in 0..len {
        let mut sum = None;
        for s in &series {
            let at = i as i64 + (start - s.start) / step;
            if let Some(v) = usize::try_from(at).ok().and_then(|a| s.values.get(a)) {
                if v.is_finite() {
                    *sum.get_or_insert(0.0) += f64::from(*v);
                }
            }
        }
        if let Some(v) = sum {
            let slot = &mut out[i / per];
            *slot = Some(slot.map_or(v, |o: f64| o.max(v)));
        }
    }
    Some((start, step * per as i64, out, series.len()))
}

/// How `headroom: auto` chose the margin, for the proposed limit's label.
fn auto_note(c: &Computed) -> String {
    match &c.headroom_auto {
        None => String::new(),
        Some(a) if a.origins == 0 => ", auto: too little history, the default".into(),
        Some(a) if a.review => format!(
            ", auto at max_headroom: review, {} origins replayed",
            a.origins
        ),
        Some(a) => format!(
            ", auto from {} origins replayed, worst surprise {}×",
            a.origins,
            a.worst_surprise.map_or("-".into(), |w| format!("{w:.2}"))
        ),
    }
}

/// Height of the lookback chart (px).
const CHART_H: f64 = 230.0;

/// The levels a lookback's chart draws over its series: class, label, requests/s (the
/// statistic or the forecast bound, and the proposed limit).
fn levels(c: Option<&Computed>) -> Vec<(&'static str, String, f64)> {
    [
        c.and_then(|c| {
            c.statistic_rps.map(|v| {
                (
                    "statistic",
                    format!(
                        "{} {}",
                        c.statistic.as_deref().unwrap_or("statistic"),
                        rate(v)
                    ),
                    v,
                )
            })
        }),
        c.and_then(|c| {
            c.forecast_upper_bound_rps
                .map(|v| ("forecast", format!("forecast bound {}", rate(v)), v))
        }),
        c.map(|c| {
            (
                "proposed",
                format!(
                    "proposed limit {}{}{}",
                    rate(c.limit_rps),
                    c.headroom
                        .map(|h| {
                            // In percent to a thousandth: 0.07 is 7 %, not 7.000000000000001.
                            let pct = (h * 100_000.0).round() / 1000.0;
                            format!(" (headroom +{}%{})", rate(pct), auto_note(c))
                        })
                        .unwrap_or_default(),
                    c.capped_from_rps
                        .map(|f| format!(", capped from {} by a rail", rate(f)))
                        .unwrap_or_default()
                ),
                c.limit_rps,
            )
        }),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The chart of a lookback: the series, the statistic and the proposed limit as levels, the
/// headroom between them shaded.
pub fn chart(l: &Lookback) -> Markup {
    let levels = levels(l.computed.as_ref());
    let max = l
        .points
        .iter()
        .flatten()
        .copied()
        .chain(levels.iter().map(|(_, _, v)| *v))
        .fold(0.0f64, f64::max);
    let f = Frame::new(CHART_H, l.start, l.end, l.points.len(), max);
    let plot_w = f.plot_w();
    let statistic = levels
        .iter()
        .find(|(k, _, _)| *k != "proposed")
        .map(|l| l.2);
    let proposed = levels
        .iter()
        .find(|(k, _, _)| *k == "proposed")
        .map(|l| l.2);
    html! {
        figure class="chart" id="lookback-chart" {
            svg xmlns="http://www.w3.org/2000/svg" viewBox={ "0 0 " (W) " " (f.height) } width=(W)
                height=(f.height) role="img" data-points=(l.points.len()) {
                title { "the history the quota is computed from, requests/s" }
                // The headroom: between the statistic and the proposed limit.
                @if let (Some(s), Some(p)) = (statistic, proposed) {
                    @if p > s {
                        rect class="headroom" x=(LEFT) y=(dec1(f.y(p))) width=(dec1(plot_w))
                            height=(dec1(f.y(s) - f.y(p))) {
                            title { "headroom: " (rate(s)) " → " (rate(p)) " requests/s" }
                        }
                    }
                }
                (f.axes())
                line class="key history" x1=(LEFT) x2=(dec1(LEFT + 22.0)) y1="12" y2="12" {}
                text class="legend" x=(dec1(LEFT + 28.0)) y="16" { "history (busiest sample per step)" }
                path class="history" data-series="history" d=(path(&l.points, |i| f.mid(i), |v| f.y(v))) {}
                @for (k, (class, label, v)) in levels.iter().enumerate() {
                    line class={ "level " (class) } data-level=(class) x1=(LEFT) x2=(dec1(LEFT + plot_w))
                        y1=(dec1(f.y(*v))) y2=(dec1(f.y(*v))) {}
                    text class={ "legend level " (class) } x=(dec1(LEFT + plot_w - 4.0))
                        y=(dec1(f.y(*v) - 4.0 - 12.0 * (k % 2) as f64)) text-anchor="end" { (label) }
                }
            }
        }
    }
}

/// The section of the bucket page.
pub fn section(l: Option<&Lookback>, why_none: &str) -> Markup {
    html! {
        section id="lookback" {
            h2 { "History the quota is computed from" }
            @match l {
                None => { p class="muted" id="no-lookback" { (why_none) } }
                Some(l) => {
                    p class="muted" {
                        (when(l.start)) " – " (when(l.end)) " UTC, from " code { (l.source) }
                        " (pulled " (when(l.pulled_at)) " UTC; " (l.series) " series"
                        @if l.step_secs > 60 { "; each point the busiest sample of " (l.step_secs / 60) " min" }
                        ")."
                        @if let Some(c) = &l.computed {
                            " Policy " code { (c.policy) } ", plan computed " (when(c.computed_at)) " UTC."
                        } @else {
                            " No plan computed from this snapshot yet (GET /v1/quotas computes one)."
                        }
                    }
                    (chart(l))
                    @if let Some(why) = l.computed.as_ref().and_then(|c| c.explain.as_deref()) {
                        p class="muted" id="lookback-why" { "Why: " (super::prose(why)) }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn computed(auto: Option<rlc_plan::evidence::HeadroomAuto>) -> Computed {
        Computed {
            policy: "peak".into(),
            statistic: Some("max".into()),
            statistic_rps: Some(100.0),
            forecast_upper_bound_rps: None,
            headroom: Some(auto.as_ref().map_or(0.25, |a| a.chosen)),
            headroom_auto: auto,
            limit_rps: 107.0,
            capped_from_rps: None,
            explain: None,
            computed_at: DateTime::<Utc>::from_timestamp(0, 0).unwrap(),
        }
    }

    /// The proposed limit's label says how `headroom: auto` chose the margin, or that the
    /// bucket was flagged for review.
    #[test]
    fn the_proposed_limit_says_how_auto_chose_its_margin() {
        let label = |c: &Computed| {
            levels(Some(c))
                .into_iter()
                .find(|l| l.0 == "proposed")
                .map(|l| l.1)
                .unwrap()
        };
        let fixed = computed(None);
        assert!(
            label(&fixed).ends_with("(headroom +25%)"),
            "{}",
            label(&fixed)
        );
        let auto = rlc_plan::evidence::HeadroomAuto {
            chosen: 0.07,
            origins: 14,
            worst_surprise: Some(1.052),
            ..Default::default()
        };
        let l = label(&computed(Some(auto.clone())));
        assert!(
            l.ends_with("(headroom +7%, auto from 14 origins replayed, worst surprise 1.05×)"),
            "{l}"
        );
        let review = rlc_plan::evidence::HeadroomAuto {
            chosen: 1.0,
            review: true,
            ..auto
        };
        let l = label(&computed(Some(review)));
        assert!(l.contains("auto at max_headroom: review"), "{l}");
    }
}
