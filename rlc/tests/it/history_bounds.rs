//! Hostile history answers: a fake Prometheus whose answers look valid and never end. The real
//! `rlc preview` and `rlc serve` must stop reading at a bound, keep every quota (preview exits
//! 1) and name the bound, with their peak RSS bounded (see [`Ended`] for how it is read).
//!
//! The fake server speaks HTTP/1.1 on a raw socket, one thread per connection, so that an
//! answer can be written for as long as the client reads it. While a child runs, its RSS is
//! watched: past [`RSS_MAX`] it is killed and the test fails at once (before the bounds, these
//! answers took rlc to gigabytes in seconds), and a child still running after [`DEADLINE`] is
//! killed too, so a test fails instead of hanging.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use test_support::git::GitRemote;
use test_support::process::free_port;

/// The peak RSS a child may reach: a generous bound (rlc's own footprint is some tens of MB).
const RSS_MAX: u64 = 400 << 20;
/// A child still running after this is killed: the test then fails instead of hanging.
const DEADLINE: Duration = Duration::from_secs(300);

/// What the fake Prometheus answers.
#[derive(Clone, Copy, Debug)]
enum Hostile {
    /// `query_range`: one series whose `values` never end.
    EndlessSeries,
    /// `query_range`: new series, one after the other, for ever.
    EndlessDistinctSeries,
    /// Remote read: frames of one series, its chunks repeated for ever.
    EndlessFrames,
    /// Remote read: two series in turn, for ever (each listed again and again).
    RepeatedSeries,
    /// Remote read: a valid answer sent 64 bytes every 100 ms, for ever (never idle long
    /// enough for the per-byte timeout).
    Dribble,
}

/// Starts the fake Prometheus; its threads end with the test process.
fn fake_prometheus(hostile: Hostile) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(s) = s else { continue };
            std::thread::spawn(move || {
                let _ = serve_connection(s, hostile);
            });
        }
    });
    url
}

/// Answers the requests of one connection until the client closes it.
fn serve_connection(s: TcpStream, hostile: Hostile) -> std::io::Result<()> {
    let mut r = BufReader::new(s.try_clone()?);
    let mut w = s;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let mut length = 0usize;
        loop {
            let mut h = String::new();
            r.read_line(&mut h)?;
            if h.trim().is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; length];
        r.read_exact(&mut body)?;
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let json = |w: &mut TcpStream, text: &str| {
            write!(
                w,
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
                text.len()
            )
        };
        match path.as_str() {
            "/api/v1/query_range" => {
                let form = String::from_utf8_lossy(&body).to_string();
                let start: i64 = form
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("start="))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                return endless_query_range(&mut w, hostile, start);
            }
            "/api/v1/read" => return endless_frames(&mut w, hostile),
            "/api/v1/status/flags" => json(
                &mut w,
                r#"{"status":"success","data":{"query.lookback-delta":"5m"}}"#,
            )?,
            "/api/v1/status/buildinfo" => json(
                &mut w,
                r#"{"status":"success","data":{"version":"2.42.0"}}"#,
            )?,
            "/api/v1/status/config" => json(
                &mut w,
                r#"{"status":"success","data":{"yaml":"global:\n  scrape_interval: 15s\n"}}"#,
            )?,
            _ => write!(w, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")?,
        }
    }
}

/// Writes `piece` as one chunk of a chunked body.
fn chunk(w: &mut TcpStream, piece: &[u8]) -> std::io::Result<()> {
    write!(w, "{:x}\r\n", piece.len())?;
    w.write_all(piece)?;
    w.write_all(b"\r\n")
}

