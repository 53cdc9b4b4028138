//! `rlc.yaml`: the daemon's deployment-side configuration ([`DaemonConfig`]) and its sections.

use super::*;

/// `rlc.yaml`: the daemon's deployment-side configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// Where RPS history comes from.
    pub history: HistoryConfig,
    /// The git config repository.
    pub config_repo: ConfigRepoConfig,
    /// The GRL controller to push to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<ControllerConfig>,
    /// Several GRL controllers, one per region (each with `region:`), instead of
    /// `controller:`: every one gets the base branch's config, and `rollout.stages` of
    /// `rlc/policies.yaml` names their regions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub controllers: Vec<ControllerConfig>,
    /// `sqlite://rlc.db` or `postgres://…`.
    #[serde(default = "default_database_url")]
    pub database_url: String,
    /// Cron expression (5 fields, UTC) for scheduled runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// Safety rails applied after every policy.
    #[serde(default)]
    pub rails: RailsConfig,
    /// Plugin loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugins: Option<PluginsConfig>,
    /// The daemon's HTTP API (`rlc serve`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerConfig>,
    /// How long the store keeps shadow reports (`rlc serve` applies it periodically), and how
    /// long `rlc serve` waits for the store.
    #[serde(default)]
    pub store: StoreConfig,
}

/// Retention of the controller reports in the store, and how long `rlc serve` waits for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// Reports kept at full resolution (one row per controller tick and scope key); 48h default.
    #[serde(default = "default_shadow_raw_retention")]
    pub shadow_raw_retention: HumanDuration,
    /// Per-minute roll-ups (per service, bucket and scope key) that the dashboard and the
    /// readiness figures read; 35d default. Must not be shorter than `shadow_raw_retention`.
    #[serde(default = "default_shadow_rollup_retention")]
    pub shadow_rollup_retention: HumanDuration,
    /// Finished rollouts (done, superseded, and aborted ones the base branch no longer holds)
    /// are kept this long after their last change, with their candidate counts, then deleted;
    /// an aborted change deleted so is no longer held back from proposals (it would be tried
    /// as a candidate again). Open rollouts are never deleted; 90d default.
    #[serde(default = "default_rollout_retention")]
    pub rollout_retention: HumanDuration,
    /// Longest wait for one store query of a dashboard request (`GET /`, `/buckets/...`,
    /// `/v1/shadow...`, `/v1/runs`): a part not loaded in time is named on the page (HTTP
    /// 503) instead of the page hanging on a store that is down or slow; 5s default.
    #[serde(default = "default_store_query_timeout")]
    pub query_timeout: HumanDuration,
    /// Longest wait for one store write of the report poll (a batch of up to 20,000
    /// reports, an hourly roll-up pass, a retention pass): the reports stay buffered and are
    /// written at a later poll; 30s default.
    #[serde(default = "default_store_write_timeout")]
    pub write_timeout: HumanDuration,
    /// Directory where a run writes its record before the store (relative to rlc.yaml's
    /// directory): a record the store could not take (down, locked, full), or of a run killed
    /// between its git write and its record, stays there and is written to the store at the
    /// next run or poll; `rlc-journal` by default.
    #[serde(default = "default_journal_dir")]
    pub journal_dir: String,
}

fn default_journal_dir() -> String {
    "rlc-journal".into()
}

impl Default for StoreConfig {
    fn default() -> StoreConfig {
        StoreConfig {
            shadow_raw_retention: default_shadow_raw_retention(),
            shadow_rollup_retention: default_shadow_rollup_retention(),
            rollout_retention: default_rollout_retention(),
            query_timeout: default_store_query_timeout(),
            write_timeout: default_store_write_timeout(),
            journal_dir: default_journal_dir(),
        }
    }
}

fn default_shadow_raw_retention() -> HumanDuration {
    HumanDuration(Duration::from_secs(48 * 3600))
}
fn default_shadow_rollup_retention() -> HumanDuration {
    HumanDuration(Duration::from_secs(35 * 86_400))
}
fn default_rollout_retention() -> HumanDuration {
    HumanDuration(Duration::from_secs(90 * 86_400))
}
fn default_store_query_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(5))
}
fn default_store_write_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(30))
}

