use std::path::Path;

use super::*;

fn parse_err<T: serde::de::DeserializeOwned + std::fmt::Debug>(text: &str) -> Diagnostic {
    parse_str::<T>(Path::new("f.yaml"), text).expect_err("should fail")
}

#[test]
fn unknown_key_names_key_and_line() {
    let d = parse_err::<BucketFile>(
        "service: a\nbuckets:\n  - name: x\n    caller: b\n    limit_rps: 5\n    colour: red\n",
    );
    assert_eq!(d.line, 6, "{d}");
    assert!(d.key.ends_with("colour"), "{d}");
    assert!(d.message.contains("unknown field"), "{d}");
}

#[test]
fn wrong_enum_names_key() {
    let d = parse_err::<BucketFile>(
        "service: a\nbuckets:\n  - name: x\n    caller: b\n    limit_rps: 5\n    scope: planet\n",
    );
    assert_eq!(d.line, 6, "{d}");
    assert_eq!(d.key, "buckets[0].scope", "{d}");
}

#[test]
fn policy_names_parse() {
    for (s, ok) in [
        ("peak", true),
        ("forecast", true),
        ("fixed", true),
        ("plugin:my-p", true),
        ("plugin:", false),
        ("peek", false),
        ("plugin:a b", false),
    ] {
        assert_eq!(s.parse::<PolicyName>().is_ok(), ok, "{s}");
    }
    assert_eq!(
        "plugin:x".parse::<PolicyName>().unwrap().to_string(),
        "plugin:x"
    );
}

#[test]
fn durations_parse_and_print() {
    for (s, secs) in [
        ("30s", 30),
        ("1m", 60),
        ("28d", 28 * 86400),
        ("14d", 14 * 86400),
    ] {
        let d: HumanDuration = s.parse().unwrap();
        assert_eq!(d.as_secs(), secs);
        assert_eq!(d.to_string(), s);
    }
    assert_eq!("2w".parse::<HumanDuration>().unwrap().as_secs(), 14 * 86400);
    assert!("0d".parse::<HumanDuration>().is_err());
    assert!("5y".parse::<HumanDuration>().is_err());
    assert!("d".parse::<HumanDuration>().is_err());
}

#[test]
fn render_is_deterministic_and_round_trips() {
    let f = BucketFile {
        criticality: Default::default(),
        service: "payments".into(),
        buckets: vec![
            Bucket {
                name: "z.last".into(),
                caller: Some("z".into()),
                procedure: None,
                scope: Scope::Zone,
                limit_rps: 10.5,
                mode: Mode::Shadow,
                policy: PolicyName::Plugin("p".into()),
            },
            Bucket {
                name: "api-gateway.charge".into(),
                caller: Some("api-gateway".into()),
                procedure: Some("charge".into()),
                scope: Scope::Global,
                limit_rps: 1250.0,
                mode: Mode::Enforce,
                policy: PolicyName::Peak,
            },
        ],
    };
    let a = render_bucket_file(&f);
    let mut g = f.clone();
    g.buckets.reverse();
    assert_eq!(a, render_bucket_file(&g), "order must not matter");
    assert!(a.contains("limit_rps: 1250\n"), "{a}");
    assert!(a.contains("limit_rps: 10.5\n"), "{a}");
    let back: BucketFile = serde_yaml::from_str(&a).unwrap();
    assert_eq!(back.buckets.len(), 2);
    assert_eq!(back.buckets[0].name, "api-gateway.charge");
    assert_eq!(back.buckets[1].policy, PolicyName::Plugin("p".into()));
}

/// A bucket file's criticality caps: rendered (keys quoted where YAML needs it), read back,
/// tiers case-insensitive; a bad pattern or tier is an error naming the file, line and key.
#[test]
fn criticality_caps_round_trip_and_bad_ones_are_named() {
    use crate::Criticality;
    let mut f = BucketFile::new("pay", Vec::new());
    f.criticality.caps = [
        ("*".to_string(), Criticality::Critical),
        ("batch-*".to_string(), Criticality::Sheddable),
        ("cron".to_string(), Criticality::SheddablePlus),
    ]
    .into();
    let text = render_bucket_file(&f);
    assert!(
        text.contains("criticality:  # written by hand: rlc keeps it as it is\n  caps:\n    \"*\": CRITICAL\n    \"batch-*\": SHEDDABLE\n    cron: SHEDDABLE_PLUS\n"),
        "{text}"
    );
    let back: BucketFile = serde_yaml::from_str(&text).unwrap();
    assert_eq!(back, f);
    // Without caps the section is left out, as files rendered before it existed.
    assert!(!render_bucket_file(&BucketFile::new("pay", Vec::new())).contains("criticality"));
    let lower: BucketFile =
        serde_yaml::from_str("service: pay\ncriticality:\n  caps:\n    cron: sheddable\n").unwrap();
    assert_eq!(lower.criticality.caps["cron"], Criticality::Sheddable);

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("pay.yaml"),
        "service: pay\ncriticality:\n  caps:\n    \"a*b\": SHEDDABLE\nbuckets: []\n",
    )
    .unwrap();
    std::fs::write(
        d.join("web.yaml"),
        "service: web\ncriticality:\n  caps:\n    cron: URGENT\nbuckets: []\n",
    )
    .unwrap();
    let (_, diags) = load_bucket_dir(d);
    let shown: Vec<String> = diags.iter().map(|x| x.to_string()).collect();
    assert_eq!(diags.len(), 2, "{shown:#?}");
    assert!(diags[0].file.ends_with("pay.yaml"), "{shown:#?}");
    assert!(diags[0].message.contains("`a*b`"), "{shown:#?}");
    assert!(
        diags[1].file.ends_with("web.yaml") && diags[1].line == 3,
        "{shown:#?}"
    );
    assert!(diags[1].message.contains("URGENT"), "{shown:#?}");
}

