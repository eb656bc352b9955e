#!/usr/bin/env bash
# Installs the Claude Code CLI (npm @anthropic-ai/claude-code, pinned) for tests/clients into the
# cache directory outside the repository that .ci/install/codex.sh installs the Codex CLI into.
# Idempotent: when the pinned version is already installed and runs, it does nothing.
set -euo pipefail

CLAUDE_VERSION="2.1.332"

# shellcheck source=lib/npm_cli.sh
source "$(dirname "$0")/lib/npm_cli.sh"

# The package is a launcher with the native binary in a per-platform optional dependency
# (@anthropic-ai/claude-code-linux-x64, ...): optional dependencies must not be omitted.
# --no-engine-strict: its "node >= 22" is the launcher's wish; the native binary needs no node.
install_npm_cli "@anthropic-ai/claude-code" "$CLAUDE_VERSION" claude --include=optional --no-engine-strict
