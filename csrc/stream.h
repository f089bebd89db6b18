/*
 * stream.h - streams and events of the virtual NPU.
 *
 * A stream is an ordered queue of tasks run by its own worker thread (started on first use).
 * Every task gets a position (1, 2, 3, ... per stream); the stream has "passed" position p
 * once the worker finished the task at p.  An event is a recorded position on a stream, so
 * it completes exactly when the work queued before it has run.
 *
 * Each device has a default stream (aclrtStream NULL means the current device's default
 * stream).  Created streams belong to the device that was current when they were created.
 *
 * Internal users (the memory functions, the caching allocator) hold a stream through a
 * reference: stream_acquire() resolves a handle and pins the stream until stream_release().
 *
 * An asynchronous task that fails leaves a sticky error on its stream; the next
 * aclrtSynchronizeStream / aclrtSynchronizeDevice returns it once and clears it.
 *
 * Locking: the stream table lock (owned by this module) guards the handle tables; each stream
 * owns one mutex guarding its queue.  A worker never holds a stream mutex while running a task.
 *
 * A task must not wait for its own stream: synchronising it (or its device, or an event not yet
 * passed on it) from one of its tasks returns ACL_ERROR_RT_FEATURE_NOT_SUPPORT instead of
 * deadlocking; aclrtDestroyStream of its own stream returns the same.
 *
 * Callbacks (aclrtLaunchCallback) and subscriptions (aclrtSubscribeReport):
 *   - threadId is the OS thread's pthread_t as an integer (Python: threading.get_ident()).  A
 *     stream has at most one subscribed thread; a thread may serve several streams, all of one
 *     device (CANN's rule).  The thread need not exist when it is subscribed.
 *   - Where a callback runs is decided when the stream's worker reaches the callback task: if
 *     the stream has a subscribed thread then, the callback is queued to that thread, which runs
 *     it inside aclrtProcessReport(timeout).  One ProcessReport call waits (timeout ms, -1 =
 *     forever) until something is queued, then runs, oldest first, the callbacks queued when
 *     it woke up, and returns ACL_SUCCESS.  Called from a callback (nested), it leaves the
 *     callbacks of the streams whose callbacks the thread is running to the outer call, and
 *     waits only for the others.
 *     ACL_CALLBACK_BLOCK: the worker waits until the callback returned, so later tasks of the
 *     stream (and events recorded after it) wait for it.  ACL_CALLBACK_NO_BLOCK: the worker goes
 *     on at once; the callback's position counts as passed when it is handed over, so
 *     aclrtSynchronizeStream does not wait for it.  Callbacks of one stream run in launch order.
 *   - A stream whose subscribed thread is its own worker (subscribed from one of its callbacks)
 *     runs its callbacks on the worker: that is the subscribed thread, and it cannot wait for
 *     itself.
 *   - npualloc convenience (CANN returns ACL_ERROR_RT_STREAM_NO_CB_REG from aclrtLaunchCallback
 *     instead): on a stream with no subscribed thread the callback runs on the stream's worker,
 *     in order, and both block types behave as BLOCK.
 *   - Error codes, as CANN's runtime returns them (ACL passes them through): subscribing a
 *     stream that already has a thread (the same or another) -> ACL_ERROR_RT_STREAM_SUBSCRIBE;
 *     a thread that serves another device's streams -> ACL_ERROR_RT_THREAD_SUBSCRIBE;
 *     unsubscribing a stream nobody subscribed -> ACL_ERROR_RT_STREAM_SUBSCRIBE, one subscribed
 *     by another thread -> ACL_ERROR_RT_THREAD_SUBSCRIBE; aclrtProcessReport with timeout 0 or
 *     < -1 -> ACL_ERROR_INVALID_PARAM, from a thread with no subscription (or whose last one
 *     ended while it waited) -> ACL_ERROR_RT_THREAD_SUBSCRIBE, nothing queued in time ->
 *     ACL_ERROR_RT_REPORT_TIMEOUT.  An invalid stream handle -> ACL_ERROR_INVALID_PARAM; NULL is
 *     the current device's default stream.  ACL_ERROR_REPEAT_SUBSCRIBE and the other 10003x
 *     codes of acl_base.h are never returned.
 *   - Nothing is lost and nothing waits for a thread that stopped calling ProcessReport:
 *     unsubscribing hands the stream's callbacks not yet started back to its worker, which runs
 *     them (in order, before its next task); aclrtDestroyStream and stream_shutdown() end the
 *     stream's subscription first, so its worker runs them while draining.  Unsubscribe,
 *     destroy and shutdown do wait for the stream's callbacks already running on another thread
 *     (CANN's unsubscribe waits for a busy callback too): when they return, no callback of the
 *     stream runs or is pending on the old thread.  A callback of the stream may unsubscribe,
 *     synchronize or (NO_BLOCK only) destroy it; but a callback its worker waits for (BLOCK, or
 *     run on the worker) that would have to wait for another callback of the stream still
 *     running elsewhere (one blocked in a stream wait) cannot unsubscribe it:
 *     ACL_ERROR_RT_FEATURE_NOT_SUPPORT, and the subscription stays (which stream that one
 *     waits for is not known: one waiting for an unrelated stream refuses it too, until its
 *     wait returns).  Until unsubscribed, a BLOCK callback waits for its thread like on CANN:
 *     aclrtSynchronizeStream/Device wait with it.
 *   - Callbacks of one stream never overlap, even when its subscription moves: a worker starts
 *     the next one (on itself or on the new thread) only after the previous one returned,
 *     unless that one is blocked in a stream wait (it may be waiting for this stream).
 *   - A subscribed thread that blocks in a stream wait (synchronize, event synchronize, destroy)
 *     cannot run callbacks meanwhile: the callbacks queued to it whose worker waits for one of
 *     them (a BLOCK one) are handed back to their workers, and new BLOCK callbacks run on their
 *     workers until the wait ends (NO_BLOCK ones still queue up for it).  This avoids the
 *     deadlocks of "the thread waits for a stream that waits for the thread".
 *   - A thread running a BLOCK callback of stream S stands in for S's worker: waiting for S (or
 *     its device, or an event on S) or destroying S from the callback returns
 *     ACL_ERROR_RT_FEATURE_NOT_SUPPORT (npualloc_shutdown, and so stream_shutdown(), is refused there).
 *   - fork child: no subscriptions; callbacks queued to threads are dropped, not run.
 */
