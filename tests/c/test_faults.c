/* test_faults.c - fault injection swept over whole workloads: every injected failure surfaces as
 * a documented error, the allocator stays consistent and usable, and nothing leaks (memory,
 * mappings, descriptors). */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "npualloc_graph.h"
#include "testutil.h"

static int open_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

static void check(int32_t dev)
{
    char why[512] = "";
    if (npualloc_cache_check(dev, why, sizeof why) != ACL_SUCCESS)
        fail_msg("invariant broken: %s", why);
}

static bool documented(aclError rc)
{
    return rc == ACL_SUCCESS || rc == ACL_ERROR_RT_MEMORY_ALLOCATION || rc == ACL_ERROR_RT_RESOURCE_ALLOC_FAIL;
}

/* A graph launch maps the graph's memory behind its range: capture an allocation, a memset into it and
 * its free, then launch.  Returns whether the launch failed (with a documented code). */
static int graph_launch(void)
{
    aclrtStream s;
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    npualloc_graph *g;
    assert_int_equal(npualloc_graph_create(0, &g), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_begin(g, s, 0, NULL), ACL_SUCCESS);
    void *p = NULL;
    assert_int_equal(npualloc_cache_malloc(0, 3 * MiB_, (uint64_t)(uintptr_t)s, &p), ACL_SUCCESS);
    assert_int_equal(aclrtMemsetAsync(p, 3 * MiB_, 0x5A, 3 * MiB_, s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_end(g), ACL_SUCCESS);
    npualloc_graph_exec *e;
    assert_int_equal(npualloc_graph_instantiate(g, &e), ACL_SUCCESS);
    aclError rc = npualloc_graph_launch(e, s, 0);
    assert_true(documented(rc));
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    npualloc_graph_exec_destroy(e);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    return rc != ACL_SUCCESS;
}

/* A workload touching every path that allocates, maps or creates memory files: the caching
 * allocator (plain and expandable segments, pages kept by empty_virt_addr_cache and mapped again, a
 * retry), aclrtMalloc, physical handles mapped twice, a graph launch.  Returns how many calls failed
 * (each with a documented code). */
static int workload(void)
{
    int failures = 0;
    void *p[24] = {0};
    static const size_t sizes[] = {1000, 3 * MiB_, 30 * MiB_, 200, 12 * MiB_, 100 * MiB_};
    for (int i = 0; i < 12; i++) {
        aclError rc = npualloc_cache_malloc(0, sizes[i % 6], 0, &p[i]);
        assert_true(documented(rc));
        failures += rc != ACL_SUCCESS;
    }
    for (int i = 0; i < 12; i += 2)
        npualloc_cache_free(p[i]);
    /* expandable segments: map pages */
    assert_int_equal(npualloc_cache_set_settings("expandable_segments:True"), ACL_SUCCESS);
    for (int i = 12; i < 18; i++) {
        aclError rc = npualloc_cache_malloc(0, sizes[i % 6], 0, &p[i]);
        assert_true(documented(rc));
        failures += rc != ACL_SUCCESS;
    }
    /* their pages kept, then mapped again */
    for (int i = 12; i < 18; i++)
        npualloc_cache_free(p[i]);
    assert_int_equal(npualloc_cache_empty_virt_addr_cache(), ACL_SUCCESS);
    for (int i = 12; i < 18; i++) {
        aclError rc = npualloc_cache_malloc(0, sizes[i % 6], 0, &p[i]);
        assert_true(documented(rc));
        failures += rc != ACL_SUCCESS;
    }
    assert_int_equal(npualloc_cache_set_settings("expandable_segments:False"), ACL_SUCCESS);
    failures += graph_launch();
    /* the runtime directly */
    void *d = NULL;
    aclError rc = aclrtMalloc(&d, 5 * MiB_, ACL_MEM_MALLOC_HUGE_FIRST);
    assert_true(documented(rc));
    failures += rc != ACL_SUCCESS;
    aclrtPhysicalMemProp prop = hbm_prop(ACL_HBM_MEM_HUGE, 0);
    aclrtDrvMemHandle h = NULL;
    rc = aclrtMallocPhysical(&h, 2 * MiB_, &prop, 0);
    assert_true(documented(rc));
    failures += rc != ACL_SUCCESS;
    void *va = NULL, *vb = NULL;
    assert_int_equal(aclrtReserveMemAddress(&va, 2 * MiB_, 0, NULL, 0), ACL_SUCCESS);
    assert_int_equal(aclrtReserveMemAddress(&vb, 2 * MiB_, 0, NULL, 0), ACL_SUCCESS);
    aclError ma = h ? aclrtMapMem(va, 2 * MiB_, 0, h, 0) : ACL_ERROR_RT_MEMORY_ALLOCATION;
    aclError mb = h ? aclrtMapMem(vb, 2 * MiB_, 0, h, 0) : ACL_ERROR_RT_MEMORY_ALLOCATION;
    assert_true(documented(ma) && documented(mb));
    failures += (ma != ACL_SUCCESS) + (mb != ACL_SUCCESS);
    check(0);
    /* and everything goes back */
    if (ma == ACL_SUCCESS)
        assert_int_equal(aclrtUnmapMem(va), ACL_SUCCESS);
    if (mb == ACL_SUCCESS)
        assert_int_equal(aclrtUnmapMem(vb), ACL_SUCCESS);
    assert_int_equal(aclrtReleaseMemAddress(va), ACL_SUCCESS);
    assert_int_equal(aclrtReleaseMemAddress(vb), ACL_SUCCESS);
    if (h)
        assert_int_equal(aclrtFreePhysical(h), ACL_SUCCESS);
    if (d)
        assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    for (int i = 0; i < 18; i++)
        if (i >= 12 || i % 2)
            npualloc_cache_free(p[i]);
    return failures;
}

static void assert_nothing_left(int fds_before)
{
    check(0);
    npualloc_cache_empty();
    npualloc_stats s;
    assert_int_equal(npualloc_cache_get_stats(0, &s), ACL_SUCCESS);
    assert_int_equal(s.reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    assert_int_equal(s.allocated_bytes[NPUALLOC_STAT_ALL].current, 0);
    npualloc_vmm_counts c;
    npualloc_vmm_counts_get(&c);
    assert_int_equal(c.physical_handles, 0);
    assert_int_equal(c.mappings, 0);
    assert_int_equal(c.reservations, 0);
    assert_int_equal(c.fds_kept, 0);
    assert_int_equal(free_of(ACL_HBM_MEM), 512 * MiB_);
    if (open_fds() != fds_before) {
        char cmd[64];
        snprintf(cmd, sizeof cmd, "ls -l /proc/%d/fd >&2", (int)getpid());
        if (system(cmd) != 0)
            print_error("ls failed\n");
    }
    assert_int_equal(open_fds(), fds_before);
}

static void sweep(npualloc_fault_kind kind, const char *name)
{
    start_runtime(1, 512 * MiB_, 512 * MiB_, 0, 0);
    int fds_before = open_fds();
    /* How many operations of this kind does the workload perform? */
    assert_int_equal(npualloc_fault_set(kind, UINT64_MAX), ACL_SUCCESS);
    assert_int_equal(workload(), 0);
    uint64_t ops = 0, injected_before = 0;
    npualloc_fault_counts(kind, &ops, &injected_before);
    assert_true(ops > 3);
    assert_nothing_left(fds_before);
    int survived = 0;
    for (uint64_t n = 1; n <= ops; n++) {
        assert_int_equal(npualloc_fault_set(kind, n), ACL_SUCCESS);
        int failed = workload();
        uint64_t seen, injected;
        npualloc_fault_counts(kind, &seen, &injected);
        assert_int_equal(injected, injected_before + n); /* exactly one fault per run */
        (void)failed;
        assert_nothing_left(fds_before);
        /* and the allocator is still usable */
        void *q = NULL;
        assert_int_equal(npualloc_cache_malloc(0, 4 * MiB_, 0, &q), ACL_SUCCESS);
        npualloc_cache_free(q);
        npualloc_cache_empty(); /* every run starts from the same state */
        survived++;
    }
    assert_int_equal(npualloc_fault_set(kind, 0), ACL_SUCCESS);
    print_message("%s: %d injected faults survived over %llu operations\n", name, survived,
                  (unsigned long long)ops);
}

static void test_every_device_allocation_can_fail(void **state)
{
    (void)state;
    sweep(NPUALLOC_FAULT_DEVICE_ALLOC, "device_alloc");
}

static void test_every_map_can_fail(void **state)
{
    (void)state;
    sweep(NPUALLOC_FAULT_MAP, "map");
}

static void test_every_memory_file_creation_can_fail(void **state)
{
    (void)state;
    sweep(NPUALLOC_FAULT_MEMFILE, "memfile");
}

static void test_environment_arms_faults(void **state)
{
    (void)state;
    for (int k = 0; k < NPUALLOC_FAULT_KINDS; k++)
        npualloc_fault_set((npualloc_fault_kind)k, 0);
    npualloc_shutdown();
    setenv("NPUALLOC_FAULT", "device_alloc:2", 1);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    void *a = NULL, *b = NULL;
    assert_int_equal(aclrtMalloc(&a, 100, 0), ACL_SUCCESS);
    assert_int_equal(aclrtMalloc(&b, 100, 0), ACL_ERROR_RT_MEMORY_ALLOCATION);
    assert_int_equal(aclrtMalloc(&b, 100, 0), ACL_SUCCESS); /* one failure, then disarmed */
    aclrtFree(a);
    aclrtFree(b);
    npualloc_shutdown();
    /* an unknown kind, an empty item (a trailing comma too), a kind named twice (which count?) */
    static const char *const malformed[] = {"disk:3", "map:1,", ",map:1", "map:1,,map:2", "map:1,map:0", "map:"};
    for (size_t i = 0; i < sizeof malformed / sizeof *malformed; i++) {
        setenv("NPUALLOC_FAULT", malformed[i], 1);
        assert_int_equal(aclrtSetDevice(0), ACL_ERROR_UNINITIALIZE);
        char want[64];
        snprintf(want, sizeof want, "NPUALLOC_FAULT='%s' is malformed", malformed[i]);
        assert_non_null(strstr(npualloc_init_error(), want));
        npualloc_shutdown();
    }
    unsetenv("NPUALLOC_FAULT");
    assert_int_equal(npualloc_fault_set(7, 1), ACL_ERROR_INVALID_PARAM);
}

int main(void)
{
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_every_device_allocation_can_fail, stop_runtime),
        cmocka_unit_test_teardown(test_every_map_can_fail, stop_runtime),
        cmocka_unit_test_teardown(test_every_memory_file_creation_can_fail, stop_runtime),
        cmocka_unit_test_teardown(test_environment_arms_faults, stop_runtime),
    };
    return cmocka_run_group_tests_name("faults", tests, NULL, NULL);
}