#[test]
fn format_rps_has_no_float_noise() {
    assert_eq!(format_rps(1250.0), "1250");
    assert_eq!(format_rps(0.1 + 0.2), "0.3");
    assert_eq!(format_rps(12.3456), "12.346");
}

#[test]
fn policies_merge_over_default() {
    let f: PoliciesFile = serde_yaml::from_str("default:\n  policy: peak\n  headroom: 0.25\nservices:\n  maps:\n    policy: forecast\n    horizon: 7d\n").unwrap();
    let m = f.for_service("maps");
    assert_eq!(m.policy, Some(PolicyName::Forecast));
    assert_eq!(m.headroom, Some(Headroom::Fixed(0.25)));
    assert_eq!(f.for_service("other").policy, Some(PolicyName::Peak));
}

#[test]
fn capacity_prefers_procedure_entry() {
    let c: CapacityFile = serde_yaml::from_str("capacity:\n  - service: maps\n    rps: 5000\n  - service: maps\n    procedure: route\n    rps: 2000\n").unwrap();
    assert_eq!(c.for_bucket("maps", Some("route")), Some(2000.0));
    assert_eq!(c.for_bucket("maps", Some("geocode")), Some(5000.0));
    assert_eq!(c.for_bucket("maps", None), Some(5000.0));
    assert_eq!(c.for_bucket("other", None), None);
}

#[test]
fn json_schema_covers_every_file() {
    let s = json_schema();
    for k in [
        "buckets/<service>.yaml",
        "rlc/policies.yaml",
        "rlc/contracts.yaml",
        "rlc/capacity.yaml",
        "rlc.yaml",
    ] {
        assert!(s.get(k).is_some(), "{k}");
    }
    assert!(s["rlc.yaml"]["properties"]["history"].is_object());
    assert!(s["rlc/policies.yaml"]["properties"]["promotion"].is_object());
    let kinds = s["rlc/policies.yaml"]["definitions"]["ChangeClass"].to_string();
    for k in ChangeClass::ALL {
        assert!(
            kinds.contains(&format!("\"{}\"", k.as_str())),
            "{k:?} in {kinds}"
        );
    }
}

#[test]
fn daemon_config_checks_the_schedule_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rlc.yaml");
    std::fs::write(
        &p,
        "history:\n  file: h.csv\nconfig_repo:\n  path: repo\nschedule: \"0 3 * *\"\n",
    )
    .unwrap();
    let errs = load_daemon_config(&p).unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(
        (errs[0].line, errs[0].key.as_str()),
        (5, "schedule"),
        "{}",
        errs[0]
    );
    std::fs::write(
        &p,
        "history:\n  file: h.csv\nconfig_repo:\n  path: repo\nschedule: \"0 3 * * 1-5\"\n",
    )
    .unwrap();
    assert!(load_daemon_config(&p).is_ok());
}

#[test]
fn daemon_config_prometheus_query_defaults_to_grl_calls() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rlc.yaml");
    std::fs::write(
        &p,
        "history:\n  prometheus:\n    url: http://127.0.0.1:9090\n  lookback: 3m\n  step: 5s\nconfig_repo:\n  path: repo\n",
    )
    .unwrap();
    let c = load_daemon_config(&p).unwrap();
    let prom = c.history.prometheus.unwrap();
    assert_eq!(
        prom.query,
        "sum by (service, caller, procedure) (rate(grl_calls_total[1m]))"
    );
    assert_eq!(prom.labels.caller, "caller");
    assert_eq!(
        (c.history.lookback.as_secs(), c.history.step.as_secs()),
        (180, 5)
    );
}

#[test]
fn daemon_config_store_retention() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rlc.yaml");
    let base = "history:\n  file: h.csv\nconfig_repo:\n  path: repo\n";
    std::fs::write(&p, base).unwrap();
    let c = load_daemon_config(&p).unwrap();
    assert_eq!(c.store.shadow_raw_retention.as_secs(), 48 * 3600);
    assert_eq!(c.store.shadow_rollup_retention.as_secs(), 35 * 86_400);
    assert_eq!(c.store.rollout_retention.as_secs(), 90 * 86_400);
    assert_eq!(
        (
            c.store.query_timeout.as_secs(),
            c.store.write_timeout.as_secs()
        ),
        (5, 30)
    );
    std::fs::write(
        &p,
        format!(
            "{base}store:\n  query_timeout: 2s\n  write_timeout: 1m\n  rollout_retention: 2w\n"
        ),
    )
    .unwrap();
    let c = load_daemon_config(&p).unwrap();
    assert_eq!(c.store.rollout_retention.as_secs(), 14 * 86_400);
    assert_eq!(
        (
            c.store.query_timeout.as_secs(),
            c.store.write_timeout.as_secs()
        ),
        (2, 60)
    );
    std::fs::write(
        &p,
        format!("{base}store:\n  shadow_raw_retention: 6h\n  shadow_rollup_retention: 2w\n"),
    )
    .unwrap();
    let c = load_daemon_config(&p).unwrap();
    assert_eq!(c.store.shadow_raw_retention.as_secs(), 6 * 3600);
    assert_eq!(c.store.shadow_rollup_retention.as_secs(), 14 * 86_400);
    // Roll-ups shorter than raw reports: refused, with the line.
    std::fs::write(
        &p,
        format!("{base}store:\n  shadow_raw_retention: 3d\n  shadow_rollup_retention: 2d\n"),
    )
    .unwrap();
    let errs = load_daemon_config(&p).unwrap_err();
    assert_eq!(
        (errs[0].line, errs[0].key.as_str()),
        (7, "store.shadow_rollup_retention"),
        "{}",
        errs[0]
    );
    for bad in [
        "shadow_raw_retention: 2x",
        "shadow_raw_retention: 0h",
        "query_timeout: 0s",
        "write_timeout: soon",
        "rollout_retention: 0d",
        "raw: 1h",
    ] {
        std::fs::write(&p, format!("{base}store:\n  {bad}\n")).unwrap();
        let errs = load_daemon_config(&p).unwrap_err();
        assert_eq!(errs[0].line, 6, "{bad}: {}", errs[0]);
    }
    let schema = json_schema();
    assert!(
        schema["rlc.yaml"]["definitions"]["StoreConfig"]["properties"]["shadow_rollup_retention"]
            .is_object(),
        "{schema:#}"
    );
}