fn default_database_url() -> String {
    "sqlite://rlc.db".into()
}

/// History source: a Prometheus-compatible API or a file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HistoryConfig {
    /// A Prometheus-compatible HTTP API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prometheus: Option<PrometheusConfig>,
    /// A saved `query_range` JSON response or a CSV file (`ts,service,caller,procedure,rps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// How far back to look (28d default).
    #[serde(default = "default_lookback")]
    pub lookback: HumanDuration,
    /// Resolution of the rate (1m default).
    #[serde(default = "default_step")]
    pub step: HumanDuration,
    /// Below this fraction of expected samples a service keeps its current quotas.
    #[serde(default = "default_min_coverage")]
    pub min_coverage: f64,
    /// `rlc serve` keeps the pulled history and pulls only the minutes since its last pull
    /// (plus a 10-minute overlap for late samples); it pulls the whole lookback again at most
    /// this long after the last full pull (1d default), and always after a start or a change
    /// of the history settings.
    #[serde(default = "default_full_pull_every")]
    pub full_pull_every: HumanDuration,
}

fn default_lookback() -> HumanDuration {
    HumanDuration(Duration::from_secs(28 * 86_400))
}
fn default_step() -> HumanDuration {
    HumanDuration(Duration::from_secs(60))
}
fn default_min_coverage() -> f64 {
    0.5
}
fn default_full_pull_every() -> HumanDuration {
    HumanDuration(Duration::from_secs(86_400))
}

/// Prometheus query settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PrometheusConfig {
    /// Base URL, e.g. `http://127.0.0.1:9090`.
    pub url: String,
    /// PromQL giving one RPS series per (service, caller, procedure). Default: GRL's own
    /// counts of every request, `sum by (service, caller, procedure)
    /// (rate(grl_calls_total[1m]))`; a mesh's metrics work too (with `labels`), e.g.
    /// `sum by (destination_service_name, source_workload, request_operation)
    /// (rate(istio_requests_total[1m]))`.
    #[serde(default = "default_query")]
    pub query: String,
    /// Label names in the result.
    #[serde(default)]
    pub labels: LabelNames,
    /// Maximum points per series in one request (11,000 for Prometheus).
    #[serde(default = "default_max_points")]
    pub max_points: u32,
    /// Concurrent requests at most.
    #[serde(default = "default_concurrency")]
    pub concurrency: u32,
    /// Per-request timeout. Over remote read, whose answer grows with the fleet, it is the
    /// longest wait for the next byte; `max_request_duration` bounds the request in all.
    #[serde(default = "default_timeout")]
    pub timeout: HumanDuration,
    /// How long one remote-read request may take in all, its streamed answer included: a
    /// server that keeps sending a few bytes at a time is cut there (and the request
    /// retried, up to `retries` attempts), so that a pull always ends.
    #[serde(default = "default_max_request_duration")]
    pub max_request_duration: HumanDuration,
    /// Attempts per request (with jittered backoff).
    #[serde(default = "default_retries")]
    pub retries: u32,
    /// Let Prometheus reduce the series server-side: `max_over_time((query)[D:step])` at step
    /// `D` keeps the per-step peak in lookback ÷ D points (e.g. `1h`: 672 points for 28 days).
    /// Much less data to move for large fleets; percentiles and backtests then work on these
    /// per-D maxima.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downsample: Option<HumanDuration>,
    /// Directory for the temporary file that `rlc run` and `rlc preview` write the pulled
    /// series to as they stream in, so that the plan is computed one service at a time instead
    /// of holding the fleet's series in memory (lookback ÷ step × 4 bytes per series, e.g.
    /// 1.6 GB for 10,000 series × 28 days at 1 m). Relative to rlc.yaml's directory; the
    /// system's temporary directory (`$TMPDIR`) by default. The file is removed after the
    /// plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spill_dir: Option<String>,
    /// Which API the series are read with. `auto` (default): Prometheus' remote-read API
    /// (`/api/v1/read`, raw samples as compressed chunks: several times fewer bytes and far
    /// less decoding than JSON) when `query` is a plain selector (a metric name with optional
    /// label matchers, e.g. a recording rule's series) and `downsample` is not set, else
    /// `query_range`; a server without remote read (VictoriaMetrics), or whose lookback delta,
    /// version or external labels cannot be read, gets `query_range`. `query_range` and
    /// `remote_read` force one API.
    #[serde(default)]
    pub api: HistoryApi,
    /// Bytes one answer may carry at most (after the HTTP headers; error answers are cut at
    /// 64 KiB anyway). An answer that sends more fails the pull at once, not retried. The
    /// default, 2 GiB, is about 9 times a `query_range` answer of 10,000 series × 720 points
    /// (about 33 bytes a point: 240 MB) and above the largest answer Prometheus gives with its
    /// default `--query.max-samples` (50 million points: 1.65 GB).
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: u64,
    /// Bytes a whole pull may read at most, every answer and retry counted. The default,
    /// 32 GiB, is about 2.4 times a per-minute `query_range` pull of 10,000 series × 28 days
    /// (403 million points at about 33 bytes: 13.3 GB; remote read moves about a fifth of it).
    #[serde(default = "default_max_pull_bytes")]
    pub max_pull_bytes: u64,
    /// Distinct series a pull may hold at most (series rejected for their labels included):
    /// each one costs memory for its labels and index (and, in `rlc serve`, its grid:
    /// lookback ÷ step × 4 bytes). A pull with more fails at once.
    #[serde(default = "default_max_series")]
    pub max_series: u64,
}

