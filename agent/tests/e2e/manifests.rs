//! The deployment artefacts checked against the agent's real CLI and the invariants they depend
//! on: the Kubernetes manifests (one kustomization per directory under `deploy/kubernetes/`, as
//! `kubectl apply -k` takes them; `scripts/check-deploy.sh` also renders them and validates
//! them against the API schemas), the Dockerfile and the systemd unit.

use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser as _};
use envoy_agent::config::cli::Cli;
use envoy_agent::config::duration::parse_duration;
use serde::Deserialize as _;
use serde_yaml::Value;

pub(crate) const NODE_PROXY: &str = "deploy/kubernetes/node-proxy";
pub(crate) const SIDECAR_EXAMPLE: &str = "deploy/kubernetes/sidecar-example";

/// How long the status server's `/healthz/ready` may wait on Envoy's admin API
/// (`ENVOY_CALL_TIMEOUT` in `agent/src/status.rs`): an HTTP probe's timeout must exceed it.
const READY_HANDLER_WAIT_SECS: u64 = 2;

/// The image's user (`USER` in the Dockerfile).
const IMAGE_UID: u64 = 101;

pub(crate) fn repo() -> PathBuf {
    envoy_agent_tests::repo_root()
}

/// The long flags of `envoy-agent run` (and the global ones).
fn run_flags() -> Vec<String> {
    let cli = Cli::command();
    let run = cli.find_subcommand("run").expect("run subcommand");
    run.get_arguments()
        .chain(cli.get_arguments())
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect()
}

/// The environment variables that `envoy-agent run` (and every subcommand) reads.
fn flag_env_vars() -> Vec<String> {
    let cli = Cli::command();
    let run = cli.find_subcommand("run").expect("run subcommand");
    run.get_arguments()
        .chain(cli.get_arguments())
        .filter_map(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
        .collect()
}

/// `--name=value` or `--name value` from an argument list.
pub(crate) fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
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

pub(crate) fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().map(|a| a.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

/// Every YAML document of a file.
pub(crate) fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .collect()
}

/// One kustomization directory, read as `kubectl kustomize` would find it.
pub(crate) struct Kustomization {
    dir: String,
    spec: Value,
    /// The objects of its `resources:`.
    objects: Vec<Value>,
}

impl Kustomization {
    pub(crate) fn load(dir: &str) -> Self {
        let path = repo().join(dir).join("kustomization.yaml");
        let spec = yaml_docs(&path).remove(0);
        let objects = strings(&spec["resources"])
            .iter()
            .flat_map(|r| yaml_docs(&repo().join(dir).join(r)))
            .collect();
        Kustomization {
            dir: dir.to_owned(),
            spec,
            objects,
        }
    }

    fn all() -> Vec<Self> {
        let mut dirs: Vec<String> = std::fs::read_dir(repo().join("deploy/kubernetes"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("kustomization.yaml").is_file())
            .map(|p| {
                format!(
                    "deploy/kubernetes/{}",
                    p.file_name().unwrap().to_string_lossy()
                )
            })
            .collect();
        dirs.sort();
        dirs.iter().map(|d| Self::load(d)).collect()
    }

    /// The first object of `kind`, or with `Kind/name` the one so named.
    pub(crate) fn object(&self, kind: &str) -> &Value {
        let (kind_only, name) = kind
            .split_once('/')
            .map_or((kind, None), |(k, n)| (k, Some(n)));
        self.objects
            .iter()
            .find(|o| o["kind"] == kind_only && name.is_none_or(|n| o["metadata"]["name"] == n))
            .unwrap_or_else(|| panic!("{}: no {kind}", self.dir))
    }

    /// The files its configMapGenerator entries take, by ConfigMap name.
    fn generated_config_maps(&self) -> Vec<(String, Vec<String>)> {
        self.spec["configMapGenerator"]
            .as_sequence()
            .map(|gens| {
                gens.iter()
                    .map(|g| (g["name"].as_str().unwrap().to_owned(), strings(&g["files"])))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The pod spec of a workload.
pub(crate) fn pod_spec(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]
}

/// The containers (and init containers) of a pod that run the agent: the envoy-agent image
/// with its entrypoint, which is the agent.
pub(crate) fn agent_containers(pod: &Value) -> Vec<&Value> {
    ["initContainers", "containers"]
        .iter()
        .filter_map(|k| pod[*k].as_sequence())
        .flatten()
        .filter(|c| {
            c["image"]
                .as_str()
                .is_some_and(|i| i.starts_with("envoy-agent"))
                && c["command"].is_null()
        })
        .collect()
}

pub(crate) fn args_of(container: &Value) -> Vec<String> {
    strings(&container["args"])
}

/// The volume mounted at `mount_path` in `container`.
fn volume_at<'a>(pod: &'a Value, container: &Value, mount_path: &str) -> &'a Value {
    let mount = container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == mount_path)
        .unwrap_or_else(|| panic!("nothing mounted at {mount_path}"));
    pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("no volume for {mount_path}"))
}

/// The writable mount that holds `path`, if any.
fn writable_mount_of<'a>(container: &'a Value, path: &str) -> Option<&'a Value> {
    container["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|m| m["readOnly"] != true)
        .find(|m| Path::new(path).starts_with(m["mountPath"].as_str().unwrap()))
}

