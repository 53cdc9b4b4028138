//! Child processes and ports for tests that run the real binaries.
//!
//! Every child a test starts through this crate runs in its own process group
//! ([`spawn_in_group`]), and stopping it stops the whole group ([`stop_group`]): SIGTERM to
//! the group, a bounded wait, then SIGKILL. A wrapper that forks (`git daemon` forks
//! `git-daemon`) therefore never leaves its children behind.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// How long [`stop_group`] waits after SIGTERM before it sends SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// Spawns `cmd` as the leader of a new process group (`process_group(0)`), so that the
/// group can be stopped as a whole with [`stop_group`].
pub fn spawn_in_group(cmd: &mut Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0).spawn()
}

/// True when `pid` leads its own process group (it was started by [`spawn_in_group`]).
fn leads_group(pid: u32) -> bool {
    // SAFETY: getpgid only reads the process table.
    let pgid = unsafe { libc::getpgid(pid as libc::pid_t) };
    pgid == pid as libc::pid_t
}

fn signal_group(pgid: u32, sig: libc::c_int) {
    // SAFETY: kill with a negative pid signals the process group `pgid`; it has no memory
    // effects. `pgid` is a child of ours that leads its own group, so the group is ours.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), sig);
    }
}

/// Members of process group `pgid` that still run (zombies excluded), from `/proc`.
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // `pid (comm) state ppid pgrp …`: comm may hold spaces, so split after the last ')'.
            let Some((_, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            f.len() > 2 && f[0] != "Z" && f[0] != "X" && f[2].parse::<u32>().ok() == Some(pgid)
        })
        .collect()
}

/// Stops `child` and its whole process group: SIGTERM to the group, up to `grace` for the
/// group to exit, then SIGKILL to whatever is left; the child is reaped. A child that does
/// not lead its own group (spawned without [`spawn_in_group`]) gets the same treatment alone.
pub fn stop_group(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        // Already reaped: its pid may be reused, so only a group it left behind is signalled,
        // and only while that group still has members.
        let pgid = child.id();
        if !group_members(pgid).is_empty() {
            signal_group(pgid, libc::SIGKILL);
        }
        return;
    }
    let pgid = child.id();
    let group = leads_group(pgid);
    if group {
        signal_group(pgid, libc::SIGTERM);
    } else {
        // SAFETY: signals our own unreaped child.
        unsafe {
            libc::kill(pgid as libc::pid_t, libc::SIGTERM);
        }
    }
    let deadline = Instant::now() + grace;
    loop {
        let leader_done = matches!(child.try_wait(), Ok(Some(_)));
        let rest = if group {
            group_members(pgid)
        } else {
            Vec::new()
        };
        if leader_done && rest.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if group {
        signal_group(pgid, libc::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Kills `child`'s whole process group at once with SIGKILL (a crash, not a shutdown) and
/// reaps the child.
pub fn kill_group(child: &mut Child) {
    if let Ok(None) = child.try_wait() {
        if leads_group(child.id()) {
            signal_group(child.id(), libc::SIGKILL);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A child process stopped with its whole process group when dropped (SIGTERM, up to
/// [`STOP_GRACE`], then SIGKILL), so a failing test leaves no server behind. Start it with
/// [`Proc::spawn`] (its own process group); `Proc(child)` of a child spawned otherwise stops
/// that child alone.
pub struct Proc(pub Child);

impl Proc {
    /// Spawns `cmd` in its own process group.
    pub fn spawn(cmd: &mut Command) -> std::io::Result<Proc> {
        spawn_in_group(cmd).map(Proc)
    }

    /// Kills the process group now with SIGKILL: a crash, nothing is shut down cleanly.
    pub fn kill(mut self) {
        kill_group(&mut self.0);
    }

    /// Sends `sig` (e.g. `libc::SIGTERM`) to the process only, as a supervisor would.
    pub fn signal(&self, sig: i32) {
        // SAFETY: signals our own child, which is not reaped while `self` lives.
        unsafe {
            libc::kill(self.0.id() as libc::pid_t, sig);
        }
    }

    /// Waits up to `bound` for the process to exit; `None` when it still runs.
    pub fn wait_exit(&mut self, bound: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + bound;
        loop {
            if let Ok(Some(st)) = self.0.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        stop_group(&mut self.0, STOP_GRACE);
    }
}

/// A port free on 127.0.0.1 right now (the OS picks it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind 127.0.0.1:0")
        .local_addr()
        .expect("local addr")
        .port()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Stdio;

    #[test]
    fn dropping_a_proc_stops_its_whole_group() {
        // A shell that forks a grandchild, as `git daemon` does.
        let p = Proc::spawn(
            Command::new("sh")
                .args(["-c", "sleep 300 & sleep 300; wait"])
                .stdin(Stdio::null()),
        )
        .unwrap();
        let pgid = p.0.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while group_members(pgid).len() < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(group_members(pgid).len(), 3, "sh and its two sleeps");
        drop(p);
        assert_eq!(group_members(pgid), Vec::<u32>::new());
    }
}
