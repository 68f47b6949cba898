//! Spec fields the agent does not implement yet. The kubelet implements every
//! field of a pod's spec; evpleg does not yet, and a field it would silently
//! ignore could make a pod run differently from what its author asked (a
//! probe that never runs, a volume that is not there, a deadline never
//! enforced). Such a pod is refused at admission, with reason
//! [`UNSUPPORTED_REASON`] and a message naming every such field, rather than
//! run half-right.
//!
//! Volumes of the types [`SUPPORTED_VOLUMES`] are mounted by the volume
//! manager ([`evpleg_volume`]); any other type (`nfs`, `iscsi`, ...) is
//! refused naming the volume and its type (`spec.volumes[data].nfs`), as are
//! the projected sources `clusterTrustBundle` and `podCertificate`, a
//! mount's `subPathExpr` and `recursiveReadOnly`, and `volumeDevices`. So
//! are what the kubelet's eviction manager would enforce (an
//! `ephemeral-storage` limit, an on-disk emptyDir's `sizeLimit`: the agent
//! has no eviction manager), an emptyDir medium other than disk and
//! `Memory`, and `env[].valueFrom.fileKeyRef`.
//!
//! `lifecycle.stopSignal` is refused because the CRI has no place for it: it is
//! `ContainerConfig.stop_signal` from cri-api v0.33 on, the vendored
//! `api.proto` is v0.32.3, and containerd 1.6/1.7 do not read it.
//!
//! Accepted, because on a kubelet node they are the scheduler's (the
//! kubelet re-checks required node affinity, `nodeSelector`, `nodeName` and
//! `NoExecute` tolerations, and so does [`super::node`]; the rest have no
//! effect on a node): `affinity`, `nodeSelector`, `tolerations`,
//! `topologySpreadConstraints`, `schedulerName`, `schedulingGates`,
//! `priority`, `priorityClassName`, `preemptionPolicy`, `nodeName` (the API
//! source already selects by node). Also accepted: what the API server sets on
//! every pod (`automountServiceAccountToken`, `serviceAccountName`,
//! `fsGroupChangePolicy` (ownership is always changed, its `Always`), a
//! container's `resizePolicy`), and what the agent does: `env`/`envFrom`
//! and `enableServiceLinks` ([`crate::env`]), `terminationMessagePath` and
//! `terminationMessagePolicy` ([`crate::kuberuntime::termination_message`]),
//! `activeDeadlineSeconds` ([`crate::active_deadline`]), `imagePullSecrets`
//! ([`crate::credentials`]). `spec.os.name` other than `linux` is the
//! kubelet's own refusal (`PodOSNotSupported`, [`super::os_supported`]).

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, SecurityContext, Volume};

/// The rejection reason of a pod using fields the agent does not implement.
pub const UNSUPPORTED_REASON: &str = "UnsupportedPodSpec";

/// The spec fields of `pod` that the agent does not implement, as paths
/// (`spec.containers[app].livenessProbe`); empty when it can run as asked.
pub fn unsupported(pod: &Pod) -> Vec<String> {
    let mut out = Vec::new();
    let Some(spec) = &pod.spec else {
        return out;
    };
    pod_spec(spec, &mut out);
    for c in spec.init_containers.iter().flatten() {
        let path = format!("spec.initContainers[{}]", c.name);
        container(
            c,
            &path,
            crate::kuberuntime::actions::is_sidecar(c),
            &mut out,
        );
        match c.restart_policy.as_deref() {
            None | Some("Always") => {}
            Some(other) => out.push(format!("{path}.restartPolicy={other}")),
        }
    }
    for c in &spec.containers {
        let path = format!("spec.containers[{}]", c.name);
        container(c, &path, true, &mut out);
        if c.restart_policy.is_some() {
            out.push(format!("{path}.restartPolicy"));
        }
    }
    out
}

