/*
 * device.c - virtual NPU devices: configuration from the environment, capacity accounting,
 * the thread's current device and peer access.
 */
#include "device.h"

#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "fault.h"
#include "stream.h"

typedef struct device {
    size_t used[MEM_KIND_COUNT]; /* usage_lock */
    /* The references and the epoch in one word, changed together by compare-and-swap, so that a
     * reference taken while another thread drops the last one is never lost to that reset: low
     * 32 bits aclrtSetDevice minus aclrtResetDevice (0 after a forced reset), high 32 bits the
     * epoch, bumped when the last reference goes (every context on the device ends). */
    _Atomic uint64_t contexts;
    /* aclrtSetDevice calls so far: the last reset waits again when one came during its wait (a
     * reference taken and dropped meanwhile leaves `contexts` as it was, and its work queued). */
    _Atomic uint64_t sets;
    /* 1 + the epoch in which access to peer i was enabled, 0 if it was not: a reset ends it
     * without touching these, so it cannot wipe an enable made in the next epoch. */
    _Atomic uint64_t peer_since[NPU_MAX_DEVICES];
} device;

static const npualloc_config default_config = {
    .device_count = 8,
    .device_memory = (uint64_t)64 << 30,
    .huge_memory = (uint64_t)64 << 30,
    .huge1g_memory = 0,
    .ddr_memory = 0,
};

/* Guards the start of the runtime and the configuration before it. */
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_bool initialized;
static bool configured; /* npualloc_configure() was called */
static npualloc_config config;
static char init_error[256];
static device devices[NPU_MAX_DEVICES];
/* Guards every device's usage.  One lock for all: usage changes only when a segment or a physical
 * handle comes or goes (never on a cache hit), and fork's prepare handler takes one lock, not one
 * per device. */
static pthread_mutex_t usage_lock = PTHREAD_MUTEX_INITIALIZER;

/* The current device of this thread, valid while the device's epoch is unchanged.  A thread bound to an
 * explicit context has that context's device instead, valid while the context's generation is unchanged. */
static _Thread_local int32_t current_dev = -1;
static _Thread_local uint32_t current_epoch;
static _Thread_local device_context *current_ctx;
static _Thread_local uint32_t current_ctx_generation;

static uint32_t context_refs(uint64_t contexts) { return (uint32_t)contexts; }
static uint32_t context_epoch(uint64_t contexts) { return (uint32_t)(contexts >> 32); }
/* The word after the last reference went: no references, the next epoch. */
static uint64_t contexts_ended(uint64_t contexts) { return (uint64_t)(context_epoch(contexts) + 1u) << 32; }

size_t mem_kind_page_size(mem_kind kind)
{
    switch (kind) {
    case MEM_NORMAL:
        return 4 * KiB;
    case MEM_HUGE:
    case MEM_DDR_HUGE:
        return 2 * MiB;
    case MEM_HUGE1G:
        return GiB;
    default:
        return 4 * KiB;
    }
}

/* ---- sizes and the environment ---- */

int npualloc_parse_size(const char *text, uint64_t *out)
{
    if (!text || !out)
        return -1;
    const char *p = text;
    while (isspace((unsigned char)*p))
        p++;
    if (!isdigit((unsigned char)*p))
        return -1;
    /* Integer part exactly, then an optional fraction: no floating point for plain integers. */
    uint64_t whole = 0;
    while (isdigit((unsigned char)*p)) {
        unsigned d = (unsigned)(*p++ - '0');
        if (whole > (UINT64_MAX - d) / 10)
            return -1;
        whole = whole * 10 + d;
    }
    uint64_t frac_num = 0, frac_den = 1;
    if (*p == '.') {
        p++;
        if (!isdigit((unsigned char)*p))
            return -1;
        while (isdigit((unsigned char)*p)) {
            if (frac_den < 1000000000000ULL) { /* 12 digits are plenty */
                frac_num = frac_num * 10 + (unsigned)(*p - '0');
                frac_den *= 10;
            }
            p++;
        }
    }
    while (isspace((unsigned char)*p))
        p++;
    static const struct {
        const char *suffix;
        unsigned shift;
    } units[] = {{"KiB", 10}, {"MiB", 20}, {"GiB", 30}, {"TiB", 40}, {"K", 10}, {"M", 20},
                 {"G", 30},   {"T", 40},   {"B", 0},    {"", 0}};
    for (size_t i = 0; i < ARRAY_LEN(units); i++) {
        size_t n = strlen(units[i].suffix);
        if (strncmp(p, units[i].suffix, n) != 0)
            continue;
        const char *rest = p + n;
        while (isspace((unsigned char)*rest))
            rest++;
        if (*rest != '\0')
            continue;
        unsigned shift = units[i].shift;
        if (shift && whole > (UINT64_MAX >> shift))
            return -1;
        uint64_t bytes = whole << shift;
        if (frac_num) {
            /* frac_num / frac_den of one unit, rounded down to whole bytes. */
            long double extra = (long double)frac_num / (long double)frac_den * (long double)((uint64_t)1 << shift);
            uint64_t add = (uint64_t)extra;
            if (bytes > UINT64_MAX - add)
                return -1;
            bytes += add;
        }
        *out = bytes;
        return 0;
    }
    return -1;
}

