//! Throughput of the filter's request work, to run natively or, built for
//! wasm32-wasip1, in V8 through Node.js (`just bench-v8`): the chained block
//! hashes alone, per hash, and whole `understand` calls on agent bodies.
//! V8 here is the engine Envoy embeds, so these are the filter's own costs
//! without Envoy around them.

use std::time::Instant;

use kvmesh_request::{Api, BlockHash, FilterConfig, block_hashes, salt, understand};

/// A chat body of about `bytes`: a system prompt and tool round trips whose
/// results are source code (many `\n` escapes, as real ones).
fn agent_body(bytes: usize) -> Vec<u8> {
    let mut body = String::from(r#"{"model":"m","stream":true,"messages":[{"role":"system","content":""#);
    body.push_str(&"You are a coding agent. Use the tools. ".repeat(60));
    body.push_str(r#""}"#);
    let mut turn = 0;
    while body.len() < bytes {
        body.push_str(&format!(
            r#",{{"role":"assistant","content":null,"tool_calls":[{{"id":"c{turn}","type":"function","function":{{"name":"read_file","arguments":"{{\"path\":\"src/f{turn}.rs\"}}"}}}}]}},{{"role":"tool","tool_call_id":"c{turn}","content":"{}"}}"#,
            "pub fn f(x: u32) -> u32 { x * 2 }\\n".repeat(60)
        ));
        turn += 1;
    }
    body.push_str("]}");
    body.into_bytes()
}

fn per_mb(reps: u32, bytes: usize, started: Instant) -> f64 {
    started.elapsed().as_secs_f64() * 1e3 / f64::from(reps) / (bytes as f64 / 1e6)
}

fn main() {
    let stream: Vec<u8> = (0..1_000_000u32).map(|i| (i.wrapping_mul(31) % 251) as u8).collect();
    let seed = salt("tenant", "model", "");
    for hash in [BlockHash::Xxh3, BlockHash::Sha256] {
        for _ in 0..5 {
            std::hint::black_box(block_hashes(hash, &seed, &stream, 256, usize::MAX));
        }
        let reps = 20;
        let started = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(block_hashes(hash, &seed, &stream, 256, usize::MAX));
        }
        println!(
            "chained {hash:?}, 256-byte blocks: {:.3} ms per MB",
            per_mb(reps, stream.len(), started)
        );
    }
    let headers: Vec<(String, String)> = vec![("x-session-id".into(), "s".into())];
    for kb in [10usize, 100, 400, 1000] {
        let body = agent_body(kb * 1000);
        for hash in [BlockHash::Xxh3, BlockHash::Sha256] {
            let config = FilterConfig {
                hash,
                ..FilterConfig::default()
            };
            // Untimed first: V8 starts in its baseline compiler and tiers
            // the hot functions up in the background.
            for _ in 0..50 {
                std::hint::black_box(understand(Api::ChatCompletions, &headers, &body, false, &config).is_ok());
            }
            let reps = 20;
            let started = Instant::now();
            for _ in 0..reps {
                let understood = understand(Api::ChatCompletions, &headers, &body, false, &config);
                std::hint::black_box(understood.is_ok());
            }
            let ms = started.elapsed().as_secs_f64() * 1e3 / f64::from(reps);
            println!("understand {kb:>4} KB body, {hash:?}: {ms:.3} ms");
        }
    }
}
