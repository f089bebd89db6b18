/*
 * caching_api.c - the caching allocator's public face: settings (PYTORCH_NPU_ALLOC_CONF),
 * the per-device caches, errors and warnings, the API of npualloc.h, OOM messages, snapshots (built by snapshot.c).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "caching.h"
#include "common.h"
#include "device.h"
#include "graph.h"
#include "host.h"
#include "pluggable.h"
#include "snapshot.h"
#include "va_space.h"
#include "vmm.h"

alloc_settings cache_settings;

/* Guards the start of the caches (settings from the environment) and settings changes. */
static pthread_mutex_t api_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t history_lock = PTHREAD_MUTEX_INITIALIZER; /* record_history calls; taken before api_lock */
static bool settings_loaded;
static conf_result settings_error; /* status != CONF_OK: the environment is malformed */
static char *settings_text; /* the whole text in effect, however long (torch keeps a std::string) */
static device_cache caches[NPU_MAX_DEVICES];
static bool caches_ready; /* the device mutexes are initialised */
/* torch builds every device's allocator at once, on first use, and each keeps in its stats the
 * max_split_size of that moment.  Caches here start one by one: the first one records the value
 * (until the runtime stops) and every later one reports it too. */
static bool any_cache_started;
static int64_t started_max_split_stat;

/* ---- errors and warnings ---- */

static _Thread_local npualloc_error_kind last_kind;
static _Thread_local char last_message[1024];
static _Thread_local int last_submodule = CONF_SUB_NONE, last_code = CONF_ERR_NONE;
static _Thread_local npualloc_oom_info last_oom;

void cache_set_error(npualloc_error_kind kind, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_message, sizeof last_message, fmt, ap);
    va_end(ap);
    last_kind = kind;
    last_submodule = CONF_SUB_NONE;
    last_code = CONF_ERR_NONE;
}

/* A settings error: torch_npu's message, and the PTA_ERROR / OPS_ERROR suffix it carries (if any). */
static void cache_set_conf_error(const conf_result *r)
{
    cache_set_error(r->status == CONF_VALUE_ERROR ? NPUALLOC_ERR_VALUE : NPUALLOC_ERR_RUNTIME, "%s", r->message);
    last_submodule = r->error_subsystem;
    last_code = r->error_code;
}

const char *npualloc_last_error(npualloc_error_kind *kind)
{
    if (kind)
        *kind = last_kind;
    return last_message;
}

void npualloc_last_error_suffix(int *submodule, int *code)
{
    if (submodule)
        *submodule = last_submodule;
    if (code)
        *code = last_code;
}

/* Pending warnings, each for the thread whose call made it (torch gives a TORCH_WARN to that thread):
 * one ring for the process, whose entries name their thread; when full, the oldest goes. */
#define WARNING_SLOTS 32
typedef struct pending_warning {
    uint64_t thread; /* host_thread_serial() of the thread that made it */
    char text[512];
} pending_warning;
static pthread_mutex_t warning_lock = PTHREAD_MUTEX_INITIALIZER;
static pending_warning warnings[WARNING_SLOTS];
static size_t warning_head, warning_count;
/* warning_count, read without the lock: the callers' usual case, no warning at all, stays one load
 * (a thread-local read from a shared library is a call). */
static _Atomic size_t warnings_pending;
/* At least the number of the ring's entries of this thread (another thread's push may have dropped
 * some): lets npualloc_has_warnings answer without the lock. */
static _Thread_local size_t own_warnings;
/* A thread that made a warning drops its pending ones when it exits (a thread-specific value's
 * destructor): nobody else will take them, and they would hold warnings_pending up for ever. */
static pthread_key_t warning_owner_key;
static pthread_once_t warning_key_once = PTHREAD_ONCE_INIT;
static bool warning_key_ready;
static _Thread_local bool warning_owner_set;

static pending_warning *warning_at(size_t i) { return &warnings[(warning_head + i) % WARNING_SLOTS]; }

static void drop_exiting_threads_warnings(void *unused)
{
    (void)unused;
    uint64_t self = host_thread_serial();
    pthread_mutex_lock(&warning_lock);
    size_t kept = 0;
    for (size_t i = 0; i < warning_count; i++)
        if (warning_at(i)->thread != self)
            *warning_at(kept++) = *warning_at(i); /* in order: kept <= i */
    warning_count = kept;
    warnings_pending = warning_count;
    pthread_mutex_unlock(&warning_lock);
}

static void warning_key_create(void)
{
    warning_key_ready = pthread_key_create(&warning_owner_key, drop_exiting_threads_warnings) == 0;
}

void cache_push_warning(const char *fmt, ...)
{
    if (!warning_owner_set) {
        pthread_once(&warning_key_once, warning_key_create);
        warning_owner_set = warning_key_ready && pthread_setspecific(warning_owner_key, &warning_owner_key) == 0;
    }
    pending_warning w = {.thread = host_thread_serial()};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w.text, sizeof w.text, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&warning_lock);
    size_t slot = (warning_head + warning_count) % WARNING_SLOTS;
    if (warning_count == WARNING_SLOTS) /* full: the oldest goes */
        warning_head = (warning_head + 1) % WARNING_SLOTS;
    else
        warning_count++;
    warnings[slot] = w;
    warnings_pending = warning_count;
    pthread_mutex_unlock(&warning_lock);
    own_warnings++;
}

/* torch_npu's TORCH_NPU_WARN_ONCE: once a process (a fork inherits it); a runtime started again after
 * npualloc_shutdown warns again, as a new process would. */
static atomic_bool warned_1g_fallback;

void cache_warn_1g_fallback(void)
{
    if (!atomic_exchange(&warned_1g_fallback, true))
        cache_push_warning("The malloc 1G large-page physical memory failed, so malloc 2M page memory.Using the 2M "
                           "memory page may result in performance degradation. This warning occurs because the "
                           "PYTORCH_NPU_ALLOC_CONF = page_size:1g configuration is enabled, but the pre-allocated "
                           "number of 1G large pages is insufficient or 1G large-page memory pre-allocation is not "
                           "enabled.");
}

bool npualloc_has_warnings(void) { return warnings_pending != 0 && own_warnings != 0; }

bool npualloc_pop_warning(char *buf, size_t len)
{
    if (!own_warnings)
        return false;
    uint64_t self = host_thread_serial();
    pthread_mutex_lock(&warning_lock);
    size_t i = 0;
    while (i < warning_count && warning_at(i)->thread != self)
        i++;
    bool any = i < warning_count;
    if (any) {
        snprintf(buf, len, "%s", warning_at(i)->text);
        for (size_t j = i; j + 1 < warning_count; j++) /* the later ones move up: the ring keeps its order */
            *warning_at(j) = *warning_at(j + 1);
        warning_count--;
        warnings_pending = warning_count;
    }
    size_t left = 0;
    for (size_t j = i; j < warning_count; j++)
        left += warning_at(j)->thread == self;
    pthread_mutex_unlock(&warning_lock);
    own_warnings = left;
    return any;
}

/* ---- free-memory callbacks (npualloc_cache_add_free_memory_callback) ---- */

