//! Image pull credentials from a pod's `imagePullSecrets`, as the kubelet's
//! credential keyring (`pkg/credentialprovider`):
//!
//! - the secrets are read from the API server (the kubelet's
//!   `getPullSecretsForPod`): one that cannot be read is skipped, and a
//!   `FailedToRetrieveImagePullSecret` Warning names the skipped ones; an
//!   entry with an empty name is ignored;
//! - `kubernetes.io/dockerconfigjson` secrets give their `.dockerconfigjson`'s
//!   `auths`, `kubernetes.io/dockercfg` secrets their `.dockercfg`
//!   (`secrets.MakeDockerKeyring`); an entry's `auth` (base64 `user:pass`)
//!   wins over its `username` and `password` (`DockerConfigEntry.UnmarshalJSON`);
//! - every entry's registry goes in one keyring (`BasicDockerKeyring.Add`):
//!   its scheme dropped, a leading `/v1` or `/v2` of its path dropped, the
//!   keys sorted in reverse so that a longer path comes before its prefix;
//! - an image's repository (`docker.io/library/` added as the kubelet's
//!   `ParseImageName` does) gets the credentials of every key that matches
//!   it (`URLsMatch`): the same number of host labels, each matched as a glob
//!   (`*.example.com`), the same port (none matches only none), the key's
//!   path a prefix of the repository's; with no match, an
//!   `index.docker.io` entry serves Docker Hub images (`isDefaultRegistryMatch`);
//! - the pull tries each matching credential in turn, the first success
//!   wins, and the errors of all are the pull's error (the kubelet's
//!   `PullImage` in `kuberuntime_image.go`); with no match it pulls without.
//!
//! The ServiceAccount's `imagePullSecrets` come in the pod's: the API
//! server's `ServiceAccount` admission plugin copies them into the pod's spec
//! at its creation, and the kubelet, like this module, reads only the pod's.
//!
//! Differences: no node-wide keyring (the kubelet's `config.json` search
//! paths and its credential provider plugins); the credentials are not
//! cached between pulls (the kubelet's secret manager keeps a watched
//! copy); no `KubeletEnsureSecretPulledImages` record of which credentials
//! pulled an image.

use std::collections::BTreeMap;

use evpleg_cri::CriClient;
use evpleg_cri_api::v1;
use k8s_openapi::api::core::v1::{Pod, Secret};

/// The type and key of a `.dockerconfigjson` secret.
pub const DOCKER_CONFIG_JSON_TYPE: &str = "kubernetes.io/dockerconfigjson";
pub const DOCKER_CONFIG_JSON_KEY: &str = ".dockerconfigjson";
/// The type and key of a legacy `.dockercfg` secret.
pub const DOCKERCFG_TYPE: &str = "kubernetes.io/dockercfg";
pub const DOCKERCFG_KEY: &str = ".dockercfg";
/// The Warning reason of pull secrets that could not be read.
pub const FAILED_TO_RETRIEVE_IMAGE_PULL_SECRET: &str = "FailedToRetrieveImagePullSecret";
/// Docker Hub's key in a docker configuration (`index.docker.io/v1/`, its
/// path dropped).
const DEFAULT_REGISTRY_HOST: &str = "index.docker.io";

/// Why pull credentials cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CredentialError {
    #[error("secret {namespace}/{name}: cannot parse {key}: {message}")]
    Parse {
        namespace: String,
        name: String,
        key: &'static str,
        message: String,
    },
    #[error("docker config entry {registry:?}: auth is not base64 of user:password")]
    Auth { registry: String },
}

/// One registry's credentials (`AuthConfig`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Credential {
    pub username: String,
    pub password: String,
}

impl Credential {
    /// The CRI's `AuthConfig` for it.
    pub fn auth_config(&self) -> v1::AuthConfig {
        v1::AuthConfig {
            username: self.username.clone(),
            password: self.password.clone(),
            ..Default::default()
        }
    }
}

/// A docker configuration entry as written (`DockerConfigEntry`): its
/// string fields, missing ones empty.
#[derive(Debug, Default)]
struct Entry {
    username: String,
    password: String,
    auth: String,
}

/// A docker configuration (`DockerConfig`): registry to entry.
fn parse_config(v: &serde_json::Value) -> Result<BTreeMap<String, Entry>, String> {
    let map = v.as_object().ok_or("not a JSON object of registries")?;
    let mut out = BTreeMap::new();
    for (registry, e) in map {
        let field = |name: &str| match e.get(name) {
            None | Some(serde_json::Value::Null) => Ok(String::new()),
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(format!("{registry}: {name} is not a string")),
        };
        if !e.is_object() {
            return Err(format!("{registry}: not a JSON object"));
        }
        let entry = Entry {
            username: field("username")?,
            password: field("password")?,
            auth: field("auth")?,
        };
        out.insert(registry.clone(), entry);
    }
    Ok(out)
}

