#!/usr/bin/env bash
# Runs one cmocka test binary under valgrind memcheck; any memcheck error or definite leak fails it
# (exit status 99 or 98).  Prints the binary's output, then memcheck's reports.
# Usage: run-valgrind.sh SHIM.so BINARY
#   `make valgrind` runs every C test through it, VALGRIND_JOBS at once (tools/run-ctests.sh with
#   CTEST_RUNNER; memcheck runs a process's threads one at a time, so binaries run side by side).
#   SHIM.so is tools/valgrind-shim.c built as a shared object (valgrind lacks mremap with an old
#   size of 0, which npualloc maps device memory with; the shim provides the equivalent).
#   The test sees NPUALLOC_VALGRIND=1 (the long ones shorten themselves) and a 64 GiB device
#   address window (NPUALLOC_VA_SPACE: memcheck is slow on a 32 TiB PROT_NONE reservation).
#   tools/valgrind.supp suppresses the writes test_vmm makes on purpose to unmapped memory.
set -u
shim=$1 binary=$2
supp=$(dirname "$0")/valgrind.supp
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# Leaks are judged in the test process only: a fork child exits holding what the parent's other
# threads referenced, which memcheck would call lost.  Memory errors fail anywhere (exit 99).
NPUALLOC_VALGRIND=1 NPUALLOC_VA_SPACE=${NPUALLOC_VA_SPACE:-64GiB} LD_PRELOAD="$shim" \
  valgrind --suppressions="$supp" --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=none \
  --show-leak-kinds=definite --fair-sched=yes --log-file="$logs/vg.%p" "$binary" 2>&1 &
pid=$!
wait $pid; rc=$?
cat "$logs"/vg.* 2>/dev/null
if [ $rc -eq 0 ] && grep -qE 'definitely lost: [1-9]' "$logs/vg.$pid" 2>/dev/null; then
  rc=98
fi
exit $rc
