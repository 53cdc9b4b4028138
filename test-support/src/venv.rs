//! Python tools from PyPI at pinned versions, each in a venv of its own, installed on first
//! use: `~/.cache/grl-tests/<package>-<version>` (or under `$GRL_TEST_CACHE`). They need
//! Debian's `python3` and `python3-venv` (`cargo xtask test` installs them) and PyPI once.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

/// The Python that makes the venvs: Debian's, not whatever `python3` is first on the PATH.
const PYTHON: &str = "/usr/bin/python3";

/// Where the venvs live.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("GRL_TEST_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache").join("grl-tests")
}

/// The executable `exe` of `package==version`, installing it when missing. Concurrent callers
/// (test binaries) take turns on a lock file; a finished install is marked by a file written
/// last, so an interrupted one is redone.
pub fn tool(package: &str, version: &str, exe: &str) -> Result<PathBuf> {
    use std::os::unix::io::AsRawFd;

    let dir = cache_dir().join(format!("{package}-{version}"));
    let exe = dir.join("bin").join(exe);
    let done = dir.join("installed");
    if done.exists() {
        return Ok(exe);
    }
    if !Path::new(PYTHON).exists() {
        bail!("{PYTHON} is missing: install the Debian packages python3 and python3-venv (cargo xtask test does)");
    }
    std::fs::create_dir_all(cache_dir())?;
    let lock = std::fs::File::create(cache_dir().join(format!("{package}-{version}.lock")))?;
    // SAFETY: flock on a descriptor this function owns; released when `lock` is dropped.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        bail!(
            "locking the {package} install: {}",
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
            &format!("{package}=={version}"),
        ]),
        &format!("pip install {package}=={version}"),
    )?;
    if !exe.exists() {
        bail!("{} missing after the install", exe.display());
    }
    std::fs::write(&done, version)?;
    Ok(exe)
}
