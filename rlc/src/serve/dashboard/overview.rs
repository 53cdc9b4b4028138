//! The overview's bucket list: every bucket of the config repo's base branch (with or without
//! controller reports) and every bucket that reported, each with a verdict, sorted by what
//! needs attention: enforced buckets dropping real traffic, then shadow buckets that would
//! drop, then buckets whose reports stopped (stale) or never came (silent), then the rest.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Duration, Utc};
use maud::{html, Markup};
use rlc_plan::censor::OverrideWindow;

use super::{encoded, percent, rate, when, WOULD_THROTTLE_SHARE};
use crate::store::BucketShadowSummary;

/// How much a bucket needs attention, most first (the overview's order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Attention {
    /// Enforced and refusing real requests in the window.
    Dropping,
    /// Shadow, and enforcing it as configured would refuse more than 1 % of its traffic.
    WouldThrottle,
    /// Reported in the window, but not for longer than the readiness rule's report age.
    Stale,
    /// In the config repo, without a report in the window.
    Silent,
    /// Nothing to do.
    Ok,
}

impl Attention {
    /// Every verdict, most urgent first.
    pub const ALL: [Attention; 5] = [
        Attention::Dropping,
        Attention::WouldThrottle,
        Attention::Stale,
        Attention::Silent,
        Attention::Ok,
    ];

    /// The word of the `verdict` filter and of the row's class.
    pub fn key(self) -> &'static str {
        match self {
            Attention::Dropping => "dropping",
            Attention::WouldThrottle => "would-throttle",
            Attention::Stale => "stale",
            Attention::Silent => "silent",
            Attention::Ok => "ok",
        }
    }

    /// What the filter offers.
    pub fn label(self) -> &'static str {
        match self {
            Attention::Dropping => "dropping real traffic",
            Attention::WouldThrottle => "would throttle (shadow)",
            Attention::Stale => "stale reports",
            Attention::Silent => "no reports",
            Attention::Ok => "ok",
        }
    }

    /// The verdict named by `key`.
    pub fn parse(key: &str) -> Option<Attention> {
        Attention::ALL.into_iter().find(|a| a.key() == key)
    }
}

/// A bucket of the config repo's base branch, as the controllers serve it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigBucket {
    /// The limit in force: the base branch's, or the one a rollout keeps in force meanwhile
    /// ([`crate::rollout::enforced`]); None for a new bucket that is only a candidate so far.
    pub limit_rps: Option<f64>,
    /// enforce | shadow (in force; the base branch's for a new bucket).
    pub mode: String,
    /// The policy that set it.
    pub policy: String,
    /// The candidate limit baking beside it, if any.
    pub candidate: Option<crate::rollout::CandidateView>,
}

/// One row of the overview.
#[derive(Debug, Clone)]
pub struct Row {
    /// Callee service.
    pub service: String,
    /// Bucket.
    pub bucket: String,
    /// The bucket in the config repo (none: only reports name it).
    pub config: Option<ConfigBucket>,
    /// Its reports over the window (none: no report).
    pub summary: Option<BucketShadowSummary>,
    /// The incident overrides acting on it now, each with the number of buckets it acts on.
    pub overrides: Vec<(OverrideWindow, usize)>,
    /// How much it needs attention.
    pub attention: Attention,
    /// The verdict in words.
    pub verdict: String,
}

impl Row {
    /// The mode in force: the config repo's, else the latest report's.
    pub fn mode(&self) -> &str {
        match (&self.config, &self.summary) {
            (Some(c), _) => &c.mode,
            (None, Some(s)) => &s.mode,
            (None, None) => "",
        }
    }

    /// Real drops ÷ offered over the window.
    fn drop_share(&self) -> f64 {
        self.summary
            .as_ref()
            .map_or(0.0, |s| share(s.dropped, s.offered))
    }

    fn sort_key(&self) -> (Attention, f64, i64) {
        let share = match self.attention {
            Attention::Dropping => self.drop_share(),
            Attention::WouldThrottle => self.summary.as_ref().map_or(0.0, |s| s.virtual_drop_share),
            _ => 0.0,
        };
        // Oldest last report first among the stale.
        let seen = self.summary.as_ref().map_or(0, |s| s.last_seen.timestamp());
        (self.attention, -share, seen)
    }
}

/// `d` in the largest whole unit (`42 s`, `7 min`, `3 h`, `2 d`).
pub fn age(d: Duration) -> String {
    let s = d.num_seconds().max(0);
    match s {
        0..60 => format!("{s} s"),
        60..7_200 => format!("{} min", s / 60),
        7_200..172_800 => format!("{} h", s / 3_600),
        _ => format!("{} d", s / 86_400),
    }
}

/// What an enforced bucket's real drops say, the same on the overview and on its page:
/// `dropping 34.60% of requests`.
pub fn dropping(dropped: f64, offered: f64) -> String {
    format!("dropping {} of requests", percent(share(dropped, offered)))
}

