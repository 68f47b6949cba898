//! Death to the pod's status in the API server (issue #30): what a user of the
//! cluster sees, not a node's own view. The real kube-apiserver and etcd
//! (built by `cargo xtask setup`, `evpleg_tests::control_plane`) serve the
//! node; pods are API pods bound to it (`spec.nodeName`, restartPolicy Never,
//! busybox `sleep`), created together, then their main processes killed from
//! the host at random times. A watch on their namespace is the other end of
//! the stopwatch: the first watch event in which the app container is
//! terminated, taken from the kernel's exit timestamp (the agent's own kernel
//! PLEG in `ebpf` mode and the proxy's behind it, otherwise a kernel PLEG
//! beside the node, as in the `agent-killed` workload).
//!
//! The modes are the node agents a user would choose between: the agent in
//! `ebpf` mode, and the stock kubelet 1.37 with its generic PLEG, with its
//! Evented PLEG on containerd 1.7's own stream, and behind `evpleg
//! cri-proxy`. Each repetition of each mode runs a fresh node (the same Node
//! object, `bench`, taken over) and a fresh namespace; the modes are
//! interleaved repetition by repetition, as in the `agent-killed` workload.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use evpleg_core::clock::monotonic_ns;
use evpleg_pleg::stages::Stage;
use evpleg_tests::containerd::Containerd;
use evpleg_tests::control_plane::ControlPlane;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;

use crate::agent::{AgentMode, NODE, kill_over};
use crate::kubelet::KubeletMode;
use crate::results::Latency;
use crate::stats::{Percentiles, Summary};

/// The workload's name in the results.
pub const WORKLOAD: &str = "api-killed";
/// Its one stage: the watch event showing the container terminated.
pub const STAGE: &str = "api-status";

/// The modes, in the report's order.
pub const MODES: [AgentMode; 4] = [
    AgentMode::Pleg(evpleg_pleg::PlegMode::Ebpf),
    AgentMode::Kubelet(KubeletMode::Generic),
    AgentMode::Kubelet(KubeletMode::Evented),
    AgentMode::Kubelet(KubeletMode::ProxyEvented),
];

/// How long the pods of a repetition may take to run, and to be gone once
/// deleted.
const SETTLE: Duration = Duration::from_secs(120);

/// The report's note on this workload.
pub const NOTE: &str = "API status (`api-killed`): the real kube-apiserver 1.37 and etcd on \
     loopback serve the node (the agent or the stock kubelet 1.37, with the node's identity under \
     the Node authorizer and NodeRestriction); each repetition creates its pods as API pods bound \
     to the node (busybox `sleep`, restartPolicy Never) in a fresh namespace, waits until all \
     run, then kills their main processes from the host at random times. `api-status` is the \
     first event of a watch on the namespace showing the container terminated, from the \
     kernel's exit timestamp: the status as any client of the cluster first sees it (the \
     node's status write, the API server's and etcd's commit and the watch's delivery \
     included). The stock kubelet's modes run as in `agent-killed`.";

/// Samples of one mode.
#[derive(Default)]
struct ModeSeries {
    reps: Vec<Percentiles>,
    samples: Vec<f64>,
    lost: usize,
}

