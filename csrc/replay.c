/*
 * replay.c - trace replay through a private caching-allocator instance on a simulated device
 * (see include/npualloc_replay.h for the API and replay.h for the session's layout).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"
#include "replay.h"
#include "snapshot.h"

/* ---- the simulated device ---- */

static uint64_t sim_paged_capacity(const sim_device *s) { return s->capacity - s->huge1g_capacity; }

/* Takes `size` bytes: from the 1 GiB pool when asked and it has room, otherwise from ordinary
 * memory.  A page_size:1g segment that does not fit the pool falls back to ordinary memory here
 * rather than in caching.c, whose fallback would queue a process-wide warning; the outcome is
 * the same and the session counts it.  Returns false when the device is full. */
static bool sim_charge(sim_device *s, size_t size, bool huge1g, bool *from_pool)
{
    if (huge1g && s->huge1g_capacity - s->used_huge1g >= size) {
        s->used_huge1g += size;
        *from_pool = true;
        return true;
    }
    if (sim_paged_capacity(s) - s->used_paged < size)
        return false;
    if (huge1g)
        s->huge1g_fallbacks++;
    s->used_paged += size;
    *from_pool = false;
    return true;
}

static void sim_uncharge(sim_device *s, size_t size, bool from_pool)
{
    if (from_pool)
        s->used_huge1g -= size;
    else
        s->used_paged -= size;
}