#[test]
fn bucket_dir_reports_every_problem_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("ok.yaml"),
        "service: ok\nbuckets:\n  - name: a\n    caller: a\n    limit_rps: 5\n",
    )
    .unwrap();
    std::fs::write(
        d.join("x.yaml"),
        "service: y\nbuckets:\n  - name: a\n    caller: a\n    limit_rps: 5\n",
    )
    .unwrap();
    std::fs::write(
        d.join("typo.yaml"),
        "service: typo\nbuckets:\n  - name: a\n    caller: a\n    limit_rps: 5\n    colour: red\n",
    )
    .unwrap();
    std::fs::write(d.join("old.yml"), "service: old\nbuckets: []\n").unwrap();
    std::fs::write(d.join("notes.txt"), "not a bucket file").unwrap();
    let (files, diags) = load_bucket_dir(d);
    let shown: Vec<String> = diags.iter().map(|x| x.to_string()).collect();
    assert_eq!(diags.len(), 3, "{shown:#?}");
    // Sorted by file: old.yml (ignored), typo.yaml (unknown key, line 6), x.yaml (service).
    assert!(diags[0].file.ends_with("old.yml") && diags[0].message.contains("ignored"));
    assert!(diags[1].file.ends_with("typo.yaml") && diags[1].line == 6);
    assert!(diags[2].file.ends_with("x.yaml") && diags[2].key == "service");
    assert_eq!(diags[2].line, 1);
    // What parsed comes back (x.yaml and typo.yaml without its unknown key too: callers
    // refuse on any diagnostic).
    let services: Vec<&str> = files.iter().map(|f| f.value.service.as_str()).collect();
    assert_eq!(services, ["ok", "typo", "y"]);
    // A missing directory is one diagnostic, not a panic.
    let (files, diags) = load_bucket_dir(&d.join("missing"));
    assert!(files.is_empty() && diags.len() == 1);
}

// ---------------------------------------------------------------------------------------------
// Reading within limits

fn small_limits() -> Limits {
    Limits {
        max_file_bytes: 1024,
        max_repo_bytes: 2048,
        max_buckets: 5,
        max_dir_entries: 8,
        max_problems_per_file: 3,
        ..Limits::DEFAULT
    }
}

fn bucket_file(service: &str, n: usize) -> String {
    let mut s = format!("service: {service}\nbuckets:\n");
    for i in 0..n {
        s.push_str(&format!("  - {{name: b{i}, caller: c{i}, limit_rps: 5}}\n"));
    }
    s
}

#[test]
fn the_repo_budget_refuses_the_file_that_crosses_it() {
    let dir = tempfile::tempdir().unwrap();
    // Three files of ~900 bytes: the third crosses 2048 bytes.
    for s in ["a", "b", "c"] {
        let mut text = bucket_file(s, 1);
        text.push_str(&format!("# {}\n", "x".repeat(900 - text.len())));
        std::fs::write(dir.path().join(format!("{s}.yaml")), text).unwrap();
    }
    let (files, diags) = load_bucket_dir_with(dir.path(), &small_limits());
    assert_eq!(files.len(), 2, "{diags:?}");
    assert_eq!(diags.len(), 1, "{diags:?}");
    assert!(diags[0].file.ends_with("c.yaml"), "{}", diags[0]);
    assert!(
        diags[0].message.contains("exceed 2 KiB together"),
        "{}",
        diags[0]
    );
}

#[test]
fn the_repo_node_budget_refuses_the_file_that_crosses_it() {
    let dir = tempfile::tempdir().unwrap();
    // 2 + 2 + 7 × 4 = 32 nodes per file: the second file crosses 50.
    for s in ["a", "b"] {
        std::fs::write(dir.path().join(format!("{s}.yaml")), bucket_file(s, 4)).unwrap();
    }
    let limits = Limits {
        max_repo_nodes: 50,
        ..Limits::DEFAULT
    };
    let (files, diags) = load_bucket_dir_with(dir.path(), &limits);
    assert_eq!(files.len(), 1, "{diags:?}");
    assert_eq!(diags.len(), 1, "{diags:?}");
    assert!(diags[0].file.ends_with("b.yaml"), "{}", diags[0]);
    assert!(
        diags[0]
            .message
            .contains("more than 50 YAML nodes together"),
        "{}",
        diags[0]
    );
}

#[test]
fn the_file_limit_refuses_without_reading() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), bucket_file("a", 40)).unwrap();
    let (files, diags) = load_bucket_dir_with(dir.path(), &small_limits());
    assert!(files.is_empty());
    assert!(
        diags[0].message.contains("larger than 1 KiB"),
        "{}",
        diags[0]
    );
}

