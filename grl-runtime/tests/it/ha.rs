//! Highly available controllers: two `grl controller` replicas on one Postgres, two
//! aggregators reporting to both, clients offering twice the limit; one replica killed with
//! SIGKILL under traffic, then restarted.

use super::*;

/// Requests offered and admitted by the whole fleet over the next `ms` milliseconds, per
/// second.
async fn admitted_rps(counts: &[AtomicU64; 2], ms: u64) -> (f64, f64) {
    let before = [0, 1].map(|i| counts[i].load(Ordering::Relaxed));
    tokio::time::sleep(Duration::from_millis(ms)).await;
    let after = [0, 1].map(|i| counts[i].load(Ordering::Relaxed));
    let secs = ms as f64 / 1000.0;
    let offered = (after[0] - before[0]) as f64;
    let dropped = (after[1] - before[1]) as f64;
    (offered / secs, (offered - dropped) / secs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_killed_under_traffic_loses_no_enforcement_and_catches_up_on_restart() {
    let db = test_support::postgres::fresh_database().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (free_port(), free_port());
    let (ca, cb) = (
        format!("http://127.0.0.1:{pa}"),
        format!("http://127.0.0.1:{pb}"),
    );
    let replica = |port: u16, name: &str| {
        spawn_controller(
            port,
            &dir.path().join(name),
            dir.path(),
            &["--database-url", &db.url, "--database-poll-secs", "1"],
        )
    };
    let ctl_a = replica(pa, "state-a");
    let _ctl_b = replica(pb, "state-b");
    wait_up(&format!("{ca}/v1/status")).await;
    wait_up(&format!("{cb}/v1/status")).await;
    let http = reqwest::Client::new();

    // A push to one replica is served by both.
    push_config(&http, &ca, &payments_config("v1", 200.0)).await;
    eventually("replica b serves v1", || {
        let (http, cb) = (http.clone(), cb.clone());
        async move { get_json(&http, &format!("{cb}/v1/config")).await["version"] == "v1" }
    })
    .await;

    // Two aggregators of the zone, each listing both replicas (a first).
    let (ga, gb) = (free_port(), free_port());
    let (ua, ub) = (
        format!("http://127.0.0.1:{ga}"),
        format!("http://127.0.0.1:{gb}"),
    );
    let creds = dir.path().join("client-credentials");
    std::fs::write(&creds, format!("payments payments {CLIENT_TOKEN}\n")).unwrap();
    let aggregator = |port: u16, id: &str| {
        spawn_aggregator_with(
            port,
            &ca,
            id,
            dir.path(),
            100,
            &[
                "--controller",
                &cb,
                "--client-credentials",
                creds.to_str().unwrap(),
            ],
            &[("GRL_REPORT_TOKEN", REPORT_TOKEN)],
        )
    };
    let _agg_a = aggregator(ga, "agg-a");
    let _agg_b = aggregator(gb, "agg-b");
    wait_up(&format!("{ua}/v1/config")).await;
    wait_up(&format!("{ub}/v1/config")).await;

    // An incident override added on replica a (limit 150 instead of 200) before the kill.
    let r = http
        .post(format!("{ca}/v1/overrides"))
        .bearer_auth(TOKEN)
        .json(
            &json!({"service": "payments", "bucket": "gw.charge", "limit_rps": 150.0,
                       "ttl_secs": 3600, "reason": "INC-7", "who": "carol"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let ovr: Value = r.json().await.unwrap();
    eventually("replica b holds the override", || {
        let (http, cb) = (http.clone(), cb.clone());
        let id = ovr["id"].clone();
        async move {
            get_json(&http, &format!("{cb}/v1/overrides")).await["overrides"][0]["id"] == id
        }
    })
    .await;

    // 4 clients × 100 rps = 400 rps offered against the override's 150.
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let clients = super::alternating_clients(4, &ua, &ub);
    for c in &clients {
        load_as(
            c.clone(),
            ("gw", "charge"),
            100.0,
            stop.clone(),
            counts.clone(),
        );
    }
    let limit = 150.0;
    let within = |admitted: f64| ((admitted - limit) / limit).abs() <= 0.05;
    // Settled: two consecutive seconds within ±5% of the override's limit.
    let mut settled = 0;
    let mut seen = Vec::new();
    for _ in 0..20 {
        let (offered, admitted) = admitted_rps(&counts, 1000).await;
        seen.push((offered.round(), admitted.round()));
        settled = if within(admitted) { settled + 1 } else { 0 };
        if settled == 2 {
            break;
        }
    }
    assert_eq!(settled, 2, "never settled at {limit} rps: {seen:?}");

    // The standby is warm: replica b computes from the same zone rates (it sees the whole
    // 400 rps offered), while the counts go to the replica whose directives are served only,
    // so each request is counted once over the replicas' /metrics.
    let (_, rows) = reports_after(&http, &cb, 0).await;
    let offered_b: Vec<f64> = rows
        .iter()
        .filter(|r| r["bucket"] == "gw.charge")
        .filter_map(|r| r["offered"].as_f64())
        .collect();
    let tail = &offered_b[offered_b.len().saturating_sub(10)..];
    let mean_b = tail.iter().sum::<f64>() / tail.len().max(1) as f64;
    assert!(
        mean_b > 300.0,
        "standby b saw {mean_b:.0} rps offered: {tail:?}"
    );
    let metrics_text = |base: String| {
        let http = http.clone();
        async move {
            http.get(format!("{base}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    };
    let counted_a = offered_total(&metrics_text(ca.clone()).await, "gw.charge", "z1");
    let counted_b = offered_total(&metrics_text(cb.clone()).await, "gw.charge", "z1");
    assert!(counted_a.unwrap_or(0) > 0, "{counted_a:?}");
    assert_eq!(counted_b.unwrap_or(0), 0, "standby b counted requests");

    // Kill replica a (SIGKILL) under traffic: the aggregators fail over to b, which had the
    // same inputs all along; the fleet stays at the limit over the following seconds.
    ctl_a.kill();
    let (offered, admitted) = admitted_rps(&counts, 4000).await;
    assert!(offered > 350.0, "offered {offered} rps");
    assert!(
        within(admitted),
        "admitted {admitted:.1} rps over the 4 s after the kill, limit {limit} (±5%); before: {seen:?}"
    );
    eprintln!(
        "before the kill (offered, admitted rps per second): {seen:?}; 4 s after: {offered:.1}, {admitted:.1}"
    );
    let counted_b = offered_total(&metrics_text(cb.clone()).await, "gw.charge", "z1");
    assert!(counted_b.unwrap_or(0) > 0, "b counts once it serves");
    let now = grl_core::now_ms();
    for c in &clients {
        let t = c.limiter().table();
        assert!(!t.is_stale(now), "a client went stale after the kill");
        assert_eq!(t.version(), "v1");
    }
    let list = get_json(&http, &format!("{cb}/v1/overrides")).await;
    assert_eq!(list["overrides"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list["overrides"][0]["id"], ovr["id"]);
    assert_eq!(list["overrides"][0]["reason"], "INC-7");

    // While a is down, b takes a new version; a restarted catches up from the database and
    // serves the same version, override and revision as b.
    push_config(&http, &cb, &payments_config("v2", 200.0)).await;
    let _ctl_a = replica(pa, "state-a");
    wait_up(&format!("{ca}/v1/status")).await;
    let (cfg_a, cfg_b) = (
        get_json(&http, &format!("{ca}/v1/config")).await,
        get_json(&http, &format!("{cb}/v1/config")).await,
    );
    assert_eq!(cfg_b["version"], "v2");
    assert_eq!(cfg_a["version"], cfg_b["version"]);
    assert_eq!(cfg_a, cfg_b);
    let (st_a, st_b) = (
        get_json(&http, &format!("{ca}/v1/status")).await,
        get_json(&http, &format!("{cb}/v1/status")).await,
    );
    assert_eq!(st_a["state"]["backend"], "postgres", "{st_a}");
    assert_eq!(st_a["state"]["revision"], st_b["state"]["revision"]);
    assert_eq!(st_a["overrides"], 1);
    let list_a = get_json(&http, &format!("{ca}/v1/overrides")).await;
    assert_eq!(list_a["overrides"][0]["id"], ovr["id"]);
    // Nothing was written to the state directories: the database holds the state.
    assert!(!dir.path().join("state-a/config.json").exists());
    // The clients moved to v2 (through b) and still enforce the override.
    eventually("clients run v2", || {
        let ok = clients
            .iter()
            .all(|c| c.limiter().table().version() == "v2");
        async move { ok }
    })
    .await;
    let (_, admitted) = admitted_rps(&counts, 2000).await;
    assert!(
        ((admitted - limit) / limit).abs() <= 0.1,
        "admitted {admitted:.1} rps after the restart"
    );
    stop.store(true, Ordering::Relaxed);
}

/// The largest `grl_aggregator_directives_age_seconds` of aggregator `base` sampled every
/// 50 ms over `ms` milliseconds.
async fn max_directives_age(http: &reqwest::Client, base: &str, ms: u64) -> f64 {
    let mut max: f64 = 0.0;
    for _ in 0..ms / 50 {
        let text = get_text(http, &format!("{base}/metrics")).await;
        if let Some(age) = text
            .lines()
            .find_map(|l| l.strip_prefix("grl_aggregator_directives_age_seconds "))
        {
            max = max.max(age.trim().parse().unwrap());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    max
}

/// A hung replica (SIGSTOP: it accepts connections and never answers) costs the aggregator
/// about one tick, not its 2 s client timeout: a delta report not answered within the tick
/// (500 ms at least) goes to the standby, which already holds the zone's rates through its
/// own delta session. Once the hung replica runs again the aggregator stays with the standby
/// (no flapping back) and the former primary gets the standby copies again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_replica_fails_over_within_about_a_tick() {
    let dir = tempfile::tempdir().unwrap();
    let (pa, pb) = (free_port(), free_port());
    let (ca, cb) = (
        format!("http://127.0.0.1:{pa}"),
        format!("http://127.0.0.1:{pb}"),
    );
    let ctl_a = spawn_controller(pa, &dir.path().join("state-a"), dir.path(), &[]);
    let _ctl_b = spawn_controller(pb, &dir.path().join("state-b"), dir.path(), &[]);
    let http = reqwest::Client::new();
    for c in [&ca, &cb] {
        wait_up(&format!("{c}/v1/status")).await;
        push_config(&http, c, &payments_config("v1", 200.0)).await;
    }
    let ga = free_port();
    let ua = format!("http://127.0.0.1:{ga}");
    let creds = dir.path().join("client-credentials");
    std::fs::write(&creds, format!("payments payments {CLIENT_TOKEN}\n")).unwrap();
    let _agg = spawn_aggregator_with(
        ga,
        &ca,
        "agg-hung",
        dir.path(),
        100,
        &[
            "--controller",
            &cb,
            "--client-credentials",
            creds.to_str().unwrap(),
        ],
        &[("GRL_REPORT_TOKEN", REPORT_TOKEN)],
    );
    wait_up(&format!("{ua}/v1/config")).await;
    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let clients = super::alternating_clients(2, &ua, &ua);
    for c in &clients {
        load_as(
            c.clone(),
            ("gw", "charge"),
            100.0,
            stop.clone(),
            counts.clone(),
        );
    }
    let metrics_of = |base: String| {
        let http = http.clone();
        async move {
            http.get(format!("{base}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }
    };
    // Replica a serves (it is listed first) and counts; b gets the rates only.
    eventually("replica a counts the zone's requests", || {
        let m = metrics_of(ca.clone());
        async move { offered_total(&m.await, "gw.charge", "z1").unwrap_or(0) > 0 }
    })
    .await;
    let steady = max_directives_age(&http, &ua, 1000).await;
    assert_eq!(
        offered_total(&metrics_of(cb.clone()).await, "gw.charge", "z1").unwrap_or(0),
        0,
        "standby b counted requests"
    );

    // Hung, not dead: the aggregator's next delta to a waits for no answer.
    ctl_a.signal(libc::SIGSTOP);
    let hung = max_directives_age(&http, &ua, 3000).await;
    let counted_b = offered_total(&metrics_of(cb.clone()).await, "gw.charge", "z1");
    ctl_a.signal(libc::SIGCONT);
    eprintln!("directives age: steady max {steady:.3} s, with a hung primary max {hung:.3} s");
    assert!(
        counted_b.unwrap_or(0) > 0,
        "b serves and counts once a hangs"
    );
    // One tick (100 ms) plus the 500 ms floor of the delta answer's bound and b's answer;
    // the client timeout (2 s) would leave the directives more than 2 s old.
    assert!(
        hung < 1.5,
        "directives {hung:.3} s old while the primary hung (steady {steady:.3} s)"
    );
    // a runs again: the aggregator stays with b (its directives are fresh and its counts
    // keep going there), and a is a standby that takes the copies again.
    let before = offered_total(&metrics_of(cb.clone()).await, "gw.charge", "z1").unwrap_or(0);
    let after_resume = max_directives_age(&http, &ua, 1500).await;
    let after = offered_total(&metrics_of(cb.clone()).await, "gw.charge", "z1").unwrap_or(0);
    assert!(after > before, "b still counts after a resumed");
    assert!(
        after_resume < 1.0,
        "directives {after_resume:.3} s old after a resumed"
    );
    let failures = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("grl_aggregator_standby_failures_total "))
            .map(|v| v.trim().parse::<f64>().unwrap())
    };
    // The copies to a while it hung failed (counted); the forward that timed out too.
    let agg_metrics = metrics_of(ua.clone()).await;
    assert!(
        failures(&agg_metrics).is_some_and(|n| n >= 1.0),
        "{agg_metrics}"
    );
    stop.store(true, Ordering::Relaxed);
}

/// The database URL's forms: a password on the command line is refused (ps shows flags); from
/// GRL_DATABASE_URL_FILE it is used, never printed, and an unreachable database ends the start
/// after the connect timeout with a non-zero exit.
#[test]
fn database_url_password_stays_out_of_flags_and_logs() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("postgres://grl:hunter2@127.0.0.1:{}/grl", free_port());
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let out = Command::new(env!("CARGO_BIN_EXE_grl"))
            .args(["controller", "--listen", "127.0.0.1:0", "--state-dir"])
            .arg(dir.path().join("state"))
            .args(args)
            .env("GRL_TOKEN", TOKEN)
            .env("GRL_REPORT_TOKEN", REPORT_TOKEN)
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (out.status, String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (status, err) = run(&["--database-url", &url], &[]);
    assert!(!status.success());
    assert!(err.contains("GRL_DATABASE_URL_FILE"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");

    let file = dir.path().join("database-url");
    std::fs::write(&file, format!("{url}\n")).unwrap();
    let t = std::time::Instant::now();
    let (status, err) = run(
        &["--database-connect-timeout-secs", "1"],
        &[("GRL_DATABASE_URL_FILE", file.to_str().unwrap())],
    );
    assert!(!status.success());
    assert!(err.contains("refusing to start: state database"), "{err}");
    assert!(err.contains("grl:***@127.0.0.1"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    // A hang guard, not a speed assertion: the start gives up instead of waiting forever.
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}
