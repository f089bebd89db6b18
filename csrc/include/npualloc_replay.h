/*
 * npualloc_replay.h - trace replay: runs a recorded sequence of allocations and frees through a
 * fresh caching allocator (the same algorithm as the live one, torch_npu's
 * NPUCachingAllocator) on a simulated device, and reports what that allocator would have
 * reserved.
 *
 * A session owns everything it uses: its own settings, its own allocator instance and a
 * simulated device that only counts bytes and hands out addresses that are never touched.  No
 * device memory, no streams, no runtime state: the live allocator is unaffected, and sessions
 * may run in parallel threads (one thread per session at a time).
 *
 * Events are fed in bulk, in chunks (a caller can show progress between chunks).  An alloc
 * names the address the recorded run returned; the session maps it to its own pointer, and the
 * free of that address frees it.  A free of an address the session has not seen is counted
 * (an "unknown free"), not an error.
 */
#ifndef NPUALLOC_REPLAY_H_PUBLIC
#define NPUALLOC_REPLAY_H_PUBLIC

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "npualloc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct npualloc_replay npualloc_replay;

typedef enum npualloc_replay_status {
    NPUALLOC_REPLAY_OK = 0,
    NPUALLOC_REPLAY_BAD_SETTINGS,  /* the settings text is malformed (the parser's message) */
    NPUALLOC_REPLAY_BAD_CONFIG,    /* device memory, 1 GiB pool, fraction or pad out of range */
    NPUALLOC_REPLAY_UNAVAILABLE,   /* a setting this build's allocator does not implement */
    NPUALLOC_REPLAY_STOPPED,       /* an allocation ran out of memory and the session stops on OOM */
    NPUALLOC_REPLAY_HOST_MEMORY,   /* out of host memory (for the session's bookkeeping) */
    NPUALLOC_REPLAY_INVALID,       /* a NULL session, configuration or output */
    NPUALLOC_REPLAY_DEVICE_ERROR,  /* the device refused an allocation for another reason than memory (a
                                      setting that cannot run there; npualloc_replay_error says which) */
} npualloc_replay_status;

/* NULL arguments: the functions that return a status return NPUALLOC_REPLAY_INVALID for a NULL
 * session, configuration, event list or output (npualloc_replay_check: ACL_ERROR_INVALID_PARAM);
 * the others say so below.  None writes to an output then (create still describes the error in
 * err). */

#define NPUALLOC_REPLAY_PAD_NPU 32 /* torch_npu adds 32 bytes to every request before rounding */
#define NPUALLOC_REPLAY_PAD_CUDA 0 /* torch's CUDA allocator adds nothing */

typedef struct npualloc_replay_config {
    const char *settings;     /* PYTORCH_NPU_ALLOC_CONF text; NULL or "" = the defaults */
    uint64_t device_memory;   /* the simulated device's capacity in bytes (> 0) */
    uint64_t huge1g_memory;   /* of which a pool of 1 GiB pages (a multiple of 1 GiB), for page_size:1g */
    size_t pad;               /* NPUALLOC_REPLAY_PAD_NPU or NPUALLOC_REPLAY_PAD_CUDA (any value < 512) */
    double fraction;          /* per-process memory fraction in (0, 1]; 0 = not set (the settings' own
                                 per_process_memory_fraction, if any, still applies) */
    bool stop_on_oom;         /* stop at the first allocation that runs out of memory; otherwise skip it
                                 (its later free is ignored) and go on */
    uint32_t timeline_points; /* at most this many timeline samples (0 = no timeline) */
    uint32_t max_oom_records; /* OOMs kept with their message (all are counted) */
    size_t record_history;    /* > 0: record a memory history of up to this many entries (snapshot) */
} npualloc_replay_config;

/* 80 GiB, no 1 GiB pool, NPU rounding, no fraction, continue on OOM, 2048 timeline points,
 * 64 OOM records, no history. */
npualloc_replay_status npualloc_replay_config_default(npualloc_replay_config *cfg);

/* FREE frees a block at once (torch's free_requested with its free_completed right after).  A
 * block freed while another stream still used it (record_stream) returns to the cache only once
 * its events passed: FREE_REQUESTED frees it (allocated bytes drop) but keeps it active and out
 * of the cache until the FREE_COMPLETED of the same address, or until the allocator drains the
 * device (its last-resort retry, an empty cache), as torch's synchronize_and_free_events does.
 * A FREE_COMPLETED with no free of its address pending is ignored. */
enum {
    NPUALLOC_REPLAY_ALLOC = 0,
    NPUALLOC_REPLAY_FREE = 1,
    NPUALLOC_REPLAY_FREE_REQUESTED = 2,
    NPUALLOC_REPLAY_FREE_COMPLETED = 3,
    NPUALLOC_REPLAY_OOM = 4,
    NPUALLOC_REPLAY_EMPTY_CACHE = 5
};
/* EMPTY_CACHE: the recorded program emptied the cache (torch's empty_cache: pending frees
 * complete, every cached segment goes back to the device); addr and size are not used. */
/* OOM: an allocation the recorded run tried and could not make (torch's "oom" entry); size is
 * its size after rounding, addr is not used.  The session tries the same allocation (size less
 * the pad, which its rounding adds back), with the same side effects (cached segments released
 * by the retry), and frees it at once if it succeeds: the recorded program went on without it.
 * Counted in recorded_ooms / recorded_ooms_reproduced, not in allocs or ooms. */

