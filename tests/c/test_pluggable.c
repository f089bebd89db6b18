/* test_pluggable.c - npualloc_allocator_change: a pluggable allocator (torch_npu's) serves the caching
 * allocator's entry points once swapped in, each free is told what its allocation was, the swap is
 * refused once an allocator is initialized, shutdown and fork bring the caching allocator back, and
 * threads allocate through it concurrently. */
#include <pthread.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

static atomic_long alloc_calls, free_calls;
static _Thread_local size_t last_free_size;
static _Thread_local int last_free_device;
static _Thread_local aclrtStream last_free_stream;

static void *plug_alloc(size_t size, int device, aclrtStream stream)
{
    (void)stream;
    atomic_fetch_add(&alloc_calls, 1);
    int32_t previous;
    assert_int_equal(aclrtGetDevice(&previous), ACL_SUCCESS);
    void *p = NULL;
    if (aclrtSetDevice(device) != ACL_SUCCESS || aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS)
        p = NULL;
    assert_int_equal(aclrtSetDevice(previous), ACL_SUCCESS);
    return p;
}

static void plug_free(void *ptr, size_t size, int device, aclrtStream stream)
{
    atomic_fetch_add(&free_calls, 1);
    last_free_size = size;
    last_free_device = device;
    last_free_stream = stream;
    assert_int_equal(aclrtFree(ptr), ACL_SUCCESS);
}

/* A faulty library: always the same address, or nothing. */
static char one_buffer[4096];

static void *same_address(size_t size, int device, aclrtStream stream)
{
    (void)size;
    (void)device;
    (void)stream;
    return one_buffer;
}

static void *nothing(size_t size, int device, aclrtStream stream)
{
    (void)size;
    (void)device;
    (void)stream;
    return NULL;
}

static void forget_it(void *ptr, size_t size, int device, aclrtStream stream)
{
    (void)device;
    (void)stream;
    atomic_fetch_add(&free_calls, 1);
    assert_ptr_equal(ptr, one_buffer);
    last_free_size = size;
}

