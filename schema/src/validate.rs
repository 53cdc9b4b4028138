//! Whole-repo validation: every file parsed, every cross-field and cross-file rule checked,
//! and *all* problems reported, each with file, line and key.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use crate::types::*;
use crate::{parse_file, parse_str, Diagnostic, Located};

/// A config repo as loaded from disk (DESIGN §3.1). Files that failed to parse are absent and
/// their problems are in the diagnostics returned next to it.
#[derive(Debug, Default, Clone)]
pub struct ConfigRepo {
    /// The repo's root directory.
    pub root: PathBuf,
    /// `buckets/<service>.yaml`, by service (file stem).
    pub buckets: BTreeMap<String, Located<BucketFile>>,
    /// `rlc/policies.yaml`.
    pub policies: Option<Located<PoliciesFile>>,
    /// `rlc/contracts.yaml`.
    pub contracts: Option<Located<ContractsFile>>,
    /// `rlc/capacity.yaml`.
    pub capacity: Option<Located<CapacityFile>>,
}

impl ConfigRepo {
    /// Loads and checks the repo at `root`. Returns the repo with everything that parsed, and
    /// every problem found (sorted by file and line).
    pub fn load(root: &Path) -> (ConfigRepo, Vec<Diagnostic>) {
        let mut diags = Vec::new();
        let mut repo = ConfigRepo {
            root: root.to_path_buf(),
            ..Default::default()
        };
        let rel = |p: &str| root.join(p);

        let bucket_dir = root.join("buckets");
        if bucket_dir.is_dir() {
            let (files, d) = load_bucket_dir(&bucket_dir);
            diags.extend(d);
            for f in files {
                // Keyed by file name, as `service` may differ (already reported).
                let stem = f
                    .file
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .unwrap_or_default();
                repo.buckets.insert(stem.to_string(), f);
            }
        }

        let policies = rel("rlc/policies.yaml");
        if policies.exists() {
            match parse_file::<PoliciesFile>(&policies) {
                Ok(f) => {
                    check_policies(&f, &mut diags);
                    repo.policies = Some(f);
                }
                Err(d) => diags.push(d),
            }
        } else {
            diags.push(file_diag(
                &policies,
                "missing: every config repo needs rlc/policies.yaml (at least a `default` policy)"
                    .into(),
            ));
        }
        let contracts = rel("rlc/contracts.yaml");
        if contracts.exists() {
            match parse_file::<ContractsFile>(&contracts) {
                Ok(f) => repo.contracts = Some(f),
                Err(d) => diags.push(d),
            }
        }
        let capacity = rel("rlc/capacity.yaml");
        if capacity.exists() {
            match parse_file::<CapacityFile>(&capacity) {
                Ok(f) => repo.capacity = Some(f),
                Err(d) => diags.push(d),
            }
        }
        repo.check_references(&mut diags);
        diags.sort();
        diags.dedup();
        (repo, diags)
    }

    /// Every service the repo knows: bucket files and services named in policies.yaml.
    pub fn known_services(&self) -> BTreeSet<String> {
        let mut s: BTreeSet<String> = self.buckets.keys().cloned().collect();
        if let Some(p) = &self.policies {
            s.extend(p.value.services.keys().cloned());
        }
        s
    }

    /// The current buckets of `service`, if it has a file.
    pub fn current(&self, service: &str) -> Option<&BucketFile> {
        self.buckets.get(service).map(|l| &l.value)
    }

