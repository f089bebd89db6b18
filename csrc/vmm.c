/*
 * vmm.c - physical handles, reserved ranges and mappings (see vmm.h).
 */
#include "vmm.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "avl.h"
#include "common.h"
#include "fault.h"
#include "handle_table.h"
#include "host.h"
#include "va_space.h"

typedef struct phys_handle {
    uint64_t id;        /* handle value while users may name it, 0 after aclrtFreePhysical */
    int32_t device;     /* -1: host-resident memory (pinned host memory) */
    mem_kind kind;      /* capacity kind charged */
    size_t size;        /* bytes as requested (a multiple of the granularity) */
    size_t charged;     /* bytes charged to the device, or to the pinned host count */
    host_memfile mem;
    uint32_t mappings;  /* live mappings; the memory is released when 0 and id == 0 */
    /* cross-process sharing (ipc.c): */
    uint64_t serial;    /* unique for the life of the process: never reused, unlike ids */
    uint32_t refs;      /* imported handles: imports of the same value share it (refcount) */
    bool shared;        /* exported or imported: vmm_share_released is told when users free it */
    bool imported;      /* made by vmm_physical_adopt from another process's memory */
} phys_handle;

typedef struct region {
    avl_node node; /* in vmm.regions, ordered by base */
    uintptr_t base;
    size_t size;
    int32_t device;         /* device of the memory mapped here, -1 while none is */
    uint32_t mappings;
    phys_handle *malloc_handle; /* set when the region is aclrtMalloc memory */
    vmm_owner owner;            /* who may free malloc memory */
    bool runtime_owned;         /* reserved by the runtime for itself (vmm_reserve_private) */
    char *write_view;           /* read-only malloc memory: the writable view of its pages, else NULL */
    /* A private range confined to part of its mappings (vmm_confine_private): only [visible_lo,
     * visible_hi) has host pages behind it; both 0 when all of it does. */
    uintptr_t visible_lo, visible_hi;
} region;

typedef struct mapping {
    avl_node node; /* in vmm.mappings, ordered by va */
    uintptr_t va;
    size_t size;
    region *region;
    phys_handle *handle;
} mapping;

static struct {
    pthread_rwlock_t lock;
    handle_table handles; /* tag 'H' */
    avl_tree regions;
    avl_tree mappings;
    size_t live_handles; /* including freed-but-mapped ones */
    size_t readonly_regions; /* regions with a write_view: while 0, writes need no lookup */
} vmm = {.lock = PTHREAD_RWLOCK_INITIALIZER, .handles = {.tag = 'H'}};

/* Cross-process sharing: handle serial numbers, and who to tell when shared memory is freed. */
static _Atomic uint64_t next_serial = 1;
void (*vmm_share_released)(uint64_t serial);

/* ---- ordering ---- */

static int region_order(const avl_node *a, const avl_node *b)
{
    uintptr_t x = AVL_ENTRY(a, region, node)->base, y = AVL_ENTRY(b, region, node)->base;
    return (x > y) - (x < y);
}

static int region_key_order(const void *key, const avl_node *n)
{
    uintptr_t x = *(const uintptr_t *)key, y = AVL_ENTRY(n, region, node)->base;
    return (x > y) - (x < y);
}

static int mapping_order(const avl_node *a, const avl_node *b)
{
    uintptr_t x = AVL_ENTRY(a, mapping, node)->va, y = AVL_ENTRY(b, mapping, node)->va;
    return (x > y) - (x < y);
}

static int mapping_key_order(const void *key, const avl_node *n)
{
    uintptr_t x = *(const uintptr_t *)key, y = AVL_ENTRY(n, mapping, node)->va;
    return (x > y) - (x < y);
}

/* The region that starts at address a, or NULL. */
static region *region_starting_at(uintptr_t a)
{
    avl_node *n = avl_find(&vmm.regions, &a, region_key_order);
    return n ? AVL_ENTRY(n, region, node) : NULL;
}

/* The region containing address a, or NULL. */
static region *region_containing(uintptr_t a)
{
    avl_node *n = avl_floor(&vmm.regions, &a, region_key_order);
    if (!n)
        return NULL;
    region *r = AVL_ENTRY(n, region, node);
    return a - r->base < r->size ? r : NULL;
}

/* The mapping containing address a, or NULL. */
static mapping *mapping_containing(uintptr_t a)
{
    avl_node *n = avl_floor(&vmm.mappings, &a, mapping_key_order);
    if (!n)
        return NULL;
    mapping *m = AVL_ENTRY(n, mapping, node);
    return a - m->va < m->size ? m : NULL;
}

