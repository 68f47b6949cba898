//! SyncPod: the kubelet's `SyncPod` (`kuberuntime_manager.go`) for a pod that
//! should run. Each sync publishes the pod's API status, computes the actions
//! ([`super::actions`]), waits for the pod's volumes ([`evpleg_volume`]) and
//! carries the actions out: a kill of the old sandbox and the purge of its
//! init containers (`purgeInitContainers`), sandbox, image present or pulled,
//! init containers one by one, app containers, kills of changed containers,
//! CrashLoopBackOff.

use std::sync::Arc;
use std::time::Duration;

use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::{Container, Pod};
use tracing::{info, warn};

use super::actions::{backoff_key, compute_pod_actions_probed, format_pod, latest};
use super::cri_config::{container_config, container_mounts, host_network, sandbox_config};
use super::images::{PullPolicy, back_off_event};
use super::reasons::{
    CONTAINER_CREATING, CREATE_CONTAINER_CONFIG_ERROR, CREATE_CONTAINER_ERROR,
    ERR_IMAGE_NEVER_PULL, ERR_IMAGE_PULL, IMAGE_INSPECT_ERROR, IMAGE_PULL_BACKOFF,
    INVALID_IMAGE_NAME, RUN_CONTAINER_ERROR, StartError, check_image_reference,
};
use super::security_context::{needs_image_user, verify_run_as_non_root};
use crate::events as kubelet_events;
use crate::kuberuntime::manager::{KubeRuntime, lock, pod_uid, unix_now_ns};
use crate::network::hostname_and_domain;
use crate::network::hosts::{ETC_HOSTS, HostsSpec, ensure_hosts_mount};
use crate::pod_workers::{SyncError, SyncResult, spec_grace_seconds};
use evpleg_core::cache::CacheEntry;
use evpleg_core::container::{ContainerState, PodStatus};
use evpleg_core::ids::PodUid;
use evpleg_record::EventType;

