/*
 * stream.c - streams (ordered task queues, one worker thread each) and events (recorded
 * stream positions).  See stream.h for the model.
 *
 * Lifetime.  Streams and events are reference counted and freed when the count reaches 0.
 *   A stream is referenced by: its handle-table or default-stream slot ("listed"), each event
 *   whose current record is on it, each queued stream-wait task that waits on it, and each
 *   pin taken by stream_acquire*() (pins are also counted on their own, see the fork child).
 *   An event is referenced by its table slot and by each queued record, reset and wait task for it.
 *   Invariant: the listing reference of a stream is dropped only after its worker has been
 *   joined, so a stream is never freed by, or while being used by, its own worker, and a
 *   stream whose count reached 0 has an empty queue and no thread.
 *
 * Locks, in acquisition order (never the other way round):
 *   event lock -> stream lock      (recording queues a task while the event is locked)
 *   table_lock -> sub_lock -> stream lock   (fork prepare; handing callbacks back)
 *   The event lock is never held with table_lock or sub_lock.  Nothing is held while a task
 *   or a callback runs, and a stream or event is never released with any of these locks held
 *   (freeing takes table_lock to leave the registry).
 *
 * Callback subscriptions (see stream.h).  A callback task decides where its callback runs when
 * the worker reaches it: on the worker (no subscriber), or as a "report" queued to the
 * subscribed thread (report_thread), which runs it inside aclrtProcessReport.  For a BLOCK
 * callback the worker then waits for the report to be DONE or handed back (RETURNED).
 * Reports not yet started are handed back to their stream's worker when the stream is
 * unsubscribed (explicitly, or by destroy/shutdown) and, for streams with a BLOCK report
 * pending, when the subscribed thread itself blocks in a stream wait.  Handed-back NO_BLOCK
 * reports go to the stream's `returned` list, which the worker runs before anything else.
 *   Invariant: a queued report's stream is subscribed, hence listed (a stream leaves its
 *   listing only after stream_close_reports()), so a queued report never outlives its
 *   stream.  A report being run pins its stream (a pin, so a fork child keeps it too).
 *   Callbacks of one stream never overlap, whichever thread runs the next one: before a
 *   worker runs a callback itself or hands it to another thread, it waits until no earlier one
 *   runs on a different thread, unless that thread is blocked in a stream wait (it may be
 *   waiting for this stream).  Unsubscribing (and destroy) also waits for the stream's
 *   callbacks running on other threads, like CANN's unsubscribe waits for a busy callback.
 *
 * A worker never waits for its own stream: synchronising a stream (or its device, or an event
 * on it) from one of its own tasks returns ACL_ERROR_RT_FEATURE_NOT_SUPPORT instead of
 * deadlocking, and stream_wait_position() returns at once.
 */
#include "stream.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "device.h"
#include "graph.h"
#include "handle_table.h"
#include "host.h"
#include "npualloc.h"

_Static_assert(sizeof(uintptr_t) >= sizeof(uint64_t), "stream and event handles are 64-bit values in pointers");

/* Returned when a task would wait for its own stream (it would wait forever). */
#define ERR_SELF_WAIT ACL_ERROR_RT_FEATURE_NOT_SUPPORT
/* Longest npualloc_sleep_async delay: keeps the nanosecond count far inside uint64_t. */
#define MAX_SLEEP_SECONDS 1e9

typedef struct cb_report cb_report;
typedef struct callback_task callback_task;
typedef struct report_thread report_thread;

typedef struct stream_task {
    struct stream_task *next;
    stream_task_fn fn;
    void *arg;
    stream_task_cleanup_fn cleanup;
    uint64_t position;
} stream_task;

struct npu_stream {
    /* Immutable after creation. */
    int32_t device;
    uint64_t handle;             /* 0 for a default stream */
    const device_context *owner; /* the explicit context it was made in (its destroy takes it), or NULL, */
    uint32_t owner_generation;   /* at this generation of its slot */
    bool context_default;        /* the owner's default stream: only the owner's destroy ends it */

    pthread_mutex_t lock;      /* guards the fields down to `worker` */
    pthread_cond_t work_cv;    /* the worker waits here for a task or for `stopping` */
    pthread_cond_t passed_cv;  /* waiters for a position wait here */
    stream_task *head, *tail;  /* tasks not yet started, in position order */
    uint64_t last;             /* position of the last task queued; completed <= last */
    aclError sticky;           /* first task failure since the last synchronize */
    unsigned waiters;          /* threads blocked on passed_cv */
    bool worker_started;       /* a worker thread exists and somebody must join it */
    bool stopping;             /* no task is accepted; the worker exits once drained */
    pthread_t worker;

    /* Stored by the worker (with `lock` held), loaded without the lock by stream_passed(). */
    _Atomic uint64_t completed;

    /* graph capture (graph.c): the graph its tasks are recorded into, NULL when they run. */
    _Atomic(void *) capture;

    atomic_uint refs; /* every reference, pins included */
    atomic_uint pins; /* the references taken by stream_acquire*() */

    /* Guarded by `lock`: callbacks handed back by the subscribed thread, not yet run; the
     * worker runs them before its next task. */
    cb_report *returned_head, *returned_tail;

    /* Guarded by sub_lock. */
    report_thread *subscriber; /* thread running this stream's callbacks, NULL: the worker */
    bool sub_closed;           /* destroyed (or shut down): cannot be subscribed any more */
    cb_report *running;        /* its callbacks running inside aclrtProcessReport now */
    atomic_uint cb_running;    /* how many: read without sub_lock by run_callback's fast path */

    /* Guarded by table_lock. */
    bool listed;                     /* in stream_table or default_streams[] (one reference) */
    npu_stream *reg_prev, *reg_next; /* registry of every stream object still allocated */
    npu_stream *doomed_next;         /* private list of stream_shutdown() */
};

typedef struct npu_event {
    pthread_mutex_t lock; /* guards the current record, down to `stamped` */
    npu_stream *stream;   /* stream of the current record (a reference); NULL: never recorded */
    uint64_t position;    /* position of the current record on `stream` */
    uint64_t seq;         /* number of records so far: identifies the current one */
    uint64_t time_ns;     /* host_now_ns() when the worker passed the current record */
    bool stamped;         /* time_ns belongs to the current record */

    /* Immutable after creation: 0 for aclrtCreateEvent, else the ACL_EVENT_* bits it was created with;
     * `ex` for aclrtCreateEventExWithFlag (CANN's "new mode" event, refused by some calls). */
    uint32_t flags;
    bool ex;
    /* Stream-wait tasks queued on this event that have not finished waiting (aclrtQueryEventWaitStatus). */
    atomic_uint pending_waits;

    atomic_uint refs; /* the listing one and one per queued record, reset or wait task */

    /* Guarded by table_lock. */
    bool listed; /* in event_table (one reference) */
    struct npu_event *reg_prev, *reg_next;
    struct npu_event *doomed_next;
} npu_event;

/* A record or reset task (run_record, run_reset): its event and the record count it is for. */
typedef struct event_task {
    npu_event *event; /* a reference */
    uint64_t seq;
    unsigned forks; /* forks_since_start when made */
} event_task;

/* A reset task's seq: a graph queues a captured reset again at every launch, long after it was made, to
 * clear whatever record is current then.  No record count: the counts go up from 0, one per record. */
#define RESET_CAPTURED UINT64_MAX

/* The module lock: guards both handle tables, default_streams and both registries. */
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static handle_table stream_table = {.tag = 'S'};
static handle_table event_table = {.tag = 'E'};
static npu_stream *default_streams[NPU_MAX_DEVICES];
/* Every allocated object, listed or not: fork and shutdown must reach all of them. */
static npu_stream *stream_registry;
static npu_event *event_registry;
/* The forks this process is a child of (written only by stream_atfork_child, while the child has one
 * thread).  A record, reset or wait task made before the fork that outlives it (one a graph captured,
 * graph.c, is freed when the graph is) names objects the child freed or recounted: its cleanup frees
 * only its argument, as stream_drop_tasks does. */
static unsigned forks_since_start;

/* The stream whose worker is the calling thread, NULL on other threads. */
static _Thread_local npu_stream *tl_worker;
/* The callbacks the calling thread is running inside aclrtProcessReport (innermost first): a callback
 * may process reports too, so several may be running at once, one inside another. */
typedef struct run_frame {
    npu_stream *stream;
    report_thread *rt; /* the calling thread's, maybe retired meanwhile */
    bool block;        /* a BLOCK callback: its stream's worker waits for it */
    struct run_frame *up;
} run_frame;
static _Thread_local run_frame *tl_running;

/* Does the calling thread run a BLOCK callback of s (s NULL: of any stream of `device`), at any depth?
 * Then it stands in for that stream's worker, which waits for it. */
static bool runs_block_callback(const npu_stream *s, int32_t device)
{
    for (const run_frame *f = tl_running; f; f = f->up)
        if (f->block && (s ? f->stream == s : f->stream->device == device))
            return true;
    return false;
}

/* True when waiting for s from this thread would wait for the caller itself. */
bool stream_waits_for_self(const npu_stream *s) { return s && (tl_worker == s || runs_block_callback(s, -1)); }

/* ------------------------------------------------------------------------------------------
 * Subscription state (the functions are further down, with the callback API)
 * ------------------------------------------------------------------------------------------ */

typedef enum report_state { REPORT_QUEUED, REPORT_RUNNING, REPORT_DONE, REPORT_RETURNED } report_state;

/* One callback handed to a subscribed thread. */
struct cb_report {
    cb_report *next;     /* in a report_thread queue or a stream's returned list */
    cb_report *run_next; /* in its stream's running list */
    report_thread *runner; /* while RUNNING: the thread running it */
    aclrtCallback fn;
    void *user_data;
    void (*release)(void *); /* runs right after fn (an uncaptured npualloc_launch_host_func) */
    /* A graph's NO_BLOCK host node, for which this report holds a reference: the launch counts as passed
     * once the report is handed over, so the graph may go (and release the node's data) before it ran. */
    callback_task *node;
    npu_stream *stream; /* not a reference: see the invariant at the top */
    bool block;
    report_state state; /* sub_lock */
};

/* A thread named by aclrtSubscribeReport (it need not exist until it calls ProcessReport). */
struct report_thread {
    report_thread *next; /* in report_threads */
    uint64_t tid;
    int32_t device;    /* the device of its streams (CANN: one device per thread) */
    unsigned nstreams; /* streams it is subscribed to; 0 = retired */
    unsigned users;    /* ProcessReport calls and stream waits of the thread in progress */
    unsigned waiting;  /* stream waits of the thread in progress: BLOCK callbacks bypass it */
    bool dead;         /* retired (no subscription left); freed by its last user */
    cb_report *head, *tail;
    size_t queued;
    pthread_cond_t cv; /* CLOCK_MONOTONIC, with sub_lock: ProcessReport waits here */
};

static pthread_mutex_t sub_lock = PTHREAD_MUTEX_INITIALIZER;
/* With sub_lock: workers wait here for their BLOCK report to be done or handed back. */
static pthread_cond_t report_done_cv = PTHREAD_COND_INITIALIZER;
static report_thread *report_threads; /* the live (not retired) ones */
/* Number of subscribed streams: lets callbacks and waits skip sub_lock when there are none. */
static atomic_uint subscribed_streams;

/* Runs a callback; `release`, when given, hands back its data (the callback runs only once). */
static void callback_run(aclrtCallback fn, void *user_data, void (*release)(void *))
{
    fn(user_data);
    if (release)
        release(user_data);
}

static void callback_task_put(callback_task *c);

/* Frees a report that ran (no lock held: the node's release may run here). */
static void report_free(cb_report *r)
{
    if (r->node)
        callback_task_put(r->node);
    free(r);
}

