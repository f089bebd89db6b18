/* fuzz_conf.c - the PYTORCH_NPU_ALLOC_CONF parser (csrc/alloc_conf.c) on arbitrary bytes.
 *
 * Input: byte 0 = flags, the rest = the text (any bytes, NUL included, not terminated).
 *   flags & 3: 0 start-up parse (alloc_conf_parse_n), 1 run-time parse (_set_allocator_settings,
 *              over the result of a start-up parse of the same text), 2 alloc_conf_from_env (the
 *              text split at its first 0x01 byte into the two variables), 3 all three
 *   flags & 4: the expandable-segments probe fails
 *   flags & 8: no conf_result (r = NULL)
 *
 * Properties (any failure aborts):
 *   - no crash, no sanitizer report, no leak;
 *   - the status is one of the three; every message and warning ends inside its buffer;
 *     warning_count is within [0, ALLOC_CONF_MAX_WARNINGS];
 *   - on error the settings are unchanged (the documented contract);
 *   - alloc_conf_parse_n(text, len) == alloc_conf_parse(text up to the first NUL): same status,
 *     message, warnings and settings; and parsing twice gives the same result (no hidden state);
 *   - accepted settings are in range: roundup divisions 0 or a power of two, the garbage
 *     collection threshold 0 or in (0, 1), the fraction in [0, 1], base_addr_aligned_size at
 *     most 16 KiB, segment_size 0 or 20..512 MiB, and (start-up) expandable segments never
 *     together with max_split_size_mb or garbage_collection_threshold;
 *   - alloc_conf_roundup_divisions() is defined for every size. */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "alloc_conf.h"
#include "fuzz_common.h"

static int conf_probe(void *ctx) { return *(const bool *)ctx ? 0 : CONF_PROBE_FEATURE_NOT_SUPPORT; }

static bool same_double(double a, double b) { return memcmp(&a, &b, sizeof a) == 0; }

static bool settings_equal(const alloc_settings *a, const alloc_settings *b)
{
    if (a->max_split_size != b->max_split_size || a->max_non_split_rounding_size != b->max_non_split_rounding_size ||
        !same_double(a->garbage_collection_threshold, b->garbage_collection_threshold) ||
        a->expandable_segments != b->expandable_segments ||
        a->expandable_segments_explicit != b->expandable_segments_explicit ||
        a->pinned_use_background_threads != b->pinned_use_background_threads ||
        a->large_segment_size != b->large_segment_size || a->pinned_max_round_threshold != b->pinned_max_round_threshold ||
        a->pinned_max_cached_size != b->pinned_max_cached_size ||
        a->base_addr_aligned_size != b->base_addr_aligned_size || a->page_size_1g != b->page_size_1g ||
        a->segment_size != b->segment_size ||
        !same_double(a->per_process_memory_fraction, b->per_process_memory_fraction) ||
        a->per_process_memory_fraction_set != b->per_process_memory_fraction_set ||
        a->release_lock_on_npumalloc != b->release_lock_on_npumalloc ||
        a->throw_on_npumalloc_oom != b->throw_on_npumalloc_oom ||
        a->multi_stream_lazy_reclaim != b->multi_stream_lazy_reclaim ||
        a->pin_memory_expandable_segments != b->pin_memory_expandable_segments ||
        a->pinned_mem_register != b->pinned_mem_register ||
        a->pinned_reserve_segment_size != b->pinned_reserve_segment_size)
        return false;
    for (int i = 0; i < ALLOC_CONF_ROUNDUP_BUCKETS; i++)
        if (a->roundup_power2_divisions[i] != b->roundup_power2_divisions[i])
            return false;
    return true;
}

static void check_result(const conf_result *r, conf_status st)
{
    FUZZ_CHECK(st == CONF_OK || st == CONF_RUNTIME_ERROR || st == CONF_VALUE_ERROR, "status %d", (int)st);
    FUZZ_CHECK(r->status == st, "result status %d, returned %d", (int)r->status, (int)st);
    FUZZ_CHECK(fuzz_terminated(r->message, sizeof r->message), "message not NUL-terminated");
    FUZZ_CHECK(r->warning_count >= 0 && r->warning_count <= ALLOC_CONF_MAX_WARNINGS, "warning_count %d",
               r->warning_count);
    for (int i = 0; i < r->warning_count; i++)
        FUZZ_CHECK(fuzz_terminated(r->warnings[i], sizeof r->warnings[i]), "warning %d not NUL-terminated", i);
    if (st != CONF_OK)
        FUZZ_CHECK(r->message[0] != '\0', "an error without a message");
    /* the status name is always a string */
    FUZZ_CHECK(alloc_conf_status_name(st) != NULL, "no status name");
}

