//! The deployment artefacts of `deploy/`: the container image (built from scratch out of the
//! prebuilt binaries, its files run, and started under podman where the machine allows it),
//! the systemd units (`systemd-analyze verify` against the built binaries), the Kubernetes
//! manifests (validated offline by `kubernetes-validate`, pinned, from PyPI) and the compose
//! stack (structure: every command's flags exist, ports match the listen addresses, mounted
//! files exist, scrape targets and URLs name services). The commands are the README's
//! "Deploy" section.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_yaml::Value;
use test_support::process::{free_port, Proc};

use super::{bin, get_text, wait_until};

/// The pinned kubernetes-validate (its schemas ship in the package: it validates offline).
const KUBERNETES_VALIDATE: &str = "1.37.0";
/// The Kubernetes version the manifests are validated against.
const KUBERNETES: &str = "1.30.0";

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// The long flags `<binary> <subcommand> --help` lists.
fn help_flags(binary: &str, sub: &str) -> BTreeSet<String> {
    let out = Command::new(bin(binary))
        .args([sub, "--help"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{binary} {sub} --help");
    String::from_utf8(out.stdout)
        .unwrap()
        .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == '<')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.trim_end_matches(['=', ']', '.']).to_string())
        .collect()
}

/// Checks a command line of `binary` (`args[0]` the subcommand): every `--flag` exists.
fn check_flags(what: &str, binary: &str, args: &[String]) {
    let sub = &args[0];
    let known = help_flags(binary, sub);
    assert!(!known.is_empty(), "{binary} {sub}");
    for a in args.iter().filter(|a| a.starts_with("--")) {
        let flag = a.split('=').next().unwrap();
        assert!(
            known.contains(flag),
            "{what}: `{binary} {sub}` has no flag {flag} (it has {known:?})"
        );
    }
}

/// The value after `flag` in `args`.
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .map(|i| args[i + 1].as_str())
}

