//! `rlc preview` and `rlc backtest` as a user runs them: paths relative to rlc.yaml.

use std::process::Command;

use chrono::Utc;

fn setup(history: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("repo/rlc")).unwrap();
    std::fs::create_dir_all(d.join("repo/buckets")).unwrap();
    std::fs::write(
        d.join("repo/rlc/policies.yaml"),
        "default:\n  policy: peak\nservices:\n  search:\n    policy: forecast\n",
    )
    .unwrap();
    std::fs::write(
        d.join("repo/buckets/maps.yaml"),
        "service: maps\nbuckets:\n  - name: web.route\n    caller: web\n    procedure: route\n    limit_rps: 5000\n    policy: peak\n",
    )
    .unwrap();
    std::fs::write(
        d.join("rlc.yaml"),
        format!("history:\n{history}\nconfig_repo:\n  path: repo\n"),
    )
    .unwrap();
    rlc::history::synth::generate(&d.join("h.csv"), 1, Utc::now(), 28, 60).unwrap();
    // A git working copy, as `rlc run` keeps it: preview asks its history whether a decrease
    // must wait (no commit lowered anything here).
    let repo = d.join("repo");
    for args in [
        &["init", "-q", "-b", "main"][..],
        &["add", "-A"],
        &["commit", "-q", "-m", "seed"],
    ] {
        test_support::git::git(&repo, args).unwrap();
    }
    dir
}

