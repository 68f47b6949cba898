//! The kubelet's authenticated server (issue #28) end to end: the whole agent
//! against the real containerd and the real kube-apiserver, its server on a
//! free port on loopback with the control plane's CA as `--client-ca-file`.
//! Requests made straight to it (with a token, the admin's client
//! certificate, nothing) are authenticated and authorized by the API server
//! (TokenReview, SubjectAccessReview, read back from its audit log); the real
//! `kubectl logs` reaches it through the API server, which finds it by the
//! Node's InternalIP and daemonEndpoints. Privileged: skipped with a reason
//! without root/BTF/the eBPF object, the control plane's binaries or kubectl,
//! a failure under `CI=true`.
//!
//! Every wait is bounded; nothing sleeps to synchronise.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use evpleg_tests::e2e::*;
use evpleg_tests::privileged;
use http_body_util::{BodyExt, Empty};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Api;
use kube::api::PostParams;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// Whether the test can run here.
fn real(test: &str) -> bool {
    if !privileged(test) || !evpleg_tests::control_plane::available(test) {
        return false;
    }
    if let Err(e) = evpleg_tests::go_tools::binary("kubectl") {
        evpleg_tests::skip(test, &e.to_string());
        return false;
    }
    true
}

/// The agent with its kubelet server on a free loopback port (the harness's
/// `--port 0 --address 127.0.0.1`), client certificates checked against the
/// control plane's CA.
async fn start(name: &str) -> E2e {
    let cp = evpleg_tests::control_plane::ControlPlane::shared().await;
    let ca = cp.ca().display().to_string();
    E2e::start_with_control_plane(name, &["--node-ip", "127.0.0.1", "--client-ca-file", &ca]).await
}

/// Accepts exactly the agent's certificate.
#[derive(Debug)]
struct Pinned(CertificateDer<'static>);

impl rustls::client::danger::ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.0.as_ref() {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General("not the agent's certificate".into()))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &rustls::crypto::ring::default_provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::ring::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// How a request to the kubelet server authenticates.
enum Cred<'a> {
    None,
    Token(&'a str),
    /// A client certificate and its key (PEM files).
    Cert(&'a Path, &'a Path),
}

/// `GET path` on the agent's kubelet server: its status and body.
async fn get(e: &E2e, path: &str, cred: Cred<'_>) -> (u16, String) {
    request(e, "GET", path, cred).await
}

/// A TLS connection to the agent's kubelet server (its certificate pinned),
/// with `cred`'s client certificate when it is one. With TLS 1.3 a client
/// certificate the server refuses shows at the first read, not here.
async fn connect(
    e: &E2e,
    cred: &Cred<'_>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let addr = e.agent().kubelet_addr.expect("the kubelet server runs");
    let pinned = CertificateDer::from_pem_file(e.args.root_dir.join("pki/kubelet.crt"))
        .expect("the agent's self-signed certificate in <root-dir>/pki");
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("tls versions")
    .dangerous()
    .with_custom_certificate_verifier(Arc::new(Pinned(pinned)));
    let config = match cred {
        Cred::Cert(cert, key) => builder
            .with_client_auth_cert(
                CertificateDer::pem_file_iter(cert)
                    .expect("cert")
                    .collect::<Result<Vec<_>, _>>()
                    .expect("cert"),
                PrivateKeyDer::from_pem_file(key).expect("key"),
            )
            .expect("client auth"),
        _ => builder.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("kubelet").expect("a name"), tcp)
        .await
}

/// `method path` on the agent's kubelet server: its status and body.
async fn request(e: &E2e, method: &str, path: &str, cred: Cred<'_>) -> (u16, String) {
    let tls = connect(e, &cred).await.expect("tls handshake");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .expect("http handshake");
    tokio::spawn(conn);
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "kubelet");
    if let Cred::Token(t) = cred {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = tokio::time::timeout(
        DEADLINE,
        sender.send_request(req.body(Empty::<Bytes>::new()).expect("a request")),
    )
    .await
    .expect("an answer in time")
    .expect("an answer");
    let code = resp.status().as_u16();
    let body = tokio::time::timeout(DEADLINE, resp.into_body().collect())
        .await
        .expect("the body in time")
        .expect("the body")
        .to_bytes();
    (code, String::from_utf8_lossy(&body).into_owned())
}

/// A token of service account `ns/name` (made now), from TokenRequest.
async fn token(client: &kube::Client, ns: &str, name: &str) -> String {
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let account: ServiceAccount =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))
            .expect("an account");
    accounts
        .create(&PostParams::default(), &account)
        .await
        .expect("create the service account");
    let request: TokenRequest =
        serde_json::from_value(serde_json::json!({"spec": {"audiences": []}})).expect("a request");
    let answer: TokenRequest = accounts
        .create_subresource("token", name, &PostParams::default(), &request)
        .await
        .expect("TokenRequest");
    answer.status.expect("a token").token
}

