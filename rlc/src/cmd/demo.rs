//! `rlc demo`: the whole loop on embedded defaults, for a first look, leaving a directory that
//! the README's next commands (`grl controller`, `rlc run --once`, `rlc serve`) work with as is.
//!
//! 1. a config repo made from the template embedded in the binary (a real git repository);
//! 2. four weeks of generated per-minute history (the bundled quickstart set, as CSV);
//! 3. credentials (one per role, mode 600, as in production; `rlc-token` holds rlc's own),
//!    `rlc.yaml`, and a GRL controller in-process on loopback with its state in `grl-state/`;
//! 4. one `rlc run` cycle: history → policies → rails → `buckets/*.yaml` committed → pushed to
//!    the controller → recorded in SQLite;
//! 5. live traffic at 1.5× a bucket's new limit (and a shadow bucket's): requests to an
//!    in-process axum service behind `GrlLayer`, whose GRL client reports through a zone
//!    aggregator: 429s settle the admitted rate at the limit; the controller's reports go to
//!    the store (the dashboard's data), and the offered rates its `/metrics` counted become
//!    the history's last sample;
//! 6. a second cycle on that history: the enforced bucket keeps its limit (its overload lasted
//!    seconds and was refused: throttled minutes are not demand), the shadow bucket, which
//!    refused nothing, follows its demand; the demo prints why; capped decreases wait a day.
//!
//! Files the demo wrote are recorded with their hashes ([`files`]); a re-run rewrites only
//! those still unedited and says which it kept.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use grl_client::auth::CredentialSet;
use grl_client::client::{ClientOptions, GrlClient};
use grl_client::layer::{GrlLayer, KeyFrom};
use grl_control::aggregator::{Aggregator, AggregatorHandle, AggregatorOptions};
use grl_control::controller::{Controller, ControllerHandle, ControllerOptions};
use schema::{format_rps, Mode, PolicyName};
use tower::ServiceExt as _;

use crate::cycle::{Cycle, RunStatus};
use crate::gitops::short;
use rlc_plan::plan::Plan;

pub mod files;
use files::{Owned, Wrote};

mod template {
    include!(concat!(env!("OUT_DIR"), "/template.rs"));
}

/// Arguments of `rlc demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Working directory for the demo (config repo, history, database, controller state).
    #[arg(long, default_value = "demo-out")]
    pub dir: PathBuf,
    /// A config-repo template directory to start from instead of the one built into rlc.
    #[arg(long)]
    pub template: Option<PathBuf>,
    /// Seconds of live traffic to drive through the GRL client (0: none, and the history
    /// stays the bundled one).
    #[arg(long, default_value_t = 4)]
    pub traffic_secs: u64,
    /// Where the `grl controller` of the next steps listens (`controller.url` of rlc.yaml).
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub controller_listen: String,
    /// Where `rlc serve` listens (`server.listen` of rlc.yaml).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
}

/// 256 random bits, hex.
fn secret() -> String {
    format!(
        "{:032x}{:032x}",
        rand::random::<u128>(),
        rand::random::<u128>()
    )
}

/// The secret of credential `name` in a credentials file (`NAME ROLES SECRET` lines), read
/// with the same parser the controller and the aggregator use.
fn credential(path: &Path, name: &str) -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let creds = grl_client::auth::parse_credentials(path, &text, None)
        .map_err(|e| anyhow::anyhow!("{e}; delete the file and `rlc demo` writes a new one"))?;
    creds
        .iter()
        .find(|c| c.name == name)
        .map(|c| c.secret().to_string())
        .with_context(|| {
            format!(
                "{}: no `{name}` credential line (NAME ROLES SECRET); delete the file and `rlc demo` writes a new one",
                path.display()
            )
        })
}

/// Prints what happened to a file the demo writes.
fn say(rel: &str, wrote: Wrote) {
    if wrote == Wrote::Kept {
        println!(
            "   kept {rel}: edited since `rlc demo` wrote it, or not written by it (delete it to get the demo's version)"
        );
    }
}

