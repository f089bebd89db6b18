/* test_alloc_conf.c - the PYTORCH_NPU_ALLOC_CONF parser: values, bucket arrays, messages, warnings. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "alloc_conf.h"

#define KiB_ ((size_t)1 << 10)
#define MiB_ ((size_t)1 << 20)
#define GiB_ ((size_t)1 << 30)
#define CLAMPED_MB ((SIZE_MAX / MiB_) * MiB_) /* c10's clamp of a huge MB count */
#define NB ALLOC_CONF_ROUNDUP_BUCKETS

/* ---------------------------------------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------------------------------------- */

static void assert_settings_eq(const alloc_settings *a, const alloc_settings *b)
{
    assert_true(a->max_split_size == b->max_split_size);
    assert_true(a->max_non_split_rounding_size == b->max_non_split_rounding_size);
    assert_true(a->garbage_collection_threshold == b->garbage_collection_threshold);
    for (int k = 0; k < NB; k++)
        assert_true(a->roundup_power2_divisions[k] == b->roundup_power2_divisions[k]);
    assert_int_equal(a->expandable_segments, b->expandable_segments);
    assert_int_equal(a->expandable_segments_explicit, b->expandable_segments_explicit);
    assert_int_equal(a->pinned_use_background_threads, b->pinned_use_background_threads);
    assert_true(a->large_segment_size == b->large_segment_size);
    assert_true(a->pinned_max_round_threshold == b->pinned_max_round_threshold);
    assert_true(a->pinned_max_cached_size == b->pinned_max_cached_size);
    assert_true(a->base_addr_aligned_size == b->base_addr_aligned_size);
    assert_int_equal(a->page_size_1g, b->page_size_1g);
    assert_true(a->segment_size == b->segment_size);
    assert_true(a->per_process_memory_fraction == b->per_process_memory_fraction);
    assert_int_equal(a->per_process_memory_fraction_set, b->per_process_memory_fraction_set);
    assert_int_equal(a->release_lock_on_npumalloc, b->release_lock_on_npumalloc);
    assert_int_equal(a->throw_on_npumalloc_oom, b->throw_on_npumalloc_oom);
    assert_int_equal(a->multi_stream_lazy_reclaim, b->multi_stream_lazy_reclaim);
    assert_int_equal(a->pin_memory_expandable_segments, b->pin_memory_expandable_segments);
    assert_int_equal(a->pinned_mem_register, b->pinned_mem_register);
    assert_true(a->pinned_reserve_segment_size == b->pinned_reserve_segment_size);
}

/* The fields only start-up NPU keys set: a run-time text never changes them. */
static void assert_npu_startup_fields_eq(const alloc_settings *a, const alloc_settings *b)
{
    assert_true(a->base_addr_aligned_size == b->base_addr_aligned_size);
    assert_int_equal(a->page_size_1g, b->page_size_1g);
    assert_true(a->segment_size == b->segment_size);
    assert_int_equal(a->multi_stream_lazy_reclaim, b->multi_stream_lazy_reclaim);
    assert_int_equal(a->pin_memory_expandable_segments, b->pin_memory_expandable_segments);
    assert_int_equal(a->pinned_mem_register, b->pinned_mem_register);
    assert_true(a->pinned_reserve_segment_size == b->pinned_reserve_segment_size);
}

static int probe_ok(void *ctx)
{
    if (ctx)
        ++*(int *)ctx;
    return 0;
}

/* The runtime has no virtual memory management: a warning, expandable segments off. */
static int probe_fail(void *ctx)
{
    if (ctx)
        ++*(int *)ctx;
    return CONF_PROBE_FEATURE_NOT_SUPPORT;
}

/* Any other failure of the reserve is fatal (NPU_CHECK_ERROR). */
static int probe_error(void *ctx)
{
    if (ctx)
        ++*(int *)ctx;
    return 207001;
}

static void assert_msg_terminated(const conf_result *r)
{
    assert_non_null(memchr(r->message, '\0', sizeof r->message));
    assert_true(r->warning_count >= 0 && r->warning_count <= ALLOC_CONF_MAX_WARNINGS);
    for (int k = 0; k < r->warning_count; k++)
        assert_non_null(memchr(r->warnings[k], '\0', sizeof r->warnings[k]));
}

/* ---------------------------------------------------------------------------------------------------------
 * Defaults
 * ------------------------------------------------------------------------------------------------------- */

static void test_defaults(void **state)
{
    (void)state;
    alloc_settings s;
    memset(&s, 0xA5, sizeof s);
    alloc_settings_default(&s);
    assert_true(s.max_split_size == SIZE_MAX);
    assert_true(s.max_non_split_rounding_size == 20 * MiB_);
    assert_true(s.garbage_collection_threshold == 0.0);
    for (int k = 0; k < NB; k++)
        assert_true(s.roundup_power2_divisions[k] == 0);
    assert_false(s.expandable_segments);
    assert_false(s.expandable_segments_explicit);
    assert_false(s.pinned_use_background_threads);
    assert_true(s.large_segment_size == 20 * MiB_);
    assert_true(s.pinned_max_round_threshold == SIZE_MAX);
    assert_true(s.pinned_max_cached_size == SIZE_MAX);
    assert_true(s.base_addr_aligned_size == 16 * KiB_);
    assert_false(s.page_size_1g);
    assert_true(s.segment_size == 0);
    assert_true(s.per_process_memory_fraction == 1.0);
    assert_false(s.per_process_memory_fraction_set);
    assert_false(s.release_lock_on_npumalloc || s.throw_on_npumalloc_oom || s.multi_stream_lazy_reclaim ||
                 s.pin_memory_expandable_segments || s.pinned_mem_register);
    assert_true(s.pinned_reserve_segment_size == 0);
}

/* ---------------------------------------------------------------------------------------------------------
 * Valid strings: stored results
 * ------------------------------------------------------------------------------------------------------- */

typedef enum {
    F_END = 0, F_MAX_SPLIT, F_NON_SPLIT, F_GC, F_EXP, F_EXP_EXPL, F_BG, F_LARGE, F_PMRT, F_PMCS, F_BASE,
    F_PAGE1G, F_SEG, F_FRAC, F_FRAC_SET, F_RELEASE, F_THROW, F_LAZY, F_PINEXP, F_PINREG, F_PINRES,
} field;

typedef struct fx {
    field f;
    unsigned long long u; /* size_t / bool fields */
    double d;             /* double fields */
} fx;

static void set_field(alloc_settings *s, fx e)
{
    switch (e.f) {
    case F_END: break;
    case F_MAX_SPLIT: s->max_split_size = (size_t)e.u; break;
    case F_NON_SPLIT: s->max_non_split_rounding_size = (size_t)e.u; break;
    case F_GC: s->garbage_collection_threshold = e.d; break;
    case F_EXP: s->expandable_segments = e.u != 0; break;
    case F_EXP_EXPL: s->expandable_segments_explicit = e.u != 0; break;
    case F_BG: s->pinned_use_background_threads = e.u != 0; break;
    case F_LARGE: s->large_segment_size = (size_t)e.u; break;
    case F_PMRT: s->pinned_max_round_threshold = (size_t)e.u; break;
    case F_PMCS: s->pinned_max_cached_size = (size_t)e.u; break;
    case F_BASE: s->base_addr_aligned_size = (size_t)e.u; break;
    case F_PAGE1G: s->page_size_1g = e.u != 0; break;
    case F_SEG: s->segment_size = (size_t)e.u; break;
    case F_FRAC: /* parsing the fraction always marks it set */
        s->per_process_memory_fraction = e.d;
        s->per_process_memory_fraction_set = true;
        break;
    case F_FRAC_SET: s->per_process_memory_fraction_set = e.u != 0; break;
    case F_RELEASE: s->release_lock_on_npumalloc = e.u != 0; break;
    case F_THROW: s->throw_on_npumalloc_oom = e.u != 0; break;
    case F_LAZY: s->multi_stream_lazy_reclaim = e.u != 0; break;
    case F_PINEXP: s->pin_memory_expandable_segments = e.u != 0; break;
    case F_PINREG: s->pinned_mem_register = e.u != 0; break;
    case F_PINRES: s->pinned_reserve_segment_size = (size_t)e.u; break;
    }
}

typedef struct valid_case {
    const char *text;
    fx expect[8]; /* fields that differ from the defaults; F_END-terminated */
    int warnings; /* expected warning count */
} valid_case;

#define U(f, v) {f, (unsigned long long)(v), 0}
#define D(f, v) {f, 0, v}

