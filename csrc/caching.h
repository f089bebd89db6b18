/*
 * caching.h - internals of the caching allocator (torch_npu's NPUCachingAllocator), shared by
 * caching.c (the per-device algorithm) and caching_api.c (settings, the public API, reports).
 *
 * Vocabulary, as in torch: a segment is one piece of device memory obtained from the runtime
 * (aclrtMallocAlign32); it is tiled by blocks, linked in address order (prev/next).  A block is
 * allocated (handed to a user), pending (freed by the user but waiting for events recorded on
 * streams that used it), or free (cached in a pool, reusable).
 *
 * Invariants (npualloc_cache_check verifies them):
 *   - the blocks of a segment tile it exactly and never overlap;
 *   - two neighbouring blocks are never both free (free_block merges them);
 *   - a block is in its pool iff it is free; in allocated_blocks iff allocated;
 *   - every pool's free-block index is ordered and consistent (block_pool_check);
 *   - the stats equal what the blocks imply (allocated, active, reserved bytes and counts);
 *   - a private pool's segment count is the plain and expandable segments it owns.
 *
 * Locking: each device cache has one mutex (owned by it) guarding everything below; it is
 * released only around device synchronisation and free-memory callbacks.  Settings are
 * changed with every device lock held, so the algorithm reads them under its own lock.
 */
#ifndef NPUALLOC_CACHING_H
#define NPUALLOC_CACHING_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "alloc_conf.h"
#include "block_pool.h"
#include "cache_lock.h"
#include "npualloc.h"
#include "ptr_map.h"
#include "stream.h"

#define K_MIN_BLOCK_SIZE ((size_t)512)
#define K_SMALL_SIZE ((size_t)1 << 20)
#define K_SMALL_BUFFER ((size_t)2 << 20)
#define K_MIN_LARGE_ALLOC ((size_t)10 << 20)
#define K_ROUND_LARGE ((size_t)2 << 20)
#define K_LARGE_BUFFER ((size_t)20 << 20)
#define K_EXTRA_LARGE_BUFFER ((size_t)1 << 30)
#define K_PAD_SIZE ((size_t)32)
#define K_ONE_EB ((size_t)1 << 60)
/* raw_alloc sizes from here on would wrap around in torch_npu's size arithmetic (only a negative
 * Python size gets there): refused with the 1 EB message instead. */
#define K_RAW_ALLOC_LIMIT ((size_t)1 << 63)

typedef struct expandable_segment expandable_segment;

struct cache_block {
    /* Laid out by use, in three 64-byte lines (the structs are line-aligned, caching.c): the
     * first holds what a bin walk reads (links, address, size) and the segment neighbours, the
     * second the state flags and the rest of what a cache hit writes, the third what a hit at
     * most reads (expandable segment, context) and what record_stream, sharing and the spare
     * list use.  Measured: 12% fewer L1 misses than the previous order (README). */
    _Alignas(64) avl_node pool_node; /* in pool->blocks while free and mapped, in pool->unmapped while unmapped */
    uintptr_t ptr;
    size_t size;
    cache_block *prev, *next; /* neighbours in the segment, address order */
    bool allocated;
    bool in_pool;
    bool mapped;              /* false only for the unmapped address space of an expandable segment */
    bool oversize_alloc;      /* counted in oversize_allocations when allocated */
    bool oversize_segment;    /* its segment was counted in oversize_segments (same on every block) */
    bool shared;              /* a share of this allocation exists (cache_share_freed is told) */
    int32_t event_count;      /* events still to complete before the free finishes */
    uint32_t use_count;       /* streams in uses (record_stream) */
    uint32_t pool_bin;        /* the size-class bin holding it while in_pool (block_pool.c) */
    stream_bins *pool_bins;   /* and its stream's bins (kept when it leaves): no stream lookups */
    block_pool *pool;
    uint64_t stream;          /* stream handle the block belongs to (0 = default stream) */
    size_t requested_size;    /* the size asked for at the last allocation (stale once freed) */
    uint64_t gc_base;         /* pool->search_count when the block last became free */
    expandable_segment *es;   /* the expandable segment the block lies in, or NULL */
    npualloc_context *ctx;    /* where it was allocated, while allocated (history) */
    uint64_t *uses;           /* streams recorded with record_stream while allocated (use_capacity of room) */
    uint32_t use_capacity;
    /* sharing pin (npualloc.share, ipc_share.c): while another process has the block open, a
     * free by its owner waits (like a block waiting for events) until the last one closed. */
    uint32_t share_pins;      /* opens in other processes */
    npualloc_context *segment_ctx; /* on a segment's first block: where the segment was allocated */
    cache_block *free_link;   /* the device's list of spare block structs */
    cache_block *pinned_next; /* the device's list of freed blocks waiting for their pins */
};