/// Runs the demo; returns the exit code.
pub async fn run(args: DemoArgs) -> anyhow::Result<i32> {
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating {}", args.dir.display()))?;
    let dir = args.dir.canonicalize()?;
    let mut owned = Owned::load(&dir)?;
    let files = prepare_files(&args, &dir, &mut owned)?;
    let controller = start_controller(&files).await?;
    let demo = Demo::new(&files, &controller)?;
    let Some(head) = demo.first_run(&files, &controller).await? else {
        controller.shutdown().await;
        bail!("the cycle failed");
    };
    let driven = run_traffic(&args, &files, &mut owned, &controller, &demo).await?;
    let again = demo.second_run(&files, &head, &driven).await?;
    controller.shutdown().await;
    print_next_steps(&args);
    Ok(if again.status == RunStatus::Failed {
        1
    } else {
        0
    })
}

/// Where the demo's files are, with the secrets it read from them.
struct Files {
    dir: PathBuf,
    repo_dir: PathBuf,
    history: PathBuf,
    creds_path: PathBuf,
    cfg_path: PathBuf,
    zone_token: String,
}

/// Steps 1 to 3's files: the config repo, the history, the credentials, `rlc-token` and
/// `rlc.yaml` (each reused, or kept when edited, as the module doc says).
fn prepare_files(args: &DemoArgs, dir: &Path, owned: &mut Owned) -> anyhow::Result<Files> {
    // 1. The config repo.
    let repo_dir = dir.join("config-repo");
    let created = match &args.template {
        Some(t) => init_config_repo(t, &repo_dir)?,
        None => init_config_repo_embedded(&repo_dir)?,
    };
    println!(
        "1. config repo  {} ({})",
        repo_dir.display(),
        match (created, &args.template) {
            (false, _) => "reused".to_string(),
            (true, None) => "created from the template built into rlc".to_string(),
            (true, Some(t)) => format!("created from {}", t.display()),
        }
    );
    let history = prepare_history(dir, owned)?;
    // 3. Credentials, one per role: rlc pushes configs and reads reports, on-call people add
    // overrides, aggregators send zone reports; no anonymous report is accepted. Reused when
    // they exist, so that a controller started from them keeps working across re-runs.
    let creds_path = dir.join("grl-credentials");
    if !creds_path.exists() {
        let w = owned.write(
            "grl-credentials",
            &format!(
                "# Written by `rlc demo`: NAME ROLES SECRET (see docs/security.md).\nrlc config,reports {}\noncall overrides {}\nzone-report zone-report {}\n",
                secret(),
                secret(),
                secret()
            ),
            true,
        )?;
        say("grl-credentials", w);
    }
    let token = credential(&creds_path, "rlc")?;
    let zone_token = credential(&creds_path, "zone-report")?;
    say(
        "rlc-token",
        owned.write("rlc-token", &format!("{token}\n"), true)?,
    );
    let cfg_path = dir.join("rlc.yaml");
    say(
        "rlc.yaml",
        owned.write(
            "rlc.yaml",
            &rlc_yaml(&args.controller_listen, &args.listen),
            false,
        )?,
    );
    Ok(Files {
        dir: dir.to_path_buf(),
        repo_dir,
        history,
        creds_path,
        cfg_path,
        zone_token,
    })
}

/// Step 2: four weeks of generated history, unless there is one.
fn prepare_history(dir: &Path, owned: &mut Owned) -> anyhow::Result<PathBuf> {
    let history = dir.join("history.csv");
    if !history.exists() {
        let rows = crate::history::synth::generate(&history, 42, chrono::Utc::now(), 28, 60)
            .with_context(|| format!("writing {}", history.display()))?;
        owned.record("history.csv")?;
        println!(
            "2. history      {} ({rows} per-minute samples, 28 days, generated)",
            history.display()
        );
    } else {
        println!("2. history      {} (reused)", history.display());
    }
    Ok(history)
}

