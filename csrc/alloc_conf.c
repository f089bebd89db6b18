/* alloc_conf.c - the PYTORCH_NPU_ALLOC_CONF parser (torch_npu >= 2.10, "generation 2").
 *
 * What runs, in torch_npu's order (NPUAllocatorConfig::instance() and its parseArgs, the c10
 * AcceleratorAllocatorConfig::parseArgs and ConfigTokenizer it calls):
 *
 *   1. Key validation (npu_validate): every key position is checked against the c10 key set and the NPU key
 *      set. Unknown keys give a ValueError, keys c10 knows but torch_npu does not support a RuntimeError.
 *   2. The c10 pass (c10_parse): resets max_split_size, roundup_power2_divisions and
 *      garbage_collection_threshold; reads every large_segment_size_mb first (the other minimums depend on
 *      it); sets max_non_split_rounding_size = large_segment_size; then walks the keys and parses its own.
 *      Non-c10 keys are skipped with ConfigTokenizer::skipKey, so a missing value after ANY key is caught
 *      here as "Index out of bounds in ConfigTokenizer".
 *   3. If expandable_segments is on: the max_split_size / gc-threshold cross-check (unconditional in
 *      generation 2), then the 512-byte reserve probe. A failed probe warns and re-runs the c10 pass on
 *      "expandable_segments:False", which also resets roundup_power2_divisions and
 *      max_non_split_rounding_size, exactly as in torch_npu.
 *   4. The NPU pass (npu_parse): the NPU-only keys, then the pinned_mem_register post-check.
 *   5. The segment_size_mb / large_segment_size_mb / page_size warnings.
 *
 * c10's ConfigTokenizer::checkToken only asserts that the index exists and returns a bool that every caller
 * ignores, so "key,value" is read like "key:value". That is reproduced, not fixed.
 *
 * Exceptions are modelled as a failing bool return that has filled conf_result. The settings are parsed into
 * a copy, committed on success; a failed run-time parse commits it too (torch_npu keeps what the text set
 * before its error), a failed start-up parse does not (torch_npu retries it at every use).
 */
#include "alloc_conf.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KB ((size_t)1024)
#define MB ((size_t)1024 * 1024)
#define LARGE_BUFFER (20 * MB)          /* kLargeBuffer: default large segment and non-split rounding size */
#define MIN_LARGE_ALLOC_MB ((size_t)10) /* kMinLargeAlloc / kMB: large_segment_size_mb must be above this */
#define ALIGN_ROUND_LARGE (16 * KB)     /* kAlignRoundLarge: default and maximum base_addr_aligned_kb */
#define SEGMENT_MIN_MB 20               /* k20MB */
#define SEGMENT_MAX_MB 512              /* k512MB */
#define ECHO_MAX 400                    /* longest key/value echoed into a message, so its tail survives */

/* ---------------------------------------------------------------------------------------------------------
 * Exact strings
 * ------------------------------------------------------------------------------------------------------- */

#define MSG_INDEX_OOB "Index out of bounds in ConfigTokenizer"
#define MSG_NO_CLOSING "Expected closing bracket ']' in ConfigTokenizer but reached end of config"
#define MSG_EXPANDABLE_CONFLICT                                                                             \
    "`max_split_size_mb` or `garbage_collection_threshold`, cannot be enabled with `expandable_segments`, " \
    "please set `expandable_segments` to `False`."
#define MSG_BOTH_ENV "Both PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF have been set, please set only one of them."
#define MSG_ROUNDUP_LIST_DIV "For roundups, the divisions has to be power of 2 or 0 to disable roundup "
#define MSG_ROUNDUP_SINGLE_DIV "For roundups, the divisions has to be power of 2 "
#define MSG_ROUNDUP_INTERVAL "For roundups, the intervals have to be power of 2 "
#define MSG_GC "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"
#define MSG_ALIGN_RANGE "CachingAllocator option base_addr_aligned_kb error, must be [0~16], dtype is int"
#define MSG_SEGMENT_RANGE "CachingAllocator option segment_size_mb error, must be [20, 512], dtype is int"
#define MSG_FRACTION "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"
#define MSG_PAGE_FORMAT "page_size requires format 'page_size:1g'"

#define MSG_PROBE_ERROR "NPU function error: aclrtReserveMemAddress, error code is %d"
#define WARN_EXPANDABLE_FAIL "expandable_segments setting failure, now change to `False`."
#define WARN_SEGMENT_DEPRECATED "`segment_size_mb` is deprecated, please use `large_segment_size_mb` instead."
#define WARN_PINNED_REGISTER                                                                               \
    "pinned_mem_register setting failure, this feature is not supported when pin_memory_expandable_segments " \
    "is set to `True`, now change to `False`."
#define WARN_BOTH_SEGMENT                                                                                  \
    "Both `segment_size_mb` and `large_segment_size_mb` are set. `segment_size_mb` is deprecated. It is " \
    "recommended to use only `large_segment_size_mb`."
#define WARN_PAGE_OVERRIDE                                                                                 \
    "`page_size:1g` is set, which will override `large_segment_size_mb` and `segment_size_mb` for large " \
    "pool allocations (size > 1MB). It is recommended to use only `page_size:1g`."

