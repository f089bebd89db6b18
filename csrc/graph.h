/*
 * graph.h - the hooks through which streams, memory functions and the caching allocator hand
 * work on capturing streams to the graph module (graph.c; the model is in npualloc_graph.h).
 *
 * Every hook sits behind one predictable branch on a global counter, so code that never captures
 * pays one relaxed load:
 *   graph_capture_active()  some stream is in capture mode now;
 *   graph_ranges_active()   some graph owns an address range (copies check access and, for
 *                           checked graphs, lifetimes).
 *
 * Locks (graph.c): bind_lock (exec bindings and arenas; held over vmm calls) -> graph_lock
 * (captures and graph structures; never held over a vmm call or a stream wait) -> stream locks.
 * The range registry's lock is taken inside the vmm read lock (copy checks) and is a leaf, but for
 * the violation log's lock inside it.
 */
#ifndef NPUALLOC_GRAPH_H
#define NPUALLOC_GRAPH_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "acl_rt.h"
#include "stream.h"
#include "vmm.h"

extern _Atomic unsigned graph_capturing_streams; /* streams in capture mode */
extern _Atomic unsigned graph_live_ranges;       /* graphs owning an address range */

static inline bool graph_capture_active(void)
{
    return atomic_load_explicit(&graph_capturing_streams, memory_order_relaxed) != 0;
}

static inline bool graph_ranges_active(void)
{
    return atomic_load_explicit(&graph_live_ranges, memory_order_relaxed) != 0;
}

/* Kinds of generic stream tasks (stream.c tells them apart by their function). */
enum { GRAPH_TASK_GENERIC = 0, GRAPH_TASK_HOST = 1, GRAPH_TASK_DELAY = 2 };

/* ---- stream.c ----
 * stream_enqueue on a stream whose capture pointer is set: true when the task became a node (the
 * graph owns `arg` and runs `cleanup` when it is destroyed); false when the capture ended
 * meanwhile (queue it normally).  *rc receives the result when handled. */
bool graph_capture_task(npu_stream *s, int kind, stream_task_fn fn, void *arg, stream_task_cleanup_fn cleanup,
                        aclError *rc);
/* aclrtRecordEvent / aclrtStreamWaitEvent while some capture is active: true when handled. */
bool graph_capture_record(npu_stream *s, uint64_t event, aclError *rc);
bool graph_capture_wait(npu_stream *s, uint64_t event, aclError *rc);

/* ---- mem.c ----
 * aclrtMemcpyAsync / aclrtMemsetAsync (and each row of aclrtMemcpy2dAsync) while some capture is
 * active: true when `stream` is capturing and the operation became a node (or was refused: *rc). */
bool graph_capture_memop(aclrtStream stream, void *dst, const void *src, size_t count, int32_t value, bool copy,
                         aclError *rc);
/* aclrtMemcpy / aclrtMemcpy2d / aclrtMemset while some capture is active, before touching memory:
 * the capture modes' verdict, ACL_SUCCESS or ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT (takes graph_lock). */
aclError graph_unsafe_call_check(void);
/* With the vmm read lock held and some graph range live: the rules for graph memory.  `dc`/`sc`
 * and `dd`/`sd` are what vmm_classify_locked said; src is NULL for a memset.  Returns
 * ACL_SUCCESS, ACL_ERROR_RT_PARAM_INVALID (checked graph: outside an output's lifetime) or
 * ACL_ERROR_RT_FEATURE_NOT_SUPPORT (a device without access). */
aclError graph_check_locked(const void *dst, range_class dc, int32_t dd, const void *src, range_class sc, int32_t sd,
                            size_t count);

/* ---- caching_api.c ----
 * An allocation on a capturing stream (0: `device`'s default stream): true when it became an
 * ALLOC node (*ptr, *rc; the error message is set as npualloc_last_error's). */
bool graph_capture_malloc(int32_t device, size_t size, uint64_t stream, void **ptr, aclError *rc);
/* A pointer the caching allocator does not know: true when it is graph memory (a FREE node, or
 * nothing once its capture ended: graph memory goes with the graph). */
bool graph_free(void *ptr, aclError *rc);
/* record_stream of graph memory during its capture: its FREE node will also wait for `stream`. */
bool graph_record_stream(void *ptr, uint64_t stream, aclError *rc);

/* fork (runtime.c): the outer locks are taken before the runtime's, the leaves after them. */
void graph_atfork_prepare_outer(void);
void graph_atfork_prepare_leaves(void);
void graph_atfork_parent(void);
void graph_atfork_child(void);

#endif
