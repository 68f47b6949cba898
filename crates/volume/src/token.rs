//! Service-account tokens for projected volumes (the kubelet's
//! `pkg/kubelet/token` manager): a TokenRequest to the API server
//! (`POST .../serviceaccounts/<name>/token`, audiences, expiration, bound to
//! the pod), cached per pod and request, requested again when the cached one
//! is within 20 % of its lifetime from expiry or older than 24 h
//! (`requiresRefresh`; without its jitter), forgotten with the pod's volume.

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;

use super::plugin::{PluginError, PodContext};
use evpleg_core::ids::PodUid;

/// The kubelet's `maxTTL`.
pub const MAX_TTL_SECONDS: i64 = 24 * 3600;
/// `serviceAccountToken.expirationSeconds` when unset.
pub const DEFAULT_EXPIRATION_SECONDS: i64 = 3600;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    pod: PodUid,
    namespace: String,
    account: String,
    audience: String,
    expiration: i64,
}

#[derive(Clone, Debug)]
struct Cached {
    token: String,
    /// Unix seconds.
    expires_at: i64,
}

pub struct TokenManager {
    kube: Option<kube::Client>,
    cache: Mutex<HashMap<Key, Cached>>,
}

impl std::fmt::Debug for TokenManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenManager")
            .field("api", &self.kube.is_some())
            .finish_non_exhaustive()
    }
}

/// `requiresRefresh`: within 20 % of the lifetime of expiry, or issued more
/// than [`MAX_TTL_SECONDS`] ago (all Unix seconds).
pub fn requires_refresh(now: i64, expires_at: i64, expiration_seconds: i64) -> bool {
    let issued_at = expires_at - expiration_seconds;
    now > issued_at + MAX_TTL_SECONDS || now > expires_at - expiration_seconds * 20 / 100
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl TokenManager {
    pub fn new(kube: Option<kube::Client>) -> Self {
        Self {
            kube,
            cache: Mutex::new(HashMap::new()),
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Cached>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pod's token for `audience` (empty: the API server's), from the
    /// cache or a new TokenRequest.
    pub async fn token(
        &self,
        pod: &PodContext,
        audience: &str,
        expiration: Option<i64>,
    ) -> Result<String, PluginError> {
        let expiration = expiration.unwrap_or(DEFAULT_EXPIRATION_SECONDS);
        let key = Key {
            pod: pod.uid.clone(),
            namespace: pod.namespace().to_owned(),
            account: pod.service_account().to_owned(),
            audience: audience.to_owned(),
            expiration,
        };
        if let Some(c) = self.cache().get(&key)
            && !requires_refresh(unix_now(), c.expires_at, expiration)
        {
            return Ok(c.token.clone());
        }
        let what = format!(
            "serviceaccounts \"{}\" token for pod {}/{}",
            key.account,
            key.namespace,
            pod.name()
        );
        let Some(kube) = &self.kube else {
            return Err(PluginError::Object(format!(
                "{what}: no API server to request it from (the agent runs without --kubeconfig)"
            )));
        };
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: if audience.is_empty() {
                    Vec::new()
                } else {
                    vec![audience.to_owned()]
                },
                expiration_seconds: Some(expiration),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(pod.name().to_owned()),
                    uid: Some(pod.uid.to_string()),
                }),
            },
            ..Default::default()
        };
        let api: kube::Api<ServiceAccount> = kube::Api::namespaced(kube.clone(), &key.namespace);
        let answer = api
            .create_token_request(&key.account, &Default::default(), &request)
            .await
            .map_err(|e| PluginError::Object(format!("failed to fetch token: {what}: {e}")))?;
        let status = answer.status.ok_or_else(|| {
            PluginError::Object(format!("{what}: the TokenRequest has no status"))
        })?;
        let cached = Cached {
            token: status.token.clone(),
            expires_at: status.expiration_timestamp.0.as_second(),
        };
        self.cache().insert(key, cached);
        Ok(status.token)
    }

    /// Forgets the pod's tokens (`DeleteServiceAccountToken`).
    pub fn forget_pod(&self, uid: &PodUid) {
        self.cache().retain(|k, _| &k.pod != uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refresh_at_80_percent_of_the_lifetime_or_after_a_day() {
        let exp = 3600;
        let issued = 1_000_000;
        let expires = issued + exp;
        let cases = [
            (issued, false),
            (issued + 2879, false),
            (issued + 2880, false),
            (issued + 2881, true),
            (expires + 1, true),
        ];
        for (now, want) in cases {
            assert_eq!(
                requires_refresh(now, expires, exp),
                want,
                "{}",
                now - issued
            );
        }
        // A two-day token is refreshed after a day.
        let long = 2 * 86_400;
        assert!(!requires_refresh(issued + 86_400, issued + long, long));
        assert!(requires_refresh(issued + 86_401, issued + long, long));
    }
}
