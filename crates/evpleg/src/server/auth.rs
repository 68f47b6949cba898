//! The kubelet server's authentication and authorization, as the kubelet's
//! `pkg/kubelet/server/auth.go` and the delegating authenticator and
//! authorizer it builds (`--anonymous-auth`, `--client-ca-file`,
//! `--authentication-token-webhook`, `--authorization-mode`):
//!
//! * authentication: a verified client certificate names the user (its
//!   common name) and groups (its organizations); else a bearer token is
//!   reviewed by the API server (`TokenReview`), its answer, either way, kept
//!   for `--authentication-token-webhook-cache-ttl` (2 min); else, with
//!   anonymous requests allowed, `system:anonymous` in
//!   `system:unauthenticated`; else 401. Every authenticated user also gets
//!   `system:authenticated`;
//! * authorization: `AlwaysAllow`, or `Webhook`: a `SubjectAccessReview` of
//!   the request's verb (GET get, POST create, PUT update, PATCH patch,
//!   DELETE delete) on `nodes/<subresource>` named after the node, the
//!   subresource from the path ([`attributes`]: `stats`, `metrics`, `log`
//!   for `/logs`, and `configz`, `healthz`, `pods` with `proxy` as their
//!   fallback, as the kubelet's fine-grained authorization; `proxy` for
//!   everything else); allowed answers kept 5 min, denied ones 30 s
//!   (`--authorization-webhook-cache-authorized-ttl`, `-unauthorized-ttl`).
//!   Denied: 403 `Forbidden (user=..., verb=..., resource=nodes,
//!   subresource(s)=[...])`; a review that failed: 500.
//!
//! Differences: no `--authentication-token-webhook` audiences, no request
//! header (front proxy) authentication; the caches are bounded at
//! [`CACHE_ENTRIES`] and emptied when full.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use tokio::time::Instant;

/// The kubelet's default token review cache TTL.
pub const TOKEN_TTL: Duration = Duration::from_secs(120);
/// The kubelet's default TTL of an allowed access review.
pub const AUTHORIZED_TTL: Duration = Duration::from_secs(300);
/// The kubelet's default TTL of a denied access review.
pub const UNAUTHORIZED_TTL: Duration = Duration::from_secs(30);
/// Entries a cache holds at most.
pub const CACHE_ENTRIES: usize = 4096;

/// Who made a request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct User {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

impl User {
    /// `system:anonymous` in `system:unauthenticated`.
    pub fn anonymous() -> Self {
        Self {
            name: "system:anonymous".into(),
            groups: vec!["system:unauthenticated".into()],
            ..Self::default()
        }
    }

    fn authenticated(mut self) -> Self {
        if !self.groups.iter().any(|g| g == "system:authenticated") {
            self.groups.push("system:authenticated".into());
        }
        self
    }
}

/// What a request asks for: its verb on `nodes/<subresource>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct Attributes {
    pub verb: &'static str,
    pub subresource: &'static str,
}

/// The request's attributes to authorize, in order: the first allowed one
/// lets it through.
pub fn attributes(method: &str, path: &str) -> Vec<Attributes> {
    let verb = match method {
        "GET" => "get",
        "POST" => "create",
        "PUT" => "update",
        "PATCH" => "patch",
        "DELETE" => "delete",
        _ => "",
    };
    let under = |prefix: &str| {
        path == prefix
            || path
                .strip_prefix(prefix)
                .is_some_and(|r| r.starts_with('/'))
    };
    let one = |subresource| Attributes { verb, subresource };
    if under("/stats") {
        vec![one("stats")]
    } else if under("/metrics") {
        vec![one("metrics")]
    } else if under("/logs") {
        vec![one("log")]
    } else if under("/configz") {
        vec![one("configz"), one("proxy")]
    } else if under("/healthz") {
        vec![one("healthz"), one("proxy")]
    } else if under("/pods") {
        vec![one("pods"), one("proxy")]
    } else {
        vec![one("proxy")]
    }
}

