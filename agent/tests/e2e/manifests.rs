//! The Kubernetes manifests in `deploy/kubernetes/` checked against the agent's real flags and
//! the invariants the cross-pod handoff depends on.

use clap::CommandFactory;
use envoy_agent::cli::Cli;
use envoy_agent::duration::parse_duration;
use serde_yaml::Value;

fn repo() -> std::path::PathBuf {
    envoy_agent_tests::repo_root()
}

/// The long flags of `envoy-agent run`.
fn run_flags() -> Vec<String> {
    let cli = Cli::command();
    let run = cli.find_subcommand("run").expect("run subcommand");
    run.get_arguments()
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .chain(
            cli.get_arguments()
                .filter_map(|a| a.get_long().map(|l| format!("--{l}"))),
        )
        .collect()
}

/// `--name=value` or `--name value` from an argument list.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().enumerate().find_map(|(i, a)| {
        if let Some(v) = a.strip_prefix(&format!("{name}=")) {
            Some(v)
        } else if a == name {
            args.get(i + 1).map(String::as_str)
        } else {
            None
        }
    })
}

#[test]
fn daemonset_supports_the_cross_pod_handoff() {
    let path = repo().join("deploy/kubernetes/daemonset.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let ds: Value = serde_yaml::from_str(&text).unwrap();
    assert_eq!(ds["kind"], "DaemonSet");
    let spec = &ds["spec"];
    assert_eq!(spec["updateStrategy"]["rollingUpdate"]["maxSurge"], 1);
    assert_eq!(spec["updateStrategy"]["rollingUpdate"]["maxUnavailable"], 0);
    let pod = &spec["template"]["spec"];
    assert_eq!(
        pod["hostNetwork"], true,
        "the Envoys must share a network namespace"
    );

    let container = &pod["containers"][0];
    let args: Vec<String> = container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(args[0], "run");
    let known = run_flags();
    for arg in args.iter().filter(|a| a.starts_with("--")) {
        let name = arg.split('=').next().unwrap();
        assert!(
            known.iter().any(|k| k == name),
            "{name} is not a flag of envoy-agent run"
        );
    }
    assert!(args.iter().any(|a| a == "--hot-restart"));
    assert!(flag(&args, "--base-id").is_some(), "a fixed base id");

    // The grace period covers the old pod's wait for its Envoy to be terminated.
    let parent_shutdown = parse_duration(flag(&args, "--parent-shutdown-time").unwrap()).unwrap();
    let drain = parse_duration(flag(&args, "--drain-time").unwrap()).unwrap();
    assert!(parent_shutdown > drain);
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace > parent_shutdown.as_secs(),
        "terminationGracePeriodSeconds {grace} must exceed --parent-shutdown-time {parent_shutdown:?}"
    );

    // Readiness is the pod-local marker, not the shared admin port.
    let marker = flag(&args, "--ready-marker").unwrap();
    let probe: Vec<&str> = container["readinessProbe"]["exec"]["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert!(
        probe.contains(&marker),
        "the probe checks {marker}: {probe:?}"
    );

    // /dev/shm and the state dir are the node's; the marker's dir is the pod's own.
    let mounts = container["volumeMounts"].as_sequence().unwrap();
    let volumes = pod["volumes"].as_sequence().unwrap();
    let volume_of = |mount_path: &str| -> &Value {
        let mount = mounts
            .iter()
            .find(|m| m["mountPath"] == mount_path)
            .unwrap_or_else(|| panic!("nothing mounted at {mount_path}"));
        volumes
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap_or_else(|| panic!("no volume for {mount_path}"))
    };
    assert_eq!(volume_of("/dev/shm")["hostPath"]["path"], "/dev/shm");
    let state_dir = flag(&args, "--state-dir").unwrap();
    assert!(
        volume_of(state_dir)["hostPath"]["path"].is_string(),
        "the state dir is a hostPath"
    );
    let marker_dir = std::path::Path::new(marker)
        .parent()
        .unwrap()
        .to_str()
        .unwrap();
    assert!(
        volume_of(marker_dir)["hostPath"].is_null(),
        "the marker must be pod-local"
    );

    // The identity in the state dir is the pod's name.
    let env = container["env"].as_sequence().unwrap();
    assert!(
        env.iter().any(|e| e["name"] == "POD_NAME"
            && e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name")
    );
}

/// Every YAML document under `deploy/kubernetes/`, with its file name.
fn manifests() -> Vec<(String, Value)> {
    let dir = repo().join("deploy/kubernetes");
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).unwrap();
            for doc in serde_yaml::Deserializer::from_str(&text) {
                let value =
                    Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                docs.push((
                    path.file_name().unwrap().to_string_lossy().into_owned(),
                    value,
                ));
            }
        }
    }
    docs
}

use serde::Deserialize as _;

