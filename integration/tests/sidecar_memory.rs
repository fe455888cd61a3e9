//! The sidecar's memory stays bounded whatever model names clients send.
//! Before the wire bounds, 150 Picks with 3 MB model names took a sidecar
//! from 129 MB to 1.86 GB: every string of a Pick is kept (pending picks,
//! insight traces) and the learned bytes per token were a map keyed by
//! model that was never pruned.
//!
//! Here 10,000 Picks with distinct 3 MB model names (rejected: a model is at
//! most `MAX_ID_BYTES`) and then 10,000 Picks with distinct short names,
//! each reported with usage so the router learns its bytes per token. The
//! bound: peak RSS (VmHWM) under 100 MB, and `kvmesh_models` exactly the
//! router's `max_models` (1024). Measured on a 2-core machine, debug build:
//! RSS 14 MB at start, peak 29 MB after the 3 MB names (31-37 s), 30-31 MB
//! after the short ones (13-16 s); the bound leaves three times that.
//!
//! The times are printed, not asserted: they are this machine's speed (at
//! load 12 on the same machine the phases took 302 s and 161 s). What is
//! asserted is memory and counts; the only bound on time is a deadline per
//! phase that catches a hang.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvmesh_integration::cluster::start_sidecar;
use kvmesh_integration::paths::Profile;
use kvmesh_integration::process::memory_kib;
use kvmesh_proto::v1::router_client::RouterClient;
use kvmesh_proto::v1::{Outcome, PickReason, PickRequest};

const BIG_PICKS: u64 = 10_000;
const SHORT_PICKS: u64 = 10_000;
const BIG_MODEL_BYTES: usize = 3 << 20;
/// Peak resident memory allowed, in kB.
const MAX_HWM_KB: u64 = 100 * 1024;
/// `RouterConfig::default().max_models`.
const MAX_MODELS: f64 = 1024.0;
/// Deadline of each phase: only bounds a hang (a phase took 5 minutes at
/// load 12 on a 2-core machine).
const HANG: Duration = Duration::from_secs(30 * 60);

fn pick(model: String, session: String, request_id: u64) -> PickRequest {
    PickRequest {
        block_hashes: vec![request_id, request_id + 1],
        block_bytes: 256,
        prompt_bytes: 400,
        session_id: session,
        model,
        request_id,
        ..PickRequest::default()
    }
}

async fn metric(http: &reqwest::Client, admin: SocketAddr, series: &str) -> Option<f64> {
    let text = http
        .get(format!("http://{admin}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_model_names_leave_memory_bounded() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("kvmesh-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let workers: Vec<SocketAddr> = ["127.0.0.1:1", "127.0.0.1:2"]
        .iter()
        .map(|w| w.parse())
        .collect::<Result<_, _>>()?;
    let args = ["--scrape-interval-ms".to_owned(), "0".to_owned()];
    let (sidecar, grpc, admin) = start_sidecar(&dir, Profile::Debug, "127.0.0.1:0".parse()?, &workers, &args)?;
    let pid = sidecar.pid();
    let http = reqwest::Client::builder().no_proxy().build()?;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))?
        .connect()
        .await?;
    let mut router = RouterClient::new(channel).max_encoding_message_size(usize::MAX);
    let (start_rss, _) = memory_kib(pid).expect("the sidecar's /proc status");

    // One buffer, a distinct prefix per Pick; the stream pulls them lazily.
    let big = "m".repeat(BIG_MODEL_BYTES);
    let started = Instant::now();
    let picks = futures_util::stream::iter((0..BIG_PICKS).map(move |i| {
        let mut model = big.clone();
        model.replace_range(..20, &format!("{i:020}"));
        pick(model, format!("big-{i}"), i)
    }));
    let mut replies = router.pick_stream(picks).await?.into_inner();
    let rejected = tokio::time::timeout(HANG, async {
        let mut rejected = 0u64;
        while let Some(reply) = replies.message().await? {
            assert_eq!(reply.reason(), PickReason::Rejected, "{reply:?}");
            rejected += 1;
        }
        anyhow::Ok(rejected)
    })
    .await
    .map_err(|_| anyhow::anyhow!("the 3 MB Picks hung: not all answered within {HANG:?}"))??;
    let big_took = started.elapsed();
    assert_eq!(rejected, BIG_PICKS);
    let (big_rss, big_hwm) = memory_kib(pid).expect("the sidecar's /proc status");

    let started = Instant::now();
    tokio::time::timeout(HANG, async {
        for i in 0..SHORT_PICKS {
            let reply = router
                .pick(pick(format!("model-{i}"), format!("short-{i}"), 0))
                .await?
                .into_inner();
            router
                .report(Outcome {
                    pick_id: reply.pick_id,
                    destination: reply.destinations[0].clone(),
                    prompt_tokens: Some(100),
                    ..Outcome::default()
                })
                .await?;
        }
        anyhow::Ok(())
    })
    .await
    .map_err(|_| anyhow::anyhow!("the short Picks hung: not all answered within {HANG:?}"))??;
    let short_took = started.elapsed();
    let (end_rss, end_hwm) = memory_kib(pid).expect("the sidecar's /proc status");
    let models = metric(&http, admin, "kvmesh_models").await;
    eprintln!(
        "RSS at start {start_rss} kB; after {BIG_PICKS} x 3 MB models ({big_took:?}): RSS {big_rss} kB, peak {big_hwm} kB; \
         after {SHORT_PICKS} short models ({short_took:?}): RSS {end_rss} kB, peak {end_hwm} kB; kvmesh_models {models:?}"
    );
    assert!(end_hwm < MAX_HWM_KB, "peak RSS {end_hwm} kB over {MAX_HWM_KB} kB");
    assert_eq!(models, Some(MAX_MODELS));
    assert_eq!(
        metric(&http, admin, "kvmesh_picks_rejected_total{field=\"model\"}").await,
        Some(BIG_PICKS as f64)
    );
    drop(sidecar);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
