#!/usr/bin/env bash
# Checks the gRPC API (proto/envoyagent/v1/agent.proto) with buf: `buf lint` (STANDARD rules,
# no exceptions: proto/buf.yaml) and `buf breaking` against the committed baseline,
# proto/baseline/envoyagent.v1.binpb (the API as last released; FILE rules: wire, JSON and
# generated-code compatibility). buf comes from the npm registry (@bufbuild/buf ships the
# binary), pinned below and installed into target/buf/ when missing.
#
# At a release, once the API is final: UPDATE_PROTO_BASELINE=1 scripts/check-proto.sh rewrites
# the baseline from proto/ (commit it with the release); from then on every change is checked
# against it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

version=1.75.0
dir=target/buf
buf="$dir/node_modules/.bin/buf"
baseline=proto/baseline/envoyagent.v1.binpb

die() { printf 'check-proto: %s\n' "$*" >&2; exit 1; }

if [ ! -x "$buf" ] || [ "$("$buf" --version 2>/dev/null)" != "$version" ]; then
  command -v npm >/dev/null 2>&1 || die "npm is needed to install buf (Debian: apt-get install npm)"
  echo "check-proto: installing @bufbuild/buf@$version into $dir" >&2
  mkdir -p "$dir"
  npm install --prefix "$dir" --no-audit --no-fund --no-save --silent "@bufbuild/buf@$version" >&2 \
    || die "npm could not install @bufbuild/buf@$version (is the npm registry reachable?)"
  [ "$("$buf" --version)" = "$version" ] || die "$buf does not run"
fi

echo "check-proto: buf lint (STANDARD)" >&2
"$buf" lint proto
if [ -n "${UPDATE_PROTO_BASELINE:-}" ]; then
  echo "check-proto: rewriting $baseline from proto/" >&2
  mkdir -p "$(dirname "$baseline")"
  "$buf" build proto --exclude-source-info -o "$baseline"
fi
[ -f "$baseline" ] || die "no baseline at $baseline (UPDATE_PROTO_BASELINE=1 $0 makes one)"
echo "check-proto: buf breaking against $baseline" >&2
"$buf" breaking proto --against "$baseline"
echo "check-proto: ok" >&2