static int env_size(const char *name, uint64_t *value, char *err, size_t errlen)
{
    const char *text = getenv(name);
    if (!text || !*text)
        return 0;
    if (npualloc_parse_size(text, value) != 0) {
        snprintf(err, errlen,
                 "%s='%s' is not a size: use bytes or a number with KiB, MiB, GiB or TiB (or K, M, G, T)",
                 name, text);
        return -1;
    }
    return 0;
}

aclError npualloc_config_from_env(npualloc_config *out, char *err, size_t errlen)
{
    if (!out)
        return ACL_ERROR_INVALID_PARAM;
    npualloc_config c = default_config;
    long count;
    int given = env_whole_number("NPUALLOC_DEVICE_COUNT", 1, NPU_MAX_DEVICES, &count);
    if (given < 0) {
        snprintf(err, errlen, "NPUALLOC_DEVICE_COUNT='%s' is not a device count: use a whole number from 1 to %d",
                 getenv("NPUALLOC_DEVICE_COUNT"), NPU_MAX_DEVICES);
        return ACL_ERROR_INVALID_PARAM;
    }
    if (given > 0)
        c.device_count = (int32_t)count;
    const char *huge = getenv("NPUALLOC_HUGE_MEMORY");
    bool huge_given = huge && *huge;
    if (env_size("NPUALLOC_DEVICE_MEMORY", &c.device_memory, err, errlen) ||
        env_size("NPUALLOC_HUGE_MEMORY", &c.huge_memory, err, errlen) ||
        env_size("NPUALLOC_HUGE1G_MEMORY", &c.huge1g_memory, err, errlen) ||
        env_size("NPUALLOC_DDR_MEMORY", &c.ddr_memory, err, errlen))
        return ACL_ERROR_INVALID_PARAM;
    if (!huge_given)
        c.huge_memory = c.device_memory;
    aclError rc = npualloc_config_check(&c, err, errlen);
    if (rc == ACL_SUCCESS)
        *out = c;
    return rc;
}

aclError npualloc_config_check(const npualloc_config *c, char *err, size_t errlen)
{
    const char *problem = NULL;
    if (!c)
        problem = "no configuration given";
    else if (c->device_count < 1 || c->device_count > NPU_MAX_DEVICES)
        problem = "NPUALLOC_DEVICE_COUNT must be from 1 to 64";
    else if (c->device_memory == 0)
        problem = "NPUALLOC_DEVICE_MEMORY must be more than 0";
    else if (c->device_memory > ((uint64_t)1 << 50))
        problem = "NPUALLOC_DEVICE_MEMORY must be at most 1024 TiB";
    else if (c->huge_memory > c->device_memory)
        problem = "NPUALLOC_HUGE_MEMORY must not exceed NPUALLOC_DEVICE_MEMORY";
    else if (c->huge1g_memory > c->device_memory)
        problem = "NPUALLOC_HUGE1G_MEMORY must not exceed NPUALLOC_DEVICE_MEMORY";
    else if (c->huge1g_memory % GiB != 0)
        problem = "NPUALLOC_HUGE1G_MEMORY must be a whole number of GiB";
    else if (c->ddr_memory > ((uint64_t)1 << 50))
        problem = "NPUALLOC_DDR_MEMORY must be at most 1024 TiB";
    if (!problem)
        return ACL_SUCCESS;
    if (err && errlen)
        snprintf(err, errlen, "%s", problem);
    return ACL_ERROR_INVALID_PARAM;
}

