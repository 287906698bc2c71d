#!/usr/bin/env bash
# Runs the benchmarks (release builds, the real Envoy): prints a table, and writes the JSON report
# and the timeline SVG to target/bench/ (report.json, timeline.svg). Takes ~5 minutes after the release build (~5 more from clean).
# Extra arguments go to envoy-agent-bench (e.g. --restarts 5, or --json/--svg elsewhere).
#
# scripts/bench.sh --scale [ARGS]: instead, the scale benchmark (bench/scale.py): what the agent
# costs Envoy on a large static config (300 listeners, 5000 clusters) versus a 10x smaller one
# (idle CPU, RSS, hot-restart LIVE latency, pre-flight, a drain's load, a Prometheus scrape's cost
# and how concurrent scrapes share Envoy's walk). Builds only the release agent; writes
# target/bench/scale.json; ARGS go to scale.py (e.g. --only large, --idle-s 10, --scrapes-only).
#
# scripts/bench.sh --zero-wait [ARGS]: instead, exit-on-zero's wait (bench/zero_wait.py): the
# agent's CPU while N idle connections hold the drain open, with other sockets on the node, and
# how soon zero is seen once they close; writes target/bench/zero-wait.json; ARGS go to
# zero_wait.py (e.g. --connections 1000,15000 --other-sockets 15000 --modes sidecar,node).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${ENVOY_PATH:-}" ]; then
  ENVOY_PATH="$(scripts/install-envoy.sh)"
  export ENVOY_PATH
fi
if [ "${1:-}" = "--scale" ]; then
  shift
  cargo build --locked --release -p envoy-agent
  mkdir -p target/bench
  exec python3 bench/scale.py --agent target/release/envoy-agent --envoy "$ENVOY_PATH" --json target/bench/scale.json "$@"
fi
if [ "${1:-}" = "--zero-wait" ]; then
  shift
  cargo build --locked --release -p envoy-agent
  mkdir -p target/bench
  exec python3 bench/zero_wait.py --agent target/release/envoy-agent --envoy "$ENVOY_PATH" --json target/bench/zero-wait.json "$@"
fi
cargo build --locked --release -p envoy-agent -p envoy-agent-bench
mkdir -p target/bench
exec target/release/envoy-agent-bench --json target/bench/report.json --svg target/bench/timeline.svg "$@"
