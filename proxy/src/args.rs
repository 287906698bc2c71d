//! Envoy's command line, built by one pure function so every rule has a unit test.
//!
//! The order follows Istio's pilot-agent (`pkg/envoy/proxy.go`), with the hot-restart flags in
//! the place of `--disable-hot-restart`, and the caller's extra arguments last so they win
//! where Envoy lets a later flag override an earlier one.

use std::net::IpAddr;

use crate::config::{AdminAddress, ProxyConfig};
use crate::log_level::LogLevels;
use crate::socket_path::SocketPath;

/// Envoy's log line as JSON: the format Istio passed as `--log-format` before moving it into
/// the bootstrap. `%j` is Envoy's JSON-escaped message.
pub const JSON_LOG_FORMAT: &str = r#"{"level":"%l","time":"%Y-%m-%dT%T.%fZ","scope":"envoy %n","msg":"%j","caller":"%g:%#","thread":%t}"#;

/// A built command line plus what the builder had to leave out, for the caller to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyArgs {
    /// Arguments after the binary name.
    pub args: Vec<String>,
    /// One line per input the builder ignored, saying what and why.
    pub warnings: Vec<String>,
}

/// Whether `args` (the user's extra arguments) set flag `flag` (`--flag value`,
/// `--flag=value`, or a bare switch), under any of its `names`.
pub fn sets(args: &[String], names: &[&str]) -> bool {
    args.iter().any(|a| {
        names
            .iter()
            .any(|n| a == n || a.strip_prefix(n).is_some_and(|rest| rest.starts_with('=')))
    })
}

/// An extra argument the agent cannot let through, and what to use instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedArg {
    /// The flag, as the user wrote it.
    pub flag: String,
    /// Why, and the agent flag to use instead.
    pub instead: &'static str,
}

/// The first of the user's extra arguments that would break what the agent guarantees (its
/// epochs, the file it validates and watches, the hot-restart ordering rule), if any. Every
/// other flag the agent passes is left out when the user sets it: the user's wins, since Envoy
/// refuses a flag given twice ("Argument already set!").
pub fn refused_extra_arg(config: &ProxyConfig) -> Option<RefusedArg> {
    let hot = config.hot_restart.is_some();
    let rules: &[(&[&str], bool, &'static str)] = &[
        (
            &["-c", "--config-path"],
            true,
            "the agent reads, validates and watches the bootstrap: give it with `envoy-agent run -c`",
        ),
        (
            &["--mode"],
            true,
            "the agent runs envoy in serve mode (it validates configs itself)",
        ),
        (
            &["--restart-epoch"],
            true,
            "the agent manages restart epochs (use --hot-restart)",
        ),
        (
            &["--base-id", "--use-dynamic-base-id", "--base-id-path"],
            true,
            "the agent names the envoy family: use `envoy-agent run --hot-restart --base-id N`",
        ),
        (
            &["--parent-shutdown-time-s"],
            true,
            "use `envoy-agent run --parent-shutdown-time` (with --hot-restart)",
        ),
        (
            &["--drain-time-s"],
            hot,
            "use `envoy-agent run --drain-time`: with hot restart it must stay below the parent shutdown time",
        ),
        (
            &["--disable-hot-restart"],
            hot,
            "hot restart is on (--hot-restart): leave this out, or run without --hot-restart",
        ),
        (
            &["--config-yaml"],
            config.options.outlier_log_path.is_some(),
            "--outlier-log-path is an overlay too and envoy takes one: put the outlier log path in your overlay",
        ),
    ];
    for (names, refused, instead) in rules {
        if *refused {
            if let Some(arg) = config
                .extra_args
                .iter()
                .find(|a| sets(std::slice::from_ref(a), names))
            {
                return Some(RefusedArg {
                    flag: arg.split('=').next().unwrap_or(arg).to_owned(),
                    instead,
                });
            }
        }
    }
    None
}

/// Envoy's arguments for `config` at restart `epoch`. The epoch is ignored when hot restart is
/// off (Envoy then runs with `--disable-hot-restart`, always epoch 0). A flag the user's extra
/// arguments set is left out (theirs wins); [`refused_extra_arg`] says which ones cannot be.
pub fn envoy_args(config: &ProxyConfig, epoch: u32) -> EnvoyArgs {
    let extra = &config.extra_args;
    let mut flags = Flags {
        args: Vec::new(),
        extra,
    };
    let mut warnings = Vec::new();

    flags.set("-c", config.config_path.display().to_string());
    flags.set(
        "--drain-time-s",
        config.options.drain_time.as_secs().to_string(),
    );
    flags.set(
        "--drain-strategy",
        config.options.drain_strategy.as_str().to_owned(),
    );
    flags.set(
        "--local-address-ip-version",
        ip_version(&config.options.node_ips).to_owned(),
    );
    flags.set(
        "--file-flush-interval-msec",
        config.options.file_flush_interval.as_millis().to_string(),
    );
    hot_restart_flags(&mut flags, config, epoch);
    if !flags.theirs(&["--allow-unknown-static-fields"]) {
        flags.args.push("--allow-unknown-static-fields".to_owned());
    }
    if config.file_flush_min_size_kb > 0 && !flags.theirs(&["--file-flush-min-size-kb"]) {
        flags.args.push("--file-flush-min-size-kb".to_owned());
        flags.args.push(config.file_flush_min_size_kb.to_string());
    }
    log_flags(&mut flags, config, &mut warnings);
    if config.enable_core_dump && !flags.theirs(&["--enable-core-dump"]) {
        flags.args.push("--enable-core-dump".to_owned());
    }
    if let Some(overlay) = config_overlay(config, epoch) {
        flags.args.push("--config-yaml".to_owned());
        flags.args.push(overlay);
    }
    if config.options.concurrency > 0 && !flags.theirs(&["--concurrency"]) {
        flags.args.push("--concurrency".to_owned());
        flags.args.push(config.options.concurrency.to_string());
    }
    if let Some(path) = admin_address_path(config, epoch) {
        flags.args.push("--admin-address-path".to_owned());
        flags.args.push(path);
    }
    let mut args = flags.args;
    args.extend(extra.iter().cloned());
    EnvoyArgs { args, warnings }
}

/// Envoy's arguments as [`envoy_args`] builds them, beside the user's extra arguments that
/// may set some of the same flags.
struct Flags<'a> {
    args: Vec<String>,
    extra: &'a [String],
}

