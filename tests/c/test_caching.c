/* test_caching.c - the caching allocator, rule by rule with exact numbers, and a randomized
 * sequence checked by the invariant checker after every step. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "caching.h"
#include "host.h"
#include "stream.h"
#include "testutil.h"

static void start_cache(uint64_t hbm, const char *conf)
{
    if (conf)
        setenv("PYTORCH_NPU_ALLOC_CONF", conf, 1);
    else
        unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
    start_runtime(2, hbm, hbm, 0, 0);
}

static int stop_cache(void **state)
{
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    return stop_runtime(state);
}

static void check(void)
{
    char why[512] = "";
    aclError rc = npualloc_cache_check(0, why, sizeof why);
    if (rc != ACL_SUCCESS)
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

#define ALL NPUALLOC_STAT_ALL
#define SMALL NPUALLOC_STAT_SMALL_POOL
#define LARGE NPUALLOC_STAT_LARGE_POOL

static void test_round_size_pads_and_rounds(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    alloc(1); /* loads the settings */
    assert_int_equal(cache_round_size(&cache_settings, K_PAD_SIZE, 1), 512);
    assert_int_equal(cache_round_size(&cache_settings, K_PAD_SIZE, 480), 512);  /* 480 + 32 = 512 */
    assert_int_equal(cache_round_size(&cache_settings, K_PAD_SIZE, 481), 1024);
    assert_int_equal(cache_round_size(&cache_settings, K_PAD_SIZE, MiB_ - 32), MiB_);
    assert_int_equal(cache_round_size(&cache_settings, K_PAD_SIZE, MiB_), MiB_ + 512);
}

static void test_roundup_power2_divisions(void **state)
{
    (void)state;
    start_cache(GiB_, "roundup_power2_divisions:4");
    alloc(1);
    /* 1200 + 32 = 1232 is not above 512 * 4: plain 512 rounding. */
    assert_int_equal(cache_round_size(&cache_settings, K_PAD_SIZE, 1200), 1536);
    /* 9000 + 32 = 9032: the next quarter of 8192 is 10240 (512 rounding would give 9216). */
    assert_int_equal(cache_round_size(&cache_settings, K_PAD_SIZE, 9000), 10240);
    /* 84 MiB with 4 divisions rounds to 96 MiB. */
    assert_int_equal(cache_round_size(&cache_settings, K_PAD_SIZE, 84 * MiB_), 96 * MiB_);
    assert_int_equal(cache_round_size(&cache_settings, K_PAD_SIZE, 64 * MiB_ - 32), 64 * MiB_); /* a power of two stays */
}

static void test_small_requests_share_a_2mib_segment(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    char *a = alloc(1), *b = alloc(1000);
    assert_ptr_equal(b, a + 512); /* best fit: the front of the remainder */
    npualloc_stats s = stats();
    assert_int_equal(s.segment[SMALL].current, 1);
    assert_int_equal(s.segment[LARGE].current, 0);
    assert_int_equal(s.reserved_bytes[ALL].current, 2 * MiB_);
    assert_int_equal(s.allocated_bytes[ALL].current, 512 + 1536);
    assert_int_equal(s.requested_bytes[ALL].current, 1001);
    assert_int_equal(s.inactive_split[SMALL].current, 1);
    assert_int_equal(s.inactive_split_bytes[SMALL].current, 2 * MiB_ - 2048);
    check();
}

static void test_large_pool_segment_sizes(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    alloc(10 * MiB_); /* 10 MiB + 512: a 12 MiB segment (2 MiB rounding from 10 MiB up) */
    npualloc_stats s = stats();
    assert_int_equal(s.segment[LARGE].current, 1);
    assert_int_equal(s.reserved_bytes[LARGE].current, 12 * MiB_);
    assert_int_equal(s.inactive_split_bytes[LARGE].current, 2 * MiB_ - 512); /* split: rest > 1 MiB */
    alloc(MiB_); /* 1 MiB + 512 fits that rest, whole: what would remain is not over 1 MiB */
    assert_int_equal(stats().segment[LARGE].current, 1);
    alloc(5 * MiB_); /* below 10 MiB: a 20 MiB segment */
    s = stats();
    assert_int_equal(s.segment[LARGE].current, 2);
    assert_int_equal(s.reserved_bytes[LARGE].current, 32 * MiB_);
    assert_int_equal(s.allocated_bytes[LARGE].current, 10 * MiB_ + 512 + (2 * MiB_ - 512) + 5 * MiB_ + 512);
    check();
}

static void test_large_remainder_of_one_mib_is_not_split(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    void *a = alloc(19 * MiB_ + 512); /* rounds to 19 MiB + 1024: one 20 MiB segment */
    assert_int_equal(npualloc_cache_free(a), ACL_SUCCESS);
    /* The cached 20 MiB block serves 19 MiB: the 1 MiB - 512 rest is too small to split off. */
    void *b = alloc(19 * MiB_ - 32);
    assert_ptr_equal(a, b);
    npualloc_stats s = stats();
    assert_int_equal(s.allocated_bytes[LARGE].current, 20 * MiB_);
    assert_int_equal(s.inactive_split[LARGE].current, 0);
    check();
}

static void test_free_merges_neighbours(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    void *a = alloc(1000), *b = alloc(1000), *c = alloc(1000);
    (void)c;
    npualloc_cache_free(a);
    npualloc_stats s = stats();
    assert_int_equal(s.inactive_split[SMALL].current, 2); /* a, and the segment's tail */
    npualloc_cache_free(b); /* merges with a (1000 + 32 bytes round to 1536) */
    s = stats();
    assert_int_equal(s.inactive_split[SMALL].current, 2);
    assert_int_equal(s.inactive_split_bytes[SMALL].current, 2 * MiB_ - 1536);
    check();
    npualloc_cache_free(c); /* the whole segment is one free block again */
    s = stats();
    assert_int_equal(s.inactive_split[SMALL].current, 0);
    assert_int_equal(s.active[ALL].current, 0);
    check();
    npualloc_cache_empty();
    assert_int_equal(stats().reserved_bytes[ALL].current, 0);
    assert_int_equal(stats().num_device_free, 1);
}

static void test_cached_only_allocation_serves_hits_and_leaves_misses(void **state)
{
    (void)state;
    void *p = NULL;
    assert_false(npualloc_cache_malloc_cached(0, 4096, 0, NULL, &p)); /* not started yet */
    start_cache(GiB_, NULL);
    assert_false(npualloc_cache_malloc_cached(0, 4096, 0, NULL, &p)); /* nothing cached */
    assert_null(p);
    npualloc_stats before = stats();
    assert_int_equal(before.num_device_alloc, 0);
    void *a = alloc(4096);
    npualloc_cache_free(a);
    before = stats();
    assert_true(npualloc_cache_malloc_cached(0, 4096, 0, NULL, &p));
    assert_ptr_equal(p, a); /* the same best fit as npualloc_cache_malloc */
    npualloc_stats after = stats();
    assert_int_equal(after.num_device_alloc, before.num_device_alloc);
    assert_int_equal(after.allocation[SMALL].current, 1);
    assert_int_equal(after.requested_bytes[ALL].current, 4096);
    check();
    /* a size the cache cannot serve: false, and nothing changed */
    void *q = NULL;
    before = stats();
    assert_false(npualloc_cache_malloc_cached(0, 64 * MiB_, 0, NULL, &q));
    assert_null(q);
    after = stats();
    assert_int_equal(after.num_device_alloc, before.num_device_alloc);
    assert_int_equal(after.allocation[ALL].current, before.allocation[ALL].current);
    assert_false(npualloc_cache_malloc_cached(0, 0, 0, NULL, &q));
    assert_false(npualloc_cache_malloc_cached(7, 4096, 0, NULL, &q)); /* no such device */
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
    check();
}

static void test_acl_free_refuses_the_allocators_segments(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    char *p = alloc(3000); /* the base of a 2 MiB segment */
    assert_int_equal(aclrtFree(p), ACL_ERROR_RT_MEMORY_FREE);
    memset(p, 0x5a, 3000); /* still mapped: the allocator owns it */
    check();
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
    npualloc_cache_empty();
    assert_int_equal(stats().reserved_bytes[ALL].current, 0);
    void *user = NULL; /* and aclrtMalloc memory is still the user's to free */
    assert_int_equal(aclrtMalloc(&user, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtFree(user), ACL_SUCCESS);
}

static void test_best_fit_prefers_smallest_then_lowest_address(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    char *a = alloc(4000), *sep1 = alloc(100), *b = alloc(2000), *sep2 = alloc(100), *c = alloc(2000);
    (void)sep1;
    (void)sep2;
    alloc(100); /* keeps c from merging with the segment's tail */
    npualloc_cache_free(a);
    npualloc_cache_free(c);
    npualloc_cache_free(b);
    /* Free holes of 4096, 2048, 2048 bytes: a 1500-byte request takes the lower 2048 one. */
    assert_ptr_equal(alloc(1500), b);
    assert_ptr_equal(alloc(1500), c);
    assert_ptr_equal(alloc(1500), a);
    check();
}

static void test_streams_do_not_share_cached_blocks(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    aclrtStream s1;
    assert_int_equal(aclrtCreateStream(&s1), ACL_SUCCESS);
    void *a = alloc(1000);
    npualloc_cache_free(a);
    void *b = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 1000, (uint64_t)(uintptr_t)s1, &b), ACL_SUCCESS);
    assert_ptr_not_equal(a, b); /* a's segment belongs to the default stream */
    assert_int_equal(stats().segment[SMALL].current, 2);
    npualloc_cache_free(b);
    check();
    aclrtDestroyStream(s1);
}