#define MAX_FREE_CALLBACKS 8
static pthread_mutex_t free_callback_lock = PTHREAD_MUTEX_INITIALIZER;
static npualloc_free_memory_callback free_callbacks[MAX_FREE_CALLBACKS];
static _Atomic int free_callback_count; /* entries below it are written before it is raised */

aclError npualloc_cache_add_free_memory_callback(npualloc_free_memory_callback fn)
{
    if (!fn) {
        cache_set_error(NPUALLOC_ERR_VALUE, "npualloc_cache_add_free_memory_callback: fn must not be NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&free_callback_lock);
    int n = free_callback_count;
    if (n < MAX_FREE_CALLBACKS) {
        free_callbacks[n] = fn;
        free_callback_count = n + 1;
    }
    pthread_mutex_unlock(&free_callback_lock);
    if (n == MAX_FREE_CALLBACKS) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "at most %d free-memory callbacks can be registered", MAX_FREE_CALLBACKS);
        return ACL_ERROR_INVALID_PARAM;
    }
    return ACL_SUCCESS;
}

/* Runs every callback (no lock held): true when one of them freed something. */
static bool run_free_callbacks(void)
{
    bool freed = false;
    int n = free_callback_count;
    for (int i = 0; i < n; i++)
        freed |= free_callbacks[i]();
    return freed;
}

/* ---- the virtual NPU as a segment source ---- */

static aclError npu_segment_alloc(void *ctx, int32_t device, size_t size, bool huge1g, void **ptr)
{
    (void)ctx;
    vmm_kind_choice choice = huge1g ? (vmm_kind_choice){{MEM_HUGE1G}, 1} : (vmm_kind_choice){{MEM_HUGE, MEM_NORMAL}, 2};
    return vmm_malloc(device, size, choice, VMM_OWNER_ALLOCATOR, false, ptr);
}

static void npu_segment_free(void *ctx, int32_t device, void *ptr, size_t size)
{
    (void)ctx;
    (void)device;
    (void)size;
    vmm_free_malloc(ptr, VMM_OWNER_ALLOCATOR);
}

static void npu_mem_info(void *ctx, int32_t device, size_t *free_bytes, size_t *total_bytes)
{
    (void)ctx;
    device_mem_info(device, ACL_HBM_MEM, free_bytes, total_bytes);
}

static void npu_synchronize(void *ctx, int32_t device)
{
    (void)ctx;
    (void)stream_wait_device(device); /* a failed task's error stays for the application */
}

static bool npu_segment_valid(void *ctx, int32_t device, void *ptr, size_t size)
{
    (void)ctx;
    vmm_read_lock();
    int32_t dev = -2;
    range_class rc = vmm_classify_locked(ptr, size, &dev);
    vmm_read_unlock();
    return rc == RANGE_DEVICE && dev == device;
}

/* Expandable segments live in ranges of the runtime's own: a program's aclrtUnmapMem,
 * aclrtReleaseMemAddress or aclrtMapMem cannot take pages or the range from under the cache. */
static aclError npu_reserve(void *ctx, int32_t device, size_t size, uintptr_t *base)
{
    (void)ctx;
    void *va = NULL;
    aclError rc = vmm_reserve_private(device, size, &va);
    *base = (uintptr_t)va;
    return rc;
}

static void npu_release(void *ctx, int32_t device, uintptr_t base, size_t size)
{
    (void)ctx;
    (void)device;
    (void)size;
    vmm_release_private((void *)base);
}

static aclError npu_map_page(void *ctx, int32_t device, uintptr_t va, size_t size, bool huge1g, uint64_t *handle)
{
    (void)ctx;
    /* torch_npu asks aclrtMallocPhysical for each page, which refuses a size off the granularity (a large
     * segment size of 11 MiB, say): every page fails, as there, instead of the first only (at an address
     * the next page's mapping then found misaligned) */
    if (size % (huge1g ? VMM_GRANULARITY_1G : VMM_GRANULARITY) != 0)
        return ACL_ERROR_RT_PARAM_INVALID;
    aclrtDrvMemHandle h;
    aclError rc = vmm_physical_create(device, (vmm_kind_choice){{huge1g ? MEM_HUGE1G : MEM_HUGE}, 1}, size, &h);
    if (rc != ACL_SUCCESS)
        return rc;
    if ((rc = vmm_map_private((void *)va, size, h)) != ACL_SUCCESS) {
        aclrtFreePhysical(h);
        return rc;
    }
    *handle = (uint64_t)(uintptr_t)h;
    return ACL_SUCCESS;
}

static aclError npu_remap_page(void *ctx, int32_t device, uintptr_t va, size_t size, uint64_t handle)
{
    (void)ctx;
    (void)device;
    return vmm_map_private((void *)va, size, (aclrtDrvMemHandle)(uintptr_t)handle);
}

static void npu_unmap_page(void *ctx, int32_t device, uintptr_t va, size_t size, uint64_t handle, bool keep)
{
    (void)ctx;
    (void)device;
    (void)size;
    vmm_unmap_private((void *)va);
    if (!keep)
        aclrtFreePhysical((aclrtDrvMemHandle)(uintptr_t)handle);
}

static void npu_free_page(void *ctx, int32_t device, uint64_t handle)
{
    (void)ctx;
    (void)device;
    aclrtFreePhysical((aclrtDrvMemHandle)(uintptr_t)handle);
}

static bool npu_free_memory(void *ctx)
{
    (void)ctx;
    return run_free_callbacks();
}

const cache_backend cache_npu_backend = {npu_segment_alloc, npu_segment_free, npu_mem_info,   npu_synchronize,
                                         npu_segment_valid, npu_reserve,      npu_release,    npu_map_page,
                                         npu_remap_page,    npu_unmap_page,   npu_free_page,  npu_free_memory,
                                         NULL /* every free waits for stream events, completed by the cache */};

/* ---- settings ---- */

/* torch_npu's start-up probe: can 512 bytes of address space be reserved?  Its status decides
 * (alloc_conf.h): FEATURE_NOT_SUPPORT turns expandable segments off, any other error is fatal. */
static int expandable_probe(void *ctx)
{
    (void)ctx;
    void *p = NULL;
    aclError rc = aclrtReserveMemAddress(&p, 512, 0, NULL, 1);
    if (rc == ACL_SUCCESS)
        aclrtReleaseMemAddress(p);
    return rc;
}

static void forward_warnings(const conf_result *r)
{
    for (int i = 0; i < r->warning_count; i++)
        cache_push_warning("%s", r->warnings[i]);
}

/* Loads the settings from the environment once (api_lock held). */
static void load_settings(void)
{
    if (settings_loaded)
        return;
    alloc_settings_default(&cache_settings);
    const char *used = NULL;
    /* the outcome stays in settings_error (lock_settings reports it) */
    (void)alloc_conf_from_env(NULL, &cache_settings, expandable_probe, NULL, &settings_error, &used);
    char *text = strdup(used ? used : "");
    if (!text) { /* not loaded: the next call tries again */
        settings_error.status = CONF_RUNTIME_ERROR;
        settings_error.error_subsystem = CONF_SUB_NONE;
        settings_error.error_code = CONF_ERR_NONE;
        snprintf(settings_error.message, sizeof settings_error.message,
                 "npualloc: out of host memory for the allocator settings");
        return;
    }
    free(settings_text);
    settings_text = text;
    /* torch_npu warns as its parser goes: what came before an error is given too, once */
    forward_warnings(&settings_error);
    settings_loaded = true;
}

