/*
 * npualloc.h - the npualloc core API: what the virtual NPU offers beyond the aclrt* names
 * (configuration, introspection, test hooks).  The aclrt* functions are in acl_rt.h.
 *
 * Every function that can fail returns an aclError (0 = success), ACL_ERROR_INVALID_PARAM for a NULL
 * pointer it needs.  The others ignore a NULL output (they write nothing there).
 */
#ifndef NPUALLOC_H
#define NPUALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "acl_rt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- configuration (before the devices start) ----
 * The defaults named below are npualloc_config_from_env's: start from it and change fields.  A field left
 * 0 means 0, not the default: a struct with only device_memory set has no memory usable as 2 MiB pages, so
 * the caching allocator (which maps 2 MiB pages) finds the device out of memory at once. */
typedef struct npualloc_config {
    int32_t device_count;   /* NPUALLOC_DEVICE_COUNT, default 8 */
    uint64_t device_memory; /* NPUALLOC_DEVICE_MEMORY: HBM per device, default 64 GiB */
    uint64_t huge_memory;   /* NPUALLOC_HUGE_MEMORY: HBM usable as 2 MiB pages, default all */
    uint64_t huge1g_memory; /* NPUALLOC_HUGE1G_MEMORY: 1 GiB page pool, default 0 */
    uint64_t ddr_memory;    /* NPUALLOC_DDR_MEMORY: low-bandwidth memory per device, default 0 */
} npualloc_config;

/* Parses "123", "64GiB", "1.5G", "512 MiB": bytes or KiB/MiB/GiB/TiB (K/M/G/T are the same
 * binary units).  Returns 0, or -1 when the text is not a size (or text or out is NULL). */
int npualloc_parse_size(const char *text, uint64_t *out);

/* Reads the NPUALLOC_* variables over the defaults.  On a malformed value returns
 * ACL_ERROR_INVALID_PARAM and writes a message naming the variable and the value. */
aclError npualloc_config_from_env(npualloc_config *out, char *err, size_t errlen);

/* Checks a configuration (message in err on failure). */
aclError npualloc_config_check(const npualloc_config *cfg, char *err, size_t errlen);

/* Sets the configuration used when the devices start.  ACL_ERROR_INVALID_PARAM (with a message) for an
 * inconsistent configuration, checked first; else ACL_ERROR_REPEAT_INITIALIZE once they have started. */
aclError npualloc_configure(const npualloc_config *cfg, char *err, size_t errlen);

/* True once the devices have started. */
bool npualloc_initialized(void);
/* Why the last start failed (a malformed environment), or NULL.  The text is the calling thread's
 * copy, valid until its next call. */
const char *npualloc_init_error(void);
/* The configuration in effect (starts the devices). */
aclError npualloc_get_config(npualloc_config *out);

/* ---- streams ---- */
/* Enqueues a delay on a stream (NULL: the current device's default stream). */
aclError npualloc_sleep_async(aclrtStream stream, double seconds);
/* True when the calling thread runs a stream's task or callback (a stream's worker, or a callback
 * inside aclrtProcessReport).  A blocking call there, such as aclrtDestroyStream, may wait for work
 * that waits for the caller: its own stream, or a stream waiting for an event behind it. */
bool npualloc_in_stream_task(void);

/* ---- errors and warnings of the torch-like layer ---- */
/* How a failure surfaces in Python (torch raises these types). */
typedef enum npualloc_error_kind {
    NPUALLOC_ERR_NONE = 0,
    NPUALLOC_ERR_RUNTIME, /* RuntimeError */
    NPUALLOC_ERR_VALUE,   /* ValueError */
    NPUALLOC_ERR_TYPE,    /* TypeError */
    NPUALLOC_ERR_OOM      /* OutOfMemoryError (a RuntimeError) */
} npualloc_error_kind;

/* The message and kind of the calling thread's last failed npualloc_cache_* call. */
const char *npualloc_last_error(npualloc_error_kind *kind);
/* The error-suffix parts torch_npu appends to that message (PTA_ERROR / OPS_ERROR: "\n[ERROR] <time>
 * (PID:.., Device:.., RankID:..) ERR<submodule:02><code:03> <PTA|OPS> <text>"): submodule 0 (PTA) or 1 (OPS)
 * and the ErrCode, or submodule -1 when torch_npu adds none (so far only settings errors carry one). */