static bool same_result(const conf_result *a, const conf_result *b)
{
    if (a->status != b->status || strcmp(a->message, b->message) != 0 || a->warning_count != b->warning_count)
        return false;
    for (int i = 0; i < a->warning_count; i++)
        if (strcmp(a->warnings[i], b->warnings[i]) != 0)
            return false;
    return a->status == CONF_OK || (a->error_code == b->error_code && a->error_subsystem == b->error_subsystem);
}

static bool pow2_or_zero(size_t v) { return (v & (v - 1)) == 0; }

static void check_settings(const alloc_settings *s, bool startup)
{
    for (int i = 0; i < ALLOC_CONF_ROUNDUP_BUCKETS; i++)
        FUZZ_CHECK(pow2_or_zero(s->roundup_power2_divisions[i]), "divisions[%d] = %zu", i,
                   s->roundup_power2_divisions[i]);
    double gc = s->garbage_collection_threshold;
    FUZZ_CHECK(gc == 0 || (gc > 0 && gc < 1), "garbage_collection_threshold %g", gc);
    double f = s->per_process_memory_fraction;
    FUZZ_CHECK(f >= 0 && f <= 1, "per_process_memory_fraction %g", f);
    FUZZ_CHECK(s->base_addr_aligned_size <= 16 * 1024, "base_addr_aligned_size %zu", s->base_addr_aligned_size);
    FUZZ_CHECK(s->segment_size == 0 || (s->segment_size >= ((size_t)20 << 20) && s->segment_size <= ((size_t)512 << 20)),
               "segment_size %zu", s->segment_size);
    if (startup && s->expandable_segments)
        FUZZ_CHECK(s->max_split_size == SIZE_MAX && s->garbage_collection_threshold == 0,
                   "expandable segments with max_split_size %zu / gc %g", s->max_split_size, gc);
    static const size_t sizes[] = {0, 1, 511, 512, (size_t)1 << 20, ((size_t)1 << 21) + 1, (size_t)1 << 36,
                                   ((size_t)1 << 40) - 1, SIZE_MAX};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        FUZZ_CHECK(pow2_or_zero(alloc_conf_roundup_divisions(s, sizes[i])), "roundup_divisions(%zu)", sizes[i]);
}

/* Parses text[0..len) at start-up, both ways; returns the status, the settings in *out. */
static conf_status startup_parse(const char *text, size_t len, bool probe_ok, bool with_result,
                                 alloc_settings *out, conf_result *r)
{
    alloc_settings s, before;
    alloc_settings_default(&s);
    before = s;
    conf_result *rp = with_result ? r : NULL;
    conf_status st = alloc_conf_parse_n(text, len, &s, conf_probe, &probe_ok, rp);
    if (with_result)
        check_result(r, st);
    if (st != CONF_OK)
        FUZZ_CHECK(settings_equal(&s, &before), "settings changed by a failed parse");
    else
        check_settings(&s, true);

    /* The same text, terminated at its first NUL, through alloc_conf_parse: the same outcome. */
    size_t n = strnlen(text, len);
    char *copy = malloc(n + 1);
    FUZZ_CHECK(copy != NULL, "out of memory");
    memcpy(copy, text, n);
    copy[n] = '\0';
    alloc_settings s2;
    alloc_settings_default(&s2);
    conf_result r2;
    conf_status st2 = alloc_conf_parse(copy, &s2, conf_probe, &probe_ok, &r2);
    check_result(&r2, st2);
    FUZZ_CHECK(st2 == st, "parse_n gave %d, parse of the terminated text %d", (int)st, (int)st2);
    FUZZ_CHECK(settings_equal(&s, &s2), "parse_n and parse disagree on the settings");
    if (with_result)
        FUZZ_CHECK(same_result(r, &r2), "parse_n and parse disagree: '%s' vs '%s'", r->message, r2.message);
    /* Again: no hidden state between calls. */
    alloc_settings s3;
    alloc_settings_default(&s3);
    conf_result r3;
    conf_status st3 = alloc_conf_parse(copy, &s3, conf_probe, &probe_ok, &r3);
    FUZZ_CHECK(st3 == st2 && same_result(&r2, &r3) && settings_equal(&s2, &s3), "a second parse differs");
    free(copy);
    *out = s;
    return st;
}

