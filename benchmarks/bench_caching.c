/*
 * bench_caching.c - the caching allocator's hot path: a cache-hit npualloc_cache_malloc +
 * npualloc_cache_free pair, and how it grows with the number of live blocks held.
 *
 *   bench_caching [--json]
 *
 * Prints ns per pair (median of 5 repetitions); --json prints one JSON object per line instead.
 * No targets here: benchmarks/run.py (make bench) compares them with the targets.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "npualloc.h"

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

/* ns per alloc+free pair of `size` bytes, with the cache warm. */
static double pair_ns(size_t size, long pairs)
{
    double reps[5];
    for (int r = 0; r < 5; r++) {
        double t0 = now_ns();
        for (long i = 0; i < pairs; i++) {
            void *p;
            npualloc_cache_malloc(0, size, 0, &p);
            npualloc_cache_free(p);
        }
        reps[r] = (now_ns() - t0) / (double)pairs;
    }
    qsort(reps, 5, sizeof reps[0], cmp_double);
    return reps[2];
}

int main(int argc, char **argv)
{
    int json = argc > 1 && strcmp(argv[1], "--json") == 0;
    npualloc_config cfg = {1, (uint64_t)64 << 30, (uint64_t)64 << 30, 0, 0};
    char err[256];
    if (npualloc_configure(&cfg, err, sizeof err) != ACL_SUCCESS) {
        fprintf(stderr, "configure: %s\n", err);
        return 1;
    }
    void *warm;
    npualloc_cache_malloc(0, 4096, 0, &warm);
    npualloc_cache_free(warm);
    if (!json)
        printf("%-44s %12s\n", "caching allocator (C)", "ns/pair");
    static const size_t sizes[] = {512, 4096, 1 << 20, 8 << 20, 64 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        double ns = pair_ns(sizes[i], 200000);
        char label[64];
        snprintf(label, sizeof label, "cache-hit pair, %zu bytes", sizes[i]);
        if (json)
            printf("{\"bench\":\"caching\",\"what\":\"cache-hit pair\",\"size\":%zu,\"ns_per_pair\":%.2f}\n",
                   sizes[i], ns);
        else
            printf("%-44s %12.1f\n", label, ns);
    }
    /* Growth with live blocks: hold N small blocks, then time pairs of the same size. */
    static const long live_counts[] = {1000, 10000, 100000, 1000000};
    double base = 0;
    void **held = malloc(sizeof(void *) * 1000000);
    long held_n = 0;
    for (size_t k = 0; k < sizeof live_counts / sizeof live_counts[0]; k++) {
        while (held_n < live_counts[k])
            npualloc_cache_malloc(0, 512, 0, &held[held_n++]);
        double ns = pair_ns(512, 200000);
        if (k == 0)
            base = ns;
        char label[64];
        snprintf(label, sizeof label, "pair with %ld live blocks", live_counts[k]);
        if (json)
            printf("{\"bench\":\"caching\",\"what\":\"live blocks\",\"live\":%ld,\"ns_per_pair\":%.2f}\n",
                   live_counts[k], ns);
        else
            printf("%-44s %12.1f   (x%.2f of 1k)\n", label, ns, ns / base);
    }
    for (long i = 0; i < held_n; i++)
        npualloc_cache_free(held[i]);
    free(held);
    npualloc_shutdown();
    return 0;
}
