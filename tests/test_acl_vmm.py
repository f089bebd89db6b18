"""Virtual memory management through acl.rt: physical handles, reserved ranges, mappings,
aliases, faults on unmapped memory, and the errors of each call."""
import ctypes

import pytest

from conftest import GiB, MiB, run_python
from npualloc import _C, acl

rt = acl.rt
pytestmark = pytest.mark.usefixtures("dev0")

G2 = 2 * MiB


def prop(mem_attr=acl.ACL_HBM_MEM_HUGE, dev=0, loc_type=acl.ACL_MEM_LOCATION_TYPE_DEVICE, **over):
    p = {"handleType": acl.ACL_MEM_HANDLE_TYPE_NONE, "allocationType": acl.ACL_MEM_ALLOCATION_TYPE_PINNED,
         "memAttr": mem_attr, "location": {"id": dev, "type": loc_type}, "reserve": 0}
    p.update(over)
    return p


def physical(size=G2, p=None):
    handle, ret = rt.malloc_physical(size, p or prop(), 0)
    assert ret == 0 and handle != 0
    return handle


def reserve(size=G2, expect=0, flags=0):
    va, ret = rt.reserve_mem_address(size, 0, expect, flags)
    assert ret == 0 and va != 0
    return va


def counts():
    c = _C.vmm_counts()
    return c["physical_handles"], c["reservations"], c["mappings"]


def test_readme_example_alias(dev0):
    handle = physical()
    a, b = reserve(), reserve()
    assert a != b
    assert rt.map_mem(a, G2, 0, handle, 0) == 0
    assert rt.map_mem(b, G2, 0, handle, 0) == 0  # the same physical memory at a second address
    assert rt.memset(a, G2, 0x5A, 16) == 0
    assert acl.util.ptr_to_bytes(b, 16) == b"Z" * 16


def test_bytes_written_through_one_mapping_are_read_through_the_other():
    handle = physical(2 * G2)
    a, b = reserve(2 * G2), reserve(4 * G2)
    assert rt.map_mem(a, 2 * G2, 0, handle, 0) == 0
    assert rt.map_mem(b + G2, 2 * G2, 0, handle, 0) == 0  # any granule inside a reservation
    payload = bytes(range(256)) * 64
    assert rt.memcpy(a + G2 + 100, len(payload), acl.util.bytes_to_ptr(payload), len(payload), 1) == 0
    assert acl.util.ptr_to_bytes(b + 2 * G2 + 100, len(payload)) == payload
    # and the other way round, through the CPU directly
    ctypes.memmove(b + G2, b"written at b", 12)
    assert ctypes.string_at(a, 12) == b"written at b"
    assert rt.unmap_mem(a) == 0
    assert acl.util.ptr_to_bytes(b + G2, 12) == b"written at b"  # b still maps the memory
    assert rt.unmap_mem(b + G2) == 0
    assert rt.free_physical(handle) == 0
    assert rt.release_mem_address(a) == 0 and rt.release_mem_address(b) == 0
    assert counts() == (0, 0, 0)


def test_two_handles_in_one_reservation():
    h1, h2 = physical(), physical()
    va = reserve(2 * G2)
    assert rt.map_mem(va, G2, 0, h1, 0) == 0
    assert rt.map_mem(va + G2, G2, 0, h2, 0) == 0
    assert rt.memset(va, 2 * G2, 0x77, 2 * G2) == 0  # one operation across both mappings
    assert acl.util.ptr_to_bytes(va + G2 - 2, 4) == b"\x77" * 4
    assert counts() == (2, 1, 2)
    for p in (va, va + G2):
        assert rt.unmap_mem(p) == 0
    assert rt.free_physical(h1) == 0 and rt.free_physical(h2) == 0
    assert rt.release_mem_address(va) == 0


