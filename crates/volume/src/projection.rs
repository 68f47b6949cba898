//! The configMap, secret, downwardAPI and projected plugins
//! (`pkg/volume/{configmap,secret,downwardapi,projected}`): each builds a
//! payload of files (the kubelet's `MakePayload` / `CollectData`) and writes
//! it with the AtomicWriter ([`super::atomic_writer`]), so a remount (each pod
//! sync) propagates a changed object into the mounted files atomically.
//! Objects are read from the API server at each set-up (the kubelet's `Get`
//! strategy); without `--kubeconfig` a configMap, secret or token volume
//! fails, naming the object. `optional` objects and keys that are missing
//! give no file; `items` select keys into paths with their `mode`, else
//! `defaultMode` (0644). downwardAPI files: `metadata.name`, `namespace`,
//! `uid`, `labels`, `annotations` (`key="value"` lines, sorted, as
//! `FormatMap`), `metadata.labels['k']`, and containers' `limits.*` /
//! `requests.*` of cpu and memory with a divisor (a limit unset is the
//! node's allocatable). Projected: configMap, secret, downwardAPI and
//! serviceAccountToken sources ([`super::token`]); `clusterTrustBundle` and
//! `podCertificate` are refused. Secret and projected volumes are written on
//! a tmpfs of their own (sized as a Memory emptyDir), unmounted at
//! tear-down, so no secret or token reaches the node's disk; with
//! `<root-dir>/pods` mode 0750 ([`super::pod_dirs`]) no unprivileged host
//! user reads them. Difference: the kubelet puts downwardAPI volumes on a
//! tmpfs too; here they are on disk (they hold no secret).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{ConfigMap, KeyToPath, Secret, VolumeProjection};

use super::atomic_writer::{self, FileProjection};
use super::downward_api::downward_files;
use super::plugin::{
    Attributes, PluginError, PodContext, SetUpArgs, Spec, TearDownArgs, VolumePlugin,
};
use super::token::TokenManager;

/// `defaultMode` when unset (the API server's default).
pub const DEFAULT_MODE: i32 = 0o644;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    ConfigMap,
    Secret,
    DownwardApi,
    Projected,
}

pub struct ProjectionPlugin {
    kind: Kind,
    kube: Option<kube::Client>,
    tokens: Option<Arc<TokenManager>>,
}

impl std::fmt::Debug for ProjectionPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProjectionPlugin")
            .field("kind", &self.kind)
            .field("api", &self.kube.is_some())
            .finish_non_exhaustive()
    }
}

impl ProjectionPlugin {
    pub fn config_map(kube: Option<kube::Client>) -> Self {
        Self {
            kind: Kind::ConfigMap,
            kube,
            tokens: None,
        }
    }
    pub fn secret(kube: Option<kube::Client>) -> Self {
        Self {
            kind: Kind::Secret,
            kube,
            tokens: None,
        }
    }
    pub fn downward_api() -> Self {
        Self {
            kind: Kind::DownwardApi,
            kube: None,
            tokens: None,
        }
    }
    pub fn projected(kube: Option<kube::Client>, tokens: Arc<TokenManager>) -> Self {
        Self {
            kind: Kind::Projected,
            kube,
            tokens: Some(tokens),
        }
    }

    /// Secret and projected volumes (service-account tokens among them)
    /// live on a tmpfs of their own, never on the node's disk (the kubelet
    /// wraps them in a Memory emptyDir).
    fn in_memory(&self) -> bool {
        matches!(self.kind, Kind::Secret | Kind::Projected)
    }

    async fn config_map_files(
        &self,
        pod: &PodContext,
        name: &str,
        items: Option<&[KeyToPath]>,
        optional: bool,
        default_mode: i32,
        out: &mut Payload,
    ) -> Result<(), PluginError> {
        let cm: Option<ConfigMap> = self.get(pod, "configmap", name, optional).await?;
        let mut data: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        if let Some(cm) = cm {
            for (k, v) in cm.data.unwrap_or_default() {
                data.insert(k, v.into_bytes());
            }
            for (k, v) in cm.binary_data.unwrap_or_default() {
                data.insert(k, v.0);
            }
        }
        select(&data, items, optional, default_mode, "config", out)
    }