static void run_report_list(cb_report *r)
{
    while (r) {
        cb_report *next = r->next;
        callback_run(r->fn, r->user_data, r->release);
        report_free(r);
        r = next;
    }
}

static void free_report_list(cb_report *r)
{
    while (r) {
        cb_report *next = r->next;
        free(r);
        r = next;
    }
}

static uint64_t self_tid(void) { return (uint64_t)(uintptr_t)pthread_self(); }

static report_thread *report_thread_find_locked(uint64_t tid)
{
    for (report_thread *rt = report_threads; rt; rt = rt->next)
        if (rt->tid == tid)
            return rt;
    return NULL;
}

static void report_thread_free(report_thread *rt)
{
    pthread_cond_destroy(&rt->cv);
    free(rt);
}

/* Hands every queued (not started) report of stream s back to its worker, keeping their
 * order: NO_BLOCK ones go to the stream's returned list, the BLOCK one (there is at most one:
 * its worker is waiting for it) is marked RETURNED so its waiting worker runs it, after the
 * returned list.  sub_lock held. */
static void reclaim_stream_locked(report_thread *rt, npu_stream *s)
{
    cb_report *back = NULL, *back_last = NULL, *kept_last = NULL;
    bool block_returned = false;
    for (cb_report **pp = &rt->head; *pp;) {
        cb_report *r = *pp;
        if (r->stream != s) {
            kept_last = r;
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        rt->queued--;
        r->next = NULL;
        if (r->block) {
            r->state = REPORT_RETURNED;
            block_returned = true;
        } else {
            if (back_last)
                back_last->next = r;
            else
                back = r;
            back_last = r;
        }
    }
    rt->tail = kept_last;
    if (back) {
        pthread_mutex_lock(&s->lock);
        if (s->returned_tail)
            s->returned_tail->next = back;
        else
            s->returned_head = back;
        s->returned_tail = back_last;
        pthread_cond_signal(&s->work_cv);
        pthread_mutex_unlock(&s->lock);
    }
    if (block_returned)
        pthread_cond_broadcast(&report_done_cv);
}

/* Ends the subscription of s (sub_lock held; s is subscribed).  Returns the subscriber when it
 * was retired and nobody uses it any more: the caller frees it after unlocking. */
static report_thread *unsubscribe_locked(npu_stream *s)
{
    report_thread *rt = s->subscriber;
    reclaim_stream_locked(rt, s);
    s->subscriber = NULL;
    atomic_fetch_sub_explicit(&subscribed_streams, 1, memory_order_release);
    pthread_cond_broadcast(&report_done_cv); /* a worker may wait with an old target */
    if (--rt->nstreams > 0)
        return NULL;
    for (report_thread **pp = &report_threads; *pp; pp = &(*pp)->next) {
        if (*pp == rt) {
            *pp = rt->next;
            break;
        }
    }
    rt->dead = true;
    pthread_cond_broadcast(&rt->cv); /* a ProcessReport waiting for it returns */
    return rt->users == 0 ? rt : NULL;
}

static void wait_running_locked(npu_stream *s);

/* Destroy and shutdown: ends the stream's subscription (its pending callbacks go back to the
 * worker, which runs them while draining) and refuses new ones.  Called before the stream
 * is stopped, so destroy never waits for a thread that stopped calling ProcessReport. */
static void stream_close_reports(npu_stream *s)
{
    pthread_mutex_lock(&sub_lock);
    s->sub_closed = true;
    report_thread *gone = s->subscriber ? unsubscribe_locked(s) : NULL;
    wait_running_locked(s);
    pthread_mutex_unlock(&sub_lock);
    if (gone)
        report_thread_free(gone);
}

/* Called before the calling thread blocks waiting for a stream.  If the thread is subscribed,
 * it cannot run callbacks while it waits, so every stream whose worker waits for one of its
 * BLOCK callbacks gets its pending callbacks back, and until report_wait_end() new BLOCK
 * callbacks run on their workers (NO_BLOCK ones still queue up for it).  The report_threads so
 * marked (pinned) are returned for report_wait_end. */
static bool report_wait_may_matter(void)
{
    return tl_running || atomic_load_explicit(&subscribed_streams, memory_order_relaxed) != 0;
}

typedef struct report_waiter {
    report_thread *rt[2]; /* rt[1] only beside rt[0]: rt[0] is NULL when nothing was marked */
} report_waiter;

static void mark_waiting_locked(report_thread *rt)
{
    rt->users++;
    rt->waiting++;
    pthread_cond_broadcast(&report_done_cv); /* workers need not wait for its callbacks now */
    for (;;) {
        cb_report *r = rt->head;
        while (r && !r->block)
            r = r->next;
        if (!r)
            break;
        reclaim_stream_locked(rt, r->stream);
    }
}

static report_waiter report_wait_begin(void)
{
    report_waiter w = {{NULL, NULL}};
    if (!report_wait_may_matter())
        return w;
    pthread_mutex_lock(&sub_lock);
    /* Inside a callback the thread's own (even if retired meanwhile: workers may wait for the
     * callback it is running), and the one it is subscribed by now if the callback subscribed
     * it again (its BLOCK callbacks would wait for this thread too); otherwise by id. */
    report_thread *running = tl_running ? tl_running->rt : NULL, *live = report_thread_find_locked(self_tid());
    w.rt[0] = running ? running : live;
    w.rt[1] = running && live != running ? live : NULL;
    for (int i = 0; i < 2; i++)
        if (w.rt[i])
            mark_waiting_locked(w.rt[i]);
    pthread_mutex_unlock(&sub_lock);
    return w;
}

static void report_wait_end(report_waiter w)
{
    if (!w.rt[0])
        return;
    bool gone[2] = {false, false};
    pthread_mutex_lock(&sub_lock);
    for (int i = 0; i < 2 && w.rt[i]; i++) {
        w.rt[i]->waiting--;
        gone[i] = --w.rt[i]->users == 0 && w.rt[i]->dead;
    }
    pthread_mutex_unlock(&sub_lock);
    for (int i = 0; i < 2; i++)
        if (gone[i])
            report_thread_free(w.rt[i]);
}

/* How many of s's running callbacks are the calling thread's own (they cannot be waited for). */
static unsigned own_running(const npu_stream *s)
{
    unsigned n = 0;
    for (const run_frame *f = tl_running; f; f = f->up)
        n += f->stream == s;
    return n;
}

/* Waits until no callback of s runs on another thread (sub_lock held; it is dropped while
 * waiting).  The caller holds a reference to s. */
static void wait_running_locked(npu_stream *s)
{
    if (atomic_load(&s->cb_running) <= own_running(s))
        return;
    pthread_mutex_unlock(&sub_lock);
    report_waiter me = report_wait_begin(); /* the running callback may wait for our stream */
    pthread_mutex_lock(&sub_lock);
    while (atomic_load(&s->cb_running) > own_running(s))
        pthread_cond_wait(&report_done_cv, &sub_lock);
    pthread_mutex_unlock(&sub_lock);
    report_wait_end(me);
    pthread_mutex_lock(&sub_lock);
}

/* Must the worker of s wait before the next callback of s runs on `target` (NULL: the worker)?
 * Yes while an earlier one runs on another thread that is not blocked in a stream wait.
 * sub_lock held. */
static bool running_elsewhere_locked(const npu_stream *s, const report_thread *target)
{
    for (const cb_report *r = s->running; r; r = r->run_next)
        if (r->runner != target && r->runner->waiting == 0)
            return true;
    return false;
}

/* On the worker of s: runs the callbacks handed back to it, once no earlier callback of s
 * still runs elsewhere.  No lock held. */
static void run_returned(npu_stream *s)
{
    pthread_mutex_lock(&s->lock);
    bool any = s->returned_head != NULL;
    pthread_mutex_unlock(&s->lock);
    if (!any)
        return;
    pthread_mutex_lock(&sub_lock);
    while (running_elsewhere_locked(s, NULL))
        pthread_cond_wait(&report_done_cv, &sub_lock);
    pthread_mutex_unlock(&sub_lock);
    pthread_mutex_lock(&s->lock);
    cb_report *r = s->returned_head;
    s->returned_head = s->returned_tail = NULL;
    pthread_mutex_unlock(&s->lock);
    run_report_list(r);
}

static uint64_t handle_value(const void *handle) { return (uint64_t)(uintptr_t)handle; }

/* ------------------------------------------------------------------------------------------
 * Registries (table_lock held)
 * ------------------------------------------------------------------------------------------ */

static void stream_registry_add(npu_stream *s)
{
    s->reg_prev = NULL;
    s->reg_next = stream_registry;
    if (stream_registry)
        stream_registry->reg_prev = s;
    stream_registry = s;
}

static void stream_registry_remove(npu_stream *s)
{
    if (s->reg_prev)
        s->reg_prev->reg_next = s->reg_next;
    else
        stream_registry = s->reg_next;
    if (s->reg_next)
        s->reg_next->reg_prev = s->reg_prev;
}

static void event_registry_add(npu_event *e)
{
    e->reg_prev = NULL;
    e->reg_next = event_registry;
    if (event_registry)
        event_registry->reg_prev = e;
    event_registry = e;
}

static void event_registry_remove(npu_event *e)
{
    if (e->reg_prev)
        e->reg_prev->reg_next = e->reg_next;
    else
        event_registry = e->reg_next;
    if (e->reg_next)
        e->reg_next->reg_prev = e->reg_prev;
}

/* ------------------------------------------------------------------------------------------
 * Stream objects
 * ------------------------------------------------------------------------------------------ */

/* A condition variable timed against CLOCK_MONOTONIC (the clock of deadline_after_ms). */
static int monotonic_cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0)
        return -1;
    int rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0 && pthread_cond_init(cv, &attr) == 0 ? 0 : -1;
    pthread_condattr_destroy(&attr);
    return rc;
}

/* The CLOCK_MONOTONIC time `ms` (> 0) milliseconds from now. */
static struct timespec deadline_after_ms(int32_t ms)
{
    uint64_t ns = host_now_ns() + (uint64_t)ms * 1000000u;
    return (struct timespec){.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
}

static int stream_sync_init(npu_stream *s)
{
    if (pthread_mutex_init(&s->lock, NULL) != 0)
        return -1;
    if (pthread_cond_init(&s->work_cv, NULL) != 0) {
        pthread_mutex_destroy(&s->lock);
        return -1;
    }
    if (monotonic_cond_init(&s->passed_cv) != 0) {
        pthread_cond_destroy(&s->work_cv);
        pthread_mutex_destroy(&s->lock);
        return -1;
    }
    return 0;
}

/* A new stream holding one reference (the listing one the caller is about to store). */
static npu_stream *stream_new(int32_t device)
{
    npu_stream *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    if (stream_sync_init(s) != 0) {
        free(s);
        return NULL;
    }
    s->device = device;
    atomic_init(&s->completed, 0);
    atomic_init(&s->cb_running, 0);
    atomic_init(&s->refs, 1);
    atomic_init(&s->pins, 0);
    return s;
}

/* Frees the queued tasks without running them or their cleanups (fork child only). The
 * arguments of this module's own tasks and of tasks whose cleanup is plain free() are freed;
 * any other argument is leaked, because its cleanup may take locks the child cannot own. */
static void event_task_free(void *arg);
static void wait_cleanup(void *arg);
static void callback_task_free(void *arg);
static void stream_drop_tasks(npu_stream *s)
{
    stream_task *t = s->head;
    while (t) {
        stream_task *next = t->next;
        if (t->cleanup == free || t->cleanup == event_task_free || t->cleanup == wait_cleanup ||
            t->cleanup == callback_task_free) /* (queued, so uncaptured: its cleanup only frees it) */
            free(t->arg);
        free(t);
        t = next;
    }
    s->head = s->tail = NULL;
    free_report_list(s->returned_head); /* their callbacks are not run either */
    s->returned_head = s->returned_tail = NULL;
}

/* Releases the memory of a stream nobody references (already out of the registry). */
static void stream_free(npu_stream *s)
{
    stream_drop_tasks(s); /* empty by the invariant; kept so a broken invariant cannot leak */
    pthread_cond_destroy(&s->passed_cv);
    pthread_cond_destroy(&s->work_cv);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

/* Takes one more reference; the caller must already hold one. */
static void stream_retain(npu_stream *s) { atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed); }

/* Takes a reference on a stream found in the registry (table_lock held), unless its last one
 * is being dropped: then stream_put is about to free it. */
static bool stream_try_retain(npu_stream *s)
{
    unsigned n = atomic_load_explicit(&s->refs, memory_order_relaxed);
    while (n != 0)
        if (atomic_compare_exchange_weak_explicit(&s->refs, &n, n + 1, memory_order_relaxed, memory_order_relaxed))
            return true;
    return false;
}

/* Drops a reference; the last one frees the stream.  No lock of this module may be held. */
static void stream_put(npu_stream *s)
{
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1)
        return;
    pthread_mutex_lock(&table_lock);
    stream_registry_remove(s);
    pthread_mutex_unlock(&table_lock);
    stream_free(s);
}