/* One recorded use of a freed block on a stream (torch's per-stream event FIFO entry). */
typedef struct pending_event {
    struct pending_event *next;
    npu_stream *stream; /* pinned until the entry is consumed */
    uint64_t position;  /* the stream's last task when the block was freed */
    uint64_t seq;       /* order of insertion (device_cache.event_seq) */
    cache_block *block;
} pending_event;

typedef struct event_queue {
    uint64_t stream_id;
    pending_event *head, *tail;
} event_queue;

/* One trace entry of the memory history (torch's TraceEntry). */
typedef enum trace_action {
    TRACE_ALLOC,
    TRACE_FREE_REQUESTED,
    TRACE_FREE_COMPLETED,
    TRACE_SEGMENT_ALLOC,
    TRACE_SEGMENT_FREE,
    TRACE_SEGMENT_MAP,
    TRACE_SEGMENT_UNMAP,
    TRACE_SNAPSHOT,
    TRACE_OOM,
    TRACE_ACTION_COUNT
} trace_action;

typedef struct trace_entry {
    trace_action action;
    uintptr_t addr; /* for TRACE_OOM: the device's free bytes */
    size_t size;
    uint64_t stream;
    int64_t time_us;
    npualloc_context *ctx;      /* held while the entry is */
    npualloc_context *metadata; /* the user metadata then (torch's user_metadata), held likewise */
} trace_entry;

/* Drops what an entry holds. */
void trace_entry_drop(trace_entry *e);

struct npualloc_context {
    _Atomic uint32_t refs;
    uint32_t len;
    char data[];
};

/* An expandable segment: a reserved range per (stream, pool) into which pages are mapped on
 * demand, lowest address first (torch's ExpandableSegment). */
struct expandable_segment {
    expandable_segment *next; /* the device's list */
    uint64_t stream;
    block_pool *pool;
    uintptr_t base;
    size_t page_size;
    size_t pages;      /* the reserved range holds this many pages */
    uint64_t *handles; /* per page: the backend's handle, 0 while unmapped; grown on demand */
    size_t handle_count; /* entries in handles: the pages from here on are unmapped */
    size_t mapped_pages;
};

/* A private pool (torch's PrivatePool: MemPool, graph captures): its own small and large block
 * pools; memory goes back to the device only once the pool is no longer used (use_count 0)
 * and its blocks are free. */
struct private_pool {
    private_pool *next; /* the device's list */
    npualloc_mempool_id id;
    block_pool small, large;
    int use_count;      /* holders (MemPool objects, captures) */
    int mallocs_underway; /* allocations into the pool that release the device lock on their way (a
                           * cache miss): the pool outlives them, whatever happens meanwhile */
    size_t segments;    /* plain and expandable segments owned (torch's cudaMalloc_count, which
                         * torch_npu moves per expandable allocation and unmap, unbalanced) */
    /* torch's MemPool(allocator): the pool's segments come from these (plain segments, never
     * expandable ones, as in torch), or from the device when NULL. */
    npualloc_alloc_fn segment_alloc_fn;
    npualloc_free_fn segment_free_fn;
    /* torch's use_on_oom_pools: an allocation of the default pools that the device cannot serve
     * takes a free block of this pool first (try_oom_pools); oom_mark orders the marked pools
     * (the order they were marked in). */
    bool use_on_oom;
    uint64_t oom_mark;
};

/* An active "allocate to pool" (torch's captures_underway entry): allocations matching the
 * filter come from the pool. */
