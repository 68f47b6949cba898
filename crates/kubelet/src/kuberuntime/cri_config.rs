//! The CRI configs of a pod's sandbox and containers: the kubelet's
//! `generatePodSandboxConfig` and `generateContainerConfig`
//! (`kuberuntime_sandbox.go`, `kuberuntime_container.go`): labels and annotations
//! the agent finds its objects by, namespaces, log paths, command, env,
//! CPU/memory resources and `oom_score_adj` ([`super::oom_score`]),
//! the environment and `$(VAR)`-expanded command and args ([`crate::env`]),
//! port mappings, sysctls, stdin/tty and security
//! contexts ([`super::security_context`]), hostname and DNS config
//! ([`crate::network`]), and the containers' volume mounts
//! ([`container_mounts`], the kubelet's `makeMounts`: host path of the
//! volume as mounted by the volume manager, `subPath`, read-only when the
//! mount or the volume says so, mount propagation; no SELinux relabelling).
//! What a pod may not use is refused at admission
//! ([`crate::admission::fields`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::{Container, Pod};

use super::actions::container_hash;
use super::security_context::{container_security_context, sandbox_security_context};
use crate::admission::host_ports::pod_ports;
use crate::env::ContainerEnv;
use crate::kuberuntime::manager::NodeInfo;
use crate::network::dns::DnsWarning;
use crate::network::{hostname_and_domain, kernel_hostname};
use crate::pod_workers::{SyncError, spec_grace_seconds};
use evpleg_core::cgroup_path::pod_cgroup_path;
use evpleg_core::ids::PodUid;
use evpleg_core::labels;
use evpleg_core::qos::qos_class;
use evpleg_core::quantity::{parse_milli, parse_units};
use evpleg_volume::PodVolume;

/// CFS period used for CPU limits (µs), as the kubelet's.
const CPU_PERIOD_US: i64 = 100_000;

pub(super) fn host_network(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.host_network)
        .unwrap_or(false)
}

/// A pod's log directory, the sandbox's `log_directory`:
/// `<log-dir>/<namespace>_<name>_<uid>` (the kubelet's `BuildPodLogsDirectory`).
pub fn pod_log_dir(log_dir: &Path, pod: &Pod, uid: &PodUid) -> PathBuf {
    let (name, namespace) = name_ns(pod);
    log_dir.join(format!("{namespace}_{name}_{uid}"))
}

/// A container's log file relative to its pod's log directory, the
/// container's `log_path`: `<container>/<attempt>.log` (the kubelet's
/// `BuildContainerLogsDirectory` and `<restartCount>.log`).
pub fn container_log_file(name: &str, attempt: u32) -> String {
    format!("{name}/{attempt}.log")
}

pub(super) fn name_ns(pod: &Pod) -> (String, String) {
    (
        pod.metadata.name.clone().unwrap_or_default(),
        pod.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
    )
}

/// The CRI sandbox config of `pod`, and the warnings about its DNS config
/// (events to record). An error is the kubelet's "Failed to generate sandbox
/// config": a hostname or domain that is no DNS label, an FQDN too long, an
/// unreadable `--resolv-conf`.
pub fn sandbox_config(
    pod: &Pod,
    uid: &PodUid,
    attempt: u32,
    node: &NodeInfo,
) -> Result<(v1::PodSandboxConfig, Vec<DnsWarning>), SyncError> {
    let (name, namespace) = name_ns(pod);
    let failed = |e: &dyn std::fmt::Display| {
        SyncError(format!(
            "failed to generate sandbox config for pod {namespace}/{name}: {e}"
        ))
    };
    let spec = pod.spec.clone().unwrap_or_default();
    let mut sandbox_labels: HashMap<String, String> = pod
        .metadata
        .labels
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    sandbox_labels.insert(labels::POD_NAME.into(), name.clone());
    sandbox_labels.insert(labels::POD_NAMESPACE.into(), namespace.clone());
    sandbox_labels.insert(labels::POD_UID.into(), uid.to_string());
    let host_net = spec.host_network.unwrap_or(false);
    // A host-network sandbox has no UTS namespace of its own to name.
    let hostname = if host_net {
        String::new()
    } else {
        let (hostname, domain) =
            hostname_and_domain(pod, &node.dns.cluster_domain).map_err(|e| failed(&e))?;
        kernel_hostname(&hostname, &domain, spec.set_hostname_as_fqdn == Some(true))
            .map_err(|e| failed(&e))?
    };
    let (dns_config, warnings) = node.dns.pod_dns(pod).map_err(|e| failed(&e))?;
    let config = v1::PodSandboxConfig {
        metadata: Some(v1::PodSandboxMetadata {
            name: name.clone(),
            uid: uid.to_string(),
            namespace: namespace.clone(),
            attempt,
        }),
        hostname,
        dns_config: Some(dns_config),
        log_directory: pod_log_dir(&node.log_dir, pod, uid)
            .to_string_lossy()
            .into_owned(),
        labels: sandbox_labels,
        annotations: pod
            .metadata
            .annotations
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect(),
        linux: Some(v1::LinuxPodSandboxConfig {
            cgroup_parent: pod_cgroup_path(node.cgroup_driver, qos_class(pod), uid),
            security_context: Some(sandbox_security_context(pod, namespace_options(pod))),
            sysctls: spec
                .security_context
                .iter()
                .flat_map(|s| s.sysctls.iter().flatten())
                .map(|s| (s.name.clone(), s.value.clone()))
                .collect(),
            ..Default::default()
        }),
        port_mappings: pod_ports(pod)
            .into_iter()
            .map(|p| v1::PortMapping {
                protocol: match p.protocol.as_str() {
                    "UDP" => v1::Protocol::Udp,
                    "SCTP" => v1::Protocol::Sctp,
                    _ => v1::Protocol::Tcp,
                } as i32,
                container_port: p.container_port,
                host_port: p.host_port,
                host_ip: p.host_ip,
            })
            .collect(),
        ..Default::default()
    };
    Ok((config, warnings))
}

