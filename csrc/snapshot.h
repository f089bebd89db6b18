/*
 * snapshot.h - builds an npualloc_snapshot (npualloc.h) from device caches: one snapshot segment
 * per segment, or per contiguous mapped range of an expandable one, every block of it, and the
 * memory history.  Shared by the live caches (npualloc_cache_snapshot) and replay sessions.
 */
#ifndef NPUALLOC_SNAPSHOT_H
#define NPUALLOC_SNAPSHOT_H

#include <stdbool.h>
#include <stddef.h>

#include "caching.h"

typedef struct snapshot_builder {
    npualloc_snapshot *snap;
    size_t segment_cap, block_cap, trace_cap; /* allocated lengths of snap's three arrays */
    bool failed;                              /* out of host memory: the snapshot is incomplete */
} snapshot_builder;

/* Appends dc's memory history and segments (lock held; contexts are retained).  Returns false
 * when out of host memory (then also sets failed, and stays false for later devices). */
bool snapshot_add_device(snapshot_builder *sb, device_cache *dc);

#endif