    fn check_references(&self, diags: &mut Vec<Diagnostic>) {
        let known = self.known_services();
        let capacity = self.capacity.as_ref();
        if let Some(c) = &self.contracts {
            let mut seen: HashMap<(&str, Option<&str>, Option<&str>), usize> = HashMap::new();
            for (i, k) in c.value.contracts.iter().enumerate() {
                let at = |key: &str| format!("contracts[{i}].{key}");
                if !known.contains(&k.service) {
                    diags.push(c.diag(
                        at("service"),
                        format!(
                            "references unknown service `{}` (no buckets/{}.yaml and not in rlc/policies.yaml)",
                            k.service, k.service
                        ),
                    ));
                }
                if k.caller.is_none() && k.procedure.is_none() {
                    diags.push(c.diag(
                        format!("contracts[{i}]"),
                        "a contract needs a caller, a procedure or both",
                    ));
                }
                check_rate(c, &at("limit_rps"), k.limit_rps, diags);
                let key = (
                    k.service.as_str(),
                    k.caller.as_deref(),
                    k.procedure.as_deref(),
                );
                if let Some(&j) = seen.get(&key) {
                    diags.push(c.diag(
                        format!("contracts[{i}]"),
                        format!("contradicts contracts[{j}]: the same service, caller and procedure twice"),
                    ));
                } else {
                    seen.insert(key, i);
                }
                if let Some(cap) = capacity {
                    if let Some(rps) = cap.value.for_bucket(&k.service, k.procedure.as_deref()) {
                        if k.limit_rps.is_finite() && k.limit_rps > rps {
                            diags.push(c.diag(
                                at("limit_rps"),
                                format!(
                                    "contract limit {} exceeds the planned capacity {} in rlc/capacity.yaml",
                                    crate::format_rps(k.limit_rps),
                                    crate::format_rps(rps)
                                ),
                            ));
                        }
                    }
                }
            }
        }
        if let Some(c) = capacity {
            let mut seen: HashMap<(&str, Option<&str>), usize> = HashMap::new();
            for (i, e) in c.value.capacity.iter().enumerate() {
                if !known.contains(&e.service) {
                    diags.push(c.diag(
                        format!("capacity[{i}].service"),
                        format!("references unknown service `{}`", e.service),
                    ));
                }
                check_rate(c, &format!("capacity[{i}].rps"), e.rps, diags);
                let key = (e.service.as_str(), e.procedure.as_deref());
                if let Some(&j) = seen.get(&key) {
                    diags.push(c.diag(
                        format!("capacity[{i}]"),
                        format!("contradicts capacity[{j}]: the same service and procedure twice"),
                    ));
                } else {
                    seen.insert(key, i);
                }
            }
            // A procedure's capacity above its whole service's capacity cannot both hold.
            for (i, e) in c.value.capacity.iter().enumerate() {
                if e.procedure.is_none() {
                    continue;
                }
                if let Some(total) = c
                    .value
                    .capacity
                    .iter()
                    .find(|t| t.service == e.service && t.procedure.is_none())
                {
                    if e.rps > total.rps {
                        diags.push(c.diag(
                            format!("capacity[{i}].rps"),
                            format!(
                                "procedure capacity {} exceeds the whole service's {}",
                                crate::format_rps(e.rps),
                                crate::format_rps(total.rps)
                            ),
                        ));
                    }
                }
            }
        }
    }
}

/// Loads the bucket files of `dir` (a config repo's `buckets/`) the one way `rlc validate`,
/// `rlc` and `grl controller --config-dir` all use: `*.yaml` only (a `.yml` file is reported as
/// ignored), each parsed with unknown keys refused and checked (the `service` key equals the
/// file name, unique bucket names and matchers, positive finite limits). Returns the files
/// that passed, sorted by path, and every problem with file, line and key (sorted, no
/// duplicates). Files that parsed are returned even when a check failed (callers that apply
/// the config must refuse on any diagnostic).
pub fn load_bucket_dir(dir: &Path) -> (Vec<Located<BucketFile>>, Vec<Diagnostic>) {
    let mut diags = Vec::new();
    let mut files = Vec::new();
    let mut entries: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(e) => {
            diags.push(file_diag(dir, format!("cannot read directory: {e}")));
            Vec::new()
        }
    };
    entries.sort();
    for path in entries {
        match path.extension().and_then(|e| e.to_str()) {
            Some("yaml") => {}
            Some("yml") => {
                diags.push(file_diag(
                    &path,
                    "bucket files end in .yaml; this file is ignored by rlc and grl".into(),
                ));
                continue;
            }
            _ => continue,
        }
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        match parse_file::<BucketFile>(&path) {
            Ok(f) => {
                check_bucket_file(&stem, &f, &mut diags);
                files.push(f);
            }
            Err(d) => diags.push(d),
        }
    }
    diags.sort();
    diags.dedup();
    (files, diags)
}