/// Registries and their credentials, the most specific key first
/// (`BasicDockerKeyring`).
#[derive(Clone, Debug, Default)]
pub struct Keyring {
    /// Keys (`host[:port][/path]`), reverse sorted, no duplicates.
    index: Vec<String>,
    creds: BTreeMap<String, Vec<Credential>>,
}

impl Keyring {
    /// The keyring of `secrets` (`MakeDockerKeyring`): secrets of other
    /// types, or without their key, give nothing.
    pub fn from_secrets(secrets: &[Secret]) -> Result<Self, CredentialError> {
        let mut keyring = Keyring::default();
        for s in secrets {
            let data = s.data.as_ref();
            let get = |key: &str| data.and_then(|d| d.get(key)).filter(|v| !v.0.is_empty());
            let parse_error = |key: &'static str, message: String| CredentialError::Parse {
                namespace: s.metadata.namespace.clone().unwrap_or_default(),
                name: s.metadata.name.clone().unwrap_or_default(),
                key,
                message,
            };
            let type_ = s.type_.as_deref().unwrap_or_default();
            let (key, auths) = if let Some(v) =
                get(DOCKER_CONFIG_JSON_KEY).filter(|_| type_ == DOCKER_CONFIG_JSON_TYPE)
            {
                let json: serde_json::Value = serde_json::from_slice(&v.0)
                    .map_err(|e| parse_error(DOCKER_CONFIG_JSON_KEY, e.to_string()))?;
                let auths = json
                    .get("auths")
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!({}));
                (DOCKER_CONFIG_JSON_KEY, auths)
            } else if let Some(v) = get(DOCKERCFG_KEY).filter(|_| type_ == DOCKERCFG_TYPE) {
                let json: serde_json::Value = serde_json::from_slice(&v.0)
                    .map_err(|e| parse_error(DOCKERCFG_KEY, e.to_string()))?;
                (DOCKERCFG_KEY, json)
            } else {
                continue;
            };
            keyring.add(parse_config(&auths).map_err(|m| parse_error(key, m))?)?;
        }
        Ok(keyring)
    }

    /// `BasicDockerKeyring.Add`.
    fn add(&mut self, cfg: BTreeMap<String, Entry>) -> Result<(), CredentialError> {
        for (registry, entry) in cfg {
            let credential = if entry.auth.is_empty() {
                Credential {
                    username: entry.username,
                    password: entry.password,
                }
            } else {
                decode_auth(&entry.auth).ok_or_else(|| CredentialError::Auth {
                    registry: registry.clone(),
                })?
            };
            let key = registry_key(&registry);
            self.creds.entry(key.clone()).or_default().push(credential);
            self.index.push(key);
        }
        self.index.sort_unstable_by(|a, b| b.cmp(a));
        self.index.dedup();
        Ok(())
    }

    /// The credentials for `image`'s repository, the most specific first
    /// (`BasicDockerKeyring.Lookup`); empty: pull without.
    pub fn lookup(&self, image: &str) -> Vec<Credential> {
        let repo = repository(image);
        let found: Vec<Credential> = self
            .index
            .iter()
            .filter(|k| urls_match(k, &repo))
            .flat_map(|k| self.creds[k.as_str()].iter().cloned())
            .collect();
        if !found.is_empty() {
            return found;
        }
        match self.creds.get(DEFAULT_REGISTRY_HOST) {
            Some(c) if is_default_registry_match(&repo) => c.clone(),
            _ => Vec::new(),
        }
    }
}

/// `decodeDockerConfigFieldAuth`: base64 `user:password`.
fn decode_auth(auth: &str) -> Option<Credential> {
    let bytes: k8s_openapi::ByteString =
        serde_json::from_value(serde_json::Value::String(auth.to_owned())).ok()?;
    let text = String::from_utf8(bytes.0).ok()?;
    let (user, password) = text.split_once(':')?;
    Some(Credential {
        username: user.to_owned(),
        password: password.trim_matches('\0').to_owned(),
    })
}

/// A registry's key: without scheme, with its path unless that is empty or
/// `/` once a leading `/v1` or `/v2` is dropped.
fn registry_key(registry: &str) -> String {
    let rest = registry
        .strip_prefix("https://")
        .or_else(|| registry.strip_prefix("http://"))
        .unwrap_or(registry);
    let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let path = if path.starts_with("/v1/") || path.starts_with("/v2/") {
        &path[3..]
    } else {
        path
    };
    if path.is_empty() || path == "/" {
        host.to_owned()
    } else {
        format!("{host}{path}")
    }
}

/// The repository an image is pulled from, as the kubelet's
/// `ParseImageName` normalises it: without tag and digest, Docker Hub's
/// host and `library/` added to a short name.
pub fn repository(image: &str) -> String {
    let name = image.split_once('@').map_or(image, |(n, _)| n);
    let name = match name.rfind(':') {
        Some(i) if !name[i..].contains('/') => &name[..i],
        _ => name,
    };
    let (first, rest) = name.split_once('/').unwrap_or(("", name));
    if !first.is_empty() && (first.contains(['.', ':']) || first == "localhost") {
        return name.to_owned();
    }
    let rest = if first.is_empty() {
        rest.to_owned()
    } else {
        format!("{first}/{rest}")
    };
    if rest.contains('/') {
        format!("docker.io/{rest}")
    } else {
        format!("docker.io/library/{rest}")
    }
}

