//! The README's Quick start, as a newcomer runs it: `rlc demo` in a directory outside the
//! source tree, then the README's next commands exactly as it writes them (parsed out of the
//! README, so the two cannot drift): `grl controller` from the demo's state in the background,
//! `rlc run --once`, `rlc serve`. And a second `rlc demo` keeps a file the user edited.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use test_support::process::{free_port, Proc};

use super::{bin, get, get_text, wait_until};

/// The documented addresses, replaced by free ports so that parallel tests cannot collide
/// (the demo is told the same ports with its `--controller-listen` and `--listen` flags).
const CONTROLLER_ADDR: &str = "127.0.0.1:7070";
const SERVE_ADDR: &str = "127.0.0.1:8080";

/// The commands of the README's Quick start section (every `sh` block up to the next `## `
/// heading: the demo, then the "After the demo" block), without `cargo xtask test`.
fn quick_start() -> Vec<String> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    let section = readme
        .split("\n## Quick start\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README has a Quick start");
    let commands: Vec<String> = section
        .split("```sh\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .flat_map(str::lines)
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with("cargo xtask"))
        .map(str::to_string)
        .collect();
    assert!(!commands.is_empty(), "Quick start has sh blocks");
    commands
}

/// A README command as a program and its arguments: `cargo run --release -p rlc --` is the
/// built `rlc`, `cargo run --release -p grl-runtime --` the built `grl`; a trailing `&` runs it
/// in the background.
fn argv(cmd: &str) -> (PathBuf, Vec<String>, bool) {
    let (cmd, background) = match cmd.strip_suffix('&') {
        Some(c) => (c.trim(), true),
        None => (cmd, false),
    };
    let (program, rest) = if let Some(r) = cmd.strip_prefix("cargo run --release -p rlc -- ") {
        (bin("rlc"), r)
    } else if let Some(r) = cmd.strip_prefix("cargo run --release -p grl-runtime -- ") {
        (bin("grl"), r)
    } else {
        panic!("a Quick start command this test does not know how to run: {cmd}");
    };
    (
        program,
        rest.split_whitespace().map(str::to_string).collect(),
        background,
    )
}

/// Runs `rlc demo` (with `extra` arguments) in `cwd`; its exit code and output.
fn demo(cwd: &Path, extra: &[String]) -> (Option<i32>, String) {
    let log = cwd.join(format!("demo-{}.log", free_port()));
    let mut p = Proc::spawn(
        Command::new(bin("rlc"))
            .arg("demo")
            .args(extra)
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::inherit()),
    )
    .unwrap();
    let status = p.wait_exit(Duration::from_secs(300));
    let out = std::fs::read_to_string(&log).unwrap();
    assert!(status.is_some(), "rlc demo still runs after 300 s:\n{out}");
    (status.unwrap().code(), out)
}

/// GET on loopback waiting up to 180 s for the answer; the body of a 200.
fn get_waiting(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(180))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    let (head, body) = buf.split_once("\r\n\r\n").unwrap();
    assert!(head.contains(" 200 "), "GET {path}: {head}");
    body.to_string()
}

fn limit(repo: &Path, rev: &str, service: &str, bucket: &str) -> f64 {
    let out = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["show", &format!("{rev}:buckets/{service}.yaml")])
        .output()
        .unwrap();
    assert!(out.status.success(), "git show {rev}");
    let file: schema::BucketFile = serde_yaml::from_slice(&out.stdout).unwrap();
    file.buckets
        .iter()
        .find(|b| b.name == bucket)
        .unwrap_or_else(|| panic!("{service}/{bucket} at {rev}"))
        .limit_rps
}

