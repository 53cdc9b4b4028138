//! Schemathesis (PyPI), the property-based API tester, at a pinned version in a venv of its
//! own, installed on first use: `~/.cache/grl-tests/schemathesis-<version>` (or under
//! `$GRL_TEST_CACHE`). It needs Debian's `python3` and `python3-venv` (`cargo xtask test`
//! installs them) and PyPI.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The pinned version.
pub const VERSION: &str = "4.32.5";

/// The Python that makes the venv: Debian's, not whatever `python3` is first on the PATH.
const PYTHON: &str = "/usr/bin/python3";

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("GRL_TEST_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache").join("grl-tests")
}

/// The `schemathesis` executable, installing it when missing. Concurrent callers (test
/// binaries) take turns on a lock file; a finished install is marked by a file written last,
/// so an interrupted one is redone.
pub fn executable() -> Result<PathBuf> {
    use std::os::unix::io::AsRawFd;

    let dir = cache_dir().join(format!("schemathesis-{VERSION}"));
    let exe = dir.join("bin").join("schemathesis");
    let done = dir.join("installed");
    if done.exists() {
        return Ok(exe);
    }
    if !Path::new(PYTHON).exists() {
        bail!("{PYTHON} is missing: install the Debian packages python3 and python3-venv (cargo xtask test does)");
    }
    std::fs::create_dir_all(cache_dir())?;
    let lock = std::fs::File::create(cache_dir().join(format!("schemathesis-{VERSION}.lock")))?;
    // SAFETY: flock on a descriptor this function owns; released when `lock` is dropped.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        bail!(
            "locking the schemathesis install: {}",
            std::io::Error::last_os_error()
        );
    }
    if done.exists() {
        return Ok(exe);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let run = |cmd: &mut Command, what: &str| -> Result<()> {
        let out = cmd.output().with_context(|| what.to_string())?;
        if !out.status.success() {
            bail!(
                "{what} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    };
    run(
        Command::new(PYTHON).args(["-m", "venv"]).arg(&dir),
        "python3 -m venv (Debian package python3-venv)",
    )?;
    run(
        Command::new(dir.join("bin").join("pip")).args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("schemathesis=={VERSION}"),
        ]),
        &format!("pip install schemathesis=={VERSION}"),
    )?;
    if !exe.exists() {
        bail!("{} missing after the install", exe.display());
    }
    std::fs::write(&done, VERSION)?;
    Ok(exe)
}
