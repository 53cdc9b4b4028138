//! Project automation. `cargo xtask test` is the one test command (README, `.ci/run`):
//!
//! 1. installs the Debian packages the tests need when they are missing (as root; otherwise it
//!    says which to install),
//! 2. builds the example policy plugin the plugin tests load,
//! 3. runs every test of the workspace and ends with one line counting them all,
//! 4. checks that no process started by the tests is left running: every process of the run
//!    carries `GRL_TEST_RUN=<run id>` in its environment (inherited from `cargo test`), and any
//!    still alive shortly after the tests end is named, killed, and fails the run.
//!
//! Throwaway services are started by the tests themselves, through `test-support`: a Postgres
//! cluster per test binary that needs one (temp dir, free port, stopped when the binary exits)
//! unless `DATABASE_URL` names a server, and Prometheus instances backfilled with promtool.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{bail, Context, Result};

mod house;

/// Debian packages and a binary that tells whether each is installed.
const PACKAGES: &[(&str, &str)] = &[
    ("postgresql", "initdb"),
    ("prometheus", "promtool"),
    // the Prometheus-compatible store without remote read (history falls back to query_range)
    ("victoria-metrics", "victoria-metrics"),
    ("redis-server", "redis-server"),
    ("git", "git"),
    ("chromium", "chromium"),
    // schemathesis (PyPI) runs in a venv of Debian's Python (test_support::schemathesis).
    ("python3", "/usr/bin/python3"),
    ("python3-venv", "python3-venv"),
    // builds the container image from scratch (tests/tests/it/deploy.rs) and starts it where
    // the machine allows containers
    ("podman", "podman"),
    // `systemd-analyze verify` checks deploy/systemd/
    ("systemd", "systemd-analyze"),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("test") => test(&args[1..]),
        Some("deps") => ensure_packages().map(|_| 0),
        Some("house") => house::run(&workspace_root(), &args[1..]),
        _ => {
            eprintln!(
                "usage: cargo xtask test [-- CARGO TEST ARGS]   run every test with throwaway services\n       cargo xtask deps                        install missing Debian packages (as root)\n       cargo xtask house [--check]             import circles, long functions and files, string errors"
            );
            Ok(2)
        }
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// The lints every landing passes: `cargo fmt --check` and clippy on every target with
/// warnings as errors (the toolchain's `rustfmt` and `clippy` components are added when
/// missing).
fn lint(root: &Path) -> Result<()> {
    for (component, probe) in [("rustfmt", "fmt"), ("clippy", "clippy")] {
        let present = Command::new(cargo())
            .args([probe, "--version"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !present {
            eprintln!("xtask: adding the toolchain component {component}");
            let added = Command::new("rustup")
                .args(["component", "add", component])
                .status()
                .is_ok_and(|s| s.success());
            if !added {
                bail!("cargo {probe} is missing and `rustup component add {component}` failed");
            }
        }
    }
    let fmt = Command::new(cargo())
        .current_dir(root)
        .args(["fmt", "--all", "--", "--check"])
        .status()
        .context("running cargo fmt")?;
    if !fmt.success() {
        bail!("`cargo fmt --all -- --check` found unformatted code: run `cargo fmt --all`");
    }
    let clippy = Command::new(cargo())
        .current_dir(root)
        .args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ])
        .status()
        .context("running cargo clippy")?;
    if !clippy.success() {
        bail!("`cargo clippy --workspace --all-targets -- -D warnings` failed (see above)");
    }
    Ok(())
}

fn test(extra: &[String]) -> Result<u8> {
    ensure_packages()?;
    match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => {
            eprintln!("xtask: tests use DATABASE_URL from the environment")
        }
        // test_support::postgres starts one throwaway cluster per test binary that needs it.
        _ => eprintln!("xtask: tests start throwaway Postgres clusters (temp dir, free port)"),
    }

    let root = workspace_root();
    lint(&root)?;
    build_example_plugin(&root)?;
    let run_id = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let (status, totals) = run_tests(&root, &run_id, extra)?;
    let leaked = kill_leftovers(&run_id);
    for why in &totals.skipped {
        println!("xtask: skipped on this machine: {why}");
    }
    let (passed, failed, skipped) = totals.summary(leaked);
    println!("xtask: {passed} passed, {failed} failed, {skipped} skipped");
    Ok(if status.success() && totals.passed > 0 && !leaked {
        0
    } else {
        1
    })
}

