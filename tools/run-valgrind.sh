#!/usr/bin/env bash
# Runs cmocka test binaries under valgrind memcheck; any memcheck error or definite leak fails.
# Usage: run-valgrind.sh SHIM.so BINARY...
#   SHIM.so is tools/valgrind-shim.c built as a shared object (valgrind lacks mremap with an old
#   size of 0, which npualloc maps device memory with; the shim provides the equivalent).
#   The tests see NPUALLOC_VALGRIND=1 (the long ones shorten themselves) and a 64 GiB device
#   address window (NPUALLOC_VA_SPACE: memcheck is slow on a 32 TiB PROT_NONE reservation).
#   tools/valgrind.supp suppresses the writes test_vmm makes on purpose to unmapped memory.
#   VALGRIND_SKIP="name ..." leaves binaries out; VALGRIND_JOBS=N runs N at once (default: the
#   number of cores); each binary's time is printed.
set -u
shim=$1; shift
supp=$(dirname "$0")/valgrind.supp
failed=()
ran=0
skipped=()
# One binary under memcheck; its report goes to $results/NAME.{out,rc,secs}.
run_one() {
  local t=$1 name logs start pid rc
  name=$(basename "$t")
  start=$(date +%s)
  logs=$(mktemp -d)
  # Leaks are judged in the test process only: a fork child exits holding what the parent's other
  # threads referenced, which memcheck would call lost.  Memory errors fail anywhere (exit 99).
  NPUALLOC_VALGRIND=1 NPUALLOC_VA_SPACE=${NPUALLOC_VA_SPACE:-64GiB} LD_PRELOAD="$shim" \
    valgrind --suppressions="$supp" --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=none \
    --show-leak-kinds=definite --fair-sched=yes --log-file="$logs/vg.%p" "$t" >"$logs/out" 2>&1 &
  pid=$!
  wait $pid; rc=$?
  { cat "$logs/out"; cat "$logs"/vg.* 2>/dev/null; } >"$results/$name.out"
  if grep -qE 'definitely lost: [1-9]' "$logs/vg.$pid" 2>/dev/null; then
    [ $rc -eq 0 ] && rc=98
  fi
  rm -rf "$logs"
  echo $rc >"$results/$name.rc"
  echo $(( $(date +%s) - start )) >"$results/$name.secs"
}

# memcheck runs a process's threads one at a time, so VALGRIND_JOBS binaries (default: one per
# core) run side by side; the reports are printed in the order the binaries were given.
results=$(mktemp -d)
jobs_max=${VALGRIND_JOBS:-$(nproc)}
names=()
for t in "$@"; do
  name=$(basename "$t")
  if [[ " ${VALGRIND_SKIP:-} " == *" $name "* ]]; then
    skipped+=("$name"); continue
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  run_one "$t" &
  names+=("$name")
done
wait
for name in "${names[@]}"; do
  rc=$(cat "$results/$name.rc"); secs=$(cat "$results/$name.secs")
  ran=$((ran + 1))
  if [ "$rc" -ne 0 ]; then
    failed+=("$name"); cat "$results/$name.out"
    printf '  %-40s FAILED under valgrind (exit %d, %ds)\n' "$name" "$rc" "$secs"
  else
    printf '  %-40s %s (%ds)\n' "$name" "$(grep -E '^\[  PASSED  \]' "$results/$name.out" | tail -1)" "$secs"
  fi
done
rm -rf "$results"
[ ${#skipped[@]} -gt 0 ] && echo "  skipped under valgrind: ${skipped[*]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "C tests (valgrind) FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "C tests (valgrind): $ran binaries passed, no memcheck error, no definite leak"