static void test_max_split_size_oversize_rules(void **state)
{
    (void)state;
    start_cache(GiB_, "max_split_size_mb:64");
    assert_int_equal(stats().max_split_size, 64 * (int64_t)MiB_);
    void *big = alloc(100 * MiB_ - 32); /* exactly 100 MiB: an oversize segment */
    npualloc_stats s = stats();
    assert_int_equal(s.oversize_segments.current, 1);
    assert_int_equal(s.oversize_allocations.current, 1);
    npualloc_cache_free(big);
    /* A request below max_split never takes an oversize block. */
    void *small = alloc(30 * MiB_);
    assert_ptr_not_equal(small, big);
    /* A large request takes it only if the block is less than 20 MiB larger. */
    void *b70 = alloc(70 * MiB_);
    assert_ptr_not_equal(b70, big);
    void *b90 = alloc(90 * MiB_);
    assert_ptr_equal(b90, big); /* 100 < 90 + 0.5 KiB + 20 MiB, and oversize blocks are never split */
    /* 30 MiB + 512 split from a 32 MiB segment; 70 MiB + 512 takes a whole 72 MiB oversize one. */
    s = stats();
    assert_int_equal(s.allocated_bytes[LARGE].current, 100 * MiB_ + 30 * MiB_ + 512 + 72 * MiB_);
    check();
}

static void test_large_segment_size_mb_sets_the_segment_for_mid_requests(void **state)
{
    (void)state;
    start_cache(GiB_, "large_segment_size_mb:32");
    char *p[6];
    for (int i = 0; i < 6; i++) /* 5 MiB + 512 each: six fit one 32 MiB segment (three fit 20 MiB) */
        p[i] = alloc(5 * MiB_);
    npualloc_stats s = stats();
    assert_int_equal(s.num_device_alloc, 1);
    assert_int_equal(s.segment[LARGE].current, 1);
    assert_int_equal(s.reserved_bytes[LARGE].current, 32 * MiB_);
    for (int i = 1; i < 6; i++)
        assert_ptr_equal(p[i], p[i - 1] + 5 * MiB_ + 512);
    alloc(12 * MiB_); /* 10 MiB or more: rounded to 2 MiB as always (14 MiB), not 32 */
    assert_int_equal(stats().reserved_bytes[LARGE].current, 32 * MiB_ + 14 * MiB_);
    alloc(MiB_ - 32); /* the small pool keeps its 2 MiB segments */
    assert_int_equal(stats().reserved_bytes[SMALL].current, 2 * MiB_);
    check();
    /* the default: a 20 MiB segment for the same request */
    start_cache(GiB_, NULL);
    alloc(5 * MiB_);
    assert_int_equal(stats().reserved_bytes[LARGE].current, 20 * MiB_);
}

/* An 80 MiB oversize block cached, then 45 MiB asked for (max_split 40 MiB): torch's get_free_block
 * accepts the block only if it is smaller than request + max_non_split_rounding_size. */
static void max_non_split_case(const char *conf, bool reused)
{
    start_cache(GiB_, conf);
    char *big = alloc(80 * MiB_ - 32);
    npualloc_cache_free(big);
    char *p = alloc(45 * MiB_ - 32);
    npualloc_stats s = stats();
    if (reused) { /* 80 < 45 + 40: served whole (an oversize block is never split) */
        assert_ptr_equal(p, big);
        assert_int_equal(s.num_device_alloc, 1);
        assert_int_equal(s.allocated_bytes[LARGE].current, 80 * MiB_);
    } else { /* 80 >= 45 + 20: a new 46 MiB segment */
        assert_ptr_not_equal(p, big);
        assert_int_equal(s.num_device_alloc, 2);
        assert_int_equal(s.allocated_bytes[LARGE].current, 46 * MiB_);
    }
    check();
}

static void test_max_non_split_rounding_mb_widens_oversize_reuse(void **state)
{
    (void)state;
    max_non_split_case("max_split_size_mb:40,max_non_split_rounding_mb:40", true);
    assert_int_equal(cache_settings.max_non_split_rounding_size, 40 * MiB_);
    max_non_split_case("max_split_size_mb:40", false);
    assert_int_equal(cache_settings.max_non_split_rounding_size, 20 * MiB_);
}

/* ---- free-memory callbacks ---- */

static void *callback_frees;      /* the block the callback gives back, or NULL */
static bool callback_armed;
static int callback_calls;
static npualloc_stats callback_saw; /* the stats while the callback ran */

static bool free_some_memory(void)
{
    if (!callback_armed)
        return false;
    callback_calls++;
    /* No allocator lock is held: the allocator can be used from here. */
    assert_int_equal(npualloc_cache_get_stats(0, &callback_saw), ACL_SUCCESS);
    if (!callback_frees)
        return false;
    assert_int_equal(npualloc_cache_free(callback_frees), ACL_SUCCESS);
    callback_frees = NULL;
    return true;
}

static bool frees_nothing(void) { return false; }