#[test]
fn the_bucket_limit_refuses_the_file_that_crosses_it_and_reads_no_more() {
    let dir = tempfile::tempdir().unwrap();
    for (s, n) in [("a", 3), ("b", 3), ("c", 1), ("d", 1)] {
        std::fs::write(dir.path().join(format!("{s}.yaml")), bucket_file(s, n)).unwrap();
    }
    let (files, diags) = load_bucket_dir_with(dir.path(), &small_limits());
    let shown: Vec<String> = diags.iter().map(|d| d.to_string()).collect();
    assert_eq!(files.len(), 1, "{shown:#?}");
    assert_eq!(diags.len(), 2, "{shown:#?}");
    assert!(
        shown[0].contains("2 more bucket file(s) not read: the limit of 5 buckets"),
        "{shown:#?}"
    );
    assert!(diags[1].file.ends_with("b.yaml"), "{shown:#?}");
    assert!(
        shown[1].contains("to 6, more than the limit of 5"),
        "{shown:#?}"
    );
}

#[test]
fn too_many_directory_entries_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for i in 0..9 {
        std::fs::write(
            dir.path().join(format!("s{i}.yaml")),
            bucket_file(&format!("s{i}"), 0),
        )
        .unwrap();
    }
    let (files, diags) = load_bucket_dir_with(dir.path(), &small_limits());
    assert!(files.is_empty());
    assert_eq!(diags.len(), 1);
    assert!(
        diags[0].message.contains("more than 8 entries"),
        "{}",
        diags[0]
    );
}

#[test]
fn problems_per_file_are_capped_with_a_count_of_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::from("service: a\nbuckets:\n");
    for i in 0..10 {
        text.push_str(&format!("  - {{name: b{i}, caller: c{i}, limit_rps: 0}}\n"));
    }
    std::fs::write(dir.path().join("a.yaml"), text).unwrap();
    let limits = Limits {
        max_problems_per_file: 3,
        ..Limits::DEFAULT
    };
    let (_, diags) = load_bucket_dir_with(dir.path(), &limits);
    let all = load_bucket_dir(dir.path()).1;
    assert_eq!(all.len(), 10, "{all:#?}");
    assert_eq!(diags.len(), 4, "{diags:?}");
    assert!(
        diags[3]
            .message
            .contains("7 more problem(s) in this file not listed"),
        "{}",
        diags[3]
    );
}

#[test]
fn unreadable_entries_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("bin.yaml"), b"service: \xff\xfe\n").unwrap();
    std::os::unix::fs::symlink(d.join("nowhere"), d.join("dangling.yaml")).unwrap();
    std::fs::create_dir(d.join("dir.yaml")).unwrap();
    std::fs::create_dir(d.join("sub")).unwrap();
    std::fs::write(d.join("sub/inner.yaml"), bucket_file("inner", 1)).unwrap();
    std::os::unix::fs::symlink("sub/inner.yaml", d.join("inner.yaml")).unwrap();
    let (files, diags) = load_bucket_dir(d);
    let shown: Vec<String> = diags.iter().map(|d| d.to_string()).collect();
    assert_eq!(diags.len(), 3, "{shown:#?}");
    assert!(
        shown[0].contains("bin.yaml:1:1: not UTF-8 text (invalid byte at offset 9)"),
        "{shown:#?}"
    );
    assert!(
        shown[1].contains("dangling.yaml:1:1: refused: a symbolic link that resolves to nothing"),
        "{shown:#?}"
    );
    assert!(
        shown[2].contains("dir.yaml:1:1: refused: a directory, not a regular file"),
        "{shown:#?}"
    );
    // A link inside the directory is followed.
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].value.service, "inner");
}

#[test]
fn a_config_dir_that_is_a_link_out_of_the_repo_is_refused() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("x.yaml"), bucket_file("x", 1)).unwrap();
    let repo = tempfile::tempdir().unwrap();
    std::fs::create_dir(repo.path().join("rlc")).unwrap();
    std::fs::write(
        repo.path().join("rlc/policies.yaml"),
        "default:\n  policy: peak\n",
    )
    .unwrap();
    std::os::unix::fs::symlink(outside.path(), repo.path().join("buckets")).unwrap();
    let (repo_value, diags) = ConfigRepo::load(repo.path());
    assert!(repo_value.buckets.is_empty());
    assert_eq!(diags.len(), 1, "{diags:?}");
    assert!(
        diags[0].message.contains("outside the repo"),
        "{}",
        diags[0]
    );
}

#[test]
fn daemon_config_follows_links_but_refuses_a_fifo() {
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real.yaml");
    std::fs::write(
        &real,
        "history:\n  file: h.csv\nconfig_repo:\n  path: repo\n",
    )
    .unwrap();
    let link = dir.path().join("rlc.yaml");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    assert!(load_daemon_config(&link).is_ok());
    let fifo = dir.path().join("fifo.yaml");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let errs = load_daemon_config(&fifo).unwrap_err();
    assert!(errs[0].message.contains("a FIFO"), "{}", errs[0]);
}

#[test]
fn daemon_config_reports_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rlc.yaml");
    std::fs::write(
        &p,
        "history:\n  file: h.csv\n  step: 5y\nconfig_repo:\n  path: repo\n  mode: sideways\nrails:\n  min_change: lots\n",
    )
    .unwrap();
    let errs = load_daemon_config(&p).unwrap_err();
    let keys: Vec<&str> = errs.iter().map(|d| d.key.as_str()).collect();
    assert_eq!(
        keys,
        ["history.step", "config_repo.mode", "rails.min_change"],
        "{errs:?}"
    );
    assert_eq!(errs.iter().map(|d| d.line).collect::<Vec<_>>(), [3, 6, 8]);
}

