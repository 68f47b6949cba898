//! What is recorded of one pod on one side, and the fields compared.
//!
//! From the pod's status (polled every [`super::STATUS_POLL`]): the sequence of its
//! phases and of each container's states (each distinct one in the order first
//! seen, so that a crash loop's repetitions and the polling's rhythm do not
//! count), and its last status before the case was done (or its manifest
//! removed): the pod's reason and message, QoS class, each
//! condition (status, reason, message), each container's state (not for a
//! case that stops in a crash loop, where it is timing) and last
//! state (kind, reason, message, exit code), restart count, `ready` and
//! `started`. From the runtime (each side's own containerd, every [`super::CRI_POLL`]):
//! every container attempt's creation, start and end in nanoseconds, which give
//! the order containers started in (init containers and sidecars), the waits
//! between a container's end and its next attempt (CrashLoopBackOff) and, for a
//! pod whose manifest is removed, how long after the removal each container
//! ended and with which exit code. In API mode, also the pod's events: per
//! reason, the distinct `type fieldPath: message` (messages normalised by
//! [`super::api::normalise`]; how often an event repeated is timing and not
//! compared). Timestamps, ids and IPs are not compared.
//!
//! A state shown stale is not a state seen: a container `running` first seen
//! more than [`STALE_MS`] after the runtime's end of that container, and the
//! pod's phase `Running` seen only when none of its containers ran (by the
//! runtime's start and end, with the same slack). The kubelet's relist (1 s)
//! and containerd's lagging exit reports (up to 3.5 s under the whole
//! corpus) show a dead container running for seconds, where the kernel PLEG
//! reports the death at once: counted, those displays made evpleg look as if
//! it had missed a run it reported truly (issue #31). A state shown while it
//! held still counts on both sides, so a start evpleg reports late is still
//! a difference. A run shorter than [`STALE_MS`] shows `running` by chance
//! on either side and does not count as one.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::Case;

/// Tolerance on a restart's wait (a container's end to its next creation):
/// the kubelet restarts at its first pod sync after the back-off expires, and
/// on a busy 2-core machine either side's sync may come a second late.
pub const RESTART_WAIT_TOLERANCE_MS: i64 = 1_500;
/// Tolerance on a container's end after its pod's manifest was removed.
pub const TERMINATION_TOLERANCE_MS: i64 = 700;
/// How long after a container's end (the runtime's) a `running` shown for it
/// still counts as seen: the statuses are polled every 50 ms, and a status
/// reaches the API server some milliseconds after it was made.
pub const STALE_MS: i64 = 250;

/// One container attempt as the runtime showed it.
#[derive(Debug, Clone, Default)]
pub struct Attempt {
    pub name: String,
    pub attempt: u32,
    pub created_ns: i64,
    pub started_ns: i64,
    pub finished_ns: i64,
    pub exit_code: i32,
    /// CRI state: 0 created, 1 running, 2 exited, 3 unknown.
    pub state: i32,
}

/// Everything seen of one pod on one side.
#[derive(Debug, Clone, Default)]
pub struct Record {
    /// Distinct phases in the order seen.
    pub phases: Vec<String>,
    /// Per container: distinct `kind:reason` states in the order first seen.
    pub states: BTreeMap<String, Vec<String>>,
    /// The last status seen.
    pub last: Value,
    /// `done`, `timeout` or `never seen`.
    pub outcome: String,
    /// The runtime's containers of this pod, by id.
    pub attempts: BTreeMap<String, Attempt>,
    /// When its manifest was removed (wall clock, ns), for deletion cases.
    pub removed_ns: Option<i64>,
    /// When its status was first seen.
    pub first_seen: Option<std::time::Instant>,
    /// Its status is no longer recorded (the case is done, or its manifest
    /// was removed: the kubelet stops serving it, the agent does not).
    pub frozen: bool,
    /// Its events, in API mode.
    pub events: Option<Vec<super::api::Seen>>,
    /// Each container `running` first seen: (name, container id, when, wall
    /// clock ns), in the order seen.
    running_seen: Vec<(String, String, i64)>,
    /// When the phase was seen `Running` (wall clock ns).
    running_phase_at: Vec<i64>,
}

