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

/* Allocates `size` bytes of device memory as one mapped region (aclrtMalloc family). */
aclError vmm_malloc(int32_t device, size_t size, vmm_kind_choice choice, void **out);
/* Frees memory from vmm_malloc; ACL_ERROR_INVALID_PARAM for any other pointer. */
aclError vmm_free_malloc(void *ptr);

/* A reserved range in a device's address slice (aclrtReserveMemAddress with an explicit device;
 * `at` non-NULL asks for that exact address). */
aclError vmm_reserve(int32_t device, size_t size, void *at, void **out);
/* A physical handle of `kind` charged to `device` (aclrtMallocPhysical without the property
 * checks); it is a normal handle users could name. */
aclError vmm_physical_create(int32_t device, mem_kind kind, size_t size, aclrtDrvMemHandle *out);

typedef enum range_class { RANGE_HOST, RANGE_DEVICE, RANGE_INVALID } range_class;

void vmm_read_lock(void);
void vmm_read_unlock(void);
/* With the read lock held: is [p, p + n) host memory (outside every reservation), device
 * memory (inside one region and mapped throughout), or neither?  For device memory *device
 * receives the owning device (-1 for host-resident physical memory). */
range_class vmm_classify_locked(const void *p, size_t n, int32_t *device);

/* Counters for tests and leak checks. */
void vmm_counts(size_t *handles, size_t *regions, size_t *mappings);

void vmm_atfork_prepare(void);
void vmm_atfork_parent(void);
void vmm_atfork_child(void);
/* Frees every handle, region and mapping. */
void vmm_shutdown(void);

#endif
