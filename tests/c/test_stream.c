/* test_stream.c - streams, events, callbacks, sticky errors, fork and shutdown. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "acl_rt.h"
#include "device.h"
#include "host.h"
#include "npualloc.h"
#include "stream.h"

#define MS (1000000ull) /* nanoseconds */

/* Defined only when runtime.c is linked in: then its pthread_atfork handlers are registered. */
extern void npualloc_shutdown(void) __attribute__((weak));

/* ---- helpers ---- */

/* An ordered log written by tasks on any worker. */
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static int log_values[512];
static int log_count;

static void log_reset(void)
{
    pthread_mutex_lock(&log_lock);
    log_count = 0;
    pthread_mutex_unlock(&log_lock);
}

static void log_append(int v)
{
    pthread_mutex_lock(&log_lock);
    if (log_count < (int)(sizeof log_values / sizeof log_values[0]))
        log_values[log_count++] = v;
    pthread_mutex_unlock(&log_lock);
}

static aclError task_append(void *arg)
{
    log_append(*(const int *)arg);
    return ACL_SUCCESS;
}

static aclError task_fail(void *arg)
{
    return (aclError)(intptr_t)arg;
}

static void cb_append(void *user_data) { log_append(*(const int *)user_data); }

static void cb_set_flag(void *user_data) { atomic_store((atomic_int *)user_data, 1); }

static void cb_count(void *user_data) { atomic_fetch_add((atomic_int *)user_data, 1); }

static aclrtStream new_stream(void)
{
    aclrtStream s = NULL;
    assert_int_equal(aclrtCreateStream(&s), ACL_SUCCESS);
    assert_non_null(s);
    return s;
}

static aclrtEvent new_event(void)
{
    aclrtEvent e = NULL;
    assert_int_equal(aclrtCreateEvent(&e), ACL_SUCCESS);
    assert_non_null(e);
    return e;
}

static aclrtEventStatus query(aclrtEvent e)
{
    aclrtEventStatus st = ACL_EVENT_STATUS_RESERVED;
    assert_int_equal(aclrtQueryEvent(e, &st), ACL_SUCCESS);
    return st;
}

static aclrtEventRecordedStatus query_recorded(aclrtEvent e)
{
    aclrtEventRecordedStatus st = (aclrtEventRecordedStatus)-1;
    assert_int_equal(aclrtQueryEventStatus(e, &st), ACL_SUCCESS);
    return st;
}

static void assert_counts(size_t streams, size_t events)
{
    size_t s = 99, e = 99;
    stream_counts(&s, &e);
    assert_int_equal(s, streams);
    assert_int_equal(e, events);
}

static int setup(void **state)
{
    (void)state;
    log_reset();
    return aclrtSetDevice(0) == ACL_SUCCESS ? 0 : -1;
}

/* Everything is released; ASan's leak check at exit sees whatever a test leaked. */
static int teardown(void **state)
{
    (void)state;
    stream_shutdown();
    size_t s = 1, e = 1;
    stream_counts(&s, &e);
    device_shutdown();
    return (s == 0 && e == 0) ? 0 : -1;
}

/* ---- ordering ---- */

static void test_tasks_run_in_fifo_order_with_increasing_positions(void **state)
{
    (void)state;
    npu_stream *s;
    assert_int_equal(stream_acquire(NULL, &s), ACL_SUCCESS);
    assert_int_equal(stream_id(s), 0);
    assert_int_equal(stream_device(s), 0);
    static int vals[100];
    uint64_t base = stream_last_position(s), pos = 0, mid = 0;
    assert_int_equal(npualloc_sleep_async(NULL, 0.02), ACL_SUCCESS); /* let the queue build up */
    base++;
    for (int i = 0; i < 100; i++) {
        vals[i] = i;
        assert_int_equal(stream_enqueue(s, task_append, &vals[i], NULL, &pos), ACL_SUCCESS);
        assert_int_equal(pos, base + (uint64_t)i + 1);
        if (i == 49)
            mid = pos;
    }
    assert_int_equal(stream_last_position(s), base + 100);
    stream_wait_position(s, mid);
    assert_true(stream_passed(s, mid));
    assert_int_equal(stream_synchronize(s), ACL_SUCCESS);
    assert_true(stream_passed(s, base + 100));
    assert_int_equal(log_count, 100);
    for (int i = 0; i < 100; i++)
        assert_int_equal(log_values[i], i);
    stream_release(s);
}

static void test_created_stream_id_is_its_handle(void **state)
{
    (void)state;
    aclrtStream h = new_stream();
    npu_stream *s;
    assert_int_equal(stream_acquire(h, &s), ACL_SUCCESS);
    assert_int_equal(stream_id(s), (uint64_t)(uintptr_t)h);
    assert_int_equal(stream_device(s), 0);
    assert_int_equal(stream_last_position(s), 0);
    assert_true(stream_passed(s, 0));
    stream_release(s);
    assert_int_equal(aclrtDestroyStream(h), ACL_SUCCESS);
}

