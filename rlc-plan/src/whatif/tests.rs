use std::sync::atomic::{AtomicUsize, Ordering};

use policies::RateSeries;
use proptest::prelude::*;

use crate::backtest::{score_plan, split};
use crate::history::{SeriesKey, Unreadable};

use super::*;
use crate::pipeline::{self, Purpose, World};
use std::path::Path;

const DAY: i64 = 86_400;
/// 2026-01-01, the history's start; it lasts 21 days.
const START: i64 = 1_767_225_600;

struct Fixture {
    _dir: tempfile::TempDir,
    inputs: Inputs,
    history: History,
    current: Plan,
    now: DateTime<Utc>,
}

fn constant(rps: f32) -> RateSeries {
    RateSeries {
        start: START,
        step: 60,
        values: vec![rps; 21 * 1440],
    }
}

/// `pay` (caller web at 100 rps, limit 100) and `maps` (caller mobile at 40 rps, limit 50),
/// default policy peak with 20 % headroom.
fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let w = |p: &str, t: &str| {
        let p = dir.path().join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, t).unwrap();
    };
    w(
        "buckets/pay.yaml",
        "service: pay\nbuckets:\n  - name: web\n    caller: web\n    limit_rps: 100\n    mode: enforce\n    policy: peak\n",
    );
    w(
        "buckets/maps.yaml",
        "service: maps\nbuckets:\n  - name: mobile\n    caller: mobile\n    limit_rps: 50\n    mode: enforce\n    policy: peak\n",
    );
    w(
        "rlc/policies.yaml",
        "default:\n  policy: peak\n  headroom: 0.2\nservices:\n  pay: {}\n",
    );
    let (repo, diags) = ConfigRepo::load(dir.path());
    assert!(diags.is_empty(), "{}", schema::Diagnostics(diags));
    let cfg: DaemonConfig =
        serde_yaml::from_str("history:\n  file: x.csv\nconfig_repo:\n  path: repo\n").unwrap();
    let key = |s: &str, c: &str| SeriesKey {
        service: s.into(),
        caller: Some(c.into()),
        procedure: None,
    };
    let history = History {
        start: START,
        step: 60,
        len: 21 * 1440,
        series: [
            (key("pay", "web"), constant(100.0)),
            (key("maps", "mobile"), constant(40.0)),
        ]
        .into_iter()
        .collect(),
        rejected: vec![],
        source_error: None,
    };
    let now = Utc.timestamp_opt(START + 21 * DAY, 0).unwrap();
    let world = World::none();
    let current = pipeline::plan(&cfg, &repo, &history, &world, now, Purpose::Run);
    Fixture {
        _dir: dir,
        inputs: Inputs { cfg, repo, world },
        history,
        current,
        now,
    }
}

/// The HTTP status `rlc serve` answers a refusal with.
trait HttpStatus {
    fn status(&self) -> u16;
}

impl HttpStatus for WhatIfError {
    fn status(&self) -> u16 {
        match self.refusal {
            Refusal::TooLarge => 413,
            Refusal::MediaType => 415,
            Refusal::Unreadable => 400,
            Refusal::Invalid => 422,
        }
    }
}

impl Fixture {
    fn run(&self, body: &str, ct: Option<&str>) -> Result<PreviewAnswer, WhatIfError> {
        preview(
            &self.inputs,
            &self.history,
            &self.current,
            body.as_bytes(),
            ct,
            self.now,
        )
    }
}

const JSON: Option<&str> = Some("application/json");
const YAML: Option<&str> = Some("application/yaml");

fn limit(plan: &Plan, service: &str, bucket: &str) -> f64 {
    plan.buckets
        .iter()
        .find(|b| b.service == service && b.bucket.name == bucket)
        .unwrap_or_else(|| panic!("no {service}/{bucket} in {plan:?}"))
        .bucket
        .limit_rps
}

fn problems(p: &WhatIfError) -> Vec<(String, usize, String)> {
    p.problems
        .iter()
        .map(|q| (q.file.clone(), q.line, q.key.clone()))
        .collect()
}

