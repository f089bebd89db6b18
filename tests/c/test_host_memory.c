/* test_host_memory.c - the caching allocator when host memory for its own metadata runs out: the
 * request fails with ACL_ERROR_BAD_ALLOC and every invariant holds.
 *
 * This program defines aligned_alloc (glibc's behind it), which the allocator's block structs come from,
 * and realloc, which a block's list of streams comes from, and makes them fail on demand.  Not under
 * ASan or TSan, whose own allocator it would replace, nor under valgrind, which replaces the allocator
 * itself: the tests skip there. */
#include <pthread.h>
#include <stdatomic.h>

#include "testutil.h"

#include "host.h"
#include "npualloc_graph.h"

static atomic_bool refuse_aligned, refuse_realloc;
/* The calling thread's own refusals (other threads, a stream's worker among them, allocate as usual). */
static _Thread_local bool refuse_malloc_here, refuse_realloc_here;

static void refuse_host_memory_here(bool refuse)
{
    refuse_malloc_here = refuse;
    refuse_realloc_here = refuse;
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(NPUALLOC_TSAN)
#define INTERPOSED 1
void *__libc_memalign(size_t align, size_t size);
void *__libc_realloc(void *ptr, size_t size);
void *__libc_malloc(size_t size);

void *aligned_alloc(size_t align, size_t size)
{
    return atomic_load(&refuse_aligned) ? NULL : __libc_memalign(align, size);
}

void *realloc(void *ptr, size_t size)
{
    return atomic_load(&refuse_realloc) || refuse_realloc_here ? NULL : __libc_realloc(ptr, size);
}

void *malloc(size_t size) { return refuse_malloc_here ? NULL : __libc_malloc(size); }
#endif

/* Every test begins here: skipped where the allocator cannot be interposed (or valgrind replaced it). */
static void skip_unless_interposed(void)
{
#if !defined(INTERPOSED)
    skip();
#endif
    if (getenv("NPUALLOC_VALGRIND"))
        skip();
}

/* One device, the allocator's default settings. */
static void start_with_defaults(void)
{
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
    start_runtime(1, GiB_, GiB_, 0, 0);
}

static void check(void)
{
    char why[512] = "";
    if (npualloc_cache_check(0, why, sizeof why) != ACL_SUCCESS)
        fail_msg("invariant broken: %s", why);
}

/* With expandable segments a large block starts on a 16 KiB boundary (torch_npu's base_addr_aligned_kb):
 * the unaligned front goes back to the pool as a block of its own.  When the allocation then found no host
 * memory for its split or its pointer-map slot, the aligned block went back next to that free front,
 * unmerged.  What the allocation needs is now got before the front is split off.  Block structs come 64
 * at a time, so where they run out depends on how many were taken before: each parity is tried. */
static void test_no_host_memory_after_aligning_a_block_leaves_no_unmerged_neighbours(void **state)
{
    (void)state;
    skip_unless_interposed();
    setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True", 1);
    for (int taken = 0; taken < 4; taken++) {
        start_runtime(1, 4 * GiB_, 4 * GiB_, 0, 0);
        void *p = NULL;
        for (int i = 0; i <= taken; i++)
            assert_int_equal(npualloc_cache_malloc(0, 1000, 0, &p), ACL_SUCCESS);
        atomic_store(&refuse_aligned, true);
        aclError rc = ACL_SUCCESS;
        for (int round = 0; round < 200 && rc == ACL_SUCCESS; round++) {
            rc = npualloc_cache_malloc(0, 10 * MiB_ + 512, 0, &p); /* leaves an unaligned free tail */
            if (rc == ACL_SUCCESS)
                rc = npualloc_cache_malloc(0, 3 * MiB_, 0, &p); /* found there: aligned, then split */
            check();
        }
        atomic_store(&refuse_aligned, false);
        /* out of host memory for a block's metadata, or for a new segment's (a device out of memory then,
         * as documented) */
        assert_true(rc == ACL_ERROR_BAD_ALLOC || rc == ACL_ERROR_RT_MEMORY_ALLOCATION);
        stop_runtime(NULL);
    }
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
}

/* A record_stream during a capture (here another thread's use_mem_pool) that ran out of host memory left
 * its capture mark behind.  The mark outlived the block, and took from the next block in the same struct
 * a stream recorded before a capture: that block's free, deferred by the next capture, completed without
 * waiting for the stream's queued work, and the next allocation got the block while the stream used it. */
static void test_a_failed_record_stream_during_a_capture_leaves_no_mark(void **state)
{
    (void)state;
    skip_unless_interposed();
    start_with_defaults();
    aclrtStream s = new_stream();
    const uint64_t sid = (uint64_t)(uintptr_t)s;
    const npualloc_mempool_id first = npualloc_mempool_id_new(true), second = npualloc_mempool_id_new(true);
    const size_t size = 12 * MiB_ - 32;
    void *b = NULL, *c = NULL;
    /* a route for a thread that allocates nothing: a capture is underway, and this thread's
     * allocations still come from the default pools */
    assert_int_equal(npualloc_cache_pool_begin(0, first, NPUALLOC_POOL_FILTER_THREAD, 1), ACL_SUCCESS);
    /* a mark made and dropped: the list of marks has room, and only the block's list of streams fails */
    assert_int_equal(npualloc_cache_malloc(0, 1000, 0, &c), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_record_stream(c, sid), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_erase_stream(c, sid), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(c), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_malloc(0, size, 0, &b), ACL_SUCCESS);
    atomic_store(&refuse_realloc, true);
    aclError rc = npualloc_cache_record_stream(b, sid);
    atomic_store(&refuse_realloc, false);
    assert_int_equal(rc, ACL_ERROR_BAD_ALLOC);
    assert_int_equal(npualloc_cache_free(b), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_end(0, first), ACL_SUCCESS);

    assert_int_equal(npualloc_cache_malloc(0, size, 0, &b), ACL_SUCCESS); /* the same block struct */
    assert_int_equal(npualloc_cache_record_stream(b, sid), ACL_SUCCESS);  /* before any capture */
    atomic_int gate;
    hold_stream(s, &gate); /* the stream's work, queued before the free, has not run */
    assert_int_equal(npualloc_cache_pool_begin(0, second, NPUALLOC_POOL_FILTER_THREAD, 1), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(b), ACL_SUCCESS); /* its event waits for the capture's end */
    assert_int_equal(npualloc_cache_pool_end(0, second), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_malloc(0, size, 0, &c), ACL_SUCCESS);
    const bool reused_while_in_use = c == b;
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(c), ACL_SUCCESS);
    check();
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_false(reused_while_in_use);
}