static void init_caches(void)
{
    if (caches_ready)
        return;
    for (int i = 0; i < NPU_MAX_DEVICES; i++)
        cache_lock_init(&caches[i].lock);
    caches_ready = true;
}

/* Takes api_lock with the caches and the settings ready.  False (lock released, error set) while
 * the environment's settings are malformed: every call reports that error again, as in torch_npu. */
static bool lock_settings(void)
{
    pthread_mutex_lock(&api_lock);
    init_caches();
    load_settings();
    if (settings_error.status == CONF_OK)
        return true;
    pthread_mutex_unlock(&api_lock);
    cache_set_conf_error(&settings_error);
    return false;
}

/* Starts the runtime if needed; false, with the error set, when it cannot start. */
static bool runtime_started(void)
{
    if (runtime_ensure_init() == ACL_SUCCESS)
        return true;
    const char *why = npualloc_init_error();
    cache_set_error(NPUALLOC_ERR_VALUE, "%s", why ? why : "the virtual NPU could not start");
    return false;
}

/* Starts the runtime if needed; true when `device` is one of its devices (else the error is set). */
static bool device_ready(int32_t device)
{
    if (!runtime_started())
        return false;
    if (!device_valid(device)) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "Invalid device argument %d: did you call init?", (int)device);
        return false;
    }
    return true;
}

/* Starts the runtime, the settings and the device's cache; NULL (error set) on failure. */
static device_cache *cache_get(int32_t device)
{
    /* A started cache implies a running runtime and a valid device: shutdown resets the caches
     * before it stops the runtime.  So the hot path checks that flag alone. */
    if (likely(device >= 0 && device < NPU_MAX_DEVICES && __atomic_load_n(&caches[device].started, __ATOMIC_ACQUIRE)))
        return &caches[device];
    if (!device_ready(device))
        return NULL;
    device_cache *dc = &caches[device];
    if (!lock_settings())
        return NULL;
    cache_lock_acquire(&dc->lock);
    if (!dc->started) {
        cache_device_init(dc, device, &cache_settings, &cache_npu_backend, NULL, K_PAD_SIZE);
        if (!any_cache_started)
            started_max_split_stat = dc->stats.max_split_size;
        any_cache_started = true;
        dc->stats.max_split_size = started_max_split_stat;
    }
    cache_lock_release(&dc->lock);
    pthread_mutex_unlock(&api_lock);
    return dc;
}

/* cache_get with the cache's lock held; NULL (error set) also when a shutdown reset the cache between
 * the two, as it may while another thread calls in: its settings are gone then. */
static device_cache *cache_acquire(int32_t device)
{
    device_cache *dc = cache_get(device);
    if (!dc)
        return NULL;
    cache_lock_acquire(&dc->lock);
    if (likely(dc->started))
        return dc;
    cache_lock_release(&dc->lock);
    cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: the runtime was shut down during the call");
    return NULL;
}

device_cache *cache_device(int32_t device) { return cache_get(device); }

/* ---- a pluggable allocator in its place (pluggable.c) ---- */

aclError npualloc_allocator_change(npualloc_alloc_fn alloc_fn, npualloc_free_fn free_fn)
{
    if (!alloc_fn || !free_fn) {
        cache_set_error(NPUALLOC_ERR_VALUE, "npualloc_allocator_change: alloc_fn and free_fn must not be NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    /* Under api_lock, which every cache takes to start: no cache starts while this decides. */
    pthread_mutex_lock(&api_lock);
    bool initialized = pluggable_active();
    for (int d = 0; d < NPU_MAX_DEVICES && caches_ready && !initialized; d++)
        initialized = __atomic_load_n(&caches[d].started, __ATOMIC_ACQUIRE);
    if (!initialized)
        pluggable_install(alloc_fn, free_fn);
    pthread_mutex_unlock(&api_lock);
    if (initialized) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "Can't swap an already initialized allocator");
        return ACL_ERROR_REPEAT_INITIALIZE;
    }
    return ACL_SUCCESS;
}

bool npualloc_allocator_is_pluggable(void) { return pluggable_active(); }

/* The started cache owning a device pointer, or NULL. */
static device_cache *cache_of_ptr(const void *ptr)
{
    int32_t dev = va_device_of((uintptr_t)ptr);
    if (dev < 0 || dev >= NPU_MAX_DEVICES || !__atomic_load_n(&caches[dev].started, __ATOMIC_ACQUIRE))
        return NULL;
    return &caches[dev];
}

void cache_settings_export(const alloc_settings *s, npualloc_allocator_settings *out)
{
    out->max_split_size = s->max_split_size;
    out->max_non_split_rounding_size = s->max_non_split_rounding_size;
    out->garbage_collection_threshold = s->garbage_collection_threshold;
    out->expandable_segments = s->expandable_segments;
    for (int i = 0; i < 16; i++)
        out->roundup_power2_divisions[i] = s->roundup_power2_divisions[i];
    out->base_addr_aligned_size = s->base_addr_aligned_size;
    out->page_size_1g = s->page_size_1g;
    out->large_segment_size = s->large_segment_size;
    out->release_lock_on_npumalloc = s->release_lock_on_npumalloc;
    out->throw_on_npumalloc_oom = s->throw_on_npumalloc_oom;
    out->multi_stream_lazy_reclaim = s->multi_stream_lazy_reclaim;
}

aclError npualloc_cache_get_settings(npualloc_allocator_settings *out)
{
    if (!out)
        return ACL_ERROR_INVALID_PARAM;
    if (!runtime_started())
        return ACL_ERROR_UNINITIALIZE;
    if (!lock_settings())
        return ACL_ERROR_INVALID_PARAM;
    /* Settings change with every device lock held: holding one is enough to read them. */
    cache_lock_acquire(&caches[0].lock);
    cache_settings_export(&cache_settings, out);
    cache_lock_release(&caches[0].lock);
    pthread_mutex_unlock(&api_lock);
    return ACL_SUCCESS;
}

size_t npualloc_cache_settings_text(char *buf, size_t len)
{
    pthread_mutex_lock(&api_lock);
    load_settings();
    const char *text = settings_text ? settings_text : ""; /* "" only when host memory ran out */
    size_t n = strlen(text);
    if (len > 0)
        snprintf(buf, len, "%s", text);
    pthread_mutex_unlock(&api_lock);
    return n;
}

