//! The whole agent wired together, as the kubelet's `RunKubelet` does: sources ->
//! mux -> sync loop -> pod workers -> CRI; the PLEG (kernel events merged with a
//! reconciling relist, or the kubelet's generic relist) -> cache + events -> the
//! same workers; workers -> the status manager -> the local `/pods` store and,
//! with a kubeconfig, the API server; pod events kept per pod
//! (`/pods/<namespace>/<name>/events`) and, with a kubeconfig, written to the
//! API server; the volume manager's reconciler mounting the pods' volumes.
//! Also `/metrics` and `/healthz`, and the kubelet's authenticated server
//! ([`crate::server::secure`]) with a kubeconfig or `--authorization-mode
//! AlwaysAllow`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::routing::get;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{AuthorizationModeFlag, NoEndpoint, RUN_LISTEN, RunArgs};
use crate::metrics::Metrics;
use crate::server;
use crate::server::ServerState;
use crate::server::tls::ClientCerts;
use evpleg_core::clock::{MonotonicClock, SharedClock, WallClock};
use evpleg_core::tasks::TaskHealth;
use evpleg_cri::runtime::CriRuntime;
use evpleg_cri::{CriClient, CriClientConfig, CriError};
use evpleg_kubelet::admission::{Admission, Allocatable, Reserved};
use evpleg_kubelet::kuberuntime::backoff::{CrashBackoff, ImagePullBackoff};
use evpleg_kubelet::kuberuntime::gc;
use evpleg_kubelet::kuberuntime::gc::GcPolicy;
use evpleg_kubelet::kuberuntime::manager::{KubeRuntime, NodeInfo};
use evpleg_kubelet::pod_workers::{PodWorkers, WorkerConfig, WorkerState};
use evpleg_kubelet::source::SourceName;
use evpleg_kubelet::source::mux::PodConfig;
use evpleg_kubelet::status::local::LocalStore;
use evpleg_kubelet::status::manager::{FLUSH_BOUND, StatusManager};
use evpleg_kubelet::status::{StatusWriter, WriteError};
use evpleg_kubelet::sync_loop::{SyncLoop, SyncLoopParts};
use evpleg_pleg::kernel::index::{cgroup2_mount, v1_hierarchies};
use evpleg_pleg::{Pleg, PlegError};
use evpleg_record::Recorder;
use evpleg_record::api::ApiWriter;

