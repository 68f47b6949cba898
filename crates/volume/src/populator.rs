//! The desired state's populator (the kubelet's
//! `populator/desired_state_of_world_populator.go`, `processPodVolumes` and
//! `createVolumeSpec`): a pod's `spec.volumes`, each turned into a
//! [`Spec`], its plugin found and its unique name taken. A
//! `persistentVolumeClaim` (and an `ephemeral` volume's claim,
//! `<pod>-<volume>`, which must be owned by the pod) is resolved through the
//! API server to the PersistentVolume bound to it, with the kubelet's checks
//! (`getPVCExtractPV`, `getPVSpec`): the claim exists, is not being deleted,
//! is Bound to a named volume, and that volume's `claimRef` is the claim.
//! A volume that cannot be processed is kept as an error of the pod (the
//! wait reports it).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Volume};

use super::desired::{DesiredPod, DesiredVolume};
use super::plugin::{PodContext, Spec, VolumePluginMgr, VolumeSource};

/// Why a claim cannot be resolved (the kubelet's words).
#[derive(Debug, thiserror::Error)]
pub enum PopulatorError {
    /// A volume name that is no path component would name a directory
    /// outside the pod's (admission refuses such pods first).
    #[error("volume name {name:?} is not a DNS-1123 label: it cannot name the volume's directory")]
    BadName { name: String },
    #[error(
        "error processing PVC {claim}: no API server to read it from (the agent runs without --kubeconfig)"
    )]
    NoApiServer { claim: String },
    #[error("error processing PVC {claim}: failed to fetch PVC from API server: {message}")]
    ClaimFetch { claim: String, message: String },
    /// Deleted, and no longer protected by `kubernetes.io/pvc-protection`.
    #[error("error processing PVC {claim}: PVC is being deleted")]
    ClaimDeleting { claim: String },
    #[error("error processing PVC {claim}: PVC is not bound")]
    NotBound { claim: String },
    #[error("error processing PVC {claim}: PVC has empty pvc.Spec.VolumeName")]
    NoVolumeName { claim: String },
    /// An ephemeral volume's claim not controlled by the pod (the kubelet
    /// returns `ephemeral.VolumeIsForPod`'s error as it is).
    #[error("PVC {claim} was not created for pod {pod} (pod is not owner)")]
    NotOwner { claim: String, pod: String },
    #[error("error processing PVC {claim}: failed to fetch PV {volume} from API server: {message}")]
    VolumeFetch {
        claim: String,
        volume: String,
        message: String,
    },
    #[error(
        "error processing PVC {claim}: found PV object {volume} but it has a nil pv.Spec.ClaimRef indicating it is not yet bound to the claim"
    )]
    NoClaimRef { claim: String, volume: String },
    #[error(
        "error processing PVC {claim}: found PV object {volume} but its pv.Spec.ClaimRef.UID {claim_ref} does not point to claim.UID {claim_uid}"
    )]
    ClaimRef {
        claim: String,
        volume: String,
        claim_ref: String,
        claim_uid: String,
    },
}

/// The finalizer that keeps a claim in use from going (`util.PVCProtectionFinalizer`).
const PVC_PROTECTION: &str = "kubernetes.io/pvc-protection";

/// What the kubelet's `%v` of a client error shows: the API server's
/// message (`persistentvolumeclaims "data" not found`).
fn api_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => status.message.clone(),
        other => other.to_string(),
    }
}