/* Keys of c10 AcceleratorAllocatorConfig that torch_npu supports. */
static const char *const c10_supported_keys[] = {
    "max_split_size_mb",       "garbage_collection_threshold", "roundup_power2_divisions",
    "expandable_segments",     "pinned_use_background_threads", "large_segment_size_mb",
    "max_non_split_rounding_mb", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
};
/* Keys newest c10 knows that torch_npu does not list as supported. UNVERIFIED: the newest c10 key list was
   not readable; these are the device-generic (non-"cuda") newest keys of the CUDA option table. */
static const char *const c10_unsupported_keys[] = {
    "pinned_free_catch_all",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
};
/* NPUAllocatorConfig::getKeys(). */
static const char *const npu_keys[] = {
    "pin_memory_expandable_segments", "pinned_mem_register",      "base_addr_aligned_kb",
    "page_size",                      "segment_size_mb",          "multi_stream_lazy_reclaim",
    "pinned_reserve_segment_size_mb", "per_process_memory_fraction", "release_lock_on_npumalloc",
    "throw_on_npumalloc_oom",
};
/* torch_npu.npu.memory._set_allocator_settings() allowed set. */
static const char *const runtime_keys[] = {
    "expandable_segments",       "max_split_size_mb",           "max_non_split_rounding_mb",
    "release_lock_on_npumalloc", "throw_on_npumalloc_oom",      "per_process_memory_fraction",
    "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
};

/* ---------------------------------------------------------------------------------------------------------
 * Parser state, results
 * ------------------------------------------------------------------------------------------------------- */

typedef struct tok {
    const char *s; /* NUL-terminated copy */
    size_t len;
} tok;

typedef struct parser {
    const tok *t;
    size_t n;
    alloc_settings *w; /* the working copy */
    conf_result *r;
} parser;

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define ECHO(tk) (int)((tk).len < ECHO_MAX ? (tk).len : ECHO_MAX), (tk).s

static bool fail(parser *p, conf_status st, int sub, int code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

static bool fail(parser *p, conf_status st, int sub, int code, const char *fmt, ...)
{
    conf_result *r = p->r;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->message, sizeof r->message, fmt, ap);
    va_end(ap);
    r->status = st;
    r->error_subsystem = sub;
    r->error_code = code;
    return false;
}

/* Emulates TORCH_NPU_WARN_ONCE within one parse: each distinct text is recorded once. */
static void warn(conf_result *r, const char *text)
{
    for (int k = 0; k < r->warning_count; k++)
        if (strcmp(r->warnings[k], text) == 0)
            return;
    if (r->warning_count >= ALLOC_CONF_MAX_WARNINGS)
        return;
    snprintf(r->warnings[r->warning_count++], ALLOC_CONF_MSG_LEN, "%s", text);
}

static void result_init(conf_result *r)
{
    memset(r, 0, sizeof *r);
    r->status = CONF_OK;
    r->error_code = CONF_ERR_NONE;
    r->error_subsystem = CONF_SUB_NONE;
}

static bool tok_is(const tok *t, const char *s)
{
    size_t l = strlen(s);
    return t->len == l && memcmp(t->s, s, l) == 0;
}

static bool in_set(const tok *t, const char *const *set, size_t count)
{
    for (size_t k = 0; k < count; k++)
        if (tok_is(t, set[k]))
            return true;
    return false;
}

#define IN_SET(tk, set) in_set((tk), (set), ARRAY_LEN(set))

static bool is_pow2(unsigned long long v) { return v != 0 && (v & (v - 1)) == 0; }

static unsigned floor_log2(unsigned long long v) /* v != 0 */
{
    return 63u - (unsigned)__builtin_clzll(v);
}

/* val MiB in bytes, clamped the way c10 does: min(val, SIZE_MAX / MB) * MB. */
static size_t mb_to_bytes(size_t val)
{
    if (val > SIZE_MAX / MB)
        val = SIZE_MAX / MB;
    return val * MB;
}

/* ---------------------------------------------------------------------------------------------------------
 * Tokenizer (c10::CachingAllocator::ConfigTokenizer)
 *
 * ',' ':' '[' ']' are single-character tokens; std::isspace characters (C locale: space \t \n \v \f \r) are
 * dropped anywhere, even inside a word; every other byte accumulates into the current token.
 * ------------------------------------------------------------------------------------------------------- */

typedef struct token_list {
    tok *t;
    size_t n;
    char *buf;
} token_list;

static bool is_sep(char c) { return c == ',' || c == ':' || c == '[' || c == ']'; }
static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }

