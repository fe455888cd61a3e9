#!/usr/bin/env bash
# inference-perf (the Kubernetes serving workgroup's benchmark client) in its
# multi-turn mode (`conversation_replay`) against the local deployment on
# real vLLM workers, once through kvmesh and once through Envoy's listener
# without the filter (plain round robin), each on a fresh deployment so the
# second run does not start from the first one's cache. inference-perf sends
# each conversation's id in the header named by `api.session_id_header_key`;
# it is set to `x-session-id`, one of the filter's default session sources.
#
#   integration/bench/inference_perf.sh [results-dir]
#
# Prints one JSON line per mode (also in <results-dir>/<mode>-summary.json):
# the engines' hit rate (the growth of their vllm:prompt_tokens_cached_total
# over that of vllm:prompt_tokens_total), the infinite-cache bound of the
# prompts sent in vLLM's 128-token blocks, inference-perf's TTFT and failed
# requests, and prompt and cached tokens per turn from the replies' usage.
#
# Needs `./dev setup-vllm` (the engines and .tools/vllm-model) and the
# release binaries (`just build-release`). Knobs, as environment variables
# (defaults: the run in docs/benchmarks.md):
#   WORKERS=3 BLOCKS=33 MAX_MODEL_LEN=4096 CONVERSATIONS=15 TURNS=9
#   SYSTEM=100 ISL=150 OSL=16 CONCURRENCY=5 SLOTS=$CONCURRENCY SEED=1
#   MODES="kvmesh baseline"
# conversation_replay keeps SLOTS conversations open: each slot sends its
# conversation's turns in order, each after the previous one answered, and
# when they run out starts the next conversation (CONVERSATIONS / SLOTS in
# all per slot). Its next conversation replays the slot's own blueprint (the
# same system prompt and user turns; the replies differ, vLLM samples) under
# a new session id. SYSTEM is each blueprint's own system prompt:
# conversation_replay carries a conversation's history into its next turn
# only when it has one. Its text is random token ids decoded, which the
# tokenizer reads back 10-20 % longer, so ISL=150 rather than aiperf.sh's
# 180: a conversation ends near aiperf.sh's 1,850 tokens (a few blueprints'
# turns decode to text many times longer), the 5 open at once about the
# 3 x 33 x 128 = 12,672 tokens of the fleet's KV, and all 15 about three
# times it.
#   INFERENCE_PERF_VENV=.tools/inference-perf (where it is installed)
#   KVMESH_BENCH=target/release/kvmesh-bench
set -euo pipefail
source "$(dirname "$0")/lib.sh"

out=${1:-$bench_repo/target/inference-perf}
venv=${INFERENCE_PERF_VENV:-$bench_repo/.tools/inference-perf}
WORKERS=${WORKERS:-3} BLOCKS=${BLOCKS:-33} MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
CONVERSATIONS=${CONVERSATIONS:-15} TURNS=${TURNS:-9} ISL=${ISL:-150} OSL=${OSL:-16}
SYSTEM=${SYSTEM:-100} CONCURRENCY=${CONCURRENCY:-5} SLOTS=${SLOTS:-$CONCURRENCY} SEED=${SEED:-1}
MODES=${MODES:-"kvmesh baseline"}
((CONVERSATIONS % SLOTS == 0)) || { echo "CONVERSATIONS=$CONVERSATIONS is not a multiple of SLOTS=$SLOTS" >&2; exit 1; }

install_inference_perf "$venv"
require_deployment_inputs
mkdir -p "$out"

# A fixed distribution: every conversation, turn and reply the same length.
fixed() { echo "{type: fixed, mean: $1, min: $1, max: $1, std_dev: 0}"; }

for mode in $MODES; do
    start_deployment "$mode" "$out"
    rm -rf "${out:?}/$mode"
    # One stage of CONVERSATIONS x TURNS requests over SLOTS open conversations.
    cat >"$out/$mode-config.yml" <<EOF
api:
  type: completion
  streaming: true
  session_id_header_key: x-session-id
data:
  type: conversation_replay
  conversation_replay:
    seed: $SEED
    num_conversations: $SLOTS
    shared_system_prompt_len: 0
    dynamic_system_prompt_len: $(fixed "$SYSTEM")
    turns_per_conversation: $(fixed "$TURNS")
    input_tokens_per_turn: $(fixed "$ISL")
    output_tokens_per_turn: $(fixed "$OSL")
    max_model_len: $MAX_MODEL_LEN
load:
  type: concurrent
  stages:
    - num_requests: $((CONVERSATIONS * TURNS))
      concurrency_level: $CONCURRENCY
  num_workers: 2
  base_seed: $SEED
server:
  type: vllm
  model_name: kvmesh-tiny
  base_url: $url
  ignore_eos: true
