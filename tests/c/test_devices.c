/* test_devices.c - configuration, the current device, peer access. */
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include "testutil.h"
#include "va_space.h"

static void test_parse_size_accepts_bytes_and_binary_units(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        uint64_t bytes;
    } ok[] = {
        {"0", 0},
        {"123", 123},
        {"4KiB", 4096},
        {"4K", 4096},
        {"64GiB", (uint64_t)64 << 30},
        {"64G", (uint64_t)64 << 30},
        {"1TiB", (uint64_t)1 << 40},
        {"2T", (uint64_t)2 << 40},
        {"512 MiB", (uint64_t)512 << 20},
        {"1.5GiB", (uint64_t)3 << 29},
        {" 7M ", (uint64_t)7 << 20},
        {"100B", 100},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        uint64_t v = 1;
        assert_int_equal(npualloc_parse_size(ok[i].text, &v), 0);
        assert_int_equal(v, ok[i].bytes);
    }
    static const char *bad[] = {"", "GiB", "-1", "12XB", "1.GiB", "1e9", "64 GiB x", "99999999999999999999",
                                "20000000000TiB", "0x10", "5 kib"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint64_t v;
        assert_int_equal(npualloc_parse_size(bad[i], &v), -1);
    }
}

static void clear_env(void)
{
    unsetenv("NPUALLOC_DEVICE_COUNT");
    unsetenv("NPUALLOC_DEVICE_MEMORY");
    unsetenv("NPUALLOC_HUGE_MEMORY");
    unsetenv("NPUALLOC_HUGE1G_MEMORY");
    unsetenv("NPUALLOC_DDR_MEMORY");
}

static void test_environment_defaults_and_overrides(void **state)
{
    (void)state;
    clear_env();
    npualloc_config c;
    char err[256];
    assert_int_equal(npualloc_config_from_env(&c, err, sizeof err), ACL_SUCCESS);
    assert_int_equal(c.device_count, 8);
    assert_int_equal(c.device_memory, (uint64_t)64 << 30);
    assert_int_equal(c.huge_memory, (uint64_t)64 << 30);
    assert_int_equal(c.huge1g_memory, 0);
    assert_int_equal(c.ddr_memory, 0);
    setenv("NPUALLOC_DEVICE_COUNT", "2", 1);
    setenv("NPUALLOC_DEVICE_MEMORY", "16GiB", 1);
    setenv("NPUALLOC_HUGE1G_MEMORY", "4G", 1);
    setenv("NPUALLOC_DDR_MEMORY", "1GiB", 1);
    assert_int_equal(npualloc_config_from_env(&c, err, sizeof err), ACL_SUCCESS);
    assert_int_equal(c.device_count, 2);
    assert_int_equal(c.device_memory, (uint64_t)16 << 30);
    assert_int_equal(c.huge_memory, (uint64_t)16 << 30); /* defaults to all of the HBM */
    assert_int_equal(c.huge1g_memory, (uint64_t)4 << 30);
    assert_int_equal(c.ddr_memory, (uint64_t)1 << 30);
    clear_env();
}

static void test_malformed_environment_names_variable_and_value(void **state)
{
    (void)state;
    clear_env();
    npualloc_config c;
    char err[256];
    setenv("NPUALLOC_DEVICE_MEMORY", "64XB", 1);
    assert_int_equal(npualloc_config_from_env(&c, err, sizeof err), ACL_ERROR_INVALID_PARAM);
    assert_non_null(strstr(err, "NPUALLOC_DEVICE_MEMORY"));
    assert_non_null(strstr(err, "64XB"));
    clear_env();
    setenv("NPUALLOC_DEVICE_COUNT", "eight", 1);
    assert_int_equal(npualloc_config_from_env(&c, err, sizeof err), ACL_ERROR_INVALID_PARAM);
    assert_non_null(strstr(err, "NPUALLOC_DEVICE_COUNT"));
    assert_non_null(strstr(err, "eight"));
    clear_env();
    setenv("NPUALLOC_HUGE_MEMORY", "128GiB", 1); /* more than the 64 GiB default HBM */
    assert_int_equal(npualloc_config_from_env(&c, err, sizeof err), ACL_ERROR_INVALID_PARAM);
    assert_non_null(strstr(err, "NPUALLOC_HUGE_MEMORY"));
    clear_env();
    setenv("NPUALLOC_HUGE1G_MEMORY", "1536MiB", 1); /* not whole GiB */
    assert_int_equal(npualloc_config_from_env(&c, err, sizeof err), ACL_ERROR_INVALID_PARAM);
    assert_non_null(strstr(err, "NPUALLOC_HUGE1G_MEMORY"));
    clear_env();
}