/// Why a request is not let through.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No acceptable credentials: 401.
    #[error("Unauthorized")]
    Unauthenticated,
    /// The token review failed: 401, as the kubelet answers.
    #[error("token review: {0}")]
    TokenReview(String),
    /// Every attribute denied: 403.
    #[error(
        "Forbidden (user={user}, verb={verb}, resource=nodes, subresource(s)=[{subresources}])"
    )]
    Forbidden {
        user: String,
        verb: String,
        subresources: String,
    },
    /// The access review failed: 500.
    #[error(
        "Authorization error (user={user}, verb={verb}, resource=nodes, subresource(s)=[{subresources}]): {message}"
    )]
    Review {
        user: String,
        verb: String,
        subresources: String,
        message: String,
    },
}

/// The API server's reviews (a trait, for the caches' tests).
pub trait Reviewer: Send + Sync + std::fmt::Debug + 'static {
    /// `TokenReview`: the token's user, `None` when not authenticated.
    fn token_review(
        &self,
        token: &str,
    ) -> impl Future<Output = Result<Option<User>, String>> + Send;
    /// `SubjectAccessReview` of `attrs` on node `node`.
    fn access_review(
        &self,
        user: &User,
        node: &str,
        attrs: &Attributes,
    ) -> impl Future<Output = Result<bool, String>> + Send;
}

/// The reviews through the agent's API client.
#[derive(Clone)]
pub struct KubeReviewer(pub kube::Client);

impl std::fmt::Debug for KubeReviewer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KubeReviewer")
    }
}

impl Reviewer for KubeReviewer {
    async fn token_review(&self, token: &str) -> Result<Option<User>, String> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                ..TokenReviewSpec::default()
            },
            ..TokenReview::default()
        };
        let api: Api<TokenReview> = Api::all(self.0.clone());
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| e.to_string())?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Ok(None);
        }
        let u = status.user.unwrap_or_default();
        Ok(Some(User {
            name: u.username.unwrap_or_default(),
            uid: u.uid.unwrap_or_default(),
            groups: u.groups.unwrap_or_default(),
            extra: u.extra.unwrap_or_default().into_iter().collect(),
        }))
    }

    async fn access_review(
        &self,
        user: &User,
        node: &str,
        attrs: &Attributes,
    ) -> Result<bool, String> {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.name.clone()),
                uid: (!user.uid.is_empty()).then(|| user.uid.clone()),
                groups: Some(user.groups.clone()),
                extra: (!user.extra.is_empty()).then(|| user.extra.clone().into_iter().collect()),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(attrs.verb.into()),
                    group: Some(String::new()),
                    version: Some("v1".into()),
                    resource: Some("nodes".into()),
                    subresource: Some(attrs.subresource.into()),
                    name: Some(node.into()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let api: Api<SubjectAccessReview> = Api::all(self.0.clone());
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| e.to_string())?;
        Ok(answer.status.is_some_and(|s| s.allowed))
    }
}

/// A map whose entries expire.
#[derive(Debug)]
struct TtlCache<K, V> {
    entries: Mutex<HashMap<K, (V, Instant)>>,
}

impl<K: Eq + Hash, V: Clone> TtlCache<K, V> {
    fn new() -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
        }
    }

    fn get(&self, key: &K) -> Option<V> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries
            .get(key)
            .filter(|(_, until)| Instant::now() < *until)
            .map(|(v, _)| v.clone())
    }

    fn put(&self, key: K, value: V, ttl: Duration) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if entries.len() >= CACHE_ENTRIES {
            entries.retain(|_, (_, until)| now < *until);
            if entries.len() >= CACHE_ENTRIES {
                entries.clear();
            }
        }
        entries.insert(key, (value, now + ttl));
    }
}

/// `--authorization-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthzMode {
    AlwaysAllow,
    Webhook,
}

/// The settings of [`Auth`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthConfig {
    pub node_name: String,
    pub anonymous: bool,
    /// Bearer tokens reviewed by the API server.
    pub token_webhook: bool,
    pub token_ttl: Duration,
    pub mode: AuthzMode,
    pub authorized_ttl: Duration,
    pub unauthorized_ttl: Duration,
}

/// How many reviews were asked of the API server (the caches' effect).
#[derive(Debug, Default)]
pub struct ReviewCounts {
    pub token_reviews: AtomicU64,
    pub access_reviews: AtomicU64,
}