static void runtime_parse(const char *text, size_t len, bool probe_ok, bool with_result, const alloc_settings *base)
{
    size_t n = strnlen(text, len);
    char *copy = malloc(n + 1);
    FUZZ_CHECK(copy != NULL, "out of memory");
    memcpy(copy, text, n);
    copy[n] = '\0';
    /* over the defaults, and over what the start-up parse accepted */
    alloc_settings bases[2];
    alloc_settings_default(&bases[0]);
    bases[1] = *base;
    for (int b = 0; b < 2; b++) {
        alloc_settings s = bases[b];
        conf_result r;
        conf_status st = alloc_conf_parse_runtime(copy, &s, conf_probe, &probe_ok, with_result ? &r : NULL);
        if (with_result)
            check_result(&r, st);
        FUZZ_CHECK(st == CONF_OK || st == CONF_RUNTIME_ERROR || st == CONF_VALUE_ERROR, "status %d", (int)st);
        /* a failed text keeps what it set before its error (as torch_npu does): valid values, and the
           NPU-only start-up keys untouched */
        check_settings(&s, false);
        if (st != CONF_OK)
            FUZZ_CHECK(s.base_addr_aligned_size == bases[b].base_addr_aligned_size &&
                           s.page_size_1g == bases[b].page_size_1g && s.segment_size == bases[b].segment_size &&
                           s.multi_stream_lazy_reclaim == bases[b].multi_stream_lazy_reclaim &&
                           s.pin_memory_expandable_segments == bases[b].pin_memory_expandable_segments &&
                           s.pinned_mem_register == bases[b].pinned_mem_register &&
                           s.pinned_reserve_segment_size == bases[b].pinned_reserve_segment_size,
                       "a failed run-time parse changed a start-up key");
    }
    free(copy);
}

/* alloc_conf_from_env with a fake environment. */
static const char *env_npu, *env_generic;
static const char *fake_getenv(const char *name)
{
    if (strcmp(name, "PYTORCH_NPU_ALLOC_CONF") == 0)
        return env_npu;
    if (strcmp(name, "PYTORCH_ALLOC_CONF") == 0)
        return env_generic;
    return NULL;
}

static void env_parse(const char *text, size_t len, uint8_t flags, bool probe_ok)
{
    size_t n = strnlen(text, len);
    const char *sep = memchr(text, 0x01, n);
    size_t n1 = sep ? (size_t)(sep - text) : n;
    char *a = malloc(n1 + 1), *b = malloc(n - (sep ? n1 + 1 : n1) + 1);
    FUZZ_CHECK(a && b, "out of memory");
    memcpy(a, text, n1);
    a[n1] = '\0';
    size_t n2 = sep ? n - n1 - 1 : 0;
    memcpy(b, sep ? sep + 1 : text, n2);
    b[n2] = '\0';
    env_npu = (flags & 0x10) ? NULL : a;
    env_generic = sep ? b : NULL;
    alloc_settings s, before;
    alloc_settings_default(&s);
    before = s;
    conf_result r;
    const char *used = (const char *)1;
    conf_status st = alloc_conf_from_env(fake_getenv, &s, conf_probe, &probe_ok, &r, &used);
    check_result(&r, st);
    if (env_npu && env_generic)
        FUZZ_CHECK(st == CONF_RUNTIME_ERROR, "both variables set, status %d", (int)st);
    else
        FUZZ_CHECK(used == (env_npu ? env_npu : env_generic), "used_text is not the variable's text");
    if (st != CONF_OK)
        FUZZ_CHECK(settings_equal(&s, &before), "settings changed by a failed parse");
    env_npu = env_generic = NULL;
    free(a);
    free(b);
}

int fuzz_conf_one(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    uint8_t flags = data[0];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    bool probe_ok = !(flags & 4);
    bool with_result = !(flags & 8);
    int mode = flags & 3;
    conf_result r;
    alloc_settings s;
    if (mode == 0 || mode == 3 || mode == 1)
        (void)startup_parse(text, len, probe_ok, with_result, &s, &r);
    if (mode == 1 || mode == 3)
        runtime_parse(text, len, probe_ok, with_result, &s);
    if (mode == 2 || mode == 3)
        env_parse(text, len, flags, probe_ok);
    return 0;
}

#ifndef NPUALLOC_FUZZ_NO_ENTRY
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) { return fuzz_conf_one(data, size); }
FUZZ_ASAN_DEFAULT_OPTIONS
#endif