/* The default stream of a valid device, created on first use; returns it referenced. */
static aclError default_stream_get(int32_t device, npu_stream **out)
{
    if (!device_valid(device))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    aclError rc = ACL_SUCCESS;
    pthread_mutex_lock(&table_lock);
    npu_stream *s = default_streams[device];
    if (!s) {
        s = stream_new(device);
        if (s) {
            s->listed = true;
            stream_registry_add(s);
            default_streams[device] = s;
        } else {
            rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
        }
    }
    if (s)
        stream_retain(s);
    pthread_mutex_unlock(&table_lock);
    *out = s;
    return rc;
}

/* Resolves a handle (NULL: the current context's default stream) to a referenced stream. */
static aclError stream_lookup(aclrtStream handle, npu_stream **out)
{
    uint64_t context_stream = 0;
    if (!handle) {
        int32_t dev;
        aclError rc = device_current_stream(&dev, &context_stream);
        if (rc != ACL_SUCCESS || !context_stream)
            return rc == ACL_SUCCESS ? default_stream_get(dev, out) : rc;
    }
    pthread_mutex_lock(&table_lock);
    npu_stream *s = handle_table_get(&stream_table, handle ? handle_value(handle) : context_stream);
    if (s)
        stream_retain(s); /* listed, so the count is at least 1 */
    pthread_mutex_unlock(&table_lock);
    if (!s) /* for a context's default stream: the context was destroyed meanwhile */
        return handle ? ACL_ERROR_INVALID_PARAM : ACL_ERROR_RT_CONTEXT_NULL;
    *out = s;
    return ACL_SUCCESS;
}

aclError stream_acquire(aclrtStream handle, npu_stream **out)
{
    if (!out)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = stream_lookup(handle, out);
    if (rc == ACL_SUCCESS)
        atomic_fetch_add_explicit(&(*out)->pins, 1, memory_order_relaxed);
    return rc;
}

aclError stream_acquire_default(int32_t device, npu_stream **out)
{
    if (!out)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = default_stream_get(device, out);
    if (rc == ACL_SUCCESS)
        atomic_fetch_add_explicit(&(*out)->pins, 1, memory_order_relaxed);
    return rc;
}

/* Its own tag: no table hands out handles with it, so a default-stream id is never a live handle. */
#define DEFAULT_STREAM_ID_TAG 'd'

uint64_t stream_default_id(int32_t device)
{
    return device_valid(device) ? handle_make(DEFAULT_STREAM_ID_TAG, 0, (uint32_t)device) : 0;
}

/* A default-stream id's device, or `device` for 0; false for any other id. */
static bool default_stream_of_id(int32_t device, uint64_t id, int32_t *out)
{
    if (id == 0) {
        *out = device;
        return true;
    }
    if (handle_tag(id) != DEFAULT_STREAM_ID_TAG)
        return false;
    *out = (int32_t)handle_index1(id) - 1;
    return true;
}

aclError stream_acquire_id(int32_t device, uint64_t id, npu_stream **out)
{
    int32_t dev;
    if (default_stream_of_id(device, id, &dev))
        return stream_acquire_default(dev, out);
    return stream_acquire((aclrtStream)(uintptr_t)id, out);
}

aclError stream_acquire_for_wait(int32_t device, uint64_t id, npu_stream **out)
{
    if (!out)
        return ACL_ERROR_INVALID_PARAM;
    int32_t dev;
    if (default_stream_of_id(device, id, &dev))
        return stream_acquire_default(dev, out);
    pthread_mutex_lock(&table_lock);
    npu_stream *s = handle_table_get(&stream_table, id);
    if (s) {
        stream_retain(s);
    } else {
        /* Destroyed: aclrtDestroyStream keeps the object registered until its worker drained,
         * and handles are never reused, so the registry still names it by its old handle. */
        for (s = stream_registry; s; s = s->reg_next)
            if (s->handle == id)
                break;
        if (s && !stream_try_retain(s))
            s = NULL; /* its last reference is being dropped: its work has all run */
    }
    pthread_mutex_unlock(&table_lock);
    if (!s)
        return ACL_ERROR_INVALID_PARAM;
    atomic_fetch_add_explicit(&s->pins, 1, memory_order_relaxed);
    *out = s;
    return ACL_SUCCESS;
}

void stream_release(npu_stream *s)
{
    if (!s)
        return;
    atomic_fetch_sub_explicit(&s->pins, 1, memory_order_relaxed);
    stream_put(s);
}

int32_t stream_device(const npu_stream *s) { return s ? s->device : -1; }

uint64_t stream_id(const npu_stream *s) { return s ? s->handle : 0; }

/* ------------------------------------------------------------------------------------------
 * The worker and the queue
 * ------------------------------------------------------------------------------------------ */

/* Runs the tasks in position order until the stream stops and its queue is empty. */
static void *worker_main(void *arg)
{
    npu_stream *s = arg;
    tl_worker = s;
    pthread_setname_np(pthread_self(), "npu-stream");
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (!s->head && !s->returned_head && !s->stopping)
            pthread_cond_wait(&s->work_cv, &s->lock);
        if (s->returned_head) {
            /* Callbacks the subscribed thread gave back: they come before any later task. */
            pthread_mutex_unlock(&s->lock);
            run_returned(s);
            pthread_mutex_lock(&s->lock);
            continue;
        }
        stream_task *t = s->head;
        if (!t)
            break; /* stopping, and every queued task has run */
        s->head = t->next;
        if (!s->head)
            s->tail = NULL;
        pthread_mutex_unlock(&s->lock);

        aclError rc = t->fn(t->arg);
        /* The cleanup runs before the position is passed, so a synchronize that returns
         * has seen the whole task, cleanup included. */
        if (t->cleanup)
            t->cleanup(t->arg);
        uint64_t position = t->position;
        free(t);

        pthread_mutex_lock(&s->lock);
        if (rc != ACL_SUCCESS && s->sticky == ACL_SUCCESS)
            s->sticky = rc;
        atomic_store_explicit(&s->completed, position, memory_order_release);
        if (s->waiters)
            pthread_cond_broadcast(&s->passed_cv);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

/* Starts the worker if the stream has none yet (s->lock held).  The worker blocks the
 * asynchronous signals so they reach the application's threads; fault signals stay
 * unblocked so a crashing task is still reported (a blocked SIGSEGV kills silently). */
static aclError ensure_worker_locked(npu_stream *s)
{
    if (s->worker_started)
        return ACL_SUCCESS;
    static const int fault_signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS};
    sigset_t mask, old;
    sigfillset(&mask);
    for (size_t i = 0; i < ARRAY_LEN(fault_signals); i++)
        sigdelset(&mask, fault_signals[i]);
    pthread_sigmask(SIG_SETMASK, &mask, &old);
    int err = pthread_create(&s->worker, NULL, worker_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0)
        return ACL_ERROR_RT_RESOURCE_ALLOC_FAIL;
    s->worker_started = true;
    return ACL_SUCCESS;
}

struct callback_task {
    /* The stream task's or the graph node's, and one per report of the node still to run (cb_report.node). */
    atomic_uint refs;
    aclrtCallback fn;
    void *user_data;
    /* npualloc_launch_host_func's destroy: right after the one run of an uncaptured callback, or
     * when the graph that captured it frees it. */
    void (*release)(void *);
    aclrtCallback once; /* if set, the one run of an uncaptured callback, in place of fn and release */
    bool block;
    /* A graph node: set before the node is visible to any launch, so its runs read it unlocked. */
    bool captured;
};

static aclError run_callback(void *arg);
static aclError run_sleep(void *arg);
static aclError run_reset(void *arg);

void *stream_capture_get(const npu_stream *s)
{
    return atomic_load_explicit(&((npu_stream *)s)->capture, memory_order_acquire);
}

/* Under the stream's lock, which stream_enqueue_uncaptured holds while it checks and queues. */
void stream_capture_set(npu_stream *s, void *capture)
{
    pthread_mutex_lock(&s->lock);
    atomic_store_explicit(&s->capture, capture, memory_order_release);
    pthread_mutex_unlock(&s->lock);
}

void stream_pin(npu_stream *s)
{
    if (!s)
        return; /* as stream_release */
    stream_retain(s);
    atomic_fetch_add_explicit(&s->pins, 1, memory_order_relaxed);
}

/* graph capture: the task becomes a node of the capturing graph (graph.c), which owns `arg`. */
static bool capture_task(npu_stream *s, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                         uint64_t *position, aclError *rc)
{
    bool host = fn == run_callback;
    int kind = host ? GRAPH_TASK_HOST : fn == run_sleep ? GRAPH_TASK_DELAY : GRAPH_TASK_GENERIC;
    /* Whether a callback's data is released after a run, and whether a reset clears whatever record is
     * current when it runs (RESET_CAPTURED), are decided here, with the capture, and not by a caller's
     * earlier look at the stream (a capture may begin or end in between). */
    event_task *reset = fn == run_reset ? arg : NULL;
    uint64_t seq = reset ? reset->seq : 0;
    if (host)
        ((callback_task *)arg)->captured = true;
    if (reset)
        reset->seq = RESET_CAPTURED;
    if (!graph_capture_task(s, kind, fn, arg, cleanup, rc)) {
        if (host)
            ((callback_task *)arg)->captured = false; /* nobody saw it */
        if (reset)
            reset->seq = seq;
        return false; /* the capture ended meanwhile */
    }
    if (position)
        *position = stream_last_position(s);
    return true;
}

/* stream_enqueue, and with `capturable` false stream_enqueue_plain. */
static aclError enqueue(npu_stream *s, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                        uint64_t *position, bool capturable)
{
    if (!s || !fn)
        return ACL_ERROR_INVALID_PARAM;
    aclError crc;
    if (capturable && unlikely(atomic_load_explicit(&s->capture, memory_order_relaxed) != NULL) &&
        capture_task(s, fn, arg, cleanup, position, &crc))
        return crc;
    stream_task *t = malloc(sizeof *t);
    if (!t)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *t = (stream_task){.fn = fn, .arg = arg, .cleanup = cleanup};
    pthread_mutex_lock(&s->lock);
    /* A stopping stream was destroyed: to the caller its handle is no longer live. */
    aclError rc = s->stopping ? ACL_ERROR_INVALID_PARAM : ensure_worker_locked(s);
    if (rc == ACL_SUCCESS) {
        t->position = ++s->last;
        if (s->tail)
            s->tail->next = t;
        else
            s->head = t;
        s->tail = t;
        if (position)
            *position = t->position;
        pthread_cond_signal(&s->work_cv);
    }
    pthread_mutex_unlock(&s->lock);
    if (rc != ACL_SUCCESS)
        free(t);
    return rc;
}

