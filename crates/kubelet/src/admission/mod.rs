//! Pod admission: the kubelet's admit handlers (`lifecycle/predicate.go`).
//! In order:
//! 0. the names the agent turns into paths must be valid, as the API server
//!    validates them ([`validation`], reason `InvalidPodSpec`), whatever the
//!    pod's source;
//! 1. the pod's `spec.os.name`, when set, must be the node's OS, `linux`
//!    ([`os_supported`], `PodOSNotSupported`: the predicate handler's
//!    `rejectPodAdmissionBasedOnOSField`); checked before the fields below,
//!    so that a pod for another OS is refused for its OS, as by the kubelet,
//!    and not for that OS's fields;
//! 2. fields the agent does not implement yet refuse the pod ([`fields`],
//!    reason `UnsupportedPodSpec`: a difference, the kubelet implements them);
//! 3. the pod's sysctls against the node's allowlist ([`sysctls`],
//!    `SysctlForbidden`), as the kubelet's handler registered before the
//!    predicates;
//! 4. the scheduler's NodeResourcesFit: one more pod must fit in the node's
//!    pod capacity (`--max-pods`, `OutOfpods`), CPU and memory requests in
//!    the node's allocatable minus what admitted pods request (`OutOfcpu`,
//!    `OutOfmemory`, `OutOfephemeral-storage`); a critical pod (static,
//!    mirror, system-critical priority) is not refused for resources: the
//!    checks below refuse it first, else admitted pods are preempted for it
//!    or, if no set of them frees enough, it is refused with
//!    `UnexpectedAdmissionError` ([`preemption`], the kubelet's
//!    `CriticalPodAdmissionHandler`);
//! 5. NodeAffinity (`nodeSelector`, required node affinity) and NodeName
//!    against the node ([`node`]);
//! 6. the scheduler's NodePorts: no host port of an admitted pod
//!    ([`host_ports`], `NodePorts`);
//! 7. the node's `NoExecute` taints, for pods that are not static
//!    ([`node`], `TaintToleration`).
//!
//! A rejected pod's status says Failed with the reason and "Pod was
//! rejected: " and the kubelet's message, and a Warning event with the
//! reason and the message says it too ([`reject_event`], the kubelet's
//! `rejectPod`). Pods that come together are admitted oldest first
//! ([`by_creation_time`], `HandlePodAdditions`' sort), so that of two pods
//! competing for a port or resources the older one wins whatever the
//! source's order. The node's labels and taints are
//! the ones evpleg registers (`--node-labels`, `--register-with-taints`, the
//! default labels); changes others make to the Node object are not read back
//! (a difference: the kubelet's node lister sees them). Ephemeral storage is
//! the filesystem of `--root-dir` (the kubelet's nodefs), counted against
//! requests at admission; its use is not measured (no eviction).

pub mod fields;
pub mod host_ports;
pub mod node;
pub mod preemption;
pub mod sysctls;
pub mod validation;

use std::collections::HashMap;

use k8s_openapi::api::core::v1::{Container, Pod};

use self::host_ports::{PodPort, pod_ports};
use evpleg_core::ids::PodUid;
use evpleg_core::quantity::{parse_milli, parse_units};

/// What the node offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocatable {
    pub cpu_milli: i64,
    pub memory_bytes: i64,
    /// The size of the filesystem holding `--root-dir`.
    pub ephemeral_storage_bytes: i64,
    /// Pods the node runs at most (`--max-pods`, the kubelet's 110).
    pub pods: i64,
}

impl Allocatable {
    /// This host's CPUs and memory (`available_parallelism`, `/proc/meminfo`)
    /// and the size of the filesystem holding `root_dir` (the kubelet's
    /// nodefs capacity).
    pub fn of_host(root_dir: &std::path::Path) -> Self {
        let cpus = evpleg_core::machine::cpus();
        let memory = evpleg_core::machine::memory_bytes();
        // The root dir may not exist yet: its nearest existing ancestor's
        // filesystem is the one it will be on.
        let storage = root_dir
            .ancestors()
            .find_map(evpleg_core::machine::filesystem_bytes)
            .map_or(0, |(_, total)| total as i64);
        Self {
            cpu_milli: cpus * 1000,
            memory_bytes: memory,
            ephemeral_storage_bytes: storage,
            pods: DEFAULT_MAX_PODS,
        }
    }