/// Lets service account `ns/name` get `nodes/proxy`.
async fn grant_node_proxy(client: &kube::Client, ns: &str, name: &str) {
    let role: ClusterRole = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{ns}-node-proxy")},
        "rules": [{"apiGroups": [""], "resources": ["nodes/proxy"], "verbs": ["get"]}],
    }))
    .expect("a role");
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await
        .expect("create the cluster role");
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{ns}-node-proxy")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": format!("{ns}-node-proxy")},
        "subjects": [{"kind": "ServiceAccount", "namespace": ns, "name": name}],
    }))
    .expect("a binding");
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .expect("create the cluster role binding");
}

/// Waits until pod `default/name` runs.
async fn running(e: &E2e, name: &str) -> Pod {
    e.wait_api(name, "running", |p| {
        p.status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
            })
    })
    .await
}

/// The admin's client certificate and key (system:masters).
fn admin_cert(e: &E2e) -> (PathBuf, PathBuf) {
    let pki = e.cp().dir().join("pki");
    (pki.join("admin.crt"), pki.join("admin.key"))
}

/// SubjectAccessReviews the agent asked for `user` on `nodes/<sub>`.
fn access_reviews(e: &E2e, user: &str, sub: &str) -> usize {
    e.cp()
        .audit()
        .into_iter()
        .filter(|r| r.user == format!("system:node:{NODE}") && r.verb == "create")
        .filter(|r| r.path() == "/apis/authorization.k8s.io/v1/subjectaccessreviews")
        .filter(|r| {
            r.body.as_ref().is_some_and(|b| {
                b["spec"]["user"] == user && b["spec"]["resourceAttributes"]["subresource"] == sub
            })
        })
        .count()
}

/// The Node says where the kubelet server is and what the node is.
async fn wait_node_endpoint(e: &E2e) -> Node {
    let port = i32::from(e.agent().kubelet_addr.expect("serving").port());
    wait_object(
        &Api::<Node>::all(e.kube().await),
        NODE,
        "its kubelet endpoint",
        |n| {
            n.and_then(|n| n.status.as_ref())
                .and_then(|s| s.daemon_endpoints.as_ref())
                .and_then(|d| d.kubelet_endpoint.as_ref())
                .is_some_and(|k| k.port == port)
        },
    )
    .await
    .expect("the node")
}

/// `kubectl <args>` as the admin: its exit status, stdout and stderr.
fn kubectl(e: &E2e, args: &[&str]) -> (bool, String, String) {
    let out =
        std::process::Command::new(evpleg_tests::go_tools::binary("kubectl").expect("kubectl"))
            .arg("--kubeconfig")
            .arg(e.cp().admin_kubeconfig())
            .args(["--request-timeout", "30s", "-n", "default"])
            .args(args)
            .output()
            .expect("run kubectl");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn kubectl_ok(e: &E2e, args: &[&str]) -> String {
    let (ok, out, err) = kubectl(e, args);
    assert!(ok, "kubectl {args:?} failed: {err}");
    out
}

/// `value` is between the two readings around it, widened by `slack`.
fn between(what: &str, value: u64, a: u64, b: u64, slack: u64) {
    let (lo, hi) = (a.min(b).saturating_sub(slack), a.max(b) + slack);
    assert!(
        (lo..=hi).contains(&value),
        "{what}: {value} not within [{lo}, {hi}] (the test read {a} then {b}, slack {slack})"
    );
}

mod auth;
mod logs;
mod stats;
mod streaming;
