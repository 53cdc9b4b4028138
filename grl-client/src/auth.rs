//! Credentials: who may report, push, override or read, checked before a request body is read.
//!
//! A credential is a name (for logs and audit; never the secret), a scope and a secret sent as
//! `Authorization: Bearer <secret>`. On an aggregator the scope is the services a client may
//! report for; on the controller it is the roles a caller holds (`config`, `overrides`,
//! `reports`, `zone-report`). `*` means all.
//!
//! Credentials come from environment variables or files, never from command-line flags (which
//! `ps` shows to every user). A credentials file has one credential per line:
//!
//! ```text
//! # name              scope                  secret
//! payments-2026-11    payments               4f1c…(at least 16 characters)
//! checkout            checkout,cart          9a02…
//! ```
//!
//! It is re-read when it changes (checked at most once a second), so a rotation needs no
//! restart: add the new credential next to the old one, move the callers to it, remove the old
//! one. A file that fails to parse on reload is logged (file and line, never its content) and
//! the previous set stays in force.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderMap;

/// Shortest secret a credentials file accepts.
pub const MIN_SECRET_LEN: usize = 16;
/// Largest credentials or token file read.
const MAX_FILE_BYTES: u64 = 1 << 20;
/// How often a file is checked for changes.
const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// One accepted credential.
#[derive(Clone)]
pub struct Credential {
    /// Shown in logs and recorded in audit fields.
    pub name: String,
    /// Services (aggregator) or roles (controller); `*` = all.
    pub scope: Vec<String>,
    secret: String,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential")
            .field("name", &self.name)
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

impl Credential {
    /// Whether the scope covers `item` (a service or a role).
    pub fn covers(&self, item: &str) -> bool {
        self.scope.iter().any(|s| s == "*" || s == item)
    }

    /// The secret, for a program that hands its own credential to a peer (the demo gives rlc
    /// and the aggregator theirs); never log it.
    pub fn secret(&self) -> &str {
        &self.secret
    }
}

/// The secret of an `Authorization: Bearer <secret>` header, as sent.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
}

/// Compares in time that depends on the lengths only (`subtle`).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// Why a line of a credentials file is refused (its secret is never part of it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineProblem {
    /// Not `NAME SCOPE SECRET`.
    #[error("expected `NAME SCOPE SECRET` (3 fields separated by spaces), found {0} field(s)")]
    Fields(usize),
    /// A scope such as `a,,b`.
    #[error("credential `{name}`: empty scope item")]
    EmptyScope {
        /// The credential's name.
        name: String,
    },
    /// A scope item outside the allowed ones (the controller's roles).
    #[error("credential `{name}`: unknown role `{role}` (known: {known})")]
    UnknownRole {
        /// The credential's name.
        name: String,
        /// The item refused.
        role: String,
        /// The allowed items, comma-separated.
        known: String,
    },
    /// A secret shorter than [`MIN_SECRET_LEN`].
    #[error("credential `{name}`: the secret is shorter than {MIN_SECRET_LEN} characters")]
    ShortSecret {
        /// The credential's name.
        name: String,
    },
    /// A name an earlier line has.
    #[error("credential name `{name}` already used on line {first}")]
    DuplicateName {
        /// The credential's name.
        name: String,
        /// The earlier line.
        first: usize,
    },
    /// A secret an earlier line has.
    #[error("credential `{name}` has the same secret as `{other}` on line {first}")]
    SharedSecret {
        /// The credential's name.
        name: String,
        /// The earlier credential's name.
        other: String,
        /// The earlier line.
        first: usize,
    },
}

/// Every refused line of a credentials file: one `FILE:LINE: problem` per line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialsError {
    /// The file.
    pub path: PathBuf,
    /// Each refused line (1-based) and why.
    pub lines: Vec<(usize, LineProblem)>,
}

impl std::fmt::Display for CredentialsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (n, problem)) in self.lines.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{}:{n}: {problem}", self.path.display())?;
        }
        Ok(())
    }
}

impl std::error::Error for CredentialsError {}

