//! Lies told on the wire: a tower layer in front of the gRPC services that, for an RPC with a
//! `lie RPC:garbage` or `lie RPC:bad-utf8` fault, lets the RPC do its work and then rewrites
//! the encoded reply, so the CO receives bytes no honest encoder produces.
//!
//! A gRPC reply body is length-prefixed messages (a compression flag byte, a 4-byte
//! big-endian length, the message) followed by trailers carrying `grpc-status`. Only an
//! uncompressed reply holding exactly one message is rewritten; an error reply (no message)
//! passes untouched. The trailers are kept, so the reply still says OK: only the message is
//! wrong.
//!
//! - `garbage`: the message becomes a key with wire type 7, which no protobuf decoder accepts.
//! - `bad-utf8`: the real message is kept and a string field is appended whose bytes are not
//!   UTF-8 (a repeated scalar field's last value wins and embedded messages merge, so the
//!   appended field overrides the real one, and a decoder must check it).

use csi_isolator::error_chain::Chain;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http_body::{Body as _, Frame};
use tonic::body::Body;
use tonic::codegen::http::{HeaderMap, Request, Response};
use tonic::codegen::{Bytes, Service};

use super::faults::LieMode;
use super::Plugin;

/// Header of one gRPC message: compression flag and length.
const PREFIX_LEN: usize = 5;

/// The layer wrapping every service of a plugin.
#[derive(Clone, Debug)]
pub(crate) struct WireLiesLayer {
    plugin: Arc<Plugin>,
}

impl WireLiesLayer {
    pub(crate) fn new(plugin: Arc<Plugin>) -> WireLiesLayer {
        WireLiesLayer { plugin }
    }
}

impl<S> tower::Layer<S> for WireLiesLayer {
    type Service = WireLies<S>;

    fn layer(&self, inner: S) -> WireLies<S> {
        WireLies {
            inner,
            plugin: self.plugin.clone(),
        }
    }
}

/// The service of [`WireLiesLayer`].
#[derive(Clone, Debug)]
pub(crate) struct WireLies<S> {
    inner: S,
    plugin: Arc<Plugin>,
}

impl<S> Service<Request<Body>> for WireLies<S>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // `/csi.v1.Node/NodeStageVolume` -> `NodeStageVolume`.
        let rpc = request
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let lie = self
            .plugin
            .faults
            .reply_lie(&rpc)
            .filter(|m| m.on_the_wire());
        // The service that was polled ready serves this call; a clone takes its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let response = inner.call(request).await?;
            match lie {
                None => Ok(response),
                Some(mode) => Ok(rewrite(response, &rpc, mode).await),
            }
        })
    }
}

/// Reads the whole reply and rewrites its message per `mode`.
async fn rewrite(response: Response<Body>, rpc: &str, mode: LieMode) -> Response<Body> {
    let (parts, mut body) = response.into_parts();
    let mut data = Vec::new();
    let mut trailers = None;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(status) => {
                // The reply broke by itself; pass on what it was.
                tracing::warn!(rpc, error = %Chain(&status), "lie fault: reply body failed; not rewritten");
                return Response::from_parts(parts, Body::new(Replay::new(data, trailers)));
            }
        };
        match frame.into_data() {
            Ok(chunk) => data.extend_from_slice(&chunk),
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    trailers = Some(t);
                }
            }
        }
    }
    let data = match single_message(&data) {
        Some(message) => {
            tracing::warn!(
                rpc,
                mode = mode.as_str(),
                "lie fault: rewriting the encoded reply"
            );
            frame_message(&lie_message(message, rpc, mode))
        }
        None => data,
    };
    Response::from_parts(parts, Body::new(Replay::new(data, trailers)))
}

/// The message of a body holding one uncompressed gRPC message, if that is what it holds.
fn single_message(data: &[u8]) -> Option<&[u8]> {
    let (prefix, message) = data.split_at_checked(PREFIX_LEN)?;
    let len = u32::from_be_bytes(prefix[1..].try_into().ok()?);
    (prefix[0] == 0 && usize::try_from(len).ok()? == message.len()).then_some(message)
}

