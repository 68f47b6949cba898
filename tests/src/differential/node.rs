//! One side's node for the differential harness: the stock kubelet (on
//! containerd directly or behind `evpleg cri-proxy`) or `evpleg run`, with its
//! pods from a manifest directory or from the API server ([`super::api`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::{Case, DifferentialError, NODE, STATUS_POLL, Side, act, api};
use crate::containerd::Containerd;
use crate::control_plane::ControlPlane;
use crate::csi_driver::{CsiDriverProcess, DRIVER_NAME};
use crate::killable::Killable;
use crate::stock_kubelet::{KubeletOptions, StockKubelet};

/// A running node of one side on its own containerd.
pub(super) enum Runner {
    Kubelet(StockKubelet, Option<Box<evpleg::cri_proxy::CriProxy>>),
    /// The agent (`None` only while it restarts), its manifest directory,
    /// and the flags it was started with (to start it again,
    /// [`act::Act::RestartNode`]).
    /// `evpleg run` in a process of its own, as a node runs it (with its
    /// own runtime threads, not the harness's), with its manifest
    /// directory, its flags and its log file.
    Evpleg {
        agent: Option<Killable>,
        program: &'static str,
        manifests: PathBuf,
        args: Vec<String>,
        log: PathBuf,
    },
}

/// A node and where its pods come from.
pub(super) struct Node {
    /// Locked for the whole of a restart: statuses are not served meanwhile.
    runner: tokio::sync::Mutex<Runner>,
    /// In [`Mode::Api`]: the side's namespace and node on the API server.
    pub(super) api: Option<api::ApiSide>,
    name: &'static str,
    /// The test CSI driver, registered with the node, stopped after it.
    csi: Option<CsiDriverProcess>,
}

impl Node {
    pub(super) async fn start(
        side: Side,
        containerd: &Containerd,
        cp: Option<&ControlPlane>,
        csi_driver: Option<&'static str>,
    ) -> Result<Self, DifferentialError> {
        let (api, name, kubeconfig) = match cp {
            Some(cp) => {
                let api = api::ApiSide::new(cp, side).await;
                let kubeconfig = cp.node_kubeconfig(api.node);
                let name = api.node;
                (Some(api), name, Some(kubeconfig))
            }
            None => (None, NODE, None),
        };
        let runner = match side {
            Side::Kubelet | Side::KubeletBehindProxy { .. } => {
                let (proxy, endpoint, evented_pleg) = match side {
                    Side::KubeletBehindProxy { evented } => {
                        let (proxy, _) = crate::cri_proxy::proxy(containerd, &[]).await;
                        let socket = containerd.base().join("proxy.sock");
                        (Some(proxy), format!("unix://{}", socket.display()), evented)
                    }
                    _ => (None, containerd.endpoint(), false),
                };
                let opts = KubeletOptions {
                    endpoint,
                    node: name.into(),
                    evented_pleg,
                    cgroups: crate::stock_kubelet::KubeletCgroups::PrivateRoot,
                };
                let kubelet =
                    StockKubelet::start_against(containerd.base(), &opts, kubeconfig.as_deref())
                        .await?;
                Runner::Kubelet(kubelet, proxy.map(Box::new))
            }
            Side::Evpleg { program } => {
                let base = containerd.base();
                let manifests = base.join("agent-manifests");
                std::fs::create_dir_all(&manifests).map_err(|source| DifferentialError::Io {
                    what: "create",
                    path: manifests.clone(),
                    source,
                })?;
                let s = |p: PathBuf| p.display().to_string();
                let mut args = vec![
                    "run".to_owned(),
                    "--manifest-dir".into(),
                    s(manifests.clone()),
                    "--node-name".into(),
                    name.into(),
                    "--listen".into(),
                    "127.0.0.1:0".into(),
                    "--pod-log-dir".into(),
                    s(base.join("agent-pod-logs")),
                    "--root-dir".into(),
                    s(agent_root(base)),
                    "--cri-endpoint".into(),
                    containerd.endpoint(),
                    "--crashloop-backoff-initial".into(),
                    "1s".into(),
                    "--crashloop-backoff-max".into(),
                    "1s".into(),
                ];
                if let Some(k) = kubeconfig {
                    args.push("--kubeconfig".into());
                    args.push(s(k));
                }
                let log = base.join("agent.log");
                let agent = spawn_agent(program, &args, &log).await?;
                Runner::Evpleg {
                    agent: Some(agent),
                    program,
                    manifests,
                    args,
                    log,
                }
            }
        };
        let csi = match csi_driver {
            Some(program) => {
                if let Some(api) = &api {
                    api.ensure_csi_driver(DRIVER_NAME).await;
                }
                let registry = match &runner {
                    Runner::Kubelet(k, _) => k.root_dir(),
                    Runner::Evpleg { .. } => agent_root(containerd.base()),
                }
                .join("plugins_registry");
                Some(start_csi_driver(program, containerd.base(), registry).await?)
            }
            None => None,
        };
        Ok(Self {
            runner: tokio::sync::Mutex::new(runner),
            api,
            name,
            csi,
        })
    }

