/* test_stream_flags.c - the stream and event calls with CANN's flags: aclrtCreateEventWithFlag,
 * aclrtCreateEventExWithFlag, aclrtResetEvent, aclrtQueryEventWaitStatus, aclrtCreateStreamWithConfig
 * and aclrtSynchronizeDeviceWithTimeout (values, codes and what npualloc makes of each flag:
 * docs/runtime.md). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "host.h"
#include "npualloc_graph.h"
#include "stream.h"
#include "testutil.h"

#define MS (1000000ull) /* nanoseconds */
#define FORGED ((void *)(uintptr_t)0x4500000012345601ull) /* a plausible but unknown handle value */

static aclError task_fail(void *arg) { return (aclError)(intptr_t)arg; }

static aclrtEvent flagged(uint32_t flag)
{
    aclrtEvent e = NULL;
    assert_int_equal(aclrtCreateEventWithFlag(&e, flag), ACL_SUCCESS);
    assert_non_null(e);
    return e;
}

static aclrtEvent flagged_ex(uint32_t flag)
{
    aclrtEvent e = NULL;
    assert_int_equal(aclrtCreateEventExWithFlag(&e, flag), ACL_SUCCESS);
    assert_non_null(e);
    return e;
}

static aclrtEventRecordedStatus recorded(aclrtEvent e)
{
    aclrtEventRecordedStatus st = (aclrtEventRecordedStatus)-1;
    assert_int_equal(aclrtQueryEventStatus(e, &st), ACL_SUCCESS);
    return st;
}

static aclrtEventWaitStatus wait_status(aclrtEvent e)
{
    aclrtEventWaitStatus st = ACL_EVENT_WAIT_STATUS_RESERVED;
    assert_int_equal(aclrtQueryEventWaitStatus(e, &st), ACL_SUCCESS);
    return st;
}

static int setup(void **state)
{
    (void)state;
    start_runtime(2, GiB_, GiB_, 0, 0);
    return 0;
}

/* ---- values ---- */

static void test_flag_and_status_values_are_canns(void **state)
{
    (void)state;
    assert_int_equal(ACL_EVENT_SYNC, 0x1);
    assert_int_equal(ACL_EVENT_CAPTURE_STREAM_PROGRESS, 0x2);
    assert_int_equal(ACL_EVENT_TIME_LINE, 0x8);
    assert_int_equal(ACL_EVENT_DEVICE_USE_ONLY, 0x10);
    assert_int_equal(ACL_EVENT_EXTERNAL, 0x20);
    assert_int_equal(ACL_EVENT_IPC, 0x40);
    assert_int_equal(ACL_STREAM_FAST_LAUNCH, 0x1);
    assert_int_equal(ACL_STREAM_FAST_SYNC, 0x2);
    assert_int_equal(ACL_STREAM_PERSISTENT, 0x4);
    assert_int_equal(ACL_STREAM_HUGE, 0x8);
    assert_int_equal(ACL_STREAM_CPU_SCHEDULE, 0x10);
    assert_int_equal(ACL_STREAM_DEVICE_USE_ONLY, 0x20);
    assert_int_equal(ACL_EVENT_WAIT_STATUS_COMPLETE, 0);
    assert_int_equal(ACL_EVENT_WAIT_STATUS_NOT_READY, 1);
    assert_int_equal(ACL_EVENT_WAIT_STATUS_RESERVED, 0xFFFF);
}

/* ---- event creation ---- */