    /// What is left once `reserved` (`--system-reserved` plus
    /// `--kube-reserved`) is set aside, never below 0 (the kubelet's
    /// allocatable), with `max_pods`.
    pub fn minus(self, reserved: Reserved, max_pods: i64) -> Self {
        Self {
            cpu_milli: (self.cpu_milli - reserved.cpu_milli).max(0),
            memory_bytes: (self.memory_bytes - reserved.memory_bytes).max(0),
            ephemeral_storage_bytes: (self.ephemeral_storage_bytes
                - reserved.ephemeral_storage_bytes)
                .max(0),
            pods: max_pods,
        }
    }
}

/// The kubelet's default `--max-pods`.
pub const DEFAULT_MAX_PODS: i64 = 110;

/// CPU, memory and ephemeral storage: what a pod requests ([`Requests`]) or
/// what is set aside for the system and the agent ([`Reserved`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_milli: i64,
    pub memory_bytes: i64,
    pub ephemeral_storage_bytes: i64,
}

/// Resources set aside for the system and the agent.
pub type Reserved = Resources;

/// What a pod requests.
pub type Requests = Resources;

/// A `--system-reserved` / `--kube-reserved` value that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReservedError {
    #[error("reserved resources {input:?}: {item:?} is not name=quantity")]
    Item { input: String, item: String },
    #[error("reserved resources {input:?}: {name:?} is not cpu, memory or ephemeral-storage")]
    Name { input: String, name: String },
    #[error("reserved resources {input:?}: {value:?} is not a quantity")]
    Quantity { input: String, value: String },
}

impl Resources {
    /// Reserved resources as `cpu=500m,memory=1Gi` (the kubelet's syntax;
    /// empty: nothing).
    pub fn parse(input: &str) -> Result<Self, ReservedError> {
        let mut out = Self::default();
        for item in input.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, value) = item.split_once('=').ok_or_else(|| ReservedError::Item {
                input: input.into(),
                item: item.into(),
            })?;
            let bad = || ReservedError::Quantity {
                input: input.into(),
                value: value.into(),
            };
            match name.trim() {
                "cpu" => out.cpu_milli += parse_milli(value.trim()).map_err(|_| bad())?,
                "memory" => out.memory_bytes += parse_units(value.trim()).map_err(|_| bad())?,
                "ephemeral-storage" => {
                    out.ephemeral_storage_bytes += parse_units(value.trim()).map_err(|_| bad())?
                }
                other => {
                    return Err(ReservedError::Name {
                        input: input.into(),
                        name: other.into(),
                    });
                }
            }
        }
        Ok(out)
    }

    pub fn plus(self, other: Self) -> Self {
        Self {
            cpu_milli: self.cpu_milli + other.cpu_milli,
            memory_bytes: self.memory_bytes + other.memory_bytes,
            ephemeral_storage_bytes: self.ephemeral_storage_bytes + other.ephemeral_storage_bytes,
        }
    }

    fn max(self, o: Self) -> Self {
        Self {
            cpu_milli: self.cpu_milli.max(o.cpu_milli),
            memory_bytes: self.memory_bytes.max(o.memory_bytes),
            ephemeral_storage_bytes: self.ephemeral_storage_bytes.max(o.ephemeral_storage_bytes),
        }
    }
}

