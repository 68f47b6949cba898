//! The stock kubelet 1.37 as the full agent's rival (issues #29, #30): the
//! real kubelet, built from its Go module by `cargo xtask setup`, run
//! standalone on the benchmark's containerd with the same static pods as the
//! agent's modes, started one at a time and then killed from the host at
//! random times. Three ways:
//!
//! * [`KubeletMode::Generic`]: its generic PLEG (the 1 s relist), directly on
//!   containerd;
//! * [`KubeletMode::Evented`]: `EventedPLEG=true`, containerd 1.7's own
//!   GetContainerEvents stream;
//! * [`KubeletMode::ProxyEvented`]: `EventedPLEG=true` behind `evpleg
//!   cri-proxy`, whose kernel PLEG serves the event stream.
//!
//! Its pods' containers are in containerd's `/k8s.io/<id>`
//! (`KubeletCgroups::ContainerdNamespace`), where a kernel PLEG sees them:
//! the stopwatch is the kernel's exit timestamp, from a kernel PLEG beside
//! it (the proxy's own in the proxy mode), as for the agent's relist modes.
//! Its one stage is `status-held`: the first poll of its read-only `/pods`
//! (every [`DEATH_POLL`]) showing the container terminated, the status
//! manager's status as it serves it, so up to one poll and one HTTP request
//! later than held. Start latency: the manifest's rename into its directory
//! to the first poll (every [`super::agent::POLL`]) showing the container
//! running; the CRI time from its own
//! `kubelet_runtime_operations_duration_seconds`.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use evpleg_core::clock::monotonic_ns;
use evpleg_core::ids::ContainerId;
use evpleg_pleg::stages::{self, Stage};
use evpleg_tests::containerd::Containerd;
use evpleg_tests::stock_kubelet::{KubeletCgroups, KubeletOptions, StockKubelet};
use serde_json::Value;

use crate::agent::{AgentSeries, NODE, POLL, app, cri_delta, cri_sums_in, kill_over, pod_name};
use crate::results::StartSamples;

/// How often its `/pods` is polled for the deaths.
pub const DEATH_POLL: Duration = Duration::from_millis(5);

/// The report's note on these rows.
pub const NOTE: &str = "Stock kubelet (`kubelet-1.37-*`): the real kubelet 1.37, built from \
     its Go module by `cargo xtask setup`, standalone on the same containerd (a fresh one for \
     each repetition, its pods' containers in containerd's `/k8s.io/<id>`, no pod cgroups), the \
     same static pods as the agent's, started one at a time, then killed at random times. \
     `kubelet-1.37-generic`: its generic PLEG; `kubelet-1.37-evented`: `EventedPLEG=true` on \
     containerd 1.7's own event stream; `kubelet-1.37-cri-proxy`: `EventedPLEG=true` behind \
     `evpleg cri-proxy` (the proxy's kernel PLEG serves the stream). The stopwatch is a kernel \
     PLEG beside it (the proxy's own behind the proxy). Its `status-held` is the first poll of \
     its read-only `/pods`, every 5 ms, showing the container terminated (the status manager's \
     status as served: up to one poll and one request late); its start latency runs from the \
     manifest's rename to the first poll, every 10 ms, showing the container running, and \
     its CRI time is its own `kubelet_runtime_operations_duration_seconds`.";

/// How the stock kubelet meets the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KubeletMode {
    Generic,
    Evented,
    ProxyEvented,
}

impl KubeletMode {
    pub fn name(self) -> &'static str {
        match self {
            Self::Generic => "kubelet-1.37-generic",
            Self::Evented => "kubelet-1.37-evented",
            Self::ProxyEvented => "kubelet-1.37-cri-proxy",
        }
    }
}