aclError npualloc_configure(const npualloc_config *cfg, char *err, size_t errlen)
{
    aclError rc = npualloc_config_check(cfg, err, errlen);
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_mutex_lock(&init_lock);
    if (atomic_load(&initialized)) {
        pthread_mutex_unlock(&init_lock);
        if (err && errlen)
            snprintf(err, errlen, "the devices are already initialised: configure npualloc before its first use");
        return ACL_ERROR_REPEAT_INITIALIZE;
    }
    config = *cfg;
    configured = true;
    pthread_mutex_unlock(&init_lock);
    return ACL_SUCCESS;
}

static void reset_devices(void)
{
    for (int i = 0; i < NPU_MAX_DEVICES; i++) {
        device *d = &devices[i];
        memset(d->used, 0, sizeof d->used);
        /* forget every thread's current device, and every peer access */
        atomic_store(&d->contexts, contexts_ended(atomic_load(&d->contexts)));
        for (int j = 0; j < NPU_MAX_DEVICES; j++)
            atomic_store(&d->peer_since[j], 0);
    }
}

aclError runtime_ensure_init(void)
{
    if (likely(atomic_load_explicit(&initialized, memory_order_acquire)))
        return ACL_SUCCESS;
    pthread_mutex_lock(&init_lock);
    aclError rc = ACL_SUCCESS;
    if (!atomic_load(&initialized)) {
        if (!configured)
            rc = npualloc_config_from_env(&config, init_error, sizeof init_error);
        if (rc == ACL_SUCCESS && !runtime_check_env(init_error, sizeof init_error))
            rc = ACL_ERROR_INVALID_PARAM;
        if (rc == ACL_SUCCESS && !fault_arm_from_env(init_error, sizeof init_error))
            rc = ACL_ERROR_INVALID_PARAM;
        if (rc == ACL_SUCCESS) {
            init_error[0] = '\0';
            reset_devices();
            atomic_store_explicit(&initialized, true, memory_order_release);
        } else {
            rc = ACL_ERROR_UNINITIALIZE;
        }
    }
    pthread_mutex_unlock(&init_lock);
    return rc;
}

bool npualloc_initialized(void) { return atomic_load(&initialized); }

/* A copy for the calling thread: another thread's failed start rewrites init_error (under
 * init_lock) at any time. */
const char *npualloc_init_error(void)
{
    static _Thread_local char copy[sizeof init_error];
    pthread_mutex_lock(&init_lock);
    memcpy(copy, init_error, sizeof copy);
    pthread_mutex_unlock(&init_lock);
    return copy[0] ? copy : NULL;
}

aclError npualloc_get_config(npualloc_config *out)
{
    if (!out)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc == ACL_SUCCESS)
        *out = config;
    return rc;
}

const npualloc_config *device_config(void) { return &config; }

int device_count(void) { return atomic_load(&initialized) ? config.device_count : 0; }

bool device_valid(int32_t dev) { return dev >= 0 && dev < device_count(); }

/* Leaves of the lock order: nothing is locked while one of these is held. */
void device_atfork_prepare(void)
{
    pthread_mutex_lock(&init_lock);
    pthread_mutex_lock(&usage_lock);
}

void device_atfork_parent(void)
{
    pthread_mutex_unlock(&usage_lock);
    pthread_mutex_unlock(&init_lock);
}

void device_atfork_child(void)
{
    device_atfork_parent(); /* this thread took them in prepare */
    /* Device memory is not inherited (MADV_DONTFORK): start with empty devices. */
    if (atomic_load(&initialized))
        reset_devices();
}

void device_shutdown(void)
{
    pthread_mutex_lock(&init_lock);
    if (atomic_load(&initialized))
        reset_devices();
    atomic_store(&initialized, false);
    configured = false;
    pthread_mutex_unlock(&init_lock);
}

/* ---- the current device ---- */