static void test_event_behind_sleep_is_not_ready_until_synchronized(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    aclrtEvent e = new_event();
    uint64_t t0 = host_now_ns();
    assert_int_equal(npualloc_sleep_async(st, 0.1), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, st), ACL_SUCCESS);
    assert_int_equal(query(e), ACL_EVENT_STATUS_NOT_READY);
    assert_int_equal(query_recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY);
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    assert_true(host_now_ns() - t0 >= 95 * MS);
    assert_int_equal(query(e), ACL_EVENT_STATUS_COMPLETE);
    assert_int_equal(query_recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static void test_never_recorded_event_is_complete_but_not_recorded(void **state)
{
    (void)state;
    aclrtEvent e = new_event();
    assert_int_equal(query(e), ACL_EVENT_STATUS_COMPLETE);
    /* CANN: NOT_READY covers "not recorded" for aclrtQueryEventStatus. */
    assert_int_equal(query_recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY);
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
}

static void test_elapsed_time_spans_sleep_and_may_be_negative(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    aclrtEvent start = new_event(), end = new_event();
    assert_int_equal(aclrtRecordEvent(start, st), ACL_SUCCESS);
    assert_int_equal(npualloc_sleep_async(st, 0.05), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(end, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeEvent(end), ACL_SUCCESS);
    float ms = -1;
    assert_int_equal(aclrtEventElapsedTime(&ms, start, end), ACL_SUCCESS);
    assert_true(ms >= 45.0f && ms < 2000.0f);
    float back = 0;
    assert_int_equal(aclrtEventElapsedTime(&back, end, start), ACL_SUCCESS);
    assert_true(back <= -45.0f);
    assert_true(fabsf(back + ms) < 0.01f);
    assert_int_equal(aclrtEventElapsedTime(&ms, start, start), ACL_SUCCESS);
    assert_true(ms == 0.0f);
    aclrtDestroyEvent(start);
    aclrtDestroyEvent(end);
    aclrtDestroyStream(st);
}

static void test_elapsed_time_rejects_unrecorded_and_incomplete_events(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    aclrtEvent never = new_event(), done = new_event(), pending = new_event();
    assert_int_equal(aclrtRecordEvent(done, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    float ms = 0;
    assert_int_equal(aclrtEventElapsedTime(&ms, never, done), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtEventElapsedTime(&ms, done, never), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtEventElapsedTime(NULL, done, done), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_sleep_async(st, 0.1), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(pending, st), ACL_SUCCESS);
    assert_int_equal(aclrtEventElapsedTime(&ms, done, pending), ACL_ERROR_RT_STREAM_NOT_COMPLETE);
    assert_int_equal(aclrtEventElapsedTime(&ms, pending, done), ACL_ERROR_RT_STREAM_NOT_COMPLETE);
    assert_int_equal(ACL_ERROR_RT_STREAM_NOT_COMPLETE, 507004);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(aclrtEventElapsedTime(&ms, done, pending), ACL_SUCCESS);
    assert_true(ms >= 95.0f);
    aclrtDestroyEvent(never);
    aclrtDestroyEvent(done);
    aclrtDestroyEvent(pending);
    aclrtDestroyStream(st);
}

/* ---- cross-stream waits ---- */

static void test_stream_wait_event_makes_b_wait_for_sleep_on_a(void **state)
{
    (void)state;
    aclrtStream a = new_stream(), b = new_stream();
    aclrtEvent e = new_event();
    static int a_done_val = 1, b_val = 2;
    assert_int_equal(npualloc_sleep_async(a, 0.1), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_append, &a_done_val, ACL_CALLBACK_BLOCK, a), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, a), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(b, e), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_append, &b_val, ACL_CALLBACK_BLOCK, b), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(b), ACL_SUCCESS);
    /* B's callback ran, and only after A's sleep and A's callback. */
    assert_int_equal(log_count, 2);
    assert_int_equal(log_values[0], 1);
    assert_int_equal(log_values[1], 2);
    aclrtDestroyEvent(e);
    aclrtDestroyStream(a);
    aclrtDestroyStream(b);
}

static void test_stream_wait_uses_position_captured_at_call(void **state)
{
    (void)state;
    aclrtStream a = new_stream(), b = new_stream(), c = new_stream();
    aclrtEvent e = new_event();
    static int a_val = 1, b_val = 2;
    assert_int_equal(npualloc_sleep_async(a, 0.1), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_append, &a_val, ACL_CALLBACK_NO_BLOCK, a), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, a), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(b, e), ACL_SUCCESS);
    /* Moving the event to an idle stream afterwards does not release B early. */
    assert_int_equal(aclrtRecordEvent(e, c), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_append, &b_val, ACL_CALLBACK_NO_BLOCK, b), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(b), ACL_SUCCESS);
    assert_int_equal(log_count, 2);
    assert_int_equal(log_values[0], 1);
    assert_int_equal(log_values[1], 2);
    aclrtDestroyEvent(e);
    aclrtDestroyStream(a);
    aclrtDestroyStream(b);
    aclrtDestroyStream(c);
}

