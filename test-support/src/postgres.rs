//! A fresh Postgres database per test.
//!
//! With `DATABASE_URL` set, databases are created on that server. Without it, one throwaway
//! cluster is started per test binary (as the `postgres` user: initdb and postgres refuse to
//! run as root) on a free loopback port, and a watchdog stops it and removes its directory
//! when the test process exits. Missing binaries are an error, never a silent skip.
//!
//! A test that needs a store that goes down starts a [`Server`] of its own, which it may stop
//! and start again.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context, Result};
use sqlx::Connection;

const HOWTO: &str =
    "install Debian package postgresql or set DATABASE_URL, or run `cargo xtask test`";

/// A fresh, empty database for one test.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// `postgres://…/<fresh name>`.
    pub url: String,
    /// The database name.
    pub name: String,
}

/// A throwaway Postgres server on a free loopback port (trust authentication, no fsync),
/// stopped and removed when dropped, or by its watchdog when the test process exits first.
#[derive(Debug)]
pub struct Server {
    /// Admin URL (database `postgres`).
    admin_url: String,
    pg_ctl: PathBuf,
    dir: PathBuf,
    data: PathBuf,
    opts: String,
}

static CLUSTER: OnceLock<Result<Server, String>> = OnceLock::new();

fn find_bin(name: &str) -> Option<PathBuf> {
    let local = Path::new("/usr/local/bin").join(name);
    if local.exists() {
        return Some(local);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin").join(name))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop()
}

fn as_postgres(bin: &Path) -> Command {
    // initdb/postgres refuse to run as root; run them as the `postgres` user when we are root.
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    if is_root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

impl Server {
    /// Initialises a new cluster in a temporary directory and starts it.
    pub fn start() -> Result<Server> {
        let initdb = find_bin("initdb").ok_or_else(|| anyhow!("initdb not found: {HOWTO}"))?;
        let pg_ctl = find_bin("pg_ctl").ok_or_else(|| anyhow!("pg_ctl not found: {HOWTO}"))?;
        // Kept on disk on purpose: dropping the server or the watchdog below removes it.
        let dir = tempfile::Builder::new().prefix("rlc-pg-").tempdir()?.keep();
        let data = dir.join("data");
        // As root the cluster runs as `postgres` and needs the directory; otherwise this fails
        // and we run initdb ourselves.
        let _ = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status();
        let out = as_postgres(&initdb)
            .args(["-D"])
            .arg(&data)
            .args(["-A", "trust", "-U", "postgres", "--no-sync"])
            .output()
            .with_context(|| format!("running initdb ({HOWTO})"))?;
        if !out.status.success() {
            bail!(
                "initdb failed ({HOWTO}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            dir.display()
        );
        let server = Server {
            admin_url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            pg_ctl,
            dir,
            data,
            opts,
        };
        server.resume()?;
        // Stop the cluster when this test process exits (statics are never dropped, and a
        // test may be killed): a small watchdog waits for our pid to disappear. Its own
        // process group: a Ctrl-C meant for the test binary does not kill the watchdog before
        // it has stopped the cluster.
        let pid = std::process::id();
        let stop = format!(
            "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; {}; rm -rf {}",
            server.stop_command("immediate"),
            server.dir.display()
        );
        crate::process::spawn_in_group(
            Command::new("sh")
                .args(["-c", &stop])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
        .context("starting the cluster watchdog")?;
        Ok(server)
    }

    /// `pg_ctl stop` in `mode` as a shell command (as `postgres` when we are root).
    fn stop_command(&self, mode: &str) -> String {
        let (pg_ctl, data) = (self.pg_ctl.display(), self.data.display());
        format!(
            "runuser -u postgres -- {pg_ctl} -D {data} -m {mode} -w stop >/dev/null 2>&1 || \
             {pg_ctl} -D {data} -m {mode} -w stop >/dev/null 2>&1"
        )
    }

    /// Stops the server (fast shutdown: sessions are ended) and waits until it is down; its
    /// port then refuses connections until [`Server::resume`].
    pub fn stop(&self) -> Result<()> {
        let st = Command::new("sh")
            .args(["-c", &self.stop_command("fast")])
            .stdin(Stdio::null())
            .status()?;
        if !st.success() {
            bail!("pg_ctl stop failed");
        }
        Ok(())
    }

    /// Starts the (stopped) server again on the same port and data, and waits until it
    /// accepts connections.
    pub fn resume(&self) -> Result<()> {
        let out = as_postgres(&self.pg_ctl)
            .args(["-D"])
            .arg(&self.data)
            .args(["-o", &self.opts, "-l"])
            .arg(self.dir.join("log"))
            .args(["-w", "start"])
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running pg_ctl start ({HOWTO})"))?;
        if !out.status.success() {
            let log = std::fs::read_to_string(self.dir.join("log")).unwrap_or_default();
            bail!(
                "pg_ctl start failed: {}{log}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Creates a fresh database with a random name on this server.
    pub async fn fresh_database(&self) -> Result<TestDb> {
        create_database(&self.admin_url).await
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("sh")
            .args(["-c", &self.stop_command("immediate")])
            .stdin(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `url` with its database name replaced by `db`.
fn with_database(url: &str, db: &str) -> Result<String> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base
        .find("://")
        .ok_or_else(|| anyhow!("DATABASE_URL is not a URL"))?
        + 3;
    let host_part = match base[scheme_end..].find('/') {
        Some(i) => &base[..scheme_end + i],
        None => base,
    };
    Ok(match query {
        Some(q) => format!("{host_part}/{db}?{q}"),
        None => format!("{host_part}/{db}"),
    })
}

/// Creates a fresh database with a random name on `DATABASE_URL`'s server, or on this test
/// binary's throwaway cluster.
pub async fn fresh_database() -> Result<TestDb> {
    let admin = match std::env::var("DATABASE_URL") {
        Ok(u) if !u.is_empty() => u,
        _ => {
            let c = CLUSTER.get_or_init(|| Server::start().map_err(|e| format!("{e:#}")));
            match c {
                Ok(c) => c.admin_url.clone(),
                Err(e) => bail!("cannot start a throwaway Postgres: {e}"),
            }
        }
    };
    create_database(&admin).await
}

/// Creates a database with a random name through `admin` (a URL with the right to).
async fn create_database(admin: &str) -> Result<TestDb> {
    let name = format!("rlc_test_{:016x}", rand::random::<u64>());
    let mut conn = sqlx::PgConnection::connect(admin)
        .await
        .with_context(|| format!("connecting to Postgres to create a test database ({HOWTO})"))?;
    sqlx::query(&format!("CREATE DATABASE \"{name}\""))
        .execute(&mut conn)
        .await
        .context("CREATE DATABASE")?;
    let _ = conn.close().await;
    Ok(TestDb {
        url: with_database(admin, &name)?,
        name,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn database_name_is_replaced() {
        let u = super::with_database("postgres://u:p@h:5/app?sslmode=disable", "x").unwrap();
        assert_eq!(u, "postgres://u:p@h:5/x?sslmode=disable");
        assert_eq!(
            super::with_database("postgres://h", "x").unwrap(),
            "postgres://h/x"
        );
    }
}
