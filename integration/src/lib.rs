//! Test and demo harness: starts real processes (simulated workers or real
//! vLLM engines, the kvmesh sidecar, a real Envoy loading the kvmesh Wasm
//! filter) on ephemeral loopback ports, talks to them, and stops them by pid.
#![forbid(unsafe_code)]

pub mod cluster;
pub mod envoy_config;
pub mod harnesses;
pub mod istio;
pub mod paths;
pub mod peers;
pub mod process;
pub mod prometheus;
pub mod redis;
pub mod vllm;
pub mod workload;

pub use cluster::{Cluster, ClusterOptions, Engine, PATIENT_SIDECAR_TIMEOUT_MS, Reply};
pub use workload::AgentSession;
