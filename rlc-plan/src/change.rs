//! The one vocabulary of change: how a bucket file differs from the one a plan renders
//! (added, removed, raised, lowered, modified, with mode, scope, policy and match changes
//! named), shared by the commit message, the pull-request body, the JSON outputs, the quota
//! API and what-if previews.

use std::collections::BTreeMap;
use std::fmt::Write;

use schema::{format_rps, BucketFile, Mode, Scope};
use serde::Serialize;

/// How one bucket changed: the one word for it everywhere (commit message, pull-request
/// body, JSON answers, the store's `change` column, the dashboard).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema,
)]
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

impl std::fmt::Display for ChangeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A word that is not a [`ChangeKind`] (a store row written by something else).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown change `{0}` (want added, removed, raised, lowered or modified)")]
pub struct UnknownChange(pub String);

impl std::str::FromStr for ChangeKind {
    type Err = UnknownChange;

    fn from_str(s: &str) -> Result<ChangeKind, UnknownChange> {
        [
            ChangeKind::Added,
            ChangeKind::Removed,
            ChangeKind::Raised,
            ChangeKind::Lowered,
            ChangeKind::Modified,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
        .ok_or_else(|| UnknownChange(s.to_string()))
    }
}

impl TryFrom<String> for ChangeKind {
    type Error = UnknownChange;

    fn try_from(s: String) -> Result<ChangeKind, UnknownChange> {
        s.parse()
    }
}

/// One changed bucket.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
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
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
pub struct ServiceChange {
    /// Callee service.
    pub service: String,
    /// Its changed buckets, by name.
    pub changes: Vec<BucketChange>,
}

/// Every change of one run, by service.
#[derive(Debug, Clone, Default, PartialEq, Serialize, schemars::JsonSchema)]
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

    /// A one-line title: `rlc: update quotas for 2 services (raised 2, added 1)`;
    /// `rlc: no quota change` when nothing changed.
    pub fn title(&self) -> String {
        let n = self.services.len();
        if n == 0 {
            return "rlc: no quota change".into();
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use schema::{Bucket, PolicyName};

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
                criticality: Default::default(),
                service: "pay".into(),
                buckets: vec![bucket("a", 10.0), bucket("b", 10.0), bucket("c", 10.0)],
            },
        )]
        .into();
        let new = vec![BucketFile {
            criticality: Default::default(),
            service: "pay".into(),
            buckets: vec![bucket("a", 20.0), bucket("b", 5.0), bucket("d", 1.0)],
        }];
        let s = diff(&old, &new);
        assert_eq!(s.counts_line(), "raised 1, lowered 1, added 1, removed 1");
        let msg = s.commit_message();
        assert!(msg.contains("pay/a: raised 10 -> 20 rps"), "{msg}");
        assert!(msg.contains("pay/c: removed (was 10 rps)"), "{msg}");
    }
}
