/* test_pools.c - private memory pools (torch's MemPool / graph pools). */
#include <pthread.h>
#include <unistd.h>

#include "testutil.h"

static void start_cache(void)
{
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
    start_runtime(1, 4 * GiB_, 4 * GiB_, 0, 0);
}

static void check(void)
{
    char why[512] = "";
    if (npualloc_cache_check(0, why, sizeof why) != ACL_SUCCESS)
        fail_msg("invariant broken: %s", why);
}

static void *alloc_on(size_t size, uint64_t stream)
{
    void *p = NULL;
    aclError rc = npualloc_cache_malloc(0, size, stream, &p);
    if (rc != ACL_SUCCESS)
        fail_msg("malloc(%zu) failed: %d %s", size, rc, npualloc_last_error(NULL));
    return p;
}

static void *alloc(size_t size) { return alloc_on(size, 0); }

/* Sends this thread's allocations on device 0 to pool id (torch's use_mem_pool). */
static void route_here(npualloc_mempool_id id)
{
    assert_int_equal(npualloc_cache_pool_begin(0, id, NPUALLOC_POOL_FILTER_THREAD, (uint64_t)pthread_self()),
                     ACL_SUCCESS);
}

/* The pool id of the segment holding ptr, from a snapshot. */
static npualloc_mempool_id pool_of(void *ptr)
{
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    npualloc_mempool_id id = {UINT64_MAX, UINT64_MAX};
    for (size_t i = 0; i < snap->segment_count; i++) {
        const npualloc_segment_info *s = &snap->segments[i];
        if ((uintptr_t)ptr >= s->address && (uintptr_t)ptr < s->address + s->total_size)
            id = (npualloc_mempool_id){s->pool_id[0], s->pool_id[1]};
    }
    npualloc_snapshot_free(snap);
    return id;
}

static npualloc_stats stats(void)
{
    npualloc_stats s;
    assert_int_equal(npualloc_cache_get_stats(0, &s), ACL_SUCCESS);
    return s;
}

static void test_pool_ids_follow_torch_counters(void **state)
{
    (void)state;
    npualloc_mempool_id a = npualloc_mempool_id_new(true), b = npualloc_mempool_id_new(true);
    assert_int_equal(a.first, 0);
    assert_int_equal(b.first, 0);
    assert_int_equal(b.second, a.second + 1);
    npualloc_mempool_id internal = npualloc_mempool_id_new(false);
    assert_int_not_equal(internal.first, 0);
    assert_int_equal(internal.second, 0);
}

typedef struct other_thread {
    void *ptr;
} other_thread;

static void *allocate_elsewhere(void *arg)
{
    other_thread *o = arg;
    o->ptr = alloc(1000);
    return NULL;
}

static void test_thread_route_sends_only_this_threads_allocations_to_the_pool(void **state)
{
    (void)state;
    start_cache();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_create(0, id), ACL_SUCCESS);
    route_here(id);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 2); /* the pool object and the route */
    void *mine = alloc(1000), *big = alloc(30 * MiB_);
    other_thread o;
    pthread_t t;
    pthread_create(&t, NULL, allocate_elsewhere, &o);
    pthread_join(t, NULL);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1);
    void *after = alloc(1000);
    npualloc_mempool_id p1 = pool_of(mine), p2 = pool_of(big), p3 = pool_of(o.ptr), p4 = pool_of(after);
    assert_true(p1.first == id.first && p1.second == id.second);
    assert_true(p2.first == id.first && p2.second == id.second);
    assert_true(p3.first == 0 && p3.second == 0);
    assert_true(p4.first == 0 && p4.second == 0);
    /* Pool segments count in the device's stats like any other. */
    npualloc_stats s = stats();
    assert_int_equal(s.segment[NPUALLOC_STAT_ALL].current, 3);
    check();
}

static bool is_pool(npualloc_mempool_id got, npualloc_mempool_id want)
{
    return got.first == want.first && got.second == want.second;
}

/* torch's beginAllocateToPool: one recording per pool at a time, whatever the filter; a
 * refused begin leaves the use count alone.  A stream joining the recording shares it. */
