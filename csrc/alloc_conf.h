/* alloc_conf.h - the PYTORCH_NPU_ALLOC_CONF / PYTORCH_ALLOC_CONF parser.
 *
 * Re-implements what torch_npu >= 2.10 ("generation 2", master) accepts at start-up and through
 * torch_npu.npu.memory._set_allocator_settings(): its grammar, stored values, error messages and warnings.
 * torch_npu splits the work between c10::CachingAllocator::AcceleratorAllocatorConfig (the c10 keys) and
 * NPUAllocatorConfig (the NPU-only keys); this parser models both halves and the order in which they run,
 * because that order decides which message a malformed string produces.
 *
 * Only libc is used. Every function is re-entrant and keeps no state between calls.
 */
#ifndef NPUALLOC_ALLOC_CONF_H
#define NPUALLOC_ALLOC_CONF_H

#include <stdbool.h>
#include <stddef.h>

#define ALLOC_CONF_ROUNDUP_BUCKETS 16
#define ALLOC_CONF_MAX_WARNINGS 8 /* one parse can emit at most 5 distinct warnings */
#define ALLOC_CONF_MSG_LEN 512

/* How the error surfaces in Python: TORCH_CHECK / TORCH_INTERNAL_ASSERT / std:: exceptions give RuntimeError,
   TORCH_CHECK_VALUE gives ValueError. */
typedef enum { CONF_OK = 0, CONF_RUNTIME_ERROR, CONF_VALUE_ERROR } conf_status;

/* The error-suffix parts that PTA_ERROR(code) / OPS_ERROR(code) append:
   "\n[ERROR] <time> (PID:.., Device:.., RankID:..) ERR<sub:02d><code:03d> <SUB> <text>". */
enum { CONF_SUB_NONE = -1, CONF_SUB_PTA = 0, CONF_SUB_OPS = 1 };
enum { CONF_ERR_NONE = 0, CONF_ERR_PARAM = 1, CONF_ERR_VALUE = 3 };

typedef struct alloc_settings {
    /* c10 AcceleratorAllocatorConfig part */
    size_t max_split_size;              /* bytes; SIZE_MAX = unlimited (default) */
    size_t max_non_split_rounding_size; /* bytes; default 20 MiB (= large_segment_size after every parse) */
    double garbage_collection_threshold;/* 0 = off */
    size_t roundup_power2_divisions[ALLOC_CONF_ROUNDUP_BUCKETS];
    bool expandable_segments;
    bool expandable_segments_explicit;  /* the user set the key */
    bool pinned_use_background_threads;
    size_t large_segment_size;          /* bytes; default 20 MiB */
    size_t pinned_max_round_threshold;  /* bytes; SIZE_MAX = off (default): every pinned block is rounded */
    size_t pinned_max_cached_size;      /* bytes; SIZE_MAX = off (default): every pinned block is cached */
    /* NPUAllocatorConfig part */
    size_t base_addr_aligned_size;      /* bytes; default 16 KiB; 0 means 512-byte alignment */
    bool page_size_1g;
    size_t segment_size;                /* deprecated segment_size_mb in bytes, 0 = unset */
    double per_process_memory_fraction; /* default 1.0; bool below says whether set */
    bool per_process_memory_fraction_set;
    bool release_lock_on_npumalloc, throw_on_npumalloc_oom, multi_stream_lazy_reclaim,
         pin_memory_expandable_segments, pinned_mem_register;
    size_t pinned_reserve_segment_size; /* bytes; 0 = none (default) */
} alloc_settings;

typedef struct conf_result {
    conf_status status;
    /* The exact torch_npu / c10 message, without the "\n[ERROR] ... ERR0xxxx" suffix. Truncated (always
       NUL-terminated) when an echoed key or value is very long. */
    char message[ALLOC_CONF_MSG_LEN];
    int error_code;      /* the suffix's code: CONF_ERR_PARAM / CONF_ERR_VALUE; CONF_ERR_NONE = no suffix */
    int error_subsystem; /* CONF_SUB_PTA / CONF_SUB_OPS; CONF_SUB_NONE = no suffix */
    int warning_count;   /* warnings stored below, in emission order (each distinct text at most once) */
    char warnings[ALLOC_CONF_MAX_WARNINGS][ALLOC_CONF_MSG_LEN];
} conf_result;

/* The 512-byte aclrtReserveMemAddress probe: returns its status, 0 when expandable segments are supported.
   As torch_npu's NPU_CHECK_ERROR: CONF_PROBE_FEATURE_NOT_SUPPORT (ACL_ERROR_RT_FEATURE_NOT_SUPPORT) only warns
   and turns expandable segments off; any other error fails the parse (a RuntimeError). */
#define CONF_PROBE_FEATURE_NOT_SUPPORT 207000
typedef int (*conf_expandable_probe)(void *ctx);

void alloc_settings_default(alloc_settings *s);

/* Parses an env-var value over `s` as torch_npu does at start-up (key validation, the c10 pass, the expandable
   cross-check and probe, the NPU pass, the post-parse warnings). `text` NULL = variable unset: nothing changes.
   `probe` NULL = supported. `r` may be NULL. On error `s` is unchanged. */
conf_status alloc_conf_parse(const char *text, alloc_settings *s, conf_expandable_probe probe, void *probe_ctx,
                             conf_result *r);

/* Same, for a text of `len` bytes that need not be NUL-terminated; a NUL byte ends the text (as getenv would). */
conf_status alloc_conf_parse_n(const char *text, size_t len, alloc_settings *s, conf_expandable_probe probe,
                               void *probe_ctx, conf_result *r);

/* torch_npu.npu.memory._set_allocator_settings(text): only the keys in torch_npu's allowed set.  On a parse
   error `s` keeps what the text set before it, as torch_npu's settings do (c10's pass, when it ran, has
   reset max_split_size, garbage_collection_threshold and roundup_power2_divisions); on the expandable
   cross-check's error (after the parse) `s` is unchanged. */
conf_status alloc_conf_parse_runtime(const char *text, alloc_settings *s, conf_expandable_probe probe,
                                     void *probe_ctx, conf_result *r);

/* Reads PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF through `get` (NULL = getenv); both set is an error.
   *used_text (if used_text is not NULL) receives the text that was parsed, or NULL. */
conf_status alloc_conf_from_env(const char *(*get)(const char *name), alloc_settings *s,
                                conf_expandable_probe probe, void *probe_ctx, conf_result *r,
                                const char **used_text);

/* Divisions for a rounded size: bucket floor(log2(size)) - 20 clamped to [0, 15] (size 0 uses bucket 0). */
size_t alloc_conf_roundup_divisions(const alloc_settings *s, size_t size);

/* "RuntimeError" / "ValueError" / "OK". */
const char *alloc_conf_status_name(conf_status st);

#endif