/* A snapshot that ran out of host memory while collecting the segments reported success without them. */
static void test_a_snapshot_out_of_host_memory_fails_instead_of_leaving_segments_out(void **state)
{
    (void)state;
    skip_unless_interposed();
    start_with_defaults();
    void *p = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 1000, 0, &p), ACL_SUCCESS);
    npualloc_snapshot *snap = NULL;
    atomic_store(&refuse_realloc, true);
    aclError rc = npualloc_cache_snapshot(&snap);
    char why[128] = "";
    aclError checked = npualloc_cache_check(0, why, sizeof why);
    atomic_store(&refuse_realloc, false);
    assert_int_equal(rc, ACL_ERROR_BAD_ALLOC);
    assert_null(snap);
    assert_int_equal(checked, ACL_ERROR_BAD_ALLOC); /* not a broken invariant */
    assert_string_equal(why, "out of host memory for the check");
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    assert_int_equal(snap->segment_count, 1);
    npualloc_snapshot_free(snap);
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
}

static atomic_int pool_segments_given, pool_segments_taken;

static void *counted_segment_alloc(size_t size, int device, aclrtStream stream)
{
    (void)device;
    (void)stream;
    void *p = NULL;
    if (aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS)
        return NULL;
    atomic_fetch_add(&pool_segments_taken, 1);
    return p;
}

static void counted_segment_free(void *ptr, size_t size, int device, aclrtStream stream)
{
    (void)size;
    (void)device;
    (void)stream;
    atomic_fetch_add(&pool_segments_given, 1);
    (void)aclrtFree(ptr);
}

