//! Pod admission: the kubelet's resource fit check (`lifecycle/predicate.go`,
//! the scheduler's NodeResourcesFit). A pod is admitted when its CPU and memory
//! requests fit in the node's allocatable minus what admitted pods request;
//! otherwise it is rejected with the kubelet's reason (`OutOfcpu`,
//! `OutOfmemory`) and a message, and its status says Failed.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::pleg::PodUid;
use crate::runtime::quantity::{parse_milli, parse_units};

/// What the node offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocatable {
    pub cpu_milli: i64,
    pub memory_bytes: i64,
}

impl Allocatable {
    /// This host's CPUs and memory (`available_parallelism`, `/proc/meminfo`).
    pub fn of_host() -> Self {
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1) as i64;
        let memory = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
            })
            .map(|kb| kb * 1024)
            .unwrap_or(0);
        Self {
            cpu_milli: cpus * 1000,
            memory_bytes: memory,
        }
    }
}

/// A pod's requests: the sum over app containers, or the largest init container
/// if larger (init containers run one at a time).
pub fn requests(pod: &Pod) -> (i64, i64) {
    let one = |c: &Container| -> (i64, i64) {
        let req = c.resources.as_ref().and_then(|r| r.requests.as_ref());
        let lim = c.resources.as_ref().and_then(|r| r.limits.as_ref());
        let get = |name: &str, parse: fn(&str) -> Result<i64, _>| -> i64 {
            req.and_then(|m| m.get(name))
                .or_else(|| lim.and_then(|m| m.get(name)))
                .and_then(|q| parse(&q.0).ok())
                .unwrap_or(0)
        };
        (get("cpu", parse_milli), get("memory", parse_units))
    };
    let Some(spec) = &pod.spec else { return (0, 0) };
    let (mut cpu, mut mem) = spec
        .containers
        .iter()
        .map(one)
        .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
    for (c, m) in spec.init_containers.iter().flatten().map(one) {
        cpu = cpu.max(c);
        mem = mem.max(m);
    }
    (cpu, mem)
}

/// A refusal: the kubelet's reason and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: String,
    pub message: String,
}

/// Admitted pods and what they request.
#[derive(Debug)]
pub struct Admission {
    allocatable: Allocatable,
    admitted: HashMap<PodUid, (i64, i64)>,
}

impl Admission {
    pub fn new(allocatable: Allocatable) -> Self {
        Self {
            allocatable,
            admitted: HashMap::new(),
        }
    }

    /// Admits `pod` or says why not. Admitting the same UID again is a no-op.
    pub fn admit(&mut self, uid: &PodUid, pod: &Pod) -> Result<(), Rejection> {
        if self.admitted.contains_key(uid) {
            return Ok(());
        }
        let (cpu, mem) = requests(pod);
        let (used_cpu, used_mem) = self
            .admitted
            .values()
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        let check = |name: &str, requested: i64, used: i64, capacity: i64| {
            (used + requested > capacity).then(|| Rejection {
                reason: format!("OutOf{name}"),
                message: format!(
                    "Pod was rejected: Node didn't have enough resource: {name}, requested: {requested}, used: {used}, capacity: {capacity}"
                ),
            })
        };
        if let Some(r) = check("cpu", cpu, used_cpu, self.allocatable.cpu_milli) {
            return Err(r);
        }
        if let Some(r) = check("memory", mem, used_mem, self.allocatable.memory_bytes) {
            return Err(r);
        }
        self.admitted.insert(uid.clone(), (cpu, mem));
        Ok(())
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
        assert_eq!(
            requests(&pod("500m", "1Mi")),
            (1500, 1 << 20),
            "the init container's cpu is larger"
        );
        let mut a = Admission::new(Allocatable {
            cpu_milli: 4000,
            memory_bytes: 100 << 20,
        });
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
        a.release(&uid(1));
        assert!(a.admit(&uid(2), &pod("100m", "60Mi")).is_ok());
        assert!(Allocatable::of_host().memory_bytes > 0);
    }
}