static bool tokenize(const char *text, size_t len, token_list *out)
{
    size_t ntok = 0, nchar = 0;
    bool in_word = false;
    memset(out, 0, sizeof *out);
    for (size_t k = 0; k < len; k++) {
        char c = text[k];
        if (is_sep(c)) {
            ntok += in_word ? 2 : 1;
            nchar += 1;
            in_word = false;
        } else if (!is_space(c)) {
            nchar += 1;
            in_word = true;
        }
    }
    if (in_word)
        ntok++;
    if (ntok == 0)
        return true;
    /* ntok <= nchar <= len, and each token needs one NUL: nchar + ntok <= 2 * len. */
    if (ntok > SIZE_MAX / sizeof(tok) || nchar > SIZE_MAX - ntok)
        return false;
    out->t = malloc(ntok * sizeof(tok));
    out->buf = malloc(nchar + ntok);
    if (!out->t || !out->buf) {
        free(out->t);
        free(out->buf);
        memset(out, 0, sizeof *out);
        return false;
    }
    char *w = out->buf, *start = NULL;
    size_t n = 0;
    for (size_t k = 0; k < len; k++) {
        char c = text[k];
        if (is_sep(c)) {
            if (start) {
                *w++ = '\0';
                out->t[n++] = (tok){start, (size_t)(w - 1 - start)};
                start = NULL;
            }
            out->t[n++] = (tok){w, 1};
            *w++ = c;
            *w++ = '\0';
        } else if (!is_space(c)) {
            if (!start)
                start = w;
            *w++ = c;
        }
    }
    if (start) {
        *w++ = '\0';
        out->t[n++] = (tok){start, (size_t)(w - 1 - start)};
    }
    out->n = n;
    return true;
}

static void tokens_free(token_list *l)
{
    free(l->t);
    free(l->buf);
    memset(l, 0, sizeof *l);
}

/* ConfigTokenizer::checkIndex / operator[]: a TORCH_INTERNAL_ASSERT (RuntimeError). Its full text also carries
   "i < config_.size() INTERNAL ASSERT FAILED at \"<path>\":<line>, please report a bug to PyTorch. "; only the
   stable part is kept. */
static bool idx_ok(parser *p, size_t i)
{
    if (i < p->n)
        return true;
    return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_NONE, CONF_ERR_NONE, MSG_INDEX_OOB);
}

/* ConfigTokenizer::checkToken: asserts the index, returns a comparison every caller ignores. */
static bool check_token(parser *p, size_t i) { return idx_ok(p, i); }

/* std::stoull / std::stod / std::stoi failures. Their what() is only the function name ("stoull"), which is
   neither portable nor useful, so these messages are this library's own: they name the option and the value
   and the std:: function whose exception torch_npu would let through (as a RuntimeError). */
static bool conv_fail(parser *p, const tok *v, const char *key, const char *fn, bool range)
{
    return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_NONE, CONF_ERR_NONE,
                "Invalid value '%.*s' for allocator option %s (std::%s: %s)", ECHO(*v), key, fn,
                range ? "out of range" : "no conversion could be performed");
}

/* ConfigTokenizer::toSizeT: std::stoull semantics (strtoull base 10: optional sign, a '-' wraps modulo 2^64,
   trailing garbage ignored; no digits -> invalid_argument; ERANGE -> out_of_range). */
static bool to_size_t(parser *p, size_t i, const char *key, size_t *out)
{
    if (!idx_ok(p, i))
        return false;
    const tok *v = &p->t[i];
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v->s, &end, 10);
    if (end == v->s)
        return conv_fail(p, v, key, "stoull", false);
    if (errno == ERANGE)
        return conv_fail(p, v, key, "stoull", true);
    *out = (size_t)x;
    return true;
}

/* std::stod semantics (strtod: decimal, hex, inf, nan; trailing garbage ignored; ERANGE on overflow and
   underflow -> out_of_range). */
static bool to_double(parser *p, size_t i, const char *key, double *out)
{
    if (!idx_ok(p, i))
        return false;
    const tok *v = &p->t[i];
    char *end;
    errno = 0;
    double x = strtod(v->s, &end);
    if (end == v->s)
        return conv_fail(p, v, key, "stod", false);
    if (errno == ERANGE)
        return conv_fail(p, v, key, "stod", true);
    *out = x;
    return true;
}

/* std::stoi on a token already known to be all digits: only out_of_range can happen. */
static bool digits_to_int(parser *p, const tok *v, const char *key, int *out)
{
    char *end;
    errno = 0;
    long x = strtol(v->s, &end, 10);
    if (errno == ERANGE || x > INT_MAX)
        return conv_fail(p, v, key, "stoi", true);
    *out = (int)x;
    return true;
}

static bool all_digits(const tok *v)
{
    if (v->len == 0)
        return false;
    for (size_t k = 0; k < v->len; k++)
        if (v->s[k] < '0' || v->s[k] > '9')
            return false;
    return true;
}

/* ConfigTokenizer::toBool (TORCH_CHECK_VALUE). */
static bool to_bool(parser *p, size_t i, bool *out)
{
    if (!idx_ok(p, i))
        return false;
    const tok *v = &p->t[i];
    if (tok_is(v, "True")) {
        *out = true;
        return true;
    }
    if (tok_is(v, "False")) {
        *out = false;
        return true;
    }
    return fail(p, CONF_VALUE_ERROR, CONF_SUB_NONE, CONF_ERR_NONE,
                "Expected 'True' or 'False' at index %zu in ConfigTokenizer but got '%.*s'", i, ECHO(*v));
}

