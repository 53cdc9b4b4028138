//! The plugin host: the child process that loads one plugin and answers its calls, so that a
//! plugin that panics across the C boundary, segfaults, hangs or exhausts memory takes down
//! only this process. The parent side is [`crate::isolated`].
//!
//! Started as `<host> __plugin-host --dir DIR --plugin NAME --memory-limit-bytes N` (the `rlc`
//! binary and `rlc-plugin-host` both accept it). In order, the host:
//! 1. sets `RLIMIT_AS` to N bytes (0 = no limit), soft and hard, before loading anything;
//! 2. moves the protocol to private descriptors (close-on-exec) and points its own stdin at
//!    `/dev/null` and stdout at stderr, so a plugin that reads stdin or prints cannot corrupt
//!    the protocol;
//! 3. starts a watchdog thread that kills the host's process group when the parent is gone;
//! 4. loads the plugin with [`crate::loader::load`] (the configured directory only, ABI version
//!    first) and writes one handshake line: `{"ready":{"protocol":1,"description":{…}}}`
//!    or `{"error":"…"}` (then exits with code 3);
//! 5. reads one JSON [`policy_abi::PluginInput`] per line and answers each with one line,
//!    `{"output":"<the plugin's answer, as text>"}` or `{"error":"…"}`, until stdin closes.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::FromRawFd;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The first argument that makes a program act as the plugin host.
pub const HOST_ARG: &str = "__plugin-host";
/// The version of the line protocol between `rlc` and its host process.
pub const PROTOCOL: u32 = 1;
/// Exit code of a host that could not load its plugin.
pub const EXIT_LOAD_FAILED: i32 = 3;
/// Exit code of a host started with wrong arguments.
pub const EXIT_USAGE: i32 = 64;

/// The handshake line.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Handshake {
    /// The plugin is loaded.
    Ready {
        /// [`PROTOCOL`] of the host.
        protocol: u32,
        /// What the plugin says about itself.
        description: policy_abi::Description,
    },
    /// It could not be loaded.
    Error(String),
}

/// The answer to one call.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Answer {
    /// The plugin's answer, unparsed.
    Output(String),
    /// The call could not be made (e.g. `compute` returned null).
    Error(String),
}

struct Args {
    dir: PathBuf,
    plugin: String,
    memory_limit_bytes: u64,
}