/// A pod's requests, as the kubelet's `PodRequests`: app containers and
/// sidecars (init containers with `restartPolicy: Always`) together, or, if
/// larger, an init container plus the sidecars started before it (init
/// containers run one at a time, sidecars keep running).
pub fn requests(pod: &Pod) -> Requests {
    let one = |c: &Container| -> Requests {
        let req = c.resources.as_ref().and_then(|r| r.requests.as_ref());
        let lim = c.resources.as_ref().and_then(|r| r.limits.as_ref());
        let get = |name: &str, parse: fn(&str) -> Result<i64, _>| -> i64 {
            req.and_then(|m| m.get(name))
                .or_else(|| lim.and_then(|m| m.get(name)))
                .and_then(|q| parse(&q.0).ok())
                .unwrap_or(0)
        };
        Requests {
            cpu_milli: get("cpu", parse_milli),
            memory_bytes: get("memory", parse_units),
            ephemeral_storage_bytes: get("ephemeral-storage", parse_units),
        }
    };
    let Some(spec) = &pod.spec else {
        return Requests::default();
    };
    let mut total = spec
        .containers
        .iter()
        .map(one)
        .fold(Requests::default(), Requests::plus);
    let (mut sidecars, mut init_peak) = (Requests::default(), Requests::default());
    for c in spec.init_containers.iter().flatten() {
        let this = one(c);
        let during = if c.restart_policy.as_deref() == Some("Always") {
            sidecars = sidecars.plus(this);
            total = total.plus(this);
            sidecars
        } else {
            sidecars.plus(this)
        };
        init_peak = init_peak.max(during);
    }
    total.max(init_peak)
}

/// A refusal: the kubelet's reason and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: String,
    pub message: String,
}

impl Rejection {
    /// The message without "Pod was rejected: ", as the kubelet's event
    /// has it.
    pub fn event_message(&self) -> &str {
        self.message
            .strip_prefix("Pod was rejected: ")
            .unwrap_or(&self.message)
    }
}

/// The kubelet's `rejectPod` event: a Warning with the rejection's reason
/// and message.
pub fn reject_event(rec: &evpleg_record::Recorder, pod: &Pod, r: &Rejection) {
    rec.record(
        pod,
        None,
        evpleg_record::EventType::Warning,
        &r.reason,
        r.event_message(),
    );
}

/// Orders pods oldest first by `creationTimestamp` (the kubelet's
/// `sort.Sort(sliceutils.PodsByCreationTime(pods))` in
/// `HandlePodAdditions`); a pod without one counts as the oldest, equal
/// ones keep their order.
pub fn by_creation_time(pods: &mut [std::sync::Arc<Pod>]) {
    pods.sort_by_key(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0));
}

/// The kubelet's reason for a pod whose `spec.os.name` is not the node's.
pub const POD_OS_NOT_SUPPORTED: &str = "PodOSNotSupported";

/// The kubelet's `rejectPodAdmissionBasedOnOSField` (`lifecycle/predicate.go`):
/// a pod that names an OS (`spec.os.name`) other than the node's, `linux`
/// (Go's `runtime.GOOS`), is refused with [`POD_OS_NOT_SUPPORTED`] and the
/// kubelet's message; a pod without `spec.os` passes.
pub fn os_supported(pod: &Pod) -> Result<(), Rejection> {
    let os = pod.spec.as_ref().and_then(|s| s.os.as_ref());
    match os {
        Some(os) if os.name != "linux" => Err(Rejection {
            reason: POD_OS_NOT_SUPPORTED.into(),
            message: "Pod was rejected: Failed to admit pod as the OS field doesn't match node OS"
                .into(),
        }),
        _ => Ok(()),
    }
}

/// Admitted pods and what they request.
#[derive(Debug)]
pub struct Admission {
    allocatable: Allocatable,
    node: node::NodeInfo,
    sysctls: sysctls::Allowlist,
    admitted: HashMap<PodUid, Admitted>,
}

/// What an admitted pod holds.
#[derive(Debug)]
struct Admitted {
    /// The pod, which a critical pod may preempt.
    pod: std::sync::Arc<Pod>,
    requests: Requests,
    ports: Vec<PodPort>,
}

