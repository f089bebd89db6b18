/* test_replay.c - trace replay sessions: exact peaks on hand-written event lists, NPU and CUDA
 * rounding, OOM (stop / continue), unknown frees, chunked feeding, settings errors, the 1 GiB
 * pool, the timeline, snapshots, and sessions running in parallel without touching the runtime. */
#include <pthread.h>
#include <stdio.h>

#include "npualloc_replay.h"
#include "replay.h"
#include "testutil.h"

#define A NPUALLOC_REPLAY_ALLOC
#define F NPUALLOC_REPLAY_FREE
#define FR NPUALLOC_REPLAY_FREE_REQUESTED
#define FC NPUALLOC_REPLAY_FREE_COMPLETED
#define OOM NPUALLOC_REPLAY_OOM
#define EMPTY NPUALLOC_REPLAY_EMPTY_CACHE

typedef struct ev {
    uint8_t action;
    uint64_t addr, size, stream;
} ev;

/* Splits a list of events into the parallel arrays the API takes. */
typedef struct evs {
    uint8_t action[256];
    uint64_t addr[256], size[256], stream[256];
    npualloc_replay_events e;
} evs;

static void to_arrays(evs *out, const ev *list, size_t n)
{
    assert_true(n <= 256);
    for (size_t i = 0; i < n; i++) {
        out->action[i] = list[i].action;
        out->addr[i] = list[i].addr;
        out->size[i] = list[i].size;
        out->stream[i] = list[i].stream;
    }
    out->e = (npualloc_replay_events){out->action, out->addr, out->size, out->stream, n};
}

static npualloc_replay *session(const char *settings, uint64_t memory, size_t pad, bool stop)
{
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    cfg.settings = settings;
    cfg.device_memory = memory;
    cfg.pad = pad;
    cfg.stop_on_oom = stop;
    npualloc_replay *r = NULL;
    char err[512];
    npualloc_replay_status st = npualloc_replay_create(&cfg, &r, err, sizeof err);
    if (st != NPUALLOC_REPLAY_OK)
        fail_msg("create failed: %s %s", npualloc_replay_status_name(st), err);
    return r;
}

static void check(npualloc_replay *r)
{
    char why[512] = "";
    if (npualloc_replay_check(r, why, sizeof why) != ACL_SUCCESS)
        fail_msg("invariant broken: %s", why);
}

static npualloc_replay_result run(npualloc_replay *r, const ev *list, size_t n, npualloc_replay_status want)
{
    evs a;
    to_arrays(&a, list, n);
    assert_int_equal(npualloc_replay_feed(r, &a.e), want);
    check(r);
    npualloc_replay_result res;
    npualloc_replay_get_result(r, &res);
    return res;
}

#define N(list) (sizeof(list) / sizeof((list)[0]))

static void test_small_pool_exact_peaks(void **state)
{
    (void)state;
    static const ev list[] = {
        {A, 0x1000, 1000, 0}, {A, 0x2000, 1000, 0}, {F, 0x1000, 0, 0}, {A, 0x3000, 100, 0},
        {F, 0x2000, 0, 0},    {F, 0x3000, 0, 0},
    };
    npualloc_replay *r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    /* 1000 + 32 rounds to 1536; 100 + 32 to 512 (it reuses the first hole). */
    assert_int_equal(res.events, 6);
    assert_int_equal(res.allocs, 3);
    assert_int_equal(res.frees, 3);
    assert_int_equal(res.peak_requested, 2000);
    assert_int_equal(res.peak_allocated, 3072);
    assert_int_equal(res.peak_active, 3072);
    assert_int_equal(res.peak_reserved, 2 * MiB_);
    assert_int_equal(res.final_allocated, 0);
    assert_int_equal(res.final_reserved, 2 * MiB_); /* cached, not returned */
    assert_int_equal(res.device_allocs, 1);
    assert_int_equal(res.device_frees, 0);
    assert_int_equal(res.segments, 1);
    assert_int_equal(res.unknown_frees, 0);
    assert_true(res.fragmentation == 1.0 - 3072.0 / (double)(2 * MiB_));
    assert_true(res.wall_seconds >= 0.0);
    npualloc_replay_destroy(r);
}

static void test_large_segments_and_reuse(void **state)
{
    (void)state;
    static const ev list[] = {
        {A, 0x10000, 10 * MiB_, 0},     /* 10 MiB + 32 -> 10 MiB + 512: a 12 MiB segment */
        {A, 0x20000, 5 * MiB_, 0},      /* below 10 MiB: a 20 MiB segment */
        {F, 0x10000, 0, 0},             /* cached */
        {A, 0x30000, 10 * MiB_ - 32, 0}, /* exactly 10 MiB: takes the cached 12 MiB block, splits off 2 MiB */
        {F, 0x20000, 0, 0},
        {F, 0x30000, 0, 0},
    };
    npualloc_replay *r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.peak_reserved, 32 * MiB_);
    assert_int_equal(res.peak_allocated, 10 * MiB_ + 512 + 5 * MiB_ + 512);
    assert_int_equal(res.peak_requested, 15 * MiB_);
    assert_int_equal(res.device_allocs, 2);
    assert_int_equal(res.retries, 0);
    npualloc_stats s;
    npualloc_replay_get_stats(r, &s);
    assert_int_equal(s.segment[NPUALLOC_STAT_LARGE_POOL].peak, 2);
    assert_int_equal(s.allocation[NPUALLOC_STAT_ALL].allocated, 3);
    npualloc_replay_destroy(r);
}

