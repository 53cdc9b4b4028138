//! `deploy/`: the Grafana dashboards and the Prometheus rules read only metrics the project
//! exports (collected from `/metrics` of a real controller, aggregator, `grl sidecar` and
//! `rlc serve`, and from an embedded client's registry), the dashboards are Grafana dashboard
//! JSON, and the rules pass `promtool check rules` and their `promtool test rules` unit tests.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use test_support::process::{free_port, Proc};

use test_support::prometheus::Prometheus;

use super::bin;
use super::fleet::Fleet;
use super::{get_text, post, start_controller, wait_until, Deployment};

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

/// Grafana's built-in variables (`$__rate_interval`, …), replaced by a value of their kind.
fn grafana_builtin(name: &str) -> Option<&'static str> {
    Some(match name {
        "__rate_interval" | "__interval" | "__range" | "__auto" => "5m",
        "__interval_ms" | "__range_ms" => "300000",
        "__range_s" => "300",
        _ => return None,
    })
}

/// The names of the variables `text` references: `$x`, `${x}`, `${x:format}`, `[[x]]`.
fn variable_refs(text: &str) -> Vec<(std::ops::Range<usize>, String)> {
    let b = text.as_bytes();
    let ident = |i: usize| {
        let mut j = i;
        while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_') {
            j += 1;
        }
        j
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'$' && i + 1 < b.len() && b[i + 1] == b'{' {
            let end = ident(i + 2);
            let close = text[end..].find('}').map(|k| end + k);
            if let Some(close) = close.filter(|_| end > i + 2) {
                out.push((i..close + 1, text[i + 2..end].to_string()));
                i = close + 1;
                continue;
            }
        } else if b[i] == b'$' {
            let end = ident(i + 1);
            if end > i + 1 {
                out.push((i..end, text[i + 1..end].to_string()));
                i = end;
                continue;
            }
        } else if b[i..].starts_with(b"[[") {
            let end = ident(i + 2);
            if end > i + 2 && b[end..].starts_with(b"]]") {
                out.push((i..end + 2, text[i + 2..end].to_string()));
                i = end + 2;
                continue;
            }
        }
        i += 1;
    }
    out
}

#[test]
fn variable_refs_finds_every_syntax() {
    let r: Vec<String> = variable_refs(
        r#"rate(x{a=~"$service", b="${bucket:regex}", c="[[zone]]"}[$__rate_interval]) > 0.5$"#,
    )
    .into_iter()
    .map(|(_, n)| n)
    .collect();
    assert_eq!(r, ["service", "bucket", "zone", "__rate_interval"]);
}

/// `text` with every variable replaced by its value in `values` or a built-in's; an error
/// naming the variables that are neither.
fn substitute(text: &str, values: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut last = 0;
    let mut unknown = Vec::new();
    for (range, name) in variable_refs(text) {
        out.push_str(&text[last..range.start]);
        match values
            .get(&name)
            .map(String::as_str)
            .or(grafana_builtin(&name))
        {
            Some(v) => out.push_str(v),
            None => unknown.push(name),
        }
        last = range.end;
    }
    out.push_str(&text[last..]);
    if unknown.is_empty() {
        Ok(out)
    } else {
        Err(format!("undefined variable(s) {unknown:?} in {text}"))
    }
}

/// One dashboard: its file, its variables (name → type, in order) and its expressions.
struct Dashboard {
    file: PathBuf,
    /// (name, type, `label_values(…)` definition of a query variable).
    variables: Vec<(String, String, Option<String>)>,
    /// (panel title, expression).
    exprs: Vec<(String, String)>,
}

/// Every string in `v` with its JSON path.
fn strings_in(v: &serde_json::Value, path: &str, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::String(s) => out.push((path.to_string(), s.clone())),
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                strings_in(x, &format!("{path}[{i}]"), out);
            }
        }
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                strings_in(x, &format!("{path}.{k}"), out);
            }
        }
        _ => {}
    }
}

