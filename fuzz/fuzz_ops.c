/* fuzz_ops.c - an operation-sequence fuzzer over the caching allocator's C API.
 *
 * Each input is a program: byte 0 picks the start-up PYTORCH_NPU_ALLOC_CONF (a table of valid
 * texts), byte 1 the device memory; every following byte is an operation, with its operands
 * read from the bytes after it.  The runtime has 2 devices of 40..100 MiB (so segments of 20 MiB
 * and out-of-memory paths are reached quickly) and 2 streams per device; operations are
 * malloc (0 bytes to above the device, incl. >= 1 EB), free (cache and torch allocate paths),
 * wrong frees, record_stream / erase_stream (own, other device's, default, bogus streams),
 * empty_cache, empty_virt_addr_cache, set_fraction (valid and invalid), _set_allocator_settings
 * (a table incl. expandable_segments on/off, and raw input bytes), private pools (create,
 * begin/end by thread or stream, release, empty; the last pool takes its segments from an
 * allocator of its own, torch's MemPool(allocator)), pool settings (use_on_oom marked and
 * cleared, no_split: torch's MemPool(use_on_oom=..., no_split=...)), stream work, stats,
 * snapshots, history.
 *
 * Checked after every operation (any failure aborts):
 *   - npualloc_cache_check passes on both devices;
 *   - each call returns one of its documented codes, and a failed allocation is an OOM whose
 *     message is NUL-terminated, or an invalid-argument error;
 *   - every live block still holds the pattern written at allocation: a tag at each 512-byte
 *     offset and its last byte (blocks are 512-aligned, so any overlap of two live blocks
 *     overwrites a tag of one of them);
 *   - snapshots list exactly the live blocks as allocated, with their requested sizes;
 *   - once a pool of the device was marked use_on_oom, a request no route takes gets a block of
 *     the default pools or of a pool that may be marked, held and not recorded into (or fails
 *     with beginAllocateToPool's error while a marked pool is recorded into); an allocation
 *     never splits a block of a no_split pool (with expandable_segments off, plain segments:
 *     the block count of its segment does not grow, a new segment holds one block); the pool
 *     settings return ACL_ERROR_INVALID_PARAM exactly for an unknown pool or device;
 *   - at the end, after freeing everything, ending the routes, releasing the pools and
 *     empty_cache: no allocated and no reserved bytes on either device, and every segment the
 *     pool's allocator handed out came back to it.
 * The runtime is shut down at the end of every input (npualloc_shutdown), so inputs are
 * independent. */
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "acl_rt.h"
#include "fuzz_common.h"
#include "npualloc.h"

#define OPS_DEVICES 2
#define OPS_STREAMS 2 /* created streams per device (plus the default stream 0) */
#define OPS_SLOTS 48
#define OPS_POOLS 3
#define OPS_ROUTES 8
#define OPS_MAX_STEPS 4096
#define MiB ((size_t)1 << 20)


typedef struct slot {
    unsigned char *ptr;
    size_t size;
    uint64_t tag;
    int32_t device;
    bool uncached_api; /* allocated with npualloc_allocate */
    npualloc_context *ctx;
} slot;

typedef struct route {
    npualloc_mempool_id id;
    int32_t device;
    npualloc_pool_filter filter;
    uint64_t value; /* the stream of a stream filter */
} route;

typedef struct ops_state {
    fuzz_in in;
    slot slots[OPS_SLOTS];
    uint64_t streams[OPS_DEVICES][OPS_STREAMS];
    npualloc_mempool_id pools[OPS_POOLS];
    int pool_refs[OPS_DEVICES][OPS_POOLS]; /* our references from npualloc_cache_pool_create */
    /* What the pool settings may have done, per device and pool.  made: created (not since
     * forgotten for sure); oom_marked: maybe marked use_on_oom (a forgotten pool loses its mark:
     * this may say true of an unmarked pool, never false of a marked one); no_split: surely
     * no_split (cleared when the pool may have been forgotten and made again). */
    bool made[OPS_DEVICES][OPS_POOLS];
    bool oom_marked[OPS_DEVICES][OPS_POOLS];
    bool no_split[OPS_DEVICES][OPS_POOLS];
    bool ever_marked[OPS_DEVICES]; /* a pool was marked: requests are watched from then on */
    long oom_fallbacks; /* default requests a marked pool's block served (traced at the end) */
    route routes[OPS_ROUTES];
    int route_count;
    uint64_t next_tag;
    size_t device_memory;
} ops_state;

static const char *const startup_confs[] = {
    NULL,
    "expandable_segments:True",
    "max_split_size_mb:40",
    "max_split_size_mb:24,garbage_collection_threshold:0.6",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[1:2,4:4,>:8],max_non_split_rounding_mb:30",
    "expandable_segments:True,base_addr_aligned_kb:0",
    "garbage_collection_threshold:0.9,per_process_memory_fraction:0.7",
    "throw_on_npumalloc_oom:True,per_process_memory_fraction:0.5",
    "large_segment_size_mb:30,multi_stream_lazy_reclaim:True",
};

static const char *const runtime_confs[] = {
    "expandable_segments:True",
    "expandable_segments:False",
    "max_split_size_mb:30",
    "max_split_size_mb:64",
    "max_non_split_rounding_mb:24",
    "per_process_memory_fraction:0.6",
    "per_process_memory_fraction:1.0",
    "per_process_memory_fraction:0",
    "throw_on_npumalloc_oom:True",
    "throw_on_npumalloc_oom:False",
    "release_lock_on_npumalloc:True",
    "release_lock_on_npumalloc:False",
    "expandable_segments:True,max_split_size_mb:40", /* rejected: the two exclude each other */
    "garbage_collection_threshold:0.5",              /* rejected at run time */
    "",
};

#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

/* Prints an operation when tracing (fuzz_tracing). */
#define OPS_TRACE(...)                                                                                         \
    do {                                                                                                       \
        if (fuzz_tracing()) {                                                                                  \
            fprintf(stderr, "  ");                                                                             \
            fprintf(stderr, __VA_ARGS__);                                                                      \
            fputc('\n', stderr);                                                                               \
        }                                                                                                      \
    } while (0)

/* ---- the allocator of the last pool (torch's MemPool(allocator)) ---- */

