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
