//! Container garbage collection: the kubelet's `containerGC`
//! (`kuberuntime_gc.go`), run every `--container-gc-period` (the kubelet's 1 min).
//!
//! * Dead containers (not running, created more than `--minimum-container-ttl-duration`
//!   ago) are grouped by pod and container name. A pod whose content may go
//!   (the kubelet's `ShouldPodContentBeRemoved`: no source has it and its
//!   worker has finished, once every source has sent its pods) loses them
//!   all; every other group keeps its newest
//!   `--maximum-dead-containers-per-container` (1), so the last termination of
//!   every container stays for its status and restart count (a newest
//!   instance created and not yet started does not count: it is about to
//!   run, and the termination before it stays); then, when
//!   `--maximum-dead-containers` is not negative, the node keeps at most that
//!   many, oldest first out (each group keeping one while it can).
//! * A pod's sandboxes that are not ready and hold no container are removed,
//!   but for the newest of a pod whose content stays.
//! * A removed container's log file goes with it, when the path the runtime
//!   reports is under `--pod-log-dir` (without `..`): a runtime's answer is
//!   never a licence to remove a host file elsewhere.
//!
//! So a deleted pod's exited containers and stopped sandbox stay until the
//! next collection, as under the kubelet, whose `SyncTerminatedPod` leaves
//! them "to be reclaimed in the background": their exit codes stay in the
//! runtime meanwhile. Which pods' content may go is asked of the sync loop
//! ([`ContentQuery`]), which alone knows the sources' pods and the workers.
//! Differences: the kubelet also lets an evicted pod's content go while its
//! API object exists, and removes older dead instances of a container at
//! each of its deaths (`containerDeletor`); here only the collection does.
//! The kubelet's `evictableContainers` counts a container created and not
//! yet started as the dead instance to keep, so a collection between a
//! restart's CreateContainer and StartContainer removes the termination the
//! status's `lastState` is read from; here that new container does not
//! count.

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use evpleg_cri_api::v1;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use evpleg_core::labels;
use evpleg_cri::CriClient;

/// The kubelet's `GCPolicy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GcPolicy {
    /// Dead containers younger than this stay.
    pub min_age: Duration,
    /// Dead containers kept per (pod, container name); negative: no limit.
    pub max_per_pod_container: i32,
    /// Dead containers kept on the node; negative: no limit.
    pub max_containers: i32,
}

impl Default for GcPolicy {
    fn default() -> Self {
        Self {
            min_age: Duration::ZERO,
            max_per_pod_container: 1,
            max_containers: -1,
        }
    }
}

/// What one collection removes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcPlan {
    pub containers: Vec<String>,
    pub sandboxes: Vec<String>,
}

#[derive(Clone, Debug)]
struct Dead {
    id: String,
    created_at: i64,
    /// Created and never started.
    created_only: bool,
}

/// Removes the oldest `n` of `unit` (sorted newest first) into `out`.
fn remove_oldest(unit: &mut Vec<Dead>, n: usize, out: &mut Vec<String>) {
    let keep = unit.len().saturating_sub(n);
    out.extend(unit.drain(keep..).map(|d| d.id));
}

/// A question to the sync loop: which of these pod UIDs' content may go.
#[derive(Debug)]
pub struct ContentRequest {
    pub uids: Vec<String>,
    pub reply: oneshot::Sender<HashSet<String>>,
}

/// The collector's side of the question ([`content_channel`]).
#[derive(Clone, Debug)]
pub struct ContentQuery(mpsc::Sender<ContentRequest>);

/// The two ends: the collector asks on the first, the sync loop answers
/// what it receives on the second.
pub fn content_channel() -> (ContentQuery, mpsc::Receiver<ContentRequest>) {
    let (tx, rx) = mpsc::channel(1);
    (ContentQuery(tx), rx)
}

impl ContentQuery {
    /// Those of `uids` whose content may go; none when the sync loop does
    /// not answer (it stopped): nothing of a pod goes on a guess.
    pub async fn removable(&self, uids: Vec<String>) -> HashSet<String> {
        if uids.is_empty() {
            return HashSet::new();
        }
        let (reply, answer) = oneshot::channel();
        if self.0.send(ContentRequest { uids, reply }).await.is_err() {
            return HashSet::new();
        }
        answer.await.unwrap_or_default()
    }
}