static void test_free_memory_callbacks_run_before_the_device_is_asked(void **state)
{
    (void)state;
    start_cache(64 * MiB_, NULL);
    assert_int_equal(npualloc_cache_add_free_memory_callback(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_add_free_memory_callback(free_some_memory), ACL_SUCCESS);
    char *held = alloc(40 * MiB_ - 32); /* the memory an extension still holds */
    callback_armed = true;
    callback_calls = 0;
    /* A cache hit never runs the callbacks. */
    npualloc_cache_free(alloc(MiB_ / 2));
    void *small = alloc(MiB_ / 2);
    assert_int_equal(callback_calls, 1); /* only the first (a miss) ran them */
    npualloc_cache_free(small);
    /* 40 MiB more does not fit the 64 MiB device: the callback frees `held`, the cache is
     * searched again and serves the request, before any device allocation, release or retry. */
    callback_calls = 0;
    callback_frees = held;
    void *again = alloc(40 * MiB_ - 32);
    assert_ptr_equal(again, held);
    assert_int_equal(callback_calls, 1);
    assert_int_equal(callback_saw.num_device_alloc, 2); /* 40 MiB + the small pool's 2 MiB so far */
    npualloc_stats s = stats();
    assert_int_equal(s.num_device_alloc, 2);
    assert_int_equal(s.num_alloc_retries, 0);
    assert_int_equal(s.num_ooms, 0);
    assert_int_equal(s.reserved_bytes[LARGE].current, 40 * MiB_);
    /* A callback that frees nothing: the allocator goes on to the device (and to an OOM here,
     * after its retry), the callback having run first. */
    callback_calls = 0;
    void *p = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 40 * MiB_ - 32, 0, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(callback_calls, 1);
    assert_int_equal(callback_saw.num_alloc_retries, 0);
    assert_int_equal(callback_saw.num_ooms, 0);
    assert_int_equal(stats().num_ooms, 1);
    callback_armed = false;
    check();
    /* At most 8 callbacks. */
    for (int i = 1; i < 8; i++)
        assert_int_equal(npualloc_cache_add_free_memory_callback(frees_nothing), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_add_free_memory_callback(frees_nothing), ACL_ERROR_INVALID_PARAM);
}

/* ---- the checker itself ---- */

static void expect_check_failure(device_cache *dc, const char *want)
{
    char why[512] = "";
    assert_int_equal(cache_check_locked(dc, why, sizeof why), ACL_ERROR_INTERNAL_ERROR);
    if (!strstr(why, want))
        fail_msg("checker said \"%s\", expected \"%s\"", why, want);
}

static void test_checker_reports_broken_invariants(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    char *a = alloc(5 * MiB_), *b = alloc(5 * MiB_); /* one 20 MiB segment: a, b, free rest */
    assert_ptr_equal(b, a + 5 * MiB_ + 512);
    device_cache *dc = cache_device(0);
    assert_non_null(dc);
    cache_lock_acquire(&dc->lock);
    cache_block *ba = ptr_map_get(&dc->allocated_blocks, (uintptr_t)a);
    cache_block *bb = ptr_map_get(&dc->allocated_blocks, (uintptr_t)b);
    cache_block *rest = bb->next;
    assert_non_null(ba);
    assert_ptr_equal(ba->next, bb);
    assert_non_null(rest);
    char why[512] = "";
    assert_int_equal(cache_check_locked(dc, why, sizeof why), ACL_SUCCESS);

    /* a stat that disagrees with the blocks (the all-pools entry is the sum of the two pools) */
    dc->stats.allocated_bytes[NPUALLOC_STAT_LARGE_POOL].current += 512;
    expect_check_failure(dc, "stat allocated_bytes[0].current");
    dc->stats.allocated_bytes[NPUALLOC_STAT_LARGE_POOL].current -= 512;

    /* a broken link */
    rest->prev = NULL;
    expect_check_failure(dc, "next/prev links disagree");
    rest->prev = bb;

    /* broken tiling: a block that does not start where its predecessor ends */
    bb->ptr += 512;
    expect_check_failure(dc, "does not start where its predecessor ends");
    bb->ptr -= 512;

    /* two free neighbours left unmerged: b looks free (and pooled) next to the free rest */
    bb->allocated = false;
    bb->in_pool = true;
    expect_check_failure(dc, "were not merged");
    bb->allocated = true;
    bb->in_pool = false;

    /* a free block missing from its pool */
    rest->in_pool = false;
    expect_check_failure(dc, "in pool 0 but free 1");
    rest->in_pool = true;

    /* the reserved total */
    dc->total_allocated_memory += 2 * MiB_;
    expect_check_failure(dc, "reserved memory");
    dc->total_allocated_memory -= 2 * MiB_;

    assert_int_equal(cache_check_locked(dc, why, sizeof why), ACL_SUCCESS); /* restored */
    cache_lock_release(&dc->lock);
    npualloc_cache_free(a);
    npualloc_cache_free(b);
    check();
}

static void test_release_available_releases_one_large_enough_oversize_block(void **state)
{
    (void)state;
    start_cache(256 * MiB_, "max_split_size_mb:64");
    void *a = alloc(200 * MiB_ - 32), *keep = alloc(40 * MiB_ - 32);
    (void)keep;
    npualloc_cache_free(a);
    /* 150 MiB: the cached 200 MiB block is 20 MiB too large to reuse, 16 MiB are free:
     * exactly that block goes back, no retry. */
    void *b = alloc(150 * MiB_ - 32);
    npualloc_stats s = stats();
    assert_ptr_not_equal(b, NULL);
    assert_int_equal(s.num_device_free, 1);
    assert_int_equal(s.num_alloc_retries, 0);
    assert_int_equal(s.reserved_bytes[ALL].current, 190 * MiB_);
    check();
}

static void test_release_available_walks_largest_first(void **state)
{
    (void)state;
    start_cache(256 * MiB_, "max_split_size_mb:64");
    void *a = alloc(100 * MiB_ - 32), *b = alloc(100 * MiB_ - 32);
    npualloc_cache_free(a);
    npualloc_cache_free(b);
    /* 200 MiB cached, 56 MiB free: none of the cached blocks is 120 MiB, so the largest go,
     * top down, until 120 MiB were released (both). */
    void *c = alloc(120 * MiB_ - 32);
    npualloc_stats s = stats();
    assert_int_equal(s.num_alloc_retries, 0);
    assert_int_equal(s.num_device_free, 2);
    assert_int_equal(s.reserved_bytes[ALL].current, 120 * MiB_);
    /* Not enough oversize memory cached: what was released stays released, then the last resort. */
    npualloc_cache_free(c);
    void *d = alloc(150 * MiB_ - 32); /* 136 free + 120 cached, less than 150 + ... */
    (void)d;
    s = stats();
    assert_int_equal(s.num_device_free, 3);
    assert_int_equal(s.num_alloc_retries, 1);
    assert_int_equal(s.reserved_bytes[ALL].current, 150 * MiB_);
    check();
}

static void test_last_resort_releases_everything_and_counts_a_retry(void **state)
{
    (void)state;
    start_cache(64 * MiB_, NULL);
    void *a = alloc(12 * MiB_ - 32), *b = alloc(12 * MiB_ - 32), *c = alloc(12 * MiB_ - 32);
    npualloc_cache_free(a);
    npualloc_cache_free(b);
    npualloc_cache_free(c);
    /* 36 MiB cached in three 12 MiB segments; 28 MiB free: 40 MiB needs the cache back. */
    void *d = alloc(40 * MiB_ - 32);
    assert_non_null(d);
    npualloc_stats s = stats();
    assert_int_equal(s.num_alloc_retries, 1);
    assert_int_equal(s.num_sync_all_streams, 1);
    assert_int_equal(s.segment[ALL].current, 1);
    assert_int_equal(s.num_device_free, 3);
    check();
}

static void test_out_of_memory_message_and_counters(void **state)
{
    (void)state;
    start_cache(64 * MiB_, NULL);
    void *a = alloc(30 * MiB_ - 32);
    void *p = NULL;
    aclError rc = npualloc_cache_malloc(0, 40 * MiB_ - 32, 0, &p);
    assert_int_equal(rc, ACL_ERROR_RT_MEMORY_ALLOCATION);
    npualloc_error_kind kind;
    const char *msg = npualloc_last_error(&kind);
    assert_int_equal(kind, NPUALLOC_ERR_OOM);
    assert_string_equal(msg, "NPU out of memory. Tried to allocate 40.00 MiB (NPU 0; 64.00 MiB total capacity; "
                             "30.00 MiB already allocated; 30.00 MiB current active; 34.00 MiB free; 30.00 MiB "
                             "reserved in total by PyTorch).If reserved memory is >> allocated memory try setting "
                             "max_split_size_mb to avoid fragmentation.");
    npualloc_oom_info info;
    npualloc_cache_last_oom(&info);
    assert_int_equal(info.alloc_size, 40 * MiB_);
    assert_int_equal(info.device_free, 34 * MiB_);
    npualloc_stats s = stats();
    assert_int_equal(s.num_ooms, 1);
    assert_int_equal(s.num_alloc_retries, 1);
    /* 1 EB or more: allocate()'s own message, no counters; raw_alloc has no such check (its OOM is the
     * ordinary one) up to sizes torch_npu's arithmetic would wrap. */
    rc = npualloc_allocate(0, (size_t)1 << 60, 0, &p);
    assert_int_equal(rc, ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_string_equal(npualloc_last_error(NULL), "NPU out of memory. Tried to allocate more than 1EB memory.");
    assert_int_equal(stats().num_ooms, 1);
    rc = npualloc_cache_malloc(0, SIZE_MAX, 0, &p);
    assert_int_equal(rc, ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_string_equal(npualloc_last_error(NULL), "NPU out of memory. Tried to allocate more than 1EB memory.");
    assert_int_equal(stats().num_ooms, 1);
    rc = npualloc_cache_malloc(0, (size_t)1 << 60, 0, &p);
    assert_int_equal(rc, ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_non_null(strstr(npualloc_last_error(NULL), "Tried to allocate 1073741824.00 GiB (NPU 0; "));
    npualloc_cache_last_oom(&info);
    assert_int_equal(info.alloc_size, ((size_t)1 << 60) + 2 * MiB_);
    assert_int_equal(stats().num_ooms, 2);
    npualloc_cache_free(a);
    check();
}

static void test_fraction_is_enforced_on_reserved_memory(void **state)
{
    (void)state;
    start_cache(100 * MiB_, NULL);
    assert_int_equal(npualloc_cache_set_fraction(0, 0.5), ACL_SUCCESS);
    double f = 0;
    assert_int_equal(npualloc_cache_get_fraction(0, &f), ACL_SUCCESS);
    assert_true(f == 0.5);
    void *a = alloc(50 * MiB_ - 32); /* exactly the allowed 50 MiB */
    void *p = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 1, 0, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_non_null(strstr(npualloc_last_error(NULL), "; 50.00 MiB allowed; 50.00 MiB reserved in total"));
    npualloc_cache_free(a);
    /* Cached blocks are reused freely within the limit. */
    assert_ptr_equal(alloc(50 * MiB_ - 32), a);
    assert_int_equal(npualloc_cache_set_fraction(0, 1.5), ACL_ERROR_INVALID_PARAM);
    assert_string_equal(npualloc_last_error(NULL), "invalid fraction:1.5. Please set within [0, 1].");
    check();
}

static void test_garbage_collection_frees_oldest_segments_first(void **state)
{
    (void)state;
    start_cache(GiB_, "garbage_collection_threshold:0.9");
    /* 512 MiB allowed; collection starts above 0.9 of it (460.8 MiB). */
    assert_int_equal(npualloc_cache_set_fraction(0, 0.5), ACL_SUCCESS);
    void *old = alloc(100 * MiB_ - 32), *mid = alloc(100 * MiB_ - 32), *young = alloc(100 * MiB_ - 32);
    void *w = alloc(150 * MiB_ - 32), *hot = alloc(5 * MiB_); /* 470 MiB reserved */
    (void)w;
    /* Each search of the large pool ages every cached block of it by one; reusing "hot"
     * searches without missing, so nothing is collected yet. */
    npualloc_cache_free(old);
    for (int i = 0; i < 2; i++) {
        npualloc_cache_free(hot);
        hot = alloc(5 * MiB_);
    }
    npualloc_cache_free(mid);
    npualloc_cache_free(hot);
    hot = alloc(5 * MiB_);
    npualloc_cache_free(young);
    npualloc_cache_free(hot);
    hot = alloc(5 * MiB_); /* ages: old 4, mid 2, young 1 */
    assert_int_equal(stats().num_device_free, 0);
    /* A miss above the threshold: ages 5, 3, 2 (average 3.33): only old goes, which is enough. */
    void *z = alloc(120 * MiB_ - 32);
    (void)z;
    npualloc_stats s = stats();
    assert_int_equal(s.num_device_free, 1);
    assert_int_equal(s.reserved_bytes[ALL].current, 490 * MiB_);
    assert_ptr_equal(alloc(100 * MiB_ - 32), mid); /* mid and young are still cached */
    assert_ptr_equal(alloc(100 * MiB_ - 32), young);
    check();
}

/* The Python faces try the cache alone first and call the full allocation only on a miss
 * (memory_py.c): one allocation, so one search of the pool for the garbage collector's ages. */
static void *alloc_cached_first(size_t size)
{
    void *p = NULL;
    if (!npualloc_cache_malloc_cached(0, size, 0, NULL, &p))
        p = alloc(size);
    return p;
}

static void test_garbage_collection_ages_count_a_miss_once_through_the_cached_path(void **state)
{
    (void)state;
    start_cache(GiB_, "garbage_collection_threshold:0.9");
    assert_int_equal(npualloc_cache_set_fraction(0, 0.5), ACL_SUCCESS); /* collects above 460.8 MiB */
    void *old = alloc_cached_first(100 * MiB_ - 32), *mid = alloc_cached_first(100 * MiB_ - 32);
    void *young = alloc_cached_first(100 * MiB_ - 32), *hot = alloc_cached_first(5 * MiB_); /* 320 MiB */
    npualloc_cache_free(old);
    void *w = alloc_cached_first(150 * MiB_ - 32); /* a miss below the threshold: 470 MiB */
    (void)w;
    npualloc_cache_free(mid);
    npualloc_cache_free(hot);
    hot = alloc_cached_first(5 * MiB_); /* a hit */
    npualloc_cache_free(young);
    assert_int_equal(stats().num_device_free, 0);
    /* A miss above the threshold, counted once as in torch_npu: ages old 3, mid 2, young 1, so old
     * and mid are at least the average (counting each miss twice gave 5, 3, 2: old alone). */
    void *z = alloc_cached_first(120 * MiB_ - 32);
    (void)z;
    npualloc_stats s = stats();
    assert_int_equal(s.num_device_free, 2);
    assert_int_equal(s.reserved_bytes[ALL].current, (470 - 200 + 120) * (int64_t)MiB_);
    assert_ptr_equal(alloc_cached_first(100 * MiB_ - 32), young); /* young is still cached */
    check();
}

static void test_record_stream_delays_reuse_until_stream_work_ran(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    aclrtStream side;
    assert_int_equal(aclrtCreateStream(&side), ACL_SUCCESS);
    void *a = alloc(1000);
    assert_int_equal(npualloc_cache_record_stream(a, (uint64_t)(uintptr_t)side), ACL_SUCCESS);
    assert_int_equal(npualloc_sleep_async(side, 0.2), ACL_SUCCESS); /* work on the side stream */
    npualloc_cache_free(a);
    npualloc_stats s = stats();
    assert_int_equal(s.allocation[ALL].current, 0);
    assert_int_equal(s.active[ALL].current, 1); /* pending: the side stream may still use it */
    void *b = alloc(1000);
    assert_ptr_not_equal(a, b);
    /* Only an allocated block has uses to erase: a freed one waiting for its events is not. */
    assert_int_equal(npualloc_cache_erase_stream(a, (uint64_t)(uintptr_t)side), ACL_ERROR_INVALID_PARAM);
    check();
    assert_int_equal(aclrtSynchronizeStream(side), ACL_SUCCESS);
    npualloc_cache_free(b);
    void *c = alloc(1000); /* the event passed: a's block is free and first in address order */
    assert_ptr_equal(c, a);
    check();
    /* erase_stream forgets a recorded use: the free completes at once. */
    assert_int_equal(npualloc_cache_record_stream(c, (uint64_t)(uintptr_t)side), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_erase_stream(c, (uint64_t)(uintptr_t)side), ACL_SUCCESS);
    npualloc_cache_free(c);
    assert_int_equal(stats().active[ALL].current, 0);
    assert_int_equal(npualloc_cache_record_stream((void *)0x1234, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_record_stream(b, 0xdead), ACL_ERROR_INVALID_PARAM);
    aclrtDestroyStream(side);
    check();
}

/* Every device's default stream is the handle 0: npualloc_cache_record_stream_on says whose. */
static void test_record_stream_on_another_devices_default_stream(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    static atomic_int gate;
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    hold_stream(NULL, &gate); /* device 1's default stream is busy */
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    void *a = alloc(1000);
    assert_int_equal(npualloc_cache_record_stream_on(a, 1, 0), ACL_SUCCESS);
    npualloc_cache_free(a);
    void *b = alloc(1000);
    int64_t active_while_held = stats().active[ALL].current;
    atomic_store(&gate, 1);
    assert_int_equal(active_while_held, 2); /* a waits for device 1's default stream */
    assert_ptr_not_equal(a, b);
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    npualloc_cache_free(b);
    assert_ptr_equal(alloc(1000), a);
    /* Device 0 (the block's own) given explicitly is the same use as 0; erase_stream_on finds it. */
    assert_int_equal(npualloc_cache_record_stream_on(a, 0, 0), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_record_stream_on(a, 1, 0), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_erase_stream(a, 0), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_erase_stream_on(a, 1, 0), ACL_SUCCESS);
    npualloc_cache_free(a);
    assert_int_equal(stats().active[ALL].current, 0); /* no use left: freed at once */
    void *c = alloc(1000);
    assert_int_equal(npualloc_cache_record_stream_on(c, 2, 0), ACL_ERROR_INVALID_PARAM); /* 2 devices */
    assert_int_equal(npualloc_cache_record_stream_on(c, -1, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_erase_stream_on(c, 7, 0), ACL_ERROR_INVALID_PARAM);
    npualloc_cache_free(c);
    check();
}

/* A block recorded on `stream`, whose queued work (which may use it) is held until *gate opens. */
static void *block_used_by_held_stream(aclrtStream stream, atomic_int *gate)
{
    void *a = alloc(1000);
    assert_int_equal(npualloc_cache_record_stream(a, (uint64_t)(uintptr_t)stream), ACL_SUCCESS);
    hold_stream(stream, gate);
    return a;
}

static void *destroy_stream_thread(void *arg) { return (void *)(intptr_t)aclrtDestroyStream((aclrtStream)arg); }

static void test_free_waits_for_a_recorded_stream_being_destroyed(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    aclrtStream side;
    assert_int_equal(aclrtCreateStream(&side), ACL_SUCCESS);
    static atomic_int gate;
    void *a = block_used_by_held_stream(side, &gate);
    /* Another thread destroys the stream: its handle goes at once, its queued work still runs. */
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, destroy_stream_thread, side), 0);
    size_t live = 1;
    while (live != 0) {
        stream_counts(&live, NULL);
        host_sleep_ns(1000000);
    }
    npualloc_cache_free(a);
    int64_t active_after_free = stats().active[ALL].current;
    void *b = alloc(1000);
    /* The gate opens before any assertion: a failing one must not leave the stream held. */
    atomic_store(&gate, 1);
    void *rc;
    assert_int_equal(pthread_join(t, &rc), 0);
    assert_int_equal((aclError)(intptr_t)rc, ACL_SUCCESS);
    assert_int_equal(active_after_free, 1); /* was pending behind the side stream's work */
    assert_ptr_not_equal(a, b);
    void *c = alloc(1000); /* the destroyed stream drained: a's block is free and first in address order */
    assert_ptr_equal(c, a);
    npualloc_cache_free(b);
    npualloc_cache_free(c);
    assert_int_equal(stats().active[ALL].current, 0);
    check();
}

static void *empty_cache_thread(void *arg)
{
    (void)arg;
    return (void *)(intptr_t)npualloc_cache_empty();
}

/* empty_cache synchronizes its own device only; a free waiting for another device's stream is
 * waited for with the allocator lock released, so that stream's queued work may take it (a
 * callback freeing memory of this device). */
static void test_empty_cache_waits_for_another_devices_stream_without_the_lock(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    aclrtStream other;
    assert_int_equal(aclrtCreateStream(&other), ACL_SUCCESS); /* device 1's */
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    static atomic_int gate;
    void *a = block_used_by_held_stream(other, &gate);
    npualloc_cache_free(a); /* waits for the held callback */
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, empty_cache_thread, NULL), 0);
    npu_stream *s;
    assert_int_equal(stream_acquire(other, &s), ACL_SUCCESS);
    while (stream_waiter_count(s) == 0) /* empty_cache is waiting for the free's event */
        host_sleep_ns(1000000);
    device_cache *dc = cache_device(0);
    bool lock_free = cache_lock_try(&dc->lock);
    if (lock_free)
        cache_lock_release(&dc->lock);
    atomic_store(&gate, 1); /* before any assertion: a failing one must not leave the stream held */
    void *rc;
    assert_int_equal(pthread_join(t, &rc), 0);
    stream_release(s);
    assert_int_equal((aclError)(intptr_t)rc, ACL_SUCCESS);
    assert_true(lock_free);
    npualloc_stats st = stats();
    assert_int_equal(st.active[ALL].current, 0); /* the free completed... */
    assert_int_equal(st.reserved_bytes[ALL].current, 0); /* ...and its segment was released */
    assert_int_equal(aclrtDestroyStream(other), ACL_SUCCESS);
    check();
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(NPUALLOC_TSAN)
/* Out of host memory on demand: malloc fails in a thread that set this.  The sanitizers' malloc
 * cannot be replaced, so the test using it runs in the release build only. */
static _Thread_local bool malloc_fails;
void *__libc_malloc(size_t size);

void *malloc(size_t size) { return malloc_fails ? NULL : __libc_malloc(size); }

static atomic_bool free_returned;

static void *free_without_host_memory_thread(void *p)
{
    malloc_fails = true;
    npualloc_cache_free(p);
    malloc_fails = false;
    atomic_store(&free_returned, true);
    return NULL;
}

/* record_stream reserves the free's event, so a free with no host memory left neither fails nor
 * waits for the stream with the allocator lock held (the stream's queued work may need it). */
static void test_free_without_host_memory_does_not_wait_holding_the_lock(void **state)
{
    (void)state;
    if (getenv("NPUALLOC_VALGRIND"))
        skip(); /* valgrind replaces the executable's malloc with its own */
    start_cache(GiB_, NULL);
    aclrtStream side;
    assert_int_equal(aclrtCreateStream(&side), ACL_SUCCESS);
    static atomic_int gate;
    void *a = block_used_by_held_stream(side, &gate);
    atomic_store(&free_returned, false);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, free_without_host_memory_thread, a), 0);
    npu_stream *s;
    assert_int_equal(stream_acquire(side, &s), ACL_SUCCESS);
    while (!atomic_load(&free_returned) && stream_waiter_count(s) == 0)
        host_sleep_ns(1000000);
    bool returned_while_held = atomic_load(&free_returned);
    device_cache *dc = cache_device(0);
    bool lock_free = cache_lock_try(&dc->lock);
    if (lock_free)
        cache_lock_release(&dc->lock);
    atomic_store(&gate, 1); /* before any assertion: a failing one must not leave the stream held */
    assert_int_equal(pthread_join(t, NULL), 0);
    stream_release(s);
    assert_true(lock_free);
    assert_true(returned_while_held);
    assert_int_equal(aclrtSynchronizeStream(side), ACL_SUCCESS);
    void *c = alloc(1000); /* the event passed: a's block is free again */
    assert_ptr_equal(c, a);
    /* Out of host memory, it is record_stream that fails, recording nothing. */
    malloc_fails = true;
    aclError rc = npualloc_cache_record_stream(c, (uint64_t)(uintptr_t)side);
    malloc_fails = false;
    assert_int_equal(rc, ACL_ERROR_BAD_ALLOC);
    check();
    npualloc_cache_free(c);
    assert_int_equal(stats().active[ALL].current, 0); /* no use recorded: freed at once */
    assert_int_equal(aclrtDestroyStream(side), ACL_SUCCESS);
    check();
}
#endif

static void test_invalid_frees_are_rejected(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    char *a = alloc(1000);
    assert_int_equal(npualloc_cache_free(NULL), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(a + 512), ACL_ERROR_INVALID_PARAM);
    char expect[64];
    snprintf(expect, sizeof expect, "invalid device pointer: %p", (void *)(a + 512));
    assert_string_equal(npualloc_last_error(NULL), expect);
    assert_int_equal(npualloc_cache_free(a), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(a), ACL_ERROR_INVALID_PARAM);
    int local;
    assert_int_equal(npualloc_cache_free(&local), ACL_ERROR_INVALID_PARAM);
    check();
}

static void test_stats_reset(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    void *a = alloc(1000);
    npualloc_cache_free(a);
    alloc(3000);
    npualloc_stats s = stats();
    assert_int_equal(s.allocation[ALL].allocated, 2);
    assert_int_equal(s.allocation[ALL].freed, 1);
    assert_int_equal(s.allocated_bytes[ALL].peak, 3072);
    assert_int_equal(npualloc_cache_reset_accumulated(0), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_reset_peak(0), ACL_SUCCESS);
    s = stats();
    assert_int_equal(s.allocation[ALL].allocated, 0);
    assert_int_equal(s.allocation[ALL].freed, 0);
    assert_int_equal(s.allocation[ALL].current, 1);
    assert_int_equal(s.allocated_bytes[ALL].peak, 3072);
    assert_int_equal(s.num_device_alloc, 0);
}

static void test_snapshot_reports_segments_blocks_and_history(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_ALL, 100), ACL_SUCCESS);
    void *a = alloc(1000), *b = alloc(MiB_);
    npualloc_cache_free(a);
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    assert_int_equal(snap->segment_count, 2);
    const npualloc_segment_info *small = &snap->segments[0], *large = &snap->segments[1];
    if (!small->is_small) {
        const npualloc_segment_info *t = small;
        small = large;
        large = t;
    }
    assert_int_equal(small->total_size, 2 * MiB_);
    assert_int_equal(small->allocated_size, 0);
    assert_int_equal(small->block_count, 1);
    assert_int_equal(snap->blocks[small->first_block].state, NPUALLOC_BLOCK_INACTIVE);
    assert_int_equal(large->total_size, 20 * MiB_);
    assert_int_equal(large->block_count, 2);
    assert_int_equal(snap->blocks[large->first_block].address, (uintptr_t)b);
    assert_int_equal(snap->blocks[large->first_block].state, NPUALLOC_BLOCK_ACTIVE_ALLOCATED);
    assert_int_equal(snap->blocks[large->first_block].requested_size, MiB_);
    /* segment_alloc, alloc, segment_alloc, alloc, free_requested, free_completed */
    static const npualloc_trace_action expect[] = {NPUALLOC_TRACE_SEGMENT_ALLOC, NPUALLOC_TRACE_ALLOC,
                                                   NPUALLOC_TRACE_SEGMENT_ALLOC, NPUALLOC_TRACE_ALLOC,
                                                   NPUALLOC_TRACE_FREE_REQUESTED, NPUALLOC_TRACE_FREE_COMPLETED};
    assert_int_equal(snap->trace_count, 6);
    for (size_t i = 0; i < 6; i++)
        assert_int_equal(snap->traces[i].action, expect[i]);
    assert_int_equal(snap->traces[1].size, 1000);
    npualloc_snapshot_free(snap);
    /* The snapshot itself was recorded, after the copy (on every device). */
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    assert_int_equal(snap->trace_count, 7 + 1);
    assert_int_equal(snap->traces[6].device, 0);
    assert_int_equal(snap->traces[6].action, NPUALLOC_TRACE_SNAPSHOT);
    assert_int_equal(snap->traces[7].device, 1);
    npualloc_snapshot_free(snap);
    /* A ring of 4 keeps the newest 4, oldest first. */
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_ALL, 4), ACL_SUCCESS);
    for (int i = 0; i < 6; i++)
        npualloc_cache_free(alloc(1000 + 512 * (size_t)i));
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    assert_int_equal(snap->trace_count, 4);
    assert_int_equal(snap->traces[0].action, NPUALLOC_TRACE_FREE_COMPLETED);
    assert_int_equal(snap->traces[1].action, NPUALLOC_TRACE_ALLOC);
    assert_int_equal(snap->traces[1].size, 1000 + 512 * 5);
    assert_int_equal(snap->traces[3].action, NPUALLOC_TRACE_FREE_COMPLETED);
    npualloc_snapshot_free(snap);
}

