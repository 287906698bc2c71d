//! The process exit codes of `envoy-agent`, every subcommand: the one place they are named.
//!
//! | code | when |
//! |---|---|
//! | 0 | `run`: Envoy stopped as asked (drained, handed over, quit); a client subcommand: the call succeeded |
//! | 1 | a client subcommand: the agent refused or failed the call (the message says why); `run`: a shutdown drain failed, or Envoy exited with a code that is no exit code |
//! | Envoy's own | `run`: Envoy ended on its own (128+N for signal N): the agent passes its code on |
//! | [`USAGE`] (64) | bad input: a flag, its value, the bootstrap, the Envoy binary, an address |
//! | [`UNAVAILABLE`] (69) | something needed is not there now but may come back: `run`'s port in use, a client's agent not reachable |
//! | [`SOFTWARE`] (70) | the agent itself failed, or could not run Envoy at all |
//! | [`WEDGED`] (75) | `run`: the serving Envoy wedged (its admin API silent past `--admin-unresponsive-deadline`, or, with `--hot-restart`, a new epoch stuck) and the agent gave up on it |
//!
//! The numbers are the BSD `sysexits.h` ones, which supervisors (systemd's
//! `RestartPreventExitStatus=`, a pod's restart policy) and scripts already know how to read.

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