/// Why a secret file (a token or a credentials file) cannot be used. Each names the file,
/// never its content.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    /// Opening or reading failed.
    #[error("{}: {error}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// What the system said.
        error: std::io::Error,
    },
    /// A directory, a device, a pipe...
    #[error("{}: not a regular file", path.display())]
    NotAFile {
        /// The file.
        path: PathBuf,
    },
    /// Larger than the 1 MiB read.
    #[error("{}: larger than {MAX_FILE_BYTES} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// A token file whose first line is blank.
    #[error("{}: empty token file", path.display())]
    EmptyToken {
        /// The file.
        path: PathBuf,
    },
    /// A credentials file with refused lines.
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    /// The file named by environment variable `<var>_FILE`.
    #[error("{var}_FILE: {error}")]
    Env {
        /// The variable, without `_FILE`.
        var: String,
        /// What is wrong with its file.
        error: Box<SecretFileError>,
    },
}

/// Parses a credentials file's text. `allowed_scope` (when given) lists the scope items
/// accepted (the controller's roles). Errors name the file and line, never the secret.
pub fn parse_credentials(
    path: &Path,
    text: &str,
    allowed_scope: Option<&[&str]>,
) -> Result<Vec<Credential>, CredentialsError> {
    let mut out: Vec<(usize, Credential)> = Vec::new();
    let mut errors = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [name, scope, secret] = fields[..] else {
            errors.push((n, LineProblem::Fields(fields.len())));
            continue;
        };
        let scope: Vec<String> = scope.split(',').map(str::to_string).collect();
        if scope.iter().any(String::is_empty) {
            errors.push((n, LineProblem::EmptyScope { name: name.into() }));
            continue;
        }
        if let Some(allowed) = allowed_scope {
            if let Some(bad) = scope
                .iter()
                .find(|s| *s != "*" && !allowed.contains(&s.as_str()))
            {
                errors.push((
                    n,
                    LineProblem::UnknownRole {
                        name: name.into(),
                        role: bad.clone(),
                        known: allowed.join(", "),
                    },
                ));
                continue;
            }
        }
        if secret.len() < MIN_SECRET_LEN {
            errors.push((n, LineProblem::ShortSecret { name: name.into() }));
            continue;
        }
        if let Some((m, _)) = out.iter().find(|(_, c)| c.name == name) {
            errors.push((
                n,
                LineProblem::DuplicateName {
                    name: name.into(),
                    first: *m,
                },
            ));
            continue;
        }
        if let Some((m, c)) = out
            .iter()
            .find(|(_, c)| ct_eq(c.secret.as_bytes(), secret.as_bytes()))
        {
            errors.push((
                n,
                LineProblem::SharedSecret {
                    name: name.into(),
                    other: c.name.clone(),
                    first: *m,
                },
            ));
            continue;
        }
        out.push((
            n,
            Credential {
                name: name.into(),
                scope,
                secret: secret.into(),
            },
        ));
    }
    if errors.is_empty() {
        Ok(out.into_iter().map(|(_, c)| c).collect())
    } else {
        Err(CredentialsError {
            path: path.to_path_buf(),
            lines: errors,
        })
    }
}

/// Writes `text` to `path` readable by its owner only (mode 600 on Unix), replacing it
/// atomically (a reader never sees half a credentials file).
pub fn write_secret_file(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, 0o600);
    let mut f = o.open(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// What identifies a file version without reading it.
fn file_key(path: &Path) -> Option<(std::time::SystemTime, u64, u64)> {
    let m = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let ino = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let ino = 0;
    Some((m.modified().ok()?, m.len(), ino))
}

fn read_small(path: &Path) -> Result<String, SecretFileError> {
    let text = read_secret_file(path)?;
    warn_if_world_readable(path);
    Ok(text)
}

/// A secret file's text, at most `MAX_FILE_BYTES`; a path that is not a regular file is
/// refused. Errors name the file, never its content.
pub fn read_secret_file(path: &Path) -> Result<String, SecretFileError> {
    use std::io::Read;
    let read = |error| SecretFileError::Read {
        path: path.to_path_buf(),
        error,
    };
    let f = std::fs::File::open(path).map_err(read)?;
    let meta = f.metadata().map_err(read)?;
    if !meta.is_file() {
        return Err(SecretFileError::NotAFile {
            path: path.to_path_buf(),
        });
    }
    let mut text = String::new();
    f.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(SecretFileError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    Ok(text)
}

/// Warns when a secret file is readable by every user of the machine.
pub fn warn_if_world_readable(path: &Path) {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o004 != 0) {
            tracing::warn!(file = %path.display(), "secret file is readable by every user (chmod 600 it)");
        }
    }
}