/// Why the host's arguments are wrong (printed above the usage line).
#[derive(Debug, thiserror::Error)]
enum UsageError {
    #[error("{0} needs a value")]
    NoValue(String),
    #[error("--memory-limit-bytes: {0}")]
    MemoryLimit(std::num::ParseIntError),
    #[error("unknown argument {0}")]
    Unknown(String),
    #[error("{0} is required")]
    Required(&'static str),
}

fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Args, UsageError> {
    let mut it = args.into_iter().peekable();
    if it.peek().is_some_and(|a| a == HOST_ARG) {
        it.next();
    }
    let (mut dir, mut plugin, mut mem) = (None, None, 0u64);
    while let Some(a) = it.next() {
        let a = a.to_string_lossy().into_owned();
        let Some(v) = it.next() else {
            return Err(UsageError::NoValue(a));
        };
        match a.as_str() {
            "--dir" => dir = Some(PathBuf::from(v)),
            "--plugin" => plugin = Some(v.to_string_lossy().into_owned()),
            "--memory-limit-bytes" => {
                mem = v
                    .to_string_lossy()
                    .parse()
                    .map_err(UsageError::MemoryLimit)?
            }
            _ => return Err(UsageError::Unknown(a)),
        }
    }
    Ok(Args {
        dir: dir.ok_or(UsageError::Required("--dir"))?,
        plugin: plugin.ok_or(UsageError::Required("--plugin"))?,
        memory_limit_bytes: mem,
    })
}

/// Runs the host with `args` (the program's arguments after its name, `__plugin-host` first
/// or not) and returns the exit code. Call it before anything else in `main`.
pub fn main(args: impl IntoIterator<Item = OsString>) -> i32 {
    let args = match parse_args(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("rlc plugin host: {e}");
            eprintln!("usage: {HOST_ARG} --dir DIR --plugin NAME [--memory-limit-bytes N]");
            return EXIT_USAGE;
        }
    };
    if let Err(e) = limit_memory(args.memory_limit_bytes) {
        eprintln!("rlc plugin host: setrlimit(RLIMIT_AS): {e}");
        return EXIT_USAGE;
    }
    let (input, mut output) = match private_stdio() {
        Ok(io) => io,
        Err(e) => {
            eprintln!("rlc plugin host: cannot set up its descriptors: {e}");
            return EXIT_USAGE;
        }
    };
    start_watchdog();
    let plugin = match crate::loader::load(&args.dir, &args.plugin) {
        Ok(p) => p,
        Err(e) => {
            let message = match e {
                crate::PolicyError::Plugin { message, .. } => message,
                e => e.to_string(),
            };
            let _ = send(&mut output, &Handshake::Error(message));
            return EXIT_LOAD_FAILED;
        }
    };
    let hello = Handshake::Ready {
        protocol: PROTOCOL,
        description: plugin.description().clone(),
    };
    if send(&mut output, &hello).is_err() {
        return 0;
    }
    let mut input = BufReader::new(input);
    let mut line = String::new();
    loop {
        line.clear();
        match input.read_line(&mut line) {
            Ok(0) | Err(_) => return 0, // the parent closed the pipe or is gone
            Ok(_) => {}
        }
        let answer = match plugin.call(line.trim_end_matches('\n')) {
            Ok(out) => Answer::Output(out),
            Err(crate::PolicyError::Plugin { message, .. }) => Answer::Error(message),
            Err(e) => Answer::Error(e.to_string()),
        };
        if send(&mut output, &answer).is_err() {
            return 0;
        }
    }
}

fn send(out: &mut File, v: &impl Serialize) -> std::io::Result<()> {
    let mut line = serde_json::to_string(v).map_err(std::io::Error::other)?;
    line.push('\n');
    out.write_all(line.as_bytes())?;
    out.flush()
}

fn limit_memory(bytes: u64) -> std::io::Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let lim = libc::rlimit {
        rlim_cur: bytes as libc::rlim_t,
        rlim_max: bytes as libc::rlim_t,
    };
    // SAFETY: plain system call on a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The protocol's input and output on fresh close-on-exec descriptors; fd 0 becomes
/// `/dev/null` and fd 1 a copy of fd 2.
fn private_stdio() -> std::io::Result<(File, File)> {
    // SAFETY: descriptor juggling with plain system calls; each result is checked, and the
    // new descriptors are owned by the returned Files only.
    unsafe {
        let dup = |fd: i32| {
            let n = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3);
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n)
            }
        };
        let input = dup(0)?;
        let output = dup(1)?;
        let null = File::open("/dev/null")?;
        use std::os::fd::AsRawFd;
        if libc::dup2(null.as_raw_fd(), 0) < 0 || libc::dup2(2, 1) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((File::from_raw_fd(input), File::from_raw_fd(output)))
    }
}

/// A thread that kills the host's process group (the host, and anything a plugin started)
/// once the parent is gone, even while the main thread is stuck in a plugin call.
fn start_watchdog() {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let _ = std::thread::Builder::new()
        .name("parent-watchdog".into())
        .stack_size(64 * 1024)
        .spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_millis(500));
            // SAFETY: plain system calls.
            unsafe {
                if libc::getppid() != parent {
                    // Only a group of its own (as rlc starts it) is killed as a whole.
                    if libc::getpgrp() == libc::getpid() {
                        libc::killpg(0, libc::SIGKILL);
                    }
                    libc::_exit(1);
                }
            }
        });
}