static void test_cuda_and_npu_rounding_differ(void **state)
{
    (void)state;
    /* 1 MiB: with the NPU pad it is 1 MiB + 512, a large request (a 20 MiB segment); without
     * it, a small request in a 2 MiB segment.  512 bytes: 1024 on an NPU, 512 for CUDA. */
    static const ev list[] = {{A, 0x1000, MiB_, 0}, {A, 0x2000, 512, 0}, {F, 0x1000, 0, 0}, {F, 0x2000, 0, 0}};
    npualloc_replay *npu = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay *cuda = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_CUDA, false);
    npualloc_replay_result rn = run(npu, list, N(list), NPUALLOC_REPLAY_OK);
    npualloc_replay_result rc = run(cuda, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(rn.peak_reserved, 20 * MiB_ + 2 * MiB_);
    assert_int_equal(rn.peak_allocated, MiB_ + 512 + 1024);
    assert_int_equal(rn.device_allocs, 2);
    assert_int_equal(rc.peak_reserved, 2 * MiB_);
    assert_int_equal(rc.peak_allocated, MiB_ + 512);
    assert_int_equal(rc.device_allocs, 1);
    assert_int_equal(rn.peak_requested, rc.peak_requested);
    npualloc_replay_destroy(npu);
    npualloc_replay_destroy(cuda);
}

static void test_oom_continue_skips_the_allocation_and_its_free(void **state)
{
    (void)state;
    static const ev list[] = {
        {A, 0x1000, 60 * MiB_, 0}, /* a 62 MiB segment */
        {A, 0x2000, 60 * MiB_, 0}, /* 62 more do not fit in 100 MiB: OOM, skipped */
        {F, 0x2000, 0, 0},         /* ignored */
        {F, 0x1000, 0, 0},
        {A, 0x3000, 60 * MiB_, 0}, /* the cached block */
        {F, 0x3000, 0, 0},
    };
    npualloc_replay *r = session(NULL, 100 * MiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.events, 6);
    assert_int_equal(res.ooms, 1);
    assert_false(res.stopped);
    assert_int_equal(res.allocs, 2);
    assert_int_equal(res.frees, 2);
    assert_int_equal(res.skipped_frees, 1);
    assert_int_equal(res.unknown_frees, 0);
    assert_int_equal(res.retries, 1);          /* the last resort: release the cache, retry once */
    assert_int_equal(res.device_allocs, 1);
    assert_int_equal(res.peak_reserved, 62 * MiB_);
    npualloc_replay_oom o;
    assert_true(npualloc_replay_get_oom(r, 0, &o));
    assert_false(npualloc_replay_get_oom(r, 1, &o));
    assert_int_equal(o.event, 1);
    assert_int_equal(o.size, 60 * MiB_);
    assert_string_equal(o.message,
                        "NPU out of memory. Tried to allocate 62.00 MiB (NPU 0; 100.00 MiB total capacity; 60.00 MiB "
                        "already allocated; 60.00 MiB current active; 38.00 MiB free; 62.00 MiB reserved in total by "
                        "PyTorch).If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
                        "fragmentation.");
    npualloc_replay_destroy(r);
}

static void test_oom_stop_ends_the_run(void **state)
{
    (void)state;
    static const ev list[] = {
        {A, 0x1000, 60 * MiB_, 0}, {A, 0x2000, 60 * MiB_, 0}, {F, 0x2000, 0, 0}, {F, 0x1000, 0, 0},
    };
    npualloc_replay *r = session(NULL, 100 * MiB_, NPUALLOC_REPLAY_PAD_NPU, true);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_STOPPED);
    assert_true(res.stopped);
    assert_int_equal(res.events, 2);
    assert_int_equal(res.ooms, 1);
    assert_int_equal(res.allocs, 1);
    assert_int_equal(res.frees, 0);
    assert_int_equal(res.final_allocated, 60 * MiB_ + 512);
    /* Later chunks replay nothing. */
    res = run(r, list + 2, 2, NPUALLOC_REPLAY_STOPPED);
    assert_int_equal(res.events, 2);
    npualloc_replay_destroy(r);
}

/* A setting whose allocations the device refuses for another reason than memory (expandable pages of 11 MiB,
 * off the 2 MiB granularity) stops the session with the allocator's message (it was reported as the host out
 * of memory, and the lab's replay raised MemoryError). */
static void test_a_device_refusal_stops_the_run_with_its_message(void **state)
{
    (void)state;
    static const ev list[] = {{A, 0x1000, 1000, 0}, {A, 0x2000, 30 * MiB_, 0}, {F, 0x1000, 0, 0}};
    npualloc_replay *r = session("expandable_segments:True,large_segment_size_mb:11", GiB_, NPUALLOC_REPLAY_PAD_NPU,
                                 false);
    assert_string_equal(npualloc_replay_error(r), "");
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_DEVICE_ERROR);
    assert_int_equal(res.allocs, 1); /* the small one: 2 MiB pages */
    assert_int_equal(res.ooms, 0);
    assert_non_null(strstr(npualloc_replay_error(r), "failed with ACL error 107000"));
    res = run(r, list + 2, 1, NPUALLOC_REPLAY_STOPPED); /* later chunks replay nothing */
    assert_int_equal(res.frees, 0);
    npualloc_replay_destroy(r);
    assert_string_equal(npualloc_replay_error(NULL), "");
}

static void test_unknown_frees_and_ignored_events_are_counted(void **state)
{
    (void)state;
    static const ev list[] = {
        {F, 0xdead000, 0, 0}, /* allocated before recording began */
        {A, 0x1000, 4096, 0},
        {F, 0, 0, 0},         /* no address */
        {A, 0x2000, 0, 0},    /* nothing allocated for 0 bytes */
        {F, 0x1000, 0, 0},
        {F, 0x1000, 0, 0},    /* a second free of the same address */
    };
    npualloc_replay *r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.events, 6);
    assert_int_equal(res.unknown_frees, 2);
    assert_int_equal(res.ignored, 2);
    assert_int_equal(res.allocs, 1);
    assert_int_equal(res.frees, 1);
    assert_int_equal(res.ooms, 0);
    npualloc_replay_destroy(r);
}