#[test]
fn an_empty_body_previews_the_current_inputs() {
    let f = fixture();
    for ct in [None, JSON, YAML] {
        let a = f.run("", ct).unwrap();
        assert_eq!(a.plan, f.current);
        assert_eq!(a.diff.buckets, vec![]);
        assert_eq!(a.diff.unchanged, 2);
        assert_eq!(limit(&a.plan, "pay", "web"), 120.0);
        // Fitted on the first 14 days, scored on the last 7: same numbers for both.
        assert_eq!(a.backtest.holdout_secs, 7 * DAY);
        let b = &a.backtest.buckets[1];
        assert_eq!((b.service.as_str(), b.bucket.as_str()), ("pay", "web"));
        assert_eq!(b.current, b.what_if);
        let s = b.current.unwrap();
        assert_eq!((s.limit_rps, s.holdout_peak_rps), (120.0, 100.0));
        assert!(
            (s.slack - 1.2).abs() < 1e-9 && s.throttled_fraction == 0.0,
            "{s:?}"
        );
    }
}

#[test]
fn a_patch_raising_the_headroom_raises_limits_and_slack() {
    let f = fixture();
    let a = f
        .run(
            r#"{"policies": {"patch": {"services": {"pay": {"headroom": 0.5}}}}}"#,
            JSON,
        )
        .unwrap();
    assert_eq!(limit(&a.plan, "pay", "web"), 150.0);
    assert_eq!(
        limit(&a.plan, "maps", "mobile"),
        50.0,
        "maps: 48 is within 10 % of 50"
    );
    assert_eq!(a.diff.unchanged, 1);
    let [c] = &a.diff.buckets[..] else {
        panic!("{:?}", a.diff)
    };
    assert_eq!(c.kind, ChangeKind::Raised);
    let json = serde_json::to_value(c).unwrap();
    assert_eq!(
        json["change"], "changed",
        "the diff's word as it has always been"
    );
    assert_eq!(json["kind"], "raised");
    assert_eq!(c.current.as_ref().unwrap().limit_rps, 120.0);
    assert_eq!(c.what_if.as_ref().unwrap().limit_rps, 150.0);
    assert!((c.limit_factor.unwrap() - 1.25).abs() < 1e-9);
    let b = a
        .backtest
        .buckets
        .iter()
        .find(|b| b.service == "pay")
        .unwrap();
    let (cur, new) = (b.current.unwrap(), b.what_if.unwrap());
    assert!((cur.slack - 1.2).abs() < 1e-9 && (new.slack - 1.5).abs() < 1e-9);
}

#[test]
fn a_lower_headroom_shows_its_cost_in_the_backtest() {
    let f = fixture();
    // Traffic steps up 30 % in the last week: 20 % headroom throttles, 50 % does not.
    let mut f = f;
    for v in f.history.series.values_mut() {
        for x in &mut v.values[14 * 1440..] {
            *x *= 1.3;
        }
    }
    let a = f
        .run(
            "policies:\n  patch:\n    default:\n      headroom: 0.5\n",
            YAML,
        )
        .unwrap();
    let b = a
        .backtest
        .buckets
        .iter()
        .find(|b| b.service == "pay")
        .unwrap();
    let (cur, new) = (b.current.unwrap(), b.what_if.unwrap());
    // 120 against 130 rps: 10/130 of the requests over the limit.
    assert!(
        (cur.throttled_fraction - 10.0 / 130.0).abs() < 1e-6,
        "{cur:?}"
    );
    assert_eq!(new.throttled_fraction, 0.0, "150 rps holds 130: {new:?}");
}