/// Computes a collection from the runtime's lists at `now_ns` (Unix ns);
/// `removable`: the pod UIDs whose content may go.
/// Objects without the agent's pod UID label are not the agent's: untouched.
pub fn plan(
    containers: &[v1::Container],
    sandboxes: &[v1::PodSandbox],
    policy: &GcPolicy,
    now_ns: i64,
    removable: &HashSet<String>,
) -> GcPlan {
    let mut out = GcPlan::default();
    let newest_created = now_ns.saturating_sub(policy.min_age.as_nanos() as i64);
    let mut units: HashMap<(String, String), Vec<Dead>> = HashMap::new();
    for c in containers {
        let Some(pod) = c.labels.get(labels::POD_UID) else {
            continue;
        };
        let name = c
            .labels
            .get(labels::CONTAINER_NAME)
            .cloned()
            .or_else(|| c.metadata.as_ref().map(|m| m.name.clone()))
            .unwrap_or_default();
        if c.state == v1::ContainerState::ContainerRunning as i32 || c.created_at > newest_created {
            continue;
        }
        units.entry((pod.clone(), name)).or_default().push(Dead {
            id: c.id.clone(),
            created_at: c.created_at,
            created_only: c.state == v1::ContainerState::ContainerCreated as i32,
        });
    }
    for unit in units.values_mut() {
        unit.sort_by_key(|d| std::cmp::Reverse(d.created_at));
    }
    // A pod whose content may go loses every dead container. Another's
    // newest instance, when it was created and not yet started, is the next
    // one about to run, not a dead one: it stays and does not count, so that
    // the last termination it follows stays too.
    units.retain(|(pod, _), unit| {
        if removable.contains(pod) {
            out.containers.extend(unit.drain(..).map(|d| d.id));
        } else if unit.first().is_some_and(|d| d.created_only) {
            unit.remove(0);
        }
        !unit.is_empty()
    });
    let per_unit = |units: &mut HashMap<_, Vec<Dead>>, keep: usize, out: &mut Vec<String>| {
        for unit in units.values_mut() {
            let n = unit.len().saturating_sub(keep);
            remove_oldest(unit, n, out);
        }
    };
    if policy.max_per_pod_container >= 0 {
        per_unit(
            &mut units,
            policy.max_per_pod_container as usize,
            &mut out.containers,
        );
    }
    let total = |units: &HashMap<_, Vec<Dead>>| units.values().map(Vec::len).sum::<usize>();
    if policy.max_containers >= 0 && total(&units) > policy.max_containers as usize {
        let max = policy.max_containers as usize;
        // An equal share per group first (at least one), then the oldest.
        let share = (max / units.len().max(1)).max(1);
        per_unit(&mut units, share, &mut out.containers);
        let left = total(&units);
        if left > max {
            let mut all: Vec<Dead> = units.values().flatten().cloned().collect();
            all.sort_by_key(|d| std::cmp::Reverse(d.created_at));
            remove_oldest(&mut all, left - max, &mut out.containers);
        }
    }

    // Sandboxes: active when ready or still holding a container that stays.
    let removed: HashSet<&str> = out.containers.iter().map(String::as_str).collect();
    let holding: HashSet<&str> = containers
        .iter()
        .filter(|c| !removed.contains(c.id.as_str()))
        .map(|c| c.pod_sandbox_id.as_str())
        .collect();
    let mut by_pod: HashMap<&str, Vec<&v1::PodSandbox>> = HashMap::new();
    for s in sandboxes {
        if let Some(pod) = s.labels.get(labels::POD_UID) {
            by_pod.entry(pod.as_str()).or_default().push(s);
        }
    }
    for (pod, list) in by_pod.iter_mut() {
        list.sort_by_key(|s| std::cmp::Reverse(s.created_at));
        // The newest stays while the pod's content does.
        let keep = usize::from(!removable.contains(*pod));
        for s in list.iter().skip(keep) {
            let active = s.state == v1::PodSandboxState::SandboxReady as i32
                || holding.contains(s.id.as_str());
            if !active {
                out.sandboxes.push(s.id.clone());
            }
        }
    }
    out.containers.sort();
    out.sandboxes.sort();
    out
}