typedef struct pool_route {
    npualloc_mempool_id id;
    private_pool *pool;
    npualloc_pool_filter filter;
    uint64_t filter_value; /* the thread (pthread_t) or stream handle */
    bool owns_ref;         /* a begin's route holds a reference; a joined one is covered by it */
} pool_route;

/* A stream recorded on an allocated block while a capture was underway (torch's
 * block_to_graph_stream_uses): the free deferred to the capture's end does not wait for it. */
typedef struct capture_use {
    const struct cache_block *block;
    uint64_t stream;
} capture_use;

/* Physical pages unmapped by empty_virt_addr_cache, kept for the pool's next map. */
typedef struct cached_page {
    uint64_t handle;
    size_t size;
    const struct block_pool *pool; /* the pool that unmapped it, and alone maps it again */
} cached_page;

/* Where a cache gets its segments: the virtual NPU (vmm.c) for real devices, a simulated
 * device (pure accounting) for trace replay. */
typedef struct cache_backend {
    /* ACL_ERROR_RT_MEMORY_ALLOCATION when the device is out of memory. */
    aclError (*segment_alloc)(void *ctx, int32_t device, size_t size, bool huge1g, void **ptr);
    void (*segment_free)(void *ctx, int32_t device, void *ptr, size_t size);
    void (*mem_info)(void *ctx, int32_t device, size_t *free_bytes, size_t *total_bytes);
    /* Waits for all work queued on the device's streams (called without the cache lock). */
    void (*synchronize)(void *ctx, int32_t device);
    /* For the checker (may be NULL): is [ptr, ptr + size) the device's memory? */
    bool (*segment_valid)(void *ctx, int32_t device, void *ptr, size_t size);
    /* Expandable segments (all NULL: not supported). Reserve address space; map a new page
     * (ACL_ERROR_RT_MEMORY_ALLOCATION when out of memory); map a kept page again (NULL where no
     * page is ever kept: only empty_virt_addr_cache keeps them); unmap a page, freeing its memory
     * unless `keep`; free a kept page. */
    aclError (*reserve)(void *ctx, int32_t device, size_t size, uintptr_t *base);
    void (*release)(void *ctx, int32_t device, uintptr_t base, size_t size);
    aclError (*map_page)(void *ctx, int32_t device, uintptr_t va, size_t size, bool huge1g, uint64_t *handle);
    aclError (*remap_page)(void *ctx, int32_t device, uintptr_t va, size_t size, uint64_t handle);
    void (*unmap_page)(void *ctx, int32_t device, uintptr_t va, size_t size, uint64_t handle, bool keep);
    void (*free_page)(void *ctx, int32_t device, uint64_t handle);
    /* torch's free-memory callbacks, run on a cache miss (NULL: none, e.g. a simulated device);
     * true when something was freed. */
    bool (*free_memory)(void *ctx);
    /* Completes the frees the backend itself holds back until the device drains (NULL: none;
     * trace replay: frees whose recorded completion is still ahead).  Called, lock held, where
     * torch's synchronize_and_free_events completes every pending free. */
    void (*complete_frees)(void *ctx);
} cache_backend;

