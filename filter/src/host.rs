//! The filter's only door to what Envoy holds about a request: headers,
//! trailers and properties, read as bytes, with every host error turned into
//! "absent".
//!
//! # The rule: no SDK call that can panic on what a client or engine sends
//!
//! A panic in a Wasm callback kills the VM on that Envoy thread: with
//! `FAIL_OPEN`, every later request on it skips the filter (and any header
//! the filter was meant to remove reaches the upstream). The proxy-wasm
//! SDK's text accessors (`get_http_request_header`, `..._headers`,
//! `get_http_response_header(s)`, the trailer twins, `get_grpc_status`, and
//! `hostcalls::get_map` / `get_map_value`) `unwrap` a `String::from_utf8` of
//! the value, and HTTP lets a client put any byte above 0x7f in a value. So:
//!
//! - read values only through this module (bytes; `clippy.toml` bans the
//!   text accessors, so a newcomer's `get_http_request_header` fails CI);
//! - header *names* come back as `String` from `get_map_bytes` too, but
//!   Envoy's HTTP/1 and HTTP/2 codecs only accept names made of HTTP token
//!   characters (ASCII), so a name is always UTF-8 (a test sends a name
//!   with a `\xff` byte: Envoy answers 400 before any Wasm runs);
//! - the SDK's trait setters `unwrap` the host's status: write through
//!   `set_request_header`, which ignores a refusal (a request the host no
//!   longer holds);
//! - a gRPC status message is never read: its bytes come from the sidecar
//!   connection, and the code and the elapsed time say enough.

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType};

/// A request header's raw value.
pub(crate) fn request_header(name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
}

/// Every request header, values as bytes.
pub(crate) fn request_headers() -> Vec<(String, Vec<u8>)> {
    hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default()
}

/// A response header's raw value.
pub(crate) fn response_header(name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
        .ok()
        .flatten()
}

/// Sets (or with `None` removes) a request header; a refusal is ignored.
pub(crate) fn set_request_header(name: &str, value: Option<&str>) {
    let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value);
}

/// A request header as text: absent when it is not UTF-8.
pub(crate) fn request_header_text(name: &str) -> Option<String> {
    request_header(name).and_then(|v| String::from_utf8(v).ok())
}

/// A property as text (`upstream.address`): absent when it is not UTF-8.
pub(crate) fn property_text(path: Vec<&str>) -> Option<String> {
    hostcalls::get_property(path)
        .ok()
        .flatten()
        .and_then(|v| String::from_utf8(v).ok())
}

/// Replaces the first `len` bytes of the request body Envoy holds with
/// `with`; `false` if the host refused.
///
/// Call it only from `on_http_request_body`, with `len` at most the body
/// size it was given: there the body buffer is the mutable one Envoy holds,
/// and its `Buffer::copyFrom` takes a rewrite from offset 0 (drain `len`,
/// prepend `with`) and nothing else. The SDK's `set_buffer` panics on any
/// status but `Ok` (and the trait's `set_http_request_body` unwraps that),
/// so a call at another offset, or with no body held, would kill the VM.
pub(crate) fn replace_request_body_prefix(len: usize, with: &[u8]) -> bool {
    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, len, with).is_ok()
}
