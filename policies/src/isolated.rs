//! Plugins run out of process: one host process per plugin ([`crate::host`]), JSON lines over
//! pipes, a timeout per call, an address-space limit, bounded restarts. Whatever a plugin does
//! (panic across the C boundary, segfault, hang, exhaust memory, print to stdout) fails only the
//! calls made to it, with an error naming what happened; the calling process lives on.
//!
//! - The host is `settings.host` started as `HOST __plugin-host --dir … --plugin … --memory-limit-bytes …`
//!   in a process group of its own; see [`default_host`] for where the program comes from.
//! - A call that takes longer than `settings.timeout` (the start, i.e. loading and describing
//!   the plugin, too) kills the host's whole process group: "timed out after 5s".
//! - A host that died is described from its wait status and the tail of its stderr: "died with
//!   signal 11 (SIGSEGV)", "died with signal 6 (SIGABRT): memory allocation of … failed (memory
//!   limit 256 MiB)". An answer longer than [`MAX_ANSWER_BYTES`] kills it too.
//! - A dead host is started again on the next call, at most `settings.max_restarts` times within
//!   [`RESTART_WINDOW`]; beyond that the plugin's calls fail at once ("disabled …", naming the
//!   last failure) until the oldest failure leaves the window.
//! - A host whose parent is gone kills its own process group (see [`crate::host`]).

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use policy_abi::{Description, PluginInput, PluginResult};
use schema::PolicyName;

use crate::host::{Answer, Handshake, HOST_ARG, PROTOCOL};
use crate::loader::err;
use crate::{headroom, Policy, PolicyError, PolicyInput, Proposal};

/// Restarts are counted over this window.
pub const RESTART_WINDOW: Duration = Duration::from_secs(600);
/// The longest answer line read from a host (a larger one kills it).
pub const MAX_ANSWER_BYTES: usize = 16 << 20;
/// Environment variable naming the host program (after `plugins.host` in rlc.yaml).
pub const HOST_ENV: &str = "RLC_PLUGIN_HOST";
/// The dedicated host binary's name, looked for next to the running executable.
pub const HOST_BINARY: &str = "rlc-plugin-host";
/// Bytes kept of the start and of the end of a host's stderr, to explain its death.
const STDERR_KEEP: usize = 8192;

/// How plugin hosts are started and bounded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The host program (the `rlc` binary or `rlc-plugin-host`).
    pub host: PathBuf,
    /// Bound on one call, and on a host's start.
    pub timeout: Duration,
    /// `RLIMIT_AS` of the host, in bytes (0 = none).
    pub memory_limit_bytes: u64,
    /// Restarts allowed within [`RESTART_WINDOW`].
    pub max_restarts: u32,
}

static SELF_HOST: OnceLock<PathBuf> = OnceLock::new();

/// Why there is no plugin host program to start.
#[derive(Debug, thiserror::Error)]
pub enum NoHost {
    /// The running executable (next to which the host is looked for) is unknown.
    #[error("cannot find the running executable: {0}")]
    NoExecutable(std::io::Error),
    /// Not configured, and not next to the running executable.
    #[error("no plugin host: set `plugins.host` in rlc.yaml or {HOST_ENV} to the rlc binary or {HOST_BINARY} (looked for {looked})", HOST_ENV = HOST_ENV, HOST_BINARY = HOST_BINARY)]
    NotFound {
        /// The paths looked at, comma-separated.
        looked: String,
    },
}

/// Why a plugin's host could not be started, or did not answer a call.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// Its host failed more than `max_restarts` times within [`RESTART_WINDOW`].
    #[error("disabled: its host failed {failures} times within {minutes} minutes (max_restarts {max_restarts}); last: {last}")]
    Disabled {
        failures: usize,
        minutes: u64,
        max_restarts: u32,
        /// The last failure.
        last: String,
    },
    /// The host program could not be started.
    #[error("cannot start the plugin host {}: {error}", .host.display())]
    Spawn {
        host: PathBuf,
        error: std::io::Error,
    },
    /// The host ended (died, timed out, broke the protocol) before its handshake.
    #[error("while starting: {0}")]
    Starting(String),
    /// The host speaks another version of the protocol.
    #[error("the plugin host {} speaks protocol {protocol}, this rlc {PROTOCOL}: use the host of the same rlc version", .host.display(), PROTOCOL = PROTOCOL)]
    Protocol { host: PathBuf, protocol: u32 },
    /// The program's first line is not a handshake.
    #[error("{} is not a plugin host (its first line {head:?}: {error})", .host.display())]
    NotAHost {
        host: PathBuf,
        /// The first 80 characters of its first line.
        head: String,
        error: serde_json::Error,
    },
    /// The host's or the plugin's own error (a plugin that cannot be loaded, a call it could
    /// not answer): text, as it crosses the JSON line protocol.
    #[error("{0}")]
    Plugin(String),
    /// The host stopped answering a call: why it ended (see `Running::finish`).
    #[error("{0}")]
    Ended(String),
}

