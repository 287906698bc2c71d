#!/usr/bin/env bash
# The soak (docs/soak.md): the release agent with the real Envoy, under load, through a random
# schedule of real faults drawn from a seed, with invariants checked all the time. Builds the
# release agent and envoy-agent-soak first, installs Envoy if ENVOY_PATH is unset (and the test
# tools for the HTTP/2 client if ENVOY_AGENT_TEST_TOOLS is unset). Arguments go to
# envoy-agent-soak (--help): e.g. --duration 1h --mode sidecar --pid1, or --seed N to replay.
#
# The soak's own lines go to stdout; the agents' and Envoys' logs to
# target/soak/<mode>-<seed>.log (its last lines are printed when the run fails).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -z "${ENVOY_PATH:-}" ]; then
  ENVOY_PATH="$(scripts/install-envoy.sh)"
  export ENVOY_PATH
fi
if [ -z "${ENVOY_AGENT_TEST_TOOLS:-}" ] && [ ! -x .test-tools/venv/bin/python ]; then
  scripts/install-test-tools.sh
fi
cargo build --locked --release -p envoy-agent -p envoy-agent-bench
mkdir -p target/soak
log="$(mktemp target/soak/run.XXXXXX.log)"
set +e
target/release/envoy-agent-soak "$@" 2>"$log" | tee "$log.out"
status=${PIPESTATUS[0]}
set -e
# Name the log after the mode and seed the run printed first.
seed="$(sed -n 's/^soak: seed \([0-9]*\) (\([a-z]*\);.*/\2-\1/p' "$log.out" | head -n 1)"
rm -f "$log.out"
if [ -n "$seed" ]; then
  mv "$log" "target/soak/$seed.log"
  log="target/soak/$seed.log"
elif [ ! -s "$log" ]; then
  # --help, or a bad command line: nothing ran.
  rm -f "$log"
fi
if [ "$status" -ne 0 ]; then
  echo "::: the soak failed ($status); the last lines of the agents' log ($log):"
  tail -n 60 "$log"
fi
exit "$status"