static const valid_case valid_cases[] = {
    {"", {{0}}, 0},
    {"   \t\n ", {{0}}, 0},
    /* max_split_size_mb: stoull semantics, >= large_segment_size_mb (20), clamp */
    {"max_split_size_mb:128", {U(F_MAX_SPLIT, 128 * MiB_)}, 0},
    {"max_split_size_mb:20", {U(F_MAX_SPLIT, 20 * MiB_)}, 0},
    {" max_split_size_mb : 128 ", {U(F_MAX_SPLIT, 128 * MiB_)}, 0},
    {"max_split\t_size_mb:1 28", {U(F_MAX_SPLIT, 128 * MiB_)}, 0}, /* spaces vanish inside words */
    {"max_split_size_mb:\r\n128\v\f", {U(F_MAX_SPLIT, 128 * MiB_)}, 0},
    {"max_split_size_mb:128abc", {U(F_MAX_SPLIT, 128 * MiB_)}, 0},  /* trailing garbage ignored */
    {"max_split_size_mb:+128", {U(F_MAX_SPLIT, 128 * MiB_)}, 0},
    {"max_split_size_mb:0128", {U(F_MAX_SPLIT, 128 * MiB_)}, 0},
    {"max_split_size_mb:-1", {U(F_MAX_SPLIT, CLAMPED_MB)}, 0},      /* '-' wraps, then the clamp */
    {"max_split_size_mb:18446744073709551615", {U(F_MAX_SPLIT, CLAMPED_MB)}, 0},
    {"max_split_size_mb:17592186044415", {U(F_MAX_SPLIT, CLAMPED_MB)}, 0}, /* exactly SIZE_MAX / MiB */
    {"max_split_size_mb,128", {U(F_MAX_SPLIT, 128 * MiB_)}, 0},     /* checkToken result is ignored */
    {"max_split_size_mb:128,", {U(F_MAX_SPLIT, 128 * MiB_)}, 0},
    {"max_split_size_mb:100,max_split_size_mb:200", {U(F_MAX_SPLIT, 200 * MiB_)}, 0},
    /* max_non_split_rounding_mb / large_segment_size_mb */
    {"max_non_split_rounding_mb:64", {U(F_NON_SPLIT, 64 * MiB_)}, 0},
    {"max_non_split_rounding_mb:20", {U(F_NON_SPLIT, 20 * MiB_)}, 0},
    {"large_segment_size_mb:11", {U(F_LARGE, 11 * MiB_), U(F_NON_SPLIT, 11 * MiB_)}, 0},
    {"large_segment_size_mb:64,max_split_size_mb:64",
     {U(F_LARGE, 64 * MiB_), U(F_NON_SPLIT, 64 * MiB_), U(F_MAX_SPLIT, 64 * MiB_)}, 0},
    {"max_split_size_mb:64,large_segment_size_mb:64", /* read first wherever it is */
     {U(F_LARGE, 64 * MiB_), U(F_NON_SPLIT, 64 * MiB_), U(F_MAX_SPLIT, 64 * MiB_)}, 0},
    {"max_non_split_rounding_mb:100,large_segment_size_mb:64", {U(F_LARGE, 64 * MiB_), U(F_NON_SPLIT, 100 * MiB_)}, 0},
    {"large_segment_size_mb:-1", {U(F_LARGE, CLAMPED_MB), U(F_NON_SPLIT, CLAMPED_MB)}, 0},
    /* garbage_collection_threshold: stod semantics, (0, 1) */
    {"garbage_collection_threshold:0.6", {D(F_GC, 0.6)}, 0},
    {"garbage_collection_threshold:6e-1", {D(F_GC, 0.6)}, 0},
    {"garbage_collection_threshold:0.6xyz", {D(F_GC, 0.6)}, 0},
    {"garbage_collection_threshold:0x1p-1", {D(F_GC, 0.5)}, 0},
    {"garbage_collection_threshold:.999", {D(F_GC, 0.999)}, 0},
    {"max_split_size_mb:32,garbage_collection_threshold:0.6", {U(F_MAX_SPLIT, 32 * MiB_), D(F_GC, 0.6)}, 0},
    /* c10 booleans */
    {"expandable_segments:True", {U(F_EXP, 1), U(F_EXP_EXPL, 1)}, 0},
    {"expandable_segments:False", {U(F_EXP_EXPL, 1)}, 0},
    {"expandable_segments:True,expandable_segments:False,max_split_size_mb:100",
     {U(F_EXP_EXPL, 1), U(F_MAX_SPLIT, 100 * MiB_)}, 0},
    {"expandable_segments:True,base_addr_aligned_kb:16", {U(F_EXP, 1), U(F_EXP_EXPL, 1)}, 0},
    {"pinned_use_background_threads:True", {U(F_BG, 1)}, 0},
    {"pinned_use_background_threads:False", {{0}}, 0},
    /* pinned thresholds */
    {"pinned_max_round_threshold_mb:64", {U(F_PMRT, 64 * MiB_)}, 0},
    {"pinned_max_cached_size_mb:32", {U(F_PMCS, 32 * MiB_)}, 0},
    {"pinned_max_round_threshold_mb:0,pinned_max_cached_size_mb:-1", {U(F_PMRT, 0), U(F_PMCS, CLAMPED_MB)}, 0},
    {"pinned_reserve_segment_size_mb:2048", {U(F_PINRES, 2048 * MiB_)}, 0},
    {"pinned_reserve_segment_size_mb:-1", {U(F_PINRES, CLAMPED_MB)}, 0},
    /* base_addr_aligned_kb: digits only, no leading zeros, 0..16 */
    {"base_addr_aligned_kb:0", {U(F_BASE, 0)}, 0},
    {"base_addr_aligned_kb:8", {U(F_BASE, 8 * KiB_)}, 0},
    {"base_addr_aligned_kb:16", {U(F_BASE, 16 * KiB_)}, 0},
    {"base_addr_aligned_kb:1,base_addr_aligned_kb:2", {U(F_BASE, 2 * KiB_)}, 0},
    /* page_size */
    {"page_size:1g", {U(F_PAGE1G, 1)}, 0},
    /* segment_size_mb (deprecated, one warning) */
    {"segment_size_mb:20", {U(F_SEG, 20 * MiB_)}, 1},
    {"segment_size_mb:512", {U(F_SEG, 512 * MiB_)}, 1},
    {"segment_size_mb:020", {U(F_SEG, 20 * MiB_)}, 1},
    {"segment_size_mb:64,segment_size_mb:128", {U(F_SEG, 128 * MiB_)}, 1},
    /* per_process_memory_fraction: [0, 1] */
    {"per_process_memory_fraction:0", {D(F_FRAC, 0.0)}, 0},
    {"per_process_memory_fraction:0.5", {D(F_FRAC, 0.5)}, 0},
    {"per_process_memory_fraction:1", {D(F_FRAC, 1.0)}, 0},
    {"per_process_memory_fraction:1.0e0", {D(F_FRAC, 1.0)}, 0},
    /* NPU booleans */
    {"release_lock_on_npumalloc:True", {U(F_RELEASE, 1)}, 0},
    {"throw_on_npumalloc_oom:True", {U(F_THROW, 1)}, 0},
    {"multi_stream_lazy_reclaim:True", {U(F_LAZY, 1)}, 0},
    {"pin_memory_expandable_segments:True", {U(F_PINEXP, 1)}, 0},
    {"pinned_mem_register:True", {U(F_PINREG, 1)}, 0},
    {"pinned_mem_register:False,release_lock_on_npumalloc:False", {{0}}, 0},
    {"pin_memory_expandable_segments:True,pinned_mem_register:True", {U(F_PINEXP, 1)}, 1},
    /* everything at once */
    {"max_split_size_mb:64,max_non_split_rounding_mb:40,garbage_collection_threshold:0.25,"
     "pinned_use_background_threads:True,release_lock_on_npumalloc:True,throw_on_npumalloc_oom:True,"
     "multi_stream_lazy_reclaim:True,per_process_memory_fraction:0.75",
     {U(F_MAX_SPLIT, 64 * MiB_), U(F_NON_SPLIT, 40 * MiB_), D(F_GC, 0.25), U(F_BG, 1), U(F_RELEASE, 1),
      U(F_THROW, 1), U(F_LAZY, 1), D(F_FRAC, 0.75)},
     0},
};