aclError stream_enqueue(npu_stream *s, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                        uint64_t *position)
{
    return enqueue(s, fn, arg, cleanup, position, true);
}

aclError stream_enqueue_plain(npu_stream *s, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                              uint64_t *position)
{
    return enqueue(s, fn, arg, cleanup, position, false);
}

/* Frees task structs never queued (their arguments stay the caller's). */
static void free_task_list(stream_task *t)
{
    while (t) {
        stream_task *next = t->next;
        free(t);
        t = next;
    }
}

aclError stream_enqueue_uncaptured(npu_stream *s, const stream_task_fn *fns, void *const *args, size_t n,
                                   uint64_t *last_position)
{
    if (!s)
        return ACL_ERROR_INVALID_PARAM;
    stream_task *first = NULL, **link = &first;
    for (size_t i = 0; i < n; i++, link = &(*link)->next) {
        if (!fns[i] || !(*link = malloc(sizeof **link))) {
            aclError rc = fns[i] ? ACL_ERROR_RT_MEMORY_ALLOCATION : ACL_ERROR_INVALID_PARAM;
            free_task_list(first);
            return rc;
        }
        **link = (stream_task){.fn = fns[i], .arg = args[i]};
    }
    pthread_mutex_lock(&s->lock);
    aclError rc = atomic_load_explicit(&s->capture, memory_order_relaxed) ? ACL_ERROR_RT_FEATURE_NOT_SUPPORT
                  : s->stopping                                           ? ACL_ERROR_INVALID_PARAM
                                                                          : ensure_worker_locked(s);
    if (rc == ACL_SUCCESS && first) {
        for (stream_task *t = first; t; t = t->next)
            t->position = ++s->last;
        if (s->tail)
            s->tail->next = first;
        else
            s->head = first;
        for (s->tail = first; s->tail->next; s->tail = s->tail->next) {
        }
        pthread_cond_signal(&s->work_cv);
    }
    if (rc == ACL_SUCCESS && last_position)
        *last_position = s->last;
    pthread_mutex_unlock(&s->lock);
    if (rc != ACL_SUCCESS)
        free_task_list(first);
    return rc;
}

uint64_t stream_last_position(npu_stream *s)
{
    if (!s)
        return 0;
    pthread_mutex_lock(&s->lock);
    uint64_t last = s->last;
    pthread_mutex_unlock(&s->lock);
    return last;
}

/* Everything queued so far has run. */
static bool stream_idle(npu_stream *s) { return stream_passed(s, stream_last_position(s)); }

unsigned stream_waiter_count(npu_stream *s)
{
    pthread_mutex_lock(&s->lock);
    unsigned n = s->waiters;
    pthread_mutex_unlock(&s->lock);
    return n;
}

bool stream_passed(const npu_stream *s, uint64_t position)
{
    return !s || atomic_load_explicit(&s->completed, memory_order_acquire) >= position;
}

/* Blocks until `position` has passed (s->lock held; position <= s->last), or until `deadline`
 * (CLOCK_MONOTONIC; NULL: none) passed first: then returns false.  May drop and retake s->lock
 * (sub_lock comes first) to hand a subscribed caller's callbacks back. */
static bool wait_passed_locked(npu_stream *s, uint64_t position, const struct timespec *deadline)
{
    if (atomic_load_explicit(&s->completed, memory_order_relaxed) >= position)
        return true;
    report_waiter rt = {{NULL, NULL}};
    if (report_wait_may_matter()) {
        pthread_mutex_unlock(&s->lock);
        rt = report_wait_begin();
        pthread_mutex_lock(&s->lock);
    }
    s->waiters++;
    bool passed = true;
    while (passed && atomic_load_explicit(&s->completed, memory_order_relaxed) < position) {
        if (!deadline)
            pthread_cond_wait(&s->passed_cv, &s->lock);
        else if (pthread_cond_timedwait(&s->passed_cv, &s->lock, deadline) == ETIMEDOUT)
            passed = atomic_load_explicit(&s->completed, memory_order_relaxed) >= position;
    }
    s->waiters--;
    if (rt.rt[0]) {
        pthread_mutex_unlock(&s->lock);
        report_wait_end(rt);
        pthread_mutex_lock(&s->lock);
    }
    return passed;
}

/* stream_wait_position with a deadline (NULL: none); false when it came first. */
static bool wait_position_until(npu_stream *s, uint64_t position, const struct timespec *deadline)
{
    /* The worker cannot wait for itself: any position not yet passed is at or behind the
     * task it is running. */
    if (!s || stream_passed(s, position) || stream_waits_for_self(s))
        return true;
    pthread_mutex_lock(&s->lock);
    if (position > s->last)
        position = s->last; /* a position never queued would never pass */
    bool passed = wait_passed_locked(s, position, deadline);
    pthread_mutex_unlock(&s->lock);
    return passed;
}

void stream_wait_position(npu_stream *s, uint64_t position) { (void)wait_position_until(s, position, NULL); }

/* Waits for everything queued on s so far; with take_error, returns and clears its sticky error
 * (a synchronize), otherwise leaves it for the next synchronize.  A deadline (CLOCK_MONOTONIC;
 * NULL: none) that comes first returns ACL_ERROR_RT_STREAM_SYNC_TIMEOUT and leaves the error. */
static aclError stream_drain(npu_stream *s, bool take_error, const struct timespec *deadline)
{
    if (!s)
        return ACL_ERROR_INVALID_PARAM;
    if (stream_waits_for_self(s))
        return ERR_SELF_WAIT;
    pthread_mutex_lock(&s->lock);
    aclError rc = ACL_SUCCESS;
    if (!wait_passed_locked(s, s->last, deadline)) {
        rc = ACL_ERROR_RT_STREAM_SYNC_TIMEOUT;
    } else if (take_error) {
        rc = s->sticky;
        s->sticky = ACL_SUCCESS;
    }
    pthread_mutex_unlock(&s->lock);
    return rc;
}

aclError stream_synchronize(npu_stream *s) { return stream_drain(s, true, NULL); }

typedef struct device_stream {
    npu_stream *s; /* a reference */
    bool listed;   /* false: destroyed, maybe still running the work queued before its destroy */
} device_stream;

/* References every stream of a device into a new array (caller frees it): the listed ones and
 * the destroyed ones still allocated, whose workers may still be draining. */
static aclError device_streams(int32_t device, device_stream **out, size_t *count)
{
    pthread_mutex_lock(&table_lock);
    size_t n = 0;
    for (npu_stream *s = stream_registry; s; s = s->reg_next)
        n += s->device == device;
    device_stream *list = malloc((n ? n : 1) * sizeof *list);
    size_t taken = 0;
    if (list) {
        for (npu_stream *s = stream_registry; s; s = s->reg_next)
            if (s->device == device && stream_try_retain(s))
                list[taken++] = (device_stream){.s = s, .listed = s->listed};
    }
    pthread_mutex_unlock(&table_lock);
    if (!list)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *out = list;
    *count = taken;
    return ACL_SUCCESS;
}

/* Returns and clears the sticky error of s without waiting. */
static aclError stream_take_error(npu_stream *s)
{
    pthread_mutex_lock(&s->lock);
    aclError rc = s->sticky;
    s->sticky = ACL_SUCCESS;
    pthread_mutex_unlock(&s->lock);
    return rc;
}

/* With a deadline (CLOCK_MONOTONIC; NULL: none) that comes first, returns ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
 * and takes no error: every stream keeps its sticky error for the next synchronize. */
static aclError device_drain(int32_t device, bool take_errors, const struct timespec *deadline)
{
    if (!device_valid(device))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    if ((tl_worker && tl_worker->device == device) || runs_block_callback(NULL, device))
        return ERR_SELF_WAIT;
    device_stream *list;
    size_t n;
    aclError rc = device_streams(device, &list, &n);
    if (rc != ACL_SUCCESS)
        return rc;
    /* Every stream is drained, a stream being destroyed included (its queued work is still the
     * device's work).  With take_errors a listed stream's sticky error is returned and cleared (the
     * first error wins); a destroyed stream's is not reported: its handle is gone. */
    if (deadline) {
        /* Errors are taken (all of them, the first one returned) only once every stream drained in time. */
        for (size_t i = 0; i < n && rc == ACL_SUCCESS; i++)
            rc = stream_drain(list[i].s, false, deadline);
        for (size_t i = 0; i < n && take_errors && rc != ACL_ERROR_RT_STREAM_SYNC_TIMEOUT; i++) {
            aclError one = list[i].listed ? stream_take_error(list[i].s) : ACL_SUCCESS;
            if (rc == ACL_SUCCESS)
                rc = one;
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            aclError one = stream_drain(list[i].s, take_errors && list[i].listed, NULL);
            if (rc == ACL_SUCCESS)
                rc = one;
        }
    }
    for (size_t i = 0; i < n; i++)
        stream_put(list[i].s);
    free(list);
    return rc;
}

aclError stream_synchronize_device(int32_t device) { return device_drain(device, true, NULL); }

aclError stream_wait_device(int32_t device) { return device_drain(device, false, NULL); }

/* Lets the worker run every queued task and exit, then joins it.  Afterwards the stream has
 * passed every position it ever gave out and accepts no task.  Called by the one thread that
 * took the stream out of its listing. */
static void stream_stop(npu_stream *s)
{
    pthread_mutex_lock(&s->lock);
    s->stopping = true;
    bool started = s->worker_started;
    s->worker_started = false;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->lock);
    if (started) {
        report_waiter rt = report_wait_begin();
        pthread_join(s->worker, NULL);
        report_wait_end(rt);
    }
}

/* ------------------------------------------------------------------------------------------
 * Stream API
 * ------------------------------------------------------------------------------------------ */

/* A new stream of `dev` made in `owner` at `generation` (owner NULL: the default context); with start_worker its
 * worker runs before it is handed out. */
static aclError stream_make(int32_t dev, const device_context *owner, uint32_t generation, bool start_worker,
                            bool context_default, aclrtStream *stream)
{
    aclError rc = ACL_SUCCESS;
    npu_stream *s = stream_new(dev);
    if (!s)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    s->owner = owner;
    s->owner_generation = generation;
    s->context_default = context_default;
    if (start_worker) {
        pthread_mutex_lock(&s->lock);
        rc = ensure_worker_locked(s);
        pthread_mutex_unlock(&s->lock);
        if (rc != ACL_SUCCESS) {
            stream_free(s);
            return rc;
        }
    }
    pthread_mutex_lock(&table_lock);
    /* A destroy of the owner retires it before its sweep takes this lock: a stream listed after that sweep
     * would outlive its context, so it is refused here, under the lock the sweep reads the table with. */
    bool owner_gone = owner && atomic_load(&owner->generation) != generation;
    uint64_t h = owner_gone ? 0 : handle_table_insert(&stream_table, s);
    if (h) {
        s->handle = h;
        s->listed = true;
        stream_registry_add(s);
    }
    pthread_mutex_unlock(&table_lock);
    if (!h) {
        stream_stop(s); /* joins the worker, if one was started */
        stream_free(s);
        return owner_gone ? ACL_ERROR_RT_CONTEXT_NULL : ACL_ERROR_RT_NO_STREAM_RESOURCE;
    }
    *stream = (aclrtStream)(uintptr_t)h;
    return ACL_SUCCESS;
}