impl Admission {
    pub fn new(allocatable: Allocatable, node: node::NodeInfo) -> Self {
        Self {
            allocatable,
            node,
            sysctls: sysctls::Allowlist::safe(sysctls::Allowlist::host_kernel()),
            admitted: HashMap::new(),
        }
    }

    /// Admits the sysctls of `allowlist` (by default the kubelet's safe set
    /// for this host's kernel).
    pub fn with_sysctls(mut self, allowlist: sysctls::Allowlist) -> Self {
        self.sysctls = allowlist;
        self
    }

    /// Admits `pod` or says why not. Admitting the same UID again is a
    /// no-op. A critical pod admitted by preempting others
    /// ([`preemption`]) returns them: freed here, for the caller to stop.
    pub fn admit(&mut self, uid: &PodUid, pod: &Pod) -> Result<Vec<PodUid>, Rejection> {
        if self.admitted.contains_key(uid) {
            return Ok(Vec::new());
        }
        let errors = validation::validate(pod);
        if !errors.is_empty() {
            return Err(Rejection {
                reason: validation::INVALID_REASON.into(),
                message: format!("Pod was rejected: invalid pod: {}", errors.join("; ")),
            });
        }
        os_supported(pod)?;
        let missing = fields::unsupported(pod);
        if !missing.is_empty() {
            return Err(Rejection {
                reason: fields::UNSUPPORTED_REASON.into(),
                message: format!(
                    "Pod was rejected: evpleg does not implement {} yet",
                    missing.join(", ")
                ),
            });
        }
        self.sysctls.admit(pod)?;
        // The scheduler's NodeResourcesFit: each resource short, with the
        // rejection it makes and how much is missing.
        let mut short: Vec<(Rejection, preemption::Requirement)> = Vec::new();
        let pods = self.admitted.len() as i64;
        let asked = requests(pod);
        let used = self
            .admitted
            .values()
            .fold(Requests::default(), |a, p| a.plus(p.requests));
        let a = &self.allocatable;
        for (name, requested, used, capacity) in [
            ("pods", 1, pods, a.pods),
            ("cpu", asked.cpu_milli, used.cpu_milli, a.cpu_milli),
            (
                "memory",
                asked.memory_bytes,
                used.memory_bytes,
                a.memory_bytes,
            ),
            (
                "ephemeral-storage",
                asked.ephemeral_storage_bytes,
                used.ephemeral_storage_bytes,
                a.ephemeral_storage_bytes,
            ),
        ] {
            if used + requested > capacity {
                short.push((
                    Rejection {
                        reason: format!("OutOf{name}"),
                        message: format!(
                            "Pod was rejected: Node didn't have enough resource: {name}, requested: {requested}, used: {used}, capacity: {capacity}"
                        ),
                    },
                    preemption::Requirement {
                        resource: name,
                        quantity: requested - (capacity - used),
                    },
                ));
            }
        }
        // A critical pod is not refused for resources: its other reasons
        // come first, then preemption decides.
        let critical = preemption::is_critical(pod);
        if !critical && let Some((r, _)) = short.first() {
            return Err(r.clone());
        }
        let rejected = |r: Rejection| Rejection {
            message: format!("Pod was rejected: {}", r.message),
            ..r
        };
        node::selection(pod, &self.node).map_err(rejected)?;
        let ports = pod_ports(pod);
        let taken = self.admitted.values().flat_map(|p| p.ports.iter());
        if taken
            .flat_map(|t| ports.iter().map(move |p| (t, p)))
            .any(|(t, p)| p.conflicts_with(t))
        {
            return Err(Rejection {
                reason: host_ports::NODE_PORTS_REASON.into(),
                message: format!("Pod was rejected: {}", host_ports::NODE_PORTS_MESSAGE),
            });
        }
        node::taints(pod, &self.node, crate::status::api::is_static(pod)).map_err(rejected)?;
        let preempted = if short.is_empty() {
            Vec::new()
        } else {
            let missing = preemption::Requirements(short.into_iter().map(|(_, r)| r).collect());
            let candidates: Vec<(PodUid, &Pod)> = self
                .admitted
                .iter()
                .map(|(uid, a)| (uid.clone(), &*a.pod))
                .collect();
            preemption::pods_to_preempt(pod, &candidates, &missing).map_err(|e| Rejection {
                reason: preemption::UNEXPECTED_REASON.into(),
                message: format!(
                    "Pod was rejected: Unexpected error while attempting to recover from admission failure: preemption: error finding a set of pods to preempt: {e}"
                ),
            })?
        };
        for uid in &preempted {
            self.admitted.remove(uid);
        }
        self.admitted.insert(
            uid.clone(),
            Admitted {
                pod: std::sync::Arc::new(pod.clone()),
                requests: asked,
                ports,
            },
        );
        Ok(preempted)
    }