/// Errors of starting the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("the agent needs a CRI runtime: {0}")]
    NoRuntime(#[from] NoEndpoint),
    #[error("the agent needs a CRI runtime; --cri-endpoint none is for observe")]
    RuntimeDisabled,
    #[error("container runtime: {0}")]
    Cri(#[from] CriError),
    #[error(transparent)]
    Pleg(#[from] PlegError),
    #[error("manifest url {url}: {message}")]
    Url { url: String, message: String },
    #[error("kubeconfig {path}: {message}")]
    Kube { path: String, message: String },
    #[error(transparent)]
    Sysctls(#[from] evpleg_kubelet::admission::sysctls::SysctlError),
    #[error("--system-reserved / --kube-reserved: {0}")]
    Reserved(#[from] evpleg_kubelet::admission::ReservedError),
    #[error("--node-labels / --register-with-taints: {0}")]
    NodeFlags(#[from] evpleg_kubelet::admission::node::NodeFlagError),
    #[error("CSI plugin registration: {0}")]
    PluginRegistry(#[from] evpleg_volume::csi::CsiError),
    #[error("--root-dir: {0}")]
    RootDir(#[from] evpleg_volume::pod_dirs::PodDirError),
    #[error("kubelet server: {0}")]
    KubeletServer(#[from] crate::server::tls::TlsError),
    #[error(transparent)]
    LogPolicy(#[from] evpleg_kubelet::logs::LogRotateError),
    #[error("cannot serve on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Writes every status to the local store and, when configured, the API server.
#[derive(Debug)]
struct Writers {
    local: Arc<LocalStore>,
    api: Option<evpleg_kubelet::status::api::ApiStatusWriter>,
}

impl StatusWriter for Writers {
    async fn write(
        &self,
        pod: &k8s_openapi::api::core::v1::Pod,
        status: &k8s_openapi::api::core::v1::PodStatus,
    ) -> Result<(), WriteError> {
        self.local.write(pod, status).await?;
        match &self.api {
            Some(api) => api.write(pod, status).await,
            None => Ok(()),
        }
    }

    async fn forget(&self, pod: &k8s_openapi::api::core::v1::Pod) {
        self.local.forget(pod).await;
        if let Some(api) = &self.api {
            api.forget(pod).await;
        }
    }

    async fn delete(&self, pod: &k8s_openapi::api::core::v1::Pod) -> Result<(), WriteError> {
        match &self.api {
            Some(api) => api.delete(pod).await,
            None => Ok(()),
        }
    }
}

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    pub local: Arc<LocalStore>,
    /// The pods' events ([`evpleg_record`]).
    pub events: Recorder,
    /// The CSI drivers registered through the plugin registration directory.
    pub csi_drivers: evpleg_volume::csi::CsiDrivers,
    pub status: Arc<StatusManager>,
    pub addr: SocketAddr,
    /// The kubelet server's address, when it serves.
    pub kubelet_addr: Option<SocketAddr>,
    /// The kubelet server's state (its auth caches' counts, its log streams).
    pub kubelet_api: Option<Arc<server::secure::KubeletApi>>,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    pleg: Option<Pleg>,
    workers: Arc<PodWorkers<KubeRuntime>>,
    status_task: Option<JoinHandle<()>>,
}

async fn kube_client(path: &str) -> Result<kube::Client, AgentError> {
    let err = |e: &dyn std::fmt::Display| AgentError::Kube {
        path: path.to_owned(),
        message: e.to_string(),
    };
    let config = if path == "in-cluster" {
        kube::Config::incluster().map_err(|e| err(&e))?
    } else {
        let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| err(&e))?;
        kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .map_err(|e| err(&e))?
    };
    // The status manager and the watcher back off themselves; kube's own retries
    // would hide an outage for minutes.
    let mut config = config;
    config.default_retry = false;
    kube::Client::try_from(config).map_err(|e| err(&e))
}

impl Agent {
    /// Starts every part of the agent.
    pub async fn start(args: &RunArgs) -> Result<Self, AgentError> {
        let common = &args.common;
        let endpoint = common
            .endpoint(std::path::Path::new("/"))?
            .ok_or(AgentError::RuntimeDisabled)?;
        // The flags first, then the HTTP port: bad input or a clash fails
        // before anything started.
        let node_name = args.node_name();
        let reserved = Reserved::parse(&args.system_reserved)
            .and_then(|s| Reserved::parse(&args.kube_reserved).map(|k| s.plus(k)))?;
        let node_info = evpleg_kubelet::admission::node::NodeInfo::from_flags(
            &node_name,
            &args.node_labels,
            &args.register_with_taints,
        )?;
        let host = Allocatable::of_host(&args.root_dir);
        let allocatable = host.minus(reserved, args.max_pods);
        let capacity = Allocatable {
            pods: args.max_pods,
            ..host
        };
        let sysctls =
            evpleg_kubelet::admission::sysctls::Allowlist::for_host(&args.allowed_unsafe_sysctls)?;
        let admission = Admission::new(allocatable, node_info.clone()).with_sysctls(sysctls);
        let listen = common.listen_or(RUN_LISTEN);
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|source| AgentError::Listen {
                addr: listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| AgentError::Listen {
            addr: listen,
            source,
        })?;
        let serve_kubelet = args.kubeconfig.is_some()
            || args.server.authorization_mode == AuthorizationModeFlag::AlwaysAllow;
        let kubelet_listener = if serve_kubelet {
            let addr = SocketAddr::new(args.server.address, args.server.port);
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| AgentError::Listen { addr, source })?;
            Some(listener)
        } else {
            info!("kubelet server off: no --kubeconfig to review its requests with");
            None
        };
        let kubelet_addr = kubelet_listener.as_ref().and_then(|l| l.local_addr().ok());
        let clock: SharedClock = Arc::new(MonotonicClock);
        let host_ip = args.node_ip();
        let cri = CriClient::connect(&endpoint, CriClientConfig::default()).await?;
        let cri_metrics = cri.metrics();
        let shutdown = CancellationToken::new();
        let mut tasks = Vec::new();

        let (pleg_tx, pleg_rx) = mpsc::channel(common.event_channel);
        let pleg = Pleg::start(
            common.pleg.mode(),
            CriRuntime::new(cri.clone()),
            common.kernel.config(),
            pleg_tx,
            clock.clone(),
            common.relist_period,
        )?;

        // Status: the manager writes to the local store and maybe the API.
        let local = Arc::new(LocalStore::new());
        let kube = match &args.kubeconfig {
            Some(path) => Some(kube_client(path).await?),
            None => None,
        };
        let writers = Writers {
            local: local.clone(),
            api: kube
                .clone()
                .map(|c| evpleg_kubelet::status::api::ApiStatusWriter::new(c, node_name.clone())),
        };
        let status = Arc::new(StatusManager::new());
        let health = TaskHealth::new(clock.clone());
        // Events: kept locally, and written to the API with a kubeconfig.
        let wall: SharedClock = Arc::new(WallClock);
        let events = match &kube {
            Some(client) => {
                let (events, queue) = Recorder::with_api(&node_name, wall.clone());
                let writer = ApiWriter::new(client.clone(), &node_name, wall, events.stats());
                tasks.push(health.spawn(
                    "event writer",
                    shutdown.clone(),
                    writer.run(queue, shutdown.clone()),
                ));
                events
            }
            None => Recorder::new(&node_name, wall, Default::default(), None),
        };
        // CSI drivers register through <root-dir>/plugins_registry (the
        // kubelet's plugin manager); the CSI volume plugin finds them there.
        let csi_drivers = evpleg_volume::csi::CsiDrivers::new();
        let watcher = evpleg_volume::csi::PluginWatcher::new(
            &args.root_dir,
            csi_drivers.clone(),
            evpleg_volume::csi::CsiClientConfig::default(),
        )?;
        tasks.push(health.spawn(
            "plugin watcher",
            shutdown.clone(),
            watcher.run(shutdown.clone()),
        ));
        let status_task = health.spawn(
            "status manager",
            shutdown.clone(),
            status.clone().run(writers, shutdown.clone()),
        );

        let mut cgroup_mounts: Vec<PathBuf> = cgroup2_mount().ok().flatten().into_iter().collect();
        cgroup_mounts.extend(
            v1_hierarchies()
                .unwrap_or_default()
                .into_iter()
                .map(|(_, _, m)| m),
        );
        let version = cri.version().await?;
        let runtime_name = version.runtime_name.clone();
        let cgroup_driver =
            evpleg_kubelet::kuberuntime::cgroups::resolve_driver(args.cgroup_driver.driver(), &cri)
                .await;
        let node = NodeInfo {
            name: node_name.clone(),
            host_ip: host_ip.clone(),
            runtime_name,
            cgroup_driver,
            log_dir: args.pod_log_dir.clone(),
            cgroup_mounts: cgroup_mounts.clone(),
            dns: args.dns(),
            root_dir: args.root_dir.clone(),
        };
        let backoff =
            CrashBackoff::crash_loop(args.crashloop_backoff_initial, args.crashloop_backoff_max);
        let image_backoff =
            ImagePullBackoff::new(args.image_pull_backoff_initial, args.image_pull_backoff_max);
        let gc_policy = GcPolicy {
            min_age: args.minimum_container_ttl_duration,
            max_per_pod_container: args.maximum_dead_containers_per_container,
            max_containers: args.maximum_dead_containers,
        };
        // The collector asks the sync loop which pods' content may go.
        let (gc_pods, gc_queries) = gc::content_channel();
        tasks.push(health.spawn(
            "container gc",
            shutdown.clone(),
            gc::run(
                cri.clone(),
                gc_policy,
                args.pod_log_dir.clone(),
                args.container_gc_period,
                gc_pods,
                shutdown.clone(),
            ),
        ));
        let (probe_results, probe_changes) = evpleg_kubelet::prober::Results::new();
        let prober = Arc::new(evpleg_kubelet::prober::ProberManager::new(
            probe_results.clone(),
            pleg.cache.clone(),
            cri.clone(),
            host_ip.clone(),
            events.clone(),
        ));
        // <root-dir>/pods is root's, mode 0750: no other host user reaches
        // the pods' volumes.
        evpleg_volume::pod_dirs::ensure_pods_dir(&args.root_dir)?;
        // Volumes: the built-in plugins (others register on `plugins`), the
        // reconciler as an essential task.
        let volume_host = evpleg_volume::VolumeHost {
            root_dir: args.root_dir.clone(),
            node_name: node_name.clone(),
            kube: kube.clone(),
        };
        let mut plugins = evpleg_volume::builtin_plugins(&volume_host);
        // CSI volumes, through the drivers of the plugin watcher.
        if let Err(e) = plugins.register(Arc::new(evpleg_volume::csi::plugin::CsiPlugin::new(
            &args.root_dir,
            &node_name,
            csi_drivers.clone(),
        ))) {
            warn!(error = %e, "the CSI volume plugin is not registered");
        }
        let volumes = Arc::new(evpleg_volume::VolumeManager::new(
            volume_host,
            plugins,
            events.clone(),
        ));
        tasks.push(health.spawn(
            "volume manager",
            shutdown.clone(),
            volumes.clone().run(shutdown.clone()),
        ));
        let volume_manager = volumes.clone();
        let syncer = Arc::new(
            KubeRuntime::new(cri.clone(), status.clone(), node, backoff)
                .with_image_pull_backoff(image_backoff)
                .with_probes(probe_results)
                .with_events(events.clone())
                .with_volumes(volumes)
                .with_kube(kube.clone()),
        );
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let workers = Arc::new(PodWorkers::new(
            syncer,
            pleg.cache.clone(),
            clock.clone(),
            Some(pleg.pod_relist.clone()),
            WorkerConfig {
                resync: args.sync_frequency,
                ..WorkerConfig::default()
            },
            done_tx,
        ));

        // Sources -> mux -> sync loop.
        let (source_tx, source_rx) = mpsc::channel(64);
        let (update_tx, update_rx) = mpsc::channel(64);
        let mux = PodConfig::new();
        let seen = mux.seen_sources();
        tasks.push(health.spawn("pod config", shutdown.clone(), async move {
            mux.run(source_rx, update_tx).await;
        }));
        let mut sources = Vec::new();
        if let Some(dir) = &args.manifest_dir {
            sources.push(SourceName::File);
            let file =
                evpleg_kubelet::source::file::FileSource::new(dir.clone(), node_name.clone());
            tasks.push(health.spawn("file source", shutdown.clone(), file.run(source_tx.clone())));
            info!(dir = %dir.display(), "static pod manifests watched");
        }
        if let Some(url) = &args.manifest_url {
            sources.push(SourceName::Http);
            let config =
                evpleg_kubelet::source::url::UrlSourceConfig::new(url.clone(), node_name.clone());
            let src = evpleg_kubelet::source::url::UrlSource::new(config).map_err(|e| {
                AgentError::Url {
                    url: url.clone(),
                    message: e.to_string(),
                }
            })?;
            tasks.push(health.spawn("url source", shutdown.clone(), src.run(source_tx.clone())));
        }
        let node_client = kube.clone();
        let node_client_for_auth = kube.clone();
        if let Some(client) = kube {
            sources.push(SourceName::Api);
            let api = evpleg_kubelet::source::api::ApiSource::new(client, node_name.clone());
            tasks.push(health.spawn("api source", shutdown.clone(), api.run(source_tx.clone())));
        }
        if sources.is_empty() {
            warn!(
                "no pod source configured (--manifest-dir, --manifest-url, --kubeconfig): no pods will run"
            );
        }
        drop(source_tx);
        let status_cri = cri.clone();
        let kubelet_cri = cri.clone();
        // The kubelet's container log manager: rotation by size.
        let log_manager = evpleg_kubelet::logs::ContainerLogManager {
            cri: cri.clone(),
            policy: evpleg_kubelet::logs::LogPolicy::new(
                args.container_log_max_size,
                args.container_log_max_files as usize,
            )?,
            interval: args.container_log_monitor_interval,
        };
        tasks.push(health.spawn(
            "container log manager",
            shutdown.clone(),
            log_manager.run(shutdown.clone()),
        ));
        let host_ip_for_status = host_ip.clone();
        let sync_loop = SyncLoop::new(SyncLoopParts {
            workers: workers.clone(),
            status: status.clone(),
            cache: pleg.cache.clone(),
            cri,
            admission,
            seen,
            sources,
            host_ip,
            cgroup_mounts,
            root_dir: Some(args.root_dir.clone()),
            event_latency: pleg.event_latency.clone(),
            prober: Some((prober, probe_changes)),
            events: events.clone(),
            gc_queries: Some(gc_queries),
        });
        tasks.push(health.spawn(
            "sync loop",
            shutdown.clone(),
            sync_loop.run(update_rx, pleg_rx, done_rx, shutdown.clone()),
        ));

        // HTTP: /metrics, /healthz, /pods.
        let essential = vec![health.clone(), pleg.task_health.clone()];
        let metrics = Arc::new(
            Metrics::new(Some(&pleg), None)
                .with_task_health(essential.clone())
                .with_status(status.clone())
                .with_workers(workers.metrics())
                .with_volumes(&volume_manager)
                .with_events(events.stats())
                .with_cri(cri_metrics)
                .with_csi(csi_drivers.metrics()),
        );
        let mut state = ServerState::new(
            metrics,
            Some(pleg.relist_stats.clone()),
            clock.clone(),
            pleg.relist_period(),
        )
        .with_path_health(pleg.path_health.clone())
        .with_tasks(essential);
        state.threshold = args.pleg_health_threshold.max(pleg.relist_period() * 2);
        if let Some(client) = node_client {
            use evpleg_kubelet::node_status::runtime_state;
            use evpleg_kubelet::node_status::runtime_state::RuntimeState;
            let runtime = RuntimeState::new(clock, args.runtime_status_period);
            tasks.push(health.spawn(
                "runtime status",
                shutdown.clone(),
                runtime_state::run(
                    status_cri,
                    runtime.clone(),
                    args.runtime_status_period,
                    shutdown.clone(),
                ),
            ));
            let checked = state.clone();
            let node_health: evpleg_kubelet::node_status::Health = Arc::new(move || {
                let (code, body) = server::health_report(&checked);
                let healthz = if code.is_success() { Ok(()) } else { Err(body) };
                runtime_state::ready(runtime.errors(), healthz)
            });
            use evpleg_kubelet::node_status::info;
            let identity = info::NodeIdentity {
                internal_ip: host_ip_for_status.clone(),
                hostname: crate::config::host_name(),
                kubelet_port: kubelet_addr.map(|a| a.port()),
                system: info::system_info(&version.runtime_name, &version.runtime_version),
            };
            let parts = evpleg_kubelet::node_status::NodeStatusParts {
                client,
                node: node_info,
                capacity,
                allocatable,
                lease_duration_seconds: args.node_lease_duration_seconds,
                update_frequency: args.node_status_update_frequency,
                health: node_health,
                identity,
            };
            tasks.push(health.spawn(
                "node status",
                shutdown.clone(),
                evpleg_kubelet::node_status::run(parts, shutdown.clone()),
            ));
        }
        let mut router = server::router(state.clone());
        // /pods exposes every pod's spec, env values included: an operator
        // turns it off with --pods-endpoint=false (the kubelet's read-only
        // port off).
        if args.pods_endpoint {
            router = router.merge(pods_routes(&local, &events));
        }
        let mut kubelet_api = None;
        if let Some(listener) = kubelet_listener {
            let tls = crate::server::tls::server_config(
                &serving_cert(args, &node_name),
                args.server
                    .client_ca_file
                    .as_deref()
                    .map_or(ClientCerts::Off, ClientCerts::Optional),
            )?;
            let api = Arc::new(server::secure::KubeletApi {
                auth: server::auth::Auth::new(
                    args.server.auth(&node_name),
                    node_client_for_auth.map(server::auth::KubeReviewer),
                ),
                pods: local.clone(),
                cri: kubelet_cri.clone(),
                log_streams: Default::default(),
                streams: Arc::new(server::streaming::Streams::new(shutdown.clone())),
                stats: Some(Arc::new(server::stats::StatsProvider::new(
                    node_name.clone(),
                    kubelet_cri,
                    local.clone(),
                    cgroup_driver,
                    args.root_dir.clone(),
                    args.pod_log_dir.clone(),
                ))),
                configz: server::configz::document(args, &node_name),
            });
            let base = server::router(state).merge(pods_routes(&local, &events));
            tasks.push(tokio::spawn(server::secure::serve(
                listener,
                tls,
                server::secure::router(api.clone(), base),
                common.http.limits(),
                shutdown.clone(),
            )));
            info!(addr = ?kubelet_addr, "kubelet server running: /containerLogs, /exec, /attach, /portForward, /run, /stats/summary, /metrics/resource, /configz, /pods, /metrics, /healthz");
            kubelet_api = Some(api);
        }
        tasks.push(tokio::spawn(crate::http::serve(
            listener,
            None,
            router,
            common.http.limits(),
            shutdown.clone(),
        )));
        info!(%addr, node = %node_name, mode = ?pleg.mode, endpoint, "agent running: /pods, /pods/<namespace>/<name>/events, /metrics, /healthz");
        Ok(Self {
            local,
            events,
            csi_drivers,
            status,
            addr,
            kubelet_addr,
            kubelet_api,
            shutdown,
            tasks,
            pleg: Some(pleg),
            workers,
            status_task: Some(status_task),
        })
    }

    /// The PLEG (for its stats and cache).
    pub fn pleg(&self) -> Option<&Pleg> {
        self.pleg.as_ref()
    }

    /// The state of a pod's worker (`Done` once it terminated).
    pub fn worker_state(&self, uid: &evpleg_core::ids::PodUid) -> Option<WorkerState> {
        self.workers.state(uid)
    }

    /// Stops everything: the sources, the sync loop and the workers stop (the
    /// containers keep running), pending statuses are written within
    /// [`FLUSH_BOUND`], then the PLEG stops.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        self.workers.shutdown();
        if let Some(t) = self.status_task.take() {
            let abort = t.abort_handle();
            if tokio::time::timeout(FLUSH_BOUND + Duration::from_secs(1), t)
                .await
                .is_err()
            {
                warn!("the status manager did not stop within its bound");
                abort.abort();
            }
        }
        for t in self.tasks.drain(..) {
            t.abort();
            let _ = t.await;
        }
        if let Some(p) = self.pleg.take() {
            p.stop().await;
        }
    }
}

/// `/pods` and `/pods/{namespace}/{name}/events`.
fn pods_routes(local: &Arc<LocalStore>, events: &Recorder) -> axum::Router {
    let pods_store = local.clone();
    let pod_events = events.clone();
    axum::Router::new()
        .route(
            "/pods",
            get(move || {
                let store = pods_store.clone();
                async move { axum::Json(store.pod_list()) }
            }),
        )
        .route(
            "/pods/{namespace}/{name}/events",
            get(move |Path((namespace, name)): Path<(String, String)>| {
                let events = pod_events.clone();
                async move { axum::Json(events.event_list(&namespace, &name)) }
            }),
        )
}

/// The kubelet server's certificate: the flags' files, else a self-signed
/// one in --cert-dir (<root-dir>/pki) for the host name, the node name and
/// the node IP.
fn serving_cert(args: &RunArgs, node_name: &str) -> crate::server::tls::ServingCert {
    use crate::server::tls::ServingCert;
    if let (Some(cert), Some(key)) = (
        &args.server.tls_cert_file,
        &args.server.tls_private_key_file,
    ) {
        return ServingCert::Files {
            cert: cert.clone(),
            key: key.clone(),
        };
    }
    let mut names = vec![
        crate::config::host_name(),
        node_name.to_owned(),
        args.node_ip(),
    ];
    names.dedup();
    names.retain(|n| !n.is_empty());
    ServingCert::SelfSigned {
        dir: args
            .server
            .cert_dir
            .clone()
            .unwrap_or_else(|| args.root_dir.join("pki")),
        names,
    }
}