fn port_of(listen: &str) -> u16 {
    listen.rsplit(':').next().unwrap().parse().unwrap()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| {
            s.iter()
                .map(|x| match x {
                    Value::String(s) => s.clone(),
                    other => serde_yaml::to_string(other).unwrap().trim().to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A rlc.yaml text, parsed by the daemon's own loader (unknown keys are errors).
fn check_rlc_yaml(what: &str, text: &str) -> schema::DaemonConfig {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("rlc.yaml");
    std::fs::write(&p, text).unwrap();
    schema::load_daemon_config(&p).unwrap_or_else(|e| panic!("{what}: {e:?}"))
}

// ------------------------------------------------------------------------------------------
// systemd

/// The ExecStart command line of a unit.
fn exec_start(unit: &str) -> Vec<String> {
    unit.lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

fn verify(dir: &Path) -> (bool, String) {
    let units: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let out = Command::new("/usr/bin/systemd-analyze")
        .args(["verify", "--man=no"])
        .args(&units)
        .output()
        .expect("systemd-analyze (Debian package systemd)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// `systemd-analyze verify` on copies of the units whose ExecStart runs the built binaries
/// (verify needs them to exist); the flags of every ExecStart exist; a unit naming a missing
/// binary, or with an unknown key, is caught (the check can fail).
#[test]
fn systemd_units_pass_systemd_analyze_verify() {
    let dir = tempfile::tempdir().unwrap();
    let mut n = 0;
    for e in std::fs::read_dir(deploy().join("systemd")).unwrap() {
        let p = e.unwrap().path();
        let text = std::fs::read_to_string(&p).unwrap();
        let cmd = exec_start(&text);
        let binary = Path::new(&cmd[0]).file_name().unwrap().to_str().unwrap();
        assert_eq!(
            cmd[0],
            format!("/usr/local/bin/{binary}"),
            "{}",
            p.display()
        );
        check_flags(&p.display().to_string(), binary, &cmd[1..]);
        let local = text
            .replace("/usr/local/bin/grl", bin("grl").to_str().unwrap())
            .replace("/usr/local/bin/rlc", bin("rlc").to_str().unwrap());
        std::fs::write(dir.path().join(p.file_name().unwrap()), local).unwrap();
        n += 1;
    }
    assert_eq!(n, 4, "controller, aggregator, sidecar and rlc units");
    let (ok, out) = verify(dir.path());
    assert!(ok, "{out}");
    // Warnings (an unknown key, a bad specifier) name the unit file: none.
    assert!(!out.contains(".service:"), "{out}");

    let bad = tempfile::tempdir().unwrap();
    let unit = std::fs::read_to_string(deploy().join("systemd/grl-controller.service")).unwrap();
    std::fs::write(
        bad.path().join("grl-controller.service"),
        unit.replace("/usr/local/bin/grl", "/nonexistent/grl"),
    )
    .unwrap();
    let (ok, out) = verify(bad.path());
    assert!(!ok && out.contains("/nonexistent/grl"), "{out}");
    std::fs::write(
        bad.path().join("grl-controller.service"),
        unit.replace("/usr/local/bin/grl", bin("grl").to_str().unwrap())
            .replace("KillSignal=", "KilSignal="),
    )
    .unwrap();
    let (_, out) = verify(bad.path());
    assert!(out.contains("Unknown key"), "{out}");
}

// ------------------------------------------------------------------------------------------
// Kubernetes

fn manifests() -> Vec<(PathBuf, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy().join("kubernetes"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    let mut docs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for d in serde_yaml::Deserializer::from_str(&text) {
            let v = Value::deserialize(d).unwrap();
            if !v.is_null() {
                docs.push((f.clone(), v));
            }
        }
    }
    docs
}

use serde::Deserialize;

/// The manifests pass `kubernetes-validate --strict` offline (no network namespace when
/// `unshare` can make one), and hang together: every container's flags exist, probes use
/// `/healthz` and `/readyz`, Services and the ServiceMonitor select what exists, the
/// NetworkPolicy opens the aggregator's port, the rlc.yaml in the ConfigMap loads.
#[test]
fn kubernetes_manifests_validate_offline_and_hang_together() {
    let tool = test_support::venv::tool(
        "kubernetes-validate",
        KUBERNETES_VALIDATE,
        "kubernetes-validate",
    )
    .unwrap();
    let files: BTreeSet<PathBuf> = manifests().into_iter().map(|(f, _)| f).collect();
    let offline = Command::new("unshare")
        .args(["-n", "true"])
        .status()
        .is_ok_and(|s| s.success());
    let mut cmd = if offline {
        let mut c = Command::new("unshare");
        c.arg("-n").arg(&tool);
        c
    } else {
        Command::new(&tool)
    };
    let out = cmd
        .args(["--strict", "-k", KUBERNETES])
        .args(&files)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let docs = manifests();
    let crds = docs
        .iter()
        .filter(|(_, d)| d["kind"] == "ServiceMonitor")
        .count();
    assert_eq!(crds, 1);
    assert_eq!(
        text.matches(" passed for resource ").count(),
        docs.len() - crds,
        "every built-in resource validated:\n{text}"
    );

    let kinds = |k: &str| -> Vec<&Value> {
        docs.iter()
            .filter(|(_, d)| d["kind"] == k)
            .map(|(_, d)| d)
            .collect()
    };
    let mut ports: BTreeMap<String, u16> = BTreeMap::new();
    let mut pod_labels = Vec::new();
    let workloads = || {
        kinds("Deployment")
            .into_iter()
            .chain(kinds("DaemonSet"))
            .chain(kinds("StatefulSet"))
    };
    for w in workloads() {
        let name = w["metadata"]["name"].as_str().unwrap().to_string();
        let spec = &w["spec"]["template"]["spec"];
        let labels = &w["spec"]["template"]["metadata"]["labels"];
        for (k, v) in w["spec"]["selector"]["matchLabels"].as_mapping().unwrap() {
            assert_eq!(&labels[k], v, "{name}: selector does not match its pods");
        }
        pod_labels.push(labels.clone());
        for c in spec["containers"].as_sequence().unwrap() {
            let args = strings(&c["args"]);
            let binary = match strings(&c["command"]).first() {
                Some(c) => Path::new(c)
                    .file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string(),
                None => "grl".into(),
            };
            check_flags(&name, &binary, &args);
            let listen = flag_value(&args, "--listen").map(port_of).unwrap_or(8080);
            let cport = c["ports"][0]["containerPort"].as_u64().unwrap() as u16;
            assert_eq!(
                listen, cport,
                "{name}: listens on {listen}, exposes {cport}"
            );
            assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz", "{name}");
            assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz", "{name}");
            ports.insert(
                labels["app.kubernetes.io/name"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                cport,
            );
            // Mounted Secrets and ConfigMaps exist.
            for v in spec["volumes"].as_sequence().unwrap() {
                if let Some(s) = v["secret"]["secretName"].as_str() {
                    assert!(
                        kinds("Secret").iter().any(|d| d["metadata"]["name"] == s),
                        "{name}: no Secret {s}"
                    );
                }
                if let Some(s) = v["configMap"]["name"].as_str() {
                    assert!(
                        kinds("ConfigMap")
                            .iter()
                            .any(|d| d["metadata"]["name"] == s),
                        "{name}: no ConfigMap {s}"
                    );
                }
            }
        }
    }
    assert_eq!(ports["grl-controller"], 7070);
    assert_eq!(ports["grl-aggregator"], 7071);
    assert_eq!(ports["rlc"], 8080);
    let rlc = kinds("Deployment")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "rlc")
        .unwrap();
    assert!(
        rlc["spec"]["replicas"].as_u64().unwrap() >= 2,
        "rlc replicas"
    );
    let selects = |sel: &Value| {
        pod_labels
            .iter()
            .any(|l| sel.as_mapping().unwrap().iter().all(|(k, v)| &l[k] == v))
    };
    for s in kinds("Service") {
        assert!(
            selects(&s["spec"]["selector"]),
            "{:?}",
            s["metadata"]["name"]
        );
    }
    // The ServiceMonitor selects every Service but the replicas' headless one (it would
    // scrape the controllers twice), on a port name they all have.
    let sm = kinds("ServiceMonitor")[0];
    let port = &sm["spec"]["endpoints"][0]["port"];
    for s in kinds("Service")
        .into_iter()
        .filter(|s| s["spec"]["clusterIP"] != "None")
    {
        for (k, v) in sm["spec"]["selector"]["matchLabels"].as_mapping().unwrap() {
            assert_eq!(
                &s["metadata"]["labels"][k], v,
                "{:?}",
                s["metadata"]["name"]
            );
        }
        assert_eq!(&s["spec"]["ports"][0]["name"], port);
    }
    // Controller replicas: at least two on one database, named through a headless Service,
    // and every aggregator lists every one of them.
    let controller = kinds("StatefulSet")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "grl-controller")
        .expect("the controllers as a StatefulSet");
    let replicas = controller["spec"]["replicas"].as_u64().unwrap();
    assert!(replicas >= 2, "controller replicas: {replicas}");
    let headless = controller["spec"]["serviceName"].as_str().unwrap();
    let hs = kinds("Service")
        .into_iter()
        .find(|d| d["metadata"]["name"] == headless)
        .unwrap_or_else(|| panic!("no Service {headless}"));
    assert_eq!(hs["spec"]["clusterIP"], "None", "{headless} is headless");
    let pod = &controller["spec"]["template"]["spec"];
    let env = &pod["containers"][0]["env"];
    let url_file = env
        .as_sequence()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "GRL_DATABASE_URL_FILE")
        .expect("the replicas get the database from GRL_DATABASE_URL_FILE")["value"]
        .as_str()
        .unwrap();
    // The file is a key of a mounted Secret that exists and holds a postgres:// URL.
    let mount = pod["containers"][0]["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| {
            let dir = m["mountPath"].as_str().unwrap().trim_end_matches('/');
            url_file.starts_with(&format!("{dir}/"))
        })
        .unwrap_or_else(|| panic!("{url_file} is not on a mounted volume"));
    let key = url_file
        .strip_prefix(mount["mountPath"].as_str().unwrap())
        .unwrap()
        .trim_start_matches('/');
    let volume = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let secret_name = volume["secret"]["secretName"].as_str().unwrap();
    let secret = kinds("Secret")
        .into_iter()
        .find(|d| d["metadata"]["name"] == secret_name)
        .unwrap();
    assert!(
        secret["stringData"][key]
            .as_str()
            .is_some_and(|u| u.starts_with("postgres://")),
        "{secret_name}/{key}"
    );
    let names: BTreeSet<String> = (0..replicas)
        .map(|i| format!("http://grl-controller-{i}.{headless}.grl.svc:7070"))
        .collect();
    for a in kinds("DaemonSet") {
        let args = strings(&a["spec"]["template"]["spec"]["containers"][0]["args"]);
        let listed: BTreeSet<String> = args
            .windows(2)
            .filter(|w| w[0] == "--controller")
            .map(|w| w[1].clone())
            .collect();
        assert_eq!(listed, names, "{:?}", a["metadata"]["name"]);
    }
    // Clients reach the aggregators' port.
    let np = kinds("NetworkPolicy")
        .into_iter()
        .find(|d| {
            d["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "grl-aggregator"
        })
        .expect("a NetworkPolicy for the aggregators");
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], 7071);
    let cm = kinds("ConfigMap")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "rlc-config")
        .unwrap();
    let cfg = check_rlc_yaml("rlc-config", cm["data"]["rlc.yaml"].as_str().unwrap());
    assert!(
        cfg.database_url.starts_with("postgres://"),
        "replicas need Postgres"
    );
    assert_eq!(
        cfg.controller.unwrap().url,
        "http://grl-controller.grl.svc:7070"
    );
    // Every variable rlc.yaml names comes from the Secret.
    let secret = kinds("Secret")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "rlc")
        .unwrap();
    for var in ["RLC_TOKEN", "GRL_CONFIG_TOKEN", "PGPASSWORD", "GIT_TOKEN"] {
        assert!(secret["stringData"][var].is_string(), "{var}");
    }
}

/// The sidecar example (`deploy/kubernetes/sidecar/`) passes `kubernetes-validate --strict`
/// offline and hangs together: the sidecar's flags exist, the Service sends callers to the
/// sidecar's port (never the application's), the sidecar's upstream is the port the
/// application serves, its probes are on the admin listener, its credential file is a key of a
/// mounted Secret of the example.
#[test]
fn kubernetes_sidecar_example_validates_offline_and_hangs_together() {
    let tool = test_support::venv::tool(
        "kubernetes-validate",
        KUBERNETES_VALIDATE,
        "kubernetes-validate",
    )
    .unwrap();
    let file = deploy().join("kubernetes/sidecar/payments.yaml");
    let offline = Command::new("unshare")
        .args(["-n", "true"])
        .status()
        .is_ok_and(|s| s.success());
    let mut cmd = if offline {
        let mut c = Command::new("unshare");
        c.arg("-n").arg(&tool);
        c
    } else {
        Command::new(&tool)
    };
    let out = cmd
        .args(["--strict", "-k", KUBERNETES])
        .arg(&file)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let docs: Vec<Value> =
        serde_yaml::Deserializer::from_str(&std::fs::read_to_string(&file).unwrap())
            .map(|d| Value::deserialize(d).unwrap())
            .filter(|v| !v.is_null())
            .collect();
    assert_eq!(
        text.matches(" passed for resource ").count(),
        docs.len(),
        "{text}"
    );
    let kind = |k: &str| docs.iter().find(|d| d["kind"] == k).unwrap();
    let (deploy_, service, secret) = (kind("Deployment"), kind("Service"), kind("Secret"));
    let pod = &deploy_["spec"]["template"]["spec"];
    let labels = &deploy_["spec"]["template"]["metadata"]["labels"];
    for (k, v) in service["spec"]["selector"].as_mapping().unwrap() {
        assert_eq!(&labels[k], v, "the Service selects the pods");
    }
    let containers = pod["containers"].as_sequence().unwrap();
    let sidecar = containers
        .iter()
        .find(|c| strings(&c["args"]).first().map(String::as_str) == Some("sidecar"))
        .expect("a grl sidecar container");
    let app = containers
        .iter()
        .find(|c| *c != sidecar)
        .expect("an application container");
    let args = strings(&sidecar["args"]);
    check_flags("sidecar example", "grl", &args);
    let port_named = |c: &Value, name: &str| -> u64 {
        c["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no port {name}"))["containerPort"]
            .as_u64()
            .unwrap()
    };
    let listen = port_of(flag_value(&args, "--listen").unwrap()) as u64;
    let admin = port_of(flag_value(&args, "--admin-listen").unwrap()) as u64;
    assert_eq!(port_named(sidecar, "http"), listen);
    assert_eq!(port_named(sidecar, "admin"), admin);
    // Callers reach the sidecar's port.
    let target = &service["spec"]["ports"][0]["targetPort"];
    let target = target
        .as_u64()
        .unwrap_or_else(|| port_named(sidecar, target.as_str().unwrap()));
    assert_eq!(target, listen);
    // Probes on the admin listener.
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        assert_eq!(sidecar[probe]["httpGet"]["path"], path);
        assert_eq!(sidecar[probe]["httpGet"]["port"], "admin");
    }
    // The upstream is the application's port, on the pod's loopback.
    let upstream = flag_value(&args, "--upstream").unwrap();
    let up_port = port_of(upstream);
    assert!(upstream.starts_with("http://127.0.0.1:"), "{upstream}");
    let app_cmd = strings(&app["command"]);
    assert!(
        app_cmd.contains(&up_port.to_string()),
        "{app_cmd:?} does not serve {up_port}"
    );
    assert!(
        app["ports"].is_null(),
        "the application's port is not exposed"
    );
    // The client credential file is a key of the example's Secret, mounted.
    let env = sidecar["env"].as_sequence().unwrap();
    let file_ = env
        .iter()
        .find(|e| e["name"] == "GRL_CLIENT_TOKEN_FILE")
        .unwrap()["value"]
        .as_str()
        .unwrap();
    let mount = sidecar["volumeMounts"][0]["mountPath"].as_str().unwrap();
    let key = file_
        .strip_prefix(&format!("{mount}/"))
        .expect("the token file is mounted");
    let vol = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == sidecar["volumeMounts"][0]["name"])
        .unwrap();
    assert_eq!(vol["secret"]["secretName"], secret["metadata"]["name"]);
    assert!(secret["stringData"][key].is_string(), "Secret key {key}");
    // It reports to the aggregators' Service (30-aggregator.yaml).
    let agg = flag_value(&args, "--aggregator").unwrap();
    let agg_service = manifests()
        .into_iter()
        .map(|(_, d)| d)
        .find(|d| d["kind"] == "Service" && d["metadata"]["name"] == "grl-aggregator")
        .unwrap();
    assert_eq!(
        agg,
        format!(
            "http://grl-aggregator.{}.svc:{}",
            agg_service["metadata"]["namespace"].as_str().unwrap(),
            agg_service["spec"]["ports"][0]["port"].as_u64().unwrap()
        )
    );
}