/// Builds the example policy plugin the plugin tests load.
fn build_example_plugin(root: &Path) -> Result<()> {
    let status = Command::new(cargo())
        .current_dir(root)
        .args(["build", "-p", "example-plugin"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building the example plugin failed");
    }
    Ok(())
}

/// Runs every test of the workspace with the run's mark in the environment, passing the
/// output through while adding up the per-binary results, so that the run ends on one line
/// that counts every test of the workspace.
fn run_tests(
    root: &Path,
    run_id: &str,
    extra: &[String],
) -> Result<(std::process::ExitStatus, Totals)> {
    let mut child = Command::new(cargo())
        .current_dir(root)
        .env(RUN_ENV, run_id)
        .args(["test", "--workspace", "--no-fail-fast"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo test")?;
    let mut totals = Totals::default();
    let stdout = child.stdout.take().expect("piped");
    // Read in a thread: a process left running by a test may hold the pipe open forever, so
    // the run ends when cargo exits (plus a bounded drain), not at end of file.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let status = loop {
        use std::sync::mpsc::RecvTimeoutError;
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(line) => {
                println!("{line}");
                totals.add(&line);
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => break child.wait()?,
            Err(RecvTimeoutError::Timeout) => {}
        }
        if let Some(st) = child.try_wait()? {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while let Ok(line) =
                rx.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
            {
                println!("{line}");
                totals.add(&line);
            }
            break st;
        }
    };
    Ok((status, totals))
}

/// Names and kills the processes of the run still alive after the tests ended; whether there
/// were any (which fails the run).
fn kill_leftovers(run_id: &str) -> bool {
    // Throwaway Postgres clusters are stopped by a watchdog once their test binary is gone:
    // give such orderly stops a bounded moment before calling anything a leak.
    let left = leftovers(run_id, LEAK_GRACE);
    for p in &left {
        eprintln!(
            "xtask: left running by the tests: pid {} ({}): {}",
            p.pid, p.comm, p.cmdline
        );
        let _ = Command::new("kill")
            .args(["-9", &p.pid.to_string()])
            .status();
    }
    if !left.is_empty() {
        eprintln!(
            "xtask: FAILED: {} process(es) started by the tests were still running after the tests ended (killed now); every test must stop what it starts",
            left.len()
        );
    }
    !left.is_empty()
}

/// The environment variable that marks every process of one `cargo xtask test` run.
const RUN_ENV: &str = "GRL_TEST_RUN";

/// How long processes of the run may take to exit after the tests ended.
const LEAK_GRACE: std::time::Duration = std::time::Duration::from_secs(20);

/// A process of the test run that is still alive.
#[derive(Debug)]
struct Leftover {
    pid: u32,
    comm: String,
    cmdline: String,
}

/// Live processes (zombies excluded) whose environment has `GRL_TEST_RUN=<run_id>`, other than
/// this one.
fn marked_processes(run_id: &str) -> Vec<Leftover> {
    let needle = format!("{RUN_ENV}={run_id}");
    let me = std::process::id();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if !env.split(|b| *b == 0).any(|v| v == needle.as_bytes()) {
            continue;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next())
            .unwrap_or("");
        if state == "Z" || state == "X" {
            continue;
        }
        let read = |f: &str| {
            std::fs::read(format!("/proc/{pid}/{f}"))
                .map(|b| {
                    String::from_utf8_lossy(&b)
                        .replace('\0', " ")
                        .trim()
                        .to_string()
                })
                .unwrap_or_default()
        };
        out.push(Leftover {
            pid,
            comm: read("comm"),
            cmdline: read("cmdline"),
        });
    }
    out
}

/// Processes of the run still alive after up to `grace` (polled), or none.
fn leftovers(run_id: &str, grace: std::time::Duration) -> Vec<Leftover> {
    let deadline = std::time::Instant::now() + grace;
    loop {
        let left = marked_processes(run_id);
        if left.is_empty() || std::time::Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Sums of libtest's `test result:` lines.
#[derive(Default)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
    /// Tests that passed but declared themselves skipped on this machine
    /// (`test_support::skip`), with their reasons.
    skipped: Vec<String>,
}

impl Totals {
    /// (passed, failed, skipped): the leak check counts as one more test (failed when
    /// `leaked`); a test that skipped itself is skipped, not passed.
    fn summary(&self, leaked: bool) -> (u64, u64, u64) {
        let skipped = self.skipped.len() as u64;
        (
            self.passed.saturating_sub(skipped),
            self.failed + u64::from(leaked),
            self.ignored + skipped,
        )
    }

    fn add(&mut self, line: &str) {
        // The marker of test_support::skip (kept in step with test_support::SKIP_MARKER).
        if let Some(why) = line.trim_start().strip_prefix("xtask-skip: ") {
            self.skipped.push(why.to_string());
            return;
        }
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(what), Some(n)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(n) = n.parse::<u64>() else { continue };
            match what {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                "ignored" => self.ignored += n,
                _ => {}
            }
        }
    }
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn have(bin: &str) -> bool {
    if bin == "initdb" {
        return postgres_bin_dir().is_ok();
    }
    if bin == "python3-venv" {
        // A module, not a binary: Debian's python3 without it cannot make a venv with pip.
        return Command::new("/usr/bin/python3")
            .args(["-c", "import ensurepip, venv"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
    }
    Command::new("sh")
        .args(["-c", &format!("command -v {bin}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Installs the missing packages as root, or names them otherwise.
fn ensure_packages() -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(_, bin)| !have(bin))
        .map(|(pkg, _)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "missing Debian packages: {}. Install them (sudo apt-get install {}) or run this command as root",
            missing.join(", "),
            missing.join(" ")
        );
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    let ok = Command::new("apt-get")
        .arg("update")
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        bail!("apt-get update failed");
    }
    let ok = Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        bail!("apt-get install {} failed", missing.join(" "));
    }
    Ok(())
}

/// The directory holding `initdb` and `pg_ctl`: PATH first, then Debian's versioned dirs.
fn postgres_bin_dir() -> Result<PathBuf> {
    if let Ok(o) = Command::new("sh")
        .args(["-c", "command -v initdb"])
        .output()
    {
        if o.status.success() {
            let p = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
            if let Some(dir) = p.parent() {
                if dir.join("pg_ctl").exists() {
                    return Ok(dir.to_path_buf());
                }
            }
        }
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs.into_iter()
        .rev()
        .find(|d| d.join("initdb").exists() && d.join("pg_ctl").exists())
        .context("initdb/pg_ctl not found (Debian package postgresql)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_that_skips_itself_counts_as_skipped_not_passed() {
        let mut t = Totals::default();
        t.add("running 4 tests");
        t.add("  xtask-skip: deploy::artefacts::container_image_starts_under_podman: podman cannot start containers here");
        t.add("test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 2 filtered out");
        assert_eq!(t.summary(false), (2, 0, 2));
        assert_eq!(t.summary(true), (2, 1, 2));
        assert!(t.skipped[0].contains("podman cannot start containers here"));
    }

    #[test]
    fn a_process_of_the_run_left_running_is_found_and_named() {
        let run_id = format!("selftest-{}", std::process::id());
        let mut child = Command::new("sleep")
            .arg("300")
            .env(RUN_ENV, &run_id)
            .spawn()
            .unwrap();
        // spawn() can return while execve is still installing the new image, when
        // /proc/PID/environ reads empty: wait (bounded) until the marker is visible.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let found = loop {
            let found = marked_processes(&run_id);
            if !found.is_empty() || std::time::Instant::now() >= deadline {
                break found;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].pid, child.id());
        assert_eq!(found[0].comm, "sleep");
        assert_eq!(found[0].cmdline, "sleep 300");
        // Reaped: nothing of the run is left.
        assert!(leftovers(&run_id, std::time::Duration::from_secs(2)).is_empty());
        // Another run's marker does not match.
        assert!(marked_processes(&format!("{run_id}-other")).is_empty());
    }
}
