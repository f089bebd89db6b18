/* test_expandable.c - expandable segments, base_addr_aligned_kb and page_size:1g. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "caching.h"
#include "testutil.h"

static void start_cache(uint64_t hbm, uint64_t huge1g, const char *conf)
{
    if (conf)
        setenv("PYTORCH_NPU_ALLOC_CONF", conf, 1);
    else
        unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
    start_runtime(1, hbm, hbm, huge1g, 0);
    while (npualloc_has_warnings()) { /* start each test with no leftover warnings */
        char w[512];
        npualloc_pop_warning(w, sizeof w);
    }
}

static int stop_cache(void **state)
{
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    return stop_runtime(state);
}

static void check(void)
{
    char why[512] = "";
    if (npualloc_cache_check(0, why, sizeof why) != ACL_SUCCESS)
        fail_msg("invariant broken: %s", why);
}

static npualloc_stats stats(void)
{
    npualloc_stats s;
    assert_int_equal(npualloc_cache_get_stats(0, &s), ACL_SUCCESS);
    return s;
}

static void *alloc(size_t size)
{
    void *p = NULL;
    aclError rc = npualloc_cache_malloc(0, size, 0, &p);
    if (rc != ACL_SUCCESS)
        fail_msg("malloc(%zu) failed: %d %s", size, rc, npualloc_last_error(NULL));
    return p;
}

/* Counts the snapshot's segments and checks they are all expandable (or all not). */
static size_t snapshot_segments(bool expandable, size_t *total)
{
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    size_t n = snap->segment_count;
    *total = 0;
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(snap->segments[i].is_expandable, expandable);
        *total += snap->segments[i].total_size;
    }
    npualloc_snapshot_free(snap);
    return n;
}

#define PAGE (20 * MiB_)
#define ARRAY_LEN_(a) (sizeof(a) / sizeof((a)[0]))

static void test_one_segment_grows_page_by_page(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    char *p[10];
    for (int i = 0; i < 10; i++) {
        p[i] = alloc(15 * MiB_ - 32); /* 15 MiB exactly */
        if (i > 0)
            assert_ptr_equal(p[i], p[i - 1] + 15 * MiB_); /* the segment extends in place */
        size_t want_pages = ((size_t)(i + 1) * 15 + 19) / 20;
        npualloc_stats s = stats();
        assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, want_pages * PAGE);
        /* One map call per growth, and each growth here needs at most one new 20 MiB page, so the
         * maps so far equal the pages: ceil(15 * (i + 1) / 20) = 1,2,3,3,4,5,6,6,7,8 (the 4th and 8th
         * requests fit in the free tail of the mapped pages: 60 and 120 MiB are whole pages). */
        static const int64_t want_maps[10] = {1, 2, 3, 3, 4, 5, 6, 6, 7, 8};
        assert_int_equal(s.num_device_alloc, want_maps[i]);
        assert_int_equal(s.segment[NPUALLOC_STAT_ALL].current, 0); /* mapping does not add segments */
        check();
    }
    size_t total;
    assert_int_equal(snapshot_segments(true, &total), 1); /* one contiguous mapped range */
    assert_int_equal(total, 8 * PAGE);
    for (int i = 0; i < 10; i++)
        npualloc_cache_free(p[i]);
    check();
    npualloc_cache_empty();
    npualloc_stats s = stats();
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    assert_int_equal(s.num_device_free, 1); /* one unmap of the whole free range */
    assert_int_equal(snapshot_segments(true, &total), 0);
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 0); /* pages freed, reservation released */
    assert_int_equal(c.reservations, 0);
    check();
}

static void test_small_pool_uses_2mib_pages(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    char *a = alloc(1000), *b = alloc(MiB_ - 32);
    assert_ptr_equal(b, a + 1536);
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_SMALL_POOL].current, 2 * MiB_); /* one page */
    char *c = alloc(MiB_ - 32); /* crosses into a second 2 MiB page, contiguous */
    assert_ptr_equal(c, b + MiB_);
    npualloc_stats s = stats();
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_SMALL_POOL].current, 2 * 2 * MiB_);
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_LARGE_POOL].current, 0);
    check();
}

/* raw_alloc has no 1 EB check: the largest sizes it takes (just under 2^63) go all the way to the
 * ordinary OOM, through the expandable segment and page rounding, without overflowing. */
