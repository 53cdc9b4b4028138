//! The computation of a plan ([`rlc_plan::compute`]) and the resolution of `rlc.yaml`'s
//! relative paths it needs first.

use std::path::Path;

use schema::DaemonConfig;

pub use rlc_plan::compute::*;

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

