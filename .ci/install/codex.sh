#!/usr/bin/env bash
# Installs the Codex CLI (npm @openai/codex, pinned) for tests/clients into a cache directory
# outside the repository that survives between CI runs on the same machine.
# Idempotent: when the pinned version is already installed and runs, it does nothing.
set -euo pipefail

CODEX_VERSION="0.169.0"
DIR="${KVWARM_CLIENTS_DIR:-$HOME/.cache/kvwarm-clients}"
BIN="$DIR/node_modules/.bin/codex"
PKG="$DIR/node_modules/@openai/codex/package.json"

installed_version() {
  [ -f "$PKG" ] || return 1
  sed -n 's/^[[:space:]]*"version":[[:space:]]*"\([^"]*\)".*/\1/p' "$PKG" | head -n1
}

if [ "$(installed_version || true)" = "$CODEX_VERSION" ] && [ -x "$BIN" ] \
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
npm install --prefix "$DIR" --no-audit --no-fund --no-progress --loglevel=error \
  --save-exact "@openai/codex@$CODEX_VERSION" >/dev/null

"$BIN" --version