/* ---- errors ---- */

/* Host errors seen while creating or mapping memory: descriptors or mappings running out
 * are a resource failure; everything else is out of memory. */
static aclError resource_error(int err)
{
    return (err == EMFILE || err == ENFILE || err == ENOMEM) ? ACL_ERROR_RT_RESOURCE_ALLOC_FAIL
                                                             : ACL_ERROR_RT_MEMORY_ALLOCATION;
}

/* A descriptor for sharing that could not be had: out of descriptors, or the reopen through
 * /proc/self/map_files refused (EPERM or EACCES: the process lacks CAP_SYS_ADMIN and
 * CAP_CHECKPOINT_RESTORE) are a resource failure (docs/runtime.md, "Open files"). */
static aclError share_fd_error(int err)
{
    return err == EPERM || err == EACCES ? ACL_ERROR_RT_RESOURCE_ALLOC_FAIL : resource_error(err);
}

/* ---- physical handles ---- */

/* Gives back what handle_create charged: the device's capacity, or the process's pinned host memory. */
static void uncharge(const phys_handle *h)
{
    if (h->device >= 0)
        device_uncharge(h->device, h->kind, h->charged);
    else
        host_pinned_uncharge(h->charged);
}

/* Creates a handle's memory and charges it; the handle is not yet in the table. */
static aclError handle_create(int32_t device, mem_kind kind, size_t size, size_t charge, phys_handle **out)
{
    phys_handle *h = calloc(1, sizeof *h);
    if (!h)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    h->device = device;
    h->kind = kind;
    h->size = size;
    h->mem.fd = -1;
    h->serial = atomic_fetch_add(&next_serial, 1);
    h->refs = 1;
    if (device >= 0) {
        aclError rc = device_charge(device, kind, charge);
        if (rc != ACL_SUCCESS) {
            free(h);
            return rc;
        }
    } else if (!host_pinned_charge(charge)) {
        free(h);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    h->charged = charge;
    int err = host_memfile_create(size, &h->mem);
    if (err) {
        uncharge(h);
        free(h);
        return resource_error(err);
    }
    *out = h;
    return ACL_SUCCESS;
}

/* Releases the memory and the charge.  Called without the vmm lock (syscalls). */
static void handle_destroy(phys_handle *h)
{
    host_memfile_destroy(&h->mem);
    uncharge(h);
    free(h);
}

/* Releases a handle when the whole runtime goes away: the devices' counters are reset by
 * their owner, and after fork the memory is no longer in this process (only the descriptor
 * is). */
static void handle_discard(phys_handle *h, bool in_child)
{
    if (in_child)
        h->mem.home = NULL;
    host_memfile_destroy(&h->mem);
    if (h->device < 0) /* the devices' counters go with the runtime; the process's pinned count stays */
        host_pinned_uncharge(h->charged);
    free(h);
}

/* How a physical-memory property maps onto this runtime: host or device memory, which
 * capacity kind, which granularity. */
typedef struct prop_class {
    bool host;
    mem_kind kind;
    size_t granularity;
} prop_class;

/* Reads the location and memAttr of a property, as CANN's ACL layer does for both calls that take
 * one; aclrtMemGetAllocationGranularity checks nothing else (its runtime property has no handle or
 * allocation type), aclrtMallocPhysical checks those two first. */
static aclError classify_prop(const aclrtPhysicalMemProp *prop, prop_class *out)
{
    bool host;
    switch (prop->location.type) {
    case ACL_MEM_LOCATION_TYPE_HOST:
    case ACL_MEM_LOCATION_TYPE_HOST_NUMA:
        host = true;
        break;
    case ACL_MEM_LOCATION_TYPE_DEVICE:
        host = false;
        break;
    default:
        return ACL_ERROR_INVALID_PARAM;
    }
    out->host = host;
    out->granularity = VMM_GRANULARITY;
    switch (prop->memAttr) {
    case ACL_DDR_MEM_HUGE:
    case ACL_DDR_MEM_NORMAL:
    case ACL_DDR_MEM_P2P_HUGE:
    case ACL_DDR_MEM_P2P_NORMAL:
        if (!host) /* DDR attributes describe host memory only */
            return ACL_ERROR_INVALID_PARAM;
        out->kind = MEM_DDR;
        return ACL_SUCCESS;
    case ACL_HBM_MEM_HUGE:
    case ACL_HBM_MEM_NORMAL: /* CANN allocates HBM "normal" physical memory as huge pages */
        if (host)
            return ACL_ERROR_INVALID_PARAM;
        out->kind = MEM_HUGE;
        return ACL_SUCCESS;
    case ACL_HBM_MEM_HUGE1G:
        if (host)
            return ACL_ERROR_INVALID_PARAM;
        out->kind = MEM_HUGE1G;
        out->granularity = VMM_GRANULARITY_1G;
        return ACL_SUCCESS;
    case ACL_MEM_NORMAL:
    case ACL_MEM_HUGE:
    case ACL_MEM_P2P_NORMAL:
    case ACL_MEM_P2P_HUGE:
        out->kind = MEM_HUGE;
        return ACL_SUCCESS;
    case ACL_MEM_HUGE1G:
    case ACL_MEM_P2P_HUGE1G:
        if (host) /* 1 GiB pages are device memory only (CANN's driver: not supported on the host side) */
            return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
        out->kind = MEM_HUGE1G;
        out->granularity = VMM_GRANULARITY_1G;
        return ACL_SUCCESS;
    default: /* ACL_DDR_MEM / ACL_HBM_MEM, ACL_HBM_MEM_P2P_* and unknown values: not in CANN's table */
        return ACL_ERROR_INVALID_PARAM;
    }
}

aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, aclrtMemGranularityOptions option,
                                          size_t *granularity)
{
    if (!prop || !granularity)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    prop_class pc;
    if ((rc = classify_prop(prop, &pc)) != ACL_SUCCESS)
        return rc;
    if (!pc.host && !device_valid((int32_t)prop->location.id))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    /* The ACL layer passes the option and the reserved field on; CANN's driver refuses them. */
    if (prop->reserve != 0)
        return ACL_ERROR_RT_PARAM_INVALID;
    if (option != ACL_RT_MEM_ALLOC_GRANULARITY_MINIMUM && option != ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    *granularity = pc.granularity;
    return ACL_SUCCESS;
}

aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size, const aclrtPhysicalMemProp *prop,
                             uint64_t flags)
{
    if (!handle || !prop || size == 0 || flags != 0 || prop->handleType != ACL_MEM_HANDLE_TYPE_NONE ||
        prop->allocationType != ACL_MEM_ALLOCATION_TYPE_PINNED)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    prop_class pc;
    if ((rc = classify_prop(prop, &pc)) != ACL_SUCCESS)
        return rc;
    int32_t device = pc.host ? -1 : (int32_t)prop->location.id;
    if (!pc.host && !device_valid(device))
        return ACL_ERROR_RT_INVALID_DEVICEID;
    if (prop->reserve != 0 || size % pc.granularity != 0) /* CANN's driver checks both */
        return ACL_ERROR_RT_PARAM_INVALID;
    return vmm_physical_create(device, (vmm_kind_choice){{pc.kind}, 1}, size, handle);
}