static size_t history_actions(npualloc_trace_action *out, size_t cap)
{
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    size_t n = 0;
    for (size_t i = 0; i < snap->trace_count; i++)
        if (snap->traces[i].device == 0 && n < cap)
            out[n++] = snap->traces[i].action;
    npualloc_snapshot_free(snap);
    return n;
}

/* torch's user metadata: attached to the entries recorded after it is set, kept by them when it changes. */
static void test_user_metadata_goes_with_the_entries_recorded_after_it(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_ALL, 100), ACL_SUCCESS);
    void *p = alloc(1000);
    assert_int_equal(npualloc_cache_set_user_metadata(0, "step", 4), ACL_SUCCESS);
    npualloc_cache_free(p);
    assert_int_equal(npualloc_cache_set_user_metadata(0, "", 0), ACL_SUCCESS);
    npualloc_cache_free(alloc(1000));
    npualloc_context *md = (npualloc_context *)1;
    assert_int_equal(npualloc_cache_get_user_metadata(0, &md), ACL_SUCCESS);
    assert_null(md);
    assert_int_equal(npualloc_cache_set_user_metadata(0, "later", 5), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_get_user_metadata(0, &md), ACL_SUCCESS);
    size_t len;
    assert_memory_equal(npualloc_context_data(md, &len), "later", 5);
    assert_int_equal(len, 5);
    npualloc_context_release(md);
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    /* segment_alloc, alloc | free_requested, free_completed ("step") | alloc, free_requested, free_completed */
    assert_int_equal(snap->trace_count, 7);
    for (size_t i = 0; i < snap->trace_count; i++) {
        const void *data = npualloc_context_data(snap->traces[i].user_metadata, &len);
        if (i == 2 || i == 3) {
            assert_int_equal(len, 4);
            assert_memory_equal(data, "step", 4);
        } else {
            assert_null(data);
        }
    }
    npualloc_snapshot_free(snap);
    assert_int_equal(npualloc_cache_set_user_metadata(0, NULL, 3), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_set_user_metadata(NPU_MAX_DEVICES, "x", 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_set_user_metadata(-1, "x", 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_get_user_metadata(0, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_record_history(false, NPUALLOC_RECORD_NEVER, 0), ACL_SUCCESS);
}

static void test_history_options_skip_keep_and_clear(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    npualloc_history_options opts = {
        .clear_history = false,
        .skip_actions = NPUALLOC_TRACE_SKIP(NPUALLOC_TRACE_SEGMENT_ALLOC) | NPUALLOC_TRACE_SKIP(NPUALLOC_TRACE_SNAPSHOT)};
    assert_int_equal(npualloc_cache_record_history_opts(true, NPUALLOC_RECORD_ALL, 100, &opts), ACL_SUCCESS);
    npualloc_cache_free(alloc(1000));
    npualloc_trace_action got[16];
    assert_int_equal(history_actions(got, 16), 3); /* alloc, free_requested, free_completed */
    assert_int_equal(got[0], NPUALLOC_TRACE_ALLOC);
    assert_int_equal(got[2], NPUALLOC_TRACE_FREE_COMPLETED);
    /* Kept across an enabling call, trimmed to its newest entries; skips are set anew. */
    opts.skip_actions = 0;
    assert_int_equal(npualloc_cache_record_history_opts(true, NPUALLOC_RECORD_ALL, 2, &opts), ACL_SUCCESS);
    assert_int_equal(history_actions(got, 16), 2);
    assert_int_equal(got[0], NPUALLOC_TRACE_FREE_REQUESTED);
    assert_int_equal(got[1], NPUALLOC_TRACE_FREE_COMPLETED);
    /* Now the snapshot entry is recorded: the ring of 2 holds free_completed and snapshot. */
    assert_int_equal(history_actions(got, 16), 2);
    assert_int_equal(got[0], NPUALLOC_TRACE_FREE_COMPLETED);
    assert_int_equal(got[1], NPUALLOC_TRACE_SNAPSHOT);
    /* Bad options change nothing. */
    opts.skip_actions = NPUALLOC_TRACE_SKIP(NPUALLOC_TRACE_OOM + 1);
    assert_int_equal(npualloc_cache_record_history_opts(true, NPUALLOC_RECORD_ALL, 2, &opts),
                     ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_record_history_opts(true, NPUALLOC_RECORD_ALL, 2, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(history_actions(got, 16), 2);
    assert_int_equal(got[1], NPUALLOC_TRACE_SNAPSHOT);
    opts.skip_actions = 0;
    opts.clear_history = true;
    assert_int_equal(npualloc_cache_record_history_opts(true, NPUALLOC_RECORD_ALL, 100, &opts), ACL_SUCCESS);
    assert_int_equal(history_actions(got, 16), 0);
    /* Stopping clears whatever the options say. */
    npualloc_cache_free(alloc(1000));
    opts.clear_history = false;
    assert_int_equal(npualloc_cache_record_history_opts(false, NPUALLOC_RECORD_NEVER, 0, &opts), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_record_history_opts(true, NPUALLOC_RECORD_ALL, 100, &opts), ACL_SUCCESS);
    assert_int_equal(history_actions(got, 16), 0);
}

static void test_history_keeps_contexts_by_level(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    npualloc_context *where = npualloc_context_create("train.py:42", 11);
    npualloc_context *freed_at = npualloc_context_create("train.py:99", 11);
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_STATE, 100), ACL_SUCCESS);
    void *a = NULL, *b = NULL, *whole = NULL;
    /* 20 MiB - 32 fills a 20 MiB segment exactly: nothing is split off */
    assert_int_equal(npualloc_cache_malloc_ctx(0, 20 * MiB_ - 32, 0, where, &whole), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_malloc_ctx(0, 1000, 0, where, &a), ACL_SUCCESS);
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    assert_int_equal(snap->segment_count, 2);
    const npualloc_segment_info *small = &snap->segments[0], *large = &snap->segments[1];
    if (small->total_size > large->total_size) {
        const npualloc_segment_info *t = small;
        small = large;
        large = t;
    }
    assert_ptr_equal(large->frames, where); /* STATE: blocks and segments */
    assert_ptr_equal(snap->blocks[large->first_block].frames, where);
    /* As torch: the segment's context stays with the remainder when the front is split off, so the
     * segment reports none (the block does). */
    assert_null(small->frames);
    assert_ptr_equal(snap->blocks[small->first_block].frames, where);
    for (size_t i = 0; i < snap->trace_count; i++)
        assert_null(snap->traces[i].frames); /* but not trace entries */
    npualloc_snapshot_free(snap);
    npualloc_cache_free(whole);
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_ALL, 100), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_malloc_ctx(0, 1000, 0, where, &b), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free_ctx(b, freed_at), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    assert_int_equal(snap->traces[0].action, NPUALLOC_TRACE_ALLOC);
    assert_ptr_equal(snap->traces[0].frames, where);
    assert_int_equal(snap->traces[1].action, NPUALLOC_TRACE_FREE_REQUESTED);
    assert_ptr_equal(snap->traces[1].frames, freed_at);
    size_t len = 0;
    assert_memory_equal(npualloc_context_data(snap->traces[1].frames, &len), "train.py:99", 11);
    assert_int_equal(len, 11);
    /* A freed (cached) block carries no allocation context. */
    for (size_t i = 0; i < snap->block_count; i++)
        if (snap->blocks[i].state == NPUALLOC_BLOCK_INACTIVE)
            assert_null(snap->blocks[i].frames);
    npualloc_snapshot_free(snap);
    npualloc_cache_free(a);
    /* The allocator holds its own references: the caller's can go now (ASan checks the rest). */
    npualloc_context_release(where);
    npualloc_context_release(freed_at);
}

static npualloc_context *waiting_stack;

static void *empty_cache_with_a_stack(void *arg)
{
    (void)arg;
    assert_int_equal(npualloc_cache_empty_ctx(waiting_stack), ACL_SUCCESS); /* waits for the device, unlocked */
    return NULL;
}

/* A call waiting with the device's lock released (here empty_cache's synchronize) kept its stack as the
 * device's current one, and entries other threads recorded meanwhile took it: a snapshot's entry, which
 * torch records with no stack, carried the waiting call's. */
static void test_a_waiting_calls_stack_goes_to_no_other_threads_entries(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    waiting_stack = npualloc_context_create("train.py:7 empty_cache", 23);
    assert_int_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_ALL, 100), ACL_SUCCESS);
    aclrtStream s = new_stream();
    atomic_int gate;
    hold_stream(s, &gate);
    pthread_t waiter;
    assert_int_equal(pthread_create(&waiter, NULL, empty_cache_with_a_stack, NULL), 0);
    struct timespec pause = {0, 200 * 1000 * 1000};
    nanosleep(&pause, NULL); /* the empty_cache waits for the held stream */
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS); /* records its entry, with no stack */
    npualloc_snapshot_free(snap);
    atomic_store(&gate, 1);
    assert_int_equal(pthread_join(waiter, NULL), 0);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    size_t snapshots = 0;
    for (size_t i = 0; i < snap->trace_count; i++) {
        if (snap->traces[i].action == NPUALLOC_TRACE_SNAPSHOT) {
            snapshots++;
            assert_null(snap->traces[i].frames);
        }
    }
    npualloc_snapshot_free(snap);
    assert_int_equal(snapshots, 2); /* the one taken during the wait, and this one */
    npualloc_context_release(waiting_stack);
}