    /// Frees what a terminated or removed pod requested.
    pub fn release(&mut self, uid: &PodUid) {
        self.admitted.remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(cpu: &str, mem: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "a", "resources": {"requests": {"cpu": cpu, "memory": mem}}}],
                     "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "1500m"}}}]}
        }))
        .unwrap()
    }

    fn uid(n: u8) -> PodUid {
        PodUid::parse(&format!("{n:02x}").repeat(16)).unwrap()
    }

    #[test]
    fn requests_fit_or_are_rejected_with_the_kubelet_reason() {
        let r = requests(&pod("500m", "1Mi"));
        assert_eq!(
            (r.cpu_milli, r.memory_bytes),
            (1500, 1 << 20),
            "the init container's cpu is larger"
        );
        let mut a = Admission::new(
            Allocatable {
                cpu_milli: 4000,
                memory_bytes: 100 << 20,
                ephemeral_storage_bytes: 1 << 30,
                pods: 110,
            },
            node::NodeInfo::default(),
        );
        assert!(a.admit(&uid(1), &pod("100m", "60Mi")).is_ok());
        let r = a.admit(&uid(2), &pod("100m", "60Mi")).unwrap_err();
        assert_eq!(r.reason, "OutOfmemory");
        assert!(
            r.message.contains("requested: 62914560, used: 62914560"),
            "{}",
            r.message
        );
        let r = a.admit(&uid(3), &pod("3", "1Mi")).unwrap_err();
        assert_eq!(r.reason, "OutOfcpu");
        let mut storage = |uid_n: u8, size: &str| {
            let p = any_pod(serde_json::json!({"containers": [
                {"name": "a", "resources": {"requests": {"ephemeral-storage": size}}}
            ]}));
            a.admit(&uid(uid_n), &p)
        };
        assert!(storage(4, "600Mi").is_ok());
        let r = storage(5, "600Mi").unwrap_err();
        assert_eq!(r.reason, "OutOfephemeral-storage");
        assert_eq!(
            r.message,
            "Pod was rejected: Node didn't have enough resource: ephemeral-storage, requested: 629145600, used: 629145600, capacity: 1073741824"
        );
        a.release(&uid(4));
        a.release(&uid(1));
        assert!(a.admit(&uid(2), &pod("100m", "60Mi")).is_ok());
        let host = Allocatable::of_host(std::path::Path::new("/"));
        assert!(host.memory_bytes > 0 && host.ephemeral_storage_bytes > 0);
    }

    fn any_pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "spec": spec}))
            .unwrap()
    }

    #[test]
    fn sidecars_add_to_the_app_containers_and_to_later_init_containers() {
        let p = any_pod(serde_json::json!({
            "initContainers": [
                {"name": "i1", "resources": {"requests": {"cpu": "1"}}},
                {"name": "s", "restartPolicy": "Always", "resources": {"requests": {"cpu": "300m", "memory": "1Mi"}}},
                {"name": "i2", "resources": {"requests": {"cpu": "900m"}}},
            ],
            "containers": [{"name": "a", "resources": {"requests": {"cpu": "100m", "memory": "2Mi"}}}]
        }));
        // cpu: max(apps 100 + sidecar 300, i1 1000, sidecar 300 + i2 900) = 1200.
        let r = requests(&p);
        assert_eq!((r.cpu_milli, r.memory_bytes), (1200, 3 << 20));
    }

    fn big() -> Admission {
        Admission::new(
            Allocatable {
                cpu_milli: 64_000,
                memory_bytes: 1 << 40,
                ephemeral_storage_bytes: 1 << 40,
                pods: 110,
            },
            node::NodeInfo::default(),
        )
    }

    #[test]
    fn reserved_resources_parse_and_leave_the_allocatable() {
        let r = Reserved::parse("cpu=500m, memory=1Gi").unwrap();
        assert_eq!(
            r,
            Reserved {
                cpu_milli: 500,
                memory_bytes: 1 << 30,
                ephemeral_storage_bytes: 0,
            }
        );
        let both = r.plus(Reserved::parse("cpu=1").unwrap());
        let host = Allocatable {
            cpu_milli: 4000,
            memory_bytes: 2 << 30,
            ephemeral_storage_bytes: 10 << 30,
            pods: 110,
        };
        let both = both.plus(Reserved::parse("ephemeral-storage=4Gi").unwrap());
        assert_eq!(
            host.minus(both, 20),
            Allocatable {
                cpu_milli: 2500,
                memory_bytes: 1 << 30,
                ephemeral_storage_bytes: 6 << 30,
                pods: 20
            }
        );
        assert_eq!(
            host.minus(Reserved::parse("memory=8Gi").unwrap(), 1)
                .memory_bytes,
            0
        );
        assert_eq!(Reserved::parse("").unwrap(), Reserved::default());
        assert_eq!(
            Reserved::parse("cpu").unwrap_err().to_string(),
            "reserved resources \"cpu\": \"cpu\" is not name=quantity"
        );
        assert_eq!(
            Reserved::parse("pid=100").unwrap_err().to_string(),
            "reserved resources \"pid=100\": \"pid\" is not cpu, memory or ephemeral-storage"
        );
        assert!(matches!(
            Reserved::parse("cpu=lots"),
            Err(ReservedError::Quantity { .. })
        ));
    }

    /// The kubelet's order and messages: pods, then the node's selection,
    /// the host ports, the taints; static pods pass the taints.
    #[test]
    fn node_predicates_reject_with_the_kubelet_s_reasons() {
        let node = node::NodeInfo {
            name: "n1".into(),
            labels: [("zone".to_owned(), "a".to_owned())].into(),
            taints: vec![
                serde_json::from_value(serde_json::json!({"key": "k", "effect": "NoExecute"}))
                    .unwrap(),
            ],
        };
        let mut a = Admission::new(
            Allocatable {
                cpu_milli: 4000,
                memory_bytes: 1 << 30,
                ephemeral_storage_bytes: 1 << 30,
                pods: 2,
            },
            node,
        );
        let api_pod = |spec: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "annotations": {"kubernetes.io/config.source": "api"}},
                "spec": spec
            }))
            .unwrap()
        };
        let tolerant = serde_json::json!([{"key": "k", "operator": "Exists"}]);
        let r = a
            .admit(
                &uid(1),
                &api_pod(serde_json::json!({"containers": [{"name": "a"}]})),
            )
            .unwrap_err();
        assert_eq!(
            (r.reason.as_str(), r.message.as_str()),
            (
                "TaintToleration",
                "Pod was rejected: Predicate TaintToleration failed: node(s) had taints that the pod didn't tolerate"
            )
        );
        // A static pod is not checked against taints.
        let static_pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "s", "annotations": {"kubernetes.io/config.source": "file"}},
            "spec": {"containers": [{"name": "a"}]}
        }))
        .unwrap();
        assert!(a.admit(&uid(2), &static_pod).is_ok());
        let r = a
            .admit(
                &uid(3),
                &api_pod(
                    serde_json::json!({"tolerations": tolerant, "nodeSelector": {"zone": "b"},
                                            "containers": [{"name": "a"}]}),
                ),
            )
            .unwrap_err();
        assert_eq!(
            (r.reason.as_str(), r.message.as_str()),
            (
                "NodeAffinity",
                "Pod was rejected: Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity/selector"
            )
        );
        let ok = api_pod(
            serde_json::json!({"tolerations": tolerant, "nodeSelector": {"zone": "a"},
                                            "containers": [{"name": "a"}]}),
        );
        assert!(a.admit(&uid(4), &ok).is_ok());
        // Two pods admitted, two allowed: the third is OutOfpods, before anything else.
        let r = a.admit(&uid(5), &ok).unwrap_err();
        assert_eq!(
            (r.reason.as_str(), r.message.as_str()),
            (
                "OutOfpods",
                "Pod was rejected: Node didn't have enough resource: pods, requested: 1, used: 2, capacity: 2"
            )
        );
        a.release(&uid(2));
        assert!(a.admit(&uid(5), &ok).is_ok());
    }

    #[test]
    fn an_unimplemented_field_is_refused_naming_it() {
        let p = any_pod(serde_json::json!({
            "volumes": [{"name": "v", "emptyDir": {}}, {"name": "n", "nfs": {"server": "s", "path": "/"}}],
            "containers": [{"name": "a", "volumeDevices": [{"name": "d", "devicePath": "/dev/x"}]}]
        }));
        let r = big().admit(&uid(1), &p).unwrap_err();
        assert_eq!(r.reason, "UnsupportedPodSpec");
        assert_eq!(
            r.message,
            "Pod was rejected: evpleg does not implement spec.volumes[n].nfs, spec.containers[a].volumeDevices yet"
        );
    }

    /// `rejectPodAdmissionBasedOnOSField`: a pod for another OS is refused
    /// with the kubelet's reason and message, also when it has fields the
    /// agent does not implement (that OS's); `linux` or no OS is admitted.
    #[test]
    fn a_pod_for_another_os_is_refused_as_by_the_kubelet() {
        let want = (
            "PodOSNotSupported",
            "Pod was rejected: Failed to admit pod as the OS field doesn't match node OS",
        );
        // (spec.os, refused)
        let cases = [
            (Some("windows"), Some(want)),
            (Some("plan9"), Some(want)),
            (Some("linux"), None),
            (None, None),
        ];
        for (os, refused) in cases {
            let mut spec = serde_json::json!({"containers": [{"name": "a"}]});
            if let Some(os) = os {
                spec["os"] = serde_json::json!({"name": os});
            }
            let r = big().admit(&uid(1), &any_pod(spec)).err();
            let got = r.as_ref().map(|r| (r.reason.as_str(), r.message.as_str()));
            assert_eq!(got, refused, "{os:?}");
        }
        // Refused for its OS before its OS's fields.
        let windows = any_pod(serde_json::json!({
            "os": {"name": "windows"},
            "securityContext": {"windowsOptions": {"runAsUserName": "u"}},
            "containers": [{"name": "a"}]
        }));
        let r = big().admit(&uid(1), &windows).unwrap_err();
        assert_eq!(r.reason, "PodOSNotSupported");
    }

    // Issue #24: whatever its source, a pod whose names would become host
    // paths is refused, naming the fields, before anything is admitted.
    #[test]
    fn a_pod_whose_names_would_become_paths_is_refused_naming_them() {
        let p = any_pod(serde_json::json!({
            "volumes": [{"name": "/data", "emptyDir": {}}],
            "containers": [{"name": "../x"}]
        }));
        let mut a = big();
        let r = a.admit(&uid(1), &p).unwrap_err();
        assert_eq!(r.reason, "InvalidPodSpec");
        assert!(
            r.message.starts_with("Pod was rejected: invalid pod: spec.volumes[0].name: Invalid value: \"/data\": a lowercase RFC 1123 label"),
            "{}",
            r.message
        );
        assert!(
            r.message
                .contains("; spec.containers[0].name: Invalid value: \"../x\""),
            "{}",
            r.message
        );
        assert!(a.admitted.is_empty());
    }

    #[test]
    fn a_host_port_is_held_until_its_pod_is_released() {
        let web = |port: i32| {
            any_pod(serde_json::json!({
                "hostNetwork": true,
                "containers": [{"name": "a", "ports": [{"containerPort": port}]}]
            }))
        };
        let mut a = big();
        assert!(a.admit(&uid(1), &web(8080)).is_ok());
        assert!(a.admit(&uid(2), &web(8081)).is_ok());
        let r = a.admit(&uid(3), &web(8080)).unwrap_err();
        assert_eq!(
            (r.reason.as_str(), r.message.as_str()),
            (
                host_ports::NODE_PORTS_REASON,
                "Pod was rejected: Predicate NodePorts failed: node(s) didn't have free ports for the requested pod ports"
            )
        );
        a.release(&uid(1));
        assert!(a.admit(&uid(3), &web(8080)).is_ok());
    }

    /// A critical pod is not refused for resources (the kubelet's
    /// `CriticalPodAdmissionHandler`): with nothing to preempt it is refused
    /// with `UnexpectedAdmissionError` and the kubelet's message (the
    /// corpus's `admission-resources`, a static pod asking 1000 CPUs);
    /// otherwise the pods preempted for it are returned, their requests
    /// freed; its other reasons come before its resources. A pod that is not
    /// critical is refused for resources first, as before.
    #[test]
    fn a_critical_pod_preempts_or_is_refused_as_by_the_kubelet() {
        let node = node::NodeInfo {
            name: "n1".into(),
            labels: [("zone".to_owned(), "a".to_owned())].into(),
            taints: Vec::new(),
        };
        let mut a = Admission::new(
            Allocatable {
                cpu_milli: 2000,
                memory_bytes: 1 << 30,
                ephemeral_storage_bytes: 1 << 30,
                pods: 110,
            },
            node,
        );
        let with = |source: &str, cpu: &str, selector: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "annotations": {"kubernetes.io/config.source": source}},
                "spec": {"nodeSelector": selector,
                         "containers": [{"name": "a", "resources": {"requests": {"cpu": cpu}}}]}
            }))
            .unwrap()
        };
        let anywhere = serde_json::json!({});
        let r = a
            .admit(&uid(1), &with("file", "1000", anywhere.clone()))
            .unwrap_err();
        assert_eq!(
            (r.reason.as_str(), r.message.as_str()),
            (
                "UnexpectedAdmissionError",
                "Pod was rejected: Unexpected error while attempting to recover from admission failure: preemption: error finding a set of pods to preempt: no set of running pods found to reclaim resources: [(res: cpu, q: 998000), ]"
            )
        );
        assert_eq!(
            a.admit(&uid(2), &with("api", "1500m", anywhere.clone())),
            Ok(vec![])
        );
        assert_eq!(
            a.admit(&uid(3), &with("file", "1", anywhere.clone())),
            Ok(vec![uid(2)]),
            "the API pod is preempted for the static one"
        );
        assert_eq!(
            a.admit(&uid(4), &with("api", "1", anywhere)),
            Ok(vec![]),
            "the preempted pod's CPU is free"
        );
        let elsewhere = serde_json::json!({"zone": "b"});
        let r = a
            .admit(&uid(5), &with("file", "1", elsewhere.clone()))
            .unwrap_err();
        assert_eq!(r.reason, "NodeAffinity", "{r:?}");
        let r = a.admit(&uid(6), &with("api", "1", elsewhere)).unwrap_err();
        assert_eq!(r.reason, "OutOfcpu", "{r:?}");
    }
}
