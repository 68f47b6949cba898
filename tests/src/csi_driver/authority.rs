//! The registration socket's relay: the test driver's registration service
//! behind a relay that gives every request the `:authority` `localhost`.
//!
//! The stock kubelet dials a plugin's registration socket by its bare path
//! (1.37's `pluginmanager/operationexecutor` `dial`, with no
//! `grpc.WithAuthority`, which its CSI client got in kubernetes#112597), so
//! grpc-go sends the socket's path as the HTTP/2 `:authority`
//! (kubernetes#108254). h2, under tonic, refuses such a request
//! (`malformed authority`, RST_STREAM PROTOCOL_ERROR): the kubelet never
//! registered this driver. A driver is normally registered by the Go sidecar
//! node-driver-registrar, which accepts any authority; this relay stands in
//! for that leniency, as Rust drivers do in front of their registration
//! socket. Found by the differential harness's first CSI case (issue #31).
//!
//! The relay reads the client's frames: each header block (a HEADERS frame
//! and its CONTINUATIONs) is decoded with the client's HPACK context,
//! `:authority` replaced, and encoded again with the relay's own context,
//! which the server's decoder follows (one HEADERS frame, its padding and
//! priority dropped); every other frame, and all the server sends, pass
//! unchanged.

use std::io;
use std::path::Path;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

/// What every relayed request's `:authority` becomes.
pub const AUTHORITY: &[u8] = b"localhost";

/// The client connection preface's length (RFC 9113, 3.4).
const PREFACE: usize = 24;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame the relay writes (the default SETTINGS_MAX_FRAME_SIZE).
const MAX_FRAME: usize = 16_384;

/// Relays each connection of `listener` to the server at `server` until
/// `shutdown`.
pub async fn serve(listener: UnixListener, server: &Path, shutdown: CancellationToken) {
    loop {
        let client = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(e) => {
                    tracing::warn!("registration relay: accept: {e}");
                    continue;
                }
            },
            () = shutdown.cancelled() => return,
        };
        let server = server.to_owned();
        tokio::spawn(async move {
            let upstream = match UnixStream::connect(&server).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(path = %server.display(), "registration relay: connect: {e}");
                    return;
                }
            };
            let (client_read, mut client_write) = client.into_split();
            let (mut server_read, server_write) = upstream.into_split();
            let requests = relay_requests(client_read, server_write);
            let responses = tokio::io::copy(&mut server_read, &mut client_write);
            let (a, b) = tokio::join!(requests, responses);
            for e in [a.err(), b.err()].into_iter().flatten() {
                tracing::debug!("registration relay: connection ended: {e}");
            }
        });
    }
}

/// Copies the client's preface and frames from `from` to `to`, each header
/// block with its `:authority` replaced ([`AUTHORITY`]).
pub async fn relay_requests(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
) -> io::Result<()> {
    let mut preface = [0u8; PREFACE];
    from.read_exact(&mut preface).await?;
    to.write_all(&preface).await?;
    let mut rewriter = Rewriter::default();
    // A header block under way: its stream, its END_STREAM flag, its bytes.
    let mut block: Option<(u32, u8, Vec<u8>)> = None;
    loop {
        let mut head = [0u8; 9];
        match from.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return to.shutdown().await,
            Err(e) => return Err(e),
        }
        let (len, kind, flags, stream) = parse_head(&head);
        let mut payload = vec![0u8; len];
        from.read_exact(&mut payload).await?;
        match kind {
            HEADERS => {
                let fragment = fragment(&payload, flags)?;
                block = Some((stream, flags & END_STREAM, fragment.to_vec()));
            }
            CONTINUATION => match &mut block {
                Some((s, _, bytes)) if *s == stream => bytes.extend_from_slice(&payload),
                _ => return Err(invalid("a CONTINUATION frame without its HEADERS")),
            },
            _ => {
                to.write_all(&head).await?;
                to.write_all(&payload).await?;
                continue;
            }
        }
        if flags & END_HEADERS != 0
            && let Some((stream, end_stream, bytes)) = block.take()
        {
            let encoded = rewriter.rewrite(&bytes)?;
            to.write_all(&frame_head(
                encoded.len(),
                END_HEADERS | end_stream,
                stream,
            )?)
            .await?;
            to.write_all(&encoded).await?;
        }
    }
}

/// A HEADERS frame's header block fragment: its padding and priority fields
/// dropped.
fn fragment(payload: &[u8], flags: u8) -> io::Result<&[u8]> {
    let mut rest = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        let (&n, tail) = rest
            .split_first()
            .ok_or_else(|| invalid("a short HEADERS frame"))?;
        pad = n as usize;
        rest = tail;
    }
    if flags & PRIORITY != 0 {
        rest = rest
            .get(5..)
            .ok_or_else(|| invalid("a short HEADERS frame"))?;
    }
    let end = rest
        .len()
        .checked_sub(pad)
        .ok_or_else(|| invalid("a HEADERS frame's padding longer than it"))?;
    Ok(&rest[..end])
}

