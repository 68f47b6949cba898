//! The CRI calls of the kubelet's stats provider and container log manager:
//! `ListContainerStats`, `ListPodSandboxStats`, `ImageFsInfo` and
//! `ReopenContainerLog`. Runtimes that predate a call answer `Unimplemented`,
//! which the caller reads in [`crate::CriError::code`].

use evpleg_cri_api::v1;

use crate::config::CallKind;
use crate::{CriClient, Result, Retry, Target, request};

impl CriClient {
    /// `ListContainerStats` of every container (or those matching `filter`):
    /// CPU, memory and the writable layer's use.
    pub async fn list_container_stats(
        &self,
        filter: Option<v1::ContainerStatsFilter>,
    ) -> Result<Vec<v1::ContainerStats>> {
        let req = v1::ListContainerStatsRequest { filter };
        let resp = self
            .call(
                "ListContainerStats",
                self.runtime_target(),
                self.config.timeout(CallKind::Query),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.list_container_stats(req).await }
                },
            )
            .await?;
        Ok(resp.stats)
    }

    /// `ListPodSandboxStats` of every sandbox: the pod's CPU, memory and
    /// network as the runtime sees them (CRI 1.23; older runtimes answer
    /// `Unimplemented`).
    pub async fn list_pod_sandbox_stats(&self) -> Result<Vec<v1::PodSandboxStats>> {
        let req = v1::ListPodSandboxStatsRequest { filter: None };
        let resp = self
            .call(
                "ListPodSandboxStats",
                self.runtime_target(),
                self.config.timeout(CallKind::Query),
                Retry::Unavailable,
                |c, t| {
                    let mut rt = c.runtime.clone();
                    let req = request(req.clone(), t);
                    async move { rt.list_pod_sandbox_stats(req).await }
                },
            )
            .await?;
        Ok(resp.stats)
    }

    /// `ImageFsInfo`: the filesystems holding images and writable layers.
    pub async fn image_fs_info(&self) -> Result<v1::ImageFsInfoResponse> {
        self.call(
            "ImageFsInfo",
            self.runtime_target(),
            self.config.timeout(CallKind::Query),
            Retry::Unavailable,
            |c, t| {
                let mut images = c.images.clone();
                let req = request(v1::ImageFsInfoRequest {}, t);
                async move { images.image_fs_info(req).await }
            },
        )
        .await
    }

    /// `ReopenContainerLog`: the runtime closes container `id`'s log file and
    /// opens its path again (after the file was renamed away by rotation).
    pub async fn reopen_container_log(&self, id: &str) -> Result<()> {
        let req = v1::ReopenContainerLogRequest {
            container_id: id.to_owned(),
        };
        self.call(
            "ReopenContainerLog",
            Target::Container(id.to_owned()),
            self.config.timeout(CallKind::Request),
            Retry::NotSent,
            |c, t| {
                let mut rt = c.runtime.clone();
                let req = request(req.clone(), t);
                async move { rt.reopen_container_log(req).await }
            },
        )
        .await?;
        Ok(())
    }
}