static void test_stream_wait_on_unrecorded_event_does_not_block(void **state)
{
    (void)state;
    aclrtStream a = new_stream();
    aclrtEvent e = new_event();
    uint64_t t0 = host_now_ns();
    assert_int_equal(aclrtStreamWaitEvent(a, e), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(NULL, e), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(a), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
    assert_true(host_now_ns() - t0 < 50 * MS);
    aclrtDestroyEvent(e);
    aclrtDestroyStream(a);
}

static void test_re_record_moves_event_and_old_record_does_not_restamp(void **state)
{
    (void)state;
    aclrtStream a = new_stream(), b = new_stream();
    aclrtEvent e = new_event(), ref = new_event();
    assert_int_equal(npualloc_sleep_async(a, 0.1), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, a), ACL_SUCCESS);
    assert_int_equal(query(e), ACL_EVENT_STATUS_NOT_READY);
    assert_int_equal(aclrtRecordEvent(e, b), ACL_SUCCESS); /* b is idle */
    uint64_t t0 = host_now_ns();
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    assert_true(host_now_ns() - t0 < 80 * MS);
    assert_int_equal(query(e), ACL_EVENT_STATUS_COMPLETE);
    assert_int_equal(aclrtRecordEvent(ref, b), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeEvent(ref), ACL_SUCCESS);
    float before = -1, after = -1;
    assert_int_equal(aclrtEventElapsedTime(&before, e, ref), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(a), ACL_SUCCESS); /* the obsolete record passes */
    assert_int_equal(aclrtEventElapsedTime(&after, e, ref), ACL_SUCCESS);
    assert_true(before == after);
    assert_true(after >= 0.0f && after < 80.0f);
    aclrtDestroyEvent(e);
    aclrtDestroyEvent(ref);
    aclrtDestroyStream(a);
    aclrtDestroyStream(b);
}

/* ---- callbacks and errors ---- */