/* ConfigTokenizer::skipKey: i is a key; returns the value's index (or the closing ']' of a list). */
static bool skip_key(parser *p, size_t *i)
{
    size_t j = *i + 1;
    if (!check_token(p, j))
        return false;
    if (!idx_ok(p, ++j))
        return false;
    if (tok_is(&p->t[j], "[")) {
        while (++j < p->n && !tok_is(&p->t[j], "]")) {
        }
        if (j >= p->n)
            return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_NONE, CONF_ERR_NONE, MSG_NO_CLOSING);
    }
    *i = j;
    return true;
}

/* ---------------------------------------------------------------------------------------------------------
 * 1. Key validation
 * ------------------------------------------------------------------------------------------------------- */

static bool is_known_key(const tok *k)
{
    return IN_SET(k, c10_supported_keys) || IN_SET(k, c10_unsupported_keys) || IN_SET(k, npu_keys);
}

static bool classify_key(parser *p, const tok *k)
{
    if (IN_SET(k, npu_keys) || IN_SET(k, c10_supported_keys))
        return true;
    if (IN_SET(k, c10_unsupported_keys))
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE,
                    "torch_npu not support key '%.*s' in NPU allocator config, ", ECHO(*k));
    return fail(p, CONF_VALUE_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE,
                "Unrecognized key '%.*s' in NPU allocator config, ", ECHO(*k));
}

/* Walks the key positions the way the parse loops do (key, ':', value or [list], ','), without raising
   structural errors: those come from the passes that follow. */
static bool npu_validate(parser *p)
{
    size_t i = 0;
    while (i < p->n) {
        if (!classify_key(p, &p->t[i]))
            return false;
        size_t j = i + 2;
        if (j >= p->n)
            break;
        if (tok_is(&p->t[j], "[")) {
            while (++j < p->n && !tok_is(&p->t[j], "]")) {
            }
            if (j >= p->n)
                break;
        }
        i = j;
        if (i + 1 < p->n)
            i++;
        i++;
    }
    return true;
}

/* ---------------------------------------------------------------------------------------------------------
 * 2. The c10 pass (AcceleratorAllocatorConfig::parseArgs)
 * ------------------------------------------------------------------------------------------------------- */

/* "<key>:<MB>" with the lower bound check (TORCH_CHECK_VALUE) and the c10 clamp. */
static bool c10_mb_value(parser *p, size_t *i, const char *key, size_t *mb)
{
    if (!check_token(p, ++*i))
        return false;
    return to_size_t(p, ++*i, key, mb);
}

static bool c10_large_segment(parser *p, size_t *i)
{
    size_t v = 0;
    if (!c10_mb_value(p, i, "large_segment_size_mb", &v))
        return false;
    if (!(v > MIN_LARGE_ALLOC_MB))
        return fail(p, CONF_VALUE_ERROR, CONF_SUB_NONE, CONF_ERR_NONE,
                    "CachingAllocator option large_segment_size_mb must be > %zu MB", MIN_LARGE_ALLOC_MB);
    p->w->large_segment_size = mb_to_bytes(v);
    return true;
}

static bool c10_min_mb(parser *p, size_t *i, const char *key, const char *what, size_t *dst)
{
    size_t v = 0, min_mb = p->w->large_segment_size / MB;
    if (!c10_mb_value(p, i, key, &v))
        return false;
    if (v < min_mb)
        return fail(p, CONF_VALUE_ERROR, CONF_SUB_NONE, CONF_ERR_NONE,
                    "CachingAllocator option %s too small, must be >= %zu", what, min_mb);
    *dst = mb_to_bytes(v);
    return true;
}

static bool c10_gc(parser *p, size_t *i)
{
    double v = 0;
    if (!check_token(p, ++*i) || !to_double(p, ++*i, "garbage_collection_threshold", &v))
        return false;
    if (!(v > 0 && v < 1.0))
        return fail(p, CONF_VALUE_ERROR, CONF_SUB_NONE, CONF_ERR_NONE, MSG_GC);
    p->w->garbage_collection_threshold = v;
    return true;
}