/// One repetition (`rep` 0 the warm-up): a fresh kubelet ([`Running`]),
/// `n` static pods started one at a time and killed over `window`, then the
/// pods removed, the kubelet stopped and what it left in the runtime
/// removed, also when the repetition fails. Returns its progress line.
pub async fn repetition(
    containerd: &Containerd,
    series: &mut AgentSeries,
    mode: KubeletMode,
    rep: usize,
    n: usize,
    window: Duration,
) -> Result<String> {
    crate::stages::start();
    // The proxy's own kernel PLEG records the exits in the proxy mode.
    let _stopwatch =
        (mode != KubeletMode::ProxyEvented).then(evpleg_tests::cri_pod::ExitClock::start);
    let mut running = Running::start(containerd, mode, &rep.to_string()).await?;
    let mut uids = Vec::new();
    let outcome = measure(&mut running, series, rep, n, window, &mut uids).await;
    running.finish(containerd, &uids).await;
    outcome
}

/// A fresh stock kubelet in one mode (behind a fresh proxy in the proxy
/// mode) with a directory of its own.
pub(crate) struct Running {
    pub kubelet: StockKubelet,
    pub proxy: Option<evpleg::cri_proxy::CriProxy>,
    written: Vec<String>,
}

impl Running {
    /// Starts the kubelet in `mode`; `tag` names its directory among the
    /// run's (a repetition's number, a part's name).
    pub async fn start(containerd: &Containerd, mode: KubeletMode, tag: &str) -> Result<Self> {
        Self::start_against(containerd, mode, tag, None).await
    }

    /// As [`Self::start`], with `kubeconfig` (when given) the API server it
    /// registers its Node with and takes its pods from.
    pub async fn start_against(
        containerd: &Containerd,
        mode: KubeletMode,
        tag: &str,
        kubeconfig: Option<&std::path::Path>,
    ) -> Result<Self> {
        // Short: the kubelet's unix sockets below it (its pod-resources
        // endpoint) must fit in 108 bytes.
        let short = match mode {
            KubeletMode::Generic => "g",
            KubeletMode::Evented => "e",
            KubeletMode::ProxyEvented => "p",
        };
        let base = containerd.base().join(format!("k{short}{tag}"));
        containerd.track_root_cgroup(evpleg_tests::containerd::CRI_NAMESPACE);
        let proxy = match mode {
            KubeletMode::ProxyEvented => {
                Some(evpleg_tests::cri_proxy::proxy(containerd, &[]).await.0)
            }
            KubeletMode::Generic | KubeletMode::Evented => None,
        };
        let endpoint = match mode {
            KubeletMode::ProxyEvented => {
                format!("unix://{}", containerd.base().join("proxy.sock").display())
            }
            KubeletMode::Generic | KubeletMode::Evented => containerd.endpoint(),
        };
        let opts = KubeletOptions {
            endpoint,
            node: NODE.into(),
            evented_pleg: mode != KubeletMode::Generic,
            cgroups: KubeletCgroups::ContainerdNamespace,
        };
        match StockKubelet::start_against(&base, &opts, kubeconfig).await {
            Ok(kubelet) => Ok(Self {
                kubelet,
                proxy,
                written: Vec::new(),
            }),
            Err(e) => {
                if let Some(p) = proxy {
                    p.stop().await;
                }
                Err(e).context("starting the stock kubelet")
            }
        }
    }

    /// Writes the static pod `name` (busybox `sleep`, restartPolicy Never)
    /// into its manifest directory.
    pub fn write_pod(&mut self, name: &str) {
        let file = format!("{name}.yaml");
        self.kubelet.write(
            &file,
            &evpleg_tests::e2e::manifest(name, "Never", "sleep 1000000", ""),
        );
        self.written.push(file);
    }

    /// Its pods as its read-only `/pods` serves them (empty when it does not
    /// answer).
    pub async fn pods(&self) -> Value {
        self.kubelet.pods().await.unwrap_or_default()
    }

    /// Clean-up, whatever happened: the pods removed through the kubelet,
    /// the kubelet stopped, what it left of the pods `uids` in the runtime
    /// removed, the proxy stopped.
    pub async fn finish(self, containerd: &Containerd, uids: &[String]) {
        for file in &self.written {
            self.kubelet.remove(file);
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while tokio::time::Instant::now() < deadline
            && self.kubelet.pods().await.is_none_or(|list| {
                list["items"]
                    .as_array()
                    .is_some_and(|items| !items.is_empty())
            })
        {
            tokio::time::sleep(POLL).await;
        }
        drop(self.kubelet);
        // Its deleted pods' sandboxes wait for its container GC (a minute):
        // removed here, so that nothing after it meets them.
        let client = containerd.client().await;
        for s in crate::agent::runtime_clean(&client, uids, Duration::ZERO).await {
            let _ = client.stop_pod_sandbox(&s).await;
            let _ = client.remove_pod_sandbox(&s).await;
        }
        if let Some(p) = self.proxy {
            p.stop().await;
        }
    }
}

/// The pod `name` in a `/pods` list.
fn find<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
    let full = format!("{name}-{NODE}");
    list["items"]
        .as_array()?
        .iter()
        .find(|p| p["metadata"]["name"] == full.as_str())
}