static void test_valid_table(void **state)
{
    (void)state;
    for (size_t c = 0; c < sizeof valid_cases / sizeof valid_cases[0]; c++) {
        const valid_case *vc = &valid_cases[c];
        alloc_settings s, want;
        conf_result r;
        alloc_settings_default(&s);
        alloc_settings_default(&want);
        for (int k = 0; k < 8 && vc->expect[k].f != F_END; k++)
            set_field(&want, vc->expect[k]);
        conf_status st = alloc_conf_parse(vc->text, &s, NULL, NULL, &r);
        if (st != CONF_OK)
            fail_msg("case %zu '%s': %s: %s", c, vc->text, alloc_conf_status_name(st), r.message);
        assert_int_equal(r.status, CONF_OK);
        assert_string_equal(r.message, "");
        assert_int_equal(r.error_code, CONF_ERR_NONE);
        assert_int_equal(r.error_subsystem, CONF_SUB_NONE);
        if (r.warning_count != vc->warnings)
            fail_msg("case %zu '%s': %d warnings", c, vc->text, r.warning_count);
        assert_settings_eq(&s, &want);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * roundup_power2_divisions: exact bucket arrays
 * ------------------------------------------------------------------------------------------------------- */

typedef struct roundup_case {
    const char *text;
    size_t div[NB];
} roundup_case;

static const roundup_case roundup_cases[] = {
    {"roundup_power2_divisions:4", {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4}},
    {"roundup_power2_divisions:1", {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}},
    {"roundup_power2_divisions:4096", {4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096,
                                       4096, 4096, 4096, 4096}},
    {"roundup_power2_divisions:[256:1,512:2,>:8]", {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 8, 8, 8, 8, 8, 8}},
    {"roundup_power2_divisions: [ 256 : 1 , 512 : 2 , > : 8 ] ", {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 8, 8, 8, 8, 8, 8}},
    {"roundup_power2_divisions:[64:8,256:4,1024:4,>:1]", {8, 8, 8, 8, 8, 8, 8, 0, 4, 0, 4, 1, 1, 1, 1, 1}},
    {"roundup_power2_divisions:[>:8]", {0, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8}},
    {"roundup_power2_divisions:[>:8,256:1]", {1, 1, 1, 1, 1, 1, 1, 1, 1, 8, 8, 8, 8, 8, 8, 8}},
    {"roundup_power2_divisions:[1:4]", {4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
    {"roundup_power2_divisions:[1024:4,4096:2]", {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 2, 0, 0, 0}},
    {"roundup_power2_divisions:[32768:2]", {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2}},
    {"roundup_power2_divisions:[65536:2]", {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2}},
    {"roundup_power2_divisions:[1048576:4,1:2]", {2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4}},
    {"roundup_power2_divisions:[9223372036854775808:16]",
     {16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16}},
    {"roundup_power2_divisions:[256:0]", {0}},
    {"roundup_power2_divisions:[256:1,256:2]", {1, 1, 1, 1, 1, 1, 1, 1, 2, 0, 0, 0, 0, 0, 0, 0}},
    {"roundup_power2_divisions:[]", {0}},
    {"roundup_power2_divisions:[256:1,]", {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0}},
    {"roundup_power2_divisions:[256,1]", {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0}}, /* ':' unchecked */
    {"roundup_power2_divisions:[256:1],max_split_size_mb:64", {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0}},
};

static void test_roundup_table(void **state)
{
    (void)state;
    for (size_t c = 0; c < sizeof roundup_cases / sizeof roundup_cases[0]; c++) {
        alloc_settings s;
        conf_result r;
        alloc_settings_default(&s);
        conf_status st = alloc_conf_parse(roundup_cases[c].text, &s, NULL, NULL, &r);
        if (st != CONF_OK)
            fail_msg("case '%s': %s", roundup_cases[c].text, r.message);
        for (int k = 0; k < NB; k++)
            if (s.roundup_power2_divisions[k] != roundup_cases[c].div[k])
                fail_msg("case '%s': bucket %d = %zu, want %zu", roundup_cases[c].text, k,
                         s.roundup_power2_divisions[k], roundup_cases[c].div[k]);
    }
}

static void test_roundup_lookup(void **state)
{
    (void)state;
    alloc_settings s;
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("roundup_power2_divisions:[256:1,512:2,>:8]", &s, NULL, NULL, NULL), CONF_OK);
    assert_int_equal(alloc_conf_roundup_divisions(&s, 0), 1);
    assert_int_equal(alloc_conf_roundup_divisions(&s, 1), 1);
    assert_int_equal(alloc_conf_roundup_divisions(&s, MiB_), 1);
    assert_int_equal(alloc_conf_roundup_divisions(&s, 256 * MiB_), 1);
    assert_int_equal(alloc_conf_roundup_divisions(&s, 512 * MiB_ - 1), 1);
    assert_int_equal(alloc_conf_roundup_divisions(&s, 512 * MiB_), 2);
    assert_int_equal(alloc_conf_roundup_divisions(&s, GiB_ - 1), 2);
    assert_int_equal(alloc_conf_roundup_divisions(&s, GiB_), 8);
    assert_int_equal(alloc_conf_roundup_divisions(&s, SIZE_MAX), 8);
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("roundup_power2_divisions:[2:4,>:2]", &s, NULL, NULL, NULL), CONF_OK);
    assert_int_equal(alloc_conf_roundup_divisions(&s, 2 * MiB_ - 1), 4); /* bucket 0 (filled below) */
    assert_int_equal(alloc_conf_roundup_divisions(&s, 2 * MiB_), 4);     /* bucket 1 */
    assert_int_equal(alloc_conf_roundup_divisions(&s, 4 * MiB_), 2);     /* bucket 2 */
    assert_int_equal(alloc_conf_roundup_divisions(&s, 64 * GiB_), 2);    /* bucket 15 */
}

/* Every parse resets max_split_size, roundup_power2_divisions and garbage_collection_threshold, and
   max_non_split_rounding_size (= large_segment_size); every other setting persists. */
static void test_reset_and_persist(void **state)
{
    (void)state;
    alloc_settings s;
    conf_result r;
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("max_split_size_mb:100,garbage_collection_threshold:0.5,"
                                      "roundup_power2_divisions:4,max_non_split_rounding_mb:64,"
                                      "large_segment_size_mb:32,base_addr_aligned_kb:4,release_lock_on_npumalloc:True,"
                                      "pinned_max_cached_size_mb:8",
                                      &s, NULL, NULL, &r),
                     CONF_OK);
    assert_true(s.max_non_split_rounding_size == 64 * MiB_);
    assert_int_equal(alloc_conf_parse("pinned_use_background_threads:True", &s, NULL, NULL, &r), CONF_OK);
    assert_true(s.max_split_size == SIZE_MAX);
    assert_true(s.garbage_collection_threshold == 0.0);
    assert_int_equal(s.roundup_power2_divisions[3], 0);
    assert_true(s.max_non_split_rounding_size == 32 * MiB_); /* the persisted large segment size */
    assert_true(s.large_segment_size == 32 * MiB_);
    assert_true(s.base_addr_aligned_size == 4 * KiB_);
    assert_true(s.release_lock_on_npumalloc);
    assert_true(s.pinned_max_cached_size == 8 * MiB_);
    assert_true(s.pinned_use_background_threads);
    /* the persisted large segment size is also the max_split_size_mb minimum */
    assert_int_equal(alloc_conf_parse("max_split_size_mb:20", &s, NULL, NULL, &r), CONF_VALUE_ERROR);
    assert_string_equal(r.message, "CachingAllocator option max_split_size_mb too small, must be >= 32");
    /* NULL text: variable unset, nothing happens */
    alloc_settings before = s;
    assert_int_equal(alloc_conf_parse(NULL, &s, NULL, NULL, &r), CONF_OK);
    assert_settings_eq(&s, &before);
}

/* ---------------------------------------------------------------------------------------------------------
 * Errors: exact messages, exception types and suffix codes
 * ------------------------------------------------------------------------------------------------------- */

typedef struct err_case {
    const char *text;
    conf_status st;
    int sub, code;
    const char *msg;
} err_case;

#define RT CONF_RUNTIME_ERROR
#define VE CONF_VALUE_ERROR
#define NOSUF CONF_SUB_NONE, CONF_ERR_NONE
#define OPS_V CONF_SUB_OPS, CONF_ERR_VALUE
#define OPS_P CONF_SUB_OPS, CONF_ERR_PARAM
#define PTA_V CONF_SUB_PTA, CONF_ERR_VALUE
#define PTA_P CONF_SUB_PTA, CONF_ERR_PARAM
#define OOB "Index out of bounds in ConfigTokenizer"
#define NOCLOSE "Expected closing bracket ']' in ConfigTokenizer but reached end of config"
#define CONFLICT                                                                                            \
    "`max_split_size_mb` or `garbage_collection_threshold`, cannot be enabled with `expandable_segments`, " \
    "please set `expandable_segments` to `False`."
#define GC_MSG "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"
#define ALIGN_MSG "CachingAllocator option base_addr_aligned_kb error, must be [0~16], dtype is int"
#define SEG_MSG "CachingAllocator option segment_size_mb error, must be [20, 512], dtype is int"
#define FRAC_MSG "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"
#define NOCONV(v, k, f) "Invalid value '" v "' for allocator option " k " (std::" f ": no conversion could be performed)"
#define RANGE(v, k, f) "Invalid value '" v "' for allocator option " k " (std::" f ": out of range)"

static const err_case err_cases[] = {
    /* key validation (runs first) */
    {"foo:1", VE, OPS_V, "Unrecognized key 'foo' in NPU allocator config, "},
    {"max_split_size_mb:abc,foo:1", VE, OPS_V, "Unrecognized key 'foo' in NPU allocator config, "},
    {"max_split_size_mb:1,roundup_power2_divisions:[1:3,2:5],bar:[x]", VE, OPS_V,
     "Unrecognized key 'bar' in NPU allocator config, "},
    {"Max_split_size_mb:128", VE, OPS_V, "Unrecognized key 'Max_split_size_mb' in NPU allocator config, "},
    {"backend:native", VE, OPS_V, "Unrecognized key 'backend' in NPU allocator config, "},
    {"release_lock_on_cudamalloc:True", VE, OPS_V,
     "Unrecognized key 'release_lock_on_cudamalloc' in NPU allocator config, "},
    {"max split size mb:1", VE, OPS_V, "Unrecognized key 'maxsplitsizemb' in NPU allocator config, "},
    {":", VE, OPS_V, "Unrecognized key ':' in NPU allocator config, "},
    {",", VE, OPS_V, "Unrecognized key ',' in NPU allocator config, "},
    {",max_split_size_mb:128", VE, OPS_V, "Unrecognized key ',' in NPU allocator config, "},
    {"max_split_size_mb:100:200", VE, OPS_V, "Unrecognized key '200' in NPU allocator config, "},
    {"roundup_power2_divisions:[256]1]", VE, OPS_V, "Unrecognized key ']' in NPU allocator config, "},
    {"pinned_free_catch_all:True", RT, OPS_V, "torch_npu not support key 'pinned_free_catch_all' in NPU allocator config, "},
    {"expandable_segments_reserve:1", RT, OPS_V,
     "torch_npu not support key 'expandable_segments_reserve' in NPU allocator config, "},
    {"max_split_size_mb:5,expandable_segments_reserve_by_class:x", RT, OPS_V,
     "torch_npu not support key 'expandable_segments_reserve_by_class' in NPU allocator config, "},
    /* tokenizer bounds: a missing value after any key (c10's walk runs before the NPU pass) */
    {"max_split_size_mb", RT, NOSUF, OOB},
    {"max_split_size_mb:", RT, NOSUF, OOB},
    {"garbage_collection_threshold:", RT, NOSUF, OOB},
    {"expandable_segments:", RT, NOSUF, OOB},
    {"large_segment_size_mb:", RT, NOSUF, OOB},
    {"max_split_size_mb:64,large_segment_size_mb", RT, NOSUF, OOB},
    {"base_addr_aligned_kb:", RT, NOSUF, OOB},
    {"release_lock_on_npumalloc", RT, NOSUF, OOB},
    {"page_size", RT, NOSUF, OOB},
    {"page_size:", RT, NOSUF, OOB},
    {"pinned_reserve_segment_size_mb:", RT, NOSUF, OOB},
    {"per_process_memory_fraction:", RT, NOSUF, OOB},
    {"segment_size_mb:", RT, NOSUF, OOB},
    {"base_addr_aligned_kb:[1,2", RT, NOSUF, NOCLOSE},
    /* max_split_size_mb / max_non_split_rounding_mb / large_segment_size_mb */
    {"max_split_size_mb:19", VE, NOSUF, "CachingAllocator option max_split_size_mb too small, must be >= 20"},
    {"max_split_size_mb:0", VE, NOSUF, "CachingAllocator option max_split_size_mb too small, must be >= 20"},
    {"max_split_size_mb:19.9", VE, NOSUF, "CachingAllocator option max_split_size_mb too small, must be >= 20"},
    {"large_segment_size_mb:64,max_split_size_mb:32", VE, NOSUF,
     "CachingAllocator option max_split_size_mb too small, must be >= 64"},
    {"max_non_split_rounding_mb:19", VE, NOSUF,
     "CachingAllocator option max_non_split_rounding_mb too small, must be >= 20"},
    {"max_non_split_rounding_mb:30,large_segment_size_mb:31", VE, NOSUF,
     "CachingAllocator option max_non_split_rounding_mb too small, must be >= 31"},
    {"large_segment_size_mb:10", VE, NOSUF, "CachingAllocator option large_segment_size_mb must be > 10 MB"},
    {"large_segment_size_mb:0", VE, NOSUF, "CachingAllocator option large_segment_size_mb must be > 10 MB"},
    {"max_split_size_mb:5,large_segment_size_mb:5", VE, NOSUF,
     "CachingAllocator option large_segment_size_mb must be > 10 MB"},
    {"max_split_size_mb:abc", RT, NOSUF, NOCONV("abc", "max_split_size_mb", "stoull")},
    {"max_split_size_mb:-", RT, NOSUF, NOCONV("-", "max_split_size_mb", "stoull")},
    {"max_split_size_mb:[", RT, NOSUF, NOCONV("[", "max_split_size_mb", "stoull")},
    {"max_split_size_mb:99999999999999999999", RT, NOSUF,
     RANGE("99999999999999999999", "max_split_size_mb", "stoull")},
    {"max_non_split_rounding_mb:x", RT, NOSUF, NOCONV("x", "max_non_split_rounding_mb", "stoull")},
    {"large_segment_size_mb:x", RT, NOSUF, NOCONV("x", "large_segment_size_mb", "stoull")},
    {"pinned_max_round_threshold_mb:x", RT, NOSUF, NOCONV("x", "pinned_max_round_threshold_mb", "stoull")},
    {"pinned_max_cached_size_mb:", RT, NOSUF, OOB},
    {"pinned_reserve_segment_size_mb:big", RT, NOSUF, NOCONV("big", "pinned_reserve_segment_size_mb", "stoull")},
    /* garbage_collection_threshold */
    {"garbage_collection_threshold:0", VE, NOSUF, GC_MSG},
    {"garbage_collection_threshold:1", VE, NOSUF, GC_MSG},
    {"garbage_collection_threshold:1.0", VE, NOSUF, GC_MSG},
    {"garbage_collection_threshold:-0.5", VE, NOSUF, GC_MSG},
    {"garbage_collection_threshold:nan", VE, NOSUF, GC_MSG},
    {"garbage_collection_threshold:inf", VE, NOSUF, GC_MSG},
    {"garbage_collection_threshold:abc", RT, NOSUF, NOCONV("abc", "garbage_collection_threshold", "stod")},
    {"garbage_collection_threshold:1e999", RT, NOSUF, RANGE("1e999", "garbage_collection_threshold", "stod")},
    {"garbage_collection_threshold:1e-400", RT, NOSUF, RANGE("1e-400", "garbage_collection_threshold", "stod")},
    /* roundup_power2_divisions */
    {"roundup_power2_divisions:3", VE, NOSUF, "For roundups, the divisions has to be power of 2 "},
    {"roundup_power2_divisions:0", VE, NOSUF, "For roundups, the divisions has to be power of 2 "},
    {"roundup_power2_divisions:[256:3]", VE, NOSUF,
     "For roundups, the divisions has to be power of 2 or 0 to disable roundup "},
    {"roundup_power2_divisions:[>:6]", VE, NOSUF,
     "For roundups, the divisions has to be power of 2 or 0 to disable roundup "},
    {"roundup_power2_divisions:[255:1]", VE, NOSUF, "For roundups, the intervals have to be power of 2 "},
    {"roundup_power2_divisions:[0:1]", VE, NOSUF, "For roundups, the intervals have to be power of 2 "},
    {"roundup_power2_divisions:[abc:1]", RT, NOSUF, NOCONV("abc", "roundup_power2_divisions", "stoull")},
    {"roundup_power2_divisions:[256:x]", RT, NOSUF, NOCONV("x", "roundup_power2_divisions", "stoull")},
    {"roundup_power2_divisions:abc", RT, NOSUF, NOCONV("abc", "roundup_power2_divisions", "stoull")},
    {"roundup_power2_divisions:", RT, NOSUF, OOB},
    {"roundup_power2_divisions:[256", RT, NOSUF, OOB},
    {"roundup_power2_divisions:[256:", RT, NOSUF, OOB},
    {"roundup_power2_divisions:[256:1", RT, NOSUF, OOB},
    {"roundup_power2_divisions:[256:1,", RT, NOSUF, NOCLOSE},
    {"roundup_power2_divisions:[", RT, NOSUF, NOCLOSE},
    /* c10 booleans: toBool (the index is the token index) */
    {"expandable_segments:true", VE, NOSUF, "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'"},
    {"max_split_size_mb:100,expandable_segments:1", VE, NOSUF,
     "Expected 'True' or 'False' at index 6 in ConfigTokenizer but got '1'"},
    {"pinned_use_background_threads:yes", VE, NOSUF,
     "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'yes'"},
    {"expandable_segments:[True]", VE, NOSUF, "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got '['"},
    /* the expandable cross-check (before the probe) */
    {"expandable_segments:True,max_split_size_mb:100", RT, OPS_P, CONFLICT},
    {"max_split_size_mb:-1,expandable_segments:True", RT, OPS_P, CONFLICT},
    {"expandable_segments:True,garbage_collection_threshold:0.5", RT, OPS_P, CONFLICT},
    {"expandable_segments:True,max_split_size_mb:100,base_addr_aligned_kb:99", RT, OPS_P, CONFLICT},
    /* base_addr_aligned_kb */
    {"base_addr_aligned_kb:17", RT, OPS_V, ALIGN_MSG},
    {"base_addr_aligned_kb:016", RT, OPS_V, ALIGN_MSG},
    {"base_addr_aligned_kb:00", RT, OPS_V, ALIGN_MSG},
    {"base_addr_aligned_kb:2147483647", RT, OPS_V, ALIGN_MSG},
    {"base_addr_aligned_kb:-1", RT, NOSUF, "CachingAllocator option base_addr_aligned_kb is invalid."},
    {"base_addr_aligned_kb:+1", RT, NOSUF, "CachingAllocator option base_addr_aligned_kb is invalid."},
    {"base_addr_aligned_kb:1.5", RT, NOSUF, "CachingAllocator option base_addr_aligned_kb is invalid."},
    {"base_addr_aligned_kb:abc", RT, NOSUF, "CachingAllocator option base_addr_aligned_kb is invalid."},
    {"base_addr_aligned_kb:2147483648", RT, NOSUF, RANGE("2147483648", "base_addr_aligned_kb", "stoi")},
    {"base_addr_aligned_kb:99999999999999999999999", RT, NOSUF,
     RANGE("99999999999999999999999", "base_addr_aligned_kb", "stoi")},
    /* page_size */
    {"page_size:2g", RT, OPS_V, "Unsupported page_size value: 2g"},
    {"page_size:1G", RT, OPS_V, "Unsupported page_size value: 1G"},
    {"page_size:1gb", RT, OPS_V, "Unsupported page_size value: 1gb"},
    /* segment_size_mb */
    {"segment_size_mb:19", RT, OPS_V, SEG_MSG},
    {"segment_size_mb:513", RT, OPS_V, SEG_MSG},
    {"segment_size_mb:0", RT, OPS_V, SEG_MSG},
    {"segment_size_mb:abc", RT, NOSUF, "CachingAllocator option segment_size_mb is invalid."},
    {"segment_size_mb:-20", RT, NOSUF, "CachingAllocator option segment_size_mb is invalid."},
    {"segment_size_mb:99999999999", RT, NOSUF, RANGE("99999999999", "segment_size_mb", "stoi")},
    /* per_process_memory_fraction */
    {"per_process_memory_fraction:1.5", RT, PTA_V, FRAC_MSG},
    {"per_process_memory_fraction:-0.1", RT, PTA_V, FRAC_MSG},
    {"per_process_memory_fraction:nan", RT, PTA_V, FRAC_MSG},
    {"per_process_memory_fraction:abc", RT, NOSUF, NOCONV("abc", "per_process_memory_fraction", "stod")},
    {"per_process_memory_fraction:1e-999", RT, NOSUF, RANGE("1e-999", "per_process_memory_fraction", "stod")},
    /* NPU booleans */
    {"pin_memory_expandable_segments:1", RT, OPS_P,
     "Expected a single True/False argument for pin_memory_expandable_segments"},
    {"pinned_mem_register:true", RT, OPS_P, "Expected a single True/False argument for pinned_mem_register"},
    {"multi_stream_lazy_reclaim:x", RT, PTA_P, "Expected a single True/False argument for multi_stream_lazy_reclaim"},
    {"release_lock_on_npumalloc:yes", RT, PTA_P, "Expected a single True/False argument for release_lock_on_npumalloc"},
    {"throw_on_npumalloc_oom:TRUE", RT, PTA_P, "Expected a single True/False argument for throw_on_npumalloc_oom"},
    /* the order of the passes: c10 errors come before NPU errors */
    {"base_addr_aligned_kb:99,max_split_size_mb:1", VE, NOSUF,
     "CachingAllocator option max_split_size_mb too small, must be >= 20"},
    {"page_size:2g,base_addr_aligned_kb:99", RT, OPS_V, "Unsupported page_size value: 2g"},
};

static void test_error_table(void **state)
{
    (void)state;
    for (size_t c = 0; c < sizeof err_cases / sizeof err_cases[0]; c++) {
        const err_case *ec = &err_cases[c];
        alloc_settings s, before;
        conf_result r;
        alloc_settings_default(&s);
        s.max_non_split_rounding_size = 77 * MiB_; /* would be reset by a committed parse */
        s.roundup_power2_divisions[5] = 8;
        before = s;
        conf_status st = alloc_conf_parse(ec->text, &s, NULL, NULL, &r);
        if (st != ec->st || strcmp(r.message, ec->msg) != 0 || r.error_subsystem != ec->sub ||
            r.error_code != ec->code)
            fail_msg("case %zu '%s': got %s [%d/%d] '%s'", c, ec->text, alloc_conf_status_name(st),
                     r.error_subsystem, r.error_code, r.message);
        assert_int_equal(r.status, st);
        assert_settings_eq(&s, &before); /* unchanged on error */
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Warnings, probe
 * ------------------------------------------------------------------------------------------------------- */

#define W_EXP "expandable_segments setting failure, now change to `False`."
#define W_DEPR "`segment_size_mb` is deprecated, please use `large_segment_size_mb` instead."
#define W_PINREG                                                                                            \
    "pinned_mem_register setting failure, this feature is not supported when pin_memory_expandable_segments " \
    "is set to `True`, now change to `False`."
#define W_BOTH                                                                                             \
    "Both `segment_size_mb` and `large_segment_size_mb` are set. `segment_size_mb` is deprecated. It is " \
    "recommended to use only `large_segment_size_mb`."
#define W_PAGE                                                                                             \
    "`page_size:1g` is set, which will override `large_segment_size_mb` and `segment_size_mb` for large " \
    "pool allocations (size > 1MB). It is recommended to use only `page_size:1g`."

typedef struct warn_case {
    const char *text;
    bool probe_fails;
    conf_status st;
    const char *w[6]; /* NULL-terminated */
} warn_case;

static const warn_case warn_cases[] = {
    {"segment_size_mb:64", false, CONF_OK, {W_DEPR}},
    {"segment_size_mb:64,segment_size_mb:32", false, CONF_OK, {W_DEPR}},
    {"segment_size_mb:64,large_segment_size_mb:64", false, CONF_OK, {W_DEPR, W_BOTH}},
    {"segment_size_mb:64,large_segment_size_mb:20", false, CONF_OK, {W_DEPR}}, /* 20 MiB counts as unset */
    {"page_size:1g,segment_size_mb:64", false, CONF_OK, {W_DEPR, W_PAGE}},
    {"page_size:1g,large_segment_size_mb:64", false, CONF_OK, {W_PAGE}},
    {"page_size:1g", false, CONF_OK, {NULL}},
    {"pin_memory_expandable_segments:True,pinned_mem_register:True", false, CONF_OK, {W_PINREG}},
    {"expandable_segments:True", true, CONF_OK, {W_EXP}},
    {"expandable_segments:True", false, CONF_OK, {NULL}},
    {"expandable_segments:False", true, CONF_OK, {NULL}},
    {"expandable_segments:True,segment_size_mb:64,large_segment_size_mb:64,page_size:1g,"
     "pin_memory_expandable_segments:True,pinned_mem_register:True",
     true, CONF_OK, {W_EXP, W_DEPR, W_PINREG, W_BOTH, W_PAGE}},
    /* warnings emitted before an error are still reported */
    {"segment_size_mb:5", false, CONF_RUNTIME_ERROR, {W_DEPR}},
    {"expandable_segments:True,base_addr_aligned_kb:17", true, CONF_RUNTIME_ERROR, {W_EXP}},
};

static void test_warning_table(void **state)
{
    (void)state;
    for (size_t c = 0; c < sizeof warn_cases / sizeof warn_cases[0]; c++) {
        const warn_case *wc = &warn_cases[c];
        alloc_settings s;
        conf_result r;
        alloc_settings_default(&s);
        conf_status st = alloc_conf_parse(wc->text, &s, wc->probe_fails ? probe_fail : probe_ok, NULL, &r);
        if (st != wc->st)
            fail_msg("case '%s': %s '%s'", wc->text, alloc_conf_status_name(st), r.message);
        int n = 0;
        while (wc->w[n])
            n++;
        if (r.warning_count != n)
            fail_msg("case '%s': %d warnings, want %d", wc->text, r.warning_count, n);
        for (int k = 0; k < n; k++)
            assert_string_equal(r.warnings[k], wc->w[k]);
    }
}

static void test_probe(void **state)
{
    (void)state;
    alloc_settings s;
    conf_result r;
    int calls = 0;

    /* not called unless expandable ends up on */
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("expandable_segments:False,max_split_size_mb:64", &s, probe_fail, &calls, &r),
                     CONF_OK);
    assert_int_equal(calls, 0);
    /* supported: called once, the rest kept */
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("expandable_segments:True,roundup_power2_divisions:4,"
                                      "max_non_split_rounding_mb:64",
                                      &s, probe_ok, &calls, &r),
                     CONF_OK);
    assert_int_equal(calls, 1);
    assert_true(s.expandable_segments);
    assert_int_equal(s.roundup_power2_divisions[0], 4);
    assert_true(s.max_non_split_rounding_size == 64 * MiB_);
    /* not called when the cross-check fails first */
    calls = 0;
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("expandable_segments:True,max_split_size_mb:64", &s, probe_ok, &calls, &r),
                     CONF_RUNTIME_ERROR);
    assert_int_equal(calls, 0);
    /* failure: warning, expandable False, and the c10 re-parse of "expandable_segments:False" also resets
       roundup_power2_divisions and max_non_split_rounding_size, as in torch_npu */
    calls = 0;
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("expandable_segments:True,roundup_power2_divisions:4,"
                                      "max_non_split_rounding_mb:64,large_segment_size_mb:32,base_addr_aligned_kb:0",
                                      &s, probe_fail, &calls, &r),
                     CONF_OK);
    assert_int_equal(calls, 1);
    assert_false(s.expandable_segments);
    assert_true(s.expandable_segments_explicit);
    assert_int_equal(s.roundup_power2_divisions[0], 0);
    assert_true(s.max_non_split_rounding_size == 32 * MiB_);
    assert_true(s.large_segment_size == 32 * MiB_);
    assert_true(s.base_addr_aligned_size == 0);
    assert_int_equal(r.warning_count, 1);
    assert_string_equal(r.warnings[0], W_EXP);
    /* any other failure of the reserve: NPU_CHECK_ERROR raises, nothing changes, no warning */
    calls = 0;
    alloc_settings_default(&s);
    alloc_settings before = s;
    assert_int_equal(alloc_conf_parse("expandable_segments:True,large_segment_size_mb:32", &s, probe_error, &calls, &r),
                     CONF_RUNTIME_ERROR);
    assert_int_equal(calls, 1);
    assert_string_equal(r.message, "NPU function error: aclrtReserveMemAddress, error code is 207001");
    assert_int_equal(r.warning_count, 0);
    assert_settings_eq(&s, &before);
    assert_int_equal(alloc_conf_parse_runtime("expandable_segments:True", &s, probe_error, &calls, &r),
                     CONF_RUNTIME_ERROR);
    assert_int_equal(calls, 2);
    assert_settings_eq(&s, &before);
}