/// The pods with a dead container or a sandbox that is not ready: those
/// whose content the collector asks about.
fn with_dead_content(containers: &[v1::Container], sandboxes: &[v1::PodSandbox]) -> Vec<String> {
    let dead_containers = containers
        .iter()
        .filter(|c| c.state != v1::ContainerState::ContainerRunning as i32)
        .filter_map(|c| c.labels.get(labels::POD_UID));
    let dead_sandboxes = sandboxes
        .iter()
        .filter(|s| s.state != v1::PodSandboxState::SandboxReady as i32)
        .filter_map(|s| s.labels.get(labels::POD_UID));
    let uids: std::collections::BTreeSet<&String> = dead_containers.chain(dead_sandboxes).collect();
    uids.into_iter().cloned().collect()
}

/// One collection against the runtime: lists, asks which pods' content may
/// go, plans, removes (logs first). Errors are logged per object; the next
/// period tries again.
pub async fn collect(
    cri: &CriClient,
    policy: &GcPolicy,
    log_dir: &Path,
    now_ns: i64,
    pods: &ContentQuery,
) -> GcPlan {
    let containers = match cri.list_containers(None).await {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "container gc: listing containers failed");
            return GcPlan::default();
        }
    };
    let sandboxes = match cri.list_pod_sandboxes(None).await {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "container gc: listing sandboxes failed");
            return GcPlan::default();
        }
    };
    let removable = pods
        .removable(with_dead_content(&containers, &sandboxes))
        .await;
    let plan = plan(&containers, &sandboxes, policy, now_ns, &removable);
    for id in &plan.containers {
        // The kubelet's removeContainerLog: the log file before the container.
        if let Ok(resp) = cri.container_status(id, false).await
            && let Some(path) = resp.status.map(|s| s.log_path).filter(|p| !p.is_empty())
        {
            remove_container_log(log_dir, Path::new(&path));
        }
        match cri.remove_container(id).await {
            Ok(()) => info!(container = %id, "container gc: removed a dead container"),
            Err(e) => warn!(container = %id, error = %e, "container gc: removal failed"),
        }
    }
    for id in &plan.sandboxes {
        match cri.remove_pod_sandbox(id).await {
            Ok(()) => info!(sandbox = %id, "container gc: removed a dead sandbox"),
            Err(e) => warn!(sandbox = %id, error = %e, "container gc: removal failed"),
        }
    }
    debug!(
        containers = plan.containers.len(),
        sandboxes = plan.sandboxes.len(),
        "container gc done"
    );
    plan
}

/// Whether `path` is a file under `log_dir` (`--pod-log-dir`), named without
/// `.` or `..`: a log path the runtime reports is removed only then.
pub fn is_pod_log(log_dir: &Path, path: &Path) -> bool {
    path.is_absolute()
        && path.starts_with(log_dir)
        && path != log_dir
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

/// Removes a dead container's log file (the kubelet's `removeContainerLog`),
/// refusing a path outside the pod log directory (a runtime's answer is not
/// trusted with the host's files); never follows a symlink (it removes it).
fn remove_container_log(log_dir: &Path, path: &Path) {
    if !is_pod_log(log_dir, path) {
        warn!(path = %path.display(), log_dir = %log_dir.display(), "container gc: not removing a log path outside the pod log directory");
        return;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            warn!(path = %path.display(), error = %e, "container gc: cannot remove a container log")
        }
    }
}