    /// The name of `case`'s pod: `<case>-<node>` for a static pod.
    pub(super) fn pod_name(&self, case: &str) -> String {
        match self.api {
            Some(_) => case.to_owned(),
            None => format!("{case}-{}", self.name),
        }
    }

    /// Starts `case`'s pod: its manifest written, or its API pod created.
    pub(super) async fn write(&self, case: &str, yaml: &str) -> Result<(), DifferentialError> {
        let file = format!("{case}.yaml");
        if let Some(api) = &self.api {
            return api.create(&file, yaml).await;
        }
        match &*self.runner.lock().await {
            Runner::Kubelet(k, _) => k.write(&file, yaml),
            Runner::Evpleg { manifests: dir, .. } => {
                let tmp = dir.join(format!(".{file}.tmp"));
                std::fs::write(&tmp, yaml).expect("write manifest");
                std::fs::rename(&tmp, dir.join(&file)).expect("rename manifest");
            }
        }
        Ok(())
    }

    /// Creates the API objects `case`'s pod refers to (none in static mode,
    /// where the corpus allows none).
    pub(super) async fn create_objects(&self, case: &Case) -> Result<(), DifferentialError> {
        match &self.api {
            Some(api) => {
                let file = format!("{}.yaml", case.name);
                for object in &case.objects {
                    api.create_object(&file, object).await?;
                }
                Ok(())
            }
            None if case.objects.is_empty() => Ok(()),
            None => Err(DifferentialError::Manifest {
                path: format!("{}.yaml", case.name).into(),
                why: "API objects without the API server".into(),
            }),
        }
    }

    /// Deletes `case`'s pod: its manifest removed, or its API pod deleted.
    pub(super) async fn remove(&self, case: &str) -> Result<(), DifferentialError> {
        if let Some(api) = &self.api {
            return api.delete(case).await;
        }
        let file = format!("{case}.yaml");
        match &*self.runner.lock().await {
            Runner::Kubelet(k, _) => k.remove(&file),
            Runner::Evpleg { manifests: dir, .. } => {
                std::fs::remove_file(dir.join(file)).expect("remove manifest")
            }
        }
        Ok(())
    }

    /// Does `act` to `case`'s pod; `false` when it cannot be done yet.
    pub(super) async fn act(
        &self,
        act: act::Act,
        case: &Case,
        client: &evpleg_cri::CriClient,
    ) -> Result<bool, DifferentialError> {
        match act {
            act::Act::KillSandbox => act::kill_sandbox(client, &self.pod_name(&case.name)).await,
            act::Act::Update => {
                self.write(&case.name, &act::updated(&case.yaml)).await?;
                Ok(true)
            }
            act::Act::Gate => match &self.api {
                Some(api) => api.open_gate(&case.name).await.map(|()| true),
                None => Err(DifferentialError::Api(format!(
                    "{}: a readiness gate needs the API server (api-only)",
                    case.name
                ))),
            },
            act::Act::RestartNode => self.restart().await.map(|()| true),
        }
    }

    /// Stops the node's process and starts it again with the same
    /// configuration and state; its pods keep running.
    async fn restart(&self) -> Result<(), DifferentialError> {
        let mut runner = self.runner.lock().await;
        match &mut *runner {
            Runner::Kubelet(k, _) => k.restart().await?,
            Runner::Evpleg {
                agent,
                program,
                args,
                log,
                ..
            } => {
                if let Some(old) = agent.take() {
                    stop_agent(old).await;
                }
                *agent = Some(spawn_agent(program, args, log).await?);
            }
        }
        Ok(())
    }

