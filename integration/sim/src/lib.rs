//! The simulated GPU worker as a library: its engine state (prefix cache,
//! counters), its timing model, the inference APIs it speaks, and the
//! scripted agent model that answers under `--agent-script`. The
//! `kvmesh-sim` server runs them in real time; the benchmark runs the same
//! model on a virtual clock.
#![forbid(unsafe_code)]

pub mod agent;
pub mod api;
pub mod engine;
pub mod timing;
pub mod tokenizer;
