/*
 * bench_runtime.c - latency and bandwidth of npualloc's runtime layer (the aclrt* calls).
 *
 * Each line runs one operation in a loop.  The loop count is calibrated first so that one
 * repetition takes about 70 ms; the line reports the median of 5 repetitions as nanoseconds
 * per operation (and GB/s for the copy).  Absolute numbers of this machine; no targets.
 *
 * Build and run: `make bench` (all benchmarks), or
 *   make build/release/bench/bench_runtime && build/release/bench/bench_runtime
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "acl_rt.h"
#include "npualloc.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((uint64_t)1 << 30)

#define REPS 5
#define TARGET_NS 70000000.0 /* one repetition: ~70 ms, inside the 50-100 ms window */
#define MIN_REP_NS 50000000u
#define MAX_REP_NS 100000000u
#define CALIBRATE_NS 5000000 /* grow the trial count until a trial takes this long */

#define CHECK(call)                                                                                          \
    do {                                                                                                     \
        aclError rc_ = (call);                                                                               \
        if (rc_ != ACL_SUCCESS) {                                                                            \
            fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #call, rc_);                      \
            exit(1);                                                                                         \
        }                                                                                                    \
    } while (0)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* One benchmark: `run` performs `n` operations and returns the nanoseconds they took (it may
 * leave set-up and clean-up outside the timed part). */
typedef uint64_t (*bench_fn)(void *ctx, size_t n);

typedef struct result {
    size_t ops;   /* per repetition */
    double ns_op; /* median */
    double ms_rep; /* median duration of a repetition */
} result;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static size_t scale_ops(size_t n, uint64_t t)
{
    double ops = TARGET_NS * (double)n / (double)(t ? t : 1);
    return ops < 1.0 ? 1 : (size_t)ops;
}

static result measure(bench_fn run, void *ctx)
{
    (void)run(ctx, 1); /* warm-up: first-use costs (worker thread start, page faults) */
    /* Calibrate: double n until one trial is long enough to time, scale to the target, and
     * rescale until a trial lands in the 50-100 ms window (a few tries at most). */
    size_t n = 1;
    uint64_t t = run(ctx, n);
    while (t < CALIBRATE_NS && n < ((size_t)1 << 30)) {
        n *= 2;
        t = run(ctx, n);
    }
    size_t ops = scale_ops(n, t);
    for (int i = 0; i < 3; i++) {
        t = run(ctx, ops);
        if ((t >= MIN_REP_NS && t <= MAX_REP_NS) || (ops == 1 && t > MAX_REP_NS))
            break;
        ops = scale_ops(ops, t);
    }
    double per_op[REPS], per_rep[REPS];
    for (int i = 0; i < REPS; i++) {
        uint64_t rt = run(ctx, ops);
        per_op[i] = (double)rt / (double)ops;
        per_rep[i] = (double)rt / 1e6;
    }
    qsort(per_op, REPS, sizeof per_op[0], cmp_double);
    qsort(per_rep, REPS, sizeof per_rep[0], cmp_double);
    return (result){.ops = ops, .ns_op = per_op[REPS / 2], .ms_rep = per_rep[REPS / 2]};
}

/* ---- the operations ---- */

typedef struct malloc_ctx {
    size_t size;
} malloc_ctx;

static uint64_t run_malloc_free(void *ctx, size_t n)
{
    size_t size = ((malloc_ctx *)ctx)->size;
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n; i++) {
        void *p = NULL;
        CHECK(aclrtMalloc(&p, size, ACL_MEM_MALLOC_HUGE_FIRST));
        CHECK(aclrtFree(p));
    }
    return now_ns() - t0;
}

static aclrtPhysicalMemProp hbm_huge_prop(void)
{
    aclrtPhysicalMemProp p;
    memset(&p, 0, sizeof p);
    p.handleType = ACL_MEM_HANDLE_TYPE_NONE;
    p.allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED;
    p.memAttr = ACL_HBM_MEM_HUGE;
    p.location.id = 0;
    p.location.type = ACL_MEM_LOCATION_TYPE_DEVICE;
    return p;
}

static uint64_t run_physical(void *ctx, size_t n)
{
    (void)ctx;
    aclrtPhysicalMemProp prop = hbm_huge_prop();
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n; i++) {
        aclrtDrvMemHandle h = NULL;
        CHECK(aclrtMallocPhysical(&h, 2 * MiB, &prop, 0));
        CHECK(aclrtFreePhysical(h));
    }
    return now_ns() - t0;
}

