//! `evpleg run`'s flags of the kubelet's authenticated server
//! ([`crate::server::secure`]), with the kubelet's names. Defaults are those
//! of the kubelet's configuration file (`KubeletConfiguration`, what kubeadm
//! deploys): anonymous requests refused, bearer tokens reviewed by the API
//! server, authorization by the API server; the kubelet's command line alone
//! defaults to anonymous allowed and `AlwaysAllow`.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::duration;
use crate::server::auth::{AuthConfig, AuthzMode};

/// `--authorization-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AuthorizationModeFlag {
    /// Every authenticated request is allowed.
    AlwaysAllow,
    /// A SubjectAccessReview per request (its verb on nodes/<subresource>).
    Webhook,
}

/// The kubelet server's flags.
#[derive(Clone, Debug, clap::Args)]
pub struct KubeletServerArgs {
    /// The IP address the kubelet server listens on (the kubelet's
    /// `--address`).
    #[arg(long, env = "EVPLEG_ADDRESS", default_value = "0.0.0.0")]
    pub address: IpAddr,

    /// The kubelet server's port (the kubelet's `--port`), written to the
    /// Node's status.daemonEndpoints; 0: a free port the kernel picks. The
    /// server runs with --kubeconfig, or with --authorization-mode
    /// AlwaysAllow.
    #[arg(long, env = "EVPLEG_PORT", default_value_t = 10250)]
    pub port: u16,

    /// The serving certificate (PEM, its chain after it); without it a
    /// self-signed one is made in --cert-dir.
    #[arg(long, env = "EVPLEG_TLS_CERT_FILE", requires = "tls_private_key_file")]
    pub tls_cert_file: Option<PathBuf>,

    /// The serving certificate's key (PEM).
    #[arg(long, env = "EVPLEG_TLS_PRIVATE_KEY_FILE", requires = "tls_cert_file")]
    pub tls_private_key_file: Option<PathBuf>,

    /// Where the self-signed serving certificate is kept (kubelet.crt,
    /// kubelet.key). Default: <root-dir>/pki.
    #[arg(long, env = "EVPLEG_CERT_DIR")]
    pub cert_dir: Option<PathBuf>,

    /// CA bundle (PEM) that client certificates must chain to; the user is
    /// the certificate's common name, its groups the organizations.
    #[arg(long, env = "EVPLEG_CLIENT_CA_FILE")]
    pub client_ca_file: Option<PathBuf>,

    /// Requests without credentials are let through as system:anonymous
    /// (then authorized); `false`: 401.
    #[arg(long, env = "EVPLEG_ANONYMOUS_AUTH", default_value_t = false,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub anonymous_auth: bool,

    /// Bearer tokens are reviewed by the API server (TokenReview).
    #[arg(long, env = "EVPLEG_AUTHENTICATION_TOKEN_WEBHOOK", default_value_t = true,
          num_args = 0..=1, require_equals = true, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub authentication_token_webhook: bool,

    /// How long a token review's answer is kept.
    #[arg(long, env = "EVPLEG_AUTHENTICATION_TOKEN_WEBHOOK_CACHE_TTL", default_value = "2m0s",
          value_parser = duration::parse)]
    pub authentication_token_webhook_cache_ttl: Duration,

    /// How requests are authorized.
    #[arg(long, env = "EVPLEG_AUTHORIZATION_MODE", value_enum,
          default_value_t = AuthorizationModeFlag::Webhook)]
    pub authorization_mode: AuthorizationModeFlag,

    /// How long an allowed access review is kept.
    #[arg(long, env = "EVPLEG_AUTHORIZATION_WEBHOOK_CACHE_AUTHORIZED_TTL", default_value = "5m0s",
          value_parser = duration::parse)]
    pub authorization_webhook_cache_authorized_ttl: Duration,

    /// How long a denied access review is kept.
    #[arg(long, env = "EVPLEG_AUTHORIZATION_WEBHOOK_CACHE_UNAUTHORIZED_TTL", default_value = "30s",
          value_parser = duration::parse)]
    pub authorization_webhook_cache_unauthorized_ttl: Duration,
}

impl KubeletServerArgs {
    /// The authentication and authorization settings for node `node_name`.
    pub fn auth(&self, node_name: &str) -> AuthConfig {
        AuthConfig {
            node_name: node_name.to_owned(),
            anonymous: self.anonymous_auth,
            token_webhook: self.authentication_token_webhook,
            token_ttl: self.authentication_token_webhook_cache_ttl,
            mode: match self.authorization_mode {
                AuthorizationModeFlag::AlwaysAllow => AuthzMode::AlwaysAllow,
                AuthorizationModeFlag::Webhook => AuthzMode::Webhook,
            },
            authorized_ttl: self.authorization_webhook_cache_authorized_ttl,
            unauthorized_ttl: self.authorization_webhook_cache_unauthorized_ttl,
        }
    }
}
