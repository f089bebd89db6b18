/* test_hostile_api.c - every aclrt* function of acl_rt.h (and npualloc.h's functions that return
 * an aclError) called as a careless or hostile C program would: NULL pointers, zero and huge sizes,
 * unaligned addresses, forged, stale and twice-freed handles, calls without a current device, with
 * a malformed environment, after aclFinalize, aclrtResetDevice or npualloc_shutdown, from several
 * threads at once and in a forked child.  Each returns its documented error code (docs/runtime.md,
 * the reference's B2/B3) and nothing crashes, leaks or races. */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <unistd.h>

#include "stream.h" /* stream_counts */
#include "testutil.h"

#define FORGED ((void *)(uintptr_t)0x4800000012345601ull) /* a plausible but unknown handle value */

static aclrtPhysicalMemProp good_prop(void) { return hbm_prop(ACL_HBM_MEM_HUGE, 0); }

static aclrtDrvMemHandle physical(size_t size)
{
    aclrtPhysicalMemProp p = good_prop();
    aclrtDrvMemHandle h = NULL;
    assert_int_equal(aclrtMallocPhysical(&h, size, &p, 0), ACL_SUCCESS);
    return h;
}

static void *reserved(size_t size)
{
    void *va = NULL;
    assert_int_equal(aclrtReserveMemAddress(&va, size, 0, NULL, 0), ACL_SUCCESS);
    return va;
}

static void assert_nothing_live(void)
{
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 0);
    assert_int_equal(c.mappings, 0);
    assert_int_equal(free_of(ACL_HBM_MEM), GiB_);
}

