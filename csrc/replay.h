/*
 * replay.h - internals of a trace-replay session (the API is in include/npualloc_replay.h).
 *
 * A session is a device_cache (caching.c's per-device algorithm, instantiated on its own) whose
 * backend is a simulated device: capacity accounting and addresses from three disjoint
 * regions that are never touched (ordinary segments, segments from the 1 GiB page pool, and the
 * reservations of expandable segments).  The recorded run's addresses map to the session's
 * pointers in `live`.
 *
 * Locking: the cache's own mutex guards the whole session; feed and the getters take it.
 */
#ifndef NPUALLOC_REPLAY_H
#define NPUALLOC_REPLAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "alloc_conf.h"
#include "caching.h"
#include "npualloc_replay.h"
#include "ptr_map.h"

/* Address regions of the simulated device (bump allocated; address space is never reused, and a
 * region used up is out of memory). */
#define SIM_PAGED_BASE ((uintptr_t)1 << 44)
#define SIM_HUGE1G_BASE ((uintptr_t)1 << 61)
#define SIM_RESERVE_BASE ((uintptr_t)1 << 62)

typedef struct sim_device {
    uint64_t capacity;        /* bytes in all */
    uint64_t huge1g_capacity; /* of which the 1 GiB page pool */
    uint64_t used_paged, used_huge1g;
    uintptr_t next_paged, next_huge1g, next_reserve;
    /* Address ranges of destroyed expandable segments, reused by the next reservations: a huge
     * simulated device's segment reserves 1 1/8 of it, and the reserve region (2^62 .. 2^64) holds
     * only a few such ranges. */
    struct sim_range { uintptr_t base; size_t size; } *released;
    size_t released_count, released_capacity;
    uint64_t page_serial;     /* handles of expandable pages */
    uint64_t huge1g_fallbacks;
} sim_device;

/* Timeline: buckets of `stride` events holding the largest values seen; when the buffer is full
 * neighbouring buckets merge and the stride doubles, so any run fits in `cap` samples. */
typedef struct replay_timeline {
    npualloc_replay_point *points;
    size_t count, cap;
    uint64_t stride;
    npualloc_replay_point cur; /* the bucket being filled */
    uint64_t cur_events;       /* events in it */
} replay_timeline;

struct npualloc_replay {
    device_cache dc; /* its lock guards the session */
    alloc_settings settings;
    sim_device sim;
    ptr_map live; /* recorded address -> session pointer (REPLAY_SKIPPED: skipped after OOM) */
    /* recorded address -> session block of a FREE_REQUESTED whose FREE_COMPLETED is still ahead:
     * the block waits on the device's pinned list (a pin in place of its stream events) */
    ptr_map pending;
    npualloc_replay_result res;
    bool stop_on_oom, halted;
    replay_timeline timeline;
    npualloc_replay_oom *ooms;
    size_t oom_cap;
    int warning_count;
    char warnings[ALLOC_CONF_MAX_WARNINGS][ALLOC_CONF_MSG_LEN];
    char device_error[ALLOC_CONF_MSG_LEN]; /* NPUALLOC_REPLAY_DEVICE_ERROR's message */
};

#define REPLAY_SKIPPED ((void *)(uintptr_t)1)

extern const cache_backend replay_sim_backend;

#endif