/// Declares that the running executable acts as the plugin host when started with
/// `__plugin-host` (the `rlc` binary does, first thing in `main`). On Linux `/proc/self/exe`
/// is used, so the host is always the very binary that runs, even once it was replaced on disk.
pub fn host_is_current_exe() {
    let exe = if Path::new("/proc/self/exe").exists() {
        Some(PathBuf::from("/proc/self/exe"))
    } else {
        std::env::current_exe().ok()
    };
    if let Some(exe) = exe {
        let _ = SELF_HOST.set(exe);
    }
}

/// The host program when rlc.yaml names none: `$RLC_PLUGIN_HOST`, else the running executable
/// if it declared itself ([`host_is_current_exe`]), else `rlc-plugin-host` next to the running
/// executable (or one directory up from cargo's `deps/`, where test binaries live).
pub fn default_host() -> Result<PathBuf, NoHost> {
    if let Some(p) = std::env::var_os(HOST_ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = SELF_HOST.get() {
        return Ok(p.clone());
    }
    let exe = std::env::current_exe().map_err(NoHost::NoExecutable)?;
    let name = format!("{HOST_BINARY}{}", std::env::consts::EXE_SUFFIX);
    let mut looked = Vec::new();
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let p = d.join(&name);
        if p.is_file() {
            return Ok(p);
        }
        looked.push(p.display().to_string());
        if d.file_name().is_some_and(|n| n == "deps") {
            dir = d.parent();
        } else {
            break;
        }
    }
    Err(NoHost::NotFound {
        looked: looked.join(", "),
    })
}

type Registry = Mutex<HashMap<PathBuf, &'static IsolatedPlugin>>;

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// The plugin `name` from `dir`, run in its own host process, started now if it is not running
/// (so that a plugin that cannot be loaded fails here, with the host's reason). One instance per
/// plugin file; new settings for the same file stop the old host.
pub fn load(
    dir: &Path,
    name: &str,
    settings: &Settings,
) -> Result<&'static IsolatedPlugin, PolicyError> {
    let path = crate::loader::resolve(dir, name)?;
    let plugin = {
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        match reg.get(&path) {
            Some(p) if p.settings == *settings && p.name == name => *p,
            old => {
                if let Some(old) = old {
                    old.stop();
                }
                let dir = dir
                    .canonicalize()
                    .map_err(|e| err(name, format!("plugin directory {}: {e}", dir.display())))?;
                let p: &'static IsolatedPlugin = Box::leak(Box::new(IsolatedPlugin {
                    name: name.to_string(),
                    dir,
                    path: path.clone(),
                    settings: settings.clone(),
                    state: Mutex::new(State::default()),
                }));
                reg.insert(path, p);
                p
            }
        }
    };
    let mut st = plugin.lock();
    plugin
        .ensure_running(&mut st)
        .map_err(|e| err(name, e.to_string()))?;
    Ok(plugin)
}

/// A plugin run in a host process. Lives for the whole process (at most one per plugin file
/// and settings).
pub struct IsolatedPlugin {
    name: String,
    dir: PathBuf,
    path: PathBuf,
    settings: Settings,
    state: Mutex<State>,
}

impl std::fmt::Debug for IsolatedPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IsolatedPlugin")
            .field("name", &self.name)
            .field("path", &self.path)
            .field("settings", &self.settings)
            .finish()
    }
}

#[derive(Default)]
struct State {
    running: Option<Running>,
    description: Option<Description>,
    /// Failures (start or death) within the restart window, oldest first.
    failures: VecDeque<(Instant, String)>,
    starts: u64,
}

