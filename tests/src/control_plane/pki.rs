//! The certificates of a test control plane, made at test time by Debian's
//! `openssl` (as [`crate::tls`] makes the probe tests' certificate): a CA, the
//! API server's serving certificate (for `127.0.0.1` and `localhost`), client
//! certificates (an admin in `system:masters`, a node as
//! `system:node:<name>` in `system:nodes`, as the kubelet's TLS bootstrap
//! would give it), the service-account signing key, and kubeconfig files that
//! name them by path. EC P-256 keys throughout: fast to make, and read by
//! etcd, the API server and rustls alike.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::ControlPlaneError;

/// A certificate and its key, as PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA in a directory, issuing certificates into it.
#[derive(Clone, Debug)]
pub struct Pki {
    dir: PathBuf,
    ca: Issued,
}

impl Pki {
    /// Makes a CA in `dir` (created if missing).
    pub fn create(dir: &Path) -> Result<Self, ControlPlaneError> {
        std::fs::create_dir_all(dir).map_err(|e| ControlPlaneError::io("create", dir, e))?;
        let ca = Issued {
            cert: dir.join("ca.crt"),
            key: dir.join("ca.key"),
        };
        openssl(
            Command::new("openssl")
                .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
                .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
                .args(["-subj", "/CN=evpleg-test-ca"])
                .args(["-addext", "basicConstraints=critical,CA:TRUE"])
                .args([
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
                ])
                .arg("-keyout")
                .arg(&ca.key)
                .arg("-out")
                .arg(&ca.cert),
            "the CA",
        )?;
        Ok(Self {
            dir: dir.to_owned(),
            ca,
        })
    }

    /// The CA's certificate and key.
    pub fn ca(&self) -> &Issued {
        &self.ca
    }

    /// A certificate signed by the CA for `subject` (`/O=.../CN=...`), written
    /// as `<file>.crt` and `<file>.key`: a client certificate, or a serving one
    /// for `sans` (`IP:127.0.0.1`, `DNS:localhost`) when there are any.
    pub fn issue(
        &self,
        file: &str,
        subject: &str,
        sans: &[&str],
    ) -> Result<Issued, ControlPlaneError> {
        let issued = Issued {
            cert: self.dir.join(format!("{file}.crt")),
            key: self.dir.join(format!("{file}.key")),
        };
        let mut cmd = Command::new("openssl");
        cmd.args(["req", "-x509", "-CA"])
            .arg(&self.ca.cert)
            .arg("-CAkey")
            .arg(&self.ca.key)
            .args(["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"])
            .args(["-nodes", "-days", "2", "-subj", subject])
            .args(["-addext", "basicConstraints=critical,CA:FALSE"])
            .args([
                "-addext",
                "keyUsage=critical,digitalSignature,keyEncipherment",
            ]);
        if sans.is_empty() {
            cmd.args(["-addext", "extendedKeyUsage=clientAuth"]);
        } else {
            cmd.args(["-addext", "extendedKeyUsage=serverAuth,clientAuth"])
                .arg("-addext")
                .arg(format!("subjectAltName={}", sans.join(",")));
        }
        cmd.arg("-keyout")
            .arg(&issued.key)
            .arg("-out")
            .arg(&issued.cert);
        openssl(&mut cmd, subject)?;
        Ok(issued)
    }

    /// The client certificate of node `node`: `CN=system:node:<node>`,
    /// `O=system:nodes`, what the Node authorizer and NodeRestriction know a
    /// kubelet by.
    pub fn node(&self, node: &str) -> Result<Issued, ControlPlaneError> {
        self.issue(
            &format!("node-{node}"),
            &format!("/O=system:nodes/CN=system:node:{node}"),
            &[],
        )
    }

    /// An EC key pair for service-account tokens, as `<file>.key` (the
    /// private key, `--service-account-signing-key-file`) and `<file>.pub`
    /// (its public key, `--service-account-key-file`, which takes public keys
    /// only).
    pub fn signing_key(&self, file: &str) -> Result<Issued, ControlPlaneError> {
        let pair = Issued {
            cert: self.dir.join(format!("{file}.pub")),
            key: self.dir.join(format!("{file}.key")),
        };
        openssl(
            Command::new("openssl")
                .args(["genpkey", "-algorithm", "EC", "-pkeyopt"])
                .args(["ec_paramgen_curve:P-256", "-out"])
                .arg(&pair.key),
            "the service-account signing key",
        )?;
        openssl(
            Command::new("openssl")
                .args(["pkey", "-pubout", "-in"])
                .arg(&pair.key)
                .arg("-out")
                .arg(&pair.cert),
            "the service-account public key",
        )?;
        Ok(pair)
    }
}

/// Runs one `openssl` command; its stderr in the error.
fn openssl(cmd: &mut Command, what: &str) -> Result<(), ControlPlaneError> {
    let out = cmd.output().map_err(|e| ControlPlaneError::Openssl {
        what: what.to_owned(),
        message: format!(
            "cannot run openssl (Debian's package, installed by cargo xtask setup): {e}"
        ),
    })?;
    if out.status.success() {
        return Ok(());
    }
    Err(ControlPlaneError::Openssl {
        what: what.to_owned(),
        message: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
    })
}

