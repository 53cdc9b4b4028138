//! `rlc demo`: the whole loop on embedded defaults, for a first look.
//!
//! 1. a config repo made from the template (a real git repository) in `--dir`;
//! 2. four weeks of generated per-minute history (the bundled quickstart set, as CSV);
//! 3. an in-process GRL controller on loopback, with generated credentials (one per role, in
//!    a mode-600 credentials file, as in production);
//! 4. one `rlc run` cycle: history → policies → rails → `buckets/*.yaml` committed → pushed to
//!    the controller → recorded in SQLite;
//! 5. live traffic at 1.5× one bucket's new limit through a real GRL client and zone aggregator,
//!    showing the admitted rate settle at the limit;
//! 6. a second cycle on the same history: nothing to change, capped decreases wait a day, no
//!    commit.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use grl_runtime::aggregator::{Aggregator, AggregatorOptions};
use grl_runtime::auth::{write_secret_file, CredentialSet};
use grl_runtime::client::{ClientOptions, GrlClient};
use grl_runtime::controller::{Controller, ControllerOptions};
use schema::{format_rps, Mode};

use crate::cycle::{short, Cycle, RunStatus};

/// Arguments of `rlc demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Working directory for the demo (config repo, history, database, controller state).
    #[arg(long, default_value = "demo-out")]
    pub dir: PathBuf,
    /// The config-repo template to start from.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../config-repo-template"))]
    pub template: PathBuf,
    /// Seconds of live traffic to drive through the GRL client.
    #[arg(long, default_value_t = 4)]
    pub traffic_secs: u64,
}

const TOKEN_ENV: &str = "RLC_DEMO_GRL_TOKEN";

/// 256 random bits, hex.
fn secret() -> String {
    format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    )
}

/// Runs the demo; returns the exit code.
pub async fn run(args: DemoArgs) -> anyhow::Result<i32> {
    let dir = &args.dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = dir.canonicalize()?;

    // 1. The config repo.
    let repo_dir = dir.join("config-repo");
    let created = init_config_repo(&args.template, &repo_dir)?;
    println!(
        "1. config repo  {} ({})",
        repo_dir.display(),
        if created {
            "created from config-repo-template"
        } else {
            "reused"
        }
    );

    // 2. History.
    let history = dir.join("history.csv");
    if !history.exists() {
        let rows = crate::history::synth::generate(&history, 42, chrono::Utc::now(), 28, 60)
            .with_context(|| format!("writing {}", history.display()))?;
        println!(
            "2. history      {} ({rows} per-minute samples, 28 days, generated)",
            history.display()
        );
    } else {
        println!("2. history      {} (reused)", history.display());
    }

    // 3. The in-process controller, serving the repo's current buckets, with one generated
    // credential per role: rlc pushes configs and reads reports, on-call people add
    // overrides, aggregators send zone reports. No anonymous report is accepted.
    let token = secret();
    let zone_token = secret();
    let creds_path = dir.join("grl-credentials");
    write_secret_file(
        &creds_path,
        &format!(
            "# Written by `rlc demo`: NAME ROLES SECRET (see docs/security.md).\nrlc config,reports {token}\noncall overrides {}\nzone-report zone-report {zone_token}\n",
            secret()
        ),
    )
    .with_context(|| format!("writing {}", creds_path.display()))?;
    let mut credentials = CredentialSet::default();
    credentials
        .add_file(&creds_path, Some(grl_runtime::controller::ROLES))
        .map_err(anyhow::Error::msg)?;
    let controller = Controller::start(ControllerOptions {
        state_dir: dir.join("grl-state"),
        credentials,
        config_dir: Some(repo_dir.join("buckets")),
        tick: Duration::from_millis(250),
        ..Default::default()
    })
    .await
    .context("starting the GRL controller")?;
    // The push client reads its credential from the environment, as in production.
    std::env::set_var(TOKEN_ENV, &token);
    println!("3. controller   {} (in-process)", controller.url());
    println!(
        "   credentials  {} (generated, mode 600: rlc = config,reports; oncall = overrides; zone-report)",
        creds_path.display()
    );

    let cfg_path = dir.join("rlc.yaml");
    std::fs::write(&cfg_path, rlc_yaml(&controller.url()))?;
    let (cfg, base) = crate::cycle::load_config(&cfg_path)?;
    let planner = crate::pipeline::planner();
    let cycle = Cycle::new(cfg, &base);

    // 4. One full cycle.
    println!("4. rlc run      (config: {})", cfg_path.display());
    let out = cycle.run(&planner, "demo").await;
    for line in out.to_string().lines() {
        println!("   {line}");
    }
    if out.status == RunStatus::Failed {
        controller.shutdown().await;
        bail!("the cycle failed");
    }
    let head = git_head(&repo_dir)?;
    let status: serde_json::Value = reqwest::get(format!("{}/v1/status", controller.url()))
        .await?
        .json()
        .await?;
    let active = status["version"].as_str().unwrap_or_default().to_string();
    println!(
        "   controller version {} {} config-repo HEAD {}",
        short(&active),
        if active == head { "==" } else { "!=" },
        short(&head)
    );

    // 5. Live traffic through a real client and aggregator.
    let after = schema::ConfigRepo::load(&repo_dir).0;
    let enforced = after
        .buckets
        .values()
        .flat_map(|f| {
            f.value
                .buckets
                .iter()
                .map(move |b| (f.value.service.clone(), b.clone()))
        })
        .find(|(_, b)| b.mode == Mode::Enforce && b.caller.is_some() && b.procedure.is_some());
    if let Some((service, bucket)) = enforced {
        traffic(
            &controller.url(),
            &dir,
            &zone_token,
            &service,
            &bucket,
            args.traffic_secs,
        )
        .await?;
    }

    // 6. Same history again: nothing new to change. Decreases the rails capped wait for the
    // next interval (one decrease per bucket per day), so no commit.
    let again = cycle.run(&planner, "demo").await;
    let head2 = git_head(&repo_dir)?;
    let waiting = again
        .skipped
        .iter()
        .filter(|s| s.reason.contains("already lowered"))
        .count();
    println!(
        "6. rlc run again on the same history: {} — {}{}",
        again.status.as_str(),
        if head2 == head {
            "no new commit"
        } else {
            "a new commit"
        },
        if waiting > 0 {
            format!(" ({waiting} capped decrease(s) wait a day: one decrease per bucket per day)")
        } else {
            String::new()
        }
    );
    controller.shutdown().await;
    println!(
        "\nNext: `rlc preview --config {0}` for the table, `rlc serve --config {0}` for the daemon and its dashboard,\n`git -C {1} log -p` for what was committed.",
        cfg_path.display(),
        repo_dir.display()
    );
    Ok(if again.status == RunStatus::Failed {
        1
    } else {
        0
    })
}

