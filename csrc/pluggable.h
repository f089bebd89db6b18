/*
 * pluggable.h - a pluggable allocator in place of the caching allocator (torch_npu's
 * NPUPluggableAllocator and change_current_allocator).
 *
 * Once one is current, npualloc_cache_malloc / npualloc_cache_free (and everything built on them:
 * npualloc_allocate, the Python face) call the user's alloc/free functions instead; what each
 * allocation was (size, device, stream) is kept here, so that its free can tell free_fn.  As in
 * torch_npu, the swap is refused once the allocator in use is initialized: the caching allocator
 * after any device's cache started, a pluggable one always (it is initialized when created).
 *
 * Lifetime: until npualloc_shutdown, or a fork (the child has fresh devices, so it starts with
 * the caching allocator again; the library loaded in the child still has its parent's state).
 *
 * Locking: one mutex, a leaf: the user's functions are called with no npualloc lock held.
 */
#ifndef NPUALLOC_PLUGGABLE_H
#define NPUALLOC_PLUGGABLE_H

#include <stdatomic.h>
#include <stdbool.h>

#include "npualloc.h"

/* The current pluggable allocator's alloc function, NULL while the caching allocator is current:
 * the hot paths check this one word.  Its free function is written before it (release). */
extern _Atomic(npualloc_alloc_fn) pluggable_alloc_fn;

static inline bool pluggable_active(void)
{
    return atomic_load_explicit(&pluggable_alloc_fn, memory_order_acquire) != NULL;
}

/* Makes alloc/release current (the caller checked that no allocator is initialized). */
void pluggable_install(npualloc_alloc_fn alloc, npualloc_free_fn release);
/* Allocates through the user's alloc_fn (a NULL result is returned as it is, as torch_npu does);
 * ptr is not NULL and device is valid (the caller checked). */
aclError pluggable_malloc(int32_t device, size_t size, uint64_t stream, void **ptr);
/* Frees through free_fn with what the allocation was; "Trying to free a pointer not allocated
 * here" when ptr did not come from pluggable_malloc. */
aclError pluggable_free(void *ptr);

/* The device, stream and size of a live allocation of the pluggable allocator; false if ptr is
 * not one. */
bool pluggable_info(void *ptr, int32_t *device, uint64_t *stream, size_t *size);

void pluggable_shutdown(void);
void pluggable_atfork_prepare(void);
void pluggable_atfork_parent(void);
void pluggable_atfork_child(void);

#endif
