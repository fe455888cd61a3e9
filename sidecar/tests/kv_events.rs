//! The decoder against frames captured from a real vLLM 0.32 (tiny model,
//! 12 blocks of 128 tokens, seven completions then `/reset_prefix_cache`
//! and one more), and against hand-made hostile input.

#![allow(clippy::unwrap_used, clippy::panic)] // a test fails loudly

mod kv_fixtures;

use kv_fixtures::FIXTURES;

use kvmesh_sidecar::kv_events::*;

/// A fixture: each frame as a 4-byte big-endian length and its bytes.
fn frames(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while let Some((len, tail)) = rest.split_first_chunk::<4>() {
        let len = u32::from_be_bytes(*len) as usize;
        out.push(tail[..len].to_vec());
        rest = &tail[len..];
    }
    out
}

fn batch(fixture: &[u8]) -> Batch {
    let frames = frames(fixture);
    let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
    match decode(&refs) {
        Ok(batch) => batch,
        Err(err) => panic!("fixture does not decode: {err}"),
    }
}

#[test]
fn a_real_stored_event_decodes_with_its_hashes_tokens_and_block_size() {
    let b = batch(FIXTURES[0]);
    assert_eq!(b.seq, 0);
    assert!(b.ts > 1.7e9, "{}", b.ts);
    assert_eq!(
        b.events,
        vec![Event::BlockStored {
            hashes: vec![
                15_540_359_563_638_585_712,
                11_526_097_800_606_218_959,
                6_975_751_920_992_319_243,
                9_285_222_020_131_563_123
            ],
            parent: None,
            tokens: 512,
            block_size: 128,
            medium: Medium::Primary,
        }]
    );
}

#[test]
fn the_captured_run_is_followed_block_by_block() {
    // (stored, removed, cleared, resident), counted by hand from the frames
    // (msgspec's own decoder): 11 usable blocks, 10 of them cached once full.
    let expected = [
        (4, 0, false, 4),
        (4, 0, false, 8),
        (4, 2, false, 10),
        (3, 3, false, 10),
        (3, 3, false, 10),
        (4, 4, false, 10),
        (4, 4, false, 10),
        (2, 0, true, 2),
    ];
    let mut cache = EngineCache::new();
    for (fixture, (stored, removed, cleared, resident)) in FIXTURES.iter().zip(expected) {
        let applied = cache.apply(&batch(fixture));
        assert_eq!(applied.gap, None);
        assert_eq!(
            (applied.stored_blocks, applied.removed_blocks, applied.cleared),
            (stored, removed, cleared)
        );
        assert_eq!(applied.block_tokens, Some(128));
        assert_eq!(cache.resident_blocks(), resident);
        assert!(cache.exact());
    }
}

#[test]
fn a_lost_message_is_a_gap_and_a_sequence_going_back_a_restart() {
    let mut cache = EngineCache::new();
    cache.apply(&batch(FIXTURES[0]));
    let applied = cache.apply(&batch(FIXTURES[2]));
    assert_eq!(applied.gap, Some(Gap::Missed { missed: 1 }));
    assert!(!cache.exact());
    // Started again from what came after the gap: 4 stored, none known removed.
    assert_eq!(cache.resident_blocks(), 4);
    let applied = cache.apply(&batch(FIXTURES[0]));
    assert_eq!(applied.gap, Some(Gap::Restarted));
    assert!(cache.exact(), "a publisher's first message starts it exact");
    assert_eq!(cache.resident_blocks(), 4);
    // A subscriber that joins late is not exact until a clear.
    let mut late = EngineCache::new();
    late.apply(&batch(FIXTURES[3]));
    assert!(!late.exact());
    late.apply(&batch(FIXTURES[4]));
    late.apply(&batch(FIXTURES[5]));
    late.apply(&batch(FIXTURES[6]));
    late.apply(&batch(FIXTURES[7]));
    assert!(late.exact());
    assert_eq!(late.resident_blocks(), 2);
}

fn encode(value: &impl serde::Serialize) -> Vec<u8> {
    rmp_serde::to_vec(value).unwrap_or_default()
}

