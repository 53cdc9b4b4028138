//! `rlc validate DIR`: every problem of a config repo, one per line, `file:line:col: key: message`.
//! With `--history`, also a warning for each active contract whose caller and procedure sent
//! no traffic in the history window.

use std::path::Path;

/// Prints every problem of the repo at `dir`; returns the exit code (0 clean, 1 problems).
pub fn run(dir: &Path, format: &str) -> anyhow::Result<i32> {
    report(dir, format, &[])
}

/// [`run`], then the history of `config`'s source: a warning (exit code unchanged) for every
/// active contract whose caller and procedure sent no traffic in the window. A history that
/// cannot be pulled is an error (exit 1).
pub async fn run_with_history(dir: &Path, format: &str, config: &Path) -> anyhow::Result<i32> {
    if !dir.is_dir() {
        anyhow::bail!("{}: not a directory", dir.display());
    }
    let (mut cfg, base_dir) = crate::config::load_config(config)?;
    crate::config::resolve_paths(&mut cfg, &base_dir);
    let (repo, _) = schema::ConfigRepo::load(dir);
    let history = crate::history::load_plan_or_unavailable(&cfg, &base_dir).await;
    let today = chrono::Utc::now().date_naive();
    let unused = tokio::task::spawn_blocking(move || {
        rlc_plan::compute::contracts_without_traffic(&repo, &history, today)
    })
    .await?
    .map_err(|e| anyhow::anyhow!("history ({}): {e}", config.display()))?;
    let file = dir.join("rlc/contracts.yaml");
    let warnings: Vec<String> = unused
        .into_iter()
        .map(|(i, why)| format!("{}: contracts[{i}]: warning: {why}", file.display()))
        .collect();
    report(dir, format, &warnings)
}

fn report(dir: &Path, format: &str, warnings: &[String]) -> anyhow::Result<i32> {
    if !dir.is_dir() {
        anyhow::bail!("{}: not a directory", dir.display());
    }
    let diags = schema::validate_repo(dir);
    if format == "json" {
        let out: Vec<_> = diags
            .iter()
            .map(|d| {
                serde_json::json!({
                    "file": d.file.display().to_string(),
                    "line": d.line,
                    "column": d.column,
                    "key": d.key,
                    "message": d.message,
                })
            })
            .collect();
        let mut doc = serde_json::json!({ "problems": out });
        if !warnings.is_empty() {
            doc["warnings"] = serde_json::json!(warnings);
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        for d in &diags {
            println!("{d}");
        }
        for w in warnings {
            println!("{w}");
        }
        if diags.is_empty() {
            eprintln!("{}: ok", dir.display());
        } else {
            eprintln!("{}: {} problem(s)", dir.display(), diags.len());
        }
    }
    Ok(if diags.is_empty() { 0 } else { 1 })
}