fn push_distinct(list: &mut Vec<String>, item: String) {
    if !list.contains(&item) {
        list.push(item);
    }
}

/// `(kind, detail)` of a container state object (`{"running": {...}}`).
fn state_of(s: &Value) -> (String, Value) {
    s.as_object()
        .and_then(|o| o.iter().next())
        .map(|(k, v)| (k.clone(), v.clone()))
        .unwrap_or_else(|| (String::new(), Value::Null))
}

/// The container statuses of a pod, init containers first.
fn statuses(pod: &Value) -> Vec<&Value> {
    ["initContainerStatuses", "containerStatuses"]
        .iter()
        .flat_map(|k| pod["status"][k].as_array().into_iter().flatten())
        .collect()
}

impl Record {
    /// Takes one polled status of the pod, seen at `at_ns` (wall clock).
    pub fn observe(&mut self, pod: &Value, at_ns: i64) {
        if self.frozen {
            return;
        }
        if let Some(phase) = pod["status"]["phase"].as_str() {
            push_distinct(&mut self.phases, phase.to_owned());
            if phase == "Running" {
                self.running_phase_at.push(at_ns);
            }
        }
        for c in statuses(pod) {
            let name = c["name"].as_str().unwrap_or("").to_owned();
            let (kind, detail) = state_of(&c["state"]);
            if kind == "running" {
                let id = c["containerID"].as_str().unwrap_or("");
                let id = id.rsplit("://").next().unwrap_or(id).to_owned();
                if !self
                    .running_seen
                    .iter()
                    .any(|(n, i, _)| *n == name && *i == id)
                {
                    self.running_seen.push((name.clone(), id, at_ns));
                }
            }
            let reason = detail["reason"].as_str().unwrap_or("");
            let entry = if reason.is_empty() {
                kind
            } else {
                format!("{kind}:{reason}")
            };
            push_distinct(self.states.entry(name).or_default(), entry);
        }
        self.last = pod.clone();
    }

    /// The fields compared, by name.
    pub fn fields(&self, case: &Case) -> BTreeMap<String, Value> {
        let mut f = BTreeMap::new();
        let status = &self.last["status"];
        f.insert("outcome".into(), json!(self.outcome));
        f.insert("phases".into(), json!(self.phases_held()));
        f.insert(
            "pod reason, message".into(),
            json!([status["reason"], status["message"]]),
        );
        f.insert("qosClass".into(), status["qosClass"].clone());
        let looping = matches!(case.until, super::Until::Restarts(_));
        for c in status["conditions"].as_array().into_iter().flatten() {
            let kind = c["type"].as_str().unwrap_or("");
            if looping && matches!(kind, "Ready" | "ContainersReady") {
                continue;
            }
            f.insert(
                format!("condition {kind}"),
                json!([c["status"], c["reason"], c["message"]]),
            );
        }
        let view = |s: &Value| {
            let (kind, d) = state_of(s);
            json!({"kind": kind, "reason": d["reason"], "message": d["message"], "exitCode": d["exitCode"], "signal": d["signal"]})
        };
        for c in statuses(&self.last) {
            let name = c["name"].as_str().unwrap_or("");
            // A container that keeps restarting is caught at any point of
            // its loop when the case stops: its last state is compared, not
            // its state, readiness or start.
            if !looping {
                f.insert(format!("{name}: state"), view(&c["state"]));
                f.insert(format!("{name}: ready"), c["ready"].clone());
                f.insert(format!("{name}: started"), c["started"].clone());
            }
            f.insert(format!("{name}: lastState"), view(&c["lastState"]));
            let count = c["restartCount"].as_u64().unwrap_or(0);
            f.insert(
                format!("{name}: restartCount"),
                json!(case.until.restart_count(count)),
            );
        }
        for (name, seq) in &self.states {
            let seq: Vec<&String> = seq
                .iter()
                .filter(|s| *s != "running" || self.ran_when_seen(name))
                .collect();
            f.insert(format!("{name}: states seen"), json!(seq));
        }
        f.insert("start order".into(), json!(self.start_order()));
        if let Some(events) = &self.events {
            let mut by_reason: BTreeMap<&str, Vec<String>> = BTreeMap::new();
            for e in events {
                by_reason
                    .entry(&e.reason)
                    .or_default()
                    .push(format!("{} {}: {}", e.kind, e.field_path, e.message));
            }
            for (reason, list) in by_reason {
                f.insert(format!("event {reason}"), json!(list));
            }
        }
        for (name, wait) in self.restart_waits() {
            f.insert(format!("{name}: restart wait ms"), json!(wait));
        }
        if let Some(removed) = self.removed_ns {
            for (name, (after, code)) in self.terminations(removed) {
                f.insert(format!("{name}: end after removal ms"), json!(after));
                f.insert(format!("{name}: exit code at removal"), json!(code));
            }
        }
        f
    }