/// An environment variable's value or downward-API field.
/// The pod spec's container named `name` (of its `containers`).
pub(crate) fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    pod["containers"]
        .as_sequence()
        .and_then(|c| c.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no container {name:?}"))
}

pub(crate) fn env_var<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_sequence()?
        .iter()
        .find(|e| e["name"] == name)
}

fn assert_downward_api(container: &Value, name: &str, field: &str, what: &str) {
    let env = env_var(container, name).unwrap_or_else(|| panic!("{what}: no {name}"));
    assert_eq!(
        env["valueFrom"]["fieldRef"]["fieldPath"], field,
        "{what}: {name} from the downward API's {field}"
    );
}

/// The `restricted` Pod Security profile, and a read-only root filesystem, for one container;
/// pod-level settings count. Returns the container's uid.
fn assert_restricted(pod: &Value, container: &Value, what: &str) -> u64 {
    let sc = &container["securityContext"];
    let pod_sc = &pod["securityContext"];
    let either = |key: &str| {
        if sc[key].is_null() {
            &pod_sc[key]
        } else {
            &sc[key]
        }
    };
    assert_eq!(*either("runAsNonRoot"), true, "{what}: runAsNonRoot");
    let uid = either("runAsUser")
        .as_u64()
        .unwrap_or_else(|| panic!("{what}: a numeric runAsUser"));
    assert_ne!(uid, 0, "{what}: not root");
    assert!(
        either("runAsGroup").as_u64().is_some(),
        "{what}: a numeric runAsGroup"
    );
    assert_eq!(
        sc["allowPrivilegeEscalation"], false,
        "{what}: allowPrivilegeEscalation"
    );
    assert_ne!(sc["privileged"], true, "{what}: not privileged");
    assert_eq!(
        strings(&sc["capabilities"]["drop"]),
        ["ALL"],
        "{what}: every capability dropped"
    );
    assert!(
        sc["capabilities"]["add"].is_null(),
        "{what}: no capability added"
    );
    assert_eq!(
        either("seccompProfile")["type"],
        "RuntimeDefault",
        "{what}: the runtime's seccomp profile"
    );
    assert_eq!(
        sc["readOnlyRootFilesystem"], true,
        "{what}: read-only root filesystem"
    );
    uid
}

fn assert_resources(container: &Value, what: &str) {
    let resources = &container["resources"];
    for kind in ["requests", "limits"] {
        assert!(
            resources[kind]["memory"].is_string(),
            "{what}: a memory {kind}"
        );
    }
    assert!(
        resources["requests"]["cpu"].is_string(),
        "{what}: a CPU request"
    );
}

fn assert_real_flags(container: &Value, what: &str) {
    let args = args_of(container);
    assert_eq!(args.first().map(String::as_str), Some("run"), "{what}");
    let known = run_flags();
    for arg in args.iter().filter(|a| a.starts_with("--")) {
        let name = arg.split('=').next().unwrap();
        assert!(
            known.iter().any(|k| k == name),
            "{what}: {name} is not a flag of envoy-agent run"
        );
    }
    let envs = flag_env_vars();
    for env in container["env"].as_sequence().into_iter().flatten() {
        let name = env["name"].as_str().unwrap();
        if name.starts_with("ENVOY_AGENT_") {
            assert!(
                envs.iter().any(|e| e == name),
                "{what}: {name} is not an environment variable the agent reads"
            );
        }
    }
}

