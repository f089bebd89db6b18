"""npualloc.empty() buffers (numpy / memoryview), PYTORCH_NO_NPU_MEMORY_CACHING, and many threads
allocating on several streams at once."""
import ctypes
import random
import threading

import numpy as np
import pytest

import npualloc
from conftest_memory import GiB, MiB, block_of, check_all, mem, run_python, segment_of  # noqa: F401


BUFFER_FREE_FAILS = """
import gc, sys, weakref
import npualloc
for i in range(20):
    b = npualloc.empty(1000)
    npualloc.caching_allocator_delete(b.ptr)       # freed behind the Buffer's back
    r = weakref.ref(b)
    del b                                          # its own free fails: reported, not raised
    gc.collect()
    assert r() is None
    s, g = npualloc.Stream(), npualloc.Graph()
    with g.capture(stream=s):
        b = npualloc.empty(1000)                   # graph memory, its graph dropped first
    del g, b
    gc.collect()
print("survived", file=sys.stderr)
"""


def test_a_buffer_whose_free_fails_is_reported_and_collected_once():
    # The failed free used to be reported from the deallocator with the dying Buffer, which the report
    # resurrected and deallocated twice: a corrupted heap, then a segfault a few rounds later.
    proc = run_python(BUFFER_FREE_FAILS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("Exception ignored in: <npualloc.Buffer") == 40
    assert proc.stderr.count("RuntimeError: invalid device pointer") == 40
    assert proc.stderr.rstrip().endswith("survived")


def test_buffer_basics_and_numpy(mem):
    b = npualloc.empty(1000)
    assert isinstance(b, npualloc.Buffer)
    assert (b.nbytes, b.device, b.stream, len(b), b.freed) == (1000, 0, 0, 1000, False)
    assert block_of(b.ptr)["size"] == 1536 and npualloc.memory_allocated() == 1536
    assert repr(b) == f"<npualloc.Buffer ptr={b.ptr:#x} nbytes=1000 device=npu:0 stream=0x0>"
    a = np.frombuffer(b, dtype=np.uint8)
    a[:] = np.arange(1000) % 251
    assert ctypes.string_at(b.ptr, 4) == bytes([0, 1, 2, 3])        # it is the device memory itself
    ctypes.memset(b.ptr + 10, 0xAB, 5)
    assert list(a[9:16]) == [9, 0xAB, 0xAB, 0xAB, 0xAB, 0xAB, 15]
    f = np.frombuffer(b, dtype=np.float32, count=250)
    f[0] = 1.5
    assert bytes(memoryview(b)[:4]) == np.float32(1.5).tobytes()
    with pytest.raises(BufferError, match="exported view"):
        b.free()
    del a, f
    b.free()
    assert b.freed and b.ptr == 0 and b.nbytes == 0 and npualloc.memory_allocated() == 0
    b.free()                                           # again: nothing
    with pytest.raises(BufferError):
        memoryview(b)
    assert repr(b) == "<npualloc.Buffer freed, device=npu:0>"
    for name in ("ptr", "nbytes", "device", "stream", "freed"):     # read-only: the allocator owns them
        with pytest.raises(AttributeError):
            setattr(b, name, 1)


def test_buffer_lifetimes(mem):
    with npualloc.empty(100) as b:
        assert npualloc.memory_allocated() == 512
        with memoryview(b) as view:
            view[0] = 7
    assert b.freed and npualloc.memory_allocated() == 0
    c = npualloc.empty(5 * MiB)
    assert npualloc.memory_allocated() == 5 * MiB + 512
    del c                                              # freed when collected
    assert npualloc.memory_allocated() == 0
    before = npualloc.memory_snapshot()
    z = npualloc.empty(0)
    assert z.ptr == 0 and len(memoryview(z)) == 0 and npualloc.memory_snapshot() == before
    with pytest.raises(ValueError):
        npualloc.empty(-1)
    with pytest.raises(npualloc.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
        npualloc.empty(2 * GiB - 32)
    assert npualloc.memory_allocated() == 0


def test_a_buffer_of_an_ended_runtime_reads_as_freed(mem):
    """After a restart the new runtime may hand the old pointer out again: the old Buffer reads as freed
    (its ptr 0) instead of naming that memory (it kept ptr, nbytes and freed=False, and record_stream marked
    the new runtime's block at that address in use on the stream)."""
    b = npualloc.empty(100)
    assert not b.freed and b.ptr and len(b) == 100
    mem()                                             # a restart: the Buffer's memory is gone
    q = npualloc.caching_allocator_alloc(100)
    s = npualloc.Stream()
    npualloc._sleep(1.0, s.npu_stream)                # s is busy: a use recorded on it would hold q's block
    with pytest.raises(RuntimeError, match="the memory was freed"):
        b.record_stream(s)                            # the first thing asked of the stale Buffer
    npualloc.caching_allocator_delete(q)
    assert npualloc.caching_allocator_alloc(100) == q  # reused at once: no use of s was recorded on it
    npualloc.caching_allocator_delete(q)
    assert b.freed and b.ptr == 0 and b.nbytes == 0 and len(b) == 0
    assert repr(b) == "<npualloc.Buffer freed, device=npu:0>"
    with pytest.raises(BufferError, match="the runtime that owned the memory was shut down"):
        memoryview(b)
    b.free()                                          # nothing to give back
    s.synchronize()
    assert npualloc.memory_allocated() == 0


def test_the_runtime_is_not_shut_down_under_a_view_of_a_buffer():
    # shutdown() unmapped the memory under a live memoryview, and writing through it killed the process (SIGSEGV)
    p = run_python("""
import numpy as np
import npualloc
from npualloc import _C
b = npualloc.empty(4096)
view = memoryview(b)
array = np.frombuffer(b, dtype=np.uint8)
view[0] = 1
for holder in ("view", "array"):
    try:
        _C.shutdown()
    except BufferError as e:
        print(e)
    if holder == "view":
        view.release()
    else:
        del array
_C.shutdown()          # nothing holds the memory now
try:
    memoryview(b)
except BufferError as e:
    print(e)
""")
    assert p.returncode == 0, p.stderr[-800:]
    lines = p.stdout.splitlines()
    assert lines[0] == ("npualloc: 2 exported view(s) of npualloc.Buffer memory still exist: release them "
                        "(memoryview.release(), or drop the arrays) before shutting the runtime down")
    assert lines[1].startswith("npualloc: 1 exported view(s)")
    assert lines[2] == "npualloc.Buffer: the runtime that owned the memory was shut down"


def test_buffer_device_stream_and_record_stream(mem):
    s = npualloc.Stream(1)
    b = npualloc.empty(4096, device="npu:1", stream=s)
    assert (b.device, b.stream) == (1, s.npu_stream)
    assert segment_of(b.ptr)["stream"] == s.npu_stream and segment_of(b.ptr)["device"] == 1
    with npualloc.stream(s):
        c = npualloc.empty(10)
    assert c.device == 1 and c.stream == s.npu_stream
    side = npualloc.Stream()
    d = npualloc.empty(10)
    ptr = d.ptr
    d.record_stream(side)
    npualloc._sleep(0.2, side.npu_stream)
    d.free()
    assert block_of(ptr)["state"] == "active_pending_free"
    side.synchronize()
    npualloc.erase_stream(c, s)                         # a Buffer works as the pointer
    with pytest.raises(RuntimeError, match="freed"):
        d.record_stream(side)
    with pytest.raises(TypeError):
        b.record_stream(None)


def test_no_memory_caching(mem):
    mem(no_caching="1")
    free0, total = npualloc.mem_get_info()
    b = npualloc.empty(3 * MiB)
    assert npualloc.memory_stats()["allocation.all.allocated"] == 0      # no stats at all
    assert npualloc.memory_snapshot() == []
    assert npualloc.mem_get_info()[0] < free0
    np.frombuffer(b, dtype=np.uint8)[:] = 1
    b.record_stream(npualloc.Stream())                  # ignored, as torch ignores foreign memory
    npualloc.erase_stream(b, npualloc.Stream())
    b.free()
    assert npualloc.mem_get_info() == (free0, total)
    p = npualloc.caching_allocator_alloc(1)             # caching_allocator_alloc always caches
    assert npualloc.memory_allocated() == 512
    npualloc.caching_allocator_delete(p)
    mem(no_caching="0")
    with npualloc.empty(1):
        assert npualloc.memory_allocated() == 512


def test_no_memory_caching_edge_cases(mem):
    """The uncached path's answers: nothing for 0 bytes, torch's 1 EB message, and the runtime's codes for
    a device that does not exist and a request beyond the device (aclrtMallocAlign32's, as torch_npu)."""
    mem(no_caching="1")
    free0 = npualloc.mem_get_info()
    b = npualloc.empty(0)
    assert (b.ptr, b.nbytes) == (0, 0)
    b.free()
    with pytest.raises(npualloc.OutOfMemoryError, match="^NPU out of memory. Tried to allocate more than 1EB memory.$"):
        npualloc.empty(1 << 60)
    with pytest.raises(RuntimeError, match="^NPU error: aclrtMallocAlign32 of 40 bytes on device 5 returned 107001$"):
        npualloc.empty(8, device=5)
    with pytest.raises(RuntimeError, match=f"^NPU error: aclrtMallocAlign32 of {2 * GiB + 32} bytes on device 0 "
                                           "returned 207001$"):
        npualloc.empty(2 * GiB)
    assert npualloc.mem_get_info() == free0  # nothing leaked


def test_threads_never_share_live_blocks(mem):
    threads, rounds = 8, 1500
    streams = [npualloc.Stream(device=i % 2) for i in range(4)]
    live = {0: {}, 1: {}}                 # device -> {ptr: end}
    lock = threading.Lock()
    errors = []

    def claim(device, ptr, size):
        with lock:
            for p, end in live[device].items():
                if ptr < end and p < ptr + size:
                    raise AssertionError(f"overlap: {ptr:#x}+{size} with {p:#x}..{end:#x}")
            live[device][ptr] = ptr + size

    def release(device, ptr):
        with lock:
            del live[device][ptr]

    def worker(tid):
        rng = random.Random(tid)
        held = []
        try:
            for i in range(rounds):
                if len(held) > 6 or (held and rng.random() < 0.45):
                    kind, obj, ptr, size, device, fill = held.pop(rng.randrange(len(held)))
                    if ctypes.string_at(ptr, size) != fill * size:
                        raise AssertionError(f"thread {tid}: block {ptr:#x} was overwritten")
                    release(device, ptr)
                    if kind == "raw":
                        npualloc.caching_allocator_delete(ptr)
                    else:
                        obj.free()
                    continue
                size = rng.choice([1, 100, 4000, 70000, 600 * 1024, MiB + 5, 3 * MiB])
                s = streams[rng.randrange(len(streams))]
                fill = bytes([tid * 16 + i % 16])
                if rng.random() < 0.3:
                    obj = npualloc.empty(size, device=s.device, stream=s)
                    kind, ptr = "buf", obj.ptr
                else:
                    ptr = npualloc.caching_allocator_alloc(size, device=s.device, stream=s)
                    kind, obj = "raw", None
                claim(s.device, ptr, size)
                ctypes.memset(ptr, fill[0], size)           # releases the GIL while writing
                if rng.random() < 0.1:
                    npualloc.record_stream(ptr, streams[rng.randrange(len(streams))])
                held.append((kind, obj, ptr, size, s.device, fill))
            for kind, obj, ptr, size, device, fill in held:
                if ctypes.string_at(ptr, size) != fill * size:
                    raise AssertionError(f"thread {tid}: block {ptr:#x} was overwritten")
                release(device, ptr)
                if kind == "raw":
                    npualloc.caching_allocator_delete(ptr)
                else:
                    obj.free()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    for s in streams:
        s.synchronize()
    check_all()
    npualloc.empty_cache()
    for d in (0, 1):
        st = npualloc.memory_stats(d)
        assert st["allocation.all.current"] == 0 and st["active.all.current"] == 0
        assert st["allocation.all.allocated"] == st["allocation.all.freed"] > 0
    check_all()
    assert npualloc.memory_reserved(0) == npualloc.memory_reserved(1) == 0


DEADLOCK_CODE = """
import threading, time, npualloc
from npualloc import acl
side = npualloc.Stream(device=1)
p = npualloc.caching_allocator_alloc(1)
q = npualloc.caching_allocator_alloc(1)
npualloc.record_stream(p, side)
assert acl.rt.launch_callback(lambda _: time.sleep(0.4), None, 1, side.npu_stream) == 0
npualloc.caching_allocator_delete(p)      # its free waits for the Python callback on `side`
t = threading.Thread(target=npualloc.empty_cache)   # waits for `side` with device 0's lock released
t.start()
time.sleep(0.1)
npualloc.caching_allocator_delete(q)      # at once: the lock is free (and the binding waits for it without the GIL)
t.join()
print(npualloc.memory_reserved())        # 0: q was freed while empty_cache waited, so its segment went too
npualloc.empty_cache()
print(npualloc.memory_reserved())
"""


def test_no_deadlock_with_python_callbacks_on_streams():
    r = run_python(DEADLOCK_CODE, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "0"]
