/*
 * npualloc_graph.h - captured graphs with planned memory (CUDA graph memory nodes, seed 003).
 *
 * Capture.  npualloc_graph_capture_begin(g, stream) puts a stream in capture mode: what is queued
 * on it is recorded as graph nodes instead of being run.
 *   - npualloc_cache_malloc / npualloc_allocate on a capturing stream -> an ALLOC node; the pointer
 *     returned is the graph address the launched graph uses (addresses are assigned at capture);
 *   - npualloc_cache_free / npualloc_deallocate of a graph address -> a FREE node on the stream of
 *     its allocation (depending also on the streams named by npualloc_cache_record_stream);
 *   - aclrtMemcpyAsync / aclrtMemsetAsync -> MEMCPY / MEMSET nodes with their arguments;
 *     aclrtMemcpy2dAsync -> one MEMCPY node per row;
 *   - aclrtLaunchCallback, npualloc_launch_host_func -> HOST nodes, npualloc_sleep_async -> DELAY;
 *   - aclrtRecordEvent on a capturing stream records the capture point in the event (the event's
 *     real state is untouched); aclrtStreamWaitEvent on such an event makes the waiting stream
 *     depend on that point, and a stream that was not capturing joins the capture (as CUDA).
 *     Waiting for an event recorded outside the capture adds no dependency.  The event's latest
 *     record decides: a record in another capture moves its point there, a record outside every
 *     capture erases it, and a capturing stream waiting for another capture's point fails with
 *     ACL_ERROR_RT_FEATURE_NOT_SUPPORT (both captures stay valid).
 *   - other operations (synchronize, event query) behave as usual: they see only the work queued
 *     before the capture.
 * Every node depends on the previous nodes of its stream (the stream's frontier), so each stream's
 * nodes form a chain; events add cross-stream edges.  Capture end requires every joined stream to
 * be joined back (the capturing stream must have waited for an event recorded after the joined
 * stream's last node), as CUDA's cudaErrorStreamCaptureUnjoined.
 *
 * Memory plan.  An allocation may take the address range of allocation X only when X's FREE node
 * is an ancestor of the new ALLOC node (their lifetimes do not overlap by the graph's
 * dependencies).  Placement is best fit among the gaps left by the conflicting allocations.
 * The lower bound reported is the weight of a set of pairwise conflicting allocations (the live
 * set at the peak of capture order, grown greedily with other conflicting allocations): any
 * valid plan needs at least that much.  Allocations never freed in the graph are its outputs.
 *
 * Launch.  npualloc_graph_launch(exec, stream) maps physical memory behind the graph's range and
 * queues the nodes, in capture order (a topological order), on the stream.  Physical memory is
 * shared per launch stream: every graph launched on one stream maps the same pages (a graph's
 * range is chunked as 2, 2, 4, ... 64, 64 ... MiB; chunk i of every graph maps the stream's chunk
 * i), so graphs on one stream alias each other's memory, and graphs on different streams never
 * share pages.  Chunks that hold an output get pages of their own (an output keeps its data
 * until the graph's next launch).  Mappings stay in place until the executable graph is destroyed
 * or launched on another stream (which first waits for its previous launches).
 *
 * Checked graphs (NPUALLOC_GRAPH_CHECKED) detect uses of graph memory outside an allocation's
 * lifetime: at capture, a MEMCPY/MEMSET touching graph memory not covered by an allocation whose
 * ALLOC node is an ancestor and which has no FREE node yet fails with ACL_ERROR_RT_PARAM_INVALID;
 * a FREE node that is not ordered after every use of its allocation is recorded; after launch,
 * aclrtMemcpy/aclrtMemset (and the async forms, on ordinary streams or captured into another
 * graph, whatever the other operand) touching the graph's range outside its outputs fail with
 * ACL_ERROR_RT_PARAM_INVALID.  Every violation is recorded
 * (npualloc_graph_violation), and instantiating a graph whose capture recorded one fails.
 *
 * Multi-device access.  An allocation records, when captured, the devices that may access it:
 * the capture's access mask if one was given, else the device's graph memory access setting
 * (npualloc_graph_set_mem_access, like cudaMemPoolSetAccess).  Changing the setting later does
 * not change captured allocations.  Copies between graph memory and another device's memory are
 * allowed only for devices in the allocation's mask (peer access enablement does not apply to
 * graph memory, as with CUDA's VMM mappings); at run time a range reused by several allocations
 * is accessible to the union of their masks (CUDA maps such a range for all of them).
 *
 * Pool captures (use_pool): the torch-style alternative.  Allocations on the capturing streams
 * come from the private pool (npualloc_cache_pool_begin with a stream filter), at real, stable
 * addresses; no ALLOC/FREE nodes are recorded and there is no plan.  Several captures may share
 * one pool.  As in torch, the graph holds one reference to the pool from capture_begin until it
 * is destroyed; streams joining the capture take none.
 *
 * Capture modes (params->mode, as aclmdlRICaptureBegin's): while a capture is underway on a device,
 * aclrtMemcpy and aclrtMemset there, the unsafe calls CANN lists that npualloc has, fail with
 * ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT as acl_rt.h describes (GLOBAL: in every thread; THREAD_LOCAL:
 * in the thread that began the capture; RELAXED: nowhere; aclmdlRICaptureThreadExchangeMode changes
 * a thread's part).  The capture is not invalidated.  The caching allocator's own device
 * allocations make no such call, so a capture never blocks them (torch runs them RELAXED).
 *
 * Limits: one device's memory per graph (allocations on another device's capturing stream fail);
 * one live executable graph per graph; a launch cannot be captured; nodes run one after another
 * on the launch stream (branches are not run concurrently).
 */