void npualloc_last_error_suffix(int *submodule, int *code);
/* Pops the oldest pending warning of the calling thread (torch would emit it with TORCH_WARN in the thread
 * whose call made it); false when none.  Up to 32 warnings of all threads are kept: the oldest goes. */
bool npualloc_pop_warning(char *buf, size_t len);
/* Cheap check for the calling thread's pending warnings (no lock; may say true when another thread's
 * warnings pushed its last one out). */
bool npualloc_has_warnings(void);

/* ---- the caching allocator (torch_npu's NPUCachingAllocator) ---- */
typedef struct npualloc_stat {
    int64_t current, peak, allocated, freed;
} npualloc_stat;

enum { NPUALLOC_STAT_ALL = 0, NPUALLOC_STAT_SMALL_POOL = 1, NPUALLOC_STAT_LARGE_POOL = 2, NPUALLOC_STAT_TYPES = 3 };

typedef struct npualloc_stats {
    npualloc_stat allocation[NPUALLOC_STAT_TYPES];
    npualloc_stat segment[NPUALLOC_STAT_TYPES];
    npualloc_stat active[NPUALLOC_STAT_TYPES];
    npualloc_stat inactive_split[NPUALLOC_STAT_TYPES];
    npualloc_stat allocated_bytes[NPUALLOC_STAT_TYPES];
    npualloc_stat reserved_bytes[NPUALLOC_STAT_TYPES];
    npualloc_stat active_bytes[NPUALLOC_STAT_TYPES];
    npualloc_stat inactive_split_bytes[NPUALLOC_STAT_TYPES];
    npualloc_stat requested_bytes[NPUALLOC_STAT_TYPES];
    npualloc_stat oversize_allocations;
    npualloc_stat oversize_segments;
    int64_t num_alloc_retries;
    int64_t num_ooms;
    int64_t max_split_size; /* -1 when unlimited */
    int64_t num_sync_all_streams;
    int64_t num_device_alloc;
    int64_t num_device_free;
    int64_t num_oom_rejections;
} npualloc_stats;

/* What an out-of-memory failure saw (for torch_npu's message and the OOM observers). */
typedef struct npualloc_oom_info {
    int32_t device;
    bool over_1eb;        /* the request was 1 EB or more */
    bool preemptive;      /* throw_on_npumalloc_oom rejected it before trying the device */
    size_t requested;     /* the caller's size */
    size_t alloc_size;    /* what the allocator tried to get from the device */
    size_t device_total, device_free;
    size_t allocated, active, reserved; /* allocated_bytes / active_bytes / reserved_bytes, all pools */
    bool fraction_set;
    size_t allowed;       /* the fraction's limit, when set */
} npualloc_oom_info;

/* Allocates `size` bytes for `stream` (a stream handle, 0 = the device's default stream): torch_npu's
 * raw_alloc (caching_allocator_alloc), which has no 1 EB check (npualloc_allocate has): 2^60 bytes
 * take the ordinary path to its OOM; 2^63 or more, which torch_npu's size arithmetic would wrap,
 * get the 1 EB message.  size 0 gives NULL.  On out-of-memory returns ACL_ERROR_RT_MEMORY_ALLOCATION;
 * the message (npualloc_last_error, kind OOM) is torch_npu's, and npualloc_cache_last_oom() has the
 * figures. */
aclError npualloc_cache_malloc(int32_t device, size_t size, uint64_t stream, void **ptr);
/* Frees a pointer from npualloc_cache_malloc (NULL is ignored). */
aclError npualloc_cache_free(void *ptr);
/* The out-of-memory figures of this thread's last failed allocation. */
void npualloc_cache_last_oom(npualloc_oom_info *out);

/* A pluggable allocator (torch_npu's NPUPluggableAllocator and change_current_allocator), with
 * torch_npu's signatures: alloc_fn(size, device, stream) and free_fn(ptr, size, device, stream). */