typedef struct device_cache {
    /* 64-byte aligned, so one device's cache shares no cache line with another's: a thread on
     * device 1 taking its lock must not evict the line device 0's thread is reading (measured:
     * two threads on two devices ran at 0.9x one thread when the array happened to straddle). */
    _Alignas(64) cache_lock lock;
    int32_t device;
    bool started;
    const alloc_settings *settings;
    const cache_backend *backend;
    void *backend_ctx;
    size_t pad; /* bytes added to every request before rounding (32 on an NPU, 0 for CUDA) */
    block_pool large, small;
    ptr_map allocated_blocks; /* ptr -> block, allocated blocks only */
    npualloc_stats stats;
    size_t total_allocated_memory; /* bytes obtained from the device (reserved) */
    bool set_fraction;
    double fraction;
    size_t allowed_memory_maximum;
    event_queue *queues;
    size_t queue_count, queue_capacity;
    size_t pending_events;
    uint64_t event_seq; /* events inserted so far */
    /* One event struct per use recorded with record_stream and not yet turned into an event, and
     * room in `queues` for as many more queues: the free that records the events needs no host
     * memory (record_stream reports running out instead). */
    pending_event *spare_events;
    size_t spare_event_count;
    expandable_segment *expandable_segments;
    private_pool *private_pools;
    uint64_t oom_marks; /* pools marked use_on_oom so far (their oom_mark) */
    pool_route *routes; /* newest last; matched newest first */
    size_t route_count, route_capacity;
    cache_block **deferred; /* freed with stream uses during a capture: events wait for its end */
    size_t deferred_count, deferred_capacity;
    capture_use *capture_uses; /* each of a block that has the stream in its uses; dropped with it */
    size_t capture_use_count, capture_use_capacity;
    cached_page *cached_pages; /* pages kept by empty_virt_addr_cache */
    size_t cached_page_count, cached_page_capacity;
    cache_block *pinned;       /* freed blocks still open in another process (sharing pin) */
    cache_block *spare_blocks; /* recycled block structs: no heap call on a cache hit */
    cache_block **chunks;      /* block struct chunks, freed at shutdown */
    size_t chunk_count, chunk_capacity;
    /* memory history */
    npualloc_context *current_ctx; /* the context of the API call holding the lock */
    npualloc_record_context record_context;
    uint32_t history_skip;   /* NPUALLOC_TRACE_SKIP bits: actions not recorded */
    size_t history_max;      /* the ring's limit (max_entries); 0 while the history is off */
    trace_entry *history;    /* grows on demand up to history_max */
    npualloc_context *user_metadata; /* attached to the entries recorded from now on (NULL: none) */
    size_t history_capacity;
    size_t history_count, history_next; /* entries held; where the oldest is once full */
} device_cache;

/* ---- shared by caching.c and caching_expandable.c ---- */
cache_block *cache_block_new(device_cache *dc);
void cache_block_delete(device_cache *dc, cache_block *b);
/* Puts a free block into its pool as a fresh cache entry (age 0). */
void cache_pool_insert(cache_block *b);
/* Merges src into dst when src is free (same mapped state); returns the bytes taken over. */
size_t cache_try_merge(device_cache *dc, cache_block *dst, cache_block *src);
/* The stats entry of a pool's blocks.  Callers that update several arrays keep it in a local: read
 * again after each store to the stats, it would be reloaded from the pool every time. */
static inline unsigned pool_stat_kind(const block_pool *pool)
{
    return pool->is_small ? NPUALLOC_STAT_SMALL_POOL : NPUALLOC_STAT_LARGE_POOL;
}

/* torch's Stat: increase (current, peak, allocated) and decrease (current, freed); an array
 * is updated for the aggregate and for the pool's own kind.
 *
 * The aggregate (NPUALLOC_STAT_ALL) of an array always equals the sum of its small- and
 * large-pool entries in current, allocated and freed, so only its peak is kept in the array:
 * the other three are filled in when the stats are read (cache_stat_all, cache_stats_read).
 * Every allocation and free updates five arrays; this saves a third of that work. */
static inline void cache_stat_one_inc(npualloc_stat *s, int64_t n)
{
    s->current += n;
    if (s->current > s->peak) /* a branch, not a select: the peak is rarely new, so no store */
        s->peak = s->current;
    s->allocated += n;
}

static inline void cache_stat_one_dec(npualloc_stat *s, int64_t n)
{
    s->current -= n;
    s->freed += n;
}

static inline void cache_stat_inc(npualloc_stat *arr, unsigned kind, int64_t n)
{
    cache_stat_one_inc(&arr[kind], n);
    int64_t all = arr[NPUALLOC_STAT_SMALL_POOL].current + arr[NPUALLOC_STAT_LARGE_POOL].current;
    if (all > arr[NPUALLOC_STAT_ALL].peak)
        arr[NPUALLOC_STAT_ALL].peak = all;
}

static inline void cache_stat_dec(npualloc_stat *arr, unsigned kind, int64_t n)
{
    cache_stat_one_dec(&arr[kind], n);
}

