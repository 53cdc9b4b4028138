//! Property tests of the wire protocol decoders and the handlers behind them: arbitrary bytes
//! and arbitrary (often absurd) well-formed messages never panic, never take long, and never
//! get a 5xx; every message type survives an encode/decode round trip.

use std::time::{Duration, Instant};

use grl_control::aggregator::{Aggregator, AggregatorOptions};
use grl_control::controller::{Controller, ControllerOptions};
use grl_control::overrides::OverrideRequest;
use grl_wire::{
    BucketCountsMsg, CallCountMsg, ClientDirectives, ClientReport, ConfigDoc, DirectiveMsg,
    ReplySession, ReportSession, ServiceCallCountMsg, ServiceDirectives, ZoneBucketMsg,
    ZoneDirectives, ZoneReport,
};
use proptest::prelude::*;
use schema::{Bucket, BucketFile, Mode, PolicyName, Scope};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A hang guard per decode, not a speed assertion.
const DECODE_BOUND: Duration = Duration::from_secs(2);

fn decode_all(bytes: &[u8]) {
    fn one<T: DeserializeOwned>(bytes: &[u8]) {
        let t = Instant::now();
        let _ = serde_json::from_slice::<T>(bytes);
        assert!(t.elapsed() < DECODE_BOUND, "decode took {:?}", t.elapsed());
    }
    one::<ConfigDoc>(bytes);
    one::<ClientReport>(bytes);
    one::<ClientDirectives>(bytes);
    one::<ZoneReport>(bytes);
    one::<ZoneDirectives>(bytes);
    one::<OverrideRequest>(bytes);
    one::<grl_control::overrides::Override>(bytes);
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "payments",
            "gw.charge",
            "gw",
            "charge",
            "",
            " ",
            "a\"b\\c\n"
        ])
        .prop_map(String::from),
        "[a-z.:_-]{0,10}",
        any::<String>(),
    ]
}

/// Finite floats (JSON has no NaN or infinity) with the edges that break arithmetic.
fn float() -> impl Strategy<Value = f64> {
    prop_oneof![
        prop::sample::select(vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            1e308,
            -1e308,
            f64::MIN_POSITIVE,
            5e-324
        ]),
        (-1_000_000i64..1_000_000).prop_map(|x| x as f64 / 8.0),
        any::<f64>().prop_filter("finite", |f| f.is_finite()),
    ]
}

fn count() -> impl Strategy<Value = u64> {
    prop_oneof![
        prop::sample::select(vec![0, 1, u64::MAX, u64::MAX / 2 + 1]),
        0u64..10_000,
        any::<u64>(),
    ]
}

fn counts() -> impl Strategy<Value = BucketCountsMsg> {
    (name(), count(), count(), count(), count()).prop_map(|(bucket, o, a, d, s)| BucketCountsMsg {
        bucket,
        offered: o,
        admitted: a,
        dropped: d,
        shadow_dropped: s,
        tiers: Vec::new(),
    })
}

fn client_report() -> impl Strategy<Value = ClientReport> {
    (
        name(),
        name(),
        name(),
        count(),
        prop::collection::vec(counts(), 0..5),
        any::<bool>(),
        prop::collection::vec(call(), 0..4),
    )
        .prop_map(
            |(client_id, service, version, interval_ms, buckets, urgent, calls)| ClientReport {
                client_id,
                service,
                version,
                interval_ms,
                buckets,
                urgent,
                calls,
            },
        )
}

fn call() -> impl Strategy<Value = CallCountMsg> {
    (name(), name(), count()).prop_map(|(caller, procedure, count)| CallCountMsg {
        caller,
        procedure,
        count,
    })
}

