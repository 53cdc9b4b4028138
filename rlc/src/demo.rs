//! `rlc demo`: the whole loop on embedded defaults, for a first look. Creates a working
//! directory with a config repo made from the template (a real git repo), validates it, and
//! says what it did.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Arguments of `rlc demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Working directory for the demo (config repo, database, history file).
    #[arg(long, default_value = "demo-out")]
    pub dir: PathBuf,
    /// The config-repo template to start from.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../config-repo-template"))]
    pub template: PathBuf,
}

/// Runs the demo; returns the exit code.
pub async fn run(args: DemoArgs) -> anyhow::Result<i32> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let repo_dir = args.dir.join("config-repo");
    let created = init_config_repo(&args.template, &repo_dir)?;
    println!(
        "config repo: {} ({})",
        repo_dir.display(),
        if created {
            "created from the template"
        } else {
            "reused"
        }
    );
    let diags = schema::validate_repo(&repo_dir);
    if !diags.is_empty() {
        for d in &diags {
            println!("  {d}");
        }
        anyhow::bail!("the demo config repo does not validate");
    }
    let (repo, _) = schema::ConfigRepo::load(&repo_dir);
    println!(
        "validated: {} services, {} buckets",
        repo.buckets.len(),
        repo.buckets
            .values()
            .map(|f| f.value.buckets.len())
            .sum::<usize>()
    );
    Ok(0)
}

/// Copies the template into a new git repository at `dest` with one initial commit; leaves an
/// existing repository alone. Returns whether it created one.
pub fn init_config_repo(template: &Path, dest: &Path) -> anyhow::Result<bool> {
    if dest.join(".git").exists() {
        return Ok(false);
    }
    copy_dir(template, dest)?;
    let repo = git2::Repository::init_opts(
        dest,
        git2::RepositoryInitOptions::new().initial_head("main"),
    )
    .with_context(|| format!("git init {}", dest.display()))?;
    let mut index = repo.index()?;
    index.add_all(["*"], git2::IndexAddOption::DEFAULT, None)?;
    index.write()?;
    let tree = repo.find_tree(index.write_tree()?)?;
    let sig = git2::Signature::now("rlc demo", "rlc@localhost")?;
    repo.commit(
        Some("HEAD"),
        &sig,
        &sig,
        "Initial config from config-repo-template",
        &tree,
        &[],
    )?;
    Ok(true)
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}
