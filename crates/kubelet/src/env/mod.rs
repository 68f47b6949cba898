//! A container's environment, as the kubelet's `makeEnvironmentVariables`
//! (`kubelet_pods.go`) and `ExpandContainerCommandAndArgs`
//! (`pkg/kubelet/container/helpers.go`):
//!
//! 1. `envFrom` first, in order, each configMap's or secret's keys (with the
//!    source's `prefix`); a missing `optional` source gives nothing;
//! 2. then `env` in order, each a later-wins override: a `value` has its
//!    `$(VAR)` references expanded ([`expansion`]) against the variables set
//!    so far, then the service variables; else `valueFrom`: `fieldRef`
//!    (`metadata.name`, `namespace`, `uid`, `labels`, `annotations` and their
//!    keys, `spec.nodeName`, `spec.serviceAccountName`, `status.hostIP(s)`,
//!    `status.podIP(s)`), `resourceFieldRef` (unset limits are the node's
//!    capacity, as `defaultPodLimitsForDownwardAPI`), `configMapKeyRef`,
//!    `secretKeyRef` (a missing `optional` object or key leaves the
//!    variable out);
//! 3. the service variables ([`services`]) that nothing above set;
//! 4. `command` and `args` expanded against the result.
//!
//! ConfigMaps and Secrets are read from the API server at each container
//! start (the kubelet reads them through its managers: the same objects,
//! here without a cache); Services from a watched copy ([`service_cache`]),
//! as the kubelet's Service informer. Without an API server a reference
//! fails as the kubelet's ("no kubeClient defined") and there are no service
//! variables. An error is the start's
//! `CreateContainerConfigError`, naming the object or key.
//!
//! Differences: the kubelet's variables come in Go's map order; here they are
//! sorted by name (the process sees the same set). An unset
//! `enableServiceLinks` is true, the API server's default (the kubelet
//! refuses a pod without it; static pods are defaulted before).

pub mod expansion;
pub mod service_cache;
pub mod services;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret, Service};

use self::service_cache::ServiceCache;
use crate::source::api::SourceBackoff;
use evpleg_volume::downward_api::{field_value, resource_value};

/// Why a container's environment cannot be made (the kubelet's
/// `CreateContainerConfigError` messages).
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("couldn't get {kind} {namespace}/{name}, no kubeClient defined")]
    NoApi {
        kind: &'static str,
        namespace: String,
        name: String,
    },
    #[error("{kind} {name:?} not found")]
    NotFound { kind: &'static str, name: String },
    #[error("couldn't find key {key} in {kind} {namespace}/{name}")]
    MissingKey {
        key: String,
        kind: &'static str,
        namespace: String,
        name: String,
    },
    #[error("cannot read {kind} {namespace}/{name}: {message}")]
    Api {
        kind: &'static str,
        namespace: String,
        name: String,
        message: String,
    },
    #[error("services have not yet been read at least once, cannot construct envvars")]
    ServicesNotSynced,
    #[error("env {name}: {message}")]
    Field { name: String, message: String },
}

/// The API server client the environment's objects are read with, and the
/// watched Services ([`ServiceCache`]) every start reads.
#[derive(Clone)]
pub struct ApiClient {
    client: kube::Client,
    services: ServiceCache,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient")
            .field("services", &self.services)
            .finish_non_exhaustive()
    }
}

impl ApiClient {
    /// `client`, and a [`ServiceCache`] started with it (in the current
    /// tokio runtime).
    pub fn new(client: kube::Client) -> Self {
        let services = ServiceCache::start(client.clone(), SourceBackoff::default());
        Self { client, services }
    }

    pub fn client(&self) -> &kube::Client {
        &self.client
    }
}

/// What the environment is made from besides the spec.
#[derive(Clone, Copy, Debug)]
pub struct EnvContext<'a> {
    pub pod: &'a Pod,
    pub container: &'a Container,
    /// The pod's IPs, first the primary (`status.podIP`).
    pub pod_ips: &'a [String],
    /// The node's IP (`status.hostIP`).
    pub host_ip: &'a str,
}

/// The API objects a container's environment reads, fetched beforehand
/// ([`fetch`]): `None` for an object the API server does not have.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    /// Whether there is an API server at all.
    pub api: bool,
    pub config_maps: BTreeMap<String, Option<ConfigMap>>,
    pub secrets: BTreeMap<String, Option<Secret>>,
    pub services: Vec<Service>,
}

/// The container's environment and its expanded command and args.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerEnv {
    pub env: BTreeMap<String, String>,
    pub command: Vec<String>,
    pub args: Vec<String>,
}

fn namespace(pod: &Pod) -> &str {
    pod.metadata.namespace.as_deref().unwrap_or("default")
}

