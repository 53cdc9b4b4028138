//! TLS on every hop, with real `grl` controller and aggregator processes on loopback and
//! in-process clients: certificates come from a throwaway CA made by the test (rcgen).

// End-to-end scenarios read top to bottom; the size bound (clippy.toml) is for code outside
// tests.
#![allow(clippy::too_many_lines)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use grl_client::client::{ClientOptions, GrlClient};
use grl_client::tls::ClientTls;
use grl_core::Decision;
use serde_json::{json, Value};
use test_support::process::{free_port, Proc};
use test_support::tls::Ca;
use test_support::wait::eventually;

/// The controller's roles, one credential each (`PUT /v1/config`, overrides, `GET
/// /v1/reports`, zone reports from aggregators and peer controllers).
const CONFIG_TOKEN: &str = "config-token-0123456789";
const OVERRIDE_TOKEN: &str = "override-token-0123456789";
const READ_TOKEN: &str = "read-token-0123456789";
const REPORT_TOKEN: &str = "zone-report-token-0123456789";
/// The client report credential for service `payments` (the aggregator's credentials file).
const PAYMENTS_SECRET: &str = "payments-client-0123456789";

fn log_file(dir: &Path, name: &str) -> Stdio {
    Stdio::from(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
}

/// The `grl` binary cargo built for this test (`GRL_BIN` overrides it: a copy taken right
/// after the build, when several checkouts share one target directory).
fn grl(args: &[&str]) -> Command {
    let bin = std::env::var_os("GRL_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_grl")));
    let mut c = Command::new(bin);
    c.args(args)
        .env("GRL_CONFIG_TOKEN", CONFIG_TOKEN)
        .env("GRL_OVERRIDE_TOKEN", OVERRIDE_TOKEN)
        .env("GRL_READ_TOKEN", READ_TOKEN)
        .env("GRL_REPORT_TOKEN", REPORT_TOKEN);
    for v in [
        "GRL_TOKEN",
        "GRL_TOKEN_FILE",
        "GRL_CONFIG_TOKEN_FILE",
        "GRL_OVERRIDE_TOKEN_FILE",
        "GRL_READ_TOKEN_FILE",
        "GRL_REPORT_TOKEN_FILE",
        "GRL_CREDENTIALS_FILE",
        "GRL_CLIENT_CREDENTIALS_FILE",
        "GRL_TLS_CERT",
        "GRL_TLS_KEY",
        "GRL_TLS_CLIENT_CA",
        "GRL_TLS_CA",
        "GRL_TLS_CLIENT_CERT",
        "GRL_TLS_CLIENT_KEY",
    ] {
        c.env_remove(v);
    }
    c
}

/// A `grl` process in its own process group, stopped with it when dropped.
fn spawn(args: &[&str], logs: &Path, name: &str) -> Proc {
    Proc::spawn(grl(args).stdout(Stdio::null()).stderr(log_file(logs, name))).unwrap()
}

