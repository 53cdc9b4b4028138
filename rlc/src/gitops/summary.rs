//! What changed between the bucket files in the repo and the ones a plan renders, in words: the
//! commit message and the pull-request body (a markdown table per service).

use std::collections::BTreeMap;
use std::fmt::Write;

use schema::{format_rps, BucketFile, Mode, Scope};
use serde::Serialize;

use crate::plan::Plan;

/// GitHub refuses PR bodies and comments above 65,535 characters.
pub const FORGE_BODY_LIMIT: usize = 65_535;

/// Where the full report is committed in pull-request mode.
pub const REPORT_PATH: &str = "rlc/last-run.md";

/// How one bucket changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChangeKind {
    /// New bucket.
    Added,
    /// Bucket no longer proposed for a service the plan covers.
    Removed,
    /// Higher limit.
    Raised,
    /// Lower limit.
    Lowered,
    /// Same limit, other fields (mode, scope, policy, match) changed; which ones is in
    /// [`BucketChange::details`].
    Modified,
}

impl ChangeKind {
    /// The lowercase word used in summaries and the store.
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Added => "added",
            ChangeKind::Removed => "removed",
            ChangeKind::Raised => "raised",
            ChangeKind::Lowered => "lowered",
            ChangeKind::Modified => "modified",
        }
    }
}

/// One changed bucket.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BucketChange {
    /// Bucket name.
    pub bucket: String,
    /// What happened to it.
    pub kind: ChangeKind,
    /// Limit in the repo before.
    pub old_limit_rps: Option<f64>,
    /// Limit written now.
    pub new_limit_rps: Option<f64>,
    /// Mode before.
    pub old_mode: Option<Mode>,
    /// Mode now.
    pub new_mode: Option<Mode>,
    /// Scope before.
    pub old_scope: Option<Scope>,
    /// Scope now.
    pub new_scope: Option<Scope>,
    /// Policy (provenance) before.
    pub old_policy: Option<String>,
    /// Policy now.
    pub new_policy: Option<String>,
    /// The caller or procedure the bucket matches changed.
    pub match_changed: bool,
}

impl BucketChange {
    /// Whether the mode changed (`shadow -> enforce`): a bucket that starts or stops
    /// dropping traffic, whatever its limit did.
    pub fn mode_changed(&self) -> bool {
        self.old_mode.is_some() && self.new_mode.is_some() && self.old_mode != self.new_mode
    }

    /// Whether the scope changed (`region -> global`): the same limit then counts other
    /// traffic.
    pub fn scope_changed(&self) -> bool {
        self.old_scope.is_some() && self.new_scope.is_some() && self.old_scope != self.new_scope
    }

    /// What changed besides the limit, in words: `mode shadow -> enforce`, `scope region ->
    /// global`, `policy peak -> forecast`, `match changed`. Empty for added and removed
    /// buckets.
    pub fn details(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let (true, Some(o), Some(n)) = (self.mode_changed(), self.old_mode, self.new_mode) {
            out.push(format!("mode {} -> {}", o.as_str(), n.as_str()));
        }
        if let (true, Some(o), Some(n)) = (self.scope_changed(), self.old_scope, self.new_scope) {
            out.push(format!("scope {} -> {}", o.as_str(), n.as_str()));
        }
        if let (Some(o), Some(n)) = (&self.old_policy, &self.new_policy) {
            if o != n {
                out.push(format!("policy {o} -> {n}"));
            }
        }
        if self.match_changed {
            out.push("caller/procedure match changed".into());
        }
        out
    }
}

/// The changed buckets of one service.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServiceChange {
    /// Callee service.
    pub service: String,
    /// Its changed buckets, by name.
    pub changes: Vec<BucketChange>,
}

/// Every change of one run, by service.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChangeSummary {
    /// Services with at least one changed bucket, sorted.
    pub services: Vec<ServiceChange>,
}

