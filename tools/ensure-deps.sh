#!/usr/bin/env bash
# Installs what the build and the tests need, only when it is missing.
set -eu
# Arguments add to that:
#   bench     the allocators the benchmarks compare with;
#   valgrind  valgrind (memcheck for `make valgrind`, callgrind for `make bench-count`);
#   test      PyTorch 2.13 (CPU) when its wheel lies on this machine's disk, for the optional
#             compatibility test (tests/test_history_viz.py: torch's memory viewer reads our snapshots).
want=(libcmocka-dev python3-dev gcc make)
torch=0
for extra in "$@"; do
  case "$extra" in
    bench) want+=(libjemalloc-dev libmimalloc-dev) ;;
    valgrind) want+=(valgrind) ;;
    test) torch=1 ;;
    *) echo "ensure-deps.sh: unknown argument $extra" >&2; exit 2 ;;
  esac
done
debs=()
for pkg in "${want[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || debs+=("$pkg")
done
if [ ${#debs[@]} -gt 0 ]; then
  echo "installing Debian packages: ${debs[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${debs[@]}" >/dev/null
fi
PYTHON=${PYTHON:-python3}
pips=()
for mod in pytest:pytest xdist:pytest-xdist numpy:numpy matplotlib:matplotlib hypothesis:hypothesis; do
  "$PYTHON" -c "import ${mod%%:*}" >/dev/null 2>&1 || pips+=("${mod##*:}")
done
# setuptools, missing or older than 77 (pyproject.toml's license is an SPDX string, read from 77 on)
"$PYTHON" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" >/dev/null 2>&1 ||
  pips+=("setuptools>=77")
if [ ${#pips[@]} -gt 0 ]; then
  echo "installing Python packages: ${pips[*]}"
  "$PYTHON" -m pip install -q "${pips[@]}"
fi
if [ "$torch" = 1 ] && ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then
  # Only from a local file (--no-index keeps pip's find-links): never a multi-GB download from PyPI.
  if "$PYTHON" -m pip install -q --dry-run --no-index --no-deps torch==2.13.0 >/dev/null 2>&1; then
    echo "installing torch 2.13.0 (CPU, from the local wheel) for the optional compatibility test"
    "$PYTHON" -m pip install -q torch==2.13.0 >/dev/null 2>&1 ||
      echo "torch could not be installed: tests/test_history_viz.py will be skipped"
  fi
fi
