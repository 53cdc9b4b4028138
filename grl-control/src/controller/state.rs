//! The controller's state at start and from the state database: the state directory's lock
//! and files, the checks a stored state passes, and following the database.

use super::*;
use anyhow::Context;

/// Takes the state directory's exclusive lock (`controller.lock`, an advisory lock the OS
/// releases with the process) and writes who holds it. Two controllers on one state directory
/// would overwrite each other's config and overrides: the second refuses to start, naming the
/// holder. A lock released by a controller of this process that is still stopping is waited
/// for up to 2 s.
pub(super) async fn lock_state_dir(dir: &Path) -> anyhow::Result<std::fs::File> {
    use std::io::{Read, Seek, Write};
    let path = dir.join(STATE_LOCK_FILE);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("refusing to start: cannot open {}: {e}", path.display()))?;
    let mut tries = 0;
    loop {
        match f.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if tries < 20 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = (&f).take(1024).read_to_string(&mut holder);
                let holder = holder.trim();
                anyhow::bail!(
                    "refusing to start: state directory {} is in use by another controller ({}); stop it, or give this one its own --state-dir (replicas share a state through --database-url, not a directory)",
                    dir.display(),
                    if holder.is_empty() { "holder unknown" } else { holder }
                );
            }
            Err(std::fs::TryLockError::Error(e)) => {
                anyhow::bail!("refusing to start: cannot lock {}: {e}", path.display())
            }
        }
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let holder = format!(
        "pid {} on {} since {}",
        std::process::id(),
        host.trim(),
        chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
    );
    f.set_len(0)?;
    f.rewind()?;
    f.write_all(holder.as_bytes())?;
    Ok(f)
}

/// Reads and checks the persisted state of `dir`. The config must pass exactly the checks of
/// `PUT /v1/config` and every override those of `POST /v1/overrides` (its request, a unique id
/// below the id counter, an expiry after its creation); a state that does not is refused with
/// the file and the problem, never served: a controller that silently enforced nothing would
/// be worse than one that does not start. (A bucket override whose bucket a later config
/// removed is kept, as it is while running: it acts on nothing.) Only regular files of at most
/// [`config::MAX_STATE_FILE`] bytes are read.
pub(super) fn load_state(dir: &Path) -> anyhow::Result<(Option<ConfigDoc>, OverridesFile)> {
    let read = |name: &str| -> anyhow::Result<Option<(PathBuf, Vec<u8>)>> {
        let path = dir.join(name);
        match config::read_state_file(&path, config::MAX_STATE_FILE) {
            Ok(b) => Ok(b.map(|b| (path, b))),
            Err(e) => anyhow::bail!("refusing to start: state file {e}"),
        }
    };
    let refuse = |path: &Path, problem: &dyn std::fmt::Display| {
        anyhow::anyhow!(
            "refusing to start: state file {}: {problem} (fix or remove the file; the controller does not serve a state it would refuse over its API)",
            path.display()
        )
    };
    let cfg = match read("config.json")? {
        Some((path, bytes)) => {
            let doc: ConfigDoc = serde_json::from_slice(&bytes).map_err(|e| refuse(&path, &e))?;
            config::validate_pushed(&doc).map_err(|e| refuse(&path, &e))?;
            Some(doc)
        }
        None => None,
    };
    let ov = match read("overrides.json")? {
        Some((path, bytes)) => {
            let ov: OverridesFile =
                serde_json::from_slice(&bytes).map_err(|e| refuse(&path, &e))?;
            check_overrides(&ov).map_err(|p| refuse(&path, &p))?;
            ov
        }
        None => OverridesFile::default(),
    };
    Ok((cfg, ov))
}

/// `grl_controller_state_revision` and `grl_controller_state_database_up`, read at scrape time
/// (registered only with a state database).
pub(super) struct DbCollector(pub(super) Arc<DbSync>);

impl std::fmt::Debug for DbCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DbCollector")
    }
}

impl prometheus_client::collector::Collector for DbCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::gauge::ConstGauge;
        use prometheus_client::metrics::MetricType;
        let (rev, up) = {
            let h = self.0.health.lock().expect("db health lock");
            (h.rev, i64::from(h.error.is_none()))
        };
        let fam = encoder.encode_descriptor(
            "grl_controller_state_revision",
            "Revision of the shared state (config and overrides) this replica applied.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(rev).encode(fam)?;
        let fam = encoder.encode_descriptor(
            "grl_controller_state_database_up",
            "1 while the last contact with the state database succeeded; 0 while it fails (changes answer 503).",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(up).encode(fam)?;
        Ok(())
    }
}

/// Why a stored state (a state file, a snapshot of the state database) is refused: what
/// `PUT /v1/config` or `POST /v1/overrides` would refuse.
#[derive(Debug, thiserror::Error)]
pub(super) enum StoredStateError {
    #[error("config `{version}`: {err}")]
    Config {
        version: String,
        err: config::ConfigError,
    },
    #[error("override `{id}`: {problem}")]
    Override {
        id: String,
        problem: OverrideProblem,
    },
}