#[test]
fn an_alias_bomb_is_refused_before_expansion() {
    let mut bomb = String::from("a0: &a0 [x,x,x,x,x,x,x,x,x,x]\n");
    for i in 1..8 {
        bomb.push_str(&format!(
            "a{i}: &a{i} [{}]\n",
            vec![format!("*a{}", i - 1); 10].join(",")
        ));
    }
    bomb.push_str("service: s\nbuckets: *a7\n");
    let t = std::time::Instant::now();
    let p = parse_all::<BucketFile>(Path::new("b.yaml"), &bomb, &Limits::DEFAULT);
    assert!(p.located.is_none());
    assert!(
        p.problems[0]
            .message
            .contains("more than 1000000 YAML nodes"),
        "{:?}",
        p.problems
    );
    assert!(t.elapsed() < std::time::Duration::from_secs(5));
}

// ---------------------------------------------------------------------------------------------
// Property tests: whatever the input, the loader returns (no panic, no hang) within a bound.

mod props {
    use super::*;
    use proptest::prelude::*;
    use std::time::{Duration, Instant};

    /// Parses `text` as every file type; returns the longest time one took.
    fn parse_every_kind(text: &str) -> Duration {
        let f = Path::new("f.yaml");
        let l = Limits::DEFAULT;
        let mut worst = Duration::ZERO;
        let mut time = |run: &dyn Fn()| {
            let t = Instant::now();
            run();
            worst = worst.max(t.elapsed());
        };
        time(&|| {
            let p = parse_all::<BucketFile>(f, text, &l);
            // A value without problems, or problems: never neither.
            assert!(p.located.is_some() || !p.problems.is_empty());
        });
        time(&|| drop(parse_all::<PoliciesFile>(f, text, &l)));
        time(&|| drop(parse_all::<ContractsFile>(f, text, &l)));
        time(&|| drop(parse_all::<CapacityFile>(f, text, &l)));
        time(&|| drop(parse_all::<DaemonConfig>(f, text, &l)));
        worst
    }

    fn yamlish() -> impl Strategy<Value = String> {
        const TOKENS: &[&str] = &[
            "[",
            "]",
            "{",
            "}",
            ", ",
            ": ",
            ":",
            "- ",
            "? ",
            "\n",
            "  ",
            "\t",
            "&a ",
            "*a",
            "&b ",
            "*b",
            "!!str ",
            "!t ",
            "~",
            "'",
            "\"",
            "# c",
            "|\n",
            ">-\n",
            "---\n",
            "...\n",
            "%YAML 1.2\n",
            "service",
            "buckets",
            "name",
            "caller",
            "procedure",
            "limit_rps",
            "scope",
            "zone",
            "mode",
            "shadow",
            "policy",
            "plugin:x",
            "default",
            "services",
            "contracts",
            "capacity",
            "rps",
            "history",
            "5",
            "-1",
            ".inf",
            ".nan",
            "1e308",
            "0x1F",
            "true",
            "null",
            "é",
            "\u{feff}",
            "\\",
            "<<",
        ];
        let token = prop::sample::select(TOKENS);
        prop::collection::vec(token, 0..200).prop_map(|t| t.concat())
    }

    /// Few tokens repeated many times: the shapes that used to hang or overflow the stack.
    fn repeated() -> impl Strategy<Value = String> {
        const UNITS: &[&str] = &[
            "[", "{a: ", "- ", "? ", "a:\n ", "*a,", "&a [x] ", "\"", "[a,", "{",
        ];
        let unit = prop::sample::select(UNITS);
        (prop::collection::vec(unit, 1..4), 1usize..60_000, yamlish()).prop_map(|(u, n, tail)| {
            let mut s = String::from("a: ");
            s.push_str(&u.concat().repeat(n));
            s.push_str(&tail);
            s
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
            let text = String::from_utf8_lossy(&bytes);
            prop_assert!(parse_every_kind(&text) < Duration::from_secs(2));
        }

        #[test]
        fn yamlish_text_never_panics(text in yamlish()) {
            prop_assert!(parse_every_kind(&text) < Duration::from_secs(2));
        }

        #[test]
        fn repeated_structures_stay_within_bounds(text in repeated()) {
            prop_assert!(parse_every_kind(&text) < Duration::from_secs(5));
        }

        #[test]
        fn a_repo_of_arbitrary_files_loads_without_panic(
            bucket in yamlish(),
            policies in yamlish(),
            bytes in prop::collection::vec(any::<u8>(), 0..512),
        ) {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir_all(dir.path().join("buckets")).unwrap();
            std::fs::create_dir_all(dir.path().join("rlc")).unwrap();
            std::fs::write(dir.path().join("buckets/a.yaml"), &bucket).unwrap();
            std::fs::write(dir.path().join("buckets/b.yaml"), &bytes).unwrap();
            std::fs::write(dir.path().join("rlc/policies.yaml"), &policies).unwrap();
            std::fs::write(dir.path().join("rlc/contracts.yaml"), &bucket).unwrap();
            let t = Instant::now();
            let (_, diags) = ConfigRepo::load(dir.path());
            prop_assert!(t.elapsed() < Duration::from_secs(5));
            // Every problem names a file of the repo.
            for d in &diags {
                prop_assert!(d.file.starts_with(dir.path()), "{}", d);
                prop_assert!(d.line >= 1 && d.column >= 1, "{}", d);
            }
        }
    }
}

#[test]
fn promotion_section_merges_defaults_and_reports_every_problem_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("rlc")).unwrap();
    let p = dir.path().join("rlc/policies.yaml");
    std::fs::write(
        &p,
        "default:\n  policy: peak\npromotion:\n  default:\n    min_days_in_shadow: 3\n    auto_merge: [raise, decrease]\n  services:\n    pay:\n      min_coverage: 0.5\n      auto_merge: [raise]\n",
    )
    .unwrap();
    let (repo, diags) = ConfigRepo::load(dir.path());
    assert!(diags.is_empty(), "{diags:?}");
    let f = &repo.policies.unwrap().value;
    let pay = f.promotion_for("pay").unwrap();
    assert_eq!(pay.min_days_in_shadow, 3.0);
    assert_eq!(pay.min_coverage, 0.5);
    assert_eq!(pay.auto_merge, [ChangeClass::Raise]);
    let other = f.promotion_for("maps").unwrap();
    assert_eq!(other.min_coverage, 0.9);
    assert_eq!(other.max_virtual_drop_share, 1e-4);
    assert_eq!(
        other.auto_merge,
        [ChangeClass::Raise, ChangeClass::Decrease]
    );
    // Without the section: no rule at all.
    let plain: PoliciesFile = parse_str(Path::new("p.yaml"), "default:\n  policy: peak\n")
        .unwrap()
        .value;
    assert!(plain.promotion_for("pay").is_none());

    // Every problem, with its line and key.
    std::fs::write(
        &p,
        "default:\n  policy: peak\npromotion:\n  default:\n    min_days_in_shadow: -1\n    max_virtual_drop_share: 2\n  services:\n    pay:\n      auto_merge: [raise, raise]\n",
    )
    .unwrap();
    let (_, diags) = ConfigRepo::load(dir.path());
    let got: Vec<(usize, &str)> = diags.iter().map(|d| (d.line, d.key.as_str())).collect();
    assert_eq!(
        got,
        [
            (5, "promotion.default.min_days_in_shadow"),
            (6, "promotion.default.max_virtual_drop_share"),
            (9, "promotion.services.pay.auto_merge[1]"),
        ],
        "{diags:?}"
    );
    assert!(
        diags[0].to_string().contains("rlc/policies.yaml:5:"),
        "{}",
        diags[0]
    );
    // An unknown kind names the key and line.
    std::fs::write(
        &p,
        "default:\n  policy: peak\npromotion:\n  default:\n    auto_merge: [raise, yolo]\n",
    )
    .unwrap();
    let (_, diags) = ConfigRepo::load(dir.path());
    assert_eq!(diags.len(), 1, "{diags:?}");
    assert_eq!(diags[0].line, 5, "{}", diags[0]);
    assert!(
        diags[0].key.starts_with("promotion.default.auto_merge"),
        "{}",
        diags[0]
    );
    assert!(diags[0].message.contains("yolo"), "{}", diags[0]);
}