    async fn secret_files(
        &self,
        pod: &PodContext,
        name: &str,
        items: Option<&[KeyToPath]>,
        optional: bool,
        default_mode: i32,
        out: &mut Payload,
    ) -> Result<(), PluginError> {
        let s: Option<Secret> = self.get(pod, "secret", name, optional).await?;
        let data: BTreeMap<String, Vec<u8>> = s
            .and_then(|s| s.data)
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect();
        select(&data, items, optional, default_mode, "secret", out)
    }

    /// The object, `None` when it is missing and optional.
    async fn get<K>(
        &self,
        pod: &PodContext,
        kind: &str,
        name: &str,
        optional: bool,
    ) -> Result<Option<K>, PluginError>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
        K::DynamicType: Default,
    {
        let Some(kube) = &self.kube else {
            return Err(PluginError::Object(format!(
                "{kind} {:?} of pod {}/{}: no API server to read it from (the agent runs without --kubeconfig)",
                name,
                pod.namespace(),
                pod.name()
            )));
        };
        let api: kube::Api<K> = kube::Api::namespaced(kube.clone(), pod.namespace());
        match api.get_opt(name).await {
            Ok(Some(o)) => Ok(Some(o)),
            Ok(None) if optional => Ok(None),
            // The kubelet's managers' NotFound: `configmap "x" not found`.
            Ok(None) => Err(PluginError::Object(format!("{kind} {name:?} not found"))),
            Err(e) => Err(PluginError::Object(format!(
                "cannot read {kind} {}/{name}: {e}",
                pod.namespace()
            ))),
        }
    }

    async fn payload(&self, spec: &Spec, pod: &PodContext) -> Result<Payload, PluginError> {
        let v = spec
            .inline()
            .ok_or_else(|| PluginError::Failed(format!("volume {:?} is not inline", spec.name)))?;
        let mut out = Payload::new();
        match self.kind {
            Kind::ConfigMap => {
                let s = v.config_map.clone().unwrap_or_default();
                let mode = s.default_mode.unwrap_or(DEFAULT_MODE);
                let optional = s.optional.unwrap_or(false);
                self.config_map_files(pod, &s.name, s.items.as_deref(), optional, mode, &mut out)
                    .await?;
            }
            Kind::Secret => {
                let s = v.secret.clone().unwrap_or_default();
                let mode = s.default_mode.unwrap_or(DEFAULT_MODE);
                let name = s.secret_name.clone().unwrap_or_default();
                let optional = s.optional.unwrap_or(false);
                self.secret_files(pod, &name, s.items.as_deref(), optional, mode, &mut out)
                    .await?;
            }
            Kind::DownwardApi => {
                let s = v.downward_api.clone().unwrap_or_default();
                let mode = s.default_mode.unwrap_or(DEFAULT_MODE);
                downward_files(
                    &pod.pod,
                    s.items.as_deref().unwrap_or_default(),
                    mode,
                    &mut out,
                )?;
            }
            Kind::Projected => {
                let s = v.projected.clone().unwrap_or_default();
                let mode = s.default_mode.unwrap_or(DEFAULT_MODE);
                for source in s.sources.iter().flatten() {
                    self.projection(pod, source, mode, &mut out).await?;
                }
            }
        }
        Ok(out)
    }