/* A record_history that fails (the settings are malformed, so no device can start) leaves the level it
 * reports alone: it said ALL while no device recorded. */
static void test_a_failed_record_history_changes_no_level(void **state)
{
    (void)state;
    start_cache(GiB_, "max_split_size_mb:10");
    assert_int_not_equal(npualloc_cache_record_history(true, NPUALLOC_RECORD_ALL, 100), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_record_context(), NPUALLOC_RECORD_NEVER);
}

static atomic_int toggles_go;

static void *toggle_history(void *on)
{
    while (!atomic_load(&toggles_go))
        ;
    assert_int_equal(npualloc_cache_record_history(on != NULL, on ? NPUALLOC_RECORD_ALL : NPUALLOC_RECORD_NEVER, 100),
                     ACL_SUCCESS);
    return NULL;
}

/* Two record_history calls at once (one on, one off) leave every device as one of them said, and the
 * level reported is that one's: devices were left mixed, and the level could be the other call's. */
static void test_concurrent_record_history_calls_leave_one_state(void **state)
{
    (void)state;
    enum { DEVICES = 4 };
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    start_runtime(DEVICES, GiB_, GiB_, 0, 0);
    const int rounds = getenv("NPUALLOC_VALGRIND") ? 30 : 300;
    for (int round = 0; round < rounds; round++) {
        assert_int_equal(npualloc_cache_record_history(false, NPUALLOC_RECORD_NEVER, 0), ACL_SUCCESS);
        atomic_store(&toggles_go, 0);
        pthread_t on, off;
        assert_int_equal(pthread_create(&on, NULL, toggle_history, (void *)1), 0);
        assert_int_equal(pthread_create(&off, NULL, toggle_history, NULL), 0);
        atomic_store(&toggles_go, 1);
        assert_int_equal(pthread_join(on, NULL), 0);
        assert_int_equal(pthread_join(off, NULL), 0);
        size_t recorded[DEVICES] = {0};
        for (int d = 0; d < DEVICES; d++) {
            void *p = NULL;
            assert_int_equal(npualloc_cache_malloc(d, 1000, 0, &p), ACL_SUCCESS);
            assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
        }
        npualloc_snapshot *snap;
        assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
        for (size_t i = 0; i < snap->trace_count; i++)
            recorded[snap->traces[i].device] += snap->traces[i].action == NPUALLOC_TRACE_ALLOC;
        npualloc_snapshot_free(snap);
        for (int d = 1; d < DEVICES; d++)
            if ((recorded[d] > 0) != (recorded[0] > 0))
                fail_msg("round %d: device 0 records: %d, device %d: %d", round, recorded[0] > 0, d, recorded[d] > 0);
        if ((recorded[0] > 0) != (npualloc_cache_record_context() != NPUALLOC_RECORD_NEVER))
            fail_msg("round %d: the devices record: %d, but the level is %d", round, recorded[0] > 0,
                     (int)npualloc_cache_record_context());
    }
    assert_int_equal(npualloc_cache_record_history(false, NPUALLOC_RECORD_NEVER, 0), ACL_SUCCESS);
}