impl Flags<'_> {
    /// Whether the user's extra arguments set the flag under any of its `names`.
    fn theirs(&self, names: &[&str]) -> bool {
        sets(self.extra, names)
    }

    /// `flag value`, unless the user's extra arguments set `flag`.
    fn set(&mut self, flag: &str, value: String) {
        if !self.theirs(&[flag]) {
            self.args.push(flag.to_owned());
            self.args.push(value);
        }
    }
}

/// The hot-restart flags at `epoch`, or `--disable-hot-restart` without hot restart.
fn hot_restart_flags(flags: &mut Flags<'_>, config: &ProxyConfig, epoch: u32) {
    match &config.hot_restart {
        Some(hot) => {
            flags.set("--restart-epoch", epoch.to_string());
            flags.set("--base-id", hot.base_id.to_string());
            match &hot.socket_path {
                SocketPath::File(prefix) => {
                    flags.set("--socket-path", prefix.display().to_string());
                    flags.set("--socket-mode", "600".to_owned());
                }
                path if *path != SocketPath::envoy_default() => {
                    flags.set("--socket-path", path.to_string());
                }
                _ => {}
            }
            flags.set(
                "--parent-shutdown-time-s",
                hot.parent_shutdown_time.as_secs().to_string(),
            );
        }
        None if flags.theirs(&["--disable-hot-restart"]) => {}
        None => flags.args.push("--disable-hot-restart".to_owned()),
    }
}

