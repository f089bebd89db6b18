/*
 * caching.c - the per-device caching allocator: torch_npu's DeviceCachingAllocator, decision
 * for decision (see caching.h for the vocabulary and invariants).
 *
 * malloc: process completed events; round the size and choose the pool; best fit in the pool
 * (then again after the free-memory callbacks); garbage collection (with a memory fraction);
 * a new segment; releasing oversize cached segments; then synchronize the device, release every
 * cached segment and retry; then out of memory.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "caching.h"
#include "common.h"
#include "host.h"

/* ---- stats: see caching.h (inline, they run several times per allocation) ---- */

/* The nine arrays of a stats struct. */
#define STAT_ARRAYS(s)                                                                                   \
    {(s)->allocation,      (s)->segment,        (s)->active,       (s)->inactive_split,                     \
     (s)->allocated_bytes, (s)->reserved_bytes, (s)->active_bytes, (s)->inactive_split_bytes,               \
     (s)->requested_bytes}

void cache_stats_read(const npualloc_stats *stats, npualloc_stats *out)
{
    *out = *stats;
    npualloc_stat *arrays[] = STAT_ARRAYS(out);
    for (size_t i = 0; i < ARRAY_LEN(arrays); i++)
        arrays[i][NPUALLOC_STAT_ALL] = cache_stat_all(arrays[i]);
}

void cache_stats_reset_peak(npualloc_stats *stats)
{
    npualloc_stat *arrays[] = STAT_ARRAYS(stats);
    for (size_t i = 0; i < ARRAY_LEN(arrays); i++) {
        arrays[i][NPUALLOC_STAT_SMALL_POOL].peak = arrays[i][NPUALLOC_STAT_SMALL_POOL].current;
        arrays[i][NPUALLOC_STAT_LARGE_POOL].peak = arrays[i][NPUALLOC_STAT_LARGE_POOL].current;
        arrays[i][NPUALLOC_STAT_ALL].peak = cache_stat_all(arrays[i]).current;
    }
    stats->oversize_allocations.peak = stats->oversize_allocations.current;
    stats->oversize_segments.peak = stats->oversize_segments.current;
}

/* ---- block structs ---- */

#define BLOCKS_PER_CHUNK 64

/* Adds a chunk of spare block structs; false when out of host memory. */
static bool add_spare_blocks(device_cache *dc)
{
    if (!ARRAY_RESERVE(dc->chunks, dc->chunk_capacity, dc->chunk_count + 1, 16))
        return false;
    /* Line-aligned, so a block's fields fall into the lines its layout intends (caching.h). */
    cache_block *chunk = aligned_alloc(64, BLOCKS_PER_CHUNK * sizeof *chunk);
    if (!chunk)
        return false;
    memset(chunk, 0, BLOCKS_PER_CHUNK * sizeof *chunk);
    dc->chunks[dc->chunk_count++] = chunk;
    for (int i = 0; i < BLOCKS_PER_CHUNK; i++) {
        chunk[i].free_link = dc->spare_blocks;
        dc->spare_blocks = &chunk[i];
    }
    return true;
}

/* ALWAYS_INLINE (an external function still): every split takes one. */
/* Is a block struct ready for cache_block_new (made now if none is)? */
static inline bool spare_block_ready(device_cache *dc) { return likely(dc->spare_blocks) || add_spare_blocks(dc); }

ALWAYS_INLINE cache_block *cache_block_new(device_cache *dc)
{
    if (!spare_block_ready(dc))
        return NULL;
    cache_block *b = dc->spare_blocks;
    dc->spare_blocks = b->free_link;
    /* A copy of a zeroed struct, not memset: gcc copies it with 16-byte moves, where it makes the
     * memset a `rep stos` with a long start-up (the recorded trace's pair: 108.6 -> 104.8 ns). */
    static const cache_block zeroed;
    *b = zeroed;
    b->mapped = true;
    return b;
}

void cache_block_delete(device_cache *dc, cache_block *b)
{
    if (b->uses) /* rarely: only blocks used with record_stream have a list */
        free(b->uses);
    b->uses = NULL;
    cache_context_drop(b->ctx);
    cache_context_drop(b->segment_ctx);
    b->free_link = dc->spare_blocks;
    dc->spare_blocks = b;
}

static inline bool block_is_split(const cache_block *b) { return b->prev || b->next; }

static inline int64_t block_age(const cache_block *b) { return (int64_t)(b->pool->search_count - b->gc_base); }

/* ALWAYS_INLINE (an external function still): every free ends here. */
ALWAYS_INLINE void cache_pool_insert(cache_block *b)
{
    b->gc_base = b->pool->search_count;
    block_pool_insert(b->pool, b);
}

/* ---- sizes ---- */

/* torch's roundup_power2_next_division. */
static size_t roundup_power2_next_division(size_t size, size_t divisions)
{
    if ((size & (size - 1)) == 0)
        return size;
    size_t floor_pow2 = (size_t)1 << (63 - __builtin_clzll((unsigned long long)size));
    size_t step = floor_pow2 >> (63 - __builtin_clzll((unsigned long long)divisions));
    if (step == 0)
        return floor_pow2 << 1;
    return round_up(size, step);
}

size_t cache_round_size(const alloc_settings *settings, size_t pad, size_t size)
{
    size += pad; /* torch_npu pads every request by 32 bytes (a CUDA replay uses no pad) */
    /* torch returns 512 for smaller sizes; raising them to 512 gives the same answer below, with a
     * cmov where a branch was mispredicted on a third of the synthetic benchmark's pairs. */
    size = size < K_MIN_BLOCK_SIZE ? K_MIN_BLOCK_SIZE : size;
    size_t divisions = alloc_conf_roundup_divisions(settings, size);
    if (divisions > 1 && size > K_MIN_BLOCK_SIZE * divisions)
        return roundup_power2_next_division(size, divisions);
    return round_up(size, K_MIN_BLOCK_SIZE);
}

static size_t allocation_size(const alloc_settings *settings, size_t size, bool small)
{
    if (!small && settings->page_size_1g)
        return round_up(size, K_EXTRA_LARGE_BUFFER);
    if (size <= K_SMALL_SIZE)
        return K_SMALL_BUFFER;
    if (size < K_MIN_LARGE_ALLOC)
        return settings->large_segment_size;
    return round_up(size, K_ROUND_LARGE);
}

/* ---- contexts ---- */

npualloc_context *npualloc_context_create(const void *data, size_t len)
{
    if (len > UINT32_MAX || (len && !data))
        return NULL;
    npualloc_context *c = malloc(sizeof *c + len);
    if (!c)
        return NULL;
    atomic_init(&c->refs, 1);
    c->len = (uint32_t)len;
    if (len)
        memcpy(c->data, data, len);
    return c;
}

void npualloc_context_retain(npualloc_context *c)
{
    if (c)
        atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
}

void npualloc_context_release(npualloc_context *c)
{
    if (c && atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) == 1)
        free(c);
}

const void *npualloc_context_data(const npualloc_context *c, size_t *len)
{
    if (len)
        *len = c ? c->len : 0;
    return c ? c->data : NULL;
}

/* ---- memory history ---- */

void cache_history_add(device_cache *dc, trace_action action, uintptr_t addr, size_t size, uint64_t stream,
                       npualloc_context *fallback)
{
    if (dc->history_skip & NPUALLOC_TRACE_SKIP(action))
        return;
    npualloc_context *ctx = dc->current_ctx ? dc->current_ctx : fallback;
    if (dc->record_context < NPUALLOC_RECORD_ALLOC)
        ctx = NULL;
    trace_entry e = {action, addr, size, stream, host_epoch_us(), ctx, dc->user_metadata};
    npualloc_context_retain(ctx);
    npualloc_context_retain(e.metadata);
    if (dc->history_count == dc->history_capacity && dc->history_capacity < dc->history_max) {
        size_t cap = dc->history_capacity ? dc->history_capacity * 2 : 1024;
        if (cap > dc->history_max)
            cap = dc->history_max;
        trace_entry *grown = realloc(dc->history, cap * sizeof *grown);
        if (grown) {
            dc->history = grown;
            dc->history_capacity = cap;
        } else {
            dc->history_max = dc->history_capacity; /* out of memory: the ring stays this size */
        }
    }
    if (dc->history_count < dc->history_capacity) {
        dc->history[dc->history_count++] = e;
    } else if (dc->history_capacity) {
        trace_entry_drop(&dc->history[dc->history_next]);
        dc->history[dc->history_next] = e;
        dc->history_next = (dc->history_next + 1) % dc->history_capacity;
    } else {
        trace_entry_drop(&e);
    }
}

void trace_entry_drop(trace_entry *e)
{
    npualloc_context_release(e->ctx);
    npualloc_context_release(e->metadata);
}

/* ---- allocation parameters ---- */

typedef struct alloc_params {
    size_t size;       /* rounded */
    size_t alloc_size; /* a new segment's size: worked out on a miss, 0 before */
    uint64_t stream;
    block_pool *pool;
    cache_block *block;
    aclError err;
} alloc_params;

static inline size_t max_split_size(const device_cache *dc) { return dc->settings->max_split_size; }

/* ---- pools ---- */

/* The pool an allocation comes from: the newest matching route's private pool, else the
 * device's default pools (torch's get_pool; small = rounded size up to 1 MiB). */
static block_pool *get_pool(device_cache *dc, size_t size, uint64_t stream)
{
    bool small = size <= K_SMALL_SIZE;
    for (size_t i = dc->route_count; i-- > 0;) {
        const pool_route *r = &dc->routes[i];
        bool match = r->filter == NPUALLOC_POOL_FILTER_STREAM ? r->filter_value == stream
                                                               : r->filter_value == (uint64_t)pthread_self();
        if (match)
            return small ? &r->pool->small : &r->pool->large;
    }
    return small ? &dc->small : &dc->large;
}

static inline void owner_segments(block_pool *pool, int delta)
{
    if (pool->owner)
        pool->owner->segments += (size_t)(ptrdiff_t)delta;
}

/* ---- waits ---- */

/* A window in a call that holds the lock: the lock goes for a wait and comes back.  The caller's stack
 * (current_ctx) is set aside meanwhile: entries other threads record while the lock is free are not the
 * caller's, and another call may set its own. */
