"""Plain memory through acl.rt: capacity per page kind, every malloc policy and its fallback,
memcpy / memset of every kind and their errors, pinned host memory, and acl.util."""
import ctypes
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import GiB, MiB
from npualloc import acl

rt = acl.rt
pytestmark = pytest.mark.usefixtures("dev0")

KiB = 1 << 10
PAGE = 4 * KiB
HUGE = 2 * MiB


def info(attr):
    free, total, ret = rt.get_mem_info(attr)
    assert ret == 0
    return free, total


def used(attr):
    free, total = info(attr)
    return total - free


def malloc(size, policy=acl.ACL_MEM_MALLOC_HUGE_FIRST, fn=None):
    ptr, ret = (fn or rt.malloc)(size, policy)
    assert ret == 0, f"malloc({size}, {policy:#x}) -> {ret}"
    assert ptr != 0
    return ptr


def round_up(x, unit):
    return (x + unit - 1) // unit * unit


# ---- capacity ----

def test_capacity_per_page_kind(dev0):
    assert info(acl.ACL_HBM_MEM) == (4 * GiB, 4 * GiB)
    assert info(acl.ACL_HBM_MEM_NORMAL) == (3 * GiB, 3 * GiB)  # HBM minus the 1 GiB page pool
    assert info(acl.ACL_HBM_MEM_HUGE) == (2 * GiB, 2 * GiB)  # huge_memory
    assert info(acl.ACL_HBM_MEM_HUGE1G) == (1 * GiB, 1 * GiB)
    assert info(acl.ACL_DDR_MEM) == (256 * MiB, 256 * MiB)
    for same_as_huge in (acl.ACL_HBM_MEM_P2P_HUGE, acl.ACL_MEM_HUGE, acl.ACL_MEM_P2P_HUGE):
        assert info(same_as_huge) == info(acl.ACL_HBM_MEM_HUGE)
    for same_as_normal in (acl.ACL_HBM_MEM_P2P_NORMAL, acl.ACL_MEM_NORMAL, acl.ACL_MEM_P2P_NORMAL):
        assert info(same_as_normal) == info(acl.ACL_HBM_MEM_NORMAL)
    for same_as_1g in (acl.ACL_HBM_MEM_P2P_HUGE1G, acl.ACL_MEM_HUGE1G, acl.ACL_MEM_P2P_HUGE1G):
        assert info(same_as_1g) == info(acl.ACL_HBM_MEM_HUGE1G)
    for ddr in (acl.ACL_DDR_MEM_HUGE, acl.ACL_DDR_MEM_NORMAL, acl.ACL_DDR_MEM_P2P_HUGE, acl.ACL_DDR_MEM_P2P_NORMAL):
        assert info(ddr) == info(acl.ACL_DDR_MEM)


@pytest.mark.parametrize("attr", [18, 99, -1, 2**31 - 1, 2**31, -2**40])
def test_unknown_attribute_reports_zero(attr):
    assert rt.get_mem_info(attr) == (0, 0, 0)


def test_capacity_is_per_device(dev0):
    ptr = malloc(64 * MiB)
    assert used(acl.ACL_HBM_MEM) > 0
    assert rt.set_device(1) == 0
    assert used(acl.ACL_HBM_MEM) == 0
    assert rt.set_device(0) == 0
    assert rt.free(ptr) == 0
    assert used(acl.ACL_HBM_MEM) == 0


def test_custom_configuration(restart):
    restart(device_count=2, device_memory=512 * MiB, huge_memory=128 * MiB, huge1g_memory=0, ddr_memory=0)
    assert rt.get_device_count() == (2, 0)
    assert rt.set_device(1) == 0
    assert info(acl.ACL_HBM_MEM) == (512 * MiB, 512 * MiB)
    assert info(acl.ACL_HBM_MEM_HUGE) == (128 * MiB, 128 * MiB)
    assert info(acl.ACL_HBM_MEM_HUGE1G) == (0, 0)
    assert info(acl.ACL_DDR_MEM) == (0, 0)
    assert rt.malloc(1, acl.ACL_MEM_MALLOC_HUGE1G_ONLY) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    assert rt.malloc(1, acl.ACL_MEM_TYPE_LOW_BAND_WIDTH) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)


# ---- malloc policies ----

def test_huge_first_small_uses_normal_pages():
    ptr = malloc(1000)  # 1000 -> 1024 + 32 bytes of padding -> one 4 KiB page
    assert used(acl.ACL_HBM_MEM_NORMAL) == PAGE
    assert used(acl.ACL_HBM_MEM) == PAGE
    assert info(acl.ACL_HBM_MEM_HUGE)[0] == 2 * GiB  # huge pages untouched
    assert rt.free(ptr) == 0
    assert used(acl.ACL_HBM_MEM) == 0


