/*
 * caching_expandable.c - expandable segments (expandable_segments:True): one reserved range per
 * (stream, pool) with pages mapped on demand at the lowest free address, so a growing workload
 * extends its segment instead of fragmenting (PyTorch's "Note [Expandable Segments]", with
 * torch_npu's page sizes).
 *
 * The range is tiled by blocks like any segment; unmapped stretches are blocks too (mapped ==
 * false, kept in the pool's unmapped set).  Invariants: an unmapped block covers whole pages;
 * a mapped block's pages are all mapped; two neighbouring unmapped blocks are merged.
 *
 * Stats as torch: mapping adds to reserved_bytes and num_device_alloc (the segment count does
 * not move); unmapping subtracts and counts num_device_free; no inactive-split stats.
 */
#include <stdlib.h>
#include <string.h>

#include "caching.h"
#include "common.h"

bool expandable_supported(const device_cache *dc) { return dc->backend->reserve != NULL; }

size_t expandable_page_size(const device_cache *dc, const block_pool *pool)
{
    if (pool->is_small)
        return K_SMALL_BUFFER;
    if (dc->settings->page_size_1g)
        return K_EXTRA_LARGE_BUFFER;
    return dc->settings->segment_size ? dc->settings->segment_size : dc->settings->large_segment_size;
}

/* ---- the segment: reserve, map and unmap pages ---- */

static expandable_segment *segment_create(device_cache *dc, block_pool *pool, uint64_t stream)
{
    size_t page = expandable_page_size(dc, pool);
    size_t free_bytes = 0, total = 0;
    dc->backend->mem_info(dc->backend_ctx, dc->device, &free_bytes, &total);
    /* 1 1/8 of the device's memory, so one stream can map all of it plus fragmentation. */
    size_t pages = (total + total / 8 + page - 1) / page;
    if (pages == 0)
        pages = 1;
    expandable_segment *es = calloc(1, sizeof *es);
    uintptr_t base = 0;
    if (!es || dc->backend->reserve(dc->backend_ctx, dc->device, pages * page, &base) != ACL_SUCCESS) {
        free(es);
        return NULL;
    }
    es->stream = stream;
    es->pool = pool;
    es->base = base;
    es->page_size = page;
    es->pages = pages;
    es->next = dc->expandable_segments;
    dc->expandable_segments = es;
    if (pool->owner) /* the pool stays while it owns the segment, however its pages come and go */
        pool->owner->segments++;
    return es;
}

static void segment_destroy(device_cache *dc, expandable_segment *es)
{
    for (expandable_segment **link = &dc->expandable_segments; *link; link = &(*link)->next) {
        if (*link == es) {
            *link = es->next;
            break;
        }
    }
    if (es->pool->owner)
        es->pool->owner->segments--;
    dc->backend->release(dc->backend_ctx, dc->device, es->base, es->pages * es->page_size);
    free(es->handles);
    free(es);
}

/* Takes a kept page of the right size that the pool kept, if any (LIFO).  As torch_npu's BlockPool
 * free_physical_handles_: a pool maps only the pages it unmapped itself. */
static uint64_t take_cached_page(device_cache *dc, const block_pool *pool, size_t size)
{
    for (size_t i = dc->cached_page_count; i-- > 0;) {
        if (dc->cached_pages[i].size == size && dc->cached_pages[i].pool == pool) {
            uint64_t h = dc->cached_pages[i].handle;
            dc->cached_pages[i] = dc->cached_pages[--dc->cached_page_count];
            return h;
        }
    }
    return 0;
}

static void keep_cached_page(device_cache *dc, const block_pool *pool, uint64_t handle, size_t size)
{
    if (!ARRAY_RESERVE(dc->cached_pages, dc->cached_page_capacity, dc->cached_page_count + 1, 16)) {
        dc->backend->free_page(dc->backend_ctx, dc->device, handle); /* out of host memory: not kept */
        return;
    }
    dc->cached_pages[dc->cached_page_count++] = (cached_page){handle, size, pool};
}

/* `*kept_used` is incremented when the page mapped is a kept one. */
static aclError map_one_page(device_cache *dc, expandable_segment *es, size_t index, size_t *kept_used)
{
    uintptr_t va = es->base + index * es->page_size;
    uint64_t handle = take_cached_page(dc, es->pool, es->page_size);
    if (handle) {
        if (dc->backend->remap_page(dc->backend_ctx, dc->device, va, es->page_size, handle) == ACL_SUCCESS) {
            es->handles[index] = handle;
            (*kept_used)++;
            return ACL_SUCCESS;
        }
        dc->backend->free_page(dc->backend_ctx, dc->device, handle);
    }
    bool huge1g = es->page_size == K_EXTRA_LARGE_BUFFER && !es->pool->is_small;
    aclError rc = dc->backend->map_page(dc->backend_ctx, dc->device, va, es->page_size, huge1g, &handle);
    if (rc == ACL_ERROR_RT_MEMORY_ALLOCATION && huge1g) {
        cache_warn_1g_fallback();
        rc = dc->backend->map_page(dc->backend_ctx, dc->device, va, es->page_size, false, &handle);
    }
    if (rc == ACL_SUCCESS)
        es->handles[index] = handle;
    return rc;
}