/// `isDefaultRegistryMatch`: an image of Docker Hub.
fn is_default_registry_match(repo: &str) -> bool {
    let Some((first, _)) = repo.split_once('/') else {
        return !repo.is_empty();
    };
    if first.is_empty() {
        return false;
    }
    first == "docker.io" || first == "index.docker.io" || !first.contains(['.', ':'])
}

/// `URLsMatchStr`: whether the key `glob` (host labels may be globs) covers
/// the repository `target`.
pub fn urls_match(glob: &str, target: &str) -> bool {
    let split = |s: &str| {
        let (authority, path) = s.split_at(s.find('/').unwrap_or(s.len()));
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) if !p.contains(']') => (h, p),
            _ => (authority, ""),
        };
        (host.to_owned(), port.to_owned(), path.to_owned())
    };
    let (g_host, g_port, g_path) = split(glob);
    let (t_host, t_port, t_path) = split(target);
    if g_port != t_port {
        return false;
    }
    let g_labels: Vec<&str> = g_host.split('.').collect();
    let t_labels: Vec<&str> = t_host.split('.').collect();
    g_labels.len() == t_labels.len()
        && g_labels
            .iter()
            .zip(&t_labels)
            .all(|(g, t)| glob_match(g, t))
        && t_path.starts_with(&g_path)
}

/// `filepath.Match` within one host label: `*` any run, `?` one character,
/// `[...]` a class; anything else literally.
fn glob_match(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    fn go(p: &[char], t: &[char]) -> bool {
        match p.first() {
            None => t.is_empty(),
            Some('*') => (0..=t.len()).any(|i| go(&p[1..], &t[i..])),
            Some('?') => !t.is_empty() && go(&p[1..], &t[1..]),
            Some('[') => {
                let Some(end) = p.iter().position(|c| *c == ']') else {
                    return false;
                };
                let Some(c) = t.first() else { return false };
                let class = &p[1..end];
                let (negate, class) = match class.first() {
                    Some('^') => (true, &class[1..]),
                    _ => (false, class),
                };
                let mut hit = false;
                let mut i = 0;
                while i < class.len() {
                    if i + 2 < class.len() && class[i + 1] == '-' {
                        hit |= class[i] <= *c && *c <= class[i + 2];
                        i += 3;
                    } else {
                        hit |= class[i] == *c;
                        i += 1;
                    }
                }
                hit != negate && go(&p[end + 1..], &t[1..])
            }
            Some(c) => t.first() == Some(c) && go(&p[1..], &t[1..]),
        }
    }
    go(&p, &t)
}

/// Reads the pod's pull secrets (`getPullSecretsForPod`): the secrets read,
/// and the names of those that could not be (for the Warning). Without an
/// API server none can be read.
pub async fn pull_secrets(kube: Option<&kube::Client>, pod: &Pod) -> (Vec<Secret>, Vec<String>) {
    let names = pod
        .spec
        .iter()
        .flat_map(|s| s.image_pull_secrets.iter().flatten())
        .map(|r| r.name.as_str())
        .filter(|n| !n.is_empty());
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let (mut found, mut failed) = (Vec::new(), Vec::new());
    for name in names {
        let got = match kube {
            Some(k) => kube::Api::<Secret>::namespaced(k.clone(), ns)
                .get(name)
                .await
                .map_err(|e| e.to_string()),
            None => Err("no kubeClient defined".to_owned()),
        };
        match got {
            Ok(s) => found.push(s),
            Err(e) => {
                tracing::info!(namespace = ns, secret = name, error = %e,
                    "unable to retrieve pull secret, the image pull may not succeed");
                failed.push(name.to_owned());
            }
        }
    }
    (found, failed)
}

/// The kubelet's `PullImage`: without credentials for the image one pull
/// without; else one pull per credential until one succeeds. The error
/// lists every attempt's, as Go's `NewAggregate` (one: itself; more:
/// `[a, b]`).
pub async fn pull_image(
    cri: &CriClient,
    keyring: &Keyring,
    spec: &v1::ImageSpec,
) -> Result<String, String> {
    let creds = keyring.lookup(&spec.image);
    if creds.is_empty() {
        return cri
            .pull_image(spec, None, None)
            .await
            .map_err(|e| crate::kuberuntime::images::pull_error_text(&e));
    }
    let mut errors = Vec::new();
    for c in &creds {
        match cri.pull_image(spec, Some(&c.auth_config()), None).await {
            Ok(image_ref) => return Ok(image_ref),
            Err(e) => errors.push(crate::kuberuntime::images::pull_error_text(&e)),
        }
    }
    Err(match errors.as_slice() {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    })
}

#[cfg(test)]
mod tests;
