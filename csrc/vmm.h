/*
 * vmm.h - virtual memory management of the virtual NPU: physical memory handles, reserved
 * address ranges and the mappings between them (aclrtMallocPhysical, aclrtReserveMemAddress,
 * aclrtMapMem, ...), plus the address registry every memory function validates against.
 *
 * Objects:
 *   physical handle  one memory file charged to a device's capacity (or host memory).
 *                    Freeing a mapped handle hides it from users at once and releases the
 *                    memory after its last unmap.
 *   region           a reserved address range.  aclrtMalloc memory is a region whose whole
 *                    range is mapped to its own handle.
 *   mapping          one handle mapped at one address inside one region.  A handle may be
 *                    mapped in several regions at once: the same bytes appear at each.
 *
 * Locking: one reader-writer lock, owned by this module, guards the handle table and the
 * region and mapping trees.  Memory functions hold it for reading while they touch device
 * memory, so an unmap can never pull memory from under a copy.  Device capacity is charged
 * through device.h, whose lock is taken after (never before) this one.
 */
#ifndef NPUALLOC_VMM_H
#define NPUALLOC_VMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "acl_rt.h"
#include "device.h"

#define VMM_GRANULARITY ((size_t)2 << 20)
#define VMM_GRANULARITY_1G ((size_t)1 << 30)

/* How aclrtMalloc-style memory is charged: the first kind that fits wins. */
typedef struct vmm_kind_choice {
    mem_kind kinds[2];
    int count;
} vmm_kind_choice;

/* Who may free a vmm_malloc region: the user (aclrtFree) or the caching allocator (its segments
 * and uncached blocks), so that aclrtFree of an allocator segment is refused instead of pulling
 * the memory from under the allocator. */
typedef enum vmm_owner { VMM_OWNER_USER, VMM_OWNER_ALLOCATOR } vmm_owner;

/* Allocates `size` bytes of device memory as one mapped region (aclrtMalloc family).  `readonly`
 * (ACL_MEM_ACCESS_USER_SPACE_READONLY): the region's pages are mapped read-only, so the process's own
 * writes fault, while the runtime's copies and memsets still write them (vmm_runtime_view_locked). */
aclError vmm_malloc(int32_t device, size_t size, vmm_kind_choice choice, vmm_owner owner, bool readonly,
                    void **out);
/* Frees memory from vmm_malloc by the same owner; ACL_ERROR_INVALID_PARAM for any other pointer. */
aclError vmm_free_malloc(void *ptr, vmm_owner owner);

/* A reserved range in a device's address slice (aclrtReserveMemAddress with an explicit device;
 * `at` non-NULL asks for that exact address). */
aclError vmm_reserve(int32_t device, size_t size, void *at, void **out);
/* A range the runtime reserves for itself (ipc.c maps imported memory there, the caching
 * allocator its expandable segments, graph.c a graph's memory).  Users cannot map into it, unmap
 * it or release it (ACL_ERROR_RT_PARAM_INVALID, as for aclrtMalloc memory): only the *_private
 * calls can, so its owner never loses pages under it nor meets a mapping that is not its own. */
aclError vmm_reserve_private(int32_t device, size_t size, void **out);
/* aclrtMapMem, aclrtUnmapMem and aclrtReleaseMemAddress for private ranges (and only for them). */
aclError vmm_map_private(void *va, size_t size, aclrtDrvMemHandle handle);
aclError vmm_unmap_private(void *va);
/* Leaves host pages behind only [base + lo, base + hi) of a private range whose mappings are all
 * made (lo and hi multiples of the host page size): the rest turns back into reserved,
 * inaccessible memory, and the runtime's copies and sets refuse it (107000) instead of faulting
 * there.  The mappings still count whole; unmapping them later covers the range again. */
aclError vmm_confine_private(void *base, size_t lo, size_t hi);
aclError vmm_release_private(void *base);
/* Shrinks a reservation with nothing mapped to its first `size` bytes (a multiple of
 * VMM_GRANULARITY) and gives the rest back, in one step: no other thread can take the range
 * in between, as it could between a release and a new reservation. */
aclError vmm_reserve_shrink(void *base, size_t size);
/* A physical handle charged to `device` (aclrtMallocPhysical without the property checks), of the first
 * kind in `choice` the device has room for; it is a normal handle users could name. */