typedef struct map_ctx {
    void *va;
    size_t size;
    aclrtDrvMemHandle handle;
} map_ctx;

static uint64_t run_map_unmap(void *ctx, size_t n)
{
    map_ctx *m = ctx;
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n; i++) {
        CHECK(aclrtMapMem(m->va, m->size, 0, m->handle, 0));
        CHECK(aclrtUnmapMem(m->va));
    }
    return now_ns() - t0;
}

typedef struct copy_ctx {
    void *dev;
    void *host;
    size_t size;
    bool to_host; /* device-to-host instead of host-to-device */
} copy_ctx;

static uint64_t run_memcpy(void *ctx, size_t n)
{
    copy_ctx *c = ctx;
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n; i++) {
        if (c->to_host)
            CHECK(aclrtMemcpy(c->host, c->size, c->dev, c->size, ACL_MEMCPY_DEVICE_TO_HOST));
        else
            CHECK(aclrtMemcpy(c->dev, c->size, c->host, c->size, ACL_MEMCPY_HOST_TO_DEVICE));
    }
    return now_ns() - t0;
}

typedef struct stream_ctx {
    aclrtStream stream;
    aclrtEvent event;
} stream_ctx;

static uint64_t run_event_round_trip(void *ctx, size_t n)
{
    stream_ctx *s = ctx;
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n; i++) {
        CHECK(aclrtRecordEvent(s->event, s->stream));
        CHECK(aclrtSynchronizeEvent(s->event));
    }
    return now_ns() - t0;
}

static uint64_t run_libc_memcpy(void *ctx, size_t n)
{
    copy_ctx *c = ctx;
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n; i++) {
        memcpy(c->dev, c->host, c->size);
        __asm__ __volatile__("" : : "r"(c->dev) : "memory"); /* keep every copy */
    }
    return now_ns() - t0;
}

static void empty_callback(void *user_data) { (void)user_data; }

/* Caller-side cost of queueing a task (an empty callback; no thread subscribed, so the worker
 * runs it).  The drain afterwards is not timed. */
static uint64_t run_enqueue(void *ctx, size_t n)
{
    stream_ctx *s = ctx;
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n; i++)
        CHECK(aclrtLaunchCallback(empty_callback, NULL, ACL_CALLBACK_NO_BLOCK, s->stream));
    uint64_t t = now_ns() - t0;
    CHECK(aclrtSynchronizeStream(s->stream));
    return t;
}

/* ---- the table ---- */

static void print_line(const char *name, result r, const char *extra)
{
    printf("%-46s %10zu %8.1f %14.1f%s%s\n", name, r.ops, r.ms_rep, r.ns_op, extra ? "   " : "", extra ? extra : "");
    fflush(stdout);
}

