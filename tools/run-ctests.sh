#!/usr/bin/env bash
# Runs cmocka test binaries, CTEST_JOBS at once (default: the number of cores); prints a line per
# binary with its time, in the order given, and the full output of any that fails.
# Usage: run-ctests.sh LABEL BINARY...   (give the longest first: they start first)
#   CTEST_RUNNER="COMMAND ARGS" runs each as COMMAND ARGS BINARY instead (`make valgrind`:
#   tools/run-valgrind.sh), whose exit status judges it.
set -u
label=$1; shift
results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
# One binary; its output, exit code and seconds go to $results/NAME.{out,rc,secs}.
run_one() {
  local t=$1 name start
  name=$(basename "$t")
  start=$(date +%s)
  ${CTEST_RUNNER:-} "$t" >"$results/$name.out" 2>&1
  echo $? >"$results/$name.rc"
  echo $(( $(date +%s) - start )) >"$results/$name.secs"
}
jobs_max=${CTEST_JOBS:-$(nproc)}
for t in "$@"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  run_one "$t" &
done
wait
failed=()
for t in "$@"; do
  name=$(basename "$t")
  rc=$(cat "$results/$name.rc"); secs=$(cat "$results/$name.secs")
  if [ "$rc" -ne 0 ]; then
    failed+=("$name"); cat "$results/$name.out"
    printf '  %-40s FAILED (exit %d, %ds)\n' "$name" "$rc" "$secs"
  else
    printf '  %-40s %s (%ds)\n' "$name" "$(grep -E '^\[  PASSED  \]' "$results/$name.out" | tail -1)" "$secs"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "C tests ($label) FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "C tests ($label): $# binaries passed"