aclError npualloc_cache_set_settings(const char *text)
{
    if (!text) {
        cache_set_error(NPUALLOC_ERR_TYPE, "_set_allocator_settings() expects a string");
        return ACL_ERROR_INVALID_PARAM;
    }
    if (!runtime_started())
        return ACL_ERROR_UNINITIALIZE;
    /* torch_npu empties the NPU streams first; then the change happens under every device lock.  The
     * wait comes before api_lock: a queued callback may need that lock (a snapshot reads the settings),
     * and so may fork's prepare handler while the forking thread holds what the callback waits for. */
    for (int d = 0; d < device_count(); d++)
        if (__atomic_load_n(&caches[d].started, __ATOMIC_ACQUIRE))
            (void)stream_wait_device(d);
    char *copy = strdup(text); /* the text in effect if it parses: got first, so nothing fails after */
    if (!copy) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory for the allocator settings");
        return ACL_ERROR_BAD_ALLOC;
    }
    if (!lock_settings()) {
        free(copy);
        return ACL_ERROR_INVALID_PARAM;
    }
    alloc_settings next = cache_settings;
    next.per_process_memory_fraction_set = false; /* set again only by a text that names the key */
    conf_result r;
    /* A failed text changes what it set before its error (alloc_conf_parse_runtime), as in torch_npu. */
    conf_status st = alloc_conf_parse_runtime(text, &next, expandable_probe, NULL, &r);
    forward_warnings(&r);
    for (int d = 0; d < NPU_MAX_DEVICES; d++)
        cache_lock_acquire(&caches[d].lock);
    if (st == CONF_OK && next.per_process_memory_fraction_set) {
        for (int d = 0; d < NPU_MAX_DEVICES; d++)
            if (caches[d].started)
                cache_set_fraction_locked(&caches[d], next.per_process_memory_fraction);
    } else {
        /* A text without the key leaves every fraction alone, and caches started later still take
         * the fraction the settings had (the environment's, or an earlier text's).  A failed text's
         * fraction is not applied (torch_npu's parse only stores it; applying comes after). */
        next.per_process_memory_fraction_set = cache_settings.per_process_memory_fraction_set;
        next.per_process_memory_fraction = cache_settings.per_process_memory_fraction;
    }
    cache_settings = next;
    if (st == CONF_OK) {
        free(settings_text);
        settings_text = copy;
    } else {
        free(copy);
    }
    for (int d = NPU_MAX_DEVICES - 1; d >= 0; d--)
        cache_lock_release(&caches[d].lock);
    pthread_mutex_unlock(&api_lock);
    if (st != CONF_OK) {
        cache_set_conf_error(&r);
        return ACL_ERROR_INVALID_PARAM;
    }
    return ACL_SUCCESS;
}

/* ---- sizes and messages ---- */

void npualloc_format_size(uint64_t size, char *buf, size_t len)
{
    if (size <= 1024)
        snprintf(buf, len, "%llu bytes", (unsigned long long)size);
    else if (size <= 1048576)
        snprintf(buf, len, "%.2f KiB", (double)size / 1024.0);
    else if (size <= 1073741824)
        snprintf(buf, len, "%.2f MiB", (double)size / 1048576.0);
    else
        snprintf(buf, len, "%.2f GiB", (double)size / 1073741824.0);
}

int npualloc_format_oom(const npualloc_oom_info *o, char *buf, size_t len)
{
    if (!o || (!buf && len))
        return -1;
    if (o->over_1eb)
        return snprintf(buf, len, "NPU out of memory. Tried to allocate more than 1EB memory.");
    char alloc[32], total[32], allocated[32], active[32], free_s[32], allowed[48], reserved[32];
    npualloc_format_size(o->alloc_size, alloc, sizeof alloc);
    if (o->preemptive)
        return snprintf(buf, len,
                        "NPU out of memory. Allocation was preemptively rejected because it would exceed "
                        "per_process_memory_fraction limit. Requested size: %s",
                        alloc);
    npualloc_format_size(o->device_total, total, sizeof total);
    npualloc_format_size(o->allocated, allocated, sizeof allocated);
    npualloc_format_size(o->active, active, sizeof active);
    npualloc_format_size(o->device_free, free_s, sizeof free_s);
    npualloc_format_size(o->reserved, reserved, sizeof reserved);
    allowed[0] = '\0';
    if (o->fraction_set) {
        char a[32];
        npualloc_format_size(o->allowed, a, sizeof a);
        snprintf(allowed, sizeof allowed, "%s allowed; ", a);
    }
    return snprintf(buf, len,
                    "NPU out of memory. Tried to allocate %s (NPU %d; %s total capacity; %s already allocated; "
                    "%s current active; %s free; %s%s reserved in total by PyTorch).If reserved memory is >> "
                    "allocated memory try setting max_split_size_mb to avoid fragmentation.",
                    alloc, (int)o->device, total, allocated, active, free_s, allowed, reserved);
}

void npualloc_cache_last_oom(npualloc_oom_info *out)
{
    if (out)
        *out = last_oom;
}

static aclError report_oom(const npualloc_oom_info *info)
{
    last_oom = *info;
    char msg[sizeof last_message];
    npualloc_format_oom(info, msg, sizeof msg);
    cache_set_error(NPUALLOC_ERR_OOM, "%s", msg);
    return ACL_ERROR_RT_MEMORY_ALLOCATION;
}

/* ---- allocation ---- */

aclError npualloc_cache_malloc(int32_t device, size_t size, uint64_t stream, void **ptr)
{
    return npualloc_cache_malloc_ctx(device, size, stream, NULL, ptr);
}

