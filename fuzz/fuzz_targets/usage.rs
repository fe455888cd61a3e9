//! The response usage reader on arbitrary bytes, as JSON and as SSE, fed in
//! chunks whose sizes the input chooses: never a panic.
#![no_main]

use kvmesh_request::UsageReader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (chunk, body) = data
        .split_first()
        .map_or((1, data), |(c, b)| (usize::from(*c).max(1), b));
    for content_type in ["application/json", "text/event-stream"] {
        let mut reader = UsageReader::new(Some(content_type), 1024);
        for piece in body.chunks(chunk) {
            reader.feed(piece);
        }
        let _ = reader.finish();
    }
});
