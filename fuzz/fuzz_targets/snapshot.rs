//! The Redis snapshot decoder on arbitrary bytes (any client of that Redis
//! can write the key): never a panic, never an allocation a length field
//! merely claims; a snapshot it accepts encodes and decodes back to itself.
#![no_main]

use kvmesh_sidecar::snapshot::{decode_snapshot, encode_snapshot};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((id, snapshot)) = decode_snapshot(data) else {
        return;
    };
    let bytes = encode_snapshot(&id, &snapshot);
    // Trailing bytes are ignored, so the input is not always the encoding;
    // the encoding is never longer than what it was decoded from.
    assert!(bytes.len() <= data.len());
    assert_eq!(decode_snapshot(&bytes), Some((id, snapshot)));
});