aclError npualloc_cache_malloc_ctx(int32_t device, size_t size, uint64_t stream, npualloc_context *ctx, void **ptr)
{
    if (!ptr) {
        cache_set_error(NPUALLOC_ERR_VALUE, "npualloc_cache_malloc: ptr must not be NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    *ptr = NULL;
    /* graph capture hook (graph.c): an allocation on a capturing stream is a graph ALLOC node, whichever
     * allocator is current (the graph plans its memory itself) */
    aclError grc;
    if (unlikely(graph_capture_active()) && size != 0 && size < K_RAW_ALLOC_LIMIT &&
        graph_capture_malloc(device, size, stream, ptr, &grc))
        return grc;
    if (unlikely(pluggable_active())) /* told only devices that exist */
        return device_ready(device) ? pluggable_malloc(device, size, stream, ptr) : ACL_ERROR_INVALID_PARAM;
    if (size == 0)
        return ACL_SUCCESS; /* torch returns a null pointer without allocating */
    /* No 1 EB check: torch_npu has it in allocate() (npualloc_allocate) only, raw_alloc takes the
     * ordinary path and its OOM. */
    if (size >= K_RAW_ALLOC_LIMIT) {
        npualloc_oom_info info = {.device = device, .over_1eb = true, .requested = size};
        return report_oom(&info);
    }
    device_cache *dc = cache_acquire(device);
    if (!dc)
        return ACL_ERROR_INVALID_PARAM;
    npualloc_oom_info oom;
    dc->current_ctx = ctx;
    aclError rc = cache_malloc_locked(dc, size, stream, ptr, &oom);
    dc->current_ctx = NULL;
    cache_lock_release(&dc->lock);
    if (rc == ACL_ERROR_RT_MEMORY_ALLOCATION)
        return report_oom(&oom);
    return rc;
}

bool npualloc_cache_malloc_cached(int32_t device, size_t size, uint64_t stream, npualloc_context *ctx, void **ptr)
{
    /* No device_valid call: a started cache implies a valid device (see cache_get). */
    if (!ptr || size == 0 || size >= K_ONE_EB || unlikely(graph_capture_active()) || device < 0 ||
        device >= NPU_MAX_DEVICES || unlikely(pluggable_active()))
        return false;
    device_cache *dc = &caches[device];
    if (!__atomic_load_n(&dc->started, __ATOMIC_ACQUIRE) || !cache_lock_try(&dc->lock))
        return false;
    if (unlikely(!dc->started)) { /* a shutdown reset it meanwhile (cache_acquire) */
        cache_lock_release(&dc->lock);
        return false;
    }
    dc->current_ctx = ctx;
    bool served = cache_malloc_cached_locked(dc, size, stream, ptr);
    dc->current_ctx = NULL;
    cache_lock_release(&dc->lock);
    return served;
}

aclError npualloc_cache_free(void *ptr) { return npualloc_cache_free_ctx(ptr, NULL); }

aclError npualloc_cache_free_ctx(void *ptr, npualloc_context *ctx)
{
    if (!ptr)
        return ACL_SUCCESS;
    device_cache *dc = cache_of_ptr(ptr);
    if (dc) {
        cache_lock_acquire(&dc->lock);
        cache_block *b = ptr_map_remove(&dc->allocated_blocks, (uintptr_t)ptr);
        if (b) {
            dc->current_ctx = ctx;
            cache_free_locked(dc, b);
            dc->current_ctx = NULL;
            cache_lock_release(&dc->lock);
            return ACL_SUCCESS;
        }
        cache_lock_release(&dc->lock);
    }
    /* graph capture hook (graph.c): graph memory is freed by a FREE node (or with its graph) */
    aclError grc;
    if (unlikely(graph_ranges_active()) && graph_free(ptr, &grc))
        return grc;
    if (unlikely(pluggable_active()))
        return pluggable_free(ptr);
    cache_set_error(NPUALLOC_ERR_RUNTIME, "invalid device pointer: %p", ptr);
    return ACL_ERROR_INVALID_PARAM;
}

/* Looks up a live block; returns with its cache locked, or NULL (error set). */
static cache_block *locked_block(void *ptr, device_cache **out)
{
    device_cache *dc = ptr ? cache_of_ptr(ptr) : NULL;
    if (dc) {
        cache_lock_acquire(&dc->lock);
        cache_block *b = ptr_map_get(&dc->allocated_blocks, (uintptr_t)ptr);
        if (b) {
            *out = dc;
            return b;
        }
        cache_lock_release(&dc->lock);
    }
    cache_set_error(NPUALLOC_ERR_RUNTIME, "invalid device pointer: %p", ptr);
    return NULL;
}

aclError npualloc_cache_block_info(void *ptr, int32_t *device, uint64_t *stream, size_t *size)
{
    if (unlikely(pluggable_active()) && pluggable_info(ptr, device, stream, size))
        return ACL_SUCCESS;
    device_cache *dc;
    cache_block *b = locked_block(ptr, &dc);
    if (!b)
        return ACL_ERROR_INVALID_PARAM;
    if (device)
        *device = dc->device;
    if (stream)
        *stream = b->stream;
    if (size)
        *size = b->size;
    cache_lock_release(&dc->lock);
    return ACL_SUCCESS;
}

/* A stream id must name a live stream (stream_acquire_id). */
static bool stream_exists(int32_t device, uint64_t stream)
{
    npu_stream *s;
    if (stream_acquire_id(device, stream, &s) != ACL_SUCCESS)
        return false;
    stream_release(s);
    return true;
}

/* The id of `stream` of `device`: every default stream's handle is 0, which names the block's device's
 * (device -1), so another device's default stream gets an id of its own. */
static uint64_t stream_of_device(int32_t device, uint64_t stream)
{
    return stream == 0 && device >= 0 ? stream_default_id(device) : stream;
}

/* The id a block's use list keeps: its own device's default stream is 0, however it was named. */
static uint64_t use_id(const device_cache *dc, uint64_t id)
{
    return id == stream_default_id(dc->device) ? 0 : id;
}

/* The device of a *_stream_on call must exist (error set when not). */
static bool stream_device_valid(int32_t device, const char *fn)
{
    if (device_valid(device))
        return true;
    cache_set_error(NPUALLOC_ERR_RUNTIME, "%s: %d is not a device", fn, (int)device);
    return false;
}

static aclError record_stream(void *ptr, int32_t device, uint64_t stream)
{
    uint64_t id = stream_of_device(device, stream);
    if (id != 0 && !stream_exists(device, id)) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "record_stream: %#llx is not a live stream", (unsigned long long)stream);
        return ACL_ERROR_INVALID_PARAM;
    }
    if (unlikely(pluggable_active()) && pluggable_info(ptr, NULL, NULL, NULL))
        return ACL_SUCCESS; /* torch_npu calls the library's record_stream_fn, which Python cannot set */
    device_cache *dc;
    cache_block *b = locked_block(ptr, &dc);
    aclError grc; /* graph capture hook (graph.c): graph memory's FREE node also waits for the stream */
    if (!b)
        return unlikely(graph_capture_active()) && graph_record_stream(ptr, id, &grc) ? grc : ACL_ERROR_INVALID_PARAM;
    aclError rc = cache_record_stream_locked(dc, b, use_id(dc, id));
    cache_lock_release(&dc->lock);
    if (rc != ACL_SUCCESS)
        cache_set_error(NPUALLOC_ERR_RUNTIME, "record_stream: out of host memory");
    return rc;
}

aclError npualloc_cache_record_stream(void *ptr, uint64_t stream) { return record_stream(ptr, -1, stream); }

aclError npualloc_cache_record_stream_on(void *ptr, int32_t device, uint64_t stream)
{
    return stream_device_valid(device, "record_stream") ? record_stream(ptr, device, stream) : ACL_ERROR_INVALID_PARAM;
}

static aclError erase_stream(void *ptr, int32_t device, uint64_t stream)
{
    if (unlikely(pluggable_active()) && pluggable_info(ptr, NULL, NULL, NULL))
        return ACL_SUCCESS; /* as record_stream */
    device_cache *dc;
    cache_block *b = locked_block(ptr, &dc);
    if (!b)
        return ACL_ERROR_INVALID_PARAM;
    cache_erase_stream_locked(dc, b, use_id(dc, stream_of_device(device, stream)));
    cache_lock_release(&dc->lock);
    return ACL_SUCCESS;
}

aclError npualloc_cache_erase_stream(void *ptr, uint64_t stream) { return erase_stream(ptr, -1, stream); }

aclError npualloc_cache_erase_stream_on(void *ptr, int32_t device, uint64_t stream)
{
    return stream_device_valid(device, "erase_stream") ? erase_stream(ptr, device, stream) : ACL_ERROR_INVALID_PARAM;
}

/* ---- the uncached path (PYTORCH_NO_NPU_MEMORY_CACHING) ---- */

/* Read once, as torch_npu does (-1: not yet).  Atomic: threads may ask first at the same time. */
static _Atomic int caching_disabled = -1;
static pthread_mutex_t uncached_lock = PTHREAD_MUTEX_INITIALIZER;
static ptr_map uncached_blocks; /* ptr -> device + 1 */

