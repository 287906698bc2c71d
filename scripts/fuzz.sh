#!/usr/bin/env bash
# Fuzzes every parser of outside input (cargo-fuzz, libFuzzer, AddressSanitizer) for a bounded
# time each and prints, per target, the result and how many inputs it tried. Not run by CI (too
# slow): see docs/fuzzing.md.
#
#   scripts/fuzz.sh                       # every target, 60 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh duration heartbeat
#
# Exits 1 if any target crashed (a panic, an ASan report), hung (an input that took more than
# FUZZ_TIMEOUT seconds) or ran out of memory (RSS or a single allocation over FUZZ_RSS_MB), or if
# a finding kept in fuzz/artifacts-found/ still reproduces; 2 if the targets do not build; 0
# otherwise. After a target's first failure it keeps fuzzing for the rest of its time in
# libFuzzer's fork mode, failures skipped and counted (FUZZ_KEEP_GOING=0: stop at the first).
#
# Seeds (committed) are in fuzz/seeds/<target>/; what libFuzzer adds goes to fuzz/corpus/<target>/
# (ignored by git, kept between runs, so a second run starts where the first stopped); crashing
# inputs go to fuzz/artifacts/<target>/ (ignored: copy a real finding to fuzz/artifacts-found/).
# Logs: fuzz/logs/<target>.log.
#
# Environment:
#   FUZZ_SECONDS   time per target, in seconds (default 60)
#   FUZZ_TIMEOUT   one input taking longer than this many seconds is a hang (default 5)
#   FUZZ_RSS_MB    memory limit in MB, also for one allocation (default 512)
#   FUZZ_ARGS      extra libFuzzer arguments (e.g. "-seed=1 -max_len=4096")
#   FUZZ_KEEP_GOING  0: no fork-mode continuation after a failure (default 1)
#
# Needs only the stable toolchain: cargo-fuzz passes one nightly-only flag (-Zsanitizer=address),
# which RUSTC_BOOTSTRAP=1 lets the stable compiler accept. libfuzzer-sys builds libFuzzer's C++
# sources with the system C++ compiler (g++ or clang++).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds="${FUZZ_SECONDS:-60}"
timeout="${FUZZ_TIMEOUT:-5}"
rss_mb="${FUZZ_RSS_MB:-512}"
cargo_fuzz_version=0.13.2

export RUSTC_BOOTSTRAP=1
# Keep the other build's flags out of the fuzz build (cargo-fuzz sets its own).
unset RUSTFLAGS CARGO_BUILD_RUSTFLAGS CARGO_ENCODED_RUSTFLAGS

say() { printf 'fuzz: %s\n' "$*" >&2; }

if ! cargo fuzz --version >/dev/null 2>&1; then
  say "installing cargo-fuzz $cargo_fuzz_version"
  cargo install cargo-fuzz --locked --version "$cargo_fuzz_version" >&2
fi
command -v c++ >/dev/null 2>&1 || say "warning: no c++ on PATH; libfuzzer-sys needs a C++ compiler"

if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo fuzz list)
fi

say "building ${targets[*]} (release, debug assertions, AddressSanitizer)"
# cargo-fuzz's defaults: release with debug assertions and overflow checks, ASan, SanitizerCoverage.
if [ "$#" -gt 0 ]; then
  for t in "${targets[@]}"; do cargo fuzz build "$t" >&2 || { say "build failed"; exit 2; }; done
else
  cargo fuzz build >&2 || { say "build failed"; exit 2; }
fi

triple="$(rustc -vV | sed -n 's/^host: //p')"
bin_dir="fuzz/target/$triple/release"
mkdir -p fuzz/logs

stat() { # stat NAME LOG: the value of libFuzzer's final `stat::NAME:` line
  sed -n "s/^stat::$1: *//p" "$2" | tail -n 1
}

failed=0
rows=()

