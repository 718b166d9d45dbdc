//! The API server's wire formats for lists and watches, without I/O.
//!
//! What kube-apiserver v1.36 sends (checked on the wire against a real one,
//! docs/architecture.md):
//! - a protobuf body (`Content-Type: application/vnd.kubernetes.protobuf`)
//!   is the 4 bytes `k8s\0` and then a `runtime.Unknown` message: the
//!   object's apiVersion and kind, and the object's own message as bytes.
//!   Lists (`ServiceList`), errors (`Status`) and single objects alike;
//! - a protobuf watch (`...protobuf;stream=watch`) is a sequence of frames,
//!   each a 4-byte big-endian length and a `meta.v1.WatchEvent` message whose
//!   object is itself enveloped as above (a bookmark: the resource's kind
//!   with only metadata; an error: a `Status`);
//! - a JSON watch is one JSON watch event per line.
//!
//! Nothing here panics on bad input: truncated or garbage bytes are errors
//! (a property test feeds arbitrary bytes).

use bytes::{Buf, Bytes, BytesMut};
use k8s_pb::apimachinery::pkg::apis::meta::v1 as pbmeta;
use k8s_pb::apimachinery::pkg::runtime::Unknown;
use prost::Message;
use serde::Deserialize;
use serde_json::value::RawValue;

/// The protobuf media type, and what the proxy asks for by default (as
/// upstream's `--kube-api-content-type`).
pub const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";
/// The JSON media type.
pub const JSON: &str = "application/json";
/// The envelope's magic bytes.
const MAGIC: &[u8; 4] = b"k8s\0";
/// The largest watch frame or line accepted. etcd stores objects of at most
/// 1.5 MiB; a larger length is garbage, not something to wait for.
pub const MAX_FRAME: usize = 64 << 20;

/// What was wrong with bytes from the API server.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("the protobuf body does not start with the k8s\\0 envelope")]
    NoEnvelope,
    #[error("decoding {what} (protobuf): {source}")]
    Protobuf {
        what: &'static str,
        #[source]
        source: prost::DecodeError,
    },
    #[error("decoding {what} (JSON): {source}")]
    Json {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("expected a {want}, the server sent a {got:?}")]
    Kind { want: &'static str, got: String },
    #[error("the envelope's content is encoded ({0:?}), which no server sends")]
    Encoded(String),
    #[error("a watch frame of {0} bytes (the limit is {MAX_FRAME})")]
    FrameTooLarge(usize),
    #[error("unknown watch event type {0:?}")]
    EventType(String),
}

fn pb_err(what: &'static str) -> impl FnOnce(prost::DecodeError) -> CodecError {
    move |source| CodecError::Protobuf { what, source }
}

fn json_err(what: &'static str) -> impl FnOnce(serde_json::Error) -> CodecError {
    move |source| CodecError::Json { what, source }
}

/// The encoding of a response, from its Content-Type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Protobuf,
    Json,
}

impl Format {
    /// `None` for a media type we cannot decode (YAML, CBOR, HTML from a
    /// proxy...). No Content-Type at all is taken for JSON, as kube-rs does.
    pub fn of(content_type: Option<&str>) -> Option<Format> {
        let Some(ct) = content_type else {
            return Some(Format::Json);
        };
        let media = ct.split(';').next().unwrap_or("").trim();
        if media.eq_ignore_ascii_case(PROTOBUF) {
            Some(Format::Protobuf)
        } else if media.eq_ignore_ascii_case(JSON) {
            Some(Format::Json)
        } else {
            None
        }
    }
}

/// Opens the `k8s\0` envelope of a protobuf body.
pub fn envelope(body: &[u8]) -> Result<Unknown, CodecError> {
    let rest = body.strip_prefix(MAGIC).ok_or(CodecError::NoEnvelope)?;
    let unknown = Unknown::decode(rest).map_err(pb_err("the envelope"))?;
    match unknown.content_encoding.as_deref() {
        None | Some("") => Ok(unknown),
        Some(other) => Err(CodecError::Encoded(other.to_string())),
    }
}

/// The kind an envelope says it carries ("" when it says nothing).
pub fn kind_of(u: &Unknown) -> &str {
    u.type_meta
        .as_ref()
        .and_then(|t| t.kind.as_deref())
        .unwrap_or("")
}

/// The message inside an envelope that must carry `kind`.
pub fn payload<'a>(u: &'a Unknown, kind: &'static str) -> Result<&'a [u8], CodecError> {
    let got = kind_of(u);
    if got != kind {
        return Err(CodecError::Kind {
            want: kind,
            got: got.to_string(),
        });
    }
    Ok(u.raw.as_deref().unwrap_or(&[]))
}