static void test_huge_raw_alloc_is_an_ordinary_oom(void **state)
{
    (void)state;
    const char *confs[] = {"expandable_segments:True", "expandable_segments:True,page_size:1g",
                           "roundup_power2_divisions:4", "page_size:1g"};
    for (size_t i = 0; i < sizeof confs / sizeof *confs; i++) {
        start_cache(GiB_, 0, confs[i]);
        void *p = NULL;
        void *keep = alloc(30 * MiB_);
        for (size_t size = (size_t)1 << 60; size != 0 && size < ((size_t)1 << 63); size = size * 2 + 1) {
            assert_int_equal(npualloc_cache_malloc(0, size, 0, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
            assert_null(p);
            assert_non_null(strstr(npualloc_last_error(NULL), " GiB (NPU 0; 1024.00 MiB total capacity; "));
        }
        assert_int_equal(stats().num_ooms, 3);
        npualloc_cache_free(keep);
        check();
    }
}

static void test_empty_cache_unmaps_exactly_the_fully_free_pages(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    /* Three 30 MiB blocks over pages of 20 MiB: [0,30) [30,60) [60,90) -> pages 0..4 mapped. */
    char *a = alloc(30 * MiB_ - 32), *b = alloc(30 * MiB_ - 32), *c = alloc(30 * MiB_ - 32);
    (void)a;
    (void)c;
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 5 * PAGE);
    npualloc_cache_free(b); /* [30, 60) free: only page [40, 60) lies entirely inside */
    npualloc_cache_empty();
    npualloc_stats s = stats();
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, 4 * PAGE);
    size_t total;
    assert_int_equal(snapshot_segments(true, &total), 2); /* [0, 40) and [60, 100) */
    assert_int_equal(total, 4 * PAGE);
    check();
    /* The hole is reused at the lowest address, mapping the page again. */
    char *d = alloc(30 * MiB_ - 32);
    assert_ptr_equal(d, b);
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 5 * PAGE);
    check();
}

/* torch counts every map as a device allocation and every unmap as a device free, so one mapping
 * released in two parts counts more frees than allocations (the replay fuzzer once assumed not). */
static void test_one_map_released_in_two_parts_counts_two_device_frees(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    char *a = alloc(25 * MiB_ - 32); /* pages [0, 40) mapped by one call */
    assert_int_equal(stats().num_device_alloc, 1);
    npualloc_cache_free(a);
    char *b = alloc(5 * MiB_ - 32); /* [0, 5): page [0, 20) stays in use */
    assert_ptr_equal(b, a);
    npualloc_cache_empty(); /* unmaps page [20, 40) */
    npualloc_stats s = stats();
    assert_int_equal(s.num_device_free, 1);
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, PAGE);
    npualloc_cache_free(b);
    npualloc_cache_empty(); /* unmaps page [0, 20) */
    s = stats();
    assert_int_equal(s.num_device_alloc, 1);
    assert_int_equal(s.num_device_free, 2);
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    check();
}

/* A private pool is forgotten once it owns nothing: its count of segments must follow its
 * expandable segments, not the mappings inside them (two maps unmapped at once left the count at
 * 1, one map unmapped in two parts took it below 0: either way the pool was never freed). */
static void route_to_new_pool(npualloc_mempool_id *id)
{
    *id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_begin(0, *id, NPUALLOC_POOL_FILTER_THREAD, (uint64_t)pthread_self()),
                     ACL_SUCCESS); /* the route holds the pool's only reference */
}

static void test_private_pool_counts_its_expandable_segments(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    npualloc_mempool_id id;
    route_to_new_pool(&id);
    char *a = alloc(15 * MiB_ - 32), *b = alloc(15 * MiB_ - 32); /* two maps: [0, 20), then [20, 40) */
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    npualloc_cache_free(a);
    npualloc_cache_free(b);
    npualloc_cache_empty(); /* one unmap of [0, 40): the segment and the pool go */
    check();

    route_to_new_pool(&id);
    char *c = alloc(25 * MiB_ - 32); /* one map: [0, 40) */
    npualloc_cache_free(c);
    char *d = alloc(5 * MiB_ - 32); /* keeps page [0, 20) */
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    npualloc_cache_empty(); /* unmaps [20, 40) */
    npualloc_cache_free(d);
    npualloc_cache_empty(); /* unmaps [0, 20): the segment and the pool go */
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    check();
}

static void test_empty_virt_addr_cache_keeps_physical_pages(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    void *a = alloc(40 * MiB_ - 32);
    npualloc_cache_free(a);
    assert_int_equal(npualloc_cache_empty_virt_addr_cache(), ACL_SUCCESS);
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 2); /* unmapped but kept */
    assert_int_equal(c.mappings, 0);
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    alloc(40 * MiB_ - 32); /* maps the kept pages again: no new physical memory */
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 2);
    check();
    start_cache(GiB_, 0, NULL);
    assert_int_equal(npualloc_cache_empty_virt_addr_cache(), ACL_ERROR_INVALID_PARAM);
    assert_string_equal(npualloc_last_error(NULL),
                        "Unsupported config for empty_virt_addr_cache, please enable expandable_segments.");
}

static void test_base_addr_aligned_kb(void **state)
{
    (void)state;
    static const struct {
        const char *conf;
        size_t align;
    } cases[] = {{"expandable_segments:True", 16 * KiB_},
                 {"expandable_segments:True,base_addr_aligned_kb:16", 16 * KiB_},
                 {"expandable_segments:True,base_addr_aligned_kb:4", 4 * KiB_},
                 {"expandable_segments:True,base_addr_aligned_kb:0", 512}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        start_cache(GiB_, 0, cases[i].conf);
        char *small = alloc(11 * MiB_ - 32); /* 11 MiB: the next block starts 11 MiB in... */
        char *odd = alloc(600 * 1024);       /* small pool: elsewhere */
        char *big = alloc(3 * MiB_);         /* >= 2 MiB: aligned start */
        (void)odd;
        assert_int_equal((uintptr_t)big % cases[i].align, 0);
        char *mid = alloc(2 * MiB_ + 1000); /* lands after big at an unaligned offset unless aligned */
        assert_int_equal((uintptr_t)mid % cases[i].align, 0);
        if (cases[i].align == 512)
            assert_ptr_equal(mid, big + 3 * MiB_ + 512); /* no gap without alignment */
        else
            assert_true(mid >= big + 3 * MiB_ + 512 && mid < big + 3 * MiB_ + 512 + cases[i].align);
        (void)small;
        check();
    }
}