static void test_create_event_with_flag_takes_canns_flags_and_refuses_the_rest(void **state)
{
    (void)state;
    const uint32_t good[] = {ACL_EVENT_SYNC, ACL_EVENT_CAPTURE_STREAM_PROGRESS, ACL_EVENT_TIME_LINE,
                             ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE | ACL_EVENT_CAPTURE_STREAM_PROGRESS,
                             0x4 /* the runtime's DDSYNC, no ACL name */, 0xF, ACL_EVENT_DEVICE_USE_ONLY};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++)
        assert_int_equal(aclrtDestroyEvent(flagged(good[i])), ACL_SUCCESS);
    const uint32_t bad[] = {0, ACL_EVENT_IPC, 0x80, 0x40000000, UINT32_MAX, ACL_EVENT_SYNC | ACL_EVENT_DEVICE_USE_ONLY,
                            ACL_EVENT_TIME_LINE | ACL_EVENT_EXTERNAL, ACL_EVENT_DEVICE_USE_ONLY | ACL_EVENT_EXTERNAL,
                            ACL_EVENT_SYNC | ACL_EVENT_IPC};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        aclrtEvent e = (aclrtEvent)0x1;
        assert_int_equal(aclrtCreateEventWithFlag(&e, bad[i]), ACL_ERROR_RT_PARAM_INVALID);
        assert_ptr_equal(e, (aclrtEvent)0x1);
    }
    /* valid for CANN, but for updating captured tasks, which npualloc's graph capture cannot do */
    aclrtEvent e = NULL;
    assert_int_equal(aclrtCreateEventWithFlag(&e, ACL_EVENT_EXTERNAL), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtCreateEventWithFlag(NULL, ACL_EVENT_SYNC), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtCreateEventWithFlag(NULL, 0), ACL_ERROR_INVALID_PARAM); /* the pointer first */
    size_t streams, events;
    stream_counts(&streams, &events);
    assert_int_equal(events, 0);
}

static void test_create_event_ex_with_flag_takes_canns_flags_and_refuses_the_rest(void **state)
{
    (void)state;
    const uint32_t good[] = {ACL_EVENT_SYNC, ACL_EVENT_TIME_LINE, ACL_EVENT_CAPTURE_STREAM_PROGRESS, 0x4, 0xF};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++)
        assert_int_equal(aclrtDestroyEvent(flagged_ex(good[i])), ACL_SUCCESS);
    const uint32_t bad[] = {0, ACL_EVENT_DEVICE_USE_ONLY, ACL_EVENT_EXTERNAL, ACL_EVENT_IPC | ACL_EVENT_SYNC,
                            ACL_EVENT_SYNC | ACL_EVENT_DEVICE_USE_ONLY, 0x80, UINT32_MAX};
    aclrtEvent e = NULL;
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        assert_int_equal(aclrtCreateEventExWithFlag(&e, bad[i]), ACL_ERROR_RT_PARAM_INVALID);
    /* CANN's code for an IPC event where the chip has none: npualloc has no IPC events */
    assert_int_equal(aclrtCreateEventExWithFlag(&e, ACL_EVENT_IPC), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtCreateEventExWithFlag(NULL, ACL_EVENT_SYNC), ACL_ERROR_INVALID_PARAM);
    assert_null(e);
}

/* ---- what each kind of event may do ---- */

static void test_event_without_sync_is_timed_but_never_waited_for_or_reset(void **state)
{
    (void)state;
    aclrtStream s = new_stream(), t = new_stream();
    aclrtEvent a = flagged(ACL_EVENT_TIME_LINE), b = flagged(ACL_EVENT_TIME_LINE | ACL_EVENT_CAPTURE_STREAM_PROGRESS);
    assert_int_equal(aclrtRecordEvent(a, s), ACL_SUCCESS);
    assert_int_equal(npualloc_sleep_async(s, 0.002), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(b, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeEvent(b), ACL_SUCCESS);
    float ms = -1;
    assert_int_equal(aclrtEventElapsedTime(&ms, a, b), ACL_SUCCESS);
    assert_true(ms >= 1.5f);
    assert_int_equal(recorded(a), ACL_EVENT_RECORDED_STATUS_COMPLETE);
    /* CANN's runtime: no stream waits for such an event, and there is nothing to reset */
    assert_int_equal(aclrtStreamWaitEvent(t, a), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtResetEvent(a, t), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(wait_status(a), ACL_EVENT_WAIT_STATUS_COMPLETE);
    assert_int_equal(recorded(a), ACL_EVENT_RECORDED_STATUS_COMPLETE); /* the refused reset did nothing */
    assert_int_equal(aclrtDestroyEvent(a), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(b), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(t), ACL_SUCCESS);
}

static void test_device_use_only_event_is_refused_every_host_side_task(void **state)
{
    (void)state;
    aclrtStream s = new_stream();
    aclrtEvent e = flagged(ACL_EVENT_DEVICE_USE_ONLY);
    assert_int_equal(aclrtRecordEvent(e, s), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtStreamWaitEvent(s, e), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtResetEvent(e, s), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY); /* never recorded */
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    aclrtStreamStatus st;
    assert_int_equal(aclrtStreamQuery(s, &st), ACL_SUCCESS);
    assert_int_equal(st, ACL_STREAM_STATUS_COMPLETE); /* nothing was queued */
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
}

static void test_ex_event_is_complete_until_recorded_and_refuses_query_reset_and_wait_status(void **state)
{
    (void)state;
    static atomic_int gate;
    aclrtStream s = new_stream(), t = new_stream();
    aclrtEvent e = flagged_ex(ACL_EVENT_SYNC);
    aclrtEventStatus old;
    aclrtEventWaitStatus ws;
    /* CANN's runtime: a "new mode" event counts as recorded before its first record */
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE);
    assert_int_equal(aclrtQueryEvent(e, &old), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtQueryEventWaitStatus(e, &ws), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtResetEvent(e, t), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    hold_stream(s, &gate);
    assert_int_equal(aclrtRecordEvent(e, s), ACL_SUCCESS);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY);
    assert_int_equal(aclrtStreamWaitEvent(t, e), ACL_SUCCESS); /* with SYNC: streams wait for it */
    aclrtStreamStatus st;
    assert_int_equal(aclrtStreamQuery(t, &st), ACL_SUCCESS);
    assert_int_equal(st, ACL_STREAM_STATUS_NOT_READY);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(t), ACL_SUCCESS);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    /* without SYNC, not even that */
    e = flagged_ex(ACL_EVENT_TIME_LINE);
    assert_int_equal(aclrtStreamWaitEvent(t, e), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(t), ACL_SUCCESS);
}

