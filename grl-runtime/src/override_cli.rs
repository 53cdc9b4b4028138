//! `grl override add|list|rm|history`: incident overrides on a controller, for on-call people.

use std::time::Duration;

use anyhow::bail;
use clap::Subcommand;
use grl_client::auth::TokenSource;
use grl_control::overrides::{describe_action, describe_target, OverrideRequest, MAX_TTL_SECS};
use schema::HumanDuration;
use serde_json::Value;

use super::{ClientTlsArgs, Remote};

const ADD_HELP: &str = "\
Credential: the override role's token, from GRL_OVERRIDE_TOKEN or GRL_OVERRIDE_TOKEN_FILE
(a file holding it, mode 600), else the legacy GRL_TOKEN / GRL_TOKEN_FILE.

Target either one bucket (--service and --bucket), or traffic as a whole (--caller and/or
--procedure, optionally within one --service): a traffic override limits all of it together,
fleet-wide, whether or not a bucket matched it before. With --shed-below, --service alone
targets every bucket of the service.

Action: exactly one of --limit-rps (the new limit), --drop-ratio (a fixed fraction to drop,
0 to 1) and --shed-below TIER (drop every request of a criticality tier below TIER: SHEDDABLE,
SHEDDABLE_PLUS, CRITICAL or CRITICAL_PLUS; the bucket's own limit still applies to the rest;
for one bucket or a whole service); they exclude each other.

--ttl is at most 7d (604800 s): a measure that should outlast a week belongs in the bucket files.
At most --max-overrides (1,000 by default) are active on a controller at once.

Examples:
  # Cap the checkout caller's traffic to payments at 200 requests/s for 30 minutes
  GRL_OVERRIDE_TOKEN_FILE=/etc/grl/override-token grl override add \\
      --controller https://grl-controller:7070 --service payments --caller checkout \\
      --limit-rps 200 --ttl 30m --reason INC-123

  # Drop half of one bucket's traffic for 2 hours
  grl override add --service payments --bucket api-gateway.charge --drop-ratio 0.5 \\
      --ttl 2h --reason 'INC-124: database failover' --who alice

  # Keep only CRITICAL and CRITICAL_PLUS requests to payments for 20 minutes
  grl override add --service payments --shed-below CRITICAL --ttl 20m --reason INC-125";

#[derive(Subcommand)]
pub(crate) enum OverrideCmd {
    /// Apply an override: a replacement limit, a fixed drop ratio or a criticality floor, for
    /// a bucket, a caller's/procedure's traffic or (the floor) a whole service, with a TTL (at
    /// most 7 days) and a reason.
    #[command(after_help = ADD_HELP)]
    Add {
        #[command(flatten)]
        remote: Remote,
        /// Callee service (required with --bucket; optional with --caller/--procedure).
        #[arg(long)]
        service: Option<String>,
        /// Bucket name (with --service; excludes --caller and --procedure).
        #[arg(long, conflicts_with_all = ["caller", "procedure"])]
        bucket: Option<String>,
        /// Target this caller's traffic.
        #[arg(long)]
        caller: Option<String>,
        /// Target this procedure's traffic.
        #[arg(long)]
        procedure: Option<String>,
        /// Replacement limit, requests/s (excludes --drop-ratio and --shed-below).
        #[arg(
            long,
            conflicts_with_all = ["drop_ratio", "shed_below"],
            required_unless_present_any = ["drop_ratio", "shed_below"]
        )]
        limit_rps: Option<f64>,
        /// Fixed fraction to drop, 0 to 1 (excludes --limit-rps and --shed-below).
        #[arg(long, conflicts_with = "shed_below")]
        drop_ratio: Option<f64>,
        /// Drop every request of a criticality tier below this one (SHEDDABLE_PLUS, CRITICAL
        /// or CRITICAL_PLUS); for one bucket or, with --service alone, a whole service.
        #[arg(long, conflicts_with_all = ["caller", "procedure"])]
        shed_below: Option<schema::Criticality>,
        /// Time to live, e.g. 30m, 2h; at most 7d.
        #[arg(long)]
        ttl: HumanDuration,
        /// Why: an incident or ticket reference (recorded in the audit log).
        #[arg(long)]
        reason: String,
        /// Who applies it, for the audit log (defaults to $USER; "unknown", with a warning,
        /// when that is unset).
        #[arg(long)]
        who: Option<String>,
        /// Output format: the override added as a table, or the controller's JSON.
        #[arg(long, default_value = "table", value_parser = ["table", "json"])]
        format: String,
    },
    /// List the overrides in force: a table (id, target, action, who, reason, created,
    /// expires in), or the controller's JSON with --format json.
    List {
        #[command(flatten)]
        remote: Remote,
        /// Output format.
        #[arg(long, default_value = "table", value_parser = ["table", "json"])]
        format: String,
    },
    /// Remove an override before its TTL ends (role `overrides`, as add).
    Rm {
        #[command(flatten)]
        remote: Remote,
        /// Override id (`grl override list` shows them).
        id: String,
        /// Who removes it, for the audit log (defaults to $USER; "unknown", with a warning,
        /// when that is unset).
        #[arg(long)]
        who: Option<String>,
        /// Why.
        #[arg(long, default_value = "")]
        reason: String,
        /// Output format: the override removed as a table, or the controller's JSON.
        #[arg(long, default_value = "table", value_parser = ["table", "json"])]
        format: String,
    },
    /// The audit log: overrides created, removed and expired (who, when, what, why), newest
    /// first; kept by the controller after the overrides are gone.
    History {
        #[command(flatten)]
        remote: Remote,
        /// How many events (newest first; at most 1,000).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Output format.
        #[arg(long, default_value = "table", value_parser = ["table", "json"])]
        format: String,
    },
}

