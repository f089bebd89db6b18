/*
 * stream.c - streams (ordered task queues, one worker thread each) and events (recorded
 * stream positions).  See stream.h for the model.
 *
 * Lifetime.  Streams and events are reference counted and freed when the count reaches 0.
 *   A stream is referenced by: its handle-table or default-stream slot ("listed"), each event
 *   whose current record is on it, each queued stream-wait task that waits on it, and each
 *   pin taken by stream_acquire*() (pins are also counted on their own, see the fork child).
 *   An event is referenced by its table slot and by each queued record task for it.
 *   Invariant: the listing reference of a stream is dropped only after its worker has been
 *   joined, so a stream is never freed by, or while being used by, its own worker, and a
 *   stream whose count reached 0 has an empty queue and no thread.
 *
 * Locks, in acquisition order (never the other way round):
 *   event lock -> stream lock      (recording queues a task while the event is locked)
 *   table_lock -> stream lock      (fork prepare)
 *   The event lock and table_lock are never held together.  Nothing is held while a task
 *   runs, and a stream or event is never released with any of these locks held (freeing
 *   takes table_lock to leave the registry).
 *
 * A worker never waits for its own stream: synchronising a stream (or its device, or an event
 * on it) from one of its own tasks returns ACL_ERROR_RT_FEATURE_NOT_SUPPORT instead of
 * deadlocking, and stream_wait_position() returns at once.
 */
#include "stream.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "device.h"
#include "handle_table.h"
#include "host.h"
#include "npualloc.h"

_Static_assert(sizeof(uintptr_t) >= sizeof(uint64_t), "stream and event handles are 64-bit values in pointers");

/* Returned when a task would wait for its own stream (it would wait forever). */
#define ERR_SELF_WAIT ACL_ERROR_RT_FEATURE_NOT_SUPPORT
/* Longest npualloc_sleep_async delay: keeps the nanosecond count far inside uint64_t. */
#define MAX_SLEEP_SECONDS 1e9

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
    uint64_t handle; /* 0 for a default stream */

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

    atomic_uint refs; /* every reference, pins included */
    atomic_uint pins; /* the references taken by stream_acquire*() */

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

    atomic_uint refs; /* the listing one and one per queued record task */

    /* Guarded by table_lock. */
    bool listed; /* in event_table (one reference) */
    struct npu_event *reg_prev, *reg_next;
    struct npu_event *doomed_next;
} npu_event;

/* The module lock: guards both handle tables, default_streams and both registries. */
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static handle_table stream_table = {.tag = 'S'};
static handle_table event_table = {.tag = 'E'};
static npu_stream *default_streams[NPU_MAX_DEVICES];
/* Every allocated object, listed or not: fork and shutdown must reach all of them. */
static npu_stream *stream_registry;
static npu_event *event_registry;

/* The stream whose worker is the calling thread, NULL on other threads. */
static _Thread_local npu_stream *tl_worker;

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