/* A handle of the first kind in `choice` the device has room for (`size` rounded up to that kind's page
 * when `round_to_page`).  An injected device-allocation fault fails the allocation, not one kind of it:
 * HUGE_FIRST's fallback to normal pages would otherwise absorb it. */
static aclError handle_create_first(int32_t device, vmm_kind_choice choice, size_t size, bool round_to_page,
                                    phys_handle **out)
{
    if (device >= 0 && fault_fires(NPUALLOC_FAULT_DEVICE_ALLOC))
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    aclError rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    for (int i = 0; i < choice.count && rc == ACL_ERROR_RT_MEMORY_ALLOCATION; i++) {
        size_t page = round_to_page ? mem_kind_page_size(choice.kinds[i]) : 1;
        if (add_overflows(size, page))
            break;
        size_t bytes = round_up(size, page);
        rc = handle_create(device, choice.kinds[i], bytes, bytes, out);
    }
    return rc;
}

aclError vmm_physical_create(int32_t device, vmm_kind_choice choice, size_t size, aclrtDrvMemHandle *out)
{
    phys_handle *h = NULL;
    aclError rc = handle_create_first(device, choice, size, false, &h);
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_rwlock_wrlock(&vmm.lock);
    h->id = handle_table_insert(&vmm.handles, h);
    if (h->id)
        vmm.live_handles++;
    pthread_rwlock_unlock(&vmm.lock);
    if (!h->id) {
        handle_destroy(h);
        return ACL_ERROR_RT_RESOURCE_ALLOC_FAIL;
    }
    *out = (aclrtDrvMemHandle)(uintptr_t)h->id;
    return ACL_SUCCESS;
}