/// How `history.prometheus` reads the series.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum HistoryApi {
    /// Remote read when the query is a plain selector and the server supports it, else
    /// `query_range`.
    #[default]
    Auto,
    /// PromQL over `/api/v1/query_range` (JSON).
    QueryRange,
    /// Prometheus' remote-read API; the query must be a plain selector.
    RemoteRead,
}

/// The default `history.prometheus.query`: the controller's `grl_calls_total`, every request
/// by (service, caller, procedure), matched by a bucket or not.
pub const DEFAULT_PROMETHEUS_QUERY: &str =
    "sum by (service, caller, procedure) (rate(grl_calls_total[1m]))";

fn default_query() -> String {
    DEFAULT_PROMETHEUS_QUERY.into()
}

fn default_max_points() -> u32 {
    11_000
}
fn default_concurrency() -> u32 {
    4
}
fn default_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(60))
}
fn default_max_request_duration() -> HumanDuration {
    HumanDuration(Duration::from_secs(600))
}
fn default_retries() -> u32 {
    3
}
/// See [`PrometheusConfig::max_response_bytes`].
pub const DEFAULT_MAX_RESPONSE_BYTES: u64 = 2 << 30;
/// See [`PrometheusConfig::max_pull_bytes`].
pub const DEFAULT_MAX_PULL_BYTES: u64 = 32 << 30;
/// See [`PrometheusConfig::max_series`].
pub const DEFAULT_MAX_SERIES: u64 = 200_000;
fn default_max_response_bytes() -> u64 {
    DEFAULT_MAX_RESPONSE_BYTES
}
fn default_max_pull_bytes() -> u64 {
    DEFAULT_MAX_PULL_BYTES
}
fn default_max_series() -> u64 {
    DEFAULT_MAX_SERIES
}

/// Names of the labels carrying service, caller and procedure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LabelNames {
    /// Callee service label.
    #[serde(default = "l_service")]
    pub service: String,
    /// Caller label.
    #[serde(default = "l_caller")]
    pub caller: String,
    /// Procedure label.
    #[serde(default = "l_procedure")]
    pub procedure: String,
}

fn l_service() -> String {
    "service".into()
}
fn l_caller() -> String {
    "caller".into()
}
fn l_procedure() -> String {
    "procedure".into()
}

impl Default for LabelNames {
    fn default() -> Self {
        Self {
            service: l_service(),
            caller: l_caller(),
            procedure: l_procedure(),
        }
    }
}

/// Commit mode of the writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema, Default)]
#[serde(rename_all = "kebab-case")]
pub enum RepoMode {
    /// Commit on the base branch and push.
    #[default]
    Direct,
    /// Update a stable branch and open or update a pull request.
    PullRequest,
}