#[test]
fn the_older_positional_events_bytes_hashes_and_offloaded_media_decode() {
    #[derive(serde::Serialize)]
    struct Positional(
        &'static str,
        Vec<u64>,
        Option<u64>,
        Vec<u32>,
        u32,
        Option<u32>,
        &'static str,
    );
    let stored = Positional("BlockStored", vec![7, 8], Some(6), vec![1; 32], 16, None, "GPU");
    let payload = encode(&(
        1.5f64,
        (stored, ("BlockRemoved", [7u64], "CPU"), ("AllBlocksCleared",)),
        0,
    ));
    let b = decode(&[b"", &5u64.to_be_bytes(), &payload]);
    assert_eq!(
        b.map(|b| b.events),
        Ok(vec![
            Event::BlockStored {
                hashes: vec![7, 8],
                parent: Some(6),
                tokens: 32,
                block_size: 16,
                medium: Medium::Primary
            },
            Event::BlockRemoved {
                hashes: vec![7],
                medium: Medium::Host
            },
            Event::AllBlocksCleared,
        ])
    );
    // sha256 bytes: the low 8 bytes, as vLLM's integer mode takes them.
    let mut hash = [0u8; 32];
    hash[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    #[derive(serde::Serialize)]
    struct Removed {
        r#type: &'static str,
        #[serde(with = "serde_bytes_list")]
        block_hashes: Vec<[u8; 32]>,
        medium: Option<&'static str>,
    }
    mod serde_bytes_list {
        pub(super) fn serialize<S: serde::Serializer>(v: &[[u8; 32]], s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeSeq;
            let mut seq = s.serialize_seq(Some(v.len()))?;
            for h in v {
                seq.serialize_element(&Bytes(h))?;
            }
            seq.end()
        }
        struct Bytes<'a>(&'a [u8]);
        impl serde::Serialize for Bytes<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(self.0)
            }
        }
    }
    let removed = Removed {
        r#type: "BlockRemoved",
        block_hashes: vec![hash],
        medium: None,
    };
    let payload = encode(&(1.5f64, [removed]));
    let b = decode(&[b"kv", &0u64.to_be_bytes(), &payload]);
    assert_eq!(
        b.map(|b| b.events),
        Ok(vec![Event::BlockRemoved {
            hashes: vec![0x0102_0304_0506_0708],
            medium: Medium::Primary
        }])
    );
}

#[test]
fn hostile_messages_are_refused_not_panicked_on() {
    let seq = 0u64.to_be_bytes();
    assert_eq!(decode(&[b"kv", &seq]), Err(DecodeError::Frames(2)));
    assert_eq!(decode(&[b"kv", b"1234", b""]), Err(DecodeError::Sequence(4)));
    assert_eq!(decode(&[&[b'x'; 300], &seq, b""]), Err(DecodeError::Topic(300)));
    let big = vec![0u8; MAX_PAYLOAD_BYTES + 1];
    assert_eq!(
        decode(&[b"kv", &seq, &big]),
        Err(DecodeError::PayloadTooLarge(MAX_PAYLOAD_BYTES + 1))
    );
    // An array header claiming 4 billion events, with none behind it.
    let lying = [0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff];
    assert!(matches!(decode(&[b"kv", &seq, &lying]), Err(DecodeError::Payload(_))));
    // Too many hashes in one event.
    let many = encode(&(1.0f64, [("BlockRemoved", vec![1u64; MAX_HASHES + 1], "GPU")]));
    assert!(matches!(decode(&[b"kv", &seq, &many]), Err(DecodeError::Payload(_))));
    // An unknown event type is skipped; the rest still count.
    let unknown = encode(&(1.0f64, (("SomethingNew", 1u8), ("AllBlocksCleared",))));
    assert_eq!(
        decode(&[b"kv", &seq, &unknown]).map(|b| b.events),
        Ok(vec![Event::AllBlocksCleared])
    );
    // Every truncation of a real payload fails cleanly.
    let real = frames(FIXTURES[2]);
    for end in 0..real[2].len() {
        let _ = decode(&[&real[0], &real[1], &real[2][..end]]);
    }
}

/// One event as vLLM's msgspec sends it today: a map tagged by `type`.
#[derive(serde::Serialize)]
struct MapEvent {
    r#type: &'static str,
    block_hashes: Vec<u64>,
    medium: Option<&'static str>,
}

fn map_batch(seq: u64, events: Vec<MapEvent>) -> Batch {
    let payload = rmp_serde::to_vec_named(&(1.5f64, events)).unwrap_or_default();
    match decode(&[b"kv", &seq.to_be_bytes(), &payload]) {
        Ok(batch) => batch,
        Err(err) => panic!("does not decode: {err}"),
    }
}