/// What is wrong with a stored override.
#[derive(Debug, thiserror::Error)]
pub(super) enum OverrideProblem {
    #[error("{0}")]
    Invalid(crate::overrides::OverrideError),
    #[error("id appears twice")]
    DuplicateId,
    #[error("id must be `ovr-N` with N at most next_id ({next_id})")]
    BadId { next_id: u64 },
    #[error("expires_at must be after created_at")]
    Expiry,
}

/// The checks of `POST /v1/overrides` on a stored override list: each request valid, ids
/// unique and `ovr-N` with N at most the id counter, an expiry after the creation.
pub(super) fn check_overrides(ov: &OverridesFile) -> Result<(), StoredStateError> {
    let mut ids = std::collections::BTreeSet::new();
    for o in &ov.overrides {
        let bad = |problem| StoredStateError::Override {
            id: o.id.clone(),
            problem,
        };
        o.req
            .validate()
            .map_err(|e| bad(OverrideProblem::Invalid(e)))?;
        if !ids.insert(o.id.as_str()) {
            return Err(bad(OverrideProblem::DuplicateId));
        }
        match o
            .id
            .strip_prefix("ovr-")
            .and_then(|n| n.parse::<u64>().ok())
        {
            Some(n) if n <= ov.next_id => {}
            _ => {
                return Err(bad(OverrideProblem::BadId {
                    next_id: ov.next_id,
                }))
            }
        }
        if o.expires_at <= o.created_at {
            return Err(bad(OverrideProblem::Expiry));
        }
    }
    Ok(())
}

/// A snapshot of the state database checked as the API checks a change (the config as
/// `PUT /v1/config`, the overrides as `POST /v1/overrides`).
pub(super) fn check_snapshot(snap: &crate::state_db::Snapshot) -> Result<(), StoredStateError> {
    if let Some(doc) = &snap.config {
        config::validate_pushed(doc).map_err(|err| StoredStateError::Config {
            version: doc.version.clone(),
            err,
        })?;
    }
    check_overrides(&OverridesFile {
        next_id: snap.next_override_id,
        overrides: snap.overrides.clone(),
    })
}

/// Connects to the state database, retrying until `opts.connect_timeout` (a replica started
/// while Postgres restarts waits for it instead of exiting at once).
pub(super) async fn connect_db(opts: &DatabaseOptions) -> anyhow::Result<crate::state_db::StateDb> {
    let deadline = std::time::Instant::now() + opts.connect_timeout;
    let mut wait = Duration::from_millis(200);
    loop {
        match crate::state_db::StateDb::connect(&opts.url.0).await {
            Ok(db) => return Ok(db),
            Err(e) if std::time::Instant::now() + wait < deadline => {
                tracing::warn!(database = ?opts.url, error = %e, "state database not reachable yet; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            Err(e) => anyhow::bail!(
                "refusing to start: state database {:?}: {e} (gave up after {:?})",
                opts.url,
                opts.connect_timeout
            ),
        }
    }
}

/// Loads what changed in the state database since the applied revision into the engine.
/// True when something was applied. A snapshot that fails the API's checks is not applied
/// (logged; the replica keeps what it has).
pub(super) async fn catch_up(
    s: &Shared,
    sync: &DbSync,
    applied: &mut Applied,
) -> Result<bool, crate::state_db::DbError> {
    let snap = match sync.db.load_since(applied.rev, applied.config_rev).await {
        Ok(Some(snap)) => snap,
        Ok(None) => {
            sync.ok(applied.rev);
            return Ok(false);
        }
        Err(e) => {
            sync.failed("catch up", &e);
            return Err(e);
        }
    };
    if let Err(p) = check_snapshot(&snap) {
        let e =
            crate::state_db::DbError::Corrupt(format!("revision {}: {p}; not applied", snap.rev));
        sync.failed("catch up", &e);
        return Err(e);
    }
    let now = unix_now();
    let mut e = s.engine.lock().expect("engine lock");
    if let Some(doc) = snap.config {
        tracing::info!(from = %e.base_config().version, to = %doc.version, rev = snap.config_rev, "config applied from the state database");
        e.set_config(doc);
    }
    let list: Vec<Override> = snap
        .overrides
        .into_iter()
        .filter(|o| o.active(now))
        .collect();
    if list != e.overrides() {
        let (before, after) = (e.overrides().len(), list.len());
        if let Err(err) = e.try_set_overrides(list, |_| Ok::<(), ()>(())) {
            let err = crate::state_db::DbError::Corrupt(format!(
                "revision {}: the overrides cannot be served: {err}; not applied",
                snap.rev
            ));
            drop(e);
            sync.failed("catch up", &err);
            return Err(err);
        }
        tracing::info!(
            before,
            after,
            rev = snap.rev,
            "overrides applied from the state database"
        );
    }
    e.recompute(s.now_ms(), now);
    drop(e);
    *applied = Applied {
        rev: snap.rev,
        config_rev: snap.config_rev,
    };
    sync.ok(snap.rev);
    Ok(true)
}

/// Follows the state database: a catch-up on each notification of a change and at every
/// `poll` (the fallback when a notification is lost, or the listening connection is down);
/// expired overrides are deleted at each poll. Runs until aborted.
pub(super) async fn db_sync_loop(s: Arc<Shared>, sync: Arc<DbSync>, poll: Duration) {
    use sqlx::postgres::PgListener;
    let mut listener: Option<PgListener> = None;
    let mut iv = tokio::time::interval(poll);
    iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if listener.is_none() {
            match PgListener::connect_with(sync.db.pool()).await {
                Ok(mut l) => match l.listen(crate::state_db::CHANNEL).await {
                    Ok(()) => listener = Some(l),
                    Err(e) => sync.failed("listen", &e.into()),
                },
                Err(e) => sync.failed("listen", &e.into()),
            }
        }
        let polled = tokio::select! {
            n = async {
                match listener.as_mut() {
                    Some(l) => l.try_recv().await,
                    None => std::future::pending().await,
                }
            } => {
                if let Err(e) = n {
                    // Reconnected at the next turn; the poll covers the meantime.
                    sync.failed("listen", &e.into());
                    listener = None;
                }
                false
            }
            _ = iv.tick() => true,
        };
        if polled {
            if let Err(e) = sync.db.purge_expired(unix_now()).await {
                sync.failed("purge expired overrides", &e);
            }
        }
        let mut applied = sync.applied.lock().await;
        let _ = catch_up(&s, &sync, &mut applied).await;
    }
}

