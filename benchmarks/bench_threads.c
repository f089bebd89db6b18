/*
 * bench_threads.c - caching-allocator throughput with several threads.
 *
 *   bench_threads [--json]
 *
 * Each thread runs cache-hit alloc+free pairs (mixed small sizes) for a fixed time.  Prints
 * pairs/s for 1, 2 and 4 threads: all on one stream of one device, on different streams of one
 * device, and on different devices (one lock each); speed-ups are medians of per-round ratios.
 * Fairness: the slowest thread's pairs over the mean thread's (1.00 when all got the same share of
 * the lock), the lowest of the rounds.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "npualloc.h"

#define RUN_NS 200000000.0 /* 0.2 s per measurement */
#define ROUNDS 5

typedef struct worker {
    pthread_t thread;
    int32_t device;
    uint64_t stream;
    uint64_t pairs;
} worker;

static atomic_int go, stop;

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

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

static void *run(void *arg)
{
    worker *w = arg;
    static const size_t sizes[] = {512, 4096, 70000, 1 << 20, 3 << 20};
    while (!atomic_load(&go)) {
    }
    uint64_t n = 0;
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        for (int i = 0; i < 64; i++) {
            void *p;
            npualloc_cache_malloc(w->device, sizes[(n + (uint64_t)i) % 5], w->stream, &p);
            npualloc_cache_free(p);
        }
        n += 64;
    }
    w->pairs = n;
    return NULL;
}

/* Pairs per second with `threads` workers placed by `place`; *fairness gets the slowest worker's
 * pairs over the mean worker's. */
static double measure(int threads, int place, aclrtStream *streams, double *fairness)
{
    worker w[4];
    atomic_store(&go, 0);
    atomic_store(&stop, 0);
    for (int i = 0; i < threads; i++) {
        w[i].device = place == 2 ? i : 0;
        w[i].stream = place == 1 ? (uint64_t)(uintptr_t)streams[i] : 0;
        w[i].pairs = 0;
        pthread_create(&w[i].thread, NULL, run, &w[i]);
    }
    double t0 = now_ns();
    atomic_store(&go, 1);
    while (now_ns() - t0 < RUN_NS) {
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    atomic_store(&stop, 1);
    double elapsed = now_ns() - t0;
    uint64_t total = 0, slowest = UINT64_MAX;
    for (int i = 0; i < threads; i++) {
        pthread_join(w[i].thread, NULL);
        total += w[i].pairs;
        slowest = w[i].pairs < slowest ? w[i].pairs : slowest;
    }
    *fairness = total ? (double)slowest * threads / (double)total : 0.0;
    return (double)total / (elapsed / 1e9);
}

int main(int argc, char **argv)
{
    int json = argc > 1 && strcmp(argv[1], "--json") == 0;
    npualloc_config cfg = {4, (uint64_t)16 << 30, (uint64_t)16 << 30, 0, 0};
    char err[256];
    if (npualloc_configure(&cfg, err, sizeof err) != ACL_SUCCESS) {
        fprintf(stderr, "configure: %s\n", err);
        return 1;
    }
    aclrtStream streams[4];
    aclrtSetDevice(0);
    for (int i = 0; i < 4; i++)
        aclrtCreateStream(&streams[i]);
    static const char *places[] = {"same stream", "different streams", "different devices"};
    double fairness;
    (void)measure(4, 2, streams, &fairness); /* warm-up: every device's cache and every stream's worker */
    (void)measure(4, 1, streams, &fairness);
    if (!json)
        printf("%-20s %8s %14s %10s %9s\n", "placement", "threads", "pairs/s", "x 1 thread", "fairness");
    for (int place = 0; place < 3; place++) {
        /* Rounds alternate 1, 2 and 4 threads so that a noisy moment of the machine hits all of
         * them; each figure is the median of its rounds, each ratio the median of per-round ratios. */
        double rate[3][ROUNDS], ratio[3][ROUNDS], fair[3] = {1.0, 1.0, 1.0};
        for (int r = 0; r < ROUNDS; r++) {
            for (int k = 0; k < 3; k++) {
                rate[k][r] = measure(1 << k, place, streams, &fairness);
                fair[k] = fairness < fair[k] ? fairness : fair[k];
            }
            for (int k = 0; k < 3; k++)
                ratio[k][r] = rate[k][r] / rate[0][r];
        }
        for (int k = 0; k < 3; k++) {
            double pairs = median(rate[k], ROUNDS), speedup = median(ratio[k], ROUNDS);
            if (json)
                printf("{\"bench\":\"threads\",\"placement\":\"%s\",\"threads\":%d,\"pairs_per_s\":%.0f,"
                       "\"speedup\":%.3f,\"fairness\":%.3f}\n",
                       places[place], 1 << k, pairs, speedup, fair[k]);
            else
                printf("%-20s %8d %14.0f %10.2f %9.2f\n", places[place], 1 << k, pairs, speedup, fair[k]);
        }
    }
    for (int i = 0; i < 4; i++)
        aclrtDestroyStream(streams[i]);
    npualloc_shutdown();
    return 0;
}
