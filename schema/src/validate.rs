//! Whole-repo validation: every file parsed, every cross-field and cross-file rule checked,
//! and *all* problems reported, each with file, line and key.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;

use crate::read::{file_diag, Reader};
use crate::types::*;
use crate::{parse_within, Diagnostic, Limits, Located, Locator, Parsed};

/// A config repo as loaded from disk. Files that failed to parse are absent (or
/// present with their faulty parts replaced) and their problems are in the diagnostics
/// returned next to it.
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
    /// Services whose bucket file exists but could not be read or parsed: still known.
    pub unparsed_services: BTreeSet<String>,
    /// Whether the set of known services is complete (false when `rlc/policies.yaml` had a
    /// problem: a reference is then never called unknown).
    pub services_complete: bool,
}

/// Reads and parses one file of the repo, with every problem (parse problems first).
fn load_file<T: DeserializeOwned>(
    reader: &mut Reader,
    path: &Path,
    diags: &mut Vec<Diagnostic>,
) -> Option<Parsed<T>> {
    match reader.read(path) {
        Ok(text) => {
            let left = reader.limits.max_repo_nodes.saturating_sub(reader.nodes);
            let (p, nodes) = parse_within::<T>(path, &text, &reader.limits, left);
            reader.nodes += nodes;
            diags.extend(p.problems.iter().cloned());
            Some(p)
        }
        Err(d) => {
            diags.push(d);
            None
        }
    }
}

/// Adds the diagnostics of later checks that are not consequences of a parse problem.
fn push_checked<T>(p: &Parsed<T>, found: Vec<Diagnostic>, diags: &mut Vec<Diagnostic>) {
    diags.extend(found.into_iter().filter(|d| !p.explains(&d.key)));
}

