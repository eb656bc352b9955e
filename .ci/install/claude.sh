#!/usr/bin/env bash
# Installs the Claude Code CLI (npm @anthropic-ai/claude-code, pinned) for tests/clients into the
# cache directory outside the repository that .ci/install/codex.sh installs the Codex CLI into.
# Idempotent: when the pinned version is already installed and runs, it does nothing.
set -euo pipefail

CLAUDE_VERSION="2.1.332"
DIR="${KVWARM_CLIENTS_DIR:-$HOME/.cache/kvwarm-clients}"
BIN="$DIR/node_modules/.bin/claude"
PKG="$DIR/node_modules/@anthropic-ai/claude-code/package.json"

installed_version() {
  [ -f "$PKG" ] || return 1
  sed -n 's/^[[:space:]]*"version":[[:space:]]*"\([^"]*\)".*/\1/p' "$PKG" | head -n1
}

if [ "$(installed_version || true)" = "$CLAUDE_VERSION" ] && [ -x "$BIN" ] \
   && "$BIN" --version >/dev/null 2>&1; then
  exit 0
fi

if ! command -v npm >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi

mkdir -p "$DIR"
# A private package.json keeps npm from walking up into some other project.
[ -f "$DIR/package.json" ] || printf '{\n  "name": "kvwarm-clients",\n  "private": true\n}\n' >"$DIR/package.json"
# The package is a launcher with the native binary in a per-platform optional dependency
# (@anthropic-ai/claude-code-linux-x64, ...): optional dependencies must not be omitted.
# --no-engine-strict: its "node >= 22" is the launcher's wish; the native binary needs no node.
npm install --prefix "$DIR" --no-audit --no-fund --no-progress --loglevel=error \
  --include=optional --no-engine-strict \
  --save-exact "@anthropic-ai/claude-code@$CLAUDE_VERSION" >/dev/null

"$BIN" --version