/// An error the API server answered (`metav1.Status`), in either encoding.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ApiStatus {
    /// The HTTP code it stands for (0 when the body did not say).
    pub code: u16,
    pub reason: String,
    pub message: String,
}

impl std::fmt::Display for ApiStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl ApiStatus {
    fn from_pb(s: pbmeta::Status) -> ApiStatus {
        ApiStatus {
            code: s
                .code
                .and_then(|c| u16::try_from(c).ok())
                .unwrap_or_default(),
            reason: s.reason.unwrap_or_default(),
            message: s.message.unwrap_or_default(),
        }
    }

    fn from_json(text: &str) -> Result<ApiStatus, CodecError> {
        #[derive(Deserialize)]
        struct S {
            #[serde(default)]
            code: u16,
            #[serde(default)]
            reason: Option<String>,
            #[serde(default)]
            message: Option<String>,
        }
        let s: S = serde_json::from_str(text).map_err(json_err("a Status"))?;
        Ok(ApiStatus {
            code: s.code,
            reason: s.reason.unwrap_or_default(),
            message: s.message.unwrap_or_default(),
        })
    }

    /// The Status in an error response's body; what the body cannot tell
    /// (a proxy's HTML page, garbage) comes from the HTTP code and the
    /// body's first bytes.
    pub fn from_body(http_code: u16, format: Option<Format>, body: &[u8]) -> ApiStatus {
        let parsed = match format {
            Some(Format::Protobuf) => envelope(body)
                .and_then(|u| {
                    pbmeta::Status::decode(payload(&u, "Status")?).map_err(pb_err("a Status"))
                })
                .map(ApiStatus::from_pb)
                .ok(),
            _ => std::str::from_utf8(body)
                .ok()
                .and_then(|t| ApiStatus::from_json(t).ok()),
        };
        let mut s = parsed.unwrap_or_else(|| ApiStatus {
            code: http_code,
            reason: String::new(),
            message: String::from_utf8_lossy(&body[..body.len().min(256)])
                .trim()
                .to_string(),
        });
        if s.code == 0 {
            s.code = http_code;
        }
        s
    }
}

/// What a watch event is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Added,
    Modified,
    Deleted,
    Bookmark,
    Error,
}

impl EventType {
    fn parse(s: &str) -> Result<EventType, CodecError> {
        Ok(match s {
            "ADDED" => EventType::Added,
            "MODIFIED" => EventType::Modified,
            "DELETED" => EventType::Deleted,
            "BOOKMARK" => EventType::Bookmark,
            "ERROR" => EventType::Error,
            other => return Err(CodecError::EventType(other.to_string())),
        })
    }
}

/// One watch event whose object is not decoded yet.
#[derive(Debug)]
pub struct RawEvent {
    pub kind: EventType,
    pub object: RawObject,
}

/// A watch event's object, as sent.
#[derive(Debug)]
pub enum RawObject {
    /// The envelope (kind and message bytes).
    Protobuf(Unknown),
    /// The object's JSON text.
    Json(Box<RawValue>),
}

impl RawObject {
    /// The Status of an ERROR event.
    pub fn status(&self) -> Result<ApiStatus, CodecError> {
        match self {
            RawObject::Protobuf(u) => pbmeta::Status::decode(payload(u, "Status")?)
                .map(ApiStatus::from_pb)
                .map_err(pb_err("a Status")),
            RawObject::Json(v) => ApiStatus::from_json(v.get()),
        }
    }
}

/// A bookmark's object: only its metadata matters.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BookmarkMeta {
    pub resource_version: String,
    /// Carries `k8s.io/initial-events-end: "true"`: a streaming list's
    /// initial state is complete.
    pub initial_events_end: bool,
}

/// The annotation that ends a streaming list's initial events.
pub const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";

