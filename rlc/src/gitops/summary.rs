//! The words of a change for people on the forge: the pull-request body (a markdown table per
//! service, risky changes first). The change itself is [`rlc_plan::change`].

use std::fmt::Write;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use schema::{format_rps, Mode};

use rlc_plan::change::{describe, BucketChange, ChangeSummary};
use rlc_plan::evidence::Evidence;
use rlc_plan::plan::Plan;
use rlc_plan::plan::PromotionNote;

/// GitHub refuses PR bodies and comments above 65,535 characters.
pub const FORGE_BODY_LIMIT: usize = 65_535;

/// A number of the evidence as a table cell (`-` when absent).
fn cell(v: Option<f64>) -> String {
    v.map(format_rps).unwrap_or_else(|| "-".into())
}

/// The evidence's one line (what set the limit, which spikes and dips were discounted), at
/// most 300 characters, safe in a table cell.
fn why_cell(ev: &Evidence) -> String {
    match ev.explain.as_deref() {
        Some(s) => {
            let mut s: String = s.chars().take(300).collect();
            if s.chars().count() == 300 {
                s.push('…');
            }
            md_title(&s)
        }
        None => "-".into(),
    }
}

/// What a pull request's body shows besides the plan and its changes.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReportContext<'a> {
    /// The verdicts on shadow buckets: promoted ones carry their shadow figures, the others are
    /// listed with the reason they stay in shadow.
    pub promotions: &'a [PromotionNote],
    /// Base URL of the rlc dashboard: each bucket links to `<url>/buckets/<service>/<bucket>`.
    pub dashboard_url: Option<&'a str>,
}

/// `s` safe to place in markdown text or a table cell: letters, digits, `-` and `.` stay (a
/// `.` after `www` does not, so no autolink), everything else becomes an HTML character
/// reference, so a hostile name cannot open a link, an image, HTML, a mention (`@`), a
/// reference (`#`), emphasis or a new table cell, nor break the line.
pub fn md(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev: Vec<char> = Vec::new();
    for ch in s.chars() {
        let www = prev.len() >= 3
            && prev[prev.len() - 3..]
                .iter()
                .all(|c| c.eq_ignore_ascii_case(&'w'));
        if ch.is_ascii_alphanumeric() || ch == '-' || (ch == '.' && !www) {
            out.push(ch);
        } else {
            let _ = write!(out, "&#{};", ch as u32);
        }
        prev.push(ch);
    }
    out
}

/// What a URL path segment or query value percent-encodes: everything but RFC 3986 unreserved
/// characters (letters, digits, `-`, `.`, `_`, `~`), so a name can neither end the segment
/// (`/`, `?`, `#`) nor the value (`&`, `=`). Non-ASCII bytes are always encoded. The PR body's
/// links and the dashboard's use this one set.
pub const URL_SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// `s` as one URL path segment (RFC 3986 unreserved characters kept, the rest
/// percent-encoded: [`URL_SEGMENT`]).
pub fn url_segment(s: &str) -> String {
    utf8_percent_encode(s, URL_SEGMENT).to_string()
}

/// The dashboard page of a bucket: `<base>/buckets/<service>/<bucket>`.
pub fn bucket_url(base: &str, service: &str, bucket: &str) -> String {
    format!(
        "{}/buckets/{}/{}",
        base.trim_end_matches('/'),
        url_segment(service),
        url_segment(bucket)
    )
}

/// A minute as the report shows it: `2026-11-12 14:00 UTC`.
fn minute(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M UTC").to_string()
}

/// An RFC 3339 time of the evidence as a minute.
fn when(t: Option<&str>) -> Option<String> {
    let t = chrono::DateTime::parse_from_rfc3339(t?).ok()?;
    Some(minute(t.with_timezone(&chrono::Utc)))
}

fn pct(v: f64) -> String {
    if v != 0.0 && v.abs() < 0.001 {
        format!("{:.5}%", v * 100.0)
    } else {
        format!("{:.3}%", v * 100.0)
    }
}

