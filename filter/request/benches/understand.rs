//! Native cost of understanding agent requests of growing size, per hash.
//! (Envoy's V8 runs the same code several times slower: the end-to-end
//! figure is `kvmesh-bench filter-overhead`, in docs/benchmarks.md.)

use criterion::BatchSize;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvmesh_request::{Api, BlockHash, ChunkedRequest, FilterConfig, understand};
use serde_json::json;

fn agent_body(bytes: usize) -> Vec<u8> {
    let mut messages = vec![json!({"role": "system", "content": "You are a coding agent. Use the tools. ".repeat(60)})];
    let mut turn = 0;
    while serde_json::to_vec(&messages).map_or(0, |v| v.len()) < bytes {
        let result = format!(
            "// src/file_{turn}.rs\n{}",
            "pub fn f(x: u32) -> u32 { x * 2 }\n".repeat(60)
        );
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{turn}"),
            "type": "function", "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/file_{turn}.rs\"}}")}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": format!("c{turn}"), "content": result}));
        turn += 1;
    }
    serde_json::to_vec(&json!({"model": "m", "messages": messages, "stream": true})).unwrap_or_default()
}

fn bench_understand(c: &mut Criterion) {
    let headers: Vec<(String, String)> = vec![("x-session-id".into(), "s".into())];
    for hash in [BlockHash::Xxh3, BlockHash::Sha256] {
        let config = FilterConfig {
            hash,
            ..FilterConfig::default()
        };
        let mut group = c.benchmark_group(format!("understand/{hash:?}"));
        for kb in [10usize, 100, 400, 1000] {
            let body = agent_body(kb * 1000);
            group.throughput(Throughput::Bytes(body.len() as u64));
            group.bench_with_input(BenchmarkId::from_parameter(format!("{kb}KB")), &body, |b, body| {
                b.iter(|| understand(Api::ChatCompletions, &headers, body, false, &config));
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench_understand, bench_chunked, bench_hostile);
criterion_main!(benches);

/// The body in 64 KB chunks, as Envoy delivers a large one: all of the work
/// (`total`), and what is left once the last chunk comes (`last_chunk`, the
/// part on the request's critical path).
fn bench_chunked(c: &mut Criterion) {
    let headers: Vec<(String, String)> = vec![("x-session-id".into(), "s".into())];
    let config = FilterConfig::default();
    let chunk = 64 * 1024;
    let mut group = c.benchmark_group("chunked");
    for kb in [10usize, 100, 400, 1000] {
        let body = agent_body(kb * 1000);
        let last = body.len().saturating_sub(1).max(1).div_ceil(chunk).saturating_sub(1) * chunk;
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::new("total", format!("{kb}KB")), &body, |b, body| {
            b.iter(|| {
                let mut request = ChunkedRequest::new(Api::ChatCompletions, &headers, &config, None, body.len());
                for piece in body.chunks(chunk) {
                    request.feed(piece);
                }
                request.finish(&headers, false, &config)
            });
        });
        group.bench_with_input(BenchmarkId::new("last_chunk", format!("{kb}KB")), &body, |b, body| {
            b.iter_batched(
                || {
                    let mut request = ChunkedRequest::new(Api::ChatCompletions, &headers, &config, None, body.len());
                    request.feed(&body[..last]);
                    request
                },
                |mut request| {
                    request.feed(&body[last..]);
                    request.finish(&headers, false, &config)
                },
                BatchSize::LargeInput,
            );
        });
    }
    group.finish();
}

fn bench_hostile(c: &mut Criterion) {
    let headers: Vec<(String, String)> = vec![("x-session-id".into(), "s".into())];
    let config = FilterConfig::default();
    let chat = |messages: String| format!(r#"{{"model":"m","messages":[{messages}]}}"#).into_bytes();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated_400KB", {
            let mut b = agent_body(400_000);
            b.truncate(b.len() - 100);
            b
        }),
        (
            "nesting_10000",
            chat(format!("{}{}", "[".repeat(10_000), "]".repeat(10_000))),
        ),
        ("empty_messages_100000", chat(vec!["{}"; 100_000].join(","))),
        (
            "string_20MiB",
            chat(format!(r#"{{"role":"user","content":"{}"}}"#, "a".repeat(20 << 20))),
        ),
    ];
    let mut group = c.benchmark_group("hostile");
    group.sample_size(10);
    for (name, body) in &cases {
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), body, |b, body| {
            b.iter(|| understand(Api::ChatCompletions, &headers, body, false, &config));
        });
    }
    group.finish();
}
