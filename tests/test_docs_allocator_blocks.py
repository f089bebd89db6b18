"""docs/allocator.md's blocks that are not Python examples (test_docs_allocator.py runs those): the pluggable
allocator's C declarations, built as a library with the doc's command and swapped in as the doc says, and the
pytest plugin's example suite, run as a suite; and the messages and errors its text states."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from docs_examples import ROOT, blocks, run_python

DOC = "docs/allocator.md"
BLOCKS = blocks(DOC)
TEXT = (ROOT / DOC).read_text()


def _block(lang):
    found = [b for b in BLOCKS if b.lang == lang]
    assert len(found) == 1, found
    return found[0]


# What the declarations leave to the reader: the two functions, on the runtime's own aclrtMalloc / aclrtFree.
DEFINITIONS = r"""
long calls[2];
size_t sizes[2];

void *my_malloc(size_t size, int device, aclrtStream stream)
{
    (void)device, (void)stream;
    void *p = NULL;
    calls[0]++, sizes[0] = size;
    return aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_FIRST) == ACL_SUCCESS ? p : NULL;
}

void my_free(void *ptr, size_t size, int device, aclrtStream stream)
{
    (void)device, (void)stream;
    calls[1]++, sizes[1] = size;
    aclrtFree(ptr);
}
"""

SWAP = r"""
import ctypes, sys
import npualloc
allocator = npualloc.NPUPluggableAllocator(sys.argv[1], "my_malloc", "my_free")
npualloc.change_current_allocator(allocator)
lib = ctypes.CDLL(sys.argv[1])
calls, sizes = (ctypes.c_long * 2).in_dll(lib, "calls"), (ctypes.c_size_t * 2).in_dll(lib, "sizes")
p = npualloc.caching_allocator_alloc(1000)
assert p and list(calls) == [1, 0] and sizes[0] == 1000          # the size asked: no pad, no rounding
npualloc.caching_allocator_delete(p)
assert list(calls) == [1, 1] and sizes[1] == 1000                # what the allocation was
try:
    npualloc.caching_allocator_delete(p + 64)
    raise SystemExit("a foreign pointer freed")
except RuntimeError as e:
    assert str(e).splitlines()[0] == "Trying to free a pointer not allocated here", e   # then torch_npu's [ERROR] line
try:
    npualloc.change_current_allocator(npualloc.NPUPluggableAllocator(sys.argv[1], "my_malloc", "my_free"))
    raise SystemExit("swapped twice")
except RuntimeError as e:
    assert "Can't swap an already initialized allocator" in str(e), e