static npualloc_context *lock_window_open(device_cache *dc)
{
    npualloc_context *ctx = dc->current_ctx;
    dc->current_ctx = NULL;
    cache_lock_release(&dc->lock);
    return ctx;
}

static void lock_window_close(device_cache *dc, npualloc_context *ctx)
{
    cache_lock_acquire(&dc->lock);
    dc->current_ctx = ctx;
}

/* Synchronizes every stream of the device with the allocator lock released (torch_npu's
 * npuSynchronizeDevice: a stream task may need the lock, e.g. a callback freeing memory). */
static void synchronize_device_unlocked(device_cache *dc)
{
    npualloc_context *ctx = lock_window_open(dc);
    dc->backend->synchronize(dc->backend_ctx, dc->device);
    lock_window_close(dc, ctx);
}

/* Waits for a position of a stream the caller pinned with the allocator lock released, for the
 * same reason. */
static void wait_position_unlocked(device_cache *dc, npu_stream *s, uint64_t position)
{
    npualloc_context *ctx = lock_window_open(dc);
    stream_wait_position(s, position);
    lock_window_close(dc, ctx);
}

/* ---- events ---- */

/* The queue of a stream; a new one takes room record_stream reserved with the event's struct
 * (the caller took that struct first). */
static event_queue *queue_for(device_cache *dc, uint64_t stream_id)
{
    for (size_t i = 0; i < dc->queue_count; i++)
        if (dc->queues[i].stream_id == stream_id)
            return &dc->queues[i];
    event_queue *q = &dc->queues[dc->queue_count++];
    q->stream_id = stream_id;
    q->head = q->tail = NULL;
    return q;
}

static void free_block(device_cache *dc, cache_block *b);

/* One of the event structs record_stream reserved (one per recorded use). */
static pending_event *take_spare_event(device_cache *dc)
{
    pending_event *e = dc->spare_events;
    dc->spare_events = e->next;
    dc->spare_event_count--;
    return e;
}

/* Records, on every stream that used the block, the point after which it is safe to reuse. */
static void insert_events(device_cache *dc, cache_block *b)
{
    uint64_t *uses = b->uses;
    uint32_t n = b->use_count;
    b->uses = NULL;
    b->use_count = b->use_capacity = 0;
    for (uint32_t i = 0; i < n; i++) {
        npu_stream *s;
        /* A stream another thread is destroying still runs its queued work: it is waited for. */
        if (stream_acquire_for_wait(dc->device, uses[i], &s) != ACL_SUCCESS) {
            free(take_spare_event(dc)); /* the stream is gone: nothing can still use the block there */
            continue;
        }
        pending_event *e = take_spare_event(dc);
        event_queue *q = queue_for(dc, uses[i]);
        e->next = NULL;
        e->stream = s;
        e->position = stream_last_position(s);
        e->seq = ++dc->event_seq;
        e->block = b;
        if (q->tail)
            q->tail->next = e;
        else
            q->head = e;
        q->tail = e;
        b->event_count++;
        dc->pending_events++;
    }
    free(uses);
    if (b->event_count == 0)
        free_block(dc, b);
}

/* Drops `stream` from the block's uses, with the event reserved for it. */
static void drop_use(device_cache *dc, cache_block *b, uint64_t stream)
{
    for (uint32_t i = 0; i < b->use_count; i++) {
        if (b->uses[i] == stream) {
            b->uses[i] = b->uses[--b->use_count];
            free(take_spare_event(dc));
            return;
        }
    }
}

/* Forgets the streams recorded on `b` during a capture (all of them, or only `*stream`); with
 * `drop_uses`, drops them from its uses as well (torch's remove_graph_stream_uses). */
static void forget_capture_uses(device_cache *dc, cache_block *b, const uint64_t *stream, bool drop_uses)
{
    for (size_t i = dc->capture_use_count; i-- > 0;) {
        const capture_use *u = &dc->capture_uses[i];
        if (u->block != b || (stream && u->stream != *stream))
            continue;
        if (drop_uses)
            drop_use(dc, b, u->stream);
        dc->capture_uses[i] = dc->capture_uses[--dc->capture_use_count];
    }
}

/* Records the events of frees deferred while a capture was underway.  Only streams recorded before
 * the capture are waited for: work a capture recorded on a stream was captured, not run, so it cannot
 * be using the block (torch's insert_events_deferred_until_no_capture); with none, the free completes. */
static void insert_deferred_events(device_cache *dc)
{
    size_t n = dc->deferred_count;
    dc->deferred_count = 0;
    for (size_t i = 0; i < n; i++) {
        cache_block *b = dc->deferred[i];
        if (unlikely(dc->capture_use_count))
            forget_capture_uses(dc, b, NULL, true);
        insert_events(dc, b);
    }
}

/* Is the event's free complete: its stream passed it, or it is one of those synchronize_and_free_events
 * waited for (inserted up to `last_seq`), but not on the stream whose task is calling, which that could
 * not wait for: its queued work may still use the block. */
static inline bool event_done(const pending_event *e, uint64_t last_seq)
{
    return stream_passed(e->stream, e->position) || (e->seq <= last_seq && !stream_waits_for_self(e->stream));
}

/* Completes, per stream in FIFO order, the frees whose events are done (event_done; `last_seq` 0:
 * only those passed). */
static void complete_events_up_to(device_cache *dc, uint64_t last_seq)
{
    for (size_t i = 0; i < dc->queue_count; i++) {
        event_queue *q = &dc->queues[i];
        while (q->head && event_done(q->head, last_seq)) {
            pending_event *e = q->head;
            q->head = e->next;
            if (!q->head)
                q->tail = NULL;
            dc->pending_events--;
            stream_release(e->stream);
            cache_block *b = e->block;
            free(e);
            if (--b->event_count == 0)
                free_block(dc, b);
        }
    }
}

/* Inline: on nearly every allocation there is nothing to do. */
static inline void process_events(device_cache *dc)
{
    if (unlikely(dc->deferred_count))
        insert_deferred_events(dc);
    if (unlikely(dc->pending_events))
        complete_events_up_to(dc, 0);
}

/* The first event inserted up to `last_seq` whose position has not passed yet and can be waited
 * for, or NULL.  One on the stream whose task is calling cannot (the wait would return at once):
 * its free stays pending. */
static pending_event *first_unpassed_event(device_cache *dc, uint64_t last_seq)
{
    for (size_t i = 0; i < dc->queue_count; i++)
        for (pending_event *e = dc->queues[i].head; e && e->seq <= last_seq; e = e->next)
            if (!stream_passed(e->stream, e->position) && !stream_waits_for_self(e->stream))
                return e;
    return NULL;
}

/* Waits for every outstanding event and completes the frees (torch's synchronize_and_free_events).
 * Each wait releases the lock, as the device synchronize before it does: the stream may be another
 * device's, which that synchronize did not drain, and its queued work may need this lock (a
 * callback freeing memory).  Only the events there are now are waited for, so frees other threads
 * make meanwhile cannot keep it waiting. */
static void synchronize_and_free_events(device_cache *dc)
{
    dc->stats.num_sync_all_streams++;
    if (dc->deferred_count && dc->route_count == 0)
        insert_deferred_events(dc);
    const uint64_t last_seq = dc->event_seq;
    pending_event *e;
    while ((e = first_unpassed_event(dc, last_seq))) {
        /* Pinned: while the lock is released another thread may complete and free the event. */
        npu_stream *s = e->stream;
        stream_pin(s);
        wait_position_unlocked(dc, s, e->position);
        stream_release(s);
    }
    complete_events_up_to(dc, last_seq);
    size_t kept = 0; /* queues left empty are dropped: their streams may be gone */
    for (size_t i = 0; i < dc->queue_count; i++)
        if (dc->queues[i].head)
            dc->queues[kept++] = dc->queues[i];
    dc->queue_count = kept;
    if (dc->backend->complete_frees)
        dc->backend->complete_frees(dc->backend_ctx);
}

/* ---- finding a cached block ---- */

static size_t expandable_size(const cache_block *b)
{
    return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
}

/* `retried_on_miss`: a miss here is searched again by cache_malloc_locked (the cache-only path),
 * so only a hit counts as a search for the blocks' ages: one allocation ages them once. */
static ALWAYS_INLINE bool get_free_block(device_cache *dc, alloc_params *p, bool retried_on_miss)
{
    block_pool *pool = p->pool;
    const bool aging = dc->set_fraction && dc->settings->garbage_collection_threshold > 0.0;
    if (aging && !retried_on_miss)
        pool->search_count++; /* every cached block of the pool ages by one */
    cache_block *b = block_pool_lower_bound(pool, p->stream, p->size);
    if (!b || b->stream != p->stream)
        return false;
    if (b->es) {
        if (dc->settings->expandable_segments) {
            /* For best fit an expandable block counts as big as it can grow (into the unmapped
             * space after it): prefer a later block that would grow less. */
            cache_block *next = block_pool_next(b);
            while (b->es && next && next->stream == p->stream && expandable_size(next) < expandable_size(b)) {
                b = next;
                next = block_pool_next(b);
            }
        } else {
            /* Expandable segments were turned off: only plain blocks qualify. */
            do
                b = block_pool_next(b);
            while (b && b->es && b->stream == p->stream);
            if (!b || b->stream != p->stream)
                return false;
        }
    }
    size_t max_split = max_split_size(dc);
    /* An oversize block is never split for a smaller request... */
    if (p->size < max_split && b->size >= max_split)
        return false;
    /* ...and serves a large request only if it is not much larger. */
    if (p->size >= max_split && b->size >= p->size + dc->settings->max_non_split_rounding_size)
        return false;
    if (aging && retried_on_miss)
        pool->search_count++; /* the hit's search, counted before the block's age restarts */
    /* The block stays indexed: a split re-keys it in place (alloc_found_block). */
    b->gc_base = pool->search_count;
    p->block = b;
    return true;
}

static bool trigger_free_memory_callbacks(device_cache *dc)
{
    if (!dc->backend->free_memory)
        return false;
    npualloc_context *ctx = lock_window_open(dc);
    bool freed = dc->backend->free_memory(dc->backend_ctx);
    lock_window_close(dc, ctx);
    return freed;
}

/* ---- segments ---- */

