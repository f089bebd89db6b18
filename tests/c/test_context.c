/* test_context.c - explicit contexts (aclrtCreateContext, aclrtDestroyContext, aclrtSetCurrentContext,
 * aclrtGetCurrentContext, aclrtCtxGetCurrentDefaultStream) next to the default context aclrtSetDevice binds,
 * and aclrtGetRunMode: the codes CANN's ACL layer and runtime give (docs/runtime.md), what a NULL stream means
 * in each, and what a destroy, a device reset and fork() leave. */
#include <pthread.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <unistd.h>

#include "device.h"
#include "stream.h"
#include "testutil.h"

#define FORGED ((aclrtContext)(uintptr_t)0x4300000012345601ull) /* the explicit tag, an unknown slot */

static int setup(void **state)
{
    (void)state;
    start_runtime(2, GiB_, GiB_, 0, 0);
    return 0;
}

static aclrtContext created(int32_t device)
{
    aclrtContext c = NULL;
    assert_int_equal(aclrtCreateContext(&c, device), ACL_SUCCESS);
    assert_non_null(c);
    return c;
}

static aclrtContext current(void)
{
    aclrtContext c = NULL;
    assert_int_equal(aclrtGetCurrentContext(&c), ACL_SUCCESS);
    return c;
}

static int32_t current_device(void)
{
    int32_t dev = -1;
    assert_int_equal(aclrtGetDevice(&dev), ACL_SUCCESS);
    return dev;
}

static aclrtStreamStatus null_stream_status(void)
{
    aclrtStreamStatus st = ACL_STREAM_STATUS_RESERVED;
    assert_int_equal(aclrtStreamQuery(NULL, &st), ACL_SUCCESS);
    return st;
}

static void test_a_new_context_is_bound_to_its_thread_with_its_device(void **state)
{
    (void)state;
    aclrtContext primary = current(); /* setup's aclrtSetDevice(0): device 0's default context */
    aclrtContext ctx = created(1);
    assert_ptr_not_equal(ctx, primary);
    assert_ptr_equal(current(), ctx);
    assert_int_equal(current_device(), 1);
    assert_int_equal(aclrtSetCurrentContext(primary), ACL_SUCCESS);
    assert_int_equal(current_device(), 0);
    assert_ptr_equal(current(), primary);
    assert_int_equal(aclrtSetCurrentContext(ctx), ACL_SUCCESS);
    assert_int_equal(current_device(), 1);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS); /* back to the device's default context, as in CANN */
    assert_ptr_equal(current(), primary);
    assert_int_equal(aclrtDestroyContext(ctx), ACL_SUCCESS);
}

static void test_a_null_stream_is_the_current_contexts_default_stream(void **state)
{
    (void)state;
    aclrtContext primary = current();
    aclrtContext a = created(0), b = created(0);
    atomic_int gate;
    assert_int_equal(aclrtSetCurrentContext(a), ACL_SUCCESS);
    hold_stream(NULL, &gate); /* a's default stream */
    assert_int_equal(null_stream_status(), ACL_STREAM_STATUS_NOT_READY);
    assert_int_equal(aclrtSetCurrentContext(b), ACL_SUCCESS);
    assert_int_equal(null_stream_status(), ACL_STREAM_STATUS_COMPLETE); /* b's: nothing queued */
    assert_int_equal(aclrtSetCurrentContext(primary), ACL_SUCCESS);
    assert_int_equal(null_stream_status(), ACL_STREAM_STATUS_COMPLETE); /* the device's own */
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSetCurrentContext(a), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
    assert_int_equal(null_stream_status(), ACL_STREAM_STATUS_COMPLETE);
    assert_int_equal(aclrtDestroyContext(a), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyContext(b), ACL_SUCCESS);
}

static aclrtStream default_stream_of_context(void)
{
    aclrtStream s = (aclrtStream)1;
    assert_int_equal(aclrtCtxGetCurrentDefaultStream(&s), ACL_SUCCESS);
    return s;
}

