/* fuzz_replay.c - the trace-replay engine (npualloc_replay.h) on arbitrary configurations and
 * event streams: what the snapshot loader (npualloc/replay.py) feeds it, and worse.
 *
 * Input: a configuration (settings text from a table or raw bytes, device memory from 1 byte
 * to 1 EiB, a 1 GiB page pool, pad, fraction, stop_on_oom, timeline points, OOM records,
 * history), then events in chunks: each event is an action byte (any value: the engine reads
 * anything but ALLOC as a free), an address (one of 32 recurring ones, 0, or 8 raw bytes),
 * a size (0 to 2^64-1) and a stream.
 *
 * Properties (any failure aborts): create either succeeds or returns a documented status with
 * a terminated message; feed returns OK or STOPPED (once stopped, always STOPPED); after every
 * chunk npualloc_replay_check passes; the result is consistent (events counted, allocated <=
 * reserved <= device memory, peaks >= finals, fragmentation in [0, 1]); the timeline is in
 * event order with allocated <= reserved; OOM records and warnings are terminated strings;
 * the snapshot tiles its segments and holds live_allocations allocated blocks and
 * final_reserved bytes. */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_common.h"
#include "npualloc_replay.h"

#define RP_MAX_EVENTS 8192
#define RP_MiB ((uint64_t)1 << 20)
#define RP_GiB ((uint64_t)1 << 30)

static const char *const replay_confs[] = {
    "",
    "expandable_segments:True",
    "max_split_size_mb:64",
    "max_split_size_mb:21,garbage_collection_threshold:0.5",
    "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
    "page_size:1g",
    "page_size:1g,expandable_segments:True",
    "large_segment_size_mb:64,base_addr_aligned_kb:0",
    "per_process_memory_fraction:0.3",
    "max_split_size_mb:10", /* malformed: below the minimum */
};

static uint64_t rp_device_memory(fuzz_in *in)
{
    uint8_t b = fuzz_u8(in);
    switch (b % 8) {
    case 0:
        return 0; /* BAD_CONFIG */
    case 1:
        return 1 + fuzz_u8(in);
    case 2: /* at or above the 1 EiB limit (exactly 1 EiB once made expandable segments OOM) */
        return ((uint64_t)1 << 60) + (b >> 3);
    case 3:
        return (uint64_t)(1 + (b >> 3)) * RP_GiB;
    default:
        return (uint64_t)(1 + fuzz_u8(in)) * 4 * RP_MiB;
    }
}

static uint64_t rp_size(fuzz_in *in)
{
    uint8_t c = fuzz_u8(in);
    uint32_t r = fuzz_u32(in);
    switch (c % 8) {
    case 0:
        return c >> 7; /* 0 or 1 */
    case 1:
        return 1 + r % 4096;
    case 2:
        return 1 + r % RP_MiB;
    case 3:
        return 1 + r % (32 * RP_MiB);
    case 4:
        return 1 + (uint64_t)r * 1024;
    case 5:
        return (uint64_t)r << 20;
    case 6:
        return fuzz_u64(in);
    default: {
        static const uint64_t special[] = {((uint64_t)1 << 60) - 1, (uint64_t)1 << 60, UINT64_MAX, UINT64_MAX - 511,
                                           RP_GiB, RP_GiB - 32, 20 * RP_MiB - 32, 2 * RP_MiB, 512, 481};
        return special[r % (sizeof special / sizeof special[0])];
    }
    }
}

static uint64_t rp_addr(fuzz_in *in)
{
    uint8_t b = fuzz_u8(in);
    if (b == 0xff)
        return fuzz_u64(in);
    if (b % 33 == 0)
        return 0; /* ignored event */
    return 0x7f0000000000ull + (uint64_t)(b % 33) * 0x200000;
}

static uint64_t rp_stream(fuzz_in *in)
{
    uint8_t b = fuzz_u8(in);
    if (b >= 0xf0)
        return UINT64_MAX - (b & 0xf);
    return b % 3;
}

static void rp_check(npualloc_replay *r, const char *when)
{
    char why[512] = "";
    aclError rc = npualloc_replay_check(r, why, sizeof why);
    FUZZ_CHECK(rc == ACL_SUCCESS, "replay allocator invariant after %s: %s", when, why);
}