/* ---------------------------------------------------------------------------------------------------------
 * _set_allocator_settings
 * ------------------------------------------------------------------------------------------------------- */

#define UNSUP(k) "torch_npu.npu.memory._set_allocator_settings() unsupported setting: " k

static const err_case runtime_errs[] = {
    {"base_addr_aligned_kb:16", RT, OPS_V, UNSUP("base_addr_aligned_kb")},
    {"foo:1", RT, OPS_V, UNSUP("foo")},
    {"page_size", RT, OPS_V, UNSUP("page_size")},
    {"segment_size_mb:64", RT, OPS_V, UNSUP("segment_size_mb")},
    {"garbage_collection_threshold:0.5", RT, OPS_V, UNSUP("garbage_collection_threshold")},
    {"roundup_power2_divisions:4", RT, OPS_V, UNSUP("roundup_power2_divisions")},
    {"large_segment_size_mb:64", RT, OPS_V, UNSUP("large_segment_size_mb")},
    {"pinned_use_background_threads:True", RT, OPS_V, UNSUP("pinned_use_background_threads")},
    {"pin_memory_expandable_segments:True", RT, OPS_V, UNSUP("pin_memory_expandable_segments")},
    {"pinned_mem_register:True", RT, OPS_V, UNSUP("pinned_mem_register")},
    {"multi_stream_lazy_reclaim:True", RT, OPS_V, UNSUP("multi_stream_lazy_reclaim")},
    {"pinned_reserve_segment_size_mb:64", RT, OPS_V, UNSUP("pinned_reserve_segment_size_mb")},
    {"release_lock_on_npumalloc:True,pinned_free_catch_all:True", RT, OPS_V, UNSUP("pinned_free_catch_all")},
    {"base_addr_aligned_kb:16,max_split_size_mb:1", RT, OPS_V, UNSUP("base_addr_aligned_kb")},
    /* the NPU missing-value messages are reachable here: no c10 walk runs first */
    {"release_lock_on_npumalloc:", RT, PTA_P, "Error, expecting release_lock_on_npumalloc value"},
    {"throw_on_npumalloc_oom:", RT, PTA_P, "Error, expecting throw_on_npumalloc_oom value"},
    {"per_process_memory_fraction:", RT, PTA_V, "Error, expecting per_process_memory_fraction value"},
    {"release_lock_on_npumalloc", RT, NOSUF, OOB},
    {"per_process_memory_fraction:2,max_split_size_mb:1", RT, PTA_V, FRAC_MSG},
    {"throw_on_npumalloc_oom:1", RT, PTA_P, "Expected a single True/False argument for throw_on_npumalloc_oom"},
    /* the first c10 key hands the whole string to c10 */
    {"max_split_size_mb:1,base_addr_aligned_kb:16", VE, NOSUF,
     "CachingAllocator option max_split_size_mb too small, must be >= 20"},
    {"release_lock_on_npumalloc:True,max_split_size_mb", RT, NOSUF, OOB},
    {"max_non_split_rounding_mb:5", VE, NOSUF, "CachingAllocator option max_non_split_rounding_mb too small, must be >= 20"},
    {"expandable_segments:yes", VE, NOSUF, "Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'yes'"},
    {"expandable_segments:True,max_split_size_mb:100", RT, OPS_P, CONFLICT},
    {"pinned_max_cached_size_mb:x", RT, NOSUF, NOCONV("x", "pinned_max_cached_size_mb", "stoull")},
    /* c10 (with torch_npu's hook registered) checks every key of the string against the registered keys */
    {"max_split_size_mb:64,foo:1", VE, NOSUF, "Unrecognized key 'foo' in Accelerator allocator config."},
    {"release_lock_on_npumalloc:True,expandable_segments:False,backend:native", VE, NOSUF,
     "Unrecognized key 'backend' in Accelerator allocator config."},
    {"max_split_size_mb:64,base_addr_aligned_kb:16", RT, OPS_V, UNSUP("base_addr_aligned_kb")},
    {"max_split_size_mb:64,pinned_free_catch_all:1", RT, OPS_V, UNSUP("pinned_free_catch_all")},
};