static void test_one_recording_per_pool_and_streams_joining_it(void **state)
{
    (void)state;
    start_cache();
    aclrtStream s1, s2, s3;
    assert_int_equal(aclrtCreateStream(&s1), ACL_SUCCESS);
    assert_int_equal(aclrtCreateStream(&s2), ACL_SUCCESS);
    assert_int_equal(aclrtCreateStream(&s3), ACL_SUCCESS);
    npualloc_mempool_id id = npualloc_mempool_id_new(false), other = npualloc_mempool_id_new(false);
    uint64_t h1 = (uint64_t)(uintptr_t)s1, h2 = (uint64_t)(uintptr_t)s2, h3 = (uint64_t)(uintptr_t)s3;
    assert_int_equal(npualloc_cache_pool_join(0, id, h2), ACL_ERROR_INVALID_PARAM); /* nothing to join */
    assert_string_equal(npualloc_last_error(NULL), "joinAllocateToPool: no capture is recording to mempool_id");
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 0);
    assert_int_equal(npualloc_cache_pool_begin(0, id, NPUALLOC_POOL_FILTER_STREAM, h1), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1);
    const struct {
        npualloc_pool_filter filter;
        uint64_t value;
    } refused[] = {{NPUALLOC_POOL_FILTER_STREAM, h1},
                   {NPUALLOC_POOL_FILTER_STREAM, h2},
                   {NPUALLOC_POOL_FILTER_THREAD, (uint64_t)pthread_self()}};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        assert_int_equal(npualloc_cache_pool_begin(0, id, refused[i].filter, refused[i].value),
                         ACL_ERROR_INVALID_PARAM);
        assert_string_equal(npualloc_last_error(NULL), "beginAllocateToPool: already recording to mempool_id");
        assert_int_equal(npualloc_cache_pool_use_count(0, id), 1);
    }
    /* Another pool records at the same time. */
    assert_int_equal(npualloc_cache_pool_begin(0, other, NPUALLOC_POOL_FILTER_STREAM, h3), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_join(0, id, h2), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1); /* torch: the recording's one reference */
    void *a = alloc_on(1000, h1), *b = alloc_on(1000, h2), *c = alloc_on(1000, h3), *d = alloc_on(1000, 0);
    assert_true(is_pool(pool_of(a), id));
    assert_true(is_pool(pool_of(b), id));
    assert_true(is_pool(pool_of(c), other));
    assert_true(is_pool(pool_of(d), (npualloc_mempool_id){0, 0}));
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS); /* s2's joined route drops no reference */
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS); /* the recording's drops its own */
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 0);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_ERROR_INVALID_PARAM);
    assert_string_equal(npualloc_last_error(NULL), "endAllocatePool: not currently recording to mempool_id");
    assert_int_equal(npualloc_cache_pool_end(0, other), ACL_SUCCESS);
    /* Once the recording ended, the pool can be shared by the next capture. */
    assert_int_equal(npualloc_cache_pool_create(0, id), ACL_SUCCESS); /* a holder, so the pool survives */
    assert_int_equal(npualloc_cache_pool_begin(0, id, NPUALLOC_POOL_FILTER_STREAM, h2), ACL_SUCCESS);
    void *e = alloc_on(1000, h2);
    assert_true(is_pool(pool_of(e), id));
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1);
    npualloc_cache_free(a);
    npualloc_cache_free(b);
    npualloc_cache_free(c);
    npualloc_cache_free(d);
    npualloc_cache_free(e);
    check();
    aclrtDestroyStream(s1);
    aclrtDestroyStream(s2);
    aclrtDestroyStream(s3);
}

static void test_pool_memory_returns_only_when_released_and_free(void **state)
{
    (void)state;
    start_cache();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_create(0, id), ACL_SUCCESS);
    route_here(id);
    void *a = alloc(30 * MiB_);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    npualloc_cache_free(a);
    /* Still held by the pool object: empty_cache keeps the pool's memory. */
    npualloc_cache_empty();
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 30 * MiB_ + 2 * MiB_);
    /* Allocations outside the route never reuse the pool's blocks. */
    void *outside = alloc(30 * MiB_);
    assert_ptr_not_equal(outside, a);
    npualloc_cache_free(outside);
    assert_int_equal(npualloc_cache_pool_release(0, id), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 0);
    npualloc_cache_empty();
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    assert_int_equal(npualloc_cache_pool_release(0, id), ACL_ERROR_INVALID_PARAM); /* gone */
    check();
}