static aclError sim_segment_alloc(void *ctx, int32_t device, size_t size, bool huge1g, void **ptr)
{
    (void)device;
    sim_device *s = ctx;
    bool pool;
    if (!sim_charge(s, size, huge1g, &pool))
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    /* Each region ends where the next begins.  Addresses are never reused, so a device whose
     * segments came and went until they reached the end of the region (about 2 EiB each) is out
     * of memory, as a used-up address space is for reservations; past the end, a segment would be
     * taken for the next region's and uncharged from the wrong count. */
    uintptr_t *next = pool ? &s->next_huge1g : &s->next_paged;
    uintptr_t end = pool ? SIM_RESERVE_BASE : SIM_HUGE1G_BASE;
    if (size > end - *next || round_up(size, pool ? GiB : 2 * MiB) > end - *next) {
        sim_uncharge(s, size, pool);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    *ptr = (void *)*next;
    *next += round_up(size, pool ? GiB : 2 * MiB);
    return ACL_SUCCESS;
}

static void sim_segment_free(void *ctx, int32_t device, void *ptr, size_t size)
{
    (void)device;
    sim_device *s = ctx;
    uintptr_t p = (uintptr_t)ptr;
    sim_uncharge(s, size, p >= SIM_HUGE1G_BASE && p < SIM_RESERVE_BASE);
}

static void sim_mem_info(void *ctx, int32_t device, size_t *free_bytes, size_t *total_bytes)
{
    (void)device;
    const sim_device *s = ctx;
    *total_bytes = s->capacity;
    *free_bytes = s->capacity - s->used_paged - s->used_huge1g;
}

static void sim_synchronize(void *ctx, int32_t device)
{
    (void)ctx;
    (void)device; /* no streams: nothing is ever in flight */
}

static bool sim_segment_valid(void *ctx, int32_t device, void *ptr, size_t size)
{
    (void)device;
    const sim_device *s = ctx;
    uintptr_t p = (uintptr_t)ptr;
    if (p >= SIM_RESERVE_BASE)
        return p + size <= s->next_reserve;
    if (p >= SIM_HUGE1G_BASE)
        return p + size <= s->next_huge1g;
    return p >= SIM_PAGED_BASE && p + size <= s->next_paged;
}

/* Reservations end below 2^64 - 1 GiB, so next_reserve never wraps around. */
#define SIM_RESERVE_END (UINTPTR_MAX - GiB + 1)

/* Expandable segments: address space costs nothing; pages are charged while they exist.  A page
 * handle encodes where its bytes came from: serial << 32 | (size / 512) << 1 | from_pool. */
static aclError sim_reserve(void *ctx, int32_t device, size_t size, uintptr_t *base)
{
    (void)device;
    sim_device *s = ctx;
    if (size > SIM_RESERVE_END - SIM_RESERVE_BASE) /* never fits; also keeps round_up from overflowing */
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    size_t want = round_up(size, GiB);
    for (size_t i = 0; i < s->released_count; i++) {
        if (s->released[i].size >= want) {
            *base = s->released[i].base;
            s->released[i] = s->released[--s->released_count];
            return ACL_SUCCESS;
        }
    }
    if (want > SIM_RESERVE_END - s->next_reserve)
        return ACL_ERROR_RT_MEMORY_ALLOCATION; /* the address space is used up: out of memory */
    *base = s->next_reserve;
    s->next_reserve += want;
    return ACL_SUCCESS;
}

static void sim_release(void *ctx, int32_t device, uintptr_t base, size_t size)
{
    (void)device;
    sim_device *s = ctx;
    if (!ARRAY_RESERVE(s->released, s->released_capacity, s->released_count + 1, 8))
        return; /* out of host memory: the range is not reused */
    s->released[s->released_count++] = (struct sim_range){base, round_up(size, GiB)};
}

static aclError sim_map_page(void *ctx, int32_t device, uintptr_t va, size_t size, bool huge1g, uint64_t *handle)
{
    (void)device;
    (void)va;
    sim_device *s = ctx;
    bool pool;
    /* the device's physical granularity (2 MiB, 1 GiB for 1 GiB pages): a page off it is refused, as the
     * runtime's pages are (caching_api.c), as aclrtMallocPhysical refuses it */
    if (size % (huge1g ? K_EXTRA_LARGE_BUFFER : K_SMALL_BUFFER) != 0)
        return ACL_ERROR_RT_PARAM_INVALID;
    if (size % K_MIN_BLOCK_SIZE != 0 || size / K_MIN_BLOCK_SIZE >= ((uint64_t)1 << 31) ||
        !sim_charge(s, size, huge1g, &pool))
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *handle = (++s->page_serial << 32) | ((uint64_t)(size / K_MIN_BLOCK_SIZE) << 1) | (pool ? 1u : 0u);
    return ACL_SUCCESS;
}

static void sim_free_page(void *ctx, int32_t device, uint64_t handle)
{
    (void)device;
    sim_uncharge(ctx, (size_t)((handle & 0xffffffffu) >> 1) * K_MIN_BLOCK_SIZE, handle & 1);
}

static void sim_unmap_page(void *ctx, int32_t device, uintptr_t va, size_t size, uint64_t handle, bool keep)
{
    (void)va;
    (void)size;
    if (!keep)
        sim_free_page(ctx, device, handle);
}

/* Puts the block of a requested free back into the cache (its recorded completion came, or the
 * device drained). */
static void complete_requested_free(npualloc_replay *r, cache_block *b) { cache_share_unpin_locked(&r->dc, b); }

/* The device drained: every free still waiting for its recorded completion completes, as torch's
 * synchronize_and_free_events completes every free waiting for its events. */
static void sim_complete_frees(void *ctx)
{
    npualloc_replay *r = (npualloc_replay *)((char *)ctx - offsetof(npualloc_replay, sim));
    for (size_t i = 0; r->pending.count && i <= r->pending.mask; i++)
        if (r->pending.slots[i].key)
            complete_requested_free(r, r->pending.slots[i].value);
    ptr_map_free(&r->pending);
}

const cache_backend replay_sim_backend = {
    .segment_alloc = sim_segment_alloc,
    .segment_free = sim_segment_free,
    .mem_info = sim_mem_info,
    .synchronize = sim_synchronize,
    .segment_valid = sim_segment_valid,
    .reserve = sim_reserve,
    .release = sim_release,
    .map_page = sim_map_page,
    /* no remap_page: a replay never keeps pages (only the runtime's empty_virt_addr_cache does) */
    .unmap_page = sim_unmap_page,
    .free_page = sim_free_page,
    .complete_frees = sim_complete_frees,
};

/* ---- timeline ---- */

static int timeline_init(replay_timeline *t, uint32_t points)
{
    memset(t, 0, sizeof *t);
    if (points == 0)
        return 0;
    /* Full buffers merge in pairs: an even capacity at or below the limit, and the bucket being filled
     * fits beside what a merge leaves.  One sample is one bucket that never fills. */
    t->cap = points < 2 ? 1 : points / 2 * 2;
    t->stride = points < 2 ? UINT64_MAX : 1;
    t->points = malloc(t->cap * sizeof *t->points);
    return t->points ? 0 : -1;
}

static void timeline_merge(replay_timeline *t)
{
    for (size_t i = 0; i < t->count / 2; i++) {
        const npualloc_replay_point *a = &t->points[2 * i], *b = &t->points[2 * i + 1];
        npualloc_replay_point m = {a->event, a->allocated > b->allocated ? a->allocated : b->allocated,
                                   a->reserved > b->reserved ? a->reserved : b->reserved};
        t->points[i] = m;
    }
    t->count /= 2;
    t->stride *= 2;
}

static inline void timeline_sample(replay_timeline *t, uint64_t event, uint64_t allocated, uint64_t reserved)
{
    if (!t->cap)
        return;
    if (t->cur_events == 0) {
        t->cur.event = event;
        t->cur.allocated = allocated;
        t->cur.reserved = reserved;
    } else {
        if (allocated > t->cur.allocated)
            t->cur.allocated = allocated;
        if (reserved > t->cur.reserved)
            t->cur.reserved = reserved;
    }
    if (++t->cur_events == t->stride) {
        t->points[t->count++] = t->cur;
        t->cur_events = 0;
        if (t->count == t->cap)
            timeline_merge(t);
    }
}

/* ---- sessions ---- */

static const char *const status_names[] = {"OK",          "BAD_SETTINGS", "BAD_CONFIG",  "UNAVAILABLE",
                                           "STOPPED",     "HOST_MEMORY",  "INVALID",     "DEVICE_ERROR"};

const char *npualloc_replay_error(const npualloc_replay *r) { return r ? r->device_error : ""; }

const char *npualloc_replay_status_name(npualloc_replay_status st)
{
    return (unsigned)st < ARRAY_LEN(status_names) ? status_names[st] : "UNKNOWN";
}

npualloc_replay_status npualloc_replay_config_default(npualloc_replay_config *cfg)
{
    if (!cfg)
        return NPUALLOC_REPLAY_INVALID;
    memset(cfg, 0, sizeof *cfg);
    cfg->device_memory = (uint64_t)80 << 30;
    cfg->pad = NPUALLOC_REPLAY_PAD_NPU;
    cfg->timeline_points = 2048;
    cfg->max_oom_records = 64;
    return NPUALLOC_REPLAY_OK;
}

static npualloc_replay_status fail(char *err, size_t errlen, npualloc_replay_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static npualloc_replay_status fail(char *err, size_t errlen, npualloc_replay_status st, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return st;
}

npualloc_replay_status npualloc_replay_create(const npualloc_replay_config *cfg, npualloc_replay **out, char *err,
                                              size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!cfg || !out)
        return fail(err, errlen, NPUALLOC_REPLAY_INVALID, "npualloc_replay_create: NULL argument");
    *out = NULL;
    if (cfg->device_memory == 0)
        return fail(err, errlen, NPUALLOC_REPLAY_BAD_CONFIG, "device memory must be more than 0 bytes");
    if (cfg->device_memory > ((uint64_t)1 << 60))
        return fail(err, errlen, NPUALLOC_REPLAY_BAD_CONFIG, "device memory must be at most 1 EiB");
    if (cfg->huge1g_memory % GiB != 0 || cfg->huge1g_memory > cfg->device_memory)
        return fail(err, errlen, NPUALLOC_REPLAY_BAD_CONFIG,
                    "the 1 GiB page pool (%llu bytes) must be a multiple of 1 GiB and at most the device memory",
                    (unsigned long long)cfg->huge1g_memory);
    if (cfg->pad >= K_MIN_BLOCK_SIZE)
        return fail(err, errlen, NPUALLOC_REPLAY_BAD_CONFIG, "pad must be below 512 bytes (32 for NPU rounding, "
                    "0 for CUDA rounding)");
    if (!(cfg->fraction == 0.0 || (cfg->fraction > 0.0 && cfg->fraction <= 1.0)))
        return fail(err, errlen, NPUALLOC_REPLAY_BAD_CONFIG, "memory fraction must be in (0, 1], got %g",
                    cfg->fraction);

    /* aligned: the device cache inside keeps its lines to itself (caching.h) */
    npualloc_replay *r = aligned_alloc(_Alignof(npualloc_replay), sizeof *r);
    if (!r)
        return fail(err, errlen, NPUALLOC_REPLAY_HOST_MEMORY, "out of host memory");
    memset(r, 0, sizeof *r);
    alloc_settings_default(&r->settings);
    conf_result cr;
    memset(&cr, 0, sizeof cr);
    if (cfg->settings && alloc_conf_parse(cfg->settings, &r->settings, NULL, NULL, &cr) != CONF_OK) {
        free(r);
        return fail(err, errlen, NPUALLOC_REPLAY_BAD_SETTINGS, "%s", cr.message);
    }
    r->warning_count = cr.warning_count;
    for (int i = 0; i < cr.warning_count && i < ALLOC_CONF_MAX_WARNINGS; i++)
        memcpy(r->warnings[i], cr.warnings[i], sizeof r->warnings[i]);

    r->sim.capacity = cfg->device_memory;
    r->sim.huge1g_capacity = cfg->huge1g_memory;
    r->sim.next_paged = SIM_PAGED_BASE;
    r->sim.next_huge1g = SIM_HUGE1G_BASE;
    r->sim.next_reserve = SIM_RESERVE_BASE;
    r->stop_on_oom = cfg->stop_on_oom;
    r->oom_cap = cfg->max_oom_records;
    if (timeline_init(&r->timeline, cfg->timeline_points) != 0 ||
        (r->oom_cap && !(r->ooms = calloc(r->oom_cap, sizeof *r->ooms)))) {
        free(r->timeline.points);
        free(r);
        return fail(err, errlen, NPUALLOC_REPLAY_HOST_MEMORY, "out of host memory");
    }
    cache_lock_init(&r->dc.lock);
    cache_lock_acquire(&r->dc.lock);
    cache_device_init(&r->dc, 0, &r->settings, &replay_sim_backend, &r->sim, cfg->pad);
    if (cfg->fraction > 0.0)
        cache_set_fraction_locked(&r->dc, cfg->fraction);
    if (cfg->record_history) {
        r->dc.history_max = cfg->record_history;
        r->dc.record_context = NPUALLOC_RECORD_NEVER;
    }
    bool expandable = r->settings.expandable_segments;
    bool supported = !expandable || expandable_supported(&r->dc);
    cache_lock_release(&r->dc.lock);
    if (!supported) {
        npualloc_replay_destroy(r);
        return fail(err, errlen, NPUALLOC_REPLAY_UNAVAILABLE,
                    "expandable_segments is not available in this build of npualloc's allocator");
    }
    r->res.expandable = expandable;
    *out = r;
    return NPUALLOC_REPLAY_OK;
}

void npualloc_replay_destroy(npualloc_replay *r)
{
    if (!r)
        return;
    cache_lock_acquire(&r->dc.lock);
    cache_device_release_all(&r->dc);
    cache_lock_release(&r->dc.lock);
    free(r->sim.released);
    ptr_map_free(&r->live);
    ptr_map_free(&r->pending);
    free(r->timeline.points);
    free(r->ooms);
    free(r);
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void record_oom(npualloc_replay *r, uint64_t event, uint64_t size, uint64_t stream,
                       const npualloc_oom_info *info)
{
    size_t i = (size_t)r->res.ooms++;
    if (i >= r->oom_cap)
        return;
    npualloc_replay_oom *o = &r->ooms[i];
    o->event = event;
    o->size = size;
    o->stream = stream;
    npualloc_format_oom(info, o->message, sizeof o->message);
}

/* Frees the session block at `ptr` (an allocated block of the session). */
static inline void replay_free_ptr(npualloc_replay *r, void *ptr)
{
    cache_block *b = ptr_map_remove(&r->dc.allocated_blocks, (uintptr_t)ptr);
    if (likely(b != NULL))
        cache_free_locked(&r->dc, b);
    r->res.frees++;
}

/* A free whose completion comes with a later FREE_COMPLETED of its address: the block at `ptr`
 * is freed (no longer allocated) but pinned, so it stays active and out of the cache meanwhile,
 * as a torch block waiting for the events of the streams that used it.  `slot` is the address's
 * entry in the pending map. */
static void replay_request_free(npualloc_replay *r, ptr_map_entry *slot, void *ptr)
{
    if (slot->value) /* requested again before the first completed: that one completes now */
        complete_requested_free(r, slot->value);
    cache_block *b = ptr_map_remove(&r->dc.allocated_blocks, (uintptr_t)ptr);
    slot->value = b;
    r->res.frees++;
    if (unlikely(b == NULL))
        return;
    b->share_pins++;
    b->event_count++; /* dropped with the pin (cache_share_unpin_locked) */
    b->pinned_next = r->dc.pinned;
    r->dc.pinned = b;
    cache_free_locked(&r->dc, b);
}

/* The recorded run's failed allocation of `rounded` bytes, tried again (see NPUALLOC_REPLAY_OOM).
 * Returns false when out of host memory. */
static bool replay_recorded_oom(npualloc_replay *r, uint64_t rounded, uint64_t stream)
{
    r->res.recorded_ooms++;
    void *ptr = NULL;
    npualloc_oom_info oom;
    size_t size = rounded > r->dc.pad ? (size_t)(rounded - r->dc.pad) : (size_t)rounded;
    aclError rc = rounded >= K_ONE_EB ? ACL_ERROR_RT_MEMORY_ALLOCATION
                                      : cache_malloc_locked(&r->dc, size, stream, &ptr, &oom);
    if (rc == ACL_ERROR_RT_MEMORY_ALLOCATION)
        r->res.recorded_ooms_reproduced++;
    if (rc != ACL_SUCCESS)
        return rc == ACL_ERROR_RT_MEMORY_ALLOCATION;
    cache_block *b = ptr_map_remove(&r->dc.allocated_blocks, (uintptr_t)ptr);
    if (likely(b != NULL))
        cache_free_locked(&r->dc, b);
    return true;
}

npualloc_replay_status npualloc_replay_feed(npualloc_replay *r, const npualloc_replay_events *ev)
{
    if (!r || !ev || (ev->count && (!ev->action || !ev->addr || !ev->size || !ev->stream)))
        return NPUALLOC_REPLAY_INVALID;
    cache_lock_acquire(&r->dc.lock);
    if (r->halted) {
        cache_lock_release(&r->dc.lock);
        return NPUALLOC_REPLAY_STOPPED;
    }
    npualloc_replay_status st = NPUALLOC_REPLAY_OK;
    device_cache *dc = &r->dc;
    double t0 = now_seconds();
    size_t i;
    for (i = 0; i < ev->count; i++) {
        uint64_t index = r->res.events;
        uintptr_t addr = (uintptr_t)ev->addr[i];
        if (unlikely(ev->action[i] == NPUALLOC_REPLAY_OOM)) {
            if (unlikely(!replay_recorded_oom(r, ev->size[i], ev->stream[i]))) {
                r->halted = true;
                st = NPUALLOC_REPLAY_HOST_MEMORY;
                break;
            }
        } else if (unlikely(ev->action[i] == NPUALLOC_REPLAY_EMPTY_CACHE)) {
            cache_empty_locked(dc, false);
        } else if (unlikely(addr == 0)) {
            r->res.ignored++;
        } else if (ev->action[i] == NPUALLOC_REPLAY_ALLOC) {
            uint64_t size = ev->size[i];
            if (unlikely(size == 0)) {
                r->res.ignored++;
                goto sample;
            }
            ptr_map_entry *slot = ptr_map_find_or_insert(&r->live, addr);
            if (unlikely(!slot)) {
                r->halted = true;
                st = NPUALLOC_REPLAY_HOST_MEMORY;
                break;
            }
            if (unlikely(slot->value != NULL)) {
                /* The recorded run handed this address out again: its free is missing. */
                r->res.duplicate_allocs++;
                if (slot->value != REPLAY_SKIPPED)
                    replay_free_ptr(r, slot->value);
                slot->value = NULL;
            }
            void *ptr = NULL;
            npualloc_oom_info oom;
            aclError rc;
            if (unlikely(size >= K_ONE_EB)) {
                memset(&oom, 0, sizeof oom);
                oom.over_1eb = true;
                oom.requested = size;
                rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
            } else {
                rc = cache_malloc_locked(dc, (size_t)size, ev->stream[i], &ptr, &oom);
            }
            if (likely(rc == ACL_SUCCESS)) {
                r->res.allocs++;
                slot->value = ptr; /* the map does not change inside the allocator: slot is still valid */
            } else if (rc == ACL_ERROR_RT_MEMORY_ALLOCATION) {
                record_oom(r, index, size, ev->stream[i], &oom);
                if (r->stop_on_oom) {
                    ptr_map_remove(&r->live, addr);
                    r->res.stopped = true;
                    r->halted = true;
                    st = NPUALLOC_REPLAY_STOPPED;
                    r->res.events++; /* the failing allocation was replayed */
                    timeline_sample(&r->timeline, index, (uint64_t)cache_stat_all(dc->stats.allocated_bytes).current,
                                    (uint64_t)cache_stat_all(dc->stats.reserved_bytes).current);
                    break;
                }
                slot->value = REPLAY_SKIPPED;
            } else {
                ptr_map_remove(&r->live, addr);
                r->halted = true;
                if (rc == ACL_ERROR_BAD_ALLOC) {
                    st = NPUALLOC_REPLAY_HOST_MEMORY;
                } else { /* the device refused it (a page off its granularity, say): the setting cannot run */
                    const char *why = npualloc_last_error(NULL);
                    snprintf(r->device_error, sizeof r->device_error, "%s", why && *why ? why : "device error");
                    st = NPUALLOC_REPLAY_DEVICE_ERROR;
                }
                break;
            }
        } else if (ev->action[i] == NPUALLOC_REPLAY_FREE_COMPLETED) {
            cache_block *b = ptr_map_remove(&r->pending, addr);
            if (b)
                complete_requested_free(r, b);
        } else {
            ptr_map_entry *pending = NULL; /* a FREE_REQUESTED's entry (before anything changes) */
            if (ev->action[i] == NPUALLOC_REPLAY_FREE_REQUESTED && !(pending = ptr_map_find_or_insert(&r->pending, addr))) {
                r->halted = true;
                st = NPUALLOC_REPLAY_HOST_MEMORY;
                break;
            }
            void *ptr = ptr_map_remove(&r->live, addr);
            if (unlikely(ptr == NULL))
                r->res.unknown_frees++;
            else if (unlikely(ptr == REPLAY_SKIPPED))
                r->res.skipped_frees++;
            else if (pending)
                replay_request_free(r, pending, ptr);
            else
                replay_free_ptr(r, ptr);
            if (pending && !pending->value) /* nothing waits for a completion */
                ptr_map_remove(&r->pending, addr);
        }
    sample:
        r->res.events++;
        timeline_sample(&r->timeline, index, (uint64_t)cache_stat_all(dc->stats.allocated_bytes).current,
                        (uint64_t)cache_stat_all(dc->stats.reserved_bytes).current);
    }
    r->res.wall_seconds += now_seconds() - t0;
    cache_lock_release(&r->dc.lock);
    return st;
}

npualloc_replay_status npualloc_replay_get_result(npualloc_replay *r, npualloc_replay_result *out)
{
    if (!r || !out)
        return NPUALLOC_REPLAY_INVALID;
    cache_lock_acquire(&r->dc.lock);
    npualloc_stats all;
    cache_stats_read(&r->dc.stats, &all);
    const npualloc_stats *s = &all;
    *out = r->res;
    out->peak_requested = (uint64_t)s->requested_bytes[NPUALLOC_STAT_ALL].peak;
    out->peak_allocated = (uint64_t)s->allocated_bytes[NPUALLOC_STAT_ALL].peak;
    out->peak_active = (uint64_t)s->active_bytes[NPUALLOC_STAT_ALL].peak;
    out->peak_reserved = (uint64_t)s->reserved_bytes[NPUALLOC_STAT_ALL].peak;
    out->final_allocated = (uint64_t)s->allocated_bytes[NPUALLOC_STAT_ALL].current;
    out->final_reserved = (uint64_t)s->reserved_bytes[NPUALLOC_STAT_ALL].current;
    out->segments = (uint64_t)s->segment[NPUALLOC_STAT_ALL].current;
    out->live_allocations = (uint64_t)s->allocation[NPUALLOC_STAT_ALL].current;
    out->fragmentation =
        out->peak_reserved ? 1.0 - (double)out->peak_active / (double)out->peak_reserved : 0.0;
    out->device_allocs = (uint64_t)s->num_device_alloc;
    out->device_frees = (uint64_t)s->num_device_free;
    out->retries = (uint64_t)s->num_alloc_retries;
    out->huge1g_fallbacks = r->sim.huge1g_fallbacks;
    out->events_per_second = out->wall_seconds > 0.0 ? (double)out->events / out->wall_seconds : 0.0;
    cache_lock_release(&r->dc.lock);
    return NPUALLOC_REPLAY_OK;
}

npualloc_replay_status npualloc_replay_get_stats(npualloc_replay *r, npualloc_stats *out)
{
    if (!r || !out)
        return NPUALLOC_REPLAY_INVALID;
    cache_lock_acquire(&r->dc.lock);
    cache_stats_read(&r->dc.stats, out);
    cache_lock_release(&r->dc.lock);
    return NPUALLOC_REPLAY_OK;
}

size_t npualloc_replay_timeline(npualloc_replay *r, npualloc_replay_point *out, size_t cap)
{
    if (!r)
        return 0;
    if (!out) /* a count only */
        cap = 0;
    cache_lock_acquire(&r->dc.lock);
    const replay_timeline *t = &r->timeline;
    size_t n = t->count + (t->cur_events ? 1 : 0);
    for (size_t i = 0; i < n && i < cap; i++)
        out[i] = i < t->count ? t->points[i] : t->cur;
    cache_lock_release(&r->dc.lock);
    return n;
}

bool npualloc_replay_get_oom(npualloc_replay *r, size_t i, npualloc_replay_oom *out)
{
    if (!r || !out)
        return false;
    cache_lock_acquire(&r->dc.lock);
    bool ok = i < r->res.ooms && i < r->oom_cap;
    if (ok)
        *out = r->ooms[i];
    cache_lock_release(&r->dc.lock);
    return ok;
}

const char *npualloc_replay_warning(npualloc_replay *r, size_t i)
{
    return r && i < (size_t)r->warning_count ? r->warnings[i] : NULL;
}

npualloc_replay_status npualloc_replay_get_settings(npualloc_replay *r, npualloc_allocator_settings *out)
{
    if (!r || !out)
        return NPUALLOC_REPLAY_INVALID;
    /* Fixed at creation: no lock needed. */
    cache_settings_export(&r->settings, out);
    return NPUALLOC_REPLAY_OK;
}

aclError npualloc_replay_check(npualloc_replay *r, char *why, size_t len)
{
    if (!r || (!why && len)) /* a message of len bytes would be written through why */
        return ACL_ERROR_INVALID_PARAM;
    cache_lock_acquire(&r->dc.lock);
    aclError rc = cache_check_locked(&r->dc, why, len);
    cache_lock_release(&r->dc.lock);
    return rc;
}

/* ---- snapshot ---- */

npualloc_replay_status npualloc_replay_snapshot(npualloc_replay *r, npualloc_snapshot **out)
{
    if (!r || !out)
        return NPUALLOC_REPLAY_INVALID;
    *out = NULL;
    npualloc_snapshot *s = calloc(1, sizeof *s);
    if (!s)
        return NPUALLOC_REPLAY_HOST_MEMORY;
    snapshot_builder sb = {.snap = s};
    cache_lock_acquire(&r->dc.lock);
    bool complete = snapshot_add_device(&sb, &r->dc);
    cache_lock_release(&r->dc.lock);
    if (!complete) {
        npualloc_snapshot_free(s);
        return NPUALLOC_REPLAY_HOST_MEMORY;
    }
    *out = s;
    return NPUALLOC_REPLAY_OK;
}
