//! The runtime's state as the node's Ready condition sees it: the kubelet's
//! `runtimeState` (`pkg/kubelet/runtime.go`) fed by `updateRuntimeUp`
//! (`kubelet.go`), which asks the runtime's CRI `Status` every 5 s.
//!
//! Errors, in the kubelet's words: "container runtime status check may not
//! have completed yet" before the first answer; "container runtime is down"
//! when no answer came for the threshold (the kubelet's 30 s, six periods
//! here); "container runtime not ready: RuntimeReady=false reason:... message:..."
//! and "container runtime network not ready: NetworkReady=false reason:...
//! message:..." from the runtime's own conditions.
//!
//! Differences: the period is a flag (`--runtime-status-period`, the kubelet's
//! fixed 5 s) so tests can see the runtime go down in seconds; the threshold
//! follows it (six periods).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use evpleg_cri_api::v1;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use evpleg_core::clock::SharedClock;
use evpleg_cri::CriClient;

/// The kubelet's `updateRuntimeUp` period.
pub const DEFAULT_PERIOD: Duration = Duration::from_secs(5);
/// The threshold in periods: the kubelet's 30 s for its 5 s period.
pub const THRESHOLD_PERIODS: u32 = 6;

/// What the last `Status` calls said.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Last {
    /// No answer yet, since `since_ns`.
    NotYet { since_ns: u64 },
    /// The last answer, at `at_ns`, with the errors of its conditions.
    Answered { at_ns: u64, conditions: Vec<String> },
}

/// The runtime's state, shared with the node status.
#[derive(Debug)]
pub struct RuntimeState {
    last: Mutex<Last>,
    threshold: Duration,
    clock: SharedClock,
}