#[test]
fn forge_kind_defaults_to_github_and_gitlab_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rlc.yaml");
    let cfg = |forge: &str| {
        format!("history:\n  file: h.csv\nconfig_repo:\n  path: repo\n  mode: pull-request\n  forge:\n{forge}")
    };
    std::fs::write(
        &p,
        cfg("    repo: acme/config\n    labels: [quotas]\n    reviewers: [alice]\n"),
    )
    .unwrap();
    let c = load_daemon_config(&p).unwrap();
    let f = c.config_repo.forge.unwrap();
    assert_eq!(f.kind, "github");
    assert_eq!(f.labels, ["quotas"]);
    std::fs::write(&p, cfg("    kind: gitlab\n    repo: group/sub/config\n")).unwrap();
    assert!(load_daemon_config(&p).is_ok());
    std::fs::write(
        &p,
        cfg("    kind: gitlab\n    repo: config\n    labels: [\"a,b\"]\n    dashboard_url: rlc.example\n    web_url: \"javascript:alert(1)\"\n"),
    )
    .unwrap();
    let errs = load_daemon_config(&p).unwrap_err();
    let keys: Vec<(usize, &str)> = errs.iter().map(|d| (d.line, d.key.as_str())).collect();
    assert_eq!(
        keys,
        [
            (8, "config_repo.forge.repo"),
            (9, "config_repo.forge.labels[0]"),
            (10, "config_repo.forge.dashboard_url"),
            (11, "config_repo.forge.web_url"),
        ],
        "{errs:?}"
    );
}

#[test]
fn replacement_documents_get_the_checks_of_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let w = |p: &str, t: &str| {
        let p = dir.path().join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, t).unwrap();
    };
    w(
        "buckets/a.yaml",
        "service: a\nbuckets:\n  - name: x\n    caller: x\n    limit_rps: 5\n",
    );
    w("rlc/policies.yaml", "default:\n  policy: peak\n");
    w(
        "rlc/contracts.yaml",
        "contracts:\n  - service: b\n    caller: x\n    limit_rps: 5\n",
    );
    w("rlc/capacity.yaml", "capacity: []\n");
    // `b` is known through policies.yaml: the repo is valid.
    w(
        "rlc/policies.yaml",
        "default:\n  policy: peak\nservices:\n  b: {}\n",
    );
    let (repo, diags) = ConfigRepo::load(dir.path());
    assert!(diags.is_empty(), "{}", Diagnostics(diags));

    // A replacement of policies.yaml that drops `b` and has a bad headroom: both reported,
    // the first about the text given, the second about the repo's own contracts.yaml.
    let text = "default:\n  policy: peak\n  headroom: -1\n";
    let body = Path::new("what-if policies");
    let c = repo.check_documents(
        &DocumentTexts {
            policies: Some((body, text)),
            ..Default::default()
        },
        &Limits::DEFAULT,
    );
    assert!(!c.parse_problems);
    let shown: Vec<String> = c.problems.iter().map(|d| d.to_string()).collect();
    assert_eq!(c.problems.len(), 2, "{shown:?}");
    let h = c.problems.iter().find(|d| d.file == body).unwrap();
    assert_eq!((h.line, h.key.as_str()), (3, "default.headroom"), "{h}");
    let r = c.problems.iter().find(|d| d.file != body).unwrap();
    assert!(r.file.ends_with("rlc/contracts.yaml"), "{r}");
    assert_eq!((r.line, r.key.as_str()), (2, "contracts[0].service"), "{r}");
    assert_eq!(
        c.policies.unwrap().value.default.headroom,
        Some(Headroom::Fixed(-1.0))
    );
    assert_eq!(
        c.contracts.unwrap().value.contracts.len(),
        1,
        "the repo's own"
    );

    // A contract over capacity and an unknown key: a parse problem and a check problem.
    let contracts =
        "contracts:\n  - service: a\n    caller: x\n    limit_rps: 50\n    colour: red\n";
    let capacity = "capacity:\n  - service: a\n    rps: 10\n";
    let c = repo.check_documents(
        &DocumentTexts {
            contracts: Some((Path::new("c"), contracts)),
            capacity: Some((Path::new("k"), capacity)),
            ..Default::default()
        },
        &Limits::DEFAULT,
    );
    assert!(c.parse_problems);
    let keys: Vec<(&str, usize, &str)> = c
        .problems
        .iter()
        .map(|d| (d.file.to_str().unwrap(), d.line, d.key.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("c", 4, "contracts[0].limit_rps"),
            ("c", 5, "contracts[0].colour")
        ],
        "{:?}",
        c.problems
    );
}