static int stream_sync_init(npu_stream *s)
{
    if (pthread_mutex_init(&s->lock, NULL) != 0)
        return -1;
    if (pthread_cond_init(&s->work_cv, NULL) != 0) {
        pthread_mutex_destroy(&s->lock);
        return -1;
    }
    if (pthread_cond_init(&s->passed_cv, NULL) != 0) {
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
    atomic_init(&s->refs, 1);
    atomic_init(&s->pins, 0);
    return s;
}

/* Frees the queued tasks without running them or their cleanups (fork child only). The
 * arguments of this module's own tasks and of tasks whose cleanup is plain free() are freed;
 * any other argument is leaked, because its cleanup may take locks the child cannot own. */
static void record_cleanup(void *arg);
static void wait_cleanup(void *arg);
static void stream_drop_tasks(npu_stream *s)
{
    stream_task *t = s->head;
    while (t) {
        stream_task *next = t->next;
        if (t->cleanup == free || t->cleanup == record_cleanup || t->cleanup == wait_cleanup)
            free(t->arg);
        free(t);
        t = next;
    }
    s->head = s->tail = NULL;
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

/* Resolves a handle (NULL: the current default stream) to a referenced stream. */
static aclError stream_lookup(aclrtStream handle, npu_stream **out)
{
    if (!handle) {
        int32_t dev;
        aclError rc = device_current(&dev);
        return rc == ACL_SUCCESS ? default_stream_get(dev, out) : rc;
    }
    pthread_mutex_lock(&table_lock);
    npu_stream *s = handle_table_get(&stream_table, handle_value(handle));
    if (s)
        stream_retain(s); /* listed, so the count is at least 1 */
    pthread_mutex_unlock(&table_lock);
    if (!s)
        return ACL_ERROR_INVALID_PARAM;
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
        while (!s->head && !s->stopping)
            pthread_cond_wait(&s->work_cv, &s->lock);
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

aclError stream_enqueue(npu_stream *s, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                        uint64_t *position)
{
    if (!s || !fn)
        return ACL_ERROR_INVALID_PARAM;
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

uint64_t stream_last_position(npu_stream *s)
{
    if (!s)
        return 0;
    pthread_mutex_lock(&s->lock);
    uint64_t last = s->last;
    pthread_mutex_unlock(&s->lock);
    return last;
}

bool stream_passed(const npu_stream *s, uint64_t position)
{
    return !s || atomic_load_explicit(&s->completed, memory_order_acquire) >= position;
}

/* Blocks until `position` has passed (s->lock held; position <= s->last). */
static void wait_passed_locked(npu_stream *s, uint64_t position)
{
    s->waiters++;
    while (atomic_load_explicit(&s->completed, memory_order_relaxed) < position)
        pthread_cond_wait(&s->passed_cv, &s->lock);
    s->waiters--;
}

void stream_wait_position(npu_stream *s, uint64_t position)
{
    /* The worker cannot wait for itself: any position not yet passed is at or behind the
     * task it is running. */
    if (!s || stream_passed(s, position) || tl_worker == s)
        return;
    pthread_mutex_lock(&s->lock);
    if (position > s->last)
        position = s->last; /* a position never queued would never pass */
    wait_passed_locked(s, position);
    pthread_mutex_unlock(&s->lock);
}

aclError stream_synchronize(npu_stream *s)
{
    if (!s)
        return ACL_ERROR_INVALID_PARAM;
    if (tl_worker == s)
        return ERR_SELF_WAIT;
    pthread_mutex_lock(&s->lock);
    wait_passed_locked(s, s->last);
    aclError rc = s->sticky;
    s->sticky = ACL_SUCCESS;
    pthread_mutex_unlock(&s->lock);
    return rc;
}

/* References every listed stream of a device into a new array (caller frees it). */
static aclError device_streams(int32_t device, npu_stream ***out, size_t *count)
{
    pthread_mutex_lock(&table_lock);
    size_t n = 0;
    for (npu_stream *s = stream_registry; s; s = s->reg_next)
        n += s->listed && s->device == device;
    npu_stream **list = malloc((n ? n : 1) * sizeof *list);
    if (list) {
        size_t i = 0;
        for (npu_stream *s = stream_registry; s; s = s->reg_next) {
            if (s->listed && s->device == device) {
                stream_retain(s);
                list[i++] = s;
            }
        }
    }
    pthread_mutex_unlock(&table_lock);
    if (!list)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *out = list;
    *count = n;
    return ACL_SUCCESS;
}

aclError stream_synchronize_device(int32_t device)
{
    if (!device_valid(device))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    if (tl_worker && tl_worker->device == device)
        return ERR_SELF_WAIT;
    npu_stream **list;
    size_t n;
    aclError rc = device_streams(device, &list, &n);
    if (rc != ACL_SUCCESS)
        return rc;
    /* Every stream is synchronised (and its sticky error cleared); the first error wins. */
    for (size_t i = 0; i < n; i++) {
        aclError one = stream_synchronize(list[i]);
        if (rc == ACL_SUCCESS)
            rc = one;
        stream_put(list[i]);
    }
    free(list);
    return rc;
}

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
    if (started)
        pthread_join(s->worker, NULL);
}

/* ------------------------------------------------------------------------------------------
 * Stream API
 * ------------------------------------------------------------------------------------------ */

aclError aclrtCreateStream(aclrtStream *stream)
{
    if (!stream)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    int32_t dev;
    if ((rc = device_current(&dev)) != ACL_SUCCESS)
        return rc;
    npu_stream *s = stream_new(dev);
    if (!s)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    pthread_mutex_lock(&table_lock);
    uint64_t h = handle_table_insert(&stream_table, s);
    if (h) {
        s->handle = h;
        s->listed = true;
        stream_registry_add(s);
    }
    pthread_mutex_unlock(&table_lock);
    if (!h) {
        stream_free(s);
        return ACL_ERROR_RT_NO_STREAM_RESOURCE;
    }
    *stream = (aclrtStream)(uintptr_t)h;
    return ACL_SUCCESS;
}

aclError aclrtDestroyStream(aclrtStream stream)
{
    if (!stream)
        return ACL_ERROR_INVALID_PARAM; /* the default stream is never destroyed */
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_mutex_lock(&table_lock);
    npu_stream *s = handle_table_get(&stream_table, handle_value(stream));
    if (!s) {
        rc = ACL_ERROR_INVALID_PARAM;
    } else if (s == tl_worker) {
        rc = ERR_SELF_WAIT; /* it would wait for the task that is calling */
    } else {
        handle_table_remove(&stream_table, handle_value(stream));
        s->listed = false; /* its listing reference is now ours */
    }
    pthread_mutex_unlock(&table_lock);
    if (rc != ACL_SUCCESS)
        return rc;
    stream_stop(s);
    stream_put(s); /* events and waiting tasks may keep the (finished) stream a little longer */
    return ACL_SUCCESS;
}

aclError aclrtSynchronizeStream(aclrtStream stream)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_stream *s;
    if ((rc = stream_lookup(stream, &s)) != ACL_SUCCESS)
        return rc;
    rc = stream_synchronize(s);
    stream_put(s);
    return rc;
}

aclError aclrtSynchronizeDevice(void)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    int32_t dev;
    if ((rc = device_current(&dev)) != ACL_SUCCESS)
        return rc;
    return stream_synchronize_device(dev);
}

/* Queues fn on a stream handle; `arg` is a malloc'd block freed after the task runs, or at
 * once when queueing fails. */
static aclError enqueue_owned(aclrtStream stream, stream_task_fn fn, void *arg)
{
    npu_stream *s;
    aclError rc = stream_lookup(stream, &s);
    if (rc == ACL_SUCCESS) {
        rc = stream_enqueue(s, fn, arg, free, NULL);
        stream_put(s);
    }
    if (rc != ACL_SUCCESS)
        free(arg);
    return rc;
}

typedef struct callback_task {
    aclrtCallback fn;
    void *user_data;
} callback_task;

static aclError run_callback(void *arg)
{
    callback_task *c = arg;
    c->fn(c->user_data);
    return ACL_SUCCESS;
}

/* Both block types run the callback on the stream's worker, so later tasks of the stream
 * always wait for it (ACL_CALLBACK_BLOCK semantics; NO_BLOCK is the weaker promise). */
aclError aclrtLaunchCallback(aclrtCallback fn, void *userData, aclrtCallbackBlockType blockType,
                             aclrtStream stream)
{
    if (!fn || (blockType != ACL_CALLBACK_NO_BLOCK && blockType != ACL_CALLBACK_BLOCK))
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    callback_task *c = malloc(sizeof *c);
    if (!c)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *c = (callback_task){.fn = fn, .user_data = userData};
    return enqueue_owned(stream, run_callback, c);
}

static aclError run_sleep(void *arg)
{
    host_sleep_ns(*(const uint64_t *)arg);
    return ACL_SUCCESS;
}

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
    return enqueue_owned(stream, run_sleep, ns);
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

static aclError event_lookup(aclrtEvent handle, npu_event **out)
{
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

/* A record task: stamps the completion time if its record is still the event's current one
 * (a later record made this one obsolete otherwise). */
typedef struct record_task {
    npu_event *event; /* a reference */
    uint64_t seq;
} record_task;

static aclError run_record(void *arg)
{
    record_task *r = arg;
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

static void record_cleanup(void *arg)
{
    record_task *r = arg;
    event_put(r->event);
    free(r);
}

/* Moves the event's record to the end of stream s.  The event lock is held across the
 * enqueue so the record task cannot check its sequence number before it is current. */
static aclError event_record(npu_event *e, npu_stream *s)
{
    record_task *r = malloc(sizeof *r);
    if (!r)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    event_retain(e); /* the task's reference */
    r->event = e;
    npu_stream *old = NULL;
    pthread_mutex_lock(&e->lock);
    uint64_t seq = e->seq + 1, position;
    r->seq = seq;
    aclError rc = stream_enqueue(s, run_record, r, record_cleanup, &position);
    if (rc == ACL_SUCCESS) {
        old = e->stream;
        stream_retain(s);
        e->stream = s;
        e->position = position;
        e->seq = seq;
        e->stamped = false;
    }
    pthread_mutex_unlock(&e->lock);
    if (rc != ACL_SUCCESS) {
        free(r);
        event_put(e); /* the caller still holds one: this never frees */
    }
    if (old)
        stream_put(old);
    return rc;
}

/* ------------------------------------------------------------------------------------------
 * Event API
 * ------------------------------------------------------------------------------------------ */

aclError aclrtCreateEvent(aclrtEvent *event)
{
    if (!event)
        return ACL_ERROR_INVALID_PARAM;
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
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_event *e;
    if ((rc = event_lookup(event, &e)) != ACL_SUCCESS)
        return rc;
    npu_stream *s;
    if ((rc = stream_lookup(stream, &s)) == ACL_SUCCESS) {
        rc = event_record(e, s);
        stream_put(s);
    }
    event_put(e);
    return rc;
}

/* True when the event's current record has passed; a never-recorded event counts as passed. */
static aclError event_passed(aclrtEvent event, bool *recorded, bool *passed)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_event *e;
    if ((rc = event_lookup(event, &e)) != ACL_SUCCESS)
        return rc;
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
    bool recorded, passed;
    aclError rc = event_passed(event, &recorded, &passed);
    if (rc == ACL_SUCCESS)
        *status = passed ? ACL_EVENT_STATUS_COMPLETE : ACL_EVENT_STATUS_NOT_READY;
    return rc;
}

/* CANN: NOT_READY also covers "never recorded" here, unlike aclrtQueryEvent. */
aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status)
{
    if (!status)
        return ACL_ERROR_INVALID_PARAM;
    bool recorded, passed;
    aclError rc = event_passed(event, &recorded, &passed);
    if (rc == ACL_SUCCESS)
        *status = recorded && passed ? ACL_EVENT_RECORDED_STATUS_COMPLETE : ACL_EVENT_RECORDED_STATUS_NOT_READY;
    return rc;
}

aclError aclrtSynchronizeEvent(aclrtEvent event)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_event *e;
    if ((rc = event_lookup(event, &e)) != ACL_SUCCESS)
        return rc;
    uint64_t position;
    npu_stream *s = event_target(e, &position);
    event_put(e);
    if (!s)
        return ACL_SUCCESS; /* never recorded: nothing to wait for */
    if (!stream_passed(s, position)) {
        if (tl_worker == s)
            rc = ERR_SELF_WAIT;
        else
            stream_wait_position(s, position);
    }
    stream_put(s);
    return rc;
}