static bool c10_roundup(parser *p, size_t *ip)
{
    static const char key[] = "roundup_power2_divisions";
    size_t *div = p->w->roundup_power2_divisions;
    size_t i = *ip, value = 0;
    bool first_value = true;

    if (!check_token(p, ++i) || !idx_ok(p, ++i))
        return false;
    if (tok_is(&p->t[i], "[")) {
        size_t last_index = 0;
        while (++i < p->n && !tok_is(&p->t[i], "]")) {
            size_t value_index = i;
            if (!check_token(p, ++i) || !to_size_t(p, ++i, key, &value))
                return false;
            if (value != 0 && !is_pow2(value))
                return fail(p, CONF_VALUE_ERROR, CONF_SUB_NONE, CONF_ERR_NONE, MSG_ROUNDUP_LIST_DIV);
            if (tok_is(&p->t[value_index], ">")) {
                /* newest c10: from the bucket after the last listed one (none listed: from bucket 1) */
                for (size_t k = last_index + 1; k < ALLOC_CONF_ROUNDUP_BUCKETS; k++)
                    div[k] = value;
            } else {
                size_t boundary = 0;
                if (!to_size_t(p, value_index, key, &boundary))
                    return false;
                if (!is_pow2(boundary))
                    return fail(p, CONF_VALUE_ERROR, CONF_SUB_NONE, CONF_ERR_NONE, MSG_ROUNDUP_INTERVAL);
                size_t index = floor_log2(boundary);
                if (index > ALLOC_CONF_ROUNDUP_BUCKETS - 1)
                    index = ALLOC_CONF_ROUNDUP_BUCKETS - 1;
                if (first_value) { /* the first listed interval also covers every bucket below it */
                    for (size_t k = 0; k < index; k++)
                        div[k] = value;
                    first_value = false;
                }
                div[index] = value;
                last_index = index;
            }
            if (!idx_ok(p, i + 1))
                return false;
            if (!tok_is(&p->t[i + 1], "]"))
                ++i; /* checkToken(++i, ","): in range, result ignored */
        }
        if (i >= p->n)
            return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_NONE, CONF_ERR_NONE, MSG_NO_CLOSING);
    } else { /* a single value for every bucket; 0 is rejected here */
        if (!to_size_t(p, i, key, &value))
            return false;
        if (!is_pow2(value))
            return fail(p, CONF_VALUE_ERROR, CONF_SUB_NONE, CONF_ERR_NONE, MSG_ROUNDUP_SINGLE_DIV);
        for (size_t k = 0; k < ALLOC_CONF_ROUNDUP_BUCKETS; k++)
            div[k] = value;
    }
    *ip = i;
    return true;
}

static bool c10_bool(parser *p, size_t *i, bool *dst)
{
    if (!check_token(p, ++*i))
        return false;
    return to_bool(p, ++*i, dst);
}

/* UNVERIFIED: pinned_max_round_threshold_mb / pinned_max_cached_size_mb are read like the other c10 MB options
   (toSizeT, clamp, x 1 MiB) with no bound check; their c10 source was not readable. */
static bool c10_plain_mb(parser *p, size_t *i, const char *key, size_t *dst)
{
    size_t v = 0;
    if (!c10_mb_value(p, i, key, &v))
        return false;
    *dst = mb_to_bytes(v);
    return true;
}

static bool c10_parse(parser *p)
{
    alloc_settings *w = p->w;
    size_t i;

    /* reset on every parse; the other c10 settings persist */
    w->max_split_size = SIZE_MAX;
    memset(w->roundup_power2_divisions, 0, sizeof w->roundup_power2_divisions);
    w->garbage_collection_threshold = 0;

    /* large_segment_size_mb first: every token is looked at, keys and values alike */
    for (i = 0; i < p->n; ++i)
        if (tok_is(&p->t[i], "large_segment_size_mb") && !c10_large_segment(p, &i))
            return false;
    w->max_non_split_rounding_size = w->large_segment_size;

    for (i = 0; i < p->n; i++) {
        const tok *k = &p->t[i];
        bool ok;
        if (tok_is(k, "large_segment_size_mb"))
            ok = skip_key(p, &i);
        else if (tok_is(k, "max_split_size_mb"))
            ok = c10_min_mb(p, &i, "max_split_size_mb", "max_split_size_mb", &w->max_split_size);
        else if (tok_is(k, "max_non_split_rounding_mb"))
            ok = c10_min_mb(p, &i, "max_non_split_rounding_mb", "max_non_split_rounding_mb",
                            &w->max_non_split_rounding_size);
        else if (tok_is(k, "garbage_collection_threshold"))
            ok = c10_gc(p, &i);
        else if (tok_is(k, "roundup_power2_divisions"))
            ok = c10_roundup(p, &i);
        else if (tok_is(k, "expandable_segments")) {
            ok = c10_bool(p, &i, &w->expandable_segments);
            if (ok)
                w->expandable_segments_explicit = true;
        } else if (tok_is(k, "pinned_use_background_threads"))
            ok = c10_bool(p, &i, &w->pinned_use_background_threads);
        else if (tok_is(k, "pinned_max_round_threshold_mb"))
            ok = c10_plain_mb(p, &i, "pinned_max_round_threshold_mb", &w->pinned_max_round_threshold);
        else if (tok_is(k, "pinned_max_cached_size_mb"))
            ok = c10_plain_mb(p, &i, "pinned_max_cached_size_mb", &w->pinned_max_cached_size);
        else {
            /* a device hook (torch_npu's) is registered, so c10 checks the key against all registered keys */
            if (!is_known_key(k))
                return fail(p, CONF_VALUE_ERROR, CONF_SUB_NONE, CONF_ERR_NONE,
                            "Unrecognized key '%.*s' in Accelerator allocator config.", ECHO(*k));
            ok = skip_key(p, &i);
        }
        if (!ok)
            return false;
        if (i + 1 < p->n)
            ++i; /* checkToken(++i, ","): never fails, result ignored */
    }
    return true;
}

/* ---------------------------------------------------------------------------------------------------------
 * 3. The expandable-segments cross-check and probe
 * ------------------------------------------------------------------------------------------------------- */

