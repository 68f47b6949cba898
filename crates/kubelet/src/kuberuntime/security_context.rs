//! Security contexts: the kubelet's `kuberuntime/security_context.go` and
//! `pkg/securitycontext`. A container's effective context is its own, with
//! the pod's `runAsUser`, `runAsGroup` and `runAsNonRoot` where it sets none;
//! it becomes the CRI's `LinuxContainerSecurityContext`: user and group,
//! supplemental groups (the pod's, and its `fsGroup`), capabilities to add
//! and drop, privileged, read-only root filesystem, `no_new_privs` when
//! `allowPrivilegeEscalation: false`, seccomp (`RuntimeDefault` or
//! `Unconfined`; unset is Unconfined, the kubelet's default without
//! `--seccomp-default`), the default masked and read-only `/proc` paths,
//! and the pod's namespaces. The sandbox gets the pod-level part, and is
//! privileged when a container is.
//!
//! `runAsNonRoot` is checked before a container is created, as the kubelet's
//! `verifyRunAsNonRoot`: with no `runAsUser`, the image's user decides (an
//! image with no user runs as root). A failure is the container's
//! `CreateContainerConfigError`.
//!
//! Refused at admission instead ([`crate::admission::fields`]): SELinux
//! options, AppArmor profiles other than Unconfined, Localhost seccomp
//! profiles, a procMount other than Default, Windows options.

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::{Container, Pod, PodSecurityContext, SeccompProfile};

/// `/proc` and `/sys` paths masked in a container (the kubelet's and the
/// runtimes' defaults for `procMount: Default`).
const MASKED_PATHS: &[&str] = &[
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// `/proc` paths mounted read-only in a container.
const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// The user, group and non-root rule a container runs with: its own
/// settings, else the pod's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EffectiveUser {
    pub run_as_user: Option<i64>,
    pub run_as_group: Option<i64>,
    pub run_as_non_root: bool,
}

fn pod_sc(pod: &Pod) -> Option<&PodSecurityContext> {
    pod.spec.as_ref().and_then(|s| s.security_context.as_ref())
}

/// The kubelet's `DetermineEffectiveSecurityContext`, for the user fields.
pub fn effective_user(pod: &Pod, c: &Container) -> EffectiveUser {
    let own = c.security_context.as_ref();
    let pod = pod_sc(pod);
    EffectiveUser {
        run_as_user: own
            .and_then(|s| s.run_as_user)
            .or(pod.and_then(|s| s.run_as_user)),
        run_as_group: own
            .and_then(|s| s.run_as_group)
            .or(pod.and_then(|s| s.run_as_group)),
        run_as_non_root: own
            .and_then(|s| s.run_as_non_root)
            .or(pod.and_then(|s| s.run_as_non_root))
            .unwrap_or(false),
    }
}

/// Whether creating `c` needs the image's user to check `runAsNonRoot`.
pub fn needs_image_user(pod: &Pod, c: &Container) -> bool {
    let u = effective_user(pod, c);
    u.run_as_non_root && u.run_as_user.is_none()
}

/// The kubelet's `verifyRunAsNonRoot`. `image` is the image's user from the
/// runtime's `ImageStatus` (uid, or a user name); an image without either
/// runs as root.
pub fn verify_run_as_non_root(
    pod: &Pod,
    c: &Container,
    pod_name: &str,
    image: Option<&v1::Image>,
) -> Result<(), String> {
    let u = effective_user(pod, c);
    if !u.run_as_non_root {
        return Ok(());
    }
    let who = format!("pod: {pod_name:?}, container: {}", c.name);
    match u.run_as_user {
        Some(0) => {
            return Err(format!(
                "container's runAsUser breaks non-root policy ({who})"
            ));
        }
        Some(_) => return Ok(()),
        None => {}
    }
    let uid = image.and_then(|i| i.uid.as_ref()).map(|u| u.value);
    let username = image.map(|i| i.username.as_str()).unwrap_or_default();
    match (uid, username) {
        (Some(0), _) | (None, "") => Err(format!(
            "container has runAsNonRoot and image will run as root ({who})"
        )),
        (None, name) => Err(format!(
            "container has runAsNonRoot and image has non-numeric user ({name}), cannot verify user is non-root ({who})"
        )),
        (Some(_), _) => Ok(()),
    }
}

fn seccomp(profile: Option<&SeccompProfile>) -> Option<v1::SecurityProfile> {
    let profile_type = match profile.map(|p| p.type_.as_str()) {
        Some("RuntimeDefault") => v1::security_profile::ProfileType::RuntimeDefault,
        // Unset: the kubelet's default without --seccomp-default.
        _ => v1::security_profile::ProfileType::Unconfined,
    };
    Some(v1::SecurityProfile {
        profile_type: profile_type as i32,
        localhost_ref: String::new(),
    })
}

