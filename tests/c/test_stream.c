/* test_stream.c - streams, events, callbacks, sticky errors, fork and shutdown. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "device.h"
#include "host.h"
#include "stream.h"
#include "testutil.h"

#define MS (1000000ull) /* nanoseconds */

/* Defined only when runtime.c is linked in: then its pthread_atfork handlers are registered. */
extern aclError npualloc_shutdown(void) __attribute__((weak));

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

typedef struct entry_gate {
    atomic_int entered, open;
} entry_gate;

/* Like cb_wait_gate, and tells when its worker reached it. */
static void cb_enter_gate(void *user_data)
{
    entry_gate *g = user_data;
    atomic_store(&g->entered, 1);
    cb_wait_gate(&g->open);
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
    size_t s = 1, e = 1, rt = 1, rs = 1;
    stream_counts(&s, &e);
    stream_report_counts(&rt, &rs);
    device_shutdown();
    return (s == 0 && e == 0 && rt == 0 && rs == 0) ? 0 : -1;
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
    static atomic_int gate; /* holds the stream while the event is checked, however slow this thread is */
    uint64_t t0 = host_now_ns();
    hold_stream(st, &gate);
    assert_int_equal(npualloc_sleep_async(st, 0.1), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, st), ACL_SUCCESS);
    assert_int_equal(query(e), ACL_EVENT_STATUS_NOT_READY);
    assert_int_equal(query_recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    assert_true(host_now_ns() - t0 >= 95 * MS);
    assert_int_equal(query(e), ACL_EVENT_STATUS_COMPLETE);
    assert_int_equal(query_recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

/* aclrtMemsetAsync / aclrtMemcpyAsync of pinned (aclrtMallocHost) memory run in stream order behind
 * queued work: nothing lands while a gate holds the queue, and each copy sees the memset queued before
 * it, not the one after. */
static void test_memset_and_memcpy_async_run_in_order_behind_queued_work(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    aclrtEvent e = new_event();
    void *d;
    unsigned char *first, *second, *src;
    assert_int_equal(aclrtMallocHost((void **)&first, 4096), ACL_SUCCESS);
    assert_int_equal(aclrtMallocHost((void **)&second, 4096), ACL_SUCCESS);
    assert_int_equal(aclrtMallocHost((void **)&src, 4096), ACL_SUCCESS);
    memset(first, 0, 4096);
    memset(second, 0, 4096);
    memset(src, 0x33, 4096);
    assert_int_equal(aclrtMalloc(&d, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtMemset(d, 4096, 0, 4096), ACL_SUCCESS);
    static atomic_int gate;
    hold_stream(st, &gate);
    assert_int_equal(aclrtMemsetAsync(d, 4096, 0x11, 4096, st), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(first, 4096, d, 4096, ACL_MEMCPY_DEVICE_TO_HOST, st), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(d, 4096, src, 2048, ACL_MEMCPY_HOST_TO_DEVICE, st), ACL_SUCCESS);
    assert_int_equal(aclrtMemcpyAsync(second, 4096, d, 4096, ACL_MEMCPY_DEVICE_TO_HOST, st), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, st), ACL_SUCCESS);
    /* behind the gate: nothing ran yet */
    unsigned char now[4096];
    assert_int_equal(aclrtMemcpy(now, sizeof now, d, 4096, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(now[0], 0);
    assert_int_equal(first[0], 0);
    assert_int_equal(query(e), ACL_EVENT_STATUS_NOT_READY);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    for (size_t i = 0; i < 4096; i++) {
        assert_int_equal(first[i], 0x11);
        assert_int_equal(second[i], i < 2048 ? 0x33 : 0x11);
    }
    assert_int_equal(query(e), ACL_EVENT_STATUS_COMPLETE);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(first), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(second), ACL_SUCCESS);
    assert_int_equal(aclrtFreeHost(src), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

/* An asynchronous copy between device memory and pageable host memory (not aclrtMallocHost's) returns
 * with the copy done, as CANN documents: it waits for the work queued before it, then copies.  Pinned
 * memory in the same call shape is queued. */
typedef struct gate_opener {
    atomic_int *gate;
    atomic_int opened;
} gate_opener;

static void *open_gate_later(void *arg)
{
    gate_opener *g = arg;
    host_sleep_ns(50 * MS);
    atomic_store(&g->opened, 1);
    atomic_store(g->gate, 1);
    return NULL;
}

static void test_async_copy_of_pageable_memory_is_done_on_return(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    void *d;
    assert_int_equal(aclrtMalloc(&d, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    assert_int_equal(aclrtMemset(d, 4096, 0, 4096), ACL_SUCCESS);
    static atomic_int gate;
    hold_stream(st, &gate);
    assert_int_equal(aclrtMemsetAsync(d, 4096, 0x11, 4096, st), ACL_SUCCESS);
    gate_opener g = {.gate = &gate};
    atomic_init(&g.opened, 0);
    pthread_t opener;
    assert_int_equal(pthread_create(&opener, NULL, open_gate_later, &g), 0);
    /* device to pageable host: waits for the gate and the memset queued before it */
    unsigned char page[4096] = {0};
    assert_int_equal(aclrtMemcpyAsync(page, sizeof page, d, 4096, ACL_MEMCPY_DEVICE_TO_HOST, st), ACL_SUCCESS);
    assert_true(atomic_load(&g.opened));
    assert_int_equal(page[0], 0x11);
    assert_int_equal(page[4095], 0x11);
    pthread_join(opener, NULL);
    /* pageable host to device: the source may change as soon as the call returns */
    memset(page, 0x22, 2048);
    assert_int_equal(aclrtMemcpyAsync(d, 4096, page, 2048, ACL_MEMCPY_HOST_TO_DEVICE, st), ACL_SUCCESS);
    memset(page, 0x99, sizeof page);
    unsigned char now[4096];
    assert_int_equal(aclrtMemcpy(now, sizeof now, d, 4096, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(now[0], 0x22);
    assert_int_equal(now[2047], 0x22);
    assert_int_equal(now[2048], 0x11);
    /* a 2-D copy of pageable rows too */
    unsigned char rows[3][8];
    memset(rows, 0x44, sizeof rows);
    hold_stream(st, &gate);
    atomic_store(&g.opened, 0);
    assert_int_equal(pthread_create(&opener, NULL, open_gate_later, &g), 0);
    assert_int_equal(aclrtMemcpy2dAsync(d, 64, rows, 8, 8, 3, ACL_MEMCPY_HOST_TO_DEVICE, st), ACL_SUCCESS);
    assert_true(atomic_load(&g.opened));
    pthread_join(opener, NULL);
    memset(rows, 0, sizeof rows);
    assert_int_equal(aclrtMemcpy(now, sizeof now, d, 4096, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    assert_int_equal(now[0], 0x44);
    assert_int_equal(now[64 + 7], 0x44);
    assert_int_equal(now[128], 0x44);
    assert_int_equal(now[8], 0x22); /* between the rows: untouched */
    /* the same copy of pinned memory is queued behind the gate */
    unsigned char *pinned;
    assert_int_equal(aclrtMallocHost((void **)&pinned, 4096), ACL_SUCCESS);
    memset(pinned, 0, 4096);
    hold_stream(st, &gate);
    assert_int_equal(aclrtMemcpyAsync(pinned, 4096, d, 4096, ACL_MEMCPY_DEVICE_TO_HOST, st), ACL_SUCCESS);
    assert_int_equal(pinned[0], 0);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(pinned[0], 0x44);
    /* the wait reports the stream's failed work, as aclrtSynchronizeStream does, and copies nothing */
    npu_stream *s;
    assert_int_equal(stream_acquire(st, &s), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, task_fail, (void *)(intptr_t)ACL_ERROR_RT_DEVICE_MEM_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    stream_release(s);
    memset(page, 0x55, sizeof page);
    assert_int_equal(aclrtMemcpyAsync(page, sizeof page, d, 4096, ACL_MEMCPY_DEVICE_TO_HOST, st),
                     ACL_ERROR_RT_DEVICE_MEM_ERROR);
    assert_int_equal(page[0], 0x55);
    assert_int_equal(aclrtFreeHost(pinned), ACL_SUCCESS);
    assert_int_equal(aclrtFree(d), ACL_SUCCESS);
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
    /* An event never recorded: CANN's "event recorder null", which ACL reports as 507000. */
    assert_int_equal(aclrtEventElapsedTime(&ms, never, done), ACL_ERROR_RT_INTERNAL_ERROR);
    assert_int_equal(aclrtEventElapsedTime(&ms, done, never), ACL_ERROR_RT_INTERNAL_ERROR);
    assert_int_equal(ACL_ERROR_RT_INTERNAL_ERROR, 507000);
    assert_int_equal(aclrtEventElapsedTime(NULL, done, done), ACL_ERROR_INVALID_PARAM);
    static atomic_int gate;
    hold_stream(st, &gate);
    assert_int_equal(npualloc_sleep_async(st, 0.1), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(pending, st), ACL_SUCCESS);
    /* Both records are checked before either time: a missing one wins over one not yet reached. */
    assert_int_equal(aclrtEventElapsedTime(&ms, pending, never), ACL_ERROR_RT_INTERNAL_ERROR);
    assert_int_equal(aclrtEventElapsedTime(&ms, never, pending), ACL_ERROR_RT_INTERNAL_ERROR);
    assert_int_equal(aclrtEventElapsedTime(&ms, done, pending), ACL_ERROR_RT_STREAM_NOT_COMPLETE);
    assert_int_equal(aclrtEventElapsedTime(&ms, pending, done), ACL_ERROR_RT_STREAM_NOT_COMPLETE);
    assert_int_equal(ACL_ERROR_RT_STREAM_NOT_COMPLETE, 507004);
    atomic_store(&gate, 1);
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
    assert_int_equal(aclrtStreamWaitEvent(a, e), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(NULL, e), ACL_SUCCESS);
    /* a wait that blocked would run out (the event is never recorded) */
    assert_int_equal(aclrtSynchronizeStreamWithTimeout(a, 10000), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStreamWithTimeout(NULL, 10000), ACL_SUCCESS);
    aclrtDestroyEvent(e);
    aclrtDestroyStream(a);
}

static void test_re_record_moves_event_and_old_record_does_not_restamp(void **state)
{
    (void)state;
    aclrtStream a = new_stream(), b = new_stream();
    aclrtEvent e = new_event(), ref = new_event();
    static atomic_int gate;
    hold_stream(a, &gate);
    assert_int_equal(npualloc_sleep_async(a, 0.1), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, a), ACL_SUCCESS);
    assert_int_equal(query(e), ACL_EVENT_STATUS_NOT_READY);
    assert_int_equal(aclrtRecordEvent(e, b), ACL_SUCCESS); /* b is idle */
    /* a is held until the end: waiting for its record would run out */
    assert_int_equal(aclrtSynchronizeEventWithTimeout(e, 10000), ACL_SUCCESS);
    assert_int_equal(query(e), ACL_EVENT_STATUS_COMPLETE);
    assert_int_equal(aclrtRecordEvent(ref, b), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeEvent(ref), ACL_SUCCESS);
    float before = -1, after = -1;
    assert_int_equal(aclrtEventElapsedTime(&before, e, ref), ACL_SUCCESS);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(a), ACL_SUCCESS); /* the obsolete record passes */
    assert_int_equal(aclrtEventElapsedTime(&after, e, ref), ACL_SUCCESS);
    assert_true(before == after);
    assert_true(after >= 0.0f);
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

static void test_internal_device_wait_leaves_sticky_errors_for_synchronize(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    npu_stream *s, *d;
    assert_int_equal(stream_acquire(st, &s), ACL_SUCCESS);
    assert_int_equal(stream_acquire(NULL, &d), ACL_SUCCESS);
    static int v = 9;
    assert_int_equal(npualloc_sleep_async(st, 0.05), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, task_fail, (void *)(intptr_t)ACL_ERROR_RT_DEVICE_MEM_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, task_append, &v, NULL, NULL), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(d, task_fail, (void *)(intptr_t)ACL_ERROR_RT_INTERNAL_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    /* The caching allocator's wait: everything ran, and no error was taken. */
    assert_int_equal(stream_wait_device(0), ACL_SUCCESS);
    assert_int_equal(log_count, 1);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_ERROR_RT_DEVICE_MEM_ERROR);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_ERROR_RT_INTERNAL_ERROR);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_SUCCESS);
    assert_int_equal(stream_wait_device(99), ACL_ERROR_RT_INVALID_DEVICEID);
    stream_release(d);
    stream_release(s);
    aclrtDestroyStream(st);
}

static void test_synchronize_with_timeout_stream_and_event(void **state)
{
    (void)state;
    assert_int_equal(ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, 507046);
    assert_int_equal(ACL_ERROR_RT_EVENT_SYNC_TIMEOUT, 507047);
    aclrtStream st = new_stream();
    aclrtEvent e = new_event();
    npu_stream *s;
    assert_int_equal(stream_acquire(st, &s), ACL_SUCCESS);
    static atomic_int gate;
    hold_stream(st, &gate);
    assert_int_equal(stream_enqueue(s, task_fail, (void *)(intptr_t)ACL_ERROR_RT_DEVICE_MEM_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, st), ACL_SUCCESS);
    /* CANN accepts [-1, INT_MAX]. */
    assert_int_equal(aclrtSynchronizeStreamWithTimeout(st, -2), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtSynchronizeEventWithTimeout(e, INT32_MIN), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtSynchronizeStreamWithTimeout((aclrtStream)(uintptr_t)0x1234, 10), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtSynchronizeEventWithTimeout((aclrtEvent)(uintptr_t)0x1234, 10), ACL_ERROR_INVALID_PARAM);
    /* The work is held back: the waits run out, and the failed task's error is not taken. */
    assert_int_equal(aclrtSynchronizeStreamWithTimeout(st, 20), ACL_ERROR_RT_STREAM_SYNC_TIMEOUT);
    assert_int_equal(aclrtSynchronizeEventWithTimeout(e, 20), ACL_ERROR_RT_EVENT_SYNC_TIMEOUT);
    assert_int_equal(query(e), ACL_EVENT_STATUS_NOT_READY);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeEventWithTimeout(e, -1), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStreamWithTimeout(st, 60000), ACL_ERROR_RT_DEVICE_MEM_ERROR);
    assert_int_equal(aclrtSynchronizeStreamWithTimeout(st, 0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeEventWithTimeout(e, 1), ACL_SUCCESS); /* already passed */
    /* A never-recorded event has nothing to wait for; the default stream is NULL. */
    aclrtEvent fresh = new_event();
    assert_int_equal(aclrtSynchronizeEventWithTimeout(fresh, 1), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStreamWithTimeout(NULL, 1), ACL_SUCCESS);
    stream_release(s);
    assert_int_equal(aclrtDestroyEvent(fresh), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static void test_stream_query_reports_queued_work(void **state)
{
    (void)state;
    assert_int_equal(ACL_STREAM_STATUS_COMPLETE, 0);
    assert_int_equal(ACL_STREAM_STATUS_NOT_READY, 1);
    assert_int_equal(ACL_STREAM_STATUS_RESERVED, 0xFFFF);
    aclrtStream st = new_stream();
    aclrtStreamStatus status = ACL_STREAM_STATUS_RESERVED;
    assert_int_equal(aclrtStreamQuery(st, &status), ACL_SUCCESS);
    assert_int_equal(status, ACL_STREAM_STATUS_COMPLETE); /* nothing queued */
    static atomic_int gate;
    hold_stream(st, &gate);
    assert_int_equal(aclrtStreamQuery(st, &status), ACL_SUCCESS);
    assert_int_equal(status, ACL_STREAM_STATUS_NOT_READY);
    assert_int_equal(aclrtStreamQuery(NULL, &status), ACL_SUCCESS); /* the default stream is idle */
    assert_int_equal(status, ACL_STREAM_STATUS_COMPLETE);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(aclrtStreamQuery(st, &status), ACL_SUCCESS);
    assert_int_equal(status, ACL_STREAM_STATUS_COMPLETE);
    assert_int_equal(aclrtStreamQuery(st, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
    assert_int_equal(aclrtStreamQuery(st, &status), ACL_ERROR_INVALID_PARAM);
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
    assert_int_equal(aclrtSubscribeReport(1, bad), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtUnSubscribeReport(1, bad), ACL_ERROR_INVALID_PARAM);
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

static void *destroy_stream_thread(void *arg)
{
    return (void *)(intptr_t)aclrtDestroyStream((aclrtStream)arg);
}

static void test_device_sync_waits_for_a_stream_being_destroyed(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    npu_stream *s;
    assert_int_equal(stream_acquire(st, &s), ACL_SUCCESS);
    static atomic_int flag;
    atomic_store(&flag, 0);
    assert_int_equal(npualloc_sleep_async(st, 0.2), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, task_fail, (void *)(intptr_t)ACL_ERROR_RT_DEVICE_MEM_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_set_flag, &flag, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    stream_release(s);
    /* Another thread destroys it: its handle goes at once, its queued work still runs. */
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, destroy_stream_thread, st), 0);
    size_t live = 1;
    while (live != 0) {
        stream_counts(&live, NULL);
        host_sleep_ns(MS);
    }
    /* That work is still the device's: the device sync waits for it (and, the handle being gone,
     * does not report its error). */
    assert_int_equal(aclrtSynchronizeDevice(), ACL_SUCCESS);
    assert_int_equal(atomic_load(&flag), 1);
    void *rc;
    assert_int_equal(pthread_join(t, &rc), 0);
    assert_int_equal((aclError)(intptr_t)rc, ACL_SUCCESS);
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
    /* Hold the worker so the event is recorded (behind the callback) before the callback runs. */
    static atomic_int gate;
    hold_stream(r.self, &gate);
    assert_int_equal(aclrtLaunchCallback(cb_self_calls, &r, ACL_CALLBACK_BLOCK, r.self), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(r.event_on_self, r.self), ACL_SUCCESS);
    atomic_store(&gate, 1);
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

/* ---- callback subscriptions (aclrtSubscribeReport / aclrtProcessReport) ---- */

static uint64_t self_id(void) { return (uint64_t)(uintptr_t)pthread_self(); }

/* A thread id no thread has: a subscriber that never calls aclrtProcessReport. */
#define ABSENT_TID ((uint64_t)0x5eed5eedull)

static void assert_report_counts(size_t threads, size_t streams)
{
    size_t t = 99, s = 99;
    stream_report_counts(&t, &s);
    assert_int_equal(t, threads);
    assert_int_equal(s, streams);
}

/* A callback that logs a value and the thread it ran on. */
typedef struct cb_rec {
    int value;
    _Atomic uint64_t thread; /* 0 until it ran */
    atomic_int runs;
} cb_rec;

static void cb_record(void *user_data)
{
    cb_rec *r = user_data;
    log_append(r->value); /* before `runs`: a test that saw runs change may read the log */
    atomic_store(&r->thread, self_id());
    atomic_fetch_add(&r->runs, 1);
}

static void rec_init(cb_rec *r, int value)
{
    r->value = value;
    atomic_init(&r->thread, 0);
    atomic_init(&r->runs, 0);
}

/* Queues a plain task (not a callback) that logs v: "a later task" of the stream. */
static void enqueue_append(aclrtStream st, const int *v)
{
    npu_stream *s;
    assert_int_equal(stream_acquire(st, &s), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, task_append, (void *)v, NULL, NULL), ACL_SUCCESS);
    stream_release(s);
}

/* A thread looping on aclrtProcessReport until told to stop. */
typedef struct reporter {
    pthread_t thread;
    int32_t timeout;
    atomic_int stop;
    atomic_int unexpected; /* return codes other than success, timeout, not subscribed */
    atomic_int not_subscribed;
    atomic_int timeouts;
    atomic_int calls;
} reporter;

static void *reporter_main(void *arg)
{
    reporter *r = arg;
    while (!atomic_load(&r->stop)) {
        aclError rc = aclrtProcessReport(r->timeout);
        atomic_fetch_add(&r->calls, 1);
        if (rc == ACL_ERROR_RT_REPORT_TIMEOUT)
            atomic_fetch_add(&r->timeouts, 1);
        else if (rc == ACL_ERROR_RT_THREAD_SUBSCRIBE) {
            atomic_fetch_add(&r->not_subscribed, 1);
            host_sleep_ns(MS); /* not (or no longer) subscribed: do not spin */
        } else if (rc != ACL_SUCCESS)
            atomic_fetch_add(&r->unexpected, 1);
    }
    return NULL;
}

static void reporter_start(reporter *r, int32_t timeout)
{
    memset(r, 0, sizeof *r);
    r->timeout = timeout;
    assert_int_equal(pthread_create(&r->thread, NULL, reporter_main, r), 0);
}

static uint64_t reporter_tid(const reporter *r) { return (uint64_t)(uintptr_t)r->thread; }

/* Stops a reporter whose subscriptions have all ended (so a -1 wait returns). */
static void reporter_stop(reporter *r)
{
    atomic_store(&r->stop, 1);
    assert_int_equal(pthread_join(r->thread, NULL), 0);
    assert_int_equal(atomic_load(&r->unexpected), 0);
}

static void test_subscription_error_codes_follow_cann_runtime(void **state)
{
    (void)state;
    /* The values of CANN's headers (rt_error_codes.h: a report timeout is 507012; 107013 is
     * ACL_ERROR_RT_GROUP_NOT_SET). */
    assert_int_equal(ACL_ERROR_RT_STREAM_SUBSCRIBE, 107011);
    assert_int_equal(ACL_ERROR_RT_THREAD_SUBSCRIBE, 107012);
    assert_int_equal(ACL_ERROR_RT_REPORT_TIMEOUT, 507012);
    assert_int_equal(ACL_ERROR_RT_STREAM_NO_CB_REG, 107015);
    assert_int_equal(ACL_ERROR_REPEAT_SUBSCRIBE, 100033);
    assert_int_equal(ACL_ERROR_STREAM_NOT_SUBSCRIBE, 100034);
    assert_int_equal(ACL_ERROR_THREAD_NOT_SUBSCRIBE, 100035);
    assert_int_equal(ACL_ERROR_WAIT_CALLBACK_TIMEOUT, 100036);

    aclrtStream a = new_stream(), b = new_stream();
    uint64_t me = self_id();
    assert_report_counts(0, 0);
    assert_int_equal(aclrtSubscribeReport(me, a), ACL_SUCCESS);
    assert_report_counts(1, 1);
    /* A stream has one thread: again by the same thread or by another one. */
    assert_int_equal(aclrtSubscribeReport(me, a), ACL_ERROR_RT_STREAM_SUBSCRIBE);
    assert_int_equal(aclrtSubscribeReport(ABSENT_TID, a), ACL_ERROR_RT_STREAM_SUBSCRIBE);
    /* A thread serves several streams, the default one (NULL) included. */
    assert_int_equal(aclrtSubscribeReport(me, b), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(me, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(me, NULL), ACL_ERROR_RT_STREAM_SUBSCRIBE);
    assert_report_counts(1, 3);
    /* ... but only streams of one device. */
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    aclrtStream on1 = new_stream();
    assert_int_equal(aclrtSubscribeReport(me, on1), ACL_ERROR_RT_THREAD_SUBSCRIBE);
    assert_int_equal(aclrtSubscribeReport(ABSENT_TID, on1), ACL_SUCCESS); /* another thread may */
    assert_int_equal(aclrtUnSubscribeReport(ABSENT_TID, on1), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(on1), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    /* Unsubscribing: by the wrong thread, twice, a stream nobody subscribed, a bad handle. */
    assert_int_equal(aclrtUnSubscribeReport(ABSENT_TID, a), ACL_ERROR_RT_THREAD_SUBSCRIBE);
    assert_int_equal(aclrtUnSubscribeReport(me, a), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(me, a), ACL_ERROR_RT_STREAM_SUBSCRIBE);
    assert_int_equal(aclrtUnSubscribeReport(ABSENT_TID, a), ACL_ERROR_RT_STREAM_SUBSCRIBE);
    aclrtStream bad = (aclrtStream)(uintptr_t)0x1234;
    assert_int_equal(aclrtSubscribeReport(me, bad), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtUnSubscribeReport(me, bad), ACL_ERROR_INVALID_PARAM);
    /* Resubscribing after an unsubscribe works. */
    assert_int_equal(aclrtSubscribeReport(me, a), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(me, a), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(me, b), ACL_SUCCESS);
    assert_report_counts(1, 1);
    assert_int_equal(aclrtUnSubscribeReport(me, NULL), ACL_SUCCESS);
    assert_report_counts(0, 0);
    /* A destroyed stream's handle is stale. */
    assert_int_equal(aclrtDestroyStream(a), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(me, a), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtUnSubscribeReport(me, a), ACL_ERROR_INVALID_PARAM);
    /* The thread-device rule holds for live subscriptions only. */
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(me, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(me, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(b), ACL_SUCCESS);
    assert_report_counts(0, 0);
}

static void test_process_report_argument_subscription_and_timeout_codes(void **state)
{
    (void)state;
    /* CANN: -1 waits forever, otherwise the timeout must be > 0 ms. */
    assert_int_equal(aclrtProcessReport(0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtProcessReport(-2), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtProcessReport(INT32_MIN), ACL_ERROR_INVALID_PARAM);
    /* A thread that subscribes nothing, even with -1: at once. */
    assert_int_equal(aclrtProcessReport(-1), ACL_ERROR_RT_THREAD_SUBSCRIBE);
    assert_int_equal(aclrtProcessReport(10), ACL_ERROR_RT_THREAD_SUBSCRIBE);
    aclrtStream st = new_stream();
    assert_int_equal(aclrtSubscribeReport(ABSENT_TID, st), ACL_SUCCESS);
    assert_int_equal(aclrtProcessReport(10), ACL_ERROR_RT_THREAD_SUBSCRIBE); /* another thread is */
    assert_int_equal(aclrtUnSubscribeReport(ABSENT_TID, st), ACL_SUCCESS);
    /* Subscribed, nothing arrives: the timeout code after about the timeout. */
    assert_int_equal(aclrtSubscribeReport(self_id(), st), ACL_SUCCESS);
    uint64_t t0 = host_now_ns();
    assert_int_equal(aclrtProcessReport(40), ACL_ERROR_RT_REPORT_TIMEOUT);
    uint64_t waited = host_now_ns() - t0;
    assert_true(waited >= 39 * MS && waited < 2000 * MS);
    /* A callback arriving during the wait ends it early. */
    static cb_rec r;
    rec_init(&r, 1);
    t0 = host_now_ns();
    assert_int_equal(npualloc_sleep_async(st, 0.03), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &r, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtProcessReport(5000), ACL_SUCCESS);
    waited = host_now_ns() - t0;
    assert_true(waited >= 20 * MS && waited < 2000 * MS);
    assert_int_equal(atomic_load(&r.runs), 1);
    assert_int_equal(atomic_load(&r.thread), self_id());
    assert_int_equal(aclrtUnSubscribeReport(self_id(), st), ACL_SUCCESS);
    assert_int_equal(aclrtProcessReport(10), ACL_ERROR_RT_THREAD_SUBSCRIBE);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static void test_block_callback_holds_later_tasks_until_process_report_runs_it(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    aclrtEvent after = new_event();
    static cb_rec cb;
    static const int later = 2;
    rec_init(&cb, 1);
    assert_int_equal(aclrtSubscribeReport(self_id(), st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    enqueue_append(st, &later);
    assert_int_equal(aclrtRecordEvent(after, st), ACL_SUCCESS);
    host_sleep_ns(50 * MS);
    /* The worker waits for the subscribed thread: nothing after the callback ran. */
    assert_int_equal(log_count, 0);
    assert_int_equal(query(after), ACL_EVENT_STATUS_NOT_READY);
    assert_int_equal(atomic_load(&cb.runs), 0);
    assert_int_equal(aclrtProcessReport(1000), ACL_SUCCESS);
    assert_int_equal(atomic_load(&cb.runs), 1);
    assert_int_equal(atomic_load(&cb.thread), self_id()); /* inside ProcessReport */
    assert_int_equal(aclrtSynchronizeEvent(after), ACL_SUCCESS);
    assert_int_equal(log_count, 2);
    assert_int_equal(log_values[0], 1);
    assert_int_equal(log_values[1], 2);
    assert_int_equal(aclrtUnSubscribeReport(self_id(), st), ACL_SUCCESS);
    aclrtDestroyEvent(after);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static void test_no_block_callback_lets_later_tasks_and_synchronize_go_on(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    aclrtEvent after = new_event();
    static cb_rec cb;
    static const int later = 2;
    rec_init(&cb, 1);
    assert_int_equal(aclrtSubscribeReport(self_id(), st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    enqueue_append(st, &later);
    assert_int_equal(aclrtRecordEvent(after, st), ACL_SUCCESS);
    /* The later task and the event pass; synchronize does not wait for the callback, and the
     * subscribed caller's NO_BLOCK callback stays queued for it while it waits. */
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(query(after), ACL_EVENT_STATUS_COMPLETE);
    assert_int_equal(log_count, 1);
    assert_int_equal(log_values[0], 2);
    assert_int_equal(atomic_load(&cb.runs), 0);
    assert_int_equal(aclrtProcessReport(1000), ACL_SUCCESS);
    assert_int_equal(atomic_load(&cb.thread), self_id());
    assert_int_equal(log_count, 2);
    assert_int_equal(log_values[1], 1);
    assert_int_equal(aclrtProcessReport(10), ACL_ERROR_RT_REPORT_TIMEOUT); /* it ran once */
    assert_int_equal(aclrtUnSubscribeReport(self_id(), st), ACL_SUCCESS);
    aclrtDestroyEvent(after);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static void test_unsubscribed_stream_keeps_running_callbacks_on_its_worker(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    static cb_rec cb[2];
    rec_init(&cb[0], 1);
    rec_init(&cb[1], 2);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[0], ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[1], ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    /* npualloc's convenience: both ran, before synchronize returned, on one (worker) thread. */
    assert_int_equal(log_count, 2);
    assert_int_equal(atomic_load(&cb[0].thread), atomic_load(&cb[1].thread));
    assert_true(atomic_load(&cb[0].thread) != self_id());
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static void test_callback_goes_where_the_subscription_is_when_the_worker_reaches_it(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    static cb_rec cb;
    rec_init(&cb, 1);
    static entry_gate eg;
    atomic_store(&eg.entered, 0);
    atomic_store(&eg.open, 0);
    assert_int_equal(aclrtLaunchCallback(cb_enter_gate, &eg, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    while (!atomic_load(&eg.entered)) /* the worker holds at the gate, unsubscribed */
        host_sleep_ns(MS);
    assert_int_equal(aclrtSubscribeReport(self_id(), st), ACL_SUCCESS); /* before the gate opens */
    atomic_store(&eg.open, 1);
    assert_int_equal(aclrtProcessReport(2000), ACL_SUCCESS);
    assert_int_equal(atomic_load(&cb.thread), self_id());
    assert_int_equal(aclrtUnSubscribeReport(self_id(), st), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

#define ORDER_CALLBACKS 60

/* A callback that subscribes the thread it runs on (the stream's worker) to its stream. */
typedef struct self_subscription {
    aclrtStream stream;
    _Atomic uint64_t tid;
    atomic_int rc;
} self_subscription;

static void cb_subscribe_own_thread(void *user_data)
{
    self_subscription *sub = user_data;
    atomic_store(&sub->tid, self_id());
    atomic_store(&sub->rc, aclrtSubscribeReport(self_id(), sub->stream));
}

static void test_stream_subscribed_to_its_own_worker_runs_callbacks_there(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    static self_subscription sub;
    sub.stream = st;
    atomic_store(&sub.tid, 0);
    atomic_store(&sub.rc, -1);
    assert_int_equal(aclrtLaunchCallback(cb_subscribe_own_thread, &sub, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(atomic_load(&sub.rc), ACL_SUCCESS);
    assert_report_counts(1, 1);
    /* The worker is the subscribed thread: it runs the callbacks instead of waiting for itself. */
    static cb_rec block, noblock;
    rec_init(&block, 1);
    rec_init(&noblock, 2);
    assert_int_equal(aclrtLaunchCallback(cb_record, &block, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &noblock, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStreamWithTimeout(st, 60000), ACL_SUCCESS);
    assert_int_equal(atomic_load(&block.runs), 1);
    assert_int_equal(atomic_load(&noblock.runs), 1);
    assert_int_equal(atomic_load(&block.thread), atomic_load(&sub.tid));
    assert_int_equal(atomic_load(&noblock.thread), atomic_load(&sub.tid));
    assert_int_equal(log_count, 2);
    assert_int_equal(log_values[0], 1);
    assert_int_equal(log_values[1], 2);
    assert_int_equal(aclrtUnSubscribeReport(atomic_load(&sub.tid), st), ACL_SUCCESS);
    assert_report_counts(0, 0);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static void test_reporter_thread_runs_callbacks_of_two_streams_in_order(void **state)
{
    (void)state;
    reporter rep;
    reporter_start(&rep, 20);
    aclrtStream s[2] = {new_stream(), new_stream()};
    for (int i = 0; i < 2; i++)
        assert_int_equal(aclrtSubscribeReport(reporter_tid(&rep), s[i]), ACL_SUCCESS);
    static cb_rec cb[2][ORDER_CALLBACKS];
    for (int i = 0; i < ORDER_CALLBACKS; i++) {
        for (int k = 0; k < 2; k++) {
            rec_init(&cb[k][i], k * 1000 + i);
            aclrtCallbackBlockType bt = (i % 3 == 0) ? ACL_CALLBACK_BLOCK : ACL_CALLBACK_NO_BLOCK;
            assert_int_equal(aclrtLaunchCallback(cb_record, &cb[k][i], bt, s[k]), ACL_SUCCESS);
        }
    }
    for (int k = 0; k < 2; k++)
        assert_int_equal(aclrtSynchronizeStream(s[k]), ACL_SUCCESS);
    /* The last ones may be NO_BLOCK: wait for the thread to run them. */
    for (int spin = 0; spin < 2000 && atomic_load(&cb[1][ORDER_CALLBACKS - 1].runs) +
                                              atomic_load(&cb[0][ORDER_CALLBACKS - 1].runs) < 2; spin++)
        host_sleep_ns(MS);
    pthread_mutex_lock(&log_lock);
    assert_int_equal(log_count, 2 * ORDER_CALLBACKS);
    int next[2] = {0, 0};
    for (int i = 0; i < log_count; i++) {
        int k = log_values[i] / 1000;
        assert_int_equal(log_values[i] % 1000, next[k]++); /* each stream's in launch order */
    }
    pthread_mutex_unlock(&log_lock);
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < ORDER_CALLBACKS; i++) {
            assert_int_equal(atomic_load(&cb[k][i].runs), 1);
            assert_int_equal(atomic_load(&cb[k][i].thread), reporter_tid(&rep));
        }
    for (int i = 0; i < 2; i++)
        assert_int_equal(aclrtUnSubscribeReport(reporter_tid(&rep), s[i]), ACL_SUCCESS);
    reporter_stop(&rep);
    for (int i = 0; i < 2; i++)
        assert_int_equal(aclrtDestroyStream(s[i]), ACL_SUCCESS);
}

static void test_unsubscribe_hands_pending_callbacks_back_to_the_worker_in_order(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    aclrtEvent done = new_event();
    static cb_rec cb[3];
    static const int later = 4;
    for (int i = 0; i < 3; i++)
        rec_init(&cb[i], i + 1);
    assert_int_equal(aclrtSubscribeReport(ABSENT_TID, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[0], ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[1], ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[2], ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    enqueue_append(st, &later);
    assert_int_equal(aclrtRecordEvent(done, st), ACL_SUCCESS);
    host_sleep_ns(50 * MS);
    assert_int_equal(log_count, 0); /* queued to a thread that never processes */
    assert_int_equal(query(done), ACL_EVENT_STATUS_NOT_READY);
    assert_int_equal(aclrtUnSubscribeReport(ABSENT_TID, st), ACL_SUCCESS);
    assert_report_counts(0, 0);
    assert_int_equal(aclrtSynchronizeEvent(done), ACL_SUCCESS);
    assert_int_equal(log_count, 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(log_values[i], i + 1);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(atomic_load(&cb[i].runs), 1);
        assert_true(atomic_load(&cb[i].thread) != self_id());
    }
    aclrtDestroyEvent(done);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static void test_destroy_and_shutdown_do_not_wait_for_an_absent_subscriber(void **state)
{
    (void)state;
    static cb_rec cb[4];
    for (int i = 0; i < 4; i++)
        rec_init(&cb[i], i);
    aclrtStream st = new_stream();
    assert_int_equal(aclrtSubscribeReport(ABSENT_TID, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[0], ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[1], ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    uint64_t t0 = host_now_ns();
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
    assert_true(host_now_ns() - t0 < 2000 * MS);
    assert_int_equal(atomic_load(&cb[0].runs), 1); /* run by the worker while draining */
    assert_int_equal(atomic_load(&cb[1].runs), 1);
    assert_report_counts(0, 0);
    /* Shutdown, with the default stream and a created one subscribed by the absent thread. */
    aclrtStream st2 = new_stream();
    assert_int_equal(aclrtSubscribeReport(ABSENT_TID, st2), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(ABSENT_TID, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[2], ACL_CALLBACK_BLOCK, st2), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[3], ACL_CALLBACK_NO_BLOCK, NULL), ACL_SUCCESS);
    host_sleep_ns(20 * MS);
    assert_int_equal(atomic_load(&cb[2].runs) + atomic_load(&cb[3].runs), 0);
    stream_shutdown();
    assert_int_equal(atomic_load(&cb[2].runs), 1);
    assert_int_equal(atomic_load(&cb[3].runs), 1);
    assert_report_counts(0, 0);
    assert_counts(0, 0);
}

static void test_process_report_waiting_forever_returns_when_last_subscription_ends(void **state)
{
    (void)state;
    aclrtStream st = new_stream();
    reporter rep;
    reporter_start(&rep, -1);
    assert_int_equal(aclrtSubscribeReport(reporter_tid(&rep), st), ACL_SUCCESS);
    /* Let it enter ProcessReport(-1) subscribed, then pull the subscription away. */
    for (int spin = 0; spin < 100 && atomic_load(&rep.calls) < 1; spin++)
        host_sleep_ns(MS);
    host_sleep_ns(20 * MS);
    int before = atomic_load(&rep.not_subscribed);
    assert_int_equal(aclrtUnSubscribeReport(reporter_tid(&rep), st), ACL_SUCCESS);
    for (int spin = 0; spin < 2000 && atomic_load(&rep.not_subscribed) == before; spin++)
        host_sleep_ns(MS);
    assert_true(atomic_load(&rep.not_subscribed) > before);
    reporter_stop(&rep);
    assert_int_equal(atomic_load(&rep.timeouts), 0);
    assert_report_counts(0, 0);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static void test_subscribed_thread_blocking_in_synchronize_gets_block_callbacks_run_elsewhere(void **state)
{
    (void)state;
    aclrtStream st = new_stream(), other = new_stream();
    aclrtEvent e = new_event();
    static cb_rec cb[4];
    for (int i = 0; i < 4; i++)
        rec_init(&cb[i], i + 1);
    assert_int_equal(aclrtSubscribeReport(self_id(), st), ACL_SUCCESS);
    /* Already queued to this thread when it starts waiting: NO_BLOCK then BLOCK. */
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[0], ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[1], ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    host_sleep_ns(20 * MS);
    assert_int_equal(log_count, 0);
    /* Waiting for another stream that waits for st: would deadlock if the callbacks stayed. */
    assert_int_equal(aclrtRecordEvent(e, st), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(other, e), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(other), ACL_SUCCESS);
    assert_int_equal(log_count, 2);
    assert_int_equal(log_values[0], 1);
    assert_int_equal(log_values[1], 2);
    assert_true(atomic_load(&cb[0].thread) != self_id());
    /* Arriving during the wait: the BLOCK one runs on the worker. */
    assert_int_equal(npualloc_sleep_async(st, 0.03), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[2], ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(atomic_load(&cb[2].runs), 1);
    assert_true(atomic_load(&cb[2].thread) != self_id());
    /* Outside waits the thread gets its callbacks again. */
    assert_int_equal(aclrtLaunchCallback(cb_record, &cb[3], ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtProcessReport(1000), ACL_SUCCESS);
    assert_int_equal(atomic_load(&cb[3].thread), self_id());
    assert_int_equal(aclrtUnSubscribeReport(self_id(), st), ACL_SUCCESS);
    aclrtDestroyEvent(e);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(other), ACL_SUCCESS);
}

/* A BLOCK callback on the subscribed thread stands in for its stream's worker. */
typedef struct block_self {
    aclrtStream self, other;
    aclrtEvent event_on_self;
    aclError sync_self, destroy_self, sync_event, sync_other, sync_device;
    _Atomic uint64_t thread;
} block_self;

static void cb_block_self_calls(void *user_data)
{
    block_self *r = user_data;
    atomic_store(&r->thread, self_id());
    r->sync_self = aclrtSynchronizeStream(r->self);
    r->destroy_self = aclrtDestroyStream(r->self);
    r->sync_event = aclrtSynchronizeEvent(r->event_on_self);
    r->sync_other = aclrtSynchronizeStream(r->other);
    r->sync_device = aclrtSetDevice(0);
    if (r->sync_device == ACL_SUCCESS)
        r->sync_device = aclrtSynchronizeDevice();
}

static void test_block_callback_on_subscribed_thread_cannot_wait_for_its_stream(void **state)
{
    (void)state;
    reporter rep;
    reporter_start(&rep, 20);
    block_self r = {.self = new_stream(), .other = new_stream(), .event_on_self = new_event()};
    atomic_init(&r.thread, 0);
    static atomic_int gate; /* the event is recorded before the callback runs */
    assert_int_equal(aclrtSubscribeReport(reporter_tid(&rep), r.self), ACL_SUCCESS);
    hold_stream(r.self, &gate);
    assert_int_equal(aclrtLaunchCallback(cb_block_self_calls, &r, ACL_CALLBACK_BLOCK, r.self), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(r.event_on_self, r.self), ACL_SUCCESS);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(r.self), ACL_SUCCESS);
    assert_int_equal(atomic_load(&r.thread), reporter_tid(&rep));
    assert_int_equal(r.sync_self, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.destroy_self, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.sync_event, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.sync_device, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.sync_other, ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(reporter_tid(&rep), r.self), ACL_SUCCESS);
    reporter_stop(&rep);
    aclrtDestroyEvent(r.event_on_self);
    assert_int_equal(aclrtDestroyStream(r.self), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(r.other), ACL_SUCCESS);
}

/* BLOCK callbacks nested by an aclrtProcessReport inside a callback: the inner one (of `inner`) runs on the
 * thread that also runs the outer one (of `outer`), so it stands in for both workers. */
typedef struct nested_block {
    aclrtStream outer, inner;
    aclError launch, process, sync_outer_timed, destroy_outer, sync_device;
} nested_block;

static void cb_nested_inner(void *user_data)
{
    nested_block *r = user_data;
    r->sync_outer_timed = aclrtSynchronizeStreamWithTimeout(r->outer, 500);
    if (r->sync_outer_timed != ACL_ERROR_RT_FEATURE_NOT_SUPPORT)
        return; /* the calls below would wait for ever for the outer callback */
    r->destroy_outer = aclrtDestroyStream(r->outer);
    r->sync_device = aclrtSynchronizeDevice();
}

static void cb_nested_outer(void *user_data)
{
    nested_block *r = user_data;
    r->launch = aclrtLaunchCallback(cb_nested_inner, r, ACL_CALLBACK_BLOCK, r->inner);
    r->process = aclrtProcessReport(2000); /* runs the inner callback here */
}

/* The outer stream's worker waits for the outer callback, which this thread runs: a wait for that stream
 * from the inner callback is refused as a wait for itself.  Only the innermost BLOCK callback counted, so the
 * timed synchronize timed out (507046), and a destroy or an untimed synchronize waited for ever. */
static void test_a_nested_block_callback_still_stands_in_for_the_outer_stream(void **state)
{
    (void)state;
    nested_block r = {.outer = new_stream(), .inner = new_stream()};
    const uint64_t me = self_id();
    assert_int_equal(aclrtSubscribeReport(me, r.outer), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(me, r.inner), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_nested_outer, &r, ACL_CALLBACK_BLOCK, r.outer), ACL_SUCCESS);
    assert_int_equal(aclrtProcessReport(2000), ACL_SUCCESS);
    assert_int_equal(r.launch, ACL_SUCCESS);
    assert_int_equal(r.process, ACL_SUCCESS);
    assert_int_equal(r.sync_outer_timed, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.destroy_outer, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(r.sync_device, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtSynchronizeStream(r.outer), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(me, r.outer), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(me, r.inner), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(r.outer), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(r.inner), ACL_SUCCESS);
}

/* A NO_BLOCK callback of `st` that processes reports itself, while the next callback of `st` and one of
 * `other` are queued to the same thread. */
typedef struct nested_same {
    atomic_int inside; /* the first callback of st is running */
    atomic_int overlap; /* the second one ran while the first still ran */
    aclError process;
} nested_same;

static void cb_nested_same_first(void *user_data)
{
    nested_same *n = user_data;
    log_append(1);
    atomic_store(&n->inside, 1);
    n->process = aclrtProcessReport(1000);
    atomic_store(&n->inside, 0);
    log_append(2);
}

static void cb_nested_same_second(void *user_data)
{
    nested_same *n = user_data;
    if (atomic_load(&n->inside))
        atomic_store(&n->overlap, 1);
    log_append(3);
}

/* The nested aclrtProcessReport runs the other stream's callback but leaves the next one of its own stream
 * for after it: the nested call used to run it inside the first one (log 1 3 4 2, overlap). */
static void test_nested_process_report_does_not_run_the_next_callback_of_its_own_stream(void **state)
{
    (void)state;
    aclrtStream st = new_stream(), other = new_stream();
    nested_same n = {.process = -1};
    atomic_init(&n.inside, 0);
    atomic_init(&n.overlap, 0);
    static int four = 4;
    const uint64_t me = self_id();
    assert_int_equal(aclrtSubscribeReport(me, st), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(me, other), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_nested_same_first, &n, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_nested_same_second, &n, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    /* Both are queued to this thread once st is passed; then the one of `other`. */
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_append, &four, ACL_CALLBACK_NO_BLOCK, other), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(other), ACL_SUCCESS);
    assert_int_equal(aclrtProcessReport(2000), ACL_SUCCESS);
    assert_int_equal(n.process, ACL_SUCCESS);
    assert_int_equal(atomic_load(&n.overlap), 0);
    assert_int_equal(log_count, 4);
    static const int order[] = {1, 4, 2, 3};
    for (int i = 0; i < 4; i++)
        assert_int_equal(log_values[i], order[i]);
    assert_int_equal(aclrtUnSubscribeReport(me, st), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(me, other), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(other), ACL_SUCCESS);
}

/* A callback of `other` that queues one more callback (on `third`) to the same thread while a nested
 * aclrtProcessReport runs it: that one came after the nested call woke up. */
typedef struct late_report {
    aclrtStream third;
    aclError launch, sync;
} late_report;

static void cb_queue_a_late_one(void *user_data)
{
    late_report *l = user_data;
    static int five = 5;
    log_append(4);
    l->launch = aclrtLaunchCallback(cb_append, &five, ACL_CALLBACK_NO_BLOCK, l->third);
    l->sync = aclrtSynchronizeStream(l->third); /* passed once the callback is handed to the thread */
}

/* A nested call ran as many reports as the thread had queued, counting those it leaves to the outer call,
 * so it ran one that arrived after it woke up (log 1 4 5 2 3): it runs those it found, and no more. */
static void test_nested_process_report_runs_only_what_it_found(void **state)
{
    (void)state;
    aclrtStream st = new_stream(), other = new_stream(), third = new_stream();
    nested_same n = {.process = -1};
    atomic_init(&n.inside, 0);
    atomic_init(&n.overlap, 0);
    late_report late = {.third = third, .launch = -1, .sync = -1};
    const uint64_t me = self_id();
    assert_int_equal(aclrtSubscribeReport(me, st), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(me, other), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(me, third), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_nested_same_first, &n, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_nested_same_second, &n, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_queue_a_late_one, &late, ACL_CALLBACK_NO_BLOCK, other), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(other), ACL_SUCCESS);
    assert_int_equal(aclrtProcessReport(2000), ACL_SUCCESS);
    if (log_count < 5) /* the outer call may leave the late one to the next call */
        assert_int_equal(aclrtProcessReport(2000), ACL_SUCCESS);
    assert_int_equal(n.process, ACL_SUCCESS);
    assert_int_equal(late.launch, ACL_SUCCESS);
    assert_int_equal(late.sync, ACL_SUCCESS);
    assert_int_equal(log_count, 5);
    static const int order[] = {1, 4, 2, 3, 5};
    for (int i = 0; i < 5; i++)
        assert_int_equal(log_values[i], order[i]);
    assert_int_equal(aclrtUnSubscribeReport(me, st), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(me, other), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(me, third), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(other), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(third), ACL_SUCCESS);
}

/* A NO_BLOCK callback that logs its start, sleeps, logs its end. */
typedef struct slow_cb {
    int start, end;
    atomic_int started;
} slow_cb;

static void cb_slow(void *user_data)
{
    slow_cb *c = user_data;
    log_append(c->start);
    atomic_store(&c->started, 1);
    /* still running when the unsubscribe has handed the next callback back */
    size_t subscribed = 1;
    for (int spin = 0; spin < 10000 && subscribed; spin++) {
        stream_report_counts(NULL, &subscribed);
        host_sleep_ns(MS);
    }
    host_sleep_ns(20 * MS);
    log_append(c->end);
}

static void test_unsubscribe_waits_for_a_running_callback_and_order_is_kept(void **state)
{
    (void)state;
    reporter rep;
    reporter_start(&rep, 20);
    aclrtStream st = new_stream();
    static slow_cb slow = {.start = 1, .end = 2};
    static cb_rec next;
    atomic_store(&slow.started, 0);
    rec_init(&next, 3);
    assert_int_equal(aclrtSubscribeReport(reporter_tid(&rep), st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_slow, &slow, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &next, ACL_CALLBACK_NO_BLOCK, st), ACL_SUCCESS);
    for (int spin = 0; spin < 2000 && !atomic_load(&slow.started); spin++)
        host_sleep_ns(MS);
    assert_true(atomic_load(&slow.started));
    /* Like CANN, unsubscribing waits for the busy callback; the next one, handed back to the
     * worker, runs after it. */
    assert_int_equal(aclrtUnSubscribeReport(reporter_tid(&rep), st), ACL_SUCCESS);
    pthread_mutex_lock(&log_lock);
    assert_true(log_count >= 2);
    assert_int_equal(log_values[1], 2);
    pthread_mutex_unlock(&log_lock);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    for (int spin = 0; spin < 2000 && !atomic_load(&next.runs); spin++)
        host_sleep_ns(MS);
    assert_int_equal(log_count, 3);
    assert_int_equal(log_values[2], 3);
    assert_true(atomic_load(&next.thread) != reporter_tid(&rep));
    reporter_stop(&rep);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

/* A NO_BLOCK callback on the subscribed thread that unsubscribes it, then waits for its own
 * stream, whose later BLOCK callback must run meanwhile (on the worker). */
typedef struct self_unsub {
    aclrtStream st;
    uint64_t tid;
    aclError unsub, sync;
    atomic_int done;
} self_unsub;

static void cb_unsubscribe_and_sync_own_stream(void *user_data)
{
    self_unsub *u = user_data;
    u->unsub = aclrtUnSubscribeReport(u->tid, u->st);
    u->sync = aclrtSynchronizeStream(u->st);
    atomic_store(&u->done, 1);
}

static void cb_destroy_own_stream(void *user_data)
{
    self_unsub *u = user_data;
    u->sync = aclrtDestroyStream(u->st);
    atomic_store(&u->done, 1);
}

static void test_no_block_callback_may_unsubscribe_sync_or_destroy_its_own_stream(void **state)
{
    (void)state;
    reporter rep;
    reporter_start(&rep, 20);
    static cb_rec later[2];
    rec_init(&later[0], 1);
    rec_init(&later[1], 2);
    self_unsub u = {.st = new_stream(), .tid = reporter_tid(&rep)};
    atomic_init(&u.done, 0);
    assert_int_equal(aclrtSubscribeReport(u.tid, u.st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_unsubscribe_and_sync_own_stream, &u, ACL_CALLBACK_NO_BLOCK, u.st),
                     ACL_SUCCESS);
    assert_int_equal(npualloc_sleep_async(u.st, 0.02), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &later[0], ACL_CALLBACK_BLOCK, u.st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(u.st), ACL_SUCCESS);
    for (int spin = 0; spin < 5000 && !atomic_load(&u.done); spin++)
        host_sleep_ns(MS);
    assert_true(atomic_load(&u.done));
    assert_int_equal(u.unsub, ACL_SUCCESS);
    assert_int_equal(u.sync, ACL_SUCCESS);
    assert_int_equal(atomic_load(&later[0].runs), 1);
    assert_true(atomic_load(&later[0].thread) != u.tid); /* unsubscribed: on the worker */
    /* Destroying its own stream from a NO_BLOCK callback (its worker is not waiting for it). The gate
     * keeps the destroy from running before the later callback is launched. */
    self_unsub d = {.st = new_stream(), .tid = reporter_tid(&rep)};
    atomic_init(&d.done, 0);
    static atomic_int gate;
    assert_int_equal(aclrtSubscribeReport(d.tid, d.st), ACL_SUCCESS);
    hold_stream(d.st, &gate);
    assert_int_equal(aclrtLaunchCallback(cb_destroy_own_stream, &d, ACL_CALLBACK_NO_BLOCK, d.st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_record, &later[1], ACL_CALLBACK_BLOCK, d.st), ACL_SUCCESS);
    atomic_store(&gate, 1);
    for (int spin = 0; spin < 5000 && !atomic_load(&d.done); spin++)
        host_sleep_ns(MS);
    assert_true(atomic_load(&d.done));
    assert_int_equal(d.sync, ACL_SUCCESS);
    assert_int_equal(atomic_load(&later[1].runs), 1);
    assert_report_counts(0, 0);
    reporter_stop(&rep);
    assert_int_equal(aclrtDestroyStream(u.st), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(d.st), ACL_ERROR_INVALID_PARAM); /* already destroyed */
}

/* Unsubscribing a stream from a callback of it that its worker waits for (a BLOCK one, or any one run on
 * the worker) while an earlier callback of the stream, on the subscribed thread, waits for the stream:
 * `first` (NO_BLOCK) moves the subscription to `to` (when set) and synchronizes st; meanwhile `second`
 * (BLOCK) runs on the worker, or on `to`, and unsubscribes. */
typedef struct unsub_in_block {
    aclrtStream st;
    uint64_t from, to;         /* the subscriber, and the one `first` hands the stream to (0: none) */
    atomic_int gate;           /* opened by `first`: `second` is reached after the move */
    aclError move, sync, unsub;
    _Atomic uint64_t thread;   /* where `second` ran */
} unsub_in_block;

static void cb_move_and_sync(void *user_data)
{
    unsub_in_block *u = user_data;
    if (u->to) {
        u->move = aclrtUnSubscribeReport(u->from, u->st);
        if (u->move == ACL_SUCCESS)
            u->move = aclrtSubscribeReport(u->to, u->st);
    }
    atomic_store(&u->gate, 1);
    u->sync = aclrtSynchronizeStream(u->st);
}

static void cb_unsubscribe_current(void *user_data)
{
    unsub_in_block *u = user_data;
    atomic_store(&u->thread, self_id());
    u->unsub = aclrtUnSubscribeReport(u->to ? u->to : u->from, u->st);
}

/* A plain task of st that waits until *arg (an atomic_int) is set, as cb_wait_gate does. */
static aclError task_wait_gate(void *arg)
{
    cb_wait_gate(arg);
    return ACL_SUCCESS;
}

/* The unsubscribe would wait for `first`, which waits for st, which waits for `second`: it used to
 * deadlock (here SIGALRM).  It is refused as a wait for its own stream, and the subscription stays. */
static void run_unsubscribe_from_block_callback(uint64_t to)
{
    unsub_in_block u = {.st = new_stream(), .from = self_id(), .to = to, .move = -1, .sync = -1, .unsub = -1};
    atomic_init(&u.gate, 0);
    atomic_init(&u.thread, 0);
    assert_int_equal(aclrtSubscribeReport(u.from, u.st), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_move_and_sync, &u, ACL_CALLBACK_NO_BLOCK, u.st), ACL_SUCCESS);
    npu_stream *s;
    assert_int_equal(stream_acquire(u.st, &s), ACL_SUCCESS);
    assert_int_equal(stream_enqueue(s, task_wait_gate, &u.gate, NULL, NULL), ACL_SUCCESS);
    stream_release(s);
    assert_int_equal(aclrtLaunchCallback(cb_unsubscribe_current, &u, ACL_CALLBACK_BLOCK, u.st), ACL_SUCCESS);
    alarm(getenv("NPUALLOC_VALGRIND") ? 300 : 10); /* a deadlock dies of SIGALRM instead of hanging */
    assert_int_equal(aclrtProcessReport(5000), ACL_SUCCESS); /* runs `first` */
    alarm(0);
    assert_int_equal(u.sync, ACL_SUCCESS);
    assert_int_equal(u.unsub, ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    const uint64_t subscriber = to ? to : u.from;
    if (to)
        assert_int_equal(u.move, ACL_SUCCESS);
    /* On the worker (the subscribed thread was blocked in the synchronize), or on the new subscriber. */
    assert_true(to ? atomic_load(&u.thread) == to : atomic_load(&u.thread) != u.from);
    assert_int_equal(aclrtUnSubscribeReport(subscriber, u.st), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(u.st), ACL_SUCCESS);
}

static void test_block_callback_on_the_worker_cannot_unsubscribe_while_its_stream_is_waited_for(void **state)
{
    (void)state;
    run_unsubscribe_from_block_callback(0);
}

static void test_block_callback_on_another_thread_cannot_unsubscribe_while_its_stream_is_waited_for(void **state)
{
    (void)state;
    reporter rep;
    reporter_start(&rep, 20);
    run_unsubscribe_from_block_callback(reporter_tid(&rep));
    reporter_stop(&rep);
}

/* Several streams, two serving threads, and a thread moving subscriptions around: every
 * callback runs exactly once and each stream's callbacks run in launch order. */
#define CHURN_STREAMS 4
#define CHURN_CALLBACKS 150

typedef struct churn_cb {
    int stream, index;
    atomic_int runs;
} churn_cb;

static atomic_int churn_next[CHURN_STREAMS];
static atomic_int churn_disorder;

static void cb_churn(void *user_data)
{
    churn_cb *c = user_data;
    if (atomic_fetch_add(&churn_next[c->stream], 1) != c->index)
        atomic_fetch_add(&churn_disorder, 1);
    atomic_fetch_add(&c->runs, 1);
}

typedef struct churn_ctx {
    aclrtStream streams[CHURN_STREAMS];
    uint64_t tids[2];
    atomic_int stop;
    atomic_int failures;
} churn_ctx;

static void *churn_main(void *arg)
{
    churn_ctx *c = arg;
    for (unsigned i = 0; !atomic_load(&c->stop); i++) {
        aclrtStream st = c->streams[i % CHURN_STREAMS];
        uint64_t tid = c->tids[(i / CHURN_STREAMS) % 2];
        aclError rc = aclrtSubscribeReport(tid, st);
        if (rc != ACL_SUCCESS && rc != ACL_ERROR_RT_STREAM_SUBSCRIBE)
            atomic_fetch_add(&c->failures, 1);
        host_sleep_ns(MS / 4);
        if (i % 3 == 0) {
            for (int k = 0; k < 2; k++) {
                rc = aclrtUnSubscribeReport(c->tids[k], st);
                if (rc != ACL_SUCCESS && rc != ACL_ERROR_RT_STREAM_SUBSCRIBE && rc != ACL_ERROR_RT_THREAD_SUBSCRIBE)
                    atomic_fetch_add(&c->failures, 1);
            }
        }
    }
    return NULL;
}

static void test_subscription_churn_loses_and_reorders_no_callback(void **state)
{
    (void)state;
    static churn_cb cbs[CHURN_STREAMS][CHURN_CALLBACKS];
    churn_ctx c;
    memset(&c, 0, sizeof c);
    atomic_store(&churn_disorder, 0);
    reporter rep[2];
    for (int k = 0; k < 2; k++) {
        reporter_start(&rep[k], 5);
        c.tids[k] = reporter_tid(&rep[k]);
    }
    for (int s = 0; s < CHURN_STREAMS; s++) {
        c.streams[s] = new_stream();
        atomic_store(&churn_next[s], 0);
    }
    pthread_t churner;
    assert_int_equal(pthread_create(&churner, NULL, churn_main, &c), 0);
    for (int i = 0; i < CHURN_CALLBACKS; i++) {
        for (int s = 0; s < CHURN_STREAMS; s++) {
            churn_cb *cb = &cbs[s][i];
            cb->stream = s;
            cb->index = i;
            atomic_store(&cb->runs, 0);
            aclrtCallbackBlockType bt = ((i + s) % 2) ? ACL_CALLBACK_BLOCK : ACL_CALLBACK_NO_BLOCK;
            assert_int_equal(aclrtLaunchCallback(cb_churn, cb, bt, c.streams[s]), ACL_SUCCESS);
        }
        if (i % 50 == 0)
            host_sleep_ns(2 * MS);
    }
    for (int s = 0; s < CHURN_STREAMS; s++)
        assert_int_equal(aclrtSynchronizeStream(c.streams[s]), ACL_SUCCESS);
    atomic_store(&c.stop, 1);
    assert_int_equal(pthread_join(churner, NULL), 0);
    /* Destroy: whatever is still queued to the reporters comes back to the workers. */
    for (int s = 0; s < CHURN_STREAMS; s++)
        assert_int_equal(aclrtDestroyStream(c.streams[s]), ACL_SUCCESS);
    assert_report_counts(0, 0);
    for (int k = 0; k < 2; k++)
        reporter_stop(&rep[k]);
    assert_int_equal(atomic_load(&c.failures), 0);
    assert_int_equal(atomic_load(&churn_disorder), 0);
    for (int s = 0; s < CHURN_STREAMS; s++)
        for (int i = 0; i < CHURN_CALLBACKS; i++)
            assert_int_equal(atomic_load(&cbs[s][i].runs), 1);
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
#if defined(NPUALLOC_TSAN)
    skip(); /* TSan loses track of threads a child of a threaded process starts ("dup thread id") */
#endif
    atomic_store(&child_ran_parent_task, 0);
    aclrtStream st = new_stream();
    aclrtEvent e = new_event();
    static atomic_int gate; /* the parent's task waits until the child is done */
    hold_stream(st, &gate);
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
    atomic_store(&gate, 1);
    /* The parent's work goes on. */
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    assert_int_equal(atomic_load(&child_ran_parent_task), 1);
    stream_release(pinned);
    aclrtDestroyEvent(e);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static atomic_int forked_pid;

/* The child ends in the middle of cmocka's run: what cmocka holds then is no leak of npualloc's, so the
 * child's exit skips LeakSanitizer's check (an atexit handler registered after it runs first). */
static void end_child_without_leak_check(void) { _exit(0); }

/* A callback that forks; the child returns from it, into the copy of the stream's worker loop. */
static void cb_fork(void *arg)
{
    (void)arg;
    pid_t pid = fork();
    if (pid == 0)
        atexit(end_child_without_leak_check);
    else
        atomic_store(&forked_pid, pid);
}

/* fork() from a callback on a stream's worker: the child's thread goes back into that worker's loop when
 * the callback returns, and ends there (the process with it, status 0).  The child used to free the
 * stream that loop then wrote to (ASan: use after free). */
static void test_a_child_forked_by_a_callback_returns_into_its_stream_unharmed(void **state)
{
    (void)state;
#if defined(NPUALLOC_TSAN)
    skip(); /* TSan loses track of threads a child of a threaded process starts ("dup thread id") */
#endif
    if (npualloc_shutdown == NULL)
        skip(); /* the fork handlers are runtime.c's */
    atomic_store(&forked_pid, 0);
    aclrtStream st = new_stream();
    assert_int_equal(aclrtLaunchCallback(cb_fork, NULL, ACL_CALLBACK_BLOCK, st), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(st), ACL_SUCCESS);
    pid_t pid = atomic_load(&forked_pid);
    assert_true(pid > 0);
    int status = -1;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    assert_int_equal(aclrtDestroyStream(st), ACL_SUCCESS);
}

static aclrtStream resub_first, resub_second;
static atomic_int resub_ran;
static aclError resub_sync;

/* A callback the subscribed thread runs: it moves its subscription to another stream (its first one
 * retires, a new one is made) and waits for a BLOCK callback queued there. */
static void cb_resubscribe_and_wait(void *arg)
{
    (void)arg;
    (void)aclrtUnSubscribeReport(self_id(), resub_first);
    (void)aclrtSubscribeReport(self_id(), resub_second);
    (void)aclrtLaunchCallback(cb_set_flag, &resub_ran, ACL_CALLBACK_BLOCK, resub_second);
    resub_sync = aclrtSynchronizeStreamWithTimeout(resub_second, 10000);
}

/* A subscribed thread waiting for a stream from inside a callback hands its BLOCK callbacks back to the
 * workers: those of the subscription it has now too, made again while the callback ran.  Only the retired
 * one was marked, so the BLOCK callback waited for the thread that waited for it (507046 here, a hang
 * without the timeout). */
static void test_a_callback_that_subscribes_its_thread_again_can_wait_for_that_stream(void **state)
{
    (void)state;
    resub_first = new_stream();
    resub_second = new_stream();
    atomic_store(&resub_ran, 0);
    resub_sync = -1;
    assert_int_equal(aclrtSubscribeReport(self_id(), resub_first), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_resubscribe_and_wait, NULL, ACL_CALLBACK_NO_BLOCK, resub_first),
                     ACL_SUCCESS);
    assert_int_equal(aclrtProcessReport(20000), ACL_SUCCESS);
    assert_int_equal(resub_sync, ACL_SUCCESS);
    assert_int_equal(atomic_load(&resub_ran), 1); /* it ran on the worker */
    assert_int_equal(aclrtUnSubscribeReport(self_id(), resub_second), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(resub_first), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(resub_second), ACL_SUCCESS);
}

/* Runs in the forked child: no subscription survives, new ones work. */
static int fork_child_subscription_checks(void)
{
    size_t t = 1, n = 1;
    stream_report_counts(&t, &n);
    if (t != 0 || n != 0)
        return 1;
    if (aclrtProcessReport(10) != ACL_ERROR_RT_THREAD_SUBSCRIBE)
        return 2;
    if (aclrtSetDevice(0) != ACL_SUCCESS)
        return 3;
    aclrtStream st = NULL;
    static atomic_int flag;
    if (aclrtCreateStream(&st) != ACL_SUCCESS || aclrtSubscribeReport(self_id(), st) != ACL_SUCCESS ||
        aclrtLaunchCallback(cb_set_flag, &flag, ACL_CALLBACK_BLOCK, st) != ACL_SUCCESS)
        return 4;
    if (aclrtProcessReport(2000) != ACL_SUCCESS || atomic_load(&flag) != 1)
        return 5;
    if (aclrtUnSubscribeReport(self_id(), st) != ACL_SUCCESS || aclrtSynchronizeStream(st) != ACL_SUCCESS ||
        aclrtDestroyStream(st) != ACL_SUCCESS)
        return 6;
    if (atomic_load(&child_ran_parent_task))
        return 7; /* a callback queued in the parent must not run in the child */
    return 0;
}

static void test_fork_child_has_no_subscriptions_and_parent_keeps_its_own(void **state)
{
    (void)state;
#if defined(NPUALLOC_TSAN)
    skip(); /* TSan loses track of threads a child of a threaded process starts ("dup thread id") */
#endif
    atomic_store(&child_ran_parent_task, 0);
    aclrtStream absent = new_stream(), mine = new_stream();
    assert_int_equal(aclrtSubscribeReport(ABSENT_TID, absent), ACL_SUCCESS);
    assert_int_equal(aclrtSubscribeReport(self_id(), mine), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_mark_parent_task, NULL, ACL_CALLBACK_NO_BLOCK, absent), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_mark_parent_task, NULL, ACL_CALLBACK_BLOCK, absent), ACL_SUCCESS);
    assert_int_equal(aclrtLaunchCallback(cb_mark_parent_task, NULL, ACL_CALLBACK_NO_BLOCK, mine), ACL_SUCCESS);
    host_sleep_ns(20 * MS); /* let the workers hand them over */
    assert_int_equal(atomic_load(&child_ran_parent_task), 0);
    bool handlers_registered = npualloc_shutdown != NULL;
    if (!handlers_registered)
        stream_atfork_prepare();
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (!handlers_registered)
            stream_atfork_child();
        _exit(fork_child_subscription_checks());
    }
    if (!handlers_registered)
        stream_atfork_parent();
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* The parent's subscriptions are intact. */
    assert_report_counts(2, 2);
    assert_int_equal(atomic_load(&child_ran_parent_task), 0);
    assert_int_equal(aclrtProcessReport(1000), ACL_SUCCESS); /* mine's callback */
    assert_int_equal(atomic_load(&child_ran_parent_task), 1);
    assert_int_equal(aclrtUnSubscribeReport(ABSENT_TID, absent), ACL_SUCCESS); /* the worker runs them */
    assert_int_equal(aclrtSynchronizeStream(absent), ACL_SUCCESS);
    assert_int_equal(aclrtUnSubscribeReport(self_id(), mine), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(absent), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(mine), ACL_SUCCESS);
    assert_report_counts(0, 0);
}

int main(void)
{
    /* The tests assume the default configuration (8 devices). */
    unsetenv("NPUALLOC_DEVICE_COUNT");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_tasks_run_in_fifo_order_with_increasing_positions, setup, teardown),
        cmocka_unit_test_setup_teardown(test_created_stream_id_is_its_handle, setup, teardown),
        cmocka_unit_test_setup_teardown(test_event_behind_sleep_is_not_ready_until_synchronized, setup, teardown),
        cmocka_unit_test_setup_teardown(test_memset_and_memcpy_async_run_in_order_behind_queued_work, setup, teardown),
        cmocka_unit_test_setup_teardown(test_async_copy_of_pageable_memory_is_done_on_return, setup, teardown),
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
        cmocka_unit_test_setup_teardown(test_internal_device_wait_leaves_sticky_errors_for_synchronize, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_synchronize_with_timeout_stream_and_event, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_query_reports_queued_work, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_stream_arguments_and_handles_are_rejected, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_event_arguments_and_handles_are_rejected, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sleep_async_rejects_negative_nan_and_infinite, setup, teardown),
        cmocka_unit_test_setup_teardown(test_without_current_device_context_calls_fail_with_107002, setup, teardown),
        cmocka_unit_test_setup_teardown(test_default_streams_are_per_device_and_not_counted, setup, teardown),
        cmocka_unit_test_setup_teardown(test_created_stream_belongs_to_current_device_and_device_sync_waits_for_it,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_device_sync_waits_for_a_stream_being_destroyed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_destroy_stream_waits_for_queued_work, setup, teardown),
        cmocka_unit_test_setup_teardown(test_event_stays_valid_after_its_stream_is_destroyed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_waiting_stream_survives_destroy_of_the_stream_it_waits_for, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_destroy_event_with_queued_record_is_safe, setup, teardown),
        cmocka_unit_test_setup_teardown(test_eight_threads_create_record_query_destroy_concurrently, setup, teardown),
        cmocka_unit_test_setup_teardown(test_task_cannot_wait_for_its_own_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(test_subscription_error_codes_follow_cann_runtime, setup, teardown),
        cmocka_unit_test_setup_teardown(test_process_report_argument_subscription_and_timeout_codes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_block_callback_holds_later_tasks_until_process_report_runs_it, setup, teardown),
        cmocka_unit_test_setup_teardown(test_no_block_callback_lets_later_tasks_and_synchronize_go_on, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unsubscribed_stream_keeps_running_callbacks_on_its_worker, setup, teardown),
        cmocka_unit_test_setup_teardown(test_callback_goes_where_the_subscription_is_when_the_worker_reaches_it, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stream_subscribed_to_its_own_worker_runs_callbacks_there, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_reporter_thread_runs_callbacks_of_two_streams_in_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unsubscribe_hands_pending_callbacks_back_to_the_worker_in_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_destroy_and_shutdown_do_not_wait_for_an_absent_subscriber, setup, teardown),
        cmocka_unit_test_setup_teardown(test_process_report_waiting_forever_returns_when_last_subscription_ends, setup, teardown),
        cmocka_unit_test_setup_teardown(test_subscribed_thread_blocking_in_synchronize_gets_block_callbacks_run_elsewhere, setup, teardown),
        cmocka_unit_test_setup_teardown(test_block_callback_on_subscribed_thread_cannot_wait_for_its_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(test_a_nested_block_callback_still_stands_in_for_the_outer_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(test_nested_process_report_does_not_run_the_next_callback_of_its_own_stream,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_nested_process_report_runs_only_what_it_found, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unsubscribe_waits_for_a_running_callback_and_order_is_kept, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_no_block_callback_may_unsubscribe_sync_or_destroy_its_own_stream, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_block_callback_on_the_worker_cannot_unsubscribe_while_its_stream_is_waited_for,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(
            test_block_callback_on_another_thread_cannot_unsubscribe_while_its_stream_is_waited_for, setup, teardown),
        cmocka_unit_test_setup_teardown(test_subscription_churn_loses_and_reorders_no_callback, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shutdown_runs_queued_work_frees_everything_and_restarts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fork_child_starts_without_streams_and_runs_no_parent_task, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_a_child_forked_by_a_callback_returns_into_its_stream_unharmed, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_a_callback_that_subscribes_its_thread_again_can_wait_for_that_stream,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_fork_child_has_no_subscriptions_and_parent_keeps_its_own, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