/// `part ÷ whole`, 0 when nothing was offered.
pub fn share(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        part / whole
    } else {
        0.0
    }
}

/// The verdict of a bucket: see [`Attention`]. `max_age` is how old a last report may be.
pub fn verdict(
    summary: Option<&BucketShadowSummary>,
    in_config: bool,
    window: &str,
    now: DateTime<Utc>,
    max_age: Duration,
) -> (Attention, String) {
    let Some(s) = summary else {
        return (
            Attention::Silent,
            if in_config {
                format!("no reports in the last {window}")
            } else {
                "no reports".into()
            },
        );
    };
    if s.dropped > 0.0 {
        return (Attention::Dropping, dropping(s.dropped, s.offered));
    }
    if s.virtual_drop_share > WOULD_THROTTLE_SHARE {
        return (
            Attention::WouldThrottle,
            format!("would throttle {}", percent(s.virtual_drop_share)),
        );
    }
    if now - s.last_seen > max_age {
        return (
            Attention::Stale,
            format!("stale: last report {} ago", age(now - s.last_seen)),
        );
    }
    (Attention::Ok, "ok".into())
}

/// What the overview merges.
pub struct Sources<'a> {
    /// The config repo's bucket files (none: no config repo, or not readable).
    pub config: Option<&'a [schema::BucketFile]>,
    /// The reports' aggregates.
    pub summaries: &'a [BucketShadowSummary],
    /// Overrides in force now, by bucket.
    pub overrides: &'a BTreeMap<(String, String), Vec<OverrideWindow>>,
    /// The newest rollout of each bucket.
    pub rollouts: &'a BTreeMap<(String, String), crate::rollout::Rollout>,
    /// Only this service.
    pub service: Option<&'a str>,
    /// The window as asked.
    pub window: &'a str,
    /// Now.
    pub now: DateTime<Utc>,
    /// How old a last report may be before the bucket is stale.
    pub max_age: Duration,
}

/// Every bucket of the config repo and of the reports, sorted by attention (then by the share
/// it drops or would drop, then by name).
pub fn rows(src: &Sources<'_>) -> Vec<Row> {
    let mut config: BTreeMap<(String, String), ConfigBucket> = BTreeMap::new();
    for f in src.config.unwrap_or_default() {
        if src.service.is_some_and(|s| s != f.service) {
            continue;
        }
        for b in &f.buckets {
            let key = (f.service.clone(), b.name.clone());
            let e = crate::rollout::enforced(Some(b), src.rollouts.get(&key), src.now);
            let spec = e.spec.unwrap_or(b);
            config.insert(
                key,
                ConfigBucket {
                    limit_rps: e.spec.map(|s| s.limit_rps),
                    mode: spec.mode.as_str().to_string(),
                    policy: spec.policy.to_string(),
                    candidate: e.candidate,
                },
            );
        }
    }
    let mut summaries: BTreeMap<(String, String), &BucketShadowSummary> = BTreeMap::new();
    for s in src.summaries {
        summaries.insert((s.service.clone(), s.bucket.clone()), s);
    }
    // How many buckets each override acts on: one acting on several (a caller-wide one)
    // shares its limit between them.
    let mut spread: BTreeMap<&str, usize> = BTreeMap::new();
    for w in src.overrides.values().flatten() {
        *spread.entry(w.id.as_str()).or_default() += 1;
    }
    let keys: BTreeSet<(String, String)> = config.keys().chain(summaries.keys()).cloned().collect();
    let mut out: Vec<Row> = keys
        .into_iter()
        .map(|key| {
            let summary = summaries.get(&key).map(|s| (*s).clone());
            let config = config.get(&key).cloned();
            let (attention, verdict) = verdict(
                summary.as_ref(),
                config.is_some(),
                src.window,
                src.now,
                src.max_age,
            );
            let overrides = src
                .overrides
                .get(&key)
                .map(|ws| {
                    ws.iter()
                        .filter(|w| w.from <= src.now && src.now < w.to)
                        .map(|w| (w.clone(), spread.get(w.id.as_str()).copied().unwrap_or(1)))
                        .collect()
                })
                .unwrap_or_default();
            Row {
                service: key.0,
                bucket: key.1,
                config,
                summary,
                overrides,
                attention,
                verdict,
            }
        })
        .collect();
    out.sort_by(|a, b| {
        let (ka, kb) = (a.sort_key(), b.sort_key());
        ka.0.cmp(&kb.0)
            .then(ka.1.total_cmp(&kb.1))
            .then(ka.2.cmp(&kb.2))
            .then_with(|| (&a.service, &a.bucket).cmp(&(&b.service, &b.bucket)))
    });
    out
}