/* The most pages one segment maps at once: 2^20 (an 8 MiB page table), i.e. 2 TiB of 2 MiB pages,
 * 20 TiB of 20 MiB pages, 1 PiB of 1 GiB pages.  Beyond that (only a simulated device is that
 * big) the mapping fails as out of memory instead of the host allocating gigabytes of page table
 * and mapping millions of pages one by one. */
#define MAX_SEGMENT_PAGES ((size_t)1 << 20)

/* Makes the page table hold at least `count` entries.  It grows with use, as torch's does: the
 * reserved range is sized for the whole device (for a simulated 1 EiB device too). */
static bool ensure_handles(expandable_segment *es, size_t count)
{
    if (count <= es->handle_count)
        return true;
    if (count > MAX_SEGMENT_PAGES)
        return false;
    size_t cap = es->handle_count * 2 > count ? es->handle_count * 2 : count;
    if (cap < 16)
        cap = 16;
    if (cap > es->pages)
        cap = es->pages;
    if (cap > MAX_SEGMENT_PAGES)
        cap = MAX_SEGMENT_PAGES;
    uint64_t *grown = realloc(es->handles, cap * sizeof *grown);
    if (!grown)
        return false;
    memset(grown + es->handle_count, 0, (cap - es->handle_count) * sizeof *grown);
    es->handles = grown;
    es->handle_count = cap;
    return true;
}

/* Undoes a map of the pages [first, last): `kept_used` of them (which ones does not matter: kept
 * pages of a size are alike) go back to the kept pages they were taken from, the rest are freed.
 * Keeping them again needs no host memory: taking them left room in the array. */
static void segment_unmap_undo(device_cache *dc, expandable_segment *es, size_t first, size_t last, size_t kept_used)
{
    for (size_t i = first; i < last; i++) {
        bool keep = kept_used > 0;
        dc->backend->unmap_page(dc->backend_ctx, dc->device, es->base + i * es->page_size, es->page_size,
                                es->handles[i], keep);
        if (keep) {
            keep_cached_page(dc, es->pool, es->handles[i], es->page_size);
            kept_used--;
        }
        es->handles[i] = 0;
        es->mapped_pages--;
    }
}

/* Maps the pages covering [ptr, ptr + size) (all unmapped); returns the bytes mapped (whole pages
 * from ptr) and in *kept_used how many were kept pages, or 0 with *err set when a page could not be
 * mapped: ACL_ERROR_RT_MEMORY_ALLOCATION when the device (or the host, for the page table) ran out of
 * memory, else the runtime's error (out of descriptors or mappings).  The pages mapped by this call
 * are given back as they came. */
static size_t segment_map(device_cache *dc, expandable_segment *es, uintptr_t ptr, size_t size, size_t *kept_used,
                          aclError *err)
{
    size_t first = (ptr - es->base) / es->page_size;
    size_t last = (ptr + size - es->base + es->page_size - 1) / es->page_size;
    *kept_used = 0;
    *err = ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (!ensure_handles(es, last))
        return 0;
    for (size_t i = first; i < last; i++) {
        aclError rc = map_one_page(dc, es, i, kept_used);
        if (rc != ACL_SUCCESS) {
            segment_unmap_undo(dc, es, first, i, *kept_used);
            *err = rc;
            return 0;
        }
        es->mapped_pages++;
    }
    *err = ACL_SUCCESS;
    return (last - first) * es->page_size;
}

/* Unmaps the pages lying entirely inside [ptr, ptr + size); returns the range unmapped. */
static void segment_unmap(device_cache *dc, expandable_segment *es, uintptr_t ptr, size_t size, bool keep,
                          uintptr_t *out_ptr, size_t *out_size)
{
    size_t first = (ptr - es->base + es->page_size - 1) / es->page_size;
    size_t last = (ptr + size - es->base) / es->page_size;
    *out_ptr = es->base + first * es->page_size;
    *out_size = last > first ? (last - first) * es->page_size : 0;
    for (size_t i = first; i < last; i++) {
        uintptr_t va = es->base + i * es->page_size;
        dc->backend->unmap_page(dc->backend_ctx, dc->device, va, es->page_size, es->handles[i], keep);
        if (keep)
            keep_cached_page(dc, es->pool, es->handles[i], es->page_size);
        es->handles[i] = 0;
        es->mapped_pages--;
    }
}