/* An array's aggregate entry, complete. */
static inline npualloc_stat cache_stat_all(const npualloc_stat *arr)
{
    const npualloc_stat *s = &arr[NPUALLOC_STAT_SMALL_POOL], *l = &arr[NPUALLOC_STAT_LARGE_POOL];
    return (npualloc_stat){s->current + l->current, arr[NPUALLOC_STAT_ALL].peak, s->allocated + l->allocated,
                           s->freed + l->freed};
}

/* The device's stats with every aggregate entry filled in (lock held). */
void cache_stats_read(const npualloc_stats *stats, npualloc_stats *out);
/* Every peak back to its current value (torch's resetPeakStats). */
void cache_stats_reset_peak(npualloc_stats *stats);

/* A net change of either sign. */
static inline void cache_stat_update(npualloc_stat *arr, unsigned kind, int64_t n)
{
    if (n >= 0)
        cache_stat_inc(arr, kind, n);
    else
        cache_stat_dec(arr, kind, -n);
}
/* Expandable segments (caching_expandable.c). */
bool expandable_supported(const device_cache *dc);
/* The page size of a pool's expandable segments (torch_npu: 2 MiB small, the large segment size (or the
 * deprecated segment_size_mb) large, 1 GiB with page_size:1g). */
size_t expandable_page_size(const device_cache *dc, const block_pool *pool);
/* Finds or maps room for `size` bytes in the stream's expandable segment of the pool; the
 * block returned is mapped, free, and out of the pool.  NULL with *err set when it cannot:
 * ACL_ERROR_RT_MEMORY_ALLOCATION when the device is out of memory, else the error of the page
 * mapping that failed (torch_npu's map raises any other error than running out of memory). */
cache_block *expandable_allocate(device_cache *dc, block_pool *pool, uint64_t stream, size_t size, aclError *err);
/* Unmaps the fully free pages of a free expandable block; releases the segment when nothing of
 * it stays mapped.  `keep_pages` keeps the physical pages for reuse (empty_virt_addr_cache). */
void expandable_release_block(device_cache *dc, cache_block *b, bool keep_pages);
/* Gives back the segments of the pool with nothing mapped (whose first mapping failed). */
void expandable_release_unmapped_segments(device_cache *dc, block_pool *pool);
/* Frees the pages a pool kept (empty_virt_addr_cache), or every pool's for NULL. */
void expandable_free_cached_pages(device_cache *dc, const block_pool *pool);
void expandable_release_all(device_cache *dc, bool return_memory);

/* ---- shared state (caching_api.c) ---- */
extern alloc_settings cache_settings;
/* The public view of a settings instance (the live allocator's or a replay session's). */
void cache_settings_export(const alloc_settings *s, npualloc_allocator_settings *out);
device_cache *cache_device(int32_t device); /* started, or NULL for an invalid device */

/* ---- the algorithm (caching.c) ---- */
void cache_device_init(device_cache *dc, int32_t device, const alloc_settings *settings,
                       const cache_backend *backend, void *backend_ctx, size_t pad);
/* Frees everything the device holds (blocks, segments, events); the lock must be held. */
void cache_device_release_all(device_cache *dc);
/* The same without giving memory back (after fork the memory is not in the process). */
void cache_device_forget(device_cache *dc);
/* Lock held on entry and on return (it may be released inside). */
aclError cache_malloc_locked(device_cache *dc, size_t orig_size, uint64_t stream, void **out,
                             npualloc_oom_info *oom);
/* Serves the allocation from the cache alone (the lock is never released); false, with the
 * allocator as consistent as before, when cache_malloc_locked must be called. */
bool cache_malloc_cached_locked(device_cache *dc, size_t orig_size, uint64_t stream, void **out);
/* Frees an allocated block the caller has just taken out of allocated_blocks (ptr_map_remove
 * finds and removes it in one probe sequence). */
void cache_free_locked(device_cache *dc, cache_block *b);
aclError cache_record_stream_locked(device_cache *dc, cache_block *b, uint64_t stream);
void cache_erase_stream_locked(device_cache *dc, cache_block *b, uint64_t stream);
/* Private pools (lock held). */
/* Creates a pool (its segments from alloc_fn/free_fn, or from the device when NULL), or takes a
 * reference to an existing one made with the same functions. */