fn zone_report() -> impl Strategy<Value = ZoneReport> {
    let bucket = (
        name(),
        name(),
        float(),
        float(),
        float(),
        float(),
        counts(),
        (any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(service, bucket, o, a, d, s, counts, (gone, counts_only))| ZoneBucketMsg {
                service,
                bucket,
                offered_rps: o,
                admitted_rps: a,
                dropped_rps: d,
                shadow_dropped_rps: s,
                counts,
                gone,
                counts_only,
                tier_offered_rps: None,
            },
        );
    let call = (name(), call()).prop_map(|(service, c)| ServiceCallCountMsg {
        service,
        caller: c.caller,
        procedure: c.procedure,
        count: c.count,
    });
    (
        name(),
        name(),
        name(),
        prop::collection::vec(bucket, 0..5),
        prop::collection::vec(call, 0..4),
        prop::option::of(count()),
        prop::option::of((
            any::<u32>(),
            count(),
            prop::option::of(count()),
            prop::option::of((any::<u32>(), count())),
        )),
    )
        .prop_map(
            |(aggregator_id, region, zone, buckets, calls, calls_ms, session)| ZoneReport {
                aggregator_id,
                region,
                zone,
                buckets,
                calls,
                calls_ms,
                session: session.map(|(id, seq, base, d)| ReportSession {
                    id: id as u64,
                    seq,
                    base,
                    directives: d.map(|(e, v)| (e as u64, v)),
                }),
            },
        )
}

fn bucket() -> impl Strategy<Value = Bucket> {
    (
        name(),
        prop::option::of(name()),
        prop::option::of(name()),
        prop::sample::select(vec![Scope::Global, Scope::Region, Scope::Zone]),
        float(),
        prop::sample::select(vec![Mode::Enforce, Mode::Shadow]),
        prop::sample::select(vec![
            PolicyName::Peak,
            PolicyName::Forecast,
            PolicyName::Fixed,
            PolicyName::Manual,
            PolicyName::Plugin("x".into()),
        ]),
    )
        .prop_map(
            |(name, caller, procedure, scope, limit_rps, mode, policy)| Bucket {
                name,
                caller,
                procedure,
                scope,
                limit_rps,
                mode,
                policy,
            },
        )
}

fn config_doc() -> impl Strategy<Value = ConfigDoc> {
    let file = (name(), prop::collection::vec(bucket(), 0..4))
        .prop_map(|(service, buckets)| BucketFile::new(service, buckets));
    (name(), prop::collection::vec(file, 0..3)).prop_map(|(version, services)| ConfigDoc {
        version,
        services,
        candidates: Vec::new(),
    })
}

fn override_request(ttl: BoxedStrategy<u64>) -> impl Strategy<Value = OverrideRequest> {
    (
        (
            prop::option::of(name()),
            prop::option::of(name()),
            prop::option::of(name()),
            prop::option::of(name()),
        ),
        prop::option::of(float()),
        prop::option::of(float()),
        ttl,
        name(),
        name(),
    )
        .prop_map(
            |(
                (service, bucket, caller, procedure),
                limit_rps,
                drop_ratio,
                ttl_secs,
                reason,
                who,
            )| {
                OverrideRequest {
                    service,
                    bucket,
                    caller,
                    procedure,
                    limit_rps,
                    drop_ratio,
                    shed_below: None,
                    ttl_secs,
                    reason,
                    who,
                }
            },
        )
}

fn directive() -> impl Strategy<Value = DirectiveMsg> {
    (name(), float(), float(), float(), any::<bool>()).prop_map(|(bucket, ratio, f, l, fixed)| {
        DirectiveMsg {
            bucket,
            ratio,
            fleet_offered_rps: f,
            limit_rps: l,
            fixed,
            shed: None,
        }
    })
}

fn client_directives() -> impl Strategy<Value = ClientDirectives> {
    (
        name(),
        prop::option::of(count()),
        prop::collection::vec(directive(), 0..4),
    )
        .prop_map(|(version, age_ms, directives)| ClientDirectives {
            version,
            age_ms,
            directives,
        })
}

fn zone_directives() -> impl Strategy<Value = ZoneDirectives> {
    let svc =
        (name(), prop::collection::vec(directive(), 0..3)).prop_map(|(service, directives)| {
            ServiceDirectives {
                service,
                directives,
            }
        });
    let session = (
        prop::option::of(count()),
        any::<bool>(),
        any::<u32>(),
        count(),
        any::<bool>(),
    )
        .prop_map(|(applied, resync, epoch, version, delta)| ReplySession {
            applied,
            resync,
            epoch: epoch as u64,
            version,
            delta,
        });
    (
        name(),
        prop::collection::vec(svc, 0..3),
        prop::option::of(session),
    )
        .prop_map(|(version, services, session)| ZoneDirectives {
            version,
            services,
            session,
        })
}

/// Equal, except that floats may differ in the last bit: serde_json's default float parser
/// is not correctly rounded for every 17-digit input (its `float_roundtrip` feature is).
fn same(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value::*;
    match (a, b) {
        (Number(x), Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            // At most two units in the last place apart (same sign: bit patterns are ordered).
            x == y || (x.signum() == y.signum() && x.to_bits().abs_diff(y.to_bits()) <= 2)
        }
        (Array(x), Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y)),
        (Object(x), Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

fn round_trip<T: Serialize + DeserializeOwned + std::fmt::Debug>(v: &T) {
    let bytes = serde_json::to_vec(v).unwrap();
    let back: T = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&bytes)));
    let (a, b) = (
        serde_json::to_value(v).unwrap(),
        serde_json::to_value(&back).unwrap(),
    );
    assert!(same(&a, &b), "{v:?} came back as {back:?}");
}

