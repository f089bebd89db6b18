"""Hostile input through Python: every public function of npualloc.acl.rt and of the torch-style API,
called with wrong types, negative and huge numbers, freed and foreign pointers, unknown handles and bad
enums.  Each call gets its documented outcome (acl.rt: a TypeError naming the function and argument for a
wrong type, an ACL code for any int; torch-style API: TypeError / ValueError / RuntimeError /
OutOfMemoryError, or OverflowError for ints beyond 64 bits), never a crash; and afterwards the allocator
still passes its invariant checker on every device and every device reports the memory it had before.

memcpy/memset data arguments get hostile device addresses (freed, reserved-but-unmapped, out of range)
and host addresses no access can succeed at (below mmap_min_addr, or a page reserved inaccessible; the
kernel checks host memory: docs/runtime.md).
"""
import ctypes
import math
import mmap

import numpy as np
import pytest

import npualloc
from conftest import run_python
from npualloc import acl

rt = acl.rt
M = npualloc
GiB = 1 << 30
MiB = 1 << 20
DEVICES = 2

ACL_CODES = {v for k, v in vars(acl).items() if k.startswith("ACL_ERROR") or k == "ACL_SUCCESS"}

INTS = [-1, -(2**31), -(2**63), -(2**63) - 1, 2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100, 12345]
NON_INTS = ["1", 1.5, None, [1], b"\x01", object(), {"a": 1}, 1j, float("nan")]
PROP = {"handleType": 0, "allocationType": 0, "memAttr": 4, "location": {"id": 0, "type": 1}, "reserve": 0}


