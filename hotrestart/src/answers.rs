//! What the family answers a drain or a request to fail its health checks, and where those
//! requests wait while a handoff may still move the admin listener.
//!
//! A request asked while an epoch or a cold family starts is held by that handoff
//! ([`Deferred`], inside `Handoff::Starting` and `Handoff::Cold`) and leaves with it: once the
//! handoff settles (LIVE, failed, or made moot by a successor's takeover) the supervisor sends
//! it to whichever Envoy serves then; when the family stops instead, [`Deferred::not_serving`]
//! answers it. Dropping a `Deferred` drops its reply channels: the caller then hears
//! [`FamilyError::Gone`], never silence.

use std::sync::Arc;

use envoy_agent_proxy::{AdminError, DrainOptions, DrainPlan};
use tokio::sync::oneshot;

/// Why the family did not do what it was asked: a drain, or failing its health checks.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum FamilyError {
    /// The supervisor has ended: nothing is left to ask.
    #[error("the supervisor is gone")]
    Gone,
    /// The serving Envoy's admin API refused or failed the call (shared: one call answers
    /// every request that waited for it).
    #[error(transparent)]
    Admin(Arc<AdminError>),
}

/// Where a drain's answer goes: what it reached, or why it failed.
pub(crate) type DrainReply = oneshot::Sender<Result<DrainPlan, FamilyError>>;
/// Where the answer to failing the health checks goes.
pub(crate) type HealthChecksReply = oneshot::Sender<Result<(), FamilyError>>;

/// Drains and health-check failures asked while a handoff is under way, held by it until it
/// settles.
#[derive(Debug, Default)]
pub(crate) struct Deferred {
    /// Each drain asked, with its options; one call answers them all (the first one's
    /// options, as a drain already under way would).
    pub(crate) drains: Vec<(DrainOptions, DrainReply)>,
    pub(crate) health_checks: Vec<HealthChecksReply>,
}

impl Deferred {
    /// The family stops before the handoff settled: nothing of ours serves to drain, and
    /// nothing will answer a health check.
    pub(crate) fn not_serving(self) {
        for (options, reply) in self.drains {
            let _ = reply.send(Ok(DrainPlan::not_serving(options.listeners)));
        }
        for reply in self.health_checks {
            let _ = reply.send(Ok(()));
        }
    }
}