#[test]
fn a_contract_gives_its_bucket_the_contract_limit() {
    let f = fixture();
    let body = "contracts:\n  replace:\n    contracts:\n      - service: pay\n        caller: web\n        limit_rps: 333\n        reference: MSA-1\n";
    let a = f.run(body, YAML).unwrap();
    let b = a.plan.buckets.iter().find(|b| b.service == "pay").unwrap();
    assert_eq!(b.bucket.limit_rps, 333.0);
    assert_eq!(b.bucket.policy, schema::PolicyName::Fixed);
    let c = &a.diff.buckets[0];
    assert_eq!(c.what_if.as_ref().unwrap().policy, "fixed");
    assert!((c.limit_factor.unwrap() - 333.0 / 120.0).abs() < 1e-9);
}

#[test]
fn services_restrict_what_is_computed() {
    let f = fixture();
    let a = preview(
        &f.inputs,
        &f.history,
        &f.current,
        br#"{"services": ["maps"], "policies": {"patch": {"default": {"headroom": 1}}}}"#,
        JSON,
        f.now,
    )
    .unwrap();
    // What is computed is restricted before computing: the repo and history handed to the
    // plan hold maps only.
    let only: BTreeSet<String> = ["maps".to_string()].into();
    let repo = restrict_repo(&f.inputs.repo, f.inputs.repo.clone(), Some(&only));
    assert_eq!(repo.buckets.keys().collect::<Vec<_>>(), ["maps"]);
    assert_eq!(View::new(&f.history, Some(&only)).services(), ["maps"]);
    assert_eq!(a.services, Some(vec!["maps".to_string()]));
    assert_eq!(a.plan.buckets.len(), 1);
    assert_eq!(limit(&a.plan, "maps", "mobile"), 80.0);
    assert_eq!(a.diff.buckets.len(), 1, "pay is not in the diff");
    assert_eq!(a.diff.unchanged, 0);
    assert!(a.backtest.buckets.iter().all(|b| b.service == "maps"));
}

#[test]
fn unknown_services_are_named() {
    let f = fixture();
    let e = f
        .run("services:\n  - pay\n  - nope\n  - gone\n", YAML)
        .unwrap_err();
    assert_eq!(e.status(), 422);
    assert_eq!(
        problems(&e),
        [
            ("body".into(), 3, "services[1]".into()),
            ("body".into(), 4, "services[2]".into())
        ]
    );
    assert!(e.problems[0].message.contains("`nope`"), "{:?}", e.problems);
}

#[test]
fn syntax_shape_and_type_problems_are_400_with_every_problem() {
    let f = fixture();
    // YAML: an unknown top-level key, an unknown key and a wrong type in the document.
    let body = "policies:\n  replace:\n    default:\n      policy: peak\n      headroom: lots\n      colour: red\nextra: 1\n";
    let e = f.run(body, YAML).unwrap_err();
    assert_eq!(e.status(), 400, "{e:?}");
    let mut got = problems(&e);
    got.sort();
    assert_eq!(
        got,
        [
            ("body".into(), 5, "policies.replace.default.headroom".into()),
            ("body".into(), 6, "policies.replace.default.colour".into()),
            ("body".into(), 7, "extra".into()),
        ],
        "{e:?}"
    );
    // JSON syntax: line and column of the error.
    let e = f.run("{\n  \"policies\": {,}\n}", JSON).unwrap_err();
    assert_eq!((e.status(), e.problems[0].line), (400, 2), "{e:?}");
    // Both replace and patch.
    let e = f
        .run(r#"{"capacity": {"replace": {}, "patch": {}}}"#, JSON)
        .unwrap_err();
    assert_eq!(problems(&e), [("body".into(), 1, "capacity".into())]);
    // Not UTF-8.
    let e = preview(&f.inputs, &f.history, &f.current, b"\xff\xfe", YAML, f.now).unwrap_err();
    assert_eq!(e.status(), 400);
}

#[test]
fn validation_problems_are_422_with_file_line_and_key() {
    let f = fixture();
    // The patch sets a negative headroom (the body's line); dropping `pay` from the services
    // makes nothing else wrong. A contract above the capacity: both in the body.
    let body = "policies:\n  patch:\n    default:\n      headroom: -1\ncontracts:\n  replace:\n    contracts:\n      - service: pay\n        caller: web\n        limit_rps: 500\ncapacity:\n  replace:\n    capacity:\n      - service: pay\n        rps: 300\n";
    let e = f.run(body, YAML).unwrap_err();
    assert_eq!(e.status(), 422, "{e:?}");
    let mut got = problems(&e);
    got.sort();
    assert_eq!(
        got,
        [
            ("body".into(), 4, "policies.patch.default.headroom".into()),
            (
                "body".into(),
                10,
                "contracts.replace.contracts[0].limit_rps".into()
            ),
        ],
        "{e:?}"
    );
}

#[test]
fn a_problem_in_an_untouched_document_names_its_repo_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut f = fixture();
    // A repo whose contract names `pay` only through policies.yaml's services.
    for (p, t) in [
        (
            "rlc/policies.yaml",
            "default:\n  policy: peak\nservices:\n  ghost: {}\n",
        ),
        (
            "rlc/contracts.yaml",
            "contracts:\n  - service: ghost\n    caller: web\n    limit_rps: 5\n",
        ),
    ] {
        let p = dir.path().join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, t).unwrap();
    }
    let (repo, diags) = ConfigRepo::load(dir.path());
    assert!(diags.is_empty(), "{diags:?}");
    f.inputs.repo = repo;
    let e = f
        .run(
            r#"{"policies": {"patch": {"services": {"ghost": null}}}}"#,
            JSON,
        )
        .unwrap_err();
    assert_eq!(e.status(), 422, "{e:?}");
    assert_eq!(
        problems(&e),
        [(
            "rlc/contracts.yaml".into(),
            2,
            "contracts[0].service".into()
        )]
    );
}