/// The in-process controller serving the repo's buckets, its state where the README's
/// `grl controller` takes it over.
async fn start_controller(files: &Files) -> anyhow::Result<ControllerHandle> {
    let mut credentials = CredentialSet::default();
    credentials.add_file(&files.creds_path, Some(grl_control::controller::ROLES))?;
    let controller = Controller::start(ControllerOptions {
        state_dir: files.dir.join("grl-state"),
        credentials,
        config_dir: Some(files.repo_dir.join("buckets")),
        tick: Duration::from_millis(250),
        ..Default::default()
    })
    .await
    .context("starting the GRL controller")?;
    println!(
        "3. controller   {} (in-process for the demo; state in {})",
        controller.url(),
        files.dir.join("grl-state").display()
    );
    println!(
        "   credentials  {} (mode 600: rlc = config,reports; oncall = overrides; zone-report), rlc's in {}",
        files.creds_path.display(),
        files.dir.join("rlc-token").display()
    );
    Ok(controller)
}

/// The demo's cycles: rlc.yaml's config pointed at the in-process controller, and the
/// production planner keeping its last plan (the demo says why a driven bucket kept its
/// limit: the plan's evidence).
struct Demo {
    cfg: schema::DaemonConfig,
    base: PathBuf,
    cycle: Cycle,
    planner: crate::cycle::Planner,
    last_plan: Arc<Mutex<Option<Plan>>>,
}

impl Demo {
    fn new(files: &Files, controller: &ControllerHandle) -> anyhow::Result<Self> {
        // rlc.yaml names the controller of the next steps; the demo's cycles talk to this one.
        let (mut cfg, base) = crate::config::load_config(&files.cfg_path)?;
        if let Some(c) = cfg.controller.as_mut() {
            c.url = controller.url();
        }
        let last_plan: Arc<Mutex<Option<Plan>>> = Arc::default();
        let planner: crate::cycle::Planner = {
            let last_plan = last_plan.clone();
            Arc::new(move |input| {
                let last_plan = last_plan.clone();
                Box::pin(async move {
                    let plan = crate::cycle::compute::compute(input).await?;
                    *last_plan.lock().unwrap_or_else(|e| e.into_inner()) = Some(plan.clone());
                    Ok(plan)
                })
            })
        };
        let cycle = Cycle::new(cfg.clone(), &base);
        Ok(Demo {
            cfg,
            base,
            cycle,
            planner,
            last_plan,
        })
    }

    /// Step 4: one full cycle, and whether the controller serves what it committed; returns the
    /// config repo's HEAD, or `None` when the cycle failed.
    async fn first_run(
        &self,
        files: &Files,
        controller: &ControllerHandle,
    ) -> anyhow::Result<Option<String>> {
        println!("4. rlc run      (config: {})", files.cfg_path.display());
        let out = self.cycle.run(&self.planner, "demo").await;
        for line in out.to_string().lines() {
            println!("   {line}");
        }
        if out.status == RunStatus::Failed {
            return Ok(None);
        }
        let head = git_head(&files.repo_dir)?;
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
        Ok(Some(head))
    }

    /// Step 6: the history with the observed traffic: the enforced bucket's overload was refused
    /// (throttled minutes, left out); the shadow bucket's demand is learned. Decreases the
    /// rails capped wait for the next interval (one decrease per bucket per day).
    async fn second_run(
        &self,
        files: &Files,
        head: &str,
        driven: &[(String, String)],
    ) -> anyhow::Result<crate::cycle::RunOutcome> {
        let again = self.cycle.run(&self.planner, "demo").await;
        let head2 = git_head(&files.repo_dir)?;
        let waiting = again
            .skipped
            .iter()
            .filter(|s| s.reason.contains("already lowered"))
            .count();
        println!(
            "6. rlc run again, on the history with the observed traffic: {}{}",
            again.status.as_str(),
            if waiting > 0 {
                format!(
                    " ({waiting} capped decrease(s) wait a day: one decrease per bucket per day)"
                )
            } else {
                String::new()
            }
        );
        for line in again.to_string().lines().skip(1) {
            println!("   {line}");
        }
        self.print_why(driven);
        println!(
            "   {}",
            if head2 == head {
                "no new commit".to_string()
            } else {
                format!("new commit {}", short(&head2))
            }
        );
        Ok(again)
    }