/// The override credential: `GRL_OVERRIDE_TOKEN[_FILE]`, else the legacy `GRL_TOKEN[_FILE]`.
fn override_token() -> anyhow::Result<String> {
    for var in ["GRL_OVERRIDE_TOKEN", "GRL_TOKEN"] {
        if let Some(t) = TokenSource::from_env(var)? {
            return Ok(t.current().to_string());
        }
    }
    bail!("set the override credential in GRL_OVERRIDE_TOKEN or GRL_OVERRIDE_TOKEN_FILE (or the legacy GRL_TOKEN)")
}

/// `--who`, else $USER, else "unknown" with a warning (cron jobs and containers often run
/// without $USER; the override must still go through in an incident).
fn who_or_user(who: Option<String>) -> String {
    who.filter(|w| !w.trim().is_empty())
        .or_else(|| std::env::var("USER").ok().filter(|u| !u.trim().is_empty()))
        .unwrap_or_else(|| {
            eprintln!(
                "warning: --who not given and $USER unset: recording the author as \"unknown\""
            );
            "unknown".to_string()
        })
}

/// What to print of the controller's answer.
enum Output {
    Body,
    Table(fn(&Value, u64) -> String),
}

pub(crate) async fn run(mut cmd: OverrideCmd) -> anyhow::Result<()> {
    let (tls, timeout) = take_tls(&mut cmd);
    let http = tls.options()?.http_client(timeout)?;
    let (req, what, output) = request(cmd, &http)?;
    let body = answer(req, what, timeout).await?;
    match output {
        Output::Body => println!("{body}"),
        Output::Table(f) => {
            let v: Value = serde_json::from_str(&body)
                .map_err(|e| anyhow::anyhow!("{what}: the controller's answer is not JSON: {e}"))?;
            print!("{}", f(&v, unix_now()));
        }
    }
    Ok(())
}

/// The command's TLS options (taken out of it) and its timeout.
fn take_tls(cmd: &mut OverrideCmd) -> (ClientTlsArgs, Duration) {
    match cmd {
        OverrideCmd::Add { remote, .. }
        | OverrideCmd::List { remote, .. }
        | OverrideCmd::Rm { remote, .. }
        | OverrideCmd::History { remote, .. } => (
            std::mem::replace(
                &mut remote.tls,
                ClientTlsArgs {
                    tls_ca: None,
                    tls_client_cert: None,
                    tls_client_key: None,
                },
            ),
            Duration::from_secs(remote.timeout_secs.max(1)),
        ),
    }
}

/// The controller request of `cmd`, what it does (for errors) and what to print of the
/// answer; a request refused here (an invalid override, no credential) is an error.
fn request(
    cmd: OverrideCmd,
    http: &reqwest::Client,
) -> anyhow::Result<(reqwest::RequestBuilder, &'static str, Output)> {
    let table = |format: &str, f: fn(&Value, u64) -> String| {
        if format == "json" {
            Output::Body
        } else {
            Output::Table(f)
        }
    };
    Ok(match cmd {
        OverrideCmd::Add {
            remote,
            service,
            bucket,
            caller,
            procedure,
            limit_rps,
            drop_ratio,
            shed_below,
            ttl,
            reason,
            who,
            format,
        } => {
            let req = OverrideRequest {
                service,
                bucket,
                caller,
                procedure,
                limit_rps,
                drop_ratio,
                shed_below,
                ttl_secs: ttl.as_secs(),
                reason,
                who: who_or_user(who),
            };
            if req.ttl_secs > MAX_TTL_SECS {
                bail!("--ttl is at most 7d (604800 s); put a lasting change in the bucket files");
            }
            req.validate()?;
            let r = http
                .post(format!("{}/v1/overrides", remote.controller))
                .bearer_auth(override_token()?)
                .json(&req);
            (r, "add override", table(&format, added_table))
        }
        OverrideCmd::List { remote, format } => {
            let r = http.get(format!("{}/v1/overrides", remote.controller));
            (r, "list overrides", table(&format, list_table))
        }
        OverrideCmd::Rm {
            remote,
            id,
            who,
            reason,
            format,
        } => {
            let r = http
                .delete(format!("{}/v1/overrides/{id}", remote.controller))
                .query(&[("who", who_or_user(who)), ("reason", reason)])
                .bearer_auth(override_token()?);
            (r, "remove override", table(&format, removed_table))
        }
        OverrideCmd::History {
            remote,
            limit,
            format,
        } => {
            let r = http
                .get(format!("{}/v1/overrides/history", remote.controller))
                .query(&[("limit", limit.clamp(1, 1_000))]);
            (
                r,
                "read the overrides' history",
                table(&format, history_table),
            )
        }
    })
}

