//! A throwaway real Prometheus, backfilled with generated history by `promtool`.
//!
//! [`OpenMetricsWriter`] writes samples (one metric family at a time, samples of a series in
//! time order, as promtool requires); [`Prometheus::start`] turns the file into TSDB blocks with
//! `promtool tsdb create-blocks-from openmetrics --max-block-duration=720h`, starts
//! `prometheus` on a free loopback port over them (no scrape targets, 10 y retention), waits for
//! `/-/ready`, and stops its process group on drop. [`Prometheus::scraping`] starts one on an
//! empty TSDB that scrapes live targets instead. Missing binaries are an error that says how
//! to get them.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const HOW_TO_GET: &str =
    "install Debian packages prometheus and victoria-metrics, or run `cargo xtask test`";

/// Writes an OpenMetrics text file for promtool.
pub struct OpenMetricsWriter {
    out: BufWriter<File>,
    path: PathBuf,
    line: String,
}

impl OpenMetricsWriter {
    /// Creates the file at `path`.
    pub fn create(path: &Path) -> Result<Self> {
        let f = File::create(path).with_context(|| format!("create {}", path.display()))?;
        Ok(Self {
            out: BufWriter::with_capacity(1 << 20, f),
            path: path.to_path_buf(),
            line: String::new(),
        })
    }

    /// Starts a metric family: `kind` is `gauge` or `counter` (counter samples are written as
    /// `<name>_total`).
    pub fn family(&mut self, name: &str, kind: &str) -> Result<()> {
        writeln!(self.out, "# TYPE {name} {kind}")?;
        Ok(())
    }

    /// One sample; `ts` in unix seconds. Write all samples of a series in time order.
    pub fn sample(
        &mut self,
        name: &str,
        labels: &[(&str, &str)],
        value: f64,
        ts: i64,
    ) -> Result<()> {
        self.line.clear();
        self.line.push_str(name);
        self.line.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                self.line.push(',');
            }
            let _ = write!(
                self.line,
                "{k}=\"{}\"",
                v.replace('\\', "\\\\").replace('"', "\\\"")
            );
        }
        let _ = writeln!(self.line, "}} {value} {ts}");
        self.out.write_all(self.line.as_bytes())?;
        Ok(())
    }

    /// Writes `# EOF` and returns the file's path.
    pub fn finish(mut self) -> Result<PathBuf> {
        self.out.write_all(b"# EOF\n")?;
        self.out.flush()?;
        Ok(self.path)
    }
}

/// A running Prometheus over backfilled blocks; its process group is stopped on drop.
pub struct Prometheus {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    child: Child,
    dir: tempfile::TempDir,
}