#[test]
fn daemonset_supports_the_cross_pod_handoff() {
    let k = Kustomization::load(NODE_PROXY);
    let ds = k.object("DaemonSet");
    let spec = &ds["spec"];
    assert_eq!(spec["updateStrategy"]["rollingUpdate"]["maxSurge"], 1);
    assert_eq!(spec["updateStrategy"]["rollingUpdate"]["maxUnavailable"], 0);
    let pod = pod_spec(ds);
    assert_eq!(
        pod["hostNetwork"], true,
        "the Envoys must share a network namespace"
    );

    let container = &pod["containers"][0];
    assert_real_flags(container, "the DaemonSet");
    let args = args_of(container);
    assert!(args.iter().any(|a| a == "--hot-restart"));
    assert!(flag(&args, "--base-id").is_some(), "a fixed base id");
    assert!(
        container["ports"].is_null(),
        "no container ports: with hostNetwork they are host ports, and the surge pod could not be scheduled beside the old one"
    );

    // The grace period covers the old pod's wait for its Envoy to be terminated.
    let parent_shutdown = parse_duration(flag(&args, "--parent-shutdown-time").unwrap()).unwrap();
    let drain = parse_duration(flag(&args, "--drain-time").unwrap()).unwrap();
    assert!(parent_shutdown > drain);
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace > parent_shutdown.as_secs(),
        "terminationGracePeriodSeconds {grace} must exceed --parent-shutdown-time {parent_shutdown:?}"
    );
    // The agent holds itself to the pod's grace period (issue 31).
    let budget = parse_duration(flag(&args, "--shutdown-budget").unwrap()).unwrap();
    assert_eq!(
        budget.as_secs(),
        grace,
        "--shutdown-budget is the grace period"
    );

    // Readiness is the pod-local marker, not the shared admin port.
    let marker = flag(&args, "--ready-marker").unwrap();
    let probe = strings(&container["readinessProbe"]["exec"]["command"]);
    assert!(
        probe.iter().any(|c| c == marker),
        "the probe checks {marker}: {probe:?}"
    );

    // /dev/shm and the state dir are the node's; the marker's dir is the pod's own.
    assert_eq!(
        volume_at(pod, container, "/dev/shm")["hostPath"]["path"],
        "/dev/shm"
    );
    let state_dir = flag(&args, "--state-dir").unwrap();
    assert!(
        volume_at(pod, container, state_dir)["hostPath"]["path"].is_string(),
        "the state dir is a hostPath"
    );
    let marker_dir = Path::new(marker).parent().unwrap().to_str().unwrap();
    assert!(
        volume_at(pod, container, marker_dir)["emptyDir"].is_mapping(),
        "the marker must be pod-local"
    );

    // The identity in the state dir is the pod's name.
    assert_downward_api(container, "POD_NAME", "metadata.name", "the DaemonSet");
}

