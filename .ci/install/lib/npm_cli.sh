# Sourced by .ci/install/claude.sh and .ci/install/codex.sh (a subdirectory: .ci/run runs every
# .ci/install/*.sh, and this is not an install of its own).
#
# install_npm_cli PACKAGE VERSION BIN [NPM_ARG...]: installs the npm package PACKAGE at exactly
# VERSION into the cache directory outside the repository that survives between CI runs on the
# same machine ($KVWARM_CLIENTS_DIR, default ~/.cache/kvwarm-clients), then prints the version
# its launcher BIN reports. Idempotent: when VERSION is already installed and its launcher runs,
# it does nothing. NPM_ARG...: extra arguments for npm install.

install_npm_cli() {
  local package="$1" version="$2" name="$3"
  shift 3
  local dir="${KVWARM_CLIENTS_DIR:-$HOME/.cache/kvwarm-clients}"
  local bin="$dir/node_modules/.bin/$name"
  local pkg="$dir/node_modules/$package/package.json"

  local installed=""
  if [ -f "$pkg" ]; then
    installed="$(sed -n 's/^[[:space:]]*"version":[[:space:]]*"\([^"]*\)".*/\1/p' "$pkg" | head -n1)"
  fi
  if [ "$installed" = "$version" ] && [ -x "$bin" ] && "$bin" --version >/dev/null 2>&1; then
    return 0
  fi

  if ! command -v npm >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  fi

  mkdir -p "$dir"
  # A private package.json keeps npm from walking up into some other project.
  [ -f "$dir/package.json" ] || printf '{\n  "name": "kvwarm-clients",\n  "private": true\n}\n' >"$dir/package.json"
  npm install --prefix "$dir" --no-audit --no-fund --no-progress --loglevel=error \
    "$@" --save-exact "$package@$version" >/dev/null

  "$bin" --version
}
