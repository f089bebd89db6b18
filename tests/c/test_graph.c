/* test_graph.c - captured graphs with planned memory (csrc/graph.c, npualloc_graph.h). */
#include <pthread.h>
#include <unistd.h>

#include "testutil.h"

#include "graph.h"
#include "host.h"
#include "npualloc_graph.h"
#include "vmm.h"

static void start(void)
{
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
    start_runtime(2, 4 * GiB_, 4 * GiB_, 0, 0);
}

static aclrtEvent new_event(void)
{
    aclrtEvent e;
    assert_int_equal(aclrtCreateEvent(&e), ACL_SUCCESS);
    return e;
}

static uint64_t sh(aclrtStream s) { return (uint64_t)(uintptr_t)s; }

static void *galloc_on(aclrtStream s, size_t n)
{
    void *p = NULL;
    aclError rc = npualloc_cache_malloc(0, n, sh(s), &p);
    if (rc != ACL_SUCCESS)
        fail_msg("graph alloc failed: %d %s", rc, npualloc_last_error(NULL));
    return p;
}

/* Pinned (aclrtMallocHost) host memory, zeroed: a captured copy must not use pageable memory, whose
 * "asynchronous" copy is a synchronous one, refused on a capturing stream. */
static void *pinned_host(size_t n)
{
    void *p = NULL;
    assert_int_equal(aclrtMallocHost(&p, n), ACL_SUCCESS);
    memset(p, 0, n);
    return p;
}

static npualloc_graph *new_graph(uint32_t flags)
{
    npualloc_graph *g;
    assert_int_equal(npualloc_graph_create(flags, &g), ACL_SUCCESS);
    return g;
}

static void begin(npualloc_graph *g, aclrtStream s)
{
    aclError rc = npualloc_graph_capture_begin(g, s, 0, NULL);
    if (rc != ACL_SUCCESS)
        fail_msg("capture_begin: %d %s", rc, npualloc_graph_last_error());
}

static void end(npualloc_graph *g)
{
    aclError rc = npualloc_graph_capture_end(g);
    if (rc != ACL_SUCCESS)
        fail_msg("capture_end: %d %s", rc, npualloc_graph_last_error());
}