static void test_pool_empty_releases_that_pool_only_when_freeable(void **state)
{
    (void)state;
    start_cache();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    route_here(id); /* creates the pool, the route holds the only reference */
    void *a = alloc(1000);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    void *d = alloc(1000);
    npualloc_cache_free(d);
    npualloc_cache_free(a);
    assert_int_equal(npualloc_cache_pool_empty(0, id), ACL_SUCCESS);
    /* The pool's segment went back; the default pool's stays cached. */
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 2 * MiB_);
    check();
}

/* A route's reference released by someone else (the count is public): the pool stays while the
 * route points at it, and its memory returns once the route ended. */
static void test_a_routed_pool_outlives_an_over_released_count(void **state)
{
    (void)state;
    start_cache();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    route_here(id);
    assert_int_equal(npualloc_cache_pool_release(0, id), ACL_SUCCESS); /* the route's reference */
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 0);
    npualloc_cache_empty(); /* the pool is routed: not freed */
    void *a = alloc(1000);
    assert_true(is_pool(pool_of(a), id));
    npualloc_cache_free(a);
    check();
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_ERROR_INVALID_PARAM); /* no reference left to drop */
    npualloc_cache_empty();
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    check();
}

/* A free-memory callback run by the next cache miss (the allocator lock released) ends the route and gives
 * back the pool's last reference, and empties the cache when asked to. */
static npualloc_mempool_id ending_pool;
static atomic_int end_the_route, and_empty;

static bool end_route_and_release_pool(void)
{
    if (!atomic_exchange(&end_the_route, 0))
        return false;
    assert_int_equal(npualloc_cache_pool_end(0, ending_pool), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_release(0, ending_pool), ACL_SUCCESS);
    if (atomic_load(&and_empty))
        assert_int_equal(npualloc_cache_empty(), ACL_SUCCESS);
    return false;
}

/* An allocation into a private pool outlives the pool's route and last reference when they go while it has
 * the lock released (a miss: callbacks, synchronizes): the pool was freed under it (ASan: use after free),
 * by an empty_cache meanwhile or by the allocation's own last resort.  As torch, which holds its mutex
 * throughout, the allocation comes first: it is the pool's, and the pool goes with the next release. */
static void test_a_pool_released_while_an_allocation_into_it_waits_outlives_it(void **state)
{
    (void)state;
    start_cache();
    static atomic_bool registered;
    if (!atomic_exchange(&registered, true)) /* callbacks stay for the process */
        assert_int_equal(npualloc_cache_add_free_memory_callback(end_route_and_release_pool), ACL_SUCCESS);
    for (int empty = 1; empty >= 0; empty--) {
        ending_pool = npualloc_mempool_id_new(true);
        assert_int_equal(npualloc_cache_pool_create(0, ending_pool), ACL_SUCCESS);
        route_here(ending_pool);
        atomic_store(&and_empty, empty);
        atomic_store(&end_the_route, 1);
        void *p = NULL;
        if (empty) { /* an empty_cache while the miss has the lock released */
            assert_int_equal(npualloc_cache_malloc(0, MiB_, 0, &p), ACL_SUCCESS);
            assert_true(is_pool(pool_of(p), ending_pool));
            check();
            assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
        } else { /* more than the device: the miss ends in the last resort, which releases unused pools */
            assert_int_equal(npualloc_cache_malloc(0, 5 * GiB_, 0, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
            assert_null(p);
        }
        check();
        assert_int_equal(npualloc_cache_pool_use_count(0, ending_pool), 0);
        assert_int_equal(npualloc_cache_empty(), ACL_SUCCESS); /* the pool goes now */
        assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
        check();
    }
}

static void test_frees_with_stream_uses_wait_for_the_capture_to_end(void **state)
{
    (void)state;
    start_cache();
    aclrtStream side;
    assert_int_equal(aclrtCreateStream(&side), ACL_SUCCESS);
    void *a = alloc(1000);
    assert_int_equal(npualloc_cache_record_stream(a, (uint64_t)(uintptr_t)side), ACL_SUCCESS);
    npualloc_mempool_id id = npualloc_mempool_id_new(false);
    aclrtStream cap;
    assert_int_equal(aclrtCreateStream(&cap), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_begin(0, id, NPUALLOC_POOL_FILTER_STREAM, (uint64_t)(uintptr_t)cap),
                     ACL_SUCCESS);
    npualloc_cache_free(a);
    check(); /* deferred: active, not cached */
    assert_int_equal(stats().active[NPUALLOC_STAT_ALL].current, 1);
    void *b = alloc(1000); /* no events are processed during the capture */
    assert_ptr_not_equal(a, b);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(side), ACL_SUCCESS);
    void *c = alloc(1000); /* events recorded now, and already passed */
    assert_ptr_equal(c, a);
    check();
    aclrtDestroyStream(side);
    aclrtDestroyStream(cap);
}

/* A stream callback that frees memory needs the allocator's lock. */
static void free_in_callback(void *ptr) { assert_int_equal(npualloc_cache_free(ptr), ACL_SUCCESS); }

/* Emptying a pool waits for every block's recorded streams, as empty_cache does: with the lock
 * released, so a callback queued before a recorded use can still free memory (held, it deadlocked). */
static void test_pool_empty_waits_for_streams_without_the_allocator_lock(void **state)
{
    (void)state;
    start_cache();
    aclrtStream side;
    assert_int_equal(aclrtCreateStream(&side), ACL_SUCCESS);
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_create(0, id), ACL_SUCCESS);
    void *freed_by_callback = alloc(1000), *used_on_side = alloc(1000);
    /* The delay makes the callback run while the pool is being emptied. */
    assert_int_equal(npualloc_sleep_async(side, 0.3), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(free_in_callback, freed_by_callback, ACL_CALLBACK_BLOCK, side), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_record_stream(used_on_side, (uint64_t)(uintptr_t)side), ACL_SUCCESS);
    npualloc_cache_free(used_on_side); /* its free waits for the callback */
    assert_int_equal(npualloc_cache_pool_release(0, id), ACL_SUCCESS);
    alarm(getenv("NPUALLOC_VALGRIND") ? 300 : 30); /* a deadlock dies of SIGALRM instead of hanging */
    assert_int_equal(npualloc_cache_pool_empty(0, id), ACL_SUCCESS);
    alarm(0);
    npualloc_stats s = stats();
    assert_int_equal(s.allocation[NPUALLOC_STAT_ALL].current, 0);
    assert_int_equal(s.active[NPUALLOC_STAT_ALL].current, 0); /* the pending free completed */
    check();
    aclrtDestroyStream(side);
}