/// The git config repository.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConfigRepoConfig {
    /// Local working copy.
    pub path: String,
    /// Remote to clone from and push to, when the working copy has none yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Base branch.
    #[serde(default = "default_branch")]
    pub branch: String,
    /// direct | pull-request.
    #[serde(default)]
    pub mode: RepoMode,
    /// Branch used in pull-request mode.
    #[serde(default = "default_pr_branch")]
    pub pr_branch: String,
    /// Commit author name.
    #[serde(default = "default_author_name")]
    pub author_name: String,
    /// Commit author e-mail.
    #[serde(default = "default_author_email")]
    pub author_email: String,
    /// Environment variable holding an https token (never written to logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_env: Option<String>,
    /// The forge API for pull requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forge: Option<ForgeConfig>,
    /// How long a connection to the remote may take to open, and how long it may stay
    /// silent while fetching or pushing: past it the git operation fails (a run fails with
    /// exit 1, nothing written) instead of hanging on a remote that never answers.
    #[serde(default = "default_git_timeout")]
    pub timeout: HumanDuration,
}

fn default_git_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(30))
}

fn default_branch() -> String {
    "main".into()
}
fn default_pr_branch() -> String {
    "rlc/quotas".into()
}
fn default_author_name() -> String {
    "rlc".into()
}
fn default_author_email() -> String {
    "rlc@localhost".into()
}

/// The forge that hosts pull (merge) requests: GitHub, GitLab, or none (branch only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForgeConfig {
    /// `github` (default), `gitlab` or `none`.
    #[serde(default = "default_forge_kind")]
    pub kind: String,
    /// API base URL: `https://api.github.com` (default for github),
    /// `https://gitlab.com/api/v4` (default for gitlab).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_url: Option<String>,
    /// `owner/name` (github) or the project's full path `group/subgroup/name` (gitlab).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<String>,
    /// Environment variable holding the API token (default `GITHUB_TOKEN` or `GITLAB_TOKEN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_env: Option<String>,
    /// Labels put on the pull request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    /// Reviewers asked on the pull request: user names (GitLab also takes numeric user ids).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reviewers: Vec<String>,
    /// Base URL of the rlc dashboard (`rlc serve`), e.g. `https://rlc.example.com`: pull
    /// requests link each bucket to `<dashboard_url>/buckets/<service>/<bucket>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dashboard_url: Option<String>,
    /// Web base URL of the forge, e.g. `https://github.com` or `https://gitlab.example.com`:
    /// the dashboard links a commit to `<web_url>/<repo>/commit/<sha>` (github) or
    /// `<web_url>/<repo>/-/commit/<sha>` (gitlab). Default: from `api_url`
    /// (`https://api.github.com` gives `https://github.com`; a trailing `/api/v3`, `/api/v4`,
    /// `/api/v1` or `/api` is removed). Not used with kind `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web_url: Option<String>,
}

fn default_forge_kind() -> String {
    "github".into()
}

/// The GRL controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ControllerConfig {
    /// Base URL, e.g. `http://127.0.0.1:7070`.
    pub url: String,
    /// The region this controller serves (needed in `controllers:`; `default` when absent
    /// under `controller:`): what `rollout.stages` names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Environment variable holding the credential with the controller's `config` role
    /// (`PUT /v1/config`); `<VAR>_FILE`, when `<VAR>` is unset, names a file holding it.
    #[serde(default = "default_controller_token_env")]
    pub token_env: String,
    /// A file holding that credential (its first line), relative to rlc.yaml and re-read on
    /// every call; when set, it is used instead of `token_env` (what `rlc demo` writes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
    /// Environment variable holding the credential with the `reports` role
    /// (`GET /v1/reports`); default: the `token_env` credential.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reports_token_env: Option<String>,
    /// How rlc verifies the controller (an `https://` url) and identifies itself to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ClientTlsConfig>,
}

/// TLS of a client: the CA that server certificates must chain to, and an optional client
/// certificate for servers that require mutual TLS. Paths are relative to rlc.yaml.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientTlsConfig {
    /// CA certificates (PEM). When set, only they are trusted (not the public roots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
    /// Client certificate chain (PEM), for mutual TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<String>,
    /// The client certificate's private key (PEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<String>,
}

