//! Reading an event's payload: the pod's state as the runtime reports it
//! right after the event (containerd 1.7's `generateAndSendContainerEvent`
//! reads it the same way), which the 1.26-1.36 Evented PLEG writes into its
//! cache as the pod's status. A read is a few CRI calls and takes
//! milliseconds, more while the runtime is busy with the exit itself; the
//! event task runs reads of different pods at once ([`super::pod_queue`]).
//!
//! The read only asks; what is read is laid into the event, with the
//! overlay's deaths and the proxy's memory of ids, by
//! [`super::Events`] once it is done.

use evpleg_cri::CriClient;
use evpleg_cri_api::v1;
use futures::future::BoxFuture;

/// A container's status as read, or the runtime's error as text.
pub type StatusRead = Result<v1::ContainerStatus, String>;

/// What one read found. Errors are the runtime's, as text.
#[derive(Clone, Debug, PartialEq)]
pub struct Read {
    /// The pod's sandbox: the one known when the read began, else found by
    /// listing the container; `None` when neither knew it.
    pub sandbox_id: Option<String>,
    /// Its status (`Ok(None)`: the runtime answered without one).
    pub sandbox_status: Result<Option<v1::PodSandboxStatus>, String>,
    /// The pod's containers, each with its status; `Err`: the listing
    /// failed.
    pub containers: Result<Vec<(String, StatusRead)>, String>,
}

impl Read {
    /// A read that found no sandbox for the event's container: nothing of
    /// the pod.
    pub fn no_sandbox() -> Self {
        Self {
            sandbox_id: None,
            sandbox_status: Ok(None),
            containers: Ok(Vec::new()),
        }
    }
}

/// Where payloads are read from: the runtime behind the proxy, or a test's
/// stand-in.
pub trait PayloadSource: Send + Sync + std::fmt::Debug {
    /// The pod's state now, for the event of `id` (a container, or the
    /// sandbox itself when `sandbox` is `Some(id)`); `sandbox`: the pod's
    /// sandbox if the proxy knows it.
    fn read(&self, id: String, sandbox: Option<String>) -> BoxFuture<'static, Read>;
}

impl PayloadSource for CriClient {
    fn read(&self, id: String, sandbox: Option<String>) -> BoxFuture<'static, Read> {
        let cri = self.clone();
        Box::pin(async move {
            let sandbox_id = match sandbox {
                Some(s) => Some(s),
                None => {
                    let filter = v1::ContainerFilter {
                        id,
                        ..Default::default()
                    };
                    cri.list_containers(Some(filter))
                        .await
                        .ok()
                        .and_then(|c| c.first().map(|c| c.pod_sandbox_id.clone()))
                }
            };
            let Some(sandbox_id) = sandbox_id else {
                return Read::no_sandbox();
            };
            // The sandbox's status and the pod's containers are asked at
            // once, then every container's status at once: the calls do not
            // depend on each other.
            let filter = v1::ContainerFilter {
                pod_sandbox_id: sandbox_id.clone(),
                ..Default::default()
            };
            let (sandbox_status, listed) = tokio::join!(
                cri.pod_sandbox_status(&sandbox_id, false),
                cri.list_containers(Some(filter))
            );
            let containers = match listed {
                Ok(listed) => {
                    let statuses = futures::future::join_all(
                        listed.iter().map(|c| cri.container_status(&c.id, false)),
                    )
                    .await;
                    Ok(listed
                        .into_iter()
                        .zip(statuses)
                        .map(|(c, s)| {
                            let s = s.map(|r| r.status.unwrap_or_default());
                            (c.id, s.map_err(|e| e.to_string()))
                        })
                        .collect())
                }
                Err(e) => Err(e.to_string()),
            };
            Read {
                sandbox_id: Some(sandbox_id),
                sandbox_status: sandbox_status.map(|r| r.status).map_err(|e| e.to_string()),
                containers,
            }
        })
    }
}