#[test]
fn media_type_and_size() {
    let f = fixture();
    assert_eq!(f.run("{}", Some("text/plain")).unwrap_err().status(), 415);
    assert_eq!(f.run("{}", None).unwrap_err().status(), 415);
    assert!(f.run("{}", Some("application/json; charset=utf-8")).is_ok());
    assert!(f.run("{}", Some("text/yaml")).is_ok());
    assert!(f.run("{}", Some("application/x-yaml")).is_ok());
    let big = format!("services: [{}]", "pay, ".repeat(MAX_BODY_BYTES / 4));
    assert_eq!(f.run(&big, YAML).unwrap_err().status(), 413);
}

#[test]
fn nesting_and_alias_bombs_are_refused() {
    let f = fixture();
    let deep = format!("{}{}", "[".repeat(100), "]".repeat(100));
    let e = f
        .run(&format!("{{\"policies\": {{\"patch\": {deep}}}}}"), JSON)
        .unwrap_err();
    assert_eq!(e.status(), 400, "{e:?}");
    assert!(e.problems[0].message.contains("nesting"), "{e:?}");
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..8 {
        bomb.push_str(&format!(
            "{}: &{} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n",
            (b'a' + i) as char,
            (b'a' + i) as char,
            p = (b'a' + i - 1) as char
        ));
    }
    let e = f.run(&bomb, YAML).unwrap_err();
    assert_eq!(e.status(), 400, "{e:?}");
}

#[test]
fn holdout_is_bounded_by_the_history() {
    let f = fixture();
    let a = f.run("holdout: 3d\n", YAML).unwrap();
    assert_eq!(a.backtest.holdout_secs, 3 * DAY);
    let a = f.run("holdout: 100w\n", YAML).unwrap();
    assert_eq!(
        a.backtest.holdout_secs,
        21 * DAY / 2,
        "at most half the history"
    );
    // A duration that overflows is a problem of the body, not a panic.
    let e = f.run("holdout: 18446744073709551615w\n", YAML).unwrap_err();
    assert_eq!(
        (e.status(), e.problems[0].key.as_str()),
        (400, "holdout"),
        "{e:?}"
    );
}