/// A kubeconfig for `server` trusting `ca`, authenticating as `user` with
/// its client certificate (files named by path, so the agent reads them as
/// the kubelet reads its rotated certificate).
pub fn kubeconfig(server: &str, ca: &Path, user: &str, identity: &Issued) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: evpleg-test
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: {user}
  user:
    client-certificate: {cert}
    client-key: {key}
contexts:
- name: {user}@evpleg-test
  context:
    cluster: evpleg-test
    user: {user}
current-context: {user}@evpleg-test
",
        ca = ca.display(),
        cert = identity.cert.display(),
        key = identity.key.display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!(
            "evpleg-pki-{name}-{}-{:x}",
            std::process::id(),
            crate::unique_u64()
        ))
    }

    fn text(cert: &Path) -> String {
        let out = Command::new("openssl")
            .args(["x509", "-noout", "-text", "-in"])
            .arg(cert)
            .output()
            .expect("openssl x509");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn verify(ca: &Path, cert: &Path) -> bool {
        Command::new("openssl")
            .arg("verify")
            .arg("-CAfile")
            .arg(ca)
            .arg(cert)
            .output()
            .expect("openssl verify")
            .status
            .success()
    }

    #[test]
    fn pki_issues_node_admin_and_serving_certificates_the_ca_signed() {
        let d = dir("issue");
        let pki = Pki::create(&d).expect("a CA");
        let node = pki.node("n1").expect("a node certificate");
        let admin = pki
            .issue("admin", "/O=system:masters/CN=evpleg-admin", &[])
            .expect("an admin certificate");
        let serving = pki
            .issue(
                "apiserver",
                "/CN=kube-apiserver",
                &["IP:127.0.0.1", "DNS:localhost"],
            )
            .expect("a serving certificate");
        for cert in [&node.cert, &admin.cert, &serving.cert] {
            assert!(verify(&pki.ca().cert, cert), "{}", cert.display());
        }
        let node_text = text(&node.cert);
        assert!(
            node_text.contains("Subject: O = system:nodes, CN = system:node:n1"),
            "{node_text}"
        );
        assert!(
            node_text.contains("TLS Web Client Authentication"),
            "{node_text}"
        );
        assert!(
            !node_text.contains("TLS Web Server Authentication"),
            "{node_text}"
        );
        assert!(text(&admin.cert).contains("O = system:masters, CN = evpleg-admin"));
        let serving_text = text(&serving.cert);
        assert!(
            serving_text.contains("IP Address:127.0.0.1, DNS:localhost"),
            "{serving_text}"
        );
        assert!(
            serving_text.contains("TLS Web Server Authentication"),
            "{serving_text}"
        );
        // A certificate signed by another CA does not verify: the check can fail.
        let other = Pki::create(&d.join("other")).expect("another CA");
        assert!(!verify(&other.ca().cert, &node.cert));
        let pair = pki.signing_key("sa").expect("a signing key");
        let pem = std::fs::read_to_string(&pair.key).expect("the key");
        assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----"), "{pem}");
        let public = std::fs::read_to_string(&pair.cert).expect("the public key");
        assert!(public.starts_with("-----BEGIN PUBLIC KEY-----"), "{public}");
        std::fs::remove_dir_all(&d).expect("remove the test directory");
    }

    #[test]
    fn pki_names_the_subject_that_openssl_refused() {
        let d = dir("refused");
        let pki = Pki::create(&d).expect("a CA");
        let err = pki
            .issue("bad", "not-a-subject", &[])
            .expect_err("a subject without a leading slash");
        let text = err.to_string();
        assert!(
            text.contains("openssl") && text.contains("not-a-subject"),
            "{text}"
        );
        std::fs::remove_dir_all(&d).expect("remove the test directory");
    }

    #[tokio::test]
    async fn pki_kubeconfig_gives_kube_the_server_the_ca_and_the_identity() {
        let d = dir("kubeconfig");
        let pki = Pki::create(&d).expect("a CA");
        let node = pki.node("n1").expect("a node certificate");
        let yaml = kubeconfig(
            "https://127.0.0.1:6443",
            &pki.ca().cert,
            "system:node:n1",
            &node,
        );
        let path = d.join("kubeconfig");
        std::fs::write(&path, &yaml).expect("write the kubeconfig");
        let kc = kube::config::Kubeconfig::read_from(&path).expect("kube reads it");
        let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("a client configuration");
        assert_eq!(config.cluster_url.to_string(), "https://127.0.0.1:6443/");
        assert_eq!(config.root_cert.as_ref().map(Vec::len), Some(1), "the CA");
        let auth = &config.auth_info;
        assert_eq!(
            auth.client_certificate.as_deref(),
            Some(node.cert.to_str().expect("utf-8"))
        );
        assert_eq!(
            auth.client_key.as_deref(),
            Some(node.key.to_str().expect("utf-8"))
        );
        // kube builds a TLS client from it (the key is one rustls reads).
        kube::Client::try_from(config).expect("a client with the node's identity");
        std::fs::remove_dir_all(&d).expect("remove the test directory");
    }
}