    async fn projection(
        &self,
        pod: &PodContext,
        source: &VolumeProjection,
        mode: i32,
        out: &mut Payload,
    ) -> Result<(), PluginError> {
        if let Some(c) = &source.config_map {
            let optional = c.optional.unwrap_or(false);
            self.config_map_files(pod, &c.name, c.items.as_deref(), optional, mode, out)
                .await?;
        }
        if let Some(s) = &source.secret {
            let optional = s.optional.unwrap_or(false);
            self.secret_files(pod, &s.name, s.items.as_deref(), optional, mode, out)
                .await?;
        }
        if let Some(d) = &source.downward_api {
            downward_files(&pod.pod, d.items.as_deref().unwrap_or_default(), mode, out)?;
        }
        if let Some(t) = &source.service_account_token {
            let tokens = self.tokens.as_ref().ok_or_else(|| {
                PluginError::Failed("no token manager for serviceAccountToken".into())
            })?;
            let audience = t.audience.clone().unwrap_or_default();
            let token = tokens.token(pod, &audience, t.expiration_seconds).await?;
            out.insert(t.path.clone(), file(token.into_bytes(), mode));
        }
        if source.cluster_trust_bundle.is_some() {
            return Err(PluginError::Failed(
                "projected clusterTrustBundle sources are not supported".into(),
            ));
        }
        if source.pod_certificate.is_some() {
            return Err(PluginError::Failed(
                "projected podCertificate sources are not supported".into(),
            ));
        }
        Ok(())
    }
}

pub(crate) type Payload = BTreeMap<String, FileProjection>;

pub(crate) fn file(data: Vec<u8>, mode: i32) -> FileProjection {
    FileProjection {
        data,
        mode: (mode & 0o7777) as u32,
    }
}