/* Completion time of an event's current record. */
static aclError event_time(aclrtEvent event, uint64_t *ns)
{
    npu_event *e;
    aclError rc = event_lookup(event, &e);
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_mutex_lock(&e->lock);
    if (!e->stream)
        rc = ACL_ERROR_INVALID_PARAM;
    else if (!stream_passed(e->stream, e->position))
        rc = ACL_ERROR_RT_STREAM_NOT_COMPLETE;
    else if (!e->stamped)
        rc = ACL_ERROR_RT_INTERNAL_ERROR; /* unreachable: the record task stamps before passing */
    else
        *ns = e->time_ns;
    pthread_mutex_unlock(&e->lock);
    event_put(e);
    return rc;
}

aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent)
{
    if (!ms)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    uint64_t t0, t1;
    if ((rc = event_time(startEvent, &t0)) != ACL_SUCCESS || (rc = event_time(endEvent, &t1)) != ACL_SUCCESS)
        return rc;
    double ns = t1 >= t0 ? (double)(t1 - t0) : -(double)(t0 - t1);
    *ms = (float)(ns / 1e6);
    return ACL_SUCCESS;
}

/* A stream-wait task: holds its stream's worker until another stream passed a position. */
typedef struct wait_task {
    npu_stream *stream; /* a reference */
    uint64_t position;
} wait_task;