/* A chunk of events, as parallel arrays.  action[i] is one of the NPUALLOC_REPLAY_* actions
 * above (any other value is a FREE); addr[i] the recorded address (0 = none: the event is
 * ignored); size[i] the requested bytes (allocs; ignored for frees; 0 = nothing allocated, as
 * torch does); stream[i] the recorded stream. */
typedef struct npualloc_replay_events {
    const uint8_t *action;
    const uint64_t *addr;
    const uint64_t *size;
    const uint64_t *stream;
    size_t count;
} npualloc_replay_events;

/* Creates a session.  On failure returns the status and writes a message into err. */
npualloc_replay_status npualloc_replay_create(const npualloc_replay_config *cfg, npualloc_replay **out,
                                              char *err, size_t errlen);
/* Does nothing for NULL. */
void npualloc_replay_destroy(npualloc_replay *r);

/* Replays a chunk.  NPUALLOC_REPLAY_STOPPED once an OOM stopped the session (the events after
 * it are not replayed; later calls replay nothing).  NPUALLOC_REPLAY_HOST_MEMORY and
 * NPUALLOC_REPLAY_DEVICE_ERROR leave the session stopped too. */
npualloc_replay_status npualloc_replay_feed(npualloc_replay *r, const npualloc_replay_events *ev);
/* After NPUALLOC_REPLAY_DEVICE_ERROR: the allocator's message for it (its ACL error included); "" before
 * any (and for a NULL session). */
const char *npualloc_replay_error(const npualloc_replay *r);

typedef struct npualloc_replay_result {
    uint64_t events;           /* events replayed (up to the stop, if any) */
    uint64_t allocs, frees;    /* allocations made and frees done */
    uint64_t unknown_frees;    /* frees of addresses never allocated in the session */
    uint64_t skipped_frees;    /* frees of allocations skipped after an OOM */
    uint64_t duplicate_allocs; /* allocs of an address still live (the earlier one is freed first) */
    uint64_t ignored;          /* events with address 0, or allocs of 0 bytes */
    uint64_t ooms;             /* allocations that ran out of memory */
    uint64_t recorded_ooms;    /* OOM events replayed (the recorded run's failed allocations) */
    uint64_t recorded_ooms_reproduced; /* of which ran out of memory here too */
    bool stopped;              /* an OOM stopped the run */
    uint64_t peak_requested, peak_allocated, peak_active, peak_reserved; /* bytes, all pools */
    uint64_t final_allocated, final_reserved;
    uint64_t live_allocations; /* allocations still live at the end */
    double fragmentation;      /* 1 - peak_active / peak_reserved (GMLake); 0 when nothing was reserved */
    uint64_t device_allocs, device_frees; /* segments obtained from / returned to the device */
    uint64_t retries;          /* allocations retried after releasing the whole cache */
    uint64_t segments;         /* segments held at the end */
    uint64_t huge1g_fallbacks; /* page_size:1g segments that did not fit the 1 GiB pool */
    bool expandable;           /* expandable segments were in use */
    double wall_seconds;       /* time spent replaying */
    double events_per_second;
} npualloc_replay_result;

npualloc_replay_status npualloc_replay_get_result(npualloc_replay *r, npualloc_replay_result *out);
/* The session's allocator statistics (as npualloc_cache_get_stats). */
npualloc_replay_status npualloc_replay_get_stats(npualloc_replay *r, npualloc_stats *out);

/* One timeline sample: the largest allocated / reserved bytes over events [event, next
 * sample's event). */
typedef struct npualloc_replay_point {
    uint64_t event;
    uint64_t allocated;
    uint64_t reserved;
} npualloc_replay_point;

/* Copies up to `cap` samples (oldest first) into out; returns how many there are.  A NULL out
 * copies nothing (a count only); a NULL session has none (0). */
size_t npualloc_replay_timeline(npualloc_replay *r, npualloc_replay_point *out, size_t cap);

typedef struct npualloc_replay_oom {
    uint64_t event;     /* index of the event (from the first event fed) */
    uint64_t size;      /* the requested bytes */
    uint64_t stream;
    char message[384];  /* torch_npu's out-of-memory message */
} npualloc_replay_oom;

/* The i-th recorded OOM (i < min(ooms, max_oom_records)); false when there is none, or for a
 * NULL session or out. */
bool npualloc_replay_get_oom(npualloc_replay *r, size_t i, npualloc_replay_oom *out);

/* Warnings the settings parser emitted (index < count); NULL past the end and for a NULL session. */
const char *npualloc_replay_warning(npualloc_replay *r, size_t i);

/* The session's segments, blocks and (with record_history) memory history, in the form of
 * npualloc_cache_snapshot (device 0; no contexts).  Free with npualloc_snapshot_free. */
npualloc_replay_status npualloc_replay_snapshot(npualloc_replay *r, npualloc_snapshot **out);

/* The settings the session replays under (parsed from cfg.settings), as npualloc_cache_get_settings
 * reports the live allocator's. */
npualloc_replay_status npualloc_replay_get_settings(npualloc_replay *r, npualloc_allocator_settings *out);

/* Checks the allocator's invariants (npualloc_cache_check); ACL_SUCCESS or the first violation,
 * described in why (len bytes; why may be NULL only with len 0). */
aclError npualloc_replay_check(npualloc_replay *r, char *why, size_t len);

/* "OK", "BAD_SETTINGS", ... */
const char *npualloc_replay_status_name(npualloc_replay_status st);

#ifdef __cplusplus
}
#endif
#endif