impl KubeRuntime {
    pub(super) async fn sync_pod(
        &self,
        pod: Arc<Pod>,
        entry: CacheEntry,
    ) -> Result<SyncResult, SyncError> {
        let uid = pod_uid(&pod)?;
        let now = unix_now_ns();
        // Past its activeDeadlineSeconds: Failed (DeadlineExceeded, set by
        // `publish`), terminal, its containers killed by the termination.
        let deadline = crate::active_deadline::remaining(&pod, self.active_start(&pod, &uid), now);
        if deadline.is_some_and(|d| d.is_zero()) {
            info!(pod = %uid, "pod past its active deadline");
            self.events.record(
                &pod,
                None,
                EventType::Normal,
                crate::active_deadline::REASON,
                crate::active_deadline::MESSAGE.to_owned(),
            );
            self.publish(
                &pod,
                &uid,
                &entry.status,
                Some(super::actions::Terminal::Failed),
            );
            return Ok(SyncResult {
                terminal: true,
                ..SyncResult::default()
            });
        }
        let mut actions = {
            let backoff = lock(&self.backoff);
            compute_pod_actions_probed(&pod, &uid, &entry.status, &backoff, now, &|c, id| {
                self.probes.started(c, id)
            })
        };
        crate::prober::probe_kills(&pod, &entry.status, &self.probes, &mut actions);
        self.publish(&pod, &uid, &entry.status, actions.terminal);
        if actions.terminal.is_some() {
            return Ok(SyncResult {
                terminal: true,
                ..SyncResult::default()
            });
        }
        // As the kubelet's SyncPod: the volumes first (WaitForAttachAndMount).
        self.wait_for_volumes(&pod, &uid).await?;
        kubelet_events::crash_loop_back_off(&self.events, &pod, &uid, &actions.backoff);
        lock(&self.reasons).back_off(&uid, &actions.backoff);
        let grace = spec_grace_seconds(&pod);
        if actions.kill_pod {
            kubelet_events::sandbox_changed(&self.events, &pod);
            self.kill_pod(&uid, &pod, grace, &entry.status).await?;
            if actions.create_sandbox {
                self.purge_init_containers(&pod, &uid, &entry.status)
                    .await?;
            }
        }
        for k in &actions.kill {
            info!(pod = %uid, container = %k.name, reason = %k.reason, "killing container");
            kubelet_events::killing(&self.events, &pod, &k.name, &k.reason);
            let grace = k.grace_seconds.unwrap_or(grace);
            self.stop_with_pre_stop((&*pod, &uid), &k.name, k.id.as_str(), grace, None)
                .await?;
        }
        let spec = pod.spec.clone().unwrap_or_default();
        let (sandbox_config, dns_warnings) =
            sandbox_config(&pod, &uid, actions.sandbox_attempt, &self.node).inspect_err(|e| {
                warn!(pod = %uid, error = %e, "sandbox config");
                if actions.create_sandbox {
                    kubelet_events::failed_create_pod_sandbox(&self.events, &pod, e);
                }
            })?;
        let host_net = host_network(&pod);
        let (sandbox_id, pod_ips) = if actions.create_sandbox {
            for w in dns_warnings {
                warn!(pod = %uid, reason = w.reason, message = %w.message, "pod DNS config");
                self.events
                    .record(&pod, None, EventType::Warning, w.reason, w.message);
            }
            // The runtime sets up the pod's network here (CNI ADD), unless
            // it shares the node's; a failure is the plugin's error.
            let id = self
                .cri
                .run_pod_sandbox(&sandbox_config, "")
                .await
                .inspect_err(|e| {
                    warn!(pod = %uid, error = %e, "RunPodSandbox failed");
                    kubelet_events::failed_create_pod_sandbox(&self.events, &pod, e);
                    self.sandbox_failed(&uid, &spec, &actions, e);
                })
                .map_err(|e| {
                    SyncError(format!(
                        "pod {}: failed to create pod sandbox: {e}",
                        format_pod(&pod, &uid)
                    ))
                })?;
            info!(pod = %uid, sandbox = %id, "sandbox created");
            // As the kubelet: the new sandbox's IPs, for the containers'
            // /etc/hosts.
            let ips = if host_net {
                vec![self.node.host_ip.clone()]
            } else {
                let status = self.cri.pod_sandbox_status(&id, false).await.map_err(|e| {
                    SyncError(format!(
                        "pod {}: sandbox {id} status: {e}",
                        format_pod(&pod, &uid)
                    ))
                })?;
                evpleg_cri::runtime::sandbox_ips(status.status.as_ref())
            };
            (id, ips)
        } else {
            let id = actions
                .sandbox
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            let ips = if host_net {
                vec![self.node.host_ip.clone()]
            } else {
                entry.status.ips.clone()
            };
            (id, ips)
        };
        // Attempts continue from the newest container, whatever its sandbox.
        let status = &entry.status;
        let inits = spec.init_containers.as_deref().unwrap_or_default();
        let init = actions.start_init.iter().map(|i| &inits[*i]);
        let apps = actions.start.iter().map(|j| &spec.containers[*j]);
        // As the kubelet: every container is tried, each error recorded for its
        // status, and the sync fails if one did.
        let mut failed = Vec::new();
        for c in init.chain(apps) {
            let started = self
                .start_container(
                    &pod,
                    &uid,
                    (&sandbox_id, &sandbox_config, &pod_ips),
                    c,
                    status,
                )
                .await;
            let mut reasons = lock(&self.reasons);
            match started {
                Ok(()) => reasons.remove(&uid, &c.name),
                Err(e) => {
                    warn!(pod = %uid, container = %c.name, reason = e.reason, message = %e.message, "container start failed");
                    kubelet_events::start_failed(&self.events, &pod, &c.name, &e);
                    failed.push(format!("container {}: {e}", c.name));
                    reasons.update(&uid, &c.name, e);
                }
            }
        }
        if !failed.is_empty() {
            return Err(SyncError(format!(
                "pod {}: {}",
                format_pod(&pod, &uid),
                failed.join("; ")
            )));
        }
        Ok(SyncResult {
            terminal: false,
            // The kubelet's `ShouldSync`: back when the deadline comes.
            requeue_after: deadline,
            backoff: actions
                .backoff
                .iter()
                .map(|w| w.retry_in)
                .chain(actions.recheck)
                .min(),
            did_runtime_work: actions.does_runtime_work(),
        })
    }