static bool expandable_check(parser *p, conf_expandable_probe probe, void *probe_ctx)
{
    alloc_settings *w = p->w;
    if (!w->expandable_segments)
        return true;
    if (!(w->max_split_size == SIZE_MAX && w->garbage_collection_threshold == 0))
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_PARAM, MSG_EXPANDABLE_CONFLICT);
    int status = probe == NULL ? 0 : probe(probe_ctx);
    if (status == 0)
        return true;
    /* NPU_CHECK_ERROR(status): fatal, unless the feature is not supported (torch_npu then prints
       "[WARN]... Feature is not supportted ..." to stdout, which is not reproduced here). */
    if (status != CONF_PROBE_FEATURE_NOT_SUPPORT)
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_NONE, CONF_ERR_NONE, MSG_PROBE_ERROR, status);
    warn(p->r, WARN_EXPANDABLE_FAIL);
    /* accAllocConfIns.parseArgs("expandable_segments:False") */
    static const tok reparse[] = {{"expandable_segments", 19}, {":", 1}, {"False", 5}};
    parser q = {reparse, ARRAY_LEN(reparse), p->w, p->r};
    return c10_parse(&q);
}

/* ---------------------------------------------------------------------------------------------------------
 * 4. The NPU pass (NPUAllocatorConfig::parseArgs)
 * ------------------------------------------------------------------------------------------------------- */

/* The NPU True/False options: "<key>:True|False", each with its own name in the missing-value message (two
   of them say "m_<key>") and its own error suffixes. */
typedef struct npu_bool_opt {
    const char *key;
    const char *missing_name;
    int bad_sub, bad_code, missing_sub, missing_code;
    size_t offset; /* of the bool in alloc_settings */
} npu_bool_opt;

static const npu_bool_opt npu_bools[] = {
    {"pin_memory_expandable_segments", "m_pin_memory_expandable_segments", CONF_SUB_OPS, CONF_ERR_PARAM,
     CONF_SUB_OPS, CONF_ERR_VALUE, offsetof(alloc_settings, pin_memory_expandable_segments)},
    {"pinned_mem_register", "m_pinned_mem_register", CONF_SUB_OPS, CONF_ERR_PARAM, CONF_SUB_OPS,
     CONF_ERR_VALUE, offsetof(alloc_settings, pinned_mem_register)},
    {"multi_stream_lazy_reclaim", "multi_stream_lazy_reclaim", CONF_SUB_PTA, CONF_ERR_PARAM, CONF_SUB_PTA,
     CONF_ERR_PARAM, offsetof(alloc_settings, multi_stream_lazy_reclaim)},
    {"release_lock_on_npumalloc", "release_lock_on_npumalloc", CONF_SUB_PTA, CONF_ERR_PARAM, CONF_SUB_PTA,
     CONF_ERR_PARAM, offsetof(alloc_settings, release_lock_on_npumalloc)},
    /* UNVERIFIED: modelled on release_lock_on_npumalloc (its parser was not readable) */
    {"throw_on_npumalloc_oom", "throw_on_npumalloc_oom", CONF_SUB_PTA, CONF_ERR_PARAM, CONF_SUB_PTA,
     CONF_ERR_PARAM, offsetof(alloc_settings, throw_on_npumalloc_oom)},
};

static bool npu_bool(parser *p, size_t *i, const npu_bool_opt *o)
{
    if (!check_token(p, ++*i))
        return false;
    if (++*i >= p->n)
        return fail(p, CONF_RUNTIME_ERROR, o->missing_sub, o->missing_code, "Error, expecting %s value",
                    o->missing_name);
    const tok *v = &p->t[*i];
    if (!tok_is(v, "True") && !tok_is(v, "False"))
        return fail(p, CONF_RUNTIME_ERROR, o->bad_sub, o->bad_code,
                    "Expected a single True/False argument for %s", o->key);
    *(bool *)((char *)p->w + o->offset) = tok_is(v, "True");
    return true;
}

static size_t decimal_digits(int v) /* v >= 0 */
{
    size_t d = 1;
    while (v >= 10) {
        v /= 10;
        d++;
    }
    return d;
}

static bool npu_base_addr(parser *p, size_t *i)
{
    static const char key[] = "base_addr_aligned_kb";
    if (!check_token(p, ++*i))
        return false;
    if (++*i >= p->n)
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE, "Error, expecting %s value", key);
    const tok *v = &p->t[*i];
    int val = 0;
    if (!all_digits(v))
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_NONE, CONF_ERR_NONE,
                    "CachingAllocator option base_addr_aligned_kb is invalid.");
    if (!digits_to_int(p, v, key, &val))
        return false;
    /* the length check rejects leading zeros ("016") */
    if (v->len != decimal_digits(val) || (size_t)val > ALIGN_ROUND_LARGE / KB)
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE, MSG_ALIGN_RANGE);
    p->w->base_addr_aligned_size = (size_t)val * KB;
    return true;
}

static bool npu_page_size(parser *p, size_t *i)
{
    if (!(*i + 2 < p->n))
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE, MSG_PAGE_FORMAT);
    if (!check_token(p, ++*i))
        return false;
    const tok *v = &p->t[++*i];
    if (!tok_is(v, "1g"))
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE, "Unsupported page_size value: %.*s",
                    ECHO(*v));
    p->w->page_size_1g = true;
    return true;
}