#[test]
fn merge_patch_follows_rfc_7396() {
    // Examples of RFC 7396, appendix A.
    for (target, patch, result) in [
        ("{a: b}", "{a: c}", "{a: c}"),
        ("{a: b}", "{b: c}", "{a: b, b: c}"),
        ("{a: b}", "{a: null}", "{}"),
        ("{a: b, b: c}", "{a: null}", "{b: c}"),
        ("{a: [b]}", "{a: c}", "{a: c}"),
        ("{a: c}", "{a: [b]}", "{a: [b]}"),
        ("{a: {b: c}}", "{a: {b: d, c: null}}", "{a: {b: d}}"),
        ("{a: [{b: c}]}", "{a: [1]}", "{a: [1]}"),
        ("[a, b]", "[c, d]", "[c, d]"),
        ("{a: b}", "[c]", "[c]"),
        ("{a: foo}", "null", "null"),
        ("{a: foo}", "bar", "bar"),
        ("{e: null}", "{a: 1}", "{e: null, a: 1}"),
        ("[1, 2]", "{a: b, c: null}", "{a: b}"),
        ("{}", "{a: {bb: {ccc: null}}}", "{a: {bb: {}}}"),
    ] {
        let y = |s: &str| serde_yaml::from_str::<Value>(s).unwrap();
        let mut t = y(target);
        merge_patch(&mut t, &y(patch));
        assert_eq!(t, y(result), "{target} + {patch}");
    }
}

#[test]
fn patch_sets_finds_keys_and_replaced_ancestors() {
    let p: Value =
        serde_yaml::from_str("default: {headroom: 1}\ncontracts: [x]\ngone: null").unwrap();
    assert!(patch_sets(&p, "default.headroom"));
    assert!(!patch_sets(&p, "default.policy"));
    assert!(patch_sets(&p, "contracts[3].service"));
    assert!(patch_sets(&p, "gone"));
    assert!(!patch_sets(&p, "services.pay"));
    assert!(patch_sets(&p, ""));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random bytes, in either format: an answer or a 4xx, never a panic or a 5xx.
    #[test]
    fn random_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..300), json in any::<bool>()) {
        let f = FIXTURE.with(|f| f.clone());
        let r = f.run_bytes(&body, if json { JSON } else { YAML });
        if let Err(p) = r {
            prop_assert!((400..500).contains(&p.status()), "{p:?}");
        }
    }

    /// Random YAML built from the body's own vocabulary, so that it gets past the parser.
    #[test]
    fn random_what_ifs_never_panic(body in what_if_text()) {
        let f = FIXTURE.with(|f| f.clone());
        if let Err(p) = f.run_bytes(body.as_bytes(), YAML) {
            prop_assert!((400..500).contains(&p.status()), "{body}\n{p:?}");
        }
    }
}

thread_local! {
    static FIXTURE: std::rc::Rc<Fixture> = std::rc::Rc::new(fixture());
}

impl Fixture {
    fn run_bytes(&self, body: &[u8], ct: Option<&str>) -> Result<PreviewAnswer, WhatIfError> {
        preview(
            &self.inputs,
            &self.history,
            &self.current,
            body,
            ct,
            self.now,
        )
    }
}

fn what_if_text() -> impl Strategy<Value = String> {
    let word = prop::sample::select(vec![
        "services",
        "policies",
        "contracts",
        "capacity",
        "replace",
        "patch",
        "default",
        "policy",
        "peak",
        "forecast",
        "fixed",
        "headroom",
        "pay",
        "maps",
        "web",
        "service",
        "caller",
        "limit_rps",
        "rps",
        "procedure",
        "expires",
        "holdout",
        "7d",
        "-1",
        "0",
        "1e308",
        ".inf",
        "null",
        "[]",
        "{}",
        "x",
        "mode",
        "shadow",
        "scope",
        "zone",
        "floor_rps",
        "ceiling_rps",
        "plugin:x",
    ]);
    let line = (
        0usize..4,
        word.clone(),
        prop::option::of(word),
        any::<bool>(),
    )
        .prop_map(|(indent, k, v, dash)| {
            format!(
                "{}{}{}:{}",
                "  ".repeat(indent),
                if dash { "- " } else { "" },
                k,
                v.map(|v| format!(" {v}")).unwrap_or_default()
            )
        });
    proptest::collection::vec(line, 0..16).prop_map(|l| l.join("\n"))
}