static void rp_check_result(npualloc_replay *r, const npualloc_replay_config *cfg, uint64_t fed, bool stopped)
{
    npualloc_replay_result res;
    npualloc_replay_get_result(r, &res);
    FUZZ_CHECK(stopped ? res.events <= fed : res.events == fed, "%llu events counted, %llu fed",
               (unsigned long long)res.events, (unsigned long long)fed);
    FUZZ_CHECK(res.stopped == (stopped && cfg->stop_on_oom && res.ooms > 0) || !stopped,
               "stopped flag %d with %llu OOMs", res.stopped, (unsigned long long)res.ooms);
    FUZZ_CHECK(res.final_allocated <= res.final_reserved, "final allocated %llu > reserved %llu",
               (unsigned long long)res.final_allocated, (unsigned long long)res.final_reserved);
    FUZZ_CHECK(res.peak_allocated <= res.peak_reserved && res.peak_allocated >= res.final_allocated &&
                   res.peak_reserved >= res.final_reserved && res.peak_active >= res.peak_allocated,
               "peaks: allocated %llu active %llu reserved %llu", (unsigned long long)res.peak_allocated,
               (unsigned long long)res.peak_active, (unsigned long long)res.peak_reserved);
    FUZZ_CHECK(res.peak_reserved <= cfg->device_memory, "reserved %llu of a %llu-byte device",
               (unsigned long long)res.peak_reserved, (unsigned long long)cfg->device_memory);
    FUZZ_CHECK(res.fragmentation >= 0.0 && res.fragmentation <= 1.0, "fragmentation %g", res.fragmentation);
    FUZZ_CHECK(res.allocs >= res.live_allocations, "allocs %llu < live %llu", (unsigned long long)res.allocs,
               (unsigned long long)res.live_allocations);
    /* Not with expandable segments: one mapping may be unmapped in parts, and torch counts every
     * unmap as a device free (25 MiB mapped at once, then released a page at a time: 1 alloc, 2 frees). */
    FUZZ_CHECK(res.expandable || res.device_allocs >= res.device_frees, "device frees %llu > allocs %llu",
               (unsigned long long)res.device_frees, (unsigned long long)res.device_allocs);

    /* the timeline */
    size_t n = npualloc_replay_timeline(r, NULL, 0);
    npualloc_replay_point *pts = calloc(n ? n : 1, sizeof *pts);
    FUZZ_CHECK(pts != NULL, "out of memory");
    FUZZ_CHECK(npualloc_replay_timeline(r, pts, n) == n, "timeline size changed");
    if (cfg->timeline_points == 0)
        FUZZ_CHECK(n == 0 || n == 1, "%zu timeline points without a timeline", n);
    for (size_t i = 0; i < n; i++) {
        FUZZ_CHECK(pts[i].allocated <= pts[i].reserved, "timeline point %zu: allocated > reserved", i);
        FUZZ_CHECK(i == 0 || pts[i].event > pts[i - 1].event, "timeline not in event order at %zu", i);
        FUZZ_CHECK(pts[i].event < (res.events ? res.events : 1), "timeline point %zu past the last event", i);
    }
    free(pts);

    /* OOM records and warnings */
    for (size_t i = 0; i < 4 + (size_t)cfg->max_oom_records; i++) {
        npualloc_replay_oom o;
        bool have = npualloc_replay_get_oom(r, i, &o);
        FUZZ_CHECK(have == (i < res.ooms && i < cfg->max_oom_records), "OOM record %zu present: %d", i, have);
        if (have) {
            FUZZ_CHECK(fuzz_terminated(o.message, sizeof o.message), "OOM message %zu not terminated", i);
            FUZZ_CHECK(o.event < res.events, "OOM record %zu at event %llu of %llu", i, (unsigned long long)o.event,
                       (unsigned long long)res.events);
        }
    }
    for (size_t i = 0; i < 16; i++) {
        const char *w = npualloc_replay_warning(r, i);
        if (w)
            FUZZ_CHECK(fuzz_terminated(w, 512), "warning %zu not terminated", i);
    }

    /* the snapshot */
    npualloc_snapshot *snap = NULL;
    npualloc_replay_status st = npualloc_replay_snapshot(r, &snap);
    FUZZ_CHECK(st == NPUALLOC_REPLAY_OK && snap, "replay snapshot: %s", npualloc_replay_status_name(st));
    uint64_t total = 0, allocated_blocks = 0;
    for (size_t s = 0; s < snap->segment_count; s++) {
        const npualloc_segment_info *seg = &snap->segments[s];
        FUZZ_CHECK(seg->first_block + seg->block_count <= snap->block_count, "segment %zu blocks out of range", s);
        uint64_t at = seg->address;
        for (size_t k = 0; k < seg->block_count; k++) {
            const npualloc_block_info *b = &snap->blocks[seg->first_block + k];
            FUZZ_CHECK(b->address == at, "segment %zu: blocks do not tile it", s);
            at += b->size;
            allocated_blocks += b->state == NPUALLOC_BLOCK_ACTIVE_ALLOCATED;
        }
        total += seg->total_size;
    }
    if (cfg->record_history)
        FUZZ_CHECK(snap->trace_count <= cfg->record_history, "%zu trace entries, at most %zu kept",
                   snap->trace_count, cfg->record_history);
    /* expandable segments list their unmapped tail as blocks: compare reserved bytes without them */
    if (!res.expandable)
        FUZZ_CHECK(total == res.final_reserved, "snapshot holds %llu bytes, %llu reserved",
                   (unsigned long long)total, (unsigned long long)res.final_reserved);
    FUZZ_CHECK(allocated_blocks == res.live_allocations, "snapshot: %llu allocated blocks, %llu live",
               (unsigned long long)allocated_blocks, (unsigned long long)res.live_allocations);
    npualloc_snapshot_free(snap);

    npualloc_stats stats;
    npualloc_replay_get_stats(r, &stats);
    FUZZ_CHECK((uint64_t)stats.reserved_bytes[NPUALLOC_STAT_ALL].current == res.final_reserved, "stats differ");
}