def _inaccessible_page():
    """A page this process reserves with no access rights (PROT_NONE): any read or write of it faults,
    and since it stays reserved, nothing else is ever mapped there."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    page = libc.mmap(None, 4096, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert page not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    return page


INACCESSIBLE_PAGE = _inaccessible_page()  # held for the life of the test process


def unmapped_host_addresses():
    """Host addresses no access can succeed at: 12345 lies below mmap_min_addr, and a page reserved
    inaccessible.  (Addresses merely found unmapped in /proc/self/maps raced with the process mapping
    memory in between, as the sanitizer runtime does: a hostile write then landed in live memory.)"""
    return [12345, INACCESSIBLE_PAGE, INACCESSIBLE_PAGE + 4096 - 16]


class World:
    """Live and dead objects to aim at: made once per test on a fresh runtime."""

    def __init__(self):
        assert rt.set_device(0) == 0
        self.buf, ret = rt.malloc(4096, 0)
        assert ret == 0
        self.buf2, _ = rt.malloc(4096, 0)
        freed, _ = rt.malloc(4096, 0)
        assert rt.free(freed) == 0
        self.freed = freed
        self.va, ret = rt.reserve_mem_address(2 * MiB, 0, 0, 0)  # reserved, nothing mapped
        assert ret == 0
        self.stream, _ = rt.create_stream()
        dead_stream, _ = rt.create_stream()
        assert rt.destroy_stream(dead_stream) == 0
        self.dead_stream = dead_stream
        self.event, _ = rt.create_event()
        dead_event, _ = rt.create_event()
        assert rt.destroy_event(dead_event) == 0
        self.dead_event = dead_event
        self.host_array = np.zeros(64, dtype=np.uint8)
        self.foreign = self.host_array.__array_interface__["data"][0]  # a numpy array's address
        self.cache_live = M.caching_allocator_alloc(3000)  # the base of a caching-allocator segment
        p = M.caching_allocator_alloc(1000)  # right after it in the same segment
        M.caching_allocator_delete(p)
        self.cache_freed = p
        dead_context, ret = rt.create_context(1)
        assert ret == 0 and rt.destroy_context(dead_context) == 0
        self.dead_context = dead_context
        assert rt.set_device(0) == 0  # the destroy left this thread without a context

    def pointers(self):
        """Hostile pointers for functions that look pointers up (never dereference them).  Not the
        base of a caching-allocator segment: the torch-style free takes that one (acl.rt.free must not:
        test_acl_rt_free_refuses_the_caching_allocators_memory)."""
        return [self.freed, self.foreign, 0x1, 2**63, self.va, self.buf + 1, self.cache_live + 512, self.cache_freed,
                2**64 - 1]

    def device_pointers(self):
        """Hostile pointers for memcpy/memset data arguments: bad device and host addresses."""
        return [self.freed, self.va, self.va + MiB, self.buf + 2**40, 0] + unmapped_host_addresses()

    def handles(self):
        return [self.dead_stream, self.dead_event, self.dead_context, 12345, 2**40]

    def close(self):
        M.caching_allocator_delete(self.cache_live)
        rt.free(self.buf)
        rt.free(self.buf2)
        rt.release_mem_address(self.va)
        rt.destroy_stream(self.stream)
        rt.destroy_event(self.event)


@pytest.fixture
def world(restart, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_COMPACT_ERROR_OUTPUT", "1")
    for var in ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_NPU_MEMORY_CACHING"):
        monkeypatch.delenv(var, raising=False)
    restart(device_count=DEVICES, device_memory=GiB, huge_memory=GiB, huge1g_memory=0, ddr_memory=0)
    w = World()
    w.baseline = memory_state()
    yield w
    w.close()


def memory_state():
    """(free, total) HBM of every device after empty_cache, and the current device."""
    M.empty_cache()
    cur = rt.get_device()
    state = []
    for d in range(DEVICES):
        assert rt.set_device(d) == 0
        free, total, ret = rt.get_mem_info(acl.ACL_HBM_MEM)
        assert ret == 0
        state.append((free, total))
    if cur[1] == 0:
        rt.set_device(cur[0])
    return state


def assert_consistent(w, what):
    for d in range(DEVICES):
        M.memory._check(d)  # AssertionError with the broken invariant
    assert memory_state() == w.baseline, f"device memory changed by {what}"
    rt.set_device(0)


# ---- acl.rt ----
# name -> argument kinds: i (int), p (pointer looked up), d (device data pointer), h (handle), s (stream),
# e (event), c (context), prop, fn, data, key (str), pids (list of ints), dev (device id), n (size/count/enum/flags)
RT = {
    "set_device": ["dev"], "reset_device": ["dev"], "reset_device_force": ["dev"], "get_device": [],
    "create_context": ["dev"], "destroy_context": ["c"], "set_context": ["c"], "get_context": [], "get_run_mode": [],
    "ctx_get_current_default_stream": [],
    "get_device_count": [], "synchronize_device": [], "device_can_access_peer": ["dev", "dev"], "device_enable_peer_access": ["dev", "n"],
    "device_disable_peer_access": ["dev"], "device_get_bare_tgid": [],
    "malloc": ["n", "n"], "malloc_align32": ["n", "n"], "malloc_cached": ["n", "n"], "free": ["p"],
    "malloc_host": ["n"], "free_host": ["p"], "memset": ["d", "n", "n", "n"], "memcpy": ["d", "n", "d", "n", "n"],
    "memcpy2d": ["d", "n", "d", "n", "n", "n", "n"], "memcpy2d_async": ["d", "n", "d", "n", "n", "n", "n", "s"],
    "get_mem_info": ["n"], "mem_get_allocation_granularity": ["prop", "n"], "malloc_physical": ["n", "prop", "n"],
    "free_physical": ["h"], "reserve_mem_address": ["n", "n", "p", "n"], "release_mem_address": ["p"],
    "map_mem": ["p", "n", "n", "h", "n"], "unmap_mem": ["p"], "create_stream": [], "destroy_stream": ["s"],
    "synchronize_stream": ["s"], "memcpy_async": ["d", "n", "d", "n", "n", "s"], "memset_async": ["d", "n", "n", "n", "s"],
    "launch_callback": ["fn", "data", "n", "s"], "create_event": [], "destroy_event": ["e"], "record_event": ["e", "s"],
    "query_event": ["e"], "query_event_status": ["e"], "synchronize_event": ["e"], "event_elapsed_time": ["e", "e"],
    "stream_wait_event": ["s", "e"], "subscribe_report": ["n", "s"], "unsubscribe_report": ["n", "s"],
    "process_report": ["n"], "synchronize_stream_with_timeout": ["s", "n"], "synchronize_event_with_timeout": ["e", "n"],
    "stream_query": ["s"],
    "synchronize_device_with_timeout": ["n"], "create_stream_with_config": ["n", "n"],
    "create_event_with_flag": ["n"], "create_event_ex_with_flag": ["n"], "reset_event": ["e", "s"],
    "query_event_wait_status": ["e"],
    "mem_export_to_shareable_handle": ["h", "n", "n"], "mem_import_from_shareable_handle": ["n", "dev"],
    "mem_set_pid_to_shareable_handle": ["n", "pids"], "ipc_mem_get_export_key": ["p", "n", "n", "n"],
    "ipc_mem_set_import_pid": ["key", "pids"], "ipc_mem_import_by_key": ["key", "n"], "ipc_mem_close": ["key"],
}
# Arguments that are not ints: what a wrong type raises (and its message prefix).
NOT_INT_KINDS = {"prop", "fn", "data", "key", "pids"}
# Int arguments whose out-of-range values raise instead of returning a code (as pyACL does).
RAISES_FOR_INTS = {("ipc_mem_get_export_key", 2): ValueError}  # "key len should be less than 1024"


def test_the_table_covers_every_acl_rt_function():
    public = {name for name in dir(rt) if not name.startswith("_")}
    missing = public - set(RT)
    assert not missing, f"acl.rt functions without hostile cases: {sorted(missing)}"


def valid_args(w, kinds):
    """A harmless call: every argument of the right type (the call may still fail with a code)."""
    base = {"dev": 0, "n": 0, "p": 0, "d": w.buf, "h": 0, "s": w.stream, "e": w.event, "c": 0, "prop": PROP,
            "fn": (lambda data: None), "data": None, "key": "no-such-key", "pids": [1]}
    args = [base[k] for k in kinds]
    if kinds[:2] == ["d", "n"]:
        args[1] = 64  # dest_max / max_count of the 4 KiB buffer
    return args


def hostile_values(w, kind):
    if kind == "p":
        return INTS + w.pointers() + w.handles()
    if kind in ("h", "s", "e", "c"):
        return INTS + w.pointers() + w.handles() + [w.buf]  # a pointer is no handle
    if kind == "d":
        return w.device_pointers()
    if kind in ("n", "dev"):
        return INTS + [7, 2, DEVICES, 0xFFFF, 0x100000]
    if kind == "prop":
        return [dict(PROP, memAttr=99), dict(PROP, location={"id": 99, "type": 1}),
                dict(PROP, location={"id": 0, "type": 99}), dict(PROP, handleType=2**31 - 1),
                dict(PROP, allocationType=-1), dict(PROP, reserve=2**64 - 1)]
    if kind == "pids":
        return [[], [0], [-1], [2**31 - 1] * 1000, [2**40]]
    if kind == "key":
        return ["", "x" * 100000, "npualloc:" + "9" * 64, "../../etc/passwd"]
    return []


def cleanup(name, args, result):
    """Releases whatever a hostile call that happened to succeed created."""
    if not isinstance(result, tuple) or result[-1] != 0:
        if name == "set_device":
            rt.set_device(0)
        return
    value = result[0]
    if name in ("malloc", "malloc_align32", "malloc_cached"):
        assert rt.free(value) == 0
    elif name == "malloc_host":
        assert rt.free_host(value) == 0
    elif name in ("malloc_physical", "mem_import_from_shareable_handle"):
        assert rt.free_physical(value) == 0
    elif name == "reserve_mem_address":
        assert rt.release_mem_address(value) == 0
    elif name in ("create_stream", "create_stream_with_config"):
        rt.destroy_stream(value)
    elif name in ("create_event", "create_event_with_flag", "create_event_ex_with_flag"):
        rt.destroy_event(value)
    elif name == "ipc_mem_get_export_key":
        rt.ipc_mem_close(value)
    elif name == "create_context":
        assert rt.destroy_context(value) == 0
        rt.set_device(0)  # the context was the thread's: back to device 0's default one
    elif name == "ipc_mem_import_by_key":
        rt.ipc_mem_close(args[0])


def call_rt(name, args):
    result = getattr(rt, name)(*args)
    if isinstance(result, tuple):
        code = result[-1]
    else:
        code = result
    assert isinstance(code, int) and code in ACL_CODES, f"acl.rt.{name}{tuple(args)!r:.200} returned {result!r}"
    cleanup(name, args, result)
    if isinstance(code, int) and code == 0 and name in ("map_mem",):
        rt.unmap_mem(args[0])
    if name == "subscribe_report" and code == 0:
        rt.unsubscribe_report(*args)
    if name == "device_enable_peer_access" and code == 0:
        rt.device_disable_peer_access(args[0])
    return result


RT_CASES = [(name, i) for name, kinds in RT.items() for i in range(len(kinds))]


@pytest.mark.parametrize("name,index", RT_CASES, ids=[f"{n}.{i}" for n, i in RT_CASES])
def test_acl_rt_hostile_values_give_codes_or_type_errors(world, name, index):
    kinds = RT[name]
    kind = kinds[index]
    for value in hostile_values(world, kind):
        if name == "process_report" and isinstance(value, int) and value < 0:
            continue  # -1 would wait for a report forever (CANN's meaning); the thread is not subscribed anyway
        args = valid_args(world, kinds)
        args[index] = value
        if name in ("reset_device", "reset_device_force") and value in range(DEVICES):
            continue
        expected = RAISES_FOR_INTS.get((name, index))
        if expected is not None:
            try:
                call_rt(name, args)
            except expected:
                pass
        else:
            call_rt(name, args)
        rt.set_device(0)
    if kind not in NOT_INT_KINDS:
        for value in NON_INTS:
            args = valid_args(world, kinds)
            args[index] = value
            with pytest.raises(TypeError, match=rf"acl\.rt\.{name}\(\) argument '"):
                getattr(rt, name)(*args)
    elif kind in ("prop", "key", "pids", "fn"):
        for value in (None, 5, 1.5, b"x", object()) + (("str",) if kind != "key" else ()):
            args = valid_args(world, kinds)
            args[index] = value
            with pytest.raises((TypeError, ValueError)):
                getattr(rt, name)(*args)
    if kind == "key":  # no C string: a NUL would cut the key short, a surrogate has no UTF-8
        for value in ("\x00key", "key\x00", "\udc80"):
            args = valid_args(world, kinds)
            args[index] = value
            parse_failed = rf"acl\.rt\.{name} args parse failed: acl\.rt\.{name}\(\) argument 'key'"
            with pytest.raises(ValueError, match=parse_failed):
                getattr(rt, name)(*args)
    assert_consistent(world, f"acl.rt.{name}")


def test_acl_rt_free_refuses_the_caching_allocators_memory(world):
    w = world
    assert rt.free(w.cache_live) != 0
    assert_consistent(w, "acl.rt.free of caching-allocator memory")


def test_acl_rt_vmm_calls_refuse_an_expandable_segment(world):
    w = world
    M.memory._set_allocator_settings("expandable_segments:True")
    p = M.caching_allocator_alloc(15 * MiB)  # the base of a large-pool segment: 20 MiB pages, one mapped
    segments = [s for s in M.memory._snapshot()["segments"] if s["address"] == p]
    assert len(segments) == 1 and segments[0]["is_expandable"]
    h, ret = rt.malloc_physical(20 * MiB, PROP, 0)
    assert ret == 0
    try:
        assert rt.memset(p, 1000, 0x5A, 1000) == 0
        assert rt.unmap_mem(p) == acl.ACL_ERROR_RT_PARAM_INVALID
        assert rt.release_mem_address(p) == acl.ACL_ERROR_RT_PARAM_INVALID
        assert rt.map_mem(p + 40 * MiB, 20 * MiB, 0, h, 0) == acl.ACL_ERROR_RT_PARAM_INVALID  # a page not mapped
        assert acl.util.ptr_to_bytes(p, 4) == b"\x5a" * 4  # still the allocator's, still mapped
    finally:
        M.caching_allocator_delete(p)
        assert rt.free_physical(h) == 0
        M.memory._set_allocator_settings("expandable_segments:False")
    assert_consistent(w, "acl.rt unmap/release/map on an expandable segment")


def test_acl_util_ptr_to_bytes_huge_size_is_a_value_error(world):
    for size in (2**40, 2**63 - 1):
        with pytest.raises(ValueError):
            acl.util.ptr_to_bytes(world.buf, size)


def test_acl_rt_foreign_and_freed_pointers_are_refused(world):
    w = world
    for p in w.pointers():
        assert rt.free(p) in (acl.ACL_ERROR_RT_MEMORY_FREE, acl.ACL_ERROR_INVALID_PARAM, acl.ACL_ERROR_RT_PARAM_INVALID)
        assert rt.free_host(p) in (acl.ACL_ERROR_RT_MEMORY_FREE, acl.ACL_ERROR_INVALID_PARAM)
        assert rt.unmap_mem(p) != 0
        if p != w.va:
            assert rt.release_mem_address(p) != 0
    # the buffers that are live are still intact and usable
    assert rt.memset(w.buf, 4096, 0x5A, 4096) == 0
    assert acl.util.ptr_to_bytes(w.buf, 4) == b"\x5a" * 4
    assert_consistent(w, "frees of foreign pointers")


def test_acl_rt_dead_handles_are_refused(world):
    w = world
    for s in (w.dead_stream, 12345, 2**40):
        assert rt.synchronize_stream(s) != 0
        assert rt.destroy_stream(s) != 0
        assert rt.record_event(w.event, s) != 0
        assert rt.memset_async(w.buf, 64, 0, 64, s) != 0
    for e in (w.dead_event, 12345):
        assert rt.query_event(e)[1] != 0
        assert rt.synchronize_event(e) != 0
        assert rt.destroy_event(e) != 0
    for h in (12345, w.buf, w.dead_stream):
        assert rt.free_physical(h) == acl.ACL_ERROR_RT_INVALID_HANDLE
        assert rt.map_mem(w.va, 2 * MiB, 0, h, 0) != 0
    assert_consistent(w, "dead handles")


def test_acl_rt_bad_host_addresses_are_codes_not_crashes(world):
    """Each of these killed the process with SIGSEGV when host memory was touched unchecked."""
    w = world
    bad = unmapped_host_addresses()
    assert 12345 in bad and len(bad) >= 2
    for p in bad:
        assert rt.memset(p, 16, 0, 16) == acl.ACL_ERROR_RT_PARAM_INVALID
        assert rt.memcpy(p, 16, w.buf, 16, acl.ACL_MEMCPY_DEVICE_TO_HOST) == acl.ACL_ERROR_RT_PARAM_INVALID
        assert rt.memcpy(w.buf, 16, p, 16, acl.ACL_MEMCPY_HOST_TO_DEVICE) == acl.ACL_ERROR_RT_PARAM_INVALID
        assert rt.memcpy(p, 16, w.foreign, 16, acl.ACL_MEMCPY_HOST_TO_HOST) == acl.ACL_ERROR_RT_PARAM_INVALID
        with pytest.raises(ValueError, match="cannot read 4 bytes"):
            acl.util.ptr_to_bytes(p, 4)
        # on a stream: a memset is queued, then the stream's synchronize reports the failed task; a copy
        # to or from pageable host memory is made at once (CANN), so its error is the call's
        assert rt.memset_async(p, 16, 0, 16, w.stream) == 0
        assert rt.synchronize_stream(w.stream) == acl.ACL_ERROR_RT_DEVICE_MEM_ERROR
        bad_copy = acl.ACL_ERROR_RT_PARAM_INVALID
        assert rt.memcpy_async(p, 16, w.buf, 16, acl.ACL_MEMCPY_DEVICE_TO_HOST, w.stream) == bad_copy
        assert rt.memcpy_async(w.buf, 16, p, 16, acl.ACL_MEMCPY_HOST_TO_DEVICE, w.stream) == bad_copy
    assert rt.synchronize_stream(w.stream) == 0

    # Host memory stays usable: numpy buffers, malloc_host memory, bytes objects.
    arr = np.arange(16, dtype=np.uint8)
    ptr = acl.util.numpy_to_ptr(arr)
    assert rt.memcpy(w.buf, 4096, ptr, 16, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    out = np.zeros(16, dtype=np.uint8)
    assert rt.memcpy(acl.util.numpy_to_ptr(out), 16, w.buf, 16, acl.ACL_MEMCPY_DEVICE_TO_HOST) == 0
    assert (out == arr).all()
    assert rt.memset(ptr, 16, 7, 16) == 0 and (arr == 7).all()
    assert rt.memset_async(ptr, 16, 9, 8, w.stream) == 0 and rt.synchronize_stream(w.stream) == 0
    assert list(arr) == [9] * 8 + [7] * 8
    h, ret = rt.malloc_host(64)
    assert ret == 0
    assert rt.memset(h, 64, 3, 64) == 0
    assert rt.memcpy(w.buf, 4096, h, 64, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert acl.util.ptr_to_bytes(w.buf, 64) == b"\x03" * 64
    assert rt.free_host(h) == 0
    data = b"0123456789abcdef"
    assert rt.memcpy(w.buf, 4096, acl.util.bytes_to_ptr(data), 16, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert acl.util.ptr_to_bytes(w.buf, 16) == data
    assert_consistent(w, "bad host addresses")


def test_acl_util_hostile_arguments(world):
    w = world
    for p in (w.freed, w.va):
        with pytest.raises(ValueError, match="not mapped device memory"):
            acl.util.ptr_to_bytes(p, 8)
        with pytest.raises(ValueError, match="not mapped device memory"):
            acl.util.ptr_to_numpy(p, (8,), 2)
    with pytest.raises(ValueError):
        acl.util.ptr_to_bytes(w.buf, 2**30)
    for size in (-1, 2**64):
        with pytest.raises((ValueError, OverflowError)):
            acl.util.ptr_to_bytes(w.buf, size)
    with pytest.raises(ValueError):
        acl.util.ptr_to_numpy(w.buf, (2**62,), 12)
    with pytest.raises(ValueError):
        acl.util.ptr_to_numpy(w.buf, (-1,), 2)
    with pytest.raises(ValueError):
        acl.util.ptr_to_numpy(w.buf, (8,), 99)
    for bad in (None, "x", 1.5):
        with pytest.raises(TypeError):
            acl.util.ptr_to_bytes(bad, 8)
        with pytest.raises(TypeError):
            acl.util.ptr_to_numpy(bad, (8,), 2)
        with pytest.raises(TypeError):
            acl.util.numpy_to_ptr(bad)
    assert_consistent(w, "acl.util")


# ---- acl.rt arguments that change while they are read ----
# An int's __index__ runs Python code in the middle of the conversion; it may empty the pid list or
# delete a prop dict that holds it.  Each case runs in a child process, so a crash is a failure here.

PROP_LITERAL = repr(PROP)


def test_acl_rt_pid_list_emptied_by_an_items_index_is_read_as_given():
    """mem_set_pid_to_shareable_handle / ipc_mem_set_import_pid read the list as it was passed: the
    call succeeds with all 1001 pids though the first pid's __index__ empties the list."""
    r = run_python(f"""
from npualloc import acl
rt = acl.rt
assert rt.set_device(0) == 0
handle, ret = rt.malloc_physical(2 << 20, {PROP_LITERAL}, 0)
assert ret == 0
value, ret = rt.mem_export_to_shareable_handle(handle, 0, 0)
assert ret == 0
ptr, ret = rt.malloc(2 << 20, 0)
key, ret = rt.ipc_mem_get_export_key(ptr, 2 << 20, 65, 0)
assert ret == 0

class Emptier:
    def __init__(self, pids):
        self.pids = pids
    def __index__(self):
        self.pids.clear()
        return 4242

for fn, target in ((rt.mem_set_pid_to_shareable_handle, value), (rt.ipc_mem_set_import_pid, key)):
    pids = []
    pids += [Emptier(pids)] + list(range(1000, 2000))
    assert fn(target, pids) == 0
    assert pids == []
print("survived")
""")
    assert r.returncode == 0 and r.stdout == "survived\n", (r.returncode, r.stdout, r.stderr)


