//! The pod's cgroups: the kubelet's cgroup driver choice (`--cgroup-driver`,
//! or the runtime's answer to CRI `RuntimeConfig`, as with the kubelet's
//! `KubeletCgroupDriverFromCRI`) and its pod container manager
//! (`pod_container_manager_linux.go`), which removes a terminated pod's cgroup
//! that RemovePodSandbox leaves behind. Names follow the driver
//! ([`pod_cgroup_path`]: `/kubepods/burstable/pod<uid>` or
//! `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice`).

use std::path::PathBuf;

use k8s_openapi::api::core::v1::Pod;

use evpleg_cri_api::v1;
use tracing::{info, warn};

use evpleg_core::cgroup_path::{CgroupDriver, pod_cgroup_path};
use evpleg_core::ids::PodUid;
use evpleg_core::qos::qos_class;
use evpleg_cri::CriClient;

/// Removes the pod's (empty) cgroup in every hierarchy; RemovePodSandbox leaves it.
pub fn remove_pod_cgroups(mounts: &[PathBuf], driver: CgroupDriver, pod: &Pod, uid: &PodUid) {
    let rel = pod_cgroup_path(driver, qos_class(pod), uid);
    for mount in mounts {
        let dir = mount.join(rel.trim_start_matches('/'));
        match std::fs::remove_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!(path = %dir.display(), error = %e, "cannot remove pod cgroup"),
        }
    }
}

/// The driver the runtime reports in a `RuntimeConfig` answer.
pub fn runtime_driver(resp: &v1::RuntimeConfigResponse) -> Option<CgroupDriver> {
    let linux = resp.linux.as_ref()?;
    match v1::CgroupDriver::try_from(linux.cgroup_driver).ok()? {
        v1::CgroupDriver::Systemd => Some(CgroupDriver::Systemd),
        v1::CgroupDriver::Cgroupfs => Some(CgroupDriver::Cgroupfs),
    }
}

/// Resolves `--cgroup-driver`: an explicit driver (`Some`) is used (a runtime
/// that says otherwise is warned about: its containers would not be found);
/// `None` (`auto`) takes the runtime's answer, or cgroupfs when the runtime
/// has no `RuntimeConfig`.
pub async fn resolve_driver(flag: Option<CgroupDriver>, cri: &CriClient) -> CgroupDriver {
    let asked = match cri.runtime_config().await {
        Ok(resp) => runtime_driver(&resp),
        Err(e) => {
            info!(error = %e, "the runtime does not report its cgroup driver (RuntimeConfig)");
            None
        }
    };
    let chosen = match (flag, asked) {
        (Some(d), _) | (None, Some(d)) => d,
        (None, None) => CgroupDriver::Cgroupfs,
    };
    if asked.is_some_and(|a| a != chosen) {
        warn!(flag = ?chosen, runtime = ?asked, "--cgroup-driver disagrees with the runtime's cgroup driver");
    }
    info!(driver = ?chosen, "cgroup driver");
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_s_driver_from_runtime_config() {
        let resp = |d: Option<i32>| v1::RuntimeConfigResponse {
            linux: d.map(|cgroup_driver| v1::LinuxRuntimeConfiguration { cgroup_driver }),
        };
        let cases = [
            (
                Some(v1::CgroupDriver::Systemd as i32),
                Some(CgroupDriver::Systemd),
            ),
            (
                Some(v1::CgroupDriver::Cgroupfs as i32),
                Some(CgroupDriver::Cgroupfs),
            ),
            (Some(7), None),
            (None, None),
        ];
        for (answer, want) in cases {
            assert_eq!(runtime_driver(&resp(answer)), want, "{answer:?}");
        }
    }
}