fn rlc(dir: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    // Run from elsewhere: paths must resolve against rlc.yaml's directory.
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(args)
        .arg("--config")
        .arg(dir.join("rlc.yaml"))
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn preview_json_and_table() {
    let dir = setup("  file: h.csv");
    let (code, out, err) = rlc(dir.path(), &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
    let buckets = plan["buckets"].as_array().unwrap();
    assert_eq!(buckets.len(), 8);
    let web = buckets
        .iter()
        .find(|b| b["service"] == "maps" && b["name"] == "web.route")
        .unwrap();
    for k in [
        "service",
        "name",
        "caller",
        "procedure",
        "scope",
        "limit_rps",
        "mode",
        "policy",
        "current_limit_rps",
        "evidence",
        // The bucket as GET /v1/quotas/{service} serves it.
        "change",
        "confidence",
        "rail",
        "mode_change",
        "details",
    ] {
        assert!(web.get(k).is_some(), "missing {k} in {web}");
    }
    assert_eq!(web["change"]["kind"], "lowered", "{web}");
    assert!(
        web["rail"].as_str().is_some(),
        "the 25 % cap is the rail: {web}"
    );
    // 5000 → ≈ 1500: the decrease is capped at 25% per run.
    assert_eq!(web["limit_rps"], 3750.0);
    assert_eq!(web["current_limit_rps"], 5000.0);
    assert_eq!(web["mode"], "enforce");

    let (code, out, _) = rlc(dir.path(), &["preview", "--service", "maps"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("SERVICE"), "{out}");
    assert!(
        out.contains("web.route") && out.contains("-25.0%") && !out.contains("search"),
        "{out}"
    );

    // Without the config repo's history the run would hold the decrease (fail safe): so
    // does the preview, keeping the current limit and saying why.
    std::fs::remove_dir_all(dir.path().join("repo/.git")).unwrap();
    let (code, out, err) = rlc(dir.path(), &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
    let web = plan["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["service"] == "maps" && b["name"] == "web.route")
        .unwrap()
        .clone();
    assert_eq!(web["limit_rps"], 5000.0, "{web}");
    assert_eq!(web["held"]["proposed_limit_rps"], 3750.0, "{web}");
    let reason = web["held"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("not a git repository") && reason.contains("decrease held"),
        "{reason}"
    );
    let (_, out, _) = rlc(dir.path(), &["preview", "--service", "maps"]);
    assert!(out.contains("held (-25.0%)"), "{out}");
    assert!(
        !dir.path().join("rlc.db").exists(),
        "preview created no store"
    );
}

#[test]
fn preview_with_prometheus_down_keeps_quotas_and_fails() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = setup(&format!(
        "  prometheus:\n    url: http://127.0.0.1:{port}\n    query: up\n    retries: 2"
    ));
    let (code, out, err) = rlc(dir.path(), &["preview", "--format", "json"]);
    assert_eq!(code, 1, "{err}");
    let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(plan["buckets"][0]["limit_rps"], 5000.0);
    let reason = plan["skipped"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("history source failed") && reason.contains(&port.to_string()),
        "{reason}"
    );
}

#[test]
fn backtest_side_by_side() {
    let dir = setup("  file: h.csv");
    let (code, out, err) = rlc(
        dir.path(),
        &["backtest", "--holdout", "7d", "--format", "json"],
    );
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    let totals = r["totals"].as_array().unwrap();
    assert_eq!(totals.len(), 2);
    assert_eq!(
        (totals[0]["policy"].as_str(), totals[1]["policy"].as_str()),
        (Some("peak"), Some("forecast"))
    );
    assert_eq!(totals[0]["buckets"], 8);
    // Quickstart traffic grows ≤ 2%/day: both stay within 1.5× the real peak, forecast throttles no more.
    for t in totals {
        assert!(t["mean_slack"].as_f64().unwrap() < 1.5, "{t}");
    }
    assert!(
        totals[1]["throttled_fraction"].as_f64() <= totals[0]["throttled_fraction"].as_f64(),
        "{totals:?}"
    );
}

/// `headroom: auto` in policies.yaml: every computed bucket says how its margin was chosen, and
/// the limit is its level × (1 + that margin).
#[test]
fn preview_shows_how_auto_chose_each_margin() {
    let dir = setup("  file: h.csv");
    std::fs::write(
        dir.path().join("repo/rlc/policies.yaml"),
        "default:\n  policy: peak\n  headroom: auto\n",
    )
    .unwrap();
    let repo = dir.path().join("repo");
    test_support::git::git(&repo, &["commit", "-q", "-am", "auto"]).unwrap();
    let (code, out, err) = rlc(dir.path(), &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
    let buckets = plan["buckets"].as_array().unwrap();
    assert_eq!(buckets.len(), 8, "{out}");
    for b in buckets {
        let p = &b["evidence"]["policy"];
        let a = &p["headroom_auto"];
        let chosen = a["chosen"].as_f64().unwrap_or_else(|| panic!("{b}"));
        assert!((0.03..=1.0).contains(&chosen), "{a}");
        assert_eq!(p["headroom"].as_f64(), Some(chosen), "{p}");
        assert_eq!(a["origins"], 14, "28 days of history: {a}");
        assert_eq!(a["surprises"].as_array().unwrap().len(), 14, "{a}");
        assert!(a["replayed_throttled"].as_f64().unwrap() <= 0.0001, "{a}");
        let why = b["evidence"]["explain"].as_str().unwrap();
        assert!(
            why.contains(&format!("; margin auto {chosen:.2} (14 origins replayed")),
            "{why}"
        );
        // What the policy proposed, before the rails (a decrease is capped per run).
        let level = p["value_rps"].as_f64().unwrap();
        let proposed = b["evidence"]["proposed_rps"].as_f64().unwrap();
        assert!(
            (proposed / (level * (1.0 + chosen)) - 1.0).abs() < 0.01,
            "{b}"
        );
        // Shown as 0, not -0: an empty sum is -0 in Rust.
        let shares = [&a["replayed_throttled"], &a["tail_throttled"]];
        for v in shares.into_iter().filter_map(|v| v.as_f64()) {
            assert!(v.is_sign_positive(), "{a}");
        }
    }
}

/// `--headroom auto,0.25`: each policy at each margin, the margin each bucket used beside its
/// score; `auto` ends up with less slack than the fixed 25 % and stays within its bounds.
#[test]
fn backtest_compares_margins() {
    let dir = setup("  file: h.csv");
    let (code, out, err) = rlc(
        dir.path(),
        &[
            "backtest",
            "--policy",
            "peak",
            "--headroom",
            "auto,0.25",
            "--format",
            "json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    let totals = r["totals"].as_array().unwrap();
    let asked: Vec<&str> = totals
        .iter()
        .map(|t| t["headroom"].as_str().unwrap())
        .collect();
    assert_eq!(asked, ["auto", "0.25"]);
    assert_eq!(totals[0]["buckets"], totals[1]["buckets"]);
    assert!(
        totals[0]["median_slack"].as_f64() < totals[1]["median_slack"].as_f64(),
        "{totals:?}"
    );
    for b in r["buckets"].as_array().unwrap() {
        let m = b["margin"].as_f64().unwrap();
        match b["headroom"].as_str().unwrap() {
            "auto" => assert!((0.03..=1.0).contains(&m), "{b}"),
            _ => assert_eq!(m, 0.25, "{b}"),
        }
    }
    // The table ends each line with the margin used and the one asked.
    let (code, out, err) = rlc(
        dir.path(),
        &["backtest", "--policy", "peak", "--headroom", "auto"],
    );
    assert_eq!(code, 0, "{err}");
    let header = out.lines().next().unwrap();
    assert!(header.ends_with("SLACK MARGIN ASKED"), "{out}");
    assert!(out.contains("peak      at auto: throttled"), "{out}");
    // A margin that is not one is refused by name.
    let (code, _, err) = rlc(dir.path(), &["backtest", "--headroom", "lots"]);
    assert_eq!(code, 64, "usage error: {err}");
    assert!(err.contains("`lots` is not a margin"), "{err}");
}

#[test]
fn preview_with_a_relative_config_path() {
    // `rlc preview --config deploy/rlc.yaml` from deploy's parent: relative paths in rlc.yaml
    // must resolve once, against deploy/, not twice.
    let dir = setup("  file: h.csv");
    let parent = dir.path().parent().unwrap();
    let name = dir.path().file_name().unwrap().to_str().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args([
            "preview",
            "--format",
            "json",
            "--config",
            &format!("{name}/rlc.yaml"),
        ])
        .current_dir(parent)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(plan["skipped"].as_array().unwrap().len(), 0, "{stdout}");
    assert_eq!(plan["buckets"].as_array().unwrap().len(), 8);
}

#[test]
fn preview_json_has_null_caller_and_procedure_and_skips_bad_labels() {
    let dir = setup("  file: h.csv");
    // A procedure-only series, and one whose service cannot name a file.
    let mut csv = std::fs::read_to_string(dir.path().join("h.csv")).unwrap();
    let last_ts = csv
        .lines()
        .last()
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .to_string();
    csv.push_str(&format!(
        "{last_ts},maps,,tiles,5\n{last_ts},team/svc,web,x,5\n"
    ));
    std::fs::write(dir.path().join("h.csv"), csv).unwrap();
    let (code, out, err) = rlc(dir.path(), &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
    let tiles = plan["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == "tiles")
        .expect("procedure-only bucket");
    assert!(tiles.get("caller").is_some_and(|c| c.is_null()), "{tiles}");
    assert_eq!(tiles["procedure"], "tiles");
    let skipped = plan["skipped"].as_array().unwrap();
    assert!(
        skipped.iter().any(|s| s["service"] == "team/svc"
            && s["reason"].as_str().unwrap().contains("not a valid name")),
        "{skipped:?}"
    );
}

/// `rlc preview` with plugins run by the `rlc` binary itself (no `plugins.host`: the default
/// host is the running binary): a segfaulting plugin and one answering 1e308 fail only their
/// buckets, which keep their current limit; the command succeeds and the rest is computed.
#[test]
fn preview_survives_a_segfaulting_plugin_and_refuses_1e308() {
    let dir = setup("  file: h.csv");
    let d = dir.path();
    let plugins = d.join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    for name in ["crashy", "absurd"] {
        std::fs::copy(
            test_support::plugin::example_plugin_lib(),
            plugins.join(format!(
                "{}{name}{}",
                std::env::consts::DLL_PREFIX,
                std::env::consts::DLL_SUFFIX
            )),
        )
        .unwrap();
    }
    std::fs::write(
        d.join("repo/rlc/policies.yaml"),
        "default:\n  policy: peak\nservices:\n  maps:\n    policy: plugin:crashy\n    params: {mode: segfault}\n  payments:\n    policy: plugin:absurd\n    params: {mode: huge}\n",
    )
    .unwrap();
    std::fs::write(
        d.join("repo/buckets/payments.yaml"),
        "service: payments\nbuckets:\n  - name: billing.charge\n    caller: billing\n    procedure: charge\n    limit_rps: 321\n    policy: peak\n",
    )
    .unwrap();
    // Committed, as a run reads the base branch's tip (uncommitted edits of the working copy
    // are not what the next run would use).
    for args in [&["add", "-A"][..], &["commit", "-q", "-m", "plugins"]] {
        test_support::git::git(&d.join("repo"), args).unwrap();
    }
    let yaml = std::fs::read_to_string(d.join("rlc.yaml")).unwrap();
    std::fs::write(
        d.join("rlc.yaml"),
        format!("{yaml}plugins:\n  dir: plugins\n"),
    )
    .unwrap();

    let (code, out, err) = rlc(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
    let buckets = plan["buckets"].as_array().unwrap();
    let find = |s: &str, n: &str| {
        buckets
            .iter()
            .find(|b| b["service"] == s && b["name"] == n)
            .unwrap_or_else(|| panic!("{s}/{n} missing: {out}"))
    };
    assert_eq!(find("maps", "web.route")["limit_rps"], 5000.0, "kept");
    assert_eq!(
        find("payments", "billing.charge")["limit_rps"],
        321.0,
        "kept"
    );
    assert_eq!(find("search", "web.query")["policy"], "peak", "computed");
    let skipped = plan["skipped"].as_array().unwrap();
    let reason = |s: &str, c: &str| {
        skipped
            .iter()
            .find(|k| k["service"] == s && k["caller"] == c)
            .and_then(|k| k["reason"].as_str())
            .unwrap_or_else(|| panic!("{s}/{c} not skipped: {skipped:?}"))
            .to_string()
    };
    let r = reason("maps", "web");
    assert!(
        r.contains("plugin:crashy") && r.contains("died with signal 11 (SIGSEGV)"),
        "{r}"
    );
    let r = reason("payments", "billing");
    assert!(
        r.contains("plugin:absurd") && r.contains("1e308") && r.contains("sanity bound"),
        "{r}"
    );
}

/// A push that fails says why in words ("connection refused", not reqwest's "error sending
/// request"), and a controller token file every user can read is warned about.
#[test]
fn a_failed_push_names_its_cause_and_a_world_readable_token_is_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let dir = setup("  file: h.csv");
    let d = dir.path();
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let yaml = std::fs::read_to_string(d.join("rlc.yaml")).unwrap();
    std::fs::write(
        d.join("rlc.yaml"),
        format!("{yaml}controller:\n  url: http://{dead}\n  token_file: rlc-token\n"),
    )
    .unwrap();
    std::fs::write(d.join("rlc-token"), "rlc-config-0123456789abcdef\n").unwrap();
    std::fs::set_permissions(d.join("rlc-token"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, out, err) = rlc(d, &["run", "--once", "--json"]);
    assert_eq!(code, 2, "{out}\n{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let push = v["push_error"].as_str().unwrap_or_default();
    assert!(push.contains("connection refused"), "{push}");
    assert!(
        err.contains("readable by every user") && err.contains("rlc-token"),
        "{err}"
    );
    // chmod 600: no warning.
    std::fs::set_permissions(d.join("rlc-token"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let (_, _, err) = rlc(d, &["run", "--once", "--json"]);
    assert!(!err.contains("readable by every user"), "{err}");
}

/// `rlc openapi | head -1`: the reader goes away; rlc leaves quietly (no panic, no backtrace),
/// with status 141 as a command killed by SIGPIPE would.
#[test]
fn a_closed_pipe_ends_a_command_quietly() {
    use std::io::Read;
    let mut child = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .arg("openapi")
        .env("RUST_BACKTRACE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    // The read end is dropped here.
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
    assert_eq!(out.status.code(), Some(141), "{err}");
}

/// `RUST_LOG=info rlc run --once` tells what each phase did: the history pull (series,
/// seconds), the evidence, the plan, the outcome; fields print as text, not Rust `Debug`.
#[test]
fn info_logs_tell_the_phases_of_a_run() {
    let dir = setup("  file: h.csv");
    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(["run", "--once", "--config"])
        .arg(dir.path().join("rlc.yaml"))
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    for phase in [
        "config repo synced",
        "evidence gathered",
        "history pulled",
        "plan computed",
        "run finished",
    ] {
        assert!(err.contains(phase), "no `{phase}` in:\n{err}");
    }
    assert!(err.contains("series=8"), "{err}");
    // The pull's line: kind, API, series, points, bytes, seconds, as text.
    let pulled = err
        .lines()
        .find(|l| l.contains("history pulled"))
        .unwrap_or_else(|| panic!("{err}"));
    let bytes = std::fs::metadata(dir.path().join("h.csv")).unwrap().len();
    for field in [
        "kind=full".to_string(),
        "api=file".into(),
        "series=8".into(),
        format!("bytes={bytes} "),
        "seconds=".into(),
    ] {
        assert!(pulled.contains(&field), "{field} in {pulled}");
    }
    let points: u64 = pulled
        .split_whitespace()
        .find_map(|w| w.strip_prefix("points="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("points in {pulled}"));
    assert!(points >= 8, "{pulled}");
    assert!(!err.contains("=None") && !err.contains("=Some("), "{err}");
}

/// `rlc preview --format markdown` prints the pull request's body: title, the per-service
/// table, the why of each limit.
#[test]
fn preview_markdown_is_the_pull_request_body() {
    let dir = setup("  file: h.csv");
    let (code, out, err) = rlc(dir.path(), &["preview", "--format", "markdown"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("## "), "{out}");
    assert!(out.contains("Generated by rlc"), "{out}");
    assert!(
        out.contains("| bucket | current | proposed | change % | observed peak | policy | confidence | why |"),
        "{out}"
    );
    assert!(out.contains("### maps"), "{out}");
}

/// A contract for a caller the traffic never shows (a typo, a partner not live yet) is
/// flagged: in the limit's why and evidence (preview, pull request body) and by
/// `rlc validate --history`; a contract whose caller sends traffic is not.
#[test]
fn contracts_without_traffic_are_flagged() {
    let dir = setup("  file: h.csv");
    let d = dir.path();
    std::fs::write(
        d.join("repo/rlc/contracts.yaml"),
        "contracts:\n  - service: maps\n    caller: partner-x\n    procedure: geocode\n    limit_rps: 40\n    reference: MSA-1\n  - service: maps\n    caller: partner-y\n    procedure: geocode\n    limit_rps: 30\n    reference: MSA-2\n",
    )
    .unwrap();
    for args in [&["add", "-A"][..], &["commit", "-q", "-m", "contracts"]] {
        test_support::git::git(&d.join("repo"), args).unwrap();
    }
    let (code, out, err) = rlc(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let bucket = |caller: &str| {
        v["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["caller"] == caller && b["service"] == "maps")
            .cloned()
            .unwrap_or_else(|| panic!("{caller} in {v}"))
    };
    let y = bucket("partner-y");
    assert!(
        y["evidence"]["no_traffic"]
            .as_str()
            .unwrap()
            .contains("partner-y"),
        "{y}"
    );
    assert!(
        y["evidence"]["explain"]
            .as_str()
            .unwrap()
            .contains("no traffic from caller partner-y"),
        "{y}"
    );
    assert!(bucket("partner-x")["evidence"].get("no_traffic").is_none());
    let (_, md, _) = rlc(d, &["preview", "--format", "markdown"]);
    assert!(md.contains("no traffic from caller partner-y"), "{md}");

    let out = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(["validate", "repo", "--history", "--config", "rlc.yaml"])
        .current_dir(d)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let flagged: Vec<&str> = text.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(flagged.len(), 1, "{text}");
    assert!(
        flagged[0].contains("contracts.yaml: contracts[1]") && flagged[0].contains("partner-y"),
        "{text}"
    );
}

/// While a lowered limit bakes as a candidate (10000 → the base branch's 5000), the
/// controllers enforce 10000: `rlc preview` says so in the table's CURRENT, in
/// `current_limit_rps`, and shows the candidate with its stage and bake progress.
#[test]
fn preview_shows_a_baking_candidate_beside_the_limit_in_force() {
    let dir = setup("  file: h.csv");
    let d = dir.path();
    let text = std::fs::read_to_string(d.join("repo/buckets/maps.yaml")).unwrap();
    let file: schema::BucketFile = schema::parse_str(std::path::Path::new("maps.yaml"), &text)
        .unwrap()
        .value;
    let new = file.buckets[0].clone();
    let mut old = new.clone();
    old.limit_rps = 10000.0;
    let now_ms = Utc::now().timestamp_millis();
    let r = rlc::rollout::Rollout {
        id: "rlc-web-route".into(),
        service: "maps".into(),
        bucket: "web.route".into(),
        old: Some(old),
        new,
        change: "lowered 10000 -> 5000 rps".into(),
        version: "abc".into(),
        settings: schema::RolloutSpec::default().resolved(),
        stages: vec![vec!["eu".into()], vec!["us".into()]],
        stage: 1,
        stage_started_ms: Some(now_ms - 15 * 60_000),
        stage_began_ms: Some(now_ms - 15 * 60_000),
        state: rlc::rollout::RolloutState::Baking,
        reason: None,
        fingerprint: "fp".into(),
        created_ms: now_ms - 90 * 60_000,
        updated_ms: now_ms - 15 * 60_000,
        figures: Default::default(),
        revert: None,
        revert_pending: false,
        settled: false,
        fleet: None,
        rev: None,
    };
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = rlc::store::Store::connect("sqlite://rlc.db", d)
            .await
            .unwrap();
        assert!(store.insert_rollout(&r.row()).await.unwrap());
    });

    let (code, out, err) = rlc(d, &["preview", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
    let web = plan["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["service"] == "maps" && b["name"] == "web.route")
        .unwrap();
    assert_eq!(web["current_limit_rps"], 10000.0, "{web}");
    assert_eq!(web["candidate"]["limit_rps"], 5000.0, "{web}");
    assert_eq!(web["candidate"]["stage"], 2, "{web}");
    assert_eq!(
        web["candidate"]["in_force_regions"],
        serde_json::json!(["eu"])
    );
    let p = web["candidate"]["bake_progress"].as_f64().unwrap();
    assert!((p - 0.25).abs() < 0.02, "{web}");
    // Another bucket keeps the base branch's value and gets no candidate.
    assert!(plan["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["name"] != "web.route")
        .all(|b| b.get("candidate").is_none()));

    let (code, out, _) = rlc(d, &["preview", "--service", "maps"]);
    assert_eq!(code, 0);
    let row = out.lines().find(|l| l.contains("web.route")).unwrap();
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[2], "10000", "CURRENT is the limit in force: {out}");
    assert!(
        out.contains("maps/web.route: candidate 5000 rps enforce, baking in region us (stage 2 of 2), 25% of the 3600s bake; in force: 10000 rps"),
        "{out}"
    );
}