def test_huge_first_large_uses_huge_pages():
    ptr = malloc(2 * MiB)  # 2 MiB + 32 bytes of padding -> two huge pages
    assert used(acl.ACL_HBM_MEM_HUGE) == 2 * HUGE
    assert used(acl.ACL_HBM_MEM) == 2 * HUGE
    assert rt.free(ptr) == 0


def test_malloc_align32_does_not_pad():
    ptr = malloc(2 * MiB, acl.ACL_MEM_MALLOC_HUGE_ONLY, rt.malloc_align32)
    assert used(acl.ACL_HBM_MEM_HUGE) == HUGE
    assert rt.free(ptr) == 0
    ptr = malloc(2 * MiB, acl.ACL_MEM_MALLOC_HUGE_ONLY, rt.malloc_cached)
    assert used(acl.ACL_HBM_MEM_HUGE) == 2 * HUGE  # malloc_cached pads like malloc
    assert rt.free(ptr) == 0


@pytest.mark.parametrize("policy", [acl.ACL_MEM_MALLOC_HUGE_ONLY, acl.ACL_MEM_MALLOC_HUGE_ONLY_P2P])
def test_huge_only_fails_when_huge_pages_run_out(policy):
    big = malloc(2 * GiB, policy, rt.malloc_align32)
    assert info(acl.ACL_HBM_MEM_HUGE)[0] == 0
    assert rt.malloc(1000, policy) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    assert info(acl.ACL_HBM_MEM_NORMAL)[0] == 1 * GiB  # normal pages are left
    assert rt.free(big) == 0
    small = malloc(1000, policy)  # even a small HUGE_ONLY block takes a huge page
    assert used(acl.ACL_HBM_MEM_HUGE) == HUGE
    assert rt.free(small) == 0


@pytest.mark.parametrize("policy", [acl.ACL_MEM_MALLOC_HUGE_FIRST, acl.ACL_MEM_MALLOC_HUGE_FIRST_P2P])
def test_huge_first_falls_back_to_normal_pages(policy):
    big = malloc(2 * GiB, acl.ACL_MEM_MALLOC_HUGE_ONLY, rt.malloc_align32)
    before = used(acl.ACL_HBM_MEM_NORMAL)
    ptr = malloc(4 * MiB, policy, rt.malloc_align32)
    assert used(acl.ACL_HBM_MEM_NORMAL) - before == 4 * MiB
    assert rt.free(ptr) == 0
    assert rt.free(big) == 0


@pytest.mark.parametrize("policy", [acl.ACL_MEM_MALLOC_NORMAL_ONLY, acl.ACL_MEM_MALLOC_NORMAL_ONLY_P2P])
def test_normal_only(policy):
    ptr = malloc(8 * MiB, policy, rt.malloc_align32)
    assert used(acl.ACL_HBM_MEM_NORMAL) == 8 * MiB
    assert info(acl.ACL_HBM_MEM_HUGE)[0] == 2 * GiB
    assert rt.free(ptr) == 0


def test_normal_and_huge_pages_share_the_hbm():
    huge = malloc(2 * GiB, acl.ACL_MEM_MALLOC_HUGE_ONLY, rt.malloc_align32)
    normal = malloc(1 * GiB, acl.ACL_MEM_MALLOC_NORMAL_ONLY, rt.malloc_align32)  # the last of the 3 GiB
    assert rt.malloc(1, acl.ACL_MEM_MALLOC_NORMAL_ONLY) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    assert rt.malloc(4 * MiB, acl.ACL_MEM_MALLOC_HUGE_FIRST) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    assert info(acl.ACL_HBM_MEM) == (1 * GiB, 4 * GiB)  # only the 1 GiB page pool is left
    one_g = malloc(1, acl.ACL_MEM_MALLOC_HUGE1G_ONLY)
    assert info(acl.ACL_HBM_MEM)[0] == 0
    for p in (huge, normal, one_g):
        assert rt.free(p) == 0
    assert info(acl.ACL_HBM_MEM)[0] == 4 * GiB


@pytest.mark.parametrize("policy", [acl.ACL_MEM_MALLOC_HUGE1G_ONLY, acl.ACL_MEM_MALLOC_HUGE1G_ONLY_P2P])
def test_huge1g_only(policy):
    ptr = malloc(1 * GiB, policy)  # no padding with 1 GiB pages: exactly one page
    assert info(acl.ACL_HBM_MEM_HUGE1G) == (0, 1 * GiB)
    assert info(acl.ACL_HBM_MEM_NORMAL)[0] == 3 * GiB
    assert rt.malloc(1, policy) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)  # no fallback
    assert rt.free(ptr) == 0
    assert info(acl.ACL_HBM_MEM_HUGE1G)[0] == 1 * GiB