/// The panels of a dashboard, those nested in (collapsed) rows included.
fn all_panels(panels: &[serde_json::Value]) -> Vec<&serde_json::Value> {
    let mut out = Vec::new();
    for p in panels {
        out.push(p);
        if let Some(inner) = p["panels"].as_array() {
            out.extend(all_panels(inner));
        }
    }
    out
}

/// Reads and checks the structure of every dashboard of deploy/grafana: Grafana's JSON
/// model (uid, title, schema version), panels with unique ids and a full grid position
/// inside the 24 columns, every data source reference (panel, target, variable) a
/// Prometheus one naming a declared data source variable, every target with a unique
/// `refId` and an expression, and every variable referenced anywhere declared (or one of
/// Grafana's built-ins).
fn dashboards() -> Vec<Dashboard> {
    let mut out = Vec::new();
    for f in files("grafana", "json") {
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        let what = f.display().to_string();
        assert!(d["schemaVersion"].as_u64().unwrap() >= 36, "{what}");
        assert!(d["uid"].as_str().is_some_and(|u| !u.is_empty()), "{what}");
        assert!(d["title"].as_str().is_some_and(|u| !u.is_empty()), "{what}");
        let vars = d["templating"]["list"].as_array().unwrap();
        let mut variables = Vec::new();
        for v in vars {
            let name = v["name"].as_str().unwrap().to_string();
            let kind = v["type"].as_str().unwrap().to_string();
            assert!(
                variables.iter().all(|(n, _, _)| *n != name),
                "{what}: variable {name} declared twice"
            );
            let def = (kind == "query").then(|| v["definition"].as_str().unwrap().to_string());
            variables.push((name, kind, def));
        }
        let datasources: BTreeSet<String> = vars
            .iter()
            .filter(|v| v["type"] == "datasource" && v["query"] == "prometheus")
            .map(|v| v["name"].as_str().unwrap().to_string())
            .collect();
        assert!(
            !datasources.is_empty(),
            "{what}: no Prometheus data source variable"
        );
        let check_ds = |ds: &serde_json::Value, where_: &str| {
            assert_eq!(ds["type"], "prometheus", "{what}: {where_}: {ds}");
            let uid = ds["uid"].as_str().unwrap_or_default();
            let refs = variable_refs(uid);
            assert!(
                refs.len() == 1
                    && refs[0].0 == (0..uid.len())
                    && datasources.contains(&refs[0].1),
                "{what}: {where_}: data source {ds} is not one of the declared data source variables {datasources:?}"
            );
        };
        for v in vars.iter().filter(|v| v["type"] == "query") {
            check_ds(&v["datasource"], &format!("variable {}", v["name"]));
        }
        let mut exprs = Vec::new();
        let mut ids = BTreeSet::new();
        let mut with_targets = 0;
        for p in all_panels(d["panels"].as_array().unwrap()) {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            assert!(
                ids.insert(p["id"].as_u64().expect("panel id")),
                "{what}: duplicate panel id {}",
                p["id"]
            );
            let g = &p["gridPos"];
            let [x, y, w, h] = ["x", "y", "w", "h"].map(|k| {
                g[k].as_u64()
                    .unwrap_or_else(|| panic!("{what}: {title}: gridPos.{k}"))
            });
            let _ = y;
            assert!(
                w > 0 && h > 0 && x + w <= 24,
                "{what}: {title}: gridPos {g}"
            );
            if p["type"] == "row" {
                continue;
            }
            check_ds(&p["datasource"], &title);
            let targets = p["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{what}: {title} has no target");
            with_targets += 1;
            let mut ref_ids = BTreeSet::new();
            for t in targets {
                if !t["datasource"].is_null() {
                    check_ds(&t["datasource"], &title);
                }
                let r = t["refId"].as_str().unwrap_or_default();
                assert!(
                    !r.is_empty() && ref_ids.insert(r.to_string()),
                    "{what}: {title}: target refId {r:?} missing or repeated"
                );
                exprs.push((title.clone(), t["expr"].as_str().unwrap().to_string()));
            }
        }
        assert!(with_targets >= 6, "{what}: {with_targets} panels");
        // Every variable referenced anywhere (expressions, titles, links) is declared.
        let declared: BTreeMap<String, String> = variables
            .iter()
            .map(|(n, _, _)| (n.clone(), String::new()))
            .collect();
        let mut all = Vec::new();
        strings_in(&d, "", &mut all);
        for (path, s) in all {
            if let Err(e) = substitute(&s, &declared) {
                panic!("{what}: {path}: {e}");
            }
        }
        out.push(Dashboard {
            file: f,
            variables,
            exprs,
        });
    }
    out
}