/// Compares the current files (by service) with the files a plan renders. Services the plan
/// does not cover are not compared: they stay untouched.
pub fn diff(old: &BTreeMap<String, BucketFile>, new: &[BucketFile]) -> ChangeSummary {
    let mut services = Vec::new();
    for nf in new {
        let old_buckets: BTreeMap<&str, &schema::Bucket> = old
            .get(&nf.service)
            .map(|f| f.buckets.iter().map(|b| (b.name.as_str(), b)).collect())
            .unwrap_or_default();
        let new_buckets: BTreeMap<&str, &schema::Bucket> =
            nf.buckets.iter().map(|b| (b.name.as_str(), b)).collect();
        let mut changes = Vec::new();
        for (name, nb) in &new_buckets {
            let kind = match old_buckets.get(name) {
                None => Some(ChangeKind::Added),
                Some(ob) if nb.limit_rps > ob.limit_rps => Some(ChangeKind::Raised),
                Some(ob) if nb.limit_rps < ob.limit_rps => Some(ChangeKind::Lowered),
                Some(ob) if ob != nb => Some(ChangeKind::Modified),
                Some(_) => None,
            };
            if let Some(kind) = kind {
                let ob = old_buckets.get(name);
                changes.push(BucketChange {
                    bucket: name.to_string(),
                    kind,
                    old_limit_rps: ob.map(|b| b.limit_rps),
                    new_limit_rps: Some(nb.limit_rps),
                    old_mode: ob.map(|b| b.mode),
                    new_mode: Some(nb.mode),
                    old_scope: ob.map(|b| b.scope),
                    new_scope: Some(nb.scope),
                    old_policy: ob.map(|b| b.policy.to_string()),
                    new_policy: Some(nb.policy.to_string()),
                    match_changed: ob
                        .is_some_and(|b| b.caller != nb.caller || b.procedure != nb.procedure),
                });
            }
        }
        for (name, ob) in &old_buckets {
            if !new_buckets.contains_key(name) {
                changes.push(BucketChange {
                    bucket: name.to_string(),
                    kind: ChangeKind::Removed,
                    old_limit_rps: Some(ob.limit_rps),
                    new_limit_rps: None,
                    old_mode: Some(ob.mode),
                    new_mode: None,
                    old_scope: Some(ob.scope),
                    new_scope: None,
                    old_policy: Some(ob.policy.to_string()),
                    new_policy: None,
                    match_changed: false,
                });
            }
        }
        changes.sort_by(|a, b| a.bucket.cmp(&b.bucket));
        if !changes.is_empty() {
            services.push(ServiceChange {
                service: nf.service.clone(),
                changes,
            });
        }
    }
    services.sort_by(|a, b| a.service.cmp(&b.service));
    ChangeSummary { services }
}

impl ChangeSummary {
    /// No bucket changed.
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// Count of changes of `kind` over all services.
    pub fn count(&self, kind: ChangeKind) -> usize {
        self.services
            .iter()
            .flat_map(|s| &s.changes)
            .filter(|c| c.kind == kind)
            .count()
    }

    /// `raised 2, lowered 1, added 3` (only non-zero counts), then how many buckets changed
    /// mode or scope (whatever their limit did): `modified 1; mode changed 1`.
    pub fn counts_line(&self) -> String {
        let all = || self.services.iter().flat_map(|s| &s.changes);
        let extra: Vec<String> = [
            ("mode changed", all().filter(|c| c.mode_changed()).count()),
            ("scope changed", all().filter(|c| c.scope_changed()).count()),
        ]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(w, n)| format!("{w} {n}"))
        .collect();
        let kinds = self.kind_counts();
        if extra.is_empty() {
            kinds
        } else {
            format!("{kinds}; {}", extra.join(", "))
        }
    }

    fn kind_counts(&self) -> String {
        let parts: Vec<String> = [
            ("raised", ChangeKind::Raised),
            ("lowered", ChangeKind::Lowered),
            ("added", ChangeKind::Added),
            ("removed", ChangeKind::Removed),
            ("modified", ChangeKind::Modified),
        ]
        .iter()
        .filter_map(|(w, k)| {
            let n = self.count(*k);
            (n > 0).then(|| format!("{w} {n}"))
        })
        .collect();
        if parts.is_empty() {
            "no change".into()
        } else {
            parts.join(", ")
        }
    }

    /// A one-line title: `rlc: quotas for 2 services (raised 2, added 1)`.
    pub fn title(&self) -> String {
        let n = self.services.len();
        let names: Vec<&str> = self.services.iter().map(|s| s.service.as_str()).collect();
        let who = if n <= 3 {
            names.join(", ")
        } else {
            format!("{n} services")
        };
        format!("rlc: update quotas for {who} ({})", self.counts_line())
    }

    /// The commit message: a title, then one line per changed bucket (bounded, so a huge run
    /// still gives a readable message).
    pub fn commit_message(&self) -> String {
        const MAX_LINES: usize = 200;
        let mut out = self.title();
        out.push_str("\n\n");
        let mut lines = 0;
        let total: usize = self.services.iter().map(|s| s.changes.len()).sum();
        'outer: for s in &self.services {
            for c in &s.changes {
                if lines == MAX_LINES {
                    let _ = writeln!(out, "... and {} more bucket changes", total - lines);
                    break 'outer;
                }
                let _ = writeln!(out, "{}/{}: {}", s.service, c.bucket, describe(c));
                lines += 1;
            }
        }
        out
    }
}