/// The pod's volumes as the desired state wants them.
pub async fn desired_pod(
    plugins: &VolumePluginMgr,
    kube: Option<&kube::Client>,
    ctx: PodContext,
) -> DesiredPod {
    let mut volumes = BTreeMap::new();
    let mut errors = BTreeMap::new();
    let specs = ctx
        .pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.clone())
        .unwrap_or_default();
    for vol in specs {
        let name = vol.name.clone();
        if !evpleg_core::names::is_dns_label(&name) {
            errors.insert(name.clone(), PopulatorError::BadName { name }.to_string());
            continue;
        }
        let spec = match spec_of(kube, &ctx, vol).await {
            Ok(s) => s,
            Err(e) => {
                errors.insert(name, e.to_string());
                continue;
            }
        };
        let found = plugins.find(&spec).and_then(|p| {
            let unique = p.unique_name(&spec, &ctx.uid)?;
            Ok((p, unique))
        });
        match found {
            Ok((plugin, unique)) => {
                let v = DesiredVolume {
                    unique,
                    device_mountable: plugin.device_mountable(&spec),
                    requires_remount: plugin.requires_remount(&spec),
                    plugin,
                    spec,
                };
                volumes.insert(name, v);
            }
            Err(e) => {
                errors.insert(name, e.to_string());
            }
        }
    }
    DesiredPod {
        ctx,
        volumes,
        errors,
    }
}

/// The kubelet's `createVolumeSpec`.
async fn spec_of(
    kube: Option<&kube::Client>,
    ctx: &PodContext,
    vol: Volume,
) -> Result<Spec, PopulatorError> {
    let (claim_name, read_only, ephemeral) = if let Some(c) = &vol.persistent_volume_claim {
        (c.claim_name.clone(), c.read_only.unwrap_or(false), false)
    } else if vol.ephemeral.is_some() {
        (format!("{}-{}", ctx.name(), vol.name), false, true)
    } else {
        return Ok(Spec {
            name: vol.name.clone(),
            source: VolumeSource::Inline(Box::new(vol)),
            read_only: false,
        });
    };
    let claim_key = format!("{}/{}", ctx.namespace(), claim_name);
    let Some(kube) = kube else {
        return Err(PopulatorError::NoApiServer { claim: claim_key });
    };
    let claims: kube::Api<PersistentVolumeClaim> =
        kube::Api::namespaced(kube.clone(), ctx.namespace());
    let claim = claims
        .get(&claim_name)
        .await
        .map_err(|e| PopulatorError::ClaimFetch {
            claim: claim_key.clone(),
            message: api_message(&e),
        })?;
    let pv_name = resolve_claim(&claim, &claim_key)?;
    if ephemeral {
        let owned =
            claim.metadata.owner_references.iter().flatten().any(|o| {
                o.controller == Some(true) && Some(&o.uid) == ctx.pod.metadata.uid.as_ref()
            });
        if !owned {
            return Err(PopulatorError::NotOwner {
                claim: claim_key,
                pod: format!("{}/{}", ctx.namespace(), ctx.name()),
            });
        }
    }
    let volumes: kube::Api<PersistentVolume> = kube::Api::all(kube.clone());
    let pv = volumes
        .get(&pv_name)
        .await
        .map_err(|e| PopulatorError::VolumeFetch {
            claim: claim_key.clone(),
            volume: pv_name.clone(),
            message: api_message(&e),
        })?;
    check_claim_ref(&claim, &pv, &claim_key)?;
    Ok(Spec {
        name: vol.name,
        source: VolumeSource::Persistent {
            claim: Box::new(claim),
            volume: Box::new(pv),
        },
        read_only,
    })
}

/// The bound volume's name (`getPVCExtractPV`): a claim being deleted is
/// refused only once its protection finalizer is gone.
pub fn resolve_claim(claim: &PersistentVolumeClaim, key: &str) -> Result<String, PopulatorError> {
    let protected = claim
        .metadata
        .finalizers
        .iter()
        .flatten()
        .any(|f| f == PVC_PROTECTION);
    if claim.metadata.deletion_timestamp.is_some() && !protected {
        return Err(PopulatorError::ClaimDeleting { claim: key.into() });
    }
    let phase = claim.status.as_ref().and_then(|s| s.phase.as_deref());
    if phase != Some("Bound") {
        return Err(PopulatorError::NotBound { claim: key.into() });
    }
    match claim.spec.as_ref().and_then(|s| s.volume_name.clone()) {
        Some(volume) if !volume.is_empty() => Ok(volume),
        _ => Err(PopulatorError::NoVolumeName { claim: key.into() }),
    }
}

