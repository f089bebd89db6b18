# npualloc build.  `make test` and `make demo` are the two commands a user needs; both install
# what is missing first (tools/ensure-deps.sh).

PYTHON  ?= python3
CC      ?= gcc
BUILD   ?= build
JOBS    ?= $(shell nproc)

WARN    := -Wall -Wextra -Werror
BASE    := -std=c11 -D_GNU_SOURCE $(WARN) -Icsrc -Icsrc/include -pthread -fPIC
RELEASE := -O2 -g
# The benchmarks and the Python extension (setup.py) are built with link-time optimisation, so the
# hot path inlines across the core's small files (the C tests link the plain release objects, which
# is quicker).  An LTO link re-diagnoses inlined code and reports false maybe-uninitialized
# warnings; the objects were checked when compiled, so the LTO link leaves that warning out.
LTO     := -flto=auto
LTO_LINK:= $(LTO) -Wno-maybe-uninitialized
ASAN    := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
TSAN    := -O1 -g -fsanitize=thread

CORE_SRC := $(sort $(wildcard csrc/*.c))
HEADERS  := $(wildcard csrc/*.h csrc/include/*.h csrc/include/acl/*.h tests/c/*.h)
TEST_SRC := $(sort $(wildcard tests/c/test_*.c))
BENCH_SRC:= $(sort $(wildcard benchmarks/bench_*.c))

REL_TESTS  := $(TEST_SRC:tests/c/%.c=$(BUILD)/release/tests/%)
ASAN_TESTS := $(TEST_SRC:tests/c/%.c=$(BUILD)/asan/tests/%)
TSAN_TESTS := $(TEST_SRC:tests/c/%.c=$(BUILD)/tsan/tests/%)
BENCHES    := $(BENCH_SRC:benchmarks/%.c=$(BUILD)/release/bench/%)

.PHONY: all deps lib ctest ctest-asan ctest-tsan ext pytest test demo bench bench-count clean
.PHONY: fuzz fuzz-ci fuzzers stress valgrind pytest-asan FORCE

all: lib ext

deps:
	@bash tools/ensure-deps.sh

lib: $(BUILD)/release/libnpualloc.a

# The core as a static library, one per build flavour (release, asan, lto, fuzz):
# $(call core_library,FLAVOUR,COMPILE COMMAND) gives its object and archive rules.
define core_library
$(BUILD)/$(1)/obj/%.o: csrc/%.c $(HEADERS)
	@mkdir -p $$(dir $$@)
	$(2) -c $$< -o $$@

$(BUILD)/$(1)/libnpualloc.a: $(CORE_SRC:csrc/%.c=$(BUILD)/$(1)/obj/%.o)
	@rm -f $$@
	ar rcs $$@ $$^
endef

$(eval $(call core_library,release,$(CC) $(BASE) $(RELEASE)))
$(eval $(call core_library,asan,$(CC) $(BASE) $(ASAN)))
$(eval $(call core_library,tsan,$(CC) $(BASE) $(TSAN)))
$(eval $(call core_library,lto,$(CC) $(BASE) $(RELEASE) $(LTO)))

# test_graph parks a thread inside a call from one module of the core to another, to force an
# interleaving: the linker routes those calls through the test's __wrap_ functions.
TEST_LDFLAGS_test_graph := -Wl,--wrap=npualloc_cache_pool_join -Wl,--wrap=graph_capture_task \
                           -Wl,--wrap=graph_capture_record -Wl,--wrap=graph_capture_wait -Wl,--wrap=graph_capture_memop

# A test's link flags, kept in a file rewritten only when they change: editing them relinks the test.
$(BUILD)/ldflags/%: FORCE
	@mkdir -p $(dir $@)
	@echo '$(TEST_LDFLAGS_$*)' | cmp -s - $@ || echo '$(TEST_LDFLAGS_$*)' > $@

FORCE:
.PRECIOUS: $(BUILD)/ldflags/%

$(BUILD)/release/tests/%: tests/c/%.c $(BUILD)/release/libnpualloc.a $(HEADERS) $(BUILD)/ldflags/%
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(RELEASE) -Itests/c $< $(BUILD)/release/libnpualloc.a -lcmocka $(TEST_LDFLAGS_$*) -o $@

$(BUILD)/asan/tests/%: tests/c/%.c $(BUILD)/asan/libnpualloc.a $(HEADERS) $(BUILD)/ldflags/%
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(ASAN) -Itests/c $< $(BUILD)/asan/libnpualloc.a -lcmocka $(TEST_LDFLAGS_$*) -o $@

$(BUILD)/tsan/tests/%: tests/c/%.c $(BUILD)/tsan/libnpualloc.a $(HEADERS) $(BUILD)/ldflags/%
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(TSAN) -Itests/c $< $(BUILD)/tsan/libnpualloc.a -lcmocka $(TEST_LDFLAGS_$*) -o $@

$(BUILD)/release/bench/%: benchmarks/%.c $(BUILD)/lto/libnpualloc.a $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(RELEASE) $(LTO_LINK) -Ibenchmarks $< $(BUILD)/lto/libnpualloc.a -o $@

# The C test binaries run CTEST_JOBS at once (tools/run-ctests.sh; default: one per core), the
# longest first so that the last ones end together: $(call longest_first,BINARIES,SLOW NAMES).
SLOW_TESTS    := test_stress test_caching test_memory test_ipc test_expandable test_fuzz_regressions
longest_first  = $(foreach n,$(2),$(filter %/$(n),$(1))) $(filter-out $(addprefix %/,$(2)),$(1))

ctest: deps $(REL_TESTS)
	@bash tools/run-ctests.sh release $(call longest_first,$(REL_TESTS),$(SLOW_TESTS))

ctest-asan: deps $(ASAN_TESTS)
	@ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  bash tools/run-ctests.sh asan $(call longest_first,$(ASAN_TESTS),$(SLOW_TESTS))

# ThreadSanitizer: any data race, lock-order inversion or misuse of a lock fails the binary.  A
# forked child may start threads (die_after_fork=0): the fork tests check exactly that.
ctest-tsan: deps $(TSAN_TESTS)
	@TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:die_after_fork=0 \
	  bash tools/run-ctests.sh tsan $(call longest_first,$(TSAN_TESTS),$(SLOW_TESTS))

ext: deps
	$(PYTHON) setup.py -q build_ext --inplace --parallel $(JOBS)

# The Python suite, JOBS worker processes at once (pytest-xdist; the groups of tests/conftest.py
# run on one worker each).
pytest: ext
	@PYTHON=$(PYTHON) bash tools/ensure-deps.sh test
	$(PYTHON) -m pytest -q -n $(JOBS) --dist loadgroup tests

# The C tests (release, ASan+UBSan, TSan, valgrind memcheck), the Python suite, the fuzzers for a few
# seconds each (when clang is there), and the Python suite once more with the extension built with
# ASan+UBSan.  The test binaries are built first, JOBS at once; the suites then run one after another,
# each timed (CI's log shows where the minutes go).
test: deps
	@$(MAKE) --no-print-directory -j$(JOBS) $(REL_TESTS) $(ASAN_TESTS) $(TSAN_TESTS) $(BUILD)/valgrind/libvgshim.so
	@for suite in ctest ctest-asan ctest-tsan valgrind pytest fuzz-ci pytest-asan; do \
	  start=$$(date +%s); $(MAKE) --no-print-directory $$suite || exit 1; \
	  echo "make test: $$suite passed in $$(( $$(date +%s) - start )) s"; done

# TRACES=DIR replays the PyTorch snapshots in DIR too (default: ../shared/traces when it is there).
demo: ext
	$(PYTHON) -m npualloc demo $(if $(TRACES),--traces $(TRACES))

# Every benchmark, then one table of the performance targets with PASS/MISS (details to
# build/bench-results.json); the peers jemalloc and mimalloc are installed when missing.
bench: deps $(BENCHES) ext
	@bash tools/ensure-deps.sh bench
	$(PYTHON) benchmarks/run.py --bin $(BUILD)/release/bench --json $(BUILD)/bench-results.json

# Instructions, and simulated branch mispredictions and L1 misses, per hot-path pair (callgrind):
# exact where the timings of `make bench` are noisy.
bench-count: deps $(BUILD)/release/bench/bench_hotpath ext
	@bash tools/ensure-deps.sh bench valgrind
	$(PYTHON) benchmarks/count_hotpath.py --bin $(BUILD)/release/bench --allocator npualloc --allocator mimalloc

clean:
	rm -rf $(BUILD) npualloc/_C*.so *.egg-info

# ---- reliability: fuzzing, stress, valgrind, the Python suite under ASan (docs/reliability.md) ----

FUZZ_CC         ?= clang
FUZZ_SECONDS    ?= 60
FUZZ_CI_SECONDS ?= 10
FUZZ_JOBS       ?= 1
FUZZ_NAMES      := conf ops replay
FUZZ_BASE       := $(filter-out -Werror,$(BASE))  # a clang-only warning in new code must not stop the fuzzers
FUZZ_FLAGS      := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
FUZZERS         := $(FUZZ_NAMES:%=$(BUILD)/fuzz/fuzz_%)
STRESS_THREADS  ?= 8
STRESS_OPS      ?= 1000000
VALGRIND_SKIP   ?=

# the regression test compiles the fuzz harnesses in
$(BUILD)/release/tests/test_fuzz_regressions $(BUILD)/asan/tests/test_fuzz_regressions $(BUILD)/tsan/tests/test_fuzz_regressions: $(wildcard fuzz/*.c fuzz/*.h)

$(eval $(call core_library,fuzz,$(FUZZ_CC) $(FUZZ_BASE) $(FUZZ_FLAGS) -fsanitize=fuzzer-no-link))

$(BUILD)/fuzz/fuzz_%: fuzz/fuzz_%.c fuzz/fuzz_common.h $(BUILD)/fuzz/libnpualloc.a $(HEADERS)
	$(FUZZ_CC) $(FUZZ_BASE) $(FUZZ_FLAGS) -Ifuzz -fsanitize=fuzzer $< $(BUILD)/fuzz/libnpualloc.a -lm -o $@

fuzzers: $(FUZZERS)

# Each libFuzzer harness for FUZZ_SECONDS (clang is installed when missing).
fuzz: deps
	@FUZZ_CC=$(FUZZ_CC) bash tools/run-fuzz.sh --install
	@$(MAKE) --no-print-directory fuzzers
	@FUZZ_JOBS=$(FUZZ_JOBS) bash tools/run-fuzz.sh $(FUZZ_SECONDS) $(BUILD)/fuzz $(FUZZ_NAMES)

# The short run of `make test`: installs clang with libFuzzer when missing, like `make fuzz`.  The
# harnesses run one at a time: two at once on two cores gave fuzz_replay a sixth of its executions.
fuzz-ci: deps
	@FUZZ_CC=$(FUZZ_CC) bash tools/run-fuzz.sh --install
	@$(MAKE) --no-print-directory -s -j$(JOBS) fuzzers
	@bash tools/run-fuzz.sh $(FUZZ_CI_SECONDS) $(BUILD)/fuzz $(FUZZ_NAMES)

# 8 threads x 1M operations, plain and expandable segments (the C tests run a short version).
stress: deps $(BUILD)/release/tests/test_stress
	$(BUILD)/release/tests/test_stress --threads $(STRESS_THREADS) --ops $(STRESS_OPS)
	$(BUILD)/release/tests/test_stress --threads $(STRESS_THREADS) --ops $(STRESS_OPS) --conf expandable_segments:True
	$(BUILD)/release/tests/test_stress --threads $(STRESS_THREADS) --ops $(STRESS_OPS) --forks

$(BUILD)/valgrind/libvgshim.so: tools/valgrind-shim.c
	@mkdir -p $(dir $@)
	$(CC) -shared -fPIC -O2 $(WARN) $< -o $@

# The C tests under valgrind memcheck (errors and definite leaks fail), VALGRIND_JOBS at once (default:
# one per core), the longest under memcheck first; VALGRIND_SKIP="test_x ..." leaves some out.
VALGRIND_SLOW := test_memory test_ipc test_caching test_expandable test_stress test_fuzz_regressions
VALGRIND_JOBS ?= $(JOBS)
valgrind: deps $(REL_TESTS) $(BUILD)/valgrind/libvgshim.so
	@bash tools/ensure-deps.sh valgrind
	@$(if $(VALGRIND_SKIP),echo "  skipped under valgrind: $(VALGRIND_SKIP)")
	@CTEST_JOBS=$(VALGRIND_JOBS) CTEST_RUNNER="bash tools/run-valgrind.sh $(abspath $(BUILD))/valgrind/libvgshim.so" \
	  bash tools/run-ctests.sh valgrind \
	  $(call longest_first,$(filter-out $(addprefix %/,$(VALGRIND_SKIP)),$(REL_TESTS)),$(VALGRIND_SLOW))

# The Python suite with npualloc._C built with -fsanitize=address,undefined (in $(BUILD)/pytest-asan).
pytest-asan: deps
	@CC=$(CC) PYTHON=$(PYTHON) JOBS=$(JOBS) bash tools/run-pytest-asan.sh $(BUILD)/pytest-asan -q -n $(JOBS) --dist loadgroup -m "not install" tests
