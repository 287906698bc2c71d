#!/usr/bin/env bash
# The Docker image's build stage, without Docker.
#
#   scripts/docker-build-stage.sh compile OUT_DIR
#       What the Dockerfile's build stage RUNs, in the build context: the release build of the
#       agent, copied to OUT_DIR (in the image the target dir is a cache mount, which is not
#       part of the layer). This is the only place the cargo command line is written.
#
#   scripts/docker-build-stage.sh [check]
#       What CI runs, since no Docker engine runs there: a clean copy of HEAD (`git archive`,
#       less what .dockerignore leaves out of the build context), `compile` run inside it by the
#       copy's own script, then checks of the binary: it exists, runs `--version`, is stripped,
#       links only libraries of the runtime image's glibc, and needs no newer glibc symbol
#       version than that image has. Uncommitted changes are not in the copy.
#
# Environment (check):
#   CARGO_TARGET_DIR   the build's target dir (default target/docker-build-stage/target here:
#                      kept between runs, like the Dockerfile's cache mount, so a second run
#                      is incremental). Share one to save build time.
#   CARGO_HOME         cargo's registry cache, as for any cargo command.
set -euo pipefail

die() { printf 'docker-build-stage: FAILED: %s\n' "$*" >&2; exit 1; }
say() { printf 'docker-build-stage: %s\n' "$*" >&2; }

# The newest glibc in the runtime image. envoyproxy/envoy:v1.40.0 is built FROM ubuntu:22.04
# (envoyproxy/envoy, distribution/docker/Dockerfile-envoy: `ARG BUILD_OS=ubuntu`,
# `ARG BUILD_TAG=22.04`), whose libc6 is glibc 2.35. (Its distroless variant is Debian 12:
# glibc 2.36.) Update both lines together when the Dockerfile's runtime image changes.
RUNTIME_IMAGE="envoyproxy/envoy:v1.40.0"
RUNTIME_GLIBC="2.35"
# Shared libraries that glibc and libgcc provide in any Ubuntu base image.
RUNTIME_LIBS="libc.so.6 libm.so.6 libgcc_s.so.1 ld-linux-x86-64.so.2 ld-linux-aarch64.so.1 libpthread.so.0 libdl.so.2 librt.so.1"

compile() {
  [ "$#" -eq 1 ] || die "usage: $0 compile OUT_DIR"
  local out="$1"
  cargo --version >&2
  cargo build --locked --release -p envoy-agent --bin envoy-agent
  mkdir -p "$out"
  cp "${CARGO_TARGET_DIR:-target}/release/envoy-agent" "$out/envoy-agent"
}