@pytest.mark.parametrize("base", [acl.ACL_MEM_MALLOC_HUGE_FIRST, acl.ACL_MEM_MALLOC_HUGE_ONLY,
                                  acl.ACL_MEM_MALLOC_NORMAL_ONLY, acl.ACL_MEM_MALLOC_HUGE1G_ONLY])
def test_low_band_width_uses_ddr(base):
    ptr = malloc(3 * MiB, base | acl.ACL_MEM_TYPE_LOW_BAND_WIDTH)
    assert used(acl.ACL_DDR_MEM) >= 3 * MiB
    assert used(acl.ACL_HBM_MEM) == 0
    assert rt.free(ptr) == 0
    assert rt.malloc(300 * MiB, base | acl.ACL_MEM_TYPE_LOW_BAND_WIDTH) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)


def test_high_band_width_and_readonly_flags_keep_the_page_policy():
    ptr = malloc(4 * MiB, acl.ACL_MEM_MALLOC_HUGE_ONLY | acl.ACL_MEM_TYPE_HIGH_BAND_WIDTH, rt.malloc_align32)
    assert used(acl.ACL_HBM_MEM_HUGE) == 4 * MiB
    assert rt.free(ptr) == 0
    ptr = malloc(4 * MiB, acl.ACL_MEM_MALLOC_NORMAL_ONLY | acl.ACL_MEM_ACCESS_USER_SPACE_READONLY, rt.malloc_align32)
    assert used(acl.ACL_HBM_MEM_NORMAL) == 4 * MiB
    assert rt.free(ptr) == 0


READONLY_WRITE = """
import ctypes
from npualloc import acl
assert acl.rt.set_device(0) == 0
p, ret = acl.rt.malloc(4096, acl.ACL_MEM_ACCESS_USER_SPACE_READONLY)
assert ret == 0 and ctypes.string_at(p, 1) is not None       # reading works
ctypes.memset(p, 1, 1)                                        # writing faults
"""


