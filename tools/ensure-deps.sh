#!/usr/bin/env bash
# Installs what the build and the tests need, only when it is missing.
set -eu
# `ensure-deps.sh bench` also installs the allocators the benchmarks compare with.
want=(libcmocka-dev python3-dev gcc make)
[ "${1:-}" = bench ] && want+=(libjemalloc-dev libmimalloc-dev)
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
for mod in pytest:pytest numpy:numpy setuptools:setuptools matplotlib:matplotlib hypothesis:hypothesis; do
  "$PYTHON" -c "import ${mod%%:*}" >/dev/null 2>&1 || pips+=("${mod##*:}")
done
if [ ${#pips[@]} -gt 0 ]; then
  echo "installing Python packages: ${pips[*]}"
  "$PYTHON" -m pip install -q "${pips[@]}"
fi