typedef void *(*npualloc_alloc_fn)(size_t size, int device, aclrtStream stream);
typedef void (*npualloc_free_fn)(void *ptr, size_t size, int device, aclrtStream stream);
/* From now on npualloc_cache_malloc and npualloc_allocate (and the Python face) allocate with
 * alloc_fn, passing the size as asked and the stream as given; npualloc_cache_free frees such a
 * pointer with free_fn, told its size, device and stream (the caching allocator's pointers still
 * free as before).  record_stream and erase_stream do nothing to its pointers, as in torch_npu.
 * An allocation on a capturing stream stays a graph ALLOC node (npualloc_graph.h).  The caching
 * allocator's rules for sizes do not apply to alloc_fn's pointers: it is asked for every size (0 and
 * 2^60 or more too), and a NULL it returns is the allocation's result (ACL_SUCCESS with *ptr NULL).
 * Refused with ACL_ERROR_REPEAT_INITIALIZE and torch_npu's "Can't swap an already initialized
 * allocator" once the allocator in use is initialized: the caching allocator after any device's
 * cache started (its first allocation, or a read of its statistics, fraction or a pool's use count),
 * a pluggable one always.  Until npualloc_shutdown (or fork: the child starts with
 * the caching allocator). */
aclError npualloc_allocator_change(npualloc_alloc_fn alloc_fn, npualloc_free_fn free_fn);
/* True while a pluggable allocator is current. */
bool npualloc_allocator_is_pluggable(void);
/* torch_npu's out-of-memory message for `info` (what npualloc_last_error gives after the failure), as
 * snprintf writes it: the length it needed, -1 for a NULL info (or a NULL buf with len > 0). */
int npualloc_format_oom(const npualloc_oom_info *info, char *buf, size_t len);
/* torch's format_size: "512 bytes", "1.50 KiB", "2.00 MiB", "3.25 GiB". */
void npualloc_format_size(uint64_t size, char *buf, size_t len);

/* Marks a live block as used on another stream: its memory is reused only after the work
 * queued on that stream when the block is freed has run.  `stream` is a stream handle of any
 * device, or 0 for the default stream of the block's device. */
aclError npualloc_cache_record_stream(void *ptr, uint64_t stream);
/* torch_npu.erase_stream: forgets such a use (and cancels its pending event). */
aclError npualloc_cache_erase_stream(void *ptr, uint64_t stream);
/* The same, with the stream's device given: 0 is then `device`'s default stream, which may be
 * another device than the block's (as torch_npu's record_stream takes any device's stream).  A
 * negative or unknown device is ACL_ERROR_INVALID_PARAM. */
aclError npualloc_cache_record_stream_on(void *ptr, int32_t device, uint64_t stream);
aclError npualloc_cache_erase_stream_on(void *ptr, int32_t device, uint64_t stream);

/* Synchronizes the devices in use and returns every unused cached segment to them. */
aclError npualloc_cache_empty(void);
/* torch_npu's empty_virt_addr_cache: like empty_cache, but the physical pages of expandable
 * segments are kept (unmapped) for the next mapping instead of being freed; whole free plain
 * segments and freeable private pools are still released, as in torch_npu.  Fails with
 * ACL_ERROR_INVALID_PARAM unless expandable_segments:True. */
aclError npualloc_cache_empty_virt_addr_cache(void);
aclError npualloc_cache_set_fraction(int32_t device, double fraction);
aclError npualloc_cache_get_fraction(int32_t device, double *fraction);
aclError npualloc_cache_get_stats(int32_t device, npualloc_stats *out);
aclError npualloc_cache_reset_peak(int32_t device);
aclError npualloc_cache_reset_accumulated(int32_t device);

/* torch's allocate() path (tensors, npualloc.empty): like npualloc_cache_malloc, but 2^60 bytes
 * or more fail at once with "NPU out of memory. Tried to allocate more than 1EB memory." (no
 * counters, no observers), and with PYTORCH_NO_NPU_MEMORY_CACHING set (to a non-zero number) memory
 * comes straight from the device and goes back on free (after a device synchronize), bypassing the
 * cache and stats; a device out of range is then aclrtMallocAlign32's ACL_ERROR_RT_INVALID_DEVICEID (the
 * cache's ACL_ERROR_INVALID_PARAM otherwise), with torch_npu's "NPU error: aclrtMallocAlign32 ..." message. */
aclError npualloc_allocate(int32_t device, size_t size, uint64_t stream, void **ptr);
/* Frees memory from npualloc_allocate or npualloc_cache_malloc. */
aclError npualloc_deallocate(void *ptr);
/* True when PYTORCH_NO_NPU_MEMORY_CACHING bypasses the cache. */
bool npualloc_caching_disabled(void);

/* The device, stream and size of a live block (ACL_ERROR_INVALID_PARAM if ptr is not one). */
aclError npualloc_cache_block_info(void *ptr, int32_t *device, uint64_t *stream, size_t *size);