/// Bytes that look like JSON: a valid message with a cut, a flipped byte or an insertion.
fn mangled(valid: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let n = valid.len().max(1);
    (0..n, any::<u8>(), 0u8..3).prop_map(move |(at, b, how)| {
        let mut v = valid.clone();
        match how {
            0 => v.truncate(at),
            1 if at < v.len() => v[at] = b,
            _ => v.insert(at.min(v.len()), b),
        }
        v
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn decoders_never_panic_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        decode_all(&bytes);
    }

    #[test]
    fn decoders_never_panic_on_mangled_messages(
        bytes in zone_report().prop_flat_map(|r| mangled(serde_json::to_vec(&r).unwrap()))
    ) {
        decode_all(&bytes);
    }

    #[test]
    fn every_wire_message_round_trips(
        c in config_doc(),
        r in client_report(),
        z in zone_report(),
        o in override_request(any::<u64>().boxed()),
        cd in client_directives(),
        zd in zone_directives(),
    ) {
        round_trip(&c);
        round_trip(&r);
        round_trip(&z);
        round_trip(&o);
        round_trip(&cd);
        round_trip(&zd);
    }
}

#[test]
fn deep_nesting_is_refused_quickly() {
    for open in ["[", "{\"version\":", "{\"services\":["] {
        let body = open.repeat(400_000 / open.len());
        let t = Instant::now();
        decode_all(body.as_bytes());
        assert!(t.elapsed() < DECODE_BOUND, "{open}: {:?}", t.elapsed());
    }
}

/// A controller (no report token) and an aggregator in this process, on loopback.
struct Servers {
    rt: tokio::runtime::Runtime,
    controller: String,
    aggregator: String,
    http: reqwest::Client,
    _dir: tempfile::TempDir,
}

/// The controller's config and overrides credential.
const TOKEN: &str = "prop-token";
/// The zone-report credential (controller) that the aggregator forwards with.
const ZONE_TOKEN: &str = "prop-zone-report-token";
/// The client report credential the aggregator's credentials file grants for every service.
const CLIENT_TOKEN: &str = "prop-client-token-0123456789";

fn servers() -> &'static Servers {
    static S: std::sync::OnceLock<Servers> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (controller, aggregator) = rt.block_on(async {
            let c = Controller::start(ControllerOptions {
                state_dir: dir.path().join("state"),
                token: TOKEN.into(),
                report_token: Some(ZONE_TOKEN.into()),
                tick: Duration::from_millis(50),
                ..Default::default()
            })
            .await
            .unwrap();
            let curl = c.url();
            let creds = dir.path().join("client-credentials");
            std::fs::write(&creds, format!("props * {CLIENT_TOKEN}\n")).unwrap();
            let a = Aggregator::start(AggregatorOptions {
                controllers: vec![curl.clone()],
                zone: "z1".into(),
                region: "r1".into(),
                tick: Duration::from_millis(50),
                report_token: Some(ZONE_TOKEN.into()),
                client_credentials: Some(creds),
                ..Default::default()
            })
            .await
            .unwrap();
            let aurl = a.url();
            // Serve for the life of the test binary.
            std::mem::forget(c);
            std::mem::forget(a);
            (curl, aurl)
        });
        Servers {
            rt,
            controller,
            aggregator,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap(),
            _dir: dir,
        }
    })
}