/* A new stream of the current context. */
static aclError stream_create(aclrtStream *stream, bool start_worker)
{
    int32_t dev;
    aclError rc = runtime_current_device(&dev);
    if (rc != ACL_SUCCESS)
        return rc;
    uint32_t generation;
    const device_context *owner = device_bound_context(&generation);
    return stream_make(dev, owner, generation, start_worker, false, stream);
}

aclError stream_create_owned(const device_context *owner, uint32_t generation, aclrtStream *stream)
{
    return stream_make(atomic_load(&owner->device), owner, generation, false, true, stream);
}

aclError aclrtCreateStream(aclrtStream *stream)
{
    if (!stream)
        return ACL_ERROR_INVALID_PARAM;
    return stream_create(stream, false);
}

#define STREAM_FLAGS_KNOWN 0x3FU /* ACL_STREAM_FAST_LAUNCH .. ACL_STREAM_DEVICE_USE_ONLY */

aclError aclrtCreateStreamWithConfig(aclrtStream *stream, uint32_t priority, uint32_t flag)
{
    (void)priority; /* CANN: reserved, and clamped into its range rather than refused; no effect here */
    if (!stream)
        return ACL_ERROR_INVALID_PARAM;
    /* CANN's ACL layer passes on the known bits only (any other bit is ignored); its runtime refuses
     * DEVICE_USE_ONLY with another of them. */
    flag &= STREAM_FLAGS_KNOWN;
    if ((flag & ACL_STREAM_DEVICE_USE_ONLY) && (flag & ~ACL_STREAM_DEVICE_USE_ONLY))
        return ACL_ERROR_RT_PARAM_INVALID;
    /* A persistent stream keeps its tasks for a model (aclmdlRI) to run, which npualloc does not have:
     * its tasks would never run. */
    if (flag & ACL_STREAM_PERSISTENT)
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    /* FAST_LAUNCH: CANN sets up the stream's resources at creation instead of at first use; here the
     * resource is the worker thread.  The other flags change nothing in how a stream runs here. */
    return stream_create(stream, flag & ACL_STREAM_FAST_LAUNCH);
}

/* Destroys a listed stream; a context's default stream only when `owner_sweep` (its context's destroy). */
static aclError stream_destroy(aclrtStream stream, bool owner_sweep)
{
    if (!stream)
        return ACL_ERROR_INVALID_PARAM; /* the default stream is never destroyed */
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_mutex_lock(&table_lock);
    npu_stream *s = handle_table_get(&stream_table, handle_value(stream));
    if (!s || (s->context_default && !owner_sweep)) {
        /* CANN destroys only the streams its create calls made: a context's default stream (the handle
         * aclrtCtxGetCurrentDefaultStream gives) lives as long as the context */
        rc = ACL_ERROR_INVALID_PARAM;
    } else if (stream_waits_for_self(s)) {
        rc = ERR_SELF_WAIT; /* it would wait for the task that is calling */
    } else {
        handle_table_remove(&stream_table, handle_value(stream));
        s->listed = false; /* its listing reference is now ours */
    }
    pthread_mutex_unlock(&table_lock);
    if (rc != ACL_SUCCESS)
        return rc;
    stream_close_reports(s); /* its pending callbacks run on the worker while it drains */
    stream_stop(s);
    stream_put(s); /* events and waiting tasks may keep the (finished) stream a little longer */
    return ACL_SUCCESS;
}

aclError aclrtDestroyStream(aclrtStream stream) { return stream_destroy(stream, false); }

void stream_destroy_owned(const device_context *owner, uint32_t generation)
{
    /* In batches, the lock dropped for the destroys (each waits for its stream's work), until a batch destroys
     * nothing: what is left then is streams a callback of their own is destroying the context from. */
    enum { BATCH = 64 };
    bool progress = true;
    while (progress) {
        uint64_t found[BATCH];
        size_t n = 0;
        pthread_mutex_lock(&table_lock);
        for (npu_stream *s = stream_registry; s && n < BATCH; s = s->reg_next)
            if (s->owner == owner && s->owner_generation == generation && s->listed)
                found[n++] = s->handle;
        pthread_mutex_unlock(&table_lock);
        progress = false;
        for (size_t i = 0; i < n; i++) {
            aclError rc = stream_destroy((aclrtStream)(uintptr_t)found[i], true);
            progress |= rc == ACL_SUCCESS || rc == ACL_ERROR_INVALID_PARAM; /* (destroyed by another thread) */
        }
    }
}

/* aclrtSynchronizeStream(WithTimeout): timeout -1 (or 0, which CANN's ACL layer also lets
 * through) waits forever, a positive one is in milliseconds.  A stream being captured has nothing
 * to wait for that the capture would not miss: CANN's runtime refuses it (the capture goes on). */
static aclError synchronize_handle(aclrtStream stream, int32_t timeout)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_stream *s;
    if ((rc = stream_lookup(stream, &s)) != ACL_SUCCESS)
        return rc;
    if (unlikely(stream_capture_get(s) != NULL)) {
        stream_put(s);
        return ACL_ERROR_RT_STREAM_CAPTURED;
    }
    struct timespec deadline;
    if (timeout > 0)
        deadline = deadline_after_ms(timeout);
    rc = stream_drain(s, true, timeout > 0 ? &deadline : NULL);
    stream_put(s);
    return rc;
}

aclError aclrtSynchronizeStream(aclrtStream stream) { return synchronize_handle(stream, -1); }

aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout)
{
    if (timeout < -1)
        return ACL_ERROR_RT_PARAM_INVALID; /* CANN: [-1, INT_MAX] */
    return synchronize_handle(stream, timeout);
}

aclError aclrtSynchronizeDevice(void)
{
    int32_t dev;
    aclError rc = runtime_current_device(&dev);
    if (rc != ACL_SUCCESS)
        return rc;
    return stream_synchronize_device(dev);
}

aclError aclrtSynchronizeDeviceWithTimeout(int32_t timeout)
{
    if (timeout < -1)
        return ACL_ERROR_RT_PARAM_INVALID; /* CANN: [-1, INT_MAX] */
    if (timeout <= 0)
        return aclrtSynchronizeDevice(); /* -1, and 0 as for the stream and event forms: forever */
    int32_t dev;
    aclError rc = runtime_current_device(&dev);
    if (rc != ACL_SUCCESS)
        return rc;
    struct timespec deadline = deadline_after_ms(timeout);
    return device_drain(dev, true, &deadline);
}

/* Queues fn on a stream handle; `arg` is a malloc'd block that `cleanup` frees after the task
 * runs, or that is freed at once (by free()) when queueing fails. */
static aclError enqueue_owned(aclrtStream stream, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup)
{
    npu_stream *s;
    aclError rc = stream_lookup(stream, &s);
    if (rc == ACL_SUCCESS) {
        rc = stream_enqueue(s, fn, arg, cleanup, NULL);
        stream_put(s);
    }
    if (rc != ACL_SUCCESS)
        free(arg);
    return rc;
}

/* ------------------------------------------------------------------------------------------
 * Callbacks and their subscribed threads
 * ------------------------------------------------------------------------------------------ */

static bool returned_pending(npu_stream *s)
{
    pthread_mutex_lock(&s->lock);
    bool any = s->returned_head != NULL;
    pthread_mutex_unlock(&s->lock);
    return any;
}

/* The callback task, on the worker of its stream: runs the callback here when nobody is
 * subscribed, otherwise hands it to the subscribed thread (and for BLOCK waits for it).
 * Earlier callbacks of the stream always come first: the ones handed back to this worker,
 * and any still running on another thread. */
static aclError run_callback(void *arg)
{
    callback_task *c = arg;
    /* A graph's node runs at every launch; an uncaptured callback runs once. */
    aclrtCallback fn = c->captured || !c->once ? c->fn : c->once;
    void (*release)(void *) = c->captured || c->once ? NULL : c->release;
    npu_stream *s = tl_worker;
    /* Fast path: nothing subscribed anywhere and nothing of s still running elsewhere.  The
     * acquire loads see every hand-back and run that preceded the last unsubscribe. */
    if (atomic_load_explicit(&subscribed_streams, memory_order_acquire) == 0 &&
        atomic_load_explicit(&s->cb_running, memory_order_acquire) == 0) {
        run_returned(s);
        callback_run(fn, c->user_data, release);
        return ACL_SUCCESS;
    }
    cb_report *r = malloc(sizeof *r);
    report_thread *rt;
    bool here;
    pthread_mutex_lock(&sub_lock);
    for (;;) {
        if (returned_pending(s)) { /* (only appended under sub_lock) */
            pthread_mutex_unlock(&sub_lock);
            run_returned(s);
            pthread_mutex_lock(&sub_lock);
            continue;
        }
        rt = s->subscriber;
        /* No subscriber; out of memory; a BLOCK callback for a thread that is itself blocked
         * in a stream wait (maybe for this very stream); or the subscribed thread is this
         * worker (subscribed from one of its callbacks), which would wait for itself: run it
         * here. */
        here = !rt || !r || (c->block && rt->waiting) || rt->tid == self_tid();
        if (!running_elsewhere_locked(s, here ? NULL : rt))
            break;
        pthread_cond_wait(&report_done_cv, &sub_lock);
    }
    if (here) {
        if (rt)
            reclaim_stream_locked(rt, s); /* this stream's callbacks still queued there go first */
        pthread_mutex_unlock(&sub_lock);
        free(r);
        run_returned(s);
        callback_run(fn, c->user_data, release);
        return ACL_SUCCESS;
    }
    *r = (cb_report){.fn = fn, .user_data = c->user_data, .release = release, .stream = s, .block = c->block,
                     .state = REPORT_QUEUED};
    if (c->captured && !c->block) { /* (a BLOCK one's launch waits for it) */
        atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
        r->node = c;
    }
    if (rt->tail)
        rt->tail->next = r;
    else
        rt->head = r;
    rt->tail = r;
    rt->queued++;
    pthread_cond_broadcast(&rt->cv);
    if (!c->block) {
        pthread_mutex_unlock(&sub_lock); /* the thread frees r once it ran it */
        return ACL_SUCCESS;
    }
    while (r->state == REPORT_QUEUED || r->state == REPORT_RUNNING)
        pthread_cond_wait(&report_done_cv, &sub_lock);
    bool returned = r->state == REPORT_RETURNED;
    pthread_mutex_unlock(&sub_lock);
    if (returned) {
        run_returned(s); /* the NO_BLOCK ones handed back with it came first */
        pthread_mutex_lock(&sub_lock);
        while (running_elsewhere_locked(s, NULL))
            pthread_cond_wait(&report_done_cv, &sub_lock);
        pthread_mutex_unlock(&sub_lock);
        callback_run(r->fn, r->user_data, r->release);
    }
    free(r);
    return ACL_SUCCESS;
}

static void callback_task_put(callback_task *c)
{
    if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) != 1)
        return;
    if (c->captured && c->release)
        c->release(c->user_data);
    free(c);
}

/* The callback task's cleanup: after its one run (which released the data), or when the graph
 * that captured it frees its nodes. */
static void callback_task_free(void *arg) { callback_task_put(arg); }

aclError stream_launch_callback(aclrtStream stream, aclrtCallback fn, aclrtCallback once, void *user_data,
                                void (*release)(void *), aclrtCallbackBlockType block)
{
    if (!fn || (block != ACL_CALLBACK_NO_BLOCK && block != ACL_CALLBACK_BLOCK))
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    callback_task *c = malloc(sizeof *c);
    if (!c)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *c = (callback_task){
        .fn = fn, .user_data = user_data, .release = release, .once = once, .block = block == ACL_CALLBACK_BLOCK};
    atomic_init(&c->refs, 1);
    /* (a task that could not be queued is freed without its release: the caller keeps user_data) */
    return enqueue_owned(stream, run_callback, c, callback_task_free);
}