#[test]
fn the_node_proxy_runs_unprivileged_and_can_write_what_it_must() {
    let k = Kustomization::load(NODE_PROXY);
    let ds = k.object("DaemonSet");
    let pod = pod_spec(ds);
    let container = &pod["containers"][0];
    let what = "the DaemonSet's agent";
    let uid = assert_restricted(pod, container, what);
    assert_eq!(uid, IMAGE_UID, "{what}: the image's user");
    assert_resources(container, what);
    for (name, field) in [
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
        ("NODE_NAME", "spec.nodeName"),
    ] {
        assert_downward_api(container, name, field, what);
    }
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert_eq!(pod["nodeSelector"]["kubernetes.io/os"], "linux");
    assert!(
        pod["tolerations"]
            .as_sequence()
            .is_some_and(|t| t.iter().any(|t| t["operator"] == "Exists")),
        "tolerates tainted nodes"
    );

    // What it writes is mounted, the root filesystem being read-only: the state dir and
    // /dev/shm (the node's), the marker, the gRPC socket and /tmp (the pod's).
    let args = args_of(container);
    let state_dir = flag(&args, "--state-dir").unwrap();
    let marker = flag(&args, "--ready-marker").unwrap();
    let grpc = env_var(container, "ENVOY_AGENT_GRPC_ADDRESS")
        .and_then(|e| e["value"].as_str())
        .and_then(|a| a.strip_prefix("unix:"))
        .expect("a pod-local gRPC socket (ENVOY_AGENT_GRPC_ADDRESS=unix:...)");
    for path in [state_dir, "/dev/shm", marker, grpc, "/tmp"] {
        assert!(
            writable_mount_of(container, path).is_some(),
            "{what}: {path} is on a writable volume"
        );
    }
    let grpc_mount = writable_mount_of(container, grpc).unwrap()["mountPath"]
        .as_str()
        .unwrap();
    assert!(
        volume_at(pod, container, grpc_mount)["emptyDir"].is_mapping(),
        "the gRPC socket is pod-local: the successor pod's agent has its own"
    );

    // The kubelet creates the hostPath state dir as root: an init container hands it to the
    // agent's user before the agent starts.
    let init = pod["initContainers"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|c| {
            c["volumeMounts"]
                .as_sequence()
                .is_some_and(|m| m.iter().any(|m| m["mountPath"] == state_dir))
        })
        .expect("an init container that prepares the state dir");
    let command = strings(&init["command"]);
    let gid = container["securityContext"]["runAsGroup"].as_u64().unwrap();
    let owner = format!("{uid}:{gid}");
    assert_eq!(
        command,
        ["chown", owner.as_str(), state_dir],
        "the init container gives the state dir to the agent's user"
    );
    assert_eq!(
        strings(&init["securityContext"]["capabilities"]["add"]),
        ["CHOWN"],
        "the init container needs CAP_CHOWN only"
    );
    assert_eq!(
        strings(&init["securityContext"]["capabilities"]["drop"]),
        ["ALL"]
    );
    assert_eq!(init["securityContext"]["allowPrivilegeEscalation"], false);
    assert_resources(init, "the state-dir init container");
}

#[test]
fn the_node_proxy_bootstrap_has_fixed_ports() {
    let k = Kustomization::load(NODE_PROXY);
    let ds = k.object("DaemonSet");
    let args = args_of(&pod_spec(ds)["containers"][0]);
    let config = Path::new(flag(&args, "--config-path").unwrap());
    let (_, files) = k
        .generated_config_maps()
        .into_iter()
        .next()
        .expect("a configMapGenerator");
    let file = config.file_name().unwrap().to_str().unwrap();
    assert!(files.iter().any(|f| f == file), "the ConfigMap has {file}");
    let bootstrap = yaml_docs(&repo().join(NODE_PROXY).join(file)).remove(0);

    // No TCP admin port, which every process on the node could use to stop Envoy: the agent
    // puts Envoy's admin on its own socket, which every epoch and the successor pod's Envoy
    // bind in turn.
    assert!(
        bootstrap["admin"].is_null(),
        "no admin address in the shipped bootstrap"
    );
    assert_eq!(flag(&args, "--envoy-admin"), Some("socket"));
    // Envoy hands listening sockets over by their configured address.
    for listener in bootstrap["static_resources"]["listeners"]
        .as_sequence()
        .unwrap()
    {
        assert!(
            listener["address"]["socket_address"]["port_value"]
                .as_u64()
                .is_some_and(|p| p > 0),
            "listener {:?} has a fixed port",
            listener["name"]
        );
    }
}

