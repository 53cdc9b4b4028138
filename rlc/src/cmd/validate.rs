//! `rlc validate DIR`: every problem of a config repo, one per line, `file:line:col: key: message`.

use std::path::Path;

/// Prints every problem of the repo at `dir`; returns the exit code (0 clean, 1 problems).
pub fn run(dir: &Path, format: &str) -> anyhow::Result<i32> {
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
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "problems": out }))?
        );
    } else {
        for d in &diags {
            println!("{d}");
        }
        if diags.is_empty() {
            eprintln!("{}: ok", dir.display());
        } else {
            eprintln!("{}: {} problem(s)", dir.display(), diags.len());
        }
    }
    Ok(if diags.is_empty() { 0 } else { 1 })
}