#[test]
fn request_and_answer_have_json_schemas() {
    let req = serde_json::to_value(schemars::schema_for!(Request)).unwrap();
    let props = &req["properties"];
    for k in ["services", "policies", "contracts", "capacity", "holdout"] {
        assert!(props.get(k).is_some(), "{k} in {req}");
    }
    let ans = serde_json::to_value(schemars::schema_for!(PreviewAnswer)).unwrap();
    for k in ["services", "plan", "diff", "backtest"] {
        assert!(ans["properties"].get(k).is_some(), "{k} in {ans}");
    }
}

/// A history kept elsewhere, as the daemon's ring on disk: never whole, read one service at a
/// time (each read a copy of that service's series), a service optionally unreadable.
struct PerService {
    history: History,
    unreadable: Option<&'static str>,
    reads: AtomicUsize,
}

impl PerService {
    fn new(history: History, unreadable: Option<&'static str>) -> PerService {
        PerService {
            history,
            unreadable,
            reads: AtomicUsize::new(0),
        }
    }
}

impl SeriesSource for PerService {
    fn services(&self) -> Vec<String> {
        self.history.services()
    }
    fn rejected(&self) -> &[Rejected] {
        &self.history.rejected
    }
    fn source_error(&self) -> Option<&str> {
        self.history.source_error.as_deref()
    }
    fn service(&self, service: &str) -> Result<Cow<'_, History>, Unreadable> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        if self.unreadable == Some(service) {
            return Err(Unreadable(format!("cannot read {service}")));
        }
        let h = &self.history;
        Ok(Cow::Owned(History {
            series: h
                .service_series(service)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            rejected: Vec::new(),
            source_error: None,
            ..*h
        }))
    }
}

/// The config repo of [`fleet`] with `policies` as `rlc/policies.yaml`.
fn fleet_repo(dir: &Path, policies: &str) -> ConfigRepo {
    let w = |p: &str, t: &str| {
        let p = dir.join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, t).unwrap();
    };
    // s00–s07 have buckets in force (s05 none for mobile: it is added), s08–s11 none.
    for i in 0..8 {
        let mut t = format!("service: s{i:02}\nbuckets:\n  - name: web\n    caller: web\n    limit_rps: {}\n    mode: enforce\n    policy: peak\n", 50 + 10 * i);
        if i != 5 {
            t.push_str("  - name: mobile\n    caller: mobile\n    limit_rps: 20\n    mode: shadow\n    policy: peak\n");
        }
        w(&format!("buckets/s{i:02}.yaml"), &t);
    }
    w("rlc/policies.yaml", policies);
    w(
        "rlc/contracts.yaml",
        "contracts:\n  - service: s07\n    caller: web\n    limit_rps: 90\n    reference: MSA-7\n",
    );
    let (repo, diags) = ConfigRepo::load(dir);
    assert!(diags.is_empty(), "{}", schema::Diagnostics(diags));
    repo
}

const FLEET_POLICIES: &str =
    "default:\n  policy: peak\n  headroom: 0.2\nservices:\n  s02:\n    policy: forecast\n";
/// A what-if of [`FLEET_POLICIES`]: other headroom, another policy for s03.
const FLEET_WHAT_IF: &str = "default:\n  policy: peak\n  headroom: 0.35\nservices:\n  s02:\n    policy: forecast\n  s03:\n    policy: forecast\n    headroom: 0.1\n";

