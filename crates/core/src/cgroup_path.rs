//! Works out what a cgroup path is for Kubernetes.
//!
//! The kernel PLEG learns of new cgroups from the `cgroup_mkdir`/`cgroup_rmdir`
//! tracepoints, and of a process's cgroup from `/proc/<pid>/cgroup`. Both give the
//! path relative to the root of its hierarchy (always starting with `/`, never with
//! the mount point such as `/sys/fs/cgroup/cpu`). [`classify`] turns such a path
//! into a [`CgroupClass`]: above pods, a pod, a container (or sandbox), or a
//! runtime's helper.
//!
//! # The kubelet's naming
//!
//! This reproduces how the kubelet's container manager (`pkg/kubelet/cm`) names the
//! cgroups it creates. It keeps a cgroup name as a list of components:
//!
//! * the node-level cgroup `kubepods` (with the default `--cgroup-root`);
//! * a QoS-level cgroup `burstable` or `besteffort` below it; guaranteed pods have
//!   none and sit directly under `kubepods`;
//! * the pod cgroup `pod<uid>`, the pod's UID as the API server gave it.
//!
//! `cgroup_manager_linux.go` turns that list into a path according to the cgroup
//! driver:
//!
//! * **cgroupfs** joins the components with `/`:
//!   `/kubepods/burstable/pod1b4e28ba-2fa1-11d2-883f-0016d3cca427`;
//! * **systemd** (`ConvertCgroupNameToSystemd`, `CgroupName.ToSystemd`) first
//!   escapes every `-` of a component as `_` (`escapeSystemdCgroupName`: a `-` in a
//!   systemd unit name means nesting), joins the components with `-`, appends
//!   `.slice` and expands that slice name into the path of its ancestors
//!   (`ExpandSlice`):
//!   `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b4e28ba_2fa1_11d2_883f_0016d3cca427.slice`.
//!   A pod slice therefore repeats the QoS of its parent, which [`classify`] checks.
//!
//! [`pod_cgroup_path`] and [`qos_cgroup_path`] produce these names.
//!
//! # The runtimes' naming
//!
//! The runtime creates the container cgroups inside the pod cgroup it is handed as
//! the sandbox's cgroup parent, one per container and one for the sandbox (the path
//! alone cannot tell those two apart):
//!
//! | runtime    | cgroupfs driver                  | systemd driver                   |
//! |------------|----------------------------------|----------------------------------|
//! | containerd | `<id>`                           | `cri-containerd-<id>.scope`      |
//! | CRI-O      | `crio-<id>`                      | `crio-<id>.scope`                |
//! | Docker     | `<id>`                           | `docker-<id>.scope`              |
//!
//! `<id>` is the 64-hex container id. CRI-O also runs a monitor process (conmon)
//! per container in `crio-conmon-<id>` / `crio-conmon-<id>.scope`, either in the pod
//! cgroup or in `/system.slice` (its `conmon_cgroup` setting); it holds no container
//! process and is reported as [`CgroupClass::RuntimeHelper`].
//!
//! Containers whose pod the path does not name:
//!
//! * containerd given no cgroup parent puts a container in `/<namespace>/<id>`, and
//!   the CRI plugin's namespace is `k8s.io`: `/k8s.io/<id>`;
//! * Docker's own containers: `/docker/<id>` (cgroupfs), `/system.slice/docker-<id>.scope`;
//! * runtime scopes directly under `/system.slice` (`crio-<id>.scope`,
//!   `cri-containerd-<id>.scope`).
//!
//! Cgroups created below a container cgroup (by the container itself, or by a
//! runtime that puts the payload in a child such as `init.scope` or `container`)
//! belong to that container and are reported with `nested: true`.
//!
//! The kernel PLEG classifies cgroup2 paths only (`docs/pleg.md` clause 9): on a
//! hybrid host the v1 hierarchies hold the same relative paths, but they are not
//! reported or indexed.
//!
//! Not supported: a non-default `--cgroup-root` (such as kind's `/kubelet`), and
//! nodes whose own cgroup namespace is not the host's (a path such as
//! `/docker/<node>/kubepods/...` is the docker container `<node>`, nested).

use std::fmt;

use crate::ids::{ContainerId, PodUid};

/// The kubelet's node-level cgroup name (`--cgroup-root=/`).
const KUBEPODS: &str = "kubepods";
/// The node-level cgroup under the systemd driver.
const KUBEPODS_SLICE: &str = "kubepods.slice";
/// The pod cgroup's name prefix (`podCgroupNamePrefix`).
const POD_PREFIX: &str = "pod";
const SLICE_SUFFIX: &str = ".slice";
const SCOPE_SUFFIX: &str = ".scope";
/// containerd's CRI namespace, the cgroup parent when none is given.
const CONTAINERD_K8S_NAMESPACE: &str = "k8s.io";
/// Docker's cgroup parent for its own containers (cgroupfs driver).
const DOCKER_ROOT: &str = "docker";
/// systemd's slice for system services; runtimes' scopes may sit there.
const SYSTEM_SLICE: &str = "system.slice";

const CRIO_CONMON_PREFIX: &str = "crio-conmon-";
const CRIO_PREFIX: &str = "crio-";
const CONTAINERD_SCOPE_PREFIX: &str = "cri-containerd-";
const DOCKER_SCOPE_PREFIX: &str = "docker-";

