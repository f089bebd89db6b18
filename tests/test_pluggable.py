"""NPUPluggableAllocator and change_current_allocator (torch_npu's): a library's alloc/free functions serve
every allocation once swapped in, with the size, device and stream each call is told; the swap is refused once
an allocator is initialized; the torch-like functions the library cannot serve warn as torch_npu's do; restart
brings the caching allocator back.  The library is tests/plugins/counting_allocator.c, compiled here."""
import ctypes
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

import npualloc
from npualloc import acl
from npualloc.testing import restart
from conftest_memory import MiB, mem, run_python  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "plugins" / "counting_allocator.c"
UNSUPPORTED = "NPUPluggableAllocator does not yet support {}. If you need it, please file an issue describing your use case."


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler to build the plugin")
    out = tmp_path_factory.mktemp("plugin") / "counting_allocator.so"
    include = npualloc.get_include()  # the checkout's csrc/include here
    assert Path(include) == ROOT / "csrc" / "include"
    subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I", include, str(SOURCE),
                    "-o", str(out)], check=True)
    return out


class Counters:
    """The plugin's record of its calls (its globals, read through ctypes)."""

    def __init__(self, path):
        # the library's aclrt* calls resolve against the extension once NPUPluggableAllocator loaded one
        npualloc.NPUPluggableAllocator(str(path), "counting_malloc", "counting_free")
        self.lib = ctypes.CDLL(str(path))

    def __getattr__(self, name):
        kind = {"alloc_calls": ctypes.c_long, "free_calls": ctypes.c_long, "last_alloc_size": ctypes.c_size_t,
                "last_free_size": ctypes.c_size_t, "last_alloc_device": ctypes.c_int, "last_free_device": ctypes.c_int,
                "last_alloc_stream": ctypes.c_size_t, "last_free_stream": ctypes.c_size_t,
                "last_free_ptr": ctypes.c_size_t}[name]
        return kind.in_dll(self.lib, name).value


@pytest.fixture
def swapped(mem, plugin):
    """A fresh runtime with the counting allocator current; restarted afterwards (the caching allocator again)."""
    allocator = npualloc.NPUPluggableAllocator(str(plugin), "counting_malloc", "counting_free")
    npualloc.change_current_allocator(allocator)
    yield allocator, Counters(plugin)
    restart(device_count=2, device_memory="1GiB")


def test_allocations_and_frees_go_to_the_library_with_what_torch_npu_tells_it(swapped):
    allocator, calls = swapped
    before = calls.alloc_calls, calls.free_calls
    s = npualloc.Stream(device=1)
    p = npualloc.caching_allocator_alloc(1000, device=1, stream=s)
    assert calls.alloc_calls == before[0] + 1
    # the size as asked (no pad, no rounding), the device and the stream
    assert (calls.last_alloc_size, calls.last_alloc_device, calls.last_alloc_stream) == (1000, 1, s.npu_stream)
    # real device memory of device 1, from the library's aclrtMalloc
    assert acl.rt.memset(p, 1000, 0x5A, 1000) == 0
    assert acl.util.ptr_to_bytes(p, 4) == b"ZZZZ"
    free1, total1 = npualloc.mem_get_info(1)
    free0, total0 = npualloc.mem_get_info(0)
    assert free1 < total1 and free0 == total0  # on device 1, not on the current device 0
    npualloc.caching_allocator_delete(p)
    assert calls.free_calls == before[1] + 1
    assert (calls.last_free_ptr, calls.last_free_size, calls.last_free_device, calls.last_free_stream) == (
        p, 1000, 1, s.npu_stream)
    assert npualloc.memory._get_current_allocator().allocator() == allocator.allocator()


def test_buffers_use_the_library_too(swapped):
    _, calls = swapped
    before = calls.alloc_calls, calls.free_calls
    b = npualloc.empty(4096)
    assert calls.alloc_calls == before[0] + 1 and calls.last_alloc_size == 4096
    memoryview(b)[:3] = b"abc"
    assert acl.util.ptr_to_bytes(b.ptr, 3) == b"abc"
    ptr = b.ptr
    del b
    assert calls.free_calls == before[1] + 1 and calls.last_free_ptr == ptr