/// The kubelet's `MakePayload` of a configMap or secret (`what`: `config`
/// or `secret`, in its message for a missing key).
fn select(
    data: &BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
    optional: bool,
    default_mode: i32,
    what: &str,
    out: &mut Payload,
) -> Result<(), PluginError> {
    match items.filter(|i| !i.is_empty()) {
        None => {
            for (k, v) in data {
                out.insert(k.clone(), file(v.clone(), default_mode));
            }
        }
        Some(items) => {
            for item in items {
                match data.get(&item.key) {
                    Some(v) => {
                        let mode = item.mode.unwrap_or(default_mode);
                        out.insert(item.path.clone(), file(v.clone(), mode));
                    }
                    None if optional => {}
                    None => {
                        let kind = if what == "config" {
                            "configmap"
                        } else {
                            "secret"
                        };
                        return Err(PluginError::Object(format!(
                            "{kind} references non-existent {what} key: {}",
                            item.key
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

#[async_trait]
impl VolumePlugin for ProjectionPlugin {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::ConfigMap => "kubernetes.io/configmap",
            Kind::Secret => "kubernetes.io/secret",
            Kind::DownwardApi => "kubernetes.io/downward-api",
            Kind::Projected => "kubernetes.io/projected",
        }
    }

    fn can_support(&self, spec: &Spec) -> bool {
        spec.inline().is_some_and(|v| match self.kind {
            Kind::ConfigMap => v.config_map.is_some(),
            Kind::Secret => v.secret.is_some(),
            Kind::DownwardApi => v.downward_api.is_some(),
            Kind::Projected => v.projected.is_some(),
        })
    }

    fn requires_remount(&self, _: &Spec) -> bool {
        true
    }

    fn attributes(&self, _: &Spec) -> Attributes {
        Attributes {
            read_only: true,
            managed: true,
        }
    }

    async fn set_up(&self, args: SetUpArgs<'_>) -> Result<(), PluginError> {
        let payload = self.payload(args.spec, args.pod).await?;
        if self.in_memory() {
            in_memory_dir(args.dir, &args.pod.pod)?;
        }
        atomic_writer::write(args.dir, &payload)
            .map(drop)
            .map_err(|e| PluginError::Failed(e.to_string()))
    }

    async fn tear_down(&self, args: TearDownArgs<'_>) -> Result<(), PluginError> {
        if let Some(t) = &self.tokens {
            t.forget_pod(args.pod_uid);
        }
        super::empty_dir::tear_down_dir(args.dir)
    }
}

/// Mounts the volume's tmpfs on `dir` unless it is mounted, sized as a
/// Memory emptyDir without `sizeLimit` (the pod's memory limits when each
/// container has one, else tmpfs's default), mode 0777 as the kubelet's.
fn in_memory_dir(
    dir: &std::path::Path,
    pod: &k8s_openapi::api::core::v1::Pod,
) -> Result<(), PluginError> {
    std::fs::create_dir_all(dir).map_err(PluginError::io("create", dir))?;
    if !super::util::is_mount_point(dir)? {
        super::util::mount_tmpfs(dir, super::empty_dir::memory_size(None, pod)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // A static pod (no API server): each API-backed source fails naming the
    // object and the pod.
    #[tokio::test]
    async fn without_an_api_server_each_source_names_its_object() {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "0a"},
            "spec": {"serviceAccountName": "runner", "containers": [{"name": "c"}]}
        }))
        .unwrap();
        let ctx = PodContext {
            uid: evpleg_core::ids::PodUid::parse("0a").unwrap(),
            pod: Arc::new(pod),
        };
        let root = tempfile::tempdir().unwrap();
        let tokens = Arc::new(TokenManager::new(None));
        let cases = [
            (
                ProjectionPlugin::config_map(None),
                serde_json::json!({"name": "v", "configMap": {"name": "cfg"}}),
                "configmap \"cfg\" of pod ns/web: no API server to read it from (the agent runs without --kubeconfig)",
            ),
            (
                ProjectionPlugin::secret(None),
                serde_json::json!({"name": "v", "secret": {"secretName": "sec"}}),
                "secret \"sec\" of pod ns/web: no API server to read it from (the agent runs without --kubeconfig)",
            ),
            (
                ProjectionPlugin::projected(None, tokens),
                serde_json::json!({"name": "v", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}),
                "serviceaccounts \"runner\" token for pod ns/web: no API server to request it from (the agent runs without --kubeconfig)",
            ),
        ];
        for (plugin, volume, want) in cases {
            let spec = Spec {
                name: "v".into(),
                source: super::super::plugin::VolumeSource::Inline(Box::new(
                    serde_json::from_value(volume).unwrap(),
                )),
                read_only: false,
            };
            assert!(plugin.can_support(&spec));
            let dir = root.path().join(plugin.name().replace('/', "~"));
            let args = SetUpArgs {
                spec: &spec,
                pod: &ctx,
                dir: &dir,
                device_mount_path: None,
            };
            let err = plugin.set_up(args).await.unwrap_err();
            assert_eq!(err.to_string(), want);
        }
        // A downwardAPI volume needs no API server.
        let spec = Spec {
            name: "v".into(),
            source: super::super::plugin::VolumeSource::Inline(Box::new(
                serde_json::from_value(serde_json::json!({"name": "v", "downwardAPI": {"items": [
                    {"path": "n", "fieldRef": {"fieldPath": "metadata.name"}}]}}))
                .unwrap(),
            )),
            read_only: false,
        };
        let dir = root.path().join("dapi");
        let args = SetUpArgs {
            spec: &spec,
            pod: &ctx,
            dir: &dir,
            device_mount_path: None,
        };
        ProjectionPlugin::downward_api().set_up(args).await.unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("n")).unwrap(), "web");
    }

    #[test]
    fn keys_select_files_with_their_modes() {
        let data: BTreeMap<String, Vec<u8>> = [
            ("a".to_owned(), b"1".to_vec()),
            ("b".to_owned(), b"2".to_vec()),
        ]
        .into();
        let mut all = Payload::new();
        select(&data, None, false, 0o644, "config", &mut all).unwrap();
        assert_eq!(all.keys().collect::<Vec<_>>(), ["a", "b"]);
        let items: Vec<KeyToPath> = serde_json::from_value(serde_json::json!([
            {"key": "b", "path": "dir/bee", "mode": 0o400}
        ]))
        .unwrap();
        let mut some = Payload::new();
        select(&data, Some(&items), false, 0o644, "config", &mut some).unwrap();
        assert_eq!(some["dir/bee"], file(b"2".to_vec(), 0o400));
        assert_eq!(some.len(), 1);
        let missing: Vec<KeyToPath> =
            serde_json::from_value(serde_json::json!([{"key": "zz", "path": "z"}])).unwrap();
        let err = select(
            &data,
            Some(&missing),
            false,
            0o644,
            "config",
            &mut Payload::new(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "configmap references non-existent config key: zz"
        );
        select(
            &data,
            Some(&missing),
            true,
            0o644,
            "secret",
            &mut Payload::new(),
        )
        .unwrap();
    }

    // Issue #24: a projected volume (the service-account token's) is on a
    // tmpfs of its own under a 0750 pods directory: its files have the modes
    // asked, exactly, and an unprivileged host user (uid 65534) reads none.
    #[tokio::test]
    async fn projected_files_are_on_a_tmpfs_no_other_user_reads() {
        if !crate::tests::can_mount("projected_files_are_on_a_tmpfs_no_other_user_reads") {
            return;
        }
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "0a"},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"memory": "16Mi"}}}]}
        }))
        .unwrap();
        let ctx = PodContext {
            uid: evpleg_core::ids::PodUid::parse("0a").unwrap(),
            pod: Arc::new(pod),
        };
        let root = tempfile::tempdir().unwrap();
        // Others may traverse the test's own directory: only pods/ guards.
        std::fs::set_permissions(
            root.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        super::super::pod_dirs::ensure_pods_dir(root.path()).unwrap();
        let dir = root
            .path()
            .join("pods/0a/volumes/kubernetes.io~projected/v");
        let spec = Spec {
            name: "v".into(),
            source: super::super::plugin::VolumeSource::Inline(Box::new(
                serde_json::from_value(serde_json::json!({"name": "v", "projected": {
                "defaultMode": 0o440,
                "sources": [{"downwardAPI": {"items": [
                    {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
                    {"path": "ns", "fieldRef": {"fieldPath": "metadata.namespace"}, "mode": 0o400}
                ]}}]}}))
                .unwrap(),
            )),
            read_only: false,
        };
        let plugin = ProjectionPlugin::projected(None, Arc::new(TokenManager::new(None)));
        let args = SetUpArgs {
            spec: &spec,
            pod: &ctx,
            dir: &dir,
            device_mount_path: None,
        };
        plugin.set_up(args).await.unwrap();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = mounts
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(dir.to_str().unwrap()))
            .unwrap_or_else(|| panic!("{} is not a mount point: {mounts}", dir.display()));
        assert!(
            line.contains(" - tmpfs ") && line.contains("size=16384k"),
            "{line}"
        );
        let mode = |p: &str| {
            std::os::unix::fs::PermissionsExt::mode(
                &std::fs::metadata(dir.join(p)).unwrap().permissions(),
            ) & 0o7777
        };
        assert_eq!((mode("name"), mode("ns")), (0o440, 0o400));
        assert_eq!(std::fs::read_to_string(dir.join("name")).unwrap(), "web");
        for file in ["name", "ns"] {
            use std::os::unix::process::CommandExt;
            let out = std::process::Command::new("cat")
                .arg(dir.join(file))
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap();
            assert!(!out.status.success(), "uid 65534 read {file}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains("Permission denied"), "{err}");
        }
        let args = TearDownArgs {
            spec: &spec,
            pod_uid: &ctx.uid,
            dir: &dir,
        };
        plugin.tear_down(args).await.unwrap();
        assert!(!dir.exists());
        assert!(!crate::util::is_mounted(&dir).unwrap());
    }
}