# Known findings first: does each kept input still fail?
for t in "${targets[@]}"; do
  dir="fuzz/artifacts-found/$t"
  [ -d "$dir" ] || continue
  for input in "$dir"/*; do
    [ -f "$input" ] || continue
    case "$input" in *.md | *.txt) continue ;; esac
    replay_log="fuzz/logs/$t.replay.$(basename "$input").log"
    if "$bin_dir/$t" -rss_limit_mb="$rss_mb" -malloc_limit_mb="$rss_mb" -timeout="$timeout" \
      "$input" >"$replay_log" 2>&1; then
      say "$input: no longer fails (fixed?): move it to fuzz/seeds/$t/ and update docs/fuzzing.md"
    else
      say "$input: still fails (see docs/fuzzing.md; log $replay_log)"
      failed=1
    fi
  done
done

for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  # What `cargo fuzz run` would pass, plus the limits. The binaries are run directly so that
  # every target runs the build made above (`cargo fuzz run` rebuilds first, and would pick up
  # sources edited while the script runs).
  args=(-artifact_prefix="fuzz/artifacts/$t/" -rss_limit_mb="$rss_mb" -malloc_limit_mb="$rss_mb"
    -timeout="$timeout")
  [ -f "fuzz/dicts/$t.dict" ] && args+=(-dict="fuzz/dicts/$t.dict")
  # shellcheck disable=SC2206 # FUZZ_ARGS is a list of arguments
  args+=(${FUZZ_ARGS:-})
  log="fuzz/logs/$t.log"
  marker="fuzz/logs/$t.start"
  : >"$marker"
  started="$(date +%s)"
  say "running $t for ${seconds}s (log $log)"
  set +e
  "$bin_dir/$t" "${args[@]}" -max_total_time="$seconds" -print_final_stats=1 \
    "fuzz/corpus/$t" "fuzz/seeds/$t" >"$log" 2>&1
  rc=$?
  set -e
  result=ok
  runs="$(stat number_of_executed_units "$log")"
  # The last status line: `#N  DONE  cov: C ft: F corp: N/SIZE ...` (or the last pulse).
  last="$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)"
  if [ "$rc" -ne 0 ]; then
    failed=1
    if grep -q 'ERROR: libFuzzer: timeout' "$log"; then
      result=HANG
    elif grep -q -e 'ERROR: libFuzzer: out-of-memory' -e 'ERROR: libFuzzer: malloc' "$log"; then
      result=OOM
    elif grep -q -e 'ERROR: libFuzzer: deadly signal' -e 'ERROR: AddressSanitizer' \
      -e 'panicked at' "$log"; then
      result=CRASH
    else
      result="FAILED($rc)"
    fi
    artifact="$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)"
    say "$t: $result after ${runs:-?} inputs${artifact:+, input $artifact}"
    grep -m 1 -A 1 -e 'panicked at' -e 'ERROR: libFuzzer' "$log" >&2 || true
    # libFuzzer stops at the first failure. Spend the rest of the time fuzzing on past it
    # (fork mode, failures recorded and skipped), so a known finding does not leave the
    # target unfuzzed until it is fixed.
    remaining=$((seconds - ($(date +%s) - started)))
    if [ "${FUZZ_KEEP_GOING:-1}" != 0 ] && [ "$remaining" -ge 5 ]; then
      say "$t: fuzzing on for ${remaining}s past it (-fork=1 -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1; log $log.fork)"
      set +e
      "$bin_dir/$t" "${args[@]}" -max_total_time="$remaining" -fork=1 -ignore_crashes=1 \
        -ignore_timeouts=1 -ignore_ooms=1 "fuzz/corpus/$t" "fuzz/seeds/$t" >"$log.fork" 2>&1
      set -e
      # `#N: cov: C ft: F corp: K exec/s: E oom/timeout/crash: O/T/C time: ...`
      fork_last="$(grep -E '^#[0-9]+: cov:' "$log.fork" | tail -n 1 || true)"
      fork_runs="$(sed -n 's/^#\([0-9]*\):.*/\1/p' <<<"$fork_last")"
      [ -n "$fork_runs" ] && runs=$((${runs:-0} + fork_runs)) && last="$fork_last"
      failures="$(sed -n 's/.*oom\/timeout\/crash: \([0-9\/]*\).*/\1/p' <<<"$fork_last")"
      [ -n "$failures" ] && say "$t: past the first failure: oom/timeout/crash $failures"
    fi
    new_artifacts="$(find "fuzz/artifacts/$t" -type f -newer "$marker" | wc -l)"
    result="$result/$new_artifacts"
  fi
  per_s=$(( ${runs:-0} / ( $(date +%s) - started > 0 ? $(date +%s) - started : 1 ) ))
  rss="$(stat peak_rss_mb "$log")"
  cov="$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")"
  ft="$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")"
  corp="$(sed -n 's/.* corp: \([0-9]*\(\/[0-9]*[a-zA-Z]*\)\{0,1\}\).*/\1/p' <<<"$last")"
  # fuzz/corpus/<target>: what libFuzzer kept so far (all runs), files and bytes.
  saved="$(find "fuzz/corpus/$t" -type f -printf '%s\n' | awk '{n++; b += $1} END {printf "%d/%db", n, b}')"
  rows+=("$(printf '%-26s %-9s %12s %8s %6s %6s %12s %14s %7s' "$t" "$result" "${runs:--}" \
    "$per_s" "${cov:--}" "${ft:--}" "${corp:--}" "$saved" "${rss:--}")")
done

printf '\nfuzz: %ss per target, -timeout=%s -rss_limit_mb=%s -malloc_limit_mb=%s\n' \
  "$seconds" "$timeout" "$rss_mb" "$rss_mb"
printf '%-26s %-9s %12s %8s %6s %6s %12s %14s %7s\n' target result executions execs/s cov ft \
  corp corpus_dir peak_MB
printf '%s\n' "${rows[@]}"
exit "$failed"