static bool npu_segment_size(parser *p, size_t *i)
{
    static const char key[] = "segment_size_mb";
    warn(p->r, WARN_SEGMENT_DEPRECATED); /* emitted before anything is checked */
    if (!check_token(p, ++*i))
        return false;
    if (++*i >= p->n)
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE, "Error, expecting %s value", key);
    const tok *v = &p->t[*i];
    int val = 0;
    if (!all_digits(v))
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_NONE, CONF_ERR_NONE,
                    "CachingAllocator option segment_size_mb is invalid.");
    if (!digits_to_int(p, v, key, &val))
        return false;
    if (val < SEGMENT_MIN_MB || val > SEGMENT_MAX_MB)
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE, MSG_SEGMENT_RANGE);
    p->w->segment_size = (size_t)val * MB;
    return true;
}

static bool npu_fraction(parser *p, size_t *i)
{
    static const char key[] = "per_process_memory_fraction";
    double v = 0;
    if (!check_token(p, ++*i))
        return false;
    if (++*i >= p->n)
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_PTA, CONF_ERR_VALUE, "Error, expecting %s value", key);
    if (!to_double(p, *i, key, &v))
        return false;
    if (!(v >= 0.0 && v <= 1.0))
        return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_PTA, CONF_ERR_VALUE, MSG_FRACTION);
    p->w->per_process_memory_fraction = v;
    p->w->per_process_memory_fraction_set = true;
    return true;
}

/* torch_npu keeps the raw MB count; stored here in bytes with the c10 clamp. No bound check (toSizeT only). */
static bool npu_pinned_reserve(parser *p, size_t *i)
{
    size_t v = 0;
    if (!check_token(p, ++*i) || !to_size_t(p, ++*i, "pinned_reserve_segment_size_mb", &v))
        return false;
    p->w->pinned_reserve_segment_size = mb_to_bytes(v);
    return true;
}

static bool npu_parse(parser *p, bool runtime, bool *c10_ran)
{
    for (size_t i = 0; i < p->n; i++) {
        const tok *k = &p->t[i];
        bool ok = true, handled = false;
        if (runtime && !IN_SET(k, runtime_keys))
            return fail(p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE,
                        "torch_npu.npu.memory._set_allocator_settings() unsupported setting: %.*s", ECHO(*k));
        for (size_t b = 0; b < ARRAY_LEN(npu_bools); b++)
            if (tok_is(k, npu_bools[b].key)) {
                ok = npu_bool(p, &i, &npu_bools[b]);
                handled = true;
                break;
            }
        if (handled) {
        } else if (tok_is(k, "base_addr_aligned_kb"))
            ok = npu_base_addr(p, &i);
        else if (tok_is(k, "page_size"))
            ok = npu_page_size(p, &i);
        else if (tok_is(k, "segment_size_mb"))
            ok = npu_segment_size(p, &i);
        else if (tok_is(k, "per_process_memory_fraction"))
            ok = npu_fraction(p, &i);
        else if (tok_is(k, "pinned_reserve_segment_size_mb"))
            ok = npu_pinned_reserve(p, &i);
        else {
            if (!classify_key(p, k))
                return false;
            /* _set_allocator_settings hands the whole text to c10 when it meets a c10 key (every time in
               torch_npu; the result is the same, so once here) */
            if (runtime && !*c10_ran) {
                if (!c10_parse(p))
                    return false;
                *c10_ran = true;
            }
            ok = skip_key(p, &i);
        }
        if (!ok)
            return false;
        if (i + 1 < p->n)
            ++i; /* checkToken(++i, ",") */
    }
    /* AclrtMallocHostWithCfg is taken to exist (the emulated CANN is new enough); the pin-memory
       CANN/driver version checks likewise pass. */
    if (p->w->pinned_mem_register && p->w->pin_memory_expandable_segments) {
        p->w->pinned_mem_register = false;
        warn(p->r, WARN_PINNED_REGISTER);
    }
    return true;
}

/* ---------------------------------------------------------------------------------------------------------
 * Public API
 * ------------------------------------------------------------------------------------------------------- */

void alloc_settings_default(alloc_settings *s)
{
    memset(s, 0, sizeof *s);
    s->max_split_size = SIZE_MAX;
    s->max_non_split_rounding_size = LARGE_BUFFER;
    s->garbage_collection_threshold = 0;
    s->large_segment_size = LARGE_BUFFER;
    s->pinned_max_round_threshold = SIZE_MAX;
    s->pinned_max_cached_size = SIZE_MAX;
    s->base_addr_aligned_size = ALIGN_ROUND_LARGE;
    s->per_process_memory_fraction = 1.0;
}

static size_t bounded_len(const char *text, size_t len)
{
    const char *nul = memchr(text, '\0', len);
    return nul ? (size_t)(nul - text) : len;
}

typedef enum { MODE_STARTUP, MODE_RUNTIME } parse_mode;