// ------------------------------------------------------------------------------------------
// compose

/// The compose stack hangs together: the project's services run flags their binaries have
/// and publish the ports they listen on, every mounted file and secret exists (the secrets
/// as `deploy/compose/secrets.sh` writes them), dependencies and scrape targets name
/// services, rlc.yaml loads and points at them, Grafana gets the dashboards directory.
#[test]
fn compose_stack_hangs_together() {
    let dir = deploy().join("compose");
    let doc: Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("compose.yaml")).unwrap()).unwrap();
    let services = doc["services"].as_mapping().unwrap();
    let names: BTreeSet<&str> = services.keys().map(|k| k.as_str().unwrap()).collect();
    for want in [
        "postgres",
        "prometheus",
        "controller",
        "aggregator",
        "rlc",
        "grafana",
    ] {
        assert!(names.contains(want), "no service {want}");
    }
    // The secrets as the README makes them.
    let work = tempfile::tempdir().unwrap();
    for f in ["secrets.sh", "compose.yaml"] {
        std::fs::copy(dir.join(f), work.path().join(f)).unwrap();
    }
    let ok = Command::new("sh")
        .arg(work.path().join("secrets.sh"))
        .arg(bin("grl"))
        .status()
        .unwrap()
        .success();
    assert!(ok, "secrets.sh");
    let declared: BTreeSet<&str> = doc["secrets"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let file = v["file"].as_str().unwrap();
            assert!(work.path().join(file).is_file(), "secret file {file}");
            k.as_str().unwrap()
        })
        .collect();
    // The controller credentials hold every role rlc, on-call and the zones need.
    let creds =
        std::fs::read_to_string(work.path().join("secrets/controller-credentials")).unwrap();
    assert_eq!(creds.lines().count(), 3, "{creds}");

    let mut listens: BTreeMap<String, u16> = BTreeMap::new();
    for (name, s) in services {
        let name = name.as_str().unwrap();
        let image = s["image"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: no image"));
        for sec in strings(&s["secrets"]) {
            assert!(declared.contains(sec.as_str()), "{name}: secret {sec}");
        }
        for f in strings(&s["env_file"]) {
            assert!(work.path().join(&f).is_file(), "{name}: env_file {f}");
        }
        for d in strings(&s["depends_on"]) {
            assert!(names.contains(d.as_str()), "{name}: depends on {d}");
        }
        for v in strings(&s["volumes"]) {
            let host = v.split(':').next().unwrap();
            if host.starts_with('.') {
                assert!(dir.join(host).exists(), "{name}: mounts {host}, missing");
            } else {
                assert!(
                    doc["volumes"][host].is_mapping(),
                    "{name}: volume {host} not declared"
                );
            }
        }
        if image.starts_with("localhost/grl-rlc") {
            let binary = match strings(&s["entrypoint"]).first() {
                Some(e) => Path::new(e)
                    .file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string(),
                None => "grl".into(),
            };
            let args = strings(&s["command"]);
            check_flags(name, &binary, &args);
            let port = match flag_value(&args, "--listen") {
                Some(l) => port_of(l),
                // rlc serve listens where rlc.yaml says.
                None => port_of(
                    &check_rlc_yaml(
                        "compose rlc.yaml",
                        &std::fs::read_to_string(dir.join("rlc.yaml")).unwrap(),
                    )
                    .server
                    .unwrap()
                    .listen,
                ),
            };
            let published = strings(&s["ports"]);
            assert!(
                published.iter().any(|p| p.ends_with(&format!(":{port}"))),
                "{name}: listens on {port}, publishes {published:?}"
            );
            listens.insert(name.to_string(), port);
        }
    }
    listens.insert("prometheus".into(), 9090);
    listens.insert("postgres".into(), 5432);
    // Scrape targets are services on the ports they listen on.
    let prom: Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("prometheus.yml")).unwrap())
            .unwrap();
    let mut targets = BTreeSet::new();
    for job in prom["scrape_configs"].as_sequence().unwrap() {
        for t in strings(&job["static_configs"][0]["targets"]) {
            let (host, port) = t.split_once(':').unwrap();
            assert_eq!(
                listens.get(host),
                Some(&port.parse().unwrap()),
                "target {t}"
            );
            targets.insert(host.to_string());
        }
    }
    assert_eq!(
        targets,
        ["aggregator", "controller", "controller-2", "rlc"]
            .map(String::from)
            .into()
    );
    // Both controller replicas share one database, and the aggregator lists both.
    for c in ["controller", "controller-2"] {
        let s = &doc["services"][c];
        assert_eq!(
            s["environment"]["GRL_DATABASE_URL_FILE"], "/run/secrets/controller-database-url",
            "{c}"
        );
        assert!(strings(&s["secrets"]).contains(&"controller-database-url".to_string()));
    }
    let url = std::fs::read_to_string(work.path().join("secrets/controller-database-url")).unwrap();
    let pg = std::fs::read_to_string(work.path().join("secrets/pg-password")).unwrap();
    assert_eq!(url.trim(), format!("postgres://rlc:{pg}@postgres:5432/rlc"));
    let agg = strings(&doc["services"]["aggregator"]["command"]);
    let listed: Vec<&String> = agg
        .windows(2)
        .filter(|w| w[0] == "--controller")
        .map(|w| &w[1])
        .collect();
    assert_eq!(
        listed,
        [
            format!("http://controller:{}", listens["controller"]),
            format!("http://controller-2:{}", listens["controller-2"])
        ]
        .iter()
        .collect::<Vec<_>>()
    );
    assert_eq!(
        strings(&prom["rule_files"]),
        ["/etc/prometheus/rules.yml"],
        "the rules mounted from deploy/prometheus"
    );
    // rlc.yaml points at the stack's services.
    let cfg = check_rlc_yaml(
        "compose rlc.yaml",
        &std::fs::read_to_string(dir.join("rlc.yaml")).unwrap(),
    );
    let host_port = |url: &str| {
        let rest = url.split_once("://").unwrap().1;
        let hp = rest.split(['/', '?']).next().unwrap();
        let hp = hp.rsplit('@').next().unwrap();
        let (h, p) = hp.split_once(':').unwrap();
        (h.to_string(), p.parse::<u16>().unwrap())
    };
    for url in [
        cfg.controller.as_ref().unwrap().url.clone(),
        cfg.history.prometheus.as_ref().unwrap().url.clone(),
        cfg.database_url.clone(),
    ] {
        let (h, p) = host_port(&url);
        assert_eq!(listens.get(&h), Some(&p), "{url}");
    }
    // The sidecar sends to a service of the stack, reports to the aggregator's port, and its
    // client token is the secret of the aggregator's `payments` credential.
    let sc = strings(&doc["services"]["payments-sidecar"]["command"]);
    let (up_host, up_port) = host_port(flag_value(&sc, "--upstream").unwrap());
    let app = strings(&doc["services"][up_host.as_str()]["command"]);
    assert!(
        app.contains(&up_port.to_string()),
        "{up_host} does not serve {up_port}: {app:?}"
    );
    let (agg_host, agg_port) = host_port(flag_value(&sc, "--aggregator").unwrap());
    assert_eq!(listens.get(&agg_host), Some(&agg_port));
    let client_line =
        std::fs::read_to_string(work.path().join("secrets/client-credentials")).unwrap();
    let token = std::fs::read_to_string(work.path().join("secrets/payments-client-token")).unwrap();
    assert_eq!(
        client_line.split_whitespace().nth(2),
        Some(token.trim()),
        "the sidecar's token is the payments secret"
    );
    assert_eq!(
        flag_value(&sc, "--service"),
        client_line.split_whitespace().nth(1)
    );

    // Grafana: the provider reads the directory deploy/grafana is mounted on.
    let provider: Value = serde_yaml::from_str(
        &std::fs::read_to_string(dir.join("grafana/dashboards.yaml")).unwrap(),
    )
    .unwrap();
    let path = provider["providers"][0]["options"]["path"]
        .as_str()
        .unwrap();
    let mounts = strings(&doc["services"]["grafana"]["volumes"]);
    assert!(
        mounts
            .iter()
            .any(|m| m.starts_with("../grafana:") && m.contains(path)),
        "{mounts:?}"
    );
    let ds: Value = serde_yaml::from_str(
        &std::fs::read_to_string(dir.join("grafana/datasources.yaml")).unwrap(),
    )
    .unwrap();
    assert_eq!(ds["datasources"][0]["url"], "http://prometheus:9090");
}

