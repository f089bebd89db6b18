"""Fault injection from Python: an injected failure surfaces as the documented error or
OutOfMemoryError, the allocator stays consistent and usable, and nothing leaks."""
import os

import pytest

import npualloc
from npualloc import acl, faults
from conftest_memory import MiB, mem  # noqa: F401


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def workload():
    """Allocations through both faces; returns the failures seen (documented kinds only)."""
    failures = 0
    ptrs = []
    for size in (1000, 3 * MiB, 30 * MiB, 12 * MiB):
        try:
            ptrs.append(npualloc.caching_allocator_alloc(size))
        except npualloc.OutOfMemoryError:
            failures += 1
        except RuntimeError as e:  # a resource failure (descriptors, mappings): not an OOM
            assert "207005" in str(e) or "ACL error" in str(e) or "NPU error" in str(e), e
            failures += 1
    ptr, ret = acl.rt.malloc(5 * MiB, 0)
    assert ret in (0, acl.ACL_ERROR_RT_MEMORY_ALLOCATION, acl.ACL_ERROR_RT_RESOURCE_ALLOC_FAIL)
    failures += ret != 0
    if ret == 0:
        assert acl.rt.free(ptr) == 0
    for p in ptrs:
        npualloc.caching_allocator_delete(p)
    return failures


@pytest.mark.parametrize("kind", sorted(faults.KINDS))
def test_sweep_every_operation_of_a_kind(mem, kind):
    if kind == "reserve":  # the allocator reserves address ranges for expandable segments
        mem(alloc_conf="expandable_segments:True")
    acl.rt.set_device(0)
    npualloc.caching_allocator_delete(npualloc.caching_allocator_alloc(1))  # settings loaded (the probe ran)
    npualloc.empty_cache()
    fds = open_fds()
    faults.arm(kind, 10**12)
    assert workload() == 0
    npualloc.empty_cache()
    ops, injected0 = faults.counts(kind)
    assert ops >= (2 if kind == "reserve" else 3)  # expandable: one range per pool
    for n in range(1, ops + 1):
        with faults.inject(kind, n):
            assert workload() in (0, 1)  # the allocator's retries may absorb a one-shot fault
        assert faults.counts(kind)[1] == injected0 + n
        npualloc.memory._check(0)
        npualloc.empty_cache()
        assert npualloc.memory_reserved() == 0
        counts = npualloc._C.vmm_counts()
        assert counts["physical_handles"] == counts["mappings"] == counts["fds_kept"] == 0
        assert open_fds() == fds
    assert npualloc.caching_allocator_alloc(4 * MiB)  # still usable


def test_a_device_allocation_fault_fails_the_allocation_not_one_page_kind(mem):
    """An injected device_alloc fault fails the whole allocation: HUGE_FIRST's fallback to normal pages
    absorbed it (the huge-page charge failed, the normal one passed), so no caller ever saw it."""
    acl.rt.set_device(0)
    with faults.inject("device_alloc", 1):
        ptr, ret = acl.rt.malloc(4 * MiB, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    assert ret == acl.ACL_ERROR_RT_MEMORY_ALLOCATION
    prop = {"handleType": 0, "allocationType": 0, "memAttr": acl.ACL_HBM_MEM_HUGE,
            "location": {"type": 1, "id": 0}, "reserve": 0}
    with faults.inject("device_alloc", 1):
        assert acl.rt.malloc_physical(2 * MiB, prop, 0)[1] == acl.ACL_ERROR_RT_MEMORY_ALLOCATION
    # the caching allocator frees its cache and tries again, as torch does: a single fault is absorbed
    # there, and shows as a retry
    with faults.inject("device_alloc", 1):
        p = npualloc.caching_allocator_alloc(10 * MiB)
    st = npualloc.memory_stats()
    assert st["num_alloc_retries"] == 1 and st["num_ooms"] == 0
    npualloc.caching_allocator_delete(p)


def test_bad_kind_and_nth_are_rejected():
    with pytest.raises(ValueError, match="unknown fault kind 'disk'"):
        faults.arm("disk", 1)
    with pytest.raises(TypeError):
        faults.arm("map", -1)