/* ---- snapshots and memory history ---- */
/* An immutable, reference-counted blob that describes where an allocation came from (the
 * Python layer stores a call stack in it).  The allocator keeps contexts for blocks, segments
 * and trace entries; they are freed when nothing refers to them any more. */
typedef struct npualloc_context npualloc_context;
/* A new context holding a copy of data (reference count 1), or NULL when out of memory, for more than
 * UINT32_MAX bytes, or for data NULL with len > 0. */
npualloc_context *npualloc_context_create(const void *data, size_t len);
void npualloc_context_retain(npualloc_context *ctx);
void npualloc_context_release(npualloc_context *ctx);
const void *npualloc_context_data(const npualloc_context *ctx, size_t *len);

/* How much context the history keeps (torch's RecordContext). */
typedef enum npualloc_record_context {
    NPUALLOC_RECORD_NEVER = 0,
    NPUALLOC_RECORD_STATE = 1, /* blocks and segments remember where they were allocated */
    NPUALLOC_RECORD_ALLOC = 2, /* ... and so do alloc trace entries */
    NPUALLOC_RECORD_ALL = 3    /* ... and frees */
} npualloc_record_context;
/* The level set by the last npualloc_cache_record_history (to decide whether to gather);
 * NEVER again after npualloc_shutdown and in a forked child, whose fresh caches record nothing. */
npualloc_record_context npualloc_cache_record_context(void);

/* npualloc_cache_malloc / free with the caller's context (may be NULL; borrowed). */
aclError npualloc_cache_malloc_ctx(int32_t device, size_t size, uint64_t stream, npualloc_context *ctx, void **ptr);
/* npualloc_allocate with the caller's context (used when the memory comes from the cache). */
aclError npualloc_allocate_ctx(int32_t device, size_t size, uint64_t stream, npualloc_context *ctx, void **ptr);
/* The same allocation when the cache can serve it at once: true with *ptr set, or false with
 * nothing changed when it would need the device, a wait, a contended lock, or a started
 * allocator (then call npualloc_cache_malloc_ctx).  Never blocks, so a binding can call it
 * without giving up its interpreter lock. */
bool npualloc_cache_malloc_cached(int32_t device, size_t size, uint64_t stream, npualloc_context *ctx, void **ptr);
aclError npualloc_cache_free_ctx(void *ptr, npualloc_context *ctx);
/* npualloc_cache_empty with the caller's context (may be NULL; borrowed): at record level ALL its
 * segment_free trace entries keep it (torch's emptyCache gathers one). */
aclError npualloc_cache_empty_ctx(npualloc_context *ctx);
typedef enum npualloc_block_state {
    NPUALLOC_BLOCK_INACTIVE = 0,
    NPUALLOC_BLOCK_ACTIVE_ALLOCATED = 1,
    NPUALLOC_BLOCK_ACTIVE_PENDING_FREE = 2
} npualloc_block_state;

typedef struct npualloc_block_info {
    uint64_t address, size, requested_size;
    npualloc_block_state state;
    npualloc_context *frames; /* where it was allocated (NULL if not recorded) */
} npualloc_block_info;

typedef struct npualloc_segment_info {
    int32_t device;
    uint64_t address, total_size, allocated_size, active_size, requested_size;
    uint64_t stream;
    bool is_small, is_expandable;
    uint64_t pool_id[2];             /* the owning pool ((0, 0) = default) */
    size_t first_block, block_count; /* range in npualloc_snapshot.blocks */
    npualloc_context *frames;        /* where the segment was allocated (NULL if not recorded) */
} npualloc_segment_info;

typedef enum npualloc_trace_action {
    NPUALLOC_TRACE_ALLOC,
    NPUALLOC_TRACE_FREE_REQUESTED,
    NPUALLOC_TRACE_FREE_COMPLETED,
    NPUALLOC_TRACE_SEGMENT_ALLOC,
    NPUALLOC_TRACE_SEGMENT_FREE,
    NPUALLOC_TRACE_SEGMENT_MAP,
    NPUALLOC_TRACE_SEGMENT_UNMAP,
    NPUALLOC_TRACE_SNAPSHOT,
    NPUALLOC_TRACE_OOM
} npualloc_trace_action;