static aclError run_wait(void *arg)
{
    wait_task *w = arg;
    stream_wait_position(w->stream, w->position);
    return ACL_SUCCESS;
}

static void wait_cleanup(void *arg)
{
    wait_task *w = arg;
    stream_put(w->stream);
    free(w);
}

/* Makes s wait until src passed position; takes over the caller's reference to src. */
static aclError enqueue_wait(npu_stream *s, npu_stream *src, uint64_t position)
{
    wait_task *w = malloc(sizeof *w);
    aclError rc = w ? ACL_SUCCESS : ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (w) {
        *w = (wait_task){.stream = src, .position = position};
        rc = stream_enqueue(s, run_wait, w, wait_cleanup, NULL);
    }
    if (rc != ACL_SUCCESS) {
        free(w);
        stream_put(src);
    }
    return rc;
}

aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    npu_event *e;
    if ((rc = event_lookup(event, &e)) != ACL_SUCCESS)
        return rc;
    npu_stream *s;
    if ((rc = stream_lookup(stream, &s)) != ACL_SUCCESS) {
        event_put(e);
        return rc;
    }
    /* The position is taken now: a later re-record of the event does not change this wait. */
    uint64_t position;
    npu_stream *src = event_target(e, &position);
    event_put(e);
    /* Nothing to wait for when never recorded, already passed, or on s itself (FIFO). */
    if (src && src != s && !stream_passed(src, position))
        rc = enqueue_wait(s, src, position);
    else if (src)
        stream_put(src);
    stream_put(s);
    return rc;
}

