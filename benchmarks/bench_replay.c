/*
 * bench_replay.c - events per second of the trace-replay engine (npualloc_replay.h).
 *
 * Inputs, in this order:
 *   - files named on the command line, or in NPUALLOC_REPLAY_EVENTS (colon-separated): binary event
 *     files written by npualloc.replay.export_events() / `python -m npualloc replay TRACE --export-events F`;
 *   - with neither, the PyTorch traces in ../shared/traces/ (or NPUALLOC_TRACES_DIR) when present, exported
 *     through `$PYTHON -m npualloc replay --export-events` into a temporary directory;
 *   - always, a synthesized transformer-like workload (no files needed).
 *
 * Each (input, setting) line replays the whole event list in a fresh session, repeated until at least
 * 300 ms have passed (and at least 5 times), and reports the median rate (session creation and
 * teardown excluded) plus what the replay reserved.  Target: >= 2 M events/s on the fullstep trace.
 *
 * --json prints one JSON object per (input, setting) line instead of the table.
 *
 * The heap keeps 64 MiB above its top (M_TOP_PAD), so every session runs on memory the process already
 * has: the rate is the engine's.  Without it glibc may give the heap's top back to the kernel when a
 * session ends, and the next session pays a page fault on each page it touches again; whether it does
 * depends on what else sits at the top of the heap, and the same trace then measured either about 9 or
 * about 19 M events/s from one build to the next (cs336-ctx128-forward-mixed, default settings,
 * 2026-11-26).
 *
 * Build and run: `make bench`, or
 *   make build/release/bench/bench_replay && build/release/bench/bench_replay [--json] [FILE...]
 */
#include <dirent.h>
#include <malloc.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "npualloc_replay.h"

#define MiB ((uint64_t)1 << 20)
#define GiB ((uint64_t)1 << 30)
#define MIN_RUNS 5
#define MIN_SECONDS 0.3

typedef struct events {
    char name[128];
    size_t count, prefix;
    uint8_t *action;
    uint64_t *addr, *size, *stream;
} events;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static bool alloc_events(events *e, size_t n)
{
    e->count = n;
    e->action = malloc(n ? n : 1);
    e->addr = malloc((n ? n : 1) * 8);
    e->size = malloc((n ? n : 1) * 8);
    e->stream = malloc((n ? n : 1) * 8);
    return e->action && e->addr && e->size && e->stream;
}

static void free_events(events *e)
{
    free(e->action);
    free(e->addr);
    free(e->size);
    free(e->stream);
}

/* Reads the export format: "NPUREPL1", u64 count, u64 prefix, u8 action[count] padded to 8, u64 addr[count],
 * size[count], stream[count] (little-endian; this benchmark assumes a little-endian host). */
static bool load_file(const char *path, events *e)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return false;
    }
    char magic[8];
    uint64_t hdr[2];
    bool ok = fread(magic, 1, 8, f) == 8 && memcmp(magic, "NPUREPL1", 8) == 0 && fread(hdr, 8, 2, f) == 2 &&
              hdr[0] < ((uint64_t)1 << 36) && alloc_events(e, (size_t)hdr[0]);
    if (ok) {
        size_t n = (size_t)hdr[0], pad = (8 - n % 8) % 8;
        char skip[8];
        e->prefix = (size_t)hdr[1];
        ok = fread(e->action, 1, n, f) == n && fread(skip, 1, pad, f) == pad && fread(e->addr, 8, n, f) == n &&
             fread(e->size, 8, n, f) == n && fread(e->stream, 8, n, f) == n;
    }
    fclose(f);
    if (!ok) {
        fprintf(stderr, "%s: not a replay event file (write one with npualloc.replay.export_events)\n", path);
        return false;
    }
    const char *base = strrchr(path, '/');
    snprintf(e->name, sizeof e->name, "%s", base ? base + 1 : path);
    return true;
}

/* A transformer-like training loop: weights and optimizer state that live throughout, activations
 * kept for the backward pass (of a varying sequence length), short-lived temporaries, and gradient
 * buckets on a second stream. */
static uint32_t rng_state = 12345;
static uint32_t rnd(void)
{
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state >> 8;
}

typedef struct gen {
    events *e;
    size_t cap;
    uint64_t next_addr;
} gen;

static uint64_t gen_alloc(gen *g, uint64_t size, uint64_t stream)
{
    events *e = g->e;
    if (e->count == g->cap)
        return 0;
    uint64_t a = g->next_addr;
    g->next_addr += 0x1000;
    e->action[e->count] = NPUALLOC_REPLAY_ALLOC;
    e->addr[e->count] = a;
    e->size[e->count] = size;
    e->stream[e->count++] = stream;
    return a;
}

static void gen_free(gen *g, uint64_t a, uint64_t stream)
{
    events *e = g->e;
    if (e->count == g->cap || !a)
        return;
    e->action[e->count] = NPUALLOC_REPLAY_FREE;
    e->addr[e->count] = a;
    e->size[e->count] = 0;
    e->stream[e->count++] = stream;
}