typedef struct npualloc_trace_info {
    int32_t device;
    npualloc_trace_action action;
    uint64_t addr; /* for OOM: the device's free bytes */
    uint64_t size;
    uint64_t stream;
    int64_t time_us;
    npualloc_context *frames; /* NULL if not recorded */
    npualloc_context *user_metadata; /* the device's metadata when recorded, or NULL for none */
} npualloc_trace_info;

typedef struct npualloc_snapshot {
    npualloc_segment_info *segments; /* by device, then address */
    size_t segment_count;
    npualloc_block_info *blocks;
    size_t block_count;
    npualloc_trace_info *traces;     /* by device, oldest first */
    size_t trace_count;
} npualloc_snapshot;

/* Takes a snapshot of every started device (and appends a SNAPSHOT trace entry after the
 * traces were copied, as torch does).  The snapshot holds references to its contexts. */
aclError npualloc_cache_snapshot(npualloc_snapshot **out);
void npualloc_snapshot_free(npualloc_snapshot *snap);
/* Starts or stops recording the memory history of every device (a ring of max_entries trace
 * entries, and contexts as `when` says); both clear what was recorded.  ACL_ERROR_INVALID_PARAM
 * when `when` is not a npualloc_record_context. */
aclError npualloc_cache_record_history(bool enabled, npualloc_record_context when, size_t max_entries);

/* torch's newer recordHistory options. */
typedef struct npualloc_history_options {
    /* Drop what was recorded so far.  Otherwise an enabling call keeps the history, trimmed to its
     * newest max_entries entries (torch >= 2.3); stopping always clears it. */
    bool clear_history;
    /* Actions left out of the history from now on: NPUALLOC_TRACE_SKIP(action) bits. */
    uint32_t skip_actions;
} npualloc_history_options;
#define NPUALLOC_TRACE_SKIP(action) (1u << (unsigned)(action))
/* npualloc_cache_record_history with options (npualloc_cache_record_history is this with
 * clear_history and no skipped action).  ACL_ERROR_INVALID_PARAM also when opts is NULL or
 * skip_actions has a bit that is no npualloc_trace_action. */
aclError npualloc_cache_record_history_opts(bool enabled, npualloc_record_context when, size_t max_entries,
                                            const npualloc_history_options *opts);

/* torch's setUserMetadata / getUserMetadata: `len` bytes attached to the device's trace entries recorded
 * from now on (len 0: none).  The getter gives a reference to the current bytes (NULL for none), to
 * read with npualloc_context_data and drop with npualloc_context_release.  ACL_ERROR_INVALID_PARAM for a
 * device out of range or a NULL pointer, ACL_ERROR_BAD_ALLOC out of host memory. */
aclError npualloc_cache_set_user_metadata(int32_t device, const void *data, size_t len);
aclError npualloc_cache_get_user_metadata(int32_t device, npualloc_context **out);

/* ---- private memory pools (torch's MemPool / graph_pool_handle) ---- */
typedef struct npualloc_mempool_id {
    uint64_t first, second; /* (0, 0) is the default pool */
} npualloc_mempool_id;

/* A new pool id: user-created ids are (0, n), internal ones (n, 0), counters shared as torch. */
npualloc_mempool_id npualloc_mempool_id_new(bool user_created);
/* Creates the pool on a device, or takes another reference to it. */
aclError npualloc_cache_pool_create(int32_t device, npualloc_mempool_id id);
/* torch's MemPool(allocator): a pool whose segments come from alloc_fn (told the segment's size,
 * the device and the allocating stream) and go back through free_fn, instead of from the device;
 * plain segments, never expandable ones, as in torch.  alloc_fn must return memory of that device
 * (from aclrtMalloc, for instance) or NULL (out of memory: the allocator then frees cached memory
 * of the pool and retries, as for the device).  Both run under the device's allocator lock: they
 * must not call the caching allocator.  Creating an existing pool takes a reference when the
 * functions are the same, and fails otherwise. */
aclError npualloc_cache_pool_create_with_allocator(int32_t device, npualloc_mempool_id id, npualloc_alloc_fn alloc_fn,
                                                   npualloc_free_fn free_fn);
/* Drops a reference; at zero the pool's memory returns to the device once its blocks are free
 * (at the next empty_cache / last-resort release). */