/// Twelve services with daily cycles, growth, gaps, a procedure series, a service whose
/// series were merged (ambiguous) and a rejected series, over 21 days at 1 m.
fn fleet() -> (Fixture, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let repo = fleet_repo(dir.path(), FLEET_POLICIES);
    let cfg: DaemonConfig =
        serde_yaml::from_str("history:\n  file: x.csv\nconfig_repo:\n  path: repo\n").unwrap();
    let len = 21 * 1440;
    let mut series = BTreeMap::new();
    for i in 0..12usize {
        for (j, caller) in ["web", "mobile"].into_iter().enumerate() {
            let base = 10.0 + 7.0 * i as f32 + 13.0 * j as f32;
            let values = (0..len)
                .map(|t| {
                    if (i + j) % 4 == 1 && t % 97 < 5 {
                        return f32::NAN; // gaps
                    }
                    let day = (t % 1440) as f32 / 1440.0 * std::f32::consts::TAU;
                    let growth = if i % 3 == 0 {
                        t as f32 / len as f32
                    } else {
                        0.0
                    };
                    base * (1.0 + 0.4 * day.sin() + growth) + ((t * 31 + i * 7) % 11) as f32
                })
                .collect();
            let key = SeriesKey {
                service: format!("s{i:02}"),
                caller: Some(caller.into()),
                procedure: (i == 4 && j == 1).then(|| "charge".to_string()),
            };
            series.insert(
                key,
                RateSeries {
                    start: START,
                    step: 60,
                    values,
                },
            );
        }
    }
    let history = History {
        start: START,
        step: 60,
        len,
        series,
        rejected: vec![
            Rejected {
                service: Some("s09".into()),
                caller: Some("web".into()),
                procedure: None,
                reason: "merged series".into(),
                fails_service: true,
            },
            Rejected {
                service: Some("s10".into()),
                caller: None,
                procedure: None,
                reason: "no caller or procedure".into(),
                fails_service: false,
            },
        ],
        source_error: None,
    };
    let now = Utc.timestamp_opt(START + 21 * DAY, 0).unwrap();
    let world = World::none();
    let current = pipeline::plan(&cfg, &repo, &history, &world, now, Purpose::Run);
    let f = Fixture {
        _dir: dir,
        inputs: Inputs { cfg, repo, world },
        history,
        current,
        now,
    };
    (f, tempfile::tempdir().unwrap())
}

/// The preview's plan, diff and backtest computed as they were before the history was read
/// service by service: the whole history (of the services in `only`) copied into memory,
/// split in two whole histories, scored on the whole.
fn the_old_way(
    f: &Fixture,
    source: &dyn SeriesSource,
    whatif_repo: &ConfigRepo,
    holdout_asked: i64,
) -> serde_json::Value {
    // What `restrict_history` did for every service.
    let mut h = History {
        source_error: source.source_error().map(str::to_string),
        rejected: source.rejected().to_vec(),
        ..History::default()
    };
    for s in source.services() {
        match source.service(&s) {
            Ok(one) => {
                (h.start, h.step, h.len) = (one.start, one.step, one.len);
                h.series
                    .extend(one.service_series(&s).map(|(k, v)| (k.clone(), v.clone())));
            }
            Err(e) => {
                h.source_error.get_or_insert(e.to_string());
            }
        }
    }
    let cfg = &f.inputs.cfg;
    let plan = pipeline::plan(cfg, whatif_repo, &h, &f.inputs.world, f.now, Purpose::Run);
    let diff = diff(&f.current, &plan);
    let span = h.len as i64 * h.step;
    let holdout = holdout_asked.min(span / 2).max(0);
    let mut backtest = Backtest {
        holdout_secs: holdout,
        ..Backtest::default()
    };
    if let Some(e) = &h.source_error {
        backtest.note = Some(format!("no backtest: the history source failed ({e})"));
    } else {
        let (train, at) = split(&h, holdout);
        let when = Utc.timestamp_opt(at, 0).single().unwrap();
        let none = World::none();
        let mut by: BTreeMap<(String, String), (Option<Score>, Option<Score>)> = BTreeMap::new();
        for (i, repo) in [&f.inputs.repo, whatif_repo].into_iter().enumerate() {
            let p = pipeline::plan(cfg, repo, &train, &none, when, Purpose::Backtest);
            for (s, b, sc) in score_plan(&h, &p, at) {
                let e = by.entry((s, b)).or_default();
                *(if i == 0 { &mut e.0 } else { &mut e.1 }) = Some(sc);
            }
        }
        backtest.split = Some(when);
        backtest.buckets = by
            .into_iter()
            .map(|((service, bucket), (current, what_if))| BucketBacktest {
                service,
                bucket,
                current,
                what_if,
            })
            .collect();
    }
    serde_json::json!({"plan": plan, "diff": diff, "backtest": backtest})
}