/// The pod's namespaces (the kubelet's `NamespacesForPod`), for the sandbox
/// and each container: the node's with hostNetwork/hostPID/hostIPC, else the
/// pod's (network, IPC; PID with `shareProcessNamespace`), else the
/// container's own PID namespace.
pub fn namespace_options(pod: &Pod) -> v1::NamespaceOption {
    let spec = pod.spec.clone().unwrap_or_default();
    let mode = |node_wide: bool, shared: bool| {
        if node_wide {
            v1::NamespaceMode::Node as i32
        } else if shared {
            v1::NamespaceMode::Pod as i32
        } else {
            v1::NamespaceMode::Container as i32
        }
    };
    v1::NamespaceOption {
        network: mode(spec.host_network.unwrap_or(false), true),
        pid: mode(
            spec.host_pid.unwrap_or(false),
            spec.share_process_namespace.unwrap_or(false),
        ),
        ipc: mode(spec.host_ipc.unwrap_or(false), true),
        ..Default::default()
    }
}

/// The CRI container config of `c` (its `attempt`-th instance), with its
/// environment and expanded command and args ([`crate::env`]).
pub fn container_config(
    pod: &Pod,
    uid: &PodUid,
    c: &Container,
    attempt: u32,
    env: &ContainerEnv,
) -> Result<v1::ContainerConfig, SyncError> {
    let (name, namespace) = name_ns(pod);
    let envs = env
        .env
        .iter()
        .map(|(key, value)| v1::KeyValue {
            key: key.clone(),
            value: value.clone(),
        })
        .collect();
    let mut resources = v1::LinuxContainerResources::default();
    let requests = c
        .resources
        .as_ref()
        .and_then(|r| r.requests.clone())
        .unwrap_or_default();
    let limits = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .unwrap_or_default();
    let bad = |what: &str, e: evpleg_core::quantity::QuantityError| {
        SyncError(format!(
            "container {} of pod {namespace}/{name}: {what}: {e}",
            c.name
        ))
    };
    let cpu_request = requests.get("cpu").or(limits.get("cpu"));
    if let Some(q) = cpu_request {
        let milli = parse_milli(&q.0).map_err(|e| bad("cpu request", e))?;
        resources.cpu_shares = (milli * 1024 / 1000).max(2);
    } else {
        resources.cpu_shares = 2;
    }
    if let Some(q) = limits.get("cpu") {
        let milli = parse_milli(&q.0).map_err(|e| bad("cpu limit", e))?;
        resources.cpu_period = CPU_PERIOD_US;
        resources.cpu_quota = (milli * CPU_PERIOD_US / 1000).max(1000);
    }
    if let Some(q) = limits.get("memory") {
        resources.memory_limit_in_bytes = parse_units(&q.0).map_err(|e| bad("memory limit", e))?;
    }
    resources.oom_score_adj =
        super::oom_score::oom_score_adj(pod, c, evpleg_core::machine::memory_bytes());
    let container_labels = HashMap::from([
        (labels::POD_NAME.to_owned(), name.clone()),
        (labels::POD_NAMESPACE.to_owned(), namespace.clone()),
        (labels::POD_UID.to_owned(), uid.to_string()),
        (labels::CONTAINER_NAME.to_owned(), c.name.clone()),
    ]);
    let mut annotations = HashMap::from([
        (
            labels::CONTAINER_HASH.to_owned(),
            format!("{:x}", container_hash(c)),
        ),
        (
            labels::CONTAINER_RESTART_COUNT.to_owned(),
            attempt.to_string(),
        ),
        (
            labels::TERMINATION_GRACE_PERIOD.to_owned(),
            spec_grace_seconds(pod).to_string(),
        ),
    ]);
    annotations.extend(super::termination_message::annotations(c));
    Ok(v1::ContainerConfig {
        metadata: Some(v1::ContainerMetadata {
            name: c.name.clone(),
            attempt,
        }),
        image: Some(v1::ImageSpec {
            image: c.image.clone().unwrap_or_default(),
            ..Default::default()
        }),
        command: env.command.clone(),
        args: env.args.clone(),
        working_dir: c.working_dir.clone().unwrap_or_default(),
        envs,
        labels: container_labels,
        annotations,
        log_path: container_log_file(&c.name, attempt),
        stdin: c.stdin.unwrap_or(false),
        stdin_once: c.stdin_once.unwrap_or(false),
        tty: c.tty.unwrap_or(false),
        linux: Some(v1::LinuxContainerConfig {
            resources: Some(resources),
            security_context: Some(container_security_context(pod, c, namespace_options(pod))),
        }),
        ..Default::default()
    })
}

