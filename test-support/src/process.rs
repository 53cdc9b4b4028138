//! Child processes and ports for tests that run the real binaries.

use std::process::Child;

/// A child process killed (SIGKILL) and reaped when dropped, so a failing test leaves no
/// server behind.
pub struct Proc(pub Child);

impl Proc {
    /// Kills the process now.
    pub fn kill(self) {
        drop(self);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
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