/// A pod's QoS class, which picks its QoS-level cgroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QosClass {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl QosClass {
    /// The Kubernetes name, lowercased: `guaranteed`, `burstable`, `besteffort`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Guaranteed => "guaranteed",
            Self::Burstable => "burstable",
            Self::BestEffort => "besteffort",
        }
    }

    /// The QoS-level cgroup component, `None` for guaranteed pods (they sit
    /// directly under `kubepods`).
    fn component(self) -> Option<&'static str> {
        match self {
            Self::Guaranteed => None,
            Self::Burstable => Some("burstable"),
            Self::BestEffort => Some("besteffort"),
        }
    }

    /// The class whose QoS-level cgroup component is `component`.
    fn from_component(component: &str) -> Option<Self> {
        match component {
            "burstable" => Some(Self::Burstable),
            "besteffort" => Some(Self::BestEffort),
            _ => None,
        }
    }
}

/// The kubelet's `--cgroup-driver`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CgroupDriver {
    Cgroupfs,
    Systemd,
}

/// The container runtime a container cgroup's name points to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Runtime {
    Containerd,
    CriO,
    Docker,
    /// A bare 64-hex cgroup under a cgroupfs pod cgroup: containerd and Docker
    /// both name them so.
    Unknown,
}

/// What a cgroup is for Kubernetes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CgroupClass {
    /// `/kubepods`, a QoS-level cgroup, etc.: above pods. `qos` is `None` for the
    /// node-level cgroup (and for containerd's `/k8s.io`).
    NodeLevel {
        driver: CgroupDriver,
        qos: Option<QosClass>,
    },
    Pod {
        uid: PodUid,
        qos: QosClass,
        driver: CgroupDriver,
    },
    /// A container (or sandbox: the path alone cannot tell them apart).
    Container {
        /// `None` when the path does not name the pod (`/k8s.io/<id>`,
        /// `/system.slice/crio-<id>.scope`, Docker's own containers).
        pod: Option<(PodUid, QosClass)>,
        id: ContainerId,
        runtime: Runtime,
        driver: CgroupDriver,
        /// The path is a cgroup below the container's own.
        nested: bool,
    },
    /// A runtime's helper cgroup that holds no container process
    /// (`crio-conmon-<id>.scope`); `id` is the container it serves.
    RuntimeHelper { id: ContainerId },
}

/// Why a path is not classified.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum CgroupPathError {
    /// A well-formed path outside every Kubernetes layout (`/`, `/user.slice/...`,
    /// `/system.slice/cron.service`).
    #[error("cgroup {path:?} is not a kubernetes cgroup")]
    NotKubernetes { path: String },
    /// A path that is not a cgroup path, or that starts like a Kubernetes layout but
    /// breaks its rules (bad uid or id, QoS mismatch, unexpected component).
    #[error("malformed cgroup path {path:?}: {reason}")]
    Malformed { path: String, reason: String },
}

fn not_kubernetes(path: &str) -> CgroupPathError {
    CgroupPathError::NotKubernetes {
        path: path.to_owned(),
    }
}