fn stored(hashes: &[u64], medium: Option<&'static str>) -> MapEvent {
    MapEvent {
        r#type: "BlockStored",
        block_hashes: hashes.to_vec(),
        medium,
    }
}

fn removed(hashes: &[u64], medium: Option<&'static str>) -> MapEvent {
    MapEvent {
        r#type: "BlockRemoved",
        block_hashes: hashes.to_vec(),
        medium,
    }
}

#[test]
fn the_medium_names_the_tier_gpu_host_or_other() {
    // vLLM's names (vllm/distributed/kv_events.py: MEDIUM_GPU, MEDIUM_CPU,
    // MEDIUM_STORAGE), any case; none means the primary cache; anything
    // else is a tier kvmesh does not price.
    let b = map_batch(
        0,
        vec![
            removed(&[1], Some("GPU")),
            removed(&[2], Some("CPU")),
            removed(&[3], Some("cpu")),
            removed(&[4], Some("STORAGE")),
            removed(&[5], None),
            removed(&[6], Some("NVMe-over-fabric")),
        ],
    );
    let media: Vec<Medium> = b
        .events
        .iter()
        .map(|e| match e {
            Event::BlockRemoved { medium, .. } => *medium,
            other => panic!("{other:?}"),
        })
        .collect();
    use Medium::*;
    assert_eq!(media, vec![Primary, Host, Host, Other, Primary, Other]);
    // A medium name over 64 bytes is refused, not kept.
    let long: &'static str = Box::leak("C".repeat(65).into_boxed_str());
    let payload = rmp_serde::to_vec_named(&(1.5f64, vec![removed(&[1], Some(long))])).unwrap_or_default();
    assert!(decode(&[b"kv", &0u64.to_be_bytes(), &payload]).is_err());
}

#[test]
fn host_copies_are_followed_apart_from_the_gpu_ones() {
    let mut cache = EngineCache::new();
    // Blocks 1, 2, 3 on the GPU; the engine offloads copies of 1 and 2.
    let a = cache.apply(&map_batch(
        0,
        vec![stored(&[1, 2, 3], Some("GPU")), stored(&[1, 2], Some("CPU"))],
    ));
    assert!(a.host_tier);
    assert_eq!(
        (cache.resident_blocks(), cache.host_blocks(), cache.host_only_blocks()),
        (3, 2, 0)
    );
    // The GPU evicts 1 and 3: 1 keeps its host copy, 3 is gone.
    let a = cache.apply(&map_batch(1, vec![removed(&[1, 3], Some("GPU"))]));
    assert_eq!((a.removed_blocks, a.removed_to_host_blocks), (2, 1));
    assert_eq!((cache.resident_blocks(), cache.host_only_blocks()), (1, 1));
    // Removing 2's host copy leaves its GPU one: no host-only block went.
    let a = cache.apply(&map_batch(2, vec![removed(&[2], Some("CPU"))]));
    assert_eq!((a.removed_blocks, a.host_only_removed_blocks), (0, 0));
    assert_eq!((cache.resident_blocks(), cache.host_only_blocks()), (1, 1));
    // Removing 1's host copy removes the block: it was on the host only.
    let a = cache.apply(&map_batch(3, vec![removed(&[1], Some("CPU"))]));
    assert_eq!(a.host_only_removed_blocks, 1);
    assert_eq!(cache.host_only_blocks(), 0);
    // A block stored on the host, then on the GPU, is not host-only; storage
    // events change nothing.
    cache.apply(&map_batch(
        4,
        vec![stored(&[7], Some("CPU")), stored(&[7], Some("GPU"))],
    ));
    cache.apply(&map_batch(
        5,
        vec![stored(&[8], Some("STORAGE")), removed(&[2], Some("STORAGE"))],
    ));
    assert_eq!(
        (cache.resident_blocks(), cache.host_blocks(), cache.host_only_blocks()),
        (2, 1, 0)
    );
    // A clear forgets both tiers.
    let a = cache.apply(&map_batch(
        6,
        vec![MapEvent {
            r#type: "AllBlocksCleared",
            block_hashes: Vec::new(),
            medium: None,
        }],
    ));
    assert!(a.cleared && a.host_tier);
    assert_eq!((cache.resident_blocks(), cache.host_blocks()), (0, 0));
}