/* s2 joins s1's capture (s2 waits for an event recorded on s1). */
static void fork_to(aclrtStream from, aclrtStream to)
{
    aclrtEvent e = new_event();
    assert_int_equal(aclrtRecordEvent(e, from), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(to, e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
}

static void test_chain_reuses_freed_address(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_graph *g = new_graph(0);
    begin(g, s);
    bool cap = false;
    assert_int_equal(npualloc_stream_capture_status(s, 0, &cap, NULL), ACL_SUCCESS);
    assert_true(cap);
    void *a = galloc_on(s, 1000);
    assert_int_equal(npualloc_cache_free(a), ACL_SUCCESS);
    void *b = galloc_on(s, 1000);
    assert_ptr_equal(a, b); /* the FREE of a is an ancestor of b's ALLOC */
    void *c = galloc_on(s, 1000);
    assert_ptr_not_equal(b, c); /* b is live */
    assert_int_equal(npualloc_cache_free(b), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(c), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(c), ACL_ERROR_INVALID_PARAM); /* double free */
    end(g);
    assert_int_equal(npualloc_stream_capture_status(s, 0, &cap, NULL), ACL_SUCCESS);
    assert_false(cap);
    npualloc_graph_plan p;
    assert_int_equal(npualloc_graph_get_plan(g, &p), ACL_SUCCESS);
    assert_int_equal(p.alloc_count, 3);
    assert_int_equal(p.footprint, 2048);
    assert_int_equal(p.lower_bound, 2048);
    assert_int_equal(npualloc_graph_node_count(g), 6);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
}

/* The graph's range is the device's memory (4 GiB here): what the live allocations leave is all a new
 * one may take, and a refusal leaves the capture usable.  raw_alloc has no 1 EB check: on a capturing
 * stream such a size is the graph's to refuse too, not an allocation of the ordinary cache outside the
 * graph, which is never asked. */
static void test_graph_memory_is_the_devices_memory(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_graph *g = new_graph(0);
    begin(g, s);
    void *p = (void *)0x1;
    assert_int_equal(npualloc_cache_malloc(0, (size_t)1 << 61, sh(s), &p), ACL_ERROR_RT_DEVICE_OOM);
    assert_non_null(strstr(npualloc_last_error(NULL), "cannot fit in graph memory"));
    assert_int_equal(npualloc_cache_malloc(0, 5 * GiB_, sh(s), &p), ACL_ERROR_RT_DEVICE_OOM);
    assert_non_null(strstr(npualloc_last_error(NULL), "graph memory of device 0 is exhausted"));
    void *a = galloc_on(s, 3 * GiB_);
    assert_int_equal(npualloc_cache_malloc(0, 2 * GiB_, sh(s), &p), ACL_ERROR_RT_DEVICE_OOM);
    assert_int_equal(npualloc_cache_free(a), ACL_SUCCESS);
    void *b = galloc_on(s, 2 * GiB_); /* a's free precedes it: a's range is free again */
    assert_ptr_equal(b, a);
    assert_int_equal(npualloc_cache_free(b), ACL_SUCCESS);
    npualloc_stats st;
    assert_int_equal(npualloc_cache_get_stats(0, &st), ACL_SUCCESS);
    assert_int_equal(st.num_ooms, 0); /* the device's cache was not asked */
    end(g);
    npualloc_graph_plan plan;
    assert_int_equal(npualloc_graph_get_plan(g, &plan), ACL_SUCCESS);
    assert_int_equal(plan.alloc_count, 2);
    assert_int_equal(plan.footprint, 3 * GiB_);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
}

/* a -> (x on s1 | y on s2) -> z: x and y may run at once, z follows both frees. */
static void test_diamond(void **state)
{
    (void)state;
    start();
    aclrtStream s1 = new_stream(), s2 = new_stream();
    npualloc_graph *g = new_graph(0);
    begin(g, s1);
    void *a = galloc_on(s1, 4096);
    assert_int_equal(aclrtMemsetAsync(a, 4096, 1, 4096, s1), ACL_SUCCESS);
    fork_to(s1, s2);
    void *x = galloc_on(s1, 8192);
    assert_int_equal(aclrtMemcpyAsync(x, 8192, a, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE, s1), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
    void *y = galloc_on(s2, 8192);
    assert_int_equal(aclrtMemcpyAsync(y, 8192, a, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE, s2), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(y), ACL_SUCCESS);
    /* x and y are on concurrent branches: y cannot take x's range although x was freed first */
    assert_true((char *)y >= (char *)x + 8192 || (char *)y + 8192 <= (char *)x);
    fork_to(s2, s1); /* join */
    void *z = galloc_on(s1, 8192);
    assert_true(z == x || z == y); /* after the join both ranges are free */
    assert_int_equal(npualloc_cache_free(z), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(a), ACL_SUCCESS);
    end(g);
    npualloc_graph_plan p;
    assert_int_equal(npualloc_graph_get_plan(g, &p), ACL_SUCCESS);
    assert_int_equal(p.stream_count, 2);
    assert_int_equal(p.footprint, 4096 + 8192 + 8192);
    assert_int_equal(p.lower_bound, 4096 + 8192 + 8192); /* {a, x, y} pairwise conflict */
    /* The dependencies: z's ALLOC follows both frees. */
    npualloc_graph_alloc za;
    assert_int_equal(npualloc_graph_get_alloc(g, 3, &za), ACL_SUCCESS);
    npualloc_graph_node zn;
    assert_int_equal(npualloc_graph_get_node(g, za.alloc_node, &zn), ACL_SUCCESS);
    assert_int_equal(zn.kind, NPUALLOC_GRAPH_NODE_ALLOC);
    assert_int_equal(zn.dep_count, 2);
    /* Run it. */
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    assert_ptr_equal(npualloc_graph_exec_graph(e), g);
    assert_null(npualloc_graph_exec_graph(NULL));
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(npualloc_graph_launch(e, s1, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s1), ACL_SUCCESS);
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
}

/* An event's capture point is its latest record's: a record in another capture moves it there, and
 * a record outside every capture erases it. */
static void test_an_events_latest_record_decides_its_capture(void **state)
{
    (void)state;
    start();
    aclrtStream s1 = new_stream(), s2 = new_stream(), s3 = new_stream(), plain = new_stream();
    npualloc_graph *g1 = new_graph(0), *g2 = new_graph(0);
    begin(g1, s1);
    begin(g2, s2);
    aclrtEvent e = new_event();
    assert_int_equal(aclrtRecordEvent(e, s1), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, s2), ACL_SUCCESS); /* now g2's */
    assert_int_equal(aclrtStreamWaitEvent(s3, e), ACL_SUCCESS);  /* s3 joins g2, not g1 */
    /* g1 cannot wait for a point of g2; the refusal leaves both captures as they were */
    assert_int_equal(aclrtStreamWaitEvent(s1, e), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_non_null(strstr(npualloc_graph_last_error(), "recorded in another capture"));
    assert_int_equal(aclrtRecordEvent(e, plain), ACL_SUCCESS); /* erased from g2 */
    /* the event is an outside one now: a capturing stream's wait adds nothing, a plain stream's
     * wait is an ordinary wait and joins no capture */
    assert_int_equal(aclrtStreamWaitEvent(s1, e), ACL_SUCCESS);
    aclrtStream s4 = new_stream();
    assert_int_equal(aclrtStreamWaitEvent(s4, e), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s4), ACL_SUCCESS);
    fork_to(s3, s2); /* join s3 back */
    end(g1);
    end(g2);
    npualloc_graph_plan p1, p2;
    assert_int_equal(npualloc_graph_get_plan(g1, &p1), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_get_plan(g2, &p2), ACL_SUCCESS);
    assert_int_equal(p1.stream_count, 1);
    assert_int_equal(p2.stream_count, 2);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    npualloc_graph_destroy(g1);
    npualloc_graph_destroy(g2);
}

static void test_unjoined_stream_fails_the_capture(void **state)
{
    (void)state;
    start();
    aclrtStream s1 = new_stream(), s2 = new_stream();
    npualloc_graph *g = new_graph(0);
    begin(g, s1);
    fork_to(s1, s2);
    void *p = galloc_on(s2, 100);
    (void)p;
    assert_int_equal(npualloc_graph_capture_end(g), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    bool cap = true;
    assert_int_equal(npualloc_stream_capture_status(s2, 0, &cap, NULL), ACL_SUCCESS);
    assert_false(cap);
    npualloc_graph_exec *e;
    assert_int_not_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    npualloc_graph_destroy(g);
}

/* Two graphs on one stream share pages: what one writes through its range, the other reads
 * through its own (separate) range. */
static void test_graphs_on_one_stream_alias(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream(), other = new_stream();
    char *host_src = pinned_host(4096), *host_dst = pinned_host(4096);
    memset(host_src, 0x5a, 4096);
    npualloc_graph *g1 = new_graph(0), *g2 = new_graph(0);
    begin(g1, s);
    void *x = galloc_on(s, 4096);
    assert_int_equal(aclrtMemcpyAsync(x, 4096, host_src, 4096, ACL_MEMCPY_HOST_TO_DEVICE, s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
    end(g1);
    begin(g2, s);
    void *y = galloc_on(s, 4096);
    assert_int_equal(aclrtMemcpyAsync(host_dst, 4096, y, 4096, ACL_MEMCPY_DEVICE_TO_HOST, s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(y), ACL_SUCCESS);
    end(g2);
    assert_ptr_not_equal(x, y);
    npualloc_graph_exec *e1, *e2;
    assert_int_equal(npualloc_graph_instantiate(g1, &e1), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_instantiate(g2, &e2), ACL_SUCCESS);
    npualloc_vmm_counts before;
    npualloc_vmm_counts_get(&before);
    assert_int_equal(npualloc_graph_launch(e1, s, 0), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e2, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal((unsigned char)host_dst[0], 0x5a);
    assert_int_equal((unsigned char)host_dst[4095], 0x5a);
    npualloc_vmm_counts after;
    npualloc_vmm_counts_get(&after);
    assert_int_equal(after.physical_handles - before.physical_handles, 1); /* one 2 MiB chunk for both */
    assert_int_equal(after.mappings - before.mappings, 2);
    /* The data changes between launches; the other graph sees it. */
    memset(host_src, 0x33, 4096);
    assert_int_equal(npualloc_graph_launch(e1, s, 0), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e2, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal((unsigned char)host_dst[100], 0x33);
    /* On another stream, g2 gets other pages: it no longer sees g1's data. */
    memset(host_dst, 0, 4096);
    assert_int_equal(npualloc_graph_launch(e2, other, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(other), ACL_SUCCESS);
    assert_int_equal((unsigned char)host_dst[100], 0);
    npualloc_graph_exec_destroy(e1);
    npualloc_graph_exec_destroy(e2);
    npualloc_vmm_counts_get(&after);
    assert_int_equal(after.physical_handles, before.physical_handles);
    assert_int_equal(after.mappings, before.mappings);
    npualloc_graph_destroy(g1);
    npualloc_graph_destroy(g2);
    assert_int_equal(aclrtFreeHost(host_src), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(host_dst), ACL_SUCCESS);
}

struct graph_pair {
    npualloc_graph *g;
    npualloc_graph_exec *e;
};

static void cb_destroy_graph(void *user)
{
    struct graph_pair *p = user;
    npualloc_graph_exec_destroy(p->e);
    npualloc_graph_destroy(p->g);
}

/* Destroyed by a task of the stream its launches are queued on, behind that task: the destroy cannot
 * wait there, so a thread of its own waits for them, then frees the graph's nodes and pages. */
static void test_exec_destroyed_by_a_callback_finishes_its_queued_launches(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    char *host_src = pinned_host(4096), *host_dst = pinned_host(4096);
    memset(host_src, 0x6b, 4096);
    npualloc_vmm_counts before;
    npualloc_vmm_counts_get(&before);
    static struct graph_pair pair;
    pair.g = new_graph(0);
    begin(pair.g, s);
    void *x = galloc_on(s, 4096);
    assert_int_equal(aclrtMemcpyAsync(x, 4096, host_src, 4096, ACL_MEMCPY_HOST_TO_DEVICE, s), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(host_dst, 4096, x, 4096, ACL_MEMCPY_DEVICE_TO_HOST, s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
    end(pair.g);
    assert_int_equal(npualloc_graph_instantiate(pair.g, &pair.e), ACL_SUCCESS);
    static atomic_int gate;
    hold_stream(s, &gate);
    assert_int_equal(aclrtLaunchCallback(cb_destroy_graph, &pair, ACL_CALLBACK_BLOCK, s), ACL_SUCCESS);
    for (int i = 0; i < 3; i++)
        assert_int_equal(npualloc_graph_launch(pair.e, s, 0), ACL_SUCCESS);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS); /* the launches ran on live nodes */
    assert_int_equal((unsigned char)host_dst[0], 0x6b);
    assert_int_equal((unsigned char)host_dst[4095], 0x6b);
    npualloc_vmm_counts after;
    for (int waited = 0; waited < 5000; waited++) { /* the destroying thread finishes after the launches */
        npualloc_vmm_counts_get(&after);
        if (after.mappings == before.mappings && after.physical_handles == before.physical_handles)
            break;
        host_sleep_ns(1000000);
    }
    assert_int_equal(after.mappings, before.mappings);
    assert_int_equal(after.physical_handles, before.physical_handles);
    assert_int_equal(aclrtFreeHost(host_src), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(host_dst), ACL_SUCCESS);
}

static void test_checked_graph_reports_use_after_free(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_graph *g = new_graph(NPUALLOC_GRAPH_CHECKED);
    begin(g, s);
    void *x = galloc_on(s, 4096);
    assert_int_equal(aclrtMemsetAsync(x, 4096, 0, 4096, s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
    assert_int_equal(aclrtMemsetAsync(x, 4096, 0, 4096, s), ACL_ERROR_RT_PARAM_INVALID);
    void *y = galloc_on(s, 4096);
    assert_ptr_equal(x, y);
    assert_int_equal(aclrtMemsetAsync(x, 4096, 0, 4096, s), ACL_SUCCESS); /* y lives there now */
    end(g);
    assert_int_equal(npualloc_graph_violation_count(g), 1);
    char msg[512];
    assert_true(npualloc_graph_violation(g, 0, msg, sizeof msg));
    assert_non_null(strstr(msg, "after"));
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_ERROR_RT_PARAM_INVALID);
    npualloc_graph_destroy(g);
}

/* A graph's address range is the runtime's: a program's aclrtUnmapMem, aclrtReleaseMemAddress or
 * aclrtMapMem on it is refused while it is mapped for a launch and after, and launches go on. */
static void test_user_cannot_unmap_release_or_map_a_graphs_range(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_graph *g = new_graph(0);
    begin(g, s);
    char *out = galloc_on(s, 4096); /* the first block: at the range's base, where chunk 0 is mapped */
    assert_int_equal(aclrtMemsetAsync(out, 4096, 7, 4096, s), ACL_SUCCESS);
    end(g);
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtUnmapMem(out), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReleaseMemAddress(out), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtMemsetAsync(out, 4096, 0, 4096, s), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    char buf[16];
    assert_int_equal(aclrtMemcpy(buf, sizeof buf, out, sizeof buf, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(buf[15], 7);
    /* unbound: nothing mapped, the range still the graph's */
    npualloc_graph_exec_destroy(e);
    aclrtDrvMemHandle h = NULL;
    aclrtPhysicalMemProp prop = hbm_prop(ACL_HBM_MEM_HUGE, 0);
    assert_int_equal(aclrtMallocPhysical(&h, 2 * MiB_, &prop, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMapMem(out, 2 * MiB_, 0, h, 0), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtReleaseMemAddress(out), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(npualloc_cache_free(out), ACL_SUCCESS);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.reservations, 0); /* the graph released its range */
    assert_int_equal(c.mappings, 0);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
}

static void test_checked_output_and_host_access_after_launch(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_graph *g = new_graph(NPUALLOC_GRAPH_CHECKED);
    begin(g, s);
    void *tmp = galloc_on(s, 4096);
    assert_int_equal(aclrtMemsetAsync(tmp, 4096, 7, 4096, s), ACL_SUCCESS);
    void *out = galloc_on(s, 4096);
    assert_int_equal(aclrtMemcpyAsync(out, 4096, tmp, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE, s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(tmp), ACL_SUCCESS);
    end(g);
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    char buf[4096];
    assert_int_equal(aclrtMemcpy(buf, sizeof buf, out, 4096, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(buf[0], 7);
    assert_int_equal(aclrtMemcpy(buf, sizeof buf, tmp, 4096, ACL_MEMCPY_DEVICE_TO_HOST), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(npualloc_graph_violation_count(g), 1);
    /* Freeing an output after the capture: the memory goes with the graph. */
    assert_int_equal(npualloc_cache_free(out), ACL_SUCCESS);
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
}

static void test_access_is_frozen_at_capture(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    void *dev1 = NULL;
    assert_int_equal(aclrtMalloc(&dev1, 4096, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_set_mem_access(0, 0), ACL_SUCCESS);
    npualloc_graph *g1 = new_graph(0), *g2 = new_graph(0);
    begin(g1, s);
    void *x = galloc_on(s, 4096);
    /* inside the capture: device 1 has no access to x */
    assert_int_equal(aclrtMemcpyAsync(dev1, 4096, x, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE, s),
                     ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    end(g1);
    assert_int_equal(npualloc_graph_set_mem_access(0, 2), ACL_SUCCESS);
    begin(g2, s);
    void *y = galloc_on(s, 4096);
    assert_int_equal(aclrtMemcpyAsync(dev1, 4096, y, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE, s), ACL_SUCCESS);
    end(g2);
    npualloc_graph_alloc ax, ay;
    assert_int_equal(npualloc_graph_get_alloc(g1, 0, &ax), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_get_alloc(g2, 0, &ay), ACL_SUCCESS);
    assert_int_equal(ax.access_mask, 1);
    assert_int_equal(ay.access_mask, 3);
    npualloc_graph_exec *e1, *e2;
    assert_int_equal(npualloc_graph_instantiate(g1, &e1), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_instantiate(g2, &e2), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e1, s, 0), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e2, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    /* x (an output of g1) stays device-0 only even with peer access enabled */
    assert_int_equal(aclrtDeviceEnablePeerAccess(1, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(dev1, 4096, x, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtMemcpy(dev1, 4096, y, 4096, ACL_MEMCPY_DEVICE_TO_DEVICE), ACL_SUCCESS);
    npualloc_graph_exec_destroy(e1);
    npualloc_graph_exec_destroy(e2);
    npualloc_graph_destroy(g1);
    npualloc_graph_destroy(g2);
    assert_int_equal(aclrtFree(dev1), ACL_SUCCESS);
}

static int host_runs;
static int host_destroyed;
static void host_fn(void *data) { host_runs += *(int *)data; }
static void host_destroy(void *data)
{
    (void)data;
    host_destroyed++;
}

static void test_host_and_delay_nodes_run_at_every_launch(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    static int one = 1;
    host_runs = host_destroyed = 0;
    npualloc_graph *g = new_graph(0);
    begin(g, s);
    assert_int_equal(npualloc_launch_host_func(s, host_fn, &one, host_destroy, ACL_CALLBACK_BLOCK), ACL_SUCCESS);
    assert_int_equal(npualloc_sleep_async(s, 0.001), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(host_fn, &one, ACL_CALLBACK_BLOCK, s), ACL_SUCCESS);
    end(g);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(host_runs, 0); /* captured, not run */
    npualloc_graph_node n;
    assert_int_equal(npualloc_graph_get_node(g, 1, &n), ACL_SUCCESS);
    assert_int_equal(n.kind, NPUALLOC_GRAPH_NODE_DELAY);
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    for (int i = 0; i < 3; i++)
        assert_int_equal(npualloc_graph_launch(e, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(host_runs, 6);
    npualloc_graph_exec_destroy(e);
    assert_int_equal(host_destroyed, 0);
    npualloc_graph_destroy(g);
    assert_int_equal(host_destroyed, 1);
    /* Outside a capture it runs once and releases its data. */
    assert_int_equal(npualloc_launch_host_func(s, host_fn, &one, host_destroy, ACL_CALLBACK_BLOCK), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(host_runs, 7);
    assert_int_equal(host_destroyed, 2);
}

static void test_pool_capture_uses_the_private_pool(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    npualloc_capture_params p = {.use_pool = true, .pool = id};
    npualloc_graph *g = new_graph(0);
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, &p), ACL_SUCCESS);
    /* torch: beginAllocateToPool's one reference, kept by the graph after the capture */
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1);
    void *x = galloc_on(s, 1000);
    assert_int_equal(aclrtMemsetAsync(x, 1000, 3, 1000, s), ACL_SUCCESS);
    end(g);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1);
    int32_t dev;
    uint64_t stream;
    size_t size;
    assert_int_equal(npualloc_cache_block_info(x, &dev, &stream, &size), ACL_SUCCESS); /* a real block */
    npualloc_graph_plan plan;
    assert_int_equal(npualloc_graph_get_plan(g, &plan), ACL_SUCCESS);
    assert_true(plan.pool_mode);
    assert_int_equal(plan.alloc_count, 0);
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    char b[4];
    assert_int_equal(aclrtMemcpy(b, 4, x, 4, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(b[0], 3);
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 0);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
}

/* Is x in a segment of pool id? */
static bool in_pool(const void *x, npualloc_mempool_id id)
{
    npualloc_snapshot *snap;
    assert_int_equal(npualloc_cache_snapshot(&snap), ACL_SUCCESS);
    bool found = false;
    for (size_t i = 0; i < snap->segment_count; i++) {
        const npualloc_segment_info *seg = &snap->segments[i];
        if ((uintptr_t)x >= seg->address && (uintptr_t)x < seg->address + seg->total_size)
            found = seg->pool_id[0] == id.first && seg->pool_id[1] == id.second;
    }
    npualloc_snapshot_free(snap);
    return found;
}

/* Pool captures: a stream joining the capture allocates from its pool; a second capture into
 * the same pool while the first records is refused (torch) and leaves the use count alone. */
static void test_pool_capture_joined_stream_and_no_second_recording(void **state)
{
    (void)state;
    start();
    aclrtStream s1 = new_stream(), s2 = new_stream(), s3 = new_stream();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    npualloc_capture_params p = {.use_pool = true, .pool = id};
    npualloc_graph *g = new_graph(0), *g2 = new_graph(0);
    assert_int_equal(npualloc_graph_capture_begin(g, s1, 0, &p), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_begin(g2, s3, 0, &p), ACL_ERROR_INVALID_PARAM);
    assert_string_equal(npualloc_graph_last_error(),
                        "capture_begin: beginAllocateToPool: already recording to mempool_id");
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1); /* g's recording only, not g2 */
    fork_to(s1, s2);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1); /* s2 joins under that reference (torch) */
    void *x = galloc_on(s2, 1000);
    fork_to(s2, s1);
    end(g);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 1);
    assert_true(in_pool(x, id));
    /* The recording ended: the next capture shares the pool. */
    assert_int_equal(npualloc_graph_capture_begin(g2, s3, 0, &p), ACL_SUCCESS);
    end(g2);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 2);
    npualloc_graph_destroy(g);
    npualloc_graph_destroy(g2);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 0);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
}

static void test_stale_graph_after_shutdown(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_graph *g = new_graph(0);
    begin(g, s);
    void *x = galloc_on(s, 100);
    (void)x;
    end(g);
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e, s, 0), ACL_SUCCESS);
    npualloc_shutdown();
    assert_int_not_equal(npualloc_graph_launch(e, NULL, 0), ACL_SUCCESS);
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
}

/* A graph still capturing when the runtime is shut down and restarted: dropping it must not touch
 * the new runtime's address range, which starts where the stale graph's did. */
static void test_stale_capture_end_keeps_the_new_graphs_range(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_graph *old = new_graph(0);
    begin(old, s);
    void *x = galloc_on(s, 3 * MiB_); /* the stale plan would map 4 MiB, the new one maps 2 MiB */
    start();
    aclrtStream s2 = new_stream();
    npualloc_graph *g = new_graph(0);
    begin(g, s2);
    void *y = galloc_on(s2, 4096);
    assert_ptr_equal(x, y);
    assert_int_equal(aclrtMemsetAsync(y, 4096, 7, 4096, s2), ACL_SUCCESS); /* an output of g */
    end(g);
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.reservations, 1);
    npualloc_graph_destroy(old); /* ends the stale capture */
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.reservations, 1); /* g's range is still reserved */
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e, s2, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s2), ACL_SUCCESS);
    char b[4];
    assert_int_equal(aclrtMemcpy(b, 4, y, 4, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(b[0], 7);
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
}

/* The same for a pool capture: ending the stale capture must not end the new runtime's recording
 * to a pool of the same id. */
static void test_stale_pool_capture_end_keeps_the_new_recording(void **state)
{
    (void)state;
    start();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    npualloc_capture_params p = {.use_pool = true, .pool = id};
    aclrtStream s = new_stream();
    npualloc_graph *old = new_graph(0);
    assert_int_equal(npualloc_graph_capture_begin(old, s, 0, &p), ACL_SUCCESS);
    start();
    aclrtStream s2 = new_stream();
    npualloc_graph *g = new_graph(0);
    assert_int_equal(npualloc_graph_capture_begin(g, s2, 0, &p), ACL_SUCCESS);
    int uses = npualloc_cache_pool_use_count(0, id);
    assert_int_equal(npualloc_graph_capture_end(old), ACL_ERROR_INVALID_PARAM);
    assert_string_equal(npualloc_graph_last_error(), "capture_end: the graph belongs to a runtime that was shut down");
    assert_int_equal(npualloc_cache_pool_use_count(0, id), uses);
    void *x = galloc_on(s2, 1000);
    assert_true(in_pool(x, id)); /* g still records to the pool */
    end(g);
    npualloc_graph_destroy(old);
    npualloc_graph_destroy(g);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
}

/* Captures, launches and ordinary work on several threads at once (locks, under ASAN/TSAN). */
typedef struct worker_arg {
    int id;
    int errors;
} worker_arg;

static void *capture_worker(void *p)
{
    worker_arg *w = p;
    if (aclrtSetDevice(0) != ACL_SUCCESS) {
        w->errors++;
        return NULL;
    }
    aclrtStream s;
    if (aclrtCreateStream(&s) != ACL_SUCCESS) {
        w->errors++;
        return NULL;
    }
    char *src = NULL, *dst = NULL; /* pinned: these copies are captured */
    if (aclrtMallocHost((void **)&src, 256) != ACL_SUCCESS || aclrtMallocHost((void **)&dst, 256) != ACL_SUCCESS) {
        w->errors++;
        return NULL;
    }
    for (int round = 0; round < 20; round++) {
        memset(src, w->id + round, 256);
        if (w->id % 2 == 0) { /* ordinary work on this thread's stream meanwhile */
            void *p2 = NULL;
            if (npualloc_cache_malloc(0, 256, sh(s), &p2) != ACL_SUCCESS ||
                aclrtMemcpyAsync(p2, 256, src, 256, ACL_MEMCPY_HOST_TO_DEVICE, s) != ACL_SUCCESS ||
                aclrtMemcpyAsync(dst, 256, p2, 256, ACL_MEMCPY_DEVICE_TO_HOST, s) != ACL_SUCCESS ||
                aclrtSynchronizeStream(s) != ACL_SUCCESS || dst[7] != (char)(w->id + round) ||
                npualloc_cache_free(p2) != ACL_SUCCESS)
                w->errors++;
        }
        npualloc_graph *g;
        if (npualloc_graph_create(round % 3 == 0 ? NPUALLOC_GRAPH_CHECKED : 0, &g) != ACL_SUCCESS) {
            w->errors++;
            continue;
        }
        void *x = NULL;
        bool ok = npualloc_graph_capture_begin(g, s, 0, NULL) == ACL_SUCCESS &&
                  npualloc_cache_malloc(0, 256, sh(s), &x) == ACL_SUCCESS &&
                  aclrtMemcpyAsync(x, 256, src, 256, ACL_MEMCPY_HOST_TO_DEVICE, s) == ACL_SUCCESS &&
                  aclrtMemcpyAsync(dst, 256, x, 256, ACL_MEMCPY_DEVICE_TO_HOST, s) == ACL_SUCCESS &&
                  npualloc_cache_free(x) == ACL_SUCCESS && npualloc_graph_capture_end(g) == ACL_SUCCESS;
        npualloc_graph_exec *e = NULL;
        ok = ok && npualloc_graph_instantiate(g, &e) == ACL_SUCCESS && npualloc_graph_launch(e, s, 0) == ACL_SUCCESS &&
             aclrtSynchronizeStream(s) == ACL_SUCCESS && dst[100] == (char)(w->id + round);
        if (!ok)
            w->errors++;
        npualloc_graph_exec_destroy(e);
        npualloc_graph_destroy(g);
    }
    if (aclrtDestroyStream(s) != ACL_SUCCESS)
        w->errors++;
    if (aclrtFreeHost(src) != ACL_SUCCESS || aclrtFreeHost(dst) != ACL_SUCCESS)
        w->errors++;
    return NULL;
}

static void test_concurrent_captures(void **state)
{
    (void)state;
    start();
    pthread_t t[4];
    worker_arg w[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (worker_arg){.id = i};
        pthread_create(&t[i], NULL, capture_worker, &w[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(t[i], NULL);
        assert_int_equal(w[i].errors, 0);
    }
    assert_int_equal(npualloc_cache_empty(), ACL_SUCCESS); /* the ordinary work's cached segments */
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.mappings, 0); /* every graph's memory went with it */
    assert_int_equal(c.physical_handles, 0);
}

static void test_access_setting_is_forgotten_on_restart(void **state)
{
    (void)state;
    start();
    assert_int_equal(npualloc_graph_set_mem_access(0, 2), ACL_SUCCESS);
    uint64_t m = 0;
    assert_int_equal(npualloc_graph_get_mem_access(0, &m), ACL_SUCCESS);
    assert_int_equal(m, 3);
    assert_int_equal(npualloc_graph_set_mem_access(0, 4), ACL_ERROR_RT_INVALID_DEVICEID); /* 2 devices */
    start();
    assert_int_equal(npualloc_graph_get_mem_access(0, &m), ACL_SUCCESS);
    assert_int_equal(m, 1);
}

/* A NULL output is ACL_ERROR_INVALID_PARAM, as for every other function, whatever the device. */
static void test_get_mem_access_rejects_a_null_output(void **state)
{
    (void)state;
    start();
    assert_int_equal(npualloc_graph_get_mem_access(0, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_graph_get_mem_access(-1, NULL), ACL_ERROR_INVALID_PARAM);
    uint64_t m = 0;
    assert_int_equal(npualloc_graph_get_mem_access(2, &m), ACL_ERROR_RT_INVALID_DEVICEID); /* 2 devices */
    assert_int_equal(m, 0);
}

/* aclrtMemcpy2dAsync on a capturing stream: one MEMCPY node per row, in order; each launch copies
 * the rows. */
static void test_memcpy2d_async_captures_a_node_per_row(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    char *host_src = pinned_host(3 * 16), *host_dst = pinned_host(3 * 64);
    for (int i = 0; i < 3 * 16; i++)
        host_src[i] = (char)(i + 1);
    npualloc_graph *g = new_graph(0);
    begin(g, s);
    char *x = galloc_on(s, 3 * 64);
    assert_int_equal(aclrtMemsetAsync(x, 3 * 64, 0, 3 * 64, s), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy2dAsync(x, 64, host_src, 16, 16, 3, ACL_MEMCPY_HOST_TO_DEVICE, s), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(host_dst, 3 * 64, x, 3 * 64, ACL_MEMCPY_DEVICE_TO_HOST, s),
                     ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
    end(g);
    size_t rows = 0;
    for (size_t i = 0; i < npualloc_graph_node_count(g); i++) {
        npualloc_graph_node n;
        assert_int_equal(npualloc_graph_get_node(g, i, &n), ACL_SUCCESS);
        if (n.kind == NPUALLOC_GRAPH_NODE_MEMCPY && n.count == 16) {
            assert_int_equal(n.dst, (uintptr_t)x + rows * 64);
            assert_int_equal(n.src, (uintptr_t)host_src + rows * 16);
            rows++;
        }
    }
    assert_int_equal(rows, 3);
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    for (int launch = 0; launch < 2; launch++) {
        memset(host_dst, 0x7f, 3 * 64);
        host_src[0] = (char)(50 + launch);
        assert_int_equal(npualloc_graph_launch(e, s, 0), ACL_SUCCESS);
        assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
        for (int r = 0; r < 3; r++) {
            assert_memory_equal(host_dst + r * 64, host_src + r * 16, 16);
            for (int b = 16; b < 64; b++)
                assert_int_equal(host_dst[r * 64 + b], 0);
        }
    }
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtFreeHost(host_src), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(host_dst), ACL_SUCCESS);
}

/* ---- capture modes (acl_rt.h, aclmdlRICaptureMode) ---- */

static char host_buf[64];
static void *dev_buf;

static aclError unsafe_copy(void) { return aclrtMemcpy(host_buf, 64, dev_buf, 64, ACL_MEMCPY_DEVICE_TO_HOST); }
static aclError unsafe_set(void) { return aclrtMemset(dev_buf, 64, 7, 64); }
static aclError unsafe_copy2d(void)
{
    return aclrtMemcpy2d(host_buf, 32, dev_buf, 32, 16, 2, ACL_MEMCPY_DEVICE_TO_HOST);
}

typedef struct other_thread {
    int32_t device;                /* the thread's current device; -1: none */
    int exchange;                  /* its exchange mode first; -1: leave it at GLOBAL */
    aclError copy, set, exchanged; /* results */
} other_thread;

static void *other_thread_main(void *arg)
{
    other_thread *t = arg;
    t->exchanged = ACL_SUCCESS;
    if (t->device >= 0 && aclrtSetDevice(t->device) != ACL_SUCCESS)
        t->exchanged = -1;
    if (t->exchange >= 0) {
        aclmdlRICaptureMode m = (aclmdlRICaptureMode)t->exchange;
        t->exchanged = aclmdlRICaptureThreadExchangeMode(&m);
    }
    t->copy = unsafe_copy();
    t->set = unsafe_set();
    if (t->device >= 0)
        (void)aclrtResetDevice(t->device);
    return NULL;
}

static other_thread in_other_thread(int32_t device, int exchange)
{
    other_thread t = {.device = device, .exchange = exchange};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, other_thread_main, &t), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(t.exchanged, ACL_SUCCESS);
    return t;
}

static aclmdlRICaptureMode exchange(aclmdlRICaptureMode m)
{
    assert_int_equal(aclmdlRICaptureThreadExchangeMode(&m), ACL_SUCCESS);
    return m;
}

static npualloc_graph *begin_mode(aclrtStream s, aclmdlRICaptureMode mode)
{
    npualloc_graph *g = new_graph(0);
    npualloc_capture_params p = {.mode = mode};
    aclError rc = npualloc_graph_capture_begin(g, s, 0, &p);
    if (rc != ACL_SUCCESS)
        fail_msg("capture_begin: %d %s", rc, npualloc_graph_last_error());
    return g;
}

static void capture_mode_setup(void)
{
    start();
    assert_int_equal(aclrtMalloc(&dev_buf, 64, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
}

/* GLOBAL (also what NULL params give): aclrtMemcpy and aclrtMemset on the device fail with
 * ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT in every thread, and the capture goes on; a thread of another
 * device, or one that exchanged its mode, may make them. */
static void test_global_capture_refuses_unsafe_calls_in_every_thread(void **state)
{
    (void)state;
    capture_mode_setup();
    aclrtStream s = new_stream();
    npualloc_graph *g = new_graph(0);
    begin(g, s); /* params NULL: GLOBAL */
    assert_int_equal(unsafe_copy(), ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    assert_int_equal(unsafe_set(), ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    assert_int_equal(unsafe_copy2d(), ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    other_thread t = in_other_thread(0, -1);
    assert_int_equal(t.copy, ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    assert_int_equal(t.set, ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    t = in_other_thread(1, -1); /* the capture is device 0's */
    assert_int_equal(t.copy, ACL_SUCCESS);
    assert_int_equal(t.set, ACL_SUCCESS);
    t = in_other_thread(0, ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL); /* not the capturing thread */
    assert_int_equal(t.copy, ACL_SUCCESS);
    /* The capturing thread needs RELAXED: THREAD_LOCAL still refuses its own capture's calls. */
    assert_int_equal(exchange(ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL), ACL_MODEL_RI_CAPTURE_MODE_GLOBAL);
    assert_int_equal(unsafe_copy(), ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    assert_int_equal(exchange(ACL_MODEL_RI_CAPTURE_MODE_RELAXED), ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL);
    assert_int_equal(unsafe_set(), ACL_SUCCESS);
    assert_int_equal(unsafe_copy(), ACL_SUCCESS);
    assert_int_equal(host_buf[0], 7); /* it really ran */
    memset(host_buf, 0, sizeof host_buf);
    assert_int_equal(unsafe_copy2d(), ACL_SUCCESS);
    assert_int_equal(host_buf[32 + 15], 7);
    assert_int_equal(exchange(ACL_MODEL_RI_CAPTURE_MODE_GLOBAL), ACL_MODEL_RI_CAPTURE_MODE_RELAXED);
    bool cap = false;
    assert_int_equal(npualloc_stream_capture_status(s, 0, &cap, NULL), ACL_SUCCESS);
    assert_true(cap); /* not invalidated */
    end(g);
    npualloc_graph_plan plan;
    assert_int_equal(npualloc_graph_get_plan(g, &plan), ACL_SUCCESS);
    assert_int_equal(plan.capture_mode, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL);
    assert_int_equal(unsafe_copy(), ACL_SUCCESS);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtFree(dev_buf), ACL_SUCCESS);
}

/* An asynchronous copy of pageable host memory is a synchronous copy (CANN): on the capturing stream
 * its wait for the stream is refused (ACL_ERROR_RT_STREAM_CAPTURED, as aclrtSynchronizeStream of that
 * stream is); on another stream the capture mode refuses it as CANN refuses a converted copy
 * (ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC); neither copies or ends the capture. */
static void test_pageable_async_copies_during_a_capture(void **state)
{
    (void)state;
    capture_mode_setup();
    aclrtStream s = new_stream(), other = new_stream();
    npualloc_graph *g = new_graph(0);
    begin(g, s); /* GLOBAL */
    size_t nodes = npualloc_graph_node_count(g);
    memset(host_buf, 0x5a, sizeof host_buf);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_ERROR_RT_STREAM_CAPTURED);
    assert_int_equal(aclrtSynchronizeStreamWithTimeout(s, 100), ACL_ERROR_RT_STREAM_CAPTURED);
    assert_int_equal(aclrtMemcpyAsync(dev_buf, 64, host_buf, 64, ACL_MEMCPY_HOST_TO_DEVICE, s),
                     ACL_ERROR_RT_STREAM_CAPTURED);
    assert_int_equal(aclrtMemcpy2dAsync(host_buf, 32, dev_buf, 32, 16, 2, ACL_MEMCPY_DEVICE_TO_HOST, s),
                     ACL_ERROR_RT_STREAM_CAPTURED);
    assert_int_equal(aclrtMemcpyAsync(dev_buf, 64, host_buf, 64, ACL_MEMCPY_HOST_TO_DEVICE, other),
                     ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC);
    assert_int_equal(aclrtMemcpy2dAsync(host_buf, 32, dev_buf, 32, 16, 2, ACL_MEMCPY_DEVICE_TO_HOST, other),
                     ACL_ERROR_RT_CAPTURE_MODE_BLOCK_ASYNC);
    assert_int_equal(npualloc_graph_node_count(g), nodes); /* nothing captured */
    char dev_now[64];
    assert_int_equal(exchange(ACL_MODEL_RI_CAPTURE_MODE_RELAXED), ACL_MODEL_RI_CAPTURE_MODE_GLOBAL);
    assert_int_equal(aclrtMemcpy(dev_now, 64, dev_buf, 64, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(dev_now[0], 0); /* nothing copied */
    /* RELAXED: the other stream's copy is made, at once */
    assert_int_equal(aclrtMemcpyAsync(dev_buf, 64, host_buf, 64, ACL_MEMCPY_HOST_TO_DEVICE, other), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpy(dev_now, 64, dev_buf, 64, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(dev_now[63], 0x5a);
    assert_int_equal(aclrtMemcpyAsync(dev_buf, 64, host_buf, 64, ACL_MEMCPY_HOST_TO_DEVICE, s),
                     ACL_ERROR_RT_STREAM_CAPTURED); /* whatever the mode */
    assert_int_equal(exchange(ACL_MODEL_RI_CAPTURE_MODE_GLOBAL), ACL_MODEL_RI_CAPTURE_MODE_RELAXED);
    bool cap = false;
    assert_int_equal(npualloc_stream_capture_status(s, 0, &cap, NULL), ACL_SUCCESS);
    assert_true(cap); /* not invalidated */
    end(g);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtFree(dev_buf), ACL_SUCCESS);
}

/* THREAD_LOCAL refuses the unsafe calls of the thread that began the capture only; RELAXED none. */
static void test_thread_local_and_relaxed_captures(void **state)
{
    (void)state;
    capture_mode_setup();
    aclrtStream s = new_stream();
    npualloc_graph *g = begin_mode(s, ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL);
    assert_int_equal(unsafe_copy(), ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    assert_int_equal(unsafe_set(), ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    other_thread t = in_other_thread(0, -1);
    assert_int_equal(t.copy, ACL_SUCCESS);
    assert_int_equal(t.set, ACL_SUCCESS);
    end(g);
    npualloc_graph_plan plan;
    assert_int_equal(npualloc_graph_get_plan(g, &plan), ACL_SUCCESS);
    assert_int_equal(plan.capture_mode, ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL);
    npualloc_graph_destroy(g);
    g = begin_mode(s, ACL_MODEL_RI_CAPTURE_MODE_RELAXED);
    assert_int_equal(unsafe_copy(), ACL_SUCCESS);
    assert_int_equal(unsafe_set(), ACL_SUCCESS);
    /* A GLOBAL capture beside the RELAXED one decides (the strictest on the device). */
    aclrtStream s2 = new_stream();
    npualloc_graph *g2 = begin_mode(s2, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL);
    assert_int_equal(unsafe_copy(), ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    npualloc_graph_destroy(g2); /* ends its capture */
    assert_int_equal(unsafe_copy(), ACL_SUCCESS);
    end(g);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtFree(dev_buf), ACL_SUCCESS);
}

static void *exchange_without_device(void *arg)
{
    aclmdlRICaptureMode m = ACL_MODEL_RI_CAPTURE_MODE_RELAXED;
    *(aclError *)arg = aclmdlRICaptureThreadExchangeMode(&m);
    return NULL;
}

/* The arguments: a mode that is not one (CANN's runtime: ACL_ERROR_RT_PARAM_INVALID, the graph stays
 * capturable), NULL (ACL's ACL_ERROR_INVALID_PARAM), and no current context (ACL_ERROR_RT_CONTEXT_NULL). */
static void test_capture_mode_arguments(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_graph *g = new_graph(0);
    npualloc_capture_params p = {.mode = (aclmdlRICaptureMode)3};
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, &p), ACL_ERROR_RT_PARAM_INVALID);
    assert_string_equal(npualloc_graph_last_error(), "capture_begin: 3 is not a capture mode");
    bool cap = true;
    assert_int_equal(npualloc_stream_capture_status(s, 0, &cap, NULL), ACL_SUCCESS);
    assert_false(cap);
    p.mode = ACL_MODEL_RI_CAPTURE_MODE_RELAXED;
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, &p), ACL_SUCCESS);
    end(g);
    npualloc_graph_destroy(g);
    assert_int_equal(aclmdlRICaptureThreadExchangeMode(NULL), ACL_ERROR_INVALID_PARAM);
    aclmdlRICaptureMode m = (aclmdlRICaptureMode)3;
    assert_int_equal(aclmdlRICaptureThreadExchangeMode(&m), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(m, 3); /* untouched */
    /* a thread starts GLOBAL */
    assert_int_equal(exchange(ACL_MODEL_RI_CAPTURE_MODE_GLOBAL), ACL_MODEL_RI_CAPTURE_MODE_GLOBAL);
    aclError rc = ACL_SUCCESS;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, exchange_without_device, &rc), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(rc, ACL_ERROR_RT_CONTEXT_NULL);
}

/* torch's allocator makes its own device allocations of a capture RELAXED: npualloc's caching
 * allocator makes no unsafe call, so a GLOBAL pool capture lets it create segments, for the capture's
 * pool and for other streams in other threads, while aclrtMemcpy stays refused. */
typedef struct alloc_thread {
    void *p;
    aclError rc;
} alloc_thread;

static void *alloc_in_other_thread(void *arg)
{
    alloc_thread *a = arg;
    a->rc = aclrtSetDevice(0);
    if (a->rc == ACL_SUCCESS)
        a->rc = npualloc_cache_malloc(0, 40 << 20, 0, &a->p);
    (void)aclrtResetDevice(0);
    return NULL;
}

static void test_global_pool_capture_does_not_block_the_caching_allocator(void **state)
{
    (void)state;
    capture_mode_setup();
    aclrtStream s = new_stream();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    npualloc_capture_params p = {.use_pool = true, .pool = id, .mode = ACL_MODEL_RI_CAPTURE_MODE_GLOBAL};
    npualloc_graph *g = new_graph(0);
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, &p), ACL_SUCCESS);
    npualloc_stats before, after;
    assert_int_equal(npualloc_cache_get_stats(0, &before), ACL_SUCCESS);
    void *x = galloc_on(s, 30 << 20); /* a new segment of the capture's pool */
    assert_true(in_pool(x, id));
    alloc_thread a = {0};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, alloc_in_other_thread, &a), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(a.rc, ACL_SUCCESS); /* a new default-pool segment, from another thread */
    assert_int_equal(npualloc_cache_get_stats(0, &after), ACL_SUCCESS);
    assert_int_equal(after.segment[0].current, before.segment[0].current + 2);
    assert_int_equal(unsafe_copy(), ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
    end(g);
    npualloc_graph_destroy(g);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(a.p), ACL_SUCCESS);
    assert_int_equal(aclrtFree(dev_buf), ACL_SUCCESS);
}

static void *end_capture(void *g)
{
    static aclError rc;
    rc = npualloc_graph_capture_end(g);
    return &rc;
}

static aclError end_in_other_thread(npualloc_graph *g)
{
    pthread_t th;
    void *rc;
    assert_int_equal(pthread_create(&th, NULL, end_capture, g), 0);
    assert_int_equal(pthread_join(th, &rc), 0);
    return *(aclError *)rc;
}

/* aclmdlRICaptureEnd: a capture not begun RELAXED ends in the thread that began it; ended in another
 * one it fails with ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD and ends broken (CANN's runtime ends
 * the stream's capture too); a RELAXED one may end anywhere. */
static void test_capture_ends_in_its_thread_unless_relaxed(void **state)
{
    (void)state;
    capture_mode_setup();
    aclrtStream s = new_stream();
    for (int mode = ACL_MODEL_RI_CAPTURE_MODE_GLOBAL; mode <= ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL; mode++) {
        npualloc_graph *g = begin_mode(s, (aclmdlRICaptureMode)mode);
        assert_int_equal(end_in_other_thread(g), ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD);
        bool cap = true;
        assert_int_equal(npualloc_stream_capture_status(s, 0, &cap, NULL), ACL_SUCCESS);
        assert_false(cap);
        assert_int_equal(unsafe_copy(), ACL_SUCCESS); /* no capture left to refuse it */
        npualloc_graph_plan plan;
        assert_int_equal(npualloc_graph_get_plan(g, &plan), ACL_ERROR_RT_FEATURE_NOT_SUPPORT); /* broken */
        assert_int_equal(npualloc_graph_capture_end(g), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);    /* ended */
        npualloc_graph_destroy(g);
    }
    npualloc_graph *g = begin_mode(s, ACL_MODEL_RI_CAPTURE_MODE_RELAXED);
    assert_int_equal(end_in_other_thread(g), ACL_SUCCESS);
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtFree(dev_buf), ACL_SUCCESS);
}

/* A thread that begins a capture and exits without ending it: its id (pthread_t) is free for the
 * next thread, which glibc usually hands the same one (checked below). */
typedef struct exited_capturer {
    aclrtStream s;
    aclmdlRICaptureMode mode;
    npualloc_graph *g;
    pthread_t self;
    aclError rc;
} exited_capturer;

static void *begin_and_exit(void *arg)
{
    exited_capturer *c = arg;
    c->self = pthread_self();
    npualloc_capture_params p = {.mode = c->mode};
    if ((c->rc = aclrtSetDevice(0)) == ACL_SUCCESS)
        c->rc = npualloc_graph_capture_begin(c->g, c->s, 0, &p);
    return NULL;
}

typedef struct successor {
    npualloc_graph *g;
    pthread_t self;
    aclError copy, end;
} successor;

static void *successor_main(void *arg)
{
    successor *t = arg;
    t->self = pthread_self();
    t->copy = aclrtSetDevice(0);
    if (t->copy == ACL_SUCCESS)
        t->copy = unsafe_copy();
    t->end = npualloc_graph_capture_end(t->g);
    return NULL;
}

/* A capture's thread is the thread that began it, not whichever thread later gets the same pthread_t:
 * after that thread exited, a new thread is not refused a THREAD_LOCAL capture's unsafe calls, and
 * may not end a GLOBAL or THREAD_LOCAL capture without ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD. */
static void test_a_thread_that_reuses_an_exited_capturers_id_is_another_thread(void **state)
{
    (void)state;
    capture_mode_setup();
    aclrtStream s = new_stream();
    bool reused = false;
    for (int mode = ACL_MODEL_RI_CAPTURE_MODE_GLOBAL; mode <= ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL; mode++) {
        exited_capturer c = {.s = s, .mode = (aclmdlRICaptureMode)mode, .g = new_graph(0)};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, begin_and_exit, &c), 0);
        assert_int_equal(pthread_join(th, NULL), 0);
        assert_int_equal(c.rc, ACL_SUCCESS);
        successor t = {.g = c.g};
        assert_int_equal(pthread_create(&th, NULL, successor_main, &t), 0);
        assert_int_equal(pthread_join(th, NULL), 0);
        reused |= pthread_equal(c.self, t.self) != 0;
        assert_int_equal(t.copy, mode == ACL_MODEL_RI_CAPTURE_MODE_GLOBAL ? ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT
                                                                          : ACL_SUCCESS);
        assert_int_equal(t.end, ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD);
        npualloc_graph_destroy(c.g);
    }
    assert_int_equal(aclrtFree(dev_buf), ACL_SUCCESS);
    if (!reused)
        skip(); /* the C library gave the new threads other ids: the case was not met */
}

typedef struct ending_capture {
    npualloc_graph *g;
    atomic_int phase; /* 1: in npualloc_graph_capture_end, 2: it returned */
    aclError rc;
} ending_capture;

static void *end_capture_phased(void *arg)
{
    ending_capture *c = arg;
    atomic_store(&c->phase, 1);
    c->rc = npualloc_graph_capture_end(c->g);
    atomic_store(&c->phase, 2);
    return NULL;
}

/* A graph is instantiable only once capture_end trimmed its address range: an executable graph's launch
 * maps pages into the range, and a range with mappings cannot shrink, so a launch from another thread
 * while capture_end was between finalising the plan and trimming made capture_end fail with "the graph's
 * address range could not be kept" (207001) and break the graph.  Here this thread holds the vmm read
 * lock, so capture_end (in another thread) waits in the trim, and keeps trying to instantiate the graph
 * meanwhile: none may succeed before capture_end returned. */
static void test_a_graph_is_instantiable_only_once_capture_end_trimmed_its_range(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    npualloc_graph *g = new_graph(0);
    npualloc_capture_params p = {.mode = ACL_MODEL_RI_CAPTURE_MODE_RELAXED}; /* ended in another thread */
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, &p), ACL_SUCCESS);
    void *a = galloc_on(s, 4096);
    assert_int_equal(npualloc_cache_free(a), ACL_SUCCESS);
    ending_capture c = {.g = g};
    npualloc_graph_exec *e = NULL;
    aclError irc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    int phase_at_instantiate = -1;
    pthread_t th;
    vmm_read_lock(); /* the trim (vmm_reserve_shrink) waits for it */
    if (pthread_create(&th, NULL, end_capture_phased, &c) != 0) {
        vmm_read_unlock();
        fail_msg("pthread_create failed");
    }
    const struct timespec ms = {0, 1000000};
    for (int i = 0; i < 200 && irc != ACL_SUCCESS; i++) { /* ~200 ms: capture_end reaches the trim */
        irc = npualloc_graph_instantiate(g, &e);
        if (irc == ACL_SUCCESS)
            phase_at_instantiate = atomic_load(&c.phase);
        else
            nanosleep(&ms, NULL);
    }
    vmm_read_unlock();
    assert_int_equal(pthread_join(th, NULL), 0);
    if (irc == ACL_SUCCESS)
        fail_msg("instantiate succeeded while capture_end had not returned (phase %d; it then returned %d)",
                 phase_at_instantiate, c.rc);
    if (c.rc != ACL_SUCCESS)
        fail_msg("capture_end: %d %s", c.rc, npualloc_graph_last_error());
    /* Ended: the graph is captured, its range trimmed to what the plan maps, and it runs. */
    npualloc_graph_plan plan;
    assert_int_equal(npualloc_graph_get_plan(g, &plan), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
}

struct launcher {
    npualloc_graph_exec *e;
    aclrtStream s;
    aclError rc;
};

static void *launch_thread(void *arg)
{
    struct launcher *l = arg;
    l->rc = npualloc_graph_launch(l->e, l->s, 0);
    return NULL;
}

/* "A launch cannot be captured": a capture begun on the launch stream while a launch was in
 * npualloc_graph_launch (past its capture check, here held in exec_bind by the vmm lock) recorded the
 * launch's nodes, which point into the launched graph (a use after free once it went), and the launch said
 * success with nothing run.  The launch now queues its nodes under the stream's lock, refused once the
 * stream is capturing. */
static void test_a_launch_racing_capture_begin_is_refused_not_captured(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    void *warm = NULL; /* the device's cache started (pool captures use it) */
    assert_int_equal(npualloc_cache_malloc(0, 4096, sh(s), &warm), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(warm), ACL_SUCCESS);
    char *host_dst = pinned_host(4096);
    npualloc_graph *g1, *g2;
    assert_int_equal(npualloc_graph_create(0, &g1), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_create(0, &g2), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_begin(g1, s, 0, NULL), ACL_SUCCESS);
    void *x = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 4096, sh(s), &x), ACL_SUCCESS);
    assert_int_equal(aclrtMemsetAsync(x, 4096, 0x77, 4096, s), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(host_dst, 4096, x, 4096, ACL_MEMCPY_DEVICE_TO_HOST, s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(x), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_end(g1), ACL_SUCCESS);
    npualloc_graph_exec *e1;
    assert_int_equal(npualloc_graph_instantiate(g1, &e1), ACL_SUCCESS);

    struct launcher l = {e1, s, -1};
    pthread_t th;
    vmm_read_lock(); /* the launch's exec_bind waits for it */
    assert_int_equal(pthread_create(&th, NULL, launch_thread, &l), 0);
    host_sleep_ns(200 * 1000000ull); /* the launch is past its capture check */
    npualloc_capture_params p = {.use_pool = true, .pool = npualloc_mempool_id_new(true)};
    aclError brc = npualloc_graph_capture_begin(g2, s, 0, &p);
    vmm_read_unlock();
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(brc, ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_end(g2), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    size_t captured = npualloc_graph_node_count(g2);
    assert_int_equal(captured, 0);
    assert_int_equal(l.rc, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal((unsigned char)host_dst[0], 0); /* nothing ran */
    assert_int_equal(npualloc_graph_launch(e1, s, 0), ACL_SUCCESS); /* the stream no longer captures */
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal((unsigned char)host_dst[0], 0x77);
    npualloc_graph_exec_destroy(e1);
    npualloc_graph_destroy(g1);
    npualloc_graph_destroy(g2);
    assert_int_equal(aclrtFreeHost(host_dst), ACL_SUCCESS);
}

/* npualloc_launch_host_func looked at the stream's capture and then queued: a capture that began in
 * between took the run-once form of the callback (its data never released, and freed by its first
 * launch), and one that ended in between released the data when the graph went, maybe before the
 * queued callback ran.  Whether the callback is a node or runs once is now decided with the capture.
 * One thread captures (and destroys) graph after graph on a stream while another launches host
 * functions on it: each one's data is released exactly once, never before it ran. */
#define RACED_HOST_FUNCS 20000
typedef struct raced_host_data {
    atomic_int runs, releases, runs_after_release;
} raced_host_data;
static raced_host_data raced[RACED_HOST_FUNCS];
static atomic_bool raced_launching;

static void raced_fn(void *arg)
{
    raced_host_data *d = arg;
    if (atomic_load(&d->releases))
        atomic_fetch_add(&d->runs_after_release, 1);
    atomic_fetch_add(&d->runs, 1);
}

static void raced_release(void *arg) { atomic_fetch_add(&((raced_host_data *)arg)->releases, 1); }

static void *capture_graphs_while_launching(void *arg)
{
    aclrtStream s = arg;
    while (atomic_load(&raced_launching)) {
        npualloc_graph *g;
        if (npualloc_graph_create(0, &g) != ACL_SUCCESS)
            return (void *)1;
        aclError rc = npualloc_graph_capture_begin(g, s, ACL_MODEL_RI_CAPTURE_MODE_RELAXED, NULL);
        if (rc == ACL_SUCCESS)
            rc = npualloc_graph_capture_end(g);
        npualloc_graph_destroy(g);
        if (rc != ACL_SUCCESS)
            return (void *)1;
    }
    return NULL;
}

static void test_a_host_func_racing_capture_begin_and_end_is_released_once_after_it_ran(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    memset(raced, 0, sizeof raced);
    atomic_store(&raced_launching, true);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, capture_graphs_while_launching, s), 0);
    bool launched[RACED_HOST_FUNCS];
    for (int i = 0; i < RACED_HOST_FUNCS; i++)
        launched[i] = npualloc_launch_host_func(s, raced_fn, &raced[i], raced_release, ACL_CALLBACK_NO_BLOCK) ==
                      ACL_SUCCESS;
    atomic_store(&raced_launching, false);
    void *capturer_failed;
    assert_int_equal(pthread_join(th, &capturer_failed), 0);
    assert_null(capturer_failed);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    int launches = 0, unreleased = 0, released_twice = 0, ran_after_release = 0;
    for (int i = 0; i < RACED_HOST_FUNCS; i++) {
        if (!launched[i])
            continue;
        launches++;
        int n = atomic_load(&raced[i].releases);
        unreleased += n == 0;
        released_twice += n > 1;
        ran_after_release += atomic_load(&raced[i].runs_after_release) != 0;
    }
    print_message("%d host functions launched\n", launches);
    assert_int_equal(launches, RACED_HOST_FUNCS); /* (a capturing stream takes them too) */
    assert_int_equal(unreleased, 0);
    assert_int_equal(released_twice, 0);
    assert_int_equal(ran_after_release, 0);
}

/* Parking places (Makefile: TEST_LDFLAGS_test_graph links the core's calls to these functions through the
 * __wrap_ ones below): a thread that armed one stops on its next call there until the test lets it go, so
 * that the test can run other threads' work in that window.  It stops before the real call, but for the
 * capture hooks of records, waits and memory operations (graph.h): after it, once the hook answered. */
typedef struct parking {
    atomic_bool arrived, go;
} parking;

static _Thread_local parking *park_next; /* armed by the thread itself; used once */

static void park_if_armed(void)
{
    parking *p = park_next;
    if (!p)
        return;
    park_next = NULL;
    atomic_store(&p->arrived, true);
    /* at most 60 s: a test that fails before letting it go then fails instead of hanging its teardown */
    for (int waited = 0; waited < 60000 && !atomic_load(&p->go); waited++)
        host_sleep_ns(1000000);
}

/* At most 60 s, then the test fails: a thread that never reaches its parking place must not hang it. */
static void await_parked(parking *p)
{
    for (int waited = 0; waited < 600000 && !atomic_load(&p->arrived); waited++)
        host_sleep_ns(100000);
    if (!atomic_load(&p->arrived))
        fail_msg("the thread never reached its parking place");
}

aclError __real_npualloc_cache_pool_join(int32_t device, npualloc_mempool_id id, uint64_t stream);
aclError __wrap_npualloc_cache_pool_join(int32_t device, npualloc_mempool_id id, uint64_t stream);
aclError __wrap_npualloc_cache_pool_join(int32_t device, npualloc_mempool_id id, uint64_t stream)
{
    park_if_armed();
    return __real_npualloc_cache_pool_join(device, id, stream);
}

bool __real_graph_capture_task(npu_stream *s, int kind, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                               aclError *rc);
bool __wrap_graph_capture_task(npu_stream *s, int kind, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                               aclError *rc);
bool __wrap_graph_capture_task(npu_stream *s, int kind, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                               aclError *rc)
{
    park_if_armed();
    return __real_graph_capture_task(s, kind, fn, arg, cleanup, rc);
}

bool __real_graph_capture_record(npu_stream *s, uint64_t event, aclError *rc);
bool __wrap_graph_capture_record(npu_stream *s, uint64_t event, aclError *rc);
bool __wrap_graph_capture_record(npu_stream *s, uint64_t event, aclError *rc)
{
    bool handled = __real_graph_capture_record(s, event, rc);
    park_if_armed();
    return handled;
}

bool __real_graph_capture_wait(npu_stream *s, uint64_t event, aclError *rc);
bool __wrap_graph_capture_wait(npu_stream *s, uint64_t event, aclError *rc);
bool __wrap_graph_capture_wait(npu_stream *s, uint64_t event, aclError *rc)
{
    bool handled = __real_graph_capture_wait(s, event, rc);
    park_if_armed();
    return handled;
}

bool __real_graph_capture_memop(aclrtStream stream, void *dst, const void *src, size_t count, int32_t value,
                                bool copy, aclError *rc);
bool __wrap_graph_capture_memop(aclrtStream stream, void *dst, const void *src, size_t count, int32_t value,
                                bool copy, aclError *rc);
bool __wrap_graph_capture_memop(aclrtStream stream, void *dst, const void *src, size_t count, int32_t value,
                                bool copy, aclError *rc)
{
    bool handled = __real_graph_capture_memop(stream, dst, src, count, value, copy, rc);
    park_if_armed();
    return handled;
}

/* aclrtStreamWaitEvent(s, e), parked at p's place. */
typedef struct parked_call {
    aclrtStream s;
    aclrtEvent e;
    parking *p;
    aclError rc;
} parked_call;

static void *wait_event_parked(void *arg)
{
    parked_call *c = arg;
    park_next = c->p;
    c->rc = aclrtStreamWaitEvent(c->s, c->e);
    return NULL;
}

static void *record_event_parked(void *arg)
{
    parked_call *c = arg;
    park_next = c->p;
    c->rc = aclrtRecordEvent(c->e, c->s);
    return NULL;
}

static void *reset_event_parked(void *arg)
{
    parked_call *c = arg;
    park_next = c->p;
    c->rc = aclrtResetEvent(c->e, c->s);
    return NULL;
}

/* A stream joining a pool capture takes its pool route after the join (graph_lock dropped).  A capture_end
 * in that window ended the capture's routes without it, the pool's next recording began (another graph),
 * and the late route then landed on that recording: the next recording's end ended it (the newest route)
 * instead of its own, whose route (with its pool reference) stayed for ever, so its stream kept allocating
 * from the pool.  Here the joining thread is parked in the window; capture_end now waits for the join. */
static void test_a_join_racing_capture_end_and_the_pools_next_recording(void **state)
{
    (void)state;
    start();
    aclrtStream s0 = new_stream(), s1 = new_stream(), s2 = new_stream();
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    npualloc_capture_params pa = {.use_pool = true, .pool = id, .mode = ACL_MODEL_RI_CAPTURE_MODE_RELAXED};
    npualloc_capture_params pb = {.use_pool = true, .pool = id};
    npualloc_graph *a = new_graph(0), *b = new_graph(0);
    assert_int_equal(npualloc_graph_capture_begin(a, s0, 0, &pa), ACL_SUCCESS);
    aclrtEvent ev = new_event();
    assert_int_equal(aclrtRecordEvent(ev, s0), ACL_SUCCESS);

    parking join = {0};
    parked_call w = {.s = s1, .e = ev, .p = &join, .rc = -1};
    pthread_t joiner, ender;
    assert_int_equal(pthread_create(&joiner, NULL, wait_event_parked, &w), 0);
    await_parked(&join); /* s1 joined a's capture, and has no route yet */
    ending_capture c = {.g = a};
    assert_int_equal(pthread_create(&ender, NULL, end_capture_phased, &c), 0);
    /* Before the fix a's end returned at once; now it waits for the join: ~200 ms, and the next
     * recording's begin is refused meanwhile (a's routes are still there). */
    for (int i = 0; i < 200 && atomic_load(&c.phase) != 2; i++)
        host_sleep_ns(1000000);
    aclError brc = npualloc_graph_capture_begin(b, s2, 0, &pb);
    atomic_store(&join.go, true);
    assert_int_equal(pthread_join(joiner, NULL), 0);
    assert_int_equal(pthread_join(ender, NULL), 0);
    assert_int_equal(w.rc, ACL_SUCCESS);
    assert_int_equal(c.rc, ACL_SUCCESS);
    if (brc != ACL_SUCCESS) {
        assert_string_equal(npualloc_graph_last_error(),
                            "capture_begin: beginAllocateToPool: already recording to mempool_id");
        brc = npualloc_graph_capture_begin(b, s2, 0, &pb);
    }
    assert_int_equal(brc, ACL_SUCCESS);
    end(b);

    /* Both recordings ended: no stream allocates from the pool, which the two graphs hold once each. */
    void *x1 = galloc_on(s1, 1000), *x2 = galloc_on(s2, 1000);
    assert_false(in_pool(x1, id));
    assert_false(in_pool(x2, id));
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 2);
    assert_int_equal(npualloc_cache_free(x1), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(x2), ACL_SUCCESS);
    npualloc_graph_destroy(a);
    npualloc_graph_destroy(b);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 0);
    assert_int_equal(aclrtDestroyEvent(ev), ACL_SUCCESS);
}

/* aclrtResetEvent decided whether its reset was a captured one (cleared whatever record is current when
 * it runs) by looking at the stream before queueing it.  A capture ended in between: the reset was queued
 * on the stream all the same, as a captured one, and cleared a record made after it.  Here the resetting
 * thread is parked where the stream hands its task to the capture, and the capture ends meanwhile. */
static void test_a_reset_racing_capture_end_keeps_a_later_record(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream(), other = new_stream();
    static atomic_int gate;
    hold_stream(s, &gate); /* the reset runs after the later record */
    npualloc_graph *g = new_graph(0);
    begin(g, s);
    aclrtEvent ev = new_event();

    parking reset = {0};
    parked_call r = {.s = s, .e = ev, .p = &reset, .rc = -1};
    pthread_t resetter;
    assert_int_equal(pthread_create(&resetter, NULL, reset_event_parked, &r), 0);
    await_parked(&reset); /* the stream was capturing when the reset looked */
    end(g);
    atomic_store(&reset.go, true);
    assert_int_equal(pthread_join(resetter, NULL), 0);
    assert_int_equal(r.rc, ACL_SUCCESS);
    assert_int_equal(npualloc_graph_node_count(g), 0); /* queued on the stream */

    assert_int_equal(aclrtRecordEvent(ev, other), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(other), ACL_SUCCESS);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    aclrtEventRecordedStatus st;
    assert_int_equal(aclrtQueryEventStatus(ev, &st), ACL_SUCCESS);
    assert_int_equal(st, ACL_EVENT_RECORDED_STATUS_COMPLETE); /* the later record stays */
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtDestroyEvent(ev), ACL_SUCCESS);
}

/* aclrtRecordEvent, aclrtStreamWaitEvent and the asynchronous memory calls ask a capture hook (graph.h)
 * whether their stream is capturing, then queue their plain task when it is not.  A capture begun on the
 * stream in between (another thread's, or a join) took that task as a generic node of the graph: neither
 * the plain operation the caller had decided on nor the captured one.  In these tests the calling thread
 * is parked right after the hook answered (some other capture is active, so the hook is asked), and the
 * stream's capture begins meanwhile. */

/* A record that became a node: the event's record pointed at the stream's work before the capture, which
 * passed, but was never stamped (aclrtEventElapsedTime: "unreachable" internal error) until a launch of
 * the graph ran the node, which re-stamped it at every launch. */
static void test_a_record_racing_capture_begin_is_made_before_it(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream(), other = new_stream();
    npualloc_graph *h = new_graph(0), *g = new_graph(0);
    begin(h, other);
    aclrtEvent ev = new_event();

    parking rec = {0};
    parked_call r = {.s = s, .e = ev, .p = &rec, .rc = -1};
    pthread_t recorder;
    assert_int_equal(pthread_create(&recorder, NULL, record_event_parked, &r), 0);
    await_parked(&rec); /* s was not capturing when the record asked */
    begin(g, s);
    atomic_store(&rec.go, true);
    assert_int_equal(pthread_join(recorder, NULL), 0);
    assert_int_equal(r.rc, ACL_SUCCESS);

    assert_int_equal(aclrtSynchronizeEvent(ev), ACL_SUCCESS);
    float ms = -1.0f;
    assert_int_equal(aclrtEventElapsedTime(&ms, ev, ev), ACL_SUCCESS);
    assert_true(ms == 0.0f);
    end(g);
    end(h);
    assert_int_equal(npualloc_graph_node_count(g), 0); /* queued on the stream */
    npualloc_graph_destroy(g);
    npualloc_graph_destroy(h);
    assert_int_equal(aclrtDestroyEvent(ev), ACL_SUCCESS);
}

/* A wait that became a node: it counted in the event's pending waits until a launch ran it (never, here),
 * so aclrtQueryEventWaitStatus said NOT_READY long after the record had passed. */
static void test_a_wait_racing_capture_begin_is_queued_before_it(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream(), src = new_stream(), other = new_stream();
    static atomic_int gate;
    hold_stream(src, &gate);
    aclrtEvent ev = new_event();
    assert_int_equal(aclrtRecordEvent(ev, src), ACL_SUCCESS); /* passes once the gate opens */
    npualloc_graph *h = new_graph(0), *g = new_graph(0);
    begin(h, other);

    parking wait = {0};
    parked_call w = {.s = s, .e = ev, .p = &wait, .rc = -1};
    pthread_t waiter;
    assert_int_equal(pthread_create(&waiter, NULL, wait_event_parked, &w), 0);
    await_parked(&wait); /* s was not capturing, and the event has no captured record */
    begin(g, s);
    atomic_store(&wait.go, true);
    assert_int_equal(pthread_join(waiter, NULL), 0);
    assert_int_equal(w.rc, ACL_SUCCESS);

    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(src), ACL_SUCCESS);
    end(g);
    end(h);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS); /* the wait ran there */
    aclrtEventWaitStatus st;
    assert_int_equal(aclrtQueryEventWaitStatus(ev, &st), ACL_SUCCESS);
    assert_int_equal(st, ACL_EVENT_WAIT_STATUS_COMPLETE);
    assert_int_equal(npualloc_graph_node_count(g), 0);
    npualloc_graph_destroy(g);
    npualloc_graph_destroy(h);
    assert_int_equal(aclrtDestroyEvent(ev), ACL_SUCCESS);
}

typedef struct parked_memset {
    aclrtStream s;
    void *p;
    size_t n;
    parking *park;
    aclError rc;
} parked_memset;

static void *memset_async_parked(void *arg)
{
    parked_memset *c = arg;
    park_next = c->park;
    c->rc = aclrtMemsetAsync(c->p, c->n, 0x5a, c->n, c->s);
    return NULL;
}

/* A memset (as a copy, or a 2-D copy's rows) that became a node: a generic TASK node, not the MEMSET
 * node its capture makes, and not the memset the call had queued either (it ran only at launches). */
static void test_a_memset_racing_capture_begin_is_queued_before_it(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream(), other = new_stream();
    enum { N = 4096 };
    void *d = NULL;
    assert_int_equal(aclrtMalloc(&d, N, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtMemset(d, N, 0, N), ACL_SUCCESS);
    npualloc_graph *h = new_graph(0), *g = new_graph(0);
    begin(h, other);

    parking set = {0};
    parked_memset m = {.s = s, .p = d, .n = N, .park = &set, .rc = -1};
    pthread_t setter;
    assert_int_equal(pthread_create(&setter, NULL, memset_async_parked, &m), 0);
    await_parked(&set); /* s was not capturing when the memset asked */
    begin(g, s);
    atomic_store(&set.go, true);
    assert_int_equal(pthread_join(setter, NULL), 0);
    assert_int_equal(m.rc, ACL_SUCCESS);
    end(g);
    end(h);
    assert_int_equal(npualloc_graph_node_count(g), 0);

    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    static unsigned char back[N];
    assert_int_equal(aclrtMemcpy(back, N, d, N, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(back[0], 0x5a);
    assert_int_equal(back[N - 1], 0x5a);
    npualloc_graph_destroy(g);
    npualloc_graph_destroy(h);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
}

/* A pool's allocator runs under the caching allocator's lock; one that waits for an event on a stream
 * while some capture is active (aclrtStreamWaitEvent asks graph_capture_wait) must not deadlock against
 * a stream joining a pool capture, which takes its pool route (the caching allocator's lock) after the
 * join.  graph_capture_wait held route_lock over every capture-time wait, join or not, and over the
 * join's pool call: the joiner (route_lock, wants the cache lock) and the allocator (cache lock, wants
 * route_lock) waited for each other (here SIGALRM). */
static aclrtStream alloc_waits_on;
static aclrtEvent alloc_waits_for;
static atomic_int in_waiting_alloc;
static void *waiting_alloc_memory; /* made before the capture */

static void *waiting_segment_alloc(size_t size, int device, aclrtStream stream)
{
    (void)device;
    (void)stream;
    atomic_store(&in_waiting_alloc, 1);
    (void)aclrtStreamWaitEvent(alloc_waits_on, alloc_waits_for);
    void *p = waiting_alloc_memory;
    waiting_alloc_memory = NULL;
    return size <= 32 * MiB_ ? p : NULL;
}

static void waiting_segment_free(void *ptr, size_t size, int device, aclrtStream stream)
{
    (void)size;
    (void)device;
    (void)stream;
    (void)aclrtFree(ptr);
}

typedef struct pool_alloc_call {
    aclrtStream s;
    void *p;
    aclError rc;
} pool_alloc_call;

static void *alloc_in_pool(void *arg)
{
    pool_alloc_call *c = arg;
    c->rc = npualloc_cache_malloc(0, 1000, sh(c->s), &c->p);
    return NULL;
}

static void test_a_join_does_not_deadlock_with_a_pool_allocator_that_waits_for_an_event(void **state)
{
    (void)state;
    start();
    aclrtStream s0 = new_stream(), s1 = new_stream();
    alloc_waits_on = new_stream();
    alloc_waits_for = new_event();
    atomic_store(&in_waiting_alloc, 0);
    assert_int_equal(aclrtMalloc(&waiting_alloc_memory, 32 * MiB_, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_create_with_allocator(0, id, waiting_segment_alloc, waiting_segment_free),
                     ACL_SUCCESS);
    npualloc_capture_params pa = {.use_pool = true, .pool = id, .mode = ACL_MODEL_RI_CAPTURE_MODE_RELAXED};
    npualloc_graph *a = new_graph(0);
    assert_int_equal(npualloc_graph_capture_begin(a, s0, 0, &pa), ACL_SUCCESS);
    aclrtEvent ev = new_event();
    assert_int_equal(aclrtRecordEvent(ev, s0), ACL_SUCCESS);

    alarm(getenv("NPUALLOC_VALGRIND") ? 300 : 20); /* a deadlock dies of SIGALRM instead of hanging */
    parking join = {0};
    parked_call w = {.s = s1, .e = ev, .p = &join, .rc = -1};
    pool_alloc_call m = {.s = s0, .rc = -1};
    pthread_t joiner, allocator;
    assert_int_equal(pthread_create(&joiner, NULL, wait_event_parked, &w), 0);
    await_parked(&join); /* s1 joined, its route still to take */
    assert_int_equal(pthread_create(&allocator, NULL, alloc_in_pool, &m), 0);
    while (!atomic_load(&in_waiting_alloc))
        host_sleep_ns(100000);
    host_sleep_ns(100 * 1000000); /* the allocator is in its wait by now, under the cache lock */
    atomic_store(&join.go, true);
    assert_int_equal(pthread_join(allocator, NULL), 0);
    assert_int_equal(pthread_join(joiner, NULL), 0);
    alarm(0);
    assert_int_equal(w.rc, ACL_SUCCESS);
    assert_int_equal(m.rc, ACL_SUCCESS);
    assert_true(in_pool(m.p, id));
    assert_int_equal(npualloc_cache_free(m.p), ACL_SUCCESS);
    /* s1 joined back, so that the capture ends well */
    aclrtEvent back = new_event();
    assert_int_equal(aclrtRecordEvent(back, s1), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(s0, back), ACL_SUCCESS);
    end(a);
    npualloc_graph_destroy(a);
    assert_int_equal(aclrtDestroyEvent(back), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(ev), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(alloc_waits_for), ACL_SUCCESS);
}

/* A graph's NO_BLOCK host node handed to a subscribed thread counts as passed once handed over, so the
 * graph could be destroyed (and the node's data released) before the thread ran it: the run then used
 * released data.  The data is released once both the graph and every hand-over of it are done. */
typedef struct handed_host_data {
    int runs, runs_after_release, releases;
} handed_host_data;

static void handed_fn(void *arg)
{
    handed_host_data *d = arg;
    d->runs_after_release += d->releases != 0;
    d->runs++;
}

static void handed_release(void *arg) { ((handed_host_data *)arg)->releases++; }

static void test_a_host_node_handed_to_a_subscriber_keeps_its_data_until_it_ran(void **state)
{
    (void)state;
    start();
    aclrtStream s = new_stream();
    handed_host_data d = {0};
    npualloc_graph *g = new_graph(0);
    begin(g, s);
    assert_int_equal(npualloc_launch_host_func(s, handed_fn, &d, handed_release, ACL_CALLBACK_NO_BLOCK),
                     ACL_SUCCESS);
    end(g);
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    const uint64_t me = (uint64_t)(uintptr_t)pthread_self();
    assert_int_equal(aclrtSubscribeReport(me, s), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_launch(e, s, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS); /* handed to this thread, not run */
    assert_int_equal(d.runs, 0);
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
    assert_int_equal(d.releases, 0);
    assert_int_equal(aclrtProcessReport(2000), ACL_SUCCESS);
    assert_int_equal(d.runs, 1);
    assert_int_equal(d.runs_after_release, 0);
    assert_int_equal(d.releases, 1);
    assert_int_equal(aclrtUnSubscribeReport(me, s), ACL_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_chain_reuses_freed_address, stop_runtime),
        cmocka_unit_test_teardown(test_graph_memory_is_the_devices_memory, stop_runtime),
        cmocka_unit_test_teardown(test_diamond, stop_runtime),
        cmocka_unit_test_teardown(test_exec_destroyed_by_a_callback_finishes_its_queued_launches, stop_runtime),
        cmocka_unit_test_teardown(test_unjoined_stream_fails_the_capture, stop_runtime),
        cmocka_unit_test_teardown(test_an_events_latest_record_decides_its_capture, stop_runtime),
        cmocka_unit_test_teardown(test_graphs_on_one_stream_alias, stop_runtime),
        cmocka_unit_test_teardown(test_checked_graph_reports_use_after_free, stop_runtime),
        cmocka_unit_test_teardown(test_checked_output_and_host_access_after_launch, stop_runtime),
        cmocka_unit_test_teardown(test_access_is_frozen_at_capture, stop_runtime),
        cmocka_unit_test_teardown(test_host_and_delay_nodes_run_at_every_launch, stop_runtime),
        cmocka_unit_test_teardown(test_pool_capture_uses_the_private_pool, stop_runtime),
        cmocka_unit_test_teardown(test_pool_capture_joined_stream_and_no_second_recording, stop_runtime),
        cmocka_unit_test_teardown(test_stale_graph_after_shutdown, stop_runtime),
        cmocka_unit_test_teardown(test_stale_capture_end_keeps_the_new_graphs_range, stop_runtime),
        cmocka_unit_test_teardown(test_stale_pool_capture_end_keeps_the_new_recording, stop_runtime),
        cmocka_unit_test_teardown(test_concurrent_captures, stop_runtime),
        cmocka_unit_test_teardown(test_access_setting_is_forgotten_on_restart, stop_runtime),
        cmocka_unit_test_teardown(test_get_mem_access_rejects_a_null_output, stop_runtime),
        cmocka_unit_test_teardown(test_user_cannot_unmap_release_or_map_a_graphs_range, stop_runtime),
        cmocka_unit_test_teardown(test_memcpy2d_async_captures_a_node_per_row, stop_runtime),
        cmocka_unit_test_teardown(test_global_capture_refuses_unsafe_calls_in_every_thread, stop_runtime),
        cmocka_unit_test_teardown(test_pageable_async_copies_during_a_capture, stop_runtime),
        cmocka_unit_test_teardown(test_thread_local_and_relaxed_captures, stop_runtime),
        cmocka_unit_test_teardown(test_capture_mode_arguments, stop_runtime),
        cmocka_unit_test_teardown(test_global_pool_capture_does_not_block_the_caching_allocator, stop_runtime),
        cmocka_unit_test_teardown(test_capture_ends_in_its_thread_unless_relaxed, stop_runtime),
        cmocka_unit_test_teardown(test_a_thread_that_reuses_an_exited_capturers_id_is_another_thread, stop_runtime),
        cmocka_unit_test_teardown(test_a_graph_is_instantiable_only_once_capture_end_trimmed_its_range, stop_runtime),
        cmocka_unit_test_teardown(test_a_launch_racing_capture_begin_is_refused_not_captured, stop_runtime),
        cmocka_unit_test_teardown(test_a_host_func_racing_capture_begin_and_end_is_released_once_after_it_ran,
                                  stop_runtime),
        cmocka_unit_test_teardown(test_a_host_node_handed_to_a_subscriber_keeps_its_data_until_it_ran, stop_runtime),
        cmocka_unit_test_teardown(test_a_join_racing_capture_end_and_the_pools_next_recording, stop_runtime),
        cmocka_unit_test_teardown(test_a_reset_racing_capture_end_keeps_a_later_record, stop_runtime),
        cmocka_unit_test_teardown(test_a_record_racing_capture_begin_is_made_before_it, stop_runtime),
        cmocka_unit_test_teardown(test_a_wait_racing_capture_begin_is_queued_before_it, stop_runtime),
        cmocka_unit_test_teardown(test_a_memset_racing_capture_begin_is_queued_before_it, stop_runtime),
        cmocka_unit_test_teardown(test_a_join_does_not_deadlock_with_a_pool_allocator_that_waits_for_an_event,
                                  stop_runtime),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