/// The volume is bound to this claim (`getPVSpec`).
pub fn check_claim_ref(
    claim: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    key: &str,
) -> Result<(), PopulatorError> {
    let volume = pv.metadata.name.clone().unwrap_or_default();
    let Some(claim_ref) = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) else {
        return Err(PopulatorError::NoClaimRef {
            claim: key.into(),
            volume,
        });
    };
    let claim_ref = claim_ref.uid.clone().unwrap_or_default();
    let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
    if claim_ref != claim_uid {
        return Err(PopulatorError::ClaimRef {
            claim: key.into(),
            volume,
            claim_ref,
            claim_uid,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim(v: serde_json::Value) -> PersistentVolumeClaim {
        serde_json::from_value(v).unwrap()
    }

    // Each of the kubelet 1.37 `getPVCExtractPV` refusals, in its words (the
    // fidelity harness's volume-pvc-pending found the words of an older
    // kubelet here); a deleted claim still protected by its finalizer is
    // used, as the kubelet uses it.
    #[test]
    fn a_claim_resolves_only_when_bound_to_a_volume() {
        let deleted = "2026-01-01T00:00:00Z";
        let cases = [
            (
                json!({"metadata": {"name": "c"}, "spec": {"volumeName": "pv1"}, "status": {"phase": "Bound"}}),
                Ok("pv1"),
            ),
            (
                json!({"metadata": {"name": "c", "deletionTimestamp": deleted, "finalizers": [PVC_PROTECTION]},
                       "spec": {"volumeName": "pv1"}, "status": {"phase": "Bound"}}),
                Ok("pv1"),
            ),
            (
                json!({"metadata": {"name": "c", "deletionTimestamp": deleted},
                       "spec": {"volumeName": "pv1"}, "status": {"phase": "Bound"}}),
                Err("error processing PVC ns/c: PVC is being deleted"),
            ),
            (
                json!({"metadata": {"name": "c"}, "spec": {}, "status": {"phase": "Pending"}}),
                Err("error processing PVC ns/c: PVC is not bound"),
            ),
            (
                json!({"metadata": {"name": "c"}, "spec": {"volumeName": "pv1"}}),
                Err("error processing PVC ns/c: PVC is not bound"),
            ),
            (
                json!({"metadata": {"name": "c"}, "spec": {"volumeName": ""}, "status": {"phase": "Bound"}}),
                Err("error processing PVC ns/c: PVC has empty pvc.Spec.VolumeName"),
            ),
        ];
        for (c, expected) in cases {
            let got = resolve_claim(&claim(c.clone()), "ns/c").map_err(|e| e.to_string());
            assert_eq!(got.as_deref().map_err(String::as_str), expected, "{c}");
        }
    }

    #[test]
    fn a_volume_must_name_the_claim() {
        let bound = claim(json!({"metadata": {"name": "c", "uid": "u1"},
            "spec": {"volumeName": "pv1"}, "status": {"phase": "Bound"}}));
        let pv = |spec: serde_json::Value| -> PersistentVolume {
            serde_json::from_value(json!({"metadata": {"name": "pv1"}, "spec": spec})).unwrap()
        };
        check_claim_ref(&bound, &pv(json!({"claimRef": {"uid": "u1"}})), "ns/c").unwrap();
        let refused = |spec| {
            check_claim_ref(&bound, &pv(spec), "ns/c")
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            refused(json!({"claimRef": {"uid": "u2"}})),
            "error processing PVC ns/c: found PV object pv1 but its pv.Spec.ClaimRef.UID u2 does not point to claim.UID u1"
        );
        assert_eq!(
            refused(json!({})),
            "error processing PVC ns/c: found PV object pv1 but it has a nil pv.Spec.ClaimRef indicating it is not yet bound to the claim"
        );
    }
}