/* ---- blocks ---- */

static inline bool allocatable(const cache_block *b)
{
    return b && !b->allocated && b->event_count == 0 && b->use_count == 0;
}

/* Maps the front `size` bytes (rounded to pages) of an unmapped block; the block becomes mapped,
 * merges with free neighbours and goes into the pool.  Else segment_map's error (out of host memory
 * for a block struct: ACL_ERROR_RT_MEMORY_ALLOCATION). */
static aclError map_block(device_cache *dc, cache_block *b, size_t size)
{
    expandable_segment *es = b->es;
    size_t kept_used;
    aclError err;
    size_t mapped = segment_map(dc, es, b->ptr, size, &kept_used, &err);
    if (mapped == 0)
        return err;
    block_pool *pool = b->pool;
    block_pool_remove_unmapped(pool, b);
    b->mapped = true;
    if (mapped < b->size) {
        cache_block *rest = cache_block_new(dc);
        if (!rest) { /* out of host memory: give the pages back */
            size_t first = (b->ptr - es->base) / es->page_size;
            segment_unmap_undo(dc, es, first, first + mapped / es->page_size, kept_used);
            b->mapped = false;
            block_pool_insert_unmapped(pool, b);
            return ACL_ERROR_RT_MEMORY_ALLOCATION;
        }
        rest->pool = pool;
        rest->stream = b->stream;
        rest->es = es;
        rest->mapped = false;
        rest->ptr = b->ptr + mapped;
        rest->size = b->size - mapped;
        rest->prev = b;
        rest->next = b->next;
        if (b->next)
            b->next->prev = rest;
        b->next = rest;
        b->size = mapped;
        block_pool_insert_unmapped(pool, rest);
    }
    uintptr_t at = b->ptr;
    cache_try_merge(dc, b, b->prev);
    cache_try_merge(dc, b, b->next);
    cache_pool_insert(b);
    dc->total_allocated_memory += mapped;
    cache_stat_inc(dc->stats.reserved_bytes, pool_stat_kind(pool), (int64_t)mapped);
    dc->stats.num_device_alloc++;
    cache_history_record(dc, TRACE_SEGMENT_MAP, at, mapped, b->stream);
    /* As torch_npu: a mapping at the segment's start records where the segment was allocated
     * (the snapshot's segment frames, the unmap's fallback), as alloc_block does for a plain one. */
    if (!b->prev && !b->segment_ctx && dc->record_context >= NPUALLOC_RECORD_STATE) {
        b->segment_ctx = dc->current_ctx;
        npualloc_context_retain(b->segment_ctx);
    }
    return ACL_SUCCESS;
}

/* The lowest-addressed place of the stream's segment with `size` bytes of free and unmapped
 * space, or a new segment's whole range when there is none. */
static cache_block *find_expandable_block(device_cache *dc, block_pool *pool, uint64_t stream, size_t size)
{
    for (cache_block *c = block_pool_first_unmapped(pool, stream); c && c->stream == stream;
         c = block_pool_next_unmapped(c)) {
        cache_block *start = allocatable(c->prev) ? c->prev : c; /* a free block just before can grow */
        size_t bytes = 0;
        for (cache_block *b = start; bytes < size && allocatable(b); b = b->next)
            bytes += b->size;
        if (bytes >= size)
            return start;
    }
    expandable_segment *es = segment_create(dc, pool, stream);
    cache_block *whole = es ? cache_block_new(dc) : NULL;
    if (!whole) {
        if (es)
            segment_destroy(dc, es);
        return NULL;
    }
    whole->pool = pool;
    whole->stream = stream;
    whole->es = es;
    whole->mapped = false;
    whole->ptr = es->base;
    whole->size = es->pages * es->page_size;
    block_pool_insert_unmapped(pool, whole);
    return whole;
}

cache_block *expandable_allocate(device_cache *dc, block_pool *pool, uint64_t stream, size_t size, aclError *err)
{
    *err = ACL_ERROR_RT_MEMORY_ALLOCATION;
    cache_block *candidate = find_expandable_block(dc, pool, stream, size);
    if (!candidate)
        return NULL;
    /* The candidate is unmapped, or free and followed by unmapped space. */
    if (!candidate->mapped &&
        (*err = map_block(dc, candidate, candidate->size < size ? candidate->size : size)) != ACL_SUCCESS)
        return NULL;
    while (candidate->size < size) {
        /* free -> unmapped: map the missing part; the mapped pages merge into the candidate */
        cache_block *grow = candidate->next;
        size_t missing = size - candidate->size;
        if ((*err = map_block(dc, grow, grow->size < missing ? grow->size : missing)) != ACL_SUCCESS)
            return NULL;
        candidate = grow;
    }
    *err = ACL_SUCCESS;
    block_pool_remove(pool, candidate);
    return candidate;
}

