#!/usr/bin/env bash
# AIPerf (NVIDIA's benchmark client) in its multi-turn mode against the local
# deployment on real vLLM workers, once through kvmesh and once through
# Envoy's listener without the filter (plain round robin), each on a fresh
# deployment so the second run does not start from the first one's cache.
# AIPerf sends `X-Session-Affinity` (the conversation's correlation id) on
# every turn, which the kvmesh filter reads as the session.
#
#   integration/bench/aiperf.sh [results-dir]
#
# Needs `./dev setup-vllm` (the engines and .tools/vllm-model) and the
# release binaries (kvmesh-bench, kvmesh-sidecar, the filter's Wasm).
# Knobs, as environment variables (defaults: the run in docs/benchmarks.md):
#   WORKERS=3 BLOCKS=33 MAX_MODEL_LEN=4096 CONVERSATIONS=14 TURNS=9
#   ISL=180 OSL=16 CONCURRENCY=5 SEED=1 MODES="kvmesh baseline"
# With these, a conversation ends at about 9 x (180 + 16 + template) = 1,850
# tokens, 14 of them about 26k distinct tokens: twice the 3 x 33 x 128 =
# 12,672 tokens of the fleet's KV.
#   AIPERF_VENV=.tools/aiperf (where AIPerf is installed)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$repo/target/aiperf}
venv=${AIPERF_VENV:-$repo/.tools/aiperf}
target=${CARGO_TARGET_DIR:-$repo/target}
bench=$target/release/kvmesh-bench
model_dir=$repo/.tools/vllm-model
AIPERF_VERSION=0.13.0

WORKERS=${WORKERS:-3} BLOCKS=${BLOCKS:-33} MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
CONVERSATIONS=${CONVERSATIONS:-14} TURNS=${TURNS:-9} ISL=${ISL:-180} OSL=${OSL:-16}
CONCURRENCY=${CONCURRENCY:-5} SEED=${SEED:-1} MODES=${MODES:-"kvmesh baseline"}

# 1. AIPerf, pinned, in its own venv; skipped while the stamp matches.
stamp=$venv/.kvmesh-installed
if [[ "$(cat "$stamp" 2>/dev/null)" != "aiperf==$AIPERF_VERSION" ]]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "aiperf==$AIPERF_VERSION"
    echo "aiperf==$AIPERF_VERSION" >"$stamp"
fi
[[ -x $bench ]] || { echo "no $bench: cargo build --release --locked -p kvmesh-bench -p kvmesh-sidecar -p kvmesh-sim --bins" >&2; exit 1; }
[[ -d $model_dir ]] || { echo "no $model_dir: run ./dev setup-vllm" >&2; exit 1; }
mkdir -p "$out"

# The engines' prompt and cached tokens, summed over workers.
engine_tokens() {
    local total=0 cached=0 w t c
    for w in "$@"; do
        t=$(curl -s "$w/metrics" | awk '/^vllm:prompt_tokens_total[{ ]/ {s+=$NF} END {printf "%d", s}')
        c=$(curl -s "$w/metrics" | awk '/^vllm:prompt_tokens_cached_total[{ ]/ {s+=$NF} END {printf "%d", s}')
        total=$((total + t)) cached=$((cached + c))
    done
    echo "$total $cached"
}

for mode in $MODES; do
    log=$out/$mode-serve.log
    # Its own process group's leader is `kvmesh-bench serve`, which stops
    # Envoy, the sidecar and every vLLM group when it gets SIGTERM.
    "$bench" serve --engine vllm --local "$WORKERS" --vllm-blocks "$BLOCKS" \
        --max-model-len "$MAX_MODEL_LEN" >"$out/$mode-urls.json" 2>"$log" &
    serve=$!
    trap 'kill $serve 2>/dev/null; wait $serve 2>/dev/null' EXIT
    for _ in $(seq 600); do
        [[ -s $out/$mode-urls.json ]] && break
        kill -0 $serve 2>/dev/null || { echo "serve failed, see $log" >&2; tail -5 "$log" >&2; exit 1; }
        sleep 1
    done
    urls=$out/$mode-urls.json
    field() { python3 -c "import json,sys; v=json.load(open(sys.argv[1]))[sys.argv[2]]; print(' '.join(v) if isinstance(v, list) else v)" "$urls" "$1"; }
    case $mode in
        kvmesh) url=$(field kvmesh_url) ;;
        baseline) url=$(field baseline_url) ;;
        *) echo "unknown mode $mode" >&2; exit 1 ;;
    esac
    read -r -a workers <<<"$(field workers)"
    read -r before_total before_cached <<<"$(engine_tokens "${workers[@]}")"
    started=$(date +%s.%N)
    # A local tokenizer folder is read only with HF_HUB_OFFLINE unset, and
    # `--tokenizer builtin` would download one: point it at the model's.
    env -u HF_HUB_OFFLINE "$venv/bin/aiperf" profile \
        --model kvmesh-tiny --url "$url" --endpoint-type chat --streaming \
        --tokenizer "$model_dir" \
        --conversation-num "$CONVERSATIONS" --conversation-turn-mean "$TURNS" --conversation-turn-stddev 0 \
        --isl "$ISL" --isl-stddev 0 --osl "$OSL" --extra-inputs ignore_eos:true \
        --num-dataset-entries $((CONVERSATIONS * TURNS * 2)) \
        --concurrency "$CONCURRENCY" --random-seed "$SEED" \
        --ui-type none --no-server-metrics --workers-max 2 \
        --output-artifact-dir "$out/$mode" >"$out/$mode-aiperf.log" 2>&1
    wall=$(python3 -c "import time; print(round(time.time() - $started, 1))")
    read -r after_total after_cached <<<"$(engine_tokens "${workers[@]}")"
    prompt=$((after_total - before_total)) cached=$((after_cached - before_cached))
    python3 - "$out/$mode" "$mode" "$prompt" "$cached" "$wall" >"$out/$mode-summary.json" <<'EOF'
import glob, json, sys
art, mode, prompt, cached, wall = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
found = glob.glob(f"{art}/**/profile_export_aiperf.json", recursive=True)
ttft, requests = {}, None
if found:
    data = json.load(open(found[0]))
    t = data.get("time_to_first_token") or data.get("records", {}).get("time_to_first_token") or {}
    ttft = {k: t.get(k) for k in ("p50", "p99", "avg", "unit")}
    requests = (data.get("request_count") or {}).get("avg")
print(json.dumps({"mode": mode, "engine_prompt_tokens": prompt, "engine_cached_tokens": cached,
                  "engine_hit_rate": cached / max(prompt, 1), "ttft_ms": ttft, "requests": requests,
                  "wall_s": wall}))
EOF
    cat "$out/$mode-summary.json"
    kill $serve
    wait $serve || true
    trap - EXIT
done
