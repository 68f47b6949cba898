//! Volume plugins: the kubelet's `pkg/volume` interfaces (`VolumePlugin`,
//! `Mounter`/`Unmounter`, `DeviceMounter`/`DeviceUnmounter`, `Attributes`)
//! folded into one async trait, [`VolumePlugin`], and the registry the
//! manager finds a volume's plugin in ([`VolumePluginMgr`], the kubelet's
//! `VolumePluginMgr`).
//!
//! A plugin is called by the reconciler ([`super::reconciler`]) only:
//! - [`VolumePlugin::mount_device`] once per volume, before the first pod's
//!   set-up, for a plugin that says [`VolumePlugin::device_mountable`] (the
//!   kubelet's `MountDevice`, CSI's NodeStageVolume), into a node-global
//!   directory the manager gives; [`VolumePlugin::unmount_device`] after the
//!   last pod's tear-down (`UnmountDevice`, NodeUnstageVolume). Such a volume
//!   is keyed by its [`VolumePlugin::unique_name`] (one per node, whatever the
//!   pods), the others by pod and volume name.
//! - [`VolumePlugin::set_up`] per pod into `<root-dir>/pods/<uid>/volumes/
//!   <plugin name, / as ~>/<volume name>` (`SetUp`, NodePublishVolume); again
//!   when the pod is synced if it [`VolumePlugin::requires_remount`] (the
//!   kubelet's `RequiresRemount`: configMap, secret, downwardAPI, projected);
//!   it must be idempotent. [`VolumePlugin::tear_down`] once the pod's
//!   containers are all stopped (`TearDown`, NodeUnpublishVolume).
//!
//! Differences: the kubelet's unmounter is built from the volume's name and
//! the pod's UID alone (it can reconstruct volumes after a restart); here
//! tear-down gets the [`Spec`] the set-up had, kept in the actual state of the
//! world, and a restarted agent does not reconstruct (docs/volumes.md). There
//! is no attach/detach (no `Attacher`): a CSI driver's ControllerPublish is
//! the attach-detach controller's, not a node's.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod, Volume};

use evpleg_core::ids::PodUid;

/// Why a plugin operation failed. The reconciler retries every failure with
/// back-off; [`PluginError::Uncertain`] also tells it the operation may have
/// done something, so a tear-down (or unmount of the device) is due even
/// though the set-up never succeeded (the kubelet's `UncertainProgressError`).
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A final failure, as the plugin words it (kubelet's messages, e.g.
    /// `hostPath type check failed: /x is not a directory`).
    #[error("{0}")]
    Failed(String),
    /// The operation's outcome is not known (a deadline passed mid-call): it
    /// may have mounted something.
    #[error("{0}")]
    Uncertain(String),
    /// An API object the volume needs cannot be read (`configmap "x" not
    /// found`, no API server configured, a TokenRequest refused).
    #[error("{0}")]
    Object(String),
    /// No registered plugin supports the volume, or more than one does.
    #[error("{0}")]
    NoPlugin(String),
}

impl PluginError {
    pub fn io<'a>(
        action: &'static str,
        path: &'a Path,
    ) -> impl FnOnce(std::io::Error) -> Self + 'a {
        move |source| Self::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }

    /// Whether the failed operation may have left something mounted.
    pub fn is_uncertain(&self) -> bool {
        matches!(self, Self::Uncertain(_))
    }
}

/// Where a volume comes from: one of the pod's `spec.volumes`, or a
/// `persistentVolumeClaim` (or `ephemeral` volume's claim) resolved to its
/// bound PersistentVolume by the populator ([`super::populator`]), as the
/// kubelet's `volume.Spec` holds either `Volume` or `PersistentVolume`.
#[derive(Clone, Debug)]
pub enum VolumeSource {
    /// An inline volume (emptyDir, hostPath, configMap, secret, downwardAPI,
    /// projected, an inline ephemeral `csi`, ...): the pod's own entry.
    Inline(Box<Volume>),
    /// A claim and the volume bound to it (the claim is Bound, the volume's
    /// `claimRef` names the claim's UID).
    Persistent {
        claim: Box<PersistentVolumeClaim>,
        volume: Box<PersistentVolume>,
    },
}

