//! The process exit codes of `envoy-agent`, every subcommand: the one place they are named.
//! [`TABLE`] says what each means; `docs/operations.md` ("Exit codes") shows it, generated
//! from it and checked by a test (`UPDATE_FLAG_DOCS=1 cargo test -p envoy-agent --test e2e
//! flag_reference` rewrites it).
//!
//! The numbers are the BSD `sysexits.h` ones, which supervisors (systemd's
//! `RestartPreventExitStatus=`, a pod's restart policy) and scripts already know how to read.

/// Every exit code of `envoy-agent run` and what leads to it, then the client subcommands':
/// `(code, meaning)` as the docs' table shows them.
pub const TABLE: &[(&str, &str)] = &[
    (
        "0",
        "the agent was told to stop (SIGTERM/SIGINT, `Stop`, `/quitquitquit`) and stopped Envoy (also during a crash back-off), or a successor pod took over and terminated it",
    ),
    (
        "Envoy's code",
        "Envoy (the serving epoch) exited on its own (0 after Envoy's own `/quitquitquit`, hot restart off)",
    ),
    (
        "128+N",
        "Envoy died from signal N (137: SIGKILL; exit path `oom_killed` when the container's OOM killer sent it, as its cgroup counts, `proxy_exited` otherwise)",
    ),
    (
        "the crash's code",
        "`--restart-on-crash`: Envoy crashed again after `--crash-restart-limit` restarts in a row (exit path `crash_loop`; 1 when the last restart never started, 128+N for signal N); before that a crash does not end the agent",
    ),
    (
        "1",
        "hot restart: the serving Envoy exited 0 while no other epoch served and no successor took over (terminated from outside, e.g. by another pod's failed epoch): never reported as success; or the first epoch never started (pre-flight rejected the bootstrap, no turn on the node). Either mode: Envoy never accepted the shutdown's drain request, asked each second until the deadline (its admin silent, the agent out of descriptors): stopped without a drain (exit path `drain_failed`)",
    ),
    (
        "64",
        "bad input, which the user can fix in the command line or files: missing or unreadable bootstrap, bootstrap without an admin address, no Envoy binary (or one this user may not execute, or a script whose interpreter is missing), a bad flag value, a refused extra Envoy argument, an untrusted socket or state directory, another agent serving on the gRPC socket; one line on stderr names it. Do not restart blindly: fix the input",
    ),
    (
        "69",
        "a resource that may come back is unavailable: the status address (or a TCP gRPC address) is in use; supervisors retry it, with back-off (the systemd unit's `RestartPreventExitStatus=64` does not stop it)",
    ),
    (
        "70",
        "the agent itself failed (e.g. cannot start Envoy for another reason); the message says why",
    ),
    (
        "75",
        "wedged: the serving Envoy's admin API stopped answering for `--admin-unresponsive-deadline` (both modes), or, with hot restart, epoch 0 never became LIVE; the reason is logged",
    ),
    (
        "client: 0",
        "a client subcommand (`status`, `stop`, `drain`, `wait`, ...): the call succeeded",
    ),
    (
        "client: 1",
        "the agent refused or failed the call (the message says why); `wait`: not ready by its timeout",
    ),
    ("client: 64", "bad input: a flag or its value"),
    ("client: 69", "no agent answers at the gRPC address"),
];

/// [`TABLE`] as the Markdown table the docs show.
pub fn markdown_table() -> String {
    let mut out = String::from("| code | meaning |\n|---|---|\n");
    for (code, meaning) in TABLE {
        out.push_str(&format!("| {code} | {meaning} |\n"));
    }
    out
}

/// `EX_USAGE`: the command was used incorrectly (bad flag, bootstrap, binary, address); a
/// restart with the same input fails the same way.
pub const USAGE: u8 = 64;

/// `EX_UNAVAILABLE`: a resource is not available now but may come back, so a supervisor
/// should retry: the status or gRPC address is in use (`run`), or nothing answers at the
/// agent's gRPC address (client subcommands).
pub const UNAVAILABLE: u8 = 69;

/// `EX_SOFTWARE`: the agent failed, not its input: it could not run Envoy at all, or an
/// internal error ended it.
pub const SOFTWARE: u8 = 70;

/// `EX_TEMPFAIL`: the serving Envoy was found wedged (its admin API silent past
/// `--admin-unresponsive-deadline`, in both modes; with hot restart, also a new epoch stuck)
/// and the agent gave up on it: restart the agent. Named by the proxy crate, which decides it.
pub use envoy_agent_proxy::EXIT_WEDGED as WEDGED;

/// The generic failure, no `sysexits.h` code: a client call the agent refused or failed;
/// `run`: a shutdown whose drain request Envoy never accepted (exit path `drain_failed`).
pub const FAILURE: u8 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_code_is_in_the_table() {
        for code in [FAILURE, USAGE, UNAVAILABLE, SOFTWARE, WEDGED] {
            assert!(
                TABLE.iter().any(|(c, _)| *c == code.to_string()),
                "{code} is not in the table"
            );
        }
    }
}