fn pod_spec(s: &PodSpec, out: &mut Vec<String>) {
    let mut set = |present: bool, field: &str| {
        if present {
            out.push(format!("spec.{field}"));
        }
    };
    set(non_empty(&s.ephemeral_containers), "ephemeralContainers");
    set(s.host_users == Some(false), "hostUsers=false");
    set(s.hostname_override.is_some(), "hostnameOverride");
    set(s.overhead.is_some(), "overhead");
    set(non_empty(&s.resource_claims), "resourceClaims");
    set(s.resources.is_some(), "resources");
    set(
        s.runtime_class_name
            .as_deref()
            .is_some_and(|r| !r.is_empty()),
        "runtimeClassName",
    );
    if let Some(sc) = &s.security_context {
        set(
            sc.app_armor_profile
                .as_ref()
                .is_some_and(|p| p.type_ != "Unconfined"),
            "securityContext.appArmorProfile",
        );
        set(
            sc.se_linux_options.is_some(),
            "securityContext.seLinuxOptions",
        );
        set(
            sc.se_linux_change_policy.is_some(),
            "securityContext.seLinuxChangePolicy",
        );
        set(
            sc.seccomp_profile
                .as_ref()
                .is_some_and(|p| p.type_ == "Localhost"),
            "securityContext.seccompProfile=Localhost",
        );
        set(
            sc.supplemental_groups_policy.as_deref() == Some("Strict"),
            "securityContext.supplementalGroupsPolicy=Strict",
        );
        set(
            sc.windows_options.is_some(),
            "securityContext.windowsOptions",
        );
    }
    for v in s.volumes.iter().flatten() {
        volume(v, out);
    }
}

/// The volume types the volume manager mounts ([`evpleg_volume`]); a
/// claim is mounted by the plugin of its PersistentVolume's type.
pub const SUPPORTED_VOLUMES: [&str; 9] = [
    "emptyDir",
    "hostPath",
    "configMap",
    "secret",
    "downwardAPI",
    "projected",
    "persistentVolumeClaim",
    "ephemeral",
    // Inline ephemeral CSI volumes (evpleg_volume::csi).
    "csi",
];

/// A volume of a type no plugin mounts (`spec.volumes[v].nfs`), or a
/// projected source that is not supported.
fn volume(v: &Volume, out: &mut Vec<String>) {
    let json = serde_json::to_value(v).unwrap_or_default();
    let kinds = json.as_object().into_iter().flat_map(|o| o.keys());
    for kind in kinds.filter(|k| *k != "name") {
        if !SUPPORTED_VOLUMES.contains(&kind.as_str()) {
            out.push(format!("spec.volumes[{}].{kind}", v.name));
        }
    }
    if let Some(e) = &v.empty_dir {
        match e.medium.as_deref().unwrap_or("") {
            // On disk a sizeLimit is the kubelet's eviction manager's to
            // enforce, which the agent does not have; a Memory one is the
            // tmpfs's size.
            "" if e.size_limit.is_some() => {
                out.push(format!("spec.volumes[{}].emptyDir.sizeLimit", v.name));
            }
            "" | "Memory" => {}
            medium => out.push(format!("spec.volumes[{}].emptyDir.medium={medium}", v.name)),
        }
    }
    let sources = v.projected.iter().flat_map(|p| p.sources.iter().flatten());
    for (i, s) in sources.enumerate() {
        for (present, field) in [
            (s.cluster_trust_bundle.is_some(), "clusterTrustBundle"),
            (s.pod_certificate.is_some(), "podCertificate"),
        ] {
            if present {
                out.push(format!(
                    "spec.volumes[{}].projected.sources[{i}].{field}",
                    v.name
                ));
            }
        }
    }
}

/// `probed`: a container whose probes run ([`crate::prober`]): an app
/// container or a sidecar. A plain init container cannot have probes (the API
/// server refuses them); one that has them is refused here rather than
/// ignored.
fn container(c: &Container, path: &str, probed: bool, out: &mut Vec<String>) {
    let mut set = |present: bool, field: &str| {
        if present {
            out.push(format!("{path}.{field}"));
        }
    };
    set(
        c.lifecycle
            .as_ref()
            .is_some_and(|l| l.stop_signal.is_some()),
        "lifecycle.stopSignal",
    );
    let probes = [
        (&c.liveness_probe, "livenessProbe"),
        (&c.readiness_probe, "readinessProbe"),
        (&c.startup_probe, "startupProbe"),
    ];
    for (probe, name) in probes {
        set(probe.is_some() && !probed, name);
    }
    for (i, m) in c.volume_mounts.iter().flatten().enumerate() {
        set(
            m.sub_path_expr.as_deref().is_some_and(|e| !e.is_empty()),
            &format!("volumeMounts[{i}].subPathExpr"),
        );
        set(
            m.recursive_read_only
                .as_deref()
                .is_some_and(|r| r != "Disabled"),
            &format!("volumeMounts[{i}].recursiveReadOnly"),
        );
    }
    set(non_empty(&c.volume_devices), "volumeDevices");
    for e in c.env.iter().flatten() {
        set(
            e.value_from
                .as_ref()
                .is_some_and(|f| f.file_key_ref.is_some()),
            &format!("env[{}].valueFrom.fileKeyRef", e.name),
        );
    }
    set(non_empty(&c.restart_policy_rules), "restartPolicyRules");
    if let Some(r) = &c.resources {
        set(non_empty(&r.claims), "resources.claims");
        // Enforced by the kubelet's eviction manager, which the agent does
        // not have (a request is admission's, and is checked).
        set(
            r.limits
                .as_ref()
                .is_some_and(|l| l.contains_key("ephemeral-storage")),
            "resources.limits[ephemeral-storage]",
        );
        let names: std::collections::BTreeSet<&String> = r
            .requests
            .iter()
            .chain(r.limits.iter())
            .flat_map(|m| m.keys())
            .filter(|n| !matches!(n.as_str(), "cpu" | "memory" | "ephemeral-storage"))
            .collect();
        for name in names {
            out.push(format!("{path}.resources[{name}]"));
        }
    }
    if let Some(sc) = &c.security_context {
        security_context(sc, path, out);
    }
}

