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
 *   - the stats equal what the blocks imply (allocated, active, reserved bytes and counts).
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

struct cache_block {
    avl_node pool_node;       /* in pool->blocks while free and cached */
    cache_block *prev, *next; /* neighbours in the segment, address order */
    block_pool *pool;
    uint64_t stream;          /* stream handle the block belongs to (0 = default stream) */
    uintptr_t ptr;
    size_t size;
    size_t requested_size;    /* the size asked for at the last allocation (stale once freed) */
    uint64_t gc_base;         /* pool->search_count when the block last became free */
    int32_t event_count;      /* events still to complete before the free finishes */
    bool allocated;
    bool in_pool;
    uint32_t use_count, use_capacity;
    uint64_t *uses;           /* streams recorded with record_stream while allocated */
    cache_block *free_link;   /* the device's list of spare block structs */
};

/* One recorded use of a freed block on a stream (torch's per-stream event FIFO entry). */
typedef struct pending_event {
    struct pending_event *next;
    npu_stream *stream; /* pinned until the entry is consumed */
    uint64_t position;  /* the stream's last task when the block was freed */
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
} trace_entry;

typedef struct device_cache {
    pthread_mutex_t lock;
    int32_t device;
    bool started;
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
    cache_block *spare_blocks; /* recycled block structs: no heap call on a cache hit */
    void **chunks;             /* block struct chunks, freed at shutdown */
    size_t chunk_count, chunk_capacity;
    /* memory history */
    bool history_enabled;
    size_t history_max;      /* the ring's limit (max_entries) */
    trace_entry *history;    /* grows on demand up to history_max */
    size_t history_capacity;
    size_t history_count, history_next; /* entries held; where the oldest is once full */
} device_cache;

/* ---- shared state (caching_api.c) ---- */
extern alloc_settings cache_settings;
device_cache *cache_device(int32_t device); /* started, or NULL for an invalid device */

/* ---- the algorithm (caching.c) ---- */
void cache_device_init(device_cache *dc, int32_t device);
/* Frees everything the device holds (blocks, segments, events); the lock must be held. */
void cache_device_release_all(device_cache *dc);
/* The same without giving memory back (after fork the memory is not in the process). */
void cache_device_forget(device_cache *dc);
/* Lock held on entry and on return (it may be released inside). */
aclError cache_malloc_locked(device_cache *dc, size_t orig_size, uint64_t stream, void **out,
                             npualloc_oom_info *oom);
void cache_free_locked(device_cache *dc, cache_block *b);
aclError cache_record_stream_locked(device_cache *dc, cache_block *b, uint64_t stream);
void cache_erase_stream_locked(device_cache *dc, cache_block *b, uint64_t stream);
/* empty_cache for one device: synchronize (lock released), then release every free segment. */
void cache_empty_locked(device_cache *dc);
void cache_set_fraction_locked(device_cache *dc, double fraction);
void cache_history_record(device_cache *dc, trace_action action, uintptr_t addr, size_t size, uint64_t stream);
/* Calls fn on every block of every segment (segments in address order, blocks in order). */
void cache_each_segment(device_cache *dc, void (*fn)(cache_block *head, void *ctx), void *ctx);
aclError cache_check_locked(device_cache *dc, char *why, size_t len);

/* ---- lifetime (caching_api.c) ---- */
/* Returns every cached and allocated segment to the runtime and forgets the settings. */
void caching_shutdown(void);
void caching_atfork_prepare(void);
void caching_atfork_parent(void);
/* The child has none of the parent's device memory: every cache starts empty. */
void caching_atfork_child(void);

/* ---- free-memory callbacks (torch's FreeMemoryCallbacksRegistry) ---- */
typedef bool (*cache_free_callback)(void);
void cache_add_free_callback(cache_free_callback fn);
bool cache_run_free_callbacks(void);

/* ---- errors (caching_api.c) ---- */
void cache_set_error(npualloc_error_kind kind, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cache_push_warning(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

size_t cache_round_size(size_t size);

#endif