/* Shutdown gives every segment back without asking for host memory: it used to collect the segments
 * into a list first, and with no memory for the list it gave none back, so a pool's free function was
 * never told of its segments. */
static void test_shutdown_out_of_host_memory_still_gives_every_segment_back(void **state)
{
    (void)state;
    skip_unless_interposed();
    start_with_defaults();
    atomic_store(&pool_segments_given, 0);
    atomic_store(&pool_segments_taken, 0);
    const npualloc_mempool_id id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_create_with_allocator(0, id, counted_segment_alloc, counted_segment_free),
                     ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_begin(0, id, NPUALLOC_POOL_FILTER_THREAD, (uint64_t)pthread_self()),
                     ACL_SUCCESS);
    void *p[3] = {NULL};
    for (int i = 0; i < 3; i++) /* three large segments, one kept allocated */
        assert_int_equal(npualloc_cache_malloc(0, (size_t)(i + 2) * 10 * MiB_, 0, &p[i]), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(p[0]), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(p[1]), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    assert_int_equal(atomic_load(&pool_segments_taken), 3);
    atomic_store(&refuse_realloc, true);
    atomic_store(&refuse_aligned, true);
    aclError rc = npualloc_shutdown();
    atomic_store(&refuse_realloc, false);
    atomic_store(&refuse_aligned, false);
    assert_int_equal(rc, ACL_SUCCESS);
    assert_int_equal(atomic_load(&pool_segments_given), 3);
}

/* A pool capture whose capture_end found no host memory for its two small lists (the streams, their pool
 * routes) said success, and left the pool's recording route in place for ever (any later capture into the
 * pool: "already recording") and the streams pinned.  capture_end asks for no memory now: it ends them all
 * the same (and npualloc_graph_destroy, which ends a capture first, can rely on that). */
static void test_a_pool_capture_end_without_host_memory_still_ends_the_recording(void **state)
{
    (void)state;
    skip_unless_interposed();
    start_with_defaults();
    aclrtStream s = new_stream(), s2 = new_stream();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    npualloc_capture_params p = {.use_pool = true, .pool = id};
    npualloc_graph *g, *g2;
    assert_int_equal(npualloc_graph_create(0, &g), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_create(0, &g2), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, &p), ACL_SUCCESS);
    void *x = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 1000, (uint64_t)(uintptr_t)s, &x), ACL_SUCCESS);
    refuse_host_memory_here(true);
    aclError ended = npualloc_graph_capture_end(g);
    refuse_host_memory_here(false);
    assert_int_equal(ended, ACL_SUCCESS);
    bool capturing = true;
    assert_int_equal(npualloc_stream_capture_status(s, 0, &capturing, NULL), ACL_SUCCESS);
    assert_false(capturing);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1); /* the graph's reference, not the recording's */
    assert_int_equal(npualloc_graph_capture_begin(g2, s2, 0, &p), ACL_SUCCESS); /* the recording ended */
    assert_int_equal(npualloc_graph_capture_end(g2), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
    npualloc_graph_destroy(g2);
    npualloc_graph_destroy(g);
    check();
}

/* A capture_begin out of host memory for its list of streams said "the stream is already capturing". */
static void test_a_capture_begin_out_of_host_memory_says_so(void **state)
{
    (void)state;
    skip_unless_interposed();
    start_with_defaults();
    aclrtStream s = new_stream();
    npualloc_graph *g;
    assert_int_equal(npualloc_graph_create(0, &g), ACL_SUCCESS);
    refuse_realloc_here = true;
    aclError begun = npualloc_graph_capture_begin(g, s, 0, NULL);
    refuse_realloc_here = false;
    assert_int_equal(begun, ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_string_equal(npualloc_graph_last_error(), "capture_begin: out of host memory");
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, NULL), ACL_SUCCESS); /* nothing was left claimed */
    assert_int_equal(npualloc_graph_capture_end(g), ACL_SUCCESS);
    npualloc_graph_destroy(g);
}