static void test_duplicate_alloc_frees_the_earlier_block(void **state)
{
    (void)state;
    static const ev list[] = {{A, 0x1000, 4096, 0}, {A, 0x1000, 4096, 0}, {F, 0x1000, 0, 0}};
    npualloc_replay *r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.duplicate_allocs, 1);
    assert_int_equal(res.frees, 2);
    assert_int_equal(res.final_allocated, 0);
    assert_int_equal(res.peak_allocated, 4608);
    npualloc_replay_destroy(r);
}

static void test_a_requested_free_waits_for_its_completion(void **state)
{
    (void)state;
    static const ev list[] = {
        {A, 0x10000, 15 * MiB_, 0}, /* a 16 MiB segment */
        {FR, 0x10000, 0, 0},        /* another stream still uses it: not reusable yet */
        {A, 0x20000, 15 * MiB_, 0}, /* so this one needs a second segment */
        {FC, 0x10000, 0, 0},        /* now the first block is cached */
        {A, 0x30000, 15 * MiB_, 0}, /* and reused */
        {FC, 0x30000, 0, 0},        /* no free of it pending: ignored */
    };
    npualloc_replay *r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    evs a;
    to_arrays(&a, list, 3);
    assert_int_equal(npualloc_replay_feed(r, &a.e), NPUALLOC_REPLAY_OK);
    check(r);
    npualloc_snapshot *snap = NULL;
    assert_int_equal(npualloc_replay_snapshot(r, &snap), NPUALLOC_REPLAY_OK);
    assert_int_equal(snap->segment_count, 2);
    assert_int_equal(snap->blocks[0].state, NPUALLOC_BLOCK_ACTIVE_PENDING_FREE);
    npualloc_snapshot_free(snap);
    npualloc_stats s;
    npualloc_replay_get_stats(r, &s);
    /* each block is its whole segment (the 1 MiB - 512 left is too small to split off) */
    assert_int_equal(s.allocated_bytes[NPUALLOC_STAT_ALL].current, 16 * MiB_); /* freed at the request */
    assert_int_equal(s.active_bytes[NPUALLOC_STAT_ALL].current, 32 * MiB_);
    assert_int_equal(s.requested_bytes[NPUALLOC_STAT_ALL].current, 2 * 15 * MiB_);
    npualloc_replay_result res = run(r, list + 3, N(list) - 3, NPUALLOC_REPLAY_OK);
    assert_int_equal(res.events, N(list));
    assert_int_equal(res.allocs, 3);
    assert_int_equal(res.frees, 1);
    assert_int_equal(res.unknown_frees, 0);
    assert_int_equal(res.ignored, 0);
    assert_int_equal(res.peak_reserved, 32 * MiB_);
    assert_int_equal(res.device_allocs, 2);
    assert_int_equal(res.live_allocations, 2);
    npualloc_replay_destroy(r);

    /* The same with a plain FREE reuses the block at once. */
    static const ev at_once[] = {{A, 0x10000, 15 * MiB_, 0}, {F, 0x10000, 0, 0}, {A, 0x20000, 15 * MiB_, 0}};
    r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    res = run(r, at_once, N(at_once), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.peak_reserved, 16 * MiB_);
    npualloc_replay_destroy(r);
}

static void test_a_requested_free_completes_when_the_allocator_drains(void **state)
{
    (void)state;
    /* 24 MiB of device: the second 16 MiB segment does not fit.  torch's last resort synchronizes,
     * completes every pending free and releases the cache: the first segment goes back and the
     * allocation succeeds.  A free requested again before its completion completes the first. */
    static const ev list[] = {
        {A, 0x10000, 15 * MiB_, 0}, {FR, 0x10000, 0, 0}, {A, 0x20000, 15 * MiB_, 0},
        {FC, 0x10000, 0, 0},        /* already completed by the drain: ignored */
        {A, 0x30000, 1000, 0},      {FR, 0x30000, 0, 0}, {A, 0x30000, 1000, 0},
        {FR, 0x30000, 0, 0},        {FC, 0x30000, 0, 0},
    };
    npualloc_replay *r = session(NULL, 24 * MiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.ooms, 0);
    assert_int_equal(res.retries, 1);
    assert_int_equal(res.device_frees, 1);
    assert_int_equal(res.allocs, 4);
    assert_int_equal(res.frees, 3);
    assert_int_equal(res.live_allocations, 1);
    npualloc_stats s;
    npualloc_replay_get_stats(r, &s);
    assert_int_equal(s.active_bytes[NPUALLOC_STAT_ALL].current, 16 * MiB_);
    npualloc_replay_destroy(r);
}

static void test_a_recorded_oom_is_tried_again(void **state)
{
    (void)state;
    /* 64 MiB of device.  The recorded run failed to allocate 70 MiB (rounded: 70 MiB + 512): its
     * retry released the cached 22 MiB segment, so the next 20 MiB needed a new one. */
    static const ev list[] = {
        {A, 0x10000, 20 * MiB_, 0}, {F, 0x10000, 0, 0}, {OOM, 0, 70 * MiB_ + 512, 0}, {A, 0x20000, 20 * MiB_, 0},
    };
    npualloc_replay *r = session(NULL, 64 * MiB_, NPUALLOC_REPLAY_PAD_NPU, true);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.events, 4);
    assert_int_equal(res.recorded_ooms, 1);
    assert_int_equal(res.recorded_ooms_reproduced, 1);
    assert_int_equal(res.ooms, 0); /* not a new OOM: the session does not stop */
    assert_false(res.stopped);
    assert_int_equal(res.allocs, 2);
    assert_int_equal(res.retries, 1);
    assert_int_equal(res.device_allocs, 2);
    assert_int_equal(res.device_frees, 1);
    npualloc_replay_destroy(r);

    /* On a larger device the allocation succeeds: the segment made for it stays cached. */
    r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.recorded_ooms, 1);
    assert_int_equal(res.recorded_ooms_reproduced, 0);
    assert_int_equal(res.allocs, 2);
    assert_int_equal(res.frees, 1);
    assert_int_equal(res.live_allocations, 1);
    assert_int_equal(res.peak_allocated, 70 * MiB_ + 512); /* exactly the recorded size, pad taken back */
    assert_int_equal(res.final_reserved, 22 * MiB_ + 72 * MiB_);
    npualloc_replay_destroy(r);
}