# Whether version $1 <= version $2 (dotted numbers).
version_le() {
  [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" = "$1" ]
}

need_objdump() {
  command -v objdump >/dev/null 2>&1 && return
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing binutils (objdump) with apt-get"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq binutils; } >&2 \
      || die "cannot install binutils (objdump) with apt-get"
  else
    die "objdump not found: install binutils (Debian: apt-get install binutils)"
  fi
}

check() {
  local repo start
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cd "$repo"
  start=$SECONDS

  grep -qx "FROM $RUNTIME_IMAGE" Dockerfile \
    || die "the Dockerfile's runtime image is no longer $RUNTIME_IMAGE: find its glibc version and update RUNTIME_IMAGE and RUNTIME_GLIBC in $0"
  grep -q 'scripts/docker-build-stage.sh compile /out$' Dockerfile \
    || die "the Dockerfile's build stage no longer RUNs 'scripts/docker-build-stage.sh compile /out': this check would not test what the image builds"
  grep -q '^COPY --from=build /out/envoy-agent /usr/local/bin/envoy-agent$' Dockerfile \
    || die "the Dockerfile no longer copies /out/envoy-agent from the build stage"

  local work="$repo/target/docker-build-stage"
  local src="$work/src" out="$work/out"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$work/target}"
  local head
  head="$(git rev-parse --short HEAD)" || die "not a git repository: $repo"
  if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    say "note: the working tree has uncommitted changes; they are not built (HEAD $head is)"
  fi

  say "clean copy of HEAD ($head) in $src"
  rm -rf "$src" "$out"
  mkdir -p "$src"
  # -m: files dated now, not at the commit's time, so that cargo never takes the shared target
  # dir's build of a newer commit for up to date when an older one is checked.
  git archive --format=tar HEAD | tar -x -m -C "$src" || die "git archive of HEAD failed"
  # The Docker build context leaves out what .dockerignore names; so does the copy.
  if [ -f "$src/.dockerignore" ]; then
    local pattern
    while IFS= read -r pattern || [ -n "$pattern" ]; do
      pattern="${pattern%%#*}"
      pattern="$(printf '%s' "$pattern" | tr -d '[:space:]')"
      [ -n "$pattern" ] || continue
      case "$pattern" in
        '!'*) die ".dockerignore exception '$pattern' is not supported by this script" ;;
      esac
      (cd "$src" && shopt -s nullglob globstar && for p in ${pattern#/}; do rm -rf -- "$p"; done)
    done < "$src/.dockerignore"
  fi

  say "build stage: scripts/docker-build-stage.sh compile (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
  local build_start=$SECONDS
  (cd "$src" && scripts/docker-build-stage.sh compile "$out") \
    || die "the build stage's command failed (scripts/docker-build-stage.sh compile in a clean copy of HEAD)"
  say "build stage took $((SECONDS - build_start))s"

  local bin="$out/envoy-agent"
  [ -x "$bin" ] || die "the build stage produced no executable $bin"

  local version want
  version="$("$bin" --version 2>&1)" || die "'envoy-agent --version' failed: $version"
  want="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$src/Cargo.toml" | head -n 1)"
  case "$version" in
    *"$want"*) say "runs: $version" ;;
    *) die "'envoy-agent --version' printed '$version', expected version $want" ;;
  esac

  need_objdump
  local sections
  sections="$(objdump -h "$bin")" || die "objdump cannot read $bin"
  if grep -qE '[[:space:]]\.(symtab|strtab|debug_[a-z_]+)[[:space:]]' <<<"$sections"; then
    die "$bin is not stripped (has $(grep -oE '\.(symtab|strtab|debug_[a-z_]+)' <<<"$sections" | sort -u | tr '\n' ' ')); is 'strip = true' still in [profile.release]?"
  fi
  say "stripped: no .symtab, .strtab or .debug_* sections"

  local lib needed
  needed="$(objdump -p "$bin" | awk '$1 == "NEEDED" { print $2 }')"
  for lib in $needed; do
    case " $RUNTIME_LIBS " in
      *" $lib "*) ;;
      *) die "$bin needs $lib, which the runtime image ($RUNTIME_IMAGE) may not have" ;;
    esac
  done
  say "links: $(tr '\n' ' ' <<<"$needed")"

  local symbols newest
  symbols="$(objdump -T "$bin")" || die "objdump -T cannot read $bin"
  newest="$(grep -oE 'GLIBC_[0-9]+(\.[0-9]+)+' <<<"$symbols" | sed 's/^GLIBC_//' | sort -uV | tail -n 1)"
  [ -n "$newest" ] || die "found no GLIBC symbol versions in $bin (is it dynamically linked against glibc?)"
  if ! version_le "$newest" "$RUNTIME_GLIBC"; then
    die "$bin needs GLIBC_$newest, newer than the glibc $RUNTIME_GLIBC of $RUNTIME_IMAGE; symbols: $(grep -F "GLIBC_$newest" <<<"$symbols" | awk '{ print $NF }' | sort -u | tr '\n' ' ')"
  fi
  say "glibc: needs at most GLIBC_$newest, the runtime image has $RUNTIME_GLIBC"

  say "OK: the build stage builds HEAD ($head) into a working, stripped binary for $RUNTIME_IMAGE ($((SECONDS - start))s)"
}

case "${1:-check}" in
  compile) shift; compile "$@" ;;
  check) check ;;
  *) die "usage: $0 [check] | $0 compile OUT_DIR" ;;
esac
