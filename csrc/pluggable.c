/* pluggable.c - see pluggable.h. */
#include "pluggable.h"

#include <pthread.h>
#include <stdlib.h>

#include "caching.h"
#include "ptr_map.h"

/* What torch_npu's _AllocationMetadata keeps for the free. */
typedef struct allocation {
    size_t size;
    int device;
    uint64_t stream;
} allocation;

_Atomic(npualloc_alloc_fn) pluggable_alloc_fn;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static npualloc_free_fn free_fn; /* written before pluggable_alloc_fn, unchanged while it is set */
static ptr_map allocations;      /* ptr -> allocation */

void pluggable_install(npualloc_alloc_fn alloc, npualloc_free_fn release)
{
    free_fn = release;
    atomic_store_explicit(&pluggable_alloc_fn, alloc, memory_order_release);
}

aclError pluggable_malloc(int32_t device, size_t size, uint64_t stream, void **ptr)
{
    allocation *a = malloc(sizeof *a); /* before the call: a failure then leaks nothing */
    if (!a) {
        *ptr = NULL;
        cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory");
        return ACL_ERROR_BAD_ALLOC;
    }
    *a = (allocation){size, (int)device, stream};
    npualloc_alloc_fn alloc_fn = atomic_load_explicit(&pluggable_alloc_fn, memory_order_acquire);
    void *p = alloc_fn(size, (int)device, (aclrtStream)(uintptr_t)stream);
    *ptr = p;
    if (!p) { /* nothing to free later */
        free(a);
        return ACL_SUCCESS;
    }
    pthread_mutex_lock(&lock);
    ptr_map_entry *e = ptr_map_find_or_insert(&allocations, (uintptr_t)p);
    bool recorded = e && !e->value;
    if (recorded)
        e->value = a;
    pthread_mutex_unlock(&lock);
    if (recorded)
        return ACL_SUCCESS;
    free(a);
    if (e) /* the library handed out a pointer it already had out: the first record stays, as in torch_npu */
        return ACL_SUCCESS;
    free_fn(p, size, (int)device, (aclrtStream)(uintptr_t)stream);
    *ptr = NULL;
    cache_set_error(NPUALLOC_ERR_RUNTIME, "npualloc: out of host memory");
    return ACL_ERROR_BAD_ALLOC;
}

aclError pluggable_free(void *ptr)
{
    pthread_mutex_lock(&lock);
    allocation *a = ptr_map_remove(&allocations, (uintptr_t)ptr);
    pthread_mutex_unlock(&lock);
    if (!a) {
        cache_set_error(NPUALLOC_ERR_RUNTIME, "Trying to free a pointer not allocated here");
        return ACL_ERROR_INVALID_PARAM;
    }
    allocation info = *a;
    free(a);
    free_fn(ptr, info.size, info.device, (aclrtStream)(uintptr_t)info.stream);
    return ACL_SUCCESS;
}

bool pluggable_info(void *ptr, int32_t *device, uint64_t *stream, size_t *size)
{
    pthread_mutex_lock(&lock);
    const allocation *a = ptr_map_get(&allocations, (uintptr_t)ptr);
    if (a) {
        if (device)
            *device = a->device;
        if (stream)
            *stream = a->stream;
        if (size)
            *size = a->size;
    }
    pthread_mutex_unlock(&lock);
    return a != NULL;
}

/* Forgets the allocator and what it handed out (the memory went with the devices). */
static void forget(void)
{
    atomic_store(&pluggable_alloc_fn, NULL);
    for (size_t i = 0; allocations.mask && i <= allocations.mask; i++)
        if (allocations.slots[i].key)
            free(allocations.slots[i].value);
    ptr_map_free(&allocations);
    free_fn = NULL;
}

void pluggable_shutdown(void)
{
    pthread_mutex_lock(&lock);
    forget();
    pthread_mutex_unlock(&lock);
}

void pluggable_atfork_prepare(void) { pthread_mutex_lock(&lock); }

void pluggable_atfork_parent(void) { pthread_mutex_unlock(&lock); }

void pluggable_atfork_child(void)
{
    pthread_mutex_unlock(&lock);
    forget();
}