static long pool_allocator_live; /* its segments not yet given back */

static void *pool_allocator_alloc(size_t size, int device, aclrtStream stream)
{
    (void)stream;
    int32_t previous = -1;
    bool had = aclrtGetDevice(&previous) == ACL_SUCCESS;
    void *p = NULL;
    if (aclrtSetDevice(device) != ACL_SUCCESS || aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS)
        p = NULL; /* out of memory: the allocator frees cached memory and retries, or fails */
    if (had)
        FUZZ_CHECK(aclrtSetDevice(previous) == ACL_SUCCESS, "set_device back");
    pool_allocator_live += p != NULL;
    return p;
}

static void pool_allocator_free(void *ptr, size_t size, int device, aclrtStream stream)
{
    (void)size;
    (void)device;
    (void)stream;
    FUZZ_CHECK(aclrtFree(ptr) == ACL_SUCCESS, "a pool allocator's segment %p could not be freed", ptr);
    pool_allocator_live--;
}

/* ---- the fill pattern ---- */

static void fill(slot *s)
{
    for (size_t off = 0; off < s->size; off += 512) {
        uint64_t word = s->tag ^ (uint64_t)off;
        size_t n = s->size - off < 8 ? s->size - off : 8;
        memcpy(s->ptr + off, &word, n);
    }
    s->ptr[s->size - 1] = (unsigned char)(s->tag * 31u + 7u);
}

static void verify(const slot *s)
{
    for (size_t off = 0; off < s->size; off += 512) {
        uint64_t word = s->tag ^ (uint64_t)off, got = 0;
        size_t n = s->size - off < 8 ? s->size - off : 8;
        if (off + n == s->size) /* the last byte holds its own mark */
            n = n > 1 ? n - 1 : 0;
        memcpy(&got, s->ptr + off, n);
        FUZZ_CHECK(memcmp(&got, &word, n) == 0, "block %p (%zu bytes, device %d) overwritten at offset %zu",
                   (void *)s->ptr, s->size, (int)s->device, off);
    }
    FUZZ_CHECK(s->ptr[s->size - 1] == (unsigned char)(s->tag * 31u + 7u), "block %p: last byte overwritten",
               (void *)s->ptr);
}

/* ---- checks ---- */

static void check_devices(const char *after)
{
    for (int32_t d = 0; d < OPS_DEVICES; d++) {
        char why[512] = "";
        aclError rc = npualloc_cache_check(d, why, sizeof why);
        FUZZ_CHECK(rc == ACL_SUCCESS, "device %d after %s: %s", (int)d, after, why);
    }
}

static void check_error_message(void)
{
    npualloc_error_kind kind = NPUALLOC_ERR_NONE;
    const char *msg = npualloc_last_error(&kind);
    FUZZ_CHECK(msg != NULL && fuzz_terminated(msg, 1024), "last error not terminated");
    FUZZ_CHECK(kind >= NPUALLOC_ERR_NONE && kind <= NPUALLOC_ERR_OOM, "error kind %d", (int)kind);
}

static void check_all_slots(const ops_state *st)
{
    for (int i = 0; i < OPS_SLOTS; i++)
        if (st->slots[i].ptr)
            verify(&st->slots[i]);
}

static void check_snapshot(const ops_state *st)
{
    npualloc_snapshot *snap = NULL;
    aclError rc = npualloc_cache_snapshot(&snap);
    FUZZ_CHECK(rc == ACL_SUCCESS, "snapshot: %d", rc);
    size_t live = 0;
    for (int i = 0; i < OPS_SLOTS; i++)
        if (st->slots[i].ptr)
            live++;
    size_t allocated = 0;
    for (size_t si = 0; si < snap->segment_count; si++) {
        const npualloc_segment_info *seg = &snap->segments[si];
        FUZZ_CHECK(seg->first_block + seg->block_count <= snap->block_count, "segment %zu: blocks out of range", si);
        uint64_t at = seg->address, total = 0;
        for (size_t k = 0; k < seg->block_count; k++) {
            const npualloc_block_info *b = &snap->blocks[seg->first_block + k];
            FUZZ_CHECK(b->address == at, "segment %zu: blocks do not tile it", si);
            at += b->size;
            total += b->size;
            if (b->state != NPUALLOC_BLOCK_ACTIVE_ALLOCATED)
                continue;
            allocated++;
            bool found = false;
            for (int i = 0; i < OPS_SLOTS && !found; i++) {
                const slot *s = &st->slots[i];
                if (s->ptr && (uintptr_t)s->ptr == b->address) {
                    found = true;
                    FUZZ_CHECK(s->device == seg->device, "block %#llx on device %d, allocated on %d",
                               (unsigned long long)b->address, (int)seg->device, (int)s->device);
                    FUZZ_CHECK(b->requested_size == s->size && b->size >= s->size,
                               "block %#llx: requested %llu / size %llu, asked for %zu",
                               (unsigned long long)b->address, (unsigned long long)b->requested_size,
                               (unsigned long long)b->size, s->size);
                }
            }
            FUZZ_CHECK(found, "snapshot block %#llx is allocated but nobody holds it", (unsigned long long)b->address);
        }
        FUZZ_CHECK(total == seg->total_size, "segment %zu: total_size %llu, blocks %llu", si,
                   (unsigned long long)seg->total_size, (unsigned long long)total);
    }
    FUZZ_CHECK(allocated == live, "snapshot: %zu allocated blocks, %zu live", allocated, live);
    npualloc_snapshot_free(snap);
}

/* ---- private pools: what the harness knows of them ---- */

static bool same_pool(npualloc_mempool_id a, npualloc_mempool_id b) { return a.first == b.first && a.second == b.second; }

/* The index in st->pools of a snapshot's pool id, or -1 (the default pool). */
static int pool_index(const ops_state *st, const uint64_t id[2])
{
    for (int p = 0; p < OPS_POOLS; p++)
        if (st->pools[p].first == id[0] && st->pools[p].second == id[1])
            return p;
    return -1;
}

static bool pool_routed(const ops_state *st, int32_t dev, int p)
{
    for (int k = 0; k < st->route_count; k++)
        if (st->routes[k].device == dev && same_pool(st->routes[k].id, st->pools[p]))
            return true;
    return false;
}