aclError aclrtSetDevice(int32_t dev)
{
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (!device_valid(dev))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    device *d = &devices[dev];
    uint64_t w = atomic_load(&d->contexts), next;
    do /* (the count saturates rather than carry into the epoch) */
        next = context_refs(w) == UINT32_MAX ? w : w + 1;
    while (!atomic_compare_exchange_weak(&d->contexts, &w, next));
    atomic_fetch_add(&d->sets, 1);
    current_dev = dev;
    current_epoch = context_epoch(next);
    current_ctx = NULL; /* the thread moves to the device's default context, as in CANN */
    return ACL_SUCCESS;
}

/* CANN releases a device only after the work queued on it completed (a task of the device itself
 * cannot wait for it, and does not); sticky stream errors stay for the next synchronize. */
static void wait_for_queued_work(const device *d)
{
    (void)stream_wait_device((int32_t)(d - devices));
}

/* The device a reset names, once the runtime runs; NULL with the error in *rc. */
static device *reset_target(int32_t dev, aclError *rc)
{
    *rc = runtime_ensure_init();
    if (*rc == ACL_SUCCESS && !device_valid(dev))
        *rc = ACL_ERROR_RT_INVALID_DEVICEID;
    return *rc == ACL_SUCCESS ? &devices[dev] : NULL;
}

/* Drops one aclrtSetDevice reference; the last one waits for the device's queued work, then ends
 * the device's default context for every thread bound to it, and its peer access. */
aclError aclrtResetDevice(int32_t dev)
{
    aclError rc;
    device *d = reset_target(dev, &rc);
    if (!d)
        return rc;
    uint64_t w = atomic_load(&d->contexts);
    uint64_t sets_waited = 0;
    bool waited = false;
    for (;;) {
        if (context_refs(w) == 0)
            return ACL_SUCCESS;
        if (context_refs(w) == 1 && (!waited || atomic_load(&d->sets) != sets_waited)) {
            /* the last reference: wait (again, after a set and reset meanwhile), then look again */
            sets_waited = atomic_load(&d->sets);
            wait_for_queued_work(d);
            waited = true;
            w = atomic_load(&d->contexts);
            continue;
        }
        uint64_t next = context_refs(w) == 1 ? contexts_ended(w) : w - 1;
        if (atomic_compare_exchange_weak(&d->contexts, &w, next))
            return ACL_SUCCESS;
    }
}

/* Drops every aclrtSetDevice reference at once, however many there were, after the device's queued
 * work, as aclrtResetDevice's last reference does: work queued by a thread that set the device while
 * it waited is waited for too. */
aclError aclrtResetDeviceForce(int32_t dev)
{
    aclError rc;
    device *d = reset_target(dev, &rc);
    if (!d)
        return rc;
    uint64_t w = atomic_load(&d->contexts);
    uint64_t sets_waited = 0;
    bool waited = false;
    for (;;) {
        if (context_refs(w) == 0)
            return ACL_SUCCESS;
        if (!waited || atomic_load(&d->sets) != sets_waited) {
            sets_waited = atomic_load(&d->sets);
            wait_for_queued_work(d);
            waited = true;
            w = atomic_load(&d->contexts);
            continue;
        }
        if (atomic_compare_exchange_weak(&d->contexts, &w, contexts_ended(w)))
            return ACL_SUCCESS;
    }
}

/* The bound explicit context's device and default stream, read as a seqlock reader reads: its slot may be
 * destroyed and made a new context meanwhile, and then the generation read again has changed. */
static aclError bound_context_read(int32_t *dev, uint64_t *default_stream)
{
    const device_context *c = current_ctx;
    if (!atomic_load(&initialized) ||
        atomic_load_explicit(&c->generation, memory_order_acquire) != current_ctx_generation)
        return ACL_ERROR_RT_CONTEXT_NULL; /* destroyed: no default context to fall back on, as in CANN */
    /* acquire: a value a new context of the slot stored (with release) brings the end of ours with it */
    int32_t d = atomic_load_explicit(&c->device, memory_order_acquire);
    uint64_t s = atomic_load_explicit(&c->default_stream, memory_order_acquire);
    if (atomic_load_explicit(&c->generation, memory_order_relaxed) != current_ctx_generation)
        return ACL_ERROR_RT_CONTEXT_NULL;
    *dev = d;
    *default_stream = s;
    return ACL_SUCCESS;
}