static void test_callbacks_run_in_order_with_their_user_data(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    static int vals[20];
    for (int i = 0; i < 20; i++) {
        vals[i] = 100 + i;
        aclrtCallbackBlockType block = (i % 2) ? ACL_CALLBACK_BLOCK : ACL_CALLBACK_NO_BLOCK;
        assert_int_equal(aclrtLaunchCallback(cb_append, &vals[i], block, st), ACL_SUCCESS);
    }
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(log_count, 20);
    for (int i = 0; i < 20; i++)
        assert_int_equal(log_values[i], 100 + i);
    /* On the default stream too. */
    static int dflt = 7;
    assert_int_equal(aclrtLaunchCallback(cb_append, &dflt, ACL_CALLBACK_BLOCK, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
    assert_int_equal(log_values[20], 7);
    aclrtDestroyStream(st);
}

static void test_launch_callback_rejects_null_fn_and_bad_block_type(void **state)
{
    (void)state;
    static int v;
    assert_int_equal(aclrtLaunchCallback(NULL, &v, ACL_CALLBACK_BLOCK, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtLaunchCallback(cb_append, &v, (aclrtCallbackBlockType)2, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtLaunchCallback(cb_append, &v, (aclrtCallbackBlockType)-1, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
    assert_int_equal(log_count, 0);
}

static void test_sticky_error_is_returned_once_by_next_synchronize(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    npu_stream *s;
    assert_int_equal(stream_acquire(st, &s), ACL_SUCCESS);
    static int v = 5;
    assert_int_equal(stream_enqueue(s, task_fail, (void *)(intptr_t)ACL_ERROR_RT_DEVICE_MEM_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, task_fail, (void *)(intptr_t)ACL_ERROR_RT_INTERNAL_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, task_append, &v, NULL, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_ERROR_RT_DEVICE_MEM_ERROR); /* the first one */
    assert_int_equal(log_count, 1);                                              /* later tasks still ran */
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    stream_release(s);
    aclrtDestroyStream(st);
}

static void test_synchronize_device_returns_sticky_errors_of_all_its_streams_once(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    npu_stream *s, *d;
    assert_int_equal(stream_acquire(st, &s), ACL_SUCCESS);
    assert_int_equal(stream_acquire(NULL, &d), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, task_fail, (void *)(intptr_t)ACL_ERROR_RT_DEVICE_MEM_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_ERROR_RT_DEVICE_MEM_ERROR);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(d, task_fail, (void *)(intptr_t)ACL_ERROR_RT_INTERNAL_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_ERROR_RT_INTERNAL_ERROR);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
    /* Another device's error is not this device's. */
    npu_stream *other;
    assert_int_equal(stream_acquire_default(1, &other), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(other, task_fail, (void *)(intptr_t)ACL_ERROR_RT_INTERNAL_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_SUCCESS);
    assert_int_equal(stream_synchronize_device(1), ACL_ERROR_RT_INTERNAL_ERROR);
    assert_int_equal(stream_synchronize_device(99), ACL_ERROR_RT_INVALID_DEVICEID);
    stream_release(other);
    stream_release(d);
    stream_release(s);
    aclrtDestroyStream(st);
}

/* ---- bad arguments and handles ---- */

static void check_stream_handle_rejected(aclrtStream bad, aclrtEvent good_event)
{
    static int v;
    npu_stream *s;
    assert_int_equal(aclrtDestroyStream(bad), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeStream(bad), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtLaunchCallback(cb_append, &v, ACL_CALLBACK_BLOCK, bad), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_sleep_async(bad, 0.0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtRecordEvent(good_event, bad), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtStreamWaitEvent(bad, good_event), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(stream_acquire(bad, &s), ACL_ERROR_INVALID_PARAM);
}

static void test_bad_stream_arguments_and_handles_are_rejected(void **state)
{
    (void)state;
    aclrtEvent e = new_event();
    assert_int_equal(aclrtCreateStream(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyStream(NULL), ACL_ERROR_INVALID_PARAM); /* the default stream */
    check_stream_handle_rejected((aclrtStream)(uintptr_t)0x1234, e);
    /* Right tag, wrong slot and generation. */
    check_stream_handle_rejected((aclrtStream)(uintptr_t)(((uint64_t)'S' << 56) | ((uint64_t)7 << 24) | 1000), e);
    check_stream_handle_rejected((aclrtStream)e, e); /* an event is not a stream */
    aclrtStream st = new_stream();
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
    check_stream_handle_rejected(st, e); /* stale */
    npu_stream *s;
    assert_int_equal(stream_acquire(NULL, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(stream_acquire_default(99, &s), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(stream_acquire_default(-1, &s), ACL_ERROR_RT_INVALID_DEVICEID);
    assert_int_equal(stream_acquire(NULL, &s), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, NULL, NULL, NULL, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(stream_enqueue(NULL, task_append, NULL, NULL, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(stream_synchronize(NULL), ACL_ERROR_INVALID_PARAM);
    stream_release(s);
    assert_int_equal(log_count, 0);
    aclrtDestroyEvent(e);
}

static void check_event_handle_rejected(aclrtEvent bad, aclrtEvent good, aclrtStream st)
{
    aclrtEventStatus es;
    aclrtEventRecordedStatus rs;
    float ms;
    assert_int_equal(aclrtDestroyEvent(bad), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtRecordEvent(bad, st), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEvent(bad, &es), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventStatus(bad, &rs), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeEvent(bad), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtEventElapsedTime(&ms, bad, good), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtEventElapsedTime(&ms, good, bad), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtStreamWaitEvent(st, bad), ACL_ERROR_INVALID_PARAM);
}

static void test_bad_event_arguments_and_handles_are_rejected(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    aclrtEvent good = new_event();
    assert_int_equal(aclrtRecordEvent(good, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeEvent(good), ACL_SUCCESS);
    assert_int_equal(aclrtCreateEvent(NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEvent(good, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventStatus(good, NULL), ACL_ERROR_INVALID_PARAM);
    check_event_handle_rejected(NULL, good, st);
    check_event_handle_rejected((aclrtEvent)(uintptr_t)0x1234, good, st);
    check_event_handle_rejected((aclrtEvent)st, good, st); /* a stream is not an event */
    aclrtEvent gone = new_event();
    assert_int_equal(aclrtDestroyEvent(gone), ACL_SUCCESS);
    check_event_handle_rejected(gone, good, st); /* destroyed */
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    aclrtDestroyEvent(good);
    aclrtDestroyStream(st);
}

static void test_sleep_async_rejects_negative_nan_and_infinite(void **state)
{
    (void)state;
    assert_int_equal(npualloc_sleep_async(NULL, -1.0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_sleep_async(NULL, -1e-9), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_sleep_async(NULL, NAN), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_sleep_async(NULL, INFINITY), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_sleep_async(NULL, 1e300), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_sleep_async(NULL, 0.0), ACL_SUCCESS);
    assert_int_equal(npualloc_sleep_async(NULL, 0.001), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
}

/* ---- contexts and devices ---- */

typedef struct no_context_results {
    aclrtStream created; /* a stream made on the test thread, usable from any thread */
    aclrtEvent event;
    aclError rc[9];
} no_context_results;

static void *no_context_thread(void *arg)
{
    no_context_results *r = arg;
    aclrtStream s = NULL;
    npu_stream *ns;
    static int v;
    r->rc[0] = aclrtCreateStream(&s);
    r->rc[1] = aclrtSynchronizeStream(NULL);
    r->rc[2] = aclrtSynchronizeDevice();
    r->rc[3] = npualloc_sleep_async(NULL, 0.0);
    r->rc[4] = aclrtLaunchCallback(cb_append, &v, ACL_CALLBACK_BLOCK, NULL);
    r->rc[5] = aclrtRecordEvent(r->event, NULL);
    r->rc[6] = stream_acquire(NULL, &ns);
    r->rc[7] = aclrtStreamWaitEvent(NULL, r->event);
    r->rc[8] = aclrtSynchronizeStream(r->created); /* an explicit stream needs no context */
    return NULL;
}

static void test_without_current_device_context_calls_fail_with_107002(void **state)
{
    (void)state;
    no_context_results r = {.created = new_stream(), .event = new_event()};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, no_context_thread, &r), 0);
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(ACL_ERROR_RT_CONTEXT_NULL, 107002);
    for (int i = 0; i < 8; i++)
        assert_int_equal(r.rc[i], ACL_ERROR_RT_CONTEXT_NULL);
    assert_int_equal(r.rc[8], ACL_SUCCESS);
    assert_counts(1, 1);
    aclrtDestroyEvent(r.event);
    aclrtDestroyStream(r.created);
}

static void test_default_streams_are_per_device_and_not_counted(void **state)
{
    (void)state;
    uint32_t n = 0;
    assert_int_equal(aclrtGetDeviceCount(&n), ACL_SUCCESS);
    assert_int_equal(n, 8);
    npu_stream *s0, *s1, *again0, *again1;
    assert_int_equal(stream_acquire(NULL, &s0), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    assert_int_equal(stream_acquire(NULL, &s1), ACL_SUCCESS);
    assert_ptr_not_equal(s0, s1);
    assert_int_equal(stream_device(s0), 0);
    assert_int_equal(stream_device(s1), 1);
    assert_int_equal(stream_id(s1), 0);
    assert_int_equal(stream_acquire_default(0, &again0), ACL_SUCCESS);
    assert_int_equal(stream_acquire_default(1, &again1), ACL_SUCCESS);
    assert_ptr_equal(again0, s0);
    assert_ptr_equal(again1, s1);
    assert_counts(0, 0);
    stream_release(again1);
    stream_release(again0);
    stream_release(s1);
    stream_release(s0);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
}

static void test_created_stream_belongs_to_current_device_and_device_sync_waits_for_it(void **state)
{
    (void)state;
    assert_int_equal(aclrtSetDevice(3), ACL_SUCCESS);
    aclrtStream st = new_stream();
    npu_stream *s;
    assert_int_equal(stream_acquire(st, &s), ACL_SUCCESS);
    assert_int_equal(stream_device(s), 3);
    stream_release(s);
    static atomic_int flag;
    atomic_store(&flag, 0);
    assert_int_equal(npualloc_sleep_async(st, 0.05), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_set_flag, &flag, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_SUCCESS);
    assert_int_equal(atomic_load(&flag), 1);
    /* The stream keeps its device when another one becomes current. */
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

/* ---- lifetimes ---- */

static void test_destroy_stream_waits_for_queued_work(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    static atomic_int flag;
    atomic_store(&flag, 0);
    assert_int_equal(npualloc_sleep_async(st, 0.05), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_set_flag, &flag, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_counts(1, 0);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
    assert_int_equal(atomic_load(&flag), 1);
    assert_counts(0, 0);
    assert_int_equal(aclrtDestroyStream(st), ACL_ERROR_INVALID_PARAM);
}

static void test_event_stays_valid_after_its_stream_is_destroyed(void **state)
{
    (void)state;
    aclrtStream st = new_stream(), other = new_stream();
    aclrtEvent e = new_event();
    assert_int_equal(npualloc_sleep_async(st, 0.05), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, st), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
    assert_int_equal(query(e), ACL_EVENT_STATUS_COMPLETE);
    assert_int_equal(query_recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE);
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    float ms = -1;
    assert_int_equal(aclrtEventElapsedTime(&ms, e, e), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(other, e), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(other), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, other), ACL_SUCCESS); /* moving it off the dead stream */
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(other), ACL_SUCCESS);
}

static void test_waiting_stream_survives_destroy_of_the_stream_it_waits_for(void **state)
{
    (void)state;
    aclrtStream a = new_stream(), b = new_stream();
    aclrtEvent e = new_event();
    static int a_val = 1, b_val = 2;
    assert_int_equal(npualloc_sleep_async(a, 0.05), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_append, &a_val, ACL_CALLBACK_BLOCK, a), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, a), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(b, e), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_append, &b_val, ACL_CALLBACK_BLOCK, b), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS); /* the wait holds the position, not the event */
    assert_int_equal(aclrtDestroyStream(a), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(b), ACL_SUCCESS);
    assert_int_equal(log_count, 2);
    assert_int_equal(log_values[0], 1);
    assert_int_equal(log_values[1], 2);
    assert_int_equal(aclrtDestroyStream(b), ACL_SUCCESS);
}

static void test_destroy_event_with_queued_record_is_safe(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    aclrtEvent e = new_event(), f = new_event();
    assert_int_equal(npualloc_sleep_async(st, 0.05), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, st), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(f, st), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(f, st), ACL_SUCCESS); /* two queued records of one event */
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(f), ACL_SUCCESS);
    aclrtEventStatus es;
    assert_int_equal(aclrtQueryEvent(e, &es), ACL_ERROR_INVALID_PARAM);
    assert_counts(1, 0);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS); /* the records run on freed-by-user events */
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

/* ---- concurrency ---- */

#define STRESS_THREADS 8
#define STRESS_ROUNDS 60

typedef struct stress_ctx {
    aclrtStream shared;
    aclrtEvent shared_event;
    atomic_int callbacks;
    atomic_int failures;
} stress_ctx;

static void expect_ok(stress_ctx *c, aclError rc)
{
    if (rc != ACL_SUCCESS)
        atomic_fetch_add(&c->failures, 1);
}

static void *stress_thread(void *arg)
{
    stress_ctx *c = arg;
    static _Atomic int next_id;
    int id = atomic_fetch_add(&next_id, 1);
    expect_ok(c, aclrtSetDevice(id % 2));
    for (int i = 0; i < STRESS_ROUNDS; i++) {
        aclrtStream st = NULL;
        aclrtEvent ev = NULL;
        expect_ok(c, aclrtCreateStream(&st));
        expect_ok(c, aclrtCreateEvent(&ev));
        expect_ok(c, aclrtLaunchCallback(cb_count, &c->callbacks, ACL_CALLBACK_BLOCK, st));
        expect_ok(c, aclrtRecordEvent(ev, st));
        aclrtEventStatus es;
        expect_ok(c, aclrtQueryEvent(ev, &es));
        expect_ok(c, aclrtStreamWaitEvent(st, c->shared_event)); /* whatever its current record is */
        expect_ok(c, aclrtRecordEvent(c->shared_event, st));    /* re-recorded by every thread */
        expect_ok(c, aclrtStreamWaitEvent(c->shared, ev));
        expect_ok(c, aclrtLaunchCallback(cb_count, &c->callbacks, ACL_CALLBACK_NO_BLOCK, c->shared));
        if (i % 3 == 0)
            expect_ok(c, aclrtSynchronizeEvent(ev));
        if (i % 4 == 0)
            expect_ok(c, aclrtSynchronizeDevice());
        expect_ok(c, aclrtDestroyEvent(ev)); /* possibly before its record ran */
        if (i % 2 == 0)
            expect_ok(c, aclrtSynchronizeStream(st));
        expect_ok(c, aclrtDestroyStream(st)); /* possibly with shared_event still pointing at it */
        if (aclrtDestroyStream(st) != ACL_ERROR_INVALID_PARAM)
            atomic_fetch_add(&c->failures, 1);
    }
    return NULL;
}

static void test_eight_threads_create_record_query_destroy_concurrently(void **state)
{
    (void)state;
    stress_ctx c = {.shared = new_stream(), .shared_event = new_event()};
    atomic_init(&c.callbacks, 0);
    atomic_init(&c.failures, 0);
    pthread_t t[STRESS_THREADS];
    for (int i = 0; i < STRESS_THREADS; i++)
        assert_int_equal(pthread_create(&t[i], NULL, stress_thread, &c), 0);
    for (int i = 0; i < STRESS_THREADS; i++)
        assert_int_equal(pthread_join(t[i], NULL), 0);
    assert_int_equal(aclrtSynchronizeStream(c.shared), ACL_SUCCESS);
    assert_int_equal(atomic_load(&c.failures), 0);
    assert_int_equal(atomic_load(&c.callbacks), STRESS_THREADS * STRESS_ROUNDS * 2);
    assert_counts(1, 1);
    assert_int_equal(aclrtSynchronizeEvent(c.shared_event), ACL_SUCCESS);
    assert_int_equal(query(c.shared_event), ACL_EVENT_STATUS_COMPLETE);
    assert_int_equal(aclrtDestroyEvent(c.shared_event), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(c.shared), ACL_SUCCESS);
    assert_counts(0, 0);
}

/* ---- a task calling back into its own stream ---- */

typedef struct self_results {
    aclrtStream self;
    aclrtStream other;
    aclError sync_self, sync_device, destroy_self, sync_other, sync_event;
    aclrtEvent event_on_self;
} self_results;

static void cb_self_calls(void *user_data)
{
    self_results *r = user_data;
    r->sync_self = aclrtSynchronizeStream(r->self);
    r->destroy_self = aclrtDestroyStream(r->self);
    r->sync_other = aclrtSynchronizeStream(r->other);
    r->sync_event = aclrtSynchronizeEvent(r->event_on_self);
    /* No cmocka assertion here: it would longjmp across threads.  The worker has no current
     * device of its own, so give it the stream's. */
    r->sync_device = aclrtSetDevice(0);
    if (r->sync_device == ACL_SUCCESS)
        r->sync_device = aclrtSynchronizeDevice();
}

static void test_task_cannot_wait_for_its_own_stream(void **state)
{
    (void)state;
    self_results r = {.self = new_stream(), .other = new_stream(), .event_on_self = new_event()};
    assert_int_equal(aclrtLaunchCallback(cb_self_calls, &r, ACL_CALLBACK_BLOCK, r.self), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(r.event_on_self, r.self), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(r.self), ACL_SUCCESS);
    assert_int_equal(r.sync_self, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.destroy_self, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.sync_device, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.sync_event, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.sync_other, ACL_SUCCESS);
    assert_counts(2, 1);
    aclrtDestroyEvent(r.event_on_self);
    assert_int_equal(aclrtDestroyStream(r.self), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(r.other), ACL_SUCCESS);
}

/* ---- shutdown and fork ---- */

static void test_shutdown_runs_queued_work_frees_everything_and_restarts(void **state)
{
    (void)state;
    static atomic_int flags[3];
    aclrtStream st[3];
    aclrtEvent ev[3];
    for (int i = 0; i < 3; i++) {
        atomic_store(&flags[i], 0);
        st[i] = new_stream();
        ev[i] = new_event();
        assert_int_equal(npualloc_sleep_async(st[i], 0.02), ACL_SUCCESS);
        assert_int_equal(aclrtLaunchCallback(cb_set_flag, &flags[i], ACL_CALLBACK_BLOCK, st[i]), ACL_SUCCESS);
        assert_int_equal(aclrtRecordEvent(ev[i], st[i]), ACL_SUCCESS);
    }
    assert_int_equal(aclrtStreamWaitEvent(st[0], ev[2]), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(ev[0], NULL), ACL_SUCCESS);
    npu_stream *pinned;
    assert_int_equal(stream_acquire(st[1], &pinned), ACL_SUCCESS);
    assert_counts(3, 3);
    stream_shutdown();
    assert_counts(0, 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(atomic_load(&flags[i]), 1);
    /* A pinned stream outlives shutdown as a finished one until released. */
    assert_true(stream_passed(pinned, stream_last_position(pinned)));
    assert_int_equal(stream_enqueue(pinned, task_append, NULL, NULL, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(stream_synchronize(pinned), ACL_SUCCESS);
    stream_release(pinned);
    /* Old handles are gone; new work starts cleanly. */
    assert_int_equal(aclrtDestroyEvent(ev[1]), ACL_ERROR_INVALID_PARAM);
    aclrtStream again = new_stream();
    static int v = 9;
    assert_int_equal(aclrtLaunchCallback(cb_append, &v, ACL_CALLBACK_BLOCK, again), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(again), ACL_SUCCESS);
    assert_int_equal(log_values[0], 9);
    assert_int_equal(aclrtDestroyStream(again), ACL_SUCCESS);
    stream_shutdown();
    stream_shutdown(); /* idempotent */
    assert_counts(0, 0);
}

static atomic_int child_ran_parent_task;

static void cb_mark_parent_task(void *user_data)
{
    (void)user_data;
    atomic_store(&child_ran_parent_task, 1);
}

/* Runs in the forked child; returns the exit code (0 = every check passed). */
static int fork_child_checks(npu_stream *pinned)
{
    size_t s = 1, e = 1;
    stream_counts(&s, &e);
    if (s != 0 || e != 0)
        return 1;
    if (!stream_passed(pinned, stream_last_position(pinned)))
        return 2;
    if (stream_enqueue(pinned, task_append, NULL, NULL, NULL) != ACL_ERROR_INVALID_PARAM)
        return 3;
    stream_release(pinned);
    if (aclrtSetDevice(0) != ACL_SUCCESS)
        return 4;
    aclrtStream st = NULL;
    static atomic_int flag;
    if (aclrtCreateStream(&st) != ACL_SUCCESS ||
        aclrtLaunchCallback(cb_set_flag, &flag, ACL_CALLBACK_BLOCK, st) != ACL_SUCCESS ||
        aclrtSynchronizeStream(st) != ACL_SUCCESS || atomic_load(&flag) != 1)
        return 5;
    if (aclrtSynchronizeDevice() != ACL_SUCCESS || aclrtDestroyStream(st) != ACL_SUCCESS)
        return 6;
    if (atomic_load(&child_ran_parent_task))
        return 7; /* a task queued in the parent must not run in the child */
    return 0;
}

static void test_fork_child_starts_without_streams_and_runs_no_parent_task(void **state)
{
    (void)state;
    atomic_store(&child_ran_parent_task, 0);
    aclrtStream st = new_stream();
    aclrtEvent e = new_event();
    assert_int_equal(npualloc_sleep_async(st, 0.1), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_mark_parent_task, NULL, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, st), ACL_SUCCESS);
    npu_stream *pinned;
    assert_int_equal(stream_acquire(st, &pinned), ACL_SUCCESS);
    /* runtime.c registers the handlers when it is linked in; otherwise call them here. */
    bool handlers_registered = npualloc_shutdown != NULL;
    if (!handlers_registered)
        stream_atfork_prepare();
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (!handlers_registered)
            stream_atfork_child();
        _exit(fork_child_checks(pinned));
    }
    if (!handlers_registered)
        stream_atfork_parent();
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* The parent's work goes on. */
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    assert_int_equal(atomic_load(&child_ran_parent_task), 1);
    stream_release(pinned);
    aclrtDestroyEvent(e);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

int main(void)
{
    /* The tests assume the default configuration (8 devices). */
    unsetenv("NPUALLOC_DEVICE_COUNT");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_tasks_run_in_fifo_order_with_increasing_positions, setup, teardown),
        cmocka_unit_test_setup_teardown(test_created_stream_id_is_its_handle, setup, teardown),
        cmocka_unit_test_setup_teardown(test_event_behind_sleep_is_not_ready_until_synchronized, setup, teardown),
        cmocka_unit_test_setup_teardown(test_never_recorded_event_is_complete_but_not_recorded, setup, teardown),
        cmocka_unit_test_setup_teardown(test_elapsed_time_spans_sleep_and_may_be_negative, setup, teardown),
        cmocka_unit_test_setup_teardown(test_elapsed_time_rejects_unrecorded_and_incomplete_events, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_wait_event_makes_b_wait_for_sleep_on_a, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_wait_uses_position_captured_at_call, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_wait_on_unrecorded_event_does_not_block, setup, teardown),
        cmocka_unit_test_setup_teardown(test_re_record_moves_event_and_old_record_does_not_restamp, setup, teardown),
        cmocka_unit_test_setup_teardown(test_callbacks_run_in_order_with_their_user_data, setup, teardown),
        cmocka_unit_test_setup_teardown(test_launch_callback_rejects_null_fn_and_bad_block_type, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sticky_error_is_returned_once_by_next_synchronize, setup, teardown),
        cmocka_unit_test_setup_teardown(test_synchronize_device_returns_sticky_errors_of_all_its_streams_once, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_bad_stream_arguments_and_handles_are_rejected, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_event_arguments_and_handles_are_rejected, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sleep_async_rejects_negative_nan_and_infinite, setup, teardown),
        cmocka_unit_test_setup_teardown(test_without_current_device_context_calls_fail_with_107002, setup, teardown),
        cmocka_unit_test_setup_teardown(test_default_streams_are_per_device_and_not_counted, setup, teardown),
        cmocka_unit_test_setup_teardown(test_created_stream_belongs_to_current_device_and_device_sync_waits_for_it,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_destroy_stream_waits_for_queued_work, setup, teardown),
        cmocka_unit_test_setup_teardown(test_event_stays_valid_after_its_stream_is_destroyed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_waiting_stream_survives_destroy_of_the_stream_it_waits_for, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_destroy_event_with_queued_record_is_safe, setup, teardown),
        cmocka_unit_test_setup_teardown(test_eight_threads_create_record_query_destroy_concurrently, setup, teardown),
        cmocka_unit_test_setup_teardown(test_task_cannot_wait_for_its_own_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shutdown_runs_queued_work_frees_everything_and_restarts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fork_child_starts_without_streams_and_runs_no_parent_task, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
