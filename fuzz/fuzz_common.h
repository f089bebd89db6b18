/* fuzz_common.h - shared helpers of npualloc's fuzz harnesses (fuzz/fuzz_*.c).
 *
 * Each harness defines `int fuzz_<name>_one(const uint8_t *data, size_t size)`, which runs one
 * input and aborts (FUZZ_CHECK) on any broken property.  The libFuzzer entry point
 * LLVMFuzzerTestOneInput is compiled only without NPUALLOC_FUZZ_NO_ENTRY, so that
 * tests/c/test_fuzz_regressions.c can #include the harnesses and replay the seed corpora and
 * the crash inputs of fuzz/regressions/ through exactly the same code, without libFuzzer. */
#ifndef NPUALLOC_FUZZ_COMMON_H
#define NPUALLOC_FUZZ_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_CHECK(cond, ...)                                                                                  \
    do {                                                                                                       \
        if (!(cond)) {                                                                                         \
            fprintf(stderr, "%s:%d: fuzz property failed: %s: ", __FILE__, __LINE__, #cond);                   \
            fprintf(stderr, __VA_ARGS__);                                                                      \
            fputc('\n', stderr);                                                                               \
            abort();                                                                                           \
        }                                                                                                      \
    } while (0)

/* A reader over the input: past the end every read returns 0. */
typedef struct fuzz_in {
    const uint8_t *p;
    size_t n, at;
} fuzz_in;

/* NPUALLOC_FUZZ_TRACE set: a harness prints what it does, to turn a crash input into a C
 * reproducer (read once). */
static inline int fuzz_tracing(void)
{
    static int on = -1;
    if (on < 0)
        on = getenv("NPUALLOC_FUZZ_TRACE") != NULL;
    return on;
}

static inline int fuzz_more(const fuzz_in *in) { return in->at < in->n; }

static inline uint8_t fuzz_u8(fuzz_in *in) { return in->at < in->n ? in->p[in->at++] : 0; }

static inline uint16_t fuzz_u16(fuzz_in *in)
{
    uint16_t v = fuzz_u8(in);
    return (uint16_t)(v | (uint16_t)fuzz_u8(in) << 8);
}

static inline uint32_t fuzz_u32(fuzz_in *in)
{
    uint32_t v = fuzz_u16(in);
    return v | (uint32_t)fuzz_u16(in) << 16;
}

static inline uint64_t fuzz_u64(fuzz_in *in)
{
    uint64_t v = fuzz_u32(in);
    return v | (uint64_t)fuzz_u32(in) << 32;
}

/* True when buf[0..len) holds a NUL (a C string that ends inside its buffer). */
static inline int fuzz_terminated(const char *buf, size_t len) { return memchr(buf, 0, len) != NULL; }

/* ASan's defaults for the harnesses: a host allocation too large for ASan returns NULL (as
 * malloc does in a release build, where the library handles it) instead of aborting.  Known
 * case: fuzz/regressions/replay/expandable-huge-device (see docs/reliability.md). */
#define FUZZ_ASAN_DEFAULT_OPTIONS                                                                              \
    const char *__asan_default_options(void);                                                                  \
    const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

#endif