def test_acl_rt_prop_dict_deleted_by_a_values_index_is_read_as_given():
    """malloc_physical / mem_get_allocation_granularity read prop["location"] as it was passed: the
    calls succeed although location.id's __index__ deletes (and frees) the location dict, whose
    memory other dicts then reuse."""
    r = run_python(f"""
from npualloc import acl
rt = acl.rt
assert rt.set_device(0) == 0

def hostile_prop():
    prop = {PROP_LITERAL}
    class Deleter:
        def __index__(self):
            del prop["location"]  # the last reference to the location dict
            junk = [{{"x%d" % k: k}} for k in range(50)]  # reuses its memory
            return 0
    prop["location"] = {{"id": Deleter(), "type": 1}}
    return prop

for i in range(100):
    handle, ret = rt.malloc_physical(2 << 20, hostile_prop(), 0)
    assert ret == 0 and handle != 0, (i, ret)
    assert rt.free_physical(handle) == 0
    assert rt.mem_get_allocation_granularity(hostile_prop(), 0) == (2 << 20, 0), i
print("survived")
""")
    assert r.returncode == 0 and r.stdout == "survived\n", (r.returncode, r.stdout, r.stderr)


# ---- the torch-style API ----

ALLOWED = (TypeError, ValueError, RuntimeError, OverflowError)  # OutOfMemoryError is a RuntimeError