aclError aclrtLaunchCallback(aclrtCallback fn, void *userData, aclrtCallbackBlockType blockType,
                             aclrtStream stream)
{
    return stream_launch_callback(stream, fn, NULL, userData, NULL, blockType);
}

aclError npualloc_launch_host_func(aclrtStream stream, aclrtCallback fn, void *user_data, void (*destroy)(void *),
                                   aclrtCallbackBlockType block)
{
    return stream_launch_callback(stream, fn, NULL, user_data, destroy, block);
}

static report_thread *report_thread_new(uint64_t tid)
{
    report_thread *rt = calloc(1, sizeof *rt);
    if (!rt)
        return NULL;
    if (monotonic_cond_init(&rt->cv) != 0) {
        free(rt);
        return NULL;
    }
    rt->tid = tid;
    return rt;
}

aclError aclrtSubscribeReport(uint64_t threadId, aclrtStream stream)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_stream *s;
    if ((rc = stream_lookup(stream, &s)) != ACL_SUCCESS)
        return rc;
    report_thread *fresh = report_thread_new(threadId); /* used when the thread is new */
    pthread_mutex_lock(&sub_lock);
    report_thread *rt = report_thread_find_locked(threadId);
    if (s->sub_closed)
        rc = ACL_ERROR_INVALID_PARAM; /* destroyed meanwhile */
    else if (s->subscriber)
        rc = ACL_ERROR_RT_STREAM_SUBSCRIBE; /* by this thread or another one */
    else if (rt && rt->device != s->device)
        rc = ACL_ERROR_RT_THREAD_SUBSCRIBE; /* CANN: a thread serves the streams of one device */
    else if (!rt && !fresh)
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (rc == ACL_SUCCESS) {
        if (!rt) {
            rt = fresh;
            fresh = NULL;
            rt->device = s->device;
            rt->next = report_threads;
            report_threads = rt;
        }
        rt->nstreams++;
        s->subscriber = rt;
        atomic_fetch_add_explicit(&subscribed_streams, 1, memory_order_relaxed);
        pthread_cond_broadcast(&report_done_cv); /* a worker may wait with an old target */
    }
    pthread_mutex_unlock(&sub_lock);
    if (fresh)
        report_thread_free(fresh);
    stream_put(s);
    return rc;
}

aclError aclrtUnSubscribeReport(uint64_t threadId, aclrtStream stream)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_stream *s;
    if ((rc = stream_lookup(stream, &s)) != ACL_SUCCESS)
        return rc;
    report_thread *gone = NULL;
    pthread_mutex_lock(&sub_lock);
    if (!s->subscriber)
        rc = ACL_ERROR_RT_STREAM_SUBSCRIBE; /* the stream is not subscribed */
    else if (s->subscriber->tid != threadId)
        rc = ACL_ERROR_RT_THREAD_SUBSCRIBE; /* subscribed, by another thread */
    else if (stream_waits_for_self(s) && atomic_load(&s->cb_running) > own_running(s))
        /* Its worker waits for the caller, and the wait below would be for a callback of s running on
         * another thread, which overlaps the caller only because it is blocked in a stream wait: maybe for
         * s, which would then wait for ever. */
        rc = ERR_SELF_WAIT;
    else
        gone = unsubscribe_locked(s);
    if (rc == ACL_SUCCESS)
        wait_running_locked(s); /* CANN waits for a busy callback too */
    pthread_mutex_unlock(&sub_lock);
    if (gone)
        report_thread_free(gone);
    stream_put(s);
    return rc;
}

/* The first queued report the calling thread may run now, NULL if none (*prev: the report before it, NULL
 * at the head).  Inside a callback (a nested call) the reports of the streams whose callbacks the thread is
 * running are left for the outer call: run here, the next callback of such a stream would run inside the
 * one before it.  sub_lock held. */
static cb_report *next_runnable_locked(const report_thread *rt, cb_report **prev)
{
    cb_report *before = NULL, *r = rt->head;
    for (; r && own_running(r->stream); r = r->next)
        before = r;
    *prev = before;
    return r;
}

aclError aclrtProcessReport(int32_t timeout)
{
    if (timeout < -1 || timeout == 0)
        return ACL_ERROR_INVALID_PARAM; /* CANN: -1 waits forever, otherwise > 0 ms */
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    struct timespec deadline = {0};
    if (timeout > 0)
        deadline = deadline_after_ms(timeout);
    pthread_mutex_lock(&sub_lock);
    report_thread *rt = report_thread_find_locked(self_tid());
    if (!rt) {
        pthread_mutex_unlock(&sub_lock);
        return ACL_ERROR_RT_THREAD_SUBSCRIBE;
    }
    rt->users++;
    cb_report *r, *prev;
    while (!(r = next_runnable_locked(rt, &prev)) && !rt->dead) {
        if (timeout < 0) {
            pthread_cond_wait(&rt->cv, &sub_lock);
        } else if (pthread_cond_timedwait(&rt->cv, &sub_lock, &deadline) == ETIMEDOUT &&
                   !(r = next_runnable_locked(rt, &prev)) && !rt->dead) {
            rc = ACL_ERROR_RT_REPORT_TIMEOUT;
            break;
        }
    }
    if (rc == ACL_SUCCESS && !r)
        rc = ACL_ERROR_RT_THREAD_SUBSCRIBE; /* its last subscription ended while it waited */
    /* The callbacks queued when it woke up, oldest first, but for those left to an outer call; later ones
     * wait for the next call. */
    size_t n = 0;
    for (cb_report *q = rt->head; q; q = q->next)
        n += !own_running(q->stream);
    for (; rc == ACL_SUCCESS && n > 0 && (r = next_runnable_locked(rt, &prev)); n--) {
        if (prev)
            prev->next = r->next;
        else
            rt->head = r->next;
        if (rt->tail == r)
            rt->tail = prev;
        rt->queued--;
        r->next = NULL;
        r->state = REPORT_RUNNING;
        npu_stream *s = r->stream;
        r->runner = rt;
        r->run_next = s->running;
        s->running = r;
        atomic_fetch_add_explicit(&s->cb_running, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&s->pins, 1, memory_order_relaxed); /* released below */
        stream_retain(s);
        pthread_mutex_unlock(&sub_lock);
        run_frame frame = {.stream = s, .rt = rt, .block = r->block, .up = tl_running};
        tl_running = &frame;
        callback_run(r->fn, r->user_data, r->release);
        tl_running = frame.up;
        pthread_mutex_lock(&sub_lock);
        for (cb_report **pp = &s->running; *pp; pp = &(*pp)->run_next) {
            if (*pp == r) { /* (a fork child started over with an empty list) */
                *pp = r->run_next;
                atomic_fetch_sub_explicit(&s->cb_running, 1, memory_order_release);
                break;
            }
        }
        cb_report *done = r->block ? NULL : r;
        if (r->block)
            r->state = REPORT_DONE; /* its worker frees it */
        pthread_cond_broadcast(&report_done_cv);
        pthread_mutex_unlock(&sub_lock);
        if (done)
            report_free(done);
        stream_release(s); /* no lock may be held */
        pthread_mutex_lock(&sub_lock);
    }
    bool gone = --rt->users == 0 && rt->dead;
    pthread_mutex_unlock(&sub_lock);
    if (gone)
        report_thread_free(rt);
    return rc;
}

void stream_report_counts(size_t *threads, size_t *streams)
{
    pthread_mutex_lock(&sub_lock);
    size_t n = 0;
    for (report_thread *rt = report_threads; rt; rt = rt->next)
        n++;
    if (threads)
        *threads = n;
    if (streams)
        *streams = atomic_load(&subscribed_streams);
    pthread_mutex_unlock(&sub_lock);
}

static aclError run_sleep(void *arg)
{
    host_sleep_ns(*(const uint64_t *)arg);
    return ACL_SUCCESS;
}

bool npualloc_in_stream_task(void) { return tl_worker || tl_running; }

aclError npualloc_sleep_async(aclrtStream stream, double seconds)
{
    /* Written so that NaN fails too; the bound keeps the conversion below defined. */
    if (!(seconds >= 0.0 && seconds <= MAX_SLEEP_SECONDS))
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    uint64_t *ns = malloc(sizeof *ns);
    if (!ns)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *ns = (uint64_t)(seconds * 1e9 + 0.5); /* in range: seconds <= MAX_SLEEP_SECONDS */
    return enqueue_owned(stream, run_sleep, ns, free);
}

/* ------------------------------------------------------------------------------------------
 * Event objects
 * ------------------------------------------------------------------------------------------ */

static void event_retain(npu_event *e) { atomic_fetch_add_explicit(&e->refs, 1, memory_order_relaxed); }

/* Drops a reference; the last one frees the event and its stream reference.  No lock of
 * this module may be held. */
static void event_put(npu_event *e)
{
    if (atomic_fetch_sub_explicit(&e->refs, 1, memory_order_acq_rel) != 1)
        return;
    pthread_mutex_lock(&table_lock);
    event_registry_remove(e);
    pthread_mutex_unlock(&table_lock);
    npu_stream *s = e->stream; /* nobody else can reach the event any more */
    pthread_mutex_destroy(&e->lock);
    free(e);
    if (s)
        stream_put(s);
}

/* Starts the runtime if need be, then finds the event (referenced: event_put it). */
static aclError event_lookup(aclrtEvent handle, npu_event **out)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (!handle)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&table_lock);
    npu_event *e = handle_table_get(&event_table, handle_value(handle));
    if (e)
        event_retain(e); /* listed, so the count is at least 1 */
    pthread_mutex_unlock(&table_lock);
    if (!e)
        return ACL_ERROR_INVALID_PARAM;
    *out = e;
    return ACL_SUCCESS;
}

/* The current record of an event: its stream (referenced, NULL if never recorded) and
 * position. */
static npu_stream *event_target(npu_event *e, uint64_t *position)
{
    pthread_mutex_lock(&e->lock);
    npu_stream *s = e->stream;
    *position = e->position;
    if (s)
        stream_retain(s);
    pthread_mutex_unlock(&e->lock);
    return s;
}

/* A task for e with its own reference to it (seq still to be set); NULL when out of memory. */
static event_task *event_task_new(npu_event *e)
{
    event_task *t = malloc(sizeof *t);
    if (t) {
        event_retain(e);
        *t = (event_task){.event = e, .forks = forks_since_start};
    }
    return t;
}

/* The tasks' cleanup; also frees one that could not be queued (its caller still holds a reference, so
 * this never frees the event then). */
static void event_task_free(void *arg)
{
    event_task *t = arg;
    if (t->forks == forks_since_start)
        event_put(t->event);
    free(t);
}

/* A record task: stamps the completion time if its record is still the event's current one
 * (a later record made this one obsolete otherwise). */
static aclError run_record(void *arg)
{
    event_task *r = arg;
    uint64_t now = host_now_ns(); /* the moment the worker reached the record */
    npu_event *e = r->event;
    pthread_mutex_lock(&e->lock);
    if (e->seq == r->seq) {
        e->time_ns = now;
        e->stamped = true;
    }
    pthread_mutex_unlock(&e->lock);
    return ACL_SUCCESS;
}

/* Moves the event's record to the end of stream s.  The event lock is held across the
 * enqueue so the record task cannot check its sequence number before it is current. */
static aclError event_record(npu_event *e, npu_stream *s)
{
    event_task *r = event_task_new(e);
    if (!r)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    npu_stream *old = NULL;
    pthread_mutex_lock(&e->lock);
    uint64_t seq = e->seq + 1, position;
    r->seq = seq;
    /* Plain: aclrtRecordEvent found s not capturing (graph_capture_active, graph_capture_record), and a
     * capture begun since must not take the task as a node: the event's record would be s's work before
     * the capture, passed but never stamped until a launch of the graph ran the node. */
    aclError rc = stream_enqueue_plain(s, run_record, r, event_task_free, &position);
    if (rc == ACL_SUCCESS) {
        old = e->stream;
        stream_retain(s);
        e->stream = s;
        e->position = position;
        e->seq = seq;
        e->stamped = false;
    }
    pthread_mutex_unlock(&e->lock);
    if (rc != ACL_SUCCESS)
        event_task_free(r);
    if (old)
        stream_put(old);
    return rc;
}