/// How a watched file's text becomes its value.
type Parser<T> = Box<dyn Fn(&str) -> Result<T, SecretFileError> + Send + Sync>;

/// A file's parsed content, re-read when the file changes.
struct Watched<T> {
    path: PathBuf,
    parse: Parser<T>,
    state: Mutex<WatchedState<T>>,
}

struct WatchedState<T> {
    checked: Instant,
    key: Option<(std::time::SystemTime, u64, u64)>,
    value: Arc<T>,
}

impl<T> Watched<T> {
    fn open(
        path: &Path,
        parse: impl Fn(&str) -> Result<T, SecretFileError> + Send + Sync + 'static,
    ) -> Result<Watched<T>, SecretFileError> {
        let key = file_key(path);
        let value = parse(&read_small(path)?)?;
        Ok(Watched {
            path: path.to_path_buf(),
            parse: Box::new(parse),
            state: Mutex::new(WatchedState {
                checked: Instant::now(),
                key,
                value: Arc::new(value),
            }),
        })
    }

    fn current(&self) -> Arc<T> {
        let mut st = self.state.lock().expect("watched file lock");
        if st.checked.elapsed() >= RELOAD_EVERY {
            st.checked = Instant::now();
            let key = file_key(&self.path);
            if key != st.key {
                st.key = key;
                match read_small(&self.path).and_then(|t| (self.parse)(&t)) {
                    Ok(v) => {
                        tracing::info!(file = %self.path.display(), "reloaded");
                        st.value = Arc::new(v);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "cannot reload; the previous content stays in force")
                    }
                }
            }
        }
        st.value.clone()
    }
}

/// A secret this process sends: a fixed value, or a file re-read when it changes (so that a
/// rotation needs no restart).
#[derive(Clone)]
pub struct TokenSource(Arc<TokenInner>);

enum TokenInner {
    Fixed(Arc<String>),
    File(Watched<String>),
}

impl std::fmt::Debug for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &*self.0 {
            TokenInner::Fixed(_) => f.write_str("TokenSource(<redacted>)"),
            TokenInner::File(w) => write!(f, "TokenSource(file {})", w.path.display()),
        }
    }
}

impl From<String> for TokenSource {
    fn from(s: String) -> Self {
        TokenSource::fixed(&s)
    }
}

impl From<&str> for TokenSource {
    fn from(s: &str) -> Self {
        TokenSource::fixed(s)
    }
}

impl TokenSource {
    /// A fixed secret.
    pub fn fixed(secret: &str) -> TokenSource {
        TokenSource(Arc::new(TokenInner::Fixed(Arc::new(
            secret.trim().to_string(),
        ))))
    }

    /// The first line of `path` (surrounding blanks removed), re-read when the file changes.
    pub fn file(path: &Path) -> Result<TokenSource, SecretFileError> {
        let p = path.to_path_buf();
        let w = Watched::open(path, move |t| {
            let s = t.lines().next().unwrap_or("").trim().to_string();
            if s.is_empty() {
                Err(SecretFileError::EmptyToken { path: p.clone() })
            } else {
                Ok(s)
            }
        })?;
        Ok(TokenSource(Arc::new(TokenInner::File(w))))
    }