/// Authentication and authorization of the kubelet server's requests.
#[derive(Debug)]
pub struct Auth<R> {
    config: AuthConfig,
    reviewer: Option<R>,
    tokens: TtlCache<[u8; 32], Option<User>>,
    decisions: TtlCache<(User, Attributes), bool>,
    pub counts: ReviewCounts,
}

impl<R: Reviewer> Auth<R> {
    /// `reviewer` is needed by the token webhook and the `Webhook` mode.
    pub fn new(config: AuthConfig, reviewer: Option<R>) -> Self {
        Self {
            config,
            reviewer,
            tokens: TtlCache::new(),
            decisions: TtlCache::new(),
            counts: ReviewCounts::default(),
        }
    }

    pub fn config(&self) -> &AuthConfig {
        &self.config
    }

    /// The user of a request: its client certificate's (`cert`), its bearer
    /// token's (from the `Authorization` header), or anonymous.
    pub async fn authenticate(
        &self,
        cert: Option<&User>,
        authorization: Option<&str>,
    ) -> Result<User, AuthError> {
        if let Some(user) = cert {
            return Ok(user.clone().authenticated());
        }
        let token = authorization
            .and_then(|h| {
                h.strip_prefix("Bearer ")
                    .or_else(|| h.strip_prefix("bearer "))
            })
            .map(str::trim)
            .filter(|t| !t.is_empty());
        if let (Some(token), true, Some(reviewer)) =
            (token, self.config.token_webhook, &self.reviewer)
        {
            use sha2::Digest;
            let key: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
            let user = match self.tokens.get(&key) {
                Some(cached) => cached,
                None => {
                    self.counts.token_reviews.fetch_add(1, Ordering::Relaxed);
                    let answer = reviewer
                        .token_review(token)
                        .await
                        .map_err(AuthError::TokenReview)?;
                    self.tokens.put(key, answer.clone(), self.config.token_ttl);
                    answer
                }
            };
            return user
                .map(User::authenticated)
                .ok_or(AuthError::Unauthenticated);
        }
        if self.config.anonymous {
            return Ok(User::anonymous());
        }
        Err(AuthError::Unauthenticated)
    }

    /// Lets `user` through for `method` on `path`, or says why not.
    pub async fn authorize(&self, user: &User, method: &str, path: &str) -> Result<(), AuthError> {
        let attrs = attributes(method, path);
        let reviewer = match (self.config.mode, &self.reviewer) {
            (AuthzMode::AlwaysAllow, _) => return Ok(()),
            (AuthzMode::Webhook, Some(r)) => r,
            (AuthzMode::Webhook, None) => {
                return Err(self.denied(user, &attrs, Some("no API server to ask".into())));
            }
        };
        for a in &attrs {
            let key = (user.clone(), a.clone());
            let allowed = match self.decisions.get(&key) {
                Some(d) => d,
                None => {
                    self.counts.access_reviews.fetch_add(1, Ordering::Relaxed);
                    let allowed = reviewer
                        .access_review(user, &self.config.node_name, a)
                        .await
                        .map_err(|e| self.denied(user, &attrs, Some(e)))?;
                    let ttl = if allowed {
                        self.config.authorized_ttl
                    } else {
                        self.config.unauthorized_ttl
                    };
                    self.decisions.put(key, allowed, ttl);
                    allowed
                }
            };
            if allowed {
                return Ok(());
            }
        }
        Err(self.denied(user, &attrs, None))
    }

    fn denied(&self, user: &User, attrs: &[Attributes], error: Option<String>) -> AuthError {
        let verb = attrs.first().map(|a| a.verb).unwrap_or_default().to_owned();
        let subresources = attrs
            .iter()
            .map(|a| a.subresource)
            .collect::<Vec<_>>()
            .join(" ");
        match error {
            None => AuthError::Forbidden {
                user: user.name.clone(),
                verb,
                subresources,
            },
            Some(message) => AuthError::Review {
                user: user.name.clone(),
                verb,
                subresources,
                message,
            },
        }
    }
}

#[cfg(test)]
mod tests;
