#!/usr/bin/env bash
# Install Debian's headless-capable Chromium for tests/web (the dashboard page in a real browser).
# Idempotent: does nothing when a chromium binary is already on PATH. Needs root (apt-get).
set -euo pipefail

for name in chromium chromium-browser; do
  if command -v "$name" >/dev/null 2>&1; then
    echo "chromium: already installed ($(command -v "$name"))"
    exit 0
  fi
done

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# fonts-dejavu-core: a readable default font for the screenshots (the page uses the system UI font stack).
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
echo "chromium: installed ($(command -v chromium))"
