#!/usr/bin/env bash
# Runs the whole test suite against the real Envoy, installing Envoy, the older Envoy release the
# upgrade tests start from, and the second-language clients the tests use (install-test-tools.sh) first
# when needed.
# Extra arguments go to `cargo test` (e.g. `scripts/test.sh -p envoy-agent-drain`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ -z "${ENVOY_PATH:-}" ]; then
  ENVOY_PATH="$(scripts/install-envoy.sh)"
  export ENVOY_PATH
fi
# The older release the upgrade tests hot-restart from (tests/src/lib.rs: UPGRADE_FROM_VERSION).
if [ -z "${ENVOY_UPGRADE_FROM_PATH:-}" ]; then
  ENVOY_UPGRADE_FROM_PATH="$(ENVOY_VERSION=1.39.3 scripts/install-envoy.sh)"
  export ENVOY_UPGRADE_FROM_PATH
fi
# Every supported release, for the e2e smoke test of each (agent/tests/e2e/releases.rs; the list
# is its SUPPORTED): installed once under .envoy/<release>/.
for release in 1.36.4 1.37.0 1.38.3 1.39.3 1.40.0; do
  ENVOY_VERSION="$release" scripts/install-envoy.sh > /dev/null
done
# The second-language clients the tests use (Python's grpcio, h2 and aioquic, grpcurl, nghttp).
if [ -z "${ENVOY_AGENT_TEST_TOOLS:-}" ]; then
  ENVOY_AGENT_TEST_TOOLS="$(scripts/install-test-tools.sh)"
  export ENVOY_AGENT_TEST_TOOLS
fi
echo "test.sh: testing with Envoy at $ENVOY_PATH ($("$ENVOY_PATH" --version 2>&1 | grep -o 'version: [^ ]*' | head -n 1))" >&2
if [ "$#" -eq 0 ]; then
  set -- --workspace
fi
exec cargo test --locked "$@"