def test_capacity_charged_per_physical_handle():
    free0, total, _ = rt.get_mem_info(acl.ACL_HBM_MEM_HUGE)
    handle = physical(4 * G2)
    assert rt.get_mem_info(acl.ACL_HBM_MEM_HUGE)[0] == free0 - 4 * G2
    va = reserve(4 * G2)  # address space costs no capacity
    assert rt.get_mem_info(acl.ACL_HBM_MEM_HUGE)[0] == free0 - 4 * G2
    assert rt.map_mem(va, 4 * G2, 0, handle, 0) == 0
    assert rt.free_physical(handle) == 0
    # freed while mapped: the memory stays (and stays charged) until the last unmap
    assert rt.get_mem_info(acl.ACL_HBM_MEM_HUGE)[0] == free0 - 4 * G2
    assert rt.memset(va, 16, 1, 16) == 0
    assert counts() == (1, 1, 1)
    assert rt.unmap_mem(va) == 0
    assert rt.get_mem_info(acl.ACL_HBM_MEM_HUGE) == (free0, total, 0)
    assert counts() == (0, 1, 0)
    assert rt.release_mem_address(va) == 0


def test_physical_memory_runs_out():
    handle = physical(2 * GiB)  # all of the huge pages
    assert rt.malloc_physical(G2, prop(), 0) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    one_g, ret = rt.malloc_physical(1 * GiB, prop(acl.ACL_HBM_MEM_HUGE1G), 0)
    assert ret == 0
    assert rt.malloc_physical(1 * GiB, prop(acl.ACL_HBM_MEM_HUGE1G), 0) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    assert rt.free_physical(handle) == 0 and rt.free_physical(one_g) == 0
    assert rt.get_mem_info(acl.ACL_HBM_MEM) == (4 * GiB, 4 * GiB, 0)


def test_host_located_physical_memory():
    before = rt.get_mem_info(acl.ACL_HBM_MEM)
    handle = physical(G2, prop(acl.ACL_DDR_MEM_HUGE, loc_type=acl.ACL_MEM_LOCATION_TYPE_HOST))
    assert rt.get_mem_info(acl.ACL_HBM_MEM) == before
    va = reserve()
    assert rt.map_mem(va, G2, 0, handle, 0) == 0
    assert rt.memset(va, G2, 3, G2) == 0
    assert acl.util.ptr_to_bytes(va + G2 - 1, 1) == b"\x03"
    assert rt.unmap_mem(va) == 0 and rt.free_physical(handle) == 0 and rt.release_mem_address(va) == 0


@pytest.mark.parametrize("attr,gran", [(acl.ACL_HBM_MEM_HUGE, G2), (acl.ACL_HBM_MEM_NORMAL, G2),
                                       (acl.ACL_MEM_HUGE, G2), (acl.ACL_HBM_MEM_HUGE1G, GiB),
                                       (acl.ACL_MEM_P2P_HUGE1G, GiB)])
def test_granularity(attr, gran):
    for option in (acl.ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, acl.ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED):
        assert rt.mem_get_allocation_granularity(prop(attr), option) == (gran, 0)


def test_granularity_errors():
    invalid = acl.ACL_ERROR_INVALID_PARAM
    g = rt.mem_get_allocation_granularity
    # the option goes to CANN's driver, which refuses it (so does a `reserve` other than 0)
    unsupported = acl.ACL_ERROR_RT_FEATURE_NOT_SUPPORT
    assert g(prop(), acl.ACL_RT_MEM_ALLOC_GRANULARITY_UNDEF) == (0, unsupported)
    assert g(prop(), -1) == (0, unsupported)
    assert g(prop(), 2**40) == (0, unsupported)
    assert g(dict(prop(), reserve=1), 0) == (0, acl.ACL_ERROR_RT_PARAM_INVALID)
    assert g(prop(acl.ACL_HBM_MEM), 0) == (0, invalid)  # not a physical attribute
    assert g(prop(acl.ACL_DDR_MEM_HUGE), 0) == (0, invalid)  # DDR on a device location
    assert g(prop(acl.ACL_DDR_MEM_HUGE, loc_type=acl.ACL_MEM_LOCATION_TYPE_HOST), 0) == (G2, 0)
    assert g(prop(loc_type=acl.ACL_MEM_LOCATION_TYPE_UNREGISTERED), 0) == (0, invalid)
    assert g(prop(dev=4), 0) == (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)
    assert g(prop(dev=-1), 0) == (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)
    assert g(prop(dev=2**40), 0) == (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)
    assert g(prop(mem_attr=2**40), 0) == (0, invalid)
    assert g(prop(reserve=-1), 0) == (0, invalid)


