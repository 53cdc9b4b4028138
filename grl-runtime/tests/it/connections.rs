//! Connection exhaustion without a credential, against real `grl` processes: slow request
//! heads are cut after the header timeout, and a server at its connection cap still answers
//! its health probes (and nothing else) on the connections it keeps for them.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use test_support::process::{free_port, Proc};

use super::{spawn_aggregator_with, spawn_controller, wait_up, REPORT_TOKEN};

/// A controller or an aggregator (whose controller need not be up: its health and its
/// connection limits do not depend on one).
fn spawn(which: &str, port: u16, dir: &Path, extra: &[&str]) -> Proc {
    match which {
        "controller" => spawn_controller(port, &dir.join("state"), dir, extra),
        _ => {
            let creds = dir.join("client-credentials");
            std::fs::write(&creds, "p payments payments-client-0123456789\n").unwrap();
            let mut args = vec!["--client-credentials", creds.to_str().unwrap()];
            args.extend_from_slice(extra);
            spawn_aggregator_with(
                port,
                &format!("http://127.0.0.1:{}", free_port()),
                "agg-conn",
                dir,
                100,
                &args,
                &[("GRL_REPORT_TOKEN", REPORT_TOKEN)],
            )
        }
    }
}

/// Whether the server closed `s` (EOF or an error on read); `s` is non-blocking.
fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 512];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(_) => true,
    }
}

/// One raw request on a new connection: its status code, 0 when the connection was closed
/// or timed out without an answer.
fn raw_get(port: u16, path: &str) -> u16 {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return 0;
    };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return 0;
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// 200 connections that send a request head a byte every 500 ms (never finishing it) are
/// all cut by the server after the default header timeout (10 s), while `/healthz` and a
/// real request keep answering. Before the header timeout existed the connections were held
/// for as long as the client kept trickling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_request_heads_are_cut_and_health_keeps_answering() {
    for which in ["controller", "aggregator"] {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let _p = spawn(which, port, dir.path(), &[]);
        wait_up(&format!("http://127.0.0.1:{port}/healthz")).await;
        let result = tokio::task::spawn_blocking(move || {
            let mut socks: Vec<(TcpStream, Option<Duration>)> = (0..200)
                .map(|_| {
                    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                    s.write_all(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                        .unwrap();
                    s.set_nonblocking(true).unwrap();
                    (s, None)
                })
                .collect();
            let start = Instant::now();
            let mut health = Vec::new();
            // A hang guard, not a speed claim: three times the default header timeout.
            while start.elapsed() < Duration::from_secs(30) {
                for (s, cut) in socks.iter_mut().filter(|(_, c)| c.is_none()) {
                    if closed_by_server(s) || s.write_all(b"a").is_err() {
                        *cut = Some(start.elapsed());
                    }
                }
                if socks.iter().all(|(_, c)| c.is_some()) {
                    break;
                }
                health.push((raw_get(port, "/healthz"), raw_get(port, "/metrics")));
                std::thread::sleep(Duration::from_millis(500));
            }
            let held = socks.iter().filter(|(_, c)| c.is_none()).count();
            let last = socks.iter().filter_map(|(_, c)| *c).max();
            (held, last, health)
        })
        .await
        .unwrap();
        let (held, last, health) = result;
        assert_eq!(
            held, 0,
            "{which}: {held} of 200 slow connections still held after 30 s"
        );
        // Not cut before the timeout either: the server waited for the heads.
        assert!(
            last.unwrap() >= Duration::from_secs(9),
            "{which}: cut after {last:?}"
        );
        assert!(
            health.iter().all(|&(h, m)| h == 200 && m == 200),
            "{which}: health and a real request while slow clients held 200 connections: {health:?}"
        );
    }
}

/// At its connection cap a server still answers `/healthz` and `/readyz` on one of the
/// connections it keeps for probes, refuses anything else there (503), and serves again once
/// the connections that held the cap are cut by the header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_connection_cap_health_probes_still_answer() {
    for which in ["controller", "aggregator"] {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let _p = spawn(
            which,
            port,
            dir.path(),
            &[
                "--max-connections",
                "20",
                "--health-connections",
                "2",
                "--http-header-timeout-ms",
                "3000",
            ],
        );
        wait_up(&format!("http://127.0.0.1:{port}/healthz")).await;
        let r = tokio::task::spawn_blocking(move || {
            // The probe's kept-alive connection is closed by now (its client was dropped).
            std::thread::sleep(Duration::from_millis(500));
            // Twenty silent connections take the cap.
            let hogs: Vec<TcpStream> = (0..20)
                .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
                .collect();
            std::thread::sleep(Duration::from_millis(300));
            let at_cap = (
                raw_get(port, "/healthz"),
                raw_get(port, "/readyz"),
                raw_get(port, "/metrics"),
            );
            // The hogs are cut after the header timeout: the server serves everything again.
            let start = Instant::now();
            let mut after = 0;
            while start.elapsed() < Duration::from_secs(20) {
                after = raw_get(port, "/metrics");
                if after == 200 {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            drop(hogs);
            (at_cap, after)
        })
        .await
        .unwrap();
        let ((healthz, readyz, other), after) = r;
        assert_eq!(healthz, 200, "{which}: /healthz at the cap");
        assert!(
            readyz == 200 || readyz == 503,
            "{which}: /readyz at the cap answers its readiness: {readyz}"
        );
        assert_eq!(
            other, 503,
            "{which}: anything but health is refused on a probe connection: {healthz} {readyz} {other}"
        );
        assert_eq!(after, 200, "{which}: served again once the hogs were cut");
    }
}

/// With `--health-listen`, probes have a port of their own: while connections hold the main
/// port's cap and its health connections too, `/healthz` and `/readyz` answer there (and
/// nothing else is served there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_listener_answers_while_the_main_port_is_flooded() {
    for which in ["controller", "aggregator"] {
        let dir = tempfile::tempdir().unwrap();
        let (port, health) = (free_port(), free_port());
        let listen = format!("127.0.0.1:{health}");
        let _p = spawn(
            which,
            port,
            dir.path(),
            &[
                "--max-connections",
                "20",
                "--health-connections",
                "2",
                "--health-listen",
                &listen,
            ],
        );
        wait_up(&format!("http://127.0.0.1:{port}/healthz")).await;
        wait_up(&format!("http://127.0.0.1:{health}/healthz")).await;
        let r = tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_millis(500));
            // More silent connections than the cap and the health connections together.
            let hogs: Vec<TcpStream> = (0..40)
                .filter_map(|_| TcpStream::connect(("127.0.0.1", port)).ok())
                .collect();
            std::thread::sleep(Duration::from_millis(300));
            let r = (
                raw_get(port, "/v1/status"),
                raw_get(health, "/healthz"),
                raw_get(health, "/readyz"),
                raw_get(health, "/metrics"),
            );
            drop(hogs);
            r
        })
        .await
        .unwrap();
        let (main, healthz, readyz, other) = r;
        assert_ne!(main, 200, "{which}: the main port is full");
        assert_eq!(healthz, 200, "{which}: /healthz on the health listener");
        assert!(readyz == 200 || readyz == 503, "{which}: /readyz {readyz}");
        assert_eq!(
            other, 404,
            "{which}: the health listener serves health only"
        );
    }
}