bool npualloc_caching_disabled(void)
{
    int disabled = atomic_load_explicit(&caching_disabled, memory_order_relaxed);
    if (disabled < 0) {
        const char *v = getenv("PYTORCH_NO_NPU_MEMORY_CACHING");
        disabled = v && strtol(v, NULL, 10) != 0;
        atomic_store_explicit(&caching_disabled, disabled, memory_order_relaxed);
    }
    return disabled;
}

aclError npualloc_allocate(int32_t device, size_t size, uint64_t stream, void **ptr)
{
    return npualloc_allocate_ctx(device, size, stream, NULL, ptr);
}

aclError npualloc_allocate_ctx(int32_t device, size_t size, uint64_t stream, npualloc_context *ctx, void **ptr)
{
    /* a pluggable allocator decides for itself; torch_npu's allocate() checks for 1 EB first */
    if (pluggable_active() || (size < K_ONE_EB && !npualloc_caching_disabled()))
        return npualloc_cache_malloc_ctx(device, size, stream, ctx, ptr);
    if (!ptr)
        return ACL_ERROR_INVALID_PARAM;
    *ptr = NULL;
    if (size == 0)
        return ACL_SUCCESS;
    if (size >= K_ONE_EB) {
        npualloc_oom_info info = {.device = device, .over_1eb = true, .requested = size};
        return report_oom(&info);
    }
    aclError rc = runtime_ensure_init();
    /* graph capture hook (graph.c): an allocation on a capturing stream is a graph ALLOC node */
    if (rc == ACL_SUCCESS && unlikely(graph_capture_active()) && graph_capture_malloc(device, size, stream, ptr, &rc))
        return rc;
    if (rc == ACL_SUCCESS && !device_valid(device))
        rc = ACL_ERROR_RT_INVALID_DEVICEID;
    if (rc == ACL_SUCCESS)
        rc = vmm_malloc(device, size + K_PAD_SIZE, (vmm_kind_choice){{MEM_HUGE, MEM_NORMAL}, 2}, VMM_OWNER_ALLOCATOR,
                        false, ptr);
    if (rc != ACL_SUCCESS) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "NPU error: aclrtMallocAlign32 of %zu bytes on device %d returned %d",
                        size + K_PAD_SIZE, (int)device, rc);
        return rc;
    }
    pthread_mutex_lock(&uncached_lock);
    int err = ptr_map_put(&uncached_blocks, (uintptr_t)*ptr, (void *)(uintptr_t)(device + 1));
    pthread_mutex_unlock(&uncached_lock);
    if (err) {
        vmm_free_malloc(*ptr, VMM_OWNER_ALLOCATOR);
        *ptr = NULL;
        cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory");
        return ACL_ERROR_BAD_ALLOC;
    }
    return ACL_SUCCESS;
}

aclError npualloc_deallocate(void *ptr)
{
    if (!ptr)
        return ACL_SUCCESS;
    pthread_mutex_lock(&uncached_lock);
    uintptr_t dev1 = (uintptr_t)ptr_map_remove(&uncached_blocks, (uintptr_t)ptr);
    pthread_mutex_unlock(&uncached_lock);
    if (!dev1)
        return npualloc_cache_free(ptr);
    /* torch_npu synchronizes the device before every uncached free. */
    (void)stream_wait_device((int32_t)dev1 - 1);
    return vmm_free_malloc(ptr, VMM_OWNER_ALLOCATOR);
}

/* ---- private pools ---- */

/* torch's MemPool id counters: user-created (0, uid++), internal (uuid++, 0), both from 1. */
static _Atomic uint64_t next_user_pool = 1, next_internal_pool = 1;

npualloc_mempool_id npualloc_mempool_id_new(bool user_created)
{
    npualloc_mempool_id id = {0, 0};
    if (user_created)
        id.second = next_user_pool++;
    else
        id.first = next_internal_pool++;
    return id;
}

/* Runs a pool operation on a started device under its lock. */
#define WITH_DEVICE(device, expr)                                                                              \
    do {                                                                                                           \
        device_cache *dc_ = cache_acquire(device);                                                                 \
        if (!dc_)                                                                                                  \
            return ACL_ERROR_INVALID_PARAM;                                                                        \
        aclError rc_ = (expr);                                                                                     \
        cache_lock_release(&dc_->lock);                                                                            \
        return rc_;                                                                                                \
    } while (0)

aclError npualloc_cache_pool_create(int32_t device, npualloc_mempool_id id)
{
    WITH_DEVICE(device, cache_pool_create_locked(dc_, id, NULL, NULL));
}