static void test_empty_cache_releases_and_completes_pending_frees(void **state)
{
    (void)state;
    static const ev list[] = {
        {A, 0x10000, 20 * MiB_, 0}, {A, 0x20000, 20 * MiB_, 0}, {F, 0x10000, 0, 0},
        {FR, 0x20000, 0, 0},        /* its completion is still ahead... */
        {EMPTY, 0, 0, 0},           /* ...but empty_cache completes it: both segments go back */
        {FC, 0x20000, 0, 0},
    };
    npualloc_replay *r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.events, N(list));
    assert_int_equal(res.device_allocs, 2);
    assert_int_equal(res.device_frees, 2);
    assert_int_equal(res.final_reserved, 0);
    assert_int_equal(res.ignored, 0);
    npualloc_replay_destroy(r);
}

static void test_streams_keep_their_own_blocks(void **state)
{
    (void)state;
    /* A block freed on stream 7 is not reused by stream 9: two small segments. */
    static const ev list[] = {{A, 0x1000, 1000, 7}, {F, 0x1000, 0, 7}, {A, 0x2000, 1000, 9}, {F, 0x2000, 0, 9}};
    npualloc_replay *r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.device_allocs, 2);
    assert_int_equal(res.peak_reserved, 4 * MiB_);
    npualloc_replay_destroy(r);
}

/* A pseudo-random but fixed workload of n events over `live` slots. */
static size_t make_workload(uint8_t *action, uint64_t *addr, uint64_t *size, uint64_t *stream, size_t n,
                            uint32_t seed)
{
    uint64_t slots[64] = {0};
    uint64_t next = 0x100000;
    size_t k = 0;
    uint32_t x = seed;
    while (k < n) {
        x = x * 1664525u + 1013904223u;
        size_t s = (x >> 8) % 64;
        if (slots[s]) {
            action[k] = F;
            addr[k] = slots[s];
            size[k] = 0;
            slots[s] = 0;
        } else {
            x = x * 1664525u + 1013904223u;
            uint64_t sz = (x >> 4) % 4 == 0 ? ((uint64_t)(x >> 10) % (64 * MiB_)) + 1 : (x >> 12) % 200000 + 1;
            action[k] = A;
            addr[k] = slots[s] = next;
            next += 0x1000;
            size[k] = sz;
        }
        stream[k] = (x >> 20) % 5 == 0 ? 3 : 0;
        k++;
    }
    return k;
}