int main(void)
{
    uint64_t start = now_ns();
    npualloc_config cfg = {
        .device_count = 1, .device_memory = 64 * GiB, .huge_memory = 64 * GiB, .huge1g_memory = 0, .ddr_memory = 0};
    char err[256] = "";
    aclError rc = npualloc_configure(&cfg, err, sizeof err);
    if (rc != ACL_SUCCESS) {
        fprintf(stderr, "npualloc_configure failed: %d %s\n", rc, err);
        return 1;
    }
    CHECK(aclrtSetDevice(0));

    printf("npualloc bench_runtime: 1 device, 64 GiB HBM; median of %d repetitions of ~%.0f ms\n", REPS,
           TARGET_NS / 1e6);
    printf("%-46s %10s %8s %14s\n", "operation", "ops/rep", "ms/rep", "ns/op");

    static const struct {
        const char *name;
        size_t size;
    } mallocs[] = {{"aclrtMalloc+aclrtFree 4 KiB (HUGE_FIRST)", 4 * KiB},
                   {"aclrtMalloc+aclrtFree 2 MiB (HUGE_FIRST)", 2 * MiB},
                   {"aclrtMalloc+aclrtFree 64 MiB (HUGE_FIRST)", 64 * MiB}};
    for (size_t i = 0; i < sizeof mallocs / sizeof mallocs[0]; i++) {
        malloc_ctx m = {.size = mallocs[i].size};
        print_line(mallocs[i].name, measure(run_malloc_free, &m), NULL);
    }

    print_line("aclrtMallocPhysical+aclrtFreePhysical 2 MiB", measure(run_physical, NULL), NULL);

    static const struct {
        const char *name;
        size_t size;
    } maps[] = {{"aclrtMapMem+aclrtUnmapMem 2 MiB", 2 * MiB}, {"aclrtMapMem+aclrtUnmapMem 20 MiB", 20 * MiB}};
    for (size_t i = 0; i < sizeof maps / sizeof maps[0]; i++) {
        map_ctx m = {.size = maps[i].size};
        aclrtPhysicalMemProp prop = hbm_huge_prop();
        CHECK(aclrtReserveMemAddress(&m.va, m.size, 0, NULL, 0));
        CHECK(aclrtMallocPhysical(&m.handle, m.size, &prop, 0));
        print_line(maps[i].name, measure(run_map_unmap, &m), NULL);
        CHECK(aclrtFreePhysical(m.handle));
        CHECK(aclrtReleaseMemAddress(m.va));
    }

    /* aclrtMemcpy between device memory and plain (malloc) host memory, both directions, large
     * and small, and with aclrtMallocHost memory. */
    static const struct {
        const char *name;
        size_t size;
        bool to_host, pinned;
    } copies[] = {{"aclrtMemcpy 64 MiB host-to-device", 64 * MiB, false, false},
                  {"aclrtMemcpy 64 MiB device-to-host", 64 * MiB, true, false},
                  {"aclrtMemcpy 4 KiB host-to-device", 4 * KiB, false, false},
                  {"aclrtMemcpy 4 KiB device-to-host", 4 * KiB, true, false},
                  {"aclrtMemcpy 64 MiB aclrtMallocHost-to-device", 64 * MiB, false, true},
                  {"aclrtMemcpy 4 KiB aclrtMallocHost-to-device", 4 * KiB, false, true}};
    for (size_t i = 0; i < sizeof copies / sizeof copies[0]; i++) {
        copy_ctx c = {.size = copies[i].size, .to_host = copies[i].to_host};
        CHECK(aclrtMalloc(&c.dev, c.size, ACL_MEM_MALLOC_HUGE_FIRST));
        if (copies[i].pinned)
            CHECK(aclrtMallocHost(&c.host, c.size));
        else if (!(c.host = malloc(c.size))) {
            fprintf(stderr, "out of host memory\n");
            return 1;
        }
        memset(c.host, 0x5a, c.size); /* touch every page first: no page faults while timing */
        CHECK(aclrtMemcpy(c.dev, c.size, c.host, c.size, ACL_MEMCPY_HOST_TO_DEVICE));
        result r = measure(run_memcpy, &c);
        char extra[64];
        snprintf(extra, sizeof extra, "%.2f GB/s", (double)c.size / r.ns_op);
        print_line(copies[i].name, r, extra);
        if (copies[i].pinned)
            CHECK(aclrtFreeHost(c.host));
        else
            free(c.host);
        CHECK(aclrtFree(c.dev));
    }
    {
        /* Reference: the same bytes with libc memcpy, host to host. */
        copy_ctx h = {.size = 64 * MiB, .host = malloc(64 * MiB), .dev = malloc(64 * MiB)};
        if (!h.host || !h.dev) {
            fprintf(stderr, "out of host memory\n");
            return 1;
        }
        memset(h.host, 0x5a, h.size);
        memset(h.dev, 0, h.size);
        result r = measure(run_libc_memcpy, &h);
        char extra[64];
        snprintf(extra, sizeof extra, "%.2f GB/s", (double)h.size / r.ns_op);
        print_line("  reference: libc memcpy 64 MiB host-to-host", r, extra);
        free(h.dev);
        free(h.host);
    }

    {
        stream_ctx s;
        CHECK(aclrtCreateStream(&s.stream));
        CHECK(aclrtCreateEvent(&s.event));
        CHECK(aclrtSynchronizeStream(s.stream)); /* worker started by the first task below */
        print_line("event record+synchronize round trip", measure(run_event_round_trip, &s), NULL);
        print_line("stream task enqueue (aclrtLaunchCallback)", measure(run_enqueue, &s), NULL);
        CHECK(aclrtDestroyEvent(s.event));
        CHECK(aclrtDestroyStream(s.stream));
    }

    CHECK(aclrtResetDevice(0));
    printf("total %.1f s\n", (double)(now_ns() - start) / 1e9);
    return 0;
}
