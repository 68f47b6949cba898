//! TLS for `scheme: HTTPS` httpGet probes and lifecycle hooks, as the
//! kubelet's `tls.Config{InsecureSkipVerify: true}` (`pkg/probe/http.New`
//! for probes, the lifecycle handlers' insecure client for hooks): the
//! server's certificate is **deliberately not verified** (no chain, no name,
//! no expiry check), because a probe asks a container's own endpoint at its
//! IP, whose certificate is usually self-signed or names a service, not the
//! IP; a probe only learns whether the endpoint answers, never sends a secret
//! the pod did not put in its own spec. The handshake itself is still
//! checked (the server must hold the key of the certificate it shows), as
//! Go's TLS does with `InsecureSkipVerify`. SNI is the request's host when it
//! is a name; an IP address sends none (as Go's client). TLS 1.2 and 1.3
//! with rustls' `ring` provider (the one the URL pod source already uses).
//!
//! A probe offers HTTP/2 by ALPN (`h2`, then `http/1.1`) and speaks it when
//! the server chooses it, as the kubelet's probe transport; a hook offers
//! nothing and speaks HTTP/1.1, as the kubelet's lifecycle client.
//!
//! A server that answers the ClientHello with plain HTTP (its first bytes
//! `HTTP/`) fails the handshake with Go's message, "http: server gave HTTP
//! response to HTTPS client" ([`ConnectError::PlainHttp`]): the kubelet's
//! hooks fall back to http on exactly that error.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A TLS connection to a probed endpoint.
pub type Stream = tokio_rustls::client::TlsStream<Sniff<TcpStream>>;

/// Go's error for a plain-http answer to a TLS ClientHello.
pub const PLAIN_HTTP: &str = "http: server gave HTTP response to HTTPS client";

/// Why a TLS connection could not be made.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConnectError {
    #[error("{PLAIN_HTTP}")]
    PlainHttp,
    #[error("{0}")]
    Failed(String),
}

/// Accepts any certificate, as Go's `InsecureSkipVerify` (see the module
/// doc: deliberate), while still checking the handshake's signatures with the
/// certificate's key.
#[derive(Debug)]
struct AnyCertificate(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// The client configuration, built once per ALPN offer: probes offer `h2`
/// then `http/1.1`, as the kubelet's probe transport (its
/// `SetTransportDefaults` configures HTTP/2); hooks offer none, as the
/// kubelet's lifecycle client (a Go transport with its own TLS config and no
/// HTTP/2 forced).
fn config(h2: bool) -> Result<Arc<ClientConfig>, ConnectError> {
    static CONFIGS: [OnceLock<Result<Arc<ClientConfig>, String>>; 2] =
        [OnceLock::new(), OnceLock::new()];
    CONFIGS[usize::from(h2)]
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let algorithms = provider.signature_verification_algorithms;
            let mut config = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| format!("the probes' tls configuration: {e}"))?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(algorithms)))
                .with_no_client_auth();
            if h2 {
                config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
            }
            Ok(Arc::new(config))
        })
        .clone()
        .map_err(ConnectError::Failed)
}

/// The TLS handshake over `tcp` with `host` (a name, or an IP address),
/// offering HTTP/2 by ALPN if `h2`.
pub async fn connect(tcp: TcpStream, host: &str, h2: bool) -> Result<Stream, ConnectError> {
    let name = ServerName::try_from(host.to_owned())
        .map_err(|e| ConnectError::Failed(format!("tls: server name {host:?}: {e}")))?;
    let connector = tokio_rustls::TlsConnector::from(config(h2)?);
    let sniff = Sniff {
        inner: tcp,
        first: Vec::new(),
    };
    connector
        .connect(name, sniff)
        .into_fallible()
        .await
        .map_err(|(e, sniff)| classify(&sniff.first, e.to_string()))
}

/// Whether the server chose HTTP/2.
pub fn is_h2(stream: &Stream) -> bool {
    stream.get_ref().1.alpn_protocol() == Some(b"h2")
}

/// A failed handshake's error: Go's plain-http one when the server's first
/// bytes were an HTTP response.
fn classify(first: &[u8], error: String) -> ConnectError {
    if first.starts_with(b"HTTP/") {
        ConnectError::PlainHttp
    } else {
        ConnectError::Failed(error)
    }
}

/// A stream keeping the first bytes it read (to name a plain-http server).
#[derive(Debug)]
pub struct Sniff<S> {
    inner: S,
    first: Vec<u8>,
}

/// How many first bytes [`Sniff`] keeps (`HTTP/`).
const SNIFFED: usize = 5;

impl<S: AsyncRead + Unpin> AsyncRead for Sniff<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if this.first.len() < SNIFFED {
            let new = &buf.filled()[before..];
            let take = new.len().min(SNIFFED - this.first.len());
            this.first.extend_from_slice(&new[..take]);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Sniff<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_http_answer_is_named_as_go_names_it() {
        let cases: &[(&[u8], ConnectError)] = &[
            (b"HTTP/", ConnectError::PlainHttp),
            (b"HTTP/1.1 400", ConnectError::PlainHttp),
            (
                b"\x15\x03\x03\x00\x02",
                ConnectError::Failed("received fatal alert".into()),
            ),
            (b"HTTP", ConnectError::Failed("received fatal alert".into())),
            (b"", ConnectError::Failed("received fatal alert".into())),
        ];
        for (first, want) in cases {
            assert_eq!(
                &classify(first, "received fatal alert".into()),
                want,
                "{first:?}"
            );
        }
        assert_eq!(
            ConnectError::PlainHttp.to_string(),
            "http: server gave HTTP response to HTTPS client"
        );
    }
}