/// One uncompressed gRPC message frame.
fn frame_message(message: &[u8]) -> Vec<u8> {
    let len = u32::try_from(message.len()).expect("a lie fits in a gRPC frame");
    let mut out = Vec::with_capacity(PREFIX_LEN + message.len());
    out.push(0);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// A length-delimited field (wire type 2).
fn field(number: u8, bytes: &[u8]) -> Vec<u8> {
    let len = u8::try_from(bytes.len()).expect("short field");
    assert!(number < 16 && len < 128, "one-byte key and length");
    let mut out = vec![(number << 3) | 2, len];
    out.extend_from_slice(bytes);
    out
}

/// The lying message for `rpc`'s real `message`.
fn lie_message(message: &[u8], rpc: &str, mode: LieMode) -> Vec<u8> {
    /// Not UTF-8: a lone continuation byte and a byte that never occurs in UTF-8.
    const NOT_UTF8: &[u8] = b"v\x80\xff";
    match mode {
        // Field 1, wire type 7: no such wire type.
        LieMode::Garbage => vec![(1 << 3) | 7, 0xde, 0xad, 0xbe, 0xef],
        LieMode::BadUtf8 => {
            let appended = match rpc {
                // CreateVolumeResponse.volume (1) -> Volume.volume_id (2).
                "CreateVolume" => field(1, &field(2, NOT_UTF8)),
                // ControllerPublishVolumeResponse.publish_context (1): a map entry whose
                // value (2) is not UTF-8.
                "ControllerPublishVolume" => {
                    field(1, &[field(1, b"k"), field(2, NOT_UTF8)].concat())
                }
                // GetPluginInfoResponse.name (1), NodeGetInfoResponse.node_id (1).
                _ => field(1, NOT_UTF8),
            };
            [message, &appended].concat()
        }
        _ => message.to_vec(),
    }
}

/// A body that plays back one data frame and the trailers.
struct Replay {
    frames: VecDeque<Frame<Bytes>>,
}

impl Replay {
    fn new(data: Vec<u8>, trailers: Option<HeaderMap>) -> Replay {
        let mut frames = VecDeque::new();
        if !data.is_empty() {
            frames.push_back(Frame::data(Bytes::from(data)));
        }
        if let Some(trailers) = trailers {
            frames.push_back(Frame::trailers(trailers));
        }
        Replay { frames }
    }
}

impl http_body::Body for Replay {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.frames.pop_front().map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use csi_isolator::csi::proto;

    #[test]
    fn frames_round_trip_and_odd_bodies_are_left_alone() {
        let framed = frame_message(b"abc");
        assert_eq!(framed, b"\0\0\0\0\x03abc");
        assert_eq!(single_message(&framed), Some(&b"abc"[..]));
        assert_eq!(single_message(b""), None);
        assert_eq!(single_message(b"\x01\0\0\0\x01a"), None, "compressed");
        assert_eq!(single_message(b"\0\0\0\0\x02a"), None, "short");
        assert_eq!(
            single_message(b"\0\0\0\0\x00"),
            Some(&b""[..]),
            "empty message"
        );
    }

    #[test]
    fn garbage_does_not_decode() {
        let err = proto::NodeStageVolumeResponse::decode(
            &lie_message(b"", "NodeStageVolume", LieMode::Garbage)[..],
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "failed to decode Protobuf message: invalid wire type value: 7"
        );
    }

    #[test]
    fn bad_utf8_lands_in_a_string_field_of_each_reply() {
        let real = proto::CreateVolumeResponse {
            volume: Some(proto::Volume {
                volume_id: "vol-1".into(),
                capacity_bytes: 4096,
                ..Default::default()
            }),
        }
        .encode_to_vec();
        // The real message decodes; with the appended field, it does not.
        proto::CreateVolumeResponse::decode(&real[..]).unwrap();
        let err = proto::CreateVolumeResponse::decode(
            &lie_message(&real, "CreateVolume", LieMode::BadUtf8)[..],
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .ends_with("invalid string value: data is not UTF-8 encoded"),
            "{err}"
        );
        let err = proto::ControllerPublishVolumeResponse::decode(
            &lie_message(b"", "ControllerPublishVolume", LieMode::BadUtf8)[..],
        )
        .unwrap_err();
        assert!(err.to_string().contains("not UTF-8"), "{err}");
        for rpc in ["GetPluginInfo", "NodeGetInfo"] {
            let bytes = lie_message(b"", rpc, LieMode::BadUtf8);
            let err = if rpc == "GetPluginInfo" {
                proto::GetPluginInfoResponse::decode(&bytes[..]).unwrap_err()
            } else {
                proto::NodeGetInfoResponse::decode(&bytes[..]).unwrap_err()
            };
            assert!(err.to_string().contains("not UTF-8"), "{rpc}: {err}");
        }
    }
}
