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
# release binaries (`just build-release`).
# Knobs, as environment variables (defaults: the run in docs/benchmarks.md):
#   WORKERS=3 BLOCKS=33 MAX_MODEL_LEN=4096 CONVERSATIONS=14 TURNS=9
#   ISL=180 OSL=16 CONCURRENCY=5 SEED=1 MODES="kvmesh baseline"
# With these, a conversation ends at about 9 x (180 + 16 + template) = 1,850
# tokens, 14 of them about 26k distinct tokens: twice the 3 x 33 x 128 =
# 12,672 tokens of the fleet's KV.
#   AIPERF_VENV=.tools/aiperf (where AIPerf is installed)
#   KVMESH_BENCH=target/release/kvmesh-bench
set -euo pipefail
source "$(dirname "$0")/lib.sh"

out=${1:-$bench_repo/target/aiperf}
venv=${AIPERF_VENV:-$bench_repo/.tools/aiperf}
WORKERS=${WORKERS:-3} BLOCKS=${BLOCKS:-33} MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
CONVERSATIONS=${CONVERSATIONS:-14} TURNS=${TURNS:-9} ISL=${ISL:-180} OSL=${OSL:-16}
CONCURRENCY=${CONCURRENCY:-5} SEED=${SEED:-1} MODES=${MODES:-"kvmesh baseline"}

install_aiperf "$venv"
require_deployment_inputs
mkdir -p "$out"

for mode in $MODES; do
    start_deployment "$mode" "$out"
    rm -rf "${out:?}/$mode"
    read -r before_total before_cached <<<"$(engine_tokens "${workers[@]}")"
    before_split=$(engine_prompt_by_worker "${workers[@]}")
    load_start=$(load_1m)
    started=$(date +%s.%N)
    # A local tokenizer folder is read only with HF_HUB_OFFLINE unset, and
    # `--tokenizer builtin` would download one: point it at the model's.
    env -u HF_HUB_OFFLINE "$venv/bin/aiperf" profile \
        --model kvmesh-tiny --url "$url" --endpoint-type chat --streaming \
        --tokenizer "$bench_model_dir" \
        --conversation-num "$CONVERSATIONS" --conversation-turn-mean "$TURNS" --conversation-turn-stddev 0 \
        --isl "$ISL" --isl-stddev 0 --osl "$OSL" --extra-inputs ignore_eos:true \
        --num-dataset-entries $((CONVERSATIONS * TURNS * 2)) \
        --concurrency "$CONCURRENCY" --random-seed "$SEED" \
        --ui-type none --no-server-metrics --workers-max 2 \
        --output-artifact-dir "$out/$mode" >"$out/$mode-aiperf.log" 2>&1 \
        || { echo "aiperf failed, see $out/$mode-aiperf.log" >&2; tail -20 "$out/$mode-aiperf.log" >&2; exit 1; }
    wall=$(python3 -c "import time; print(round(time.time() - $started, 1))")
    load_end=$(load_1m)
    read -r after_total after_cached <<<"$(engine_tokens "${workers[@]}")"
    after_split=$(engine_prompt_by_worker "${workers[@]}")
    stop_deployment
    python3 - "$out/$mode" "$mode" $((after_total - before_total)) $((after_cached - before_cached)) \
        "$wall" "$load_start" "$load_end" "$before_split" "$after_split" >"$out/$mode-summary.json" <<'EOF'
import glob, json, sys
art, mode = sys.argv[1], sys.argv[2]
prompt, cached, wall = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
split = [b - a for a, b in zip(map(int, sys.argv[8].split(",")), map(int, sys.argv[9].split(",")))]
def found(name):
    paths = sorted(glob.glob(f"{art}/**/{name}", recursive=True))
    if not paths:
        sys.exit(f"no {name} under {art}")
    return paths[0]
data = json.load(open(found("profile_export_aiperf.json")))
t = data.get("time_to_first_token") or {}
ttft = {k: t.get(k) for k in ("p50", "p99", "avg", "unit")}
failed = sum(e.get("count", 1) for e in data.get("error_summary") or [])
# Per turn (from 1), the prompt and cached tokens the engines reported in
# each reply's usage, from AIPerf's per-request records.
by_turn = {}
for line in open(found("profile_export.jsonl")):
    r = json.loads(line)
    m, turn = r.get("metrics") or {}, (r.get("metadata") or {}).get("turn_index")
    if r.get("error") or turn is None:
        continue
    v = by_turn.setdefault(int(turn) + 1, [0, 0])
    v[0] += (m.get("usage_prompt_tokens") or {}).get("value") or 0
    v[1] += (m.get("usage_prompt_cache_read_tokens") or {}).get("value") or 0
turns = range(1, max(by_turn, default=0) + 1)
print(json.dumps({"mode": mode, "engine_prompt_tokens": prompt, "engine_cached_tokens": cached,
                  "engine_hit_rate": cached / max(prompt, 1), "engine_prompt_tokens_by_worker": split,
                  "ttft_ms": ttft,
                  "requests": (data.get("request_count") or {}).get("avg"), "failed": failed,
                  "prompt_tokens_by_turn": [by_turn.get(t, [0, 0])[0] for t in turns],
                  "cached_tokens_by_turn": [by_turn.get(t, [0, 0])[1] for t in turns],
                  "benchmark_s": (data.get("benchmark_duration") or {}).get("avg"), "wall_s": wall,
                  "load_1m": [float(sys.argv[6]), float(sys.argv[7])]}))
EOF
    cat "$out/$mode-summary.json"
done