/* The private pool whose own allocator gives the pool's segments (torch's MemPool(allocator)),
 * or NULL: they come from the device. */
static const private_pool *segment_source(const block_pool *pool)
{
    const private_pool *owner = pool->owner;
    return owner && owner->segment_alloc_fn ? owner : NULL;
}

/* A pool with its own allocator has plain segments only, as in torch. */
static bool uses_expandable_segments(const device_cache *dc, const block_pool *pool)
{
    return dc->settings->expandable_segments && expandable_supported(dc) && !segment_source(pool);
}

/* Memory for a new plain segment of the request's size, from its pool's allocator or the device.
 * A pool allocator's memory must be mapped memory of the device, all of it: a block's pointer
 * leads back to its cache by the device, and the blocks will be written.  A NULL from it is out
 * of memory, as torch takes a NULL from raw_alloc. */
static aclError segment_take(device_cache *dc, const alloc_params *p, void **ptr)
{
    const cache_backend *be = dc->backend;
    const private_pool *source = segment_source(p->pool);
    if (source) {
        aclrtStream stream = (aclrtStream)(uintptr_t)p->stream;
        *ptr = source->segment_alloc_fn(p->alloc_size, dc->device, stream);
        if (*ptr && be->segment_valid && !be->segment_valid(dc->backend_ctx, dc->device, *ptr, p->alloc_size)) {
            source->segment_free_fn(*ptr, p->alloc_size, dc->device, stream);
            cache_push_warning("npualloc: a pool's allocator returned memory that is not the device's: not used");
            *ptr = NULL;
        }
        return *ptr ? ACL_SUCCESS : ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    if (p->pool->is_small || !dc->settings->page_size_1g)
        return be->segment_alloc(dc->backend_ctx, dc->device, p->alloc_size, false, ptr);
    aclError rc = be->segment_alloc(dc->backend_ctx, dc->device, p->alloc_size, true, ptr);
    if (rc != ACL_ERROR_RT_MEMORY_ALLOCATION)
        return rc;
    cache_warn_1g_fallback();
    return be->segment_alloc(dc->backend_ctx, dc->device, p->alloc_size, false, ptr);
}

/* Gives a plain segment's memory back where segment_take got it. */
static void segment_give_back(device_cache *dc, const block_pool *pool, uint64_t stream, void *ptr, size_t size)
{
    const private_pool *source = segment_source(pool);
    if (source)
        source->segment_free_fn(ptr, size, dc->device, (aclrtStream)(uintptr_t)stream);
    else
        dc->backend->segment_free(dc->backend_ctx, dc->device, ptr, size);
}

static bool alloc_block(device_cache *dc, alloc_params *p, bool is_retry)
{
    if (is_retry)
        dc->stats.num_alloc_retries++;
    if (dc->set_fraction && dc->total_allocated_memory + p->alloc_size > dc->allowed_memory_maximum) {
        p->err = ACL_ERROR_RT_MEMORY_ALLOCATION;
        return false;
    }
    if (uses_expandable_segments(dc, p->pool)) {
        /* Pages are mapped for the rounded size; stats and the trace come from the mapping. */
        p->block = expandable_allocate(dc, p->pool, p->stream, p->size, &p->err);
        return p->block != NULL;
    }
    void *ptr = NULL;
    aclError rc = segment_take(dc, p, &ptr);
    cache_block *b = NULL;
    if (rc == ACL_SUCCESS && !(b = cache_block_new(dc))) {
        segment_give_back(dc, p->pool, p->stream, ptr, p->alloc_size);
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    if (rc != ACL_SUCCESS) {
        p->err = rc;
        return false;
    }
    dc->total_allocated_memory += p->alloc_size;
    owner_segments(p->pool, 1);
    b->pool = p->pool;
    b->stream = p->stream;
    b->ptr = (uintptr_t)ptr;
    b->size = p->alloc_size;
    const unsigned kind = pool_stat_kind(p->pool);
    cache_stat_inc(dc->stats.segment, kind, 1);
    cache_stat_inc(dc->stats.reserved_bytes, kind, (int64_t)p->alloc_size);
    b->oversize_segment = p->alloc_size >= max_split_size(dc);
    if (b->oversize_segment)
        cache_stat_one_inc(&dc->stats.oversize_segments, 1);
    dc->stats.num_device_alloc++;
    if (dc->record_context >= NPUALLOC_RECORD_STATE) {
        b->segment_ctx = dc->current_ctx;
        npualloc_context_retain(b->segment_ctx);
    }
    cache_history_record(dc, TRACE_SEGMENT_ALLOC, b->ptr, b->size, b->stream);
    p->block = b;
    return true;
}

/* Returns a whole free segment to the device (or to its pool's allocator). */
static void release_block(device_cache *dc, cache_block *b)
{
    cache_history_record_ctx(dc, TRACE_SEGMENT_FREE, b->ptr, b->size, b->stream, b->segment_ctx);
    segment_give_back(dc, b->pool, b->stream, (void *)b->ptr, b->size);
    dc->total_allocated_memory -= b->size;
    block_pool *pool = b->pool;
    owner_segments(pool, -1);
    const unsigned kind = pool_stat_kind(pool);
    cache_stat_dec(dc->stats.segment, kind, 1);
    cache_stat_dec(dc->stats.reserved_bytes, kind, (int64_t)b->size);
    if (b->oversize_segment) /* counted when allocated, whatever max_split is now */
        cache_stat_one_dec(&dc->stats.oversize_segments, 1);
    dc->stats.num_device_free++;
    block_pool_remove(pool, b);
    cache_block_delete(dc, b);
}

/* Frees oversize cached segments of the request's stream, just enough for the request. */
static bool release_available_cached_blocks(device_cache *dc, alloc_params *p)
{
    size_t max_split = max_split_size(dc);
    if (max_split == SIZE_MAX)
        return false;
    size_t key_size = p->size > max_split ? p->size : max_split;
    synchronize_device_unlocked(dc); /* torch_npu synchronizes before releasing */
    cache_block *b = block_pool_lower_bound(p->pool, p->stream, key_size);
    while (b && b->stream == p->stream && b->es) /* expandable blocks are not segments */
        b = block_pool_next(b);
    if (b && b->stream == p->stream) {
        if (block_is_split(b))
            return false;
        release_block(dc, b);
        return true;
    }
    /* None large enough: release the largest ones of the stream, from the top down. */
    size_t released = 0;
    b = block_pool_last_of_stream(p->pool, p->stream);
    while (released < key_size && b && b->size >= max_split) {
        cache_block *prev = block_pool_prev(b);
        if (!block_is_split(b) && !b->es) {
            released += b->size;
            release_block(dc, b);
        }
        b = (prev && prev->stream == p->stream) ? prev : NULL;
    }
    return released >= key_size;
}

static void release_blocks(device_cache *dc, block_pool *pool, bool keep_pages)
{
    /* Expandable blocks are collected first: unmapping splits and merges blocks around them
     * (it only ever deletes unmapped neighbours, never another collected block). */
    size_t n = 0, cap = 0;
    cache_block **expandable = NULL;
    cache_block *b = block_pool_first(pool);
    while (b) {
        cache_block *next = block_pool_next(b);
        if (b->es) {
            if (n == cap) {
                size_t grown_cap = cap ? cap * 2 : 16;
                cache_block **grown = realloc(expandable, grown_cap * sizeof *grown);
                if (grown) { /* out of host memory: this block simply stays mapped */
                    expandable = grown;
                    cap = grown_cap;
                }
            }
            if (n < cap)
                expandable[n++] = b;
        } else if (!block_is_split(b)) {
            release_block(dc, b);
        }
        b = next;
    }
    for (size_t i = 0; i < n; i++)
        expandable_release_block(dc, expandable[i], keep_pages);
    free(expandable);
    expandable_release_unmapped_segments(dc, pool);
}

static void pool_destroy(device_cache *dc, private_pool *pp)
{
    /* its kept pages too: nothing else could map them again (torch_npu's BlockPool would leak them) */
    expandable_free_cached_pages(dc, &pp->small);
    expandable_free_cached_pages(dc, &pp->large);
    block_pool_destroy(&pp->small);
    block_pool_destroy(&pp->large);
    for (private_pool **link = &dc->private_pools; *link; link = &(*link)->next) {
        if (*link == pp) {
            *link = pp->next;
            break;
        }
    }
    free(pp);
}

static bool pool_routed(const device_cache *dc, const private_pool *pp)
{
    for (size_t i = 0; i < dc->route_count; i++)
        if (dc->routes[i].pool == pp)
            return true;
    return false;
}

/* Releases a private pool's free memory if nothing uses the pool any more; forgets the pool
 * once it owns no memory.  A pool a route points at is in use whatever its count says: the
 * count is the holders' to release (npualloc_cache_pool_release), and one released too often
 * must not leave the route pointing at a freed pool. */
static void release_freeable_pool(device_cache *dc, private_pool *pp, bool keep_pages)
{
    if (pp->use_count > 0 || pp->mallocs_underway > 0 || pool_routed(dc, pp))
        return;
    release_blocks(dc, &pp->large, keep_pages);
    release_blocks(dc, &pp->small, keep_pages);
    if (!keep_pages) {
        expandable_free_cached_pages(dc, &pp->large);
        expandable_free_cached_pages(dc, &pp->small);
    }
    if (pp->segments == 0) /* every block, free or unmapped, lies in a counted segment */
        pool_destroy(dc, pp);
}

/* Returns every whole cached segment to the device (torch's release_cached_blocks).  While a capture
 * or use_mem_pool is underway only the pools nobody uses are released, as newest torch's
 * release_cached_blocks does (torch_npu's asserts that none is): its frees wait for the capture to end. */
static bool release_cached_blocks(device_cache *dc, bool keep_pages)
{
    if (dc->route_count == 0)
        synchronize_and_free_events(dc);
    /* Asked again: the waits release the lock, and a capture may have begun meanwhile. */
    const bool all = dc->route_count == 0;
    if (all) {
        release_blocks(dc, &dc->large, keep_pages);
        release_blocks(dc, &dc->small, keep_pages);
    }
    for (private_pool *pp = dc->private_pools, *next; pp; pp = next) {
        next = pp->next;
        release_freeable_pool(dc, pp, keep_pages);
    }
    if (all && !keep_pages)
        expandable_free_cached_pages(dc, NULL);
    return true;
}

/* Frees the oldest whole cached large segments until usage is back under the threshold. */
static void garbage_collect_cached_blocks(device_cache *dc)
{
    size_t gc_threshold = (size_t)(dc->settings->garbage_collection_threshold * (double)dc->allowed_memory_maximum);
    if (dc->total_allocated_memory <= gc_threshold)
        return;
    bool any = false;
    for (cache_block *b = block_pool_first(&dc->large); b && !any; b = block_pool_next(b))
        any = !block_is_split(b) && !b->es;
    if (!any)
        return;
    synchronize_device_unlocked(dc); /* torch_npu synchronizes before collecting */
    if (dc->total_allocated_memory <= gc_threshold)
        return;
    size_t target = dc->total_allocated_memory - gc_threshold;
    double total_age = 0.0;
    size_t freeable = 0;
    for (cache_block *b = block_pool_first(&dc->large); b; b = block_pool_next(b)) {
        if (!block_is_split(b) && !b->es) {
            total_age += (double)block_age(b);
            freeable++;
        }
    }
    size_t reclaimed = 0;
    bool freed_something = true;
    while (reclaimed < target && freed_something && freeable > 0) {
        double age_threshold = total_age / (double)freeable;
        freed_something = false;
        cache_block *b = block_pool_first(&dc->large);
        while (b) {
            cache_block *next = block_pool_next(b);
            if (!block_is_split(b) && !b->es && (double)block_age(b) >= age_threshold) {
                freed_something = true;
                reclaimed += b->size;
                total_age -= (double)block_age(b);
                freeable--;
                release_block(dc, b);
            }
            b = next;
        }
    }
}

/* ---- handing out and taking back ---- */

static bool should_split(const device_cache *dc, const cache_block *b, size_t size)
{
    const block_pool *pool = b->pool;
    if (unlikely(pool->no_split)) /* torch: a no_split pool hands out whole blocks */
        return false;
    size_t remaining = b->size - size;
    if (pool->is_small || dc->settings->expandable_segments)
        return remaining >= K_MIN_BLOCK_SIZE;
    return size < max_split_size(dc) && remaining > K_SMALL_SIZE;
}

/* torch_npu's base_addr_aligned_kb: with expandable segments, a block of 2 MiB or more starts on
 * that alignment; the unaligned front goes back to the pool (no stats change). */
static void align_block_start_slow(device_cache *dc, alloc_params *p)
{
    size_t align = dc->settings->base_addr_aligned_size;
    cache_block *b = p->block;
    if (!align || b->ptr % align == 0)
        return;
    size_t offset = align - b->ptr % align;
    if (offset + p->size > b->size)
        return;
    /* What the allocation needs after the front is split off (a block for its own split, a pointer-map
     * slot) is got first: failing after the split would leave the aligned block next to its free front,
     * unmerged.  Out of host memory, the unaligned block is left to the allocation, which fails. */
    cache_block *aligned = ptr_map_reserve(&dc->allocated_blocks, 1) == 0 ? cache_block_new(dc) : NULL;
    if (!aligned)
        return;
    if (!spare_block_ready(dc)) {
        cache_block_delete(dc, aligned);
        return;
    }
    if (!b->es) {
        /* A plain block (expandable segments switched on later) keeps its inactive-split stats
         * exact: the front stays free and split, the aligned part is now split too.  (torch_npu
         * changes no stats here and lets them drift for plain blocks.) */
        bool was_split = block_is_split(b);
        const unsigned kind = pool_stat_kind(b->pool);
        cache_stat_inc(dc->stats.inactive_split, kind, was_split ? 1 : 2);
        if (!was_split)
            cache_stat_inc(dc->stats.inactive_split_bytes, kind, (int64_t)b->size);
    }
    aligned->pool = b->pool;
    aligned->stream = b->stream;
    aligned->es = b->es;
    aligned->oversize_segment = b->oversize_segment;
    aligned->ptr = b->ptr + offset;
    aligned->size = b->size - offset;
    aligned->prev = b;
    aligned->next = b->next;
    if (b->next)
        b->next->prev = aligned;
    b->next = aligned;
    if (b->in_pool) { /* found in the pool: the front keeps its place */
        block_pool_rekey(b->pool, b, b->ptr, offset);
        b->gc_base = b->pool->search_count;
    } else {
        b->size = offset;
        cache_pool_insert(b);
    }
    p->block = aligned;
}

/* The test inline: out of line, the function saved six registers to find nothing to do. */
static inline void align_block_start(device_cache *dc, alloc_params *p)
{
    if (unlikely(p->size >= K_ROUND_LARGE && dc->settings->expandable_segments))
        align_block_start_slow(dc, p);
}

static ALWAYS_INLINE aclError alloc_found_block(device_cache *dc, alloc_params *p, size_t orig_size, void **out)
{
    cache_block *b = p->block;
    block_pool *pool = p->pool;
    const unsigned kind = pool_stat_kind(pool);
    bool already_split = block_is_split(b);
    bool split = should_split(dc, b, p->size);
    cache_block *front = split ? cache_block_new(dc) : NULL;
    if ((split && !front) || ptr_map_reserve(&dc->allocated_blocks, 1) != 0) {
        if (front)
            cache_block_delete(dc, front);
        if (!b->in_pool)
            cache_pool_insert(b);
        cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory for block metadata");
        return ACL_ERROR_BAD_ALLOC;
    }
    if (split) {
        /* The front part is handed out; the remainder goes back to the pool. */
        cache_block *rest = b;
        front->pool = pool;
        front->stream = p->stream;
        front->ptr = rest->ptr;
        front->size = p->size;
        front->prev = rest->prev;
        if (front->prev)
            front->prev->next = front;
        front->next = rest;
        rest->prev = front;
        /* As torch: the segment's context stays with the remainder (the front has none), so a
         * segment reports frames only until its first block is split off. */
        front->es = rest->es;
        front->oversize_segment = rest->oversize_segment; /* every block carries its segment's flag */
        if (rest->in_pool) { /* found in the pool: mostly keeps its place there */
            block_pool_rekey(pool, rest, rest->ptr + p->size, rest->size - p->size);
            rest->gc_base = pool->search_count;
        } else {
            rest->ptr += p->size;
            rest->size -= p->size;
            cache_pool_insert(rest);
        }
        b = front;
        if (b->es) {
            /* expandable segments keep no inactive-split stats */
        } else if (already_split) {
            cache_stat_dec(dc->stats.inactive_split_bytes, kind, (int64_t)b->size);
        } else {
            cache_stat_inc(dc->stats.inactive_split_bytes, kind, (int64_t)rest->size);
            cache_stat_inc(dc->stats.inactive_split, kind, 1);
        }
    } else {
        if (b->in_pool)
            block_pool_remove(pool, b);
        if (already_split && !b->es) {
            cache_stat_dec(dc->stats.inactive_split_bytes, kind, (int64_t)b->size);
            cache_stat_dec(dc->stats.inactive_split, kind, 1);
        }
    }
    ptr_map_put_reserved(&dc->allocated_blocks, b->ptr, b);
    b->allocated = true;
    b->requested_size = orig_size;
    if (dc->record_context >= NPUALLOC_RECORD_STATE) {
        b->ctx = dc->current_ctx;
        npualloc_context_retain(b->ctx);
    }
    cache_history_record(dc, TRACE_ALLOC, b->ptr, orig_size, b->stream);
    cache_stat_inc(dc->stats.allocation, kind, 1);
    cache_stat_inc(dc->stats.allocated_bytes, kind, (int64_t)b->size);
    cache_stat_inc(dc->stats.active, kind, 1);
    cache_stat_inc(dc->stats.active_bytes, kind, (int64_t)b->size);
    cache_stat_inc(dc->stats.requested_bytes, kind, (int64_t)orig_size);
    b->oversize_alloc = b->size >= max_split_size(dc);
    if (b->oversize_alloc)
        cache_stat_one_inc(&dc->stats.oversize_allocations, 1);
    *out = (void *)b->ptr;
    return ACL_SUCCESS;
}

/* Can free block dst absorb its neighbour src (free too, no events or uses pending)? */
static inline bool can_merge(const cache_block *dst, const cache_block *src)
{
    return src && !src->allocated && src->event_count <= 0 && src->use_count == 0 && src->mapped == dst->mapped;
}

/* Merges src into dst (can_merge holds; out of line, as most frees merge nothing) and returns the
 * bytes taken over.  With take_place, dst (not indexed) also takes src's place in the pool's
 * index, saving a removal and an insertion (complete_free re-keys it afterwards). */
static size_t merge_into(device_cache *dc, cache_block *dst, cache_block *src, bool take_place)
{
    if (take_place && src->in_pool)
        block_pool_transplant(src, dst);
    if (dst->prev == src) {
        dst->ptr = src->ptr;
        dst->prev = src->prev;
        if (dst->prev)
            dst->prev->next = dst;
        cache_context_drop(dst->segment_ctx); /* torch: dst takes src's (moved) */
        dst->segment_ctx = src->segment_ctx;
        src->segment_ctx = NULL;
    } else {
        dst->next = src->next;
        if (dst->next)
            dst->next->prev = dst;
    }
    size_t subsumed = src->size;
    dst->size += subsumed;
    if (src->in_pool)
        block_pool_remove(src->pool, src);
    else if (!src->mapped)
        block_pool_remove_unmapped(src->pool, src);
    cache_block_delete(dc, src);
    return subsumed;
}

size_t cache_try_merge(device_cache *dc, cache_block *dst, cache_block *src)
{
    return can_merge(dst, src) ? merge_into(dc, dst, src, false) : 0;
}

/* Completes a free: merges with free neighbours and caches the result.  Inline into the user's
 * free (cache_free_locked); the other callers (events, pins) use free_block. */
static ALWAYS_INLINE void complete_free(device_cache *dc, cache_block *b)
{
    cache_history_record_ctx(dc, TRACE_FREE_COMPLETED, b->ptr, b->requested_size, b->stream, b->ctx);
    size_t original_size = b->size, requested = b->requested_size;
    block_pool *pool = b->pool;
    const unsigned kind = pool_stat_kind(pool);
    int64_t net_splits = 0, net_split_bytes = 0;
    cache_context_drop(b->ctx); /* a cached block has no allocation context */
    b->ctx = NULL;
    cache_block *neighbours[2] = {b->prev, b->next};
    for (int i = 0; i < 2; i++) {
        if (can_merge(b, neighbours[i])) {
            net_splits--;
            net_split_bytes -= (int64_t)merge_into(dc, b, neighbours[i], !b->in_pool);
        }
    }
    if (b->in_pool) { /* took a merged neighbour's place: mostly the right one already */
        block_pool_rekey(pool, b, b->ptr, b->size);
        b->gc_base = pool->search_count;
    } else {
        cache_pool_insert(b);
    }
    if (block_is_split(b)) {
        net_splits++;
        net_split_bytes += (int64_t)b->size;
    }
    if (net_splits && !b->es)
        cache_stat_update(dc->stats.inactive_split, kind, net_splits);
    if (net_split_bytes && !b->es)
        cache_stat_update(dc->stats.inactive_split_bytes, kind, net_split_bytes);
    cache_stat_dec(dc->stats.active, kind, 1);
    cache_stat_dec(dc->stats.active_bytes, kind, (int64_t)original_size);
    cache_stat_dec(dc->stats.requested_bytes, kind, (int64_t)requested);
}

static void free_block(device_cache *dc, cache_block *b) { complete_free(dc, b); }

/* ---- sharing pin (see caching.h) ---- */

void (*cache_share_freed)(device_cache *dc, cache_block *b);

void cache_share_unpin_locked(device_cache *dc, cache_block *b)
{
    if (--b->share_pins > 0 || b->allocated)
        return;
    for (cache_block **link = &dc->pinned; *link; link = &(*link)->pinned_next) {
        if (*link == b) {
            *link = b->pinned_next;
            b->pinned_next = NULL;
            if (--b->event_count == 0)
                free_block(dc, b);
            return;
        }
    }
}

void cache_free_locked(device_cache *dc, cache_block *b)
{
    b->allocated = false;
    if (unlikely(b->shared)) { /* sharing pin: no reuse while another process has it open */
        b->shared = false;
        if (cache_share_freed)
            cache_share_freed(dc, b);
        if (b->share_pins) {
            b->event_count++; /* dropped by the last cache_share_unpin_locked */
            b->pinned_next = dc->pinned;
            dc->pinned = b;
        }
    }
    const unsigned kind = pool_stat_kind(b->pool);
    cache_stat_dec(dc->stats.allocation, kind, 1);
    cache_stat_dec(dc->stats.allocated_bytes, kind, (int64_t)b->size);
    cache_history_record_ctx(dc, TRACE_FREE_REQUESTED, b->ptr, b->requested_size, b->stream, b->ctx);
    if (b->oversize_alloc) /* counted when allocated, whatever max_split is now */
        cache_stat_one_dec(&dc->stats.oversize_allocations, 1);
    if (b->use_count > 0 && dc->route_count > 0 &&
        ARRAY_RESERVE(dc->deferred, dc->deferred_capacity, dc->deferred_count + 1, 8)) {
        /* During a capture events cannot be recorded: they are inserted when it ends.  (Out of host
         * memory, they are recorded now, with every use: correct, just early.) */
        dc->deferred[dc->deferred_count++] = b;
        return;
    }
    if (b->use_count > 0) {
        if (unlikely(dc->capture_use_count))
            forget_capture_uses(dc, b, NULL, false);
        insert_events(dc, b);
    } else if (b->event_count == 0) { /* non-zero: held by a sharing pin */
        complete_free(dc, b);
    }
}

/* Adds `stream` to the block's uses, with its free's event reserved; fails only for host memory. */
static aclError add_use(device_cache *dc, cache_block *b, uint64_t stream)
{
    /* torch_npu records even the block's own stream (no early return). */
    for (uint32_t i = 0; i < b->use_count; i++)
        if (b->uses[i] == stream)
            return ACL_SUCCESS;
    if (b->use_count == b->use_capacity) {
        uint32_t cap = b->use_capacity ? b->use_capacity * 2 : 2;
        uint64_t *uses = realloc(b->uses, cap * sizeof *uses);
        if (!uses)
            return ACL_ERROR_BAD_ALLOC;
        b->uses = uses;
        b->use_capacity = cap;
    }
    /* The free's event is reserved now, so the free never runs out of host memory: it would have
     * to wait for the stream there, with the lock held, which the stream's queued work (a callback
     * freeing memory) may need. */
    if (!ARRAY_RESERVE(dc->queues, dc->queue_capacity, dc->queue_count + dc->spare_event_count + 1, 4))
        return ACL_ERROR_BAD_ALLOC;
    pending_event *e = malloc(sizeof *e);
    if (!e)
        return ACL_ERROR_BAD_ALLOC;
    e->next = dc->spare_events;
    dc->spare_events = e;
    dc->spare_event_count++;
    b->uses[b->use_count++] = stream;
    return ACL_SUCCESS;
}

aclError cache_record_stream_locked(device_cache *dc, cache_block *b, uint64_t stream)
{
    bool mark = false;
    if (unlikely(dc->route_count > 0)) { /* marked as recorded during a capture (capture_use) */
        bool known = false;
        for (size_t i = 0; i < dc->capture_use_count && !known; i++)
            known = dc->capture_uses[i].block == b && dc->capture_uses[i].stream == stream;
        if (!known) {
            if (!ARRAY_RESERVE(dc->capture_uses, dc->capture_use_capacity, dc->capture_use_count + 1, 4))
                return ACL_ERROR_BAD_ALLOC;
            mark = true;
        }
    }
    aclError rc = add_use(dc, b, stream);
    /* Marked only once the use is recorded: the mark of a failed record outlived its block, and took
     * from the next block in the same struct a use recorded before a capture. */
    if (rc == ACL_SUCCESS && mark)
        dc->capture_uses[dc->capture_use_count++] = (capture_use){b, stream};
    return rc;
}

/* torch_npu's eraseStream also cancels the block's events queued on `stream`; there are none
 * here: events are recorded only when a block is freed, and `b` is allocated (the caller found
 * it in allocated_blocks), so it has none until its next free. */
void cache_erase_stream_locked(device_cache *dc, cache_block *b, uint64_t stream)
{
    drop_use(dc, b, stream);
    forget_capture_uses(dc, b, &stream, false);
}

/* ---- malloc ---- */

static void fill_oom(device_cache *dc, const alloc_params *p, size_t orig_size, npualloc_oom_info *oom)
{
    size_t device_free = 0, device_total = 0;
    dc->backend->mem_info(dc->backend_ctx, dc->device, &device_free, &device_total);
    memset(oom, 0, sizeof *oom);
    oom->device = dc->device;
    oom->requested = orig_size;
    oom->alloc_size = p->alloc_size;
    oom->device_total = device_total;
    oom->device_free = device_free;
    oom->allocated = (size_t)cache_stat_all(dc->stats.allocated_bytes).current;
    oom->active = (size_t)cache_stat_all(dc->stats.active_bytes).current;
    oom->reserved = (size_t)cache_stat_all(dc->stats.reserved_bytes).current;
    oom->fraction_set = dc->set_fraction;
    oom->allowed = dc->allowed_memory_maximum;
}

/* The use_on_oom pool marked next after `after` (torch iterates a hash set, in no documented
 * order: npualloc takes the pools in the order they were marked), or NULL. */
static private_pool *next_oom_pool(device_cache *dc, uint64_t after)
{
    private_pool *next = NULL;
    for (private_pool *pp = dc->private_pools; pp; pp = pp->next)
        if (pp->use_on_oom && pp->oom_mark > after && (!next || pp->oom_mark < next->oom_mark))
            next = pp;
    return next;
}

/* torch's try_mempool_fallback, after the device refused a new segment for want of memory: a
 * request of the default pools takes a free block of the first use_on_oom pool that has one,
 * searched as the pool's own allocations are (same size, stream and rules).  The block stays the
 * pool's: its stats kind, snapshot and free are that pool's.  A request already routed to a private
 * pool just goes on.  torch enters each pool as beginAllocateToPool does (and leaves it, so its use
 * count ends as it was): a pool some capture or use_mem_pool is recording into fails the allocation
 * with that call's error.  1 found (p now names the pool and block), 0 none, -1 that error. */
static int try_oom_pools(device_cache *dc, alloc_params *p)
{
    if (p->pool->owner)
        return 0;
    for (private_pool *pp = next_oom_pool(dc, 0); pp; pp = next_oom_pool(dc, pp->oom_mark)) {
        if (pp->use_count <= 0)
            continue; /* nobody holds it: its memory is on its way back (torch never has such a pool) */
        if (pool_routed(dc, pp)) {
            cache_set_error(NPUALLOC_ERR_RUNTIME, "beginAllocateToPool: already recording to mempool_id");
            return -1;
        }
        alloc_params q = *p;
        q.pool = p->pool->is_small ? &pp->small : &pp->large;
        q.block = NULL;
        if (get_free_block(dc, &q, false)) {
            q.err = ACL_SUCCESS;
            *p = q;
            return 1;
        }
    }
    return 0;
}

/* The first steps of every allocation: completed frees are taken in, the size rounded, the pool
 * chosen.  A new segment's size is worked out only on a miss (cache_malloc_locked). */
static inline void begin_malloc(device_cache *dc, size_t orig_size, uint64_t stream, alloc_params *p)
{
    if (likely(dc->route_count == 0)) /* no events are processed while a capture is underway */
        process_events(dc);
    p->size = cache_round_size(dc->settings, dc->pad, orig_size);
    p->stream = stream;
    p->pool = get_pool(dc, p->size, stream);
    p->alloc_size = 0;
    p->block = NULL;
    p->err = ACL_SUCCESS;
}

bool cache_malloc_cached_locked(device_cache *dc, size_t orig_size, uint64_t stream, void **out)
{
    alloc_params p;
    begin_malloc(dc, orig_size, stream, &p);
    if (!get_free_block(dc, &p, true))
        return false;
    align_block_start(dc, &p);
    return alloc_found_block(dc, &p, orig_size, out) == ACL_SUCCESS;
}

/* A new segment (or an expandable segment's page) refused for another reason than memory: its error, which
 * names the page or the segment.  Cold and apart, so that the miss path around it compiles as before. */
static __attribute__((cold, noinline)) aclError segment_refused(device_cache *dc, const alloc_params *p)
{
    if (uses_expandable_segments(dc, p->pool))
        cache_set_error(NPUALLOC_ERR_RUNTIME, "NPU error: mapping a %zu-byte page of an expandable segment on device %d "
                        "failed with ACL error %d", expandable_page_size(dc, p->pool), dc->device, p->err);
    else
        cache_set_error(NPUALLOC_ERR_RUNTIME, "NPU error: allocating a %zu-byte segment on device %d failed with ACL "
                        "error %d", p->alloc_size, dc->device, p->err);
    return p->err;
}

/* cache_malloc_locked after get_free_block found nothing: the callbacks, a new segment, the releases and
 * retries, the out-of-memory report. */
static aclError malloc_on_miss(device_cache *dc, alloc_params *p, size_t orig_size, uint64_t stream, void **out,
                               npualloc_oom_info *oom)
{
    p->alloc_size = allocation_size(dc->settings, p->size, p->pool->is_small);
    /* A new block of the stream is about to be made: its index must be ready, so that putting
     * the block in the pool later cannot fail.  A hit needs no check: the block found proves
     * the stream's index exists. */
    if (unlikely(block_pool_prepare(p->pool, stream) != 0)) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory for the block index");
        return ACL_ERROR_BAD_ALLOC;
    }
    bool found = trigger_free_memory_callbacks(dc) && get_free_block(dc, p, false);
    if (!found) {
        if (dc->set_fraction && dc->settings->garbage_collection_threshold > 0.0)
            garbage_collect_cached_blocks(dc);
        if (dc->set_fraction && dc->settings->throw_on_npumalloc_oom &&
            dc->total_allocated_memory + p->alloc_size > dc->allowed_memory_maximum) {
            /* throw_on_npumalloc_oom: reject before trying the device or the retry chain. */
            dc->stats.num_oom_rejections++;
            fill_oom(dc, p, orig_size, oom);
            oom->preemptive = true;
            return ACL_ERROR_RT_MEMORY_ALLOCATION;
        }
        found = alloc_block(dc, p, false);
        if (!found) {
            /* torch: before releasing anything, and only for a device out of memory (its fallback asks
             * for that status; another failure of the segment is no reason to lend a pool's block) */
            int fallback = p->err == ACL_ERROR_RT_MEMORY_ALLOCATION ? try_oom_pools(dc, p) : 0;
            if (fallback < 0)
                return ACL_ERROR_INVALID_PARAM;
            found = fallback > 0 || (release_available_cached_blocks(dc, p) && alloc_block(dc, p, false));
        }
    }
    if (!found && dc->route_count == 0) {
        /* Last resort: drain the device, return every cached segment, try once more. */
        synchronize_device_unlocked(dc);
        found = release_cached_blocks(dc, false) && alloc_block(dc, p, true);
    }
    if (!found) {
        if (p->err != ACL_ERROR_RT_MEMORY_ALLOCATION)
            return segment_refused(dc, p);
        dc->stats.num_ooms++;
        fill_oom(dc, p, orig_size, oom);
        cache_history_record(dc, TRACE_OOM, oom->device_free, p->size, stream);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    align_block_start(dc, p);
    return alloc_found_block(dc, p, orig_size, out);
}

aclError cache_malloc_locked(device_cache *dc, size_t orig_size, uint64_t stream, void **out,
                             npualloc_oom_info *oom)
{
    alloc_params p;
    begin_malloc(dc, orig_size, stream, &p);
    if (get_free_block(dc, &p, false)) {
        align_block_start(dc, &p);
        return alloc_found_block(dc, &p, orig_size, out);
    }
    /* A miss releases the lock on its way (the free-memory callbacks, the synchronizes before releasing
     * cached memory), when another thread may end the pool's route and release it: torch holds its mutex
     * throughout, so the allocation comes first and the pool stays until it is done. */
    private_pool *pinned = p.pool->owner;
    if (pinned)
        pinned->mallocs_underway++;
    aclError rc = malloc_on_miss(dc, &p, orig_size, stream, out, oom);
    if (pinned)
        pinned->mallocs_underway--;
    return rc;
}

/* ---- private pools ---- */

static bool same_id(npualloc_mempool_id a, npualloc_mempool_id b) { return a.first == b.first && a.second == b.second; }

private_pool *cache_pool_find(device_cache *dc, npualloc_mempool_id id)
{
    for (private_pool *pp = dc->private_pools; pp; pp = pp->next)
        if (same_id(pp->id, id))
            return pp;
    return NULL;
}

aclError cache_pool_create_locked(device_cache *dc, npualloc_mempool_id id, npualloc_alloc_fn alloc_fn,
                                  npualloc_free_fn free_fn)
{
    if (id.first == 0 && id.second == 0) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "the default pool id (0, 0) is not a private pool");
        return ACL_ERROR_INVALID_PARAM;
    }
    private_pool *pp = cache_pool_find(dc, id);
    if (pp) {
        if (alloc_fn && (pp->segment_alloc_fn != alloc_fn || pp->segment_free_fn != free_fn)) {
            cache_set_error(NPUALLOC_ERR_RUNTIME, "mempool (%llu, %llu) exists with another allocator",
                            (unsigned long long)id.first, (unsigned long long)id.second);
            return ACL_ERROR_INVALID_PARAM;
        }
        pp->use_count++;
        return ACL_SUCCESS;
    }
    if (!(pp = calloc(1, sizeof *pp))) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory for a pool");
        return ACL_ERROR_BAD_ALLOC;
    }
    pp->id = id;
    pp->use_count = 1;
    pp->segment_alloc_fn = alloc_fn;
    pp->segment_free_fn = free_fn;
    block_pool_init(&pp->small, true, pp);
    block_pool_init(&pp->large, false, pp);
    pp->next = dc->private_pools;
    dc->private_pools = pp;
    return ACL_SUCCESS;
}