impl RuntimeState {
    pub fn new(clock: SharedClock, period: Duration) -> Arc<Self> {
        Arc::new(Self {
            last: Mutex::new(Last::NotYet {
                since_ns: clock.now_ns(),
            }),
            threshold: period * THRESHOLD_PERIODS,
            clock,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Last> {
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Transition: the runtime answered `Status`.
    pub fn answered(&self, status: Option<&v1::RuntimeStatus>) {
        *self.lock() = Last::Answered {
            at_ns: self.clock.now_ns(),
            conditions: condition_errors(status),
        };
    }

    /// The errors that make the node not ready.
    pub fn errors(&self) -> RuntimeErrors {
        let now = self.clock.now_ns();
        let threshold = self.threshold.as_nanos() as u64;
        let reach = |reach| RuntimeErrors {
            reach: Some(reach),
            conditions: Vec::new(),
        };
        match &*self.lock() {
            Last::NotYet { since_ns } if now.saturating_sub(*since_ns) > threshold => {
                reach("container runtime is down")
            }
            Last::NotYet { .. } => {
                reach("container runtime status check may not have completed yet")
            }
            Last::Answered { at_ns, .. } if now.saturating_sub(*at_ns) > threshold => {
                reach("container runtime is down")
            }
            Last::Answered { conditions, .. } => RuntimeErrors {
                reach: None,
                conditions: conditions.clone(),
            },
        }
    }
}

/// What [`RuntimeState::errors`] found: whether the runtime answers, and the
/// errors of its conditions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeErrors {
    /// "container runtime is down", or its status not checked yet.
    pub reach: Option<&'static str>,
    /// The errors of the runtime's RuntimeReady and NetworkReady conditions.
    pub conditions: Vec<String>,
}

/// The errors of the runtime's conditions, as the kubelet words them.
fn condition_errors(status: Option<&v1::RuntimeStatus>) -> Vec<String> {
    let conditions = status.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let find = |kind: &str| conditions.iter().find(|c| c.r#type == kind);
    let mut errors = Vec::new();
    for (kind, what) in [
        ("RuntimeReady", "container runtime not ready"),
        ("NetworkReady", "container runtime network not ready"),
    ] {
        match find(kind) {
            Some(c) if c.status => {}
            Some(c) => errors.push(format!(
                "{what}: {kind}=false reason:{} message:{}",
                c.reason, c.message
            )),
            None => errors.push(format!("{what}: <nil>")),
        }
    }
    errors
}

/// The node's health for its Ready condition, as the kubelet's
/// `runtimeErrors` aggregate: the runtime's reachability, then the PLEG's
/// health (the first line of the `/healthz` failure), then the runtime's own
/// conditions; one error as it is, several as `[a, b]`.
pub fn ready(runtime: RuntimeErrors, healthz: Result<(), String>) -> Result<(), String> {
    let mut errors: Vec<String> = runtime.reach.into_iter().map(str::to_owned).collect();
    if let Err(body) = healthz {
        let first = body.lines().next().unwrap_or_default();
        errors.push(if first.starts_with("pleg") {
            format!("PLEG is not healthy: {first}")
        } else {
            first.to_owned()
        });
    }
    errors.extend(runtime.conditions);
    match errors.len() {
        0 => Ok(()),
        1 => Err(errors.remove(0)),
        _ => Err(format!("[{}]", errors.join(", "))),
    }
}

/// Asks the runtime's `Status` every `period` until `shutdown`.
pub async fn run(
    cri: CriClient,
    state: Arc<RuntimeState>,
    period: Duration,
    shutdown: CancellationToken,
) {
    let mut was_down = false;
    loop {
        let answer = tokio::select! {
            () = shutdown.cancelled() => return,
            r = tokio::time::timeout(period * THRESHOLD_PERIODS, cri.status(false)) => r,
        };
        match answer {
            Ok(Ok(resp)) => {
                state.answered(resp.status.as_ref());
                if was_down {
                    info!("the container runtime answers Status again");
                }
                was_down = false;
            }
            Ok(Err(e)) => {
                if !was_down {
                    warn!(error = %e, "container runtime Status failed");
                }
                was_down = true;
            }
            Err(_) => {
                if !was_down {
                    warn!(
                        timeout_s = (period * THRESHOLD_PERIODS).as_secs_f64(),
                        "container runtime Status did not answer"
                    );
                }
                was_down = true;
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(period) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_core::clock::{Clock, ManualClock};

    fn condition(kind: &str, ok: bool) -> v1::RuntimeCondition {
        v1::RuntimeCondition {
            r#type: kind.into(),
            status: ok,
            reason: if ok {
                String::new()
            } else {
                "NetworkPluginNotReady".into()
            },
            message: if ok {
                String::new()
            } else {
                "cni config uninitialized".into()
            },
        }
    }

    fn status(runtime: bool, network: bool) -> v1::RuntimeStatus {
        v1::RuntimeStatus {
            conditions: vec![
                condition("RuntimeReady", runtime),
                condition("NetworkReady", network),
            ],
        }
    }

    #[test]
    fn errors_table() {
        const S: u64 = 1_000_000_000;
        /// (answer at s, or none; now in s; the errors)
        type Case = (
            Option<(u64, v1::RuntimeStatus)>,
            u64,
            &'static [&'static str],
        );
        let cases: &[Case] = &[
            (
                None,
                1,
                &["container runtime status check may not have completed yet"],
            ),
            (None, 31, &["container runtime is down"]),
            (Some((1, status(true, true))), 2, &[]),
            (Some((1, status(true, true))), 31, &[]),
            (
                Some((1, status(true, true))),
                32,
                &["container runtime is down"],
            ),
            (
                Some((1, status(true, false))),
                2,
                &[
                    "container runtime network not ready: NetworkReady=false reason:NetworkPluginNotReady message:cni config uninitialized",
                ],
            ),
            (
                Some((1, status(false, true))),
                2,
                &[
                    "container runtime not ready: RuntimeReady=false reason:NetworkPluginNotReady message:cni config uninitialized",
                ],
            ),
        ];
        for (i, (answer, now, want)) in cases.iter().enumerate() {
            let clock = ManualClock::new(0);
            let state = RuntimeState::new(Arc::new(clock.clone()), DEFAULT_PERIOD);
            if let Some((at, s)) = answer {
                clock.advance(at * S);
                state.answered(Some(s));
            }
            clock.advance(now * S - clock.now_ns());
            let errors = state.errors();
            let all: Vec<String> = (errors.reach.map(str::to_owned).into_iter())
                .chain(errors.conditions)
                .collect();
            assert_eq!(all, *want, "case {i}");
        }
    }

    #[test]
    fn ready_table() {
        let pleg = || Err("pleg was last seen active 3.1s ago; threshold is 3.0s\ndetails".into());
        let none = RuntimeErrors::default;
        let down = || RuntimeErrors {
            reach: Some("container runtime is down"),
            conditions: Vec::new(),
        };
        let net = vec![
            "container runtime network not ready: NetworkReady=false reason:r message:m".to_owned(),
        ];
        type Case = (RuntimeErrors, Result<(), String>, Result<(), &'static str>);
        let cases: Vec<Case> = vec![
            (none(), Ok(()), Ok(())),
            (down(), Ok(()), Err("container runtime is down")),
            (
                none(),
                pleg(),
                Err("PLEG is not healthy: pleg was last seen active 3.1s ago; threshold is 3.0s"),
            ),
            (
                none(),
                Err("task \"sync loop\" stopped".into()),
                Err("task \"sync loop\" stopped"),
            ),
            (
                RuntimeErrors {
                    conditions: net,
                    ..down()
                },
                pleg(),
                Err(
                    "[container runtime is down, PLEG is not healthy: pleg was last seen active 3.1s ago; threshold is 3.0s, container runtime network not ready: NetworkReady=false reason:r message:m]",
                ),
            ),
        ];
        for (i, (runtime, healthz, want)) in cases.into_iter().enumerate() {
            assert_eq!(
                ready(runtime, healthz),
                want.map_err(str::to_owned),
                "case {i}"
            );
        }
    }

    #[test]
    fn a_runtime_that_reports_no_conditions_is_not_ready() {
        let state = RuntimeState::new(Arc::new(ManualClock::new(0)), DEFAULT_PERIOD);
        state.answered(None);
        let errors = state.errors();
        assert_eq!(errors.reach, None);
        assert_eq!(errors.conditions.len(), 2, "{errors:?}");
    }
}