impl IsolatedPlugin {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the plugin says about itself (from the last start).
    pub fn description(&self) -> Option<Description> {
        self.lock().description.clone()
    }

    /// The file it is loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The process id of its running host, if one runs.
    pub fn host_pid(&self) -> Option<u32> {
        self.lock().running.as_ref().map(|r| r.child.id())
    }

    /// How many host processes were started so far.
    pub fn starts(&self) -> u64 {
        self.lock().starts
    }

    /// Stops the host process (the next call starts one again).
    pub fn stop(&self) {
        if let Some(mut r) = self.lock().running.take() {
            r.finish(End::Stopped, &self.settings);
        }
    }

    fn ensure_running(&self, st: &mut State) -> Result<(), HostError> {
        if st.running.is_some() {
            return Ok(());
        }
        let now = Instant::now();
        while st
            .failures
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > RESTART_WINDOW)
        {
            st.failures.pop_front();
        }
        if st.failures.len() > self.settings.max_restarts as usize {
            let last = st.failures.back().map(|f| f.1.as_str()).unwrap_or("");
            return Err(HostError::Disabled {
                failures: st.failures.len(),
                minutes: RESTART_WINDOW.as_secs() / 60,
                max_restarts: self.settings.max_restarts,
                last: last.to_string(),
            });
        }
        st.starts += 1;
        match self.start() {
            Ok((r, d)) => {
                st.running = Some(r);
                st.description = Some(d);
                Ok(())
            }
            Err(e) => {
                st.failures.push_back((now, e.to_string()));
                Err(e)
            }
        }
    }

    fn start(&self) -> Result<(Running, Description), HostError> {
        let s = &self.settings;
        let mut cmd = Command::new(&s.host);
        cmd.arg(HOST_ARG)
            .arg("--dir")
            .arg(&self.dir)
            .arg("--plugin")
            .arg(&self.name)
            .arg("--memory-limit-bytes")
            .arg(s.memory_limit_bytes.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its stderr is read for the cause of a death: the panic message, not a backtrace.
            .env("RUST_BACKTRACE", "0")
            .process_group(0);
        let mut child = cmd.spawn().map_err(|error| HostError::Spawn {
            host: s.host.clone(),
            error,
        })?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let mut stderr = child.stderr.take().expect("piped");
        let tail = Arc::new(Mutex::new(Tail::default()));
        let t = tail.clone();
        let _ = std::thread::Builder::new()
            .name(format!("plugin-{}-stderr", self.name))
            .spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    let n = match stderr.read(&mut buf) {
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(_) => 0,
                    };
                    let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
                    if n == 0 {
                        t.closed = true;
                        break;
                    }
                    t.push(&buf[..n]);
                }
            });
        let (req_tx, req_rx) = mpsc::channel::<String>();
        let (ans_tx, ans_rx) = mpsc::channel();
        let _ = std::thread::Builder::new()
            .name(format!("plugin-{}-io", self.name))
            .spawn(move || io_loop(stdin, stdout, req_rx, ans_tx));
        let mut running = Running {
            child,
            requests: req_tx,
            answers: ans_rx,
            stderr: tail,
            done: false,
        };
        let end = match running.answers.recv_timeout(s.timeout) {
            Ok(Ok(line)) => Ok(line),
            Ok(Err(end)) => Err(end),
            Err(RecvTimeoutError::Disconnected) => Err(End::Eof),
            Err(RecvTimeoutError::Timeout) => Err(End::TimedOut),
        };
        let line = end.map_err(|end| HostError::Starting(running.finish(end, s)))?;
        match serde_json::from_str::<Handshake>(&line) {
            Ok(Handshake::Ready {
                protocol,
                description,
                ..
            }) if protocol == PROTOCOL => Ok((running, description)),
            Ok(Handshake::Ready { protocol, .. }) => {
                running.finish(End::Stopped, s);
                Err(HostError::Protocol {
                    host: s.host.clone(),
                    protocol,
                })
            }
            Ok(Handshake::Error(m)) => {
                running.finish(End::Stopped, s);
                Err(HostError::Plugin(m))
            }
            Err(error) => {
                running.finish(End::Stopped, s);
                Err(HostError::NotAHost {
                    host: s.host.clone(),
                    head: line.chars().take(80).collect(),
                    error,
                })
            }
        }
    }

    /// Sends one JSON input to the plugin and returns its answer as text (unchecked).
    pub fn call(&self, input_json: String) -> Result<String, HostError> {
        let mut st = self.lock();
        self.ensure_running(&mut st)?;
        let r = st.running.as_mut().expect("running");
        let end = if r.requests.send(input_json).is_err() {
            End::Eof
        } else {
            match r.answers.recv_timeout(self.settings.timeout) {
                Ok(Ok(line)) => match serde_json::from_str::<Answer>(&line) {
                    Ok(Answer::Output(out)) => return Ok(out),
                    Ok(Answer::Error(m)) => return Err(HostError::Plugin(m)),
                    Err(_) => End::Protocol,
                },
                Ok(Err(end)) => end,
                Err(RecvTimeoutError::Disconnected) => End::Eof,
                Err(RecvTimeoutError::Timeout) => End::TimedOut,
            }
        };
        let mut r = st.running.take().expect("running");
        let cause = r.finish(end, &self.settings);
        st.failures.push_back((Instant::now(), cause.clone()));
        Err(HostError::Ended(cause))
    }
}