fn answer_json(a: &PreviewAnswer) -> serde_json::Value {
    serde_json::json!({"plan": a.plan, "diff": a.diff, "backtest": a.backtest})
}

fn preview_on(f: &Fixture, source: &dyn SeriesSource, body: &str) -> PreviewAnswer {
    preview(&f.inputs, source, &f.current, body.as_bytes(), YAML, f.now).unwrap()
}

#[test]
fn a_whole_fleet_preview_read_service_by_service_answers_as_the_whole_history_did() {
    let (f, other) = fleet();
    let whatif_repo = fleet_repo(other.path(), FLEET_WHAT_IF);
    let what_if_body = {
        let v: Value = serde_yaml::from_str(FLEET_WHAT_IF).unwrap();
        serde_yaml::to_string(&serde_yaml::Mapping::from_iter([(
            "policies".into(),
            Value::Mapping(serde_yaml::Mapping::from_iter([("replace".into(), v)])),
        )]))
        .unwrap()
    };
    let on_disk = PerService::new(f.history.clone(), None);
    for (body, repo, holdout) in [
        ("", &f.inputs.repo, 7 * DAY),
        (what_if_body.as_str(), &whatif_repo, 7 * DAY),
        (
            &format!("{what_if_body}holdout: 3d\n"),
            &whatif_repo,
            3 * DAY,
        ),
    ] {
        let old = the_old_way(&f, &on_disk, repo, holdout);
        let read = on_disk.reads.load(Ordering::Relaxed);
        let streamed = preview_on(&f, &on_disk, body);
        let in_memory = preview_on(&f, &f.history, body);
        assert_eq!(answer_json(&streamed), old, "body {body:?}");
        assert_eq!(answer_json(&in_memory), old, "body {body:?}");
        assert_eq!(streamed.services, None);
        // Each service is read for the plan, the two training plans and the scores: never
        // the whole history at once (the source cannot give it).
        let reads = on_disk.reads.load(Ordering::Relaxed) - read;
        assert!(
            (12..=4 * 12).contains(&reads),
            "{reads} reads of 12 services"
        );
        // The answer is a real one: buckets changed, scored on both sides.
        assert!(
            old["backtest"]["buckets"].as_array().unwrap().len() >= 20,
            "{old}"
        );
        if !body.is_empty() {
            assert!(!streamed.diff.buckets.is_empty());
        }
    }
    // Services given: the same from both sources.
    let body = format!("{what_if_body}services: [s03, s05, s09]\n");
    assert_eq!(
        serde_json::to_value(preview_on(&f, &on_disk, &body)).unwrap(),
        serde_json::to_value(preview_on(&f, &f.history, &body)).unwrap()
    );
}

#[test]
fn a_service_that_cannot_be_read_fails_the_whole_preview_as_before() {
    let (f, _) = fleet();
    let broken = PerService::new(f.history.clone(), Some("s04"));
    let old = the_old_way(&f, &broken, &f.inputs.repo, 7 * DAY);
    let a = preview_on(&f, &broken, "");
    assert_eq!(answer_json(&a)["backtest"], old["backtest"]);
    assert_eq!(answer_json(&a), old);
    assert_eq!(
        a.backtest.note.as_deref(),
        Some("no backtest: the history source failed (cannot read s04)")
    );
    assert_eq!(a.plan.history_error.as_deref(), Some("cannot read s04"));
    assert!(a.plan.history_failed.contains(&"s00".to_string()));
}