/// A name that may break only after `/`, `.`, `-`, `_` or `:` (never inside a word): each
/// such character is followed by a `<wbr>`.
pub fn name_html(name: &str) -> Markup {
    let mut parts = Vec::new();
    let mut start = 0;
    for (i, c) in name.char_indices() {
        if matches!(c, '/' | '.' | '-' | '_' | ':') {
            let end = i + c.len_utf8();
            parts.push(&name[start..end]);
            start = end;
        }
    }
    parts.push(&name[start..]);
    let last = parts.len() - 1;
    html! {
        @for (i, p) in parts.iter().enumerate() {
            (p)
            @if i < last { wbr; }
        }
    }
}

/// The limit cell: the limit in force (the config repo's, or the one a rollout keeps in force
/// while its candidate bakes), the candidate with its stage and bake progress, and the
/// controller's latest report when it differs (not applied yet, or an override).
fn limit_cell(r: &Row) -> Markup {
    let reported = r.summary.as_ref().map(|s| s.limit_rps);
    html! {
        @match (&r.config, reported) {
            (Some(c), _) => {
                @match c.limit_rps {
                    Some(l) => { (rate(l)) }
                    None => { span class="muted" title="a new bucket: not in force yet" { "—" } }
                }
                @if let Some(k) = &c.candidate {
                    div class="small candidate" title={
                        "candidate limit baking beside the limit in force (rollout "
                        (k.rollout_id) "), not enforced"
                    } {
                        "candidate " (rate(k.limit_rps)) " · stage " (k.stage) "/" (k.stages)
                        " · " (format!("{:.0}", k.bake_progress * 100.0)) "% baked"
                    }
                }
                @if let Some(rep) = reported.filter(|rep| c.limit_rps.is_none_or(|l| (rep - l).abs() > 0.005 * l.abs().max(1.0))) {
                    div class="muted small" title="the limit in the bucket's latest controller report" {
                        "reported " (rate(rep))
                    }
                }
            }
            (None, Some(rep)) => {
                span title="the limit in the bucket's latest controller report (not in the config repo)" {
                    (rate(rep))
                }
            }
            (None, None) => { span class="muted" { "—" } }
        }
    }
}

/// The overrides in force on a row, as badges.
pub fn override_badges(overrides: &[(OverrideWindow, usize)]) -> Markup {
    html! {
        @for (w, n) in overrides {
            span class="badge override" title={
                "incident override " (w.id) ": " (w.reason) " (until " (when(w.to)) " UTC)"
            } {
                @if *n > 1 { "override (caller-wide, " (n) " buckets)" } @else { "override" }
            }
            " "
        }
    }
}

/// The table of `rows`.
pub fn table(rows: &[Row], window: &str, with_config: bool) -> Markup {
    let opt = |v: Option<f64>, f: fn(f64) -> String| v.map(f).unwrap_or_else(|| "—".into());
    html! {
        div class="scroll" {
            table id="buckets" {
                thead {
                    tr {
                        th { "Service" } th { "Bucket" } th { "Verdict" } th { "Mode" }
                        th class="num" { "Limit rps" }
                        th class="num" { "Peak offered rps" }
                        th class="num" { "Real drops" }
                        th class="num" { "Virtual-drop share" }
                        th class="num" { "Offered" }
                        th class="num" { "Virtual drops" }
                        th class="num" { "Reports" }
                        th { "Last report (UTC)" }
                    }
                }
                tbody {
                    @for r in rows {
                        @let s = r.summary.as_ref();
                        tr class=(r.attention.key()) data-bucket=(r.bucket) data-service=(r.service)
                            data-verdict=(r.attention.key()) {
                            td class="name" {
                                a href={ "/?service=" (encoded(&r.service)) "&window=" (encoded(window)) } {
                                    (name_html(&r.service))
                                }
                            }
                            td class="name" {
                                a href={
                                    "/buckets/" (encoded(&r.service)) "/" (encoded(&r.bucket))
                                    "?window=" (encoded(window))
                                } {
                                    code { (name_html(&r.bucket)) }
                                }
                                @if with_config && r.config.is_none() {
                                    div class="muted small" { "not in the config repo" }
                                }
                            }
                            td {
                                span class={ "badge " (r.attention.key()) } { (r.verdict) }
                                @if !r.overrides.is_empty() { " " (override_badges(&r.overrides)) }
                            }
                            td { span class="badge mode" { (r.mode()) } }
                            td class="num" { (limit_cell(r)) }
                            td class="num" { (opt(s.map(|s| s.peak_offered_rps), rate)) }
                            td class="num drops" { (opt(s.map(|s| s.dropped), rate)) }
                            td class="num share" { (opt(s.map(|s| s.virtual_drop_share), percent)) }
                            td class="num" { (opt(s.map(|s| s.offered), rate)) }
                            td class="num" { (opt(s.map(|s| s.shadow_dropped), rate)) }
                            td class="num" { (s.map_or(0, |s| s.reports)) }
                            td class="nowrap" { (s.map(|s| when(s.last_seen)).unwrap_or_else(|| "—".into())) }
                        }
                    }
                }
            }
        }
    }
}
