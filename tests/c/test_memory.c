/* test_memory.c - aclrtMalloc policies and capacity accounting, memcpy, memset, host memory. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sanitizer.h"
#include "seccomp_util.h"
#include "testutil.h"

static size_t huge_free(void) { return free_of(ACL_HBM_MEM_HUGE); }
static size_t normal_free(void) { return free_of(ACL_HBM_MEM_NORMAL); }

static void test_huge_first_small_uses_normal_pages(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    size_t n0 = normal_free(), h0 = huge_free();
    void *p;
    /* 1 MiB - 32 bytes: + 32 pad = exactly 1 MiB, still "small": 256 normal 4 KiB pages. */
    assert_int_equal(aclrtMalloc(&p, MiB_ - 32, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(n0 - normal_free(), MiB_);
    /* Normal and huge pages share the HBM: huge free shrinks with it. */
    assert_int_equal(h0 - huge_free(), MiB_);
    assert_int_equal(free_of(ACL_HBM_MEM), 63 * MiB_);
    assert_int_equal(aclrtFree(p), ACL_SUCCESS);
    assert_int_equal(normal_free(), n0);
}

static void test_padding_and_align32_rounding(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    size_t n0 = normal_free();
    void *p, *q;
    assert_int_equal(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
    assert_int_equal(n0 - normal_free(), 8192); /* 4096 + 32 pad -> two pages */
    assert_int_equal(aclrtMallocAlign32(&q, 4096, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
    assert_int_equal(n0 - normal_free(), 8192 + 4096); /* no pad */
    assert_int_equal((uintptr_t)p % 64, 0);
    assert_int_equal(aclrtFree(p), ACL_SUCCESS);
    assert_int_equal(aclrtFree(q), ACL_SUCCESS);
    assert_int_equal(normal_free(), n0);
}

static void test_huge_first_large_prefers_huge_and_falls_back(void **state)
{
    (void)state;
    /* 64 MiB HBM, of which only 8 MiB may be huge pages. */
    start_runtime(1, 64 * MiB_, 8 * MiB_, 0, 0);
    void *a, *b;
    assert_int_equal(aclrtMallocAlign32(&a, 6 * MiB_, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(huge_free(), 2 * MiB_); /* took 3 huge pages */
    /* 4 MiB more does not fit in huge pages: normal pages instead. */
    assert_int_equal(aclrtMallocAlign32(&b, 4 * MiB_, ACL_MEM_MALLOC_HUGE_FIRST_P2P), ACL_SUCCESS);
    assert_int_equal(huge_free(), 2 * MiB_);
    assert_int_equal(free_of(ACL_HBM_MEM), 54 * MiB_);
    aclrtFree(a);
    aclrtFree(b);
    assert_int_equal(free_of(ACL_HBM_MEM), 64 * MiB_);
}

static void test_huge_only_fails_when_huge_pages_run_out(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 4 * MiB_, 0, 0);
    void *a, *b;
    assert_int_equal(aclrtMallocAlign32(&a, 3 * MiB_, ACL_MEM_MALLOC_HUGE_ONLY), ACL_SUCCESS);
    assert_int_equal(aclrtMallocAlign32(&b, 2 * MiB_, ACL_MEM_MALLOC_HUGE_ONLY), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(aclrtMallocAlign32(&b, 2 * MiB_, ACL_MEM_MALLOC_HUGE_ONLY_P2P), ACL_ERROR_RT_MEMORY_ALLOCATION);
    /* Small HUGE_ONLY requests still take a whole huge page. */
    assert_int_equal(aclrtFree(a), ACL_SUCCESS);
    assert_int_equal(aclrtMalloc(&b, 100, ACL_MEM_MALLOC_HUGE_ONLY), ACL_SUCCESS);
    assert_int_equal(huge_free(), 2 * MiB_);
    aclrtFree(b);
}

static void test_normal_only_uses_normal_pages(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 8 * MiB_, 0, 0);
    void *a;
    assert_int_equal(aclrtMallocAlign32(&a, 40 * MiB_, ACL_MEM_MALLOC_NORMAL_ONLY_P2P), ACL_SUCCESS);
    assert_int_equal(huge_free(), 8 * MiB_);
    assert_int_equal(normal_free(), 24 * MiB_);
    aclrtFree(a);
}

static void test_huge1g_pool_is_separate_and_exact(void **state)
{
    (void)state;
    start_runtime(1, 8 * GiB_, 8 * GiB_, 2 * GiB_, 0);
    assert_int_equal(normal_free(), 6 * GiB_); /* the pool is set aside */
    assert_int_equal(free_of(ACL_HBM_MEM_HUGE1G), 2 * GiB_);
    void *a, *b;
    assert_int_equal(aclrtMalloc(&a, GiB_ + 1, ACL_MEM_MALLOC_HUGE1G_ONLY), ACL_SUCCESS);
    assert_int_equal(free_of(ACL_HBM_MEM_HUGE1G), 0);
    assert_int_equal(aclrtMalloc(&b, 1, ACL_MEM_MALLOC_HUGE1G_ONLY_P2P), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(free_of(ACL_HBM_MEM), 6 * GiB_);
    aclrtFree(a);
    assert_int_equal(free_of(ACL_HBM_MEM_HUGE1G), 2 * GiB_);
    start_runtime(1, 8 * GiB_, 8 * GiB_, 0, 0);
    assert_int_equal(aclrtMalloc(&b, 1, ACL_MEM_MALLOC_HUGE1G_ONLY), ACL_ERROR_RT_MEMORY_ALLOCATION);
}

static void test_bandwidth_types_choose_ddr_or_hbm(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 16 * MiB_);
    void *a, *b, *c, *d;
    assert_int_equal(aclrtMalloc(&a, 8 * MiB_, ACL_MEM_MALLOC_HUGE_FIRST | ACL_MEM_TYPE_LOW_BAND_WIDTH), ACL_SUCCESS);
    assert_int_equal(free_of(ACL_DDR_MEM), 6 * MiB_); /* 8 MiB + 32 pad in 2 MiB DDR pages */
    assert_int_equal(free_of(ACL_HBM_MEM), 64 * MiB_);
    /* The page part of the policy holds on DDR too; the flag alone is HUGE_FIRST. */
    assert_int_equal(aclrtMalloc(&c, 1, ACL_MEM_MALLOC_HUGE_ONLY | ACL_MEM_TYPE_LOW_BAND_WIDTH), ACL_SUCCESS);
    assert_int_equal(free_of(ACL_DDR_MEM), 4 * MiB_);
    assert_int_equal(aclrtMalloc(&d, 100 * 1024, ACL_MEM_TYPE_LOW_BAND_WIDTH), ACL_SUCCESS);
    assert_int_equal(free_of(ACL_DDR_MEM), 4 * MiB_ - 104 * 1024); /* 1 MiB or less: 4 KiB pages */
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtMalloc(&d, 2 * MiB_, ACL_MEM_MALLOC_NORMAL_ONLY | ACL_MEM_TYPE_LOW_BAND_WIDTH), ACL_SUCCESS);
    assert_int_equal(free_of(ACL_DDR_MEM), 2 * MiB_ - 4096);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtFree(c), ACL_SUCCESS);
    assert_int_equal(aclrtMalloc(&b, 8 * MiB_, ACL_MEM_TYPE_HIGH_BAND_WIDTH), ACL_SUCCESS);
    assert_int_equal(free_of(ACL_HBM_MEM), 64 * MiB_ - 10 * MiB_);
    assert_int_equal(aclrtMalloc(&b, 9 * MiB_, ACL_MEM_TYPE_LOW_BAND_WIDTH), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(aclrtMalloc(&b, 1, ACL_MEM_TYPE_LOW_BAND_WIDTH | ACL_MEM_TYPE_HIGH_BAND_WIDTH),
                     ACL_ERROR_INVALID_PARAM);
    aclrtFree(a);
}

/* The 32-byte pad is left out exactly when the allocation takes 1 GiB pages (CANN pads every
 * policy but HUGE1G_ONLY / HUGE1G_ONLY_P2P): one decoding of the policy decides both. */
static void test_padding_is_left_out_only_for_1g_pages(void **state)
{
    (void)state;
    start_runtime(1, 3 * GiB_, 3 * GiB_, 2 * GiB_, 16 * MiB_);
    void *p;
    /* an unknown policy (0x206 is no HUGE1G policy, whatever its low byte): normal pages, padded */
    size_t n0 = normal_free();
    assert_int_equal(aclrtMalloc(&p, 4096, (aclrtMemMallocPolicy)0x206), ACL_SUCCESS);
    assert_int_equal(n0 - normal_free(), 8192);
    assert_int_equal(aclrtFree(p), ACL_SUCCESS);
    /* a 1 GiB policy on DDR, which has no 1 GiB pages: normal DDR pages, padded */
    size_t d0 = free_of(ACL_DDR_MEM);
    assert_int_equal(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_HUGE1G_ONLY | ACL_MEM_TYPE_LOW_BAND_WIDTH), ACL_SUCCESS);
    assert_int_equal(d0 - free_of(ACL_DDR_MEM), 8192);
    assert_int_equal(aclrtFree(p), ACL_SUCCESS);
    /* 1 GiB pages, with or without flags: no pad, so 1 GiB takes one page */
    const uint32_t one_g[] = {ACL_MEM_MALLOC_HUGE1G_ONLY, ACL_MEM_MALLOC_HUGE1G_ONLY_P2P,
                              ACL_MEM_MALLOC_HUGE1G_ONLY | ACL_MEM_TYPE_HIGH_BAND_WIDTH,
                              ACL_MEM_MALLOC_HUGE1G_ONLY_P2P | ACL_MEM_ACCESS_USER_SPACE_READONLY};
    for (size_t i = 0; i < sizeof one_g / sizeof *one_g; i++) {
        assert_int_equal(aclrtMalloc(&p, GiB_, (aclrtMemMallocPolicy)one_g[i]), ACL_SUCCESS);
        assert_int_equal(free_of(ACL_HBM_MEM_HUGE1G), GiB_);
        assert_int_equal(aclrtFree(p), ACL_SUCCESS);
    }
}

static void test_capacity_is_exact_until_out_of_memory(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    void *p[40];
    int n = 0;
    while (n < 40 && aclrtMallocAlign32(&p[n], 2 * MiB_, ACL_MEM_MALLOC_HUGE_ONLY) == ACL_SUCCESS)
        n++;
    assert_int_equal(n, 32);
    assert_int_equal(free_of(ACL_HBM_MEM), 0);
    void *q;
    assert_int_equal(aclrtMalloc(&q, 1, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_ERROR_RT_MEMORY_ALLOCATION);
    for (int i = 0; i < n; i++)
        assert_int_equal(aclrtFree(p[i]), ACL_SUCCESS);
    assert_int_equal(free_of(ACL_HBM_MEM), 64 * MiB_);
}

static void test_malloc_and_free_errors(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    void *p;
    assert_int_equal(aclrtMalloc(NULL, 10, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMalloc(&p, 0, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMalloc(&p, SIZE_MAX, 0), ACL_ERROR_INVALID_PARAM); /* size + 31 + pad overflows */
    assert_int_equal(aclrtMalloc(&p, SIZE_MAX - 64, 0), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(aclrtFree(NULL), ACL_ERROR_INVALID_PARAM);
    int local;
    assert_int_equal(aclrtFree(&local), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtMalloc(&p, 100, 0), ACL_SUCCESS);
    assert_int_equal(aclrtFree((char *)p + 64), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtFree(p), ACL_SUCCESS);
    assert_int_equal(aclrtFree(p), ACL_ERROR_RT_MEMORY_FREE);
    size_t f, t;
    assert_int_equal(aclrtGetMemInfo(ACL_HBM_MEM, NULL, &t), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtGetMemInfo(99, &f, &t), ACL_SUCCESS); /* unknown attribute: 0/0 */
    assert_int_equal(f, 0);
    assert_int_equal(t, 0);
}

static void test_memcpy_all_kinds_and_checks(void **state)
{
    (void)state;
    start_runtime(2, 64 * MiB_, 64 * MiB_, 0, 0);
    char host[256], back[256];
    for (int i = 0; i < 256; i++)
        host[i] = (char)i;
    void *d0, *d1, *hp;
    assert_int_equal(aclrtMalloc(&d0, 256, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMallocHost(&hp, 256), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(d0, 256, host, 256, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(hp, 256, d0, 256, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(back, 256, hp, 256, ACL_MEMCPY_HOST_TO_HOST), ACL_SUCCESS);
    assert_memory_equal(host, back, 256);
    assert_int_equal(aclrtMemcpy(back, 10, d0, 11, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(back, 10, d0, 0, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(NULL, 10, d0, 5, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemcpy(back, 10, d0, 5, ACL_MEMCPY_INNER_DEVICE_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemcpy(back, 10, d0, 5, (aclrtMemcpyKind)-1), ACL_ERROR_INVALID_PARAM);
    /* Past the end of the allocation's pages: rejected, not a fault. */
    assert_int_equal(aclrtMemcpy(back, 256, (char *)d0 + 4096 - 10, 20, ACL_MEMCPY_DEVICE_TO_HOST),
                     ACL_ERROR_RT_PARAM_INVALID);
    /* Between devices: needs peer access. */
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtMalloc(&d1, 256, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(d1, 256, d0, 256, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtDeviceEnablePeerAccess(0, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(d1, 256, d0, 256, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_SUCCESS);
    memset(back, 0, sizeof back);
    assert_int_equal(aclrtMemcpy(back, 256, d1, 256, ACL_MEMCPY_DEFAULT), ACL_SUCCESS);
    assert_memory_equal(host, back, 256);
    /* A freed pointer is an error code, never a fault. */
    assert_int_equal(aclrtFree(d1), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(back, 256, d1, 256, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    aclrtFree(d0);
    aclrtFreeHost(hp);
}

/* CANN's runtime with the host attached to the device: no copy between two host buffers on a stream,
 * pinned or pageable (aclrtMemcpy makes it); a copy onto itself succeeds without looking at the memory,
 * after the argument checks. */
static void test_copies_between_host_buffers_and_onto_themselves(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    aclrtStream s;
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    char a[64], b[64];
    memset(a, 1, sizeof a);
    memset(b, 2, sizeof b);
    void *pa, *pb, *d;
    assert_int_equal(aclrtMallocHost(&pa, 64), ACL_SUCCESS);
    assert_int_equal(aclrtMallocHost(&pb, 64), ACL_SUCCESS);
    assert_int_equal(aclrtMalloc(&d, 64, 0), ACL_SUCCESS);
    const void *srcs[] = {a, pa, a};
    void *dsts[] = {b, pb, pb};
    for (int i = 0; i < 3; i++)
        for (int kind = ACL_MEMCPY_HOST_TO_HOST; kind <= ACL_MEMCPY_DEFAULT; kind++)
            assert_int_equal(aclrtMemcpyAsync(dsts[i], 64, srcs[i], 64, (aclrtMemcpyKind)kind, s),
                             ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    /* nothing was queued, and nothing copied */
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(b[0], 2);
    /* no host address is device memory: a bogus pair is refused the same way, not queued */
    assert_int_equal(aclrtMemcpyAsync((void *)0x10, 64, (void *)0x10, 64, ACL_MEMCPY_DEVICE_TO_DEVICE, s),
                     ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtMemcpy(b, 64, a, 64, ACL_MEMCPY_HOST_TO_HOST), ACL_SUCCESS);
    assert_int_equal(b[0], 1);
    /* onto itself */
    assert_int_equal(aclrtMemcpy((void *)0x10, 64, (void *)0x10, 64, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy((void *)0x10, 64, (void *)0x10, 65, ACL_MEMCPY_DEVICE_TO_DEVICE),
                     ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy((void *)0x10, 64, (void *)0x10, 64, (aclrtMemcpyKind)7), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemcpyAsync(d, 64, d, 64, ACL_MEMCPY_DEVICE_TO_DEVICE, s), ACL_SUCCESS);
    void *freed;
    assert_int_equal(aclrtMalloc(&freed, 64, 0), ACL_SUCCESS);
    assert_int_equal(aclrtFree(freed), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(d, 64, freed, 64, ACL_MEMCPY_DEVICE_TO_DEVICE, s), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpyAsync(freed, 64, freed, 64, ACL_MEMCPY_DEVICE_TO_DEVICE, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    aclrtFree(d);
    aclrtFreeHost(pa);
    aclrtFreeHost(pb);
}

/* ---- 2-D copies ---- */

static aclrtStream stream2d; /* NULL: the synchronous aclrtMemcpy2d */

static aclError copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                       int kind)
{
    if (!stream2d)
        return aclrtMemcpy2d(dst, dpitch, src, spitch, width, height, (aclrtMemcpyKind)kind);
    aclError rc = aclrtMemcpy2dAsync(dst, dpitch, src, spitch, width, height, (aclrtMemcpyKind)kind, stream2d);
    return rc == ACL_SUCCESS ? aclrtSynchronizeStream(stream2d) : rc;
}

/* 5 rows of 24 bytes: host (pitch 40) -> device (pitch 32) -> host (pitch 48); the bytes between the
 * rows are left alone, from pageable and from aclrtMallocHost memory, with the kind named or DEFAULT. */
static void check_round_trip(void *dev, char *pinned)
{
    char src[5 * 40], back[5 * 48];
    for (int i = 0; i < (int)sizeof src; i++)
        src[i] = (char)(i * 7 + 1);
    char *hosts[2] = {src, pinned};
    memcpy(pinned, src, sizeof src);
    for (int h = 0; h < 2; h++) {
        assert_int_equal(aclrtMemset(dev, 5 * 32, 0xEE, 5 * 32), ACL_SUCCESS);
        assert_int_equal(copy2d(dev, 32, hosts[h], 40, 24, 5, h ? ACL_MEMCPY_DEFAULT : ACL_MEMCPY_HOST_TO_DEVICE),
                         ACL_SUCCESS);
        memset(back, 0x11, sizeof back);
        assert_int_equal(copy2d(back, 48, dev, 32, 24, 5, h ? ACL_MEMCPY_DEVICE_TO_HOST : ACL_MEMCPY_DEFAULT),
                         ACL_SUCCESS);
        for (int r = 0; r < 5; r++) {
            assert_memory_equal(back + r * 48, src + r * 40, 24);
            for (int b = 24; b < 48; b++)
                assert_int_equal(back[r * 48 + b], 0x11);
        }
        unsigned char flat[5 * 32];
        assert_int_equal(aclrtMemcpy(flat, sizeof flat, dev, sizeof flat, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
        for (int r = 0; r < 5; r++)
            for (int b = 24; b < 32; b++)
                assert_int_equal(flat[r * 32 + b], 0xEE);
    }
}

static void test_memcpy2d_round_trip_with_pitches(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    void *dev, *pinned;
    assert_int_equal(aclrtMalloc(&dev, 5 * 32, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMallocHost(&pinned, 5 * 40), ACL_SUCCESS);
    stream2d = NULL;
    check_round_trip(dev, pinned);
    assert_int_equal(aclrtCreateStream(&stream2d), ACL_SUCCESS);
    check_round_trip(dev, pinned);
    assert_int_equal(aclrtDestroyStream(stream2d), ACL_SUCCESS);
    stream2d = NULL;
    aclrtFree(dev);
    aclrtFreeHost(pinned);
}

/* The codes of CANN's ACL layer first (ACL_ERROR_INVALID_PARAM), then its runtime's limits
 * (ACL_ERROR_RT_PARAM_INVALID) and its refusal of DEVICE_TO_DEVICE (ACL_ERROR_RT_FEATURE_NOT_SUPPORT),
 * then the memory's: host to host, device to device, a row outside its allocation, a freed pointer. */
static void check_copy2d_errors(void *dev, void *dev2)
{
    char host[256] = {0}, host2[256];
    const size_t max_h = (size_t)5 << 20, max_w = 5000000;
    assert_int_equal(copy2d(NULL, 32, host, 32, 8, 2, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(copy2d(dev, 32, NULL, 32, 8, 2, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(copy2d(dev, 32, host, 32, 8, 0, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(copy2d(dev, 32, host, 32, 0, 2, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(copy2d(dev, 32, host, 16, 17, 2, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(copy2d(dev, 16, host, 32, 17, 2, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_INVALID_PARAM);
    const int refused_kinds[] = {ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE,
                                 ACL_MEMCPY_INNER_DEVICE_TO_DEVICE, ACL_MEMCPY_INTER_DEVICE_TO_DEVICE, -1, 8};
    for (size_t i = 0; i < sizeof refused_kinds / sizeof *refused_kinds; i++)
        assert_int_equal(copy2d(dev, 32, host, 32, 8, 2, refused_kinds[i]), ACL_ERROR_INVALID_PARAM);
    /* The ACL layer's kind check comes before the runtime's limits, the limits before DEVICE_TO_DEVICE. */
    assert_int_equal(copy2d(dev, 32, host, 32, 8, max_h + 1, ACL_MEMCPY_HOST_TO_HOST), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(copy2d(dev, 32, host, 32, 8, max_h + 1, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(copy2d(dev, max_w + 1, host, max_w + 1, max_w + 1, 1, ACL_MEMCPY_DEVICE_TO_DEVICE),
                     ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(copy2d(dev, max_w, dev2, max_w, max_w, max_h, ACL_MEMCPY_DEVICE_TO_DEVICE),
                     ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(copy2d(dev, 32, dev2, 32, 8, 2, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    /* The direction comes from the pointers: host to host and device to device are refused. */
    assert_int_equal(copy2d(host2, 32, host, 32, 8, 2, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(copy2d(dev, 32, dev2, 32, 8, 2, ACL_MEMCPY_DEFAULT), ACL_ERROR_RT_PARAM_INVALID);
    /* A kind against the pointers' direction: refused for pageable host memory, overridden for pinned. */
    assert_int_equal(copy2d(dev, 32, host, 32, 8, 2, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(copy2d(host2, 32, dev, 32, 8, 2, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    void *pinned;
    assert_int_equal(aclrtMallocHost(&pinned, 64), ACL_SUCCESS);
    memset(pinned, 0x42, 64);
    assert_int_equal(copy2d(dev, 32, pinned, 32, 8, 2, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(copy2d(host2, 32, dev, 32, 8, 2, ACL_MEMCPY_DEFAULT), ACL_SUCCESS);
    assert_int_equal(host2[32 + 7], 0x42);
    assert_int_equal(copy2d(pinned, 32, dev, 32, 8, 2, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(pinned), ACL_SUCCESS);
    /* Rows that would wrap around the address space. */
    assert_int_equal(copy2d(dev, 32, (void *)(UINTPTR_MAX - 64), 32, 8, 3, ACL_MEMCPY_HOST_TO_DEVICE),
                     ACL_ERROR_RT_PARAM_INVALID);
    /* The last row past the end of the allocation's pages: nothing is copied, not even the first rows. */
    unsigned char ff[64];
    memset(ff, 0xFF, sizeof ff);
    assert_int_equal(aclrtMemset(dev, 4096, 0, 4096), ACL_SUCCESS);
    assert_int_equal(copy2d(dev, 4096, ff, 8, 8, 2, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(host2, 8, dev, 8, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    for (int i = 0; i < 8; i++)
        assert_int_equal(host2[i], 0);
}

static void test_memcpy2d_error_codes(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    void *dev, *dev2;
    /* dev last, so that no later allocation maps the page after it */
    assert_int_equal(aclrtMalloc(&dev2, 256, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMallocAlign32(&dev, 4096, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
    stream2d = NULL;
    check_copy2d_errors(dev, dev2);
    assert_int_equal(aclrtCreateStream(&stream2d), ACL_SUCCESS);
    check_copy2d_errors(dev, dev2);
    /* A freed pointer is an error code, never a fault. */
    char host[64];
    assert_int_equal(aclrtFree(dev2), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy2dAsync(host, 32, dev2, 32, 8, 2, ACL_MEMCPY_DEVICE_TO_HOST, stream2d),
                     ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtDestroyStream(stream2d), ACL_SUCCESS);
    stream2d = NULL;
    assert_int_equal(aclrtMemcpy2d(host, 32, dev2, 32, 8, 2, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    aclrtFree(dev);
}

/* The asynchronous copy is one task in the stream's order: it sees the memset queued before it, and the
 * copy queued after it sees its rows. */
static void test_memcpy2d_async_keeps_stream_order(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    void *dev, *pinned;
    aclrtStream s;
    assert_int_equal(aclrtMalloc(&dev, 4 * 16, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMallocHost(&pinned, 4 * 16), ACL_SUCCESS);
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    static char src[4 * 8];
    for (int i = 0; i < (int)sizeof src; i++)
        src[i] = (char)(100 + i);
    assert_int_equal(aclrtMemsetAsync(dev, 64, 0x33, 64, s), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy2dAsync(dev, 16, src, 8, 8, 4, ACL_MEMCPY_HOST_TO_DEVICE, s), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(pinned, 64, dev, 64, ACL_MEMCPY_DEVICE_TO_HOST, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    const unsigned char *out = pinned;
    for (int r = 0; r < 4; r++) {
        assert_memory_equal(out + r * 16, src + r * 8, 8);
        for (int b = 8; b < 16; b++)
            assert_int_equal(out[r * 16 + b], 0x33);
    }
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    aclrtFree(dev);
    aclrtFreeHost(pinned);
}

static void test_memset_writes_and_checks(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    void *d;
    unsigned char back[100];
    assert_int_equal(aclrtMalloc(&d, 100, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMemset(d, 100, 0x5A, 100), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(back, 100, d, 100, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    for (int i = 0; i < 100; i++)
        assert_int_equal(back[i], 0x5A);
    assert_int_equal(aclrtMemset(d, 10, 0, 11), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemset(NULL, 10, 0, 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMemset(d, 0, 0, 0), ACL_SUCCESS);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtMemset(d, 100, 0, 100), ACL_ERROR_RT_PARAM_INVALID);
}

static void test_host_memory(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    void *h;
    assert_int_equal(aclrtMallocHost(&h, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocHost(NULL, 10), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtMallocHost(&h, 10000), ACL_SUCCESS);
    memset(h, 1, 10000);
    int local;
    assert_int_equal(aclrtFreeHost(&local), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtFreeHost(h), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(h), ACL_ERROR_RT_MEMORY_FREE);
    assert_int_equal(aclrtFreeHost(NULL), ACL_ERROR_INVALID_PARAM);
}

/* A read-only allocation: the process's own writes fault (in a fork child, which starts with fresh
 * devices and allocates its own), reads see what the runtime's copies and memsets wrote. */
static void test_readonly_memory_faults_on_writes_and_takes_the_runtimes(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    const aclrtMemMallocPolicy ro =
        (aclrtMemMallocPolicy)(ACL_MEM_MALLOC_HUGE_FIRST | ACL_MEM_ACCESS_USER_SPACE_READONLY);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL); /* not the test runner's handler: the fault must end the child */
        void *q;
        if (aclrtSetDevice(0) != ACL_SUCCESS || aclrtMalloc(&q, 4096, ro) != ACL_SUCCESS)
            _exit(2);
        unsigned char seen = ((volatile unsigned char *)q)[0]; /* reading works */
        ((volatile unsigned char *)q)[0] = (unsigned char)(seen + 1);
        _exit(0);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGSEGV);

    unsigned char *p;
    assert_int_equal(aclrtMalloc((void **)&p, 3 * MiB_, ro), ACL_SUCCESS);
    assert_int_equal(aclrtMemset(p, 3 * MiB_, 0x5A, 3 * MiB_), ACL_SUCCESS);
    assert_int_equal(p[0], 0x5A);
    assert_int_equal(p[3 * MiB_ - 1], 0x5A);
    unsigned char src[64];
    for (int i = 0; i < 64; i++)
        src[i] = (unsigned char)i;
    assert_int_equal(aclrtMemcpy(p + 100, 64, src, 64, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
    assert_memory_equal(p + 100, src, 64);
    /* an overlapping copy inside it moves the bytes as memmove would */
    assert_int_equal(aclrtMemcpy(p + 101, 64, p + 100, 64, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_SUCCESS);
    assert_int_equal(p[101], 0);
    assert_memory_equal(p + 102, src + 1, 63);
    /* and a copy from it, and the asynchronous forms, on a stream */
    unsigned char back[64];
    assert_int_equal(aclrtMemcpy(back, 64, p + 101, 64, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_memory_equal(back, p + 101, 64);
    aclrtStream s;
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    assert_int_equal(aclrtMemsetAsync(p + 2 * MiB_, 16, 0x11, 16, s), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(p + 2 * MiB_ + 16, 64, src, 64, ACL_MEMCPY_HOST_TO_DEVICE, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(p[2 * MiB_ + 15], 0x11);
    assert_memory_equal(p + 2 * MiB_ + 16, src, 64);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtFree(p), ACL_SUCCESS);
    /* an ordinary allocation stays writable */
    assert_int_equal(aclrtMalloc((void **)&p, 3 * MiB_, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    p[0] = 1;
    assert_int_equal(aclrtFree(p), ACL_SUCCESS);
}

/* Host addresses nobody allocated or that were unmapped, and read-only memory: memcpy and memset
 * return ACL_ERROR_RT_PARAM_INVALID instead of faulting, synchronously and on a stream. */
static void test_bad_host_addresses_are_error_codes(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    long page = sysconf(_SC_PAGESIZE);
    char *gone = mmap(NULL, 2 * (size_t)page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *ro = mmap(NULL, (size_t)page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(gone != MAP_FAILED && ro != MAP_FAILED);
    assert_int_equal(munmap(gone + page, (size_t)page), 0); /* the first page stays, the second is gone */
    void *d;
    char buf[64] = {0};
    assert_int_equal(aclrtMalloc(&d, 4096, 0), ACL_SUCCESS);
    void *low = (void *)(uintptr_t)12345; /* below mmap_min_addr: never mapped */
    assert_int_equal(aclrtMemset(low, 16, 0, 16), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemset(gone + page, 16, 0, 16), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemset(ro, 16, 0, 16), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemset(gone + page - 8, 16, 0, 16), ACL_ERROR_RT_PARAM_INVALID); /* runs off the end */
    assert_int_equal(aclrtMemcpy(low, 16, d, 16, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(ro, 16, d, 16, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(d, 16, low, 16, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(d, 16, gone + page, 16, ACL_MEMCPY_HOST_TO_DEVICE), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(buf, 16, low, 16, ACL_MEMCPY_HOST_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpy(low, 16, buf, 16, ACL_MEMCPY_HOST_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    /* Readable memory is still a good source, and the good first page a good destination. */
    assert_int_equal(aclrtMemcpy(d, 16, ro, 16, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
    assert_int_equal(aclrtMemset(gone, 16, 0x33, 16), ACL_SUCCESS);
    assert_int_equal(gone[15], 0x33);

    /* On a stream: a memset is queued (the host side is not probed then), reported by the synchronize
     * as the stream's error, and the stream keeps working.  A copy to or from pageable host memory is
     * made at once (CANN makes it synchronous), so its bad address is the call's error; pinned memory
     * freed after its copy was queued is the stream's. */
    aclrtStream s;
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    assert_int_equal(aclrtMemsetAsync((void *)(uintptr_t)0x10000, 16, 0, 16, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_ERROR_RT_DEVICE_MEM_ERROR);
    assert_int_equal(aclrtMemcpyAsync(low, 16, d, 16, ACL_MEMCPY_DEVICE_TO_HOST, s), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemcpyAsync(d, 16, gone + page, 16, ACL_MEMCPY_HOST_TO_DEVICE, s),
                     ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    void *pinned;
    assert_int_equal(aclrtMallocHost(&pinned, 16), ACL_SUCCESS);
    static atomic_int gate;
    hold_stream(s, &gate);
    assert_int_equal(aclrtMemcpyAsync(pinned, 16, d, 16, ACL_MEMCPY_DEVICE_TO_HOST, s), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(pinned), ACL_SUCCESS);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_ERROR_RT_DEVICE_MEM_ERROR);
    assert_int_equal(aclrtMemsetAsync(d, 16, 0x44, 16, s), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(buf, 16, d, 16, ACL_MEMCPY_DEVICE_TO_HOST, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(buf[0], 0x44);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    munmap(gone, (size_t)page);
    munmap(ro, (size_t)page);
}

/* Plain host memory on both sides goes through the kernel: overlapping moves (both directions,
 * longer than the staging buffer) give memmove's result, and a long memset sets every byte. */
static void test_host_to_host_moves_and_long_memsets(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    enum { N = 3 * 4096 + 123, SHIFT = 1000 };
    static unsigned char got[N], want[N];
    for (int dir = 0; dir < 2; dir++) {
        for (int i = 0; i < N; i++)
            got[i] = want[i] = (unsigned char)(i * 7 + 3);
        unsigned char *dst = dir ? got : got + SHIFT, *src = dir ? got + SHIFT : got;
        memmove(dir ? want : want + SHIFT, dir ? want + SHIFT : want, N - SHIFT);
        assert_int_equal(aclrtMemcpy(dst, N - SHIFT, src, N - SHIFT, ACL_MEMCPY_HOST_TO_HOST), ACL_SUCCESS);
        assert_memory_equal(got, want, N);
    }
    size_t big = 600 * KiB_ + 5; /* more than one system call's worth of pattern */
    unsigned char *h = malloc(big + 2);
    assert_non_null(h);
    memset(h, 1, big + 2);
    assert_int_equal(aclrtMemset(h + 1, big, 0xA7, big), ACL_SUCCESS);
    assert_int_equal(h[0], 1);
    assert_int_equal(h[big + 1], 1);
    for (size_t i = 1; i <= big; i++)
        if (h[i] != 0xA7)
            fail_msg("byte %zu is %#x", i, h[i]);
    free(h);
}

#ifdef TEST_AUDIT_ARCH
/* Where a seccomp filter refuses process_vm_readv/writev (ENOSYS), host copies and memsets still
 * work: the memory is then accessed directly.  Runs in a child, which the filter binds. */
static void test_host_copies_work_where_the_kernel_copy_is_refused(void **state)
{
    (void)state;
    if (getenv("NPUALLOC_VALGRIND"))
        skip(); /* valgrind runs its own system calls under the filter */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (bind_seccomp_filter(SYS_process_vm_readv, SYS_process_vm_writev, SECCOMP_RET_ERRNO | ENOSYS,
                                SECCOMP_RET_ALLOW) != 0)
            _exit(2);
        start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
        char a[64], b[64];
        memset(a, 9, sizeof a);
        void *d;
        int bad = aclrtMalloc(&d, 64, 0) != ACL_SUCCESS || aclrtMemcpy(d, 64, a, 64, ACL_MEMCPY_HOST_TO_DEVICE) ||
                  aclrtMemset(a, 64, 0, 64) || a[0] != 0 || aclrtMemcpy(b, 64, d, 64, ACL_MEMCPY_DEVICE_TO_HOST) ||
                  b[63] != 9 || aclrtMemcpy(a + 1, 63, a, 63, ACL_MEMCPY_HOST_TO_HOST) || a[1] != 0;
        _exit(bad ? 3 : 0);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}
#endif

static void *mem_info_without_device(void *arg)
{
    size_t f, t;
    *(aclError *)arg = aclrtGetMemInfo(ACL_HBM_MEM, &f, &t);
    return NULL;
}

static void test_mem_info_needs_a_current_device(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    aclError rc = 0;
    pthread_t t;
    pthread_create(&t, NULL, mem_info_without_device, &rc);
    pthread_join(t, NULL);
    assert_int_equal(rc, ACL_ERROR_RT_CONTEXT_NULL);
}

typedef struct hammer_arg {
    int id;
    int failures;
} hammer_arg;

static void *hammer_malloc_free(void *p)
{
    hammer_arg *a = p;
    aclrtSetDevice(a->id % 2);
#if defined(NPUALLOC_TSAN)
    const int rounds = 100; /* TSan's memset marks every byte it writes: 300 rounds took 32 s */
#else
    const int rounds = 300;
#endif
    for (int i = 0; i < rounds; i++) {
        size_t size = (size_t)(1 + (i * 7919 + a->id * 104729) % (3 * MiB_));
        void *d;
        if (aclrtMalloc(&d, size, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) {
            a->failures++;
            continue;
        }
        unsigned char tag = (unsigned char)(a->id * 31 + i);
        memset(d, tag, size);
        unsigned char *bytes = d;
        if (bytes[0] != tag || bytes[size - 1] != tag || bytes[size / 2] != tag)
            a->failures++;
        if (aclrtFree(d) != ACL_SUCCESS)
            a->failures++;
    }
    return NULL;
}

static void test_eight_threads_hammer_malloc_and_free(void **state)
{
    (void)state;
    start_runtime(2, 256 * MiB_, 256 * MiB_, 0, 0);
    pthread_t t[8];
    hammer_arg args[8];
    for (int i = 0; i < 8; i++) {
        args[i] = (hammer_arg){i, 0};
        pthread_create(&t[i], NULL, hammer_malloc_free, &args[i]);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(t[i], NULL);
        assert_int_equal(args[i].failures, 0);
    }
    assert_int_equal(free_of(ACL_HBM_MEM), 256 * MiB_);
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 0);
    assert_int_equal(c.reservations, 0);
    assert_int_equal(c.mappings, 0);
}

/* Lines of /proc/self/maps naming `needle` (all lines for NULL), read without malloc: at the map limit
 * stdio could not map a buffer. */
static int maps_lines(const char *needle)
{
    static char text[32 << 20];
    int fd = open("/proc/self/maps", O_RDONLY), n = 0;
    size_t len = 0;
    ssize_t r;
    while (fd >= 0 && len < sizeof text - 1 && (r = read(fd, text + len, sizeof text - 1 - len)) > 0)
        len += (size_t)r;
    if (fd >= 0)
        close(fd);
    text[len] = 0;
    for (char *line = text; *line;) {
        char *end = strchr(line, '\n');
        if (end)
            *end = 0;
        n += !needle || strstr(line, needle) != NULL;
        if (!end)
            break;
        line = end + 1;
    }
    return n;
}

/* Near vm.max_map_count a fixed mapping that splits the device window may leave the process above the
 * limit, where no mapping can be made: unmapping a view (replacing it by the window's reservation) must
 * still take the view away, and the process recovers once it has mappings to spare. */
static void test_free_above_the_map_count_limit_removes_the_views(void **state)
{
    (void)state;
#ifdef NPUALLOC_TSAN
    skip(); /* ThreadSanitizer maps its own memory as it goes, and fails at the limit */
#endif
    if (getenv("NPUALLOC_VALGRIND"))
        skip(); /* valgrind keeps its own table of mappings, with a limit of its own */
    long max = 0;
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    if (!f || fscanf(f, "%ld", &max) != 1 || max > 1000000) {
        if (f)
            fclose(f);
        skip(); /* unknown, or too many to fill in a test */
    }
    fclose(f);
    start_runtime(1, GiB_, GiB_, 0, 0);
    void *warm;
    assert_int_equal(aclrtMalloc(&warm, 1 << 20, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtFree(warm), ACL_SUCCESS);
    /* The program's own mappings fill the count: pages of alternating protections (no merging). */
    size_t pages = (size_t)max + 1000, page = (size_t)sysconf(_SC_PAGESIZE);
    char *arena = mmap(NULL, pages * page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    assert_true(arena != MAP_FAILED);
    size_t own = 0;
    for (; own + 1 < pages; own += 2)
        if (mprotect(arena + own * page, page, PROT_READ | PROT_WRITE) != 0)
            break;
    for (int i = 0; i < 40; i++) /* 40 back for the runtime */
        mprotect(arena + (own - 2 - 2 * (size_t)i) * page, page, PROT_READ);
    if (maps_lines(NULL) % 2) /* so that a view, not a reservation, is what goes past the limit */
        assert_true(mmap(NULL, page, PROT_READ | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != MAP_FAILED);
    enum { MAX_BLOCKS = 200 };
    static void *p[MAX_BLOCKS];
    int n = 0;
    aclError rc = ACL_SUCCESS;
    while (n < MAX_BLOCKS && (rc = aclrtMalloc(&p[n], 2 << 20, ACL_MEM_MALLOC_HUGE_FIRST)) == ACL_SUCCESS)
        n++;
    int views_at_limit = maps_lines("memfd:npualloc");
    for (int i = 0; i < n; i++)
        assert_int_equal(aclrtFree(p[i]), ACL_SUCCESS);
    int views_left = maps_lines("memfd:npualloc");
    munmap(arena, pages * page);
    assert_int_equal(rc, ACL_ERROR_RT_RESOURCE_ALLOC_FAIL); /* the limit was reached */
    assert_true(n > 0 && views_at_limit >= n);
    assert_int_equal(views_left, 0); /* every view went with its free */
    void *again;
    assert_int_equal(aclrtMalloc(&again, 2 << 20, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtFree(again), ACL_SUCCESS);
}

/* A memory file larger than RLIMIT_FSIZE: refused as out of memory, where the kernel's SIGXFSZ would have
 * killed the process (its default action; CPython ignores it, a C program does not). */
static void test_a_file_size_limit_is_an_allocation_failure_not_a_signal(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        signal(SIGXFSZ, SIG_DFL);
        struct rlimit limit = {4 << 20, 4 << 20};
        if (setrlimit(RLIMIT_FSIZE, &limit) != 0 || aclrtSetDevice(0) != ACL_SUCCESS)
            _exit(10);
        void *small, *big;
        if (aclrtMalloc(&small, 2 << 20, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS)
            _exit(11);
        if (aclrtMalloc(&big, 8 << 20, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_ERROR_RT_MEMORY_ALLOCATION)
            _exit(12);
        _exit(aclrtFree(small) == ACL_SUCCESS ? 0 : 13);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_false(WIFSIGNALED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_huge_first_small_uses_normal_pages, stop_runtime),
        cmocka_unit_test_teardown(test_padding_and_align32_rounding, stop_runtime),
        cmocka_unit_test_teardown(test_free_above_the_map_count_limit_removes_the_views, stop_runtime),
        cmocka_unit_test_teardown(test_a_file_size_limit_is_an_allocation_failure_not_a_signal, stop_runtime),
        cmocka_unit_test_teardown(test_padding_is_left_out_only_for_1g_pages, stop_runtime),
        cmocka_unit_test_teardown(test_huge_first_large_prefers_huge_and_falls_back, stop_runtime),
        cmocka_unit_test_teardown(test_huge_only_fails_when_huge_pages_run_out, stop_runtime),
        cmocka_unit_test_teardown(test_normal_only_uses_normal_pages, stop_runtime),
        cmocka_unit_test_teardown(test_huge1g_pool_is_separate_and_exact, stop_runtime),
        cmocka_unit_test_teardown(test_bandwidth_types_choose_ddr_or_hbm, stop_runtime),
        cmocka_unit_test_teardown(test_capacity_is_exact_until_out_of_memory, stop_runtime),
        cmocka_unit_test_teardown(test_copies_between_host_buffers_and_onto_themselves, stop_runtime),
        cmocka_unit_test_teardown(test_malloc_and_free_errors, stop_runtime),
        cmocka_unit_test_teardown(test_memcpy_all_kinds_and_checks, stop_runtime),
        cmocka_unit_test_teardown(test_memcpy2d_round_trip_with_pitches, stop_runtime),
        cmocka_unit_test_teardown(test_memcpy2d_error_codes, stop_runtime),
        cmocka_unit_test_teardown(test_memcpy2d_async_keeps_stream_order, stop_runtime),
        cmocka_unit_test_teardown(test_memset_writes_and_checks, stop_runtime),
        cmocka_unit_test_teardown(test_host_memory, stop_runtime),
        cmocka_unit_test_teardown(test_readonly_memory_faults_on_writes_and_takes_the_runtimes, stop_runtime),
        cmocka_unit_test_teardown(test_bad_host_addresses_are_error_codes, stop_runtime),
        cmocka_unit_test_teardown(test_host_to_host_moves_and_long_memsets, stop_runtime),
#ifdef TEST_AUDIT_ARCH
        cmocka_unit_test_teardown(test_host_copies_work_where_the_kernel_copy_is_refused, stop_runtime),
#endif
        cmocka_unit_test_teardown(test_mem_info_needs_a_current_device, stop_runtime),
        cmocka_unit_test_teardown(test_eight_threads_hammer_malloc_and_free, stop_runtime),
    };
    return cmocka_run_group_tests_name("memory", tests, NULL, NULL);
}