/// The pod's supplemental groups, with its `fsGroup`, as the kubelet adds
/// them to every container.
fn supplemental_groups(pod: &Pod) -> Vec<i64> {
    let Some(sc) = pod_sc(pod) else {
        return Vec::new();
    };
    sc.fs_group
        .into_iter()
        .chain(sc.supplemental_groups.iter().flatten().copied())
        .collect()
}

/// Whether any container of the pod is privileged (its sandbox must be).
pub fn has_privileged_container(pod: &Pod) -> bool {
    pod.spec.as_ref().is_some_and(|s| {
        s.init_containers
            .iter()
            .flatten()
            .chain(s.containers.iter())
            .any(|c| {
                c.security_context
                    .as_ref()
                    .and_then(|s| s.privileged)
                    .unwrap_or(false)
            })
    })
}

/// The sandbox's security context, around the pod's namespaces.
pub fn sandbox_security_context(
    pod: &Pod,
    namespaces: v1::NamespaceOption,
) -> v1::LinuxSandboxSecurityContext {
    let sc = pod_sc(pod);
    v1::LinuxSandboxSecurityContext {
        namespace_options: Some(namespaces),
        run_as_user: sc
            .and_then(|s| s.run_as_user)
            .map(|value| v1::Int64Value { value }),
        run_as_group: sc
            .and_then(|s| s.run_as_group)
            .map(|value| v1::Int64Value { value }),
        supplemental_groups: supplemental_groups(pod),
        privileged: has_privileged_container(pod),
        seccomp: seccomp(sc.and_then(|s| s.seccomp_profile.as_ref())),
        ..Default::default()
    }
}