fn binary(name: &str) -> Result<PathBuf> {
    for dir in ["/usr/bin", "/usr/local/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return Ok(p);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join(name);
            if p.exists() {
                return Ok(p);
            }
        }
    }
    bail!("`{name}` not found: {HOW_TO_GET}")
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Prometheus {
    /// Backfills `openmetrics` (a file from [`OpenMetricsWriter`]) and starts Prometheus on it.
    pub fn start(openmetrics: &Path) -> Result<Self> {
        let promtool = binary("promtool")?;
        let dir = tempfile::Builder::new().prefix("prometheus-").tempdir()?;
        let data = dir.path().join("data");
        std::fs::create_dir(&data)?;
        let out = Command::new(&promtool)
            .args([
                "tsdb",
                "create-blocks-from",
                "openmetrics",
                "--max-block-duration=720h",
                "--quiet",
            ])
            .arg(openmetrics)
            .arg(&data)
            .output()
            .context("run promtool")?;
        if !out.status.success() {
            bail!(
                "promtool failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Self::run(
            dir,
            &data,
            "global:\n  scrape_interval: 1h\nscrape_configs: []\n",
        )
    }

    /// Backfills `openmetrics` into the TSDB directory `data` (created if missing) with blocks
    /// of at most `max_block` (e.g. `24h`). Several calls can fill one directory part by part;
    /// parts whose blocks overlap in time are merged by Prometheus (vertical compaction) later.
    pub fn backfill(openmetrics: &Path, data: &Path, max_block: &str) -> Result<()> {
        let promtool = binary("promtool")?;
        std::fs::create_dir_all(data)?;
        let out = Command::new(&promtool)
            .args(["tsdb", "create-blocks-from", "openmetrics", "--quiet"])
            .arg(format!("--max-block-duration={max_block}"))
            .arg(openmetrics)
            .arg(data)
            .output()
            .context("run promtool")?;
        if !out.status.success() {
            bail!(
                "promtool failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Starts Prometheus on an existing TSDB directory (kept when it stops), without
    /// compaction of blocks longer than `max_block` (so that reruns on the same directory
    /// query the same blocks).
    pub fn on_data(data: &Path, max_block: &str) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("prometheus-").tempdir()?;
        Self::run_with(
            dir,
            data,
            "global:\n  scrape_interval: 1h\nscrape_configs: []\n",
            &[
                "--storage.tsdb.min-block-duration=2h".to_string(),
                format!("--storage.tsdb.max-block-duration={max_block}"),
            ],
        )
    }

    /// Starts Prometheus on an empty TSDB scraping `targets` (`host:port`, `/metrics`) every
    /// `interval` (whole seconds, at least 1 s; the scrape timeout is the same).
    pub fn scraping(targets: &[String], interval: Duration) -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("prometheus-").tempdir()?;
        let data = dir.path().join("data");
        std::fs::create_dir(&data)?;
        let secs = interval.as_secs().max(1);
        let list = targets
            .iter()
            .map(|t| format!("'{t}'"))
            .collect::<Vec<_>>()
            .join(", ");
        let config = format!(
            "global:\n  scrape_interval: {secs}s\n  scrape_timeout: {secs}s\nscrape_configs:\n  - job_name: targets\n    static_configs:\n      - targets: [{list}]\n"
        );
        Self::run(dir, &data, &config)
    }

    fn run(dir: tempfile::TempDir, data: &Path, config_text: &str) -> Result<Self> {
        Self::run_with(dir, data, config_text, &[])
    }

    fn run_with(
        dir: tempfile::TempDir,
        data: &Path,
        config_text: &str,
        extra: &[String],
    ) -> Result<Self> {
        let prometheus = binary("prometheus")?;
        let config = dir.path().join("prometheus.yml");
        std::fs::write(&config, config_text)?;
        let log = File::create(dir.path().join("prometheus.log"))?;
        let port = free_port()?;
        let child = crate::process::spawn_in_group(
            Command::new(&prometheus)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={}", data.display()))
                .arg("--storage.tsdb.retention.time=10y")
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .args(extra)
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log),
        )
        .context("start prometheus")?;
        let mut p = Prometheus {
            url: format!("http://127.0.0.1:{port}"),
            child,
            dir,
        };
        p.wait_ready(port)?;
        Ok(p)
    }

    fn wait_ready(&mut self, port: u16) -> Result<()> {
        // A start-up bound, not a timing assertion: a healthy instance is ready in seconds.
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!("prometheus exited with {status}: {}", self.log());
            }
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = s.write_all(b"GET /-/ready HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
                let mut buf = String::new();
                let _ = s.read_to_string(&mut buf);
                if buf.starts_with("HTTP/1.0 200") || buf.starts_with("HTTP/1.1 200") {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        bail!("prometheus not ready after 120 s: {}", self.log())
    }

    /// The instance's log so far (for error messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        crate::process::stop_group(&mut self.child, crate::process::STOP_GRACE);
    }
}

/// A throwaway single-node VictoriaMetrics (Debian's `victoria-metrics`) on a free port, its
/// storage in a temporary directory; its process group is stopped on drop.
pub struct VictoriaMetrics {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    child: Child,
    dir: tempfile::TempDir,
}

impl VictoriaMetrics {
    /// Starts an empty instance; data from [`Self::import`] is searchable at once (no cache,
    /// no latency offset).
    pub fn start() -> Result<Self> {
        let vm = binary("victoria-metrics")?;
        let dir = tempfile::Builder::new().prefix("victoria-").tempdir()?;
        let log = File::create(dir.path().join("vm.log"))?;
        let port = free_port()?;
        let child = crate::process::spawn_in_group(
            Command::new(&vm)
                .arg(format!(
                    "-storageDataPath={}",
                    dir.path().join("data").display()
                ))
                .arg(format!("-httpListenAddr=127.0.0.1:{port}"))
                .arg("-retentionPeriod=100y")
                .arg("-search.disableCache")
                .arg("-search.latencyOffset=0s")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log),
        )
        .context("start victoria-metrics")?;
        let mut v = VictoriaMetrics {
            url: format!("http://127.0.0.1:{port}"),
            child,
            dir,
        };
        // A start-up bound, not a timing assertion.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = v.child.try_wait()? {
                bail!("victoria-metrics exited with {status}: {}", v.log());
            }
            if http(port, "GET", "/health", "").is_ok_and(|r| r.starts_with("HTTP/1.1 200")) {
                return Ok(v);
            }
            if Instant::now() > deadline {
                bail!("victoria-metrics not ready after 60 s: {}", v.log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Imports Prometheus text exposition lines with timestamps (ms) and flushes them to
    /// search.
    pub fn import(&self, text: &str) -> Result<()> {
        let port: u16 = self.url.rsplit(':').next().unwrap_or_default().parse()?;
        let r = http(port, "POST", "/api/v1/import/prometheus", text)?;
        if !r.starts_with("HTTP/1.1 204") && !r.starts_with("HTTP/1.1 200") {
            bail!("import refused: {r}");
        }
        http(port, "GET", "/internal/force_flush", "")?;
        Ok(())
    }

    /// The instance's log so far (for error messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("vm.log")).unwrap_or_default()
    }
}

impl Drop for VictoriaMetrics {
    fn drop(&mut self) {
        crate::process::stop_group(&mut self.child, crate::process::STOP_GRACE);
    }
}

/// One HTTP/1.1 request on a fresh connection (`Connection: close`); the whole answer.
fn http(port: u16, method: &str, path: &str, body: &str) -> Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}
