//! An in-process CRI runtime for the scale workload: it serves as many pods
//! (one sandbox and one container each) as the workload made cgroups for, on
//! its own unix socket and its own runtime thread (`fake-cri`, so that its CPU
//! is told apart from the PLEG's). Only the calls a relist makes are
//! implemented (the others answer Unimplemented). It measures evpleg's relist
//! code at counts containerd cannot run on this machine, not a runtime.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::{Context, Result};
use evpleg_core::labels;
use evpleg_cri_api::v1;
use evpleg_cri_api::{RuntimeService, RuntimeServiceServer};
use tonic::{Request, Response, Status};

/// One pod of the fake runtime.
#[derive(Clone, Debug)]
pub struct FakePod {
    pub uid: String,
    pub sandbox_id: String,
    pub container_id: String,
    pub running: bool,
    pub exit_code: i32,
    pub finished_at: i64,
    /// The main process's host pid, served in a verbose status's `info` as
    /// containerd does (the relist confirms the kernel's main process with it).
    pub pid: i32,
}

#[derive(Debug, Default)]
struct State {
    pods: Vec<FakePod>,
    by_sandbox: HashMap<String, usize>,
    by_container: HashMap<String, usize>,
    /// A label-selected list (a pod relist) finds its pod at once: at tens of
    /// thousands of pods a scan per call would be the fake's cost, not the
    /// PLEG's.
    by_uid: HashMap<String, usize>,
}

/// The pods the fake serves, shared with the workload (which marks deaths).
#[derive(Clone, Debug, Default)]
pub struct Pods(Arc<RwLock<State>>);

impl Pods {
    pub fn set(&self, pods: Vec<FakePod>) {
        let mut s = self.0.write().unwrap_or_else(|e| e.into_inner());
        s.by_sandbox = pods
            .iter()
            .enumerate()
            .map(|(i, p)| (p.sandbox_id.clone(), i))
            .collect();
        s.by_container = pods
            .iter()
            .enumerate()
            .map(|(i, p)| (p.container_id.clone(), i))
            .collect();
        s.by_uid = pods
            .iter()
            .enumerate()
            .map(|(i, p)| (p.uid.clone(), i))
            .collect();
        s.pods = pods;
    }

    /// Marks pod `i`'s container exited by SIGKILL now.
    pub fn killed(&self, i: usize) {
        let mut s = self.0.write().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = s.pods.get_mut(i) {
            p.running = false;
            p.exit_code = 137;
            p.finished_at = now_unix_ns();
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// The pods a list with this label selector returns (every pod without a
    /// pod-uid selector).
    fn selected<'a>(
        &'a self,
        selector: Option<&HashMap<String, String>>,
    ) -> Box<dyn Iterator<Item = &'a FakePod> + 'a> {
        match selector.and_then(|s| s.get(labels::POD_UID)) {
            Some(uid) => Box::new(
                self.by_uid
                    .get(uid)
                    .and_then(|i| self.pods.get(*i))
                    .into_iter(),
            ),
            None => Box::new(self.pods.iter()),
        }
    }
}

fn now_unix_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

fn pod_labels(p: &FakePod) -> HashMap<String, String> {
    HashMap::from([
        (labels::POD_UID.to_owned(), p.uid.clone()),
        (
            labels::POD_NAME.to_owned(),
            format!("scale-{}", &p.uid[..8]),
        ),
        (labels::POD_NAMESPACE.to_owned(), "bench".to_owned()),
    ])
}

fn sandbox(p: &FakePod) -> v1::PodSandbox {
    v1::PodSandbox {
        id: p.sandbox_id.clone(),
        metadata: Some(v1::PodSandboxMetadata {
            name: format!("scale-{}", &p.uid[..8]),
            uid: p.uid.clone(),
            namespace: "bench".into(),
            attempt: 0,
        }),
        state: v1::PodSandboxState::SandboxReady as i32,
        created_at: 1,
        labels: pod_labels(p),
        ..Default::default()
    }
}

fn container_state(p: &FakePod) -> i32 {
    if p.running {
        v1::ContainerState::ContainerRunning as i32
    } else {
        v1::ContainerState::ContainerExited as i32
    }
}

fn container_labels(p: &FakePod) -> HashMap<String, String> {
    let mut l = pod_labels(p);
    l.insert(labels::CONTAINER_NAME.to_owned(), "app".to_owned());
    l
}

#[derive(Debug)]
struct Service(Pods);

#[tonic::async_trait]
impl RuntimeService for Service {
    async fn version(
        &self,
        _: Request<v1::VersionRequest>,
    ) -> Result<Response<v1::VersionResponse>, Status> {
        Ok(Response::new(v1::VersionResponse {
            version: "0.1.0".into(),
            runtime_name: "evpleg-bench-fake".into(),
            runtime_version: "0.1.0".into(),
            runtime_api_version: "v1".into(),
        }))
    }

    async fn list_pod_sandbox(
        &self,
        req: Request<v1::ListPodSandboxRequest>,
    ) -> Result<Response<v1::ListPodSandboxResponse>, Status> {
        let filter = req.into_inner().filter;
        let selector = filter.as_ref().map(|f| &f.label_selector);
        let s = self.0.read();
        let items = s.selected(selector).map(sandbox).collect();
        Ok(Response::new(v1::ListPodSandboxResponse { items }))
    }

