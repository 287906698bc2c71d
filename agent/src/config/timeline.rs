//! The shutdown's timeline: when, after the signal (SIGTERM, SIGINT, gRPC `Stop`), readiness
//! goes off, Envoy fails its health checks, the drain starts and Envoy is stopped at the
//! latest. Each offset is the operator's (`--not-ready-at`, `--healthcheck-fail-at`,
//! `--drain-delay`; the stop follows from the drain's deadline, `--termination-drain-duration`
//! or what `--shutdown-budget` leaves), fitted once at start ([`fit`]): a step that would come
//! after Envoy's latest stop is refused (exit 64), naming the flags, rather than silently never
//! taken.
//!
//! Load balancers see a pod go in three ways, which these steps turn off one by one:
//! Kubernetes' endpoints (readiness), health checks sent through Envoy (an HTTP `health_check`
//! filter, which answers 503 once Envoy's health checks fail), and connections (the drain).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use envoy_agent_drain::Counting;

use crate::config::duration::parse_duration;

/// When Envoy is told to fail its health checks (`--healthcheck-fail-at`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthCheckFailAt {
    /// Never: Envoy's health checks pass until it stops.
    Off,
    /// When the drain starts (`--drain-delay` after the signal).
    Drain,
    /// This long after the signal.
    After(Duration),
}

impl FromStr for HealthCheckFailAt {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "off" => Ok(HealthCheckFailAt::Off),
            "drain" => Ok(HealthCheckFailAt::Drain),
            other => parse_duration(other)
                .map(HealthCheckFailAt::After)
                .map_err(|e| format!("{e}; or `drain` (when the drain starts), or `off`")),
        }
    }
}

impl fmt::Display for HealthCheckFailAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HealthCheckFailAt::Off => f.write_str("off"),
            HealthCheckFailAt::Drain => f.write_str("drain"),
            HealthCheckFailAt::After(d) => f.write_str(&span(*d)),
        }
    }
}

/// A sidecar's app rule (`--app-hold`): how long after the signal, at most, Envoy keeps
/// serving an app that still holds connections to its outbound listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppHold {
    /// Envoy is stopped on the drain's clock, whatever the app does.
    Off,
    /// At most this long after the signal.
    For(Duration),
}

impl FromStr for AppHold {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "off" => Ok(AppHold::Off),
            other => parse_duration(other)
                .map(AppHold::For)
                .map_err(|e| format!("{e}; or `off`")),
        }
    }
}

impl fmt::Display for AppHold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AppHold::Off => f.write_str("off"),
            AppHold::For(d) => f.write_str(&span(*d)),
        }
    }
}

/// How long after the drain starts Envoy is stopped at the latest: the termination drain
/// duration, except in exit-on-zero mode when it is not longer than the minimum (nothing would
/// ever be counted): then there is none, and the agent counts until zero (Istio's behaviour).
pub fn drain_deadline(
    exit_on_zero: Option<Counting>,
    termination_drain_duration: Duration,
    minimum_drain_duration: Duration,
) -> Option<Duration> {
    match exit_on_zero {
        Some(_) if termination_drain_duration <= minimum_drain_duration => None,
        _ => Some(termination_drain_duration),
    }
}

/// What the timeline is fitted from: the steps as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Steps {
    /// `--not-ready-at`.
    pub not_ready: Duration,
    /// `--healthcheck-fail-at`.
    pub fail_health_checks: HealthCheckFailAt,
    /// `--drain-delay`: when the drain starts.
    pub drain: Duration,
    /// The drain's deadline after it starts ([`drain_deadline`]); none: exit-on-zero counts
    /// until zero, however long.
    pub drain_deadline: Option<Duration>,
    /// `--shutdown-budget`, when given (it set the drain's deadline: named in a refusal).
    pub budget: Option<Duration>,
}

/// The shutdown's timeline: each step's offset from the signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeline {
    /// Readiness (and gRPC health) off.
    pub not_ready: Duration,
    /// Envoy fails its health checks; none: never.
    pub fail_health_checks: Option<Duration>,
    /// The drain request.
    pub drain: Duration,
    /// Envoy is stopped at the latest (exit-on-zero may stop it sooner); none: exit-on-zero
    /// without a deadline.
    pub stop_by: Option<Duration>,
}

impl Default for Timeline {
    /// Today's order with the defaults: readiness off and the drain at the signal, health
    /// checks failing with the drain, the stop 5 s later.
    fn default() -> Self {
        Timeline {
            not_ready: Duration::ZERO,
            fail_health_checks: Some(Duration::ZERO),
            drain: Duration::ZERO,
            stop_by: Some(crate::config::defaults::TERMINATION_DRAIN_DURATION),
        }
    }
}