static void test_chunked_feeding_matches_one_feed(void **state)
{
    (void)state;
    enum { NEV = 4000 };
    static uint8_t action[NEV];
    static uint64_t addr[NEV], size[NEV], stream[NEV];
    make_workload(action, addr, size, stream, NEV, 42);
    npualloc_replay *one = session("max_split_size_mb:128", 2 * GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay *many = session("max_split_size_mb:128", 2 * GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_events e = {action, addr, size, stream, NEV};
    assert_int_equal(npualloc_replay_feed(one, &e), NPUALLOC_REPLAY_OK);
    for (size_t at = 0; at < NEV; at += 333) {
        size_t n = NEV - at < 333 ? NEV - at : 333;
        npualloc_replay_events c = {action + at, addr + at, size + at, stream + at, n};
        assert_int_equal(npualloc_replay_feed(many, &c), NPUALLOC_REPLAY_OK);
    }
    check(one);
    check(many);
    npualloc_replay_result a, b;
    npualloc_replay_get_result(one, &a);
    npualloc_replay_get_result(many, &b);
    assert_int_equal(a.events, NEV);
    assert_int_equal(b.events, NEV);
    assert_int_equal(a.peak_reserved, b.peak_reserved);
    assert_int_equal(a.peak_allocated, b.peak_allocated);
    assert_int_equal(a.device_allocs, b.device_allocs);
    assert_int_equal(a.device_frees, b.device_frees);
    assert_true(a.peak_reserved >= a.peak_allocated && a.peak_allocated >= a.peak_requested);
    /* The timeline: at most 2048 samples, its maxima are the peaks, its first sample event 0. */
    static npualloc_replay_point pts[4096];
    size_t np = npualloc_replay_timeline(many, pts, 4096);
    assert_true(np > 0 && np <= 2048);
    uint64_t ma = 0, mr = 0;
    for (size_t i = 0; i < np; i++) {
        ma = pts[i].allocated > ma ? pts[i].allocated : ma;
        mr = pts[i].reserved > mr ? pts[i].reserved : mr;
        if (i)
            assert_true(pts[i].event > pts[i - 1].event);
    }
    assert_int_equal(pts[0].event, 0);
    assert_int_equal(ma, b.peak_allocated);
    assert_int_equal(mr, b.peak_reserved);
    npualloc_replay_destroy(one);
    npualloc_replay_destroy(many);
}

static void test_timeline_stays_within_its_points(void **state)
{
    (void)state;
    enum { NEV = 1001 };
    static uint8_t action[NEV];
    static uint64_t addr[NEV], size[NEV], stream[NEV];
    make_workload(action, addr, size, stream, NEV, 7);
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    cfg.timeline_points = 10;
    npualloc_replay *r = NULL;
    assert_int_equal(npualloc_replay_create(&cfg, &r, NULL, 0), NPUALLOC_REPLAY_OK);
    npualloc_replay_events e = {action, addr, size, stream, NEV};
    assert_int_equal(npualloc_replay_feed(r, &e), NPUALLOC_REPLAY_OK);
    npualloc_replay_point pts[16];
    size_t n = npualloc_replay_timeline(r, pts, 16);
    assert_true(n >= 5 && n <= 11); /* 10 full buckets at most, plus the one being filled */
    npualloc_replay_result res;
    npualloc_replay_get_result(r, &res);
    uint64_t mr = 0;
    for (size_t i = 0; i < n; i++)
        mr = pts[i].reserved > mr ? pts[i].reserved : mr;
    assert_int_equal(mr, res.peak_reserved);
    npualloc_replay_destroy(r);
}

static void test_bad_settings_and_config_are_reported(void **state)
{
    (void)state;
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    npualloc_replay *r = (npualloc_replay *)1;
    char err[512];
    cfg.settings = "max_split_size_mb:1";
    assert_int_equal(npualloc_replay_create(&cfg, &r, err, sizeof err), NPUALLOC_REPLAY_BAD_SETTINGS);
    assert_null(r);
    assert_string_equal(err, "CachingAllocator option max_split_size_mb too small, must be >= 20");
    cfg.settings = "no_such_key:1";
    assert_int_equal(npualloc_replay_create(&cfg, &r, err, sizeof err), NPUALLOC_REPLAY_BAD_SETTINGS);
    assert_true(strlen(err) > 0);
    cfg.settings = NULL;
    cfg.device_memory = 0;
    assert_int_equal(npualloc_replay_create(&cfg, &r, err, sizeof err), NPUALLOC_REPLAY_BAD_CONFIG);
    cfg.device_memory = GiB_;
    cfg.fraction = 1.5;
    assert_int_equal(npualloc_replay_create(&cfg, &r, err, sizeof err), NPUALLOC_REPLAY_BAD_CONFIG);
    cfg.fraction = 0;
    cfg.huge1g_memory = 2 * GiB_;
    assert_int_equal(npualloc_replay_create(&cfg, &r, err, sizeof err), NPUALLOC_REPLAY_BAD_CONFIG);
    cfg.huge1g_memory = 0;
    cfg.pad = 512;
    assert_int_equal(npualloc_replay_create(&cfg, &r, err, sizeof err), NPUALLOC_REPLAY_BAD_CONFIG);
    /* A deprecated key parses with a warning the session keeps. */
    npualloc_replay_config_default(&cfg);
    cfg.settings = "segment_size_mb:64";
    assert_int_equal(npualloc_replay_create(&cfg, &r, err, sizeof err), NPUALLOC_REPLAY_OK);
    assert_non_null(npualloc_replay_warning(r, 0));
    assert_null(npualloc_replay_warning(r, 1));
    npualloc_replay_destroy(r);
}

static void test_every_status_has_its_name(void **state)
{
    (void)state;
    static const char *const names[] = {"OK",      "BAD_SETTINGS", "BAD_CONFIG", "UNAVAILABLE",
                                        "STOPPED", "HOST_MEMORY",  "INVALID",    "DEVICE_ERROR"};
    for (int st = NPUALLOC_REPLAY_OK; st <= NPUALLOC_REPLAY_DEVICE_ERROR; st++)
        assert_string_equal(npualloc_replay_status_name((npualloc_replay_status)st), names[st]);
    assert_string_equal(npualloc_replay_status_name((npualloc_replay_status)(NPUALLOC_REPLAY_DEVICE_ERROR + 1)),
                        "UNKNOWN");
    assert_string_equal(npualloc_replay_status_name((npualloc_replay_status)-1), "UNKNOWN");
}

static void test_a_session_reports_its_own_settings(void **state)
{
    (void)state;
    npualloc_allocator_settings s;
    npualloc_replay *r = session("max_split_size_mb:40,garbage_collection_threshold:0.5", GiB_, 32, false);
    assert_int_equal(npualloc_replay_get_settings(r, &s), NPUALLOC_REPLAY_OK);
    assert_int_equal(s.max_split_size, 40 * MiB_);
    assert_true(s.garbage_collection_threshold == 0.5);
    assert_false(s.expandable_segments);
    npualloc_replay_destroy(r);
    r = session("expandable_segments:True", GiB_, 32, false);
    assert_int_equal(npualloc_replay_get_settings(r, &s), NPUALLOC_REPLAY_OK);
    assert_true(s.expandable_segments);
    assert_int_equal(npualloc_replay_get_settings(r, NULL), NPUALLOC_REPLAY_INVALID);
    assert_int_equal(npualloc_replay_get_settings(NULL, &s), NPUALLOC_REPLAY_INVALID);
    assert_true(s.max_split_size == SIZE_MAX);
    npualloc_replay_destroy(r);
}

static void test_memory_fraction_limits_the_session(void **state)
{
    (void)state;
    static const ev list[] = {{A, 0x1000, 600 * MiB_, 0}, {A, 0x2000, 300 * MiB_, 0}};
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    cfg.device_memory = GiB_;
    cfg.fraction = 0.5;
    npualloc_replay *r = NULL;
    assert_int_equal(npualloc_replay_create(&cfg, &r, NULL, 0), NPUALLOC_REPLAY_OK);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.ooms, 1);
    assert_int_equal(res.allocs, 1);
    npualloc_replay_oom o;
    assert_true(npualloc_replay_get_oom(r, 0, &o));
    assert_int_equal(o.event, 0);
    assert_non_null(strstr(o.message, "512.00 MiB allowed;"));
    npualloc_replay_destroy(r);
}

static void test_page_size_1g_uses_the_pool_then_falls_back(void **state)
{
    (void)state;
    static const ev list[] = {{A, 0x1000, 30 * MiB_, 0}, {A, 0x2000, 30 * MiB_, 0}, {A, 0x3000, 1000, 0}};
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    cfg.settings = "page_size:1g";
    cfg.device_memory = 4 * GiB_;
    cfg.huge1g_memory = GiB_;
    npualloc_replay *r = NULL;
    assert_int_equal(npualloc_replay_create(&cfg, &r, NULL, 0), NPUALLOC_REPLAY_OK);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    /* A large request gets a 1 GiB segment from the pool; the second one is split from the
     * first segment's remainder; the small request gets an ordinary 2 MiB segment. */
    assert_int_equal(res.peak_reserved, GiB_ + 2 * MiB_);
    assert_int_equal(res.device_allocs, 2);
    assert_int_equal(res.huge1g_fallbacks, 0);
    npualloc_replay_destroy(r);
    /* No pool: the 1 GiB segment comes from ordinary memory, counted, and no process-wide warning. */
    cfg.huge1g_memory = 0;
    assert_int_equal(npualloc_replay_create(&cfg, &r, NULL, 0), NPUALLOC_REPLAY_OK);
    res = run(r, list, 1, NPUALLOC_REPLAY_OK);
    assert_int_equal(res.peak_reserved, GiB_);
    assert_int_equal(res.huge1g_fallbacks, 1);
    assert_false(npualloc_has_warnings());
    npualloc_replay_destroy(r);
}

/* A simulated device can be huge; one expandable segment maps at most 2^20 pages at once (its page
 * table stays within 8 MiB of host memory): more is an out-of-memory event, not gigabytes of
 * host allocation (found by fuzz_replay), and the session goes on. */
static void test_expandable_page_table_is_bounded(void **state)
{
    (void)state;
    const uint64_t TiB = (uint64_t)1 << 40;
    static ev list[3];
    list[0] = (ev){A, 0x1000, 400 * TiB, 0}; /* 20 MiB pages: 20.97 M pages > 2^20 */
    list[1] = (ev){A, 0x2000, TiB, 0};       /* 52 k pages: fits */
    list[2] = (ev){F, 0x2000, TiB, 0};
    npualloc_replay *r = session("expandable_segments:True", (uint64_t)1 << 60, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.ooms, 1);
    assert_int_equal(res.allocs, 1);
    assert_int_equal(res.peak_allocated, TiB + 512); /* torch_npu's 32-byte pad, rounded to 512 */
    npualloc_replay_oom o;
    assert_true(npualloc_replay_get_oom(r, 0, &o));
    assert_int_equal(o.event, 0);
    npualloc_replay_destroy(r);
}

/* On a 1 EiB simulated device each expandable segment reserves 1 1/8 EiB, and the simulated address
 * space holds ten: the eleventh stream's segment is an out-of-memory event (the reservations used to
 * wrap around 2^64 and break the checker; found by fuzz_replay), and a destroyed segment's range is
 * reused when a retry releases it. */
static void test_simulated_address_space_runs_out_and_is_reused(void **state)
{
    (void)state;
    static ev list[13];
    for (int i = 0; i < 11; i++)
        list[i] = (ev){A, 0x1000 * (uint64_t)(i + 1), 2 * MiB_, (uint64_t)(i + 1)}; /* streams 1 .. 11 */
    list[11] = (ev){F, 0x1000, 0, 1};                                               /* stream 1's is free */
    list[12] = (ev){A, 0xc000, 2 * MiB_, 11}; /* the retry releases stream 1's segment, then reuses it */
    npualloc_replay *r = session("expandable_segments:True", (uint64_t)1 << 60, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, 11, NPUALLOC_REPLAY_OK);
    assert_int_equal(res.allocs, 10);
    assert_int_equal(res.ooms, 1);
    npualloc_replay_oom o;
    assert_true(npualloc_replay_get_oom(r, 0, &o));
    assert_int_equal(o.event, 10);
    res = run(r, list + 11, 2, NPUALLOC_REPLAY_OK);
    assert_int_equal(res.allocs, 11);
    assert_int_equal(res.ooms, 1);
    npualloc_replay_destroy(r);
}

/* Segment addresses are never reused: on a 1 EiB device, three segments of most of it that come
 * and go use up the 2 EiB of the segment region, and the third is out of memory (the region is
 * used up) instead of taking addresses of the 1 GiB pool's region. */
static void test_segment_address_region_runs_out(void **state)
{
    (void)state;
    static const ev list[] = {
        {A, 0x1000, (uint64_t)3 << 58, 0},  {F, 0x1000, 0, 0},  /* 0.75 EiB */
        {A, 0x2000, (uint64_t)13 << 56, 0}, {F, 0x2000, 0, 0},  /* 0.81 EiB: the first is released first */
        {A, 0x3000, (uint64_t)7 << 57, 0},  {F, 0x3000, 0, 0},  /* 0.88 EiB: past the region's 2 EiB */
    };
    npualloc_replay *r = session("", (uint64_t)1 << 60, NPUALLOC_REPLAY_PAD_NPU, false);
    npualloc_replay_result res = run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.allocs, 2);
    assert_int_equal(res.ooms, 1);
    npualloc_replay_oom o;
    assert_true(npualloc_replay_get_oom(r, 0, &o));
    assert_int_equal(o.event, 4);
    npualloc_replay_destroy(r);
}

