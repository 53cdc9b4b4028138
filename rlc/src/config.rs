//! `rlc.yaml`: loading it, and resolving its relative paths against its directory.

use std::path::{Path, PathBuf};

use schema::DaemonConfig;

/// Loads rlc.yaml; returns it with its directory as an absolute path (the base of relative
/// paths in it), so that paths resolve the same wherever the command runs from.
pub fn load_config(path: &Path) -> anyhow::Result<(DaemonConfig, PathBuf)> {
    let cfg = schema::load_daemon_config(path)
        .map_err(|d| crate::exit::ConfigError(schema::Diagnostics(d).to_string()))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let base = std::path::absolute(dir).map_err(|e| {
        crate::exit::ConfigError(format!(
            "{}: cannot resolve its directory: {e}",
            path.display()
        ))
    })?;
    Ok((cfg, base))
}

/// Resolves the relative paths of `rlc.yaml` (`config_repo.path`, `history.file`,
/// `plugins.dir`) against `base_dir`, the directory of the file.
pub fn resolve_paths(cfg: &mut DaemonConfig, base_dir: &Path) {
    let abs = |p: &str| -> String { base_dir.join(p).to_string_lossy().into_owned() };
    cfg.config_repo.path = abs(&cfg.config_repo.path);
    if let Some(f) = &cfg.history.file {
        cfg.history.file = Some(abs(f));
    }
    if let Some(p) = &mut cfg.plugins {
        p.dir = abs(&p.dir);
        if let Some(h) = &p.host {
            p.host = Some(abs(h));
        }
    }
}
