//! `grl controller --config-dir` on a hostile or unlucky directory: it refuses to start, with
//! an error naming the file and the reason, in bounded time and memory, never printing the
//! content of a file from outside the directory, and persists nothing.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{REPORT_TOKEN, TOKEN};

const GOOD: &str = "service: maps\nbuckets:\n  - name: a\n    caller: a\n    limit_rps: 5\n";

/// Starts the real controller on `cfg` with its address space capped at 2 GiB and a 60 s
/// guard; returns (exit code, stderr, time taken). A controller that starts (exit code None
/// after 60 s) fails the test.
fn start_on(dir: &Path, cfg: &Path) -> (i32, String, Duration) {
    let err = dir.join("controller.err");
    let start = Instant::now();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 2097152 && exec \"$0\" controller --listen 127.0.0.1:0 --state-dir \"$1\" --config-dir \"$2\"")
        .arg(env!("CARGO_BIN_EXE_grl"))
        .arg(dir.join("state"))
        .arg(cfg)
        .env("GRL_TOKEN", TOKEN)
        .env("GRL_REPORT_TOKEN", REPORT_TOKEN)
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "grl controller still running after 60 s on {}",
                cfg.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.code().unwrap_or(-1),
        std::fs::read_to_string(&err).unwrap(),
        start.elapsed(),
    )
}

/// A config dir with one good file and `bad` set up by `make`; asserts the refusal names
/// `bad` and `reason`.
fn refused(bad: &str, reason: &str, make: impl FnOnce(&Path)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("buckets");
    std::fs::create_dir_all(&cfg).unwrap();
    std::fs::write(cfg.join("maps.yaml"), GOOD).unwrap();
    make(&cfg.join(bad));
    let (code, err, took) = start_on(dir.path(), &cfg);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("refusing to start: bucket files in"), "{err}");
    let line = format!("{}:", cfg.join(bad).display());
    assert!(
        err.lines().any(|l| l.contains(&line) && l.contains(reason)),
        "no `{reason}` for {bad} in {err}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(!dir.path().join("state/config.json").exists());
    err
}

#[test]
fn fault_controller_refuses_a_fifo_without_blocking() {
    refused(
        "queue.yaml",
        "a FIFO (named pipe), not a regular file",
        |p| {
            assert!(Command::new("mkfifo").arg(p).status().unwrap().success());
        },
    );
}

#[test]
fn fault_controller_refuses_a_symlink_to_etc_passwd_without_printing_it() {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    let first = passwd.lines().next().unwrap().to_string();
    let err = refused(
        "users.yaml",
        "symbolic link to /etc/passwd outside the repo",
        |p| std::os::unix::fs::symlink("/etc/passwd", p).unwrap(),
    );
    assert!(
        !err.contains(&first),
        "content of /etc/passwd printed: {err}"
    );
    assert!(
        !err.contains("/bin/"),
        "content of /etc/passwd printed: {err}"
    );
}

#[test]
fn fault_controller_refuses_a_symlink_to_dev_zero() {
    refused(
        "zero.yaml",
        "symbolic link to /dev/zero outside the repo",
        |p| std::os::unix::fs::symlink("/dev/zero", p).unwrap(),
    );
}

#[test]
fn fault_controller_refuses_an_oversize_file() {
    refused("big.yaml", "refused: larger than 4 MiB", |p| {
        let mut text = String::from("service: big\nbuckets:\n");
        let mut i = 0;
        while text.len() <= 5 << 20 {
            text.push_str(&format!("  - {{name: b{i}, caller: c{i}, limit_rps: 5}}\n"));
            i += 1;
        }
        std::fs::write(p, text).unwrap();
    });
}

#[test]
fn fault_controller_refuses_deep_nesting_quickly() {
    refused("deep.yaml", "nesting deeper than 64 levels", |p| {
        let n = 200_000;
        std::fs::write(
            p,
            format!(
                "service: deep\nbuckets: {}{}\n",
                "[".repeat(n),
                "]".repeat(n)
            ),
        )
        .unwrap();
    });
}

#[test]
fn fault_controller_refuses_more_buckets_than_the_limit() {
    // 105,000 buckets in three files of 1.7 MB (each within the size limit); the controller
    // accepted 1.1 M buckets before the limit.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("buckets");
    std::fs::create_dir_all(&cfg).unwrap();
    for s in ["s0", "s1", "s2"] {
        let mut text = format!("service: {s}\nbuckets:\n");
        for i in 0..35_000 {
            text.push_str(&format!("  - {{name: b{i}, caller: c{i}, limit_rps: 5}}\n"));
        }
        std::fs::write(cfg.join(format!("{s}.yaml")), text).unwrap();
    }
    let (code, err, _) = start_on(dir.path(), &cfg);
    assert_eq!(code, 1, "{err}");
    let line = format!("{}:1:1: ", cfg.join("s2.yaml").display());
    assert!(
        err.lines()
            .any(|l| l.contains(&line) && l.contains("to 105000, more than the limit of 100000")),
        "{err}"
    );
    assert!(!dir.path().join("state/config.json").exists());
}