impl Policy for IsolatedPlugin {
    fn name(&self) -> PolicyName {
        PolicyName::Plugin(self.name.clone())
    }

    fn compute(&self, input: &PolicyInput<'_>) -> Result<Proposal, PolicyError> {
        if crate::is_auto(input.spec) {
            return crate::margin::compute(self, input);
        }
        let s = input.series;
        let pin = PluginInput {
            service: input.service.to_string(),
            caller: input.caller.map(str::to_string),
            procedure: input.procedure.map(str::to_string),
            start: s.start,
            step: s.step,
            values: s
                .values
                .iter()
                .map(|v| (!v.is_nan()).then_some(*v))
                .collect(),
            headroom: Some(headroom(input.spec)),
            capacity_share_rps: input.capacity_share_rps,
            params: input.spec.params.clone().unwrap_or(serde_json::Value::Null),
        };
        let json = serde_json::to_string(&pin).map_err(|e| err(&self.name, e.to_string()))?;
        let out = self
            .call(json)
            .map_err(|e| err(&self.name, e.to_string()))?;
        let result: PluginResult = serde_json::from_str(&out).map_err(|e| {
            let head: String = out.chars().take(80).collect();
            err(
                &self.name,
                format!("compute returned invalid JSON ({e}): {head:?}"),
            )
        })?;
        match result {
            PluginResult::Error(m) => Err(err(&self.name, m)),
            PluginResult::Ok(o) => Ok(Proposal {
                limit_rps: o.limit_rps,
                shadow: o.shadow,
                policy: self.name(),
                peak_rps: s.max().unwrap_or(0.0),
                confidence: o.confidence.unwrap_or(0.0).clamp(0.0, 1.0),
                evidence: serde_json::json!({"plugin": self.name, "path": self.path, "output": o.evidence}),
            }),
        }
    }
}

/// Why a host stopped answering.
#[derive(Debug, Clone, Copy, PartialEq)]
enum End {
    /// Its output closed (it died, usually).
    Eof,
    /// No answer within the timeout.
    TimedOut,
    /// An answer over [`MAX_ANSWER_BYTES`].
    TooLong,
    /// A line that is not the protocol.
    Protocol,
    /// Stopped by rlc (settings changed, bad handshake).
    Stopped,
}

struct Running {
    child: Child,
    requests: mpsc::Sender<String>,
    answers: mpsc::Receiver<Result<String, End>>,
    stderr: Arc<Mutex<Tail>>,
    done: bool,
}

/// What a host wrote to stderr: the first and the last [`STDERR_KEEP`] bytes.
#[derive(Default)]
struct Tail {
    head: Vec<u8>,
    tail: Vec<u8>,
    /// Bytes were dropped between head and tail.
    cut: bool,
    /// Its stderr reached end of file.
    closed: bool,
}

impl Tail {
    fn push(&mut self, mut b: &[u8]) {
        let room = STDERR_KEEP.saturating_sub(self.head.len());
        let n = room.min(b.len());
        self.head.extend_from_slice(&b[..n]);
        b = &b[n..];
        self.tail.extend_from_slice(b);
        if self.tail.len() > 2 * STDERR_KEEP {
            let cut = self.tail.len() - STDERR_KEEP;
            self.tail.drain(..cut);
            self.cut = true;
        }
    }

