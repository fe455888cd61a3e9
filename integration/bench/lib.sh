# Shared by the client benchmarks (aiperf.sh, inference_perf.sh) and the
# `setup-bench-clients` recipe: the clients' pinned installs, a fresh local
# deployment on real vLLM workers per mode, and the engines' token counters.
# Sourced, never run; the caller sets `set -euo pipefail`.

bench_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bench_target=${CARGO_TARGET_DIR:-$bench_repo/target}
# `kvmesh-bench serve` starts the release sidecar (and Envoy with the release
# filter) whichever kvmesh-bench runs it.
bench_bin=${KVMESH_BENCH:-$bench_target/release/kvmesh-bench}
bench_model_dir=$bench_repo/.tools/vllm-model
AIPERF_VERSION=0.13.0
INFERENCE_PERF_VERSION=0.7.0

# AIPerf, pinned, in its own venv; skipped while the stamp matches.
install_aiperf() {
    local venv=$1 want="aiperf==$AIPERF_VERSION"
    [[ "$(cat "$venv/.kvmesh-installed" 2>/dev/null)" == "$want" ]] && return 0
    echo "installing $want into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$want"
    echo "$want" >"$venv/.kvmesh-installed"
}

# inference-perf, pinned, in its own venv; skipped while the stamp (the
# version and a hash of the constraints) matches.
#
# 0.7.0 declares `Requires-Python >=3.12`, but it runs on 3.11 (this
# machine's Python, Debian 12's): nothing in it is 3.12-only. Checked on 3.11:
# the package byte-compiles (`compileall`, which would reject 3.12 syntax
# such as `type` aliases or PEP 695 generics), every one of its modules
# imports, and its multi-turn runs through both listeners (docs/benchmarks.md).
# So pip is told to ignore the declaration. That also lifts the check for
# its dependencies, where it matters: pip would take numpy 2.5, which needs
# 3.12 and has no 3.11 wheel, and try to build it from source. The
# constraints file holds every package at the version resolved and checked
# on 3.11 (numpy 2.3.5, av 16.1.0, transformers 5.13.0), and
# `--only-binary=:all:` fails rather than build anything. The two checks
# run again after each install.
install_inference_perf() {
    local venv=$1 constraints=$bench_repo/integration/bench/inference-perf-constraints.txt want
    want="inference-perf==$INFERENCE_PERF_VERSION $(sha256sum "$constraints" | cut -c1-16)"
    [[ "$(cat "$venv/.kvmesh-installed" 2>/dev/null)" == "$want" ]] && return 0
    echo "installing inference-perf==$INFERENCE_PERF_VERSION into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --ignore-requires-python \
        --only-binary=:all: -c "$constraints" "inference-perf==$INFERENCE_PERF_VERSION"
    "$venv/bin/python" - <<'EOF'
import compileall, importlib, os, pkgutil, sys
import inference_perf
root = os.path.dirname(inference_perf.__file__)
if not compileall.compile_dir(root, quiet=1):
    sys.exit(f"inference-perf does not compile on Python {sys.version.split()[0]}")
for m in pkgutil.walk_packages([root], "inference_perf."):
    importlib.import_module(m.name)
EOF
    echo "$want" >"$venv/.kvmesh-installed"
}

# What a run needs that the install does not make.
require_deployment_inputs() {
    [[ -x $bench_bin ]] || { echo "no $bench_bin: run \`just build-release\` (or ./dev test, which builds it)" >&2; exit 1; }
    [[ -d $bench_model_dir ]] || { echo "no $bench_model_dir: run ./dev setup-vllm" >&2; exit 1; }
}

# The engines' prompt and cached tokens, summed over the workers' URLs.
engine_tokens() {
    local total=0 cached=0 w t c
    for w in "$@"; do
        read -r t c <<<"$(curl -sf "$w/metrics" | awk '
            /^vllm:prompt_tokens_total[{ ]/ {t += $NF}
            /^vllm:prompt_tokens_cached_total[{ ]/ {c += $NF}
            END {printf "%d %d", t, c}')"
        total=$((total + t)) cached=$((cached + c))
    done
    echo "$total $cached"
}

# Each worker's prompt tokens, comma-separated, in the order of the URLs:
# how the run was spread over the engines.
engine_prompt_by_worker() {
    local w list=()
    for w in "$@"; do
        list+=("$(curl -sf "$w/metrics" | awk '/^vllm:prompt_tokens_total[{ ]/ {t += $NF} END {printf "%d", t}')")
    done
    (IFS=,; echo "${list[*]}")
}

# The 1-minute load average.
load_1m() { cut -d' ' -f1 /proc/loadavg; }

# Starts a fresh deployment for `mode` (kvmesh or baseline) with its files
# under `out`: sets $serve (the pid of `kvmesh-bench serve`, which stops
# Envoy, the sidecar and every vLLM group on SIGTERM), $url (the mode's
# listener) and $workers (the engines' URLs). Needs WORKERS, BLOCKS and
# MAX_MODEL_LEN.
start_deployment() {
    local mode=$1 out=$2 urls=$2/$1-urls.json log=$2/$1-serve.log
    case $mode in
        kvmesh | baseline) ;;
        *) echo "unknown mode $mode (kvmesh or baseline)" >&2; exit 1 ;;
    esac
    : >"$urls"
    "$bench_bin" serve --engine vllm --local "$WORKERS" --vllm-blocks "$BLOCKS" \
        --max-model-len "$MAX_MODEL_LEN" >"$urls" 2>"$log" &
    serve=$!
    trap stop_deployment EXIT
    for _ in $(seq 600); do
        [[ -s $urls ]] && break
        kill -0 "$serve" 2>/dev/null || { echo "kvmesh-bench serve failed, see $log" >&2; tail -5 "$log" >&2; exit 1; }
        sleep 1
    done
    [[ -s $urls ]] || { echo "kvmesh-bench serve not ready in 600 s, see $log" >&2; exit 1; }
    url=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2] + '_url'])" "$urls" "$mode")
    read -r -a workers <<<"$(python3 -c "import json,sys; print(' '.join(json.load(open(sys.argv[1]))['workers']))" "$urls")"
}

stop_deployment() {
    if [[ -n ${serve:-} ]]; then
        kill "$serve" 2>/dev/null || true
        wait "$serve" 2>/dev/null || true
        serve=
    fi
    trap - EXIT
}
