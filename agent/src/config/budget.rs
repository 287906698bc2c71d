//! `--shutdown-budget`: the one deadline from SIGTERM to the agent's exit (a pod's
//! `terminationGracePeriodSeconds`), split over the shutdown's phases at start.
//!
//! A shutdown is, in order: the drain delay (readiness off, Envoy serving), the drain (for the
//! termination drain duration, or with exit-on-zero until zero at the latest then), the stop
//! (SIGTERM, SIGKILL after the stop grace), and the agent's own exit (its servers closing,
//! bounded by [`crate::SHUTDOWN_GRACE`]). The delay, the stop grace and the exit are taken as
//! configured; the drain gets what is left unless `--termination-drain-duration` is given, in
//! which case it must fit. A node proxy stopped while a successor pod takes over waits for the
//! successor's Envoy to terminate its own, up to `--parent-shutdown-time` after the takeover:
//! that wait must fit too, and is bounded by the budget. Whatever cannot fit is refused at
//! start (exit 64), naming the flags, rather than cut short by the kubelet's SIGKILL.

use std::time::Duration;

/// What the split starts from: the shutdown's settings as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Phases {
    /// `--drain-delay`.
    pub drain_delay: Duration,
    /// `--termination-drain-duration`, when given.
    pub termination_drain_duration: Option<Duration>,
    /// `--minimum-drain-duration`, when exit-on-zero counts (its wait needs a deadline past
    /// it: the budget leaves no room for "until zero, however long").
    pub exit_on_zero_minimum: Option<Duration>,
    /// `--stop-grace`.
    pub stop_grace: Duration,
    /// The agent's own exit once Envoy is gone.
    pub exit: Duration,
    /// Node proxy: `--parent-shutdown-time` (how long a successor's Envoy may take to
    /// terminate ours after it took over).
    pub handover: Option<Duration>,
}

/// How the budget was split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// The whole budget.
    pub budget: Duration,
    /// The drain delay (as configured).
    pub drain_delay: Duration,
    /// The drain: the termination drain duration in force.
    pub drain: Duration,
    /// The stop grace (as configured).
    pub stop_grace: Duration,
    /// Kept for the agent's exit.
    pub exit: Duration,
    /// Node proxy: the longest wait for a successor's Envoy to terminate ours.
    pub handover: Option<Duration>,
}

/// A phase that cannot fit the budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetError {
    /// The fixed phases alone take the whole budget.
    #[error(
        "--shutdown-budget {budget:?} leaves no time to drain: --drain-delay {drain_delay:?}, \
         --stop-grace {stop_grace:?} and the agent's exit ({exit:?}) take it all"
    )]
    NoRoomToDrain {
        /// The budget.
        budget: Duration,
        /// `--drain-delay`.
        drain_delay: Duration,
        /// `--stop-grace`.
        stop_grace: Duration,
        /// The agent's exit.
        exit: Duration,
    },
    /// The termination drain duration given does not fit.
    #[error(
        "--termination-drain-duration {asked:?} does not fit --shutdown-budget {budget:?}: at \
         most {room:?} is left after --drain-delay, --stop-grace and the agent's exit ({exit:?}); \
         leave it out to drain for what the budget leaves"
    )]
    DrainTooLong {
        /// What was given.
        asked: Duration,
        /// What is left for it.
        room: Duration,
        /// The budget.
        budget: Duration,
        /// The agent's exit.
        exit: Duration,
    },
    /// Exit-on-zero's minimum drain is not shorter than the drain's deadline.
    #[error(
        "--minimum-drain-duration {minimum:?} is not shorter than the drain's deadline \
         ({drain:?}) under --shutdown-budget {budget:?}: exit-on-zero would never count"
    )]
    MinimumTooLong {
        /// `--minimum-drain-duration`.
        minimum: Duration,
        /// The drain's deadline.
        drain: Duration,
        /// The budget.
        budget: Duration,
    },
    /// A node proxy's handover wait does not fit.
    #[error(
        "--parent-shutdown-time {parent_shutdown:?} does not fit --shutdown-budget {budget:?}: \
         a pod stopped while its successor takes over waits that long for the successor's Envoy \
         to terminate its own, then --stop-grace {stop_grace:?} and the agent's exit \
         ({exit:?}); at most {room:?}"
    )]
    HandoverTooLong {
        /// `--parent-shutdown-time`.
        parent_shutdown: Duration,
        /// What is left for it.
        room: Duration,
        /// The budget.
        budget: Duration,
        /// `--stop-grace`.
        stop_grace: Duration,
        /// The agent's exit.
        exit: Duration,
    },
}