/// Sends `body` with the credential its endpoint takes (so that the body is read, not refused
/// from the headers); the answer must come, and must not be a 5xx.
fn send(method: reqwest::Method, url: String, body: Vec<u8>) {
    let s = servers();
    let token = if url.ends_with("/v1/report") {
        CLIENT_TOKEN
    } else if url.ends_with("/v1/aggregate") {
        ZONE_TOKEN
    } else {
        TOKEN
    };
    let status = s.rt.block_on(async {
        s.http
            .request(method, &url)
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .map(|r| r.status())
    });
    let status = status.unwrap_or_else(|e| panic!("{url}: no answer ({e}): the handler died"));
    assert!(!status.is_server_error(), "{url}: answered {status}");
}

fn still_serving() {
    let s = servers();
    for url in [
        format!("{}/v1/status", s.controller),
        format!("{}/metrics", s.controller),
        format!("{}/v1/config", s.aggregator),
    ] {
        let st =
            s.rt.block_on(async { s.http.get(&url).send().await.map(|r| r.status()) })
                .unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(st, 200, "{url}");
    }
}

/// A config the controller accepts, so that reports and overrides meet real buckets.
fn install_config() {
    let s = servers();
    let doc = serde_json::json!({"version": "prop-v1", "services": [{"service": "payments", "buckets": [
        {"name": "gw.charge", "caller": "gw", "procedure": "charge", "scope": "global", "limit_rps": 100.0},
        {"name": "gw", "caller": "gw", "scope": "zone", "limit_rps": 50.0}]}]});
    let st = s.rt.block_on(async {
        s.http
            .put(format!("{}/v1/config", s.controller))
            .bearer_auth(TOKEN)
            .json(&doc)
            .send()
            .await
            .unwrap()
            .status()
    });
    assert!(st.is_success(), "{st}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn aggregator_answers_any_client_report_without_5xx(
        r in client_report(),
        raw in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        install_config();
        let s = servers();
        send(reqwest::Method::POST, format!("{}/v1/report", s.aggregator), serde_json::to_vec(&r).unwrap());
        send(reqwest::Method::POST, format!("{}/v1/report", s.aggregator), raw);
        still_serving();
    }

    #[test]
    fn controller_answers_any_zone_report_without_5xx(
        mut z in zone_report(),
        known in any::<bool>(),
    ) {
        install_config();
        if known {
            // Reports on real buckets reach the engine's arithmetic.
            for b in &mut z.buckets {
                b.service = "payments".into();
                b.bucket = "gw.charge".into();
                for r in [&mut b.offered_rps, &mut b.admitted_rps, &mut b.dropped_rps, &mut b.shadow_dropped_rps] {
                    *r = r.abs();
                }
            }
            z.zone = "z1".into();
            z.region = "r1".into();
        }
        let s = servers();
        send(reqwest::Method::POST, format!("{}/v1/aggregate", s.controller), serde_json::to_vec(&z).unwrap());
        // Twice: the second adds to the totals of the first.
        send(reqwest::Method::POST, format!("{}/v1/aggregate", s.controller), serde_json::to_vec(&z).unwrap());
        still_serving();
    }

    #[test]
    fn controller_answers_any_config_push_and_override_without_5xx(
        c in config_doc(),
        // TTLs up to ten years: the bound on longer ones is the TTL limit of the override API.
        o in override_request((1u64..315_360_000).boxed()),
        raw in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        let s = servers();
        send(reqwest::Method::PUT, format!("{}/v1/config", s.controller), serde_json::to_vec(&c).unwrap());
        send(reqwest::Method::PUT, format!("{}/v1/config", s.controller), raw.clone());
        install_config();
        send(reqwest::Method::POST, format!("{}/v1/overrides", s.controller), serde_json::to_vec(&o).unwrap());
        send(reqwest::Method::POST, format!("{}/v1/overrides", s.controller), raw);
        still_serving();
    }
}
