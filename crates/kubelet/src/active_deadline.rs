//! `activeDeadlineSeconds`, as the kubelet's active deadline handler
//! (`pkg/kubelet/active_deadline.go`, `activeDeadlineHandler`): once a pod
//! has been active on the node for its deadline, measured from its status's
//! `startTime`, it is evicted: every status generated from then on is
//! `Failed` with reason `DeadlineExceeded` and the message "Pod was active
//! on the node longer than the specified deadline" (`ShouldEvict`, applied
//! in `generateAPIPodStatus`), a Normal `DeadlineExceeded` event is
//! recorded, SyncPod finds the pod terminal and the pod worker kills its
//! containers. A pod is synced when its deadline comes (`ShouldSync`): here
//! SyncPod asks its worker to come back then ([`remaining`]).
//!
//! The start is the API status's `startTime` when the pod has one (a pod
//! the agent took over after a restart keeps its deadline), else the time
//! the agent first synced it.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;

/// The eviction's reason (the kubelet's `reason`).
pub const REASON: &str = "DeadlineExceeded";
/// The eviction's message.
pub const MESSAGE: &str = "Pod was active on the node longer than the specified deadline";

/// When the pod started, Unix ns: its API `startTime`, else `own` (when the
/// agent first synced it), the earlier of the two.
pub fn start_ns(pod: &Pod, own: i64) -> i64 {
    let api = pod
        .status
        .as_ref()
        .and_then(|s| s.start_time.as_ref())
        .and_then(|t| i64::try_from(t.0.as_nanosecond()).ok());
    api.map_or(own, |a| a.min(own))
}

/// Time left before the pod's deadline: `None` without one, zero once it has
/// passed (the kubelet's `pastActiveDeadline`: the active duration reached
/// the deadline).
pub fn remaining(pod: &Pod, start_ns: i64, now_ns: i64) -> Option<Duration> {
    let seconds = pod.spec.as_ref()?.active_deadline_seconds?;
    let allowed = i128::from(seconds.max(0)) * 1_000_000_000;
    let active = i128::from(now_ns) - i128::from(start_ns);
    let left = (allowed - active).max(0);
    Some(Duration::from_nanos(
        u64::try_from(left).unwrap_or(u64::MAX),
    ))
}

/// Whether the pod is past its deadline (`ShouldEvict`).
pub fn past(pod: &Pod, start_ns: i64, now_ns: i64) -> bool {
    remaining(pod, start_ns, now_ns).is_some_and(|d| d.is_zero())
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    fn pod(deadline: Option<i64>, start: Option<&str>) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"activeDeadlineSeconds": deadline, "containers": [{"name": "c"}]},
            "status": {"startTime": start}
        }))
        .unwrap()
    }

    /// The kubelet's `TestActiveDeadlineHandler` cases: past, not yet, no
    /// deadline; the deadline itself counts as past.
    #[test]
    fn the_kubelet_s_deadline_table() {
        let start = 1_000 * S;
        let cases = [
            ("no deadline", None, 10_000 * S, None),
            (
                "not yet",
                Some(30),
                start + 29 * S,
                Some(Duration::from_secs(1)),
            ),
            (
                "exactly at it",
                Some(30),
                start + 30 * S,
                Some(Duration::ZERO),
            ),
            ("past it", Some(30), start + 31 * S, Some(Duration::ZERO)),
            ("zero", Some(0), start, Some(Duration::ZERO)),
        ];
        for (name, deadline, now, want) in cases {
            let p = pod(deadline, None);
            assert_eq!(remaining(&p, start, now), want, "{name}");
            assert_eq!(past(&p, start, now), want == Some(Duration::ZERO), "{name}");
        }
    }

    /// The API's startTime wins when earlier: an agent restart keeps the
    /// deadline.
    #[test]
    fn the_api_start_time_is_the_start() {
        let p = pod(Some(30), Some("2026-01-01T00:00:00Z"));
        let api = 1_767_225_600 * S;
        assert_eq!(start_ns(&p, api + 100 * S), api);
        assert_eq!(start_ns(&p, api - S), api - S);
        assert_eq!(start_ns(&pod(Some(30), None), 7), 7);
    }
}