/* Links `part` (a new block struct) in as [start, start + size), the free mapped part of b just
 * before or after the pages b is about to unmap, and caches it. */
static void split_off(cache_block *b, cache_block *part, uintptr_t start, size_t size, bool before)
{
    part->pool = b->pool;
    part->stream = b->stream;
    part->es = b->es;
    part->ptr = start;
    part->size = size;
    if (before) { /* prev? -> part -> b */
        part->prev = b->prev;
        part->next = b;
        if (b->prev)
            b->prev->next = part;
        b->prev = part;
    } else { /* b -> part -> next? */
        part->prev = b;
        part->next = b->next;
        if (b->next)
            b->next->prev = part;
        b->next = part;
    }
    cache_pool_insert(part);
}

void expandable_release_block(device_cache *dc, cache_block *b, bool keep_pages)
{
    expandable_segment *es = b->es;
    uintptr_t up;
    size_t us;
    /* Which whole pages lie inside the block? (computed before touching anything) */
    size_t first = (b->ptr - es->base + es->page_size - 1) / es->page_size;
    size_t last = (b->ptr + b->size - es->base) / es->page_size;
    if (last <= first)
        return;
    up = es->base + first * es->page_size;
    us = (last - first) * es->page_size;
    size_t before = up - b->ptr, after = b->size - before - us;
    /* The structs of both parts first: out of host memory, the block stays mapped, untouched. */
    cache_block *front = before ? cache_block_new(dc) : NULL;
    cache_block *back = after ? cache_block_new(dc) : NULL;
    if ((before && !front) || (after && !back)) {
        if (front)
            cache_block_delete(dc, front);
        if (back)
            cache_block_delete(dc, back);
        return;
    }
    if (front)
        split_off(b, front, b->ptr, before, true);
    if (back)
        split_off(b, back, up + us, after, false);
    block_pool_remove(b->pool, b);
    segment_unmap(dc, es, up, us, keep_pages, &up, &us);
    b->ptr = up;
    b->size = us;
    b->mapped = false;
    cache_try_merge(dc, b, b->prev);
    cache_try_merge(dc, b, b->next);
    block_pool_insert_unmapped(b->pool, b);
    dc->total_allocated_memory -= us;
    cache_stat_dec(dc->stats.reserved_bytes, pool_stat_kind(b->pool), (int64_t)us);
    dc->stats.num_device_free++;
    cache_history_record_ctx(dc, TRACE_SEGMENT_UNMAP, up, us, b->stream, b->segment_ctx);
    if (!b->prev && !b->next) { /* nothing of the segment is mapped any more */
        block_pool_remove_unmapped(b->pool, b);
        cache_block_delete(dc, b);
        segment_destroy(dc, es);
    }
}

void expandable_release_unmapped_segments(device_cache *dc, block_pool *pool)
{
    /* Such a segment is one unmapped block with no neighbours: its first mapping failed, and
     * nothing else would ever give its range back (a stream gone, a released private pool). */
    avl_node *n = avl_first(&pool->unmapped);
    while (n) {
        cache_block *b = AVL_ENTRY(n, cache_block, pool_node);
        n = avl_next(n);
        if (b->prev || b->next)
            continue;
        expandable_segment *es = b->es;
        block_pool_remove_unmapped(pool, b);
        cache_block_delete(dc, b);
        segment_destroy(dc, es);
    }
}

void expandable_free_cached_pages(device_cache *dc, const block_pool *pool)
{
    size_t kept = 0;
    for (size_t i = 0; i < dc->cached_page_count; i++) {
        cached_page page = dc->cached_pages[i];
        if (pool && page.pool != pool)
            dc->cached_pages[kept++] = page;
        else
            dc->backend->free_page(dc->backend_ctx, dc->device, page.handle);
    }
    dc->cached_page_count = kept;
}

void expandable_release_all(device_cache *dc, bool return_memory)
{
    while (dc->expandable_segments) {
        expandable_segment *es = dc->expandable_segments;
        dc->expandable_segments = es->next;
        if (return_memory) {
            for (size_t i = 0; i < es->handle_count; i++)
                if (es->handles[i])
                    dc->backend->unmap_page(dc->backend_ctx, dc->device, es->base + i * es->page_size,
                                            es->page_size, es->handles[i], false);
            dc->backend->release(dc->backend_ctx, dc->device, es->base, es->pages * es->page_size);
        }
        free(es->handles);
        free(es);
    }
    if (return_memory)
        expandable_free_cached_pages(dc, NULL);
    free(dc->cached_pages);
    dc->cached_pages = NULL;
    dc->cached_page_count = dc->cached_page_capacity = 0;
}