/// A frame header's length, kind, flags and stream (RFC 9113, 4.1).
fn parse_head(head: &[u8; 9]) -> (usize, u8, u8, u32) {
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    (len, head[3], head[4], stream)
}

fn frame_head(len: usize, flags: u8, stream: u32) -> io::Result<[u8; 9]> {
    if len > MAX_FRAME {
        return Err(invalid("a header block longer than one frame"));
    }
    let l = (len as u32).to_be_bytes();
    let s = stream.to_be_bytes();
    Ok([l[1], l[2], l[3], HEADERS, flags, s[0], s[1], s[2], s[3]])
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("registration relay: {what}"),
    )
}

/// The two HPACK contexts of a relayed connection: the client's, decoded,
/// and the relay's own, encoded.
#[derive(Default)]
struct Rewriter {
    decoder: fluke_hpack::Decoder<'static>,
    encoder: fluke_hpack::Encoder<'static>,
}

impl Rewriter {
    /// Header block `bytes` with its `:authority` replaced.
    fn rewrite(&mut self, bytes: &[u8]) -> io::Result<Vec<u8>> {
        let headers = self
            .decoder
            .decode(bytes)
            .map_err(|e| invalid(&format!("an undecodable header block: {e:?}")))?;
        let headers = headers.iter().map(|(name, value)| {
            let value = if name == b":authority" {
                AUTHORITY
            } else {
                &value[..]
            };
            (&name[..], value)
        });
        Ok(self.encoder.encode(headers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame as the relay reads it.
    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = frame_head(payload.len(), flags, stream)
            .expect("small")
            .to_vec();
        f[3] = kind;
        f.extend_from_slice(payload);
        f
    }

    /// The frames of `bytes` (the relay's output after the preface):
    /// `(kind, flags, stream, payload)`.
    fn frames(bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut frames = Vec::new();
        let mut rest = &bytes[PREFACE..];
        while !rest.is_empty() {
            let head: &[u8; 9] = rest[..9].try_into().expect("a frame header");
            let (len, kind, flags, stream) = parse_head(head);
            frames.push((kind, flags, stream, rest[9..9 + len].to_vec()));
            rest = &rest[9 + len..];
        }
        frames
    }

    // Two requests of one connection, as grpc-go sends them: the second
    // names the path only by its dynamic table index; one block split into a
    // padded HEADERS and a CONTINUATION; other frames untouched.
    #[tokio::test]
    async fn every_request_gets_localhost_and_the_rest_passes() {
        let path = b"/var/lib/kubelet/plugins_registry/x-reg.sock";
        let mut client = fluke_hpack::Encoder::new();
        let request: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", path),
            (b"content-type", b"application/grpc"),
        ];
        // grpc-go indexes the path (literal with incremental indexing of the
        // static name 1, `:authority`), then names it by its dynamic index 62.
        let mut block = |authority: &[u8]| {
            let mut b = client.encode(request[..3].iter().copied());
            b.extend_from_slice(authority);
            b.extend(client.encode(request[4..].iter().copied()));
            b
        };
        let first = block(&[&[0x41, path.len() as u8][..], path].concat());
        let second = block(&[0x80 | 62]);
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        input.extend(frame(HEADERS, END_HEADERS, 1, &first));
        input.extend(frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0])); // DATA
        let (head, tail) = second.split_at(1);
        let mut padded = vec![2u8];
        padded.extend_from_slice(head);
        padded.extend_from_slice(&[0, 0]);
        input.extend(frame(HEADERS, PADDED | END_STREAM, 3, &padded));
        input.extend(frame(CONTINUATION, END_HEADERS, 3, tail));
        let mut output = Vec::new();
        relay_requests(&input[..], &mut output)
            .await
            .expect("relayed");
        assert_eq!(output[..PREFACE], input[..PREFACE]);
        let expected: Vec<(Vec<u8>, Vec<u8>)> = request
            .iter()
            .map(|(n, v)| {
                let v = if *n == b":authority" { AUTHORITY } else { *v };
                (n.to_vec(), v.to_vec())
            })
            .collect();
        let mut server = fluke_hpack::Decoder::new();
        let seen: Vec<(u8, u8, u32)> = frames(&output)
            .into_iter()
            .map(|(kind, flags, stream, payload)| {
                if kind == HEADERS {
                    assert_eq!(server.decode(&payload).expect("decodable"), expected);
                }
                (kind, flags, stream)
            })
            .collect();
        assert_eq!(
            seen,
            [
                (0x4, 0, 0),
                (HEADERS, END_HEADERS, 1),
                (0x0, END_STREAM, 1),
                (HEADERS, END_HEADERS | END_STREAM, 3),
            ]
        );
    }

    #[tokio::test]
    async fn a_continuation_without_its_headers_is_refused() {
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(CONTINUATION, END_HEADERS, 1, &[0x82]));
        let err = relay_requests(&input[..], Vec::new())
            .await
            .expect_err("refused");
        assert!(err.to_string().contains("CONTINUATION"), "{err}");
    }
}
