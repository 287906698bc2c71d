#!/usr/bin/env bash
# Runs the benchmarks (release builds, the real Envoy) and prints a table and JSON.
# Extra arguments go to envoy-agent-bench (e.g. --restarts 5 --json report.json).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${ENVOY_PATH:-}" ]; then
  ENVOY_PATH="$(scripts/install-envoy.sh)"
  export ENVOY_PATH
fi
cargo build --locked --release -p envoy-agent -p envoy-agent-bench
exec target/release/envoy-agent-bench "$@"