aclError npualloc_cache_pool_create_with_allocator(int32_t device, npualloc_mempool_id id, npualloc_alloc_fn alloc_fn,
                                                   npualloc_free_fn free_fn)
{
    if (!alloc_fn || !free_fn) {
        cache_set_error(NPUALLOC_ERR_VALUE, "npualloc_cache_pool_create_with_allocator: alloc_fn and free_fn must "
                                            "not be NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    WITH_DEVICE(device, cache_pool_create_locked(dc_, id, alloc_fn, free_fn));
}

aclError npualloc_cache_pool_release(int32_t device, npualloc_mempool_id id)
{
    WITH_DEVICE(device, cache_pool_release_locked(dc_, id));
}

aclError npualloc_cache_pool_set_use_on_oom(int32_t device, npualloc_mempool_id id, bool use_on_oom)
{
    WITH_DEVICE(device, cache_pool_set_use_on_oom_locked(dc_, id, use_on_oom));
}

aclError npualloc_cache_pool_set_no_split(int32_t device, npualloc_mempool_id id)
{
    WITH_DEVICE(device, cache_pool_set_no_split_locked(dc_, id));
}

aclError npualloc_cache_pool_begin(int32_t device, npualloc_mempool_id id, npualloc_pool_filter filter,
                                   uint64_t value)
{
    if (filter != NPUALLOC_POOL_FILTER_THREAD && filter != NPUALLOC_POOL_FILTER_STREAM) {
        cache_set_error(NPUALLOC_ERR_VALUE, "unknown pool filter %d", (int)filter);
        return ACL_ERROR_INVALID_PARAM;
    }
    WITH_DEVICE(device, cache_pool_begin_locked(dc_, id, filter, value));
}

aclError npualloc_cache_pool_join(int32_t device, npualloc_mempool_id id, uint64_t stream)
{
    WITH_DEVICE(device, cache_pool_join_locked(dc_, id, stream));
}

aclError npualloc_cache_pool_end(int32_t device, npualloc_mempool_id id)
{
    WITH_DEVICE(device, cache_pool_end_locked(dc_, id));
}

static aclError empty_pool(device_cache *dc, npualloc_mempool_id id)
{
    cache_pool_empty_locked(dc, id);
    return ACL_SUCCESS;
}

aclError npualloc_cache_pool_empty(int32_t device, npualloc_mempool_id id)
{
    WITH_DEVICE(device, empty_pool(dc_, id));
}

int npualloc_cache_pool_use_count(int32_t device, npualloc_mempool_id id)
{
    device_cache *dc = cache_acquire(device);
    if (!dc)
        return 0;
    private_pool *pp = cache_pool_find(dc, id);
    int n = pp ? pp->use_count : 0;
    cache_lock_release(&dc->lock);
    return n;
}

/* ---- device-wide operations ---- */

aclError npualloc_cache_empty(void) { return npualloc_cache_empty_ctx(NULL); }

aclError npualloc_cache_empty_ctx(npualloc_context *ctx)
{
    if (runtime_ensure_init() != ACL_SUCCESS)
        return ACL_SUCCESS; /* nothing was ever cached */
    for (int d = 0; d < device_count(); d++) {
        device_cache *dc = &caches[d];
        if (!__atomic_load_n(&dc->started, __ATOMIC_ACQUIRE))
            continue;
        cache_lock_acquire(&dc->lock);
        dc->current_ctx = ctx;
        cache_empty_locked(dc, false);
        dc->current_ctx = NULL;
        cache_lock_release(&dc->lock);
    }
    return ACL_SUCCESS;
}

/* torch_npu: emptyVirtAddrCache() is emptyCacheImpl(check_error, free_physical = false), i.e. the
 * same emptyCache(device, check_error, free_physical) -> release_cached_blocks(..., free_physical)
 * path as empty_cache with one flag changed: unmapped expandable pages keep their handles in the
 * pool's free_physical_handles_.  That path also releases whole free plain segments (release_block
 * does not look at the flag) and freeable private pools, so this does too; only the expandable
 * pages' physical memory is kept.  torch_npu documents the call as requiring
 * expandable_segments:True ("otherwise a runtime error"). */
aclError npualloc_cache_empty_virt_addr_cache(void)
{
    if (runtime_ensure_init() != ACL_SUCCESS)
        return ACL_SUCCESS;
    pthread_mutex_lock(&api_lock);
    load_settings();
    bool expandable = cache_settings.expandable_segments;
    pthread_mutex_unlock(&api_lock);
    if (!expandable) {
        cache_set_error(NPUALLOC_ERR_RUNTIME,
                        "Unsupported config for empty_virt_addr_cache, please enable expandable_segments.");
        return ACL_ERROR_INVALID_PARAM;
    }
    for (int d = 0; d < device_count(); d++) {
        device_cache *dc = &caches[d];
        if (!__atomic_load_n(&dc->started, __ATOMIC_ACQUIRE))
            continue;
        cache_lock_acquire(&dc->lock);
        cache_empty_locked(dc, true);
        cache_lock_release(&dc->lock);
    }
    return ACL_SUCCESS;
}

aclError npualloc_cache_set_fraction(int32_t device, double fraction)
{
    if (!(fraction >= 0.0 && fraction <= 1.0)) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "invalid fraction:%g. Please set within [0, 1].", fraction);
        return ACL_ERROR_INVALID_PARAM;
    }
    device_cache *dc = cache_acquire(device);
    if (!dc)
        return ACL_ERROR_INVALID_PARAM;
    cache_set_fraction_locked(dc, fraction);
    cache_lock_release(&dc->lock);
    return ACL_SUCCESS;
}

aclError npualloc_cache_get_fraction(int32_t device, double *fraction)
{
    device_cache *dc = fraction ? cache_acquire(device) : NULL;
    if (!dc)
        return ACL_ERROR_INVALID_PARAM;
    *fraction = dc->set_fraction ? dc->fraction : 1.0;
    cache_lock_release(&dc->lock);
    return ACL_SUCCESS;
}

aclError npualloc_cache_get_stats(int32_t device, npualloc_stats *out)
{
    device_cache *dc = out ? cache_acquire(device) : NULL;
    if (!dc)
        return ACL_ERROR_INVALID_PARAM;
    cache_stats_read(&dc->stats, out);
    cache_lock_release(&dc->lock);
    return ACL_SUCCESS;
}

/* Applies fn to every stat of a device (the nine arrays and the two oversize stats). */
static void each_stat(npualloc_stats *s, void (*fn)(npualloc_stat *))
{
    npualloc_stat *arrays[] = {s->allocation,     s->segment,         s->active,
                               s->inactive_split, s->allocated_bytes, s->reserved_bytes,
                               s->active_bytes,   s->inactive_split_bytes, s->requested_bytes};
    for (size_t i = 0; i < ARRAY_LEN(arrays); i++)
        for (int k = 0; k < NPUALLOC_STAT_TYPES; k++)
            fn(&arrays[i][k]);
    fn(&s->oversize_allocations);
    fn(&s->oversize_segments);
}

static void reset_accumulated_stat(npualloc_stat *s) { s->allocated = s->freed = 0; }

aclError npualloc_cache_reset_peak(int32_t device)
{
    device_cache *dc = cache_acquire(device);
    if (!dc)
        return ACL_ERROR_INVALID_PARAM;
    cache_stats_reset_peak(&dc->stats);
    cache_lock_release(&dc->lock);
    return ACL_SUCCESS;
}

aclError npualloc_cache_reset_accumulated(int32_t device)
{
    device_cache *dc = cache_acquire(device);
    if (!dc)
        return ACL_ERROR_INVALID_PARAM;
    each_stat(&dc->stats, reset_accumulated_stat);
    dc->stats.num_alloc_retries = 0;
    dc->stats.num_ooms = 0;
    dc->stats.num_sync_all_streams = 0;
    dc->stats.num_device_alloc = 0;
    dc->stats.num_device_free = 0;
    dc->stats.num_oom_rejections = 0;
    cache_lock_release(&dc->lock);
    return ACL_SUCCESS;
}

aclError npualloc_cache_check(int32_t device, char *why, size_t len)
{
    if (!why && len) /* a message of len bytes would be written through why */
        return ACL_ERROR_INVALID_PARAM;
    device_cache *dc = cache_acquire(device);
    if (!dc) {
        snprintf(why, len, "%s", last_message);
        return ACL_ERROR_INVALID_PARAM;
    }
    aclError rc = cache_check_locked(dc, why, len);
    cache_lock_release(&dc->lock);
    return rc;
}

/* ---- snapshots ---- */

aclError npualloc_cache_snapshot(npualloc_snapshot **out)
{
    if (!out)
        return ACL_ERROR_INVALID_PARAM;
    npualloc_snapshot *s = calloc(1, sizeof *s);
    if (!s)
        return ACL_ERROR_BAD_ALLOC;
    snapshot_builder sb = {.snap = s};
    int count = runtime_ensure_init() == ACL_SUCCESS ? device_count() : 0;
    for (int d = 0; d < count && !sb.failed; d++) {
        device_cache *dc = &caches[d];
        if (!__atomic_load_n(&dc->started, __ATOMIC_ACQUIRE))
            continue;
        cache_lock_acquire(&dc->lock);
        snapshot_add_device(&sb, dc);
        cache_history_record(dc, TRACE_SNAPSHOT, 0, (size_t)cache_stat_all(dc->stats.active_bytes).current, 0);
        cache_lock_release(&dc->lock);
    }
    if (sb.failed) {
        npualloc_snapshot_free(s);
        cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory for the snapshot");
        return ACL_ERROR_BAD_ALLOC;
    }
    *out = s;
    return ACL_SUCCESS;
}