// ------------------------------------------------------------------------------------------
// the container image

fn podman() -> Option<PathBuf> {
    ["/usr/bin/podman", "/usr/local/bin/podman"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// Builds the image from deploy/Containerfile with the prebuilt binaries (deploy/rootfs.sh,
/// `--build-arg BINARIES=context`: no base image is pulled); returns its tag.
fn build_image(podman: &Path, ctx: &Path, tag: &str) {
    let ok = Command::new("sh")
        .arg(deploy().join("rootfs.sh"))
        .arg(ctx.join("rootfs"))
        .arg(bin("grl"))
        .arg(bin("rlc"))
        .status()
        .unwrap()
        .success();
    assert!(ok, "rootfs.sh");
    std::fs::copy(deploy().join("Containerfile"), ctx.join("Containerfile")).unwrap();
    // One build at a time, so that the images a build leaves are known to be its own.
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let before = image_ids(podman);
    let out = Command::new(podman)
        .args(["build", "--build-arg", "BINARIES=context", "-t", tag])
        .arg(ctx)
        .output()
        .unwrap();
    // The build's stage images (the `context` stage holds the ~400 MB rootfs) are not part of
    // the tagged image: remove them, or every run leaves one dangling image behind.
    // (`--layers=false` would not keep them, but podman 4.3 then fails on this Containerfile's
    // `FROM ${BINARIES} AS binaries`, a stage with the same image as the one before.)
    let tagged = image_id(podman, tag);
    let stages: Vec<String> = image_ids(podman)
        .difference(&before)
        .filter(|id| Some(*id) != tagged.as_ref())
        .cloned()
        .collect();
    if !stages.is_empty() {
        let _ = Command::new(podman)
            .arg("rmi")
            .args(&stages)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    assert!(
        out.status.success(),
        "podman build: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every image's full id (`podman images -a`), without the `sha256:` prefix.
fn image_ids(podman: &Path) -> BTreeSet<String> {
    let out = Command::new(podman)
        .args(["images", "-a", "-q", "--no-trunc"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().trim_start_matches("sha256:").to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

/// The full id of image `tag`, if it exists.
fn image_id(podman: &Path, tag: &str) -> Option<String> {
    let out = Command::new(podman)
        .args(["image", "inspect", "--format", "{{.Id}}", tag])
        .output()
        .ok()?;
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !id.is_empty()).then(|| id.trim_start_matches("sha256:").to_string())
}

fn remove_image(podman: &Path, tag: &str) {
    let _ = Command::new(podman)
        .args(["rmi", "-f", tag])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn is_root() -> bool {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() == 0 }
}

/// The image holds the two binaries, their shared libraries, the CA certificates and the
/// passwd/group files, nothing else; and its files run: the exported filesystem starts a
/// controller under chroot that answers `/readyz` and exits 0 on SIGTERM.
#[test]
fn container_image_from_scratch_holds_the_binaries_and_runs() {
    const TEST: &str =
        "deploy::artefacts::container_image_from_scratch_holds_the_binaries_and_runs";
    let Some(podman) = podman() else {
        test_support::skip(
            TEST,
            "podman is not installed (Debian package podman; cargo xtask test installs it as root)",
        );
        return;
    };
    if !is_root() {
        test_support::skip(
            TEST,
            "building an image with podman and chroot need root here",
        );
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let tag = format!("localhost/grl-rlc:test-files-{}", std::process::id());
    build_image(&podman, work.path(), &tag);
    let id = Command::new(&podman)
        .args(["create", &tag])
        .output()
        .unwrap();
    assert!(
        id.status.success(),
        "{}",
        String::from_utf8_lossy(&id.stderr)
    );
    let id = String::from_utf8(id.stdout).unwrap().trim().to_string();
    let root = work.path().join("exported");
    std::fs::create_dir(&root).unwrap();
    let export = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{} export {id} | tar -x -C {}",
            podman.display(),
            root.display()
        ))
        .status()
        .unwrap();
    let _ = Command::new(&podman).args(["rm", "-f", &id]).output();
    let config = Command::new(&podman)
        .args(["image", "inspect", "--format", "{{json .Config}}", &tag])
        .output()
        .unwrap();
    remove_image(&podman, &tag);
    assert!(export.success());
    let config: serde_json::Value = serde_json::from_slice(&config.stdout).unwrap();
    assert_eq!(config["Entrypoint"][0], "/usr/local/bin/grl", "{config}");
    assert_eq!(config["User"], "65532:65532", "{config}");

    let mut files = BTreeSet::new();
    let mut stack = vec![root.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.insert(p.strip_prefix(&root).unwrap().display().to_string());
            }
        }
    }
    let mut want: BTreeSet<String> = [
        "usr/local/bin/grl",
        "usr/local/bin/rlc",
        "etc/passwd",
        "etc/group",
        "etc/ssl/certs/ca-certificates.crt",
    ]
    .map(String::from)
    .into();
    for b in ["grl", "rlc"] {
        let out = Command::new("ldd").arg(bin(b)).output().unwrap();
        for l in String::from_utf8(out.stdout).unwrap().lines() {
            let path = l
                .split_once("=> ")
                .map_or(l.trim(), |(_, r)| r)
                .split(' ')
                .next()
                .unwrap();
            if path.starts_with('/') {
                want.insert(path.trim_start_matches('/').to_string());
            }
        }
    }
    assert_eq!(
        files, want,
        "the image holds exactly the binaries and their libraries"
    );

    // The image's own files run (no library missing): a controller under chroot.
    let port = free_port();
    let mut ctl = Proc::spawn(
        Command::new("chroot")
            .arg(&root)
            .args([
                "/usr/local/bin/grl",
                "controller",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--state-dir",
                "/tmp/state",
            ])
            .env("GRL_REPORT_TOKEN", "image-zone-token")
            .env("GRL_CONFIG_TOKEN", "image-config-token")
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .unwrap();
    wait_until(Duration::from_secs(30), || {
        get_text(port, "/readyz").is_some_and(|t| t.contains("\"ready\":true"))
    });
    ctl.signal(libc::SIGTERM);
    let st = ctl
        .wait_exit(Duration::from_secs(30))
        .expect("exit after SIGTERM");
    assert_eq!(st.code(), Some(0));
    let out = Command::new("chroot")
        .arg(&root)
        .args(["/usr/local/bin/rlc", "--version"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("rlc "));
}

/// The image started as a container: a controller that answers `/readyz`, stopped with
/// `podman stop` (SIGTERM), exit code 0. Skipped, saying why, where podman cannot start
/// containers (no cgroup or rlimit rights inside another container, for example).
#[test]
fn container_image_starts_under_podman() {
    const TEST: &str = "deploy::artefacts::container_image_starts_under_podman";
    let Some(podman) = podman() else {
        test_support::skip(TEST, "podman is not installed (Debian package podman)");
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let tag = format!("localhost/grl-rlc:test-run-{}", std::process::id());
    build_image(&podman, work.path(), &tag);
    let port = free_port();
    let name = format!("grl-test-{}", std::process::id());
    let out = Command::new(&podman)
        .args(["run", "-d", "--name", &name, "--network", "host"])
        .args(["--tmpfs", "/var/lib/grl:rw,mode=1777"])
        .args(["-e", "GRL_REPORT_TOKEN=image-zone-token"])
        .args(["-e", "GRL_CONFIG_TOKEN=image-config-token", &tag])
        .args([
            "controller",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--state-dir",
            "/var/lib/grl/state",
        ])
        .output()
        .unwrap();
    if !out.status.success() {
        let _ = Command::new(&podman).args(["rm", "-f", &name]).output();
        remove_image(&podman, &tag);
        let why = String::from_utf8_lossy(&out.stderr).trim().to_string();
        test_support::skip(
            TEST,
            &format!("podman built the image but cannot start containers here: {why}"),
        );
        return;
    }
    let ready = (0..300).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        get_text(port, "/readyz").is_some_and(|t| t.contains("\"ready\":true"))
    });
    let stop = Command::new(&podman)
        .args(["stop", "-t", "20", &name])
        .output()
        .unwrap();
    let code = Command::new(&podman)
        .args(["inspect", "--format", "{{.State.ExitCode}}", &name])
        .output()
        .unwrap();
    let logs = Command::new(&podman)
        .args(["logs", &name])
        .output()
        .unwrap();
    let _ = Command::new(&podman).args(["rm", "-f", &name]).output();
    remove_image(&podman, &tag);
    let logs = String::from_utf8_lossy(&logs.stderr).to_string();
    assert!(ready, "the container never turned ready:\n{logs}");
    assert!(stop.status.success());
    assert_eq!(String::from_utf8_lossy(&code.stdout).trim(), "0", "{logs}");
}