/// Validates the config repo at `root`: all problems, sorted by file and line.
pub fn validate_repo(root: &Path) -> Vec<Diagnostic> {
    ConfigRepo::load(root).1
}

fn file_diag(file: &Path, message: String) -> Diagnostic {
    Diagnostic {
        file: file.to_path_buf(),
        line: 1,
        column: 1,
        key: String::new(),
        message,
    }
}

fn check_rate<T>(f: &Located<T>, key: &str, v: f64, diags: &mut Vec<Diagnostic>) {
    if !v.is_finite() {
        diags.push(f.diag(key, format!("must be a finite number, got {v}")));
    } else if v <= 0.0 {
        diags.push(f.diag(key, format!("must be positive, got {v}")));
    }
}

fn check_bucket_file(stem: &str, f: &Located<BucketFile>, diags: &mut Vec<Diagnostic>) {
    if f.value.service != stem {
        diags.push(f.diag(
            "service",
            format!(
                "service `{}` differs from the file name `{stem}.yaml`",
                f.value.service
            ),
        ));
    }
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut matches: HashMap<(Option<&str>, Option<&str>), usize> = HashMap::new();
    for (i, b) in f.value.buckets.iter().enumerate() {
        let at = |k: &str| format!("buckets[{i}].{k}");
        if b.name.trim().is_empty() {
            diags.push(f.diag(at("name"), "must not be empty"));
        }
        if let Some(&j) = names.get(b.name.as_str()) {
            diags.push(f.diag(
                at("name"),
                format!("duplicate bucket name `{}` (also buckets[{j}])", b.name),
            ));
        } else {
            names.insert(&b.name, i);
        }
        if b.caller.is_none() && b.procedure.is_none() {
            diags.push(f.diag(
                format!("buckets[{i}]"),
                "a bucket needs a caller, a procedure or both",
            ));
        } else {
            let m = (b.caller.as_deref(), b.procedure.as_deref());
            if let Some(&j) = matches.get(&m) {
                diags.push(f.diag(
                    format!("buckets[{i}]"),
                    format!(
                        "matches the same caller and procedure as buckets[{j}] (`{}`)",
                        f.value.buckets[j].name
                    ),
                ));
            } else {
                matches.insert(m, i);
            }
        }
        for (k, v) in [("caller", &b.caller), ("procedure", &b.procedure)] {
            if v.as_deref().is_some_and(|s| s.trim().is_empty()) {
                diags.push(f.diag(at(k), "must not be empty when present"));
            }
        }
        check_rate(f, &at("limit_rps"), b.limit_rps, diags);
    }
}

fn check_spec(f: &Located<PoliciesFile>, at: &str, s: &PolicySpec, diags: &mut Vec<Diagnostic>) {
    let key = |k: &str| {
        if at.is_empty() {
            k.to_string()
        } else {
            format!("{at}.{k}")
        }
    };
    if let Some(h) = s.headroom {
        if !h.is_finite() || h < 0.0 {
            diags.push(f.diag(
                key("headroom"),
                format!("must be a finite number ≥ 0, got {h}"),
            ));
        }
    }
    if let Some(p) = s.percentile {
        if !(p > 0.0 && p <= 100.0) {
            diags.push(f.diag(key("percentile"), format!("must be in (0, 100], got {p}")));
        }
    }
    if let Some(v) = s.floor_rps {
        if !v.is_finite() || v < 0.0 {
            diags.push(f.diag(
                key("floor_rps"),
                format!("must be a finite number ≥ 0, got {v}"),
            ));
        }
    }
    if let Some(v) = s.ceiling_rps {
        check_rate(f, &key("ceiling_rps"), v, diags);
    }
    if let (Some(lo), Some(hi)) = (s.floor_rps, s.ceiling_rps) {
        if lo > hi {
            diags.push(f.diag(
                key("floor_rps"),
                format!("floor_rps {lo} is above ceiling_rps {hi}"),
            ));
        }
    }
    if s.policy == Some(PolicyName::Manual) {
        diags.push(f.diag(
            key("policy"),
            "`manual` is a provenance, not a policy: use peak, forecast, fixed or plugin:<name>",
        ));
    }
}