#[test]
fn the_readme_quick_start_runs_as_written() {
    let cmds = quick_start();
    assert_eq!(cmds.len(), 4, "{cmds:?}");
    assert_eq!(cmds[0], "cargo run --release -p rlc -- demo");
    let work = tempfile::tempdir().unwrap();
    let cwd = work.path();
    assert!(
        !cwd.starts_with(Path::new(env!("CARGO_MANIFEST_DIR")).join("..")),
        "outside the source tree"
    );
    let (cport, sport) = (free_port(), free_port());
    let (caddr, saddr) = (format!("127.0.0.1:{cport}"), format!("127.0.0.1:{sport}"));
    let ported = |c: &str| {
        c.replace(CONTROLLER_ADDR, &caddr)
            .replace(SERVE_ADDR, &saddr)
    };

    // 1. The demo.
    let (_, mut args, _) = argv(&cmds[0]);
    args.remove(0);
    args.extend([
        "--controller-listen".to_string(),
        caddr.clone(),
        "--listen".to_string(),
        saddr.clone(),
    ]);
    let (code, out) = demo(cwd, &args);
    assert_eq!(code, Some(0), "{out}");
    // It prints the README's next commands (not run through cargo here: bare names).
    for c in &cmds[1..] {
        let printed = ported(c)
            .replace("cargo run --release -p rlc -- ", "rlc ")
            .replace("cargo run --release -p grl-runtime -- ", "grl ");
        assert!(
            out.lines().any(|l| l.trim() == printed),
            "the demo does not print `{printed}`:\n{out}"
        );
    }
    let d = cwd.join("demo-out");
    for secret in ["grl-credentials", "rlc-token", "grl-client-credentials"] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.join(secret))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{secret}");
    }
    // The loop ran on the demo's traffic: payments/api-gateway.charge (the template's enforced
    // peak-policy bucket) and payments/api-gateway.refund (a shadow bucket) were offered 1.5×
    // their first limits. The enforced bucket refused the excess for seconds: refused minutes
    // are not demand, it keeps its limit and the demo says why. The shadow bucket refused
    // nothing: the second cycle raised it to the observed peak × 1.25 (headroom), at most
    // 1.5 × 1.25 times the first, and well above 1.25 (the controller counts a little less than
    // offered: the first tick's requests), unless the observed minute is a one-off spike over
    // the usual level at the hour the test runs (the demo's history has a daily shape), which
    // the policy leaves out and the demo names.
    let repo = d.join("config-repo");
    // The first run's commit (the second run may or may not commit).
    let run1 = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("git: committed "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("the first run committed\n{out}"))
        .to_string();
    let (first, learned) = (
        limit(&repo, &run1, "payments", "api-gateway.charge"),
        limit(&repo, "HEAD", "payments", "api-gateway.charge"),
    );
    assert_eq!(first, learned, "the enforced bucket kept its limit\n{out}");
    assert!(
        out.lines().any(|l| l.contains("why")
            && l.contains("api-gateway.charge")
            && l.contains("throttled minute")
            && l.contains("left out")),
        "the demo says why the enforced bucket kept its limit:\n{out}"
    );
    let (first, learned) = (
        limit(&repo, &run1, "payments", "api-gateway.refund"),
        limit(&repo, "HEAD", "payments", "api-gateway.refund"),
    );
    let ratio = learned / first;
    let spike_named = out.lines().any(|l| {
        l.contains("why")
            && l.contains("api-gateway.refund")
            && l.contains("spike")
            && l.contains("discounted")
    });
    assert!(
        (1.25..=1.875).contains(&ratio) || (ratio == 1.0 && spike_named),
        "{first} -> {learned}: raised to the demand, or kept with the spike named\n{out}"
    );
    let head = String::from_utf8(
        Command::new("git")
            .arg("-C")
            .arg(&repo)
            .args(["rev-parse", "HEAD"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .to_string();

    // 2. The rest, as written (addresses replaced).
    let mut daemons: Vec<Proc> = Vec::new();
    let mut ran_once = false;
    for c in &cmds[1..] {
        let c = ported(c);
        let (program, args, background) = argv(&c);
        let log = cwd.join(format!("step-{}.log", daemons.len() + ran_once as usize));
        let mut cmd = Command::new(&program);
        cmd.args(&args)
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(log.with_extension("err")).unwrap());
        if args.first().map(String::as_str) == Some("controller") {
            assert!(
                background,
                "the README starts the controller in the background: {c}"
            );
            daemons.push(Proc::spawn(&mut cmd).unwrap());
            wait_until(Duration::from_secs(30), || {
                get(cport, "/v1/status").is_some()
            });
            // It serves the demo's last commit from the state the demo left.
            assert_eq!(get(cport, "/v1/status").unwrap()["version"], head.as_str());
        } else if args.first().map(String::as_str) == Some("serve") {
            daemons.push(Proc::spawn(&mut cmd).unwrap());
            wait_until(Duration::from_secs(60), || {
                get_text(sport, "/healthz").is_some()
            });
        } else {
            assert_eq!(args.first().map(String::as_str), Some("run"), "{c}");
            let mut p = Proc::spawn(&mut cmd).unwrap();
            let status = p.wait_exit(Duration::from_secs(180));
            let out = std::fs::read_to_string(&log).unwrap()
                + &std::fs::read_to_string(log.with_extension("err")).unwrap();
            assert_eq!(status.and_then(|s| s.code()), Some(0), "{c}\n{out}");
            assert!(out.contains("unchanged"), "{out}");
            ran_once = true;
        }
    }
    assert!(ran_once && daemons.len() == 2, "{cmds:?}");

    // The daemon answers with the demo's buckets: every bucket of the config repo, at the
    // limits the demo committed.
    let mut committed = Vec::new();
    for f in std::fs::read_dir(repo.join("buckets")).unwrap() {
        let file: schema::BucketFile =
            serde_yaml::from_str(&std::fs::read_to_string(f.unwrap().path()).unwrap()).unwrap();
        for b in file.buckets {
            committed.push((format!("{}/{}", file.service, b.name), b.limit_rps));
        }
    }
    committed.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(committed.len() >= 7, "{committed:?}");
    // The first answer loads four weeks of history (seconds in a debug build): wait for it.
    let quotas: serde_json::Value =
        serde_json::from_str(&get_waiting(sport, "/v1/quotas")).expect("GET /v1/quotas");
    let mut current: Vec<(String, f64)> = quotas["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                format!(
                    "{}/{}",
                    b["service"].as_str().unwrap(),
                    b["name"].as_str().unwrap()
                ),
                b["current_limit_rps"].as_f64().unwrap(),
            )
        })
        .collect();
    current.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(current, committed);
    assert!(current.contains(&("payments/api-gateway.refund".to_string(), learned)));

    // The dashboard shows the demo's traffic, from the reports the demo stored: the enforced
    // bucket dropped about a third of 1.5× its limit (less in the first second, before the
    // ratio settles), the shadow one dropped nothing and would have dropped about as much.
    let shadow = get(sport, "/v1/shadow?window=1h").expect("GET /v1/shadow");
    let row = |name: &str| {
        shadow["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["service"] == "payments" && b["bucket"] == name)
            .unwrap_or_else(|| panic!("payments/{name} in {shadow}"))
            .clone()
    };
    let (charge, refund) = (row("api-gateway.charge"), row("api-gateway.refund"));
    let share =
        |b: &serde_json::Value, k: &str| b[k].as_f64().unwrap() / b["offered"].as_f64().unwrap();
    assert_eq!(charge["mode"], "enforce");
    // 1.5× the limit drops a third in steady state; the few seconds the demo drives include
    // the control loop's first reaction, which once dropped 43.5% of them on a loaded run.
    assert!(
        (0.15..0.50).contains(&share(&charge, "dropped")),
        "{charge}"
    );
    assert_eq!(refund["mode"], "shadow");
    assert_eq!(refund["dropped"].as_f64(), Some(0.0), "{refund}");
    // The same first seconds weigh on the shadow bucket: a loaded run measured 45.3% (a first
    // tick offered 350 rps against a limit of 98.4).
    assert!(
        (0.15..0.50).contains(&share(&refund, "shadow_dropped")),
        "{refund}"
    );
    let page = get_text(sport, "/").expect("GET /");
    for name in ["api-gateway.charge", "api-gateway.refund"] {
        assert!(page.contains(name), "{name} on the dashboard");
    }
    // Every bucket of the config repo is on the overview, reported or not; the enforced
    // bucket that dropped a third of its requests says so first, not "ok".
    for (name, _) in &committed {
        let (service, bucket) = name.split_once('/').unwrap();
        assert!(
            page.contains(&format!(
                "data-bucket=\"{bucket}\" data-service=\"{service}\""
            )),
            "{name} on the overview:\n{page}"
        );
    }
    let first_row = page
        .split("<tbody>")
        .nth(1)
        .and_then(|t| t.split("</tr>").next())
        .unwrap();
    assert!(
        first_row.contains("data-bucket=\"api-gateway.charge\"")
            && first_row.contains("data-verdict=\"dropping\"")
            && first_row.contains("dropping "),
        "the dropping bucket first: {first_row}"
    );
    // The bucket page shows the limit the last run committed (its quota history's), not the
    // one of the reports' time.
    let bucket_page =
        get_text(sport, "/buckets/payments/api-gateway.refund?window=1h").expect("bucket page");
    let shown = bucket_page
        .split("id=\"limit-in-force\">")
        .nth(1)
        .and_then(|t| t.split(" requests/s").next())
        .unwrap_or_else(|| panic!("limit in force on the bucket page:\n{bucket_page}"));
    let expected = if learned >= 100.0 || learned.fract() == 0.0 {
        format!("{learned:.0}")
    } else {
        format!("{learned:.1}")
    };
    assert_eq!(shown, expected, "the limit in force is the committed one");

    // The enforced bucket's page, as Chromium renders it: its figures agree with each other,
    // with the JSON behind it, with the overview's and with GET /v1/quotas. Rows stand for
    // one second whatever the demo's tick, so the chart's per-minute rates times 60 add up to
    // the offered requests.
    let detail = get(sport, "/v1/shadow/payments/api-gateway.charge?window=1h")
        .expect("GET /v1/shadow/payments/api-gateway.charge");
    let stats = &detail["readiness"]["stats"];
    let offered = stats["offered"].as_f64().unwrap();
    let dropped = stats["dropped"].as_f64().unwrap();
    let close = |a: f64, b: f64, what: &str| {
        assert!(
            (a - b).abs() <= 0.01 * b.abs().max(1.0),
            "{what}: {a} vs {b}\n{detail}"
        );
    };
    close(
        offered,
        charge["offered"].as_f64().unwrap(),
        "offered: page vs overview",
    );
    close(
        dropped,
        charge["dropped"].as_f64().unwrap(),
        "dropped: page vs overview",
    );
    // The requests the demo's callers sent and saw refused, from its per-second lines
    // (`t=1s api-gateway.charge:  2952 requests,   983 answered 429 (33.3%) | …`): report
    // rows carry the requests counted, so the store has every one of them.
    let (mut sent, mut refused) = (0.0, 0.0);
    for line in out.lines().filter(|l| l.trim_start().starts_with("t=")) {
        let part = line.split("api-gateway.charge:").nth(1).expect(line);
        let part = part.split('|').next().unwrap();
        let words: Vec<&str> = part.split_whitespace().collect();
        sent += words[0].parse::<f64>().expect(line);
        refused += words[2].parse::<f64>().expect(line);
    }
    assert!(sent > 0.0, "{out}");
    assert!(
        offered == sent,
        "stored offered {offered}, the demo sent {sent}\n{out}"
    );
    assert!(
        dropped == refused,
        "stored dropped {dropped}, the demo saw {refused} refused\n{out}"
    );
    // The chart's rate is the busiest minute's requests per reported second: at least the
    // window's average per reported second (a weighted mean of the minutes'), at most every
    // request in one second. (Not bounded by the busiest second's rate estimate: the counts a
    // row carries arrive in lumps; a full run once charted 2,914 beside a busiest 2,900.)
    let charted = detail["series"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["points"].as_array().unwrap())
        .filter_map(|p| p["offered_rps"].as_f64())
        .fold(0.0, f64::max);
    let per_second = offered / charge["reports"].as_f64().unwrap();
    assert!(
        per_second * 0.999 <= charted && charted <= offered,
        "chart {charted}, average per reported second {per_second}, offered {offered}"
    );
    let verdict = format!(
        "enforced: dropping {:.2}% of requests",
        dropped / offered * 100.0
    );
    assert_eq!(detail["readiness"]["verdict_text"], verdict.as_str());
    assert_eq!(
        charge["verdict_text"],
        verdict.trim_start_matches("enforced: ")
    );
    let in_quotas = quotas["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["service"] == "payments" && b["name"] == "api-gateway.charge")
        .and_then(|b| b["current_limit_rps"].as_f64())
        .expect("the charge bucket in GET /v1/quotas");
    let dom = super::dashboard::chromium(
        &["--dump-dom".into()],
        &format!("http://127.0.0.1:{sport}/buckets/payments/api-gateway.charge?window=1h"),
    );
    let text = |id: &str| super::dashboard::text_of(&dom, id);
    assert_eq!(text("verdict"), verdict, "{dom}");
    let offered_shown: f64 = text("offered").parse().unwrap();
    close(offered_shown, offered, "offered on the page");
    let limit_shown: f64 = text("limit-in-force")
        .trim_end_matches(" requests/s")
        .parse()
        .unwrap_or_else(|e| panic!("{e}: {dom}"));
    close(
        limit_shown,
        in_quotas,
        "limit in force: page vs GET /v1/quotas",
    );

    // The README's API examples, as written (the address replaced), against the demo's
    // `rlc serve`: every answer is JSON, the unknown path's a problem.
    for c in readme_curls() {
        let c = ported(&c);
        let out = Command::new("sh")
            .arg("-c")
            .arg(&c)
            .current_dir(cwd)
            .output()
            .unwrap();
        assert!(out.status.success(), "{c}: {out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{c}: {e}: {}", String::from_utf8_lossy(&out.stdout)));
        if c.contains("/v1/nothing-here") {
            assert_eq!(v["status"], 404, "{c}: {v}");
            assert_eq!(v["type"], "about:blank", "{c}: {v}");
            continue;
        }
        assert_ne!(v["type"], "about:blank", "{c} answered a problem: {v:#}");
        if c.contains("/history") {
            assert!(!v["changes"].as_array().unwrap().is_empty(), "{c}: {v:#}");
        } else if c.contains("/v1/previews") {
            assert!(v["diff"].is_object() && v["plan"].is_object(), "{c}: {v:#}");
        } else {
            let buckets = v["buckets"].as_array().unwrap();
            assert!(!buckets.is_empty(), "{c}: {v:#}");
            assert!(
                buckets.iter().all(|b| b["service"] == "payments"),
                "{c}: {v:#}"
            );
        }
    }
    drop(daemons);
}