fn malformed(path: &str, reason: impl fmt::Display) -> CgroupPathError {
    CgroupPathError::Malformed {
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// The kubelet's cgroup path for a pod, relative to the hierarchy root.
///
/// cgroupfs: `/kubepods[/<qos>]/pod<uid>`; systemd:
/// `/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid with _>.slice`.
pub fn pod_cgroup_path(driver: CgroupDriver, qos: QosClass, uid: &PodUid) -> String {
    let pod = format!("{POD_PREFIX}{}", uid.as_str());
    kubelet_cgroup_path(driver, qos, Some(&pod))
}

/// The kubelet's QoS-level cgroup path (the node-level one for guaranteed pods).
pub fn qos_cgroup_path(driver: CgroupDriver, qos: QosClass) -> String {
    kubelet_cgroup_path(driver, qos, None)
}

/// Converts the kubelet's cgroup name `[kubepods, <qos>?, <pod>?]` into a path the
/// way `CgroupName.ToName` (cgroupfs) and `CgroupName.ToSystemd` do.
fn kubelet_cgroup_path(driver: CgroupDriver, qos: QosClass, pod: Option<&str>) -> String {
    let name = [Some(KUBEPODS), qos.component(), pod];
    let components = name.iter().flatten();
    match driver {
        CgroupDriver::Cgroupfs => components.fold(String::new(), |mut path, c| {
            path.push('/');
            path.push_str(c);
            path
        }),
        CgroupDriver::Systemd => {
            // Escape, join with '-' and expand the slice into its ancestors: each
            // path component is the slice name of a prefix of the cgroup name.
            let mut path = String::new();
            let mut unit = String::new();
            for c in components {
                if !unit.is_empty() {
                    unit.push('-');
                }
                unit.push_str(&c.replace('-', "_"));
                path.push('/');
                path.push_str(&unit);
                path.push_str(SLICE_SUFFIX);
            }
            path
        }
    }
}

/// Classifies a cgroup path relative to its hierarchy's root, such as
/// `/kubepods/besteffort/pod<uid>/<id>`.
pub fn classify(path: &str) -> Result<CgroupClass, CgroupPathError> {
    let components = components(path)?;
    let Some((&root, below)) = components.split_first() else {
        return Err(not_kubernetes(path));
    };
    match root {
        KUBEPODS => classify_cgroupfs(path, below),
        KUBEPODS_SLICE => classify_systemd(path, below),
        CONTAINERD_K8S_NAMESPACE => classify_containerd_namespace(path, below),
        DOCKER_ROOT => classify_docker(path, below),
        SYSTEM_SLICE => classify_system_slice(path, below),
        _ => Err(not_kubernetes(path)),
    }
}

/// Splits an absolute cgroup path into its components, rejecting what no cgroup
/// path holds (empty components from doubled or trailing `/`, `.` and `..`).
fn components(path: &str) -> Result<Vec<&str>, CgroupPathError> {
    let Some(relative) = path.strip_prefix('/') else {
        return Err(malformed(
            path,
            "a cgroup path relative to its hierarchy root starts with '/'",
        ));
    };
    if relative.is_empty() {
        return Ok(Vec::new());
    }
    relative
        .split('/')
        .map(|component| match component {
            "" => Err(malformed(path, "empty component (doubled or trailing '/')")),
            "." | ".." => Err(malformed(path, format!("{component:?} component"))),
            _ => Ok(component),
        })
        .collect()
}

/// What a cgroup directly inside a pod cgroup (or a runtime's parent) is.
enum Leaf {
    Container(Runtime, ContainerId),
    Helper(ContainerId),
}

/// Parses a 64-hex id found in `name`.
fn leaf_id(name: &str, raw: &str) -> Result<ContainerId, String> {
    ContainerId::parse(raw)
        .ok_or_else(|| format!("{name:?} does not hold a container id (64 hex digits)"))
}

/// A container cgroup's name under the cgroupfs driver: `<id>`, `crio-<id>` or
/// `crio-conmon-<id>`. `None` when the name follows none of these.
fn parse_cgroupfs_leaf(name: &str) -> Option<Result<Leaf, String>> {
    if let Some(raw) = name.strip_prefix(CRIO_CONMON_PREFIX) {
        return Some(leaf_id(name, raw).map(Leaf::Helper));
    }
    if let Some(raw) = name.strip_prefix(CRIO_PREFIX) {
        return Some(leaf_id(name, raw).map(|id| Leaf::Container(Runtime::CriO, id)));
    }
    ContainerId::parse(name).map(|id| Ok(Leaf::Container(Runtime::Unknown, id)))
}

/// A runtime's scope name under the systemd driver. `None` when `name` is not a
/// scope named by a runtime this knows.
fn parse_systemd_scope(name: &str) -> Option<Result<Leaf, String>> {
    let stem = name.strip_suffix(SCOPE_SUFFIX)?;
    // crio-conmon- first: it starts with crio- too.
    if let Some(raw) = stem.strip_prefix(CRIO_CONMON_PREFIX) {
        return Some(leaf_id(name, raw).map(Leaf::Helper));
    }
    let (runtime, raw) = [
        (CONTAINERD_SCOPE_PREFIX, Runtime::Containerd),
        (CRIO_PREFIX, Runtime::CriO),
        (DOCKER_SCOPE_PREFIX, Runtime::Docker),
    ]
    .into_iter()
    .find_map(|(prefix, runtime)| stem.strip_prefix(prefix).map(|raw| (runtime, raw)))?;
    Some(leaf_id(name, raw).map(|id| Leaf::Container(runtime, id)))
}

/// The class of a leaf and the components below it.
fn leaf_class(
    leaf: Leaf,
    pod: Option<(PodUid, QosClass)>,
    driver: CgroupDriver,
    below: &[&str],
) -> CgroupClass {
    match leaf {
        Leaf::Container(runtime, id) => CgroupClass::Container {
            pod,
            id,
            runtime,
            driver,
            nested: !below.is_empty(),
        },
        Leaf::Helper(id) => CgroupClass::RuntimeHelper { id },
    }
}

/// The components below a pod cgroup: nothing (the pod itself) or a container
/// cgroup, possibly with nested cgroups below it.
fn classify_below_pod(
    path: &str,
    uid: PodUid,
    qos: QosClass,
    driver: CgroupDriver,
    below: &[&str],
) -> Result<CgroupClass, CgroupPathError> {
    let Some((&name, nested)) = below.split_first() else {
        return Ok(CgroupClass::Pod { uid, qos, driver });
    };
    let (leaf, expected) = match driver {
        CgroupDriver::Cgroupfs => (
            parse_cgroupfs_leaf(name),
            "<id>, crio-<id> or crio-conmon-<id>",
        ),
        CgroupDriver::Systemd => (
            parse_systemd_scope(name),
            "cri-containerd-<id>.scope, crio-<id>.scope, docker-<id>.scope or crio-conmon-<id>.scope",
        ),
    };
    match leaf {
        Some(Ok(leaf)) => Ok(leaf_class(leaf, Some((uid, qos)), driver, nested)),
        Some(Err(reason)) => Err(malformed(path, reason)),
        None => Err(malformed(
            path,
            format!("unexpected cgroup {name:?} in a pod cgroup (expected {expected})"),
        )),
    }
}

/// Below `/kubepods`: `[<qos>/]pod<uid>[/<container>[/...]]`.
fn classify_cgroupfs(path: &str, below: &[&str]) -> Result<CgroupClass, CgroupPathError> {
    let driver = CgroupDriver::Cgroupfs;
    let (qos, rest) = match below.split_first() {
        None => return Ok(CgroupClass::NodeLevel { driver, qos: None }),
        Some((&first, rest)) => match QosClass::from_component(first) {
            Some(qos) => (qos, rest),
            None => (QosClass::Guaranteed, below),
        },
    };
    let Some((&pod, rest)) = rest.split_first() else {
        return Ok(CgroupClass::NodeLevel {
            driver,
            qos: Some(qos),
        });
    };
    let Some(raw_uid) = pod.strip_prefix(POD_PREFIX) else {
        let expected = match qos {
            QosClass::Guaranteed => "pod<uid>, burstable or besteffort",
            QosClass::Burstable | QosClass::BestEffort => "pod<uid>",
        };
        return Err(malformed(
            path,
            format!("unexpected cgroup {pod:?} (expected {expected})"),
        ));
    };
    if raw_uid.contains('_') {
        return Err(malformed(
            path,
            format!("pod uid {raw_uid:?} holds '_': the cgroupfs driver keeps the uid's '-'"),
        ));
    }
    let uid = PodUid::parse(raw_uid)
        .ok_or_else(|| malformed(path, format!("bad pod uid {raw_uid:?}")))?;
    classify_below_pod(path, uid, qos, driver, rest)
}

/// The QoS of a QoS-level slice name (`kubepods-burstable.slice`).
fn systemd_qos_slice(name: &str) -> Option<QosClass> {
    let stem = name.strip_suffix(SLICE_SUFFIX)?;
    let qos = stem.strip_prefix(KUBEPODS)?.strip_prefix('-')?;
    QosClass::from_component(qos)
}

/// Parses a pod slice name, `kubepods[-<qos>]-pod<escaped uid>.slice`.
fn parse_systemd_pod_slice(name: &str) -> Result<(QosClass, PodUid), String> {
    let unexpected =
        || format!("unexpected cgroup {name:?} (expected kubepods[-<qos>]-pod<uid>.slice)");
    let stem = name
        .strip_suffix(SLICE_SUFFIX)
        .and_then(|stem| stem.strip_prefix(KUBEPODS))
        .and_then(|stem| stem.strip_prefix('-'))
        .ok_or_else(unexpected)?;
    let (qos, raw_uid) = [QosClass::Burstable, QosClass::BestEffort]
        .into_iter()
        .find_map(|qos| {
            let qos_name = qos.component()?;
            let raw = stem.strip_prefix(qos_name)?.strip_prefix('-')?;
            raw.strip_prefix(POD_PREFIX).map(|raw| (qos, raw))
        })
        .or_else(|| {
            stem.strip_prefix(POD_PREFIX)
                .map(|raw| (QosClass::Guaranteed, raw))
        })
        .ok_or_else(unexpected)?;
    if raw_uid.contains('-') {
        return Err(format!(
            "pod uid {raw_uid:?} in slice {name:?} is not escaped ('-' is written '_')"
        ));
    }
    let uid = PodUid::parse(raw_uid).ok_or_else(|| format!("bad pod uid {raw_uid:?}"))?;
    Ok((qos, uid))
}

/// Below `/kubepods.slice`: `[kubepods-<qos>.slice/]kubepods[-<qos>]-pod<uid>.slice[/<scope>[/...]]`.
fn classify_systemd(path: &str, below: &[&str]) -> Result<CgroupClass, CgroupPathError> {
    let driver = CgroupDriver::Systemd;
    let (qos, rest) = match below.split_first() {
        None => return Ok(CgroupClass::NodeLevel { driver, qos: None }),
        Some((&first, rest)) => match systemd_qos_slice(first) {
            Some(qos) => (qos, rest),
            None => (QosClass::Guaranteed, below),
        },
    };
    let Some((&pod, rest)) = rest.split_first() else {
        return Ok(CgroupClass::NodeLevel {
            driver,
            qos: Some(qos),
        });
    };
    let (slice_qos, uid) =
        parse_systemd_pod_slice(pod).map_err(|reason| malformed(path, reason))?;
    if slice_qos != qos {
        let parent = match qos {
            QosClass::Guaranteed => KUBEPODS_SLICE.to_owned(),
            QosClass::Burstable | QosClass::BestEffort => {
                format!("kubepods-{}.slice", qos.as_str())
            }
        };
        return Err(malformed(
            path,
            format!(
                "pod slice {pod:?} is for qos {} but sits in {parent}",
                slice_qos.as_str()
            ),
        ));
    }
    classify_below_pod(path, uid, qos, driver, rest)
}

/// Below `/k8s.io`: containerd's CRI containers given no cgroup parent.
fn classify_containerd_namespace(
    path: &str,
    below: &[&str],
) -> Result<CgroupClass, CgroupPathError> {
    let driver = CgroupDriver::Cgroupfs;
    let Some((&name, nested)) = below.split_first() else {
        return Ok(CgroupClass::NodeLevel { driver, qos: None });
    };
    let id = leaf_id(name, name).map_err(|reason| malformed(path, reason))?;
    Ok(leaf_class(
        Leaf::Container(Runtime::Containerd, id),
        None,
        driver,
        nested,
    ))
}

/// Below `/docker`: Docker's own containers. Anything else there (such as
/// BuildKit's `/docker/buildkit`) is not Kubernetes'.
fn classify_docker(path: &str, below: &[&str]) -> Result<CgroupClass, CgroupPathError> {
    let Some((&name, nested)) = below.split_first() else {
        return Err(not_kubernetes(path));
    };
    let id = ContainerId::parse(name).ok_or_else(|| not_kubernetes(path))?;
    Ok(leaf_class(
        Leaf::Container(Runtime::Docker, id),
        None,
        CgroupDriver::Cgroupfs,
        nested,
    ))
}

/// Below `/system.slice`: runtime scopes outside any pod; services are not
/// Kubernetes'.
fn classify_system_slice(path: &str, below: &[&str]) -> Result<CgroupClass, CgroupPathError> {
    let Some((&name, nested)) = below.split_first() else {
        return Err(not_kubernetes(path));
    };
    match parse_systemd_scope(name) {
        Some(Ok(leaf)) => Ok(leaf_class(leaf, None, CgroupDriver::Systemd, nested)),
        Some(Err(reason)) => Err(malformed(path, reason)),
        None => Err(not_kubernetes(path)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UID: &str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427";
    const UID_ESC: &str = "1b4e28ba_2fa1_11d2_883f_0016d3cca427";
    const STATIC_UID: &str = "6f0e1b0c2a3d4e5f60718293a4b5c6d7";
    const ID: &str = "3f9d2c1b0a5e4d6c8b7a9f0e1d2c3b4a5f6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c";
    const ID2: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab";

    use CgroupDriver::{Cgroupfs, Systemd};
    use QosClass::{BestEffort, Burstable, Guaranteed};

    /// What a table row expects.
    #[derive(Debug)]
    enum Want {
        Ok(CgroupClass),
        NotKubernetes,
        /// Malformed, with this text in the reason.
        Malformed(&'static str),
    }

    fn uid(raw: &str) -> PodUid {
        PodUid::parse(raw).expect("test uid")
    }

    fn id(raw: &str) -> ContainerId {
        ContainerId::parse(raw).expect("test id")
    }

    fn node(driver: CgroupDriver, qos: Option<QosClass>) -> Want {
        Want::Ok(CgroupClass::NodeLevel { driver, qos })
    }

    fn pod(raw: &str, qos: QosClass, driver: CgroupDriver) -> Want {
        Want::Ok(CgroupClass::Pod {
            uid: uid(raw),
            qos,
            driver,
        })
    }

    fn ctr(
        pod: Option<(&str, QosClass)>,
        raw_id: &str,
        runtime: Runtime,
        driver: CgroupDriver,
        nested: bool,
    ) -> Want {
        Want::Ok(CgroupClass::Container {
            pod: pod.map(|(raw, qos)| (uid(raw), qos)),
            id: id(raw_id),
            runtime,
            driver,
            nested,
        })
    }

    fn helper(raw_id: &str) -> Want {
        Want::Ok(CgroupClass::RuntimeHelper { id: id(raw_id) })
    }

    fn table() -> Vec<(String, Want)> {
        let short = &ID[..63];
        let be_pod = format!("/kubepods/besteffort/pod{UID}");
        let bu_pod = format!("/kubepods/burstable/pod{UID}");
        let sd_bu = "/kubepods.slice/kubepods-burstable.slice";
        let sd_be = "/kubepods.slice/kubepods-besteffort.slice";
        let sd_be_pod = format!("{sd_be}/kubepods-besteffort-pod{UID_ESC}.slice");
        let sd_g_pod = format!("/kubepods.slice/kubepods-pod{UID_ESC}.slice");
        let g = Some((UID, Guaranteed));
        let bu = Some((UID, Burstable));
        let be = Some((UID, BestEffort));
        use Runtime::{Containerd, CriO, Docker, Unknown};
        vec![
            // cgroupfs driver.
            ("/kubepods".into(), node(Cgroupfs, None)),
            (
                "/kubepods/burstable".into(),
                node(Cgroupfs, Some(Burstable)),
            ),
            (
                "/kubepods/besteffort".into(),
                node(Cgroupfs, Some(BestEffort)),
            ),
            (
                format!("/kubepods/pod{UID}"),
                pod(UID, Guaranteed, Cgroupfs),
            ),
            (bu_pod.clone(), pod(UID, Burstable, Cgroupfs)),
            (be_pod.clone(), pod(UID, BestEffort, Cgroupfs)),
            (
                format!("/kubepods/pod{STATIC_UID}"),
                pod(STATIC_UID, Guaranteed, Cgroupfs),
            ),
            (
                format!("/kubepods/burstable/pod{}", UID.to_uppercase()),
                pod(UID, Burstable, Cgroupfs),
            ),
            (
                format!("{be_pod}/{ID}"),
                ctr(be, ID, Unknown, Cgroupfs, false),
            ),
            (
                format!("/kubepods/pod{UID}/{ID}"),
                ctr(g, ID, Unknown, Cgroupfs, false),
            ),
            (
                format!("{bu_pod}/{}", ID.to_uppercase()),
                ctr(bu, ID, Unknown, Cgroupfs, false),
            ),
            (
                format!("{bu_pod}/crio-{ID}"),
                ctr(bu, ID, CriO, Cgroupfs, false),
            ),
            (format!("{bu_pod}/crio-conmon-{ID}"), helper(ID)),
            (
                format!("{be_pod}/{ID}/sub/child"),
                ctr(be, ID, Unknown, Cgroupfs, true),
            ),
            (
                format!("{bu_pod}/crio-{ID}/container"),
                ctr(bu, ID, CriO, Cgroupfs, true),
            ),
            (format!("{bu_pod}/crio-conmon-{ID}/x"), helper(ID)),
            // cgroupfs driver, malformed.
            (
                "/kubepods/guaranteed".into(),
                Want::Malformed("\"guaranteed\""),
            ),
            (
                "/kubepods/burstable/besteffort".into(),
                Want::Malformed("expected pod<uid>)"),
            ),
            (
                format!("/kubepods/{ID}"),
                Want::Malformed("unexpected cgroup"),
            ),
            (
                "/kubepods/burstable/podxyz".into(),
                Want::Malformed("bad pod uid \"xyz\""),
            ),
            (
                "/kubepods/burstable/pod".into(),
                Want::Malformed("bad pod uid"),
            ),
            (
                format!("/kubepods/besteffort/pod{UID}-"),
                Want::Malformed("bad pod uid"),
            ),
            (
                format!("/kubepods/burstable/pod{UID_ESC}"),
                Want::Malformed("holds '_'"),
            ),
            (
                format!("{be_pod}/{short}"),
                Want::Malformed("unexpected cgroup"),
            ),
            (
                format!("{be_pod}/{ID}0"),
                Want::Malformed("unexpected cgroup"),
            ),
            (format!("{be_pod}/crio-{short}"), Want::Malformed("64 hex")),
            (
                format!("{be_pod}/crio-conmon-{ID}z"),
                Want::Malformed("64 hex"),
            ),
            (
                format!("{be_pod}/cri-containerd-{ID}.scope"),
                Want::Malformed("unexpected cgroup"),
            ),
            (
                format!("{be_pod}/sub/{ID}"),
                Want::Malformed("unexpected cgroup"),
            ),
            // containerd without a cgroup parent.
            ("/k8s.io".into(), node(Cgroupfs, None)),
            (
                format!("/k8s.io/{ID}"),
                ctr(None, ID, Containerd, Cgroupfs, false),
            ),
            (
                format!("/k8s.io/{ID}/nested"),
                ctr(None, ID, Containerd, Cgroupfs, true),
            ),
            ("/k8s.io/notanid".into(), Want::Malformed("64 hex")),
            // Docker's own containers.
            (
                format!("/docker/{ID}"),
                ctr(None, ID, Docker, Cgroupfs, false),
            ),
            ("/docker".into(), Want::NotKubernetes),
            ("/docker/buildkit".into(), Want::NotKubernetes),
            (
                format!("/docker/{ID}/kubepods/burstable/pod{UID}/{ID2}"),
                ctr(None, ID, Docker, Cgroupfs, true),
            ),
            // systemd driver.
            ("/kubepods.slice".into(), node(Systemd, None)),
            (sd_bu.into(), node(Systemd, Some(Burstable))),
            (sd_be.into(), node(Systemd, Some(BestEffort))),
            (sd_g_pod.clone(), pod(UID, Guaranteed, Systemd)),
            (
                format!("{sd_bu}/kubepods-burstable-pod{UID_ESC}.slice"),
                pod(UID, Burstable, Systemd),
            ),
            (sd_be_pod.clone(), pod(UID, BestEffort, Systemd)),
            (
                format!("/kubepods.slice/kubepods-pod{STATIC_UID}.slice"),
                pod(STATIC_UID, Guaranteed, Systemd),
            ),
            (
                format!("{sd_be_pod}/cri-containerd-{ID}.scope"),
                ctr(be, ID, Containerd, Systemd, false),
            ),
            (
                format!("{sd_be_pod}/crio-{ID}.scope"),
                ctr(be, ID, CriO, Systemd, false),
            ),
            (
                format!("{sd_g_pod}/docker-{ID}.scope"),
                ctr(g, ID, Docker, Systemd, false),
            ),
            (
                format!("{sd_bu}/kubepods-burstable-pod{UID_ESC}.slice/cri-containerd-{ID}.scope"),
                ctr(bu, ID, Containerd, Systemd, false),
            ),
            (format!("{sd_be_pod}/crio-conmon-{ID}.scope"), helper(ID)),
            (
                format!("{sd_be_pod}/cri-containerd-{ID}.scope/init.scope"),
                ctr(be, ID, Containerd, Systemd, true),
            ),
            (
                format!("{sd_g_pod}/crio-{ID}.scope/container/a"),
                ctr(g, ID, CriO, Systemd, true),
            ),
            // systemd driver, malformed.
            (
                format!("{sd_be}/kubepods-burstable-pod{UID_ESC}.slice"),
                Want::Malformed("is for qos burstable but sits in kubepods-besteffort.slice"),
            ),
            (
                format!("/kubepods.slice/kubepods-besteffort-pod{UID_ESC}.slice"),
                Want::Malformed("is for qos besteffort but sits in kubepods.slice"),
            ),
            (
                format!("{sd_bu}/kubepods-pod{UID_ESC}.slice"),
                Want::Malformed("is for qos guaranteed"),
            ),
            (
                format!("{sd_bu}/kubepods-burstable-pod{UID}.slice"),
                Want::Malformed("not escaped"),
            ),
            (
                format!("{sd_bu}/kubepods-burstable-podzz.slice"),
                Want::Malformed("bad pod uid \"zz\""),
            ),
            (
                format!("{sd_bu}/kubepods-burstable-pod{UID_ESC}"),
                Want::Malformed("unexpected cgroup"),
            ),
            (
                "/kubepods.slice/kubepods-guaranteed.slice".into(),
                Want::Malformed("unexpected cgroup"),
            ),
            (
                format!("{sd_bu}/kubepods-besteffort.slice"),
                Want::Malformed("unexpected cgroup"),
            ),
            (
                format!("/kubepods.slice/pod{UID_ESC}.slice"),
                Want::Malformed("unexpected cgroup"),
            ),
            (
                format!("{sd_be_pod}/{ID}"),
                Want::Malformed("unexpected cgroup"),
            ),
            (
                format!("{sd_be_pod}/cri-containerd-{short}.scope"),
                Want::Malformed("64 hex"),
            ),
            (
                format!("{sd_be_pod}/crio-conmon-{short}.scope"),
                Want::Malformed("64 hex"),
            ),
            (
                format!("{sd_be_pod}/crio-{ID}.slice"),
                Want::Malformed("unexpected cgroup"),
            ),
            (
                format!("{sd_be_pod}/foo.service"),
                Want::Malformed("unexpected cgroup"),
            ),
            // Runtime scopes in /system.slice.
            (
                format!("/system.slice/crio-{ID}.scope"),
                ctr(None, ID, CriO, Systemd, false),
            ),
            (format!("/system.slice/crio-conmon-{ID}.scope"), helper(ID)),
            (
                format!("/system.slice/cri-containerd-{ID}.scope"),
                ctr(None, ID, Containerd, Systemd, false),
            ),
            (
                format!("/system.slice/docker-{ID}.scope/init.scope"),
                ctr(None, ID, Docker, Systemd, true),
            ),
            (
                "/system.slice/crio-abc.scope".into(),
                Want::Malformed("64 hex"),
            ),
            ("/system.slice".into(), Want::NotKubernetes),
            ("/system.slice/cron.service".into(), Want::NotKubernetes),
            (
                "/system.slice/containerd.service".into(),
                Want::NotKubernetes,
            ),
            ("/system.slice/crio.service".into(), Want::NotKubernetes),
            // Outside Kubernetes.
            ("/".into(), Want::NotKubernetes),
            ("/init.scope".into(), Want::NotKubernetes),
            (
                "/user.slice/user-1000.slice/session-1.scope".into(),
                Want::NotKubernetes,
            ),
            ("/machine.slice".into(), Want::NotKubernetes),
            ("/kubepods-burstable.slice".into(), Want::NotKubernetes),
            (
                format!("/sys/fs/cgroup/kubepods/pod{UID}"),
                Want::NotKubernetes,
            ),
            // Not cgroup paths.
            ("".into(), Want::Malformed("starts with '/'")),
            ("kubepods".into(), Want::Malformed("starts with '/'")),
            ("/kubepods/".into(), Want::Malformed("empty component")),
            ("//kubepods".into(), Want::Malformed("empty component")),
            (
                "/kubepods//burstable".into(),
                Want::Malformed("empty component"),
            ),
            (format!("{sd_be_pod}/"), Want::Malformed("empty component")),
            ("/user.slice/".into(), Want::Malformed("empty component")),
            (
                "/kubepods/burstable/../besteffort".into(),
                Want::Malformed("\"..\" component"),
            ),
            (
                "/kubepods/./burstable".into(),
                Want::Malformed("\".\" component"),
            ),
            (
                format!("/k8s.io/{ID}/.."),
                Want::Malformed("\"..\" component"),
            ),
        ]
    }

    #[test]
    fn classify_table() {
        let rows = table();
        for (path, want) in &rows {
            let got = classify(path);
            match (want, &got) {
                (Want::Ok(class), Ok(got_class)) => {
                    assert_eq!(got_class, class, "{path:?}")
                }
                (Want::NotKubernetes, Err(CgroupPathError::NotKubernetes { path: p })) => {
                    assert_eq!(p, path)
                }
                (Want::Malformed(needle), Err(CgroupPathError::Malformed { path: p, reason })) => {
                    assert_eq!(p, path);
                    assert!(
                        reason.contains(needle),
                        "{path:?}: reason {reason:?} lacks {needle:?}"
                    );
                }
                _ => panic!("{path:?}: want {want:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn error_messages_name_the_path() {
        let err = classify("/user.slice").expect_err("not kubernetes");
        assert_eq!(
            err.to_string(),
            "cgroup \"/user.slice\" is not a kubernetes cgroup"
        );
        let err = classify("/kubepods/burstable/podxyz").expect_err("malformed");
        assert_eq!(
            err.to_string(),
            "malformed cgroup path \"/kubepods/burstable/podxyz\": bad pod uid \"xyz\""
        );
    }

    #[test]
    fn kubelet_names() {
        let u = uid(UID);
        let cases = [
            (
                Cgroupfs,
                Guaranteed,
                format!("/kubepods/pod{UID}"),
                "/kubepods",
            ),
            (
                Cgroupfs,
                Burstable,
                format!("/kubepods/burstable/pod{UID}"),
                "/kubepods/burstable",
            ),
            (
                Cgroupfs,
                BestEffort,
                format!("/kubepods/besteffort/pod{UID}"),
                "/kubepods/besteffort",
            ),
            (
                Systemd,
                Guaranteed,
                format!("/kubepods.slice/kubepods-pod{UID_ESC}.slice"),
                "/kubepods.slice",
            ),
            (
                Systemd,
                Burstable,
                format!(
                    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_ESC}.slice"
                ),
                "/kubepods.slice/kubepods-burstable.slice",
            ),
            (
                Systemd,
                BestEffort,
                format!(
                    "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_ESC}.slice"
                ),
                "/kubepods.slice/kubepods-besteffort.slice",
            ),
        ];
        for (driver, qos, pod_path, qos_path) in cases {
            assert_eq!(pod_cgroup_path(driver, qos, &u), pod_path);
            assert_eq!(qos_cgroup_path(driver, qos), qos_path);
        }
    }

    #[test]
    fn qos_paths_classify_as_node_level() {
        for driver in [Cgroupfs, Systemd] {
            for qos in [Guaranteed, Burstable, BestEffort] {
                let want = CgroupClass::NodeLevel {
                    driver,
                    qos: (qos != Guaranteed).then_some(qos),
                };
                assert_eq!(classify(&qos_cgroup_path(driver, qos)), Ok(want));
            }
        }
    }

    fn driver_strategy() -> impl Strategy<Value = CgroupDriver> {
        prop_oneof![Just(Cgroupfs), Just(Systemd)]
    }

    fn qos_strategy() -> impl Strategy<Value = QosClass> {
        prop_oneof![Just(Guaranteed), Just(Burstable), Just(BestEffort)]
    }

    fn uid_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            // Static pods: the hash of the manifest.
            "[0-9a-f]{32}",
        ]
    }

    /// The runtimes a driver's container naming can express, with the runtime
    /// `classify` reports for them.
    fn container_name(driver: CgroupDriver, runtime: Runtime, id: &str) -> String {
        match (driver, runtime) {
            (Cgroupfs, Runtime::CriO) => format!("crio-{id}"),
            (Cgroupfs, _) => id.to_owned(),
            (Systemd, Runtime::CriO) => format!("crio-{id}.scope"),
            (Systemd, Runtime::Docker) => format!("docker-{id}.scope"),
            (Systemd, _) => format!("cri-containerd-{id}.scope"),
        }
    }

    fn runtime_strategy(driver: CgroupDriver) -> BoxedStrategy<Runtime> {
        match driver {
            Cgroupfs => prop_oneof![Just(Runtime::Unknown), Just(Runtime::CriO)].boxed(),
            Systemd => prop_oneof![
                Just(Runtime::Containerd),
                Just(Runtime::CriO),
                Just(Runtime::Docker)
            ]
            .boxed(),
        }
    }

    proptest! {
        #[test]
        fn pod_paths_roundtrip(
            (driver, runtime) in driver_strategy()
                .prop_flat_map(|d| (Just(d), runtime_strategy(d))),
            qos in qos_strategy(),
            raw_uid in uid_strategy(),
            raw_id in "[0-9a-f]{64}",
            nested in proptest::collection::vec("[a-z][a-z0-9_.]{0,8}", 0..3),
        ) {
            let uid = uid(&raw_uid);
            let pod_path = pod_cgroup_path(driver, qos, &uid);
            prop_assert_eq!(
                classify(&pod_path),
                Ok(CgroupClass::Pod { uid: uid.clone(), qos, driver })
            );

            let mut path = format!("{pod_path}/{}", container_name(driver, runtime, &raw_id));
            for child in &nested {
                path.push('/');
                path.push_str(child);
            }
            prop_assert_eq!(
                classify(&path),
                Ok(CgroupClass::Container {
                    pod: Some((uid, qos)),
                    id: id(&raw_id),
                    runtime,
                    driver,
                    nested: !nested.is_empty(),
                })
            );

            let conmon = match driver {
                Cgroupfs => format!("{pod_path}/crio-conmon-{raw_id}"),
                Systemd => format!("{pod_path}/crio-conmon-{raw_id}.scope"),
            };
            prop_assert_eq!(classify(&conmon), Ok(CgroupClass::RuntimeHelper { id: id(&raw_id) }));
        }

        #[test]
        fn never_panics(path in "(/[-a-z0-9_.]{0,70}){0,6}") {
            let _ = classify(&path);
        }

        #[test]
        fn never_panics_on_any_string(path in "\\PC*") {
            let _ = classify(&path);
        }
    }
}