    /// Removes every init container of the pod before its new sandbox (the
    /// kubelet's `purgeInitContainers`, after the kill): the init containers
    /// then run again from the first, and none of the old sandbox's counts.
    async fn purge_init_containers(
        &self,
        pod: &Pod,
        uid: &PodUid,
        status: &PodStatus,
    ) -> Result<(), SyncError> {
        let inits = pod
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.as_deref())
            .unwrap_or_default();
        for c in status
            .containers
            .iter()
            .filter(|c| inits.iter().any(|i| i.name == c.name))
        {
            info!(pod = %uid, container = %c.name, id = %c.id, "removing an init container before the new sandbox");
            self.cri
                .remove_container(c.id.as_str())
                .await
                .map_err(|e| {
                    SyncError(format!(
                        "pod {}: removing init container {} ({}): {e}",
                        format_pod(pod, uid),
                        c.name,
                        c.id
                    ))
                })?;
        }
        Ok(())
    }

    /// Adds the pod's volumes to the desired state (the populator's
    /// `ReprocessPod`, which also refreshes configMap-like volumes) and waits
    /// for them (`WaitForAttachAndMount`); a failure is a FailedMount event
    /// and the sync's error, retried by the worker.
    async fn wait_for_volumes(&self, pod: &Arc<Pod>, uid: &PodUid) -> Result<(), SyncError> {
        let has_volumes = pod
            .spec
            .as_ref()
            .is_some_and(|s| s.volumes.as_ref().is_some_and(|v| !v.is_empty()));
        let Some(volumes) = &self.volumes else {
            if has_volumes {
                return Err(SyncError(format!(
                    "pod {}: the agent has no volume manager",
                    format_pod(pod, uid)
                )));
            }
            return Ok(());
        };
        volumes.add_pod(pod, uid).await;
        volumes
            .wait_for_attach_and_mount(uid, evpleg_volume::MOUNT_WAIT)
            .await
            .map_err(|e| {
                let message = format!("Unable to attach or mount volumes: {e}");
                warn!(pod = %uid, error = %e, "volumes not mounted");
                self.events.record(
                    pod,
                    None,
                    EventType::Warning,
                    evpleg_volume::reconciler::FAILED_MOUNT,
                    message.clone(),
                );
                SyncError(format!("pod {}: {message}", format_pod(pod, uid)))
            })
    }

    /// Makes the container's image present as its pull policy says (the
    /// kubelet's `EnsureImageExists`), with the pull back-off. An unset policy
    /// is defaulted from the image's tag ([`PullPolicy::of`]).
    async fn ensure_image(&self, pod: &Pod, uid: &PodUid, c: &Container) -> Result<(), StartError> {
        let image = c.image.as_deref().unwrap_or_default();
        check_image_reference(image).map_err(|e| {
            StartError::new(
                INVALID_IMAGE_NAME,
                format!("Failed to apply default image tag {image:?}: {e}"),
            )
        })?;
        let policy =
            PullPolicy::of(c).map_err(|e| StartError::new(CREATE_CONTAINER_CONFIG_ERROR, e))?;
        let spec = v1::ImageSpec {
            image: image.to_owned(),
            ..Default::default()
        };
        let present = self
            .cri
            .image_status(&spec, false)
            .await
            .map_err(|e| {
                StartError::new(
                    IMAGE_INSPECT_ERROR,
                    format!("Failed to inspect image {image:?}: {e}"),
                )
            })?
            .image
            .is_some();
        let pull = match policy {
            PullPolicy::Always => true,
            PullPolicy::Never if !present => {
                return Err(StartError::new(
                    ERR_IMAGE_NEVER_PULL,
                    format!("Container image {image:?} is not present with pull policy of Never"),
                ));
            }
            PullPolicy::Never => false,
            PullPolicy::IfNotPresent => !present,
        };
        if !pull {
            kubelet_events::already_present(&self.events, pod, &c.name, image);
            return Ok(());
        }
        let key = (uid.clone(), image.to_owned());
        let now = unix_now_ns();
        if lock(&self.image_backoff)
            .in_backoff_since_update(&key, now)
            .is_some()
        {
            let waiting = lock(&self.pull_errors).back_off_message(uid, image);
            return Err(
                StartError::new(IMAGE_PULL_BACKOFF, back_off_event(image)).waiting_message(waiting)
            );
        }
        lock(&self.pull_errors).pulling(uid, image);
        info!(pod = %uid, image, "pulling image");
        kubelet_events::pulling(&self.events, pod, &c.name, image);
        let started = unix_now_ns();
        match self.pull_with_secrets(pod, &spec).await {
            Ok(_) => {
                let took = Duration::from_nanos((unix_now_ns() - started).max(0) as u64);
                kubelet_events::pulled(&self.events, pod, &c.name, image, took);
                self.status
                    .start_latency
                    .pulled(uid, started, unix_now_ns());
                lock(&self.image_backoff).reset(&key);
                Ok(())
            }
            Err(e) => {
                lock(&self.image_backoff).restarting(key, now, now);
                lock(&self.pull_errors).failed(uid, image, &e);
                // The event names the image, the status has the error alone
                // (`pullImage`'s event and `evalCRIPullErr`'s message).
                Err(StartError::new(
                    ERR_IMAGE_PULL,
                    format!("Failed to pull image {image:?}: {e}"),
                )
                .waiting_message(e))
            }
        }
    }

    /// `PullImage` with the pod's pull secrets ([`crate::credentials`]).
    async fn pull_with_secrets(&self, pod: &Pod, spec: &v1::ImageSpec) -> Result<String, String> {
        let kube = self.kube.as_ref().map(|k| k.client());
        let (secrets, failed) = crate::credentials::pull_secrets(kube, pod).await;
        kubelet_events::failed_to_retrieve_pull_secrets(&self.events, pod, &failed);
        let keyring =
            crate::credentials::Keyring::from_secrets(&secrets).map_err(|e| e.to_string())?;
        crate::credentials::pull_image(&self.cri, &keyring, spec).await
    }

    /// `runAsNonRoot` without `runAsUser`: the image's user decides, read
    /// from the runtime (the kubelet's `verifyRunAsNonRoot`).
    async fn verify_run_as_non_root(
        &self,
        pod: &Pod,
        uid: &PodUid,
        c: &Container,
    ) -> Result<(), StartError> {
        let image = if needs_image_user(pod, c) {
            let spec = v1::ImageSpec {
                image: c.image.clone().unwrap_or_default(),
                ..Default::default()
            };
            self.cri
                .image_status(&spec, false)
                .await
                .map_err(|e| StartError::new(IMAGE_INSPECT_ERROR, e.to_string()))?
                .image
        } else {
            None
        };
        verify_run_as_non_root(pod, c, &format_pod(pod, uid), image.as_ref())
            .map_err(|e| StartError::new(CREATE_CONTAINER_CONFIG_ERROR, e))
    }

    /// A failed RunPodSandbox (a network setup the CNI plugin refused): the
    /// containers it was to start wait in `ContainerCreating`, as under the
    /// kubelet, with the error as their message (the kubelet has it in the
    /// FailedCreatePodSandBox event only).
    fn sandbox_failed(
        &self,
        uid: &PodUid,
        spec: &k8s_openapi::api::core::v1::PodSpec,
        actions: &super::actions::PodActions,
        error: &dyn std::fmt::Display,
    ) {
        let inits = spec.init_containers.as_deref().unwrap_or_default();
        let names = (actions.start_init.iter().map(|i| &inits[*i].name))
            .chain(actions.start.iter().map(|j| &spec.containers[*j].name));
        let mut reasons = lock(&self.reasons);
        for name in names {
            let message = format!("Failed to create pod sandbox: {error}");
            reasons.update(uid, name, StartError::new(CONTAINER_CREATING, message));
        }
    }

    /// The pod's managed /etc/hosts, written now (the kubelet's
    /// `makeHostsMount`, on each container's start).
    fn hosts_mount(
        &self,
        pod: &Pod,
        uid: &PodUid,
        pod_ips: &[String],
    ) -> Result<Option<v1::Mount>, StartError> {
        let spec = pod.spec.clone().unwrap_or_default();
        let (hostname, domain) = hostname_and_domain(pod, &self.node.dns.cluster_domain)
            .map_err(|e| StartError::new(CREATE_CONTAINER_CONFIG_ERROR, e.to_string()))?;
        let aliases = spec.host_aliases.unwrap_or_default();
        let hosts = HostsSpec {
            pod_ips,
            hostname: &hostname,
            domain: &domain,
            aliases: &aliases,
            host_network: spec.host_network.unwrap_or(false),
        };
        ensure_hosts_mount(&self.node.root_dir, uid.as_str(), &hosts)
            .map_err(|e| StartError::new(CREATE_CONTAINER_CONFIG_ERROR, e.to_string()))
    }

    async fn start_container(
        &self,
        pod: &Pod,
        uid: &PodUid,
        (sandbox_id, sandbox, pod_ips): (&str, &v1::PodSandboxConfig, &[String]),
        c: &Container,
        status: &PodStatus,
    ) -> Result<(), StartError> {
        let previous = latest(status, &c.name);
        let attempt = previous.map(|p| p.attempt + 1).unwrap_or(0);
        // The restart decision counts for the back-off, as the kubelet's `Next`
        // in `doBackOff`, before the start (which may fail).
        if let Some(p) = previous.filter(|p| p.state == ContainerState::Exited) {
            lock(&self.backoff).restarting(
                backoff_key(uid, c),
                p.finished_at.unwrap_or(0),
                unix_now_ns(),
            );
        }
        self.ensure_image(pod, uid, c).await?;
        self.verify_run_as_non_root(pod, uid, c).await?;
        let env_ctx = crate::env::EnvContext {
            pod,
            container: c,
            pod_ips,
            host_ip: &self.node.host_ip,
        };
        let config_error =
            |e: crate::env::EnvError| StartError::new(CREATE_CONTAINER_CONFIG_ERROR, e.to_string());
        let objects = crate::env::fetch(self.kube.as_ref(), &env_ctx)
            .await
            .map_err(config_error)?;
        let env = crate::env::make_environment(&env_ctx, &objects).map_err(config_error)?;
        let mut config = container_config(pod, uid, c, attempt, &env)
            .map_err(|e| StartError::new(CREATE_CONTAINER_CONFIG_ERROR, e.0))?;
        let volumes = (self.volumes.as_ref())
            .map(|v| v.pod_volumes(uid))
            .unwrap_or_default();
        let pod_dir = crate::network::hosts::pod_dir(&self.node.root_dir, uid.as_str());
        config.mounts = container_mounts(c, &volumes, &pod_dir)
            .map_err(|e| StartError::new(CREATE_CONTAINER_CONFIG_ERROR, e.0))?;
        // The managed /etc/hosts, unless the container mounts a volume there
        // (the kubelet's `shouldMountHostsFile`).
        if !config.mounts.iter().any(|m| m.container_path == ETC_HOSTS) {
            config.mounts.extend(self.hosts_mount(pod, uid, pod_ips)?);
        }
        // The termination-log file (the kubelet's `makeMounts`).
        config.mounts.extend(super::termination_message::prepare(
            &self.node.root_dir,
            uid,
            c,
            attempt,
        ));
        let id = self
            .cri
            .create_container(sandbox_id, &config, sandbox)
            .await
            .map_err(|e| StartError::new(CREATE_CONTAINER_ERROR, e.to_string()))?;
        kubelet_events::created(&self.events, pod, &c.name);
        self.cri
            .start_container(&id)
            .await
            .map_err(|e| StartError::new(RUN_CONTAINER_ERROR, e.to_string()))?;
        kubelet_events::started(&self.events, pod, &c.name);
        info!(pod = %uid, container = %c.name, attempt, id = %id, "container started");
        if let Some(post_start) = c.lifecycle.as_ref().and_then(|l| l.post_start.as_ref()) {
            let hook = self
                .run_hook(
                    "PostStart",
                    (pod, uid),
                    c,
                    &id,
                    post_start,
                    super::hooks::POST_START_BOUND,
                )
                .await;
            if let Err(e) = hook {
                // The kubelet's `startContainer`: the event, then
                // `killContainer` with the message `FailedPostStartHook` (its
                // Killing event says only that; its preStop hook runs); the
                // start failed.
                warn!(pod = %uid, container = %c.name, reason = "FailedPostStartHook", error = %e, "postStart hook failed: killing the container");
                kubelet_events::post_start_hook_failed(&self.events, pod, &c.name);
                let stop = self.stop_with_pre_stop(
                    (pod, uid),
                    &c.name,
                    &id,
                    spec_grace_seconds(pod),
                    None,
                );
                if let Err(stop) = stop.await {
                    warn!(pod = %uid, container = %c.name, error = %stop, "stopping the container after its failed postStart hook");
                }
                return Err(StartError::new(
                    super::hooks::POST_START_HOOK_ERROR,
                    e.to_string(),
                ));
            }
        }
        Ok(())
    }
}