/* Whether an allocation on (dev, stream) by this thread goes to a private pool (a route matches). */
static bool request_routed(const ops_state *st, int32_t dev, uint64_t stream)
{
    for (int k = 0; k < st->route_count; k++)
        if (st->routes[k].device == dev &&
            (st->routes[k].filter == NPUALLOC_POOL_FILTER_THREAD || st->routes[k].value == stream))
            return true;
    return false;
}

static bool pool_has_segments(int32_t dev, npualloc_mempool_id id)
{
    npualloc_snapshot *snap = NULL;
    FUZZ_CHECK(npualloc_cache_snapshot(&snap) == ACL_SUCCESS, "snapshot");
    bool found = false;
    for (size_t si = 0; si < snap->segment_count && !found; si++)
        found = snap->segments[si].device == dev && snap->segments[si].pool_id[0] == id.first &&
                snap->segments[si].pool_id[1] == id.second;
    npualloc_snapshot_free(snap);
    return found;
}

/* 1: pool p exists on the device, 0: it does not, -1: unknown (made, but nobody holds it and it
 * owns no segment: the next release of cached memory, which an allocation may do, forgets it). */
static int pool_exists(const ops_state *st, int32_t dev, int p)
{
    if (!st->made[dev][p])
        return 0;
    if (npualloc_cache_pool_use_count(dev, st->pools[p]) > 0 || pool_routed(st, dev, p) ||
        pool_has_segments(dev, st->pools[p]))
        return 1;
    return -1;
}

/* The segment of a snapshot that holds ptr (NULL: none). */
static const npualloc_segment_info *segment_of(const npualloc_snapshot *snap, int32_t dev, uintptr_t ptr)
{
    for (size_t si = 0; si < snap->segment_count; si++) {
        const npualloc_segment_info *seg = &snap->segments[si];
        if (seg->device == dev && ptr >= seg->address && ptr - seg->address < seg->total_size)
            return seg;
    }
    return NULL;
}

/* ---- operands ---- */

static int32_t pick_device(ops_state *st)
{
    uint8_t b = fuzz_u8(&st->in);
    if (b == 0xff)
        return -1; /* invalid */
    if (b == 0xfe)
        return 7; /* valid index, never configured */
    return (int32_t)(b % OPS_DEVICES);
}

static uint64_t pick_stream(ops_state *st, int32_t device)
{
    uint8_t b = fuzz_u8(&st->in);
    int32_t d = device >= 0 && device < OPS_DEVICES ? device : 0;
    switch (b % 8) {
    case 0:
    case 1:
        return 0;
    case 2:
    case 3:
        return st->streams[d][0];
    case 4:
        return st->streams[d][1];
    case 5:
        return st->streams[(d + 1) % OPS_DEVICES][b >> 7]; /* the other device's stream */
    case 6:
        return st->streams[d][b >> 7];
    default:
        return 0xdead0000u + b; /* not a stream */
    }
}

static size_t pick_size(ops_state *st)
{
    uint8_t c = fuzz_u8(&st->in);
    uint32_t r = fuzz_u32(&st->in);
    switch (c % 9) {
    case 0:
        return c < 0x80 ? 0 : 1;
    case 1:
        return 1 + r % 512;
    case 2:
    case 3:
        return 1 + r % (64 * 1024);
    case 4:
        return 1 + r % MiB;
    case 5:
        return 1 + r % (12 * MiB);
    case 6:
        return 1 + r % (40 * MiB);
    case 7:
        return 1 + r % (st->device_memory + 8 * MiB);
    default: {
        static const size_t special[] = {MiB - 32, MiB - 31, MiB, 2 * MiB, 10 * MiB - 32, 10 * MiB,
                                         20 * MiB - 32, 20 * MiB, 512, 480, 481, 31,
                                         (size_t)1 << 60, SIZE_MAX, ((size_t)1 << 60) - 1, (size_t)1 << 40};
        return special[r % N_ELEMS(special)];
    }
    }
}

static int pick_slot(ops_state *st, bool want_live)
{
    int start = fuzz_u8(&st->in) % OPS_SLOTS;
    for (int k = 0; k < OPS_SLOTS; k++) {
        int i = (start + k) % OPS_SLOTS;
        if ((st->slots[i].ptr != NULL) == want_live)
            return i;
    }
    return -1;
}

/* ---- operations ---- */

