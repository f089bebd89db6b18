/* test_hot_path.c - a cache hit (allocation served from the cache, and its free) makes no system
 * call and no heap allocation, through the C API and through the Python face's entry point
 * (npualloc_cache_malloc_cached).
 *
 * System calls: a child process warms the cache, then binds itself with a seccomp filter that
 * kills it on any system call but exit, and runs cache-hit pairs.  Heap: this program defines
 * malloc and its relatives (counting, then calling glibc's), so every heap call of the library
 * is seen; not under ASan or TSan, whose own malloc they would replace.  Under valgrind both tests
 * skip (it makes system calls of its own and replaces the allocator); under the sanitizers the
 * first one does. */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/wait.h>
#include <unistd.h>

#include "seccomp_util.h"
#include "testutil.h"

/* Sizes of both pools, split and unsplit blocks: the pattern each test repeats. */
static const size_t sizes[] = {512, 4096, 70000, MiB_ - 32, 3 * MiB_, 25 * MiB_};
#define SIZE_COUNT (sizeof sizes / sizeof sizes[0])

/* One round of the pattern: every size allocated (some kept alive across others), then freed.
 * Returns false when a call fails. */
static bool one_round(bool through_cached_entry)
{
    void *p[SIZE_COUNT];
    for (size_t i = 0; i < SIZE_COUNT; i++) {
        p[i] = NULL;
        if (through_cached_entry) {
            if (!npualloc_cache_malloc_cached(0, sizes[i], 0, NULL, &p[i]))
                return false;
        } else if (npualloc_cache_malloc(0, sizes[i], 0, &p[i]) != ACL_SUCCESS) {
            return false;
        }
    }
    for (size_t i = SIZE_COUNT; i-- > 0;)
        if (npualloc_cache_free(p[i]) != ACL_SUCCESS)
            return false;
    return true;
}

/* What both tests watch: a thousand rounds through each entry point, all cache hits. */
static inline bool thousand_rounds(void)
{
    for (int r = 0; r < 1000; r++)
        if (!one_round(false) || !one_round(true))
            return false;
    return true;
}

#ifdef TEST_AUDIT_ARCH
/* In a child (whose caches start empty: npualloc forgets the parent's device memory at fork):
 * warms the cache, installs a filter that kills the process on any system call but exit and
 * exit_group, then runs `fn`; exits 0 when fn returned true. */
static int run_without_system_calls(bool (*fn)(void))
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        npualloc_shutdown();
        npualloc_config c = {1, GiB_, GiB_, 0, 0};
        char err[256];
        if (npualloc_configure(&c, err, sizeof err) != ACL_SUCCESS || aclrtSetDevice(0) != ACL_SUCCESS ||
            !one_round(false) || !one_round(true))
            _exit(4);
        if (bind_seccomp_filter(SYS_exit_group, SYS_exit, SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS) != 0)
            _exit(2);
        _exit(fn() ? 0 : 3);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return status;
}

static bool one_system_call(void) { return getppid() > 0; }

static void test_cache_hits_make_no_system_call(void **state)
{
    (void)state;
    if (getenv("NPUALLOC_VALGRIND"))
        skip(); /* valgrind makes system calls of its own under the filter */
#if defined(__SANITIZE_ADDRESS__) || defined(NPUALLOC_TSAN)
    skip(); /* so does the sanitizer's runtime (sigaltstack) */
#endif
    /* the filter is live: one system call kills the child */
    int status = run_without_system_calls(one_system_call);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGSYS);
    status = run_without_system_calls(thousand_rounds);
    if (WIFSIGNALED(status))
        fail_msg("a cache hit made a system call (child killed by signal %d)", WTERMSIG(status));
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}
#endif

#if !defined(__SANITIZE_ADDRESS__) && !defined(NPUALLOC_TSAN)
/* Heap calls of the whole process while `counting` is set (the test is single-threaded then:
 * no stream exists, so no worker thread runs). */
static atomic_bool counting;
static atomic_long heap_calls;

void *__libc_malloc(size_t size);
void *__libc_calloc(size_t n, size_t size);
void *__libc_realloc(void *p, size_t size);
void *__libc_memalign(size_t align, size_t size);
void __libc_free(void *p);

static void count(void)
{
    if (atomic_load_explicit(&counting, memory_order_relaxed))
        atomic_fetch_add(&heap_calls, 1);
}

void *malloc(size_t size)
{
    count();
    return __libc_malloc(size);
}

void *calloc(size_t n, size_t size)
{
    count();
    return __libc_calloc(n, size);
}

void *realloc(void *p, size_t size)
{
    count();
    return __libc_realloc(p, size);
}

void *aligned_alloc(size_t align, size_t size)
{
    count();
    return __libc_memalign(align, size);
}

int posix_memalign(void **out, size_t align, size_t size)
{
    count();
    void *p = __libc_memalign(align, size);
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}

void free(void *p)
{
    count();
    __libc_free(p);
}

static void test_cache_hits_allocate_no_heap_memory(void **state)
{
    (void)state;
    if (getenv("NPUALLOC_VALGRIND"))
        skip(); /* valgrind replaces the allocator these counters wrap */
    start_runtime(1, GiB_, GiB_, 0, 0);
    assert_true(one_round(false)); /* fills the cache: every later round is all hits */
    /* the counter sees the library's heap calls: a cache miss (a new segment) makes some */
    atomic_store(&heap_calls, 0);
    atomic_store(&counting, true);
    void *big = NULL;
    aclError rc = npualloc_cache_malloc(0, 300 * MiB_, 0, &big);
    atomic_store(&counting, false);
    assert_int_equal(rc, ACL_SUCCESS);
    assert_true(atomic_load(&heap_calls) > 0);
    assert_int_equal(npualloc_cache_free(big), ACL_SUCCESS);

    assert_true(one_round(true)); /* the cached entry point warmed too */
    atomic_store(&heap_calls, 0);
    atomic_store(&counting, true);
    bool ok = thousand_rounds();
    atomic_store(&counting, false);
    assert_true(ok);
    assert_int_equal(atomic_load(&heap_calls), 0);
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
#ifdef TEST_AUDIT_ARCH
        cmocka_unit_test_teardown(test_cache_hits_make_no_system_call, stop_runtime),
#endif
#if !defined(__SANITIZE_ADDRESS__) && !defined(NPUALLOC_TSAN)
        cmocka_unit_test_teardown(test_cache_hits_allocate_no_heap_memory, stop_runtime),
#endif
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