#[test]
fn planned_events_and_forecast_keys_are_checked_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let w = |p: &str, t: &str| {
        let p = dir.path().join(p);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, t).unwrap();
    };
    w(
        "rlc/policies.yaml",
        "default:\n  policy: forecast\n  timezone: Mars/Olympus\n  new_normal_after: 10d\nservices:\n  a:\n    timezone: Europe/Berlin\n",
    );
    w(
        "rlc/capacity.yaml",
        "capacity: []\nevents:\n  - name: sale\n    service: a\n    from: 2026-12-01\n    until: 2026-12-03\n    factor: 3\n  - name: migration\n    service: nope\n    caller: web\n    from: 2026-12-05\n    until: 2026-12-04\n    factor: 0.5\n  - name: launch\n    service: a\n    from: 2026-12-01\n    until: 2026-12-01\n",
    );
    let (repo, diags) = ConfigRepo::load(dir.path());
    let got: Vec<(String, usize, String)> = diags
        .iter()
        .map(|d| {
            (
                d.file.file_name().unwrap().to_string_lossy().into_owned(),
                d.line,
                d.key.clone(),
            )
        })
        .collect();
    let want = |f: &str, l: usize, k: &str| (f.to_string(), l, k.to_string());
    for w in [
        want("policies.yaml", 3, "default.timezone"),
        want("capacity.yaml", 9, "events[1].service"),
        want("capacity.yaml", 12, "events[1].until"),
        want("capacity.yaml", 13, "events[1].factor"),
        want("capacity.yaml", 14, "events[2]"),
    ] {
        assert!(got.contains(&w), "{w:?} not in {got:?}");
    }
    assert_eq!(got.len(), 5, "{}", Diagnostics(diags));
    let e = &repo.capacity.unwrap().value.events[0];
    assert!(e.matches("a", Some("web"), None) && !e.matches("b", None, None));
    // 2026-12-01 00:00 UTC to 2026-12-04 00:00 UTC.
    assert_eq!(e.window(), (1_796_083_200, 1_796_083_200 + 3 * 86_400));
    assert!(e.overlaps(1_796_083_200 - 86_400, 1_796_083_200 + 1));
    assert!(!e.overlaps(1_796_083_200 + 3 * 86_400, 1_796_083_200 + 4 * 86_400));
}

#[test]
fn history_bounds_have_defaults_and_refuse_zero() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rlc.yaml");
    let yaml = |extra: &str| {
        format!("history:\n  prometheus:\n    url: http://127.0.0.1:9090\n{extra}config_repo:\n  path: repo\n")
    };
    std::fs::write(&p, yaml("")).unwrap();
    let cfg = load_daemon_config(&p).unwrap();
    let prom = cfg.history.prometheus.unwrap();
    assert_eq!(
        (
            prom.max_response_bytes,
            prom.max_pull_bytes,
            prom.max_series
        ),
        (2 << 30, 32 << 30, crate::DEFAULT_MAX_SERIES)
    );
    std::fs::write(
        &p,
        yaml("    max_response_bytes: 0\n    max_pull_bytes: 0\n    max_series: 0\n"),
    )
    .unwrap();
    let errs = load_daemon_config(&p).unwrap_err();
    let keys: Vec<&str> = errs.iter().map(|d| d.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "history.prometheus.max_response_bytes",
            "history.prometheus.max_pull_bytes",
            "history.prometheus.max_series"
        ],
        "{errs:?}"
    );
    assert!(
        errs.iter().all(|d| d.message == "must be at least 1"),
        "{errs:?}"
    );
}

#[test]
fn full_pull_every_defaults_to_a_day_and_refuses_zero_and_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rlc.yaml");
    std::fs::write(&p, "history:\n  file: h.csv\nconfig_repo:\n  path: repo\n").unwrap();
    let c = load_daemon_config(&p).unwrap();
    assert_eq!(c.history.full_pull_every.as_secs(), 86_400);
    std::fs::write(
        &p,
        "history:\n  file: h.csv\n  full_pull_every: 6h\nconfig_repo:\n  path: repo\n",
    )
    .unwrap();
    assert_eq!(
        load_daemon_config(&p)
            .unwrap()
            .history
            .full_pull_every
            .as_secs(),
        6 * 3600
    );
    for (value, says) in [("0s", "must be positive"), ("often", "often")] {
        std::fs::write(
            &p,
            format!(
                "history:\n  file: h.csv\n  full_pull_every: {value}\nconfig_repo:\n  path: repo\n"
            ),
        )
        .unwrap();
        let errs = load_daemon_config(&p).unwrap_err();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].key, "history.full_pull_every", "{value}: {errs:?}");
        assert_eq!(errs[0].line, 3, "{errs:?}");
        assert!(errs[0].message.contains(says), "{}", errs[0].message);
    }
}