/// The `curl` commands of the README's "Previewing quotas over HTTP" section, continuation
/// lines joined.
fn readme_curls() -> Vec<String> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .unwrap();
    let block = readme
        .split("\n## Previewing quotas over HTTP\n")
        .nth(1)
        .and_then(|s| s.split("```sh\n").nth(1))
        .and_then(|s| s.split("```").next())
        .expect("README has the API examples");
    let joined = block.replace("\\\n", " ");
    let curls: Vec<String> = joined
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("curl "))
        .map(str::to_string)
        .collect();
    assert!(curls.len() >= 4, "{curls:?}");
    curls
}

#[test]
fn a_second_demo_keeps_an_edited_rlc_yaml_and_rewrites_the_rest() {
    let work = tempfile::tempdir().unwrap();
    let cwd = work.path();
    let (code, out) = demo(cwd, &[]);
    assert_eq!(code, Some(0), "{out}");
    let d = cwd.join("demo-out");
    let edited = std::fs::read_to_string(d.join("rlc.yaml")).unwrap() + "# my own note\n";
    std::fs::write(d.join("rlc.yaml"), &edited).unwrap();
    std::fs::remove_file(d.join("rlc-token")).unwrap();
    let observed = |text: &str| text.matches("# observed by `rlc demo`").count();
    assert_eq!(
        observed(&std::fs::read_to_string(d.join("history.csv")).unwrap()),
        1
    );

    let (code, out) = demo(cwd, &[]);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(std::fs::read_to_string(d.join("rlc.yaml")).unwrap(), edited);
    let kept: Vec<&str> = out
        .lines()
        .filter(|l| l.trim().starts_with("kept "))
        .collect();
    assert_eq!(kept.len(), 1, "{out}");
    assert!(
        kept[0].contains("rlc.yaml") && kept[0].contains("edited"),
        "{out}"
    );
    // The deleted token is written again from the (reused) credentials, mode 600.
    let creds = std::fs::read_to_string(d.join("grl-credentials")).unwrap();
    let token = std::fs::read_to_string(d.join("rlc-token")).unwrap();
    assert!(
        creds
            .lines()
            .any(|l| l.starts_with("rlc ") && l.ends_with(token.trim())),
        "rlc-token holds the rlc credential"
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(d.join("rlc-token"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // The unedited history is the demo's own: the second run's traffic was added to it.
    assert_eq!(
        observed(&std::fs::read_to_string(d.join("history.csv")).unwrap()),
        2
    );
    assert!(
        out.contains("1. config repo") && out.contains("(reused)"),
        "{out}"
    );

    // Edited history: kept, and the observed rates are not added.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(d.join("history.csv"))
        .unwrap();
    std::io::Write::write_all(&mut f, b"# mine\n").unwrap();
    drop(f);
    let (code, out) = demo(cwd, &[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("kept history.csv"), "{out}");
    assert_eq!(
        observed(&std::fs::read_to_string(d.join("history.csv")).unwrap()),
        2
    );
}