#ifndef NPUALLOC_GRAPH_PUBLIC_H
#define NPUALLOC_GRAPH_PUBLIC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "acl_rt.h"
#include "npualloc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct npualloc_graph npualloc_graph;
typedef struct npualloc_graph_exec npualloc_graph_exec;

enum { NPUALLOC_GRAPH_CHECKED = 1u };

typedef struct npualloc_capture_params {
    bool has_access;      /* access_mask overrides the device's graph memory access setting */
    uint64_t access_mask; /* bit d: device d may access the capture's allocations */
    bool use_pool;        /* torch-style: allocations come from the private pool `pool` */
    npualloc_mempool_id pool;
    aclmdlRICaptureMode mode; /* which unsafe calls the capture refuses (acl_rt.h); 0: GLOBAL */
} npualloc_capture_params;

typedef enum npualloc_graph_node_kind {
    NPUALLOC_GRAPH_NODE_ALLOC = 0,
    NPUALLOC_GRAPH_NODE_FREE,
    NPUALLOC_GRAPH_NODE_MEMCPY,
    NPUALLOC_GRAPH_NODE_MEMSET,
    NPUALLOC_GRAPH_NODE_HOST,
    NPUALLOC_GRAPH_NODE_DELAY,
    NPUALLOC_GRAPH_NODE_TASK /* any other stream task */
} npualloc_graph_node_kind;

typedef struct npualloc_graph_node {
    npualloc_graph_node_kind kind;
    uint32_t stream;          /* index of the capturing stream (npualloc_graph_stream) */
    const uint32_t *deps;     /* indices of the nodes it depends on (valid while g lives) */
    uint32_t dep_count;
    uint32_t alloc;           /* ALLOC / FREE: the allocation's index */
    uint64_t dst, src, count; /* MEMCPY (dst, src, count) / MEMSET (dst, count) */
    int32_t value;            /* MEMSET */
} npualloc_graph_node;

#define NPUALLOC_GRAPH_NONE UINT32_MAX

typedef struct npualloc_graph_alloc {
    uint64_t address, offset, size; /* size: rounded up to 512 bytes */
    uint64_t requested;
    uint32_t alloc_node, free_node; /* free_node NPUALLOC_GRAPH_NONE: an output */
    uint64_t access_mask;           /* devices that may access it (its own device included) */
} npualloc_graph_alloc;

typedef struct npualloc_graph_plan {
    int32_t device;
    uint64_t base;        /* the graph's address range starts here */
    uint64_t footprint;   /* bytes of the range the plan uses */
    uint64_t lower_bound; /* no valid plan uses less */
    uint64_t mapped;      /* bytes mapped at launch (the footprint rounded up to whole chunks) */
    uint64_t output_bytes;
    size_t alloc_count, node_count, stream_count;
    bool checked, pool_mode, instantiated;
    aclmdlRICaptureMode capture_mode; /* the mode the graph was captured in */
} npualloc_graph_plan;

/* A new, empty graph (flags: NPUALLOC_GRAPH_CHECKED). */
aclError npualloc_graph_create(uint32_t flags, npualloc_graph **out);
/* Drops the caller's reference; the graph goes once its executable graph is destroyed too. */
void npualloc_graph_destroy(npualloc_graph *g);

/* Starts capturing `stream` (NULL: `device`'s default stream) into an empty graph.  params may be
 * NULL (a GLOBAL capture with planned memory).  Fails with ACL_ERROR_RT_FEATURE_NOT_SUPPORT when
 * the stream is already capturing, ACL_ERROR_RT_PARAM_INVALID for a mode that is not one (as
 * aclmdlRICaptureBegin). */