fn security_context(sc: &SecurityContext, path: &str, out: &mut Vec<String>) {
    let mut set = |present: bool, field: &str| {
        if present {
            out.push(format!("{path}.securityContext.{field}"));
        }
    };
    set(
        sc.app_armor_profile
            .as_ref()
            .is_some_and(|p| p.type_ != "Unconfined"),
        "appArmorProfile",
    );
    set(sc.se_linux_options.is_some(), "seLinuxOptions");
    set(sc.windows_options.is_some(), "windowsOptions");
    set(
        sc.proc_mount.as_deref().is_some_and(|m| m != "Default"),
        "procMount",
    );
    set(
        sc.seccomp_profile
            .as_ref()
            .is_some_and(|p| p.type_ == "Localhost"),
        "seccompProfile=Localhost",
    );
}

fn non_empty<T>(v: &Option<Vec<T>>) -> bool {
    v.as_ref().is_some_and(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "spec": spec}))
            .unwrap()
    }

    #[test]
    fn what_the_agent_runs_is_accepted() {
        let p = pod(serde_json::json!({
            "hostNetwork": true, "restartPolicy": "Never", "dnsPolicy": "ClusterFirstWithHostNet",
            "enableServiceLinks": true, "nodeSelector": {"a": "b"}, "priority": 5,
            "activeDeadlineSeconds": 30, "imagePullSecrets": [{"name": "pull"}],
            "hostname": "h", "subdomain": "s", "setHostnameAsFQDN": true,
            "hostAliases": [{"ip": "1.2.3.4", "hostnames": ["a"]}],
            "volumes": [{"name": "e", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                        {"name": "h", "hostPath": {"path": "/tmp", "type": "Directory"}},
                        {"name": "c", "configMap": {"name": "c"}}, {"name": "s", "secret": {"secretName": "s"}},
                        {"name": "d", "downwardAPI": {"items": [{"path": "n", "fieldRef": {"fieldPath": "metadata.name"}}]}},
                        {"name": "p", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
                        {"name": "pvc", "persistentVolumeClaim": {"claimName": "claim"}}],
            "dnsConfig": {"nameservers": ["1.1.1.1"]},
            "securityContext": {"runAsUser": 1000, "runAsNonRoot": true, "fsGroup": 5,
                                "seccompProfile": {"type": "RuntimeDefault"}, "sysctls": [{"name": "kernel.shm_rmid_forced", "value": "1"}]},
            "initContainers": [{"name": "sidecar", "image": "i", "restartPolicy": "Always",
                                "startupProbe": {"tcpSocket": {"port": 1}},
                                "livenessProbe": {"exec": {"command": ["true"]}},
                                "readinessProbe": {"httpGet": {"port": 8080}}}],
            "containers": [{
                "name": "app", "image": "i", "imagePullPolicy": "Always", "ports": [{"containerPort": 80}],
                "env": [{"name": "A", "value": "$(B)"},
                        {"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "envFrom": [{"configMapRef": {"name": "c"}, "prefix": "C_"}], "stdin": true, "tty": true,
                "volumeMounts": [{"name": "e", "mountPath": "/e", "subPath": "x", "readOnly": true,
                                  "mountPropagation": "HostToContainer", "recursiveReadOnly": "Disabled"}],
                "terminationMessagePath": "/tmp/done", "terminationMessagePolicy": "FallbackToLogsOnError",
                "resources": {"requests": {"cpu": "1", "memory": "1Mi", "ephemeral-storage": "1Gi"}},
                "securityContext": {"privileged": false, "capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]},
                                    "readOnlyRootFilesystem": true, "allowPrivilegeEscalation": false,
                                    "procMount": "Default", "seccompProfile": {"type": "Unconfined"}}
            }]
        }));
        assert_eq!(unsupported(&p), Vec::<String>::new());
    }

    #[test]
    fn every_unimplemented_field_is_named() {
        let cases = [
            (
                serde_json::json!({"volumes": [{"name": "v", "emptyDir": {}}, {"name": "data", "nfs": {"server": "s", "path": "/"}}]}),
                "spec.volumes[data].nfs",
            ),
            (
                serde_json::json!({"volumes": [{"name": "disk", "iscsi": {"targetPortal": "t", "iqn": "i", "lun": 0}}]}),
                "spec.volumes[disk].iscsi",
            ),
            (
                serde_json::json!({"volumes": [{"name": "p", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}, {"clusterTrustBundle": {"path": "b", "name": "n"}}]}}]}),
                "spec.volumes[p].projected.sources[1].clusterTrustBundle",
            ),
            (
                serde_json::json!({"hostnameOverride": "h"}),
                "spec.hostnameOverride",
            ),
            (
                serde_json::json!({"runtimeClassName": "gvisor"}),
                "spec.runtimeClassName",
            ),
            (
                serde_json::json!({"securityContext": {"seLinuxOptions": {"level": "s0"}}}),
                "spec.securityContext.seLinuxOptions",
            ),
            (
                serde_json::json!({"securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "x"}}}),
                "spec.securityContext.seccompProfile=Localhost",
            ),
        ];
        for (extra, field) in cases {
            let mut spec = serde_json::json!({"containers": [{"name": "app", "image": "i"}]});
            spec.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            assert_eq!(unsupported(&pod(spec)), vec![field.to_owned()], "{field}");
        }
        let volumes = [
            (
                serde_json::json!({"name": "d", "emptyDir": {"sizeLimit": "1Gi"}}),
                "spec.volumes[d].emptyDir.sizeLimit",
            ),
            (
                serde_json::json!({"name": "h", "emptyDir": {"medium": "HugePages-2Mi"}}),
                "spec.volumes[h].emptyDir.medium=HugePages-2Mi",
            ),
        ];
        for (v, field) in volumes {
            let spec =
                serde_json::json!({"volumes": [v], "containers": [{"name": "app", "image": "i"}]});
            assert_eq!(unsupported(&pod(spec)), vec![field.to_owned()], "{field}");
        }
        let containers = [
            (
                serde_json::json!({"env": [{"name": "F", "valueFrom": {"fileKeyRef": {"volumeName": "v", "path": "p", "key": "k"}}}]}),
                "env[F].valueFrom.fileKeyRef",
            ),
            (
                serde_json::json!({"resources": {"requests": {"ephemeral-storage": "1Gi"}, "limits": {"ephemeral-storage": "1Gi"}}}),
                "resources.limits[ephemeral-storage]",
            ),
            (
                serde_json::json!({"lifecycle": {"stopSignal": "SIGUSR1"}}),
                "lifecycle.stopSignal",
            ),
            (
                serde_json::json!({"volumeMounts": [{"name": "v", "mountPath": "/v"}, {"name": "v", "mountPath": "/w", "subPathExpr": "$(POD)"}]}),
                "volumeMounts[1].subPathExpr",
            ),
            (
                serde_json::json!({"volumeDevices": [{"name": "v", "devicePath": "/dev/xvda"}]}),
                "volumeDevices",
            ),
            (
                serde_json::json!({"resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "1"}}}),
                "resources[nvidia.com/gpu]",
            ),
            (
                serde_json::json!({"securityContext": {"procMount": "Unmasked"}}),
                "securityContext.procMount",
            ),
            (
                serde_json::json!({"restartPolicy": "Always"}),
                "restartPolicy",
            ),
        ];
        for (extra, field) in containers {
            let mut c = serde_json::json!({"name": "app", "image": "i"});
            c.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let p = pod(serde_json::json!({"containers": [c]}));
            assert_eq!(
                unsupported(&p),
                vec![format!("spec.containers[app].{field}")],
                "{field}"
            );
        }
        // Init containers are checked too; only Always is a restart policy there.
        let p = pod(serde_json::json!({
            "initContainers": [{"name": "i", "image": "i", "restartPolicy": "OnFailure",
                                "startupProbe": {"tcpSocket": {"port": 1}}}],
            "containers": [{"name": "app", "image": "i"}]
        }));
        assert_eq!(
            unsupported(&p),
            [
                "spec.initContainers[i].startupProbe",
                "spec.initContainers[i].restartPolicy=OnFailure"
            ]
        );
    }
}
