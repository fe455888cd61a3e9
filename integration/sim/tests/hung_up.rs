//! A request whose client hangs up before the reply gives back what it
//! took: its KV blocks (the engine holds a running request's blocks, and a
//! handler dropped mid-request must release them, or the engine's free room
//! shrinks for good and the prompts behind it wait forever), and its place
//! in the queue the engine reports.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test helpers fail loudly by design

mod common;

use std::time::{Duration, Instant};

use common::Sim;
use serde_json::json;

/// A gauge's value in the sim's vLLM-named metrics.
fn gauge(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

#[test]
fn a_client_that_hangs_up_mid_decode_releases_its_blocks() {
    // Real time, so the request is still decoding its many steps when the
    // client goes.
    let sim = Sim::start(&["--time-scale", "1", "--capacity-tokens", "4000"], &[]);
    let text = "the sidecar picks the worker that holds the session's prefix. ".repeat(60);
    let body = |max_tokens: u64| json!({"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens});
    // The prompt once to the end, so the call that hangs up finds it cached.
    let (status, reply) = sim.post("/v1/chat/completions", &body(2));
    assert_eq!(status, 200, "{reply}");
    sim.post_and_hang_up("/v1/chat/completions", &body(100_000), || {
        let m = sim.get("/metrics");
        gauge(&m, "vllm:num_requests_running") == 1.0 && gauge(&m, "vllm:kv_cache_usage_perc") > 0.0
    });
    // Released: no request runs, no block is held.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = sim.get("/metrics");
        let (running, usage) = (
            gauge(&m, "vllm:num_requests_running"),
            gauge(&m, "vllm:kv_cache_usage_perc"),
        );
        if running == 0.0 && usage == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still held after the hang-up: {running} running, usage {usage}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The blocks went back to the cache, not away: the prompt runs again
    // from it.
    let (status, reply) = sim.post("/v1/chat/completions", &body(2));
    assert_eq!(status, 200, "{reply}");
    let usage = &serde_json::from_str::<serde_json::Value>(&reply).unwrap()["usage"];
    assert!(
        usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0,
        "{usage}"
    );
}

#[test]
fn a_client_that_hangs_up_while_queued_leaves_the_queue() {
    let sim = Sim::start(&["--time-scale", "1"], &[]);
    // A long prompt nobody sent before: its prefill holds the lane a while.
    let long = "each worker keeps its own prefix cache of the prompts it has seen. ".repeat(600);
    let call = |text: &str| json!({"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": 2});
    std::thread::scope(|scope| {
        let first = scope.spawn(|| sim.post("/v1/chat/completions", &call(&long)));
        let deadline = Instant::now() + Duration::from_secs(60);
        while gauge(&sim.get("/metrics"), "vllm:num_requests_running") != 1.0 {
            assert!(Instant::now() < deadline, "the long call never started");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Another call queues behind it, then its client hangs up.
        sim.post_and_hang_up("/v1/chat/completions", &call("a short question"), || {
            gauge(&sim.get("/metrics"), "vllm:num_requests_waiting") == 1.0
        });
        assert_eq!(first.join().unwrap().0, 200);
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = sim.get("/metrics");
        let (waiting, running) = (
            gauge(&m, "vllm:num_requests_waiting"),
            gauge(&m, "vllm:num_requests_running"),
        );
        if waiting == 0.0 && running == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still counted after the hang-up: {waiting} waiting, {running} running"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
