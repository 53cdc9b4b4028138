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

// ---------------------------------------------------------------------------------------------
// A hostile or unlucky repo: every refusal names the file and the reason, in bounded time and
// memory, without printing anything from outside the repo.

/// What `rlc validate` did on a repo: exit code, stdout, stderr, wall time.
struct Outcome {
    code: i32,
    stdout: String,
    stderr: String,
    took: std::time::Duration,
}

/// Runs `rlc validate dir` with its address space capped at 2 GiB (a run that tries to read
/// `/dev/zero` dies instead of taking the machine) and a 60 s guard (a hang fails the test
/// instead of blocking it); output goes to files so that a full pipe cannot block the child.
fn validate_bounded(dir: &Path) -> Outcome {
    let out = tempfile::tempdir().unwrap();
    let (o, e) = (out.path().join("out"), out.path().join("err"));
    let start = std::time::Instant::now();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 2097152 && exec \"$0\" validate \"$1\"")
        .arg(env!("CARGO_BIN_EXE_rlc"))
        .arg(dir)
        .stdout(std::fs::File::create(&o).unwrap())
        .stderr(std::fs::File::create(&e).unwrap())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("rlc validate {} still running after 60 s", dir.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Outcome {
        code: status.code().unwrap_or(-1),
        stdout: std::fs::read_to_string(&o).unwrap(),
        stderr: std::fs::read_to_string(&e).unwrap(),
        took: start.elapsed(),
    }
}

fn template_copy() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&template(), tmp.path());
    tmp
}

/// Asserts one problem line for `file` (relative to the repo) containing `reason`, exit 1,
/// within 20 s.
fn assert_refused(repo: &Path, o: &Outcome, file: &str, reason: &str) {
    assert_eq!(o.code, 1, "stdout {} stderr {}", o.stdout, o.stderr);
    let prefix = format!("{}:1:1: ", repo.join(file).display());
    assert!(
        o.stdout
            .lines()
            .any(|l| l.starts_with(&prefix) && l.contains(reason)),
        "no `{reason}` for {file} in {}",
        o.stdout
    );
    assert!(
        o.took < std::time::Duration::from_secs(20),
        "took {:?}",
        o.took
    );
}

fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo").arg(path).status().unwrap().success();
    assert!(ok, "mkfifo {}", path.display());
}

#[test]
fn fault_symlink_to_dev_zero_is_refused_not_read() {
    let repo = template_copy();
    let f = repo.path().join("buckets/maps.yaml");
    std::fs::remove_file(&f).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &f).unwrap();
    let o = validate_bounded(repo.path());
    assert_refused(
        repo.path(),
        &o,
        "buckets/maps.yaml",
        "symbolic link to /dev/zero outside the repo",
    );
}

#[test]
fn fault_symlink_to_etc_passwd_is_refused_and_never_printed() {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let first = passwd.lines().next().unwrap().to_string();
    let repo = template_copy();
    for f in ["buckets/maps.yaml", "rlc/contracts.yaml"] {
        let p = repo.path().join(f);
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &p).unwrap();
    }
    let o = validate_bounded(repo.path());
    for f in ["buckets/maps.yaml", "rlc/contracts.yaml"] {
        assert_refused(
            repo.path(),
            &o,
            f,
            "symbolic link to /etc/passwd outside the repo",
        );
    }
    for out in [&o.stdout, &o.stderr] {
        assert!(
            !out.contains(&first),
            "content of /etc/passwd printed: {out}"
        );
        assert!(
            !out.contains("/bin/"),
            "content of /etc/passwd printed: {out}"
        );
    }
    // maps has a file (refused, but there): rlc/capacity.yaml's `maps` is no unknown service.
    assert!(!o.stdout.contains("unknown service"), "{}", o.stdout);
}

#[test]
fn fault_symlink_inside_the_repo_is_followed() {
    let repo = template_copy();
    let p = repo.path().join("buckets/payments.yaml");
    std::fs::rename(&p, repo.path().join("payments.source")).unwrap();
    std::os::unix::fs::symlink("../payments.source", &p).unwrap();
    let o = validate_bounded(repo.path());
    assert_eq!(o.code, 0, "{} {}", o.stdout, o.stderr);
}

#[test]
fn fault_fifo_is_refused_without_blocking() {
    let repo = template_copy();
    mkfifo(&repo.path().join("buckets/queue.yaml"));
    mkfifo(&repo.path().join("rlc/capacity.yaml.fifo"));
    std::fs::remove_file(repo.path().join("rlc/capacity.yaml")).unwrap();
    std::fs::rename(
        repo.path().join("rlc/capacity.yaml.fifo"),
        repo.path().join("rlc/capacity.yaml"),
    )
    .unwrap();
    let o = validate_bounded(repo.path());
    assert_refused(
        repo.path(),
        &o,
        "buckets/queue.yaml",
        "a FIFO (named pipe), not a regular file",
    );
    assert_refused(
        repo.path(),
        &o,
        "rlc/capacity.yaml",
        "a FIFO (named pipe), not a regular file",
    );
}