/* ---- aclrtResetEvent ---- */

static void test_reset_takes_effect_when_its_stream_reaches_it(void **state)
{
    (void)state;
    static atomic_int gate;
    aclrtStream s = new_stream(), t = new_stream();
    aclrtEvent e = flagged(ACL_EVENT_SYNC);
    assert_int_equal(aclrtRecordEvent(e, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE);
    hold_stream(t, &gate);
    assert_int_equal(aclrtResetEvent(e, t), ACL_SUCCESS);
    host_sleep_ns(5 * MS);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE); /* queued behind the gate */
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(t), ACL_SUCCESS);
    /* back to never recorded: not recorded, nothing to wait for, no time */
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY);
    aclrtEventStatus st = ACL_EVENT_STATUS_RESERVED;
    assert_int_equal(aclrtQueryEvent(e, &st), ACL_SUCCESS);
    assert_int_equal(st, ACL_EVENT_STATUS_COMPLETE);
    float ms;
    assert_int_equal(aclrtEventElapsedTime(&ms, e, e), ACL_ERROR_RT_INTERNAL_ERROR); /* no record */
    assert_int_equal(aclrtSynchronizeEventWithTimeout(e, 1), ACL_SUCCESS);
    /* and it records again */
    assert_int_equal(aclrtRecordEvent(e, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeEvent(e), ACL_SUCCESS);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE);
    assert_int_equal(aclrtEventElapsedTime(&ms, e, e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(t), ACL_SUCCESS);
}

static void test_reset_leaves_a_record_made_after_it_was_queued(void **state)
{
    (void)state;
    static atomic_int gate;
    aclrtStream s = new_stream(), t = new_stream();
    aclrtEvent e = flagged(ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE);
    assert_int_equal(aclrtRecordEvent(e, s), ACL_SUCCESS);
    hold_stream(t, &gate);
    assert_int_equal(aclrtResetEvent(e, t), ACL_SUCCESS);
    assert_int_equal(aclrtRecordEvent(e, s), ACL_SUCCESS); /* the newer record */
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(t), ACL_SUCCESS);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE);
    float ms = -1;
    assert_int_equal(aclrtEventElapsedTime(&ms, e, e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(t), ACL_SUCCESS);
}

static void test_reset_of_a_record_still_pending_clears_it_and_its_late_stamp(void **state)
{
    (void)state;
    static atomic_int gate;
    aclrtStream s = new_stream();
    aclrtEvent e = flagged(ACL_EVENT_SYNC);
    hold_stream(s, &gate);
    assert_int_equal(aclrtRecordEvent(e, s), ACL_SUCCESS);
    /* on the default stream (NULL), which is idle: it runs before the record does */
    assert_int_equal(aclrtResetEvent(e, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(NULL), ACL_SUCCESS);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY);
    assert_int_equal(aclrtSynchronizeEventWithTimeout(e, 1), ACL_SUCCESS); /* nothing to wait for */
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY); /* the old record stays gone */
    float ms;
    assert_int_equal(aclrtEventElapsedTime(&ms, e, e), ACL_ERROR_RT_INTERNAL_ERROR); /* no record */
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
}