    /// From environment variable `var` (the secret) or `<var>_FILE` (a file holding it);
    /// `None` when neither is set or the value is empty.
    pub fn from_env(var: &str) -> Result<Option<TokenSource>, SecretFileError> {
        if let Some(v) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) {
            return Ok(Some(TokenSource::fixed(&v)));
        }
        match std::env::var(format!("{var}_FILE"))
            .ok()
            .filter(|v| !v.is_empty())
        {
            Some(p) => {
                TokenSource::file(Path::new(&p))
                    .map(Some)
                    .map_err(|e| SecretFileError::Env {
                        var: var.into(),
                        error: Box::new(e),
                    })
            }
            None => Ok(None),
        }
    }

    /// The secret now.
    pub fn current(&self) -> Arc<String> {
        match &*self.0 {
            TokenInner::Fixed(s) => s.clone(),
            TokenInner::File(w) => w.current(),
        }
    }
}

/// The credentials a server accepts: named token sources with a scope, plus an optional
/// credentials file re-read when it changes.
#[derive(Clone, Default)]
pub struct CredentialSet {
    named: Vec<(String, Vec<String>, TokenSource)>,
    file: Option<Arc<Watched<Vec<Credential>>>>,
}

impl std::fmt::Debug for CredentialSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialSet")
            .field(
                "named",
                &self
                    .named
                    .iter()
                    .map(|(n, s, _)| (n, s))
                    .collect::<Vec<_>>(),
            )
            .field(
                "file",
                &self.file.as_ref().map(|w| w.path.display().to_string()),
            )
            .finish()
    }
}

/// Why a request was not authenticated or not authorized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A secret no credential has.
    Unknown,
}

impl Refusal {
    /// The metrics label.
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::Missing => "missing_credential",
            Refusal::Unknown => "unknown_credential",
        }
    }
}

impl CredentialSet {
    /// Adds a credential named `name` with `scope` whose secret comes from `source`.
    pub fn add(&mut self, name: &str, scope: &[&str], source: TokenSource) {
        self.named.push((
            name.into(),
            scope.iter().map(|s| s.to_string()).collect(),
            source,
        ));
    }

    /// Adds the credentials of `path` (checked now; re-read when it changes). `allowed_scope`
    /// lists the scope items the file may use (`None`: any, e.g. service names).
    pub fn add_file(
        &mut self,
        path: &Path,
        allowed_scope: Option<&'static [&'static str]>,
    ) -> Result<(), SecretFileError> {
        let p = path.to_path_buf();
        let w = Watched::open(path, move |t| Ok(parse_credentials(&p, t, allowed_scope)?))?;
        self.file = Some(Arc::new(w));
        Ok(())
    }

    /// Whether no credential at all is configured.
    pub fn is_empty(&self) -> bool {
        self.named.is_empty() && self.file.is_none()
    }

    /// Whether some configured credential covers `item` now.
    pub fn any_covers(&self, item: &str) -> bool {
        self.named
            .iter()
            .any(|(_, s, _)| s.iter().any(|x| x == "*" || x == item))
            || self
                .file
                .as_ref()
                .is_some_and(|w| w.current().iter().any(|c| c.covers(item)))
    }

    /// The credential whose secret is the request's bearer token (read from the headers only).
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Credential, Refusal> {
        let got = bearer(headers)
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .ok_or(Refusal::Missing)?;
        let mut found = None;
        // Every secret is compared (no early exit on a match).
        for (name, scope, src) in &self.named {
            let s = src.current();
            if !s.is_empty() && ct_eq(s.as_bytes(), got.as_bytes()) {
                found = Some(Credential {
                    name: name.clone(),
                    scope: scope.clone(),
                    secret: String::new(),
                });
            }
        }
        if let Some(w) = &self.file {
            for c in w.current().iter() {
                if ct_eq(c.secret.as_bytes(), got.as_bytes()) {
                    found = Some(Credential {
                        name: c.name.clone(),
                        scope: c.scope.clone(),
                        secret: String::new(),
                    });
                }
            }
        }
        found.ok_or(Refusal::Unknown)
    }
}