/* Read by any thread (npualloc_cache_record_context) while another may change it.  Back to
 * NEVER wherever the caches start afresh (shutdown, a forked child), as their history does. */
static _Atomic npualloc_record_context record_level;

npualloc_record_context npualloc_cache_record_context(void) { return atomic_load(&record_level); }

static void swap_entries(trace_entry *h, size_t i, size_t j)
{
    trace_entry t = h[i];
    h[i] = h[j];
    h[j] = t;
}

static void reverse_entries(trace_entry *h, size_t from, size_t to)
{
    while (from + 1 < to)
        swap_entries(h, from++, --to);
}

/* Keeps the newest `keep` entries of the ring, oldest first from index 0 (in place: nothing to
 * fail); the capacity becomes the count, so cache_history_add grows it again up to the new limit. */
static void history_keep_newest(device_cache *dc, size_t keep)
{
    trace_entry *h = dc->history;
    size_t n = dc->history_count;
    /* Rotate the oldest entry (at history_next once the ring wrapped) to the front. */
    reverse_entries(h, 0, dc->history_next);
    reverse_entries(h, dc->history_next, n);
    reverse_entries(h, 0, n);
    size_t drop = n > keep ? n - keep : 0;
    for (size_t i = 0; i < drop; i++)
        trace_entry_drop(&h[i]);
    if (drop)
        memmove(h, h + drop, (n - drop) * sizeof *h);
    dc->history_count = dc->history_capacity = n - drop;
    dc->history_next = 0;
    if (dc->history_count == 0) {
        free(h);
        dc->history = NULL;
    }
}

aclError npualloc_cache_record_history(bool enabled, npualloc_record_context when, size_t max_entries)
{
    const npualloc_history_options opts = {.clear_history = true, .skip_actions = 0};
    return npualloc_cache_record_history_opts(enabled, when, max_entries, &opts);
}

aclError npualloc_cache_record_history_opts(bool enabled, npualloc_record_context when, size_t max_entries,
                                            const npualloc_history_options *opts)
{
    if ((unsigned)when > NPUALLOC_RECORD_ALL || !opts ||
        (opts->skip_actions & ~(NPUALLOC_TRACE_SKIP(TRACE_ACTION_COUNT) - 1u)) != 0)
        return ACL_ERROR_INVALID_PARAM;
    npualloc_record_context level = enabled ? when : NPUALLOC_RECORD_NEVER;
    if (enabled && max_entries == 0)
        max_entries = 1;
    /* One call at a time, so that every device records as the last call said; the level reported is set
     * only once every device took the call's settings (a call that fails on the way leaves it alone). */
    pthread_mutex_lock(&history_lock);
    int count = runtime_ensure_init() == ACL_SUCCESS ? device_count() : 0;
    for (int d = 0; d < count; d++) {
        device_cache *dc = cache_acquire(d);
        if (!dc) {
            pthread_mutex_unlock(&history_lock);
            return ACL_ERROR_INVALID_PARAM;
        }
        history_keep_newest(dc, enabled && !opts->clear_history ? max_entries : 0);
        dc->record_context = level;
        dc->history_skip = opts->skip_actions;
        dc->history_max = enabled ? max_entries : 0; /* at least 1 when enabled */
        cache_lock_release(&dc->lock);
    }
    atomic_store(&record_level, level);
    pthread_mutex_unlock(&history_lock);
    return ACL_SUCCESS;
}

aclError npualloc_cache_set_user_metadata(int32_t device, const void *data, size_t len)
{
    if (len && !data)
        return ACL_ERROR_INVALID_PARAM;
    npualloc_context *md = NULL;
    if (len && !(md = npualloc_context_create(data, len)))
        return ACL_ERROR_BAD_ALLOC;
    device_cache *dc = cache_acquire(device);
    if (!dc) {
        npualloc_context_release(md);
        return ACL_ERROR_INVALID_PARAM;
    }
    npualloc_context *old = dc->user_metadata;
    dc->user_metadata = md;
    cache_lock_release(&dc->lock);
    npualloc_context_release(old);
    return ACL_SUCCESS;
}

aclError npualloc_cache_get_user_metadata(int32_t device, npualloc_context **out)
{
    if (!out)
        return ACL_ERROR_INVALID_PARAM;
    device_cache *dc = cache_acquire(device);
    if (!dc)
        return ACL_ERROR_INVALID_PARAM;
    *out = dc->user_metadata;
    npualloc_context_retain(*out);
    cache_lock_release(&dc->lock);
    return ACL_SUCCESS;
}

/* ---- lifetime ---- */

void caching_shutdown(void)
{
    pthread_mutex_lock(&api_lock);
    for (int d = 0; d < NPU_MAX_DEVICES; d++) {
        device_cache *dc = &caches[d];
        if (!caches_ready)
            break;
        cache_lock_acquire(&dc->lock);
        if (dc->started)
            cache_device_release_all(dc);
        cache_lock_release(&dc->lock);
    }
    pthread_mutex_lock(&uncached_lock);
    ptr_map_free(&uncached_blocks);
    pthread_mutex_unlock(&uncached_lock);
    settings_loaded = false;
    free(settings_text);
    settings_text = NULL;
    any_cache_started = false;
    atomic_store(&record_level, NPUALLOC_RECORD_NEVER);
    memset(&settings_error, 0, sizeof settings_error);
    atomic_store_explicit(&caching_disabled, -1, memory_order_relaxed);
    atomic_store(&warned_1g_fallback, false);
    pthread_mutex_unlock(&api_lock);
}

void caching_atfork_prepare(void)
{
    pthread_mutex_lock(&history_lock);
    pthread_mutex_lock(&api_lock);
    if (caches_ready)
        for (int d = 0; d < NPU_MAX_DEVICES; d++)
            cache_lock_acquire(&caches[d].lock);
    pthread_mutex_lock(&uncached_lock);
}

/* The warning queue's and the callback list's locks are leaves (warnings are pushed under cache
 * and vmm locks). */
void caching_atfork_prepare_leaves(void)
{
    pthread_mutex_lock(&warning_lock);
    pthread_mutex_lock(&free_callback_lock);
}

void caching_atfork_parent(void)
{
    pthread_mutex_unlock(&free_callback_lock);
    pthread_mutex_unlock(&warning_lock);
    pthread_mutex_unlock(&uncached_lock);
    if (caches_ready)
        for (int d = NPU_MAX_DEVICES - 1; d >= 0; d--)
            cache_lock_release(&caches[d].lock);
    pthread_mutex_unlock(&api_lock);
    pthread_mutex_unlock(&history_lock);
}

void caching_atfork_child(void)
{
    /* The forking thread took every lock in prepare: it releases them as the parent does. */
    caching_atfork_parent();
    /* Forget every block without touching device memory (it is not in this process). */
    ptr_map_free(&uncached_blocks);
    for (int d = 0; d < NPU_MAX_DEVICES && caches_ready; d++) {
        device_cache *dc = &caches[d];
        if (dc->started)
            cache_device_forget(dc);
    }
    atomic_store(&record_level, NPUALLOC_RECORD_NEVER);
}