aclError cache_pool_release_locked(device_cache *dc, npualloc_mempool_id id)
{
    private_pool *pp = cache_pool_find(dc, id);
    if (!pp || pp->use_count <= 0) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "releasePool: pool (%llu, %llu) is not in use",
                        (unsigned long long)id.first, (unsigned long long)id.second);
        return ACL_ERROR_INVALID_PARAM;
    }
    pp->use_count--;
    return ACL_SUCCESS;
}

/* The private pool `id` for a setting, or NULL with the error set. */
static private_pool *pool_to_set(device_cache *dc, npualloc_mempool_id id)
{
    private_pool *pp = cache_pool_find(dc, id);
    if (!pp)
        cache_set_error(NPUALLOC_ERR_RUNTIME, "mempool (%llu, %llu) does not exist on device %d",
                        (unsigned long long)id.first, (unsigned long long)id.second, (int)dc->device);
    return pp;
}

aclError cache_pool_set_use_on_oom_locked(device_cache *dc, npualloc_mempool_id id, bool use_on_oom)
{
    private_pool *pp = cache_pool_find(dc, id);
    if (!use_on_oom) { /* torch erases the id from a set: nothing to do for an unknown one */
        if (pp)
            pp->use_on_oom = false;
        return ACL_SUCCESS;
    }
    if (!(pp = pool_to_set(dc, id)))
        return ACL_ERROR_INVALID_PARAM;
    if (!pp->use_on_oom) { /* marking twice keeps the pool's place, as a set insert does */
        pp->use_on_oom = true;
        pp->oom_mark = ++dc->oom_marks;
    }
    return ACL_SUCCESS;
}