static bool synthesize(events *e, size_t target)
{
    if (!alloc_events(e, target))
        return false;
    e->count = 0;
    e->prefix = 0;
    snprintf(e->name, sizeof e->name, "synthetic transformer");
    gen g = {e, target, 0x7f0000000000ull};
    enum { LAYERS = 24, SAVED = 8 };
    const uint64_t h = 2048, comm = 0x5000;
    for (int l = 0; l < LAYERS; l++) { /* weights: 12 h^2 fp32 per layer, in 4 tensors; optimizer state x2 */
        uint64_t sizes[4] = {3 * h * h * 4, h * h * 4, 4 * h * h * 4, 4 * h * h * 4};
        for (int k = 0; k < 4; k++)
            for (int c = 0; c < 3; c++)
                gen_alloc(&g, sizes[k], 0);
    }
    static uint64_t saved[LAYERS][SAVED];
    while (e->count + 4096 < target) {
        uint64_t seq = 128 * (1 + rnd() % 8), tok = 4 * seq; /* batch 4 */
        for (int l = 0; l < LAYERS; l++) {
            for (int k = 0; k < SAVED; k++) {
                uint64_t sz = k == 3 ? 4 * 16 * seq * seq * 2 : (k == 5 ? tok * 4 * h * 2 : tok * h * 2);
                uint64_t tmp = gen_alloc(&g, tok * h * 2 + (rnd() % 3) * 512, 0);
                saved[l][k] = gen_alloc(&g, sz, 0);
                gen_free(&g, tmp, 0);
            }
            uint64_t small = gen_alloc(&g, 64 + rnd() % 8192, 0);
            gen_free(&g, small, 0);
        }
        uint64_t logits = gen_alloc(&g, tok * 32000 * 2, 0);
        uint64_t grad_logits = gen_alloc(&g, tok * 32000 * 2, 0);
        gen_free(&g, logits, 0);
        uint64_t buckets[LAYERS] = {0};
        for (int l = LAYERS - 1; l >= 0; l--) {
            uint64_t grads[4];
            for (int k = 0; k < 4; k++)
                grads[k] = gen_alloc(&g, (k == 0 ? 3 : k == 1 ? 1 : 4) * h * h * 4, 0);
            for (int k = SAVED - 1; k >= 0; k--) {
                uint64_t tmp = gen_alloc(&g, tok * h * 2, 0);
                gen_free(&g, saved[l][k], 0);
                gen_free(&g, tmp, 0);
            }
            buckets[l] = gen_alloc(&g, 12 * h * h * 4, comm);
            for (int k = 0; k < 4; k++)
                gen_free(&g, grads[k], 0);
            if (l + 2 < LAYERS)
                gen_free(&g, buckets[l + 2], comm), buckets[l + 2] = 0;
        }
        gen_free(&g, grad_logits, 0);
        for (int l = 0; l < LAYERS; l++)
            gen_free(&g, buckets[l], comm);
        for (int l = 0; l < LAYERS * 4; l++) { /* optimizer temporaries */
            uint64_t t = gen_alloc(&g, h * h * 4 * (1 + l % 4), 0);
            gen_free(&g, t, 0);
        }
    }
    return true;
}

/* Exports the shared traces through the Python side; returns how many files were added. */
static size_t export_shared(events *list, size_t cap, char *tmpdir)
{
    const char *dir = getenv("NPUALLOC_TRACES_DIR");
    if (!dir)
        dir = "../shared/traces";
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    const char *py = getenv("PYTHON");
    if (!py)
        py = "python3";
    size_t n = 0;
    struct dirent *de;
    char *names[16];
    size_t nn = 0;
    while ((de = readdir(d)) != NULL && nn < 16) {
        size_t len = strlen(de->d_name);
        if (len > 7 && strcmp(de->d_name + len - 7, ".pickle") == 0)
            names[nn++] = strdup(de->d_name);
    }
    closedir(d);
    for (size_t i = 0; i < nn; i++) /* a stable order */
        for (size_t j = i + 1; j < nn; j++)
            if (strcmp(names[j], names[i]) < 0) {
                char *t = names[i];
                names[i] = names[j];
                names[j] = t;
            }
    for (size_t i = 0; i < nn && n < cap; i++) {
        char out[512], cmd[2048];
        snprintf(out, sizeof out, "%s/%.*s.bin", tmpdir, (int)(strlen(names[i]) - 7), names[i]);
        snprintf(cmd, sizeof cmd, "%s -m npualloc replay '%s/%s' --export-events '%s' >/dev/null", py, dir, names[i],
                 out);
        if (system(cmd) == 0 && load_file(out, &list[n]))
            n++;
        unlink(out);
        free(names[i]);
    }
    return n;
}

typedef struct setting {
    const char *label, *conf;
    size_t pad;
    double fraction;
    bool huge1g;
} setting;