static const char *const alternating_texts[2] = {"max_split_size_mb:40", "max_split_size_mb:0000000000000030"};

static void *set_settings_alternately(void *arg)
{
    atomic_bool *stop = arg;
    for (int i = 0; !atomic_load(stop); i++)
        (void)npualloc_cache_set_settings(alternating_texts[i & 1]);
    return NULL;
}

/* The text is copied under the lock: a reader never sees one text half written over another (it got a
 * pointer to a buffer that a concurrent change rewrote; TSan named the race). */
static void test_settings_text_read_while_another_thread_changes_it(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    alloc(1);
    assert_int_equal(npualloc_cache_set_settings(alternating_texts[1]), ACL_SUCCESS);
    atomic_bool stop = false;
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, set_settings_alternately, &stop), 0);
    for (int i = 0; i < 2000; i++) {
        char text[64];
        (void)npualloc_cache_settings_text(text, sizeof text);
        if (strcmp(text, alternating_texts[0]) != 0 && strcmp(text, alternating_texts[1]) != 0)
            fail_msg("a torn settings text: '%s'", text);
    }
    atomic_store(&stop, true);
    assert_int_equal(pthread_join(t, NULL), 0);
}

static void test_settings_change_at_run_time(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    alloc(1);
    assert_int_equal(npualloc_cache_set_settings("max_split_size_mb:40"), ACL_SUCCESS);
    assert_int_equal(cache_settings.max_split_size, 40 * MiB_);
    char text[64];
    assert_int_equal(npualloc_cache_settings_text(text, sizeof text), strlen("max_split_size_mb:40"));
    assert_string_equal(text, "max_split_size_mb:40");
    assert_int_equal(npualloc_cache_settings_text(text, 5), strlen("max_split_size_mb:40")); /* cut, as snprintf */
    assert_string_equal(text, "max_");
    assert_int_equal(npualloc_cache_settings_text(NULL, 0), strlen("max_split_size_mb:40"));
    /* a long text is kept whole (it was cut to 1023 bytes) */
    char long_text[3000] = "max_split_size_mb:";
    size_t zeros = sizeof long_text - strlen(long_text) - 3;
    memset(long_text + strlen(long_text), '0', zeros);
    strcat(long_text, "40");
    assert_int_equal(npualloc_cache_set_settings(long_text), ACL_SUCCESS);
    assert_int_equal(cache_settings.max_split_size, 40 * MiB_);
    char *back = malloc(sizeof long_text);
    assert_non_null(back);
    assert_int_equal(npualloc_cache_settings_text(back, sizeof long_text), strlen(long_text));
    assert_string_equal(back, long_text);
    free(back);
    assert_int_equal(npualloc_cache_set_settings("max_split_size_mb:40"), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_set_settings("page_size:1g"), ACL_ERROR_INVALID_PARAM);
    npualloc_error_kind kind;
    assert_string_equal(npualloc_last_error(&kind),
                        "torch_npu.npu.memory._set_allocator_settings() unsupported setting: page_size");
    assert_int_equal(kind, NPUALLOC_ERR_RUNTIME);
    int sub = -1, code = -1;
    npualloc_last_error_suffix(&sub, &code); /* OPS_ERROR(ErrCode::VALUE) */
    assert_int_equal(sub, 1);
    assert_int_equal(code, 3);
    assert_int_equal(cache_settings.max_split_size, 40 * MiB_); /* unchanged by the failure */
    /* c10's errors carry no suffix, and a later error of another kind drops the last one's */
    assert_int_equal(npualloc_cache_set_settings("max_split_size_mb:5"), ACL_ERROR_INVALID_PARAM);
    npualloc_last_error_suffix(&sub, &code);
    assert_int_equal(sub, -1);
    assert_int_equal(code, 0);
    assert_int_equal(npualloc_cache_set_settings("throw_on_npumalloc_oom:1"), ACL_ERROR_INVALID_PARAM);
    npualloc_last_error_suffix(&sub, NULL); /* PTA_ERROR(ErrCode::PARAM) */
    assert_int_equal(sub, 0);
    assert_int_not_equal(npualloc_cache_free((void *)(uintptr_t)0x1234), ACL_SUCCESS);
    npualloc_last_error_suffix(&sub, &code);
    assert_int_equal(sub, -1);
}

