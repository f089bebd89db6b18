/* snapshot.c - see snapshot.h. */
#include "snapshot.h"

#include <string.h>

#include "common.h"

/* A new, zeroed last item of one of the snapshot's arrays; NULL when out of host memory. */
#define APPEND(arr, count, cap)                                                                                    \
    (ARRAY_RESERVE(arr, cap, (count) + 1, 64) ? memset(&(arr)[(count)++], 0, sizeof *(arr)) : NULL)

/* Starts a snapshot segment at block b (the first of a mapped run). */
static npualloc_segment_info *begin_segment(snapshot_builder *sb, const device_cache *dc, const cache_block *b)
{
    npualloc_snapshot *s = sb->snap;
    npualloc_segment_info *seg = APPEND(s->segments, s->segment_count, sb->segment_cap);
    if (!seg)
        return NULL;
    seg->device = dc->device;
    seg->address = b->ptr;
    seg->stream = b->stream;
    seg->is_small = b->pool->is_small;
    seg->is_expandable = b->es != NULL;
    if (b->pool->owner) {
        seg->pool_id[0] = b->pool->owner->id.first;
        seg->pool_id[1] = b->pool->owner->id.second;
    }
    seg->first_block = s->block_count;
    if (!b->prev) {
        seg->frames = b->segment_ctx;
        npualloc_context_retain(seg->frames);
    }
    return seg;
}

static bool add_block(snapshot_builder *sb, npualloc_segment_info *seg, const cache_block *b)
{
    npualloc_snapshot *s = sb->snap;
    npualloc_block_info *bi = APPEND(s->blocks, s->block_count, sb->block_cap);
    if (!bi)
        return false;
    bi->address = b->ptr;
    bi->size = b->size;
    bi->requested_size = b->requested_size;
    bi->frames = b->ctx;
    npualloc_context_retain(bi->frames);
    /* torch's "active": allocated, or freed but waiting for its streams (events pending, or stream
     * uses whose events wait for the end of a capture or pool context). */
    bool active = b->allocated || b->event_count > 0 || b->use_count > 0;
    bi->state = b->allocated ? NPUALLOC_BLOCK_ACTIVE_ALLOCATED
                : active     ? NPUALLOC_BLOCK_ACTIVE_PENDING_FREE
                             : NPUALLOC_BLOCK_INACTIVE;
    seg->total_size += b->size;
    if (b->allocated)
        seg->allocated_size += b->size;
    if (active) {
        seg->active_size += b->size;
        seg->requested_size += b->requested_size;
    }
    seg->block_count++;
    return true;
}

typedef struct segment_walk {
    snapshot_builder *sb;
    const device_cache *dc;
} segment_walk;

/* cache_each_segment's callback: the mapped runs of one segment. */
static void add_segment(cache_block *head, void *ctx)
{
    segment_walk *w = ctx;
    npualloc_segment_info *seg = NULL;
    for (cache_block *b = head; b && !w->sb->failed; b = b->next) {
        if (!b->mapped) {
            seg = NULL;
            continue;
        }
        if ((!seg && !(seg = begin_segment(w->sb, w->dc, b))) || !add_block(w->sb, seg, b))
            w->sb->failed = true;
    }
}

static bool add_traces(snapshot_builder *sb, const device_cache *dc)
{
    npualloc_snapshot *s = sb->snap;
    /* The ring is oldest-first starting at history_next once it wrapped. */
    for (size_t i = 0; i < dc->history_count; i++) {
        const trace_entry *e = &dc->history[(dc->history_next + i) % dc->history_count];
        npualloc_trace_info *t = APPEND(s->traces, s->trace_count, sb->trace_cap);
        if (!t)
            return false;
        t->device = dc->device;
        t->action = (npualloc_trace_action)e->action;
        t->addr = e->addr;
        t->size = e->size;
        t->stream = e->stream;
        t->time_us = e->time_us;
        t->frames = e->ctx;
        npualloc_context_retain(t->frames);
        t->user_metadata = e->metadata;
        npualloc_context_retain(t->user_metadata);
    }
    return true;
}

bool snapshot_add_device(snapshot_builder *sb, device_cache *dc)
{
    if (sb->failed || !add_traces(sb, dc)) {
        sb->failed = true;
        return false;
    }
    segment_walk w = {sb, dc};
    if (!cache_each_segment(dc, add_segment, &w))
        sb->failed = true;
    return !sb->failed;
}

void npualloc_snapshot_free(npualloc_snapshot *snap)
{
    if (!snap)
        return;
    for (size_t i = 0; i < snap->segment_count; i++)
        npualloc_context_release(snap->segments[i].frames);
    for (size_t i = 0; i < snap->block_count; i++)
        npualloc_context_release(snap->blocks[i].frames);
    for (size_t i = 0; i < snap->trace_count; i++) {
        npualloc_context_release(snap->traces[i].frames);
        npualloc_context_release(snap->traces[i].user_metadata);
    }
    free(snap->segments);
    free(snap->blocks);
    free(snap->traces);
    free(snap);
}