static const setting SETTINGS[] = {
    {"default (npu)", "", NPUALLOC_REPLAY_PAD_NPU, 0, false},
    {"default (cuda)", "", NPUALLOC_REPLAY_PAD_CUDA, 0, false},
    {"max_split_size_mb:128", "max_split_size_mb:128", NPUALLOC_REPLAY_PAD_NPU, 0, false},
    {"gc:0.8 +fraction 0.9", "garbage_collection_threshold:0.8", NPUALLOC_REPLAY_PAD_NPU, 0.9, false},
    {"expandable_segments:True", "expandable_segments:True", NPUALLOC_REPLAY_PAD_NPU, 0, false},
    {"page_size:1g", "page_size:1g", NPUALLOC_REPLAY_PAD_NPU, 0, true},
};

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void print_name(const char *s)
{
    putchar('"');
    for (; *s; s++)
        if (*s == '"' || *s == '\\')
            printf("\\%c", *s);
        else if ((unsigned char)*s >= 0x20)
            putchar(*s);
    putchar('"');
}

static void bench_one(const events *e, const setting *s, bool json)
{
    npualloc_replay_config cfg;
    npualloc_replay_config_default(&cfg);
    cfg.settings = s->conf;
    cfg.pad = s->pad;
    cfg.fraction = s->fraction;
    cfg.huge1g_memory = s->huge1g ? cfg.device_memory * 3 / 4 / GiB * GiB : 0;
    double rates[1000];
    int runs = 0;
    double start = now();
    npualloc_replay_result res;
    memset(&res, 0, sizeof res);
    while (runs < 1000 && (runs < MIN_RUNS || now() - start < MIN_SECONDS)) {
        npualloc_replay *r = NULL;
        char err[512];
        npualloc_replay_status st = npualloc_replay_create(&cfg, &r, err, sizeof err);
        if (st != NPUALLOC_REPLAY_OK) {
            if (!json)
                printf("  %-32s %-26s %s\n", e->name, s->label,
                       st == NPUALLOC_REPLAY_UNAVAILABLE ? "not available" : err);
            return;
        }
        npualloc_replay_events ev = {e->action, e->addr, e->size, e->stream, e->count};
        double t0 = now();
        npualloc_replay_feed(r, &ev);
        double dt = now() - t0;
        npualloc_replay_get_result(r, &res);
        npualloc_replay_destroy(r);
        rates[runs++] = dt > 0 ? (double)res.events / dt : 0;
    }
    qsort(rates, (size_t)runs, sizeof rates[0], cmp_double);
    if (json) {
        printf("{\"bench\":\"replay\",\"trace\":");
        print_name(e->name);
        printf(",\"setting\":");
        print_name(s->label);
        printf(",\"events\":%zu,\"runs\":%d,\"events_per_s\":%.0f,\"peak_reserved\":%llu,"
               "\"peak_allocated\":%llu,\"fragmentation\":%.4f,\"ooms\":%llu}\n",
               e->count, runs, rates[runs / 2], (unsigned long long)res.peak_reserved,
               (unsigned long long)res.peak_allocated, res.fragmentation, (unsigned long long)res.ooms);
        return;
    }
    printf("  %-32s %-26s %9zu %5d %9.2f %12.2f %9.2f %6.1f%% %4llu\n", e->name, s->label, e->count, runs,
           rates[runs / 2] / 1e6, (double)res.peak_reserved / (double)GiB, (double)res.peak_allocated / (double)GiB,
           res.fragmentation * 100.0, (unsigned long long)res.ooms);
}

int main(int argc, char **argv)
{
    events list[24];
    size_t n = 0;
    int files = 0;
    bool json = false;
    char tmpdir[] = "/tmp/npualloc-bench-XXXXXX";
    mallopt(M_TOP_PAD, 64 << 20); /* see the header: sessions reuse the process's memory */
    for (int i = 1; i < argc && n < 20; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = true;
            continue;
        }
        files++;
        if (load_file(argv[i], &list[n]))
            n++;
    }
    const char *env = getenv("NPUALLOC_REPLAY_EVENTS");
    if (files == 0 && env && *env) {
        char *copy = strdup(env);
        for (char *tok = strtok(copy, ":"); tok && n < 20; tok = strtok(NULL, ":"))
            if (load_file(tok, &list[n]))
                n++;
        free(copy);
    }
    if (files == 0 && n == 0 && mkdtemp(tmpdir)) {
        n += export_shared(list + n, 20 - n, tmpdir);
        rmdir(tmpdir);
    }
    if (!synthesize(&list[n], 200000)) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    n++;
    if (!json) {
        printf("bench_replay: median replay rate per (trace, setting); 80 GiB simulated device; session set-up "
               "excluded\n");
        printf("  %-32s %-26s %9s %5s %9s %12s %9s %7s %4s\n", "trace", "setting", "events", "runs", "Mev/s",
               "peak resv GiB", "alloc GiB", "frag", "OOMs");
    }
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < sizeof SETTINGS / sizeof SETTINGS[0]; k++)
            bench_one(&list[i], &SETTINGS[k], json);
        free_events(&list[i]);
    }
    return 0;
}