#[test]
fn fault_deep_flow_nesting_is_refused_in_bounded_time() {
    let repo = template_copy();
    // 400 KB of `[[[[…]]]]`: over a minute before the limit.
    let n = 200_000;
    std::fs::write(
        repo.path().join("buckets/maps.yaml"),
        format!(
            "service: maps\nbuckets: {}{}\n",
            "[".repeat(n),
            "]".repeat(n)
        ),
    )
    .unwrap();
    // Block nesting (`- - - …`) overflowed the stack of both parsers before the limit.
    std::fs::write(
        repo.path().join("buckets/payments.yaml"),
        format!("service: payments\nbuckets:\n{}x\n", "- ".repeat(n)),
    )
    .unwrap();
    let o = validate_bounded(repo.path());
    assert_eq!(o.code, 1, "{} {}", o.stdout, o.stderr);
    for f in ["buckets/maps.yaml:2:", "buckets/payments.yaml:3:"] {
        let prefix = format!("{}", repo.path().join(f).display());
        assert!(
            o.stdout
                .lines()
                .any(|l| l.starts_with(&prefix) && l.contains("nesting deeper than 64 levels")),
            "{f} in {}",
            o.stdout
        );
    }
    assert!(
        o.took < std::time::Duration::from_secs(20),
        "took {:?}",
        o.took
    );
}

#[test]
fn fault_oversize_file_is_refused_before_reading() {
    let repo = template_copy();
    let mut text = String::from("service: maps\nbuckets:\n");
    let mut i = 0;
    while text.len() <= 5 << 20 {
        text.push_str(&format!("  - {{name: b{i}, caller: c{i}, limit_rps: 5}}\n"));
        i += 1;
    }
    std::fs::write(repo.path().join("buckets/maps.yaml"), text).unwrap();
    let o = validate_bounded(repo.path());
    assert_refused(
        repo.path(),
        &o,
        "buckets/maps.yaml",
        "refused: larger than 4 MiB",
    );
    assert!(!o.stdout.contains("unknown service"), "{}", o.stdout);
}

#[test]
fn every_problem_of_a_file_is_reported_even_after_a_type_error() {
    let repo = template_copy();
    // One bad scope used to hide everything else in the file and to make `maps` an unknown
    // service for rlc/capacity.yaml.
    std::fs::write(
        repo.path().join("buckets/maps.yaml"),
        "service: maps
buckets:
  - name: a
    caller: web
    limit_rps: 0
    scope: planet
  - name: a
    caller: api
    limit_rps: fast
    mode: maybe
    colour: red
  - name: c
    caller: x
    policy: peek
",
    )
    .unwrap();
    let o = validate_bounded(repo.path());
    assert_eq!(o.code, 1, "{} {}", o.stdout, o.stderr);
    let f = repo.path().join("buckets/maps.yaml");
    for (line, key, what) in [
        (5, "buckets[0].limit_rps", "must be positive"),
        (6, "buckets[0].scope", "unknown variant `planet`"),
        (7, "buckets[1].name", "duplicate bucket name"),
        (
            9,
            "buckets[1].limit_rps",
            "invalid type: string \"fast\", expected f64",
        ),
        (10, "buckets[1].mode", "unknown variant `maybe`"),
        (11, "buckets[1].colour", "unknown field `colour`"),
        (12, "buckets[2].limit_rps", "missing field `limit_rps`"),
        (14, "buckets[2].policy", "unknown policy `peek`"),
    ] {
        let prefix = format!("{}:{line}:", f.display());
        assert!(
            o.stdout.lines().any(|l| l.starts_with(&prefix)
                && l.contains(&format!("{key}: "))
                && l.contains(what)),
            "no `{key}: …{what}` at line {line} in\n{}",
            o.stdout
        );
    }
    // Nothing invented: no consequence of a replaced value, no unknown service.
    assert_eq!(o.stdout.lines().count(), 8, "{}", o.stdout);
    assert!(!o.stdout.contains("unknown service"), "{}", o.stdout);
}

#[test]
fn a_reference_is_never_unknown_because_its_file_failed_to_parse() {
    let repo = template_copy();
    // A syntax error: no value at all, but the service has a bucket file.
    std::fs::write(
        repo.path().join("buckets/maps.yaml"),
        "service: maps\nbuckets:\n  - name: a\n    caller: b: c\n",
    )
    .unwrap();
    // policies.yaml broken: the services it names cannot be known, so none is called unknown.
    std::fs::write(
        repo.path().join("rlc/policies.yaml"),
        "default:\n  policy: peak\nservices:\n  billing: [\n",
    )
    .unwrap();
    std::fs::write(
        repo.path().join("rlc/contracts.yaml"),
        "contracts:\n  - service: billing\n    caller: partner\n    limit_rps: 10\n",
    )
    .unwrap();
    let o = validate_bounded(repo.path());
    assert_eq!(o.code, 1, "{} {}", o.stdout, o.stderr);
    assert!(o.stdout.contains("buckets/maps.yaml:4:"), "{}", o.stdout);
    assert!(o.stdout.contains("rlc/policies.yaml:"), "{}", o.stdout);
    assert!(!o.stdout.contains("unknown service"), "{}", o.stdout);
    assert_eq!(o.stdout.lines().count(), 2, "{}", o.stdout);
}