static void test_base_addr_aligned_kb_needs_expandable(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "base_addr_aligned_kb:16");
    alloc(11 * MiB_ - 32);
    char *a = alloc(3 * MiB_), *b = alloc(2 * MiB_ + 1000);
    assert_ptr_equal(b, a + 3 * MiB_ + 512); /* no effect without expandable segments */
}

static bool pop_warning_containing(const char *text)
{
    char w[512];
    bool found = false;
    while (npualloc_pop_warning(w, sizeof w))
        found |= strstr(w, text) != NULL;
    return found;
}

static void test_page_size_1g_uses_the_1g_pool(void **state)
{
    (void)state;
    start_cache(8 * GiB_, 4 * GiB_, "page_size:1g");
    alloc(100 * MiB_); /* a large-pool segment rounded up to 1 GiB */
    npualloc_stats s = stats();
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, GiB_);
    assert_int_equal(free_of(ACL_HBM_MEM_HUGE1G), 3 * GiB_);
    alloc(100); /* small requests still use 2 MiB segments of normal memory */
    assert_int_equal(free_of(ACL_HBM_MEM_HUGE1G), 3 * GiB_);
    assert_false(pop_warning_containing("1G large-page"));
    check();
}

static void test_page_size_1g_without_1g_pages_warns_and_falls_back(void **state)
{
    (void)state;
    start_cache(8 * GiB_, 0, "page_size:1g");
    alloc(100 * MiB_);
    assert_true(pop_warning_containing("The malloc 1G large-page physical memory failed, so malloc 2M page memory."));
    npualloc_stats s = stats();
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, GiB_);
    assert_int_equal(free_of(ACL_HBM_MEM_HUGE), 7 * GiB_);
    alloc(1100 * MiB_); /* a second fallback: torch_npu warns once a process */
    assert_int_equal(free_of(ACL_HBM_MEM_HUGE), 5 * GiB_);
    assert_false(pop_warning_containing("1G large-page"));
    check();
}

static void test_page_size_1g_expandable_maps_1g_pages(void **state)
{
    (void)state;
    start_cache(8 * GiB_, 2 * GiB_, "expandable_segments:True,page_size:1g");
    alloc(1500 * MiB_);
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 2 * GiB_);
    assert_int_equal(free_of(ACL_HBM_MEM_HUGE1G), 0);
    alloc(700 * MiB_); /* 1.5 + 0.7 GiB: a third page, the 1 GiB pool is empty: fallback */
    assert_true(pop_warning_containing("1G large-page"));
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 3 * GiB_);
    check();
}

static void test_option_conflicts_fail_with_torch_npu_messages(void **state)
{
    (void)state;
    static const char *bad[] = {"expandable_segments:True,max_split_size_mb:64",
                                "expandable_segments:True,garbage_collection_threshold:0.5"};
    for (size_t i = 0; i < 2; i++) {
        start_cache(GiB_, 0, bad[i]);
        void *p = NULL;
        assert_int_not_equal(npualloc_cache_malloc(0, 100, 0, &p), ACL_SUCCESS);
        assert_string_equal(npualloc_last_error(NULL),
                            "`max_split_size_mb` or `garbage_collection_threshold`, cannot be enabled with "
                            "`expandable_segments`, please set `expandable_segments` to `False`.");
    }
}

/* torch's test_release_expandable: release_cached_blocks runs with expandable blocks cached. */
static void test_release_cached_blocks_with_expandable_blocks_free(void **state)
{
    (void)state;
    start_cache(GiB_, 0, NULL);
    assert_int_equal(npualloc_cache_set_fraction(0, 120.0 / 1024.0), ACL_SUCCESS); /* 120 MiB allowed */
    assert_int_equal(npualloc_cache_set_settings("expandable_segments:False,max_split_size_mb:40"), ACL_SUCCESS);
    void *a = alloc(30 * MiB_ - 32);
    assert_int_equal(npualloc_cache_set_settings("expandable_segments:True"), ACL_SUCCESS);
    void *b = alloc(40 * MiB_ - 32);
    assert_int_equal(npualloc_cache_set_settings("expandable_segments:False,max_split_size_mb:40"), ACL_SUCCESS);
    void *c = alloc(30 * MiB_ - 32);
    void *p = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 30 * MiB_ - 32, 0, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    npualloc_cache_free(a);
    npualloc_cache_free(b);
    npualloc_cache_free(c);
    check();
    void *all = alloc(120 * MiB_ - 32); /* only fits once every cached block, expandable or not, is gone */
    assert_non_null(all);
    npualloc_stats s = stats();
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, 120 * MiB_);
    check();
}