/// A volume to mount, as the kubelet's `volume.Spec`.
#[derive(Clone, Debug)]
pub struct Spec {
    /// The pod's name for it (`spec.volumes[].name`; the kubelet's
    /// `outerVolumeSpecName`): the directory name under the pod's volumes.
    pub name: String,
    pub source: VolumeSource,
    /// Read-only as the pod asks for the whole volume (a claim's
    /// `persistentVolumeClaim.readOnly`; the kubelet's `Spec.ReadOnly`).
    pub read_only: bool,
}

impl Spec {
    /// The inline volume, if it is one.
    pub fn inline(&self) -> Option<&Volume> {
        match &self.source {
            VolumeSource::Inline(v) => Some(v.as_ref()),
            VolumeSource::Persistent { .. } => None,
        }
    }

    /// The PersistentVolume, if it is a resolved claim.
    pub fn persistent_volume(&self) -> Option<&PersistentVolume> {
        match &self.source {
            VolumeSource::Persistent { volume, .. } => Some(volume),
            VolumeSource::Inline(_) => None,
        }
    }
}

/// The pod a volume is set up for (the kubelet's `VolumeOptions.Pod`).
#[derive(Clone, Debug)]
pub struct PodContext {
    pub uid: PodUid,
    pub pod: Arc<Pod>,
}

impl PodContext {
    pub fn name(&self) -> &str {
        self.pod.metadata.name.as_deref().unwrap_or_default()
    }

    pub fn namespace(&self) -> &str {
        self.pod.metadata.namespace.as_deref().unwrap_or("default")
    }

    /// `spec.serviceAccountName`, `default` when unset (as the API server
    /// defaults it).
    pub fn service_account(&self) -> &str {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.as_deref())
            .filter(|s| !s.is_empty())
            .unwrap_or("default")
    }

    /// `securityContext.fsGroup`.
    pub fn fs_group(&self) -> Option<i64> {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.security_context.as_ref())
            .and_then(|s| s.fs_group)
    }
}

/// The key of a volume in the desired and actual states of the world (the
/// kubelet's `UniqueVolumeName`): `<plugin>/<pod uid>-<volume name>` for a
/// per-pod volume, `<plugin>/<node-global key>` for one that is
/// device-mountable (shared by the pods that use it).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UniqueVolumeName(pub String);

impl UniqueVolumeName {
    /// `GetUniqueVolumeNameFromSpecWithPod`: one per pod and volume.
    pub fn per_pod(plugin: &str, pod: &PodUid, volume: &str) -> Self {
        Self(format!("{plugin}/{pod}-{volume}"))
    }

    /// `GetUniqueVolumeName`: one per node for this plugin and key (a CSI
    /// driver's name and volume handle).
    pub fn global(plugin: &str, key: &str) -> Self {
        Self(format!("{plugin}/{key}"))
    }
}

impl fmt::Display for UniqueVolumeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the manager needs to know of a set-up volume (the kubelet's
/// `volume.Attributes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Attributes {
    /// Containers get it read-only whatever their `volumeMounts` say
    /// (configMap, secret, downwardAPI, projected).
    pub read_only: bool,
    /// The manager may change its ownership for the pod's `fsGroup` (the
    /// kubelet's `Managed`).
    pub managed: bool,
}

/// What [`VolumePlugin::set_up`] is given.
#[derive(Clone, Copy, Debug)]
pub struct SetUpArgs<'a> {
    pub spec: &'a Spec,
    pub pod: &'a PodContext,
    /// `<root-dir>/pods/<uid>/volumes/<plugin, / as ~>/<volume name>`; the
    /// plugin creates it (its parent exists).
    pub dir: &'a Path,
    /// The node-global directory [`VolumePlugin::mount_device`] filled, for a
    /// device-mountable volume.
    pub device_mount_path: Option<&'a Path>,
}