aclError cache_pool_create_locked(device_cache *dc, npualloc_mempool_id id, npualloc_alloc_fn alloc_fn,
                                  npualloc_free_fn free_fn);
aclError cache_pool_release_locked(device_cache *dc, npualloc_mempool_id id);
/* torch's setUseOnOOM / setNoSplit on an existing pool. */
aclError cache_pool_set_use_on_oom_locked(device_cache *dc, npualloc_mempool_id id, bool use_on_oom);
aclError cache_pool_set_no_split_locked(device_cache *dc, npualloc_mempool_id id);
aclError cache_pool_begin_locked(device_cache *dc, npualloc_mempool_id id, npualloc_pool_filter filter,
                                 uint64_t value);
aclError cache_pool_join_locked(device_cache *dc, npualloc_mempool_id id, uint64_t stream);
aclError cache_pool_end_locked(device_cache *dc, npualloc_mempool_id id);
private_pool *cache_pool_find(device_cache *dc, npualloc_mempool_id id);
/* emptyCache(mempool_id): synchronize (lock released), then that pool's freeable memory only. */
void cache_pool_empty_locked(device_cache *dc, npualloc_mempool_id id);
/* empty_cache for one device: synchronize (lock released), then release every free segment;
 * `keep_pages` (empty_virt_addr_cache) unmaps expandable pages but keeps their memory. */
void cache_empty_locked(device_cache *dc, bool keep_pages);
void cache_set_fraction_locked(device_cache *dc, double fraction);
/* Appends to the history ring (cache_history_record_ctx checks that it is on). */
void cache_history_add(device_cache *dc, trace_action action, uintptr_t addr, size_t size, uint64_t stream,
                       npualloc_context *fallback);
/* torch's record_trace(..., context ? context : fallback): the call's context, else `fallback`
 * (a free: the block's allocation context; a segment free: the segment's).  Inline: every
 * allocation and free records up to two entries, and the history is nearly always off. */
static inline void cache_history_record_ctx(device_cache *dc, trace_action action, uintptr_t addr, size_t size,
                                            uint64_t stream, npualloc_context *fallback)
{
    if (__builtin_expect(dc->history_max != 0, 0))
        cache_history_add(dc, action, addr, size, stream, fallback);
}

static inline void cache_history_record(device_cache *dc, trace_action action, uintptr_t addr, size_t size,
                                        uint64_t stream)
{
    cache_history_record_ctx(dc, action, addr, size, stream, NULL);
}

/* npualloc_context_release without the call for the common NULL (no context recorded). */
static inline void cache_context_drop(npualloc_context *c)
{
    if (c)
        npualloc_context_release(c);
}
/* Calls fn on the first block of every segment, in address order; false (fn called for none) when out of
 * host memory to collect them. */
bool cache_each_segment(device_cache *dc, void (*fn)(cache_block *head, void *ctx), void *ctx);
aclError cache_check_locked(device_cache *dc, char *why, size_t len);

/* ---- sharing pin (npualloc.share; the hook is set by ipc_share.c) ----
 * Lock held.  cache_share_freed(dc, b) is called when the owner frees a shared block (before
 * the free proceeds); if b->share_pins is then non-zero the free waits for
 * cache_share_unpin_locked to drop the last pin. */
extern void (*cache_share_freed)(device_cache *dc, cache_block *b);
void cache_share_unpin_locked(device_cache *dc, cache_block *b);

/* ---- lifetime (caching_api.c) ---- */
/* Returns every cached and allocated segment to the runtime and forgets the settings. */
void caching_shutdown(void);
void caching_atfork_prepare(void);
void caching_atfork_prepare_leaves(void);
void caching_atfork_parent(void);
/* The child has none of the parent's device memory: every cache starts empty. */
void caching_atfork_child(void);

/* ---- errors (caching_api.c) ---- */
void cache_set_error(npualloc_error_kind kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cache_push_warning(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* torch_npu's warning that a page_size:1g allocation fell back to 2 MiB pages; once a process, as there. */
void cache_warn_1g_fallback(void);

size_t cache_round_size(const alloc_settings *settings, size_t pad, size_t size);
/* The backend of the virtual NPU's devices. */
extern const cache_backend cache_npu_backend;

#endif