/// Fits `phases` into `budget`.
pub fn split(budget: Duration, phases: Phases) -> Result<Split, BudgetError> {
    let Phases {
        drain_delay,
        termination_drain_duration,
        exit_on_zero_minimum,
        stop_grace,
        exit,
        handover,
    } = phases;
    let room = budget
        .checked_sub(drain_delay + stop_grace + exit)
        .filter(|room| !room.is_zero())
        .ok_or(BudgetError::NoRoomToDrain {
            budget,
            drain_delay,
            stop_grace,
            exit,
        })?;
    let drain = match termination_drain_duration {
        Some(asked) if asked > room => {
            return Err(BudgetError::DrainTooLong {
                asked,
                room,
                budget,
                exit,
            });
        }
        Some(asked) => asked,
        None => room,
    };
    if let Some(minimum) = exit_on_zero_minimum.filter(|m| *m >= drain) {
        return Err(BudgetError::MinimumTooLong {
            minimum,
            drain,
            budget,
        });
    }
    let handover = match handover {
        Some(parent_shutdown) => {
            // The wait starts at SIGTERM, no drain delay before it.
            let room = budget.saturating_sub(stop_grace + exit);
            if parent_shutdown > room {
                return Err(BudgetError::HandoverTooLong {
                    parent_shutdown,
                    room,
                    budget,
                    stop_grace,
                    exit,
                });
            }
            Some(room)
        }
        None => None,
    };
    Ok(Split {
        budget,
        drain_delay,
        drain,
        stop_grace,
        exit,
        handover,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn sidecar() -> Phases {
        Phases {
            drain_delay: S(5),
            termination_drain_duration: None,
            exit_on_zero_minimum: None,
            stop_grace: S(5),
            exit: S(2),
            handover: None,
        }
    }

    #[test]
    fn the_drain_gets_what_the_other_phases_leave() {
        let split = split(S(45), sidecar()).unwrap();
        assert_eq!((split.drain, split.handover), (S(33), None));
        assert_eq!(
            split.drain_delay + split.drain + split.stop_grace + split.exit,
            S(45)
        );
    }

    #[test]
    fn a_given_drain_that_fits_is_kept_and_one_that_does_not_is_refused() {
        let given = |d| Phases {
            termination_drain_duration: Some(d),
            ..sidecar()
        };
        assert_eq!(split(S(45), given(S(20))).unwrap().drain, S(20));
        assert_eq!(split(S(45), given(S(33))).unwrap().drain, S(33));
        let err = split(S(45), given(S(34))).unwrap_err();
        assert!(matches!(err, BudgetError::DrainTooLong { room, .. } if room == S(33)));
        assert!(
            err.to_string().contains("--termination-drain-duration"),
            "{err}"
        );
    }

    #[test]
    fn fixed_phases_that_take_the_whole_budget_are_refused() {
        for budget in [S(12), S(11), S(1)] {
            let err = split(budget, sidecar()).unwrap_err();
            assert!(matches!(err, BudgetError::NoRoomToDrain { .. }), "{err}");
            assert!(err.to_string().contains("--shutdown-budget"), "{err}");
        }
    }

    #[test]
    fn exit_on_zero_needs_its_minimum_before_the_deadline() {
        let counting = |minimum| Phases {
            exit_on_zero_minimum: Some(minimum),
            ..sidecar()
        };
        assert!(split(S(45), counting(S(5))).is_ok());
        let err = split(S(20), counting(S(8))).unwrap_err();
        assert!(matches!(err, BudgetError::MinimumTooLong { .. }), "{err}");
        assert!(
            err.to_string().contains("--minimum-drain-duration"),
            "{err}"
        );
    }

    #[test]
    fn a_node_proxys_handover_wait_must_fit() {
        let node = |parent| Phases {
            drain_delay: S(0),
            handover: Some(parent),
            ..sidecar()
        };
        let split = split(S(90), node(S(60))).unwrap();
        assert_eq!((split.drain, split.handover), (S(83), Some(S(83))));
        let err = super::split(S(60), node(S(60))).unwrap_err();
        assert!(matches!(err, BudgetError::HandoverTooLong { room, .. } if room == S(53)));
        assert!(err.to_string().contains("--parent-shutdown-time"), "{err}");
    }
}