aclError npualloc_graph_capture_begin(npualloc_graph *g, aclrtStream stream, int32_t device,
                                      const npualloc_capture_params *params);
/* Ends the capture (every joined stream leaves capture mode).  Fails with
 * ACL_ERROR_RT_FEATURE_NOT_SUPPORT for an unjoined stream, with
 * ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD when a capture not begun RELAXED ends in another thread
 * than the one that began it (as aclmdlRICaptureEnd), and with ACL_ERROR_INVALID_PARAM when the
 * runtime was shut down since the capture began (the new runtime's memory and pools are left
 * alone); the capture ends all the same, and the graph is then unusable. */
aclError npualloc_graph_capture_end(npualloc_graph *g);
/* *capturing: is the stream in capture mode?  *graph (may be NULL): the graph (borrowed). */
aclError npualloc_stream_capture_status(aclrtStream stream, int32_t device, bool *capturing, npualloc_graph **graph);

/* Finalises the plan and creates the executable graph (one at a time per graph).  Fails with
 * ACL_ERROR_RT_FEATURE_NOT_SUPPORT unless the graph's capture ended well, and until
 * npualloc_graph_capture_end (in another thread) has returned: it still trims the graph's range. */
aclError npualloc_graph_instantiate(npualloc_graph *g, npualloc_graph_exec **out);
/* Queues the graph on a stream of its device (NULL: `device`'s default stream).  Moving to another
 * stream waits for the launches on the stream it was on; from a task of that stream, with a launch
 * queued behind the task, it cannot: ACL_ERROR_RT_FEATURE_NOT_SUPPORT. */
aclError npualloc_graph_launch(npualloc_graph_exec *e, aclrtStream stream, int32_t device);
/* Waits for the launches, unmaps the graph's memory and frees the executable graph.  From a
 * stream's task (a callback), which cannot wait for launches queued behind it, it returns at once
 * and a thread of its own waits and frees (the graph's single executable stays taken until then).
 * As free(), not while another thread is still in npualloc_graph_launch(e): the Python face's
 * GraphExec keeps that order for its users. */
void npualloc_graph_exec_destroy(npualloc_graph_exec *e);
/* The captured graph an executable graph was made from (NULL for NULL). */
npualloc_graph *npualloc_graph_exec_graph(npualloc_graph_exec *e);

/* Introspection (after capture). */
aclError npualloc_graph_get_plan(npualloc_graph *g, npualloc_graph_plan *out);
size_t npualloc_graph_node_count(npualloc_graph *g);
aclError npualloc_graph_get_node(npualloc_graph *g, size_t index, npualloc_graph_node *out);
size_t npualloc_graph_alloc_count(npualloc_graph *g);
aclError npualloc_graph_get_alloc(npualloc_graph *g, size_t index, npualloc_graph_alloc *out);
/* The handle of capture stream `index` (0: a default stream) and its device. */
aclError npualloc_graph_stream(npualloc_graph *g, size_t index, uint64_t *handle, int32_t *device);
/* Violations recorded by a checked graph (the text is copied into buf). */
size_t npualloc_graph_violation_count(npualloc_graph *g);
bool npualloc_graph_violation(npualloc_graph *g, size_t index, char *buf, size_t len);

/* The devices that may access graph memory allocated on `device` from now on (bit d = device d;
 * the device itself is always included), like cudaMemPoolSetAccess on its graph memory pool. */
aclError npualloc_graph_set_mem_access(int32_t device, uint64_t mask);
/* ACL_ERROR_INVALID_PARAM for a NULL mask, ACL_ERROR_RT_INVALID_DEVICEID for an unknown device. */
aclError npualloc_graph_get_mem_access(int32_t device, uint64_t *mask);

/* aclrtLaunchCallback with ownership of user_data: on a capturing stream the callback becomes a
 * HOST node run at every launch and destroy(user_data) runs when the graph is destroyed;
 * otherwise fn runs once and destroy right after it, on the same thread.  Which one is decided
 * with the capture itself, so a capture beginning or ending meanwhile on another thread takes the
 * callback whole or not at all.  On failure the caller keeps user_data. */
aclError npualloc_launch_host_func(aclrtStream stream, aclrtCallback fn, void *user_data, void (*destroy)(void *),
                                   aclrtCallbackBlockType block);

/* The message of the calling thread's last failed npualloc_graph_* call. */
const char *npualloc_graph_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* NPUALLOC_GRAPH_PUBLIC_H */