static npualloc_mempool_id begun_in_callback;
static void begin_capture_in_callback(void *stream)
{
    assert_int_equal(npualloc_cache_pool_begin(0, begun_in_callback, NPUALLOC_POOL_FILTER_STREAM,
                                               (uint64_t)(uintptr_t)stream), ACL_SUCCESS);
}

/* empty_cache leaves the default pools alone while a capture is underway, and it decides so after
 * waiting for the recorded streams, which releases the lock: a capture may begin meanwhile (torch holds
 * its lock throughout, so none can).  The recorded stream is another device's, which the device's own
 * synchronize before that wait does not drain. */
static void test_empty_cache_keeps_default_pools_for_a_capture_begun_during_its_synchronize(void **state)
{
    (void)state;
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
    start_runtime(2, 4 * GiB_, 4 * GiB_, 0, 0);
    aclrtStream side, cap;
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtCreateStream(&side), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    assert_int_equal(aclrtCreateStream(&cap), ACL_SUCCESS);
    npualloc_cache_free(alloc(4 * MiB_)); /* a whole cached large segment */
    void *used_on_side = alloc(1000);
    const int64_t reserved = stats().reserved_bytes[NPUALLOC_STAT_ALL].current;
    begun_in_callback = npualloc_mempool_id_new(false);
    /* The delay makes the capture begin while empty_cache waits for the side stream. */
    assert_int_equal(npualloc_sleep_async(side, 0.2), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(begin_capture_in_callback, cap, ACL_CALLBACK_BLOCK, side), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_record_stream(used_on_side, (uint64_t)(uintptr_t)side), ACL_SUCCESS);
    npualloc_cache_free(used_on_side); /* its free waits for the callback */
    assert_int_equal(npualloc_cache_empty(), ACL_SUCCESS);
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, reserved);
    check();
    assert_int_equal(npualloc_cache_pool_end(0, begun_in_callback), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_empty(), ACL_SUCCESS); /* the capture over: everything goes */
    assert_int_equal(stats().reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    aclrtDestroyStream(side);
    aclrtDestroyStream(cap);
}