"""


def test_the_pluggable_allocator_builds_with_the_doc_command_and_is_called(tmp_path):
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    block = _block("c")
    (tmp_path / "my_allocator.c").write_text(block.text + DEFINITIONS)
    command = re.search(r"Build it with `(cc [^`]*)`", TEXT).group(1)
    assert command == "cc -shared -fPIC -I$(python -m npualloc include) my_allocator.c -o my_allocator.so"
    include = subprocess.run([sys.executable, "-m", "npualloc", "include"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
    command = command.replace("$(python -m npualloc include)", include) + " -std=c11 -Wall -Wextra -Werror"
    subprocess.run(command, shell=True, cwd=tmp_path, check=True)
    proc = run_python(SWAP, args=[str(tmp_path / "my_allocator.so")])
    assert proc.returncode == 0, proc.stderr


def test_the_plugin_example_runs_as_a_suite(tmp_path):
    block = _block("py")
    conftest, suite = block.text.split("# test_memory.py\n")
    assert conftest.startswith("# conftest.py\n")
    (tmp_path / "conftest.py").write_text(conftest)
    # `...`: the test's own work
    body = "    assert npualloc.mem_get_info(0)[1] == 8 << 30\n    npualloc.caching_allocator_alloc(1 << 30)\n"
    assert suite.count("    ...\n") == 1
    (tmp_path / "test_memory.py").write_text(suite.replace("    ...\n", body))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPUALLOC_", "PYTORCH_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout, proc.stdout


# ---- the messages and errors the text states ----

# error(fn) in the scripts below: the "Type: message" of what fn raises
ERROR_OF = r"""
def error(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    raise SystemExit(f"no error from {fn}")
"""

STATED = ERROR_OF + r"""
import os
import npualloc
from npualloc import _C, memory

for conf, want in (("max_split_size_mb:abc", "RuntimeError: Invalid value 'abc' for allocator option max_split_size_mb "
                                             "(std::stoull: "),
                   ("max_split_size_mb:", "RuntimeError: Index out of bounds in ConfigTokenizer")):
    _C.shutdown()
    os.environ["PYTORCH_NPU_ALLOC_CONF"] = conf
    assert error(lambda: npualloc.caching_allocator_alloc(1)).startswith(want), conf
_C.shutdown()
del os.environ["PYTORCH_NPU_ALLOC_CONF"]
npualloc.configure(device_count=2, device_memory="1GiB")
eb = "OutOfMemoryError: NPU out of memory. Tried to allocate more than 1EB memory."
assert error(lambda: npualloc.empty(1 << 60)) == eb
assert error(lambda: npualloc.caching_allocator_alloc(-1)) == eb
assert error(lambda: npualloc.caching_allocator_alloc(1 << 60)).startswith(
    "OutOfMemoryError: NPU out of memory. Tried to allocate 1073741824.00 GiB (NPU 0;")
assert npualloc.memory_stats()["num_ooms"] == 1          # the 1 EB ones count nothing
assert issubclass(npualloc.OutOfMemoryError, RuntimeError)
assert error(lambda: memory._record_memory_history(skip_actions=["nope"])) == (
    "RuntimeError: Unknown TraceEntry action: nope")
assert error(lambda: memory._record_memory_history(nope=1)).startswith("TypeError: ")
assert error(lambda: npualloc.mem_get_info(2)) == "AssertionError: Invalid device id"
assert npualloc.mem_get_info("npu") == npualloc.mem_get_info(0)
assert npualloc.caching_allocator_alloc(0) == 0
p = npualloc.caching_allocator_alloc(10)
assert error(lambda: npualloc.record_stream(p, None)).startswith("TypeError: ")
assert error(lambda: npualloc.empty(10).record_stream(None)).startswith("TypeError: ")
assert error(npualloc.empty_virt_addr_cache).startswith("RuntimeError: ")
assert sorted(memory._snapshot()) == ["allocator_settings", "device_traces", "external_annotations", "segments"]
assert memory._snapshot()["external_annotations"] == []
assert len(npualloc.memory_stats()) == 123
assert error(lambda: npualloc.MemPool(use_on_oom="yes")).startswith("TypeError: ")
assert error(lambda: npualloc.MemPool(no_split=[])).startswith("TypeError: ")
assert npualloc.MemPool(use_on_oom=1, no_split=None).use_count() == 1
"""


def test_the_messages_the_text_states():
    text = " ".join(TEXT.split())
    for phrase in ("(`Invalid value 'abc' for allocator option max_split_size_mb (std::stoull: ...)`)",
                   "gives `RuntimeError: Index out of bounds in ConfigTokenizer`",
                   "`empty()` of 2^60 bytes or more fails at once with `NPU out of memory. Tried to allocate more "
                   "than 1EB memory.`", "a negative size, which torch_npu's arithmetic wraps around, gets the 1 EB",
                   "raises `RuntimeError: Unknown TraceEntry action: <name>`", "any other keyword is a `TypeError`",
                   "`AssertionError: Invalid device id`", "`npualloc.OutOfMemoryError` (a `RuntimeError`)",
                   "`None` is a `TypeError`", "it raises `RuntimeError` unless `expandable_segments:True`",
                   "123 flat keys", "returns `segments`, `device_traces`, `allocator_settings` and "
                   "`external_annotations`", "(numbers and `None` by their truth; a string or list is a `TypeError`)", "returns a pointer (0 for size 0;"):
        assert phrase in text, phrase
    proc = run_python(STATED, env={"TORCH_NPU_COMPACT_ERROR_OUTPUT": "1"})
    assert proc.returncode == 0, proc.stderr


GIVING = r"""
import os
import npualloc
from npualloc import _C, memory

def start(conf):
    _C.shutdown()
    os.environ["PYTORCH_NPU_ALLOC_CONF"] = conf
    npualloc.configure(device_count=1, device_memory="1GiB")
    npualloc.caching_allocator_delete(npualloc.caching_allocator_alloc(1))
    return memory._snapshot()["allocator_settings"]

assert start("max_split_size_mb:64abc")["max_split_size"] == 64 << 20
assert start("max_split_size_mb,64")["max_split_size"] == 64 << 20
assert start("garbage_collection_threshold:0.5")["garbage_collection_threshold"] == 0.5
try:
    memory._set_allocator_settings("max_split_size_mb:64,foo:1")
    raise SystemExit("no error")
except ValueError:
    pass
s = memory._snapshot()["allocator_settings"]
assert s["max_split_size"] == 64 << 20 and s["garbage_collection_threshold"] == 0, s
assert s["PYTORCH_NPU_ALLOC_CONF"] == "garbage_collection_threshold:0.5", s
_C.shutdown()
del os.environ["PYTORCH_NPU_ALLOC_CONF"]
os.environ["PYTORCH_NO_NPU_MEMORY_CACHING"] = "1"
npualloc.configure(device_count=1, device_memory="1GiB")
b = npualloc.empty(1000)
assert npualloc.memory_allocated() == 0 and npualloc.memory_snapshot() == [] and npualloc.mem_get_info()[0] < 1 << 30
b.free()
assert npualloc.mem_get_info()[0] == 1 << 30
"""


def test_what_giving_settings_says():
    text = " ".join(TEXT.split())
    for phrase in ("so `max_split_size_mb:64abc` is 64", "`max_split_size_mb,64` is read like `max_split_size_mb:64`",
                   'after `_set_allocator_settings("max_split_size_mb:64,foo:1")` raises, `max_split_size_mb` is 64 '
                   "and a start-up `garbage_collection_threshold` is gone", "its text is not shown as",
                   "`npualloc.empty()` buffers bypass the cache", "no stats, not in snapshots"):
        assert phrase in text, phrase
    proc = run_python(GIVING, env={"TORCH_NPU_COMPACT_ERROR_OUTPUT": "1"})
    assert proc.returncode == 0, proc.stderr


DECIDES = ERROR_OF + r"""
import os
import npualloc
from npualloc import _C, acl

MiB = 1 << 20

def start(conf):
    _C.shutdown()
    os.environ["PYTORCH_NPU_ALLOC_CONF"] = conf
    npualloc.configure(device_count=2, device_memory="1GiB")

start("roundup_power2_divisions:4")
npualloc.caching_allocator_alloc(84 * MiB)
assert npualloc.memory_allocated() == 96 * MiB                 # an 84 MiB request becomes a 96 MiB block
start("")
p = npualloc.caching_allocator_alloc(MiB)
assert npualloc.memory_stats()["allocated_bytes.large_pool.current"] == MiB + 512
assert acl.rt.free(p) == 207002 and acl.rt.unmap_mem(p) == 107000
start("")
npualloc.caching_allocator_alloc(10 * MiB)
assert npualloc.memory_reserved() == 12 * MiB                   # 10 MiB asks for a 12 MiB segment
assert error(lambda: npualloc.set_per_process_memory_fraction(1)).startswith("TypeError: ")
assert error(lambda: npualloc.set_per_process_memory_fraction(1.5)).startswith("ValueError: ")
assert error(lambda: npualloc.set_per_process_memory_fraction(0.5, 5)) == (
    "RuntimeError: Allocator not initialized for device 5: did you call init?")
assert acl.rt.get_device() == (0, 0)
assert error(lambda: npualloc.get_per_process_memory_fraction("npu")).startswith("ValueError: ")
assert npualloc.get_per_process_memory_fraction() == 1.0
start("expandable_segments:True")
q = npualloc.caching_allocator_alloc(30 * MiB)
assert (acl.rt.free(q), acl.rt.unmap_mem(q), acl.rt.release_mem_address(q)) == (207002, 107000, 107000)
"""


def test_what_how_the_allocator_decides_says():
    text = " ".join(TEXT.split())
    for phrase in ("With N = 4, an 84 MiB request becomes a 96 MiB block", "A request of exactly 1 MiB is large "
                   "(1 MiB + 32 B pad rounds to 1 MiB + 512 B)", "10 MiB asks for a 12 MiB segment",
                   "takes a `float` (`TypeError` otherwise) in [0, 1] (`ValueError` otherwise)",
                   "`RuntimeError: Allocator not initialized for device <d>: did you call init?`, the current "
                   "device unchanged", "(1.0 when none was set", '`"npu"` is a `ValueError`',
                   "which `acl.rt.free` refuses with 207002", "on an address in it, mapped or not, return 107000"):
        assert phrase in text, phrase
    proc = run_python(DECIDES, env={"TORCH_NPU_COMPACT_ERROR_OUTPUT": "1"})
    assert proc.returncode == 0, proc.stderr