static void op_malloc(ops_state *st, bool with_ctx)
{
    int32_t dev = pick_device(st);
    size_t size = pick_size(st);
    uint64_t stream = pick_stream(st, dev);
    int i = pick_slot(st, false);
    if (i < 0)
        return;
    slot *s = &st->slots[i];
    uint8_t how = fuzz_u8(&st->in);
    void *p = (void *)0x1;
    npualloc_context *ctx = NULL;
    aclError rc;
    /* The pool settings: a request no route takes may get a use_on_oom pool's block (or fail
     * while such a pool is being recorded into); no request splits a block of a no_split pool.
     * Only plain segments are watched, with expandable_segments off: the base_addr_aligned_kb
     * front split and growing an expandable segment make blocks without splitting one. */
    bool valid_dev = dev >= 0 && dev < OPS_DEVICES, routed = valid_dev && request_routed(st, dev, stream);
    bool watch_route = valid_dev && st->ever_marked[dev], marked_recorded = false, watch_split = false;
    npualloc_snapshot *before = NULL;
    for (int k = 0; valid_dev && k < OPS_POOLS; k++) {
        marked_recorded |= st->oom_marked[dev][k] && pool_routed(st, dev, k);
        watch_split |= st->no_split[dev][k];
    }
    if (watch_split) {
        npualloc_allocator_settings set;
        FUZZ_CHECK(npualloc_cache_get_settings(&set) == ACL_SUCCESS, "get_settings");
        watch_split = !set.expandable_segments;
    }
    if (watch_split)
        FUZZ_CHECK(npualloc_cache_snapshot(&before) == ACL_SUCCESS, "snapshot");
    if (with_ctx) {
        ctx = npualloc_context_create(&how, 1);
        rc = npualloc_cache_malloc_ctx(dev, size, stream, ctx, &p);
    } else if (how & 1) {
        rc = npualloc_allocate(dev, size, stream, &p);
    } else {
        rc = npualloc_cache_malloc(dev, size, stream, &p);
    }
    OPS_TRACE("slot %d = %s(device %d, %zu, stream %#llx) -> %d %p", i,
              with_ctx ? "malloc_ctx" : (how & 1) ? "allocate" : "malloc", (int)dev, size, (unsigned long long)stream,
              rc, p);
    if (rc != ACL_SUCCESS) {
        npualloc_snapshot_free(before);
        FUZZ_CHECK(p == NULL, "a failed allocation left a pointer");
        check_error_message();
        if (dev < 0 || dev >= OPS_DEVICES)
            FUZZ_CHECK(rc == ACL_ERROR_INVALID_PARAM || rc == ACL_ERROR_RT_MEMORY_ALLOCATION,
                       "malloc on device %d: %d", (int)dev, rc);
        else if (rc == ACL_ERROR_INVALID_PARAM && !routed && marked_recorded)
            FUZZ_CHECK(strcmp(npualloc_last_error(NULL), "beginAllocateToPool: already recording to mempool_id") == 0,
                       "malloc(%zu) on device %d, a marked pool recorded into: %s", size, (int)dev,
                       npualloc_last_error(NULL));
        else
            FUZZ_CHECK(rc == ACL_ERROR_RT_MEMORY_ALLOCATION, "malloc(%zu) on device %d: %d %s", size, (int)dev, rc,
                       npualloc_last_error(NULL));
        npualloc_error_kind kind;
        npualloc_last_error(&kind);
        if (rc == ACL_ERROR_RT_MEMORY_ALLOCATION) {
            FUZZ_CHECK(kind == NPUALLOC_ERR_OOM, "OOM with error kind %d", (int)kind);
            npualloc_oom_info info;
            npualloc_cache_last_oom(&info);
            char msg[512];
            int n = npualloc_format_oom(&info, msg, sizeof msg);
            FUZZ_CHECK(n > 0 && fuzz_terminated(msg, sizeof msg), "OOM message");
        }
        npualloc_context_release(ctx);
        return;
    }
    if (size == 0) {
        npualloc_snapshot_free(before);
        FUZZ_CHECK(p == NULL, "malloc(0) returned %p", p);
        npualloc_context_release(ctx);
        return;
    }
    FUZZ_CHECK(dev >= 0 && dev < OPS_DEVICES, "malloc on device %d succeeded", (int)dev);
    FUZZ_CHECK(p != NULL && ((uintptr_t)p & 511) == 0, "malloc returned %p", p);
    int32_t bdev = -1;
    size_t bsize = 0;
    uint64_t bstream = 1;
    FUZZ_CHECK(npualloc_cache_block_info(p, &bdev, &bstream, &bsize) == ACL_SUCCESS, "block_info of a live block");
    FUZZ_CHECK(bdev == dev && bsize >= size && bstream == stream, "block_info: device %d size %zu stream %#llx",
               (int)bdev, bsize, (unsigned long long)bstream);
    if (watch_split || (watch_route && !routed)) {
        npualloc_snapshot *after = NULL;
        FUZZ_CHECK(npualloc_cache_snapshot(&after) == ACL_SUCCESS, "snapshot");
        const npualloc_segment_info *seg = segment_of(after, dev, (uintptr_t)p);
        FUZZ_CHECK(seg != NULL, "block %p is in no segment of device %d", p, (int)dev);
        int k = pool_index(st, seg->pool_id);
        if (!routed && k >= 0) {
            FUZZ_CHECK(st->oom_marked[dev][k], "a request no route takes got block %p of pool %d, not use_on_oom",
                       p, k);
            /* a pool nobody holds is skipped, one being recorded into fails the request */
            FUZZ_CHECK(npualloc_cache_pool_use_count(dev, st->pools[k]) > 0 && !pool_routed(st, dev, k),
                       "block %p of pool %d (use count %d, routed %d) served a request no route takes", p, k,
                       npualloc_cache_pool_use_count(dev, st->pools[k]), (int)pool_routed(st, dev, k));
            st->oom_fallbacks++;
            OPS_TRACE("  use_on_oom: served by pool %d's block", k);
        }
        if (watch_split && k >= 0 && st->no_split[dev][k] && !seg->is_expandable) {
            /* the same segment before (frees taken in may have merged blocks since), or a new one */
            const npualloc_segment_info *old = segment_of(before, dev, (uintptr_t)p);
            bool same = old && old->address == seg->address && old->total_size == seg->total_size &&
                        old->pool_id[0] == seg->pool_id[0] && old->pool_id[1] == seg->pool_id[1];
            FUZZ_CHECK(seg->block_count <= (same ? old->block_count : 1),
                       "no_split pool %d: block %p split its segment (%zu blocks, %zu before)", k, p, seg->block_count,
                       same ? old->block_count : 0);
        }
        npualloc_snapshot_free(after);
    }
    npualloc_snapshot_free(before);
    s->ptr = p;
    s->size = size;
    s->device = dev;
    s->tag = ++st->next_tag * 0x9E3779B97F4A7C15ull;
    s->uncached_api = !with_ctx && (how & 1);
    s->ctx = ctx;
    fill(s);
}

static void op_free(ops_state *st)
{
    int i = pick_slot(st, true);
    if (i < 0)
        return;
    slot *s = &st->slots[i];
    verify(s);
    uint8_t how = fuzz_u8(&st->in);
    aclError rc;
    if (s->ctx || (how & 3) == 3)
        rc = npualloc_cache_free_ctx(s->ptr, s->ctx);
    else if (s->uncached_api || (how & 1))
        rc = npualloc_deallocate(s->ptr);
    else
        rc = npualloc_cache_free(s->ptr);
    OPS_TRACE("free slot %d (%p, %zu bytes, device %d)%s", i, (void *)s->ptr, s->size, (int)s->device,
              s->ctx || (how & 3) == 3 ? " with ctx" : s->uncached_api || (how & 1) ? " by deallocate" : "");
    FUZZ_CHECK(rc == ACL_SUCCESS, "free(%p): %d", (void *)s->ptr, rc);
    npualloc_context_release(s->ctx);
    memset(s, 0, sizeof *s);
}