static void test_expandable_segments_when_available(void **state)
{
    (void)state;
    enum { NEV = 2000 };
    static uint8_t action[NEV];
    static uint64_t addr[NEV], size[NEV], stream[NEV];
    make_workload(action, addr, size, stream, NEV, 3);
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    cfg.settings = "expandable_segments:True";
    npualloc_replay *r = NULL;
    char err[256];
    npualloc_replay_status st = npualloc_replay_create(&cfg, &r, err, sizeof err);
    if (st == NPUALLOC_REPLAY_UNAVAILABLE) {
        assert_non_null(strstr(err, "expandable_segments"));
        skip();
    }
    assert_int_equal(st, NPUALLOC_REPLAY_OK);
    npualloc_replay_events e = {action, addr, size, stream, NEV};
    assert_int_equal(npualloc_replay_feed(r, &e), NPUALLOC_REPLAY_OK);
    check(r);
    npualloc_replay_result res;
    npualloc_replay_get_result(r, &res);
    assert_true(res.expandable);
    assert_int_equal(res.ooms, 0);
    assert_true(res.peak_reserved >= res.peak_allocated);
    npualloc_replay_destroy(r);
}

static void test_snapshot_has_segments_and_history(void **state)
{
    (void)state;
    static const ev list[] = {{A, 0x1000, 1000, 0}, {A, 0x2000, 30 * MiB_, 5}, {F, 0x1000, 0, 0}};
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    cfg.record_history = 100;
    npualloc_replay *r = NULL;
    assert_int_equal(npualloc_replay_create(&cfg, &r, NULL, 0), NPUALLOC_REPLAY_OK);
    run(r, list, N(list), NPUALLOC_REPLAY_OK);
    npualloc_snapshot *s = NULL;
    assert_int_equal(npualloc_replay_snapshot(r, &s), NPUALLOC_REPLAY_OK);
    assert_int_equal(s->segment_count, 2);
    /* segment_alloc, alloc, segment_alloc, alloc, free_requested, free_completed */
    assert_int_equal(s->trace_count, 6);
    static const npualloc_trace_action want[] = {NPUALLOC_TRACE_SEGMENT_ALLOC, NPUALLOC_TRACE_ALLOC,
                                                 NPUALLOC_TRACE_SEGMENT_ALLOC, NPUALLOC_TRACE_ALLOC,
                                                 NPUALLOC_TRACE_FREE_REQUESTED, NPUALLOC_TRACE_FREE_COMPLETED};
    for (size_t i = 0; i < 6; i++)
        assert_int_equal(s->traces[i].action, want[i]);
    assert_int_equal(s->traces[3].size, 30 * MiB_);
    assert_int_equal(s->traces[3].stream, 5);
    uint64_t reserved = 0, allocated = 0;
    for (size_t i = 0; i < s->segment_count; i++) {
        reserved += s->segments[i].total_size;
        allocated += s->segments[i].allocated_size;
    }
    assert_int_equal(reserved, 2 * MiB_ + 32 * MiB_);
    assert_int_equal(allocated, 30 * MiB_ + 512);
    npualloc_snapshot_free(s);
    npualloc_replay_destroy(r);
}