    /// Why each driven bucket has the limit it has: an overload refused for seconds is not
    /// demand (the enforced bucket keeps its limit); the shadow bucket refused nothing.
    fn print_why(&self, driven: &[(String, String)]) {
        let last_plan = self.last_plan.lock().unwrap_or_else(|e| e.into_inner());
        let Some(plan) = last_plan.as_ref() else {
            return;
        };
        for (service, name) in driven {
            if let Some(b) = plan
                .buckets
                .iter()
                .find(|b| &b.service == service && &b.bucket.name == name)
            {
                println!(
                    "   why          {service}/{name} ({}) {} rps: {}",
                    b.bucket.mode.as_str(),
                    format_rps(b.bucket.limit_rps),
                    b.evidence.explain.as_deref().unwrap_or("-")
                );
            }
        }
    }
}

/// The buckets the demo drives: an enforced bucket (a peak policy's when there is one: its
/// next limit follows the observed peak) and a shadow bucket of the same service, when there
/// is traffic to drive.
fn driven_buckets(repo_dir: &Path, traffic_secs: u64) -> Option<(String, Vec<schema::Bucket>)> {
    let after = schema::ConfigRepo::load(repo_dir).0;
    let mut all: Vec<(String, schema::Bucket)> = after
        .buckets
        .values()
        .flat_map(|f| {
            f.value
                .buckets
                .iter()
                .map(move |b| (f.value.service.clone(), b.clone()))
        })
        .filter(|(_, b)| b.caller.is_some() && b.procedure.is_some())
        .collect();
    all.sort_by_key(|(_, b)| (b.mode != Mode::Enforce, b.policy != PolicyName::Peak));
    let (service, enforced) = all
        .first()
        .filter(|(_, b)| b.mode == Mode::Enforce && traffic_secs > 0)?;
    let shadow = all
        .iter()
        .find(|(s, b)| s == service && b.mode == Mode::Shadow)
        .map(|(_, b)| b.clone());
    let mut driven = vec![enforced.clone()];
    driven.extend(shadow);
    Some((service.clone(), driven))
}

/// Step 5: live traffic through a real client and aggregator on the driven buckets, the
/// controller's reports read into the store, and the offered rates it counted added to the
/// history; returns the driven buckets as (service, bucket).
async fn run_traffic(
    args: &DemoArgs,
    files: &Files,
    owned: &mut Owned,
    controller: &ControllerHandle,
    demo: &Demo,
) -> anyhow::Result<Vec<(String, String)>> {
    let driven = driven_buckets(&files.repo_dir, args.traffic_secs);
    if args.traffic_secs == 0 {
        println!("5. traffic      none (--traffic-secs 0): the history stays the bundled one");
    }
    let Some((service, driven)) = driven else {
        return Ok(Vec::new());
    };
    let before = offered_counts(&controller.url()).await?;
    traffic(
        &controller.url(),
        owned,
        &files.zone_token,
        &service,
        &driven,
        args.traffic_secs,
    )
    .await?;
    let counted = offered_counts(&controller.url()).await?;
    // The controller writes a second's report rows after it: the last counts are in rows at
    // most a second after the traffic's end.
    let offered: f64 = counted
        .iter()
        .filter(|(k, _)| k.0 == service)
        .map(|(k, n)| n - before.get(k).copied().unwrap_or(0.0))
        .sum();
    let (sums, stored) = read_reports(demo, controller, &service, offered).await?;
    for b in &driven {
        let (o, d, v) = sums.get(&b.name).copied().unwrap_or_default();
        let pct = |x: f64| 100.0 * x / o.max(f64::MIN_POSITIVE);
        println!(
            "   reports      {service}/{} ({}): dropped {:.1}%, virtually dropped (shadow) {:.1}% of the offered requests",
            b.name,
            b.mode.as_str(),
            pct(d),
            pct(v)
        );
    }
    println!(
        "   store        {stored} controller reports stored in {} (the dashboard's data)",
        files.dir.join("rlc.db").display()
    );
    // What the controller counted, as Prometheus would scrape it: the history's last sample.
    let mut observed = Vec::new();
    for (key, n) in &counted {
        let rate = (n - before.get(key).copied().unwrap_or(0.0)) / args.traffic_secs as f64;
        if rate > 0.0 {
            observed.push((key.clone(), rate));
        }
    }
    add_observed(owned, &files.history, &observed, args.traffic_secs)?;
    Ok(driven
        .iter()
        .map(|b| (service.clone(), b.name.clone()))
        .collect())
}