/// The evidence line of one risky change: limit ÷ peak with the peak's minute, what a rail
/// capped the limit from, and for a promotion its shadow figures.
fn risky_line(pb: Option<&rlc_plan::plan::PlannedBucket>, c: &BucketChange) -> Vec<String> {
    let mut parts = Vec::new();
    let Some(pb) = pb else {
        return parts;
    };
    let ev = &pb.evidence;
    if let (Some(limit), Some(peak)) = (c.new_limit_rps, ev.peak_rps) {
        if peak > 0.0 {
            let mut p = format!(
                "limit ÷ peak {:.2} (peak {} rps",
                limit / peak,
                format_rps(peak)
            );
            if let Some(at) = when(ev.peak_at.as_deref()) {
                let _ = write!(p, " at {at}");
            }
            p.push(')');
            parts.push(p);
        }
    }
    if let Some(from) = ev.capped_from {
        parts.push(format!("capped from {} rps by the rails", format_rps(from)));
    }
    if let Some(f) = ev
        .promotion
        .as_ref()
        .filter(|p| p.promoted)
        .and_then(|p| p.figures.as_ref())
    {
        let mut s = String::from("shadow:");
        let _ = write!(s, " {:.1} days in shadow,", f.days_in_shadow);
        let _ = write!(s, " coverage {:.1}%,", f.coverage * 100.0);
        let _ = write!(s, " virtual drops {}", pct(f.virtual_drop_share));
        if f.peak_drop_share > 0.0 {
            let _ = write!(s, " (worst minute {}", pct(f.peak_drop_share));
            if let Some(at) = f.peak_drop_at {
                let _ = write!(s, " at {}", minute(at));
            }
            s.push(')');
        }
        if let Some(v) = f.suggested_limit_rps {
            let _ = write!(s, ", suggested limit {} rps", format_rps(v));
        }
        parts.push(s);
    }
    // Enforced by a hand-set mode, not the promotion rule: say so, and when nothing was ever
    // watched in shadow, say that.
    if let Some(p) = ev.promotion.as_ref().filter(|p| p.promoted) {
        if p.reason.starts_with("mode: enforce set by hand") {
            parts.push("set by hand in rlc/policies.yaml, not by the promotion rule".into());
        }
        if p.figures.is_none() {
            parts.push(format!("shadow: none ({})", md(&p.reason)));
        }
    }
    parts
}

/// The planned buckets of the changes of `summary`.
fn changed<'a>(
    plan: &'a Plan,
    summary: &'a ChangeSummary,
) -> impl Iterator<Item = &'a rlc_plan::plan::PlannedBucket> + 'a {
    summary
        .services
        .iter()
        .flat_map(|s| {
            s.changes
                .iter()
                .map(move |c| (s.service.as_str(), c.bucket.as_str()))
        })
        .filter_map(|(s, b)| {
            plan.buckets
                .iter()
                .find(|p| p.service == s && p.bucket.name == b)
        })
}

/// `service/bucket` for the body, linked to the dashboard when it has one.
fn bucket_link(service: &str, bucket: &str, ctx: &ReportContext<'_>) -> String {
    let name = format!("{}/{}", md(service), md(bucket));
    match ctx.dashboard_url {
        Some(base) => format!("[{name}]({})", bucket_url(base, service, bucket)),
        None => name,
    }
}

/// The changed buckets whose `headroom: auto` margin reached `max_headroom`: a replay of
/// their history still throttles at it, too noisy for a quota alone.
fn margins_at_max(out: &mut String, plan: &Plan, summary: &ChangeSummary, ctx: &ReportContext<'_>) {
    let at_max: Vec<(
        &rlc_plan::plan::PlannedBucket,
        rlc_plan::evidence::HeadroomAuto,
    )> = changed(plan, summary)
        .filter_map(|pb| {
            let a = pb.evidence.policy.as_ref()?.figures().headroom_auto?;
            a.review.then_some((pb, a))
        })
        .collect();
    if at_max.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "### Margins at max_headroom: {} bucket(s)\n",
        at_max.len()
    );
    for (pb, a) in at_max {
        let _ = writeln!(
            out,
            "- {}: `headroom: auto` needed more than {:.2}; {} replayed origins still throttle {:.4}% (target {:.4}%). A quota alone does not protect it: look at its callers' retries and bursts.",
            bucket_link(&pb.service, &pb.bucket.name, ctx),
            a.max_headroom,
            a.origins,
            a.replayed_throttled.unwrap_or(0.0).max(a.tail_throttled.unwrap_or(0.0)) * 100.0,
            a.target_throttled * 100.0
        );
    }
    out.push('\n');
}

