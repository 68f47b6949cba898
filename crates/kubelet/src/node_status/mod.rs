//! The Node object and its heartbeats, as the kubelet's `pkg/kubelet/nodestatus`
//! and `pkg/kubelet/nodelease` (with `--kubeconfig` only):
//!
//! * registration (`registerWithAPIServer`): the Node is created with the
//!   node's labels and taints ([`crate::admission::node::NodeInfo`]) and its
//!   capacity and allocatable (cpu, memory, pods); for one that already
//!   exists, as the kubelet's `updateDefaultLabels`, only the default labels
//!   (`kubernetes.io/hostname`, `kubernetes.io/os`, `kubernetes.io/arch`) are
//!   patched (`--node-labels` and taints apply at creation only);
//! * the Lease `kube-node-lease/<node>` (holder the node, `leaseDurationSeconds`
//!   from `--node-lease-duration-seconds`, 40) renewed every quarter of its
//!   duration, as the kubelet's lease controller (10 s by default), created
//!   when missing; a conflict is retried at the next renewal;
//! * the node status checked every `--node-status-update-frequency` (10 s)
//!   and patched when a condition changed or 5 min passed since the last
//!   patch (`nodeStatusReportFrequency`): Ready (True `KubeletReady`, or
//!   False `KubeletNotReady` with the runtime's errors ([`runtime_state`]:
//!   "container runtime is down", its network not ready) and "PLEG is not
//!   healthy: ..." when the health check of `/healthz` fails), MemoryPressure (`memory.available` below the
//!   kubelet's hard eviction default 100Mi, from `/proc/meminfo`
//!   MemAvailable), DiskPressure (`nodefs.available` below 10 % of the root
//!   filesystem), PIDPressure (never: the kubelet has no default PID
//!   threshold).
//!
//! The addresses, the kubelet server's port and the node's system info are
//! [`info`]'s, written at registration and with every status patch.
//!
//! Differences: the status carries no images; no eviction is done under pressure; labels or taints
//! changed by others are not reconciled.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeSpec, NodeStatus};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::admission::Allocatable;
use crate::admission::node::NodeInfo;

pub mod info;
pub mod runtime_state;

/// The namespace of node leases.
pub const LEASE_NAMESPACE: &str = "kube-node-lease";
/// The kubelet's `nodeStatusReportFrequency`.
pub const REPORT_FREQUENCY: Duration = Duration::from_secs(300);
/// The kubelet's hard eviction default `memory.available<100Mi`.
pub const MEMORY_AVAILABLE_MIN: i64 = 100 << 20;
/// The kubelet's hard eviction default `nodefs.available<10%`.
pub const NODEFS_AVAILABLE_MIN_PERCENT: u64 = 10;

/// The health check (the `/healthz` answer): Err with its message.
pub type Health = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What the node status needs.
pub struct NodeStatusParts {
    pub client: kube::Client,
    pub node: NodeInfo,
    pub capacity: Allocatable,
    pub allocatable: Allocatable,
    pub lease_duration_seconds: i32,
    pub update_frequency: Duration,
    pub health: Health,
    /// Addresses, the kubelet server's port, the system info.
    pub identity: info::NodeIdentity,
}

impl std::fmt::Debug for NodeStatusParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeStatusParts")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

fn resources(a: &Allocatable) -> BTreeMap<String, Quantity> {
    [
        ("cpu", format!("{}m", a.cpu_milli)),
        ("memory", a.memory_bytes.to_string()),
        ("ephemeral-storage", a.ephemeral_storage_bytes.to_string()),
        ("pods", a.pods.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), Quantity(v)))
    .collect()
}

/// The Node registered for `node`.
pub fn node_object(
    node: &NodeInfo,
    capacity: &Allocatable,
    allocatable: &Allocatable,
    identity: &info::NodeIdentity,
) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(node.name.clone()),
            labels: Some(node.labels.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            taints: (!node.taints.is_empty()).then(|| node.taints.clone()),
            ..NodeSpec::default()
        }),
        status: Some(NodeStatus {
            capacity: Some(resources(capacity)),
            allocatable: Some(resources(allocatable)),
            addresses: Some(identity.addresses()),
            daemon_endpoints: Some(identity.daemon_endpoints()),
            node_info: Some(identity.system.clone()),
            ..NodeStatus::default()
        }),
    }
}

