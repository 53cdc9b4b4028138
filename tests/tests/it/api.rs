//! `rlc serve`'s HTTP API against its own OpenAPI document: schemathesis (property-based,
//! from PyPI, pinned: `test_support::schemathesis`) generates requests for every operation
//! of the served `/openapi.json`, valid and invalid, and fails on any 5xx or any answer the
//! document does not describe (status, content type, headers, body schema).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::Duration;

use test_support::process::{free_port, Proc};

use super::{get, get_text, wait_until, Deployment};

const WRITE: &str = "rlc-e2e-token";
const READ: &str = "rlc-e2e-read-token";

/// `method path` on loopback with a bearer token; the status and the JSON body.
fn call(port: u16, method: &str, path: &str, token: &str) -> Option<(u16, serde_json::Value)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, serde_json::from_str(body).ok()?))
}

/// Runs schemathesis on the document served on `port` with `token`; panics with its report
/// on any failure.
fn schemathesis(port: u16, token: &str, work: &std::path::Path) {
    let exe = test_support::schemathesis::executable().expect("schemathesis installs");
    let out = std::process::Command::new(exe)
        .current_dir(work)
        .args([
            "run",
            &format!("http://127.0.0.1:{port}/openapi.json"),
            "--header",
            &format!("Authorization: Bearer {token}"),
            "--checks",
            "all",
            // Schema-valid what-if documents may still fail the checks of the files (a merge
            // patch setting a negative headroom is a valid JSON object): the server answers
            // 422 with every problem, which this check would count as a refusal of valid
            // data. Every other check (no 5xx, status codes, content types, headers and
            // bodies conforming to the document) stays on.
            "--exclude-checks",
            "positive_data_acceptance",
            "--mode",
            "all",
            "--max-examples",
            "25",
            "--seed",
            "20261130",
            "--workers",
            "1",
            // `GET /v1/quotas?refresh=true` pulls the history again (sharing a pull in
            // flight) before it computes: once, on an otherwise quiet machine, one took more
            // than 10 s. A bound on a request, not a speed claim.
            "--request-timeout",
            "30",
            // A bound on the run, not a speed claim: under load (other builds on the same
            // two cores) the coverage phase alone took 19 s, and the fuzzing and stateful
            // phases were then never reached.
            "--max-time",
            "45",
            "--phases",
            "examples,coverage,fuzzing,stateful",
        ])
        .env("NO_COLOR", "1")
        .env("SCHEMATHESIS_HOOKS", "")
        .stdin(Stdio::null())
        .output()
        .expect("schemathesis runs");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "schemathesis found problems (token {}):\n{report}",
        if token == WRITE { "write" } else { "read" }
    );
    // It tested every operation it selected, all of them (schemathesis leaves out the
    // document's own URL), not a run that found nothing to do.
    let field = |name: &str| {
        report
            .lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| panic!("no `{name}` in the report:\n{report}"))
    };
    let tested: usize = field("Tested:").parse().unwrap();
    assert_eq!(field("Selected:"), format!("{tested}/{tested}"), "{report}");
    assert!(tested >= 8, "{report}");
}

#[test]
fn the_served_openapi_document_describes_every_answer() {
    let d = Deployment::build("sqlite://rlc.db", &[], "  read_token_env: RLC_READ_TOKEN\n");
    let port = free_port();
    let _serve = Proc::spawn(
        d.rlc(&[
            "serve",
            "--poll-secs",
            "1",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .env("RLC_READ_TOKEN", READ)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(d.dir.path().join("serve.log")).unwrap()),
    )
    .unwrap();
    wait_until(Duration::from_secs(60), || {
        get_text(port, "/healthz").is_some()
    });
    // The read endpoints need a token now; the document does not.
    assert!(get(port, "/v1/runs").is_none());
    assert_eq!(get(port, "/openapi.json").unwrap()["openapi"], "3.1.0");

    // One finished run in the store, so that run answers carry real records.
    let mut queued = None;
    wait_until(Duration::from_secs(60), || {
        queued = call(port, "POST", "/v1/runs", WRITE)
            .filter(|(status, _)| *status == 202)
            .map(|(_, v)| v);
        queued.is_some()
    });
    let uid = queued.unwrap()["run_uid"].as_str().unwrap().to_string();
    wait_until(Duration::from_secs(120), || {
        call(port, "GET", &format!("/v1/runs/{uid}"), READ)
            .is_some_and(|(_, v)| v["state"] == "finished")
    });
    let (_, runs) = call(port, "GET", "/v1/runs", READ).unwrap();
    assert_eq!(runs["runs"][0]["run_uid"], uid.as_str(), "{runs}");

    let work = tempfile::tempdir().unwrap();
    schemathesis(port, WRITE, work.path());
    schemathesis(port, READ, work.path());
    // The daemon is still up and answering.
    assert_eq!(get_text(port, "/healthz").as_deref(), Some("ok\n"));
}

/// A read token that rlc.yaml asks for but the environment lacks never opens the reads: the
/// daemon refuses to start and names the variable.
#[test]
fn serve_refuses_to_start_without_the_configured_read_token() {
    let d = Deployment::build("sqlite://rlc.db", &[], "  read_token_env: RLC_READ_TOKEN\n");
    let port = free_port();
    let out = d
        .rlc(&["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env_remove("RLC_READ_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("server.read_token_env") && stderr.contains("RLC_READ_TOKEN"),
        "{stderr}"
    );
    assert!(get_text(port, "/healthz").is_none(), "nothing listens");
}