/// Runs the workload: `reps` counted repetitions (after a warm-up) of `n`
/// pods per mode, each mode's deaths spread over `window`.
pub async fn run(
    containerd: &Containerd,
    modes: &[AgentMode],
    reps: usize,
    n: usize,
    window: Duration,
) -> Result<Vec<Latency>> {
    let cp = ControlPlane::start()
        .await
        .context("starting etcd and kube-apiserver")?;
    let kubeconfig = cp.node_kubeconfig(NODE);
    let mut series: Vec<ModeSeries> = modes.iter().map(|_| ModeSeries::default()).collect();
    for rep in 0..=reps {
        for k in 0..modes.len() {
            crate::interrupt::check()?;
            let i = (k + rep) % modes.len();
            let (samples, lost) =
                repetition(containerd, &cp, &kubeconfig, modes[i], rep, n, window).await?;
            let p50 = Percentiles::of(&samples).map_or(f64::NAN, |p| p.p50);
            crate::progress(&format!(
                "  api, {}, {}: api-status p50 {:.1} ms, {lost} lost",
                modes[i].name(),
                crate::rep_label(rep),
                p50 / 1000.0
            ));
            if rep > 0 {
                let s = &mut series[i];
                s.reps.extend(Percentiles::of(&samples));
                s.samples.extend(samples);
                s.lost += lost;
            }
        }
    }
    Ok(modes
        .iter()
        .zip(series)
        .map(|(mode, s)| Latency {
            mode: mode.name().to_owned(),
            workload: WORKLOAD.to_owned(),
            stage: STAGE.to_owned(),
            summary: Summary::of(&s.reps),
            lost: s.lost,
            samples_us: s.samples,
        })
        .collect())
}

/// A node in one of the modes.
enum Node {
    Agent(crate::agent::Running),
    Kubelet(crate::kubelet::Running),
}

impl Node {
    async fn start(
        containerd: &Containerd,
        mode: AgentMode,
        tag: &str,
        kubeconfig: &Path,
    ) -> Result<Self> {
        Ok(match mode {
            AgentMode::Kubelet(k) => Self::Kubelet(
                crate::kubelet::Running::start_against(containerd, k, tag, Some(kubeconfig))
                    .await?,
            ),
            _ => Self::Agent(
                crate::agent::Running::start_against(containerd, mode, tag, Some(kubeconfig))
                    .await?,
            ),
        })
    }

    async fn finish(self, containerd: &Containerd, uids: &[String]) {
        match self {
            Self::Agent(a) => a.finish(containerd, uids).await,
            Self::Kubelet(k) => k.finish(containerd, uids).await,
        }
    }
}

/// One repetition of one mode; returns its samples (us) and how many deaths
/// the API never showed.
async fn repetition(
    containerd: &Containerd,
    cp: &ControlPlane,
    kubeconfig: &Path,
    mode: AgentMode,
    rep: usize,
    n: usize,
    window: Duration,
) -> Result<(Vec<f64>, usize)> {
    crate::stages::start();
    // A kernel PLEG in-process records the exits: the agent's own in
    // `ebpf` mode, the proxy's behind it, otherwise this one.
    let own_kernel = matches!(
        mode,
        AgentMode::Pleg(evpleg_pleg::PlegMode::Ebpf)
            | AgentMode::Kubelet(KubeletMode::ProxyEvented)
    );
    let _stopwatch = (!own_kernel).then(evpleg_tests::cri_pod::ExitClock::start);
    let tag = format!("api{rep}");
    let node = Node::start(containerd, mode, &tag, kubeconfig).await?;
    let ns = cp.namespace("bench").await;
    let pods: Api<Pod> = Api::namespaced(cp.admin().await, &ns);
    let mut uids = Vec::new();
    let outcome = measure(&pods, n, window, &mut uids).await;
    // The pods deleted through the API (the node stops what still runs and
    // finishes the deletion), whatever happened.
    let _ = pods
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let deadline = tokio::time::Instant::now() + SETTLE;
    while tokio::time::Instant::now() < deadline
        && pods
            .list(&ListParams::default())
            .await
            .map_or(true, |l| !l.items.is_empty())
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    node.finish(containerd, &uids).await;
    outcome
}

/// What the watch has shown of one pod's app container.
#[derive(Default)]
struct Seen {
    /// Its container id once running.
    id: Option<String>,
    /// When (CLOCK_MONOTONIC ns) a watch event first showed it terminated.
    ended_ns: Option<u64>,
}