static void op_bad_free(ops_state *st)
{
    static char host_bytes[1024];
    uint8_t kind = fuzz_u8(&st->in);
    void *p;
    int i = pick_slot(st, true);
    switch (kind % 5) {
    case 0:
        if (i < 0)
            return;
        p = st->slots[i].ptr + 512 * (1 + kind / 8); /* inside a live block (maybe its neighbour: skip) */
        for (int k = 0; k < OPS_SLOTS; k++)
            if (st->slots[k].ptr == p)
                return;
        break;
    case 1:
        p = host_bytes;
        break;
    case 2:
        p = (void *)(uintptr_t)0x1;
        break;
    case 3:
        p = (void *)(uintptr_t)((uint64_t)1 << 63);
        break;
    default:
        p = (void *)(uintptr_t)(0x1000 * (uintptr_t)(kind + 1));
        break;
    }
    OPS_TRACE("bad free %p", p);
    aclError rc = (kind & 8) ? npualloc_deallocate(p) : npualloc_cache_free(p);
    FUZZ_CHECK(rc == ACL_ERROR_INVALID_PARAM, "free(%p) of no block: %d", p, rc);
    FUZZ_CHECK(npualloc_cache_record_stream(p, 0) == ACL_ERROR_INVALID_PARAM, "record_stream of no block");
    FUZZ_CHECK(npualloc_cache_erase_stream(p, 0) == ACL_ERROR_INVALID_PARAM, "erase_stream of no block");
    FUZZ_CHECK(npualloc_cache_block_info(p, NULL, NULL, NULL) == ACL_ERROR_INVALID_PARAM, "block_info of no block");
    check_error_message();
}

static void op_record_stream(ops_state *st, bool erase)
{
    int i = pick_slot(st, true);
    uint64_t stream = pick_stream(st, i >= 0 ? st->slots[i].device : 0);
    if (i < 0)
        return;
    slot *s = &st->slots[i];
    aclError rc = erase ? npualloc_cache_erase_stream(s->ptr, stream) : npualloc_cache_record_stream(s->ptr, stream);
    OPS_TRACE("%s(slot %d, stream %#llx) -> %d", erase ? "erase_stream" : "record_stream", i,
              (unsigned long long)stream, rc);
    if (erase)
        FUZZ_CHECK(rc == ACL_SUCCESS, "erase_stream: %d", rc);
    else if (stream >= 0xdead0000u && stream < 0xdead0100u)
        FUZZ_CHECK(rc == ACL_ERROR_INVALID_PARAM, "record_stream of a bogus stream: %d", rc);
    else
        FUZZ_CHECK(rc == ACL_SUCCESS, "record_stream: %d", rc);
}

static void op_fraction(ops_state *st)
{
    int32_t dev = pick_device(st);
    uint8_t v = fuzz_u8(&st->in);
    double f = v <= 200 ? v / 200.0 : v == 201 ? 1.5 : v == 202 ? -0.25 : v == 203 ? NAN : v == 204 ? INFINITY : 1.0;
    aclError rc = npualloc_cache_set_fraction(dev, f);
    OPS_TRACE("set_fraction(device %d, %g) -> %d", (int)dev, f, rc);
    bool valid_dev = dev >= 0 && dev < OPS_DEVICES, valid_f = f >= 0.0 && f <= 1.0;
    FUZZ_CHECK(rc == (valid_dev && valid_f ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM), "set_fraction(%d, %g): %d",
               (int)dev, f, rc);
    if (rc == ACL_SUCCESS) {
        double got = -1;
        FUZZ_CHECK(npualloc_cache_get_fraction(dev, &got) == ACL_SUCCESS && got == f, "get_fraction");
    }
    check_error_message();
}

static void op_settings(ops_state *st, bool raw)
{
    char text[48];
    if (raw) {
        size_t n = fuzz_u8(&st->in) % (sizeof text);
        for (size_t k = 0; k < n; k++)
            text[k] = (char)fuzz_u8(&st->in);
        text[n] = '\0';
        if (n == sizeof text - 1)
            text[n - 1] = '\0';
    } else {
        snprintf(text, sizeof text, "%s", runtime_confs[fuzz_u8(&st->in) % N_ELEMS(runtime_confs)]);
    }
    npualloc_allocator_settings before, after;
    memset(&before, 0, sizeof before);
    memset(&after, 0, sizeof after);
    FUZZ_CHECK(npualloc_cache_get_settings(&before) == ACL_SUCCESS, "get_settings");
    aclError rc = npualloc_cache_set_settings(text);
    OPS_TRACE("set_settings(\"%s\") -> %d", text, rc);
    FUZZ_CHECK(rc == ACL_SUCCESS || rc == ACL_ERROR_INVALID_PARAM, "set_settings(\"%s\"): %d", text, rc);
    FUZZ_CHECK(npualloc_cache_get_settings(&after) == ACL_SUCCESS, "get_settings");
    if (rc != ACL_SUCCESS) {
        check_error_message();
        /* a rejected text keeps what it set before its error, and c10's resets, as torch_npu does;
           the keys read only at start-up never change at run time */
        FUZZ_CHECK(before.base_addr_aligned_size == after.base_addr_aligned_size &&
                       before.page_size_1g == after.page_size_1g &&
                       before.multi_stream_lazy_reclaim == after.multi_stream_lazy_reclaim,
                   "a rejected settings text changed a start-up key");
    }
    char now[1024];
    size_t len = npualloc_cache_settings_text(now, sizeof now);
    FUZZ_CHECK(fuzz_terminated(now, sizeof now) && (len >= sizeof now || strlen(now) == len), "settings text");
    if (rc == ACL_SUCCESS) /* the text in effect is the one just set, whole */
        FUZZ_CHECK(len == strlen(text) && strncmp(now, text, sizeof now - 1) == 0, "the settings text in effect");
}