/* What each text of runtime_errs leaves set: torch_npu parses a run-time text straight into its settings
   (its own and c10's, which c10's pass resets first), so what came before the error stays.  From
   max_split_size 128 MiB, release_lock_on_npumalloc and expandable_segments_explicit off. */
typedef struct after_error {
    size_t max_split_size;
    bool release_lock, expandable_explicit;
} after_error;
#define KEPT {128 * MiB_, false, false}
#define RESET {SIZE_MAX, false, false}
static const after_error runtime_errs_after[] = {
    KEPT, KEPT, KEPT, KEPT, KEPT, KEPT, KEPT, KEPT, KEPT, KEPT, KEPT, KEPT,
    {128 * MiB_, true, false}, /* release_lock_on_npumalloc:True came first */
    KEPT, KEPT, KEPT, KEPT, KEPT, KEPT, KEPT,
    RESET,                     /* c10's pass reset max_split_size, then failed */
    {SIZE_MAX, true, false}, RESET, RESET,
    KEPT,                      /* the expandable cross-check (after the parse): nothing is kept */
    RESET, {64 * MiB_, false, false}, {SIZE_MAX, true, true}, {64 * MiB_, false, false}, {64 * MiB_, false, false},
};

static void test_runtime_errors(void **state)
{
    (void)state;
    assert_int_equal(sizeof runtime_errs / sizeof runtime_errs[0],
                     sizeof runtime_errs_after / sizeof runtime_errs_after[0]);
    for (size_t c = 0; c < sizeof runtime_errs / sizeof runtime_errs[0]; c++) {
        const err_case *ec = &runtime_errs[c];
        alloc_settings s, want;
        conf_result r;
        alloc_settings_default(&s);
        s.max_split_size = 128 * MiB_;
        want = s;
        want.max_split_size = runtime_errs_after[c].max_split_size;
        want.release_lock_on_npumalloc = runtime_errs_after[c].release_lock;
        want.expandable_segments_explicit = runtime_errs_after[c].expandable_explicit;
        conf_status st = alloc_conf_parse_runtime(ec->text, &s, NULL, NULL, &r);
        if (st != ec->st || strcmp(r.message, ec->msg) != 0 || r.error_subsystem != ec->sub ||
            r.error_code != ec->code)
            fail_msg("case %zu '%s': got %s [%d/%d] '%s'", c, ec->text, alloc_conf_status_name(st),
                     r.error_subsystem, r.error_code, r.message);
        assert_settings_eq(&s, &want);
    }
    /* c10's pass also drops a start-up garbage_collection_threshold and roundup_power2_divisions, and NPU
       values parsed before the error stay, the fraction included */
    alloc_settings s, want;
    conf_result r;
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("garbage_collection_threshold:0.5,roundup_power2_divisions:4,"
                                      "large_segment_size_mb:32", &s, NULL, NULL, &r), CONF_OK);
    want = s;
    want.garbage_collection_threshold = 0;
    memset(want.roundup_power2_divisions, 0, sizeof want.roundup_power2_divisions);
    want.throw_on_npumalloc_oom = true;
    want.per_process_memory_fraction = 0.25;
    want.per_process_memory_fraction_set = true;
    want.max_non_split_rounding_size = 32 * MiB_;
    assert_int_equal(alloc_conf_parse_runtime("throw_on_npumalloc_oom:True,per_process_memory_fraction:0.25,"
                                              "max_non_split_rounding_mb:31", &s, NULL, NULL, &r),
                     CONF_VALUE_ERROR);
    assert_string_equal(r.message, "CachingAllocator option max_non_split_rounding_mb too small, must be >= 32");
    assert_settings_eq(&s, &want);
}