aclError aclrtFreePhysical(aclrtDrvMemHandle handle)
{
    if (!handle)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    pthread_rwlock_wrlock(&vmm.lock);
    phys_handle *h = handle_table_get(&vmm.handles, (uint64_t)(uintptr_t)handle);
    /* sharing: an imported handle imported n times in this process needs n frees */
    if (h && h->refs > 1) {
        h->refs--;
        pthread_rwlock_unlock(&vmm.lock);
        return ACL_SUCCESS;
    }
    h = handle_table_remove(&vmm.handles, (uint64_t)(uintptr_t)handle);
    bool release_now = false, shared = false;
    uint64_t serial = 0;
    if (h) {
        h->id = 0;
        shared = h->shared;
        serial = h->serial;
        release_now = h->mappings == 0;
        if (release_now)
            vmm.live_handles--;
    }
    pthread_rwlock_unlock(&vmm.lock);
    if (!h)
        return ACL_ERROR_RT_INVALID_HANDLE;
    if (shared && vmm_share_released) /* sharing: no new imports of this memory from now on */
        vmm_share_released(serial);
    if (release_now)
        handle_destroy(h);
    return ACL_SUCCESS;
}

/* ---- reserved ranges ---- */

static aclError region_insert(uintptr_t base, size_t size, region **out)
{
    region *r = calloc(1, sizeof *r);
    if (!r)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    r->base = base;
    r->size = size;
    r->device = -1;
    avl_insert(&vmm.regions, &r->node, region_order);
    *out = r;
    return ACL_SUCCESS;
}

static aclError reserve_range(int32_t device, size_t size, void *at, bool runtime_owned, void **out)
{
    if (size > ((size_t)1 << 50))
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (fault_fires(NPUALLOC_FAULT_RESERVE))
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;
    size = round_up(size, VMM_GRANULARITY);
    size_t align = size >= VMM_GRANULARITY_1G ? VMM_GRANULARITY_1G : VMM_GRANULARITY;
    uintptr_t start;
    int err = va_alloc(device, size, align, (uintptr_t)at, &start);
    if (err)
        return err == EEXIST ? ACL_ERROR_RT_PARAM_INVALID : ACL_ERROR_RT_MEMORY_ALLOCATION;
    pthread_rwlock_wrlock(&vmm.lock);
    region *r;
    aclError rc = region_insert(start, size, &r);
    if (rc == ACL_SUCCESS)
        r->runtime_owned = runtime_owned;
    pthread_rwlock_unlock(&vmm.lock);
    if (rc != ACL_SUCCESS) {
        va_free(start, size);
        return rc;
    }
    *out = (void *)start;
    return ACL_SUCCESS;
}

aclError vmm_reserve(int32_t device, size_t size, void *at, void **out)
{
    return reserve_range(device, size, at, false, out);
}

aclError vmm_reserve_private(int32_t device, size_t size, void **out)
{
    return reserve_range(device, size, NULL, true, out);
}

aclError vmm_reserve_shrink(void *base, size_t size)
{
    uintptr_t at = (uintptr_t)base;
    pthread_rwlock_wrlock(&vmm.lock);
    region *r = region_starting_at(at);
    if (!r || r->malloc_handle || r->mappings || size == 0 || size % VMM_GRANULARITY || size > r->size) {
        pthread_rwlock_unlock(&vmm.lock);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    if (size < r->size)
        va_free(r->base + size, r->size - size);
    r->size = size;
    pthread_rwlock_unlock(&vmm.lock);
    return ACL_SUCCESS;
}

aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr, uint64_t flags)
{
    if (!virPtr || size == 0 || alignment != 0 || flags > 1)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    /* CANN's rule for a chosen address: aligned, to 1 GiB for more than 1 GiB. */
    if (expectPtr && (uintptr_t)expectPtr % (size > VMM_GRANULARITY_1G ? VMM_GRANULARITY_1G : VMM_GRANULARITY) != 0)
        return ACL_ERROR_INVALID_PARAM;
    /* The range lives in the current device's slice (device 0 without a context). */
    int32_t dev = 0;
    if (device_current(&dev) != ACL_SUCCESS)
        dev = 0;
    return vmm_reserve(dev, size, expectPtr, virPtr);
}

/* Releases the reservation at `base` if it has nothing mapped and `runtime_owned` says who
 * reserved it. */