/// Whether `path` names an entry that exists (a dangling symbolic link exists too: reading
/// it reports why it cannot be read).
fn present(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

impl ConfigRepo {
    /// Loads and checks the repo at `root` within the default [`Limits`]. Returns the repo with
    /// everything that parsed, and every problem found (sorted by file and line).
    pub fn load(root: &Path) -> (ConfigRepo, Vec<Diagnostic>) {
        Self::load_with(root, &Limits::DEFAULT)
    }

    /// [`ConfigRepo::load`] within `limits`.
    pub fn load_with(root: &Path, limits: &Limits) -> (ConfigRepo, Vec<Diagnostic>) {
        let mut diags = Vec::new();
        let mut repo = ConfigRepo {
            root: root.to_path_buf(),
            services_complete: true,
            ..Default::default()
        };
        let mut reader = match Reader::confined(root, *limits) {
            Ok(r) => r,
            Err(d) => return (repo, vec![d]),
        };
        let rel = |p: &str| root.join(p);

        let bucket_dir = root.join("buckets");
        if present(&bucket_dir) {
            let b = bucket_dir_with(&mut reader, &bucket_dir);
            diags.extend(b.diags);
            repo.unparsed_services = b.unparsed;
            for f in b.files {
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
        let parsed_policies = if present(&policies) {
            load_file::<PoliciesFile>(&mut reader, &policies, &mut diags).map(Some)
        } else {
            diags.push(file_diag(
                &policies,
                "missing: every config repo needs rlc/policies.yaml (at least a `default` policy)"
                    .into(),
            ));
            Some(None)
        };
        let contracts = rel("rlc/contracts.yaml");
        let parsed_contracts = present(&contracts)
            .then(|| load_file::<ContractsFile>(&mut reader, &contracts, &mut diags))
            .flatten();
        let capacity = rel("rlc/capacity.yaml");
        let parsed_capacity = present(&capacity)
            .then(|| load_file::<CapacityFile>(&mut reader, &capacity, &mut diags))
            .flatten();
        // A policies file that exists but cannot be read leaves the set of services incomplete.
        let policies_read = parsed_policies.is_some();
        let docs = Docs {
            policies: parsed_policies.flatten(),
            contracts: parsed_contracts,
            capacity: parsed_capacity,
        };
        let mut known = repo.bucket_services();
        if let Some(f) = docs.policies.as_ref().and_then(|p| p.located.as_ref()) {
            known.extend(f.value.services.keys().cloned());
        }
        let checked = docs.check(&known, true, (None, None), &mut diags);
        repo.services_complete = checked.services_complete && policies_read;
        repo.policies = checked.policies;
        repo.contracts = checked.contracts;
        repo.capacity = checked.capacity;
        (repo, bound(diags, limits))
    }

    /// Every service the repo knows: bucket files and services named in policies.yaml.
    /// A bucket file that exists but failed to parse still makes its service known.
    pub fn known_services(&self) -> BTreeSet<String> {
        let mut s = self.bucket_services();
        if let Some(p) = &self.policies {
            s.extend(p.value.services.keys().cloned());
        }
        s
    }

    /// The services with a bucket file (parsed or not).
    fn bucket_services(&self) -> BTreeSet<String> {
        let mut s: BTreeSet<String> = self.buckets.keys().cloned().collect();
        s.extend(self.unparsed_services.iter().cloned());
        s
    }

    /// Checks replacement texts of the human-authored documents (`rlc/policies.yaml`,
    /// `rlc/contracts.yaml`, `rlc/capacity.yaml`) against this repo exactly as
    /// [`ConfigRepo::load`] checks the files: parsed within `limits` with unknown keys refused,
    /// the policies checked, and the references across documents checked with the repo's
    /// other documents and bucket files. Reads and writes nothing. A document that is not
    /// replaced is this repo's own (only the problems the replacements cause are reported
    /// about it). Diagnostics about a replacement name the `file` given with its text.
    pub fn check_documents(&self, texts: &DocumentTexts<'_>, limits: &Limits) -> CheckedDocuments {
        let mut diags = Vec::new();
        fn one<T: DeserializeOwned>(
            t: Option<(&Path, &str)>,
            limits: &Limits,
            diags: &mut Vec<Diagnostic>,
        ) -> Option<Parsed<T>> {
            let (file, text) = t?;
            let p = crate::parse_all::<T>(file, text, limits);
            diags.extend(p.problems.iter().cloned());
            Some(p)
        }
        let docs = Docs {
            policies: one::<PoliciesFile>(texts.policies, limits, &mut diags),
            contracts: one::<ContractsFile>(texts.contracts, limits, &mut diags),
            capacity: one::<CapacityFile>(texts.capacity, limits, &mut diags),
        };
        let parse_problems = !diags.is_empty();
        let mut known = self.bucket_services();
        let policies = match &docs.policies {
            Some(p) => p.located.as_ref(),
            None => self.policies.as_ref(),
        };
        if let Some(f) = policies {
            known.extend(f.value.services.keys().cloned());
        }
        let (replaced_contracts, replaced_capacity) =
            (docs.contracts.is_some(), docs.capacity.is_some());
        let complete = match &docs.policies {
            Some(_) => true,
            None => self.services_complete,
        };
        let base = (self.contracts.as_ref(), self.capacity.as_ref());
        let mut checked = docs.check(&known, complete, base, &mut diags);
        if !replaced_contracts {
            checked.contracts = self.contracts.clone();
        }
        if !replaced_capacity {
            checked.capacity = self.capacity.clone();
        }
        CheckedDocuments {
            policies: checked.policies.or_else(|| self.policies.clone()),
            contracts: checked.contracts,
            capacity: checked.capacity,
            services_complete: checked.services_complete,
            parse_problems,
            problems: bound(diags, limits),
        }
    }

    /// The current buckets of `service`, if it has a file.
    pub fn current(&self, service: &str) -> Option<&BucketFile> {
        self.buckets.get(service).map(|l| &l.value)
    }
}

/// The checks across documents: contracts and capacities name known services, contracts stay
/// within the planned capacity, no contract or capacity twice. `complete`: whether `known` is
/// every service (an unknown reference is reported only then).
fn check_references(
    known: &BTreeSet<String>,
    complete: bool,
    contracts: Option<&Located<ContractsFile>>,
    capacity: Option<&Located<CapacityFile>>,
    diags: &mut Vec<Diagnostic>,
) {
    let known = KnownServices {
        names: known,
        complete,
    };
    if let Some(c) = contracts {
        check_contracts(c, capacity, known, diags);
    }
    if let Some(c) = capacity {
        check_capacities(c, known, diags);
        check_events(c, known, diags);
        check_procedure_capacities(c, diags);
    }
}

/// The services references may name.
#[derive(Clone, Copy)]
struct KnownServices<'a> {
    names: &'a BTreeSet<String>,
    /// Whether `names` is every service (an unknown reference is reported only then).
    complete: bool,
}

impl KnownServices<'_> {
    /// Whether `service` is known not to exist.
    fn lacks(&self, service: &str) -> bool {
        self.complete && !self.names.contains(service)
    }
}

/// Contracts name known services, a caller or a procedure, a valid limit within the planned
/// capacity (`capacity`), and no key twice.
fn check_contracts(
    c: &Located<ContractsFile>,
    capacity: Option<&Located<CapacityFile>>,
    known: KnownServices<'_>,
    diags: &mut Vec<Diagnostic>,
) {
    let mut seen: HashMap<(&str, Option<&str>, Option<&str>), usize> = HashMap::new();
    for (i, k) in c.value.contracts.iter().enumerate() {
        let at = |key: &str| format!("contracts[{i}].{key}");
        if known.lacks(&k.service) {
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
        let planned =
            capacity.and_then(|cap| cap.value.for_bucket(&k.service, k.procedure.as_deref()));
        if let Some(rps) = planned {
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

/// Capacities name known services, a valid rate, and no key twice.
fn check_capacities(
    c: &Located<CapacityFile>,
    known: KnownServices<'_>,
    diags: &mut Vec<Diagnostic>,
) {
    let mut seen: HashMap<(&str, Option<&str>), usize> = HashMap::new();
    for (i, e) in c.value.capacity.iter().enumerate() {
        if known.lacks(&e.service) {
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
}

/// Planned events name a known service, a name, a time span, and one of a factor (≥ 1) and
/// an expected rate.
fn check_events(c: &Located<CapacityFile>, known: KnownServices<'_>, diags: &mut Vec<Diagnostic>) {
    for (i, e) in c.value.events.iter().enumerate() {
        let at = |k: &str| format!("events[{i}].{k}");
        if known.lacks(&e.service) {
            diags.push(c.diag(
                at("service"),
                format!("references unknown service `{}`", e.service),
            ));
        }
        if e.name.trim().is_empty() {
            diags.push(c.diag(at("name"), "must not be empty"));
        }
        for (k, v) in [("caller", &e.caller), ("procedure", &e.procedure)] {
            if v.as_deref().is_some_and(|s| s.trim().is_empty()) {
                diags.push(c.diag(at(k), "must not be empty when present"));
            }
        }
        if e.until < e.from {
            diags.push(c.diag(
                at("until"),
                format!("{} is before from {}", e.until, e.from),
            ));
        }
        match (e.factor, e.rps) {
            (Some(_), Some(_)) => diags.push(c.diag(
                format!("events[{i}]"),
                "set one of factor and rps, not both",
            )),
            (None, None) => {
                diags.push(c.diag(format!("events[{i}]"), "needs a factor or an expected rps"))
            }
            (Some(f), None) => {
                if !f.is_finite() || f < 1.0 {
                    diags.push(c.diag(
                        at("factor"),
                        format!("must be a finite number ≥ 1 (events raise quotas; a lower level is learnt from traffic), got {f}"),
                    ));
                }
            }
            (None, Some(r)) => check_rate(c, &at("rps"), r, diags),
        }
    }
}

/// A procedure's capacity above its whole service's capacity cannot both hold.
fn check_procedure_capacities(c: &Located<CapacityFile>, diags: &mut Vec<Diagnostic>) {
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

/// Loads the bucket files of `dir` (a config repo's `buckets/`) the one way `rlc validate`,
/// `rlc` and `grl controller --config-dir` all use: `*.yaml` only (a `.yml` file is reported as
/// ignored), each read within the default [`Limits`] (regular files inside `dir` only, size,
/// nesting, node and bucket limits), parsed with unknown keys refused and checked (the
/// `service` key equals the file name, unique bucket names and matchers, positive finite
/// limits). Returns the files that parsed, sorted by path, and every problem with file, line
/// and key (sorted, no duplicates). Files that parsed are returned even when a check failed
/// (callers that apply the config must refuse on any diagnostic), without key positions (their
/// `locator` is empty: every check that needs one is done).
pub fn load_bucket_dir(dir: &Path) -> (Vec<Located<BucketFile>>, Vec<Diagnostic>) {
    load_bucket_dir_with(dir, &Limits::DEFAULT)
}

/// [`load_bucket_dir`] within `limits`, `dir` being the boundary files must resolve into.
pub fn load_bucket_dir_with(
    dir: &Path,
    limits: &Limits,
) -> (Vec<Located<BucketFile>>, Vec<Diagnostic>) {
    let mut reader = match Reader::confined(dir, *limits) {
        Ok(r) => r,
        Err(d) => return (Vec::new(), vec![d]),
    };
    let b = bucket_dir_with(&mut reader, dir);
    (b.files, bound(b.diags, limits))
}

#[derive(Default)]
struct BucketDir {
    files: Vec<Located<BucketFile>>,
    diags: Vec<Diagnostic>,
    /// Stems of `.yaml` files that could not be read or parsed.
    unparsed: BTreeSet<String>,
}

fn bucket_dir_with(reader: &mut Reader, dir: &Path) -> BucketDir {
    let limits = reader.limits;
    let mut out = BucketDir::default();
    let entries = match dir_entries(reader, dir) {
        Ok(entries) => entries,
        Err(d) => {
            out.diags.push(d);
            return out;
        }
    };
    let mut buckets = 0usize;
    let mut not_read = 0usize;
    for path in entries {
        let Some(stem) = bucket_file_stem(&path, &mut out.diags) else {
            continue;
        };
        if buckets > limits.max_buckets {
            not_read += 1;
            out.unparsed.insert(stem);
            continue;
        }
        let Some(file) = load_checked_bucket_file(reader, &path, &stem, &mut out.diags) else {
            out.unparsed.insert(stem);
            continue;
        };
        buckets += file.value.buckets.len();
        if buckets > limits.max_buckets {
            out.diags.push(file_diag(
                &path,
                format!(
                    "refused: brings the buckets of {} to {buckets}, more than the limit of {}",
                    dir.display(),
                    limits.max_buckets
                ),
            ));
            out.unparsed.insert(stem);
            continue;
        }
        out.files.push(file);
    }
    if not_read > 0 {
        out.diags.push(file_diag(
            dir,
            format!(
                "{not_read} more bucket file(s) not read: the limit of {} buckets was reached",
                limits.max_buckets
            ),
        ));
    }
    // Both callers sort and dedup through `bound`.
    out
}

/// The paths in `dir`, sorted; the problem instead when it is not a readable directory
/// inside the reader's boundary or has more entries than the limit (nothing in it is read).
fn dir_entries(reader: &Reader, dir: &Path) -> Result<Vec<PathBuf>, Diagnostic> {
    let limits = reader.limits;
    let real = reader.resolve(dir)?;
    if !real.is_dir() {
        return Err(file_diag(dir, "refused: not a directory".into()));
    }
    let rd = std::fs::read_dir(dir)
        .map_err(|e| file_diag(dir, format!("cannot read directory: {e}")))?;
    let mut entries: Vec<PathBuf> = Vec::new();
    for e in rd.filter_map(|e| e.ok()) {
        if entries.len() == limits.max_dir_entries {
            return Err(file_diag(
                dir,
                format!(
                    "refused: more than {} entries (the limit per directory); nothing in it was read",
                    limits.max_dir_entries
                ),
            ));
        }
        entries.push(e.path());
    }
    entries.sort();
    Ok(entries)
}

/// The stem of a bucket file (`*.yaml`); `None` for any other file, a `.yml` one reported
/// as ignored.
fn bucket_file_stem(path: &Path, diags: &mut Vec<Diagnostic>) -> Option<String> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("yaml") => {}
        Some("yml") => {
            diags.push(file_diag(
                path,
                "bucket files end in .yaml; this file is ignored by rlc and grl".into(),
            ));
            return None;
        }
        _ => return None,
    }
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    Some(stem.to_string())
}

/// Bucket file `path` read, parsed and checked (its problems into `diags`), without its key
/// positions; `None` when it could not be read or parsed.
fn load_checked_bucket_file(
    reader: &mut Reader,
    path: &Path,
    stem: &str,
    diags: &mut Vec<Diagnostic>,
) -> Option<Located<BucketFile>> {
    let p = load_file::<BucketFile>(reader, path, diags)?;
    let f = p.located.as_ref()?;
    let mut found = Vec::new();
    check_bucket_file(stem, f, &mut found);
    push_checked(&p, found, diags);
    let mut l = p.located?;
    // Checked: the positions are not needed any more (a file's can take tens of MB).
    l.locator = Locator::default();
    Some(l)
}

/// Replacement texts of the human-authored documents of a config repo (None: the repo's own),
/// each with the file name its diagnostics should carry.
#[derive(Debug, Clone, Copy, Default)]
pub struct DocumentTexts<'a> {
    /// `rlc/policies.yaml`.
    pub policies: Option<(&'a Path, &'a str)>,
    /// `rlc/contracts.yaml`.
    pub contracts: Option<(&'a Path, &'a str)>,
    /// `rlc/capacity.yaml`.
    pub capacity: Option<(&'a Path, &'a str)>,
}

/// The documents of [`ConfigRepo::check_documents`]: the replacements where given (with their
/// faulty parts replaced when there are problems), the repo's own otherwise.
#[derive(Debug, Clone)]
pub struct CheckedDocuments {
    /// `rlc/policies.yaml`.
    pub policies: Option<Located<PoliciesFile>>,
    /// `rlc/contracts.yaml`.
    pub contracts: Option<Located<ContractsFile>>,
    /// `rlc/capacity.yaml`.
    pub capacity: Option<Located<CapacityFile>>,
    /// Whether the set of known services is complete (see [`ConfigRepo::services_complete`]).
    pub services_complete: bool,
    /// Whether a replacement failed to parse (YAML syntax, wrong types, unknown keys, limits),
    /// as opposed to parsing and failing a later check.
    pub parse_problems: bool,
    /// Every problem, sorted, bounded like [`ConfigRepo::load`]'s.
    pub problems: Vec<Diagnostic>,
}

/// The human-authored documents as parsed, before the checks that need them together.
struct Docs {
    policies: Option<Parsed<PoliciesFile>>,
    contracts: Option<Parsed<ContractsFile>>,
    capacity: Option<Parsed<CapacityFile>>,
}

/// [`Docs`] checked.
struct CheckedDocs {
    policies: Option<Located<PoliciesFile>>,
    contracts: Option<Located<ContractsFile>>,
    capacity: Option<Located<CapacityFile>>,
    services_complete: bool,
}

impl Docs {
    /// Checks the policies and the references across documents (`base`: the contracts and
    /// capacity to use where these have none), adding every problem that is not a
    /// consequence of a parse problem. `complete`: whether `known` holds every service when
    /// the policies parsed cleanly.
    fn check(
        self,
        known: &BTreeSet<String>,
        complete: bool,
        base: (
            Option<&Located<ContractsFile>>,
            Option<&Located<CapacityFile>>,
        ),
        diags: &mut Vec<Diagnostic>,
    ) -> CheckedDocs {
        let mut complete = complete;
        if let Some(p) = &self.policies {
            complete = p.problems.is_empty();
            if let Some(f) = &p.located {
                let mut found = Vec::new();
                check_policies(f, &mut found);
                push_checked(p, found, diags);
            }
        }
        let contracts = match &self.contracts {
            Some(p) => p.located.as_ref(),
            None => base.0,
        };
        let capacity = match &self.capacity {
            Some(p) => p.located.as_ref(),
            None => base.1,
        };
        let mut found = Vec::new();
        check_references(known, complete, contracts, capacity, &mut found);
        // A replaced (faulty) value in contracts or capacity explains what is said about it.
        fn explains<T>(p: &Option<Parsed<T>>, d: &Diagnostic) -> bool {
            p.as_ref().is_some_and(|p| {
                p.located.as_ref().is_some_and(|l| l.file == d.file) && p.explains(&d.key)
            })
        }
        found.retain(|d| !(explains(&self.contracts, d) || explains(&self.capacity, d)));
        diags.extend(found);
        CheckedDocs {
            policies: self.policies.and_then(|p| p.located),
            contracts: self.contracts.and_then(|p| p.located),
            capacity: self.capacity.and_then(|p| p.located),
            services_complete: complete,
        }
    }
}

/// Validates the config repo at `root`: all problems, sorted by file and line.
pub fn validate_repo(root: &Path) -> Vec<Diagnostic> {
    ConfigRepo::load(root).1
}

/// Sorted, without duplicates, at most `max_problems_per_file` per file (the rest counted in
/// one last line), keys and messages cut to a readable length.
fn bound(mut diags: Vec<Diagnostic>, limits: &Limits) -> Vec<Diagnostic> {
    fn cut(s: &mut String, max: usize) {
        if s.len() > max {
            let mut i = max;
            while !s.is_char_boundary(i) {
                i -= 1;
            }
            s.truncate(i);
            s.push('…');
        }
    }
    diags.sort();
    diags.dedup();
    let mut out: Vec<Diagnostic> = Vec::with_capacity(diags.len());
    let mut i = 0;
    while i < diags.len() {
        let file = diags[i].file.clone();
        let n = diags[i..].iter().take_while(|d| d.file == file).count();
        for d in &diags[i..i + n.min(limits.max_problems_per_file)] {
            let mut d = d.clone();
            cut(&mut d.key, 200);
            cut(&mut d.message, 400);
            out.push(d);
        }
        if n > limits.max_problems_per_file {
            out.push(Diagnostic {
                file: file.clone(),
                line: diags[i + limits.max_problems_per_file - 1].line,
                column: 1,
                key: String::new(),
                message: format!(
                    "{} more problem(s) in this file not listed (at most {} per file)",
                    n - limits.max_problems_per_file,
                    limits.max_problems_per_file
                ),
            });
        }
        i += n;
    }
    out
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
    for pattern in f.value.criticality.caps.keys() {
        if let Err(e) = crate::criticality::check_caller_pattern(pattern) {
            diags.push(f.diag(format!("criticality.caps.{pattern}"), e));
        }
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
    if let Some(Headroom::Fixed(h)) = s.headroom {
        if !h.is_finite() || h < 0.0 {
            diags.push(f.diag(
                key("headroom"),
                format!("must be a finite number ≥ 0 or `auto`, got {h}"),
            ));
        }
    }
    if let Some(t) = s.target_throttled {
        if !(t > 0.0 && t < 1.0) {
            diags.push(f.diag(
                key("target_throttled"),
                format!("must be a share of requests in (0, 1), got {t}"),
            ));
        }
    }
    for (k, v) in [
        ("min_headroom", s.min_headroom),
        ("max_headroom", s.max_headroom),
    ] {
        if v.is_some_and(|v| !v.is_finite() || v < 0.0) {
            diags.push(f.diag(
                key(k),
                format!("must be a finite number ≥ 0, got {}", v.unwrap_or_default()),
            ));
        }
    }
    if let (Some(lo), Some(hi)) = (s.min_headroom, s.max_headroom) {
        if lo > hi {
            diags.push(f.diag(
                key("min_headroom"),
                format!("min_headroom {lo} is above max_headroom {hi}"),
            ));
        }
    }
    if let Some(p) = s.percentile {
        if !(p > 0.0 && p <= 100.0) {
            diags.push(f.diag(key("percentile"), format!("must be in (0, 100], got {p}")));
        }
    }
    if let Some(v) = s.spike_factor {
        if !(v.is_finite() && v > 1.0) {
            diags.push(f.diag(
                key("spike_factor"),
                format!("must be a finite number > 1, got {v}"),
            ));
        }
    }
    if s.sustained_throttling_days == Some(0) {
        diags.push(f.diag(key("sustained_throttling_days"), "must be at least 1"));
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
    if let Some(tz) = &s.timezone {
        if tz.parse::<chrono_tz::Tz>().is_err() {
            diags.push(f.diag(
                key("timezone"),
                format!("unknown time zone `{tz}`: use an IANA name such as UTC or Europe/Berlin"),
            ));
        }
    }
    if s.new_normal_after.is_some_and(|d| d.as_secs() == 0) {
        diags.push(f.diag(key("new_normal_after"), "must be longer than 0"));
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
    for (i, e) in f.value.excluded.iter().enumerate() {
        let key = |k: &str| format!("excluded[{i}].{k}");
        if e.to <= e.from {
            diags.push(f.diag(key("to"), format!("must be after from ({})", e.from)));
        }
        if e.reason.trim().is_empty() {
            diags.push(f.diag(key("reason"), "say why this traffic is not demand"));
        }
    }
    if let Some(p) = &f.value.promotion {
        check_promotion(f, "promotion.default", &p.default, diags);
        for (name, spec) in &p.services {
            check_promotion(f, &format!("promotion.services.{name}"), spec, diags);
        }
    }
    if let Some(r) = &f.value.rollout {
        check_rollout(f, "", &r.default_spec(), diags);
        for (name, spec) in &r.services {
            check_rollout(f, &format!("rollout.services.{name}"), spec, diags);
        }
    }
}

fn check_rollout(
    f: &Located<PoliciesFile>,
    at: &str,
    s: &RolloutSpec,
    diags: &mut Vec<Diagnostic>,
) {
    let key = |k: &str| {
        if at.is_empty() {
            format!("rollout.{k}")
        } else {
            format!("{at}.{k}")
        }
    };
    if let Some(v) = s.max_virtual_drop_share {
        if !(0.0..=1.0).contains(&v) {
            diags.push(f.diag(
                key("max_virtual_drop_share"),
                format!("must be between 0 and 1, got {v}"),
            ));
        }
    }
    if let Some(v) = s.min_offered {
        if !(v.is_finite() && v >= 0.0) {
            diags.push(f.diag(
                key("min_offered"),
                format!("must be a finite number of requests ≥ 0, got {v}"),
            ));
        }
    }
    if let (Some(b), Some(m)) = (s.bake, s.max_bake) {
        if m < b {
            diags.push(f.diag(
                key("max_bake"),
                format!("is shorter than bake ({b}), got {m}"),
            ));
        }
    }
    if let Some(stages) = &s.stages {
        if stages.is_empty() {
            diags.push(f.diag(
                key("stages"),
                "needs at least one stage (default [[\"*\"]])",
            ));
        }
        let mut seen = BTreeSet::new();
        for (i, stage) in stages.iter().enumerate() {
            if stage.is_empty() {
                diags.push(f.diag(
                    format!("{}[{i}]", key("stages")),
                    "a stage names at least one region (or \"*\")",
                ));
            }
            for (j, r) in stage.iter().enumerate() {
                if r.trim().is_empty() {
                    diags.push(f.diag(format!("{}[{i}][{j}]", key("stages")), "empty region name"));
                } else if !seen.insert(r.clone()) {
                    diags.push(f.diag(
                        format!("{}[{i}][{j}]", key("stages")),
                        format!("region `{r}` is in an earlier stage"),
                    ));
                }
            }
        }
    }
}

fn check_promotion(
    f: &Located<PoliciesFile>,
    at: &str,
    s: &PromotionSpec,
    diags: &mut Vec<Diagnostic>,
) {
    let key = |k: &str| format!("{at}.{k}");
    if let Some(d) = s.min_days_in_shadow {
        if !d.is_finite() || d < 0.0 {
            diags.push(f.diag(
                key("min_days_in_shadow"),
                format!("must be a finite number of days ≥ 0, got {d}"),
            ));
        }
    }
    for (k, v) in [
        ("max_virtual_drop_share", s.max_virtual_drop_share),
        ("min_coverage", s.min_coverage),
    ] {
        if let Some(v) = v {
            if !(0.0..=1.0).contains(&v) {
                diags.push(f.diag(key(k), format!("must be between 0 and 1, got {v}")));
            }
        }
    }
    if let Some(d) = s.max_report_age {
        if d.as_secs() == 0 {
            diags.push(f.diag(key("max_report_age"), "must be longer than 0s"));
        }
    }
    if let Some(kinds) = &s.auto_merge {
        let mut seen = BTreeSet::new();
        for (i, k) in kinds.iter().enumerate() {
            if !seen.insert(*k) {
                diags.push(f.diag(
                    format!("{at}.auto_merge[{i}]"),
                    format!("`{}` is listed twice", k.as_str()),
                ));
            }
        }
    }
}

/// Loads `rlc.yaml`, checking what serde cannot. Read like a repo file (a regular file within
/// the size, nesting and node limits) but from anywhere: symbolic links are followed, as
/// deployment tools mount configuration through them.
pub fn load_daemon_config(path: &Path) -> Result<DaemonConfig, Vec<Diagnostic>> {
    let mut reader = Reader::anywhere(Limits::DEFAULT);
    let mut problems = Vec::new();
    let parsed = load_file::<DaemonConfig>(&mut reader, path, &mut problems);
    if !problems.is_empty() {
        return Err(bound(problems, &Limits::DEFAULT));
    }
    let Some(f) = parsed.and_then(|p| p.located) else {
        return Err(vec![file_diag(path, "cannot read file".into())]);
    };
    let mut diags = Vec::new();
    check_history(&f, &mut diags);
    if let Some(p) = &f.value.history.prometheus {
        check_prometheus(&f, p, &mut diags);
    }
    check_store(&f, &mut diags);
    check_rails(&f, &mut diags);
    check_controllers(&f, &mut diags);
    check_schedule_and_database(&f, &mut diags);
    if let Some(forge) = &f.value.config_repo.forge {
        check_forge(&f, forge, &mut diags);
    }
    if diags.is_empty() {
        Ok(f.value)
    } else {
        diags.sort();
        Err(diags)
    }
}

/// rlc.yaml's `history`: one source, a coverage in 0..=1, a step within the lookback.
fn check_history(f: &Located<DaemonConfig>, diags: &mut Vec<Diagnostic>) {
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
}

/// rlc.yaml's `history.prometheus`: an http(s) URL and bounds of at least 1 (2 points).
fn check_prometheus(f: &Located<DaemonConfig>, p: &PrometheusConfig, diags: &mut Vec<Diagnostic>) {
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
    for (k, v) in [
        ("max_response_bytes", p.max_response_bytes),
        ("max_pull_bytes", p.max_pull_bytes),
        ("max_series", p.max_series),
    ] {
        if v == 0 {
            diags.push(f.diag(format!("history.prometheus.{k}"), "must be at least 1"));
        }
    }
}

/// rlc.yaml's `store`: the rollups are kept at least as long as the raw shadow reports.
fn check_store(f: &Located<DaemonConfig>, diags: &mut Vec<Diagnostic>) {
    let st = &f.value.store;
    if st.shadow_rollup_retention.as_secs() < st.shadow_raw_retention.as_secs() {
        diags.push(f.diag(
            "store.shadow_rollup_retention",
            "is shorter than store.shadow_raw_retention",
        ));
    }
}

/// rlc.yaml's `rails`: fractions in 0..=1, a positive finite increase, a floor ≥ 0.
fn check_rails(f: &Located<DaemonConfig>, diags: &mut Vec<Diagnostic>) {
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
    if !(r.max_increase.is_finite() && r.max_increase > 0.0) {
        diags.push(f.diag(
            "rails.max_increase",
            format!("must be a finite number > 0, got {}", r.max_increase),
        ));
    }
    if !(r.floor_rps.is_finite() && r.floor_rps >= 0.0) {
        diags.push(f.diag("rails.floor_rps", "must be a finite number ≥ 0"));
    }
}

/// rlc.yaml's `controller` or `controllers`: not both; each an http(s) URL, TLS only over
/// https with the client certificate and key together, and one controller per region.
fn check_controllers(f: &Located<DaemonConfig>, diags: &mut Vec<Diagnostic>) {
    if f.value.controller.is_some() && !f.value.controllers.is_empty() {
        diags.push(f.diag(
            "controllers",
            "give `controller` or `controllers`, not both",
        ));
    }
    let mut regions = BTreeSet::new();
    let listed = f
        .value
        .controller
        .iter()
        .map(|c| ("controller".to_string(), c))
        .chain(
            f.value
                .controllers
                .iter()
                .enumerate()
                .map(|(i, c)| (format!("controllers[{i}]"), c)),
        );
    for (at, c) in listed {
        if !(c.url.starts_with("http://") || c.url.starts_with("https://")) {
            diags.push(f.diag(format!("{at}.url"), "must start with http:// or https://"));
        }
        if let Some(t) = &c.tls {
            if c.url.starts_with("http://") {
                diags.push(f.diag(
                    format!("{at}.tls"),
                    format!("is set but {at}.url is http://; use https://"),
                ));
            }
            if t.client_cert.is_some() != t.client_key.is_some() {
                diags.push(f.diag(
                    format!("{at}.tls"),
                    "client_cert and client_key go together",
                ));
            }
        }
        match c.region.as_deref() {
            None if at != "controller" => {
                diags.push(f.diag(at.clone(), "needs `region:` (the name rollout.stages uses)"))
            }
            Some(r) if r.trim().is_empty() || r == "*" => diags.push(f.diag(
                format!("{at}.region"),
                format!("`{r}` is not a region name"),
            )),
            _ => {}
        }
        let region = c.region.clone().unwrap_or_else(|| "default".into());
        if !regions.insert(region.clone()) {
            diags.push(f.diag(
                format!("{at}.region"),
                format!("region `{region}` has another controller already"),
            ));
        }
    }
}

/// rlc.yaml's `schedule` (5-field cron) and `database_url` (sqlite or postgres).
fn check_schedule_and_database(f: &Located<DaemonConfig>, diags: &mut Vec<Diagnostic>) {
    if let Some(expr) = &f.value.schedule {
        if let Err(e) = crate::parse_schedule(expr) {
            diags.push(f.diag("schedule", e.to_string()));
        }
    }
    let db = &f.value.database_url;
    if !(db.starts_with("sqlite:")
        || db.starts_with("postgres://")
        || db.starts_with("postgresql://"))
    {
        diags.push(f.diag("database_url", "must be sqlite://… or postgres://…"));
    }
}

/// rlc.yaml's `config_repo.forge`: a known kind with its repo's shape, http(s) URLs, labels
/// and reviewers without separators.
fn check_forge(f: &Located<DaemonConfig>, forge: &ForgeConfig, diags: &mut Vec<Diagnostic>) {
    match forge.kind.as_str() {
        "none" => {}
        "github" => match forge.repo.as_deref() {
            None => diags.push(f.diag(
                "config_repo.forge.repo",
                "github forge needs repo: owner/name",
            )),
            Some(r) if r.split('/').filter(|p| !p.is_empty()).count() != 2 => {
                diags.push(f.diag("config_repo.forge.repo", format!("`{r}` is not owner/name")))
            }
            Some(_) => {}
        },
        "gitlab" => match forge.repo.as_deref() {
            None => diags.push(f.diag(
                "config_repo.forge.repo",
                "gitlab forge needs repo: the project path (group/name)",
            )),
            Some(r) if !r.contains('/') || r.split('/').any(|p| p.is_empty()) => {
                diags.push(f.diag(
                    "config_repo.forge.repo",
                    format!("`{r}` is not a project path group/name"),
                ))
            }
            Some(_) => {}
        },
        k => diags.push(f.diag(
            "config_repo.forge.kind",
            format!("unknown forge `{k}`, expected github, gitlab or none"),
        )),
    }
    for (key, url) in [
        ("config_repo.forge.api_url", &forge.api_url),
        ("config_repo.forge.dashboard_url", &forge.dashboard_url),
        ("config_repo.forge.web_url", &forge.web_url),
    ] {
        if let Some(u) = url {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                diags.push(f.diag(key, "must start with http:// or https://"));
            }
        }
    }
    for (i, l) in forge.labels.iter().enumerate() {
        if l.trim().is_empty() || l.contains(',') {
            diags.push(f.diag(
                format!("config_repo.forge.labels[{i}]"),
                "must be a non-empty label without commas",
            ));
        }
    }
    for (i, r) in forge.reviewers.iter().enumerate() {
        if r.trim().is_empty() || r.contains(char::is_whitespace) {
            diags.push(f.diag(
                format!("config_repo.forge.reviewers[{i}]"),
                "must be a user name (or a GitLab user id) without spaces",
            ));
        }
    }
}
