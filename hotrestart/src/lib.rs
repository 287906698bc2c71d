//! The hot-restart supervisor: Envoy's restart epochs without dropped connections and without
//! the outages of `hot-restarter.py`.
//!
//! # Theory of operation
//!
//! One actor task ([`Supervisor::run`]) owns every Envoy process of the family (one per restart
//! epoch) and publishes a [`SupervisorState`] on a `watch` channel; [`SupervisorHandle`]s ask
//! it for hot restarts and read the state. The rules come from Envoy's protocol
//! (`shared/design.md` §1):
//!
//! - **Start**: epoch 0, LIVE within the handoff deadline, or the supervisor gives up.
//! - **Trigger** (SIGHUP, a config change seen by the [`watch`] module, a handle call): queued.
//!   A queued restart starts only when no handoff is under way *and* no parent is still
//!   draining, so at most two generations ever exist; every trigger queued meanwhile is
//!   coalesced into that one restart and shares its outcome.
//! - **Pre-flight**: the binary's `--hot-restart-version` must equal the running one, and
//!   `envoy --mode validate` must accept the config. A failure rejects the restart with
//!   Envoy's own words; nothing is started, the serving epoch keeps serving.
//! - **Handoff**: the next epoch is exactly the newest LIVE epoch + 1 (a failed attempt is
//!   retried with the same number). It is LIVE when the shared admin port reports LIVE at that
//!   epoch; its parent is then draining and will be terminated by its child after
//!   `--parent-shutdown-time` (exit 0: expected). The readiness marker exists exactly while the
//!   newest epoch is LIVE.
//! - **Failure**: a new epoch that exits, or is not LIVE within the handoff deadline (it is
//!   then stopped), leaves the old epoch serving. If it died while initializing it leaves
//!   Envoy's shared INITIALIZING flag set, which would fail every later hot restart
//!   ("previous envoy process is still initializing"): the supervisor clears the stale flag
//!   (see [`shm`]), records a `stale_initializing` wedge and goes on. If the failed child had
//!   already shut its parent's admin listener, the restart is retried (same epoch, up to three
//!   times) since only a LIVE child gives the family an admin endpoint back.
//! - **Deaths**: the newest LIVE epoch exiting ends the supervisor with its code (the pod
//!   restarts). A draining parent dying early does not: the supervisor binds the dead parent's
//!   hot-restart sockets ([`absorber`]) so that its child, which still talks to it, keeps
//!   serving instead of aborting.
//! - **Watchdogs**: the handoff deadline, and the serving epoch's admin API silent for longer
//!   than its deadline: a wedge, logged with its reason, exit code [`EXIT_WEDGED`].
//! - **Stop**: cancelling `run`'s token removes the marker and stops every epoch, newest first
//!   (SIGTERM, SIGKILL after the grace), bounded; nothing is left running.

pub mod absorber;
pub mod metrics;
pub mod node;
pub mod shm;
pub mod state;
mod supervisor;
pub mod watch;

pub use state::{
    EpochInfo, EpochState, Handoff, HandoffResult, Outcome, Phase, SupervisorState, Wedge,
    WedgeReason,
};
pub use supervisor::{
    Config, ConfigError, EXIT_WEDGED, RestartError, Supervisor, SupervisorExit, SupervisorHandle,
};