impl RawObject {
    /// Reads a BOOKMARK's metadata. Every object message has its
    /// ObjectMeta as field 1, so one small message reads them all.
    pub fn bookmark(&self) -> Result<BookmarkMeta, CodecError> {
        let (rv, annotations) = match self {
            RawObject::Protobuf(u) => {
                #[derive(Clone, PartialEq, prost::Message)]
                struct MetaOnly {
                    #[prost(message, optional, tag = "1")]
                    metadata: Option<pbmeta::ObjectMeta>,
                }
                let m = MetaOnly::decode(u.raw.as_deref().unwrap_or(&[]))
                    .map_err(pb_err("a bookmark"))?
                    .metadata
                    .unwrap_or_default();
                (m.resource_version.unwrap_or_default(), m.annotations)
            }
            RawObject::Json(v) => {
                #[derive(Deserialize)]
                struct B {
                    #[serde(default)]
                    metadata: M,
                }
                #[derive(Deserialize, Default)]
                #[serde(rename_all = "camelCase")]
                struct M {
                    #[serde(default)]
                    resource_version: Option<String>,
                    #[serde(default)]
                    annotations: Option<std::collections::BTreeMap<String, String>>,
                }
                let b: B = serde_json::from_str(v.get()).map_err(json_err("a bookmark"))?;
                (
                    b.metadata.resource_version.unwrap_or_default(),
                    b.metadata.annotations.unwrap_or_default(),
                )
            }
        };
        Ok(BookmarkMeta {
            resource_version: rv,
            initial_events_end: annotations.get(INITIAL_EVENTS_END).map(String::as_str)
                == Some("true"),
        })
    }
}

/// Decodes one protobuf watch frame (without its length).
pub fn pb_event(frame: &[u8]) -> Result<RawEvent, CodecError> {
    let ev = pbmeta::WatchEvent::decode(frame).map_err(pb_err("a watch event"))?;
    let kind = EventType::parse(ev.r#type.as_deref().unwrap_or(""))?;
    let raw = ev.object.and_then(|o| o.raw).unwrap_or_default();
    Ok(RawEvent {
        kind,
        object: RawObject::Protobuf(envelope(&raw)?),
    })
}

/// Decodes one JSON watch event line.
pub fn json_event(line: &[u8]) -> Result<RawEvent, CodecError> {
    #[derive(Deserialize)]
    struct E {
        #[serde(rename = "type")]
        kind: String,
        object: Box<RawValue>,
    }
    let e: E = serde_json::from_slice(line).map_err(json_err("a watch event"))?;
    Ok(RawEvent {
        kind: EventType::parse(&e.kind)?,
        object: RawObject::Json(e.object),
    })
}

/// Splits a watch body into events' bytes as it arrives: length-prefixed
/// frames (protobuf) or lines (JSON).
#[derive(Debug)]
pub struct Frames {
    format: Format,
    buf: BytesMut,
    /// JSON: how far `buf` was searched for a newline already.
    scanned: usize,
}

impl Frames {
    pub fn new(format: Format) -> Frames {
        Frames {
            format,
            buf: BytesMut::new(),
            scanned: 0,
        }
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// Appends bytes received.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete frame, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Bytes>, CodecError> {
        match self.format {
            Format::Protobuf => {
                if self.buf.len() < 4 {
                    return Ok(None);
                }
                let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                    as usize;
                if len > MAX_FRAME {
                    return Err(CodecError::FrameTooLarge(len));
                }
                if self.buf.len() < 4 + len {
                    return Ok(None);
                }
                self.buf.advance(4);
                Ok(Some(self.buf.split_to(len).freeze()))
            }
            Format::Json => loop {
                let Some(i) = self.buf[self.scanned..].iter().position(|b| *b == b'\n') else {
                    self.scanned = self.buf.len();
                    if self.scanned > MAX_FRAME {
                        return Err(CodecError::FrameTooLarge(self.scanned));
                    }
                    return Ok(None);
                };
                let end = self.scanned + i;
                let line = self.buf.split_to(end + 1).freeze().slice(..end);
                self.scanned = 0;
                if !line.iter().all(u8::is_ascii_whitespace) {
                    return Ok(Some(line));
                }
            },
        }
    }

    /// Bytes of an incomplete frame left over (at the end of the stream: a
    /// frame cut off).
    pub fn pending(&self) -> usize {
        match self.format {
            Format::Protobuf => self.buf.len(),
            Format::Json => {
                if self.buf.iter().all(u8::is_ascii_whitespace) {
                    0
                } else {
                    self.buf.len()
                }
            }
        }
    }
}

/// A list's metadata.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListMeta {
    pub resource_version: String,
    /// The token for the next page; empty on the last.
    pub continue_token: String,
}