    /// Whether container `name` was seen `running` while one of its
    /// attempts ran: first seen before its end (the runtime's) plus
    /// [`STALE_MS`], or for an attempt the runtime was not seen to end. An
    /// attempt that ran shorter than [`STALE_MS`] does not count: either side
    /// shows it `running` or not by chance (the runtime's listing lags its
    /// exit, the poll comes every 50 ms).
    fn ran_when_seen(&self, name: &str) -> bool {
        let slack = STALE_MS * 1_000_000;
        self.running_seen
            .iter()
            .filter(|(n, _, _)| n == name)
            .any(|(_, id, at)| match self.attempts.get(id) {
                Some(a) if a.finished_ns > 0 => {
                    a.finished_ns - a.started_ns >= slack && *at <= a.finished_ns + slack
                }
                _ => true,
            })
    }

    /// The phases seen, `Running` only if it was seen while a container of
    /// the pod ran (by the runtime's start and end, with [`STALE_MS`]).
    fn phases_held(&self) -> Vec<&String> {
        let slack = STALE_MS * 1_000_000;
        let ran_at = |at: i64| {
            self.attempts.values().any(|a| {
                a.started_ns > 0
                    && a.started_ns <= at + slack
                    && (a.finished_ns <= 0 || at <= a.finished_ns + slack)
            })
        };
        let held = self.running_phase_at.iter().any(|at| ran_at(*at));
        self.phases
            .iter()
            .filter(|p| *p != "Running" || held)
            .collect()
    }

    /// Container names in the order their first attempts were created.
    fn start_order(&self) -> Vec<String> {
        let mut first: Vec<&Attempt> = self.attempts.values().filter(|a| a.attempt == 0).collect();
        first.sort_by_key(|a| a.created_ns);
        first.iter().map(|a| a.name.clone()).collect()
    }

    /// Per container with restarts: the median of (creation of attempt k+1 -
    /// end of attempt k), in ms.
    fn restart_waits(&self) -> BTreeMap<String, i64> {
        let mut by_name: BTreeMap<&str, Vec<&Attempt>> = BTreeMap::new();
        for a in self.attempts.values() {
            by_name.entry(&a.name).or_default().push(a);
        }
        let mut out = BTreeMap::new();
        for (name, mut list) in by_name {
            list.sort_by_key(|a| a.attempt);
            let mut waits: Vec<i64> = list
                .windows(2)
                .filter(|w| w[1].attempt == w[0].attempt + 1 && w[0].finished_ns > 0)
                .map(|w| (w[1].created_ns - w[0].finished_ns) / 1_000_000)
                .collect();
            if waits.is_empty() {
                continue;
            }
            waits.sort();
            out.insert(name.to_owned(), waits[waits.len() / 2]);
        }
        out
    }