static void test_bad_environment_fails_start_with_message(void **state)
{
    (void)state;
    npualloc_shutdown();
    clear_env();
    setenv("NPUALLOC_DDR_MEMORY", "lots", 1);
    assert_int_equal(aclrtSetDevice(0), ACL_ERROR_UNINITIALIZE);
    assert_non_null(npualloc_init_error());
    assert_non_null(strstr(npualloc_init_error(), "NPUALLOC_DDR_MEMORY='lots'"));
    assert_false(npualloc_initialized());
    clear_env();
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS); /* fixed environment: starts */
    assert_null(npualloc_init_error());
}

/* Under ThreadSanitizer the default window shrinks to 1 TiB, the size that fits its address-space
 * layout, and a small one lands outside its application ranges, where TSan dies ("mmap at bad
 * address"): there the test gives 1 TiB, the window every TSan run uses. */
#if defined(NPUALLOC_TSAN)
#define VALID_WINDOW "1TiB"
#define VALID_WINDOW_BYTES ((size_t)1 << 40)
#else
#define VALID_WINDOW "8GiB"
#define VALID_WINDOW_BYTES ((size_t)8 << 30)
#endif

/* The variables read by the modules themselves (address window, descriptor budget, sharing
 * timeout) stop the start too when malformed, even after npualloc_configure, instead of being
 * replaced by their defaults. */
static void test_malformed_module_variable_fails_start(void **state)
{
    (void)state;
    static const char *const cases[][2] = {
        {"NPUALLOC_VA_SPACE", "xyz"},     {"NPUALLOC_VA_SPACE", "512MiB"},    {"NPUALLOC_VA_SPACE", "200TiB"},
        {"NPUALLOC_FD_BUDGET", "many"},   {"NPUALLOC_FD_BUDGET", "-1"},       {"NPUALLOC_FD_BUDGET", "12k"},
        {"NPUALLOC_IPC_TIMEOUT_MS", "0"}, {"NPUALLOC_IPC_TIMEOUT_MS", "1s"},
    };
    /* the window the test runner chose (valgrind's is small), put back at the end */
    const char *runner_window = getenv("NPUALLOC_VA_SPACE");
    char *saved_window = runner_window ? strdup(runner_window) : NULL;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        npualloc_shutdown();
        clear_env();
        unsetenv("NPUALLOC_VA_SPACE");
        unsetenv("NPUALLOC_FD_BUDGET");
        unsetenv("NPUALLOC_IPC_TIMEOUT_MS");
        npualloc_config c = {2, GiB_, GiB_, 0, 0};
        char err[256];
        assert_int_equal(npualloc_configure(&c, err, sizeof err), ACL_SUCCESS);
        setenv(cases[i][0], cases[i][1], 1);
        assert_int_equal(aclrtSetDevice(0), ACL_ERROR_UNINITIALIZE);
        char expected[64];
        snprintf(expected, sizeof expected, "%s='%s'", cases[i][0], cases[i][1]);
        assert_non_null(npualloc_init_error());
        assert_non_null(strstr(npualloc_init_error(), expected));
        assert_false(npualloc_initialized());
    }
    unsetenv("NPUALLOC_IPC_TIMEOUT_MS");
    setenv("NPUALLOC_VA_SPACE", VALID_WINDOW, 1);
    setenv("NPUALLOC_FD_BUDGET", "16", 1);
    setenv("NPUALLOC_IPC_TIMEOUT_MS", "500", 1);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    void *p = NULL;
    assert_int_equal(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    uintptr_t base;
    size_t size;
    va_window(&base, &size);
#if defined(NPUALLOC_TSAN)
    /* TSan's mappings sometimes leave no free 1 TiB run, and the window halves (seen once: 512 GiB). */
    assert_true(size <= VALID_WINDOW_BYTES && size >= VALID_WINDOW_BYTES / 8);
#else
    assert_int_equal(size, VALID_WINDOW_BYTES); /* the valid value is the one used */
#endif
    assert_int_equal(aclrtFree(p), ACL_SUCCESS);
    npualloc_shutdown();
    unsetenv("NPUALLOC_FD_BUDGET");
    unsetenv("NPUALLOC_IPC_TIMEOUT_MS");
    if (saved_window)
        setenv("NPUALLOC_VA_SPACE", saved_window, 1);
    else
        unsetenv("NPUALLOC_VA_SPACE");
    free(saved_window);
}