/* Is the thread's default context (no explicit one bound) still the device's? */
static bool default_context_live(void)
{
    return current_ctx == NULL && current_dev >= 0 && atomic_load(&initialized) &&
           context_epoch(atomic_load(&devices[current_dev].contexts)) == current_epoch;
}

aclError device_current_stream(int32_t *dev, uint64_t *default_stream)
{
    if (unlikely(current_ctx != NULL))
        return bound_context_read(dev, default_stream);
    if (!default_context_live())
        return ACL_ERROR_RT_CONTEXT_NULL;
    *dev = current_dev;
    *default_stream = 0;
    return ACL_SUCCESS;
}

aclError device_current(int32_t *dev)
{
    uint64_t unused;
    return device_current_stream(dev, &unused);
}

device_context *device_bound_context(uint32_t *generation)
{
    *generation = current_ctx_generation;
    return current_ctx;
}

void device_bind_context(device_context *ctx, uint32_t generation)
{
    current_ctx = ctx;
    current_ctx_generation = generation;
    current_dev = atomic_load_explicit(&ctx->device, memory_order_relaxed);
}

bool device_current_default_context(int32_t *dev, uint32_t *epoch)
{
    if (!default_context_live())
        return false;
    *dev = current_dev;
    *epoch = current_epoch;
    return true;
}

bool device_bind_default_context(int32_t dev, uint32_t epoch)
{
    uint64_t w = atomic_load(&devices[dev].contexts);
    if (context_refs(w) == 0 || context_epoch(w) != epoch)
        return false;
    current_dev = dev;
    current_epoch = epoch;
    current_ctx = NULL;
    return true;
}

aclError runtime_current_device(int32_t *dev)
{
    aclError rc = runtime_ensure_init();
    return rc != ACL_SUCCESS ? rc : device_current(dev);
}

aclError aclrtGetDevice(int32_t *dev)
{
    if (!dev)
        return ACL_ERROR_INVALID_PARAM;
    return runtime_current_device(dev);
}

aclError aclrtGetDeviceCount(uint32_t *count)
{
    if (!count)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    *count = (uint32_t)config.device_count;
    return ACL_SUCCESS;
}

/* ---- peer access ---- */

aclError aclrtDeviceCanAccessPeer(int32_t *can, int32_t dev, int32_t peer)
{
    if (!can)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    if (dev == peer) /* CANN's ACL layer refuses it before it looks either id up */
        return ACL_ERROR_INVALID_PARAM;
    if (!device_valid(dev) || !device_valid(peer))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    *can = 1; /* every device of the virtual server is linked to every other */
    return ACL_SUCCESS;
}

aclError aclrtDeviceEnablePeerAccess(int32_t peer, uint32_t flags)
{
    if (flags != 0) /* reserved: CANN's ACL layer checks it before it asks for the context */
        return ACL_ERROR_FEATURE_UNSUPPORTED;
    int32_t dev;
    aclError rc = runtime_current_device(&dev);
    if (rc != ACL_SUCCESS)
        return rc;
    if (!device_valid(peer))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    if (peer == dev)
        return ACL_ERROR_INVALID_PARAM;
    /* tagged with the caller's default context: if a reset ended it meanwhile, the enable ends with it; a
     * caller in an explicit context (which no reset ends) takes the device's epoch now */
    uint32_t epoch = current_ctx ? context_epoch(atomic_load(&devices[dev].contexts)) : current_epoch;
    atomic_store(&devices[dev].peer_since[peer], 1u + (uint64_t)epoch);
    return ACL_SUCCESS;
}

aclError aclrtDeviceDisablePeerAccess(int32_t peer)
{
    int32_t dev;
    aclError rc = runtime_current_device(&dev);
    if (rc != ACL_SUCCESS)
        return rc;
    if (!device_valid(peer))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    if (peer == dev)
        return ACL_ERROR_INVALID_PARAM;
    atomic_store(&devices[dev].peer_since[peer], 0);
    return ACL_SUCCESS;
}