#ifndef NPUALLOC_STREAM_H
#define NPUALLOC_STREAM_H

#include <stdbool.h>
#include <stdint.h>

#include "acl_rt.h"
#include "device.h"

typedef struct npu_stream npu_stream;

/* A task runs on the stream's worker; its return value becomes the stream's sticky error
 * when it is not ACL_SUCCESS.  `cleanup` (may be NULL) runs after it, on the worker, before
 * the task's position counts as passed.  stream_shutdown() and aclrtDestroyStream() run every
 * queued task.  A fork child runs neither queued tasks nor their cleanups (they may take locks
 * of threads that do not exist there): it drops them, freeing `arg` only when `cleanup` is
 * plain free(); any other argument is leaked in the child. */
typedef aclError (*stream_task_fn)(void *arg);
typedef void (*stream_task_cleanup_fn)(void *arg);

/* Resolves a handle (NULL: the current device's default stream) and pins the stream.
 * ACL_ERROR_RT_CONTEXT_NULL when NULL is given and no device is current;
 * ACL_ERROR_INVALID_PARAM for a handle that is not a live stream. */
aclError stream_acquire(aclrtStream handle, npu_stream **out);
/* The default stream of a device (pinned; release it too). */
aclError stream_acquire_default(int32_t device, npu_stream **out);
/* Resolves a stream id as recorded by an internal user (stream_id(): 0 is `device`'s default
 * stream) and pins it, also after aclrtDestroyStream took a created stream's handle: while its
 * object exists its worker may still be running the work queued before the destroy, which a
 * waiter (the caching allocator's reuse events) must still wait for.  ACL_ERROR_INVALID_PARAM
 * once nothing of the stream remains (then none of its work can still run). */
aclError stream_acquire_for_wait(int32_t device, uint64_t id, npu_stream **out);
/* An id naming `device`'s default stream for the two functions here that take ids, whatever device the
 * user is on: every device's default stream has the handle 0, which they read as their own device's.
 * (torch_npu's record_stream takes another device's default stream.)  0 for an invalid device. */
uint64_t stream_default_id(int32_t device);
/* Resolves an id as stream_acquire_for_wait does, but only while the stream is live (stream_acquire). */
aclError stream_acquire_id(int32_t device, uint64_t id, npu_stream **out);
/* A new stream made in `owner` at `generation` (an explicit context's default stream), whatever the current
 * context; ACL_ERROR_RT_CONTEXT_NULL if the context was destroyed meanwhile. */
aclError stream_create_owned(const device_context *owner, uint32_t generation, aclrtStream *stream);
/* Destroys, as aclrtDestroyStream does, every stream made in `owner` at `generation` (its default stream
 * included), but a stream whose own callback is running this (it stays, an ordinary stream of its device). */