/// Offers 1.5× the bucket's limit for `secs` seconds through a GRL client reporting to a zone
/// aggregator, and prints the admitted rate each second.
async fn traffic(
    controller: &str,
    dir: &Path,
    zone_token: &str,
    service: &str,
    bucket: &schema::Bucket,
    secs: u64,
) -> anyhow::Result<()> {
    // The aggregator accepts client reports only with a credential for their service.
    let client_token = secret();
    let client_creds = dir.join("grl-client-credentials");
    write_secret_file(
        &client_creds,
        &format!("# Written by `rlc demo`: NAME SERVICES SECRET (see docs/security.md).\n{service} {service} {client_token}\n"),
    )
    .with_context(|| format!("writing {}", client_creds.display()))?;
    let agg = Aggregator::start(AggregatorOptions {
        listen: ([127, 0, 0, 1], 0).into(),
        controllers: vec![controller.to_string()],
        zone: "demo-zone-a".into(),
        region: "demo".into(),
        tick: Duration::from_millis(250),
        report_token: Some(zone_token.into()),
        client_credentials: Some(client_creds.clone()),
        ..Default::default()
    })
    .await?;
    let mut opts = ClientOptions::new(service, vec![agg.url()]);
    opts.tick = Duration::from_millis(250);
    opts.report_token = Some(client_token.as_str().into());
    let client = GrlClient::start(opts);
    let caller = bucket.caller.clone().unwrap_or_default();
    let procedure = bucket.procedure.clone().unwrap_or_default();
    let offered = bucket.limit_rps * 1.5;
    println!(
        "5. traffic      {service}/{} limit {} rps, offering {} rps through a GRL client → zone aggregator → controller",
        bucket.name,
        format_rps(bucket.limit_rps),
        format_rps(offered.round())
    );
    println!(
        "   client credential for {service} in {} (generated); anonymous reports are refused",
        client_creds.display()
    );
    let slice = Duration::from_millis(20);
    let start = Instant::now();
    let mut last = start;
    let mut carry = 0.0;
    for second in 1..=secs {
        let (mut admitted, mut sent) = (0u64, 0u64);
        let end = start + Duration::from_secs(second);
        while Instant::now() < end {
            // Requests due since the last slice, so that sleep overshoot does not lower the rate.
            let now = Instant::now();
            carry += offered * (now - last).as_secs_f64();
            last = now;
            while carry >= 1.0 {
                carry -= 1.0;
                sent += 1;
                if client.limiter().decide(&caller, &procedure).admitted() {
                    admitted += 1;
                }
            }
            tokio::time::sleep(slice).await;
        }
        println!(
            "   t={second}s offered {sent:>6} admitted {admitted:>6} dropped {:>5.1}%",
            100.0 * (sent - admitted) as f64 / sent.max(1) as f64
        );
    }
    client.shutdown();
    agg.shutdown().await;
    Ok(())
}

fn rlc_yaml(controller_url: &str) -> String {
    format!(
        "# Written by `rlc demo`: the embedded defaults. Paths are relative to this file.
history:
  file: history.csv
  lookback: 28d
  step: 1m
config_repo:
  path: config-repo
  branch: main
  mode: direct
controller:
  url: {controller_url}   # the demo's in-process controller (gone when the demo ends)
  token_env: {TOKEN_ENV}
database_url: sqlite://rlc.db
schedule: \"0 3 * * *\"
"
    )
}

fn git_head(repo: &Path) -> anyhow::Result<String> {
    let r = git2::Repository::open(repo)?;
    let id = r.head()?.peel_to_commit()?.id().to_string();
    Ok(id)
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