/* Whether `dev` enabled access to `peer` in its current epoch. */
static bool peer_enabled_now(int32_t dev, int32_t peer)
{
    const device *d = &devices[dev];
    return atomic_load(&d->peer_since[peer]) == 1u + (uint64_t)context_epoch(atomic_load(&d->contexts));
}

bool device_peer_enabled(int32_t a, int32_t b)
{
    return a == b || peer_enabled_now(a, b) || peer_enabled_now(b, a);
}

/* ---- capacity ---- */

/* Bytes still available to `kind` on a device; called with the device lock held. */
static size_t available(const device *d, mem_kind kind)
{
    const npualloc_config *c = &config;
    size_t paged_cap = c->device_memory - c->huge1g_memory; /* normal + huge share this */
    size_t paged_used = d->used[MEM_NORMAL] + d->used[MEM_HUGE];
    size_t paged_free = paged_used >= paged_cap ? 0 : paged_cap - paged_used;
    switch (kind) {
    case MEM_NORMAL:
        return paged_free;
    case MEM_HUGE: {
        size_t huge_free = d->used[MEM_HUGE] >= c->huge_memory ? 0 : c->huge_memory - d->used[MEM_HUGE];
        return huge_free < paged_free ? huge_free : paged_free;
    }
    case MEM_HUGE1G:
        return c->huge1g_memory - d->used[MEM_HUGE1G];
    case MEM_DDR:
    case MEM_DDR_HUGE:
        return c->ddr_memory - d->used[MEM_DDR] - d->used[MEM_DDR_HUGE];
    default:
        return 0;
    }
}

aclError device_charge(int32_t dev, mem_kind kind, size_t bytes)
{
    device *d = &devices[dev];
    aclError rc = ACL_SUCCESS;
    pthread_mutex_lock(&usage_lock);
    if (bytes > available(d, kind))
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    else
        d->used[kind] += bytes;
    pthread_mutex_unlock(&usage_lock);
    return rc;
}

void device_uncharge(int32_t dev, mem_kind kind, size_t bytes)
{
    device *d = &devices[dev];
    pthread_mutex_lock(&usage_lock);
    d->used[kind] -= bytes;
    pthread_mutex_unlock(&usage_lock);
}

void device_mem_info(int32_t dev, aclrtMemAttr attr, size_t *free_bytes, size_t *total_bytes)
{
    device *d = &devices[dev];
    const npualloc_config *c = &config;
    size_t f = 0, t = 0;
    pthread_mutex_lock(&usage_lock);
    switch (attr) {
    case ACL_DDR_MEM:
    case ACL_DDR_MEM_HUGE:
    case ACL_DDR_MEM_NORMAL:
    case ACL_DDR_MEM_P2P_HUGE:
    case ACL_DDR_MEM_P2P_NORMAL:
        f = available(d, MEM_DDR);
        t = c->ddr_memory;
        break;
    case ACL_HBM_MEM: {
        size_t used = d->used[MEM_NORMAL] + d->used[MEM_HUGE] + d->used[MEM_HUGE1G];
        f = c->device_memory - used;
        t = c->device_memory;
        break;
    }
    case ACL_HBM_MEM_HUGE:
    case ACL_HBM_MEM_P2P_HUGE:
    case ACL_MEM_HUGE:
    case ACL_MEM_P2P_HUGE:
        f = available(d, MEM_HUGE);
        t = c->huge_memory < c->device_memory - c->huge1g_memory ? c->huge_memory
                                                                 : c->device_memory - c->huge1g_memory;
        break;
    case ACL_HBM_MEM_NORMAL:
    case ACL_HBM_MEM_P2P_NORMAL:
    case ACL_MEM_NORMAL:
    case ACL_MEM_P2P_NORMAL:
        f = available(d, MEM_NORMAL);
        t = c->device_memory - c->huge1g_memory;
        break;
    case ACL_HBM_MEM_HUGE1G:
    case ACL_HBM_MEM_P2P_HUGE1G:
    case ACL_MEM_HUGE1G:
    case ACL_MEM_P2P_HUGE1G:
        f = available(d, MEM_HUGE1G);
        t = c->huge1g_memory;
        break;
    default: /* an attribute the device does not have reports 0/0, as CANN does */
        break;
    }
    pthread_mutex_unlock(&usage_lock);
    *free_bytes = f;
    *total_bytes = t;
}