#[test]
fn rollout_section_merges_defaults_and_reports_every_problem_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("rlc")).unwrap();
    let p = dir.path().join("rlc/policies.yaml");
    std::fs::write(
        &p,
        "default:\n  policy: peak\nrollout:\n  bake: 30m\n  stages: [[eu], [\"*\"]]\n  services:\n    pay:\n      bake: 2h\n    maps:\n      enabled: false\n",
    )
    .unwrap();
    let (repo, diags) = ConfigRepo::load(dir.path());
    assert!(diags.is_empty(), "{diags:?}");
    let f = &repo.policies.unwrap().value;
    let pay = f.rollout_for("pay").unwrap();
    assert_eq!(pay.bake.as_secs(), 7200);
    assert_eq!(pay.stages, [vec!["eu".to_string()], vec!["*".to_string()]]);
    assert_eq!((pay.stage_of("eu"), pay.stage_of("us")), (Some(0), Some(1)));
    let other = f.rollout_for("search").unwrap();
    assert_eq!(other.bake.as_secs(), 1800);
    assert_eq!(other.max_virtual_drop_share, 1e-4);
    assert_eq!(other.min_offered, 1000.0);
    assert_eq!(other.max_bake.as_secs(), 86_400);
    assert!(f.rollout_for("maps").is_none(), "disabled for maps");
    let plain: PoliciesFile = parse_str(Path::new("p.yaml"), "default:\n  policy: peak\n")
        .unwrap()
        .value;
    assert!(plain.rollout_for("pay").is_none(), "no rollout: at once");

    std::fs::write(
        &p,
        "default:\n  policy: peak\nrollout:\n  max_virtual_drop_share: 2\n  stages: [[eu], [eu]]\n  services:\n    pay:\n      bake: 2h\n      max_bake: 1h\n",
    )
    .unwrap();
    let (_, diags) = ConfigRepo::load(dir.path());
    let got: Vec<(usize, &str)> = diags.iter().map(|d| (d.line, d.key.as_str())).collect();
    assert_eq!(
        got,
        [
            (4, "rollout.max_virtual_drop_share"),
            (5, "rollout.stages[1][0]"),
            (9, "rollout.services.pay.max_bake"),
        ],
        "{diags:?}"
    );
    assert!(
        diags[0].to_string().contains("rlc/policies.yaml:4:"),
        "{}",
        diags[0]
    );
}

#[test]
fn daemon_config_names_controllers_by_region() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rlc.yaml");
    let head = "history:\n  file: h.csv\nconfig_repo:\n  path: repo\n";
    std::fs::write(
        &p,
        format!("{head}controllers:\n  - region: eu\n    url: http://a:7070\n  - region: us\n    url: http://b:7070\n"),
    )
    .unwrap();
    let c = load_daemon_config(&p).unwrap();
    let regions: Vec<String> = c.region_controllers().into_iter().map(|(r, _)| r).collect();
    assert_eq!(regions, ["eu", "us"]);
    std::fs::write(&p, format!("{head}controller:\n  url: http://a:7070\n")).unwrap();
    let c = load_daemon_config(&p).unwrap();
    assert_eq!(c.region_controllers()[0].0, "default");
    std::fs::write(
        &p,
        format!("{head}controllers:\n  - url: http://a:7070\n  - region: eu\n    url: ftp://b\n  - region: eu\n    url: http://c:7070\n"),
    )
    .unwrap();
    let errs = load_daemon_config(&p).unwrap_err();
    let got: Vec<(usize, &str)> = errs.iter().map(|d| (d.line, d.key.as_str())).collect();
    assert_eq!(
        got,
        [
            (6, "controllers[0]"),
            (8, "controllers[1].url"),
            (9, "controllers[2].region"),
        ],
        "{errs:?}"
    );
}

#[test]
fn headroom_is_a_number_or_auto_with_its_bounds_checked_by_line() {
    let f: PoliciesFile = serde_yaml::from_str(
        "default:\n  policy: peak\n  headroom: auto\nservices:\n  pay:\n    headroom: 0.1\n  maps:\n    headroom: AUTO\n    min_headroom: 0.05\n",
    )
    .unwrap();
    assert_eq!(f.for_service("other").headroom, Some(Headroom::Auto));
    assert_eq!(f.for_service("pay").headroom, Some(Headroom::Fixed(0.1)));
    assert_eq!(f.for_service("maps").min_headroom, Some(0.05));
    // Written back as it was read.
    let back = serde_yaml::to_string(&f.for_service("pay")).unwrap();
    assert!(back.contains("headroom: 0.1"), "{back}");
    let back = serde_yaml::to_string(&f.default).unwrap();
    assert!(back.contains("headroom: auto"), "{back}");
    // A word that is not `auto`: the key and its line.
    let d = parse_err::<PoliciesFile>("default:\n  policy: peak\n  headroom: lots\n");
    assert_eq!((d.line, d.key.as_str()), (3, "default.headroom"), "{d}");
    assert!(d.message.contains("a number ≥ 0 or `auto`"), "{d}");
    // Bounds that make no sense: each named with its line.
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("rlc")).unwrap();
    std::fs::write(
        dir.path().join("rlc/policies.yaml"),
        "default:\n  policy: peak\n  headroom: auto\n  target_throttled: 2\n  min_headroom: 0.5\n  max_headroom: 0.2\n",
    )
    .unwrap();
    let (_, diags) = ConfigRepo::load(dir.path());
    let got: Vec<(usize, &str)> = diags.iter().map(|d| (d.line, d.key.as_str())).collect();
    assert_eq!(
        got,
        [(4, "default.target_throttled"), (5, "default.min_headroom")],
        "{}",
        Diagnostics(diags.clone())
    );
}