#[test]
fn every_kustomization_creates_what_its_workloads_need() {
    let all = Kustomization::all();
    let dirs: Vec<&str> = all.iter().map(|k| k.dir.as_str()).collect();
    assert_eq!(dirs, [NODE_PROXY, SIDECAR_EXAMPLE]);
    let mut agents = 0;
    for k in &all {
        let dir = &k.dir;
        // Every manifest in the directory is applied; the generators' files exist.
        let resources = strings(&k.spec["resources"]);
        let generated: Vec<String> = k
            .generated_config_maps()
            .into_iter()
            .flat_map(|(_, files)| files)
            .collect();
        for entry in std::fs::read_dir(repo().join(dir)).unwrap() {
            let file = entry.unwrap().file_name().to_string_lossy().into_owned();
            if file.ends_with(".yaml") && file != "kustomization.yaml" {
                assert!(
                    resources.contains(&file) || generated.contains(&file),
                    "{dir}: kustomization.yaml uses {file}"
                );
            }
        }
        for file in &generated {
            assert!(
                repo().join(dir).join(file).is_file(),
                "{dir}: {file} exists"
            );
        }

        // It creates its own namespace.
        let namespace = k.spec["namespace"]
            .as_str()
            .unwrap_or_else(|| panic!("{dir}: a namespace"));
        assert_eq!(
            k.object("Namespace")["metadata"]["name"],
            namespace,
            "{dir}: creates its namespace"
        );

        // The agent's image can be pointed at a registry.
        let images: Vec<&str> = k.spec["images"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{dir}: an images: entry"))
            .iter()
            .map(|i| i["name"].as_str().unwrap())
            .collect();

        for workload in k
            .objects
            .iter()
            .filter(|o| o["spec"]["template"].is_mapping())
        {
            let pod = pod_spec(workload);
            let names: Vec<String> = k
                .generated_config_maps()
                .into_iter()
                .map(|(n, _)| n)
                .collect();
            for volume in pod["volumes"].as_sequence().into_iter().flatten() {
                if let Some(cm) = volume["configMap"]["name"].as_str() {
                    assert!(
                        names.iter().any(|n| n == cm),
                        "{dir}: the ConfigMap {cm} is generated here"
                    );
                }
            }
            for container in agent_containers(pod) {
                let what = format!("{dir}: container {}", container["name"].as_str().unwrap());
                assert_real_flags(container, &what);
                let image = container["image"].as_str().unwrap();
                let name = image.split(':').next().unwrap();
                assert!(images.contains(&name), "{what}: images: names {name}");
                // The bootstrap is a generated ConfigMap file, mounted where --config-path says.
                let args = args_of(container);
                let config = Path::new(flag(&args, "--config-path").expect("--config-path"));
                let volume = volume_at(pod, container, config.parent().unwrap().to_str().unwrap());
                assert!(
                    volume["configMap"].is_mapping(),
                    "{what}: bootstrap from a ConfigMap"
                );
                let file = config.file_name().unwrap().to_string_lossy().into_owned();
                assert!(
                    generated.contains(&file),
                    "{what}: the ConfigMap has {file}"
                );
                agents += 1;
            }
        }
    }
    assert!(agents >= 2, "the DaemonSet and the sidecar");
}

/// The classic-sidecar example (no native sidecars): the agent is the pod's first container,
/// with the native example's arguments and socket (its end-to-end tests cover both), a
/// postStart `envoy-agent wait` whose timeout parses, no preStop (SIGTERM reaches both
/// containers at once: the agent drains on it), and the same readiness probe.
#[test]
fn the_classic_sidecar_is_the_first_container_and_holds_the_app_with_wait() {
    let k = Kustomization::load(SIDECAR_EXAMPLE);
    let native = &pod_spec(k.object("Deployment/web"))["initContainers"][0];
    let pod = pod_spec(k.object("Deployment/web-classic"));
    assert!(pod["initContainers"].is_null(), "no native sidecar");
    let classic = &pod["containers"][0];
    assert_eq!(agent_containers(pod), [classic], "the agent comes first");
    assert_eq!(
        args_of(classic),
        args_of(native),
        "the native example's arguments"
    );
    assert_eq!(
        env_var(classic, "ENVOY_AGENT_GRPC_ADDRESS"),
        env_var(native, "ENVOY_AGENT_GRPC_ADDRESS")
    );
    assert_eq!(classic["readinessProbe"], native["readinessProbe"]);
    assert_eq!(classic["volumeMounts"], native["volumeMounts"]);
    let command = strings(&classic["lifecycle"]["postStart"]["exec"]["command"]);
    assert!(command[0].ends_with("/envoy-agent"), "{command:?}");
    let parsed = Cli::try_parse_from(&command).unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        matches!(
            parsed.command,
            envoy_agent::config::cli::Command::Client(
                envoy_agent::config::cli::ClientCommand::Wait
            )
        ),
        "{command:?}"
    );
    assert!(
        parsed.client.timeout >= std::time::Duration::from_secs(60),
        "{command:?}: long enough for Envoy's start and its control plane"
    );
    assert!(
        classic["lifecycle"]["preStop"].is_null(),
        "no preStop drain"
    );
    assert_eq!(pod["terminationGracePeriodSeconds"], 45);
}

