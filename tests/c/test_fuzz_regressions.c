/* test_fuzz_regressions.c - replays the fuzzers' seed corpora and every crash input found so
 * far through the same harness functions libFuzzer drives (fuzz/fuzz_*.c), without libFuzzer:
 * these run on every machine, under ASan+UBSan (make ctest-asan) and valgrind (make valgrind).
 *
 *   fuzz/corpus/<harness>/        seeds (conf, ops, replay)
 *   fuzz/regressions/<harness>/   inputs that once crashed or broke a property: must pass
 *
 * Standalone: test_fuzz_regressions HARNESS FILE... runs the files through one harness (conf,
 * ops or replay), e.g. to reproduce a crash input on a machine without clang;
 * NPUALLOC_FUZZ_TRACE=1 makes the ops harness print each operation.
 * NPUALLOC_FUZZ_DIR names the fuzz/ directory (default: ./fuzz, or found from this file's path). */
#define NPUALLOC_FUZZ_NO_ENTRY 1

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>

#include "testutil.h"

#include "../../fuzz/fuzz_conf.c"
#include "../../fuzz/fuzz_ops.c"
#include "../../fuzz/fuzz_replay.c"

FUZZ_ASAN_DEFAULT_OPTIONS

typedef int (*harness_fn)(const uint8_t *data, size_t size);

static const struct {
    const char *name;
    harness_fn fn;
} harnesses[] = {{"conf", fuzz_conf_one}, {"ops", fuzz_ops_one}, {"replay", fuzz_replay_one}};

static harness_fn harness_named(const char *name)
{
    for (size_t i = 0; i < sizeof harnesses / sizeof harnesses[0]; i++)
        if (strcmp(harnesses[i].name, name) == 0)
            return harnesses[i].fn;
    return NULL;
}

static char fuzz_dir[1024];

static void find_fuzz_dir(void)
{
    const char *env = getenv("NPUALLOC_FUZZ_DIR");
    struct stat st;
    if (env) {
        snprintf(fuzz_dir, sizeof fuzz_dir, "%s", env);
        return;
    }
    if (stat("fuzz/corpus", &st) == 0) {
        snprintf(fuzz_dir, sizeof fuzz_dir, "fuzz");
        return;
    }
    /* __FILE__ is tests/c/test_fuzz_regressions.c relative to the root the build ran in */
    snprintf(fuzz_dir, sizeof fuzz_dir, "%s", __FILE__);
    char *tail = strstr(fuzz_dir, "tests/c/test_fuzz_regressions.c");
    if (tail)
        snprintf(tail, sizeof fuzz_dir - (size_t)(tail - fuzz_dir), "fuzz");
    else
        snprintf(fuzz_dir, sizeof fuzz_dir, "fuzz");
}

static uint8_t *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            uint8_t *grown = realloc(buf, cap *= 2);
            if (!grown) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = grown;
        }
    }
    fclose(f);
    *len = n;
    return buf;
}

static int run_file(harness_fn fn, const char *path)
{
    size_t len = 0;
    uint8_t *data = read_all(path, &len);
    if (!data) {
        fprintf(stderr, "cannot read %s: %s\n", path, strerror(errno));
        return -1;
    }
    fn(data, len);
    free(data);
    return 0;
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The regular files of a directory (sorted), optionally only those whose name starts with prefix. */
static size_t list_dir(const char *dir, const char *prefix, char ***out)
{
    *out = NULL;
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    size_t n = 0, cap = 0;
    char **names = NULL;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.' || (prefix && strncmp(e->d_name, prefix, strlen(prefix)) != 0))
            continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode))
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **grown = realloc(names, cap * sizeof *names);
            assert_non_null(grown);
            names = grown;
        }
        names[n++] = strdup(path);
    }
    closedir(d);
    if (n)
        qsort(names, n, sizeof *names, by_name);
    *out = names;
    return n;
}

static size_t run_dir(harness_fn fn, const char *sub, const char *harness)
{
    char dir[1536];
    snprintf(dir, sizeof dir, "%s/%s/%s", fuzz_dir, sub, harness);
    char **files;
    size_t n = list_dir(dir, NULL, &files);
    for (size_t i = 0; i < n; i++) {
        if (getenv("NPUALLOC_FUZZ_VERBOSE"))
            fprintf(stderr, "%s\n", files[i]);
        assert_int_equal(run_file(fn, files[i]), 0);
        free(files[i]);
    }
    free(files);
    return n;
}

static void run_harness(const char *harness)
{
    harness_fn fn = harness_named(harness);
    size_t seeds = run_dir(fn, "corpus", harness);
    size_t regressions = run_dir(fn, "regressions", harness);
    assert_true(seeds > 0); /* the corpus is where it should be */
    print_message("%s: %zu seed inputs, %zu regression inputs passed\n", harness, seeds, regressions);
}

static void test_conf_inputs(void **state)
{
    (void)state;
    run_harness("conf");
}

static void test_ops_inputs(void **state)
{
    (void)state;
    run_harness("ops");
}

static void test_replay_inputs(void **state)
{
    (void)state;
    run_harness("replay");
}

int main(int argc, char **argv)
{
    find_fuzz_dir();
    if (argc >= 3) {
        harness_fn fn = harness_named(argv[1]);
        if (!fn) {
            fprintf(stderr, "usage: %s conf|ops|replay FILE...\n", argv[0]);
            return 2;
        }
        for (int i = 2; i < argc; i++) {
            fprintf(stderr, "running %s\n", argv[i]);
            if (run_file(fn, argv[i]) != 0)
                return 1;
        }
        fprintf(stderr, "%d inputs passed\n", argc - 2);
        return 0;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conf_inputs),
        cmocka_unit_test(test_ops_inputs),
        cmocka_unit_test(test_replay_inputs),
    };
    return cmocka_run_group_tests_name("fuzz_regressions", tests, NULL, NULL);
}
