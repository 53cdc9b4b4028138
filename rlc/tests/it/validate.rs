//! `rlc validate` on the template and on one broken repo per class of error.

use std::path::{Path, PathBuf};
use std::process::Command;

fn template() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../config-repo-template")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), &t).unwrap();
        }
    }
}

/// Runs `rlc validate` on `dir`: (exit code, stdout lines).
fn validate(dir: &Path) -> (i32, Vec<String>) {
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .arg("validate")
        .arg(dir)
        .output()
        .expect("rlc runs");
    let stdout = String::from_utf8(out.stdout).unwrap();
    (
        out.status.code().unwrap_or(-1),
        stdout.lines().map(String::from).collect(),
    )
}

const PAYMENTS: &str = "service: payments
buckets:
  - name: a
    caller: api-gateway
    procedure: charge
    limit_rps: 100
  - name: b
    caller: checkout
    limit_rps: 50
";

/// A broken repo: the template with `edits` applied (None deletes the file); `expect` lists
/// (file, line, key) that must each appear in one reported problem.
struct Case {
    name: &'static str,
    edits: Vec<(&'static str, Option<String>)>,
    expect: Vec<(&'static str, usize, &'static str)>,
}

fn payments_with(from: &str, to: &str) -> Vec<(&'static str, Option<String>)> {
    assert!(PAYMENTS.contains(from), "{from}");
    vec![(
        "buckets/payments.yaml",
        Some(PAYMENTS.replacen(from, to, 1)),
    )]
}

fn cases() -> Vec<Case> {
    let contracts = |body: &str| vec![("rlc/contracts.yaml", Some(format!("contracts:\n{body}")))];
    let capacity = |body: &str| vec![("rlc/capacity.yaml", Some(format!("capacity:\n{body}")))];
    vec![
        Case {
            name: "yaml syntax",
            edits: payments_with("    caller: checkout\n", "    caller: checkout: x\n"),
            expect: vec![("buckets/payments.yaml", 8, "")],
        },
        Case {
            name: "unknown key in a bucket",
            edits: payments_with("    limit_rps: 50\n", "    limit_rps: 50\n    burst: 10\n"),
            expect: vec![("buckets/payments.yaml", 10, "burst")],
        },
        Case {
            name: "wrong scope",
            edits: payments_with("    limit_rps: 50\n", "    limit_rps: 50\n    scope: planet\n"),
            expect: vec![("buckets/payments.yaml", 10, "buckets[1].scope")],
        },
        Case {
            name: "wrong mode",
            edits: payments_with("    limit_rps: 100\n", "    limit_rps: 100\n    mode: maybe\n"),
            expect: vec![("buckets/payments.yaml", 7, "buckets[0].mode")],
        },
        Case {
            name: "unknown policy provenance in a bucket",
            edits: payments_with("    limit_rps: 100\n", "    limit_rps: 100\n    policy: peek\n"),
            expect: vec![("buckets/payments.yaml", 7, "buckets[0].policy")],
        },
        Case {
            name: "zero limit",
            edits: payments_with("limit_rps: 50", "limit_rps: 0"),
            expect: vec![("buckets/payments.yaml", 9, "buckets[1].limit_rps")],
        },
        Case {
            name: "negative limit",
            edits: payments_with("limit_rps: 100", "limit_rps: -5"),
            expect: vec![("buckets/payments.yaml", 6, "buckets[0].limit_rps")],
        },
        Case {
            name: "non-finite limit",
            edits: payments_with("limit_rps: 100", "limit_rps: .inf"),
            expect: vec![("buckets/payments.yaml", 6, "buckets[0].limit_rps")],
        },
        Case {
            name: "missing limit",
            edits: payments_with("    limit_rps: 50\n", ""),
            expect: vec![("buckets/payments.yaml", 7, "buckets[1].limit_rps")],
        },
        Case {
            name: "duplicate bucket names",
            edits: payments_with("name: b", "name: a"),
            expect: vec![("buckets/payments.yaml", 7, "buckets[1].name")],
        },
        Case {
            name: "two buckets with the same match",
            edits: payments_with("    caller: checkout\n", "    caller: api-gateway\n    procedure: charge\n"),
            expect: vec![("buckets/payments.yaml", 7, "buckets[1]")],
        },
        Case {
            name: "bucket matching nothing",
            edits: payments_with("    caller: checkout\n", ""),
            expect: vec![("buckets/payments.yaml", 7, "buckets[1]")],
        },
        Case {
            name: "service differs from file name",
            edits: payments_with("service: payments", "service: payment"),
            expect: vec![("buckets/payments.yaml", 1, "service")],
        },
        Case {
            name: "unknown policy name",
            edits: vec![("rlc/policies.yaml", Some("default:\n  policy: peak\nservices:\n  maps:\n    policy: forcast\n".into()))],
            expect: vec![("rlc/policies.yaml", 5, "services.maps.policy")],
        },
        Case {
            name: "unknown key in policies",
            edits: vec![("rlc/policies.yaml", Some("default:\n  policy: peak\n  headrom: 0.2\n".into()))],
            expect: vec![("rlc/policies.yaml", 3, "headrom")],
        },
        Case {
            name: "negative headroom",
            edits: vec![("rlc/policies.yaml", Some("default:\n  policy: peak\nservices:\n  maps:\n    headroom: -0.5\n".into()))],
            expect: vec![("rlc/policies.yaml", 5, "services.maps.headroom")],
        },
        Case {
            name: "missing policies file",
            edits: vec![("rlc/policies.yaml", None)],
            expect: vec![("rlc/policies.yaml", 1, "")],
        },
        Case {
            name: "contract for an unknown service",
            edits: contracts("  - service: mapz\n    caller: partner-x\n    limit_rps: 10\n"),
            expect: vec![("rlc/contracts.yaml", 2, "contracts[0].service")],
        },
        Case {
            name: "contradicting contracts",
            edits: contracts("  - service: maps\n    caller: partner-x\n    limit_rps: 10\n  - service: maps\n    caller: partner-x\n    limit_rps: 20\n"),
            expect: vec![("rlc/contracts.yaml", 5, "contracts[1]")],
        },
        Case {
            name: "contract above planned capacity",
            edits: contracts("  - service: maps\n    caller: partner-x\n    procedure: route\n    limit_rps: 9000\n"),
            expect: vec![("rlc/contracts.yaml", 5, "contracts[0].limit_rps")],
        },
        Case {
            name: "contract with a bad date",
            edits: contracts("  - service: maps\n    caller: partner-x\n    limit_rps: 10\n    expires: 2027-13-01\n"),
            expect: vec![("rlc/contracts.yaml", 5, "contracts[0].expires")],
        },
        Case {
            name: "capacity for an unknown service",
            edits: capacity("  - service: nowhere\n    rps: 10\n"),
            expect: vec![("rlc/capacity.yaml", 2, "capacity[0].service")],
        },
        Case {
            name: "contradicting capacity entries",
            edits: capacity("  - service: maps\n    rps: 10\n  - service: maps\n    rps: 20\n"),
            expect: vec![("rlc/capacity.yaml", 4, "capacity[1]")],
        },
        Case {
            name: "several problems in one repo are all reported",
            edits: [
                payments_with("limit_rps: 50", "limit_rps: 0"),
                contracts("  - service: mapz\n    caller: partner-x\n    limit_rps: 10\n"),
                capacity("  - service: nowhere\n    rps: -1\n"),
            ]
            .concat(),
            expect: vec![
                ("buckets/payments.yaml", 9, "buckets[1].limit_rps"),
                ("rlc/contracts.yaml", 2, "contracts[0].service"),
                ("rlc/capacity.yaml", 2, "capacity[0].service"),
                ("rlc/capacity.yaml", 3, "capacity[0].rps"),
            ],
        },
    ]
}

#[test]
fn template_is_valid() {
    let (code, lines) = validate(&template());
    assert_eq!(code, 0, "{lines:#?}");
    assert!(lines.is_empty(), "{lines:#?}");
}

#[test]
fn every_class_of_error_names_file_line_and_key() {
    let cases = cases();
    assert!(cases.len() >= 15);
    let mut failures = Vec::new();
    for case in cases {
        let tmp = tempfile::tempdir().unwrap();
        copy_dir(&template(), tmp.path());
        for (file, content) in &case.edits {
            let p = tmp.path().join(file);
            match content {
                Some(c) => std::fs::write(&p, c).unwrap(),
                None => std::fs::remove_file(&p).unwrap(),
            }
        }
        let (code, lines) = validate(tmp.path());
        if code != 1 {
            failures.push(format!("{}: exit {code}, output {lines:#?}", case.name));
            continue;
        }
        for (file, line, key) in &case.expect {
            let prefix = format!("{}:{line}:", tmp.path().join(file).display());
            let key_part = if key.is_empty() {
                String::new()
            } else {
                format!("{key}: ")
            };
            let hit = lines
                .iter()
                .any(|l| l.starts_with(&prefix) && l.contains(&key_part));
            if !hit {
                failures.push(format!(
                    "{}: no problem at {file}:{line} naming `{key}` in {lines:#?}",
                    case.name
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn json_output_lists_problems() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&template(), tmp.path());
    std::fs::write(
        tmp.path().join("buckets/payments.yaml"),
        PAYMENTS.replace("limit_rps: 50", "limit_rps: 0"),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(["validate", "--format", "json"])
        .arg(tmp.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = &v["problems"][0];
    assert_eq!(p["line"], 9);
    assert_eq!(p["key"], "buckets[1].limit_rps");
    assert!(p["file"]
        .as_str()
        .unwrap()
        .ends_with("buckets/payments.yaml"));
}