/* An expandable segment reserves far more address space than it maps: the snapshot lists only
 * its mapped ranges (as the live allocator's does), so the segments add up to what is reserved. */
static void test_expandable_snapshot_lists_mapped_ranges_only(void **state)
{
    (void)state;
    static const ev list[] = {{A, 0x1000, 1000, 0}, {A, 0x2000, 30 * MiB_, 0}};
    npualloc_replay *r = session("expandable_segments:True", 80 * GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    run(r, list, N(list), NPUALLOC_REPLAY_OK);
    npualloc_replay_result res;
    npualloc_replay_get_result(r, &res);
    npualloc_snapshot *s = NULL;
    assert_int_equal(npualloc_replay_snapshot(r, &s), NPUALLOC_REPLAY_OK);
    uint64_t listed = 0;
    for (size_t i = 0; i < s->segment_count; i++) {
        assert_true(s->segments[i].is_expandable);
        listed += s->segments[i].total_size;
    }
    assert_int_equal(listed, res.peak_reserved); /* nothing was freed: peak = current */
    assert_true(listed < 64 * MiB_);
    npualloc_snapshot_free(s);
    npualloc_replay_destroy(r);
}

typedef struct thread_arg {
    uint32_t seed;
    npualloc_replay_result res;
} thread_arg;

static void *replay_thread(void *p)
{
    thread_arg *a = p;
    enum { NEV = 20000 };
    uint8_t *action = malloc(NEV);
    uint64_t *addr = malloc(NEV * 8), *size = malloc(NEV * 8), *stream = malloc(NEV * 8);
    make_workload(action, addr, size, stream, NEV, a->seed);
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    cfg.device_memory = 4 * GiB_;
    cfg.settings = "garbage_collection_threshold:0.8";
    cfg.fraction = 0.9;
    npualloc_replay *r = NULL;
    if (npualloc_replay_create(&cfg, &r, NULL, 0) == NPUALLOC_REPLAY_OK) {
        npualloc_replay_events e = {action, addr, size, stream, NEV};
        npualloc_replay_feed(r, &e);
        npualloc_replay_get_result(r, &a->res);
        npualloc_replay_destroy(r);
    }
    free(action);
    free(addr);
    free(size);
    free(stream);
    return NULL;
}

static void test_parallel_sessions_are_independent_and_leave_the_runtime_alone(void **state)
{
    (void)state;
    npualloc_shutdown();
    thread_arg args[4] = {{1, {0}}, {1, {0}}, {2, {0}}, {2, {0}}};
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&t[i], NULL, replay_thread, &args[i]), 0);
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    for (int i = 0; i < 4; i += 2) {
        assert_int_equal(args[i].res.events, 20000);
        assert_int_equal(args[i].res.peak_reserved, args[i + 1].res.peak_reserved);
        assert_int_equal(args[i].res.device_allocs, args[i + 1].res.device_allocs);
        assert_int_equal(args[i].res.device_frees, args[i + 1].res.device_frees);
    }
    /* No device was started, no warning queued. */
    assert_false(npualloc_initialized());
    assert_false(npualloc_has_warnings());
}