/// The ConfigMaps and Secrets `c` references, by name.
fn references(c: &Container) -> (Vec<&str>, Vec<&str>) {
    let mut maps = Vec::new();
    let mut secrets = Vec::new();
    for from in c.env_from.iter().flatten() {
        maps.extend(from.config_map_ref.as_ref().map(|r| r.name.as_str()));
        secrets.extend(from.secret_ref.as_ref().map(|r| r.name.as_str()));
    }
    for e in c.env.iter().flatten() {
        let Some(from) = &e.value_from else { continue };
        maps.extend(from.config_map_key_ref.as_ref().map(|r| r.name.as_str()));
        secrets.extend(from.secret_key_ref.as_ref().map(|r| r.name.as_str()));
    }
    maps.sort_unstable();
    maps.dedup();
    secrets.sort_unstable();
    secrets.dedup();
    (maps, secrets)
}

/// Reads what `ctx`'s container needs from the API server: its ConfigMaps
/// and Secrets, and from the watched Services those of `default` and (with
/// service links) of the pod's namespace. Without a client nothing is read.
pub async fn fetch(api: Option<&ApiClient>, ctx: &EnvContext<'_>) -> Result<Objects, EnvError> {
    let Some(api) = api else {
        return Ok(Objects::default());
    };
    let kube = &api.client;
    let ns = namespace(ctx.pod);
    let (maps, secrets) = references(ctx.container);
    let mut out = Objects {
        api: true,
        ..Objects::default()
    };
    let failed = |kind: &'static str, name: &str, e: kube::Error| EnvError::Api {
        kind,
        namespace: ns.to_owned(),
        name: name.to_owned(),
        message: e.to_string(),
    };
    let config_maps: kube::Api<ConfigMap> = kube::Api::namespaced(kube.clone(), ns);
    for name in maps {
        let cm = config_maps
            .get_opt(name)
            .await
            .map_err(|e| failed("configmap", name, e))?;
        out.config_maps.insert(name.to_owned(), cm);
    }
    let secret_api: kube::Api<Secret> = kube::Api::namespaced(kube.clone(), ns);
    for name in secrets {
        let s = secret_api
            .get_opt(name)
            .await
            .map_err(|e| failed("secret", name, e))?;
        out.secrets.insert(name.to_owned(), s);
    }
    let mut namespaces = vec![services::MASTER_NAMESPACE];
    if service_links(ctx.pod) && ns != services::MASTER_NAMESPACE {
        namespaces.push(ns);
    }
    out.services = api.services.services(&namespaces).await?;
    Ok(out)
}

fn service_links(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.enable_service_links)
        .unwrap_or(true)
}

/// The kubelet's `makeEnvironmentVariables` followed by
/// `ExpandContainerCommandAndArgs`, from objects already read.
pub fn make_environment(ctx: &EnvContext<'_>, objects: &Objects) -> Result<ContainerEnv, EnvError> {
    let pod = ctx.pod;
    let c = ctx.container;
    let ns = namespace(pod);
    let service_env = services::service_env(&objects.services, ns, service_links(pod));
    let object = |kind, name, optional| Lookup {
        api: objects.api,
        kind,
        namespace: ns,
        name,
        optional,
    };
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for from in c.env_from.iter().flatten() {
        let prefix = from.prefix.as_deref().unwrap_or_default();
        if let Some(r) = &from.config_map_ref {
            let cm = object("configMap", &r.name, r.optional == Some(true))
                .find(&objects.config_maps)?;
            for (k, v) in cm.iter().flat_map(|cm| cm.data.iter().flatten()) {
                env.insert(format!("{prefix}{k}"), v.clone());
            }
        }
        if let Some(r) = &from.secret_ref {
            let s = object("secret", &r.name, r.optional == Some(true)).find(&objects.secrets)?;
            for (k, v) in s.iter().flat_map(|s| s.data.iter().flatten()) {
                env.insert(
                    format!("{prefix}{k}"),
                    String::from_utf8_lossy(&v.0).into_owned(),
                );
            }
        }
    }
    for e in c.env.iter().flatten() {
        let value = e.value.as_deref().unwrap_or_default();
        let value = if !value.is_empty() {
            let contexts = [&env, &service_env];
            expansion::expand(value, &expansion::mapping_for(&contexts))
        } else if let Some(from) = &e.value_from {
            let field_error = |message: String| EnvError::Field {
                name: e.name.clone(),
                message,
            };
            if let Some(f) = &from.field_ref {
                field_ref(ctx, &f.field_path).map_err(field_error)?
            } else if let Some(r) = &from.resource_field_ref {
                resource_field_ref(pod, c, r).map_err(field_error)?
            } else if let Some(r) = &from.config_map_key_ref {
                let optional = r.optional == Some(true);
                let found = object("configMap", &r.name, optional).find(&objects.config_maps)?;
                let Some(cm) = found else { continue };
                match cm.data.as_ref().and_then(|d| d.get(&r.key)) {
                    Some(v) => v.clone(),
                    None if optional => continue,
                    None => return Err(missing_key(&r.key, "ConfigMap", ns, &r.name)),
                }
            } else if let Some(r) = &from.secret_key_ref {
                let optional = r.optional == Some(true);
                let found = object("secret", &r.name, optional).find(&objects.secrets)?;
                let Some(s) = found else { continue };
                match s.data.as_ref().and_then(|d| d.get(&r.key)) {
                    Some(v) => String::from_utf8_lossy(&v.0).into_owned(),
                    None if optional => continue,
                    None => return Err(missing_key(&r.key, "Secret", ns, &r.name)),
                }
            } else {
                String::new()
            }
        } else {
            String::new()
        };
        env.insert(e.name.clone(), value);
    }
    for (k, v) in service_env {
        env.entry(k).or_insert(v);
    }
    let (command, args) = expand_command_and_args(c, &env);
    Ok(ContainerEnv { env, command, args })
}

