#!/usr/bin/env bash
# Runs the benchmarks (release builds, the real Envoy): prints a table, and writes the JSON report
# and the timeline SVG to target/bench/ (report.json, timeline.svg). Takes ~5 minutes after the release build (~5 more from clean).
# Extra arguments go to envoy-agent-bench (e.g. --restarts 5, or --json/--svg elsewhere).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${ENVOY_PATH:-}" ]; then
  ENVOY_PATH="$(scripts/install-envoy.sh)"
  export ENVOY_PATH
fi
cargo build --locked --release -p envoy-agent -p envoy-agent-bench
mkdir -p target/bench
exec target/release/envoy-agent-bench --json target/bench/report.json --svg target/bench/timeline.svg "$@"