aclError cache_pool_set_no_split_locked(device_cache *dc, npualloc_mempool_id id)
{
    private_pool *pp = pool_to_set(dc, id);
    if (!pp)
        return ACL_ERROR_INVALID_PARAM;
    pp->small.no_split = pp->large.no_split = true;
    return ACL_SUCCESS;
}

static bool reserve_route(device_cache *dc)
{
    if (ARRAY_RESERVE(dc->routes, dc->route_capacity, dc->route_count + 1, 4))
        return true;
    cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory for a pool route");
    return false;
}

aclError cache_pool_begin_locked(device_cache *dc, npualloc_mempool_id id, npualloc_pool_filter filter,
                                 uint64_t value)
{
    /* torch: one recording per pool at a time, whatever its filter.  (torch takes the pool's
     * reference before this check and keeps it on failure; here a refused begin changes nothing.) */
    for (size_t i = 0; i < dc->route_count; i++) {
        if (same_id(dc->routes[i].id, id)) {
            cache_set_error(NPUALLOC_ERR_RUNTIME, "beginAllocateToPool: already recording to mempool_id");
            return ACL_ERROR_INVALID_PARAM;
        }
    }
    if (!reserve_route(dc))
        return ACL_ERROR_BAD_ALLOC;
    aclError rc = cache_pool_create_locked(dc, id, NULL, NULL); /* creates, or takes a reference */
    if (rc != ACL_SUCCESS)
        return rc;
    dc->routes[dc->route_count++] = (pool_route){id, cache_pool_find(dc, id), filter, value, true};
    return ACL_SUCCESS;
}