/// The changed buckets whose proposed limit is below the peak of their critical demand
/// (critical headroom < 1: the less critical tiers cannot cover the shed at that peak).
fn critical_short(out: &mut String, plan: &Plan, summary: &ChangeSummary, ctx: &ReportContext<'_>) {
    let short: Vec<(&str, &str, &rlc_plan::evidence::CriticalHeadroom, bool)> =
        changed(plan, summary)
            .filter_map(|pb| {
                let (s, b) = (pb.service.as_str(), pb.bucket.name.as_str());
                let h = pb
                    .evidence
                    .critical_headroom
                    .as_ref()
                    .filter(|h| h.short())?;
                Some((s, b, h, pb.bucket.mode == schema::Mode::Shadow))
            })
            .collect();
    if short.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "### Critical traffic over the limit: {} bucket(s)\n",
        short.len()
    );
    for (service, bucket, h, shadow) in short {
        let name = bucket_link(service, bucket, ctx);
        let _ = writeln!(
            out,
            "- {name}: the limit is {:.1}% of its CRITICAL_PLUS + CRITICAL peak ({} rps at {}): \
             critical requests {} at that peak",
            h.headroom * 100.0,
            format_rps(h.peak_critical_rps),
            h.peak_at.format("%Y-%m-%d %H:%M UTC"),
            if shadow {
                "would be shed (once enforced)"
            } else {
                "are shed"
            }
        );
    }
    out.push('\n');
}