def test_record_and_erase_stream_do_nothing_to_the_librarys_memory(swapped):
    _, calls = swapped
    s = npualloc.Stream()
    p = npualloc.caching_allocator_alloc(512)
    npualloc.record_stream(p, s.npu_stream)
    npualloc.erase_stream(p, s)
    frees = calls.free_calls
    npualloc.caching_allocator_delete(p)  # freed at once: no event to wait for
    assert calls.free_calls == frees + 1


def test_a_pointer_the_library_did_not_hand_out_is_refused(swapped, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "0")
    with pytest.raises(RuntimeError) as e:
        npualloc.caching_allocator_delete(0x1234000)
    assert str(e.value).startswith("Trying to free a pointer not allocated here\n[ERROR] ")
    assert str(e.value).endswith("ERR00004 PTA invalid pointer")


def test_a_null_from_the_library_is_returned_as_torch_npu_returns_it(mem, plugin):
    npualloc.change_current_allocator(npualloc.NPUPluggableAllocator(str(plugin), "refusing_malloc", "counting_free"))
    try:
        assert npualloc.caching_allocator_alloc(1 << 20) == 0
        npualloc.caching_allocator_delete(0)  # nothing to free
    finally:
        restart(device_count=2, device_memory="1GiB")


def test_what_the_library_cannot_do_warns_as_torch_npu_does(swapped):
    _, calls = swapped
    p = npualloc.caching_allocator_alloc(2 * MiB)
    for call, what in [(npualloc.memory_stats, "getDeviceStats"), (npualloc.reset_peak_memory_stats, "resetPeakStats"),
                       (npualloc.reset_accumulated_memory_stats, "resetAccumulatedStats"),
                       (npualloc.memory_snapshot, "snapshot"), (npualloc.memory._snapshot, "snapshot"),
                       (npualloc.memory._record_memory_history, "recordHistory"),
                       (lambda: npualloc.memory._attach_out_of_memory_observer(print), "attachOutOfMemoryObserver")]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        assert [str(w.message) for w in caught] == [UNSUPPORTED.format(what)], what
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the caching allocator served nothing: its figures stay zero
        assert npualloc.memory_allocated() == 0 and npualloc.memory_snapshot() == []
    npualloc.caching_allocator_delete(p)


def test_the_warnings_name_the_callers_line(swapped):
    # each public reader warns once, from the line that called it (stacklevel through the helpers)
    p = npualloc.caching_allocator_alloc(2 * MiB)
    readers = [npualloc.memory_stats, npualloc.memory_stats_as_nested_dict, npualloc.memory_allocated,
               npualloc.max_memory_allocated, npualloc.memory_reserved, npualloc.max_memory_reserved,
               npualloc.memory_summary, npualloc.reset_peak_memory_stats, npualloc.memory_snapshot,
               npualloc.memory._snapshot, npualloc.memory._record_memory_history]
    for reader in readers:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader()
        assert [w.filename for w in caught] == [__file__], reader.__name__
    npualloc.caching_allocator_delete(p)


def test_the_swap_is_refused_once_an_allocator_is_initialized(mem, plugin, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "1")
    allocator = npualloc.NPUPluggableAllocator(str(plugin), "counting_malloc", "counting_free")
    npualloc.caching_allocator_delete(npualloc.caching_allocator_alloc(512))  # the caching allocator starts
    with pytest.raises(RuntimeError, match="^Can't swap an already initialized allocator$"):
        npualloc.change_current_allocator(allocator)
    assert npualloc.memory._get_current_allocator().allocator() == "native"
    restart(device_count=2, device_memory="1GiB")
    npualloc.change_current_allocator(allocator)
    try:
        with pytest.raises(RuntimeError, match="^Can't swap an already initialized allocator$"):
            npualloc.change_current_allocator(allocator)  # a pluggable allocator is initialized when made
    finally:
        restart(device_count=2, device_memory="1GiB")