/// Offered, dropped and virtually dropped requests per bucket.
type Sums = BTreeMap<String, (f64, f64, f64)>;

/// The controller's reports into the store (the dashboard's data: `rlc serve` reads them from
/// here on), read until every request of `service` it counted (`offered`) is in a row, or 5 s
/// passed; returns `service`'s sums per bucket and how many reports were stored.
async fn read_reports(
    demo: &Demo,
    controller: &ControllerHandle,
    service: &str,
    offered: f64,
) -> anyhow::Result<(Sums, u64)> {
    let mut client_cfg = demo
        .cfg
        .controller
        .clone()
        .context("rlc.yaml has no controller")?;
    client_cfg.url = controller.url();
    let client = crate::push::ControllerClient::from_config(&client_cfg, &demo.base)?;
    let store = demo.cycle.store().await?;
    let (mut cursor, mut stored) = (None::<String>, 0);
    let mut sums = Sums::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let page = client.reports(cursor.as_deref(), 10_000).await?;
        let n = page.reports.len();
        for r in page.reports.iter().filter(|r| r.service == service) {
            let e = sums.entry(r.bucket.clone()).or_default();
            let [offered, _, dropped, shadow_dropped] = r.requests();
            e.0 += offered;
            e.1 += dropped;
            e.2 += shadow_dropped;
        }
        stored += store
            .insert_reports(&page.reports, chrono::Utc::now())
            .await?;
        let next = page.next.as_param();
        let moved = next.is_some() && next != cursor;
        if moved {
            cursor = next;
        }
        if n == 10_000 && moved {
            continue;
        }
        let in_rows: f64 = sums.values().map(|e| e.0).sum();
        if in_rows >= offered || std::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok((sums, stored))
}

/// Appends the observed rates to the history as its last minute, unless the history was
/// edited since the demo wrote it.
fn add_observed(
    owned: &mut Owned,
    history: &Path,
    observed: &[((String, String, String), f64)],
    traffic_secs: u64,
) -> anyhow::Result<()> {
    if !owned.is_ours("history.csv") {
        println!("   kept history.csv: edited since `rlc demo` wrote it; the observed rates are not added");
        return Ok(());
    }
    // Stamped at the last whole minute (the newest a run reads), or the history's last
    // minute if later.
    let whole = chrono::Utc::now().timestamp() / 60 * 60 - 60;
    let last = last_sample_ts(history)?.max(whole);
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(history)
        .with_context(|| format!("appending to {}", history.display()))?;
    writeln!(
        f,
        "# observed by `rlc demo` at {}: grl_requests_offered_total over {} s of traffic",
        chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        traffic_secs
    )?;
    for ((s, c, p), rate) in observed {
        writeln!(f, "{last},{s},{c},{p},{rate:.3}")?;
        println!(
            "   observed     {s}/{c}.{p} {} rps offered (the controller's grl_requests_offered_total), added to history.csv as its last minute",
            format_rps(rate.round())
        );
    }
    drop(f);
    owned.record("history.csv")?;
    Ok(())
}