aclError cache_pool_join_locked(device_cache *dc, npualloc_mempool_id id, uint64_t stream)
{
    for (size_t i = 0; i < dc->route_count; i++) {
        if (same_id(dc->routes[i].id, id) && dc->routes[i].filter == NPUALLOC_POOL_FILTER_STREAM) {
            /* torch: the capture's filter matches every stream of the capture under the one
             * reference beginAllocateToPool took, so a joined route takes none and its end drops
             * none (the pool stays while any route points at it: release_freeable_pool). */
            if (!reserve_route(dc))
                return ACL_ERROR_BAD_ALLOC;
            dc->routes[dc->route_count++] = (pool_route){id, dc->routes[i].pool, NPUALLOC_POOL_FILTER_STREAM, stream,
                                                         false};
            return ACL_SUCCESS;
        }
    }
    cache_set_error(NPUALLOC_ERR_RUNTIME, "joinAllocateToPool: no capture is recording to mempool_id");
    return ACL_ERROR_INVALID_PARAM;
}

aclError cache_pool_end_locked(device_cache *dc, npualloc_mempool_id id)
{
    /* The newest route to this pool ends (routes nest like context managers). */
    for (size_t i = dc->route_count; i-- > 0;) {
        if (same_id(dc->routes[i].id, id)) {
            bool owns_ref = dc->routes[i].owns_ref;
            memmove(&dc->routes[i], &dc->routes[i + 1], (dc->route_count - i - 1) * sizeof *dc->routes);
            dc->route_count--;
            return owns_ref ? cache_pool_release_locked(dc, id) : ACL_SUCCESS;
        }
    }
    cache_set_error(NPUALLOC_ERR_RUNTIME, "endAllocatePool: not currently recording to mempool_id");
    return ACL_ERROR_INVALID_PARAM;
}