    /// The pods served now, by name.
    pub(super) async fn pods(&self) -> BTreeMap<String, Value> {
        if let Some(api) = &self.api {
            return api.pods().await;
        }
        let list = match &*self.runner.lock().await {
            Runner::Kubelet(k, _) => k.pods().await.unwrap_or(Value::Null),
            Runner::Evpleg { agent, .. } => match agent {
                Some(a) => crate::stock_kubelet::pods_at(a.addr)
                    .await
                    .unwrap_or(Value::Null),
                None => Value::Null,
            },
        };
        list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| Some((p["metadata"]["name"].as_str()?.to_owned(), p.clone())))
            .collect()
    }

    /// Stops the node; returns the kubelet's cgroup root, to remove once
    /// containerd has removed the containers.
    pub(super) async fn stop(self) -> Option<String> {
        let csi = self.csi;
        let root = match self.runner.into_inner() {
            Runner::Kubelet(mut k, proxy) => {
                k.stop();
                let root = k.private_cgroup_root().map(str::to_owned);
                drop(k);
                drop(proxy);
                root
            }
            Runner::Evpleg { agent, log, .. } => {
                if let Some(a) = agent {
                    stop_agent(a).await;
                }
                // Its log with the harness's, as a test's output is kept.
                eprintln!(
                    "the agent's log {}:\n{}",
                    log.display(),
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
                None
            }
        };
        if let Some(driver) = csi {
            let _ = tokio::task::spawn_blocking(move || drop(driver)).await;
        }
        root
    }
}

/// How long the node has to answer the CSI driver's registration.
const CSI_REGISTRATION_BOUND: Duration = Duration::from_secs(30);

/// Starts the test CSI driver `program` (its state under `base`), its
/// registration socket in the node's `registry`, and waits until the node
/// has told it how its registration went (`NotifyRegistrationStatus`,
/// registered or not: a standalone kubelet refuses every CSI driver, it has
/// no API server to publish the driver's node id to), so that no pod's
/// mount races the registration.
async fn start_csi_driver(
    program: &'static str,
    base: &Path,
    registry: PathBuf,
) -> Result<CsiDriverProcess, DifferentialError> {
    let base = base.to_owned();
    let driver = tokio::task::spawn_blocking(move || {
        CsiDriverProcess::start(program, DRIVER_NAME, &base, &registry, &[])
    })
    .await
    .map_err(|e| DifferentialError::CsiDriver(format!("start: {e}")))?
    .map_err(|e| DifferentialError::CsiDriver(format!("start {program}: {e}")))?;
    let notified = tokio::time::timeout(CSI_REGISTRATION_BOUND, async {
        while !driver
            .calls()
            .iter()
            .any(|c| c.method == "NotifyRegistrationStatus")
        {
            tokio::time::sleep(STATUS_POLL).await;
        }
    })
    .await;
    match notified {
        Ok(()) => Ok(driver),
        Err(_) => Err(DifferentialError::CsiDriver(format!(
            "the node did not answer its registration within {CSI_REGISTRATION_BOUND:?} (calls: {:?})",
            driver.calls()
        ))),
    }
}

/// The agent's `--root-dir` under its containerd's base (its
/// `plugins_registry/` there).
fn agent_root(base: &Path) -> PathBuf {
    base.join("agent-root")
}

/// How long the agent has to stop on SIGTERM (its pods' statuses flushed)
/// before it is killed.
const AGENT_STOP_BOUND: Duration = Duration::from_secs(10);

/// Starts `evpleg run` with `args` (`program`: the `evpleg-killable` build of
/// the binary's `main`), its log appended to `log`.
async fn spawn_agent(
    program: &'static str,
    args: &[String],
    log: &Path,
) -> Result<Killable, DifferentialError> {
    let (args, log) = (args.to_vec(), log.to_owned());
    tokio::task::spawn_blocking(move || Killable::spawn(Path::new(program), &args, &log))
        .await
        .map_err(|e| DifferentialError::Agent(format!("start: {e}")))
}

/// Stops the agent as a node's is stopped (SIGTERM), SIGKILL past
/// [`AGENT_STOP_BOUND`].
async fn stop_agent(agent: Killable) {
    let _ = tokio::task::spawn_blocking(move || agent.stop(AGENT_STOP_BOUND)).await;
}