/// Refusals counted per reason: `grl_reports_refused_total{reason}` (the reasons are fixed
/// words, so the family stays small).
#[derive(Default, Clone)]
pub struct RefusalCounts {
    counts: prometheus_client::metrics::family::Family<
        [(&'static str, &'static str); 1],
        prometheus_client::metrics::counter::Counter,
    >,
}

impl RefusalCounts {
    /// Counts one refusal.
    pub fn add(&self, reason: &'static str) {
        self.counts.get_or_create(&[("reason", reason)]).inc();
    }

    /// Registers `grl_reports_refused_total{reason}` (a reason appears once counted).
    pub fn register(&self, reg: &mut prometheus_client::registry::Registry) {
        reg.register(
            "grl_reports_refused",
            "Reports refused, by reason (missing_credential, unknown_credential, forbidden, malformed, invalid, too_large, timeout, over_budget, busy).",
            self.counts.clone(),
        );
    }
}

/// Lets through one log line per period (floods of forged requests must not flood the log).
pub struct LogGate {
    last_ms: AtomicU64,
    period_ms: u64,
    start: Instant,
}

impl LogGate {
    /// A gate opening at most once per `period`.
    pub fn new(period: Duration) -> LogGate {
        LogGate {
            last_ms: AtomicU64::new(u64::MAX),
            period_ms: period.as_millis() as u64,
            start: Instant::now(),
        }
    }

    /// Whether to log now.
    pub fn open(&self) -> bool {
        let now = self.start.elapsed().as_millis() as u64;
        let last = self.last_ms.load(Ordering::Relaxed);
        if last != u64::MAX && now.saturating_sub(last) < self.period_ms {
            return false;
        }
        self.last_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusal logs' throttle: open once, closed within the period, open again after.
    #[test]
    fn log_gate_opens_once_per_period() {
        let gate = LogGate::new(Duration::from_millis(200));
        assert!(gate.open(), "the first refusal is logged");
        assert!(!gate.open(), "the next ones within the period are not");
        assert!(!gate.open());
        std::thread::sleep(Duration::from_millis(250));
        assert!(gate.open(), "one again after the period");
        assert!(!gate.open());
    }

    #[test]
    fn file_errors_name_the_line_and_never_the_secret() {
        let p = Path::new("creds");
        let text = "# comment\n\na * 0123456789abcdef\nb x short\nc x,y\na q 0123456789abcdeX\nd * 0123456789abcdef\ne bogus 0123456789abcdeZ\n";
        let e = parse_credentials(p, text, Some(&["x", "q", "y"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("creds:4:") && e.contains("shorter"), "{e}");
        assert!(e.contains("creds:5:") && e.contains("3 fields"), "{e}");
        assert!(
            e.contains("creds:6:") && e.contains("already used on line 3"),
            "{e}"
        );
        assert!(
            e.contains("creds:7:") && e.contains("same secret as `a`"),
            "{e}"
        );
        assert!(
            e.contains("creds:8:") && e.contains("unknown role `bogus`"),
            "{e}"
        );
        assert!(!e.contains("0123456789abcde"), "{e}");
        let ok = parse_credentials(p, "a payments,maps 0123456789abcdef\n", None).unwrap();
        assert!(ok[0].covers("maps") && !ok[0].covers("x"));
        assert!(!format!("{:?}", ok[0]).contains("0123"));
    }

    #[test]
    fn authenticate_finds_the_credential_by_secret() {
        let mut set = CredentialSet::default();
        set.add("legacy", &["config"], TokenSource::fixed("tok-legacy"));
        let mut h = HeaderMap::new();
        assert_eq!(set.authenticate(&h).unwrap_err(), Refusal::Missing);
        h.insert("authorization", "Bearer nope".parse().unwrap());
        assert_eq!(set.authenticate(&h).unwrap_err(), Refusal::Unknown);
        h.insert("authorization", "Bearer tok-legacy".parse().unwrap());
        assert_eq!(set.authenticate(&h).unwrap().name, "legacy");
    }
}