aclError vmm_physical_create(int32_t device, vmm_kind_choice choice, size_t size, aclrtDrvMemHandle *out);

typedef enum range_class { RANGE_HOST, RANGE_DEVICE, RANGE_INVALID } range_class;

void vmm_read_lock(void);
void vmm_read_unlock(void);
/* With the read lock held: is [p, p + n) host memory (outside every reservation), device
 * memory (inside one region and mapped throughout), or neither?  For device memory *device
 * receives the owning device (-1 for host-resident physical memory). */
range_class vmm_classify_locked(const void *p, size_t n, int32_t *device);
/* With the read lock held, for device memory vmm_classify_locked accepted: the address through which
 * the runtime's copies and memsets access it, which is `p` itself except in read-only aclrtMalloc
 * memory (a writable view of the same pages). */
void *vmm_runtime_view_locked(const void *p);

/* ---- cross-process sharing (ipc.c) ----
 * A reference to shareable memory that is safe to resolve after the memory was freed: a user
 * handle (by its id) or aclrtMalloc memory (by its base address), each checked against the
 * handle's serial number, which is never reused in the life of the process.  Taking a
 * reference marks the handle shared: when its user frees it (aclrtFreePhysical, aclrtFree),
 * vmm_share_released(serial) is called (without any vmm lock held), so the exporter stops
 * handing it out.  An imported handle is reference counted: each aclrtFreePhysical drops one
 * reference and only the last frees it. */
typedef struct vmm_share_ref {
    uint64_t handle_id;   /* a user handle, or 0 */
    uintptr_t malloc_base; /* aclrtMalloc memory, or 0 */
    uint64_t serial;
} vmm_share_ref;

typedef struct vmm_share_info {
    int32_t device;  /* -1: host memory */
    mem_kind kind;
    size_t size;     /* bytes of the memory file (what an importer maps) */
    bool imported;   /* the handle itself came from another process */
} vmm_share_info;

extern void (*vmm_share_released)(uint64_t serial);
/* References a live user handle (ACL_ERROR_RT_INVALID_HANDLE if not live). */
aclError vmm_share_ref_handle(aclrtDrvMemHandle handle, vmm_share_ref *ref, vmm_share_info *info);
/* References the aclrtMalloc memory that starts at `base` (ACL_ERROR_INVALID_PARAM otherwise). */
aclError vmm_share_ref_malloc(const void *base, vmm_share_ref *ref, vmm_share_info *info);
/* True while the reference's owner has not freed it. */
bool vmm_share_ref_live(const vmm_share_ref *ref);
/* A new descriptor (close-on-exec) for the memory of a reference its owner still holds;
 * ACL_ERROR_RT_INVALID_HANDLE once the owner freed it. */
aclError vmm_share_dup_fd(const vmm_share_ref *ref, int *fd, vmm_share_info *info);
/* Whether a descriptor can be handed out for it: always when the memory file's descriptor was
 * kept; past the descriptor budget it tries the reopen through /proc/self/map_files (and closes
 * it).  ACL_ERROR_RT_RESOURCE_ALLOC_FAIL when that is refused (no CAP_SYS_ADMIN or
 * CAP_CHECKPOINT_RESTORE) or descriptors ran out; ACL_ERROR_RT_INVALID_HANDLE once freed. */
aclError vmm_share_check_reopen(const vmm_share_ref *ref);
/* A user handle for memory received from another process (takes `fd` in every case).  It is
 * charged to no device (the exporter's device carries it) and belongs to `device`. */
aclError vmm_physical_adopt(int32_t device, mem_kind kind, size_t size, int fd, aclrtDrvMemHandle *out,
                            uint64_t *serial);
/* Adds a reference to a live handle with that serial (a repeated import); false if gone. */
bool vmm_handle_retain(uint64_t handle_id, uint64_t serial);

/* Counters for tests and leak checks. */
void vmm_counts(size_t *handles, size_t *regions, size_t *mappings);

void vmm_atfork_prepare(void);
void vmm_atfork_parent(void);
void vmm_atfork_child(void);
/* Frees every handle, region and mapping. */
void vmm_shutdown(void);

#endif