static void test_default_pool_id_is_not_a_private_pool(void **state)
{
    (void)state;
    start_cache();
    npualloc_mempool_id zero = {0, 0};
    assert_int_equal(npualloc_cache_pool_create(0, zero), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_pool_begin(0, zero, 7, 0), ACL_ERROR_INVALID_PARAM);
}

/* ---- MemPool(use_on_oom=..., no_split=...) ---- */

/* A 64 MiB device: a pool's 22 MiB segment (a 20 MiB request, freed again) and a 42 MiB default
 * allocation fill it. */
static npualloc_mempool_id fill_small_device(void **hog)
{
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_create(0, id), ACL_SUCCESS);
    route_here(id);
    npualloc_cache_free(alloc(20 * MiB_));
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    *hog = alloc(40 * MiB_);
    assert_int_equal(free_of(ACL_HBM_MEM), 0);
    return id;
}

static aclError try_alloc(size_t size, void **p)
{
    *p = NULL;
    return npualloc_cache_malloc(0, size, 0, p);
}

/* The segment holding ptr: its block count and whether ptr's block is its only one. */
static size_t blocks_of_segment(void *ptr)
{
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    size_t n = 0;
    for (size_t i = 0; i < snap->segment_count; i++) {
        const npualloc_segment_info *s = &snap->segments[i];
        if ((uintptr_t)ptr >= s->address && (uintptr_t)ptr < s->address + s->total_size)
            n = s->block_count;
    }
    npualloc_snapshot_free(snap);
    return n;
}

static void test_use_on_oom_pool_serves_a_default_request_the_device_cannot(void **state)
{
    (void)state;
    void *hog, *p;
    npualloc_mempool_id id = fill_small_device(&hog);
    /* Unmarked: the pool's free block is not the default pool's, the request runs out of memory. */
    assert_int_equal(try_alloc(20 * MiB_, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(stats().num_ooms, 1);
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, id, true), ACL_SUCCESS);
    int64_t retries = stats().num_alloc_retries;
    assert_int_equal(try_alloc(20 * MiB_, &p), ACL_SUCCESS);
    /* Before any release: the pool's block, in the pool's segment, split as the pool splits. */
    assert_true(is_pool(pool_of(p), id));
    assert_int_equal(blocks_of_segment(p), 2);
    npualloc_stats s = stats();
    assert_int_equal(s.num_ooms, 1);
    assert_int_equal(s.num_alloc_retries, retries);
    assert_int_equal(s.segment[NPUALLOC_STAT_ALL].current, 2);
    assert_int_equal(s.allocated_bytes[NPUALLOC_STAT_LARGE_POOL].current, (40 * MiB_ + 512) + (20 * MiB_ + 512));
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1); /* entered and left, as torch */
    check();
    /* Its free returns it to the pool: the same block serves the next fallback. */
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
    assert_int_equal(blocks_of_segment(p), 1);
    assert_true(is_pool(pool_of(p), id));
    check();
    void *again;
    assert_int_equal(try_alloc(20 * MiB_, &again), ACL_SUCCESS);
    assert_ptr_equal(again, p);
    npualloc_cache_free(again);
    /* Cleared (~MemPool does it first): out of memory again. */
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, id, false), ACL_SUCCESS);
    assert_int_equal(try_alloc(20 * MiB_, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    npualloc_cache_free(hog);
    check();
}

static void test_use_on_oom_is_not_for_requests_routed_to_a_private_pool(void **state)
{
    (void)state;
    void *hog, *p;
    npualloc_mempool_id id = fill_small_device(&hog);
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, id, true), ACL_SUCCESS);
    npualloc_mempool_id other = npualloc_mempool_id_new(true);
    route_here(other);
    assert_int_equal(try_alloc(20 * MiB_, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(npualloc_cache_pool_end(0, other), ACL_SUCCESS);
    /* A small request looks in the pool's small blocks: it has none. */
    assert_int_equal(try_alloc(1000, &p), ACL_ERROR_RT_MEMORY_ALLOCATION);
    npualloc_cache_free(hog);
    check();
}

/* torch falls back only when the device is out of memory (its fallback asks for that status): a
 * segment that fails otherwise (here the mapping, out of host resources: 207005) is not replaced
 * by the pool's block; the retry chain makes a new default segment. */
static void test_use_on_oom_is_only_for_a_device_out_of_memory(void **state)
{
    (void)state;
    void *hog, *p;
    npualloc_mempool_id id = fill_small_device(&hog);
    npualloc_cache_free(hog);
    assert_int_equal(npualloc_cache_empty(), ACL_SUCCESS); /* room on the device again */
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, id, true), ACL_SUCCESS);
    assert_int_equal(npualloc_fault_set(NPUALLOC_FAULT_MAP, 1), ACL_SUCCESS);
    assert_int_equal(try_alloc(20 * MiB_, &p), ACL_SUCCESS);
    uint64_t seen, injected;
    npualloc_fault_counts(NPUALLOC_FAULT_MAP, &seen, &injected);
    assert_int_equal(injected, 1);
    assert_true(is_pool(pool_of(p), (npualloc_mempool_id){0, 0}));
    assert_int_equal(stats().segment[NPUALLOC_STAT_ALL].current, 2); /* the pool's and the new one */
    npualloc_cache_free(p);
    check();
}