/* torch's test_garbage_collect_expandable: garbage collection frees plain segments only. */
static void test_garbage_collection_skips_expandable_blocks(void **state)
{
    (void)state;
    start_cache(GiB_, 0, NULL);
    assert_int_equal(npualloc_cache_set_fraction(0, 120.0 / 1024.0), ACL_SUCCESS);
    void *a = alloc(40 * MiB_ - 32); /* a plain 40 MiB segment */
    /* torch_npu's parser refuses expandable segments with garbage collection, so switch both on
     * directly (all device locks are free here): the allocator must still skip expandable blocks. */
    cache_settings.expandable_segments = true;
    cache_settings.garbage_collection_threshold = 0.5;
    void *b = alloc(40 * MiB_ - 32); /* two 20 MiB pages */
    npualloc_cache_free(a);
    npualloc_cache_free(b);
    void *c = alloc(80 * MiB_ - 32); /* a miss above 60 MiB: GC frees a, b's pages grow instead */
    (void)c;
    npualloc_stats s = stats();
    assert_int_equal(s.num_device_free, 1);
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, 80 * MiB_);
    check();
}

static void test_turning_expandable_off_skips_expandable_blocks(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    void *a = alloc(10 * MiB_);
    npualloc_cache_free(a);
    assert_int_equal(npualloc_cache_set_settings("expandable_segments:False"), ACL_SUCCESS);
    void *b = alloc(10 * MiB_); /* the cached expandable block is not used */
    assert_ptr_not_equal(a, b);
    assert_int_equal(stats().segment[NPUALLOC_STAT_ALL].current, 1);
    check();
}

static void test_history_records_map_and_unmap(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_STATE, 100), ACL_SUCCESS);
    void *a = alloc(30 * MiB_ - 32);
    npualloc_cache_free(a);
    npualloc_cache_empty();
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    int maps = 0, unmaps = 0;
    for (size_t i = 0; i < snap->trace_count; i++) {
        if (snap->traces[i].action == NPUALLOC_TRACE_SEGMENT_MAP) {
            maps++;
            assert_int_equal(snap->traces[i].size, 2 * PAGE);
        }
        if (snap->traces[i].action == NPUALLOC_TRACE_SEGMENT_UNMAP) {
            unmaps++;
            assert_int_equal(snap->traces[i].size, 2 * PAGE);
        }
    }
    assert_int_equal(maps, 1);
    assert_int_equal(unmaps, 1);
    npualloc_snapshot_free(snap);
}

/* A segment whose first mapping failed (out of device memory) is all address space: empty_cache
 * gives the range back, and a released private pool holding one goes too (both were kept for good:
 * the range of a stream never used again, the pool with its count of one segment). */
static void test_empty_cache_releases_segments_with_nothing_mapped(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    device_cache *dc = cache_device(0);
    void *p = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 2 * GiB_, 0, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_non_null(dc->expandable_segments); /* reserved for the request, nothing mapped */
    npualloc_cache_empty();
    assert_null(dc->expandable_segments);

    npualloc_mempool_id id;
    route_to_new_pool(&id);
    assert_int_equal(npualloc_cache_malloc(0, 2 * GiB_, 0, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS); /* released: nobody uses the pool */
    npualloc_cache_empty();
    assert_null(dc->expandable_segments);
    assert_null(cache_pool_find(dc, id));
    check();
}

/* As a plain segment, an expandable one keeps where it was first mapped (torch_npu's map_block sets
 * the segment's context): the snapshot's segment reports it, and an unmap recorded without a
 * context of its own falls back to it, as a segment free does. */
static void test_expandable_segment_keeps_its_allocation_context(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    npualloc_context *where = npualloc_context_create("train.py:7", 10);
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_ALLOC, 100), ACL_SUCCESS);
    void *whole = NULL; /* one page exactly: nothing is split off */
    assert_int_equal(npualloc_cache_malloc_ctx(0, PAGE - 32, 0, where, &whole), ACL_SUCCESS);
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    assert_int_equal(snap->segment_count, 1);
    assert_true(snap->segments[0].is_expandable);
    assert_ptr_equal(snap->segments[0].frames, where);
    npualloc_snapshot_free(snap);
    npualloc_cache_free(whole);
    npualloc_cache_empty(); /* no context of its own (ALLOC level) */
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    size_t unmaps = 0;
    for (size_t i = 0; i < snap->trace_count; i++) {
        if (snap->traces[i].action == NPUALLOC_TRACE_SEGMENT_UNMAP) {
            unmaps++;
            assert_ptr_equal(snap->traces[i].frames, where);
        }
    }
    assert_int_equal(unmaps, 1);
    npualloc_snapshot_free(snap);
    npualloc_context_release(where);
    check();
}

/* ---- out of host memory while unmapping ---- */

/* The block structs come in chunks from aligned_alloc (caching.c): this one fails while armed,
 * otherwise it is the next definition's (libc's, or a sanitizer's). */
static atomic_bool fail_aligned_alloc;
static void *(*next_aligned_alloc)(size_t, size_t);
static pthread_once_t next_aligned_alloc_once = PTHREAD_ONCE_INIT;

static void find_next_aligned_alloc(void)
{
    *(void **)&next_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
}