/// The full markdown report of a run (the pull request's body), for a reviewer who has a
/// minute: the risky changes first (new buckets that enforce at once, promotions out of shadow,
/// decreases, mode, scope and match changes, removals), each with limit ÷ peak, the peak's
/// minute, the value a rail capped it from, a promotion's shadow figures and a link to the
/// bucket's dashboard page; then a table per changed service (bucket, current, proposed,
/// change %, observed peak, policy, confidence); then the shadow buckets that stay in shadow and
/// why, and what was skipped. Every name is escaped ([`md`]).
pub fn report_with(plan: &Plan, summary: &ChangeSummary, ctx: &ReportContext<'_>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## {}\n", md_title(&summary.title()));
    out.push_str("Generated by rlc from `rlc/*.yaml` and observed traffic. Review the proposed limits; merging applies them to the GRL controller.\n\n");
    let find = |service: &str, bucket: &str| {
        plan.buckets
            .iter()
            .find(|b| b.service == service && b.bucket.name == bucket)
    };
    let mut risky: Vec<(schema::ChangeClass, &str, &BucketChange)> = summary
        .services
        .iter()
        .flat_map(|s| s.changes.iter().map(move |c| (s.service.as_str(), c)))
        .map(|(s, c)| {
            let throttled = rlc_plan::promotion::throttled_in(plan, s, &c.bucket);
            (rlc_plan::promotion::classify(c, throttled), s, c)
        })
        .filter(|(k, _, _)| k.is_risky())
        .collect();
    risky.sort_by(|a, b| (a.0, a.1, &a.2.bucket).cmp(&(b.0, b.1, &b.2.bucket)));
    if !risky.is_empty() {
        let _ = writeln!(out, "### Review first: {} risky change(s)\n", risky.len());
        for (class, service, c) in &risky {
            let name = format!("{}/{}", md(service), md(&c.bucket));
            let name = match ctx.dashboard_url {
                Some(base) => format!("[{name}]({})", bucket_url(base, service, &c.bucket)),
                None => name,
            };
            let what = match class {
                schema::ChangeClass::NewEnforcing => format!(
                    "new bucket enforcing at once at {} rps",
                    c.new_limit_rps.map(format_rps).unwrap_or_default()
                ),
                schema::ChangeClass::ThrottledRaise => {
                    let t = find(service, &c.bucket).and_then(|b| b.evidence.throttled.as_ref());
                    format!(
                        "{}; its limit refused {} requests over {} minutes on {} day(s){}",
                        md_title(&describe(c)),
                        t.map_or("?".into(), |t| format_rps(t.refused_requests)),
                        t.map_or(0, |t| t.minutes),
                        t.map_or(0, |t| t.days),
                        if t.is_some_and(|t| t.sustained) {
                            " (sustained: counted as demand)"
                        } else {
                            " (left out: the raise comes from other traffic)"
                        }
                    )
                }
                schema::ChangeClass::Promotion => format!(
                    "promotion shadow → enforce at {} rps{}",
                    c.new_limit_rps.map(format_rps).unwrap_or_default(),
                    match (c.old_limit_rps, c.new_limit_rps) {
                        (Some(o), Some(n)) if o != n => format!(" (was {} rps)", format_rps(o)),
                        _ => String::new(),
                    }
                ),
                _ => md_title(&describe(c)),
            };
            let _ = write!(out, "- **{}** {name}: {what}", class.as_str());
            let parts = risky_line(find(service, &c.bucket), c);
            if !parts.is_empty() {
                let _ = write!(out, " · {}", parts.join(" · "));
            }
            out.push('\n');
        }
        out.push('\n');
    }
    critical_short(&mut out, plan, summary, ctx);
    margins_at_max(&mut out, plan, summary, ctx);
    for s in &summary.services {
        let _ = writeln!(out, "### {}\n", md(&s.service));
        out.push_str(
            "| bucket | current | proposed | change % | observed peak | policy | confidence | why |\n",
        );
        out.push_str("|---|---:|---:|---:|---:|---|---|---|\n");
        for c in &s.changes {
            let pb = find(&s.service, &c.bucket);
            let current = c
                .old_limit_rps
                .map(format_rps)
                .unwrap_or_else(|| "—".into());
            let proposed = match c.new_limit_rps {
                Some(v) => format_rps(v),
                None => "removed".into(),
            };
            let mut pct = match (c.old_limit_rps, c.new_limit_rps) {
                (Some(o), Some(n)) if o > 0.0 => format!("{:+.1}%", (n - o) / o * 100.0),
                (None, Some(_)) => "new".into(),
                _ => "—".into(),
            };
            // Mode, scope, policy or match changes, named (a limit change alone says little
            // when the bucket starts enforcing or counts the whole fleet).
            let details = c.details();
            if !details.is_empty() {
                let d = details.join("; ").replace('|', "\\|");
                pct = format!("{pct}; {d}");
            }
            let (peak, policy, conf, why) = match pb {
                Some(pb) => (
                    cell(pb.evidence.peak_rps),
                    md(&pb.bucket.policy.to_string()),
                    cell(pb.evidence.confidence),
                    why_cell(&pb.evidence),
                ),
                None => ("-".into(), "-".into(), "-".into(), "-".into()),
            };
            let mode = match c.new_mode {
                Some(Mode::Shadow) => " (shadow)",
                _ => "",
            };
            let _ = writeln!(
                out,
                "| {}{mode} | {current} | {proposed} | {pct} | {peak} | {policy} | {conf} | {why} |",
                md(&c.bucket)
            );
        }
        out.push('\n');
    }
    let staying: Vec<&PromotionNote> = ctx.promotions.iter().filter(|p| !p.promoted).collect();
    if !staying.is_empty() {
        out.push_str("### Staying in shadow\n\n");
        for p in staying {
            let _ = writeln!(
                out,
                "- {}/{}: {}",
                md(&p.service),
                md(&p.bucket),
                md_title(&p.reason)
            );
        }
        out.push('\n');
    }
    if !plan.skipped.is_empty() {
        out.push_str("### Skipped (current quotas kept)\n\n");
        for sk in &plan.skipped {
            // Each name escaped, the separators rlc puts between them kept readable.
            let what: Vec<String> = [Some(&sk.service), sk.caller.as_ref(), sk.procedure.as_ref()]
                .into_iter()
                .flatten()
                .map(|n| md(n))
                .collect();
            let _ = writeln!(out, "- {}: {}", what.join("/"), md_title(&sk.reason));
        }
        out.push('\n');
    }
    out
}