def test_restart_brings_the_caching_allocator_back(swapped):
    _, calls = swapped
    restart(device_count=2, device_memory="1GiB")
    before = calls.alloc_calls
    p = npualloc.caching_allocator_alloc(1000)
    assert calls.alloc_calls == before and npualloc.memory_allocated() == 1536  # 1000 + 32, to 512
    npualloc.caching_allocator_delete(p)


def test_bad_arguments(mem, plugin):
    with pytest.raises(AttributeError, match="no_such_function"):
        npualloc.NPUPluggableAllocator(str(plugin), "no_such_function", "counting_free")
    with pytest.raises(OSError):
        npualloc.NPUPluggableAllocator(str(plugin) + ".missing", "counting_malloc", "counting_free")
    with pytest.raises(TypeError, match="NPUPluggableAllocator"):
        npualloc.change_current_allocator("counting_malloc")
    with pytest.raises(TypeError):
        npualloc.NPUPluggableAllocator(12345, "counting_malloc", "counting_free")
    with pytest.raises(TypeError):
        npualloc.NPUPluggableAllocator(str(plugin), None, "counting_free")
    assert not npualloc.memory._M._allocator_is_pluggable()


def test_a_forked_child_starts_with_the_caching_allocator(plugin):
    code = f"""
import os
import npualloc
npualloc.change_current_allocator(npualloc.NPUPluggableAllocator({str(plugin)!r}, "counting_malloc", "counting_free"))
p = npualloc.caching_allocator_alloc(1000)
pid = os.fork()
if pid == 0:
    q = npualloc.caching_allocator_alloc(1000)
    ok = not npualloc.memory._M._allocator_is_pluggable() and npualloc.memory_allocated() == 1536
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
npualloc.caching_allocator_delete(p)
print(os.waitstatus_to_exitcode(status), npualloc.memory._M._allocator_is_pluggable())
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "True"]


# ---- a MemPool whose segments come from the library (torch's MemPool(allocator)) ----

def test_a_pools_segments_come_from_its_allocator(mem, plugin):
    calls = Counters(plugin)
    allocator = npualloc.NPUPluggableAllocator(str(plugin), "counting_malloc", "counting_free")
    pool = npualloc.MemPool(allocator=allocator.allocator())
    assert pool.allocator == allocator.allocator()
    s = npualloc.Stream()
    allocs, frees = calls.alloc_calls, calls.free_calls
    with npualloc.use_mem_pool(pool):
        p = npualloc.caching_allocator_alloc(1000, stream=s)   # a 2 MiB small-pool segment, from the library
        q = npualloc.caching_allocator_alloc(3000, stream=s)   # split from the same segment
    assert calls.alloc_calls == allocs + 1
    assert (calls.last_alloc_size, calls.last_alloc_device, calls.last_alloc_stream) == (2 * MiB, 0, s.npu_stream)
    (seg,) = pool.snapshot()
    assert seg["total_size"] == 2 * MiB and seg["address"] == p and q == p + 1536
    assert npualloc.memory_reserved() == 2 * MiB and npualloc.memory_allocated() == 1536 + 3072
    npualloc.memory._check(0)
    r = npualloc.caching_allocator_alloc(1000, stream=s)       # outside the pool: the device's memory
    assert calls.alloc_calls == allocs + 1
    for ptr in (p, q, r):
        npualloc.caching_allocator_delete(ptr)
    pool.release()
    npualloc.empty_cache()
    assert calls.free_calls == frees + 1
    assert (calls.last_free_ptr, calls.last_free_size, calls.last_free_device) == (p, 2 * MiB, 0)
    assert npualloc.memory_reserved() == 0


def test_a_pool_with_an_allocator_never_uses_expandable_segments(mem, plugin):
    mem("expandable_segments:True")
    calls = Counters(plugin)
    pool = npualloc.MemPool(allocator=npualloc.NPUPluggableAllocator(str(plugin), "counting_malloc", "counting_free"))
    allocs = calls.alloc_calls
    with npualloc.use_mem_pool(pool):
        p = npualloc.caching_allocator_alloc(30 * MiB)
    assert calls.alloc_calls == allocs + 1 and calls.last_alloc_size == 32 * MiB  # 30 MiB + 32, to 2 MiB: one plain segment
    (seg,) = pool.snapshot()
    assert not seg["is_expandable"] and seg["total_size"] == 32 * MiB
    npualloc.caching_allocator_delete(p)


def test_a_pool_allocator_out_of_memory_is_an_oom(mem, plugin):
    pool = npualloc.MemPool(allocator=npualloc.NPUPluggableAllocator(str(plugin), "refusing_malloc", "counting_free"))
    with npualloc.use_mem_pool(pool), pytest.raises(npualloc.OutOfMemoryError, match="^NPU out of memory"):
        npualloc.caching_allocator_alloc(1000)
    assert npualloc.memory_stats()["num_ooms"] == 1


def test_a_pool_refuses_memory_that_is_not_the_devices(mem, plugin):
    calls = Counters(plugin)
    pool = npualloc.MemPool(allocator=npualloc.NPUPluggableAllocator(str(plugin), "host_malloc", "host_free"))
    allocs, frees = calls.alloc_calls, calls.free_calls
    with npualloc.use_mem_pool(pool), pytest.warns(UserWarning, match="returned memory that is not the device's"), \
            pytest.raises(npualloc.OutOfMemoryError):
        npualloc.caching_allocator_alloc(1000)
    tries = calls.alloc_calls - allocs
    assert tries >= 1 and calls.free_calls - frees == tries  # each one given back at once
    assert npualloc.memory_reserved() == 0
    npualloc.memory._check(0)


def test_a_capture_still_records_graph_nodes(swapped):
    # the graph plans its own memory, whichever allocator is current
    _, calls = swapped
    allocs = calls.alloc_calls
    s, g = npualloc.Stream(), npualloc.Graph()
    with g.capture(stream=s):
        x = npualloc.caching_allocator_alloc(1000)
        npualloc.caching_allocator_delete(x)
        y = npualloc.caching_allocator_alloc(1000)
    exe = g.instantiate()
    assert x == y and exe.memory_plan()["footprint"] == 1024
    exe.launch(s)
    s.synchronize()
    assert calls.alloc_calls == allocs
    p = npualloc.caching_allocator_alloc(1000)  # outside the capture: the library
    assert calls.alloc_calls == allocs + 1
    npualloc.caching_allocator_delete(p)


def test_a_python_pool_allocator_releasing_while_another_thread_frees_does_not_deadlock():
    """A pool whose allocator is Python code (ctypes callbacks) needs the GIL under the device's allocator
    lock.  MemPool.release() emptied the pool with the GIL released but uncounted, so another thread's free
    kept the GIL while it waited for that lock, and the pool's free function waited for the GIL for ever."""
    code = """
import ctypes, faulthandler, threading, time
import npualloc as n
from npualloc import acl
n.configure(device_count=1, device_memory="1GiB")
faulthandler.dump_traceback_later(50, exit=True)
ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)

@ALLOC
def palloc(size, dev, stream):
    p, r = acl.rt.malloc(size, 0)
    return p if r == 0 else None

@FREE
def pfree(ptr, size, dev, stream):
    time.sleep(0.001)   # widens the window: the free function runs under the allocator lock
    acl.rt.free(ptr)

addrs = (ctypes.cast(palloc, ctypes.c_void_p).value, ctypes.cast(pfree, ctypes.c_void_p).value)
stop = threading.Event()

def hammer():
    while not stop.is_set():
        n.caching_allocator_delete(n.caching_allocator_alloc(4096))

t = threading.Thread(target=hammer)
t.start()
for i in range(100):
    pool = n.MemPool(allocator=addrs)
    with n.use_mem_pool(pool):
        ps = [n.caching_allocator_alloc(1 << 20) for _ in range(3)]
    for p in ps:
        n.caching_allocator_delete(p)
    pool.release()
stop.set()
t.join()
print("done")
"""
    proc = run_python(code, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr[-3000:]
