//! The hot-restart supervisor: a family of Envoy restart epochs behind the [`Proxy`] trait
//! ([`EnvoyFamily`]), without the outages of `hot-restarter.py`.
//!
//! [`Proxy`]: envoy_agent_proxy::Proxy
//!
//! # Theory of operation
//!
//! One actor task (the supervisor, run by [`EnvoyFamily`]'s `run`) owns every Envoy process
//! of the family, one per restart epoch, and publishes a typed
//! [`ProxyState`](envoy_agent_proxy::ProxyState) on a `watch` channel; [`SupervisorHandle`]s
//! send it commands that resolve once applied. Everything it does outside its memory goes
//! through a [`Host`] (the real one, or the unit tests' fake). The rules come from Envoy's
//! hot-restart protocol (the whole flow: "How a hot restart flows" in `ARCHITECTURE.md`):
//!
//! - **First epoch**: with a state directory, under the node's epoch lock, the supervisor
//!   looks for a LIVE Envoy of its family ([`node`] heartbeats plus the shared admin port) and
//!   takes over from it at its epoch + 1, or starts at epoch 0 when nothing answers; never
//!   epoch 0 while something answers on the admin port. The first epoch goes through the same
//!   pre-flight as every restart.
//! - **Trigger** (SIGHUP, a config change seen by the [`watch`] module, a handle call): queued.
//!   A queued restart starts only when no handoff is under way, no parent drains and the
//!   node's epoch lock is free (no successor pod is starting), so at most two generations ever
//!   exist; every trigger queued meanwhile is coalesced into that one restart.
//! - **Pre-flight**: the binary's `--hot-restart-version` must equal the running one, and
//!   `envoy --mode validate` must accept the config. A failure rejects the restart with
//!   Envoy's own words; nothing is started, the serving epoch keeps serving. Verdicts are kept
//!   per (binary, config) pair ([`preflight_cache`], shared with the family's config updates),
//!   so a pair already judged, or already serving, execs nothing before Envoy itself.
//! - **Handoff** ([`handoff`]): the next epoch is exactly the newest LIVE epoch + 1 (a failed
//!   attempt is retried with the same number). It is LIVE when the shared admin port reports
//!   LIVE at that epoch, from a process no older than ours; its parent then drains and is
//!   terminated by its child after `--parent-shutdown-time`. One that outlives that time by
//!   a grace is killed and stood in for. The readiness marker exists exactly while our newest
//!   epoch is LIVE.
//! - **Failure**: a new epoch that exits, or is not LIVE within the handoff deadline (then
//!   SIGKILL: Envoy's SIGTERM handler would also terminate its serving parent), leaves the old
//!   epoch serving. A stale INITIALIZING flag it left is cleared ([`shm`], found from the
//!   segment's own header). If it had shut the serving epoch's admin listener, the restart is
//!   retried (same epoch, up to three times): only a LIVE child gives an admin back.
//! - **Deaths**: a parent that dies while its child still talks to it (draining, or the
//!   serving epoch dying while its successor starts) is stood in for ([`absorber`]), so the
//!   child keeps serving. The serving epoch exiting with no successor ends the family with
//!   its code (never 0: a serving Envoy killed from outside is a failure). `run` may then be
//!   called again (the agent's crash recovery): a fresh family, started as the first was
//!   (discovery, then epoch 0), with the old one's history.
//! - **Cross-pod**: the node's other heartbeats are read every period; a starting successor
//!   makes the watchdog look at the admin port often, and its Envoy answering at a newer epoch
//!   is a handover: marker removed, ours drain until the successor terminates them. A stop
//!   asks [`SupervisorHandle::successor`] first (fresh facts).
//! - **Watchdogs**: the handoff deadline (it kills only once a LIVE check sent after it says
//!   "not LIVE": a stalled agent's late timer must not kill an epoch that went LIVE
//!   meanwhile); the serving epoch's admin API silent (not refused: that is a lost listener,
//!   recovered by a restart) for longer than its deadline, by a check sent after it: a wedge.
//!   An admin call the agent itself could not make (no descriptor, no memory) is no fact of
//!   Envoy's and counts for neither.
//!   The steady check (every second) is `/ready` over an admin connection the host keeps and
//!   renews every [`host::KEPT_CONNECTION_RENEWAL`] with a `/server_info` (who answers): a
//!   kept connection reaches the process that accepted it, so what it cannot see (a
//!   takeover) is seen at the renewal, and while a successor announces itself every check
//!   opens a new one. Neither costs Envoy more on a larger config.
//! - **Stop**: cancelling `run`'s token removes the marker and stops every epoch, newest
//!   first: SIGKILL for one that is not LIVE and may have a living parent, SIGTERM otherwise,
//!   SIGKILL to what is left after the grace; bounded; nothing is left running.

pub mod absorber;
mod admin_files;
mod answers;
mod config;
#[cfg(test)]
mod decisions;
mod discovery;
mod epochs;
mod family;
pub mod handoff;
pub mod host;
pub mod metrics;
pub mod node;
pub mod preflight_cache;
mod probing;
pub mod shm;
mod supervisor;
#[cfg(test)]
mod testing;
pub mod watch;

pub use answers::FamilyError;
pub use config::{Config, ConfigError, FamilyOptions, check, unique_identity};
pub use envoy_agent_proxy::{EXIT_WEDGED, RestartError};
pub use family::{EnvoyFamily, SupervisorHandle};
pub use host::{Host, RealHost};