static void test_configure_only_before_start(void **state)
{
    (void)state;
    start_runtime(2, 1 * GiB_, 1 * GiB_, 0, 0);
    uint32_t n = 0;
    assert_int_equal(aclrtGetDeviceCount(&n), ACL_SUCCESS);
    assert_int_equal(n, 2);
    npualloc_config c = {4, GiB_, GiB_, 0, 0};
    char err[256];
    assert_int_equal(npualloc_configure(&c, err, sizeof err), ACL_ERROR_REPEAT_INITIALIZE);
    assert_non_null(strstr(err, "already initialised"));
    npualloc_config bad = {4, GiB_, 2 * GiB_, 0, 0};
    npualloc_shutdown();
    assert_int_equal(npualloc_configure(&bad, err, sizeof err), ACL_ERROR_INVALID_PARAM);
    assert_non_null(strstr(err, "NPUALLOC_HUGE_MEMORY"));
}

static void *get_device_in_thread(void *arg)
{
    int32_t dev = -5;
    *(aclError *)arg = aclrtGetDevice(&dev);
    return NULL;
}

static void test_current_device_is_per_thread_and_checked(void **state)
{
    (void)state;
    start_runtime(4, GiB_, GiB_, 0, 0);
    int32_t dev = -1;
    assert_int_equal(aclrtGetDevice(&dev), ACL_SUCCESS);
    assert_int_equal(dev, 0);
    assert_int_equal(aclrtSetDevice(3), ACL_SUCCESS);
    assert_int_equal(aclrtGetDevice(&dev), ACL_SUCCESS);
    assert_int_equal(dev, 3);
    assert_int_equal(aclrtSetDevice(4), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(aclrtSetDevice(-1), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(aclrtResetDevice(9), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(aclrtGetDevice(NULL), ACL_ERROR_INVALID_PARAM);
    aclError in_thread = 0;
    pthread_t t;
    pthread_create(&t, NULL, get_device_in_thread, &in_thread);
    pthread_join(t, NULL);
    assert_int_equal(in_thread, ACL_ERROR_RT_CONTEXT_NULL);
}

static void cb_shutdown(void *user) { *(aclError *)user = npualloc_shutdown(); }

/* A callback cannot shut the runtime down: shutdown waits for every stream, its own included. */
static void test_shutdown_from_a_callback_is_refused_and_changes_nothing(void **state)
{
    (void)state;
    start_runtime(1, GiB_, GiB_, 0, 0);
    aclrtStream st = new_stream();
    void *dev = NULL;
    assert_int_equal(aclrtMalloc(&dev, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    static aclError rc = ACL_SUCCESS;
    uint64_t generation = npualloc_runtime_generation();
    assert_int_equal(aclrtLaunchCallback(cb_shutdown, &rc, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(rc, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(npualloc_runtime_generation(), generation);
    assert_int_equal(aclrtMemset(dev, 4096, 7, 4096), ACL_SUCCESS); /* memory and stream still live */
    assert_int_equal(aclrtFree(dev), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
    assert_int_equal(npualloc_shutdown(), ACL_SUCCESS);
}

static void test_reset_device_ends_context_after_last_reference(void **state)
{
    (void)state;
    start_runtime(2, GiB_, GiB_, 0, 0); /* device 0 set once */
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    int32_t dev;
    assert_int_equal(aclrtResetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtGetDevice(&dev), ACL_SUCCESS); /* one reference left */
    assert_int_equal(dev, 1);
    assert_int_equal(aclrtResetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtGetDevice(&dev), ACL_ERROR_RT_CONTEXT_NULL);
    void *p;
    assert_int_equal(aclrtMalloc(&p, 100, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_RT_CONTEXT_NULL);
}

static void *reset_device_1(void *arg)
{
    (void)arg;
    (void)aclrtResetDevice(1);
    return NULL;
}

typedef struct set_queue_reset {
    aclrtStream stream;
    atomic_int *gate;
} set_queue_reset;

/* aclrtSetDevice(1), work held on a stream, aclrtResetDevice(1): a reference taken and dropped. */
static void *set_queue_and_reset_device_1(void *arg)
{
    set_queue_reset *a = arg;
    (void)aclrtSetDevice(1);
    (void)aclrtLaunchCallback(cb_wait_gate, a->gate, ACL_CALLBACK_BLOCK, a->stream);
    (void)aclrtResetDevice(1);
    return NULL;
}

/* The last reset waits for the work queued on the device, also work queued by a reference taken and
 * dropped while it waited (it left the reference count as it was, and the reset used to end the device's
 * context after its first wait, that work still queued).  Whichever reset is last, the context ends only
 * after both streams' work. */
static void test_the_last_reset_waits_for_work_queued_while_it_waited(void **state)
{
    (void)state;
    start_runtime(2, GiB_, GiB_, 0, 0);
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS); /* device 1's only reference */
    aclrtStream first = new_stream(), second = new_stream();
    static atomic_int gate1, gate2;
    hold_stream(first, &gate1);
    atomic_store(&gate2, 0);
    pthread_t last, other;
    assert_int_equal(pthread_create(&last, NULL, reset_device_1, NULL), 0); /* waits for `first` */
    usleep(100000);
    set_queue_reset a = {second, &gate2};
    assert_int_equal(pthread_create(&other, NULL, set_queue_and_reset_device_1, &a), 0);
    usleep(100000);
    atomic_store(&gate1, 1);
    usleep(200000);
    int32_t dev = -1;
    assert_int_equal(aclrtGetDevice(&dev), ACL_SUCCESS); /* `second` still holds work: not ended */
    aclrtStreamStatus st = ACL_STREAM_STATUS_RESERVED;
    assert_int_equal(aclrtStreamQuery(second, &st), ACL_SUCCESS);
    assert_int_equal(st, ACL_STREAM_STATUS_NOT_READY);
    atomic_store(&gate2, 1);
    assert_int_equal(pthread_join(last, NULL), 0);
    assert_int_equal(pthread_join(other, NULL), 0);
    assert_int_equal(aclrtGetDevice(&dev), ACL_ERROR_RT_CONTEXT_NULL); /* ended, after the work */
    assert_int_equal(aclrtStreamQuery(second, &st), ACL_SUCCESS);
    assert_int_equal(st, ACL_STREAM_STATUS_COMPLETE);
}

static void *set_device_1_in_thread(void *arg)
{
    *(aclError *)arg = aclrtSetDevice(1);
    return NULL;
}

static void test_reset_device_force_drops_every_reference(void **state)
{
    (void)state;
    start_runtime(2, GiB_, GiB_, 0, 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    aclError in_thread = -1;
    pthread_t t;
    pthread_create(&t, NULL, set_device_1_in_thread, &in_thread); /* a fourth reference, another thread's */
    pthread_join(t, NULL);
    assert_int_equal(in_thread, ACL_SUCCESS);
    assert_int_equal(aclrtResetDeviceForce(1), ACL_SUCCESS); /* once is enough */
    int32_t dev;
    assert_int_equal(aclrtGetDevice(&dev), ACL_ERROR_RT_CONTEXT_NULL);
    void *p;
    assert_int_equal(aclrtMalloc(&p, 100, ACL_MEM_MALLOC_HUGE_FIRST), ACL_ERROR_RT_CONTEXT_NULL);
    /* no reference is left over: one set and one reset end the next context */
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtResetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtGetDevice(&dev), ACL_ERROR_RT_CONTEXT_NULL);
    /* a device nobody set, and devices that do not exist */
    assert_int_equal(aclrtResetDeviceForce(1), ACL_SUCCESS);
    assert_int_equal(aclrtResetDeviceForce(2), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(aclrtResetDeviceForce(-1), ACL_ERROR_RT_INVALID_DEVICEID);
}

typedef struct forced_reset {
    int32_t device;
    atomic_bool done;
} forced_reset;

static void *force_reset_in_thread(void *arg)
{
    forced_reset *f = arg;
    (void)aclrtResetDeviceForce(f->device);
    atomic_store(&f->done, true);
    return NULL;
}

static void *set_device_1_and_queue(void *arg)
{
    set_queue_reset *a = arg;
    (void)aclrtSetDevice(1);
    (void)aclrtLaunchCallback(cb_wait_gate, a->gate, ACL_CALLBACK_BLOCK, a->stream);
    return NULL;
}

/* aclrtResetDeviceForce waits as the last aclrtResetDevice does: also for work queued by a thread that
 * set the device while it waited (it used to end the context after its first wait, that work queued). */
static void test_reset_device_force_waits_for_work_queued_while_it_waited(void **state)
{
    (void)state;
    start_runtime(2, GiB_, GiB_, 0, 0);
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    aclrtStream first = new_stream(), second = new_stream();
    static atomic_int gate1, gate2;
    hold_stream(first, &gate1);
    atomic_store(&gate2, 0);
    forced_reset f = {.device = 1};
    pthread_t force, other;
    assert_int_equal(pthread_create(&force, NULL, force_reset_in_thread, &f), 0); /* waits for `first` */
    usleep(100000);
    set_queue_reset a = {second, &gate2};
    assert_int_equal(pthread_create(&other, NULL, set_device_1_and_queue, &a), 0);
    assert_int_equal(pthread_join(other, NULL), 0); /* a reference taken and work queued on `second` */
    atomic_store(&gate1, 1);
    usleep(200000);
    assert_false(atomic_load(&f.done)); /* `second` still holds work */
    int32_t dev = -1;
    assert_int_equal(aclrtGetDevice(&dev), ACL_SUCCESS);
    atomic_store(&gate2, 1);
    assert_int_equal(pthread_join(force, NULL), 0);
    assert_int_equal(aclrtGetDevice(&dev), ACL_ERROR_RT_CONTEXT_NULL); /* ended, after the work */
    aclrtStreamStatus st = ACL_STREAM_STATUS_RESERVED;
    assert_int_equal(aclrtStreamQuery(second, &st), ACL_SUCCESS);
    assert_int_equal(st, ACL_STREAM_STATUS_COMPLETE);
}

static void test_peer_access_rules(void **state)
{
    (void)state;
    start_runtime(3, GiB_, GiB_, 0, 0);
    int32_t can = -1;
    assert_int_equal(aclrtDeviceCanAccessPeer(&can, 0, 1), ACL_SUCCESS);
    assert_int_equal(can, 1);
    assert_int_equal(aclrtDeviceCanAccessPeer(&can, 1, 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDeviceCanAccessPeer(&can, 0, 3), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(aclrtDeviceCanAccessPeer(&can, 3, 3), ACL_ERROR_INVALID_PARAM); /* equal ids first, as CANN */
    assert_int_equal(aclrtDeviceCanAccessPeer(NULL, 0, 1), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDeviceEnablePeerAccess(1, 1), ACL_ERROR_FEATURE_UNSUPPORTED);
    assert_int_equal(aclrtDeviceEnablePeerAccess(0, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDeviceEnablePeerAccess(7, 0), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(aclrtDeviceEnablePeerAccess(1, 0), ACL_SUCCESS);
    assert_int_equal(aclrtDeviceDisablePeerAccess(1), ACL_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_size_accepts_bytes_and_binary_units),
        cmocka_unit_test(test_environment_defaults_and_overrides),
        cmocka_unit_test(test_malformed_environment_names_variable_and_value),
        cmocka_unit_test(test_malformed_module_variable_fails_start),
        cmocka_unit_test_teardown(test_bad_environment_fails_start_with_message, stop_runtime),
        cmocka_unit_test_teardown(test_configure_only_before_start, stop_runtime),
        cmocka_unit_test_teardown(test_current_device_is_per_thread_and_checked, stop_runtime),
        cmocka_unit_test_teardown(test_reset_device_ends_context_after_last_reference, stop_runtime),
        cmocka_unit_test_teardown(test_reset_device_force_drops_every_reference, stop_runtime),
        cmocka_unit_test_teardown(test_reset_device_force_waits_for_work_queued_while_it_waited, stop_runtime),
        cmocka_unit_test_teardown(test_the_last_reset_waits_for_work_queued_while_it_waited, stop_runtime),
        cmocka_unit_test_teardown(test_peer_access_rules, stop_runtime),
        cmocka_unit_test_teardown(test_shutdown_from_a_callback_is_refused_and_changes_nothing, stop_runtime),
    };
    return cmocka_run_group_tests_name("devices", tests, NULL, NULL);
}
