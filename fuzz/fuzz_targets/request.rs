//! The filter's request understanding on arbitrary bytes, as every API, as a
//! whole body and as one cut at the cap, with arbitrary header bytes (not
//! only UTF-8) in every header it reads: never a panic; when it succeeds
//! the result is bounded by the configuration and by the wire's limits.
//! The body is also fed in chunks of fuzzer-chosen sizes, as Envoy delivers
//! it, and must be understood exactly as in one piece (its declared
//! retention horizon and its priority edit included).
#![no_main]

use kvmesh_request::{Api, ChunkedRequest, Engine, FilterConfig, PriorityField, understand};
use kvmesh_vocab::limits::{MAX_ID_BYTES, MAX_PRIORITY, MAX_RETENTION_HORIZON_S, MAX_SECTIONS, MIN_PRIORITY};
use libfuzzer_sys::fuzz_target;

/// Headers the filter reads; the fuzzer's bytes become their values.
const READ_HEADERS: [&str; 10] = [
    "x-session-id",
    "x-claude-code-agent-id",
    "x-parent-session-id",
    "authorization",
    "x-kvmesh-tenant",
    "user-agent",
    "originator",
    "thread-id",
    "x-kvmesh-priority",
    "x-dynamo-session-final",
];

fuzz_target!(|data: &[u8]| {
    // The first byte picks the headers, the trust setting, the model
    // assumed for hashing ahead and the chunk sizes; the next bytes (up to
    // the first 0x00) are header values, the rest is the body.
    let (selector, rest) = data.split_first().map_or((0, data), |(s, b)| (*s, b));
    let chunking = selector >> 3;
    let (values, body) = match rest.iter().position(|b| *b == 0) {
        Some(at) if selector & 1 == 1 => (&rest[..at], &rest[at + 1..]),
        _ => (&[][..], rest),
    };
    let config = FilterConfig {
        max_blocks: 64,
        block_bytes: 16,
        trust_tenant_header: selector & 2 == 2,
        // The priority rewrite always on: its edit must agree too.
        priority_field: Some(PriorityField {
            engine: Engine::Vllm,
            lead: 0,
            subagent: 0,
            background: -100,
            harness: Default::default(),
            background_header: "x-kvmesh-background".to_owned(),
        }),
        // And the billing block's removal, which shares that edit.
        strip_preambles: true,
        ..FilterConfig::default()
    };
    let mut headers: Vec<(String, Vec<u8>)> = vec![("content-type".to_owned(), b"application/json".to_vec())];
    // Each header gets a slice of the values, split at 0xff bytes.
    for (name, value) in READ_HEADERS.iter().zip(values.split(|b| *b == 0xff)) {
        headers.push(((*name).to_owned(), value.to_vec()));
    }
    for api in Api::ALL {
        for truncated in [false, true] {
            let whole = understand(api, &headers, body, truncated, &config);
            // Chunks of 1 to 16 bytes chosen by the body's own bytes, or of
            // a fixed 1 to 31 bytes.
            let likely = (selector & 4 == 4).then_some("m");
            let mut chunked = ChunkedRequest::new(api, &headers, &config, likely, usize::from(selector) * 64);
            let mut at = 0;
            while at < body.len() {
                let size = match chunking {
                    0 => usize::from(body[at] % 16) + 1,
                    n => usize::from(n),
                };
                let end = (at + size).min(body.len());
                chunked.feed(&body[at..end]);
                at = end;
            }
            assert_eq!(chunked.finish(&headers, truncated, &config), whole);
            if let Ok(u) = whole {
                assert!(u.hashes.hashes.len() <= config.max_blocks);
                assert!(u.model.len() <= MAX_ID_BYTES);
                assert!(u.sections.len() <= MAX_SECTIONS);
                assert!(u.hints.retention_horizon_s.is_none_or(|h| h <= MAX_RETENTION_HORIZON_S));
                assert!(u.hints.priority.is_some_and(|p| (MIN_PRIORITY..=MAX_PRIORITY).contains(&p)));
                if let Some(edit) = &u.body_edit {
                    // Only whole bodies are edited, and only from their start.
                    assert!(!truncated && edit.replace <= body.len());
                    assert_eq!(edit.apply(body).len(), edit.new_len(body.len()));
                }
                for id in [
                    &u.identity.session_id,
                    &u.identity.agent_id,
                    &u.identity.parent_id,
                    &u.identity.tenant,
                ] {
                    assert!(id.len() <= MAX_ID_BYTES, "{} bytes", id.len());
                }
            }
        }
    }
});