/// The container's security context (the kubelet's
/// `determineEffectiveSecurityContext`).
pub fn container_security_context(
    pod: &Pod,
    c: &Container,
    namespaces: v1::NamespaceOption,
) -> v1::LinuxContainerSecurityContext {
    let own = c.security_context.as_ref();
    let user = effective_user(pod, c);
    let privileged = own.and_then(|s| s.privileged).unwrap_or(false);
    let caps = own.and_then(|s| s.capabilities.as_ref());
    let profile = own
        .and_then(|s| s.seccomp_profile.as_ref())
        .or(pod_sc(pod).and_then(|s| s.seccomp_profile.as_ref()));
    let paths = |p: &[&str]| p.iter().map(|s| (*s).to_owned()).collect();
    v1::LinuxContainerSecurityContext {
        capabilities: caps.map(|c| v1::Capability {
            add_capabilities: c.add.clone().unwrap_or_default(),
            drop_capabilities: c.drop.clone().unwrap_or_default(),
            add_ambient_capabilities: Vec::new(),
        }),
        privileged,
        namespace_options: Some(namespaces),
        run_as_user: user.run_as_user.map(|value| v1::Int64Value { value }),
        run_as_group: user.run_as_group.map(|value| v1::Int64Value { value }),
        readonly_rootfs: own
            .and_then(|s| s.read_only_root_filesystem)
            .unwrap_or(false),
        supplemental_groups: supplemental_groups(pod),
        // The kubelet's `AddNoNewPrivileges`: only an explicit false sets it.
        no_new_privs: own.and_then(|s| s.allow_privilege_escalation) == Some(false),
        masked_paths: paths(MASKED_PATHS),
        readonly_paths: paths(READONLY_PATHS),
        seccomp: seccomp(profile),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(pod_sc: serde_json::Value, container_sc: serde_json::Value) -> (Pod, Container) {
        let p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"securityContext": pod_sc,
                     "containers": [{"name": "app", "securityContext": container_sc}]}
        }))
        .unwrap();
        let c = p.spec.as_ref().unwrap().containers[0].clone();
        (p, c)
    }

    #[test]
    fn the_container_inherits_the_pods_user_and_overrides_it() {
        let (p, c) = pod(
            serde_json::json!({"runAsUser": 1000, "runAsGroup": 3000, "runAsNonRoot": true}),
            serde_json::json!({"runAsUser": 2000}),
        );
        assert_eq!(
            effective_user(&p, &c),
            EffectiveUser {
                run_as_user: Some(2000),
                run_as_group: Some(3000),
                run_as_non_root: true
            }
        );
        let sc = container_security_context(&p, &c, Default::default());
        assert_eq!(sc.run_as_user, Some(v1::Int64Value { value: 2000 }));
        assert_eq!(sc.run_as_group, Some(v1::Int64Value { value: 3000 }));
    }

    #[test]
    fn the_container_fields_map_to_the_cri() {
        let (p, c) = pod(
            serde_json::json!({"fsGroup": 7, "supplementalGroups": [4000, 4001],
                               "seccompProfile": {"type": "RuntimeDefault"}}),
            serde_json::json!({"privileged": true, "readOnlyRootFilesystem": true,
                               "allowPrivilegeEscalation": false,
                               "capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]}}),
        );
        let sc = container_security_context(&p, &c, Default::default());
        assert!(sc.privileged && sc.readonly_rootfs && sc.no_new_privs);
        assert_eq!(sc.supplemental_groups, [7, 4000, 4001]);
        let caps = sc.capabilities.unwrap();
        assert_eq!(
            (caps.add_capabilities, caps.drop_capabilities),
            (vec!["NET_ADMIN".to_owned()], vec!["ALL".to_owned()])
        );
        assert_eq!(
            sc.seccomp.unwrap().profile_type,
            v1::security_profile::ProfileType::RuntimeDefault as i32,
            "the pod's profile is inherited"
        );
        assert_eq!(sc.masked_paths.len(), MASKED_PATHS.len());
        let sandbox = sandbox_security_context(&p, Default::default());
        assert!(
            sandbox.privileged,
            "a privileged container needs a privileged sandbox"
        );
        assert_eq!(sandbox.supplemental_groups, [7, 4000, 4001]);
    }

    #[test]
    fn defaults_are_the_kubelets() {
        let (p, c) = pod(serde_json::json!({}), serde_json::json!({}));
        let sc = container_security_context(&p, &c, Default::default());
        assert!(!sc.privileged && !sc.readonly_rootfs && !sc.no_new_privs);
        assert_eq!((sc.run_as_user, sc.run_as_group), (None, None));
        assert_eq!(
            sc.seccomp.unwrap().profile_type,
            v1::security_profile::ProfileType::Unconfined as i32
        );
        let (_, c) = pod(
            serde_json::json!({}),
            serde_json::json!({"allowPrivilegeEscalation": true, "seccompProfile": {"type": "Unconfined"}}),
        );
        assert!(!container_security_context(&p, &c, Default::default()).no_new_privs);
        assert!(!sandbox_security_context(&p, Default::default()).privileged);
    }

    #[test]
    fn run_as_non_root_table() {
        let image = |uid: Option<i64>, username: &str| v1::Image {
            uid: uid.map(|value| v1::Int64Value { value }),
            username: username.into(),
            ..Default::default()
        };
        let root = image(None, "");
        let table = [
            // (pod sc, container sc, image, Ok?, error fragment)
            (
                serde_json::json!({}),
                serde_json::json!({}),
                Some(root.clone()),
                None,
            ),
            (
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!({}),
                Some(root.clone()),
                Some("image will run as root"),
            ),
            (
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!({}),
                Some(image(Some(0), "")),
                Some("image will run as root"),
            ),
            (
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!({}),
                Some(image(Some(1000), "")),
                None,
            ),
            (
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!({}),
                Some(image(None, "nobody")),
                Some("non-numeric user (nobody)"),
            ),
            (
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!({"runAsUser": 0}),
                None,
                Some("runAsUser breaks non-root policy"),
            ),
            (
                serde_json::json!({"runAsNonRoot": true, "runAsUser": 5}),
                serde_json::json!({}),
                None,
                None,
            ),
            (
                serde_json::json!({"runAsNonRoot": true}),
                serde_json::json!({"runAsNonRoot": false}),
                Some(root),
                None,
            ),
        ];
        for (psc, csc, img, want) in table {
            let (p, c) = pod(psc.clone(), csc.clone());
            let got = verify_run_as_non_root(&p, &c, "p_default(x)", img.as_ref());
            match want {
                None => assert_eq!(got, Ok(()), "{psc} {csc}"),
                Some(fragment) => {
                    let e = got.unwrap_err();
                    assert!(
                        e.contains(fragment) && e.contains("container: app"),
                        "{psc} {csc}: {e}"
                    );
                }
            }
        }
        let (p, c) = pod(
            serde_json::json!({"runAsNonRoot": true}),
            serde_json::json!({}),
        );
        assert!(needs_image_user(&p, &c));
        let (p, c) = pod(
            serde_json::json!({"runAsNonRoot": true}),
            serde_json::json!({"runAsUser": 3}),
        );
        assert!(!needs_image_user(&p, &c));
        let (p, c) = pod(serde_json::json!({}), serde_json::json!({}));
        assert!(!needs_image_user(&p, &c));
    }
}