/* torch enters each marked pool with beginAllocateToPool: a pool being recorded into fails the
 * allocation with that call's error. */
static void test_use_on_oom_pool_being_recorded_into_fails_the_request(void **state)
{
    (void)state;
    void *hog, *p;
    npualloc_mempool_id id = fill_small_device(&hog);
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, id, true), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_begin(0, id, NPUALLOC_POOL_FILTER_STREAM, 12345), ACL_SUCCESS);
    assert_int_equal(try_alloc(20 * MiB_, &p), ACL_ERROR_INVALID_PARAM);
    assert_string_equal(npualloc_last_error(NULL), "beginAllocateToPool: already recording to mempool_id");
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1);
    npualloc_cache_free(hog);
    check();
}

/* Marked pools are tried in the order they were marked; the first with a fitting block serves. */
static void test_use_on_oom_pools_in_marking_order_and_their_lifetime(void **state)
{
    (void)state;
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    npualloc_mempool_id a = npualloc_mempool_id_new(true), b = npualloc_mempool_id_new(true);
    void *in_a, *in_b;
    assert_int_equal(npualloc_cache_pool_create(0, a), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_create(0, b), ACL_SUCCESS);
    route_here(a);
    in_a = alloc(20 * MiB_);
    assert_int_equal(npualloc_cache_pool_end(0, a), ACL_SUCCESS);
    route_here(b);
    in_b = alloc(20 * MiB_);
    assert_int_equal(npualloc_cache_pool_end(0, b), ACL_SUCCESS);
    npualloc_cache_free(in_a);
    npualloc_cache_free(in_b);
    void *hog = alloc(18 * MiB_); /* 20 MiB: the device is full */
    assert_int_equal(free_of(ACL_HBM_MEM), 0);
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, b, true), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, a, true), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, b, true), ACL_SUCCESS); /* keeps its place */
    void *x, *y;
    assert_int_equal(try_alloc(20 * MiB_, &x), ACL_SUCCESS);
    assert_true(is_pool(pool_of(x), b));
    assert_int_equal(try_alloc(20 * MiB_, &y), ACL_SUCCESS);
    assert_true(is_pool(pool_of(y), a));
    /* The pool goes (~MemPool: cleared, released, emptied) while its block is live: the segment
     * stays until the block is freed, then returns at the next release. */
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, b, false), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_release(0, b), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_empty(0, b), ACL_SUCCESS);
    assert_true(is_pool(pool_of(x), b));
    check();
    npualloc_cache_free(x);
    assert_true(is_pool(pool_of(x), b));
    npualloc_cache_empty();
    assert_int_equal(npualloc_cache_pool_use_count(0, b), 0);
    assert_int_equal(free_of(ACL_HBM_MEM), 22 * MiB_);
    /* Unknown pools: marking fails, clearing does nothing. */
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, b, true), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, b, false), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_set_use_on_oom(0, (npualloc_mempool_id){0, 0}, true),
                     ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_pool_set_no_split(0, b), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_pool_set_no_split(9, a), ACL_ERROR_INVALID_PARAM);
    npualloc_cache_free(y);
    npualloc_cache_free(hog);
    check();
}

