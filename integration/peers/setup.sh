#!/usr/bin/env bash
# Installs the real peer routers kvmesh is compared with, at pinned
# versions, each into its own venv under .tools/peers, so no test fetches
# anything at run time. For now one peer:
#
#   .tools/peers/smg/bin/smg    the SGLang Model Gateway (Rust, shipped as a
#                               binary wheel), run by integration/src/peers.rs
#
# Idempotent: a stamp file holds the pinned versions, and a run with it
# current returns at once. Only binary wheels are accepted: smg is a
# prebuilt Rust binary, and building it from an sdist would need a Rust
# build of its own, minutes on 2 cores. Its few Python dependencies are held
# at the versions first resolved (integration/peers/smg-constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

uv_version=0.13.8
smg_version=1.13.0
dir=$root/.tools/peers
smg_venv=$dir/smg
here=$root/integration/peers

say() { printf 'kvmesh setup-peers: %s\n' "$*" >&2; }

want="uv=$uv_version smg=$smg_version pins=$(sha256sum <"$here/smg-constraints.txt" | cut -c1-16)"
if [ "$(cat "$smg_venv/.kvmesh-installed" 2>/dev/null)" = "$want" ]; then
    exit 0
fi

say "installing smg $smg_version (SGLang Model Gateway) into .tools/peers/smg"
start=$SECONDS
rm -f "$smg_venv/.kvmesh-installed"
mkdir -p "$dir"
[ -x "$smg_venv/bin/python" ] || python3 -m venv "$smg_venv"
"$smg_venv/bin/pip" install --quiet --disable-pip-version-check "uv==$uv_version"
# uv does not read pip's configuration: hand it the system CA bundle.
SSL_CERT_FILE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt} \
    "$smg_venv/bin/uv" pip install --quiet --python "$smg_venv/bin/python" \
    --only-binary :all: --constraint "$here/smg-constraints.txt" "smg==$smg_version"

# The pinned version is what runs, and its router CLI answers.
got=$("$smg_venv/bin/python" -c 'import importlib.metadata as m; print(m.version("smg"))')
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