fn check_policies(f: &Located<PoliciesFile>, diags: &mut Vec<Diagnostic>) {
    if f.value.default.policy.is_none() {
        diags.push(f.diag("default.policy", "the default needs a policy"));
    }
    check_spec(f, "default", &f.value.default, diags);
    for (name, spec) in &f.value.services {
        check_spec(f, &format!("services.{name}"), spec, diags);
    }
}

/// Loads `rlc.yaml`, checking what serde cannot.
pub fn load_daemon_config(path: &Path) -> Result<DaemonConfig, Vec<Diagnostic>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| vec![file_diag(path, format!("cannot read file: {e}"))])?;
    let f: Located<DaemonConfig> = parse_str(path, &text).map_err(|d| vec![d])?;
    let mut diags = Vec::new();
    let h = &f.value.history;
    match (&h.prometheus, &h.file) {
        (None, None) => diags.push(f.diag("history", "needs `prometheus` or `file`")),
        (Some(_), Some(_)) => {
            diags.push(f.diag("history.file", "give `prometheus` or `file`, not both"))
        }
        _ => {}
    }
    if !(0.0..=1.0).contains(&h.min_coverage) {
        diags.push(f.diag("history.min_coverage", "must be between 0 and 1"));
    }
    if h.step.as_secs() > h.lookback.as_secs() {
        diags.push(f.diag("history.step", "is longer than history.lookback"));
    }
    if let Some(p) = &h.prometheus {
        if !(p.url.starts_with("http://") || p.url.starts_with("https://")) {
            diags.push(f.diag(
                "history.prometheus.url",
                "must start with http:// or https://",
            ));
        }
        if p.max_points < 2 {
            diags.push(f.diag("history.prometheus.max_points", "must be at least 2"));
        }
        if p.concurrency == 0 {
            diags.push(f.diag("history.prometheus.concurrency", "must be at least 1"));
        }
        if p.retries == 0 {
            diags.push(f.diag("history.prometheus.retries", "must be at least 1"));
        }
    }
    let r = &f.value.rails;
    for (k, v) in [
        ("min_change", r.min_change),
        ("max_decrease", r.max_decrease),
    ] {
        if !(0.0..=1.0).contains(&v) {
            diags.push(f.diag(
                format!("rails.{k}"),
                format!("must be between 0 and 1, got {v}"),
            ));
        }
    }
    if !(r.floor_rps.is_finite() && r.floor_rps >= 0.0) {
        diags.push(f.diag("rails.floor_rps", "must be a finite number ≥ 0"));
    }
    if let Some(c) = &f.value.controller {
        if !(c.url.starts_with("http://") || c.url.starts_with("https://")) {
            diags.push(f.diag("controller.url", "must start with http:// or https://"));
        }
        if let Some(t) = &c.tls {
            if c.url.starts_with("http://") {
                diags.push(f.diag(
                    "controller.tls",
                    "is set but controller.url is http://; use https://",
                ));
            }
            if t.client_cert.is_some() != t.client_key.is_some() {
                diags.push(f.diag("controller.tls", "client_cert and client_key go together"));
            }
        }
    }
    if let Some(expr) = &f.value.schedule {
        if let Err(e) = crate::parse_schedule(expr) {
            diags.push(f.diag("schedule", e));
        }
    }
    let db = &f.value.database_url;
    if !(db.starts_with("sqlite:")
        || db.starts_with("postgres://")
        || db.starts_with("postgresql://"))
    {
        diags.push(f.diag("database_url", "must be sqlite://… or postgres://…"));
    }
    if let Some(forge) = &f.value.config_repo.forge {
        match forge.kind.as_str() {
            "none" => {}
            "github" => {
                if forge.repo.is_none() {
                    diags.push(f.diag(
                        "config_repo.forge.repo",
                        "github forge needs repo: owner/name",
                    ));
                }
            }
            k => diags.push(f.diag(
                "config_repo.forge.kind",
                format!("unknown forge `{k}`, expected github or none"),
            )),
        }
    }
    if diags.is_empty() {
        Ok(f.value)
    } else {
        diags.sort();
        Err(diags)
    }
}