/// The config and overrides a controller starts with (its state directory's, else its
/// --config-dir's), and its view of the state database when it has one (whose state wins).
pub(super) async fn load_start_state(
    opts: &ControllerOptions,
) -> anyhow::Result<(ConfigDoc, OverridesFile, Option<Arc<DbSync>>)> {
    let (persisted_cfg, ov) = load_state(&opts.state_dir)?;
    // A config dir given is checked even when persisted state wins: a controller never
    // starts on what `rlc validate` rejects.
    let from_dir = match &opts.config_dir {
        Some(dir) => Some(
            config::load_dir(dir)
                .with_context(|| format!("refusing to start: bucket files in {}", dir.display()))?,
        ),
        None => None,
    };
    match &opts.database {
        None => {
            let cfg = match (persisted_cfg, from_dir) {
                (Some(c), _) => c,
                (None, Some(doc)) => {
                    let bytes = serde_json::to_vec_pretty(&doc)?;
                    write_atomic(&opts.state_dir.join("config.json"), &bytes)?;
                    doc
                }
                (None, None) => ConfigDoc::default(),
            };
            Ok((cfg, ov, None))
        }
        Some(dbo) => load_from_database(dbo, persisted_cfg.or(from_dir), ov).await,
    }
}

/// Connects to the state database, imports `local_cfg` and `ov` into it when it is empty,
/// and loads its state, checked as the API checks a change; expired overrides are left out.
async fn load_from_database(
    dbo: &DatabaseOptions,
    local_cfg: Option<ConfigDoc>,
    ov: OverridesFile,
) -> anyhow::Result<(ConfigDoc, OverridesFile, Option<Arc<DbSync>>)> {
    let db = connect_db(dbo).await?;
    // An empty database takes what this controller had: its state directory's
    // files (a controller given a database for the first time), else its
    // --config-dir. A database that holds a state wins over both.
    if db
        .import_if_empty(local_cfg.as_ref(), &ov.overrides, ov.next_id)
        .await
        .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?
    {
        tracing::info!(
            version = local_cfg.as_ref().map_or("none", |c| c.version.as_str()),
            overrides = ov.overrides.len(),
            "empty state database: imported this controller's state"
        );
    }
    let snap = db
        .load_since(-1, -1)
        .await
        .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?
        .context("refusing to start: the state database has no revision")?;
    check_snapshot(&snap).map_err(|p| {
        anyhow::anyhow!("refusing to start: state database {:?} at revision {}: {p} (the controller does not serve a state it would refuse over its API)", dbo.url, snap.rev)
    })?;
    tracing::info!(database = ?dbo.url, rev = snap.rev, "controller state loaded from the state database");
    let sync = DbSync {
        db,
        applied: tokio::sync::Mutex::new(Applied {
            rev: snap.rev,
            config_rev: snap.config_rev,
        }),
        health: Mutex::new(DbHealth {
            rev: snap.rev,
            ok_at: std::time::Instant::now(),
            error: None,
        }),
        errors_log: LogGate::new(Duration::from_secs(10)),
    };
    let now = unix_now();
    let ov = OverridesFile {
        next_id: snap.next_override_id,
        overrides: snap
            .overrides
            .into_iter()
            .filter(|o| o.active(now))
            .collect(),
    };
    Ok((snap.config.unwrap_or_default(), ov, Some(Arc::new(sync))))
}
