//! KV event messages captured from a real vLLM 0.32, as the sidecar
//! receives them (the frames of one message each), shared by the decoder's
//! tests and the subscriber's.

pub(crate) const FIXTURES: [&[u8]; 8] = [
    include_bytes!("../fixtures/kv_events/vllm-0.32-seq000.frames"),
    include_bytes!("../fixtures/kv_events/vllm-0.32-seq001.frames"),
    include_bytes!("../fixtures/kv_events/vllm-0.32-seq002.frames"),
    include_bytes!("../fixtures/kv_events/vllm-0.32-seq003.frames"),
    include_bytes!("../fixtures/kv_events/vllm-0.32-seq004.frames"),
    include_bytes!("../fixtures/kv_events/vllm-0.32-seq005.frames"),
    include_bytes!("../fixtures/kv_events/vllm-0.32-seq006.frames"),
    include_bytes!("../fixtures/kv_events/vllm-0.32-seq007.frames"),
];