/* torch's no_split: every allocation of the pool takes a whole block; stats follow the blocks. */
static void test_no_split_pool_hands_out_whole_segments(void **state)
{
    (void)state;
    start_cache();
    npualloc_mempool_id id = npualloc_mempool_id_new(true), plain = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_create(0, id), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_create(0, plain), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_set_no_split(0, id), ACL_SUCCESS);
    route_here(plain);
    void *split_small = alloc(1000), *split_large = alloc(5 * MiB_);
    assert_int_equal(npualloc_cache_pool_end(0, plain), ACL_SUCCESS);
    assert_int_equal(blocks_of_segment(split_small), 2); /* an ordinary pool splits */
    assert_int_equal(blocks_of_segment(split_large), 2);
    npualloc_stats before = stats();
    route_here(id);
    void *small = alloc(1000), *small2 = alloc(1000), *large = alloc(5 * MiB_);
    assert_int_equal(blocks_of_segment(small), 1);
    assert_int_equal(blocks_of_segment(small2), 1);
    assert_int_equal(blocks_of_segment(large), 1);
    npualloc_stats s = stats();
    /* two 2 MiB segments and one 20 MiB one, each a single allocated block */
    assert_int_equal(s.segment[NPUALLOC_STAT_ALL].current - before.segment[NPUALLOC_STAT_ALL].current, 3);
    assert_int_equal(s.allocated_bytes[NPUALLOC_STAT_SMALL_POOL].current -
                         before.allocated_bytes[NPUALLOC_STAT_SMALL_POOL].current,
                     4 * MiB_);
    assert_int_equal(s.allocated_bytes[NPUALLOC_STAT_LARGE_POOL].current -
                         before.allocated_bytes[NPUALLOC_STAT_LARGE_POOL].current,
                     20 * MiB_);
    assert_int_equal(s.requested_bytes[NPUALLOC_STAT_ALL].current - before.requested_bytes[NPUALLOC_STAT_ALL].current,
                     2000 + 5 * MiB_);
    assert_int_equal(s.inactive_split[NPUALLOC_STAT_ALL].current, before.inactive_split[NPUALLOC_STAT_ALL].current);
    check();
    /* A freed block serves the next request whole again. */
    npualloc_cache_free(small);
    void *again = alloc(600);
    assert_ptr_equal(again, small);
    assert_int_equal(blocks_of_segment(again), 1);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    npualloc_cache_free(again);
    npualloc_cache_free(small2);
    npualloc_cache_free(large);
    npualloc_cache_free(split_small);
    npualloc_cache_free(split_large);
    check();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_ids_follow_torch_counters),
        cmocka_unit_test_teardown(test_thread_route_sends_only_this_threads_allocations_to_the_pool, stop_runtime),
        cmocka_unit_test_teardown(test_one_recording_per_pool_and_streams_joining_it, stop_runtime),
        cmocka_unit_test_teardown(test_pool_memory_returns_only_when_released_and_free, stop_runtime),
        cmocka_unit_test_teardown(test_pool_empty_releases_that_pool_only_when_freeable, stop_runtime),
        cmocka_unit_test_teardown(test_empty_cache_keeps_default_pools_for_a_capture_begun_during_its_synchronize,
                                  stop_runtime),
        cmocka_unit_test_teardown(test_a_routed_pool_outlives_an_over_released_count, stop_runtime),
        cmocka_unit_test_teardown(test_a_pool_released_while_an_allocation_into_it_waits_outlives_it, stop_runtime),
        cmocka_unit_test_teardown(test_frees_with_stream_uses_wait_for_the_capture_to_end, stop_runtime),
        cmocka_unit_test_teardown(test_pool_empty_waits_for_streams_without_the_allocator_lock, stop_runtime),
        cmocka_unit_test_teardown(test_default_pool_id_is_not_a_private_pool, stop_runtime),
        cmocka_unit_test_teardown(test_use_on_oom_pool_serves_a_default_request_the_device_cannot, stop_runtime),
        cmocka_unit_test_teardown(test_use_on_oom_is_not_for_requests_routed_to_a_private_pool, stop_runtime),
        cmocka_unit_test_teardown(test_use_on_oom_pool_being_recorded_into_fails_the_request, stop_runtime),
        cmocka_unit_test_teardown(test_use_on_oom_is_only_for_a_device_out_of_memory, stop_runtime),
        cmocka_unit_test_teardown(test_use_on_oom_pools_in_marking_order_and_their_lifetime, stop_runtime),
        cmocka_unit_test_teardown(test_no_split_pool_hands_out_whole_segments, stop_runtime),
    };
    return cmocka_run_group_tests_name("pools", tests, NULL, NULL);
}