impl Timeline {
    /// The steps in the order they come (ties in the order the agent takes them: readiness,
    /// health checks, drain), each with its offset; the stop last when it has a deadline.
    pub fn steps(&self) -> Vec<(Step, Duration)> {
        let mut steps = vec![(Step::NotReady, self.not_ready)];
        if let Some(at) = self.fail_health_checks {
            steps.push((Step::FailHealthChecks, at));
        }
        steps.push((Step::Drain, self.drain));
        // Stable: ties keep the order above.
        steps.sort_by_key(|(_, at)| *at);
        if let Some(at) = self.stop_by {
            steps.push((Step::Stop, at));
        }
        steps
    }
}

impl fmt::Display for Timeline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let steps: Vec<String> = self
            .steps()
            .iter()
            .map(|(step, at)| match step {
                Step::Stop => format!("{} by {}", step.describe(), span(*at)),
                _ => format!("{} at {}", step.describe(), span(*at)),
            })
            .collect();
        f.write_str(&steps.join(", "))?;
        if self.stop_by.is_none() {
            f.write_str(", stop at zero (no deadline)")?;
        }
        if self.fail_health_checks.is_none() {
            f.write_str("; health checks never fail")?;
        }
        Ok(())
    }
}

/// An offset as people write it (`0s`, `1.5s`).
fn span(d: Duration) -> String {
    if d.is_zero() {
        "0s".to_owned()
    } else {
        format!("{d:?}")
    }
}

/// A step of the shutdown's timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Readiness goes off.
    NotReady,
    /// Envoy is told to fail its health checks.
    FailHealthChecks,
    /// Envoy is told to drain.
    Drain,
    /// Envoy is stopped.
    Stop,
}

impl Step {
    /// Its name in logs (`not_ready`, `fail_health_checks`, `drain`, `stop`).
    pub fn name(self) -> &'static str {
        match self {
            Step::NotReady => "not_ready",
            Step::FailHealthChecks => "fail_health_checks",
            Step::Drain => "drain",
            Step::Stop => "stop",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Step::NotReady => "readiness off",
            Step::FailHealthChecks => "health checks fail",
            Step::Drain => "drain",
            Step::Stop => "stop",
        }
    }
}

/// A step that cannot come before Envoy's latest stop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimelineError {
    /// Readiness would stay on until Envoy is stopped.
    #[error(
        "--not-ready-at {at:?} is after Envoy's latest stop ({stop_by:?} after the signal: \
         --drain-delay {drain:?} plus the drain's deadline {deadline:?}, \
         {deadline_flags}): readiness would never go off before the stop"
    )]
    NotReadyAfterStop {
        /// `--not-ready-at`.
        at: Duration,
        /// The latest stop.
        stop_by: Duration,
        /// `--drain-delay`.
        drain: Duration,
        /// The drain's deadline.
        deadline: Duration,
        /// The flags that set the deadline.
        deadline_flags: &'static str,
    },
    /// Envoy's health checks would never fail before it is stopped.
    #[error(
        "--healthcheck-fail-at {at:?} is after Envoy's latest stop ({stop_by:?} after the \
         signal: --drain-delay {drain:?} plus the drain's deadline {deadline:?}, \
         {deadline_flags}): the health checks would never fail; set it earlier, `drain`, or \
         `off`"
    )]
    HealthChecksAfterStop {
        /// `--healthcheck-fail-at`.
        at: Duration,
        /// The latest stop.
        stop_by: Duration,
        /// `--drain-delay`.
        drain: Duration,
        /// The drain's deadline.
        deadline: Duration,
        /// The flags that set the deadline.
        deadline_flags: &'static str,
    },
}