static conf_status run(const char *text, size_t len, alloc_settings *s, conf_expandable_probe probe,
                       void *probe_ctx, conf_result *r_in, parse_mode mode)
{
    conf_result local;
    conf_result *r = r_in ? r_in : &local;
    result_init(r);
    parser p = {NULL, 0, NULL, r};
    if (s == NULL) {
        fail(&p, CONF_RUNTIME_ERROR, CONF_SUB_NONE, CONF_ERR_NONE, "alloc_conf: settings pointer is NULL");
        return r->status;
    }
    if (text == NULL)
        return CONF_OK; /* variable unset / nothing to apply */
    len = bounded_len(text, len);
    if (mode == MODE_RUNTIME && len == 0)
        return CONF_OK; /* NPUAllocatorConfig::parseArgs returns at once on an empty string */

    alloc_settings w = *s;
    token_list tl;
    if (!tokenize(text, len, &tl)) {
        fail(&p, CONF_RUNTIME_ERROR, CONF_SUB_NONE, CONF_ERR_NONE,
             "alloc_conf: out of memory while tokenizing the allocator config");
        return r->status;
    }
    p.t = tl.t;
    p.n = tl.n;
    p.w = &w;

    bool ok, keep_partial = false;
    if (mode == MODE_STARTUP) {
        ok = npu_validate(&p) && c10_parse(&p) && expandable_check(&p, probe, probe_ctx) &&
             npu_parse(&p, false, NULL);
        if (ok) {
            if (w.segment_size != 0 && w.large_segment_size != LARGE_BUFFER)
                warn(r, WARN_BOTH_SEGMENT);
            /* UNVERIFIED condition: "a segment size" = segment_size_mb set or a non-default large segment */
            if (w.page_size_1g && (w.segment_size != 0 || w.large_segment_size != LARGE_BUFFER))
                warn(r, WARN_PAGE_OVERRIDE);
        }
    } else {
        bool c10_ran = false;
        ok = npu_parse(&p, true, &c10_ran);
        /* torch_npu parses a run-time text straight into its settings (its own, and c10's, which c10's
           pass resets first): what the text set before its error stays set. */
        keep_partial = !ok;
        /* UNVERIFIED: the start-up cross-check and probe are applied after a runtime c10 parse too */
        ok = ok && (!c10_ran || expandable_check(&p, probe, probe_ctx));
    }
    tokens_free(&tl);
    if (ok || keep_partial)
        *s = w;
    return r->status;
}

conf_status alloc_conf_parse_n(const char *text, size_t len, alloc_settings *s, conf_expandable_probe probe,
                               void *probe_ctx, conf_result *r)
{
    return run(text, len, s, probe, probe_ctx, r, MODE_STARTUP);
}

conf_status alloc_conf_parse(const char *text, alloc_settings *s, conf_expandable_probe probe, void *probe_ctx,
                             conf_result *r)
{
    return run(text, text ? strlen(text) : 0, s, probe, probe_ctx, r, MODE_STARTUP);
}

conf_status alloc_conf_parse_runtime(const char *text, alloc_settings *s, conf_expandable_probe probe,
                                     void *probe_ctx, conf_result *r)
{
    return run(text, text ? strlen(text) : 0, s, probe, probe_ctx, r, MODE_RUNTIME);
}

static const char *libc_getenv(const char *name) { return getenv(name); }

conf_status alloc_conf_from_env(const char *(*get)(const char *name), alloc_settings *s,
                                conf_expandable_probe probe, void *probe_ctx, conf_result *r_in,
                                const char **used_text)
{
    conf_result local;
    conf_result *r = r_in ? r_in : &local;
    if (used_text)
        *used_text = NULL;
    if (get == NULL)
        get = libc_getenv;
    const char *npu = get("PYTORCH_NPU_ALLOC_CONF");
    const char *generic = get("PYTORCH_ALLOC_CONF");
    if (npu && generic) {
        result_init(r);
        parser p = {NULL, 0, NULL, r};
        fail(&p, CONF_RUNTIME_ERROR, CONF_SUB_OPS, CONF_ERR_VALUE, MSG_BOTH_ENV);
        return r->status;
    }
    const char *text = npu ? npu : generic;
    if (used_text)
        *used_text = text;
    return alloc_conf_parse(text, s, probe, probe_ctx, r);
}

size_t alloc_conf_roundup_divisions(const alloc_settings *s, size_t size)
{
    /* c10: index = floor(log2(size)) - log2(1 MiB), clamped to the 16 buckets (1 MiB .. 64 GiB). size 0 never
       reaches this in round_size (sizes below 512 return early); it maps to bucket 0 here. */
    size_t index = 0;
    if (size != 0) {
        unsigned lg = floor_log2((unsigned long long)size);
        index = lg > 20 ? lg - 20 : 0;
        if (index > ALLOC_CONF_ROUNDUP_BUCKETS - 1)
            index = ALLOC_CONF_ROUNDUP_BUCKETS - 1;
    }
    return s->roundup_power2_divisions[index];
}

const char *alloc_conf_status_name(conf_status st)
{
    switch (st) {
    case CONF_OK:
        return "OK";
    case CONF_VALUE_ERROR:
        return "ValueError";
    case CONF_RUNTIME_ERROR:
    default:
        return "RuntimeError";
    }
}