/// The CRI mounts of `c`'s `volumeMounts` (the kubelet's `makeMounts`),
/// from the pod's mounted volumes by name; a subPath is opened beneath its
/// volume and bind-mounted under `pod_dir`'s `volume-subpaths/`, and that
/// bind mount is the container's source ([`evpleg_volume::subpath`]). An
/// error (a volume not mounted, a bad subPath, Bidirectional propagation in
/// an unprivileged container) is the kubelet's CreateContainerConfigError.
pub fn container_mounts(
    c: &Container,
    volumes: &BTreeMap<String, PodVolume>,
    pod_dir: &std::path::Path,
) -> Result<Vec<v1::Mount>, SyncError> {
    let privileged = c
        .security_context
        .as_ref()
        .and_then(|s| s.privileged)
        .unwrap_or(false);
    let mut out = Vec::new();
    for (index, m) in c.volume_mounts.iter().flatten().enumerate() {
        let fail = |e: &dyn std::fmt::Display| {
            SyncError(format!(
                "container {:?}: volume mount {:?} at {}: {e}",
                c.name, m.name, m.mount_path
            ))
        };
        let vol = volumes.get(&m.name).ok_or_else(|| {
            SyncError(format!(
                "cannot find volume {:?} to mount into container {:?}",
                m.name, c.name
            ))
        })?;
        let host_path = match m.sub_path.as_deref().filter(|s| !s.is_empty()) {
            Some(sub) => {
                let sp = evpleg_volume::subpath::SubPath {
                    volume_path: &vol.host_path,
                    sub_path: sub,
                    pod_dir,
                    volume_name: &m.name,
                    container_name: &c.name,
                    index,
                };
                evpleg_volume::subpath::prepare(&sp).map_err(|e| fail(&e))?
            }
            None => vol.host_path.clone(),
        };
        let propagation = match m.mount_propagation.as_deref() {
            None | Some("None") => v1::MountPropagation::PropagationPrivate,
            Some("HostToContainer") => v1::MountPropagation::PropagationHostToContainer,
            Some("Bidirectional") if privileged => v1::MountPropagation::PropagationBidirectional,
            Some("Bidirectional") => {
                return Err(fail(
                    &"Bidirectional mount propagation is available only to privileged containers",
                ));
            }
            Some(other) => return Err(fail(&format!("invalid MountPropagation mode: {other:?}"))),
        };
        out.push(v1::Mount {
            container_path: m.mount_path.clone(),
            host_path: host_path.to_string_lossy().into_owned(),
            readonly: m.read_only.unwrap_or(false) || vol.read_only,
            selinux_relabel: false,
            propagation: propagation as i32,
            ..Default::default()
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kuberuntime::manager::pod_uid;

    fn pod() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "a".repeat(32), "labels": {"app": "web"}},
            "spec": {
                "hostNetwork": true,
                "terminationGracePeriodSeconds": 5,
                "containers": [{
                    "name": "app", "image": "localhost/busybox:latest",
                    "command": ["sh", "-c"], "args": ["exit 3"], "workingDir": "/tmp",
                    "env": [{"name": "A", "value": "1"}],
                    "resources": {"requests": {"cpu": "250m"}, "limits": {"cpu": "500m", "memory": "64Mi"}}
                }]
            }
        }))
        .unwrap()
    }

    fn node() -> NodeInfo {
        NodeInfo {
            name: "n".into(),
            host_ip: "10.0.0.1".into(),
            runtime_name: "containerd".into(),
            cgroup_driver: evpleg_core::cgroup_path::CgroupDriver::Cgroupfs,
            log_dir: "/var/log/pods".into(),
            cgroup_mounts: vec![],
            dns: crate::network::dns::Configurer {
                cluster_dns: vec!["10.96.0.10".parse().unwrap()],
                cluster_domain: "cluster.local".into(),
                resolv_conf: None,
                node_ip: None,
            },
            root_dir: "/var/lib/evpleg".into(),
        }
    }

    #[test]
    fn sandbox_config_for_a_host_network_pod() {
        let p = pod();
        let uid = pod_uid(&p).unwrap();
        let (s, _) = sandbox_config(&p, &uid, 1, &node()).unwrap();
        let m = s.metadata.as_ref().unwrap();
        assert_eq!(
            (m.name.as_str(), m.namespace.as_str(), m.attempt),
            ("web", "ns", 1)
        );
        assert_eq!(s.hostname, "");
        assert_eq!(s.labels.get(labels::POD_UID).unwrap(), &uid.to_string());
        assert_eq!(s.labels.get("app").unwrap(), "web");
        let linux = s.linux.unwrap();
        assert_eq!(linux.cgroup_parent, format!("/kubepods/burstable/pod{uid}"));
        let ns = linux.security_context.unwrap().namespace_options.unwrap();
        assert_eq!(ns.network, v1::NamespaceMode::Node as i32);
        assert_eq!(ns.pid, v1::NamespaceMode::Container as i32);
        // The systemd driver's slice, the kubelet's `CgroupName.ToSystemd`.
        let systemd = NodeInfo {
            cgroup_driver: evpleg_core::cgroup_path::CgroupDriver::Systemd,
            ..node()
        };
        let (s, _) = sandbox_config(&p, &uid, 1, &systemd).unwrap();
        assert_eq!(
            s.linux.unwrap().cgroup_parent,
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice",
                uid.as_str().replace('-', "_")
            )
        );
    }

    #[test]
    fn sandbox_config_of_a_pod_with_its_own_network() {
        let mut p = pod();
        let spec = p.spec.as_mut().unwrap();
        spec.host_network = None;
        spec.hostname = Some("h".into());
        spec.subdomain = Some("sub".into());
        spec.set_hostname_as_fqdn = Some(true);
        spec.containers[0].ports =
            Some(vec![serde_json::from_value(serde_json::json!(
            {"containerPort": 80, "hostPort": 8080, "hostIP": "127.0.0.1", "protocol": "UDP"}
        )).unwrap()]);
        let uid = pod_uid(&p).unwrap();
        let (s, warnings) = sandbox_config(&p, &uid, 0, &node()).unwrap();
        assert_eq!(s.hostname, "h.sub.ns.svc.cluster.local");
        assert!(warnings.is_empty());
        let dns = s.dns_config.unwrap();
        assert_eq!(dns.servers, ["10.96.0.10"]);
        assert_eq!(dns.searches[0], "ns.svc.cluster.local");
        let ns = s
            .linux
            .unwrap()
            .security_context
            .unwrap()
            .namespace_options
            .unwrap();
        assert_eq!(ns.network, v1::NamespaceMode::Pod as i32);
        let m = &s.port_mappings[0];
        assert_eq!(
            (
                m.container_port,
                m.host_port,
                m.host_ip.as_str(),
                m.protocol
            ),
            (80, 8080, "127.0.0.1", v1::Protocol::Udp as i32)
        );
        // A hostname that is no DNS label fails the config, naming it.
        p.spec.as_mut().unwrap().hostname = Some("No_Label".into());
        let err = sandbox_config(&p, &uid, 0, &node()).unwrap_err();
        assert!(
            err.0
                .contains("pod Hostname \"No_Label\" is not a valid DNS label"),
            "{err}"
        );
    }

    #[test]
    fn volume_mounts_become_cri_mounts() {
        let root = tempfile::tempdir().unwrap();
        let vol = root.path().join("cache");
        std::fs::create_dir(&vol).unwrap();
        let volumes = BTreeMap::from([
            (
                "cache".to_owned(),
                PodVolume {
                    host_path: vol.clone(),
                    read_only: false,
                },
            ),
            (
                "cfg".to_owned(),
                PodVolume {
                    host_path: "/cfg".into(),
                    read_only: true,
                },
            ),
        ]);
        let c: Container = serde_json::from_value(serde_json::json!({"name": "app", "volumeMounts": [
            {"name": "cache", "mountPath": "/a"},
            {"name": "cache", "mountPath": "/b", "readOnly": true, "mountPropagation": "HostToContainer"},
            {"name": "cfg", "mountPath": "/c"},
        ]}))
        .unwrap();
        // A subPath's bind mount needs root: evpleg_volume::subpath's tests
        // and the e2e volume tests cover it.
        let pod_dir = root.path().join("pod");
        let mounts = container_mounts(&c, &volumes, &pod_dir).unwrap();
        let got: Vec<(&str, String, bool, i32, bool)> = mounts
            .iter()
            .map(|m| {
                (
                    m.container_path.as_str(),
                    m.host_path.clone(),
                    m.readonly,
                    m.propagation,
                    m.selinux_relabel,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("/a", vol.display().to_string(), false, 0, false),
                ("/b", vol.display().to_string(), true, 1, false),
                ("/c", "/cfg".to_owned(), true, 0, false),
            ]
        );
        let cases = [
            (
                serde_json::json!({"name": "gone", "mountPath": "/g"}),
                "cannot find volume \"gone\" to mount into container \"app\"",
            ),
            (
                serde_json::json!({"name": "cache", "mountPath": "/g", "mountPropagation": "Bidirectional"}),
                "Bidirectional mount propagation is available only to privileged containers",
            ),
            (
                serde_json::json!({"name": "cache", "mountPath": "/g", "subPath": "../x"}),
                "must not contain '..'",
            ),
        ];
        for (m, want) in cases {
            let c: Container =
                serde_json::from_value(serde_json::json!({"name": "app", "volumeMounts": [m]}))
                    .unwrap();
            let err = container_mounts(&c, &volumes, &pod_dir).unwrap_err().0;
            assert!(err.contains(want), "{err}");
        }
        let privileged: Container = serde_json::from_value(serde_json::json!({"name": "app",
            "securityContext": {"privileged": true},
            "volumeMounts": [{"name": "cache", "mountPath": "/g", "mountPropagation": "Bidirectional"}]})).unwrap();
        assert_eq!(
            container_mounts(&privileged, &volumes, &pod_dir).unwrap()[0].propagation,
            2
        );
    }

    #[test]
    fn container_config_maps_the_spec() {
        let p = pod();
        let uid = pod_uid(&p).unwrap();
        let c = &p.spec.as_ref().unwrap().containers[0];
        let ctx = crate::env::EnvContext {
            pod: &p,
            container: c,
            pod_ips: &[],
            host_ip: "10.0.0.1",
        };
        let env = crate::env::make_environment(&ctx, &Default::default()).unwrap();
        let cfg = container_config(&p, &uid, c, 2, &env).unwrap();
        assert_eq!(cfg.command, ["sh", "-c"]);
        assert_eq!(cfg.args, ["exit 3"]);
        assert_eq!(cfg.working_dir, "/tmp");
        assert_eq!(cfg.envs[0].key, "A");
        assert_eq!(cfg.metadata.as_ref().unwrap().attempt, 2);
        let r = cfg.linux.unwrap().resources.unwrap();
        assert_eq!(
            (
                r.cpu_shares,
                r.cpu_quota,
                r.cpu_period,
                r.memory_limit_in_bytes
            ),
            (256, 50_000, 100_000, 64 << 20)
        );
        // Burstable: between Guaranteed's -997 and BestEffort's 1000.
        assert_eq!(
            r.oom_score_adj,
            super::super::oom_score::oom_score_adj(&p, c, evpleg_core::machine::memory_bytes())
        );
        assert_eq!(r.oom_score_adj, 999, "no memory request");
        assert_eq!(
            cfg.annotations.get(labels::CONTAINER_HASH).unwrap(),
            &format!("{:x}", container_hash(c))
        );
    }
}