aclError npualloc_cache_pool_release(int32_t device, npualloc_mempool_id id);
/* References held on a pool (0 when it does not exist). */
int npualloc_cache_pool_use_count(int32_t device, npualloc_mempool_id id);
/* torch's setUseOnOOM (MemPool(use_on_oom=True); ~MemPool clears it): when an allocation of the
 * default pools finds no cached block and the device, out of memory, refuses a new segment (207001;
 * not another failure of it), it takes a free block of a marked pool before any cached memory is
 * released: the first marked pool (in the order they were marked; torch's order is a hash set's)
 * with a block that fits, by the pool's own search rules (same stream, best fit, oversize limits).
 * The block stays the pool's (snapshot, stats kind, and its free returns it there).  Never for a
 * request already routed to a private pool; a pool nobody holds (use count 0) is skipped; a marked
 * pool that a capture or use_mem_pool records into fails that allocation with "beginAllocateToPool:
 * already recording to mempool_id", as in torch.  Marking needs an existing pool
 * (ACL_ERROR_INVALID_PARAM otherwise); clearing an unknown pool does nothing. */
aclError npualloc_cache_pool_set_use_on_oom(int32_t device, npualloc_mempool_id id, bool use_on_oom);
/* torch's setNoSplit (MemPool(no_split=True)): the pool's blocks are never split, so every
 * allocation takes a whole free block (a new segment: all of it); sizes, segment sizes and the
 * base_addr_aligned_kb front split are unchanged, as in torch_npu.  The pool must exist
 * (ACL_ERROR_INVALID_PARAM); it keeps the setting for its life. */
aclError npualloc_cache_pool_set_no_split(int32_t device, npualloc_mempool_id id);

/* The `value` of npualloc_cache_pool_begin says which: the thread's (uint64_t)pthread_self() (another value
 * routes nothing: no thread has it), or a stream handle as npualloc_cache_malloc takes it. */
typedef enum npualloc_pool_filter {
    NPUALLOC_POOL_FILTER_THREAD = 0, /* allocations by this thread (use_mem_pool) */
    NPUALLOC_POOL_FILTER_STREAM = 1  /* allocations on this stream (a capture) */
} npualloc_pool_filter;

/* Routes matching allocations to the pool until npualloc_cache_pool_end (torch's
 * beginAllocateToPool / endAllocateToPool); takes a reference while routing.  One recording per
 * pool at a time, as torch: fails ("beginAllocateToPool: already recording to mempool_id") while
 * any route to the pool is active, whatever its filter, and then takes no reference. */
aclError npualloc_cache_pool_begin(int32_t device, npualloc_mempool_id id, npualloc_pool_filter filter,
                                   uint64_t value);
/* A stream joining a capture that records to the pool (begun with a stream filter): its
 * allocations go to the pool as part of that recording (torch's capture filter matches every
 * stream of the capture).  Takes no reference (the begin's covers the recording); ended by
 * npualloc_cache_pool_end like a begin, newest route first, which then drops none. */
aclError npualloc_cache_pool_join(int32_t device, npualloc_mempool_id id, uint64_t stream);
aclError npualloc_cache_pool_end(int32_t device, npualloc_mempool_id id);
/* Releases what a pool no longer uses (torch's emptyCache(mempool_id)). */
aclError npualloc_cache_pool_empty(int32_t device, npualloc_mempool_id id);

/* torch_npu.npu.memory._set_allocator_settings(text). */
aclError npualloc_cache_set_settings(const char *text);
/* The settings text in effect (what PYTORCH_NPU_ALLOC_CONF or the last change said), copied into buf
 * as snprintf copies (cut to len - 1 bytes, NUL-terminated when len > 0); returns its whole length, so
 * a result >= len means buf was too small.  A copy, because another thread may change the settings. */
size_t npualloc_cache_settings_text(char *buf, size_t len);

/* torch's FreeMemoryCallback registry (FreeNPUMemoryCallbacksRegistry): callbacks that can give
 * memory back to the allocator, e.g. by dropping tensors an extension still holds.
 *
 * When a malloc on any device finds no cached block that fits, it runs every registered callback,
 * in registration order, before it asks the device for memory (and so before garbage
 * collection, releasing cached segments or the retry).  If any callback returns true ("I freed
 * something") the cache is searched once more, so a block the callback freed with
 * npualloc_cache_free serves the request.
 *
 * A callback runs on the allocating thread with no npualloc lock held (the device's allocator
 * lock is released around it), so it may call any npualloc function, npualloc_cache_free in
 * particular; another thread may use the allocator meanwhile.  It must be thread-safe and must
 * not assume it is called once per malloc.  At most 8 callbacks; they cannot be removed.
 * Returns ACL_ERROR_INVALID_PARAM for NULL or when 8 are registered. */