/// The logging flags: the levels, the JSON format, deprecation logs. A level token Envoy
/// cannot take is left out with a warning.
fn log_flags(flags: &mut Flags<'_>, config: &ProxyConfig, warnings: &mut Vec<String>) {
    // A level set at run time wins over the command line's: a later epoch keeps it.
    let (global, components) =
        match config.log_level_set.get() {
            Some(set) => (set.global_or_default().to_owned(), set.components_arg()),
            None => {
                let levels = LogLevels::parse(&config.options.log_level);
                warnings.extend(levels.dropped.iter().map(|t| {
                    format!("log level token {t:?} has more than one ':' and is ignored")
                }));
                let components = if levels.components.is_empty() {
                    config.options.component_log_level.clone()
                } else {
                    levels.components.join(",")
                };
                (levels.global.unwrap_or("warning").to_owned(), components)
            }
        };
    if !flags.theirs(&["-l", "--log-level"]) {
        flags.args.push("-l".to_owned());
        flags.args.push(global);
    }
    if !components.is_empty() && !flags.theirs(&["--component-log-level"]) {
        flags.args.push("--component-log-level".to_owned());
        flags.args.push(components);
    }
    if config.options.log_as_json && !flags.theirs(&["--log-format"]) {
        flags.args.push("--log-format".to_owned());
        flags.args.push(JSON_LOG_FORMAT.to_owned());
    }
    if config.skip_deprecated_logs && !flags.theirs(&["--skip-deprecated-logs"]) {
        flags.args.push("--skip-deprecated-logs".to_owned());
    }
}

/// The `--config-yaml` overlay at `epoch`, when the agent has anything to overlay.
fn config_overlay(config: &ProxyConfig, epoch: u32) -> Option<String> {
    // Envoy takes one overlay: everything the agent overlays goes into it.
    let mut overlay = serde_json::Map::new();
    if let Some(path) = &config.options.outlier_log_path {
        overlay.insert(
            "cluster_manager".to_owned(),
            serde_json::json!({ "outlier_detection": { "event_log_path": path } }),
        );
    }
    let mut overload = crate::overload::Parts::default();
    if let Some(file) = crate::drain_notice::file(config, epoch) {
        overload.extend(crate::drain_notice::overlay(&file));
    }
    if let Some(guard) = &config.memory_guard {
        overload.memory(guard);
    }
    if let Some(max) = config.max_downstream_connections {
        overload.connections(max);
    }
    if !overload.is_empty() {
        overlay.insert("overload_manager".to_owned(), overload.into_json());
    }
    if let Some(admin) = admin_overlay(config) {
        overlay.insert("admin".to_owned(), admin);
    }
    (!overlay.is_empty()).then(|| serde_json::Value::Object(overlay).to_string())
}

/// Where Envoy at `epoch` writes the admin address it bound (`--admin-address-path`), when
/// the agent needs to learn it.
fn admin_address_path(config: &ProxyConfig, epoch: u32) -> Option<String> {
    match (&config.admin, &config.hot_restart) {
        (AdminAddress::FromFile(path), _) => Some(path.display().to_string()),
        (AdminAddress::Fixed(_) | AdminAddress::Socket(_), Some(hot)) => {
            if let Some(path) = &hot.ephemeral_admin {
                Some(path.display().to_string())
            } else {
                hot.admin_address_dir
                    .as_ref()
                    .map(|dir| admin_address_file(dir, epoch).display().to_string())
            }
        }
        (AdminAddress::Fixed(_) | AdminAddress::Socket(_), None) => None,
    }
}

/// The `admin` part of the agent's overlay: the agent's own socket
/// ([`AdminAddress::Socket`]); for a cold handover's new family, whose predecessor holds the
/// configured address, an ephemeral port of its IP, or a socket beside the configured one
/// ([`crate::config::ephemeral_socket`]); otherwise none (the bootstrap's).
fn admin_overlay(config: &ProxyConfig) -> Option<serde_json::Value> {
    use crate::admin::Address;
    let pipe = |path: &std::path::Path| serde_json::json!({ "address": { "pipe": { "path": path, "mode": ADMIN_SOCKET_MODE } } });
    let hot = config.hot_restart.as_ref();
    let ephemeral = hot.filter(|h| h.ephemeral_admin.is_some());
    match (&config.admin, ephemeral) {
        (AdminAddress::Fixed(Address::Tcp(addr)), Some(_)) => Some(serde_json::json!({
            "address": { "socket_address": {
                "address": addr.ip().to_string(), "port_value": 0
            } }
        })),
        (AdminAddress::Fixed(Address::Unix(path)) | AdminAddress::Socket(path), Some(hot)) => {
            Some(pipe(&crate::config::ephemeral_socket(path, hot.base_id)))
        }
        (AdminAddress::Socket(path), None) => Some(pipe(path)),
        _ => None,
    }
}

/// The mode Envoy gives its admin socket: the owner's alone (Envoy's user, and root).
pub const ADMIN_SOCKET_MODE: u32 = 0o600;