/// Sends `req` and returns the controller's answer (bounded); a refusal is an error with the
/// reason its body carries.
async fn answer(
    req: reqwest::RequestBuilder,
    what: &str,
    timeout: Duration,
) -> anyhow::Result<String> {
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => bail!(
            "{what}: cannot reach the controller: {}",
            grl_client::cause::describe(&e, timeout)
        ),
    };
    let status = resp.status();
    let body = match grl_client::http_util::call_response(resp, timeout, 64 << 20).await {
        Ok(b) => String::from_utf8_lossy(&b).into_owned(),
        Err(e) => bail!("{what}: {e}"),
    };
    if !status.is_success() {
        bail!("{what}: controller answered {status}: {}", body.trim());
    }
    Ok(body)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What an override targets ([`describe_target`]), and for a traffic override how many served
/// buckets it limits as a whole.
fn target(o: &Value) -> String {
    let s = |k: &str| o.get(k).and_then(Value::as_str);
    let mut t = describe_target(s("service"), s("bucket"), s("caller"), s("procedure"));
    if let Some(n) = o.get("affects").and_then(Value::as_array).map(Vec::len) {
        if s("bucket").is_none() {
            t.push_str(&format!(
                " (as a whole, over {n} bucket{})",
                if n == 1 { "" } else { "s" }
            ));
        }
    }
    t
}

/// What an override does ([`describe_action`]).
fn action(o: &Value) -> String {
    let f = |k: &str| o.get(k).and_then(Value::as_f64);
    let tier = o.get("shed_below").and_then(Value::as_str);
    describe_action(
        f("limit_rps"),
        f("drop_ratio"),
        tier.and_then(|t| t.parse().ok()),
    )
}

/// Unix seconds as `2026-12-01 19:20:05Z`.
fn time(v: Option<&Value>) -> String {
    v.and_then(Value::as_i64)
        .and_then(|t| chrono::DateTime::from_timestamp(t, 0))
        .map_or_else(
            || "?".into(),
            |t| t.format("%Y-%m-%d %H:%M:%SZ").to_string(),
        )
}

/// Seconds as `1d 2h`, `29m 10s`, `45s`.
fn span(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3_600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

/// Columns padded to their widest cell, two spaces apart.
fn render(head: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut w: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: Vec<String>| {
        let last = cells.len() - 1;
        for (i, c) in cells.into_iter().enumerate() {
            out.push_str(&c);
            if i < last {
                out.push_str(&" ".repeat(w[i] - c.chars().count() + 2));
            }
        }
        out.push('\n');
    };
    line(head.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r);
    }
    out
}