int fuzz_replay_one(const uint8_t *data, size_t size)
{
    fuzz_in in = {data, size, 0};
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    char settings[96];
    uint8_t which = fuzz_u8(&in);
    if (which == 0xff) {
        size_t n = fuzz_u8(&in) % sizeof settings;
        for (size_t k = 0; k < n; k++)
            settings[k] = (char)fuzz_u8(&in);
        settings[n] = '\0';
        if (n)
            settings[n - 1] = '\0';
        cfg.settings = settings;
    } else if (which == 0xfe) {
        cfg.settings = NULL;
    } else {
        cfg.settings = replay_confs[which % (sizeof replay_confs / sizeof replay_confs[0])];
    }
    cfg.device_memory = rp_device_memory(&in);
    uint8_t flags = fuzz_u8(&in);
    cfg.huge1g_memory = (flags & 3) == 0 ? 0 : (flags & 3) == 1 ? RP_GiB : (flags & 3) == 2 ? cfg.device_memory / 2 : 3 * RP_GiB;
    cfg.pad = (flags & 0x0c) == 0 ? 32 : (flags & 0x0c) == 4 ? 0 : (flags & 0x0c) == 8 ? 511 : fuzz_u16(&in);
    uint8_t fb = fuzz_u8(&in);
    cfg.fraction = fb < 200 ? fb / 199.0 : fb == 200 ? -0.5 : fb == 201 ? NAN : fb == 202 ? 1.0000001 : 0.0;
    cfg.stop_on_oom = flags & 0x10;
    cfg.timeline_points = (flags & 0x20) ? fuzz_u8(&in) : 0;
    cfg.max_oom_records = (flags & 0x40) ? fuzz_u8(&in) % 8 : 0;
    cfg.record_history = (flags & 0x80) ? fuzz_u8(&in) : 0;

    if (fuzz_tracing()) /* the configuration, then every event */
        fprintf(stderr, "  config: settings \"%s\", device %llu, huge1g %llu, pad %llu, fraction %g, stop %d\n",
                cfg.settings ? cfg.settings : "(null)", (unsigned long long)cfg.device_memory,
                (unsigned long long)cfg.huge1g_memory, (unsigned long long)cfg.pad, cfg.fraction,
                (int)cfg.stop_on_oom);
    npualloc_replay *r = NULL;
    char err[256];
    memset(err, 'x', sizeof err);
    npualloc_replay_status st = npualloc_replay_create(&cfg, &r, err, sizeof err);
    FUZZ_CHECK(fuzz_terminated(err, sizeof err), "create: message not terminated");
    if (st != NPUALLOC_REPLAY_OK) {
        FUZZ_CHECK(r == NULL, "a failed create left a session");
        FUZZ_CHECK(st == NPUALLOC_REPLAY_BAD_SETTINGS || st == NPUALLOC_REPLAY_BAD_CONFIG ||
                       st == NPUALLOC_REPLAY_UNAVAILABLE,
                   "create: %s", npualloc_replay_status_name(st));
        FUZZ_CHECK(err[0] != '\0', "create failed without a message");
        return 0;
    }
    FUZZ_CHECK(r != NULL, "create succeeded without a session");

    static uint8_t action[RP_MAX_EVENTS];
    static uint64_t addr[RP_MAX_EVENTS], sz[RP_MAX_EVENTS], stream[RP_MAX_EVENTS];
    uint64_t fed = 0;
    bool stopped = false;

    /* A sane configuration serves 1000 bytes on a fresh device of 1 GiB or more (with at least
     * 512 MiB outside the 1 GiB page pool). */
    if (which != 0xff && cfg.device_memory >= RP_GiB && cfg.huge1g_memory + RP_GiB / 2 <= cfg.device_memory) {
        uint8_t pa[2] = {NPUALLOC_REPLAY_ALLOC, NPUALLOC_REPLAY_FREE};
        uint64_t paddr[2] = {1, 1}, psize[2] = {1000, 0}, pstream[2] = {0, 0};
        npualloc_replay_events probe = {pa, paddr, psize, pstream, 2};
        st = npualloc_replay_feed(r, &probe);
        npualloc_replay_result res;
        npualloc_replay_get_result(r, &res);
        FUZZ_CHECK(st == NPUALLOC_REPLAY_OK && res.allocs == 1 && res.ooms == 0,
                   "1000 bytes on a fresh %llu-byte device (%s): %s, %llu OOMs",
                   (unsigned long long)cfg.device_memory, cfg.settings ? cfg.settings : "defaults",
                   npualloc_replay_status_name(st), (unsigned long long)res.ooms);
        fed += 2;
        rp_check(r, "the probe");
    }
    while (fuzz_more(&in) && fed < RP_MAX_EVENTS) {
        size_t chunk = 1 + fuzz_u8(&in) % 64, n = 0;
        while (n < chunk && fuzz_more(&in) && fed + n < RP_MAX_EVENTS) {
            uint8_t a = fuzz_u8(&in);
            /* alloc / free; a free requested / completed (its completion later), a recorded OOM
             * or an empty cache; or a raw value beyond those (counts as a free) */
            action[n] = a < 0xe0 ? (a & 1) : a < 0xf0 ? NPUALLOC_REPLAY_FREE_REQUESTED + a % 4 : a;
            addr[n] = rp_addr(&in);
            sz[n] = action[n] == NPUALLOC_REPLAY_ALLOC || action[n] == NPUALLOC_REPLAY_OOM || a >= 0xf0 ? rp_size(&in)
                                                                                                       : 0;
            stream[n] = rp_stream(&in);
            n++;
        }
        for (size_t k = 0; fuzz_tracing() && k < n; k++)
            fprintf(stderr, "  %s %#llx %llu stream %#llx\n",
                    action[k] == NPUALLOC_REPLAY_ALLOC            ? "alloc"
                    : action[k] == NPUALLOC_REPLAY_FREE_REQUESTED ? "free_requested"
                    : action[k] == NPUALLOC_REPLAY_FREE_COMPLETED ? "free_completed"
                    : action[k] == NPUALLOC_REPLAY_OOM            ? "oom"
                    : action[k] == NPUALLOC_REPLAY_EMPTY_CACHE    ? "empty_cache"
                                                                  : "free",
                    (unsigned long long)addr[k], (unsigned long long)sz[k], (unsigned long long)stream[k]);
        npualloc_replay_events ev = {action, addr, sz, stream, n};
        st = npualloc_replay_feed(r, &ev);
        FUZZ_CHECK(st == NPUALLOC_REPLAY_OK || st == NPUALLOC_REPLAY_STOPPED, "feed: %s",
                   npualloc_replay_status_name(st));
        if (stopped)
            FUZZ_CHECK(st == NPUALLOC_REPLAY_STOPPED, "a stopped session went on");
        if (st == NPUALLOC_REPLAY_STOPPED) {
            FUZZ_CHECK(cfg.stop_on_oom, "stopped without stop_on_oom");
            stopped = true;
        }
        fed += n;
        rp_check(r, "a chunk");
    }
    /* an empty chunk and a NULL argument */
    npualloc_replay_events none = {NULL, NULL, NULL, NULL, 0};
    st = npualloc_replay_feed(r, &none);
    FUZZ_CHECK(st == (stopped ? NPUALLOC_REPLAY_STOPPED : NPUALLOC_REPLAY_OK), "empty feed: %s",
               npualloc_replay_status_name(st));
    npualloc_replay_events bad = {NULL, NULL, NULL, NULL, 1};
    FUZZ_CHECK(npualloc_replay_feed(r, &bad) == NPUALLOC_REPLAY_INVALID, "feed of NULL arrays");
    rp_check_result(r, &cfg, fed, stopped);
    npualloc_replay_destroy(r);
    return 0;
}

#ifndef NPUALLOC_FUZZ_NO_ENTRY
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) { return fuzz_replay_one(data, size); }
FUZZ_ASAN_DEFAULT_OPTIONS
#endif
