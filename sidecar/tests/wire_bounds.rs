//! The sidecar binary against Picks and Outcomes that break the wire bounds
//! (`kvmesh_vocab::limits`), sent straight over gRPC as any client on the
//! network could: each is refused alone, the sidecar lives on, the shared
//! stream carries on, and no counter takes an impossible value.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly by design

mod common;

use std::time::Duration;

use common::start;
use kvmesh_proto::v1::router_client::RouterClient;
use kvmesh_proto::v1::{Outcome, PickReason, PickReply, PickRequest};
use kvmesh_vocab::limits::{MAX_ID_BYTES, MAX_MESSAGE_BYTES};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::Channel;

fn pick(session: &str, request_id: u64) -> PickRequest {
    PickRequest {
        block_hashes: vec![1, 2, 3, 4],
        block_bytes: 256,
        prompt_bytes: 1000,
        session_id: session.to_owned(),
        model: "m".to_owned(),
        request_id,
        ..PickRequest::default()
    }
}

/// A PickStream: what to send on it, and its replies.
async fn open_stream(channel: Channel) -> (mpsc::Sender<PickRequest>, Streaming<PickReply>) {
    let (tx, rx) = mpsc::channel(4);
    let replies = RouterClient::new(channel)
        .max_encoding_message_size(usize::MAX)
        .pick_stream(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, replies)
}

async fn next(replies: &mut Streaming<PickReply>) -> Result<PickReply, tonic::Status> {
    tokio::time::timeout(Duration::from_secs(10), replies.message())
        .await
        .expect("no reply within 10 s")
        .map(|reply| reply.expect("the stream ended"))
}

/// Before the bounds, the second of these panicked a debug sidecar
/// (`attempt to add with overflow` in the insight ledger) and a release one
/// queued 4.7e18 tokens of prefill on a worker.
#[tokio::test]
async fn a_pick_claiming_u64_max_bytes_is_rejected_and_the_sidecar_lives() {
    let mut sidecar = start();
    let mut router = RouterClient::new(sidecar.channel().await);
    for _ in 0..3 {
        let status = router
            .pick(PickRequest {
                prompt_bytes: u64::MAX,
                block_bytes: 0,
                ..pick("huge", 0)
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("prompt_bytes"), "{status:?}");
    }
    let reply = router.pick(pick("normal", 0)).await.unwrap().into_inner();
    assert_eq!(reply.destinations.len(), 3);
    assert!(sidecar.alive());
    assert_eq!(
        sidecar.metric("kvmesh_picks_rejected_total{field=\"prompt_bytes\"}"),
        Some(3.0)
    );
    let workers = common::http_get(&sidecar.admin, "/debug/workers");
    let body = &workers[workers.find("\r\n\r\n").unwrap() + 4..];
    let view: serde_json::Value = serde_json::from_str(body).unwrap();
    let queued: f64 = view["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["queued_prefill_tokens"].as_f64().unwrap())
        .sum();
    assert!(queued < 1e4, "the rejected Picks queued {queued} tokens of prefill");
}

#[tokio::test]
async fn an_over_long_model_is_rejected_alone_and_the_stream_goes_on() {
    let sidecar = start();
    let (tx, mut replies) = open_stream(sidecar.channel().await).await;
    tx.send(PickRequest {
        model: "m".repeat(MAX_ID_BYTES + 1),
        ..pick("long-model", 1)
    })
    .await
    .unwrap();
    let rejected = next(&mut replies).await.unwrap();
    assert_eq!(rejected.request_id, 1);
    assert_eq!(rejected.reason(), PickReason::Rejected);
    assert!(rejected.destinations.is_empty());

    tx.send(pick("long-model", 2)).await.unwrap();
    let answered = next(&mut replies).await.unwrap();
    assert_eq!(answered.request_id, 2);
    assert_eq!(answered.destinations.len(), 3);
    assert_eq!(
        sidecar.metric("kvmesh_picks_rejected_total{field=\"model\"}"),
        Some(1.0)
    );
}

/// A message over the decode limit cannot be answered (it is never
/// decoded): it fails its own stream and nothing else, even another stream
/// on the same connection.
#[tokio::test]
async fn a_message_over_the_decode_limit_fails_only_its_own_stream() {
    let mut sidecar = start();
    let channel = sidecar.channel().await;
    let (other_tx, mut other) = open_stream(channel.clone()).await;
    other_tx.send(pick("other", 1)).await.unwrap();
    assert_eq!(next(&mut other).await.unwrap().request_id, 1);

    let (tx, mut replies) = open_stream(channel.clone()).await;
    tx.send(PickRequest {
        model: "m".repeat(MAX_MESSAGE_BYTES + (1 << 20)),
        ..pick("5mb", 7)
    })
    .await
    .unwrap();
    let status = next(&mut replies).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");

    other_tx.send(pick("other", 2)).await.unwrap();
    assert_eq!(next(&mut other).await.unwrap().request_id, 2);
    let mut router = RouterClient::new(channel);
    assert_eq!(
        router
            .pick(pick("after", 0))
            .await
            .unwrap()
            .into_inner()
            .destinations
            .len(),
        3
    );
    assert!(sidecar.alive());
}

/// Before the checks, one report of `prompt_tokens = u64::MAX` left
/// `kvmesh_usage_reported_prompt_tokens_total` at 1.8e19 for good.
#[tokio::test]
async fn implausible_usage_leaves_every_counter_unchanged() {
    let sidecar = start();
    let mut router = RouterClient::new(sidecar.channel().await);
    let usage_series = "kvmesh_usage_reported_prompt_tokens_total{harness=\"other\",tenant=\"none\"}";
    let engine_series = "kvmesh_reported_prompt_tokens_total";
    let cases = [
        (Some(u64::MAX), None, "prompt_over_limit"),
        // The Pick's 1000 bytes hold at most 1000 + 4096 tokens.
        (Some(50_000), None, "prompt_over_pick"),
        (Some(100), Some(200), "cached_over_prompt"),
    ];
    for (prompt_tokens, cached_tokens, reason) in cases {
        let reply = router.pick(pick("usage", 0)).await.unwrap().into_inner();
        router
            .report(Outcome {
                pick_id: reply.pick_id,
                destination: reply.destinations[0].clone(),
                prompt_tokens,
                cached_tokens,
                ..Outcome::default()
            })
            .await
            .unwrap();
        assert_eq!(
            sidecar.metric(&format!("kvmesh_usage_rejected_total{{reason=\"{reason}\"}}")),
            Some(1.0),
            "{reason}"
        );
    }
    assert_eq!(sidecar.metric(engine_series), Some(0.0));
    assert_eq!(sidecar.metric(usage_series), Some(0.0));

    // Plausible usage still counts.
    let reply = router.pick(pick("usage", 0)).await.unwrap().into_inner();
    router
        .report(Outcome {
            pick_id: reply.pick_id,
            destination: reply.destinations[0].clone(),
            prompt_tokens: Some(300),
            cached_tokens: Some(100),
            ..Outcome::default()
        })
        .await
        .unwrap();
    assert_eq!(sidecar.metric(engine_series), Some(300.0));
    assert_eq!(sidecar.metric(usage_series), Some(300.0));
}