impl From<pbmeta::ListMeta> for ListMeta {
    fn from(m: pbmeta::ListMeta) -> ListMeta {
        ListMeta {
            resource_version: m.resource_version.unwrap_or_default(),
            continue_token: m.r#continue.unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_pb::apimachinery::pkg::runtime::{RawExtension, TypeMeta};
    use proptest::prelude::*;

    fn enveloped(kind: &str, raw: Vec<u8>) -> Vec<u8> {
        let u = Unknown {
            type_meta: Some(TypeMeta {
                api_version: Some("v1".into()),
                kind: Some(kind.into()),
            }),
            raw: Some(raw),
            content_encoding: Some(String::new()),
            content_type: Some(String::new()),
        };
        let mut out = MAGIC.to_vec();
        out.extend(u.encode_to_vec());
        out
    }

    fn frame(ev: &pbmeta::WatchEvent) -> Vec<u8> {
        let b = ev.encode_to_vec();
        let mut out = (b.len() as u32).to_be_bytes().to_vec();
        out.extend(b);
        out
    }

    fn status(code: i32, reason: &str) -> pbmeta::Status {
        pbmeta::Status {
            status: Some("Failure".into()),
            message: Some("too old resource version: 1 (5)".into()),
            reason: Some(reason.into()),
            code: Some(code),
            ..Default::default()
        }
    }

    /// What kube-apiserver v1.36.2 sent for a watch-list request while its
    /// storage could not serve one (etcd without RequestWatchProgress),
    /// copied byte for byte from the wire: a 200, then this frame.
    const REAL_ERROR_FRAME: &[u8] = b"\x00\x00\x00\xb7\x0a\x05ERROR\x12\xad\x01\x0a\xaa\x01k8s\x00\x0a\x0c\x0a\x02v1\x12\x06Status\x12\x91\x01\x0a\x06\x0a\x00\x12\x00\x1a\x00\x12\x07Failure\x1ala watch stream was requested by the client but the required storage feature RequestWatchProgress is disabled\x22\x0dInternalError0\xf4\x03\x1a\x00\x22\x00";

    #[test]
    fn a_real_servers_error_frame_decodes() {
        let mut f = Frames::new(Format::Protobuf);
        f.push(REAL_ERROR_FRAME);
        let fr = f.next_frame().unwrap().unwrap();
        assert_eq!(f.pending(), 0);
        let ev = pb_event(&fr).unwrap();
        assert_eq!(ev.kind, EventType::Error);
        let s = ev.object.status().unwrap();
        assert_eq!(s.code, 500);
        assert_eq!(s.reason, "InternalError");
        assert!(s.message.contains("RequestWatchProgress"), "{s}");
    }

    #[test]
    fn frames_arrive_in_pieces() {
        let ev = pbmeta::WatchEvent {
            r#type: Some("ERROR".into()),
            object: Some(RawExtension {
                raw: Some(enveloped("Status", status(410, "Expired").encode_to_vec())),
            }),
        };
        let mut bytes = frame(&ev);
        bytes.extend(frame(&ev));
        let mut f = Frames::new(Format::Protobuf);
        let mut got = Vec::new();
        for b in bytes.chunks(3) {
            f.push(b);
            while let Some(fr) = f.next_frame().unwrap() {
                got.push(pb_event(&fr).unwrap().object.status().unwrap());
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].code, 410);
        assert_eq!(got[1].reason, "Expired");
        assert_eq!(f.pending(), 0);
        // A cut frame is pending at the end.
        f.push(&frame(&ev)[..7]);
        assert!(f.next_frame().unwrap().is_none());
        assert_eq!(f.pending(), 7);
    }

    #[test]
    fn json_lines_and_a_line_cut_off() {
        let mut f = Frames::new(Format::Json);
        f.push(b"{\"type\":\"BOOKMARK\",\"object\":{\"kind\":\"Service\",\"metadata\":{\"resourceVersion\":\"12\",\"annotations\":{\"k8s.io/initial-events-end\":\"true\"}}}}\n\n{\"type\":\"DEL");
        let line = f.next_frame().unwrap().unwrap();
        let ev = json_event(&line).unwrap();
        assert_eq!(ev.kind, EventType::Bookmark);
        assert_eq!(
            ev.object.bookmark().unwrap(),
            BookmarkMeta {
                resource_version: "12".into(),
                initial_events_end: true
            }
        );
        assert!(f.next_frame().unwrap().is_none());
        assert_eq!(f.pending(), 12);
        f.push(b"ETED\",\"object\":{}}\n");
        assert_eq!(
            json_event(&f.next_frame().unwrap().unwrap()).unwrap().kind,
            EventType::Deleted
        );
        assert_eq!(f.pending(), 0);
    }

    #[test]
    fn protobuf_bookmarks_read_only_metadata() {
        let meta = pbmeta::ObjectMeta {
            resource_version: Some("77".into()),
            annotations: [(INITIAL_EVENTS_END.to_string(), "true".to_string())].into(),
            ..Default::default()
        };
        let svc = k8s_pb::api::core::v1::Service {
            metadata: Some(meta),
            ..Default::default()
        };
        let ev = pbmeta::WatchEvent {
            r#type: Some("BOOKMARK".into()),
            object: Some(RawExtension {
                raw: Some(enveloped("Service", svc.encode_to_vec())),
            }),
        };
        let got = pb_event(&ev.encode_to_vec()).unwrap();
        assert_eq!(
            got.object.bookmark().unwrap(),
            BookmarkMeta {
                resource_version: "77".into(),
                initial_events_end: true
            }
        );
    }

    #[test]
    fn envelopes_are_checked() {
        assert!(matches!(envelope(b"{}"), Err(CodecError::NoEnvelope)));
        let u = envelope(&enveloped("ServiceList", vec![])).unwrap();
        assert!(matches!(
            payload(&u, "Status"),
            Err(CodecError::Kind { want: "Status", got }) if got == "ServiceList"
        ));
        assert!(payload(&u, "ServiceList").unwrap().is_empty());
        let gz = Unknown {
            content_encoding: Some("gzip".into()),
            ..Default::default()
        };
        let mut b = MAGIC.to_vec();
        b.extend(gz.encode_to_vec());
        assert!(matches!(envelope(&b), Err(CodecError::Encoded(e)) if e == "gzip"));
    }

    #[test]
    fn error_bodies_in_every_shape() {
        let pb = enveloped("Status", status(422, "Invalid").encode_to_vec());
        let s = ApiStatus::from_body(422, Some(Format::Protobuf), &pb);
        assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"));
        let js = br#"{"kind":"Status","code":410,"reason":"Expired","message":"gone"}"#;
        let s = ApiStatus::from_body(410, Some(Format::Json), js);
        assert_eq!((s.code, s.message.as_str()), (410, "gone"));
        let s = ApiStatus::from_body(502, None, b"<html>Bad Gateway</html>");
        assert_eq!(s.code, 502);
        assert_eq!(s.message, "<html>Bad Gateway</html>");
        // A Status that says no code takes the HTTP one.
        let s = ApiStatus::from_body(406, Some(Format::Json), br#"{"reason":"NotAcceptable"}"#);
        assert_eq!(s.code, 406);
    }

    #[test]
    fn content_types() {
        assert_eq!(
            Format::of(Some("application/vnd.kubernetes.protobuf;stream=watch")),
            Some(Format::Protobuf)
        );
        assert_eq!(
            Format::of(Some("application/json; charset=utf-8")),
            Some(Format::Json)
        );
        assert_eq!(Format::of(None), Some(Format::Json));
        assert_eq!(Format::of(Some("application/yaml")), None);
        assert_eq!(Format::of(Some("application/cbor")), None);
    }

    proptest! {
        /// Arbitrary bytes, whole or in pieces, in either format: errors or
        /// frames, never a panic.
        #[test]
        fn garbage_never_panics(data in proptest::collection::vec(any::<u8>(), 0..600), cut in 1usize..64) {
            for format in [Format::Protobuf, Format::Json] {
                let mut f = Frames::new(format);
                for piece in data.chunks(cut) {
                    f.push(piece);
                    while let Ok(Some(fr)) = f.next_frame() {
                        if let Ok(ev) = pb_event(&fr) {
                            let _ = ev.object.status();
                            let _ = ev.object.bookmark();
                        }
                        if let Ok(ev) = json_event(&fr) {
                            let _ = ev.object.status();
                            let _ = ev.object.bookmark();
                        }
                    }
                }
                let _ = f.pending();
            }
            let _ = envelope(&data);
            let mut magic = MAGIC.to_vec();
            magic.extend(&data);
            let _ = envelope(&magic);
            let _ = ApiStatus::from_body(500, Some(Format::Protobuf), &magic);
            let _ = ApiStatus::from_body(500, Some(Format::Json), &data);
            let _ = ApiStatus::from_body(500, None, &data);
        }

        /// A real event cut anywhere is incomplete or an error, never a
        /// panic, and whole it decodes.
        #[test]
        fn truncated_events_never_panic(cut in 0usize..REAL_ERROR_FRAME.len()) {
            let mut f = Frames::new(Format::Protobuf);
            f.push(&REAL_ERROR_FRAME[..cut]);
            prop_assert!(f.next_frame().unwrap().is_none());
            prop_assert_eq!(f.pending(), cut);
            // The frame's body cut short: a decode error.
            if cut > 4 {
                prop_assert!(pb_event(&REAL_ERROR_FRAME[4..cut]).and_then(|e| e.object.status()).is_err());
            }
        }
    }
}