/// The README's next commands, run the way this one was (`cargo run` or installed).
fn print_next_steps(args: &DemoArgs) {
    let (rlc, grl) = if std::env::var("CARGO_PKG_NAME").as_deref() == Ok("rlc") {
        // Started by `cargo run`: the same way for the next commands.
        let release = if cfg!(debug_assertions) {
            ""
        } else {
            " --release"
        };
        (
            format!("cargo run{release} -p rlc --"),
            format!("cargo run{release} -p grl-runtime --"),
        )
    } else {
        ("rlc".to_string(), "grl".to_string())
    };
    let d = args.dir.display();
    println!("\nNext, from this directory (README, Quick start): the controller from the demo's state, a run, the daemon");
    println!(
        "  {grl} controller --listen {} --state-dir {d}/grl-state --credentials {d}/grl-credentials &",
        args.controller_listen
    );
    println!("  {rlc} run --config {d}/rlc.yaml --once");
    println!("  {rlc} serve --config {d}/rlc.yaml");
    println!(
        "Dashboard: http://{}/ ; `git -C {d}/config-repo log -p` shows what was committed.",
        args.listen
    );
}

/// `grl_requests_offered_total` of the controller's `/metrics`, summed per (service, caller,
/// procedure) over buckets and zones.
async fn offered_counts(
    controller: &str,
) -> anyhow::Result<BTreeMap<(String, String, String), f64>> {
    let text = reqwest::get(format!("{controller}/metrics"))
        .await?
        .error_for_status()?
        .text()
        .await?;
    Ok(parse_offered(&text))
}

/// The `grl_requests_offered_total` samples of an OpenMetrics text, summed per (service,
/// caller, procedure).
fn parse_offered(text: &str) -> BTreeMap<(String, String, String), f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("grl_requests_offered_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let mut l: BTreeMap<String, String> = BTreeMap::new();
        let mut chars = labels.chars().peekable();
        while chars.peek().is_some() {
            let name: String = chars.by_ref().take_while(|&c| c != '=').collect();
            if chars.next() != Some('"') {
                break;
            }
            let mut value = String::new();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
            l.insert(name.trim_start_matches(',').to_string(), value);
            if chars.peek() == Some(&',') {
                chars.next();
            }
        }
        let get = |k: &str| l.get(k).cloned().unwrap_or_default();
        *out.entry((get("service"), get("caller"), get("procedure")))
            .or_insert(0.0) += v;
    }
    out
}

/// The timestamp of the last row of a history CSV.
fn last_sample_ts(path: &Path) -> anyhow::Result<i64> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .rev()
        .filter(|l| !l.starts_with('#') && !l.starts_with("ts,"))
        .find_map(|l| l.split(',').next()?.trim().parse::<i64>().ok())
        .with_context(|| format!("{}: no sample", path.display()))
}