/// Fits the configured steps into one timeline, or says which one cannot come before Envoy's
/// latest stop. A step at the stop's very instant is taken (just before the stop), as the
/// drain request is with a zero termination drain duration.
pub fn fit(steps: Steps) -> Result<Timeline, TimelineError> {
    let Steps {
        not_ready,
        fail_health_checks,
        drain,
        drain_deadline,
        budget,
    } = steps;
    let fail_health_checks = match fail_health_checks {
        HealthCheckFailAt::Off => None,
        HealthCheckFailAt::Drain => Some(drain),
        HealthCheckFailAt::After(at) => Some(at),
    };
    let timeline = Timeline {
        not_ready,
        fail_health_checks,
        drain,
        stop_by: drain_deadline.map(|d| drain + d),
    };
    let (Some(stop_by), Some(deadline)) = (timeline.stop_by, drain_deadline) else {
        return Ok(timeline);
    };
    let deadline_flags = if budget.is_some() {
        "what --shutdown-budget leaves (or --termination-drain-duration)"
    } else {
        "--termination-drain-duration"
    };
    if not_ready > stop_by {
        return Err(TimelineError::NotReadyAfterStop {
            at: not_ready,
            stop_by,
            drain,
            deadline,
            deadline_flags,
        });
    }
    if let Some(at) = fail_health_checks.filter(|at| *at > stop_by) {
        return Err(TimelineError::HealthChecksAfterStop {
            at,
            stop_by,
            drain,
            deadline,
            deadline_flags,
        });
    }
    Ok(timeline)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn steps(not_ready: u64, hc: HealthCheckFailAt, drain: u64, deadline: Option<u64>) -> Steps {
        Steps {
            not_ready: S(not_ready),
            fail_health_checks: hc,
            drain: S(drain),
            drain_deadline: deadline.map(S),
            budget: None,
        }
    }

    /// Every case: the configured steps, and the timeline, or the flag the refusal names.
    #[test]
    fn the_timelines_fits_and_refusals() {
        use HealthCheckFailAt::{After, Drain, Off};
        type Fitted = Result<(u64, Option<u64>, u64, Option<u64>), &'static str>;
        let cases: Vec<(&str, Steps, Fitted)> = vec![
            (
                "the defaults: today's order, health checks failing with the drain",
                steps(0, Drain, 0, Some(5)),
                Ok((0, Some(0), 0, Some(5))),
            ),
            (
                "a drain delay: health checks fail when the drain starts",
                steps(0, Drain, 5, Some(20)),
                Ok((0, Some(5), 5, Some(25))),
            ),
            (
                "drain at once, readiness kept until endpoints propagate, health checks later",
                steps(10, After(S(15)), 0, Some(30)),
                Ok((10, Some(15), 0, Some(30))),
            ),
            (
                "health checks first (Contour's order)",
                steps(2, After(S(0)), 5, Some(10)),
                Ok((2, Some(0), 5, Some(15))),
            ),
            (
                "health checks off",
                steps(0, Off, 0, Some(5)),
                Ok((0, None, 0, Some(5))),
            ),
            (
                "steps at the stop's instant are taken",
                steps(15, After(S(15)), 5, Some(10)),
                Ok((15, Some(15), 5, Some(15))),
            ),
            (
                "exit-on-zero without a deadline: nothing to be after",
                steps(600, After(S(900)), 0, None),
                Ok((600, Some(900), 0, None)),
            ),
            (
                "readiness off after the stop",
                steps(16, Drain, 5, Some(10)),
                Err("--not-ready-at"),
            ),
            (
                "health checks failing after the stop",
                steps(0, After(S(31)), 0, Some(30)),
                Err("--healthcheck-fail-at"),
            ),
            (
                "a zero drain leaves no room after the drain delay",
                steps(0, After(S(4)), 3, Some(0)),
                Err("--healthcheck-fail-at"),
            ),
        ];
        for (name, given, want) in cases {
            let got = fit(given)
                .map(|t| {
                    (
                        t.not_ready.as_secs(),
                        t.fail_health_checks.map(|d| d.as_secs()),
                        t.drain.as_secs(),
                        t.stop_by.map(|d| d.as_secs()),
                    )
                })
                .map_err(|e| e.to_string());
            match (&got, want) {
                (Ok(got), Ok(want)) => assert_eq!(*got, want, "{name}"),
                (Err(message), Err(flag)) => {
                    assert!(message.starts_with(flag), "{name}: {message}");
                    assert!(message.contains("--drain-delay"), "{name}: {message}");
                    assert!(
                        message.contains("--termination-drain-duration"),
                        "{name}: {message}"
                    );
                }
                _ => panic!("{name}: {got:?}"),
            }
        }
    }

    #[test]
    fn a_refusal_under_a_budget_names_it() {
        let err = fit(Steps {
            budget: Some(S(30)),
            ..steps(40, HealthCheckFailAt::Drain, 0, Some(23))
        })
        .unwrap_err();
        assert!(err.to_string().contains("--shutdown-budget"), "{err}");
    }

    #[test]
    fn the_steps_come_in_time_order_ties_in_the_agents_order() {
        let t = fit(steps(10, HealthCheckFailAt::Drain, 0, Some(30))).unwrap();
        let order: Vec<&str> = t.steps().iter().map(|(s, _)| s.name()).collect();
        assert_eq!(order, ["fail_health_checks", "drain", "not_ready", "stop"]);
        let t = Timeline::default();
        let order: Vec<&str> = t.steps().iter().map(|(s, _)| s.name()).collect();
        assert_eq!(order, ["not_ready", "fail_health_checks", "drain", "stop"]);
        assert_eq!(
            t.to_string(),
            "readiness off at 0s, health checks fail at 0s, drain at 0s, stop by 5s"
        );
    }

    #[test]
    fn healthcheck_fail_at_parses_a_duration_drain_or_off() {
        assert_eq!("drain".parse(), Ok(HealthCheckFailAt::Drain));
        assert_eq!("off".parse(), Ok(HealthCheckFailAt::Off));
        assert_eq!("7s".parse(), Ok(HealthCheckFailAt::After(S(7))));
        let err = "soon".parse::<HealthCheckFailAt>().unwrap_err();
        assert!(err.contains("`drain`"), "{err}");
    }
}