#[test]
fn the_sidecar_starts_before_the_app_drains_on_prestop_and_is_ready_from_the_status_server() {
    let k = Kustomization::load(SIDECAR_EXAMPLE);
    let deployment = k.object("Deployment");
    let pod = pod_spec(deployment);
    let sidecar = &pod["initContainers"][0];
    assert_eq!(sidecar["restartPolicy"], "Always", "a native sidecar");
    let what = "the sidecar";
    let uid = assert_restricted(pod, sidecar, what);
    assert_eq!(uid, IMAGE_UID, "{what}: the image's user");
    assert_resources(sidecar, what);
    let args = args_of(sidecar);

    // Startup and readiness on the agent's own endpoint and port, with timeouts that cover
    // the handler's own wait on Envoy.
    let status: std::net::SocketAddr = flag(&args, "--status-address").unwrap().parse().unwrap();
    assert!(
        status.ip().is_unspecified(),
        "the kubelet probes the pod IP"
    );
    for kind in ["startupProbe", "readinessProbe"] {
        let probe = &sidecar[kind];
        assert_eq!(probe["httpGet"]["path"], "/healthz/ready", "{kind}");
        assert_eq!(
            probe["httpGet"]["port"].as_u64(),
            Some(u64::from(status.port())),
            "{kind}"
        );
        let timeout = probe["timeoutSeconds"].as_u64().unwrap_or(1);
        assert!(
            timeout > READY_HANDLER_WAIT_SECS,
            "{kind}: timeoutSeconds {timeout} must exceed the handler's {READY_HANDLER_WAIT_SECS}s wait on Envoy"
        );
    }

    // preStop: the agent's own drain subcommand, which exists, over the socket `run` listens
    // on (the same container, so the same environment).
    let pre_stop = strings(&sidecar["lifecycle"]["preStop"]["exec"]["command"]);
    assert_eq!(pre_stop[1..], ["drain", "--skip-exit"]);
    let cli = Cli::command();
    let drain = cli.find_subcommand("drain").expect("a drain subcommand");
    assert!(
        drain
            .get_arguments()
            .any(|a| a.get_long() == Some("skip-exit"))
    );
    assert!(
        flag(&args, "--grpc-address").is_none(),
        "the address comes from the environment both read"
    );
    let grpc = env_var(sidecar, "ENVOY_AGENT_GRPC_ADDRESS")
        .and_then(|e| e["value"].as_str())
        .and_then(|a| a.strip_prefix("unix:"))
        .expect("ENVOY_AGENT_GRPC_ADDRESS=unix:...");
    assert!(
        writable_mount_of(sidecar, grpc).is_some(),
        "{grpc} is writable"
    );
    assert!(
        writable_mount_of(sidecar, "/tmp").is_some(),
        "/tmp is writable"
    );

    // The preStop drains inbound listeners: the bootstrap's served listener is one.
    let bootstrap = yaml_docs(&repo().join(SIDECAR_EXAMPLE).join("bootstrap.yaml")).remove(0);
    let listener = &bootstrap["static_resources"]["listeners"][0];
    assert_eq!(listener["traffic_direction"], "INBOUND");
    let inbound_port = listener["address"]["socket_address"]["port_value"]
        .as_u64()
        .unwrap();
    let service = k.object("Service");
    assert_eq!(
        service["spec"]["ports"][0]["targetPort"].as_u64(),
        Some(inbound_port),
        "the Service sends clients through Envoy"
    );

    // The grace covers the fallback drain: delay + termination drain + the stop grace.
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
    // The agent holds itself to the pod's grace period (issue 31): it splits the budget and
    // refuses at start a phase that cannot fit.
    assert_eq!(
        secs("--shutdown-budget", "0s"),
        grace,
        "--shutdown-budget is the grace period"
    );

    // The app runs restricted too (the namespace enforces it).
    assert_restricted(pod, &pod["containers"][0], "the app");
    assert_eq!(
        k.object("Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "restricted"
    );
}

#[test]
fn the_dockerfile_builds_from_the_workspace_and_runs_the_agent_unprivileged() {
    let text = std::fs::read_to_string(repo().join("Dockerfile")).unwrap();
    assert_eq!(
        text.lines().next(),
        Some("# syntax=docker/dockerfile:1"),
        "BuildKit syntax (cache mounts)"
    );
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
        text.contains("FROM envoyproxy/envoy:v1.40"),
        "the official Envoy 1.40 image"
    );

    // The build stage builds the workspace as it is: no placeholder crates, the cargo command
    // in one script (which CI runs too), registry and target dir in cache mounts.
    assert!(
        !text.contains("fn main() {}") && !text.contains("touch"),
        "no placeholder crates"
    );
    assert!(text.contains("scripts/docker-build-stage.sh compile /out"));
    let script = repo().join("scripts/docker-build-stage.sh");
    assert!(
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&script).unwrap().permissions())
            & 0o111
            != 0,
        "{} is executable",
        script.display()
    );
    for cache in ["/usr/local/cargo/registry", "/src/target"] {
        assert!(
            text.contains(&format!("--mount=type=cache,target={cache}")),
            "a cache mount for {cache}"
        );
    }
    assert!(text.contains("COPY --from=build /out/envoy-agent /usr/local/bin/envoy-agent"));

    // A numeric non-root user, so that runAsNonRoot can check it; the manifests use the same.
    let user = text
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER");
    let (uid, gid) = user.split_once(':').expect("USER uid:gid");
    assert_eq!(uid.parse::<u64>().ok(), Some(IMAGE_UID), "USER {user}");
    assert!(gid.parse::<u64>().is_ok_and(|g| g != 0), "USER {user}");

    let cmd = json_line("CMD");
    assert_eq!(cmd[0], "run");
    let known = run_flags();
    for arg in cmd.iter().filter(|a| a.starts_with("--")) {
        assert!(known.contains(arg), "{arg} is not a flag of run");
    }
    // The status port is exposed.
    let status: std::net::SocketAddr = flag(&cmd, "--status-address").unwrap().parse().unwrap();
    assert!(
        text.lines()
            .any(|l| l == format!("EXPOSE {}", status.port())),
        "EXPOSE {}",
        status.port()
    );
    assert!(repo().join(".dockerignore").exists());
}

