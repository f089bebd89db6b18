/*
 * bench_hotpath.c - the caching allocator's hot path next to the host allocators.
 *
 *   bench_hotpath [EVENTS_FILE] [--json] [--only ALLOCATOR] [--trace-only]
 *
 * 1. Trace: the alloc/free stream of a recorded PyTorch run (EVENTS_FILE, written by
 *    `python -m npualloc replay TRACE --export-events FILE`), sizes and order kept, on one
 *    stream.  A warm-up pass fills the caches, so the timed passes are all cache hits.
 * 2. Synthetic: a mix of small sizes (16 B .. 64 KiB) over 1000 slots, pseudo-random frees.
 *
 * Each workload runs through npualloc's C caching allocator and, in the same process and run,
 * through glibc malloc, jemalloc and mimalloc (loaded with dlopen when installed).  Nobody
 * touches the memory: this measures the allocators' bookkeeping only.  Prints ns per
 * alloc+free pair (median of 5 passes after a warm-up) and the ratio to each peer.  --trace-only skips the
 * synthetic workload.  --only runs one allocator
 * (npualloc, glibc, jemalloc or mimalloc), for profiling it alone.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "npualloc.h"

typedef struct allocator {
    const char *name;
    void *(*alloc)(size_t);
    void (*release)(void *);
} allocator;

static void *npu_alloc(size_t size)
{
    void *p = NULL;
    npualloc_cache_malloc(0, size, 0, &p);
    return p;
}

static void npu_free(void *p) { npualloc_cache_free(p); }

/* One step of a workload: allocate `size` into slot, or free the slot. */
typedef struct op {
    uint32_t slot;
    uint32_t is_free;
    uint64_t size;
} op;

typedef struct workload {
    const char *name;
    op *ops;
    size_t count, allocs, slots;
} workload;

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One pass: returns ns for the ops; frees what is still live afterwards (not timed). */
static double run_pass(const allocator *a, const workload *w, void **live)
{
    double t0 = now_ns();
    for (size_t i = 0; i < w->count; i++) {
        const op *o = &w->ops[i];
        if (o->is_free) {
            a->release(live[o->slot]);
            live[o->slot] = NULL;
        } else {
            live[o->slot] = a->alloc(o->size);
        }
    }
    double t = now_ns() - t0;
    for (size_t s = 0; s < w->slots; s++) {
        if (live[s]) {
            a->release(live[s]);
            live[s] = NULL;
        }
    }
    return t;
}

/* Timed passes after the warm-up; the JSON tells how many passes ran (count_hotpath.py divides by it). */
#define TIMED_PASSES 5

static double pair_ns(const allocator *a, const workload *w)
{
    void **live = calloc(w->slots, sizeof *live);
    run_pass(a, w, live); /* warm-up: fills the caches */
    double reps[TIMED_PASSES];
    for (int r = 0; r < TIMED_PASSES; r++)
        reps[r] = run_pass(a, w, live) / (double)w->allocs;
    free(live);
    qsort(reps, TIMED_PASSES, sizeof reps[0], cmp_double);
    return reps[TIMED_PASSES / 2];
}

/* ---- workloads ---- */

/* Reads the replay export (see npualloc/replay.py export_events) into alloc/free ops. */
static int load_trace(const char *path, workload *w)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    char magic[8];
    uint64_t n = 0, prefix = 0;
    int ok = fread(magic, 1, 8, f) == 8 && memcmp(magic, "NPUREPL1", 8) == 0 && fread(&n, 8, 1, f) == 1 &&
             fread(&prefix, 8, 1, f) == 1 && n < (1u << 28);
    uint8_t *action = ok ? malloc(n + 8) : NULL;
    uint64_t *addr = ok ? malloc(n * 8 + 8) : NULL, *size = ok ? malloc(n * 8 + 8) : NULL;
    uint64_t *stream = ok ? malloc(n * 8 + 8) : NULL;
    size_t padded = (size_t)((n + 7) / 8 * 8);
    ok = ok && action && addr && size && stream && fread(action, 1, padded, f) == padded &&
         fread(addr, 8, n, f) == n && fread(size, 8, n, f) == n && fread(stream, 8, n, f) == n;
    fclose(f);
    if (!ok) {
        free(action);
        free(addr);
        free(size);
        free(stream);
        return -1;
    }
    /* Map trace addresses to slots (open addressing; setup, not timed). */
    size_t cap = 1;
    while (cap < 4 * n)
        cap <<= 1;
    uint64_t *keys = calloc(cap, 8);
    uint32_t *vals = calloc(cap, 4);
    w->ops = malloc(sizeof *w->ops * (n + 1));
    w->count = w->allocs = w->slots = 0;
    uint32_t *free_slots = malloc(4 * (n + 1));
    size_t free_top = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t key = addr[i] | 1; /* never 0 */
        size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
        while (keys[h] && keys[h] != key)
            h = (h + 1) & (cap - 1);
        if (action[i] == 0) { /* alloc */
            uint32_t slot = free_top ? free_slots[--free_top] : (uint32_t)w->slots++;
            keys[h] = key;
            vals[h] = slot;
            w->ops[w->count++] = (op){slot, 0, size[i]};
            w->allocs++;
        } else if (keys[h] == key) { /* free of a live trace address */
            uint32_t slot = vals[h];
            w->ops[w->count++] = (op){slot, 1, 0};
            free_slots[free_top++] = slot;
            /* delete with backward shift */
            size_t hole = h;
            for (size_t j = (h + 1) & (cap - 1); keys[j]; j = (j + 1) & (cap - 1)) {
                size_t home = (size_t)((keys[j] * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1);
                if (((j - home) & (cap - 1)) >= ((j - hole) & (cap - 1))) {
                    keys[hole] = keys[j];
                    vals[hole] = vals[j];
                    hole = j;
                }
            }
            keys[hole] = 0;
        }
    }
    free(keys);
    free(vals);
    free(free_slots);
    free(action);
    free(addr);
    free(size);
    free(stream);
    return 0;
}

