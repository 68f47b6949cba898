//! The order in which a pod's containers stop when it has sidecars: the
//! kubelet's `terminationOrdering` (`kuberuntime_termination_order.go`).
//!
//! Every running container is killed at once, each on its own; a sidecar
//! (an init container with `restartPolicy: Always`) first runs its preStop
//! hook like any container, then waits for its turn to be stopped: until
//! every running app container and every running sidecar declared after it
//! has stopped, or until what is left of its grace period has passed
//! ([`TerminationOrdering::wait_for_turn`]). A container whose stop failed
//! is never marked stopped: those waiting for it wait out their time.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::watch;

use super::actions::is_sidecar;

/// Who waits for whom, and who has not stopped yet.
#[derive(Debug)]
pub struct TerminationOrdering {
    /// The containers each one waits for (only sidecars wait).
    waits_for: HashMap<String, Vec<String>>,
    /// The running containers not stopped yet.
    running: watch::Sender<HashSet<String>>,
}

impl TerminationOrdering {
    /// The ordering of `pod`'s containers named in `running` (the kubelet's
    /// `newTerminationOrdering`): each running sidecar waits for the running
    /// app containers and the running sidecars declared after it.
    pub fn new(pod: &Pod, running: &[&str]) -> Self {
        let spec = pod.spec.as_ref();
        let is_running = |name: &str| running.contains(&name);
        let apps: Vec<String> = spec
            .into_iter()
            .flat_map(|s| s.containers.iter())
            .filter(|c| is_running(&c.name))
            .map(|c| c.name.clone())
            .collect();
        let sidecars: Vec<String> = spec
            .into_iter()
            .flat_map(|s| s.init_containers.iter().flatten())
            .filter(|c| is_sidecar(c) && is_running(&c.name))
            .map(|c| c.name.clone())
            .collect();
        let mut waits_for = HashMap::new();
        for (i, sidecar) in sidecars.iter().enumerate() {
            let mut deps = apps.clone();
            deps.extend(sidecars[i + 1..].iter().cloned());
            waits_for.insert(sidecar.clone(), deps);
        }
        let running = running.iter().map(|n| (*n).to_owned()).collect();
        Self {
            waits_for,
            running: watch::Sender::new(running),
        }
    }

    /// Waits until every container `name` waits for has stopped, at most
    /// `grace_seconds`; returns how long it waited (`waitForTurn`).
    pub async fn wait_for_turn(&self, name: &str, grace_seconds: i64) -> Duration {
        let started = tokio::time::Instant::now();
        let Some(deps) = self.waits_for.get(name) else {
            return Duration::ZERO;
        };
        let mut rx = self.running.subscribe();
        let bound = Duration::from_secs(grace_seconds.max(0) as u64);
        let turn = rx.wait_for(|running| deps.iter().all(|d| !running.contains(d)));
        // A timeout, or every sender gone (never: `self` holds it): the turn
        // comes either way.
        let _ = tokio::time::timeout(bound, turn).await;
        started.elapsed()
    }

    /// Container `name` has stopped (`containerTerminated`).
    pub fn terminated(&self, name: &str) {
        self.running.send_modify(|running| {
            running.remove(name);
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {
                "initContainers": [
                    {"name": "s1", "restartPolicy": "Always"},
                    {"name": "init"},
                    {"name": "s2", "restartPolicy": "Always"},
                ],
                "containers": [{"name": "a"}, {"name": "b"}],
            }
        }))
        .unwrap()
    }

    /// s1 waits for the apps and s2; s2 for the apps; the apps for nobody;
    /// a container not running is not waited for; a wait ends at the grace.
    #[tokio::test(start_paused = true)]
    async fn sidecars_wait_for_the_apps_and_later_sidecars() {
        let o = Arc::new(TerminationOrdering::new(&pod(), &["s1", "s2", "a", "b"]));
        assert_eq!(o.wait_for_turn("a", 30).await, Duration::ZERO);
        let t0 = tokio::time::Instant::now();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for name in ["s1", "s2"] {
            let (o, order) = (o.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let waited = o.wait_for_turn(name, 30).await;
                order.lock().unwrap().push((name, waited.as_secs()));
                o.terminated(name);
            }));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        o.terminated("a");
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(order.lock().unwrap().is_empty(), "b still runs");
        o.terminated("b");
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [("s2", 5), ("s1", 5)]);
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_secs(5) && took < Duration::from_millis(5_010),
            "{took:?}"
        );

        // Only s1 and a run: s1 waits for a alone; its wait is bounded.
        let o = TerminationOrdering::new(&pod(), &["s1", "a"]);
        assert_eq!(o.wait_for_turn("s1", 4).await, Duration::from_secs(4));
        o.terminated("a");
        assert_eq!(o.wait_for_turn("s1", 4).await, Duration::ZERO);
    }
}