static void test_reset_of_a_plain_event_and_bad_arguments(void **state)
{
    (void)state;
    aclrtStream s = new_stream();
    aclrtEvent e = NULL;
    assert_int_equal(aclrtCreateEvent(&e), ACL_SUCCESS);
    /* aclrtCreateEvent's events carry the runtime's default flags, which a reset accepts */
    assert_int_equal(aclrtRecordEvent(e, s), ACL_SUCCESS);
    assert_int_equal(aclrtResetEvent(e, s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY);
    assert_int_equal(aclrtResetEvent(NULL, s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtResetEvent(FORGED, s), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtResetEvent(e, FORGED), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtResetEvent((aclrtEvent)s, s), ACL_ERROR_INVALID_PARAM); /* a stream for an event */
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtResetEvent(e, s), ACL_ERROR_INVALID_PARAM); /* destroyed */
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtResetEvent(e, NULL), ACL_ERROR_INVALID_PARAM); /* destroyed */
}

/* A reset queued on a capturing stream is a node of the graph, which keeps its event referenced until
 * the graph goes.  A fork child that destroys the parent's graph must not release the event: the child
 * freed the parent's events. */
static void test_graph_captured_reset_is_freed_in_a_fork_child(void **state)
{
    (void)state;
    aclrtStream t = new_stream();
    aclrtEvent e = flagged(ACL_EVENT_SYNC);
    npualloc_graph *g;
    assert_int_equal(npualloc_graph_create(0, &g), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_begin(g, t, 0, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtResetEvent(e, t), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_end(g), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS); /* the graph still holds it */
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        npualloc_graph_destroy(g);
        aclrtEvent fresh = NULL; /* the child's own events work */
        bool ok = aclrtCreateEvent(&fresh) == ACL_SUCCESS && aclrtDestroyEvent(fresh) == ACL_SUCCESS;
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    npualloc_graph_destroy(g); /* the parent's reference is real: the event goes now */
    assert_int_equal(aclrtDestroyStream(t), ACL_SUCCESS);
}

/* A graph queues a captured reset again at every launch: each launch clears the record current then, not
 * only a record that was current when the reset was captured. */
static void test_graph_captured_reset_clears_the_record_current_at_each_launch(void **state)
{
    (void)state;
    aclrtStream s = new_stream(), t = new_stream();
    aclrtEvent e = flagged(ACL_EVENT_SYNC);
    npualloc_graph *g;
    npualloc_graph_exec *x;
    assert_int_equal(npualloc_graph_create(0, &g), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_begin(g, t, 0, NULL), ACL_SUCCESS);
    assert_int_equal(aclrtResetEvent(e, t), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_capture_end(g), ACL_SUCCESS);
    assert_int_equal(npualloc_graph_instantiate(g, &x), ACL_SUCCESS);
    for (int launch = 0; launch < 2; launch++) {
        assert_int_equal(aclrtRecordEvent(e, s), ACL_SUCCESS);
        assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
        assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_COMPLETE);
        assert_int_equal(npualloc_graph_launch(x, t, 0), ACL_SUCCESS);
        assert_int_equal(aclrtSynchronizeStream(t), ACL_SUCCESS);
        assert_int_equal(recorded(e), ACL_EVENT_RECORDED_STATUS_NOT_READY);
    }
    npualloc_graph_exec_destroy(x);
    npualloc_graph_destroy(g);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(t), ACL_SUCCESS);
}

/* ---- aclrtQueryEventWaitStatus ---- */