static void synthetic(workload *w)
{
    enum { SLOTS = 1000, OPS = 400000 };
    w->ops = malloc(sizeof *w->ops * OPS);
    w->count = w->allocs = 0;
    w->slots = SLOTS;
    static uint8_t live[SLOTS];
    uint64_t x = 0x2545F4914F6CDD1Dull;
    while (w->count < OPS) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        uint32_t slot = (uint32_t)(x % SLOTS);
        if (live[slot]) {
            w->ops[w->count++] = (op){slot, 1, 0};
            live[slot] = 0;
        } else {
            /* sizes skewed small: 16 B .. 64 KiB */
            uint64_t size = 16u << ((x >> 32) % 13);
            size += (x >> 40) % size;
            w->ops[w->count++] = (op){slot, 0, size};
            w->allocs++;
            live[slot] = 1;
        }
    }
}

/* ---- peers ---- */

static char **saved_argv;

static int load_peer(allocator *a, const char *name, const char *lib, const char *alloc_sym, const char *free_sym)
{
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h && strstr(dlerror(), "static TLS") && !getenv("NPUALLOC_BENCH_REEXEC")) {
        /* jemalloc uses initial-exec TLS: glibc needs more static TLS room to dlopen it. */
        setenv("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=16384", 1);
        setenv("NPUALLOC_BENCH_REEXEC", "1", 1);
        execv("/proc/self/exe", saved_argv);
    }
    if (!h)
        return -1;
    a->name = name;
    a->alloc = (void *(*)(size_t))dlsym(h, alloc_sym);
    a->release = (void (*)(void *))dlsym(h, free_sym);
    return a->alloc && a->release ? 0 : -1;
}

int main(int argc, char **argv)
{
    const char *events = NULL, *only = NULL;
    int trace_only = 0;
    int json = 0;
    saved_argv = argv;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = 1;
        else if (strcmp(argv[i], "--trace-only") == 0)
            trace_only = 1;
        else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc)
            only = argv[++i];
        else if (argv[i][0] == '-' || events) {
            fprintf(stderr, "usage: bench_hotpath [EVENTS_FILE] [--json] [--only ALLOCATOR] [--trace-only]\n");
            return 2;
        } else
            events = argv[i];
    }
    if (trace_only && !events) {
        fprintf(stderr, "bench_hotpath: --trace-only needs an EVENTS file\n");
        return 2;
    }
    npualloc_config cfg = {1, (uint64_t)80 << 30, (uint64_t)80 << 30, 0, 0};
    char err[256];
    if (npualloc_configure(&cfg, err, sizeof err) != ACL_SUCCESS) {
        fprintf(stderr, "configure: %s\n", err);
        return 1;
    }
    allocator peers[4];
    int npeers = 0;
    peers[npeers++] = (allocator){"npualloc", npu_alloc, npu_free};
    peers[npeers++] = (allocator){"glibc", malloc, free};
    if ((!only || strcmp(only, "jemalloc") == 0) &&
        load_peer(&peers[npeers], "jemalloc", "libjemalloc.so.2", "malloc", "free") == 0)
        npeers++;
    if ((!only || strcmp(only, "mimalloc") == 0) &&
        load_peer(&peers[npeers], "mimalloc", "libmimalloc.so.2", "mi_malloc", "mi_free") == 0)
        npeers++;
    if (only) {
        int keep = -1;
        for (int p = 0; p < npeers; p++)
            if (strcmp(peers[p].name, only) == 0)
                keep = p;
        if (keep < 0) {
            fprintf(stderr, "bench_hotpath: allocator %s is not available\n", only);
            return 1;
        }
        peers[0] = peers[keep];
        npeers = 1;
    }

    workload loads[2];
    int nloads = 0;
    if (events && load_trace(events, &loads[nloads]) != 0) {
        fprintf(stderr, "bench_hotpath: cannot read %s (an events file, as benchmarks/run.py exports)\n", events);
        return 1;
    }
    if (events)
        loads[nloads++].name = "trace";
    if (!trace_only) {
        synthetic(&loads[nloads]);
        loads[nloads].name = "synthetic-small";
        nloads++;
    }

    if (!json)
        printf("%-16s %-10s %12s %12s\n", "workload", "allocator", "ns/pair", "npualloc/x");
    for (int l = 0; l < nloads; l++) {
        double ns[4];
        for (int p = 0; p < npeers; p++)
            ns[p] = pair_ns(&peers[p], &loads[l]);
        for (int p = 0; p < npeers; p++) {
            if (json)
                printf("{\"bench\":\"hotpath\",\"workload\":\"%s\",\"allocator\":\"%s\",\"ns_per_pair\":%.2f,"
                       "\"pairs\":%zu,\"passes\":%d}\n",
                       loads[l].name, peers[p].name, ns[p], loads[l].allocs, 1 + TIMED_PASSES);
            else
                printf("%-16s %-10s %12.1f %12.2f\n", loads[l].name, peers[p].name, ns[p], ns[0] / ns[p]);
        }
        free(loads[l].ops);
    }
    npualloc_shutdown();
    return 0;
}