def test_malloc_physical_errors():
    invalid = acl.ACL_ERROR_INVALID_PARAM
    mp = rt.malloc_physical
    assert mp(0, prop(), 0) == (0, invalid)
    assert mp(-G2, prop(), 0) == (0, invalid)
    assert mp(2**64, prop(), 0) == (0, invalid)
    assert mp(G2, prop(), 1) == (0, invalid)
    assert mp(G2, prop(), -1) == (0, invalid)
    assert mp(G2 + 4096, prop(), 0) == (0, acl.ACL_ERROR_RT_PARAM_INVALID)  # not a multiple of the granularity
    assert mp(G2, prop(acl.ACL_HBM_MEM_HUGE1G), 0) == (0, acl.ACL_ERROR_RT_PARAM_INVALID)
    assert mp(G2, prop(handleType=acl.ACL_MEM_HANDLE_TYPE_POSIX), 0) == (0, invalid)
    assert mp(G2, prop(allocationType=1), 0) == (0, invalid)
    assert mp(G2, prop(allocationType=-2**40), 0) == (0, invalid)
    for attr in (acl.ACL_DDR_MEM, acl.ACL_HBM_MEM, acl.ACL_DDR_MEM_NORMAL, 18, -1):
        assert mp(G2, prop(attr), 0) == (0, invalid), attr
    for loc in (acl.ACL_MEM_LOCATION_TYPE_UNREGISTERED, acl.ACL_MEM_LOCATION_TYPE_MANAGED, 7):
        assert mp(G2, prop(loc_type=loc), 0) == (0, invalid), loc
    assert mp(G2, prop(dev=4), 0) == (0, acl.ACL_ERROR_RT_INVALID_DEVICEID)
    assert mp(2**61, prop(), 0) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    assert counts()[0] == 0