/// A `query_range` answer that never ends: it stops when rlc closes the connection.
fn endless_query_range(w: &mut TcpStream, hostile: Hostile, start: i64) -> std::io::Result<()> {
    write!(
        w,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )?;
    chunk(
        w,
        br#"{"status":"success","data":{"resultType":"matrix","result":["#,
    )?;
    match hostile {
        Hostile::EndlessSeries => {
            chunk(
                w,
                br#"{"metric":{"service":"pay","caller":"web"},"values":["#,
            )?;
            let point = format!(r#"[{start},"1.5"],"#);
            let piece = point.repeat(64 << 10 >> 4);
            loop {
                chunk(w, piece.as_bytes())?;
            }
        }
        _ => {
            let mut n = 0u64;
            loop {
                let mut piece = String::with_capacity(70 << 10);
                while piece.len() < 64 << 10 {
                    piece.push_str(&format!(
                        r#"{{"metric":{{"service":"svc-{n}","caller":"web"}},"values":[[{start},"1.5"]]}},"#
                    ));
                    n += 1;
                }
                chunk(w, piece.as_bytes())?;
            }
        }
    }
}

/// A streamed remote-read answer that never ends: the same frame of one series (its samples
/// in the last day, so that every one of them is in range) over and over, or frames of two
/// series in turn.
fn endless_frames(w: &mut TcpStream, hostile: Hostile) -> std::io::Result<()> {
    write!(
        w,
        "HTTP/1.1 200 OK\r\nContent-Type: application/x-streamed-protobuf; proto=prometheus.ChunkedReadResponse\r\nTransfer-Encoding: chunked\r\n\r\n"
    )?;
    let now_ms = chrono::Utc::now().timestamp_millis();
    let mut x = 1u64;
    // Values that compress badly: XOR decoding is then as cheap per byte as it gets.
    let samples: Vec<(i64, f64)> = (0..12_000)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (now_ms - 20 * 3_600_000 + i * 1_000, (x >> 11) as f64 / 1e6)
        })
        .collect();
    let labels = |caller: &str| {
        vec![
            ("__name__".to_string(), "rpc_rps".to_string()),
            ("caller".to_string(), caller.to_string()),
            ("service".to_string(), "pay".to_string()),
        ]
    };
    let frame = match hostile {
        Hostile::RepeatedSeries => rlc::history::remote_read::bench::answer(&[
            (labels("web"), samples[..120].to_vec()),
            (labels("api"), samples[..120].to_vec()),
        ]),
        _ => rlc::history::remote_read::bench::answer(&[(labels("web"), samples)]),
    };
    if let Hostile::Dribble = hostile {
        loop {
            for piece in frame.chunks(64) {
                chunk(w, piece)?;
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    loop {
        chunk(w, &frame)?;
    }
}

/// A field of `/proc/PID/status` in bytes (`VmRSS`: resident now; `VmHWM`: the peak since
/// the process's last exec), `None` once the process is gone.
fn proc_status(pid: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// How a watched child ended.
#[derive(Debug)]
struct Ended {
    /// Exit code (`None`: killed, by a signal or by [`watch`]).
    code: Option<i32>,
    /// The child's peak RSS in bytes: its `VmHWM` (the kernel's high-water mark of its
    /// memory since its exec), last read while it ran.
    peak_rss: u64,
    /// `ru_maxrss` from `wait4`, in bytes. The kernel folds the spawning process's peak into
    /// it (the exec of a child spawned with `CLONE_VM` counts the parent's memory as the
    /// child's old image), so it is the larger of the child's peak and this test process's.
    ru_maxrss: u64,
    /// Why [`watch`] killed it, if it did.
    killed: Option<String>,
    /// How long it ran (reported, never asserted).
    after: Duration,
}

/// Waits for `child` (reaped here with `wait4`, for its rusage), killing it once its RSS
/// passes [`RSS_MAX`] or [`DEADLINE`] passes (or, when `stop` says so, sending it SIGTERM);
/// returns how it ended with its peak RSS.
fn watch(child: std::process::Child, mut stop: impl FnMut() -> bool) -> Ended {
    let pid = child.id() as i32;
    let started = Instant::now();
    let mut killed = None;
    let mut termed = false;
    let mut peak = 0;
    let proc = pid.to_string();
    loop {
        peak = peak.max(proc_status(&proc, "VmHWM").unwrap_or(0));
        let mut status = 0;
        // SAFETY: `rusage` is a plain C struct written by the kernel; `pid` is our child.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
            return Ended {
                code,
                peak_rss: peak,
                ru_maxrss: usage.ru_maxrss as u64 * 1024,
                killed,
                after: started.elapsed(),
            };
        }
        assert!(r == 0, "wait4: {}", std::io::Error::last_os_error());
        if killed.is_none() {
            if let Some(rss) = proc_status(&proc, "VmRSS").filter(|&rss| rss > RSS_MAX) {
                killed = Some(format!("RSS reached {} MB", rss >> 20));
            } else if started.elapsed() > DEADLINE {
                killed = Some(format!("still running after {DEADLINE:?}"));
            }
            if killed.is_some() {
                // SAFETY: signals our own unreaped child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        if !termed && killed.is_none() && stop() {
            termed = true;
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asserts that `ended` stayed under [`RSS_MAX`]; `ru_maxrss` too when this test process's
/// own peak is under it (it is then a bound on the child's peak, see [`Ended::ru_maxrss`]).
fn assert_bounded(what: &str, ended: &Ended, log: &str) {
    let own = proc_status("self", "VmHWM").unwrap_or(u64::MAX);
    eprintln!(
        "{what}: peak RSS {} MB (ru_maxrss {} MB, this test process {} MB), exit {:?} after {:?}",
        ended.peak_rss >> 20,
        ended.ru_maxrss >> 20,
        own >> 20,
        ended.code,
        ended.after
    );
    assert!(ended.killed.is_none(), "{what}: killed, {ended:?}\n{log}");
    assert!(ended.peak_rss < RSS_MAX, "{what}: {ended:?}");
    if own < RSS_MAX {
        assert!(ended.ru_maxrss < RSS_MAX, "{what}: {ended:?}");
    }
}

/// A config repo on a remote with `pay/web` at 250 rps, and rlc.yaml in `dir` reading
/// `prometheus` with `query` (`settings`: more lines of `history.prometheus`; `extra`: more
/// lines of rlc.yaml).
fn setup(dir: &Path, prometheus: &str, query: &str, settings: &str, extra: &str) -> GitRemote {
    let files = test_support::git::minimal_repo_files(&[("pay", "web", 250.0)]);
    let refs: Vec<(&str, &str)> = files
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let remote = GitRemote::new("main", &refs).unwrap();
    std::fs::write(
        dir.join("rlc.yaml"),
        format!(
            "history:\n  prometheus:\n    url: {prometheus}\n    query: '{query}'\n{settings}  lookback: 1d\n  step: 1m\n\
             config_repo:\n  path: wc\n  url: {}\n  author_name: rlc-bot\n  author_email: rlc@example.com\n\
             database_url: sqlite://rlc.db\n{extra}",
            remote.url()
        ),
    )
    .unwrap();
    remote
}

/// Runs `rlc preview --format json` on `dir`'s rlc.yaml: how it ended, stdout, stderr.
fn preview(dir: &Path) -> (Ended, String, String) {
    let (out, err) = (dir.join("preview.out"), dir.join("preview.err"));
    let child = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(["preview", "--format", "json", "--config"])
        .arg(dir.join("rlc.yaml"))
        .current_dir(dir)
        .env("RUST_LOG", "error")
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let ended = watch(child, || false);
    (
        ended,
        std::fs::read_to_string(out).unwrap(),
        std::fs::read_to_string(err).unwrap(),
    )
}

/// `rlc preview` against `hostile` (`settings`: of `history.prometheus`): exit 1, `pay/web`
/// keeps 250 rps, the reason names `bound`, peak RSS under [`RSS_MAX`].
fn preview_is_bounded(hostile: Hostile, query: &str, settings: &str, bound: &str) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = fake_prometheus(hostile);
    let _remote = setup(d, &url, query, settings, "");
    let (ended, out, err) = preview(d);
    assert_bounded(&format!("{hostile:?}"), &ended, &err);
    assert_eq!(ended.code, Some(1), "{hostile:?}: {out}\n{err}");
    let plan: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    assert_eq!(plan["buckets"][0]["limit_rps"], 250.0, "{plan}");
    let reason = plan["skipped"][0]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("history source failed") && reason.contains(bound) && reason.contains(&url),
        "{hostile:?}: {reason}\n{plan}"
    );
}

const QUERY: &str = "sum by (service, caller, procedure) (rate(rpc_requests_total[1m]))";
const QUERY_RANGE: &str = "    api: query_range\n";
const REMOTE_READ: &str = "    api: remote_read\n";

/// One series whose values never end: the pull stops at the text one series may take.
#[test]
fn preview_stops_a_query_range_series_that_never_ends() {
    preview_is_bounded(
        Hostile::EndlessSeries,
        QUERY,
        QUERY_RANGE,
        "one series' text exceeds",
    );
}

/// New series for ever: the pull stops at `history.prometheus.max_series`.
#[test]
fn preview_stops_query_range_series_that_never_end() {
    preview_is_bounded(
        Hostile::EndlessDistinctSeries,
        QUERY,
        QUERY_RANGE,
        "history.prometheus.max_series",
    );
}

/// Remote read: valid frames of one series for ever. The series holds at most what the grid
/// can use, and the answer stops at `history.prometheus.max_response_bytes` (256 MiB here
/// instead of the default 2 GiB, which a debug build takes about a minute to decode; the
/// memory held is the same).
#[test]
fn preview_stops_a_remote_read_stream_that_never_ends() {
    preview_is_bounded(
        Hostile::EndlessFrames,
        "rpc_rps",
        &format!("{REMOTE_READ}    max_response_bytes: {}\n", 256 << 20),
        "history.prometheus.max_response_bytes",
    );
}

/// Remote read: two series in turn for ever, each listed again and again. A series comes
/// once per request and attempt at most: the pull stops at the fourth.
#[test]
fn preview_stops_a_remote_read_stream_repeating_its_series() {
    preview_is_bounded(
        Hostile::RepeatedSeries,
        "rpc_rps",
        REMOTE_READ,
        "comes more than 3 times",
    );
}

/// Remote read: an answer that never stops but never pauses for the per-byte timeout (1 s)
/// either: each attempt is cut at `history.prometheus.max_request_duration` (2 s here), and
/// after the last one the pull fails, every quota kept.
#[test]
fn preview_cuts_a_remote_read_answer_at_its_overall_deadline() {
    preview_is_bounded(
        Hostile::Dribble,
        "rpc_rps",
        &format!("{REMOTE_READ}    timeout: 1s\n    max_request_duration: 2s\n    retries: 2\n"),
        "took longer than history.prometheus.max_request_duration (2s)",
    );
}

/// One GET /v1/quotas on `rlc serve` triggers a pull: it stops at the bound, the API answers
/// with every quota kept and the pull's error, and the daemon's peak RSS stays bounded.
#[test]
fn serve_quota_api_stops_an_answer_that_never_ends() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let url = fake_prometheus(Hostile::EndlessSeries);
    let port = free_port();
    let _remote = setup(
        d,
        &url,
        QUERY,
        QUERY_RANGE,
        &format!("server:\n  listen: 127.0.0.1:{port}\n"),
    );
    let log = d.join("serve.log");
    let child = Command::new(env!("CARGO_BIN_EXE_rlc"))
        .args(["serve", "--poll-secs", "1", "--config"])
        .arg(d.join("rlc.yaml"))
        .current_dir(d)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    // The request in a thread: the watch goes on while the daemon pulls. Until the first poll
    // has synced the config repo, the API answers 503 saying so.
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let answer = rt.block_on(async {
            let c = reqwest::Client::builder()
                .timeout(Duration::from_secs(240))
                .build()
                .unwrap();
            let url = format!("http://127.0.0.1:{port}/v1/quotas");
            for _ in 0..1200 {
                if let Ok(r) = c.get(&url).send().await {
                    let status = r.status().as_u16();
                    let text = r.text().await.unwrap_or_default();
                    if !(status == 503 && text.contains("not synced yet")) {
                        return Some((status, text));
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None
        });
        let _ = tx.send(answer);
    });
    let mut answer = None;
    let ended = watch(child, || match rx.try_recv() {
        Ok(a) => {
            answer = Some(a);
            true
        }
        Err(std::sync::mpsc::TryRecvError::Empty) => false,
        Err(_) => true,
    });
    let log = std::fs::read_to_string(&log).unwrap();
    assert_bounded("serve", &ended, &log);
    let (status, body) = answer
        .flatten()
        .unwrap_or_else(|| panic!("no answer\n{log}"));
    assert_eq!(status, 200, "{body}\n{log}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let error = v["history"]["last_pull_error"].as_str().unwrap_or_default();
    assert!(
        error.contains("one series' text exceeds") && error.contains(&url),
        "{v}"
    );
    assert_eq!(v["buckets"][0]["limit_rps"], 250.0, "{v}");
}