    /// Head and tail as text (a partial line where bytes were dropped is left out).
    fn text(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.head).into_owned();
        let mut tail: &[u8] = &self.tail;
        if self.cut {
            let nl = tail
                .iter()
                .position(|&c| c == b'\n')
                .map_or(tail.len(), |i| i + 1);
            tail = &tail[nl..];
            if let Some(i) = s.rfind('\n') {
                s.truncate(i + 1);
            }
        }
        s.push_str(&String::from_utf8_lossy(tail));
        s
    }
}

impl Running {
    /// Stops the host (its whole process group) and says what happened to it.
    fn finish(&mut self, end: End, s: &Settings) -> String {
        self.done = true;
        let pid = self.child.id() as libc::pid_t;
        if end == End::Eof {
            // It closed its output: give it a moment to exit by itself, so that its own wait
            // status (a signal, an exit code) is what gets reported.
            let deadline = Instant::now() + Duration::from_secs(1);
            while !exited(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let exited_alone = exited(pid);
        // The leader is not reaped yet, so its group id cannot have been reused.
        // SAFETY: plain system call.
        unsafe { libc::killpg(pid, libc::SIGKILL) };
        let status = self.child.wait();
        let what = match end {
            End::TimedOut => format!(
                "timed out after {}; its host process was killed",
                fmt_secs(s.timeout)
            ),
            End::TooLong => format!(
                "answered more than {} MiB; its host process was killed",
                MAX_ANSWER_BYTES >> 20
            ),
            End::Protocol => "broke the host protocol; its host process was killed".into(),
            End::Stopped => "stopped".into(),
            End::Eof if !exited_alone => "closed its output; its host process was killed".into(),
            End::Eof => match status {
                Ok(st) => match (st.signal(), st.code()) {
                    (Some(sig), _) => format!("died with signal {sig} ({})", signal_name(sig)),
                    (None, Some(code)) => format!("exited with code {code}"),
                    (None, None) => format!("ended ({st})"),
                },
                Err(e) => format!("died (wait failed: {e})"),
            },
        };
        // Its last words: wait (briefly) until the stderr reader has read everything.
        let deadline = Instant::now() + Duration::from_millis(500);
        while !self.stderr.lock().unwrap_or_else(|p| p.into_inner()).closed
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        let tail = stderr_summary(&self.stderr.lock().unwrap_or_else(|p| p.into_inner()).text());
        let mut out = what;
        if !tail.is_empty() && end != End::Stopped {
            out.push_str(": ");
            out.push_str(&tail);
        }
        let t = tail.to_ascii_lowercase();
        if s.memory_limit_bytes > 0
            && (t.contains("memory allocation")
                || t.contains("out of memory")
                || t.contains("cannot allocate"))
        {
            out.push_str(&format!(
                " (memory limit {} MiB)",
                s.memory_limit_bytes >> 20
            ));
        }
        out
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            // SAFETY: plain system call; the leader is not reaped yet.
            unsafe { libc::killpg(self.child.id() as libc::pid_t, libc::SIGKILL) };
            let _ = self.child.wait();
        }
    }
}

/// Whether `pid` (our child) has exited, without reaping it.
fn exited(pid: libc::pid_t) -> bool {
    // SAFETY: waitid with WNOWAIT only looks; the struct is zeroed and written by the kernel.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        ) == 0
            && info.si_pid() != 0
    }
}

fn fmt_secs(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

/// What a host's stderr says about its end, ≤ 300 chars: the messages of its panics if it
/// panicked, else its last meaningful lines (no backtrace frames, no notes).
fn stderr_summary(text: &str) -> String {
    let all: Vec<&str> = text.lines().map(str::trim_end).collect();
    let panics: Vec<&str> = all
        .windows(2)
        .filter(|w| w[0].contains(" panicked at ") && !w[1].is_empty())
        .map(|w| w[1])
        .collect();
    if !panics.is_empty() {
        return clip(format!("panicked: {}", panics.join("; ")));
    }
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| {
            !l.is_empty()
                && !l.starts_with(char::is_whitespace)
                && !l.starts_with("note:")
                && !l.starts_with("stack backtrace")
        })
        .collect();
    let last: Vec<&str> = lines.iter().rev().take(3).rev().copied().collect();
    clip(last.join(" | "))
}