/// The node's lease, renewed at `now`.
pub fn lease_object(node: &str, duration_seconds: i32, now: Timestamp) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(node.into()),
            namespace: Some(LEASE_NAMESPACE.into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.into()),
            lease_duration_seconds: Some(duration_seconds),
            renew_time: Some(MicroTime(now)),
            ..LeaseSpec::default()
        }),
    }
}

/// What was measured: the health check, available memory, available and
/// total bytes of the root filesystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub health: Result<(), String>,
    pub memory_available: Option<i64>,
    pub nodefs: Option<(u64, u64)>,
}

/// A condition: type, status, reason, message.
pub type Condition = (&'static str, bool, &'static str, String);

/// The conditions for what was observed, in the kubelet's order.
pub fn conditions(o: &Observed) -> Vec<Condition> {
    let memory = o.memory_available.is_some_and(|m| m < MEMORY_AVAILABLE_MIN);
    let disk = o.nodefs.is_some_and(|(avail, total)| {
        total > 0 && avail * 100 < total * NODEFS_AVAILABLE_MIN_PERCENT
    });
    let ready = match &o.health {
        Ok(()) => (
            "Ready",
            true,
            "KubeletReady",
            "kubelet is posting ready status".to_owned(),
        ),
        Err(e) => {
            let first = e.lines().next().unwrap_or_default();
            let message = if first.starts_with("pleg") {
                format!("PLEG is not healthy: {first}")
            } else {
                first.to_owned()
            };
            ("Ready", false, "KubeletNotReady", message)
        }
    };
    vec![
        if memory {
            (
                "MemoryPressure",
                true,
                "KubeletHasInsufficientMemory",
                "kubelet has insufficient memory available".into(),
            )
        } else {
            (
                "MemoryPressure",
                false,
                "KubeletHasSufficientMemory",
                "kubelet has sufficient memory available".into(),
            )
        },
        if disk {
            (
                "DiskPressure",
                true,
                "KubeletHasDiskPressure",
                "kubelet has disk pressure".into(),
            )
        } else {
            (
                "DiskPressure",
                false,
                "KubeletHasNoDiskPressure",
                "kubelet has no disk pressure".into(),
            )
        },
        (
            "PIDPressure",
            false,
            "KubeletHasSufficientPID",
            "kubelet has sufficient PID available".into(),
        ),
        ready,
    ]
}

/// Measures the host.
fn observe(health: &Health) -> Observed {
    let memory_available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
            .map(|kb| kb * 1024)
    });
    let nodefs = evpleg_core::machine::filesystem_bytes(std::path::Path::new("/"));
    Observed {
        health: health(),
        memory_available,
        nodefs,
    }
}

/// The status patch: `conditions` with their transition times kept from
/// `previous` when the status did not change.
fn status_patch(
    conds: &[Condition],
    previous: &[NodeCondition],
    now: Timestamp,
) -> Vec<NodeCondition> {
    conds
        .iter()
        .map(|(kind, ok, reason, message)| {
            let status = if *ok { "True" } else { "False" };
            let transition = previous
                .iter()
                .find(|c| c.type_ == *kind && c.status == status)
                .and_then(|c| c.last_transition_time.clone())
                .unwrap_or(Time(now));
            NodeCondition {
                type_: (*kind).into(),
                status: status.into(),
                reason: Some((*reason).into()),
                message: Some(message.clone()),
                last_heartbeat_time: Some(Time(now)),
                last_transition_time: Some(transition),
            }
        })
        .collect()
}