static void test_bad_environment_fails_every_allocation(void **state)
{
    (void)state;
    start_cache(GiB_, "max_split_size_mb:10");
    void *p = NULL;
    assert_int_not_equal(npualloc_cache_malloc(0, 100, 0, &p), ACL_SUCCESS);
    npualloc_error_kind kind;
    const char *msg = npualloc_last_error(&kind);
    assert_non_null(strstr(msg, "max_split_size_mb"));
    assert_true(kind == NPUALLOC_ERR_VALUE || kind == NPUALLOC_ERR_RUNTIME);
    /* a warning the parser gave before its error is given too, once */
    start_cache(GiB_, "segment_size_mb:5");
    while (npualloc_has_warnings()) { /* whatever the restart left */
        char w[512];
        npualloc_pop_warning(w, sizeof w);
    }
    assert_int_not_equal(npualloc_cache_malloc(0, 100, 0, &p), ACL_SUCCESS);
    assert_string_equal(npualloc_last_error(NULL), "CachingAllocator option segment_size_mb error, must be [20, 512], "
                                                   "dtype is int");
    char w[512];
    assert_true(npualloc_pop_warning(w, sizeof w));
    assert_string_equal(w, "`segment_size_mb` is deprecated, please use `large_segment_size_mb` instead.");
    assert_int_not_equal(npualloc_cache_malloc(0, 100, 0, &p), ACL_SUCCESS);
    assert_false(npualloc_has_warnings());
}

/* Warnings sat in one process-wide queue: another thread's next call popped (and in Python raised, or gave
 * to its own warning filters) the warning of this thread's allocation.  Each thread pops its own, as torch
 * gives a TORCH_WARN to the thread whose call made it. */
typedef struct warning_thread {
    pthread_mutex_t lock;
    pthread_cond_t cv;
    int step; /* 1: allocated; 2: the main thread looked at its own warnings */
    aclError alloc_rc;
    bool had_pending, popped;
    char text[512];
} warning_thread;

static void warning_step(warning_thread *w, int step, bool wait)
{
    pthread_mutex_lock(&w->lock);
    if (wait) {
        while (w->step < step)
            pthread_cond_wait(&w->cv, &w->lock);
    } else {
        w->step = step;
        pthread_cond_broadcast(&w->cv);
    }
    pthread_mutex_unlock(&w->lock);
}

static void *allocate_with_a_warning(void *arg)
{
    warning_thread *w = arg;
    void *p = NULL;
    w->alloc_rc = npualloc_cache_malloc(0, 100, 0, &p); /* the first allocation reads the settings */
    if (w->alloc_rc == ACL_SUCCESS)
        npualloc_cache_free(p);
    warning_step(w, 1, false);
    warning_step(w, 2, true);
    w->had_pending = npualloc_has_warnings();
    w->popped = npualloc_pop_warning(w->text, sizeof w->text);
    return NULL;
}

static void test_a_warning_goes_to_the_thread_whose_call_made_it(void **state)
{
    (void)state;
    start_cache(GiB_, "segment_size_mb:20");
    warning_thread w = {.lock = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, allocate_with_a_warning, &w), 0);
    warning_step(&w, 1, true);
    char text[512];
    bool main_pending = npualloc_has_warnings();
    bool main_popped = npualloc_pop_warning(text, sizeof text);
    warning_step(&w, 2, false);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(w.alloc_rc, ACL_SUCCESS);
    assert_false(main_popped);
    assert_false(main_pending);
    assert_true(w.had_pending);
    assert_true(w.popped);
    assert_string_equal(w.text, "`segment_size_mb` is deprecated, please use `large_segment_size_mb` instead.");
}

static void *push_a_warning_and_exit(void *arg)
{
    (void)arg;
    cache_push_warning("a warning of a thread that exits without taking it");
    return NULL;
}

/* A thread's warnings go when it exits: nobody else takes them, and they took a place of the 32 kept,
 * pushing out a living thread's oldest one. */
static void test_a_threads_warnings_go_with_it(void **state)
{
    (void)state;
    start_cache(GiB_, NULL);
    char w[512];
    while (npualloc_pop_warning(w, sizeof w)) {
    }
    cache_push_warning("the first of this thread's 32");
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, push_a_warning_and_exit, NULL), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    for (int i = 1; i < 32; i++)
        cache_push_warning("warning %d", i);
    int popped = 0;
    assert_true(npualloc_pop_warning(w, sizeof w));
    popped++;
    assert_string_equal(w, "the first of this thread's 32");
    while (npualloc_pop_warning(w, sizeof w))
        popped++;
    assert_int_equal(popped, 32);
    assert_string_equal(w, "warning 31");
    assert_false(npualloc_has_warnings());
}

/* ---- randomized sequence ---- */