/// What [`VolumePlugin::tear_down`] is given.
#[derive(Clone, Copy, Debug)]
pub struct TearDownArgs<'a> {
    pub spec: &'a Spec,
    pub pod_uid: &'a PodUid,
    /// The directory [`VolumePlugin::set_up`] was given.
    pub dir: &'a Path,
}

/// A volume plugin (the kubelet's `VolumePlugin` with its mounters). One
/// instance serves every volume it supports; its methods may run
/// concurrently for different volumes, never two for the same volume and pod.
#[async_trait]
pub trait VolumePlugin: fmt::Debug + Send + Sync + 'static {
    /// The plugin's name, `kubernetes.io/empty-dir` style.
    fn name(&self) -> &'static str;

    /// Whether this plugin handles `spec` (`CanSupport`).
    fn can_support(&self, spec: &Spec) -> bool;

    /// The volume's key. The default is per pod; a device-mountable plugin
    /// returns [`UniqueVolumeName::global`].
    fn unique_name(&self, spec: &Spec, pod: &PodUid) -> Result<UniqueVolumeName, PluginError> {
        Ok(UniqueVolumeName::per_pod(self.name(), pod, &spec.name))
    }

    /// Whether the volume needs the node-global [`Self::mount_device`] step
    /// (`DeviceMountableVolumePlugin`; CSI with STAGE_UNSTAGE_VOLUME).
    fn device_mountable(&self, _spec: &Spec) -> bool {
        false
    }

    /// Whether a pod sync sets the volume up again (`RequiresRemount`).
    fn requires_remount(&self, _spec: &Spec) -> bool {
        false
    }

    fn attributes(&self, spec: &Spec) -> Attributes;

    /// The host path containers bind-mount (`Mounter.GetPath`): `dir` by
    /// default (hostPath: its path; CSI: `dir/mount`).
    fn host_path(&self, _spec: &Spec, dir: &Path) -> PathBuf {
        dir.to_path_buf()
    }

    /// Where the node-global step mounts the volume (`GetDeviceMountPath`):
    /// `None` for the manager's default, `<root-dir>/plugins/<plugin, / as
    /// ~>/globalmount/<sha256 of the unique name>` (CSI has its own,
    /// `<root-dir>/plugins/kubernetes.io/csi/<driver>/<sha256 of the
    /// handle>/globalmount`).
    fn device_mount_path(
        &self,
        _spec: &Spec,
        _root_dir: &Path,
    ) -> Result<Option<PathBuf>, PluginError> {
        Ok(None)
    }

    /// The node-global step (`MountDevice`), into `device_mount_path`
    /// ([`Self::device_mount_path`]; its parent created by the manager).
    async fn mount_device(
        &self,
        _spec: &Spec,
        _device_mount_path: &Path,
    ) -> Result<(), PluginError> {
        Ok(())
    }

    /// Its reverse (`UnmountDevice`), after the last pod's tear-down.
    async fn unmount_device(
        &self,
        _spec: &Spec,
        _device_mount_path: &Path,
    ) -> Result<(), PluginError> {
        Ok(())
    }

    /// Makes the volume available for the pod in `args.dir` (`SetUp`);
    /// idempotent.
    async fn set_up(&self, args: SetUpArgs<'_>) -> Result<(), PluginError>;

    /// Undoes [`Self::set_up`] and removes `args.dir` (`TearDown`);
    /// idempotent (a missing directory is torn down).
    async fn tear_down(&self, args: TearDownArgs<'_>) -> Result<(), PluginError>;
}

/// The registered plugins (the kubelet's `VolumePluginMgr`).
#[derive(Clone, Debug, Default)]
pub struct VolumePluginMgr {
    plugins: Vec<Arc<dyn VolumePlugin>>,
}

impl VolumePluginMgr {
    /// Adds a plugin; a second plugin of the same name is refused.
    pub fn register(&mut self, plugin: Arc<dyn VolumePlugin>) -> Result<(), PluginError> {
        if self.plugins.iter().any(|p| p.name() == plugin.name()) {
            return Err(PluginError::NoPlugin(format!(
                "volume plugin {:?} was registered more than once",
                plugin.name()
            )));
        }
        self.plugins.push(plugin);
        Ok(())
    }

    /// The one plugin supporting `spec` (`FindPluginBySpec`).
    pub fn find(&self, spec: &Spec) -> Result<Arc<dyn VolumePlugin>, PluginError> {
        let found: Vec<_> = self
            .plugins
            .iter()
            .filter(|p| p.can_support(spec))
            .collect();
        match found.as_slice() {
            [one] => Ok((*one).clone()),
            [] => Err(PluginError::NoPlugin(format!(
                "no volume plugin matched volume {:?}",
                spec.name
            ))),
            many => Err(PluginError::NoPlugin(format!(
                "multiple volume plugins matched volume {:?}: {}",
                spec.name,
                many.iter().map(|p| p.name()).collect::<Vec<_>>().join(",")
            ))),
        }
    }

    /// The plugin named `name`.
    pub fn by_name(&self, name: &str) -> Option<Arc<dyn VolumePlugin>> {
        self.plugins.iter().find(|p| p.name() == name).cloned()
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.plugins.iter().map(|p| p.name()).collect()
    }
}

/// A plugin's name as a directory name (`kubernetes.io/empty-dir` ->
/// `kubernetes.io~empty-dir`, the kubelet's `EscapeQualifiedName`).
pub fn escape_plugin_name(name: &str) -> String {
    name.replace('/', "~")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Named(&'static str, &'static str);

    #[async_trait]
    impl VolumePlugin for Named {
        fn name(&self) -> &'static str {
            self.0
        }
        fn can_support(&self, spec: &Spec) -> bool {
            spec.name.starts_with(self.1)
        }
        fn attributes(&self, _: &Spec) -> Attributes {
            Attributes::default()
        }
        async fn set_up(&self, _: SetUpArgs<'_>) -> Result<(), PluginError> {
            Ok(())
        }
        async fn tear_down(&self, _: TearDownArgs<'_>) -> Result<(), PluginError> {
            Ok(())
        }
    }

    fn spec(name: &str) -> Spec {
        Spec {
            name: name.into(),
            source: VolumeSource::Inline(Box::new(Volume {
                name: name.into(),
                ..Default::default()
            })),
            read_only: false,
        }
    }

    #[test]
    fn one_plugin_per_spec_and_one_name_per_plugin() {
        let mut mgr = VolumePluginMgr::default();
        mgr.register(Arc::new(Named("a/x", "x"))).unwrap();
        mgr.register(Arc::new(Named("a/xy", "xy"))).unwrap();
        let dup = mgr.register(Arc::new(Named("a/x", "z"))).unwrap_err();
        assert!(
            dup.to_string()
                .contains("\"a/x\" was registered more than once")
        );
        assert_eq!(mgr.find(&spec("xa")).unwrap().name(), "a/x");
        let many = mgr.find(&spec("xya")).unwrap_err().to_string();
        assert!(
            many.contains("multiple volume plugins matched volume \"xya\": a/x,a/xy"),
            "{many}"
        );
        let none = mgr.find(&spec("q")).unwrap_err().to_string();
        assert_eq!(none, "no volume plugin matched volume \"q\"");
        let uid = PodUid::parse("0123abcd").unwrap();
        assert_eq!(
            Named("a/x", "x").unique_name(&spec("xv"), &uid).unwrap().0,
            "a/x/0123abcd-xv"
        );
        assert_eq!(
            escape_plugin_name("kubernetes.io/empty-dir"),
            "kubernetes.io~empty-dir"
        );
    }
}