/// The containers (and init containers) of a workload that run envoy-agent.
fn agent_containers(doc: &Value) -> Vec<Value> {
    let pod = &doc["spec"]["template"]["spec"];
    ["containers", "initContainers"]
        .iter()
        .filter_map(|k| pod[*k].as_sequence())
        .flatten()
        .filter(|c| {
            c["image"]
                .as_str()
                .is_some_and(|i| i.starts_with("envoy-agent"))
        })
        .cloned()
        .collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().map(|a| a.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

#[test]
fn every_manifest_uses_real_flags_and_the_kustomization_lists_them_all() {
    let docs = manifests();
    let known = run_flags();
    let mut checked = 0;
    for (file, doc) in &docs {
        for container in agent_containers(doc) {
            let args = strings(&container["args"]);
            assert_eq!(args[0], "run", "{file}");
            for arg in args.iter().filter(|a| a.starts_with("--")) {
                let name = arg.split('=').next().unwrap();
                assert!(
                    known.iter().any(|k| k == name),
                    "{file}: {name} is not a flag of run"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 2, "the DaemonSet and the sidecar");
    let kustomization = docs
        .iter()
        .find(|(f, _)| f == "kustomization.yaml")
        .map(|(_, d)| strings(&d["resources"]))
        .unwrap();
    for (file, _) in docs.iter().filter(|(f, _)| f != "kustomization.yaml") {
        assert!(
            kustomization.contains(file),
            "kustomization.yaml lists {file}"
        );
    }
}

#[test]
fn the_sidecar_drains_on_prestop_and_is_ready_from_the_status_server() {
    let docs = manifests();
    let (_, deployment) = docs.iter().find(|(f, _)| f == "sidecar.yaml").unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    let sidecar = &pod["initContainers"][0];
    assert_eq!(sidecar["restartPolicy"], "Always", "a native sidecar");
    let args = strings(&sidecar["args"]);

    // Readiness on the agent's own endpoint and port.
    let status: std::net::SocketAddr = flag(&args, "--status-address").unwrap().parse().unwrap();
    assert!(
        status.ip().is_unspecified(),
        "the kubelet probes the pod IP"
    );
    let probe = &sidecar["readinessProbe"]["httpGet"];
    assert_eq!(probe["path"], "/healthz/ready");
    assert_eq!(probe["port"].as_u64(), Some(u64::from(status.port())));
    let router_paths = [
        "/healthz/ready",
        "/drain",
        "/quitquitquit",
        "/stats/prometheus",
    ];
    assert!(router_paths.contains(&probe["path"].as_str().unwrap()));

    // preStop: the agent's own drain subcommand, which exists.
    let pre_stop = strings(&sidecar["lifecycle"]["preStop"]["exec"]["command"]);
    assert_eq!(pre_stop[1..], ["drain", "--skip-exit"]);
    let cli = Cli::command();
    let drain = cli.find_subcommand("drain").expect("a drain subcommand");
    assert!(
        drain
            .get_arguments()
            .any(|a| a.get_long() == Some("skip-exit"))
    );

    // The grace covers the drain: delay + termination drain + the stop grace.
    let secs = |name: &str, default: &str| {
        parse_duration(flag(&args, name).unwrap_or(default))
            .unwrap()
            .as_secs()
    };
    let needed = secs("--drain-delay", "0s")
        + secs("--termination-drain-duration", "5s")
        + secs("--stop-grace", "5s");
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace > needed,
        "terminationGracePeriodSeconds {grace} must exceed {needed}s"
    );
}

#[test]
fn the_dockerfile_runs_the_agent_with_real_flags() {
    let text = std::fs::read_to_string(repo().join("Dockerfile")).unwrap();
    let json_line = |directive: &str| -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.starts_with(directive))
            .unwrap_or_else(|| panic!("no {directive}"));
        serde_json::from_str(line[directive.len()..].trim()).unwrap()
    };
    let entrypoint = json_line("ENTRYPOINT");
    assert_eq!(
        entrypoint,
        ["/usr/local/bin/envoy-agent"],
        "the agent is PID 1"
    );
    assert!(
        text.contains(
            "COPY --from=build /src/target/release/envoy-agent /usr/local/bin/envoy-agent"
        )
    );
    assert!(
        text.contains("FROM envoyproxy/envoy:v1.40"),
        "the official Envoy 1.40 image"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("USER ") && !l.contains("root")),
        "non-root"
    );
    let cmd = json_line("CMD");
    assert_eq!(cmd[0], "run");
    let known = run_flags();
    for arg in cmd.iter().filter(|a| a.starts_with("--")) {
        assert!(known.contains(arg), "{arg} is not a flag of run");
    }
    assert!(repo().join(".dockerignore").exists());
}

#[test]
fn the_systemd_unit_uses_real_flags() {
    let text = std::fs::read_to_string(repo().join("deploy/systemd/envoy-agent.service")).unwrap();
    let exec = text.replace("\\\n", " ");
    let line = exec.lines().find(|l| l.starts_with("ExecStart=")).unwrap();
    let known = run_flags();
    for word in line.split_whitespace().filter(|w| w.starts_with("--")) {
        assert!(
            known.iter().any(|k| k == word),
            "{word} is not a flag of run"
        );
    }
    assert!(text.contains("ExecReload=/bin/kill -HUP $MAINPID"));
}

#[test]
fn flag_reference_is_current() {
    let path = repo().join("docs/flags.md");
    let generated = envoy_agent::cli::flag_reference();
    if std::env::var_os("UPDATE_FLAG_DOCS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "docs/flags.md is out of date: run `UPDATE_FLAG_DOCS=1 cargo test -p envoy-agent --test e2e flag_reference`"
    );
}