    async fn list_containers(
        &self,
        req: Request<v1::ListContainersRequest>,
    ) -> Result<Response<v1::ListContainersResponse>, Status> {
        let filter = req.into_inner().filter;
        let selector = filter.as_ref().map(|f| &f.label_selector);
        let s = self.0.read();
        let containers = s
            .selected(selector)
            .map(|p| v1::Container {
                id: p.container_id.clone(),
                pod_sandbox_id: p.sandbox_id.clone(),
                metadata: Some(v1::ContainerMetadata {
                    name: "app".into(),
                    attempt: 0,
                }),
                state: container_state(p),
                created_at: 1,
                labels: container_labels(p),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(v1::ListContainersResponse { containers }))
    }

    async fn pod_sandbox_status(
        &self,
        req: Request<v1::PodSandboxStatusRequest>,
    ) -> Result<Response<v1::PodSandboxStatusResponse>, Status> {
        let id = req.into_inner().pod_sandbox_id;
        let s = self.0.read();
        let p = s
            .by_sandbox
            .get(&id)
            .and_then(|i| s.pods.get(*i))
            .ok_or_else(|| Status::not_found(id.clone()))?;
        let sb = sandbox(p);
        Ok(Response::new(v1::PodSandboxStatusResponse {
            status: Some(v1::PodSandboxStatus {
                id: sb.id,
                metadata: sb.metadata,
                state: sb.state,
                created_at: sb.created_at,
                labels: sb.labels,
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn container_status(
        &self,
        req: Request<v1::ContainerStatusRequest>,
    ) -> Result<Response<v1::ContainerStatusResponse>, Status> {
        let req = req.into_inner();
        let id = req.container_id;
        let s = self.0.read();
        let p = s
            .by_container
            .get(&id)
            .and_then(|i| s.pods.get(*i))
            .ok_or_else(|| Status::not_found(id.clone()))?;
        Ok(Response::new(v1::ContainerStatusResponse {
            status: Some(v1::ContainerStatus {
                id: p.container_id.clone(),
                metadata: Some(v1::ContainerMetadata {
                    name: "app".into(),
                    attempt: 0,
                }),
                state: container_state(p),
                created_at: 1,
                started_at: 2,
                finished_at: if p.running { 0 } else { p.finished_at },
                exit_code: if p.running { 0 } else { p.exit_code },
                reason: if p.running { "" } else { "Error" }.into(),
                labels: container_labels(p),
                image: Some(v1::ImageSpec {
                    image: "fake".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            info: if req.verbose && p.running {
                HashMap::from([("info".to_owned(), format!("{{\"pid\": {}}}", p.pid))])
            } else {
                HashMap::new()
            },
        }))
    }
}

/// The running fake: its socket and its runtime (dropped: stopped).
#[derive(Debug)]
pub struct FakeCri {
    pub pods: Pods,
    pub socket: PathBuf,
    runtime: Option<tokio::runtime::Runtime>,
}

impl FakeCri {
    /// Serves on `dir/fake-cri.sock` from a one-thread runtime of its own.
    pub fn start(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let socket = dir.join("fake-cri.sock");
        let _ = std::fs::remove_file(&socket);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fake-cri")
            .enable_all()
            .build()?;
        let pods = Pods::default();
        let service = Service(pods.clone());
        let listener = {
            let _guard = runtime.enter();
            tokio::net::UnixListener::bind(&socket)
                .with_context(|| format!("binding {}", socket.display()))?
        };
        runtime.spawn(async move {
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(RuntimeServiceServer::new(service))
                .serve_with_incoming(incoming)
                .await;
        });
        Ok(Self {
            pods,
            socket,
            runtime: Some(runtime),
        })
    }

    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }
}

impl Drop for FakeCri {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(uid: &str) -> FakePod {
        FakePod {
            uid: uid.into(),
            sandbox_id: format!("sb-{uid}"),
            container_id: format!("c-{uid}"),
            running: true,
            exit_code: 0,
            finished_at: 0,
            pid: 1,
        }
    }

    #[test]
    fn a_pod_uid_selector_selects_that_pod_only() {
        let pods = Pods::default();
        pods.set(vec![pod("a"), pod("b"), pod("c")]);
        let s = pods.read();
        let uids = |sel: Option<&HashMap<String, String>>| {
            s.selected(sel).map(|p| p.uid.clone()).collect::<Vec<_>>()
        };
        let by = |uid: &str| HashMap::from([(labels::POD_UID.to_owned(), uid.to_owned())]);
        let other = HashMap::from([("app".to_owned(), "x".to_owned())]);
        type Selector<'a> = Option<&'a HashMap<String, String>>;
        let table: [(Selector, Vec<&str>); 4] = [
            (None, vec!["a", "b", "c"]),
            (Some(&other), vec!["a", "b", "c"]),
            (Some(&by("b")), vec!["b"]),
            (Some(&by("zz")), vec![]),
        ];
        for (sel, want) in table {
            assert_eq!(uids(sel), want, "{sel:?}");
        }
    }
}