/// Offers 1.5× each bucket's limit for `secs` seconds to an axum service behind `GrlLayer`
/// (its GRL client reporting to a zone aggregator), and prints the 429s each second.
async fn traffic(
    controller: &str,
    owned: &mut Owned,
    zone_token: &str,
    service: &str,
    buckets: &[schema::Bucket],
    secs: u64,
) -> anyhow::Result<()> {
    let (agg, client, client_creds) = start_client(controller, owned, zone_token, service).await?;
    let offered: Vec<f64> = buckets.iter().map(|b| b.limit_rps * 1.5).collect();
    for (i, (b, o)) in buckets.iter().zip(&offered).enumerate() {
        println!(
            "{} {service}/{} ({}) limit {} rps: {} rps of requests to an axum service behind GrlLayer (GRL client → zone aggregator → controller)",
            if i == 0 { "5. traffic     " } else { "   traffic     " },
            b.name,
            b.mode.as_str(),
            format_rps(b.limit_rps),
            format_rps(o.round())
        );
    }
    println!(
        "   client credential for {service} in {} (mode 600); anonymous reports are refused",
        client_creds.display()
    );
    // The service: an axum router behind `GrlLayer` (caller from `x-caller`, procedure from
    // the path), called in-process; a dropped request is answered 429 by the layer.
    let app = axum::Router::new().fallback(|| async { "ok\n" }).layer(
        GrlLayer::for_client(&client)
            .caller_from(KeyFrom::Header(axum::http::HeaderName::from_static(
                "x-caller",
            )))
            .procedure_from(KeyFrom::PathSegment(0)),
    );
    // Before its first config a client lets every request through uncounted (fail-open):
    // the traffic starts once the buckets reached it, so that every request is counted.
    let waited = Instant::now() + Duration::from_secs(10);
    while client.limiter().table().version().is_empty() && Instant::now() < waited {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    offer(&app, buckets, &offered, secs).await?;
    // Let the last counts reach the controller (client, aggregator and controller tick every
    // 250 ms) before anyone reads them.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    client.shutdown();
    agg.shutdown().await;
    Ok(())
}

/// A zone aggregator reporting to `controller` and a GRL client of `service` reporting to it,
/// with the client's credential (written on first use: the aggregator accepts client reports
/// only with a credential for their service) and the file holding it.
async fn start_client(
    controller: &str,
    owned: &mut Owned,
    zone_token: &str,
    service: &str,
) -> anyhow::Result<(AggregatorHandle, GrlClient, PathBuf)> {
    let client_creds = owned.dir().join("grl-client-credentials");
    if !client_creds.exists() {
        let w = owned.write(
            "grl-client-credentials",
            &format!(
                "# Written by `rlc demo`: NAME SERVICES SECRET (see docs/security.md).\n{service} {service} {}\n",
                secret()
            ),
            true,
        )?;
        say("grl-client-credentials", w);
    }
    let client_token = credential(&client_creds, service)?;
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
    Ok((agg, client, client_creds))
}

/// Sends `offered[i]` requests/s of bucket `i`'s caller and procedure to `app` for `secs`
/// seconds, printing each second's requests and 429s per bucket.
async fn offer(
    app: &axum::Router,
    buckets: &[schema::Bucket],
    offered: &[f64],
    secs: u64,
) -> anyhow::Result<()> {
    let slice = Duration::from_millis(20);
    let start = Instant::now();
    let mut last = start;
    let mut carry = vec![0.0; buckets.len()];
    for second in 1..=secs {
        let mut counts = vec![(0u64, 0u64); buckets.len()];
        let end = start + Duration::from_secs(second);
        while Instant::now() < end {
            // Requests due since the last slice, so that sleep overshoot does not lower the rate.
            let now = Instant::now();
            let dt = (now - last).as_secs_f64();
            last = now;
            for (i, b) in buckets.iter().enumerate() {
                carry[i] += offered[i] * dt;
                let caller = b.caller.as_deref().unwrap_or_default();
                let path = format!("/{}", b.procedure.as_deref().unwrap_or_default());
                while carry[i] >= 1.0 {
                    carry[i] -= 1.0;
                    let req = axum::http::Request::get(&path)
                        .header("x-caller", caller)
                        .body(axum::body::Body::empty())?;
                    let status = app.clone().oneshot(req).await?.status();
                    counts[i].0 += 1;
                    if status == axum::http::StatusCode::TOO_MANY_REQUESTS {
                        counts[i].1 += 1;
                    }
                }
            }
            tokio::time::sleep(slice).await;
        }
        let line: Vec<String> = buckets
            .iter()
            .zip(&counts)
            .map(|(b, &(sent, limited))| {
                format!(
                    "{}: {sent:>5} requests, {limited:>5} answered 429 ({:>4.1}%)",
                    b.name,
                    100.0 * limited as f64 / sent.max(1) as f64
                )
            })
            .collect();
        println!("   t={second}s {}", line.join(" | "));
    }
    Ok(())
}

fn rlc_yaml(controller_listen: &str, listen: &str) -> String {
    format!(
        "# Written by `rlc demo`: the embedded defaults. Paths are relative to this file.
# `rlc demo` rewrites this file on its next run unless you edited it (then it keeps it).
history:
  file: history.csv
  lookback: 28d
  step: 1m
config_repo:
  path: config-repo
  branch: main
  mode: direct
controller:
  # started from the demo's state: grl controller --listen {controller_listen} --state-dir grl-state --credentials grl-credentials
  url: http://{controller_listen}
  token_file: rlc-token   # the `rlc` credential of grl-credentials (roles config, reports)
database_url: sqlite://rlc.db
schedule: \"0 3 * * *\"
server:
  listen: {listen}   # the dashboard: http://{listen}/
"
    )
}

fn git_head(repo: &Path) -> anyhow::Result<String> {
    let r = git2::Repository::open(repo)?;
    let id = r.head()?.peel_to_commit()?.id().to_string();
    Ok(id)
}

/// Writes the template built into rlc into a new git repository at `dest` with one initial
/// commit; leaves an existing repository alone. Returns whether it created one.
pub fn init_config_repo_embedded(dest: &Path) -> anyhow::Result<bool> {
    if dest.join(".git").exists() {
        return Ok(false);
    }
    for (rel, bytes, exec) in template::TEMPLATE {
        let path = dest.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
        if *exec {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        }
    }
    commit_initial(dest)?;
    Ok(true)
}

/// Copies the template directory into a new git repository at `dest` with one initial
/// commit; leaves an existing repository alone. Returns whether it created one.
pub fn init_config_repo(template: &Path, dest: &Path) -> anyhow::Result<bool> {
    if dest.join(".git").exists() {
        return Ok(false);
    }
    copy_dir(template, dest)?;
    commit_initial(dest)?;
    Ok(true)
}

fn commit_initial(dest: &Path) -> anyhow::Result<()> {
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
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_template_is_the_source_tree_one() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config-repo-template");
        assert!(
            template::TEMPLATE.len() >= 6,
            "{}",
            template::TEMPLATE.len()
        );
        for (rel, bytes, _) in template::TEMPLATE {
            assert_eq!(&std::fs::read(root.join(rel)).unwrap()[..], *bytes, "{rel}");
        }
        let d = tempfile::tempdir().unwrap();
        assert!(init_config_repo_embedded(&d.path().join("r")).unwrap());
        let (_, diags) = schema::ConfigRepo::load(&d.path().join("r"));
        assert!(diags.is_empty(), "{}", schema::Diagnostics(diags));
        assert!(!init_config_repo_embedded(&d.path().join("r")).unwrap());
    }

    #[test]
    fn offered_counts_are_summed_per_series() {
        let text = "# TYPE grl_requests_offered counter\n\
            grl_requests_offered_total{service=\"pay\",bucket=\"a\",caller=\"web\",procedure=\"charge\",zone=\"z1\"} 10\n\
            grl_requests_offered_total{service=\"pay\",bucket=\"a\",caller=\"web\",procedure=\"charge\",zone=\"z2\"} 5.5\n\
            grl_requests_offered_total{service=\"pay\",bucket=\"b\",caller=\"x\\\"y\",procedure=\"\",zone=\"z1\"} 2\n\
            grl_requests_admitted_total{service=\"pay\",bucket=\"a\",caller=\"web\",procedure=\"charge\",zone=\"z1\"} 9\n";
        let got = parse_offered(text);
        let k = |s: &str, c: &str, p: &str| (s.to_string(), c.to_string(), p.to_string());
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[&k("pay", "web", "charge")], 15.5);
        assert_eq!(got[&k("pay", "x\"y", "")], 2.0);
    }

    #[test]
    fn credentials_are_read_with_the_controllers_parser() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("grl-credentials");
        std::fs::write(
            &f,
            "# demo\nrlc config,reports 0123456789abcdef0123\nzone-report zone-report fedcba9876543210fedc\n",
        )
        .unwrap();
        assert_eq!(credential(&f, "rlc").unwrap(), "0123456789abcdef0123");
        assert_eq!(
            credential(&f, "zone-report").unwrap(),
            "fedcba9876543210fedc"
        );
        let e = credential(&f, "oncall").unwrap_err().to_string();
        assert!(e.contains("no `oncall` credential line"), "{e}");
        // A damaged line is named by file and line, as the controller would name it.
        std::fs::write(
            &f,
            "rlc config,reports 0123456789abcdef0123\nzone-report short\n",
        )
        .unwrap();
        let e = credential(&f, "rlc").unwrap_err().to_string();
        assert!(e.contains("grl-credentials:2:"), "{e}");
        assert!(e.contains("delete the file"), "{e}");
    }
}