tokenizer:
  pretrained_model_name_or_path: $bench_model_dir
report:
  request_lifecycle:
    summary: true
    per_stage: false
    per_request: true
storage:
  local_storage:
    path: $out/$mode
EOF
    read -r before_total before_cached <<<"$(engine_tokens "${workers[@]}")"
    before_split=$(engine_prompt_by_worker "${workers[@]}")
    load_start=$(load_1m)
    started=$(date +%s.%N)
    # Nothing is downloaded: the tokenizer is the model's own folder.
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
        "$venv/bin/inference-perf" --config_file "$out/$mode-config.yml" >"$out/$mode-inference-perf.log" 2>&1 \
        || { echo "inference-perf failed, see $out/$mode-inference-perf.log" >&2; tail -20 "$out/$mode-inference-perf.log" >&2; exit 1; }
    wall=$(python3 -c "import time; print(round(time.time() - $started, 1))")
    load_end=$(load_1m)
    read -r after_total after_cached <<<"$(engine_tokens "${workers[@]}")"
    after_split=$(engine_prompt_by_worker "${workers[@]}")
    stop_deployment
    HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error "$venv/bin/python" - "$out/$mode" "$mode" \
        $((after_total - before_total)) $((after_cached - before_cached)) \
        "$wall" "$load_start" "$load_end" "$before_split" "$after_split" "$bench_model_dir" >"$out/$mode-summary.json" <<'EOF'
import glob, hashlib, json, sys
from transformers import AutoTokenizer
art, mode = sys.argv[1], sys.argv[2]
prompt, cached, wall = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
split = [b - a for a, b in zip(map(int, sys.argv[8].split(",")), map(int, sys.argv[9].split(",")))]
BLOCK = 128
def report(name):
    found = sorted(glob.glob(f"{art}/**/{name}", recursive=True))
    if not found:
        sys.exit(f"no {name} under {art}")
    return json.load(open(found[0]))
summary = report("summary_lifecycle_metrics.json")
ok, failed = summary["successes"], summary["failures"]
ttft = (ok.get("latency") or {}).get("time_to_first_token") or {}
# Per turn (the conversation's round, from 1), the prompt and cached tokens
# the engines reported in each reply's usage.
requests = sorted(report("per_request_lifecycle_metrics.json"), key=lambda r: r["start_time"])
# The infinite-cache bound in vLLM's full 128-token blocks: each prompt as
# the engine tokenizes it, in the order sent; a request could at best reuse
# its run of leading full blocks that an earlier request already had.
tokenizer = AutoTokenizer.from_pretrained(sys.argv[10])
seen, bound, sent = set(), 0, 0
for r in requests:
    ids = tokenizer(json.loads(r["request"])["prompt"])["input_ids"]
    h, leading = hashlib.sha256(), True
    for b in range(len(ids) // BLOCK):
        h.update(json.dumps(ids[b * BLOCK:(b + 1) * BLOCK]).encode())
        leading = leading and h.hexdigest() in seen
        bound += BLOCK if leading else 0
        seen.add(h.hexdigest())
    sent += len(ids)
by_turn = {}
for r in requests:
    info = r.get("info") or {}
    turn = (info.get("extra_info") or {}).get("chat_round")
    usage = (info.get("response_metrics") or {}).get("server_usage") or {}
    if r.get("error") is None and turn is not None:
        t = by_turn.setdefault(int(turn), [0, 0])
        t[0] += usage.get("prompt_tokens") or 0
        t[1] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
turns = range(1, max(by_turn, default=0) + 1)
ms = lambda v: None if v is None else round(v * 1000, 1)
print(json.dumps({
    "mode": mode, "engine_prompt_tokens": prompt, "engine_cached_tokens": cached,
    "engine_hit_rate": round(cached / max(prompt, 1), 4), "engine_prompt_tokens_by_worker": split,
    "bound_hit_rate": round(bound / max(sent, 1), 4), "distinct_full_blocks": len(seen),
    "ttft_ms": {"p50": ms(ttft.get("median")), "p99": ms(ttft.get("p99")), "mean": ms(ttft.get("mean"))},
    "requests": ok["count"], "failed": failed["count"],
    "client_prompt_tokens": ok["prompt_tokens"]["total"], "client_cached_tokens": ok["prompt_tokens"]["cached"],
    "prompt_tokens_by_turn": [by_turn.get(t, [0, 0])[0] for t in turns],
    "cached_tokens_by_turn": [by_turn.get(t, [0, 0])[1] for t in turns],
    "benchmark_s": round(summary["benchmark_time_seconds"], 1), "wall_s": wall,
    "load_1m": [float(sys.argv[6]), float(sys.argv[7])],
}))
EOF
    cat "$out/$mode-summary.json"
done