/// Registers the node, then renews its lease and reports its status until
/// `shutdown`.
pub async fn run(parts: NodeStatusParts, shutdown: CancellationToken) {
    let name = parts.node.name.clone();
    let nodes: Api<Node> = Api::all(parts.client.clone());
    let leases: Api<Lease> = Api::namespaced(parts.client.clone(), LEASE_NAMESPACE);
    let node = node_object(
        &parts.node,
        &parts.capacity,
        &parts.allocatable,
        &parts.identity,
    );
    loop {
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => {
                info!(node = %name, "node registered");
                break;
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                match update_default_labels(&nodes, &parts.node).await {
                    Ok(()) => {
                        info!(node = %name, "node already registered; default labels reconciled");
                        break;
                    }
                    Err(e) => {
                        warn!(node = %name, error = %e, "node registration failed (retryable)")
                    }
                }
            }
            Err(e) => warn!(node = %name, error = %e, "node registration failed (retryable)"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
    let renew = Duration::from_millis((parts.lease_duration_seconds.max(1) as u64) * 250);
    let mut lease_tick = tokio::time::interval(renew);
    let mut status_tick = tokio::time::interval(parts.update_frequency);
    let mut written: Option<(Vec<Condition>, tokio::time::Instant)> = None;
    let mut previous: Vec<NodeCondition> = Vec::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = lease_tick.tick() => renew_lease(&leases, &name, parts.lease_duration_seconds).await,
            _ = status_tick.tick() => {
                let conds = conditions(&observe(&parts.health));
                let due = written.as_ref().is_none_or(|(last, at)| {
                    *last != conds || at.elapsed() >= REPORT_FREQUENCY
                });
                if !due {
                    continue;
                }
                let now = Timestamp::now();
                let patched = status_patch(&conds, &previous, now);
                let body = serde_json::json!({"status": {
                    "capacity": resources(&parts.capacity),
                    "allocatable": resources(&parts.allocatable),
                    "conditions": patched,
                    "addresses": parts.identity.addresses(),
                    "daemonEndpoints": parts.identity.daemon_endpoints(),
                    "nodeInfo": parts.identity.system,
                }});
                match nodes
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&body))
                    .await
                {
                    Ok(_) => {
                        previous = patched;
                        written = Some((conds, tokio::time::Instant::now()));
                    }
                    Err(e) => warn!(node = %name, error = %e, "node status update failed (retryable)"),
                }
            }
        }
    }
}