static void test_a_faulty_library_as_torch_npu_meets_it(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    assert_int_equal(npualloc_allocator_change(same_address, forget_it), ACL_SUCCESS);
    void *p, *q;
    assert_int_equal(npualloc_cache_malloc(0, 100, 0, &p), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_malloc(0, 200, 0, &q), ACL_SUCCESS);
    assert_ptr_equal(p, q);
    /* the first record stays (torch_npu's map emplace): one free, told the first size */
    long frees = free_calls;
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
    assert_int_equal(free_calls, frees + 1);
    assert_int_equal(last_free_size, 100);
    assert_int_equal(npualloc_cache_free(q), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(free_calls, frees + 1);

    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    assert_int_equal(npualloc_allocator_change(nothing, forget_it), ACL_SUCCESS);
    p = one_buffer;
    assert_int_equal(npualloc_cache_malloc(0, 100, 0, &p), ACL_SUCCESS); /* as torch_npu: NULL, no error */
    assert_null(p);
}

static void test_allocations_go_to_the_library(void **state)
{
    (void)state;
    start_runtime(2, 256 * MiB_, 256 * MiB_, 0, 0);
    assert_false(npualloc_allocator_is_pluggable());
    assert_int_equal(npualloc_allocator_change(plug_alloc, plug_free), ACL_SUCCESS);
    assert_true(npualloc_allocator_is_pluggable());
    long allocs = alloc_calls, frees = free_calls;
    aclrtStream s;
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    void *p;
    assert_int_equal(npualloc_cache_malloc(1, 1000, (uint64_t)(uintptr_t)s, &p), ACL_SUCCESS);
    assert_non_null(p);
    assert_int_equal(alloc_calls, allocs + 1);
    /* Device memory of device 1, bytes that read back. */
    assert_int_equal(aclrtMemset(p, 1000, 0x7e, 1000), ACL_SUCCESS);
    unsigned char back[4];
    assert_int_equal(aclrtMemcpy(back, sizeof back, p, sizeof back, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(back[3], 0x7e);
    int32_t device;
    uint64_t stream;
    size_t size;
    assert_int_equal(npualloc_cache_block_info(p, &device, &stream, &size), ACL_SUCCESS);
    assert_int_equal(device, 1);
    assert_int_equal(stream, (uint64_t)(uintptr_t)s);
    assert_int_equal(size, 1000);
    /* record_stream and erase_stream leave it alone; its free is immediate */
    assert_int_equal(npualloc_cache_record_stream(p, (uint64_t)(uintptr_t)s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_erase_stream(p, (uint64_t)(uintptr_t)s), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
    assert_int_equal(free_calls, frees + 1);
    assert_int_equal(last_free_size, 1000);
    assert_int_equal(last_free_device, 1);
    assert_ptr_equal(last_free_stream, s);
    /* npualloc_allocate too, and the caching allocator's stats never moved */
    assert_int_equal(npualloc_allocate(0, 4096, 0, &p), ACL_SUCCESS);
    assert_int_equal(alloc_calls, allocs + 2);
    assert_int_equal(npualloc_deallocate(p), ACL_SUCCESS);
    assert_int_equal(free_calls, frees + 2);
    npualloc_stats st;
    assert_int_equal(npualloc_cache_get_stats(0, &st), ACL_SUCCESS);
    assert_int_equal(st.allocation[NPUALLOC_STAT_ALL].allocated, 0);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
}

static void test_unknown_pointers_and_bad_arguments(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    assert_int_equal(npualloc_allocator_change(NULL, plug_free), ACL_ERROR_INVALID_PARAM);
    assert_false(npualloc_allocator_is_pluggable());
    assert_int_equal(npualloc_allocator_change(plug_alloc, plug_free), ACL_SUCCESS);
    long frees = free_calls;
    int x;
    assert_int_equal(npualloc_cache_free(&x), ACL_ERROR_INVALID_PARAM);
    npualloc_error_kind kind;
    assert_string_equal(npualloc_last_error(&kind), "Trying to free a pointer not allocated here");
    assert_int_equal(kind, NPUALLOC_ERR_RUNTIME);
    assert_int_equal(free_calls, frees);
    void *p;
    assert_int_equal(npualloc_cache_malloc(5, 512, 0, &p), ACL_ERROR_INVALID_PARAM); /* no device 5 */
    assert_null(p);
    assert_int_equal(npualloc_cache_free(NULL), ACL_SUCCESS);
}

static void test_the_swap_is_refused_once_an_allocator_is_initialized(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    void *p;
    assert_int_equal(npualloc_cache_malloc(0, 512, 0, &p), ACL_SUCCESS); /* the caching allocator starts */
    assert_int_equal(npualloc_allocator_change(plug_alloc, plug_free), ACL_ERROR_REPEAT_INITIALIZE);
    assert_string_equal(npualloc_last_error(NULL), "Can't swap an already initialized allocator");
    assert_false(npualloc_allocator_is_pluggable());
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);

    npualloc_shutdown(); /* a new runtime: the caching allocator is not initialized yet */
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    assert_int_equal(npualloc_allocator_change(plug_alloc, plug_free), ACL_SUCCESS);
    assert_int_equal(npualloc_allocator_change(plug_alloc, plug_free), ACL_ERROR_REPEAT_INITIALIZE);
    /* a live allocation of the library is forgotten by shutdown, which restores the caching allocator */
    assert_int_equal(npualloc_cache_malloc(0, 512, 0, &p), ACL_SUCCESS);
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    assert_false(npualloc_allocator_is_pluggable());
    long allocs = alloc_calls;
    assert_int_equal(npualloc_cache_malloc(0, 512, 0, &p), ACL_SUCCESS);
    assert_int_equal(alloc_calls, allocs);
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
}

static void test_a_forked_child_starts_with_the_caching_allocator(void **state)
{
    (void)state;
    start_runtime(1, 64 * MiB_, 64 * MiB_, 0, 0);
    assert_int_equal(npualloc_allocator_change(plug_alloc, plug_free), ACL_SUCCESS);
    void *p;
    assert_int_equal(npualloc_cache_malloc(0, 512, 0, &p), ACL_SUCCESS);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        long allocs = alloc_calls;
        void *q = NULL;
        bool ok = !npualloc_allocator_is_pluggable() && aclrtSetDevice(0) == ACL_SUCCESS &&
                  npualloc_cache_malloc(0, 512, 0, &q) == ACL_SUCCESS && alloc_calls == allocs &&
                  npualloc_cache_free(q) == ACL_SUCCESS;
        _exit(ok ? 0 : 1);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    assert_true(npualloc_allocator_is_pluggable());
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
}

static void *churn(void *arg)
{
    (void)arg;
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    for (int i = 0; i < 300; i++) {
        void *p;
        size_t size = 512 * (size_t)(1 + i % 7);
        assert_int_equal(npualloc_cache_malloc(0, size, 0, &p), ACL_SUCCESS);
        assert_non_null(p);
        assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
        assert_int_equal(last_free_size, size); /* this thread's own free */
    }
    return NULL;
}

static void test_threads_allocate_through_it_at_once(void **state)
{
    (void)state;
    start_runtime(1, 256 * MiB_, 256 * MiB_, 0, 0);
    assert_int_equal(npualloc_allocator_change(plug_alloc, plug_free), ACL_SUCCESS);
    long allocs = alloc_calls, frees = free_calls;
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&t[i], NULL, churn, NULL), 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_join(t[i], NULL), 0);
    assert_int_equal(alloc_calls - allocs, 1200);
    assert_int_equal(free_calls - frees, 1200);
}

/* torch's MemPool(allocator): the pool's segments come from the library, its blocks from the cache. */
static void test_a_pools_segments_come_from_its_allocator(void **state)
{
    (void)state;
    start_runtime(1, 256 * MiB_, 256 * MiB_, 0, 0);
    npualloc_mempool_id id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_create_with_allocator(0, id, NULL, plug_free), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_pool_create_with_allocator(0, id, plug_alloc, plug_free), ACL_SUCCESS);
    /* the same pool again: a reference with the same functions, an error with others */
    assert_int_equal(npualloc_cache_pool_create_with_allocator(0, id, plug_alloc, plug_free), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_create_with_allocator(0, id, nothing, plug_free), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_cache_pool_use_count(0, id), 2);
    assert_int_equal(npualloc_cache_pool_release(0, id), ACL_SUCCESS);

    long allocs = alloc_calls, frees = free_calls;
    assert_int_equal(npualloc_cache_pool_begin(0, id, NPUALLOC_POOL_FILTER_THREAD, (uint64_t)pthread_self()),
                     ACL_SUCCESS);
    void *p, *q;
    assert_int_equal(npualloc_cache_malloc(0, 1000, 0, &p), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_malloc(0, 5 * MiB_, 0, &q), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    assert_int_equal(alloc_calls, allocs + 2); /* a 2 MiB small segment and a 20 MiB large one */
    char why[256];
    assert_int_equal(npualloc_cache_check(0, why, sizeof why), ACL_SUCCESS);
    npualloc_stats st;
    assert_int_equal(npualloc_cache_get_stats(0, &st), ACL_SUCCESS);
    assert_int_equal(st.reserved_bytes[NPUALLOC_STAT_ALL].current, (int64_t)(22 * MiB_));
    assert_int_equal(st.num_device_alloc, 2);
    assert_int_equal(npualloc_cache_free(p), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_free(q), ACL_SUCCESS);
    assert_int_equal(free_calls, frees); /* cached */
    assert_int_equal(npualloc_cache_pool_release(0, id), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_empty(), ACL_SUCCESS);
    assert_int_equal(free_calls, frees + 2);
    assert_int_equal(npualloc_cache_get_stats(0, &st), ACL_SUCCESS);
    assert_int_equal(st.reserved_bytes[NPUALLOC_STAT_ALL].current, 0);
    assert_int_equal(st.num_device_free, 2);

    /* shutdown gives a pool's live segments back to its allocator too */
    id = npualloc_mempool_id_new(true);
    assert_int_equal(npualloc_cache_pool_create_with_allocator(0, id, plug_alloc, plug_free), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_begin(0, id, NPUALLOC_POOL_FILTER_THREAD, (uint64_t)pthread_self()),
                     ACL_SUCCESS);
    assert_int_equal(npualloc_cache_malloc(0, 1000, 0, &p), ACL_SUCCESS);
    assert_int_equal(npualloc_cache_pool_end(0, id), ACL_SUCCESS);
    frees = free_calls;
    npualloc_shutdown();
    assert_int_equal(free_calls, frees + 1);
    assert_int_equal(last_free_size, 2 * MiB_);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_allocations_go_to_the_library, stop_runtime),
        cmocka_unit_test_teardown(test_unknown_pointers_and_bad_arguments, stop_runtime),
        cmocka_unit_test_teardown(test_a_faulty_library_as_torch_npu_meets_it, stop_runtime),
        cmocka_unit_test_teardown(test_the_swap_is_refused_once_an_allocator_is_initialized, stop_runtime),
        cmocka_unit_test_teardown(test_a_forked_child_starts_with_the_caching_allocator, stop_runtime),
        cmocka_unit_test_teardown(test_threads_allocate_through_it_at_once, stop_runtime),
        cmocka_unit_test_teardown(test_a_pools_segments_come_from_its_allocator, stop_runtime),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