async fn measure(
    pods: &Api<Pod>,
    n: usize,
    window: Duration,
    uids: &mut Vec<String>,
) -> Result<(Vec<f64>, usize)> {
    let mut stream = pods
        .watch(&WatchParams::default(), "0")
        .await
        .context("watching the pods")?
        .boxed();
    for i in 0..n {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("p{i}")},
            "spec": {
                "nodeName": NODE,
                "hostNetwork": true,
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 3,
                "containers": [{
                    "name": "app",
                    "image": evpleg_tests::containerd::BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", "sleep 1000000"],
                }],
            },
        }))?;
        let made = pods
            .create(&PostParams::default(), &pod)
            .await
            .with_context(|| format!("creating pod p{i}"))?;
        uids.extend(made.metadata.uid);
    }
    let mut seen: BTreeMap<String, Seen> = BTreeMap::new();
    let mut next = async |seen: &mut BTreeMap<String, Seen>, until: tokio::time::Instant| {
        match tokio::time::timeout_at(until, stream.try_next()).await {
            Ok(Ok(Some(WatchEvent::Added(p) | WatchEvent::Modified(p)))) => {
                let at = monotonic_ns();
                let name = p.metadata.name.clone().unwrap_or_default();
                let entry = seen.entry(name).or_default();
                let status = p
                    .status
                    .as_ref()
                    .and_then(|s| s.container_statuses.as_ref());
                for c in status.into_iter().flatten().filter(|c| c.name == "app") {
                    let state = c.state.as_ref();
                    if state.is_some_and(|s| s.running.is_some())
                        && let Some(id) = &c.container_id
                    {
                        entry.id = Some(id.rsplit("://").next().unwrap_or(id).to_owned());
                    }
                    if state.is_some_and(|s| s.terminated.is_some()) && entry.ended_ns.is_none() {
                        entry.ended_ns = Some(at);
                    }
                }
                Ok(true)
            }
            Ok(Ok(Some(WatchEvent::Error(e)))) => bail!("the watch failed: {e:?}"),
            Ok(Ok(Some(_))) => Ok(true),
            Ok(Ok(None)) => bail!("the watch ended"),
            Ok(Err(e)) => bail!("the watch failed: {e}"),
            Err(_) => Ok(false),
        }
    };
    let deadline = tokio::time::Instant::now() + SETTLE;
    while seen.values().filter(|s| s.id.is_some()).count() < n {
        if !next(&mut seen, deadline).await? {
            bail!(
                "{} of {n} pods running after {SETTLE:?}",
                seen.values().filter(|s| s.id.is_some()).count()
            );
        }
    }
    let ids: Vec<String> = seen.values().filter_map(|s| s.id.clone()).collect();
    let mut pids = Vec::new();
    for id in &ids {
        pids.push(
            evpleg_tests::e2e::find_container_pid(id)
                .with_context(|| format!("no main process for container {id}"))?,
        );
    }
    let watching = async {
        let deadline = tokio::time::Instant::now() + window + Duration::from_secs(30);
        while seen.values().any(|s| s.ended_ns.is_none()) {
            if !next(&mut seen, deadline).await? {
                break;
            }
        }
        anyhow::Ok(())
    };
    let ((), watched) = tokio::join!(kill_over(&pids, window), watching);
    watched?;
    let exits = kernel_exits(&ids);
    let mut samples = Vec::new();
    for s in seen.values() {
        let exit = s.id.as_ref().and_then(|id| exits.get(id));
        if let (Some(&exit), Some(ended)) = (exit, s.ended_ns) {
            samples.push(ended.saturating_sub(exit) as f64 / 1000.0);
        }
    }
    let lost = n - samples.len();
    Ok((samples, lost))
}

/// The kernel's exit timestamp of each of `ids`, from the stage log.
fn kernel_exits(ids: &[String]) -> HashMap<String, u64> {
    let records = crate::stages::snapshot();
    ids.iter()
        .filter_map(|id| {
            let key = evpleg_pleg::stages::key_of(id)?;
            let at = records
                .iter()
                .filter(|r| r.key == key && r.stage == Stage::Kernel)
                .map(|r| r.at_ns)
                .min()?;
            Some((id.clone(), at))
        })
        .collect()
}