#[test]
fn the_systemd_unit_uses_real_flags_and_leaves_stopping_envoy_to_the_agent() {
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
    let directive = |key: &str| -> Vec<&str> {
        text.lines()
            .filter_map(|l| l.strip_prefix(&format!("{key}=")))
            .collect()
    };
    assert_eq!(directive("ExecReload"), ["/bin/kill -HUP $MAINPID"]);
    assert_eq!(
        directive("Type"),
        ["notify"],
        "the agent speaks sd_notify (agent/tests/e2e/systemd.rs)"
    );
    assert_eq!(
        directive("KillMode"),
        ["mixed"],
        "SIGTERM to the agent alone, which stops every epoch itself"
    );
    let user = directive("User");
    assert!(
        user.len() == 1 && user[0] != "root" && user[0] != "0",
        "a non-root User=: {user:?}"
    );
    assert_eq!(directive("AmbientCapabilities"), ["CAP_NET_BIND_SERVICE"]);
    assert_eq!(directive("CapabilityBoundingSet"), ["CAP_NET_BIND_SERVICE"]);
    assert_eq!(directive("NoNewPrivileges"), ["yes"]);
    assert_eq!(directive("ProtectSystem"), ["strict"]);
    assert_eq!(
        directive("StateDirectoryMode"),
        ["0700"],
        "the state dir (hot-restart channel, lock, heartbeats) is the agent's alone"
    );
    // What the agent writes is in the directories systemd creates for User= (writable under
    // ProtectSystem=strict).
    for path_flag in ["--state-dir", "--ready-marker", "--grpc-address"] {
        let words: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
        let value = flag(&words, path_flag).unwrap();
        let path = value.strip_prefix("unix:").unwrap_or(value);
        let in_runtime_dir = path.starts_with("/run/envoy-agent/")
            && directive("RuntimeDirectory") == ["envoy-agent"];
        let in_state_dir = path.starts_with("/var/lib/envoy-agent")
            && directive("StateDirectory") == ["envoy-agent"];
        assert!(
            in_runtime_dir || in_state_dir,
            "{path_flag} {path} is in RuntimeDirectory= or StateDirectory="
        );
    }
}