/// Collects every `period` until `shutdown`; the first collection is one period
/// after the start, as the kubelet's.
pub async fn run(
    cri: CriClient,
    policy: GcPolicy,
    log_dir: PathBuf,
    period: Duration,
    pods: ContentQuery,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as i64);
                collect(&cri, &policy, &log_dir, now, &pods).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000_000;

    fn container(
        id: &str,
        pod: &str,
        name: &str,
        sandbox: &str,
        running: bool,
        created_s: i64,
    ) -> v1::Container {
        v1::Container {
            id: id.into(),
            pod_sandbox_id: sandbox.into(),
            state: if running {
                v1::ContainerState::ContainerRunning
            } else {
                v1::ContainerState::ContainerExited
            } as i32,
            created_at: created_s * S,
            labels: HashMap::from([
                (labels::POD_UID.to_owned(), pod.to_owned()),
                (labels::CONTAINER_NAME.to_owned(), name.to_owned()),
            ]),
            ..Default::default()
        }
    }

    fn sandbox(id: &str, pod: &str, ready: bool, created_s: i64) -> v1::PodSandbox {
        v1::PodSandbox {
            id: id.into(),
            state: if ready {
                v1::PodSandboxState::SandboxReady
            } else {
                v1::PodSandboxState::SandboxNotready
            } as i32,
            created_at: created_s * S,
            labels: HashMap::from([(labels::POD_UID.to_owned(), pod.to_owned())]),
            ..Default::default()
        }
    }

    /// One running and three dead instances of `app`, two of `side`, a
    /// container that is not ours; two old sandboxes, one still holding a
    /// container.
    fn node() -> (Vec<v1::Container>, Vec<v1::PodSandbox>) {
        let mut foreign = container("x", "p", "app", "zz", false, 1);
        foreign.labels.clear();
        (
            vec![
                container("a1", "p", "app", "s1", false, 10),
                container("a2", "p", "app", "s2", false, 20),
                container("a3", "p", "app", "s3", false, 30),
                container("a4", "p", "app", "s3", true, 40),
                container("b1", "p", "side", "s2", false, 15),
                container("b2", "p", "side", "s3", false, 35),
                foreign,
            ],
            vec![
                sandbox("s1", "p", false, 5),
                sandbox("s2", "p", false, 12),
                sandbox("s3", "p", true, 25),
                sandbox("t1", "q", false, 1),
            ],
        )
    }

    // A log path the runtime reports outside --pod-log-dir (a container
    // named `../x`, a runtime's answer) is never removed.
    #[test]
    fn only_logs_under_the_pod_log_dir_are_removed() {
        let root = tempfile::tempdir().unwrap();
        let logs = root.path().join("pods");
        std::fs::create_dir_all(logs.join("ns_p_u/app")).unwrap();
        let ours = logs.join("ns_p_u/app/0.log");
        let host = root.path().join("host-file");
        std::fs::write(&ours, "log").unwrap();
        std::fs::write(&host, "keep").unwrap();
        let escapes = [
            logs.join("ns_p_u/../../host-file"),
            logs.join("ns_p_u/app/../../../host-file"),
            host.clone(),
            PathBuf::from("host-file"),
            logs.clone(),
        ];
        for p in &escapes {
            assert!(!is_pod_log(&logs, p), "{p:?}");
            remove_container_log(&logs, p);
        }
        assert_eq!(std::fs::read_to_string(&host).unwrap(), "keep");
        assert!(is_pod_log(&logs, &ours));
        remove_container_log(&logs, &ours);
        assert!(!ours.exists());
    }

    #[test]
    fn the_kubelet_s_policy_table() {
        let (containers, sandboxes) = node();
        let now = 100 * S;
        let policy = |min_age: u64, per: i32, max: i32| GcPolicy {
            min_age: Duration::from_secs(min_age),
            max_per_pod_container: per,
            max_containers: max,
        };
        let cases = [
            // The kubelet's defaults: the newest dead instance of each container
            // stays; s1 and s2 are then empty and not the newest: removed. The
            // foreign container and q's only sandbox stay.
            (policy(0, 1, -1), vec!["a1", "a2", "b1"], vec!["s1", "s2"]),
            // Young containers stay: only what was created 75 s ago or before.
            (policy(75, 1, -1), vec!["a1"], vec!["s1"]),
            // No per-container limit, two on the node: a share of one per group.
            (policy(0, -1, 2), vec!["a1", "a2", "b1"], vec!["s1", "s2"]),
            // One on the node: the groups keep one each, then the oldest goes.
            (
                policy(0, -1, 1),
                vec!["a1", "a2", "a3", "b1"],
                vec!["s1", "s2"],
            ),
            // Nothing to remove.
            (policy(0, 5, -1), vec![], vec![]),
        ];
        for (p, want_containers, want_sandboxes) in cases {
            let got = plan(&containers, &sandboxes, &p, now, &HashSet::new());
            assert_eq!(
                (got.containers, got.sandboxes),
                (
                    want_containers
                        .iter()
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>(),
                    want_sandboxes
                        .iter()
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>()
                ),
                "{p:?}"
            );
        }
    }

    /// A pod whose content may go (deleted, its worker finished) loses
    /// every dead container and every sandbox that is not ready, its newest
    /// included; a running container and a ready sandbox stay, and so does
    /// every other pod's newest dead instance.
    #[test]
    fn a_removable_pod_loses_all_its_dead_content() {
        let (mut containers, mut sandboxes) = node();
        containers.push(container("c1", "q", "app", "t1", false, 2));
        sandboxes.push(sandbox("t2", "q", false, 3));
        let policy = GcPolicy::default();
        let now = 100 * S;
        let kept = plan(&containers, &sandboxes, &policy, now, &HashSet::new());
        assert_eq!(kept.containers, ["a1", "a2", "b1"]);
        // t1 holds q's dead c1.
        assert_eq!(kept.sandboxes, ["s1", "s2"]);
        let q = HashSet::from(["q".to_owned()]);
        let gone = plan(&containers, &sandboxes, &policy, now, &q);
        assert_eq!(gone.containers, ["a1", "a2", "b1", "c1"]);
        assert_eq!(gone.sandboxes, ["s1", "s2", "t1", "t2"]);
        let p = HashSet::from(["p".to_owned()]);
        let gone = plan(&containers, &sandboxes, &policy, now, &p);
        // a4 runs: it and its ready sandbox s3 stay; q keeps c1 and t1.
        assert_eq!(gone.containers, ["a1", "a2", "a3", "b1", "b2"]);
        assert_eq!(gone.sandboxes, ["s1", "s2"]);
        // Young containers stay even then.
        let young = GcPolicy {
            min_age: Duration::from_secs(99),
            ..policy
        };
        let gone = plan(&containers, &sandboxes, &young, now, &q);
        assert_eq!(gone.containers, Vec::<String>::new());
        assert_eq!(gone.sandboxes, ["t2"]);
    }

    /// A collection between a restart's CreateContainer and StartContainer:
    /// the new instance, created and not started, does not take the place
    /// of the last termination (lastState is read from it). An older
    /// instance created and never started (a failed start) is dead.
    #[test]
    fn a_container_about_to_start_does_not_replace_the_last_termination() {
        let created = |id, created_s| v1::Container {
            state: v1::ContainerState::ContainerCreated as i32,
            ..container(id, "r", "app", "w1", false, created_s)
        };
        let containers = vec![
            container("r1", "r", "app", "w1", false, 10),
            created("r2", 20),
            container("r3", "r", "app", "w1", false, 30),
            created("r4", 40),
        ];
        let sandboxes = vec![sandbox("w1", "r", true, 5)];
        let policy = GcPolicy::default();
        let got = plan(&containers, &sandboxes, &policy, 100 * S, &HashSet::new());
        assert_eq!(got.containers, ["r1", "r2"]);
        let r = HashSet::from(["r".to_owned()]);
        let got = plan(&containers, &sandboxes, &policy, 100 * S, &r);
        assert_eq!(got.containers, ["r1", "r2", "r3", "r4"]);
    }

    #[test]
    fn the_pods_asked_about_have_dead_content() {
        let (containers, sandboxes) = node();
        let mut all = containers;
        all.push(container("l1", "live", "app", "u1", true, 1));
        let mut boxes = sandboxes;
        boxes.push(sandbox("u1", "live", true, 1));
        assert_eq!(with_dead_content(&all, &boxes), ["p", "q"]);
    }

    /// No answer (the sync loop stopped): nothing goes.
    #[tokio::test]
    async fn an_unanswered_question_removes_nothing() {
        let (query, rx) = content_channel();
        drop(rx);
        assert!(query.removable(vec!["p".into()]).await.is_empty());
        let (query, mut rx) = content_channel();
        let answer = tokio::spawn(async move {
            let req = rx.recv().await.expect("a request");
            let _ = req
                .reply
                .send(req.uids.into_iter().filter(|u| u == "q").collect());
        });
        assert_eq!(
            query.removable(vec!["p".into(), "q".into()]).await,
            HashSet::from(["q".to_owned()])
        );
        answer.await.unwrap();
    }
}