/// The default labels an existing Node lacks or has wrong, patched.
async fn update_default_labels(nodes: &Api<Node>, node: &NodeInfo) -> Result<(), kube::Error> {
    let existing = nodes.get(&node.name).await?;
    let have = existing.metadata.labels.unwrap_or_default();
    let wrong: BTreeMap<&String, &String> = DEFAULT_LABELS
        .iter()
        .filter_map(|k| node.labels.get_key_value(*k))
        .filter(|(k, v)| have.get(*k) != Some(*v))
        .collect();
    if wrong.is_empty() {
        return Ok(());
    }
    let body = serde_json::json!({"metadata": {"labels": wrong}});
    nodes
        .patch(&node.name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .map(|_| ())
}

/// The labels the kubelet keeps up to date on an existing Node.
pub const DEFAULT_LABELS: [&str; 3] = [
    "kubernetes.io/hostname",
    "kubernetes.io/os",
    "kubernetes.io/arch",
];

async fn renew_lease(leases: &Api<Lease>, name: &str, duration: i32) {
    let fresh = lease_object(name, duration, Timestamp::now());
    let result = match leases.get_opt(name).await {
        Ok(Some(mut current)) => {
            current.spec = fresh.spec;
            leases
                .replace(name, &PostParams::default(), &current)
                .await
                .map(|_| ())
        }
        Ok(None) => leases
            .create(&PostParams::default(), &fresh)
            .await
            .map(|_| ()),
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        warn!(node = %name, error = %e, "node lease renewal failed (retryable)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_follow_the_measures() {
        let ok = Observed {
            health: Ok(()),
            memory_available: Some(1 << 30),
            nodefs: Some((50, 100)),
        };
        let short = |c: Vec<Condition>| {
            c.into_iter()
                .map(|(k, s, r, _)| (k, s, r))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            short(conditions(&ok)),
            [
                ("MemoryPressure", false, "KubeletHasSufficientMemory"),
                ("DiskPressure", false, "KubeletHasNoDiskPressure"),
                ("PIDPressure", false, "KubeletHasSufficientPID"),
                ("Ready", true, "KubeletReady"),
            ]
        );
        let bad = Observed {
            health: Err("pleg was last seen active 3m1s ago; threshold is 3m0s\nmore".into()),
            memory_available: Some(MEMORY_AVAILABLE_MIN - 1),
            nodefs: Some((9, 100)),
        };
        let c = conditions(&bad);
        assert_eq!(
            short(c.clone()),
            [
                ("MemoryPressure", true, "KubeletHasInsufficientMemory"),
                ("DiskPressure", true, "KubeletHasDiskPressure"),
                ("PIDPressure", false, "KubeletHasSufficientPID"),
                ("Ready", false, "KubeletNotReady"),
            ]
        );
        assert_eq!(
            c[3].3,
            "PLEG is not healthy: pleg was last seen active 3m1s ago; threshold is 3m0s"
        );
        // Exactly at the thresholds there is no pressure.
        let edge = Observed {
            health: Ok(()),
            memory_available: Some(MEMORY_AVAILABLE_MIN),
            nodefs: Some((10, 100)),
        };
        assert!(
            conditions(&edge)
                .iter()
                .all(|(k, s, _, _)| *s == (*k == "Ready"))
        );
    }

    #[test]
    fn transition_times_move_only_with_the_status() {
        let t0 = Timestamp::from_second(1_000).unwrap();
        let t1 = Timestamp::from_second(2_000).unwrap();
        let up = conditions(&Observed {
            health: Ok(()),
            memory_available: None,
            nodefs: None,
        });
        let first = status_patch(&up, &[], t0);
        let again = status_patch(&up, &first, t1);
        let ready = |c: &[NodeCondition]| c.iter().find(|c| c.type_ == "Ready").cloned().unwrap();
        assert_eq!(ready(&again).last_transition_time, Some(Time(t0)));
        assert_eq!(ready(&again).last_heartbeat_time, Some(Time(t1)));
        let down = conditions(&Observed {
            health: Err("pleg down".into()),
            memory_available: None,
            nodefs: None,
        });
        let flipped = status_patch(&down, &again, t1);
        assert_eq!(ready(&flipped).last_transition_time, Some(Time(t1)));
    }

    #[test]
    fn the_node_and_its_lease() {
        let info = NodeInfo::from_flags("n1", "zone=a", "k=v:NoExecute").unwrap();
        let cap = Allocatable {
            cpu_milli: 4000,
            memory_bytes: 1 << 30,
            ephemeral_storage_bytes: 10 << 30,
            pods: 110,
        };
        let alloc = Allocatable {
            cpu_milli: 3500,
            memory_bytes: 1 << 29,
            ephemeral_storage_bytes: 9 << 30,
            pods: 110,
        };
        let n = node_object(&info, &cap, &alloc, &Default::default());
        let v = serde_json::to_value(&n).unwrap();
        assert_eq!(v["metadata"]["labels"]["zone"], "a");
        assert_eq!(v["metadata"]["labels"]["kubernetes.io/hostname"], "n1");
        assert_eq!(v["spec"]["taints"][0]["effect"], "NoExecute");
        assert_eq!(v["status"]["capacity"]["cpu"], "4000m");
        assert_eq!(
            v["status"]["allocatable"]["memory"],
            (1i64 << 29).to_string()
        );
        assert_eq!(v["status"]["allocatable"]["pods"], "110");
        assert_eq!(
            v["status"]["allocatable"]["ephemeral-storage"],
            (9i64 << 30).to_string()
        );
        let l = serde_json::to_value(lease_object("n1", 40, Timestamp::from_second(0).unwrap()))
            .unwrap();
        assert_eq!(l["metadata"]["namespace"], "kube-node-lease");
        assert_eq!(l["spec"]["holderIdentity"], "n1");
        assert_eq!(l["spec"]["leaseDurationSeconds"], 40);
    }
}