/* ------------------------------------------------------------------------------------------
 * Event API
 * ------------------------------------------------------------------------------------------ */

/* Event flags as CANN's runtime checks them (ACL passes them through).  DDSYNC is the runtime's bit
 * between CAPTURE_STREAM_PROGRESS and TIME_LINE: it has no ACL name, CANN accepts it, and it makes an
 * event one that streams can wait for, as ACL_EVENT_SYNC does. */
#define EVENT_FLAG_DDSYNC 0x04U
#define EVENT_FLAGS_WITH_FLAG 0x3FU /* SYNC .. EXTERNAL: what aclrtCreateEventWithFlag accepts */
#define EVENT_FLAGS_EX 0x4FU        /* SYNC .. TIME_LINE, IPC: what aclrtCreateEventExWithFlag accepts */
#define EVENT_FLAGS_WAITABLE (ACL_EVENT_SYNC | EVENT_FLAG_DDSYNC)

/* True when `flag` contains `alone` together with another bit (CANN: those bits are never combined). */
static bool combined(uint32_t flag, uint32_t alone) { return (flag & alone) && (flag & ~alone); }

static aclError check_event_flag(uint32_t flag, bool ex)
{
    uint32_t valid = ex ? EVENT_FLAGS_EX : EVENT_FLAGS_WITH_FLAG;
    if (combined(flag, ACL_EVENT_DEVICE_USE_ONLY) || combined(flag, ACL_EVENT_EXTERNAL) ||
        (ex && combined(flag, ACL_EVENT_IPC)))
        return ACL_ERROR_RT_PARAM_INVALID;
    /* CANN refuses an IPC event on chips without the feature with this code; npualloc has no IPC events.
     * EXTERNAL events are for updating captured tasks, which npualloc's graph capture cannot do. */
    if ((ex && flag == ACL_EVENT_IPC) || (!ex && flag == ACL_EVENT_EXTERNAL))
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    if (!(flag & valid) || flag > valid)
        return ACL_ERROR_RT_PARAM_INVALID;
    return ACL_SUCCESS;
}

/* aclrtCreateEvent (flags 0) and the WithFlag forms (flags already checked). */
static aclError event_create(aclrtEvent *event, uint32_t flags, bool ex)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_event *e = calloc(1, sizeof *e);
    if (!e)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (pthread_mutex_init(&e->lock, NULL) != 0) {
        free(e);
        return ACL_ERROR_RT_NO_EVENT_RESOURCE;
    }
    e->flags = flags;
    e->ex = ex;
    atomic_init(&e->pending_waits, 0);
    atomic_init(&e->refs, 1); /* the listing reference */
    pthread_mutex_lock(&table_lock);
    uint64_t h = handle_table_insert(&event_table, e);
    if (h) {
        e->listed = true;
        event_registry_add(e);
    }
    pthread_mutex_unlock(&table_lock);
    if (!h) {
        pthread_mutex_destroy(&e->lock);
        free(e);
        return ACL_ERROR_RT_NO_EVENT_RESOURCE;
    }
    *event = (aclrtEvent)(uintptr_t)h;
    return ACL_SUCCESS;
}

aclError aclrtCreateEvent(aclrtEvent *event)
{
    if (!event)
        return ACL_ERROR_INVALID_PARAM;
    return event_create(event, 0, false);
}

aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag)
{
    if (!event)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = check_event_flag(flag, false);
    return rc == ACL_SUCCESS ? event_create(event, flag, false) : rc;
}

aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag)
{
    if (!event)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = check_event_flag(flag, true);
    return rc == ACL_SUCCESS ? event_create(event, flag, true) : rc;
}

/* CANN's runtime refuses, for a DEVICE_USE_ONLY event, every call that queues work for it on the host. */
static bool device_use_only(const npu_event *e) { return e->flags & ACL_EVENT_DEVICE_USE_ONLY; }

/* CANN's runtime, in this order, for a stream to wait for or reset an event: a DEVICE_USE_ONLY event is
 * refused, and one created with flags but without SYNC (or DDSYNC) is not waited for. */
static aclError check_waitable(const npu_event *e)
{
    if (device_use_only(e))
        return ACL_ERROR_RT_PARAM_INVALID;
    return e->flags == 0 || (e->flags & EVENT_FLAGS_WAITABLE) ? ACL_SUCCESS : ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
}

aclError aclrtDestroyEvent(aclrtEvent event)
{
    if (!event)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_mutex_lock(&table_lock);
    npu_event *e = handle_table_remove(&event_table, handle_value(event));
    if (e)
        e->listed = false; /* its listing reference is now ours */
    pthread_mutex_unlock(&table_lock);
    if (!e)
        return ACL_ERROR_INVALID_PARAM;
    event_put(e); /* a queued record task may keep it until it has run */
    return ACL_SUCCESS;
}

aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream)
{
    npu_event *e;
    aclError rc = event_lookup(event, &e);
    if (rc != ACL_SUCCESS)
        return rc;
    if (device_use_only(e)) {
        event_put(e);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    npu_stream *s;
    if ((rc = stream_lookup(stream, &s)) == ACL_SUCCESS) {
        /* graph capture (graph.c): a record on a capturing stream marks a point of the graph */
        if (!(unlikely(graph_capture_active()) && graph_capture_record(s, handle_value(event), &rc)))
            rc = event_record(e, s);
        stream_put(s);
    }
    event_put(e);
    return rc;
}

/* True when the event's current record has passed; a never-recorded event counts as passed.  *ex:
 * the event was made by aclrtCreateEventExWithFlag. */
static aclError event_passed(aclrtEvent event, bool *recorded, bool *passed, bool *ex)
{
    npu_event *e;
    aclError rc = event_lookup(event, &e);
    if (rc != ACL_SUCCESS)
        return rc;
    *ex = e->ex;
    pthread_mutex_lock(&e->lock);
    *recorded = e->stream != NULL;
    *passed = !e->stream || stream_passed(e->stream, e->position);
    pthread_mutex_unlock(&e->lock);
    event_put(e);
    return ACL_SUCCESS;
}

aclError aclrtQueryEvent(aclrtEvent event, aclrtEventStatus *status)
{
    if (!status)
        return ACL_ERROR_INVALID_PARAM;
    bool recorded, passed, ex;
    aclError rc = event_passed(event, &recorded, &passed, &ex);
    if (rc == ACL_SUCCESS && ex)
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* CANN: not for aclrtCreateEventExWithFlag's events */
    if (rc == ACL_SUCCESS)
        *status = passed ? ACL_EVENT_STATUS_COMPLETE : ACL_EVENT_STATUS_NOT_READY;
    return rc;
}

/* CANN: NOT_READY also covers "never recorded" here, unlike aclrtQueryEvent, except for an event of
 * aclrtCreateEventExWithFlag, which CANN's runtime reports COMPLETE until its first record. */
aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status)
{
    if (!status)
        return ACL_ERROR_INVALID_PARAM;
    bool recorded, passed, ex;
    aclError rc = event_passed(event, &recorded, &passed, &ex);
    if (rc == ACL_SUCCESS)
        *status = (recorded || ex) && passed ? ACL_EVENT_RECORDED_STATUS_COMPLETE
                                             : ACL_EVENT_RECORDED_STATUS_NOT_READY;
    return rc;
}

aclError aclrtQueryEventWaitStatus(aclrtEvent event, aclrtEventWaitStatus *status)
{
    if (!event || !status)
        return ACL_ERROR_INVALID_PARAM;
    npu_event *e;
    aclError rc = event_lookup(event, &e);
    if (rc != ACL_SUCCESS)
        return rc;
    if (e->ex) {
        rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT; /* CANN: not for aclrtCreateEventExWithFlag's events */
    } else {
        bool pending = atomic_load_explicit(&e->pending_waits, memory_order_acquire) != 0;
        *status = pending ? ACL_EVENT_WAIT_STATUS_NOT_READY : ACL_EVENT_WAIT_STATUS_COMPLETE;
    }
    event_put(e);
    return rc;
}

/* A reset task (seq: the event's record count when it was queued, or RESET_CAPTURED): puts the event
 * back in its never-recorded state when its stream reaches it, unless the event was recorded again
 * after the reset was queued (that newer record stays). */
static aclError run_reset(void *arg)
{
    event_task *r = arg;
    npu_event *e = r->event;
    npu_stream *old = NULL;
    pthread_mutex_lock(&e->lock);
    if ((r->seq == RESET_CAPTURED || e->seq == r->seq) && e->stream) {
        old = e->stream;
        e->stream = NULL;
        e->stamped = false;
        e->seq++; /* a record task of the cleared record still queued must not stamp it */
    }
    pthread_mutex_unlock(&e->lock);
    if (old)
        stream_put(old); /* no lock held; it may free a destroyed stream, never this worker's own */
    return ACL_SUCCESS;
}

aclError aclrtResetEvent(aclrtEvent event, aclrtStream stream)
{
    if (!event)
        return ACL_ERROR_INVALID_PARAM;
    npu_event *e;
    aclError rc = event_lookup(event, &e);
    if (rc != ACL_SUCCESS)
        return rc;
    /* CANN's runtime: what check_waitable() refuses, then (with the stream resolved) an event of
     * aclrtCreateEventExWithFlag. */
    rc = check_waitable(e);
    npu_stream *s = NULL;
    if (rc == ACL_SUCCESS && (rc = stream_lookup(stream, &s)) == ACL_SUCCESS && e->ex)
        rc = ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    event_task *r = rc == ACL_SUCCESS ? event_task_new(e) : NULL;
    if (rc == ACL_SUCCESS && !r)
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (rc == ACL_SUCCESS) {
        /* The event lock is held across the enqueue, as for a record: the sequence number the task
         * compares is the one in force at its place in the queue. */
        pthread_mutex_lock(&e->lock);
        r->seq = e->seq; /* RESET_CAPTURED if a graph takes it (capture_task) */
        rc = stream_enqueue(s, run_reset, r, event_task_free, NULL);
        pthread_mutex_unlock(&e->lock);
        if (rc != ACL_SUCCESS)
            event_task_free(r);
    }
    if (s)
        stream_put(s);
    event_put(e);
    return rc;
}

/* aclrtSynchronizeEvent(WithTimeout): timeout as synchronize_handle's. */
static aclError synchronize_event(aclrtEvent event, int32_t timeout)
{
    npu_event *e;
    aclError rc = event_lookup(event, &e);
    if (rc != ACL_SUCCESS)
        return rc;
    uint64_t position;
    npu_stream *s = event_target(e, &position);
    event_put(e);
    if (!s)
        return ACL_SUCCESS; /* never recorded: nothing to wait for */
    if (!stream_passed(s, position)) {
        struct timespec deadline;
        if (timeout > 0)
            deadline = deadline_after_ms(timeout);
        if (stream_waits_for_self(s))
            rc = ERR_SELF_WAIT;
        else if (!wait_position_until(s, position, timeout > 0 ? &deadline : NULL))
            rc = ACL_ERROR_RT_EVENT_SYNC_TIMEOUT;
    }
    stream_put(s);
    return rc;
}

aclError aclrtSynchronizeEvent(aclrtEvent event) { return synchronize_event(event, -1); }

aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout)
{
    if (timeout < -1)
        return ACL_ERROR_RT_PARAM_INVALID; /* CANN: [-1, INT_MAX] */
    return synchronize_event(event, timeout);
}

/* What aclrtEventElapsedTime needs of an event's current record, read under its lock. */
typedef struct event_stamp {
    bool recorded, passed;
    uint64_t ns;
} event_stamp;

static aclError event_stamp_of(aclrtEvent event, event_stamp *out)
{
    npu_event *e;
    aclError rc = event_lookup(event, &e);
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_mutex_lock(&e->lock);
    out->recorded = e->stream != NULL;
    out->passed = out->recorded && stream_passed(e->stream, e->position);
    if (out->passed && !e->stamped)
        rc = ACL_ERROR_RT_INTERNAL_ERROR; /* unreachable: the record task stamps before passing */
    out->ns = e->time_ns;
    pthread_mutex_unlock(&e->lock);
    event_put(e);
    return rc;
}

aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent)
{
    if (!ms)
        return ACL_ERROR_INVALID_PARAM;
    event_stamp a, b; /* event_lookup starts the runtime */
    aclError rc;
    if ((rc = event_stamp_of(startEvent, &a)) != ACL_SUCCESS || (rc = event_stamp_of(endEvent, &b)) != ACL_SUCCESS)
        return rc;
    /* CANN's runtime checks that both events have a record before it looks at either time, and
     * answers a missing one with its "event recorder null", which ACL reports as 507000. */
    if (!a.recorded || !b.recorded)
        return ACL_ERROR_RT_INTERNAL_ERROR;
    if (!a.passed || !b.passed)
        return ACL_ERROR_RT_STREAM_NOT_COMPLETE;
    double ns = b.ns >= a.ns ? (double)(b.ns - a.ns) : -(double)(a.ns - b.ns);
    *ms = (float)(ns / 1e6);
    return ACL_SUCCESS;
}

/* A stream-wait task: holds its stream's worker until another stream passed a position.  It counts in
 * its event's pending_waits until it first finished waiting, or until it goes unrun (a graph that
 * captured it, graph.c, may run it at every launch or never). */
typedef struct wait_task {
    npu_stream *stream; /* a reference */
    uint64_t position;
    npu_event *event; /* a reference */
    atomic_bool counted;
    unsigned forks; /* forks_since_start when made */
} wait_task;

static void wait_uncount(wait_task *w)
{
    if (atomic_exchange_explicit(&w->counted, false, memory_order_relaxed))
        atomic_fetch_sub_explicit(&w->event->pending_waits, 1, memory_order_release);
}

static aclError run_wait(void *arg)
{
    wait_task *w = arg;
    stream_wait_position(w->stream, w->position);
    wait_uncount(w);
    return ACL_SUCCESS;
}

static void wait_cleanup(void *arg)
{
    wait_task *w = arg;
    if (w->forks == forks_since_start) {
        wait_uncount(w);
        stream_put(w->stream);
        event_put(w->event);
    }
    free(w);
}

/* Makes s wait until src passed position (the current record of e); takes over the caller's reference
 * to src, takes one of its own to e. */
static aclError enqueue_wait(npu_stream *s, npu_stream *src, uint64_t position, npu_event *e)
{
    wait_task *w = malloc(sizeof *w);
    aclError rc = w ? ACL_SUCCESS : ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (w) {
        event_retain(e);
        *w = (wait_task){.stream = src, .position = position, .event = e, .forks = forks_since_start};
        /* Counted before the task can run (and uncount itself). */
        atomic_init(&w->counted, true);
        atomic_fetch_add_explicit(&e->pending_waits, 1, memory_order_relaxed);
        /* Plain, as a record's: aclrtStreamWaitEvent found s not capturing (graph_capture_active,
         * graph_capture_wait); as a node the wait would count as pending until a launch ran it. */
        rc = stream_enqueue_plain(s, run_wait, w, wait_cleanup, NULL);
        if (rc != ACL_SUCCESS) {
            atomic_fetch_sub_explicit(&e->pending_waits, 1, memory_order_relaxed);
            event_put(e); /* the caller still holds one: this never frees */
        }
    }
    if (rc != ACL_SUCCESS) {
        free(w);
        stream_put(src);
    }
    return rc;
}

aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event)
{
    npu_event *e;
    aclError rc = event_lookup(event, &e);
    if (rc != ACL_SUCCESS)
        return rc;
    if ((rc = check_waitable(e)) != ACL_SUCCESS) {
        event_put(e);
        return rc;
    }
    npu_stream *s;
    if ((rc = stream_lookup(stream, &s)) != ACL_SUCCESS) {
        event_put(e);
        return rc;
    }
    /* graph capture (graph.c): waiting for a captured record is a dependency (and joins the capture) */
    if (unlikely(graph_capture_active()) && graph_capture_wait(s, handle_value(event), &rc)) {
        event_put(e);
        stream_put(s);
        return rc;
    }
    /* The position is taken now: a later re-record of the event does not change this wait. */
    uint64_t position;
    npu_stream *src = event_target(e, &position);
    /* Nothing to wait for when never recorded, already passed, or on s itself (FIFO). */
    if (src && src != s && !stream_passed(src, position))
        rc = enqueue_wait(s, src, position, e);
    else if (src)
        stream_put(src);
    event_put(e);
    stream_put(s);
    return rc;
}

/* ------------------------------------------------------------------------------------------
 * fork, shutdown, counts
 * ------------------------------------------------------------------------------------------ */

void stream_atfork_prepare(void)
{
    pthread_mutex_lock(&table_lock);
    pthread_mutex_lock(&sub_lock);
    for (npu_stream *s = stream_registry; s; s = s->reg_next)
        pthread_mutex_lock(&s->lock);
}

void stream_atfork_parent(void)
{
    for (npu_stream *s = stream_registry; s; s = s->reg_next)
        pthread_mutex_unlock(&s->lock);
    pthread_mutex_unlock(&sub_lock);
    pthread_mutex_unlock(&table_lock);
}

/* The child has no subscriptions: queued reports are dropped unrun, live report_threads are
 * freed.  A retired one still used by a thread of the parent is unreachable and leaks, except
 * for the forking thread's own (it frees it when its ProcessReport returns). */
static void reports_atfork_child(void)
{
    pthread_mutex_unlock(&sub_lock);
    pthread_cond_init(&report_done_cv, NULL);
    tl_running = NULL;
    for (report_thread *rt = report_threads, *next; rt; rt = next) {
        next = rt->next;
        free_report_list(rt->head);
        rt->head = rt->tail = NULL;
        rt->queued = 0;
        rt->nstreams = 0;
        rt->waiting = 0;
        rt->dead = true;
        (void)pthread_cond_init(&rt->cv, NULL); /* waiters are gone; never destroyed with them */
        if (rt->users == 0)
            free(rt);
        /* else: its users include threads that do not exist here; it leaks */
    }
    report_threads = NULL;
    atomic_store(&subscribed_streams, 0);
}

/* The child has only the forking thread.  Every stream lock and table_lock were taken by
 * prepare, so the registries, tables and queues are consistent; event locks were not (an
 * event may be locked by a thread that no longer exists), so events are freed without
 * touching their locks. */
void stream_atfork_child(void)
{
    pthread_mutex_unlock(&table_lock);
    forks_since_start++;
    /* Forked by a task (a callback calling fork): the child's thread returns into that stream's
     * worker loop when the task ends, so the stream stays (it stops there, and the thread ends). */
    npu_stream *forking_worker = tl_worker;
    tl_worker = NULL;
    reports_atfork_child();

    for (npu_event *e = event_registry, *next; e; e = next) {
        next = e->reg_next;
        free(e); /* its stream references are settled below, from the pins */
    }
    event_registry = NULL;
    handle_table_destroy(&event_table);
    handle_table_destroy(&stream_table);
    memset(default_streams, 0, sizeof default_streams);

    npu_stream *kept = NULL;
    for (npu_stream *s = stream_registry, *next; s; s = next) {
        next = s->reg_next;
        /* prepare took its lock; its condvars' waiters were threads that do not exist here
         * (with default attributes, initialising a condvar cannot fail). */
        pthread_mutex_unlock(&s->lock);
        (void)pthread_cond_init(&s->work_cv, NULL);
        (void)monotonic_cond_init(&s->passed_cv);
        stream_drop_tasks(s);
        s->worker_started = false;
        s->stopping = true; /* accepts nothing: it behaves like a destroyed stream */
        s->waiters = 0;
        s->sticky = ACL_SUCCESS;
        s->listed = false;
        s->subscriber = NULL;
        s->sub_closed = true;
        s->running = NULL;
        atomic_store(&s->cb_running, 0);
        atomic_store(&s->completed, s->last); /* nothing will run: every position passed */
        atomic_store(&s->capture, NULL);      /* graph capture: the child has none */
        /* The only references that can still be released are the pins of the layers above;
         * the others belonged to objects and threads that are gone. */
        unsigned pins = atomic_load(&s->pins) + (s == forking_worker);
        if (pins == 0) {
            stream_free(s);
            continue;
        }
        atomic_store(&s->refs, pins);
        s->reg_prev = NULL;
        s->reg_next = kept;
        if (kept)
            kept->reg_prev = s;
        kept = s;
    }
    stream_registry = kept;
}

/* Never called from a stream task (npualloc_shutdown refuses that): a task could not wait for its own
 * worker to stop. */
void stream_shutdown(void)
{
    npu_stream *streams = NULL;
    npu_event *events = NULL;
    /* Take every listed object out of its listing; the listing references become ours. */
    pthread_mutex_lock(&table_lock);
    for (npu_stream *s = stream_registry; s; s = s->reg_next) {
        if (s->listed) {
            s->listed = false;
            s->doomed_next = streams;
            streams = s;
        }
    }
    for (npu_event *e = event_registry; e; e = e->reg_next) {
        if (e->listed) {
            e->listed = false;
            e->doomed_next = events;
            events = e;
        }
    }
    handle_table_destroy(&stream_table);
    handle_table_destroy(&event_table);
    memset(default_streams, 0, sizeof default_streams);
    pthread_mutex_unlock(&table_lock);

    /* Every queued task runs (a task may wait for another stream, which keeps running until
     * its own turn), so all record and wait tasks drop their references. */
    for (npu_stream *s = streams; s; s = s->doomed_next)
        stream_close_reports(s); /* pending callbacks run on the workers, nobody waits for a thread */
    for (npu_stream *s = streams; s; s = s->doomed_next)
        stream_stop(s);
    for (npu_event *e = events, *next; e; e = next) {
        next = e->doomed_next;
        event_put(e);
    }
    for (npu_stream *s = streams, *next; s; s = next) {
        next = s->doomed_next;
        stream_put(s);
    }
}

void stream_counts(size_t *streams, size_t *events)
{
    pthread_mutex_lock(&table_lock);
    if (streams)
        *streams = stream_table.live;
    if (events)
        *events = event_table.live;
    pthread_mutex_unlock(&table_lock);
}

aclError npualloc_stream_query(aclrtStream stream, int32_t device, bool *done)
{
    if (!done)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_stream *s;
    rc = stream ? stream_acquire(stream, &s) : stream_acquire_default(device, &s);
    if (rc != ACL_SUCCESS)
        return rc;
    *done = stream_idle(s);
    stream_release(s);
    return ACL_SUCCESS;
}

aclError aclrtStreamQuery(aclrtStream stream, aclrtStreamStatus *status)
{
    if (!status)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_stream *s;
    if ((rc = stream_lookup(stream, &s)) != ACL_SUCCESS)
        return rc;
    *status = stream_idle(s) ? ACL_STREAM_STATUS_COMPLETE : ACL_STREAM_STATUS_NOT_READY;
    stream_put(s);
    return ACL_SUCCESS;
}