static void test_runtime_valid(void **state)
{
    (void)state;
    alloc_settings s, want;
    conf_result r;
    int calls = 0;

    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("max_split_size_mb:128,roundup_power2_divisions:2,base_addr_aligned_kb:4",
                                      &s, NULL, NULL, &r),
                     CONF_OK);
    /* no c10 key: nothing c10-side is reset */
    want = s;
    want.release_lock_on_npumalloc = true;
    want.per_process_memory_fraction = 0.5;
    want.per_process_memory_fraction_set = true;
    assert_int_equal(alloc_conf_parse_runtime("release_lock_on_npumalloc:True,per_process_memory_fraction:0.5",
                                              &s, probe_fail, &calls, &r),
                     CONF_OK);
    assert_settings_eq(&s, &want);
    assert_int_equal(calls, 0);
    /* a c10 key: c10 parses the whole string, resetting max_split_size / roundup / gc */
    want.max_split_size = SIZE_MAX;
    memset(want.roundup_power2_divisions, 0, sizeof want.roundup_power2_divisions);
    want.max_non_split_rounding_size = 30 * MiB_;
    want.throw_on_npumalloc_oom = true;
    want.pinned_max_round_threshold = 64 * MiB_;
    want.pinned_max_cached_size = 32 * MiB_;
    want.expandable_segments_explicit = true;
    assert_int_equal(alloc_conf_parse_runtime("throw_on_npumalloc_oom:True,max_non_split_rounding_mb:30,"
                                              "pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:32,"
                                              "expandable_segments:False",
                                              &s, probe_fail, &calls, &r),
                     CONF_OK);
    assert_settings_eq(&s, &want);
    /* expandable on at runtime: the probe runs; failure warns and switches it off */
    assert_int_equal(alloc_conf_parse_runtime("expandable_segments:True", &s, probe_fail, &calls, &r), CONF_OK);
    assert_int_equal(calls, 1);
    assert_false(s.expandable_segments);
    assert_int_equal(r.warning_count, 1);
    assert_string_equal(r.warnings[0], W_EXP);
    assert_int_equal(alloc_conf_parse_runtime("expandable_segments:True", &s, probe_ok, &calls, &r), CONF_OK);
    assert_true(s.expandable_segments);
    assert_int_equal(alloc_conf_parse_runtime("max_split_size_mb:64,expandable_segments:False", &s, NULL, NULL, &r),
                     CONF_OK);
    assert_true(s.max_split_size == 64 * MiB_);
    assert_false(s.expandable_segments);
    /* empty / NULL / blank: nothing happens */
    want = s;
    assert_int_equal(alloc_conf_parse_runtime("", &s, NULL, NULL, &r), CONF_OK);
    assert_int_equal(alloc_conf_parse_runtime(NULL, &s, NULL, NULL, &r), CONF_OK);
    assert_int_equal(alloc_conf_parse_runtime("  ", &s, NULL, NULL, &r), CONF_OK);
    assert_settings_eq(&s, &want);
}