static void test_wait_status_is_not_ready_while_a_queued_wait_still_waits(void **state)
{
    (void)state;
    static atomic_int gate;
    aclrtStream s = new_stream(), t = new_stream(), u = new_stream();
    aclrtEvent e = flagged(ACL_EVENT_SYNC);
    assert_int_equal(wait_status(e), ACL_EVENT_WAIT_STATUS_COMPLETE); /* no wait at all */
    hold_stream(s, &gate);
    assert_int_equal(aclrtRecordEvent(e, s), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(t, e), ACL_SUCCESS);
    assert_int_equal(aclrtStreamWaitEvent(u, e), ACL_SUCCESS);
    host_sleep_ns(5 * MS);
    assert_int_equal(wait_status(e), ACL_EVENT_WAIT_STATUS_NOT_READY);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtSynchronizeStream(t), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(u), ACL_SUCCESS);
    assert_int_equal(wait_status(e), ACL_EVENT_WAIT_STATUS_COMPLETE);
    /* a wait for a record that already passed queues nothing */
    assert_int_equal(aclrtStreamWaitEvent(t, e), ACL_SUCCESS);
    assert_int_equal(wait_status(e), ACL_EVENT_WAIT_STATUS_COMPLETE);
    aclrtEventWaitStatus ws;
    assert_int_equal(aclrtQueryEventWaitStatus(e, NULL), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventWaitStatus(NULL, &ws), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtQueryEventWaitStatus(FORGED, &ws), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyEvent(e), ACL_SUCCESS);
    assert_int_equal(aclrtQueryEventWaitStatus(e, &ws), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(t), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(u), ACL_SUCCESS);
}

/* ---- aclrtCreateStreamWithConfig ---- */

static int thread_count(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    assert_non_null(f);
    char line[256];
    int n = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &n) == 1)
            break;
    fclose(f);
    return n;
}

/* The thread count once it equals `want`, or after 5 s: a joined thread can stay in the kernel's count
 * for a moment while it is reaped. */
static int thread_count_reaching(int want)
{
    int n = thread_count();
    for (int spin = 0; spin < 5000 && n != want; spin++) {
        host_sleep_ns(MS);
        n = thread_count();
    }
    return n;
}

/* The thread count once it held still for 50 ms (threads of earlier tests being reaped), at most 5 s. */
static int settled_thread_count(void)
{
    int n = thread_count();
    for (int still = 0, spin = 0; still < 50 && spin < 5000; spin++) {
        host_sleep_ns(MS);
        int now = thread_count();
        still = now == n ? still + 1 : 0;
        n = now;
    }
    return n;
}