def torch_calls(w):
    """(description, callable, expected exception or None for 'returns', extra check)."""
    cur = M.current_stream
    calls = []

    def add(desc, fn, exc):
        calls.append((desc, fn, exc))

    for size in (-1, -(2**63), 2**63 - 1, 2**62, 1 << 60):
        add(f"caching_allocator_alloc({size})", lambda s=size: M.caching_allocator_alloc(s), M.OutOfMemoryError)
    for size in (2**63, 2**64, 2**100):
        add(f"caching_allocator_alloc({size})", lambda s=size: M.caching_allocator_alloc(s), OverflowError)
    for bad in NON_INTS:
        add(f"caching_allocator_alloc({bad!r})", lambda b=bad: M.caching_allocator_alloc(b), TypeError)
    for dev in (-2, 2, 7, 99):  # (-1 is the current device, as torch_npu passes it on to current_stream)
        add(f"caching_allocator_alloc(1, device={dev})", lambda d=dev: M.caching_allocator_alloc(1, device=d),
            RuntimeError)
    for dev in ("cpu", "npu:x", "gpu:0"):
        add(f"caching_allocator_alloc(1, device={dev!r})", lambda d=dev: M.caching_allocator_alloc(1, device=d),
            (ValueError, RuntimeError))
    for dev in (2**40, 2**64):
        add(f"caching_allocator_alloc(1, device={dev})", lambda d=dev: M.caching_allocator_alloc(1, device=d),
            OverflowError)
    for bad in ("default", 1.5, object()):
        add(f"caching_allocator_alloc(1, stream={bad!r})", lambda b=bad: M.caching_allocator_alloc(1, stream=b),
            TypeError)
    add("caching_allocator_alloc(1, stream=2**64)", lambda: M.caching_allocator_alloc(1, stream=2**64), OverflowError)
    for p in w.pointers():
        add(f"caching_allocator_delete({p:#x})", lambda p=p: M.caching_allocator_delete(p), RuntimeError)
        add(f"record_stream({p:#x}, 0)", lambda p=p: M.record_stream(p, 0), RuntimeError)
        add(f"erase_stream({p:#x}, current)", lambda p=p: M.erase_stream(p, cur()), RuntimeError)
        add(f"share({p:#x})", lambda p=p: M.share(p), RuntimeError)
        add(f"close_shared({p:#x})", lambda p=p: M.close_shared(p), RuntimeError)
    for bad in NON_INTS:
        add(f"caching_allocator_delete({bad!r})", lambda b=bad: M.caching_allocator_delete(b), TypeError)
        add(f"record_stream({bad!r}, 0)", lambda b=bad: M.record_stream(b, 0), TypeError)
        add(f"share({bad!r})", lambda b=bad: M.share(b), TypeError)
    for p in (-1, 2**64):
        add(f"caching_allocator_delete({p})", lambda p=p: M.caching_allocator_delete(p), (RuntimeError, OverflowError))
    for s in (w.dead_stream, 12345, 2**40):
        add(f"record_stream(live, {s:#x})", lambda s=s: M.record_stream(w.cache_live, s), RuntimeError)
    add("record_stream(live, 'x')", lambda: M.record_stream(w.cache_live, "x"), TypeError)
    add("erase_stream(live, 0)", lambda: M.erase_stream(w.cache_live, 0), TypeError)
    for n in (-1, -(2**63)):
        add(f"empty({n})", lambda n=n: M.empty(n), ValueError)
    for n in (2**64, 2**70):
        add(f"empty({n})", lambda n=n: M.empty(n), OverflowError)
    add("empty(2**62)", lambda: M.empty(2**62), M.OutOfMemoryError)
    add("empty('x')", lambda: M.empty("x"), TypeError)
    add("empty(8, device='npu:9')", lambda: M.empty(8, device="npu:9"), RuntimeError)
    for dev in (-1, 2, 99, "npu:99", "npu:x", "cpu", object(), 2**64, 1.5):
        for fn in (M.memory_stats, M.memory_summary, M.reset_peak_memory_stats, M.reset_accumulated_memory_stats,
                   M.get_per_process_memory_fraction, M.mem_get_info, M.synchronize, M.memory._check,
                   M.memory_allocated, M.max_memory_reserved):
            if fn is M.synchronize and dev == -1:
                continue  # torch_npu's `with device(-1)` changes nothing: the current device is synchronized
            # torch_npu's mem_get_info raises AssertionError("Invalid device id") for an index out of range
            add(f"{fn.__name__}({dev!r})", lambda f=fn, d=dev: f(d),
                ALLOWED + (AssertionError,) if fn is M.mem_get_info else ALLOWED)
    for f in ("0.5", 1, None, 1.5, -0.1, float("inf"), float("nan")):
        add(f"set_per_process_memory_fraction({f!r})", lambda f=f: M.set_per_process_memory_fraction(f),
            (TypeError, ValueError, RuntimeError))
    add("set_per_process_memory_fraction(0.5, 99)", lambda: M.set_per_process_memory_fraction(0.5, 99), RuntimeError)
    for s in (None, 5, b"max_split_size_mb:64", ["x"]):
        add(f"_set_allocator_settings({s!r})", lambda s=s: M.memory._set_allocator_settings(s), TypeError)
    for s in ("x" * 100000, "max_split_size_mb:\x00", "garbage_collection_threshold:0.5", "max_split_size_mb:1",
              "max_split_size_mb:" + "9" * 400, "expandable_segments:Maybe", ",,,:::", "[[[", "roundup_power2_divisions:[",
              "per_process_memory_fraction:nan", "\udcff"):
        add(f"_set_allocator_settings({s[:40]!r})", lambda s=s: M.memory._set_allocator_settings(s),
            (RuntimeError, ValueError))
    for dev in (99, -5):
        add(f"Stream(device={dev})", lambda d=dev: M.Stream(device=d), RuntimeError)
    add("Stream(device='cpu')", lambda: M.Stream(device="cpu"), ValueError)
    add("Event().record(12345)", lambda: M.Event().record(12345), (AttributeError, TypeError))
    add("set_stream(12345)", lambda: M.set_stream(12345), (AttributeError, TypeError))
    add("Event().elapsed_time(Event())", lambda: M.Event().elapsed_time(M.Event()), RuntimeError)
    add("memory_snapshot(mempool_id=5)", lambda: M.memory_snapshot(mempool_id=5), TypeError)
    add("_record_memory_history(enabled='bogus')", lambda: M.memory._record_memory_history(enabled="bogus"),
        RuntimeError)
    add("_record_memory_history(max_entries='x')", lambda: M.memory._record_memory_history(max_entries="x"),
        TypeError)
    add("_record_memory_history(context=5)", lambda: M.memory._record_memory_history(context=5), TypeError)
    for h in (b"", b"garbage", b"x" * 10000, bytes(64)):
        add(f"open_shared({h[:10]!r})", lambda h=h: M.open_shared(h), (ValueError, RuntimeError))
    add("open_shared(5)", lambda: M.open_shared(5), TypeError)
    add("set_device(99)", lambda: M.set_device(99), RuntimeError)
    add("Buffer(5)", lambda: M.Buffer(5), TypeError)
    add("empty(8).record_stream('x')", lambda: M.empty(8).record_stream("x"), TypeError)
    add("memory._attach_out_of_memory_observer(42)", lambda: M.memory._attach_out_of_memory_observer(42), TypeError)
    return calls