    /// Per container running at the removal: ms from the removal to its end,
    /// and its exit code.
    fn terminations(&self, removed: i64) -> BTreeMap<String, (i64, i32)> {
        let mut out = BTreeMap::new();
        for a in self.attempts.values() {
            if a.finished_ns >= removed && a.started_ns > 0 && a.started_ns < removed {
                out.insert(
                    a.name.clone(),
                    ((a.finished_ns - removed) / 1_000_000, a.exit_code),
                );
            }
        }
        out
    }
}

/// Whether two values of field `field` are the same, with the stated
/// tolerances for durations.
pub fn same(field: &str, a: &Value, b: &Value) -> bool {
    let tolerance = if field.ends_with("restart wait ms") {
        RESTART_WAIT_TOLERANCE_MS
    } else if field.ends_with("end after removal ms") {
        TERMINATION_TOLERANCE_MS
    } else {
        return a == b;
    };
    match (a.as_i64(), b.as_i64()) {
        (Some(x), Some(y)) => (x - y).abs() <= tolerance,
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: i64 = 1_000_000;

    fn case() -> Case {
        Case {
            name: "c".into(),
            about: String::new(),
            yaml: String::new(),
            until: super::super::Until::Terminal,
            quick: false,
            delete: false,
            api_quick: false,
            modes: Vec::new(),
            act: None,
            after: None,
            objects: Vec::new(),
            csi_driver: false,
        }
    }

    fn status(phase: &str, state: Value) -> Value {
        json!({"status": {"phase": phase, "containerStatuses": [
            {"name": "app", "containerID": "containerd://abc", "state": state}
        ]}})
    }

    /// A record of container `app` (id `abc`) that ran from `started` to
    /// `finished` (ns).
    fn ran(started: i64, finished: i64) -> Record {
        let mut r = Record::default();
        r.attempts.insert(
            "abc".into(),
            Attempt {
                name: "app".into(),
                started_ns: started,
                finished_ns: finished,
                state: 2,
                ..Attempt::default()
            },
        );
        r
    }

    /// A container that ran from 1 s to 2 s: `running` first shown at `at`.
    fn seen(at: i64) -> (Value, Value) {
        let mut r = ran(1_000 * MS, 2_000 * MS);
        r.observe(&status("Pending", json!({"waiting": {}})), 500 * MS);
        r.observe(&status("Running", json!({"running": {}})), at);
        r.observe(
            &status("Succeeded", json!({"terminated": {"reason": "Completed"}})),
            at + 100 * MS,
        );
        let f = r.fields(&case());
        (f["app: states seen"].clone(), f["phases"].clone())
    }

    #[test]
    fn a_state_shown_after_it_ended_is_not_a_state_seen() {
        let held = (
            json!(["waiting", "running", "terminated:Completed"]),
            json!(["Pending", "Running", "Succeeded"]),
        );
        let stale = (
            json!(["waiting", "terminated:Completed"]),
            json!(["Pending", "Succeeded"]),
        );
        assert_eq!(seen(1_500 * MS), held, "shown while it ran");
        assert_eq!(seen(2_000 * MS + STALE_MS * MS), held, "within the slack");
        assert_eq!(
            seen(2_001 * MS + STALE_MS * MS),
            stale,
            "shown after it ended"
        );
    }

    #[test]
    fn a_run_shorter_than_the_slack_is_not_a_running_seen() {
        let mut r = ran(1_000 * MS, 1_000 * MS + STALE_MS * MS - 1);
        r.observe(&status("Running", json!({"running": {}})), 1_001 * MS);
        let f = r.fields(&case());
        assert_eq!(f["app: states seen"], json!([]));
    }
}