static void test_create_stream_with_config_flags(void **state)
{
    (void)state;
    const uint32_t good[] = {0, ACL_STREAM_FAST_SYNC, ACL_STREAM_HUGE, ACL_STREAM_CPU_SCHEDULE,
                             ACL_STREAM_DEVICE_USE_ONLY, ACL_STREAM_FAST_SYNC | ACL_STREAM_HUGE | ACL_STREAM_CPU_SCHEDULE,
                             0x40, 0x80000000u /* bits CANN's ACL layer drops */};
    const uint32_t priorities[] = {0, 7, UINT32_MAX}; /* CANN clamps it: never refused */
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        aclrtStream s = NULL;
        assert_int_equal(aclrtCreateStreamWithConfig(&s, priorities[i % 3], good[i]), ACL_SUCCESS);
        void *d;
        assert_int_equal(aclrtMalloc(&d, 4096, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
        assert_int_equal(aclrtMemsetAsync(d, 4096, 7, 4096, s), ACL_SUCCESS);
        assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
        unsigned char b = 0;
        assert_int_equal(aclrtMemcpy(&b, 1, (char *)d + 4095, 1, ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
        assert_int_equal(b, 7);
        assert_int_equal(aclrtFree(d), ACL_SUCCESS);
        assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    }
    aclrtStream s = (aclrtStream)0x1;
    assert_int_equal(aclrtCreateStreamWithConfig(&s, 0, ACL_STREAM_DEVICE_USE_ONLY | ACL_STREAM_FAST_SYNC),
                     ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtCreateStreamWithConfig(&s, 0, ACL_STREAM_DEVICE_USE_ONLY | ACL_STREAM_FAST_LAUNCH),
                     ACL_ERROR_RT_PARAM_INVALID);
    /* its tasks wait for a model (aclmdlRI) to run them, which npualloc has not */
    assert_int_equal(aclrtCreateStreamWithConfig(&s, 0, ACL_STREAM_PERSISTENT), ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
    assert_int_equal(aclrtCreateStreamWithConfig(NULL, 0, 0), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(aclrtCreateStreamWithConfig(NULL, 0, ACL_STREAM_PERSISTENT), ACL_ERROR_INVALID_PARAM);
    assert_ptr_equal(s, (aclrtStream)0x1);
    size_t streams, events;
    stream_counts(&streams, &events);
    assert_int_equal(streams, 0);
}

static void test_fast_launch_starts_the_worker_at_creation(void **state)
{
    (void)state;
    int before = settled_thread_count();
    aclrtStream plain, fast;
    assert_int_equal(aclrtCreateStreamWithConfig(&plain, 0, 0), ACL_SUCCESS);
    assert_int_equal(thread_count(), before); /* a worker starts with the first task */
    assert_int_equal(aclrtCreateStreamWithConfig(&fast, 0, ACL_STREAM_FAST_LAUNCH | ACL_STREAM_FAST_SYNC), ACL_SUCCESS);
    assert_int_equal(thread_count(), before + 1);
    assert_int_equal(aclrtSynchronizeStream(fast), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(fast), ACL_SUCCESS);
    assert_int_equal(thread_count_reaching(before), before);
    assert_int_equal(aclrtDestroyStream(plain), ACL_SUCCESS);
}

/* ---- aclrtSynchronizeDeviceWithTimeout ---- */

static void test_synchronize_device_with_timeout(void **state)
{
    (void)state;
    static atomic_int gate;
    aclrtStream s = new_stream(), t = new_stream();
    npu_stream *ps, *pt;
    assert_int_equal(stream_acquire(s, &ps), ACL_SUCCESS);
    assert_int_equal(stream_acquire(t, &pt), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(-2), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(INT32_MIN), ACL_ERROR_RT_PARAM_INVALID);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(1), ACL_SUCCESS); /* idle */
    /* two failed tasks, one of them held back */
    assert_int_equal(stream_enqueue(pt, task_fail, (void *)(intptr_t)ACL_ERROR_RT_AICORE_OVER_FLOW, NULL, NULL),
                     ACL_SUCCESS);
    hold_stream(s, &gate);
    assert_int_equal(stream_enqueue(ps, task_fail, (void *)(intptr_t)ACL_ERROR_RT_DEVICE_MEM_ERROR, NULL, NULL),
                     ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(20), ACL_ERROR_RT_STREAM_SYNC_TIMEOUT);
    /* the timeout took no error: t's is still there */
    assert_int_equal(aclrtSynchronizeStream(t), ACL_ERROR_RT_AICORE_OVER_FLOW);
    assert_int_equal(stream_enqueue(pt, task_fail, (void *)(intptr_t)ACL_ERROR_RT_AICORE_OVER_FLOW, NULL, NULL),
                     ACL_SUCCESS);
    atomic_store(&gate, 1);
    aclError rc = aclrtSynchronizeDeviceWithTimeout(60000);
    assert_true(rc == ACL_ERROR_RT_DEVICE_MEM_ERROR || rc == ACL_ERROR_RT_AICORE_OVER_FLOW);
    /* both errors were taken, one returned */
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(60000), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeStream(t), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(-1), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(0), ACL_SUCCESS);
    stream_release(ps);
    stream_release(pt);
    assert_int_equal(aclrtDestroyStream(s), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyStream(t), ACL_SUCCESS);
}

/* Only the current device's streams count. */
static void test_synchronize_device_with_timeout_waits_for_the_current_device_only(void **state)
{
    (void)state;
    static atomic_int gate;
    assert_int_equal(aclrtSetDevice(1), ACL_SUCCESS);
    aclrtStream other = new_stream();
    hold_stream(other, &gate);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(10), ACL_ERROR_RT_STREAM_SYNC_TIMEOUT);
    assert_int_equal(aclrtSetDevice(0), ACL_SUCCESS);
    assert_int_equal(aclrtSynchronizeDeviceWithTimeout(10), ACL_SUCCESS);
    atomic_store(&gate, 1);
    assert_int_equal(aclrtDestroyStream(other), ACL_SUCCESS);
}

static void *no_context_calls(void *arg)
{
    int *bad = arg;
    aclrtStream s;
    aclrtEvent e;
    *bad += aclrtCreateStreamWithConfig(&s, 0, 0) != ACL_ERROR_RT_CONTEXT_NULL;
    *bad += aclrtSynchronizeDeviceWithTimeout(10) != ACL_ERROR_RT_CONTEXT_NULL;
    *bad += aclrtSynchronizeDeviceWithTimeout(-2) != ACL_ERROR_RT_PARAM_INVALID; /* the argument first */
    /* events belong to no device; a reset on the default stream needs one */
    *bad += aclrtCreateEventWithFlag(&e, ACL_EVENT_SYNC) != ACL_SUCCESS;
    *bad += aclrtResetEvent(e, NULL) != ACL_ERROR_RT_CONTEXT_NULL;
    *bad += aclrtDestroyEvent(e) != ACL_SUCCESS;
    return NULL;
}

static void test_calls_on_a_thread_without_a_current_device(void **state)
{
    (void)state;
    int bad = 0;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, no_context_calls, &bad), 0);
    pthread_join(th, NULL);
    assert_int_equal(bad, 0);
}