/* ---------------------------------------------------------------------------------------------------------
 * Environment variables
 * ------------------------------------------------------------------------------------------------------- */

static const char *env_npu, *env_generic;

static const char *fake_get(const char *name)
{
    if (strcmp(name, "PYTORCH_NPU_ALLOC_CONF") == 0)
        return env_npu;
    if (strcmp(name, "PYTORCH_ALLOC_CONF") == 0)
        return env_generic;
    return NULL;
}

static void test_env(void **state)
{
    (void)state;
    alloc_settings s, def;
    conf_result r;
    const char *used = "x";
    alloc_settings_default(&def);

    env_npu = env_generic = NULL;
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_from_env(fake_get, &s, NULL, NULL, &r, &used), CONF_OK);
    assert_null(used);
    assert_settings_eq(&s, &def);

    env_npu = "max_split_size_mb:128";
    assert_int_equal(alloc_conf_from_env(fake_get, &s, NULL, NULL, &r, &used), CONF_OK);
    assert_ptr_equal(used, env_npu);
    assert_true(s.max_split_size == 128 * MiB_);

    env_npu = NULL;
    env_generic = "base_addr_aligned_kb:0";
    assert_int_equal(alloc_conf_from_env(fake_get, &s, NULL, NULL, &r, &used), CONF_OK);
    assert_ptr_equal(used, env_generic);
    assert_true(s.base_addr_aligned_size == 0);
    assert_true(s.max_split_size == SIZE_MAX);

    env_generic = "foo:1";
    assert_int_equal(alloc_conf_from_env(fake_get, &s, NULL, NULL, &r, &used), CONF_VALUE_ERROR);
    assert_string_equal(r.message, "Unrecognized key 'foo' in NPU allocator config, ");

    alloc_settings before = s;
    env_npu = "max_split_size_mb:64";
    env_generic = "";
    assert_int_equal(alloc_conf_from_env(fake_get, &s, NULL, NULL, &r, &used), CONF_RUNTIME_ERROR);
    assert_string_equal(r.message,
                        "Both PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF have been set, please set only one of them.");
    assert_int_equal(r.error_subsystem, CONF_SUB_OPS);
    assert_int_equal(r.error_code, CONF_ERR_VALUE);
    assert_null(used);
    assert_settings_eq(&s, &before);
    assert_int_equal(alloc_conf_from_env(fake_get, &s, NULL, NULL, NULL, NULL), CONF_RUNTIME_ERROR);

    env_npu = "";
    env_generic = NULL;
    assert_int_equal(alloc_conf_from_env(fake_get, &s, NULL, NULL, &r, &used), CONF_OK);
    assert_string_equal(used, "");

    /* get == NULL reads the real environment */
    setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True", 1);
    unsetenv("PYTORCH_ALLOC_CONF");
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_from_env(NULL, &s, probe_ok, NULL, &r, &used), CONF_OK);
    assert_true(s.expandable_segments);
    setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False", 1);
    assert_int_equal(alloc_conf_from_env(NULL, &s, NULL, NULL, &r, NULL), CONF_RUNTIME_ERROR);
    unsetenv("PYTORCH_NPU_ALLOC_CONF");
    unsetenv("PYTORCH_ALLOC_CONF");
}

/* ---------------------------------------------------------------------------------------------------------
 * API edges, robustness
 * ------------------------------------------------------------------------------------------------------- */