/* aclrtCtxGetCurrentDefaultStream names the stream a NULL stream means: the explicit context's own stream,
 * which works as a handle from any context, or NULL in a device's default context. */
static void test_the_current_contexts_default_stream_is_what_a_null_stream_means(void **state)
{
    (void)state;
    aclrtContext primary = current();
    assert_null(default_stream_of_context());
    aclrtContext a = created(0);
    aclrtStream sa = default_stream_of_context();
    assert_non_null(sa);
    atomic_int gate;
    hold_stream(sa, &gate);
    assert_int_equal(null_stream_status(), ACL_STREAM_STATUS_NOT_READY); /* the same stream */
    assert_int_equal(aclrtSetCurrentContext(primary), ACL_SUCCESS);
    assert_null(default_stream_of_context());
    aclrtStreamStatus st = ACL_STREAM_STATUS_RESERVED;
    assert_int_equal(aclrtStreamQuery(sa, &st), ACL_SUCCESS);
    assert_int_equal(st, ACL_STREAM_STATUS_NOT_READY);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(sa), ACL_SUCCESS);
    assert_int_equal(aclrtSetCurrentContext(a), ACL_SUCCESS);
    assert_ptr_equal(default_stream_of_context(), sa);
    assert_int_equal(aclrtCtxGetCurrentDefaultStream(NULL), ACL_ERROR_INVALID_PARAM);
    /* aclrtDestroyStream destroys only created streams: the context's own one lives with the context (it
     * was destroyed, and every NULL-stream call of the live context then returned 107002) */
    assert_int_equal(aclrtDestroyStream(sa), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
    assert_int_equal(aclrtStreamQuery(sa, &st), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyContext(a), ACL_SUCCESS);
    aclrtStream none = (aclrtStream)1;
    assert_int_equal(aclrtCtxGetCurrentDefaultStream(&none), ACL_ERROR_RT_CONTEXT_NULL);
    assert_ptr_equal(none, (aclrtStream)1); /* not written on failure */
    assert_int_equal(aclrtStreamQuery(sa, &st), ACL_ERROR_INVALID_PARAM); /* destroyed with its context */
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
}

typedef struct bound_thread {
    aclrtContext ctx;
    atomic_int bound, go;
    aclError after;
} bound_thread;

static void *use_after_destroy(void *arg)
{
    bound_thread *t = arg;
    assert_int_equal(aclrtSetCurrentContext(t->ctx), ACL_SUCCESS);
    atomic_store(&t->bound, 1);
    cb_wait_gate(&t->go);
    int32_t dev;
    t->after = aclrtGetDevice(&dev);
    return NULL;
}

static void test_a_destroy_ends_the_context_and_its_streams_for_every_thread(void **state)
{
    (void)state;
    aclrtContext ctx = created(1);
    aclrtStream mine = NULL;
    assert_int_equal(aclrtCreateStream(&mine), ACL_SUCCESS);
    bound_thread t = {.ctx = ctx};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, use_after_destroy, &t), 0);
    cb_wait_gate(&t.bound);
    assert_int_equal(aclrtDestroyContext(ctx), ACL_SUCCESS);
    atomic_store(&t.go, 1);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(t.after, ACL_ERROR_RT_CONTEXT_NULL);
    /* the destroying thread was bound to it too: no context now, no fallback to a default one */
    int32_t dev;
    assert_int_equal(aclrtGetDevice(&dev), ACL_ERROR_RT_CONTEXT_NULL);
    aclrtContext none = NULL;
    assert_int_equal(aclrtGetCurrentContext(&none), ACL_ERROR_RT_CONTEXT_NULL);
    aclrtStream s = NULL;
    assert_int_equal(aclrtCreateStream(&s), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_ERROR_RT_CONTEXT_NULL);
    aclrtStreamStatus st;
    assert_int_equal(aclrtStreamQuery(mine, &st), ACL_ERROR_INVALID_PARAM); /* destroyed with its context */
    assert_int_equal(aclrtDestroyStream(mine), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    assert_int_equal(current_device(), 0);
}