void stream_destroy_owned(const device_context *owner, uint32_t generation);
void stream_release(npu_stream *s);

int32_t stream_device(const npu_stream *s);
/* The handle applications see; 0 for a default stream. */
uint64_t stream_id(const npu_stream *s);

/* Queues a task; on success *position (if not NULL) receives its position.  On failure nothing
 * is queued and `cleanup` is not called: the caller still owns `arg`.  Fails with
 * ACL_ERROR_INVALID_PARAM once the stream was destroyed (or after fork, in the child). */
aclError stream_enqueue(npu_stream *s, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                        uint64_t *position);
/* stream_enqueue for a task whose caller asked a capture hook (graph.h) and heard that s is not capturing:
 * queued on s even if a capture began on it since (the task counts as queued before the capture began),
 * never taken by the capture as a generic node, which is neither what the caller decided nor the form
 * the hook gives a captured one. */
aclError stream_enqueue_plain(npu_stream *s, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                              uint64_t *position);
/* npualloc_launch_host_func, with `once` (if not NULL) as the one run of an uncaptured callback in place
 * of fn and release: the Python binding runs and drops a callback in one step, so that an exiting
 * interpreter never finds it between the two. */
aclError stream_launch_callback(aclrtStream stream, aclrtCallback fn, aclrtCallback once, void *user_data,
                                void (*release)(void *), aclrtCallbackBlockType block);
/* Queues n tasks (fns[i](args[i]), no cleanups) together, never into a capture: ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
 * with nothing queued, when the stream is capturing (checked under the lock stream_capture_set takes, so
 * that a capture begun by another thread meanwhile cannot take some of them); *last_position (if not NULL)
 * receives the last one's position.  Fails as stream_enqueue does otherwise, queueing nothing. */
aclError stream_enqueue_uncaptured(npu_stream *s, const stream_task_fn *fns, void *const *args, size_t n,
                                   uint64_t *last_position);
/* Position of the last task queued so far (0 if none): a free "event" for internal users. */
uint64_t stream_last_position(npu_stream *s);
/* True once the worker passed `position`. Never blocks, takes no lock on the hot path. */
bool stream_passed(const npu_stream *s, uint64_t position);
/* True when the calling thread runs a task of s (its worker, or a BLOCK callback standing in for
 * it): waiting for s from here would wait for the caller itself. */
bool stream_waits_for_self(const npu_stream *s);
/* Blocks until the worker passed `position` (clamped to the last queued position).  Returns
 * at once when stream_waits_for_self(s). */
void stream_wait_position(npu_stream *s, uint64_t position);
/* Waits for everything queued so far; returns and clears the sticky error. */
aclError stream_synchronize(npu_stream *s);
/* Synchronizes every stream of a device (default stream included), and waits for the work still
 * queued on its streams being destroyed by other threads (their errors are not reported). */
aclError stream_synchronize_device(int32_t device);
/* Waits for every stream of a device like stream_synchronize_device, but leaves their sticky
 * errors for the application's next synchronize: internal waits (the caching allocator's) must
 * not swallow a failed task's error.  Returns only its own failures (bad device, self-wait). */
aclError stream_wait_device(int32_t device);

/* fork(): the child has no worker threads; it starts with no streams or events.  A stream
 * still pinned (stream_acquire) across the fork stays allocated in the child as a finished,
 * destroyed stream until stream_release(); everything else is freed. */
void stream_atfork_prepare(void);
void stream_atfork_parent(void);
void stream_atfork_child(void);
/* Waits for all queued work, stops every worker and frees every stream and event (a stream
 * still pinned is freed by its last stream_release).  Never called from a task. */
void stream_shutdown(void);

/* Graph capture (graph.c, npualloc_graph.h): while a stream's capture pointer is set, what is
 * queued on it becomes a node of that graph instead of running (stream_enqueue hands the task
 * to the graph, which owns `arg` from then on and runs `cleanup` when the graph goes, so a
 * task queued on a capturing stream may run any number of times, once per launch); event
 * records and waits on it become dependencies. */
void *stream_capture_get(const npu_stream *s); /* s: a stream the caller holds, never NULL */
void stream_capture_set(npu_stream *s, void *capture);
/* Takes one more pin on a stream the caller holds (released with stream_release); NULL is ignored. */
void stream_pin(npu_stream *s);

/* Counts for tests: live created streams and events. */
void stream_counts(size_t *streams, size_t *events);
/* Count for tests: threads blocked waiting for one of the stream's positions. */
unsigned stream_waiter_count(npu_stream *s);
/* Counts for tests: threads with a subscription, and subscribed streams. */
void stream_report_counts(size_t *threads, size_t *streams);

#endif