static void test_api_edges(void **state)
{
    (void)state;
    alloc_settings s;
    conf_result r;

    assert_int_equal(alloc_conf_parse("max_split_size_mb:64", NULL, NULL, NULL, &r), CONF_RUNTIME_ERROR);
    assert_string_equal(r.message, "alloc_conf: settings pointer is NULL");
    assert_int_equal(alloc_conf_parse_runtime("max_split_size_mb:64", NULL, NULL, NULL, NULL), CONF_RUNTIME_ERROR);

    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse("foo", &s, NULL, NULL, NULL), CONF_VALUE_ERROR); /* r may be NULL */

    /* length-bounded input: a NUL ends the text; the buffer need not be terminated */
    static const char buf[] = "max_split_size_mb:128\0,foo:1";
    assert_int_equal(alloc_conf_parse_n(buf, sizeof buf, &s, NULL, NULL, &r), CONF_OK);
    assert_true(s.max_split_size == 128 * MiB_);
    const char raw[] = {'m', 'a', 'x', '_', 's', 'p', 'l', 'i', 't', '_', 's', 'i', 'z', 'e', '_', 'm', 'b', ':', '6', '4', 'X'};
    assert_int_equal(alloc_conf_parse_n(raw, sizeof raw - 1, &s, NULL, NULL, &r), CONF_OK);
    assert_true(s.max_split_size == 64 * MiB_);
    assert_int_equal(alloc_conf_parse_n(NULL, 5, &s, NULL, NULL, &r), CONF_OK);
    assert_int_equal(alloc_conf_parse_n(raw, 0, &s, NULL, NULL, &r), CONF_OK);
    assert_true(s.max_split_size == SIZE_MAX); /* an empty text still resets, like c10 parseArgs("") */

    assert_string_equal(alloc_conf_status_name(CONF_OK), "OK");
    assert_string_equal(alloc_conf_status_name(CONF_RUNTIME_ERROR), "RuntimeError");
    assert_string_equal(alloc_conf_status_name(CONF_VALUE_ERROR), "ValueError");
    assert_string_equal(alloc_conf_status_name((conf_status)42), "RuntimeError");

    /* a failed parse clears a previous result's warnings */
    assert_int_equal(alloc_conf_parse("segment_size_mb:64", &s, NULL, NULL, &r), CONF_OK);
    assert_int_equal(r.warning_count, 1);
    assert_int_equal(alloc_conf_parse("max_split_size_mb:1", &s, NULL, NULL, &r), CONF_VALUE_ERROR);
    assert_int_equal(r.warning_count, 0);
}

/* prefix followed by n copies of c, NUL-terminated */
static void build(char *dst, const char *prefix, char c, size_t n)
{
    size_t l = strlen(prefix);
    memcpy(dst, prefix, l);
    memset(dst + l, c, n);
    dst[l + n] = '\0';
}

static void test_long_inputs(void **state)
{
    (void)state;
    alloc_settings s;
    conf_result r;
    const size_t big = 1 << 20;
    char *text = malloc(big + 64);
    if (text == NULL)
        fail_msg("out of memory");

    /* a huge key: the message is truncated, terminated, and keeps its tail */
    memset(text, 'k', big);
    strcpy(text + big, ":1");
    alloc_settings_default(&s);
    assert_int_equal(alloc_conf_parse(text, &s, NULL, NULL, &r), CONF_VALUE_ERROR);
    assert_msg_terminated(&r);
    assert_true(strlen(r.message) < sizeof r.message);
    assert_memory_equal(r.message, "Unrecognized key 'kkkk", 22);
    const char *tail = "' in NPU allocator config, ";
    assert_string_equal(r.message + strlen(r.message) - strlen(tail), tail);

    /* a huge value */
    build(text, "page_size:", 'g', big);
    assert_int_equal(alloc_conf_parse(text, &s, NULL, NULL, &r), CONF_RUNTIME_ERROR);
    assert_msg_terminated(&r);
    assert_memory_equal(r.message, "Unsupported page_size value: ggg", 32);

    /* a huge number */
    build(text, "max_split_size_mb:", '9', big);
    assert_int_equal(alloc_conf_parse(text, &s, NULL, NULL, &r), CONF_RUNTIME_ERROR);
    assert_msg_terminated(&r);
    assert_true(strstr(r.message, "(std::stoull: out of range)") != NULL);

    /* many valid pairs */
    size_t pos = 0;
    while (pos + 32 < big) {
        memcpy(text + pos, "max_split_size_mb:128,", 22);
        pos += 22;
    }
    strcpy(text + pos, "max_split_size_mb:256");
    assert_int_equal(alloc_conf_parse(text, &s, NULL, NULL, &r), CONF_OK);
    assert_true(s.max_split_size == 256 * MiB_);

    /* separators only */
    memset(text, ',', big);
    text[big] = '\0';
    assert_int_equal(alloc_conf_parse(text, &s, NULL, NULL, &r), CONF_VALUE_ERROR);
    assert_string_equal(r.message, "Unrecognized key ',' in NPU allocator config, ");
    memset(text, '[', big);
    assert_int_equal(alloc_conf_parse(text, &s, NULL, NULL, &r), CONF_VALUE_ERROR);

    /* a huge unterminated list */
    strcpy(text, "roundup_power2_divisions:[");
    pos = strlen(text);
    while (pos + 16 < big) {
        memcpy(text + pos, "256:1,", 6);
        pos += 6;
    }
    text[pos] = '\0';
    assert_int_equal(alloc_conf_parse(text, &s, NULL, NULL, &r), CONF_RUNTIME_ERROR);
    assert_string_equal(r.message, NOCLOSE);
    free(text);
}

/* Deterministic random soup of interesting tokens and raw bytes: no crash, terminated messages, s unchanged on
   error, the status consistent. */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void test_random_soup(void **state)
{
    (void)state;
    static const char *const pieces[] = {
        "max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
        "pinned_use_background_threads", "large_segment_size_mb", "max_non_split_rounding_mb",
        "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb", "pin_memory_expandable_segments",
        "pinned_mem_register", "base_addr_aligned_kb", "page_size", "segment_size_mb", "multi_stream_lazy_reclaim",
        "pinned_reserve_segment_size_mb", "per_process_memory_fraction", "release_lock_on_npumalloc",
        "throw_on_npumalloc_oom", "pinned_free_catch_all", ":", ":", ":", ",", ",", "[", "]", ">", " ", "True",
        "False", "1g", "0", "1", "16", "17", "20", "64", "256", "512", "0.5", "-1", "1e999", "nan", "abc",
        "18446744073709551616", "\xff", "\x01",
    };
    char text[256];
    for (int it = 0; it < 30000; it++) {
        size_t len = 0;
        int parts = (int)(rng() % 12);
        for (int k = 0; k < parts; k++) {
            const char *pc = pieces[rng() % (sizeof pieces / sizeof pieces[0])];
            size_t l = strlen(pc);
            if (len + l + 1 >= sizeof text)
                break;
            memcpy(text + len, pc, l);
            len += l;
        }
        text[len] = '\0';
        alloc_settings s, before;
        conf_result r;
        alloc_settings_default(&s);
        before = s;
        bool runtime = (rng() & 3) == 0;
        conf_status st = runtime ? alloc_conf_parse_runtime(text, &s, (rng() & 1) ? probe_ok : probe_fail, NULL, &r)
                                 : alloc_conf_parse(text, &s, (rng() & 1) ? probe_ok : probe_fail, NULL, &r);
        assert_int_equal(st, r.status);
        assert_msg_terminated(&r);
        if (st == CONF_OK) {
            assert_string_equal(r.message, "");
        } else {
            assert_true(r.message[0] != '\0');
            if (runtime) /* what a failed run-time text set stays; the NPU-only start-up keys never change */
                assert_npu_startup_fields_eq(&s, &before);
            else
                assert_settings_eq(&s, &before);
        }
    }
    /* raw random bytes */
    for (int it = 0; it < 20000; it++) {
        size_t len = rng() % 64;
        for (size_t k = 0; k < len; k++)
            text[k] = (char)(rng() % 255 + 1);
        text[len] = '\0';
        alloc_settings s;
        conf_result r;
        alloc_settings_default(&s);
        conf_status st = alloc_conf_parse_n(text, len, &s, NULL, NULL, &r);
        assert_int_equal(st, r.status);
        assert_msg_terminated(&r);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),         cmocka_unit_test(test_valid_table),
        cmocka_unit_test(test_roundup_table),    cmocka_unit_test(test_roundup_lookup),
        cmocka_unit_test(test_reset_and_persist), cmocka_unit_test(test_error_table),
        cmocka_unit_test(test_warning_table),    cmocka_unit_test(test_probe),
        cmocka_unit_test(test_runtime_errors),   cmocka_unit_test(test_runtime_valid),
        cmocka_unit_test(test_env),              cmocka_unit_test(test_api_edges),
        cmocka_unit_test(test_long_inputs),      cmocka_unit_test(test_random_soup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