/// TLS of a server: certificate and key (re-read when the files change), and optionally the
/// CA whose client certificates are required (mutual TLS). Paths are relative to rlc.yaml.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerTlsConfig {
    /// Certificate chain (PEM, leaf first).
    pub cert: String,
    /// Private key (PEM).
    pub key: String,
    /// Require client certificates signed by this CA (PEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<String>,
}

fn default_controller_token_env() -> String {
    "GRL_TOKEN".into()
}

/// Safety rails applied after every policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RailsConfig {
    /// Changes smaller than this fraction are skipped.
    #[serde(default = "default_min_change")]
    pub min_change: f64,
    /// A decrease is capped at this fraction of the current limit per run.
    #[serde(default = "default_max_decrease")]
    pub max_decrease: f64,
    /// An increase is capped at this fraction of the current limit per run (1.0: at most
    /// double), so that no bad sample or storm can lift a quota further than that in one
    /// run. Contracts are not capped.
    #[serde(default = "default_max_increase")]
    pub max_increase: f64,
    /// No limit goes below this.
    #[serde(default = "default_floor")]
    pub floor_rps: f64,
    /// New buckets start in shadow mode.
    #[serde(default = "default_true")]
    pub new_buckets_shadow: bool,
    /// At most one decrease per bucket within this interval (runs can be frequent: every
    /// change of `rlc/*.yaml` triggers one). `1s` turns the guard off.
    #[serde(default = "default_decrease_interval")]
    pub decrease_interval: HumanDuration,
}

fn default_decrease_interval() -> HumanDuration {
    HumanDuration(Duration::from_secs(86_400))
}

fn default_min_change() -> f64 {
    0.10
}
fn default_max_decrease() -> f64 {
    0.25
}
fn default_max_increase() -> f64 {
    1.0
}
fn default_floor() -> f64 {
    1.0
}
fn default_true() -> bool {
    true
}

impl Default for RailsConfig {
    fn default() -> Self {
        Self {
            min_change: default_min_change(),
            max_decrease: default_max_decrease(),
            max_increase: default_max_increase(),
            floor_rps: default_floor(),
            new_buckets_shadow: true,
            decrease_interval: default_decrease_interval(),
        }
    }
}

/// Plugin loading.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginsConfig {
    /// The only directory plugins are loaded from.
    pub dir: String,
    /// How long one call of a plugin (and its start) may take before its host process is
    /// killed and the bucket skipped.
    #[serde(default = "default_plugin_timeout")]
    pub timeout: HumanDuration,
    /// Address-space limit (`RLIMIT_AS`) of a plugin's host process, in MiB.
    #[serde(default = "default_plugin_memory_limit_mb")]
    pub memory_limit_mb: u64,
    /// How many times a plugin's host process is restarted after it died or was killed,
    /// within 10 minutes; beyond that the plugin's buckets fail at once until the window frees.
    #[serde(default = "default_plugin_max_restarts")]
    pub max_restarts: u32,
    /// The host program that loads plugins (the `rlc` binary or `rlc-plugin-host`); relative
    /// to rlc.yaml's directory. Default: `RLC_PLUGIN_HOST`, else the running `rlc` binary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

fn default_plugin_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(10))
}
fn default_plugin_memory_limit_mb() -> u64 {
    1024
}
fn default_plugin_max_restarts() -> u32 {
    3
}

/// The daemon's HTTP API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Listen address, e.g. `127.0.0.1:8080`.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Environment variable holding the write token: mutating endpoints (`POST /v1/runs`)
    /// need `Authorization: Bearer <write token>`; without it they are refused.
    #[serde(default = "default_server_token_env")]
    pub token_env: String,
    /// Environment variable holding the read token. When it is set (and the variable is not
    /// empty), the read endpoints (`GET /`, `GET /v1/...`) need `Authorization: Bearer <read
    /// or write token>`; when absent they are open. `/healthz`, `/readyz`, `/metrics` and
    /// `/openapi.json` stay open either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_token_env: Option<String>,
    /// Serve HTTPS (plain HTTP when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<ServerTlsConfig>,
}

fn default_listen() -> String {
    "127.0.0.1:8080".into()
}
fn default_server_token_env() -> String {
    "RLC_TOKEN".into()
}
