# kvmesh tasks. `./dev <recipe>` installs the tools first; `just <recipe>`
# works once they are on PATH.

set shell := ["bash", "-euo", "pipefail", "-c"]

wasm_target := "wasm32-wasip1"

# List the recipes.
default:
    @just --list

# Build the sidecar, the simulator and the demo (debug) and the Wasm filter (release).
build:
    cargo build --workspace --bins --locked
    cargo build --release --locked --target {{wasm_target}} -p kvmesh-filter
    @ls -l target/{{wasm_target}}/release/kvmesh_filter.wasm
    # Tests only: the filter that panics on demand (VM reload tests).
    cargo build --release --locked --target {{wasm_target}} -p kvmesh-filter --features crash-test --target-dir target/crash-test

# Run the demo: Envoy + filter + sidecar + 3 simulated workers, two agent sessions.
demo: build
    ./target/debug/kvmesh-demo

# The whole suite, as CI runs it: formatting, lints, codegen drift, unit and end-to-end tests.
# Every test binary runs (no stop at the first failure); a summary of what failed ends the output.
test *args: check-fmt clippy check-codegen build build-release setup-vllm setup-bench-clients setup-harnesses setup-peers
    integration/suite/run.sh {{args}}

# The whole suite while a busy loop holds one core (KVMESH_BUSY_LOOPS=N for more): run it
# before resolving anything that touches timing. Prints the load average seen.
test-under-load *args:
    integration/suite/under-load.sh just test {{args}}

# The release binaries the benchmarks and their smoke tests run (`kvmesh-bench serve`).
build-release:
    cargo build --release --locked -p kvmesh-bench -p kvmesh-sidecar -p kvmesh-sim --bins

# Install the real vLLM (CPU build) into .tools/vllm and build its tiny model (docs/vllm.md).
setup-vllm:
    integration/vllm/setup.sh

# Install the benchmark clients, AIPerf and inference-perf, into .tools (docs/benchmarks.md).
setup-bench-clients:
    source integration/bench/lib.sh && install_aiperf .tools/aiperf && install_inference_perf .tools/inference-perf

# Install the real peer routers (smg, the SGLang Model Gateway; NVIDIA Dynamo and its vLLM worker) at pinned
# versions into .tools/peers (after setup-vllm: Dynamo's worker runs over its torch).
setup-peers:
    integration/peers/setup.sh

# Install the four real agent harnesses (Claude Code, Codex, OpenCode, OpenClaw) and Node 24
# at pinned versions into .tools/harnesses (docs/harnesses/README.md).
setup-harnesses:
    integration/harnesses/setup.sh

# Formatting must be clean.
check-fmt:
    cargo fmt --all -- --check

# Clippy with warnings denied, natively and for the Wasm build.
clippy:
    cargo clippy --workspace --all-targets --locked -- -D warnings
    # The sidecar's pure modules alone, as the fuzz targets link them.
    cargo clippy --locked -p kvmesh-sidecar --no-default-features --lib --tests -- -D warnings
    cargo clippy --locked --target {{wasm_target}} -p kvmesh-filter -p kvmesh-request -p kvmesh-proto -- -D warnings
    cargo clippy --locked --target {{wasm_target}} -p kvmesh-filter --features crash-test -- -D warnings

# Regenerate proto/src/gen from proto/kvmesh/v1/kvmesh.proto.
codegen:
    cargo run -q --locked -p kvmesh-proto-codegen

# Fail if proto/src/gen drifted from the proto.
check-codegen:
    cargo run -q --locked -p kvmesh-proto-codegen -- --check

# Validate envoy/envoy.yaml with the real Envoy (loads the filter, binds nothing).
validate-envoy: build
    envoy --mode validate --disable-hot-restart -c envoy/envoy.yaml

# Render one Istio overlay (envoy/istio/overlays/<overlay>) to stdout.
render-istio overlay="sidecar":
    kubectl kustomize envoy/istio/overlays/{{overlay}}

# Render every Istio overlay and validate it (Istio CRD and Kubernetes schemas).
validate-istio:
    #!/usr/bin/env bash
    set -euo pipefail
    for overlay in envoy/istio/overlays/*/; do
        printf '%s: ' "$(basename "$overlay")"
        kubectl kustomize "$overlay" | python3 envoy/istio/validate.py -
    done

# Run the standalone Envoy of envoy/envoy.yaml in the foreground.
envoy: build
    envoy -c envoy/envoy.yaml --disable-hot-restart

# The filter's request work in V8 (Node.js), per hash: docs/benchmarks.md.
bench-v8:
    cargo build --release --locked --target {{wasm_target}} -p kvmesh-request --example v8_throughput
    node --no-warnings integration/bench/run-wasi.mjs target/{{wasm_target}}/release/examples/v8_throughput.wasm

# What the filter adds in the real Envoy, by body size: docs/benchmarks.md.
bench-overhead hash="xxh3": build
    cargo build --release --locked --workspace --bins
    ./target/release/kvmesh-bench filter-overhead --hash {{hash}}

# Fuzz each target for `seconds` (default 300) with cargo fuzz; new inputs join fuzz/corpus.
fuzz seconds="300": (fuzz-each seconds "grow")

# CI's bounded fuzz run: the committed corpus, then 20 s of new inputs per target.
fuzz-smoke: (fuzz-each "20" "scratch")

[private]
fuzz-each seconds corpus:
    #!/usr/bin/env bash
    set -euo pipefail
    cd fuzz
    for target in request usage pick_report engine_metrics snapshot kv_events; do
        # CI writes new inputs to a scratch directory, not the committed corpus.
        dirs=(corpus/$target)
        if [ "{{corpus}}" = scratch ]; then dirs=("$(mktemp -d)" corpus/$target); fi
        log=$(mktemp)
        if ! cargo +nightly fuzz run -O "$target" "${dirs[@]}" -- \
            -max_total_time={{seconds}} -max_len=65536 -rss_limit_mb=1536 >"$log" 2>&1; then
            tail -n 60 "$log"
            echo "fuzz target $target failed; the crashing input is under fuzz/artifacts/$target" >&2
            exit 1
        fi
        echo "$target: $(tail -n 1 "$log")"
    done