void cache_pool_empty_locked(device_cache *dc, npualloc_mempool_id id)
{
    /* The events are waited for below: drain the device first with the lock released, as
     * empty_cache does, or a stream task that needs the lock (a callback freeing memory) and
     * precedes a recorded use would never run. */
    synchronize_device_unlocked(dc);
    synchronize_and_free_events(dc);
    private_pool *pp = cache_pool_find(dc, id); /* after the waits: another thread may have freed it */
    if (pp)
        release_freeable_pool(dc, pp, false);
}

/* ---- empty_cache, fraction ---- */

void cache_empty_locked(device_cache *dc, bool keep_pages)
{
    synchronize_device_unlocked(dc);
    release_cached_blocks(dc, keep_pages);
}

void cache_set_fraction_locked(device_cache *dc, double fraction)
{
    size_t free_bytes = 0, total = 0;
    dc->backend->mem_info(dc->backend_ctx, dc->device, &free_bytes, &total);
    dc->fraction = fraction;
    dc->allowed_memory_maximum = (size_t)(fraction * (double)total);
    dc->set_fraction = true;
}

/* ---- lifetime ---- */

static size_t segment_size(const cache_block *head)
{
    size_t total = 0;
    for (const cache_block *b = head; b; b = b->next)
        total += b->size;
    return total;
}

void cache_device_init(device_cache *dc, int32_t device, const alloc_settings *settings,
                       const cache_backend *backend, void *backend_ctx, size_t pad)
{
    dc->device = device;
    dc->settings = settings;
    dc->backend = backend;
    dc->backend_ctx = backend_ctx;
    dc->pad = pad;
    block_pool_init(&dc->large, false, NULL);
    block_pool_init(&dc->small, true, NULL);
    memset(&dc->stats, 0, sizeof dc->stats);
    dc->stats.max_split_size = dc->settings->max_split_size == SIZE_MAX ? -1 : (int64_t)dc->settings->max_split_size;
    if (dc->settings->per_process_memory_fraction_set)
        cache_set_fraction_locked(dc, dc->settings->per_process_memory_fraction);
    /* Last, and atomically: cache_get reads it without a lock and then uses the cache. */
    __atomic_store_n(&dc->started, true, __ATOMIC_RELEASE);
}

/* Collects the head of every segment: the blocks with no predecessor. */
typedef struct head_list {
    cache_block **items;
    size_t count, capacity;
    bool failed;
} head_list;

static void head_push(head_list *l, cache_block *b)
{
    if (!ARRAY_RESERVE(l->items, l->capacity, l->count + 1, 64)) {
        l->failed = true;
        return;
    }
    l->items[l->count++] = b;
}

/* Every block is exactly one of: cached (pool), unmapped, allocated, waiting for events or
 * for sharing pins; so visiting all five sets meets each segment's first block once. */
static void collect_head(cache_block *b, head_list *l)
{
    if (!b->prev)
        head_push(l, b);
}

static int head_order(const void *a, const void *b)
{
    uintptr_t x = (*(cache_block *const *)a)->ptr, y = (*(cache_block *const *)b)->ptr;
    return (x > y) - (x < y);
}

static void dedupe_heads(head_list *l)
{
    size_t out = 0;
    for (size_t i = 0; i < l->count; i++)
        if (out == 0 || l->items[i] != l->items[out - 1])
            l->items[out++] = l->items[i];
    l->count = out;
}

/* Finds the first block of every segment, from every block reachable: cached, unmapped,
 * allocated, or waiting for events.  Sorted by address, no duplicates. */
static void collect_pool_heads(block_pool *pool, head_list *heads)
{
    for (cache_block *b = block_pool_first(pool); b; b = block_pool_next(b))
        collect_head(b, heads);
    for (avl_node *n = avl_first(&pool->unmapped); n; n = avl_next(n))
        collect_head(AVL_ENTRY(n, cache_block, pool_node), heads);
}

static void collect_heads(device_cache *dc, head_list *heads)
{
    collect_pool_heads(&dc->large, heads);
    collect_pool_heads(&dc->small, heads);
    for (private_pool *pp = dc->private_pools; pp; pp = pp->next) {
        collect_pool_heads(&pp->large, heads);
        collect_pool_heads(&pp->small, heads);
    }
    for (size_t i = 0; i < dc->deferred_count; i++)
        collect_head(dc->deferred[i], heads);
    for (size_t i = 0; dc->allocated_blocks.mask && i <= dc->allocated_blocks.mask; i++)
        if (dc->allocated_blocks.slots[i].key)
            collect_head(dc->allocated_blocks.slots[i].value, heads);
    for (size_t i = 0; i < dc->queue_count; i++)
        for (pending_event *e = dc->queues[i].head; e; e = e->next)
            collect_head(e->block, heads);
    for (cache_block *b = dc->pinned; b; b = b->pinned_next) /* sharing pin */
        collect_head(b, heads);
    if (heads->count > 1)
        qsort(heads->items, heads->count, sizeof *heads->items, head_order);
    dedupe_heads(heads); /* a pending block has one queue entry per stream that used it */
}

bool cache_each_segment(device_cache *dc, void (*fn)(cache_block *head, void *ctx), void *ctx)
{
    head_list heads = {0};
    collect_heads(dc, &heads);
    for (size_t i = 0; i < heads.count && !heads.failed; i++)
        fn(heads.items[i], ctx);
    free(heads.items);
    return !heads.failed;
}

/* Frees the device's metadata; `return_memory` also gives every segment back to the runtime
 * (false after fork, where the memory is not in the process).  Asks for no memory, so that shutdown
 * out of host memory still gives every segment back (a pool's free function is told of each). */
static void release_everything(device_cache *dc, bool return_memory)
{
    /* Every block struct lives in a chunk: a live one has a pool, a spare one is marked as having
     * none, and each segment is met once, at its first block. */
    for (cache_block *b = dc->spare_blocks; b; b = b->free_link)
        b->pool = NULL;
    for (size_t c = 0; c < dc->chunk_count; c++) {
        for (cache_block *head = dc->chunks[c]; head < dc->chunks[c] + BLOCKS_PER_CHUNK; head++) {
            if (!head->pool || head->prev)
                continue;
            if (return_memory && !head->es)
                segment_give_back(dc, head->pool, head->stream, (void *)head->ptr, segment_size(head));
            for (cache_block *b = head; b; b = b->next) {
                free(b->uses);
                npualloc_context_release(b->ctx);
                npualloc_context_release(b->segment_ctx);
            }
        }
    }
    expandable_release_all(dc, return_memory);
    /* Pending frees are dropped (their streams are being torn down anyway). */
    for (size_t i = 0; i < dc->queue_count; i++) {
        while (dc->queues[i].head) {
            pending_event *e = dc->queues[i].head;
            dc->queues[i].head = e->next;
            stream_release(e->stream);
            free(e);
        }
    }
    free(dc->queues);
    while (dc->spare_events)
        free(take_spare_event(dc));
    while (dc->private_pools) {
        private_pool *pp = dc->private_pools;
        dc->private_pools = pp->next;
        block_pool_destroy(&pp->small);
        block_pool_destroy(&pp->large);
        free(pp);
    }
    block_pool_destroy(&dc->small);
    block_pool_destroy(&dc->large);
    free(dc->routes);
    free(dc->deferred);
    free(dc->capture_uses);
    ptr_map_free(&dc->allocated_blocks);
    for (size_t i = 0; i < dc->chunk_count; i++)
        free(dc->chunks[i]);
    free(dc->chunks);
    for (size_t i = 0; i < dc->history_count; i++)
        trace_entry_drop(&dc->history[i]);
    free(dc->history);
    npualloc_context_release(dc->user_metadata);
    cache_lock lock = dc->lock;
    memset(dc, 0, sizeof *dc);
    dc->lock = lock;
}

void cache_device_release_all(device_cache *dc) { release_everything(dc, true); }
void cache_device_forget(device_cache *dc) { release_everything(dc, false); }

/* ---- the invariant checker ---- */

typedef struct check_state {
    int64_t oversize_allocs, oversize_segments;
    const device_cache *dc;
    int32_t device;
    size_t free_blocks;
    size_t recorded_uses; /* record_stream uses not yet turned into events */
    char *why;
    size_t len;
    bool failed;
    npualloc_stats expect;
    size_t reserved_total;
    uintptr_t last_end;
} check_state;

#define CHECK(cond, ...)                                                                                           \
    do {                                                                                                           \
        if (!st->failed && !(cond)) {                                                                              \
            st->failed = true;                                                                                     \
            snprintf(st->why, st->len, __VA_ARGS__);                                                               \
        }                                                                                                          \
    } while (0)

static void count_block(check_state *st, const cache_block *b, int kind, bool is_free)
{
    if (b->allocated) {
        st->expect.allocation[NPUALLOC_STAT_ALL].current++;
        st->expect.allocated_bytes[NPUALLOC_STAT_ALL].current += (int64_t)b->size;
        st->expect.allocation[kind].current++;
        st->expect.allocated_bytes[kind].current += (int64_t)b->size;
    }
    if (!is_free) {
        st->expect.active[NPUALLOC_STAT_ALL].current++;
        st->expect.active_bytes[NPUALLOC_STAT_ALL].current += (int64_t)b->size;
        st->expect.active[kind].current++;
        st->expect.active_bytes[kind].current += (int64_t)b->size;
        st->expect.requested_bytes[NPUALLOC_STAT_ALL].current += (int64_t)b->requested_size;
        st->expect.requested_bytes[kind].current += (int64_t)b->requested_size;
    } else if (block_is_split(b) && !b->es) {
        st->expect.inactive_split[NPUALLOC_STAT_ALL].current++;
        st->expect.inactive_split_bytes[NPUALLOC_STAT_ALL].current += (int64_t)b->size;
        st->expect.inactive_split[kind].current++;
        st->expect.inactive_split_bytes[kind].current += (int64_t)b->size;
    }
}

