#!/usr/bin/env bash
# Runs each cmocka test binary; prints a line per binary, the full output of any that fails.
# Usage: run-ctests.sh LABEL BINARY...
set -u
label=$1; shift
failed=()
for t in "$@"; do
  out=$("$t" 2>&1); rc=$?
  if [ $rc -ne 0 ]; then
    failed+=("$t"); printf '%s\n' "$out"
  else
    printf '  %-40s %s\n' "$(basename "$t")" "$(printf '%s\n' "$out" | grep -E '^\[  PASSED  \]' | tail -1)"
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "C tests ($label) FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "C tests ($label): $# binaries passed"
