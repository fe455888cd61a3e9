//! The filter's request understanding on arbitrary bytes, as every API, as a
//! whole body and as one cut at the cap: never a panic; when it succeeds
//! the result is bounded by the configuration.
#![no_main]

use kvmesh_request::{Api, FilterConfig, understand};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let config = FilterConfig {
        max_blocks: 64,
        block_bytes: 16,
        ..FilterConfig::default()
    };
    // The first byte picks the headers, the rest is the body.
    let (selector, body) = data.split_first().map_or((0, data), |(s, b)| (*s, b));
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    if selector & 1 == 1 {
        headers.push((
            "x-session-id".to_owned(),
            String::from_utf8_lossy(body.get(..8).unwrap_or(body)).into_owned(),
        ));
    }
    for api in Api::ALL {
        for truncated in [false, true] {
            if let Ok(u) = understand(api, &headers, body, truncated, &config) {
                assert!(u.hashes.hashes.len() <= config.max_blocks);
                assert!(u.identity.session_id.len() <= 256);
            }
        }
    }
});