static aclError release_range(uintptr_t base, bool runtime_owned)
{
    pthread_rwlock_wrlock(&vmm.lock);
    region *r = region_starting_at(base);
    /* Only a reservation with nothing mapped may go; aclrtMalloc memory goes with aclrtFree. */
    if (!r || r->malloc_handle || r->mappings || r->runtime_owned != runtime_owned) {
        pthread_rwlock_unlock(&vmm.lock);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    avl_remove(&vmm.regions, &r->node);
    va_free(r->base, r->size);
    pthread_rwlock_unlock(&vmm.lock);
    free(r);
    return ACL_SUCCESS;
}

aclError aclrtReleaseMemAddress(void *virPtr)
{
    if (!virPtr)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    return release_range((uintptr_t)virPtr, false);
}

aclError vmm_release_private(void *base) { return release_range((uintptr_t)base, true); }

/* ---- mappings ---- */

/* Maps `handle` at `virPtr`, inside a reservation that `runtime_owned` says who made. */
static aclError map_range(void *virPtr, size_t size, aclrtDrvMemHandle handle, bool runtime_owned)
{
    aclError rc = ACL_SUCCESS;
    uintptr_t va = (uintptr_t)virPtr;
    mapping *m = calloc(1, sizeof *m);
    if (!m)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    pthread_rwlock_wrlock(&vmm.lock);
    phys_handle *h = handle_table_get(&vmm.handles, (uint64_t)(uintptr_t)handle);
    region *r = region_containing(va);
    if (!h) {
        rc = ACL_ERROR_RT_INVALID_HANDLE;
    } else if (size != h->size || !r || r->malloc_handle || r->runtime_owned != runtime_owned ||
               (va - r->base) % VMM_GRANULARITY != 0 || size > r->size - (va - r->base) ||
               (h->kind == MEM_HUGE1G && va % VMM_GRANULARITY_1G != 0)) { /* a page maps at its own alignment */
        rc = ACL_ERROR_RT_PARAM_INVALID;
    } else if (r->device >= 0 && h->device >= 0 && r->device != h->device) {
        rc = ACL_ERROR_RT_PARAM_INVALID; /* one range holds memory of one device only */
    } else {
        /* The range must be free: no mapping may start inside it or cover its start. */
        uintptr_t last = va + size - 1;
        avl_node *below = avl_floor(&vmm.mappings, &last, mapping_key_order);
        if (below) {
            mapping *prev = AVL_ENTRY(below, mapping, node);
            if (prev->va + prev->size > va)
                rc = ACL_ERROR_RT_PARAM_INVALID;
        }
    }
    if (rc == ACL_SUCCESS) {
        int err = host_map(virPtr, &h->mem);
        if (err)
            rc = resource_error(err);
    }
    if (rc == ACL_SUCCESS) {
        m->va = va;
        m->size = size;
        m->region = r;
        m->handle = h;
        avl_insert(&vmm.mappings, &m->node, mapping_order);
        h->mappings++;
        r->mappings++;
        if (h->device >= 0)
            r->device = h->device;
        m = NULL;
    }
    pthread_rwlock_unlock(&vmm.lock);
    free(m);
    return rc;
}

aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle, uint64_t flags)
{
    if (!virPtr || !handle || size == 0 || offset != 0 || flags != 0)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    return map_range(virPtr, size, handle, false);
}

aclError vmm_map_private(void *va, size_t size, aclrtDrvMemHandle handle)
{
    return map_range(va, size, handle, true);
}

/* Removes a mapping (write lock held); returns the handle to destroy once unlocked, if any. */
static phys_handle *mapping_remove_locked(mapping *m)
{
    phys_handle *h = m->handle;
    region *r = m->region;
    host_unmap((void *)m->va, m->size);
    avl_remove(&vmm.mappings, &m->node);
    if (--r->mappings == 0 && !r->malloc_handle)
        r->device = -1;
    free(m);
    if (--h->mappings == 0 && h->id == 0) {
        vmm.live_handles--;
        return h;
    }
    return NULL;
}

/* Unmaps the mapping that starts at `va`, in a reservation that `runtime_owned` says who made. */
static aclError unmap_at(uintptr_t va, bool runtime_owned)
{
    aclError rc = ACL_SUCCESS;
    pthread_rwlock_wrlock(&vmm.lock);
    avl_node *n = avl_find(&vmm.mappings, &va, mapping_key_order);
    mapping *m = n ? AVL_ENTRY(n, mapping, node) : NULL;
    phys_handle *dead = NULL;
    if (!m || m->region->malloc_handle || m->region->runtime_owned != runtime_owned)
        rc = ACL_ERROR_RT_PARAM_INVALID;
    else
        dead = mapping_remove_locked(m);
    pthread_rwlock_unlock(&vmm.lock);
    if (dead)
        handle_destroy(dead);
    return rc;
}