/// A referenced ConfigMap or Secret.
struct Lookup<'a> {
    api: bool,
    kind: &'static str,
    namespace: &'a str,
    name: &'a str,
    optional: bool,
}

impl Lookup<'_> {
    /// The object: `None` when it is missing and optional; an error when it
    /// is missing otherwise, or when there is no API server (optional or not,
    /// as the kubelet's).
    fn find<'o, T>(
        &self,
        objects: &'o BTreeMap<String, Option<T>>,
    ) -> Result<Option<&'o T>, EnvError> {
        if !self.api {
            return Err(EnvError::NoApi {
                kind: self.kind,
                namespace: self.namespace.to_owned(),
                name: self.name.to_owned(),
            });
        }
        match objects.get(self.name).and_then(Option::as_ref) {
            Some(o) => Ok(Some(o)),
            None if self.optional => Ok(None),
            // The kubelet's configMap and secret managers' NotFound, whose
            // resource is singular (`corev1.Resource("configmap")`), not
            // the API server's `configmaps`.
            None => Err(EnvError::NotFound {
                kind: if self.kind == "configMap" {
                    "configmap"
                } else {
                    "secret"
                },
                name: self.name.to_owned(),
            }),
        }
    }
}

fn missing_key(key: &str, kind: &'static str, ns: &str, name: &str) -> EnvError {
    EnvError::MissingKey {
        key: key.to_owned(),
        kind,
        namespace: ns.to_owned(),
        name: name.to_owned(),
    }
}

/// The kubelet's `ExpandContainerCommandAndArgs`: `$(VAR)` in `command` and
/// `args` against the container's final environment.
pub fn expand_command_and_args(
    c: &Container,
    env: &BTreeMap<String, String>,
) -> (Vec<String>, Vec<String>) {
    let contexts = [env];
    let mapping = expansion::mapping_for(&contexts);
    let expand = |v: &Option<Vec<String>>| {
        v.iter()
            .flatten()
            .map(|s| expansion::expand(s, &mapping))
            .collect()
    };
    (expand(&c.command), expand(&c.args))
}

/// The kubelet's `podFieldSelectorRuntimeValue`.
fn field_ref(ctx: &EnvContext<'_>, path: &str) -> Result<String, String> {
    let spec = ctx.pod.spec.as_ref();
    Ok(match path {
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_default(),
        "status.hostIP" | "status.hostIPs" => ctx.host_ip.to_owned(),
        "status.podIP" => ctx.pod_ips.first().cloned().unwrap_or_default(),
        "status.podIPs" => ctx.pod_ips.join(","),
        _ => field_value(ctx.pod, path).map_err(|e| e.to_string())?,
    })
}

/// The kubelet's `containerResourceRuntimeValue`: no `containerName` is the
/// container itself (an init container too).
fn resource_field_ref(
    pod: &Pod,
    c: &Container,
    r: &k8s_openapi::api::core::v1::ResourceFieldSelector,
) -> Result<String, String> {
    let named = r.container_name.as_deref().is_some_and(|n| !n.is_empty());
    if named {
        return resource_value(pod, r).map_err(|e| e.to_string());
    }
    let own = Pod {
        spec: Some(k8s_openapi::api::core::v1::PodSpec {
            containers: vec![c.clone()],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut r = r.clone();
    r.container_name = Some(c.name.clone());
    resource_value(&own, &r).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests;
