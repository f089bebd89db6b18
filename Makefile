# npualloc build.  `make test` and `make demo` are the two commands a user needs; both install
# what is missing first (tools/ensure-deps.sh).

PYTHON  ?= python3
CC      ?= gcc
BUILD   ?= build

WARN    := -Wall -Wextra -Werror
BASE    := -std=c11 -D_GNU_SOURCE $(WARN) -Icsrc -Icsrc/include -pthread -fPIC
RELEASE := -O2 -g
ASAN    := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all

CORE_SRC := $(sort $(wildcard csrc/*.c))
HEADERS  := $(wildcard csrc/*.h csrc/include/*.h tests/c/*.h)
TEST_SRC := $(sort $(wildcard tests/c/test_*.c))
BENCH_SRC:= $(sort $(wildcard benchmarks/bench_*.c))

REL_OBJ  := $(CORE_SRC:csrc/%.c=$(BUILD)/release/obj/%.o)
ASAN_OBJ := $(CORE_SRC:csrc/%.c=$(BUILD)/asan/obj/%.o)
REL_TESTS  := $(TEST_SRC:tests/c/%.c=$(BUILD)/release/tests/%)
ASAN_TESTS := $(TEST_SRC:tests/c/%.c=$(BUILD)/asan/tests/%)
BENCHES    := $(BENCH_SRC:benchmarks/%.c=$(BUILD)/release/bench/%)

.PHONY: all deps lib ctest ctest-asan ext pytest test demo bench clean

all: lib ext

deps:
	@bash tools/ensure-deps.sh

lib: $(BUILD)/release/libnpualloc.a

$(BUILD)/release/obj/%.o: csrc/%.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(RELEASE) -c $< -o $@

$(BUILD)/asan/obj/%.o: csrc/%.c $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(ASAN) -c $< -o $@

$(BUILD)/release/libnpualloc.a: $(REL_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/asan/libnpualloc.a: $(ASAN_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/release/tests/%: tests/c/%.c $(BUILD)/release/libnpualloc.a $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(RELEASE) -Itests/c $< $(BUILD)/release/libnpualloc.a -lcmocka -o $@

$(BUILD)/asan/tests/%: tests/c/%.c $(BUILD)/asan/libnpualloc.a $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(BASE) $(ASAN) -Itests/c $< $(BUILD)/asan/libnpualloc.a -lcmocka -o $@

$(BUILD)/release/bench/%: benchmarks/%.c $(BUILD)/release/libnpualloc.a $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(BASE) -O2 -g -Ibenchmarks $< $(BUILD)/release/libnpualloc.a -o $@

ctest: deps $(REL_TESTS)
	@bash tools/run-ctests.sh release $(REL_TESTS)

ctest-asan: deps $(ASAN_TESTS)
	@ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  bash tools/run-ctests.sh asan $(ASAN_TESTS)

ext: deps
	$(PYTHON) setup.py -q build_ext --inplace

pytest: ext
	$(PYTHON) -m pytest -q tests

test: ctest ctest-asan pytest

demo: ext
	$(PYTHON) -m npualloc demo

bench: deps $(BENCHES) ext
	@for b in $(BENCHES); do echo "== $$b"; $$b || exit 1; done

clean:
	rm -rf $(BUILD) npualloc/_C*.so *.egg-info