/* ---- threads ---- */

enum { RACERS = 4, ROUNDS = 300 };

typedef struct shared {
    aclrtEvent e;
    aclrtStream streams[RACERS];
    atomic_int wrong;
} shared;

static void *racer(void *p)
{
    shared *sh = p;
    static atomic_int next;
    int me = atomic_fetch_add(&next, 1) % RACERS;
    aclrtStream s = sh->streams[me];
    for (int i = 0; i < ROUNDS; i++) {
        aclrtEventRecordedStatus rs;
        aclrtEventWaitStatus ws;
        aclError rc[5] = {aclrtRecordEvent(sh->e, s), aclrtStreamWaitEvent(s, sh->e), aclrtResetEvent(sh->e, s),
                          aclrtQueryEventStatus(sh->e, &rs), aclrtQueryEventWaitStatus(sh->e, &ws)};
        for (int k = 0; k < 5; k++)
            if (rc[k] != ACL_SUCCESS)
                atomic_fetch_add(&sh->wrong, 1);
    }
    return NULL;
}

static void test_threads_record_wait_reset_and_query_one_event(void **state)
{
    (void)state;
    shared sh = {.e = flagged(ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE)};
    atomic_init(&sh.wrong, 0);
    for (int i = 0; i < RACERS; i++)
        sh.streams[i] = new_stream();
    pthread_t th[RACERS];
    for (int i = 0; i < RACERS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, racer, &sh), 0);
    for (int i = 0; i < RACERS; i++)
        pthread_join(th[i], NULL);
    assert_int_equal(atomic_load(&sh.wrong), 0);
    assert_int_equal(aclrtSynchronizeDevice(), ACL_SUCCESS);
    assert_int_equal(wait_status(sh.e), ACL_EVENT_WAIT_STATUS_COMPLETE);
    for (int i = 0; i < RACERS; i++)
        assert_int_equal(aclrtDestroyStream(sh.streams[i]), ACL_SUCCESS);
    assert_int_equal(aclrtDestroyEvent(sh.e), ACL_SUCCESS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_flag_and_status_values_are_canns, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_create_event_with_flag_takes_canns_flags_and_refuses_the_rest, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_create_event_ex_with_flag_takes_canns_flags_and_refuses_the_rest, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_event_without_sync_is_timed_but_never_waited_for_or_reset, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_device_use_only_event_is_refused_every_host_side_task, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(
            test_ex_event_is_complete_until_recorded_and_refuses_query_reset_and_wait_status, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_reset_takes_effect_when_its_stream_reaches_it, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_reset_leaves_a_record_made_after_it_was_queued, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_reset_of_a_record_still_pending_clears_it_and_its_late_stamp, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_reset_of_a_plain_event_and_bad_arguments, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_graph_captured_reset_is_freed_in_a_fork_child, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_graph_captured_reset_clears_the_record_current_at_each_launch, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_wait_status_is_not_ready_while_a_queued_wait_still_waits, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_create_stream_with_config_flags, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_fast_launch_starts_the_worker_at_creation, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_synchronize_device_with_timeout, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_synchronize_device_with_timeout_waits_for_the_current_device_only, setup,
                                        stop_runtime),
        cmocka_unit_test_setup_teardown(test_calls_on_a_thread_without_a_current_device, setup, stop_runtime),
        cmocka_unit_test_setup_teardown(test_threads_record_wait_reset_and_query_one_event, setup, stop_runtime),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