/* npualloc_graph_destroy of a graph being captured ends its capture first: out of host memory too (while
 * capture_end could fail so, the graph was freed with its stream still capturing into it). */
static void test_destroying_a_capturing_graph_without_host_memory_ends_its_capture(void **state)
{
    (void)state;
    skip_unless_interposed();
    start_with_defaults();
    aclrtStream s = new_stream();
    npualloc_graph *g, *next;
    assert_int_equal(npualloc_graph_create(0, &g), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_create(0, &next), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, NULL), ACL_SUCCESS);
    refuse_host_memory_here(true);
    npualloc_graph_destroy(g);
    refuse_host_memory_here(false);
    bool capturing = true;
    assert_int_equal(npualloc_stream_capture_status(s, 0, &capturing, NULL), ACL_SUCCESS);
    assert_false(capturing);
    assert_int_equal(npualloc_graph_capture_begin(next, s, 0, NULL), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_end(next), ACL_SUCCESS);
    npualloc_graph_destroy(next);
}

static void no_op(void *arg) { (void)arg; }

typedef struct self_launch {
    npualloc_graph_exec *e;
    aclrtStream s;
    atomic_int done, gate;
    aclError rc;
} self_launch;

/* A BLOCK callback of s launching a graph on s, out of host memory for the launch's record; it then waits. */
static void cb_launch_without_host_memory(void *arg)
{
    self_launch *r = arg;
    refuse_realloc_here = true;
    r->rc = npualloc_graph_launch(r->e, r->s, 0);
    refuse_realloc_here = false;
    atomic_store(&r->done, 1);
    cb_wait_gate(&r->gate);
}

/* Out of host memory for a launch's record, the launch queued its nodes anyway and waited for them, which a
 * launch from a task of the same stream cannot do: they stayed queued unrecorded, a destroy of the executable
 * did not wait for them, and they ran on freed memory (SIGSEGV).  The launch now fails, queueing nothing. */
static void test_a_launch_without_host_memory_for_its_record_queues_nothing(void **state)
{
    (void)state;
    skip_unless_interposed();
    start_with_defaults();
    aclrtStream s = new_stream();
    npualloc_graph *g;
    assert_int_equal(npualloc_graph_create(0, &g), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(no_op, NULL, ACL_CALLBACK_BLOCK, s), ACL_SUCCESS); /* a host node */
    assert_int_equal(npualloc_graph_capture_end(g), ACL_SUCCESS);
    static self_launch r;
    atomic_store(&r.done, 0);
    atomic_store(&r.gate, 0);
    r.s = s;
    assert_int_equal(npualloc_graph_instantiate(g, &r.e), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_launch_without_host_memory, &r, ACL_CALLBACK_BLOCK, s), ACL_SUCCESS);
    while (!atomic_load(&r.done))
        host_sleep_ns(1000000);
    assert_int_equal(r.rc, ACL_ERROR_RT_MEMORY_ALLOCATION);
    npualloc_graph_exec_destroy(r.e); /* nothing of it is queued */
    npualloc_graph_destroy(g);
    atomic_store(&r.gate, 1);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_no_host_memory_after_aligning_a_block_leaves_no_unmerged_neighbours,
                                  stop_runtime),
        cmocka_unit_test_teardown(test_a_failed_record_stream_during_a_capture_leaves_no_mark, stop_runtime),
        cmocka_unit_test_teardown(test_a_snapshot_out_of_host_memory_fails_instead_of_leaving_segments_out,
                                  stop_runtime),
        cmocka_unit_test_teardown(test_shutdown_out_of_host_memory_still_gives_every_segment_back, stop_runtime),
        cmocka_unit_test_teardown(test_a_pool_capture_end_without_host_memory_still_ends_the_recording, stop_runtime),
        cmocka_unit_test_teardown(test_a_launch_without_host_memory_for_its_record_queues_nothing, stop_runtime),
        cmocka_unit_test_teardown(test_a_capture_begin_out_of_host_memory_says_so, stop_runtime),
        cmocka_unit_test_teardown(test_destroying_a_capturing_graph_without_host_memory_ends_its_capture, stop_runtime),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