void *aligned_alloc(size_t alignment, size_t size)
{
    if (atomic_load(&fail_aligned_alloc))
        return NULL;
    pthread_once(&next_aligned_alloc_once, find_next_aligned_alloc);
    return next_aligned_alloc(alignment, size);
}

/* Puts back the spare block structs a test set aside (it left one in the list). */
static void restore_spares(device_cache *dc, cache_block *rest)
{
    cache_block *spare = dc->spare_blocks;
    if (!spare) {
        dc->spare_blocks = rest;
        return;
    }
    while (spare->free_link)
        spare = spare->free_link;
    spare->free_link = rest;
}

/* Unmapping the middle pages of a free block splits off the parts before and after them; without
 * host memory for the second part the block stays mapped, whole and correctly indexed (the undo
 * merged the first part back into a block still in the pool, re-keying it in place). */
static void test_unmap_without_host_memory_for_the_split_leaves_the_block_mapped(void **state)
{
    (void)state;
    if (getenv("NPUALLOC_VALGRIND"))
        skip(); /* valgrind replaces the executable's aligned_alloc with its own */
    start_cache(GiB_, 0, "expandable_segments:True");
    char *a = alloc(10 * MiB_ - 32), *b = alloc(40 * MiB_ - 32), *c = alloc(10 * MiB_ - 32);
    assert_ptr_equal(b, a + 10 * MiB_);
    assert_ptr_equal(c, a + 50 * MiB_);
    npualloc_cache_free(b); /* free [10, 50): page [20, 40) lies inside, with 10 MiB before and after */
    device_cache *dc = cache_device(0);
    cache_block *spare = dc->spare_blocks, *rest = spare->free_link;
    spare->free_link = NULL; /* one spare struct: the part before gets it, the part after finds none */
    atomic_store(&fail_aligned_alloc, true);
    npualloc_cache_empty();
    atomic_store(&fail_aligned_alloc, false);
    restore_spares(dc, rest);
    check();
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 3 * PAGE);
    npualloc_cache_empty(); /* with memory, the page goes */
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 2 * PAGE);
    check();
    npualloc_cache_free(a);
    npualloc_cache_free(c);
}

/* A map that runs out of host memory for the struct of the unmapped rest gives back the page it
 * took from empty_virt_addr_cache's kept pages to them, not to the device. */
static void test_map_without_host_memory_keeps_the_kept_pages(void **state)
{
    (void)state;
    if (getenv("NPUALLOC_VALGRIND"))
        skip(); /* valgrind replaces the executable's aligned_alloc with its own */
    start_cache(GiB_, 0, "expandable_segments:True");
    npualloc_cache_free(alloc(40 * MiB_ - 32));
    assert_int_equal(npualloc_cache_empty_virt_addr_cache(), ACL_SUCCESS);
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 2);
    /* A route to a private pool (for another stream: the allocations here stay in the default pool,
     * whose pages were kept) makes the failed allocation end without the last resort, which would
     * free the kept pages anyway. */
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_begin(0, id, NPUALLOC_POOL_FILTER_STREAM, 0x5eed), ACL_SUCCESS);
    device_cache *dc = cache_device(0);
    cache_block *spare = dc->spare_blocks, *rest = spare->free_link;
    spare->free_link = NULL; /* one spare struct: the new segment gets it, the map's rest finds none */
    atomic_store(&fail_aligned_alloc, true);
    void *p = NULL;
    aclError rc = npualloc_cache_malloc(0, 20 * MiB_ - 32, 0, &p);
    atomic_store(&fail_aligned_alloc, false);
    restore_spares(dc, rest);
    assert_int_equal(rc, ACL_ERROR_RT_MEMORY_ALLOCATION);
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 2); /* both still kept */
    assert_int_equal(c.mappings, 0);
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    check();
    p = alloc(40 * MiB_ - 32); /* maps both kept pages: no new physical memory */
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 2);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    npualloc_cache_free(p);
    npualloc_cache_empty();
    check();
}

/* A map whose later page finds no device memory gives the kept page it mapped first back to the
 * kept pages too. */
