#!/usr/bin/env bash
# Runs the Python test suite against an extension built with AddressSanitizer + UBSan.
# Usage: run-pytest-asan.sh DIR [PYTEST ARGS...]   (default args: -q tests)
#   DIR gets a copy of the package and the tests (the source tree's own npualloc/_C*.so is left
#   alone) with npualloc/_C built with -fsanitize=address,undefined; the suite runs there with
#   libasan preloaded into Python.  Leak detection is off (CPython keeps memory until exit), every
#   other ASan/UBSan report fails the run.  Faults stay plain signals (handle_segv=0): some tests
#   expect a child to die of SIGSEGV when it touches unmapped device memory.
#   JOBS=N compiles N sources at once (default: the number of cores).
set -eu
dir=$1; shift
[ $# -gt 0 ] || set -- -q tests
PYTHON=${PYTHON:-python3}
CC=${CC:-gcc}
root=$(pwd)
mkdir -p "$dir"
# fresh copies of what the tests import or read; the C sources are linked, not copied
rm -rf "$dir/tests"
mkdir -p "$dir/npualloc"
rm -f "$dir/npualloc"/*.py
cp npualloc/*.py "$dir/npualloc/"
cp -r tests "$dir/tests"
rm -rf "$dir/tests/__pycache__"
for f in csrc docs benchmarks fuzz tools README.md setup.py pyproject.toml Makefile; do
  [ -e "$f" ] && ln -sfn "$root/$f" "$dir/$f"
done
asan_lib=$($CC -print-file-name=libasan.so)
ubsan_lib=$($CC -print-file-name=libubsan.so)
sanitize="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all -g"
# build only when a source changed since the last build
stamp="$dir/.built"
if [ ! -f "$stamp" ] || ! ls "$dir"/npualloc/_C*.so >/dev/null 2>&1 || [ -n "$(find csrc setup.py -newer "$stamp" -name '*.[ch]' -o -newer "$stamp" -name setup.py | head -1)" ]; then
  echo "building npualloc._C with $sanitize"
  (cd "$dir" && rm -rf build && CC="$CC" CFLAGS="$sanitize" LDFLAGS="-fsanitize=address,undefined" \
     "$PYTHON" setup.py -q build_ext --inplace --parallel "${JOBS:-$(nproc)}" >/dev/null)
  touch "$stamp"
fi
cd "$dir"
start=$(date +%s)
set +e
LD_PRELOAD="$asan_lib $ubsan_lib" \
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:handle_segv=0:handle_sigbus=0 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$PYTHON" -m pytest -p no:cacheprovider "$@"
rc=$?
echo "Python tests under ASan+UBSan: exit $rc in $(( $(date +%s) - start ))s"
exit $rc