/* ------------------------------------------------------------------------------------------
 * fork, shutdown, counts
 * ------------------------------------------------------------------------------------------ */

void stream_atfork_prepare(void)
{
    pthread_mutex_lock(&table_lock);
    for (npu_stream *s = stream_registry; s; s = s->reg_next)
        pthread_mutex_lock(&s->lock);
}

void stream_atfork_parent(void)
{
    for (npu_stream *s = stream_registry; s; s = s->reg_next)
        pthread_mutex_unlock(&s->lock);
    pthread_mutex_unlock(&table_lock);
}

/* The child has only the forking thread.  Every stream lock and table_lock were taken by
 * prepare, so the registries, tables and queues are consistent; event locks were not (an
 * event may be locked by a thread that no longer exists), so events are freed without
 * touching their locks. */
void stream_atfork_child(void)
{
    pthread_mutex_init(&table_lock, NULL);
    tl_worker = NULL;

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
        /* Over locks held by prepare and condvars with departed waiters; with default
         * attributes this cannot fail. */
        (void)stream_sync_init(s);
        stream_drop_tasks(s);
        s->worker_started = false;
        s->stopping = true; /* accepts nothing: it behaves like a destroyed stream */
        s->waiters = 0;
        s->sticky = ACL_SUCCESS;
        s->listed = false;
        atomic_store(&s->completed, s->last); /* nothing will run: every position passed */
        /* The only references that can still be released are the pins of the layers above;
         * the others belonged to objects and threads that are gone. */
        unsigned pins = atomic_load(&s->pins);
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

void stream_shutdown(void)
{
    if (tl_worker)
        return; /* a task cannot wait for its own worker to stop */
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