def test_forged_and_stale_handles():
    bad = acl.ACL_ERROR_RT_INVALID_HANDLE
    handle = physical()
    va = reserve()
    stream, _ = rt.create_stream()
    for forged in (12345, handle + 1, handle ^ (1 << 30), stream, va, -1, 2**64):
        assert rt.free_physical(forged) == bad, forged
        assert rt.map_mem(va, G2, 0, forged, 0) == bad, forged
    assert rt.free_physical(0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.map_mem(va, G2, 0, 0, 0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.free_physical(handle) == 0
    assert rt.free_physical(handle) == bad  # stale
    assert rt.map_mem(va, G2, 0, handle, 0) == bad
    again = physical()  # a new handle never reuses the stale value
    assert again != handle and rt.free_physical(handle) == bad
    assert rt.free_physical(again) == 0
    assert rt.destroy_stream(stream) == 0


def test_map_errors():
    handle = physical()
    va = reserve(2 * G2)
    param = acl.ACL_ERROR_RT_PARAM_INVALID
    invalid = acl.ACL_ERROR_INVALID_PARAM
    assert rt.map_mem(va, G2 // 2, 0, handle, 0) == param  # not the handle's size
    assert rt.map_mem(va, 2 * G2, 0, handle, 0) == param
    assert rt.map_mem(va, 0, 0, handle, 0) == invalid
    assert rt.map_mem(va, -1, 0, handle, 0) == invalid
    assert rt.map_mem(va, G2, 4096, handle, 0) == invalid  # offset must be 0
    assert rt.map_mem(va, G2, -1, handle, 0) == invalid
    assert rt.map_mem(va, G2, 0, handle, 1) == invalid  # flags must be 0
    assert rt.map_mem(va, G2, 0, handle, 2**64) == invalid
    assert rt.map_mem(0, G2, 0, handle, 0) == invalid
    assert rt.map_mem(va + 4096, G2, 0, handle, 0) == param  # not on a granule
    assert rt.map_mem(va + 2 * G2, G2, 0, handle, 0) == param  # past the reservation
    assert rt.map_mem(-va, G2, 0, handle, 0) == param
    host = ctypes.create_string_buffer(64)
    assert rt.map_mem(ctypes.addressof(host), G2, 0, handle, 0) == param  # not reserved
    assert rt.map_mem(va, G2, 0, handle, 0) == 0
    assert rt.map_mem(va, G2, 0, handle, 0) == param  # already mapped there
    other = physical()
    assert rt.map_mem(va, G2, 0, other, 0) == param
    ptr, _ = rt.malloc(100, 0)
    assert rt.map_mem(ptr, G2, 0, other, 0) == param  # malloc memory is not a reservation
    assert rt.unmap_mem(ptr) == param
    assert rt.release_mem_address(ptr) == param
    assert rt.free(ptr) == 0
    assert rt.free(va) == acl.ACL_ERROR_RT_MEMORY_FREE  # a reservation is not malloc memory
    assert rt.unmap_mem(va) == 0
    assert rt.free_physical(handle) == 0 and rt.free_physical(other) == 0
    assert rt.release_mem_address(va) == 0


def test_one_reservation_holds_one_device():
    h0 = physical(p=prop(dev=0))
    h1 = physical(p=prop(dev=1))
    va = reserve(2 * G2)
    assert rt.map_mem(va, G2, 0, h0, 0) == 0
    assert rt.map_mem(va + G2, G2, 0, h1, 0) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.unmap_mem(va) == 0
    assert rt.map_mem(va + G2, G2, 0, h1, 0) == 0  # empty again: any device
    assert rt.unmap_mem(va + G2) == 0
    assert rt.free_physical(h0) == 0 and rt.free_physical(h1) == 0 and rt.release_mem_address(va) == 0


def test_unmap_and_release_errors():
    param = acl.ACL_ERROR_RT_PARAM_INVALID
    handle = physical()
    va = reserve()
    assert rt.unmap_mem(0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.release_mem_address(0) == acl.ACL_ERROR_INVALID_PARAM
    assert rt.unmap_mem(va) == param  # nothing mapped
    assert rt.unmap_mem(-1) == param
    assert rt.release_mem_address(-1) == param
    assert rt.map_mem(va, G2, 0, handle, 0) == 0
    assert rt.unmap_mem(va + 4096) == param  # not where a mapping starts
    assert rt.release_mem_address(va) == param  # still mapped
    assert rt.unmap_mem(va) == 0
    assert rt.unmap_mem(va) == param
    assert rt.release_mem_address(va + G2 // 2) == param  # not where the reservation starts
    assert rt.release_mem_address(va) == 0
    assert rt.release_mem_address(va) == param
    assert rt.map_mem(va, G2, 0, handle, 0) == param  # released
    assert rt.free_physical(handle) == 0


def test_reserve_errors_and_expect_ptr():
    invalid = acl.ACL_ERROR_INVALID_PARAM
    assert rt.reserve_mem_address(0, 0, 0, 0) == (0, invalid)
    assert rt.reserve_mem_address(-1, 0, 0, 0) == (0, invalid)
    assert rt.reserve_mem_address(G2, 4096, 0, 0) == (0, invalid)  # alignment is reserved: 0
    assert rt.reserve_mem_address(G2, 0, 0, 2) == (0, invalid)
    assert rt.reserve_mem_address(G2, 0, -1, 0) == (0, invalid)
    assert rt.reserve_mem_address(2**60, 0, 0, 0) == (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION)
    va = reserve(512, flags=1)  # torch_npu's probe: flags 1 and any size
    assert va % G2 == 0
    assert rt.reserve_mem_address(G2, 0, va, 0) == (0, acl.ACL_ERROR_RT_PARAM_INVALID)  # taken
    assert rt.reserve_mem_address(G2, 0, va + 4096, 0) == (0, invalid)  # not on a granule
    assert rt.release_mem_address(va) == 0
    assert rt.reserve_mem_address(G2, 0, va, 0) == (va, 0)  # free again: exactly there
    assert rt.release_mem_address(va) == 0


def test_no_leaks_after_a_mixed_session():
    handles = [physical() for _ in range(3)]
    vas = [reserve(3 * G2) for _ in range(2)]
    for va in vas:
        for i, h in enumerate(handles):
            assert rt.map_mem(va + i * G2, G2, 0, h, 0) == 0
    assert counts() == (3, 2, 6)
    for h in handles:
        assert rt.free_physical(h) == 0
    assert counts() == (3, 2, 6)  # freed but still mapped
    for va in vas:
        for i in range(3):
            assert rt.unmap_mem(va + i * G2) == 0
        assert rt.release_mem_address(va) == 0
    assert counts() == (0, 0, 0)


def test_ptr_to_bytes_on_unmapped_memory_is_an_error_not_a_crash():
    handle = physical()
    va = reserve(2 * G2)
    assert rt.map_mem(va, G2, 0, handle, 0) == 0
    assert acl.util.ptr_to_bytes(va, 16) == bytes(16)
    with pytest.raises(ValueError):
        acl.util.ptr_to_bytes(va + G2, 16)  # reserved, not mapped
    with pytest.raises(ValueError):
        acl.util.ptr_to_bytes(va + G2 - 8, 16)  # runs into the unmapped half
    assert rt.memcpy(va + G2, 16, va, 16, 3) == acl.ACL_ERROR_RT_PARAM_INVALID
    assert rt.unmap_mem(va) == 0
    with pytest.raises(ValueError):
        acl.util.ptr_to_bytes(va, 16)
    assert rt.free_physical(handle) == 0 and rt.release_mem_address(va) == 0


FAULT_SCRIPT = """
import ctypes, sys
from npualloc import acl
rt = acl.rt
assert rt.set_device(0) == 0
prop = {"handleType": 0, "allocationType": 0, "memAttr": 4, "location": {"id": 0, "type": 1}, "reserve": 0}
handle, ret = rt.malloc_physical(2 << 20, prop, 0)
va, ret2 = rt.reserve_mem_address(4 << 20, 0, 0, 0)
assert (ret, ret2) == (0, 0)
assert rt.map_mem(va, 2 << 20, 0, handle, 0) == 0
ctypes.memset(va, 1, 16)              # mapped: fine
assert ctypes.string_at(va, 1) == b"\\x01"
{action}
print("ACCESS-SURVIVED", flush=True)
"""


@pytest.mark.parametrize("action", [
    "rt.unmap_mem(va); ctypes.string_at(va, 1)",  # read after unmap
    "ctypes.memset(va + (2 << 20), 0, 1)",  # write to the reserved, never-mapped half
    "rt.unmap_mem(va); rt.free_physical(handle); rt.release_mem_address(va); ctypes.string_at(va, 1)",
])
def test_access_to_unmapped_memory_faults(action):
    proc = run_python(FAULT_SCRIPT.replace("{action}", action), env={"NPUALLOC_DEVICE_MEMORY": "1GiB"})
    assert "ACCESS-SURVIVED" not in proc.stdout
    assert proc.returncode == -11, (proc.returncode, proc.stderr[-2000:])