/// Every PromQL expression of every dashboard, with where it is (file, panel title or
/// variable).
fn dashboard_exprs() -> Vec<(PathBuf, String, String)> {
    let mut out = Vec::new();
    for d in dashboards() {
        for (name, _, def) in &d.variables {
            if let Some(def) = def {
                out.push((d.file.clone(), format!("variable {name}"), def.clone()));
            }
        }
        for (title, expr) in d.exprs {
            out.push((d.file.clone(), title, expr));
        }
    }
    out
}

/// `(selector, label)` of a `label_values(selector, label)` variable query.
fn label_values(def: &str) -> Option<(&str, &str)> {
    let inner = def
        .trim()
        .strip_prefix("label_values(")?
        .strip_suffix(')')?;
    let (sel, label) = inner.rsplit_once(',')?;
    Some((sel.trim(), label.trim()))
}

/// A Prometheus HTTP API call (form-encoded POST); its JSON answer, whatever the status.
fn prom_api(rt: &tokio::runtime::Runtime, url: &str, form: &[(&str, &str)]) -> serde_json::Value {
    rt.block_on(async {
        let r = reqwest::Client::new()
            .post(url)
            .form(form)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"));
        r.json::<serde_json::Value>()
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"))
    })
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

/// Real processes (controller, `rlc serve`, an aggregator and a service instance embedding
/// the client), scraped by a real Prometheus: every dashboard variable query finds series,
/// every dashboard and rule expression (variables replaced by what the variable queries
/// found) is accepted by Prometheus' query API, and every metric name they use is one the
/// processes export (or a recording rule's).
#[test]
fn dashboards_and_rules_use_only_exported_metrics() {
    let d = Deployment::new();
    let logs = d.dir.path();
    let _controller = start_controller(d.controller_port, &logs.join("grl-state"));
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

    // An aggregator and an instance of the example service (its client's series on its
    // own /metrics).
    let fleet = Fleet::start(d.controller_port, &["z1"], 1, logs);
    let aport = fleet.aggregator_ports[0];
    let service = fleet.service_urls[0]
        .trim_start_matches("http://")
        .to_string();
    let sport: u16 = service.rsplit_once(':').unwrap().1.parse().unwrap();
    // A report without a credential: refused and counted (the refusal family appears).
    let r = write_raw(
        aport,
        "POST /v1/report HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    );
    assert!(
        r.starts_with("HTTP/1.1 401") || r.starts_with("HTTP/1.0 401"),
        "{r}"
    );
    // The client has had drop ratios (their age is exported from then on).
    wait_until(Duration::from_secs(20), || {
        get_text(sport, "/metrics")
            .is_some_and(|m| m.contains("grl_client_directives_age_seconds{"))
    });

    // A sidecar before the service with --concurrency-limit (its overload series exist only
    // then), its /metrics on the admin port.
    let (side_port, side_admin) = (free_port(), free_port());
    let _sidecar = Proc::spawn(
        Command::new(bin("grl"))
            .args(["sidecar", "--listen", &format!("127.0.0.1:{side_port}")])
            .args(["--admin-listen", &format!("127.0.0.1:{side_admin}")])
            .args([
                "--upstream",
                &format!("http://{service}"),
                "--service",
                "payments",
            ])
            .args(["--aggregator", &format!("http://127.0.0.1:{aport}")])
            .args(["--concurrency-limit", "auto"])
            .env("GRL_CLIENT_TOKEN", super::fleet::CLIENT_SECRET)
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(logs.join("sidecar.log")).unwrap(),
            )),
    )
    .unwrap();
    wait_until(Duration::from_secs(30), || {
        get_text(side_admin, "/metrics").is_some_and(|m| m.contains("grl_sidecar_info{"))
    });

    let targets = [
        format!("127.0.0.1:{}", d.controller_port),
        format!("127.0.0.1:{rport}"),
        format!("127.0.0.1:{aport}"),
        service.clone(),
        format!("127.0.0.1:{side_admin}"),
    ];
    let mut exported = BTreeSet::new();
    for (what, port) in [
        ("controller", d.controller_port),
        ("rlc serve", rport),
        ("aggregator", aport),
        ("service", sport),
        ("sidecar", side_admin),
    ] {
        let text = get_text(port, "/metrics").unwrap();
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
        "grl_sidecar_overload_refusals_total",
        "grl_sidecar_concurrency_limit",
    ] {
        assert!(exported.contains(must), "{must} not exported: {exported:?}");
    }

    let rules = rules();
    let mut known = exported.clone();
    known.extend(rules.records.iter().cloned());
    // Series that exist only in states this test does not reach, each checked where it does:
    // `rlc_rollout_state` has a series per bucket with a rollout (tests/it/rollout.rs).
    known.insert("rlc_rollout_state".to_string());
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

    // A real Prometheus scraping the four processes every second.
    let prometheus = Prometheus::scraping(&targets, Duration::from_secs(1))
        .expect("prometheus (cargo xtask test installs it)");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let query = |q: &str| {
        prom_api(
            &rt,
            &format!("{}/api/v1/query", prometheus.url),
            &[("query", q)],
        )
    };
    wait_until(Duration::from_secs(60), || {
        query("count(up == 1)")["data"]["result"][0]["value"][1] == "5"
    });
    let mut failures = Vec::new();
    for dash in dashboards() {
        let what = dash.file.display().to_string();
        // The variables' values: each query variable's first value in the scraped data
        // (later variables' queries may use earlier ones).
        let mut values = BTreeMap::new();
        for (name, kind, def) in &dash.variables {
            let value = match def {
                None => kind.clone(),
                Some(def) => {
                    let def = substitute(def, &values).unwrap();
                    let (selector, label) = label_values(&def).unwrap_or_else(|| {
                        panic!(
                            "{what}: variable {name}: {def} is not label_values(selector, label)"
                        )
                    });
                    let v = prom_api(
                        &rt,
                        &format!("{}/api/v1/series", prometheus.url),
                        &[("match[]", selector)],
                    );
                    assert_eq!(
                        v["status"], "success",
                        "{what}: variable {name}: {def}: {v}"
                    );
                    let found = v["data"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .find_map(|s| s[label].as_str().map(str::to_string));
                    found.unwrap_or_else(|| {
                        panic!("{what}: variable {name}: {def} finds nothing in a real scrape: {v}")
                    })
                }
            };
            values.insert(name.clone(), value);
        }
        for (title, expr) in &dash.exprs {
            let q = substitute(expr, &values).unwrap();
            let v = query(&q);
            if v["status"] != "success" {
                failures.push(format!(
                    "{what}: {title}: {q}: {} {}",
                    v["errorType"], v["error"]
                ));
            }
        }
    }
    for (f, name, expr) in &rules.exprs {
        let v = query(expr);
        if v["status"] != "success" {
            failures.push(format!(
                "{}: {name}: {expr}: {} {}",
                f.display(),
                v["errorType"],
                v["error"]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "expressions Prometheus refuses:\n{}",
        failures.join("\n")
    );
    // Not vacuous: a malformed expression is refused as such.
    let v = query("sum by (service (grl_bucket_info)");
    assert_eq!(v["errorType"], "bad_data", "{v}");
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