static void op_pool(ops_state *st)
{
    uint8_t what = fuzz_u8(&st->in);
    int32_t dev = pick_device(st);
    int p = fuzz_u8(&st->in) % OPS_POOLS;
    npualloc_mempool_id id = st->pools[p];
    bool valid_dev = dev >= 0 && dev < OPS_DEVICES;
    aclError rc;
    OPS_TRACE("pool op %d on device %d, pool %d (%llu, %llu)%s", what % 6, (int)dev, p,
              (unsigned long long)id.first, (unsigned long long)id.second, (what & 8) ? " by stream" : "");
    /* create and begin may make a pool that was forgotten again, without its no_split */
    if (valid_dev && st->no_split[dev][p] && (what % 6 == 0 || what % 6 == 2 || what % 6 == 3) &&
        pool_exists(st, dev, p) != 1)
        st->no_split[dev][p] = false;
    switch (what % 6) {
    case 0: /* create: we hold a reference */
        rc = npualloc_cache_pool_create(dev, id);
        FUZZ_CHECK(rc == (valid_dev ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM), "pool_create: %d", rc);
        if (rc == ACL_SUCCESS) {
            st->pool_refs[dev][p]++;
            st->made[dev][p] = true;
        }
        break;
    case 1: /* release one of our references (or one we never took: an error then) */
        rc = npualloc_cache_pool_release(dev, id);
        if (valid_dev && st->pool_refs[dev][p] > 0) {
            FUZZ_CHECK(rc == ACL_SUCCESS, "pool_release: %d", rc);
            st->pool_refs[dev][p]--;
        } else if (!valid_dev) {
            FUZZ_CHECK(rc == ACL_ERROR_INVALID_PARAM, "pool_release on device %d: %d", (int)dev, rc);
        } else if (rc == ACL_SUCCESS) {
            /* a route's reference: put it back, the route still holds it */
            FUZZ_CHECK(npualloc_cache_pool_create(dev, id) == ACL_SUCCESS, "pool_create");
        }
        break;
    case 2:
    case 3: { /* begin routing allocations to the pool */
        if (st->route_count == OPS_ROUTES || !valid_dev)
            return;
        bool by_stream = what & 8;
        uint64_t value = by_stream ? pick_stream(st, dev) : (uint64_t)pthread_self();
        bool recording = false; /* torch: one recording per pool, whatever the filter */
        for (int k = 0; k < st->route_count; k++)
            recording |= st->routes[k].device == dev && st->routes[k].id.first == id.first &&
                         st->routes[k].id.second == id.second;
        int uses = npualloc_cache_pool_use_count(dev, id);
        rc = npualloc_cache_pool_begin(dev, id, by_stream ? NPUALLOC_POOL_FILTER_STREAM : NPUALLOC_POOL_FILTER_THREAD,
                                       value);
        FUZZ_CHECK(rc == (recording ? ACL_ERROR_INVALID_PARAM : ACL_SUCCESS), "pool_begin (recording %d): %d",
                   (int)recording, rc);
        if (recording)
            FUZZ_CHECK(npualloc_cache_pool_use_count(dev, id) == uses, "a refused pool_begin took a reference");
        if (rc == ACL_SUCCESS) {
            st->routes[st->route_count++] =
                (route){id, dev, by_stream ? NPUALLOC_POOL_FILTER_STREAM : NPUALLOC_POOL_FILTER_THREAD, value};
            st->made[dev][p] = true;
        }
        break;
    }
    case 4: { /* end the newest route (or a pool with none: an error) */
        if (what & 0x10 || st->route_count == 0) {
            if (!valid_dev)
                return;
            bool routed = false;
            for (int k = 0; k < st->route_count; k++)
                routed |= st->routes[k].device == dev && st->routes[k].id.first == id.first &&
                          st->routes[k].id.second == id.second;
            if (routed)
                return;
            rc = npualloc_cache_pool_end(dev, id);
            FUZZ_CHECK(rc == ACL_ERROR_INVALID_PARAM, "pool_end without a route: %d", rc);
            return;
        }
        route r = st->routes[--st->route_count];
        rc = npualloc_cache_pool_end(r.device, r.id);
        FUZZ_CHECK(rc == ACL_SUCCESS, "pool_end: %d", rc);
        break;
    }
    default:
        rc = npualloc_cache_pool_empty(dev, id);
        FUZZ_CHECK(rc == (valid_dev ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM), "pool_empty: %d", rc);
        break;
    }
    if (valid_dev)
        FUZZ_CHECK(npualloc_cache_pool_use_count(dev, id) >= 0, "use_count");
    /* the default pool is no private pool */
    if (what == 0x55)
        FUZZ_CHECK(npualloc_cache_pool_create(0, (npualloc_mempool_id){0, 0}) == ACL_ERROR_INVALID_PARAM,
                   "pool_create((0, 0))");
}

/* MemPool(use_on_oom=...) and MemPool(no_split=...): mark or clear use_on_oom, set no_split.
 * Marking and no_split need a pool that exists on a valid device; clearing needs a valid device. */
static void op_pool_setting(ops_state *st)
{
    uint8_t what = fuzz_u8(&st->in);
    int32_t dev = pick_device(st);
    int p = fuzz_u8(&st->in) % OPS_POOLS;
    bool valid_dev = dev >= 0 && dev < OPS_DEVICES, default_id = (what & 0xf0) == 0xf0;
    npualloc_mempool_id id = default_id ? (npualloc_mempool_id){0, 0} : st->pools[p];
    int exists = 0; /* the default pool is no private pool */
    if (valid_dev && !default_id) {
        exists = pool_exists(st, dev, p);
        if (exists < 0 && (what & 4)) {
            /* settles it: emptying a pool nobody holds that owns no segment forgets it */
            FUZZ_CHECK(npualloc_cache_pool_empty(dev, id) == ACL_SUCCESS, "pool_empty");
            st->made[dev][p] = st->oom_marked[dev][p] = st->no_split[dev][p] = false;
            exists = 0;
        }
    }
    aclError rc;
    switch (what % 3) {
    case 0:
        rc = npualloc_cache_pool_set_use_on_oom(dev, id, true);
        break;
    case 1:
        rc = npualloc_cache_pool_set_use_on_oom(dev, id, false);
        break;
    default:
        rc = npualloc_cache_pool_set_no_split(dev, id);
        break;
    }
    OPS_TRACE("%s(device %d, pool %d (%llu, %llu)) -> %d (exists: %d)",
              what % 3 == 0 ? "use_on_oom" : what % 3 == 1 ? "clear use_on_oom" : "no_split", (int)dev,
              default_id ? -1 : p, (unsigned long long)id.first, (unsigned long long)id.second, rc, exists);
    if (!valid_dev)
        FUZZ_CHECK(rc == ACL_ERROR_INVALID_PARAM, "pool setting %d on device %d: %d", what % 3, (int)dev, rc);
    else if (what % 3 == 1) /* torch erases the id from a set: unknown ids too */
        FUZZ_CHECK(rc == ACL_SUCCESS, "clearing use_on_oom: %d", rc);
    else if (exists >= 0)
        FUZZ_CHECK(rc == (exists ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM), "pool setting %d (pool exists: %d): %d",
                   what % 3, exists, rc);
    else
        FUZZ_CHECK(rc == ACL_SUCCESS || rc == ACL_ERROR_INVALID_PARAM, "pool setting %d: %d", what % 3, rc);
    if (rc != ACL_SUCCESS) {
        check_error_message();
        if (valid_dev && !default_id) /* the pool was forgotten */
            st->made[dev][p] = st->oom_marked[dev][p] = st->no_split[dev][p] = false;
        return;
    }
    if (!valid_dev || default_id)
        return;
    if (what % 3 == 2)
        st->no_split[dev][p] = true;
    else
        st->oom_marked[dev][p] = what % 3 == 0;
    st->ever_marked[dev] |= st->oom_marked[dev][p];
}

