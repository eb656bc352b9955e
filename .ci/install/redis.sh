#!/usr/bin/env bash
# Installs redis-server and redis-tools (Debian packages) for tests/store/test_redis.py, which
# starts its own servers on free loopback ports (standalone and a 3-master cluster).
# Idempotent: when both binaries are already installed and run, it does nothing.
# The package's own service is not used: the tests never talk to a system-wide server.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 \
   && redis-server --version >/dev/null 2>&1 && redis-cli --version >/dev/null 2>&1; then
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq -o DPkg::Lock::Timeout=600
# Wait for a dpkg lock held by another install instead of failing at once.
apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 redis-server redis-tools >/dev/null

redis-server --version
