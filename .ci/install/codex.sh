#!/usr/bin/env bash
# Installs the Codex CLI (npm @openai/codex, pinned) for tests/clients into a cache directory
# outside the repository that survives between CI runs on the same machine.
# Idempotent: when the pinned version is already installed and runs, it does nothing.
set -euo pipefail

CODEX_VERSION="0.169.0"

# shellcheck source=lib/npm_cli.sh
source "$(dirname "$0")/lib/npm_cli.sh"

install_npm_cli "@openai/codex" "$CODEX_VERSION" codex