static void test_map_failing_on_the_device_keeps_the_kept_pages(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    npualloc_cache_free(alloc(20 * MiB_ - 32));
    assert_int_equal(npualloc_cache_empty_virt_addr_cache(), ACL_SUCCESS);
    npualloc_mempool_id id;
    route_to_new_pool(&id); /* no last resort, which frees the kept pages anyway */
    assert_int_equal(npualloc_fault_set(NPUALLOC_FAULT_DEVICE_ALLOC, 1), ACL_SUCCESS);
    void *p = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 40 * MiB_ - 32, 0, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    uint64_t seen, injected;
    npualloc_fault_counts(NPUALLOC_FAULT_DEVICE_ALLOC, &seen, &injected);
    assert_int_equal(injected, 1); /* the second page's: the first one was the kept page */
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 1); /* still kept */
    assert_int_equal(c.mappings, 0);
    check();
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    npualloc_cache_empty();
    check();
}

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void test_random_operations_with_expandable_segments(void **state)
{
    (void)state;
    start_cache(2 * GiB_, 0, "expandable_segments:True");
    aclrtStream side;
    assert_int_equal(aclrtCreateStream(&side), ACL_SUCCESS);
    enum { SLOTS = 256 };
    void *live[SLOTS] = {0};
    const int steps = random_steps(20000, 6000, 1000);
    for (int step = 0; step < steps; step++) {
        uint64_t r = rng();
        int slot = (int)(r % SLOTS), op = (int)((r >> 12) % 100);
        if (live[slot] && op < 45) {
            npualloc_cache_free(live[slot]);
            live[slot] = NULL;
        } else if (!live[slot] && op < 92) {
            size_t size = (r >> 20) % 4 == 0 ? 1 + (r >> 32) % (200 * MiB_) : 1 + (r >> 32) % (4 * MiB_);
            uint64_t stream = (r >> 40) % 4 == 0 ? (uint64_t)(uintptr_t)side : 0;
            void *p = NULL;
            aclError rc = npualloc_cache_malloc(0, size, stream, &p);
            if (rc == ACL_SUCCESS) {
                live[slot] = p;
                ((char *)p)[size - 1] = 1;
            } else {
                assert_int_equal(rc, ACL_ERROR_RT_MEMORY_ALLOCATION);
            }
        } else if (op < 95) {
            npualloc_cache_empty();
        } else if (op < 97) {
            npualloc_cache_empty_virt_addr_cache();
        }
        check();
    }
    for (int i = 0; i < SLOTS; i++)
        npualloc_cache_free(live[i]);
    npualloc_cache_empty();
    check();
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    aclrtDestroyStream(side);
}

/* The segment's range is the allocator's: a program's aclrtUnmapMem, aclrtReleaseMemAddress or
 * aclrtMapMem on it is refused (as on aclrtMalloc memory), on mapped pages and unmapped ones, and
 * the allocator keeps working on it. */
static void test_user_cannot_unmap_release_or_map_a_segments_range(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    char *p = alloc(15 * MiB_ - 32); /* the segment's first page, at its base */
    memset(p, 'A', 16);
    assert_int_equal(aclrtUnmapMem(p), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReleaseMemAddress(p), ACL_ERROR_RT_PARAM_INVALID);
    aclrtDrvMemHandle h = NULL;
    aclrtPhysicalMemProp prop = hbm_prop(ACL_HBM_MEM_HUGE, 0);
    assert_int_equal(aclrtMallocPhysical(&h, PAGE, &prop, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMapMem(p + 2 * PAGE, PAGE, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID); /* a page not mapped */
    assert_int_equal(p[15], 'A');
    char *q = alloc(40 * MiB_ - 32); /* maps the next two pages, the one refused to the program too */
    assert_ptr_equal(q, p + 15 * MiB_);
    memset(q, 'B', 40 * MiB_ - 32);
    assert_int_equal(p[15], 'A');
    check();
    npualloc_cache_free(p);
    npualloc_cache_free(q);
    npualloc_cache_empty(); /* unmaps and releases all of it: nothing of the program's went */
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 1); /* h */
    assert_int_equal(c.mappings, 0);
    assert_int_equal(c.reservations, 0);
    check();
    assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
}

/* ---- the expandable_segments probe against the real runtime ---- */

static void test_probe_feature_not_supported_warns_and_turns_expandable_off(void **state)
{
    (void)state;
    /* at start-up: the 512-byte reserve fails as on a runtime without VMM */
    start_cache(GiB_, 0, "expandable_segments:True");
    assert_int_equal(npualloc_fault_set(NPUALLOC_FAULT_RESERVE, 1), ACL_SUCCESS);
    alloc(15 * MiB_); /* loads the settings: the probe runs */
    uint64_t seen, injected;
    npualloc_fault_counts(NPUALLOC_FAULT_RESERVE, &seen, &injected);
    assert_int_equal(seen, 1);
    assert_true(pop_warning_containing("expandable_segments setting failure, now change to `False`."));
    npualloc_allocator_settings st;
    assert_int_equal(npualloc_cache_get_settings(&st), ACL_SUCCESS);
    assert_false(st.expandable_segments);
    size_t total;
    assert_int_equal(snapshot_segments(false, &total), 1); /* a plain segment (15 MiB rounded to 2 MiB) */
    assert_int_equal(total, 16 * MiB_);
    /* at run time (_set_allocator_settings) */
    assert_int_equal(npualloc_fault_set(NPUALLOC_FAULT_RESERVE, 1), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_set_settings("expandable_segments:True"), ACL_SUCCESS);
    assert_true(pop_warning_containing("expandable_segments setting failure"));
    assert_int_equal(npualloc_cache_get_settings(&st), ACL_SUCCESS);
    assert_false(st.expandable_segments);
    /* supported: the probe passes */
    assert_int_equal(npualloc_cache_set_settings("expandable_segments:True"), ACL_SUCCESS);
    assert_false(npualloc_has_warnings());
    assert_int_equal(npualloc_cache_get_settings(&st), ACL_SUCCESS);
    assert_true(st.expandable_segments);
}

/* Takes device 0's whole address space; returns the number of ranges held in `held`. */
static size_t exhaust_address_space(void **held, size_t cap)
{
    size_t n = 0;
    for (size_t size = (size_t)1 << 46; size >= 2 * MiB_; size /= 2)
        while (n < cap && aclrtReserveMemAddress(&held[n], size, 0, NULL, 0) == ACL_SUCCESS)
            n++;
    void *p;
    assert_int_equal(aclrtReserveMemAddress(&p, 512, 0, NULL, 1), ACL_ERROR_RT_MEMORY_ALLOCATION);
    return n;
}

static void test_probe_other_errors_are_raised(void **state)
{
    (void)state;
    void *held[256];
    /* at run time: the error reaches the caller, the settings stay */
    start_cache(GiB_, 0, NULL);
    alloc(1);
    size_t n = exhaust_address_space(held, 256);
    assert_int_not_equal(npualloc_cache_set_settings("expandable_segments:True"), ACL_SUCCESS);
    assert_string_equal(npualloc_last_error(NULL), "NPU function error: aclrtReserveMemAddress, error code is 207001");
    assert_false(npualloc_has_warnings());
    npualloc_allocator_settings st;
    assert_int_equal(npualloc_cache_get_settings(&st), ACL_SUCCESS);
    assert_false(st.expandable_segments);
    for (size_t i = 0; i < n; i++)
        assert_int_equal(aclrtReleaseMemAddress(held[i]), ACL_SUCCESS);
    /* at start-up: every use of the allocator fails with it */
    start_cache(GiB_, 0, "expandable_segments:True");
    n = exhaust_address_space(held, 256);
    void *p = NULL;
    assert_int_not_equal(npualloc_cache_malloc(0, 100, 0, &p), ACL_SUCCESS);
    assert_string_equal(npualloc_last_error(NULL), "NPU function error: aclrtReserveMemAddress, error code is 207001");
    for (size_t i = 0; i < n; i++)
        assert_int_equal(aclrtReleaseMemAddress(held[i]), ACL_SUCCESS);
}

/* ---- sizes of expandable segments ---- */

static expandable_segment *only_segment(void)
{
    device_cache *dc = cache_device(0);
    assert_non_null(dc);
    assert_non_null(dc->expandable_segments);
    assert_null(dc->expandable_segments->next);
    return dc->expandable_segments;
}

static void test_reserved_range_is_nine_eighths_of_the_device(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    alloc(15 * MiB_);
    expandable_segment *es = only_segment();
    /* ceil((1 GiB + 1 GiB / 8) / 20 MiB) = ceil(1152 / 20) = 58 pages of 20 MiB */
    assert_int_equal(es->page_size, 20 * MiB_);
    assert_int_equal(es->pages, 58);
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.reservations, 1);
    start_cache(GiB_, 0, "expandable_segments:True");
    alloc(1000); /* the small pool: 1152 MiB / 2 MiB = 576 pages */
    es = only_segment();
    assert_int_equal(es->page_size, 2 * MiB_);
    assert_int_equal(es->pages, 576);
}