def test_readonly_memory_faults_on_writes_and_reads_what_the_runtime_wrote():
    ptr = malloc(4096, acl.ACL_MEM_MALLOC_NORMAL_ONLY | acl.ACL_MEM_ACCESS_USER_SPACE_READONLY)
    assert rt.memset(ptr, 4096, 0x5A, 4096) == 0
    data = np.arange(16, dtype=np.uint8)
    assert rt.memcpy(ptr + 8, 16, data.ctypes.data, 16, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert ctypes.string_at(ptr, 24) == b"Z" * 8 + data.tobytes()
    assert rt.free(ptr) == 0
    proc = subprocess.run([sys.executable, "-c", READONLY_WRITE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)


def test_a_numpy_view_of_readonly_memory_is_readonly():
    ptr = malloc(4096, acl.ACL_MEM_MALLOC_NORMAL_ONLY | acl.ACL_MEM_ACCESS_USER_SPACE_READONLY)
    assert rt.memset(ptr, 4096, 7, 4096) == 0
    view = acl.util.ptr_to_numpy(ptr + 16, (16,), 2)
    assert not view.flags.writeable and view.tolist() == [7] * 16
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 1  # numpy refuses, where a write to the pages would kill the process
    writable = malloc(4096, acl.ACL_MEM_MALLOC_NORMAL_ONLY)
    other = acl.util.ptr_to_numpy(writable, (16,), 2)
    other[0] = 1
    assert other.flags.writeable and ctypes.string_at(writable, 1) == b"\x01"
    del view, other
    assert rt.free(ptr) == 0 and rt.free(writable) == 0


def test_low_and_high_band_width_together_is_invalid():
    flags = acl.ACL_MEM_TYPE_LOW_BAND_WIDTH | acl.ACL_MEM_TYPE_HIGH_BAND_WIDTH
    assert rt.malloc(4096, flags) == (0, acl.ACL_ERROR_INVALID_PARAM)


def test_unknown_policy_picks_pages_by_size():
    small = malloc(1000, 0x55)
    assert used(acl.ACL_HBM_MEM_NORMAL) == PAGE and used(acl.ACL_HBM_MEM_HUGE) == 0
    big = malloc(2 * MiB, 0x55, rt.malloc_align32)
    assert used(acl.ACL_HBM_MEM_HUGE) == HUGE
    assert rt.free(small) == 0 and rt.free(big) == 0


def test_malloc_pointers_are_64_byte_aligned_and_distinct():
    ptrs = [malloc(n) for n in (1, 31, 32, 33, 4095, 4096, 5000, 3 * MiB)]
    assert len(set(ptrs)) == len(ptrs)
    assert all(p % 64 == 0 for p in ptrs)
    for p in ptrs:
        assert rt.free(p) == 0
    assert used(acl.ACL_HBM_MEM) == 0


@pytest.mark.parametrize("fn", [rt.malloc, rt.malloc_align32, rt.malloc_cached])
@pytest.mark.parametrize("size,code", [(0, acl.ACL_ERROR_INVALID_PARAM), (-1, acl.ACL_ERROR_INVALID_PARAM),
                                       (-2**70, acl.ACL_ERROR_INVALID_PARAM), (2**64, acl.ACL_ERROR_INVALID_PARAM),
                                       (2**64 - 1, acl.ACL_ERROR_INVALID_PARAM),  # rounding overflows
                                       (2**64 - 65, acl.ACL_ERROR_RT_MEMORY_ALLOCATION),
                                       (2**61, acl.ACL_ERROR_RT_MEMORY_ALLOCATION),
                                       (5 * GiB, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)])
def test_malloc_bad_sizes(fn, size, code):
    assert fn(size, 0) == (0, code)
    assert used(acl.ACL_HBM_MEM) == 0


def test_free_errors():
    ptr = malloc(100)
    assert rt.free(ptr) == 0
    assert rt.free(ptr) == acl.ACL_ERROR_RT_MEMORY_FREE  # freed
    assert rt.free(0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.free(-1) == acl.ACL_ERROR_RT_MEMORY_FREE
    assert rt.free(2**64) == acl.ACL_ERROR_RT_MEMORY_FREE
    buf = ctypes.create_string_buffer(64)
    assert rt.free(ctypes.addressof(buf)) == acl.ACL_ERROR_RT_MEMORY_FREE  # host memory
    ptr = malloc(8192)
    assert rt.free(ptr + 64) == acl.ACL_ERROR_RT_MEMORY_FREE  # inside a block
    assert rt.free(ptr) == 0


# ---- memcpy / memset ----

def test_memset_and_read_back():
    ptr = malloc(4096)
    assert rt.memset(ptr, 4096, 0xAB, 4096) == 0
    assert acl.util.ptr_to_bytes(ptr, 4096) == b"\xab" * 4096
    assert rt.memset(ptr + 10, 100, 0x1FF, 5) == 0  # the value's low byte, as C memset
    assert acl.util.ptr_to_bytes(ptr + 8, 9) == b"\xab\xab\xff\xff\xff\xff\xff\xab\xab"
    assert rt.free(ptr) == 0


@pytest.mark.parametrize("kind", [acl.ACL_MEMCPY_HOST_TO_HOST, acl.ACL_MEMCPY_HOST_TO_DEVICE,
                                  acl.ACL_MEMCPY_DEVICE_TO_HOST, acl.ACL_MEMCPY_DEVICE_TO_DEVICE,
                                  acl.ACL_MEMCPY_DEFAULT, acl.ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE])
def test_memcpy_every_kind_moves_the_bytes(kind):
    # The direction is taken from the pointers (as in CANN, where kind is advisory): each kind
    # is checked with the pointers it names.
    payload = bytes(range(256)) * 4
    host_src = ctypes.create_string_buffer(payload, len(payload))
    host_dst = ctypes.create_string_buffer(len(payload))
    dev_src, dev_dst = malloc(len(payload)), malloc(len(payload))
    assert rt.memcpy(dev_src, len(payload), ctypes.addressof(host_src), len(payload), 1) == 0
    src = {0: host_src, 1: host_src, 5: host_src}.get(kind)
    src = ctypes.addressof(src) if src is not None else dev_src
    dst = ctypes.addressof(host_dst) if kind in (0, 2) else dev_dst
    assert rt.memcpy(dst, len(payload), src, len(payload), kind) == 0
    got = host_dst.raw if kind in (0, 2) else acl.util.ptr_to_bytes(dev_dst, len(payload))
    assert got == payload
    assert rt.free(dev_src) == 0 and rt.free(dev_dst) == 0


def test_memcpy_with_bytes_and_bytearray_buffers():
    data = b"npualloc" * 8
    dev = malloc(64)
    assert rt.memcpy(dev, 64, acl.util.bytes_to_ptr(data), 64, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    out = bytearray(64)
    assert rt.memcpy(acl.util.bytes_to_ptr(out), 64, dev, 64, acl.ACL_MEMCPY_DEVICE_TO_HOST) == 0
    assert bytes(out) == data
    assert rt.free(dev) == 0


def test_memcpy_errors():
    a, b = malloc(4096), malloc(4096)
    host = ctypes.create_string_buffer(16384)
    h = ctypes.addressof(host)
    assert rt.memcpy(a, 4096, b, 0, 3) == 0  # nothing to copy
    assert rt.memcpy(0, 0, 0, 0, 99) == 0  # count 0 succeeds before any check
    assert rt.memcpy(a, 100, b, 101, 3) == acl.ACL_ERROR_RT_PARAM_INVALID  # count > dest_max
    assert rt.memcpy(0, 100, b, 10, 3) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.memcpy(a, 100, 0, 10, 3) == acl.ACL_ERROR_INVALID_PARAM
    for kind in (acl.ACL_MEMCPY_INNER_DEVICE_TO_DEVICE, acl.ACL_MEMCPY_INTER_DEVICE_TO_DEVICE, 8, -1, 2**31, -2**63):
        assert rt.memcpy(a, 100, b, 10, kind) == acl.ACL_ERROR_INVALID_PARAM, kind
    assert rt.memcpy(a, 2 * MiB, b, 1 * MiB, 3) == acl.ACL_ERROR_RT_PARAM_INVALID  # past the end of b's memory
    # 4096 bytes + 32 of padding are backed by two 4 KiB pages: the block ends at 8 KiB
    assert rt.memcpy(h, 16384, a, 8192, 2) == 0
    assert rt.memcpy(h, 16384, a, 8193, 2) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.memcpy(a, -1, b, 10, 3) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.memcpy(a, 10, b, -10, 3) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.memcpy(-a, 10, b, 10, 3) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.free(b) == 0
    assert rt.memcpy(a, 10, b, 10, 3) == acl.ACL_ERROR_RT_PARAM_INVALID  # freed source
    assert rt.memcpy(b, 10, a, 10, 3) == acl.ACL_ERROR_RT_PARAM_INVALID  # freed destination
    assert rt.memcpy(h, 10, b, 10, 2) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.free(a) == 0


def test_memset_errors():
    a = malloc(4096)
    assert rt.memset(a, 10, 1, 0) == 0
    assert rt.memset(0, 10, 1, 0) == 0
    assert rt.memset(0, 10, 1, 5) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.memset(a, 10, 1, 11) == acl.ACL_ERROR_RT_PARAM_INVALID  # count > max_count
    assert rt.memset(a, 2 * MiB, 1, 1 * MiB) == acl.ACL_ERROR_RT_PARAM_INVALID  # past the end
    assert rt.memset(a, 10, 2**31, 5) == acl.ACL_ERROR_INVALID_PARAM  # value is an int32
    assert rt.memset(a, 10, -2**31 - 1, 5) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.memset(a, -10, 1, 5) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.memset(a, 10, 1, -5) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.memset(-1, 10, 1, 5) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.free(a) == 0
    assert rt.memset(a, 10, 1, 5) == acl.ACL_ERROR_RT_PARAM_INVALID  # freed


# ---- 2-D copies ----

def copy2d(stream, dst, dpitch, src, spitch, width, height, kind):
    """acl.rt.memcpy2d, or with a stream acl.rt.memcpy2d_async and then a synchronize."""
    if stream is None:
        return rt.memcpy2d(dst, dpitch, src, spitch, width, height, kind)
    ret = rt.memcpy2d_async(dst, dpitch, src, spitch, width, height, kind, stream)
    return ret or rt.synchronize_stream(stream)


@pytest.fixture(params=["sync", "async"])
def stream2d(request):
    if request.param == "sync":
        yield None
        return
    s, ret = rt.create_stream()
    assert ret == 0
    yield s
    assert rt.destroy_stream(s) == 0


def test_memcpy2d_round_trip_with_pitches_above_the_width(stream2d):
    """5 rows of 24 bytes: host (pitch 40) -> device (pitch 32) -> host (pitch 48); the bytes between the rows
    stay as they were."""
    src = (np.arange(5 * 40) * 7 + 1).astype(np.uint8)
    dev = malloc(5 * 32)
    pinned, ret = rt.malloc_host(5 * 48)
    assert ret == 0
    assert rt.memset(dev, 5 * 32, 0xEE, 5 * 32) == 0
    assert copy2d(stream2d, dev, 32, src.ctypes.data, 40, 24, 5, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert rt.memset(pinned, 5 * 48, 0x11, 5 * 48) == 0
    assert copy2d(stream2d, pinned, 48, dev, 32, 24, 5, acl.ACL_MEMCPY_DEFAULT) == 0
    flat = np.frombuffer(acl.util.ptr_to_bytes(dev, 5 * 32), dtype=np.uint8).reshape(5, 32)
    back = np.frombuffer(acl.util.ptr_to_bytes(pinned, 5 * 48), dtype=np.uint8).reshape(5, 48)
    assert (back[:, :24] == src.reshape(5, 40)[:, :24]).all()
    assert (back[:, 24:] == 0x11).all() and (flat[:, 24:] == 0xEE).all()
    assert rt.free_host(pinned) == 0 and rt.free(dev) == 0


def test_memcpy2d_error_codes(stream2d):
    dev, other = malloc(4096), malloc(4096)
    h1, h2 = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    h = h1.ctypes.data
    max_h, max_w = 5 * 1024 * 1024, 5000000
    invalid, rt_invalid, unsupported = (acl.ACL_ERROR_INVALID_PARAM, acl.ACL_ERROR_RT_PARAM_INVALID,
                                        acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
    h2d = acl.ACL_MEMCPY_HOST_TO_DEVICE
    # CANN's ACL layer: pointers, height, width, width against the pitches, kind.
    assert copy2d(stream2d, 0, 32, h, 32, 8, 2, h2d) == invalid
    assert copy2d(stream2d, dev, 32, 0, 32, 8, 2, h2d) == invalid
    assert copy2d(stream2d, dev, 32, h, 32, 8, 0, h2d) == invalid
    assert copy2d(stream2d, dev, 32, h, 32, 0, 2, h2d) == invalid
    assert copy2d(stream2d, dev, 32, h, 16, 17, 2, h2d) == invalid
    assert copy2d(stream2d, dev, 16, h, 32, 17, 2, h2d) == invalid
    for kind in (acl.ACL_MEMCPY_HOST_TO_HOST, acl.ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE,
                 acl.ACL_MEMCPY_INNER_DEVICE_TO_DEVICE, acl.ACL_MEMCPY_INTER_DEVICE_TO_DEVICE, 8, -1, 2**31):
        assert copy2d(stream2d, dev, 32, h, 32, 8, 2, kind) == invalid, kind
    assert copy2d(stream2d, dev, 32, h, 32, 8, max_h + 1, acl.ACL_MEMCPY_HOST_TO_HOST) == invalid
    assert copy2d(stream2d, -1, 32, h, 32, 8, 2, h2d) == invalid  # not a pointer
    # Its runtime: the limits, then DEVICE_TO_DEVICE.
    assert copy2d(stream2d, dev, 32, h, 32, 8, max_h + 1, h2d) == rt_invalid
    assert copy2d(stream2d, dev, max_w + 1, h, max_w + 1, max_w + 1, 1, h2d) == rt_invalid
    assert copy2d(stream2d, dev, max_w, other, max_w, max_w, max_h, acl.ACL_MEMCPY_DEVICE_TO_DEVICE) == unsupported
    # The memory: host to host, device to device, a row past the allocation's pages (nothing copied).
    assert copy2d(stream2d, h2.ctypes.data, 32, h, 32, 8, 2, h2d) == rt_invalid
    assert copy2d(stream2d, dev, 32, other, 32, 8, 2, acl.ACL_MEMCPY_DEFAULT) == rt_invalid
    # A kind against the pointers' direction: refused for pageable host memory, overridden for pinned.
    d2h = acl.ACL_MEMCPY_DEVICE_TO_HOST
    assert copy2d(stream2d, dev, 32, h, 32, 8, 2, d2h) == rt_invalid
    assert copy2d(stream2d, h, 32, dev, 32, 8, 2, h2d) == rt_invalid
    pinned, ret = rt.malloc_host(64)
    assert ret == 0
    assert copy2d(stream2d, dev, 32, pinned, 32, 8, 2, d2h) == 0
    assert copy2d(stream2d, pinned, 32, dev, 32, 8, 2, h2d) == 0
    assert rt.free_host(pinned) == 0
    ones = np.full(16, 0xFF, dtype=np.uint8)
    assert rt.memset(dev, 8192, 0, 8192) == 0
    # 4096 bytes + 32 of padding are backed by two 4 KiB pages: the second row starts past them
    assert copy2d(stream2d, dev + 8192 - 8, 8, ones.ctypes.data, 8, 8, 2, h2d) == rt_invalid
    assert acl.util.ptr_to_bytes(dev + 8192 - 8, 8) == b"\0" * 8
    assert rt.free(other) == 0
    assert copy2d(stream2d, h, 32, other, 32, 8, 2, acl.ACL_MEMCPY_DEVICE_TO_HOST) == rt_invalid  # freed
    assert rt.free(dev) == 0


def test_memcpy2d_async_is_one_task_in_the_streams_order():
    s, ret = rt.create_stream()
    assert ret == 0
    dev = malloc(4 * 16)
    src = np.arange(100, 132, dtype=np.uint8)  # 4 rows of 8 bytes
    out = np.zeros(4 * 16, dtype=np.uint8)
    assert rt.memset_async(dev, 64, 0x33, 64, s) == 0
    assert rt.memcpy2d_async(dev, 16, src.ctypes.data, 8, 8, 4, acl.ACL_MEMCPY_HOST_TO_DEVICE, s) == 0
    assert rt.memcpy_async(out.ctypes.data, 64, dev, 64, acl.ACL_MEMCPY_DEVICE_TO_HOST, s) == 0
    assert rt.synchronize_stream(s) == 0
    assert (out.reshape(4, 16)[:, :8] == src.reshape(4, 8)).all() and (out.reshape(4, 16)[:, 8:] == 0x33).all()
    assert rt.destroy_stream(s) == 0 and rt.free(dev) == 0


def test_memcpy2d_argument_types():
    with pytest.raises(TypeError, match=r"^acl\.rt\.memcpy2d args parse failed"):
        rt.memcpy2d(0, 32, 0, 32, 8, 2)
    with pytest.raises(TypeError, match=r"^acl\.rt\.memcpy2d_async args parse failed"):
        rt.memcpy2d_async(0, 32, 0, 32, "8", 2, 1, 0)


def test_device_to_device_across_devices_needs_peer_access():
    a = malloc(4096)
    assert rt.memset(a, 4096, 0x44, 4096) == 0
    assert rt.set_device(1) == 0
    b = malloc(4096)
    assert rt.memcpy(b, 4096, a, 4096, 3) == acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert rt.device_enable_peer_access(0, 0) == 0
    assert rt.memcpy(b, 4096, a, 4096, 3) == 0
    assert acl.util.ptr_to_bytes(b, 4096) == b"\x44" * 4096
    assert rt.device_disable_peer_access(0) == 0
    assert rt.memcpy(b, 4096, a, 4096, 3) == acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert rt.free(b) == 0
    assert rt.free(a) == 0  # any device may free any pointer


# ---- pinned host memory ----

def test_malloc_host_roundtrip():
    ptr, ret = rt.malloc_host(10000)
    assert ret == 0 and ptr != 0
    assert used(acl.ACL_HBM_MEM) == 0  # host memory is not device capacity
    assert rt.memset(ptr, 10000, 0x61, 10000) == 0
    dev = malloc(10000)
    assert rt.memcpy(dev, 10000, ptr, 10000, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
    assert acl.util.ptr_to_bytes(dev, 10000) == b"a" * 10000
    assert ctypes.string_at(ptr, 4) == b"aaaa"  # ordinary host memory
    assert rt.free(dev) == 0
    assert rt.free(ptr) == acl.ACL_ERROR_RT_MEMORY_FREE  # not device memory
    assert rt.free_host(ptr) == 0
    assert rt.free_host(ptr) == acl.ACL_ERROR_RT_MEMORY_FREE


def test_malloc_host_errors(npu):
    # needs no current device
    assert rt.malloc_host(0) == (0, acl.ACL_ERROR_INVALID_PARAM)
    assert rt.malloc_host(-1) == (0, acl.ACL_ERROR_INVALID_PARAM)
    assert rt.malloc_host(2**64) == (0, acl.ACL_ERROR_INVALID_PARAM)
    assert rt.malloc_host(2**61) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    assert rt.free_host(0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.free_host(-5) == acl.ACL_ERROR_RT_MEMORY_FREE
    dev = malloc(64)
    assert rt.free_host(dev) == acl.ACL_ERROR_RT_MEMORY_FREE
    assert rt.free(dev) == 0


# ---- acl.util ----

def test_ptr_to_bytes_validates_device_pointers():
    ptr = malloc(4096)
    assert rt.memset(ptr, 4096, 7, 4096) == 0
    assert acl.util.ptr_to_bytes(ptr, 0) == b""
    assert acl.util.ptr_to_bytes(ptr, 3) == b"\x07\x07\x07"
    with pytest.raises(ValueError, match="not mapped device memory"):
        acl.util.ptr_to_bytes(ptr, 2 * MiB)  # runs past the block
    assert rt.free(ptr) == 0
    with pytest.raises(ValueError, match="not mapped device memory"):
        acl.util.ptr_to_bytes(ptr, 16)  # freed
    with pytest.raises(ValueError):
        acl.util.ptr_to_bytes(0, 16)
    with pytest.raises(ValueError):
        acl.util.ptr_to_bytes(-1, 16)
    with pytest.raises(ValueError):
        acl.util.ptr_to_bytes(ptr, -1)
    with pytest.raises(TypeError, match=r"acl\.util\.ptr_to_bytes\(\) argument 'size'"):
        acl.util.ptr_to_bytes(ptr, "16")


def test_bytes_to_ptr():
    data = b"hello, npu"
    assert ctypes.string_at(acl.util.bytes_to_ptr(data), len(data)) == data
    buf = bytearray(b"xyz")
    assert acl.util.ptr_to_bytes(acl.util.bytes_to_ptr(buf), 3) == b"xyz"
    for bad in ("text", 5, memoryview(b"ab"), None):
        with pytest.raises(TypeError, match=r"acl\.util\.bytes_to_ptr\(\) argument 'bytes_obj'"):
            acl.util.bytes_to_ptr(bad)


@pytest.mark.parametrize("code,dtype", [(0, np.bool_), (1, np.int8), (2, np.uint8), (3, np.int16), (4, np.uint16),
                                        (5, np.int32), (6, np.uint32), (7, np.int64), (8, np.uint64),
                                        (11, np.float32), (12, np.float64), (23, np.float16)])
def test_numpy_roundtrip_through_device_memory(code, dtype):
    src = (np.arange(24) % 2 == 1) if dtype is np.bool_ else np.arange(24).astype(dtype)
    src = src.reshape(2, 3, 4)
    dev = malloc(src.nbytes)
    assert rt.memcpy(dev, src.nbytes, acl.util.numpy_to_ptr(src), src.nbytes, 1) == 0
    view = acl.util.ptr_to_numpy(dev, (2, 3, 4), code)
    assert view.dtype == dtype and view.shape == (2, 3, 4)
    assert np.array_equal(view, src)
    view[0, 0, 0] = 1  # a view: writes reach the device memory
    assert acl.util.ptr_to_bytes(dev, view.itemsize) == np.array([1], dtype=dtype).tobytes()
    del view
    assert rt.free(dev) == 0


def test_ptr_to_numpy_checks():
    dev = malloc(64)
    assert acl.util.ptr_to_numpy(dev, [4], 5).shape == (4,)
    assert acl.util.ptr_to_numpy(dev, 4, 5).shape == (4,)
    assert acl.util.ptr_to_numpy(dev, (0,), 5).size == 0
    # NumPy's integers are ints here, as in acl.rt's arguments (they were a TypeError); a bool is not
    view = acl.util.ptr_to_numpy(np.uint64(dev), (np.int64(2), np.int32(2)), np.int8(5))
    assert view.shape == (2, 2) and view.dtype == np.int32
    with pytest.raises(TypeError, match="'shape'"):
        acl.util.ptr_to_numpy(dev, (True,), 5)
    with pytest.raises(ValueError, match="npy_type"):
        acl.util.ptr_to_numpy(dev, (4,), 17)  # NPY_OBJECT
    with pytest.raises(ValueError, match="negative"):
        acl.util.ptr_to_numpy(dev, (-4,), 5)
    with pytest.raises(ValueError, match="not mapped device memory"):
        acl.util.ptr_to_numpy(dev, (1 << 20,), 7)
    with pytest.raises(TypeError, match="'ptr'"):
        acl.util.ptr_to_numpy(str(dev), (4,), 5)
    with pytest.raises(TypeError, match="'shape'"):
        acl.util.ptr_to_numpy(dev, (4.0,), 5)
    with pytest.raises(TypeError, match="'npy_type'"):
        acl.util.ptr_to_numpy(dev, (4,), "int32")
    assert rt.free(dev) == 0
    with pytest.raises(ValueError, match="not mapped device memory"):
        acl.util.ptr_to_numpy(dev, (4,), 5)


def test_numpy_to_ptr():
    arr = np.zeros(8, dtype=np.int32)
    assert acl.util.numpy_to_ptr(arr) == arr.ctypes.data
    with pytest.warns(RuntimeWarning, match="contiguous"):
        assert acl.util.numpy_to_ptr(arr[::2]) == arr.ctypes.data
    with pytest.raises(TypeError, match=r"numpy_to_ptr\(\) argument 'arr'"):
        acl.util.numpy_to_ptr([1, 2, 3])
