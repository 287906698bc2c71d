#!/usr/bin/env bash
# Runs envoy-agent on the bundled example bootstrap with a real Envoy (installed first when
# needed). Try it from another terminal:
#   curl http://127.0.0.1:10000/            # served by Envoy
#   target/debug/envoy-agent admin GET /server_info  # Envoy's admin API, through the agent
# Ctrl-C stops it. Extra arguments go to `envoy-agent run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ -z "${ENVOY_PATH:-}" ]; then
  ENVOY_PATH="$(scripts/install-envoy.sh)"
  export ENVOY_PATH
fi
cargo build --locked --quiet -p envoy-agent
echo "run-example.sh: Envoy will answer on http://127.0.0.1:10000/ (its admin API: target/debug/envoy-agent admin GET /server_info); Ctrl-C to stop" >&2
exec target/debug/envoy-agent run -c examples/bootstrap.yaml --envoy-admin socket "$@"