/* A NULL session or output is NPUALLOC_REPLAY_INVALID (ACL_ERROR_INVALID_PARAM for the check),
 * false, 0 or NULL, as the header says: never a crash. */
static void test_null_sessions_and_outputs_are_refused(void **state)
{
    (void)state;
    npualloc_replay_result res;
    npualloc_stats stats;
    npualloc_replay_point pt;
    npualloc_replay_oom oom;
    npualloc_snapshot *snap = NULL;
    char why[64];
    npualloc_replay_events none = {0};
    assert_int_equal(npualloc_replay_config_default(NULL), NPUALLOC_REPLAY_INVALID);
    assert_int_equal(npualloc_replay_create(NULL, NULL, NULL, 0), NPUALLOC_REPLAY_INVALID);
    npualloc_replay_destroy(NULL);
    assert_int_equal(npualloc_replay_feed(NULL, &none), NPUALLOC_REPLAY_INVALID);
    assert_int_equal(npualloc_replay_get_result(NULL, &res), NPUALLOC_REPLAY_INVALID);
    assert_int_equal(npualloc_replay_get_stats(NULL, &stats), NPUALLOC_REPLAY_INVALID);
    assert_int_equal(npualloc_replay_timeline(NULL, &pt, 1), 0);
    assert_false(npualloc_replay_get_oom(NULL, 0, &oom));
    assert_null(npualloc_replay_warning(NULL, 0));
    assert_int_equal(npualloc_replay_snapshot(NULL, &snap), NPUALLOC_REPLAY_INVALID);
    assert_int_equal(npualloc_replay_check(NULL, why, sizeof why), ACL_ERROR_INVALID_PARAM);

    /* a live session with nowhere to write */
    npualloc_replay *r = session(NULL, GiB_, NPUALLOC_REPLAY_PAD_NPU, false);
    const ev list[] = {{A, 0x1000, 1 * MiB_, 0}, {OOM, 0, 2 * GiB_, 0}};
    run(r, list, N(list), NPUALLOC_REPLAY_OK);
    assert_int_equal(npualloc_replay_feed(r, NULL), NPUALLOC_REPLAY_INVALID);
    assert_int_equal(npualloc_replay_get_result(r, NULL), NPUALLOC_REPLAY_INVALID);
    assert_int_equal(npualloc_replay_get_stats(r, NULL), NPUALLOC_REPLAY_INVALID);
    size_t points = npualloc_replay_timeline(r, NULL, 0);
    assert_true(points > 0);
    assert_int_equal(npualloc_replay_timeline(r, NULL, 8), points); /* counted, nothing copied */
    assert_false(npualloc_replay_get_oom(r, 0, NULL));
    assert_int_equal(npualloc_replay_snapshot(r, NULL), NPUALLOC_REPLAY_INVALID);
    assert_int_equal(npualloc_replay_check(r, NULL, sizeof why), ACL_ERROR_INVALID_PARAM);
    assert_int_equal(npualloc_replay_check(r, NULL, 0), ACL_SUCCESS); /* no message wanted */
    /* and the session still works */
    assert_int_equal(npualloc_replay_get_result(r, &res), NPUALLOC_REPLAY_OK);
    assert_int_equal(res.allocs, 1);
    assert_int_equal(res.recorded_ooms, 1);
    assert_int_equal(npualloc_replay_get_stats(r, &stats), NPUALLOC_REPLAY_OK);
    npualloc_replay_destroy(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_pool_exact_peaks),
        cmocka_unit_test(test_every_status_has_its_name),
        cmocka_unit_test(test_large_segments_and_reuse),
        cmocka_unit_test(test_cuda_and_npu_rounding_differ),
        cmocka_unit_test(test_oom_continue_skips_the_allocation_and_its_free),
        cmocka_unit_test(test_oom_stop_ends_the_run),
        cmocka_unit_test(test_unknown_frees_and_ignored_events_are_counted),
        cmocka_unit_test(test_a_device_refusal_stops_the_run_with_its_message),
        cmocka_unit_test(test_duplicate_alloc_frees_the_earlier_block),
        cmocka_unit_test(test_a_requested_free_waits_for_its_completion),
        cmocka_unit_test(test_a_requested_free_completes_when_the_allocator_drains),
        cmocka_unit_test(test_a_recorded_oom_is_tried_again),
        cmocka_unit_test(test_empty_cache_releases_and_completes_pending_frees),
        cmocka_unit_test(test_streams_keep_their_own_blocks),
        cmocka_unit_test(test_chunked_feeding_matches_one_feed),
        cmocka_unit_test(test_timeline_stays_within_its_points),
        cmocka_unit_test(test_bad_settings_and_config_are_reported),
        cmocka_unit_test(test_a_session_reports_its_own_settings),
        cmocka_unit_test(test_memory_fraction_limits_the_session),
        cmocka_unit_test(test_page_size_1g_uses_the_pool_then_falls_back),
        cmocka_unit_test(test_expandable_page_table_is_bounded),
        cmocka_unit_test(test_simulated_address_space_runs_out_and_is_reused),
        cmocka_unit_test(test_segment_address_region_runs_out),
        cmocka_unit_test(test_expandable_segments_when_available),
        cmocka_unit_test(test_snapshot_has_segments_and_history),
        cmocka_unit_test(test_expandable_snapshot_lists_mapped_ranges_only),
        cmocka_unit_test(test_parallel_sessions_are_independent_and_leave_the_runtime_alone),
        cmocka_unit_test(test_null_sessions_and_outputs_are_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