#[test]
fn flag_reference_exit_code_table_is_current() {
    // One copy of the exit codes: docs/operations.md shows `exit_code::TABLE` between its
    // markers.
    let path = repo().join("docs/operations.md");
    let on_disk = std::fs::read_to_string(&path).unwrap();
    let begin = on_disk
        .find("<!-- generated from agent/src/exit_code.rs")
        .expect("the exit code table's start marker in docs/operations.md");
    let begin = begin + on_disk[begin..].find('\n').unwrap() + 1;
    let end = begin
        + on_disk[begin..]
            .find("<!-- end of the generated table -->")
            .expect("the exit code table's end marker");
    let generated = envoy_agent::exit_code::markdown_table();
    if std::env::var_os("UPDATE_FLAG_DOCS").is_some() {
        let updated = format!("{}{generated}{}", &on_disk[..begin], &on_disk[end..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    assert!(
        on_disk[begin..end] == generated,
        "docs/operations.md's exit codes are out of date: run `UPDATE_FLAG_DOCS=1 cargo test -p envoy-agent --test e2e flag_reference`"
    );
}

#[test]
fn flag_reference_is_current() {
    let path = repo().join("docs/flags.md");
    let generated = envoy_agent::config::cli::flag_reference();
    if std::env::var_os("UPDATE_FLAG_DOCS").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == generated,
        "docs/flags.md is out of date: run `UPDATE_FLAG_DOCS=1 cargo test -p envoy-agent --test e2e flag_reference`"
    );
}

/// Both sidecar examples move the app's probes through the agent (issue 41): each probe of the
/// app container asks the agent's status port at a path that `ENVOY_AGENT_APP_PROBERS` (which
/// the agent accepts) configures, every configured path is asked, and each configured probe
/// goes to a port the app listens on, within the kubelet's own timeout.
#[test]
fn the_sidecar_examples_probe_the_app_through_the_agent() {
    use envoy_agent::status::app_probe::{Action, AppProbes, Input};
    let k = Kustomization::load(SIDECAR_EXAMPLE);
    for workload in ["Deployment/web", "Deployment/web-classic"] {
        let pod = pod_spec(k.object(workload));
        let agent = agent_containers(pod)[0];
        let status: std::net::SocketAddr = flag(&args_of(agent), "--status-address")
            .unwrap()
            .parse()
            .unwrap();
        let json = env_var(agent, "ENVOY_AGENT_APP_PROBERS")
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("{workload}: ENVOY_AGENT_APP_PROBERS"));
        let probes = AppProbes::parse(json, Input::Flag)
            .unwrap_or_else(|e| panic!("{workload}: the agent refuses it: {e}"));
        let app = container(pod, "app");
        let app_ports: Vec<u64> = app["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .filter_map(|p| p["containerPort"].as_u64())
            .collect();
        let mut asked = Vec::new();
        for kind in ["startupProbe", "livenessProbe", "readinessProbe"] {
            let probe = &app[kind];
            if probe.is_null() {
                continue;
            }
            let what = format!("{workload}: the app's {kind}");
            assert_eq!(
                probe["httpGet"]["port"].as_u64(),
                Some(u64::from(status.port())),
                "{what}: the agent's status port"
            );
            let path = probe["httpGet"]["path"].as_str().unwrap();
            let configured = probes
                .get(path)
                .unwrap_or_else(|| panic!("{what}: {path} is not in ENVOY_AGENT_APP_PROBERS"));
            let kubelet_timeout = probe["timeoutSeconds"].as_u64().unwrap_or(1);
            assert!(
                configured.timeout.as_secs() < kubelet_timeout,
                "{what}: the agent's probe ({:?}) ends before the kubelet's ({kubelet_timeout}s)",
                configured.timeout
            );
            let port = match &configured.action {
                Action::Http(get) => get.target.port,
                Action::Tcp(target) => target.port,
                Action::Grpc(check) => check.target.port,
            };
            assert!(
                app_ports.contains(&u64::from(port)),
                "{what}: the app listens on {port}"
            );
            asked.push(path.to_owned());
        }
        asked.sort();
        assert_eq!(
            probes.paths().collect::<Vec<_>>(),
            asked,
            "{workload}: every configured probe is asked"
        );
    }
}