static void op_streams(ops_state *st)
{
    uint8_t what = fuzz_u8(&st->in);
    int32_t d = what & 0x10 ? 1 : 0;
    uint64_t s = st->streams[d][(what >> 5) & 1];
    aclError rc;
    switch (what % 5) {
    case 0:
        rc = npualloc_sleep_async((aclrtStream)(uintptr_t)s, 0.0);
        break;
    case 1:
        rc = npualloc_sleep_async((aclrtStream)(uintptr_t)s, 0.0002);
        break;
    case 2:
        rc = aclrtSynchronizeStream((aclrtStream)(uintptr_t)s);
        break;
    case 3:
        rc = aclrtSetDevice(d);
        if (rc == ACL_SUCCESS)
            rc = aclrtSynchronizeDevice();
        break;
    default: {
        bool done = false;
        rc = npualloc_stream_query((aclrtStream)(uintptr_t)s, d, &done);
        break;
    }
    }
    OPS_TRACE("stream operation %d on %#llx (device %d) -> %d", what % 5, (unsigned long long)s, (int)d, rc);
    FUZZ_CHECK(rc == ACL_SUCCESS, "stream operation %d: %d", what % 5, rc);
}

static void op_stats(ops_state *st)
{
    uint8_t what = fuzz_u8(&st->in);
    int32_t dev = pick_device(st);
    bool valid_dev = dev >= 0 && dev < OPS_DEVICES;
    npualloc_stats s;
    aclError rc;
    OPS_TRACE("%s(device %d)", what % 3 == 0 ? "get_stats" : what % 3 == 1 ? "reset_peak" : "reset_accumulated",
              (int)dev);
    switch (what % 3) {
    case 0:
        rc = npualloc_cache_get_stats(dev, &s);
        if (rc == ACL_SUCCESS) {
            FUZZ_CHECK(s.allocated_bytes[0].current >= 0 && s.reserved_bytes[0].current >= 0 &&
                           s.allocated_bytes[0].current <= s.reserved_bytes[0].current &&
                           s.allocated_bytes[0].peak >= s.allocated_bytes[0].current &&
                           (uint64_t)s.reserved_bytes[0].current <= st->device_memory,
                       "stats out of range");
            size_t live = 0;
            for (int i = 0; i < OPS_SLOTS; i++)
                live += st->slots[i].ptr && st->slots[i].device == dev;
            FUZZ_CHECK((size_t)s.allocation[0].current == live, "%lld allocations, %zu live",
                       (long long)s.allocation[0].current, live);
        }
        break;
    case 1:
        rc = npualloc_cache_reset_peak(dev);
        break;
    default:
        rc = npualloc_cache_reset_accumulated(dev);
        break;
    }
    FUZZ_CHECK(rc == (valid_dev ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM), "stats operation on device %d: %d",
               (int)dev, rc);
}

static void op_history(ops_state *st)
{
    uint8_t what = fuzz_u8(&st->in);
    OPS_TRACE("record_history(%d, %d, %d)", what & 1, (what >> 1) & 3, what >> 3);
    aclError rc = npualloc_cache_record_history(what & 1, (npualloc_record_context)((what >> 1) & 3),
                                                (size_t)(what >> 3));
    FUZZ_CHECK(rc == ACL_SUCCESS, "record_history: %d", rc);
}

static void op_empty(ops_state *st, bool virt)
{
    (void)st;
    OPS_TRACE("%s", virt ? "empty_virt_addr_cache" : "empty_cache");
    aclError rc;
    if (virt) {
        npualloc_allocator_settings s;
        FUZZ_CHECK(npualloc_cache_get_settings(&s) == ACL_SUCCESS, "get_settings");
        rc = npualloc_cache_empty_virt_addr_cache();
        FUZZ_CHECK(rc == (s.expandable_segments ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM),
                   "empty_virt_addr_cache: %d", rc);
    } else {
        rc = npualloc_cache_empty();
        FUZZ_CHECK(rc == ACL_SUCCESS, "empty_cache: %d", rc);
    }
}

/* ---- one input ---- */

static void start(ops_state *st, uint8_t conf, uint8_t mem)
{
    memset(st, 0, sizeof *st);
    npualloc_shutdown();
    const char *text = startup_confs[conf % N_ELEMS(startup_confs)];
    if (text)
        setenv("PYTORCH_NPU_ALLOC_CONF", text, 1);
    else
        unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
    unsetenv("PYTORCH_NO_NPU_MEMORY_CACHING");
    st->device_memory = (40 + (size_t)(mem % 4) * 20) * MiB;
    npualloc_config c = {OPS_DEVICES, st->device_memory, st->device_memory, 0, 0};
    char err[256];
    FUZZ_CHECK(npualloc_configure(&c, err, sizeof err) == ACL_SUCCESS, "configure: %s", err);
    for (int32_t d = 0; d < OPS_DEVICES; d++) {
        FUZZ_CHECK(aclrtSetDevice(d) == ACL_SUCCESS, "set_device");
        for (int k = 0; k < OPS_STREAMS; k++) {
            aclrtStream s;
            FUZZ_CHECK(aclrtCreateStream(&s) == ACL_SUCCESS, "create_stream");
            st->streams[d][k] = (uint64_t)(uintptr_t)s;
        }
    }
    FUZZ_CHECK(aclrtSetDevice(0) == ACL_SUCCESS, "set_device");
    for (int p = 0; p < OPS_POOLS; p++)
        st->pools[p] = npualloc_mempool_id_new(p != 1);
    /* The last pool has its own allocator on both devices; we hold that reference (a release may
     * drop it, and the pool is then made again without one by a later create or route). */
    pool_allocator_live = 0;
    for (int32_t d = 0; d < OPS_DEVICES; d++) {
        FUZZ_CHECK(npualloc_cache_pool_create_with_allocator(d, st->pools[OPS_POOLS - 1], pool_allocator_alloc,
                                                             pool_allocator_free) == ACL_SUCCESS,
                   "pool_create_with_allocator");
        st->pool_refs[d][OPS_POOLS - 1] = 1;
        st->made[d][OPS_POOLS - 1] = true;
    }
}