aclError aclrtUnmapMem(void *virPtr)
{
    if (!virPtr)
        return ACL_ERROR_INVALID_PARAM;
    aclError rc = runtime_ensure_init();
    if (rc != ACL_SUCCESS)
        return rc;
    return unmap_at((uintptr_t)virPtr, false);
}

aclError vmm_unmap_private(void *va) { return unmap_at((uintptr_t)va, true); }

aclError vmm_confine_private(void *base, size_t lo, size_t hi)
{
    uintptr_t at = (uintptr_t)base;
    aclError rc = ACL_SUCCESS;
    pthread_rwlock_wrlock(&vmm.lock);
    region *r = region_starting_at(at);
    if (!r || !r->runtime_owned || r->visible_hi || lo >= hi || hi > r->size)
        rc = ACL_ERROR_RT_PARAM_INVALID;
    else if ((lo > 0 && host_unmap(base, lo) != 0) || (hi < r->size && host_unmap((char *)base + hi, r->size - hi) != 0))
        rc = ACL_ERROR_RT_RESOURCE_ALLOC_FAIL;
    if (rc == ACL_SUCCESS) {
        r->visible_lo = at + lo;
        r->visible_hi = at + hi;
    }
    pthread_rwlock_unlock(&vmm.lock);
    return rc;
}

/* ---- aclrtMalloc memory ---- */