typedef bool (*npualloc_free_memory_callback)(void);
aclError npualloc_cache_add_free_memory_callback(npualloc_free_memory_callback fn);

/* Checks every invariant of a device's allocator: blocks tile their segments, live blocks
 * never overlap, free neighbours are merged, the pools hold exactly the free blocks, and the
 * stats equal what the blocks imply.  Returns ACL_SUCCESS or ACL_ERROR_INTERNAL_ERROR with the
 * first violation in `why` (len bytes; why may be NULL only with len 0, else
 * ACL_ERROR_INVALID_PARAM); ACL_ERROR_BAD_ALLOC when out of host memory to check. */
aclError npualloc_cache_check(int32_t device, char *why, size_t len);

/* ---- fault injection (tests) ---- */
typedef enum npualloc_fault_kind {
    NPUALLOC_FAULT_DEVICE_ALLOC = 0, /* a device allocation (aclrtMalloc, aclrtMallocPhysical, a caching
                                        segment or expandable page), page-kind fallbacks included: fails as out
                                        of memory (207001) */
    NPUALLOC_FAULT_MAP = 1,          /* mapping memory into a range: fails as ENOMEM (207005) */
    NPUALLOC_FAULT_MEMFILE = 2,      /* creating a memory file: fails as EMFILE (207005) */
    NPUALLOC_FAULT_RESERVE = 3,      /* reserving an address range: fails as a runtime without virtual
                                        memory management does (ACL_ERROR_RT_FEATURE_NOT_SUPPORT, 207000) */
    NPUALLOC_FAULT_KINDS = 4
} npualloc_fault_kind;
/* Makes the nth operation of `kind` from now fail once (0 disarms).  NPUALLOC_FAULT=
 * "device_alloc:N,map:N,memfile:N,reserve:N" arms the same when the runtime starts. */
aclError npualloc_fault_set(npualloc_fault_kind kind, uint64_t nth);
/* Operations of `kind` seen since it was armed, and failures injected so far. */
void npualloc_fault_counts(npualloc_fault_kind kind, uint64_t *seen, uint64_t *injected);

/* ---- introspection ---- */
typedef struct npualloc_vmm_counts {
    size_t physical_handles; /* live physical handles (including freed-but-still-mapped) */
    size_t reservations;     /* reserved address ranges, including those behind aclrtMalloc */
    size_t mappings;         /* live mappings */
    size_t fds_kept;         /* memory-file descriptors held open */
} npualloc_vmm_counts;
void npualloc_vmm_counts_get(npualloc_vmm_counts *out);

/* Releases every resource (memory, streams, events) and stops the devices; the next call
 * starts them again.  Tests use it before checking for leaks.  As aclFinalize, it must not run
 * while other threads still call into the runtime: a call racing it may fail, or use what it
 * releases.  Refused from a stream's task (a callback) with ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
 * changing nothing: it would wait for that task's own stream. */
aclError npualloc_shutdown(void);
/* Changes whenever the runtime's objects go away (npualloc_shutdown, a fork child): pointers
 * remembered from an older generation may name someone else's memory now.  (Physical memory,
 * stream and event handles never do: an old one is refused as stale.) */
uint64_t npualloc_runtime_generation(void);

/* True once everything queued so far on the stream has run (stream 0: `device`'s default
 * stream). */
aclError npualloc_stream_query(aclrtStream stream, int32_t device, bool *done);

/* The caching allocator's settings in effect (what _snapshot() reports as allocator_settings). */
typedef struct npualloc_allocator_settings {
    size_t max_split_size; /* SIZE_MAX: unlimited */
    size_t max_non_split_rounding_size;
    double garbage_collection_threshold;
    bool expandable_segments;
    size_t roundup_power2_divisions[16];
    size_t base_addr_aligned_size;
    bool page_size_1g;
    size_t large_segment_size;
    bool release_lock_on_npumalloc;
    bool throw_on_npumalloc_oom;
    bool multi_stream_lazy_reclaim;
} npualloc_allocator_settings;
aclError npualloc_cache_get_settings(npualloc_allocator_settings *out);

#ifdef __cplusplus
}
#endif
#endif /* NPUALLOC_H */