static void finish(ops_state *st)
{
    for (int i = 0; i < OPS_SLOTS; i++) {
        slot *s = &st->slots[i];
        if (!s->ptr)
            continue;
        verify(s);
        FUZZ_CHECK(npualloc_cache_free_ctx(s->ptr, NULL) == ACL_SUCCESS, "final free");
        npualloc_context_release(s->ctx);
        memset(s, 0, sizeof *s);
    }
    while (st->route_count > 0) {
        route r = st->routes[--st->route_count];
        FUZZ_CHECK(npualloc_cache_pool_end(r.device, r.id) == ACL_SUCCESS, "final pool_end");
    }
    for (int d = 0; d < OPS_DEVICES; d++)
        for (int p = 0; p < OPS_POOLS; p++)
            for (; st->pool_refs[d][p] > 0; st->pool_refs[d][p]--)
                FUZZ_CHECK(npualloc_cache_pool_release(d, st->pools[p]) == ACL_SUCCESS, "final pool_release");
    FUZZ_CHECK(npualloc_cache_empty() == ACL_SUCCESS, "final empty_cache");
    check_devices("the final empty_cache");
    FUZZ_CHECK(pool_allocator_live == 0, "%ld segments of the pool's allocator were not given back",
               pool_allocator_live);
    for (int32_t d = 0; d < OPS_DEVICES; d++) {
        npualloc_stats s;
        FUZZ_CHECK(npualloc_cache_get_stats(d, &s) == ACL_SUCCESS, "stats");
        FUZZ_CHECK(s.allocated_bytes[0].current == 0 && s.active_bytes[0].current == 0,
                   "device %d: %lld bytes still allocated, %lld active", (int)d,
                   (long long)s.allocated_bytes[0].current, (long long)s.active_bytes[0].current);
        FUZZ_CHECK(s.reserved_bytes[0].current == 0, "device %d: %lld bytes still reserved after empty_cache",
                   (int)d, (long long)s.reserved_bytes[0].current);
        size_t free_b = 0, total = 0;
        FUZZ_CHECK(aclrtSetDevice(d) == ACL_SUCCESS && aclrtGetMemInfo(ACL_HBM_MEM, &free_b, &total) == ACL_SUCCESS,
                   "get_mem_info");
        FUZZ_CHECK(free_b == total, "device %d: %zu of %zu bytes free after empty_cache", (int)d, free_b, total);
    }
    npualloc_shutdown();
    npualloc_vmm_counts counts;
    npualloc_vmm_counts_get(&counts);
    FUZZ_CHECK(counts.physical_handles == 0 && counts.mappings == 0 && counts.reservations == 0,
               "after shutdown: %zu handles, %zu mappings, %zu reservations", counts.physical_handles,
               counts.mappings, counts.reservations);
}

int fuzz_ops_one(const uint8_t *data, size_t size)
{
    static ops_state st;
    if (size < 2)
        return 0;
    OPS_TRACE("start: PYTORCH_NPU_ALLOC_CONF=%s, %zu MiB per device",
              startup_confs[data[0] % N_ELEMS(startup_confs)] ? startup_confs[data[0] % N_ELEMS(startup_confs)] : "(unset)",
              (40 + (size_t)(data[1] % 4) * 20));
    start(&st, data[0], data[1]);
    st.in = (fuzz_in){data, size, 2};
    for (int step = 0; step < OPS_MAX_STEPS && fuzz_more(&st.in); step++) {
        uint8_t op = fuzz_u8(&st.in);
        switch (op % 26) {
        case 0: case 1: case 2: case 3: case 4:
            op_malloc(&st, false);
            break;
        case 5:
            op_malloc(&st, true);
            break;
        case 6: case 7: case 8: case 9:
            op_free(&st);
            break;
        case 10:
            op_bad_free(&st);
            break;
        case 11:
            op_record_stream(&st, false);
            break;
        case 12:
            op_record_stream(&st, true);
            break;
        case 13:
            op_empty(&st, false);
            break;
        case 14:
            op_empty(&st, true);
            break;
        case 15:
            op_fraction(&st);
            break;
        case 16:
            op_settings(&st, false);
            break;
        case 17:
            op_settings(&st, true);
            break;
        case 18: case 19:
            op_pool(&st);
            break;
        case 20:
            op_streams(&st);
            break;
        case 21:
            op_stats(&st);
            break;
        case 22:
            OPS_TRACE("snapshot");
            check_snapshot(&st);
            break;
        case 23:
            op_history(&st);
            break;
        case 24:
            check_all_slots(&st);
            break;
        default: /* a wasted byte: lets mutations shift operands */
            /* but two of its values, which no regression input uses as an op (they keep their
             * meaning), set a pool's use_on_oom or no_split */
            if (op == 25 + 4 * 26 || op == 25 + 5 * 26)
                op_pool_setting(&st);
            break;
        }
        check_devices("an operation");
    }
    check_all_slots(&st);
    OPS_TRACE("use_on_oom fallbacks: %ld", st.oom_fallbacks);
    finish(&st);
    return 0;
}

#ifndef NPUALLOC_FUZZ_NO_ENTRY
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) { return fuzz_ops_one(data, size); }
FUZZ_ASAN_DEFAULT_OPTIONS
#endif