def test_torch_api_hostile_calls_raise_documented_exceptions(world):
    failures = []
    for desc, fn, exc in torch_calls(world):
        try:
            result = fn()
        except exc:
            continue
        except BaseException as e:  # noqa: BLE001 (report every unexpected outcome)
            failures.append(f"{desc}: {type(e).__name__}: {str(e)[:120]}")
            continue
        failures.append(f"{desc}: returned {result!r:.80} instead of raising {exc}")
    M.memory._clear_out_of_memory_observers()
    assert not failures, "\n".join(failures)
    assert_consistent(world, "the torch-style API")


UNFORMATTED = ("%#", "%ll", "%z", "%p", "%s", "%d", "%u", "%x")


def _unformatted_messages(w):
    bad = []
    for desc, fn, exc in torch_calls(w):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            if any(d in str(e) for d in UNFORMATTED):
                bad.append(f"{desc}: {e}")
    M.memory._clear_out_of_memory_observers()
    return bad


def test_error_messages_are_formatted(world):
    bad = _unformatted_messages(world)
    assert not bad, "\n".join(bad)


def test_torch_api_state_is_intact_after_the_sweep(world):
    """The live block, the stats and the settings survive a sweep of hostile calls."""
    w = world
    before = M.memory_stats(0)
    buf = acl.util.ptr_to_numpy(w.cache_live, (3000,), 2)
    buf[:] = 0xA5
    for desc, fn, exc in torch_calls(w):
        try:
            fn()
        except BaseException:  # noqa: BLE001
            pass
    M.memory._clear_out_of_memory_observers()
    assert (acl.util.ptr_to_numpy(w.cache_live, (3000,), 2) == 0xA5).all()
    after = M.memory_stats(0)
    for key in ("allocated_bytes.all.current", "allocation.all.current", "active_bytes.all.current"):
        assert after[key] == before[key], key
    # still fully usable
    p = M.caching_allocator_alloc(5 * MiB)
    M.record_stream(p, M.current_stream())
    M.caching_allocator_delete(p)
    assert_consistent(w, "the sweep")


def test_fraction_and_settings_errors_leave_the_settings_alone(world):
    M.set_per_process_memory_fraction(0.5, 0)
    text = M._C.memory._settings_text()
    for bad in (1.5, -1.0, float("nan")):
        with pytest.raises((ValueError, RuntimeError)):
            M.set_per_process_memory_fraction(bad, 0)
    for bad in ("max_split_size_mb:1", "bogus:1", "expandable_segments:True,max_split_size_mb:64"):
        with pytest.raises((ValueError, RuntimeError)):
            M.memory._set_allocator_settings(bad)
    assert M.get_per_process_memory_fraction(0) == 0.5
    assert M._C.memory._settings_text() == text
    assert math.isclose(M.get_per_process_memory_fraction(1), 1.0)
    assert_consistent(world, "rejected settings")