/// One changed bucket in words: `raised 10 -> 20 rps`, `modified at 10 rps: mode shadow ->
/// enforce, scope region -> global`, `lowered 10 -> 5 rps; mode enforce -> shadow`.
pub fn describe(c: &BucketChange) -> String {
    let f = |v: Option<f64>| v.map(format_rps).unwrap_or_else(|| "-".into());
    let details = c.details();
    let base = match c.kind {
        ChangeKind::Modified => {
            return format!(
                "modified at {} rps: {}",
                f(c.new_limit_rps),
                if details.is_empty() {
                    "other fields".to_string()
                } else {
                    details.join(", ")
                }
            )
        }
        _ => describe_kind(c),
    };
    if details.is_empty() {
        base
    } else {
        format!("{base}; {}", details.join(", "))
    }
}

fn describe_kind(c: &BucketChange) -> String {
    let f = |v: Option<f64>| v.map(format_rps).unwrap_or_else(|| "-".into());
    match c.kind {
        ChangeKind::Added => format!(
            "added at {} rps ({})",
            f(c.new_limit_rps),
            c.new_mode.map(|m| m.as_str()).unwrap_or("")
        ),
        ChangeKind::Removed => format!("removed (was {} rps)", f(c.old_limit_rps)),
        ChangeKind::Raised => format!(
            "raised {} -> {} rps",
            f(c.old_limit_rps),
            f(c.new_limit_rps)
        ),
        ChangeKind::Lowered => format!(
            "lowered {} -> {} rps",
            f(c.old_limit_rps),
            f(c.new_limit_rps)
        ),
        ChangeKind::Modified => format!("modified at {} rps", f(c.new_limit_rps)),
    }
}

fn evidence_str(ev: &serde_json::Value, key: &str) -> String {
    match ev.get(key) {
        Some(serde_json::Value::Number(n)) => n.as_f64().map(format_rps).unwrap_or_default(),
        Some(serde_json::Value::String(s)) => s.replace('|', "\\|"),
        Some(serde_json::Value::Null) | None => "-".into(),
        Some(v) => v.to_string().replace('|', "\\|"),
    }
}