/// An aggregator credentials file granting `PAYMENTS_SECRET` for service `payments`.
fn client_credentials(dir: &Path) -> PathBuf {
    let path = dir.join("client-credentials");
    std::fs::write(&path, format!("payments payments {PAYMENTS_SECRET}\n")).unwrap();
    path
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A client with this TLS setup (a fresh connection pool: every probe handshakes anew).
fn http(tls: &ClientTls) -> reqwest::Client {
    tls.configure(
        reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .tls_info(true),
    )
    .unwrap()
    .build()
    .unwrap()
}

async fn wait_up(tls: &ClientTls, url: &str) {
    let h = http(tls);
    eventually(&format!("{url} up"), || {
        let (h, u) = (h.clone(), url.to_string());
        async move {
            h.get(&u)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        }
    })
    .await;
}

/// Offers `rps` requests per second of gw/charge to `client` until `stop`; counts
/// [offered, dropped].
fn load(client: Arc<GrlClient>, rps: f64, stop: Arc<AtomicBool>, counts: Arc<[AtomicU64; 2]>) {
    std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let mut done = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let due = (start.elapsed().as_secs_f64() * rps) as u64;
            while done < due {
                counts[0].fetch_add(1, Ordering::Relaxed);
                if client.limiter().decide("gw", "charge") == Decision::Drop {
                    counts[1].fetch_add(1, Ordering::Relaxed);
                }
                done += 1;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
}

fn client(url: &str, id: &str, tls: ClientTls) -> Arc<GrlClient> {
    let mut o = ClientOptions::new("payments", vec![url.to_string()]);
    o.tick = Duration::from_millis(100);
    o.stale_after = Duration::from_millis(600);
    o.client_id = Some(id.into());
    o.report_token = Some(PAYMENTS_SECRET.into());
    o.tls = tls;
    Arc::new(GrlClient::start(o))
}

/// Controller and aggregator both serve HTTPS and require client certificates from the test
/// CA; the aggregator verifies the controller and presents its own certificate. Enforcement
/// works end to end; a client that does not trust the CA, or whose certificate comes from
/// another CA, gets nothing and admits everything; plain HTTP gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tier_over_mutual_tls_enforces_and_refuses_untrusted_peers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("grl test CA");
    let ca_file = ca.write(&d.join("ca.crt"));
    let (srv_crt, srv_key) = ca.server().write(d, "server");
    let (agg_crt, agg_key) = ca.client("aggregator.z1").write(d, "agg-client");
    let (svc_crt, svc_key) = ca.client("payments").write(d, "svc-client");
    let (op_crt, op_key) = ca.client("operator").write(d, "operator");
    let rogue = Ca::new("rogue CA");
    let rogue_file = rogue.write(&d.join("rogue-ca.crt"));
    let (rogue_crt, rogue_key) = rogue.client("payments").write(d, "rogue-client");

    let trusted = |crt: &Path, key: &Path| ClientTls {
        ca: Some(ca_file.clone()),
        cert: Some(crt.to_path_buf()),
        key: Some(key.to_path_buf()),
    };
    let operator = trusted(&op_crt, &op_key);

    let cport = free_port();
    let base = format!("https://127.0.0.1:{cport}");
    let listen = format!("127.0.0.1:{cport}");
    let _ctl = spawn(
        &[
            "controller",
            "--listen",
            &listen,
            "--tick-ms",
            "100",
            "--state-dir",
            s(&d.join("state")),
            "--tls-cert",
            s(&srv_crt),
            "--tls-key",
            s(&srv_key),
            "--tls-client-ca",
            s(&ca_file),
        ],
        d,
        "controller",
    );
    wait_up(&operator, &format!("{base}/v1/status")).await;
    let r = http(&operator)
        .put(format!("{base}/v1/config"))
        .bearer_auth(CONFIG_TOKEN)
        .json(&json!({
            "version": "v1",
            "services": [{"service": "payments", "buckets": [
                {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
                 "limit_rps": 200.0, "mode": "enforce", "policy": "peak"}]}]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());

    let aport = free_port();
    let agg_url = format!("https://127.0.0.1:{aport}");
    let alisten = format!("127.0.0.1:{aport}");
    let creds = client_credentials(d);
    let _agg = spawn(
        &[
            "aggregator",
            "--listen",
            &alisten,
            "--controller",
            &base,
            "--zone",
            "z1",
            "--region",
            "r1",
            "--tick-ms",
            "100",
            "--id",
            "agg-tls",
            "--client-credentials",
            s(&creds),
            "--tls-cert",
            s(&srv_crt),
            "--tls-key",
            s(&srv_key),
            "--tls-client-ca",
            s(&ca_file),
            "--tls-ca",
            s(&ca_file),
            "--tls-client-cert",
            s(&agg_crt),
            "--tls-client-key",
            s(&agg_key),
        ],
        d,
        "aggregator",
    );
    wait_up(&operator, &format!("{agg_url}/v1/config")).await;

    // Two real clients at 200 rps each against a 200 rps limit, and two that must fail.
    let stop = Arc::new(AtomicBool::new(false));
    let good: Vec<_> = (0..2)
        .map(|i| client(&agg_url, &format!("good{i}"), trusted(&svc_crt, &svc_key)))
        .collect();
    let good_counts: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    for c in &good {
        load(c.clone(), 200.0, stop.clone(), good_counts.clone());
    }
    // Trusts another CA (so not the aggregator's certificate), presents a valid certificate.
    let untrusting = client(
        &agg_url,
        "untrusting",
        ClientTls {
            ca: Some(rogue_file.clone()),
            ..trusted(&svc_crt, &svc_key)
        },
    );
    // Trusts the CA, but its certificate comes from another CA: refused under mutual TLS.
    let rogue_cert = client(
        &agg_url,
        "rogue-cert",
        ClientTls {
            ca: Some(ca_file.clone()),
            cert: Some(rogue_crt.clone()),
            key: Some(rogue_key.clone()),
        },
    );
    let bad_counts: Arc<[AtomicU64; 2]> = Arc::new(Default::default());
    load(untrusting.clone(), 200.0, stop.clone(), bad_counts.clone());
    load(rogue_cert.clone(), 200.0, stop.clone(), bad_counts.clone());

    // Enforcement over TLS: the drop ratio reaches the real clients, and they drop.
    eventually("the drop ratio reaches the clients over TLS", || {
        let now = grl_core::now_ms();
        let ok = good.iter().all(|c| {
            let t = c.limiter().table();
            t.version() == "v1" && !t.is_stale(now) && t.ratio(0) > 0.2
        });
        async move { ok }
    })
    .await;
    let before = [0, 1].map(|i| good_counts[i].load(Ordering::Relaxed));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = [0, 1].map(|i| good_counts[i].load(Ordering::Relaxed));
    let frac = (after[1] - before[1]) as f64 / (after[0] - before[0]).max(1) as f64;
    assert!(
        (0.25..0.75).contains(&frac),
        "400 rps offered against 200: about half must be dropped, got {frac}"
    );

    // The two untrusted clients never got an answer, and fail open.
    for (c, what) in [
        (&untrusting, "untrusting"),
        (&rogue_cert, "rogue certificate"),
    ] {
        let st = c.stats();
        assert_eq!(
            st.reports_ok.load(Ordering::Relaxed),
            0,
            "{what} got through"
        );
        assert!(
            st.report_errors.load(Ordering::Relaxed) > 5,
            "{what} never tried"
        );
        assert_eq!(c.limiter().table().version(), "", "{what} got a config");
    }
    assert!(bad_counts[0].load(Ordering::Relaxed) > 100);
    assert_eq!(
        bad_counts[1].load(Ordering::Relaxed),
        0,
        "a client that cannot reach its aggregator must admit everything"
    );

    // The same refusals seen directly: the handshake fails, no HTTP status comes back.
    let report = json!({"client_id": "x", "service": "payments", "version": "", "interval_ms": 100,
        "buckets": [{"bucket": "gw.charge", "offered": 100000, "admitted": 100000, "dropped": 0, "shadow_dropped": 0}]});
    for (tls, what) in [
        (
            ClientTls {
                ca: Some(ca_file.clone()),
                ..Default::default()
            },
            "no client certificate",
        ),
        (
            ClientTls {
                ca: Some(ca_file.clone()),
                cert: Some(rogue_crt.clone()),
                key: Some(rogue_key.clone()),
            },
            "a client certificate from another CA",
        ),
        (
            ClientTls {
                ca: Some(rogue_file.clone()),
                ..trusted(&svc_crt, &svc_key)
            },
            "a server certificate it does not trust",
        ),
    ] {
        for url in [&agg_url, &base] {
            // With the right credential: only TLS stands in the way.
            let r = http(&tls)
                .post(format!("{url}/v1/report"))
                .bearer_auth(PAYMENTS_SECRET)
                .json(&report)
                .send()
                .await;
            assert!(
                r.is_err(),
                "{what} at {url}: expected a refused handshake, got {r:?}"
            );
        }
    }
    // Plain HTTP on a TLS port gets no HTTP answer either.
    let plain = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{aport}/v1/config"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(
        plain.as_ref().map_or(true, |r| !r.status().is_success()),
        "plain HTTP answered: {plain:?}"
    );

    // The override CLI over TLS: works with the CA and its certificate, refused without.
    let cli = |extra: &[&str]| {
        let mut c = grl(&[
            "override",
            "list",
            "--format",
            "json",
            "--controller",
            &base,
        ]);
        c.args(extra);
        c.output().unwrap()
    };
    let ok = cli(&[
        "--tls-ca",
        s(&ca_file),
        "--tls-client-cert",
        s(&op_crt),
        "--tls-client-key",
        s(&op_key),
    ]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let v: Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert!(v["overrides"].is_array(), "{v}");
    let refused = cli(&["--tls-ca", s(&ca_file)]);
    assert!(
        !refused.status.success(),
        "no client certificate, yet listed"
    );
    let untrusted = cli(&[]);
    assert!(
        !untrusted.status.success(),
        "the public roots must not trust the test CA"
    );

    // Enforcement still holds at the end (the refusals disturbed nothing).
    let t = good[0].limiter().table();
    assert!(!t.is_stale(grl_core::now_ms()) && t.ratio(0) > 0.2);
    stop.store(true, Ordering::Relaxed);
}

/// The certificate served, as DER, from a fresh connection.
async fn served_cert(tls: &ClientTls, url: &str) -> Option<Vec<u8>> {
    let r = http(tls).get(url).send().await.ok()?;
    r.extensions()
        .get::<reqwest::tls::TlsInfo>()?
        .peer_certificate()
        .map(<[u8]>::to_vec)
}

/// Replaces `path` atomically (write aside, rename), as deployment tools do.
fn replace(path: &Path, contents: &str) {
    let tmp: PathBuf = path.with_extension("tmp");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A certificate replaced on disk is served to new connections without a restart; a
/// certificate whose key has not arrived yet is not (the previous pair stays in service).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_certificate_is_served_without_restart() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("grl test CA");
    let ca_file = ca.write(&d.join("ca.crt"));
    let first = ca.server();
    let (crt, key) = first.write(d, "server");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut ctl = spawn(
        &[
            "controller",
            "--listen",
            &listen,
            "--state-dir",
            s(&d.join("state")),
            "--tls-cert",
            s(&crt),
            "--tls-key",
            s(&key),
            "--tls-reload-secs",
            "1",
        ],
        d,
        "controller",
    );
    let tls = ClientTls {
        ca: Some(ca_file.clone()),
        ..Default::default()
    };
    let url = format!("https://127.0.0.1:{port}/v1/status");
    wait_up(&tls, &url).await;
    assert_eq!(served_cert(&tls, &url).await.unwrap(), first.der);

    // A new certificate without its key: the pair does not match, the old one stays.
    let second = ca.server();
    replace(&crt, &second.cert_pem);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        served_cert(&tls, &url).await.unwrap(),
        first.der,
        "a certificate without its key must not be served"
    );
    // The key arrives: the new pair is served, by the same process.
    replace(&key, &second.key_pem);
    eventually("the new certificate is served", || {
        let (tls, url, want) = (tls.clone(), url.clone(), second.der.clone());
        async move { served_cert(&tls, &url).await == Some(want) }
    })
    .await;
    assert!(
        ctl.0.try_wait().unwrap().is_none(),
        "the controller restarted"
    );
    let log = std::fs::read_to_string(d.join("controller.log")).unwrap();
    assert!(log.contains("TLS certificate reloaded"), "{log}");
    assert!(log.contains("do not load"), "{log}");
}

/// The controller does not start on TLS files that do not load, and says which file.
#[test]
fn controller_refuses_to_start_on_bad_tls_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("grl test CA");
    let (crt, _) = ca.server().write(d, "a");
    let (_, other_key) = ca.server().write(d, "b");
    let empty = d.join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let state = d.join("state");
    let cases: [(&[&str], &str); 3] = [
        (&["--tls-cert", s(&crt)], "--tls-cert needs --tls-key"),
        (
            &["--tls-cert", s(&empty), "--tls-key", s(&other_key)],
            "empty.pem: no certificate",
        ),
        (
            &["--tls-cert", s(&crt), "--tls-key", s(&other_key)],
            "do not go together",
        ),
    ];
    for (extra, want) in cases {
        let mut args = vec![
            "controller",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            s(&state),
        ];
        args.extend_from_slice(extra);
        let out = grl(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "started with {extra:?}");
        assert!(err.contains(want), "{extra:?}: {err}");
    }
}

/// Region controllers share global sums over mutual TLS: west presents a client certificate
/// to east and is heard; east presents none to west and is refused, so only east sees the
/// whole fleet (2/3 dropped of 600 offered against 200) while west sees its own half (1/3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_controllers_over_mutual_tls_hear_only_certified_peers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("grl test CA");
    let ca_file = ca.write(&d.join("ca.crt"));
    let (srv_crt, srv_key) = ca.server().write(d, "server");
    let (peer_crt, peer_key) = ca.client("controller.west").write(d, "peer");
    let (op_crt, op_key) = ca.client("operator").write(d, "operator");
    let operator = ClientTls {
        ca: Some(ca_file.clone()),
        cert: Some(op_crt),
        key: Some(op_key),
    };
    let (pe, pw) = (free_port(), free_port());
    let (ue, uw) = (
        format!("https://127.0.0.1:{pe}"),
        format!("https://127.0.0.1:{pw}"),
    );
    let (le, lw) = (format!("127.0.0.1:{pe}"), format!("127.0.0.1:{pw}"));
    let (se, sw) = (d.join("east"), d.join("west"));
    let server_args = [
        "--tls-cert",
        s(&srv_crt),
        "--tls-key",
        s(&srv_key),
        "--tls-client-ca",
        s(&ca_file),
        "--tls-ca",
        s(&ca_file),
    ];
    let mut east: Vec<&str> = vec!["controller", "--listen", &le, "--tick-ms", "100"];
    east.extend(["--state-dir", s(&se), "--region", "east", "--peer", &uw]);
    east.extend(server_args);
    let mut west: Vec<&str> = vec!["controller", "--listen", &lw, "--tick-ms", "100"];
    west.extend(["--state-dir", s(&sw), "--region", "west", "--peer", &ue]);
    west.extend(server_args);
    west.extend([
        "--tls-client-cert",
        s(&peer_crt),
        "--tls-client-key",
        s(&peer_key),
    ]);
    let _east = spawn(&east, d, "east");
    let _west = spawn(&west, d, "west");
    let h = http(&operator);
    for u in [&ue, &uw] {
        wait_up(&operator, &format!("{u}/v1/status")).await;
        let r = h
            .put(format!("{u}/v1/config"))
            .bearer_auth(CONFIG_TOKEN)
            .json(&json!({
                "version": "v1",
                "services": [{"service": "payments", "buckets": [
                    {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global",
                     "limit_rps": 200.0, "mode": "enforce", "policy": "peak"}]}]
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let report = |region: &str| {
        json!({"aggregator_id": format!("agg-{region}"), "region": region, "zone": format!("{region}-1"),
               "buckets": [{"service": "payments", "bucket": "gw.charge", "offered_rps": 300.0,
                            "admitted_rps": 300.0, "dropped_rps": 0.0, "shadow_dropped_rps": 0.0,
                            "counts": {"bucket": "gw.charge", "offered": 30, "admitted": 30,
                                       "dropped": 0, "shadow_dropped": 0}}]})
    };
    let ratios = || async {
        let mut v = Vec::new();
        for (u, region) in [(&ue, "east"), (&uw, "west")] {
            let d: Value = h
                .post(format!("{u}/v1/aggregate"))
                .bearer_auth(REPORT_TOKEN)
                .json(&report(region))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v.push(d["services"][0]["directives"][0]["ratio"].as_f64().unwrap());
        }
        v
    };
    let mut last = Vec::new();
    let mut heard = false;
    for _ in 0..200 {
        last = ratios().await;
        if (last[0] - 2.0 / 3.0).abs() < 1e-6 {
            heard = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(heard, "east never heard west over TLS: {last:?}");
    // Long enough for many of east's peer reports (tick 100 ms) to have been refused.
    for _ in 0..20 {
        let r = ratios().await;
        assert!(
            (r[1] - 1.0 / 3.0).abs() < 1e-6,
            "west counted east's sums without a client certificate: {r:?}"
        );
        assert!((r[0] - 2.0 / 3.0).abs() < 1e-6, "{r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the log `name.log` in `dir` contains `text`, polled for up to 15 s.
async fn log_shows(dir: &Path, name: &str, text: &str) -> bool {
    for _ in 0..150 {
        let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
        if log.contains(text) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Waits until something accepts TCP connections on `port`.
async fn wait_listening(port: u16) {
    eventually(&format!("port {port} listening"), || async move {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    })
    .await;
}

/// `grl override list` against `url` trusting `ca`: its exit status and stderr.
fn override_list(url: &str, ca: &Path, extra: &[&str]) -> (bool, String) {
    let out = grl(&["override", "list", "--controller", url, "--tls-ca", s(ca)])
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every call between the tiers names why it failed: an expired certificate with its date, a
/// host name mismatch with the names the certificate has, a refused connection, a timeout;
/// `grl override`, an aggregator calling its controller and a client calling its aggregator
/// alike (before: "error sending request" for all of them). A server started on an expired
/// certificate says so at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_calls_name_their_cause() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ca = Ca::new("grl test CA");
    let ca_file = ca.write(&d.join("ca.crt"));
    let (old_crt, old_key) = ca.expired_server().write(d, "expired");
    let (other_crt, other_key) = ca.server_for(&["other.example"]).write(d, "other");
    let controller = |port: u16, crt: &Path, key: &Path, name: &str| {
        spawn(
            &[
                "controller",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--state-dir",
                s(&d.join(name)),
                "--tls-cert",
                s(crt),
                "--tls-key",
                s(key),
            ],
            d,
            name,
        )
    };
    let (p_old, p_other) = (free_port(), free_port());
    let _c_old = controller(p_old, &old_crt, &old_key, "controller-expired");
    let _c_other = controller(p_other, &other_crt, &other_key, "controller-other");
    wait_listening(p_old).await;
    wait_listening(p_other).await;
    assert!(
        log_shows(
            d,
            "controller-expired",
            "TLS server certificate expired on 2021-01-01"
        )
        .await,
        "no warning at start"
    );

    // grl override.
    let (ok, err) = override_list(&format!("https://127.0.0.1:{p_old}"), &ca_file, &[]);
    assert!(!ok);
    assert!(
        err.contains("server certificate expired on 2021-01-01 00:00:00 UTC"),
        "{err}"
    );
    let (ok, err) = override_list(&format!("https://127.0.0.1:{p_other}"), &ca_file, &[]);
    assert!(!ok);
    assert!(
        err.contains("host name mismatch") && err.contains("other.example"),
        "{err}"
    );
    let refused = free_port();
    let (ok, err) = override_list(&format!("https://127.0.0.1:{refused}"), &ca_file, &[]);
    assert!(!ok);
    assert!(err.contains("connection refused"), "{err}");
    // Accepts connections (the kernel's backlog) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://{}", silent.local_addr().unwrap());
    let (ok, err) = override_list(&url, &ca_file, &["--timeout-secs", "1"]);
    assert!(!ok);
    assert!(err.contains("timed out after 1000 ms"), "{err}");

    // An aggregator calling the controller whose certificate expired.
    let creds = client_credentials(d);
    let pa = free_port();
    let _agg = spawn(
        &[
            "aggregator",
            "--listen",
            &format!("127.0.0.1:{pa}"),
            "--controller",
            &format!("https://127.0.0.1:{p_old}"),
            "--zone",
            "z1",
            "--region",
            "r1",
            "--tls-ca",
            s(&ca_file),
            "--client-credentials",
            s(&creds),
            // Its own certificate names another host than the one its clients call.
            "--tls-cert",
            s(&other_crt),
            "--tls-key",
            s(&other_key),
        ],
        d,
        "aggregator",
    );
    assert!(
        log_shows(
            d,
            "aggregator",
            "server certificate expired on 2021-01-01 00:00:00 UTC"
        )
        .await,
        "{}",
        std::fs::read_to_string(d.join("aggregator.log")).unwrap_or_default()
    );

    // A client calling that aggregator by an address its certificate does not name.
    let c = client(
        &format!("https://127.0.0.1:{pa}"),
        "c1",
        ClientTls {
            ca: Some(ca_file.clone()),
            ..Default::default()
        },
    );
    let last = || c.stats().last_error.lock().unwrap().clone();
    eventually("the client names the cause", || {
        let l = last();
        async move { l.is_some_and(|e| e.contains("host name mismatch")) }
    })
    .await;
    assert!(last().unwrap().contains("other.example"), "{:?}", last());
}
