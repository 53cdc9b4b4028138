//! A fresh Postgres database per test.
//!
//! With `DATABASE_URL` set, databases are created on that server. Without it, one throwaway
//! cluster is started per test binary (as the `postgres` user: initdb and postgres refuse to
//! run as root) on a free loopback port, and a watchdog stops it and removes its directory
//! when the test process exits. Missing binaries are an error, never a silent skip.

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

struct Cluster {
    /// Admin URL (database `postgres`).
    admin_url: String,
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();

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

fn start_cluster() -> Result<Cluster> {
    let initdb = find_bin("initdb").ok_or_else(|| anyhow!("initdb not found: {HOWTO}"))?;
    let pg_ctl = find_bin("pg_ctl").ok_or_else(|| anyhow!("pg_ctl not found: {HOWTO}"))?;
    // Kept on disk on purpose: the watchdog below removes it after the process exits.
    let dir = tempfile::Builder::new().prefix("rlc-pg-").tempdir()?.keep();
    let data = dir.join("data");
    // As root the cluster runs as `postgres` and needs the directory; otherwise this fails and
    // we run initdb ourselves.
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
    let out = as_postgres(&pg_ctl)
        .args(["-D"])
        .arg(&data)
        .args(["-o", &opts, "-l"])
        .arg(dir.join("log"))
        .args(["-w", "start"])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running pg_ctl start ({HOWTO})"))?;
    if !out.status.success() {
        let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
        bail!(
            "pg_ctl start failed: {}{log}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Stop the cluster when this test process exits: statics are never dropped, so a small
    // watchdog waits for our pid to disappear.
    let pid = std::process::id();
    let stop = format!(
        "while kill -0 {pid} 2>/dev/null; do sleep 0.5; done; \
         runuser -u postgres -- {} -D {} -m immediate stop >/dev/null 2>&1 || {} -D {} -m immediate stop >/dev/null 2>&1; \
         rm -rf {}",
        pg_ctl.display(),
        data.display(),
        pg_ctl.display(),
        data.display(),
        dir.display()
    );
    // Its own process group: a Ctrl-C meant for the test binary does not kill the watchdog
    // before it has stopped the cluster.
    crate::process::spawn_in_group(
        Command::new("sh")
            .args(["-c", &stop])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .context("starting the cluster watchdog")?;
    Ok(Cluster {
        admin_url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
    })
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
            let c = CLUSTER.get_or_init(|| start_cluster().map_err(|e| format!("{e:#}")));
            match c {
                Ok(c) => c.admin_url.clone(),
                Err(e) => bail!("cannot start a throwaway Postgres: {e}"),
            }
        }
    };
    let name = format!("rlc_test_{:016x}", rand::random::<u64>());
    let mut conn = sqlx::PgConnection::connect(&admin)
        .await
        .with_context(|| format!("connecting to Postgres to create a test database ({HOWTO})"))?;
    sqlx::query(&format!("CREATE DATABASE \"{name}\""))
        .execute(&mut conn)
        .await
        .context("CREATE DATABASE")?;
    let _ = conn.close().await;
    Ok(TestDb {
        url: with_database(&admin, &name)?,
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