/// Free text built by rlc around names (titles, reasons): the characters that would make
/// markdown, HTML, links or mentions are escaped; spaces and the punctuation rlc itself writes
/// (`,;:%()->`) stay readable (parentheses make no link without brackets, `>` no HTML without
/// `<`, and a line never starts with these texts).
fn md_title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '\n' | '\r' => out.push(' '),
            '<' | '[' | ']' | '!' | '@' | '#' | '|' | '*' | '_' | '`' | '~' | '\\' | '&' | '"'
            | '\'' => {
                let _ = write!(out, "&#{};", ch as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// [`report_with`] without promotions nor dashboard links.
#[cfg(test)]
pub fn report(plan: &Plan, summary: &ChangeSummary) -> String {
    report_with(plan, summary, &ReportContext::default())
}

/// `full` cut at a line boundary to at most `limit` bytes (hence characters), with a note
/// saying where the full report is: stored with the run (never committed).
pub fn truncate_body(full: &str, limit: usize) -> String {
    if full.len() <= limit {
        return full.to_string();
    }
    let note = "\n\n---\n**Truncated**: this report is longer than the forge allows. The full report is stored with the run in rlc (`rlc serve`: `GET /v1/runs`, or the dashboard).\n";
    let budget = limit.saturating_sub(note.len());
    let mut out = String::new();
    for line in full.split_inclusive('\n') {
        if out.len() + line.len() > budget {
            break;
        }
        out.push_str(line);
    }
    out.push_str(note);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlc_plan::change::diff;
    use rlc_plan::plan::PlannedBucket;
    use schema::BucketFile;
    use schema::{Bucket, PolicyName, Scope};
    use std::collections::BTreeMap;

    /// `pay`'s buckets going from the `old` limits to the `new` ones (each at 100 before),
    /// planned with the evidence `evidence` gives each new bucket: the plan and the change.
    fn pay_change(
        old: &[(&str, f64)],
        new: &[(&str, f64)],
        evidence: impl Fn(&Bucket) -> Evidence,
    ) -> (Plan, rlc_plan::change::ChangeSummary) {
        let file = |limits: &[(&str, f64)]| BucketFile {
            criticality: Default::default(),
            service: "pay".into(),
            buckets: limits.iter().map(|(n, l)| bucket(n, *l)).collect(),
        };
        let old: BTreeMap<String, BucketFile> = [("pay".to_string(), file(old))].into();
        let new = vec![file(new)];
        let mut plan = Plan::default();
        for b in &new[0].buckets {
            plan.buckets.push(PlannedBucket {
                service: "pay".into(),
                bucket: b.clone(),
                current_limit_rps: Some(100.0),
                evidence: evidence(b),
                held: None,
            });
        }
        (plan, diff(&old, &new))
    }

    fn bucket(name: &str, limit: f64) -> Bucket {
        Bucket {
            name: name.into(),
            caller: Some(name.into()),
            procedure: None,
            scope: Scope::Global,
            limit_rps: limit,
            mode: Mode::Enforce,
            policy: PolicyName::Peak,
        }
    }

    #[test]
    fn mode_and_scope_changes_are_named_not_just_modified() {
        let mut shadow_region = bucket("a", 10.0);
        shadow_region.mode = Mode::Shadow;
        shadow_region.scope = Scope::Region;
        let mut shadow = bucket("b", 10.0);
        shadow.mode = Mode::Shadow;
        let mut forecast = bucket("c", 10.0);
        forecast.policy = PolicyName::Forecast;
        let old: BTreeMap<String, BucketFile> = [(
            "pay".to_string(),
            BucketFile {
                criticality: Default::default(),
                service: "pay".into(),
                buckets: vec![shadow_region, shadow, bucket("c", 10.0), bucket("d", 10.0)],
            },
        )]
        .into();
        let mut d_region = bucket("d", 10.0);
        d_region.scope = Scope::Region;
        let new = vec![BucketFile {
            criticality: Default::default(),
            service: "pay".into(),
            // a: shadow/region -> enforce/global, same limit; b: raised and now enforced;
            // c: policy only; d: global -> region.
            buckets: vec![bucket("a", 10.0), bucket("b", 20.0), forecast, d_region],
        }];
        let s = diff(&old, &new);
        assert_eq!(
            s.counts_line(),
            "raised 1, modified 3; mode changed 2, scope changed 2"
        );
        let msg = s.commit_message();
        assert!(
            msg.contains(
                "pay/a: modified at 10 rps: mode shadow -> enforce, scope region -> global"
            ),
            "{msg}"
        );
        assert!(
            msg.contains("pay/b: raised 10 -> 20 rps; mode shadow -> enforce"),
            "{msg}"
        );
        assert!(
            msg.contains("pay/c: modified at 10 rps: policy peak -> forecast"),
            "{msg}"
        );
        assert!(
            msg.contains("pay/d: modified at 10 rps: scope global -> region"),
            "{msg}"
        );
        assert!(
            msg.lines().next().unwrap().contains("mode changed 2"),
            "{msg}"
        );

        let mut plan = Plan::default();
        for b in &new[0].buckets {
            plan.buckets.push(PlannedBucket {
                service: "pay".into(),
                bucket: b.clone(),
                current_limit_rps: Some(10.0),
                evidence: Evidence {
                    peak_rps: Some(8.0),
                    confidence: Some(0.9),
                    explain: Some("forecast bound 9.1 rps at 2026-12-03T15:00:00+00:00 (horizon 7d) × 1.25; dip 2026-11-25..2026-11-30 at 0.50× discounted (5.0d < new normal 10d)".into()),
                    ..Evidence::default()
                },
                held: None,
            });
        }
        let body = report(&plan, &s);
        // The one-line why, in its own cell (`<` escaped like every free text).
        assert!(
            body.contains("| 8 | peak | 0.9 | forecast bound 9.1 rps at 2026-12-03T15:00:00+00:00 (horizon 7d) × 1.25; dip 2026-11-25..2026-11-30 at 0.50× discounted (5.0d &#60; new normal 10d) |"),
            "{body}"
        );
        assert!(
            body.contains(
                "| a | 10 | 10 | +0.0%; mode shadow -> enforce; scope region -> global | 8 | peak | 0.9 | forecast"
            ),
            "{body}"
        );
        assert!(
            body.contains(
                "| b | 10 | 20 | +100.0%; mode shadow -> enforce | 8 | peak | 0.9 | forecast"
            ),
            "{body}"
        );
        assert!(
            body.contains(
                "| d | 10 | 10 | +0.0%; scope global -> region | 8 | peak | 0.9 | forecast"
            ),
            "{body}"
        );
        // Plain limit changes read as before.
        let plain = diff(
            &old,
            &[BucketFile {
                criticality: Default::default(),
                service: "pay".into(),
                buckets: vec![bucket("c", 20.0), bucket("d", 10.0)],
            }],
        );
        assert!(
            !plain.commit_message().contains("mode"),
            "{}",
            plain.commit_message()
        );
    }

    #[test]
    fn body_is_truncated_under_the_limit_with_a_pointer() {
        let mut plan = Plan::default();
        let mut files = Vec::new();
        for i in 0..3000 {
            let svc = format!("service-{i:04}");
            plan.buckets.push(PlannedBucket {
                service: svc.clone(),
                bucket: bucket("caller-x", 100.0),
                current_limit_rps: None,
                evidence: Evidence {
                    peak_rps: Some(80.0),
                    confidence: Some(0.9),
                    ..Evidence::default()
                },
                held: None,
            });
            files.push(BucketFile {
                criticality: Default::default(),
                service: svc,
                buckets: vec![bucket("caller-x", 100.0)],
            });
        }
        let s = diff(&BTreeMap::new(), &files);
        let full = report(&plan, &s);
        assert!(full.len() > FORGE_BODY_LIMIT);
        assert!(
            full.contains("| caller-x | — | 100 | new | 80 | peak | 0.9 |"),
            "{}",
            &full[..600]
        );
        let body = truncate_body(&full, FORGE_BODY_LIMIT);
        assert!(body.chars().count() <= FORGE_BODY_LIMIT);
        assert!(body.contains("stored with the run"));
    }

    /// A raise of an enforced bucket its limit throttled leads the review list, with how much
    /// was refused and for how long; an unthrottled raise stays in the table.
    #[test]
    fn throttled_raises_lead_the_review_list() {
        let (plan, summary) = pay_change(
            &[("down", 100.0), ("grown", 100.0), ("up", 100.0)],
            &[("down", 75.0), ("grown", 180.0), ("up", 150.0)],
            |b| {
                let mut evidence = Evidence::default();
                if b.name == "grown" {
                    let t = chrono::DateTime::from_timestamp(1_796_000_000, 0).unwrap();
                    evidence.throttled = Some(rlc_plan::censor::ThrottledEvidence {
                        minutes: 412,
                        days: 5,
                        refused_requests: 1_234_000.0,
                        first: t,
                        last: t,
                        sustained: true,
                    });
                }
                evidence
            },
        );
        let body = report_with(
            &plan,
            &summary,
            &ReportContext {
                promotions: &[],
                dashboard_url: None,
            },
        );
        let risky: Vec<&str> = body.lines().filter(|l| l.starts_with("- **")).collect();
        assert_eq!(risky.len(), 2, "{body}");
        assert!(
            risky[0].starts_with("- **throttled_raise** pay/grown: raised 100 -> 180 rps; its limit refused 1234000 requests over 412 minutes on 5 day(s) (sustained: counted as demand)"),
            "{body}"
        );
        assert!(risky[1].starts_with("- **decrease** pay/down"), "{body}");
    }

    /// A changed bucket whose proposed limit is below its critical peak is listed with its
    /// headroom; one above it (or without tiers) is not.
    #[test]
    fn buckets_short_of_their_critical_peak_are_listed() {
        let t = chrono::DateTime::from_timestamp(1_796_000_400, 0).unwrap();
        let (plan, summary) = pay_change(
            &[("down", 100.0), ("up", 100.0)],
            &[("down", 75.0), ("up", 150.0)],
            |b| Evidence {
                critical_headroom: rlc_plan::evidence::CriticalHeadroom::of(b.limit_rps, 90.0, t),
                ..Evidence::default()
            },
        );
        let body = report(&plan, &summary);
        assert!(
            body.contains("### Critical traffic over the limit: 1 bucket(s)"),
            "{body}"
        );
        assert!(
            body.contains("- pay/down: the limit is 83.3% of its CRITICAL_PLUS + CRITICAL peak (90 rps at 2026-11-30 01:00 UTC): critical requests are shed at that peak"),
            "{body}"
        );
        assert!(!body.contains("- pay/up: the limit"), "{body}");
    }

    /// A changed bucket whose `headroom: auto` margin reached `max_headroom` is listed for
    /// review with what its replay still throttles; one within it is not.
    #[test]
    fn margins_at_max_headroom_are_listed_for_review() {
        let (plan, summary) = pay_change(
            &[("noisy", 100.0), ("calm", 100.0)],
            &[("noisy", 300.0), ("calm", 110.0)],
            |b| Evidence {
                policy: Some(rlc_plan::evidence::PolicyEvidence(serde_json::json!({
                    "headroom": if b.name == "noisy" { 1.0 } else { 0.04 },
                    "headroom_auto": {
                        "chosen": if b.name == "noisy" { 1.0 } else { 0.04 },
                        "target_throttled": 0.0001, "min_headroom": 0.03, "max_headroom": 1.0,
                        "origins": 14, "replayed_throttled": 0.0003, "tail_throttled": 0.0002,
                        "review": b.name == "noisy", "why": "-",
                    },
                }))),
                ..Evidence::default()
            },
        );
        let body = report(&plan, &summary);
        assert!(
            body.contains("### Margins at max_headroom: 1 bucket(s)"),
            "{body}"
        );
        assert!(
            body.contains("- pay/noisy: `headroom: auto` needed more than 1.00; 14 replayed origins still throttle 0.0300% (target 0.0100%)."),
            "{body}"
        );
        assert!(!body.contains("- pay/calm: `headroom"), "{body}");
    }

    #[test]
    fn risky_changes_lead_with_their_evidence_and_hostile_names_stay_text() {
        let evil = "x](http://evil.example)<img src=x onerror=alert(1)>@admin|#1 www.evil.com";
        let old: BTreeMap<String, BucketFile> = [(
            "pay".to_string(),
            BucketFile {
                criticality: Default::default(),
                service: "pay".into(),
                buckets: vec![
                    bucket("down", 100.0),
                    bucket("up", 100.0),
                    bucket(evil, 10.0),
                ],
            },
        )]
        .into();
        let mut shadow_new = bucket("quiet", 5.0);
        shadow_new.mode = Mode::Shadow;
        let new = vec![BucketFile {
            criticality: Default::default(),
            service: "pay".into(),
            buckets: vec![
                bucket("down", 75.0),
                bucket("fresh", 40.0),
                shadow_new,
                bucket("up", 150.0),
                bucket(evil, 20.0),
            ],
        }];
        let s = diff(&old, &new);
        let mut plan = Plan::default();
        for b in &new[0].buckets {
            let mut ev = Evidence {
                peak_rps: Some(32.0),
                confidence: Some(1.0),
                peak_at: Some("2026-11-27T09:15:00Z".into()),
                ..Evidence::default()
            };
            if b.name == "down" {
                ev.capped_from = Some(40.0);
            }
            plan.buckets.push(PlannedBucket {
                service: "pay".into(),
                bucket: b.clone(),
                current_limit_rps: None,
                evidence: ev,
                held: None,
            });
        }
        let body = report_with(
            &plan,
            &s,
            &ReportContext {
                promotions: &[],
                dashboard_url: Some("https://rlc.example"),
            },
        );
        let risky: Vec<&str> = body.lines().filter(|l| l.starts_with("- **")).collect();
        assert_eq!(risky.len(), 2, "{body}");
        assert_eq!(
            risky[0],
            "- **new_enforcing** [pay/fresh](https://rlc.example/buckets/pay/fresh): new bucket enforcing at once at 40 rps · limit ÷ peak 1.25 (peak 32 rps at 2026-11-27 09:15 UTC)"
        );
        assert_eq!(
            risky[1],
            "- **decrease** [pay/down](https://rlc.example/buckets/pay/down): lowered 100 -> 75 rps · limit ÷ peak 2.34 (peak 32 rps at 2026-11-27 09:15 UTC) · capped from 40 rps by the rails"
        );
        // Raises and new shadow buckets are only in the table, after the risky ones.
        assert!(body.find("- **decrease**").unwrap() < body.find("| up | 100 | 150 |").unwrap());
        assert!(body.contains("| quiet (shadow) | — | 5 | new |"), "{body}");
        // The hostile name: no link, no HTML, no mention, no reference, no extra cell, no
        // autolink.
        for bad in ["](http://evil", "<img", "@admin", "|#", " #1", "www.evil"] {
            assert!(!body.contains(bad), "{bad} in {body}");
        }
        let row = body.lines().find(|l| l.contains("evil")).unwrap();
        assert_eq!(row.matches('|').count(), 9, "{row}");
        assert!(
            row.starts_with("| x&#93;&#40;http&#58;&#47;&#47;evil.example&#41;&#60;img"),
            "{row}"
        );
        // URL segments are percent-encoded.
        assert_eq!(
            bucket_url("https://rlc.example/", "pay", "a/b c"),
            "https://rlc.example/buckets/pay/a%2Fb%20c"
        );
    }

    /// Without a change the body says so (no empty list of services), and the names of a
    /// skipped series are escaped one by one, with the `/` between them kept as it is.
    #[test]
    fn a_plan_without_change_says_so_and_keeps_slashes_between_names() {
        let mut plan = crate::gitops::tests::plan(vec![]);
        plan.skipped.push(rlc_plan::plan::Skipped {
            service: "maps".into(),
            caller: Some("web".into()),
            procedure: Some("route<b>".into()),
            reason: "no samples in the window".into(),
        });
        let body = report(&plan, &ChangeSummary::default());
        let title = body.lines().next().unwrap();
        assert_eq!(title, "## rlc: no quota change", "{body}");
        assert!(
            body.contains("- maps/web/route&#60;b&#62;: no samples in the window"),
            "{body}"
        );
        assert!(!body.contains("&#47;"), "{body}");
    }
}