/// The full markdown report of a run: a table per changed service (bucket, current, proposed,
/// change %, observed peak, policy, confidence), removed buckets, and what was skipped.
pub fn report(plan: &Plan, summary: &ChangeSummary) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "## {}\n", summary.title());
    out.push_str("Generated by rlc from `rlc/*.yaml` and observed traffic. Review the proposed limits; merging applies them to the GRL controller.\n\n");
    for s in &summary.services {
        let _ = writeln!(out, "### {}\n", s.service);
        out.push_str(
            "| bucket | current | proposed | change % | observed peak | policy | confidence |\n",
        );
        out.push_str("|---|---:|---:|---:|---:|---|---|\n");
        for c in &s.changes {
            let pb = plan
                .buckets
                .iter()
                .find(|b| b.service == s.service && b.bucket.name == c.bucket);
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
            let (peak, policy, conf) = match pb {
                Some(pb) => (
                    evidence_str(&pb.evidence, "peak_rps"),
                    pb.bucket.policy.to_string(),
                    evidence_str(&pb.evidence, "confidence"),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            let mode = match c.new_mode {
                Some(Mode::Shadow) => " (shadow)",
                _ => "",
            };
            let _ = writeln!(
                out,
                "| {}{mode} | {current} | {proposed} | {pct} | {peak} | {policy} | {conf} |",
                c.bucket
            );
        }
        out.push('\n');
    }
    if !plan.skipped.is_empty() {
        out.push_str("### Skipped (current quotas kept)\n\n");
        for sk in &plan.skipped {
            let what = sk.target();
            let _ = writeln!(out, "- {what}: {}", sk.reason);
        }
        out.push('\n');
    }
    out
}

/// `full` cut at a line boundary to at most `limit` bytes (hence characters), with a note
/// pointing to the full report on `branch`.
pub fn truncate_body(full: &str, limit: usize, branch: &str) -> String {
    if full.len() <= limit {
        return full.to_string();
    }
    let note = format!(
        "\n\n---\n**Truncated**: this report is longer than the forge allows. The full report is committed on branch `{branch}` in `{REPORT_PATH}`.\n"
    );
    let budget = limit.saturating_sub(note.len());
    let mut out = String::new();
    for line in full.split_inclusive('\n') {
        if out.len() + line.len() > budget {
            break;
        }
        out.push_str(line);
    }
    out.push_str(&note);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::PlannedBucket;
    use schema::{Bucket, PolicyName, Scope};

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
    fn diff_names_every_kind_of_change() {
        let old: BTreeMap<String, BucketFile> = [(
            "pay".to_string(),
            BucketFile {
                service: "pay".into(),
                buckets: vec![bucket("a", 10.0), bucket("b", 10.0), bucket("c", 10.0)],
            },
        )]
        .into();
        let new = vec![BucketFile {
            service: "pay".into(),
            buckets: vec![bucket("a", 20.0), bucket("b", 5.0), bucket("d", 1.0)],
        }];
        let s = diff(&old, &new);
        assert_eq!(s.counts_line(), "raised 1, lowered 1, added 1, removed 1");
        let msg = s.commit_message();
        assert!(msg.contains("pay/a: raised 10 -> 20 rps"), "{msg}");
        assert!(msg.contains("pay/c: removed (was 10 rps)"), "{msg}");
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
                service: "pay".into(),
                buckets: vec![shadow_region, shadow, bucket("c", 10.0), bucket("d", 10.0)],
            },
        )]
        .into();
        let mut d_region = bucket("d", 10.0);
        d_region.scope = Scope::Region;
        let new = vec![BucketFile {
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
                evidence: serde_json::json!({"peak_rps": 8.0, "confidence": "high"}),
                held: None,
            });
        }
        let body = report(&plan, &s);
        assert!(
            body.contains(
                "| a | 10 | 10 | +0.0%; mode shadow -> enforce; scope region -> global | 8 | peak | high |"
            ),
            "{body}"
        );
        assert!(
            body.contains("| b | 10 | 20 | +100.0%; mode shadow -> enforce | 8 | peak | high |"),
            "{body}"
        );
        assert!(
            body.contains("| d | 10 | 10 | +0.0%; scope global -> region | 8 | peak | high |"),
            "{body}"
        );
        // Plain limit changes read as before.
        let plain = diff(
            &old,
            &[BucketFile {
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
                evidence: serde_json::json!({"peak_rps": 80.0, "confidence": "high"}),
                held: None,
            });
            files.push(BucketFile {
                service: svc,
                buckets: vec![bucket("caller-x", 100.0)],
            });
        }
        let s = diff(&BTreeMap::new(), &files);
        let full = report(&plan, &s);
        assert!(full.len() > FORGE_BODY_LIMIT);
        assert!(
            full.contains("| caller-x | — | 100 | new | 80 | peak | high |"),
            "{}",
            &full[..600]
        );
        let body = truncate_body(&full, FORGE_BODY_LIMIT, "rlc/quotas");
        assert!(body.chars().count() <= FORGE_BODY_LIMIT);
        assert!(body.contains("rlc/last-run.md"));
    }
}