/* Checks an expandable block against its segment's page table. */
static void check_pages(check_state *st, const cache_block *b)
{
    const expandable_segment *es = b->es;
    if (b->mapped) {
        size_t first = (b->ptr - es->base) / es->page_size, last = (b->ptr + b->size - es->base - 1) / es->page_size;
        for (size_t i = first; i <= last; i++)
            CHECK(i < es->handle_count && es->handles[i] != 0, "block %#lx is mapped but its page %zu is not",
                  (unsigned long)b->ptr, i);
    } else {
        CHECK((b->ptr - es->base) % es->page_size == 0 && b->size % es->page_size == 0,
              "unmapped block %#lx does not cover whole pages", (unsigned long)b->ptr);
        size_t end = (b->ptr + b->size - es->base) / es->page_size;
        for (size_t i = (b->ptr - es->base) / es->page_size; i < end && i < es->handle_count; i++)
            CHECK(es->handles[i] == 0, "block %#lx is unmapped but its page %zu is mapped", (unsigned long)b->ptr, i);
        CHECK(!b->allocated && b->event_count == 0 && !b->in_pool, "unmapped block %#lx is in use or cached",
              (unsigned long)b->ptr);
    }
}

static void check_segment(cache_block *head, void *ctx)
{
    check_state *st = ctx;
    bool small = head->pool->is_small;
    int kind = small ? NPUALLOC_STAT_SMALL_POOL : NPUALLOC_STAT_LARGE_POOL;
    const cache_backend *be = st->dc->backend;
    CHECK(head->ptr >= st->last_end, "segment %#lx overlaps the previous one", (unsigned long)head->ptr);
    CHECK(!head->es || head->ptr == head->es->base, "expandable chain %#lx does not start at its segment",
          (unsigned long)head->ptr);
    size_t total = 0, mapped_total = 0, run = 0;
    uintptr_t expect_ptr = head->ptr, run_start = head->ptr;
    bool prev_free = false, prev_unmapped = false;
    for (cache_block *b = head; b; b = b->next) {
        CHECK(b->ptr == expect_ptr, "block %#lx does not start where its predecessor ends (%#lx)",
              (unsigned long)b->ptr, (unsigned long)expect_ptr);
        CHECK(!b->next || b->next->prev == b, "block %#lx: next/prev links disagree", (unsigned long)b->ptr);
        CHECK(b->pool == head->pool && b->stream == head->stream && b->es == head->es,
              "block %#lx: pool, stream or segment differs from its chain", (unsigned long)b->ptr);
        CHECK(b->size > 0 && b->size % K_MIN_BLOCK_SIZE == 0, "block %#lx: size %zu is not a positive multiple of 512",
              (unsigned long)b->ptr, b->size);
        expect_ptr += b->size;
        total += b->size;
        if (b->es)
            check_pages(st, b);
        if (!b->mapped) {
            CHECK(b->es != NULL, "block %#lx is unmapped outside an expandable segment", (unsigned long)b->ptr);
            CHECK(!prev_unmapped, "unmapped neighbours at %#lx were not merged", (unsigned long)b->ptr);
            /* a mapped run ends here: the runtime must hold exactly it */
            CHECK(!run || !be->segment_valid || be->segment_valid(st->dc->backend_ctx, st->device, (void *)run_start, run),
                  "mapped range %#lx (%zu bytes) is not mapped memory of device %d", (unsigned long)run_start, run,
                  st->device);
            run = 0;
            run_start = b->ptr + b->size;
            prev_unmapped = true;
            prev_free = false;
            continue;
        }
        bool is_free = !b->allocated && b->event_count == 0 && b->use_count == 0;
        CHECK(!(is_free && prev_free), "free neighbours %#lx and its predecessor were not merged",
              (unsigned long)b->ptr);
        CHECK(b->in_pool == is_free, "block %#lx: in pool %d but free %d", (unsigned long)b->ptr, b->in_pool, is_free);
        prev_free = is_free;
        prev_unmapped = false;
        st->free_blocks += is_free;
        mapped_total += b->size;
        run += b->size;
        count_block(st, b, kind, is_free);
        st->recorded_uses += b->use_count;
        st->oversize_allocs += b->allocated && b->oversize_alloc;
        CHECK(b->oversize_segment == head->oversize_segment, "block %#lx: oversize flag differs from its segment's",
              (unsigned long)b->ptr);
    }
    st->oversize_segments += head->oversize_segment;
    CHECK(!run || !be->segment_valid || be->segment_valid(st->dc->backend_ctx, st->device, (void *)run_start, run),
          "mapped range %#lx (%zu bytes) is not mapped memory of device %d", (unsigned long)run_start, run,
          st->device);
    if (head->es) {
        CHECK(total == head->es->pages * head->es->page_size, "expandable chain %#lx covers %zu of %zu bytes",
              (unsigned long)head->ptr, total, head->es->pages * head->es->page_size);
    } else {
        st->expect.segment[NPUALLOC_STAT_ALL].current++;
        st->expect.segment[kind].current++;
    }
    st->expect.reserved_bytes[NPUALLOC_STAT_ALL].current += (int64_t)mapped_total;
    st->expect.reserved_bytes[kind].current += (int64_t)mapped_total;
    st->reserved_total += mapped_total;
    st->last_end = head->ptr + total;
}

typedef struct owned_count {
    const private_pool *pool;
    size_t segments;
} owned_count;

static void count_owned_segment(cache_block *head, void *ctx)
{
    owned_count *c = ctx;
    c->segments += !head->es && head->pool->owner == c->pool;
}

/* The plain segments and expandable segments a private pool owns (what its count must say); false when
 * out of host memory to count them. */
static bool pool_owned_segments(device_cache *dc, const private_pool *pp, size_t *owned)
{
    owned_count c = {pp, 0};
    if (!cache_each_segment(dc, count_owned_segment, &c))
        return false;
    for (const expandable_segment *es = dc->expandable_segments; es; es = es->next)
        c.segments += es->pool->owner == pp;
    *owned = c.segments;
    return true;
}

aclError cache_check_locked(device_cache *dc, char *why, size_t len)
{
    check_state state = {.dc = dc, .device = dc->device, .why = why, .len = len};
    check_state *st = &state;
    if (!cache_each_segment(dc, check_segment, st)) {
        snprintf(why, len, "out of host memory for the check");
        return ACL_ERROR_BAD_ALLOC;
    }
    static const char *names[] = {"allocation", "segment", "active", "inactive_split", "allocated_bytes",
                                  "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"};
    npualloc_stats stats;
    cache_stats_read(&dc->stats, &stats);
    const npualloc_stat *have[] = STAT_ARRAYS(&stats);
    const npualloc_stat *want[] = {st->expect.allocation, st->expect.segment, st->expect.active,
                                   st->expect.inactive_split, st->expect.allocated_bytes, st->expect.reserved_bytes,
                                   st->expect.active_bytes, st->expect.inactive_split_bytes,
                                   st->expect.requested_bytes};
    for (size_t i = 0; i < ARRAY_LEN(names); i++)
        for (int k = 0; k < NPUALLOC_STAT_TYPES; k++)
            CHECK(have[i][k].current == want[i][k].current, "stat %s[%d].current is %lld but the blocks imply %lld",
                  names[i], k, (long long)have[i][k].current, (long long)want[i][k].current);
    CHECK(dc->stats.oversize_allocations.current == st->oversize_allocs,
          "oversize_allocations is %lld but %lld oversize blocks are allocated",
          (long long)dc->stats.oversize_allocations.current, (long long)st->oversize_allocs);
    CHECK(dc->stats.oversize_segments.current == st->oversize_segments,
          "oversize_segments is %lld but %lld oversize segments exist", (long long)dc->stats.oversize_segments.current,
          (long long)st->oversize_segments);
    CHECK(st->reserved_total == dc->total_allocated_memory, "reserved memory %zu differs from the segments' %zu",
          dc->total_allocated_memory, st->reserved_total);
    CHECK(dc->allocated_blocks.count == (size_t)stats.allocation[NPUALLOC_STAT_ALL].current,
          "the allocated-block table holds %zu blocks for %lld allocations", dc->allocated_blocks.count,
          (long long)stats.allocation[NPUALLOC_STAT_ALL].current);
    size_t pooled = block_pool_count(&dc->large) + block_pool_count(&dc->small);
    for (const private_pool *pp = dc->private_pools; pp; pp = pp->next)
        pooled += block_pool_count(&pp->large) + block_pool_count(&pp->small);
    CHECK(pooled == st->free_blocks, "the pools hold %zu blocks but the segments have %zu free ones", pooled,
          st->free_blocks);
    CHECK(dc->spare_event_count == st->recorded_uses, "%zu event structs are reserved for %zu recorded uses",
          dc->spare_event_count, st->recorded_uses);
    CHECK(dc->queue_capacity >= dc->queue_count + dc->spare_event_count,
          "room for %zu event queues, %zu used and %zu reserved", dc->queue_capacity, dc->queue_count,
          dc->spare_event_count);
    bool indexes_sound = block_pool_check(&dc->large) && block_pool_check(&dc->small);
    for (const private_pool *pp = dc->private_pools; pp; pp = pp->next)
        indexes_sound = indexes_sound && block_pool_check(&pp->large) && block_pool_check(&pp->small);
    CHECK(indexes_sound, "a pool's free-block index is inconsistent (block_pool_check)");
    for (const private_pool *pp = dc->private_pools; pp && !st->failed; pp = pp->next) {
        size_t owned = 0;
        if (!pool_owned_segments(dc, pp, &owned)) {
            snprintf(why, len, "out of host memory for the check");
            return ACL_ERROR_BAD_ALLOC;
        }
        CHECK(pp->segments == owned, "private pool (%llu, %llu) counts %zu segments but owns %zu",
              (unsigned long long)pp->id.first, (unsigned long long)pp->id.second, pp->segments, owned);
    }
    return st->failed ? ACL_ERROR_INTERNAL_ERROR : ACL_SUCCESS;
}
