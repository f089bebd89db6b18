#!/usr/bin/env bash
# Runs the libFuzzer harnesses of fuzz/ for a bounded time each and prints what they did.
# Usage: run-fuzz.sh SECONDS BUILD_DIR NAME...
#   The working corpus of each harness is BUILD_DIR/corpus/NAME, seeded from fuzz/corpus/NAME and
#   fuzz/regressions/NAME; crash inputs go to BUILD_DIR/artifacts/.  A crash fails the run and is
#   printed with the command that reproduces it (also without clang: the regression test binary).
#   FUZZ_JOBS=N runs N harnesses at once (default 1).
#
# run-fuzz.sh --check     exit 0 when clang can build a libFuzzer binary here (else 1, quietly)
# run-fuzz.sh --install   install clang and its sanitizer runtimes (Debian) when that check fails
set -u
FUZZ_CC=${FUZZ_CC:-clang}
can_fuzz() {
  command -v "$FUZZ_CC" >/dev/null 2>&1 || return 1
  local tmp; tmp=$(mktemp -d)
  printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' >"$tmp/t.c"
  "$FUZZ_CC" -fsanitize=fuzzer,address,undefined "$tmp/t.c" -o "$tmp/t" >/dev/null 2>&1; local rc=$?
  rm -rf "$tmp"; return $rc
}
if [ "${1:-}" = "--check" ]; then can_fuzz; exit $?; fi
if [ "${1:-}" = "--install" ]; then
  can_fuzz && exit 0
  echo "installing clang with libFuzzer (Debian packages clang, libclang-rt-dev)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq clang >/dev/null
  # libclang-rt-NN-dev (NN = clang's major version) carries libFuzzer on Debian 12
  v=$(clang --version | grep -oE 'version [0-9]+' | head -1 | awk '{print $2}')
  if apt-cache show "libclang-rt-$v-dev" >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "libclang-rt-$v-dev" >/dev/null
  fi
  can_fuzz || { echo "clang cannot build libFuzzer binaries here" >&2; exit 1; }
  exit 0
fi
seconds=$1; build=$2; shift 2
mkdir -p "$build/artifacts"
failed=()
summary=()
run_one() {
  local name=$1 bin="$build/fuzz_$1" corpus="$build/corpus/$1" log="$build/fuzz_$1.log"
  mkdir -p "$corpus"
  local dict=()
  [ -f "fuzz/$name.dict" ] && dict=(-dict="fuzz/$name.dict")
  # -timeout: one input taking longer than 25 s is a hang; -rss_limit_mb: the machine has 24 GiB.
  "$bin" -max_total_time="$seconds" -max_len=4096 -timeout=25 -rss_limit_mb=6144 -print_final_stats=1 \
    -artifact_prefix="$build/artifacts/$name-" "${dict[@]}" "$corpus" "fuzz/corpus/$name" "fuzz/regressions/$name" \
    >"$log" 2>&1
}
pids=()
rcs=()
names=()
jobs=${FUZZ_JOBS:-1}
for name in "$@"; do
  run_one "$name" &
  pids+=($!); names+=("$name")
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait "${pids[0]}"; rcs+=("$?"); pids=("${pids[@]:1}")
  fi
done
for p in "${pids[@]}"; do wait "$p"; rcs+=("$?"); done
i=0
for name in "${names[@]}"; do
  rc=${rcs[$i]}; i=$((i + 1))
  log="$build/fuzz_$name.log"
  execs=$(grep -E '^stat::number_of_executed_units' "$log" | awk '{print $2}')
  cov=$(grep -E '^#[0-9]+' "$log" | tail -1 | grep -oE 'cov: [0-9]+' | awk '{print $2}')
  corp=$(find "$build/corpus/$name" -type f | wc -l)
  if [ "$rc" -ne 0 ]; then
    failed+=("$name")
    echo "== fuzz_$name FAILED (exit $rc); the end of $log:"
    grep -vE '^#[0-9]+|^INFO|^\s*$' "$log" | tail -40
    art=$(ls -t "$build/artifacts/$name-"* 2>/dev/null | head -1)
    if [ -n "$art" ]; then
      echo "   input: $art"
      echo "   reproduce: $build/fuzz_$name $art"
      echo "          or: build/release/tests/test_fuzz_regressions $name $art   (NPUALLOC_FUZZ_TRACE=1 for ops)"
      echo "   once fixed, add it to fuzz/regressions/$name/"
    fi
  fi
  summary+=("$(printf '  fuzz_%-8s %9s executions in %ss (%s exec/s), coverage %s, corpus %s inputs' "$name" \
    "${execs:-?}" "$seconds" "$(( ${execs:-0} / (seconds > 0 ? seconds : 1) ))" "${cov:-?}" "$corp")")
done
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzzing FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzzing: ${#names[@]} harnesses, no crash"
