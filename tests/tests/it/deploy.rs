//! `deploy/`: the Grafana dashboards and the Prometheus rules read only metrics the project
//! exports (collected from `/metrics` of a real controller, aggregator and `rlc serve`, and
//! from an embedded client's registry), the dashboards are Grafana dashboard JSON, and the
//! rules pass `promtool check rules` and their `promtool test rules` unit tests.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use test_support::process::{free_port, Proc};

use super::{bin, get_text, post, start_controller, wait_until, Deployment};

mod artefacts;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn files(dir: &str, ext: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(deploy_dir().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no *.{ext} in deploy/{dir}");
    v
}

fn promtool() -> PathBuf {
    ["/usr/bin/promtool", "/usr/local/bin/promtool"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("promtool (Debian package prometheus; `cargo xtask test` installs it)")
}

/// The sample names a `/metrics` text exposes: from its `# TYPE` lines (a counter family
/// `x` has samples `x_total`, a histogram `x_bucket`, `x_sum`, `x_count`).
fn exported_names(text: &str, into: &mut BTreeSet<String>) {
    for l in text.lines() {
        let Some(rest) = l.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').unwrap();
        match kind {
            "counter" => {
                into.insert(format!("{name}_total"));
            }
            "histogram" => {
                for s in ["_bucket", "_sum", "_count"] {
                    into.insert(format!("{name}{s}"));
                }
            }
            _ => {
                into.insert(name.to_string());
            }
        }
    }
}

const PROMQL_WORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
    // aggregation operators (`sum by (x) (…)`: not followed by a parenthesis)
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
];

/// The metric names a PromQL expression selects: identifiers outside strings, label
/// matchers, label lists and range brackets, that are neither functions nor keywords.
/// Grafana variables (`$x`, `${x}`) are dropped.
fn promql_names(expr: &str) -> BTreeSet<String> {
    let b: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let (mut i, mut brace, mut bracket) = (0, 0, 0);
    // Set after `by`/`on`/…: the next parenthesised list holds label names.
    let mut label_list = false;
    let mut in_label_list = 0;
    while i < b.len() {
        let c = b[i];
        if c == '"' || c == '\'' || c == '`' {
            i += 1;
            while i < b.len() && b[i] != c {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        if c == '$' {
            i += 1;
            while i < b.len() && (b[i].is_alphanumeric() || "_{}".contains(b[i])) {
                i += 1;
            }
            continue;
        }
        match c {
            '{' => brace += 1,
            '}' => brace -= 1,
            '[' => bracket += 1,
            ']' => bracket -= 1,
            '(' if label_list => {
                in_label_list += 1;
                label_list = false;
            }
            ')' if in_label_list > 0 => in_label_list -= 1,
            _ => {}
        }
        if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '_' || b[i] == ':') {
                i += 1;
            }
            let word: String = b[start..i].iter().collect();
            let mut j = i;
            while j < b.len() && b[j] == ' ' {
                j += 1;
            }
            let call = j < b.len() && b[j] == '(';
            let lower = word.to_ascii_lowercase();
            if [
                "by",
                "without",
                "on",
                "ignoring",
                "group_left",
                "group_right",
            ]
            .contains(&lower.as_str())
            {
                label_list = true;
            } else if brace == 0
                && bracket == 0
                && in_label_list == 0
                && !call
                && !PROMQL_WORDS.contains(&lower.as_str())
            {
                names.insert(word);
            }
            continue;
        }
        i += 1;
    }
    names
}

#[test]
fn promql_names_finds_metrics_only() {
    let n = promql_names(
        r#"histogram_quantile(0.99, sum by (instance, le) (rate(grl_x_bucket{service=~"$service", a="b c"}[5m]))) / on (service) group_left() grl:y:rate5m > 0.01 and time() - max(rlc_z) > 26 * 3600"#,
    );
    let want: BTreeSet<String> = ["grl_x_bucket", "grl:y:rate5m", "rlc_z"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(n, want);
}

struct Rules {
    records: BTreeSet<String>,
    /// (file, rule name, expr)
    exprs: Vec<(PathBuf, String, String)>,
}

fn rules() -> Rules {
    let mut r = Rules {
        records: BTreeSet::new(),
        exprs: Vec::new(),
    };
    for f in files("prometheus", "yml")
        .into_iter()
        .filter(|f| !f.to_string_lossy().ends_with("_test.yml"))
    {
        let doc: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        for g in doc["groups"].as_sequence().unwrap() {
            for rule in g["rules"].as_sequence().unwrap() {
                let expr = rule["expr"].as_str().unwrap().to_string();
                if let Some(rec) = rule["record"].as_str() {
                    r.records.insert(rec.to_string());
                    r.exprs.push((f.clone(), rec.to_string(), expr));
                } else {
                    let name = rule["alert"].as_str().unwrap().to_string();
                    r.exprs.push((f.clone(), name, expr));
                }
            }
        }
    }
    r
}

/// Every PromQL expression of every dashboard, with where it is (file, panel title).
fn dashboard_exprs() -> Vec<(PathBuf, String, String)> {
    let mut out = Vec::new();
    for f in files("grafana", "json") {
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        let what = f.display().to_string();
        assert!(d["schemaVersion"].as_u64().unwrap() >= 36, "{what}");
        assert!(d["uid"].as_str().is_some_and(|u| !u.is_empty()), "{what}");
        assert!(d["title"].as_str().is_some_and(|u| !u.is_empty()), "{what}");
        let vars = d["templating"]["list"].as_array().unwrap();
        assert!(
            vars.iter().any(|v| v["type"] == "datasource"
                && v["query"] == "prometheus"
                && v["name"] == "datasource"),
            "{what}: no Prometheus data source variable"
        );
        for v in vars.iter().filter(|v| v["type"] == "query") {
            out.push((
                f.clone(),
                format!("variable {}", v["name"]),
                v["definition"].as_str().unwrap().to_string(),
            ));
        }
        let panels = d["panels"].as_array().unwrap();
        let mut with_targets = 0;
        let mut ids = BTreeSet::new();
        for p in panels {
            assert!(
                ids.insert(p["id"].as_u64().unwrap()),
                "{what}: duplicate panel id"
            );
            assert!(p["gridPos"]["w"].as_u64().unwrap() <= 24, "{what}");
            if p["type"] == "row" {
                continue;
            }
            assert_eq!(
                p["datasource"]["uid"], "${datasource}",
                "{what}: {}",
                p["title"]
            );
            let targets = p["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{what}: {} has no target", p["title"]);
            with_targets += 1;
            for t in targets {
                out.push((
                    f.clone(),
                    p["title"].as_str().unwrap().to_string(),
                    t["expr"].as_str().unwrap().to_string(),
                ));
            }
        }
        assert!(with_targets >= 6, "{what}: {with_targets} panels");
    }
    out
}

fn unknown_names(exprs: &[(PathBuf, String, String)], known: &BTreeSet<String>) -> Vec<String> {
    let mut bad = Vec::new();
    for (f, what, expr) in exprs {
        // `label_values(metric, label)`: the first argument is a selector.
        let expr = expr
            .strip_prefix("label_values(")
            .map(|r| r.rsplit_once(',').map_or(r, |(sel, _)| sel))
            .unwrap_or(expr);
        for n in promql_names(expr) {
            if !known.contains(&n) {
                bad.push(format!("{}: {what}: `{n}` in {expr}", f.display()));
            }
        }
    }
    bad
}

fn write_raw(port: u16, req: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf
}

/// The names that real processes export, then every dashboard and rule expression against
/// them (and against the recording rules' names).
#[test]
fn dashboards_and_rules_use_only_exported_metrics() {
    let d = Deployment::new();
    let _controller = start_controller(d.controller_port, &d.dir.path().join("grl-state"));
    let rport = free_port();
    let _serve = Proc::spawn(
        d.rlc(&[
            "serve",
            "--poll-secs",
            "1",
            "--listen",
            &format!("127.0.0.1:{rport}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null()),
    )
    .unwrap();
    // A manual run, so that the per-status counter and the duration histograms have data.
    wait_until(Duration::from_secs(60), || {
        post(rport, "/v1/runs", "rlc-e2e-token") == Some(202)
    });
    wait_until(Duration::from_secs(120), || {
        get_text(rport, "/metrics").is_some_and(|m| {
            m.contains("rlc_runs_total{status=")
                && m.contains("rlc_config_version_info{version=")
                && m.contains("rlc_controller_in_sync 1")
        })
    });

    let aport = free_port();
    let creds = d.dir.path().join("client-credentials");
    std::fs::write(&creds, "payments payments payments-client-0123456789\n").unwrap();
    let _agg = Proc::spawn(
        Command::new(bin("grl"))
            .args(["aggregator", "--listen", &format!("127.0.0.1:{aport}")])
            .args([
                "--controller",
                &format!("http://127.0.0.1:{}", d.controller_port),
            ])
            .args(["--zone", "z1", "--region", "r1", "--tick-ms", "200"])
            .arg("--client-credentials")
            .arg(&creds)
            .env("GRL_REPORT_TOKEN", "e2e-zone-report-token")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .unwrap();
    wait_until(Duration::from_secs(20), || {
        get_text(aport, "/metrics").is_some()
    });
    // A report without a credential: refused and counted (the refusal family appears).
    let r = write_raw(
        aport,
        "POST /v1/report HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    );
    assert!(
        r.starts_with("HTTP/1.1 401") || r.starts_with("HTTP/1.0 401"),
        "{r}"
    );

    // An embedded client: the registry its service serves.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client_text = {
        let _g = rt.enter();
        let mut o = grl_runtime::client::ClientOptions::new(
            "payments",
            vec![format!("http://127.0.0.1:{aport}")],
        );
        o.report_token = Some("payments-client-0123456789".into());
        let c = grl_runtime::client::GrlClient::start(o);
        wait_until(Duration::from_secs(20), || {
            c.stats()
                .directives_from_ms
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0
        });
        grl_runtime::metrics::encode(&c.registry())
    };

    let mut exported = BTreeSet::new();
    for (what, text) in [
        (
            "controller",
            get_text(d.controller_port, "/metrics").unwrap(),
        ),
        ("aggregator", get_text(aport, "/metrics").unwrap()),
        ("rlc serve", get_text(rport, "/metrics").unwrap()),
        ("client", client_text),
    ] {
        assert!(text.ends_with("# EOF\n"), "{what}: {text}");
        exported_names(&text, &mut exported);
    }
    for must in [
        "grl_requests_offered_total",
        "grl_bucket_info",
        "grl_reports_refused_total",
        "grl_aggregator_forward_duration_seconds_bucket",
        "grl_client_failing_open",
        "grl_client_directives_age_seconds",
        "rlc_runs_total",
        "rlc_history_pull_duration_seconds_count",
        "rlc_last_successful_run_timestamp_seconds",
        "rlc_build_info",
        "grl_build_info",
    ] {
        assert!(exported.contains(must), "{must} not exported: {exported:?}");
    }

    let rules = rules();
    let mut known = exported.clone();
    known.extend(rules.records.iter().cloned());
    let mut bad = unknown_names(&rules.exprs, &known);
    // Recording rules read exported series only, never another recording's name before it
    // is defined: checked by promtool; here only the names.
    bad.extend(unknown_names(&dashboard_exprs(), &known));
    assert!(bad.is_empty(), "names nobody exports:\n{}", bad.join("\n"));
    // And the check is not vacuous: a name that is not exported is caught.
    let fake = vec![(
        PathBuf::from("x"),
        "x".to_string(),
        "rate(grl_requests_offerred_total[5m])".to_string(),
    )];
    assert_eq!(unknown_names(&fake, &known).len(), 1);
}

#[test]
fn prometheus_rules_pass_promtool_check_and_their_unit_tests() {
    let dir = deploy_dir().join("prometheus");
    let rules: Vec<PathBuf> = files("prometheus", "yml")
        .into_iter()
        .filter(|f| !f.to_string_lossy().ends_with("_test.yml"))
        .collect();
    let out = Command::new(promtool())
        .arg("check")
        .arg("rules")
        .args(&rules)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("SUCCESS"), "{text}");
    let tests = files("prometheus", "yml")
        .into_iter()
        .filter(|f| f.to_string_lossy().ends_with("_test.yml"))
        .collect::<Vec<_>>();
    assert!(!tests.is_empty());
    let out = Command::new(promtool())
        .current_dir(&dir)
        .arg("test")
        .arg("rules")
        .args(&tests)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    // Every alert has a unit test that fires it.
    let tested = std::fs::read_to_string(&tests[0]).unwrap();
    for (_, name, _) in self::rules()
        .exprs
        .iter()
        .filter(|(_, n, _)| !n.contains(':'))
    {
        assert!(
            tested.contains(&format!("alertname: {name}")),
            "alert {name} has no promtool test"
        );
    }
}