static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void test_random_operations_keep_every_invariant(void **state)
{
    (void)state;
    start_cache(2 * GiB_, "max_split_size_mb:200,garbage_collection_threshold:0.8");
    assert_int_equal(npualloc_cache_set_fraction(0, 0.75), ACL_SUCCESS);
    aclrtStream streams[2];
    assert_int_equal(aclrtCreateStream(&streams[0]), ACL_SUCCESS);
    assert_int_equal(aclrtCreateStream(&streams[1]), ACL_SUCCESS);
    enum { SLOTS = 512 };
    static void *live[SLOTS];
    static size_t sizes[SLOTS];
    memset(live, 0, sizeof live);
    size_t ooms = 0;
    const int steps = random_steps(100000, 20000, 4000);
    for (int step = 0; step < steps; step++) {
        uint64_t r = rng();
        int slot = (int)(r % SLOTS);
        int op = (int)((r >> 16) % 100);
        if (live[slot] && op < 45) {
            /* fill check: nobody else wrote into this block */
            unsigned char *bytes = live[slot];
            unsigned char tag = (unsigned char)slot;
            if (bytes[0] != tag || bytes[sizes[slot] - 1] != tag)
                fail_msg("block %p of slot %d was overwritten", live[slot], slot);
            assert_int_equal(npualloc_cache_free(live[slot]), ACL_SUCCESS);
            live[slot] = NULL;
        } else if (!live[slot] && op < 90) {
            /* sizes from bytes to ~300 MiB, skewed small */
            int cls = (int)((r >> 24) % 10);
            size_t size = cls < 6 ? 1 + (r >> 32) % (64 * 1024)
                          : cls < 9 ? 1 + (r >> 32) % (12 * MiB_)
                                    : 1 + (r >> 32) % (300 * MiB_);
            uint64_t stream = (r >> 40) % 3 == 0 ? 0 : (uint64_t)(uintptr_t)streams[(r >> 42) % 2];
            void *p = NULL;
            aclError rc = npualloc_cache_malloc(0, size, stream, &p);
            if (rc == ACL_ERROR_RT_MEMORY_ALLOCATION) {
                ooms++;
            } else {
                assert_int_equal(rc, ACL_SUCCESS);
                live[slot] = p;
                sizes[slot] = size;
                memset(p, (unsigned char)slot, size < 4096 ? size : 4096);
                ((unsigned char *)p)[size - 1] = (unsigned char)slot;
                if (op % 7 == 0)
                    npualloc_cache_record_stream(p, (uint64_t)(uintptr_t)streams[op % 2]);
            }
        } else if (op == 95) {
            npualloc_cache_empty();
        } else if (op == 96) {
            npualloc_sleep_async(streams[r % 2], 0.0001);
        }
        check();
    }
    for (int i = 0; i < SLOTS; i++)
        if (live[i])
            npualloc_cache_free(live[i]);
    npualloc_cache_empty();
    check();
    npualloc_stats s = stats();
    assert_int_equal(s.allocated_bytes[ALL].current, 0);
    assert_int_equal(s.reserved_bytes[ALL].current, 0);
    print_message("random sequence: %d steps, %zu OOMs, %lld retries\n", steps, ooms,
                  (long long)s.num_alloc_retries);
    aclrtDestroyStream(streams[0]);
    aclrtDestroyStream(streams[1]);
}

/* ---- threads ---- */

typedef struct thread_arg {
    int id;
    int failures;
} thread_arg;

static void *hammer(void *p)
{
    thread_arg *a = p;
    aclrtSetDevice(0);
    void *mine[16] = {0};
    for (int i = 0; i < 20000; i++) {
        int slot = (i * 7 + a->id) % 16;
        if (mine[slot]) {
            if (*(int *)mine[slot] != a->id * 100000 + slot)
                a->failures++;
            npualloc_cache_free(mine[slot]);
            mine[slot] = NULL;
        } else {
            size_t size = 64 + (size_t)((i * 2654435761u) % (3 * 1024 * 1024));
            if (npualloc_cache_malloc(0, size, 0, &mine[slot]) != ACL_SUCCESS) {
                a->failures++;
                continue;
            }
            *(int *)mine[slot] = a->id * 100000 + slot;
        }
    }
    for (int i = 0; i < 16; i++)
        npualloc_cache_free(mine[i]);
    return NULL;
}

static void test_eight_threads_never_share_a_live_block(void **state)
{
    (void)state;
    start_cache(4 * GiB_, NULL);
    pthread_t t[8];
    thread_arg args[8];
    for (int i = 0; i < 8; i++) {
        args[i] = (thread_arg){i, 0};
        pthread_create(&t[i], NULL, hammer, &args[i]);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(t[i], NULL);
        assert_int_equal(args[i].failures, 0);
    }
    check();
    assert_int_equal(stats().allocated_bytes[ALL].current, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_round_size_pads_and_rounds, stop_cache),
        cmocka_unit_test_teardown(test_roundup_power2_divisions, stop_cache),
        cmocka_unit_test_teardown(test_small_requests_share_a_2mib_segment, stop_cache),
        cmocka_unit_test_teardown(test_large_pool_segment_sizes, stop_cache),
        cmocka_unit_test_teardown(test_large_remainder_of_one_mib_is_not_split, stop_cache),
        cmocka_unit_test_teardown(test_free_merges_neighbours, stop_cache),
        cmocka_unit_test_teardown(test_best_fit_prefers_smallest_then_lowest_address, stop_cache),
        cmocka_unit_test_teardown(test_streams_do_not_share_cached_blocks, stop_cache),
        cmocka_unit_test_teardown(test_max_split_size_oversize_rules, stop_cache),
        cmocka_unit_test_teardown(test_large_segment_size_mb_sets_the_segment_for_mid_requests, stop_cache),
        cmocka_unit_test_teardown(test_max_non_split_rounding_mb_widens_oversize_reuse, stop_cache),
        cmocka_unit_test_teardown(test_free_memory_callbacks_run_before_the_device_is_asked, stop_cache),
        cmocka_unit_test_teardown(test_checker_reports_broken_invariants, stop_cache),
        cmocka_unit_test_teardown(test_release_available_releases_one_large_enough_oversize_block, stop_cache),
        cmocka_unit_test_teardown(test_release_available_walks_largest_first, stop_cache),
        cmocka_unit_test_teardown(test_last_resort_releases_everything_and_counts_a_retry, stop_cache),
        cmocka_unit_test_teardown(test_out_of_memory_message_and_counters, stop_cache),
        cmocka_unit_test_teardown(test_fraction_is_enforced_on_reserved_memory, stop_cache),
        cmocka_unit_test_teardown(test_garbage_collection_frees_oldest_segments_first, stop_cache),
        cmocka_unit_test_teardown(test_garbage_collection_ages_count_a_miss_once_through_the_cached_path, stop_cache),
        cmocka_unit_test_teardown(test_record_stream_delays_reuse_until_stream_work_ran, stop_cache),
        cmocka_unit_test_teardown(test_record_stream_on_another_devices_default_stream, stop_cache),
        cmocka_unit_test_teardown(test_free_waits_for_a_recorded_stream_being_destroyed, stop_cache),
        cmocka_unit_test_teardown(test_empty_cache_waits_for_another_devices_stream_without_the_lock, stop_cache),
#if !defined(__SANITIZE_ADDRESS__) && !defined(NPUALLOC_TSAN)
        cmocka_unit_test_teardown(test_free_without_host_memory_does_not_wait_holding_the_lock, stop_cache),
#endif
        cmocka_unit_test_teardown(test_invalid_frees_are_rejected, stop_cache),
        cmocka_unit_test_teardown(test_stats_reset, stop_cache),
        cmocka_unit_test_teardown(test_snapshot_reports_segments_blocks_and_history, stop_cache),
        cmocka_unit_test_teardown(test_history_options_skip_keep_and_clear, stop_cache),
        cmocka_unit_test_teardown(test_user_metadata_goes_with_the_entries_recorded_after_it, stop_cache),
        cmocka_unit_test_teardown(test_history_keeps_contexts_by_level, stop_cache),
        cmocka_unit_test_teardown(test_settings_change_at_run_time, stop_cache),
        cmocka_unit_test_teardown(test_settings_text_read_while_another_thread_changes_it, stop_cache),
        cmocka_unit_test_teardown(test_cached_only_allocation_serves_hits_and_leaves_misses, stop_cache),
        cmocka_unit_test_teardown(test_acl_free_refuses_the_allocators_segments, stop_cache),
        cmocka_unit_test_teardown(test_bad_environment_fails_every_allocation, stop_cache),
        cmocka_unit_test_teardown(test_a_warning_goes_to_the_thread_whose_call_made_it, stop_cache),
        cmocka_unit_test_teardown(test_a_threads_warnings_go_with_it, stop_cache),
        cmocka_unit_test_teardown(test_a_waiting_calls_stack_goes_to_no_other_threads_entries, stop_cache),
        cmocka_unit_test_teardown(test_a_failed_record_history_changes_no_level, stop_cache),
        cmocka_unit_test_teardown(test_concurrent_record_history_calls_leave_one_state, stop_cache),
        cmocka_unit_test_teardown(test_random_operations_keep_every_invariant, stop_cache),
        cmocka_unit_test_teardown(test_eight_threads_never_share_a_live_block, stop_cache),
    };
    return cmocka_run_group_tests_name("caching", tests, NULL, NULL);
}