static void test_a_destroy_waits_for_the_work_queued_in_the_context(void **state)
{
    (void)state;
    aclrtContext ctx = created(0);
    void *dev = NULL;
    assert_int_equal(aclrtMalloc(&dev, 64, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS);
    atomic_int gate;
    hold_stream(NULL, &gate);
    assert_int_equal(aclrtMemsetAsync(dev, 64, 0x5A, 64, NULL), ACL_SUCCESS);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtDestroyContext(ctx), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    unsigned char host[64];
    assert_int_equal(aclrtMemcpy(host, 64, dev, 64, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(host[0], 0x5A);
    assert_int_equal(host[63], 0x5A);
    assert_int_equal(aclrtFree(dev), ACL_SUCCESS);
}

static void test_bad_arguments_get_canns_codes(void **state)
{
    (void)state;
    aclrtContext primary = current();
    assert_int_equal(aclrtCreateContext(NULL, 0), ACL_ERROR_INVALID_PARAM);
    aclrtContext c = NULL;
    assert_int_equal(aclrtCreateContext(&c, -1), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(aclrtCreateContext(&c, 2), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_null(c);
    assert_int_equal(aclrtDestroyContext(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyContext(primary), ACL_ERROR_RT_CONTEXT_NULL); /* a default context stays */
    assert_int_equal(aclrtDestroyContext(FORGED), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtSetCurrentContext(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSetCurrentContext(FORGED), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtGetCurrentContext(NULL), ACL_ERROR_INVALID_PARAM);
    c = created(1);
    assert_int_equal(aclrtDestroyContext(c), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyContext(c), ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(aclrtSetCurrentContext(c), ACL_ERROR_RT_PARAM_INVALID);
    aclrtContext again = created(1); /* may take the same slot: the old handle stays dead */
    assert_int_equal(aclrtSetCurrentContext(c), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtSetCurrentContext(primary), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyContext(again), ACL_SUCCESS);
}

static void *context_without_device(void *arg)
{
    aclrtContext c = (aclrtContext)1;
    *(aclError *)arg = aclrtGetCurrentContext(&c);
    return NULL;
}

static void test_a_thread_without_a_device_has_no_context(void **state)
{
    (void)state;
    aclError rc = ACL_SUCCESS;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, context_without_device, &rc), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(rc, ACL_ERROR_RT_CONTEXT_NULL);
}

static void test_a_default_context_ends_with_its_device_and_explicit_ones_do_not(void **state)
{
    (void)state;
    aclrtContext primary = current();
    aclrtContext ctx = created(0);
    assert_int_equal(aclrtResetDeviceForce(0), ACL_SUCCESS);
    assert_int_equal(aclrtSetCurrentContext(primary), ACL_ERROR_RT_PARAM_INVALID);
    assert_ptr_equal(current(), ctx); /* the failed call left the binding alone */
    void *p = NULL;
    assert_int_equal(aclrtMalloc(&p, 4096, ACL_MEM_MALLOC_NORMAL_ONLY), ACL_SUCCESS); /* the context's device */
    assert_int_equal(aclrtMemsetAsync(p, 4096, 1, 4096, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
    assert_int_equal(aclrtFree(p), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    assert_ptr_not_equal(current(), primary); /* a new default context: the old handle stays ended */
    assert_int_equal(aclrtDestroyContext(ctx), ACL_SUCCESS);
}

static void test_the_table_of_contexts_is_bounded(void **state)
{
    (void)state;
    enum { MANY = 1024 };
    static aclrtContext all[MANY];
    for (int i = 0; i < MANY; i++)
        all[i] = created(i % 2);
    aclrtContext extra = NULL;
    assert_int_equal(aclrtCreateContext(&extra, 0), ACL_ERROR_RT_RESOURCE_ALLOC_FAIL);
    assert_ptr_equal(current(), all[MANY - 1]); /* the refusal left the binding alone */
    for (int i = 0; i < MANY; i++)
        assert_int_equal(aclrtDestroyContext(all[i]), ACL_SUCCESS);
    extra = created(0);
    assert_int_equal(aclrtDestroyContext(extra), ACL_SUCCESS);
}

static void test_a_fork_child_has_no_context(void **state)
{
    (void)state;
    aclrtContext ctx = created(1);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int32_t dev;
        aclrtContext c;
        int ok = aclrtGetDevice(&dev) == ACL_ERROR_RT_CONTEXT_NULL &&
                 aclrtGetCurrentContext(&c) == ACL_ERROR_RT_CONTEXT_NULL &&
                 aclrtSetCurrentContext(ctx) == ACL_ERROR_RT_PARAM_INVALID && aclrtSetDevice(0) == ACL_SUCCESS;
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    assert_int_equal(current_device(), 1); /* the parent keeps its context */
    assert_int_equal(aclrtDestroyContext(ctx), ACL_SUCCESS);
}

static size_t live_streams(void)
{
    size_t streams = 0, events = 0;
    stream_counts(&streams, &events);
    return streams;
}

typedef struct destroy_from_callback {
    aclrtContext ctx;
    aclError rc;
} destroy_from_callback;

static void cb_destroy_context(void *arg)
{
    destroy_from_callback *d = arg;
    d->rc = aclrtDestroyContext(d->ctx);
}

/* The destroy used to stop at the stream running it and leave the context's other streams alive, and
 * the next context made in the slot then destroyed them. */
static void test_a_destroy_from_a_callback_of_its_own_stream_takes_the_other_streams(void **state)
{
    (void)state;
    size_t before = live_streams();
    destroy_from_callback d = {.ctx = created(1), .rc = -1};
    aclrtStream runner = new_stream(), other = new_stream(), later = new_stream();
    assert_int_equal(aclrtLaunchCallback(cb_destroy_context, &d, ACL_CALLBACK_BLOCK, runner), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(runner), ACL_SUCCESS);
    assert_int_equal(d.rc, ACL_SUCCESS);
    aclrtStreamStatus st;
    assert_int_equal(aclrtStreamQuery(other, &st), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtStreamQuery(later, &st), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(live_streams(), before + 1); /* the runner alone: an ordinary stream of device 1 now */
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    aclrtContext next = created(1); /* very likely the same slot */
    assert_int_equal(aclrtDestroyContext(next), ACL_SUCCESS);
    assert_int_equal(aclrtStreamQuery(runner, &st), ACL_SUCCESS); /* not taken by the slot's next context */
    assert_int_equal(aclrtDestroyStream(runner), ACL_SUCCESS);
    assert_int_equal(live_streams(), before);
}

typedef struct stream_maker {
    aclrtContext ctx;
    atomic_int bound;
    int made;
} stream_maker;

static void *make_streams_until_refused(void *arg)
{
    stream_maker *m = arg;
    assert_int_equal(aclrtSetCurrentContext(m->ctx), ACL_SUCCESS);
    atomic_store(&m->bound, 1);
    aclrtStream s;
    while (aclrtCreateStream(&s) == ACL_SUCCESS)
        m->made++;
    return NULL;
}

/* A stream made while another thread destroyed its context used to be listed after the destroy's sweep:
 * it outlived the context. */
static void test_no_stream_outlives_a_context_destroyed_while_streams_are_made_in_it(void **state)
{
    (void)state;
    size_t before = live_streams();
    for (int round = 0; round < 50; round++) {
        stream_maker m = {.ctx = created(round % 2)};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, make_streams_until_refused, &m), 0);
        cb_wait_gate(&m.bound);
        for (volatile int spin = 0; spin < round * 1000; spin++) {
        }
        assert_int_equal(aclrtDestroyContext(m.ctx), ACL_SUCCESS);
        assert_int_equal(pthread_join(th, NULL), 0);
        assert_int_equal(live_streams(), before);
        assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    }
}

typedef struct stale_reader {
    aclrtContext ctx;
    atomic_int bound, stop;
    int wrong; /* answers that were neither the context's device nor "no context" after its end */
} stale_reader;

static void *read_device_until_stopped(void *arg)
{
    stale_reader *r = arg;
    assert_int_equal(aclrtSetCurrentContext(r->ctx), ACL_SUCCESS);
    atomic_store(&r->bound, 1);
    bool ended = false;
    while (!atomic_load(&r->stop)) {
        int32_t dev = -1;
        aclError rc = aclrtGetDevice(&dev);
        if (rc == ACL_ERROR_RT_CONTEXT_NULL)
            ended = true;
        else if (rc != ACL_SUCCESS || dev != 1 || ended)
            r->wrong++;
    }
    return NULL;
}

/* A thread bound to a context that another thread destroys, while the slot is made new contexts of another
 * device: it sees its context's device, then no context, never the new ones' (TSan: no race). */
static void test_a_thread_bound_to_a_destroyed_context_never_reads_the_next_one(void **state)
{
    (void)state;
    stale_reader r = {.ctx = created(1)};
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, read_device_until_stopped, &r), 0);
    cb_wait_gate(&r.bound);
    assert_int_equal(aclrtDestroyContext(r.ctx), ACL_SUCCESS);
    for (int i = 0; i < 200; i++)
        assert_int_equal(aclrtDestroyContext(created(0)), ACL_SUCCESS);
    atomic_store(&r.stop, 1);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_int_equal(r.wrong, 0);
}

/* An enable made in an explicit context was tagged with the thread's last default context, which a reset
 * had ended: the access was gone at once. */
static void test_peer_access_enabled_in_an_explicit_context_holds(void **state)
{
    (void)state;
    assert_int_equal(aclrtResetDeviceForce(0), ACL_SUCCESS); /* the thread's default context of device 0 ends */
    aclrtContext ctx = created(0);
    assert_false(device_peer_enabled(0, 1));
    assert_int_equal(aclrtDeviceEnablePeerAccess(1, 0), ACL_SUCCESS);
    assert_true(device_peer_enabled(0, 1));
    assert_int_equal(aclrtDeviceDisablePeerAccess(1), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyContext(ctx), ACL_SUCCESS);
}

static void test_run_mode_is_host(void **state)
{
    (void)state;
    assert_int_equal(ACL_DEVICE, 0);
    assert_int_equal(ACL_HOST, 1);
    aclrtRunMode mode = ACL_DEVICE;
    assert_int_equal(aclrtGetRunMode(&mode), ACL_SUCCESS);
    assert_int_equal(mode, ACL_HOST);
    assert_int_equal(aclrtGetRunMode(NULL), ACL_ERROR_INVALID_PARAM);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_a_new_context_is_bound_to_its_thread_with_its_device, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_a_null_stream_is_the_current_contexts_default_stream, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_the_current_contexts_default_stream_is_what_a_null_stream_means, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_a_destroy_ends_the_context_and_its_streams_for_every_thread, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_a_destroy_waits_for_the_work_queued_in_the_context, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_bad_arguments_get_canns_codes, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_a_thread_without_a_device_has_no_context, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_a_default_context_ends_with_its_device_and_explicit_ones_do_not, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_the_table_of_contexts_is_bounded, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_a_fork_child_has_no_context, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_a_destroy_from_a_callback_of_its_own_stream_takes_the_other_streams,
                                        setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_no_stream_outlives_a_context_destroyed_while_streams_are_made_in_it,
                                        setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_a_thread_bound_to_a_destroyed_context_never_reads_the_next_one, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_peer_access_enabled_in_an_explicit_context_holds, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_run_mode_is_host, setup, stop_runtime),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