static void test_segment_sizes_set_the_large_page(void **state)
{
    (void)state;
    static const struct {
        const char *conf;
        size_t page;
    } cases[] = {{"expandable_segments:True", 20 * MiB_},
                 {"expandable_segments:True,large_segment_size_mb:32", 32 * MiB_},
                 {"expandable_segments:True,segment_size_mb:64", 64 * MiB_}};
    for (size_t i = 0; i < ARRAY_LEN_(cases); i++) {
        start_cache(GiB_, 0, cases[i].conf);
        alloc(15 * MiB_ - 32);
        assert_int_equal(only_segment()->page_size, cases[i].page);
        assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, cases[i].page); /* one page */
        alloc(MiB_ / 2);
        assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_SMALL_POOL].current, 2 * MiB_); /* small: 2 MiB */
        check();
    }
}

/* A large-pool page off the 2 MiB physical granularity (11 MiB) is refused as aclrtMallocPhysical refuses it:
 * every large allocation fails with its error at the first page (the first page used to map, and the second
 * failed at an address off the granularity), and the small pool's 2 MiB pages still serve. */
static void test_large_pages_off_the_granularity_are_refused_at_the_first(void **state)
{
    (void)state;
    static const struct {
        const char *conf;
        const char *message; /* it names the page, not a segment */
    } cases[] = {{"expandable_segments:True,large_segment_size_mb:11",
                  "NPU error: mapping a 11534336-byte page of an expandable segment on device 0 failed with ACL error "
                  "107000"},
                 {"expandable_segments:True,segment_size_mb:21",
                  "NPU error: mapping a 22020096-byte page of an expandable segment on device 0 failed with ACL error "
                  "107000"}};
    for (size_t i = 0; i < ARRAY_LEN_(cases); i++) {
        start_cache(GiB_, 0, cases[i].conf);
        void *p = NULL;
        assert_int_equal(npualloc_cache_malloc(0, 2 * MiB_, 0, &p), ACL_ERROR_RT_PARAM_INVALID);
        assert_int_equal(npualloc_cache_malloc(0, 30 * MiB_, 0, &p), ACL_ERROR_RT_PARAM_INVALID);
        npualloc_error_kind kind;
        assert_string_equal(npualloc_last_error(&kind), cases[i].message);
        assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_LARGE_POOL].current, 0);
        alloc(MiB_ / 2);
        assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_SMALL_POOL].current, 2 * MiB_);
        check();
    }
}