fn clip(s: String) -> String {
    if s.chars().count() > 300 {
        let cut: String = s
            .chars()
            .rev()
            .take(300)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        format!("…{cut}")
    } else {
        s
    }
}

/// A signal's name, e.g. `SIGSEGV`.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGSYS => "SIGSYS",
        _ => "signal",
    }
}

/// Writes each request line, reads each answer line (bounded), until the host or rlc is done.
/// The first line read is the handshake.
fn io_loop(
    mut stdin: ChildStdin,
    stdout: ChildStdout,
    requests: mpsc::Receiver<String>,
    answers: mpsc::Sender<Result<String, End>>,
) {
    let mut r = BufReader::new(stdout);
    let first = read_line(&mut r);
    let stop = first.is_err();
    if answers.send(first).is_err() || stop {
        return;
    }
    for mut req in requests {
        req.push('\n');
        if stdin
            .write_all(req.as_bytes())
            .and_then(|_| stdin.flush())
            .is_err()
        {
            let _ = answers.send(Err(End::Eof));
            return;
        }
        let a = read_line(&mut r);
        let stop = a.is_err();
        if answers.send(a).is_err() || stop {
            return;
        }
    }
}

fn read_line(r: &mut impl BufRead) -> Result<String, End> {
    let mut buf = Vec::new();
    loop {
        let chunk = match r.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return Err(End::Eof),
        };
        if chunk.is_empty() {
            return Err(End::Eof);
        }
        if let Some(i) = chunk.iter().position(|&b| b == b'\n') {
            buf.extend_from_slice(&chunk[..i]);
            r.consume(i + 1);
            break;
        }
        let n = chunk.len();
        buf.extend_from_slice(chunk);
        r.consume(n);
        if buf.len() > MAX_ANSWER_BYTES {
            return Err(End::TooLong);
        }
    }
    if buf.len() > MAX_ANSWER_BYTES {
        return Err(End::TooLong);
    }
    String::from_utf8(buf).map_err(|_| End::Protocol)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_summary_keeps_the_cause() {
        let t = "thread 'main' panicked at src/lib.rs:1:1:\nboom\nnote: run with `RUST_BACKTRACE=1`\n\nthread 'main' panicked at core/src/panicking.rs:225:5:\npanic in a function that cannot unwind\nstack backtrace:\n   0: foo\nthread caused non-unwinding panic. aborting.\n";
        assert_eq!(
            stderr_summary(t),
            "panicked: boom; panic in a function that cannot unwind"
        );
        assert_eq!(
            stderr_summary("loading\nmemory allocation of 67108864 bytes failed\n"),
            "loading | memory allocation of 67108864 bytes failed"
        );
        let long = "x".repeat(1000);
        assert!(stderr_summary(&long).chars().count() <= 301);
        assert_eq!(stderr_summary(""), "");
    }

    #[test]
    fn stderr_keeps_its_start_and_its_end() {
        let mut t = Tail::default();
        t.push(b"first line\n");
        for i in 0..10_000 {
            t.push(format!("frame {i}\n").as_bytes());
        }
        t.push(b"last line\n");
        let text = t.text();
        assert!(text.starts_with("first line\n") && text.ends_with("frame 9999\nlast line\n"));
        assert!(text.len() <= 3 * STDERR_KEEP);
        assert!(
            text.lines()
                .all(|l| l == "first line" || l == "last line" || l.starts_with("frame ")),
            "no partial line"
        );
    }

    #[test]
    fn lines_are_bounded() {
        let mut r = BufReader::new(&b"{\"a\":1}\nrest"[..]);
        assert_eq!(read_line(&mut r), Ok("{\"a\":1}".to_string()));
        assert_eq!(
            read_line(&mut r),
            Err(End::Eof),
            "no newline: the host died mid-line"
        );
        let big = vec![b'x'; MAX_ANSWER_BYTES + 10];
        assert_eq!(read_line(&mut BufReader::new(&big[..])), Err(End::TooLong));
    }

    #[test]
    fn default_host_prefers_the_environment() {
        // Only this test touches the variable in this binary.
        std::env::set_var(HOST_ENV, "/opt/rlc/bin/rlc");
        assert_eq!(default_host().ok(), Some(PathBuf::from("/opt/rlc/bin/rlc")));
        std::env::remove_var(HOST_ENV);
    }
}