/// Whether epoch `epoch` of `config` takes over from a serving Envoy: a hot restart's child (in
/// this pod or a predecessor's), or a cold handover's new family. Such an epoch must not go
/// LIVE without its config (see [`crate::control_plane`]).
pub fn takes_over(config: &ProxyConfig, epoch: u32) -> bool {
    config
        .hot_restart
        .as_ref()
        .is_some_and(|h| epoch > 0 || h.ephemeral_admin.is_some())
}

/// Where epoch `epoch` of a hot-restart family writes its admin address, in `dir`.
pub fn admin_address_file(dir: &std::path::Path, epoch: u32) -> std::path::PathBuf {
    dir.join(format!("admin-address.{epoch}"))
}

/// `v6` only when every parseable node IP is IPv6 and there is at least one. Unparseable
/// entries are skipped. Istio answers `v6` for an empty list (`AllIPv6([])`), which makes an
/// IPv4 pod with no IPs configured bind upstream connections to IPv6; we answer `v4`.
pub fn ip_version(node_ips: &[String]) -> &'static str {
    let parsed: Vec<IpAddr> = node_ips.iter().filter_map(|ip| ip.parse().ok()).collect();
    if !parsed.is_empty() && parsed.iter().all(IpAddr::is_ipv6) {
        "v6"
    } else {
        "v4"
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::*;
    use crate::config::{DrainStrategy, HotRestart};

    fn config() -> ProxyConfig {
        ProxyConfig::new(
            PathBuf::from("/usr/bin/envoy"),
            PathBuf::from("/etc/envoy/bootstrap.yaml"),
            AdminAddress::Fixed("127.0.0.1:15000".parse().unwrap()),
        )
    }

    fn args(config: &ProxyConfig) -> Vec<String> {
        envoy_args(config, 0).args
    }

    /// The value that follows `flag`, if the flag is there.
    fn value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
        let i = args.iter().position(|a| a == flag)?;
        args.get(i + 1).map(String::as_str)
    }

    #[test]
    fn defaults_match_istio_in_order() {
        assert_eq!(
            args(&config()),
            [
                "-c",
                "/etc/envoy/bootstrap.yaml",
                "--drain-time-s",
                "45",
                "--drain-strategy",
                "immediate",
                "--local-address-ip-version",
                "v4",
                "--file-flush-interval-msec",
                "1000",
                "--disable-hot-restart",
                "--allow-unknown-static-fields",
                "-l",
                "warning",
                "--skip-deprecated-logs",
            ]
        );
    }

    #[test]
    fn drain_time_is_truncated_to_whole_seconds() {
        let mut c = config();
        c.options.drain_time = Duration::from_millis(2_900);
        assert_eq!(value(&args(&c), "--drain-time-s"), Some("2"));
    }

    #[test]
    fn drain_strategy_gradual() {
        let mut c = config();
        c.options.drain_strategy = DrainStrategy::Gradual;
        assert_eq!(value(&args(&c), "--drain-strategy"), Some("gradual"));
    }

    #[test]
    fn ip_version_v6_only_when_every_parseable_ip_is_v6() {
        let ips = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(ip_version(&ips(&["fd00::1", "::1"])), "v6");
        assert_eq!(ip_version(&ips(&["fd00::1", "not-an-ip"])), "v6");
        assert_eq!(ip_version(&ips(&["fd00::1", "10.0.0.1"])), "v4");
        assert_eq!(ip_version(&ips(&["10.0.0.1"])), "v4");
        // Istio says v6 here; an empty or useless list must not flip an IPv4 pod to IPv6.
        assert_eq!(ip_version(&ips(&[])), "v4");
        assert_eq!(ip_version(&ips(&["garbage"])), "v4");

        let mut c = config();
        c.options.node_ips = ips(&["fd00::1"]);
        assert_eq!(value(&args(&c), "--local-address-ip-version"), Some("v6"));
    }

    #[test]
    fn file_flush_interval_in_milliseconds() {
        let mut c = config();
        c.options.file_flush_interval = Duration::from_millis(250);
        assert_eq!(value(&args(&c), "--file-flush-interval-msec"), Some("250"));
    }

    #[test]
    fn hot_restart_off_disables_it() {
        let a = envoy_args(&config(), 7).args;
        assert!(a.contains(&"--disable-hot-restart".to_owned()));
        assert_eq!(value(&a, "--restart-epoch"), None);
        assert_eq!(value(&a, "--base-id"), None);
    }

    #[test]
    fn hot_restart_on_passes_epoch_base_id_and_parent_shutdown_time() {
        let mut c = config();
        c.hot_restart = Some(HotRestart {
            base_id: 42,
            parent_shutdown_time: Duration::from_secs(60),
            admin_address_dir: None,
            ephemeral_admin: None,
            socket_path: SocketPath::envoy_default(),
        });
        let a = envoy_args(&c, 3).args;
        assert!(!a.contains(&"--disable-hot-restart".to_owned()));
        assert_eq!(value(&a, "--restart-epoch"), Some("3"));
        assert_eq!(value(&a, "--base-id"), Some("42"));
        assert_eq!(value(&a, "--parent-shutdown-time-s"), Some("60"));
        assert_eq!(value(&a, "--admin-address-path"), None, "no hint asked");
    }

    #[test]
    fn a_private_channel_is_a_file_socket_path_of_mode_600() {
        let mut c = ProxyConfig::new(
            "/usr/bin/envoy".into(),
            "/etc/envoy.yaml".into(),
            AdminAddress::Fixed(std::net::SocketAddr::from(([127, 0, 0, 1], 9901)).into()),
        );
        c.hot_restart = Some(HotRestart {
            base_id: 42,
            parent_shutdown_time: Duration::from_secs(60),
            admin_address_dir: None,
            ephemeral_admin: None,
            socket_path: SocketPath::File("/var/run/envoy-agent/hot-restart/envoy".into()),
        });
        let a = envoy_args(&c, 1).args;
        assert_eq!(
            value(&a, "--socket-path"),
            Some("/var/run/envoy-agent/hot-restart/envoy")
        );
        assert_eq!(value(&a, "--socket-mode"), Some("600"));
        if let Some(hot) = &mut c.hot_restart {
            hot.socket_path = SocketPath::envoy_default();
        }
        let a = envoy_args(&c, 1).args;
        assert_eq!(value(&a, "--socket-path"), None, "Envoy's default");
        if let Some(hot) = &mut c.hot_restart {
            hot.socket_path = SocketPath::parse("@mine");
        }
        assert_eq!(
            value(&envoy_args(&c, 1).args, "--socket-path"),
            Some("@mine")
        );
    }

    #[test]
    fn each_epoch_writes_its_admin_address_to_its_own_file_when_asked() {
        let mut c = config();
        c.hot_restart = Some(HotRestart {
            base_id: 42,
            parent_shutdown_time: Duration::from_secs(60),
            admin_address_dir: Some(PathBuf::from("/run/agent")),
            ephemeral_admin: None,
            socket_path: SocketPath::envoy_default(),
        });
        assert_eq!(
            value(&envoy_args(&c, 3).args, "--admin-address-path"),
            Some("/run/agent/admin-address.3")
        );
        assert_eq!(
            value(&envoy_args(&c, 4).args, "--admin-address-path"),
            Some("/run/agent/admin-address.4")
        );
    }

    #[test]
    fn the_agents_admin_socket_is_an_overlay_and_a_cold_family_takes_one_beside_it() {
        let overlay = |c: &ProxyConfig, epoch| -> serde_json::Value {
            serde_json::from_str(value(&envoy_args(c, epoch).args, "--config-yaml").unwrap())
                .unwrap()
        };
        let mut c = config();
        c.admin = AdminAddress::Socket(PathBuf::from("/tmp/hr/7/envoy_admin_7"));
        let pipe = &overlay(&c, 0)["admin"]["address"]["pipe"];
        assert_eq!(pipe["path"], "/tmp/hr/7/envoy_admin_7");
        assert_eq!(pipe["mode"], 0o600);
        c.hot_restart = Some(HotRestart {
            base_id: 7,
            parent_shutdown_time: Duration::from_secs(60),
            admin_address_dir: Some(PathBuf::from("/run/agent")),
            ephemeral_admin: None,
            socket_path: SocketPath::envoy_default(),
        });
        // Every epoch of the family: the same socket (a child binds it after its parent
        // closed it), and the hint file as before.
        assert_eq!(
            overlay(&c, 3)["admin"]["address"]["pipe"]["path"],
            "/tmp/hr/7/envoy_admin_7"
        );
        assert_eq!(
            value(&envoy_args(&c, 3).args, "--admin-address-path"),
            Some("/run/agent/admin-address.3")
        );
        // A cold handover's new family, on base id 8, while the old one holds the socket.
        if let Some(hot) = &mut c.hot_restart {
            hot.base_id = 8;
            hot.ephemeral_admin = Some(PathBuf::from("/run/agent/cold-admin-address.8"));
        }
        assert_eq!(
            overlay(&c, 0)["admin"]["address"]["pipe"]["path"],
            "/tmp/hr/7/envoy_admin_7.8"
        );
        assert_eq!(
            value(&envoy_args(&c, 0).args, "--admin-address-path"),
            Some("/run/agent/cold-admin-address.8")
        );
        // A bootstrap's own TCP admin gets no admin overlay but the cold family's port 0.
        let c = config();
        assert!(
            value(&envoy_args(&c, 0).args, "--config-yaml")
                .is_none_or(|o| !o.contains("\"admin\""))
        );
    }

    #[test]
    fn file_flush_min_size_only_when_set() {
        let mut c = config();
        assert_eq!(value(&args(&c), "--file-flush-min-size-kb"), None);
        c.file_flush_min_size_kb = 64;
        assert_eq!(value(&args(&c), "--file-flush-min-size-kb"), Some("64"));
    }

    #[test]
    fn log_level_split_into_global_and_components() {
        let mut c = config();
        c.options.log_level = "info,upstream:debug,debug,http:trace".to_owned();
        let a = args(&c);
        assert_eq!(value(&a, "-l"), Some("debug"), "last global token wins");
        assert_eq!(
            value(&a, "--component-log-level"),
            Some("upstream:debug,http:trace")
        );
    }

    #[test]
    fn log_level_tokens_with_two_colons_are_dropped_with_a_warning() {
        let mut c = config();
        c.options.log_level = "info,a:b:c".to_owned();
        let built = envoy_args(&c, 0);
        assert_eq!(value(&built.args, "-l"), Some("info"));
        assert_eq!(value(&built.args, "--component-log-level"), None);
        assert_eq!(built.warnings.len(), 1);
        assert!(built.warnings[0].contains("a:b:c"), "{:?}", built.warnings);
    }

    #[test]
    fn component_only_log_level_keeps_default_global() {
        let mut c = config();
        c.options.log_level = "upstream:debug".to_owned();
        let a = args(&c);
        assert_eq!(value(&a, "-l"), Some("warning"));
        assert_eq!(value(&a, "--component-log-level"), Some("upstream:debug"));
    }

    #[test]
    fn deprecated_component_log_level_used_only_when_log_level_has_none() {
        let mut c = config();
        c.options.component_log_level = "misc:error".to_owned();
        assert_eq!(
            value(&args(&c), "--component-log-level"),
            Some("misc:error")
        );
        c.options.log_level = "info,http:debug".to_owned();
        assert_eq!(
            value(&args(&c), "--component-log-level"),
            Some("http:debug")
        );
    }

    #[test]
    fn a_level_set_at_run_time_wins_for_every_later_envoy() {
        let mut c = config();
        c.options.log_level = "info,upstream:debug".to_owned();
        let later = c.clone();
        c.log_level_set
            .set(crate::log_level::LogLevel::parse("debug,http:trace").unwrap());
        let a = args(&later);
        assert_eq!(value(&a, "-l"), Some("debug"));
        assert_eq!(value(&a, "--component-log-level"), Some("http:trace"));
    }

    #[test]
    fn log_as_json_sets_a_json_log_format() {
        let mut c = config();
        assert_eq!(value(&args(&c), "--log-format"), None);
        c.options.log_as_json = true;
        assert_eq!(value(&args(&c), "--log-format"), Some(JSON_LOG_FORMAT));
    }

    #[test]
    fn skip_deprecated_logs_and_core_dump_are_switches() {
        let mut c = config();
        c.skip_deprecated_logs = false;
        c.enable_core_dump = true;
        let a = args(&c);
        assert!(!a.contains(&"--skip-deprecated-logs".to_owned()));
        assert!(a.contains(&"--enable-core-dump".to_owned()));
    }

    #[test]
    fn outlier_log_path_becomes_a_bootstrap_overlay() {
        let mut c = config();
        c.options.outlier_log_path = Some(PathBuf::from("/var/log/outlier \"x\".log"));
        let a = args(&c);
        let overlay: serde_json::Value =
            serde_json::from_str(value(&a, "--config-yaml").unwrap()).unwrap();
        assert_eq!(
            overlay["cluster_manager"]["outlier_detection"]["event_log_path"],
            "/var/log/outlier \"x\".log"
        );
    }

    #[test]
    fn concurrency_only_when_positive() {
        let mut c = config();
        assert_eq!(value(&args(&c), "--concurrency"), None);
        c.options.concurrency = 2;
        assert_eq!(value(&args(&c), "--concurrency"), Some("2"));
    }

    #[test]
    fn admin_port_zero_asks_envoy_for_the_address_file() {
        let mut c = config();
        assert_eq!(value(&args(&c), "--admin-address-path"), None);
        c.admin = AdminAddress::FromFile(PathBuf::from("/run/agent/admin"));
        assert_eq!(
            value(&args(&c), "--admin-address-path"),
            Some("/run/agent/admin")
        );
    }

    #[test]
    fn extra_args_that_repeat_an_agent_flag_win() {
        let mut c = config();
        c.options.log_as_json = true;
        c.options.concurrency = 2;
        c.extra_args = vec![
            "-l".into(),
            "debug".into(),
            "--drain-strategy=gradual".into(),
            "--concurrency".into(),
            "4".into(),
            "--log-format".into(),
            "%v".into(),
            "--disable-hot-restart".into(),
            "--file-flush-interval-msec".into(),
            "500".into(),
            "--local-address-ip-version".into(),
            "v6".into(),
        ];
        let a = args(&c);
        for flag in [
            "-l",
            "--concurrency",
            "--log-format",
            "--disable-hot-restart",
            "--file-flush-interval-msec",
            "--local-address-ip-version",
        ] {
            assert_eq!(
                a.iter().filter(|x| *x == flag).count(),
                1,
                "{flag} given once: {a:?}"
            );
        }
        assert_eq!(value(&a, "-l"), Some("debug"), "theirs");
        assert_eq!(value(&a, "--concurrency"), Some("4"));
        assert!(
            !a.contains(&"--drain-strategy".to_owned()),
            "theirs as --x=y: {a:?}"
        );
        assert_eq!(refused_extra_arg(&c), None);
    }

    #[test]
    fn extra_args_that_would_break_a_guarantee_are_refused() {
        let mut c = config();
        c.extra_args = vec!["-c".into(), "other.yaml".into()];
        assert_eq!(refused_extra_arg(&c).unwrap().flag, "-c");
        c.extra_args = vec!["--restart-epoch=3".into()];
        assert_eq!(refused_extra_arg(&c).unwrap().flag, "--restart-epoch");
        c.extra_args = vec!["--drain-time-s".into(), "3".into()];
        assert_eq!(refused_extra_arg(&c), None, "no hot restart: theirs wins");
        c.hot_restart = Some(HotRestart {
            base_id: 1,
            parent_shutdown_time: Duration::from_secs(60),
            admin_address_dir: None,
            ephemeral_admin: None,
            socket_path: SocketPath::envoy_default(),
        });
        let refused = refused_extra_arg(&c).unwrap();
        assert_eq!(refused.flag, "--drain-time-s");
        assert!(refused.instead.contains("--drain-time"), "{refused:?}");
        c.extra_args = vec!["--base-id".into(), "9".into()];
        assert_eq!(refused_extra_arg(&c).unwrap().flag, "--base-id");
        c.extra_args = vec!["--disable-hot-restart".into()];
        assert_eq!(refused_extra_arg(&c).unwrap().flag, "--disable-hot-restart");
        c.extra_args = vec!["--config-yaml".into(), "{}".into()];
        assert_eq!(refused_extra_arg(&c), None);
        c.options.outlier_log_path = Some(PathBuf::from("/tmp/o"));
        assert_eq!(refused_extra_arg(&c).unwrap().flag, "--config-yaml");
    }

    #[test]
    fn extra_args_come_last_verbatim() {
        let mut c = config();
        c.extra_args = vec!["--service-cluster".into(), "edge".into()];
        let a = args(&c);
        assert_eq!(&a[a.len() - 2..], ["--service-cluster", "edge"]);
    }
}
