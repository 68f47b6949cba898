//! The little of gRPC's wire format the proxy needs: length-prefixed
//! messages, the status in trailers (or in the headers of a trailers-only
//! answer), and the body type every answer shares. Nothing here touches a
//! message the proxy only forwards.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Frame;
use hyper::header::{HeaderMap, HeaderValue};

/// Any error a body may end with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Every body the proxy sends or forwards.
pub type Body = BoxBody<Bytes, BoxError>;

/// gRPC status codes the proxy answers with itself.
pub const OK: u32 = 0;
pub const RESOURCE_EXHAUSTED: u32 = 8;
pub const UNIMPLEMENTED: u32 = 12;
pub const UNAVAILABLE: u32 = 14;

/// The method of a CRI path: `RuntimeService/ContainerStatus` from
/// `/runtime.v1.RuntimeService/ContainerStatus`; `None` for another package
/// (v1alpha2, health, reflection: forwarded without a look).
pub fn cri_method(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/runtime.v1.")?;
    (rest.starts_with("RuntimeService/") || rest.starts_with("ImageService/")).then_some(rest)
}

/// One message in gRPC's framing (not compressed).
pub fn frame(message: &impl prost::Message) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    message
        .encode(&mut buf)
        .expect("a buffer sized by encoded_len holds the message");
    buf.freeze()
}

/// The single message of a unary body; `None` when the body is not exactly
/// one uncompressed message that decodes as `M` (then it is forwarded as it
/// came).
pub fn unary<M: prost::Message + Default>(mut body: &[u8]) -> Option<M> {
    if body.len() < 5 || body[0] != 0 {
        return None;
    }
    body.advance(1);
    let len = body.get_u32() as usize;
    if body.len() != len {
        return None;
    }
    M::decode(body).ok()
}

/// The gRPC status of an answer: from its trailers, else from its headers
/// (a trailers-only answer).
pub fn status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<u32> {
    trailers
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"))
        .and_then(|v| v.to_str().ok()?.parse().ok())
}

/// Trailers carrying `code` and `message`.
pub fn trailers(code: u32, message: &str) -> HeaderMap {
    let mut t = HeaderMap::new();
    t.insert("grpc-status", HeaderValue::from(code));
    if !message.is_empty() {
        // grpc-message is percent-encoded; ours are ASCII without `%`.
        let clean: String = message
            .chars()
            .map(|c| {
                if c.is_ascii_graphic() || c == ' ' {
                    c
                } else {
                    '?'
                }
            })
            .collect();
        if let Ok(v) = HeaderValue::from_str(&clean.replace('%', "%25")) {
            t.insert("grpc-message", v);
        }
    }
    t
}

/// A body of `data` then `trailers`. Without either it is an empty body that
/// says so ([`hyper::body::Body::is_end_stream`]): the answer's HEADERS frame
/// then carries END_STREAM, which makes it a trailers-only answer. grpc-go
/// (the kubelet, crictl) reads a status in headers only from such a frame; a
/// status in headers followed by an empty DATA frame that ends the stream is
/// `Internal: server closed the stream without sending trailers` to it
/// (tonic accepts both).
pub fn body(data: Option<Bytes>, trailers: Option<HeaderMap>) -> Body {
    if data.is_none() && trailers.is_none() {
        return http_body_util::Empty::new()
            .map_err(|never| match never {})
            .boxed();
    }
    let frames = data
        .into_iter()
        .map(Frame::data)
        .chain(trailers.map(Frame::trailers))
        .map(Ok::<_, BoxError>);
    http_body_util::StreamBody::new(futures::stream::iter(frames)).boxed()
}

/// A trailers-only error answer: `code` and `message` in the headers, which
/// end the stream.
pub fn error_response(code: u32, message: &str) -> hyper::Response<Body> {
    let mut resp = hyper::Response::new(body(None, None));
    resp.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    resp.headers_mut().extend(trailers(code, message));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use evpleg_cri_api::v1;

    #[test]
    fn frames_round_trip_and_odd_bodies_are_left_alone() {
        let msg = v1::ContainerStatusRequest {
            container_id: "abc".into(),
            verbose: true,
        };
        let framed = frame(&msg);
        assert_eq!(unary::<v1::ContainerStatusRequest>(&framed), Some(msg));
        // Compressed, truncated, two messages: not decoded.
        let mut compressed = framed.to_vec();
        compressed[0] = 1;
        assert_eq!(unary::<v1::ContainerStatusRequest>(&compressed), None);
        assert_eq!(unary::<v1::ContainerStatusRequest>(&framed[..6]), None);
        let two = [&framed[..], &framed[..]].concat();
        assert_eq!(unary::<v1::ContainerStatusRequest>(&two), None);
    }

    /// Issue #26: an answer with no message and no trailers is an empty body
    /// that reports its end, so hyper sets END_STREAM on the headers; a
    /// stream of no frames did not, and grpc-go took the status for missing.
    #[test]
    fn a_trailers_only_answer_ends_with_its_headers() {
        use hyper::body::Body as _;
        assert!(body(None, None).is_end_stream());
        assert!(error_response(UNAVAILABLE, "gone").body().is_end_stream());
        assert!(!body(Some(Bytes::from_static(b"x")), None).is_end_stream());
        assert!(!body(None, Some(trailers(OK, ""))).is_end_stream());
    }

    #[test]
    fn methods_and_statuses() {
        assert_eq!(
            cri_method("/runtime.v1.RuntimeService/ContainerStatus"),
            Some("RuntimeService/ContainerStatus")
        );
        assert_eq!(cri_method("/runtime.v1alpha2.RuntimeService/Version"), None);
        assert_eq!(cri_method("/grpc.health.v1.Health/Check"), None);
        let mut h = HeaderMap::new();
        assert_eq!(status(&h, None), None);
        h.insert("grpc-status", HeaderValue::from(5u32));
        assert_eq!(status(&h, None), Some(5));
        assert_eq!(status(&h, Some(&trailers(OK, ""))), Some(OK));
        assert_eq!(
            trailers(UNAVAILABLE, "down 100%")["grpc-message"],
            "down 100%25"
        );
    }
}