static void test_devices_reject_bad_ids_and_null_outputs(void **state)
{
    (void)state;
    start_runtime(2, GiB_, GiB_, 0, 0);
    const int32_t bad_ids[] = {-1, 2, 64, INT32_MAX, INT32_MIN};
    for (size_t i = 0; i < sizeof bad_ids / sizeof *bad_ids; i++) {
        assert_int_equal(aclrtSetDevice(bad_ids[i]), ACL_ERROR_RT_INVALID_DEVICEID);
        assert_int_equal(aclrtResetDevice(bad_ids[i]), ACL_ERROR_RT_INVALID_DEVICEID);
        assert_int_equal(aclrtResetDeviceForce(bad_ids[i]), ACL_ERROR_RT_INVALID_DEVICEID);
        int32_t can = -5;
        assert_int_equal(aclrtDeviceCanAccessPeer(&can, 0, bad_ids[i]), ACL_ERROR_RT_INVALID_DEVICEID);
        assert_int_equal(aclrtDeviceCanAccessPeer(&can, bad_ids[i], 0), ACL_ERROR_RT_INVALID_DEVICEID);
        assert_int_equal(can, -5);
        assert_int_equal(aclrtDeviceEnablePeerAccess(bad_ids[i], 0), ACL_ERROR_RT_INVALID_DEVICEID);
        assert_int_equal(aclrtDeviceDisablePeerAccess(bad_ids[i]), ACL_ERROR_RT_INVALID_DEVICEID);
    }
    assert_int_equal(aclrtGetDevice(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtGetDeviceCount(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDeviceCanAccessPeer(NULL, 0, 1), ACL_ERROR_INVALID_PARAM);
    int32_t can;
    assert_int_equal(aclrtDeviceCanAccessPeer(&can, 1, 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDeviceEnablePeerAccess(0, 0), ACL_ERROR_INVALID_PARAM); /* itself */
    assert_int_equal(aclrtDeviceEnablePeerAccess(1, 1), ACL_ERROR_FEATURE_UNSUPPORTED);
    assert_int_equal(aclrtDeviceEnablePeerAccess(1, UINT32_MAX), ACL_ERROR_FEATURE_UNSUPPORTED);
    assert_int_equal(aclrtDeviceDisablePeerAccess(0), ACL_ERROR_INVALID_PARAM);
    /* the device still works after all that */
    int32_t dev = -1;
    assert_int_equal(aclrtGetDevice(&dev), ACL_SUCCESS);
    assert_int_equal(dev, 0);
}

static void test_plain_memory_rejects_bad_arguments(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    void *p = (void *)0x1;
    assert_int_equal(aclrtMalloc(NULL, 64, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMalloc(&p, 0, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocAlign32(&p, 0, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocCached(&p, 0, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM);
    /* Sizes whose rounding (and pad) overflows size_t: CANN's ACL layer refuses them as parameters. */
    const size_t overflowing[] = {SIZE_MAX, SIZE_MAX - 31};
    for (size_t i = 0; i < sizeof overflowing / sizeof *overflowing; i++) {
        assert_int_equal(aclrtMalloc(&p, overflowing[i], ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_INVALID_PARAM);
        assert_int_equal(aclrtMallocAlign32(&p, overflowing[i], ACL_MEM_MALLOC_HUGE1G_ONLY), ACL_ERROR_INVALID_PARAM);
    }
    const size_t huge_sizes[] = {SIZE_MAX - 64, SIZE_MAX / 2, (size_t)1 << 60, 2 * GiB_};
    for (size_t i = 0; i < sizeof huge_sizes / sizeof *huge_sizes; i++) {
        assert_int_equal(aclrtMalloc(&p, huge_sizes[i], ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_RT_MEMORY_ALLOCATION);
        assert_int_equal(aclrtMallocAlign32(&p, huge_sizes[i], ACL_MEM_MALLOC_HUGE1G_ONLY),
                         ACL_ERROR_RT_MEMORY_ALLOCATION);
    }
    assert_int_equal(aclrtMallocHost(&p, SIZE_MAX), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(aclrtMallocHost(&p, (size_t)1 << 60), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_ptr_equal(p, (void *)0x1); /* failures leave the output alone */
    /* both bandwidth flags at once */
    assert_int_equal(aclrtMalloc(&p, 64, (aclrtMemMallocPolicy)(ACL_MEM_TYPE_LOW_BAND_WIDTH | ACL_MEM_TYPE_HIGH_BAND_WIDTH)),
                     ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtFree(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocHost(NULL, 64), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocHost(&p, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtFreeHost(NULL), ACL_ERROR_INVALID_PARAM);

    void *d, *h;
    assert_int_equal(aclrtMalloc(&d, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtMallocHost(&h, 4096), ACL_SUCCESS);
    /* the wrong kind of pointer, an interior pointer, a stack address */
    int local = 0;
    assert_int_equal(aclrtFree(h), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtFree((char *)d + 64), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtFree(&local), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtFreeHost(d), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtFreeHost((char *)h + 64), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtFreeHost(&local), ACL_ERROR_RT_MEMORY_FREE);
    void *va = reserved(2 * MiB_);
    assert_int_equal(aclrtFree(va), ACL_ERROR_RT_MEMORY_FREE); /* a reservation goes with Release */
    assert_int_equal(aclrtReleaseMemAddress(va), ACL_SUCCESS);
    /* freed twice */
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtFree(d), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtFreeHost(h), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(h), ACL_ERROR_RT_MEMORY_FREE);
    assert_nothing_live();
}

static void test_copies_and_memsets_reject_bad_arguments(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    void *d;
    char host[64] = {0};
    assert_int_equal(aclrtMalloc(&d, 64, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(NULL, 64, host, 64, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemcpy(d, 64, NULL, 64, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemcpy(d, 32, host, 64, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(d, 0, host, 1, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(d, 64, host, 0, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS); /* no work */
    const int bad_kinds[] = {-1, ACL_MEMCPY_INNER_DEVICE_TO_DEVICE, ACL_MEMCPY_INTER_DEVICE_TO_DEVICE, 8, INT32_MAX};
    for (size_t i = 0; i < sizeof bad_kinds / sizeof *bad_kinds; i++) { /* the same kinds for both, as CANN */
        assert_int_equal(aclrtMemcpy(d, 64, host, 64, (aclrtMemcpyKind)bad_kinds[i]), ACL_ERROR_INVALID_PARAM);
        assert_int_equal(aclrtMemcpyAsync(d, 64, host, 64, (aclrtMemcpyKind)bad_kinds[i], NULL), ACL_ERROR_INVALID_PARAM);
    }
    /* past the end of the allocation, from unmapped host memory, at the very top of the address space */
    assert_int_equal(aclrtMemcpy(d, SIZE_MAX, host, 64 * KiB_, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(d, 64, (void *)0x10, 64, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(host, 64, (void *)(UINTPTR_MAX - 15), 64, ACL_MEMCPY_DEVICE_TO_HOST),
                     ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(host, SIZE_MAX, d, SIZE_MAX, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    /* unaligned device addresses inside the allocation are fine */
    assert_int_equal(aclrtMemcpy((char *)d + 3, 61, host, 61, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
    assert_int_equal(aclrtMemset(NULL, 64, 0, 64), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemset(d, 8, 0, 64), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemset(d, SIZE_MAX, 0, SIZE_MAX), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemset(NULL, 0, 0, 0), ACL_SUCCESS); /* count 0: no work */
    assert_int_equal(aclrtMemsetAsync(NULL, 64, 0, 64, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemsetAsync(d, 8, 0, 64, NULL), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemsetAsync(d, 64, 0, 64, FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemcpyAsync(d, 64, host, 64, ACL_MEMCPY_HOST_TO_DEVICE, FORGED), ACL_ERROR_INVALID_PARAM);
    /* 2-D copies: a forged stream, rows that would wrap around the address space, unmapped host memory */
    assert_int_equal(aclrtMemcpy2dAsync(d, 32, host, 32, 16, 2, ACL_MEMCPY_HOST_TO_DEVICE, FORGED),
                     ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemcpy2d(host + 16, SIZE_MAX, (char *)d + 16, SIZE_MAX, 16, 2, ACL_MEMCPY_DEVICE_TO_HOST),
                     ACL_ERROR_RT_PARAM_INVALID); /* (wrapped, the second rows would start a byte before the first) */
    assert_int_equal(aclrtMemcpy2d(d, 32, (void *)(UINTPTR_MAX - 7), 32, 16, 2, ACL_MEMCPY_HOST_TO_DEVICE),
                     ACL_ERROR_RT_PARAM_INVALID); /* a first row past the top */
    assert_int_equal(aclrtMemcpy2d(d, 32, (void *)0x10, 32, 16, 2, ACL_MEMCPY_HOST_TO_DEVICE),
                     ACL_ERROR_RT_PARAM_INVALID);
    size_t f, t;
    assert_int_equal(aclrtGetMemInfo(ACL_HBM_MEM, NULL, &t), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtGetMemInfo(ACL_HBM_MEM, &f, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtGetMemInfo((aclrtMemAttr)999, &f, &t), ACL_SUCCESS); /* an attribute it lacks: 0/0 */
    assert_true(f == 0 && t == 0);
    assert_int_equal(aclrtGetMemInfo((aclrtMemAttr)-1, &f, &t), ACL_SUCCESS);
    assert_true(f == 0 && t == 0);
    /* a freed pointer is an error code, never a fault */
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(d, 64, host, 64, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(host, 64, d, 64, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemset(d, 64, 0, 64), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemsetAsync(d, 64, 0, 64, NULL), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_SUCCESS);
    assert_nothing_live();
}

static void test_physical_memory_rejects_bad_arguments(void **state)
{
    (void)state;
    start_runtime(2, GiB_, GiB_, 0, 0);
    aclrtPhysicalMemProp prop = good_prop();
    aclrtDrvMemHandle h = FORGED;
    size_t g = 7;
    assert_int_equal(aclrtMemGetAllocationGranularity(NULL, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &g),
                     ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, NULL),
                     ACL_ERROR_INVALID_PARAM);
    /* the option and the reserved field go to CANN's driver, which refuses them */
    assert_int_equal(aclrtMemGetAllocationGranularity(&prop, ACL_RT_MEM_ALLOC_GRANULARITY_UNDEF, &g),
                     ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtMemGetAllocationGranularity(&prop, (aclrtMemGranularityOptions)-1, &g),
                     ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtMemGetAllocationGranularity(&prop, (aclrtMemGranularityOptions)2, &g),
                     ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    aclrtPhysicalMemProp reserved = good_prop();
    reserved.reserve = 5;
    assert_int_equal(aclrtMemGetAllocationGranularity(&reserved, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &g),
                     ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &reserved, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(g, 7);
    assert_int_equal(aclrtMallocPhysical(NULL, 2 * MiB_, &prop, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocPhysical(&h, 0, &prop, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, NULL, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &prop, 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &prop, UINT64_MAX), ACL_ERROR_INVALID_PARAM);
    /* every field out of range, one at a time */
    const uint32_t garbage[] = {0x7FFFFFFFu, 0xFFFFFFFFu, 18, 3};
    for (size_t i = 0; i < sizeof garbage / sizeof *garbage; i++) {
        aclrtPhysicalMemProp bad = good_prop();
        bad.handleType = (aclrtMemHandleType)garbage[i];
        assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &bad, 0), ACL_ERROR_INVALID_PARAM);
        bad = good_prop();
        bad.allocationType = (aclrtMemAllocationType)garbage[i];
        assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &bad, 0), ACL_ERROR_INVALID_PARAM);
        bad = good_prop();
        bad.memAttr = (aclrtMemAttr)garbage[i];
        if (garbage[i] != ACL_DDR_MEM_NORMAL) /* (DDR on a device location is refused too, below) */
            assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &bad, 0), ACL_ERROR_INVALID_PARAM);
        bad = good_prop();
        bad.location.type = (aclrtMemLocationType)garbage[i];
        assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &bad, 0), ACL_ERROR_INVALID_PARAM);
        bad = good_prop();
        bad.location.id = garbage[i];
        assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &bad, 0), ACL_ERROR_RT_INVALID_DEVICEID);
        assert_int_equal(aclrtMemGetAllocationGranularity(&bad, ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM, &g),
                         ACL_ERROR_RT_INVALID_DEVICEID);
    }
    aclrtPhysicalMemProp ddr_on_device = good_prop();
    ddr_on_device.memAttr = ACL_DDR_MEM_HUGE;
    assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &ddr_on_device, 0), ACL_ERROR_INVALID_PARAM);
    /* sizes: not a multiple of the granularity, more than the device has, the largest values */
    assert_int_equal(aclrtMallocPhysical(&h, MiB_, &prop, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMallocPhysical(&h, SIZE_MAX, &prop, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMallocPhysical(&h, 2 * GiB_, &prop, 0), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(aclrtMallocPhysical(&h, SIZE_MAX & ~(2 * MiB_ - 1), &prop, 0), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_ptr_equal(h, FORGED);
    /* bad handles: NULL, forged, a stream's, freed twice */
    assert_int_equal(aclrtFreePhysical(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtFreePhysical(FORGED), ACL_ERROR_RT_INVALID_HANDLE);
    assert_int_equal(aclrtFreePhysical((aclrtDrvMemHandle)(uintptr_t)1), ACL_ERROR_RT_INVALID_HANDLE);
    assert_int_equal(aclrtFreePhysical((aclrtDrvMemHandle)UINTPTR_MAX), ACL_ERROR_RT_INVALID_HANDLE);
    aclrtStream s;
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    assert_int_equal(aclrtFreePhysical((aclrtDrvMemHandle)s), ACL_ERROR_RT_INVALID_HANDLE);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    h = physical(2 * MiB_);
    assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
    assert_int_equal(aclrtFreePhysical(h), ACL_ERROR_RT_INVALID_HANDLE);
    /* a new handle in the freed one's slot does not answer to the old value */
    aclrtDrvMemHandle again = physical(2 * MiB_);
    assert_ptr_not_equal(again, h);
    assert_int_equal(aclrtFreePhysical(h), ACL_ERROR_RT_INVALID_HANDLE);
    assert_int_equal(aclrtFreePhysical(again), ACL_SUCCESS);
    assert_nothing_live();
}

static void test_reservations_and_mappings_reject_bad_arguments(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    void *va = (void *)0x1;
    assert_int_equal(aclrtReserveMemAddress(NULL, 2 * MiB_, 0, NULL, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtReserveMemAddress(&va, 0, 0, NULL, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtReserveMemAddress(&va, 2 * MiB_, 1, NULL, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtReserveMemAddress(&va, 2 * MiB_, 0, NULL, 2), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtReserveMemAddress(&va, 2 * MiB_, 0, (void *)0x1001, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtReserveMemAddress(&va, SIZE_MAX, 0, NULL, 0), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(aclrtReserveMemAddress(&va, (size_t)1 << 62, 0, NULL, 1), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_ptr_equal(va, (void *)0x1);
    /* a chosen address that is taken, or outside the device window */
    void *a = reserved(4 * MiB_);
    assert_int_equal(aclrtReserveMemAddress(&va, 2 * MiB_, 0, a, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReserveMemAddress(&va, 2 * MiB_, 0, (char *)a + 2 * MiB_, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReserveMemAddress(&va, 2 * MiB_, 0, (void *)(uintptr_t)(2 * MiB_), 0),
                     ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReserveMemAddress(&va, 2 * MiB_, 0, (void *)(UINTPTR_MAX & ~(2 * MiB_ - 1)), 0),
                     ACL_ERROR_RT_PARAM_INVALID);

    aclrtDrvMemHandle h = physical(2 * MiB_);
    assert_int_equal(aclrtMapMem(NULL, 2 * MiB_, 0, h, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMapMem(a, 0, 0, h, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMapMem(a, 2 * MiB_, 2 * MiB_, h, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMapMem(a, 2 * MiB_, 0, NULL, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMapMem(a, 2 * MiB_, 0, h, 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMapMem(a, 2 * MiB_, 0, FORGED, 0), ACL_ERROR_RT_INVALID_HANDLE);
    assert_int_equal(aclrtMapMem(a, 4 * MiB_, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID);     /* not the handle's size */
    assert_int_equal(aclrtMapMem(a, SIZE_MAX, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMapMem((char *)a + 4096, 2 * MiB_, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID); /* unaligned */
    assert_int_equal(aclrtMapMem((char *)a + 4 * MiB_, 2 * MiB_, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID); /* outside */
    int local;
    assert_int_equal(aclrtMapMem(&local, 2 * MiB_, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID);
    void *d;
    assert_int_equal(aclrtMalloc(&d, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtMapMem(d, 2 * MiB_, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID); /* aclrtMalloc memory */
    assert_int_equal(aclrtUnmapMem(d), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReleaseMemAddress(d), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    /* mapped twice at one place; unmapped where nothing starts; released while mapped */
    assert_int_equal(aclrtMapMem((char *)a + 2 * MiB_, 2 * MiB_, 0, h, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMapMem((char *)a + 2 * MiB_, 2 * MiB_, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtUnmapMem(a), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtUnmapMem((char *)a + 2 * MiB_ + 4096), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReleaseMemAddress(a), ACL_ERROR_RT_PARAM_INVALID);
    /* the handle freed while mapped: no longer named, the mapping still works until unmapped */
    assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
    assert_int_equal(aclrtMapMem(a, 2 * MiB_, 0, h, 0), ACL_ERROR_RT_INVALID_HANDLE);
    assert_int_equal(aclrtMemset((char *)a + 2 * MiB_, 2 * MiB_, 1, 2 * MiB_), ACL_SUCCESS);
    assert_int_equal(aclrtUnmapMem((char *)a + 2 * MiB_), ACL_SUCCESS);
    assert_int_equal(aclrtUnmapMem((char *)a + 2 * MiB_), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtUnmapMem(NULL), ACL_ERROR_INVALID_PARAM);
    /* released: NULL, an interior address, twice */
    assert_int_equal(aclrtReleaseMemAddress(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtReleaseMemAddress((char *)a + 2 * MiB_), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReleaseMemAddress(&local), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReleaseMemAddress(a), ACL_SUCCESS);
    assert_int_equal(aclrtReleaseMemAddress(a), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMapMem(a, 2 * MiB_, 0, physical(2 * MiB_), 0), ACL_ERROR_RT_PARAM_INVALID);
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 1); /* the last handle, which the released range refused */
    assert_int_equal(c.reservations, 0);
}

static void test_streams_and_events_reject_bad_handles(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    aclrtStream s;
    aclrtEvent e, e2;
    char host[16];
    assert_int_equal(aclrtCreateStream(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtCreateEvent(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyStream(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyStream(FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeStream(FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyEvent(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyEvent(FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    assert_int_equal(aclrtCreateEvent(&e), ACL_SUCCESS);
    assert_int_equal(aclrtCreateEvent(&e2), ACL_SUCCESS);
    /* a stream where an event belongs, and the other way round */
    assert_int_equal(aclrtDestroyEvent((aclrtEvent)s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyStream((aclrtStream)e), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtRecordEvent(s, e), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtRecordEvent(FORGED, s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtRecordEvent(NULL, s), ACL_ERROR_INVALID_PARAM);
    aclrtEventStatus st;
    aclrtEventRecordedStatus rst;
    float ms;
    assert_int_equal(aclrtQueryEvent(e, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEvent(FORGED, &st), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventStatus(e, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventStatus(FORGED, &rst), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeEvent(FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeEvent(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtEventElapsedTime(NULL, e, e2), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtEventElapsedTime(&ms, FORGED, e2), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtEventElapsedTime(&ms, e, FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtStreamWaitEvent(s, FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtStreamWaitEvent(s, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtStreamWaitEvent(FORGED, e), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtLaunchCallback(NULL, NULL, ACL_CALLBACK_BLOCK, s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtProcessReport(0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtProcessReport(-2), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSubscribeReport(1, FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtUnSubscribeReport(1, FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtUnSubscribeReport(1, s), ACL_ERROR_RT_STREAM_SUBSCRIBE); /* nobody subscribed it */
    assert_int_equal(aclrtProcessReport(10), ACL_ERROR_RT_THREAD_SUBSCRIBE);      /* this thread serves nothing */
    /* destroyed twice; then every use of the old value */
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtRecordEvent(e, s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemsetAsync(host, sizeof host, 0, sizeof host, s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEvent(e, &st), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyEvent(e2), ACL_SUCCESS);
}

/* The flagged stream and event calls: NULL outputs, forged, crossed and destroyed handles, flags that
 * are no flags; nothing is created by a refused call. */
static void test_flagged_streams_and_events_reject_bad_arguments(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    aclrtStream s = (aclrtStream)0x1;
    aclrtEvent e = (aclrtEvent)0x1;
    aclrtEventWaitStatus ws = ACL_EVENT_WAIT_STATUS_RESERVED;
    assert_int_equal(aclrtCreateStreamWithConfig(NULL, 0, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtCreateStreamWithConfig(&s, UINT32_MAX, UINT32_MAX), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtCreateEventWithFlag(NULL, ACL_EVENT_SYNC), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtCreateEventWithFlag(&e, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtCreateEventWithFlag(&e, UINT32_MAX), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtCreateEventExWithFlag(NULL, ACL_EVENT_SYNC), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtCreateEventExWithFlag(&e, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtCreateEventExWithFlag(&e, UINT32_MAX), ACL_ERROR_RT_PARAM_INVALID);
    assert_ptr_equal(s, (aclrtStream)0x1);
    assert_ptr_equal(e, (aclrtEvent)0x1);
    assert_int_equal(aclrtResetEvent(NULL, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtResetEvent(FORGED, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventWaitStatus(NULL, &ws), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventWaitStatus(FORGED, &ws), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(-2), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(INT32_MIN), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(INT32_MAX), ACL_SUCCESS); /* nothing queued */
    assert_int_equal(aclrtCreateStreamWithConfig(&s, 0, ACL_STREAM_FAST_LAUNCH), ACL_SUCCESS);
    assert_int_equal(aclrtCreateEventWithFlag(&e, ACL_EVENT_SYNC), ACL_SUCCESS);
    /* a stream where an event belongs, and the other way round */
    assert_int_equal(aclrtResetEvent((aclrtEvent)s, s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtResetEvent(e, (aclrtStream)e), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventWaitStatus((aclrtEvent)s, &ws), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventWaitStatus(e, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtResetEvent(e, FORGED), ACL_ERROR_INVALID_PARAM);
    /* destroyed: every use of the old values */
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtResetEvent(e, s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtResetEvent(e, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventWaitStatus(e, &ws), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(ws, ACL_EVENT_WAIT_STATUS_RESERVED);
    size_t streams = 1, events = 1;
    stream_counts(&streams, &events);
    assert_int_equal(streams, 0);
    assert_int_equal(events, 0);
}

static void test_sharing_rejects_bad_arguments(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    aclrtDrvMemHandle h = physical(2 * MiB_);
    uint64_t sh = 0;
    int32_t pid = (int32_t)getpid();
    char key[65];
    void *d, *d2;
    assert_int_equal(aclrtMemExportToShareableHandle(NULL, ACL_MEM_HANDLE_TYPE_NONE, 0, &sh), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemExportToShareableHandle(h, ACL_MEM_HANDLE_TYPE_NONE, 0, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemExportToShareableHandle(h, ACL_MEM_HANDLE_TYPE_POSIX, 0, &sh), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemExportToShareableHandle(h, ACL_MEM_HANDLE_TYPE_NONE, 2, &sh), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemExportToShareableHandle(FORGED, ACL_MEM_HANDLE_TYPE_NONE, 0, &sh),
                     ACL_ERROR_RT_INVALID_HANDLE);
    assert_int_equal(aclrtMemExportToShareableHandle(h, ACL_MEM_HANDLE_TYPE_NONE, 0, &sh), ACL_SUCCESS);
    uint64_t again = 0;
    assert_int_equal(aclrtMemExportToShareableHandle(h, ACL_MEM_HANDLE_TYPE_NONE, 0, &again),
                     ACL_ERROR_RT_DRV_INTERNAL_ERROR); /* one shareable handle per handle */
    aclrtDrvMemHandle imported = FORGED;
    assert_int_equal(aclrtMemImportFromShareableHandle(sh, 0, &imported), ACL_ERROR_RT_DRV_INTERNAL_ERROR);
    assert_ptr_equal(imported, FORGED); /* the exporter cannot import its own */
    assert_int_equal(aclrtMemSetPidToShareableHandle(sh, &pid, 1), ACL_SUCCESS);
    assert_int_equal(aclrtMemImportFromShareableHandle(1, 0, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemImportFromShareableHandle(1, -1, &h), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(aclrtMemSetPidToShareableHandle(1, NULL, 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemSetPidToShareableHandle(1, &pid, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDeviceGetBareTgid(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMalloc(&d, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtIpcMemGetExportKey(NULL, 4096, key, sizeof key, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtIpcMemGetExportKey(d, 0, key, sizeof key, 0), ACL_ERROR_RT_PARAM_INVALID); /* CANN's runtime */
    assert_int_equal(aclrtIpcMemGetExportKey(d, 4096, key, 0, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtIpcMemGetExportKey(d, 4096, NULL, sizeof key, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtIpcMemGetExportKey(d, 4096, key, sizeof key, 2), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtIpcMemGetExportKey((char *)d + 64, 64, key, sizeof key, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtIpcMemGetExportKey(d, SIZE_MAX, key, sizeof key, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtIpcMemImportByKey(NULL, "x", 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtIpcMemImportByKey(&d, NULL, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtIpcMemImportByKey(&d, "", 0), ACL_ERROR_RT_INVALID_HANDLE);
    assert_int_equal(aclrtIpcMemSetImportPid(NULL, &pid, 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtIpcMemSetImportPid("x", NULL, 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtIpcMemSetImportPid("x", &pid, 0), ACL_ERROR_RT_PARAM_INVALID); /* CANN's runtime */
    assert_int_equal(aclrtIpcMemSetImportPid("x", &pid, (size_t)INT32_MAX + 1), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtIpcMemClose(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtIpcMemClose("not a key"), ACL_ERROR_RT_INVALID_HANDLE);
    assert_int_equal(aclrtIpcMemGetExportKey(d, 4096, key, 8, 0), ACL_ERROR_INVALID_PARAM); /* too short for it */
    assert_int_equal(aclrtIpcMemGetExportKey(d, 4096, key, sizeof key, 0), ACL_SUCCESS);
    assert_int_equal(aclrtIpcMemImportByKey(&d2, key, 0), ACL_ERROR_RT_DRV_INTERNAL_ERROR); /* its own export */
    assert_int_equal(aclrtIpcMemClose(key), ACL_SUCCESS);
    assert_int_equal(aclrtIpcMemClose(key), ACL_ERROR_RT_INVALID_HANDLE); /* closed twice */
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
}

/* Pinned host memory (aclrtMallocHost, and physical memory with a host location, which no device
 * is charged for) cannot be more than the machine has: one allocation beyond its memory fails as out
 * of memory, whatever the kernel's overcommit policy, instead of handing out a handle or pages that
 * could never all be touched. */
static void test_pinned_host_memory_beyond_the_machine_is_out_of_memory(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    size_t ram = (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
    size_t beyond = (ram / (2 * MiB_) + 1) * (2 * MiB_);
    aclrtPhysicalMemProp hp = hbm_prop(ACL_DDR_MEM_HUGE, 0);
    hp.location.type = ACL_MEM_LOCATION_TYPE_HOST;
    aclrtDrvMemHandle h = FORGED;
    void *p = FORGED;
    const size_t sizes[] = {beyond, (size_t)1 << 46, (size_t)1 << 62};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        assert_int_equal(aclrtMallocPhysical(&h, sizes[i], &hp, 0), ACL_ERROR_RT_MEMORY_ALLOCATION);
        assert_int_equal(aclrtMallocHost(&p, sizes[i]), ACL_ERROR_RT_MEMORY_ALLOCATION);
    }
    assert_int_equal(aclrtMallocHost(&p, ram + 1), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_ptr_equal(h, FORGED);
    assert_ptr_equal(p, FORGED);
    assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &hp, 0), ACL_SUCCESS);
    assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
}

/* The ceiling holds for the process's pinned memory together, not only for each allocation: two
 * allocations of a little over half the machine each cannot both be held, and freeing one makes room
 * for the other again, through either call. */
static void test_pinned_host_memory_together_cannot_exceed_the_machine(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    size_t ram = (size_t)sysconf(_SC_PHYS_PAGES) * (size_t)sysconf(_SC_PAGESIZE);
    size_t over_half = (ram / 2 / (2 * MiB_) + 1) * (2 * MiB_);
    aclrtPhysicalMemProp hp = hbm_prop(ACL_DDR_MEM_HUGE, 0);
    hp.location.type = ACL_MEM_LOCATION_TYPE_HOST;
    aclrtDrvMemHandle first, second;
    assert_int_equal(aclrtMallocPhysical(&first, over_half, &hp, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMallocPhysical(&second, over_half, &hp, 0), ACL_ERROR_RT_MEMORY_ALLOCATION);
    void *p;
    assert_int_equal(aclrtMallocHost(&p, over_half), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(aclrtMallocHost(&p, 2 * MiB_), ACL_SUCCESS); /* below the ceiling */
    assert_int_equal(aclrtFreeHost(p), ACL_SUCCESS);
    assert_int_equal(aclrtFreePhysical(first), ACL_SUCCESS);
    assert_int_equal(aclrtMallocPhysical(&second, over_half, &hp, 0), ACL_SUCCESS);
    assert_int_equal(aclrtFreePhysical(second), ACL_SUCCESS);
    /* a runtime shut down with a host handle still held gives its charge back */
    assert_int_equal(aclrtMallocPhysical(&first, over_half, &hp, 0), ACL_SUCCESS);
    npualloc_shutdown();
    start_runtime(1, GiB_, GiB_, 0, 0);
    assert_int_equal(aclrtMallocPhysical(&second, over_half, &hp, 0), ACL_SUCCESS);
    assert_int_equal(aclrtFreePhysical(second), ACL_SUCCESS);
    /* and so does one shut down with an aclrtMallocHost block still held */
    assert_int_equal(aclrtMallocHost(&p, over_half), ACL_SUCCESS);
    npualloc_shutdown();
    start_runtime(1, GiB_, GiB_, 0, 0);
    assert_int_equal(aclrtMallocHost(&p, over_half), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(p), ACL_SUCCESS);
}

/* aclrtMallocHost memory is resident in whole pages, so it is charged in whole pages: with less than
 * 2 MiB of the machine left unpinned, exactly as many one-byte allocations fit as there are pages. */
static void test_pinned_host_memory_is_charged_in_whole_pages(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t ram = (size_t)sysconf(_SC_PHYS_PAGES) * page;
    size_t held = ram / (2 * MiB_) * (2 * MiB_);
    if (held == ram)
        held -= 2 * MiB_;
    aclrtPhysicalMemProp hp = hbm_prop(ACL_DDR_MEM_HUGE, 0);
    hp.location.type = ACL_MEM_LOCATION_TYPE_HOST;
    aclrtDrvMemHandle h;
    assert_int_equal(aclrtMallocPhysical(&h, held, &hp, 0), ACL_SUCCESS);
    size_t pages = (ram - held) / page;
    void **blocks = calloc(pages, sizeof *blocks);
    assert_non_null(blocks);
    for (size_t i = 0; i < pages; i++)
        assert_int_equal(aclrtMallocHost(&blocks[i], 1), ACL_SUCCESS);
    void *one_more;
    assert_int_equal(aclrtMallocHost(&one_more, 1), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(aclrtFreeHost(blocks[0]), ACL_SUCCESS);
    assert_int_equal(aclrtMallocHost(&blocks[0], page), ACL_SUCCESS); /* the freed page is free again */
    for (size_t i = 0; i < pages; i++)
        assert_int_equal(aclrtFreeHost(blocks[i]), ACL_SUCCESS);
    free(blocks);
    assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
}

/* npualloc.h's functions that report through an aclError say ACL_ERROR_INVALID_PARAM for a NULL
 * they need, as the aclrt* functions do, instead of writing through it. */
static void test_npualloc_functions_reject_null_pointers(void **state)
{
    (void)state;
    npualloc_shutdown();
    char err[64];
    assert_int_equal(npualloc_config_check(NULL, err, sizeof err), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_configure(NULL, err, sizeof err), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_config_from_env(NULL, err, sizeof err), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_config_check(NULL, NULL, 0), ACL_ERROR_INVALID_PARAM);
    assert_false(npualloc_initialized()); /* none of them started the devices */
    start_runtime(1, GiB_, GiB_, 0, 0);
    assert_int_equal(npualloc_get_config(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_get_fraction(0, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_get_stats(0, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_get_settings(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_snapshot(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_malloc(0, 64, 0, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_allocate(0, 64, 0, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_stream_query(NULL, 0, NULL), ACL_ERROR_INVALID_PARAM);
    /* a message of len bytes would go through a NULL why, for a known device or not */
    assert_int_equal(npualloc_cache_check(0, NULL, 64), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_check(99, NULL, 64), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_check(0, NULL, 0), ACL_SUCCESS); /* nowhere to say why, nothing to say */
    /* with somewhere to write, they work */
    npualloc_config cfg;
    npualloc_stats st;
    npualloc_allocator_settings set;
    npualloc_snapshot *snap = NULL;
    double fraction;
    assert_int_equal(npualloc_get_config(&cfg), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_get_fraction(0, &fraction), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_get_stats(0, &st), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_get_settings(&set), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    npualloc_snapshot_free(snap);
}

/* The functions that return no error code ignore a NULL output (each used to write through it), and those that
 * return a value say "nothing" for NULL input. */
static void test_npualloc_functions_without_an_error_code_ignore_null_outputs(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    uint64_t size = 7;
    assert_int_equal(npualloc_parse_size("5", NULL), -1);
    assert_int_equal(npualloc_parse_size(NULL, &size), -1);
    assert_int_equal(npualloc_parse_size("5 KiB", &size), 0);
    assert_int_equal(size, 5120);
    npualloc_cache_last_oom(NULL);
    npualloc_vmm_counts_get(NULL);
    uint64_t seen = 99;
    npualloc_fault_counts(NPUALLOC_FAULT_MAP, &seen, NULL);
    npualloc_fault_counts(NPUALLOC_FAULT_MAP, NULL, &seen);
    npualloc_fault_counts((npualloc_fault_kind)99, &seen, NULL);
    assert_int_equal(seen, 0); /* an unknown kind: nothing seen */
    char buf[16] = "untouched";
    npualloc_oom_info oom = {.over_1eb = true};
    assert_int_equal(npualloc_format_oom(NULL, buf, sizeof buf), -1);
    assert_string_equal(buf, "untouched");
    assert_int_equal(npualloc_format_oom(&oom, NULL, 8), -1);
    const char *over = "NPU out of memory. Tried to allocate more than 1EB memory.";
    assert_int_equal(npualloc_format_oom(&oom, NULL, 0), (int)strlen(over)); /* snprintf's count */
    assert_null(npualloc_context_create(NULL, 5));
    npualloc_context *ctx = npualloc_context_create(NULL, 0);
    assert_non_null(ctx);
    assert_non_null(npualloc_context_data(ctx, NULL));
    size_t len = 99;
    npualloc_context_data(ctx, &len);
    assert_int_equal(len, 0);
    npualloc_context_release(ctx);
}

/* A history level outside npualloc_record_context's values is refused, and changes nothing. */
static void test_record_history_refuses_unknown_levels(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_STATE, 8), ACL_SUCCESS);
    const int bad[] = {-1, NPUALLOC_RECORD_ALL + 1, 99, INT32_MIN};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(npualloc_cache_record_history(true, (npualloc_record_context)bad[i], 8),
                         ACL_ERROR_INVALID_PARAM);
        assert_int_equal(npualloc_cache_record_context(), NPUALLOC_RECORD_STATE);
    }
    assert_int_equal(npualloc_cache_record_history(false, (npualloc_record_context)99, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_record_context(), NPUALLOC_RECORD_STATE);
    assert_int_equal(npualloc_cache_record_history(false, NPUALLOC_RECORD_NEVER, 0), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_record_context(), NPUALLOC_RECORD_NEVER);
}

/* npualloc_shutdown and fork() give fresh caches, which record nothing: the level reported is
 * theirs, not the one set before. */
static void test_history_level_is_reset_with_the_caches(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_ALL, 8), ACL_SUCCESS);
    pid_t pid = fork();
    if (pid == 0)
        _exit(npualloc_cache_record_context() == NPUALLOC_RECORD_NEVER ? 0 : 1);
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    assert_int_equal(npualloc_cache_record_context(), NPUALLOC_RECORD_ALL); /* the parent keeps it */
    npualloc_shutdown();
    assert_int_equal(npualloc_cache_record_context(), NPUALLOC_RECORD_NEVER);
    start_runtime(1, GiB_, GiB_, 0, 0);
    assert_int_equal(npualloc_cache_record_context(), NPUALLOC_RECORD_NEVER);
    void *p = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 512, 0, &p), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
    npualloc_snapshot *snap = NULL;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    assert_int_equal(snap->trace_count, 0); /* and indeed nothing is recorded */
    npualloc_snapshot_free(snap);
}

/* One thread turns the history on and off while another asks which level is set: the answer is
 * one of the two levels, and nothing races (ThreadSanitizer checks). */
static void *toggle_history(void *p)
{
    atomic_int *stop = p;
    for (int i = 0; !atomic_load(stop); i++)
        npualloc_cache_record_history(i % 2 == 0, NPUALLOC_RECORD_ALLOC, 4);
    return NULL;
}

static void test_history_level_is_read_while_another_thread_sets_it(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    atomic_int stop = 0;
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, toggle_history, &stop), 0);
    int odd = 0;
    for (int i = 0; i < 20000; i++) {
        npualloc_record_context level = npualloc_cache_record_context();
        odd += level != NPUALLOC_RECORD_NEVER && level != NPUALLOC_RECORD_ALLOC;
    }
    atomic_store(&stop, 1);
    pthread_join(t, NULL);
    assert_int_equal(odd, 0);
    assert_int_equal(npualloc_cache_record_history(false, NPUALLOC_RECORD_NEVER, 0), ACL_SUCCESS);
}

/* With a malformed environment every call fails to start the runtime (and each tries again); one
 * thread reads why while others keep trying: always the whole message, and nothing races
 * (ThreadSanitizer checks). */
typedef struct retry_arg {
    atomic_int stop;     /* 1: stop; 2: a start did not fail as it should */
    atomic_int attempts; /* failed starts so far */
    int most;            /* then the starting threads give up */
} retry_arg;

static void *keep_starting(void *p)
{
    retry_arg *a = p;
    while (!atomic_load(&a->stop) && atomic_load(&a->attempts) < a->most) {
        if (aclrtSetDevice(0) != ACL_ERROR_UNINITIALIZE)
            atomic_store(&a->stop, 2);
        atomic_fetch_add(&a->attempts, 1);
    }
    return NULL;
}

static void test_init_error_is_read_while_other_threads_retry(void **state)
{
    (void)state;
    npualloc_shutdown();
    setenv("NPUALLOC_DDR_MEMORY", "lots", 1);
    assert_int_equal(aclrtSetDevice(0), ACL_ERROR_UNINITIALIZE);
    /* Under valgrind the threads take turns, and the starting threads, which take the lock the reader
     * needs over and over, could keep it waiting for minutes: there they give up after 2000 starts. */
    retry_arg a = {0, 0, random_steps(INT_MAX, INT_MAX, 2000)};
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&t[i], NULL, keep_starting, &a), 0);
    int wrong = 0;
    for (int i = 0; i < 2000 || atomic_load(&a.attempts) < 200; i++) {
        const char *why = npualloc_init_error();
        wrong += !why || !strstr(why, "NPUALLOC_DDR_MEMORY='lots'");
    }
    int started = atomic_exchange(&a.stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    unsetenv("NPUALLOC_DDR_MEMORY");
    assert_int_equal(started, 0);
    assert_int_equal(wrong, 0);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    assert_null(npualloc_init_error());
}

/* A malformed environment: the aclrt* calls say ACL_ERROR_UNINITIALIZE, the caching allocator's calls
 * their usual ACL_ERROR_INVALID_PARAM with the reason as their message (docs/runtime.md). */
static void test_a_malformed_environment_fails_every_call(void **state)
{
    (void)state;
    npualloc_shutdown();
    setenv("NPUALLOC_DEVICE_MEMORY", "plenty", 1);
    void *p = NULL;
    int32_t dev;
    uint32_t n;
    aclrtStream s;
    aclrtDrvMemHandle h;
    aclrtPhysicalMemProp prop = good_prop();
    assert_int_equal(aclrtSetDevice(0), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtGetDevice(&dev), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtGetDeviceCount(&n), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtMalloc(&p, 64, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtMallocHost(&p, 64), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &prop, 0), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtReserveMemAddress(&p, 2 * MiB_, 0, NULL, 0), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtCreateStream(&s), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtCreateStreamWithConfig(&s, 0, ACL_STREAM_FAST_LAUNCH), ACL_ERROR_UNINITIALIZE);
    aclrtEvent e;
    aclrtEventWaitStatus ws;
    assert_int_equal(aclrtCreateEventWithFlag(&e, ACL_EVENT_SYNC), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtCreateEventExWithFlag(&e, ACL_EVENT_SYNC), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtResetEvent(FORGED, NULL), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtQueryEventWaitStatus(FORGED, &ws), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(10), ACL_ERROR_UNINITIALIZE);
    assert_int_equal(aclInit(NULL), ACL_ERROR_UNINITIALIZE);
    npualloc_stats st;
    npualloc_error_kind kind;
    assert_int_equal(npualloc_cache_malloc(0, 64, 0, &p), ACL_ERROR_INVALID_PARAM);
    assert_non_null(strstr(npualloc_last_error(&kind), "NPUALLOC_DEVICE_MEMORY='plenty'"));
    assert_int_equal(kind, NPUALLOC_ERR_VALUE);
    assert_int_equal(npualloc_cache_get_stats(0, &st), ACL_ERROR_INVALID_PARAM);
    assert_non_null(strstr(npualloc_init_error(), "NPUALLOC_DEVICE_MEMORY='plenty'"));
    assert_null(p);
    unsetenv("NPUALLOC_DEVICE_MEMORY");
}

/* Handles outlive the runtime that made them (npualloc_shutdown, a fork child): an old value
 * never names a new object, however many the new runtime made, so using it is INVALID_HANDLE /
 * INVALID_PARAM instead of freeing someone else's memory, stream or event. */
enum { FRESH = 3 };

static int old_values_name_nothing(aclrtDrvMemHandle h, aclrtStream s, aclrtEvent e)
{
    aclrtDrvMemHandle nh[FRESH];
    aclrtStream ns[FRESH];
    aclrtEvent ne[FRESH];
    aclrtPhysicalMemProp prop = good_prop();
    int bad = aclrtSetDevice(0) != ACL_SUCCESS;
    for (int i = 0; i < FRESH; i++) {
        bad += aclrtMallocPhysical(&nh[i], 2 * MiB_, &prop, 0) != ACL_SUCCESS || nh[i] == h;
        bad += aclrtCreateStream(&ns[i]) != ACL_SUCCESS || ns[i] == s;
        bad += aclrtCreateEvent(&ne[i]) != ACL_SUCCESS || ne[i] == e;
    }
    bad += aclrtFreePhysical(h) != ACL_ERROR_RT_INVALID_HANDLE;
    bad += aclrtDestroyStream(s) != ACL_ERROR_INVALID_PARAM;
    bad += aclrtDestroyEvent(e) != ACL_ERROR_INVALID_PARAM;
    for (int i = 0; i < FRESH; i++) {
        bad += aclrtFreePhysical(nh[i]) != ACL_SUCCESS;
        bad += aclrtDestroyStream(ns[i]) != ACL_SUCCESS;
        bad += aclrtDestroyEvent(ne[i]) != ACL_SUCCESS;
    }
    return bad;
}

static void test_old_handles_never_name_new_objects(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    aclrtDrvMemHandle h = physical(2 * MiB_);
    aclrtStream s;
    aclrtEvent e;
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    assert_int_equal(aclrtCreateEvent(&e), ACL_SUCCESS);
    pid_t pid = fork();
    if (pid == 0) {
        int bad = old_values_name_nothing(h, s, e);
        npualloc_shutdown();
        _exit(bad);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* the same after a shutdown in this process */
    npualloc_shutdown();
    assert_int_equal(old_values_name_nothing(h, s, e), 0);
}

/* Calls that need a current device say so (107002) on a thread that never set one, and after the
 * last reference to it went (aclrtResetDevice); what was made before stays usable and freeable. */
static void test_calls_without_a_context(void **state)
{
    (void)state;
    start_runtime(2, GiB_, GiB_, 0, 0);
    void *d, *p = (void *)0x1;
    aclrtStream s;
    aclrtDrvMemHandle h = physical(2 * MiB_);
    assert_int_equal(aclrtMalloc(&d, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    assert_int_equal(aclrtResetDevice(0), ACL_SUCCESS);
    assert_int_equal(aclrtResetDevice(0), ACL_SUCCESS); /* one reset too many: harmless */
    int32_t dev = 7;
    size_t f, t;
    aclrtStream s2;
    assert_int_equal(aclrtGetDevice(&dev), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(dev, 7);
    assert_int_equal(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtMallocAlign32(&p, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtMallocCached(&p, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtGetMemInfo(ACL_HBM_MEM, &f, &t), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtCreateStream(&s2), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(10), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtCreateStreamWithConfig(&s2, 0, 0), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_ERROR_RT_CONTEXT_NULL); /* the default stream */
    assert_int_equal(aclrtMemsetAsync(d, 4096, 0, 4096, NULL), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtDeviceEnablePeerAccess(1, 0), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtDeviceDisablePeerAccess(1), ACL_ERROR_RT_CONTEXT_NULL);
    assert_ptr_equal(p, (void *)0x1);
    /* what needs no context, and what was made in the ended one */
    assert_int_equal(aclrtMemset(d, 4096, 3, 4096), ACL_SUCCESS);
    assert_int_equal(aclrtMemsetAsync(d, 4096, 4, 4096, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
    /* a reset of a device nobody set, and a forced one */
    assert_int_equal(aclrtResetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtResetDeviceForce(1), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtGetDevice(&dev), ACL_SUCCESS);
    assert_int_equal(dev, 1);
}

/* aclInit and aclFinalize pair up with CANN's repeat codes; the runtime does not depend on them
 * (it starts on first use, and aclFinalize ends the session only: docs/runtime.md). */
static void test_init_and_finalize_repeat_codes(void **state)
{
    (void)state;
    npualloc_shutdown();
    assert_int_equal(aclFinalize(), ACL_ERROR_REPEAT_FINALIZE); /* before any aclInit */
    void *d;
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS); /* before aclInit */
    assert_int_equal(aclrtMalloc(&d, 64, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclInit(NULL), ACL_SUCCESS);
    assert_int_equal(aclInit("/nonexistent/acl.json"), ACL_ERROR_REPEAT_INITIALIZE);
    assert_int_equal(aclFinalize(), ACL_SUCCESS);
    assert_int_equal(aclFinalize(), ACL_ERROR_REPEAT_FINALIZE);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS); /* after aclFinalize */
    assert_int_equal(aclInit(NULL), ACL_SUCCESS);
    assert_int_equal(aclFinalize(), ACL_SUCCESS);
}

/* Eight threads race to free, unmap, release or destroy the same object: exactly one wins, the
 * others get the stale-object code. */
enum { RACERS = 8 };

typedef struct race {
    pthread_barrier_t start;
    void *ptr, *host, *va, *mapped;
    aclrtDrvMemHandle handle;
    aclrtStream stream;
    aclrtEvent event;
    atomic_int wins[7];
    atomic_int wrong; /* any other code */
} race;

static void tally(race *r, int which, aclError rc, aclError loser)
{
    if (rc == ACL_SUCCESS)
        atomic_fetch_add(&r->wins[which], 1);
    else if (rc != loser)
        atomic_fetch_add(&r->wrong, 1);
}

static void *racer(void *p)
{
    race *r = p;
    pthread_barrier_wait(&r->start);
    tally(r, 0, aclrtFree(r->ptr), ACL_ERROR_RT_MEMORY_FREE);
    tally(r, 1, aclrtFreeHost(r->host), ACL_ERROR_RT_MEMORY_FREE);
    tally(r, 2, aclrtFreePhysical(r->handle), ACL_ERROR_RT_INVALID_HANDLE);
    tally(r, 3, aclrtUnmapMem(r->mapped), ACL_ERROR_RT_PARAM_INVALID);
    tally(r, 4, aclrtReleaseMemAddress(r->va), ACL_ERROR_RT_PARAM_INVALID);
    tally(r, 5, aclrtDestroyStream(r->stream), ACL_ERROR_INVALID_PARAM);
    tally(r, 6, aclrtDestroyEvent(r->event), ACL_ERROR_INVALID_PARAM);
    return NULL;
}

static void test_threads_race_to_free_the_same_objects(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    for (int round = 0; round < 20; round++) {
        race r = {.wrong = 0};
        for (int i = 0; i < 7; i++)
            atomic_init(&r.wins[i], 0);
        assert_int_equal(aclrtMalloc(&r.ptr, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
        assert_int_equal(aclrtMallocHost(&r.host, 4096), ACL_SUCCESS);
        r.handle = physical(2 * MiB_);
        r.va = reserved(4 * MiB_);
        r.mapped = (char *)r.va + 2 * MiB_;
        assert_int_equal(aclrtMapMem(r.mapped, 2 * MiB_, 0, r.handle, 0), ACL_SUCCESS);
        assert_int_equal(aclrtCreateStream(&r.stream), ACL_SUCCESS);
        assert_int_equal(aclrtCreateEvent(&r.event), ACL_SUCCESS);
        assert_int_equal(aclrtMemsetAsync(r.ptr, 4096, 1, 4096, r.stream), ACL_SUCCESS);
        assert_int_equal(aclrtRecordEvent(r.event, r.stream), ACL_SUCCESS);
        pthread_barrier_init(&r.start, NULL, RACERS);
        pthread_t t[RACERS];
        for (int i = 0; i < RACERS; i++)
            assert_int_equal(pthread_create(&t[i], NULL, racer, &r), 0);
        for (int i = 0; i < RACERS; i++)
            pthread_join(t[i], NULL);
        pthread_barrier_destroy(&r.start);
        for (int i = 0; i < 7; i++)
            assert_int_equal(atomic_load(&r.wins[i]), 1);
        assert_int_equal(atomic_load(&r.wrong), 0);
    }
    assert_nothing_live();
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.reservations, 0);
}

/* A forked child starts with fresh devices: nothing the parent made answers there, each with its
 * error code, and the child can make its own. */
static void test_parent_objects_are_stale_in_a_forked_child(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    void *d, *host;
    aclrtStream s;
    aclrtEvent e;
    assert_int_equal(aclrtMalloc(&d, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtMallocHost(&host, 4096), ACL_SUCCESS);
    aclrtDrvMemHandle h = physical(2 * MiB_);
    void *va = reserved(2 * MiB_);
    assert_int_equal(aclrtMapMem(va, 2 * MiB_, 0, h, 0), ACL_SUCCESS);
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    assert_int_equal(aclrtCreateEvent(&e), ACL_SUCCESS);
    pid_t pid = fork();
    if (pid == 0) {
        int32_t dev;
        char buf[16];
        int bad = 0;
        bad += aclrtGetDevice(&dev) != ACL_ERROR_RT_CONTEXT_NULL;
        bad += aclrtMalloc(&d, 64, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_ERROR_RT_CONTEXT_NULL;
        bad += aclrtFree(d) != ACL_ERROR_RT_MEMORY_FREE;
        bad += aclrtMemcpy(buf, sizeof buf, d, sizeof buf, ACL_MEMCPY_DEVICE_TO_HOST) != ACL_ERROR_RT_PARAM_INVALID;
        bad += aclrtMemset(va, 16, 0, 16) != ACL_ERROR_RT_PARAM_INVALID;
        bad += aclrtFreePhysical(h) != ACL_ERROR_RT_INVALID_HANDLE;
        bad += aclrtUnmapMem(va) != ACL_ERROR_RT_PARAM_INVALID;
        bad += aclrtReleaseMemAddress(va) != ACL_ERROR_RT_PARAM_INVALID;
        bad += aclrtSynchronizeStream(s) != ACL_ERROR_INVALID_PARAM;
        bad += aclrtDestroyStream(s) != ACL_ERROR_INVALID_PARAM;
        bad += aclrtSynchronizeEvent(e) != ACL_ERROR_INVALID_PARAM;
        aclrtEventWaitStatus ws;
        bad += aclrtQueryEventWaitStatus(e, &ws) != ACL_ERROR_INVALID_PARAM;
        bad += aclrtResetEvent(e, s) != ACL_ERROR_INVALID_PARAM;
        bad += aclrtDestroyEvent(e) != ACL_ERROR_INVALID_PARAM;
        bad += aclrtMemcpy(buf, sizeof buf, host, sizeof buf, ACL_MEMCPY_HOST_TO_HOST) != ACL_SUCCESS; /* inherited */
        bad += aclrtFreeHost(host) != ACL_SUCCESS;
        aclrtDrvMemHandle mine;
        aclrtStream ms;
        bad += aclrtSetDevice(0) != ACL_SUCCESS;
        bad += aclrtMalloc(&d, 64, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS || aclrtFree(d) != ACL_SUCCESS;
        aclrtPhysicalMemProp prop = good_prop();
        bad += aclrtMallocPhysical(&mine, 2 * MiB_, &prop, 0) != ACL_SUCCESS || aclrtFreePhysical(mine) != ACL_SUCCESS;
        bad += aclrtCreateStream(&ms) != ACL_SUCCESS || aclrtDestroyStream(ms) != ACL_SUCCESS;
        bad += aclrtCreateStreamWithConfig(&ms, 0, ACL_STREAM_FAST_LAUNCH) != ACL_SUCCESS ||
               aclrtDestroyStream(ms) != ACL_SUCCESS;
        bad += aclrtSynchronizeDeviceWithTimeout(1000) != ACL_SUCCESS;
        npualloc_shutdown();
        _exit(bad);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* the parent's objects are untouched */
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtUnmapMem(va), ACL_SUCCESS);
    assert_int_equal(aclrtReleaseMemAddress(va), ACL_SUCCESS);
    assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(host), ACL_SUCCESS);
    assert_nothing_live();
}

/* Two threads each take and drop a reference on one device, over and over.  While a thread holds
 * its reference (between aclrtSetDevice and aclrtResetDevice) the device's context cannot end, so
 * its aclrtGetDevice always succeeds, however the other thread's reset interleaves. */
typedef struct context_arg {
    atomic_int *stop;
    int lost; /* times the context was gone while this thread held a reference */
} context_arg;

static void *set_get_reset(void *p)
{
    context_arg *a = p;
    for (int i = 0; i < 200000 && !atomic_load(a->stop); i++) {
        int32_t dev = -1;
        if (aclrtSetDevice(0) != ACL_SUCCESS || aclrtGetDevice(&dev) != ACL_SUCCESS || dev != 0) {
            a->lost++;
            atomic_store(a->stop, 1);
        }
        aclrtResetDevice(0);
    }
    return NULL;
}

static void test_a_reference_keeps_the_context_whatever_other_threads_reset(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    assert_int_equal(aclrtResetDevice(0), ACL_SUCCESS); /* start_runtime's reference */
    atomic_int stop = 0;
    pthread_t t[2];
    context_arg args[2] = {{&stop, 0}, {&stop, 0}};
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&t[i], NULL, set_get_reset, &args[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    assert_int_equal(args[0].lost + args[1].lost, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_devices_reject_bad_ids_and_null_outputs, stop_runtime),
        cmocka_unit_test_teardown(test_plain_memory_rejects_bad_arguments, stop_runtime),
        cmocka_unit_test_teardown(test_copies_and_memsets_reject_bad_arguments, stop_runtime),
        cmocka_unit_test_teardown(test_physical_memory_rejects_bad_arguments, stop_runtime),
        cmocka_unit_test_teardown(test_reservations_and_mappings_reject_bad_arguments, stop_runtime),
        cmocka_unit_test_teardown(test_streams_and_events_reject_bad_handles, stop_runtime),
        cmocka_unit_test_teardown(test_flagged_streams_and_events_reject_bad_arguments, stop_runtime),
        cmocka_unit_test_teardown(test_sharing_rejects_bad_arguments, stop_runtime),
        cmocka_unit_test_teardown(test_pinned_host_memory_beyond_the_machine_is_out_of_memory, stop_runtime),
        cmocka_unit_test_teardown(test_pinned_host_memory_together_cannot_exceed_the_machine, stop_runtime),
        cmocka_unit_test_teardown(test_pinned_host_memory_is_charged_in_whole_pages, stop_runtime),
        cmocka_unit_test_teardown(test_npualloc_functions_reject_null_pointers, stop_runtime),
        cmocka_unit_test_teardown(test_npualloc_functions_without_an_error_code_ignore_null_outputs, stop_runtime),
        cmocka_unit_test_teardown(test_record_history_refuses_unknown_levels, stop_runtime),
        cmocka_unit_test_teardown(test_history_level_is_reset_with_the_caches, stop_runtime),
        cmocka_unit_test_teardown(test_history_level_is_read_while_another_thread_sets_it, stop_runtime),
        cmocka_unit_test_teardown(test_init_error_is_read_while_other_threads_retry, stop_runtime),
        cmocka_unit_test_teardown(test_a_malformed_environment_fails_every_call, stop_runtime),
        cmocka_unit_test_teardown(test_old_handles_never_name_new_objects, stop_runtime),
        cmocka_unit_test_teardown(test_calls_without_a_context, stop_runtime),
        cmocka_unit_test_teardown(test_init_and_finalize_repeat_codes, stop_runtime),
        cmocka_unit_test_teardown(test_threads_race_to_free_the_same_objects, stop_runtime),
        cmocka_unit_test_teardown(test_parent_objects_are_stale_in_a_forked_child, stop_runtime),
        cmocka_unit_test_teardown(test_a_reference_keeps_the_context_whatever_other_threads_reset, stop_runtime),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