static void test_page_size_1g_overrides_segment_sizes(void **state)
{
    (void)state;
    start_cache(8 * GiB_, 2 * GiB_, "expandable_segments:True,page_size:1g,large_segment_size_mb:32");
    alloc(15 * MiB_); /* loads the settings */
    assert_true(pop_warning_containing("`page_size:1g` is set, which will override"));
    assert_int_equal(only_segment()->page_size, GiB_);
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, GiB_);
    check();
    /* plain segments too: a 5 MiB request gets a 1 GiB segment, not 32 MiB */
    start_cache(8 * GiB_, 2 * GiB_, "page_size:1g,large_segment_size_mb:32");
    alloc(5 * MiB_);
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_LARGE_POOL].current, GiB_);
    check();
}

static void test_empty_cache_waits_for_stream_work_before_unmapping(void **state)
{
    (void)state;
    start_cache(GiB_, 0, "expandable_segments:True");
    char *p = alloc(15 * MiB_);
    /* Work still queued on the stream writes the block after it is freed. */
    assert_int_equal(npualloc_sleep_async(NULL, 0.3), ACL_SUCCESS);
    assert_int_equal(aclrtMemsetAsync(p, 15 * MiB_, 0x5A, 15 * MiB_, NULL), ACL_SUCCESS);
    npualloc_cache_free(p);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    npualloc_cache_empty();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double waited = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    assert_true(waited >= 0.25); /* it synchronized... */
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS); /* ...so the memset ran on mapped memory */
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 0); /* and then unmapped */
    check();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_one_segment_grows_page_by_page, stop_cache),
        cmocka_unit_test_teardown(test_small_pool_uses_2mib_pages, stop_cache),
        cmocka_unit_test_teardown(test_huge_raw_alloc_is_an_ordinary_oom, stop_cache),
        cmocka_unit_test_teardown(test_empty_cache_unmaps_exactly_the_fully_free_pages, stop_cache),
        cmocka_unit_test_teardown(test_one_map_released_in_two_parts_counts_two_device_frees, stop_cache),
        cmocka_unit_test_teardown(test_empty_virt_addr_cache_keeps_physical_pages, stop_cache),
        cmocka_unit_test_teardown(test_map_without_host_memory_keeps_the_kept_pages, stop_cache),
        cmocka_unit_test_teardown(test_map_failing_on_the_device_keeps_the_kept_pages, stop_cache),
        cmocka_unit_test_teardown(test_base_addr_aligned_kb, stop_cache),
        cmocka_unit_test_teardown(test_base_addr_aligned_kb_needs_expandable, stop_cache),
        cmocka_unit_test_teardown(test_page_size_1g_uses_the_1g_pool, stop_cache),
        cmocka_unit_test_teardown(test_page_size_1g_without_1g_pages_warns_and_falls_back, stop_cache),
        cmocka_unit_test_teardown(test_page_size_1g_expandable_maps_1g_pages, stop_cache),
        cmocka_unit_test_teardown(test_option_conflicts_fail_with_torch_npu_messages, stop_cache),
        cmocka_unit_test_teardown(test_release_cached_blocks_with_expandable_blocks_free, stop_cache),
        cmocka_unit_test_teardown(test_garbage_collection_skips_expandable_blocks, stop_cache),
        cmocka_unit_test_teardown(test_turning_expandable_off_skips_expandable_blocks, stop_cache),
        cmocka_unit_test_teardown(test_history_records_map_and_unmap, stop_cache),
        cmocka_unit_test_teardown(test_probe_feature_not_supported_warns_and_turns_expandable_off, stop_cache),
        cmocka_unit_test_teardown(test_probe_other_errors_are_raised, stop_cache),
        cmocka_unit_test_teardown(test_reserved_range_is_nine_eighths_of_the_device, stop_cache),
        cmocka_unit_test_teardown(test_segment_sizes_set_the_large_page, stop_cache),
        cmocka_unit_test_teardown(test_page_size_1g_overrides_segment_sizes, stop_cache),
        cmocka_unit_test_teardown(test_large_pages_off_the_granularity_are_refused_at_the_first, stop_cache),
        cmocka_unit_test_teardown(test_empty_cache_waits_for_stream_work_before_unmapping, stop_cache),
        cmocka_unit_test_teardown(test_private_pool_counts_its_expandable_segments, stop_cache),
        cmocka_unit_test_teardown(test_empty_cache_releases_segments_with_nothing_mapped, stop_cache),
        cmocka_unit_test_teardown(test_expandable_segment_keeps_its_allocation_context, stop_cache),
        cmocka_unit_test_teardown(test_unmap_without_host_memory_for_the_split_leaves_the_block_mapped, stop_cache),
        cmocka_unit_test_teardown(test_random_operations_with_expandable_segments, stop_cache),
        cmocka_unit_test_teardown(test_user_cannot_unmap_release_or_map_a_segments_range, stop_cache),
    };
    return cmocka_run_group_tests_name("expandable", tests, NULL, NULL);
}