aclError vmm_malloc(int32_t device, size_t size, vmm_kind_choice choice, vmm_owner owner, bool readonly,
                    void **out)
{
    phys_handle *h = NULL;
    aclError rc = handle_create_first(device, choice, size, true, &h);
    if (rc != ACL_SUCCESS)
        return rc;
    size_t span = round_up(h->mem.size, VA_UNIT);
    uintptr_t start;
    int err = va_alloc(device, span, VA_UNIT, 0, &start);
    if (err) {
        handle_destroy(h);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    void *base = (void *)start, *write_view = NULL;
    err = host_map(base, &h->mem);
    if (err == 0 && readonly && (err = host_protect_readonly(base, &h->mem, &write_view)) != 0)
        host_unmap(base, h->mem.size);
    if (err != 0) {
        va_free(start, span);
        handle_destroy(h);
        return resource_error(err);
    }
    mapping *m = calloc(1, sizeof *m);
    region *r = NULL;
    pthread_rwlock_wrlock(&vmm.lock);
    if (m)
        rc = region_insert(start, span, &r);
    else
        rc = ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (rc == ACL_SUCCESS) {
        r->malloc_handle = h;
        r->owner = owner;
        r->device = device;
        r->mappings = 1;
        r->write_view = write_view;
        vmm.readonly_regions += readonly;
        m->va = r->base;
        m->size = h->mem.size;
        m->region = r;
        m->handle = h;
        avl_insert(&vmm.mappings, &m->node, mapping_order);
        h->mappings = 1;
        vmm.live_handles++;
    }
    pthread_rwlock_unlock(&vmm.lock);
    if (rc != ACL_SUCCESS) {
        free(m);
        host_unmap(base, h->mem.size);
        va_free(start, span);
        handle_destroy(h);
        return rc;
    }
    *out = base;
    return ACL_SUCCESS;
}

aclError vmm_free_malloc(void *ptr, vmm_owner owner)
{
    uintptr_t base = (uintptr_t)ptr;
    pthread_rwlock_wrlock(&vmm.lock);
    region *r = region_starting_at(base);
    if (!r || !r->malloc_handle || r->owner != owner) {
        pthread_rwlock_unlock(&vmm.lock);
        return ACL_ERROR_INVALID_PARAM;
    }
    phys_handle *h = r->malloc_handle;
    bool shared = h->shared; /* sharing: exported with an IPC key */
    uint64_t serial = h->serial;
    avl_node *mn = avl_find(&vmm.mappings, &base, mapping_key_order);
    avl_remove(&vmm.mappings, mn);
    free(AVL_ENTRY(mn, mapping, node));
    avl_remove(&vmm.regions, &r->node);
    vmm.readonly_regions -= r->write_view != NULL;
    vmm.live_handles--;
    host_unmap((void *)r->base, h->mem.size);
    va_free(r->base, r->size);
    pthread_rwlock_unlock(&vmm.lock);
    free(r);
    if (shared && vmm_share_released)
        vmm_share_released(serial);
    handle_destroy(h);
    return ACL_SUCCESS;
}

/* ---- cross-process sharing (used by ipc.c; see vmm.h) ---- */

static void share_info_of(const phys_handle *h, vmm_share_info *info)
{
    if (!info)
        return;
    info->device = h->device;
    info->kind = h->kind;
    info->size = h->mem.size;
    info->imported = h->imported;
}

aclError vmm_share_ref_handle(aclrtDrvMemHandle handle, vmm_share_ref *ref, vmm_share_info *info)
{
    pthread_rwlock_wrlock(&vmm.lock);
    phys_handle *h = handle_table_get(&vmm.handles, (uint64_t)(uintptr_t)handle);
    if (h) {
        h->shared = true;
        ref->handle_id = h->id;
        ref->malloc_base = 0;
        ref->serial = h->serial;
        share_info_of(h, info);
    }
    pthread_rwlock_unlock(&vmm.lock);
    return h ? ACL_SUCCESS : ACL_ERROR_RT_INVALID_HANDLE;
}

aclError vmm_share_ref_malloc(const void *base, vmm_share_ref *ref, vmm_share_info *info)
{
    uintptr_t b = (uintptr_t)base;
    pthread_rwlock_wrlock(&vmm.lock);
    region *r = region_starting_at(b);
    phys_handle *h = r ? r->malloc_handle : NULL;
    if (h) {
        h->shared = true;
        ref->handle_id = 0;
        ref->malloc_base = b;
        ref->serial = h->serial;
        share_info_of(h, info);
    }
    pthread_rwlock_unlock(&vmm.lock);
    return h ? ACL_SUCCESS : ACL_ERROR_INVALID_PARAM;
}

/* The handle a reference names while its owner has not freed it (read lock held). */
static phys_handle *share_ref_resolve_locked(const vmm_share_ref *ref)
{
    phys_handle *h = NULL;
    if (ref->handle_id) {
        h = handle_table_get(&vmm.handles, ref->handle_id);
    } else if (ref->malloc_base) {
        region *r = region_starting_at(ref->malloc_base);
        h = r ? r->malloc_handle : NULL;
    }
    return h && h->serial == ref->serial ? h : NULL;
}

bool vmm_share_ref_live(const vmm_share_ref *ref)
{
    pthread_rwlock_rdlock(&vmm.lock);
    bool live = share_ref_resolve_locked(ref) != NULL;
    pthread_rwlock_unlock(&vmm.lock);
    return live;
}

aclError vmm_share_dup_fd(const vmm_share_ref *ref, int *fd, vmm_share_info *info)
{
    pthread_rwlock_rdlock(&vmm.lock);
    phys_handle *h = share_ref_resolve_locked(ref);
    int err = 0;
    if (h) {
        err = host_memfile_dup_fd(&h->mem, fd);
        share_info_of(h, info);
    }
    pthread_rwlock_unlock(&vmm.lock);
    if (!h)
        return ACL_ERROR_RT_INVALID_HANDLE;
    return err ? share_fd_error(err) : ACL_SUCCESS;
}

aclError vmm_share_check_reopen(const vmm_share_ref *ref)
{
    pthread_rwlock_rdlock(&vmm.lock);
    phys_handle *h = share_ref_resolve_locked(ref);
    int err = 0, fd = -1;
    if (h && h->mem.fd < 0)
        err = host_memfile_dup_fd(&h->mem, &fd);
    pthread_rwlock_unlock(&vmm.lock);
    if (fd >= 0)
        close(fd);
    if (!h)
        return ACL_ERROR_RT_INVALID_HANDLE;
    return err ? share_fd_error(err) : ACL_SUCCESS;
}

aclError vmm_physical_adopt(int32_t device, mem_kind kind, size_t size, int fd, aclrtDrvMemHandle *out,
                            uint64_t *serial)
{
    phys_handle *h = calloc(1, sizeof *h);
    if (!h) {
        close(fd);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    h->device = device;
    h->kind = kind;
    h->size = size;
    h->charged = 0; /* the exporter's device carries the memory */
    h->serial = atomic_fetch_add(&next_serial, 1);
    h->refs = 1;
    h->shared = true;
    h->imported = true;
    int err = host_memfile_adopt(fd, size, &h->mem);
    if (err) {
        close(fd);
        free(h);
        return err == EINVAL ? ACL_ERROR_RT_IPC_ERROR : resource_error(err);
    }
    pthread_rwlock_wrlock(&vmm.lock);
    h->id = handle_table_insert(&vmm.handles, h);
    if (h->id)
        vmm.live_handles++;
    pthread_rwlock_unlock(&vmm.lock);
    if (!h->id) {
        handle_destroy(h);
        return ACL_ERROR_RT_RESOURCE_ALLOC_FAIL;
    }
    *out = (aclrtDrvMemHandle)(uintptr_t)h->id;
    if (serial)
        *serial = h->serial;
    return ACL_SUCCESS;
}

bool vmm_handle_retain(uint64_t handle_id, uint64_t serial)
{
    pthread_rwlock_wrlock(&vmm.lock);
    phys_handle *h = handle_table_get(&vmm.handles, handle_id);
    bool ok = h && h->serial == serial;
    if (ok)
        h->refs++;
    pthread_rwlock_unlock(&vmm.lock);
    return ok;
}

/* ---- validation for memory functions ---- */

void vmm_read_lock(void) { pthread_rwlock_rdlock(&vmm.lock); }
void vmm_read_unlock(void) { pthread_rwlock_unlock(&vmm.lock); }

range_class vmm_classify_locked(const void *p, size_t n, int32_t *device)
{
    uintptr_t start = (uintptr_t)p;
    if (n == 0 || add_overflows(start, n - 1))
        return RANGE_INVALID;
    uintptr_t last = start + n - 1;
    region *r = region_containing(start);
    if (!r) /* host memory, unless it touches device address space */
        return va_overlaps(start, n) ? RANGE_INVALID : RANGE_HOST;
    if (last - r->base >= r->size || (r->visible_hi && (start < r->visible_lo || last >= r->visible_hi)))
        return RANGE_INVALID;
    /* Walk the mappings covering [start, last]: they must be contiguous. */
    mapping *m = mapping_containing(start);
    while (m) {
        if (last - m->va < m->size) {
            *device = r->device;
            return RANGE_DEVICE;
        }
        uintptr_t end = m->va + m->size;
        avl_node *nx = avl_next(&m->node);
        m = nx ? AVL_ENTRY(nx, mapping, node) : NULL;
        if (m && m->va != end)
            m = NULL;
    }
    return RANGE_INVALID;
}

void *vmm_runtime_view_locked(const void *p)
{
    if (likely(vmm.readonly_regions == 0))
        return (void *)(uintptr_t)p;
    const region *r = region_containing((uintptr_t)p);
    return r && r->write_view ? r->write_view + ((uintptr_t)p - r->base) : (void *)(uintptr_t)p;
}

/* ---- bookkeeping ---- */

void vmm_counts(size_t *handles, size_t *regions, size_t *mappings)
{
    pthread_rwlock_rdlock(&vmm.lock);
    *handles = vmm.live_handles;
    *regions = vmm.regions.count;
    *mappings = vmm.mappings.count;
    pthread_rwlock_unlock(&vmm.lock);
}

/* Frees every object (the devices' counters are reset by device.c).  `in_child`: after fork
 * the memory itself is already gone from this process, so only descriptors and metadata are
 * released. */
static void free_everything(bool in_child)
{
    while (vmm.mappings.root) {
        mapping *m = AVL_ENTRY(vmm.mappings.root, mapping, node);
        avl_remove(&vmm.mappings, &m->node);
        phys_handle *h = m->handle;
        if (--h->mappings == 0 && h->id == 0)
            handle_discard(h, in_child);
        free(m);
    }
    while (vmm.regions.root) {
        region *r = AVL_ENTRY(vmm.regions.root, region, node);
        avl_remove(&vmm.regions, &r->node);
        free(r); /* the address window goes as a whole (va_space.c) */
    }
    for (uint32_t i = 0; i < vmm.handles.capacity; i++) {
        phys_handle *h = vmm.handles.slots[i].object;
        if (h)
            handle_discard(h, in_child);
    }
    handle_table_destroy(&vmm.handles);
    vmm.live_handles = 0;
    vmm.readonly_regions = 0;
}

void vmm_atfork_prepare(void) { pthread_rwlock_wrlock(&vmm.lock); }
void vmm_atfork_parent(void) { pthread_rwlock_unlock(&vmm.lock); }

void vmm_atfork_child(void)
{
    rwlock_reset_in_child(&vmm.lock);
    free_everything(true);
}

void vmm_shutdown(void)
{
    pthread_rwlock_wrlock(&vmm.lock);
    free_everything(false);
    pthread_rwlock_unlock(&vmm.lock);
}