async fn cri_sums(kubelet: &StockKubelet) -> std::collections::BTreeMap<String, f64> {
    let text = kubelet.metrics().await.unwrap_or_default();
    cri_sums_in(&text, "kubelet_runtime_operations_duration_seconds")
}

async fn measure(
    running: &mut Running,
    series: &mut AgentSeries,
    rep: usize,
    n: usize,
    window: Duration,
    uids: &mut Vec<String>,
) -> Result<String> {
    // Starts, one pod at a time.
    let mut ids = Vec::new();
    let mut starts = StartSamples::default();
    for i in 0..n {
        let name = pod_name(rep, i);
        let before = cri_sums(&running.kubelet).await;
        let at = monotonic_ns();
        running.write_pod(&name);
        let kubelet = &running.kubelet;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let id = loop {
            let list = kubelet.pods().await.unwrap_or_default();
            // Its UID as soon as it shows, for the clean-up if it never runs.
            if let Some(uid) = find(&list, &name).and_then(|p| p["metadata"]["uid"].as_str())
                && !uids.iter().any(|u| u == uid)
            {
                uids.push(uid.to_owned());
            }
            if let Some(p) = find(&list, &name)
                && let Some(c) = app(p)
                && !c["state"]["running"].is_null()
                && let Some(id) = c["containerID"].as_str()
            {
                break id.rsplit("://").next().unwrap_or(id).to_owned();
            }
            if tokio::time::Instant::now() > deadline {
                let seen = find(&list, &name)
                    .map_or_else(|| "not in /pods".to_owned(), |p| p["status"].to_string());
                bail!(
                    "pod {name}: not running within 60 s; its status: {seen}; kubelet log:\n{}",
                    kubelet.log_tail()
                );
            }
            tokio::time::sleep(POLL).await;
        };
        let shown = monotonic_ns();
        let after = cri_sums(kubelet).await;
        let ms = shown.saturating_sub(at) as f64 / 1e6;
        starts.push(ms, cri_delta(&before, &after));
        ids.push(id);
    }
    let kubelet = &running.kubelet;
    let mut pids = Vec::new();
    for id in &ids {
        let pid = evpleg_tests::e2e::find_container_pid(id)
            .with_context(|| format!("no main process for container {id}"))?;
        pids.push(pid);
    }
    // The deaths, polled while they come: each container's first poll
    // showing it terminated is its `status-held`.
    let polling = async {
        let mut left: Vec<&str> = ids.iter().map(String::as_str).collect();
        let deadline = tokio::time::Instant::now() + window + Duration::from_secs(10);
        while !left.is_empty() && tokio::time::Instant::now() < deadline {
            let list = kubelet.pods().await.unwrap_or_default();
            let now = monotonic_ns();
            left.retain(|id| {
                let ended = list["items"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(app)
                    .any(|c| {
                        c["containerID"].as_str().is_some_and(|c| c.ends_with(id))
                            && !c["state"]["terminated"].is_null()
                    });
                if ended && let Some(id) = ContainerId::parse(id) {
                    stages::record(Stage::StatusHeld, &id, now);
                }
                !ended
            });
            tokio::time::sleep(DEATH_POLL).await;
        }
        left.len()
    };
    let ((), unseen) = tokio::join!(kill_over(&pids, window), polling);
    let records = crate::stages::snapshot();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let (stages, missing) = crate::stages::samples(&refs, &records);
    // Deaths it never showed within the wait are lost, as the agent's.
    Ok(series.record(rep, n, &starts, stages, missing + unseen))
}