/// One line of text: control characters (a hostile reason's newlines) shown as spaces.
fn cell(v: Option<&Value>) -> String {
    v.and_then(Value::as_str)
        .unwrap_or("")
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

fn list_table(v: &Value, now: u64) -> String {
    let list = v.get("overrides").and_then(Value::as_array);
    let Some(list) = list.filter(|l| !l.is_empty()) else {
        return "no override in force\n".into();
    };
    let rows = list
        .iter()
        .map(|o| {
            let expires = o.get("expires_at").and_then(Value::as_u64).unwrap_or(0);
            vec![
                cell(o.get("id")),
                target(o),
                action(o),
                cell(o.get("who")),
                cell(o.get("reason")),
                time(o.get("created_at")),
                span(expires.saturating_sub(now)),
            ]
        })
        .collect();
    render(
        &[
            "ID",
            "TARGET",
            "ACTION",
            "WHO",
            "REASON",
            "CREATED",
            "EXPIRES IN",
        ],
        rows,
    )
}

/// The answer to `add`: the override added, as one row of the list's table.
fn added_table(v: &Value, now: u64) -> String {
    one_row("added", v, now)
}

/// The answer to `rm`: the override removed, as one row of the list's table.
fn removed_table(v: &Value, now: u64) -> String {
    one_row("removed", v, now)
}

fn one_row(what: &str, v: &Value, now: u64) -> String {
    let id = v.get("id").and_then(Value::as_str).unwrap_or("?");
    let table = list_table(&serde_json::json!({ "overrides": [v] }), now);
    format!("{what} {id}\n{table}")
}

fn history_table(v: &Value, _now: u64) -> String {
    let list = v.get("events").and_then(Value::as_array);
    let Some(list) = list.filter(|l| !l.is_empty()) else {
        return "no override event recorded\n".into();
    };
    let rows = list
        .iter()
        .map(|e| {
            let o = e.get("override").cloned().unwrap_or_default();
            vec![
                time(e.get("at")),
                cell(e.get("action")),
                cell(e.get("id")),
                cell(e.get("by")),
                target(&o),
                action(&o),
                cell(e.get("reason")),
            ]
        })
        .collect();
    render(
        &["AT", "EVENT", "ID", "BY", "TARGET", "ACTION", "REASON"],
        rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_list_is_a_table_with_the_target_action_and_time_left() {
        let v = json!({"overrides": [
            {"id": "ovr-1", "service": "payments", "bucket": "charge", "limit_rps": 50.0,
             "ttl_secs": 1800, "reason": "INC-1\nsecond line", "who": "alice",
             "created_at": 1_764_616_805u64, "expires_at": 1_764_618_605u64, "affects": []},
            {"id": "ovr-2", "caller": "checkout", "service": "payments", "drop_ratio": 0.25,
             "ttl_secs": 7200, "reason": "INC-2", "who": "bob",
             "created_at": 1_764_616_805u64, "expires_at": 1_764_624_005u64,
             "affects": [{"service": "payments", "bucket": "a", "created": false},
                         {"service": "payments", "bucket": "b", "created": false}]}
        ]});
        let t = list_table(&v, 1_764_616_805 + 60);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("ID  "), "{t}");
        assert!(lines[1].contains("bucket payments/charge") && lines[1].contains("limit 50 rps"));
        assert!(
            lines[1].contains("INC-1 second line"),
            "one line per override: {t}"
        );
        assert!(
            lines[1].contains("2025-12-01 19:20:05Z") && lines[1].ends_with("29m 0s"),
            "{t}"
        );
        assert!(lines[2]
            .contains("traffic caller=checkout service=payments (as a whole, over 2 buckets)"));
        assert!(
            lines[2].contains("drop 25%") && lines[2].ends_with("1h 59m"),
            "{t}"
        );
        assert_eq!(
            list_table(&json!({"overrides": []}), 0),
            "no override in force\n"
        );
    }

    #[test]
    fn add_and_rm_print_the_override_as_a_row() {
        let o = json!({"id": "ovr-7", "caller": "gw", "drop_ratio": 0.5, "ttl_secs": 600,
                       "reason": "INC-7", "who": "alice", "created_at": 1_000, "expires_at": 1_600});
        let added = added_table(&o, 1_000);
        assert!(added.starts_with("added ovr-7\n"), "{added}");
        let row = added.lines().nth(2).unwrap();
        for want in ["ovr-7", "caller=gw", "alice", "INC-7", "10m"] {
            assert!(row.contains(want), "{want} not in {row}");
        }
        assert!(removed_table(&o, 1_300).starts_with("removed ovr-7\n"));
    }

    #[test]
    fn the_history_names_each_event() {
        let v = json!({"events": [
            {"at": 1_764_618_605u64, "action": "expired", "id": "ovr-1", "by": "expiry",
             "reason": "INC-1", "override": {"service": "payments", "bucket": "charge",
             "limit_rps": 50.0}},
            {"at": 1_764_616_805u64, "action": "created", "id": "ovr-1", "by": "alice",
             "credential": "oncall", "reason": "INC-1", "override": {"service": "payments",
             "bucket": "charge", "limit_rps": 50.0}}
        ]});
        let t = history_table(&v, 0);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[1].contains("expired") && lines[1].contains("expiry"),
            "{t}"
        );
        assert!(
            lines[2].contains("created") && lines[2].contains("alice"),
            "{t}"
        );
        assert!(lines[2].contains("bucket payments/charge") && lines[2].contains("limit 50 rps"));
    }

    #[test]
    fn spans_read_as_people_say_them() {
        assert_eq!(span(45), "45s");
        assert_eq!(span(29 * 60 + 10), "29m 10s");
        assert_eq!(span(2 * 3600 + 5 * 60), "2h 5m");
        assert_eq!(span(6 * 86_400 + 3 * 3600), "6d 3h");
    }
}
