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
    assert_eq!(m.headroom, Some(0.25));
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
